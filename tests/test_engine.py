"""The engine's policy and guarantees: exactness at L0/32 bits, autograd's in-place check, de-duplication,
parameters, indices, masks, stride-0 views, sparse tensors, odd shapes, statistics."""
import gc

import pytest
import torch
from torch import nn

import lightning_act as act
from lightning_act.stats import COMPRESSED, DUPLICATE, KEPT, PARAMETER


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Dropout(0.2),
        nn.Conv2d(16, 16, 3, stride=2, padding=1), nn.GELU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(16 * 4 * 4, 10), nn.LogSoftmax(dim=1),
    )


def grads_of(model: nn.Module, x: torch.Tensor, compressor=None) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(123)  # same dropout mask in every run
    if compressor is None:
        loss = model(x).sum()
    else:
        with compressor.compress():
            loss = model(x).sum()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("config", [act.ACTConfig(opt_level="L0"), act.ACTConfig(bits=32),
                                    act.ACTConfig(bits=32, min_numel=0)])
def test_l0_and_32_bits_give_bit_identical_gradients(config):
    model, x = small_cnn(), torch.randn(8, 3, 16, 16)
    exact = grads_of(model, x)
    compressor = act.ActivationCompressor(model, config)
    got = grads_of(model, x, compressor)
    assert all(torch.equal(a, b) for a, b in zip(exact, got))
    assert compressor.stats().num_saved > 0


def test_four_bit_gradients_are_close_and_stats_add_up():
    model, x = small_cnn(), torch.randn(16, 3, 16, 16)
    exact = torch.cat([g.flatten() for g in grads_of(model, x)])
    compressor = act.ActivationCompressor(model, act.ACTConfig(bits=4, min_numel=0))
    got = torch.cat([g.flatten() for g in grads_of(model, x, compressor)])
    assert torch.nn.functional.cosine_similarity(exact, got, dim=0) > 0.95
    stats = compressor.stats()
    assert stats.original_bytes == sum(r.original_bytes for r in stats.records)
    assert stats.stored_bytes == sum(r.stored_bytes for r in stats.records)
    assert stats.ratio == pytest.approx(stats.original_bytes / stats.stored_bytes)
    assert stats.ratio > 4
    assert stats.count(COMPRESSED) >= 5


def test_inplace_modification_after_save_raises_like_autograd():
    x = torch.randn(5000, requires_grad=True)
    compressor = act.ActivationCompressor(None, act.ACTConfig(min_numel=0))
    with compressor.compress():
        y = x.exp()  # exp saves its result
        loss = y.sum()
    y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation.*at version 1; expected version 0"):
        loss.backward()


def test_inplace_detected_even_after_the_tensor_is_gone():
    x = torch.randn(5000, requires_grad=True)
    compressor = act.ActivationCompressor(None, act.ACTConfig(min_numel=0))
    with compressor.compress():
        y = torch.sigmoid(x)
        y.mul_(2)  # modifies the saved result of sigmoid
        loss = y.sum()
    del y
    gc.collect()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_autograd_own_saved_tensors_unaffected_by_guard():
    # a tensor saved by autograd outside the context, then by an op inside it: the guard must not bump its version
    x = torch.randn(5000, requires_grad=True)
    y = x.exp()
    compressor = act.ActivationCompressor(None, act.ACTConfig(min_numel=0))
    with compressor.compress():
        z = (y * 3).sum()
    (y.sum() + z).backward()
    assert torch.allclose(x.grad, x.exp() * 4, rtol=0.2)


def test_same_storage_saved_three_times_is_stored_once():
    h = torch.randn(64, 64, requires_grad=True) * 1.0
    compressor = act.ActivationCompressor(None, act.ACTConfig(min_numel=0))
    with compressor.compress():
        loss = (h * h * h).sum()
    loss.backward()
    kinds = [r.kind for r in compressor.stats().records]
    assert kinds.count(DUPLICATE) >= 1
    one = 64 * 64 * 4
    # h once (duplicates free) and h*h once: two storages
    assert compressor.stats().original_bytes == 2 * one


