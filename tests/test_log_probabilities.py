"""Log-softmax outputs (and cross-entropy's) are stored at 8 bits or more: their backward exponentiates them."""
import pytest
import torch
import torch.nn.functional as F

import lightning_act as act
from lightning_act.codecs import op_rules
from lightning_act.codecs.op_rules import LOG_PROBABILITY_BITS, MinimumBits
from lightning_act.optrack import FunctionCall

LOG_SOFTMAX_CALLS = {
    "F.log_softmax": lambda z: F.log_softmax(z, dim=-1),
    "torch.log_softmax": lambda z: torch.log_softmax(z, dim=-1),
    "Tensor.log_softmax": lambda z: z.log_softmax(-1),
    "F.cross_entropy": lambda z: F.cross_entropy(z, torch.arange(z.shape[0]) % z.shape[1], reduction="none"),
    "nn.CrossEntropyLoss": lambda z: torch.nn.CrossEntropyLoss(reduction="none")(z, torch.arange(z.shape[0]) % 7),
    # logsumexp saves its input and output: the output is (64,), under the test's min_numel
    "torch.logsumexp": lambda z: torch.logsumexp(z, dim=-1),
    "Tensor.logsumexp": lambda z: z.logsumexp(-1),
}


def _logits_and_loss(call, dtype, config, policy=None):
    """A linear layer's logits through ``call``: ``(compressor's stored records, gradient of the input,
    the same gradient uncompressed)``."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 100).to(dtype)
    x = (torch.randn(64, 48, dtype=dtype) * 3).requires_grad_()
    exact, = torch.autograd.grad(call(layer(x)).sum(), x)
    compressor = act.ActivationCompressor(layer, config)
    handle = compressor.install_policy(**policy) if policy else None
    try:
        with compressor.compress():
            loss = call(layer(x)).sum()
        grad, = torch.autograd.grad(loss, x)
    finally:
        if handle is not None:
            handle.remove()
    compressed = [r for r in compressor.stats().records if r.kind == "compressed"]
    return compressed, grad, exact


def _relative_error(grad, exact):
    return ((grad.double() - exact.double()).norm() / exact.double().norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("call", LOG_SOFTMAX_CALLS, ids=str)
@pytest.mark.parametrize("bits", [1, 2, 4])
def test_log_probabilities_are_stored_at_8_bits_below_it(call, dtype, bits):
    config = act.ACTConfig(bits=bits, adaptive=False, min_numel=256)
    compressed, grad, exact = _logits_and_loss(LOG_SOFTMAX_CALLS[call], dtype, config)
    assert [(r.codec, r.bits, tuple(r.shape)) for r in compressed] == [("quantize", 8.0, (64, 100))]
    # what 8 bits leave of the input's gradient, in every dtype against its own uncompressed step: about 1.1%
    # (0.4% through cross-entropy); 2 bits without the floor: 57%
    assert _relative_error(grad, exact) < 0.02


@pytest.mark.parametrize("bits", [8, 16, 32])
def test_log_probabilities_keep_the_configured_bits_at_8_and_above(bits):
    config = act.ACTConfig(bits=bits, adaptive=False, min_numel=256)
    compressed, _, _ = _logits_and_loss(LOG_SOFTMAX_CALLS["F.cross_entropy"], torch.float32, config)
    assert [r.bits for r in compressed] == [float(bits)]


def test_without_the_floor_two_bits_ruin_the_gradient(monkeypatch):
    # the reason for the rule, measured: the same step with it removed
    for fn in [fn for fn, rule in op_rules.OP_RULES.items() if rule is op_rules._log_probabilities_rule]:
        monkeypatch.delitem(op_rules.OP_RULES, fn)
    config = act.ACTConfig(bits=2, adaptive=False, min_numel=256)
    compressed, grad, exact = _logits_and_loss(LOG_SOFTMAX_CALLS["F.cross_entropy"], torch.float32, config)
    assert [r.bits for r in compressed] == [2.0]
    assert _relative_error(grad, exact) > 0.3


def test_division_gives_way_to_quantize_at_8_bits_and_lorenzo_keeps_its_bound():
    division, grad, exact = _logits_and_loss(LOG_SOFTMAX_CALLS["F.log_softmax"], torch.float32,
                                             act.ACTConfig(codec="division", min_numel=256))
    assert [(r.codec, r.bits) for r in division] == [("quantize", 8.0)]
    assert _relative_error(grad, exact) < 0.02  # division itself, without the rule: 107%
    lorenzo, _, _ = _logits_and_loss(LOG_SOFTMAX_CALLS["F.log_softmax"], torch.float32,
                                     act.ACTConfig(codec="lorenzo", error_bound=1e-3, min_numel=256))
    assert [(r.codec, r.error_bound) for r in lorenzo] == [("lorenzo", 1e-3)]


@pytest.mark.parametrize("policy", ["bits", "codec"])
def test_a_policy_below_the_floor_is_raised_to_it(policy):
    two_bits = act.codecs.get("quantize", bits=2)
    answer = {"bits": lambda index, t: 2, "codec": lambda index, t: two_bits}[policy]
    config = act.ACTConfig(bits=4, adaptive=False, min_numel=256)
    compressed, _, _ = _logits_and_loss(LOG_SOFTMAX_CALLS["torch.log_softmax"], torch.float32, config,
                                        {policy: answer})
    assert [(r.codec, r.bits) for r in compressed] == [("quantize", 8.0)]


def test_a_bits_policy_reads_the_floor_of_the_tensor_it_is_asked_about():
    """``ActivationCompressor.minimum_bits(index)``: the op rule's floor for the saved tensor a ``bits_policy`` is
    asked about (what auto-precision counts in its budget), None for the others and outside a step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(48, 96), torch.nn.GELU(), torch.nn.Linear(96, 100))
    compressor = act.ActivationCompressor(model, act.ACTConfig(bits=2, adaptive=False, min_numel=256))
    asked = {}

    def policy(index, t):
        asked[tuple(t.shape)] = compressor.minimum_bits(index)
        return 2

    with compressor.install_policy(bits=policy), compressor.compress():
        F.cross_entropy(model(torch.randn(64, 48)), torch.randint(0, 100, (64,))).backward()
    assert asked == {(64, 48): None, (64, 96): None, (64, 100): LOG_PROBABILITY_BITS}
    assert compressor.minimum_bits(0) is None  # no step running


