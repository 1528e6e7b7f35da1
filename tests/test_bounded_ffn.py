"""Bounded Linear -> activation backwards (lightning_act.nn.bounded_ffn): the unconverted model's outputs bit for bit,
its gradients up to summation order, module names and state_dict untouched, and a backward that holds the
incoming and the outgoing gradient plus row chunks."""
import copy

import pytest
import torch
from torch import nn

import lightning_act as act
from lightning_act.nn.bounded_cnn import BoundedSequential
from lightning_act.nn.bounded_ffn import fusable_activation, is_bounded_ffn
from lightning_act.profiling import measure_step_memory
from tests.codec_peaks import compressed_backward_peak

transformers = pytest.importorskip("transformers")

MiB = 2**20
ACTIVATIONS = {
    "gelu": nn.GELU, "gelu_tanh": lambda: nn.GELU(approximate="tanh"), "relu": nn.ReLU,
    "relu_inplace": lambda: nn.ReLU(inplace=True), "silu": nn.SiLU, "tanh": nn.Tanh,
}


def _close(actual, expected, rtol, floor=0.0):
    """Equal up to rounding, on the scale of the tensor or ``floor`` (a gradient that is zero in exact
    arithmetic, such as BERT's key bias, is rounding noise on both sides)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if expected.numel():
        scale = max(expected.abs().max().item(), floor)
        assert (actual.double() - expected.double()).abs().max().item() <= rtol * scale


def _mlp(activation="gelu", hidden=12, dtype=torch.float32):
    torch.manual_seed(0)
    make = ACTIVATIONS[activation]
    return nn.Sequential(nn.Linear(hidden, 4 * hidden), make(), nn.Linear(4 * hidden, hidden), make(),
                         nn.Linear(hidden, 5)).to(dtype)


def _step(model, x, weights, autocast=False, context=None):
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), context or _null():
        out = model(x)
    (out.double() * weights).sum().backward()
    return out, x.grad, [p.grad for p in model.parameters()]


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _compare(reference, converted, x, weights, rtol, autocast=False, floor_share=0.0, **kw):
    (out_ref, gx_ref, grads_ref), (out, gx, grads) = (_step(m, x, weights, autocast, **kw)
                                                      for m in (reference, converted))
    assert torch.equal(out, out_ref)  # the same ops on the same values in the forward
    _close(gx, gx_ref, rtol)
    floor = floor_share * max(g.abs().max().item() for g in grads_ref if g is not None)
    for g, g_ref in zip(grads, grads_ref):
        assert (g is None) == (g_ref is None)
        if g is not None:
            _close(g, g_ref, rtol, floor)


@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", [(37,), (3, 13), (0,), (2, 0)])
def test_sequential_matches_the_unfused_pairs(dtype, rtol, activation, shape):
    """Odd row counts split in uneven chunks (chunk_bytes of 5 rows of the 48-wide pre-activation), 2D and 3D
    inputs, an empty batch."""
    reference = _mlp(activation, dtype=dtype)
    converted = copy.deepcopy(reference)
    assert act.nn.convert_bounded_ffn(converted, chunk_bytes=5 * 48 * dtype.itemsize) == 2
    torch.manual_seed(1)
    x = torch.randn(*shape, 12, dtype=dtype)
    _compare(reference, converted, x, torch.randn(*shape, 5, dtype=torch.float64), rtol)


def test_non_contiguous_input():
    reference = _mlp()
    converted = copy.deepcopy(reference)
    act.nn.convert_bounded_ffn(converted, chunk_bytes=7 * 48 * 4)
    x = torch.randn(12, 9, 5).transpose(0, 2)  # (5, 9, 12), not contiguous
    assert not x.is_contiguous()
    _compare(reference, converted, x, torch.randn(5, 9, 5, dtype=torch.float64), 1e-5)


@pytest.mark.parametrize("activation", ["gelu", "relu", "silu"])
def test_bf16_autocast_and_half_precision(activation):
    reference = _mlp(activation)
    converted = copy.deepcopy(reference)
    act.nn.convert_bounded_ffn(converted, chunk_bytes=5 * 48 * 2)
    torch.manual_seed(1)
    x, weights = torch.randn(4, 11, 12), torch.randn(4, 11, 5, dtype=torch.float64)
    out, gx, grads = _step(converted, x, weights, autocast=True)
    assert out.dtype == torch.bfloat16 and gx.dtype == torch.float32 and all(g.dtype == torch.float32 for g in grads)
    # bf16 products summed per chunk against one bf16 product: rounding of bf16 (2^-8) on the gradient's scale
    _compare(reference, converted, x, weights, 2e-2, autocast=True, floor_share=0.1)
    half = [m.half() for m in (reference, converted)]
    _compare(*half, x.half(), weights, 2e-2, floor_share=0.1)


def _bert_config(**kw):
    return transformers.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=128, max_position_embeddings=32, **kw)


def _bert(act_fn="gelu"):
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(_bert_config(hidden_act=act_fn)).train()


def _bert_step(model, ids, labels, autocast=False, compressor=None):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(2)  # the same dropout masks in both models
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), \
            compressor.compress() if compressor is not None else _null():
        out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    return out.logits, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("precision, rtol", [("fp32", 2e-5), ("fp64", 1e-12), ("bf16 autocast", 3e-2)])
@pytest.mark.parametrize("compressed", [False, True])
def test_bert_gradients_match_the_unconverted_model(precision, rtol, compressed):
    """HuggingFace BERT (BertIntermediate: dense then GELU), dropout on; compressed: a lossless 32-bit
    compressor on both models, so the converted model's forward runs by chunks, each packed as it is made and
    unpacked on its own in the backward."""
    dtype = torch.float64 if precision == "fp64" else torch.float32
    reference = _bert().to(dtype)
    converted = copy.deepcopy(reference)
    assert act.nn.convert_bounded_ffn(converted, chunk_bytes=3 * 128 * 4) == 2  # one per layer
    ids, labels = torch.randint(0, 99, (3, 17)), torch.randint(0, 2, (3,))
    results = []
    for model in (reference, converted):
        compressor = act.ActivationCompressor(model, act.ACTConfig(bits=32, adaptive=False, min_numel=0)) \
            if compressed else None
        results.append(_bert_step(model, ids, labels, precision == "bf16 autocast", compressor))
        if compressed:
            assert compressor.stats().ratio > 0
    (logits_ref, grads_ref), (logits, grads) = results
    if compressed:  # the chunked forward: row-blocked matmuls, rounded as the blocks fall
        _close(logits, logits_ref, rtol)
    else:
        assert torch.equal(logits, logits_ref)
    floor = 0.1 * max(g.abs().max().item() for g in grads_ref.values() if g is not None)
    for name, g_ref in grads_ref.items():
        _close(grads[name], g_ref, rtol, floor if precision == "bf16 autocast" else 1e-3 * floor)


def test_conversion_keeps_names_and_state_dict_and_is_undone():
    model = _bert()
    seq = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4), nn.Dropout(), nn.Linear(4, 4), nn.Tanh())
    model.head = seq
    names = [n for n, _ in model.named_modules()]
    keys = list(model.state_dict())
    classes = [type(m) for m in model.modules()]
    params = list(model.parameters())
    assert act.nn.convert_bounded_ffn(model) == 2 + 2
    assert is_bounded_ffn(model) and is_bounded_ffn(seq) and not is_bounded_ffn(model.bert.embeddings)
    assert [n for n, _ in model.named_modules()] == names
    assert list(model.state_dict()) == keys
    assert [type(m) for m in model.modules()] == classes
    assert act.nn.unconvert_bounded_ffn(model) == 5  # two layers, two intermediates, one Sequential
    assert [type(m) for m in model.modules()] == classes
    assert not is_bounded_ffn(model)
    assert all(not {"forward", "feed_forward_chunk", "_bounded_ffn_chunk_bytes"} & set(m.__dict__)
               for m in model.modules())
    assert all(p is q for p, q in zip(model.parameters(), params))
    assert act.nn.unconvert_bounded_ffn(model) == 0


def test_unfusable_pairs_are_left_as_they_are():
    class MyLinear(nn.Linear):
        pass

    hooked = nn.Linear(4, 4)
    hooked.register_full_backward_hook(lambda *a: None)
    model = nn.Sequential(MyLinear(4, 4), nn.GELU(), nn.Linear(4, 4), nn.PReLU(), nn.Linear(4, 4),
                          nn.SiLU(inplace=True), nn.Linear(4, 4), nn.Dropout(), hooked, nn.GELU())
    assert act.nn.convert_bounded_ffn(model) == 0 and not is_bounded_ffn(model)
    assert fusable_activation(torch.nn.functional.gelu) and not fusable_activation(lambda t: t)
    assert fusable_activation(transformers.activations.ACT2FN["gelu_new"])
    # a subclass of BertIntermediate with another forward is not taken for one
    from transformers.models.bert.modeling_bert import BertIntermediate

    class Scaled(BertIntermediate):
        def forward(self, hidden_states):
            return 2 * self.intermediate_act_fn(self.dense(hidden_states))

    assert act.nn.convert_bounded_ffn(Scaled(_bert_config())) == 0
    assert act.nn.convert_bounded_ffn(BertIntermediate(_bert_config())) == 1


def test_forward_hooks_run_and_no_grad_saves_nothing():
    reference = _mlp()
    converted = copy.deepcopy(reference)
    act.nn.convert_bounded_ffn(converted, chunk_bytes=4 * 48 * 4)
    calls = []
    converted[0].register_forward_hook(lambda m, i, o: calls.append(("linear", o.shape)))
    converted[1].register_forward_pre_hook(lambda m, i: calls.append(("act", i[0].shape)))
    x = torch.randn(6, 12)
    with torch.no_grad():
        out = converted(x)
    assert out.grad_fn is None and torch.equal(out, reference(x))
    assert calls == [("linear", (6, 48)), ("act", (6, 48))]
    converted.eval()  # eval mode with autograd on still saves (a backward may follow)
    out = converted(x.requires_grad_())
    assert type(out.grad_fn).__name__ == "_FeedForwardBackward"  # the last pair and the last Linear: one node


def test_frozen_weights_save_no_input_and_get_no_gradient():
    reference = _mlp()
    converted = copy.deepcopy(reference)
    act.nn.convert_bounded_ffn(converted, chunk_bytes=4 * 48 * 4)
    for m in (reference, converted):
        m[0].requires_grad_(False)
    x = torch.randn(10, 12)
    _compare(reference, converted, x, torch.randn(10, 5, dtype=torch.float64), 1e-5)
    assert converted[0].weight.grad is None
    pair = nn.Sequential(converted[0], converted[1])
    act.nn.convert_bounded_ffn(pair, chunk_bytes=4 * 48 * 4)
    out = pair(x.requires_grad_())
    node = out.grad_fn  # the output kept: torch 2.11 frees a node's saved tensors with its last output
    assert type(node).__name__ == "_FeedForwardBackward"
    assert len(node._raw_saved_tensors) == 1 + 3  # the weight and three chunks of h; x not saved
    assert pair(torch.randn(10, 12)).grad_fn is None  # nothing wants a gradient: the modules run as they are


def test_torch_checkpoint_unpacks_each_saved_chunk_once():
    reference = _bert()
    converted = copy.deepcopy(reference)
    act.nn.convert_bounded_ffn(converted, chunk_bytes=3 * 128 * 4)
    ids, labels = torch.randint(0, 99, (3, 17)), torch.randint(0, 2, (3,))
    results = []
    for model in (reference, converted):
        model.gradient_checkpointing_enable({"use_reentrant": False})
        results.append(_bert_step(model, ids, labels))
    (logits_ref, grads_ref), (logits, grads) = results
    _close(logits, logits_ref, 2e-5)  # checkpointing's hooks: the forward by chunks
    floor = 1e-4 * max(g.abs().max().item() for g in grads_ref.values())
    for name, g_ref in grads_ref.items():
        _close(grads[name], g_ref, 2e-5, floor)


def test_with_bounded_cnn_in_one_sequential():
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                              nn.Linear(4 * 36, 16), nn.GELU(), nn.Linear(16, 3))
    for first in ("cnn", "ffn"):
        converted = copy.deepcopy(reference)
        converters = [lambda m: act.nn.convert_bounded_cnn(m, chunk_bytes=1),
                      lambda m: act.nn.convert_bounded_ffn(m, chunk_bytes=16 * 4)]
        for convert in converters if first == "cnn" else converters[::-1]:
            assert convert(converted) == 1
        assert type(converted) is BoundedSequential and is_bounded_ffn(converted)
        x = torch.randn(5, 3, 6, 6)
        out = converted(x)
        assert type(out.grad_fn).__name__ == "_FeedForwardBackward"  # Linear -> GELU -> Linear
        assert type(out.grad_fn.next_functions[0][0]).__name__ == "ViewBackward0"  # Flatten of the fused conv run
        torch.manual_seed(3)
        weights = torch.randn(5, 3, dtype=torch.float64)
        ref, got = _step(reference, x, weights), _step(converted, x, weights)
        _close(got[0], ref[0], 1e-5)
        _close(got[1], ref[1], 1e-5)
        floor = 0.1 * max(g.abs().max().item() for g in ref[2])
        for g, g_ref in zip(got[2], ref[2]):
            _close(g, g_ref, 1e-4, floor)
        act.nn.unconvert_bounded_ffn(converted)
        act.nn.unconvert_bounded_cnn(converted)
        assert type(converted) is nn.Sequential and not is_bounded_ffn(converted)


@pytest.mark.parametrize("chunk_bytes", [0, "lots", -1])
def test_bad_chunk_bytes_name_the_value(chunk_bytes):
    with pytest.raises(ValueError, match="chunk_bytes"):
        act.nn.convert_bounded_ffn(_mlp(), chunk_bytes=chunk_bytes)


def test_config_flag_converts_during_the_forward_only_and_compresses_the_chunks():
    model = _bert()
    plain = copy.deepcopy(model)
    # 9600 rows: two chunks of the default 4 MiB (8192 rows of the 128-wide pre-activation; one chunk would run
    # unfused)
    ids, labels = torch.randint(0, 99, (300, 32)), torch.randint(0, 2, (300,))
    exact = _bert_step(plain, ids, labels)[1]
    errors, shapes = {}, {}
    for bounded in (False, True):
        trial = copy.deepcopy(model)
        compressor = act.ActivationCompressor(trial, act.ACTConfig(bits=8, adaptive=False, min_numel=0,
                                                                   bounded_ffn=bounded))
        seen = []
        trial.bert.encoder.layer[0].intermediate.register_forward_hook(lambda m, i, o: seen.append(is_bounded_ffn(m)))
        _, grads = _bert_step(trial, ids, labels, compressor=compressor)
        assert seen == [bounded] and not is_bounded_ffn(trial)  # the user's model again after the forward
        errors[bounded] = max(((grads[n] - g).abs().max() / g.abs().max()).item()
                              for n, g in exact.items() if g.dim() > 1)
        shapes[bounded] = {tuple(r.shape) for r in compressor.stats().records if r.kind == "compressed"}
    # GELU saves the whole 3D pre-activation; the fused node its chunks and its input's, all compressed
    assert (300, 32, 128) in shapes[False] and (300, 32, 128) not in shapes[True]
    assert {(8192, 128), (1408, 128), (8192, 32), (1408, 32)} <= shapes[True]
    # the same 8-bit codec on the same values: errors of the same size
    assert errors[True] < 2 * errors[False] + 1e-3 and errors[True] < 0.05


def test_backward_inside_the_compress_context_keeps_the_activation_derivative_exact():
    """In manual optimization the backward runs inside ``compress()``: the activation re-run on each chunk must
    not have its own saved tensors compressed (its gradients would then differ from a backward outside)."""
    results = []
    for inside in (False, True):
        model = _mlp()
        act.nn.convert_bounded_ffn(model, chunk_bytes=16 * 48 * 4)  # four chunks of 16 rows
        compressor = act.ActivationCompressor(model, act.ACTConfig(bits=2, adaptive=False, min_numel=0))
        torch.manual_seed(1)
        x = torch.randn(64, 12)
        with compressor.compress():
            loss = model(x).square().sum()
            if inside:
                loss.backward()
        saved = len(compressor.stats().records)
        if not inside:
            loss.backward()
        # a pair (weight, x and h in four chunks), a pair and the last Linear (two weights, x, h), square's input
        assert saved == 9 + 10 + 1
        results.append([p.grad for p in model.parameters()])
    for g, g_ref in zip(*results):
        assert torch.equal(g, g_ref)


@pytest.mark.parametrize("activation", ["gelu", "relu"])
@pytest.mark.parametrize("rows", [4096, 4097])
def test_backward_peak_holds_the_gradients_and_chunks(activation, rows):
    """A wide layer (8 MiB per 512-wide float32 tensor) under 4-bit compression: unfused, the activation's node
    holds the decoded pre-activation and its gradient beside the incoming gradient; fused, the input gradient
    (a quarter as wide) and chunk-sized pieces (1 MiB chunks)."""
    width, chunk = 128, 1 * MiB
    full = rows * 4 * width * 4
    peaks = {}
    for bounded in (False, True):
        torch.manual_seed(0)
        block = nn.Sequential(nn.Linear(width, 4 * width), ACTIVATIONS[activation]())
        if bounded:
            assert act.nn.convert_bounded_ffn(block, chunk_bytes=chunk) == 1
        compressor = act.ActivationCompressor(block, act.ACTConfig(bits=4, adaptive=False))
        peaks[bounded] = compressed_backward_peak(block, torch.randn(rows, width).requires_grad_(), compressor)
    grad_in = full // 4
    pieces = 4 if activation == "gelu" else 2  # decoded h, the re-run activation, its gradient, x's chunk (GELU)
    assert peaks[True] <= grad_in + pieces * chunk + MiB // 2, {k: v / MiB for k, v in peaks.items()}
    # unfused: the decoded h (or ReLU's decoded mask as a float tensor) and grad_h, whole
    assert peaks[False] >= 2 * full, {k: v / MiB for k, v in peaks.items()}


@pytest.mark.parametrize("activation, second_linear", [("gelu", False), ("relu", False), ("gelu", True)])
def test_forward_under_a_compressor_holds_no_whole_pre_activation(activation, second_linear):
    """Under a compressor the block runs by row chunks, each chunk's h packed as it is made: the forward holds the
    output, the compressed bytes and chunk-sized pieces; unfused, h and a (4x wider than x) are both whole (at the
    second Linear, when there is one: a narrow output)."""
    width, rows, chunk = 128, 4096, 1 * MiB
    wide = rows * 4 * width * 4  # h and a: 8 MiB
    peaks, outputs = {}, {}
    for bounded in (False, True):
        torch.manual_seed(0)
        modules = [nn.Linear(width, 4 * width), ACTIVATIONS[activation]()]
        block = nn.Sequential(*modules, *([nn.Linear(4 * width, width)] if second_linear else []))
        if bounded:
            act.nn.convert_bounded_ffn(block, chunk_bytes=chunk)
        compressor = act.ActivationCompressor(block, act.ACTConfig(bits=4, adaptive=False))
        x = torch.randn(rows, width).requires_grad_()

        def forward():
            with compressor.compress():
                outputs[bounded] = block(x)

        forward()
        peaks[bounded] = measure_step_memory(forward).peak_bytes
    output = wide // 4 if second_linear else wide
    stored = wide // 8 + wide // 32  # h at 4 bits (ReLU: signs, less), x at 4 bits, statistics aside
    # measured: 13.1 (GELU), 10.8 (ReLU), 7.3 (GELU, second Linear)
    assert peaks[True] <= output + stored + 5 * chunk, {k: v / MiB for k, v in peaks.items()}
    assert peaks[False] >= 2 * wide, {k: v / MiB for k, v in peaks.items()}
    _close(outputs[True], outputs[False], 1e-5)


def test_forward_hooks_under_a_compressor_run_once():
    """A hooked Linear or activation keeps the whole forward (chunks would run the hooks once per chunk)."""
    for hooked in (0, 1, 2):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(12, 48), nn.GELU(), nn.Linear(48, 5))
        reference = copy.deepcopy(model)
        act.nn.convert_bounded_ffn(model, chunk_bytes=4 * 48 * 4)
        calls = []
        model[hooked].register_forward_hook(lambda m, i, o: calls.append(o.shape))
        compressor = act.ActivationCompressor(model, act.ACTConfig(bits=32, adaptive=False, min_numel=0))
        x = torch.randn(10, 12, requires_grad=True)
        with compressor.compress():
            out = model(x)
        assert type(out.grad_fn).__name__ == "_FeedForwardBackward"
        assert calls == [(10, 5 if hooked == 2 else 48)]
        assert torch.equal(out, reference(x))  # the whole matmuls, as unfused
        out.sum().backward()
        assert model[0].weight.grad is not None and model[2].weight.grad is not None


@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("activation", ["gelu", "relu", "relu_inplace", "tanh"])
def test_linear_activation_linear_runs_as_one_node(dtype, rtol, activation):
    """A pair followed by a Linear that starts no pair of its own: the three are one node, which saves x and h
    per chunk (not the activation's output: the backward re-runs the activation), and ReLU keeps h itself."""
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(12, 48), ACTIVATIONS[activation](), nn.Linear(48, 12), nn.Tanh(),
                              nn.Linear(12, 5)).to(dtype)
    converted = copy.deepcopy(reference)
    assert act.nn.convert_bounded_ffn(converted, chunk_bytes=5 * 48 * dtype.itemsize) == 2
    x = torch.randn(3, 7, 12, dtype=dtype)
    out = converted(x.requires_grad_())
    node = out.grad_fn  # the output kept: torch 2.11 frees a node's saved tensors with its last output
    assert type(node).__name__ == "_FeedForwardBackward"  # (Linear, Tanh, Linear) last
    first = node._raw_saved_tensors
    assert len(first) == 2 + 2 * 5  # two weights, x and h in five chunks of 5 rows (21 rows)
    _compare(reference, converted, x, torch.randn(3, 7, 5, dtype=torch.float64), rtol)
    frozen = copy.deepcopy(converted)
    frozen[2].requires_grad_(False)  # the second Linear frozen: its gradient is not computed
    ref_frozen = copy.deepcopy(reference)
    ref_frozen[2].requires_grad_(False)
    _compare(ref_frozen, frozen, x, torch.randn(3, 7, 5, dtype=torch.float64), rtol)


