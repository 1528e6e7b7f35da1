"""A model's modules, listed once per shape of its module tree.

Every forward under ``compress()`` asks which parameters and buffers the model holds, which HuggingFace layers
to route through the compressed checkpoint and which modules FSDP sharded: walking a BERT-base tree for each
took about 1.5 ms of host time per step. :func:`modules` walks once and again only after a submodule has been
registered anywhere in the process (torch's global module-registration hook bumps a generation counter).
Callers read the parameters, buffers and classes of the listed modules at every step, so values swapped in
directly (``module._parameters[name] = ...``, FSDP's sharding) are always seen. A module removed with ``del``
stays listed until the next registration: its parameters then count as parameters, which keeps them exact.
"""
from __future__ import annotations

import weakref

from torch import nn
from torch.nn.modules.module import register_module_module_registration_hook

from ._validate import check_type

_generation = 0
_modules: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (generation, its modules)


def _tree_changed(*_) -> None:
    global _generation
    _generation += 1


register_module_module_registration_hook(_tree_changed)


def modules(model: nn.Module) -> tuple[nn.Module, ...]:
    """``tuple(model.modules())``, cached until a module is registered anywhere."""
    try:
        hit = _modules.get(model)
    except TypeError:  # not weak-referenceable: not a module (the converters pass the user's model here first)
        check_type("model", model, nn.Module, "an nn.Module")
        raise
    if hit is not None and hit[0] == _generation:
        return hit[1]
    generation = _generation  # read before walking: a registration during the walk invalidates the result
    listed = tuple(model.modules())
    _modules[model] = (generation, listed)
    return listed
