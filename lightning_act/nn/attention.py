"""Memory-efficient self-attention (Rabe & Staats, 2021; the FlashAttention-2 backward), GACT's CB2 ingredient.

Queries are processed in chunks, and within a chunk keys and values in chunks, with a running max and
log-sum-exp, so no (queries x keys) matrix larger than one chunk pair exists. The autograd function saves
q, k, v and the output (through the active compressor, like any saved activation) and keeps the per-row
log-sum-exp and the mask exactly; its backward recomputes each chunk pair's probabilities from them
(``dS = P * (dP - rowsum(dO * O))``) and accumulates dq, dk, dv. Dropout masks are drawn per chunk pair from
a seed, so backward regenerates them instead of storing them. Memory is linear in the sequence length:
besides its inputs, outputs and gradients, forward and backward hold a few chunk pairs at a time.

Chunk sizes: by default a chunk pair's scores (float32, float64 for float64 inputs) take a quarter of ``query``'s
bytes (``key_chunk`` up to 1024 keys, ``query_chunk`` the rows that fill that share), so attention's transients
(the backward holds three chunk pairs: probabilities, dropped probabilities and their gradient) are below the size
of the activations around it, whatever the sequence length or dtype.

``register_with_transformers()`` adds it to transformers' attention registry as ``"act_chunked"``, so a
model built with ``attn_implementation="act_chunked"`` (or ``model.set_attn_implementation``) uses it.
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch

from .._validate import check_int, check_positive_float

ATTENTION_NAME = "act_chunked"
MAX_KEY_CHUNK = 1024
SCORE_SHARE = 4  # a chunk pair's scores take 1 / SCORE_SHARE of query's bytes


def default_chunks(query: torch.Tensor, key: torch.Tensor) -> tuple[int, int]:
    """``(query_chunk, key_chunk)`` whose chunk pair of scores (in :func:`_acc_dtype`) takes at most a quarter of
    ``query``'s bytes (one row of scores at least)."""
    key_chunk = max(1, min(key.shape[-2], MAX_KEY_CHUNK))
    score_size = torch.finfo(_acc_dtype(query.dtype)).bits // 8
    scores = query.shape[-2] * query.shape[-1] * query.element_size() // (SCORE_SHARE * score_size)
    query_chunk = max(1, min(query.shape[-2], scores // key_chunk))
    return query_chunk, key_chunk


def _spans(n: int, chunk: int) -> list[tuple[int, int]]:
    return [(start, min(n, start + chunk)) for start in range(0, n, chunk)]


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """What scores, probabilities and gradient sums are computed in: float32, float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float, bias: torch.Tensor | None,
            softcap: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``softcap * tanh(q k^T * scale / softcap) + bias`` in float32 (float64 inputs: float64), the mask applied
    (additive, or bool: False -> -inf); and the tanh (None without a softcap), whose derivative the backward needs."""
    s = torch.matmul(q, k.transpose(-1, -2)).to(_acc_dtype(q.dtype)).mul_(scale)
    capped = None
    if softcap is not None:
        capped = s.div_(softcap).tanh_()
        s = capped.mul(softcap)
    if bias is not None:
        s.add_(bias)
    if mask is None:
        return s, capped
    if mask.dtype == torch.bool:
        return s.masked_fill_(~mask, float("-inf")), capped
    return s.add_(mask), capped


def _score_chunk(scores: torch.Tensor | None, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor | None:
    """The part of a tensor broadcast to the scores (a mask, a bias, the bias's gradient) that chunk pair
    (r0:r1, c0:c1) reads: its rows and keys, where they are not broadcast."""
    if scores is None:
        return None
    rows = scores if scores.shape[-2] == 1 else scores[..., r0:r1, :]
    return rows if rows.shape[-1] == 1 else rows[..., c0:c1]


def _dropout_noise(shape, device, dropout: float, seed: int, block: int) -> torch.Tensor:
    """The dropout noise (0 or 1/(1-p)) of chunk pair ``block``: the same in forward and backward."""
    generator = torch.Generator(device=device)
    generator.manual_seed((seed + block) % (1 << 63))
    noise = torch.empty(shape, device=device).bernoulli_(1.0 - dropout, generator=generator)
    return noise.div_(1.0 - dropout)


class _ChunkedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, mask, bias, scale, softcap, query_chunk, key_chunk, dropout, seed):
        options = (scale, softcap, query_chunk, key_chunk, dropout, seed)
        with torch.autocast(query.device.type, enabled=False):
            out, lse = _attention_forward(query, key, value, mask, bias, *options)
        ctx.save_for_backward(query, key, value, out)  # through the compressor, as every saved activation
        # kept exactly: the log-sum-exp sets every probability's scale (1/head_dim of q's size), an additive mask
        # holds large negatives that a lossy codec must not touch, and a bias (T5's relative positions) is a logit
        ctx.lse, ctx.mask, ctx.bias = lse, mask, bias
        ctx.options = options
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out = ctx.saved_tensors  # each decoded once
        dtypes = query.dtype, key.dtype, value.dtype
        bias = ctx.bias
        scale, _, query_chunk, *_ = ctx.options
        with torch.autocast(query.device.type, enabled=False):
            delta = _row_delta(out, grad_out.to(query.dtype), query_chunk)
            del out  # the decoded output serves only rowsum(dO * O)
            dq, dk, dv, dbias = _attention_backward(query, key, value, delta, ctx.lse, ctx.mask, bias, grad_out,
                                                    *ctx.options, bias_grad=ctx.needs_input_grad[4])
        # the decoded inputs go before the accumulators are cast, each accumulator as soon as it is (bf16 / fp16:
        # float32 dk and dv are twice the size of the gradients they become)
        del query, key, value
        dk = dk.mul_(scale).to(dtypes[1])
        dv = dv.to(dtypes[2])
        dbias = dbias.to(bias.dtype) if dbias is not None else None
        return dq, dk, dv, None, dbias, None, None, None, None, None, None


def _attention_forward(q, k, v, mask, bias, scale, softcap, query_chunk, key_chunk, dropout, seed):
    acc_dtype = _acc_dtype(q.dtype)
    out = torch.empty(q.shape[:-1] + v.shape[-1:], dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=acc_dtype, device=q.device)
    key_spans = _spans(k.shape[-2], key_chunk)
    for i, (r0, r1) in enumerate(_spans(q.shape[-2], query_chunk)):
        q_c = q[..., r0:r1, :]
        acc = torch.zeros(q_c.shape[:-1] + v.shape[-1:], dtype=acc_dtype, device=q.device)
        running_max = torch.full(q_c.shape[:-1] + (1,), float("-inf"), dtype=acc_dtype, device=q.device)
        running_sum = torch.zeros_like(running_max)
        for j, (c0, c1) in enumerate(key_spans):
            s, _ = _scores(q_c, k[..., c0:c1, :], _score_chunk(mask, r0, r1, c0, c1), scale,
                           _score_chunk(bias, r0, r1, c0, c1), softcap)
            new_max = torch.maximum(running_max, s.amax(dim=-1, keepdim=True))
            # a row masked so far keeps max -inf: shift by 0 there instead of producing NaN
            safe_max = torch.where(torch.isfinite(new_max), new_max, torch.zeros_like(new_max))
            correction = torch.exp(running_max - safe_max)
            p = s.sub_(safe_max).exp_()
            running_sum = running_sum * correction + p.sum(dim=-1, keepdim=True)
            if dropout > 0:
                p.mul_(_dropout_noise(p.shape, p.device, dropout, seed, i * len(key_spans) + j))
            acc = acc * correction + torch.matmul(p.to(v.dtype), v[..., c0:c1, :]).to(acc_dtype)
            running_max = new_max
            del s, p
        safe_max = torch.where(torch.isfinite(running_max), running_max, torch.zeros_like(running_max))
        # a fully masked row attends to nothing: output 0 (as SDPA's safe softmax), log-sum-exp -inf
        out[..., r0:r1, :] = torch.where(running_sum > 0, acc / running_sum, 0.0).to(q.dtype)
        lse[..., r0:r1] = (safe_max + running_sum.log()).squeeze(-1)
    return out, lse


def _accumulate_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b``: in place by a batched addmm when the dtypes agree (no product of ``acc``'s size is
    allocated), else through the product in ``b``'s dtype. A 16-bit ``b`` no larger than ``acc`` (a chunk of q or
    dO against dk or dv, which span all keys of a key chunk) is cast up instead: the product, and its cast, would
    be the size of ``acc`` (in bf16 / fp16, the backward's largest transients)."""
    if a.dtype == acc.dtype != b.dtype and b.numel() <= acc.numel():
        b = b.to(acc.dtype)
    if a.dtype == b.dtype == acc.dtype:
        try:
            acc3 = acc.view(-1, *acc.shape[-2:])  # a view or an error, never a copy written in vain
            acc3.baddbmm_(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]))
            return
        except RuntimeError:
            pass
    acc += torch.matmul(a.to(b.dtype), b).to(acc.dtype)


