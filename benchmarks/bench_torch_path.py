"""The pure-torch codec path (what a CPU user, or a GPU user without CuPy, runs): encode and decode bandwidth
in GB/s of input tensor, next to ``torch.clone`` of the same tensor (this machine's copy bandwidth).

A ReLU'd Gaussian activation (default 16 x 256 x 56 x 56, a ResNet stage-1 map at batch 16) in float32 and
bfloat16; ``quantize`` at 1, 2, 4, 8 bits and ``division`` (B=8, Q=2), ``backend="torch"``; median of the
repeats after one warm-up call, every timing on the same tensor.

    python benchmarks/bench_torch_path.py [--shape 16 256 56 56] [--repeats 5] [--threads N]
                                          [--out benchmarks/results/torch_path.md]
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import lightning_act as act
from models import MachineLoad, machine, publish

HERE = Path(__file__).resolve().parent
CODECS = {**{f"quantize {b}-bit": ("quantize", {"bits": b}) for b in (1, 2, 4, 8)}, "division": ("division", {})}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TITLE = "Torch path encode/decode GB/s and fraction of clone"


def _median_seconds(fn, repeats: int) -> tuple[float, object]:
    result, times = fn(), []  # one warm-up call
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def measure(shape: tuple[int, ...], repeats: int, codecs=tuple(CODECS), dtypes=tuple(DTYPES)) -> list[dict]:
    """One row per (dtype, codec): GB/s of input for encode, decode and clone, and the fractions of clone."""
    rows = []
    for dtype_name in dtypes:
        torch.manual_seed(0)
        x = torch.relu(torch.randn(shape)).to(DTYPES[dtype_name])
        gbps = lambda seconds: x.numel() * x.element_size() / seconds / 1e9  # noqa: E731
        clone, _ = _median_seconds(x.clone, repeats)
        for name in codecs:
            codec_name, options = CODECS[name]
            codec = act.codecs.get(codec_name, backend="torch", **options)
            encode, packed = _median_seconds(lambda: codec.encode(x), repeats)
            decode, _ = _median_seconds(lambda: codec.decode(packed), repeats)
            rows.append({"dtype": dtype_name, "codec": name, "shape": list(shape), "encode_gbps": gbps(encode),
                         "decode_gbps": gbps(decode), "clone_gbps": gbps(clone), "encode_vs_clone": clone / encode,
                         "decode_vs_clone": clone / decode, "repeats": repeats})
            del packed
            print(f"  {dtype_name} {name}: encode {rows[-1]['encode_vs_clone']:.3f}, "
                  f"decode {rows[-1]['decode_vs_clone']:.3f} of clone", flush=True)
    return rows


def table(rows: list[dict]) -> list[str]:
    lines = ["| dtype | codec | encode GB/s | decode GB/s | clone GB/s | encode / clone | decode / clone |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['dtype']} | {r['codec']} | {r['encode_gbps']:.3g} | {r['decode_gbps']:.3g} | "
              f"{r['clone_gbps']:.3g} | {r['encode_vs_clone']:.3g} | {r['decode_vs_clone']:.3g} |" for r in rows]
    return lines


def description(rows: list[dict]) -> str:
    shape = " x ".join(map(str, rows[0]["shape"]))
    return (f"`backend=\"torch\"` codecs on a ReLU'd Gaussian {shape} tensor; GB/s of the input tensor (its own "
            f"dtype), median of {rows[0]['repeats']} calls after a warm-up; clone: `torch.clone` of the same tensor. "
            "division: B=8, Q=2.")


def report(rows: list[dict], command: str, load: dict) -> str:
    return "\n".join([
        f"# {TITLE}", "", description(rows), "", *table(rows), "", f"Command: `{command}`", "",
        f"Machine: {machine()}. Other processes used {load['other_cores']:.2f} of its {load['cpus']} CPUs on "
        f"average while this ran (1-minute load average {load['loadavg_start']:.1f} at the start, "
        f"{load['loadavg_end']:.1f} at the end): on a shared machine every rate, clone's included, is lower and "
        "noisier.", ""])


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=int, nargs="+", default=[16, 256, 56, 56])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "torch_path.md")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with MachineLoad() as load:
        rows = measure(tuple(args.shape), args.repeats)
    command = "python benchmarks/bench_torch_path.py" + (
        f" --shape {' '.join(map(str, args.shape))}" if args.shape != [16, 256, 56, 56] else "") + (
        f" --repeats {args.repeats}" if args.repeats != 5 else "") + (f" --threads {args.threads}" if args.threads else "")
    publish(report(rows, command, load.summary()), args.out)
    return rows


if __name__ == "__main__":
    main()
