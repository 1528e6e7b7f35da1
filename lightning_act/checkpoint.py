"""Gradient checkpointing that compresses what it keeps (GACT's CB1).

``checkpoint(fn, *args)`` runs ``fn`` without keeping its activations; it saves only the segment inputs,
through ``ctx.save_for_backward``, so the active compressor compresses them. In backward it recomputes the
segment from the decompressed inputs under the compressor's :meth:`~ActivationCompressor.recompute` hooks, so
the tensors saved during the recomputation are compressed as well, then backpropagates through it.

PyTorch's non-reentrant checkpoint cannot do this: its own saved-tensor hooks are the innermost pair during
the forward and the recomputation, so a compressor's hooks never see those tensors. HuggingFace models get
this checkpoint through :func:`use_compressed_checkpointing` (their ``_set_gradient_checkpointing`` API).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch
import torch.utils.checkpoint
from torch import nn

from . import module_tree, optrack
from .codecs import op_rules
from .engine import ActivationCompressor, active_compressor


def checkpoint(function: Callable, *args: Any, compressor: ActivationCompressor | None = None,
               preserve_rng_state: bool = True, **kwargs: Any) -> Any:
    """Run ``function(*args, **kwargs)`` and recompute it in backward, compressing inputs and recomputed
    tensors with ``compressor`` (default: the one whose ``compress()`` is active; without one, a plain
    recomputing checkpoint). Tensor arguments are saved and compressed (float ones without a gradient, such as
    attention masks, on quantize's grid with their -inf kept); keyword arguments are kept as they are."""
    compressor = compressor if compressor is not None else active_compressor()
    run = functools.partial(function, **kwargs) if kwargs else function
    # an empty leaf that requires grad keeps the segment in the graph when no input requires grad
    anchor = torch.empty(0, requires_grad=True)
    with optrack.reported_call(checkpoint, args, kwargs):  # the inputs' op rule: _segment_input_rule
        return _CompressedCheckpoint.apply(run, compressor, preserve_rng_state, anchor, *args)


# A segment's float inputs without a gradient are the data and what a model hands every layer: an additive attention
# mask (0 and the dtype's most negative value, or -inf) or position tables. DIVISION's block means overflow on
# finfo.min and quantize's groups holding -inf decode to NaN: GPT-2's blocks at CB2 under division, and a block
# checkpointed by torch with a -inf mask at the default L1, trained on NaN gradients. They go on quantize's grid
# (whose group ends are exact: a mask's 0 and finfo.min come back as they were) with their -inf masked at 1 bit.
_SEGMENT_INPUT = op_rules.MinimumBits(0, in_range=True, infinities=True)


def _segment_input_rule(t: torch.Tensor, call: optrack.FunctionCall) -> op_rules.MinimumBits | None:
    return _SEGMENT_INPUT if t.is_floating_point() and not t.requires_grad else None


# PyTorch's checkpoint saves its positional inputs through the compressor in these: the non-reentrant one in its
# frame's method, the reentrant one (torch 2.13's default, HuggingFace's) once its Function's forward has returned,
# inside the ``apply`` it inherits (held here as one bound method: the tracker sets its wrapper on that class)
_TORCH_SAVE_INPUTS = tuple(fn for fn in (
    getattr(getattr(torch.utils.checkpoint, "_CheckpointFrame", None), "save_inputs", None),
    getattr(getattr(torch.utils.checkpoint, "CheckpointFunction", None), "apply", None)) if fn is not None)
op_rules.register_op_rule((checkpoint, *_TORCH_SAVE_INPUTS), _segment_input_rule, gradient=True)


class _CompressedCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, compressor, preserve_rng_state, anchor, *args):
        ctx.run, ctx.compressor = run, compressor
        ctx.step = compressor.current_step if compressor is not None else None
        ctx.autocast = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")]
        ctx.rng = _capture_rng(args) if preserve_rng_state else None
        ctx.tensor_positions = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.args = [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in ctx.tensor_positions))
        with torch.no_grad():
            return run(*args)

    @staticmethod
    def backward(ctx, *grads):
        args = list(ctx.args)
        inputs = []
        for position, saved in zip(ctx.tensor_positions, ctx.saved_tensors):
            args[position] = saved.detach().requires_grad_(ctx.needs_input_grad[4 + position])
            inputs.append(args[position])
        with _restored_rng(ctx.rng), _autocast(ctx.autocast), torch.enable_grad():
            recompute = ctx.compressor.recompute(ctx.step) if ctx.step is not None else contextlib.nullcontext()
            with recompute:
                outputs = ctx.run(*args)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if torch.is_tensor(o) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = iter(x.grad if x.requires_grad else None for x in inputs)
        grads_by_position = {p: next(input_grads) for p in ctx.tensor_positions}
        return (None, None, None, None) + tuple(grads_by_position.get(i) for i in range(len(args)))


def _capture_rng(args) -> dict:
    state = {"cpu": torch.get_rng_state()}
    cuda_devices = sorted({a.device.index for a in args if torch.is_tensor(a) and a.is_cuda})
    if cuda_devices:
        state["cuda"] = (cuda_devices, [torch.cuda.get_rng_state(d) for d in cuda_devices])
    return state


@contextlib.contextmanager
def _restored_rng(state: dict | None) -> Iterator[None]:
    """Recompute with the forward's RNG state (same dropout masks), leaving the caller's RNG untouched."""
    if state is None:
        yield
        return
    devices = state["cuda"][0] if "cuda" in state else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(state["cpu"])
        for device, cuda_state in zip(devices, state.get("cuda", ([], []))[1]):
            torch.cuda.set_rng_state(cuda_state, device)
        yield


@contextlib.contextmanager
def _autocast(states) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for device, enabled, dtype in states:
            if enabled:
                stack.enter_context(torch.autocast(device, dtype=dtype))
        yield


def _checkpointing_layer(module: nn.Module) -> bool:
    """Whether ``module`` has a bool ``gradient_checkpointing`` attribute, its own or its class's (HuggingFace's
    checkpointable layers): read without ``nn.Module.__getattr__``, whose miss raises, as every forward asks it of
    every module."""
    flag = module.__dict__.get("gradient_checkpointing")
    if flag is None:
        flag = getattr(type(module), "gradient_checkpointing", None)
    return isinstance(flag, bool)


@contextlib.contextmanager
def use_compressed_checkpointing(model: nn.Module, compressor: ActivationCompressor,
                                 enable: bool = False) -> Iterator[int]:
    """Route a HuggingFace model's gradient checkpointing through :func:`checkpoint` for the duration.

    Layers whose checkpointing the user turned on (``model.gradient_checkpointing_enable()``) use the
    compressed checkpoint instead of PyTorch's; with ``enable=True`` every checkpointable layer is
    checkpointed (CB1). Yields the number of layers routed; restores every layer's attributes on exit.
    """
    # the modules HuggingFace's own _set_gradient_checkpointing configures
    layers = [m for m in module_tree.modules(model) if _checkpointing_layer(m)]
    saved = [(m, m.gradient_checkpointing, m.__dict__.get("_gradient_checkpointing_func")) for m in layers]
    routed = 0
    try:
        for m in layers:
            if enable:
                m.gradient_checkpointing = True
            if m.gradient_checkpointing:
                m._gradient_checkpointing_func = functools.partial(checkpoint, compressor=compressor)
                routed += 1
        yield routed
    finally:
        for m, flag, func in saved:
            m.gradient_checkpointing = flag
            if func is None:
                m.__dict__.pop("_gradient_checkpointing_func", None)
            else:
                m._gradient_checkpointing_func = func
