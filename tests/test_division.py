"""DIVISION codec: residual bound per channel, unbiasedness, layouts, sizes, canonical NaN, engine use, ResNet-50
ratio."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_act as act
from lightning_act.formats import division as division_format
from lightning_act.formats import quantize as quantize_format
from lightning_act.formats.division import (
    low_frequency_copy,
    planes_and_spatial,
    upsample_nearest,
)
from lightning_act.models import resnet50
from lightning_act.stats import COMPRESSED
from tests.cuda_emulation.checks import assert_same_bits
from tests.cuda_emulation.nan_payloads import (
    GROUPS,
    assert_nans_canonical,
    nan_payload_groups,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
SHAPES = [(2, 3, 17, 9), (2, 3, 16, 16), (2, 3, 7, 7), (1,), (), (5,), (4, 33), (3, 4, 10), (2, 2, 9, 9, 9),
          (2, 1, 2, 3, 5, 6)]


def _codec(**options):
    return act.codecs.get("division", **options)


def _plane_steps(packed):
    """Each element's quantization step (the step of its plane), float32, in the tensor's shape."""
    planes, spatial = packed.meta["planes"], packed.meta["spatial"]
    step = packed.buffers["step"].float().view(planes, *([1] * len(spatial)))
    return step.expand(planes, *spatial).reshape(packed.shape)


def _within_one_step(x, y, packed):
    # one quantization step of the plane, plus the output dtype's rounding of the reconstruction (float32's for a
    # float64 input, which is computed with in float32)
    eps = torch.finfo(torch.float32 if x.dtype == torch.float64 else x.dtype).eps
    tol = _plane_steps(packed) * (1 + 1e-5) + y.float().abs() * eps
    return bool(((y.double() - x.double()).abs() <= tol).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_round_trip_error_is_within_one_step_per_channel(shape, dtype):
    x = (torch.randn(shape, dtype=torch.float64) * 3 + 1).to(dtype)  # float64 inputs off the float32 grid
    codec = _codec()
    packed = codec.encode(x, key=7)
    y = codec.decode(packed)
    assert y.shape == x.shape and y.dtype == dtype
    assert _within_one_step(x, y, packed)


def test_non_contiguous_input_round_trips():
    x = torch.randn(3, 20, 2, 11).permute(0, 2, 3, 1)  # (3, 2, 11, 20), not contiguous
    codec = _codec()
    packed = codec.encode(x, key=1)
    assert packed.meta["spatial"] == (11, 20)
    assert _within_one_step(x, codec.decode(packed), packed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(0,), (2, 0, 4, 4), (3, 4, 0)])
def test_empty_tensor(shape, dtype):
    codec = _codec()
    packed = codec.encode(torch.empty(shape, dtype=dtype))
    assert packed.nbytes == 0
    y = codec.decode(packed)
    assert y.shape == shape and y.dtype == dtype


@pytest.mark.parametrize("shape,planes,spatial", [
    ((), 1, (1,)), ((7,), 1, (7,)), ((4, 33), 4, (33,)), ((3, 4, 10), 12, (10,)), ((2, 3, 5, 6), 6, (5, 6)),
    ((2, 3, 4, 5, 6), 6, (4, 5, 6)), ((2, 1, 2, 3, 5, 6), 4, (3, 5, 6)),
])
def test_layout_planes_and_spatial_dims(shape, planes, spatial):
    assert planes_and_spatial(shape) == (planes, spatial)


def test_exact_sizes_are_reported():
    x = torch.randn(2, 3, 17, 9)  # 6 planes of 17 x 9: 3 x 2 blocks of 8
    packed = _codec().encode(x)
    lfc, payload, stats = 6 * 3 * 2 * 2, math.ceil(6 * 17 * 9 * 2 / 8), 6 * 2 * 2
    assert packed.nbytes == lfc + payload + stats == 326
    assert packed.buffers["lfc"].dtype == packed.buffers["mn"].dtype == packed.buffers["step"].dtype == torch.bfloat16
    assert _codec().bits_per_element(x) == pytest.approx(8 * (lfc + stats) / x.numel() + 2)


@pytest.mark.parametrize("spatial", [(17,), (17, 9), (7, 7), (9, 10, 11)])
def test_low_frequency_copy_is_the_average_pool_of_whole_and_partial_blocks(spatial):
    x = torch.randn(4, *spatial)
    pool = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}[len(spatial)]
    expected = pool(x.unsqueeze(0), 8, 8, ceil_mode=True).squeeze(0)  # divides edge blocks by their inside count
    lfc = low_frequency_copy(x, 8)
    assert lfc.dtype == torch.bfloat16 and lfc.shape == expected.shape
    torch.testing.assert_close(lfc.float(), expected, rtol=2**-7, atol=1e-6)


def test_block_constant_input_comes_back_exactly():
    blocks = torch.randn(6, 3, 2).to(torch.bfloat16)
    x = upsample_nearest(blocks, (20, 9), 8).view(2, 3, 20, 9)  # residual is exactly 0
    codec = _codec()
    packed = codec.encode(x)
    torch.testing.assert_close(packed.buffers["lfc"].view(6, 3, 2), blocks, rtol=0, atol=0)
    assert torch.equal(codec.decode(packed), x)


def test_unbiased_in_expectation():
    x = torch.randn(2, 3, 10, 13)
    codec = _codec()
    keys = 300
    packs = [codec.encode(x, key=k) for k in range(keys)]
    mean = torch.stack([codec.decode(p) for p in packs]).mean(0)
    step = _plane_steps(packs[0])
    # each element's error is bounded by its step, so the mean of `keys` draws has std <= step / (2 sqrt(keys))
    assert bool(((mean - x).abs() <= 5 * step / (2 * math.sqrt(keys)) + 1e-6).all())
    assert not torch.equal(packs[0].buffers["payload"], packs[1].buffers["payload"])


def test_same_key_same_bits_and_seed_changes_them():
    x = torch.randn(2, 4, 12, 12)
    a, b = _codec().encode(x, key=3), _codec().encode(x, key=3)
    assert all(torch.equal(a.buffers[k], b.buffers[k]) for k in a.buffers)
    assert not torch.equal(_codec(seed=1).encode(x, key=3).buffers["payload"], a.buffers["payload"])


@pytest.mark.parametrize("bits", [1, 4, 8])
@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_bits_and_block_size_options(bits, block_size):
    x = torch.randn(2, 3, 11, 14)
    codec = _codec(bits=bits, block_size=block_size)
    packed = codec.encode(x, key=2)
    assert packed.buffers["lfc"].shape == (6, -(-11 // block_size), -(-14 // block_size))
    assert packed.buffers["payload"].numel() == math.ceil(x.numel() * bits / 8)
    assert _within_one_step(x, codec.decode(packed), packed)


def test_more_bits_means_smaller_error():
    x = torch.randn(2, 8, 32, 32)
    errors = [(_codec(bits=b).decode(_codec(bits=b).encode(x)) - x).abs().mean().item() for b in (2, 4, 8)]
    assert errors[0] > 3 * errors[1] > 9 * errors[2]


def test_non_finite_plane_decodes_to_nan_and_others_stay_finite():
    x = torch.randn(2, 2, 9, 9)
    x[0, 1, 4, 4] = float("inf")
    x[1, 0, 0, 0] = float("nan")
    y = _codec().decode(_codec().encode(x))
    assert y[0, 1].isnan().all() and y[1, 0].isnan().all()
    assert y[0, 0].isfinite().all() and y[1, 1].isfinite().all()


@pytest.mark.parametrize("options,match", [
    ({"bits": 3}, r"bits=3; expected one of 1, 2, 4, 8"),
    ({"block_size": 0}, r"block_size=0; expected an integer >= 1"),
    ({"block_size": 2.5}, r"block_size=2.5; expected an integer >= 1"),
    ({"seed": -1}, r"seed=-1; expected an integer >= 0"),
    ({"backend": "gpu"}, r"backend='gpu'; expected one of 'auto', 'torch', 'cupy'"),
])
def test_bad_options_raise(options, match):
    with pytest.raises(ValueError, match=match):
        _codec(**options)


def test_integer_input_raises():
    with pytest.raises(ValueError, match=r"division codec takes float32/float16/bfloat16/float64 tensors; "
                                         r"got dtype=torch.int64"):
        _codec().encode(torch.arange(10))


@pytest.mark.parametrize("dtype", DTYPES)
def test_stored_and_decoded_nans_are_canonical(dtype):
    """Planes holding NaNs of every encoding and +-Inf mixes: block means, statistics and the decode hold only the
    canonical NaN of their dtype, so CPU, CUDA and the kernels store the same bytes."""
    x = nan_payload_groups(dtype, 64).view(1, GROUPS, 8, 8)  # one 8 x 8 plane per group
    codec = _codec(block_size=4, backend="torch")
    packed = codec.encode(x)
    for name in ("lfc", "mn", "step"):
        assert_nans_canonical(packed.buffers[name])
    y = codec.decode(packed)
    assert y.dtype == dtype
    assert_nans_canonical(y)
    assert torch.isfinite(y[0, -1]).all() and torch.isnan(y[0, 0]).all()  # finite plane kept, NaN plane marked


def test_config_builds_division_with_seed():
    compressor = act.ActivationCompressor(None, act.ACTConfig(codec="division", seed=5))
    codec = compressor.codec_for(0, torch.randn(8))
    assert (codec.name, codec.block_size, codec.bits, codec.seed) == ("division", 8, 2, 5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_engine_keeps_the_conv_layout_and_trains(dtype):
    torch.manual_seed(0)
    # no bias before BN: its exact gradient is zero, so no cosine to compare
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 4, 3, padding=1)).to(dtype)
    x = torch.randn(4, 3, 32, 32, dtype=dtype)
    model(x).square().mean().backward()
    exact = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compressor = act.ActivationCompressor(model, act.ACTConfig(codec="division"))
    with compressor.compress():
        loss = model(x).square().mean()
    loss.backward()
    records = [r for r in compressor.stats().records if r.kind == COMPRESSED and r.codec == "division"]
    # the input, the BN input, the second conv's input (the ReLU keeps a 1-bit mask) and the squared output
    assert [r.shape for r in records] == [(4, 3, 32, 32), (4, 8, 32, 32), (4, 8, 32, 32), (4, 4, 32, 32)]
    # 2 residual bits + one bf16 mean per 8 x 8 block: only the (H, W) layout gives < 2.5 bits
    assert all(r.bits < 2.5 for r in records)
    cosines = [F.cosine_similarity(p.grad.flatten(), g.flatten(), dim=0) for p, g in zip(model.parameters(), exact)]
    assert min(cosines) > 0.9


def test_resnet50_activation_ratio_meets_the_papers_estimate():
    torch.manual_seed(0)
    model = resnet50()
    compressor = act.ActivationCompressor(model, act.ACTConfig(codec="division"))
    with compressor.compress():
        model(torch.randn(2, 3, 224, 224))
    stats = compressor.stats()
    original, stored = stats.per_codec()["division"]
    assert stats.ratio >= 10.35  # DIVISION appendix G: R_ResNet-50 >= 10.35 (conv + BN + ReLU activations)
    assert original / stored >= 10



def _planes(shape, dtype):
    torch.manual_seed(4)
    planes, spatial = planes_and_spatial(shape)
    return (torch.randn(planes, *spatial, dtype=torch.float64) * 3 + 1).to(dtype)


@pytest.mark.parametrize("chunk", [1 << 17, 40])  # one chunk, or one or a few planes per chunk
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fast_path_is_the_specification_bit_for_bit(dtype, bits, chunk, monkeypatch):
    """What the codecs run (``division_*_reference``: chunks of planes, reused buffers, the quantize format's
    fast chunks) stores and decodes the very bits of ``division_encode_spec`` / ``division_decode_spec``: planes
    divisible by the block or not, 1D/2D/3D, one element, non-contiguous, NaN and +-Inf, block sizes 8 and 3."""
    monkeypatch.setattr(quantize_format, "CHUNK_ELEMENTS", chunk)
    inputs = {str(shape): _planes(shape, dtype) for shape in SHAPES}
    inputs["non-contiguous"] = _planes((2, 6, 20, 9), dtype).transpose(1, 2)
    inputs["NaN and Inf"] = nan_payload_groups(dtype, 64).view(GROUPS, 8, 8)
    for block in (8, 3):
        for name, x in inputs.items():
            expected = division_format.division_encode_spec(x, block, bits, 2, 7)
            stored = division_format.division_encode_reference(x, block, bits, 2, 7)
            for a, e in zip(stored, expected):
                assert_same_bits(a, e)
            args = (*expected, x.shape[0], tuple(x.shape[1:]), block, bits, dtype)
            decoded = division_format.division_decode_reference(*args)
            assert_same_bits(decoded, division_format.division_decode_spec(*args))
