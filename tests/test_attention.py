"""Chunked attention (CB2): a FlashAttention-style autograd function; exact gradients, dropout regenerated in
backward, transients bounded by one chunk pair, masks kept exactly."""
import pytest
import torch
import torch.nn.functional as F

import lightning_act as act
from lightning_act.nn.attention import _ChunkedAttention, chunked_attention, default_chunks
from lightning_act.profiling import measure_step_memory

MiB = 2**20


@pytest.mark.parametrize("mask_kind", [None, "bool", "additive"])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_gradcheck_with_masks_and_dropout(mask_kind, dropout):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 7, 3, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = None
    if mask_kind == "bool":
        mask = torch.ones(2, 1, 1, 7, dtype=torch.bool)
        mask[0, ..., 4:] = False
    elif mask_kind == "additive":
        mask = torch.randn(2, 1, 7, 7, dtype=torch.float64)
    # a fixed seed: forward and backward of every call draw the same dropout noise
    fn = lambda q, k, v: _ChunkedAttention.apply(q, k, v, mask, None, 0.5, None, 3, 2, dropout, 1234)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_dropout_matches_a_reference_with_the_same_noise():
    """Forward and backward draw chunk pair (i, j)'s noise from seed + block: rebuild it and compare with
    standard attention using that noise."""
    from lightning_act.nn.attention import _dropout_noise
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 10, 4, requires_grad=True) for _ in range(3))
    qc, kc, p, seed = 4, 6, 0.25, 99
    out = _ChunkedAttention.apply(q, k, v, None, None, 0.5, None, qc, kc, p, seed)
    noise = torch.empty(2, 3, 10, 10)
    rows, cols = range(0, 10, qc), range(0, 10, kc)
    for i, r0 in enumerate(rows):
        for j, c0 in enumerate(cols):
            block = noise[..., r0:r0 + qc, c0:c0 + kc]
            block.copy_(_dropout_noise(block.shape, q.device, p, seed, i * len(cols) + j))
    q2, k2, v2 = (t.detach().requires_grad_() for t in (q, k, v))
    ref = (torch.softmax(q2 @ k2.transpose(-1, -2) * 0.5, -1) * noise) @ v2
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q2, k2, v2), g)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_fully_masked_rows_give_zero_and_finite_gradients():
    q, k, v = (torch.randn(1, 1, 4, 8, requires_grad=True) for _ in range(3))
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    mask[..., 2, :] = False
    out = chunked_attention(q, k, v, mask, query_chunk=2, key_chunk=2)
    assert (out[..., 2, :] == 0).all()
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("dtype, rows", [(torch.float32, 16), (torch.bfloat16, 8), (torch.float16, 8),
                                         (torch.float64, 16)])
def test_default_chunks_scores_take_a_quarter_of_the_query_bytes(dtype, rows):
    """float32 scores for 16-bit queries (half as many per query byte), float64 scores for float64 queries."""
    q, k = torch.empty(2, 4, 512, 64, dtype=dtype), torch.empty(2, 4, 512, 64, dtype=dtype)
    qc, kc = default_chunks(q, k)
    score_bytes = 8 if dtype == torch.float64 else 4
    assert (qc, kc) == (rows, 512) and qc * kc * score_bytes * 4 <= 512 * 64 * q.element_size()
    assert default_chunks(torch.empty(1, 1, 8192, 64, dtype=dtype), torch.empty(1, 1, 8192, 64)) == (rows * 8, 1024)
    assert default_chunks(torch.empty(1, 1, 3, 2, dtype=dtype), torch.empty(1, 1, 5, 2)) == (1, 5)


