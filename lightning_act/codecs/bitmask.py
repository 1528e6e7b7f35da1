"""Lossless 1 bit per element for boolean tensors (dropout keep-masks, attention masks, comparisons)."""
from __future__ import annotations

import torch

from ..formats._bitpack import pack_bits, unpack_bits
from . import register, register_dtype_codec
from .base import Codec, Packed


@register
class BitmaskCodec(Codec):
    name = "bitmask"
    lossless = True
    dtypes = frozenset({torch.bool})

    def encode(self, x: torch.Tensor, *, key: int = 0) -> Packed:
        if x.dtype != torch.bool:
            raise ValueError(f"bitmask codec takes bool tensors; got dtype={x.dtype}")
        bits = pack_bits(x.reshape(-1))
        return Packed(self.name, x.shape, x.dtype, x.device, {"bits": bits})

    def decode(self, packed: Packed) -> torch.Tensor:
        return unpack_bits(packed.buffers["bits"], packed.numel).view(packed.shape)

    def bits_per_element(self, x: torch.Tensor, packed: Packed | None = None) -> float:
        return 1.0


register_dtype_codec(torch.bool, BitmaskCodec.name)
