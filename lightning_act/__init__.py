"""lightning_act: activation-compressed training for PyTorch Lightning, Accelerate and HuggingFace.

``Trainer(strategy="act")`` compresses every tensor autograd saves for backward; ``ActivationCompressor``
does the same around any forward pass.
"""
from __future__ import annotations

from . import adapt, callbacks, codecs, metrics, model_prep, nn  # model_prep registers BLPA, HF checkpointing, CB2 attention
from .config import LEVELS, ACTConfig, resolve_config
from .engine import ActivationCompressor
from .stats import CompressionStats, TensorRecord
from .strategies import ACTDDPStrategy, ACTFSDPStrategy, ACTStrategy

__version__ = "0.1.0"

__all__ = [
    "ACTConfig", "ACTDDPStrategy", "ACTFSDPStrategy", "ACTStrategy", "ActivationCompressor", "CompressionStats",
    "LEVELS", "TensorRecord", "adapt", "callbacks", "codecs", "metrics", "nn", "resolve_config",
]
