"""Per-group stochastic-rounding quantization (ActNN / GACT), the specification for the CUDA kernels.

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

NaN: every NaN this codec stores (``mn``, ``step``, the bfloat16 copy of ``bits=16``) or decodes is the one
canonical NaN of its dtype, ``CANONICAL_NAN`` (positive, quiet, no payload: 0x7fc00000 float32, 0x7e00
float16, 0x7fc0 bfloat16, 0x7ff8000000000000 float64), written through an integer view. NaN payloads are not
portable (x86 propagates an operand's, a GPU returns 0x7fffffff, casts to bfloat16 differ between code paths),
so without this the same tensor would store different bytes on CPU, on CUDA and in the kernels. Only the
lossless raw forms (``bits=32``, ``bits=16`` of 16-bit inputs) keep the input's NaN bits.
"""
from __future__ import annotations

import torch

from .. import rng
from .._validate import check_choice, check_int
from . import register
from ._bitpack import PACKABLE_BITS, pack_codes, packed_nbytes, unpack_codes
from .base import Codec, Packed

ALLOWED_BITS = (1, 2, 4, 8, 16, 32)
STATS_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BACKENDS = ("auto", "torch", "cupy")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# The one NaN the codecs store per dtype (what torch.where(isnan(x), nan, x) writes on CPU), and the integer
# dtype it is written through.
INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
            torch.float64: torch.int64}
CANONICAL_NAN = {torch.float32: 0x7FC00000, torch.float16: 0x7E00, torch.bfloat16: 0x7FC0,
                 torch.float64: 0x7FF8000000000000}


def check_float_input(codec: str, x: torch.Tensor) -> None:
    """Raise ValueError naming the given dtype and the allowed ones unless ``x`` is a float tensor a codec takes."""
    if x.dtype not in FLOAT_DTYPES:
        allowed = "/".join(str(d).removeprefix("torch.") for d in FLOAT_DTYPES)
        raise ValueError(f"{codec} codec takes {allowed} tensors; got dtype={x.dtype}")


def canonical_nan_(t: torch.Tensor) -> torch.Tensor:
    """Overwrite every NaN of ``t`` with ``CANONICAL_NAN`` of its dtype, in place, and return ``t``. Bits are
    written through an integer view: a float NaN constant would be cast, and casts of NaN differ by device."""
    t.view(INT_VIEW[t.dtype]).masked_fill_(torch.isnan(t), CANONICAL_NAN[t.dtype])
    return t


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


@register
class QuantizeCodec(Codec):
    """``bits`` in 1/2/4/8: per-group stochastic rounding; 16: bfloat16 cast (16-bit inputs kept); 32: raw."""

    name = "quantize"
    dtypes = frozenset(FLOAT_DTYPES)

    def __init__(self, bits: int = 4, group_size: int = 256, stats_dtype: str = "float32", seed: int = 0,
                 backend: str = "auto"):
        check_choice("bits", bits, ALLOWED_BITS)
        check_int("group_size", group_size, minimum=32, multiple_of=32)
        check_choice("stats_dtype", stats_dtype, STATS_DTYPES)
        check_int("seed", seed, minimum=0)
        check_choice("backend", backend, BACKENDS)
        self.bits, self.group_size, self.seed, self.backend = bits, group_size, seed, backend
        self.stats_dtype = STATS_DTYPES[stats_dtype]
        if backend == "cupy":
            from ..cuda import require_cupy

            require_cupy()

    def encode(self, x: torch.Tensor, *, key: int = 0) -> Packed:
        check_float_input(self.name, x)
        if self.bits == 32 or (self.bits == 16 and x.element_size() == 2):
            return Packed(self.name, x.shape, x.dtype, x.device, {"raw": x.contiguous()}, {"bits": self.bits})
        if self.bits == 16:
            return Packed(self.name, x.shape, x.dtype, x.device, {"raw": canonical_nan_(x.to(torch.bfloat16))},
                          {"bits": 16})
        if self._use_cupy(x):
            from ..cuda.quantize import quantize_cuda

            payload, mn, step = quantize_cuda(x.contiguous(), self.bits, self.group_size, self.stats_dtype,
                                              self.seed, key)
        else:
            payload, mn, step = quantize_reference(x, self.bits, self.group_size, self.stats_dtype, self.seed, key)
        return Packed(self.name, x.shape, x.dtype, x.device, {"payload": payload, "mn": mn, "step": step},
                      {"bits": self.bits, "group_size": self.group_size})

    def decode(self, packed: Packed) -> torch.Tensor:
        if "raw" in packed.buffers:
            raw = packed.buffers["raw"]
            if raw.dtype == packed.dtype:  # lossless: the input's own bits
                return raw.view(packed.shape)
            return canonical_nan_(raw.to(packed.dtype)).view(packed.shape)
        b = packed.buffers
        args = (b["payload"], b["mn"], b["step"], packed.numel, packed.meta["bits"], packed.meta["group_size"],
                packed.dtype)
        if self._use_cupy(b["payload"]):
            from ..cuda.quantize import dequantize_cuda

            return dequantize_cuda(*args).view(packed.shape)
        return dequantize_reference(*args).view(packed.shape)

    def _use_cupy(self, t: torch.Tensor) -> bool:
        from ..cuda import use_cupy_kernels
        from ..cuda.quantize import supports

        return use_cupy_kernels(self.backend, t, supports(self.bits, self.group_size))

    def bits_per_element(self, x: torch.Tensor) -> float:
        if self.bits in PACKABLE_BITS:
            return float(self.bits)
        return 8.0 * x.element_size() if self.bits == 32 else 16.0
