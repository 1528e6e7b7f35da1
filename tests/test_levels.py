"""GACT levels beyond L1: swap with prefetch (L2), compressed checkpointing (CB1), chunked attention (CB2)."""
import copy
import gc
import inspect

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

import lightning_act as act
from lightning_act import optrack
from lightning_act.checkpoint import _checkpointing_layer, checkpoint
from lightning_act.nn.attention import chunked_attention, use_chunked_attention
from lightning_act.stats import COMPRESSED
from lightning_act.swap import HostBufferPool, SwapStore

transformers = pytest.importorskip("transformers")


def mlp(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Dropout(dropout), nn.Linear(256, 256), nn.Tanh(),
                         nn.Linear(256, 10))


def flat_grad(model, loss_fn, compressor=None, seed=7):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    if compressor is None:
        loss = loss_fn()
    else:
        with compressor.compress():
            loss = loss_fn()
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def cosine(a, b):
    return torch.nn.functional.cosine_similarity(a, b, dim=0).item()


# ---- L2: swap ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("level", ["L1", "L0"])
def test_swap_gives_bit_identical_gradients(level):
    model, x = mlp(0.2), torch.randn(128, 64)
    loss_fn = lambda: model(x).square().mean()  # noqa: E731
    plain = flat_grad(model, loss_fn, act.ActivationCompressor(model, act.ACTConfig(opt_level=level)))
    swapping = act.ActivationCompressor(model, act.ACTConfig(opt_level=level, swap=True))
    swapped = flat_grad(model, loss_fn, swapping)
    assert torch.equal(plain, swapped)
    stats = swapping.stats()
    assert stats.offloaded_bytes > 0 and stats.device_bytes < stats.stored_bytes
    assert all(r.offloaded for r in stats.records if r.kind == COMPRESSED)


def test_swap_events_are_ordered_and_every_tensor_restored():
    model, x = mlp(), torch.randn(128, 64)
    compressor = act.ActivationCompressor(model, act.ACTConfig(opt_level="L2"))
    compressor.swap_store = SwapStore(record_events=True)
    flat_grad(model, lambda: model(x).sum(), compressor)
    events = compressor.swap_store.events
    swapped = {key for what, key in events if what == "swap_out"}
    assert swapped and {key for what, key in events if what == "use"} == swapped  # every tensor came back
    last_use: dict = {}
    for position, (what, key) in enumerate(events):
        if what != "use":
            continue
        # each use reads a copy brought in after the tensor was swapped out and after its previous use
        arrivals = [i for i, (w, k) in enumerate(events[:position]) if k == key and w in ("swap_in", "prefetch")]
        assert arrivals and arrivals[-1] > max(events.index(("swap_out", key)), last_use.get(key, -1))
        last_use[key] = position
    assert any(what == "prefetch" for what, _ in events)  # backward fetched ahead of use


def test_host_buffers_reused_across_steps_and_pool_bounded():
    model, x = mlp(), torch.randn(128, 64)
    pool = HostBufferPool(max_idle_bytes=1 << 20)
    compressor = act.ActivationCompressor(model, act.ACTConfig(opt_level="L2"))
    compressor.swap_store = SwapStore(pool)
    for _ in range(4):
        flat_grad(model, lambda: model(x).sum(), compressor)
        gc.collect()
        assert pool.idle_bytes <= pool.max_idle_bytes
    first_step_allocations = compressor.stats().count(COMPRESSED)
    assert pool.allocations == first_step_allocations  # steps 2-4 reused step 1's buffers
    assert pool.reuses == 3 * first_step_allocations


def test_pool_frees_beyond_its_bound():
    pool = HostBufferPool(max_idle_bytes=8192)
    buffers = [pool.acquire(5000) for _ in range(4)]  # 8 KiB size class
    for b in buffers:
        pool.release(b)
    assert pool.idle_bytes == 8192


# ---- CB1: checkpointing + compression ------------------------------------------------------------------------
class Segmented(nn.Module):
    def __init__(self, dropout=0.1):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(128, 128), nn.GELU(), nn.Dropout(dropout))
                                    for _ in range(3))
        self.head = nn.Linear(128, 1)

    def forward(self, x, use_checkpoint):
        for block in self.blocks:
            x = checkpoint(block, x) if use_checkpoint else block(x)
        return self.head(x).sum()


def test_checkpoint_without_compression_is_exact_even_with_dropout():
    model, x = Segmented(), torch.randn(64, 128, requires_grad=True)
    exact = flat_grad(model, lambda: model(x, False))
    for compressor in (None, act.ActivationCompressor(model, act.ACTConfig(opt_level="L0"))):
        assert torch.equal(exact, flat_grad(model, lambda: model(x, True), compressor))


