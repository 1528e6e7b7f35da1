"""The pure-torch codec path (what a CPU user, or a GPU user without CuPy, runs): encode and decode bandwidth
in GB/s of input tensor, next to two copies of the same tensor.

- ``clone``: ``torch.clone`` (the issue's baseline), which allocates its result on every call. For a tensor of
  many MiB the allocator may hand back memory the kernel has to map in page by page (glibc returns large freed
  blocks to the system: mmap/munmap, or a trimmed heap), so clone's rate is the copy *plus* page faults, and
  whether it faults depends on the size and on the allocation history. The faults per call are reported.
- ``copy_``: ``out.copy_(x)`` into a tensor allocated once: the machine's copy bandwidth, no faults.

A ReLU'd Gaussian activation (default 16 x 256 x 56 x 56, a ResNet stage-1 map at batch 16) in float32,
bfloat16 and float16; ``quantize`` at 1, 2, 4, 8 bits, ``division`` (B=8, Q=2) and ``lorenzo`` (absolute bound
1e-2, its fast torch path), ``backend="torch"``, and those with a compiled pipeline (quantize, division) again
with ``backend="compile"`` (``torch.compile``'s inductor: the first encode and decode, which compile, are
timed apart and left out of the rates). Each repeat times clone, copy_, encode and decode in turn (so
a change of machine load hits all four alike); the rates are medians of the repeats after one warm-up round.
``--threads 1 2`` measures each thread count. ``--device cuda`` (a session with a GPU: ``benchmarks/gpu_session.sh``)
times the torch path on the GPU beside the kernels (``backend="cupy"``), wall clock with the device synchronised
around each call, and reports how many times faster the kernels are (issue #20: within 5x); without CUDA it exits
with status 2.

    python benchmarks/bench_torch_path.py [--shape 16 256 56 56 | --shapes 16x256x56x56 4x256x56x56 ...]
                                          [--repeats 5] [--threads N [N ...]] [--dtypes float32 bfloat16 float16]
                                          [--codecs CODEC ...] [--compiled CODEC ...] [--device cpu|cuda]
                                          [--out benchmarks/results/torch_path.md]
"""
from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

import lightning_act as act
from models import MachineLoad, machine, publish

HERE = Path(__file__).resolve().parent
CODECS = {**{f"quantize {b}-bit": ("quantize", {"bits": b}) for b in (1, 2, 4, 8)}, "division": ("division", {}),
          "lorenzo eb=1e-2": ("lorenzo", {"error_bound": 1e-2})}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TITLE = "Torch path encode/decode GB/s and fraction of clone"
TARGET = 0.25  # issue #20: encode at 1/4 or more of clone bandwidth
NO_CUDA_EXIT = 2  # --device cuda without a GPU: nothing measured (bench_gpu.py's status too)
COMPILED = tuple(name for name, (codec, _) in CODECS.items() if codec != "lorenzo")  # those with a compiled path


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


# wall: elapsed time; cpu: CPU time of this process (all its threads). With one thread, cpu is what the call takes
# on an unshared core: on a shared machine, the time slices other processes take are not counted.
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = CLOCKS["wall"]


def _sync() -> None:
    """Wait for the device (timing on CUDA); nothing on CPU."""


def _timed(fn, clock=None) -> tuple[float, int, object]:
    clock = clock or _clock
    _sync()
    faults, start = _faults(), clock()
    result = fn()
    _sync()
    return clock() - start, _faults() - faults, result


