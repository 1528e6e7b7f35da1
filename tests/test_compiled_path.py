"""backend='compile' (issue #20 item 5): the quantize format's chunk pipeline through torch.compile stores and
decodes the bits of the specification (formats.quantize's quantize_spec / dequantize_spec).

Each compiled variant (bits, group size, value dtype, statistics dtype) costs an inductor compilation (seconds to
tens of seconds on a loaded 2-core runner), so the cases below cover every bits value, value dtype and statistics
dtype in five variants, each checked on every odd size, special values and layouts (the chunk length is dynamic:
sizes do not compile again)."""
import pytest
import torch

import lightning_act as act
from lightning_act import rng
from lightning_act.codecs import backend
from lightning_act.formats import compiled
from lightning_act.formats._bitpack import pack_codes_
from lightning_act.formats.floats import INT_VIEW
from lightning_act.formats.quantize import Workspace, chunk_elements, dequantize_spec, encode_groups, quantize_spec
from tests.codec_peaks import assert_peaks_within

pytestmark = pytest.mark.skipif(not torch._dynamo.is_dynamo_supported(), reason="torch.compile unsupported here")

# (bits, value dtype, statistics dtype): every bits value, value dtype and statistics dtype at least once
VARIANTS = [(1, torch.float32, torch.float32), (2, torch.bfloat16, torch.bfloat16), (4, torch.float16, torch.float32),
            (8, torch.float64, torch.bfloat16), (4, torch.float32, torch.float32)]
GROUP = 256
# empty, one element, short of a group, a group and one, whole groups, and more than one chunk with a short group
SIZES = [0, 1, 200, GROUP + 1, 8 * GROUP, chunk_elements(torch.device("cpu")) + 3 * GROUP + 5]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(INT_VIEW.get(t.dtype, torch.uint8))


def _assert_same_bits(got, expected):
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape
        assert torch.equal(_bits(g), _bits(e))