def test_bert_layer_ffn_is_one_node_and_hooks_keep_the_modules():
    model = _bert().eval()  # no dropout: the outputs compare
    reference = copy.deepcopy(model)
    act.nn.convert_bounded_ffn(model, chunk_bytes=3 * 128 * 4)
    layer = model.bert.encoder.layer[0]
    assert "feed_forward_chunk" in layer.__dict__
    x = torch.randn(2, 5, 32, requires_grad=True)
    out = layer.feed_forward_chunk(x)
    assert torch.equal(out, reference.bert.encoder.layer[0].feed_forward_chunk(x))  # no hooks: bit for bit
    nodes, seen = [out.grad_fn], set()
    while nodes:  # the FFN node feeds the LayerNorm through dropout and the residual sum
        node = nodes.pop()
        if node is not None and node not in seen:
            seen.add(node)
            nodes += [n for n, _ in node.next_functions]
    assert "_FeedForwardBackward" in {type(n).__name__ for n in seen}
    calls = []
    layer.output.register_forward_hook(lambda m, i, o: calls.append(o.shape))
    out = layer.feed_forward_chunk(x)
    assert calls == [(2, 5, 32)]  # through the modules: the intermediate's pair fused, the output's Linear not
    assert torch.equal(out, reference.bert.encoder.layer[0].feed_forward_chunk(x))


