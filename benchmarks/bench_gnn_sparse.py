"""Peak memory of a full-batch GCN training step over an ``edge_index`` and over a sparse adjacency, compressed
or not, with PyG's layers and with the fused ones, and the accuracy of the sparse path (issue #17, part 3).

Over an ``edge_index``, PyG's ``GCNConv`` gathers one message per edge (E x hidden floats) and scatters them:
temporaries that are not saved tensors, so compression cannot move them. Over a sparse CSR adjacency (PyG's
``adj_t``) it aggregates by ``torch.sparse.mm``: no edge-sized tensor, and what a step holds is mostly the
node-sized activations autograd saves, which the compressor shrinks. (``torch.sparse.mm`` saves only the sparse
matrix for the dense operand's gradient; the engine keeps it as it is and counts it once per step.) What is left
is backward temporaries: about five node-sized tensors per ``GCNConv`` and three per ReLU + dropout. "fused"
rows swap them (``lightning_act.integrations.fuse_gcn``) for ``SparseGCNConv`` and ``ReLUDropout``, whose
backward holds two (the incoming and the outgoing gradient) plus chunk-sized temporaries; "fused convs only"
keeps PyG's ReLU and dropout.

Memory: a random graph (``--nodes``, ``--degree`` edges per node on average, seeded), random features and labels,
``lightning_act.models.gnn("gcn", features, hidden, classes, layers, cached=True)``. Per configuration: one
untimed step, one timed step, then one step measured by ``lightning_act.profiling.measure_step_memory`` (the
CPU allocator's events; gradients freed before). Peak: the most tensor memory the step held above its start
(the graph, features and weights exist before it). Saved: what autograd keeps uncompressed (an ``L0``
compressor's count, adjacency included); stored: the configuration's ``stats().stored_bytes``. L1 runs one
auto-precision round first (4 bits on average). Checkpointing: ``torch.utils.checkpoint`` (non-reentrant)
around each layer's conv, activation and dropout (``StackedGNN.block``). Peak ÷: the sparse uncompressed
(PyG) model's peak over this one's; ÷ fused: the fused uncompressed model's over this one's.

Accuracy: the GNN recipe's model and data (2-layer GCN, hidden 64, synthetic block model of 1,600 nodes, Adam
0.01, 100 epochs, 4 bits), over ``edge_index``, the sparse adjacency and the sparse adjacency with the fused
layers, uncompressed and compressed, per seed.

    python benchmarks/bench_gnn_sparse.py [--nodes 200000] [--degree 10] [--layers 3 6] [--seeds 0 1 2]
    python benchmarks/bench_gnn_sparse.py --quick     # tiny sizes, the test suite's smoke run
"""
from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import lightning_act as act
from lightning_act.adapt import AutoPrecision
from lightning_act.datasets import adjacency, synthetic_sbm
from lightning_act.integrations import fuse_gcn
from lightning_act.models import gnn, node_classification_step
from lightning_act.profiling import measure_step_memory
from lightning_act.stats import COMPRESSED
from models import machine, publish

HERE = Path(__file__).resolve().parent
MiB = 2**20
# name -> (adjacency, compressor config or None, checkpoint each layer, layers: "pyg" | "fused" | "fused convs")
CONFIGS = {
    "edge_index, uncompressed": ("edge_index", None, False, "pyg"),
    "sparse, uncompressed": ("sparse", None, False, "pyg"),
    "sparse, 4-bit": ("sparse", act.ACTConfig(bits=4, adaptive=False), False, "pyg"),
    "sparse, 2-bit": ("sparse", act.ACTConfig(bits=2, adaptive=False), False, "pyg"),
    "sparse, L1 (auto-precision)": ("sparse", act.ACTConfig(opt_level="L1"), False, "pyg"),
    "sparse, checkpoint per layer": ("sparse", None, True, "pyg"),
    "fused sparse, uncompressed": ("sparse", None, False, "fused"),
    "fused sparse, 4-bit": ("sparse", act.ACTConfig(bits=4, adaptive=False), False, "fused"),
    "fused sparse, 2-bit": ("sparse", act.ACTConfig(bits=2, adaptive=False), False, "fused"),
    "fused convs only, 4-bit": ("sparse", act.ACTConfig(bits=4, adaptive=False), False, "fused convs"),
}


def _model(layers_kind: str, features: int, hidden: int, classes: int, layers: int):
    torch.manual_seed(0)  # the same weights for every variant
    model = gnn("gcn", features, hidden, classes, layers, cached=True)
    if layers_kind != "pyg":
        fuse_gcn(model, relu_dropout=layers_kind == "fused")
    return model


