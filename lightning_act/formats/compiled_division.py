"""DIVISION's fast path through ``torch.compile`` (``backend="compile"``): the same bits as
:func:`lightning_act.formats.division.division_encode_spec` / ``division_decode_spec``, with inductor fusing a
chunk of whole planes into one graph: the block sums (explicit adds in the specification's order: inductor does not
reassociate them, as a ``sum()`` reduction would), the bfloat16 block means, the residual, its per-plane statistics
and codes (:func:`lightning_act.formats.compiled.quantize_groups`); decode is one graph per chunk too.

One compiled graph per variant (kind, bits, block, spatial shape, value dtype, device type), built on first use and
cached; the chunk's number of planes is a dynamic dimension, so the last, shorter chunk reuses the same code.
Chunks hold :func:`compiled.groups_per_call` planes (whole planes whose codes start on a byte); a last chunk of one
plane goes with a zero plane after it (a dimension of size 1 would be specialised, and compiled again). Codes are
packed and unpacked outside the graphs, as on the quantize format's compiled path.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from .. import rng
from ._bitpack import pack_codes, pack_codes_, packed_nbytes, unpack_codes_
from .compiled import bfloat16_rounded, compile_graph, counters, groups_per_call, levels_tensor, quantize_groups
from .division import block_counts, block_sizes, block_sums, zero_padding
from .floats import canonical_nan_
from .quantize import may_decode_nan

# the block sizes of the spatial shapes met (a tensor per shape and device, read by every encode)
_block_sizes = functools.lru_cache(maxsize=4096)(block_sizes)


def _upsampled(lfc32: torch.Tensor, spatial: tuple[int, ...], block: int) -> torch.Tensor:
    """float32 block means (``planes x blocks``) repeated over each block and cropped to ``spatial``; traced into
    a graph, each element reads its block's mean (no repeated copy is made)."""
    planes, blocks = lfc32.shape[0], lfc32.shape[1:]
    wide = lfc32.view(planes, *[d for n in blocks for d in (n, 1)])
    wide = wide.expand(planes, *[d for n in blocks for d in (n, block)]).reshape(planes, *[n * block for n in blocks])
    return wide[(slice(None), *[slice(0, s) for s in spatial])]


def _encode_graph(bits: int, block: int, spatial: tuple[int, ...]):
    """The chunk encode: ``(x, counter, levels, sizes) -> (codes uint8, lfc, mn, step)`` for planes ``x`` (``planes
    x spatial``, any float dtype); ``counter`` and ``levels`` as for :func:`compiled.quantize_groups`, ``sizes``
    from :func:`division.block_sizes` (a tensor: a division by a constant would become a multiplication)."""
    padding, plane = zero_padding(spatial, block), math.prod(spatial)

    def encode(x, counter, levels_t, sizes):
        values = x.float()
        lfc = bfloat16_rounded(block_sums(F.pad(values, padding), block) / sizes, "nearest")
        residual = values - _upsampled(lfc.float(), spatial, block)
        q, mn, step = quantize_groups(residual.reshape(-1, plane), counter, levels_t, bits, torch.bfloat16)
        return q.view(-1), lfc, mn, step

    return encode


def _decode_graph(block: int, spatial: tuple[int, ...]):
    """The chunk decode: ``(codes, mn, step, lfc, out)`` writes ``(mn + codes * step) + upsampled lfc`` into
    ``out`` (``planes x spatial``, its dtype) for codes one byte each, ``planes x plane``. NaN are left as computed
    (the caller canonicalises them where there can be any)."""

    def decode(codes, mn, step, lfc, out):
        residual = codes.float() * step.float()[:, None] + mn.float()[:, None]
        out.copy_(residual.view(-1, *spatial) + _upsampled(lfc.float(), spatial, block))

    return decode


@functools.lru_cache(maxsize=None)
def _compiled(kind: str, bits: int | None, block: int, spatial: tuple[int, ...], dtype: torch.dtype,
              device_type: str):
    """The compiled ``kind`` ("encode" or "decode", whose graph is the same for every ``bits``: None) graph for
    planes of ``spatial`` shape in ``dtype`` on ``device_type``."""
    fn = _encode_graph(bits, block, spatial) if kind == "encode" else _decode_graph(block, spatial)
    parts = ["division", kind, *([f"{bits}bit"] if bits is not None else []), f"b{block}",
             "s" + "x".join(map(str, spatial)), str(dtype).removeprefix("torch."), device_type]
    # the inputs whose length is the chunk's planes (decode: codes, mn, step, lfc, out)
    return compile_graph(fn, "_".join(parts), device_type, 1 if kind == "encode" else 5)


