"""Reference models built without torchvision or a hub download (torchvision does not import beside every
torch build): what the recipes, the benchmarks, the tests and users comparing with published figures share.

- ``resnet50(num_classes)``: ResNet-50, for comparisons with published figures
- ``resnet8(in_channels, classes, width)``: a small ResNet for any image size (the CNN recipe's network)
- ``DigitsCNN``: the demo's LightningModule, a three-conv CNN for 8x8 digits; ``ImageClassifierBase``: the
  cross-entropy training and validation accuracy it shares with the CNN recipe's module
- ``gnn(kind, in_dim, hidden, classes, layers, cached)``: a torch_geometric node classifier, one of
  ``GNN_MODELS`` (GCN, GAT, GCNII, GraphSAGE; ``pip install 'lightning-act[gnn]'``)
"""
from __future__ import annotations

import contextlib
import importlib.util

import lightning as L
import torch
from torch import nn

from .nn.bounded_cnn import ResidualReLU


# ---- images ---------------------------------------------------------------------------------------------------
class Bottleneck(nn.Module):
    """ResNet-50's bottleneck: 1x1 -> 3x3 (stride) -> 1x1 (x4 channels), BN after each, ReLU after the sum."""

    def __init__(self, in_channels: int, width: int, stride: int):
        super().__init__()
        out_channels = 4 * width
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, out_channels, 1, bias=False), nn.BatchNorm2d(out_channels))
        self.shortcut = nn.Identity() if stride == 1 and in_channels == out_channels else nn.Sequential(
            nn.Conv2d(in_channels, out_channels, 1, stride, bias=False), nn.BatchNorm2d(out_channels))
        self.merge = ResidualReLU()  # relu(body + shortcut); lightning_act.nn.convert_bounded_cnn bounds its backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.merge.residual(x, self.body, self.shortcut)


def resnet50(num_classes: int = 1000) -> nn.Sequential:
    """ResNet-50 (He et al. 2016): stem, stages of 3/4/6/3 bottlenecks, average pool, linear head."""
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                               nn.MaxPool2d(3, 2, 1)]
    channels = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(blocks):
            layers.append(Bottleneck(channels, width, stride if i == 0 else 1))
            channels = 4 * width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes)]
    return nn.Sequential(*layers)


class BasicBlock(nn.Module):
    """ResNet basic block: conv-BN-ReLU-conv-BN plus the (projected) input, then ReLU."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
        self.shortcut = (nn.Identity() if stride == 1 and cin == cout else
                         nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)))
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.body(x) + self.shortcut(x))


def resnet8(in_channels: int, classes: int, width: int = 16) -> nn.Sequential:
    """A ResNet-8 style network for any image size: stem, three stages of basic blocks (width w, 2w, 4w; the
    last two halve the resolution), global average pooling, linear head."""
    w = width
    return nn.Sequential(
        nn.Conv2d(in_channels, w, 3, 1, 1, bias=False), nn.BatchNorm2d(w), nn.ReLU(),
        BasicBlock(w, w, 1), BasicBlock(w, 2 * w, 2), BasicBlock(2 * w, 4 * w, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * w, classes))


class ImageClassifierBase(L.LightningModule):
    """Cross-entropy training of ``self.net`` (set by the subclass, which also configures the optimizer);
    validation counts correct predictions (``val_correct/val_total``) and logs ``val/accuracy``."""

    val_correct = val_total = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def on_validation_epoch_start(self):
        self.val_correct = self.val_total = 0

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_correct += (self.net(x).argmax(1) == y).sum().item()
        self.val_total += len(y)

    def on_validation_epoch_end(self):
        self.log("val/accuracy", self.val_correct / max(1, self.val_total), prog_bar=True)


class DigitsCNN(ImageClassifierBase):
    """The demo's CNN for 1x8x8 digits (three convs, one max-pool, dropout, linear head), trained with Adam."""

    def __init__(self, lr: float = 2e-3):
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Dropout(0.2), nn.Linear(64 * 16, 10))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


# ---- graphs ---------------------------------------------------------------------------------------------------
GNN_MODELS = ("gcn", "gat", "gcnii", "sage")


