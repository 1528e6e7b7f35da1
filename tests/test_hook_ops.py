"""The ATen ops the pack and unpack hooks run per saved tensor on the CUDA code path (issue #20, item 1).

On a GPU host each ATen call costs microseconds of dispatch, so the host time per saved tensor follows the number
of calls the hooks make. Host microseconds vary with the machine; these counts do not: a change that adds an op
to the hot path (a clone, a host-built tensor, a reduction) fails here, where a timing would only drift. The
kernels are replaced by a runner that records their names, so every launcher runs and no kernel does."""
from collections import Counter

import pytest
import torch
from torch import nn

import lightning_act as act
from lightning_act.cuda.launcher import use_runner
from lightning_act.engine import ActivationCompressor
from lightning_act.stats import COMPRESSED, DUPLICATE, KEPT, PARAMETER
from tests.host_path import RecordingRunner, recorded_ops


class _Attention(nn.Module):
    """A transformer block's saves: linear inputs, a transposed key (a view the engine stores by its storage),
    softmax output, GELU input, a residual."""

    def __init__(self, width: int):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.out = nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        attention = torch.softmax(q @ k.transpose(-2, -1), dim=-1)
        x = x + self.out(attention @ v)
        return x + self.down(nn.functional.gelu(self.up(x)))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), _Attention(64), _Attention(64), nn.Linear(64, 4))


class HookOps:
    """The ATen ops each pack and unpack hook ran, in order: ``packs`` of ``(record, ops)`` (the saved tensor's
    record), ``unpacks`` of ``(codec name or None, ops)``."""

    def __init__(self, monkeypatch):
        self.packs, self.unpacks = [], []
        pack, unpack = ActivationCompressor._pack, ActivationCompressor._unpack

        def recorded_pack(compressor, step, t):
            with recorded_ops() as ops:
                saved = pack(compressor, step, t)
            self.packs.append((step.records[-1], Counter(ops.ops)))
            return saved

        def recorded_unpack(saved):
            with recorded_ops() as ops:
                out = unpack(saved)
            self.unpacks.append((saved.codec.name if saved.codec is not None else None, Counter(ops.ops)))
            return out

        monkeypatch.setattr(ActivationCompressor, "_pack", recorded_pack)
        monkeypatch.setattr(ActivationCompressor, "_unpack", staticmethod(recorded_unpack))


@pytest.fixture
def hook_ops(monkeypatch):
    return HookOps(monkeypatch)


def _compressed_step(hook_ops: HookOps, options: dict, dtype: torch.dtype = torch.float32):
    """Run one compressed step under ``ACTConfig(backend="cupy", min_numel=64, **options)``; returns ``(packs,
    unpacks, kernels)``: for each saved tensor the ATen ops its pack hook ran with its record, the ops its unpack
    ran with its codec's name, and the kernels launched."""
    model = _model().to(dtype)
    x = torch.randn(4, 16, 32, dtype=dtype)
    runner = RecordingRunner()
    with use_runner(runner):
        compressor = act.ActivationCompressor(model, act.ACTConfig(backend="cupy", min_numel=64, **options))
        with compressor.compress():
            loss = model(x).float().square().mean()
        loss.backward()
    return hook_ops.packs, hook_ops.unpacks, runner.kernels


ONE_FORM = Counter({"empty.memory_format": 1, "detach.default": 1})
# a memory-order codec stores a transposed key (a view filling its storage) as that storage, flat
STORAGE_VIEW = Counter({"empty.memory_format": 1, "set_.source_Storage_storage_offset": 1})
# what a codec reads where the storage will not do: a contiguous copy (division reads planes in the tensor's own
# shape; a view covering a third of its storage is copied), and no storage view built for nothing
CONTIGUOUS_COPY = Counter({"clone.default": 1})
# lorenzo's launches each take a zeroed scan state (its single-pass prefix sum over thread blocks)
SCAN_STATE = Counter({"zeros.default": 1})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("codec_options, transposed, per_launch", [
    (dict(bits=4, adaptive=False), STORAGE_VIEW, Counter()),
    (dict(bits=2, adaptive=False), STORAGE_VIEW, Counter()),
    (dict(codec="division"), CONTIGUOUS_COPY, Counter()),
    (dict(codec="lorenzo", error_bound=1e-2), STORAGE_VIEW, SCAN_STATE),
], ids=["4-bit", "2-bit", "division", "lorenzo"])
def test_a_compressed_save_costs_one_allocation_and_one_alias(hook_ops, codec_options, transposed, per_launch,
                                                              dtype):
    """Per compressed tensor, pack runs the encoded form's one allocation and the version alias (``detach``), and
    one launch (lorenzo: and its zeroed scan state); a transposed key also its flat storage view, or the copy a
    logical-layout codec reads. Unpack runs the decoded tensor's allocation, one launch (and scan state), and a
    view op only where the tensor is a view of what was stored. Kept tensors and parameters run no ATen op; a
    duplicate, only its alias. The ReLU output's 1-bit mask costs what a plain quantized tensor does."""
    packs, unpacks, kernels = _compressed_step(hook_ops, codec_options, dtype)
    compressed = [(record.codec, ops) for record, ops in packs if record.kind == COMPRESSED]
    assert len(compressed) >= 12
    forms = Counter()
    for codec, ops in compressed:
        plain = ONE_FORM + (per_launch if codec != "positive_mask" else Counter())
        assert ops in (plain, plain + transposed), (codec, ops)
        forms[ops == plain] += 1
    assert forms[False] == 2  # the two blocks' transposed keys
    for record, ops in packs:
        if record.kind in (KEPT, PARAMETER):
            assert not ops, (record, ops)
        elif record.kind == DUPLICATE:
            assert set(ops) <= {"detach.default"}, (record, ops)
    decoded = [(codec, ops) for codec, ops in unpacks if codec is not None]
    assert len(decoded) >= len(compressed)
    for codec, ops in decoded:
        plain = Counter({"empty.memory_format": 1}) + (per_launch if codec != "positive_mask" else Counter())
        views = ops - plain
        assert ops - views == plain and set(views) <= {"as_strided.default", "view.default"}, (codec, ops)
    # the transposed keys, from their decoded storages
    assert sum(ops["as_strided.default"] for _, ops in decoded) == (2 if transposed is STORAGE_VIEW else 0)
    assert all(not ops for codec, ops in unpacks if codec is None)
    # one launch a direction per compressed form (the ReLU output's mask among them)
    assert len(kernels) == len(compressed) + len(decoded)


