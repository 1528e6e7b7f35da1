"""The pure-torch codec path (what a CPU user, or a GPU user without CuPy, runs): encode and decode bandwidth
in GB/s of input tensor, next to two copies of the same tensor.

- ``clone``: ``torch.clone`` (the issue's baseline), which allocates its result on every call. For a tensor of
  many MiB the allocator may hand back memory the kernel has to map in page by page (glibc returns large freed
  blocks to the system: mmap/munmap, or a trimmed heap), so clone's rate is the copy *plus* page faults, and
  whether it faults depends on the size and on the allocation history. The faults per call are reported.
- ``copy_``: ``out.copy_(x)`` into a tensor allocated once: the machine's copy bandwidth, no faults.

A ReLU'd Gaussian activation (default 16 x 256 x 56 x 56, a ResNet stage-1 map at batch 16) in float32,
bfloat16 and float16; ``quantize`` at 1, 2, 4, 8 bits and ``division`` (B=8, Q=2), ``backend="torch"``. Each
repeat times clone, copy_, encode and decode in turn (so a change of machine load hits all four alike); the
rates are medians of the repeats after one warm-up round. ``--threads 1 2`` measures each thread count.

    python benchmarks/bench_torch_path.py [--shape 16 256 56 56 | --shapes 16x256x56x56 4x256x56x56 ...]
                                          [--repeats 5] [--threads N [N ...]] [--dtypes float32 bfloat16 float16]
                                          [--out benchmarks/results/torch_path.md]
"""
from __future__ import annotations

import argparse
import resource
import statistics
import time
from pathlib import Path

import torch

import lightning_act as act
from models import MachineLoad, machine, publish

HERE = Path(__file__).resolve().parent
CODECS = {**{f"quantize {b}-bit": ("quantize", {"bits": b}) for b in (1, 2, 4, 8)}, "division": ("division", {})}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TITLE = "Torch path encode/decode GB/s and fraction of clone"
TARGET = 0.25  # issue #20: encode at 1/4 or more of clone bandwidth


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _timed(fn) -> tuple[float, int, object]:
    faults, start = _faults(), time.perf_counter()
    result = fn()
    return time.perf_counter() - start, _faults() - faults, result


def measure(shape: tuple[int, ...], repeats: int, codecs=tuple(CODECS), dtypes=tuple(DTYPES)) -> list[dict]:
    """One row per (dtype, codec): GB/s of input for encode, decode, clone and copy_, the fractions of clone and
    of copy_, and clone's page faults per call (medians over ``repeats`` rounds after a warm-up round)."""
    rows = []
    for dtype_name in dtypes:
        torch.manual_seed(0)
        x = torch.relu(torch.randn(shape)).to(DTYPES[dtype_name])
        out = torch.empty_like(x)
        gbps = lambda seconds: x.numel() * x.element_size() / seconds / 1e9  # noqa: E731
        for name in codecs:
            codec_name, options = CODECS[name]
            codec = act.codecs.get(codec_name, backend="torch", **options)
            times = {"clone": [], "copy": [], "encode": [], "decode": []}
            faults = []
            for round_index in range(repeats + 1):  # round 0 warms up
                clone_s, clone_faults, copy = _timed(x.clone)
                del copy
                copy_s, _, _ = _timed(lambda: out.copy_(x))
                encode_s, _, packed = _timed(lambda: codec.encode(x))
                decode_s, _, decoded = _timed(lambda: codec.decode(packed))
                del packed, decoded
                if round_index:
                    for key, seconds in zip(times, (clone_s, copy_s, encode_s, decode_s)):
                        times[key].append(seconds)
                    faults.append(clone_faults)
            s = {key: statistics.median(values) for key, values in times.items()}
            rows.append({"dtype": dtype_name, "codec": name, "shape": list(shape), "threads": torch.get_num_threads(),
                         "encode_gbps": gbps(s["encode"]), "decode_gbps": gbps(s["decode"]),
                         "clone_gbps": gbps(s["clone"]), "copy_gbps": gbps(s["copy"]),
                         "clone_faults": statistics.median(faults),
                         "encode_vs_clone": s["clone"] / s["encode"], "decode_vs_clone": s["clone"] / s["decode"],
                         "encode_vs_copy": s["copy"] / s["encode"], "repeats": repeats})
            r = rows[-1]
            print(f"  {torch.get_num_threads()} thr {dtype_name} {name}: encode {r['encode_gbps']:.3g} GB/s = "
                  f"{r['encode_vs_clone']:.3f} of clone ({r['clone_gbps']:.3g} GB/s, {r['clone_faults']:.0f} faults), "
                  f"{r['encode_vs_copy']:.3f} of copy_ ({r['copy_gbps']:.3g} GB/s); decode {r['decode_gbps']:.3g} GB/s",
                  flush=True)
    return rows


