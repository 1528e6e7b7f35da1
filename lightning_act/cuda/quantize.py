"""Launchers of ``quantize.cu``: the same signatures and bits as ``quantize_reference`` / ``dequantize_reference``.

Both kernels give each group a team of threads, one 8-element chunk per thread (held in registers), so a group
spans at most a block of ``MAX_THREADS`` threads, which caps ``group_size``; grids are sized to the GPU's SM
count (``launcher.multiprocessors``) and stride over the groups.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
import torch

from .. import rng
from ..formats._bitpack import PACKABLE_BITS, packed_nbytes
from . import launcher
from .launcher import (
    DTYPE_CODES,
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


class _Plan(NamedTuple):
    """What a launch needs besides pointers and the noise, built once per format, dtype and size."""

    layout: BufferLayout  # of (payload, mn, step)
    grid: tuple
    block: tuple
    shared: int
    args: tuple  # the kernel's scalar arguments that follow the input pointer (encode) or the parts (decode)
    last: np.int32  # the last argument: the dtype code of the statistics (encode) or of the output (decode)


# One entry per (format, dtype, numel) met: a model saves a few hundred distinct sizes; varying sequence lengths
# add more, so the caches are bounded. ``max_blocks`` is launcher.MAX_BLOCKS (tests lower it).
_PLANS_PER_FORMAT = 4096


@functools.lru_cache(maxsize=_PLANS_PER_FORMAT)
def encoded_layout(numel: int, bits: int, group_size: int, stats_dtype: torch.dtype) -> BufferLayout:
    """Where the encode kernel's one buffer holds ``payload``, ``mn`` and ``step`` for ``numel`` elements."""
    groups = -(-numel // group_size)
    return buffer_layout((("payload", packed_nbytes(numel, bits), torch.uint8), ("mn", groups, stats_dtype),
                          ("step", groups, stats_dtype)))


@functools.lru_cache(maxsize=_PLANS_PER_FORMAT)
def _encode_plan(numel: int, dtype: torch.dtype, bits: int, group_size: int, stats_dtype: torch.dtype,
                 multiprocessors: int, max_blocks: int) -> _Plan:
    layout = encoded_layout(numel, bits, group_size, stats_dtype)
    grid, block, shared = _config(numel, group_size, multiprocessors, max_blocks) if numel else (None, None, 0)
    args = (np.int32(DTYPE_CODES[dtype]), np.int64(numel), np.int32(bits), np.int32(group_size))
    return _Plan(layout, grid, block, shared, args, np.int32(DTYPE_CODES[stats_dtype]))


@functools.lru_cache(maxsize=_PLANS_PER_FORMAT)
def _decode_plan(numel: int, dtype: torch.dtype, bits: int, group_size: int, stats_dtype: torch.dtype,
                 multiprocessors: int, max_blocks: int) -> _Plan:
    grid, block, shared = _config(numel, group_size, multiprocessors, max_blocks) if numel else (None, None, 0)
    args = (np.int32(DTYPE_CODES[stats_dtype]), np.int64(numel), np.int32(bits), np.int32(group_size))
    return _Plan(None, grid, block, shared, args, np.int32(DTYPE_CODES[dtype]))


def _encode(x: torch.Tensor, plan: _Plan, pointers: tuple, seed: int, key: int, runner: KernelRunner,
            device: torch.device) -> None:
    if plan.grid is not None:
        args = (pointer(x), *plan.args, np.uint32(rng.stream_base(seed, key)), *pointers, plan.last)
        runner.launch(SOURCE, "quantize_encode", plan.grid, plan.block, args, plan.shared, device)


def quantize_cuda(x: torch.Tensor, bits: int, group_size: int, stats_dtype: torch.dtype, seed: int, key: int, *,
                  runner: KernelRunner | None = None, out=None, checked: bool = True):
    """Encode kernel: ``(payload uint8, mn, step)`` bit-identical to ``quantize_reference``, views of one
    allocation.

    ``x`` must be contiguous; ``out`` may give preallocated ``(payload, mn, step)``. ``checked=False`` skips the
    argument checks, for callers that checked the format once and pass contiguous tensors of a kernel dtype."""
    runner = runner or default_runner()
    numel = x.numel()
    if checked:
        _check_format(bits, group_size, stats_dtype)
        check_runner_device(runner, x.device)
        check_tensor("x", x, device=x.device, dtypes=tuple(DTYPE_CODES))
    plan = _encode_plan(numel, x.dtype, bits, group_size, stats_dtype, launcher.multiprocessors(runner, x.device),
                        launcher.MAX_BLOCKS)
    if out is None:
        out = tuple(OneBuffer.empty(plan.layout, x.device).values())
    elif checked:
        _check_out(out, numel, bits, group_size, stats_dtype, x.device)
    _encode(x, plan, tuple(map(pointer, out)), seed, key, runner, x.device)
    return tuple(out)


def _check_out(out, numel: int, bits: int, group_size: int, stats_dtype: torch.dtype, device: torch.device) -> None:
    payload, mn, step = out
    _check_packed(payload, mn, step, numel, bits, group_size, device)
    if mn.dtype != stats_dtype:
        raise ValueError(f"mn and step must have dtype {stats_dtype}; got {mn.dtype}")
    if payload.data_ptr() % 4:
        raise ValueError(f"payload must be 4-byte aligned (encode writes 32-bit words); got data_ptr % 4 == "
                         f"{payload.data_ptr() % 4}")


def _decode(pointers: tuple, plan: _Plan, out: torch.Tensor, runner: KernelRunner, device: torch.device) -> None:
    if plan.grid is not None:
        args = (*pointers, *plan.args, pointer(out), plan.last)
        runner.launch(SOURCE, "quantize_decode", plan.grid, plan.block, args, plan.shared, device)


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
    plan = _decode_plan(numel, dtype, bits, group_size, mn.dtype, launcher.multiprocessors(runner, device),
                        launcher.MAX_BLOCKS)
    _decode((pointer(payload), pointer(mn), pointer(step)), plan, out, runner, device)
    return out


class QuantizeKernels:
    """The codec's kernel path for one format: :func:`quantize_cuda` and :func:`dequantize_cuda` without argument
    checks (the codec checked the format once and passes contiguous tensors of a kernel dtype), the encoded parts
    ``payload``, ``mn`` and ``step`` as a :class:`OneBuffer`, decoded straight into a tensor of the saved shape.

    It runs for every saved tensor, so a launch costs one dictionary lookup for its plan (per size, dtype, device
    and runner), one allocation, one hash of the noise key and the launch itself."""

    __slots__ = ("bits", "group_size", "stats_dtype", "_seed_hash", "_encodes", "_decodes")

    def __init__(self, bits: int, group_size: int, stats_dtype: torch.dtype, seed: int):
        self.bits, self.group_size, self.stats_dtype = bits, group_size, stats_dtype
        self._seed_hash = rng.seed_hash(seed)
        self._encodes: dict[tuple, _Plan] = {}
        self._decodes: dict[tuple, tuple[_Plan, tuple[int, ...]]] = {}

    def _build(self, build, numel: int, dtype: torch.dtype, device: torch.device, runner: KernelRunner) -> _Plan:
        return build(numel, dtype, self.bits, self.group_size, self.stats_dtype,
                     launcher.multiprocessors(runner, device), launcher.MAX_BLOCKS)

    def encode(self, x: torch.Tensor, key: int, runner: KernelRunner) -> OneBuffer:
        numel, dtype, device = x.numel(), x.dtype, x.device
        plans = self._encodes
        plan = plans.get((numel, dtype, device, runner))
        if plan is None:
            if len(plans) >= _PLANS_PER_FORMAT:  # sizes met so far: bounded, as the module's plan caches are
                plans.clear()
            plan = plans[(numel, dtype, device, runner)] = self._build(_encode_plan, numel, dtype, device, runner)
        buffers = OneBuffer(torch.empty(plan.layout.total, dtype=torch.uint8, device=device), plan.layout)
        if plan.grid is not None:
            runner.launch(SOURCE, "quantize_encode", plan.grid, plan.block,
                          (np.uint64(x.data_ptr()), *plan.args, np.uint32(rng.keyed_stream_base(self._seed_hash, key)),
                           *buffers.pointers(), plan.last), plan.shared, device)
        return buffers

    def decode(self, buffers: OneBuffer, shape: torch.Size, dtype: torch.dtype, runner: KernelRunner
               ) -> torch.Tensor:
        device = buffers.data.device
        plans = self._decodes
        found = plans.get((shape, dtype, device, runner))
        if found is None:  # the plan, and the shape as a tuple (torch.empty parses a torch.Size twice as slowly)
            if len(plans) >= _PLANS_PER_FORMAT:
                plans.clear()
            plan = self._build(_decode_plan, math.prod(shape), dtype, device, runner)
            found = plans[(shape, dtype, device, runner)] = (plan, tuple(shape))
        plan, dims = found
        out = torch.empty(dims, dtype=dtype, device=device)
        if plan.grid is not None:
            runner.launch(SOURCE, "quantize_decode", plan.grid, plan.block,
                          (*buffers.pointers(), *plan.args, np.uint64(out.data_ptr()), plan.last), plan.shared, device)
        return out