def test_the_count_fails_for_an_op_added_to_the_hot_path(monkeypatch, hook_ops):
    """The guard above can fail: an encode that also clones its input shows up as an extra op per tensor."""
    from lightning_act.codecs.quantize import QuantizeCodec

    encode = QuantizeCodec.encode

    def cloning_encode(self, x, *, key=0):
        return encode(self, x.clone(), key=key)

    monkeypatch.setattr(QuantizeCodec, "encode", cloning_encode)
    packs, _, _ = _compressed_step(hook_ops, dict(bits=4, adaptive=False))
    compressed = [ops for record, ops in packs if record.kind == COMPRESSED and record.codec == "quantize"]
    assert compressed and all(ops["clone.default"] == 1 for ops in compressed)


class _SaveThird(torch.autograd.Function):
    """Saves the first third of ``x``'s last dim (a strided view covering a third of its storage: a fused
    projection's query)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x.chunk(3, dim=-1)[0])
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        third, = ctx.saved_tensors
        _SaveThird.unpacked = third.clone()
        return grad


@pytest.mark.parametrize("min_numel, ops", [(1 << 20, Counter()), (64, ONE_FORM + CONTIGUOUS_COPY)],
                         ids=["kept", "quantized"])
def test_a_strided_third_is_copied_only_when_it_is_compressed(hook_ops, min_numel, ops):
    """A view covering a third of its storage is compressed as a contiguous copy of it; kept (under ``min_numel``)
    it is held as it is, with no copy made and thrown away. Either way the backward reads its values."""
    x = torch.randn(8, 16, 96, requires_grad=True)
    with use_runner(RecordingRunner()):
        compressor = act.ActivationCompressor(nn.Linear(1, 1), act.ACTConfig(backend="cupy", bits=8, adaptive=False,
                                                                             min_numel=min_numel))
        with compressor.compress():
            y = _SaveThird.apply(x * 1)  # an op output: x itself would be a leaf (a parameter to the engine)
    assert hook_ops.packs[-1][1] == ops
    if not ops:  # kept: the values themselves (the no-op runner writes no decoded values)
        y.sum().backward()
        torch.testing.assert_close(_SaveThird.unpacked, x.detach().chunk(3, dim=-1)[0], rtol=0, atol=0)


class _SaveAsGiven(torch.autograd.Function):
    """Saves its input as it is (a channels_last activation keeps its strides)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        saved, = ctx.saved_tensors
        _SaveAsGiven.unpacked = saved.clone(memory_format=torch.preserve_format)
        return grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("codec_options, ops, atol, strided", [
    # its whole storage, flat, read in place, and rebuilt with its strides
    (dict(bits=8, adaptive=False), ONE_FORM + STORAGE_VIEW, 0.03, True),
    # planes in the tensor's own shape (2-bit residuals of 8 x 8 block means), decoded contiguous
    (dict(codec="division"), ONE_FORM + CONTIGUOUS_COPY, 2.0, False),
], ids=["quantize", "division"])
def test_a_channels_last_activation_is_read_as_its_codec_reads_it(hook_ops, codec_options, ops, atol, strided,
                                                                   dtype):
    """A channels_last conv activation: a memory-order codec reads its storage as it lies (no copy), a
    logical-layout codec a contiguous copy; either way it comes back with its values, float64 included (the
    values checked on the torch path, the ops on the CUDA path)."""
    torch.manual_seed(0)
    x = torch.randn(4, 8, 12, 12, dtype=dtype).relu().to(memory_format=torch.channels_last).requires_grad_()
    for backend in ("cupy", "torch"):
        with use_runner(RecordingRunner()):
            compressor = act.ActivationCompressor(nn.Linear(1, 1), act.ACTConfig(backend=backend, min_numel=64,
                                                                                 **codec_options))
            with compressor.compress():
                y = _SaveAsGiven.apply(x * 1)  # an op output, channels_last like x
            if backend == "cupy":
                assert hook_ops.packs[-1][1] == ops
            else:
                y.sum().backward()
    assert _SaveAsGiven.unpacked.dtype == dtype
    assert _SaveAsGiven.unpacked.is_contiguous(memory_format=torch.channels_last) == strided
    torch.testing.assert_close(_SaveAsGiven.unpacked, x.detach(), rtol=0, atol=atol)
