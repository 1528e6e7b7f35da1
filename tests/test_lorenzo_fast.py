"""The fast torch path of the lorenzo format (``formats.lorenzo_fast``) stores the specification's bytes and
decodes its bits, on every dtype, shape, bound and block mode, across chunk boundaries."""
import pytest
import torch
from hypothesis import given, settings

import lightning_act as act
from lightning_act.formats import lorenzo_fast
from lightning_act.formats.lorenzo import (
    MODE_LORENZO,
    MODE_RAW,
    MODE_SPARSE,
    MODE_VERBATIM,
    block_sizes,
    lorenzo_decode_reference,
    lorenzo_encode_reference,
    reserved_payload_bytes,
)
from lightning_act.formats.lorenzo_fast import lorenzo_decode_fast, lorenzo_encode_fast
from tests.cuda_emulation.checks import assert_same_bits
from tests.cuda_emulation.nan_payloads import nan_payload_groups
from tests.lorenzo_cases import DTYPES, adversarial_values, tensors


def assert_matches_specification(flat: torch.Tensor, error_bound: float) -> dict[str, torch.Tensor]:
    expected = lorenzo_encode_reference(flat, error_bound)
    encoded = lorenzo_encode_fast(flat, error_bound)
    assert torch.equal(encoded["header"], expected["header"])
    assert torch.equal(encoded["payload"], expected["payload"])
    decoded = lorenzo_decode_fast(expected, flat.numel(), error_bound, flat.dtype)
    assert_same_bits(decoded, lorenzo_decode_reference(expected, flat.numel(), error_bound, flat.dtype))
    return encoded


