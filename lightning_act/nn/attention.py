"""Memory-efficient self-attention (Rabe & Staats, 2021), GACT's CB2 ingredient.

Queries are processed in chunks of ``query_chunk``; within a chunk, keys and values in chunks of
``key_chunk`` with a running max and log-sum-exp, so no (queries x keys) matrix larger than one chunk pair
exists. Each query chunk runs inside :func:`lightning_act.checkpoint.checkpoint`: backward recomputes it,
and what it saves (inputs and recomputed tensors) goes through the active compressor. Memory is linear in
the sequence length for fixed chunk sizes.

``register_with_transformers()`` adds it to transformers' attention registry as ``"act_chunked"``, so a
model built with ``attn_implementation="act_chunked"`` (or ``model.set_attn_implementation``) uses it.
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch

from .._validate import check_int
from ..checkpoint import checkpoint

ATTENTION_NAME = "act_chunked"


def _attend_query_chunk(q, k, v, mask, scale: float, key_chunk: int, dropout: float, training: bool):
    """Attention of one query chunk over all keys, key chunk by key chunk with a running log-sum-exp."""
    acc = torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=torch.float32, device=q.device)
    running_max = torch.full(q.shape[:-1] + (1,), float("-inf"), dtype=torch.float32, device=q.device)
    running_sum = torch.zeros_like(running_max)
    for k0 in range(0, k.shape[-2], key_chunk):
        scores = torch.matmul(q, k[..., k0:k0 + key_chunk, :].transpose(-1, -2)).float() * scale
        if mask is not None:
            scores = scores + mask[..., k0:k0 + key_chunk].float()
        new_max = torch.maximum(running_max, scores.amax(dim=-1, keepdim=True))
        # a fully masked row so far keeps max -inf: shift by 0 there instead of producing NaN
        safe_max = torch.where(torch.isfinite(new_max), new_max, torch.zeros_like(new_max))
        correction = torch.exp(running_max - safe_max)
        weights = torch.exp(scores - safe_max)
        running_sum = running_sum * correction + weights.sum(dim=-1, keepdim=True)
        if dropout > 0 and training:
            weights = torch.nn.functional.dropout(weights, dropout, training=True)
        acc = acc * correction + torch.matmul(weights.to(v.dtype), v[..., k0:k0 + key_chunk, :]).float()
        running_max = new_max
    return (acc / running_sum).to(q.dtype)


def chunked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None = None, scale: float | None = None,
                      query_chunk: int = 128, key_chunk: int = 512, dropout: float = 0.0,
                      training: bool = False) -> torch.Tensor:
    """``softmax(q k^T * scale + mask) v`` for ``(..., seq, dim)`` tensors, with memory linear in ``seq``.

    ``attention_mask`` is additive and broadcastable to ``(..., q_seq, k_seq)``; ``key``/``value`` may have
    fewer heads than ``query`` (grouped-query attention) when dim -3 divides.
    """
    check_int("query_chunk", query_chunk, minimum=1)
    check_int("key_chunk", key_chunk, minimum=1)
    if query.dim() >= 3 and key.shape[-3] != query.shape[-3]:
        if query.shape[-3] % key.shape[-3]:
            raise ValueError(f"query has {query.shape[-3]} heads and key {key.shape[-3]}; expected a divisor")
        groups = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(groups, dim=-3), value.repeat_interleave(groups, dim=-3)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~attention_mask, float("-inf"))
    outputs = []
    for q0 in range(0, query.shape[-2], query_chunk):
        q = query[..., q0:q0 + query_chunk, :]
        mask = None
        if attention_mask is not None:
            mask = attention_mask if attention_mask.shape[-2] == 1 else attention_mask[..., q0:q0 + query_chunk, :]
        outputs.append(checkpoint(_attend_query_chunk, q, key, value, mask, scale, key_chunk, dropout, training))
    return torch.cat(outputs, dim=-2)


def transformers_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                                   scaling: float | None = None, **kwargs):
    """transformers' attention-interface signature: (batch, heads, seq, dim) in, (batch, seq, heads, dim) out."""
    out = chunked_attention(query, key, value, attention_mask, scale=scaling,
                            query_chunk=kwargs.get("query_chunk", 128), key_chunk=kwargs.get("key_chunk", 512),
                            dropout=dropout, training=module.training)
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
