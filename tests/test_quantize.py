"""The pure-torch ``quantize`` codec: round trips, error bound, unbiasedness, odd shapes, non-finite values,
canonical NaN encodings."""
import math

import pytest
import torch

import lightning_act as act
from lightning_act import rng
from lightning_act.formats import quantize as quantize_format
from lightning_act.formats._bitpack import pack_codes, unpack_codes
from tests.cuda_emulation.checks import assert_same_bits
from tests.cuda_emulation.nan_payloads import (
    INT_VIEW,
    assert_nans_canonical,
    nan_payload_groups,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
PACKED_BITS = [1, 2, 4, 8]


def _per_element(stat: torch.Tensor, group: int, n: int) -> torch.Tensor:
    return stat.float().repeat_interleave(group)[:n]


def _ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing at |x| of ``dtype``, or of float32 for float64 (rounding the float32 decode into the output dtype,
    or a float64 input into float32, costs half of it)."""
    finfo = torch.finfo(torch.float32 if dtype == torch.float64 else dtype)
    return finfo.eps * x.abs().clamp_min(finfo.tiny)


@pytest.mark.parametrize("bits", PACKED_BITS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stats_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(0,), (1,), (7, 37), (3, 256), (2, 3, 300)])
def test_round_trip_error_is_at_most_one_step(bits, dtype, stats_dtype, shape):
    torch.manual_seed(0)
    x = (torch.randn(shape, dtype=torch.float64) * 3 + 1).to(dtype)  # float64 inputs off the float32 grid
    codec = act.codecs.get("quantize", bits=bits, stats_dtype=stats_dtype)
    packed = codec.encode(x, key=7)
    y = codec.decode(packed)
    assert (y.shape, y.dtype, y.device) == (x.shape, x.dtype, x.device)
    n, groups = x.numel(), math.ceil(x.numel() / 256)
    assert packed.buffers["payload"].numel() == math.ceil(n * bits / 8)
    expected_bytes = math.ceil(n * bits / 8) + 2 * groups * (4 if stats_dtype == "float32" else 2)
    assert packed.nbytes == expected_bytes
    if n:
        step = _per_element(packed.buffers["step"], 256, n)
        err = (y.double() - x.double()).abs().reshape(-1)
        bound = step * (1 + 1e-5) + _ulp(y.float().reshape(-1), dtype)
        assert torch.all(err <= bound), (err - bound).max()


@pytest.mark.parametrize("bits", PACKED_BITS)
def test_unbiased_over_seeds(bits):
    """Mean of 1000 independent decodes is within 5 standard errors of x for every element.

    Stochastic rounding to a grid of spacing s has per-draw variance <= s^2/4, so the mean of n draws has
    standard error <= s / (2 sqrt(n)); 5 of them bound a false alarm per element below 6e-7.
    """
    torch.manual_seed(1)
    x = torch.randn(512)
    n = 1000
    total = torch.zeros(512, dtype=torch.float64)
    for seed in range(n):
        codec = act.codecs.get("quantize", bits=bits, seed=seed)
        total += codec.decode(codec.encode(x)).double()
    step = _per_element(act.codecs.get("quantize", bits=bits).encode(x).buffers["step"], 256, 512).double()
    assert torch.all((total / n - x.double()).abs() <= 5 * step / (2 * math.sqrt(n)))


def test_same_key_same_bits_other_key_other_bits():
    x = torch.randn(4096)
    codec = act.codecs.get("quantize", bits=2)
    a, b, c = (codec.encode(x, key=k).buffers["payload"] for k in (5, 5, 6))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_constant_group_is_exact():
    x = torch.full((1000,), 0.3)
    codec = act.codecs.get("quantize", bits=1)
    packed = codec.encode(x)
    assert torch.equal(packed.buffers["step"], torch.zeros(4))
    assert torch.equal(codec.decode(packed), x)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_never_becomes_silently_finite(bad):
    x = torch.randn(600)
    x[300] = bad
    codec = act.codecs.get("quantize", bits=4)
    y = codec.decode(codec.encode(x))
    assert torch.isnan(y[256:512]).all()  # the whole group is marked
    assert torch.isfinite(y[:256]).all() and torch.isfinite(y[512:]).all()


def test_non_contiguous_input():
    x = torch.randn(64, 48).t()
    codec = act.codecs.get("quantize", bits=8)
    y = codec.decode(codec.encode(x))
    assert y.shape == x.shape and y.is_contiguous()
    assert (y - x).abs().max() <= (x.max() - x.min()) / 255 * 1.0001


@pytest.mark.parametrize("dtype", DTYPES)
def test_bits_16_and_32(dtype):
    x = torch.randn(100, 3).to(dtype)
    raw = act.codecs.get("quantize", bits=32)
    p = raw.encode(x)
    assert torch.equal(raw.decode(p), x) and p.nbytes == x.numel() * x.element_size()
    half = act.codecs.get("quantize", bits=16)
    p = half.encode(x)
    assert p.nbytes == x.numel() * 2
    assert torch.equal(half.decode(p), x.to(torch.bfloat16).to(dtype) if x.element_size() > 2 else x)


def test_group_statistics_bfloat16_cover_the_group():
    x = torch.randn(10000) * 7 + 3
    p = act.codecs.get("quantize", bits=2, stats_dtype="bfloat16").encode(x)
    mn = _per_element(p.buffers["mn"], 256, x.numel())
    top = mn + 3 * _per_element(p.buffers["step"], 256, x.numel())
    assert torch.all(mn <= x) and torch.all(top >= x)


@pytest.mark.parametrize("kwargs, match", [
    ({"bits": 3}, r"bits=3; expected one of 1, 2, 4, 8, 16, 32"),
    ({"group_size": 48}, r"group_size=48; expected an integer >= 32 and a multiple of 32"),
    ({"backend": "cuda"}, r"backend='cuda'"),
])
def test_codec_options_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        act.codecs.get("quantize", **kwargs)


def test_integer_input_rejected():
    with pytest.raises(ValueError, match=r"quantize codec takes float32/float16/bfloat16/float64 tensors; "
                                         r"got dtype=torch.int64"):
        act.codecs.get("quantize").encode(torch.arange(10))


@pytest.mark.parametrize("stats_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_stored_and_decoded_nans_are_canonical(dtype, stats_dtype):
    """NaNs of every encoding in, +-Inf mixes (NaN statistics from Inf - Inf): the statistics and the decode
    hold only the canonical NaN of their dtype, so CPU, CUDA and the kernels store the same bytes."""
    x = nan_payload_groups(dtype, 32, tail=7)
    codec = act.codecs.get("quantize", bits=4, group_size=32, stats_dtype=stats_dtype, backend="torch")
    packed = codec.encode(x)
    for name in ("mn", "step"):
        assert_nans_canonical(packed.buffers[name])
    y = codec.decode(packed)
    assert_nans_canonical(y)
    assert torch.isfinite(y[-39:-7]).all() and torch.isnan(y[:32]).all()  # finite group kept, NaN group marked


@pytest.mark.parametrize("dtype", DTYPES)
def test_16_bit_form_keeps_raw_16_bit_inputs_and_canonicalises_casts(dtype):
    x = nan_payload_groups(dtype, 32)
    codec = act.codecs.get("quantize", bits=16)
    packed = codec.encode(x)
    y = codec.decode(packed)
    if x.element_size() == 2:  # stored as it is: NaN bits and all
        assert torch.equal(y.view(INT_VIEW[dtype]), x.view(INT_VIEW[dtype]))
    else:
        assert_nans_canonical(packed.buffers["raw"])
        assert_nans_canonical(y)


def test_float64_model_trains_under_the_compressor():
    """A float64 model's saved tensors are quantized (they used to raise inside the pack hook)."""
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)).double()
    x = torch.randn(256, 64, dtype=torch.float64)
    model(x).square().mean().backward()
    reference = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compressor = act.ActivationCompressor(model, act.ACTConfig(codec="quantize", bits=8, min_numel=0))
    with compressor.compress():
        loss = model(x).square().mean()
    loss.backward()
    assert compressor.stats().ratio > 4
    for p, g in zip(model.parameters(), reference):
        assert p.grad.dtype == torch.float64
        assert torch.allclose(p.grad, g, rtol=2e-2, atol=1e-3)


