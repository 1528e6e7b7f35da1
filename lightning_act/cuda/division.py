"""Launchers of ``division.cu``: the same signatures and bits as ``division_encode_reference`` /
``division_decode_reference``.

Encode and decode are one launch each on the current stream: one block per plane (a thread per 8 elements, up to
``THREADS``), the grid sized to the SM count, grid-stride over planes. Encode stages a plane of up to
``STAGE_MAX`` elements in shared memory, so DRAM sees it once.

The codec runs :func:`division_encode_cuda_packed` / :func:`division_decode_cuda_packed` for every saved tensor:
one cached plan per (planes, spatial, dtype, format) holds the buffer layout, grid and scalar arguments, so an
encode is one plan lookup, one allocation (a :class:`~lightning_act.cuda.launcher.OneBuffer` of ``lfc``,
``payload``, ``mn``, ``step``) and one launch, and a decode one lookup, one allocation and one launch.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
import torch

from .. import rng
from ..formats._bitpack import PACKABLE_BITS, packed_nbytes
from ..formats.division import MAX_SPATIAL_DIMS, block_counts
from . import launcher
from .launcher import (DTYPE_CODES, BufferLayout, KernelRunner, OneBuffer, buffer_layout, check_dtype,
                       check_runner_device, check_tensor, default_runner, pointer)

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


class _Plan(NamedTuple):
    """What the launches of one format, dtype and size need besides pointers and the noise, built once."""

    layout: BufferLayout  # of the encoded form: (lfc, payload, mn, step)
    lfc_shape: tuple[int, ...]  # planes x blocks
    grid: tuple | None  # None: an empty tensor, nothing to launch
    block: tuple | None
    shared: int  # the encode's dynamic shared memory (its stage)
    encode_args: tuple  # the encode's scalars between the input pointer and the noise: x_dtype .. bits
    stage: np.int32
    decode_args: tuple  # the decode's scalars between the parts and the output pointer: planes .. bits
    code: np.int32  # the dtype of the input (encode) and of the output (decode)


@functools.lru_cache(maxsize=4096)  # one entry per (format, dtype, size) met; ``max_blocks``: launcher.MAX_BLOCKS
def _plan(planes: int, spatial: tuple[int, ...], dtype: torch.dtype, block: int, bits: int, multiprocessors: int,
          max_blocks: int) -> _Plan:
    """Raises ValueError for a layout the kernels do not take (:func:`_layout_args`)."""
    layout_args = _layout_args(spatial, block)
    blocks = block_counts(spatial, block)
    plane = math.prod(spatial)
    layout = buffer_layout((("lfc", planes * math.prod(blocks), torch.bfloat16),
                            ("payload", packed_nbytes(planes * plane, bits), torch.uint8),
                            ("mn", planes, torch.bfloat16), ("step", planes, torch.bfloat16)))
    grid, threads = _config(planes, plane, multiprocessors, max_blocks) if planes else (None, None)
    stage, code = plane <= STAGE_MAX, np.int32(DTYPE_CODES[dtype])
    decode_args = (np.int64(planes), *layout_args, np.int32(bits))
    return _Plan(layout, (planes, *blocks), grid, threads, 4 * plane if stage else 0, (code, *decode_args),
                 np.int32(stage), decode_args, code)


def _get_plan(planes, spatial, dtype, block, bits, runner: KernelRunner, device: torch.device) -> _Plan:
    return _plan(planes, spatial, dtype, block, bits, launcher.multiprocessors(runner, device), launcher.MAX_BLOCKS)


def _encode(x: torch.Tensor, plan: _Plan, buffers: OneBuffer, seed: int, key: int, runner: KernelRunner,
            device: torch.device) -> None:
    if plan.grid is not None:
        runner.launch(SOURCE, "division_encode", plan.grid, plan.block,
                      (pointer(x), *plan.encode_args, np.uint32(rng.stream_base(seed, key)), plan.stage,
                       *buffers.pointers()), plan.shared, device)


def _decode(parts: tuple, plan: _Plan, out: torch.Tensor, runner: KernelRunner, device: torch.device) -> None:
    """``parts``: the pointers of (lfc, payload, mn, step); the kernel takes the payload first."""
    if plan.grid is not None:
        lfc, payload, mn, step = parts
        runner.launch(SOURCE, "division_decode", plan.grid, plan.block,
                      (payload, lfc, mn, step, *plan.decode_args, pointer(out), plan.code), 0, device)


def division_encode_cuda(x: torch.Tensor, block: int, bits: int, seed: int, key: int, *,
                         runner: KernelRunner | None = None, checked: bool = True):
    """Encode kernels: ``(lfc, payload, mn, step)`` bit-identical to ``division_encode_reference`` for ``x``
    (contiguous) viewed as ``planes x spatial``; views of one allocation. ``checked=False`` skips the argument
    checks (the layout's are made once per size, when its plan is built)."""
    runner = runner or default_runner()
    if checked:
        _check_bits(bits)
        check_runner_device(runner, x.device)
        check_tensor("x", x, device=x.device, dtypes=tuple(DTYPE_CODES))
        if x.dim() < 2:
            raise ValueError(f"x must be planes x spatial (2 to {MAX_SPATIAL_DIMS + 1} dims); got shape "
                             f"{tuple(x.shape)}")
    plan = _get_plan(x.shape[0], tuple(x.shape[1:]), x.dtype, block, bits, runner, x.device)
    buffers = OneBuffer.empty(plan.layout, x.device)
    _encode(x, plan, buffers, seed, key, runner, x.device)
    lfc, payload, mn, step = buffers.values()
    return lfc.view(plan.lfc_shape), payload, mn, step


def division_encode_cuda_packed(x: torch.Tensor, planes: int, spatial: tuple[int, ...], block: int, bits: int,
                                seed: int, key: int, *, runner: KernelRunner | None = None) -> OneBuffer:
    """:func:`division_encode_cuda` for the codec, which runs it for every saved tensor: ``x`` (contiguous, of a
    kernel dtype, ``planes x spatial`` elements in any shape) encoded into a :class:`OneBuffer` of ``lfc`` (flat),
    ``payload``, ``mn`` and ``step`` (no views built), without argument checks: the codec checked the format
    once."""
    runner = runner or default_runner()
    device = x.device
    plan = _get_plan(planes, spatial, x.dtype, block, bits, runner, device)
    buffers = OneBuffer(torch.empty(plan.layout.total, dtype=torch.uint8, device=device), plan.layout)
    _encode(x, plan, buffers, seed, key, runner, device)
    return buffers


def division_decode_cuda(lfc, payload, mn, step, planes: int, spatial: tuple[int, ...], block: int, bits: int,
                         dtype: torch.dtype, *, runner: KernelRunner | None = None, checked: bool = True
                         ) -> torch.Tensor:
    """Decode kernel: ``planes x spatial`` in ``dtype``, bit-identical to ``division_decode_reference``.
    ``checked=False``: as for :func:`division_encode_cuda`, for buffers this package's encode made."""
    runner = runner or default_runner()
    device = payload.device
    spatial = tuple(spatial)
    if checked:
        _layout_args(spatial, block)
        _check_bits(bits)
        check_runner_device(runner, device)
        _check_packed(lfc, payload, mn, step, planes, spatial, block, bits, device)
        check_dtype("dtype", dtype)
    plan = _get_plan(planes, spatial, dtype, block, bits, runner, device)
    out = torch.empty(planes, *spatial, dtype=dtype, device=device)
    _decode((pointer(lfc), pointer(payload), pointer(mn), pointer(step)), plan, out, runner, device)
    return out


def division_decode_cuda_packed(buffers: OneBuffer, shape: torch.Size, planes: int, spatial: tuple[int, ...],
                                block: int, bits: int, dtype: torch.dtype, *, runner: KernelRunner | None = None
                                ) -> torch.Tensor:
    """:func:`division_decode_cuda` for the codec: decodes what :func:`division_encode_cuda_packed` stored
    straight into a tensor of ``shape`` (``planes x spatial`` elements), without argument checks."""
    runner = runner or default_runner()
    device = buffers.data.device
    out = torch.empty(shape, dtype=dtype, device=device)
    _decode(buffers.pointers(), _get_plan(planes, spatial, dtype, block, bits, runner, device), out, runner, device)
    return out