def modes(encoded: dict[str, torch.Tensor], dtype: torch.dtype) -> set[int]:
    return set(block_sizes(encoded["header"], dtype.itemsize)[3].tolist())


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 3 blocks: every tensor below spans several, the last one short."""
    monkeypatch.setattr(lorenzo_fast, "CHUNK_ELEMENTS", 96)


def test_bit_matrix_transpose_and_plane_words_match_their_definitions():
    words = torch.randint(-2**62, 2**62, (500,), dtype=torch.int64)
    bits = (words[:, None] >> torch.arange(64)) & 1
    transposed = (lorenzo_fast._transpose8_(words.clone())[:, None] >> torch.arange(64)) & 1
    assert torch.equal(transposed.view(-1, 8, 8), bits.view(-1, 8, 8).transpose(1, 2))
    magnitudes = torch.randint(0, 2**31, (64, 32), dtype=torch.int32)
    planes = lorenzo_fast._magnitude_planes(magnitudes, 4)
    lane_bits = (magnitudes[:, None, :].long() >> torch.arange(32)[None, :, None]) & 1
    assert torch.equal(planes, (lane_bits << torch.arange(32)).sum(dim=2))
    assert torch.equal(lorenzo_fast._lane_magnitudes(planes, 4), magnitudes)
    flags = torch.rand(64, 32) < 0.5
    assert torch.equal(lorenzo_fast._lane_words(flags), (flags.long() << torch.arange(32)).sum(dim=1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", [0, 1, 31, 32, 33, 95, 1000])
@pytest.mark.parametrize("error_bound", [1e-1, 1e-3, 1e-6])
def test_same_bytes_as_the_specification(dtype, numel, error_bound, small_chunks):
    gen = torch.Generator().manual_seed(numel)
    noise = torch.randn(numel, generator=gen, dtype=torch.float64)
    for x in (noise, noise.relu(), noise.cumsum(0) * 0.05, torch.zeros(numel, dtype=torch.float64)):
        assert_matches_specification(x.to(dtype), error_bound)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_block_mode_and_escape_matches(dtype, small_chunks):
    """Raw, Lorenzo, sparse and verbatim blocks side by side; grid points, midpoints, the bound, denormals,
    huge values, NaN and Inf (the adversarial values of the codec's tests)."""
    smooth = torch.linspace(-3, 5, 96, dtype=torch.float64)
    relu = torch.randn(96, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).relu()
    x = torch.cat([smooth, relu, torch.randn(96, dtype=torch.float64), torch.full((32,), 7.25, dtype=torch.float64),
                   adversarial_values(1e-2, torch.float64, 200, seed=3)]).to(dtype)
    encoded = assert_matches_specification(x, 1e-2)
    assert modes(encoded, dtype) == {MODE_RAW, MODE_LORENZO, MODE_SPARSE, MODE_VERBATIM}


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_payloads_and_infinities_are_stored_as_the_specification_stores_them(dtype, small_chunks):
    assert_matches_specification(nan_payload_groups(dtype, tail=7), 1e-3)


@pytest.mark.parametrize("error_bound", [1e-45, 1e-30, 1.7e38, 1e39])
def test_extreme_bounds_match(error_bound):
    x = torch.cat([torch.randn(300), torch.tensor([3e38, -3e38, 1e-40, 0.0, -0.0])])
    for dtype in DTYPES:
        assert_matches_specification(x.to(dtype), error_bound)


def test_a_strided_flat_view_and_a_reserved_payload_decode_alike():
    """A strided 1-D view (NaN in it: verbatim blocks) encodes as its values do; a payload longer than the
    headers' total (the CUDA encode's reservation) decodes as the exact one."""
    base = torch.randn(2 * 32 * 22)  # whole blocks: the chunk is not padded (copied)
    base[::14] = float("nan")
    view = base[::2]
    assert not view.is_contiguous()
    expected = lorenzo_encode_reference(view.contiguous(), 1e-2)
    encoded = lorenzo_encode_fast(view, 1e-2)
    assert torch.equal(encoded["payload"], expected["payload"])
    assert MODE_VERBATIM in modes(encoded, torch.float32)
    reserved = torch.zeros(reserved_payload_bytes(view.numel(), 4), dtype=torch.uint8)
    reserved[: expected["payload"].numel()] = expected["payload"]
    decoded = lorenzo_decode_fast({"header": expected["header"], "payload": reserved}, view.numel(), 1e-2,
                                  torch.float32)
    assert_same_bits(decoded, lorenzo_decode_reference(expected, view.numel(), 1e-2, torch.float32))


@settings(max_examples=150, deadline=None)
@given(tensors())
def test_random_tensors_match_the_specification(case):
    x, error_bound = case
    assert_matches_specification(x.reshape(-1), error_bound)


def test_the_codec_runs_the_fast_path_off_the_kernels(monkeypatch):
    calls = []
    encode, decode = lorenzo_fast.lorenzo_encode_fast, lorenzo_fast.lorenzo_decode_fast
    monkeypatch.setattr("lightning_act.codecs.lorenzo.lorenzo_encode_fast", lambda *a: calls.append("e") or encode(*a))
    monkeypatch.setattr("lightning_act.codecs.lorenzo.lorenzo_decode_fast", lambda *a: calls.append("d") or decode(*a))
    codec = act.codecs.get("lorenzo", error_bound=1e-2, backend="torch")
    x = torch.randn(4, 100)
    y = codec.decode(codec.encode(x))
    assert calls == ["e", "d"]
    assert_same_bits(y.reshape(-1), lorenzo_decode_reference(lorenzo_encode_reference(x.reshape(-1), 1e-2), 400,
                                                             1e-2, torch.float32))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sixteen_bit_values_at_the_bound_keep_zero_preservation(dtype):
    """The corner the fast path's zero preservation rests on: a 16-bit ``x = +-eb`` may round to a code of +-1
    (when ``1 / (2 eb)`` rounds up), whose decode must then be at least ``eb`` away. Bounds equal to (or a hair
    off) 16-bit values across the whole exponent range, with their neighbours: the specification's bytes."""
    patterns = torch.arange(1, 0x7C00 if dtype == torch.float16 else 0x7F80, 280, dtype=torch.int32).to(torch.int16)
    for value in patterns.view(dtype).tolist():
        at = torch.tensor([value, -value], dtype=torch.float32).to(dtype).view(torch.int16)
        x = torch.cat([at, at - 1, at + 1]).view(dtype).repeat(6)
        for error_bound in (value, value * (1 + 2**-30), value * (1 - 2**-12), value * 1.5):
            assert_matches_specification(x, error_bound)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_the_codec_encodes_any_memory_format_as_its_logical_order(dtype, memory_format):
    """The codec's torch path on a 4-D activation, contiguous or channels_last: the specification's bytes of the
    tensor in logical order, and a decode of the input's shape, dtype and values."""
    x = torch.randn(2, 5, 7, 9, generator=torch.Generator().manual_seed(2)).relu().to(dtype)
    x = x.to(memory_format=memory_format)
    codec = act.codecs.get("lorenzo", error_bound=1e-2, backend="torch")
    packed = codec.encode(x)
    expected = lorenzo_encode_reference(x.contiguous().reshape(-1), 1e-2)
    assert torch.equal(packed.buffers["payload"], expected["payload"])
    assert torch.equal(packed.buffers["header"], expected["header"])
    y = codec.decode(packed)
    assert (y.shape, y.dtype) == (x.shape, x.dtype)
    assert_same_bits(y.reshape(-1), lorenzo_decode_reference(expected, x.numel(), 1e-2, dtype))