def _values(n: int, dtype: torch.dtype) -> torch.Tensor:
    """Gaussian values with NaN, +-inf, a constant group and huge magnitudes sprinkled in."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g, dtype=torch.float64) * 3
    if n > 4 * GROUP:
        x[5], x[GROUP + 7], x[2 * GROUP + 1] = float("nan"), float("inf"), -float("inf")
        x[3 * GROUP: 4 * GROUP] = 0.25  # step 0
        x[-3] = torch.finfo(dtype).max
    return x.to(dtype)


@pytest.fixture(scope="module", params=VARIANTS, ids=lambda v: f"{v[0]}bit-{v[1]}-stats-{v[2]}".replace("torch.", ""))
def variant(request):
    return request.param


@pytest.mark.parametrize("n", SIZES)
def test_encode_and_decode_are_the_specification_bit_for_bit(variant, n):
    bits, dtype, stats_dtype = variant
    x = _values(n, dtype)
    expected = quantize_spec(x, bits, GROUP, stats_dtype, seed=3, key=11)
    _assert_same_bits(compiled.quantize_compiled(x, bits, GROUP, stats_dtype, 3, 11), expected)
    decoded = compiled.dequantize_compiled(*expected, n, bits, GROUP, dtype)
    _assert_same_bits([decoded], [dequantize_spec(*expected, n, bits, GROUP, dtype)])


def test_codec_encodes_channels_last_input_as_the_torch_backend():
    x = torch.relu(torch.randn(3, 40, 7, 9)).to(memory_format=torch.channels_last)
    fast, reference = (act.codecs.get("quantize", bits=4, backend=b) for b in ("compile", "torch"))
    packed, expected = fast.encode(x, key=5), reference.encode(x, key=5)
    _assert_same_bits(packed.buffers.values(), expected.buffers.values())
    _assert_same_bits([fast.decode(packed)], [reference.decode(expected)])


def test_counter_crosses_a_2_to_the_32_element_index_like_the_torch_path():
    """A chunk starting 100 elements below 2**32 takes the next high word's stream key past it (the tensors of
    the other tests are far too small to reach it)."""
    bits, group = 4, GROUP
    x = _values(2 * group, torch.float32)
    start, base = 2**32 - 100, rng.stream_base(3, 11)
    encode = compiled._compiled("encode", bits, group, torch.float32, torch.float32, "cpu")
    codes, mn, step = encode(x, compiled.counters(base, [start], x.device)[0], torch.tensor(15.0))
    payload = torch.empty(x.numel() * bits // 8, dtype=torch.uint8)
    mn_ref, step_ref = torch.empty(2), torch.empty(2)
    encode_groups(x, start, group, bits, torch.float32, base, Workspace(x.numel(), x.device), payload, mn_ref,
                  step_ref)
    packed = pack_codes_(codes, bits, torch.empty_like(payload))
    _assert_same_bits([packed, mn, step], [payload, mn_ref, step_ref])


def _small_cnn():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(16, 16, 3),
                               torch.nn.GELU(), torch.nn.Flatten(), torch.nn.Linear(16 * 14 * 14, 10))


def test_training_step_gradients_equal_the_torch_backend_bit_for_bit():
    x = torch.randn(8, 3, 16, 16)
    grads = {}
    for name in ("torch", "compile"):
        model = _small_cnn()
        compressor = act.ActivationCompressor(model, act.ACTConfig(bits=4, min_numel=0, backend=name))
        with compressor.compress():
            loss = model(x).square().mean()
        loss.backward()
        assert compressor.stats().ratio > 4
        grads[name] = [p.grad for p in model.parameters()]
    _assert_same_bits(grads["compile"], grads["torch"])


def test_compile_backend_never_runs_the_kernels():
    assert not backend.uses_kernels("compile", torch.zeros(4))


@pytest.mark.parametrize("broken,match", [
    ("dynamo", r"backend='compile' needs torch.compile, which this platform or Python does not support.*"
               r"use backend='torch'"),
    ("compiler", r"backend='compile' needs a C\+\+ compiler for torch.compile's inductor \(no g\+\+\): install one"),
])
def test_config_and_codec_fail_when_built_where_torch_compile_cannot_run(monkeypatch, broken, match):
    if broken == "dynamo":
        monkeypatch.setattr("torch._dynamo.eval_frame.is_dynamo_supported", lambda: False)
    else:
        def no_compiler():
            raise RuntimeError("no g++")
        monkeypatch.setattr("torch._inductor.cpp_builder.get_cpp_compiler", no_compiler)
    with pytest.raises(RuntimeError, match=match):
        act.codecs.get("quantize", backend="compile")
    with pytest.raises(RuntimeError, match=match):
        act.ACTConfig(backend="compile")


def test_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match=r"backend='inductor'; expected one of .*'compile'"):
        act.codecs.get("quantize", backend="inductor")


def test_new_lengths_reuse_the_compiled_graphs():
    """The chunk length is dynamic: after the first sizes, other sizes (a last chunk of any length) compile
    nothing more."""
    from torch._dynamo.utils import counters

    codec, reference = (act.codecs.get("quantize", bits=4, backend=b) for b in ("compile", "torch"))
    codec.decode(codec.encode(torch.randn(3 * GROUP + 7)))
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0
    for n in (2 * GROUP, 5 * GROUP + 1, chunk_elements(torch.device("cpu")) + 9 * GROUP + 3):
        x = torch.randn(n)
        assert torch.equal(codec.decode(codec.encode(x)), reference.decode(reference.encode(x)))
    assert counters["stats"]["unique_graphs"] == graphs


def test_encode_and_decode_allocate_their_results_and_chunk_sized_workspaces():
    """As on the torch path (tests/test_transients.py): a 16 MiB input costs its outputs plus workspaces of a
    chunk's size (the codes and the unpacking's scratch, a byte per element of 4 torch-path chunks each)."""
    slack = max(2 * 2**20, 16 * chunk_elements(torch.device("cpu")))
    codec = act.codecs.get("quantize", bits=4, backend="compile")
    assert_peaks_within(codec, torch.randn(1 << 22), slack)
