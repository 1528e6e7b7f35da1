"""FSDP2 (``torch.distributed.fsdp.fully_shard``) under the compressor.

In a sharded forward each FSDP module all-gathers its parameters into unsharded copies just before its forward
(FSDP's pre-forward hook) and frees them after it (or keeps them for backward: the root, or
``reshard_after_forward=False``). Those copies are what ops save for backward: ``Linear`` saves ``weight.t()``,
a fused projection saves chunks of its weight (``SplitBackward``, which the engine's walk to ``AccumulateGrad``
does not pass). :class:`FSDPParameters`, registered with the engine by ``lightning_act.model_prep``, counts their
storages as parameters while their module's forward runs, in the forward and in a compressed checkpoint's
recomputation, so every view of them passes through exactly and counts as a parameter in the statistics.

:func:`shard_blocks` is what ``Trainer(strategy="act_fsdp")`` applies when ``configure_model`` called no
``fully_shard``: each block of every ``nn.ModuleList`` (transformer layers), then every child of the module.

Nothing here imports ``torch.distributed.fsdp`` before a model is sharded: a model can hold FSDP modules only
once that module is loaded.
"""
from __future__ import annotations

import contextlib
import sys
import weakref
from typing import Any

import torch
from torch import nn

from . import module_tree
from .engine import ActivationCompressor


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that ``fully_shard`` was applied to (outermost first)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return []
    return [m for m in module_tree.modules(model) if isinstance(m, fsdp.FSDPModule)]


def _own_parameter_holders(module: nn.Module) -> list[nn.Module]:
    """``module`` and its descendants outside nested FSDP modules: the holders of the parameters its FSDP group
    all-gathers."""
    fsdp = sys.modules["torch.distributed.fsdp"]
    holders, stack = [], [module]
    while stack:
        m = stack.pop()
        holders.append(m)
        stack.extend(c for c in m.children() if not isinstance(c, fsdp.FSDPModule))
    return holders


class FSDPParameters:
    """The storages of the parameters an FSDP module has all-gathered count as parameters of the compressor's
    running step (a forward under ``compress()`` or a checkpoint's recomputation in backward) from the module's
    pre-forward (after FSDP's own, which unshards them) to its post-forward, when FSDP may free them and their
    memory may hold activations next.

    The hooks go on the FSDP modules at the first forward that finds them and stay while the compressor lives
    (recomputations run in backward, after the forward's context has closed); they hold the compressor weakly
    and are removed when it is collected."""

    def __init__(self):
        self._hooked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # compressor -> hooked modules

    def prepare(self, compressor: ActivationCompressor) -> None:
        pass

    def forward_context(self, compressor: ActivationCompressor) -> contextlib.AbstractContextManager[None]:
        modules = fsdp_modules(compressor.model) if compressor.model is not None else []
        hooked = self._hooked.setdefault(compressor, weakref.WeakSet())
        for module in modules:
            if module in hooked:
                continue
            hooked.add(module)
            window = _ParameterWindow(weakref.ref(compressor), _own_parameter_holders(module))
            for handle in (module.register_forward_pre_hook(window.open),
                           module.register_forward_hook(window.close, always_call=True)):  # also when forward raises
                weakref.finalize(compressor, handle.remove)
        return contextlib.nullcontext()


class _ParameterWindow:
    """Adds the unsharded parameters of one FSDP group to the running step's parameter storages, and takes
    exactly those out again (a stack: a module may run several times in one forward)."""

    def __init__(self, compressor: weakref.ref, holders: list[nn.Module]):
        self.compressor = compressor
        self.holders = holders
        self.added: list[set[int]] = []

    def _step(self) -> Any:
        compressor = self.compressor()
        return compressor.current_step if compressor is not None else None

    def open(self, module: nn.Module, args: Any) -> None:
        step = self._step()
        if step is None:  # a forward outside compress() and recomputations (evaluation)
            return
        ptrs = {p.untyped_storage().data_ptr() for holder in self.holders for p in holder._parameters.values()
                if p is not None and type(p) in (torch.Tensor, nn.Parameter)} - step.param_storages  # unsharded ones
        step.param_storages |= ptrs
        self.added.append(ptrs)

    def close(self, module: nn.Module, args: Any, output: Any) -> None:
        step = self._step()
        if step is None or not self.added:
            return
        step.param_storages -= self.added.pop()


def shard_blocks(module: nn.Module, mesh: Any = None, **fsdp_kwargs: Any) -> list[nn.Module]:
    """``fully_shard`` each block of every ``nn.ModuleList`` in ``module`` (all-gathered one block at a time),
    then each child of ``module`` that holds parameters outside those blocks (embeddings, heads). ``module`` itself
    is not sharded: Lightning calls ``training_step``, not its forward, so FSDP's root hooks would never run on it.
    Returns the sharded modules, blocks first.

    Raises ``ValueError`` when ``module`` holds parameters of its own (they would be neither sharded nor
    synchronised): put them in a submodule, or shard in ``configure_model``."""
    from torch.distributed.fsdp import fully_shard

    own = [name for name, _ in module.named_parameters(recurse=False)]
    if own:
        raise ValueError(f"cannot shard {type(module).__name__} automatically: it holds parameters {own} itself; "
                         "allowed: parameters inside submodules (or call fully_shard in configure_model)")
    blocks = [block for m in module.modules() if isinstance(m, nn.ModuleList) for block in m
              if any(True for _ in block.parameters())]
    for block in blocks:
        fully_shard(block, mesh=mesh, **fsdp_kwargs)
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    children = [c for c in module.children() if any(id(p) not in in_blocks for p in c.parameters())]
    for child in children:
        fully_shard(child, mesh=mesh, **fsdp_kwargs)
    return blocks + children
