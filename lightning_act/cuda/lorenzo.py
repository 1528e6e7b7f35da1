"""Launchers of ``lorenzo.cu``: the same bytes as ``lorenzo_encode_reference`` / ``lorenzo_decode_reference``,
and never a device value read on the host (no launch waits for the GPU).

Encode: one kernel (``lorenzo_encode``) reads the input once, writes each block's header, finds each block's
payload offset by a single-pass prefix sum of the blocks' sizes (decoupled look-back over tiles of 1024 elements;
``lorenzo.cu`` says how) and writes every block there, into a payload buffer of ``reserved_payload_bytes``: the
input's bytes padded to whole blocks, the most any tensor stores (the format caps each block at its 32 values
verbatim, escapes included). The actual size stays on the device: encode returns it beside the buffers, the
first word of its scan state. Decode: one kernel (``lorenzo_decode``) finds the offsets again from the headers the
same way and decodes each block. Each launch takes a zeroed int64 scan state (the payload's size, the tile
counter, a flag per tile): a fill beside each launch, where the previous design ran two kernels and a prefix sum
each way and read the input twice.

The codec runs :func:`lorenzo_encode_cuda_packed` / :func:`lorenzo_decode_cuda_packed` for every saved tensor: a
plan cached per size and dtype (layout, grid, scalar arguments), the encoded form in one allocation (a
:class:`~lightning_act.cuda.launcher.OneBuffer` of ``header`` and the ``payload`` reservation), the codec's bound
scalars built once; beside it only the scan state, per encode and per decode.

The trade-off is memory, for a while. The host cannot size the payload without waiting for the GPU, so a tensor
first holds its raw size (plus 2 bytes of header per 32 elements); :class:`PayloadTrims` gives the rest back
lazily. On CUDA, encode queues a non-blocking copy of the size into a slot of pinned host memory and records the
slot's event (slots and events are reused once read); every later lorenzo encode and decode polls the queue
(``Event.query()``, never a wait) and replaces the encoded form of each tensor whose event has completed with an
exact-size copy of its first bytes (header, then the payload's size), made on the encode's stream. Memory held is the
compressed size plus the reservations of the tensors the GPU has not encoded yet (or that no call has polled
since): bounded by how far the host runs ahead of the GPU. ``Packed.nbytes`` is what the buffers hold when it is
read: the reservation before the trim, the exact size after (the engine, which reads it right after encode,
records the reservation). Rejected: exact allocation (the host reads the size: a sync per tensor, the previous
design); a shared device pool sized from earlier steps (a tensor that overflows it has nowhere to go without a
host read). Off CUDA (the emulator, the no-op runner of the host-cost benchmark) launches finish before they
return and nothing is trimmed.

The kernels take float32, float16 and bfloat16 (``supports``); the codec runs float64 on the torch path.

The reference chunks its torch temporaries (``CHUNK_ELEMENTS``, a multiple of the block): headers and payload do
not depend on the chunking, so the kernels run over the whole tensor at once.
"""
from __future__ import annotations

import collections
import functools
import threading
import weakref
from typing import NamedTuple

import numpy as np
import torch

from ..formats.lorenzo import BLOCK, reserved_payload_bytes, working_bound
from . import launcher
from .launcher import (
    DTYPE_CODES,
    PART_ALIGN,
    BufferLayout,
    KernelRunner,
    OneBuffer,
    buffer_layout,
    check_dtype,
    check_runner_device,
    check_tensor,
    default_runner,
    pointer,
)

SOURCE = "lorenzo.cu"
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
THREADS = (8 * 32, 1, 1)  # LORENZO_WARPS warps in lorenzo.cu
TILE_ELEMENTS = 32 * BLOCK  # LORENZO_TILE_BLOCKS blocks in lorenzo.cu
# A tile's flag in the scan state (lorenzo.cu), as int64: bit 62 over its own bytes, bit 63 over its inclusive prefix
SCAN_AGGREGATE, SCAN_PREFIX = 1 << 62, -(1 << 63)


