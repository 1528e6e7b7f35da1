"""DIVISION's dual-precision codec (Wang et al., ICLR 2023, sections 4.1-4.2, appendix F): a bfloat16
low-frequency copy plus a ``bits``-bit high-frequency residual. This module is the specification of the
CUDA kernels in ``lightning_act/cuda/division.cu``.

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
``E[x'] = x``. A plane holding NaN or +-Inf decodes to NaN. Every NaN stored (``lfc``, ``mn``, ``step``) or
decoded is the canonical NaN of its dtype (``quantize.CANONICAL_NAN``), whatever the input's NaN encodings.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .._validate import check_choice, check_int
from . import register
from ._bitpack import PACKABLE_BITS
from .base import Codec, Packed
from .quantize import (BACKENDS, FLOAT_DTYPES, canonical_nan_, check_float_input, dequantize_reference,
                       quantize_reference)

MAX_SPATIAL_DIMS = 3


def saved_layout(x: torch.Tensor) -> torch.Size:
    """The shape that gives ``x`` its planes and spatial dims.

    The engine hands codecs a flat view of each saved tensor; when that view spans its base tensor exactly,
    the base's shape is the activation's layout (a flat tensor on its own is one plane).
    """
    base = x._base
    if x.dim() == 1 and base is not None and base.numel() == x.numel() and base.dtype == x.dtype \
            and base.is_contiguous() and base.data_ptr() == x.data_ptr():
        return base.shape
    return x.shape


def planes_and_spatial(shape: torch.Size | tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
    """``(number of planes, spatial size)`` of a tensor of ``shape`` (see the module docstring)."""
    if len(shape) == 0:
        return 1, (1,)
    spatial_dims = min(MAX_SPATIAL_DIMS, max(1, len(shape) - 2))
    return math.prod(shape[:-spatial_dims]), tuple(shape[-spatial_dims:])


def block_counts(spatial: tuple[int, ...], block: int) -> tuple[int, ...]:
    """Blocks of size ``block`` per spatial dim (the last one may be partial)."""
    return tuple(-(-s // block) for s in spatial)


def low_frequency_copy(x: torch.Tensor, block: int) -> torch.Tensor:
    """Block means of ``x`` (``planes x spatial``, any float dtype) in bfloat16, partial edge blocks averaged
    over their elements inside the tensor, NaN canonical; the summation order is the kernel's (module docstring)."""
    spatial = tuple(x.shape[1:])
    blocks = block_counts(spatial, block)
    pad = [p for s, n in zip(reversed(spatial), reversed(blocks)) for p in (0, n * block - s)]
    t = F.pad(x.float(), pad)
    t = t.view(x.shape[0], *[d for n in blocks for d in (n, block)])
    for axis in range(t.dim() - 1, 0, -2):  # fold the last spatial dim first
        acc = t.select(axis, 0).clone()
        for j in range(1, block):
            acc.add_(t.select(axis, j))
        t = acc
    count = torch.ones((), dtype=torch.float32, device=x.device)
    for s, n in zip(spatial, blocks):
        edge = torch.full((n,), float(block), dtype=torch.float32, device=x.device)
        edge[-1] = s - (n - 1) * block
        count = count.unsqueeze(-1) * edge
    return canonical_nan_((t / count).to(torch.bfloat16))


