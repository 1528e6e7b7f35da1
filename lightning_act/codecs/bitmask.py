"""Lossless 1 bit per element for boolean tensors (dropout keep-masks, attention masks, comparisons)."""
from __future__ import annotations

import torch

from . import register, register_dtype_codec
from ..cuda.masks import mask_decode_packed, mask_encode_packed
from ..formats._bitpack import pack_bits, unpack_bits
from ..formats.floats import require_tensor
from ._chunks import chunk_elements, pack_chunks, unpack_chunks
from .backend import check_backend
from .base import Codec, Packed


class OneBitCodec(Codec):
    """A lossless 1-bit mask (``bitmask`` here, ``positive_mask`` and ``scaled_mask`` in :mod:`.masks`): on CUDA
    (``backend`` "auto" with CuPy, or "cupy") one kernel per direction (:mod:`lightning_act.cuda.masks`) for every
    dtype the codec takes, the same bits as its torch path."""

    lossless = True
    general = False  # a mask of one op's tensor: the op rules and the bool dtype choose it

    def __init__(self, backend: str = "auto"):
        check_backend(backend)
        self.backend = backend

    def kernels_take(self, dtype: torch.dtype) -> bool:
        return dtype in self.dtypes

    def bits_per_element(self, x: torch.Tensor, packed: Packed | None = None) -> float:
        return 1.0


@register
class BitmaskCodec(OneBitCodec):
    name = "bitmask"
    dtypes = frozenset({torch.bool})

    def encode(self, x: torch.Tensor, *, key: int = 0) -> Packed:
        if getattr(x, "dtype", None) != torch.bool:
            require_tensor(self.name, x)
            raise ValueError(f"bitmask codec takes bool tensors; got dtype={x.dtype}")
        if self.runs_kernels(x):
            return Packed(self.name, x.shape, x.dtype, x.device, {"bits": mask_encode_packed(x.contiguous())})
        flat = x.reshape(-1).view(torch.uint8)
        n = flat.numel()
        if n <= chunk_elements(x.device):
            bits = pack_bits(flat)
        else:
            bits = pack_chunks(n, x.device, lambda start, end, codes: codes.copy_(flat[start:end]))
        return Packed(self.name, x.shape, x.dtype, x.device, {"bits": bits})

    def decode(self, packed: Packed) -> torch.Tensor:
        n, bits = packed.numel, packed.buffers["bits"]
        if self.runs_kernels(bits, torch.bool):
            return mask_decode_packed(bits, packed.shape, torch.bool)
        if n <= chunk_elements(packed.device):
            return unpack_bits(bits, n, packed.shape)
        out = torch.empty(n, dtype=torch.uint8, device=packed.device)
        unpack_chunks(bits, n, lambda start, end, codes: out[start:end].copy_(codes))
        return out.view(torch.bool).view(packed.shape)


register_dtype_codec(torch.bool, BitmaskCodec.name)
