"""DIVISION's fast path through ``torch.compile`` (``backend="compile"``): the same bits as
:func:`lightning_act.formats.division.division_encode_spec` / ``division_decode_spec``, a chunk of whole planes at
a time in two inductor graphs to encode, one to decode:

- means: the block sums (explicit adds in the specification's order: inductor does not reassociate them, as it
  would a ``sum()`` reduction) and the bfloat16 block means;
- encode: the residual against the upsampled means, its per-plane statistics and codes
  (:func:`lightning_act.formats.compiled.quantize_groups`, each plane a group);
- decode: ``(mn + code * step) + upsampled means``, in the output dtype.

Between them the means are repeated along the last spatial dim (:func:`_widened`: a small tensor, but in 1D), so
that the graphs read them along whole rows: their loops vectorise. One compiled graph per variant (kind, bits,
block, spatial shape, value dtype, device type), built on first use and cached; the chunk's number of planes is a
dynamic dimension, so the last, shorter chunk reuses the same code. Chunks hold :func:`compiled.groups_per_call`
planes (whole planes whose codes start on a byte); a last chunk of one plane goes with a zero plane after it (a
dimension of size 1 would be specialised, and compiled again). Codes are packed and unpacked outside the graphs, as
on the quantize format's compiled path.
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


@functools.lru_cache(maxsize=4096)
def _block_of_column(width: int, block: int, device: torch.device) -> torch.Tensor:
    """The block of each index ``0 .. width - 1`` of the last spatial dim (made once per width and device)."""
    return torch.arange(width, device=device) // block


def _widened(lfc: torch.Tensor, width: int, block: int) -> torch.Tensor:
    """Block means ``lfc`` (``planes x blocks``) repeated along the last spatial dim, of ``width``: ``planes x
    blocks[:-1] x width`` bfloat16, a 1 / block^(d-1) share of the plane (the whole plane for 1D spatial dims).
    Made outside the graphs, which read it as an input: traced, the repetition would be inlined into their loops
    as an index division per element, and their loops would not vectorise."""
    return lfc.index_select(-1, _block_of_column(width, block, lfc.device))


def _upsampled(wide: torch.Tensor, spatial: tuple[int, ...], block: int) -> torch.Tensor:
    """:func:`_widened` block means repeated ``block`` times along the other spatial dims too, cropped to
    ``spatial``, float32 (traced into a graph: each element reads its mean along whole rows of the last dim)."""
    planes, rows, width = wide.shape[0], wide.shape[1:-1], wide.shape[-1]
    grid = wide.view(planes, *[d for n in rows for d in (n, 1)], width)
    grid = grid.expand(planes, *[d for n in rows for d in (n, block)], width)
    grid = grid.reshape(planes, *[n * block for n in rows], width)
    return grid[(slice(None), *[slice(0, s) for s in spatial[:-1]])].float()


def _means_graph(block: int, spatial: tuple[int, ...]):
    """The chunk's block means: ``(x, sizes) -> lfc`` bfloat16 for planes ``x`` (``planes x spatial``, any float
    dtype), ``sizes`` from :func:`division.block_sizes` (a tensor: a division by a constant would become a
    multiplication). Explicit adds in the specification's order (:func:`division.block_sums`)."""
    padding = zero_padding(spatial, block)

    def means(x, sizes):
        return bfloat16_rounded(block_sums(F.pad(x.float(), padding), block) / sizes, "nearest")

    return means


def _encode_graph(bits: int, block: int, spatial: tuple[int, ...]):
    """The chunk's residual codes: ``(x, wide, counter, levels) -> (codes uint8, mn, step)`` for planes ``x``
    (``planes x spatial``, any float dtype) and their :func:`_widened` block means ``wide``; ``counter`` and
    ``levels`` as for :func:`compiled.quantize_groups`, each plane a group."""

    def encode(x, wide, counter, levels_t):
        residual = x.float() - _upsampled(wide, spatial, block)
        q, mn, step = quantize_groups(residual, counter, levels_t, bits, torch.bfloat16)
        return q.view(-1), mn, step

    return encode


def _decode_graph(block: int, spatial: tuple[int, ...]):
    """The chunk decode: ``(codes, mn, step, wide, out)`` writes ``(mn + codes * step) + upsampled lfc`` into
    ``out`` (``planes x spatial``, its dtype) for codes one byte each, ``planes x plane``, and :func:`_widened`
    block means ``wide``. NaN are left as computed (the caller canonicalises them where there can be any)."""

    def decode(codes, mn, step, wide, out):
        residual = codes.float() * step.float()[:, None] + mn.float()[:, None]
        out.copy_(residual.view(-1, *spatial) + _upsampled(wide, spatial, block))

    return decode


@functools.lru_cache(maxsize=None)
def _compiled(kind: str, bits: int | None, block: int, spatial: tuple[int, ...], dtype: torch.dtype,
              device_type: str):
    """The compiled ``kind`` ("means", "encode" or "decode"; ``bits`` None but for "encode") graph for planes of
    ``spatial`` shape in ``dtype`` on ``device_type``."""
    graphs = {"means": lambda: _means_graph(block, spatial), "encode": lambda: _encode_graph(bits, block, spatial),
              "decode": lambda: _decode_graph(block, spatial)}
    parts = ["division", kind, *([f"{bits}bit"] if bits is not None else []), f"b{block}",
             "s" + "x".join(map(str, spatial)), str(dtype).removeprefix("torch."), device_type]
    # the inputs whose length is the chunk's planes
    dynamic = {"means": 1, "encode": 2, "decode": 5}[kind]
    return compile_graph(graphs[kind](), "_".join(parts), device_type, dynamic)


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
    means = _compiled("means", None, block, spatial, x.dtype, x.device.type)
    encode = _compiled("encode", bits, block, spatial, x.dtype, x.device.type)
    levels, sizes = levels_tensor(bits, x.device), _block_sizes(spatial, block, x.device)
    per_call = groups_per_call(plane, bits, x.device)
    starts = range(0, planes, per_call)
    table = counters(rng.stream_base(seed, key), [p0 * plane for p0 in starts], x.device)
    for p0, counter in zip(starts, table):
        p1 = min(planes, p0 + per_call)
        chunk = x[p0:p1] if p1 - p0 > 1 else _two_planes(x[p0:p1])
        lfc_c = means(chunk, sizes)
        codes, mn_c, step_c = encode(chunk, _widened(lfc_c, spatial[-1], block), counter, levels)
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
        wide = _widened(lfc[p0:p1], spatial[-1], block)
        args = (codes[: (p1 - p0) * plane].view(p1 - p0, plane), mn[p0:p1], step[p0:p1], wide)
        if p1 - p0 > 1:
            decode(*args, out[p0:p1])
        else:
            values = out.new_empty(2, *spatial)
            decode(*map(_two_planes, args), values)
            out[p0:p1] = values[:1]
        if canonical_nan:
            canonical_nan_(out[p0:p1])
    return out
