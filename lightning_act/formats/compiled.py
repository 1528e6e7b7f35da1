"""The quantize format's fast path through ``torch.compile`` (``backend="compile"``): the same bits as
:func:`lightning_act.formats.quantize.quantize_spec` / ``dequantize_spec``, with inductor fusing each chunk's
pipeline (the random words, the group minimum and maximum, the scaling, the noise and the rounding) into a couple
of loops: C++/OpenMP on CPU, Triton on CUDA.

One compiled graph per variant (kind, bits, group size, value dtype, statistics dtype, device type), built on first
use and cached; its chunk length is a dynamic dimension, so the last, shorter chunk reuses the same code. Chunks
of whole groups are bounded (``CHUNK_FACTOR`` torch-path chunks): an encode allocates its outputs and a chunk's
codes (a byte per element: inductor keeps the float values in registers), a decode its output and a chunk's codes
and scratch. The last chunk's end (a short group, or fewer than two groups) goes through the same graph padded to
whole groups with copies of its last element (min and max unchanged), as the specification pads it.

``check_available`` raises, when a codec is built, where ``torch.compile`` cannot run.
"""
from __future__ import annotations

import functools

import torch

from .. import rng
from ._bitpack import pack_codes_, packed_nbytes, unpack_codes_
from .floats import CANONICAL_NAN, canonical_nan_
from .quantize import chunk_elements, encoded_buffers, groups_per_chunk, may_decode_nan

HINT = "use backend='torch' (same bits, no compiler needed)"
# Elements per graph call, in torch-path chunks (formats.quantize.chunk_elements): larger than the torch path's, as
# a call costs tens of microseconds on the host while its temporaries are only the byte-per-element codes
CHUNK_FACTOR = 4
_MASK32 = rng.MASK32


