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

Two torch implementations: ``quantize_spec`` / ``dequantize_spec`` are the specification, written to be read
(whole-tensor temporaries); ``quantize_reference`` / ``dequantize_reference`` compute the same bits fast (what
the codecs and the kernel tests run): chunks of whole groups bounded by ``chunk_elements(device)`` (a core's L2
share per torch thread on CPU) in two buffers reused from chunk to chunk (8 bytes per chunk element), the random
numbers in int32 (``rng.uniform24_codes_``), every pass over a chunk a whole-chunk torch op (about 30 per chunk,
half of them the random numbers'), codes by int16 truncation, bit packing by one multiplication per word. On CPU,
a large tensor skips the NaN and range handling, which only groups with non-finite statistics or ``1 / step``
need, and encodes the chunks holding such groups again with it (``encode_chunks``).
"""
from __future__ import annotations

import torch

import math

from .. import rng
from ._bitpack import pack_codes, pack_codes_, packed_nbytes, unpack_codes, unpack_codes_
from .floats import canonical_nan_

STATS_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Elements per chunk of the fast path, whose buffers take 8 bytes per element whatever the tensor size: on CPU
# 2**17 per torch thread (each thread's share, 1 MiB of buffers, stays in its core's L2 while ~30 passes run over
# it); on a GPU a chunk is 4 Mi elements (32 MiB, a GPU's L2 order), so the ~35 kernel launches per chunk stay few.
CHUNK_ELEMENTS = 1 << 17
GPU_CHUNK_ELEMENTS = 1 << 22


def chunk_elements(device: torch.device) -> int:
    return CHUNK_ELEMENTS * torch.get_num_threads() if device.type == "cpu" else GPU_CHUNK_ELEMENTS


def _div_levels(d: torch.Tensor, levels: int) -> torch.Tensor:
    """``d / levels`` as one IEEE division on every device: on CUDA, torch turns division by a Python scalar
    into a multiplication by its reciprocal (off by one ulp for levels 3, 15, 255), a tensor divisor it does not."""
    return d / torch.full_like(d, levels)


def _infinity(like: torch.Tensor, sign: int) -> torch.Tensor:
    """``sign`` x infinity as a 0-d tensor of ``like``'s dtype and device, filled there: ``new_tensor`` would copy it
    from the host, which on CUDA waits for the device."""
    return torch.full((), sign * float("inf"), dtype=like.dtype, device=like.device)


def _round_stats(mn: torch.Tensor, mx: torch.Tensor, levels: int, dtype: torch.dtype):
    """Group statistics in the stored dtype: mn rounded down, step rounded up (float32: exact); NaN canonical."""
    if dtype == torch.float32:
        return canonical_nan_(mn), canonical_nan_(_div_levels(mx - mn, levels))
    mn_s = mn.to(dtype)
    mn_s = torch.where(mn_s.float() > mn, torch.nextafter(mn_s, _infinity(mn_s, -1)), mn_s)
    step = _div_levels(mx - mn_s.float(), levels)
    step_s = step.to(dtype)
    step_s = torch.where(step_s.float() < step, torch.nextafter(step_s, _infinity(step_s, 1)), step_s)
    return canonical_nan_(mn_s), canonical_nan_(step_s)


def _as_groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """A flat tensor as float32 (groups, group_size); the short last group is padded with copies of its last
    element, which leaves its min and max unchanged."""
    x = x.float()
    pad = (-x.numel()) % group_size
    if pad:
        x = torch.cat([x, x[-1:].expand(pad)])
    return x.view(-1, group_size)


def quantize_spec(x: torch.Tensor, bits: int, group_size: int, stats_dtype: torch.dtype, seed: int, key: int):
    """The specification of encode: ``(payload uint8, mn, step)``."""
    flat = x.reshape(-1)
    n = flat.numel()
    levels = (1 << bits) - 1
    if n == 0:
        return (torch.empty(0, dtype=torch.uint8, device=x.device), torch.empty(0, dtype=stats_dtype, device=x.device),
                torch.empty(0, dtype=stats_dtype, device=x.device))
    xg = _as_groups(flat, group_size)
    mn_s, step_s = _round_stats(xg.amin(dim=1), xg.amax(dim=1), levels, stats_dtype)
    step32 = step_s.float()
    inv = torch.where(step32 > 0, 1.0 / step32, torch.zeros_like(step32))
    t = (xg - mn_s.float()[:, None]).mul_(inv[:, None])
    t += rng.uniform24(rng.stream_base(seed, key), 0, xg.numel(), x.device).view_as(t)
    t.floor_()
    # comparisons are False for NaN, so NaN lands on 0 exactly as in the kernel
    q = torch.where(t >= levels, float(levels), torch.where(t > 0, t, 0.0)).to(torch.uint8)
    return pack_codes(q.view(-1)[:n], bits), mn_s, step_s


def dequantize_spec(payload, mn, step, numel: int, bits: int, group_size: int, dtype: torch.dtype):
    """The specification of decode: a flat tensor of ``numel`` elements in ``dtype``."""
    groups = -(-numel // group_size)
    q = torch.zeros(groups * group_size, dtype=torch.float32, device=payload.device)
    q[:numel] = unpack_codes(payload, bits, numel)
    x = q.view(groups, group_size).mul_(step.float()[:, None]).add_(mn.float()[:, None])
    return canonical_nan_(x.view(-1)[:numel].to(dtype))


def groups_per_chunk(group_size: int, bits: int, elements: int) -> int:
    """Whole groups per chunk of about ``elements`` (at least one group): a multiple of the groups whose codes
    fill whole bytes, so every chunk's codes start on a byte of the payload."""
    align = 8 // math.gcd(group_size * bits, 8)
    return align * max(1, elements // (group_size * align))


class Workspace:
    """The buffers the fast path reuses from chunk to chunk, for chunks of up to ``capacity`` elements: ``values``
    (float32) and ``words`` (int32), whose bytes also hold the random words' scratch, the float32 noise and the
    16-bit and 8-bit codes in turn (8 bytes per element in all); and the views of them a chunk shape uses."""

    def __init__(self, capacity: int, device: torch.device):
        capacity = -(-capacity // 8) * 8 + 8  # room to pad the codes to whole words
        self.values = torch.empty(capacity, dtype=torch.float32, device=device)
        self.words = torch.empty(capacity, dtype=torch.int32, device=device)
        self._views: dict[tuple[int, int, int, int], _ChunkViews] = {}

    def views(self, m: int, groups: int, group_size: int, bits: int) -> "_ChunkViews":
        """The views of the buffers for a chunk of ``m`` elements in ``groups`` groups (built once per shape: every
        chunk but the last shares them)."""
        key = (m, groups, group_size, bits)
        if key not in self._views:
            self._views[key] = _ChunkViews(self, m, groups, group_size, bits)
        return self._views[key]


class _ChunkViews:
    """Views of a :class:`Workspace` for one chunk shape, in the order :func:`encode_groups` uses them."""

    def __init__(self, ws: Workspace, m: int, groups: int, group_size: int, bits: int):
        padded = groups * group_size
        values, words = ws.values[:padded], ws.words[:padded]
        self.words, self.scratch, self.noise = words, values.view(torch.int32), words.view(torch.float32)
        self.values, self.head, self.tail = values.view(groups, group_size), values[:m], values[m:]
        self.wide = words.view(torch.int16)[:m]  # the codes, 16 bits each, then 8 (below)
        whole = -(-m // (8 // bits)) * (8 // bits)
        codes = ws.values.view(torch.uint8)[:whole]
        self.codes, self.codes_head = codes, codes[:m]
        self.codes_tail = codes[m:] if whole > m else None
        self.last = values[m - 1] if m < padded else None


def _group_stats(xg: torch.Tensor, levels: int, stats_dtype: torch.dtype, mn_out: torch.Tensor,
                 step_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Statistics of the float32 groups ``xg`` as :func:`quantize_spec` computes them, written into ``mn_out`` /
    ``step_out`` (NaN left as computed: the caller canonicalises the outputs once); returns float32 ``mn``,
    ``step`` and ``inv`` for the elementwise pass."""
    mx = xg.amax(dim=1)  # aminmax is slower on CPU
    if stats_dtype == torch.float32:
        mn = torch.amin(xg, dim=1, out=mn_out)
        step = torch.div(mx.sub_(mn), torch.full_like(mx, levels), out=step_out)
        return mn, step, _inverse(step)
    mn = xg.amin(dim=1)
    mn_s = mn_out.copy_(mn)  # rounded to nearest, then down where that went up
    mn_s.copy_(torch.where(mn_s.float() > mn, torch.nextafter(mn_s, _infinity(mn_s, -1)), mn_s))
    mn = mn_s.float()
    step = _div_levels(mx.sub_(mn), levels)
    step_s = step_out.copy_(step)  # rounded to nearest, then up where that went down
    step_s.copy_(torch.where(step_s.float() < step, torch.nextafter(step_s, _infinity(step_s, 1)), step_s))
    step = step_s.float()
    return mn, step, _inverse(step)


def _inverse(step: torch.Tensor) -> torch.Tensor:
    """``1 / step`` where ``step > 0``, else 0 (float32)."""
    return torch.where(step > 0, 1.0 / step, 0.0)


def nonfinite_groups(mn: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Groups whose stored statistics or ``1 / step`` are not finite (a boolean per group). Elsewhere ``t = (x - mn)
    * inv + u`` is NaN-free and in ``[0, levels + 2)``: ``x - mn`` is finite and at most ``mx - mn``, ``inv``
    about ``levels / (mx - mn)``; so the fast encode skips the NaN and range handling and redoes these groups."""
    mn, step = mn.float(), step.float()
    return ~(torch.isfinite(mn) & torch.isfinite(step) & torch.isfinite(_inverse(step)))


def encode_groups(x: torch.Tensor, start: int, group_size: int, bits: int, stats_dtype: torch.dtype, base: int,
                  ws: Workspace, payload: torch.Tensor, mn_out: torch.Tensor, step_out: torch.Tensor,
                  safe: bool = True) -> None:
    """Encode ``x`` (a flat chunk of any float dtype: ``mn_out.numel()`` groups, the last maybe short) whose first
    element has index ``start`` in its tensor: codes into ``payload`` (starting on a byte), statistics into
    ``mn_out`` / ``step_out`` (NaN not canonical yet: the caller canonicalises the outputs once). The same bits
    as :func:`quantize_spec` on the whole tensor; with ``safe=False`` only where :func:`nonfinite_groups` is
    False (the caller encodes the chunk again, safe, otherwise)."""
    m, groups = x.numel(), mn_out.numel()
    levels = (1 << bits) - 1
    v = ws.views(m, groups, group_size, bits)
    # random words first, with the values as their scratch; then k < 2**24 as float32 in place (exact)
    noise = v.noise.copy_(rng.uniform24_codes_(base, start, v.words, v.scratch))
    if x.dtype == torch.float32 and v.last is None:
        xg = x.view(groups, group_size)
    else:  # float32 copy, the short last group padded with its last element (min and max unchanged)
        v.head.copy_(x)
        if v.last is not None:
            v.tail.copy_(v.last)
        xg = v.values
    mn, step, inv = _group_stats(xg, levels, stats_dtype, mn_out, step_out)
    t = torch.sub(xg, mn[:, None], out=v.values).mul_(inv[:, None]).view(-1)
    t.add_(noise, alpha=2.0**-24)  # k * 2**-24 is exact: fused or not, one rounding
    if safe:  # NaN to 0 as the specification's comparisons do, and +-Inf into range
        t.nan_to_num_(0.0).clamp_(0, levels)
    # truncation is floor on t >= 0; 16-bit codes hold up to levels + 1, clamped below
    wide = v.wide.copy_(v.head)
    if bits == 8:
        payload.copy_(wide.clamp_max_(levels))
        return
    v.codes_head.copy_(wide)
    if v.codes_tail is not None:
        v.codes_tail.zero_()
    pack_codes_(v.codes.clamp_max_(levels), bits, payload)


def decode_groups(payload: torch.Tensor, mn: torch.Tensor, step: torch.Tensor, bits: int, group_size: int,
                  ws: Workspace, out: torch.Tensor, canonical_nan: bool) -> None:
    """Decode one chunk of ``mn.numel()`` groups (the last maybe short) into ``out`` (flat, its dtype), the
    inverse of :func:`encode_groups`; ``canonical_nan=False`` only when no output can be NaN."""
    m, groups = out.numel(), mn.numel()
    padded = groups * group_size
    values = ws.values[:padded]
    if bits == 8:
        values[:m] = payload
    else:  # codes in the words' bytes, the values' bytes as scratch until the codes are read
        codes = ws.words.view(torch.uint8)[: payload.numel() * (8 // bits)]
        values[:m] = unpack_codes_(payload, bits, codes, ws.values.view(torch.uint8))[:m]
    values[m:] = 0
    vg = values.view(groups, group_size).mul_(step.float()[:, None])
    if out.dtype == torch.float32 and m == padded:
        torch.add(vg, mn.float()[:, None], out=out.view(groups, group_size))
    else:
        out.copy_(vg.add_(mn.float()[:, None]).view(-1)[:m])
    if canonical_nan:
        canonical_nan_(out)


def may_decode_nan(*stats: torch.Tensor) -> bool:
    """Whether a decode with these statistics can produce NaN. With finite ``mn`` and ``step`` it cannot
    (``mn + q * step`` is finite or +inf); answered on the host for CPU tensors only: True on other devices,
    where the answer would cost a synchronisation. Checked chunk by chunk: the test's temporaries are a chunk's,
    not the statistics' (as large as a quarter of the decoded tensor for small groups or planes)."""
    if stats[0].device.type != "cpu":
        return True
    chunk = chunk_elements(stats[0].device)
    return not all(bool(torch.isfinite(flat[i:i + chunk]).all())
                   for flat in (s.reshape(-1) for s in stats) for i in range(0, flat.numel(), chunk))


def encoded_buffers(n: int, bits: int, group_size: int, stats_dtype: torch.dtype,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The empty ``(payload uint8, mn, step)`` an encode of ``n`` elements fills."""
    groups = -(-n // group_size)
    return (torch.empty(packed_nbytes(n, bits), dtype=torch.uint8, device=device),
            torch.empty(groups, dtype=stats_dtype, device=device), torch.empty(groups, dtype=stats_dtype, device=device))


def quantize_reference(x: torch.Tensor, bits: int, group_size: int, stats_dtype: torch.dtype, seed: int, key: int):
    """Encode, the same bits as :func:`quantize_spec`: ``(payload uint8, mn, step)``."""
    flat = x.reshape(-1)
    n = flat.numel()
    groups = -(-n // group_size)
    payload, mn_out, step_out = encoded_buffers(n, bits, group_size, stats_dtype, x.device)
    chunk = groups_per_chunk(group_size, bits, chunk_elements(x.device))
    ws = Workspace(min(groups, chunk) * group_size, x.device)
    base = rng.stream_base(seed, key)

    def encode(g0: int, safe: bool) -> None:
        g1 = min(groups, g0 + chunk)
        e0, e1 = g0 * group_size, min(n, g1 * group_size)
        encode_groups(flat[e0:e1], e0, group_size, bits, stats_dtype, base, ws,
                      payload[e0 * bits // 8 : packed_nbytes(e1, bits)], mn_out[g0:g1], step_out[g0:g1], safe)

    encode_chunks(encode, groups, chunk, mn_out, step_out, n)
    return payload, mn_out, step_out


def encode_chunks(encode, groups: int, chunk: int, mn: torch.Tensor, step: torch.Tensor, numel: int) -> None:
    """Run ``encode(g0, safe)`` for the chunks of ``chunk`` groups starting at ``g0`` (``numel`` elements in all),
    then canonicalise the NaN of the statistics ``mn`` / ``step`` (in place). On CPU, where reading the
    statistics back is cheap, a tensor of more than ``CHUNK_ELEMENTS`` elements is encoded without NaN and range
    handling (``safe=False``), then the chunks holding a group of :func:`nonfinite_groups` (NaN, +-Inf, overflow:
    rare) again with it; smaller tensors (where that check would cost more than it saves) and other devices (where
    it would cost a synchronisation) are encoded safe."""
    fast = mn.device.type == "cpu" and numel > CHUNK_ELEMENTS
    for g0 in range(0, groups, chunk):
        encode(g0, not fast)
    if fast:
        bad = nonfinite_groups(mn, step)
        if bool(bad.any()):
            for c in bad.nonzero().view(-1).div(chunk, rounding_mode="floor").unique().tolist():
                encode(c * chunk, True)
    canonical_nan_(mn)
    canonical_nan_(step)


def dequantize_reference(payload, mn, step, numel: int, bits: int, group_size: int, dtype: torch.dtype):
    """Decode, the same bits as :func:`dequantize_spec`: a flat tensor of ``numel`` elements in ``dtype``."""
    out = torch.empty(numel, dtype=dtype, device=payload.device)
    groups = mn.numel()
    chunk = groups_per_chunk(group_size, bits, chunk_elements(payload.device))
    ws = Workspace(min(groups, chunk) * group_size, payload.device)
    canonical_nan = may_decode_nan(mn, step)
    for g0 in range(0, groups, chunk):
        g1 = min(groups, g0 + chunk)
        e0, e1 = g0 * group_size, min(numel, g1 * group_size)
        decode_groups(payload[e0 * bits // 8 : packed_nbytes(e1, bits)], mn[g0:g1], step[g0:g1], bits, group_size,
                      ws, out[e0:e1], canonical_nan)
    return out