def table(rows: list[dict]) -> list[str]:
    lines = ["| threads | dtype | codec | encode GB/s | decode GB/s | clone GB/s (faults/call) | copy_ GB/s | "
             "encode / clone | encode / copy_ | decode / clone |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r.get('threads', '')} | {r['dtype']} | {r['codec']} | {r['encode_gbps']:.3g} | "
              f"{r['decode_gbps']:.3g} | {r['clone_gbps']:.3g} ({r.get('clone_faults', 0):.0f}) | "
              f"{r.get('copy_gbps', float('nan')):.3g} | {r['encode_vs_clone']:.3g}"
              f"{'' if r['encode_vs_clone'] >= TARGET else ' ✗'} | {r.get('encode_vs_copy', float('nan')):.3g} | "
              f"{r['decode_vs_clone']:.3g} |" for r in rows]
    return lines


def description(rows: list[dict]) -> str:
    shapes = list(dict.fromkeys(" x ".join(map(str, r["shape"])) for r in rows))
    shape = " and ".join(shapes) + (" tensors" if len(shapes) > 1 else " tensor")
    return (f"`backend=\"torch\"` codecs on a ReLU'd Gaussian {shape}; GB/s of the input tensor (its own "
            f"dtype), medians of {rows[0]['repeats']} rounds after a warm-up, each round timing clone, copy_, encode "
            "and decode in turn. clone: `torch.clone` (a fresh allocation per call, the issue's baseline; its page "
            "faults per call in brackets: a large fresh allocation is mapped in by the kernel page by page, so "
            "clone is the copy plus the faults); copy_: `out.copy_(x)` into a tensor allocated once (the copy "
            f"alone). ✗: encode below {TARGET:g} of clone (issue #20's target). division: B=8, Q=2.")


def report(rows: list[dict], command: str, load: dict) -> str:
    shapes = list(dict.fromkeys(tuple(r["shape"]) for r in rows))
    tables = []
    for shape in shapes:
        these = [r for r in rows if tuple(r["shape"]) == shape]
        heading = [f"## {' x '.join(map(str, shape))}", ""] if len(shapes) > 1 else []
        tables += [*heading, *table(these), ""]
    return "\n".join([
        f"# {TITLE}", "", description(rows), "", *tables, f"Command: `{command}`", "",
        f"Machine: {machine()} (threads: the table's column). Other processes used {load['other_cores']:.2f} of its "
        f"{load['cpus']} CPUs on average while this ran (1-minute load average {load['loadavg_start']:.1f} at the "
        f"start, {load['loadavg_end']:.1f} at the end): on a shared machine every rate, clone's and copy_'s "
        "included, is lower and noisier.", ""])


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=int, nargs="+", default=[16, 256, 56, 56])
    parser.add_argument("--shapes", nargs="+", help="several shapes, each as AxBxCxD (instead of --shape)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, nargs="+", help="torch thread counts to measure (default: torch's)")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    parser.add_argument("--out", type=Path, default=HERE / "results" / "torch_path.md")
    args = parser.parse_args(argv)
    shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes] if args.shapes else [tuple(args.shape)]
    rows = []
    with MachineLoad() as load:
        for shape in shapes:
            for threads in args.threads or [torch.get_num_threads()]:
                torch.set_num_threads(threads)
                rows += measure(shape, args.repeats, dtypes=tuple(args.dtypes))
    command = "python benchmarks/bench_torch_path.py" + (
        f" --shapes {' '.join(args.shapes)}" if args.shapes else
        f" --shape {' '.join(map(str, args.shape))}" if args.shape != [16, 256, 56, 56] else "") + (
        f" --repeats {args.repeats}" if args.repeats != 5 else "") + (
        f" --threads {' '.join(map(str, args.threads))}" if args.threads else "") + (
        f" --dtypes {' '.join(args.dtypes)}" if args.dtypes != list(DTYPES) else "")
    publish(report(rows, command, load.summary()), args.out)
    return rows


if __name__ == "__main__":
    main()
