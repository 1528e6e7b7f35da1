"""Gradient fidelity and compression ratio of torch_geometric layers whose backward compares or divides by saved
values (max aggregations, PNA's max and standard deviation, graph attention's softmax), with and without the op
rules that keep those values exact (``lightning_act.codecs.op_rules``, ``gradient=True``) and the scatter max/min
that saves winner masks instead (``lightning_act.codecs.winner_masks``).

Per layer: two of them (in -> 64 -> 64, GraphNorm and ReLU between) and a linear head on a random graph
(``--nodes``, 10 edges per node, seeded), one full-batch cross-entropy step. Per configuration: the gradient's
cosine to the uncompressed step's (all parameters; nan: the gradient holds NaN or infinities), whether it is
finite, and ``stats().ratio``. "without" rows run with every gradient rule and op replacement taken out of the
registry (the log-probabilities' 8-bit floor too): what the engine did before them, but for that floor.

    python benchmarks/bench_gnn_layers.py [--nodes 2000] [--out benchmarks/results/gnn_layers.md]
    python benchmarks/bench_gnn_layers.py --quick     # 300 nodes, two layers and two configs (the test's run)
"""
from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

import lightning_act as act
from lightning_act.codecs import op_rules

HERE = Path(__file__).resolve().parent
CONFIGS = {"L1": {}, "2-bit": dict(bits=2, adaptive=False), "division": dict(codec="division"),
           "lorenzo 1e-3": dict(codec="lorenzo", error_bound=1e-3)}


def layers(degree: torch.Tensor) -> dict:
    from torch_geometric import nn as pyg_nn

    return {
        "SAGEConv max": lambda i, o: pyg_nn.SAGEConv(i, o, aggr="max"),
        "PNAConv mean/max/std": lambda i, o: pyg_nn.PNAConv(i, o, aggregators=["mean", "max", "std"],
                                                            scalers=["identity", "amplification"], deg=degree),
        "GATConv": lambda i, o: pyg_nn.GATConv(i, o // 4, heads=4),
        "GINConv": lambda i, o: pyg_nn.GINConv(nn.Sequential(nn.Linear(i, o), nn.ReLU(), nn.Linear(o, o))),
    }


class Net(nn.Module):
    def __init__(self, make, features: int, classes: int):
        from torch_geometric.nn import GraphNorm

        super().__init__()
        self.first, self.second = make(features, 64), make(64, 64)
        self.norm, self.head = GraphNorm(64), nn.Linear(64, classes)

    def forward(self, x, edges):
        return self.head(torch.relu(self.second(torch.relu(self.norm(self.first(x, edges))), edges)))


@contextlib.contextmanager
def without_gradient_rules():
    """The gradient rules and the op replacements out of the registry while the block runs (what the engine did
    before them)."""
    removed = {fn: op_rules.OP_RULES.pop(fn) for fn in op_rules.GRADIENT_RULE_FUNCTIONS if fn in op_rules.OP_RULES}
    tracked, replacements = set(op_rules.GRADIENT_RULE_FUNCTIONS), dict(op_rules.OP_REPLACEMENTS)
    op_rules.GRADIENT_RULE_FUNCTIONS.clear()
    op_rules.OP_REPLACEMENTS.clear()
    try:
        yield
    finally:
        op_rules.OP_RULES.update(removed)
        op_rules.GRADIENT_RULE_FUNCTIONS.update(tracked)
        op_rules.OP_REPLACEMENTS.update(replacements)


def gradient(model, x, edges, y, config: act.ACTConfig | None):
    model.zero_grad(set_to_none=True)
    compressor = act.ActivationCompressor(model, config) if config is not None else None
    with compressor.compress() if compressor is not None else contextlib.nullcontext():
        loss = nn.functional.cross_entropy(model(x, edges), y)
    loss.backward()
    flat = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return flat, compressor


def run(nodes: int, layer_names: list[str] | None, config_names: list[str]) -> list[dict]:
    from torch_geometric.utils import degree as node_degree

    torch.manual_seed(0)
    edges = torch.randint(0, nodes, (2, 10 * nodes))
    x, y = torch.randn(nodes, 32), torch.randint(0, 4, (nodes,))
    made = layers(torch.bincount(node_degree(edges[1], nodes).long()))
    rows = []
    for name in layer_names or list(made):
        torch.manual_seed(1)
        model = Net(made[name], 32, 4)
        expected, _ = gradient(model, x, edges, y, None)
        for config_name in config_names:
            for rules in ("with", "without"):
                with without_gradient_rules() if rules == "without" else contextlib.nullcontext():
                    got, compressor = gradient(model, x, edges, y, act.ACTConfig(**CONFIGS[config_name]))
                finite = bool(got.isfinite().all())
                cosine = nn.functional.cosine_similarity(got, expected, dim=0).item() if finite else float("nan")
                rows.append(dict(layer=name, config=config_name, rules=rules, finite=finite, cosine=cosine,
                                 ratio=compressor.stats().ratio))
                print(f"{name:22s} {config_name:13s} {rules:8s} finite {finite!s:5s} cosine {cosine:.4f} "
                      f"ratio {rows[-1]['ratio']:.2f}", flush=True)
    return rows


def table(rows: list[dict], command: str) -> str:
    lines = ["# torch_geometric layers: gradients with and without the exact-value rules", "",
             f"Command: `{command}`. torch {torch.__version__}; one full-batch step, gradient cosine to the "
             "uncompressed step's (nan: NaN or infinite gradients).", "",
             "| layer | config | rules | finite | gradient cosine | ratio |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layer']} | {r['config']} | {r['rules']} | {'yes' if r['finite'] else '**no**'} | "
                     f"{r['cosine']:.4f} | {r['ratio']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=2000)
    parser.add_argument("--quick", action="store_true", help="300 nodes, 2 layers, 2 configs; no file written")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "gnn_layers.md")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*index_reduce.*")
    if args.quick:
        return run(300, ["SAGEConv max", "GATConv"], ["L1", "division"])
    rows = run(args.nodes, None, list(CONFIGS))
    command = "python benchmarks/bench_gnn_layers.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    args.out.write_text(table(rows, command.strip()))
    print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