def measure(shape: tuple[int, ...], repeats: int, codecs=tuple(CODECS), dtypes=tuple(DTYPES),
            compiled=COMPILED, device: str = "cpu", kernels: bool | None = None) -> list[dict]:
    """One row per (dtype, codec, backend): GB/s of input for encode, decode, clone and copy_, the fractions of
    clone and of copy_, and clone's page faults per call (medians over ``repeats`` rounds after a warm-up round);
    the ``compiled`` codecs also with ``backend="compile"``, whose first encode and decode (the compilation, or
    none where this process compiled that variant already) are timed alone. ``kernels`` (default: on CUDA) also
    times ``backend="cupy"``, the kernels the torch path is compared with (off CUDA: an installed kernel runner's)."""
    rows = []
    clock = next(name for name, c in CLOCKS.items() if c is _clock)
    kernels = device == "cuda" if kernels is None else kernels
    backends = ("torch", "cupy", "compile") if kernels else ("torch", "compile")
    for dtype_name in dtypes:
        torch.manual_seed(0)
        x = torch.relu(torch.randn(shape)).to(device=device, dtype=DTYPES[dtype_name])
        out = torch.empty_like(x)
        gbps = lambda seconds: x.numel() * x.element_size() / seconds / 1e9  # noqa: E731
        for name, backend in [(c, b) for c in codecs for b in backends if b != "compile" or c in compiled]:
            codec_name, options = CODECS[name]
            codec = act.codecs.get(codec_name, backend=backend, **options)
            first = {}
            if backend == "compile":
                # elapsed time whatever the clock: inductor compiles in child processes
                first["encode"], _, packed = _timed(lambda: codec.encode(x), CLOCKS["wall"])
                first["decode"], _, _ = _timed(lambda: codec.decode(packed), CLOCKS["wall"])
                del packed
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
            rows.append({"dtype": dtype_name, "codec": name, "backend": backend, "shape": list(shape), "device": device,
                         "threads": torch.get_num_threads(), "first_encode_s": first.get("encode"),
                         "first_decode_s": first.get("decode"),
                         "encode_gbps": gbps(s["encode"]), "decode_gbps": gbps(s["decode"]),
                         "clone_gbps": gbps(s["clone"]), "copy_gbps": gbps(s["copy"]),
                         "clone_faults": statistics.median(faults),
                         "encode_vs_clone": s["clone"] / s["encode"], "decode_vs_clone": s["clone"] / s["decode"],
                         "encode_vs_copy": s["copy"] / s["encode"], "repeats": repeats, "clock": clock})
            r = rows[-1]
            print(f"  {torch.get_num_threads()} thr {dtype_name} {name} {backend}: encode {r['encode_gbps']:.3g} "
                  f"GB/s = {r['encode_vs_clone']:.3f} of clone ({r['clone_gbps']:.3g} GB/s, "
                  f"{r['clone_faults']:.0f} faults), {r['encode_vs_copy']:.3f} of copy_ ({r['copy_gbps']:.3g} GB/s); "
                  f"decode {r['decode_gbps']:.3g} GB/s"
                  + (f"; first encode {first['encode']:.1f} s, decode {first['decode']:.1f} s" if first else ""),
                  flush=True)
    return rows


def _first_calls(r: dict) -> str:
    if r.get("first_encode_s") is None:
        return ""
    return f"{r['first_encode_s']:.1f} + {r['first_decode_s']:.1f}"


def table(rows: list[dict]) -> list[str]:
    lines = ["| threads | dtype | codec | backend | encode GB/s | decode GB/s | clone GB/s (faults/call) | "
             "copy_ GB/s | encode / clone | encode / copy_ | decode / clone | first encode + decode s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r.get('threads', '')} | {r['dtype']} | {r['codec']} | {r.get('backend', 'torch')} | "
              f"{r['encode_gbps']:.3g} | "
              f"{r['decode_gbps']:.3g} | {r['clone_gbps']:.3g} ({r.get('clone_faults', 0):.0f}) | "
              f"{r.get('copy_gbps', float('nan')):.3g} | {r['encode_vs_clone']:.3g}"
              f"{'' if r['encode_vs_clone'] >= TARGET else ' ✗'} | {r.get('encode_vs_copy', float('nan')):.3g} | "
              f"{r['decode_vs_clone']:.3g} | {_first_calls(r)} |" for r in rows]
    return lines


KERNEL_TARGET = 5  # issue #20: on CUDA the torch path within 5x of the kernels


def kernel_comparison(rows: list[dict]) -> list[str]:
    """On CUDA: per dtype and codec, how many times the kernels' (``backend="cupy"``) rates the torch path's are;
    no lines when no row has both."""
    rates = {(r["dtype"], r["codec"], r["backend"]): r for r in rows}
    lines = []
    for (dtype, codec, backend), kernel in rates.items():
        torch_path = rates.get((dtype, codec, "torch"))
        if backend != "cupy" or torch_path is None:
            continue
        times = [kernel[f"{op}_gbps"] / torch_path[f"{op}_gbps"] for op in ("encode", "decode")]
        lines.append(f"| {dtype} | {codec} | {kernel['encode_gbps']:.3g} / {torch_path['encode_gbps']:.3g} = "
                     f"{times[0]:.3g}{' ✗' if times[0] > KERNEL_TARGET else ''} | {kernel['decode_gbps']:.3g} / "
                     f"{torch_path['decode_gbps']:.3g} = {times[1]:.3g}{' ✗' if times[1] > KERNEL_TARGET else ''} |")
    if not lines:
        return []
    return ["How many times faster the kernels are than the torch path on the device (✗: more than "
            f"{KERNEL_TARGET}x, issue #20's bound):", "",
            "| dtype | codec | encode GB/s: kernels / torch path | decode GB/s: kernels / torch path |",
            "|---|---|---|---|", *lines, ""]


def _clock_note(rows: list[dict]) -> str:
    if rows[0].get("clock", "wall") == "wall":
        return ""
    return (" by this process's CPU time, not elapsed time (with one thread: what each call takes on an unshared "
            "core; with two: the sum over both threads)")


