"""Every tensor users train on (issue #16): memory formats x dtypes x codecs on a CNN block, a transformer layer
and a GCN layer. Exact configurations (L0, and lossless masks with raw values) must give the uncompressed
gradients bit for bit; 8 bits a cosine of at least 0.999; every configuration finite gradients."""
import contextlib

import pytest
import torch
from torch import nn

import lightning as L

import lightning_act as act
from lightning_act.stats import COMPRESSED, KEPT

CONFIGS = {
    "L0": (act.ACTConfig(opt_level="L0"), "exact"),
    "masks": (act.ACTConfig(bits=32, adaptive=False, min_numel=0), "exact"),  # lossless masks, raw values
    "q8": (act.ACTConfig(bits=8, adaptive=False, min_numel=0), 0.999),
    # stochastic rounding on these tiny batches (30-800 rows): noise averages out less than in training
    "q4": (act.ACTConfig(bits=4, adaptive=False, min_numel=0), 0.95),
    "q2": (act.ACTConfig(bits=2, adaptive=False, min_numel=0), 0.5),
    "division": (act.ACTConfig(codec="division", min_numel=0), 0.6),
    "lorenzo": (act.ACTConfig(codec="lorenzo", error_bound=1e-3, min_numel=0), 0.999),
}
DTYPES = {"fp32": (torch.float32, None), "bf16-autocast": (torch.float32, torch.bfloat16),
          "fp64": (torch.float64, None)}


