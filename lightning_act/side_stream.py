"""Encodes on a side CUDA stream, so compression overlaps the forward's next ops (issue #20 item 4).

A GEMM or a convolution leaves the memory system mostly idle; an encode is memory-bound. Run on the compute
stream, every encode delays the next op; run on a side stream, it proceeds beside it. The ordering rules,
each one a line below:

* the side stream waits for the compute stream before each encode (the saved tensor was just produced there);
* everything the encode allocates is allocated on the side stream (``torch.cuda.stream(side)``), so its
  temporaries are freed in the side stream's order;
* the saved tensor is marked used by the side stream (``record_stream``): the compute stream's allocator does
  not hand its memory out again before the encode has read it, even when autograd drops it at once;
* before the first decode after new encodes, the stream that decodes waits for the side stream (a ticket per
  encode tells whether a wait of that stream already covers it: one wait per backward and decoding stream, not
  one per tensor; a backward op runs on its forward op's stream, so a forward on several streams decodes on
  several);
* after a decode, the encoded buffers are marked used by the decoding stream, so the side stream's allocator
  does not reuse them while the decode still reads them.

Codecs whose CUDA path does host-side work keyed to the stream it ran on (``lorenzo``'s lazy trim) declare
``side_stream_safe = False`` and encode on the compute stream. The stream calls go through :class:`StreamOps`,
so the ordering is testable on CPU (tests/test_side_stream.py) with operations that log what they would do.
"""
from __future__ import annotations

import threading
from typing import ContextManager, Protocol

import torch

from .codecs.base import Codec, Packed


class StreamOps(Protocol):
    """The stream operations the side-stream encoder needs from a device."""

    def takes(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is on a device these streams order."""

    def current(self, device: torch.device): ...

    def new_stream(self, device: torch.device): ...

    def use(self, stream) -> ContextManager: ...

    def wait(self, waiter, producer) -> None:
        """Work queued on ``waiter`` from now on starts after the work queued on ``producer`` so far."""

    def used_by(self, tensor: torch.Tensor, stream) -> None:
        """``tensor``'s memory is not reused before ``stream``'s work queued so far has finished."""


class CudaStreamOps:
    def takes(self, t):
        return t.is_cuda

    def current(self, device):
        return torch.cuda.current_stream(device)

    def new_stream(self, device):
        return torch.cuda.Stream(device)

    def use(self, stream):
        return torch.cuda.stream(stream)

    def wait(self, waiter, producer) -> None:
        waiter.wait_stream(producer)

    def used_by(self, tensor, stream) -> None:
        tensor.record_stream(stream)


class SideStreamEncoder:
    """One side stream per device; :meth:`encode` and :meth:`decode` apply the ordering rules above."""

    def __init__(self, ops: StreamOps | None = None):
        self.ops = ops or CudaStreamOps()
        self._sides: dict[torch.device, object] = {}
        self._lock = threading.Lock()  # forward threads encode, autograd's device threads decode
        self._issued = 0  # tickets handed out (one per encode)
        self._covered: dict[object, int] = {}  # decoding stream -> every ticket up to this one is waited for

    def takes(self, t: torch.Tensor) -> bool:
        return self.ops.takes(t)

    def _side(self, device: torch.device):
        side = self._sides.get(device)
        if side is None:
            with self._lock:
                side = self._sides.setdefault(device, self.ops.new_stream(device))
        return side

    def encode(self, codec: Codec, unit: torch.Tensor, key: int) -> tuple[Packed, int]:
        """``codec.encode(unit)`` on the side stream of ``unit``'s device; returns the packed form and its ticket."""
        ops, device = self.ops, unit.device
        side = self._side(device)
        ops.wait(side, ops.current(device))
        with ops.use(side):
            packed = codec.encode(unit, key=key)
        ops.used_by(unit, side)
        with self._lock:
            self._issued += 1
            return packed, self._issued

    def decode(self, codec: Codec, packed: Packed, ticket: int) -> torch.Tensor:
        """``codec.decode(packed)`` on the current stream, after the encode with ``ticket`` has finished."""
        ops, device = self.ops, packed.device
        stream = ops.current(device)
        if self._covered.get(stream, 0) < ticket:
            with self._lock:
                issued = self._issued
                ops.wait(stream, self._side(device))
                self._covered[stream] = max(self._covered.get(stream, 0), issued)
        out = codec.decode(packed)
        for buffer in _storages(packed):
            ops.used_by(buffer, stream)
        return out


def _storages(packed: Packed) -> list[torch.Tensor]:
    """One tensor per allocation ``packed`` holds (views of one allocation share its ``record_stream``)."""
    data = getattr(packed.buffers, "data", None)  # a OneBuffer: one allocation
    if isinstance(data, torch.Tensor):
        return [data]
    seen, out = set(), []
    for t in packed.buffers.values():
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            out.append(t)
    return out
