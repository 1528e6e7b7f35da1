"""Demo: train a small CNN on scikit-learn's digits on CPU, plain and with ``Trainer(strategy="act")``.

Same seed, same data, same epochs; prints saved-activation bytes, compressed bytes, ratio, step-time ratio and
the final validation accuracy of both runs.

    python recipes/demo_digits.py [--epochs 8] [--bits 4] [--batch-size 64]
"""
from __future__ import annotations

import argparse
import statistics
import time

import lightning as L
import torch
from torch import nn

import lightning_act as act


class ImageClassifierBase(L.LightningModule):
    """Cross-entropy training of ``self.net``; validation counts correct predictions (``val_correct/val_total``)."""

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
    def __init__(self, lr: float = 2e-3):
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Dropout(0.2), nn.Linear(64 * 16, 10))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class StepTimer(L.Callback):
    """Wall time of each training batch (forward, backward, optimizer step)."""

    def __init__(self):
        self.times: list[float] = []

    def on_train_batch_start(self, *args):
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, *args):
        self.times.append(time.perf_counter() - self._t0)


def digits_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's 1,797 digits as (N, 1, 8, 8) float images in [0, 1] and their labels."""
    from sklearn.datasets import load_digits

    data = load_digits()
    return torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0, torch.tensor(data.target)


def split_loaders(x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int = 0, train_fraction: float = 0.8):
    """Seeded random train/validation split of a tensor dataset, as (shuffled train, ordered val) loaders."""
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    split = int(train_fraction * len(y))
    train, val = order[:split], order[split:]
    make = lambda idx, shuffle: torch.utils.data.DataLoader(  # noqa: E731
        torch.utils.data.TensorDataset(x[idx], y[idx]), batch_size=batch_size, shuffle=shuffle,
        generator=torch.Generator().manual_seed(seed))
    return make(train, True), make(val, False)


def digits_loaders(batch_size: int, seed: int = 0):
    return split_loaders(*digits_tensors(), batch_size, seed)


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
    parser.add_argument("--bits", type=int, default=4, help="average bits per quantized activation element (L1 auto-precision budget: 1, 2, 4, 8)")
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
