"""Codecs chosen by the function that saves a tensor: lossless masks for ops whose backward needs little, exact
values or higher precision where a backward compares, divides or exponentiates, and replacements of ops whose
backward can keep less.

A rule maps a torch function (``torch.nn.functional.relu``, ``torch.relu``, ``Tensor.relu_``, ...) to a
callable ``rule(saved_tensor, call) -> Codec | None`` that picks the codec for a tensor saved while that
function runs (``call`` is the :class:`~lightning_act.optrack.FunctionCall` with its arguments), or ``None``
for the default choice. The engine asks the rule of the tracked call (what :func:`codec_for_call` does) while a
``FunctionTracker`` is active. The same storage saved later by another function (the next layer needs its
values) is stored again with that function's codec: the engine's de-duplication key includes the codec name.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional, Union

import torch

from ..optrack import LOOKUP_MODULES, FunctionCall, original, patch_sites
from .base import Codec
from .passthrough import PassthroughCodec


class MinimumBits(NamedTuple):
    """A rule's answer for a tensor whose backward amplifies its error: the codec the engine would pick (the
    configured one, a policy's), at ``bits`` per element or more. Lossless and error-bounded codecs stand as they
    are; a quantizing codec below ``bits`` runs at ``bits``; another lossy codec (division) gives way to quantize at
    ``bits``. ``in_range``: the codec must also keep each value within its group's range (``Codec.keeps_range``),
    so an error-bounded one gives way to quantize too (at ``bits``, or quantize's default for ``bits=0``, which
    asks for no precision, only the flags). ``infinities``: the tensor may hold ``-inf`` (masked
    logits), which the codec must bring back: one that does not (``Codec.keeps_infinities``) runs inside a
    :class:`~lightning_act.codecs.negative_infinity.NegativeInfinityMask`. ``row``: the tensor is rows of this many
    contiguous elements that its backward scales each by its own statistic (a normalisation's input): a quantizing
    codec's groups must not straddle two rows, so each row's rounding is relative to its own range."""

    bits: int
    in_range: bool = False
    infinities: bool = False
    row: int = 0


OpRule = Callable[[torch.Tensor, FunctionCall], Optional[Union[Codec, MinimumBits]]]
OP_RULES: dict[Callable, OpRule] = {}
_LOOKUP = ", ".join(module.__name__ for module in LOOKUP_MODULES)
# The functions of rules that keep a gradient right (not only smaller): tracked even with compress_masks=False
GRADIENT_RULE_FUNCTIONS: set[Callable] = set()
# What a rule answers for a tensor that must come back exactly: stored as it is
KEPT_EXACT = PassthroughCodec()


def register_op_rule(functions: tuple[Callable, ...], rule: OpRule, *, gradient: bool = False) -> None:
    """Let ``rule`` choose the codec of every tensor saved while one of ``functions`` runs. Each must be an attribute
    of ``optrack.LOOKUP_MODULES``, ``torch.Tensor`` or its own module, or a classmethod bound to the class code calls
    it through (an autograd Function's ``apply``): the tracker wraps it there. ``gradient``: the
    rule keeps the gradient right (a lossy value there gives NaN or a far-off gradient), so it applies even where
    ``ACTConfig.compress_masks`` turns the rules that only save memory off."""
    functions = tuple(original(fn) for fn in functions)
    for fn in functions:
        if not patch_sites(fn):
            raise ValueError(f"register_op_rule: {fn!r} is not an attribute of {_LOOKUP}, torch.Tensor or its module "
                             f"{getattr(fn, '__module__', None)!r}; expected a function that code looks up there, or a "
                             "classmethod bound to a class")
    for fn in functions:
        OP_RULES[fn] = rule
        if gradient:
            GRADIENT_RULE_FUNCTIONS.add(fn)


# Functions whose weight (the argument at this position, or ``weight=``) autocast casts for the op: a frozen weight's
# copy has no autograd history, so only the call it is saved in tells it from an activation (engine: cast again).
# The matrix products take it second, often as a view (``x @ w.t()``).
WEIGHT_ARGUMENT: dict[Callable, int] = {
    torch.nn.functional.linear: 1, torch.nn.functional.conv1d: 1, torch.nn.functional.conv2d: 1,
    torch.nn.functional.conv3d: 1, torch.nn.functional.conv_transpose1d: 1, torch.nn.functional.conv_transpose2d: 1,
    torch.nn.functional.conv_transpose3d: 1,
    torch.matmul: 1, torch.Tensor.matmul: 1, torch.Tensor.__matmul__: 1, torch.mm: 1, torch.Tensor.mm: 1,
}


# Calls run differently while the compressor tracks them: ``replacement(func, args, kwargs)`` computes the call's
# result with a backward that saves less, or returns NotImplemented (the call runs as it is, under its rule)
OpReplacement = Callable[[Callable, tuple, dict], object]
OP_REPLACEMENTS: dict[Callable, OpReplacement] = {}


def register_op_replacement(functions: tuple[Callable, ...], replacement: OpReplacement) -> None:
    """Run ``replacement`` in place of each of ``functions`` while a compressor tracks them (always: a replacement
    computes the same result and gradient as the function, with less saved for its backward)."""
    for fn in functions:
        if not patch_sites(original(fn)):
            raise ValueError(f"register_op_replacement: {fn!r} is not an attribute of {_LOOKUP}, torch.Tensor or its "
                             "module; expected a function that code looks up there")
    OP_REPLACEMENTS.update(dict.fromkeys(map(original, functions), replacement))


def tracked_functions(masks: bool = True) -> frozenset[Callable]:
    """The functions a ``FunctionTracker`` records: those with a rule or a replacement and those with a weight
    argument; without ``masks`` (``ACTConfig.compress_masks=False``), only those of the rules that keep gradients
    right and of the replacements."""
    if not masks:
        return frozenset(GRADIENT_RULE_FUNCTIONS | OP_REPLACEMENTS.keys())
    return frozenset(OP_RULES.keys() | WEIGHT_ARGUMENT.keys() | OP_REPLACEMENTS.keys())


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
# Masked logits (-inf: invalid-action masking, constrained vocabularies) reach these functions too: their
# log-probabilities, log-sum-exp and its input hold -inf there, which quantize and division store as NaN (NaN
# gradients at the default L1). Their -inf then cost a 1-bit mask (negative_infinity.py), paid unless the logits
# are a matrix product's output (a language model's head: most of these tensors, and the largest).
_LOG_PROBABILITIES_MASKED = MinimumBits(LOG_PROBABILITY_BITS, infinities=True)
# autograd nodes that move, cast or reshape their input without computing new values, and the products whose
# finite inputs give finite (or overflowed, already NaN-bound) outputs
_SHAPE_ONLY_NODES = frozenset({
    "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "ToCopyBackward0", "CloneBackward0",
    "TransposeBackward0", "TBackward0", "PermuteBackward0", "SliceBackward0", "SelectBackward0", "ExpandBackward0",
    "SqueezeBackward0", "SqueezeBackward1", "SqueezeBackward2", "UnsqueezeBackward0", "AliasBackward0"})
_PRODUCT_NODES = frozenset({"MmBackward0", "AddmmBackward0", "BmmBackward0", "BaddbmmBackward0", "MvBackward0",
                            "ConvolutionBackward0", "LinearBackward0"})


def _product_output(x) -> bool:
    """Whether ``x`` is a matrix product's or a convolution's output, moved, cast or reshaped at most: values
    with no -inf (a mask's) in them. Read from its autograd history only: no device value."""
    fn = getattr(x, "grad_fn", None)
    for _ in range(8):
        if fn is None:
            return False
        name = type(fn).__name__
        if name in _PRODUCT_NODES:
            return True
        if name not in _SHAPE_ONLY_NODES or not fn.next_functions:
            return False
        fn = fn.next_functions[0][0]
    return False


def _log_probabilities_rule(t: torch.Tensor, call: FunctionCall) -> MinimumBits | None:
    if not t.is_floating_point():
        return None
    logits = call.args[0] if call.args else call.kwargs.get("input")
    return _LOG_PROBABILITIES if _product_output(logits) else _LOG_PROBABILITIES_MASKED


register_op_rule((torch.nn.functional.log_softmax, torch.log_softmax, torch.Tensor.log_softmax,
                  torch.nn.functional.cross_entropy, torch.logsumexp, torch.Tensor.logsumexp),
                 _log_probabilities_rule, gradient=True)


# ---- exact values, where a backward compares or divides by them ------------------------------------------------
def _argument(call: FunctionCall, position: int, name: str, default=None):
    return call.args[position] if len(call.args) > position else call.kwargs.get(name, default)


def _variants(*names: str) -> tuple[Callable, ...]:
    """Each function ``name`` as torch, torch.special and torch.Tensor have it, with its in-place forms."""
    found = {}
    for name in names:
        for owner, attribute in ((torch, name), (torch, name + "_"), (torch.special, name),
                                 (torch.Tensor, name), (torch.Tensor, name + "_")):
            fn = getattr(owner, attribute, None)
            if fn is not None:
                found[id(fn)] = fn
    return tuple(found.values())


def _exact_rule(t: torch.Tensor, call: FunctionCall) -> Codec | None:
    return KEPT_EXACT if t.is_floating_point() else None


# Backwards that find a reduction's winners by comparing its saved input with its saved result: amax and amin, the
# max, min and median of a whole tensor, scatter_reduce and index_reduce by amax or amin (a GNN's max or min
# aggregation: torch_geometric's scatter), infinity norms. Rounded apart, no input equals the result any more: the
# gradient is divided by a count of 0 (NaN) or lands nowhere. A product's backward divides the result by each factor
# (scatter_reduce's and index_reduce's "prod" too), which no rounding of a factor near 0 survives.
def _whole_tensor_rule(t: torch.Tensor, call: FunctionCall) -> Codec | None:
    # max(x) and median(x) compare; max(x, dim) saves indices and max(x, y) compares its two inputs with each
    # other (a rounding there moves a tie, it does not lose the gradient)
    if _argument(call, 1, "dim") is None and _argument(call, 1, "other") is None:
        return _exact_rule(t, call)
    return None


_COMPARING_REDUCTIONS = frozenset({"amax", "amin", "prod"})


def _reduce_rule(t: torch.Tensor, call: FunctionCall) -> Codec | None:
    # (self, dim, index, src, reduce): scatter_reduce and index_reduce alike
    return _exact_rule(t, call) if _argument(call, 4, "reduce") in _COMPARING_REDUCTIONS else None


def _infinite_order_rule(name: str) -> OpRule:
    """The rule of a norm whose order is argument 1 or ``name``: exact for an infinity norm."""
    def rule(t: torch.Tensor, call: FunctionCall) -> Codec | None:
        order = _argument(call, 1, name)
        return _exact_rule(t, call) if isinstance(order, (int, float)) and math.isinf(order) else None

    return rule


# Backwards that divide by a saved tensor: sqrt, rsqrt and reciprocal by their result, a division by its divisor, a
# logarithm and a power under 1 by their input. A codec that does not keep a value's sign and range (division's
# residuals, lorenzo's zeros under its bound) turns a small positive value into 0 or a negative: an infinite or
# wrong-signed gradient (log(softmax(x)) under lorenzo or division: NaN). What sqrt, rsqrt, reciprocal and most
# divisions divide by is a statistic (a norm, a standard deviation, a softmax's row sums), far smaller than the
# activations: kept exact. A divisor as large as what it divides (a graph attention's per-edge softmax sums), a
# logarithm's or a root's input go at 8 bits or more in a format that keeps values within their group's range
# (quantize, which the configured codec gives way to where it does not).
IN_RANGE_BITS = 8
_IN_RANGE = MinimumBits(IN_RANGE_BITS, in_range=True)


def _in_range_rule(t: torch.Tensor, call: FunctionCall) -> MinimumBits | None:
    return _IN_RANGE if t.is_floating_point() else None


def _power_rule(t: torch.Tensor, call: FunctionCall) -> MinimumBits | None:
    # d/dx x^p = p x^(p-1): a power under 1 (a root, a negative power) divides by its input; a tensor exponent's
    # gradient takes the log of the base
    exponent = _argument(call, 1, "exponent")
    if torch.is_tensor(exponent) or (isinstance(exponent, (int, float)) and exponent < 1):
        return _in_range_rule(t, call)
    return None


def _divisor_rule(t: torch.Tensor, call: FunctionCall) -> Codec | MinimumBits | None:
    divisor, dividend = _argument(call, 1, "other"), call.args[0] if call.args else None
    if not (torch.is_tensor(divisor) and t.is_floating_point() and t.data_ptr() == divisor.data_ptr() and
            t.shape == divisor.shape and t.stride() == divisor.stride()):
        return None
    if torch.is_tensor(dividend) and divisor.numel() >= dividend.numel() and 0 not in divisor.stride():
        return _IN_RANGE  # (a statistic expanded to the dividend's shape holds only its own elements)
    return KEPT_EXACT


def _normalized_row(call: FunctionCall, source: torch.Tensor) -> int:
    """Elements in each contiguous row a normalisation scales by its own statistic (0: none to align with)."""
    if call.func in _PER_ROW_SHAPE:  # layer_norm, rms_norm: over the trailing normalized_shape
        shape = _argument(call, 1, "normalized_shape")
        return math.prod(shape) if isinstance(shape, (tuple, list, torch.Size)) else int(shape or 0)
    if call.func in _PER_GROUP:  # group_norm: each sample's channel group with its positions
        groups = _argument(call, 1, "num_groups")
        return source.numel() // (source.shape[0] * groups) if isinstance(groups, int) and groups > 0 else 0
    if call.func in _PER_PLANE:  # instance_norm: each sample's channel, its positions
        return math.prod(source.shape[2:])
    # batch_norm: a channel's statistics span the batch, and aligning groups with its planes (a ResNet's 56 x 56)
    # would shrink them (64 elements, statistics 1.2 bits an element at 4 bits) for every convolution block
    return 0


def _normalization_rule(t: torch.Tensor, call: FunctionCall) -> Codec | MinimumBits | None:
    # A normalisation's backward multiplies each row by its saved 1/std, which spans decades across rows (a zero
    # row's is 1/sqrt(eps)): the statistics it saves beside its input (a layer norm's mean and rstd, a batch or
    # group norm's mean and invstd, 1/row-length of the input) are kept exact, one rounding of rstd would scale a
    # whole row's gradient. The input's rounding must be relative to its own row, x_hat = (x - mean) * rstd: in
    # quantize's groups that do not straddle rows (a BEiT's all-zero class-token row in a group with patch rows
    # came back as noise, times 1e6), where a group size tiles the row (its gcd with the configured one)
    source = call.args[0] if call.args else call.kwargs.get("input")
    if not (torch.is_tensor(source) and t.is_floating_point()):
        return None
    if t.numel() < source.numel():
        return KEPT_EXACT
    row = _normalized_row(call, source) if t.is_contiguous() else 0
    return MinimumBits(0, in_range=True, row=row) if row > 0 else None


_PER_ROW_SHAPE = frozenset(map(original, (torch.nn.functional.layer_norm, torch.layer_norm,
                                           torch.nn.functional.rms_norm, torch.rms_norm)))
_PER_GROUP = frozenset(map(original, (torch.nn.functional.group_norm, torch.group_norm)))
_PER_PLANE = frozenset(map(original, (torch.nn.functional.instance_norm, torch.instance_norm)))
register_op_rule(tuple(_PER_ROW_SHAPE | _PER_GROUP | _PER_PLANE) + (torch.nn.functional.batch_norm, torch.batch_norm),
                 _normalization_rule, gradient=True)
register_op_rule(_variants("amax", "amin", "prod", "cumprod", "sqrt", "rsqrt", "reciprocal") +
                 (torch.Tensor.__rtruediv__,), _exact_rule, gradient=True)
register_op_rule(_variants("max", "min", "median", "nanmedian"), _whole_tensor_rule, gradient=True)
register_op_rule(_variants("scatter_reduce", "index_reduce"), _reduce_rule, gradient=True)
register_op_rule((torch.norm, torch.Tensor.norm), _infinite_order_rule("p"), gradient=True)
register_op_rule((torch.linalg.norm, torch.linalg.vector_norm, torch.linalg.matrix_norm), _infinite_order_rule("ord"),
                 gradient=True)

# In range, as a large divisor: what a backward takes a logarithm of (xlogy's y, entr's x; binary cross-entropy divides by p (1 - p)
# of its saved probabilities, kl_div takes the log of its target, poisson_nll_loss without log input divides by
# it, hypot by its result) and for functions whose derivative is singular at the edge of their domain (asin, acos,
# atanh, acosh, logit, log1p, erfinv, lgamma, digamma): a value outside its group's range can be outside the
# domain (acosh under lorenzo: NaN), one inside cannot.
register_op_rule(_variants("log", "log2", "log10", "log1p", "xlogy", "entr", "xlog1py", "hypot", "asin", "acos",
                           "atanh", "acosh", "logit", "erfinv", "lgamma", "digamma") +
                 (torch.nn.functional.binary_cross_entropy, torch.nn.functional.kl_div,
                  torch.nn.functional.poisson_nll_loss), _in_range_rule, gradient=True)
register_op_rule(_variants("pow") + (torch.Tensor.__pow__, torch.Tensor.__ipow__), _power_rule, gradient=True)
register_op_rule(_variants("div", "divide", "true_divide") + (torch.Tensor.__truediv__, torch.Tensor.__itruediv__),
                 _divisor_rule, gradient=True)