def _row_delta(out: torch.Tensor, grad_out: torch.Tensor, query_chunk: int) -> torch.Tensor:
    """``rowsum(dO * O)`` (the softmax backward's per-row term), chunk by chunk."""
    acc_dtype = _acc_dtype(out.dtype)
    delta = torch.empty(out.shape[:-1] + (1,), dtype=acc_dtype, device=out.device)
    for r0, r1 in _spans(out.shape[-2], query_chunk):
        delta[..., r0:r1, :] = (grad_out[..., r0:r1, :].to(acc_dtype) * out[..., r0:r1, :]).sum(-1, keepdim=True)
    return delta


def _attention_backward(q, k, v, delta, lse, mask, bias, grad_out, scale, softcap, query_chunk, key_chunk, dropout,
                        seed, bias_grad: bool = False):
    """``(dq, dk / scale, dv, dbias)``: dq in q's dtype, dk, dv and the bias's gradient (``bias_grad``, else None)
    as accumulated (float32; float64 for float64)."""
    acc_dtype = _acc_dtype(q.dtype)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc_dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc_dtype, device=v.device)
    dbias = torch.zeros(bias.shape, dtype=acc_dtype, device=bias.device) if bias_grad else None
    grad_out = grad_out.to(q.dtype)
    # rows attending to nothing (log-sum-exp -inf) get probabilities exp(s - inf) = 0, not NaN
    lse = torch.where(torch.isfinite(lse), lse, float("inf")).unsqueeze(-1)
    key_spans = _spans(k.shape[-2], key_chunk)
    for i, (r0, r1) in enumerate(_spans(q.shape[-2], query_chunk)):
        q_c, do_c, delta_c = q[..., r0:r1, :], grad_out[..., r0:r1, :], delta[..., r0:r1, :]
        dq_c = torch.zeros(q_c.shape, dtype=acc_dtype, device=q.device)
        for j, (c0, c1) in enumerate(key_spans):
            k_c, v_c = k[..., c0:c1, :], v[..., c0:c1, :]
            p, capped = _scores(q_c, k_c, _score_chunk(mask, r0, r1, c0, c1), scale, _score_chunk(bias, r0, r1, c0, c1),
                                softcap)
            p = p.sub_(lse[..., r0:r1, :]).exp_()
            dp = torch.matmul(do_c, v_c.transpose(-1, -2)).to(acc_dtype)
            if dropout > 0:  # the dropped probabilities P * noise; dS = P * (dP * noise - delta)
                dropped = _dropout_noise(p.shape, p.device, dropout, seed, i * len(key_spans) + j).mul_(p)
                _accumulate_(dv[..., c0:c1, :], dropped.transpose(-1, -2), do_c)
                ds = dp.mul_(dropped).sub_(p.mul_(delta_c))
                del dropped
            else:  # dS = P * (dP - delta)
                _accumulate_(dv[..., c0:c1, :], p.transpose(-1, -2), do_c)
                ds = dp.sub_(delta_c).mul_(p)
            del p
            if dbias is not None:  # the bias's gradient is the scores', summed where the bias broadcasts
                part = _score_chunk(dbias, r0, r1, c0, c1)
                part += ds.sum_to_size(part.shape)
            if capped is not None:  # through softcap * tanh(s / softcap): times 1 - tanh^2
                ds = ds.mul_(capped.square_().neg_().add_(1))
            del capped
            _accumulate_(dq_c, ds, k_c)
            _accumulate_(dk[..., c0:c1, :], ds.transpose(-1, -2), q_c)
            del ds, dp
        dq[..., r0:r1, :] = dq_c.mul_(scale).to(q.dtype)
    return dq, dk, dv, dbias  # dk unscaled, dk, dv and dbias in the accumulation dtype: the caller casts them


