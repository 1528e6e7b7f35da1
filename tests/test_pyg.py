"""torch_geometric GCN, GAT, GCNII and GraphSAGE under compression: gradients, what the policy keeps (int64 indices,
sparse adjacencies), training, ``LayerStats`` per-layer attribution, and the sparse-adjacency path (same results
as ``edge_index``, node-sized saved tensors only, a step peak that compression divides)."""
import contextlib

import pytest
import torch

import lightning_act as act
from lightning_act.datasets import adjacency, synthetic_sbm
from lightning_act.models import GNN_MODELS, gnn
from lightning_act.profiling import measure_step_memory
from lightning_act.stats import COMPRESSED, DUPLICATE, KEPT

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


@pytest.mark.parametrize("kind", GNN_MODELS)
def test_sparse_adjacency_gives_the_edge_index_outputs_and_gradients(graph, kind):
    # eval: no dropout (GAT drops attention per edge, in an order that differs between the two inputs)
    model = gnn(kind, graph.num_features, 32, 2, layers=4 if kind == "gcnii" else 3).eval()
    results = []
    for adj_kind in ("edge_index", "sparse"):
        model.zero_grad(set_to_none=True)
        out = model(graph.x, adjacency(graph, adj_kind))
        out.square().sum().backward()
        results.append((out.detach(), [p.grad.clone() for p in model.parameters()]))
    (out_e, grads_e), (out_s, grads_s) = results
    torch.testing.assert_close(out_s, out_e, rtol=1e-4, atol=1e-5)
    for g_s, g_e in zip(grads_s, grads_e):
        torch.testing.assert_close(g_s, g_e, rtol=1e-4, atol=1e-4)


def test_gnn_rejects_bad_layers(graph):
    with pytest.raises(ValueError, match="layers=0; expected an integer >= 1"):
        gnn("gcn", graph.num_features, 32, 2, layers=0)


def _random_graph(nodes, degree, features, classes):
    from torch_geometric.data import Data

    g = torch.Generator().manual_seed(0)
    return Data(x=torch.randn(nodes, features, generator=g), y=torch.randint(0, classes, (nodes,), generator=g),
                edge_index=torch.randint(0, nodes, (2, nodes * degree), generator=g))


@pytest.mark.parametrize("kind", ["gcn", "sage"])
def test_sparse_path_compresses_node_sized_activations_and_counts_the_adjacency_once(kind):
    data = _random_graph(3000, 10, 64, 8)
    adj = adjacency(data, "sparse")
    torch.manual_seed(0)
    model = gnn(kind, 64, 128, 8, layers=3, cached=True)
    compressor = act.ActivationCompressor(model, act.ACTConfig(bits=4, adaptive=False))
    for _ in range(2):  # the second step runs on GCN's cached normalized adjacency
        with compressor.compress():
            loss = torch.nn.functional.cross_entropy(model(data.x, adj), data.y)
        loss.backward()
    records = compressor.stats().records
    compressed = [r for r in records if r.kind == COMPRESSED]
    assert len(compressed) >= 6 and all(r.shape[0] == 3000 and r.dtype == torch.float32 for r in compressed)
    adjacencies = [r for r in records if tuple(r.shape) == (3000, 3000)]
    csr_bytes = sum(t.numel() * t.element_size() for t in (adj.crow_indices(), adj.col_indices(), adj.values()))
    if kind == "sage":  # every layer saves the one adjacency it was given: stored once
        assert [r.kind for r in adjacencies] == [KEPT] + [DUPLICATE] * (len(adjacencies) - 1)
        assert len(adjacencies) >= 2 and adjacencies[0].original_bytes == csr_bytes
    else:  # each GCNConv saves its own normalized copy (self-loops added): one record each
        assert [r.kind for r in adjacencies] == [KEPT] * 3
        assert len({r.original_bytes for r in adjacencies}) == 1 and adjacencies[0].original_bytes > csr_bytes
    assert all(r.reason == "sparse" for r in adjacencies if r.kind == KEPT)


def test_sparse_gcn_step_peak_drops_at_4_bits_and_below_edge_index():
    """Profiler-measured step peaks of a 6-layer GCN (hidden 256) on 20k nodes: the sparse path holds no
    edge-sized messages, and 4-bit compression divides its peak (benchmarks/bench_gnn_sparse.py: the same at 200k
    nodes)."""
    data = _random_graph(20_000, 10, 64, 8)
    peaks = {}
    for name, adj_kind, config in (("edge_index", "edge_index", None), ("sparse", "sparse", None),
                                   ("sparse 4-bit", "sparse", act.ACTConfig(bits=4, adaptive=False))):
        torch.manual_seed(0)
        model = gnn("gcn", 64, 256, 8, layers=6, cached=True)
        adj = adjacency(data, adj_kind)
        compressor = act.ActivationCompressor(model, config) if config is not None else None

        def step():
            with compressor.compress() if compressor is not None else contextlib.nullcontext():
                loss = torch.nn.functional.cross_entropy(model(data.x, adj), data.y)
            loss.backward()

        step()  # caches the normalized adjacency
        model.zero_grad(set_to_none=True)
        peaks[name] = measure_step_memory(step).peak_bytes
    node_tensor = 20_000 * 256 * 4
    assert peaks["edge_index"] >= 2 * peaks["sparse"]
    assert peaks["sparse"] >= 2.5 * peaks["sparse 4-bit"], {k: v / node_tensor for k, v in peaks.items()}
