"""The ``lorenzo`` codec: strict error bound, zero preservation, non-finite values, exact sizes, block modes."""
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings

import lightning_act as act
from lightning_act.codecs.lorenzo import LorenzoCodec
from lightning_act.formats import lorenzo
from lightning_act.formats.lorenzo import (
    MODE_LORENZO,
    MODE_RAW,
    MODE_SPARSE,
    MODE_VERBATIM,
    block_sizes,
    decode_blocks,
    encode_blocks,
    reserved_payload_bytes,
    working_bound,
)
from tests.cuda_emulation.nan_payloads import INT_VIEW, nan_payload_groups
from tests.lorenzo_cases import DTYPES, adversarial_values, tensors



def assert_guarantees(x: torch.Tensor, y: torch.Tensor, error_bound: float) -> None:
    """Bound on every finite element (exact), zeros preserved, non-finite values bit for bit."""
    assert (y.shape, y.dtype, y.device) == (x.shape, x.dtype, x.device)
    xd, yd = x.double().reshape(-1), y.double().reshape(-1)
    finite = torch.isfinite(xd)
    err = (xd - yd).abs()[finite]
    assert torch.all(err <= error_bound), f"max error {err.max().item()!r} > {error_bound!r}"
    # the float64 difference is rounded: the errors closest to the bound are checked in exact arithmetic
    near = err >= error_bound * (1 - 2.0**-40)
    for a, b in zip(xd[finite][near].tolist(), yd[finite][near].tolist()):
        assert abs(Fraction(a) - Fraction(b)) <= Fraction(error_bound), f"|{a!r} - {b!r}| > {error_bound!r}"
    # |x| <= eb, the largest float32 <= the bound: for 16/32-bit inputs, every |x| <= error_bound
    small = finite & (xd.abs() <= working_bound(error_bound)[0])
    assert torch.all(yd[small] == 0), "a value within the bound did not decode to 0"
    bits_x = x.reshape(-1).view(INT_VIEW[x.dtype])
    bits_y = y.reshape(-1).view(INT_VIEW[x.dtype])
    assert torch.equal(bits_x[~finite], bits_y[~finite]), "NaN/Inf not preserved bit for bit"


def round_trip(x: torch.Tensor, error_bound: float):
    codec = act.codecs.get("lorenzo", error_bound=error_bound)
    packed = codec.encode(x)
    return packed, codec.decode(packed)


@settings(max_examples=150, deadline=None)
@given(tensors())
def test_property_bound_zeros_and_non_finite_hold(case):
    x, error_bound = case
    packed, y = round_trip(x, error_bound)
    assert_guarantees(x, y, error_bound)
    blocks = math.ceil(x.numel() / 32)
    assert packed.nbytes <= 2 * blocks + reserved_payload_bytes(x.numel(), x.element_size())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("error_bound", [1e-6, 1e-4, 1e-2, 1e-1])
def test_adversarial_values_hold_the_bound(dtype, error_bound):
    x = adversarial_values(error_bound, dtype, 2000, seed=3)
    assert_guarantees(x, round_trip(x, error_bound)[1], error_bound)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(0,), (1,), (31,), (33,), (7, 37), (2, 3, 65)])
def test_odd_shapes_round_trip(dtype, shape):
    torch.manual_seed(0)
    x = (torch.randn(shape) * 2).to(dtype)
    packed, y = round_trip(x, 1e-3)
    assert_guarantees(x, y, 1e-3)
    assert packed.nbytes == sum(b.numel() * b.element_size() for b in packed.buffers.values())


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_input(dtype):
    torch.manual_seed(1)
    x = torch.randn(40, 70).to(dtype).t()[::2]
    assert not x.is_contiguous()
    assert_guarantees(x, round_trip(x, 1e-2)[1], 1e-2)


def test_stored_size_is_headers_and_payload_and_escapes_make_blocks_verbatim():
    torch.manual_seed(2)
    x = torch.randn(1000)
    x[[5, 500]] = float("nan")
    packed, _ = round_trip(x, 1e-3)
    b = packed.buffers
    blocks = math.ceil(1000 / 32)
    sizes, _, _, mode, _, _ = block_sizes(b["header"], 4)
    assert b.keys() == {"header", "payload"}
    assert b["header"].numel() == blocks and b["header"].dtype == torch.int16
    assert b["payload"].numel() == int(sizes.sum())
    assert (mode == MODE_VERBATIM).nonzero().view(-1).tolist() == [0, 15]
    assert sizes[[0, 15]].tolist() == [128, 128]
    assert packed.nbytes == 2 * blocks + b["payload"].numel()


