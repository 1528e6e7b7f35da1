"""RowCentric (LR-CNN, seed 004): exactness against the plain stack, errors, memory, planning."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_act.nn as act_nn
from lightning_act.nn import Residual, RowCentric, RowPlan
from lightning_act.profiling import measure_step_memory

# fp32, row-block arithmetic reorders sums in the backward: relative to each tensor's max.
RTOL = 1e-5


def assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=RTOL * expected.abs().max().item())


def vgg_stack() -> nn.Sequential:
    """VGG-style: same/dilated/strided/valid convs, max and average pooling, in-place ReLU."""
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(6, 6, 3, padding=2, dilation=2), nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 8, 3, stride=2), nn.LeakyReLU(0.1),
        nn.Conv2d(8, 8, 4, padding="same"), nn.GELU(),
        nn.AvgPool2d(3, stride=2, padding=1),
    )


def resnet_stack() -> nn.Sequential:
    """ResNet-style: stem, identity block, downsampling block with a 1x1 stride-2 shortcut, eval BN."""
    def bn(c: int) -> nn.BatchNorm2d:
        layer = nn.BatchNorm2d(c)
        nn.init.uniform_(layer.weight, 0.5, 1.5)
        nn.init.uniform_(layer.bias, -0.5, 0.5)
        layer.running_mean.uniform_(-0.5, 0.5)
        layer.running_var.uniform_(0.5, 1.5)
        return layer.eval()

    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), bn(8), nn.ReLU(inplace=True),
        Residual(nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), bn(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), bn(8))),
        nn.ReLU(),
        Residual(nn.Sequential(nn.Conv2d(8, 12, 3, stride=2, padding=1), bn(12), nn.ReLU(), nn.Conv2d(12, 12, 3, padding=1)),
                 nn.Sequential(nn.Conv2d(8, 12, 1, stride=2), bn(12))),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2, padding=1),
    )


def conv1d_stack() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv1d(3, 6, 5, padding=2), nn.SiLU(),
        nn.Conv1d(6, 6, 3, stride=2, dilation=2), nn.ReLU(),
        nn.MaxPool1d(2), nn.Conv1d(6, 4, 3, padding=1),
    )


STACKS = {"vgg": (vgg_stack, (2, 3, 23, 13)), "resnet": (resnet_stack, (2, 3, 21, 11)),
          "conv1d": (conv1d_stack, (2, 3, 41))}


def reference(stack: nn.Module, x: torch.Tensor):
    """Output, a random upstream grad, input grad and parameter grads of the plain stack."""
    x = x.detach().requires_grad_()
    out = stack(x)
    grad = torch.randn_like(out)
    out.backward(grad)
    grads = [p.grad.clone() for p in stack.parameters()]
    stack.zero_grad(set_to_none=True)
    return out.detach(), grad, x.grad, grads


def check_exact(stack: nn.Module, shape: tuple[int, ...], **kwargs) -> None:
    x = torch.randn(shape)
    out_ref, grad, x_grad_ref, param_grads_ref = reference(stack, x)
    wrapped = RowCentric(stack, **kwargs)
    x = x.clone().requires_grad_()
    out = wrapped(x)
    out.backward(grad)
    assert_matches(out, out_ref)
    assert_matches(x.grad, x_grad_ref)
    for param, expected in zip(stack.parameters(), param_grads_ref):
        assert_matches(param.grad, expected)


@pytest.mark.parametrize("groups", [None, 2], ids=["plain", "H"])
@pytest.mark.parametrize("rows", [1, 2, 3, 7, "H"])
@pytest.mark.parametrize("mode", ["overlap", "share"])
@pytest.mark.parametrize("stack_name", sorted(STACKS))
def test_matches_plain_stack(stack_name: str, mode: str, rows: int | str, groups: int | None) -> None:
    torch.manual_seed(0)
    make, shape = STACKS[stack_name]
    rows = shape[2] if rows == "H" else rows  # more rows than output rows: clamped to one row each
    check_exact(make(), shape, rows=rows, mode=mode, checkpoint_groups=groups)


@pytest.mark.parametrize("mode", ["overlap", "share"])
@pytest.mark.parametrize(("rows", "backward_rows"), [(2, 5), (5, 2), (1, 9)])
def test_separate_forward_and_backward_rows(mode: str, rows: int, backward_rows: int) -> None:
    torch.manual_seed(1)
    check_exact(resnet_stack(), (1, 3, 25, 9), rows=rows, backward_rows=backward_rows, mode=mode)


def test_forward_is_bit_identical_for_plain_conv_stack() -> None:
    """Each output element reads the same inputs through the same kernel, so no rounding differs."""
    torch.manual_seed(2)
    stack = vgg_stack()
    x = torch.randn(2, 3, 23, 13)
    with torch.no_grad():
        expected = stack(x)
        for mode in ("overlap", "share"):
            assert torch.equal(RowCentric(stack, rows=3, mode=mode)(x), expected)


@pytest.mark.parametrize("mode", ["overlap", "share"])
def test_frozen_parameters_and_input_without_grad(mode: str) -> None:
    torch.manual_seed(3)
    stack = vgg_stack()
    stack[0].weight.requires_grad_(False)
    x = torch.randn(2, 3, 23, 13)
    out_ref = stack(x)
    grad = torch.randn_like(out_ref)
    out_ref.backward(grad)
    expected = {name: p.grad.clone() for name, p in stack.named_parameters() if p.requires_grad}
    stack.zero_grad(set_to_none=True)

    out = RowCentric(stack, rows=4, mode=mode)(x)
    out.backward(grad)
    assert stack[0].weight.grad is None
    for name, p in stack.named_parameters():
        if p.requires_grad:
            assert_matches(p.grad, expected[name])


def test_in_place_first_activation_leaves_caller_input_untouched() -> None:
    stack = nn.Sequential(nn.ReLU(inplace=True), nn.Conv2d(2, 2, 3, padding=1))
    x = torch.randn(1, 2, 9, 9)
    before = x.clone()
    for mode in ("overlap", "share"):
        RowCentric(stack, rows=3, mode=mode)(x)
        assert torch.equal(x, before)


def test_accepts_list_and_nested_sequential() -> None:
    torch.manual_seed(4)
    layers = [nn.Conv2d(1, 2, 3), nn.Sequential(nn.ReLU(), nn.Sequential(nn.Conv2d(2, 2, 3, padding=1)))]
    x = torch.randn(1, 1, 12, 7)
    expected = nn.Sequential(*layers)(x)
    assert_matches(RowCentric(layers, rows=5, mode="share")(x), expected)


def test_residual_module_is_body_plus_shortcut() -> None:
    body, shortcut = nn.Conv2d(2, 2, 3, padding=1), nn.Conv2d(2, 2, 1)
    x = torch.randn(1, 2, 5, 5)
    assert torch.equal(Residual(body, shortcut)(x), body(x) + shortcut(x))
    assert torch.equal(Residual(body)(x), body(x) + x)


# ---------------------------------------------------------------------------------------------
# User errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"mode": "diag"}, r"mode='diag'; expected one of 'overlap', 'share'"),
    ({"rows": 0}, r"rows=0; expected an integer >= 1"),
    ({"rows": 2.5}, r"rows=2.5; expected an integer >= 1"),
    ({"backward_rows": -1}, r"backward_rows=-1; expected an integer >= 1"),
    ({"checkpoint_groups": 0}, r"checkpoint_groups=0; expected None or an integer between 1 and 6"),
    ({"checkpoint_groups": 7}, r"checkpoint_groups=7; expected None or an integer between 1 and 6"),
])
def test_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RowCentric(vgg_stack(), **kwargs)


@pytest.mark.parametrize(("layer", "error", "match"), [
    (nn.BatchNorm2d(3), ValueError,
     r"BatchNorm2d at index 1 is in training mode; RowCentric needs eval-mode or frozen BatchNorm"),
    (nn.BatchNorm2d(3, track_running_stats=False).eval(), ValueError, r"BatchNorm2d at index 1 is in training mode"),
    (nn.MultiheadAttention(3, 1), TypeError, r"MultiheadAttention at index 1 is not row-separable"),
    (nn.LayerNorm([3, 8, 8]), TypeError, r"LayerNorm at index 1 is not row-separable"),
    (nn.Dropout(0.1), TypeError, r"Dropout at index 1 is not row-separable"),
    (nn.AdaptiveAvgPool2d(1), TypeError, r"AdaptiveAvgPool2d at index 1 is not row-separable"),
    (nn.Conv2d(3, 3, 3, padding=1, padding_mode="reflect"), ValueError, r"Conv2d at index 1 uses padding_mode='reflect'"),
    (nn.MaxPool2d(2, ceil_mode=True), ValueError, r"MaxPool2d at index 1 uses ceil_mode=True"),
    (nn.AvgPool2d(3, padding=1, count_include_pad=False), ValueError, r"AvgPool2d at index 1 uses padding with count_include_pad=False"),
    (nn.Conv2d(3, 3, 1, padding=1), ValueError, r"Conv2d at index 1: row padding \(1, 1\) is not smaller than the kernel's extent 1"),
])
def test_unsupported_layers_fail_at_wrap_time(layer: nn.Module, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        RowCentric([nn.Conv2d(3, 3, 3), layer])


def test_unsupported_layer_inside_residual_is_named_by_path() -> None:
    block = Residual(nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.BatchNorm2d(3)))
    with pytest.raises(ValueError, match=r"BatchNorm2d at index 0.body.1 is in training mode"):
        RowCentric([block])


def test_batch_norm_stays_frozen_and_is_rechecked_at_forward() -> None:
    wrapped = RowCentric(resnet_stack(), rows=2)
    wrapped.train()
    assert wrapped.training and not wrapped.stack[1].training
    wrapped.stack[1].train()  # switched behind the wrapper's back
    with pytest.raises(ValueError, match=r"BatchNorm2d at index 1 is in training mode"):
        wrapped(torch.randn(1, 3, 9, 9))


def test_input_rank_and_mixed_dims() -> None:
    with pytest.raises(ValueError, match=r"input of shape \(1, 3, 9\); expected 4 dims"):
        RowCentric(vgg_stack())(torch.randn(1, 3, 9))
    with pytest.raises(ValueError, match=r"mixes 1-d and 2-d"):
        RowCentric([nn.Conv1d(1, 1, 3), nn.Conv2d(1, 1, 3)])


def test_residual_branches_with_different_heights() -> None:
    block = Residual(nn.Conv2d(2, 2, 3), nn.Identity())
    with pytest.raises(ValueError, match=r"Residual at index 0: body gives 7 rows but shortcut gives 9"):
        RowCentric([block])(torch.randn(1, 2, 9, 9))


# ---------------------------------------------------------------------------------------------
# Memory and composition with saved-tensor hooks
# ---------------------------------------------------------------------------------------------


def peak_bytes(step) -> int:
    """Peak of CPU bytes allocated during ``step()`` above the level at its start (profiler events)."""
    return measure_step_memory(step).peak_bytes


@pytest.mark.parametrize("mode", ["overlap", "share"])
def test_measured_peak_drops_with_rows(mode: str) -> None:
    torch.manual_seed(5)
    # Deep enough that the plain stack's saved activations dominate the step's memory.
    stack = nn.Sequential(*[m for _ in range(8) for m in (nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())])
    x = torch.randn(1, 8, 64, 64)

    def step(model: nn.Module) -> None:
        model(x).sum().backward()

    plain = peak_bytes(lambda: step(stack))
    two = peak_bytes(lambda: step(RowCentric(stack, rows=2, mode=mode)))
    eight = peak_bytes(lambda: step(RowCentric(stack, rows=8, mode=mode)))
    assert eight < two and eight < plain


class CountingHooks(torch.autograd.graph.saved_tensors_hooks):
    def __init__(self) -> None:
        self.packed_heights: list[int] = []
        self.unpacked = 0

        def pack(tensor: torch.Tensor):
            self.packed_heights.append(tensor.shape[2] if tensor.dim() == 4 else -1)
            return tensor.clone()

        def unpack(tensor: torch.Tensor) -> torch.Tensor:
            self.unpacked += 1
            return tensor

        super().__init__(pack, unpack)


@pytest.mark.parametrize("mode", ["overlap", "share"])
def test_saved_tensors_go_through_surrounding_hooks(mode: str) -> None:
    torch.manual_seed(6)
    stack = vgg_stack()
    shape = (1, 3, 96, 9)
    x = torch.randn(shape)
    out_ref, grad, x_grad_ref, _ = reference(stack, x)
    hooks = CountingHooks()
    x = x.clone().requires_grad_()
    with hooks:
        out = RowCentric(stack, rows=4, mode=mode)(x)
        forward_packs = len(hooks.packed_heights)
        out.backward(grad)
    assert forward_packs >= 1 and 96 in hooks.packed_heights[:forward_packs]  # the kept input
    recomputed = hooks.packed_heights[forward_packs:]
    assert len(recomputed) > 4 * 5 and max(recomputed) < 96  # every block's tensors, never full height
    assert hooks.unpacked == len(hooks.packed_heights)
    assert_matches(out, out_ref)
    assert_matches(x.grad, x_grad_ref)


def test_composes_with_save_on_cpu() -> None:
    torch.manual_seed(7)
    stack = resnet_stack()
    x = torch.randn(1, 3, 21, 11)
    out_ref, grad, x_grad_ref, params_ref = reference(stack, x)
    x = x.clone().requires_grad_()
    with torch.autograd.graph.save_on_cpu():
        RowCentric(stack, rows=3, mode="share", checkpoint_groups=2)(x).backward(grad)
    assert_matches(x.grad, x_grad_ref)
    for p, expected in zip(stack.parameters(), params_ref):
        assert_matches(p.grad, expected)


# ---------------------------------------------------------------------------------------------
# Planning
# ---------------------------------------------------------------------------------------------

PLAN_SHAPE = (2, 3, 64, 32)


def test_plan_estimate_falls_with_rows_and_stays_below_plain() -> None:
    peaks = [RowCentric.plan(vgg_stack(), PLAN_SHAPE, rows=r).backward_peak_bytes for r in (1, 2, 4, 8)]
    assert peaks == sorted(peaks, reverse=True) and peaks[0] > peaks[-1]
    plan = RowCentric.plan(vgg_stack(), PLAN_SHAPE, rows=8)
    assert plan.peak_bytes < plan.plain_peak_bytes


@pytest.mark.parametrize("mode", ["overlap", "share"])
def test_plan_picks_smallest_rows_that_fit_budget(mode: str) -> None:
    stack = vgg_stack()
    reference_plan = RowCentric.plan(stack, PLAN_SHAPE, rows=4, mode=mode)
    budget = reference_plan.backward_peak_bytes
    plan = RowCentric.plan(stack, PLAN_SHAPE, budget_bytes=budget, mode=mode)
    assert isinstance(plan, RowPlan)
    assert plan.peak_bytes <= budget
    assert 1 <= plan.forward_rows <= plan.backward_rows <= 4
    if plan.backward_rows > 1:
        fewer = RowCentric.plan(stack, PLAN_SHAPE, rows=plan.backward_rows - 1, mode=mode)
        assert fewer.backward_peak_bytes > budget
    text = str(plan)
    assert f"forward_rows={plan.forward_rows}" in text and f"backward_rows={plan.backward_rows}" in text

    torch.manual_seed(8)
    wrapped = RowCentric.from_plan(stack, plan)
    assert (wrapped.forward_rows, wrapped.backward_rows, wrapped.mode) == (plan.forward_rows, plan.backward_rows, mode)
    x = torch.randn(PLAN_SHAPE)
    with torch.no_grad():
        assert_matches(wrapped(x), stack(x))


def test_plan_errors() -> None:
    with pytest.raises(ValueError, match=r"budget_bytes=1000; the smallest estimated peak .* is \d+ bytes"):
        RowCentric.plan(vgg_stack(), PLAN_SHAPE, budget_bytes=1000)
    with pytest.raises(ValueError, match=r"budget_bytes=None, rows=None; expected exactly one of them"):
        RowCentric.plan(vgg_stack(), PLAN_SHAPE)
    with pytest.raises(ValueError, match=r"budget_bytes=-5; expected a positive integer"):
        RowCentric.plan(vgg_stack(), PLAN_SHAPE, budget_bytes=-5)


# ---- wrap_conv_trunks: the converter for whole models ----

def vgg16(width: int = 4, classes: int = 10) -> nn.Module:
    """VGG-16's layout (13 convs in 5 stages, max pools, 3 linear layers) at 1/``width`` of its channels."""
    layers, c_in = [], 3
    for item in (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"):
        if item == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(c_in, item // width, 3, padding=1), nn.ReLU(inplace=True)]
            c_in = item // width
    model = nn.Module()
    model.features = nn.Sequential(*layers)
    model.classifier = nn.Sequential(nn.Flatten(), nn.Linear(c_in * 2 * 2, 64), nn.ReLU(), nn.Linear(64, classes))
    model.forward = lambda x: model.classifier(model.features(x))
    return model


@pytest.mark.parametrize("mode", ["overlap", "share"])
def test_wrap_conv_trunks_converts_a_vgg16_exactly(mode):
    torch.manual_seed(0)
    model = vgg16()
    params = list(model.parameters())
    x = torch.randn(2, 3, 64, 64)
    out_ref, grad, x_grad_ref, grads_ref = reference(model, x)
    assert RowCentric.__name__ not in repr(model)
    assert act_nn.wrap_conv_trunks(model, rows=3, mode=mode) == ["features[0:31]"]
    assert isinstance(model.features[0], RowCentric) and len(model.features) == 1
    assert isinstance(model.classifier[1], nn.Linear)  # the head is left alone
    assert all(a is b for a, b in zip(params, model.parameters()))
    x = x.clone().requires_grad_()
    out = model(x)
    out.backward(grad)
    assert_matches(out, out_ref)
    assert_matches(x.grad, x_grad_ref)
    for param, expected in zip(model.parameters(), grads_ref):
        assert_matches(param.grad, expected)


def test_wrap_conv_trunks_stops_at_train_mode_batch_norm_and_small_runs():
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1),  # wrapped: 2 convs
        nn.BatchNorm2d(4),                                                       # training mode: not row-separable
        nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(),                                # 1 conv: left alone
        nn.Flatten(),
        nn.Sequential(nn.Unflatten(1, (4, 8, 8)), nn.Conv2d(4, 4, 3), nn.MaxPool2d(2)),  # nested run
    )
    assert act_nn.wrap_conv_trunks(model, rows=2) == ["Sequential[0:3]", "7[1:3]"]
    assert [type(m).__name__ for m in model] == ["RowCentric", "BatchNorm2d", "Conv2d", "ReLU", "Flatten",
                                                 "Sequential"]
    assert isinstance(model[5][1], RowCentric)
    assert model(torch.randn(1, 3, 8, 8)).shape == (1, 4, 3, 3)
    model[1].eval()  # an eval-mode BatchNorm joins the run when converting again
    assert act_nn.wrap_conv_trunks(model, rows=2, min_windows=1) == ["Sequential[1:4]"]
    with pytest.raises(ValueError, match="min_windows=0; expected an integer >= 1"):
        act_nn.wrap_conv_trunks(model, min_windows=0)