def test_forward_and_backward_hold_a_few_chunk_pairs_at_most():
    """Before (chunks checkpointed with lightning_act.checkpoint, query_chunk 128, key_chunk 512): 67.1 MiB here,
    the recomputation's amax and exp backward holding several (8 x 4 x 128 x 512) score blocks."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(8, 4, 512, 64, requires_grad=True) for _ in range(3))  # 4 MiB each
    grad = torch.ones(8, 4, 512, 64)

    def step():
        chunked_attention(q, k, v, dropout=0.1, training=True).backward(grad)

    step()
    for t in (q, k, v):
        t.grad = None
    peak = measure_step_memory(step).peak_bytes
    # output + q, k, v gradients (16 MiB), and in backward the float32 accumulators of dk and dv (their own
    # gradients here) plus 3 chunk pairs of 1 MiB (probabilities, dropped probabilities, dP)
    assert peak <= 16 * MiB + 4 * MiB, f"{peak / MiB:.1f} MiB"  # 19.3 measured (32.7 with chunk pairs of 4 MiB)


def test_bf16_backward_holds_no_float32_copy_of_a_gradient_and_matches_float64():
    """bf16 inputs decoded afresh in the backward (as a compressor's are): dk and dv accumulate in float32 without
    a bf16 product of their size and its float32 cast beside them (one key chunk spans every key here), and the
    decoded inputs are freed before the accumulators are cast."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(8, 4, 512, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))  # 2 MiB
    grad = torch.randn(8, 4, 512, 64, dtype=torch.bfloat16)

    def forward():
        with torch.autograd.graph.saved_tensors_hooks(torch.clone, torch.clone):
            return chunked_attention(q, k, v)

    forward().backward(grad)
    out = forward()
    for t in (q, k, v):
        t.grad = None
    peak = measure_step_memory(lambda: out.backward(grad)).peak_bytes
    # decoded q, k, v (6 MiB), dq (2), dk and dv in float32 (8), their bf16 casts, chunk pairs of 0.5 MiB
    assert peak <= 20 * MiB, f"{peak / MiB:.1f} MiB"  # 17.8 measured (23.7 with the product and its cast)
    reference = [t.detach().double().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*reference).backward(grad.double())
    for t, r in zip((q, k, v), reference):
        assert t.grad.dtype == torch.bfloat16
        assert (t.grad.double() - r.grad).abs().max() <= 2e-2 * r.grad.abs().max()  # 0.9-1.1% measured (SDPA in
        # bf16: 0.4-0.9%)


def test_cb2_bert_with_padding_trains_with_finite_gradients():
    """The padding mask stays exact (kept by the function, not saved through the compressor): quantized, its
    large negatives broke the gradients (NaN)."""
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(0)
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    model = BertForSequenceClassification(config)
    ids, labels = torch.randint(0, 100, (4, 48)), torch.randint(0, 2, (4,))
    mask = torch.ones(4, 48, dtype=torch.long)
    mask[0, 30:] = 0

    def grads(compressor=None):
        model.zero_grad()
        with compressor.compress() if compressor else torch.enable_grad():
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    exact = grads()
    compressed = grads(act.ActivationCompressor(model, act.ACTConfig(opt_level="CB2", bits=8, adaptive=False)))
    assert torch.isfinite(compressed).all()
    assert F.cosine_similarity(exact, compressed, dim=0) > 0.99


@pytest.mark.parametrize("bias_shape", [(1, 2, 7, 9), (2, 2, 7, 9), (2, 7, 1), (1, 1, 1, 9)],
                         ids=["heads", "batch and heads", "rows", "keys"])
@pytest.mark.parametrize("softcap", [None, 1.5])
def test_a_bias_gets_its_gradient_and_a_softcap_caps_the_scores(bias_shape, softcap):
    """``softmax(softcap * tanh(q k^T * scale / softcap) + bias + mask) v``: values as a plain reference, and
    gradcheck through q, k, v and the bias (T5's relative position bias is learnt through it)."""
    torch.manual_seed(0)
    q = torch.randn(2, 2, 7, 3, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 9, 3, dtype=torch.float64, requires_grad=True) for _ in range(2))
    bias = torch.randn(bias_shape, dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(2, 1, 7, 9, dtype=torch.float64)
    mask[0, ..., -3:] = torch.finfo(torch.float64).min

    def reference(q, k, v, bias):
        s = q @ k.transpose(-1, -2) * 1.3
        s = softcap * torch.tanh(s / softcap) if softcap else s
        return torch.softmax(s + bias + mask, -1) @ v

    def chunked(q, k, v, bias):
        return chunked_attention(q, k, v, mask, scale=1.3, query_chunk=3, key_chunk=4, bias=bias, softcap=softcap)

    torch.testing.assert_close(chunked(q, k, v, bias), reference(q, k, v, bias))
    assert torch.autograd.gradcheck(chunked, (q, k, v, bias))


def test_softcap_must_be_positive():
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="softcap=0; expected a finite number > 0"):
        chunked_attention(q, q, q, softcap=0)