@pytest.mark.parametrize("autocast", [False, True])
def test_bert_layer_residual_sum_is_written_in_place(autocast):
    """The FFN's residual sum goes into dropout's output (under bf16 autocast into its float32 copy: CPU's
    mixed-dtype add would copy it and then allocate the sum): the same values as the out-of-place sum that a
    hook on the dropout keeps, and under autocast a lower forward peak."""
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=256, vocab_size=99)
    layer = transformers.models.bert.modeling_bert.BertLayer(config).train()
    act.nn.convert_bounded_ffn(layer, chunk_bytes=MiB // 4)
    compressor = act.ActivationCompressor(layer, act.ACTConfig(bits=4, adaptive=False))
    x = torch.randn(8, 4096, 64, requires_grad=True)  # 8 MiB per float32 tensor of its shape
    peaks, outputs = {}, {}
    for hooked in (False, True):
        handle = layer.output.dropout.register_forward_hook(lambda *_: None) if hooked else None

        def forward():
            torch.manual_seed(1)  # the same dropout mask
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), compressor.compress():
                outputs[hooked] = layer.feed_forward_chunk(x)

        forward()
        peaks[hooked] = measure_step_memory(forward).peak_bytes
        if handle is not None:
            handle.remove()
    assert torch.equal(outputs[False], outputs[True])
    assert outputs[False].dtype == torch.float32
    if autocast:  # measured: 23.2 against 25.6 MiB (a bf16 tensor of x's shape less)
        assert peaks[False] <= peaks[True] - 2 * MiB, {k: v / MiB for k, v in peaks.items()}
    else:
        assert peaks[False] <= peaks[True]


