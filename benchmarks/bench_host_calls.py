"""Host µs per call of each layer of the per-tensor path, on one device (issue #20): where a GPU host's time per
compressed tensor goes, in eager steps and in compiled ones.

1. Calls: each layer of the path, from a bare ``torch.empty`` to the compiled graphs' dispatcher ops
   (``lightning_act::quantize``, ``::dequantize_buffer``) and the eager engine's pack and unpack hooks, called
   ``--calls`` times on a small tensor (4096 bf16 elements: its kernels take a few µs, so the clock reads the
   host's time), in 5 rounds, the device synchronised around each: wall µs per call in the best round. Each runs
   in the calling thread and in a second thread: autograd runs a CUDA backward, where the decodes are, in a thread
   of its own.
2. Steps: the narrow BERT of ``bench_host_overhead`` (hidden 96, batch 1 x 8 tokens: host-bound on a GPU) eager
   and ``torch.compile``'d, each plain and compressed at 4 bits, taking turns: wall ms per step (medians) and the
   compressed step's extra time per compressed tensor.

On CPU the codecs take their CUDA path through a no-op kernel runner (nothing is launched), as in
``bench_host_overhead``; on CUDA they launch the CuPy kernels.

    python benchmarks/bench_host_calls.py [--device cuda] [--calls 2000] [--layers 2] [--repeats 10]
                                          [--no-compile] [--out FILE]
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import threading
import time
from pathlib import Path

import torch
from bench_host_overhead import NoOpRunner, bert_base, plain_and_compressed_steps
from models import machine, publish

import lightning_act as act
from lightning_act import compiled_regions
from lightning_act.cuda import launcher
from lightning_act.cuda.launcher import use_runner

NUMEL = 4096


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def per_call_us(fn, calls: int, device: torch.device, in_thread: bool, rounds: int = 5) -> float:
    """Wall µs per call of ``fn``: the best of ``rounds`` rounds of ``calls // rounds`` calls (after one), the
    device synchronised around each round (the best round: what the calls cost when nothing else runs), in this
    thread or in a new one."""
    result = []
    per_round = max(1, calls // rounds)

    def loop() -> None:
        fn()
        best = float("inf")
        for _ in range(rounds):
            _synchronize(device)
            start = time.perf_counter()
            for _ in range(per_round):
                fn()
            _synchronize(device)
            best = min(best, time.perf_counter() - start)
        result.append(best / per_round * 1e6)

    if in_thread:
        thread = threading.Thread(target=loop)
        thread.start()
        thread.join()
    else:
        loop()
    return result[0]


def _compressor(model: torch.nn.Module) -> act.ActivationCompressor:
    return act.ActivationCompressor(model, act.ACTConfig(bits=4, adaptive=False, backend="cupy", min_numel=256))


class _ArgumentRecorder:
    """A kernel runner that launches nothing and keeps the last launch's arguments."""

    def __init__(self, device_type: str):
        self.device_type, self.args = device_type, ()

    def launch(self, source, kernel, grid, block, args, shared_mem, device) -> None:
        self.args = tuple(args)


def call_items(device: torch.device) -> tuple[dict, tuple]:
    """``(name -> a no-argument callable, what they need kept alive)``: the layers of the path a saved tensor
    takes, innermost first."""
    linear = torch.nn.Linear(8, 8).to(device)
    compressor = _compressor(linear)
    with compressor.compress():  # a step, so the graph hooks have a last step to record into
        loss = linear(torch.randn(4, 8, device=device)).sum()
    loss.backward()
    hooks = compiled_regions.GraphHooks(compressor)
    codec = compressor.codec("quantize", 4)
    x = torch.randn(NUMEL, device=device, dtype=torch.bfloat16)
    path = codec.kernel_path(x, x.dtype)
    if path is None:
        raise RuntimeError(f"the quantize codec does not run its kernel path on {device}")
    kernels, runner = path
    stored = kernels.encode(x, 1, runner)
    packed = codec.encode(x, key=1)
    args = (4, codec.group_size, codec.stats_dtype, hooks.owner)
    buffer = compiled_regions.quantize(x, *args)
    decode_args = (buffer, NUMEL, 4, codec.group_size, x.dtype, codec.stats_dtype, hooks.owner)
    ops = torch.ops.lightning_act
    # a quantize encode's arguments as its launcher hands them over, packed as the driver launch packs them
    recorder = _ArgumentRecorder(device.type)
    kernels.encode(x, 1, recorder)
    encode_args = recorder.args
    arguments = launcher.KernelArguments(encode_args)
    items = {
        "torch.empty": lambda: torch.empty(NUMEL, dtype=x.dtype, device=device),
        "kernel arguments: pack (the driver launch's host work before cuLaunchKernel)":
            lambda: arguments.pack(*encode_args),
        "kernel encode (QuantizeKernels.encode)": lambda: kernels.encode(x, 1, runner),
    }
    if isinstance(runner, launcher.CupyRunner):  # the same encode through CuPy's call (the launch before the driver's)
        other = launcher.CupyRunner(launch="cupy" if runner.launch_mode == "driver" else "driver")
        items[f"kernel encode, launch={other.launch_mode!r}"] = lambda: kernels.encode(x, 1, other)
    items.update({
        "kernel decode (QuantizeKernels.decode)": lambda: kernels.decode(stored, x.shape, x.dtype, runner),
        "codec.encode": lambda: codec.encode(x, key=1),
        "codec.decode": lambda: codec.decode(packed),
        "compiled op quantize, its Python kernel": lambda: compiled_regions.quantize(x, *args),
        "compiled op quantize, through the dispatcher": lambda: ops.quantize.default(x, *args),
        "compiled op dequantize_buffer, its Python kernel": lambda: compiled_regions.dequantize_buffer(*decode_args),
        "compiled op dequantize_buffer, through the dispatcher": lambda: ops.dequantize_buffer.default(*decode_args),
        "GraphHooks.record": lambda: hooks.record(NUMEL, x.dtype, 4, 2048),
    })
    return items, (compressor, hooks)  # GraphHooks hold their compressor weakly


