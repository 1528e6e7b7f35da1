"""``NegativeInfinityMask``: a lossy codec for tensors that may hold ``-inf`` (masked logits and what a
log-softmax or a log-sum-exp of them saves, additive attention masks), plus a 1-bit mask of where they do.

Quantize and division store a group or a plane holding ``-inf`` as NaN (their grids span finite ranges), so
``log_softmax(logits.masked_fill(mask, -inf))``, a ``cross_entropy`` or a ``Categorical(logits=...)`` over masked
logits (invalid-action masking) trained on NaN gradients. Here the inner codec stores the values with each
``-inf`` replaced by 0 and the mask brings the ``-inf`` back on decode: exact where they were, the inner codec's
error elsewhere (0 may widen a group's range: log-probabilities lie below it, logits around it). Values below what
the inner format holds are masked too: a float64 mask's ``finfo.min``, which quantize reads (as float32) as ``-inf``,
float32's ``finfo.min`` under bfloat16 statistics, whose minimum rounds down to ``-inf``, and under division any
value whose block sums could overflow. The masked places decode to the least of them (one value: a mask's).

The tensor is processed by chunks of whole inner groups (the quantize format's chunk size; whole, in its shape, for a
codec that reads the shape), each an encoded form of its own, so the stand-in copy stays one chunk long: the log-probabilities of a language model's vocabulary,
saved at the forward's peak, never cost a second full copy. ``+inf`` and NaN stay as the inner codec stores them.
"""
from __future__ import annotations

import torch

from typing import Iterable

from ..cuda.launcher import OneBuffer
from ._chunks import chunk_elements, spans
from .base import Codec, Packed
from .bitmask import BitmaskCodec

_MASK, _LEAST = "neginf", "least"


class NegativeInfinityMask(Codec):
    """``inner`` on the values with ``-inf`` replaced by 0, and a 1-bit mask of the ``-inf`` (under the inner
    codec's name in the statistics, one bit more per element). Built by the engine for the tensors of an op rule's
    ``MinimumBits(infinities=True)`` whose codec does not keep infinities (``Codec.keeps_infinities``)."""

    general = False  # chosen by the op rules, around the configured codec
    keeps_infinities = True

    def __init__(self, inner: Codec, backend: str = "auto"):
        self.inner, self.backend = inner, backend
        # the inner codec's name: a storage saved by it elsewhere (a log-softmax's output that nll_loss saves again)
        # is the same form, stored once
        self.name = inner.name
        self.dtypes, self.keeps_range, self.error_bound = inner.dtypes, inner.keeps_range, inner.error_bound
        self.side_stream_safe, self.logical_layout = inner.side_stream_safe, inner.logical_layout
        self.bits = getattr(inner, "bits", None)
        self._mask = BitmaskCodec(backend)
        # chunks of whole inner groups and whole mask bytes
        self._unit = 8 * getattr(inner, "group_size", 1)
        # the least value the inner format holds: float32's (what quantize reads), or its statistics' dtype's; a
        # pooling format's block sums must not overflow either (division: block_size^3 elements at most)
        stats = getattr(inner, "stats_dtype", torch.float32)
        pooled = getattr(inner, "block_size", 1) ** 3
        self._lowest = -min(torch.finfo(torch.float32).max, torch.finfo(stats).max) / pooled

    def _spans(self, numel: int, device: torch.device) -> Iterable[tuple[int, int]]:
        if self.logical_layout:  # the inner codec reads the tensor's shape (division's planes): one whole form
            return spans(numel, max(numel, 1))
        return spans(numel, max(self._unit, chunk_elements(device) // self._unit * self._unit))

    def encode(self, x: torch.Tensor, *, key: int = 0) -> Packed:
        flat = x.reshape(-1)
        # (a dtype whose values all lie above the bound holds only -inf below it; the bound would round to -inf there)
        negative = flat < self._lowest if torch.finfo(x.dtype).max >= -self._lowest else flat == float("-inf")
        buffers = {_MASK: self._mask.encode(negative).buffers["bits"]}
        least = torch.full((1,), float("inf"), dtype=x.dtype, device=x.device)  # of the masked values
        forms = []
        for i, (start, end) in enumerate(self._spans(flat.numel(), x.device)):
            part, masked = flat[start:end], negative[start:end]
            torch.minimum(least, part.masked_fill(~masked, float("inf")).amin().reshape(1), out=least)
            # (a chunk's own copy: an inner form may keep what it was given, as quantize's raw forms do)
            stand_in = part.masked_fill(masked, 0.0)
            form = self.inner.encode(stand_in.view(x.shape) if self.logical_layout else stand_in, key=key ^ i)
            forms.append((start, end, form))
            parts = form.buffers
            if type(parts) is OneBuffer:
                buffers[f"{i}"] = parts.data
            else:
                buffers.update((f"{i}/{name}", part) for name, part in parts.items())
        # per form: its span, its OneBuffer's layout or its buffers' names, its meta
        meta = {"forms": [(start, end, *((f.buffers.layout, None) if type(f.buffers) is OneBuffer else
                                         (None, tuple(f.buffers))), f.meta) for start, end, f in forms]}
        buffers[_LEAST] = least
        return Packed(self.name, x.shape, x.dtype, x.device, buffers, meta)

    def decode(self, packed: Packed) -> torch.Tensor:
        buffers = packed.buffers
        out = torch.empty(packed.numel, dtype=packed.dtype, device=packed.device)
        for i, (start, end, layout, names, meta) in enumerate(packed.meta["forms"]):
            parts = OneBuffer(buffers[f"{i}"], layout) if layout is not None else \
                {name: buffers[f"{i}/{name}"] for name in names}
            shape = packed.shape if self.logical_layout else torch.Size((end - start,))
            form = Packed(self.inner.name, shape, packed.dtype, packed.device, parts, meta)
            out[start:end] = self.inner.decode(form).reshape(-1)
        mask = self._mask.decode(Packed(_MASK, torch.Size((packed.numel,)), torch.bool, packed.device,
                                        {"bits": buffers[_MASK]}))
        # (a where, not masked_fill: a device scalar as the fill value is read on the host)
        return torch.where(mask, buffers[_LEAST], out, out=out).view(packed.shape)

    def bits_per_element(self, x: torch.Tensor, packed: Packed | None = None) -> float:
        return self.inner.bits_per_element(x) + 1.0
