"""Host time per saved tensor on the CUDA code path, measured on CPU (issue #20's proxy for GPU step time).

A GPU step hides host work only while the host spends less time per op than the GPU. This measures the host
side alone: the model is BERT-base-shaped (12 layers, hidden 768) at batch 1 and sequence 8, so the compute is
small (the vocabulary is cut to 1024 tokens: a dense 94 MB embedding gradient is work the compressor never sees,
and only adds noise to the plain step); the codecs take their CUDA path (``backend="cupy"``) on CPU tensors through a no-op kernel runner
(:func:`lightning_act.cuda.launcher.use_runner`), so every launcher, allocation, check, guard and record runs and
no kernel does. Two figures per configuration, medians over alternating repeats:

* step: (compressed step - the plain step run just before it) / saved tensors: everything the compressor adds,
  op tracking included, measured on steps without the hooks' clock;
* hooks: time inside the pack and unpack hooks / saved tensors (pack + unpack).

Each configuration runs twice: at BERT-base width (the issue's proxy) and at width 96 with the same 12 layers
and ops ("narrow", ``min_numel`` lowered to 256 so the same kinds of tensors are compressed). On a CPU the wide
model's compute streams 340 MB of weights through the caches between two hooks, so every hook starts with cold
caches (PyTorch's and the compressor's code and data evicted); a GPU host keeps the weights on the device, so
the narrow figure, whose caches stay warm, is the closer proxy of a GPU's host. Both are reported, and a third
model, ResNet-50 on a 2 x 32² batch (``MODELS``): a CNN's ops and saved tensors (run 6 on an H200's host measured
op tracking at 10 ms of its forward). On that host the same Python ran 2-3 times slower than on this project's
CPU (README, "On a GPU", sixth run): these figures rank changes, they do not bound the GPU step.

Times are the thread's CPU time (``time.thread_time``), not wall time: on a shared machine the wall clock also
counts the time other processes held the CPU. The hooks' clock reads its own cost too (two clock reads per hook
call); that cost, measured the same way around an empty call, is subtracted.

``--baseline DIR`` compares with another checkout of the package (``git worktree add DIR <commit>``): each round
runs one child process per code version, alternating, so both see the same machine load; medians over rounds.

``--tracking`` measures only the op tracker's cost per model (forwards without hooks, with and without a
``FunctionTracker``); with ``--baseline`` it compares the two checkouts' trackers.

``--compiled`` adds the narrow model ``torch.compile``'d, compressed inside its graphs by the kernel encode and
decode ops: host µs per compressed tensor (the compiled graphs run no hook for the others).

    python benchmarks/bench_host_overhead.py [--quick] [--repeats 15] [--baseline DIR --rounds 3] [--compiled]
                                             [--tracking] [--out FILE]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import lightning_act as act
from lightning_act.codecs import op_rules
from lightning_act.cuda.launcher import use_runner
from lightning_act.optrack import FunctionTracker
from models import MachineLoad, machine, publish

CONFIGS = {
    "quantize 4-bit": dict(bits=4, adaptive=False),
    "L1 (auto-precision bits)": dict(bits=4),
    "division": dict(codec="division"),
    "lorenzo": dict(codec="lorenzo", error_bound=1e-2),
}


class NoOpRunner:
    """A kernel runner that launches nothing: the host path of the CUDA backend, without kernels."""

    device_type = "cpu"

    def __init__(self):
        self.launches = 0

    def launch(self, source, kernel, grid, block, args, shared_mem, device) -> None:
        self.launches += 1


WIDTHS = {"BERT-base": (768, 4096), "narrow": (96, 256)}  # model -> (hidden size, the compressor's min_numel)
# ResNet-50 (its 53 convolutions, batch norms and ReLUs, and a max pool) on a 2 x 32² batch: a CNN's saved tensors
# and ops per step (481 and some 300), with min_numel lowered as for the narrow BERT; run 6 on an H200's host put
# op tracking at 10 ms of its forward, which the BERT rows did not show
MODELS = (*WIDTHS, "ResNet-50")
RESNET_MIN_NUMEL = 256


def resnet_50(batch: int = 2, size: int = 32):
    """ResNet-50 (``lightning_act.models.resnet50``, 10 classes), one fixed batch; ``(model, loss_fn)``."""
    from lightning_act.models import resnet50

    torch.manual_seed(0)
    model = resnet50(num_classes=10).train()
    x, y = torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,))
    return model, lambda: torch.nn.functional.cross_entropy(model(x), y)


def bert_base(layers: int = 12, seq: int = 8, batch: int = 1, hidden: int = 768, device: str | torch.device = "cpu"):
    """BERT-base from its config (random weights, nothing downloaded), one fixed batch; ``(model, loss_fn)``.
    ``hidden`` other than 768 keeps the layers, heads and ops and scales the widths."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=4 * hidden,
                        hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, vocab_size=1024)
    model = BertForSequenceClassification(config).train().to(device)
    ids = torch.randint(0, config.vocab_size, (batch, seq)).to(device)
    labels = torch.randint(0, 2, (batch,)).to(device)
    return model, lambda: model(input_ids=ids, labels=labels).loss


