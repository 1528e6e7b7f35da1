"""Codecs chosen by the function that saves a tensor (lossless masks for ops whose backward needs little).

A rule maps a torch function (``torch.nn.functional.relu``, ``torch.relu``, ``Tensor.relu_``, ...) to a
callable ``rule(saved_tensor, call) -> Codec | None`` that picks the codec for a tensor saved while that
function runs (``call`` is the :class:`~lightning_act.optrack.FunctionCall` with its arguments), or ``None``
for the default choice. The engine asks the rule of the tracked call (what :func:`codec_for_call` does) while a
``FunctionTracker`` is active. The same storage saved later by another function (the next layer needs its
values) is stored again with that function's codec: the engine's de-duplication key includes the codec name.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Union

import torch

from ..optrack import FunctionCall, original, patch_sites
from .base import Codec


class MinimumBits(NamedTuple):
    """A rule's answer for a tensor whose backward amplifies its error: the codec the engine would pick (the
    configured one, a policy's), at ``bits`` per element or more. Lossless and error-bounded codecs stand as they
    are; a quantizing codec below ``bits`` runs at ``bits``; another lossy codec (division) gives way to quantize at
    ``bits``."""

    bits: int


OpRule = Callable[[torch.Tensor, FunctionCall], Optional[Union[Codec, MinimumBits]]]
OP_RULES: dict[Callable, OpRule] = {}


def register_op_rule(functions: tuple[Callable, ...], rule: OpRule) -> None:
    """Let ``rule`` choose the codec of every tensor saved while one of ``functions`` runs. Each must be an attribute
    of ``torch``, ``torch.nn.functional``, ``torch.Tensor`` or its own module: the tracker wraps it there."""
    functions = tuple(original(fn) for fn in functions)
    for fn in functions:
        if not patch_sites(fn):
            raise ValueError(f"register_op_rule: {fn!r} is not an attribute of torch, torch.nn.functional, "
                             f"torch.Tensor or its module {getattr(fn, '__module__', None)!r}; expected a function "
                             "that code looks up there")
    for fn in functions:
        OP_RULES[fn] = rule


# Functions whose weight (the argument at this position, or ``weight=``) autocast casts for the op: a frozen weight's
# copy has no autograd history, so only the call it is saved in tells it from an activation (engine: cast again).
# The matrix products take it second, often as a view (``x @ w.t()``).
WEIGHT_ARGUMENT: dict[Callable, int] = {
    torch.nn.functional.linear: 1, torch.nn.functional.conv1d: 1, torch.nn.functional.conv2d: 1,
    torch.nn.functional.conv3d: 1, torch.nn.functional.conv_transpose1d: 1, torch.nn.functional.conv_transpose2d: 1,
    torch.nn.functional.conv_transpose3d: 1,
    torch.matmul: 1, torch.Tensor.matmul: 1, torch.Tensor.__matmul__: 1, torch.mm: 1, torch.Tensor.mm: 1,
}


def tracked_functions() -> set[Callable]:
    """The functions a ``FunctionTracker`` records: those with a rule and those with a weight argument."""
    return OP_RULES.keys() | WEIGHT_ARGUMENT.keys()


def codec_for_call(call: FunctionCall | None, t: torch.Tensor) -> Codec | MinimumBits | None:
    if call is None:
        return None
    rule = OP_RULES.get(call.func)
    return rule(t, call) if rule is not None else None


# A log-softmax's backward reads its output through exp: grad - exp(out) * grad.sum(dim). An error d in a saved
# log-probability scales that probability by e^d: at 2 bits a group of log-probabilities spanning [-12, 0] rounds
# by up to 4 (e^4 = 55 times), and a GraphSAGE fell from 0.97 to 0.59 test accuracy (drosophila, 2-bit) on that
# one tensor. At 8 bits the error stays within e^(range / 510): a few percent for the range of a language model's
# vocabulary. cross_entropy saves the same log-probabilities (its log-softmax runs inside the ATen op), and
# logsumexp's backward is grad * exp(input - out): both its saved input and output.
LOG_PROBABILITY_BITS = 8
_LOG_PROBABILITIES = MinimumBits(LOG_PROBABILITY_BITS)


def _log_probabilities_rule(t: torch.Tensor, call: FunctionCall) -> MinimumBits | None:
    return _LOG_PROBABILITIES if t.is_floating_point() else None


register_op_rule((torch.nn.functional.log_softmax, torch.log_softmax, torch.Tensor.log_softmax,
                  torch.nn.functional.cross_entropy, torch.logsumexp, torch.Tensor.logsumexp),
                 _log_probabilities_rule)
