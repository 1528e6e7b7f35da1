"""Accelerate: compress a prepared model's activations with one call.

Accelerate has no plugin point for this. Either put the context around the forward (``compressed_module`` picks
the module to compress: see there)::

    compressor = act.ActivationCompressor(compressed_module(model), act.ACTConfig(bits=4))
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

import torch
from torch import nn

from .._validate import check_type
from ..config import ACTConfig
from ..engine import ActivationCompressor, active_compressor
from ..model_prep import compiled_wrapper
from .._warn import warn_user

# instance attribute holding the compressor of a patched module; its presence marks the module as patched (both
# attributes go in the module's own __dict__: a compile wrapper's setattr would pass them to the module it wraps)
_COMPRESSOR_ATTR = "_lightning_act_compressor"
# instance attribute holding the forward that was an instance attribute before patching (Accelerate's autocast)
_ORIGINAL_ATTR = "_lightning_act_original_forward"


def compressed_module(model: nn.Module) -> nn.Module:
    """The module to build the compressor on, and whose forward :func:`compress_forward` patches, for ``model`` as
    ``accelerator.prepare`` returned it: the ``torch.compile`` wrapper where Accelerate compiled the model
    (``dynamo_backend``: the compressor must know that compiled graphs run, and ``compress()`` must open outside
    them), else the module inside the DDP/FSDP wrappers. Nothing is rewired (``accelerator.unwrap_model`` keeping
    the compile wrapper points its ``_orig_mod`` past DDP, at the module inside)."""
    from accelerate.utils import extract_model_from_parallel

    check_type("model", model, nn.Module, "an nn.Module (as accelerator.prepare returned it)")
    compiled = compiled_wrapper(model)  # (not `or`: a module's truth is its len() where it has one)
    return compiled if compiled is not None else extract_model_from_parallel(model, keep_torch_compile=False)


def compress_forward(model: nn.Module, config: ACTConfig | str | dict | ActivationCompressor | None = None
                     ) -> ActivationCompressor:
    """Patch the forward of ``model`` (prepared by Accelerate or not) so that training forwards run inside
    ``compressor.compress()``; returns the compressor (``.stats()`` is the last step's). ``config`` is an
    ``ACTConfig``, a level name, a dict of fields, or a ready ``ActivationCompressor``. Undo with
    :func:`unpatch`."""
    module = compressed_module(model)
    if _COMPRESSOR_ATTR in module.__dict__:
        raise ValueError(f"{type(module).__name__} is already patched by compress_forward; call unpatch(model) first")
    compressor = config if isinstance(config, ActivationCompressor) else ActivationCompressor(module, config)
    if compressor.config.memory_budget is not None:
        warn_user(
            f"lightning_act: memory_budget={compressor.config.memory_budget} needs a planning step, which "
            "compress_forward does not run; call lightning_act.adapt.memory_budget.MemoryBudget(compressor, "
            "budget).plan(forward_backward_fn) once before training (compressor = compress_forward(...))")
    if "forward" in module.__dict__:
        module.__dict__[_ORIGINAL_ATTR] = module.__dict__["forward"]
    inner_forward = module.forward

    @functools.wraps(inner_forward)
    def forward(*args, **kwargs):
        # eval and no-grad forwards save nothing; an enclosing compress() context already compresses
        if not (module.training and torch.is_grad_enabled()) or active_compressor() is not None:
            return inner_forward(*args, **kwargs)
        with compressor.compress():
            return inner_forward(*args, **kwargs)

    module.forward = forward
    module.__dict__[_COMPRESSOR_ATTR] = compressor
    return compressor


def unpatch(model: nn.Module) -> ActivationCompressor:
    """Restore the forward :func:`compress_forward` patched; returns the compressor it used."""
    module = compressed_module(model)
    compressor = module.__dict__.pop(_COMPRESSOR_ATTR, None)
    if compressor is None:
        raise ValueError(f"{type(module).__name__} is not patched by compress_forward; nothing to unpatch")
    del module.forward
    if _ORIGINAL_ATTR in module.__dict__:
        module.forward = module.__dict__.pop(_ORIGINAL_ATTR)
    return compressor
