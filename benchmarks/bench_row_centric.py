"""Peak memory and step time of RowCentric (LR-CNN OverL / 2PS, and their -H variants) on CPU.

One training step (forward, ``sum()``, backward) of a VGG-style conv stack is measured side by
side for: the plain stack, ``torch.utils.checkpoint`` of the whole stack (non-reentrant), and
RowCentric with rows 1, 2, 4, 8 in both modes, with and without ``checkpoint_groups=2`` (-H).

Peak memory: the step runs under ``torch.profiler.profile(profile_memory=True)``; the CPU
allocator's ``[memory]`` events (signed byte counts) are summed in time order and the maximum of
the running total is the step's peak above what was allocated before it (input and weights are
allocated beforehand, so the number is activations + gradients + workspaces). The estimate
column is ``RowCentric.plan(..., rows=r).peak_bytes``, the planner's model of the same step.

Time: each configuration's steps alternate with plain-stack steps (no profiler); the ratio of the
fastest of ``--repeats`` of each (the minimum is least disturbed by other processes on a shared
machine, alternating cancels slow drifts in machine load).

Usage: ``python benchmarks/bench_row_centric.py [--size 160] [--batch 2] [--repeats 3] [--out FILE]``
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_act.nn import RowCentric
from lightning_act.profiling import measure_step_memory


def vgg_stack() -> nn.Sequential:
    def block(c_in: int, c_out: int) -> list[nn.Module]:
        return [nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU(inplace=True)]

    return nn.Sequential(*block(3, 16), *block(16, 16), nn.MaxPool2d(2),
                         *block(16, 32), *block(32, 32), nn.MaxPool2d(2),
                         *block(32, 64), *block(64, 64))


def peak_bytes(step) -> int:
    """Peak of CPU bytes allocated during ``step()`` above the level at its start (profiler events)."""
    return measure_step_memory(step).peak_bytes


def time_ratio(step: Callable[[], None], plain: Callable[[], None], repeats: int) -> float:
    """Fastest ``step`` over fastest ``plain``, the two alternating."""
    step(), plain()  # warm-up
    times: dict[Callable[[], None], list[float]] = {step: [], plain: []}
    for _ in range(repeats):
        for fn in (step, plain):
            start = time.perf_counter()
            fn()
            times[fn].append(time.perf_counter() - start)
    return min(times[step]) / min(times[plain])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=128, help="input height and width")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="also write the markdown table to this file")
    args = parser.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(2)
    stack = vgg_stack()
    shape = (args.batch, 3, args.size, args.size)
    x = torch.randn(shape)

    def step_of(model: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], None]:
        def step() -> None:
            model(x).sum().backward()
            stack.zero_grad(set_to_none=True)
        return step

    configs: list[tuple[str, Callable[[], None], int | None]] = [
        ("plain stack", step_of(stack), None),
        ("checkpoint (whole stack)", step_of(lambda t: checkpoint(stack, t, use_reentrant=False)), None),
    ]
    for groups, suffix in ((None, ""), (2, "-H")):
        for mode, label in (("overlap", "OverL"), ("share", "2PS")):
            for rows in (1, 2, 4, 8):
                model = RowCentric(stack, rows=rows, mode=mode, checkpoint_groups=groups)
                estimate = RowCentric.plan(stack, shape, rows=rows, mode=mode, checkpoint_groups=groups).peak_bytes
                configs.append((f"{label}{suffix} rows={rows}", step_of(model), estimate))

    # Timing first: a finished profiler session can leave the process slower for a while.
    ratios = [time_ratio(step, configs[0][1], args.repeats) for _, step, _ in configs]
    mib = 2.0 ** 20
    lines = [
        f"RowCentric on a VGG-style stack (6 conv + 2 max-pool), input {shape}, fp32, CPU, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}",
        "",
        "| configuration | measured peak (MiB) | vs plain | planner estimate (MiB) | step time vs plain |",
        "|---|---:|---:|---:|---:|",
    ]
    plain_peak = None
    for (name, step, estimate), ratio in zip(configs, ratios):
        peak = peak_bytes(step)
        plain_peak = plain_peak or peak
        estimate_text = "" if estimate is None else f"{estimate / mib:.1f}"
        lines.append(f"| {name} | {peak / mib:.1f} | {peak / plain_peak:.2f} | {estimate_text} | {ratio:.2f} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(table + "\n")


if __name__ == "__main__":
    main()
