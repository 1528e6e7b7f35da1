"""Scatter max/min under a compressor (``lightning_act.codecs.winner_masks``): the same result and, bit for bit,
the same gradient as torch's, from 1-bit winner masks instead of exact float copies of the gathered values."""
import pytest
import torch
from torch import nn

import lightning_act as act
from lightning_act.codecs import op_rules
from lightning_act.codecs.winner_masks import ScatterWinners

EDGES, NODES, FEATURES = 600, 40, 24


def _index(edges: int = EDGES) -> torch.Tensor:
    torch.manual_seed(3)
    return torch.randint(0, NODES, (edges,))[:, None].expand(-1, FEATURES)  # a stride-0 view, as PyG broadcasts


CALLS = {
    "Tensor.scatter_reduce_": lambda target, index, src, reduce, include_self: target.scatter_reduce_(
        0, index, src, reduce, include_self=include_self),
    "Tensor.scatter_reduce": lambda target, index, src, reduce, include_self: target.scatter_reduce(
        0, index, src, reduce=reduce, include_self=include_self),
    "torch.scatter_reduce": lambda target, index, src, reduce, include_self: torch.scatter_reduce(
        target, 0, index, src, reduce, include_self=include_self),
}


def _run(call, reduce, include_self, dtype, *, ties=False, target_grad=False, config=None, edges=EDGES):
    """Forward and gradients (of src, and of the target when it requires grad) of one scatter, under ``config``
    (uncompressed when None); returns ``(result, grads, compressor)``."""
    torch.manual_seed(0)
    source = torch.randn(edges, FEATURES, dtype=dtype)
    weights = torch.randn(NODES, FEATURES, dtype=dtype)
    leaf = source.clone().requires_grad_()
    target_leaf = torch.randn(NODES, FEATURES, dtype=dtype).requires_grad_(target_grad)
    compressor = act.ActivationCompressor(None, config) if config is not None else None
    with compressor.compress() if compressor is not None else torch.enable_grad():
        src = leaf.relu() if ties else leaf * 1  # ReLU: many zeros, so ties with the zero target
        target = target_leaf * 0 if target_grad else torch.zeros(NODES, FEATURES, dtype=dtype)
        result = CALLS[call](target, _index(edges), src, reduce, include_self)
    (result * weights).sum().backward()
    grads = [leaf.grad] + ([target_leaf.grad] if target_grad else [])
    return result.detach(), grads, compressor


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("include_self", [False, True])
@pytest.mark.parametrize("reduce", ["amax", "amin"])
@pytest.mark.parametrize("call", list(CALLS))
def test_same_result_and_gradient_bit_for_bit_from_one_bit_masks(call, reduce, include_self, dtype):
    expected, expected_grads, _ = _run(call, reduce, include_self, dtype, ties=True)
    got, grads, compressor = _run(call, reduce, include_self, dtype, ties=True,
                                  config=act.ACTConfig(bits=2, adaptive=False, min_numel=0))
    assert torch.equal(got, expected)
    for g, e in zip(grads, expected_grads):
        assert torch.equal(g, e)
    records = [r for r in compressor.stats().records if r.kind != "parameter"]
    masks = sorted(tuple(r.shape) for r in records if r.dtype == torch.bool)
    assert masks == [(NODES, FEATURES), (EDGES, FEATURES)] and all(
        r.codec == "bitmask" for r in records if r.dtype == torch.bool)
    # no float copy of the messages or the result for the scatter: only the ReLU's own 1-bit mask
    assert all(r.codec == "positive_mask" for r in records if r.dtype.is_floating_point)


def test_a_target_that_requires_grad_gets_torchs_gradient_too():
    expected, expected_grads, _ = _run("Tensor.scatter_reduce", "amax", True, torch.float32, target_grad=True)
    got, grads, _ = _run("Tensor.scatter_reduce", "amax", True, torch.float32, target_grad=True,
                         config=act.ACTConfig(min_numel=0))
    assert torch.equal(got, expected) and len(grads) == 2
    assert all(torch.equal(g, e) for g, e in zip(grads, expected_grads))


def test_without_mask_compression_the_masks_are_kept_as_bools():
    expected, (expected_grad,), _ = _run("Tensor.scatter_reduce_", "amax", False, torch.float32)
    _, (grad,), compressor = _run("Tensor.scatter_reduce_", "amax", False, torch.float32,
                                  config=act.ACTConfig(min_numel=0, compress_masks=False))
    assert torch.equal(grad, expected_grad)
    kept = [r for r in compressor.stats().records if r.dtype == torch.bool]
    assert len(kept) == 2 and all(r.reason == "mask compression off" for r in kept)


def test_an_empty_scatter():
    expected, (expected_grad,), _ = _run("torch.scatter_reduce", "amax", False, torch.float32, edges=0)
    got, (grad,), _ = _run("torch.scatter_reduce", "amax", False, torch.float32, edges=0,
                           config=act.ACTConfig(min_numel=0))
    assert torch.equal(got, expected) and grad.shape == (0, FEATURES) and torch.equal(grad, expected_grad)


