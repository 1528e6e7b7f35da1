"""GACT levels side by side on a BERT from config: stored activation bytes, peak step memory, step time.

L0 (plain), L1 (4-bit), L2 (L1 + swap), swap alone (L0 + swap), checkpointing alone (L0 + CB1's
checkpointing), CB1, CB2, one after the other in one process; time ratios are medians of alternating runs
against L0. Then the peak memory of attention alone, standard vs chunked (CB2's), over sequence lengths.

Peak memory is the process's resident-set peak above its pre-step level (``benchmarks/peak_memory.py``); step
times come from a child process with glibc's own allocation thresholds (``peak_memory.timing_child``).
On this CPU-only machine swap copies host to host, so L2 frees no memory here; its bytes column shows
what would leave the device.

    python benchmarks/bench_levels.py [--batch 16] [--seq 256] [--repeats 3] [--out benchmarks/results/levels.md]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import lightning_act as act
from lightning_act.nn.attention import chunked_attention
from models import bert, machine, median_step_times, publish, train_step
from peak_memory import ensure_fixed_mmap_threshold, is_timing_child, peak_step_bytes, timing_child, write_timings

CONFIGS = {
    "L0": act.ACTConfig(opt_level="L0"),
    "L1": act.ACTConfig(opt_level="L1"),
    "L2": act.ACTConfig(opt_level="L2"),
    "swap only": act.ACTConfig(opt_level="L0", swap=True),
    "checkpointing only": act.ACTConfig(opt_level="L0", checkpointing=True),
    "CB1": act.ACTConfig(opt_level="CB1"),
    "CB2": act.ACTConfig(opt_level="CB2"),
}
PEAK_NOTE = ("Peak step MiB is the resident-set growth above the level before the step. L2 and swap only copy "
             "into pinned host buffers kept from earlier steps (reused, not reallocated), so the host copies are "
             "not in their peak: on a GPU this is the device memory the step needs. Time ratios: medians of the "
             "levels taking turns step by step in a child process with glibc's own allocation thresholds "
             "(`peak_memory.timing_child`), peaks after one warm-up step each.")


def attention_peaks(seqs, heads=4, dim=64):
    rows = []
    for seq in seqs:
        q, k, v = (torch.randn(1, heads, seq, dim, requires_grad=True) for _ in range(3))

        def standard():
            probs = torch.softmax(q @ k.transpose(-1, -2) / dim**0.5, dim=-1)
            (probs @ v).sum().backward()

        def chunked():
            chunked_attention(q, k, v, query_chunk=128, key_chunk=256).sum().backward()

        rows.append((seq, peak_step_bytes(standard) / 2**20, peak_step_bytes(chunked) / 2**20))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    ensure_fixed_mmap_threshold()  # a no-op in the timing child
    model, loss_fn = bert(args.batch, args.seq, attn_implementation="eager")
    compressors = {name: act.ActivationCompressor(model, cfg) for name, cfg in CONFIGS.items()}
    if is_timing_child():
        write_timings(median_step_times(model, loss_fn, compressors, args.repeats, warmup=1))
        return
    times = timing_child(__file__, sys.argv[1:] if argv is None else argv)
    lines = [f"BERT 4x256, batch {args.batch}, sequence {args.seq}\n",
             "| level | stored MiB (device) | stored MiB (host) | peak step MiB | time ratio vs L0 |",
             "|---|---|---|---|---|"]
    base = times["L0"]
    for name, c in compressors.items():
        train_step(model, loss_fn, c)  # warm-up: swap's pinned host buffers are made once, then reused
        peak = peak_step_bytes(lambda: train_step(model, loss_fn, c)) / 2**20
        s = c.stats()
        lines.append(f"| {name} | {s.device_bytes / 2**20:.1f} | {s.offloaded_bytes / 2**20:.1f} | {peak:.0f} | "
                     f"{times[name] / base:.2f} |")
    lines += ["", PEAK_NOTE, "", "Attention alone (1 x 4 heads x 64 dims, forward + backward): peak MiB",
              "| sequence | standard | chunked (CB2) |", "|---|---|---|"]
    lines += [f"| {s} | {a:.1f} | {b:.1f} |" for s, a, b in attention_peaks([512, 1024, 2048, 4096])]
    text = "\n".join(lines) + f"\n\n{machine()}; command: `python benchmarks/bench_levels.py`\n"
    publish(text, args.out)

if __name__ == "__main__":
    main()
