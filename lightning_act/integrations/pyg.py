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

``fuse_gcn(model)`` swaps a model's ``GCNConv`` layers for :class:`lightning_act.nn.SparseGCNConv` (same
parameters, a backward that holds two node-sized tensors instead of about five) and its
``nn.Sequential(nn.ReLU(), nn.Dropout(p))`` blocks for :class:`lightning_act.nn.ReLUDropout`; ``unfuse_gcn``
puts the originals back.
"""
from __future__ import annotations

from typing import Callable

from torch import nn

from .. import layer_stats
from .._validate import check_choice, check_type
from ..engine import ActivationCompressor
from ..layer_stats import OUTSIDE
from ..nn._chunks import chunk_rows
from ..nn.relu_dropout import ReLUDropout
from ..nn.sparse_gcn import DEFAULT_CHUNK_BYTES, SparseGCNConv

__all__ = ["OUTSIDE", "LayerStats", "fuse_gcn", "gnn_layers", "unfuse_gcn"]
# attribute of a fused model: [(parent module, child name, original child), ...] in swap order
_SWAPS = "_lightning_act_unfused"


def gnn_layers(model: nn.Module) -> dict[str, nn.Module]:
    """``MessagePassing`` (and ``SparseGCNConv``) modules and the leaf modules that are not inside one, by
    qualified name."""
    from torch_geometric.nn import MessagePassing

    tracked: dict[str, nn.Module] = {}
    inside: set[int] = set()
    for name, module in model.named_modules():
        if id(module) in inside or not name:
            continue
        if isinstance(module, (MessagePassing, SparseGCNConv)):
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


def _sparse_conv(name: str, conv: nn.Module, chunk_bytes: int | str) -> SparseGCNConv:
    """A ``SparseGCNConv`` computing ``conv`` with ``conv``'s own parameter objects (an optimizer holding them
    keeps working)."""
    if conv.aggr != "add" or conv.flow != "source_to_target" or conv.in_channels <= 0:
        raise ValueError(f"fuse_gcn: {name} has aggr={conv.aggr!r}, flow={conv.flow!r}, "
                         f"in_channels={conv.in_channels}; SparseGCNConv computes GCNConv's defaults "
                         "(aggr='add', flow='source_to_target') with known in_channels")
    fused = SparseGCNConv(conv.in_channels, conv.out_channels, conv.improved, conv.cached, conv.add_self_loops,
                          conv.normalize, conv.bias is not None, chunk_bytes)
    fused.lin.weight, fused.bias = conv.lin.weight, conv.bias
    return fused.train(conv.training)


def _is_relu_dropout(module: nn.Module) -> bool:
    return (type(module) is nn.Sequential and len(module) == 2 and type(module[0]) is nn.ReLU
            and type(module[1]) is nn.Dropout)


def fuse_gcn(model: nn.Module, chunk_bytes: int | str = DEFAULT_CHUNK_BYTES, relu_dropout: bool = True) -> nn.Module:
    """Swap, in ``model``, every ``torch_geometric.nn.GCNConv`` for a :class:`~lightning_act.nn.SparseGCNConv`
    sharing its parameters and (``relu_dropout=True``) every ``nn.Sequential(nn.ReLU(), nn.Dropout(p))`` for a
    :class:`~lightning_act.nn.ReLUDropout` (its dropout draws other masks); returns ``model``.

    Why: over a sparse ``adj_t`` a GCN step's peak is set by backward temporaries that are not saved tensors
    (about five node-sized ones per GCNConv, three per ReLU+dropout), which compression cannot shrink; the fused
    modules hold two. The fused convs normalize the adjacency at their first forward (once for all layers given
    it), not reusing a GCNConv's cache. ``GCNConv`` with another ``aggr`` or ``flow``, or lazy ``in_channels``,
    raises ``ValueError``. :func:`unfuse_gcn` undoes it."""
    from torch_geometric.nn import GCNConv

    check_type("model", model, nn.Module, "an nn.Module")
    chunk_rows(chunk_bytes, 1)  # checked here too: a model with no GCNConv to swap builds none
    check_choice("relu_dropout", relu_dropout, (True, False))
    if isinstance(model, GCNConv):
        raise TypeError("fuse_gcn swaps the GCNConv layers inside a model; for a single layer build "
                         "lightning_act.nn.SparseGCNConv and load the GCNConv's state dict")
    swaps = []
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            qualified = f"{parent_name}.{name}" if parent_name else name
            if isinstance(child, GCNConv):
                fused = _sparse_conv(qualified, child, chunk_bytes)
            elif relu_dropout and _is_relu_dropout(child):
                fused = ReLUDropout(child[1].p, chunk_bytes).train(child.training)
            else:
                continue
            setattr(parent, name, fused)
            swaps.append((parent, name, child))
    model.__dict__.setdefault(_SWAPS, []).extend(swaps)
    return model


def unfuse_gcn(model: nn.Module) -> nn.Module:
    """Put back what :func:`fuse_gcn` swapped in ``model`` (the originals take the fused modules' training mode;
    their parameters were shared all along); returns ``model``. A model never fused is returned unchanged."""
    check_type("model", model, nn.Module, "an nn.Module")
    for parent, name, original in reversed(model.__dict__.pop(_SWAPS, [])):
        original.train(getattr(parent, name).training)
        setattr(parent, name, original)
    return model
