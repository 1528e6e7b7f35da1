"""Launchers of ``lorenzo.cu``: the same bytes as ``lorenzo_encode_reference`` / ``lorenzo_decode_reference``,
and never a device value read on the host (no launch waits for the GPU).

Encode: the header pass (each block's header and payload size), the inclusive prefix sum of the sizes on the
stream (each block's end offset), then the payload pass, which writes every block at its offset into a payload
buffer of ``reserved_payload_bytes``: the input's bytes padded to whole blocks, the most any tensor stores (the
format caps each block at its 32 values verbatim, escapes included). The actual size stays on the device: encode
returns it beside the buffers, as a 1-element int64 tensor. Decode: each block's size from its header (one small
kernel), their prefix sum on the stream, the decode kernel. One warp per block of 32 elements.

The trade-off is memory, for a while. The host cannot size the payload without waiting for the GPU, so a tensor
first holds its raw size (plus 2 bytes of header per 32 elements); :class:`PayloadTrims` gives the rest back
lazily. On CUDA, encode queues a non-blocking copy of the size into pinned host memory and an event; every later
lorenzo encode and decode polls the queue (``Event.query()``, never a wait) and replaces the payload of each
tensor whose event has completed with an exact-size copy, made on the encode's stream. Memory held is the
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
import contextlib
import threading
import weakref

import numpy as np
import torch

from ..formats.lorenzo import BLOCK, reserved_payload_bytes, working_bound
from . import launcher
from .launcher import (
    DTYPE_CODES,
    KernelRunner,
    check_dtype,
    check_runner_device,
    check_tensor,
    default_runner,
    pointer,
    warps_grid,
)

SOURCE = "lorenzo.cu"
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
WARPS_PER_BLOCK = 8  # LORENZO_MAX_WARPS in lorenzo.cu
SIZES_THREADS = 256


def supports(dtype: torch.dtype) -> bool:
    """Whether the kernels encode and decode tensors of ``dtype`` (the torch path takes float64 too)."""
    return dtype in KERNEL_DTYPES


def _grid(blocks: int):
    return warps_grid(blocks, min(WARPS_PER_BLOCK, blocks), launcher.MAX_BLOCKS)


def _bound(error_bound: float) -> tuple[np.float32, np.float32, np.float32]:
    return tuple(np.float32(v) for v in working_bound(error_bound))


def _check_flat(flat: torch.Tensor, runner: KernelRunner) -> None:
    check_runner_device(runner, flat.device)
    check_tensor("flat", flat, device=flat.device, dtypes=KERNEL_DTYPES)
    if flat.dim() != 1:
        raise ValueError(f"flat must be 1-dimensional; got shape {tuple(flat.shape)}")


def lorenzo_header_pass(flat: torch.Tensor, error_bound: float, *,
                        runner: KernelRunner | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The encode's first kernel (tests compare it piecewise with the specification): per block of 32
    elements its header (int16 storage of the uint16) and payload bytes (int32)."""
    runner = runner or default_runner()
    _check_flat(flat, runner)
    blocks, device = -(-flat.numel() // BLOCK), flat.device
    header = torch.empty(blocks, dtype=torch.int16, device=device)
    sizes = torch.empty(blocks, dtype=torch.int32, device=device)
    if blocks:
        grid, block = _grid(blocks)
        runner.launch(SOURCE, "lorenzo_header", grid, block,
                      (pointer(flat), np.int32(DTYPE_CODES[flat.dtype]), np.int64(flat.numel()),
                       *_bound(error_bound), pointer(header), pointer(sizes)), 0, device)
    return header, sizes


def lorenzo_encode_cuda(flat: torch.Tensor, error_bound: float, *, runner: KernelRunner | None = None
                        ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Encode kernels: buffers ``header`` (bit-identical to ``lorenzo_encode_reference``'s) and ``payload``, whose
    first bytes are the reference's payload, in a buffer of ``reserved_payload_bytes``; and that size in bytes,
    a 1-element int64 tensor on the device (never read here)."""
    runner = runner or default_runner()
    _check_flat(flat, runner)
    numel, device = flat.numel(), flat.device
    header, sizes = lorenzo_header_pass(flat, error_bound, runner=runner)
    payload = torch.empty(reserved_payload_bytes(numel, flat.element_size()), dtype=torch.uint8, device=device)
    if not numel:
        return {"header": header, "payload": payload}, torch.zeros(1, dtype=torch.int64, device=device)
    ends = torch.cumsum(sizes, 0, dtype=torch.int64)
    grid, block = _grid(header.numel())
    runner.launch(SOURCE, "lorenzo_payload", grid, block,
                  (pointer(flat), np.int32(DTYPE_CODES[flat.dtype]), np.int64(numel), *_bound(error_bound),
                   pointer(ends), pointer(payload)), 0, device)
    return {"header": header, "payload": payload}, ends[-1:]


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
    if not numel:
        return out
    code = np.int32(DTYPE_CODES[dtype])
    sizes = torch.empty(blocks, dtype=torch.int32, device=device)
    runner.launch(SOURCE, "lorenzo_sizes", (min(-(-blocks // SIZES_THREADS), launcher.MAX_BLOCKS), 1, 1),
                  (SIZES_THREADS, 1, 1), (pointer(header), np.int64(blocks), code, pointer(sizes)), 0, device)
    ends = torch.cumsum(sizes, 0, dtype=torch.int64)
    grid, block = _grid(blocks)
    runner.launch(SOURCE, "lorenzo_decode", grid, block,
                  (pointer(header), pointer(ends), pointer(payload), np.int64(numel), _bound(error_bound)[1],
                   pointer(out), code), 0, device)
    return out


class PayloadTrims:
    """Encoded forms whose payload is still the encode's reservation, waiting for the GPU to finish them; each
    is cut to its exact size once it has (see the module docstring). Thread-safe: hooks run per thread."""

    def __init__(self):
        self._pending = collections.deque()  # (weakref to a Packed, event, host int64 size, stream), FIFO
        self._lock = threading.Lock()

    def track(self, packed, payload_bytes: torch.Tensor) -> None:
        """Trim ``packed.buffers["payload"]`` to ``payload_bytes`` (its encode's device size) once the GPU has
        written it. Off CUDA, nothing: those runners finish before they return, and exist for tests."""
        if payload_bytes.device.type != "cuda":
            return
        stream = torch.cuda.current_stream(payload_bytes.device)
        host = torch.empty(1, dtype=torch.int64, pin_memory=True)
        host.copy_(payload_bytes, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
        self.queue(packed, done, host, stream)

    def queue(self, packed, done, host: torch.Tensor, stream) -> None:
        """Trim ``packed``'s payload to ``int(host)`` bytes once ``done.query()`` (made on ``stream``, or on the
        current stream when None)."""
        with self._lock:
            self._pending.append((weakref.ref(packed), done, host, stream))

    def poll(self) -> None:
        """Trim every tracked payload whose size has arrived, oldest first; never waits."""
        while True:
            with self._lock:
                if not self._pending or not self._pending[0][1].query():
                    return
                ref, _, host, stream = self._pending.popleft()
            packed = ref()
            if packed is None:  # decoded and released before the trim
                continue
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                packed.buffers["payload"] = packed.buffers["payload"][:int(host)].clone()

    def __len__(self) -> int:
        return len(self._pending)


# The process's queue: every lorenzo codec's CUDA encodes, polled by every lorenzo encode and decode.
TRIMS = PayloadTrims()