@pytest.mark.parametrize("autocast", [True, False])
def test_one_decode_serves_the_autocast_copies_of_one_input(monkeypatch, autocast):
    """Three layers reading one float32 input under bfloat16 autocast (a transformer's query, key and value
    projections) each cast it: one stored form, decoded once in the backward, its readers getting the same tensor.
    A storage several ops save without autocast decodes at each unpack (a bounded node saves a chunk twice to
    decode it at two points of its backward, not hold it in between). A second backward (retain_graph) decodes at
    each unpack, with the same gradients."""
    from lightning_act.codecs.quantize import QuantizeCodec

    decodes = []
    decode = QuantizeCodec.decode
    monkeypatch.setattr(QuantizeCodec, "decode", lambda self, packed: decodes.append(packed) or decode(self, packed))
    torch.manual_seed(0)
    first, heads = nn.Linear(16, 64), nn.ModuleList(nn.Linear(64, 8) for _ in range(3))
    x = torch.randn(32, 16)
    compressor = act.ActivationCompressor(None, act.ACTConfig(bits=4, adaptive=False, min_numel=0))
    with compressor.compress(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        h = first(x).float()
        loss = sum(head(h).float().square().sum() for head in heads)
    records = compressor.stats().records
    duplicates = [r for r in records if r.kind == DUPLICATE and r.codec == "quantize"]
    assert len(duplicates) == 2 and all((r.reason == "autocast copy") == autocast for r in duplicates)
    forms = sum(r.kind == COMPRESSED and r.codec == "quantize" for r in records)
    loss.backward(retain_graph=True)
    once = [p.grad.clone() for p in first.parameters()]
    assert len(decodes) == (forms if autocast else forms + 2)  # one decode for the three copies, or one per save
    decodes.clear()
    first.zero_grad()
    loss.backward()
    assert len(decodes) == forms + 2  # no count left: every unpack decodes
    assert all(torch.equal(a, p.grad) for a, p in zip(once, first.parameters()))


def test_freed_storage_reused_at_same_address_is_not_a_duplicate():
    compressor = act.ActivationCompressor(None, act.ACTConfig(bits=8, min_numel=0))
    w = torch.randn(4096, requires_grad=True)
    with compressor.compress():
        losses = []
        for i in range(4):
            t = torch.full((4096,), float(i)) + 0.0  # temporaries, likely to reuse one address
            losses.append((torch.sin(t) * w).sum())
            del t
        loss = sum(losses)
    loss.backward()
    expected = sum(torch.sin(torch.full((4096,), float(i))) for i in range(4))
    torch.testing.assert_close(w.grad, expected, atol=0.02, rtol=0)


class _ThreeProjections(nn.Module):
    """A transformer's query, key and value: three Linears of one hidden state, each casting it under autocast."""

    def __init__(self, width=128):
        super().__init__()
        self.inner = nn.Linear(width, width)
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))

    def forward(self, x, between=None):
        h = torch.tanh(self.inner(x)).float()  # float32 (a LayerNorm's output under autocast): each projection
        # casts it to bfloat16 anew
        q = self.q(h)
        if between is not None:
            between(h)
        return (q * self.k(h) + self.v(h)).float().square().mean()


def _three_projection_grads(model, x, compressor=None, between=None):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if compressor is None:
            loss = model(x, between)
        else:
            with compressor.compress():
                loss = model(x, between)
    loss.backward()
    return torch.cat([p.grad.float().reshape(-1) for p in (model.q.weight, model.k.weight, model.v.weight)])


