"""Host time per saved tensor on the CUDA code path, measured on CPU (issue #20's proxy for GPU step time).

A GPU step hides host work only while the host spends less time per op than the GPU. This measures the host
side alone: the model is BERT-base-shaped (12 layers, hidden 768) at batch 1 and sequence 8, so the compute is
small; the codecs take their CUDA path (``backend="cupy"``) on CPU tensors through a no-op kernel runner
(:func:`lightning_act.cuda.launcher.use_runner`), so every launcher, allocation, check, guard and record runs and
no kernel does. Two figures per configuration, medians over alternating repeats:

* step: (compressed step - plain step) / saved tensors: everything the compressor adds, op tracking included;
* hooks: time inside the pack and unpack hooks / saved tensors.

    python benchmarks/bench_host_overhead.py [--quick] [--repeats 15]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import lightning_act as act
from lightning_act.cuda.launcher import use_runner

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


def bert_base(layers: int = 12, seq: int = 8, batch: int = 1):
    """BERT-base from its config (random weights, nothing downloaded), one fixed batch; ``(model, loss_fn)``."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(num_hidden_layers=layers, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    model = BertForSequenceClassification(config).train()
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    labels = torch.randint(0, 2, (batch,))
    return model, lambda: model(input_ids=ids, labels=labels).loss


class _HookClock:
    """Wraps a compressor's pack and unpack hooks to add up the time spent inside them."""

    def __init__(self, compressor: act.ActivationCompressor):
        self.seconds = 0.0
        pack, unpack = compressor._pack, compressor._unpack

        def timed_pack(*args):
            start = time.perf_counter()
            try:
                return pack(*args)
            finally:
                self.seconds += time.perf_counter() - start

        def timed_unpack(saved):
            start = time.perf_counter()
            try:
                return unpack(saved)
            finally:
                self.seconds += time.perf_counter() - start

        compressor._pack, compressor._unpack = timed_pack, timed_unpack


def measure(name: str, options: dict, layers: int, repeats: int) -> dict:
    model, loss_fn = bert_base(layers)
    runner = NoOpRunner()
    with use_runner(runner):  # backend="cupy" needs CuPy unless a runner stands in
        compressor = act.ActivationCompressor(model, act.ACTConfig(backend="cupy", **options))
    clock = _HookClock(compressor)

    def plain() -> None:
        loss_fn().backward()

    def compressed() -> None:
        with compressor.compress():
            loss = loss_fn()
        loss.backward()

    plain_times, compressed_times, hook_times = [], [], []
    with use_runner(runner), torch.random.fork_rng():
        for i in range(repeats + 2):  # two warm-up rounds
            for step, times in ((plain, plain_times), (compressed, compressed_times)):
                model.zero_grad(set_to_none=True)
                clock.seconds = 0.0
                start = time.perf_counter()
                step()
                if i >= 2:
                    times.append(time.perf_counter() - start)
                    if step is compressed:
                        hook_times.append(clock.seconds)
    stats = compressor.stats()
    saved = stats.num_saved
    step_us = (statistics.median(compressed_times) - statistics.median(plain_times)) / saved * 1e6
    return {"config": name, "saved": saved, "compressed": stats.num_compressed,
            "launches_per_step": runner.launches / (repeats + 2),
            "step_us_per_saved": step_us, "hook_us_per_saved": statistics.median(hook_times) / saved * 1e6,
            "plain_ms": statistics.median(plain_times) * 1e3}


def table(rows: list[dict]) -> str:
    lines = ["| config | saved tensors (compressed) | kernel launches / step | host µs per saved tensor: step | "
             "hooks only | plain step ms |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['config']} | {r['saved']} ({r['compressed']}) | {r['launches_per_step']:.0f} | "
              f"{r['step_us_per_saved']:.1f} | {r['hook_us_per_saved']:.1f} | {r['plain_ms']:.1f} |" for r in rows]
    return "\n".join(lines)


def run(quick: bool = False, repeats: int = 15) -> list[dict]:
    layers, repeats = (2, 3) if quick else (12, repeats)
    configs = dict(list(CONFIGS.items())[:2]) if quick else CONFIGS
    return [measure(name, options, layers, repeats) for name, options in configs.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 layers, 3 repeats, 2 configs (the test's mode)")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)  # host overhead is single-threaded Python; one thread keeps the plain step steady
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread, BERT-base shape, batch 1 x 8 tokens")
    print(table(run(args.quick, args.repeats)))


if __name__ == "__main__":
    main()