def _two_planes(t: torch.Tensor) -> torch.Tensor:
    """A one-plane chunk with a zero plane after it (the graphs' chunk length is never 1)."""
    return torch.cat([t, t.new_zeros(1, *t.shape[1:])])


def division_encode_compiled(x: torch.Tensor, block: int, bits: int, seed: int, key: int):
    """Encode, the same bits as :func:`division.division_encode_spec`: ``(lfc bf16, payload uint8, mn bf16,
    step bf16)`` for ``x`` already viewed as ``planes x spatial`` (contiguous)."""
    planes, spatial = x.shape[0], tuple(x.shape[1:])
    plane = math.prod(spatial)
    lfc = torch.empty(planes, *block_counts(spatial, block), dtype=torch.bfloat16, device=x.device)
    payload = torch.empty(packed_nbytes(planes * plane, bits), dtype=torch.uint8, device=x.device)
    if x.numel() == 0:  # no statistics, as in the specification
        return lfc, payload, x.new_empty(0, dtype=torch.bfloat16), x.new_empty(0, dtype=torch.bfloat16)
    mn = torch.empty(planes, dtype=torch.bfloat16, device=x.device)
    step = torch.empty(planes, dtype=torch.bfloat16, device=x.device)
    encode = _compiled("encode", bits, block, spatial, x.dtype, x.device.type)
    levels, sizes = levels_tensor(bits, x.device), _block_sizes(spatial, block, x.device)
    per_call = groups_per_call(plane, bits, x.device)
    starts = range(0, planes, per_call)
    table = counters(rng.stream_base(seed, key), [p0 * plane for p0 in starts], x.device)
    for p0, counter in zip(starts, table):
        p1 = min(planes, p0 + per_call)
        chunk = x[p0:p1] if p1 - p0 > 1 else _two_planes(x[p0:p1])
        codes, lfc_c, mn_c, step_c = encode(chunk, counter, levels, sizes)
        lfc[p0:p1], mn[p0:p1], step[p0:p1] = lfc_c[: p1 - p0], mn_c[: p1 - p0], step_c[: p1 - p0]
        m = (p1 - p0) * plane
        out = payload[p0 * plane * bits // 8 : packed_nbytes(p1 * plane, bits)]
        if bits == 8:
            out.copy_(codes[:m])
        elif m * bits % 8 == 0:  # whole bytes: packed straight into the payload
            pack_codes_(codes[:m], bits, out)
        else:  # the last chunk's codes end inside a byte: zeros after them, as the specification packs
            out.copy_(pack_codes(codes[:m], bits))
    return lfc, payload, mn, step


def division_decode_compiled(lfc, payload, mn, step, planes: int, spatial: tuple[int, ...], block: int, bits: int,
                             dtype: torch.dtype) -> torch.Tensor:
    """Decode, the same bits as :func:`division.division_decode_spec`: ``planes x spatial`` in ``dtype``."""
    plane = math.prod(spatial)
    out = torch.empty(planes, *spatial, dtype=dtype, device=payload.device)
    if out.numel() == 0:
        return out
    decode = _compiled("decode", None, block, spatial, dtype, payload.device.type)
    per_call = groups_per_call(plane, bits, payload.device)
    # finite statistics and block means decode to finite values or infinities: no NaN to canonicalise
    canonical_nan = may_decode_nan(mn, step, lfc)
    if bits < 8:  # the codes, a byte each, and the unpacking's scratch: reused from chunk to chunk
        capacity = -(-min(planes, per_call) * plane // 8) * 8
        codes_ws, scratch = torch.empty(2, capacity, dtype=torch.uint8, device=payload.device)
    for p0 in range(0, planes, per_call):
        p1 = min(planes, p0 + per_call)
        packed = payload[p0 * plane * bits // 8 : packed_nbytes(p1 * plane, bits)]
        codes = packed if bits == 8 else unpack_codes_(packed, bits, codes_ws[: packed.numel() * 8 // bits], scratch)
        args = (codes[: (p1 - p0) * plane].view(p1 - p0, plane), mn[p0:p1], step[p0:p1], lfc[p0:p1])
        if p1 - p0 > 1:
            decode(*args, out[p0:p1])
        else:
            values = out.new_empty(2, *spatial)
            decode(*map(_two_planes, args), values)
            out[p0:p1] = values[:1]
        if canonical_nan:
            canonical_nan_(out[p0:p1])
    return out