def chunked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None = None, scale: float | None = None,
                      query_chunk: int | None = None, key_chunk: int | None = None, dropout: float = 0.0,
                      training: bool = False, bias: torch.Tensor | None = None,
                      softcap: float | None = None) -> torch.Tensor:
    """``softmax(softcap * tanh(q k^T * scale / softcap) + bias + mask) v`` for ``(..., seq, dim)`` tensors, with
    memory linear in ``seq``.

    ``attention_mask`` is additive (float) or boolean (True: attend) and broadcastable to ``(..., q_seq, k_seq)``;
    it gets no gradient. ``bias`` is an additive float logit that gets one (T5's relative position bias), broadcast
    alike. ``softcap`` caps the scores (Gemma 2's logit soft-capping; None: none). ``key``/``value`` may have fewer
    heads than ``query`` (grouped-query attention) when dim -3 divides. ``query_chunk``/``key_chunk``: rows and keys
    per chunk (default: :func:`default_chunks`). A row whose keys are all masked out gives 0.
    """
    if query.dim() >= 3 and key.shape[-3] != query.shape[-3]:
        if query.shape[-3] % key.shape[-3]:
            raise ValueError(f"query has {query.shape[-3]} heads and key {key.shape[-3]}; expected a divisor")
        groups = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(groups, dim=-3), value.repeat_interleave(groups, dim=-3)
    auto_q, auto_k = default_chunks(query, key)
    query_chunk = auto_q if query_chunk is None else query_chunk
    key_chunk = auto_k if key_chunk is None else key_chunk
    check_int("query_chunk", query_chunk, minimum=1)
    check_int("key_chunk", key_chunk, minimum=1)
    if softcap is not None:
        check_positive_float("softcap", softcap)
        softcap = float(softcap)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    dropout = float(dropout) if training else 0.0
    seed = int(torch.randint(0, 1 << 62, (1,)).item()) if dropout > 0 else 0  # CPU generator: no device sync
    if attention_mask is not None:
        attention_mask = attention_mask.detach()  # added chunk by chunk in the scores' dtype: never copied
    return _ChunkedAttention.apply(query, key, value, attention_mask, bias, scale, softcap, query_chunk, key_chunk,
                                   dropout, seed)


