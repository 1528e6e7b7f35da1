"""Demo: train a small CNN on scikit-learn's digits on CPU, plain and with ``Trainer(strategy="act")``.

Same seed, same data, same epochs; prints saved-activation bytes, compressed bytes, ratio, step-time ratio and
the final validation accuracy of both runs.

    python recipes/demo_digits.py [--epochs 8] [--bits 4] [--batch-size 64]
"""
from __future__ import annotations

import argparse
import statistics

import lightning as L
import torch

import lightning_act as act
from lightning_act.codecs.quantize import ALLOWED_BITS
from lightning_act.datasets import digits_loaders
from lightning_act.models import DigitsCNN
from lightning_act.reporting import StepTimer


def run(strategy, epochs: int, batch_size: int, seed: int = 0):
    torch.manual_seed(seed)
    model = DigitsCNN()
    timer = StepTimer()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", max_epochs=epochs, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[timer])
    train, val = digits_loaders(batch_size, seed)
    trainer.fit(model, train, val)
    return model.val_correct / model.val_total, statistics.median(timer.times[5:] or timer.times), trainer


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--bits", type=int, default=4, choices=ALLOWED_BITS,
                        help="average bits per quantized activation element (L1 auto-precision budget)")
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))

    base_acc, base_step, _ = run("auto", args.epochs, args.batch_size)
    act_acc, act_step, trainer = run(act.ACTStrategy(act.ACTConfig(bits=args.bits)), args.epochs, args.batch_size)
    stats = trainer.strategy.compressor.stats()
    rows = [
        ("saved activation bytes per step", f"{stats.original_bytes:,}", f"{stats.original_bytes:,}"),
        ("stored activation bytes per step", f"{stats.original_bytes:,}", f"{stats.stored_bytes:,}"),
        ("compression ratio", "1.00x", f"{stats.ratio:.2f}x"),
        ("median step time", f"{base_step * 1e3:.1f} ms", f"{act_step * 1e3:.1f} ms"),
        ("step time ratio (act / plain)", "1.00", f"{act_step / base_step:.2f}"),
        ("final validation accuracy", f"{base_acc:.4f}", f"{act_acc:.4f}"),
    ]
    print(f"\nDigits CNN, {args.epochs} epochs, batch {args.batch_size}, level L1: quantized activations at {args.bits} bits on average (auto-precision)\n")
    print(f"| {'':34} | {'plain':>16} | {'strategy=act':>16} |")
    print(f"|{'-' * 36}|{'-' * 18}|{'-' * 18}|")
    for name, a, b in rows:
        print(f"| {name:34} | {a:>16} | {b:>16} |")
    print(f"\n{stats.summary()}")


if __name__ == "__main__":
    main()
