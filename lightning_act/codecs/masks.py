"""Lossless few-bit forms of saved tensors whose backward reads little (DIVISION appendix J): ReLU signs,
dropout masks and max-pool argmax indices.

How the engine learns which op saved a tensor: a ``FunctionTracker`` (``lightning_act.optrack``) records
the tracked torch function call that is running while autograd packs its saved tensors, and the rules
registered here (``op_rules.register_op_rule``) map those functions to the codecs below. Chosen over the
alternatives because a saved tensor's ``grad_fn`` cannot tell a ReLU saving its output from the next layer
saving the same tensor as input, and replacing modules misses functional calls (``F.relu``, ``x.relu()``)
and rewrites user models; the tracker wraps the functions where code looks them up, so it sees ``nn.ReLU``,
``F.relu``, ``torch.relu`` and ``Tensor.relu_`` alike (the outermost call is reported: ``nn.ReLU`` shows up as
``F.relu``), with the call's arguments (the max-pool geometry); a builtin held in a variable since before the
forward (``act = torch.relu``) runs untracked, its saves getting the default codec. The engine keys its
de-duplication by codec, so a ReLU output the next layer also saves is stored twice: 1 bit for the ReLU,
the values for the layer.

- ``positive_mask``: ``x > 0`` at 1 bit, decoded as 1/0. ReLU saves its output and its backward reads only
  ``result > 0`` (leaky ReLU reads ``input > 0`` or ``result > 0``), so gradients are bit-identical.
- ``scaled_mask``: a tensor whose non-zeros all equal one value ``s`` (CPU dropout saves its float noise,
  0 or ``1/(1-p)``) as 1 bit per element + ``s``; exact. CUDA dropout saves a bool mask: the engine's
  default ``bitmask`` codec takes it.
- ``positive_mask`` and ``scaled_mask`` (and ``bitmask``) run one kernel per direction on CUDA (``backend`` "auto"
  with CuPy, or "cupy": :mod:`lightning_act.cuda.masks`), the same bits as their torch path; ``scaled_mask`` takes
  its value with one ``amax`` on the device, never read on the host unless ``check`` verifies it.
- ``maxpool_index``: max-pool's int64 argmax (flat index in the input plane) as its offset inside its
  pooling window, ``ceil(log2(window))`` bit-planes of 1 bit per element; decoded back to the exact flat
  index from the pooling geometry. The pooled input itself goes to the default codec.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from ..cuda.masks import mask_decode_packed, mask_encode_packed
from ..formats._bitpack import bit_rows, pack_bits, pack_codes_, packed_nbytes, unpack_bits, unpack_rows
from ..formats.floats import require_tensor
from . import op_rules, register
from ._chunks import chunk_elements, pack_chunks, spans, unpack_chunks
from .bitmask import OneBitCodec
from .passthrough import PassthroughCodec
from .base import Codec, Packed

FLOATING = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64})


def _float_input(codec: str, x: torch.Tensor) -> None:
    if not (isinstance(x, torch.Tensor) and x.is_floating_point()):
        require_tensor(codec, x)
        raise ValueError(f"{codec} codec takes floating-point tensors; got dtype={x.dtype}")


@register
class PositiveMaskCodec(OneBitCodec):
    """``x > 0`` at 1 bit per element, decoded as 1 where positive, else 0 (what ReLU's backward reads)."""

    name = "positive_mask"  # lossless for the sign pattern, all that ReLU's backward reads
    dtypes = FLOATING

    def encode(self, x: torch.Tensor, *, key: int = 0) -> Packed:
        _float_input(self.name, x)
        if self.runs_kernels(x):
            return Packed(self.name, x.shape, x.dtype, x.device, {"bits": mask_encode_packed(x.contiguous(), True)})
        flat = x.reshape(-1)
        n = flat.numel()
        if n <= chunk_elements(x.device):
            bits = pack_bits(flat.gt(0))
        else:
            bits = pack_chunks(n, x.device,
                               lambda start, end, codes: torch.gt(flat[start:end], 0, out=codes.view(torch.bool)))
        return Packed(self.name, x.shape, x.dtype, x.device, {"bits": bits})

    def decode(self, packed: Packed) -> torch.Tensor:
        n, bits = packed.numel, packed.buffers["bits"]
        if self.runs_kernels(bits, packed.dtype):
            return mask_decode_packed(bits, packed.shape, packed.dtype)
        if n <= chunk_elements(packed.device):
            return unpack_bits(bits, n, packed.shape, packed.dtype)
        out = torch.empty(n, dtype=packed.dtype, device=packed.device)
        unpack_chunks(bits, n, lambda start, end, codes: out[start:end].copy_(codes))
        return out.view(packed.shape)


@register
class ScaledMaskCodec(OneBitCodec):
    """A tensor whose non-zero elements all equal one value (dropout noise, an additive 0/-inf mask) as 1 bit
    per element + that value. ``strict=False``: a tensor of several values is stored as it is (raw) instead of
    raising, for op rules that cannot tell beforehand (what SDPA saves besides q, k, v). ``check=False``: no
    verification passes (and no host read of their result on CUDA), for callers that know it by construction:
    the engine's dropout rule, whose noise is 0 or ``1/(1-p)``. On the kernel path, ``check=False`` encodes in two
    launches (the ``amax`` and the mask) and decodes in one."""

    name = "scaled_mask"
    dtypes = FLOATING

    def __init__(self, strict: bool = True, check: bool = True, backend: str = "auto"):
        for name, value in (("strict", strict), ("check", check)):
            if not isinstance(value, bool):
                raise ValueError(f"{name}={value!r}; expected True or False")
        super().__init__(backend)
        self.strict, self.check = strict, check

    def encode(self, x: torch.Tensor, *, key: int = 0) -> Packed:
        _float_input(self.name, x)
        kernels = self.runs_kernels(x)
        # the kernel reads x in memory order, where the maximum of all elements needs no flat view
        flat = x.contiguous() if kernels else x.reshape(-1)
        n = flat.numel()
        # dropout noise (0 or 1/(1-p)): the value is the maximum, one reduction; else the first non-zero element
        scale = flat.amax() if n else flat.new_zeros(())
        if self.check and not _holds_one_value(flat := flat.view(-1), scale):
            first = _first_nonzero(flat)  # None: all zeros, which any scale holds
            if first is not None:
                scale = first
                if not _holds_one_value(flat, scale):
                    if not self.strict:
                        return Packed(self.name, x.shape, x.dtype, x.device, {"raw": x.contiguous()})
                    raise ValueError(f"scaled_mask codec takes tensors whose non-zero elements all equal one "
                                     f"value; got a tensor of shape {list(x.shape)} with several non-zero values")
        if kernels:
            bits = mask_encode_packed(flat)  # x != 0 (NaN is non-zero)
        elif n <= chunk_elements(x.device):
            bits = pack_bits(flat.bool())  # x != 0 (NaN is non-zero), several times faster than ne(0) on CPU
        else:
            bits = pack_chunks(n, x.device, lambda start, end, codes: codes.view(torch.bool).copy_(flat[start:end]))
        return Packed(self.name, x.shape, x.dtype, x.device, {"bits": bits, "scale": scale})

    def decode(self, packed: Packed) -> torch.Tensor:
        buffers, n = packed.buffers, packed.numel
        if "raw" in buffers:
            return buffers["raw"].view(packed.shape)
        scale = buffers["scale"]
        if self.runs_kernels(buffers["bits"], packed.dtype):
            return mask_decode_packed(buffers["bits"], packed.shape, packed.dtype, scale)
        if n <= chunk_elements(packed.device):
            # the bit table's 0/1 as 0/scale (2048 elements), then one gather: no pass over a bool tensor of n
            return unpack_rows(buffers["bits"], n, packed.shape, torch.where(bit_rows(packed.device), scale, 0.0))
        zero = scale.new_zeros(())
        out = torch.empty(n, dtype=packed.dtype, device=packed.device)
        unpack_chunks(buffers["bits"], n,
                      lambda start, end, codes: torch.where(codes.view(torch.bool), scale, zero, out=out[start:end]))
        return out.view(packed.shape)

    def bits_per_element(self, x: torch.Tensor, packed: Packed | None = None) -> float:
        if packed is not None and "raw" in packed.buffers:
            return 8.0 * x.element_size()
        return 1.0


def _holds_one_value(flat: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether the elements of ``flat`` equal to ``scale`` are exactly its non-zero ones: every non-zero element
    equals ``scale`` (NaN never does), and there is one (unless ``flat`` is empty). One host read: of the
    comparison (one chunk), else of a device flag that each chunk's comparison updates."""
    n, chunk = flat.numel(), chunk_elements(flat.device)
    if n <= chunk:
        return torch.equal(flat.eq(scale), flat.bool())
    ok = torch.ones((), dtype=torch.bool, device=flat.device)
    for start, end in spans(n, chunk):
        part = flat[start:end]
        ok &= part.eq(scale).eq_(part.bool()).all()
    return bool(ok)


def _first_nonzero(flat: torch.Tensor) -> torch.Tensor | None:
    """The first non-zero element of ``flat`` (a 0-dim copy), or None."""
    for start, end in spans(flat.numel(), chunk_elements(flat.device)):
        nonzero = flat[start:end] != 0
        if bool(nonzero.any()):
            return flat[start + int(nonzero.to(torch.uint8).argmax())].clone()  # a view would keep x alive
    return None


def _int_tuple(field: str, value: Any, ndim: int, minimum: int) -> tuple[int, ...]:
    """An int or a sequence of ``ndim`` ints (one int is broadcast, as torch does), each ``>= minimum``."""
    values = (value,) if isinstance(value, int) else tuple(value) if isinstance(value, (tuple, list)) else None
    if values is not None and len(values) == 1:
        values = values * ndim
    if values is None or len(values) != ndim or any(
            isinstance(v, bool) or not isinstance(v, int) or v < minimum for v in values):
        raise ValueError(f"{field}={value!r}; expected an integer >= {minimum} or {ndim} of them")
    return values


def _pooled_size(size: int, kernel: int, stride: int, padding: int, dilation: int, ceil_mode: bool) -> int:
    """Output length of one pooled dim, as ATen's ``pooling_output_shape`` computes it."""
    out = (size + 2 * padding - dilation * (kernel - 1) - 1 + (stride - 1 if ceil_mode else 0)) // stride + 1
    if ceil_mode and (out - 1) * stride >= size + padding:
        out -= 1  # the last window must start inside the input or its left padding
    return out


def _plane_rows(x: torch.Tensor, p0: int, p1: int, per_plane: int, nd: int) -> torch.Tensor:
    """Planes ``p0:p1`` of ``x`` (row-major over its leading dims; its last ``nd`` dims are one plane) as a
    ``(p1 - p0, per_plane)`` tensor: a view when ``x`` is contiguous, else a copy of those planes only (a
    channels_last tensor is never copied whole)."""
    if x.is_contiguous():
        return x.view(-1, per_plane)[p0:p1]
    lead = x.shape[:-nd]
    last = lead[-1] if lead else 1
    rows = x.reshape(-1, last, *x.shape[x.dim() - nd:])  # merges the leading dims but the last: a view for NCHW
    blocks = []
    for r in range(p0 // last, -(-p1 // last)):
        c0, c1 = max(p0 - r * last, 0), min(p1 - r * last, last)
        blocks.append(rows[r, c0:c1].reshape(c1 - c0, per_plane))
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks)


def _unravel(flat: torch.Tensor, sizes: tuple[int, ...]) -> list[torch.Tensor]:
    coords = []
    for s in reversed(sizes):
        coords.append(flat % s)
        flat = flat // s
    return coords[::-1]


def _ravel(coords: list[torch.Tensor], sizes: tuple[int, ...]) -> torch.Tensor:
    flat = coords[0]
    for c, s in zip(coords[1:], sizes[1:]):
        flat = flat * s + c
    return flat


@register
class MaxPoolIndexCodec(Codec):
    """Max-pool argmax indices as window-local offsets in ``ceil(log2(window))`` bits per element.

    Args:
        kernel_size, stride, padding, dilation, ceil_mode: the pooling's arguments (``stride=None`` = kernel).
        input_size: the pooled input's spatial size (1, 2 or 3 dims); the flat indices refer to it.
        check: verify that every index lies in its window (a host read of the result on CUDA); ``False`` for
            callers that know it by construction: the engine's max-pool rule.
    """

    name = "maxpool_index"
    general = False  # one pooling's indices: its op rule chooses it
    lossless = True
    dtypes = frozenset({torch.int64})
    logical_layout = True  # indices are flat positions in their (row-major) input plane, whatever the strides

    def __init__(self, kernel_size, input_size, stride=None, padding=0, dilation=1, ceil_mode: bool = False,
                 check: bool = True):
        if not isinstance(check, bool):
            raise ValueError(f"check={check!r}; expected True or False")
        self.check = check
        if isinstance(input_size, int):
            input_size = (input_size,)
        if not isinstance(input_size, (tuple, list, torch.Size)) or not 1 <= len(input_size) <= 3:
            raise ValueError(f"input_size={input_size!r}; expected 1, 2 or 3 spatial sizes")
        nd = len(input_size)
        self.input_size = _int_tuple("input_size", tuple(input_size), nd, 1)
        self.kernel_size = _int_tuple("kernel_size", kernel_size, nd, 1)
        self.stride = _int_tuple("stride", self.kernel_size if stride is None else stride, nd, 1)
        self.padding = _int_tuple("padding", padding, nd, 0)
        self.dilation = _int_tuple("dilation", dilation, nd, 1)
        if not isinstance(ceil_mode, bool):
            raise ValueError(f"ceil_mode={ceil_mode!r}; expected one of False, True")
        self.output_size = tuple(_pooled_size(*a, ceil_mode) for a in zip(
            self.input_size, self.kernel_size, self.stride, self.padding, self.dilation))
        if min(self.output_size) < 1:
            raise ValueError(f"kernel_size={self.kernel_size}, padding={self.padding}, dilation={self.dilation} "
                             f"give no output for input_size={self.input_size}; expected a window that fits")
        self.window = math.prod(self.kernel_size)
        self.bits = (self.window - 1).bit_length()
        self._tables: dict[torch.device, torch.Tensor] = {}
        self._starts: dict[torch.device, list[torch.Tensor]] = {}
        # window-local offsets in the narrowest dtype that holds them: the bit-plane passes move a byte each
        self._offset_dtype = torch.uint8 if self.bits <= 8 else torch.int32
        # the index arithmetic in int32 where an input plane's positions fit (half the memory and bytes of int64)
        self._coord_dtype = torch.int32 if math.prod(self.input_size) < 2 ** 31 else torch.int64

    def _window_starts(self, device: torch.device) -> list[torch.Tensor]:
        """Per output position (row-major over ``output_size``), the first input coordinate of its window (made on
        the device once)."""
        starts = self._starts.get(device)
        if starts is None:
            positions = torch.arange(math.prod(self.output_size), dtype=self._coord_dtype, device=device)
            starts = self._starts[device] = [o * s - p for o, s, p in zip(
                _unravel(positions, self.output_size), self.stride, self.padding)]
        return starts

    def _planes_per_chunk(self, device: torch.device) -> int:
        """Whole output planes per chunk (at least one), a multiple of the planes that fill whole bytes of a
        bit-plane, so every chunk's bits start on a byte. On CPU an eighth of the float codecs' chunk (the index
        arithmetic keeps several temporaries of a chunk alive at once), elsewhere all of it, in int32 (as much
        memory as half a chunk in int64): a GPU runs each chunk's ops as launches the host waits on (ResNet-50's 128
        x 64 x 56 x 56 indices took 49 chunks of about 45 launches each way, 140 ms of host time a step on an
        H100's host; 13 chunks of about 20 in run 6, now 7)."""
        per_plane = math.prod(self.output_size)
        align = 8 // math.gcd(per_plane, 8)
        share = 8 if device.type == "cpu" else (1 if self._coord_dtype == torch.int32 else 2)
        return align * max(1, chunk_elements(device) // share // (per_plane * align))

    def _plane_tables(self, device: torch.device) -> torch.Tensor:
        """``(bits, 256, 8)``: row ``v`` of table ``b`` holds the bits of byte ``v`` shifted to bit ``b`` (in the
        offsets' dtype), least significant first, made on the device once: a bit-plane's bytes unpack and take their
        place in the offsets in one gather."""
        tables = self._tables.get(device)
        if tables is None:
            shifts = torch.arange(self.bits, dtype=self._offset_dtype, device=device)[:, None, None]
            tables = self._tables[device] = bit_rows(device, self._offset_dtype)[None] << shifts
        return tables

    def encode(self, x: torch.Tensor, *, key: int = 0) -> Packed:
        per_plane = math.prod(self.output_size)
        if getattr(x, "dtype", None) != torch.int64 or x.numel() % per_plane:
            require_tensor(self.name, x)
            raise ValueError(f"maxpool_index codec takes int64 tensors of whole {list(self.output_size)} output "
                             f"planes; got dtype={x.dtype} with {x.numel()} elements")
        n, device = x.numel(), x.device
        out = torch.empty((self.bits, packed_nbytes(n, 1)), dtype=torch.uint8, device=device)
        starts = self._window_starts(device)
        inside = torch.ones((), dtype=torch.bool, device=device)  # one host read in all, after the last chunk
        planes, chunk = n // per_plane, self._planes_per_chunk(device)
        codes = packed = None
        for p0, p1 in spans(planes, chunk):
            index = _plane_rows(x, p0, p1, per_plane, len(self.input_size)).to(self._coord_dtype)
            offsets = [c - start for c, start in zip(_unravel(index, self.input_size), starts)]
            taps = [off if d == 1 else off // d for off, d in zip(offsets, self.dilation)]
            for off, d, t, k in zip(offsets, self.dilation, taps, self.kernel_size):
                if self.check:
                    inside &= ((off % d == 0) & (t >= 0) & (t < k)).all()
            local = _ravel(taps, self.kernel_size).reshape(-1).to(self._offset_dtype)
            m = local.numel()
            whole = -(-m // 8) * 8
            if codes is None:  # the first chunk is the largest; every bit-plane of a chunk is packed in one pass
                codes = torch.empty(self.bits * whole, dtype=torch.uint8, device=device)
                packed = torch.empty(self.bits * whole // 8, dtype=torch.uint8, device=device)
            rows = codes[: self.bits * whole].view(self.bits, whole)  # plane b: bit b of each index, zero-padded
            if m < whole:
                rows[:, m:].zero_()
            for b in range(self.bits):  # a scalar shift per plane: a broadcast one runs several times slower on CPU
                torch.bitwise_and(local >> b, 1, out=rows[b, :m])
            byte0 = p0 * per_plane // 8
            out[:, byte0: byte0 + whole // 8] = pack_codes_(rows.view(-1), 1, packed[: self.bits * whole // 8]
                                                            ).view(self.bits, whole // 8)
        if self.check and not bool(inside):
            raise ValueError(f"maxpool_index codec: an index lies outside its pooling window (kernel_size="
                             f"{self.kernel_size}, stride={self.stride}, padding={self.padding}, dilation="
                             f"{self.dilation}, input_size={self.input_size})")
        return Packed(self.name, x.shape, x.dtype, x.device, {"planes": out})

    def decode(self, packed: Packed) -> torch.Tensor:
        per_plane, n, device = math.prod(self.output_size), packed.numel, packed.device
        out = torch.empty(n, dtype=torch.int64, device=device)
        starts = self._window_starts(device)
        bit_planes = packed.buffers["planes"]
        tables = self._plane_tables(device)
        for p0, p1 in spans(n // per_plane, self._planes_per_chunk(device)):
            e0, e1 = p0 * per_plane, p1 * per_plane
            bytes_ = slice(e0 // 8, e0 // 8 + -(-(e1 - e0) // 8))
            local = None  # each bit-plane's bytes gathered as their bits in place, ORed together
            for b in range(self.bits):
                bits = torch.index_select(tables[b], 0, bit_planes[b, bytes_].int()).view(-1)
                local = bits if local is None else local.bitwise_or_(bits)
            if local is None:  # a window of one element: every offset is 0
                local = torch.zeros(e1 - e0, dtype=self._coord_dtype, device=device)
            local = local[: e1 - e0].to(self._coord_dtype)
            taps = _unravel(local.view(-1, per_plane), self.kernel_size)
            coords = [start + (t if d == 1 else t * d) for start, t, d in zip(starts, taps, self.dilation)]
            out[e0:e1].view(-1, per_plane).copy_(_ravel(coords, self.input_size))
        return out.view(packed.shape)

    def bits_per_element(self, x: torch.Tensor, packed: Packed | None = None) -> float:
        return float(self.bits)


# ---- which op saved the tensor -> codec ---------------------------------------------------------------------
_POSITIVE_MASK = PositiveMaskCodec()
_DROPOUT_NOISE = ScaledMaskCodec(check=False)
_ONE_VALUE_OR_RAW = ScaledMaskCodec(strict=False)
_KEPT_RAW = PassthroughCodec()
_POOL_ARGS = ("input", "kernel_size", "stride", "padding", "dilation", "ceil_mode")
_POOL_DIMS = {
    F.max_pool1d: 1, F.max_pool1d_with_indices: 1, torch.max_pool1d: 1, torch.max_pool1d_with_indices: 1,
    F.max_pool2d: 2, F.max_pool2d_with_indices: 2, torch.max_pool2d: 2,
    F.max_pool3d: 3, F.max_pool3d_with_indices: 3, torch.max_pool3d: 3,
}


def _positive_mask_rule(t: torch.Tensor, call) -> Codec | None:
    return _POSITIVE_MASK if t.is_floating_point() else None


def _dropout_rule(t: torch.Tensor, call) -> Codec | None:
    # CPU dropout saves float noise; CUDA's native_dropout saves a bool mask, left to the bitmask codec
    return _DROPOUT_NOISE if t.is_floating_point() else None


def _max_pool_rule(t: torch.Tensor, call) -> Codec | None:
    if t.dtype != torch.int64:
        return None  # the pooled input: default codec
    args = dict(zip(_POOL_ARGS, call.args), **call.kwargs)
    nd = _POOL_DIMS[call.func]
    return MaxPoolIndexCodec(args["kernel_size"], tuple(args["input"].shape[-nd:]), args.get("stride") or None,
                             args.get("padding", 0), args.get("dilation", 1), bool(args.get("ceil_mode", False)),
                             check=False)  # argmax indices lie in their windows by construction


op_rules.register_op_rule(
    (F.relu, torch.relu, torch.relu_, torch.Tensor.relu, torch.Tensor.relu_, F.leaky_relu, F.leaky_relu_),
    _positive_mask_rule)
op_rules.register_op_rule(
    (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, torch.dropout, torch.dropout_, torch.feature_dropout,
     torch.feature_dropout_),
    _dropout_rule)
op_rules.register_op_rule(tuple(_POOL_DIMS), _max_pool_rule)


def _sdpa_rule(t: torch.Tensor, call) -> Codec | None:
    # Besides q, k, v and softmax outputs (which require grad: default codec), CPU SDPA saves its padding mask
    # as a float 0/-inf tensor (flash path) and its dropout noise (math path), both of the scores' shape.
    # Quantized, a group holding -inf decodes to NaN and every gradient turns NaN; both are one value and
    # zeros: 1 bit each, exact. A scores-shaped tensor of several values (a position bias) is kept raw. Other
    # float tensors saved without grad are the log-sum-exp of each query row (flash and efficient kernels): the
    # backward recomputes the probabilities as exp(scores - lse), so an error d in it scales them by e^-d (a
    # 4-bit grid over a group of rows moves it by a good part of 1): kept exact, a 1 / keys share of the scores.
    if not t.is_floating_point() or t.requires_grad or t.dim() < 2:
        return None
    args = dict(zip(("query", "key"), call.args), **call.kwargs)
    query, key = args.get("query"), args.get("key")
    if not (torch.is_tensor(query) and torch.is_tensor(key)):
        return None
    scores_shaped = t.shape[-1] == key.shape[-2] and t.shape[-2] in (1, query.shape[-2])
    if not scores_shaped:
        return _KEPT_RAW
    # the one-value check's verdict is a host read: off CPU it would make the host wait for the device for each
    # such tensor (CUDA's math fallback), so there the tensor is kept as it is, exact
    return _ONE_VALUE_OR_RAW if t.device.type == "cpu" else _KEPT_RAW


# a gradient rule too: a lossy padding mask or log-sum-exp is a NaN or far-off gradient, so it applies with
# compress_masks=False as well (its codecs are lossless either way)
op_rules.register_op_rule((F.scaled_dot_product_attention,), _sdpa_rule, gradient=True)