def _grad_fn_under_compressor(body):
    compressor = act.ActivationCompressor(None, act.ACTConfig(min_numel=0))
    with compressor.compress():
        return type(body().grad_fn).__name__


@pytest.mark.parametrize("body, replaced", [
    # a sum saves no values: torch's own op
    (lambda: torch.zeros(4, 3).scatter_reduce(0, torch.zeros(5, 3, dtype=torch.long),
                                              torch.randn(5, 3, requires_grad=True), "sum"), False),
    # nothing to differentiate
    (lambda: torch.zeros(4, 3).scatter_reduce(0, torch.zeros(5, 3, dtype=torch.long), torch.randn(5, 3), "amax")
     .requires_grad_(), False),
    # in place into a view: as torch runs it (its values kept exact by the rule)
    (lambda: torch.zeros(8, 3)[:4].scatter_reduce_(0, torch.zeros(5, 3, dtype=torch.long),
                                                   torch.randn(5, 3, requires_grad=True), "amax"), False),
    (lambda: torch.zeros(4, 3).scatter_reduce(0, torch.zeros(5, 3, dtype=torch.long),
                                              torch.randn(5, 3, requires_grad=True), "amax"), True),
    # a tensor subclass dispatches the call its own way
    (lambda: torch.zeros(4, 3).scatter_reduce(0, torch.zeros(5, 3, dtype=torch.long),
                                              nn.Parameter(torch.randn(5, 3)), "amax"), False),
], ids=["sum", "no grad", "view in place", "amax", "subclass"])
def test_which_calls_are_replaced(body, replaced):
    assert (_grad_fn_under_compressor(body) == "ScatterWinnersBackward") == replaced


def test_in_place_it_writes_into_its_target():
    """``target.scatter_reduce_(...)`` returns ``target``, which now holds the result (and carries its gradient)."""
    src = torch.randn(5, 3, requires_grad=True)
    target = torch.zeros(4, 3)
    compressor = act.ActivationCompressor(None, act.ACTConfig(min_numel=0))
    with compressor.compress():
        out = target.scatter_reduce_(0, torch.zeros(5, 3, dtype=torch.long), src * 1, "amax", include_self=False)
    assert out is target and type(target.grad_fn).__name__ == "ScatterWinnersBackward"
    torch.testing.assert_close(target[0], src.detach().amax(0), rtol=0, atol=0)
    assert not target[1:].any()
    target.sum().backward()
    assert torch.equal(src.grad, (src.detach() == src.detach().amax(0)).float())


def test_a_leaf_that_requires_grad_is_refused_in_place_as_torch_refuses_it():
    leaf = torch.zeros(4, 3, requires_grad=True)
    compressor = act.ActivationCompressor(None, act.ACTConfig(min_numel=0))
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"), compressor.compress():
        leaf.scatter_reduce_(0, torch.zeros(5, 3, dtype=torch.long), torch.randn(5, 3, requires_grad=True), "amax")


def test_outside_a_compressor_torch_runs_its_own_op():
    out = torch.zeros(4, 3).scatter_reduce(0, torch.zeros(5, 3, dtype=torch.long),
                                           torch.randn(5, 3, requires_grad=True), "amax")
    assert type(out.grad_fn).__name__ == "ScatterReduceBackward0"
    assert torch.scatter_reduce in op_rules.OP_REPLACEMENTS and ScatterWinners.__name__ == "ScatterWinners"


def test_a_double_backward_through_it_matches_torchs():
    """A gradient penalty through a scatter max: the first gradient is linear in the incoming one, and both
    orders of derivative come out as torch's."""
    def second_order(config):
        torch.manual_seed(0)
        src = torch.randn(EDGES, FEATURES).requires_grad_()
        weights = torch.randn(NODES, FEATURES).requires_grad_()
        compressor = act.ActivationCompressor(None, config) if config is not None else None
        with compressor.compress() if compressor is not None else torch.enable_grad():
            out = torch.zeros(NODES, FEATURES).scatter_reduce(0, _index(), src * 1, "amax", include_self=False)
        # (the backwards outside the compressor: what they save for the second one is not compressed)
        first, = torch.autograd.grad((out * weights).sum(), src, create_graph=True)
        first.square().sum().backward()
        return first.detach(), weights.grad

    expected = second_order(None)
    got = second_order(act.ACTConfig(min_numel=0))
    assert expected[1].abs().sum() > 0
    assert all(torch.equal(g, e) for g, e in zip(got, expected))


def test_a_call_torch_refuses_is_refused_by_torch():
    """A call missing ``reduce`` reaches torch, whose TypeError names it (not a KeyError from the replacement)."""
    compressor = act.ActivationCompressor(None, act.ACTConfig(min_numel=0))
    with pytest.raises(TypeError, match="reduce"), compressor.compress():
        torch.zeros(4, 3).scatter_reduce(0, torch.zeros(5, 3, dtype=torch.long), torch.randn(5, 3, requires_grad=True),
                                         include_self=False)
