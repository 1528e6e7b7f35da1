"""The largest batch whose training step fits in a memory budget, each search in a fresh child process.

What counts against the budget is everything a trial allocates, at its peak: the model's weights, the input
batch, the gradients and one forward + backward (under ``compress()`` when compressed), measured as the child's
resident-set peak above its level before the model was built (``peak_memory.py``: glibc's mmap threshold
pinned, so freed tensors leave the RSS and trials do not hide each other's memory). The interpreter and the
libraries are not counted. Nothing kills the child at the budget: a batch fits when its measured peak is at or
below it (on CPU, RLIMIT_AS would count torch's large virtual reservations instead of memory used).

The search: a warm-up trial (one-time allocations of threads and lazy initialisation), two small batches
fit a line ``peak = fixed + per_sample * batch``, then regula falsi between the largest batch measured to fit
and the smallest measured not to (a trial goes at most 4x past the largest fit), each trial a real measured
step, until the two are within ``tolerance``. Children are forked from a ``forkserver`` that imported torch and
lightning_act once, so each search starts from a fresh process without paying the imports again; several may
run at once (memory is per process).

    python benchmarks/bench_max_batch.py [--budget-mib 384] [--bits 4 2] [--parallel 2]
"""
from __future__ import annotations

if __name__ == "__main__":  # pin glibc's mmap threshold before torch allocates anything (re-executes once)
    from peak_memory import ensure_fixed_mmap_threshold

    ensure_fixed_mmap_threshold()

import argparse  # noqa: E402
import gc  # noqa: E402
import math  # noqa: E402
import multiprocessing  # noqa: E402
import multiprocessing.connection  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

import lightning_act as act  # noqa: E402
import models  # noqa: E402
from peak_memory import peak_step_bytes  # noqa: E402

MiB = 2**20


def trial_peak(build, config: act.ACTConfig | None, batch: int) -> int:
    """Bytes the resident set grew to while building the model at ``batch`` and training one step."""
    made = {}

    def trial():
        model, loss_fn = made["model"] = build(batch)
        compressor = None if config is None else act.ActivationCompressor(model, config)
        models.train_step(model, loss_fn, compressor)

    peak = peak_step_bytes(trial)
    made.clear()
    gc.collect()
    return peak


def largest_batch(build, config: act.ACTConfig | None, budget: int, max_batch: int, tolerance: float = 0.03,
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
        connection.send(largest_batch(build, config, budget, max_batch, tolerance))
    finally:
        connection.close()


def search_in_children(jobs: list[dict], parallel: int = 1) -> list[dict]:
    """``largest_batch`` of each job (``builder`` in models.py, its ``options``, ``config``, ``budget`` bytes,
    ``max_batch``, ``tolerance``), each in a fresh child process, ``parallel`` at a time with a share of the
    torch threads each (each child measures its own resident set, so they do not see each other's memory); adds
    the seconds each search took."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["lightning_act", "models", "peak_memory", __name__])
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
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-mib", type=int, default=384)
    parser.add_argument("--bits", type=int, nargs="+", default=[4, 2])
    parser.add_argument("--max-batch", type=int, default=4096)
    parser.add_argument("--parallel", type=int, default=2, help="searches at a time")
    args = parser.parse_args(argv)
    configs = {"baseline": None, **{f"quantize {b}-bit": act.ACTConfig(bits=b, adaptive=False) for b in args.bits}}
    jobs = [{"builder": builder, "options": options, "config": config, "budget": args.budget_mib * MiB,
             "max_batch": args.max_batch, "tolerance": 0.03, "name": name}
            for builder, options in (("resnet", {"size": 32}), ("bert", {})) for name, config in configs.items()]
    print("| model | config | max batch |\n|---|---|---|")
    for job, found in zip(jobs, search_in_children(jobs, args.parallel)):
        print(f"| {job['builder']} {job['options']} | {job['name']} | {found['batch']} |")
    print(f"\nBudget {args.budget_mib} MiB per trial; {models.machine()}")


if __name__ == "__main__":
    main()