def test_checkpoint_compresses_segment_inputs_and_recomputed_tensors():
    model, x = Segmented(dropout=0.0), torch.randn(64, 128)
    reference = flat_grad(model, lambda: model(x, False), act.ActivationCompressor(model, act.ACTConfig()))
    compressor = act.ActivationCompressor(model, act.ACTConfig(min_numel=0))
    grads = flat_grad(model, lambda: model(x, True), compressor)
    records = compressor.stats().records
    forward = [r for r in records if r.phase == "forward" and r.kind == COMPRESSED]
    recomputed = [r for r in records if r.phase == "recompute" and r.kind == COMPRESSED]
    # 3 segment inputs (+ the head's input); the GELU input of every recomputed block (the recomputed linear
    # inputs are the decompressed segment inputs, alive anyway during the recomputation: kept as they are)
    assert len(forward) >= 3 and len(recomputed) >= 3
    assert cosine(reference, grads) > 0.99


def _masked_attention(project: nn.Linear, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    q, k, v = project(h).chunk(3, dim=-1)
    return ((q @ k.transpose(-1, -2)).unsqueeze(1) + mask).softmax(-1) @ v.unsqueeze(1)


def _torch_checkpoint(function, *args):
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


def _torch_reentrant_checkpoint(function, *args):
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=True)


# fine settings of each codec: the recomputed attention of a random segment amplifies coarse ones' errors
@pytest.mark.parametrize("codec", [dict(codec="division", codec_options={"bits": 8}), dict(bits=8, adaptive=False),
                                   dict(codec="lorenzo", error_bound=1e-3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("fill", ["finfo.min", "-inf"])
@pytest.mark.parametrize("segment", [checkpoint, _torch_checkpoint, _torch_reentrant_checkpoint],
                         ids=["lightning_act", "torch", "torch-reentrant"])
def test_segment_inputs_without_gradient_are_kept_exact(codec, dtype, fill, segment):
    """An additive attention mask handed to a segment (0 and the dtype's most negative value, as HuggingFace builds
    it, or -inf) comes back as it was, in this package's checkpoint and PyTorch's (both kinds): under DIVISION
    its block means overflowed and every gradient was NaN (GPT-2 at CB2), under quantize a group holding -inf
    decoded to NaN. The hidden state, which carries a gradient, goes to the configured codec."""
    torch.manual_seed(0)
    project = nn.Linear(32, 96).to(dtype)
    x = torch.randn(4, 64, 32, dtype=dtype, requires_grad=True)
    value = torch.finfo(dtype).min if fill == "finfo.min" else float(fill)
    mask = torch.full((4, 1, 64, 64), value, dtype=dtype).triu(1)
    compressor = act.ActivationCompressor(project, act.ACTConfig(min_numel=0, **codec))
    with compressor.compress():
        h = x * 2  # an activation (a leaf requiring grad counts as a parameter)
        out = segment(_masked_attention, project, h, mask)  # a module before the tensors: positions matter
    out.float().square().sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(project.weight.grad).all()
    saved = {r.shape: r for r in compressor.stats().records if r.phase == "forward"}
    # on quantize's grid (its group ends exact: the mask's 0 and finfo.min) with the -inf masked at 1 bit
    assert saved[mask.shape].codec == "quantize" and 5 <= saved[mask.shape].bits < 10
    assert saved[h.shape].codec == compressor.config.codec
    expected = torch.autograd.grad(_masked_attention(project, x * 2, mask).float().square().sum(), x)[0]
    assert cosine(expected.flatten().float(), x.grad.flatten().float()) > 0.95
    # the tracker's wrappers are gone with the step
    assert vars(torch.utils.checkpoint._CheckpointFrame)["save_inputs"] is optrack.original(
        torch.utils.checkpoint._CheckpointFrame.save_inputs)
    assert "apply" not in vars(torch.utils.checkpoint.CheckpointFunction)


def test_gpt2_at_cb2_under_division_trains_on_finite_gradients():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=100, n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0,
                                  embd_pdrop=0, attn_pdrop=0)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 100, (4, 32), generator=torch.Generator().manual_seed(1))
    exact = flat_grad(model, lambda: model(input_ids=ids, labels=ids).loss)
    compressor = act.ActivationCompressor(model, act.ACTConfig(opt_level="CB2", codec="division", adaptive=False))
    grads = flat_grad(model, lambda: model(input_ids=ids, labels=ids).loss, compressor)
    assert torch.isfinite(grads).all() and cosine(exact, grads) > 0.8  # measured 0.86 (2-layer DIVISION)


def _bert(dropout=0.0, layers=2):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=500, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                                  intermediate_size=256, max_position_embeddings=128, hidden_dropout_prob=dropout,
                                  attention_probs_dropout_prob=dropout)
    model = transformers.BertForSequenceClassification(cfg).train()
    g = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(0, 500, (8, 48), generator=g), "labels": torch.randint(0, 2, (8,), generator=g)}
    return model, batch


