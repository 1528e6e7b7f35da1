"""Per-layer compression statistics, by module hooks (GNN layers by default).

    compressor = act.ActivationCompressor(model, act.ACTConfig(bits=4))
    with LayerStats(model, compressor) as layers:
        with compressor.compress():
            loss = criterion(model(data.x, data.edge_index)[mask], data.y[mask])
        loss.backward()
    layers.per_layer()     # {"convs.0": CompressionStats, ..., "(model)": CompressionStats}

Each saved tensor of the compressor's step is attributed to the innermost *tracked* module running when it
was saved: by default every ``torch_geometric`` ``MessagePassing`` layer and every leaf module outside one, so a
conv's inner ``Linear`` counts for the conv. Tensors saved outside any tracked module (functional ops in the
model's own ``forward``, the loss) go to ``"(model)"``. The engine's policy already handles what GNNs save:
int64 ``edge_index`` and scatter indices are kept, sparse adjacencies are kept, stride-0 scatter views cost their
real storage.
"""
from __future__ import annotations

from typing import Callable

from torch import nn

from .. import layer_stats
from ..engine import ActivationCompressor
from ..layer_stats import OUTSIDE

__all__ = ["OUTSIDE", "LayerStats", "gnn_layers"]


def gnn_layers(model: nn.Module) -> dict[str, nn.Module]:
    """``MessagePassing`` modules and the leaf modules that are not inside one, by qualified name."""
    from torch_geometric.nn import MessagePassing

    tracked: dict[str, nn.Module] = {}
    inside: set[int] = set()
    for name, module in model.named_modules():
        if id(module) in inside or not name:
            continue
        if isinstance(module, MessagePassing):
            tracked[name] = module
            inside.update(id(m) for m in module.modules())
        elif not any(True for _ in module.children()):
            tracked[name] = module
    return tracked


class LayerStats(layer_stats.LayerStats):
    """:class:`lightning_act.layer_stats.LayerStats` tracking :func:`gnn_layers` unless ``layers`` says otherwise."""

    def __init__(self, model: nn.Module, compressor: ActivationCompressor,
                 layers: Callable[[nn.Module], dict[str, nn.Module]] = gnn_layers):
        super().__init__(model, compressor, layers)
