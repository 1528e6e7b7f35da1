"""Per-group stochastic-rounding quantization (ActNN / GACT): the format, specified in torch, that the CUDA
kernels (``lightning_act/cuda/quantize.cu``) reproduce bit for bit.

Inputs are float32, float16, bfloat16 or float64; each element is read as float32 (float64 rounded to nearest
even, once), and everything below is float32 arithmetic. Encode, for the flattened tensor split into groups of
``group_size`` elements (the last may be short):

    mn, mx = min, max of the group in float32 (NaN propagates)
    step   = (mx - mn) / (2**bits - 1)                    stored with mn in ``stats_dtype``
    inv    = 1 / step if step > 0 else 0                  (from the stored, rounded step)
    q      = clamp(floor((x - mn) * inv + u), 0, 2**bits - 1),   NaN -> 0
    u      = rng.uniform24(stream_base(seed, key), element index)

Decode: ``x' = mn + q * step`` in float32, cast to the input dtype. Every operation is a single IEEE
float32 operation (no fused multiply-add), so the kernels reproduce it bit for bit. With bfloat16 statistics,
``mn`` is rounded down and ``step`` up, so the grid still covers the group. ``E[x'] = x`` and ``|x' - x| <=
step`` (plus float32's rounding of a float64 input). A group holding NaN or +-Inf decodes to NaN: non-finite
values never come back silently finite.

NaN: every NaN this format stores (``mn``, ``step``, the bfloat16 copy of ``bits=16``) or decodes is the one
canonical NaN of its dtype, ``CANONICAL_NAN`` (positive, quiet, no payload: 0x7fc00000 float32, 0x7e00
float16, 0x7fc0 bfloat16, 0x7ff8000000000000 float64), written through an integer view. NaN payloads are not
portable (x86 propagates an operand's, a GPU returns 0x7fffffff, casts to bfloat16 differ between code paths),
so without this the same tensor would store different bytes on CPU, on CUDA and in the kernels. Only the
lossless raw forms (``bits=32``, ``bits=16`` of 16-bit inputs) keep the input's NaN bits.
"""
from __future__ import annotations

import torch

from .. import rng
from ._bitpack import pack_codes, packed_nbytes, unpack_codes
from .floats import canonical_nan_

STATS_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
def _div_levels(d: torch.Tensor, levels: int) -> torch.Tensor:
    """``d / levels`` as one IEEE division on every device: on CUDA, torch turns division by a Python scalar
    into a multiplication by its reciprocal (off by one ulp for levels 3, 15, 255), a tensor divisor it does not."""
    return d / torch.full_like(d, levels)


def _round_stats(mn: torch.Tensor, mx: torch.Tensor, levels: int, dtype: torch.dtype):
    """Group statistics in the stored dtype: mn rounded down, step rounded up (float32: exact); NaN canonical."""
    if dtype == torch.float32:
        return canonical_nan_(mn), canonical_nan_(_div_levels(mx - mn, levels))
    mn_s = mn.to(dtype)
    mn_s = torch.where(mn_s.float() > mn, torch.nextafter(mn_s, mn_s.new_tensor(float("-inf"))), mn_s)
    step = _div_levels(mx - mn_s.float(), levels)
    step_s = step.to(dtype)
    step_s = torch.where(step_s.float() < step, torch.nextafter(step_s, step_s.new_tensor(float("inf"))), step_s)
    return canonical_nan_(mn_s), canonical_nan_(step_s)


def _as_groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """A flat float32 chunk that starts on a group boundary as (groups, group_size); the short last group is
    padded with copies of its last element, which leaves its min and max unchanged."""
    x = x.float()
    pad = (-x.numel()) % group_size
    if pad:
        x = torch.cat([x, x[-1:].expand(pad)])
    return x.view(-1, group_size)


def quantize_reference(x: torch.Tensor, bits: int, group_size: int, stats_dtype: torch.dtype, seed: int, key: int):
    """Torch specification of the encode kernel: ``(payload uint8, mn, step)``."""
    flat = x.reshape(-1)
    n = flat.numel()
    levels = (1 << bits) - 1
    groups = -(-n // group_size)
    payload = torch.empty(packed_nbytes(n, bits), dtype=torch.uint8, device=x.device)
    mn_out = torch.empty(groups, dtype=stats_dtype, device=x.device)
    step_out = torch.empty(groups, dtype=stats_dtype, device=x.device)
    base = rng.stream_base(seed, key)
    chunk_groups = max(1, rng.CHUNK_ELEMENTS // group_size)
    for g0 in range(0, groups, chunk_groups):
        g1 = min(groups, g0 + chunk_groups)
        e0, e1 = g0 * group_size, min(n, g1 * group_size)
        xg = _as_groups(flat[e0:e1], group_size)
        mn_s, step_s = _round_stats(xg.amin(dim=1), xg.amax(dim=1), levels, stats_dtype)
        mn_out[g0:g1], step_out[g0:g1] = mn_s, step_s
        step32 = step_s.float()
        inv = torch.where(step32 > 0, 1.0 / step32, torch.zeros_like(step32))
        t = (xg - mn_s.float()[:, None]).mul_(inv[:, None])
        t += rng.uniform24(base, e0, xg.numel(), x.device).view_as(t)
        t.floor_()
        # comparisons are False for NaN, so NaN lands on 0 exactly as in the kernel
        q = torch.where(t >= levels, float(levels), torch.where(t > 0, t, 0.0)).to(torch.uint8)
        payload[e0 * bits // 8 : packed_nbytes(e1, bits)] = pack_codes(q.view(-1)[: e1 - e0], bits)
    return payload, mn_out, step_out


def dequantize_reference(payload, mn, step, numel: int, bits: int, group_size: int, dtype: torch.dtype):
    """Torch specification of the decode kernel: a flat tensor of ``numel`` elements in ``dtype``."""
    out = torch.empty(numel, dtype=dtype, device=payload.device)
    chunk = max(1, rng.CHUNK_ELEMENTS // group_size) * group_size
    for e0 in range(0, numel, chunk):
        e1 = min(numel, e0 + chunk)
        g0, g1 = e0 // group_size, -(-e1 // group_size)
        codes = unpack_codes(payload[e0 * bits // 8 : packed_nbytes(e1, bits)], bits, e1 - e0)
        q = torch.zeros((g1 - g0) * group_size, dtype=torch.float32, device=payload.device)
        q[: e1 - e0] = codes
        x = q.view(-1, group_size).mul_(step[g0:g1].float()[:, None]).add_(mn[g0:g1].float()[:, None])
        out[e0:e1] = x.view(-1)[: e1 - e0]
    return canonical_nan_(out)
