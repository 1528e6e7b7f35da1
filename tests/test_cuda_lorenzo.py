"""The CUDA lorenzo kernels, run on CPU threads by the emulation harness, against the torch specification.

Bit for bit: headers, payload bytes, escape indices and values, decoded tensors, NaN encodings included. Every
block mode (raw, Lorenzo, sparse, all-zero), every dtype the kernels take (float64 runs the torch path),
escapes of every kind."""
import pytest
import torch

import lightning_act.cuda.launcher as launcher
import lightning_act.cuda.lorenzo as cuda_lorenzo
import lightning_act.formats.lorenzo as spec
from lightning_act.codecs.lorenzo import LorenzoCodec
from lightning_act.cuda.launcher import use_runner
from lightning_act.cuda.lorenzo import KERNEL_DTYPES, lorenzo_decode_cuda, lorenzo_encode_cuda
from lightning_act.formats.lorenzo import (
    MODE_LORENZO,
    MODE_RAW,
    MODE_SPARSE,
    block_sizes,
    lorenzo_decode_reference,
    lorenzo_encode_reference,
    working_bound,
)
from tests.cuda_emulation.checks import assert_refused_before_launch, assert_same_bits, check_lorenzo, lorenzo_data
from tests.cuda_emulation.emulator import EmulatorRunner, requires_gxx
from tests.cuda_emulation.nan_payloads import INT_VIEW, nan_payload_groups

DTYPES = list(KERNEL_DTYPES)


@pytest.mark.parametrize("n", [1, 31, 33, 1000])
@pytest.mark.parametrize("kind", ["noise", "smooth", "relu", "zeros", "mixed"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("error_bound", [1e-1, 1e-3, 1e-5])
@pytest.mark.toolchain
@requires_gxx
def test_random_tensors_bit_identical(runner, error_bound, dtype, kind, n):
    check_lorenzo(runner, lorenzo_data(kind, n).to(dtype), error_bound)


@pytest.mark.toolchain
@requires_gxx
def test_every_mode_appears_and_matches(runner):
    modes = block_sizes(check_lorenzo(runner, lorenzo_data("mixed", 3000), 1e-3)["header"])[3]
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
    check_lorenzo(runner, _special(case, dtype, 1e-2), 1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.toolchain
@requires_gxx
def test_nan_payloads_come_back_bit_for_bit(runner, dtype):
    """NaNs of every encoding and +-Inf escape: the kernels store and scatter back their raw bits, as the spec."""
    x = nan_payload_groups(dtype, 32, tail=7)
    expected = check_lorenzo(runner, x, 1e-2)
    decoded = lorenzo_decode_cuda(expected, x.numel(), 1e-2, dtype, runner=runner)
    bad = ~x.isfinite()
    assert torch.equal(decoded.view(INT_VIEW[dtype])[bad], x.view(INT_VIEW[dtype])[bad])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.toolchain
@requires_gxx
def test_bound_beyond_float32_range_is_capped_alike(runner, dtype):
    x = _special("non_finite", torch.float32, 1e-2) * 1e37
    check_lorenzo(runner, x.to(dtype), 1e39)


@pytest.mark.toolchain
@requires_gxx
def test_lorenzo_blocks_with_lead_values_of_1_to_4_bytes(runner):
    header = check_lorenzo(runner, _special("lead_bytes", torch.float32, 1e-2), 1e-2)["header"]
    _, _, _, mode, _, lead = block_sizes(header)
    assert set(lead[mode == MODE_LORENZO].tolist()) == {1, 2, 3, 4}


@pytest.mark.toolchain
@requires_gxx
def test_grid_stride_loops_cover_blocks_beyond_the_grid(runner, monkeypatch):
    monkeypatch.setattr(launcher, "MAX_BLOCKS", 2)
    runner.launches.clear()
    check_lorenzo(runner, _special("non_finite", torch.float32, 1e-2).repeat(3), 1e-2)  # 66 blocks
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
def test_codec_on_the_kernel_path_equals_the_torch_codec(runner, kind):
    """LorenzoCodec through the kernels == through torch, for a strided input and for the raw fallback (noise
    at a tiny bound does not compress)."""
    x = lorenzo_data(kind, 2 * 600).view(20, 60)[:, ::2]
    bound = 1e-3 if kind == "smooth" else 1e-7
    with use_runner(runner):  # the emulator stands in for the GPU
        kernel_packed = LorenzoCodec(error_bound=bound, backend="cupy").encode(x)
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
    """Encode and decode ask for the kernels with the tensor's dtype: float64 takes the torch path, whatever the
    backend (the emulator stands in for the GPU: backend="cupy" sends the CPU tensors to its kernels)."""
    runner.launches.clear()
    x = lorenzo_data("mixed", 500).to(dtype)
    with use_runner(runner):
        codec = LorenzoCodec(error_bound=1e-3, backend="cupy")
        decoded = codec.decode(codec.encode(x))
    kernels = dtype != torch.float64
    assert codec.kernels_take(dtype) is kernels
    assert {launch[0] for launch in runner.launches} == ({"lorenzo.cu"} if kernels else set())
    torch_codec = LorenzoCodec(error_bound=1e-3, backend="torch")
    assert_same_bits(decoded, torch_codec.decode(torch_codec.encode(x)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.toolchain
@requires_gxx
def test_header_pass_matches_the_specification_block_by_block(runner, dtype):
    """The first encode kernel alone: headers, payload sizes and escape counts per block, against the spec's
    prequantize / encode_blocks / block_sizes (a failure here names the block before the payload is involved)."""
    x = torch.cat([lorenzo_data("mixed", 900), _special("non_finite", torch.float32, 1e-2)]).to(dtype)[:1599]
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
    for x in (_special("non_finite", torch.float16, 1e-2), lorenzo_data("mixed", 700)):
        check_lorenzo(runner, x, 1e-2)


@pytest.mark.toolchain
@requires_gxx
def test_header_only_tensors_skip_the_payload_pass(runner):
    """All codes zero and nothing escaping (zeros and |x| <= eb): no payload, no escapes, one encode kernel."""
    eb = working_bound(1e-2)[0]
    x = torch.tensor([0.0, -0.0, eb, -eb, eb / 2] * 20, dtype=torch.float32)
    runner.launches.clear()
    encoded = check_lorenzo(runner, x, 1e-2)
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

    codec = act.codecs.get("lorenzo", **act.ACTConfig(codec="lorenzo", error_bound=1e-3, backend="torch").codec_kwargs())
    assert (codec.backend, codec.error_bound) == ("torch", 1e-3)
    with pytest.raises(ValueError, match="backend='gpu'"):
        LorenzoCodec(error_bound=1e-3, backend="gpu")
