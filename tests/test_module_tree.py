"""The cached module list behind every compress() step: invalidated by any module registration, and the
parameters read from it at every step see values swapped in directly."""
import torch
from torch import nn

import lightning_act as act
from lightning_act import module_tree
from lightning_act.stats import PARAMETER


def test_modules_are_cached_until_a_module_is_registered():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    first = module_tree.modules(model)
    assert first == tuple(model.modules())
    assert module_tree.modules(model) is first  # no walk while the tree is unchanged
    model.add_module("head", nn.Linear(4, 2))
    assert module_tree.modules(model) == tuple(model.modules()) and len(module_tree.modules(model)) == 4
    model[0].inner = nn.Linear(4, 4)  # a registration deep in the tree, through __setattr__
    assert model[0].inner in module_tree.modules(model)


def test_a_parameter_swapped_in_directly_is_still_a_parameter():
    """``module._parameters[name] = p`` fires no registration hook (FSDP shards this way): the compressor reads
    parameters from the listed modules at every step, so the new weight is never compressed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    compressor = act.ActivationCompressor(model, act.ACTConfig(bits=4, adaptive=False, min_numel=1))
    x = torch.randn(8, 64)
    with compressor.compress():
        model(x).sum().backward()
    model[2]._parameters["weight"] = nn.Parameter(torch.randn(64, 64))
    with compressor.compress():
        model(x).sum().backward()
    assert compressor._model_storages() >= {model[2].weight.untyped_storage().data_ptr()}
    kinds = {r.shape: r.kind for r in compressor.stats().records if r.shape == torch.Size([64, 64])}
    assert kinds == {torch.Size([64, 64]): PARAMETER}
