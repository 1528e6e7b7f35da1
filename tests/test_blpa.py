"""BLPA block: exact forward, exact ReLU backward, K-bit stored copy, gradients within stated tolerances."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_act as act
from lightning_act.nn.blpa import decode_codes, sign_preserving_codes
from lightning_act.stats import PARAMETER


def _scrambled_bn(bn: nn.Module) -> nn.Module:
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    return bn


def _cnn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False), _scrambled_bn(nn.BatchNorm2d(16)), nn.ReLU(inplace=True),
        nn.Conv2d(16, 16, 3, padding=1, bias=False), _scrambled_bn(nn.BatchNorm2d(16)), nn.ReLU(),
        nn.Conv2d(16, 8, 3, stride=2, padding=1, bias=False), nn.Flatten(),
        _scrambled_bn(nn.BatchNorm1d(8 * 6 * 6)), nn.ReLU(), nn.Linear(8 * 6 * 6, 10))


def _fused_pair(bits: int):
    reference = _cnn()
    fused = copy.deepcopy(reference)
    assert act.nn.convert_bn_relu(fused, bits=bits) == 3
    return reference, fused


@pytest.mark.parametrize("bits", [4, 8])
def test_converter_replaces_each_bn_relu_layer_run(bits):
    _, fused = _fused_pair(bits)
    blocks = [m for m in fused.modules() if isinstance(m, act.nn.BNReLUBlock)]
    assert [type(b.layer) for b in blocks] == [nn.Conv2d, nn.Conv2d, nn.Linear]
    assert all(b.bits == bits for b in blocks)
    assert not any(isinstance(m, nn.ReLU) for m in fused.modules())
    assert list(fused._modules) == ["0", "1", "4", "7", "8"]  # each block is named like its BatchNorm


def test_converter_finds_nested_sequentials_and_leaves_other_patterns():
    model = nn.Module()
    model.body = nn.Sequential(nn.Sequential(nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 4)),
                               nn.BatchNorm1d(4), nn.GELU(), nn.Linear(4, 4))
    assert act.nn.convert_bn_relu(model) == 1
    assert isinstance(model.body[0][0], act.nn.BNReLUBlock) and isinstance(model.body[2], nn.GELU)


def _perturbed(state: dict) -> dict:
    return {key: value + 1 if value.is_floating_point() else value + 2 for key, value in state.items()}


def test_the_state_dict_keeps_the_keys_the_model_was_built_with_and_loads_either_way(tmp_path):
    """A checkpoint of the converted model loads into the model as built (load_from_checkpoint, inference without
    BLPA) and back; one saved with the blocks' own keys still loads into the converted model."""
    model = nn.Module()
    model.body = nn.Sequential(nn.Sequential(nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 4)),
                               nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 4), nn.BatchNorm1d(4))
    built = copy.deepcopy(model)
    assert act.nn.convert_bn_relu(model) == 2
    state = model.state_dict()
    assert list(state) == list(built.state_dict())  # the same keys, in the same order
    assert all(torch.equal(state[k], v) for k, v in built.state_dict().items())
    assert state._metadata["body.1"] == built.state_dict()._metadata["body.1"]  # BatchNorm's version
    assert "body.1.bn.weight" in dict(model.named_parameters())  # (the module tree itself is converted)

    built.load_state_dict(_perturbed(state))  # converted -> as built
    assert torch.equal(built.body[3].weight, model.body[1].layer.weight + 1)
    assert torch.equal(built.body[1].num_batches_tracked, model.body[1].bn.num_batches_tracked + 2)
    model.load_state_dict(built.state_dict())  # as built -> converted
    assert torch.equal(model.body[1].layer.weight, built.body[3].weight)
    assert torch.equal(model.body[0][0].bn.running_var, built.body[0][0].running_var)
    blocks_own = {key.replace("body.1.", "body.1.bn.").replace("body.3.", "body.1.layer.")
                       .replace("body.0.0.", "body.0.0.bn.").replace("body.0.2.", "body.0.0.layer."): value
                  for key, value in _perturbed(built.state_dict()).items()}
    model.load_state_dict(blocks_own)  # the keys this package saved before
    assert torch.equal(model.body[1].layer.weight, built.body[3].weight + 1)

    path = tmp_path / "model.pt"  # the whole model, hooks included, still pickles
    torch.save(model, path)
    restored = torch.load(path, weights_only=False)
    assert list(restored.state_dict()) == list(built.state_dict())
    assert list(copy.deepcopy(model).state_dict()) == list(built.state_dict())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("train", [True, False])
