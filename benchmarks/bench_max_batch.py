"""The largest batch whose training step fits in a memory budget, each search in a fresh child process.

What counts against the budget is everything a trial allocates, at its peak, measured by the allocator (the
measure the memory-budget planner plans with and ``tests/test_memory_budget.py`` checks, what a GPU's
``max_memory_allocated`` counts): the model's weights and the input batch (what building them leaves allocated,
``lightning_act.profiling.measure_step_memory`` around the build) plus the peak of one forward + backward above
its start (the same measure around the step, gradients freed before it: they are allocated inside it), under
``compress()`` when compressed. On CPU that is ``torch.profiler``'s allocator events; the interpreter, the
libraries and the allocator's caching are not counted. Nothing kills the child at the budget: a batch fits when
its measured peak is at or below it. (The resident set is not used: in a child that has already run profiled
trials, freed heap pages are reused without growing it, so a step's resident-set growth read low for compressed
configurations, whose codecs allocate many small buffers: 135-190 MiB for BERT steps of 254 MiB allocated.)

The configurations are ``bench_gpu.py``'s (``bench_gpu.METHODS``, fp32 here, no autocast), side by side:

- ``L1``: auto-precision's bits, estimated once per search by one round at batch ``L1_PROBE_BATCH`` and carried
  to each trial's batch by pack order (``bench_gpu.carry_allocation``; a round at every trial batch would cost a
  forward + backward per saved tensor each time). The table says how many saved tensors the allocation reached.
- ``memory budget``: ``ACTConfig(memory_budget=...)``: each trial plans (``MemoryBudget(...).plan``) for the budget
  minus what the built model and batch already hold, then trains one step; the planner's own profiling passes
  are left out of the trial's peak, and their highest (plus the model and batch) at the found batch is reported
  beside it: on a device that memory must exist too.
- ``CB1``: compressed checkpointing at 4 bits (HF layers through the config; ResNet bottlenecks through
  ``lightning_act.checkpoint``); ``torch checkpoint``: HF's ``activation_checkpointing_enable()`` (formerly
  ``gradient_checkpointing_enable()``), ``torch.utils.checkpoint`` per bottleneck.

The search: a warm-up trial (one-time allocations of threads and lazy initialisation), two small batches
fit a line ``peak = fixed + per_sample * batch``, then regula falsi between the largest batch measured to fit
and the smallest measured not to (a trial goes at most 4x past the largest fit), each trial a real measured
step, until the two are within ``tolerance``. Children are forked from a ``forkserver`` that imported torch and
lightning_act once, so each search starts from a fresh process without paying the imports again; several may
run at once (memory is per process).

    python benchmarks/bench_max_batch.py [--budget-mib 384] [--models resnet bert] [--configs baseline L1 ...]
                                         [--parallel 2] [--out benchmarks/results/max_batch.md]
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import multiprocessing
import multiprocessing.connection
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import models
from bench_gpu import METHODS, Method, Prepared, carry_allocation
from lightning_act.profiling import measure_step_memory

MiB = 2**20
CPU = torch.device("cpu")
L1_PROBE_BATCH = 4
DEFAULT_CONFIGS = ("baseline", "L1", "2-bit", "CB1", "memory budget", "torch checkpoint")
MODELS = {"ResNet-50": ("resnet", {"size": 32}), "BERT": ("bert", {"seq": 128, "layers": 4})}  # models.py builders


@dataclass
class Setup:
    """What a trial trains: a ``bench_gpu`` configuration, the search's budget (the memory-budget planner's, less
    what the built model holds), L1's allocation (``AutoPrecision.state_dict()`` at ``allocation_batch``); and what
    the trials saw, by batch: the planner's own peak and plan, L1's (allocated, compressed) tensor counts."""

    method: Method
    budget: int | None = None
    allocation: dict | None = None
    allocation_batch: int = 0
    planning_peaks: dict = field(default_factory=dict)
    plans: dict = field(default_factory=dict)
    coverage: dict = field(default_factory=dict)


def setup_for(config) -> Setup:
    """A :class:`Setup` from a ``Setup``, a ``bench_gpu.METHODS`` name, an ``ACTConfig`` or ``None`` (baseline)."""
    if isinstance(config, Setup):
        return config
    if isinstance(config, str):
        return Setup(METHODS[config])
    return Setup(Method(config))


def _prepare(setup: Setup, model, loss_fn, batch: int, held: int) -> Prepared:
    """The trial's configuration applied to ``model``: the memory-budget plan for the budget less ``held`` (the
    planner's peak and plan kept in the setup), or L1's carried allocation."""
    prepared = Prepared(setup.method, model, CPU, autocast=False)
    if setup.method.budget:
        prepared.calibrate(loss_fn, max(1, setup.budget - held))
        setup.planning_peaks[batch] = held + prepared.plan.planning_peak_bytes
        setup.plans[batch] = (dict(prepared.plan.options), prepared.shortfall is None)
    else:
        allocation = setup.allocation and carry_allocation(setup.allocation, setup.allocation_batch, batch)
        prepared.calibrate(loss_fn, allocation=allocation)
    model.zero_grad(set_to_none=True)
    return prepared


def trial_peak(build, config, batch: int) -> int:
    """Allocator bytes at the peak of a trial at ``batch`` (``config``: see :func:`setup_for`): what building the
    model and its batch left allocated plus one training step's peak above its start; the memory-budget planner's
    passes are left out, their peak kept in the setup."""
    setup, made = setup_for(config), {}

    def built():
        made["model"], made["loss_fn"] = build(batch)

    held = measure_step_memory(built).end_bytes
    prepared = _prepare(setup, made["model"], made["loss_fn"], batch, held)
    try:
        step = measure_step_memory(lambda: prepared.forward_backward(made["loss_fn"])).peak_bytes
        if prepared.auto is not None:
            setup.coverage[batch] = prepared.allocation_coverage()
    finally:
        prepared.close()
        made.clear()
        gc.collect()
    return held + step


def estimate_allocation(build, setup: Setup, batch: int = L1_PROBE_BATCH) -> None:
    """L1: one auto-precision round at ``batch``; its allocation goes to every trial (carried to its batch)."""
    model, loss_fn = build(batch)
    prepared = Prepared(setup.method, model, CPU, autocast=False)
    prepared.calibrate(loss_fn)
    setup.allocation, setup.allocation_batch = prepared.auto.state_dict(), batch
    prepared.close()


def largest_batch(build, config, budget: int, max_batch: int, tolerance: float = 0.03,
                  probes: tuple[int, int] = (2, 8)) -> dict:
    """The largest batch (<= ``max_batch``) whose trial peak is <= ``budget`` bytes, within ``tolerance`` of
    the smallest batch measured over it; with every measured peak."""
    trial_peak(build, config, probes[0])  # warm-up: not measured
    peaks = {}

    def fits(batch: int) -> bool:
        peaks[batch] = trial_peak(build, config, batch)
        return peaks[batch] <= budget

    low, high = 0, max_batch + 1  # largest known to fit, smallest known not to (max_batch + 1: none yet)
    for batch in probes:
        if batch > max_batch:
            break
        if not fits(batch):
            high = batch
            break
        low = batch
    while high - low > max(1, math.ceil(tolerance * low)):
        guess = min(_secant(peaks, low, high, budget), 4 * max(low, 1))  # at most x4 per trial past a fit
        # stay strictly inside (low, high) and move at least a tolerance step so the interval shrinks
        step = max(1, math.ceil(tolerance * max(low, 1)))
        candidate = int(min(max(guess, low + step), high - 1))
        if fits(candidate):
            low = candidate
        else:
            high = candidate
    return {"batch": low, "capped": high > max_batch, "peaks_mib": {b: p / MiB for b, p in sorted(peaks.items())}}


def _secant(peaks: dict, low: int, high: int, budget: int) -> float:
    """Where the line through two measured (batch, peak) points reaches ``budget``: ``low`` and ``high`` when
    both are measured, else the two largest measured batches up to ``low``; the midpoint without two points."""
    points = [low, high] if low in peaks and high in peaks else sorted(b for b in peaks if b <= low)[-2:]
    if len(points) == 2 and peaks[points[1]] != peaks[points[0]]:
        (b0, b1), (p0, p1) = points, (peaks[points[0]], peaks[points[1]])
        guess = b0 + (budget - p0) * (b1 - b0) / (p1 - p0)
        if guess > low:
            return guess
    return (low + high) / 2


def _child(connection, builder: str, options: dict, config, budget: int, max_batch: int, tolerance: float,
           threads: int) -> None:
    try:
        torch.set_num_threads(threads)  # parallel children share the cores (OpenMP oversubscription is slow)
        build = lambda batch: getattr(models, builder)(batch, **options)  # noqa: E731
        setup = setup_for(config)
        setup.budget = budget
        if setup.method.config is not None and setup.method.config.adaptive:
            estimate_allocation(build, setup)
        found = largest_batch(build, setup, budget, max_batch, tolerance)
        batch = found["batch"]
        if batch in setup.coverage:
            found["allocated"] = setup.coverage[batch]
        if batch in setup.plans:
            found["plan"], found["plan_met"] = setup.plans[batch]
            found["planning_peak_mib"] = setup.planning_peaks[batch] / MiB
        connection.send(found)
    finally:
        connection.close()


def search_in_children(jobs: list[dict], parallel: int = 1) -> list[dict]:
    """``largest_batch`` of each job (``builder`` in models.py, its ``options``, ``config``, ``budget`` bytes,
    ``max_batch``, ``tolerance``), each in a fresh child process, ``parallel`` at a time with a share of the
    torch threads each (memory is measured per process, so they do not see each other's); adds the seconds each
    search took."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["lightning_act", "models", "bench_gpu", __name__])
    results, running, pending = [None] * len(jobs), {}, list(enumerate(jobs))
    threads = max(1, torch.get_num_threads() // parallel)
    while pending or running:
        while pending and len(running) < parallel:
            index, job = pending.pop(0)
            receiver, sender = context.Pipe(duplex=False)
            process = context.Process(target=_child, args=(sender, job["builder"], job["options"], job["config"],
                                                           job["budget"], job["max_batch"], job["tolerance"],
                                                           threads))
            process.start()
            sender.close()
            running[receiver] = (index, process, time.perf_counter())
        for receiver in multiprocessing.connection.wait(list(running)):
            index, process, started = running.pop(receiver)
            try:
                found = receiver.recv()
            except EOFError:
                process.join()
                raise RuntimeError(f"max-batch search {jobs[index]} died (exit code {process.exitcode})") from None
            process.join()
            results[index] = {**found, "tolerance": jobs[index]["tolerance"],
                              "seconds": time.perf_counter() - started}
            print(f"  search {index + 1}/{len(jobs)} done: {jobs[index].get('model', jobs[index]['builder'])} "
                  f"{jobs[index]['config'] if isinstance(jobs[index]['config'], str) else ''}: batch {found['batch']}, "
                  f"peaks (MiB) {({b: round(p, 1) for b, p in found['peaks_mib'].items()})}", flush=True)
    return results


def report(rows: list[dict], command: str) -> str:
    """The side-by-side table (each batch against the baseline's and torch checkpointing's), then how each figure
    was measured."""
    lines = ["| model | budget MiB | config | max batch | vs baseline | vs torch checkpoint | peak MiB | trials | "
             "search s | notes |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        notes = []
        if "allocated" in r:
            notes.append(f"bits allocated to {r['allocated'][0]}/{r['allocated'][1]} quantized tensors (the others: "
                         f"under min_numel at batch {L1_PROBE_BATCH}, or storages already stored, at the fallback bits)")
        if "plan" in r:
            counts = {}
            for option in r["plan"].values():
                counts[option] = counts.get(option, 0) + 1
            notes.append("plan: " + ", ".join(f"{n} {o}" for o, n in counts.items()) +
                         ("" if r["plan_met"] else " (planner: budget not met)") +
                         f"; planning peaked at {r['planning_peak_mib']:.0f} MiB")
        peak = r["peaks_mib"].get(r["batch"])
        vs_checkpoint = r.get("batch_vs_checkpoint")
        lines.append(f"| {r['model']} {r['options']} | {r['budget_mib']} | {r['config']} | "
                     f"{r['batch']}{'+' if r['capped'] else ''} | {r['batch_ratio']:.2f}x | "
                     f"{'n/a' if vs_checkpoint is None else f'{vs_checkpoint:.2f}x'} | "
                     f"{'n/a' if peak is None else f'{peak:.1f}'} | "
                     f"{len(r['peaks_mib'])} | {r['seconds']:.0f} | {'; '.join(notes)} |")
    return "\n".join(lines) + (
        "\n\nA trial builds the model and its batch and trains one step (fp32, forward + backward); it fits when its "
        "allocator-measured peak (what building the model and batch left allocated plus the step's peak above its "
        "start, `lightning_act.profiling.measure_step_memory`: torch.profiler's allocator events on CPU, "
        "`max_memory_allocated` on a GPU) is at or below the budget; searches stop "
        f"within {100 * rows[0]['tolerance']:.0f}%. peak MiB: that measure at the batch found. L1: bits from one "
        f"auto-precision round at batch {L1_PROBE_BATCH}, carried to the trial's batch by pack order. memory "
        "budget: each trial plans for the budget less what the built model and batch hold; the planner's passes "
        "are not in the trial's peak (their highest at the found batch, plus the model and batch, is in the notes). "
        "CB1 and torch checkpoint: per ResNet bottleneck / per HF layer.\n\n"
        f"Command: `{command}`; {models.machine()}.\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-mib", type=int, default=384)
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--configs", nargs="+", choices=list(METHODS), default=list(DEFAULT_CONFIGS))
    parser.add_argument("--max-batch", type=int, default=4096)
    parser.add_argument("--tolerance", type=float, default=0.03)
    parser.add_argument("--parallel", type=int, default=2, help="searches at a time")
    parser.add_argument("--out", type=Path, help="also write the markdown table here (and the rows as JSON beside)")
    args = parser.parse_args(argv)
    configs = ["baseline", *(c for c in args.configs if c != "baseline")]
    jobs = [{"model": model, "builder": MODELS[model][0], "options": MODELS[model][1], "config": name,
             "budget": args.budget_mib * MiB, "max_batch": args.max_batch, "tolerance": args.tolerance}
            for model in args.models for name in configs]
    rows = []
    for job, found in zip(jobs, search_in_children(jobs, args.parallel)):
        rows.append({"model": job["model"], "options": job["options"], "config": job["config"],
                     "budget_mib": args.budget_mib, **found})
        print(f"  {job['model']} {job['config']}: {found['batch']} ({found['seconds']:.0f} s)", flush=True)
    for r in rows:
        base = next(b for b in rows if b["model"] == r["model"] and b["config"] == "baseline")
        r["batch_ratio"] = r["batch"] / max(base["batch"], 1)
        peer = next((b for b in rows if b["model"] == r["model"] and b["config"] == "torch checkpoint"), None)
        if peer is not None:
            r["batch_vs_checkpoint"] = r["batch"] / max(peer["batch"], 1)
    command = "python benchmarks/bench_max_batch.py" + "".join(
        f" {shlex.quote(a)}" for a in (argv if argv is not None else sys.argv[1:]))
    text = report(rows, command)
    models.publish(text, args.out)
    if args.out:
        args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
