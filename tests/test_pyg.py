"""torch_geometric GCN, GAT, GCNII and GraphSAGE under compression: gradients, what the policy keeps (int64 indices,
sparse adjacencies), training, and ``LayerStats`` per-layer attribution."""
import pytest
import torch

import lightning_act as act
from lightning_act.datasets import adjacency, synthetic_sbm
from lightning_act.models import GNN_MODELS, gnn
from lightning_act.stats import COMPRESSED, KEPT

pytest.importorskip("torch_geometric")
pytestmark = pytest.mark.filterwarnings("ignore:Sparse")  # torch's beta notices for CSR tensors

from lightning_act.integrations import LayerStats  # noqa: E402
from lightning_act.integrations.pyg import OUTSIDE  # noqa: E402


@pytest.fixture(scope="module")
def graph():
    return synthetic_sbm(blocks=2, block_size=100, features=32, p_in=0.05, p_out=0.01)


def _model(kind, data):
    torch.manual_seed(0)
    return gnn(kind, data.num_features, 32, 2)


def _loss(model, data, adj):
    torch.manual_seed(1)  # same dropout masks in the exact and the compressed run
    out = model(data.x, adj)
    return torch.nn.functional.cross_entropy(out[data.train_mask], data.y[data.train_mask])


def _grad(model, data, adj, compressor=None):
    model.zero_grad(set_to_none=True)
    if compressor is None:
        loss = _loss(model, data, adj)
    else:
        with compressor.compress():
            loss = _loss(model, data, adj)
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


# GAT turns a sparse adjacency back into indices; GCN and GraphSAGE save the sparse tensor itself
@pytest.mark.parametrize("kind, adj_kind", [(k, "edge_index") for k in GNN_MODELS] + [("gcn", "sparse"), ("sage", "sparse")])
def test_gradients_close_and_per_layer_stats_add_up(graph, kind, adj_kind):
    model = _model(kind, graph).train()
    adj = adjacency(graph, adj_kind)
    exact = _grad(model, graph, adj)
    compressor = act.ActivationCompressor(model, act.ACTConfig(bits=8, min_numel=256))
    with LayerStats(model, compressor) as layers:
        approx = _grad(model, graph, adj, compressor)
    assert torch.nn.functional.cosine_similarity(exact, approx, dim=0).item() >= 0.999
    stats = compressor.stats()
    assert stats.ratio > 1.5 and stats.num_compressed > 0
    kept_dtypes = {r.dtype for r in stats.records if r.kind == KEPT}
    if adj_kind == "edge_index":
        assert torch.int64 in kept_dtypes  # edge_index / scatter indices pass through
    else:
        assert any(r.reason == "sparse" for r in stats.records)
    assert not any(r.kind == COMPRESSED and not r.dtype.is_floating_point and r.dtype != torch.bool
                   for r in stats.records)

    per_layer = layers.per_layer()
    assert sum(s.original_bytes for s in per_layer.values()) == stats.original_bytes
    assert sum(s.stored_bytes for s in per_layer.values()) == stats.stored_bytes
    assert sum(s.num_saved for s in per_layer.values()) == stats.num_saved
    assert "convs.0" in per_layer and per_layer["convs.0"].num_compressed > 0
    assert set(per_layer) <= set(layers.layers) | {OUTSIDE}


@pytest.mark.parametrize("kind", GNN_MODELS)
def test_trains_under_4_bit_compression(graph, kind):
    model = _model(kind, graph)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    compressor = act.ActivationCompressor(model, act.ACTConfig(bits=4, min_numel=256))
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        with compressor.compress():
            loss = _loss(model, graph, graph.edge_index)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert compressor.stats().ratio > 2


def test_layer_stats_hooks_removed_even_when_forward_raises(graph):
    model = _model("gcn", graph)
    compressor = act.ActivationCompressor(model)
    with pytest.raises(RuntimeError, match="boom"):
        with LayerStats(model, compressor):
            with compressor.compress():
                model.convs[0].register_forward_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
                model(graph.x, graph.edge_index)
    model.convs[0]._forward_hooks.clear()  # the test's own raising hook
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_layer_stats_errors(graph):
    model = _model("gcn", graph)
    compressor = act.ActivationCompressor(model)
    layers = LayerStats(model, compressor).attach()
    with pytest.raises(RuntimeError, match="already attached"):
        layers.attach()
    with pytest.raises(RuntimeError, match="saw no forward of the compressor's last step"):
        layers.per_layer()
    layers.detach()
    with pytest.raises(ValueError, match="no layers to track in GCNII"):
        LayerStats(_model("gcnii", graph), compressor, layers=lambda m: {})
