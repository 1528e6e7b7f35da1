"""Models and helpers the benchmark scripts share: each builder returns ``(model, loss_fn)`` for one fixed
random batch (random init, nothing downloaded), sized so that saved activations dominate a training step."""
from __future__ import annotations

import platform
import statistics
import time
from pathlib import Path

import torch
from torch import nn


def cnn(batch: int, size: int = 64):
    """Three conv-BN-ReLU layers (32, 64, 64 channels) with two max-pools and a linear head, on ``size``^2 RGB."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * (size // 4) ** 2, 10))
    x, y = torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,))
    return model, lambda: nn.functional.cross_entropy(model(x), y)


def bert(batch: int, seq: int = 128, layers: int = 4, hidden: int = 256, attn_implementation: str | None = None):
    """``BertForSequenceClassification`` from a small config (``layers`` x ``hidden``, 4 heads), random tokens."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    options = {"attn_implementation": attn_implementation} if attn_implementation else {}
    cfg = BertConfig(vocab_size=2000, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                     intermediate_size=4 * hidden, max_position_embeddings=max(seq, 64), **options)
    model = BertForSequenceClassification(cfg).train()
    ids, labels = torch.randint(0, 2000, (batch, seq)), torch.randint(0, 2, (batch,))
    return model, lambda: model(input_ids=ids, labels=labels).loss


def gcn(nodes: int, degree: int = 10, features: int = 128, hidden: int = 256, classes: int = 16):
    """A two-layer torch_geometric GCN (ReLU, dropout) on a random graph of ``nodes`` nodes, full batch."""
    from torch_geometric.nn import GCNConv

    torch.manual_seed(0)

    class GCN(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.conv2 = GCNConv(features, hidden), GCNConv(hidden, classes)
            self.dropout = nn.Dropout(0.5)

        def forward(self, x, edge_index):
            return self.conv2(self.dropout(torch.relu(self.conv1(x, edge_index))), edge_index)

    model = GCN()
    x, y = torch.randn(nodes, features), torch.randint(0, classes, (nodes,))
    edge_index = torch.randint(0, nodes, (2, nodes * degree))
    return model, lambda: nn.functional.cross_entropy(model(x, edge_index), y)


def train_step(model: nn.Module, loss_fn, compressor=None) -> float:
    """Seconds of one forward + backward (inside ``compressor.compress()`` when given)."""
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    if compressor is None:
        loss = loss_fn()
    else:
        with compressor.compress():
            loss = loss_fn()
    loss.backward()
    return time.perf_counter() - start


def median_step_times(model: nn.Module, loss_fn, compressors: dict, repeats: int, warmup: int = 2) -> dict:
    """Median step seconds per entry of ``compressors`` (``None``: no compression), the entries taking turns
    step by step after ``warmup`` rounds, so every configuration sees the same machine state."""
    times = {name: [] for name in compressors}
    for round_index in range(warmup + repeats):
        for name, compressor in compressors.items():
            seconds = train_step(model, loss_fn, compressor)
            if round_index >= warmup:
                times[name].append(seconds)
    return {name: statistics.median(t) for name, t in times.items()}


def machine() -> str:
    """What the numbers were measured on."""
    return (f"{platform.machine()} {platform.processor() or ''}".strip() +
            f", {torch.get_num_threads()} threads, torch {torch.__version__}")


def publish(text: str, out: Path | None) -> None:
    """Print a result and write it to ``out`` when given."""
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
