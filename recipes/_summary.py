"""What the recipes share: step timing, TensorBoard writing of one step's statistics, and the
baseline-vs-compressed summary table."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from lightning_act import CompressionStats
from lightning_act.metrics import step_metrics, tensor_histograms


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


class StepClock:
    """``with clock: step()`` appends the step's wall time to ``clock.times``."""

    def __init__(self):
        self.times: list[float] = []

    def __enter__(self):
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.times.append(time.perf_counter() - self._start)


def write_stats(writer, stats: CompressionStats, step: int) -> None:
    """Log one step's ``act/`` scalars and per-tensor histograms to a TensorBoard ``SummaryWriter``."""
    for tag, value in step_metrics(stats).items():
        writer.add_scalar(tag, value, step)
    for tag, values in tensor_histograms(stats).items():
        writer.add_histogram(tag, values, step)


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