def test_autocast_copies_of_one_input_are_stored_once():
    """Each projection saves its own bfloat16 copy of the hidden state: equal values, three storages. The first is
    compressed, the other two are duplicates of it (their bytes counted as original, none stored)."""
    torch.manual_seed(0)
    model, x = _ThreeProjections(), torch.randn(64, 128)
    reference = _three_projection_grads(model, x)
    compressor = act.ActivationCompressor(model, act.ACTConfig(bits=8, adaptive=False, min_numel=1024))
    grads = _three_projection_grads(model, x, compressor)
    assert torch.nn.functional.cosine_similarity(grads, reference, dim=0) > 0.999
    records = compressor.stats().records
    copies = [r for r in records if r.reason == "autocast copy"]
    assert [(r.kind, r.shape, r.original_bytes, r.stored_bytes) for r in copies] == \
        [(DUPLICATE, (64, 128), 64 * 128 * 2, 0)] * 2  # the key's and the value's copies
    # the query's, compressed: the step stores 2 of its 11 saved tensors' bytes fewer
    assert sum(r.stored_bytes for r in records) < sum(r.original_bytes for r in records) / 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_autocast_copies_of_a_channels_last_input_are_stored_once(dtype, monkeypatch):
    """Two convolutions of one channels_last input (a downsampling branch beside the main one): autocast casts a
    float32 input for each, keeping its layout, and the second copy is the first's duplicate, decoded once for
    both in the backward (its storage in memory order, seen through each save's geometry); a float64 input is not
    cast by autocast, so nothing is a copy."""
    from lightning_act.codecs.quantize import QuantizeCodec

    decodes = []
    decode = QuantizeCodec.decode
    monkeypatch.setattr(QuantizeCodec, "decode", lambda self, packed: decodes.append(packed) or decode(self, packed))
    torch.manual_seed(0)
    convs = nn.ModuleList(nn.Conv2d(8, 8, 3, padding=1) for _ in range(2)).to(dtype)
    x0 = torch.randn(4, 8, 16, 16, dtype=dtype).to(memory_format=torch.channels_last).requires_grad_()

    def grads(compressor=None):
        convs.zero_grad(set_to_none=True)
        x0.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16), (
                compressor.compress() if compressor else torch.autograd.graph.saved_tensors_hooks(lambda t: t,
                                                                                                  lambda t: t)):
            h = x0 * 2  # the shared input, float32 or float64 and channels_last
            assert h.is_contiguous(memory_format=torch.channels_last)
            loss = (convs[0](h) * convs[1](h)).double().square().mean()
        loss.backward()
        return torch.cat([x0.grad.double().reshape(-1)] + [c.weight.grad.double().reshape(-1) for c in convs])

    reference = grads()
    compressor = act.ActivationCompressor(convs, act.ACTConfig(bits=8, adaptive=False, min_numel=1024))
    compressed = grads(compressor)
    copies = [r for r in compressor.stats().records if r.reason == "autocast copy"]
    assert [(r.kind, r.shape, r.original_bytes, r.stored_bytes) for r in copies] == (
        [(DUPLICATE, (4, 8, 16, 16), 4 * 8 * 16 * 16 * 2, 0)] if dtype == torch.float32 else [])
    records = compressor.stats().records
    forms = sum(r.kind == COMPRESSED and r.codec == "quantize" for r in records)
    # one decode per stored form and per other save of one storage (float64: both convolutions save h itself)
    saved_again = sum(r.kind == DUPLICATE and r.codec == "quantize" and r.reason != "autocast copy" for r in records)
    assert saved_again == (dtype == torch.float64) and len(decodes) == forms + saved_again
    assert torch.nn.functional.cosine_similarity(compressed, reference, dim=0) > 0.999


def test_a_source_changed_between_its_casts_is_cast_anew():
    """The source modified in place (no autograd record: its version alone changes) between two projections: the
    later copies hold other values, so they are not duplicates of the first."""
    torch.manual_seed(0)
    model, x = _ThreeProjections(), torch.randn(64, 128)

    def double(h):
        with torch.no_grad():
            h.mul_(2)

    reference = _three_projection_grads(model, x, between=double)
    compressor = act.ActivationCompressor(model, act.ACTConfig(bits=8, adaptive=False, min_numel=1024))
    grads = _three_projection_grads(model, x, compressor, between=double)
    copies = [r for r in compressor.stats().records if r.reason == "autocast copy"]
    assert len(copies) == 1  # the value's copy, of the doubled state as the key's; the key's is compressed anew
    torch.testing.assert_close(grads, reference, atol=0.02 * reference.abs().max().item(), rtol=0)


def test_a_saved_tensor_of_another_dtype_is_no_copy_of_the_other_argument():
    """``a @ b`` under autocast with ``b`` already bfloat16 (a copy of another tensor): ``a``'s cast and ``b`` are
    both saved, and ``b`` is not taken for a copy of ``a``."""
    torch.manual_seed(0)
    a0, b0 = torch.randn(128, 128, requires_grad=True), torch.randn(128, 128, requires_grad=True)

    def step(compressor=None):
        a0.grad = b0.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16), (compressor.compress() if compressor else
                                                           torch.autograd.graph.saved_tensors_hooks(lambda t: t,
                                                                                                    lambda t: t)):
            a, b = torch.tanh(a0), torch.tanh(b0).to(torch.bfloat16)
            loss = (torch.matmul(a, b) + torch.matmul(a, b.t())).float().square().mean()
        loss.backward()
        return torch.cat([a0.grad.reshape(-1), b0.grad.reshape(-1)])

    reference = step()
    compressor = act.ActivationCompressor(None, act.ACTConfig(bits=8, adaptive=False, min_numel=1024))
    grads = step(compressor)
    copies = [r for r in compressor.stats().records if r.reason == "autocast copy"]
    assert len(copies) == 1  # the second product's cast of a, not b
    torch.testing.assert_close(grads, reference, atol=0.02 * reference.abs().max().item(), rtol=0)


