"""The ``division`` codec: DIVISION's dual-precision form (:mod:`lightning_act.formats.division`)."""
from __future__ import annotations

import functools
import math

import torch

from .._validate import check_choice, check_int
from ..cuda.division import division_decode_cuda, division_decode_cuda_packed, division_encode_cuda_packed
from ..cuda.launcher import DTYPE_CODES, OneBuffer
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


def _compiled_path():
    """:mod:`lightning_act.formats.compiled_division`, imported on first use (backend='compile' only)."""
    from ..formats import compiled_division

    return compiled_division


# planes_and_spatial of the shapes met: the same few hundred every step
_planes_and_spatial = functools.lru_cache(maxsize=4096)(planes_and_spatial)


@functools.lru_cache(maxsize=4096)
def _bits_per_element(shape: torch.Size, block_size: int, bits: int) -> float:
    planes, spatial = _planes_and_spatial(shape)
    numel = planes * math.prod(spatial)
    if numel == 0:
        return float(bits)
    return bits + 16.0 * planes * (math.prod(block_counts(spatial, block_size)) + 2) / numel


@register
class DivisionCodec(Codec):
    """Average-pooled bfloat16 copy (block ``block_size`` per spatial dim) + ``bits``-bit per-channel residual."""

    name = "division"
    dtypes = frozenset(FLOAT_DTYPES)
    logical_layout = True  # pools over the spatial dims of each (sample, channel) plane
    config_fields = ("seed", "backend")  # block size and residual bits keep DIVISION's defaults (B=8, Q=2)
    # buffers given as separate tensors (a dict): the format was checked in __init__, not again per tensor
    _decode_kernel = functools.partial(division_decode_cuda, checked=False)

    def __init__(self, block_size: int = 8, bits: int = 2, seed: int = 0, backend: str = "auto"):
        check_int("block_size", block_size, minimum=1)
        check_choice("bits", bits, PACKABLE_BITS)
        check_int("seed", seed, minimum=0)
        check_backend(backend)
        self.block_size, self.bits, self.seed, self.backend = block_size, bits, seed, backend

    def encode(self, x: torch.Tensor, *, key: int = 0) -> Packed:
        check_float_input(self.name, x)
        planes, spatial = _planes_and_spatial(saved_layout(x))
        meta = {"planes": planes, "spatial": spatial, "block_size": self.block_size, "bits": self.bits}
        if x.numel() == 0:
            empty = {n: x.new_empty(0, dtype=d) for n, d in
                     (("lfc", torch.bfloat16), ("payload", torch.uint8), ("mn", torch.bfloat16),
                      ("step", torch.bfloat16))}
            return Packed(self.name, x.shape, x.dtype, x.device, empty, meta)
        if self.runs_kernels(x):  # the format was checked once, in __init__: the kernel path checks nothing more
            buffers = division_encode_cuda_packed(x.contiguous(), planes, spatial, self.block_size, self.bits,
                                                  self.seed, key)
            return Packed(self.name, x.shape, x.dtype, x.device, buffers, meta)
        encode = division_encode_reference if self.backend != "compile" else _compiled_path().division_encode_compiled
        lfc, payload, mn, step = encode(x.reshape(planes, *spatial).contiguous(), self.block_size, self.bits, self.seed,
                                        key)
        return Packed(self.name, x.shape, x.dtype, x.device,
                      {"lfc": lfc, "payload": payload, "mn": mn, "step": step}, meta)

    def decode(self, packed: Packed) -> torch.Tensor:
        b, m = packed.buffers, packed.meta
        if type(b) is OneBuffer and self.runs_kernels(b.data, packed.dtype):  # what the kernel path stored
            return division_decode_cuda_packed(b, packed.shape, m["planes"], m["spatial"], m["block_size"],
                                               m["bits"], packed.dtype)
        if packed.numel == 0:
            return torch.empty(packed.shape, dtype=packed.dtype, device=packed.device)
        planes, spatial, block = m["planes"], m["spatial"], m["block_size"]
        lfc = b["lfc"].view(planes, *block_counts(spatial, block))  # a OneBuffer's part is flat
        args = (lfc, b["payload"], b["mn"], b["step"], planes, spatial, block, m["bits"], packed.dtype)
        if self.runs_kernels(lfc, packed.dtype):
            decode = self._decode_kernel
        elif self.backend == "compile":
            decode = _compiled_path().division_decode_compiled
        else:
            decode = division_decode_reference
        return decode(*args).view(packed.shape)

    def kernels_take(self, dtype: torch.dtype) -> bool:
        return dtype in DTYPE_CODES

    def bits_per_element(self, x: torch.Tensor, packed: Packed | None = None) -> float:
        """Residual bits + the bfloat16 block means + two bfloat16 statistics per plane, per element."""
        return _bits_per_element(saved_layout(x), self.block_size, self.bits)