class ResidualBlock(nn.Module):
    """Conv-BN-ReLU-MaxPool-Conv with a residual add (the stem and first block of a ResNet)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        self.body = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                  nn.Conv2d(16, 16, 3, padding=1))
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        h = self.stem(x)
        h = torch.relu(h + self.body(h))
        return self.head(h.mean(dim=(2, 3)))


def cnn_case(memory_format: torch.memory_format, dtype: torch.dtype):
    torch.manual_seed(0)
    model = ResidualBlock().to(dtype=dtype, memory_format=memory_format)
    x = torch.randn(4, 3, 20, 20, dtype=dtype).contiguous(memory_format=memory_format)
    return model, lambda: model(x).square().mean()


def transformer_case(dtype: torch.dtype):
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True).to(dtype)
    x, target = torch.randn(3, 10, 32, dtype=dtype), torch.randn(3, 10, 32, dtype=dtype)
    # a random projection: the square of a LayerNorm output has nearly no gradient
    return model, lambda: (model(x) * target).mean()


def gcn_case(dtype: torch.dtype):
    gnn = pytest.importorskip("torch_geometric.nn")
    torch.manual_seed(0)
    model = gnn.GCNConv(16, 8).to(dtype)
    x = torch.randn(200, 16, dtype=dtype)
    edge_index = torch.randint(0, 200, (2, 800))
    return model, lambda: torch.relu(model(x, edge_index)).square().mean()


def gradients(model: nn.Module, loss_fn, autocast_dtype, compressor=None) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    autocast = torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
    with compressor.compress() if compressor else contextlib.nullcontext(), autocast:
        loss = loss_fn()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def check(model, loss_fn, config_name: str, autocast_dtype) -> act.CompressionStats:
    config, expected = CONFIGS[config_name]
    exact = gradients(model, loss_fn, autocast_dtype)
    compressor = act.ActivationCompressor(model, config)
    got = gradients(model, loss_fn, autocast_dtype, compressor)
    assert all(torch.isfinite(g).all() for g in got)
    if expected == "exact":
        assert all(torch.equal(a, b) for a, b in zip(exact, got))
    else:
        flat = lambda grads: torch.cat([g.flatten().double() for g in grads])  # noqa: E731
        assert torch.nn.functional.cosine_similarity(flat(exact), flat(got), dim=0) >= expected
    return compressor.stats()


@pytest.mark.parametrize("config_name", list(CONFIGS))
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=["contiguous",
                                                                                              "channels_last"])
def test_cnn_block(config_name, dtype_name, memory_format):
    dtype, autocast_dtype = DTYPES[dtype_name]
    stats = check(*cnn_case(memory_format, dtype), config_name, autocast_dtype)
    if config_name != "L0":
        codecs = {r.codec for r in stats.records if r.kind == COMPRESSED}
        assert {"positive_mask", "maxpool_index"} <= codecs  # the lossless forms work in every layout
        assert not [r for r in stats.records if r.kind == KEPT and r.dtype.is_floating_point]


@pytest.mark.parametrize("config_name", list(CONFIGS))
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_transformer_layer(config_name, dtype_name):
    dtype, autocast_dtype = DTYPES[dtype_name]
    check(*transformer_case(dtype), config_name, autocast_dtype)


@pytest.mark.parametrize("config_name", list(CONFIGS))
@pytest.mark.parametrize("dtype_name", ["fp32", "fp64"])
def test_gcn_layer(config_name, dtype_name):
    dtype, autocast_dtype = DTYPES[dtype_name]
    check(*gcn_case(dtype), config_name, autocast_dtype)


@pytest.mark.parametrize("memory_format", [torch.channels_last_3d, "transposed", "sliced", "expanded"])
def test_strided_layouts_round_trip_exactly_at_32_bits(memory_format):
    """Views the ops produce come back with their values and strides (the engine stores their storage)."""
    torch.manual_seed(0)
    base = torch.randn(2, 3, 4, 5, 6, requires_grad=True)
    views = {
        torch.channels_last_3d: lambda b: (b * 1.0).contiguous(memory_format=torch.channels_last_3d),
        "transposed": lambda b: (b * 1.0).transpose(1, 4),
        "sliced": lambda b: (b * 1.0)[:, :, 1:3],
        "expanded": lambda b: (b * 1.0)[:, :1].expand(2, 7, 4, 5, 6),
    }
    compressor = act.ActivationCompressor(None, act.ACTConfig(bits=32, adaptive=False, min_numel=0))
    with compressor.compress():
        view = views[memory_format](base)
        loss = (view.exp()).sum()  # exp saves its output: contiguous; the view's consumers save the view
        loss2 = (view * view).sum()  # mul saves both operands: the view itself
    (loss + loss2).backward()
    reference = base.detach().clone().requires_grad_(True)
    ref_view = views[memory_format](reference)
    (ref_view.exp().sum() + (ref_view * ref_view).sum()).backward()
    assert torch.equal(base.grad, reference.grad)


class BlockModule(L.LightningModule):
    """The residual block as a LightningModule; ``memory_format`` for its weights and batches."""

    def __init__(self, memory_format: torch.memory_format = torch.contiguous_format):
        super().__init__()
        torch.manual_seed(0)
        self.block = ResidualBlock().to(memory_format=memory_format)
        self.memory_format = memory_format
        self.steps: list[act.CompressionStats] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.block(x.contiguous(memory_format=self.memory_format)), y)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.steps.append(self.trainer.strategy.compressor.stats())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def block_loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(24, 3, 20, 20, generator=g), torch.randint(0, 5, (24,), generator=g))
    return torch.utils.data.DataLoader(data, batch_size=8)


def fit(module: L.LightningModule, config: act.ACTConfig, **trainer_args) -> None:
    trainer = L.Trainer(strategy=act.ACTStrategy(config), max_steps=3, accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        **trainer_args)
    trainer.fit(module, block_loader())


@pytest.mark.parametrize("config", [act.ACTConfig(), act.ACTConfig(bits=2, adaptive=False),
                                    act.ACTConfig(codec="division"), act.ACTConfig(codec="lorenzo", error_bound=1e-3)],
                         ids=["L1", "q2", "division", "lorenzo"])
def test_channels_last_resnet_block_trains_under_the_act_strategy(config):
    module = BlockModule(torch.channels_last)
    before = [p.detach().clone() for p in module.parameters()]
    fit(module, config)
    assert len(module.steps) == 3 and all(s.num_compressed > 0 and s.ratio > 1 for s in module.steps)
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, module.parameters()))


@pytest.mark.parametrize("level", act.LEVELS)
def test_float64_model_trains_under_every_level_and_stats_say_what_happened(level):
    module = BlockModule()
    with pytest.warns(UserWarning, match="checkpoints HuggingFace layers") if level.startswith("CB") \
            else contextlib.nullcontext():
        fit(module, act.ACTConfig(opt_level=level, min_numel=0), precision="64-true")
    assert all(p.dtype == torch.float64 and torch.isfinite(p).all() for p in module.parameters())
    records = [r for r in module.steps[-1].records if r.dtype == torch.float64 and r.kind in (COMPRESSED, KEPT)]
    assert records
    for r in records:  # each float64 activation is compressed, or kept with the reason said
        assert r.kind == COMPRESSED or (r.reason and r.codec == "none"), r
    if level != "L0":
        assert any(r.kind == COMPRESSED and r.codec == "quantize" for r in records)
