"""Adaptive compression: GACT auto-precision (per-tensor sensitivity, greedy bit allocation); per-layer error
bounds from momentum statistics (Jin et al.)."""
from .allocation import CANDIDATE_BITS, allocate_bits, compression_variance, variance_factor
from .error_bound import ErrorBoundController, paper_error_bound
from .sensitivity import GradientVariance, TensorKey, estimate_sensitivities

__all__ = [
    "CANDIDATE_BITS", "ErrorBoundController", "GradientVariance", "TensorKey", "allocate_bits", "compression_variance",
    "estimate_sensitivities", "paper_error_bound", "variance_factor",
]