# what a transformers model may pass the attention interface that changes the result and this function cannot do
_UNSUPPORTED = ("s_aux", "sinks")


def transformers_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                                   scaling: float | None = None, position_bias: torch.Tensor | None = None,
                                   softcap: float | None = None, **kwargs):
    """transformers' attention-interface signature: (batch, heads, seq, dim) in, (batch, seq, heads, dim) out.
    T5's ``position_bias`` and Gemma 2's ``softcap`` are applied (they were ignored: a T5 trained on other logits);
    attention sinks are refused."""
    unsupported = [name for name in _UNSUPPORTED if kwargs.get(name) is not None]
    if unsupported:
        raise ValueError(f"{type(module).__name__} passes {', '.join(unsupported)} (attention sinks), which the "
                         "chunked attention of efficient_attention=True (opt_level='CB2') does not compute; use "
                         "opt_level='CB1' or efficient_attention=False")
    out = chunked_attention(query, key, value, attention_mask, scale=scaling, query_chunk=kwargs.get("query_chunk"),
                            key_chunk=kwargs.get("key_chunk"), dropout=dropout, training=module.training,
                            bias=position_bias, softcap=softcap)
    return out.transpose(1, 2).contiguous(), None


def register_with_transformers() -> str:
    """Register ``"act_chunked"`` in transformers' attention registry; returns the name."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask
    except ImportError as err:
        raise ImportError("chunked attention for transformers needs it: pip install 'lightning-act[hf]'") from err
    AttentionInterface.register(ATTENTION_NAME, transformers_attention_forward)
    # the additive float mask eager attention uses (large negative, never -inf: no NaN on fully masked rows)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, eager_mask)
    return ATTENTION_NAME


@contextlib.contextmanager
def use_chunked_attention(model: torch.nn.Module) -> Iterator[int]:
    """Make the HuggingFace models inside ``model`` attend with ``"act_chunked"`` for the duration.

    transformers reads ``config._attn_implementation`` at every forward, so switching it on the configs and
    putting it back afterwards is enough. Yields how many configs were switched (0 for non-HF models).
    """
    configs = {id(m.config): m.config for m in model.modules()
               if hasattr(getattr(m, "config", None), "_attn_implementation")}
    if configs:
        register_with_transformers()
    previous = {key: cfg._attn_implementation for key, cfg in configs.items()}
    try:
        for cfg in configs.values():
            cfg._attn_implementation = ATTENTION_NAME
        yield len(configs)
    finally:
        for key, cfg in configs.items():
            cfg._attn_implementation = previous[key]