def test_other_saved_tensors_of_the_step_keep_the_configured_bits():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(48, 96), torch.nn.GELU(), torch.nn.Linear(96, 100))
    x, y = torch.randn(64, 48), torch.randint(0, 100, (64,))
    compressor = act.ActivationCompressor(model, act.ACTConfig(bits=2, adaptive=False, min_numel=256))
    with compressor.compress():
        F.cross_entropy(model(x), y).backward()
    bits = {tuple(r.shape): r.bits for r in compressor.stats().records if r.kind == "compressed"}
    # the input, GELU's input and output (the linears'), then the log-probabilities
    assert bits == {(64, 48): 2.0, (64, 96): 2.0, (64, 100): 8.0}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=["contiguous",
                                                                                             "channels_last"])
@pytest.mark.parametrize("loss", ["log_softmax", "cross_entropy"])
def test_per_pixel_log_probabilities_of_a_convolution_in_either_layout(loss, memory_format, dtype):
    # a segmentation head: (N, classes, H, W) logits, log-probabilities over dim 1, saved in the conv's layout
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(8, 10, 1).to(dtype=dtype, memory_format=memory_format)
    x = (torch.randn(2, 8, 12, 12, dtype=dtype) * 3).to(memory_format=memory_format).requires_grad_()
    target = torch.randint(0, 10, (2, 12, 12))
    call = {"log_softmax": lambda z: F.log_softmax(z, dim=1).sum(),
            "cross_entropy": lambda z: F.cross_entropy(z, target)}[loss]
    exact, = torch.autograd.grad(call(conv(x)), x)
    compressor = act.ActivationCompressor(conv, act.ACTConfig(bits=2, adaptive=False, min_numel=256))
    with compressor.compress():
        out = call(conv(x))
    grad, = torch.autograd.grad(out, x)
    stored = {(r.codec, r.bits, tuple(r.shape)) for r in compressor.stats().records if r.kind == "compressed"}
    assert stored == {("quantize", 8.0, (2, 10, 12, 12))}  # (the conv's input is a leaf: kept)
    assert _relative_error(grad, exact) < 0.02


def test_minimum_bits_is_a_rule_answer_for_any_registered_function():
    logits = torch.nn.functional.linear(torch.zeros(2, 3, requires_grad=True), torch.zeros(4, 3)).float().view(2, 4)
    masked = logits.masked_fill(torch.eye(2, 4, dtype=torch.bool), float("-inf"))
    rule = op_rules.OP_RULES[F.log_softmax]
    # a matrix product's output holds no mask's -inf; other logits may: their -inf kept at 1 bit more
    assert rule(torch.zeros(2, 4), FunctionCall(F.log_softmax, (logits, -1), {})) == MinimumBits(LOG_PROBABILITY_BITS)
    assert rule(torch.zeros(2, 4), FunctionCall(F.log_softmax, (masked, -1), {})) == MinimumBits(
        LOG_PROBABILITY_BITS, infinities=True)
    assert rule(torch.zeros(2, 4), FunctionCall(F.log_softmax, (), {"input": torch.zeros(2, 4)})).infinities
    assert op_rules.OP_RULES[F.cross_entropy](torch.zeros(2, dtype=torch.int64), None) is None
