"""torch.compile'd models: activations compressed inside the compiled graphs (``lightning_act.compiled_regions``)
beside the compiled model alone, the compiled model with torch's checkpointing, and the eager runs.

    python benchmarks/bench_compiled.py [--models bert resnet] [--repeats 3] [--out benchmarks/results/compiled.md]

Each configuration trains its own copy of the model (same seed, same batch): a compiled model (``torch.compile``'s
wrapper) keeps its compiled graphs, and a checkpointed one its checkpointing, for the whole run (switching them
per step would compile again).
The configurations take turns step by step after two warm-up rounds (the first compiles). Peak: the step's
resident-set growth (``peak_memory.peak_step_bytes``, glibc's mmap threshold pinned); time: median step seconds in
a child process that runs the same turns with glibc's own thresholds (``peak_memory.timing_child``);
peak ÷ and time × against the eager baseline, and against the compiled one. On a GPU, ``bench_gpu.py``'s
``compiled`` configurations measure the same comparison (BERT-base, ResNet-50, bf16 autocast).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import lightning_act as act
import models
from models import MachineLoad, machine, publish
from bench_gpu import METHODS, Prepared
from peak_memory import (ensure_fixed_mmap_threshold, is_timing_child, peak_step_bytes, timing_child,
                         write_timings)

MiB = 2**20
# model -> (builder in models.py, batch, builder options); the sizes of run_all.py's memory section
MODELS = {"bert": ("BERT", "bert", 8, {"seq": 128, "layers": 4}),
          "resnet": ("ResNet-50", "resnet", 32, {"size": 64})}
# config -> (compiled, compressor config, torch checkpointing)
CONFIGS = {
    "eager": (False, None, False),
    "eager, quantize 4-bit": (False, act.ACTConfig(bits=4, adaptive=False), False),
    "eager, torch checkpoint": (False, None, True),
    "compiled": (True, None, False),
    "compiled, quantize 4-bit": (True, act.ACTConfig(bits=4, adaptive=False), False),
    "compiled, torch checkpoint": (True, None, True),
}


class Run:
    """One configuration's copy of the model, its loss closure and compressor."""

    def __init__(self, builder: str, batch: int, options: dict, config: str):
        compiled, compressor_config, checkpointing = CONFIGS[config]
        self.model, self.loss_fn = getattr(models, builder)(batch, compiled=compiled, **options)
        if checkpointing:  # bench_gpu's peer, before the first call (which compiles), for the whole run
            Prepared(METHODS["torch checkpoint"], self.model, torch.device("cpu"), autocast=False)
        self.compressor = act.ActivationCompressor(self.model, compressor_config) if compressor_config else None

    def step(self) -> float:
        return models.train_step(self.model, self.loss_fn, self.compressor)


def take_turns(model_key: str, configs: list[str], repeats: int, warmup: int, measure_step) -> tuple:
    """``(runs, measured, first_step_s)``: one ``Run`` per configuration, taking turns step by step;
    ``measure_step(run)`` of every step after ``warmup`` rounds, and the first step's seconds (it compiles)."""
    name, builder, batch, options = MODELS[model_key]
    runs = {config: Run(builder, batch, options, config) for config in configs}
    measured = {config: [] for config in configs}
    first_step_s = {}
    for round_index in range(warmup + repeats):
        for config, run in runs.items():
            started = time.perf_counter()
            value = measure_step(run)
            if round_index == 0:
                first_step_s[config] = time.perf_counter() - started
            if round_index >= warmup:
                measured[config].append(value)
        print(f"  {name}: round {round_index + 1} of {warmup + repeats}", flush=True)
    return runs, measured, first_step_s


def step_seconds(model_key: str, configs: list[str], repeats: int, warmup: int) -> dict[str, list[float]]:
    """Per configuration, the seconds of each measured step (in a ``peak_memory.timing_child``: a pinned
    process's step times are not a user's)."""
    return take_turns(model_key, configs, repeats, warmup, Run.step)[1]


def measure(model_key: str, configs: list[str], repeats: int, warmup: int,
            seconds: dict[str, list[float]]) -> list[dict]:
    """The rows of one model: peaks measured here, ``seconds`` from ``step_seconds`` in a timing child."""
    name, _, batch, _ = MODELS[model_key]
    runs, peaks, compile_s = take_turns(model_key, configs, repeats, warmup, lambda run: peak_step_bytes(run.step))
    rows = []
    for config, run in runs.items():
        stats = run.compressor.stats() if run.compressor is not None else None
        rows.append({"model": name, "batch": batch, "config": config, "peak_mib": statistics.median(peaks[config]) / MiB,
                     "step_ms": 1e3 * statistics.median(seconds[config]), "first_step_s": compile_s[config],
                     "ratio": stats.ratio if stats else None,
                     "compiled_tensors": sum(r.phase == "compiled" for r in stats.records) if stats else None})
    for reference in ("eager", "compiled"):
        base = next((r for r in rows if r["config"] == reference), None)
        for r in rows:
            r[f"peak_div_{reference}"] = base["peak_mib"] / r["peak_mib"] if base and r["peak_mib"] > 0 else None
            r[f"time_x_{reference}"] = r["step_ms"] / base["step_ms"] if base else None
    return rows


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rows: list[dict]) -> str:
    lines = ["| model | batch | config | peak MiB | peak ÷ eager | peak ÷ compiled | step ms | time × eager | "
             "time × compiled | ratio (tensors in compiled graphs) | first step s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x ({r['compiled_tensors']})"
        lines.append(f"| {r['model']} | {r['batch']} | {r['config']} | {r['peak_mib']:.1f} | "
                     f"{_fmt(r['peak_div_eager'], '.2f')} | {_fmt(r['peak_div_compiled'], '.2f')} | "
                     f"{r['step_ms']:.0f} | {_fmt(r['time_x_eager'], '.2f')} | {_fmt(r['time_x_compiled'], '.2f')} | "
                     f"{ratio} | {r['first_step_s']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if is_timing_child():
        write_timings({key: step_seconds(key, args.configs, args.repeats, args.warmup) for key in args.models})
        return 0
    ensure_fixed_mmap_threshold()
    started = time.perf_counter()
    with MachineLoad() as load:
        seconds = timing_child(__file__, sys.argv[1:] if argv is None else argv)
        rows = [row for key in args.models
                for row in measure(key, args.configs, args.repeats, args.warmup, seconds[key])]
    busy = load.summary()
    text = "\n\n".join([
        "# torch.compile'd models: compressed inside the compiled graphs", table(rows),
        "Peak: a step's resident-set growth, glibc's mmap threshold pinned at 64 KiB; step ms: the same turns in a "
        "child process with glibc's own thresholds (`peak_memory.timing_child`: the pin makes every large block "
        "fault its pages in afresh, which costs the step that allocates more blocks time no user's process spends); "
        "first step s: the pinned process's first step (the compiled rows load the graphs the timing child "
        "compiled from the compile caches).",
        f"Command: `python benchmarks/bench_compiled.py {' '.join(sys.argv[1:] if argv is None else argv)}`; "
        f"{machine()}; {(time.perf_counter() - started) / 60:.1f} min.",
        f"Other processes used {busy['other_cores']:.2f} of the {busy['cpus']} CPUs on average while this ran "
        f"(1-minute load average {busy['loadavg_start']:.1f} at the start, {busy['loadavg_end']:.1f} at the end)."]) + "\n"
    publish(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