def test_forward_is_identical_to_the_unfused_modules(bits, train):
    reference, fused = _fused_pair(bits)
    reference.train(train)
    fused.train(train)
    x = torch.randn(16, 3, 12, 12)
    for _ in range(2):  # the second step sees running statistics updated by the first
        assert torch.equal(fused(x), reference(x))
    assert all(torch.equal(a, b) for a, b in zip(reference.buffers(), fused.buffers()))
    with torch.no_grad():
        assert torch.equal(fused(x), reference(x))


# Stated tolerances: relative L2 error of each parameter's gradient (error <= 3|gamma| / 2**bits per element)
TOLERANCE = {8: 0.1, 4: 0.3}  # measured: 0.05 and 0.18 at most


@pytest.mark.parametrize("bits", [4, 8])
def test_parameter_gradients_are_within_the_stated_tolerance(bits):
    reference, fused = _fused_pair(bits)
    x = torch.randn(32, 3, 12, 12)
    reference(x).square().sum().backward()
    fused(x).square().sum().backward()
    errors = {name: ((a.grad - b.grad).norm() / a.grad.norm()).item()
              for (name, a), b in zip(reference.named_parameters(), fused.parameters())}
    assert max(errors.values()) < TOLERANCE[bits], errors
    assert errors["10.bias"] == 0  # the last layer's bias gradient needs no activation


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_autocast_backward_runs_the_layer_as_the_forward_did(memory_format):
    """Under bfloat16 autocast the forward's layer read bfloat16 copies of its input and weight; the backward re-runs
    it under the same autocast state (it raised "Input type (BFloat16) and bias type (float)" without it)."""
    reference, fused = _fused_pair(8)
    x = torch.randn(32, 3, 12, 12).contiguous(memory_format=memory_format)
    for model in (reference, fused):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        out.float().square().sum().backward()
    assert out.dtype == torch.bfloat16
    for (name, a), b in zip(reference.named_parameters(), fused.parameters()):
        assert b.grad.dtype == a.grad.dtype == torch.float32
        assert ((a.grad - b.grad).norm() / a.grad.norm()).item() < TOLERANCE[8], name


def test_float64_blocks_keep_float64_gradients():
    reference, fused = _fused_pair(8)
    reference.double()
    fused.double()
    x = torch.randn(32, 3, 12, 12, dtype=torch.float64, requires_grad=True)
    x_fused = x.detach().clone().requires_grad_()
    reference(x).square().sum().backward()
    fused(x_fused).square().sum().backward()
    assert x_fused.grad.dtype == torch.float64
    assert ((x.grad - x_fused.grad).norm() / x.grad.norm()).item() < TOLERANCE[8]
    assert all(p.grad.dtype == torch.float64 for p in fused.parameters())


