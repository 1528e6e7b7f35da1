"""Lorenzo codec on real saved activations, next to per-group quantization, and the adaptive error bound.

Ratios: the float tensors autograd saves in one training step of a ReLU CNN on scikit-learn digits and of a
BERT built from a small config (random init, random tokens), each compressed on its own; bounds relative to
each tensor's value range (SZ's ``rel`` mode: eb = rel * (max - min)). Accuracy: the digits CNN trained with
plain SGD + momentum vs. with ``ErrorBoundController`` (eq. 8-9 bounds, lorenzo codec on every saved tensor).

    python benchmarks/bench_lorenzo.py --out benchmarks/results/lorenzo.md
"""
from __future__ import annotations

import argparse
import contextlib
import time

import torch
from torch import nn

import lightning_act as act
from lightning_act.adapt.error_bound import ErrorBoundController
from lightning_act.datasets import digits_tensors

RELATIVE_BOUNDS = (1e-2, 1e-3, 1e-4)
QUANTIZE_BITS = (2, 4)


def digits(seed: int = 0):
    x, y = digits_tensors()
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    return x[perm[:1400]], y[perm[:1400]], x[perm[1400:]], y[perm[1400:]]


def digits_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 16, 64), nn.ReLU(), nn.Linear(64, 10))


def saved_activations(model: nn.Module, loss_fn) -> list[torch.Tensor]:
    """Float tensors of at least 1024 elements that autograd saves in one forward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, torch.Tensor] = {}

    def pack(t):
        if t.is_floating_point() and t.numel() >= 1024 and t.untyped_storage().data_ptr() not in params:
            saved.setdefault(t.untyped_storage().data_ptr(), t.detach().contiguous())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_fn(model)
    return list(saved.values())


def cnn_activations() -> list[torch.Tensor]:
    xtr, ytr, _, _ = digits()
    model = digits_cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for i in range(0, 640, 64):  # a few steps so the activations are those of a model that trains
        nn.functional.cross_entropy(model(xtr[i:i + 64]), ytr[i:i + 64]).backward()
        optimizer.step()
        optimizer.zero_grad()
    return saved_activations(model, lambda m: nn.functional.cross_entropy(m(xtr[:128]), ytr[:128]))


def bert_activations() -> list[torch.Tensor]:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=512, max_position_embeddings=128)
    model = BertForSequenceClassification(config).train()
    ids = torch.randint(0, 1000, (8, 64))
    labels = torch.randint(0, 2, (8,))
    return saved_activations(model, lambda m: m(input_ids=ids, labels=labels).loss)


def ratio_row(name: str, tensors: list[torch.Tensor]) -> list[str]:
    original = sum(t.numel() * t.element_size() for t in tensors)
    cells = [name, f"{len(tensors)}", f"{original / 2**20:.2f}"]
    for rel in RELATIVE_BOUNDS:
        stored, worst = 0, 0.0
        for t in tensors:
            span = float(t.max() - t.min())
            bound = rel * span if span > 0 else rel
            codec = act.codecs.get("lorenzo", error_bound=bound)
            packed = codec.encode(t)
            stored += packed.nbytes
            worst = max(worst, float((codec.decode(packed).double() - t.double()).abs().max()) / bound)
        if worst > 1:
            raise AssertionError(f"{name}: error {worst:.3f} x the bound at rel={rel}")
        cells.append(f"{original / stored:.1f}")
    for bits in QUANTIZE_BITS:
        codec = act.codecs.get("quantize", bits=bits)
        cells.append(f"{original / sum(codec.encode(t).nbytes for t in tensors):.1f}")
    return cells


def train_digits(adaptive: bool, epochs: int, interval: int) -> tuple[float, float, dict[str, float]]:
    """Test accuracy, mean compression ratio and the last bounds of the digits CNN."""
    xtr, ytr, xte, yte = digits()
    model = digits_cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    compressor = act.ActivationCompressor(model, act.ACTConfig(min_numel=0) if adaptive else "L0")
    controller = ErrorBoundController(compressor, optimizer, interval=interval)
    ratios = []
    with controller if adaptive else contextlib.nullcontext():
        for epoch in range(epochs):
            perm = torch.randperm(len(ytr), generator=torch.Generator().manual_seed(epoch))
            for i in range(0, len(ytr), 64):
                batch = perm[i:i + 64]
                with compressor.compress():
                    loss = nn.functional.cross_entropy(model(xtr[batch]), ytr[batch])
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                if adaptive:
                    controller.step()
                    ratios.append(compressor.stats().ratio)
    with torch.no_grad():
        accuracy = (model(xte).argmax(1) == yte).float().mean().item()
    return accuracy, sum(ratios) / len(ratios) if ratios else 1.0, dict(controller.error_bounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the markdown table here")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--interval", type=int, default=10, help="steps between error-bound refreshes")
    args = parser.parse_args()
    torch.set_num_threads(2)
    start = time.time()

    lines = ["## Lorenzo codec on saved activations (one training step; ratio = original / stored bytes)", "",
             "| model | tensors | MiB | " + " | ".join(f"lorenzo rel {r:g}" for r in RELATIVE_BOUNDS) + " | "
             + " | ".join(f"quantize {b}-bit" for b in QUANTIZE_BITS) + " |",
             "|---" * (3 + len(RELATIVE_BOUNDS) + len(QUANTIZE_BITS)) + "|"]
    for name, collect in (("ReLU CNN, sklearn digits", cnn_activations),
                          ("BERT (2x128, from config)", bert_activations)):
        lines.append("| " + " | ".join(ratio_row(name, collect())) + " |")

    base_acc, _, _ = train_digits(False, args.epochs, args.interval)
    acc, ratio, bounds = train_digits(True, args.epochs, args.interval)
    lines += ["", f"## Adaptive error bound (eq. 8-9), digits CNN, {args.epochs} epochs, refresh every "
              f"{args.interval} steps", "",
              "| run | test accuracy | mean ratio |", "|---|---|---|",
              f"| baseline (no compression) | {100 * base_acc:.2f}% | 1.0 |",
              f"| ErrorBoundController + lorenzo | {100 * acc:.2f}% | {ratio:.1f} |", "",
              "Last bounds per layer: " + ", ".join(f"`{k}` {v:.2e}" for k, v in bounds.items()), "",
              f"_{time.time() - start:.0f} s on {torch.get_num_threads()} CPU threads, torch {torch.__version__}_"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
