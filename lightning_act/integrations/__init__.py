"""Integrations with Accelerate, HuggingFace ``transformers`` and PyTorch Geometric.

Importing this package imports none of them: each name below loads its module on first use, and a missing
library raises ``ImportError`` with the install command.

- ``compress_forward(model, config)`` / ``unpatch(model)``: Accelerate (or any loop), patch a model's forward;
  ``compressed_module(model)``: what to build a compressor on for a prepared model (its ``torch.compile`` wrapper
  where Accelerate compiled it, else the module inside DDP/FSDP)
- ``ACTTrainer`` / ``ACTTrainerMixin`` / ``CompressionCallback``: HuggingFace ``Trainer`` with compression;
  ``checkpointing_args(True)``: the ``TrainingArguments`` keyword for HF gradient checkpointing in any version
- ``LayerStats``: per-layer statistics (GNN layers by default) by module hooks
- ``fuse_gcn(model)`` / ``unfuse_gcn(model)``: swap GCNConv (and ReLU+dropout) layers for ones whose backward
  holds two node-sized tensors (``lightning_act.nn.SparseGCNConv``, ``ReLUDropout``)
"""
from __future__ import annotations

import importlib
import importlib.util
from typing import Any

_EXPORTS = {
    "compress_forward": "accelerate", "unpatch": "accelerate", "compressed_module": "accelerate",
    "ACTTrainer": "transformers", "ACTTrainerMixin": "transformers", "CompressionCallback": "transformers",
    "checkpointing_args": "transformers",
    "LayerStats": "pyg", "fuse_gcn": "pyg", "unfuse_gcn": "pyg",
}
# module -> (library it needs, extra that installs it)
_REQUIREMENTS = {"accelerate": ("accelerate", "hf"), "transformers": ("transformers", "hf"),
                 "pyg": ("torch_geometric", "gnn")}

__all__ = sorted(_EXPORTS)


def require(module: str) -> None:
    """Raise ``ImportError`` with the install command when the library behind ``module`` is missing."""
    library, extra = _REQUIREMENTS[module]
    if importlib.util.find_spec(library) is None:
        raise ImportError(f"lightning_act.integrations.{module} needs {library}; "
                          f"install it with: pip install 'lightning-act[{extra}]'")


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}; available: {', '.join(__all__)}")
    module = _EXPORTS[name]
    require(module)
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