def test_auto_chunks_are_4mib_on_cpu_and_at_most_eight_off_cpu():
    """The default chunk policy of the bounded nodes (nn._chunks.chunk_rows): 4 MiB chunks; off CPU no more than 8
    chunks of a tensor, as each costs kernel launches; an explicit size is taken as given."""
    from lightning_act.nn._chunks import chunk_rows

    row, cpu, gpu = 2**20, torch.device("cpu"), torch.device("cuda")
    assert chunk_rows("auto", row) == chunk_rows("auto", row, 4096, cpu) == 4
    assert chunk_rows("auto", row, 4096, gpu) == 512
    assert chunk_rows("auto", row, 20, gpu) == 4  # few rows: 4 MiB chunks still
    assert chunk_rows("4MiB", row, 4096, gpu) == 4
    with pytest.raises(ValueError, match="chunk_bytes='big'.*or 'auto'"):
        chunk_rows("big", row)


def test_rows_that_fit_one_chunk_run_unfused():
    """One chunk would hold the activation's output and its gradient beside h and grad_h, more than the unfused
    backward: the modules then run as they are."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(12, 48), nn.GELU(), nn.Linear(48, 5))
    act.nn.convert_bounded_ffn(block)  # 4 MiB: 21845 rows of the 48-wide hidden layer
    assert type(block(torch.randn(10, 12, requires_grad=True)).grad_fn).__name__ == "AddmmBackward0"
    assert type(block(torch.randn(21845, 12, requires_grad=True)).grad_fn).__name__ == "AddmmBackward0"
    assert type(block(torch.randn(21846, 12, requires_grad=True)).grad_fn).__name__ == "_FeedForwardBackward"
