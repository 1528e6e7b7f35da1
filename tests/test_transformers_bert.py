"""GACT's fixed-4-bit BERT point: ratio >= 7 and gradients close to the exact ones (random init, no download)."""
import pytest
import torch

import lightning_act as act

transformers = pytest.importorskip("transformers")


def _bert(dropout: float):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                                  intermediate_size=512, max_position_embeddings=128,
                                  hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    model = transformers.BertForSequenceClassification(cfg).train()
    g = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(0, 1000, (16, 64), generator=g),
             "labels": torch.randint(0, 2, (16,), generator=g)}
    return model, batch


def _flat_grad(model, batch, compressor=None) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    if compressor is None:
        loss = model(**batch).loss
    else:
        with compressor.compress():
            loss = model(**batch).loss
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_bert_fixed_4_bit_ratio_and_gradient_cosine():
    model, batch = _bert(dropout=0.0)
    exact = _flat_grad(model, batch)
    compressor = act.ActivationCompressor(model, act.ACTConfig(bits=4))
    approx = _flat_grad(model, batch, compressor)
    cosine = torch.nn.functional.cosine_similarity(exact, approx, dim=0).item()
    assert cosine >= 0.97
    assert compressor.stats().ratio >= 7.0


def test_bert_with_dropout_ratio():
    model, batch = _bert(dropout=0.1)
    compressor = act.ActivationCompressor(model, act.ACTConfig(bits=4))
    _flat_grad(model, batch, compressor)
    assert compressor.stats().ratio >= 7.0


def test_bert_8_bit_gradients_nearly_exact():
    model, batch = _bert(dropout=0.0)
    exact = _flat_grad(model, batch)
    approx = _flat_grad(model, batch, act.ActivationCompressor(model, act.ACTConfig(bits=8)))
    assert torch.nn.functional.cosine_similarity(exact, approx, dim=0).item() >= 0.9999
