"""Swap compressed activations to host memory in forward and prefetch them back in backward (GACT's L2).

Forward: each compressed tensor's buffers are copied into one pooled host buffer on a swap-out stream that
first waits for the compute stream (an event), so the copy never reads unfinished data; the device buffers
are marked used by that stream (``record_stream``) so the allocator does not reuse them before the copy ends.

Backward: fetching tensor ``i`` waits (an event) for its swap-in copy, issued earlier as a prefetch or now,
and then prefetches tensor ``i - 1``, the one backward needs next, on a swap-in stream that first waits for
that tensor's swap-out event. Host buffers come from a pool of power-of-two size classes reused across steps;
a buffer returns to the pool when autograd frees the saved tensor that owns it.

On a machine without CUDA the same code runs with synchronous copies (host to host: there is no device memory
to free), so ordering, reuse and integrity are testable anywhere. ``events`` records what happened, in order.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field

import torch

from .codecs.base import Packed
from .cuda.launcher import BufferLayout, OneBuffer

_ALIGN = 64  # bytes: every buffer starts aligned, so uint8 slices can be viewed as any dtype
_MIN_CLASS = 4096


def _size_class(nbytes: int) -> int:
    return max(_MIN_CLASS, 1 << (max(nbytes, 1) - 1).bit_length())


class HostBufferPool:
    """Host (pinned when CUDA is present) byte buffers by power-of-two size class, reused across steps.

    At most ``max_idle_bytes`` of released buffers are kept for reuse; the rest are freed.
    """

    def __init__(self, max_idle_bytes: int = 1 << 30, pin_memory: bool | None = None):
        self.max_idle_bytes = max_idle_bytes
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._idle: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()  # steps of several threads share the pool
        self.idle_bytes = 0
        self.allocations = 0
        self.reuses = 0

    def acquire(self, nbytes: int) -> torch.Tensor:
        size = _size_class(nbytes)
        with self._lock:
            free = self._idle.get(size)
            if free:
                self.reuses += 1
                self.idle_bytes -= size
                return free.pop()
            self.allocations += 1
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pin_memory)

    def release(self, buffer: torch.Tensor) -> None:
        size = buffer.numel()
        with self._lock:
            if self.idle_bytes + size <= self.max_idle_bytes:
                self._idle.setdefault(size, []).append(buffer)
                self.idle_bytes += size


@dataclass(eq=False)
class SwapHandle:
    """One compressed tensor living in host memory."""

    store: "SwapStore"
    key: tuple[int, int]  # (step, index): backward prefetches (step, index - 1)
    host: torch.Tensor
    # per buffer (name, dtype, shape, offset, nbytes), or a OneBuffer's layout: its one allocation is copied whole
    layout: list[tuple[str, torch.dtype, torch.Size, int, int]] | BufferLayout
    packed: Packed  # metadata only: its buffers are empty
    swapped_out: object = None  # CUDA event: the host copy is complete
    incoming: tuple | None = field(default=None, repr=False)  # (device bytes, CUDA event) of a swap-in

    def fetch(self) -> Packed:
        return self.store.get(self)


class SwapStore:
    """Moves ``Packed`` buffers to host memory and back, with prefetch one tensor ahead in backward."""

    def __init__(self, pool: HostBufferPool | None = None, record_events: bool = False):
        self.pool = pool if pool is not None else HostBufferPool()
        self.events: list[tuple[str, tuple[int, int]]] | None = [] if record_events else None
        self._handles: dict[tuple[int, int], weakref.ref] = {}
        self._streams: dict[torch.device, tuple] = {}

    def _log(self, what: str, key: tuple[int, int]) -> None:
        if self.events is not None:
            self.events.append((what, key))

    def _cuda_streams(self, device: torch.device):
        streams = self._streams.get(device)
        if streams is None:  # two threads may both build a pair; setdefault keeps one for everybody
            streams = self._streams.setdefault(device, (torch.cuda.Stream(device), torch.cuda.Stream(device)))
        return streams

    def put(self, step: int, index: int, packed: Packed) -> SwapHandle:
        buffers = packed.buffers
        if type(buffers) is OneBuffer:  # one copy of the one allocation
            layout = buffers.layout
            host = self.pool.acquire(layout.total)
            sources = [(buffers.data, host[:layout.total])]
        else:
            layout, offset = [], 0
            for name, buf in buffers.items():
                nbytes = buf.numel() * buf.element_size()
                layout.append((name, buf.dtype, buf.shape, offset, nbytes))
                offset += -(-nbytes // _ALIGN) * _ALIGN
            host = self.pool.acquire(offset)
            sources = [(buffers[name].reshape(-1).view(torch.uint8), host[o:o + n]) for name, _, _, o, n in layout]
        meta = Packed(packed.codec, packed.shape, packed.dtype, packed.device, {}, dict(packed.meta))
        handle = SwapHandle(self, (step, index), host, layout, meta)
        weakref.finalize(handle, self.pool.release, host)
        device = packed.device
        if device.type == "cuda":
            compute = torch.cuda.current_stream(device)
            swap_out, _ = self._cuda_streams(device)
            ready = torch.cuda.Event()
            ready.record(compute)
            with torch.cuda.stream(swap_out):
                swap_out.wait_event(ready)
                for src, dst in sources:
                    dst.copy_(src, non_blocking=True)
                    src.record_stream(swap_out)
                handle.swapped_out = torch.cuda.Event()
                handle.swapped_out.record(swap_out)
        else:
            for src, dst in sources:
                dst.copy_(src)
        self._handles[handle.key] = weakref.ref(handle)
        self._log("swap_out", handle.key)
        return handle

    def _swap_in(self, handle: SwapHandle, why: str) -> None:
        layout = handle.layout
        total = layout.total if type(layout) is BufferLayout else layout[-1][3] + layout[-1][4] if layout else 0
        device = handle.packed.device
        if device.type == "cuda":
            _, swap_in = self._cuda_streams(device)
            with torch.cuda.stream(swap_in):
                swap_in.wait_event(handle.swapped_out)  # never read host bytes still being written
                data = torch.empty(total, dtype=torch.uint8, device=device)
                data.copy_(handle.host[:total], non_blocking=True)
                arrived = torch.cuda.Event()
                arrived.record(swap_in)
        else:
            data, arrived = handle.host[:total].clone(), None
        handle.incoming = (data, arrived)
        self._log(why, handle.key)

    def get(self, handle: SwapHandle) -> Packed:
        """The compressed tensor back on its device; prefetches the one backward needs next."""
        if handle.incoming is None:
            self._swap_in(handle, "swap_in")
        data, arrived = handle.incoming
        handle.incoming = None
        if arrived is not None:
            compute = torch.cuda.current_stream(handle.packed.device)
            compute.wait_event(arrived)
            data.record_stream(compute)
        if type(handle.layout) is BufferLayout:
            buffers = OneBuffer(data, handle.layout)
        else:
            buffers = {name: data[o:o + n].view(dtype).view(shape) for name, dtype, shape, o, n in handle.layout}
        self._log("use", handle.key)
        step, index = handle.key
        previous = self._handles.get((step, index - 1))
        nxt = previous() if previous is not None else None
        if nxt is not None and nxt.incoming is None:
            self._swap_in(nxt, "prefetch")
        p = handle.packed
        return Packed(p.codec, p.shape, p.dtype, p.device, buffers, dict(p.meta))

    def end_step(self, step: int) -> None:
        """Forget the prefetch map of ``step`` (handles stay valid while autograd holds them)."""
        for key in list(self._handles):  # a snapshot: other threads' steps add handles meanwhile
            if key[0] == step and self._handles[key]() is None:
                del self._handles[key]
