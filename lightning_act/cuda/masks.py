"""Launchers of ``masks.cu``: the 1-bit masks of the ``bitmask``, ``positive_mask`` and ``scaled_mask`` codecs, the
same bits as :func:`lightning_act.formats._bitpack.pack_bits` / ``unpack_bits``.

One launch per direction, no temporaries: encode allocates the payload, decode the output. A warp handles 256
elements per iteration (8 ballots of 32 flags), blocks of up to ``BLOCK_WARPS`` warps, the grid at most one wave of
resident blocks, warps striding over the rest. Plans (grid, block, scalar arguments) are cached per size, dtype and
grid bounds, so a launch on the hot path computes nothing; no device value is ever read on the host (the scale of
``scaled_mask`` is a device scalar the decode kernel reads).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import torch

from ..formats._bitpack import packed_nbytes
from . import launcher
from .launcher import DTYPE_CODES, KernelRunner, check_runner_device, check_tensor, default_runner, pointer

SOURCE = "masks.cu"
BYTE_CODE = 4  # masks.cu MASK_BYTES: bool and uint8 tensors
MASK_DTYPE_CODES = {**DTYPE_CODES, torch.bool: BYTE_CODE, torch.uint8: BYTE_CODE}
TILE = 256  # elements a warp handles per iteration (masks.cu MASK_TILE)
BLOCK_WARPS = 8
RESIDENT_THREADS_PER_SM = 2048  # sm_80 / sm_90: 32 registers a thread leaves the thread limit as the bound
NULL = np.uint64(0)


class _Plan(NamedTuple):
    nbytes: int  # payload bytes
    grid: tuple | None  # None: nothing to launch (no elements)
    block: tuple | None
    args: tuple  # encode: (numel, x dtype, positive); decode: (numel,)
    dtype: np.int32  # decode: the output's dtype code


@functools.lru_cache(maxsize=4096)  # shapes repeat every step: a hit costs less than the arithmetic
def _config(numel: int, multiprocessors: int, max_blocks: int):
    """(grid, block): whole warps, one per 256-element tile, never more warps than tiles."""
    tiles = -(-numel // TILE)
    warps = max(1, min(BLOCK_WARPS, tiles))
    blocks = min(-(-tiles // warps), multiprocessors * (RESIDENT_THREADS_PER_SM // (32 * warps)), max_blocks)
    return (blocks, 1, 1), (32 * warps, 1, 1)


@functools.lru_cache(maxsize=4096)
def _encode_plan(numel: int, dtype: torch.dtype, positive: bool, multiprocessors: int, max_blocks: int) -> _Plan:
    grid, block = _config(numel, multiprocessors, max_blocks) if numel else (None, None)
    args = (np.int64(numel), np.int32(MASK_DTYPE_CODES[dtype]), np.int32(positive))
    return _Plan(packed_nbytes(numel, 1), grid, block, args, np.int32(MASK_DTYPE_CODES[dtype]))


@functools.lru_cache(maxsize=4096)
def _decode_plan(numel: int, dtype: torch.dtype, multiprocessors: int, max_blocks: int) -> _Plan:
    grid, block = _config(numel, multiprocessors, max_blocks) if numel else (None, None)
    return _Plan(packed_nbytes(numel, 1), grid, block, (np.int64(numel),), np.int32(MASK_DTYPE_CODES[dtype]))


def _grid_bounds(runner: KernelRunner, device: torch.device) -> tuple[int, int]:
    return launcher.multiprocessors(runner, device), launcher.MAX_BLOCKS


def _encode(x: torch.Tensor, bits: torch.Tensor, plan: _Plan, runner: KernelRunner, device: torch.device) -> None:
    if plan.grid is not None:
        runner.launch(SOURCE, "mask_encode", plan.grid, plan.block, (pointer(x), *plan.args, pointer(bits)), 0,
                      device)


def _decode(bits: torch.Tensor, scale: torch.Tensor | None, out: torch.Tensor, plan: _Plan, runner: KernelRunner,
            device: torch.device) -> None:
    if plan.grid is not None:
        args = (pointer(bits), *plan.args, NULL if scale is None else pointer(scale), plan.dtype, pointer(out))
        runner.launch(SOURCE, "mask_decode", plan.grid, plan.block, args, 0, device)


# ---- the codecs' path: no checks (they pass contiguous tensors of a kernel dtype) ----

def mask_encode_packed(x: torch.Tensor, positive: bool = False, *, runner: KernelRunner | None = None) -> torch.Tensor:
    """The packed flags of ``x`` (contiguous, a float dtype, bool or uint8): ``x > 0`` when ``positive`` else
    ``x != 0``, as ``packed_nbytes(numel, 1)`` uint8; one allocation, one launch, no argument checks."""
    runner = runner or default_runner()
    device = x.device
    plan = _encode_plan(x.numel(), x.dtype, positive, *_grid_bounds(runner, device))
    bits = torch.empty(plan.nbytes, dtype=torch.uint8, device=device)
    _encode(x, bits, plan, runner, device)
    return bits


def mask_decode_packed(bits: torch.Tensor, shape: torch.Size, dtype: torch.dtype, scale: torch.Tensor | None = None,
                       *, runner: KernelRunner | None = None) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` holding 1 (``scale``'s value when given: a device scalar of ``dtype``)
    where the bit of ``bits`` is set, else 0; one allocation, one launch, no argument checks."""
    runner = runner or default_runner()
    device = bits.device
    # sizes as separate ints: a torch.Size argument costs the call twice the host time (0.8 µs more, torch 2.13)
    out = torch.empty(*shape, dtype=dtype, device=device) if shape else torch.empty((), dtype=dtype, device=device)
    _decode(bits, scale, out, _decode_plan(out.numel(), dtype, *_grid_bounds(runner, device)), runner, device)
    return out


