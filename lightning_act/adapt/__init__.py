"""Adaptive compression, framework neutral: GACT auto-precision (:class:`AutoPrecision`: per-tensor sensitivity,
greedy bit allocation); per-layer error bounds from momentum statistics (:class:`ErrorBoundController`, Jin et al.).
The Lightning callbacks in ``lightning_act.callbacks`` and the HuggingFace trainer run these."""
from .allocation import CANDIDATE_BITS, allocate_bits, compression_variance, variance_factor
from .auto_precision import AutoPrecision
from .error_bound import ErrorBoundController, paper_error_bound
from .sensitivity import GradientVariance, TensorKey, estimate_sensitivities

__all__ = [
    "CANDIDATE_BITS", "AutoPrecision", "ErrorBoundController", "GradientVariance", "TensorKey", "allocate_bits",
    "compression_variance", "estimate_sensitivities", "paper_error_bound", "variance_factor",
]
