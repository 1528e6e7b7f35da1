"""Autocast's parameter copies under the compressor (engine._ParameterCast): a saved bf16 cast of a weight (or a
view of one, as Linear saves ``weight.t()``) is not held; the backward casts the parameter again. Gradients are
bit for bit those of the same model without the compressor (a weight read by two ops: cast for each, so its two
gradients meet in float32 rather than bf16), autocast's cache no longer keeps every layer's copy through the
forward, and a parameter changed in place before the backward raises as in float32."""
import copy

import pytest
import torch
from torch import nn

import lightning_act as act
from lightning_act.profiling import measure_step_memory

MiB = 2**20


def _model(layout=torch.contiguous_format, tied=False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 64),
                          nn.GELU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    if tied:  # one weight read by two ops: autocast would cast it once, here twice, the same bits
        model[7].weight = model[5].weight
    return model.to(memory_format=layout)


def _compressor(model, **kw):
    # every activation kept as it is (min_numel above any): only the parameters' handling differs from plain
    return act.ActivationCompressor(model, act.ACTConfig(bits=4, adaptive=False, min_numel=1 << 30, **kw))


def _forward_peaks(model, x) -> dict[bool, int]:
    """The forward's peak under bf16 autocast without (False) and with (True) the compressor."""
    peaks = {}
    for compressed in (False, True):
        compressor = _compressor(model) if compressed else None

        def forward():
            with torch.autocast("cpu", dtype=torch.bfloat16), \
                    (compressor.compress() if compressor else torch.enable_grad()):
                return model(x)

        forward()
        peaks[compressed] = measure_step_memory(forward).peak_bytes
    return peaks


def _grads(model, x, compressor=None):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), (compressor.compress() if compressor else torch.enable_grad()):
        out = model(x)
    out.float().square().sum().backward()
    return out, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("tied", [False, True])
def test_gradients_are_those_of_the_model_without_the_compressor(layout, tied):
    memory_format = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    model = _model(memory_format, tied)
    x = torch.randn(5, 3, 6, 6).to(memory_format=memory_format)
    out_ref, grads_ref = _grads(copy.deepcopy(model), x)
    compressor = _compressor(model)
    out, grads = _grads(model, x, compressor)
    assert torch.equal(out, out_ref)
    for g, g_ref in zip(grads, grads_ref):
        assert g.dtype == torch.float32
        if tied:  # summed in float32 here, in bf16 through autocast's one copy: within bf16's rounding
            assert (g - g_ref).abs().max() <= 2**-7 * g_ref.abs().max()
        else:
            assert torch.equal(g, g_ref)
    records = compressor.stats().records
    assert sum(r.kind == "parameter" for r in records) >= 4  # the conv's and the Linears' bf16 weights


def test_the_forward_holds_one_layers_copy_not_every_layers():
    """16 Linears of 1024 x 1024: 2 MiB per bf16 copy, 32 MiB that autocast's cache keeps through the forward."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(16)])
    peaks = _forward_peaks(model, torch.randn(4, 1024))
    assert peaks[False] >= 32 * MiB, {k: v / MiB for k, v in peaks.items()}
    assert peaks[True] <= 5 * MiB, {k: v / MiB for k, v in peaks.items()}  # 4.0 measured: two copies at most


def test_a_parameter_changed_in_place_before_the_backward_raises():
    """Its copy is made again in the backward: a changed weight would give other gradients than the forward's, so
    autograd's in-place error is raised, as it is for the weight a float32 Linear saves."""
    model = _model()
    compressor = _compressor(model)
    with torch.autocast("cpu", dtype=torch.bfloat16), compressor.compress():
        out = model(torch.randn(2, 3, 6, 6))
    with torch.no_grad():
        model[5].weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.float().sum().backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_weights_autocast_does_not_cast_are_kept_as_before(dtype):
    """Without autocast, or for float64 under it (autocast leaves float64 alone), nothing is cast: the saved weights
    are the parameters (or their views), held as saved."""
    model = _model().to(dtype)
    compressor = _compressor(model)
    x = torch.randn(2, 3, 6, 6, dtype=dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.float64), compressor.compress():
        out = model(x)
    assert out.dtype == dtype
    out.sum().backward()
    reference = copy.deepcopy(model)
    reference.zero_grad(set_to_none=True)
    reference(x).sum().backward()
    for p, r in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, r.grad)


def test_a_parameter_outside_the_models_memory_keeps_its_copy():
    """Only the model's own parameters are cast again: another module's (here a Linear the compressor's model does
    not hold; under FSDP the all-gathered weights, freed and gathered again before the backward) keeps its saved
    copy, so changing it in place before the backward raises nothing, as without the compressor."""
    model = _model()
    outside = nn.Linear(64, 64)
    compressor = _compressor(model)
    x = torch.randn(2, 3, 6, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16), compressor.compress():
        out = outside(model(x))
    with torch.no_grad():
        outside.weight.add_(1.0)
    out.float().sum().backward()
    assert outside.weight.grad is not None and model[5].weight.grad is not None


