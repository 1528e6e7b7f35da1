"""Launchers of ``quantize.cu``: the same signatures and bits as ``quantize_reference`` / ``dequantize_reference``.

Both kernels give each group a team of threads, one 8-element chunk per thread (held in registers), so a group
spans at most a block of ``MAX_THREADS`` threads, which caps ``group_size``; grids are sized to the GPU's SM
count (``launcher.multiprocessors``) and stride over the groups.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from .. import rng
from ..formats._bitpack import PACKABLE_BITS, packed_nbytes
from . import launcher
from .launcher import (
    DTYPE_CODES,
    KernelRunner,
    check_dtype,
    check_runner_device,
    check_tensor,
    default_runner,
    one_buffer,
    pointer,
)

SOURCE = "quantize.cu"
STATS_DTYPES = (torch.float32, torch.bfloat16)
CHUNK = 8  # elements per thread per group (quantize.cu)
SLOTS = 2  # groups per team per iteration (quantize.cu)
BLOCK_WARPS = 8  # warps per block, unless one group needs more
MAX_THREADS = 1024
# the grid is at most one wave of resident blocks: sm_80 / sm_90 have 64K registers an SM, the kernels 64 a thread
RESIDENT_THREADS_PER_SM = 1024
MAX_GROUP_SIZE = MAX_THREADS * CHUNK


def supports(bits: int, group_size: int) -> bool:
    """Whether the kernels handle this format (the torch path handles every format)."""
    return bits in PACKABLE_BITS and group_size % 32 == 0 and 32 <= group_size <= MAX_GROUP_SIZE


def _check_format(bits: int, group_size: int, stats_dtype: torch.dtype) -> None:
    if bits not in PACKABLE_BITS:
        raise ValueError(f"bits={bits!r}; the CUDA kernels take one of {', '.join(map(str, PACKABLE_BITS))}")
    if not supports(bits, group_size):
        raise ValueError(f"group_size={group_size!r}; the CUDA kernels take a multiple of 32 in "
                         f"[32, {MAX_GROUP_SIZE}]")
    if stats_dtype not in STATS_DTYPES:
        raise ValueError(f"stats_dtype={stats_dtype}; expected torch.float32 or torch.bfloat16")


def _check_packed(payload, mn, step, numel: int, bits: int, group_size: int, device: torch.device) -> None:
    """The encoded form, shared by encode (its outputs) and decode (its inputs)."""
    groups = -(-numel // group_size)
    check_tensor("payload", payload, device=device, dtypes=(torch.uint8,), numel=packed_nbytes(numel, bits))
    check_tensor("mn", mn, device=device, dtypes=STATS_DTYPES, numel=groups)
    check_tensor("step", step, device=device, dtypes=(mn.dtype,), numel=groups)


def _launch_config(numel: int, group_size: int, multiprocessors: int = launcher.DEFAULT_MULTIPROCESSORS):
    """(grid, block, shared bytes) of both kernels. A group's team is ``group_size // 8`` threads: a warp holds
    ``32 // chunks`` teams when that divides, else a team is whole warps; a block has up to ``BLOCK_WARPS`` warps
    (never more than its groups need) and handles ``SLOTS`` groups per team per iteration; the grid is at most one
    wave at full occupancy, grid-stride beyond."""
    return _config(numel, group_size, multiprocessors, launcher.MAX_BLOCKS)


@functools.lru_cache(maxsize=4096)  # shapes repeat every step: a hit costs less than the arithmetic
def _config(numel: int, group_size: int, multiprocessors: int, max_blocks: int):
    groups = -(-numel // group_size)
    chunks = group_size // CHUNK
    if 32 % chunks == 0:
        unit_warps, unit_groups = 1, 32 // chunks
    else:
        unit_warps, unit_groups = -(-chunks // 32), 1
    units = max(1, min(BLOCK_WARPS // unit_warps, -(-groups // (unit_groups * SLOTS))))
    threads = 32 * unit_warps * units
    resident = multiprocessors * max(1, RESIDENT_THREADS_PER_SM // threads)
    blocks = min(-(-groups // (unit_groups * units * SLOTS)), resident, max_blocks)
    return (blocks, 1, 1), (threads, 1, 1), 0


def quantize_cuda(x: torch.Tensor, bits: int, group_size: int, stats_dtype: torch.dtype, seed: int, key: int, *,
                  runner: KernelRunner | None = None, out=None, checked: bool = True):
    """Encode kernel: ``(payload uint8, mn, step)`` bit-identical to ``quantize_reference``, views of one
    allocation.

    ``x`` must be contiguous; ``out`` may give preallocated ``(payload, mn, step)``. ``checked=False`` skips the
    argument checks, for callers that checked the format once and pass contiguous tensors of a kernel dtype
    (the codec: this runs for every saved tensor)."""
    runner = runner or default_runner()
    numel = x.numel()
    if checked:
        _check_format(bits, group_size, stats_dtype)
        check_runner_device(runner, x.device)
        check_tensor("x", x, device=x.device, dtypes=tuple(DTYPE_CODES))
    if out is None:
        groups = -(-numel // group_size)
        out = one_buffer(x.device, (packed_nbytes(numel, bits), torch.uint8), (groups, stats_dtype),
                         (groups, stats_dtype))
    elif checked:
        _check_out(out, numel, bits, group_size, stats_dtype, x.device)
    payload, mn, step = out
    if numel:
        grid, block, shared = _launch_config(numel, group_size, launcher.multiprocessors(runner, x.device))
        args = (pointer(x), np.int32(DTYPE_CODES[x.dtype]), np.int64(numel), np.int32(bits), np.int32(group_size),
                np.uint32(rng.stream_base(seed, key)), pointer(payload), pointer(mn), pointer(step),
                np.int32(DTYPE_CODES[stats_dtype]))
        runner.launch(SOURCE, "quantize_encode", grid, block, args, shared, x.device)
    return payload, mn, step


def _check_out(out, numel: int, bits: int, group_size: int, stats_dtype: torch.dtype, device: torch.device) -> None:
    payload, mn, step = out
    _check_packed(payload, mn, step, numel, bits, group_size, device)
    if mn.dtype != stats_dtype:
        raise ValueError(f"mn and step must have dtype {stats_dtype}; got {mn.dtype}")
    if payload.data_ptr() % 4:
        raise ValueError(f"payload must be 4-byte aligned (encode writes 32-bit words); got data_ptr % 4 == "
                         f"{payload.data_ptr() % 4}")


def dequantize_cuda(payload: torch.Tensor, mn: torch.Tensor, step: torch.Tensor, numel: int, bits: int,
                    group_size: int, dtype: torch.dtype, *, runner: KernelRunner | None = None, out=None,
                    checked: bool = True):
    """Decode kernel: a flat tensor of ``numel`` elements in ``dtype``, bit-identical to ``dequantize_reference``.
    ``checked=False``: as for :func:`quantize_cuda`, for buffers this package's encode made."""
    runner = runner or default_runner()
    device = payload.device
    if checked:
        _check_format(bits, group_size, mn.dtype)
        check_runner_device(runner, device)
        _check_packed(payload, mn, step, numel, bits, group_size, device)
        check_dtype("dtype", dtype)
    out = torch.empty(numel, dtype=dtype, device=device) if out is None else out
    if checked:
        check_tensor("out", out, device=device, dtypes=(dtype,), numel=numel)
    if numel:
        grid, block, shared = _launch_config(numel, group_size, launcher.multiprocessors(runner, device))
        args = (pointer(payload), pointer(mn), pointer(step), np.int32(DTYPE_CODES[mn.dtype]), np.int64(numel),
                np.int32(bits), np.int32(group_size), pointer(out), np.int32(DTYPE_CODES[dtype]))
        runner.launch(SOURCE, "quantize_decode", grid, block, args, shared, device)
    return out
