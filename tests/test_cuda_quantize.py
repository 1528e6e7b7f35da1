"""The CUDA quantize kernels, run on CPU threads by the emulation harness, against the torch specification.

Every comparison is bit for bit: payload bytes, statistics and decoded tensors viewed as integers, NaN
encodings included (the specification stores one canonical NaN per dtype, and the emulator returns a GPU's NaN
bits, not x86's), with one exception the specification leaves open: the sign of a zero minimum/maximum of a
group holding both +0 and -0 depends on torch's reduction order (it is not a rule), so zero statistics compare
by value.
"""
import ctypes
import struct
import threading
import types
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import lightning_act.codecs as act_codecs
import lightning_act.cuda as cuda_pkg
import lightning_act.cuda.launcher as launcher
import lightning_act.cuda.quantize as cuda_quantize
from lightning_act.codecs.division import DivisionCodec
from lightning_act.codecs.lorenzo import LorenzoCodec
from lightning_act.codecs.quantize import QuantizeCodec
from lightning_act.cuda.launcher import NVRTC_OPTIONS, CupyRunner, kernel_source
from lightning_act.cuda.quantize import dequantize_cuda, quantize_cuda
from lightning_act.formats.quantize import dequantize_reference, quantize_reference
from tests.cuda_emulation.checks import (
    DTYPES,
    assert_refused_before_launch,
    assert_same_bits,
    assert_same_encoding,
    check_quantize,
)
from tests.cuda_emulation.emulator import EmulatedModule, EmulatorRunner, requires_gxx
from tests.cuda_emulation.nan_payloads import nan_payload_groups, nan_tensor

BITS = [1, 2, 4, 8]
STATS_DTYPES = [torch.float32, torch.bfloat16]



# (shape, group_size): one element, sizes that are not multiples of the group, of 32 or of a block of 8 groups
SHAPES = [((1,), 256), ((37,), 32), ((7, 37), 256), ((3, 256), 256), ((2, 3, 300), 64), ((5000,), 1024)]


@pytest.mark.parametrize("shape, group_size", SHAPES)
@pytest.mark.parametrize("stats_dtype", STATS_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.toolchain
@requires_gxx
def test_random_tensors_bit_identical(runner, bits, dtype, stats_dtype, shape, group_size):
    torch.manual_seed(bits * 100 + len(shape))
    x = (torch.randn(shape) * 3 + 1).to(dtype)
    check_quantize(runner, x, bits, group_size, stats_dtype)


@pytest.mark.parametrize("group_size", [96, 160, 288, 512, 8192])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [2, 8])
@pytest.mark.toolchain
@requires_gxx
def test_team_shapes_bit_identical(runner, bits, dtype, group_size):
    """Groups whose team is part of a warp with idle lanes (96, 160: 12 and 20 chunks of 8), spans warps with idle
    lanes (288: 36 chunks on 2 warps) or whole warps reduced through shared memory (512, 8192: 2 and 32 warps, the
    largest block); a short last group in each."""
    torch.manual_seed(group_size)
    x = (torch.randn(2 * group_size + 77) * 3).to(dtype)
    check_quantize(runner, x, bits, group_size, torch.float32)


def _special(case: str) -> torch.Tensor:
    torch.manual_seed(0)
    x = torch.randn(300)
    if case == "constant":
        return torch.full((300,), 0.3)
    if case == "zeros":
        return torch.zeros(300)
    if case == "nan":
        x[70] = float("nan")
    elif case == "inf":
        x[70], x[140], x[200], x[201] = float("inf"), float("-inf"), float("inf"), float("-inf")
    elif case == "nan_group":
        x[64:128] = float("nan")
    elif case == "inf_group":
        x[128:192] = float("inf")
    elif case == "tiny":  # float32 subnormal steps: 1/step overflows to inf
        x = x * 1e-42
    elif case == "half_subnormal":
        x = x * 3e-6
    elif case == "huge":  # mx - mn overflows float32; float16 inputs become inf
        x = x * 1.5e38
    elif case == "ties":  # exact multiples of the grid: x - mn lands on integers
        x = torch.arange(300.0) % 16
    return x


SPECIAL = ["constant", "zeros", "nan", "inf", "nan_group", "inf_group", "tiny", "half_subnormal", "huge", "ties"]