def test_rng_scalar_and_tensor_hash_agree_and_cross_32bit_boundary():
    words = torch.tensor([0, 1, 2**31, 2**32 - 1, 123456789])
    assert rng.mix32_tensor(words.clone()).tolist() == [rng.mix32(w) for w in words.tolist()]
    base = rng.stream_base(3, 9)
    start = 2**32 - 2
    u = rng.uniform24(base, start, 4)
    expected = [(rng.mix32((i & rng.MASK32) ^ rng.mix32(base ^ (i >> 32))) >> 8) * 2**-24
                for i in range(start, start + 4)]
    assert u.tolist() == expected


@pytest.mark.parametrize("start, count", [(0, 1), (2**16 - 100, 300), (2**31 - 100, 300), (2**32 - 70000, 140000),
                                          (3 * 2**31 - 5, 300), (2**40 + 5, 300), (0, 2**16), (0, 2**17),
                                          (5 * 2**16 + 7, 20 * 2**16 + 3), (2**32 - 3 * 2**16 - 5, 7 * 2**16),
                                          (2**33 - 2**17, 2**18 + 9)])
def test_rng_int32_fast_path_matches_the_specification(start, count):
    """int32 words with wraparound, runs of 2**16 indices (alone, several at once, a ragged head and tail), 2**32
    boundaries: the specification's bits."""
    base = rng.stream_base(3, 9)
    out, scratch = torch.empty(count, dtype=torch.int32), torch.empty(count, dtype=torch.int32)
    k = rng.uniform24_codes_(base, start, out, scratch)
    assert k is out and int(k.min()) >= 0 and int(k.max()) < 2**24
    assert torch.equal(k.double() * 2**-24, rng.uniform24(base, start, count).double())