def random_graph(nodes: int, degree: int, features: int, classes: int, seed: int = 0):
    from torch_geometric.data import Data

    g = torch.Generator().manual_seed(seed)
    edge_index = torch.randint(0, nodes, (2, nodes * degree), generator=g)
    return Data(x=torch.randn(nodes, features, generator=g), edge_index=edge_index,
                y=torch.randint(0, classes, (nodes,), generator=g))


def _forward(model, x, adj, per_layer_checkpoint: bool):
    if not per_layer_checkpoint:
        return model(x, adj)
    x = model.dropout(x)
    for i in range(len(model.convs)):
        x = checkpoint(model.block, i, x, adj, use_reentrant=False)
    return x


def memory_rows(data, hidden: int, classes: int, layers: int, configs) -> list[dict]:
    adjs = {kind: adjacency(data, kind) for kind in {CONFIGS[name][0] for name in configs}}
    models = {}  # one model per adjacency and layers: cached=True keeps the normalized form of the first one seen
    for kind, layers_kind in {(CONFIGS[name][0], CONFIGS[name][3]) for name in configs}:
        models[kind, layers_kind] = _model(layers_kind, data.num_features, hidden, classes, layers)
    rows = []
    for name in configs:
        kind, config, per_layer_checkpoint, layers_kind = CONFIGS[name]
        model, adj = models[kind, layers_kind], adjs[kind]
        compressor = act.ActivationCompressor(model, config or act.ACTConfig(opt_level="L0"))

        def step(compress: bool = config is not None):
            with compressor.compress() if compress else contextlib.nullcontext():
                out = _forward(model, data.x, adj, per_layer_checkpoint)
                loss = nn.functional.cross_entropy(out, data.y)
            loss.backward()

        if config is not None and config.adaptive:
            auto = AutoPrecision(compressor)
            auto.adapt(0, step)
        step()
        model.zero_grad(set_to_none=True)
        started = time.perf_counter()
        step()
        seconds = time.perf_counter() - started
        model.zero_grad(set_to_none=True)
        peak = measure_step_memory(step).peak_bytes
        model.zero_grad(set_to_none=True)
        stored = compressor.stats().stored_bytes if config is not None else None
        if config is None and not per_layer_checkpoint:
            step(compress=True)  # the L0 compressor counts what autograd saves
            model.zero_grad(set_to_none=True)
            stored = compressor.stats().stored_bytes
        rows.append({"layers": layers, "config": name, "peak": peak, "stored": stored, "seconds": seconds,
                     "compressed": [tuple(r.shape) for r in compressor.stats().records if r.kind == COMPRESSED]})
        print(f"  {layers} layers, {name}: peak {peak / MiB:.1f} MiB, {seconds:.1f} s", flush=True)
    base = next(r for r in rows if r["config"] == "sparse, uncompressed")
    fused = next((r for r in rows if r["config"] == "fused sparse, uncompressed"), None)
    for r in rows:
        r["reduction"] = base["peak"] / r["peak"]
        r["reduction_fused"] = fused["peak"] / r["peak"] if fused is not None else None
    return rows


ACCURACY_KINDS = ("edge_index", "sparse", "sparse, fused")


def accuracy(seeds, epochs: int) -> list[dict]:
    """Test accuracy of the GNN recipe's GCN on its default data, per seed, adjacency and compression."""
    rows = []
    for seed in seeds:
        data = synthetic_sbm(seed=seed)
        for kind in ACCURACY_KINDS:
            adj = adjacency(data, kind.removesuffix(", fused"))
            for compress in (False, True):
                torch.manual_seed(seed)
                model = gnn("gcn", data.num_features, 64, int(data.y.max()) + 1, cached=True)
                if kind.endswith("fused"):
                    fuse_gcn(model)
                optimizer = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)
                compressor = act.ActivationCompressor(model, act.ACTConfig(bits=4, adaptive=False, min_numel=256))
                for _ in range(epochs):
                    node_classification_step(model, data, adj, optimizer, compressor if compress else None)
                model.eval()
                with torch.no_grad():
                    predicted = model(data.x, adj).argmax(1)
                correct = (predicted[data.test_mask] == data.y[data.test_mask]).float().mean().item()
                rows.append({"seed": seed, "adjacency": kind, "compressed": compress, "accuracy": correct})
    return rows


def _table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *["| " + " | ".join(str(c) for c in row) + " |" for row in rows]]


