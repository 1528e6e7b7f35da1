"""No codec's CUDA path reads a device value on the host (issue 20, item 2).

Each codec encodes and decodes through its kernel path with the emulator standing in for the GPU, under a guard
that raises on every operation which, on a CUDA tensor, would make the host wait for the GPU: a scalar read
(``.item()``, ``int()``, ``bool()``, ``float()``, ``__index__``: ``aten._local_scalar_dense``), ``.tolist()``,
``.numpy()``, ``.cpu()``, ``.to("cpu")``, and the ops whose output shape depends on the data (``nonzero``,
boolean-mask indexing, ``masked_select``, ``unique``, ``repeat_interleave`` without an output size). On this CPU
every tensor stands for a device tensor, so any such read in the path fails the test; the decoded values are
then checked bit for bit against the torch path.
"""
import weakref

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import lightning_act as act
from lightning_act.cuda.launcher import use_runner
from tests.cuda_emulation.checks import assert_same_bits
from tests.cuda_emulation.emulator import requires_gxx

# Tensor methods that copy a value to the host (the scalar conversions also reach _local_scalar_dense below), and
# the functions that make a device tensor from host data (a copy from pageable memory, which on CUDA waits too).
HOST_READS = frozenset({"item", "tolist", "numpy", "__array__", "cpu", "__int__", "__bool__", "__float__",
                        "__index__", "__complex__", "new_tensor", "tensor", "as_tensor"})
# ATen ops that read a value on the host: the scalar read, and the ones sizing their output from the data.
SYNCING_OPS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "_unique", "_unique2", "unique_dim",
                         "unique_consecutive"})


class HostReadError(AssertionError):
    pass


def _names_host(value) -> bool:
    return isinstance(value, (str, torch.device)) and torch.device(value).type == "cpu"


class _NoHostReadFunctions(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in HOST_READS:
            raise HostReadError(f"Tensor.{name} reads a device value on the host")
        if name == "to" and (any(_names_host(a) for a in args[1:]) or _names_host(kwargs.get("device"))):
            raise HostReadError("Tensor.to('cpu') copies a device tensor to the host")
        return func(*args, **kwargs)


class _NoHostReadOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self._host_values = weakref.WeakSet()  # tensors lifted from a Python number (``t[i] = 5``'s value)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name == "lift_fresh":
            out = func(*args, **kwargs)
            self._host_values.add(out)
            return out
        if name == "copy_" and args[1] in self._host_values:
            # one element set from a Python number: CUDA tensors take the value as a CPU tensor, copied from
            # pageable memory (a fill_ of a slice, or of the number, is not)
            raise HostReadError("aten.copy_ of a Python number into one element copies host memory to the device")
        if name in SYNCING_OPS:
            raise HostReadError(f"aten.{name} reads a device value on the host")
        if name in ("index", "index_put", "index_put_") and any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] if i is not None):
            raise HostReadError(f"aten.{name} with a boolean mask sizes its output from the data")
        if name == "repeat_interleave" and kwargs.get("output_size") is None and len(args) < 4:
            raise HostReadError("aten.repeat_interleave without output_size sizes its output from the data")
        return func(*args, **kwargs)


class no_host_reads:
    """Context: any host read of a tensor value raises :class:`HostReadError`."""

    def __enter__(self):
        self._modes = (_NoHostReadFunctions(), _NoHostReadOps())
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


@pytest.mark.parametrize("read", [
    lambda t: t.sum().item(), lambda t: int(t[0]), lambda t: bool(t.any()), lambda t: float(t[1]),
    lambda t: [0, 1, 2][t[1]], lambda t: t.tolist(), lambda t: t.cpu(), lambda t: t.to("cpu"), lambda t: t.numpy(),
    lambda t: torch.nonzero(t), lambda t: t[t > 0], lambda t: t.unique(), lambda t: t.repeat_interleave(t),
    lambda t: t.new_tensor(float("inf")), lambda t: torch.tensor(1.0, device=t.device), lambda t: t.__setitem__(-1, 5),
], ids=["item", "int", "bool", "float", "index", "tolist", "cpu", "to_cpu", "numpy", "nonzero", "mask", "unique",
        "repeat_interleave", "new_tensor", "tensor", "set_element"])
def test_the_guard_catches_every_host_read(read):
    t = torch.tensor([0, 1, 2])
    with pytest.raises(HostReadError), no_host_reads():
        read(t)


def test_the_guard_lets_device_side_work_through():
    t = torch.tensor([3.0, -1.0, 2.0])
    with no_host_reads():
        out = torch.cumsum(t, 0)[t.numel() - 1:] + t.amax() + t.abs().to(torch.float16).float()
        t[1:] = 2.0  # a slice set from a number is a fill on the device
        t.narrow(0, 0, 1).fill_(4.0)
    assert out.tolist() == [10.0, 8.0, 9.0] and t.tolist() == [4.0, 2.0, 2.0]


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CODECS = {
    **{f"quantize{bits}": {"name": "quantize", "bits": bits} for bits in (1, 2, 4, 8)},
    "division": {"name": "division"},
    "lorenzo": {"name": "lorenzo", "error_bound": 1e-2},
}


