"""Compression inside torch.compile'd regions (lightning_act.compiled_regions): the GraphModule hooks AOTAutograd
inlines into compiled graphs, the decode op, the pass that places it, and the engine's hooks in the eager code
around compiled graphs. Each compiling test costs an inductor compilation (seconds): models are small."""
import contextlib
import math
import re
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

import lightning_act as act
from lightning_act import compiled_regions
from lightning_act.formats._bitpack import pack_codes, pack_codes_traced, packed_nbytes
from lightning_act.cuda.launcher import use_runner
from lightning_act.formats.quantize import dequantize_reference, quantize_reference
from lightning_act.model_prep import has_compiled_parts
from lightning_act.profiling import measure_step_memory
from tests.cuda_emulation.checks import assert_same_bits
from tests.cuda_emulation.emulator import requires_gxx
from tests.host_path import RecordingRunner

pytestmark = pytest.mark.skipif(not torch._dynamo.is_dynamo_supported() or not compiled_regions.supported(),
                                reason="torch.compile with inlined saved-tensor hooks unsupported here")

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _mlp(width: int = 64, depth: int = 3) -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Linear(16, width), nn.GELU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 4))


def _gradients(model: nn.Module, step) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    step().float().square().mean().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _compressed(compressor, net, autocast: torch.dtype | None = None):
    def step(x):
        with compressor.compress(), torch.autocast("cpu", dtype=autocast or torch.bfloat16,
                                                   enabled=autocast is not None):
            return net(x)

    return step


def _compiled_records(compressor):
    return [r for r in compressor.stats().records if r.phase == "compiled"]


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [0, 1, 7, 8, 33, 1000])
def test_traced_packing_is_pack_codes(bits, n):
    codes = torch.randint(0, 1 << bits, (n,), dtype=torch.uint8)
    assert torch.equal(pack_codes_traced(codes, bits), pack_codes(codes.clone(), bits))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 255, 256, 3 * 256 + 5])
