"""What bounds the quantize kernels on a GPU (issue #20): device time per launch across the choices that set it.

The H100 runs put the quantize kernels far under their roofline (``roofline_cuda.md``). In the third run's
profiled ResNet-50 step (device times), 104 bfloat16 encodes of 14 M elements on average took 72 µs each: 4.4 GB
read and written in 7.6 ms (17% of HBM), about one element per multiprocessor clock; the 110 decodes took 33 µs
each, about two; the mask kernels of the same step moved 2.2-2.5 TB/s. (``bench_torch_path``'s GPU rates time
each call with the host's launch and a synchronisation around it, so they bound the kernels from below only.)
The design's own counts (16 instructions an element for a bfloat16 decode, 32 KB in flight per SM) predict
several times that. This sweep separates the candidate bounds, one knob at a time, on one activation
(``--shape``, default 16 x 256 x 56 x 56):

- ``grid``: the grid sized for ``factor`` x the SM count (0.25 to 4; 1 is what the launcher uses): latency-bound
  kernels speed up with more blocks in flight, issue-bound ones do not;
- ``group``: group sizes 64, 256 and 1024 (teams of a quarter warp, one warp, four warps: the shuffle and
  shared-memory reductions);
- ``bits`` 2, 4, 8 and the dtypes float32 and bfloat16 (bytes per element against work per element);
- the same tensor's ``copy_`` (the bandwidth reference) and the positive-mask encode and decode (the kernels that
  run near it);
- ablations (``--ablations``, default all): the encode at the launcher's choice with one part of its work removed
  from the source (the noise hash, the statistics' rounding, the team's min/max reduction; then all three, leaving
  the loads and stores), compiled apart: what each part costs. An H200 ran the encode at about 1.4 elements per SM
  clock whatever the grid (0.5-4x the SMs), group size or bits, and removing its branches gained 10-17%
  (kernel_sweep_gpu_run5b.md): neither latency nor the one branch per element bounds it.

Each row: µs per launch from CUDA events around ``--calls`` launches (the tensor is large enough that the device, not
the host, sets the pace), GB/s of bytes read plus written, its fraction of ``copy_``'s, and elements per SM clock.
Needs CUDA and CuPy (exit 2 otherwise); ``--emulate`` runs the same code path on CPU through the test suite's
emulator (``PYTHONPATH=.``; tiny shapes, times meaningless), which is how the tests keep it working.

    python benchmarks/bench_kernel_sweep.py [--shape 16 256 56 56] [--calls 20] [--ablations NAME ...] [--out FILE]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from lightning_act.cuda import launcher
from lightning_act.cuda.masks import mask_decode_packed, mask_encode_packed
from lightning_act.cuda.quantize import SOURCE, _launch_config, dequantize_cuda, quantize_cuda
from lightning_act.formats._bitpack import packed_nbytes
from models import machine, publish

NO_CUDA_EXIT = 2
GRID_FACTORS = (0.25, 0.5, 1, 2, 4)
GROUPS = (64, 256, 1024)
BITS = (2, 4, 8)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class ScaledGrid:
    """A runner that hands launches to ``runner`` but reports ``factor`` x its SM count, so the launchers size the
    grid for that many multiprocessors (their plans are cached per count)."""

    def __init__(self, runner: launcher.KernelRunner, factor: float):
        self.runner, self.factor, self.device_type = runner, factor, runner.device_type

    def multiprocessors(self, device: torch.device) -> int:
        return max(1, round(launcher.multiprocessors(self.runner, device) * self.factor))

    def launch(self, *args) -> None:
        self.runner.launch(*args)


# Parts of the encode removed one at a time (source text -> its replacement in quantize.cu): what is left runs the
# same loads, stores and grid, so each ablated row's time against the full encode's is what that part costs.
# The outputs of an ablated kernel are meaningless; only its time is read.
ABLATIONS = {
    "without the noise hash": [("uniform24_element(noise, j)", "0.5f")],
    "without the statistics' rounding": [
        ("round_stats(lo[s], hi[s], levels, stats_dtype, mn_out, step_out, group,\n"
         "                        q.chunk == 0 && group < groups, &mn, &step);", "mn = lo[s];\n step = hi[s];")],
    "without the team's reduction": [
        ("lo[s] = fminf(lo[s], __shfl_xor_sync(FULL_WARP, lo[s], offset));", ""),
        ("hi[s] = fmaxf(hi[s], __shfl_xor_sync(FULL_WARP, hi[s], offset));", "")],
}
ABLATIONS["loads and stores alone"] = [patch for patches in ABLATIONS.values() for patch in patches]
# not a removal: a cheaper noise spec timed before adopting it (one hash per two elements, 16 bits of noise each)
ABLATIONS["one noise hash per two elements"] = [(
    "uniform24_element(noise, j)",
    "__fmul_rn((float)((mix32_rest(noise ^ (unsigned int)(j >> 1)) >> ((j & 1) << 4)) & 0xFFFFu), 1.52587890625e-05f)")]


def ablated_source(name: str) -> str:
    """quantize.cu as the launcher compiles it, with ablation ``name``'s parts removed; a ValueError where the
    kernel no longer holds the text a part names (the sweep must follow the kernel's changes)."""
    text = launcher.kernel_source(SOURCE)
    for old, new in ABLATIONS[name]:
        if text.count(old) != 1:
            raise ValueError(f"ablation {name!r}: {old!r} occurs {text.count(old)} times in {SOURCE}; expected once")
        text = text.replace(old, new)
    return text


class Ablated:
    """A runner that launches the kernels of ``SOURCE`` from ``text`` (an ablated source) instead, on the GPU
    through CuPy's call, on CPU through the emulator; other sources go to ``runner``."""

    def __init__(self, runner: launcher.KernelRunner, text: str, name: str):
        self.runner, self.device_type = runner, runner.device_type
        self._launches = {}  # (kernel, raw stream) -> (function, CuPy stream): no host work a launch can skip, so
        # the launches of a short ablated kernel stay paced by the device, not by the host
        if self.device_type == "cuda":
            from lightning_act.cuda import require_cupy

            self._cupy = require_cupy()
            self._module = self._cupy.RawModule(code=text, options=launcher.NVRTC_OPTIONS)
        else:
            from tests.cuda_emulation.emulator import EmulatedModule

            self._module = EmulatedModule(text=text, name=f"ablated-{name.replace(' ', '-')}.cu")

    def multiprocessors(self, device: torch.device) -> int:
        return launcher.multiprocessors(self.runner, device)

    def launch(self, source, kernel, grid, block, args, shared_mem, device) -> None:
        if source != SOURCE:
            self.runner.launch(source, kernel, grid, block, args, shared_mem, device)
        elif self.device_type == "cuda":
            raw = torch.cuda.current_stream(device).cuda_stream
            found = self._launches.get((kernel, raw))
            if found is None:
                found = self._launches[(kernel, raw)] = (self._module.get_function(kernel),
                                                         self._cupy.cuda.ExternalStream(raw, device.index))
            function, stream = found
            function(tuple(grid), tuple(block), tuple(args), shared_mem=shared_mem, stream=stream)
        else:
            self._module.launch(kernel, grid, block, args, shared_mem)


SLEEP_CYCLES_PER_CALL = 200_000


class Timer:
    """Seconds per call of ``fn``: CUDA events around ``calls`` calls on a GPU (the median of 3 such rounds), the
    wall clock elsewhere."""

    def __init__(self, device: torch.device, calls: int):
        self.device, self.calls = device, calls

    def __call__(self, fn) -> float:
        fn()  # compiles, plans, allocates once
        rounds = []
        for _ in range(3):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                # the device sleeps while the host queues the round (up to 100 µs a call at 2 GHz): the events then
                # time the kernels back to back, not a host slower than them (run 6's host made every
                # ablated encode look slower than the whole one)
                torch.cuda._sleep(self.calls * SLEEP_CYCLES_PER_CALL)
                start.record()
                for _ in range(self.calls):
                    fn()
                end.record()
                end.synchronize()
                rounds.append(start.elapsed_time(end) / 1e3 / self.calls)
            else:
                started = time.perf_counter()
                for _ in range(self.calls):
                    fn()
                rounds.append((time.perf_counter() - started) / self.calls)
        return statistics.median(rounds)


def _row(kernel: str, x: torch.Tensor, seconds: float, moved: int, clock_hz: float, sms: int, **knobs) -> dict:
    return {"kernel": kernel, "dtype": str(x.dtype).removeprefix("torch."), **knobs, "us": seconds * 1e6,
            "gbps": moved / seconds / 1e9, "elements_per_sm_clock": x.numel() / seconds / (sms * clock_hz)}


def sweep(shape: tuple[int, ...], calls: int, runner: launcher.KernelRunner, device: torch.device,
          clock_hz: float, ablations: list[str] = list(ABLATIONS)) -> list[dict]:
    """The rows: per dtype, ``copy_`` and the mask kernels, then quantize encode and decode across the knobs (each
    knob varied from the launcher's choice: grid factor 1, group 256, 4 bits), then the encode at the launcher's
    choice with each of ``ablations`` (names in ``ABLATIONS``)."""
    timer, sms, rows = Timer(device, calls), launcher.multiprocessors(runner, device), []
    ablated_runners = {name: Ablated(runner, ablated_source(name), name) for name in ablations}  # compiled once
    for dtype in DTYPES.values():
        x = torch.randn(shape, device=device).relu_().to(dtype)
        n, size = x.numel(), x.element_size()
        out = torch.empty_like(x)
        rows.append(_row("copy_", x, timer(lambda: out.copy_(x)), 2 * n * size, clock_hz, sms))
        bits = mask_encode_packed(x, True, runner=runner)
        rows.append(_row("mask_encode", x, timer(lambda: mask_encode_packed(x, True, runner=runner)),
                         n * size + bits.numel(), clock_hz, sms))
        rows.append(_row("mask_decode", x, timer(lambda: mask_decode_packed(bits, x.shape, dtype, runner=runner)),
                         n * size + bits.numel(), clock_hz, sms))
        flat = x.view(-1)
        knobs = [(f, 256, 4) for f in GRID_FACTORS] + [(1, g, 4) for g in GROUPS if g != 256] + \
                [(1, 256, b) for b in BITS if b != 4]
        for factor, group, b in knobs:
            scaled = ScaledGrid(runner, factor)
            grid, block, _ = _launch_config(n, group, scaled.multiprocessors(device))
            encoded = quantize_cuda(flat, b, group, torch.float32, 0, 1, runner=scaled)
            stored = packed_nbytes(n, b) + 2 * 4 * -(-n // group)
            shape_knobs = {"factor": factor, "group": group, "bits": b, "grid": f"{grid[0]} x {block[0]}"}
            rows.append(_row("quantize_encode", x, timer(
                lambda: quantize_cuda(flat, b, group, torch.float32, 0, 1, runner=scaled, checked=False)),
                n * size + stored, clock_hz, sms, **shape_knobs))
            rows.append(_row("quantize_decode", x, timer(
                lambda: dequantize_cuda(*encoded, n, b, group, dtype, runner=scaled, checked=False)),
                n * size + stored, clock_hz, sms, **shape_knobs))
        for name, ablated in ablated_runners.items():
            stored = packed_nbytes(n, 4) + 2 * 4 * -(-n // 256)
            rows.append(_row(f"quantize_encode, {name}", x, timer(
                lambda: quantize_cuda(flat, 4, 256, torch.float32, 0, 1, runner=ablated, checked=False)),
                n * size + stored, clock_hz, sms, factor=1, group=256, bits=4))
    copies = {r["dtype"]: r["gbps"] for r in rows if r["kernel"] == "copy_"}
    for r in rows:
        r["of_copy"] = r["gbps"] / copies[r["dtype"]]
    return rows


def report(rows: list[dict], device_name: str, shape: tuple[int, ...], command: str) -> str:
    lines = [f"# Kernel sweep on {device_name}", "", f"{machine()}. Command: `{command}`", "",
             f"One {' x '.join(map(str, shape))} ReLU'd activation; µs per launch (CUDA events around each round of "
             "launches, the median of 3 rounds); GB/s of bytes read plus written; `of copy_`: that over the same "
             "dtype's `copy_`; elements per SM clock: elements / time / (SMs x clock). Knobs: grid sized for factor "
             "x the SMs (1: the launcher's), group size, bits (float32 statistics).", "",
             "| kernel | dtype | factor | group | bits | grid x block | µs | GB/s | of copy_ | elements / SM clock |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['kernel']} | {r['dtype']} | {r.get('factor', '')} | {r.get('group', '')} | "
                     f"{r.get('bits', '')} | {r.get('grid', '')} | {r['us']:.1f} | {r['gbps']:.0f} | "
                     f"{r['of_copy']:.2f} | {r['elements_per_sm_clock']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs="+", default=[16, 256, 56, 56])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--emulate", action="store_true", help="CPU, through the test suite's emulator (PYTHONPATH=.)")
    parser.add_argument("--ablations", nargs="*", choices=list(ABLATIONS), default=list(ABLATIONS),
                        help="parts removed from the encode, one row each (default: all)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if any(d < 1 for d in args.shape) or args.calls < 1:
        raise ValueError(f"--shape {args.shape} --calls {args.calls}; expected positive sizes and calls")
    if args.emulate:
        from tests.cuda_emulation.emulator import EmulatorRunner

        runner, device, name, clock_hz = EmulatorRunner(), torch.device("cpu"), "CPU (emulator)", 1e9
    elif torch.cuda.is_available():
        from lightning_act.cuda import require_cupy

        device = torch.device("cuda")
        runner = launcher.default_runner()
        name = torch.cuda.get_device_name(device)
        clock_hz = require_cupy().cuda.Device(device.index or 0).attributes["ClockRate"] * 1e3
    else:
        print("bench_kernel_sweep.py times the CUDA kernels, and torch sees no CUDA device: nothing was measured "
              "(--emulate runs the code path on CPU).", file=sys.stderr)
        return NO_CUDA_EXIT
    with launcher.use_runner(runner):
        rows = sweep(tuple(args.shape), args.calls, runner, device, clock_hz, args.ablations)
    command = "python benchmarks/bench_kernel_sweep.py " + " ".join(argv if argv is not None else sys.argv[1:])
    publish(report(rows, name, tuple(args.shape), command.strip()), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
