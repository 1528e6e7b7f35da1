"""Bounded Conv-BN-ReLU and residual-merge backwards (lightning_act.nn.bounded_cnn): the unconverted model's
outputs, gradients and running statistics, parameters and state_dict untouched, and a lower backward peak."""
import copy

import pytest
import torch
from torch import nn

import lightning_act as act
from lightning_act.models import Bottleneck
from lightning_act.nn._chunks import DEFAULT_CHUNK_BYTES, chunk_rows
from lightning_act.nn.bounded_cnn import BoundedSequential, ResidualReLU, is_bounded
from lightning_act.profiling import measure_step_memory
from tests.codec_peaks import compressed_backward_peak

MiB = 2**20
FORMATS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}


def _scrambled(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            with torch.no_grad():
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    return model


def _net() -> nn.Sequential:
    """A stem run with a conv bias and stride, a run without ReLU, a bottleneck and a layer left as it is."""
    torch.manual_seed(0)
    return _scrambled(nn.Sequential(
        nn.Conv2d(3, 8, 3, 2, 1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
        nn.Conv2d(8, 16, 1, bias=False), nn.BatchNorm2d(16, momentum=None),
        Bottleneck(16, 4, 1), Bottleneck(16, 8, 2),
        nn.Conv2d(32, 4, 3, padding=1)))


def _pair(chunk_bytes=1):
    reference = _net()
    converted = copy.deepcopy(reference)
    # 2 runs in the outer Sequential, 3 + 1 (shortcut) in the bodies, 2 merges: every chunk one image
    assert act.nn.convert_bounded_cnn(converted, chunk_bytes=chunk_bytes) == 2 + 3 + 3 + 1 + 2
    return reference, converted


def _step(model, x, weights, autocast=False):
    x = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(x)
    (out.float() * weights).sum().backward()
    return out, x.grad, [p.grad for p in model.parameters()]


def _close(actual, expected, rtol, floor=0.0):
    """Equal up to rounding, on the scale of the tensor or ``floor`` (a conv bias before a training-mode BN has
    a zero true gradient: both sides are rounding noise of the other gradients' sums there)."""
    scale = max(expected.abs().max().item(), floor)
    assert (actual.float() - expected.float()).abs().max().item() <= rtol * scale


@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 2e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("layout", FORMATS)
@pytest.mark.parametrize("batch", [1, 2, 5])
@pytest.mark.parametrize("train", [True, False])
def test_gradients_outputs_and_running_stats_match_the_unconverted_model(dtype, rtol, layout, batch, train):
    reference, converted = _pair()
    models = [m.to(dtype=dtype, memory_format=FORMATS[layout]).train(train) for m in (reference, converted)]
    torch.manual_seed(1)
    x = torch.randn(batch, 3, 17, 15, dtype=dtype).to(memory_format=FORMATS[layout])
    weights = torch.randn(batch, 4, 5, 4, dtype=dtype)
    (out_ref, gx_ref, grads_ref), (out, gx, grads) = (_step(m, x, weights) for m in models)
    _close(out, out_ref, rtol)
    assert out.is_contiguous(memory_format=FORMATS[layout]) == out_ref.is_contiguous(memory_format=FORMATS[layout])
    _close(gx, gx_ref, rtol)
    assert gx.dtype == dtype
    floor = max(g.abs().max().item() for g in grads_ref) / 10
    for g, g_ref in zip(grads, grads_ref):
        assert g.dtype == g_ref.dtype
        _close(g, g_ref, rtol, floor)
    for b, b_ref in zip(converted.buffers(), reference.buffers()):  # momentum, cumulative average, unbiased var
        assert torch.allclose(b, b_ref, rtol=rtol, atol=rtol)


@pytest.mark.parametrize("layout", FORMATS)
@pytest.mark.parametrize("batch", [1, 7])
def test_bf16_autocast_and_float16_follow_the_unconverted_model(layout, batch):
    reference, converted = _pair()
    for m in (reference, converted):
        m.to(memory_format=FORMATS[layout])
    torch.manual_seed(1)
    x = torch.randn(batch, 3, 17, 15).to(memory_format=FORMATS[layout])
    weights = torch.randn(batch, 4, 5, 4)
    (out_ref, gx_ref, grads_ref), (out, gx, grads) = (_step(m, x, weights, autocast=True)
                                                      for m in (reference, converted))
    assert out.dtype == out_ref.dtype == torch.bfloat16 and gx.dtype == torch.float32
    _close(out, out_ref, 1e-2)
    _close(gx, gx_ref, 3e-2)
    floor = max(g.abs().max().item() for g in grads_ref) / 10
    for g, g_ref in zip(grads, grads_ref):
        assert g.dtype == torch.float32
        _close(g, g_ref, 3e-2, floor)
    half = [m.half() for m in (reference, converted)]
    (out_ref, gx_ref, _), (out, gx, _) = (_step(m, x.half(), weights.half()) for m in half)
    assert gx.dtype == torch.float16
    _close(out, out_ref, 1e-2)
    _close(gx, gx_ref, 3e-2)


def test_conversion_keeps_parameters_state_dict_and_is_undone():
    reference, converted = _pair()
    params = list(converted.parameters())
    keys = list(reference.state_dict())
    assert type(converted) is BoundedSequential and is_bounded(converted)
    assert list(converted.state_dict()) == keys
    assert act.nn.unconvert_bounded_cnn(converted) == 4 + 2  # four containers, two merges
    assert not is_bounded(converted) and type(converted) is nn.Sequential
    assert all(p is q for p, q in zip(converted.parameters(), params))
    assert all(not m.bounded for m in converted.modules() if isinstance(m, ResidualReLU))
    assert list(converted.state_dict()) == keys


def test_no_grad_forward_runs_the_modules():
    reference, converted = _pair()
    x = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(converted(x), reference(x), rtol=0, atol=0)


@pytest.mark.parametrize("chunk_bytes", [0, "lots", -1])
def test_bad_chunk_bytes_name_the_value(chunk_bytes):
    with pytest.raises(ValueError, match="chunk_bytes"):
        act.nn.convert_bounded_cnn(_net(), chunk_bytes=chunk_bytes)


def test_config_flag_converts_during_the_forward_only_and_compresses_the_chunks():
    torch.manual_seed(0)
    model = _net()
    plain = copy.deepcopy(model)
    x, weights = torch.randn(6, 3, 32, 32), torch.randn(6, 4, 8, 8)
    exact = _step(plain, x, weights)[2]
    errors = {}
    for bounded in (False, True):
        trial = copy.deepcopy(model)
        compressor = act.ActivationCompressor(trial, act.ACTConfig(bits=8, adaptive=False, min_numel=0,
                                                                   bounded_cnn=bounded))
        xg = x.clone().requires_grad_()
        with compressor.compress():
            assert is_bounded(trial) == bounded
            out = trial(xg)
        assert not is_bounded(trial)  # the user's model again, the graph keeps its bounded nodes
        (out * weights).sum().backward()
        errors[bounded] = max(((p.grad - g).abs().max() / g.abs().max()).item()
                              for p, g in zip(trial.parameters(), exact) if p.dim() > 1)
        codecs = {r.codec for r in compressor.stats().records if r.kind == "compressed"}
        assert "quantize" in codecs
    # the same 8-bit codec on the same tensors (per chunk): errors of the same size
    assert errors[True] < 2 * errors[False] + 1e-3 and errors[True] < 0.05


def _wide_block(layout):
    torch.manual_seed(0)
    return _scrambled(nn.Sequential(nn.Conv2d(16, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32),
                                    nn.ReLU(inplace=True))).to(memory_format=layout)


@pytest.mark.parametrize("layout", FORMATS)
@pytest.mark.parametrize("batch", [16, 17])
def test_backward_peak_holds_two_full_tensors_plus_chunks(layout, batch):
    """Conv-BN-ReLU's backward under 4-bit compression: 8 MiB per output-sized tensor; unconverted, BN's backward
    holds the incoming gradient, the decoded input, its output and a workspace (and ReLU's the decoded mask)."""
    layout = FORMATS[layout]
    x = torch.randn(batch, 16, 64, 64).to(memory_format=layout).requires_grad_()
    full = batch * 32 * 64 * 64 * 4
    peaks = {}
    for bounded in (False, True):
        block = _wide_block(layout)
        compressor = act.ActivationCompressor(block, act.ACTConfig(bits=4, adaptive=False, bounded_cnn=bounded))
        peaks[bounded] = compressed_backward_peak(block, x, compressor)
    # unconverted: BN's input gradient, its workspace, the decoded BN input and ReLU's decoded mask and output
    # beside the incoming gradient; bounded: the input gradient (half the size) and a few chunk-sized pieces
    chunk = full // batch * min(batch, chunk_rows(DEFAULT_CHUNK_BYTES, full // batch))
    assert peaks[True] <= peaks[False] - full, {k: v / MiB for k, v in peaks.items()}
    assert peaks[True] <= full / 2 + 6 * chunk, {k: v / MiB for k, v in peaks.items()}


def test_saved_entries_on_a_torch_without_per_entry_unpacking():
    """Torch 2.11's saved entries have no ``unpack``: an entry packed by a hook is unpacked alone by that hook on
    its packed form; entries saved without hooks are read through ``ctx.saved_tensors`` once per backward, so no
    entry is unpacked twice (checkpoint refuses it)."""
    from lightning_act.nn._chunks import SavedEntries

    unpacked = []

    class Entry:  # a SavedTensor of torch 2.11: its packed form and the unpack hook (None: saved without hooks)
        def __init__(self, i, hooked):
            self.data = ("packed", i) if hooked else torch.full((2,), float(i))
            self.unpack_hook = (lambda packed: unpacked.append(packed[1]) or torch.full((2,), float(packed[1]))
                                ) if hooked else None

    class Ctx:
        reads = 0

        def __init__(self, hooked):
            self._raw_saved_tensors = tuple(Entry(i, hooked) for i in range(3))

        @property
        def saved_tensors(self):
            Ctx.reads += 1
            return tuple(e.data for e in self._raw_saved_tensors)

    hooked = SavedEntries(Ctx(hooked=True))
    assert [float(hooked[i][0]) for i in (2, 0)] == [2.0, 0.0] and unpacked == [2, 0] and Ctx.reads == 0
    plain = SavedEntries(Ctx(hooked=False))
    assert [float(plain[i][0]) for i in (2, 0, 1, 2)] == [2.0, 0.0, 1.0, 2.0] and Ctx.reads == 1
    assert float(SavedEntries(Ctx(hooked=False))[1][0]) == 1.0 and Ctx.reads == 2  # once per backward


@pytest.mark.parametrize("train", [True, False])
def test_torch_checkpoint_unpacks_each_saved_chunk_once(train):
    """Non-reentrant torch.utils.checkpoint refuses a second unpack: the two backward passes read separate
    entries (the bench's torch-checkpoint rows failed before)."""
    reference, converted = _pair()
    x = torch.randn(5, 3, 17, 15)
    weights = torch.randn(5, 4, 5, 4)
    results = []
    for model in (reference, converted):
        model.train(train)
        xg = x.clone().requires_grad_()
        out = torch.utils.checkpoint.checkpoint(model, xg, use_reentrant=False)
        (out * weights).sum().backward()
        results.append((xg.grad, [p.grad for p in model.parameters()]))
    (gx_ref, grads_ref), (gx, grads) = results
    _close(gx, gx_ref, 2e-5)
    floor = max(g.abs().max().item() for g in grads_ref) / 10
    for g, g_ref in zip(grads, grads_ref):
        _close(g, g_ref, 2e-5, floor)


@pytest.mark.parametrize("autocast", [False, True])
def test_a_batch_that_fits_one_chunk_runs_the_modules_unfused(autocast):
    """One chunk would make the fused backward hold the masked gradient, BatchNorm's decoded input, its normalised
    copy and the convolution's gradients at once: ResNet-8 at 16 x 32² (4-bit) peaked 28% above the unconverted
    model (8.9 against 6.9 MiB). Such runs keep the modules; a batch of two chunks is fused."""
    from lightning_act.models import resnet8

    torch.manual_seed(0)
    model = resnet8(3, 10, width=16).train()
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    peaks, nodes = {}, {}
    several = 16 * 32 * 32 * 2 * 8  # 8 images of the stem's output in bf16 per chunk, 4 in float32
    for chunk_bytes in (None, DEFAULT_CHUNK_BYTES, several):  # unconverted, one chunk, several
        trial = copy.deepcopy(model)
        if chunk_bytes is not None:
            act.nn.convert_bounded_cnn(trial, chunk_bytes=chunk_bytes)
        compressor = act.ActivationCompressor(trial, act.ACTConfig(bits=4, adaptive=False))

        def step():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), compressor.compress():
                loss = nn.functional.cross_entropy(trial(x), y)
            loss.backward()
            return loss

        seen, pending = set(), [step().grad_fn]
        while pending:
            node = pending.pop()
            if node is not None and node not in seen:
                seen.add(node)
                pending += [n for n, _ in node.next_functions]
        nodes[chunk_bytes] = {n.name() for n in seen}
        trial.zero_grad(set_to_none=True)
        peaks[chunk_bytes] = measure_step_memory(step).peak_bytes
    assert "_ForkBackward" not in nodes[DEFAULT_CHUNK_BYTES] and "_ForkBackward" in nodes[several]
    assert peaks[DEFAULT_CHUNK_BYTES] <= peaks[None], {k: v / MiB for k, v in peaks.items()}