def _hf_seq2seq_pair(make_model):
    """Loss and gradients of a transformers model (train mode, no dropout) with its own attention and under CB2's
    chunked attention (no codec: only the attention differs)."""
    torch.manual_seed(0)
    model = make_model()
    ids = torch.randint(3, 100, (2, 12))
    ids[:, -1] = 1
    labels = torch.tensor([1, 3])

    def step(config):
        model.zero_grad()
        compressor = act.ActivationCompressor(model, config)
        with compressor.compress():
            loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    return step(act.ACTConfig(opt_level="L0")), step(act.ACTConfig(opt_level="CB2", codec="none"))


def test_cb2_t5_keeps_its_relative_position_bias():
    """T5 passes ``position_bias`` to the attention interface: the chunked attention ignored it (the loss changed:
    1.7823 against 1.7749) and its relative_attention_bias got no gradient."""
    transformers = pytest.importorskip("transformers")
    (loss, grads), (cb2_loss, cb2_grads) = _hf_seq2seq_pair(lambda: transformers.T5ForSequenceClassification(
        transformers.T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1,
                              num_heads=4, num_labels=4, pad_token_id=0, decoder_start_token_id=0, dropout_rate=0.0)))
    torch.testing.assert_close(cb2_loss, loss)
    bias = [n for n in grads if "relative_attention_bias" in n]
    assert bias and set(cb2_grads) == set(grads)
    for name in grads:
        torch.testing.assert_close(cb2_grads[name], grads[name], rtol=1e-4, atol=1e-6)


def test_cb2_gemma2_caps_its_attention_logits():
    """Gemma 2 passes ``softcap``: ignored, the scores of large logits went uncapped. Its own eager attention is the
    reference (transformers 5.0 defaulted Gemma 2 to SDPA, which ignored the cap too)."""
    transformers = pytest.importorskip("transformers")

    def gemma2(cap: float | None):
        def make():
            model = transformers.Gemma2ForSequenceClassification(transformers.Gemma2Config(
                vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, intermediate_size=64, num_labels=4, pad_token_id=0, attn_logit_softcapping=cap))
            model.config._attn_implementation = "eager"
            with torch.no_grad():  # logits far past the cap
                for layer in model.model.layers:
                    layer.self_attn.q_proj.weight.mul_(40)
                    layer.self_attn.k_proj.weight.mul_(40)
            return model
        return make

    (loss, grads), (cb2_loss, cb2_grads) = _hf_seq2seq_pair(gemma2(2.0))
    (uncapped, _), _ = _hf_seq2seq_pair(gemma2(None))
    assert abs(float(uncapped - loss)) > 1e-2  # the cap matters here
    torch.testing.assert_close(cb2_loss, loss, rtol=1e-4, atol=1e-6)  # saturated tanh: float32 sums in other orders
    for name in grads:
        torch.testing.assert_close(cb2_grads[name], grads[name], rtol=1e-4, atol=1e-6)


def test_attention_sinks_are_refused_by_name():
    from lightning_act.nn.attention import transformers_attention_forward
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="Linear passes s_aux \\(attention sinks\\), which the chunked attention"):
        transformers_attention_forward(torch.nn.Linear(1, 1), q, q, q, None, s_aux=torch.zeros(2))
