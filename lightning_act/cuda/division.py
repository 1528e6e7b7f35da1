"""Launchers of ``division.cu``: the same signatures and bits as ``division_encode_reference`` /
``division_decode_reference``.

Encode and decode are one launch each on the current stream: one block per plane (a thread per 8 elements, up to
``THREADS``), the grid sized to the SM count, grid-stride over planes. Encode stages a plane of up to
``STAGE_MAX`` elements in shared memory, so DRAM sees it once.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch

from .. import rng
from ..formats._bitpack import PACKABLE_BITS, packed_nbytes
from ..formats.division import MAX_SPATIAL_DIMS, block_counts
from . import launcher
from .launcher import (DTYPE_CODES, KernelRunner, check_dtype, check_runner_device, check_tensor, default_runner,
                       one_buffer, pointer)

SOURCE = "division.cu"
THREADS = 256
STAGE_MAX = 12288  # division.cu DIVISION_STAGE_MAX: float32 planes within 48 KiB of shared memory
RESIDENT_THREADS_PER_SM = 1024  # the grid is at most one wave of resident blocks


def _launch_config(planes: int, plane: int, multiprocessors: int):
    """(grid, block): a block per plane, a thread per 8 of its elements (32 to ``THREADS``)."""
    return _config(planes, plane, multiprocessors, launcher.MAX_BLOCKS)


@functools.lru_cache(maxsize=4096)  # shapes repeat every step: a hit costs less than the arithmetic
def _config(planes: int, plane: int, multiprocessors: int, max_blocks: int):
    threads = min(THREADS, max(32, -(-plane // 256) * 32))
    blocks = min(planes, max_blocks, multiprocessors * max(1, RESIDENT_THREADS_PER_SM // threads))
    return (blocks, 1, 1), (threads, 1, 1)


def _layout_args(spatial: tuple[int, ...], block: int) -> tuple[np.int32, ...]:
    """(d0, d1, d2, b0, b1, b2): spatial sizes padded in front to three dims of size 1 with block size 1."""
    if not 1 <= len(spatial) <= MAX_SPATIAL_DIMS or any(s < 1 for s in spatial):
        raise ValueError(f"spatial={spatial}; expected 1 to {MAX_SPATIAL_DIMS} sizes >= 1")
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"block={block!r}; expected an int >= 1")
    if math.prod(spatial) >= 1 << 31:
        raise ValueError(f"spatial={spatial}; the CUDA kernels take planes of fewer than 2**31 elements")
    pad = MAX_SPATIAL_DIMS - len(spatial)
    sizes = (1,) * pad + tuple(spatial)
    blocks = (1,) * pad + (block,) * len(spatial)
    return tuple(np.int32(v) for v in (*sizes, *blocks))


def _check_bits(bits: int) -> None:
    if bits not in PACKABLE_BITS:
        raise ValueError(f"bits={bits!r}; the CUDA kernels take one of {', '.join(map(str, PACKABLE_BITS))}")


def _check_packed(lfc, payload, mn, step, planes: int, spatial: tuple[int, ...], block: int, bits: int,
                  device: torch.device) -> None:
    """The encoded form, shared by encode (its outputs) and decode (its inputs)."""
    cells = planes * math.prod(block_counts(spatial, block))
    check_tensor("lfc", lfc, device=device, dtypes=(torch.bfloat16,), numel=cells)
    check_tensor("payload", payload, device=device, dtypes=(torch.uint8,),
                 numel=packed_nbytes(planes * math.prod(spatial), bits))
    check_tensor("mn", mn, device=device, dtypes=(torch.bfloat16,), numel=planes)
    check_tensor("step", step, device=device, dtypes=(torch.bfloat16,), numel=planes)


def division_encode_cuda(x: torch.Tensor, block: int, bits: int, seed: int, key: int, *,
                         runner: KernelRunner | None = None, checked: bool = True):
    """Encode kernels: ``(lfc, payload, mn, step)`` bit-identical to ``division_encode_reference`` for ``x``
    (contiguous) viewed as ``planes x spatial``; views of one allocation. ``checked=False`` skips the argument
    checks, for the codec, which checked the format once and passes contiguous tensors of a kernel dtype."""
    runner = runner or default_runner()
    if checked:
        _check_bits(bits)
        check_runner_device(runner, x.device)
        check_tensor("x", x, device=x.device, dtypes=tuple(DTYPE_CODES))
        if x.dim() < 2:
            raise ValueError(f"x must be planes x spatial (2 to {MAX_SPATIAL_DIMS + 1} dims); got shape "
                             f"{tuple(x.shape)}")
    planes, spatial = x.shape[0], tuple(x.shape[1:])
    layout = _layout_args(spatial, block)
    numel = x.numel()
    blocks = block_counts(spatial, block)
    lfc, payload, mn, step = one_buffer(x.device, (planes * math.prod(blocks), torch.bfloat16),
                                        (packed_nbytes(numel, bits), torch.uint8), (planes, torch.bfloat16),
                                        (planes, torch.bfloat16))
    lfc = lfc.view(planes, *blocks)
    if numel:
        plane = numel // planes
        grid, threads = _launch_config(planes, plane, launcher.multiprocessors(runner, x.device))
        stage = plane <= STAGE_MAX
        runner.launch(SOURCE, "division_encode", grid, threads,
                      (pointer(x), np.int32(DTYPE_CODES[x.dtype]), np.int64(planes), *layout, np.int32(bits),
                       np.uint32(rng.stream_base(seed, key)), np.int32(stage), pointer(lfc), pointer(payload),
                       pointer(mn), pointer(step)), 4 * plane if stage else 0, x.device)
    return lfc, payload, mn, step


def division_decode_cuda(lfc, payload, mn, step, planes: int, spatial: tuple[int, ...], block: int, bits: int,
                         dtype: torch.dtype, *, runner: KernelRunner | None = None, checked: bool = True
                         ) -> torch.Tensor:
    """Decode kernel: ``planes x spatial`` in ``dtype``, bit-identical to ``division_decode_reference``.
    ``checked=False``: as for :func:`division_encode_cuda`, for buffers this package's encode made."""
    runner = runner or default_runner()
    device = payload.device
    spatial = tuple(spatial)
    layout = _layout_args(spatial, block)
    if checked:
        _check_bits(bits)
        check_runner_device(runner, device)
        _check_packed(lfc, payload, mn, step, planes, spatial, block, bits, device)
        check_dtype("dtype", dtype)
    out = torch.empty(planes, *spatial, dtype=dtype, device=device)
    if out.numel():
        grid, threads = _launch_config(planes, out.numel() // planes, launcher.multiprocessors(runner, device))
        runner.launch(SOURCE, "division_decode", grid, threads,
                      (pointer(payload), pointer(lfc), pointer(mn), pointer(step), np.int64(planes), *layout,
                       np.int32(bits), pointer(out), np.int32(DTYPE_CODES[dtype])), 0, device)
    return out
