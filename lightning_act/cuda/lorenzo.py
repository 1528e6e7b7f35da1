"""Launchers of ``lorenzo.cu``: the same buffers and bits as ``lorenzo_encode_reference`` /
``lorenzo_decode_reference``.

Encode: the header pass, exclusive prefix sums of the block sizes and escape counts (torch, on the same
stream), one host read of the two totals (the payload and escape buffers are allocated at their exact sizes:
never assumed smaller than the input), then the payload pass (skipped when the blocks are header-only and
nothing escapes). Decode: offsets from the headers alone (exclusive prefix sum on the stream; one host read of
their total, to check the payload's length before any launch), the decode kernel, then the escapes scattered
back. One warp per block of 32 elements.

The kernels take float32, float16 and bfloat16 (``supports``); the codec runs float64 on the torch path.

The reference chunks its torch temporaries (``CHUNK_ELEMENTS``, a multiple of the block): headers, payload and
escapes do not depend on the chunking, so the kernels run over the whole tensor at once.
"""
from __future__ import annotations

import numpy as np
import torch

from ..formats.lorenzo import BLOCK, block_sizes, index_dtype, working_bound
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
SCATTER_THREADS = 256


def supports(dtype: torch.dtype) -> bool:
    """Whether the kernels encode and decode tensors of ``dtype`` (the torch path takes float64 too)."""
    return dtype in KERNEL_DTYPES


def _grid(blocks: int):
    return warps_grid(blocks, min(WARPS_PER_BLOCK, blocks), launcher.MAX_BLOCKS)


def _exclusive_cumsum(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 offsets, int64 total) of int32 counts."""
    inclusive = torch.cumsum(counts, 0, dtype=torch.int64)
    return inclusive - counts, inclusive[-1]


def _bound(error_bound: float) -> tuple[np.float32, np.float32, np.float32]:
    return tuple(np.float32(v) for v in working_bound(error_bound))


def _check_flat(flat: torch.Tensor, runner: KernelRunner) -> None:
    check_runner_device(runner, flat.device)
    check_tensor("flat", flat, device=flat.device, dtypes=KERNEL_DTYPES)
    if flat.dim() != 1:
        raise ValueError(f"flat must be 1-dimensional; got shape {tuple(flat.shape)}")


def lorenzo_header_pass(flat: torch.Tensor, error_bound: float, *,
                        runner: KernelRunner | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The encode's first kernel (tests compare it piecewise with the specification): per block of 32
    elements its header (int16 storage of the uint16), payload bytes and escape count (int32 each)."""
    runner = runner or default_runner()
    _check_flat(flat, runner)
    blocks, device = -(-flat.numel() // BLOCK), flat.device
    header = torch.empty(blocks, dtype=torch.int16, device=device)
    sizes = torch.empty(blocks, dtype=torch.int32, device=device)
    escape_counts = torch.empty(blocks, dtype=torch.int32, device=device)
    if blocks:
        grid, block = _grid(blocks)
        runner.launch(SOURCE, "lorenzo_header", grid, block,
                      (pointer(flat), np.int32(DTYPE_CODES[flat.dtype]), np.int64(flat.numel()),
                       *_bound(error_bound), pointer(header), pointer(sizes), pointer(escape_counts)), 0, device)
    return header, sizes, escape_counts


def lorenzo_encode_cuda(flat: torch.Tensor, error_bound: float, *,
                        runner: KernelRunner | None = None) -> dict[str, torch.Tensor]:
    """Encode kernels: ``header``, ``payload``, ``escape_index``, ``escape_value`` bit-identical to
    ``lorenzo_encode_reference`` for the flat contiguous ``flat``."""
    runner = runner or default_runner()
    _check_flat(flat, runner)
    numel, device = flat.numel(), flat.device
    if not numel:
        return {"header": torch.empty(0, dtype=torch.int16, device=device),
                "payload": torch.empty(0, dtype=torch.uint8, device=device),
                "escape_index": torch.empty(0, dtype=index_dtype(0), device=device),
                "escape_value": flat.new_empty(0)}
    header, sizes, escape_counts = lorenzo_header_pass(flat, error_bound, runner=runner)
    offsets, payload_bytes = _exclusive_cumsum(sizes)
    escape_offsets, escapes = _exclusive_cumsum(escape_counts)
    # The one host synchronisation of the encode: the two totals, to allocate the exactly-sized buffers.
    payload_bytes, escapes = torch.stack([payload_bytes, escapes]).tolist()
    payload = torch.empty(payload_bytes, dtype=torch.uint8, device=device)
    escape_index = torch.empty(escapes, dtype=index_dtype(numel), device=device)
    escape_value = torch.empty(escapes, dtype=flat.dtype, device=device)
    if payload_bytes or escapes:  # else every block is header-only (e.g. all zeros): nothing to write
        grid, block = _grid(-(-numel // BLOCK))
        runner.launch(SOURCE, "lorenzo_payload", grid, block,
                      (pointer(flat), np.int32(DTYPE_CODES[flat.dtype]), np.int64(numel), *_bound(error_bound),
                       pointer(offsets), pointer(escape_offsets), pointer(payload), pointer(escape_index),
                       np.int32(escape_index.dtype == torch.int64), pointer(escape_value)), 0, device)
    return {"header": header, "payload": payload, "escape_index": escape_index, "escape_value": escape_value}


def lorenzo_decode_cuda(buffers: dict[str, torch.Tensor], numel: int, error_bound: float, dtype: torch.dtype, *,
                        runner: KernelRunner | None = None) -> torch.Tensor:
    """Decode kernels: a flat tensor of ``numel`` elements in ``dtype``, bit-identical to
    ``lorenzo_decode_reference``."""
    runner = runner or default_runner()
    header, payload = buffers["header"], buffers["payload"]
    escape_index, escape_value = buffers["escape_index"], buffers["escape_value"]
    device = header.device
    check_runner_device(runner, device)
    check_dtype("dtype", dtype, KERNEL_DTYPES)
    blocks = -(-numel // BLOCK)
    check_tensor("header", header, device=device, dtypes=(torch.int16,), numel=blocks)
    sizes = block_sizes(header)[0]
    offsets = torch.cumsum(sizes, 0) - sizes
    if blocks:  # the headers and the payload must agree (one host read, like encode's)
        check_tensor("payload", payload, device=device, dtypes=(torch.uint8,), numel=int(sizes.sum()))
    check_tensor("escape_index", escape_index, device=device, dtypes=(index_dtype(numel),))
    check_tensor("escape_value", escape_value, device=device, dtypes=(dtype,), numel=escape_index.numel())
    out = torch.empty(numel, dtype=dtype, device=device)
    if not numel:
        return out
    code = np.int32(DTYPE_CODES[dtype])
    grid, block = _grid(blocks)
    runner.launch(SOURCE, "lorenzo_decode", grid, block,
                  (pointer(header), pointer(offsets), pointer(payload), np.int64(numel), _bound(error_bound)[1],
                   pointer(out), code), 0, device)
    escapes = escape_index.numel()
    if escapes:
        runner.launch(SOURCE, "lorenzo_scatter", (min(-(-escapes // SCATTER_THREADS), launcher.MAX_BLOCKS), 1, 1),
                      (SCATTER_THREADS, 1, 1),
                      (pointer(escape_index), np.int32(escape_index.dtype == torch.int64), pointer(escape_value),
                       np.int64(escapes), code, pointer(out)), 0, device)
    return out