def test_rng_is_uniform():
    u = rng.uniform24(rng.stream_base(0, 0), 0, 1 << 16)
    hist = torch.histc(u, bins=16, min=0, max=1)
    expected = (1 << 16) / 16
    chi2 = ((hist - expected) ** 2 / expected).sum().item()
    assert chi2 < 40  # 15 degrees of freedom: p(chi2 > 40) < 0.001


def test_bitmask_codec_is_lossless_and_one_bit():
    m = torch.rand(3, 1001) > 0.5
    codec = act.codecs.get("bitmask")
    p = codec.encode(m)
    assert p.nbytes == math.ceil(3003 / 8)
    assert torch.equal(codec.decode(p), m)
    with pytest.raises(ValueError, match="bitmask codec takes bool tensors; got dtype=torch.float32"):
        codec.encode(torch.zeros(3))


@pytest.mark.parametrize("bits", PACKED_BITS)
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1001])
def test_bit_packing_layout_and_round_trip(bits, n):
    """Element i at bit (i % (8 / bits)) * bits of byte i // (8 / bits), little end first; unpack inverts."""
    codes = torch.randint(0, 2**bits, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    packed = pack_codes(codes.clone(), bits)
    per_byte = 8 // bits
    expected = [sum(int(codes[j]) << (bits * (j % per_byte)) for j in range(b * per_byte, min(n, (b + 1) * per_byte)))
                for b in range(math.ceil(n * bits / 8))]
    assert packed.tolist() == expected
    assert torch.equal(unpack_codes(packed, bits, n), codes)



def _fast_path_inputs(dtype: torch.dtype, group_size: int) -> dict:
    torch.manual_seed(3)
    wide = (torch.randn(40, 23, dtype=torch.float64) * 3 + 1).to(dtype)
    return {"empty": torch.empty(0, dtype=dtype), "one": torch.full((1,), -2.5, dtype=dtype),
            "partial last group": (torch.randn(5 * group_size + 7, dtype=torch.float64) * 5).to(dtype),
            "non-contiguous": wide.t()[:, ::2], "NaN and Inf": nan_payload_groups(dtype, group_size, tail=5),
            "constant": torch.full((3 * group_size,), 0.75, dtype=dtype)}


@pytest.mark.parametrize("chunk", [1 << 17, 100])  # one chunk, or a chunk of one or a few groups
@pytest.mark.parametrize("group_size", [32, 96, 49])  # 49: a division plane, whose codes may end mid-byte
@pytest.mark.parametrize("stats_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", PACKED_BITS)
def test_fast_path_is_the_specification_bit_for_bit(bits, dtype, stats_dtype, group_size, chunk, monkeypatch):
    """What the codecs run (``quantize_reference``: chunked, int32 random numbers, word packing) stores and
    decodes the very bits of ``quantize_spec`` / ``dequantize_spec``, chunk boundaries anywhere."""
    monkeypatch.setattr(quantize_format, "CHUNK_ELEMENTS", chunk)
    for name, x in _fast_path_inputs(dtype, group_size).items():
        expected = quantize_format.quantize_spec(x, bits, group_size, stats_dtype, 5, 11)
        stored = quantize_format.quantize_reference(x, bits, group_size, stats_dtype, 5, 11)
        for a, e in zip(stored, expected):
            assert_same_bits(a, e)
        args = (*expected, x.numel(), bits, group_size, dtype)
        assert_same_bits(quantize_format.dequantize_reference(*args), quantize_format.dequantize_spec(*args))


def _edge_inputs(dtype: torch.dtype, group_size: int) -> dict:
    """Groups where the fast path's NaN-free shortcut must not apply or sits at its edge: subnormal and zero
    ranges (1 / step overflows to +Inf), ranges that overflow float32, values beyond float32 (float64), signed
    zeros, a group at the top of the range, and a long tensor whose random words cross several 2**16 runs."""
    g = torch.Generator().manual_seed(group_size)
    finfo = torch.finfo(dtype)
    tiny = max(finfo.smallest_normal, torch.finfo(torch.float32).tiny) if dtype != torch.float64 else 1e-45
    big = min(finfo.max, torch.finfo(torch.float32).max)
    parts = [torch.randn(group_size, generator=g, dtype=torch.float64) * tiny,          # subnormal steps
             torch.full((group_size,), tiny, dtype=torch.float64),                        # zero range
             torch.where(torch.rand(group_size, generator=g) < 0.5, -big, big).double(),  # range overflows
             torch.randn(group_size, generator=g, dtype=torch.float64) * big / 4,
             torch.where(torch.rand(group_size, generator=g) < 0.5, -0.0, 0.0).double(),  # signed zeros
             torch.arange(group_size, dtype=torch.float64)]                               # top of the range
    if dtype == torch.float64:
        parts.append(torch.randn(group_size, generator=g, dtype=torch.float64) * 1e39)    # beyond float32
    x = torch.cat(parts).to(dtype)
    long = (torch.randn(3 * (1 << 16) + 5 * group_size + 3, generator=g, dtype=torch.float64) * 2).to(dtype)
    cut = 1 << 16
    return {"edge groups": x, "edge groups, shifted": torch.cat([x[:5], x]), "long": long,
            "long, edge groups inside": torch.cat([long[:cut], x, long[cut:], x[: 2 * group_size + 1]])}


@pytest.mark.parametrize("stats_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", PACKED_BITS)
def test_fast_path_edge_values_are_the_specification(bits, dtype, stats_dtype, monkeypatch):
    """On tensors of more than ``CHUNK_ELEMENTS`` the fast path skips NaN and range handling, then redoes the
    chunks holding a group without finite statistics and ``1 / step``: the same bits as the specification either
    way, on chunks of 3000 elements (several chunks, runs of random words split across chunks)."""
    monkeypatch.setattr(quantize_format, "CHUNK_ELEMENTS", 3000)
    for group_size in (64, 49):
        for name, x in _edge_inputs(dtype, group_size).items():
            expected = quantize_format.quantize_spec(x, bits, group_size, stats_dtype, 9, 1 << 40)
            stored = quantize_format.quantize_reference(x, bits, group_size, stats_dtype, 9, 1 << 40)
            for a, e in zip(stored, expected):
                assert_same_bits(a, e)
            args = (*expected, x.numel(), bits, group_size, dtype)
            assert_same_bits(quantize_format.dequantize_reference(*args), quantize_format.dequantize_spec(*args))


def test_fast_path_allocates_its_output_and_chunk_sized_buffers_only():
    """Issue #17: encode temporaries dominated the CPU peak of small models. A 4 Mi-element float32 encode
    allocates its payload and statistics, buffers of 8 bytes per chunk element, and temporaries of a few words
    per group (per-chunk statistics, the check for non-finite groups): nothing of the tensor's size (16 MiB; the
    specification allocates hundreds of MiB here). Every allocation counts, freed or not."""
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(1 << 22)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        payload, mn, step = quantize_format.quantize_reference(x, 4, 256, torch.float32, 0, 0)
    allocated = sum(max(0, e.self_cpu_memory_usage) for e in prof.events())
    outputs = payload.numel() + 4 * (mn.numel() + step.numel())
    chunk = quantize_format.chunk_elements(x.device)
    assert outputs <= allocated <= outputs + 8 * chunk + 64 * mn.numel() + (1 << 20)
