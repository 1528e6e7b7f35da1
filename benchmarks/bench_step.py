"""Activation bytes and step time with and without compression, measured side by side in one run.

For each model (a CNN on 64x64 images and a BERT built from a config, at batch sizes where activations
dominate) and each configuration, runs warm-up steps, then alternates plain and compressed training steps
(forward + backward) so both see the same machine state, and reports the median step time of each,
their ratio, and the bytes of saved activations without and with compression (from ``stats()``).

    python benchmarks/bench_step.py [--repeats 7] [--bits 2 4 8] [--out benchmarks/results/step.md]
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch
from torch import nn

import lightning_act as act


def cnn(batch: int):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 16 * 16, 10))
    x, y = torch.randn(batch, 3, 64, 64), torch.randint(0, 10, (batch,))
    return model, lambda: nn.functional.cross_entropy(model(x), y)


def bert(batch: int):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=2000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                     intermediate_size=1024, max_position_embeddings=256)
    model = BertForSequenceClassification(cfg).train()
    ids, labels = torch.randint(0, 2000, (batch, 128)), torch.randint(0, 2, (batch,))
    return model, lambda: model(input_ids=ids, labels=labels).loss


def step(model, loss_fn, compressor=None) -> float:
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    if compressor is None:
        loss = loss_fn()
    else:
        with compressor.compress():
            loss = loss_fn()
    loss.backward()
    return time.perf_counter() - t0


def measure(name, build, batch, bits_list, repeats):
    model, loss_fn = build(batch)
    compressors = {b: act.ActivationCompressor(model, act.ACTConfig(bits=b)) for b in bits_list}
    for _ in range(2):  # warm-up
        step(model, loss_fn)
        for c in compressors.values():
            step(model, loss_fn, c)
    times = {"plain": [], **{b: [] for b in bits_list}}
    for _ in range(repeats):
        times["plain"].append(step(model, loss_fn))
        for b, c in compressors.items():
            times[b].append(step(model, loss_fn, c))
    plain = statistics.median(times["plain"])
    rows = []
    for b, c in compressors.items():
        s = c.stats()
        rows.append((name, batch, f"{b}-bit", s.original_bytes / 2**20, s.stored_bytes / 2**20, s.ratio,
                     plain * 1e3, statistics.median(times[b]) * 1e3, statistics.median(times[b]) / plain))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--bits", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--out", type=Path, help="also write the markdown table here")
    args = parser.parse_args(argv)
    rows = measure("CNN 64x64", cnn, 32, args.bits, args.repeats)
    rows += measure("BERT 4x256 seq128", bert, 16, args.bits, args.repeats)
    header = ("| model | batch | config | saved MiB | stored MiB | ratio | plain ms | act ms | time ratio |\n"
              "|---|---|---|---|---|---|---|---|---|")
    lines = [header] + [f"| {m} | {b} | {c} | {o:.1f} | {s:.2f} | {r:.2f}x | {p:.0f} | {a:.0f} | {t:.2f} |"
                        for m, b, c, o, s, r, p, a, t in rows]
    machine = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    text = "\n".join(lines) + f"\n\nMedian of {args.repeats} alternating steps after warm-up; {machine}.\n" \
           "Command: `python benchmarks/bench_step.py`\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
