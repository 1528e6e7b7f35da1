"""Which torch function is running when autograd packs a saved tensor.

A saved tensor's ``grad_fn`` cannot tell a ReLU saving its output from the next layer saving the same tensor
as its input; the function being called can. A ``TorchFunctionMode`` sits above autograd, so the pack hook
fires while the mode is inside ``func``: the innermost user-visible function (``F.relu``, ``torch.conv2d``,
``Tensor.relu_``) is the one that saved the tensor. Nested calls made by that function are not seen (the mode
is disabled while it handles a call), which is what we want: ``F.relu`` is reported, not its internals.
"""
from __future__ import annotations

from typing import Any, Callable, Container, NamedTuple

from torch.overrides import TorchFunctionMode


class FunctionCall(NamedTuple):
    """The torch function being executed and the arguments it was called with."""

    func: Callable
    args: tuple
    kwargs: dict


class FunctionTracker(TorchFunctionMode):
    """``current`` is the call being executed of one of ``functions`` (``None`` between such calls). Calls of
    other functions run straight through: the mode costs one Python call per torch call, and recording only
    the calls someone asks about keeps that cheap."""

    def __init__(self, functions: Container[Callable]) -> None:
        super().__init__()
        self.functions = functions
        self.current: FunctionCall | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None) -> Any:
        kwargs = kwargs or {}
        if func not in self.functions:
            return func(*args, **kwargs)
        outer, self.current = self.current, FunctionCall(func, args, kwargs)
        try:
            return func(*args, **kwargs)
        finally:
            self.current = outer
