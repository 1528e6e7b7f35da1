"""The ``lorenzo`` codec: error-bounded Lorenzo coding with zero preservation (Jin et al.; the format and its
guarantee: :mod:`lightning_act.formats.lorenzo`). On the kernel path no step reads a device value on the host:
the payload is first the most the tensor can store, and is cut to its size once the GPU has written it
(:mod:`lightning_act.cuda.lorenzo` says how, and what that costs in memory meanwhile)."""
from __future__ import annotations

import torch

from .._validate import check_positive_float
from ..cuda.lorenzo import TRIMS, lorenzo_decode_cuda, lorenzo_encode_cuda, supports
from ..formats.floats import FLOAT_DTYPES, check_float_input
from ..formats.lorenzo import lorenzo_decode_reference, lorenzo_encode_reference
from . import register
from .backend import check_backend
from .base import Codec, Packed


@register
class LorenzoCodec(Codec):
    """Error-bounded Lorenzo codec: ``|x - decode(x)| <= error_bound`` for every finite element, strictly."""

    name = "lorenzo"
    dtypes = frozenset(FLOAT_DTYPES)
    config_fields = ("error_bound", "backend")
    side_stream_safe = False  # the lazy trim reads sizes by events recorded on the stream the encode ran on

    def __init__(self, error_bound: float | None = None, backend: str = "auto"):
        check_positive_float("error_bound", error_bound)
        check_backend(backend)
        self.error_bound = float(error_bound)
        self.backend = backend

    def encode(self, x: torch.Tensor, *, key: int = 0) -> Packed:
        check_float_input(self.name, x)
        flat = x.reshape(-1)
        meta = {"error_bound": self.error_bound}
        if not self.runs_kernels(flat):
            return Packed(self.name, x.shape, x.dtype, x.device, lorenzo_encode_reference(flat, self.error_bound),
                          meta)
        TRIMS.poll()
        buffers, payload_bytes = lorenzo_encode_cuda(flat.contiguous(), self.error_bound)
        packed = Packed(self.name, x.shape, x.dtype, x.device, buffers, meta)
        TRIMS.track(packed, payload_bytes)
        return packed

    def decode(self, packed: Packed) -> torch.Tensor:
        if not self.runs_kernels(packed.buffers["header"], packed.dtype):
            decoded = lorenzo_decode_reference(packed.buffers, packed.numel, packed.meta["error_bound"], packed.dtype)
            return decoded.view(packed.shape)
        TRIMS.poll()
        return lorenzo_decode_cuda(packed.buffers, packed.numel, packed.meta["error_bound"], packed.dtype
                                   ).view(packed.shape)

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