class StackedGNN(nn.Module):
    """``layers`` convs of GCN, GAT (4 heads) or GraphSAGE, each but the last followed by ``post``, the activation
    then dropout (the input is dropped out too). ``block(i, x, adj)`` runs layer ``i`` with what follows it, the
    unit a per-layer checkpoint wraps. ``post`` is one ``nn.Sequential`` so that
    ``lightning_act.integrations.fuse_gcn`` can swap it (ReLU + dropout) for ``ReLUDropout``."""

    def __init__(self, kind: str, in_dim: int, hidden: int, classes: int, layers: int = 2, dropout: float = 0.5,
                 cached: bool = False):
        super().__init__()
        from torch_geometric.nn import GATConv, GCNConv, SAGEConv

        dims = [in_dim] + [hidden] * (layers - 1) + [classes]
        if kind == "gat":
            heads = 4
            self.convs = nn.ModuleList([GATConv(a, b // heads, heads=heads, dropout=dropout)
                                        for a, b in zip(dims[:-2], dims[1:-1])]
                                       + [GATConv(dims[-2], classes, heads=1, dropout=dropout)])
            self.act = nn.ELU()
        elif kind == "gcn":
            self.convs = nn.ModuleList([GCNConv(a, b, cached=cached) for a, b in zip(dims[:-1], dims[1:])])
            self.act = nn.ReLU()
        else:
            self.convs = nn.ModuleList([SAGEConv(a, b) for a, b in zip(dims[:-1], dims[1:])])
            self.act = nn.ReLU()
        self.dropout = nn.Dropout(dropout)
        self.post = nn.Sequential(self.act, self.dropout)

    def block(self, i: int, x, adj):
        x = self.convs[i](x, adj)
        return x if i == len(self.convs) - 1 else self.post(x)

    def forward(self, x, adj):
        x = self.dropout(x)
        for i, conv in enumerate(self.convs):
            x = conv(x, adj)  # the conv's input is let go before the activation (a block() call would hold it)
            if i < len(self.convs) - 1:
                x = self.post(x)
        return x


class GCNII(nn.Module):
    """GCNII (Chen et al. 2020): linear in, ``layers`` initial-residual + identity-mapping convs, linear out."""

    def __init__(self, in_dim: int, hidden: int, classes: int, layers: int = 8, alpha: float = 0.1,
                 theta: float = 0.5, dropout: float = 0.5, cached: bool = False):
        super().__init__()
        from torch_geometric.nn import GCN2Conv

        self.lin_in, self.lin_out = nn.Linear(in_dim, hidden), nn.Linear(hidden, classes)
        self.convs = nn.ModuleList([GCN2Conv(hidden, alpha, theta, layer=i + 1, cached=cached)
                                    for i in range(layers)])
        self.act, self.dropout = nn.ReLU(), nn.Dropout(dropout)

    def forward(self, x, adj):
        x = x0 = self.act(self.lin_in(self.dropout(x)))
        for conv in self.convs:
            x = self.act(conv(self.dropout(x), x0, adj))
        return self.lin_out(self.dropout(x))


def gnn(kind: str, in_dim: int, hidden: int, classes: int, layers: int | None = None,
        cached: bool = False) -> nn.Module:
    """A node classifier of ``kind`` (one of ``GNN_MODELS``) taking ``(x, adj)``, ``adj`` an ``edge_index`` or a
    sparse CSR adjacency (``lightning_act.datasets.adjacency(data, "sparse")``, PyG's ``adj_t``).

    ``layers``: graph convolutions (default 2; GCNII 8). ``cached``: GCN and GCNII normalize the adjacency in
    their first forward and reuse it (full-batch training on one graph; a model so built must not see another).
    With a sparse adjacency GCN, GCNII and GraphSAGE aggregate by a sparse-dense product and materialise no
    edge-sized messages (GAT's attention is per edge whatever the input)."""
    if kind not in GNN_MODELS:
        raise ValueError(f"unknown model {kind!r}; allowed: {', '.join(GNN_MODELS)}")
    if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int) or layers < 1):
        raise ValueError(f"layers={layers!r}; expected an integer >= 1")
    if importlib.util.find_spec("torch_geometric") is None:
        raise ImportError("the GNN models need torch_geometric: pip install 'lightning-act[gnn]'")
    if kind == "gcnii":
        return GCNII(in_dim, hidden, classes, layers or 8, cached=cached)
    return StackedGNN(kind, in_dim, hidden, classes, layers or 2, cached=cached)


def node_classification_step(model: nn.Module, data, adj, optimizer: torch.optim.Optimizer,
                             compressor=None) -> torch.Tensor:
    """One full-batch training step of a node classifier on ``data``'s training nodes, under ``compressor``
    (an ``ActivationCompressor``) when given; returns the loss."""
    model.train()
    optimizer.zero_grad()
    with compressor.compress() if compressor is not None else contextlib.nullcontext():
        out = model(data.x, adj)
        loss = nn.functional.cross_entropy(out[data.train_mask], data.y[data.train_mask])
    loss.backward()
    optimizer.step()
    return loss