class _HookClock:
    """Adds up the thread CPU time spent inside the functions it wraps (a compressor's pack and unpack hooks),
    and counts the calls."""

    def __init__(self):
        self.seconds = 0.0
        self.calls = 0

    def wrap(self, fn):
        def timed(*args):
            start = time.thread_time()
            try:
                return fn(*args)
            finally:
                self.seconds += time.thread_time() - start
                self.calls += 1

        return timed

    def bias(self, calls: int = 20000) -> float:
        """Seconds this clock reports per call of a function that does nothing (its own cost)."""
        clock = _HookClock()
        empty = clock.wrap(lambda *args: None)
        for _ in range(calls):
            empty()
        return clock.seconds / calls


def plain_and_compressed_steps(compressor: act.ActivationCompressor, loss_fn):
    """``(plain, compressed)``: one forward and backward of ``loss_fn`` without and with ``compressor``."""
    def plain() -> None:
        loss_fn().backward()

    def compressed() -> None:
        with compressor.compress():
            loss = loss_fn()
        loss.backward()

    return plain, compressed


def measure(name: str, options: dict, layers: int, repeats: int, width: str = "BERT-base") -> dict:
    (model, loss_fn), min_numel = _model(width, layers)
    runner = NoOpRunner()
    with use_runner(runner):  # backend="cupy" needs CuPy unless a runner stands in
        compressor = act.ActivationCompressor(model, act.ACTConfig(backend="cupy", min_numel=min_numel, **options))
    clock = _HookClock()
    hooks = compressor._pack, compressor._unpack
    timed_hooks = clock.wrap(hooks[0]), clock.wrap(hooks[1])

    plain, compressed = plain_and_compressed_steps(compressor, loss_fn)
    # three steps take turns: plain, compressed (the step figure, no clock inside), compressed with the hooks
    # clocked (the hooks figure): the clock's own reads are system calls, which a whole-step figure must not count
    plain_times, compressed_times, hook_times = [], [], []
    bias = clock.bias()
    with use_runner(runner), torch.random.fork_rng():
        for i in range(repeats + 2):  # two warm-up rounds
            for step, times, clocked in ((plain, plain_times, False), (compressed, compressed_times, False),
                                         (compressed, None, True)):
                compressor._pack, compressor._unpack = timed_hooks if clocked else hooks
                model.zero_grad(set_to_none=True)
                clock.seconds, clock.calls = 0.0, 0
                start = time.thread_time()
                step()
                if i >= 2:
                    if clocked:
                        hook_times.append(clock.seconds - clock.calls * bias)
                    else:
                        times.append(time.thread_time() - start)
    stats = compressor.stats()
    saved = stats.num_saved
    # each compressed step against the plain step run just before it: the machine's drift cancels
    step_us = statistics.median(c - p for c, p in zip(compressed_times, plain_times)) / saved * 1e6
    return {"config": name, "model": width, "saved": saved, "compressed": stats.num_compressed,
            "launches_per_step": runner.launches / (2 * (repeats + 2)),
            "step_us_per_saved": step_us, "hook_us_per_saved": statistics.median(hook_times) / saved * 1e6,
            "plain_ms": statistics.median(plain_times) * 1e3}


def _model(width: str, layers: int):
    """``((model, loss_fn), min_numel)`` of one of ``MODELS``."""
    if width == "ResNet-50":
        return resnet_50(), RESNET_MIN_NUMEL
    hidden, min_numel = WIDTHS[width]
    return bert_base(layers, hidden=hidden), min_numel


def measure_tracking(width: str, layers: int, repeats: int) -> dict:
    """The op tracker's own cost: forwards (no hooks) without and with a ``FunctionTracker`` of the op rules'
    functions, taking turns; ms a forward, medians of the pairs' differences."""
    (model, loss_fn), _ = _model(width, layers)
    functions = op_rules.tracked_functions()
    plain, tracked = [], []
    for i in range(repeats + 2):  # two warm-up rounds
        for times, tracker in ((plain, None), (tracked, FunctionTracker(functions))):
            start = time.thread_time()
            with tracker if tracker is not None else contextlib.nullcontext():
                loss = loss_fn()
            if i >= 2:
                times.append(time.thread_time() - start)
            loss.backward()
    return {"model": width, "config": "op tracking only", "untracked_ms": statistics.median(plain) * 1e3,
            "tracking_ms": statistics.median(t - p for t, p in zip(tracked, plain)) * 1e3}


