"""The ``lorenzo`` codec: error-bounded Lorenzo coding with zero preservation (Jin et al.; the format and its
guarantee: :mod:`lightning_act.formats.lorenzo`)."""
from __future__ import annotations

import torch

from .._validate import check_positive_float
from ..cuda.lorenzo import lorenzo_decode_cuda, lorenzo_encode_cuda, supports
from ..formats.floats import FLOAT_DTYPES, check_float_input
from ..formats.lorenzo import checked_float, lorenzo_decode_reference, lorenzo_encode_reference, working_bound
from . import register
from .backend import check_backend
from .base import Codec, Packed


@register
class LorenzoCodec(Codec):
    """Error-bounded Lorenzo codec: ``|x - decode(x)| <= error_bound`` for every finite element, strictly."""

    name = "lorenzo"
    dtypes = frozenset(FLOAT_DTYPES)
    config_fields = ("error_bound", "backend")

    def __init__(self, error_bound: float | None = None, backend: str = "auto"):
        check_positive_float("error_bound", error_bound)
        check_backend(backend)
        self.error_bound = float(error_bound)
        self.backend = backend

    def encode(self, x: torch.Tensor, *, key: int = 0) -> Packed:
        check_float_input(self.name, x)
        flat = x.reshape(-1)
        encode = lorenzo_encode_cuda if self.runs_kernels(flat) else lorenzo_encode_reference
        buffers = encode(flat.contiguous(), self.error_bound)
        packed = Packed(self.name, x.shape, x.dtype, x.device, buffers, {"error_bound": self.error_bound})
        raw_bytes = flat.numel() * flat.element_size()
        if packed.nbytes > raw_bytes:  # incompressible: the raw values, still zero-preserving
            raw = torch.where(checked_float(flat).abs() <= working_bound(self.error_bound)[0], 0, flat)
            packed = Packed(self.name, x.shape, x.dtype, x.device, {"raw": raw},
                            {"error_bound": self.error_bound})
        return packed

    def decode(self, packed: Packed) -> torch.Tensor:
        if "raw" in packed.buffers:
            return packed.buffers["raw"].view(packed.shape)
        decode = lorenzo_decode_cuda if self.runs_kernels(packed.buffers["header"], packed.dtype) \
            else lorenzo_decode_reference
        return decode(packed.buffers, packed.numel, packed.meta["error_bound"], packed.dtype).view(packed.shape)

    def kernels_take(self, dtype: torch.dtype) -> bool:
        return supports(dtype)

    def bits_per_element(self, x: torch.Tensor, packed: Packed | None = None) -> float:
        """Stored bits per element of ``packed``, the encoding of ``x`` (the size depends on the data); the raw
        size without it."""
        if packed is None:
            return 8.0 * x.element_size()
        return 8.0 * packed.nbytes / max(packed.numel, 1)

    def __repr__(self) -> str:
        return f"LorenzoCodec(error_bound={self.error_bound!r}, backend={self.backend!r})"