@pytest.mark.parametrize("layer", ["linear", "conv"])
def test_a_frozen_weights_copy_is_cast_again_not_compressed(layer):
    """A frozen weight (LoRA's base layer) has no autograd history: its autocast copy is told from an activation
    by the call that saves it (``F.linear``, a convolution). Before, it was quantized with the activations: the
    input gradient read a 4-bit weight."""
    torch.manual_seed(0)
    module = nn.Linear(256, 256) if layer == "linear" else nn.Conv2d(16, 16, 3, padding=1)
    module.requires_grad_(False)
    x = torch.randn(8, 256) if layer == "linear" else torch.randn(2, 16, 8, 8)
    grads = {}
    for compressed in (False, True):
        # min_numel 1: every tensor saved as an activation would be quantized at 4 bits
        compressor = act.ActivationCompressor(module, act.ACTConfig(bits=4, adaptive=False, min_numel=1)) \
            if compressed else None
        xg = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16), \
                (compressor.compress() if compressor else torch.enable_grad()):
            out = module(xg)
        out.float().sum().backward()
        grads[compressed] = xg.grad
    assert torch.equal(grads[True], grads[False])  # the same bf16 weight in the input gradient
    kinds = [r.kind for r in compressor.stats().records]
    assert "parameter" in kinds and "compressed" not in kinds  # (the convolution also saves x's cast: a leaf's)


def test_frozen_weights_hold_no_copy_through_the_forward():
    """16 frozen Linears of 1024 x 1024 before a trainable head (a fine-tuned model's frozen base): autocast does not
    cache frozen weights' copies, autograd held each one saved (2 MiB apiece); now none outlives its op."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(16)], nn.Linear(1024, 4))
    model[:16].requires_grad_(False)
    # x requires grad, so the frozen layers' input gradients need their weights
    peaks = _forward_peaks(model, torch.randn(4, 1024, requires_grad=True))
    assert peaks[False] >= 32 * MiB, {k: v / MiB for k, v in peaks.items()}
    assert peaks[True] <= 5 * MiB, {k: v / MiB for k, v in peaks.items()}


class _Product(nn.Module):
    """A frozen weight read by a bare matrix product (``x @ w.t()``), as hand-written attention or LoRA code does."""

    def __init__(self, product: str, part: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(torch.randn(48, 64))
        self.product, self.part = product, part

    def forward(self, x):
        w = self.weight[:, :32] if self.part else self.weight  # a part: a view at an offset of the parameter
        x = x[:, : w.shape[1]]
        if self.product == "@":
            return x @ w.t()
        return getattr(torch, self.product)(x, w.t())


def _input_grads(module, compressed: bool):
    compressor = act.ActivationCompressor(module, act.ACTConfig(bits=4, adaptive=False, min_numel=1)) \
        if compressed else None
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16), (compressor.compress() if compressor else torch.enable_grad()):
        out = module(x)
    out.float().square().sum().backward()
    return x.grad, compressor


@pytest.mark.parametrize("product", ["@", "matmul", "mm"])
def test_a_frozen_weight_read_through_its_transpose_is_cast_again(product):
    """``x @ w.t()``: autocast copies the view ``w.t()``; the copy has the view's strides over the parameter's
    order, so the parameter cast again and seen through the saved geometry is that copy, bit for bit."""
    module = _Product(product).requires_grad_(False)
    expected, _ = _input_grads(module, compressed=False)
    actual, compressor = _input_grads(module, compressed=True)
    assert torch.equal(actual, expected)
    assert [r.kind for r in compressor.stats().records] == ["parameter"]


def test_a_frozen_weights_part_is_compressed_as_an_activation():
    """A view at an offset of the parameter (``w[:, :32].t()``) is not the parameter reordered: its copy is
    compressed like an activation (the README's known limits), and the gradient stays close."""
    module = _Product("@", part=True).requires_grad_(False)
    expected, _ = _input_grads(module, compressed=False)
    actual, compressor = _input_grads(module, compressed=True)
    assert [r.kind for r in compressor.stats().records] == ["compressed"]
    assert torch.allclose(actual, expected, rtol=0.1, atol=0.1 * float(expected.abs().max()))


def test_a_trainable_weight_read_through_its_transpose_is_cast_again():
    """``x @ w.t()`` with a trainable ``w``: autocast's copy of the view ``w.t()`` reaches the parameter through
    the transpose's backward. It is cast again in the backward, like ``F.linear``'s: gradients bit for bit, and
    16 layers of 1024 x 1024 no longer hold their bf16 copies (2 MiB each) through the forward."""
    module = _Product("@")
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    grads = {}
    for compressed in (False, True):
        compressor = act.ActivationCompressor(module, act.ACTConfig(bits=4, adaptive=False, min_numel=1 << 30)) \
            if compressed else None
        xg = x.clone().requires_grad_()
        module.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16), \
                (compressor.compress() if compressor else torch.enable_grad()):
            out = module(xg)
        out.float().square().sum().backward()
        grads[compressed] = (xg.grad, module.weight.grad)
    assert all(torch.equal(a, b) for a, b in zip(grads[True], grads[False]))
    # x's cast (x: a leaf that requires grad, kept as a parameter is) and w.t()'s (cast again: the peaks below)
    assert [r.kind for r in compressor.stats().records] == ["parameter", "parameter"]

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.weights = nn.ParameterList([nn.Parameter(torch.randn(1024, 1024) / 32) for _ in range(16)])

        def forward(self, x):
            for w in self.weights:
                x = x @ w.t()
            return x

    peaks = _forward_peaks(Stack(), torch.randn(4, 1024, requires_grad=True))  # every layer saves its copy
    assert peaks[False] >= 32 * MiB, {k: v / MiB for k, v in peaks.items()}
    assert peaks[True] <= 5 * MiB, {k: v / MiB for k, v in peaks.items()}
