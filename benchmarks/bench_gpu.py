"""GPU training steps with compressed activations, next to torch's own ways to save activation memory.

One command, on a machine with CUDA, writes ``benchmarks/results/gpu.md`` (and ``gpu.json``):

    python benchmarks/bench_gpu.py [--models resnet50 resnet50-cl bert-base gcn [gcn-csr]] [--configs ...]
                                   [--repeats 5] [--memory-budget checkpoint|6GiB] [--time-budget SECONDS]
                                   [--profile DIR] [--out benchmarks/results/gpu.md]
    python benchmarks/bench_gpu.py --tiny      # the same code path on CPU with tiny models (the test mode)

The report is rewritten after every row (marked partial until the run ends), so a run cut short by a lent GPU's
time limit keeps what it measured; ``--time-budget`` stops starting configurations once that many seconds have
passed (they are listed as not run). ``benchmarks/gpu_session.sh`` is the prepared script for a session with a GPU.

Models (random weights and batches, nothing downloaded): ResNet-50 (``lightning_act.models.resnet50``) at 128 x
224², contiguous and ``channels_last``; BERT-base (``transformers.BertConfig()``'s defaults) at 32 x 512; a GCN
(``lightning_act.models.gnn``, hidden 256) on a 400k-node random graph with 8M edges by ``edge_index``, and on
request (``gcn-csr``) over a sparse CSR adjacency (``lightning_act.datasets.adjacency``). Every step: bf16
autocast, forward + backward + AdamW. ``--tiny``: a ResNet-8, a 2-layer BERT, a GCN on 2,000 nodes, one torch
thread.

Configurations (``METHODS``): the baseline; ``ACTConfig`` L1 (auto-precision, one full round first), fixed 4 and
2 bits, 4-bit with ``bounded_cnn=True, bounded_ffn=True`` (the backwards of Conv-BN-ReLU runs, residual merges and
Linear -> activation pairs bounded), L1 and 4-bit with ``side_stream=True`` (encodes on a side stream), 4-bit with ``backend="compile"`` (the
torch path through ``torch.compile``, no CuPy kernels), ``division``, ``lorenzo`` (eb 1e-2), CB1 (4-bit compressed
checkpointing: HF layers through the config, other models' blocks through ``lightning_act.checkpoint``), CB2 (CB1 +
chunked attention, HF only); the peers torch checkpointing (``gradient_checkpointing_enable()`` for HF,
``torch.utils.checkpoint`` per block otherwise) and ``torch.autograd.graph.save_on_cpu``; the model
``torch.compile``'d (in place) alone, with 4-bit activations compressed inside its graphs
(``lightning_act.compiled_regions``: by the CuPy kernel ops, or ``4-bit traced``: by the encode traced into the graphs
and the ``backend="compile"`` decode, in the default mode or ``reduce-overhead``) and with torch checkpointing; the memory-budget mode
(``ACTConfig(memory_budget=...)``, planned by ``lightning_act.adapt.memory_budget.MemoryBudget``) at torch
checkpointing's peak unless ``--memory-budget`` says. Measured only when named, to split a compressed step's host
time: 4-bit with no kernels launched (``NoKernels``), hooks that do nothing, 4-bit without op tracking.

Figures per row:

- peak ÷: the baseline's step peak over the configuration's; a step's peak is ``torch.cuda.max_memory_allocated``
  over the step minus what was allocated before it (``lightning_act.profiling.measure_step_memory``; on CPU the
  profiler's allocator events), gradients freed before the step.
- time ×: median step time (5 steps after 2 warm-up steps, each CUDA-synchronised) over the baseline's.
- ratio: ``compressor.stats().ratio`` (saved / stored activation bytes); the baseline's is 1 by definition.
- kernels ms (with ``--profile DIR``, on CUDA): the device's kernel time in one more step under ``torch.profiler``;
  a step time above it is time the GPU waited for the host. Each configuration's ops by their own device and host
  time go to ``DIR``.
- max batch: the peak measured at the batch and at half of it, a line through the two, and the batch at which it
  reaches the capacity: the device's memory a step can use (free + torch's reserved - allocated before the step;
  ``--capacity-mib`` fixes it). The memory-budget row's line goes through its most aggressive plan's peaks (what
  the mode reaches at the capacity).

Without CUDA and without ``--tiny`` it prints why and exits with status 2 (``NO_CUDA_EXIT``): nothing was measured
and no table written, which a script must not mistake for a result (0 would), and 2 is the status of a command
used where it cannot run (argparse's usage errors). A configuration that fails is reported in its row and the
command exits with status 1.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import gc
import importlib.metadata
import io
import json
import pstats
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from torch._C._autograd import DeviceType
from torch.profiler import ProfilerActivity

import lightning_act as act
from lightning_act.adapt import AutoPrecision
from lightning_act.adapt.memory_budget import MemoryBudget, budget_units
from lightning_act.cuda import launcher
from lightning_act.checkpoint import checkpoint as compressed_checkpoint
from lightning_act.models import gnn, resnet8, resnet50
from lightning_act.profiling import measure_step_memory
from lightning_act.stats import COMPRESSED, KEPT
from models import publish

HERE = Path(__file__).resolve().parent
MiB = 2**20
NO_CUDA_EXIT = 2


# ---- configurations -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Method:
    """One configuration: a compressor config and/or a peer technique.

    ``checkpoint``: per block, ``"torch"`` (HF ``gradient_checkpointing_enable()``, else ``torch.utils.checkpoint``)
    or ``"compressed"`` (``lightning_act.checkpoint``; HF models get it from the config's CB level instead).
    ``budget``: the memory-budget planner, at the budget the run gives. ``hf_only``: nothing to do outside HF.
    ``compiled``: the model ``torch.compile``'d in place (``module.compile()``) for the configuration's steps, in
    ``compile_mode`` (torch.compile's ``mode``; ``"reduce-overhead"``: CUDA graphs, which replay the kernels between
    the compressor's ops, each step marked as a new one)."""

    config: act.ACTConfig | None = None
    checkpoint: str | None = None
    save_on_cpu: bool = False
    budget: bool = False
    hf_only: bool = False
    compiled: bool = False
    compile_mode: str | None = None
    kernels: bool = True  # False: the kernel path's launches skipped (NoKernels), the host path alone
    empty_hooks: bool = False  # saved_tensors_hooks that return what they get: what any hook costs at least
    diagnostic: bool = False  # not a configuration a user runs: measured when named


class NoKernels:
    """A kernel runner that launches nothing: the codecs' kernel path on ``device_type`` tensors runs its host
    side (plans, allocations, argument blocks, records) and no kernel, so a step's host time is seen without the
    device time of the kernels (their outputs are left unwritten)."""

    def __init__(self, device_type: str):
        self.device_type = device_type

    def multiprocessors(self, device: torch.device) -> int:
        if device.type == "cuda":
            return torch.cuda.get_device_properties(device).multi_processor_count
        return launcher.DEFAULT_MULTIPROCESSORS

    def launch(self, *args) -> None:
        pass


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


METHODS = {
    "baseline": Method(),
    "L1": Method(act.ACTConfig(opt_level="L1")),
    "L1, side stream": Method(act.ACTConfig(opt_level="L1", side_stream=True)),
    "4-bit": Method(act.ACTConfig(bits=4, adaptive=False)),
    "4-bit, side stream": Method(act.ACTConfig(bits=4, adaptive=False, side_stream=True)),
    "4-bit, compile": Method(act.ACTConfig(bits=4, adaptive=False, backend="compile")),
    "2-bit": Method(act.ACTConfig(bits=2, adaptive=False)),
    # Conv-BN-ReLU runs, residual merges and Linear -> activation pairs as nodes with bounded backwards (#17)
    "4-bit, bounded": Method(act.ACTConfig(bits=4, adaptive=False, bounded_cnn=True, bounded_ffn=True)),
    "division": Method(act.ACTConfig(codec="division")),
    "lorenzo eb=1e-2": Method(act.ACTConfig(codec="lorenzo", error_bound=1e-2)),
    "CB1": Method(act.ACTConfig(opt_level="CB1", adaptive=False), checkpoint="compressed"),
    "CB2": Method(act.ACTConfig(opt_level="CB2", adaptive=False), hf_only=True),
    "torch checkpoint": Method(checkpoint="torch"),
    "save_on_cpu": Method(save_on_cpu=True),
    # torch.compile'd: compressed inside the compiled graphs (lightning_act.compiled_regions), beside the peers
    "compiled": Method(compiled=True),
    "compiled, 4-bit": Method(act.ACTConfig(bits=4, adaptive=False), compiled=True),
    "compiled (reduce-overhead)": Method(compiled=True, compile_mode="reduce-overhead"),
    "compiled (reduce-overhead), 4-bit": Method(act.ACTConfig(bits=4, adaptive=False), compiled=True,
                                                compile_mode="reduce-overhead"),
    # the encode traced into the graphs (inductor's Triton, no Python per tensor at run time) and the codec's
    # compiled decode, not the CuPy kernel ops: with CUDA graphs, only the decode ops run between them
    "compiled, 4-bit traced": Method(act.ACTConfig(bits=4, adaptive=False, backend="compile"), compiled=True),
    "compiled (reduce-overhead), 4-bit traced": Method(act.ACTConfig(bits=4, adaptive=False, backend="compile"),
                                                       compiled=True, compile_mode="reduce-overhead"),
    "compiled, torch checkpoint": Method(checkpoint="torch", compiled=True),
    "memory budget": Method(budget=True),
    # where a compressed step's host time goes: without the compressor's kernels, with hooks that do nothing, and
    # without op tracking (no masks or op rules)
    "4-bit, no kernels": Method(act.ACTConfig(bits=4, adaptive=False), kernels=False, diagnostic=True),
    "empty hooks": Method(empty_hooks=True, diagnostic=True),
    "4-bit, no op tracking": Method(act.ACTConfig(bits=4, adaptive=False, compress_masks=False), diagnostic=True),
}
# what a run measures unless --configs says: the compiled configurations compile the model first (minutes on a
# GPU for BERT-base), so they run when named (benchmarks/gpu_session.sh names them)
DEFAULT_CONFIGS = tuple(name for name, method in METHODS.items() if not (method.compiled or method.diagnostic))
# what the CB levels warn about a model without HF layers: the per-block checkpoint below is what it asks for
_CB_WITHOUT_HF = r"lightning_act: opt_level='CB[12]' checkpoints HuggingFace layers"


def is_hf(model: nn.Module) -> bool:
    return bool(getattr(model, "supports_gradient_checkpointing", False))


def checkpoint_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """The blocks a per-block checkpoint wraps: the memory-budget planner's units that hold other modules
    (ResNet bottlenecks, GNN layers; not the stem's single layers)."""
    return {name: m for name, m in budget_units(model).items() if any(True for _ in m.children())}


def _torch_checkpoint(forward: Callable, *args, **kwargs):
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)


class Prepared:
    """``method`` applied to ``model`` until :meth:`close`: the compressor (if any), checkpointed blocks,
    auto-precision or the budget plan (:meth:`calibrate`), and :meth:`forward_backward` of a loss closure."""

    def __init__(self, method: Method, model: nn.Module, device: torch.device, autocast: bool = True):
        self.method, self.model, self.device, self.autocast = method, model, device, autocast
        self.compressor: act.ActivationCompressor | None = None
        self.auto: AutoPrecision | None = None
        self.planner: MemoryBudget | None = None
        self.plan = None
        self.shortfall: str | None = None  # the planner's warning when the budget cannot be met
        self._patched: list[nn.Module] = []
        self._hf_checkpointing = False
        if method.checkpoint == "torch" and is_hf(model):
            if hasattr(model, "activation_checkpointing_enable"):  # the name from transformers 5.23
                model.activation_checkpointing_enable({"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable({"use_reentrant": False})
            self._hf_checkpointing = True
        elif method.checkpoint is not None and not is_hf(model):
            wrap = _torch_checkpoint if method.checkpoint == "torch" else compressed_checkpoint
            for block in checkpoint_blocks(model).values():
                block.forward = functools.partial(wrap, block.forward)
                self._patched.append(block)
        if method.compiled:  # after the checkpoint wrappers: they are compiled with the rest
            model.compile(mode=method.compile_mode)

    def calibrate(self, loss_fn: Callable[[], torch.Tensor], budget_bytes: int | None = None,
                  allocation: dict | None = None) -> None:
        """Build the compressor and run what it needs before training on this batch: L1's auto-precision round
        (or load ``allocation``, an ``AutoPrecision.state_dict()``), or the budget plan for ``budget_bytes``."""
        method = self.method
        if method.budget:
            if budget_bytes is None:
                raise ValueError("the memory-budget configuration needs a budget")
            config = act.ACTConfig(memory_budget=budget_bytes)
        else:
            config = method.config
        if config is None:
            return
        self.compressor = act.ActivationCompressor(self.model, config)
        step = functools.partial(self.forward_backward, loss_fn)
        if config.memory_budget is not None:
            self.planner = MemoryBudget(self.compressor, config.memory_budget)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                self.plan = self.planner.plan(step)
            self.shortfall = next((str(w.message) for w in caught if "cannot be met" in str(w.message)), None)
        elif config.adaptive:
            self.auto = AutoPrecision(self.compressor)
            if allocation is None:
                self.auto.adapt(0, step)
            else:
                self.auto.load_state_dict(allocation)

    def forward_backward(self, loss_fn: Callable[[], torch.Tensor]) -> None:
        if self.method.compile_mode == "reduce-overhead":  # the last step's CUDA-graph outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        with contextlib.ExitStack() as stack:
            if self.autocast:
                stack.enter_context(torch.autocast(self.device.type, dtype=torch.bfloat16))
            if self._patched and self.compressor is not None:
                stack.enter_context(warnings.catch_warnings())
                warnings.filterwarnings("ignore", message=_CB_WITHOUT_HF)
            if self.compressor is not None:
                stack.enter_context(self.compressor.compress())
            if self.method.save_on_cpu:
                stack.enter_context(torch.autograd.graph.save_on_cpu(pin_memory=self.device.type == "cuda"))
            if self.method.empty_hooks:
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(_identity, _identity))
            if not self.method.kernels:
                stack.enter_context(launcher.use_runner(NoKernels(self.device.type)))
            loss = loss_fn()
        loss.backward()

    def allocation_coverage(self) -> tuple[int, int]:
        """(allocated tensors the last step saved, tensors it compressed): whether L1's bits applied."""
        stats = self.compressor.stats()
        keys = {(a["index"], tuple(a["shape"]), a["dtype"]) for a in self.auto.assignment()}
        saved = [(r.index, tuple(r.shape), str(r.dtype).removeprefix("torch.")) for r in stats.records
                 if r.codec == "quantize"]
        return sum(k in keys for k in saved), len(saved)

    def close(self) -> None:
        if self.planner is not None:
            self.planner.remove()
        if self.auto is not None:
            self.auto.detach()
        for block in self._patched:
            del block.forward
        self._patched.clear()
        if self._hf_checkpointing:
            disable = getattr(self.model, "activation_checkpointing_disable", None)
            (disable or self.model.gradient_checkpointing_disable)()
        if self.method.compiled:
            self.model._compiled_call_impl = None  # what module.compile() set
            torch._dynamo.reset()  # the next configuration compiles its own graphs


def carry_allocation(state: dict, from_batch: int, to_batch: int) -> dict:
    """An ``AutoPrecision.state_dict()`` estimated at ``from_batch`` for the same model at ``to_batch``: the bits
    stay with each saved tensor (pack order), whose leading dimension scales with the batch."""
    layout = []
    for index, shape, *rest in state["layout"]:  # rest: dtype, and the op rule's floor
        if shape and shape[0] % from_batch == 0:
            shape = [shape[0] // from_batch * to_batch, *shape[1:]]
        layout.append([index, shape, *rest])
    return {**state, "layout": layout}


# ---- workloads ------------------------------------------------------------------------------------------------
@dataclass
class Workload:
    """A model on ``device`` and ``inputs(size) -> loss closure`` for a batch of ``size`` (nodes for graphs)."""

    name: str
    model: nn.Module
    inputs: Callable[[int], Callable[[], torch.Tensor]]
    size: int
    unit: str = "batch"


def resnet_workload(device, tiny: bool, channels_last: bool) -> Workload:
    torch.manual_seed(0)
    side, classes = (32, 10) if tiny else (224, 1000)
    model = (resnet8(3, classes, width=8) if tiny else resnet50(classes)).to(device)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(memory_format=layout)

    def inputs(batch):
        x = torch.randn(batch, 3, side, side, device=device).to(memory_format=layout)
        y = torch.randint(0, classes, (batch,), device=device)
        return lambda: nn.functional.cross_entropy(model(x), y)

    name = ("ResNet-8 (w8)" if tiny else "ResNet-50") + (" channels_last" if channels_last else "")
    return Workload(name, model, inputs, 16 if tiny else 128)


def bert_workload(device, tiny: bool) -> Workload:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=256, max_position_embeddings=64) if tiny else BertConfig()
    model = BertForSequenceClassification(config).to(device).train()
    seq = 64 if tiny else 512

    def inputs(batch):
        ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)
        labels = torch.randint(0, 2, (batch,), device=device)
        return lambda: model(input_ids=ids, labels=labels).loss

    return Workload(f"BERT {'2x64' if tiny else 'base'}, seq {seq}", model, inputs, 8 if tiny else 32)


def gcn_workload(device, tiny: bool, sparse: bool) -> Workload:
    from torch_geometric.data import Data

    from lightning_act.datasets import adjacency

    torch.manual_seed(0)
    features, hidden, classes, degree = (32, 64, 8, 5) if tiny else (128, 256, 16, 20)
    model = gnn("gcn", features, hidden, classes).to(device).train()

    def inputs(nodes):
        edges = torch.randint(0, nodes, (2, nodes * degree), device=device)
        adj = adjacency(Data(edge_index=edges, num_nodes=nodes), "csr" if sparse else "edge_index")
        x = torch.randn(nodes, features, device=device)
        y = torch.randint(0, classes, (nodes,), device=device)
        return lambda: nn.functional.cross_entropy(model(x, adj), y)

    name = f"GCN ({'CSR adjacency' if sparse else 'edge_index'}), degree {degree}"
    return Workload(name, model, inputs, 2000 if tiny else 400_000, unit="nodes")


WORKLOADS = {
    "resnet50": functools.partial(resnet_workload, channels_last=False),
    "resnet50-cl": functools.partial(resnet_workload, channels_last=True),
    "bert-base": bert_workload,
    "gcn": functools.partial(gcn_workload, sparse=False),
    "gcn-csr": functools.partial(gcn_workload, sparse=True),
}
DEFAULT_MODELS = ("resnet50", "resnet50-cl", "bert-base", "gcn")


# ---- measuring ------------------------------------------------------------------------------------------------
def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class HostEvents:
    """What the host did in the timed steps besides the step's own work, each a wait the device cannot hide: the
    garbage collector's collections (how many, ms in all) and, on CUDA, the caching allocator's device allocations,
    frees, retries and all-stream synchronisations (``torch.cuda.memory_stats`` counters: each a driver call that
    can wait for the device). ``summary`` has them per step."""

    ALLOCATOR = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")

    def __init__(self, device: torch.device):
        self.device = device
        self.collections, self.gc_seconds, self._collecting = 0, 0.0, 0.0
        self.allocator: dict[str, int] = {}

    def _counters(self) -> dict[str, int]:
        if self.device.type != "cuda":
            return {}
        stats = torch.cuda.memory_stats(self.device)
        return {key: stats.get(key, 0) for key in self.ALLOCATOR}

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._collecting = time.perf_counter()
        else:
            self.collections += 1
            self.gc_seconds += time.perf_counter() - self._collecting

    def __enter__(self) -> "HostEvents":
        self._before = self._counters()
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._on_gc)
        after = self._counters()
        self.allocator = {key: after[key] - self._before[key] for key in after}

    def summary(self, steps: int) -> dict:
        return {"steps": steps, "gc_collections": self.collections, "gc_ms": 1e3 * self.gc_seconds,
                **self.allocator}


