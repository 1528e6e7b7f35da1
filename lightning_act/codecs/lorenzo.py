"""The ``lorenzo`` codec: error-bounded Lorenzo coding with zero preservation (Jin et al.; the format and its
guarantee: :mod:`lightning_act.formats.lorenzo`). On the kernel path no step reads a device value on the host:
the payload is first the most the tensor can store, and is cut to its size once the GPU has written it
(:mod:`lightning_act.cuda.lorenzo` says how, and what that costs in memory meanwhile). Off the kernels it runs the
format's fast torch path (:mod:`lightning_act.formats.lorenzo_fast`), byte for byte the specification's."""
from __future__ import annotations

import torch

from .._validate import check_positive_float
from ..cuda.launcher import OneBuffer
from ..cuda.lorenzo import (TRIMS, bound_scalars, lorenzo_decode_cuda, lorenzo_decode_cuda_packed,
                            lorenzo_encode_cuda_packed, supports)
from ..formats.floats import FLOAT_DTYPES, check_float_input
from ..formats.lorenzo_fast import lorenzo_decode_fast, lorenzo_encode_fast
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
    shrinks_later = True  # the lazy trim
    keeps_infinities = True  # non-finite values are escapes, stored raw

    def __init__(self, error_bound: float | None = None, backend: str = "auto"):
        self.error_bound = error_bound
        check_backend(backend)
        self.backend = backend

    @property
    def error_bound(self) -> float:
        return self._error_bound

    @error_bound.setter
    def error_bound(self, value: float) -> None:
        check_positive_float("error_bound", value)
        self._error_bound = float(value)
        self._bound = bound_scalars(self._error_bound)  # the kernels' (eb, step, inv), built once per bound

    def encode(self, x: torch.Tensor, *, key: int = 0) -> Packed:
        check_float_input(self.name, x)
        meta = {"error_bound": self._error_bound}
        if not self.runs_kernels(x):
            return Packed(self.name, x.shape, x.dtype, x.device,
                          lorenzo_encode_fast(x.reshape(-1), self._error_bound), meta)
        TRIMS.poll()
        buffers, scan = lorenzo_encode_cuda_packed(x.contiguous(), self._bound)
        packed = Packed(self.name, x.shape, x.dtype, x.device, buffers, meta)
        TRIMS.track(packed, scan)
        return packed

    def decode(self, packed: Packed) -> torch.Tensor:
        b, error_bound = packed.buffers, packed.meta["error_bound"]
        if type(b) is OneBuffer:  # the kernel path's form
            if self.runs_kernels(b.data, packed.dtype):
                TRIMS.poll()
                step = (self._bound if error_bound == self._error_bound else bound_scalars(error_bound))[1]
                return lorenzo_decode_cuda_packed(b, packed.shape, step, packed.dtype)
        elif self.runs_kernels(b["header"], packed.dtype):
            return lorenzo_decode_cuda(b, packed.numel, error_bound, packed.dtype).view(packed.shape)
        return lorenzo_decode_fast(b, packed.numel, error_bound, packed.dtype).view(packed.shape)

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