def check_available() -> None:
    """Raise RuntimeError unless ``torch.compile`` (inductor) can build this path here: dynamo supports the
    platform, a C++ compiler is found (inductor's CPU code, and Triton's launchers), and Triton imports where CUDA
    is available."""
    from torch._dynamo.eval_frame import is_dynamo_supported

    if not is_dynamo_supported():
        raise RuntimeError(f"backend='compile' needs torch.compile, which this platform or Python does not support "
                           f"(torch {torch.__version__}): {HINT}")
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception as err:
        raise RuntimeError(f"backend='compile' needs a C++ compiler for torch.compile's inductor ({err}): install "
                           f"one (g++ or clang++) or set CXX, or {HINT}") from err
    if torch.cuda.is_available():
        from torch.utils._triton import has_triton

        if not has_triton():
            raise RuntimeError(f"backend='compile' on CUDA needs Triton, which does not import: pip install triton, "
                               f"or {HINT}")


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """``rng.mix32`` on int32 words, as ``rng.uniform24_codes_`` computes it: products wrap modulo 2**32 (the low
    32 bits, in vector registers as in torch's own int32 kernels), right shifts are arithmetic, so masked."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * rng._MUL1
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * rng._MUL2
    return x ^ ((x >> 15) & 0x1FFFF)


def bfloat16_rounded(v: torch.Tensor, rounding: str) -> torch.Tensor:
    """float32 ``v`` rounded to bfloat16 toward -inf (``rounding="down"``), +inf ("up") or to nearest, ties to even
    ("nearest", torch's cast), NaN to the canonical NaN: down and up are the rounding of
    :func:`formats.quantize._round_stats` (to nearest, then one step back where that went the wrong way). Computed
    on the bits: inductor elides a cast to bfloat16 and back, so a cast would neither round a value used again in
    float32 nor let a comparison with ``v`` see the rounding."""
    bits = v.view(torch.int32)
    pattern = (bits >> 16) & 0xFFFF  # truncation: toward zero
    low = bits & 0xFFFF
    if rounding == "nearest":
        away = (low > 0x8000) | ((low == 0x8000) & ((pattern & 1) == 1))
    else:  # inexact, and the direction grows the magnitude
        away = (low != 0) & ((bits < 0) == (rounding == "down"))
    pattern = torch.where(torch.isnan(v), CANONICAL_NAN[torch.bfloat16], pattern + away.to(torch.int32))
    return torch.where(pattern >= 0x8000, pattern - 0x10000, pattern).to(torch.int16).view(torch.bfloat16)


def counters(base: int, starts: list[int], device: torch.device) -> torch.Tensor:
    """The ``counter`` rows of :func:`quantize_groups` for chunks starting at the element indices ``starts``: one
    host-to-device copy per tensor (pinned, asynchronous), not one per chunk."""
    rows = []
    for start in starts:
        lo, hi = start & _MASK32, start >> 32
        words = [lo, rng.mix32(base ^ hi), rng.mix32(base ^ (hi + 1))]
        rows.append([rng._signed32(w) for w in words] + [min((1 << 32) - lo, (1 << 31) - 1)])
    table = torch.tensor(rows, dtype=torch.int32)
    return table if device.type == "cpu" else table.pin_memory().to(device, non_blocking=True)


@functools.lru_cache(maxsize=None)
def levels_tensor(bits: int, device: torch.device) -> torch.Tensor:
    """``2**bits - 1`` as a float32 tensor on ``device`` (made once: no copy per encode)."""
    return torch.tensor(float((1 << bits) - 1), device=device)


def quantize_groups(xg: torch.Tensor, counter: torch.Tensor, levels_t: torch.Tensor, bits: int,
                    stats_dtype: torch.dtype):
    """The quantization of float32 groups ``xg`` (one group per index of dim 0, its other dims the group; element
    index = the chunk's first one plus the row-major index in ``xg``), traced into a compiled graph: ``(codes uint8
    like xg, mn, step)``. Groups of several dims keep inductor's loops over them apart (a flattened loop would
    index a tensor broadcast along some of them by divisions, element by element).
    ``counter`` (int32 words) holds the low 32 bits of the chunk's first element index, the stream keys
    ``mix32(base ^ hi32)`` of its high word and of the next, and the chunk offset where the low word wraps to the
    next high word (past the chunk when it does not: element indices are 64-bit); ``levels_t`` is
    ``2**bits - 1`` as a float32 tensor, so the statistics' division stays a division (inductor turns division by
    a constant into a multiplication by its reciprocal, one ulp off for 3, 15, 255)."""
    levels = (1 << bits) - 1
    group_dims, per_group = tuple(range(1, xg.dim())), (-1, *[1] * (xg.dim() - 1))
    mn, mx = xg.amin(dim=group_dims), xg.amax(dim=group_dims)
    if stats_dtype == torch.float32:
        mn_s = mn
        step_s = (mx - mn) / levels_t
    else:
        mn_s = bfloat16_rounded(mn, "down")
        step_s = bfloat16_rounded((mx - mn_s.float()) / levels_t, "up")
    mn32, step32 = mn_s.float(), step_s.float()
    inv = torch.where(step32 > 0, 1.0 / step32, 0.0)
    j = torch.arange(xg.numel(), dtype=torch.int32, device=xg.device).view_as(xg)
    key = torch.where(j >= counter[3], counter[2], counter[1])
    k = (_mix32((j + counter[0]) ^ key) >> 8) & 0xFFFFFF
    u = k.float() * 2.0**-24  # exact: 24-bit integers
    t = ((xg - mn32.view(per_group)) * inv.view(per_group) + u).floor()
    # comparisons are False for NaN, so NaN lands on 0 exactly as in the specification
    q = torch.where(t >= levels, float(levels), torch.where(t > 0, t, 0.0)).to(torch.uint8)
    return q, mn_s, step_s


def _encode_graph(bits: int, group_size: int, stats_dtype: torch.dtype):
    """The chunk encode: ``(x, counter, levels) -> (codes uint8, mn, step)`` for a flat chunk ``x`` of whole
    groups (``counter``, ``levels``: :func:`quantize_groups`)."""

    def encode(x, counter, levels_t):
        q, mn_s, step_s = quantize_groups(x.view(-1, group_size).float(), counter, levels_t, bits, stats_dtype)
        return q.view(-1), mn_s, step_s

    return encode


def _decode_graph(group_size: int, dtype: torch.dtype):
    """The chunk decode: ``(codes, mn, step) -> values`` in ``dtype`` for whole groups of codes, one byte each
    (unpacked outside the graph: inductor does not vectorise a byte's spreading over several elements). NaN are
    left as computed (the caller canonicalises them where there can be any: a NaN test and the integer view
    would run element by element)."""

    def decode(codes, mn, step, out):
        out.copy_((codes.view(-1, group_size).float() * step.float()[:, None] + mn.float()[:, None]).view(-1))

    return decode


def compile_graph(fn, name: str, device_type: str, dynamic: int):
    """``fn`` through ``torch.compile`` (inductor, whole graph) as a code object of its own named ``name``:
    dynamo caches compiled graphs per code object (at most ``recompile_limit`` of them), so variants sharing one
    would evict each other. Dim 0 of its first ``dynamic`` arguments (the chunk's length) is dynamic: one graph
    for every chunk length, which must never be 0 or 1 (dynamo specialises those)."""
    fn = type(fn)(fn.__code__.replace(co_name=name), fn.__globals__, name, fn.__defaults__, fn.__closure__)
    # CUDA: IEEE division, subnormals kept and no fused multiply-add (the specification's single float32
    # operations; inductor's C++ already compiles with -ffp-contract=off and without -ffast-math)
    options = {"emulate_precision_casts": True, "eager_numerics.division_rounding": True,
               "eager_numerics.disable_ftz": True} if device_type == "cuda" else {}
    compiled = torch.compile(fn, fullgraph=True, dynamic=False, options=options)

    def run(*args):
        for t in args[:dynamic]:
            torch._dynamo.mark_dynamic(t, 0)
        # the same global state from every caller (a pack hook runs with grad on, maybe under autocast): no graph
        # compiled again for it, and no autograd graph
        with torch.no_grad(), torch.autocast(device_type, enabled=False):
            return compiled(*args)

    return run


@functools.lru_cache(maxsize=None)
def _compiled(kind: str, bits: int | None, group_size: int, dtype: torch.dtype, stats_dtype: torch.dtype,
              device_type: str):
    """The compiled ``kind`` ("encode" or "decode", whose graph is the same for every ``bits``: None) graph for
    values of ``dtype`` and statistics of ``stats_dtype`` on ``device_type``."""
    fn = _encode_graph(bits, group_size, stats_dtype) if kind == "encode" else _decode_graph(group_size, dtype)
    parts = [kind, *([f"{bits}bit"] if bits is not None else []), f"g{group_size}", str(dtype), str(stats_dtype),
             device_type]
    # the inputs whose length is the chunk's (decode: codes, mn, step, out)
    return compile_graph(fn, "_".join(parts).replace("torch.", ""), device_type, 1 if kind == "encode" else 4)


def _pieces(n: int, group_size: int, chunk: int):
    """``(start, end, length)`` of the graph calls covering ``n`` elements: chunks of ``chunk`` elements (whole
    groups, at least two) go as they are (``length == end - start``); the end, when it holds a short group or
    fewer than two groups, goes as at most three groups padded to ``length`` elements, whole groups and at least
    two (a dimension of size 1 would be specialised, and compiled again)."""
    start = 0
    while n - start > chunk:
        yield start, start + chunk, chunk
        start += chunk
    groups, short = divmod(n - start, group_size)
    if short == 0 and groups >= 2:
        yield start, n, n - start
        return
    if groups >= 3:  # all but the last whole group as they are
        yield start, start + (groups - 1) * group_size, (groups - 1) * group_size
        start += (groups - 1) * group_size
    yield start, n, max(2, -(-(n - start) // group_size)) * group_size


def groups_per_call(group_size: int, bits: int, device: torch.device) -> int:
    """Groups per graph call: about ``CHUNK_FACTOR`` torch-path chunks, at least two, whose codes fill whole
    bytes."""
    return groups_per_chunk(group_size, bits, max(2 * group_size, CHUNK_FACTOR * chunk_elements(device)))


def quantize_compiled(x: torch.Tensor, bits: int, group_size: int, stats_dtype: torch.dtype, seed: int, key: int):
    """Encode, the same bits as :func:`formats.quantize.quantize_spec`: ``(payload uint8, mn, step)``."""
    flat = x.reshape(-1)
    n = flat.numel()
    payload, mn_out, step_out = encoded_buffers(n, bits, group_size, stats_dtype, x.device)
    if n == 0:
        return payload, mn_out, step_out
    encode = _compiled("encode", bits, group_size, x.dtype, stats_dtype, x.device.type)
    levels = levels_tensor(bits, x.device)
    pieces = list(_pieces(n, group_size, groups_per_call(group_size, bits, x.device) * group_size))
    table = counters(rng.stream_base(seed, key), [p[0] for p in pieces], x.device)
    for (e0, e1, length), counter in zip(pieces, table):
        m, values = e1 - e0, flat[e0:e1]
        if length > m:  # padded with copies of the last element (min and max unchanged)
            values = torch.cat([values, values[-1:].expand(length - m)])
        codes, mn, step = encode(values, counter, levels)
        g0, g1 = e0 // group_size, -(-e1 // group_size)
        mn_out[g0:g1] = mn[: g1 - g0]
        step_out[g0:g1] = step[: g1 - g0]
        out = payload[e0 * bits // 8 : packed_nbytes(e1, bits)]
        if length > m:
            codes[m:] = 0  # the specification packs zeros after the last element
        if bits == 8:
            out.copy_(codes[:m])
        elif length == m:  # whole groups: packed straight into the payload
            pack_codes_(codes, bits, out)
        else:
            out.copy_(pack_codes_(codes, bits, codes.new_empty(length * bits // 8))[: out.numel()])
    canonical_nan_(mn_out)
    canonical_nan_(step_out)
    return payload, mn_out, step_out


def dequantize_compiled(payload: torch.Tensor, mn: torch.Tensor, step: torch.Tensor, numel: int, bits: int,
                        group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Decode, the same bits as :func:`formats.quantize.dequantize_spec`: a flat tensor of ``numel`` elements."""
    out = torch.empty(numel, dtype=dtype, device=payload.device)
    if numel == 0:
        return out
    decode = _compiled("decode", None, group_size, dtype, mn.dtype, payload.device.type)
    pieces = list(_pieces(numel, group_size, groups_per_call(group_size, bits, payload.device) * group_size))
    canonical_nan = may_decode_nan(mn, step)
    if bits < 8:  # the codes, a byte each, and the unpacking's scratch: reused from piece to piece
        codes_ws, scratch = torch.empty(2, max(p[2] for p in pieces), dtype=torch.uint8, device=payload.device)
    for e0, e1, length in pieces:
        m = e1 - e0
        g0, g1 = e0 // group_size, -(-e1 // group_size)
        codes, mn_c, step_c = payload[e0 * bits // 8 : packed_nbytes(e1, bits)], mn[g0:g1], step[g0:g1]
        if length > m:  # zero codes and statistics up to the padded length
            codes = torch.cat([codes, codes.new_zeros(length * bits // 8 - codes.numel())])
            mn_c = torch.cat([mn_c, mn_c.new_zeros(length // group_size - mn_c.numel())])
            step_c = torch.cat([step_c, step_c.new_zeros(length // group_size - step_c.numel())])
        if bits < 8:
            codes = unpack_codes_(codes, bits, codes_ws[:length], scratch)
        if length == m:
            decode(codes, mn_c, step_c, out[e0:e1])
        else:
            values = out.new_empty(length)
            decode(codes, mn_c, step_c, values)
            out[e0:e1] = values[:m]
        if canonical_nan:
            canonical_nan_(out[e0:e1])
    return out
