"""DIVISION's dual-precision codec (Wang et al., ICLR 2023, sections 4.1-4.2, appendix F): a bfloat16
low-frequency copy plus a ``bits``-bit high-frequency residual. This module is the format, the specification of
the CUDA kernels in ``lightning_act/cuda/division.cu``.

Layout: a tensor is read as ``planes x spatial``. Its last ``min(3, max(1, ndim - 2))`` dims are spatial
(1D sequences and linear rows, 2D conv maps, 3D volumes); the leading dims are planes (sample x channel).
A 0-d or 1-d tensor is one plane. Inputs are float32, float16, bfloat16 or float64, each element read as
float32 (float64 rounded to nearest even, once); the arithmetic below is float32.

Encode, per plane, with ``B = block_size``:

    sum   = sum of each B x ... x B block in float32, zero-padded to a multiple of B, folded one spatial dim at a
            time from the last, each fold a left-to-right chain of adds (the kernel adds in the same order)
    lfc   = bfloat16(sum / count), count = the block's elements inside the tensor        (stored)
    r     = x - nearest-upsampled lfc                                          float32 residual
    r     -> quantize_reference(r, bits, group = one plane, bfloat16 statistics)    (stored)

so the residual is quantized per channel of each sample with stochastic rounding from ``rng`` (element index
= row-major index in the tensor), ``min`` rounded down and ``step`` up in bfloat16 (paper: ``(N^2 Q/8 + 4)``
bytes per channel). Decode: ``x' = (mn + q * step) + upsampled lfc`` in float32, cast to the input dtype,
so ``|x' - x| <= step`` of the plane (plus the output dtype's rounding, or float32's of a float64 input) and
``E[x'] = x``. A plane holding NaN or +-Inf decodes to NaN, and so does one whose block means overflow
bfloat16 (values near float32's limits: an additive attention mask's ``finfo.min``; where the op rules see masks,
``codecs.negative_infinity`` masks such values out first). Every NaN stored (``lfc``, ``mn``, ``step``) or
decoded is the canonical NaN of its dtype (``floats.CANONICAL_NAN``), whatever the input's NaN encodings.

``division_encode_spec`` / ``division_decode_spec`` are the specification, written to be read;
``division_encode_reference`` / ``division_decode_reference`` compute the same bits fast (what the codecs and the
kernel tests run): chunks of whole planes of about ``quantize.chunk_elements(device)`` elements, in reused buffers,
through the quantize format's fast chunk encoder and decoder.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import rng
from . import quantize
from ._bitpack import packed_nbytes
from .floats import canonical_nan_
from .quantize import dequantize_spec, quantize_spec

MAX_SPATIAL_DIMS = 3


def planes_and_spatial(shape: torch.Size | tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
    """``(number of planes, spatial size)`` of a tensor of ``shape`` (see the module docstring)."""
    if len(shape) == 0:
        return 1, (1,)
    spatial_dims = min(MAX_SPATIAL_DIMS, max(1, len(shape) - 2))
    return math.prod(shape[:-spatial_dims]), tuple(shape[-spatial_dims:])


def block_counts(spatial: tuple[int, ...], block: int) -> tuple[int, ...]:
    """Blocks of size ``block`` per spatial dim (the last one may be partial)."""
    return tuple(-(-s // block) for s in spatial)


def zero_padding(spatial: tuple[int, ...], block: int) -> list[int]:
    """``F.pad`` widths that zero-pad ``spatial`` to whole blocks."""
    return [p for s, n in zip(reversed(spatial), reversed(block_counts(spatial, block))) for p in (0, n * block - s)]


def block_sizes(spatial: tuple[int, ...], block: int, device: torch.device | str) -> torch.Tensor:
    """Elements of each block inside the tensor, float32, shaped as the blocks."""
    count = torch.ones((), dtype=torch.float32, device=device)
    for s, n in zip(spatial, block_counts(spatial, block)):
        edge = torch.full((n,), float(block), dtype=torch.float32, device=device)
        # a fill of a one-element slice: ``edge[-1] = v`` copies ``v`` from host memory on CUDA (a synchronisation)
        edge.narrow(0, n - 1, 1).fill_(s - (n - 1) * block)
        count = count.unsqueeze(-1) * edge
    return count


def block_sums(padded: torch.Tensor, block: int) -> torch.Tensor:
    """float32 sums of the blocks of ``padded`` (float32 ``planes x spatial`` zero-padded to whole blocks),
    ``planes x blocks``, in the kernel's order (module docstring)."""
    t = padded.view(padded.shape[0], *[d for s in padded.shape[1:] for d in (s // block, block)])
    for axis in range(t.dim() - 1, 0, -2):  # fold the last spatial dim first
        acc = t.select(axis, 0).clone()
        for j in range(1, block):
            acc.add_(t.select(axis, j))
        t = acc
    return t


def block_means(padded: torch.Tensor, sizes: torch.Tensor, block: int) -> torch.Tensor:
    """bfloat16 block means (NaN canonical) of ``padded`` (float32 ``planes x spatial`` zero-padded to whole
    blocks), ``sizes`` from :func:`block_sizes`; the summation order is the kernel's (module docstring)."""
    return canonical_nan_((block_sums(padded, block) / sizes).to(torch.bfloat16))


def low_frequency_copy(x: torch.Tensor, block: int) -> torch.Tensor:
    """Block means of ``x`` (``planes x spatial``, any float dtype) in bfloat16, partial edge blocks averaged
    over their elements inside the tensor, NaN canonical; the summation order is the kernel's (module docstring)."""
    spatial = tuple(x.shape[1:])
    return block_means(F.pad(x.float(), zero_padding(spatial, block)), block_sizes(spatial, block, x.device), block)


def upsample_nearest(lfc: torch.Tensor, spatial: tuple[int, ...], block: int) -> torch.Tensor:
    """``lfc`` (``planes x blocks``) repeated over each block and cropped to ``spatial``, in float32."""
    index = []
    for i, s in enumerate(spatial):
        shape = [1] * len(spatial)
        shape[i] = s
        index.append((torch.arange(s, device=lfc.device) // block).view(shape))
    return lfc.float()[(slice(None), *index)]


def division_encode_spec(x: torch.Tensor, block: int, bits: int, seed: int, key: int):
    """The specification of encode: ``(lfc bf16, payload uint8, mn bf16, step bf16)`` for ``x`` already viewed as
    ``planes x spatial``."""
    lfc = low_frequency_copy(x, block)
    residual = x.float() - upsample_nearest(lfc, tuple(x.shape[1:]), block)
    payload, mn, step = quantize_spec(residual, bits, math.prod(x.shape[1:]), torch.bfloat16, seed, key)
    return lfc, payload, mn, step


def division_decode_spec(lfc, payload, mn, step, planes: int, spatial: tuple[int, ...], block: int, bits: int,
                         dtype: torch.dtype) -> torch.Tensor:
    """The specification of decode: ``planes x spatial`` in ``dtype``."""
    plane = math.prod(spatial)
    residual = dequantize_spec(payload, mn, step, planes * plane, bits, plane, torch.float32)
    return canonical_nan_(residual.view(planes, *spatial).add_(upsample_nearest(lfc, spatial, block)).to(dtype))


def subtract_upsampled_(r: torch.Tensor, wide: torch.Tensor, block: int, alpha: int = -1) -> torch.Tensor:
    """``r + alpha * upsample_nearest(lfc)`` in place (alpha -1: the specification's subtraction, +1: its addition;
    exact either way), ``r`` float32 ``planes x spatial``, ``wide`` the float32 block means already repeated
    along the last spatial dim (``planes x blocks[:-1] x spatial[-1]``, see :meth:`_Planes.widen`). Each leading
    spatial dim splits into whole blocks (a broadcast over the block's rows) and a partial last block, so every
    operation runs along whole rows of the last dim: at most 4 operations (3 spatial dims)."""
    pairs = [(r, wide, 1)]
    for size in r.shape[1:-1]:
        whole, rest = divmod(size, block)
        split = []
        for rv, wv, dim in pairs:
            if whole:
                split.append((rv.narrow(dim, 0, whole * block).unflatten(dim, (whole, block)),
                              wv.narrow(dim, 0, whole).unsqueeze(dim + 1), dim + 2))
            if rest:
                split.append((rv.narrow(dim, whole * block, rest), wv.narrow(dim, whole, 1), dim + 1))
        pairs = split
    for rv, wv, _ in pairs:
        rv.add_(wv, alpha=alpha)
    return r


class _Planes:
    """The fast path's chunking of ``planes x spatial`` and its reused buffers: chunks of whole planes whose codes
    start on a byte, the quantize workspace, a float32 residual and (spatial dims not multiples of the block) a
    zero-padded copy for the block sums."""

    def __init__(self, planes: int, spatial: tuple[int, ...], block: int, bits: int, device: torch.device):
        self.spatial, self.block, self.plane = spatial, block, math.prod(spatial)
        self.blocks = block_counts(spatial, block)
        self.padded_spatial = tuple(n * block for n in self.blocks)
        self.chunk = quantize.groups_per_chunk(self.plane, bits, quantize.chunk_elements(device))
        most = min(planes, self.chunk)
        self.ws = quantize.Workspace(most * self.plane, device)
        self.residual = torch.empty(most * self.plane, dtype=torch.float32, device=device)
        self.divisible = self.padded_spatial == spatial
        self.padded = None if self.divisible else torch.zeros(most * math.prod(self.padded_spatial),
                                                              dtype=torch.float32, device=device)
        self.sizes = block_sizes(spatial, block, device)
        self.interior = (slice(None), *[slice(0, s) for s in spatial])
        self.ranges = [(p0, min(planes, p0 + self.chunk)) for p0 in range(0, planes, self.chunk)]

    def widen(self, lfc: torch.Tensor) -> torch.Tensor:
        """Block means ``lfc`` (``planes x blocks``, any float dtype) as float32, repeated ``block`` times along
        the last spatial dim and cropped to it: ``planes x blocks[:-1] x spatial[-1]``, a 1 / block^(d-1) share
        of the plane (the whole plane for 1D spatial dims)."""
        wide = lfc.float().unsqueeze(-1).expand(*lfc.shape, self.block).flatten(-2)
        return wide[..., : self.spatial[-1]]

    def low_frequency_copy(self, x: torch.Tensor) -> torch.Tensor:
        """:func:`low_frequency_copy` of float32 planes ``x``, zero-padding in the reused buffer (whose padding
        stays zero: only the interior is ever written)."""
        if self.divisible:
            return block_means(x, self.sizes, self.block)
        padded = self.padded[: x.shape[0] * math.prod(self.padded_spatial)].view(x.shape[0], *self.padded_spatial)
        padded[self.interior] = x
        return block_means(padded, self.sizes, self.block)


def division_encode_reference(x: torch.Tensor, block: int, bits: int, seed: int, key: int):
    """Encode, the same bits as :func:`division_encode_spec`: ``(lfc bf16, payload uint8, mn bf16, step bf16)``
    for ``x`` already viewed as ``planes x spatial``."""
    planes, spatial = x.shape[0], tuple(x.shape[1:])
    chunks = _Planes(planes, spatial, block, bits, x.device)
    plane = chunks.plane
    lfc = torch.empty(planes, *chunks.blocks, dtype=torch.bfloat16, device=x.device)
    payload = torch.empty(packed_nbytes(planes * plane, bits), dtype=torch.uint8, device=x.device)
    mn = torch.empty(planes, dtype=torch.bfloat16, device=x.device)
    step = torch.empty(planes, dtype=torch.bfloat16, device=x.device)
    base = rng.stream_base(seed, key)

    def encode(p0: int, safe: bool) -> None:
        p1 = min(planes, p0 + chunks.chunk)
        residual = chunks.residual[: (p1 - p0) * plane].view(p1 - p0, *spatial)
        residual.copy_(x[p0:p1])
        lfc[p0:p1] = chunks.low_frequency_copy(residual)
        subtract_upsampled_(residual, chunks.widen(lfc[p0:p1]), block)
        e0, e1 = p0 * plane, p1 * plane
        quantize.encode_groups(residual.view(-1), e0, plane, bits, torch.bfloat16, base, chunks.ws,
                               payload[e0 * bits // 8 : packed_nbytes(e1, bits)], mn[p0:p1], step[p0:p1], safe)

    quantize.encode_chunks(encode, planes, chunks.chunk, mn, step, planes * plane)
    return lfc, payload, mn, step


def division_decode_reference(lfc, payload, mn, step, planes: int, spatial: tuple[int, ...], block: int,
                              bits: int, dtype: torch.dtype) -> torch.Tensor:
    """Decode, the same bits as :func:`division_decode_spec`: ``planes x spatial`` in ``dtype``."""
    chunks = _Planes(planes, spatial, block, bits, payload.device)
    plane = chunks.plane
    out = torch.empty(planes, *spatial, dtype=dtype, device=payload.device)
    # finite statistics and block means decode to finite values or infinities: no NaN to canonicalise
    canonical_nan = quantize.may_decode_nan(mn, step, lfc)
    for p0, p1 in chunks.ranges:
        e0, e1 = p0 * plane, p1 * plane
        residual = out[p0:p1] if dtype == torch.float32 else chunks.residual[: e1 - e0].view(p1 - p0, *spatial)
        quantize.decode_groups(payload[e0 * bits // 8 : packed_nbytes(e1, bits)], mn[p0:p1], step[p0:p1], bits,
                               plane, chunks.ws, residual.view(-1), canonical_nan=False)
        subtract_upsampled_(residual, chunks.widen(lfc[p0:p1]), block, alpha=1)
        if dtype != torch.float32:
            out[p0:p1] = residual
        if canonical_nan:
            canonical_nan_(out[p0:p1])
    return out