@pytest.mark.parametrize("stats_dtype", [torch.float32, torch.bfloat16])
def test_traced_encode_is_the_quantize_format(dtype, n, stats_dtype):
    """What the forward graph stores decodes with the format's reference within a step of each group, its
    statistics those of the group's own elements, in the format's sizes."""
    bits, group = 4, 256
    x = (torch.randn(n, dtype=torch.float64) * 3).to(dtype)
    payload, mn, step = compiled_regions.encode_traced(x, bits, group, stats_dtype)
    groups = -(-n // group)
    assert payload.dtype == torch.uint8 and payload.numel() == packed_nbytes(n, bits)
    assert mn.shape == step.shape == (groups,) and mn.dtype == step.dtype == stats_dtype
    x32 = x.float().double()  # the format's statistics are of the float32 values (float64 inputs rounded)
    padded = torch.cat([x32, x32[-1:].expand(groups * group - n)]).view(groups, group)
    assert torch.all(mn.double() <= padded.amin(dim=1))
    y = dequantize_reference(payload, mn, step, n, bits, group, dtype)
    assert y.dtype == dtype and y.shape == (n,)
    bound = step.double().repeat_interleave(group)[:n] * 1.01 + padded.abs().amax() * 2.0 ** -7
    assert torch.all((y.double() - x.double()).abs() <= bound)


@pytest.mark.parametrize("stats_dtype", [torch.float32, torch.bfloat16])
def test_the_decode_op_is_the_formats_decode_without_a_compressor(stats_dtype):
    """A compiled graph can outlive its compressor: the op then decodes with a default codec of the stored
    statistics' dtype, the same values."""
    x = torch.randn(3 * 256 + 5)
    payload, mn, step = compiled_regions.encode_traced(x, 2, 256, stats_dtype)
    decoded = torch.ops.lightning_act.dequantize(payload, mn, step, x.numel(), 2, 256, torch.float32, -1)
    assert torch.equal(decoded, dequantize_reference(payload, mn, step, x.numel(), 2, 256, torch.float32))


def _encoded_with_specials(n: int, dtype: torch.dtype, bits: int, group: int, stats_dtype: torch.dtype):
    """The reference encode of ``n`` values of ``dtype`` with a NaN, an infinity and a -0.0 where they fit."""
    x = (torch.randn(n, dtype=torch.float64) * 3).to(dtype)
    for i, special in zip((3, 300, 5), (math.nan, math.inf, -0.0)):
        if i < n:
            x[i] = special
    return quantize_reference(x, bits, group, stats_dtype, seed=0, key=n)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("n, group", [(0, 256), (1, 256), (255, 256), (3 * 256 + 5, 256), (100, 32)])
@pytest.mark.parametrize("stats_dtype", [torch.float32, torch.bfloat16])
def test_the_traced_decode_is_the_formats_decode_bit_for_bit(dtype, bits, n, group, stats_dtype):
    """What compiled backwards inline for the decode op: the reference's bits, NaN canonical."""
    payload, mn, step = _encoded_with_specials(n, dtype, bits, group, stats_dtype)
    decoded = compiled_regions.decode_traced(payload, mn, step, n, bits, group, dtype)
    assert_same_bits(decoded, dequantize_reference(payload, mn, step, n, bits, group, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [1, 4, 8])
@pytest.mark.parametrize("n", [0, 1, 3 * 256 + 5])
@pytest.mark.parametrize("stats_dtype", [torch.float32, torch.bfloat16])
def test_the_traced_buffer_decode_is_the_buffer_ops_bit_for_bit(dtype, bits, n, stats_dtype):
    """The kernel encode's one buffer (here laid out from the reference's parts), decoded by slices and views."""
    parts = _encoded_with_specials(n, dtype, bits, 256, stats_dtype)
    buffer = compiled_regions.OneBuffer.empty(compiled_regions.encoded_layout(n, bits, 256, stats_dtype), "cpu")
    for name, part in zip(("payload", "mn", "step"), parts):
        buffer[name].copy_(part)
    assert_same_bits(compiled_regions.decode_buffer_traced(buffer.data, n, bits, 256, dtype, stats_dtype),
                     torch.ops.lightning_act.dequantize_buffer(buffer.data, n, bits, 256, dtype, stats_dtype, -1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_traced_decode_compiled_by_inductor_keeps_the_bits(dtype):
    """Inductor's C++ fuses the decode into one loop without contracting its multiply and add (one shape per
    dtype: each compiles)."""
    n, bits, group = 70_001, 4, 256
    payload, mn, step = _encoded_with_specials(n, dtype, bits, group, torch.float32)
    decode = torch.compile(compiled_regions.decode_traced, fullgraph=True, dynamic=False)
    assert_same_bits(decode(payload, mn, step, n, bits, group, dtype),
                     dequantize_reference(payload, mn, step, n, bits, group, dtype))
    torch._dynamo.reset()


@pytest.mark.parametrize("signs", [False, True], ids=["values", "signs"])
@pytest.mark.parametrize("reader", ["convolutions", "reductions"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_inductor_writes_a_decode_out_at_most_once_in_its_dtype(dtype, reader, signs):
    """A ReLU output read by two convolutions' backwards (a ResNet block's, channels_last) or by batch norm's
    (per-channel sums): at most one buffer of its size, in its float dtype. A NaN select made last in the integer
    view was an integer buffer and a float copy; signs restored after the stack, a second buffer."""
    from torch._inductor.utils import run_and_get_code

    batch, channels, side, bits = 2, 64, 4, 4
    n = batch * channels * side * side
    payload, mn, step = quantize_reference(torch.randn(n, dtype=dtype), bits, 256, torch.float32, seed=0, key=1)
    packed_signs = pack_codes_traced(torch.randn(n).gt(0).to(torch.uint8), 1) if signs else None
    weights = [torch.randn(out, channels, 1, 1, dtype=dtype) for out in (8, 16)]
    grads = [torch.randn(batch, out, side, side, dtype=dtype).to(memory_format=torch.channels_last)
             for out in (8, 16, channels)]

    def backward(payload, mn, step, packed_signs):
        decoded = compiled_regions.decode_traced(payload, mn, step, n, bits, 256, dtype, packed_signs)
        x = decoded.view(batch, side, side, channels).permute(0, 3, 1, 2)
        if reader == "reductions":
            return [(x * grads[-1]).sum(dim=(0, 2, 3)), x.sum(dim=(0, 2, 3))]
        return [torch.ops.aten.convolution_backward(grad, x, weight, [0], [1, 1], [0, 0], [1, 1], False, [0, 0], 1,
                                                    [False, True, False])[1] for grad, weight in zip(grads, weights)]

    compiled, (code,) = run_and_get_code(torch.compile(backward, fullgraph=True), payload, mn, step, packed_signs)
    eager = backward(payload, mn, step, packed_signs)
    torch._dynamo.reset()
    for got, expected in zip(compiled, eager):
        torch.testing.assert_close(got, expected)
    buffers = re.findall(r"empty_strided_cpu\(\(([^)]*)\), \([^)]*\), (torch\.\w+)\)", code)
    assert [dtype for shape, dtype in buffers
            if math.prod(int(d) for d in shape.split(",") if d.strip()) == n] == [str(dtype)], code


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [1, 4, 8])
@pytest.mark.parametrize("n", [1, 9, 3 * 256 + 5])
def test_traced_signs_and_masks_are_the_ops_bit_for_bit(dtype, bits, n):
    """The decode with a ReLU output's signs restored in its loop, as the decode op restores them after; a mask
    unpacked as the mask op does."""
    payload, mn, step = _encoded_with_specials(n, dtype, bits, 256, torch.float32)
    signs = pack_codes_traced(torch.randn(n).gt(0).to(torch.uint8), 1)
    assert_same_bits(compiled_regions.decode_traced(payload, mn, step, n, bits, 256, dtype, signs),
                     torch.ops.lightning_act.dequantize(payload, mn, step, n, bits, 256, dtype, -1, signs))
    assert torch.equal(compiled_regions.unpack_mask_traced(signs, n),
                       torch.ops.lightning_act.unpack_mask(signs, n, -1))


class _Counting:
    """A kernel runner that records each kernel's name and runs it on ``inner``."""

    device_type = "cpu"

    def __init__(self, inner):
        self.inner, self.kernels = inner, []

    def launch(self, source, kernel, *args) -> None:
        self.kernels.append(kernel)
        self.inner.launch(source, kernel, *args)


@pytest.mark.toolchain
@requires_gxx
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 255, 3 * 256 + 5])
@pytest.mark.parametrize("stats_dtype", ["float32", "bfloat16"])
def test_the_kernel_encode_op_stores_the_formats_bits_with_a_fresh_key_per_call(runner, dtype, n, stats_dtype):
    """``lightning_act::quantize`` (a compiled forward's encode where the kernels run) is the kernel's encode in
    one buffer, its parts bit for bit the format's reference at the codec's seed and keys 1, 2, ...; its fake size
    is the real one; ``dequantize_buffer`` decodes it as the format does."""
    compressor = act.ActivationCompressor(nn.Linear(1, 1), act.ACTConfig(bits=4, adaptive=False, seed=5,
                                                                         stats_dtype=stats_dtype))
    hooks = compiled_regions.GraphHooks(compressor)
    stats = compiled_regions.STATS_DTYPES[stats_dtype]
    x = (torch.randn(n) * 3).to(dtype)
    counting = _Counting(runner)
    with use_runner(counting):
        buffers = [torch.ops.lightning_act.quantize(x, 4, 256, stats, hooks.owner) for _ in range(2)]
        decoded = torch.ops.lightning_act.dequantize_buffer(buffers[0], n, 4, 256, dtype, stats, hooks.owner)
    assert counting.kernels == ["quantize_encode"] * 2 + ["quantize_decode"]
    layout = compiled_regions.encoded_layout(n, 4, 256, stats)
    for key, buffer in enumerate(buffers, start=1):
        assert buffer.dtype == torch.uint8 and buffer.numel() == layout.total
        parts = compiled_regions.OneBuffer(buffer, layout)
        expected = quantize_reference(x, 4, 256, stats, 5, key)
        for name, part in zip(("payload", "mn", "step"), expected):
            assert_same_bits(parts[name], part)
    assert_same_bits(decoded, dequantize_reference(*quantize_reference(x, 4, 256, stats, 5, 1), n, 4, 256, dtype))
    assert n == 1 or not torch.equal(buffers[0], buffers[1])  # one element: its group's minimum, code 0
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = torch.ops.lightning_act.quantize(mode.from_tensor(x), 4, 256, stats, hooks.owner)
    assert (fake.shape, fake.dtype) == (buffers[0].shape, torch.uint8)
    assert compiled_regions._buffer_bytes(n, 4, 256, stats) == layout.total
    # where the kernels stopped running after the graph was traced, the torch path fills the same layout (key 3)
    fallback = compiled_regions.OneBuffer(torch.ops.lightning_act.quantize(x, 4, 256, stats, hooks.owner), layout)
    for name, part in zip(("payload", "mn", "step"), quantize_reference(x, 4, 256, stats, 5, 3)):
        assert_same_bits(fallback[name], part)


@pytest.mark.skipif(not hasattr(torch.Tag, "cudagraph_unsafe"), reason="this torch has no cudagraph_unsafe tag")
def test_the_compiled_ops_keep_cuda_graphs_from_replaying_them():
    """Each op call changes Python state a CUDA graph replay would skip (a fresh noise key, a record), so every op
    is tagged ``cudagraph_unsafe``: inductor's check finds it in a graph (mode="reduce-overhead" then runs that
    graph without CUDA graphs, or partitions the graph around it)."""
    from torch._inductor.utils import get_first_incompatible_cudagraph_node

    ops = torch.ops.lightning_act
    for op in (ops.quantize, ops.dequantize_buffer, ops.dequantize, ops.unpack_mask):
        assert torch.Tag.cudagraph_unsafe in op.default.tags
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    encode = graph.call_function(ops.quantize.default, (x, 4, 256, torch.float32, 0))
    graph.output(graph.call_function(torch.ops.aten.add.Tensor, (encode, 1)))
    assert get_first_incompatible_cudagraph_node(torch.fx.GraphModule(torch.nn.Module(), graph)) is encode


def test_the_compiled_ops_take_the_kernel_path_only_for_their_codecs_format_and_runner():
    """The ops call the codec's kernels straight (``GraphHooks.kernels``) for the compressor's own format on the
    installed runner, looked up again when the runner changes; another group size or statistics dtype (a graph
    compiled for other settings) goes through the codec, and decodes as the format says."""
    compressor = act.ActivationCompressor(nn.Linear(1, 1), act.ACTConfig(bits=4, adaptive=False, seed=3))
    hooks = compiled_regions.GraphHooks(compressor)
    x = torch.randn(300)
    recording = RecordingRunner()
    with use_runner(recording):
        assert hooks.kernels(4, 256, torch.float32, x, x.dtype)[1] is recording
        assert hooks.kernels(4, 128, torch.float32, x, x.dtype) is None
        assert hooks.kernels(4, 256, torch.bfloat16, x, x.dtype) is None
        buffer = torch.ops.lightning_act.quantize(x, 4, 256, torch.float32, hooks.owner)
    assert recording.kernels == ["quantize_encode"]
    assert buffer.numel() == compiled_regions.encoded_layout(300, 4, 256, torch.float32).total
    assert hooks.kernels(4, 256, torch.float32, x, x.dtype) is None  # no runner: CPU tensors take the torch path
    other = torch.ops.lightning_act.quantize(x, 4, 128, torch.float32, hooks.owner)
    layout = compiled_regions.encoded_layout(300, 4, 128, torch.float32)
    parts = compiled_regions.OneBuffer(other, layout)
    # a default codec's (seed 0) at the hooks' next key, 2: the buffer holds the op's format
    expected = quantize_reference(x, 4, 128, torch.float32, 0, 2)
    for name, part in zip(("payload", "mn", "step"), expected):
        assert_same_bits(parts[name], part)
    decoded = torch.ops.lightning_act.dequantize_buffer(other, 300, 4, 128, x.dtype, torch.float32, hooks.owner)
    assert_same_bits(decoded, dequantize_reference(*expected, 300, 4, 128, x.dtype))
    # what compiled backwards inline for the op: the same bits
    assert_same_bits(compiled_regions.decode_buffer_traced(other, 300, 4, 128, x.dtype, torch.float32), decoded)


@pytest.mark.toolchain
@requires_gxx
def test_where_the_kernels_run_a_compiled_forward_encodes_with_them(runner):
    """One kernel encode per compressed tensor in the compiled forward, no traced encode; the backward decodes
    the kernels' buffers with traced ops (no kernel launch, no Python per tensor): the gradients are the
    uncompressed step's within the format's error, with fresh noise each step."""
    model = _mlp(width=256)
    x = torch.randn(64, 16)
    reference = _gradients(model, lambda: model(x))
    counting = _Counting(runner)
    with use_runner(counting):
        net = torch.compile(model)
        compressor = act.ActivationCompressor(net, act.ACTConfig(bits=4, adaptive=False, min_numel=1024))
        step = _compressed(compressor, net)
        grads = [_gradients(model, lambda: step(x)) for _ in range(2)]
    for g in grads:
        assert torch.nn.functional.cosine_similarity(g, reference, dim=0) > 0.995
    assert not torch.equal(grads[0], grads[1])
    records = _compiled_records(compressor)
    assert len(records) >= 3 and all(r.codec == "quantize" and r.bits == 4.0 for r in records)
    assert counting.kernels.count("quantize_encode") == 2 * len(records)
    assert "quantize_decode" not in counting.kernels
    torch._dynamo.reset()


@pytest.mark.parametrize("n", [1, 8, 4099])
def test_masks_pack_to_one_bit_losslessly(n):
    flags = torch.rand(n) > 0.3
    payload = pack_codes_traced(flags.to(torch.uint8), 1)
    assert payload.numel() == packed_nbytes(n, 1)
    assert torch.equal(torch.ops.lightning_act.unpack_mask(payload, n, -1), flags)


@pytest.mark.toolchain
@requires_gxx
@pytest.mark.parametrize("n", [1, 4099])
def test_where_the_kernels_run_masks_decode_with_the_bitmask_kernel(runner, n):
    """``unpack_mask`` decodes with the compressor's ``bitmask`` codec: one ``mask_decode`` launch where the
    kernels run (the traced pack is that codec's layout), the flags exactly."""
    compressor = act.ActivationCompressor(nn.Linear(1, 1), act.ACTConfig(bits=4, adaptive=False))
    hooks = compiled_regions.GraphHooks(compressor)
    flags = torch.rand(n) > 0.3
    payload = pack_codes_traced(flags.to(torch.uint8), 1)
    counting = _Counting(runner)
    with use_runner(counting):
        decoded = torch.ops.lightning_act.unpack_mask(payload, n, hooks.owner)
    assert counting.kernels == ["mask_decode"] and torch.equal(decoded, flags)


def test_a_compiled_models_dropout_masks_are_stored_at_one_bit():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 256), nn.GELU(), nn.Dropout(0.25), nn.Linear(256, 256), nn.Tanh(),
                          nn.Linear(256, 4))
    net = torch.compile(model)
    compressor = act.ActivationCompressor(net, act.ACTConfig(bits=4, adaptive=False, min_numel=1024))
    grads = _gradients(model, lambda: _compressed(compressor, net)(torch.randn(64, 16)))
    assert torch.isfinite(grads).all()
    masks = [r for r in _compiled_records(compressor) if r.codec == "bitmask"]
    assert masks and all((r.dtype, r.bits, r.original_bytes, r.stored_bytes) == (torch.bool, 1.0, 64 * 256, 64 * 256 // 8)
                         for r in masks)


def test_each_decode_moves_right_before_its_first_reader():
    graph = torch.fx.Graph()
    payload, mn, step, grad = (graph.placeholder(name) for name in ("payload", "mn", "step", "grad"))
    decoded = graph.call_function(torch.ops.lightning_act.dequantize.default,
                                  (payload, mn, step, 8, 4, 256, torch.float32, -1))
    view = graph.call_function(torch.ops.aten.view.default, (decoded, [2, 4]))
    squared = graph.call_function(torch.ops.aten.mul.Tensor, (grad, grad))
    added = graph.call_function(torch.ops.aten.add.Tensor, (squared, view))
    graph.output(added)
    compiled_regions._sink_decodes(graph)
    assert [n.name for n in graph.nodes][4:] == [squared.name, decoded.name, view.name, added.name, "output"]


def _inlined_and_op_steps(monkeypatch, inline: bool):
    """``(gradients, compiled records, codec decode calls)`` of a compiled step whose backward decodes with the
    traced ops inlined by the sink pass (``inline``) or, where tracing them fails, with the decode ops."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(16, 256), nn.GELU(), nn.Dropout(0.25), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 4))
    x = torch.randn(64, 16)
    net = torch.compile(model)
    compressor = act.ActivationCompressor(net, act.ACTConfig(bits=4, adaptive=False, min_numel=1024))
    calls = []
    for codec in (compressor.codec("quantize", 4), compressor.codec("bitmask")):
        decode = type(codec).decode
        monkeypatch.setattr(type(codec), "decode", lambda self, packed, _d=decode: calls.append(1) or _d(self, packed))
    if not inline:
        def refuse(node):
            raise RuntimeError("tracing refused by the test")
        monkeypatch.setattr(compiled_regions, "_traced_decode", refuse)
    with inductor_config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        step = _compressed(compressor, net)
        _gradients(model, lambda: step(x))  # compiles (which draws random numbers)
        calls.clear()
        torch.manual_seed(2)
        grads = _gradients(model, lambda: step(x))
    torch._dynamo.reset()
    records = sorted((r.codec, r.dtype, r.bits, r.original_bytes, r.stored_bytes) for r in _compiled_records(compressor))
    return grads, records, len(calls)


def test_a_compiled_backward_runs_no_python_per_saved_tensor(monkeypatch):
    """The sink pass replaces each decode op with the traced ops that compute it (inductor fuses them into the
    backward's loops) and counts the graph's tensors with one ``record_decoded`` call: no codec decode runs, and
    the statistics and gradients are those of the decode ops, which run where tracing fails (with a warning)."""
    grads, records, calls = _inlined_and_op_steps(monkeypatch, inline=True)
    assert calls == 0
    assert len(records) >= 4 and {r[0] for r in records} == {"quantize", "bitmask"}  # activations, dropout's masks
    with pytest.warns(RuntimeWarning, match="tracing refused by the test"):
        op_grads, op_records, op_calls = _inlined_and_op_steps(monkeypatch, inline=False)
    assert op_calls == len(op_records) == len(records)
    assert op_records == records
    # the same noise and decoded bits; inductor's fused loops sum in another order than the ops' own
    torch.testing.assert_close(grads, op_grads, rtol=1e-3, atol=1e-6)


class _CountingPass(CustomGraphPass):
    def __init__(self):
        self.calls = 0

    def __call__(self, graph):
        self.calls += 1

    def uuid(self):
        return b"counting"


@pytest.mark.parametrize("user_pass", ["none", "callable", "custom pass", "tuple"])
def test_the_sink_pass_is_one_pass_that_runs_the_users_first(user_pass):
    """One pass, never a tuple (torch 2.11's inductor takes a single post-grad pass); any pass the user set runs
    before it, and inductor's cache is bypassed exactly when it would be for the user's pass alone."""
    calls = []
    counting = _CountingPass()
    before = {"none": None, "callable": lambda graph: calls.append(graph), "custom pass": counting,
              "tuple": (counting, _CountingPass())}[user_pass]
    with inductor_config.patch(post_grad_custom_post_pass=before):
        compiled_regions.install_sink_pass()
        installed = inductor_config.post_grad_custom_post_pass
        compiled_regions.install_sink_pass()  # once
        assert inductor_config.post_grad_custom_post_pass is installed
    assert isinstance(installed, compiled_regions.SinkDecodes)
    graph = torch.fx.Graph()
    graph.output(graph.placeholder("x"))
    installed(graph)
    assert (len(calls), counting.calls) == {"none": (0, 0), "callable": (1, 0), "custom pass": (0, 1),
                                             "tuple": (0, 1)}[user_pass]
    uuid = installed.uuid()
    if user_pass == "callable":
        assert uuid is None
    else:
        assert isinstance(uuid, bytes) and uuid == compiled_regions.SinkDecodes(installed.before).uuid()
        assert uuid != compiled_regions.SinkDecodes((_CountingPass(), counting, counting)).uuid()


@pytest.mark.parametrize("autocast, dtype", [(None, torch.float32), (torch.bfloat16, torch.float32),
                                             (None, torch.float64)])
def test_a_compiled_model_compresses_inside_its_graph(autocast, dtype):
    model = _mlp(width=256).to(dtype)
    x = torch.randn(64, 16, dtype=dtype)
    reference = _gradients(model, lambda: model(x))
    net = torch.compile(model)
    compressor = act.ActivationCompressor(net, act.ACTConfig(bits=4, adaptive=False, min_numel=1024))
    assert compressor.graph_hooks is not None
    step = _compressed(compressor, net, autocast)
    grads = [_gradients(model, lambda: step(x)) for _ in range(2)]
    for g in grads:
        assert torch.nn.functional.cosine_similarity(g, reference, dim=0) > 0.995
    assert not torch.equal(grads[0], grads[1])  # fresh noise each step
    # the hidden activations AOTAutograd saves (its partitioner may recompute some); under autocast also the
    # input's bfloat16 copy
    records = [r for r in _compiled_records(compressor) if r.shape.numel() == 64 * 256]
    assert len(records) >= 3
    itemsize = 2 if autocast else dtype.itemsize
    for r in records:
        assert (r.codec, r.bits, r.original_bytes) == ("quantize", 4.0, 64 * 256 * itemsize)
        assert r.stored_bytes == 64 * 256 // 2 + 2 * 4 * (64 * 256 // 256)  # codes, min and step per group


@pytest.mark.parametrize("kernels", [False, True], ids=["traced encode", "kernel encode"])
def test_the_compiled_steps_peak_falls(kernels):
    """Decoded right before their readers: without SinkDecodes the backward decodes every activation as it
    starts, and the step peaks as the uncompressed one does. The kernel encode (an opaque op, here launching
    nothing: the peak is the buffers') is placed where the traced one is fused, right after its tensor's op."""
    model = _mlp(width=256, depth=8)
    x = torch.randn(2048, 16)
    peaks = {}
    for name, config in (("kept", None), ("compressed", act.ACTConfig(bits=4, adaptive=False))):
        with use_runner(RecordingRunner()) if kernels else contextlib.nullcontext():
            peaks[name] = _compiled_step_peak(model, x, config)
    activation = 2048 * 256 * 4
    assert peaks["kept"] >= 8 * activation, peaks  # 20.3 MiB measured: 16 saved activations, recomputed some
    assert peaks["compressed"] <= 0.55 * peaks["kept"], peaks  # 9.1 MiB measured (traced), 8.1 (kernels)


def _compiled_step_peak(model: nn.Module, x: torch.Tensor, config) -> int:
    net = torch.compile(model)
    compressor = act.ActivationCompressor(net, config) if config else None

    def step():
        with compressor.compress() if compressor else contextlib.nullcontext():
            loss = net(x).square().mean()
        loss.backward()

    for _ in range(2):
        model.zero_grad(set_to_none=True)
        step()
    model.zero_grad(set_to_none=True)
    peak = measure_step_memory(step).peak_bytes
    torch._dynamo.reset()
    return peak


def test_eager_code_between_compiled_graphs_runs_the_engine():
    """A module dynamo leaves eager runs the compressor's own hooks (its records: phase "forward"), the compiled
    parts around it the inlined ones."""
    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.middle, self.last = nn.Linear(16, 256), nn.Linear(256, 256), nn.Linear(256, 4)

        def forward(self, x):
            h = torch.tanh(self.first(x))
            h = torch.compiler.disable(lambda t: torch.tanh(self.middle(t)))(h)
            return self.last(torch.tanh(h))

    model = Model()
    x = torch.randn(64, 16)
    reference = _gradients(model, lambda: model(x))
    net = torch.compile(model)
    compressor = act.ActivationCompressor(net, act.ACTConfig(bits=8, adaptive=False, min_numel=1024))
    grads = _gradients(model, lambda: _compressed(compressor, net)(x))
    assert torch.nn.functional.cosine_similarity(grads, reference, dim=0) > 0.999
    stats = compressor.stats()
    phases = {r.phase for r in stats.records if r.kind == "compressed"}
    assert phases == {"forward", "compiled"}
    # what both kinds of region keep on the device between forward and backward
    assert stats.device_bytes == sum(r.stored_bytes for r in stats.records) > 0


def test_a_model_compiled_around_the_compressors_module_never_compiles_the_engine():
    """``torch.compile(model)`` after ``ActivationCompressor(model)``: the compressor cannot see the compiled graphs,
    and autograd calls its hooks between their graph breaks, in code dynamo evaluates frames in. It compiled the
    engine's hook there op by op (for every step's own hook, minutes a step); the hooks run eagerly now."""
    from torch._dynamo.convert_frame import input_codes

    torch.manual_seed(0)

    class Gated(nn.Module):
        def forward(self, x):
            torch._dynamo.graph_break()
            return x * torch.sigmoid(x)

    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), Gated(), nn.Linear(64, 64), nn.ReLU(), Gated(),
                          nn.Linear(64, 4))
    x = torch.randn(32, 16)
    reference = _gradients(model, lambda: model(x))
    compressor = act.ActivationCompressor(model, act.ACTConfig(bits=8, adaptive=False, min_numel=0))
    torch._dynamo.reset()
    net = torch.compile(model, backend="eager")  # (dynamo's frame evaluation is what matters, not inductor)
    for _ in range(2):
        grads = _gradients(model, lambda: _compressed(compressor, net)(x))
    package = str(Path(act.__file__).parent)
    compiled = {f"{ref().co_filename}:{ref().co_name}" for ref in input_codes.seen if ref() is not None}
    assert not {name for name in compiled if name.startswith(package)}, compiled
    assert compressor.stats().num_compressed >= 4  # the engine's hooks ran, on every kind of region
    assert torch.nn.functional.cosine_similarity(grads, reference, dim=0) > 0.999
    torch._dynamo.reset()


def test_an_attention_mask_the_backward_reads_is_kept_exact():
    """A padded batch through HF BERT's SDPA attention: the backward reads the additive mask (0 and -inf).
    Quantized, its groups would decode to NaN, and every gradient with them."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=200, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
    model = transformers.BertForSequenceClassification(cfg).train()
    ids, labels = torch.randint(1, 200, (4, 32)), torch.randint(0, 2, (4,))
    mask = torch.ones(4, 32, dtype=torch.long)
    mask[1, 20:] = 0
    reference = _gradients(model, lambda: model(input_ids=ids, attention_mask=mask, labels=labels).loss)
    net = torch.compile(model)
    compressor = act.ActivationCompressor(net, act.ACTConfig(bits=8, adaptive=False, min_numel=1024))
    with compressor.compress():
        loss = net(input_ids=ids, attention_mask=mask, labels=labels).loss
    model.zero_grad(set_to_none=True)
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert torch.isfinite(grads).all()
    assert torch.nn.functional.cosine_similarity(grads, reference, dim=0) > 0.999
    records = _compiled_records(compressor)
    assert len(records) >= 8 and all(r.shape.numel() != 4 * 32 * 32 for r in records)  # the mask: kept
    torch._dynamo.reset()


class _Attention(nn.Module):
    """One self-attention block through SDPA (heads 2, head size 16)."""

    def __init__(self, dropout_p: float):
        super().__init__()
        torch.manual_seed(0)
        self.qkv, self.out, self.dropout_p = nn.Linear(32, 96), nn.Linear(32, 32), dropout_p

    def forward(self, x):
        batch, tokens, _ = x.shape
        q, k, v = self.qkv(x).view(batch, tokens, 3, 2, 16).permute(2, 0, 3, 1, 4)
        attended = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout_p)
        return self.out(attended.transpose(1, 2).reshape(batch, tokens, 32))


@pytest.mark.parametrize("dropout_p, dtype", [(0.0, torch.float32), (0.1, torch.float32), (0.1, torch.float64)])
def test_what_attention_backwards_rescale_rows_by_is_kept_exact(dropout_p, dtype):
    """Without dropout CPU SDPA is one kernel, whose backward reads the rows' log-sum-exp; with dropout inductor
    decomposes it, and the backward recomputes the softmax from the saved logits, row maxima and sums. An error d
    in any of them scales a row of probabilities by e^-d: at 4 bits the gradients' norm came out 10^3-10^7 times
    too large on MiniLM. The row statistics are kept exact, the logits go at 8 bits."""
    batch, heads, tokens = 8, 2, 64
    model = _Attention(dropout_p).to(dtype)
    x = torch.randn(batch, tokens, 32, dtype=dtype) * 4  # peaked rows: maxima and log-sum-exps spread over rows
    net = torch.compile(model)
    compressor = act.ActivationCompressor(net, act.ACTConfig(bits=4, adaptive=False, min_numel=256))
    norms = []
    for compress in (False, True):
        with compressor.compress() if compress else contextlib.nullcontext():
            loss = net(x).square().mean()
        model.zero_grad(set_to_none=True)
        loss.backward()
        norms.append(torch.cat([p.grad.flatten() for p in model.parameters()]).norm())
    records = [r for r in _compiled_records(compressor) if r.codec == "quantize"]
    assert records and not any(r.shape.numel() == batch * heads * tokens for r in records)  # kept exact
    logits = [r for r in records if r.shape.numel() == batch * heads * tokens * tokens]
    assert (8.0 in [r.bits for r in logits]) == bool(dropout_p)  # beside them, 4-bit probabilities
    assert 0.7 < norms[1] / norms[0] < 1.4, norms
    torch._dynamo.reset()


def test_a_cross_entropys_row_statistics_stay_exact_and_its_logits_take_8_bits():
    """Cross-entropy's log-softmax, decomposed: the backward recomputes it from the logits, their row maxima and
    the log of the sums of exponentials."""
    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.head = _mlp(width=64), nn.Linear(4, 1000)

        def forward(self, x, y):  # the loss inside the compiled graph
            return nn.functional.cross_entropy(self.head(self.body(x)) * 8, y)

    x, y = torch.randn(256, 16), torch.randint(0, 1000, (256,))
    net = torch.compile(Classifier())
    compressor = act.ActivationCompressor(net, act.ACTConfig(bits=4, adaptive=False, min_numel=64))
    with compressor.compress():
        loss = net(x, y)
    loss.backward()
    records = [r for r in _compiled_records(compressor) if r.codec == "quantize"]
    assert not any(r.shape.numel() == 256 for r in records)  # maxima and log-sum-exps: kept
    assert [r.bits for r in records if r.shape.numel() == 256 * 1000] == [8.0]
    assert {r.bits for r in records if r.shape.numel() == 256 * 64} == {4.0}
    torch._dynamo.reset()


@pytest.mark.parametrize("kernels, autocast", [
    (False, None), pytest.param(True, None, marks=[pytest.mark.toolchain, requires_gxx]),
    pytest.param(True, torch.bfloat16, marks=[pytest.mark.toolchain, requires_gxx])],
    ids=["traced encode", "kernel encode", "kernel encode, bf16 autocast"])
def test_channels_last_convolutions_decode_in_their_memory_order(kernels, autocast, request):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.GELU(), nn.Conv2d(16, 16, 3, padding=1), nn.GELU(),
                          nn.Flatten(), nn.Linear(16 * 8 * 8, 4)).to(memory_format=torch.channels_last)
    x = torch.randn(16, 3, 8, 8).to(memory_format=torch.channels_last)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast is not None):
        reference = _gradients(model, lambda: model(x))
    counting = _Counting(request.getfixturevalue("runner")) if kernels else None
    with use_runner(counting) if kernels else contextlib.nullcontext():
        net = torch.compile(model)
        compressor = act.ActivationCompressor(net, act.ACTConfig(bits=8, adaptive=False, min_numel=1024))
        grads = _gradients(model, lambda: _compressed(compressor, net, autocast)(x))
    assert torch.nn.functional.cosine_similarity(grads, reference, dim=0) > 0.999
    records = _compiled_records(compressor)
    assert len(records) >= 3
    if kernels:  # decoded by the traced ops compiled backwards inline
        assert counting.kernels.count("quantize_encode") == len(records)
        assert "quantize_decode" not in counting.kernels
    torch._dynamo.reset()


@pytest.mark.parametrize("compress_masks", [True, False])
def test_relu_outputs_keep_their_sign_pattern_exactly(compress_masks):
    """A ReLU output saved for its values (the next layer's weight gradient) and its sign (ReLU's backward): with
    ``compress_masks`` its ``x > 0`` goes at 1 bit beside the codes, so ReLU's backward is exact, and the first
    layer's gradient, which reads only the sign here, is the uncompressed one; without, 2-bit codes round small
    positives to 0 and drop their gradient."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 4))
    x = torch.randn(64, 16)

    def first_layer_gradient(step):
        model.zero_grad(set_to_none=True)
        step().sum().backward()
        return model[0].weight.grad.clone()

    reference = first_layer_gradient(lambda: model(x))
    torch._dynamo.reset()
    net = torch.compile(model)
    compressor = act.ActivationCompressor(net, act.ACTConfig(bits=2, adaptive=False, min_numel=1024,
                                                             compress_masks=compress_masks))
    gradient = first_layer_gradient(lambda: _compressed(compressor, net)(x))
    torch._dynamo.reset()
    exact = torch.allclose(gradient, reference, rtol=1e-4, atol=1e-5)
    assert exact == compress_masks, (gradient - reference).abs().max()
    (record,) = [r for r in _compiled_records(compressor) if r.shape.numel() == 64 * 256]
    codes_and_stats = 64 * 256 * 2 // 8 + 2 * 4 * (64 * 256 // 256)
    assert record.stored_bytes == codes_and_stats + (64 * 256 // 8 if compress_masks else 0)


def test_restored_signs_are_exact_and_move_values_least():
    values = torch.tensor([0.0, 0.0, 0.5, -0.25, 0.0, 2.0, -0.0, 1e-3, float("nan")])
    original = torch.tensor([0.0, 1e-6, 0.7, -0.3, -1e-6, 2.0, 0.0, -1e-3, 1.0])
    signs = pack_codes_traced(original.gt(0).to(torch.uint8), 1)
    restored = compiled_regions.restore_signs(values.clone(), signs)
    tiny = torch.finfo(torch.float32).tiny
    assert restored[:8].tolist() == [0.0, tiny, 0.5, -0.25, 0.0, 2.0, 0.0, 0.0]
    assert restored[8].isnan()  # a NaN stays NaN


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 13, "two chunks"])
def test_restored_signs_match_the_originals_for_every_dtype_and_size(dtype, n):
    from lightning_act.formats.quantize import chunk_elements

    n = 2 * chunk_elements(torch.device("cpu")) + 13 if n == "two chunks" else n
    torch.manual_seed(0)
    original = torch.randn(n, dtype=dtype)
    values = (original * 2).round() / 2  # what a coarse decode leaves: small values at 0, some signs lost
    signs = pack_codes_traced(original.gt(0).to(torch.uint8), 1)
    restored = compiled_regions.restore_signs(values.clone(), signs)
    assert torch.equal(restored > 0, original > 0)
    kept = (values > 0) == (original > 0)
    assert torch.equal(restored[kept], values[kept])
    fixed = torch.zeros_like(values[~kept]).masked_fill_(original[~kept] > 0, torch.finfo(dtype).tiny)
    assert torch.equal(restored[~kept], fixed)


@pytest.mark.parametrize("layout_optimization, autocast", [(True, None), (False, None), (True, torch.bfloat16)])
def test_conv_activations_are_grouped_in_the_layout_inductor_gives_them(monkeypatch, layout_optimization, autocast):
    """Inductor lays a contiguous conv net's activations out channels_last (its layout optimisation): they are
    encoded in that order, so each group is a run of memory. The saved tensors encoded channels_last are exactly
    the 4-d ones inductor's forward graph lays out channels_last."""
    from torch._inductor import config as inductor_config
    from torch._inductor.graph import GraphLowering

    encoded, laid_out = {}, set()
    pack_traced, find = compiled_regions.GraphHooks.pack_traced, GraphLowering.find_nodes_prefer_channels_last

    def spy_pack(self, x):
        packed = pack_traced(self, x)
        if x.dim() == 4 and packed[0] == compiled_regions.QUANTIZE:
            encoded[compiled_regions._saved_tensor_hook_context()["_node"].name] = (x.shape, *packed[-3:-1])
        return packed

    def spy_find(self):
        nodes = find(self)
        if isinstance(self, GraphLowering) and not self.is_backward:  # not the prediction's own call
            laid_out.update(node.name for node in nodes)
        return nodes

    monkeypatch.setattr(compiled_regions.GraphHooks, "pack_traced", spy_pack)
    monkeypatch.setattr(GraphLowering, "find_nodes_prefer_channels_last", spy_find)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                          nn.Conv2d(16, 16, 3, padding=1), nn.GELU(), nn.Flatten(), nn.Linear(16 * 8 * 8, 4))
    x = torch.randn(16, 3, 8, 8)
    reference = _gradients(model, lambda: model(x))
    torch._dynamo.reset()
    with inductor_config.patch(layout_optimization=layout_optimization, force_disable_caches=True):
        net = torch.compile(model)
        compressor = act.ActivationCompressor(net, act.ACTConfig(bits=8, adaptive=False, min_numel=1024))
        grads = _gradients(model, lambda: _compressed(compressor, net, autocast)(x))
    torch._dynamo.reset()
    assert torch.nn.functional.cosine_similarity(grads, reference, dim=0) > (0.99 if autocast else 0.999)
    assert len(encoded) >= 3
    channels_last = {name for name, (_, _, inverse) in encoded.items() if inverse == (0, 3, 1, 2)}
    for name, (traced, shape, inverse) in encoded.items():
        n, c, h, w = traced
        assert shape == ((n, h, w, c) if name in channels_last else (n, c, h, w))
    assert channels_last == (set(encoded) & laid_out)
    assert channels_last == (set(encoded) if layout_optimization else set())


