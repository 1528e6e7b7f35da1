"""DIVISION codec and lossless masks: compression ratios, mask savings and accuracy, in one run.

1. Ratio of the saved activations of a ResNet-50 (built here, random weights, 224 x 224, batch 2) with
   ``division`` (B=8, Q=2) against ``quantize`` at 2 and 4 bits (masks on in all three), from ``stats()``;
   DIVISION's appendix G estimates >= 10.35x.
2. Activation bytes of a ReLU CNN (conv, ReLU, max-pool, dropout) with lossless masks off and on, the
   values kept exact (``quantize`` at 32 bits), and whether the gradients are bit-identical.
3. Test accuracy of a CNN trained on scikit-learn digits without compression and with ``division``, same
   seed, same epochs.

    python benchmarks/bench_division.py [--epochs 10] [--out benchmarks/results/division.md]
"""
from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch
from torch import nn

import lightning_act as act
from lightning_act.datasets import digits_tensors
from lightning_act.models import resnet50


def train_step(model: nn.Module, x: torch.Tensor, config: act.ACTConfig):
    """``(stats, parameter gradients)`` of one forward + backward of ``model`` on ``x`` under ``config``."""
    compressor = act.ActivationCompressor(model, config)
    with compressor.compress():
        loss = model(x).square().mean()
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return compressor.stats(), grads


def resnet50_ratios() -> list[tuple[str, str]]:
    torch.manual_seed(0)
    model = resnet50()
    x = torch.randn(2, 3, 224, 224)
    rows = []
    for label, config in (("division (B=8, Q=2)", act.ACTConfig(codec="division")),
                          ("quantize 2 bit", act.ACTConfig(codec="quantize", bits=2)),
                          ("quantize 4 bit", act.ACTConfig(codec="quantize", bits=4))):
        compressor = act.ActivationCompressor(model, config)
        start = time.perf_counter()
        with compressor.compress():  # the forward is what is measured: no backward needed
            model(x)
        seconds = time.perf_counter() - start
        stats = compressor.stats()
        own = stats.per_codec()[config.codec]
        rows.append((f"ResNet-50 ratio, {label}",
                     f"{stats.ratio:.2f}x overall ({own[0] / own[1]:.2f}x on the {config.codec} tensors), "
                     f"{stats.original_bytes / 2**20:.0f} -> {stats.stored_bytes / 2**20:.1f} MiB, forward {seconds:.0f} s"))
    return rows


def relu_cnn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2, 1),
        nn.Flatten(), nn.Dropout(0.5), nn.Linear(64 * 8 * 8, 128), nn.ReLU(), nn.Dropout(0.5), nn.Linear(128, 10))


def mask_savings() -> list[tuple[str, str]]:
    x = torch.randn(32, 3, 32, 32)
    results = {}
    for masks in (False, True):  # values kept exact (32 bits): only the masks differ
        model = relu_cnn()
        torch.manual_seed(1)  # same dropout draws
        results[masks] = train_step(model, x, act.ACTConfig(codec="quantize", bits=32, compress_masks=masks))
    model = relu_cnn()
    torch.manual_seed(1)
    model(x).square().mean().backward()
    exact = [p.grad for p in model.parameters()]
    identical = all(all(torch.equal(a, b) for a, b in zip(exact, grads)) for _, grads in results.values())
    off, on = results[False][0], results[True][0]
    return [("ReLU CNN saved bytes, masks off -> on (values kept exact)",
             f"{off.stored_bytes / 2**20:.2f} -> {on.stored_bytes / 2**20:.2f} MiB "
             f"({off.stored_bytes / on.stored_bytes:.2f}x less); gradients bit-identical to plain: {identical}")]


def digits_accuracy(epochs: int) -> list[tuple[str, str]]:
    from sklearn.model_selection import train_test_split

    images, labels = digits_tensors()
    x_train, x_test, y_train, y_test = train_test_split(images, labels, test_size=0.3, random_state=0)
    accuracies = {}
    for label, config in (("plain", None), ("division", act.ACTConfig(codec="division"))):
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(32 * 4 * 4, 10))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        compressor = act.ActivationCompressor(model, config) if config is not None else None
        generator = torch.Generator().manual_seed(0)
        for _ in range(epochs):
            model.train()
            for batch in torch.randperm(len(x_train), generator=generator).split(64):
                with compressor.compress() if compressor is not None else torch.enable_grad():
                    loss = nn.functional.cross_entropy(model(x_train[batch]), y_train[batch])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        model.eval()
        with torch.no_grad():
            accuracies[label] = (model(x_test).argmax(1) == y_test).float().mean().item() * 100
    delta = accuracies["division"] - accuracies["plain"]
    return [(f"digits CNN test accuracy, {epochs} epochs, seed 0",
             f"plain {accuracies['plain']:.2f}%, division {accuracies['division']:.2f}% ({delta:+.2f} points)")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--out", type=Path, help="write the markdown table here")
    args = parser.parse_args()
    lines = [f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
             f"{torch.get_num_threads()} threads", "", "| measurement | result |", "|---|---|"]
    print("\n".join(lines), flush=True)
    for measure in (resnet50_ratios, mask_savings, lambda: digits_accuracy(args.epochs)):
        for name, value in measure():
            lines.append(f"| {name} | {value} |")
            print(lines[-1], flush=True)
    table = "\n".join(lines)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