def report(memory: list[dict], acc: list[dict], args, command: str) -> str:
    where = f"Command: `{command}`; machine: {machine()}."
    lines = ["# GCN over a sparse adjacency: step peak, compressed or not", "", where, "",
             f"Random graph: {args.nodes:,} nodes, {args.degree * args.nodes:,} edges (average degree "
             f"{args.degree}), {args.features} features, {args.classes} classes; GCN of hidden {args.hidden}. "
             "Peak: tensor memory the training step held above its start (`measure_step_memory`); peak ÷: the "
             "sparse uncompressed (PyG `GCNConv`) model's peak / this one's; ÷ fused: the fused uncompressed "
             "model's peak / this one's. Fused: `fuse_gcn` (`SparseGCNConv` + `ReLUDropout`); fused convs only: "
             "`SparseGCNConv` with PyG's ReLU and dropout. Saved / stored: bytes autograd keeps from forward to "
             "backward (uncompressed rows: what it saves; compressed rows: what the compressor stores). Step s: "
             "one unprofiled step on a shared CPU.", ""]
    header = ["layers", "config", "peak MiB", "peak ÷", "÷ fused", "saved / stored MiB", "step s"]
    lines += _table(header, [[r["layers"], r["config"], f"{r['peak'] / MiB:.1f}", f"{r['reduction']:.2f}",
                              "-" if r["reduction_fused"] is None else f"{r['reduction_fused']:.2f}",
                              "-" if r["stored"] is None else f"{r['stored'] / MiB:.1f}", f"{r['seconds']:.3g}"]
                             for r in memory])
    shapes = sorted({s for r in memory if r["config"] == "sparse, 4-bit" for s in r["compressed"]})
    lines += ["", f"Saved tensors the 4-bit configuration compresses (shapes): {', '.join(map(str, shapes))}: "
              "node-sized activations only; the sparse adjacency is kept as it is, counted once per step."]
    fused = sorted({s for r in memory if r["config"] == "fused sparse, 4-bit" for s in r["compressed"]})
    if fused:
        lines += ["", f"The fused 4-bit configuration compresses row chunks of each conv's input (shapes: "
                  f"{', '.join(map(str, fused))}); ReLUDropout saves its keep-mask already packed at 1 bit."]
    lines += [""]
    if acc:
        seeds = sorted({r["seed"] for r in acc})
        lines += ["## Accuracy on the GNN recipe's data", "",
                  f"2-layer GCN, hidden 64, synthetic block model (1,600 nodes, 960 test nodes), {args.epochs} "
                  "epochs, 4 bits; test accuracy per seed and mean. \"sparse, fused\": `fuse_gcn` (its dropout "
                  "draws other masks than `nn.Dropout`).", ""]
        rows = []
        for kind in ACCURACY_KINDS:
            for compress in (False, True):
                values = [r["accuracy"] for r in acc if r["adjacency"] == kind and r["compressed"] == compress]
                rows.append([kind, "4-bit" if compress else "uncompressed",
                             ", ".join(f"{100 * v:.2f}" for v in values), f"{100 * sum(values) / len(values):.2f}"])
        lines += _table(["adjacency", "activations", f"accuracy % (seeds {', '.join(map(str, seeds))})", "mean %"],
                        rows)
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=200_000)
    parser.add_argument("--degree", type=int, default=10)
    parser.add_argument("--features", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--classes", type=int, default=16)
    parser.add_argument("--layers", type=int, nargs="+", default=[3, 6])
    parser.add_argument("--configs", nargs="+", choices=tuple(CONFIGS), default=list(CONFIGS),
                        metavar="CONFIG", help=f"some of: {'; '.join(CONFIGS)}")
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2], help="accuracy seeds (none: skipped)")
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1: on a shared machine each parallel op of a second thread waits "
                             "for a busy core, which penalises chunked code most)")
    parser.add_argument("--quick", action="store_true", help="2,000 nodes, 2 layers, one seed of 5 epochs")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "gnn_sparse.md")
    args = parser.parse_args(argv)
    if "sparse, uncompressed" not in args.configs:
        parser.error("--configs must include 'sparse, uncompressed' (the peak ÷ reference)")
    if args.quick:
        args.nodes, args.layers, args.seeds, args.epochs = 2000, [2], [0], 5
    command = shlex.join(["python", "benchmarks/bench_gnn_sparse.py", *(sys.argv[1:] if argv is None else argv)])
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", "Sparse")  # torch's beta and invariant-check notices for CSR tensors
    torch.manual_seed(0)
    data = random_graph(args.nodes, args.degree, args.features, args.classes)
    memory = [row for layers in args.layers
              for row in memory_rows(data, args.hidden, args.classes, layers, args.configs)]
    acc = accuracy(args.seeds, args.epochs)
    publish(report(memory, acc, args, command), args.out)
    return {"memory": memory, "accuracy": acc}


if __name__ == "__main__":
    main()