def supports(dtype: torch.dtype) -> bool:
    """Whether the kernels encode and decode tensors of ``dtype`` (the torch path takes float64 too)."""
    return dtype in KERNEL_DTYPES


@functools.lru_cache(maxsize=256)  # a codec per bound; the error-bound controller makes a few dozen
def bound_scalars(error_bound: float) -> tuple[np.float32, np.float32, np.float32]:
    """``working_bound(error_bound)`` as the kernels' float arguments ``(eb, step, inv)``."""
    return tuple(np.float32(v) for v in working_bound(error_bound))


class _Plan(NamedTuple):
    """What the launches for one size and dtype need besides pointers and the bound, built once."""

    layout: BufferLayout  # of the encoded form: (header, payload reservation)
    blocks: int  # blocks of BLOCK elements
    tiles: int  # of TILE_ELEMENTS
    grid: tuple | None  # of both kernels (each thread block claims tiles until none is left); None: nothing to launch
    code: np.int32  # the dtype of the input (encode) and output (decode)
    numel: np.int64


# One entry per (size, dtype) met: a model saves a few hundred distinct sizes. ``max_blocks``: launcher.MAX_BLOCKS.
@functools.lru_cache(maxsize=4096)
def _plan(numel: int, dtype: torch.dtype, max_blocks: int) -> _Plan:
    blocks = -(-numel // BLOCK)
    tiles = -(-numel // TILE_ELEMENTS)
    layout = buffer_layout((("header", blocks, torch.int16),
                            ("payload", reserved_payload_bytes(numel, dtype.itemsize), torch.uint8)))
    grid = (min(tiles, max_blocks), 1, 1) if tiles else None
    return _Plan(layout, blocks, tiles, grid, np.int32(DTYPE_CODES[dtype]), np.int64(numel))


def new_scan(plan: _Plan, device: torch.device) -> torch.Tensor:
    """A launch's scan state, zeroed: the payload's size, the tile counter, a flag per tile."""
    return torch.zeros(plan.tiles + 2, dtype=torch.int64, device=device)


def _check_flat(flat: torch.Tensor, runner: KernelRunner) -> None:
    check_runner_device(runner, flat.device)
    check_tensor("flat", flat, device=flat.device, dtypes=KERNEL_DTYPES)
    if flat.dim() != 1:
        raise ValueError(f"flat must be 1-dimensional; got shape {tuple(flat.shape)}")


def launch_encode(x: np.uint64, plan: _Plan, bound: tuple, header: np.uint64, payload: np.uint64,
                  scan: torch.Tensor, runner: KernelRunner, device: torch.device) -> None:
    """``lorenzo_encode`` over the input at ``x`` into the buffers at ``header`` and ``payload``, with the scan
    state ``scan`` (:func:`new_scan`; tests seed it with tiles other blocks would hold)."""
    runner.launch(SOURCE, "lorenzo_encode", plan.grid, THREADS,
                  (x, plan.code, plan.numel, *bound, header, payload, pointer(scan)), 0, device)


def launch_decode(header: np.uint64, payload: np.uint64, plan: _Plan, step: np.float32, out: torch.Tensor,
                  scan: torch.Tensor, runner: KernelRunner, device: torch.device) -> None:
    """``lorenzo_decode`` of the buffers at ``header`` and ``payload`` into ``out``, with the scan state ``scan``."""
    runner.launch(SOURCE, "lorenzo_decode", plan.grid, THREADS,
                  (header, payload, plan.numel, step, pointer(out), plan.code, pointer(scan)), 0, device)


def lorenzo_encode_cuda(flat: torch.Tensor, error_bound: float, *, runner: KernelRunner | None = None
                        ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Encode kernel: buffers ``header`` (bit-identical to ``lorenzo_encode_reference``'s) and ``payload``, whose
    first bytes are the reference's payload, in a buffer of ``reserved_payload_bytes``; and that size in bytes,
    a 1-element int64 tensor on the device (never read here)."""
    runner = runner or default_runner()
    _check_flat(flat, runner)
    buffers, scan = lorenzo_encode_cuda_packed(flat, bound_scalars(error_bound), runner=runner)
    return dict(buffers), scan[:1] if scan is not None else torch.zeros(1, dtype=torch.int64, device=flat.device)


def lorenzo_encode_cuda_packed(x: torch.Tensor, bound: tuple, *, runner: KernelRunner | None = None
                               ) -> tuple[OneBuffer, torch.Tensor | None]:
    """:func:`lorenzo_encode_cuda` for the codec, which runs it for every saved tensor: ``x`` (contiguous, any
    shape, a kernel dtype) encoded into a :class:`OneBuffer` of ``header`` and the ``payload`` reservation (one
    allocation, no views built); and the encode's scan state (:func:`new_scan`, on the device: its first word the
    payload's size in bytes; None for an empty tensor). ``bound``: :func:`bound_scalars` of the error bound. No argument checks: the codec checked its bound
    once and passes tensors of a kernel dtype."""
    runner = runner or default_runner()
    device = x.device
    plan = _plan(x.numel(), x.dtype, launcher.MAX_BLOCKS)
    buffers = OneBuffer(torch.empty(plan.layout.total, dtype=torch.uint8, device=device), plan.layout)
    if plan.grid is None:
        return buffers, None
    scan = new_scan(plan, device)
    launch_encode(pointer(x), plan, bound, *buffers.pointers(), scan, runner, device)
    return buffers, scan


def _decode(header: np.uint64, payload: np.uint64, plan: _Plan, step: np.float32, out: torch.Tensor,
            runner: KernelRunner, device: torch.device) -> None:
    if plan.grid is not None:
        launch_decode(header, payload, plan, step, out, new_scan(plan, device), runner, device)


def lorenzo_decode_cuda(buffers: dict[str, torch.Tensor], numel: int, error_bound: float, dtype: torch.dtype, *,
                        runner: KernelRunner | None = None) -> torch.Tensor:
    """Decode kernels: a flat tensor of ``numel`` elements in ``dtype``, bit-identical to
    ``lorenzo_decode_reference``. The payload's length is checked against the most ``numel`` values can store,
    not against the headers' total (a host read): the buffers must come from an encode."""
    runner = runner or default_runner()
    header, payload = buffers["header"], buffers["payload"]
    device = header.device
    check_runner_device(runner, device)
    check_dtype("dtype", dtype, KERNEL_DTYPES)
    blocks = -(-numel // BLOCK)
    check_tensor("header", header, device=device, dtypes=(torch.int16,), numel=blocks)
    check_tensor("payload", payload, device=device, dtypes=(torch.uint8,))
    most = reserved_payload_bytes(numel, dtype.itemsize)
    if payload.numel() > most:
        raise ValueError(f"payload must have at most {most} elements for {numel} values of {dtype}; got "
                         f"{payload.numel()}")
    out = torch.empty(numel, dtype=dtype, device=device)
    _decode(pointer(header), pointer(payload), _plan(numel, dtype, launcher.MAX_BLOCKS),
            bound_scalars(error_bound)[1], out, runner, device)
    return out


def lorenzo_decode_cuda_packed(buffers: OneBuffer, shape: torch.Size, step: np.float32, dtype: torch.dtype, *,
                               runner: KernelRunner | None = None) -> torch.Tensor:
    """:func:`lorenzo_decode_cuda` for the codec: decodes what :func:`lorenzo_encode_cuda_packed` stored (or its
    trim) straight into a tensor of ``shape``, without argument checks. ``step``: ``bound_scalars(...)[1]``."""
    runner = runner or default_runner()
    device = buffers.data.device
    out = torch.empty(shape, dtype=dtype, device=device)
    _decode(*buffers.pointers(), _plan(out.numel(), dtype, launcher.MAX_BLOCKS), step, out, runner, device)
    return out


def trimmed_layout(layout: BufferLayout, size: int) -> BufferLayout:
    """``layout`` (header, payload reservation) with a payload of ``size`` bytes: the same offsets, so the
    trimmed form is the first ``total`` bytes of the reserved one."""
    reserved = layout.numels[1]
    return layout._replace(numels=(layout.numels[0], size), total=layout.offsets[1] + size + (-size % PART_ALIGN),
                           nbytes=layout.nbytes - reserved + size)


class CudaTrimOps:
    """What :class:`PayloadTrims` asks of CUDA (tests stand in for it on CPU): the current stream, host slots
    for sizes (pinned memory, each with its reusable event), and running work on a stream."""

    device_type = "cuda"

    @staticmethod
    def current_stream(device: torch.device):
        return torch.cuda.current_stream(device)

    @staticmethod
    def new_slots(device: torch.device, count: int) -> list[tuple[torch.Tensor, object]]:
        host = torch.empty(count, dtype=torch.int64, pin_memory=True)
        return [(host[i:i + 1], torch.cuda.Event()) for i in range(count)]

    @staticmethod
    def use(stream):
        return torch.cuda.stream(stream)


class PayloadTrims:
    """Encoded forms whose payload is still the encode's reservation, waiting for the GPU to finish them; each
    is cut to its exact size once it has (see the module docstring). Thread-safe: hooks run per thread.

    A tracked form's size is copied into a slot of pinned host memory, with an event recorded after the copy;
    slots and their events are made ``SLOTS_PER_ALLOCATION`` at a time and reused once their size was read, so
    tracking a tensor allocates nothing in the steady state."""

    SLOTS_PER_ALLOCATION = 256

    def __init__(self, ops=None):
        self.ops = ops or CudaTrimOps()
        self._pending = collections.deque()  # (weakref to a Packed, slot, stream), FIFO
        self._free = {}  # device -> slots (host size, event) not in use; an event records on one device only
        self._lock = threading.Lock()

    def track(self, packed, scan: torch.Tensor | None) -> None:
        """Trim ``packed``'s payload (a :class:`OneBuffer` part) to the size its encode left in ``scan[0]`` on the
        device, once the GPU has written it. Off the ops' device, nothing: the other runners finish before they
        return, and exist for tests."""
        device = packed.device
        if scan is None or device.type != self.ops.device_type:
            return
        with self._lock:
            free = self._free.get(device)
            slot = free.pop() if free else None
        if slot is None:
            slots = self.ops.new_slots(device, self.SLOTS_PER_ALLOCATION)
            slot = slots.pop()
            with self._lock:
                self._free.setdefault(device, []).extend(slots)
        host, done = slot
        stream = self.ops.current_stream(device)
        host.copy_(scan[:1], non_blocking=True)
        done.record(stream)
        with self._lock:
            self._pending.append((weakref.ref(packed), slot, stream, device))

    def poll(self) -> None:
        """Trim every tracked payload whose size has arrived, oldest first; never waits."""
        while self._pending:
            with self._lock:
                if not self._pending or not self._pending[0][1][1].query():
                    return
                ref, (host, done), stream, device = self._pending.popleft()
                size = int(host)  # arrived: the event follows the copy
                self._free[device].append((host, done))
            packed = ref()
            if packed is None:  # decoded and released before the trim
                continue
            buffers = packed.buffers
            layout = trimmed_layout(buffers.layout, size)
            with self.ops.use(stream):  # the copy is ordered after the encode, on its stream
                packed.buffers = OneBuffer(buffers.data[:layout.total].clone(), layout)
            if packed.on_resize is not None:
                packed.on_resize(layout.nbytes)

    def __len__(self) -> int:
        return len(self._pending)


# The process's queue: every lorenzo codec's CUDA encodes, polled by every lorenzo encode and decode.
TRIMS = PayloadTrims()