@pytest.mark.parametrize("kernels", [False, pytest.param(True, marks=[pytest.mark.toolchain, requires_gxx])],
                         ids=["traced encode", "kernel encode"])
def test_dynamic_shapes_compile_once_for_every_batch(kernels, request):
    """Symbolic sizes: the kernel encode op's buffers are sized, and the backward's traced decodes slice them and
    count them, from the symbolic element count too."""
    model = _mlp(width=256)
    counter = CompileCounterWithBackend("inductor")
    counting = _Counting(request.getfixturevalue("runner")) if kernels else None
    with use_runner(counting) if kernels else contextlib.nullcontext():
        net = torch.compile(model, backend=counter, dynamic=True)
        compressor = act.ActivationCompressor(net, act.ACTConfig(bits=4, adaptive=False, min_numel=1024))
        step = _compressed(compressor, net)
        for batch in (64, 80, 96):
            x = torch.randn(batch, 16)
            reference = _gradients(model, lambda: model(x))
            grads = _gradients(model, lambda: step(x))
            assert torch.nn.functional.cosine_similarity(grads, reference, dim=0) > 0.995
            assert {r.original_bytes for r in _compiled_records(compressor)} == {batch * 256 * 4}
    assert counter.frame_count == 1  # the same hooks every step: no guard fails
    if kernels:  # the buffers decoded by traced ops, sliced at symbolic offsets
        assert counting.kernels.count("quantize_encode") > 0 and "quantize_decode" not in counting.kernels