def tracking_table(before: list[list[dict]] | None, after: list[list[dict]]) -> str:
    """Op tracking ms a forward per model (medians over rounds), before -> after when there is a before."""
    lines = ["| model | forward ms, untracked | op tracking ms a forward" + (", before -> after |" if before else " |"),
             "|---|---|---|"]
    for i, row in enumerate(after[0]):
        def median(rounds, key):
            return statistics.median(r[i][key] for r in rounds)

        figure = f"{median(after, 'tracking_ms'):.2f}"
        if before:
            figure = f"{median(before, 'tracking_ms'):.2f} -> {figure}"
        lines.append(f"| {row['model']} | {median(after, 'untracked_ms'):.1f} | {figure} |")
    return "\n".join(lines)


def measure_compiled(layers: int, repeats: int) -> dict:
    """The narrow model ``model.compile()``'d, alone and compressed at 4 bits inside its graphs with the kernel
    encode op (``lightning_act::quantize``: what CUDA with CuPy runs; the backward decodes by inlined traced ops),
    turns taken; (compressed step - the plain one) / the tensors the compiled graphs compress. Each compiles
    first."""
    hidden, min_numel = WIDTHS["narrow"]
    (plain_model, plain_loss), (model, loss_fn) = bert_base(layers, hidden=hidden), bert_base(layers, hidden=hidden)
    plain_model.compile()
    model.compile()
    runner = NoOpRunner()
    with use_runner(runner):
        compressor = act.ActivationCompressor(model, act.ACTConfig(bits=4, adaptive=False, backend="cupy",
                                                                   min_numel=min_numel))

        def compressed() -> None:
            with compressor.compress():
                loss = loss_fn()
            loss.backward()

        started = time.perf_counter()
        compressed()
        compile_s = time.perf_counter() - started
        plain_loss().backward()
        runner.launches = 0
        plain_times, compressed_times = [], []
        for _ in range(repeats):
            for step, times, net in ((lambda: plain_loss().backward(), plain_times, plain_model),
                                     (compressed, compressed_times, model)):
                net.zero_grad(set_to_none=True)
                start = time.thread_time()
                step()
                times.append(time.thread_time() - start)
    records = [r for r in compressor.stats().records if r.phase == "compiled"]
    compiled = len(records)
    return {"config": "compiled, quantize 4-bit (kernel ops)", "model": "narrow", "compressed": compiled,
            "quantized": sum(r.codec == "quantize" for r in records),
            "launches_per_step": runner.launches / repeats, "compile_s": compile_s,
            "step_us_per_compressed": statistics.median(c - p for c, p in zip(compressed_times, plain_times))
            / compiled * 1e6, "plain_ms": statistics.median(plain_times) * 1e3}


def compiled_table(rows: list[dict]) -> str:
    lines = ["| model | config | tensors compressed in the graphs | kernel launches / step | host µs per compressed "
             "tensor: step | compiled plain step ms (CPU) | first compressed step s (compiling) |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['config']} | {r['compressed']} | {r['launches_per_step']:.0f} | "
              f"{r['step_us_per_compressed']:.1f} | {r['plain_ms']:.1f} | {r['compile_s']:.0f} |" for r in rows]
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    lines = ["| model | config | saved tensors (compressed) | kernel launches / step | host µs per saved tensor: "
             "step | hooks only | plain step ms (CPU) |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['config']} | {r['saved']} ({r['compressed']}) | {r['launches_per_step']:.0f} | "
              f"{r['step_us_per_saved']:.1f} | {r['hook_us_per_saved']:.1f} | {r['plain_ms']:.1f} |" for r in rows]
    return "\n".join(lines)


def comparison_table(before: list[list[dict]], after: list[list[dict]]) -> str:
    """Medians over rounds, before -> after, per configuration."""
    lines = ["| model | config | host µs per saved tensor: step, before -> after | hooks only, before -> after |",
             "|---|---|---|---|"]
    for i, row in enumerate(after[0]):
        def median(rounds, key):
            return statistics.median(r[i][key] for r in rounds)

        lines.append(f"| {row['model']} | {row['config']} | {median(before, 'step_us_per_saved'):.1f} -> "
                     f"{median(after, 'step_us_per_saved'):.1f} | {median(before, 'hook_us_per_saved'):.1f} -> "
                     f"{median(after, 'hook_us_per_saved'):.1f} |")
    return "\n".join(lines)


