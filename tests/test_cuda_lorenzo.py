"""The CUDA lorenzo kernels, run on CPU threads by the emulation harness, against the torch specification.

Bit for bit: headers, payload bytes, escape indices and values, decoded tensors, NaN encodings included. Every
block mode (raw, Lorenzo, sparse, all-zero), every dtype the kernels take (float64 runs the torch path),
escapes of every kind."""
import pytest
import torch

import lightning_act.codecs.lorenzo as spec
import lightning_act.cuda as cuda_pkg
import lightning_act.cuda.lorenzo as cuda_lorenzo
from lightning_act.codecs.lorenzo import (MODE_LORENZO, MODE_RAW, MODE_SPARSE, LorenzoCodec, block_sizes,
                                          lorenzo_decode_reference, lorenzo_encode_reference, working_bound)
from lightning_act.cuda.lorenzo import KERNEL_DTYPES, lorenzo_decode_cuda, lorenzo_encode_cuda
from tests.cuda_emulation.emulator import EmulatorRunner, requires_gxx
from tests.cuda_emulation.nan_payloads import INT_VIEW, nan_payload_groups
from tests.test_cuda_quantize import assert_refused_before_launch, assert_same_bits

DTYPES = list(KERNEL_DTYPES)


@pytest.fixture(scope="module")
def runner():
    return EmulatorRunner()


def check_encode_and_decode(runner, flat, error_bound):
    """Emulated kernels == torch reference: encode buffers, and decode of the reference's encoding."""
    expected = lorenzo_encode_reference(flat, error_bound)
    encoded = lorenzo_encode_cuda(flat.contiguous(), error_bound, runner=runner)
    assert encoded.keys() == expected.keys()
    for name in expected:
        assert_same_bits(encoded[name], expected[name])
    decode_args = (expected, flat.numel(), error_bound, flat.dtype)
    decoded = lorenzo_decode_cuda(*decode_args, runner=runner)
    assert_same_bits(decoded, lorenzo_decode_reference(*decode_args))
    # and the other way round: the torch decode of the kernels' encoding
    assert_same_bits(lorenzo_decode_reference(encoded, flat.numel(), error_bound, flat.dtype), decoded)
    return expected