def _data(dtype: torch.dtype) -> torch.Tensor:
    """A (2, 3, 20, 24) activation: smooth, sparse and noisy parts and a few non-finite values, which every codec
    takes (lorenzo stores them raw)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 20, 24, generator=gen)
    x[0, 0] = torch.linspace(-2, 2, 480).view(20, 24)
    x[0, 1] *= torch.rand(20, 24, generator=gen) < 0.1
    x[1, 2, 3, :5] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -0.0])
    return x.to(dtype)


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=["contiguous", "cl"])
@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64], ids=str)
@pytest.mark.parametrize("options", [{"name": "quantize", "bits": 4, "stats_dtype": "bfloat16"}, {"name": "division"}],
                         ids=["quantize-bf16-stats", "division"])
def test_the_torch_paths_encode_makes_no_tensor_from_host_data(options, dtype, memory_format):
    """The torch path's bfloat16 statistics rounded their bounds toward infinities made by ``new_tensor``, a copy
    from the host that on CUDA waits for the device (the H100's sync check caught division's torch path). A small
    tensor: below ``CHUNK_ELEMENTS`` no CPU-only shortcut reads the statistics back."""
    codec = act.codecs.get(**{"backend": "torch", **options})
    x = _data(dtype).to(memory_format=memory_format)
    with no_host_reads():
        packed = codec.encode(x, key=3)
    assert_same_bits(codec.decode(packed), codec.decode(codec.encode(x, key=3)))


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64], ids=str)
@pytest.mark.parametrize("codec", [c for c in CODECS if c != "lorenzo"])  # lorenzo's sizes its payload on the host
def test_the_torch_paths_off_the_cpu_read_nothing_on_the_host(codec, dtype):
    """Encode, stored size and decode of the torch path on ``meta`` tensors, which stand in for CUDA ones: the
    CPU-only shortcuts (reading statistics back to skip work) are off as on a GPU, and a value read raises."""
    options = dict(CODECS[codec])
    codec = act.codecs.get(options.pop("name"), backend="torch", **options)
    x = _data(dtype).to("meta")
    with no_host_reads():
        packed = codec.encode(x, key=3)
        nbytes = packed.nbytes
        out = codec.decode(packed)
    assert (out.shape, out.dtype, out.device.type) == (x.shape, dtype, "meta")
    assert nbytes == codec.encode(_data(dtype), key=3).nbytes


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("codec", list(CODECS))
@pytest.mark.toolchain
@requires_gxx
def test_codec_cuda_paths_never_read_a_device_value_on_the_host(runner, codec, dtype):
    """Encode, the stored size and decode through the kernels (emulated), under the guard; the decode equals the
    torch path's bit for bit."""
    options = dict(CODECS[codec])
    name = options.pop("name")
    x = _data(dtype)
    if name != "lorenzo":
        x = torch.nan_to_num(x, nan=0.0, posinf=3.0, neginf=-3.0)  # lossy codecs: finite inputs
    runner.launches.clear()
    with use_runner(runner), no_host_reads():
        kernels = act.codecs.get(name, backend="cupy", **options)
        packed = kernels.encode(x, key=5)
        nbytes = packed.nbytes
        decoded = kernels.decode(packed)
    assert runner.launches, "the kernel path did not run"
    assert nbytes == sum(b.numel() * b.element_size() for b in packed.buffers.values()) > 0
    reference = act.codecs.get(name, backend="torch", **options)
    assert_same_bits(decoded, reference.decode(reference.encode(x, key=5)))


@pytest.mark.toolchain
@requires_gxx
def test_lorenzo_trim_queue_never_reads_a_device_value_on_the_host(runner, monkeypatch):
    """The lazy trim's host side, with CPU stand-ins for pinned slots and events (tests/test_cuda_lorenzo.py):
    tracking an encode (its size copied into a host slot, an event recorded) and polling before the GPU is done
    read nothing on the host; once done, the poll reads the host slot and trims."""
    from lightning_act.codecs import lorenzo as codec_lorenzo
    from lightning_act.cuda.lorenzo import PayloadTrims
    from tests.host_path import FakeTrimOps

    trims = PayloadTrims(FakeTrimOps())
    monkeypatch.setattr(codec_lorenzo, "TRIMS", trims)
    x = _data(torch.float32)
    with use_runner(runner), no_host_reads():
        codec = act.codecs.get("lorenzo", backend="cupy", error_bound=1e-2)
        packed = codec.encode(x, key=5)
        reserved = packed.nbytes
        codec.encode(x, key=5)
        trims.poll()
    assert len(trims) == 2
    for event in trims.ops.recorded():
        event.done = True
    trims.poll()
    assert len(trims) == 0 and packed.nbytes < reserved