def test_cb1_with_huggingface_gradient_checkpointing():
    model, batch = _bert()
    loss_fn = lambda: model(**batch).loss  # noqa: E731
    no_ckpt = flat_grad(model, loss_fn, act.ActivationCompressor(model, act.ACTConfig(bits=4)))
    # activation_checkpointing_enable from transformers 5.23; gradient_checkpointing_enable (its alias there) before
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    alone = act.ActivationCompressor(model, act.ACTConfig(opt_level="L0"))
    exact_ckpt = flat_grad(model, loss_fn, alone)
    compressed = act.ActivationCompressor(model, act.ACTConfig(bits=4))
    grads = flat_grad(model, loss_fn, compressed)
    stats = compressed.stats()
    assert sum(r.phase == "recompute" and r.kind == COMPRESSED for r in stats.records) >= 2 * 8
    assert stats.device_bytes < alone.stats().device_bytes / 4
    assert cosine(no_ckpt, grads) > 0.99 and cosine(exact_ckpt, grads) > 0.99
    # the user's checkpointing function is back after the step
    layer = model.bert.encoder.layer[0]
    assert layer.gradient_checkpointing and "lightning_act" not in repr(layer._gradient_checkpointing_func)


def test_cb1_level_checkpoints_hf_layers_for_the_step_only():
    model, batch = _bert()
    compressor = act.ActivationCompressor(model, act.ACTConfig(opt_level="CB1"))
    flat_grad(model, lambda: model(**batch).loss, compressor)
    assert any(r.phase == "recompute" for r in compressor.stats().records)
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def test_cb1_warns_when_nothing_to_checkpoint_at_the_users_line():
    model = mlp()
    compressor = act.ActivationCompressor(model, act.ACTConfig(opt_level="CB1"))
    with pytest.warns(UserWarning, match="has none; wrap segments with lightning_act.checkpoint") as w:
        line = inspect.currentframe().f_lineno + 1
        with compressor.compress():  # eight frames above the warning, through three context managers
            model(torch.randn(4, 64)).sum().backward()
    assert (w[0].filename, w[0].lineno) == (__file__, line)


# ---- CB2: chunked attention ----------------------------------------------------------------------------------
@pytest.mark.parametrize("seq", [64, 100, 1, 33])
@pytest.mark.parametrize("masked", [False, True])
def test_chunked_attention_matches_standard(seq, masked):
    torch.manual_seed(seq)
    q, k, v = (torch.randn(2, 3, seq, 16, requires_grad=True) for _ in range(3))
    mask = None
    if masked:
        mask = torch.zeros(2, 1, 1, seq)
        mask[0, ..., seq // 2 + 1:] = float("-inf")
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out = chunked_attention(q, k, v, mask, query_chunk=32, key_chunk=16)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_chunked_attention_rejects_bad_chunks():
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="query_chunk=0; expected an integer >= 1"):
        chunked_attention(q, q, q, query_chunk=0)


def test_cb2_bert_matches_eager_attention_and_restores_config():
    model, batch = _bert(layers=2)
    mask = torch.ones(8, 48, dtype=torch.long)
    mask[0, 30:] = 0
    eager = copy.deepcopy(model)
    eager.config._attn_implementation = "eager"
    expected = eager(input_ids=batch["input_ids"], attention_mask=mask).logits
    with use_chunked_attention(model) as switched:
        got = model(input_ids=batch["input_ids"], attention_mask=mask).logits
    assert switched == 1 and model.config._attn_implementation != "act_chunked"
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_cb2_level_trains_bert_with_compression():
    model, batch = _bert()
    exact = flat_grad(model, lambda: model(**batch).loss)
    compressor = act.ActivationCompressor(model, act.ACTConfig(opt_level="CB2"))
    grads = flat_grad(model, lambda: model(**batch).loss, compressor)
    assert cosine(exact, grads) > 0.98
    assert compressor.stats().num_compressed > 0
    assert model.config._attn_implementation != "act_chunked"


def test_checkpointable_layers_are_found_by_their_own_or_their_class_flag():
    """The layers ``use_compressed_checkpointing`` routes: a bool ``gradient_checkpointing`` on the instance (as
    BERT's encoder sets it) or on the class (HuggingFace's ``GradientCheckpointingLayer``); anything else is not
    one, a submodule of that name included."""
    class ClassFlag(nn.Module):
        gradient_checkpointing = False

    own = nn.Linear(1, 1)
    own.gradient_checkpointing = True
    named = nn.Module()
    named.gradient_checkpointing = nn.Linear(1, 1)
    counted = nn.Module()
    counted.gradient_checkpointing = 1
    assert _checkpointing_layer(own) and _checkpointing_layer(ClassFlag())
    assert not any(_checkpointing_layer(m) for m in (nn.Linear(1, 1), named, counted))
