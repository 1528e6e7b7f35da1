"""ReLU followed by dropout, with a backward that holds two tensors of the input's size.

``nn.Sequential(nn.ReLU(), nn.Dropout(p))`` saves the ReLU output and the dropout noise (CPU: float noise, the
input's size), and its backward runs two ops: dropout's (gradient in, decoded noise, gradient out) then ReLU's
(gradient in, decoded output, gradient out), three tensors of the input's size at a time. Both derivatives are
one mask, ``keep = (x > 0) & kept-by-dropout``, times ``1 / (1 - p)``. :class:`ReLUDropout` computes the output
per row chunk and saves ``keep`` bit-packed per row chunk (1 bit per element, compressed or not: packing it here
rather than leaving bool masks to the compressor keeps a byte per element from piling up until the forward
returns); its backward writes the gradient chunk by chunk into one tensor, holding the incoming and the outgoing
gradient plus one chunk of the mask. Dropout draws its own uniform noise (``torch.rand``), so its masks are not
the ones ``nn.Dropout`` would draw from the same seed.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..formats._bitpack import pack_bits, unpack_bits
from ._chunks import DEFAULT_CHUNK_BYTES, SavedEntries, chunk_rows, row_bounds

__all__ = ["ReLUDropout", "relu_dropout"]


class _ReLUDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p, rows):
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        scale = 1.0 / (1.0 - p)
        masks, zero = [], x.new_zeros(())
        for chunk, target in zip(x.split(rows), out.split(rows)):
            keep = chunk > 0
            if p > 0:
                keep &= torch.rand(chunk.shape, dtype=chunk.dtype, device=chunk.device) >= p
            torch.where(keep, chunk, zero, out=target)
            if p > 0:
                target.mul_(scale)
            masks.append(pack_bits(keep.reshape(-1)))
        ctx.scale, ctx.bounds, ctx.row_shape = scale, row_bounds(x.shape[0], rows), x.shape[1:]
        ctx.save_for_backward(*masks)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        grad = torch.empty_like(grad_out, memory_format=torch.contiguous_format)
        zero, saved = grad_out.new_zeros(()), SavedEntries(ctx)
        for i, (start, stop) in enumerate(ctx.bounds):
            keep = unpack_bits(saved[i], (stop - start) * math.prod(ctx.row_shape)).view(stop - start, *ctx.row_shape)
            target = torch.where(keep, grad_out[start:stop], zero, out=grad[start:stop])
            if ctx.scale != 1.0:
                target.mul_(ctx.scale)
        return grad, None, None


def _check_p(p) -> None:
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
        raise ValueError(f"p={p!r}; expected a probability in [0, 1)")


def relu_dropout(x: torch.Tensor, p: float, training: bool = True,
                 chunk_bytes: int | str = DEFAULT_CHUNK_BYTES) -> torch.Tensor:
    """``dropout(relu(x), p)`` (module docstring); chunks of ``chunk_bytes`` along dim 0. In eval mode, or with
    ``p == 0``, ``relu(x)``."""
    _check_p(p)
    p = float(p) if training else 0.0
    if x.dim() == 0:
        return torch.relu(x) if p == 0 else nn.functional.dropout(torch.relu(x), p)
    rows = chunk_rows(chunk_bytes, x[0].numel() * x.element_size(), x.shape[0], x.device)
    return _ReLUDropout.apply(x, p, rows)


class ReLUDropout(nn.Module):
    """Drop-in for ``nn.Sequential(nn.ReLU(), nn.Dropout(p))`` whose backward holds two tensors of the input's
    size instead of three (module docstring). ``chunk_bytes``: bytes of one row chunk, int, ``"4MiB"``, or the
    default ``"auto"`` (4 MiB, at most 8 chunks off CPU)."""

    def __init__(self, p: float = 0.5, chunk_bytes: int | str = DEFAULT_CHUNK_BYTES):
        super().__init__()
        chunk_rows(chunk_bytes, 1)
        _check_p(p)
        self.p, self.chunk_bytes = p, chunk_bytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return relu_dropout(x, self.p, self.training, self.chunk_bytes)

    def extra_repr(self) -> str:
        return f"p={self.p}, chunk_bytes={self.chunk_bytes}"
