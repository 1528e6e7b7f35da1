"""The CUDA division kernels, run on CPU threads by the emulation harness, against the torch specification.

Bit for bit: block means, payload bytes, statistics and decoded tensors, NaN encodings included (zero statistics
compare by value, as in test_cuda_quantize)."""
import pytest
import torch

import lightning_act.cuda.division as cuda_division
import lightning_act.cuda.launcher as launcher
from lightning_act.codecs.division import DivisionCodec
from lightning_act.cuda.division import division_decode_cuda, division_encode_cuda
from lightning_act.cuda.launcher import OneBuffer, use_runner
from tests.cuda_emulation.checks import DTYPES, assert_refused_before_launch, assert_same_bits, check_division
from tests.cuda_emulation.emulator import EmulatorRunner, requires_gxx
from tests.cuda_emulation.nan_payloads import GROUPS, nan_payload_groups
from tests.host_path import RecordingRunner, recorded_ops

BITS = [1, 2, 4, 8]


# planes x spatial: 1D rows, 2D maps, 3D volumes; spatial smaller than, not divisible by, equal to the block;
# a plane of one element; planes whose packed codes share a byte (9 * 2 bits)
SHAPES = [(1, 1), (3, 9), (2, 100), (4, 3, 3), (2, 17, 13), (3, 8, 16), (2, 3, 9, 11), (1, 4, 5, 2)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.toolchain
@requires_gxx
def test_random_tensors_bit_identical(runner, bits, dtype, shape):
    torch.manual_seed(bits + len(shape))
    x = (torch.randn(shape) * 3 + 1).to(dtype)
    check_division(runner, x, 8, bits)


@pytest.mark.parametrize("block", [1, 2, 3, 5])
@pytest.mark.toolchain
@requires_gxx
def test_block_sizes(runner, block):
    torch.manual_seed(block)
    check_division(runner, torch.randn(3, 11, 7), block, 2)


def _special(case: str) -> torch.Tensor:
    torch.manual_seed(0)
    x = torch.randn(4, 12, 12)
    if case == "constant":
        return torch.full((4, 12, 12), 0.3)
    if case == "signed_zeros":  # block sums of -0.0 and +0.0 padding: the sign depends on the order of adds
        x = torch.zeros(4, 12, 12)
        x[:2] = -0.0
        x[1, :, 5] = 1.0
    elif case == "nan":
        x[1, 3, 4] = float("nan")
    elif case == "inf":
        x[2, 0, 0], x[3, 11, 11] = float("inf"), float("-inf")
    elif case == "huge":
        x = x * 1.5e38
    elif case == "tiny":
        x = x * 1e-42
    return x


@pytest.mark.parametrize("case", ["constant", "signed_zeros", "nan", "inf", "huge", "tiny"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.toolchain
@requires_gxx
def test_special_values_bit_identical(runner, dtype, case):
    check_division(runner, _special(case).to(dtype), 8, 2)


@pytest.mark.parametrize("spatial", [(32,), (4, 8), (2, 4, 4)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.toolchain
@requires_gxx
def test_nan_payloads_store_the_same_bits(runner, dtype, spatial):
    """Planes holding NaNs of every encoding and +-Inf mixes: block means, statistics and decode carry the spec's
    NaN bits (blocks of 3 put a NaN first in some sums and later in others)."""
    check_division(runner, nan_payload_groups(dtype, 32).view(GROUPS, *spatial), 3, 2)


@pytest.mark.toolchain
@requires_gxx
def test_grid_stride_loops_cover_work_beyond_the_grid(runner, monkeypatch):
    monkeypatch.setattr(launcher, "MAX_BLOCKS", 2)
    runner.launches.clear()
    check_division(runner, torch.randn(6, 96, 64), 8, 4)  # 6 planes: a block each
    assert {launch[2] for launch in runner.launches} == {(2, 1, 1)}


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("shape", [(9, 3), (7, 5), (5, 2, 7), (3, 13)], ids=str)
@pytest.mark.toolchain
@requires_gxx
def test_planes_sharing_payload_bytes(runner, shape, bits):
    """Planes whose codes do not end on a chunk of 8 elements: a chunk's bytes hold codes of two or more planes,
    each written by its own block with masked swaps, and the payload's last byte is padded with zero codes."""
    torch.manual_seed(bits)
    check_division(runner, torch.randn(shape) * 2, 2, bits)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.toolchain
@requires_gxx
def test_plane_too_big_to_stage_is_read_from_global_memory(runner, dtype):
    """A plane beyond the shared-memory stage (launcher.STAGE_MAX elements): every phase reads it from global
    memory instead, with the same bits."""
    torch.manual_seed(3)
    x = (torch.randn(2, 111, 113) * 3).to(dtype)
    assert x[0].numel() > cuda_division.STAGE_MAX
    runner.launches.clear()
    check_division(runner, x, 8, 2)
    assert [(launch[1], launch[5]) for launch in runner.launches] == [("division_encode", 0), ("division_decode", 0)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.toolchain
@requires_gxx
def test_unaligned_input_takes_the_element_path(runner, dtype):
    """An input view that does not start on 16 bytes: planes are staged element by element."""
    x = (torch.randn(4 * 64 + 1) * 2).to(dtype)[1:].view(4, 8, 8)
    assert x.data_ptr() % 16
    check_division(runner, x, 8, 4)


@pytest.mark.parametrize("planes, plane, expected", [
    (6, 100, ((6, 1, 1), (32, 1, 1))),             # a warp for a plane of up to 256 elements
    (6, 768, ((6, 1, 1), (96, 1, 1))),             # a thread per 8 elements
    (10**6, 56 * 56, ((132 * 4, 1, 1), (256, 1, 1))),  # at most 256 threads; one wave: 4 blocks on each of 132 SMs
    (10**6, 49, ((132 * 32, 1, 1), (32, 1, 1))),
])
def test_launch_configuration(planes, plane, expected):
    assert cuda_division._launch_config(planes, plane, 132) == expected


@pytest.mark.parametrize("shape", [(2, 3, 10, 12), (6, 50), (1,), (3, 1, 40, 40)], ids=str)
@pytest.mark.toolchain
@requires_gxx
def test_codec_on_the_kernel_path_equals_the_torch_codec(runner, shape):
    """DivisionCodec through the kernels (layout, reshape, buffers) == through torch, also for a strided input."""
    torch.manual_seed(1)
    x = torch.randn(*shape[:-1], shape[-1] * 2)[..., ::2]  # non-contiguous
    with use_runner(runner):  # the emulator stands in for the GPU
        kernel_packed = DivisionCodec(bits=2, backend="cupy").encode(x, key=5)
    torch_codec = DivisionCodec(bits=2, backend="torch")
    torch_packed = torch_codec.encode(x, key=5)
    assert kernel_packed.nbytes == torch_packed.nbytes
    for name, buffer in torch_packed.buffers.items():
        assert_same_bits(kernel_packed.buffers[name].reshape(buffer.shape), buffer, zero_sign_free=name != "payload")
    assert_same_bits(torch_codec.decode(kernel_packed), torch_codec.decode(torch_packed))


def test_empty_tensor_launches_nothing():
    runner = EmulatorRunner()
    lfc, payload, mn, step = division_encode_cuda(torch.empty(0, 8), 8, 2, 0, 0, runner=runner)
    assert lfc.numel() == payload.numel() == mn.numel() == step.numel() == 0
    assert division_decode_cuda(lfc, payload, mn, step, 0, (8,), 8, 2, torch.float32, runner=runner).numel() == 0
    assert runner.launches == []


@pytest.mark.parametrize("call, match", [
    (lambda r: division_encode_cuda(torch.randn(8, 4).t(), 8, 2, 0, 0, runner=r),
     r"x must be contiguous; got strides \(1, 4\)"),
    (lambda r: division_encode_cuda(torch.ones(2, 8, dtype=torch.int32), 8, 2, 0, 0, runner=r),
     r"x must have dtype in \(torch.float32, torch.float16, torch.bfloat16, torch.float64\); got torch.int32"),
    (lambda r: division_encode_cuda(torch.randn(2, 8), 8, 3, 0, 0, runner=r),
     r"bits=3; the CUDA kernels take one of 1, 2, 4, 8"),
    (lambda r: division_encode_cuda(torch.randn(2, 8), 0, 2, 0, 0, runner=r), r"block=0; expected an int >= 1"),
    (lambda r: division_encode_cuda(torch.randn(8), 8, 2, 0, 0, runner=r),
     r"x must be planes x spatial \(2 to 4 dims\); got shape \(8,\)"),
    (lambda r: division_encode_cuda(torch.randn(2, 2, 2, 2, 2), 8, 2, 0, 0, runner=r),
     r"spatial=\(2, 2, 2, 2\); expected 1 to 3 sizes >= 1"),
    (lambda r: division_encode_cuda(torch.randn(2, 8, device="meta"), 8, 2, 0, 0, runner=r),
     r"tensors must be on a cpu device for EmulatorRunner; got meta"),
    (lambda r: division_decode_cuda(torch.empty(1, 1, dtype=torch.bfloat16), torch.empty(2, dtype=torch.uint8),
                                    torch.empty(1, dtype=torch.bfloat16), torch.empty(1), 1, (8,), 8, 2,
                                    torch.float32, runner=r),
     r"step must have dtype in \(torch.bfloat16\); got torch.float32"),
    (lambda r: division_decode_cuda(torch.empty(1, 1, dtype=torch.bfloat16), torch.empty(3, dtype=torch.uint8),
                                    torch.empty(1, dtype=torch.bfloat16), torch.empty(1, dtype=torch.bfloat16), 1,
                                    (8,), 8, 2, torch.float32, runner=r),
     r"payload must have 2 elements; got 3"),
])
def test_bad_arguments_are_refused_before_launch(call, match):
    assert_refused_before_launch(call, match)


def test_codec_kernel_path_is_one_allocation_and_one_launch_each_way():
    """The codec's encode on the kernel path allocates its form once (a OneBuffer) and launches once; its decode
    allocates the output and launches once: no view, copy or other op, for a contiguous input."""
    runner = RecordingRunner()
    x = torch.randn(2, 3, 10, 12)
    with use_runner(runner):
        codec = DivisionCodec(backend="cupy")
        with recorded_ops() as encode:
            packed = codec.encode(x, key=2)
        with recorded_ops() as decode:
            out = codec.decode(packed)
    assert encode.ops == ["empty.memory_format"] and decode.ops == ["empty.memory_format"]
    assert runner.kernels == ["division_encode", "division_decode"]
    assert type(packed.buffers) is OneBuffer and (out.shape, out.dtype) == (x.shape, x.dtype)
    # lfc (6 planes x 2 x 2 blocks), payload (720 2-bit codes), mn and step: bfloat16 but the payload
    assert packed.nbytes == packed.buffers.layout.nbytes == 6 * 4 * 2 + 720 * 2 // 8 + 2 * 6 * 2


def test_plans_are_built_once_per_format_dtype_and_size():
    """Encode and decode of one size share one plan, built at the first encode; another size or dtype builds
    another."""
    cuda_division._plan.cache_clear()
    with use_runner(RecordingRunner()):
        codec = DivisionCodec(backend="cupy")
        for key in range(3):
            codec.decode(codec.encode(torch.randn(4, 8, 8), key=key))
        assert cuda_division._plan.cache_info()[:2] == (5, 1)  # (hits, misses)
        codec.decode(codec.encode(torch.randn(4, 8, 9)))
        codec.decode(codec.encode(torch.randn(4, 8, 8, dtype=torch.float16)))
    assert cuda_division._plan.cache_info()[:2] == (7, 3)


def test_codec_refuses_a_plane_the_kernels_cannot_take():
    """The hot path skips the argument checks, not the layout's: a plane of 2**31 elements raises ValueError
    naming it (the meta device stands in for a GPU's memory)."""
    class MetaRunner(RecordingRunner):
        device_type = "meta"

    with use_runner(MetaRunner()):
        codec = DivisionCodec(backend="cupy")
        with pytest.raises(ValueError, match=r"spatial=\(2147483648,\); the CUDA kernels take planes of fewer"):
            codec.encode(torch.empty(2, 1 << 31, device="meta"))