def test_parameters_pass_through_including_autocast_casts():
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128))
    x = torch.randn(64, 128, requires_grad=True)
    compressor = act.ActivationCompressor(model, act.ACTConfig(min_numel=0))
    with compressor.compress(), torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x).float().sum()
    loss.backward()
    recs = compressor.stats().records
    params = [r for r in recs if r.kind == PARAMETER]
    assert {r.shape for r in params} >= {(256, 128), (128, 256)}
    assert not any(r.kind == COMPRESSED and r.shape in ((256, 128), (128, 256)) for r in recs)


def test_parameters_detected_without_model_through_grad_fn():
    lin = nn.Linear(100, 100)
    x = torch.randn(50, 100, requires_grad=True)
    compressor = act.ActivationCompressor(None, act.ACTConfig(min_numel=0))
    with compressor.compress():
        lin(x).sum().backward()
    shapes = {r.shape: r.kind for r in compressor.stats().records}
    assert shapes[(100, 100)] == PARAMETER  # weight.t() walked to AccumulateGrad


def test_integer_indices_kept_and_counted():
    emb = nn.Embedding(1000, 64)
    idx = torch.randint(0, 1000, (32, 128))
    compressor = act.ActivationCompressor(emb, act.ACTConfig(min_numel=0))
    with compressor.compress():
        emb(idx).sum().backward()
    (rec,) = [r for r in compressor.stats().records if r.dtype == torch.int64]
    assert rec.kind == KEPT and rec.original_bytes == rec.stored_bytes == idx.numel() * 8


def test_bool_masks_stored_at_one_bit():
    x = torch.randn(100, 1000, requires_grad=True)
    compressor = act.ActivationCompressor(None, act.ACTConfig(min_numel=0))
    with compressor.compress():
        y = torch.where(torch.rand(100, 1000) > 0.5, x, 0.0)  # where saves its bool condition
        y.sum().backward()
    masks = [r for r in compressor.stats().records if r.dtype == torch.bool]
    assert masks and all(r.kind == COMPRESSED and r.codec == "bitmask" for r in masks)
    assert all(r.stored_bytes * 8 == r.original_bytes for r in masks)


def test_stride_zero_expansion_counted_by_real_storage_and_not_materialised():
    leaf = torch.randn(1, 512, requires_grad=True)
    src = leaf * 1.0  # an activation, not a leaf
    compressor = act.ActivationCompressor(None, act.ACTConfig(min_numel=0, bits=8))
    with compressor.compress():
        big = src.expand(4096, 512)
        loss = (big * big.detach()).sum()  # mul saves both operands, each an expanded view
    loss.backward()
    for r in compressor.stats().records:
        if r.shape == (4096, 512):
            assert r.original_bytes <= 512 * 4
    # one 8-bit quantization step of the 512 real values, repeated in all 4096 rows
    step = (leaf.max() - leaf.min()).item() / 255
    torch.testing.assert_close(leaf.grad, 4096 * leaf.detach(), rtol=0, atol=4096 * step * 1.01)


def test_sparse_tensors_kept():
    a = torch.randn(200, 200).relu().to_sparse()
    w = torch.randn(200, 64, requires_grad=True)
    compressor = act.ActivationCompressor(None, act.ACTConfig(min_numel=0))
    with compressor.compress():
        torch.sparse.mm(a, w).sum().backward()
    sparse = [r for r in compressor.stats().records if r.reason == "sparse"]
    assert sparse and sparse[0].original_bytes == a._indices().nbytes + a._values().nbytes
    torch.testing.assert_close(w.grad, torch.sparse.mm(a.t(), torch.ones(200, 64)))


