"""Accelerate: compress a prepared model's activations with one call.

Accelerate has no plugin point for this. Either put the context around the forward::

    compressor = act.ActivationCompressor(accelerator.unwrap_model(model), act.ACTConfig(bits=4))
    with accelerator.accumulate(model):
        with compressor.compress():
            loss = model(**batch).loss
        accelerator.backward(loss)

or patch the model's forward once, as Accelerate does for autocast::

    compressor = compress_forward(model, act.ACTConfig(bits=4))   # model as returned by accelerator.prepare
    ...                                                           # training steps: forwards are compressed
    unpatch(model)

The patched forward compresses only when the module is in training mode and grad is enabled, so evaluation
under ``torch.no_grad()`` runs unchanged. It works with mixed precision, gradient accumulation and DDP (the
wrapper calls the patched forward of the module it wraps).
"""
from __future__ import annotations

import functools
import warnings

import torch
from torch import nn

from ..config import ACTConfig
from ..engine import ActivationCompressor, active_compressor

# instance attribute holding the compressor of a patched module; its presence marks the module as patched
_COMPRESSOR_ATTR = "_lightning_act_compressor"
# instance attribute holding the forward that was an instance attribute before patching (Accelerate's autocast)
_ORIGINAL_ATTR = "_lightning_act_original_forward"


def _innermost(model: nn.Module) -> nn.Module:
    """The module inside DDP/FSDP/``torch.compile`` wrappers (what ``accelerator.unwrap_model`` returns)."""
    from accelerate.utils import extract_model_from_parallel

    return extract_model_from_parallel(model, keep_fp32_wrapper=True)


def compress_forward(model: nn.Module, config: ACTConfig | str | dict | ActivationCompressor | None = None
                     ) -> ActivationCompressor:
    """Patch the forward of ``model`` (prepared by Accelerate or not) so that training forwards run inside
    ``compressor.compress()``; returns the compressor (``.stats()`` is the last step's). ``config`` is an
    ``ACTConfig``, a level name, a dict of fields, or a ready ``ActivationCompressor``. Undo with
    :func:`unpatch`."""
    module = _innermost(model)
    if _COMPRESSOR_ATTR in module.__dict__:
        raise ValueError(f"{type(module).__name__} is already patched by compress_forward; call unpatch(model) first")
    compressor = config if isinstance(config, ActivationCompressor) else ActivationCompressor(module, config)
    if compressor.config.memory_budget is not None:
        warnings.warn(
            f"lightning_act: memory_budget={compressor.config.memory_budget} needs a planning step, which "
            "compress_forward does not run; call lightning_act.adapt.memory_budget.MemoryBudget(compressor, "
            "budget).plan(forward_backward_fn) once before training (compressor = compress_forward(...))",
            stacklevel=2)
    if "forward" in module.__dict__:
        setattr(module, _ORIGINAL_ATTR, module.__dict__["forward"])
    inner_forward = module.forward

    @functools.wraps(inner_forward)
    def forward(*args, **kwargs):
        # eval and no-grad forwards save nothing; an enclosing compress() context already compresses
        if not (module.training and torch.is_grad_enabled()) or active_compressor() is not None:
            return inner_forward(*args, **kwargs)
        with compressor.compress():
            return inner_forward(*args, **kwargs)

    module.forward = forward
    setattr(module, _COMPRESSOR_ATTR, compressor)
    return compressor


def unpatch(model: nn.Module) -> ActivationCompressor:
    """Restore the forward :func:`compress_forward` patched; returns the compressor it used."""
    module = _innermost(model)
    compressor = module.__dict__.pop(_COMPRESSOR_ATTR, None)
    if compressor is None:
        raise ValueError(f"{type(module).__name__} is not patched by compress_forward; nothing to unpatch")
    del module.forward
    if _ORIGINAL_ATTR in module.__dict__:
        module.forward = module.__dict__.pop(_ORIGINAL_ATTR)
    return compressor
