"""What a compressor does to its model besides the saved-tensor hooks, registered with the engine
(:func:`lightning_act.engine.register_model_preparation`) so that the engine imports none of it:

* BLPA: ``ACTConfig(blpa_bits=4|8)`` converts BatchNorm -> ReLU -> Conv/Linear runs into BLPA blocks once, when
  the compressor is built (``compressor.blpa_blocks`` says how many);
* bounded CNN backwards: ``ACTConfig(bounded_cnn=True)`` converts Conv2d -> BatchNorm2d (-> ReLU) runs and
  residual merges (:func:`lightning_act.nn.convert_bounded_cnn`) for the duration of each forward;
* bounded FFN backwards: ``ACTConfig(bounded_ffn=True)`` converts Linear -> activation pairs
  (:func:`lightning_act.nn.convert_bounded_ffn`) for the duration of each forward;
* ``torch.compile``: a model with compiled parts gets hooks that compiled graphs inline
  (:mod:`lightning_act.compiled_regions`);
* HuggingFace checkpointing: during each forward, layers that checkpoint go through the compressed checkpoint
  (all checkpointable layers at CB1/CB2), with a warning when the level asks for checkpointing and the model
  has no such layer;
* CB2: chunked self-attention in HuggingFace models during each forward;
* FSDP2: the all-gathered weights count as parameters (``lightning_act.fsdp``).
"""
from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Iterator

import torch

from .checkpoint import use_compressed_checkpointing
from .engine import ActivationCompressor, register_model_preparation
from .fsdp import FSDPParameters
from .nn.attention import use_chunked_attention
from .nn.blpa import convert_bn_relu
from .nn.bounded_cnn import convert_bounded_cnn, is_bounded, unconvert_bounded_cnn
from .nn.bounded_ffn import convert_bounded_ffn, is_bounded_ffn, unconvert_bounded_ffn
from ._warn import warn_user


class BLPAConversion:
    """BLPA blocks replace the model's BatchNorm -> ReLU -> Conv/Linear runs (``ACTConfig.blpa_bits``)."""

    def prepare(self, compressor: ActivationCompressor) -> None:
        if compressor.model is not None and compressor.config.blpa_bits is not None:
            compressor.blpa_blocks = convert_bn_relu(compressor.model, compressor.config.blpa_bits)

    def forward_context(self, compressor: ActivationCompressor) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


class BoundedConversion:
    """A bounded-backward conversion applied during each forward when its config flag is on
    (``ACTConfig.bounded_cnn``, ``ACTConfig.bounded_ffn``); a model the user converted stays as it is."""

    def __init__(self, flag: str, convert, is_converted, unconvert) -> None:
        self.flag, self.convert, self.is_converted, self.unconvert = flag, convert, is_converted, unconvert

    def prepare(self, compressor: ActivationCompressor) -> None:
        pass

    @contextlib.contextmanager
    def forward_context(self, compressor: ActivationCompressor) -> Iterator[None]:
        model = compressor.model
        if model is None or not getattr(compressor.config, self.flag) or self.is_converted(model):
            yield
            return
        self.convert(model)
        try:
            yield
        finally:  # the graph built meanwhile keeps its bounded nodes; the model is the user's again
            self.unconvert(model)


def has_compiled_parts(model: torch.nn.Module) -> bool:
    """Whether ``model`` is ``torch.compile``'d, or holds a module that is: ``torch.compile(module)``,
    ``module.compile()``, or a LightningModule Lightning compiled in place (``from_compiled``)."""
    optimized = getattr(torch._dynamo, "OptimizedModule", ())
    return any(isinstance(m, optimized) or getattr(m, "_compiled_call_impl", None) is not None
               or getattr(m, "_compiler_ctx", None) is not None for m in model.modules())


def compiled_wrapper(model: torch.nn.Module) -> torch.nn.Module | None:
    """The outermost ``torch.compile`` wrapper (``OptimizedModule``) among ``model`` and the modules its data-parallel
    wrappers (DDP, ``DataParallel``, FSDP1) hold, or None. What a trainer calls when it compiled the model from
    outside (``TrainingArguments(torch_compile=True)``, Accelerate's ``dynamo_backend``): the module it wraps does
    not know, so a compressor built on that module would not compress inside the compiled graphs."""
    optimized = getattr(torch._dynamo, "OptimizedModule", ())
    parallel = _data_parallel_wrappers()
    while not isinstance(model, optimized):
        if not isinstance(model, parallel):
            return None
        model = model.module
    return model


@functools.cache
def _data_parallel_wrappers() -> tuple[type, ...]:
    """The wrapper classes that hold the module they run as ``.module`` (found once: a trainer asks every step)."""
    wrappers = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    if torch.distributed.is_available():
        from torch.distributed.fsdp import FullyShardedDataParallel

        wrappers += (FullyShardedDataParallel,)
    return wrappers


class CompiledRegions:
    """A model with compiled parts gets the hooks compiled graphs inline (:mod:`lightning_act.compiled_regions`),
    or a warning where its saved tensors cannot be compressed inside them."""

    def prepare(self, compressor: ActivationCompressor) -> None:
        model, config = compressor.model, compressor.config
        if model is None or not config.enabled or not has_compiled_parts(model):
            return
        from . import compiled_regions

        if not compiled_regions.supported():
            warn_user(
                f"lightning_act: the model has torch.compile'd parts; torch {torch.__version__} runs saved-tensor "
                f"hooks after a compiled forward, so activations inside compiled regions are not compressed "
                f"(pytorch#148222; torch 2.8 and later inline them). Compress an uncompiled model to save memory.")
            return
        if not compiled_regions.compresses_in_graph(config):
            warn_user(
                f"lightning_act: the model has torch.compile'd parts; inside them only codec='quantize' at 1, 2, 4 "
                f"or 8 bits compresses floats, so with codec={config.codec!r}, bits={config.bits} their float "
                f"activations are kept as they are (eager code still uses the config)")
        compressor.graph_hooks = compiled_regions.GraphHooks(compressor)

    def forward_context(self, compressor: ActivationCompressor) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


class HuggingFaceLayers:
    """HuggingFace layers checkpoint through the compressed checkpoint (all of them at CB1/CB2, the ones the user
    enabled otherwise) and use chunked attention at CB2, for the duration of the forward."""

    def __init__(self):
        self._warned: weakref.WeakSet = weakref.WeakSet()  # compressors told their model has nothing to checkpoint

    def prepare(self, compressor: ActivationCompressor) -> None:
        pass

    @contextlib.contextmanager
    def forward_context(self, compressor: ActivationCompressor) -> Iterator[None]:
        model, config = compressor.model, compressor.config
        if model is None:
            yield
            return
        with contextlib.ExitStack() as stack:
            routed = stack.enter_context(use_compressed_checkpointing(model, compressor, config.checkpointing))
            if config.checkpointing and not routed and compressor not in self._warned:
                self._warned.add(compressor)
                warn_user(
                    f"lightning_act: opt_level={config.opt_level!r} checkpoints HuggingFace layers, and "
                    f"{type(model).__name__} has none; wrap segments with lightning_act.checkpoint(fn, *args)")
            if config.efficient_attention:
                stack.enter_context(use_chunked_attention(model))
            yield


for _preparation in (BLPAConversion(),
                     BoundedConversion("bounded_cnn", convert_bounded_cnn, is_bounded, unconvert_bounded_cnn),
                     BoundedConversion("bounded_ffn", convert_bounded_ffn, is_bounded_ffn, unconvert_bounded_ffn),
                     CompiledRegions(), HuggingFaceLayers(), FSDPParameters()):
    register_model_preparation(_preparation)