def test_constant_block_costs_its_header_and_lead_value():
    x = torch.full((96,), 0.5)
    packed, y = round_trip(x, 1e-3)
    assert packed.nbytes == 3 * (2 + 2)  # header + 2 bytes of the code 250 (two's complement, 16 bits)
    assert_guarantees(x, y, 1e-3)


def test_all_zero_blocks_cost_only_their_header():
    x = torch.zeros(64, 32)
    x[0, 0] = 1e-4  # within the bound: still an all-zero block
    packed, y = round_trip(x, 1e-3)
    assert packed.nbytes == 2 * 64
    assert torch.equal(y, torch.zeros_like(x))


def _modes(x: torch.Tensor, error_bound: float) -> torch.Tensor:
    return block_sizes(round_trip(x, error_bound)[0].buffers["header"], x.element_size())[3]


def test_block_mode_follows_the_data():
    torch.manual_seed(3)
    smooth = torch.linspace(0, 10, 32 * 16)
    assert torch.all(_modes(smooth, 1e-3) == MODE_LORENZO)
    noise = torch.randn(32 * 16)
    assert (_modes(noise, 1e-3) == MODE_RAW).float().mean() > 0.75  # deltas of noise are wider than codes
    sparse = torch.zeros(32 * 16)
    sparse[::16] = torch.rand(32) + 1
    assert torch.all(_modes(sparse, 1e-3) == MODE_SPARSE)


@pytest.mark.parametrize("codes", [
    [2**29 + 1, -(2**29 + 1)] * 20,                      # largest codes, deltas of 2**30 + 2: no overflow
    [0, 0, 0, 5, 0, 0, -7, 0] * 9,                        # sparse with signs
    list(range(-50, 50)),                                 # smooth
    [1],                                                  # one element
])
def test_block_encoding_round_trips_codes(codes):
    q = torch.tensor(codes, dtype=torch.int32)
    header, payload = encode_blocks(q)
    assert payload.numel() == int(block_sizes(header, 4)[0].sum())
    assert torch.equal(decode_blocks(header, payload, q.numel(), 4), q)


def test_huge_magnitudes_escape_instead_of_overflowing():
    x = torch.tensor([0.5] * 64 + [3e38, -3e38, 1e10, 7.0, float("inf")])
    _, y = round_trip(x, 1e-6)
    assert_guarantees(x, y, 1e-6)
    assert _modes(x, 1e-6).tolist() == [MODE_LORENZO, MODE_LORENZO, MODE_VERBATIM]


def test_incompressible_input_is_stored_verbatim_but_zero_preserving():
    torch.manual_seed(5)
    x = (torch.randn(320) * 100).to(torch.bfloat16)  # 16-bit values, codes of ~26 bits at this bound
    x[::7] = 1e-7
    packed, y = round_trip(x, 1e-6)
    assert torch.all(_modes(x, 1e-6) == MODE_VERBATIM)
    assert packed.nbytes == 2 * 10 + 2 * 320  # headers, and every block's 32 values
    assert_guarantees(x, y, 1e-6)


def test_reservation_is_the_input_padded_to_whole_blocks():
    assert [reserved_payload_bytes(n, 4) for n in (0, 1, 32, 33)] == [0, 128, 128, 256]
    assert reserved_payload_bytes(1000, 2) == 32 * 2 * 32


def test_working_bound_is_the_largest_float32_not_above_the_bound():
    for bound in (1e-3, 0.1, 1 / 3, 2.0**-20):
        eb, step, inv = working_bound(bound)
        assert eb <= bound and float(np.nextafter(np.float32(eb), np.float32(1))) > bound
        assert step == 2 * eb and inv == float(np.float32(1) / np.float32(step))


@pytest.mark.parametrize("dtype", DTYPES)
def test_huge_bounds_keep_a_finite_grid(dtype):
    """A bound near float32's max would overflow the step 2 * eb: it is capped, every guarantee still holds."""
    eb, step, _ = working_bound(1e300)
    assert eb == lorenzo.MAX_WORKING_BOUND and math.isfinite(step)
    x = torch.tensor([0.0, -0.0, 1.0, -3e38, 3e38, float("inf"), float("nan")]).to(dtype)
    codec = act.codecs.get("lorenzo", error_bound=1e39)
    decoded = codec.decode(codec.encode(x))
    small = x.float().abs() <= eb
    assert torch.equal(decoded[small], torch.zeros(int(small.sum()), dtype=dtype))
    finite = x.isfinite()
    assert (decoded[finite].double() - x[finite].double()).abs().max() <= eb
    assert torch.equal(decoded[~finite & ~x.isnan()], x[~finite & ~x.isnan()]) and decoded[6].isnan()