@pytest.mark.parametrize("shape, view", [
    ((0, 5), lambda y: y),
    ((1,), lambda y: y),
    ((300, 7), lambda y: y.t()),  # non-contiguous view: storage-level round trip keeps strides
    ((999,), lambda y: y),  # group does not divide numel
    ((50, 40), lambda y: y[::2, 1:]),  # view of part of a storage
    ((1, 600), lambda y: y.expand(10, 600)),  # stride-0 view
])
def test_odd_shapes_round_trip_through_engine(shape, view):
    x = torch.randn(shape, requires_grad=True)
    compressor = act.ActivationCompressor(None, act.ACTConfig(bits=8, min_numel=0))
    with compressor.compress():
        y = view(x * 1.0)
        loss = (y * y).sum()  # saves the view twice
    loss.backward()
    expected = torch.autograd.grad((view(x * 1.0) ** 2).sum(), x)[0]
    scale = max(1.0, x.detach().abs().max().item()) if x.numel() else 1.0
    torch.testing.assert_close(x.grad, expected, atol=0.05 * scale * (10 if shape == (1, 600) else 1), rtol=0)


def test_unpack_restores_shape_dtype_and_strides():
    seen = {}
    t = torch.randn(64, 96)[:, :80].t()  # non-contiguous, offset 0, covers most of its storage
    compressor = act.ActivationCompressor(None, act.ACTConfig(bits=8, min_numel=0))

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            ctx.save_for_backward(a)
            return a.clone()

        @staticmethod
        def backward(ctx, g):
            (a,) = ctx.saved_tensors
            seen["meta"] = (a.shape, a.dtype, a.stride(), a.storage_offset())
            return g

    x = t.detach().requires_grad_(True)
    with compressor.compress():
        Probe.apply(x).sum().backward()
    assert seen["meta"] == (t.shape, t.dtype, t.stride(), t.storage_offset())


def test_nesting_is_refused_and_hooks_removed_when_forward_raises():
    compressor = act.ActivationCompressor(None)
    with pytest.raises(RuntimeError, match="already active"):
        with compressor.compress(), compressor.compress():
            pass
    with pytest.raises(ZeroDivisionError):
        with compressor.compress():
            raise ZeroDivisionError
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    # a second step still works after the failure
    x = torch.randn(5000, requires_grad=True)
    with compressor.compress():
        loss = x.exp().sum()
    loss.backward()
    assert compressor.stats().num_saved == 1


def test_fresh_noise_every_step():
    x = torch.randn(8192, requires_grad=True)
    compressor = act.ActivationCompressor(None, act.ACTConfig(bits=1))
    grads = []
    for _ in range(2):
        x.grad = None
        with compressor.compress():
            loss = torch.sin(x * 1.0).sum()
        loss.backward()
        grads.append(x.grad.clone())
    assert not torch.equal(*grads)
    assert compressor.step_number == 2


