"""The CUDA mask kernels (``masks.cu``: ``bitmask``, ``positive_mask``, ``scaled_mask``), run on CPU threads by the
emulation harness, against the torch path of the same codecs, bit for bit: the stored bytes, the scale, and the
decoded tensors viewed as integers (NaN payloads included), for every dtype the codecs take, odd sizes, views at
odd offsets and non-contiguous inputs; then the launch and allocation counts of the codecs' kernel path."""
import itertools
import types

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import lightning_act as act
import lightning_act.cuda as cuda_pkg
import lightning_act.cuda.launcher as launcher
import lightning_act.cuda.masks as cuda_masks
from lightning_act.codecs.bitmask import BitmaskCodec
from lightning_act.codecs.masks import PositiveMaskCodec, ScaledMaskCodec
from lightning_act.cuda.launcher import use_runner
from lightning_act.cuda.masks import mask_decode_cuda, mask_encode_cuda
from lightning_act.formats._bitpack import pack_bits, unpack_bits
from tests.cuda_emulation.checks import DTYPES, assert_refused_before_launch, assert_same_bits
from tests.cuda_emulation.emulator import EmulatorRunner, requires_gxx
from tests.cuda_emulation.nan_payloads import INT_VIEW, nan_tensor

# the codecs as the engine builds them: the dropout rule's scaled_mask skips the verification
CODECS = {
    "bitmask": dict(name="bitmask"),
    "positive_mask": dict(name="positive_mask"),
    "scaled_mask": dict(name="scaled_mask"),
    "scaled_mask unchecked": dict(name="scaled_mask", check=False),
}
# one element, fewer than a byte, a word, a tile (256) and a block iteration (8 tiles); none a multiple of 8 but 8,
# 256 and 4096
SIZES = [0, 1, 7, 8, 33, 255, 256, 257, 1000, 4096, 4099]


def _codec(codec: str, backend: str):
    options = dict(CODECS[codec])
    return act.codecs.get(options.pop("name"), backend=backend, **options)


def _input(codec: str, shape, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """What the codec is made for: a bool mask, a ReLU input (signs), dropout noise (0 or one value)."""
    gen = torch.Generator().manual_seed(seed)
    if codec == "bitmask":
        return torch.rand(shape, generator=gen) < 0.4
    if codec == "positive_mask":
        return torch.randn(shape, generator=gen).to(dtype)
    return (torch.rand(shape, generator=gen) < 0.7).to(dtype) * torch.tensor(1 / 0.7).to(dtype)


def _dtypes(codec: str):
    return [torch.bool] if codec == "bitmask" else DTYPES


def check_codec(runner, codec: str, x: torch.Tensor):
    """The kernel path (emulated) stores what the torch path stores, and each decodes the other's encoding into the
    same bits; returns the kernel path's encoding."""
    reference = _codec(codec, "torch")
    expected = reference.encode(x)
    with use_runner(runner):  # backend="cupy" needs CuPy unless a runner stands in
        kernels = _codec(codec, "cupy")
        packed = kernels.encode(x)
        decoded = kernels.decode(packed)
        decoded_reference = kernels.decode(expected)
    assert packed.buffers.keys() == expected.buffers.keys()
    for name, buffer in expected.buffers.items():
        assert_same_bits(packed.buffers[name], buffer)
    assert packed.nbytes == expected.nbytes
    truth = reference.decode(expected)
    assert decoded.shape == x.shape and decoded.is_contiguous()
    assert_same_bits(decoded, truth)
    assert_same_bits(decoded_reference, truth)
    assert_same_bits(reference.decode(packed), truth)
    return packed


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("codec, dtype", [(c, d) for c in CODECS for d in _dtypes(c)], ids=str)
@pytest.mark.toolchain
@requires_gxx
def test_codecs_store_and_decode_the_torch_paths_bits(runner, codec, dtype, size):
    runner.launches.clear()
    check_codec(runner, codec, _input(codec, (size,), dtype, seed=size))
    kernels = [launch[1] for launch in runner.launches]
    # encode and decode of the kernels' encoding, decode of the torch path's: none for an empty tensor
    assert kernels == ([] if size == 0 else ["mask_encode", "mask_decode", "mask_decode"])


@pytest.mark.parametrize("layout", ["transposed", "channels_last", "odd offset", "expanded", "0-dim"])
@pytest.mark.parametrize("codec, dtype", [(c, d) for c in CODECS for d in _dtypes(c)], ids=str)
@pytest.mark.toolchain
@requires_gxx
def test_views_and_layouts(runner, codec, dtype, layout):
    """What a codec may be handed: non-contiguous views (the codec reads them through a contiguous copy), a
    contiguous view whose data starts at an odd element (a chunk of a split: no 16-byte alignment), a 0-dim
    tensor."""
    if layout == "transposed":
        x = _input(codec, (37, 9), dtype).t()
    elif layout == "channels_last":
        x = _input(codec, (2, 5, 7, 3), dtype).contiguous(memory_format=torch.channels_last)
    elif layout == "odd offset":
        x = _input(codec, (301,), dtype)[3:]
        assert x.data_ptr() % 16
    elif layout == "expanded":
        x = _input(codec, (1, 45), dtype).expand(3, 45)
    else:
        x = _input(codec, (), dtype, seed=3)
    check_codec(runner, codec, x)


def _special_floats(dtype: torch.dtype) -> torch.Tensor:
    """Zeros of both signs, infinities, NaNs of every encoding, the smallest subnormals, the largest finite values
    and random values, shuffled, of an odd length."""
    info = torch.finfo(dtype)
    values = [0.0, -0.0, float("inf"), -float("inf"), info.tiny, -info.tiny, info.max, -info.max, info.eps, 1.0,
              -1.0]
    smallest = torch.tensor(1, dtype=INT_VIEW[dtype]).view(dtype)  # the smallest subnormal: non-zero, positive
    parts = [torch.tensor(values, dtype=dtype), smallest, -smallest, nan_tensor(dtype),
             torch.randn(200, generator=torch.Generator().manual_seed(1)).to(dtype)]
    x = torch.cat([p.reshape(-1) for p in parts])
    return x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(2))]