def measure_calls(device: torch.device, calls: int) -> list[dict]:
    items, (compressor, hooks) = call_items(device)
    rows = [{"call": name, "main_us": per_call_us(fn, calls, device, False),
             "thread_us": per_call_us(fn, calls, device, True)} for name, fn in items.items()]
    # the eager engine's hooks on a step's records, as autograd calls them: each call a tensor not seen before (the
    # step's de-duplication would find a repeated one), an op's output of the same size; outside compress(), whose
    # op tracker would see the hooks' own torch calls (autograd runs the hooks inside an op, where it does not)
    weight = torch.ones(NUMEL, device=device, dtype=torch.bfloat16, requires_grad=True)
    with compressor.compress():
        pack = functools.partial(compressor._pack, compressor.current_step)
    row = {"call": "eager hooks: pack + unpack"}
    for column, in_thread in (("main_us", False), ("thread_us", True)):
        fresh = iter([weight * 1 for _ in range(calls + 1)])
        row[column] = per_call_us(lambda: compressor._unpack(pack(next(fresh))), calls, device, in_thread)
    rows.append(row)
    del hooks
    return rows


def measure_steps(device: torch.device, layers: int, repeats: int, compile_models: bool) -> list[dict]:
    """Eager (and compiled) narrow BERT, plain and 4-bit, taking turns; wall ms medians and the extra µs per
    compressed tensor."""
    rows = []
    for compiled in (False, True) if compile_models else (False,):
        model, loss_fn = bert_base(layers, hidden=96, device=device)
        if compiled:
            model.compile()
        compressor = _compressor(model)
        plain, compressed = plain_and_compressed_steps(compressor, loss_fn)
        times = {plain: [], compressed: []}
        started = time.perf_counter()
        compressed()
        plain()
        first_s = time.perf_counter() - started
        for _ in range(repeats):
            for step, found in times.items():
                model.zero_grad(set_to_none=True)
                _synchronize(device)
                start = time.perf_counter()
                step()
                _synchronize(device)
                found.append(time.perf_counter() - start)
        stats = compressor.stats()  # a compiled step records the tensors its graphs compressed, and only those
        count = stats.num_compressed
        extra = statistics.median(c - p for p, c in zip(times[plain], times[compressed]))
        rows.append({"model": "compiled" if compiled else "eager", "compressed": count,
                     "plain_ms": statistics.median(times[plain]) * 1e3,
                     "compressed_ms": statistics.median(times[compressed]) * 1e3,
                     "us_per_compressed": extra / max(count, 1) * 1e6, "first_s": first_s})
    return rows


def report(device: torch.device, calls: list[dict], steps: list[dict], command: str) -> str:
    lines = [f"# Host µs per call on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}",
             "", f"{machine()}. Command: `{command}`", "",
             f"Calls on a {NUMEL}-element bfloat16 tensor, wall µs per call (the best of 5 rounds, the device "
             "synchronised around each):",
             "", "| call | this thread | a second thread |", "|---|---|---|"]
    lines += [f"| {r['call']} | {r['main_us']:.1f} | {r['thread_us']:.1f} |" for r in calls]
    if steps:
        lines += ["", "Narrow BERT steps (hidden 96, batch 1 x 8), plain and 4-bit taking turns, wall ms medians:", "",
                  "| model | tensors compressed | plain ms | 4-bit ms | extra µs per compressed tensor | "
                  "first steps s |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['compressed']} | {r['plain_ms']:.2f} | {r['compressed_ms']:.2f} | "
                  f"{r['us_per_compressed']:.1f} | {r['first_s']:.1f} |" for r in steps]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu (a no-op kernel runner) or cuda (the CuPy kernels)")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled model (it compiles first)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.device.split(":")[0] not in ("cpu", "cuda"):
        raise ValueError(f"--device {args.device}; expected cpu or cuda")
    device = torch.device(args.device)
    with use_runner(NoOpRunner()) if device.type == "cpu" else contextlib.nullcontext():
        calls = measure_calls(device, args.calls)
        steps = measure_steps(device, args.layers, args.repeats, not args.no_compile)
    command = "python benchmarks/bench_host_calls.py " + " ".join(argv if argv is not None else [])
    publish(report(device, calls, steps, command.strip()), args.out)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
