"""Lossless 1 bit per element for boolean tensors (dropout keep-masks, attention masks, comparisons)."""
from __future__ import annotations

import torch

from . import register, register_dtype_codec
from ..formats._bitpack import pack_bits, unpack_bits
from ._chunks import chunk_elements, pack_chunks, unpack_chunks
from .base import Codec, Packed


@register
class BitmaskCodec(Codec):
    name = "bitmask"
    lossless = True
    dtypes = frozenset({torch.bool})

    def encode(self, x: torch.Tensor, *, key: int = 0) -> Packed:
        if x.dtype != torch.bool:
            raise ValueError(f"bitmask codec takes bool tensors; got dtype={x.dtype}")
        flat = x.reshape(-1).view(torch.uint8)
        n = flat.numel()
        if n <= chunk_elements(x.device):
            bits = pack_bits(flat)
        else:
            bits = pack_chunks(n, x.device, lambda start, end, codes: codes.copy_(flat[start:end]))
        return Packed(self.name, x.shape, x.dtype, x.device, {"bits": bits})

    def decode(self, packed: Packed) -> torch.Tensor:
        n, bits = packed.numel, packed.buffers["bits"]
        if n <= chunk_elements(packed.device):
            return unpack_bits(bits, n, packed.shape)
        out = torch.empty(n, dtype=torch.uint8, device=packed.device)
        unpack_chunks(bits, n, lambda start, end, codes: out[start:end].copy_(codes))
        return out.view(torch.bool).view(packed.shape)

    def bits_per_element(self, x: torch.Tensor, packed: Packed | None = None) -> float:
        return 1.0


register_dtype_codec(torch.bool, BitmaskCodec.name)
