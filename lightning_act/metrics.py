"""The names every integration logs: scalars and per-tensor histograms of one compressed step, of auto-precision
and of adapted error bounds.

Framework neutral: the Lightning callbacks (``lightning_act.callbacks``), the HuggingFace and Accelerate
integrations and the recipes log what these functions return, each through its own loggers; ``write_stats``
writes one step's scalars and histograms to a TensorBoard ``SummaryWriter`` (plain loops).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .adapt.allocation import compression_variance
from .stats import COMPRESSED, CompressionStats

if TYPE_CHECKING:
    from .adapt.auto_precision import AutoPrecision

PREFIX = "act/"
ADAPT_PREFIX = PREFIX + "adapt/"
ERROR_BOUND_PREFIX = PREFIX + "error_bound/"


def step_metrics(stats: CompressionStats) -> dict[str, float]:
    """Scalars of one step under ``act/``: ratio, original and stored bytes, average bits, compressed tensors,
    and per codec ``act/codec/<name>/{original_bytes,stored_bytes,ratio}``."""
    values = {
        "compression_ratio": stats.ratio,
        "original_bytes": float(stats.original_bytes),
        "stored_bytes": float(stats.stored_bytes),
        "average_bits": stats.average_bits,
        "compressed_tensors": float(stats.num_compressed),
    }
    for codec, (original, stored) in stats.per_codec().items():
        values[f"codec/{codec}/original_bytes"] = float(original)
        values[f"codec/{codec}/stored_bytes"] = float(stored)
        values[f"codec/{codec}/ratio"] = original / stored if stored else 1.0
    return {PREFIX + k: v for k, v in values.items()}


def tensor_histograms(stats: CompressionStats) -> dict[str, torch.Tensor]:
    """Per compressed tensor: ``act/tensor_bits``, ``act/tensor_ratio`` and, for records that carry one (error-
    bounded codecs), ``act/tensor_error_bound``. Empty series are left out."""
    compressed = [r for r in stats.records if r.kind == COMPRESSED]
    series = {
        "tensor_bits": [r.bits for r in compressed],
        "tensor_ratio": [r.original_bytes / r.stored_bytes for r in compressed if r.stored_bytes],
        "tensor_error_bound": [r.error_bound for r in compressed if r.error_bound is not None],
    }
    return {PREFIX + k: torch.tensor(v, dtype=torch.float64) for k, v in series.items() if v}


def write_stats(writer, stats: CompressionStats, step: int) -> None:
    """Log one step's ``step_metrics`` scalars and ``tensor_histograms`` to a TensorBoard ``SummaryWriter`` (or
    anything with its ``add_scalar`` and ``add_histogram``)."""
    for tag, value in step_metrics(stats).items():
        writer.add_scalar(tag, value, step)
    for tag, values in tensor_histograms(stats).items():
        writer.add_histogram(tag, values, step)


def adapt_metrics(auto: "AutoPrecision") -> dict[str, float]:
    """Scalars of auto-precision under ``act/adapt/``: average bits, rounds, estimated compression variance, the
    last round's passes and seconds, the variance ratio of the failure alert (once known), and per allocated
    tensor ``bits/<index>`` and ``sensitivity/<index>``."""
    values = {"average_bits": auto.average_bits, "rounds": float(auto.rounds),
              "compression_variance": compression_variance(auto.sensitivities, auto.bits)}
    if auto.last_round is not None:
        values.update(passes=float(auto.last_round.passes), seconds=auto.last_round.seconds)
    if auto.variance_ratio is not None:
        values["variance_ratio"] = auto.variance_ratio
    for key, b, c in zip(auto.layout, auto.bits, auto.sensitivities):
        values[f"bits/{key.index:04d}"] = float(b)
        values[f"sensitivity/{key.index:04d}"] = c
    return {ADAPT_PREFIX + k: v for k, v in values.items()}


def adapt_histograms(auto: "AutoPrecision") -> dict[str, torch.Tensor]:
    """Per allocated tensor: ``act/adapt/tensor_bits`` and ``act/adapt/tensor_sensitivity`` (none before the
    first round)."""
    if not auto.bits:
        return {}
    return {ADAPT_PREFIX + "tensor_bits": torch.tensor(auto.bits, dtype=torch.float64),
            ADAPT_PREFIX + "tensor_sensitivity": torch.tensor(auto.sensitivities, dtype=torch.float64)}


def error_bound_metrics(error_bounds: dict[str, float]) -> dict[str, float]:
    """Adapted ``lorenzo`` bounds as ``act/error_bound/<layer>``."""
    return {ERROR_BOUND_PREFIX + name: bound for name, bound in error_bounds.items()}
