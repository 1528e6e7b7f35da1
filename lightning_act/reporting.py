"""Baseline-vs-compressed reporting, as the recipes and benchmarks print it: one ``RunResult`` per training run
(accuracy, per-step wall times, the compressed run's statistics), step timing (``StepClock`` around any step,
``StepTimer`` for Lightning's training batches), ``summary_table``, the Markdown table that compares two runs, and
``training_device`` for the recipes' ``--device`` option."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import lightning as L
import torch

from .stats import CompressionStats


@dataclass
class RunResult:
    """One training run: final accuracy, per-step wall times, and (compressed runs) the last step's stats."""

    accuracy: float
    step_seconds: list[float] = field(default_factory=list)
    stats: CompressionStats | None = None

    @property
    def median_step(self) -> float:
        # the first steps pay for warm-up (allocator, lazy init); skip them when there are enough
        times = self.step_seconds[3:] if len(self.step_seconds) > 6 else self.step_seconds
        return statistics.median(times) if times else float("nan")


DEVICES = ("auto", "cpu", "cuda")


def training_device(choice: str) -> torch.device:
    """The device a recipe trains on for its ``--device`` option: ``auto`` is the GPU where CUDA is available."""
    if choice not in DEVICES:
        raise ValueError(f"device={choice!r}; expected one of {', '.join(DEVICES)}")
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device='cuda', but this torch ({torch.__version__}) sees no CUDA device; use --device cpu")
    return torch.device(choice)


def _synchronize() -> None:
    """Wait for the work queued on the GPU, if any: a GPU step's wall time is its kernels', not their launches'."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class StepClock:
    """``with clock: step()`` (or ``clock.start()`` ... ``clock.stop()``) appends the step's wall time to
    ``clock.times`` (on a GPU, from the end of the work queued before it to the end of its own)."""

    def __init__(self):
        self.times: list[float] = []

    def start(self) -> None:
        _synchronize()
        self._start = time.perf_counter()

    def stop(self) -> None:
        _synchronize()
        self.times.append(time.perf_counter() - self._start)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()


class StepTimer(StepClock, L.Callback):
    """Lightning callback: the wall time of each training batch (forward, backward, optimizer step) in ``times``."""

    def on_train_batch_start(self, *args):
        self.start()

    def on_train_batch_end(self, *args):
        self.stop()


def summary_table(title: str, baseline: RunResult, compressed: RunResult) -> str:
    """Markdown table: accuracy, activation bytes per step, ratio, median step time and time ratio."""
    stats = compressed.stats or CompressionStats()
    rows = [
        ("accuracy", f"{baseline.accuracy:.4f}", f"{compressed.accuracy:.4f}"),
        ("saved activation bytes per step", f"{stats.original_bytes:,}", f"{stats.original_bytes:,}"),
        ("stored activation bytes per step", f"{stats.original_bytes:,}", f"{stats.stored_bytes:,}"),
        ("compression ratio", "1.00x", f"{stats.ratio:.2f}x"),
        ("median step time", f"{baseline.median_step * 1e3:.1f} ms", f"{compressed.median_step * 1e3:.1f} ms"),
        ("step time ratio (compressed / baseline)", "1.00", f"{compressed.median_step / baseline.median_step:.2f}"),
    ]
    width = max(len(name) for name, _, _ in rows)
    lines = [f"\n{title}\n", f"| {'':{width}} | {'baseline':>16} | {'compressed':>16} |",
             f"|{'-' * (width + 2)}|{'-' * 18}|{'-' * 18}|"]
    lines += [f"| {name:{width}} | {a:>16} | {b:>16} |" for name, a, b in rows]
    lines.append(f"\n{stats.summary()}")
    return "\n".join(lines)
