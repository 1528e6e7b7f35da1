"""The ``quantize`` codec (ActNN / GACT): per-group stochastic rounding to 1/2/4/8 bits
(:mod:`lightning_act.formats.quantize` is its specification), a bfloat16 cast at 16 bits, raw at 32."""
from __future__ import annotations

import functools

import torch

from .._validate import check_choice, check_int
from ..cuda.launcher import DTYPE_CODES, KernelRunner, OneBuffer
from ..cuda.quantize import QuantizeKernels, dequantize_cuda, supports
from ..formats._bitpack import PACKABLE_BITS
from ..formats.floats import FLOAT_DTYPES, canonical_nan_, check_float_input
from ..formats.quantize import STATS_DTYPES, dequantize_reference, quantize_reference
from . import register
from ._chunks import chunk_elements, spans
from .backend import check_backend
from .base import Codec, Packed

ALLOWED_BITS = (1, 2, 4, 8, 16, 32)


def _canonical_nan_chunks(t: torch.Tensor) -> torch.Tensor:
    """``canonical_nan_`` chunk by chunk (its NaN mask is a byte per element: a chunk's worth, not the tensor's)."""
    flat = t.view(-1)
    for start, end in spans(flat.numel(), chunk_elements(t.device)):
        canonical_nan_(flat[start:end])
    return t


def _compiled_path():
    """:mod:`lightning_act.formats.compiled`, imported on first use (backend='compile' only)."""
    from ..formats import compiled

    return compiled


@register
class QuantizeCodec(Codec):
    """``bits`` in 1/2/4/8: per-group stochastic rounding; 16: bfloat16 cast (16-bit inputs kept); 32: raw."""

    name = "quantize"
    dtypes = frozenset(FLOAT_DTYPES)
    config_fields = ("bits", "group_size", "stats_dtype", "seed", "backend")
    keeps_range = True  # codes on a grid from each group's minimum to its maximum (16 bits: bfloat16 values)
    # buffers given as separate tensors (a dict): the format was checked in __init__, not again per tensor
    _decode_kernel = functools.partial(dequantize_cuda, checked=False)

    def __init__(self, bits: int = 4, group_size: int = 256, stats_dtype: str = "float32", seed: int = 0,
                 backend: str = "auto"):
        check_choice("bits", bits, ALLOWED_BITS)
        check_int("group_size", group_size, minimum=32, multiple_of=32)
        check_choice("stats_dtype", stats_dtype, STATS_DTYPES)
        check_int("seed", seed, minimum=0)
        check_backend(backend)
        self.bits, self.group_size, self.seed, self.backend = bits, group_size, seed, backend
        self.stats_dtype = STATS_DTYPES[stats_dtype]
        self._kernels_take_format = supports(bits, group_size)
        self._kernels = QuantizeKernels(bits, group_size, self.stats_dtype, seed) if self._kernels_take_format else None
        self._meta = {"bits": bits, "group_size": group_size}  # every encoded form's (read only)

    @property
    def keeps_infinities(self) -> bool:
        return self.bits >= 16  # the bfloat16 cast and the raw form do; a group on the grid holding one is NaN

    def encode(self, x: torch.Tensor, *, key: int = 0) -> Packed:
        check_float_input(self.name, x)
        if self.bits == 32 or (self.bits == 16 and x.element_size() == 2):
            return Packed(self.name, x.shape, x.dtype, x.device, {"raw": x.contiguous()}, {"bits": self.bits})
        if self.bits == 16:
            return Packed(self.name, x.shape, x.dtype, x.device, {"raw": _canonical_nan_chunks(x.to(torch.bfloat16))},
                          {"bits": 16})
        runner = self.kernel_runner(x, x.dtype)
        if runner is not None:  # the format was checked once, in __init__: the kernel path checks nothing more
            return Packed(self.name, x.shape, x.dtype, x.device, self._kernels.encode(x.contiguous(), key, runner),
                          self._meta)
        encode = quantize_reference if self.backend != "compile" else _compiled_path().quantize_compiled
        payload, mn, step = encode(x.contiguous(), self.bits, self.group_size, self.stats_dtype, self.seed, key)
        return Packed(self.name, x.shape, x.dtype, x.device, {"payload": payload, "mn": mn, "step": step},
                      self._meta)

    def decode(self, packed: Packed) -> torch.Tensor:
        b, meta = packed.buffers, packed.meta
        if type(b) is OneBuffer:  # what the kernel path stored
            runner = self.kernel_runner(b.data, packed.dtype)
            # this codec's own format (another bit width's form decodes by its meta, below)
            if runner is not None and (meta is self._meta or meta == self._meta) \
                    and b.layout.dtypes[1] is self.stats_dtype:
                return self._kernels.decode(b, packed.shape, packed.dtype, runner)
        elif "raw" in b:
            raw = b["raw"]
            if raw.dtype == packed.dtype:  # lossless: the input's own bits
                return raw.view(packed.shape)
            return _canonical_nan_chunks(raw.to(packed.dtype)).view(packed.shape)
        args = (b["payload"], b["mn"], b["step"], packed.numel, meta["bits"], meta["group_size"], packed.dtype)
        if self.runs_kernels(b["payload"], packed.dtype):
            decode = self._decode_kernel
        else:
            decode = dequantize_reference if self.backend != "compile" else _compiled_path().dequantize_compiled
        return decode(*args).view(packed.shape)

    def kernels_take(self, dtype: torch.dtype) -> bool:
        return self._kernels_take_format and dtype in DTYPE_CODES

    def kernel_path(self, t: torch.Tensor, dtype: torch.dtype) -> tuple[QuantizeKernels, KernelRunner] | None:
        """``(kernels, runner)`` where :meth:`runs_kernels` for ``t`` and ``dtype``, else None: the kernel path
        itself, for callers that encode and decode flat contiguous tensors in this format (the compiled ops) and
        need none of :meth:`encode`'s checks nor its ``Packed``."""
        runner = self.kernel_runner(t, dtype)
        return None if runner is None else (self._kernels, runner)

    def bits_per_element(self, x: torch.Tensor, packed: Packed | None = None) -> float:
        if self.bits in PACKABLE_BITS:
            return float(self.bits)
        return 8.0 * x.element_size() if self.bits == 32 else 16.0