def test_deterministic():
    x = torch.randn(5000)
    a, _ = round_trip(x, 1e-3)
    b, _ = round_trip(x, 1e-3)
    assert all(torch.equal(a.buffers[k], b.buffers[k]) for k in a.buffers)


@pytest.mark.parametrize("bad", [None, 0, -1e-3, float("nan"), float("inf"), "1e-3", True])
def test_invalid_error_bound(bad):
    with pytest.raises(ValueError, match=r"error_bound=.*; expected a finite number > 0"):
        act.codecs.get("lorenzo", error_bound=bad)


def test_non_float_input_is_rejected():
    codec = act.codecs.get("lorenzo", error_bound=1e-3)
    with pytest.raises(ValueError, match=r"lorenzo codec takes float32/float16/bfloat16/float64 tensors; "
                                         r"got dtype=torch.int64"):
        codec.encode(torch.arange(10))


def float64_adversarial(error_bound: float, seed: int) -> torch.Tensor:
    """float64 values whose float32 rounding would pass a check that x itself fails: just beyond the bound and
    beyond grid midpoints by less than float32's resolution; tiny and huge magnitudes (float64 subnormals, past
    float32's range), random magnitudes over float64's range, signed zeros and non-finite values."""
    eb, step, _ = working_bound(error_bound)
    gen = np.random.default_rng(seed)
    nudge = np.arange(-3, 4) * 2.0**-45
    k = gen.integers(-5000, 5000, 200).astype(np.float64)
    midpoints = ((k + 0.5) * step)[:, None] * (1 + np.arange(-3, 4) * 2.0**-40)
    limit = float(np.finfo(np.float32).max)
    special = [5e-324, -5e-324, 1e-300, 1e-46, 1e300, -1e300, limit * (1 + 2.0**-30), -limit * (1 - 2.0**-30),
               3.4028235677973366e38, 1e39, 0.0, -0.0, np.nan, np.inf, -np.inf]
    magnitudes = gen.standard_normal(400) * 10.0 ** gen.uniform(-320, 308, 400)
    values = np.concatenate([eb * (1 + nudge), -eb * (1 + nudge), midpoints.ravel(), special, magnitudes])
    return torch.from_numpy(values[gen.permutation(values.size)])


@pytest.mark.parametrize("error_bound", [1e-6, 1e-2, 0.3, 1e30])
def test_float64_bound_holds_for_x_itself(error_bound):
    """The checks of a float64 input are float64: a value just above the bound that float32 rounds onto it must
    not decode to 0, a value a float32-rounded check would pass must escape or take the other code."""
    x = float64_adversarial(error_bound, seed=11)
    packed, y = round_trip(x, error_bound)
    assert_guarantees(x, y, error_bound)
    eb = working_bound(error_bound)[0]
    beyond = (x.abs() > eb) & (x.float().abs() <= eb)
    assert beyond.sum() >= 6 and (y[beyond] != 0).all()
    assert packed.buffers["payload"].numel() == int(block_sizes(packed.buffers["header"], 8)[0].sum())


@pytest.mark.parametrize("error_bound", [0.1, 1e-12])
@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_payloads_come_back_bit_for_bit(dtype, error_bound):
    """NaN and +-Inf are stored raw, in verbatim blocks: every encoding (signalling, negative, payload bits)
    comes back."""
    x = nan_payload_groups(dtype, 32, tail=7)
    _, y = round_trip(x, error_bound)
    holds_escape = torch.cat([~x.isfinite(), torch.zeros(-x.numel() % 32, dtype=torch.bool)]).view(-1, 32).any(1)
    assert holds_escape.any() and torch.all(_modes(x, error_bound)[holds_escape] == MODE_VERBATIM)
    assert_guarantees(x, y, error_bound)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_engine_with_lorenzo_gives_close_gradients(dtype):
    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)).to(dtype)
    x = torch.randn(256, 64, dtype=dtype)
    model(x).square().mean().backward()
    reference = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compressor = act.ActivationCompressor(model, act.ACTConfig(codec="lorenzo", error_bound=1e-3, min_numel=0))
    with compressor.compress():
        loss = model(x).square().mean()
    loss.backward()
    stats = compressor.stats()
    assert stats.ratio > 1.5
    for p, g in zip(model.parameters(), reference):
        assert torch.allclose(p.grad, g, rtol=1e-2, atol=1e-4)


def test_codec_is_registered():
    assert act.codecs.codec_class("lorenzo") is LorenzoCodec and "lorenzo" in act.codecs.available()