def test_other_codecs_keep_compiled_activations_and_say_so():
    model = _mlp(width=256)
    x = torch.randn(64, 16)
    reference = _gradients(model, lambda: model(x))
    net = torch.compile(model)
    with pytest.warns(UserWarning, match=r"only codec='quantize' at 1, 2, 4 or 8 bits .* codec='division'") as w:
        compressor = act.ActivationCompressor(net, act.ACTConfig(codec="division", min_numel=1024))
    assert w[0].filename == __file__
    grads = _gradients(model, lambda: _compressed(compressor, net)(x))
    torch.testing.assert_close(grads, reference)
    assert _compiled_records(compressor) == []


def test_a_torch_without_inlined_hooks_is_warned_about_at_the_users_line(monkeypatch):
    monkeypatch.setattr(compiled_regions, "supported", lambda: False)
    model = torch.compile(nn.Linear(4, 4))  # compiles lazily: building the wrapper is enough
    with pytest.warns(UserWarning, match=r"runs saved-tensor hooks after a compiled forward") as w:
        compressor = act.ActivationCompressor(model, act.ACTConfig())
    assert w[0].filename == __file__
    assert compressor.graph_hooks is None


@pytest.mark.parametrize("compile_", ["wrapper", "in place", "submodule"])
def test_compiled_parts_are_found(compile_):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    if compile_ == "wrapper":
        model = torch.compile(model)
    elif compile_ == "in place":
        model.compile()
    else:
        model[0] = torch.compile(model[0])
    assert has_compiled_parts(model)
    assert not has_compiled_parts(nn.Sequential(nn.Linear(4, 4)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert act.ActivationCompressor(model, act.ACTConfig()).graph_hooks is not None
    assert act.ActivationCompressor(model, act.ACTConfig(opt_level="L0")).graph_hooks is None


def test_the_act_strategy_compresses_a_compiled_lightning_module_inside_its_graphs():
    """Trainer.fit(torch.compile(module)): Lightning compiles the module in place (from_compiled), the strategy's
    compressor finds it and compresses inside the compiled training step."""
    lightning = pytest.importorskip("lightning")
    from tests.lightning_models import TinyCNN, random_loader

    torch.manual_seed(0)
    trainer = lightning.Trainer(strategy=act.ACTStrategy(act.ACTConfig(bits=4, adaptive=False)), max_steps=2,
                                accelerator="cpu", logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(torch.compile(TinyCNN()), random_loader())
    compressor = trainer.strategy.compressor
    assert compressor.graph_hooks is not None
    records = _compiled_records(compressor)
    assert {(r.codec, r.bits) for r in records} <= {("quantize", 4.0), ("bitmask", 1.0)}
    assert any(r.codec == "quantize" for r in records)


def test_auto_precision_skips_its_rounds_for_a_compiled_model():
    from lightning_act.adapt import AutoPrecision

    net = torch.compile(_mlp())  # compiles lazily: nothing runs here
    compressor = act.ActivationCompressor(net, act.ACTConfig(bits=4))
    with pytest.warns(UserWarning, match=r"compile'd parts, whose activations take the config's bits=4") as w:
        auto = AutoPrecision(compressor)
    assert w[0].filename == __file__

    def step():
        raise AssertionError("a round ran")

    assert auto.maybe_adapt(0, step) is False and auto.rounds == 0


_CACHED_STEP = """
import json, sys, torch
from torch import nn
from torch._dynamo.utils import counters
import lightning_act as act

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 256), nn.GELU(), nn.Dropout(0.25), nn.Linear(256, 256), nn.Tanh(),
                      nn.Linear(256, 4))
net = torch.compile(model)
compressor = act.ActivationCompressor(net, act.ACTConfig(bits=int(sys.argv[1]), adaptive=False, min_numel=1024))
with compressor.compress():
    loss = net(torch.randn(64, 16)).square().mean()
loss.backward()
print(json.dumps({"cache": dict(counters["aot_autograd"]),
                  "records": sorted([r.codec, r.bits, r.original_bytes, r.stored_bytes, r.phase]
                                    for r in compressor.stats().records),
                  "grads": [p.grad.double().sum().item() for p in model.parameters()]}))
"""


def test_compiled_graphs_come_from_aotautograds_cache_in_a_new_process_keyed_by_the_config(tmp_path):
    """The hooks carry a cache hash, so a second process loads the compiled graphs (no tracing: seconds to a
    minute per model) and compresses exactly as the first; a config the hooks decide by (bits) misses the cache."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}

    def step(bits: int) -> dict:
        result = subprocess.run([sys.executable, "-c", _CACHED_STEP, str(bits)], env=env, capture_output=True,
                                text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout.strip().splitlines()[-1])

    first, second, other = step(4), step(4), step(2)
    assert first["cache"].get("autograd_cache_saved") == 1 and "autograd_cache_hit" not in first["cache"]
    assert second["cache"].get("autograd_cache_hit") == 1
    assert second["records"] == first["records"] and sum(r[4] == "compiled" for r in first["records"]) >= 3
    assert second["grads"] == first["grads"]
    assert "autograd_cache_hit" not in other["cache"]
    assert {r[1] for r in other["records"] if r[0] == "quantize"} == {2.0}