def test_relu_backward_and_layer_bias_gradient_are_exact():
    torch.manual_seed(0)
    bn, conv = _scrambled_bn(nn.BatchNorm2d(6)), nn.Conv2d(6, 4, 3, padding=1)
    reference = nn.Sequential(bn, nn.ReLU(), conv)
    block = act.nn.BNReLUBlock(copy.deepcopy(bn), copy.deepcopy(conv), bits=4)
    x = torch.randn(8, 6, 10, 10)
    g = torch.randn(8, 4, 10, 10)
    (reference(x) * g).sum().backward()
    (block(x) * g).sum().backward()
    assert torch.equal(block.layer.bias.grad, conv.bias.grad)
    # beta's gradient is the sum of the ReLU-masked input gradient of the conv: exact up to summation order
    torch.testing.assert_close(block.bn.bias.grad, bn.bias.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits", [4, 8])
def test_stored_approximation_is_bits_per_element(bits):
    torch.manual_seed(0)
    block = act.nn.BNReLUBlock(nn.BatchNorm2d(8), nn.Conv2d(8, 4, 3), bits=bits)
    x = torch.randn(4, 8, 16, 16, requires_grad=True)
    compressor = act.ActivationCompressor(block, act.ACTConfig(opt_level="L0"))  # keep and count what is saved
    with compressor.compress():
        out = block(x)
    saved = [r for r in compressor.stats().records if r.kind != PARAMETER]
    assert [(r.dtype, r.original_bytes) for r in saved] == [(torch.uint8, x.numel() * bits // 8),
                                                            (torch.float32, 8 * 4)]  # codes, inverse std
    out.sum().backward()
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("bits", [4, 8])
def test_codes_keep_every_sign_and_the_error_bound(bits):
    torch.manual_seed(0)
    gamma = torch.tensor([1.0, 0.5, -2.0, 1e-3, 0.0, 1.0])
    beta = torch.tensor([0.2, -0.3, 1.0, 5.0, 0.0, -8.0])  # channels 3 and 5: beta +- 3 gamma excludes 0
    a2 = torch.randn(64, 6, 5) * 3 * gamma.abs().view(1, -1, 1) + beta.view(1, -1, 1)
    a2[0, :, :4] = torch.tensor([0.0, -0.0, float("nan"), 1e-30])
    a2[1, :, :2] = torch.tensor([-1e6, 1e6])
    codes = sign_preserving_codes(a2, gamma, beta, bits)
    assert codes.dtype == torch.uint8 and int(codes.max()) < 2**bits
    approx, positive = decode_codes(codes, gamma, beta, bits)
    assert torch.equal(positive, a2 > 0)
    # channels 0-2: the window is beta +- 3 gamma (less one code at the top); unclipped errors <= 3 |gamma| / 2**bits
    a2, approx, gamma, beta = a2[:, :3], approx[:, :3], gamma[:3].view(1, -1, 1), beta[:3].view(1, -1, 1)
    inside = (a2 - beta).abs() < 2.5 * gamma.abs()
    bound = (3 * gamma.abs() / 2**bits).expand_as(a2)
    assert bool(((approx - a2).abs() <= bound * (1 + 1e-5))[inside].all())


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match=r"bits=2; expected one of 4, 8"):
        act.nn.BNReLUBlock(nn.BatchNorm2d(4), nn.Conv2d(4, 4, 1), bits=2)
    with pytest.raises(ValueError, match=r"bn=LayerNorm; expected one of BatchNorm1d, BatchNorm2d, BatchNorm3d"):
        act.nn.BNReLUBlock(nn.LayerNorm(4), nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"layer=ReLU; expected one of Conv1d, Conv2d, Conv3d, Linear"):
        act.nn.BNReLUBlock(nn.BatchNorm1d(4), nn.ReLU())
    with pytest.raises(ValueError, match=r"bits=16; expected one of 4, 8"):
        act.nn.convert_bn_relu(nn.Sequential(), bits=16)


@pytest.mark.parametrize("dims", [1, 3])
def test_1d_and_3d_blocks_train(dims):
    torch.manual_seed(0)
    bn = {1: nn.BatchNorm1d, 3: nn.BatchNorm3d}[dims](4)
    conv = {1: nn.Conv1d, 3: nn.Conv3d}[dims](4, 2, 3)
    reference = nn.Sequential(bn, nn.ReLU(), conv)
    block = act.nn.BNReLUBlock(copy.deepcopy(bn), copy.deepcopy(conv), bits=8)
    x = torch.randn(8, 4, *([7] * dims))
    y_ref, y = reference(x), block(x)
    assert torch.equal(y, y_ref)
    y_ref.square().sum().backward()
    y.square().sum().backward()
    assert F.cosine_similarity(block.layer.weight.grad.flatten(), conv.weight.grad.flatten(), dim=0) > 0.999


@pytest.mark.parametrize("bits", [4, 8])
def test_config_converts_the_model_and_forward_stays_exact(bits):
    reference, model = _cnn(), _cnn()
    params_before = list(model.parameters())
    compressor = act.ActivationCompressor(model, act.ACTConfig(blpa_bits=bits))
    assert compressor.blpa_blocks == 3
    assert [m.bits for m in model.modules() if isinstance(m, act.nn.BNReLUBlock)] == [bits] * 3
    assert all(a is b for a, b in zip(params_before, model.parameters()))  # optimizers stay valid
    x = torch.randn(4, 3, 12, 12)
    with compressor.compress():
        out = model(x)
    assert torch.equal(out, reference(x))
    out.square().sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_lightning_strategy_trains_with_blpa_blocks(tmp_path):
    import lightning as L

    from tests.lightning_models import TinyCNN, random_loader

    torch.manual_seed(0)
    model = TinyCNN()  # net[1:4] is BatchNorm -> ReLU -> Conv
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    trainer = L.Trainer(strategy=act.ACTStrategy(act.ACTConfig(blpa_bits=4)), accelerator="cpu", max_epochs=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model, random_loader())
    assert isinstance(model.net[1], act.nn.BNReLUBlock) and model.net[1].bits == 4
    assert not torch.equal(before, torch.cat([p.detach().flatten() for p in model.parameters()]))
    kept = {r.dtype for r in trainer.strategy.compressor.stats().records if r.kind == "kept"}
    assert torch.uint8 in kept  # the block's packed codes, not the BN input or ReLU output
    trainer.save_checkpoint(tmp_path / "blpa.ckpt")  # loads into the model as built, for inference without BLPA
    built = TinyCNN()
    built.load_state_dict(torch.load(tmp_path / "blpa.ckpt", weights_only=False)["state_dict"])
    assert torch.equal(built.net[3].weight, model.net[1].layer.weight)
