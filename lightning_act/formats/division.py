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
``E[x'] = x``. A plane holding NaN or +-Inf decodes to NaN. Every NaN stored (``lfc``, ``mn``, ``step``) or
decoded is the canonical NaN of its dtype (``floats.CANONICAL_NAN``), whatever the input's NaN encodings.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .floats import canonical_nan_
from .quantize import dequantize_reference, quantize_reference

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