@pytest.mark.parametrize("case", SPECIAL)
@pytest.mark.parametrize("stats_dtype", STATS_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.toolchain
@requires_gxx
def test_special_values_bit_identical(runner, bits, dtype, stats_dtype, case):
    check_quantize(runner, _special(case).to(dtype), bits, 64, stats_dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.toolchain
@requires_gxx
def test_every_16_bit_pattern_is_read_exactly(runner, dtype):
    """All 65536 encodings (subnormals, infinities, NaNs) as input, in order: a group holds 256 neighbouring
    values, so its 8-bit codes are about one per ulp and expose any error of the kernel's 16-bit -> float32 read."""
    x = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    check_quantize(runner, x, 8, 256, torch.float32)


@pytest.mark.parametrize("stats_dtype", STATS_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.toolchain
@requires_gxx
def test_nan_payloads_store_the_same_bits(runner, dtype, stats_dtype):
    """Groups holding NaNs of every encoding (signalling, quiet, negative, with payload bits), +-Inf mixes whose
    differences are NaN: the statistics the kernel stores and its decode carry the spec's NaN bits."""
    check_quantize(runner, nan_payload_groups(dtype, 32, tail=7), 4, 32, stats_dtype)


def _float64_rounding_cases() -> torch.Tensor:
    """float64 inputs where rounding to float32 matters: ties and near-ties between float32 neighbours, values
    that become float32 subnormals or zero, and values beyond float32's range or just inside it."""
    gen = torch.Generator().manual_seed(7)
    low = torch.randn(256, generator=gen)
    high = torch.nextafter(low, torch.full_like(low, float("inf")))
    mid = (low.double() + high.double()) / 2  # exact in float64: a float32 tie, rounded to the even neighbour
    limit = float(torch.finfo(torch.float32).max)
    edges = torch.tensor([limit, limit * (1 + 2**-25), limit * (1 + 2**-24), 1e39, -1e300, 1e-40, 3e-45, 7e-46,
                          1e-50, 5e-324, -0.0], dtype=torch.float64)
    return torch.cat([mid, mid + 1e-13 * mid.abs(), mid - 1e-13 * mid.abs(), low.double() * 1e-39,
                      edges]).roll(5)


@pytest.mark.parametrize("stats_dtype", STATS_DTYPES)
@pytest.mark.parametrize("case", ["ties", "range"])
@pytest.mark.toolchain
@requires_gxx
def test_float64_inputs_are_rounded_to_float32_like_the_reference(runner, case, stats_dtype):
    x = _float64_rounding_cases()
    if case == "range":  # one group per magnitude: tiny groups keep their float32 subnormals apart
        x = x[x.isfinite() & (x.abs() < 1e30)].sort().values
    check_quantize(runner, x, 8, 32, stats_dtype)


@pytest.mark.parametrize("stats_dtype", STATS_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.toolchain
@requires_gxx
def test_decode_of_arbitrary_statistics(runner, dtype, stats_dtype):
    """Random bit patterns as mn and step (any float, NaN and inf included), edge values of the float16
    rounding, finite statistics whose values overflow and NaNs of every encoding: the kernel's float32 -> output
    dtype rounding and its NaN results must agree with torch's everywhere (groups of finite statistics store
    without the per-element NaN tests)."""
    gen = torch.Generator().manual_seed(5)
    groups, group_size, bits = 512, 32, 2
    edges = torch.tensor([65504.0, 65519.996, 65520.0, 2.0**-24, 2.0**-25, 2.0**-25 * 1.0000001, 2.0**-14,
                          2.0**-14 * 0.99999994, 1.5 * 2.0**-24, 2.5 * 2.0**-24, -0.0, 3.0e38])
    mn = torch.randint(-(1 << 31), 1 << 31, (groups,), generator=gen, dtype=torch.int64).to(torch.int32)
    mn = mn.view(torch.float32)
    mn[: len(edges)] = edges
    step = torch.rand(groups, generator=gen) * 10.0 ** torch.randint(-45, 30, (groups,), generator=gen)
    step[: len(edges)] = 0.0  # decode to exactly mn
    # finite statistics whose values overflow to an infinity (the decode's path without NaN tests)
    mn[200:216], step[200:216] = torch.tensor([3.0e38, -3.0e38, 1.0, -1.0]).repeat(4), 2.0e38
    mn, step = mn.to(stats_dtype), step.to(stats_dtype)
    mn[100:108], step[108:116] = nan_tensor(stats_dtype), nan_tensor(stats_dtype)
    numel = groups * group_size - 5
    payload = torch.randint(0, 256, ((numel * bits + 7) // 8,), generator=gen, dtype=torch.uint8)
    args = (payload, mn, step, numel, bits, group_size, dtype)
    assert_same_bits(dequantize_cuda(*args, runner=runner), dequantize_reference(*args))


@pytest.mark.parametrize("group_size", [64, 256, 512])
@pytest.mark.toolchain
@requires_gxx
def test_grid_stride_loop_covers_groups_beyond_the_grid(runner, monkeypatch, group_size):
    monkeypatch.setattr(launcher, "MAX_BLOCKS", 2)
    x = torch.randn(41 * 512 + 17)  # groups of 64: 4 teams a warp, 8 warps, 2 slots: 64 groups a block iteration
    runner.launches.clear()
    check_quantize(runner, x, 4, group_size, torch.float32)
    assert [launch[2] for launch in runner.launches] == [(2, 1, 1), (2, 1, 1)]


@pytest.mark.toolchain
@requires_gxx
def test_grid_is_sized_to_the_multiprocessors(runner):
    """A runner reporting its SM count gets at most one wave of resident blocks; the kernels stride beyond."""
    runner.multiprocessors = lambda device: 1
    x = torch.randn(300 * 64)
    runner.launches.clear()
    check_quantize(runner, x, 2, 64, torch.bfloat16)
    threads = cuda_quantize.RESIDENT_THREADS_PER_SM // 256
    assert [launch[2:4] for launch in runner.launches] == [((threads, 1, 1), (256, 1, 1))] * 2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.toolchain
@requires_gxx
def test_unaligned_views_take_the_element_path(runner, bits, dtype):
    """Inputs, payloads and outputs that do not start on 16 (or 8) bytes: the kernels check the pointers and
    read or write one element (byte) at a time where a vector would be misaligned."""
    x = (torch.randn(2 * 256 + 41) * 2).to(dtype)[1:]
    assert x.data_ptr() % 16
    check_quantize(runner, x, bits, 64, torch.float32)
    expected = quantize_reference(x, bits, 64, torch.float32, 3, 11)
    nbytes, groups = expected[0].numel(), expected[1].numel()
    payload_room = torch.zeros(nbytes + 8, dtype=torch.uint8)
    out = (payload_room[4:4 + nbytes], torch.empty(groups), torch.empty(groups))
    assert_same_encoding(quantize_cuda(x, bits, 64, torch.float32, 3, 11, runner=runner, out=out), expected)
    decode_args = (out[0], *expected[1:], x.numel(), bits, 64, dtype)
    out_room = torch.empty(x.numel() + 1, dtype=dtype)
    decoded = dequantize_cuda(*decode_args, runner=runner, out=out_room[1:])
    assert decoded.data_ptr() % 16
    assert_same_bits(decoded, dequantize_reference(*decode_args))


def test_empty_tensor_launches_nothing():
    runner = EmulatorRunner()
    payload, mn, step = quantize_cuda(torch.empty(0), 4, 256, torch.float32, 0, 0, runner=runner)
    assert payload.numel() == mn.numel() == step.numel() == 0
    assert dequantize_cuda(payload, mn, step, 0, 4, 256, torch.float16, runner=runner).numel() == 0
    assert runner.launches == []


@pytest.mark.parametrize("numel, group_size, expected", [
    (1, 256, ((1, 1, 1), (32, 1, 1), 0)),                      # never more warps than the groups need
    (1800, 256, ((1, 1, 1), (128, 1, 1), 0)),                  # 8 groups: 4 warps of one team, 2 slots each
    (100_000, 256, ((25, 1, 1), (256, 1, 1), 0)),              # 391 groups, 16 a block iteration
    (100_000, 64, ((25, 1, 1), (256, 1, 1), 0)),               # 4 teams a warp: 64 groups a block iteration
    (100_000, 96, ((66, 1, 1), (256, 1, 1), 0)),               # 12 chunks: a warp a team, 20 lanes idle
    (100_000, 2048, ((25, 1, 1), (256, 1, 1), 0)),             # a team of 8 warps
    (100_000, 8192, ((7, 1, 1), (1024, 1, 1), 0)),             # a team of 32 warps
    (10**9, 256, ((4 * 132, 1, 1), (256, 1, 1), 0)),           # one wave: 4 blocks of 256 on each of 132 SMs
    (10**9, 8192, ((132, 1, 1), (1024, 1, 1), 0)),
])
def test_launch_configuration(numel, group_size, expected):
    assert cuda_quantize._launch_config(numel, group_size) == expected


# ---- the same launcher code drives CuPy: a stand-in CuPy module whose kernels run on the emulator ----

class FakeCupy:
    """Records what CupyRunner asks of CuPy; RawModule compiles the code it is given with the emulator. A
    function is launched through CuPy's call (its arguments as NumPy scalars) or through the driver binding
    (``cuda.driver.launchKernel``: the function's handle and cuLaunchKernel's argument block, which the
    emulated kernel reads as the driver does)."""

    def __init__(self, tmp_path):
        self.modules, self.devices, self.streams, self.launch_streams = [], [], [], []
        self.attribute_reads, self.grids, self.functions = [], [], []
        fake = self

        class Function:  # cupy.cuda.function.Function: a CUfunction handle
            def __init__(self, module, name):
                self.module, self.name, self.ptr = module, name, 0x1000 + len(fake.functions)
                fake.functions.append(self)

        class RawKernel:  # what RawModule.get_function returns: callable, its .kernel the current device's Function
            def __init__(self, module, name):
                self.module, self.name, self._kernel = module, name, None

            @property
            def kernel(self):
                if self._kernel is None:
                    self._kernel = Function(self.module, self.name)
                return self._kernel

            def __call__(self, grid, block, args, *, shared_mem=0, stream=None):
                fake.launch_streams.append(stream.ptr)
                fake.grids.append(grid)
                self.module.launch(self.name, grid, block, args, shared_mem)

        class RawModule:
            def __init__(self, code, options):
                fake.modules.append((code, options))
                source = tmp_path / f"module{len(fake.modules)}.cu"
                source.write_text(code)
                self._module = EmulatedModule(source)

            def get_function(self, name):
                return RawKernel(self._module, name)

        def launch_kernel(f, gx, gy, gz, bx, by, bz, shared_mem, stream, kernel_params, extra):
            function = fake.functions[f - 0x1000]
            assert function.ptr == f and extra == 0
            fake.launch_streams.append(stream)
            fake.grids.append((gx, gy, gz))
            function.module.launch_packed(function.name, (gx, gy, gz), (bx, by, bz), shared_mem, kernel_params)

        class Device:
            def __init__(self, index):
                self.index = index

            @property
            def attributes(self):
                fake.attribute_reads.append(self.index)
                return {"MultiProcessorCount": 3}

            def __enter__(self):
                fake.devices.append(self.index)
                return self

            def __exit__(self, *exc):
                return False

        class ExternalStream:
            def __init__(self, ptr, device_id):
                self.ptr = ptr
                fake.streams.append((ptr, device_id))

        self.RawModule = RawModule
        self.cuda = types.SimpleNamespace(Device=Device, ExternalStream=ExternalStream,
                                          driver=types.SimpleNamespace(launchKernel=launch_kernel))


@pytest.mark.toolchain
@requires_gxx
@pytest.mark.parametrize("launch", launcher.LAUNCH_MODES)
def test_cupy_runner_code_path_on_the_emulator(tmp_path, monkeypatch, launch):
    fake = FakeCupy(tmp_path)
    monkeypatch.setattr(cuda_pkg, "require_cupy", lambda: fake)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: types.SimpleNamespace(cuda_stream=0xC0FFEE))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    runner = CupyRunner(launch=launch)
    runner.device_type = "cpu"  # the only change: let it take CPU tensors
    x = torch.randn(3, 500, dtype=torch.bfloat16)
    for key in (1, 2):
        expected = quantize_reference(x, 4, 128, torch.bfloat16, 9, key)
        encoded = quantize_cuda(x, 4, 128, torch.bfloat16, 9, key, runner=runner)
        assert_same_encoding(encoded, expected)
        decoded = dequantize_cuda(*encoded, x.numel(), 4, 128, x.dtype, runner=runner)
        assert_same_bits(decoded, dequantize_reference(*expected, x.numel(), 4, 128, x.dtype))
    # one module per (source, device) compiled from the shipped source, every launch on the torch stream
    assert fake.modules == [(kernel_source("quantize.cu"), NVRTC_OPTIONS)]
    # every launch on the torch stream (CuPy's call: through one CuPy stream object built once; the driver: the
    # raw handle); no device context is entered when torch's current device is the tensors' (the launch path runs
    # several times per saved tensor)
    assert fake.streams == ([(0xC0FFEE, 0)] if launch == "cupy" else [])
    assert fake.launch_streams == [0xC0FFEE] * 4 and fake.devices == []
    # the SM count is read once per device and sizes the grid
    assert fake.attribute_reads == [0]
    assert fake.grids == [cuda_quantize._launch_config(x.numel(), 128, 3)[0]] * 4


@pytest.mark.toolchain
@requires_gxx
@pytest.mark.parametrize("launch", launcher.LAUNCH_MODES)
def test_cupy_runner_sizes_grids_to_the_multiprocessors(tmp_path, monkeypatch, launch):
    """A tensor big enough for more blocks than one wave: the grid is capped by the reported SM count and the
    kernels' grid-stride loops cover the rest."""
    fake = FakeCupy(tmp_path)
    monkeypatch.setattr(cuda_pkg, "require_cupy", lambda: fake)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: types.SimpleNamespace(cuda_stream=1))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    runner = CupyRunner(launch=launch)
    runner.device_type = "cpu"
    x = torch.randn(13 * 128 * 32 + 100)  # groups of 32: 128 a block iteration (8 warps of 8 teams, 2 slots)
    encoded = quantize_cuda(x, 2, 32, torch.float32, 1, 2, runner=runner)
    assert_same_encoding(encoded, quantize_reference(x, 2, 32, torch.float32, 1, 2))
    assert fake.grids == [(3 * cuda_quantize.RESIDENT_THREADS_PER_SM // 256, 1, 1)]


@pytest.mark.toolchain
@requires_gxx
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("codec", ["quantize", "positive_mask"])
def test_codecs_through_the_driver_launch_store_the_torch_paths_bytes(tmp_path, monkeypatch, dtype, memory_format,
                                                                      codec):
    """Each codec's kernel path through CupyRunner's driver launch (its argument blocks read as the driver reads
    them, by the emulator) stores and decodes what its torch path does, for every float dtype (float64: the kernels
    round it to float32 as the specification does) and a channels_last tensor."""
    fake = FakeCupy(tmp_path)
    monkeypatch.setattr(cuda_pkg, "require_cupy", lambda: fake)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: types.SimpleNamespace(cuda_stream=5))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    runner = CupyRunner(launch="driver")
    runner.device_type = "cpu"
    x = torch.randn(2, 5, 7, 9).to(dtype).contiguous(memory_format=memory_format)
    x[0, 0, 0, :3] = 0.0
    reference = act_codecs.get(codec, backend="torch")
    expected = reference.encode(x, key=4)
    with launcher.use_runner(runner):
        kernel = act_codecs.get(codec, backend="cupy")
        packed = kernel.encode(x, key=4)
        decoded = kernel.decode(packed)
    for name in expected.buffers:
        assert_same_bits(packed.buffers[name].reshape(-1), expected.buffers[name].reshape(-1))
    assert_same_bits(decoded, reference.decode(expected))
    assert fake.launch_streams == [5, 5]  # one encode and one decode, both through the driver


@pytest.mark.toolchain
@requires_gxx
def test_driver_launches_of_two_threads_use_their_own_argument_blocks(tmp_path, monkeypatch):
    """The driver path writes each launch's arguments into a block kept per kernel: per thread as well, so two
    threads launching at once (autograd runs a CUDA backward in a thread of its own) never overwrite each other's
    arguments; every encode still stores the specification's bytes."""
    fake = FakeCupy(tmp_path)
    monkeypatch.setattr(cuda_pkg, "require_cupy", lambda: fake)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: types.SimpleNamespace(cuda_stream=7))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    blocks = {}
    launch_kernel = fake.cuda.driver.launchKernel

    def recording(*args):
        blocks.setdefault(threading.get_ident(), set()).add(args[-2])
        launch_kernel(*args)  # the emulator runs one launch at a time; the threads pack their arguments at once

    fake.cuda.driver.launchKernel = recording
    runner = CupyRunner(launch="driver")
    runner.device_type = "cpu"
    inputs = [torch.randn(700 + 64 * i) for i in range(8)]
    results, errors = {}, []

    def encode_all(thread_index):
        try:
            for i, x in enumerate(inputs):
                results[thread_index, i] = quantize_cuda(x, 2, 64, torch.float32, 3, 10 * thread_index + i,
                                                         runner=runner)
        except Exception as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=encode_all, args=(t,)) for t in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    for (thread_index, i), encoded in results.items():
        assert_same_encoding(encoded, quantize_reference(inputs[i], 2, 64, torch.float32, 3, 10 * thread_index + i))
    assert len(blocks) == 2 and all(len(b) == 1 for b in blocks.values())  # one block per thread, reused
    first, second = blocks.values()
    assert first.isdisjoint(second)


@pytest.mark.parametrize("arg", [np.uint64(2**64 - 3), np.int64(-2**40 - 5), np.uint32(2**32 - 9), np.int32(-7),
                                 np.uint16(65000), np.int16(-300), np.uint8(250), np.int8(-100), np.float32(-1.5e-3),
                                 np.float32(np.inf), np.float64(1e300)])
def test_kernel_arguments_hold_each_value_in_its_slot(arg):
    """What cuLaunchKernel reads: the pointer at ``address + 8 i`` leads to the bytes of argument i, at its width."""
    args = [np.int32(11), arg, np.uint64(0xDEADBEEF)]
    block = launcher.KernelArguments(args)
    for values in (args, [np.int32(-1), arg, np.uint64(5)]):  # packed again in place: the same slots
        block.pack(*values)
        slots = (ctypes.c_void_p * 3).from_address(block.address)
        for slot, value in zip(slots, values):
            assert ctypes.string_at(slot, value.dtype.itemsize) == value.tobytes()
    assert [slots[i] - slots[0] for i in range(3)] == [0, 8, 16]


def test_kernel_arguments_refuse_what_is_not_a_numpy_scalar():
    with pytest.raises(TypeError, match=r"kernel argument 1 is int; expected a NumPy scalar"):
        launcher.KernelArguments([np.int32(1), 5])
    with pytest.raises(TypeError, match=r"kernel argument 0 is complex64"):
        launcher.KernelArguments([np.complex64(1)])
    block = launcher.KernelArguments([np.int32(1), np.int64(2)])
    with pytest.raises(struct.error):  # a launch with another argument count than the block's
        block.pack(np.int32(1))


def test_launch_mode_is_checked(monkeypatch):
    monkeypatch.delenv(launcher.LAUNCH_ENV, raising=False)
    assert launcher.launch_mode() == "driver" and launcher.launch_mode("cupy") == "cupy"
    monkeypatch.setenv(launcher.LAUNCH_ENV, "cupy")
    assert launcher.launch_mode() == "cupy"
    monkeypatch.setenv(launcher.LAUNCH_ENV, "fast")
    with pytest.raises(ValueError, match=r"LIGHTNING_ACT_KERNEL_LAUNCH='fast'; expected one of 'driver', 'cupy'"):
        launcher.launch_mode()
    with pytest.raises(ValueError, match=r"launch='raw'; expected one of"):
        CupyRunner(launch="raw")


@pytest.mark.toolchain
@requires_gxx
@pytest.mark.parametrize("chosen", [False, True])
def test_a_driver_launch_the_binding_refuses_falls_back_to_cupys_call_unless_chosen(tmp_path, monkeypatch, chosen):
    """The default launch is proven by the first one: a binding that refuses it (a CuPy whose signature differs)
    leaves CuPy's own call to launch that kernel and every later one, with a warning; a driver launch asked for by
    name raises instead."""
    fake = FakeCupy(tmp_path)
    refused = []

    def refuse(*args):
        refused.append(args)
        raise TypeError("launchKernel() takes exactly 12 positional arguments (11 given)")

    fake.cuda.driver.launchKernel = refuse
    monkeypatch.setattr(cuda_pkg, "require_cupy", lambda: fake)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: types.SimpleNamespace(cuda_stream=3))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.delenv(launcher.LAUNCH_ENV, raising=False)
    runner = CupyRunner(launch="driver" if chosen else None)
    runner.device_type = "cpu"
    x = torch.randn(2, 300)
    if chosen:
        with pytest.raises(TypeError, match="takes exactly 12"):
            quantize_cuda(x, 4, 64, torch.float32, 1, 2, runner=runner)
        return
    with pytest.warns(RuntimeWarning, match=r"launching quantize_encode through cupy.cuda.driver.launchKernel "
                                            r"failed \(TypeError: launchKernel\(\) takes exactly 12"):
        encoded = quantize_cuda(x, 4, 64, torch.float32, 1, 2, runner=runner)
    assert_same_encoding(encoded, quantize_reference(x, 4, 64, torch.float32, 1, 2))
    decoded = dequantize_cuda(*encoded, x.numel(), 4, 64, x.dtype, runner=runner)  # no second attempt, no warning
    assert_same_bits(decoded, dequantize_reference(*quantize_reference(x, 4, 64, torch.float32, 1, 2), x.numel(), 4,
                                                   64, x.dtype))
    assert len(refused) == 1 and runner.launch_mode == "cupy" and fake.launch_streams == [3, 3]


def test_a_cupy_without_the_driver_binding_launches_through_its_call(tmp_path, monkeypatch):
    fake = FakeCupy(tmp_path)
    del fake.cuda.driver
    monkeypatch.setattr(cuda_pkg, "require_cupy", lambda: fake)
    monkeypatch.delenv(launcher.LAUNCH_ENV, raising=False)
    assert CupyRunner().launch_mode == "cupy"  # the default falls back
    with pytest.raises(RuntimeError, match=r"launch='driver' needs cupy.cuda.driver.launchKernel"):
        CupyRunner(launch="driver")


@pytest.mark.toolchain
@requires_gxx
def test_argument_packing_is_checked_against_the_kernel_signature():
    module = EmulatorRunner().module("quantize.cu")
    assert module.params["quantize_encode"] == [("p", 8), ("i", 4), ("i", 8), ("i", 4), ("i", 4), ("u", 4),
                                                ("p", 8), ("p", 8), ("p", 8), ("i", 4)]
    args = [np.uint64(0), np.int32(0), np.int32(1)]  # numel packed as int32 instead of long long
    with pytest.raises(TypeError, match=r"quantize_encode argument 2 is i8"):
        module.launch("quantize_encode", (1, 1, 1), (32, 1, 1), args + [np.int32(0)] * 7, 0)


@pytest.mark.toolchain
@requires_gxx
def test_shim_primitives_match_numpy():
    module = EmulatedModule(Path(__file__).parent / "cuda_emulation" / "selftest.cu")
    x = np.random.default_rng(0).integers(-50, 100, size=3 * 128 - 20).astype(np.int32)
    blocks, threads = 3, 128
    block_sums = np.zeros(blocks, np.int32)
    total, maximum = np.zeros(1, np.int32), np.full(1, -1000, np.int32)
    ballots, lane0 = np.zeros(blocks * threads // 32, np.uint32), np.zeros(blocks * threads, np.int32)
    ptr = lambda a: np.uint64(a.ctypes.data)  # noqa: E731
    module.launch("block_reduce", (blocks, 1, 1), (32, 4, 1),
                  [ptr(x), np.int64(x.size), ptr(block_sums), ptr(total), ptr(maximum), ptr(ballots), ptr(lane0)], 0)
    padded = np.concatenate([x, np.zeros(blocks * threads - x.size, np.int32)])
    assert block_sums.tolist() == padded.reshape(blocks, threads).sum(axis=1).tolist()
    assert total[0] == x.sum() and maximum[0] == x.max()
    bits = (padded.reshape(-1, 32) > 0).astype(np.uint64) << np.arange(32, dtype=np.uint64)
    assert ballots.tolist() == bits.sum(axis=1).tolist()
    assert lane0.tolist() == np.repeat(padded[::32], 32).tolist()


@pytest.mark.toolchain
@requires_gxx
def test_shim_vector_types_move_the_bytes():
    """float4 / uint4 / double2 / uint2 loads and stores (what load_chunk / store_chunk and the payload words use), in
    a __launch_bounds__ kernel calling a __noinline__ function."""
    module = EmulatedModule(Path(__file__).parent / "cuda_emulation" / "selftest.cu")
    rng = np.random.default_rng(1)
    n = 70  # two blocks of 64, the second partial
    a = rng.standard_normal(4 * n).astype(np.float32)
    b = rng.integers(0, 1 << 32, 4 * n, dtype=np.uint64).astype(np.uint32)
    c = rng.standard_normal(2 * n)
    d = rng.integers(0, 1 << 31, 2 * n, dtype=np.uint64).astype(np.uint32)
    a_out, b_out, c_out, d_out = np.zeros_like(a), np.zeros_like(b), np.zeros_like(c), np.zeros(n, np.uint32)
    ptr = lambda v: np.uint64(v.ctypes.data)  # noqa: E731
    assert all(v.ctypes.data % 16 == 0 for v in (a, b, c, d, a_out, b_out, c_out))
    module.launch("vector_types", (2, 1, 1), (64, 1, 1),
                  [ptr(a), ptr(b), ptr(c), ptr(d), np.int64(n), ptr(a_out), ptr(b_out), ptr(c_out), ptr(d_out)], 0)
    assert a_out.tobytes() == a.tobytes() and b_out.tobytes() == b.tobytes() and c_out.tobytes() == c.tobytes()
    assert d_out.tolist() == ((d[0::2].astype(np.uint64) + d[1::2]) % (1 << 32)).tolist()


@pytest.mark.toolchain
@requires_gxx
def test_shim_atomic_cas_keeps_every_racing_update():
    """32 threads a warp, 16 a word, each setting its bit with a compare-and-swap loop on a word whose other bits
    hold a pattern: every bit set, the pattern kept (division.cu writes chunks shared by two planes this way)."""
    module = EmulatedModule(Path(__file__).parent / "cuda_emulation" / "selftest.cu")
    n = 2 * 128 - 16  # the second block's last 16 threads have no word
    words = np.full(n // 16, 0xAAAAAAAA, np.uint32)  # odd bits set: the threads own the even ones
    module.launch("masked_swaps", (2, 1, 1), (128, 1, 1), [np.uint64(words.ctypes.data), np.int64(n)], 0)
    assert words.tolist() == [0xFFFFFFFF] * (n // 16)


@pytest.mark.toolchain
@requires_gxx
def test_shim_float_operations_give_the_gpu_nan():
    """NaN results of the emulated operations are 0x7fffffff, a GPU's canonical NaN, whatever NaN went in (x86
    would keep an operand's payload and sign); other results are the IEEE ones."""
    module = EmulatedModule(Path(__file__).parent / "cuda_emulation" / "selftest.cu")
    nans = nan_tensor(torch.float32).numpy()
    other = np.array([1.5, -2.5, 0.5, -0.0, 3e38, 1e-45, np.inf, 0.0], np.float32)
    # then inf - inf, 0 / 0, 0 * inf, ...: NaN from operands that are not NaN (x86 gives 0xffc00000)
    a = np.concatenate([nans, other, np.array([np.inf, 0, np.inf, 0, -np.inf, 1.5, 1e-45, 3e38], np.float32)])
    b = np.concatenate([other, nans, np.array([np.inf, 0, -np.inf, np.inf, -np.inf, 0, 0, 3e38], np.float32)])
    d = np.concatenate([nan_tensor(torch.float64).numpy(),
                        [1 + 2.0**-24, 1 + 3 * 2.0**-24, 1e-46, 3.5e38, -1e300, 1e39, 0.1, -0.0],
                        np.linspace(-3, 3, 8)])
    out = np.zeros((a.size, 8), np.float32)
    ptr = lambda v: np.uint64(v.ctypes.data)  # noqa: E731
    module.launch("float_ops", (1, 1, 1), (32, 1, 1), [ptr(a), ptr(b), ptr(d), np.int64(a.size), ptr(out)], 0)
    with np.errstate(all="ignore"):
        expected = np.stack([a + b, a - b, a * b, a / b, np.float32(1) / a, np.floor(a), np.rint(a),
                             d.astype(np.float32)], axis=1)
    expected_bits = np.where(np.isnan(expected), np.uint32(0x7FFFFFFF), expected.view(np.uint32))
    assert np.isnan(expected).sum() > 50
    assert out.view(np.uint32).tolist() == expected_bits.tolist()


# ---- checks before launch (no toolchain needed: they fail before anything runs) ----

@pytest.mark.parametrize("call, match", [
    (lambda r: quantize_cuda(torch.randn(8, 4).t(), 4, 256, torch.float32, 0, 0, runner=r),
     r"x must be contiguous; got strides \(1, 4\)"),
    (lambda r: quantize_cuda(torch.arange(8, dtype=torch.int32), 4, 256, torch.float32, 0, 0, runner=r),
     r"x must have dtype in \(torch.float32, torch.float16, torch.bfloat16, torch.float64\); got torch.int32"),
    (lambda r: quantize_cuda(torch.randn(8), 16, 256, torch.float32, 0, 0, runner=r),
     r"bits=16; the CUDA kernels take one of 1, 2, 4, 8"),
    (lambda r: quantize_cuda(torch.randn(8), 4, 16384, torch.float32, 0, 0, runner=r),
     r"group_size=16384; the CUDA kernels take a multiple of 32 in \[32, 8192\]"),
    (lambda r: quantize_cuda(torch.randn(8, device="meta"), 4, 256, torch.float32, 0, 0, runner=r),
     r"tensors must be on a cpu device for EmulatorRunner; got meta"),
    (lambda r: quantize_cuda(torch.randn(8), 4, 256, torch.float32, 0, 0, runner=r,
                             out=(torch.empty(4, dtype=torch.uint8)[1:], torch.empty(1), torch.empty(1))),
     r"payload must have 4 elements; got 3"),
    (lambda r: quantize_cuda(torch.randn(8), 4, 256, torch.float32, 0, 0, runner=r,
                             out=(torch.empty(5, dtype=torch.uint8)[1:], torch.empty(1), torch.empty(1))),
     r"payload must be 4-byte aligned \(encode writes 32-bit words\); got data_ptr % 4 == 1"),
    (lambda r: dequantize_cuda(torch.empty(4, dtype=torch.uint8), torch.empty(1), torch.empty(1, dtype=torch.bfloat16),
                               8, 4, 256, torch.float32, runner=r),
     r"step must have dtype in \(torch.float32\); got torch.bfloat16"),
    (lambda r: dequantize_cuda(torch.empty(4, dtype=torch.uint8), torch.empty(2), torch.empty(2),
                               8, 4, 256, torch.float32, runner=r),
     r"mn must have 1 elements; got 2"),
    (lambda r: dequantize_cuda(torch.empty(4, dtype=torch.uint8), torch.empty(1), torch.empty(1),
                               8, 4, 256, torch.int32, runner=r),
     r"dtype=torch.int32; expected one of torch.float32, torch.float16, torch.bfloat16, torch.float64$"),
])
def test_bad_arguments_are_refused_before_launch(call, match):
    assert_refused_before_launch(call, match)


# ---- backend choice in the codec ----

def _tensor_on(device: str, dtype: torch.dtype):
    """Stands in for a tensor: the backend choice looks only at its device and dtype."""
    return types.SimpleNamespace(device=torch.device(device), is_cuda=device.startswith("cuda"), dtype=dtype)


CODECS = {
    "quantize": lambda backend: QuantizeCodec(bits=4, backend=backend),
    "quantize group 16384": lambda backend: QuantizeCodec(bits=4, group_size=16384, backend=backend),
    "division": lambda backend: DivisionCodec(backend=backend),
    "lorenzo": lambda backend: LorenzoCodec(error_bound=1e-3, backend=backend),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("backend, device, cupy_importable, expected", [
    ("torch", "cuda:0", True, False),
    ("auto", "cpu", True, False),
    ("auto", "cuda:0", False, False),
    ("auto", "cuda:0", True, True),
    ("cupy", "cuda:0", True, True),
])
def test_backend_choice(monkeypatch, codec, backend, device, cupy_importable, expected, dtype):
    monkeypatch.setattr(cuda_pkg, "cupy_available", lambda: cupy_importable)
    monkeypatch.setattr(cuda_pkg, "require_cupy", lambda: None)
    if codec == "quantize group 16384" or (codec == "lorenzo" and dtype == torch.float64):
        expected = False  # a format the kernels do not take: the torch path (also on CUDA), with either backend
    assert CODECS[codec](backend).runs_kernels(_tensor_on(device, dtype)) is expected


def test_cuda_tensors_without_cupy_warn_once_that_they_take_the_torch_path(monkeypatch):
    """A GPU user without CuPy is told once per process why compression is slow and how to install the kernels;
    CPU tensors and backend='torch' (the path chosen) are not warned about."""
    from lightning_act.codecs import backend

    monkeypatch.setattr(cuda_pkg, "cupy_available", lambda: False)
    monkeypatch.setattr(backend, "_warned_torch_path_on_cuda", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not QuantizeCodec(bits=4, backend="torch").runs_kernels(_tensor_on("cuda:0", torch.float32))
        assert not QuantizeCodec(bits=4).runs_kernels(_tensor_on("cpu", torch.float32))
        assert caught == []
        for codec in CODECS:
            assert not CODECS[codec]("auto").runs_kernels(_tensor_on("cuda:0", torch.float32))
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "CuPy is not installed" in message and "pip install 'lightning-act[cuda13]'" in message
    assert "backend='torch'" in message


def test_backend_cupy_refuses_cpu_tensors(monkeypatch):
    monkeypatch.setattr(cuda_pkg, "require_cupy", lambda: None)
    with pytest.raises(ValueError, match=r"backend='cupy' runs on CUDA tensors; got a tensor on cpu"):
        QuantizeCodec(backend="cupy").encode(torch.randn(64))


@pytest.mark.skipif(cuda_pkg.cupy_available(), reason="CuPy is installed here")
@pytest.mark.parametrize("codec", CODECS)
def test_without_cupy_the_cupy_backend_says_how_to_install_it(codec):
    hint = r"pip install 'lightning-act\[cuda13\]' on CUDA 13, 'lightning-act\[cuda12\]' on CUDA 12"
    with pytest.raises(ImportError, match=hint):
        CODECS[codec]("cupy")
    with pytest.raises(ImportError, match=r"pip install"):
        quantize_cuda(torch.randn(64), 4, 256, torch.float32, 0, 0)


@pytest.mark.parametrize("stats_dtype", STATS_DTYPES, ids=str)
def test_encoded_parts_are_aligned_views_of_one_allocation(stats_dtype):
    """One allocator call per encode (the launcher path runs for every saved tensor), each part 16-byte aligned
    for vector loads, and the part sizes exactly the format's."""
    payload, mn, step = quantize_cuda(torch.randn(1000), 2, 64, stats_dtype, 0, 0, runner=_NoLaunch())
    assert payload.untyped_storage().data_ptr() == mn.untyped_storage().data_ptr() == step.untyped_storage().data_ptr()
    assert all(t.data_ptr() % launcher.PART_ALIGN == 0 for t in (payload, mn, step))
    assert (payload.numel(), mn.numel(), step.numel(), mn.dtype, step.dtype) == (250, 16, 16, stats_dtype, stats_dtype)


class _NoLaunch:
    device_type = "cpu"

    def launch(self, *args):
        pass


# ---- the codec's kernel path (what runs for every saved tensor) ----

class _CountingRunner(_NoLaunch):
    def __init__(self):
        self.launches = []

    def launch(self, source, kernel, grid, block, args, shared_mem, device):
        self.launches.append((kernel, grid, block, tuple(args), shared_mem))


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("stats_dtype", ["float32", "bfloat16"])
@pytest.mark.toolchain
@requires_gxx
def test_codec_kernel_path_stores_the_specifications_bytes(runner, bits, stats_dtype):
    """The codec's kernel path (cached plans, one buffer) writes what quantize_cuda and the specification write,
    and decodes them back bit for bit, also through a codec of another bit width (decoded by the form's meta)."""
    x = torch.randn(3, 700) * 3
    with launcher.use_runner(runner):
        codec = QuantizeCodec(bits=bits, group_size=64, stats_dtype=stats_dtype, seed=7, backend="cupy")
        packed = codec.encode(x, key=11)
        decoded = codec.decode(packed)
        other = QuantizeCodec(bits=2 if bits != 2 else 4, group_size=64, stats_dtype=stats_dtype, seed=7,
                              backend="cupy").decode(packed)
    reference = quantize_reference(x.reshape(-1), bits, 64, codec.stats_dtype, 7, 11)
    assert_same_encoding(tuple(packed.buffers[name] for name in ("payload", "mn", "step")), reference)
    assert packed.nbytes == sum(t.numel() * t.element_size() for t in reference)
    expected = dequantize_reference(*reference, x.numel(), bits, 64, torch.float32).view(x.shape)
    assert_same_bits(decoded, expected)
    assert_same_bits(other, expected)


def test_codec_kernel_path_launches_once_with_a_cached_plan():
    """Encode and decode are one allocation and one launch each; the plan is built once per size, dtype, device
    and runner, and the noise key reaches the kernel as the specification's stream base."""
    runner, x = _CountingRunner(), torch.randn(4, 512)
    with launcher.use_runner(runner):
        codec = QuantizeCodec(bits=4, group_size=256, seed=3, backend="cupy")
        first = codec.encode(x, key=1)
        second = codec.encode(x, key=2)
        codec.decode(first)
    assert second.buffers.data.data_ptr() != first.buffers.data.data_ptr()  # each encode its own buffer
    assert [kernel for kernel, *_ in runner.launches] == ["quantize_encode", "quantize_encode", "quantize_decode"]
    assert type(first.buffers) is launcher.OneBuffer
    assert first.buffers.data.untyped_storage().nbytes() == first.buffers.layout.total
    assert len(codec._kernels._encodes) == 1 and len(codec._kernels._decodes) == 1
    (_, *encode_one), (_, *encode_two) = runner.launches[:2]
    assert encode_one[2][5] == rng_stream_base(3, 1) and encode_two[2][5] == rng_stream_base(3, 2)
    assert encode_one[2][0] == x.data_ptr()
    with launcher.use_runner(_CountingRunner()):  # another runner: its own plan (grids are sized per runner)
        codec.encode(x, key=1)
    assert len(codec._kernels._encodes) == 2


def rng_stream_base(seed: int, key: int) -> int:
    from lightning_act import rng

    return rng.stream_base(seed, key)
