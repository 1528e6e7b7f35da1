"""Adaptive compression: GACT auto-precision (per-tensor sensitivity, greedy bit allocation)."""
from .allocation import CANDIDATE_BITS, allocate_bits, compression_variance, variance_factor
from .sensitivity import GradientVariance, TensorKey, estimate_sensitivities

__all__ = [
    "CANDIDATE_BITS", "GradientVariance", "TensorKey", "allocate_bits", "compression_variance",
    "estimate_sensitivities", "variance_factor",
]