@pytest.mark.parametrize("positive", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.toolchain
@requires_gxx
def test_special_values_are_flagged_like_torch(runner, dtype, positive):
    """x > 0 and x != 0 on the raw bits: NaN of any sign or payload is non-zero and not positive, -0.0 is zero,
    +inf positive, subnormals non-zero (a float64 subnormal is non-zero although it rounds to a float32 zero)."""
    x = _special_floats(dtype)
    expected = pack_bits(x.gt(0) if positive else x.bool())
    assert_same_bits(mask_encode_cuda(x, positive, runner=runner), expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.toolchain
@requires_gxx
def test_every_16_bit_pattern(runner, dtype):
    x = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    for positive in (False, True):
        assert_same_bits(mask_encode_cuda(x, positive, runner=runner), pack_bits(x.gt(0) if positive else x.bool()))


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8], ids=str)
@pytest.mark.toolchain
@requires_gxx
def test_byte_inputs_are_flagged_non_zero(runner, dtype):
    x = torch.randint(0, 3, (777,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    x = x.bool() if dtype == torch.bool else x * 85  # uint8: any non-zero byte is set
    assert_same_bits(mask_encode_cuda(x, runner=runner), pack_bits(x.bool()))
    decoded = mask_decode_cuda(pack_bits(x.bool()), x.numel(), dtype, runner=runner)
    assert_same_bits(decoded, x.bool().to(dtype))


@pytest.mark.parametrize("scale", [2.5, -0.0, float("inf"), -3.0, "nan"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.toolchain
@requires_gxx
def test_decode_copies_the_scale_bit_for_bit(runner, dtype, scale):
    """Where a bit is set, the device scalar's bits (a NaN payload, -0.0); elsewhere +0.0: torch.where's values."""
    value = nan_tensor(dtype)[3] if scale == "nan" else torch.tensor(scale, dtype=dtype)
    n = 523
    bits = torch.randint(0, 256, ((n + 7) // 8,), generator=torch.Generator().manual_seed(4), dtype=torch.uint8)
    expected = torch.where(unpack_bits(bits, n), value, torch.zeros((), dtype=dtype))
    assert_same_bits(mask_decode_cuda(bits, n, dtype, value, runner=runner), expected)
    assert_same_bits(mask_decode_cuda(bits, n, dtype, runner=runner), unpack_bits(bits, n, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.toolchain
@requires_gxx
def test_unchecked_scaled_mask_of_noise_with_nan_decodes_alike(runner, dtype):
    """check=False takes the maximum without looking (its NaN, when x holds one): both paths store and decode the
    same bits."""
    x = _input("scaled_mask", (300,), dtype)
    x[[5, 77]] = nan_tensor(dtype)[:2]
    check_codec(runner, "scaled_mask unchecked", x)


@pytest.mark.parametrize("offset", [0, 1, 2, 3, 4])
@pytest.mark.toolchain
@requires_gxx
def test_payloads_on_and_off_word_boundaries(runner, offset):
    """A payload that does not start on 4 bytes (decode's input, encode's ``out``) is read and written byte by
    byte (a word access would be misaligned); one that does, by words but for its last, partial word: never a
    byte past its end (102 bytes here)."""
    n = 3 * 256 + 45
    x = torch.randn(n)
    expected = pack_bits(x.gt(0))
    room = torch.full((expected.numel() + 8,), 0xAB, dtype=torch.uint8)
    out = room[offset: offset + expected.numel()]
    mask_encode_cuda(x, True, runner=runner, out=out)
    assert_same_bits(out, expected)
    assert (room[:offset] == 0xAB).all() and (room[offset + expected.numel():] == 0xAB).all()
    assert_same_bits(mask_decode_cuda(out, n, torch.float32, runner=runner), x.gt(0).float())


@pytest.mark.parametrize("size", [1, 9, 4099])
@pytest.mark.toolchain
@requires_gxx
def test_decode_writes_only_its_elements(runner, size):
    room = torch.full((size + 64,), -7.0)
    out = room[1: size + 1]
    bits = pack_bits(torch.rand(size, generator=torch.Generator().manual_seed(size)) < 0.5)
    mask_decode_cuda(bits, size, torch.float32, runner=runner, out=out)
    assert_same_bits(out, unpack_bits(bits, size, dtype=torch.float32))
    assert room[0] == -7.0 and (room[size + 1:] == -7.0).all()


@pytest.mark.parametrize("max_blocks, multiprocessors, blocks", [(1, 132, 1), (2, 132, 2), (None, 1, 8)])
@pytest.mark.toolchain
@requires_gxx
def test_warps_stride_over_tiles_beyond_the_grid(monkeypatch, max_blocks, multiprocessors, blocks):
    """101 tiles, 13 blocks of 8 warps without a bound: one block, two, or one wave of 8 blocks on one SM stride
    over them."""
    runner = EmulatorRunner()
    runner.multiprocessors = lambda device: multiprocessors
    if max_blocks is not None:
        monkeypatch.setattr(launcher, "MAX_BLOCKS", max_blocks)
    n = 100 * 256 + 17
    x = torch.randn(n, dtype=torch.bfloat16)
    bits = mask_encode_cuda(x, True, runner=runner)
    assert_same_bits(bits, pack_bits(x.gt(0)))
    assert_same_bits(mask_decode_cuda(bits, n, torch.bfloat16, runner=runner), x.gt(0).to(torch.bfloat16))
    grids = {launch[2] for launch in runner.launches}
    assert grids == {(blocks, 1, 1)}


@pytest.mark.parametrize("numel, multiprocessors, expected", [
    (1, 132, ((1, 1, 1), (32, 1, 1))),             # a warp for one element
    (300, 132, ((1, 1, 1), (64, 1, 1))),           # two tiles: two warps
    (100_000, 132, ((49, 1, 1), (256, 1, 1))),     # 391 tiles, 8 a block
    (10**9, 132, ((132 * 8, 1, 1), (256, 1, 1))),  # one wave: 8 blocks of 256 threads an SM
    (10**9, 2, ((16, 1, 1), (256, 1, 1))),
])
def test_launch_configuration(numel, multiprocessors, expected):
    assert cuda_masks._config(numel, multiprocessors, launcher.MAX_BLOCKS) == expected


def test_sizes_past_32_bits_are_packed_as_64_bit_arguments():
    plan = cuda_masks._encode_plan(3 << 31, torch.float16, True, 132, launcher.MAX_BLOCKS)
    assert plan.args == (np.int64(3 << 31), np.int32(1), np.int32(1)) and plan.nbytes == 3 << 28
    assert isinstance(plan.args[0], np.int64)


# ---- launches, allocations and host work of the codecs' kernel path ----

class _Ops(TorchDispatchMode):
    """Records the aten ops that run (on a GPU each but views and allocations is a kernel launch)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


class CountingRunner:
    """Counts launches; launches nothing."""

    device_type = "cpu"

    def __init__(self):
        self.kernels = []

    def launch(self, source, kernel, grid, block, args, shared_mem, device):
        self.kernels.append(kernel)


ALLOCATING = {"empty", "new_zeros", "zeros", "empty_like", "new_empty"}
VIEWS = {"view", "reshape", "_reshape_alias", "as_strided", "alias", "detach"}


def _counts(codec: str, x):
    runner = CountingRunner()
    with use_runner(runner):
        codec = _codec(codec, "cupy")
        with _Ops() as encode_ops:
            packed = codec.encode(x)
        encode_kernels = list(runner.kernels)
        runner.kernels.clear()
        with _Ops() as decode_ops:
            codec.decode(packed)
    return (encode_ops.ops, encode_kernels), (decode_ops.ops, runner.kernels)


def _launches(ops, kernels):
    """torch ops that launch a kernel (reductions allocate their output too), and the runner's launches"""
    return [op for op in ops if op not in ALLOCATING | VIEWS] + kernels


def _allocations(ops):
    """allocations: the allocating ops and every op that makes its output (a reduction)"""
    return [op for op in ops if op not in VIEWS]


@pytest.mark.parametrize("codec, dtype, encode_launches", [
    ("bitmask", torch.bool, ["mask_encode"]),
    ("positive_mask", torch.bfloat16, ["mask_encode"]),
    ("scaled_mask unchecked", torch.float32, ["amax", "mask_encode"]),
], ids=lambda v: str(v) if not isinstance(v, list) else "")
def test_kernel_path_launches_and_allocations(codec, dtype, encode_launches):
    """bitmask and positive_mask: one launch and one allocation a direction; the dropout rule's scaled_mask: the
    maximum (a device scalar) and the mask, then one launch to decode. Nothing else runs: no view, copy or
    chunk."""
    x = _input(codec, (4, 257), dtype)
    (encode_ops, encode_kernels), (decode_ops, decode_kernels) = _counts(codec, x)
    assert _launches(encode_ops, encode_kernels) == encode_launches
    assert len(_allocations(encode_ops)) == len(encode_launches)  # the payload (and amax's scalar)
    assert [op for op in encode_ops if op in VIEWS] == []
    assert decode_ops == ["empty"] and decode_kernels == ["mask_decode"]


def test_kernel_path_of_a_huge_tensor_is_one_launch_a_direction():
    """No chunks on the kernel path (the torch path's chunks bound its temporaries; the kernels have none)."""
    from lightning_act.formats.quantize import chunk_elements

    n = 3 * chunk_elements(torch.device("cpu")) + 5
    x = torch.zeros(n)
    (encode_ops, encode_kernels), (decode_ops, decode_kernels) = _counts("scaled_mask unchecked", x)
    assert _launches(encode_ops, encode_kernels) == ["amax", "mask_encode"]
    assert _launches(decode_ops, decode_kernels) == ["mask_decode"]


@pytest.mark.parametrize("codec", ["bitmask", "positive_mask", "scaled_mask unchecked"])
def test_kernel_path_plans_are_built_once_per_size(codec):
    x = _input(codec, (3, 101), torch.float16)
    cuda_masks._encode_plan.cache_clear()
    cuda_masks._decode_plan.cache_clear()
    with use_runner(CountingRunner()):
        kernels = _codec(codec, "cupy")
        for _ in range(3):
            kernels.decode(kernels.encode(x))
    assert cuda_masks._encode_plan.cache_info().misses == cuda_masks._decode_plan.cache_info().misses == 1
    assert cuda_masks._encode_plan.cache_info().hits == cuda_masks._decode_plan.cache_info().hits == 2


# ---- backend choice and the codecs' signatures ----

def _tensor_on(device: str, dtype: torch.dtype):
    """Stands in for a tensor: the backend choice looks only at its device and dtype."""
    return types.SimpleNamespace(device=torch.device(device), is_cuda=device.startswith("cuda"), dtype=dtype)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("backend, device, cupy_importable", itertools.product(
    ["torch", "auto", "cupy"], ["cpu", "cuda:0"], [False, True]))
def test_backend_choice_is_quantizes(monkeypatch, codec, backend, device, cupy_importable):
    """The mask codecs choose kernels or torch exactly as quantize does (tests/test_cuda_quantize.py spells the
    rule out), for every dtype they take."""
    monkeypatch.setattr(cuda_pkg, "cupy_available", lambda: cupy_importable)
    monkeypatch.setattr(cuda_pkg, "require_cupy", lambda: None)
    quantize = act.codecs.get("quantize", backend=backend)
    for dtype in _dtypes(codec):
        t = _tensor_on(device, dtype)
        if backend == "cupy" and device == "cpu":
            with pytest.raises(ValueError, match=r"backend='cupy' runs on CUDA tensors; got a tensor on cpu"):
                _codec(codec, backend).runs_kernels(t)
        else:
            assert _codec(codec, backend).runs_kernels(t) is quantize.runs_kernels(_tensor_on(device, torch.float32))


def test_constructors_keep_their_signatures_and_default_to_auto():
    assert BitmaskCodec().backend == PositiveMaskCodec().backend == ScaledMaskCodec().backend == "auto"
    codec = ScaledMaskCodec(False, False)
    assert (codec.strict, codec.check, codec.backend) == (False, False, "auto")
    assert ScaledMaskCodec(check=False, backend="torch").backend == "torch"
    for cls in (BitmaskCodec, PositiveMaskCodec, ScaledMaskCodec):
        with pytest.raises(ValueError, match=r"backend='gpu'"):
            cls(backend="gpu")
    # the kernels take every dtype the codec takes, nothing else
    assert PositiveMaskCodec().kernels_take(torch.float64) and not PositiveMaskCodec().kernels_take(torch.bool)
    assert BitmaskCodec().kernels_take(torch.bool) and not BitmaskCodec().kernels_take(torch.uint8)


# ---- checks before launch (no toolchain needed: they fail before anything runs) ----

@pytest.mark.parametrize("call, match", [
    (lambda r: mask_encode_cuda(torch.randn(8, 4).t(), runner=r), r"x must be contiguous; got strides \(1, 4\)"),
    (lambda r: mask_encode_cuda(torch.arange(8), runner=r),
     r"x must have dtype in \(torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.bool, "
     r"torch.uint8\); got torch.int64"),
    (lambda r: mask_encode_cuda(torch.ones(8, dtype=torch.bool), True, runner=r),
     r"x must have dtype in \(torch.float32, torch.float16, torch.bfloat16, torch.float64\); got torch.bool"),
    (lambda r: mask_encode_cuda(torch.randn(8), 1, runner=r), r"positive=1; expected True or False"),
    (lambda r: mask_encode_cuda([1.0, 2.0], runner=r), r"x must be a torch.Tensor; got list"),
    (lambda r: mask_encode_cuda(torch.randn(8, device="meta"), runner=r),
     r"tensors must be on a cpu device for EmulatorRunner; got meta"),
    (lambda r: mask_encode_cuda(torch.randn(9), runner=r, out=torch.empty(1, dtype=torch.uint8)),
     r"out must have 2 elements; got 1"),
    (lambda r: mask_encode_cuda(torch.randn(9), runner=r, out=torch.empty(2)),
     r"out must have dtype in \(torch.uint8\); got torch.float32"),
    (lambda r: mask_decode_cuda(torch.empty(2, dtype=torch.uint8), 17, torch.float32, runner=r),
     r"bits must have 3 elements; got 2"),
    (lambda r: mask_decode_cuda(torch.empty(2, dtype=torch.uint8), -1, torch.float32, runner=r),
     r"numel=-1; expected an int >= 0"),
    (lambda r: mask_decode_cuda(torch.empty(2, dtype=torch.uint8), 9, torch.int32, runner=r),
     r"dtype=torch.int32; expected one of torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.bool, "
     r"torch.uint8$"),
    (lambda r: mask_decode_cuda(torch.empty(2, dtype=torch.uint8), 9, torch.float16, torch.tensor(2.0), runner=r),
     r"scale must have dtype in \(torch.float16\); got torch.float32"),
    (lambda r: mask_decode_cuda(torch.empty(2, dtype=torch.uint8), 9, torch.float32, torch.ones(2), runner=r),
     r"scale must have 1 elements; got 2"),
    (lambda r: mask_decode_cuda(torch.empty(2, dtype=torch.uint8), 9, torch.float32, runner=r,
                                out=torch.empty(9, dtype=torch.float64)),
     r"out must have dtype in \(torch.float32\); got torch.float64"),
])
def test_bad_arguments_are_refused_before_launch(call, match):
    assert_refused_before_launch(call, match)


def test_empty_tensors_launch_nothing():
    runner = EmulatorRunner()
    bits = mask_encode_cuda(torch.empty(0, 3), runner=runner)
    assert bits.numel() == 0 and bits.dtype == torch.uint8
    assert mask_decode_cuda(bits, 0, torch.bfloat16, runner=runner).shape == (0,)
    assert runner.launches == []