def _data(kind: str, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(n)
    if kind == "noise":  # raw codes
        return torch.randn(n, generator=gen) * 3
    if kind == "smooth":  # Lorenzo deltas
        return torch.linspace(-3, 5, n) + 0.01 * torch.randn(n, generator=gen)
    if kind == "relu":  # sparse blocks
        return torch.relu(torch.randn(n, generator=gen)) * (torch.rand(n, generator=gen) < 0.15)
    if kind == "zeros":  # header-only blocks
        return torch.zeros(n)
    if kind == "mixed":  # every mode in one tensor
        x = torch.randn(n, generator=gen)
        x[: n // 3] = torch.linspace(0, 1, n // 3)
        x[n // 3: 2 * n // 3] *= torch.rand(2 * n // 3 - n // 3, generator=gen) < 0.1
        return x
    raise ValueError(kind)


@pytest.mark.parametrize("n", [1, 31, 33, 1000])
@pytest.mark.parametrize("kind", ["noise", "smooth", "relu", "zeros", "mixed"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("error_bound", [1e-1, 1e-3, 1e-5])
@pytest.mark.toolchain
@requires_gxx
def test_random_tensors_bit_identical(runner, error_bound, dtype, kind, n):
    check_encode_and_decode(runner, _data(kind, n).to(dtype), error_bound)


@pytest.mark.toolchain
@requires_gxx
def test_every_mode_appears_and_matches(runner):
    modes = block_sizes(check_encode_and_decode(runner, _data("mixed", 3000), 1e-3)["header"])[3]
    assert {MODE_RAW, MODE_LORENZO, MODE_SPARSE} <= set(modes.tolist())


def _special(case: str, dtype: torch.dtype, error_bound: float) -> torch.Tensor:
    torch.manual_seed(0)
    x = torch.randn(700)
    if case == "non_finite":
        x[::7], x[3::11], x[5::13] = float("nan"), float("inf"), float("-inf")
    elif case == "huge":  # beyond the 2**29 code range: escapes
        x = x * 1e30
    elif case == "signed_zeros":
        x[::2] = -0.0
        x[1::4] = 0.0
    elif case == "at_the_bound":  # |x| == eb, one ulp either side, and the grid's half points
        eb = torch.tensor(error_bound, dtype=torch.float32)
        ladder = torch.stack([eb, torch.nextafter(eb, torch.tensor(0.0)), torch.nextafter(eb, torch.tensor(1.0)),
                              3 * eb, 5 * eb]).repeat(140)
        x = ladder * torch.where(torch.rand(700) < 0.5, -1.0, 1.0)
    elif case == "denormal":
        x = x * 1e-39
    elif case == "lead_bytes":  # Lorenzo blocks of codes q, q + 1, ... whose lead q needs 1, 2, 3 and 4 bytes
        step = working_bound(error_bound)[1]
        leads = torch.tensor([-3, -1000, 40000, 9_000_000]).repeat_interleave(32) + torch.arange(32).repeat(4)
        x = (leads.float() * step).repeat(6)[:700]
    return x.to(dtype)


@pytest.mark.parametrize("case", ["non_finite", "huge", "signed_zeros", "at_the_bound", "denormal", "lead_bytes"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.toolchain
@requires_gxx
def test_special_values_bit_identical(runner, dtype, case):
    check_encode_and_decode(runner, _special(case, dtype, 1e-2), 1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.toolchain
@requires_gxx
def test_nan_payloads_come_back_bit_for_bit(runner, dtype):
    """NaNs of every encoding and +-Inf escape: the kernels store and scatter back their raw bits, as the spec."""
    x = nan_payload_groups(dtype, 32, tail=7)
    expected = check_encode_and_decode(runner, x, 1e-2)
    decoded = lorenzo_decode_cuda(expected, x.numel(), 1e-2, dtype, runner=runner)
    bad = ~x.isfinite()
    assert torch.equal(decoded.view(INT_VIEW[dtype])[bad], x.view(INT_VIEW[dtype])[bad])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.toolchain
@requires_gxx
def test_bound_beyond_float32_range_is_capped_alike(runner, dtype):
    x = _special("non_finite", torch.float32, 1e-2) * 1e37
    check_encode_and_decode(runner, x.to(dtype), 1e39)


@pytest.mark.toolchain
@requires_gxx
def test_lorenzo_blocks_with_lead_values_of_1_to_4_bytes(runner):
    header = check_encode_and_decode(runner, _special("lead_bytes", torch.float32, 1e-2), 1e-2)["header"]
    _, _, _, mode, _, lead = block_sizes(header)
    assert set(lead[mode == MODE_LORENZO].tolist()) == {1, 2, 3, 4}


@pytest.mark.toolchain
@requires_gxx
def test_grid_stride_loops_cover_blocks_beyond_the_grid(runner, monkeypatch):
    monkeypatch.setattr(cuda_lorenzo, "MAX_BLOCKS", 2)
    runner.launches.clear()
    check_encode_and_decode(runner, _special("non_finite", torch.float32, 1e-2).repeat(3), 1e-2)  # 66 blocks
    assert {launch[2] for launch in runner.launches} == {(2, 1, 1)}


@pytest.mark.toolchain
@requires_gxx
def test_escape_indices_are_64_bit_past_2_31_elements(runner, monkeypatch):
    """The index dtype switches at 2**31 elements; the kernels write and read whichever the launcher picks."""
    monkeypatch.setattr(cuda_lorenzo, "index_dtype", lambda numel: torch.int64)
    x = _special("non_finite", torch.float32, 1e-2)
    encoded = lorenzo_encode_cuda(x, 1e-2, runner=runner)
    expected = lorenzo_encode_reference(x, 1e-2)
    assert encoded["escape_index"].dtype == torch.int64
    assert torch.equal(encoded["escape_index"], expected["escape_index"].to(torch.int64))
    encoded["escape_index"] = expected["escape_index"].to(torch.int64)
    assert_same_bits(lorenzo_decode_cuda(encoded, x.numel(), 1e-2, x.dtype, runner=runner),
                     lorenzo_decode_reference(expected, x.numel(), 1e-2, x.dtype))


@pytest.mark.parametrize("kind", ["smooth", "noise"])
@pytest.mark.toolchain
@requires_gxx
def test_codec_on_the_kernel_path_equals_the_torch_codec(runner, monkeypatch, kind):
    """LorenzoCodec through the kernels == through torch, for a strided input and for the raw fallback (noise
    at a tiny bound does not compress)."""
    monkeypatch.setattr(cuda_lorenzo, "default_runner", lambda: runner)
    monkeypatch.setattr(LorenzoCodec, "_use_cupy", lambda self, t: True)
    x = _data(kind, 2 * 600).view(20, 60)[:, ::2]
    bound = 1e-3 if kind == "smooth" else 1e-7
    kernel_packed = LorenzoCodec(error_bound=bound).encode(x)
    monkeypatch.undo()
    torch_codec = LorenzoCodec(error_bound=bound, backend="torch")
    torch_packed = torch_codec.encode(x)
    assert kernel_packed.buffers.keys() == torch_packed.buffers.keys()
    assert ("raw" in torch_packed.buffers) == (kind == "noise")
    for name, buffer in torch_packed.buffers.items():
        assert_same_bits(kernel_packed.buffers[name], buffer)
    assert_same_bits(torch_codec.decode(kernel_packed), torch_codec.decode(torch_packed))


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64], ids=str)
@pytest.mark.toolchain
@requires_gxx
def test_codec_runs_the_kernels_for_their_dtypes_and_torch_for_float64(runner, monkeypatch, dtype):
    """Encode and decode ask for the kernels with the tensor's dtype: float64 takes the torch path (as if on a
    CUDA tensor with CuPy, whatever the backend: ``use_cupy_kernels`` is told the format is unsupported)."""
    asked = []

    def use_cupy_kernels(backend, t, supported=True):
        asked.append(supported)
        return supported

    monkeypatch.setattr(cuda_pkg, "use_cupy_kernels", use_cupy_kernels)
    monkeypatch.setattr(cuda_pkg, "require_cupy", lambda: None)
    monkeypatch.setattr(cuda_lorenzo, "default_runner", lambda: runner)
    runner.launches.clear()
    x = _data("mixed", 500).to(dtype)
    codec = LorenzoCodec(error_bound=1e-3, backend="cupy")
    decoded = codec.decode(codec.encode(x))
    kernels = dtype != torch.float64
    assert asked == [kernels, kernels]
    assert {launch[0] for launch in runner.launches} == ({"lorenzo.cu"} if kernels else set())
    monkeypatch.undo()
    torch_codec = LorenzoCodec(error_bound=1e-3, backend="torch")
    assert_same_bits(decoded, torch_codec.decode(torch_codec.encode(x)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.toolchain
@requires_gxx
def test_header_pass_matches_the_specification_block_by_block(runner, dtype):
    """The first encode kernel alone: headers, payload sizes and escape counts per block, against the spec's
    prequantize / encode_blocks / block_sizes (a failure here names the block before the payload is involved)."""
    x = torch.cat([_data("mixed", 900), _special("non_finite", torch.float32, 1e-2)]).to(dtype)[:1599]
    header, sizes, escape_counts = cuda_lorenzo.lorenzo_header_pass(x, 1e-2, runner=runner)
    q, escape = spec.prequantize(x, *working_bound(1e-2))
    expected_header, _ = spec.encode_blocks(q)
    assert_same_bits(header, expected_header)
    assert torch.equal(sizes.long(), block_sizes(expected_header)[0])
    padded = torch.cat([escape, escape.new_zeros(-x.numel() % spec.BLOCK)])
    assert torch.equal(escape_counts.long(), padded.view(-1, spec.BLOCK).sum(dim=1))
    assert int(escape_counts.sum()) > 0 and set(block_sizes(header)[3].tolist()) >= {MODE_RAW, MODE_SPARSE}


@pytest.mark.toolchain
@requires_gxx
def test_chunked_reference_equals_the_unchunked_kernels(runner, monkeypatch):
    """The reference encodes and decodes chunk by chunk (CHUNK_ELEMENTS, a multiple of the block); the kernels
    run over the whole tensor: escape indices, block offsets and payloads must agree across chunk borders."""
    monkeypatch.setattr(spec, "CHUNK_ELEMENTS", 2 * spec.BLOCK)
    assert len(spec._split_chunks(700)) == 11
    for x in (_special("non_finite", torch.float16, 1e-2), _data("mixed", 700)):
        check_encode_and_decode(runner, x, 1e-2)


@pytest.mark.toolchain
@requires_gxx
def test_header_only_tensors_skip_the_payload_pass(runner):
    """All codes zero and nothing escaping (zeros and |x| <= eb): no payload, no escapes, one encode kernel."""
    eb = working_bound(1e-2)[0]
    x = torch.tensor([0.0, -0.0, eb, -eb, eb / 2] * 20, dtype=torch.float32)
    runner.launches.clear()
    encoded = check_encode_and_decode(runner, x, 1e-2)
    assert encoded["payload"].numel() == encoded["escape_index"].numel() == 0
    assert [launch[1] for launch in runner.launches] == ["lorenzo_header", "lorenzo_decode"]


def test_empty_tensor_launches_nothing():
    runner = EmulatorRunner()
    encoded = lorenzo_encode_cuda(torch.empty(0, dtype=torch.float16), 1e-2, runner=runner)
    expected = lorenzo_encode_reference(torch.empty(0, dtype=torch.float16), 1e-2)
    assert {k: (v.dtype, v.numel()) for k, v in encoded.items()} == {k: (v.dtype, v.numel())
                                                                     for k, v in expected.items()}
    assert lorenzo_decode_cuda(encoded, 0, 1e-2, torch.float16, runner=runner).numel() == 0
    assert runner.launches == []


def _buffers(**changes):
    buffers = lorenzo_encode_reference(torch.linspace(0, 1, 64), 1e-2)
    return {**buffers, **changes}


@pytest.mark.parametrize("call, match", [
    (lambda r: lorenzo_encode_cuda(torch.randn(8, 4).t().reshape(-1)[::2], 1e-2, runner=r),
     r"flat must be contiguous; got strides \(2,\)"),
    (lambda r: lorenzo_encode_cuda(torch.randn(8, dtype=torch.float64), 1e-2, runner=r),
     r"flat must have dtype in \(torch.float32, torch.float16, torch.bfloat16\); got torch.float64"),
    (lambda r: lorenzo_encode_cuda(torch.randn(2, 8), 1e-2, runner=r), r"flat must be 1-dimensional; got shape \(2, 8\)"),
    (lambda r: lorenzo_encode_cuda(torch.randn(8, device="meta"), 1e-2, runner=r),
     r"tensors must be on a cpu device for EmulatorRunner; got meta"),
    (lambda r: lorenzo_decode_cuda(_buffers(), 65, 1e-2, torch.float32, runner=r), r"header must have 3 elements; got 2"),
    (lambda r: lorenzo_decode_cuda(_buffers(payload=torch.zeros(1, dtype=torch.uint8)), 64, 1e-2, torch.float32,
                                   runner=r), r"payload must have \d+ elements; got 1"),
    (lambda r: lorenzo_decode_cuda(_buffers(), 64, 1e-2, torch.float16, runner=r),
     r"escape_value must have dtype in \(torch.float16\); got torch.float32"),
    (lambda r: lorenzo_decode_cuda(_buffers(), 64, 1e-2, torch.int32, runner=r),
     r"dtype=torch.int32; expected one of torch.float32, torch.float16, torch.bfloat16"),
])
def test_bad_arguments_are_refused_before_launch(call, match):
    assert_refused_before_launch(call, match)


def test_config_passes_the_backend_and_bad_backends_are_named():
    import lightning_act as act

    codec = act.codecs.get("lorenzo", **act.ACTConfig(codec="lorenzo", error_bound=1e-3, backend="torch").codec_options())
    assert (codec.backend, codec.error_bound) == ("torch", 1e-3)
    with pytest.raises(ValueError, match="backend='gpu'"):
        LorenzoCodec(error_bound=1e-3, backend="gpu")