def description(rows: list[dict]) -> str:
    shapes = list(dict.fromkeys(" x ".join(map(str, r["shape"])) for r in rows))
    shape = " and ".join(shapes) + (" tensors" if len(shapes) > 1 else " tensor")
    return (f"`backend=\"torch\"` and `backend=\"compile\"` codecs on a ReLU'd Gaussian {shape}; GB/s of the input "
            f"tensor (its own dtype), medians of {rows[0]['repeats']} rounds after a warm-up, each round timing clone, "
            f"copy_, encode and decode in turn{_clock_note(rows)}. clone: `torch.clone` (a fresh allocation per "
            "call, the issue's baseline; its page faults per call in brackets: a large fresh allocation is mapped in "
            "by the kernel page by page, so "
            "clone is the copy plus the faults); copy_: `out.copy_(x)` into a tensor allocated once (the copy "
            f"alone). ✗: encode below {TARGET:g} of clone (issue #20's target). division: B=8, Q=2; lorenzo: "
            "absolute bound 1e-2. compile: "
            "`torch.compile` (inductor) of the codec's chunk pipeline; its first encode and decode, in elapsed "
            "seconds, compile the variant (or find it compiled earlier in the run, or in inductor's on-disk "
            "cache) and are left out of the rates.")


def report(rows: list[dict], command: str, load: dict) -> str:
    shapes = list(dict.fromkeys(tuple(r["shape"]) for r in rows))
    tables = []
    for shape in shapes:
        these = [r for r in rows if tuple(r["shape"]) == shape]
        heading = [f"## {' x '.join(map(str, shape))}", ""] if len(shapes) > 1 else []
        tables += [*heading, *table(these), ""]
    device = rows[0].get("device", "cpu")
    where = f"Device: {torch.cuda.get_device_name()}. " if device == "cuda" else ""
    return "\n".join([
        f"# {TITLE}", "", description(rows), "", *tables, *kernel_comparison(rows), f"Command: `{command}`", "",
        f"{where}Machine: {machine()} (threads: the table's column). Other processes used "
        f"{load['other_cores']:.2f} of its {load['cpus']} CPUs on average while this ran (1-minute load average {load['loadavg_start']:.1f} at the "
        f"start, {load['loadavg_end']:.1f} at the end): on a shared machine every rate, clone's and copy_'s "
        "included, is lower and noisier.", ""])


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=int, nargs="+", default=[16, 256, 56, 56])
    parser.add_argument("--shapes", nargs="+", help="several shapes, each as AxBxCxD (instead of --shape)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--clock", choices=CLOCKS, default="wall",
                        help="wall: elapsed time; cpu: this process's CPU time (one thread: an unshared core's time)")
    parser.add_argument("--threads", type=int, nargs="+", help="torch thread counts to measure (default: torch's)")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    parser.add_argument("--codecs", nargs="+", choices=CODECS, default=list(CODECS))
    parser.add_argument("--compiled", nargs="*", choices=COMPILED, default=list(COMPILED),
                        help="codecs also measured with backend='compile' (none: leave them out)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the torch path on the GPU, beside the kernels (backend='cupy'); wall clock")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "torch_path.md")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_torch_path.py --device cuda: no CUDA device here; nothing measured", file=sys.stderr)
        raise SystemExit(NO_CUDA_EXIT)
    shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes] if args.shapes else [tuple(args.shape)]
    global _clock, _sync
    _clock = CLOCKS["wall" if args.device == "cuda" else args.clock]  # a GPU's time is not this process's CPU time
    if args.device == "cuda":
        _sync = torch.cuda.synchronize
    rows = []
    with MachineLoad() as load:
        for shape in shapes:
            for threads in args.threads or [torch.get_num_threads()]:
                torch.set_num_threads(threads)
                rows += measure(shape, args.repeats, codecs=tuple(args.codecs), dtypes=tuple(args.dtypes),
                                compiled=tuple(args.compiled), device=args.device)
    command = "python benchmarks/bench_torch_path.py" + (
        f" --shapes {' '.join(args.shapes)}" if args.shapes else
        f" --shape {' '.join(map(str, args.shape))}" if args.shape != [16, 256, 56, 56] else "") + (
        f" --repeats {args.repeats}" if args.repeats != 5 else "") + (
        f" --clock {args.clock}" if args.clock != "wall" else "") + (
        f" --threads {' '.join(map(str, args.threads))}" if args.threads else "") + (
        f" --dtypes {' '.join(args.dtypes)}" if args.dtypes != list(DTYPES) else "") + (
        f" --codecs {' '.join(repr(c) for c in args.codecs)}" if args.codecs != list(CODECS) else "") + (
        f" --compiled {' '.join(args.compiled)}" if args.compiled != list(COMPILED) else "") + (
        " --device cuda" if args.device == "cuda" else "")
    publish(report(rows, command, load.summary()), args.out)
    return rows


if __name__ == "__main__":
    main()
