"""The ``division`` codec: DIVISION's dual-precision form (:mod:`lightning_act.formats.division`)."""
from __future__ import annotations

import functools
import math

import torch

from .._validate import check_choice, check_int
from ..cuda.division import division_decode_cuda, division_encode_cuda
from ..cuda.launcher import DTYPE_CODES
from ..formats._bitpack import PACKABLE_BITS
from ..formats.division import block_counts, division_decode_reference, division_encode_reference, planes_and_spatial
from ..formats.floats import FLOAT_DTYPES, check_float_input
from . import register
from .backend import check_backend
from .base import Codec, Packed


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



@register
class DivisionCodec(Codec):
    """Average-pooled bfloat16 copy (block ``block_size`` per spatial dim) + ``bits``-bit per-channel residual."""

    name = "division"
    dtypes = frozenset(FLOAT_DTYPES)
    logical_layout = True  # pools over the spatial dims of each (sample, channel) plane
    config_fields = ("seed", "backend")  # block size and residual bits keep DIVISION's defaults (B=8, Q=2)
    # the kernels' checks ran once, here and in the engine: not again for every saved tensor
    _encode_kernel = functools.partial(division_encode_cuda, checked=False)
    _decode_kernel = functools.partial(division_decode_cuda, checked=False)

    def __init__(self, block_size: int = 8, bits: int = 2, seed: int = 0, backend: str = "auto"):
        check_int("block_size", block_size, minimum=1)
        check_choice("bits", bits, PACKABLE_BITS)
        check_int("seed", seed, minimum=0)
        check_backend(backend)
        self.block_size, self.bits, self.seed, self.backend = block_size, bits, seed, backend

    def encode(self, x: torch.Tensor, *, key: int = 0) -> Packed:
        check_float_input(self.name, x)
        planes, spatial = planes_and_spatial(saved_layout(x))
        meta = {"planes": planes, "spatial": spatial, "block_size": self.block_size, "bits": self.bits}
        if x.numel() == 0:
            empty = {n: x.new_empty(0, dtype=d) for n, d in
                     (("lfc", torch.bfloat16), ("payload", torch.uint8), ("mn", torch.bfloat16),
                      ("step", torch.bfloat16))}
            return Packed(self.name, x.shape, x.dtype, x.device, empty, meta)
        encode = self._encode_kernel if self.runs_kernels(x) else division_encode_reference
        lfc, payload, mn, step = encode(x.reshape(planes, *spatial).contiguous(), self.block_size, self.bits,
                                        self.seed, key)
        return Packed(self.name, x.shape, x.dtype, x.device,
                      {"lfc": lfc, "payload": payload, "mn": mn, "step": step}, meta)

    def decode(self, packed: Packed) -> torch.Tensor:
        if packed.numel == 0:
            return torch.empty(packed.shape, dtype=packed.dtype, device=packed.device)
        b, m = packed.buffers, packed.meta
        args = (b["lfc"], b["payload"], b["mn"], b["step"], m["planes"], m["spatial"], m["block_size"], m["bits"],
                packed.dtype)
        decode = self._decode_kernel if self.runs_kernels(b["payload"], packed.dtype) else division_decode_reference
        return decode(*args).view(packed.shape)

    def kernels_take(self, dtype: torch.dtype) -> bool:
        return dtype in DTYPE_CODES

    def bits_per_element(self, x: torch.Tensor, packed: Packed | None = None) -> float:
        """Residual bits + the bfloat16 block means + two bfloat16 statistics per plane, per element."""
        planes, spatial = planes_and_spatial(saved_layout(x))
        numel = planes * math.prod(spatial)
        if numel == 0:
            return float(self.bits)
        return self.bits + 16.0 * planes * (math.prod(block_counts(spatial, self.block_size)) + 2) / numel
