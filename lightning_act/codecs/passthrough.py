"""The identity codec ``none``: keeps the tensor as it is (L0, and the reference for every ratio)."""
from __future__ import annotations

import torch

from ..formats.floats import require_tensor
from . import register
from .base import Codec, Packed


@register
class PassthroughCodec(Codec):
    name = "none"
    lossless = True

    def encode(self, x: torch.Tensor, *, key: int = 0) -> Packed:
        require_tensor(self.name, x)
        return Packed(self.name, x.shape, x.dtype, x.device, {"raw": x.contiguous()})

    def decode(self, packed: Packed) -> torch.Tensor:
        return packed.buffers["raw"]