def run(quick: bool = False, repeats: int = 15, tracking: bool = False) -> list[dict]:
    layers, repeats = (2, 3) if quick else (12, repeats)
    if tracking:
        return [measure_tracking(width, layers, repeats) for width in MODELS]
    configs = dict(list(CONFIGS.items())[:2]) if quick else CONFIGS
    return [measure(name, options, layers, repeats, width) for width in MODELS for name, options in configs.items()]


def _child(package_root: Path | None, quick: bool, repeats: int, tracking: bool = False) -> list[dict]:
    """This script's measurement in a fresh process, importing ``lightning_act`` from ``package_root`` (the
    checkout this script belongs to when None)."""
    root = package_root or Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, __file__, "--json", "--repeats", str(repeats)] + (["--quick"] if quick else []) + \
        (["--tracking"] if tracking else [])
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 layers, 3 repeats, 2 configs (the test's mode)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--baseline", type=Path, help="a checkout of the package to compare with")
    parser.add_argument("--rounds", type=int, default=3, help="child processes per code version (--baseline)")
    parser.add_argument("--out", type=Path, help="write the results here (markdown)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON (what --baseline reads)")
    parser.add_argument("--compiled", action="store_true",
                        help="also the narrow model torch.compile'd, compressed inside its graphs (compiles for a "
                             "minute or more; 1 layer with --quick)")
    parser.add_argument("--tracking", action="store_true",
                        help="only the op tracker's cost: forwards without and with a FunctionTracker, per model")
    args = parser.parse_args()
    torch.set_num_threads(1)  # host overhead is single-threaded Python; one thread keeps the plain step steady
    if args.json:
        print(json.dumps(run(args.quick, args.repeats, args.tracking)))
        return
    if args.tracking:
        before, after = [], []
        for _ in range(args.rounds if args.baseline else 1):
            if args.baseline:
                before.append(_child(args.baseline.resolve(), args.quick, args.repeats, tracking=True))
            after.append(_child(None, args.quick, args.repeats, tracking=True))
        text = (f"{machine()}; forwards without hooks, thread CPU time, medians\n\nCommand: `python "
                f"benchmarks/bench_host_overhead.py {' '.join(sys.argv[1:])}`\n\n"
                + (f"Before: {args.baseline}; after: this checkout. {args.rounds} rounds, each a child process per "
                   "version, alternating.\n\n" if args.baseline else "") + tracking_table(before, after) + "\n")
        publish(text, args.out)
        return
    header = (f"{machine()}; BERT-base shape, batch 1 x 8 tokens, and ResNet-50 at 2 x 32², no-op kernels; thread "
              "CPU time, medians\n\n"
              f"Command: `python benchmarks/bench_host_overhead.py {' '.join(sys.argv[1:])}`\n")
    with MachineLoad() as load:
        if args.baseline is None:
            rows = run(args.quick, args.repeats)
            body = table(rows)
        else:
            before, after = [], []
            for _ in range(args.rounds):
                before.append(_child(args.baseline.resolve(), args.quick, args.repeats))
                after.append(_child(None, args.quick, args.repeats))
            rows = after[-1]
            body = (f"Before: {args.baseline}; after: this checkout. {args.rounds} rounds, each a child process "
                    f"per version, alternating.\n\n{comparison_table(before, after)}\n\nAfter, last round:\n\n"
                    f"{table(rows)}")
        if args.compiled:
            compiled_rows = [measure_compiled(1 if args.quick else 12, 3 if args.quick else args.repeats)]
            body += ("\n\nCompiled (`model.compile()`), the kernel ops per compressed tensor and nothing per other "
                     f"saved tensor:\n\n{compiled_table(compiled_rows)}")
    summary = load.summary()
    publish(f"{header}\n{body}\n\nMachine load while this ran: {summary['other_cores']:.2f} other cores busy on "
            f"average, load average {summary['loadavg_start']:.1f} -> {summary['loadavg_end']:.1f}\n\n"
            f"{headline(rows)}\n", args.out)


def headline(rows: list[dict]) -> str:
    """The figure in one line, last in the report (what a glance at its tail reads): hooks-only host µs per saved
    tensor of each model for the first configuration."""
    first = rows[0]["config"]
    figures = ", ".join(f"{r['model']} {r['hook_us_per_saved']:.1f}" for r in rows if r["config"] == first)
    return f"Hooks only, host µs per saved tensor ({first}): {figures} (issue #20: at most 30, goal 15)"


if __name__ == "__main__":
    main()