class _SavesHalves(torch.autograd.Function):
    """Saves its input as two row slices: views made inside forward, where autograd records no history."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x[: x.shape[0] // 2], x[x.shape[0] // 2:], w[:1])
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        top, bottom, _ = ctx.saved_tensors
        assert top.shape[0] + bottom.shape[0] == grad.shape[0]
        return grad * 2, None


def test_views_made_inside_a_custom_function_are_activations_unless_their_base_is_a_parameter():
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 64)
    compressor = act.ActivationCompressor(layer, act.ACTConfig(bits=4, adaptive=False, min_numel=1))
    with compressor.compress():
        out = _SavesHalves.apply(layer(torch.randn(64, 64)), layer.weight)
    out.sum().backward()
    kinds = [r.kind for r in compressor.stats().records if r.shape in (torch.Size([32, 64]), torch.Size([1, 64]))]
    # the halves are two ranges of one storage, each stored on its own; the weight's row is a parameter's
    assert kinds == ["compressed", "compressed", "parameter"]


class _SavesChunksAndViews(torch.autograd.Function):
    """Saves the two halves of ``x.split()`` (a chunked layer's chunks) and two views covering ``y``'s storage;
    its backward unpacks each saved tensor alone and notes the bytes of the storage it was decoded into."""

    decoded: list[int] = []

    @staticmethod
    def forward(ctx, x, y):
        ctx.save_for_backward(*x.split(x.shape[0] // 2), y, y.t())
        return x * 2, y * 2

    @staticmethod
    def backward(ctx, gx, gy):
        from lightning_act.nn._chunks import SavedEntries

        saved = SavedEntries(ctx)
        _SavesChunksAndViews.decoded = [saved[i].untyped_storage().nbytes() for i in range(4)]
        return gx * 2, gy * 2


def test_the_chunks_of_a_split_are_stored_and_decoded_apart():
    """Each half of a split is its own memory range: stored, counted and decoded on its own (the first half used
    to store the whole storage and the second to be its duplicate, so unpacking either decoded both). A view
    covering a storage (a transpose) still shares the stored storage of the contiguous tensor filling it."""
    x, y = torch.randn(64, 128, requires_grad=True), torch.randn(96, 80, requires_grad=True)
    compressor = act.ActivationCompressor(None, act.ACTConfig(bits=8, adaptive=False, min_numel=1))
    with compressor.compress():
        out = _SavesChunksAndViews.apply(x * 1.0, y * 1.0)  # activations
    sum(o.sum() for o in out).backward()
    half = 32 * 128 * 4
    records = compressor.stats().records
    assert [r.kind for r in records] == [COMPRESSED, COMPRESSED, COMPRESSED, DUPLICATE]
    assert [r.original_bytes for r in records] == [half, half, y.nbytes, 0]
    assert _SavesChunksAndViews.decoded == [half, half, y.nbytes, y.nbytes]


def test_kept_parts_of_one_storage_count_it_once():
    """An integer edge_index saved whole and as its two rows (what PyG's layers save) is kept: the rows hold the
    whole storage alive, so the step counts that storage once, not once more per row."""
    edge_index = torch.randint(0, 100, (2, 5000))
    x = torch.randn(100, 16, requires_grad=True)
    compressor = act.ActivationCompressor(None, act.ACTConfig(bits=4, adaptive=False, min_numel=1))
    with compressor.compress():
        row, col = edge_index
        loss = (x.index_select(0, row) * x.index_select(0, col)).sum() + x[edge_index].sum()
    loss.backward()
    stats = compressor.stats()
    kept = [r for r in stats.records if r.dtype == torch.int64]
    assert len(kept) >= 3 and sum(r.original_bytes for r in kept) == edge_index.nbytes
    assert sum(r.stored_bytes for r in kept) == edge_index.nbytes


def test_a_storage_stored_under_two_codecs_counts_once_in_original_bytes():
    """A ReLU output is stored as ReLU's 1-bit mask and as the next conv's values: the step's original bytes
    (what autograd would have kept) count its storage once, as the uncompressed step does."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3))
    x = torch.randn(4, 3, 16, 16)
    originals = {}
    for level, config in (("L0", act.ACTConfig(opt_level="L0")),
                          ("4-bit", act.ACTConfig(bits=4, adaptive=False, min_numel=1))):
        compressor = act.ActivationCompressor(model, config)
        with compressor.compress():
            loss = model(x).sum()
        loss.backward()
        originals[level] = compressor.stats().original_bytes
    assert originals["4-bit"] == originals["L0"] > 0


@pytest.mark.parametrize("backend, kernels", [("torch", set()), ("cupy", {"quantize_encode", "mask_encode"})])
def test_the_configured_backend_reaches_the_lossless_codecs(backend, kernels):
    """ACTConfig(backend=...) holds for every codec the compressor builds or an op rule picks: with "torch" no
    kernel runs, masks included (the rules' shared codecs default to "auto"); with "cupy" the quantized
    activations and the ReLU / dropout masks go to the kernels."""
    from lightning_act.cuda.launcher import use_runner
    from tests.host_path import RecordingRunner

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Dropout(0.1), nn.Linear(256, 8))
    x = torch.randn(32, 64)
    runner = RecordingRunner()
    with use_runner(runner):
        compressor = act.ActivationCompressor(model, act.ACTConfig(bits=4, adaptive=False, backend=backend,
                                                                   min_numel=1))
        with compressor.compress():
            loss = model(x).square().mean()
        loss.backward()
    assert set(runner.kernels) & {"quantize_encode", "mask_encode"} == kernels
    codecs_used = {r.codec for r in compressor.stats().records if r.kind == COMPRESSED}
    assert {"quantize", "positive_mask"} <= codecs_used
