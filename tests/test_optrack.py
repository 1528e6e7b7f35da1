"""FunctionTracker: which tracked torch function is running in this thread when autograd packs a tensor."""
import threading

import pytest
import torch
import torch.nn.functional as F

from lightning_act import optrack
from lightning_act.codecs import op_rules
from lightning_act.optrack import FunctionTracker

RELU, TENSOR_RELU, LINEAR = torch.relu, torch.Tensor.relu, F.linear  # the originals, taken before any tracker


def _saves(tracker: FunctionTracker, body) -> list:
    """The tracker's current call (function, first argument) at each pack while ``body`` runs under it."""
    seen = []

    def pack(t):
        call = tracker.current
        seen.append(None if call is None else (call.func, call.args[0] if call.args else None))
        return t

    with tracker, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        body()
        assert tracker.current is None  # between tracked calls
    return seen


def test_the_tracker_wraps_its_functions_only_while_it_is_active_even_when_the_body_raises():
    with pytest.raises(RuntimeError, match="forward failed"):
        with FunctionTracker({RELU, TENSOR_RELU, LINEAR}):
            assert torch.relu is not RELU and optrack.original(torch.relu) is RELU
            assert F.linear is not LINEAR and optrack.original(F.linear) is LINEAR
            assert "relu" in vars(torch.Tensor)  # shadows TensorBase's method on the class
            raise RuntimeError("forward failed")
    assert torch.relu is RELU and F.linear is LINEAR and torch.Tensor.relu is TENSOR_RELU
    assert "relu" not in vars(torch.Tensor)


class _Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return 2 * x

    @staticmethod
    def backward(ctx, grad):
        return 2 * grad


def test_a_functions_inherited_apply_is_tracked_on_its_class_and_the_inherited_one_is_back_after():
    """Autograd packs what a Function's forward saved once the forward has returned, inside the ``apply`` it
    inherits (PyTorch's reentrant checkpoint): the tracker sets its wrapper on that class, then deletes it."""
    apply = _Double.apply  # one bound method, held: the tracked function
    x = torch.randn(3, requires_grad=True)
    assert _saves(FunctionTracker({apply}), lambda: _Double.apply(x)) == [(apply, x)]
    assert "apply" not in vars(_Double)
    with pytest.raises(RuntimeError, match="forward failed"):
        with FunctionTracker({apply}):
            assert "apply" in vars(_Double) and optrack.original(_Double.apply) is apply
            raise RuntimeError("forward failed")
    assert "apply" not in vars(_Double) and _Double.apply == apply
    assert torch.equal(_Double.apply(x), 2 * x)


def test_the_outermost_tracked_call_is_reported_with_its_arguments_and_others_are_not():
    x = torch.randn(4, requires_grad=True)
    w = torch.randn(3, 4, requires_grad=True)
    tracker = FunctionTracker({F.relu, RELU, TENSOR_RELU, LINEAR})
    seen = _saves(tracker, lambda: (F.relu(x), x.sigmoid(), x.relu(), F.linear(x, w)))
    # F.relu calls torch.relu inside: one call, F.relu's; sigmoid is not tracked; x.relu() is Tensor.relu's;
    # linear saves its input and weight
    assert seen == [(F.relu, x), None, (TENSOR_RELU, x), (LINEAR, x), (LINEAR, x)]


def test_a_reference_taken_before_the_tracker_runs_untracked():
    """The wrappers replace where code looks a function up; a builtin held since (``act = torch.relu``) is the
    original: its saves get the default codec."""
    x = torch.randn(4, requires_grad=True)
    held = torch.relu
    assert _saves(FunctionTracker({RELU}), lambda: (held(x), torch.relu(x))) == [None, (RELU, x)]


def test_each_thread_sees_only_its_own_tracked_calls_while_both_run():
    both_inside = threading.Barrier(2, timeout=30)
    seen, errors = {}, []

    def run(name: str, tracked: bool) -> None:
        try:
            x = torch.randn(64, requires_grad=True)

            def body():
                both_inside.wait()
                for _ in range(50):
                    torch.relu(x)
                both_inside.wait()

            if tracked:
                seen[name] = _saves(FunctionTracker({RELU}), body)
            else:
                body()
                seen[name] = "untracked ran"
        except Exception as error:  # reported below, not lost in the thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=("tracked", True)),
               threading.Thread(target=run, args=("plain", False))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert len(seen["tracked"]) == 50 and all(call[0] is RELU for call in seen["tracked"])
    assert seen["plain"] == "untracked ran"
    assert torch.relu is RELU  # the last tracker out removed the wrappers


def test_nested_trackers_the_inner_one_tracks_and_the_outer_one_is_back_after_it():
    x = torch.randn(4, requires_grad=True)
    outer = FunctionTracker({RELU})
    with outer:
        inner_seen = _saves(FunctionTracker({RELU}), lambda: torch.relu(x))
        assert torch.relu is not RELU  # still installed for the outer tracker
        outer_seen = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: outer_seen.append(outer.current) or t, lambda t: t):
            torch.relu(x)
    assert inner_seen == [(RELU, x)] and outer_seen[0].func is RELU
    assert torch.relu is RELU


def test_an_attribute_someone_else_replaced_meanwhile_is_left_as_it_is():
    def theirs(t):
        return RELU(t)

    try:
        with FunctionTracker({RELU}):
            torch.relu = theirs
        assert torch.relu is theirs  # not put back over theirs
    finally:
        torch.relu = RELU


def test_a_rule_for_a_function_nobody_looks_up_is_refused():
    with pytest.raises(ValueError, match="is not an attribute of torch.nn.functional, torch, torch.linalg, "
                                         "torch.special, torch.Tensor or its module 'tests.test_optrack'"):
        op_rules.register_op_rule((lambda t: t,), lambda t, call: None)


def test_a_replacement_runs_in_the_calls_place_unless_it_declines():
    """``replacements``: run while the call is current; its result stands, ``NotImplemented`` runs the function."""
    seen = []

    def replacement(func, args, kwargs):
        seen.append((func, tracker.current.func))
        return NotImplemented if args[0].sum() < 0 else "replaced"

    tracker = FunctionTracker({RELU}, {RELU: replacement})
    with tracker:
        replaced = torch.relu(torch.ones(2))
        declined = torch.relu(-torch.ones(2))
    assert replaced == "replaced" and torch.equal(declined, torch.zeros(2))
    assert seen == [(RELU, RELU)] * 2 and tracker.current is None