# ---- the 1-bit mask codecs (bitmask, positive_mask, scaled_mask as the dropout rule builds it) ----

def _dropout_rule_codec(noise: torch.Tensor):
    """The codec the engine's rule picks for CPU dropout's float noise (no verification)."""
    from lightning_act.codecs import op_rules

    return op_rules.codec_for_call(op_rules.FunctionCall(torch.nn.functional.dropout, (noise,), {}), noise)


MASK_CODECS = {  # name -> (the codec under test given its input, its torch-path twin, the input from _data)
    "bitmask": (lambda x: act.codecs.get("bitmask", backend="cupy"), lambda: act.codecs.get("bitmask", backend="torch"),
                lambda x: x > 0),
    "positive_mask": (lambda x: act.codecs.get("positive_mask", backend="cupy"),
                      lambda: act.codecs.get("positive_mask", backend="torch"), lambda x: x),
    "dropout rule": (_dropout_rule_codec, lambda: act.codecs.get("scaled_mask", check=False, backend="torch"),
                     lambda x: (x > 0).to(x.dtype) * torch.tensor(1 / 0.9, dtype=x.dtype)),
}


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64], ids=str)
@pytest.mark.parametrize("codec", list(MASK_CODECS))
@pytest.mark.toolchain
@requires_gxx
def test_mask_codec_cuda_paths_never_read_a_device_value_on_the_host(runner, codec, dtype):
    """Encode, the stored size and decode of the mask codecs' kernel path (emulated; the dropout rule's codec with
    its default backend, "auto") under the guard; the decode equals the torch path's bit for bit."""
    build, reference, make = MASK_CODECS[codec]
    x = make(_data(dtype))
    runner.launches.clear()
    with use_runner(runner), no_host_reads():
        kernels = build(x)
        packed = kernels.encode(x, key=5)
        nbytes = packed.nbytes
        decoded = kernels.decode(packed)
    assert [launch[1] for launch in runner.launches] == ["mask_encode", "mask_decode"]
    assert nbytes == sum(b.numel() * b.element_size() for b in packed.buffers.values()) > 0
    assert_same_bits(decoded, reference().decode(reference().encode(x, key=5)))


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64], ids=str)
@pytest.mark.toolchain
@requires_gxx
def test_negative_infinity_mask_cuda_path_never_reads_a_device_value_on_the_host(runner, dtype):
    """The log-probability rules' wrapper around quantize (``-inf`` masked at 1 bit, values by chunks of whole
    groups) through the quantize and bitmask kernels, under the guard: each chunk's form one allocation, kept as
    its bytes and rebuilt on decode; the same bits as the torch path."""
    from lightning_act.codecs.negative_infinity import NegativeInfinityMask

    x = torch.nan_to_num(_data(dtype), nan=0.0, posinf=3.0, neginf=-3.0)
    x = x.masked_fill(x > 1, float("-inf"))
    runner.launches.clear()
    with use_runner(runner), no_host_reads():
        kernels = NegativeInfinityMask(act.codecs.get("quantize", bits=4, backend="cupy"), backend="cupy")
        packed = kernels.encode(x, key=5)
        nbytes = packed.nbytes
        decoded = kernels.decode(packed)
    assert {launch[1] for launch in runner.launches} >= {"mask_encode", "mask_decode"}
    assert len(runner.launches) > 2 and nbytes == sum(b.numel() * b.element_size() for b in packed.buffers.values())
    reference = NegativeInfinityMask(act.codecs.get("quantize", bits=4, backend="torch"), backend="torch")
    assert_same_bits(decoded, reference.decode(reference.encode(x, key=5)))
    assert torch.equal(decoded == float("-inf"), x == float("-inf"))


@pytest.mark.toolchain
@requires_gxx
def test_checked_scaled_mask_reads_its_verdict_on_the_host(runner):
    """The guard sees the mask path's host reads where there are some: scaled_mask with check=True (the default,
    used where a tensor's values are not known beforehand) reads its verification's result, by design; here an
    additive 0/-inf mask, whose maximum is not its value, so the codec looks for its first non-zero element.
    (Its first verdict, ``torch.equal``, returns a host bool without ``_local_scalar_dense`` on CPU, which the
    guard does not see; on CUDA it waits for the device too.)"""
    additive = torch.where(_data(torch.float32) > 0, float("-inf"), 0.0)
    with use_runner(runner), pytest.raises(HostReadError), no_host_reads():
        act.codecs.get("scaled_mask", backend="cupy").encode(additive)
