"""Which torch function is running when autograd packs a saved tensor.

A saved tensor's ``grad_fn`` cannot tell a ReLU saving its output from the next layer saving the same tensor
as its input; the function being called can. A ``TorchFunctionMode`` sits above autograd, so the pack hook
fires while the mode is inside ``func``: the innermost user-visible function (``F.relu``, ``torch.conv2d``,
``Tensor.relu_``) is the one that saved the tensor. Nested calls made by that function are not seen (the mode
is disabled while it handles a call), which is what we want: ``F.relu`` is reported, not its internals.
"""
from __future__ import annotations

from typing import Any, Callable

from torch.overrides import TorchFunctionMode


class FunctionTracker(TorchFunctionMode):
    """``current`` is the torch function being executed (``None`` between calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.current: Callable | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None) -> Any:
        outer, self.current = self.current, func
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.current = outer