class Runner:
    """Trains ``workload`` under each configuration in turn (same model, one AdamW) and measures it."""

    def __init__(self, workload: Workload, device: torch.device, repeats: int, warmup: int,
                 profile_dir: Path | None = None):
        self.workload, self.device, self.repeats, self.warmup = workload, device, repeats, warmup
        self.profile_dir = profile_dir  # where each configuration's profiled step goes (None: not profiled)
        self.optimizer = torch.optim.AdamW(workload.model.parameters(), lr=1e-4)
        self.capacity_bytes: int | None = None  # set by run() once the optimizer state exists
        self.half = max(1, workload.size // 2)

    def step(self, prepared: Prepared, loss_fn) -> None:
        """One training step, gradients freed first (``measure_step_memory`` asks for that)."""
        self.optimizer.zero_grad(set_to_none=True)
        prepared.forward_backward(loss_fn)
        self.optimizer.step()

    def peak(self, prepared: Prepared, loss_fn) -> int:
        self.optimizer.zero_grad(set_to_none=True)
        return measure_step_memory(lambda: (prepared.forward_backward(loss_fn), self.optimizer.step()),
                                   self.device).peak_bytes

    def held_bytes(self) -> int:
        """Memory allocated between steps (weights, optimizer state), gradients freed."""
        self.optimizer.zero_grad(set_to_none=True)
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0

    def measure(self, name: str, method: Method, budget_bytes: int | None = None) -> dict:
        workload = self.workload
        row = {"model": workload.name, "size": workload.size, "unit": workload.unit, "config": name}
        prepared = Prepared(method, workload.model, self.device)
        try:
            loss_fn = workload.inputs(workload.size)
            started = time.perf_counter()
            prepared.calibrate(loss_fn, budget_bytes)
            row["calibrate_s"] = time.perf_counter() - started
            for i in range(self.warmup):
                _synchronize(self.device)
                started = time.perf_counter()
                self.step(prepared, loss_fn)
                _synchronize(self.device)
                if i == 0:  # a compiled configuration's compilation
                    row["first_step_s"] = time.perf_counter() - started
            seconds = []
            host = []  # the thread's CPU time issuing each step, before it waits for the device
            with HostEvents(self.device) as events:
                for _ in range(self.repeats):
                    _synchronize(self.device)
                    started, issuing = time.perf_counter(), time.thread_time()
                    self.step(prepared, loss_fn)
                    host.append(time.thread_time() - issuing)
                    _synchronize(self.device)
                    seconds.append(time.perf_counter() - started)
            row["host_events"] = {"host_ms": 1e3 * sum(host),
                                  **events.summary(self.repeats)}
            row["step_ms"] = 1e3 * statistics.median(seconds)
            row["step_ms_range"] = (1e3 * min(seconds), 1e3 * max(seconds))  # the host's step-to-step spread
            if self.profile_dir is not None:
                row.update(self.profiled(name, prepared, loss_fn))
            row["peak_mib"] = self.peak(prepared, loss_fn) / MiB
            if prepared.compressor is not None:
                stats = prepared.compressor.stats()
                row["ratio"], row["stored_mib"] = stats.ratio, stats.device_bytes / MiB
                row["stored_by"] = stored_by_kind(stats)
            elif method == METHODS["baseline"]:
                row["stored_mib"] = self.saved_bytes(loss_fn) / MiB
            if prepared.auto is not None:
                row["allocated"] = prepared.allocation_coverage()
            if prepared.plan is not None:
                row["budget_mib"] = prepared.plan.budget_bytes / MiB
                row["plan"] = dict(prepared.plan.options)
                row["plan_met"] = prepared.shortfall is None
            del loss_fn
            row["fit_peaks_mib"] = self.fit_peaks(method, prepared, row["peak_mib"])
        except Exception as error:  # one failing configuration must not hide the others' numbers
            traceback.print_exc()
            row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:200]
        finally:
            prepared.close()
            self.optimizer.zero_grad(set_to_none=True)
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        return row

    def profiled(self, name: str, prepared: Prepared, loss_fn) -> dict:
        """One more step under ``torch.profiler``: how long the device ran kernels in it (``kernel_ms``; with the
        step time, whether the step waits for the GPU or for the host) and the ops that took the time, written to
        ``profile_dir``."""
        cuda = self.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with torch.profiler.profile(activities=activities) as profile:
            self.step(prepared, loss_fn)
            _synchronize(self.device)
        averages = profile.key_averages()
        kernel_us = sum(e.self_device_time_total for e in averages
                        if e.device_type == DeviceType.CUDA and not e.is_user_annotation)
        intervals = [(e.time_range.start, e.time_range.end, e.name) for e in profile.events()
                     if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
        slug = "_".join("".join(c if c.isalnum() else " " for c in f"{self.workload.name} {name}").split())
        self.profile_dir.mkdir(parents=True, exist_ok=True)
        tables = [averages.table(sort_by=key, row_limit=30) for key in
                  (("self_device_time_total", "self_cpu_time_total") if cuda else ("self_cpu_time_total",))]
        (self.profile_dir / f"profile_{slug}.txt").write_text(
            f"{self.workload.name}, {name}: one step under torch.profiler\n\n" + "\n".join(tables))
        # and one under cProfile: the host's Python by function, and the calls that block it (their own time)
        host = cProfile.Profile()
        host.runcall(lambda: (self.step(prepared, loss_fn), _synchronize(self.device)))
        listing = io.StringIO()
        pstats.Stats(host, stream=listing).sort_stats("tottime").print_stats(40)
        (self.profile_dir / f"profile_{slug}_host.txt").write_text(
            f"{self.workload.name}, {name}: one step under cProfile (its own overhead included)\n{listing.getvalue()}")
        return {"kernel_ms": kernel_us / 1e3, "device_idle": device_gaps(intervals)} if cuda and intervals else {}

    def saved_bytes(self, loss_fn) -> int:
        """Bytes the step's saved tensors hold uncompressed, counted by an ``L0`` compressor on one extra step."""
        counter = Prepared(Method(act.ACTConfig(opt_level="L0")), self.workload.model, self.device)
        try:
            counter.calibrate(loss_fn)
            self.optimizer.zero_grad(set_to_none=True)
            counter.forward_backward(loss_fn)
            return counter.compressor.stats().device_bytes
        finally:
            counter.close()

    def fit_peaks(self, method: Method, prepared: Prepared, peak_mib: float) -> dict[int, float]:
        """Step peaks (MiB) at the batch and at half of it, for the max-batch line. L1 carries its allocation to
        the half batch; the memory-budget row measures its most aggressive plan (budget 1 byte) at both sizes:
        at the capacity only that plan can fit, so its line is what the mode reaches."""
        size, half = self.workload.size, self.half
        if not method.budget:
            loss_fn = self.workload.inputs(half)
            if prepared.auto is not None:
                prepared.auto.load_state_dict(carry_allocation(prepared.auto.state_dict(), size, half))
            self.step(prepared, loss_fn)  # warm-up at this size
            return {size: peak_mib, half: self.peak(prepared, loss_fn) / MiB}
        peaks = {}
        for batch in (size, half):
            aggressive = Prepared(method, self.workload.model, self.device)
            try:
                loss_fn = self.workload.inputs(batch)
                aggressive.calibrate(loss_fn, 1)
                self.step(aggressive, loss_fn)
                peaks[batch] = self.peak(aggressive, loss_fn) / MiB
            finally:
                aggressive.close()
        return peaks

    def max_batch(self, row: dict) -> float | None:
        """The batch at which the line through the two measured peaks reaches the capacity."""
        if self.capacity_bytes is None or "error" in row:
            return None
        (b1, p1), (b0, p0) = sorted(row["fit_peaks_mib"].items(), reverse=True)
        if p1 <= p0:
            return None
        return b0 + (self.capacity_bytes / MiB - p0) * (b1 - b0) / (p1 - p0)


def device_gaps(kernels: list[tuple[float, float, str]], top: int = 3) -> dict:
    """Where a profiled step's device sat idle, from its kernels' ``(start µs, end µs, name)`` (any streams):
    ``busy_ms`` (their union), ``span_ms`` (the first start to the last end), ``idle_ms`` (the difference) and the
    ``top`` longest gaps as ``(ms, the kernel that ended before it, the kernel that started after it)``. A step
    whose device idles waits for its host there."""
    ordered = sorted(kernels)
    start, end, last = ordered[0]
    busy, gaps = 0.0, []
    for s, e, name in ordered[1:]:
        if s > end:
            busy += end - start
            gaps.append(((s - end) / 1e3, last, name))
            start, end, last = s, e, name
        elif e > end:
            end, last = e, name
    busy += end - start
    span = (end - ordered[0][0]) / 1e3
    return {"busy_ms": busy / 1e3, "span_ms": span, "idle_ms": span - busy / 1e3,
            "gaps": sorted(gaps, key=lambda g: -g[0])[:top]}


def capacity(device: torch.device, held: int, fixed_mib: float | None) -> int | None:
    """Bytes a step can use: ``fixed_mib``, else on CUDA what the driver has free plus torch's cached blocks
    minus what is allocated (``held``: weights and optimizer state)."""
    if fixed_mib is not None:
        return int(fixed_mib * MiB)
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - held


def run(workload: Workload, configs: list[str], device: torch.device, repeats: int, warmup: int,
        budget: str, capacity_mib: float | None, deadline: float | None = None,
        on_row: Callable[[list[dict], list[str], dict], None] | None = None,
        profile_dir: Path | None = None) -> tuple[list[dict], list[str], dict]:
    """Rows of one workload, the configurations not run (with why) and facts about the run. ``deadline``
    (``time.monotonic()``): configurations not started by then are listed as not run; ``on_row(rows, not_run,
    facts)`` is called after each measured row with the figures so far (a run cut short keeps them);
    ``profile_dir``: each configuration also profiles a step there (:meth:`Runner.profiled`)."""
    runner = Runner(workload, device, repeats, warmup, profile_dir)
    rows, not_run = [], []
    for name in configs:
        method, budget_bytes = METHODS[name], None
        if deadline is not None and time.monotonic() > deadline:
            not_run.append(f"{name} on {workload.name}: the time budget was spent")
            continue
        if method.hf_only and not is_hf(workload.model):
            not_run.append(f"{name} on {workload.name}: chunked attention is for HF attention layers (CB1 is the "
                           "same without it)")
            continue
        if method.checkpoint is not None and not is_hf(workload.model) and not checkpoint_blocks(workload.model):
            not_run.append(f"{name} on {workload.name}: no blocks to checkpoint")
            continue
        if method.budget and budget == "checkpoint":
            reference = next((r for r in rows if r["config"] == "torch checkpoint" and "error" not in r), None)
            if reference is None:
                not_run.append(f"{name} on {workload.name}: its budget is torch checkpointing's peak, not measured")
                continue
            budget_bytes = int(reference["peak_mib"] * MiB)
        elif method.budget:
            budget_bytes = act.ACTConfig(memory_budget=budget).memory_budget
        print(f"  {workload.name}: {name} ...", flush=True)
        rows.append(runner.measure(name, method, budget_bytes))
        facts = derive(rows, runner, device, capacity_mib)
        if on_row is not None:
            on_row(rows, not_run, facts)
    return rows, not_run, derive(rows, runner, device, capacity_mib)


def derive(rows: list[dict], runner: Runner, device: torch.device, capacity_mib: float | None) -> dict:
    """Fill in the figures relative to the baseline (and max batch) of one workload's ``rows``; facts about it."""
    workload = runner.workload
    # what a step can use: measured now, with the optimizer state allocated and no step running
    runner.capacity_bytes = capacity(device, runner.held_bytes(), capacity_mib)
    base = next((r for r in rows if r["config"] == "baseline" and "error" not in r), None)
    for r in rows:
        r["max_batch"] = runner.max_batch(r)
        if "error" in r:
            continue
        if r["config"] == "baseline":
            r["ratio"] = 1.0
        if base is not None:
            r["peak_reduction"] = base["peak_mib"] / r["peak_mib"] if r["peak_mib"] > 0 else None
            r["time_ratio"] = r["step_ms"] / base["step_ms"]
            if r["max_batch"] is not None and base.get("max_batch"):
                r["max_batch_ratio"] = r["max_batch"] / base["max_batch"]
    return {"model": workload.name, "capacity_mib": None if runner.capacity_bytes is None else
            runner.capacity_bytes / MiB, "params_m": sum(p.numel() for p in workload.model.parameters()) / 1e6}


# ---- report ---------------------------------------------------------------------------------------------------
def environment(device: torch.device) -> dict:
    cupy = "not installed"
    for dist in ("cupy-cuda13x", "cupy-cuda12x", "cupy"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            cupy = f"{dist} {importlib.metadata.version(dist)}"
            break
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (--tiny)"
    kernels = device.type == "cuda" and act.cuda.cupy_available()
    return {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda, "cupy": cupy,
            "codecs": "CuPy kernels" if kernels else "pure-torch codecs", "python": sys.version.split()[0]}


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _step_range(row: dict) -> str:
    spread = row.get("step_ms_range")
    return "-" if spread is None else f"{spread[0]:.1f}-{spread[1]:.1f}"


def stored_by_kind(stats, top: int = 6) -> list[dict]:
    """Where a step's stored bytes go: its compressed and kept saved tensors grouped by kind, codec, bits, dtype
    and (kept ones) the reason, the ``top`` groups storing most first, each with its count and MiB saved and
    stored (what a compiled graph stores against the eager engine, say)."""
    groups: dict[tuple, list] = {}
    for r in stats.records:
        if r.kind in (COMPRESSED, KEPT):
            key = (r.kind, r.codec, round(float(r.bits), 2), str(r.dtype).removeprefix("torch."), r.reason)
            group = groups.setdefault(key, [0, 0, 0])
            group[0] += 1
            group[1] += r.original_bytes
            group[2] += r.stored_bytes
    ordered = sorted(groups.items(), key=lambda item: -item[1][2])[:top]
    return [{"kind": kind, "codec": codec, "bits": bits, "dtype": dtype, "reason": reason, "count": count,
             "original_mib": original / MiB, "stored_mib": stored / MiB}
            for (kind, codec, bits, dtype, reason), (count, original, stored) in ordered]


def _stored_group(g: dict) -> str:
    what = f"{g['codec']} at {g['bits']:g} bits" if g["kind"] == "compressed" else f"kept ({g['reason']})"
    return f"{g['count']} {g['dtype']} {what}: {g['original_mib']:.1f} -> {g['stored_mib']:.1f} MiB"


def report(rows: list[dict], not_run: list[str], facts: list[dict], env: dict, command: str, args,
           final: bool = True) -> str:
    kernels = any("kernel_ms" in r for r in rows)
    lines = [f"# GPU training steps: {env['device']}", "",
             *([] if final else ["**Partial: the run is still going (or was cut short); these are the rows measured "
                                 "so far.**", ""]),
             f"torch {env['torch']} (CUDA {env['cuda']}), {env['cupy']}, lightning_act's {env['codecs']}; "
             f"bf16 autocast, AdamW; median of {args.repeats} steps after {args.warmup} warm-up steps. "
             f"Command: `{command}`", "",
             "peak ÷: the baseline's step peak / the configuration's (step peak: `torch.cuda.max_memory_allocated` "
             "over forward, backward and optimizer step minus what was allocated before it, gradients freed "
             "before; `lightning_act.profiling.measure_step_memory`). time ×: median step time / the baseline's "
             "(min-max: the fastest and slowest timed step). "
             "ratio: saved / stored activation bytes (`stats().ratio`). max batch: where the line through the peaks "
             "at the batch and at half of it reaches the capacity below; ×: over the baseline's." +
             (" kernels ms: the device's kernel time in one more step, under `torch.profiler` (a step longer than it "
              "waits for the host; the profiles are in `--profile`'s folder)." if kernels else ""), "",
             "| model | batch | config | ratio | stored MiB | peak MiB | peak ÷ | step ms | min-max | time × | "
             "max batch | max batch × |" + (" kernels ms |" if kernels else ""),
             "|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if kernels else "")]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['size']} | {r['config']} | failed: {r['error']} | | | | | | | | |" +
                         (" |" if kernels else ""))
            continue
        stored = r.get("stored_mib")
        lines.append(
            f"| {r['model']} | {r['size']} | {r['config']} | {_fmt(r.get('ratio'), '.2f', 'x')} | "
            f"{_fmt(stored, '.1f')} | {r['peak_mib']:.1f} | {_fmt(r.get('peak_reduction'), '.2f')} | "
            f"{r['step_ms']:.1f} | {_step_range(r)} | {_fmt(r.get('time_ratio'), '.2f')} | "
            f"{_fmt(r.get('max_batch'), '.0f')} | "
            f"{_fmt(r.get('max_batch_ratio'), '.2f')} |" + (f" {_fmt(r.get('kernel_ms'), '.1f')} |" if kernels else ""))
    lines += ["", "Capacity for the max-batch column (memory a step can use besides weights and optimizer state): " +
              "; ".join(f"{f['model']} {_fmt(f['capacity_mib'], '.0f', ' MiB')} ({f['params_m']:.1f}M parameters)"
                        for f in facts) + ".", ""]
    budget = [r for r in rows if r["config"] == "memory budget" and "error" not in r]
    if budget:
        lines += ["Memory budget: `ACTConfig(memory_budget=...)` planned by `MemoryBudget(compressor, budget).plan"
                  "(forward_backward)` at " + ("torch checkpointing's step peak" if args.memory_budget ==
                                               "checkpoint" else f"`{args.memory_budget}`") + "; plans: " +
                  "; ".join(f"{r['model']} {r['budget_mib']:.1f} MiB: {_plan_summary(r['plan'])}"
                            f"{'' if r['plan_met'] else ' (the planner warns that it cannot meet the budget)'}"
                            for r in budget) +
                  ". Its max batch comes from its most aggressive plan (budget 1 byte) at both sizes. Its "
                  "calibration runs the step uncompressed once (the planner's profile).", ""]
    l1 = [r for r in rows if r.get("allocated")]
    if l1:
        lines += ["L1: one auto-precision round at the batch before timing (" + ", ".join(
            f"{r['model']} {r['calibrate_s']:.0f} s" for r in l1) + "); its allocation is carried to half the batch "
                  "by pack order.", ""]
    compiled = [r for r in rows if METHODS.get(r["config"], METHODS["baseline"]).compiled and "first_step_s" in r]
    if compiled:
        lines += ["First step of the compiled configurations (their compilation, caches cold unless an earlier "
                  "configuration compiled the same graphs): " + ", ".join(
                      f"{r['model']} {r['config']} {r['first_step_s']:.0f} s" for r in compiled) + ".", ""]
    lines += _row_notes(
        rows, "stored_by", "Where the stored bytes go (each compressed row's saved tensors grouped by codec, bits, "
        "dtype, or the reason they were kept; the groups storing most first, MiB saved -> stored):",
        lambda r: "; ".join(map(_stored_group, r["stored_by"])))
    lines += _row_notes(
        rows, "device_idle", "Device idle in the profiled step (the union of its kernels against the span from the "
        "first one's start to the last one's end: where the device waits for the host; the longest gaps, between "
        "which kernels):",
        lambda r: f"{r['device_idle']['idle_ms']:.1f} ms idle of {r['device_idle']['span_ms']:.1f}" + "".join(
            f"; {ms:.2f} ms after {before[:48]} before {after[:48]}" for ms, before, after in r["device_idle"]["gaps"]))
    lines += _row_notes(
        rows, "host_events", "Host in the timed steps, per step (host_ms: the main thread's CPU time issuing the "
        "step, before it waits for the device; the garbage collector's collections and their ms; the CUDA caching "
        "allocator's device allocations, frees, retries and all-stream synchronisations, each a driver call that "
        "can wait for the device):",
        lambda r: ", ".join(f"{value / r['host_events']['steps']:.1f} {key}"
                            for key, value in r["host_events"].items() if key != "steps"))
    lines += [f"Not run: {why}." for why in not_run]
    return "\n".join(lines).rstrip() + "\n"


def _row_notes(rows: list[dict], key: str, heading: str, line: Callable[[dict], str]) -> list[str]:
    """A report section: ``heading`` and a line per row that has ``key`` (nothing when no row has it)."""
    chosen = [r for r in rows if r.get(key)]
    if not chosen:
        return []
    return [heading, ""] + [f"- {r['model']}, {r['config']}: {line(r)}" for r in chosen] + [""]


def _plan_summary(options: dict) -> str:
    counts = {}
    for option in options.values():
        counts[option] = counts.get(option, 0) + 1
    return ", ".join(f"{n} {o}" for o, n in counts.items())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny models on CPU: the code path, in seconds")
    parser.add_argument("--models", nargs="+", choices=list(WORKLOADS), default=list(DEFAULT_MODELS),
                        help="gcn-csr: the GCN over a torch CSR adjacency (not default: torch's CPU CSR product has no "
                        "bf16 kernel, so --tiny cannot run it)")
    parser.add_argument("--configs", nargs="+", choices=list(METHODS), default=list(DEFAULT_CONFIGS),
                        help="default: every configuration but the compiled ones (each compiles the model first)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--memory-budget", default="checkpoint",
                        help="the memory-budget row's budget: 'checkpoint' (torch checkpointing's peak) or a size")
    parser.add_argument("--capacity-mib", type=float, help="memory a step can use, for max batch (default: the "
                        "GPU's free memory; --tiny: 64)")
    parser.add_argument("--time-budget", type=float, help="seconds: configurations (and models) not started by "
                        "then are listed as not run; the report is rewritten after every row either way")
    parser.add_argument("--profile", type=Path, help="a folder: each configuration profiles one more step and "
                        "writes its ops there (kernels ms: the device's kernel time in it)")
    parser.add_argument("--out", type=Path, help="markdown table (default: benchmarks/results/gpu.md on CUDA, "
                        "none with --tiny); the JSON rows go beside it")
    args = parser.parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        print(f"bench_gpu.py measures CUDA training steps, and torch {torch.__version__} sees no CUDA device "
              "(torch.cuda.is_available() is False): nothing was measured and no table was written. On a machine "
              "with a GPU: pip install -e '.[hf,gnn,cuda13]' (or cuda12, see the README) and run "
              "python benchmarks/bench_gpu.py. `--tiny` runs the same code path on CPU with tiny models.",
              file=sys.stderr)
        return NO_CUDA_EXIT
    if args.memory_budget != "checkpoint":
        act.ACTConfig(memory_budget=args.memory_budget)  # validates it now, not after an hour of measuring
    device = torch.device("cpu" if args.tiny else "cuda")
    if args.tiny:  # tiny ops: a second OpenMP thread only spins, and on a shared machine slows steps 10-100x
        torch.set_num_threads(1)
    capacity_mib = args.capacity_mib if args.capacity_mib is not None else (64.0 if args.tiny else None)
    if args.out is None and not args.tiny:
        args.out = HERE / "results" / "gpu.md"
    configs = list(args.configs)
    if "memory budget" in configs and args.memory_budget == "checkpoint" and "torch checkpoint" in configs:
        configs.remove("memory budget")
        configs.insert(configs.index("torch checkpoint") + 1, "memory budget")
    env = environment(device)
    command = "python benchmarks/bench_gpu.py" + (" " + " ".join(argv if argv is not None else sys.argv[1:])
                                                  if (argv if argv is not None else sys.argv[1:]) else "")
    deadline = None if args.time_budget is None else time.monotonic() + args.time_budget
    rows, not_run, facts = [], [], []

    def write(more_rows: list[dict], more_not_run: list[str], more_facts: list[dict], final: bool) -> None:
        """The report of everything measured so far: rewritten after every row, so a run cut short (a lent GPU's
        time limit) leaves its figures; ``final`` prints it too."""
        every = (rows + more_rows, not_run + more_not_run, facts + more_facts)
        text = report(*every, env, command.strip(), args, final=final)
        if final:
            publish(text, args.out)
        elif args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text)
        if args.out is not None:
            args.out.with_suffix(".json").write_text(json.dumps(
                {"environment": env, "command": command, "complete": final, "rows": every[0],
                 "not_run": every[1], "facts": every[2]}, indent=1, default=str))

    for key in args.models:
        if deadline is not None and time.monotonic() > deadline:
            not_run.append(f"{key}: the time budget was spent before it started")
            continue
        workload = WORKLOADS[key](device, args.tiny)
        found, skipped, fact = run(workload, configs, device, args.repeats, args.warmup, args.memory_budget,
                                   capacity_mib, deadline,
                                   lambda r, n, f: write(r, n, [f], final=False), args.profile)
        rows += found
        not_run += skipped
        facts.append(fact)
        del workload
        gc.collect()
    write([], [], [], final=True)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