# ---- checked, for direct use ----

def mask_encode_cuda(x: torch.Tensor, positive: bool = False, *, runner: KernelRunner | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Encode kernel: ``pack_bits(x > 0)`` (``positive``) or ``pack_bits(x != 0)`` of a contiguous tensor of a
    float dtype, bool or uint8 (``positive`` takes floats only), bit for bit; into ``out`` (uint8, ``(numel + 7) //
    8`` elements, contiguous) when given. Raises ValueError naming what is wrong before any launch."""
    runner = runner or default_runner()
    if not isinstance(positive, bool):
        raise ValueError(f"positive={positive!r}; expected True or False")
    check_tensor("x", x, device=getattr(x, "device", None), dtypes=tuple(DTYPE_CODES if positive else MASK_DTYPE_CODES))
    device = x.device
    check_runner_device(runner, device)
    plan = _encode_plan(x.numel(), x.dtype, positive, *_grid_bounds(runner, device))
    if out is None:
        out = torch.empty(plan.nbytes, dtype=torch.uint8, device=device)
    else:
        check_tensor("out", out, device=device, dtypes=(torch.uint8,), numel=plan.nbytes)
    _encode(x, out, plan, runner, device)
    return out


def mask_decode_cuda(bits: torch.Tensor, numel: int, dtype: torch.dtype, scale: torch.Tensor | None = None, *,
                     runner: KernelRunner | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode kernel: ``numel`` elements of ``dtype`` (a float dtype, bool or uint8), flat, 1 (or ``scale``'s value:
    a one-element tensor of ``dtype`` on the same device, read by the kernel) where the bit is set, else 0: the
    values of ``unpack_bits(bits, numel, dtype=dtype)`` (``torch.where(..., scale, 0.0)``), bit for bit; into
    ``out`` (contiguous, ``numel`` elements of ``dtype``) when given. Raises ValueError naming what is wrong before
    any launch."""
    runner = runner or default_runner()
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel={numel!r}; expected an int >= 0")
    launcher.check_dtype("dtype", dtype, MASK_DTYPE_CODES)
    check_tensor("bits", bits, device=getattr(bits, "device", None), dtypes=(torch.uint8,),
                 numel=packed_nbytes(numel, 1))
    device = bits.device
    check_runner_device(runner, device)
    if scale is not None:
        check_tensor("scale", scale, device=device, dtypes=(dtype,), numel=1)
    if out is None:
        out = torch.empty(numel, dtype=dtype, device=device)
    else:
        check_tensor("out", out, device=device, dtypes=(dtype,), numel=numel)
    _decode(bits, scale, out, _decode_plan(numel, dtype, *_grid_bounds(runner, device)), runner, device)
    return out
