"""Scatter max and min whose backward keeps 1-bit winner masks instead of values.

``scatter_reduce(target, dim, index, src, "amax" | "amin")`` (torch_geometric's max and min aggregations) saves
``target``, ``src`` and its result, and its backward (torch's) finds each output's winners by comparing them,
splitting the gradient evenly among ties. Only that equality pattern matters, never a value; rounded values break
it (NaN gradients), so the op rules would keep these floats exact: a max aggregation's gathered messages, one per
edge and feature. While a compressor tracks the call, :func:`scatter_winners` runs it as :class:`ScatterWinners`
instead: the same forward, and for its backward the two patterns (``target == result``, ``src == result[index]``),
bool tensors the engine stores at 1 bit. Its backward gives torch's backward stand-ins with the same pattern (0
where a value won, -inf for amax or +inf for amin elsewhere): the same gradient, bit for bit, wherever the result
holds no NaN.
"""
from __future__ import annotations

import math

import torch

from ..optrack import original
from . import op_rules

_FILL = {"amax": -math.inf, "amin": math.inf}
_ARGUMENTS = ("input", "dim", "index", "src", "reduce")
_aten_scatter_reduce = torch.ops.aten.scatter_reduce.two  # the ATen op: past the tracker's Python wrappers
_IN_PLACE = original(torch.Tensor.scatter_reduce_)  # (while a tracker runs, the attribute is its wrapper)


class ScatterWinners(torch.autograd.Function):
    """``scatter_reduce`` by ``"amax"`` or ``"amin"`` (in place into ``target`` with ``inplace``), saving the
    winner patterns for backward."""

    @staticmethod
    def forward(ctx, target, src, dim, index, reduce, include_self, inplace):
        result = _aten_scatter_reduce(target, dim, index, src, reduce, include_self=include_self)
        target_won = target == result
        src_won = src == result.gather(dim, index)
        ctx.save_for_backward(target_won, src_won, index)
        ctx.dim, ctx.reduce, ctx.include_self, ctx.dtype = dim, reduce, include_self, result.dtype
        if inplace:
            ctx.mark_dirty(target)
            return target.copy_(result)
        return result

    @staticmethod
    def backward(ctx, grad):
        target_won, src_won, index = ctx.saved_tensors
        create_graph = torch.is_grad_enabled()  # a double backward (a gradient penalty): torch's formula is linear
        fill = _FILL[ctx.reduce]
        target = torch.full(target_won.shape, fill, dtype=ctx.dtype, device=grad.device).masked_fill_(target_won, 0)
        src = torch.full(src_won.shape, fill, dtype=ctx.dtype, device=grad.device).masked_fill_(src_won, 0)
        with torch.enable_grad():
            target.requires_grad_(ctx.needs_input_grad[0])
            src.requires_grad_(ctx.needs_input_grad[1])
            result = _aten_scatter_reduce(target, ctx.dim, index, src, ctx.reduce, include_self=ctx.include_self)
            wanted = [t for t in (target, src) if t.requires_grad]
            grads = iter(torch.autograd.grad(result, wanted, grad, create_graph=create_graph))
        return (next(grads) if target.requires_grad else None, next(grads) if src.requires_grad else None,
                None, None, None, None, None)


def _bound(args: tuple, kwargs: dict) -> dict | None:
    """The call's arguments by name (``self`` read as ``input``), or None for a form this does not handle."""
    values = dict(zip(_ARGUMENTS, args))
    for name, value in kwargs.items():
        name = "input" if name == "self" else name
        if name in values or name not in (*_ARGUMENTS, "include_self"):
            return None  # out=, or a name given twice
        values[name] = value
    return values if all(name in values for name in _ARGUMENTS) else None  # (torch says what is missing)


def scatter_winners(func, args: tuple, kwargs: dict):
    """The op replacement (:func:`~lightning_act.codecs.op_rules.register_op_replacement`) of ``scatter_reduce``
    and ``scatter_reduce_``: :class:`ScatterWinners` for an amax or amin reduction of dense float tensors that
    autograd records, else ``NotImplemented``."""
    values = _bound(args, kwargs)
    if values is None or values["reduce"] not in _FILL or not torch.is_grad_enabled():
        return NotImplemented
    target, index, src, dim = values["input"], values["index"], values["src"], values["dim"]
    # (plain tensors: a subclass, DTensor's, dispatches the call its own way)
    if not (type(target) is torch.Tensor and type(src) is torch.Tensor and type(index) is torch.Tensor
            and isinstance(dim, int) and (target.requires_grad or src.requires_grad)
            and target.dtype == src.dtype and target.is_floating_point() and index.dtype == torch.int64
            and target.layout == src.layout == index.layout == torch.strided):
        return NotImplemented
    inplace = func is _IN_PLACE
    if inplace and (target.requires_grad and target.is_leaf or target._base is not None):
        return NotImplemented  # a leaf that requires grad, or a view: as torch handles them
    return ScatterWinners.apply(target, src, dim, index, values["reduce"], bool(values.get("include_self", True)),
                                inplace)


op_rules.register_op_replacement((torch.scatter_reduce, torch.Tensor.scatter_reduce, torch.Tensor.scatter_reduce_),
                                 scatter_winners)