def upsample_nearest(lfc: torch.Tensor, spatial: tuple[int, ...], block: int) -> torch.Tensor:
    """``lfc`` (``planes x blocks``) repeated over each block and cropped to ``spatial``, in float32."""
    index = []
    for i, s in enumerate(spatial):
        shape = [1] * len(spatial)
        shape[i] = s
        index.append((torch.arange(s, device=lfc.device) // block).view(shape))
    return lfc.float()[(slice(None), *index)]


def division_encode_reference(x: torch.Tensor, block: int, bits: int, seed: int, key: int):
    """Torch specification of the encode kernels: ``(lfc bf16, payload uint8, mn bf16, step bf16)`` for ``x``
    already viewed as ``planes x spatial``."""
    lfc = low_frequency_copy(x, block)
    residual = x.float() - upsample_nearest(lfc, tuple(x.shape[1:]), block)
    payload, mn, step = quantize_reference(residual, bits, math.prod(x.shape[1:]), torch.bfloat16, seed, key)
    return lfc, payload, mn, step


def division_decode_reference(lfc, payload, mn, step, planes: int, spatial: tuple[int, ...], block: int,
                              bits: int, dtype: torch.dtype) -> torch.Tensor:
    """Torch specification of the decode kernel: ``planes x spatial`` in ``dtype``."""
    plane = math.prod(spatial)
    residual = dequantize_reference(payload, mn, step, planes * plane, bits, plane, torch.float32)
    return canonical_nan_(residual.view(planes, *spatial).add_(upsample_nearest(lfc, spatial, block)).to(dtype))


@register
class DivisionCodec(Codec):
    """Average-pooled bfloat16 copy (block ``block_size`` per spatial dim) + ``bits``-bit per-channel residual."""

    name = "division"
    dtypes = frozenset(FLOAT_DTYPES)
    logical_layout = True  # pools over the spatial dims of each (sample, channel) plane

    def __init__(self, block_size: int = 8, bits: int = 2, seed: int = 0, backend: str = "auto"):
        check_int("block_size", block_size, minimum=1)
        check_choice("bits", bits, PACKABLE_BITS)
        check_int("seed", seed, minimum=0)
        check_choice("backend", backend, BACKENDS)
        self.block_size, self.bits, self.seed, self.backend = block_size, bits, seed, backend
        if backend == "cupy":
            from ..cuda import require_cupy

            require_cupy()

    def encode(self, x: torch.Tensor, *, key: int = 0) -> Packed:
        check_float_input(self.name, x)
        planes, spatial = planes_and_spatial(saved_layout(x))
        meta = {"planes": planes, "spatial": spatial, "block_size": self.block_size, "bits": self.bits}
        if x.numel() == 0:
            empty = {n: x.new_empty(0, dtype=d) for n, d in
                     (("lfc", torch.bfloat16), ("payload", torch.uint8), ("mn", torch.bfloat16),
                      ("step", torch.bfloat16))}
            return Packed(self.name, x.shape, x.dtype, x.device, empty, meta)
        if self._use_cupy(x):
            from ..cuda.division import division_encode_cuda

            lfc, payload, mn, step = division_encode_cuda(
                x.reshape(planes, *spatial).contiguous(), self.block_size, self.bits, self.seed, key)
        else:
            lfc, payload, mn, step = division_encode_reference(
                x.reshape(planes, *spatial), self.block_size, self.bits, self.seed, key)
        return Packed(self.name, x.shape, x.dtype, x.device,
                      {"lfc": lfc, "payload": payload, "mn": mn, "step": step}, meta)

    def decode(self, packed: Packed) -> torch.Tensor:
        if packed.numel == 0:
            return torch.empty(packed.shape, dtype=packed.dtype, device=packed.device)
        b, m = packed.buffers, packed.meta
        args = (b["lfc"], b["payload"], b["mn"], b["step"], m["planes"], m["spatial"], m["block_size"], m["bits"],
                packed.dtype)
        if self._use_cupy(b["payload"]):
            from ..cuda.division import division_decode_cuda

            return division_decode_cuda(*args).view(packed.shape)
        return division_decode_reference(*args).view(packed.shape)

    def _use_cupy(self, t: torch.Tensor) -> bool:
        from ..cuda import use_cupy_kernels

        return use_cupy_kernels(self.backend, t)

    def bits_per_element(self, x: torch.Tensor) -> float:
        """Residual bits + the bfloat16 block means + two bfloat16 statistics per plane, per element."""
        planes, spatial = planes_and_spatial(saved_layout(x))
        numel = planes * math.prod(spatial)
        if numel == 0:
            return float(self.bits)
        return self.bits + 16.0 * planes * (math.prod(block_counts(spatial, self.block_size)) + 2) / numel
