"""Activation bytes and step time with and without compression, measured side by side in one run.

For each model (a CNN on 64x64 images and a BERT built from a config, at batch sizes where activations
dominate) and each configuration, runs warm-up steps, then alternates plain and compressed training steps
(forward + backward) so both see the same machine state, and reports the median step time of each,
their ratio, and the bytes of saved activations without and with compression (from ``stats()``).

    python benchmarks/bench_step.py [--repeats 7] [--bits 2 4 8] [--out benchmarks/results/step.md]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import lightning_act as act
from models import bert, cnn, machine, median_step_times, publish


def measure(name, build, batch, bits_list, repeats):
    model, loss_fn = build(batch)
    compressors = {b: act.ActivationCompressor(model, act.ACTConfig(bits=b, adaptive=False)) for b in bits_list}
    times = median_step_times(model, loss_fn, {"plain": None, **compressors}, repeats)
    rows = []
    for b, c in compressors.items():
        s = c.stats()
        rows.append((name, batch, f"{b}-bit", s.original_bytes / 2**20, s.stored_bytes / 2**20, s.ratio,
                     times["plain"] * 1e3, times[b] * 1e3, times[b] / times["plain"]))
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
    text = "\n".join(lines) + f"\n\nMedian of {args.repeats} alternating steps after warm-up; {machine()}.\n" \
           "Command: `python benchmarks/bench_step.py`\n"
    publish(text, args.out)

if __name__ == "__main__":
    main()
