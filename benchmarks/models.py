"""Models and helpers the benchmark scripts share. Each builder returns ``(model, loss_fn)`` for one fixed
random batch (random init, nothing downloaded). Also: one training step, alternating step timing (or peak
memory), the machine description and the CPU time other processes used during a run."""
from __future__ import annotations

import functools
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from peak_memory import peak_step_bytes
from torch import nn

from lightning_act.models import resnet50


def cnn(batch: int, size: int = 64):
    """Three conv-BN-ReLU layers (32, 64, 64 channels) with two max-pools and a linear head, on ``size``^2 RGB."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * (size // 4) ** 2, 10))
    x, y = torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,))
    return model, lambda: nn.functional.cross_entropy(model(x), y)


def _compiled(model: nn.Module, compiled: bool) -> nn.Module:
    # the wrapper, not module.compile(): compiled in place, an nn.Sequential's own forward is skipped by dynamo,
    # which then compiles each block as a frame of its own (and, past its recompile limit, leaves them eager)
    return torch.compile(model) if compiled else model


def resnet(batch: int, size: int = 64, classes: int = 10, compiled: bool = False):
    """ResNet-50 (``resnet50``) on ``size``^2 RGB with a ``classes``-way head (``compiled``: ``torch.compile``'d,
    the wrapper returned and called)."""
    torch.manual_seed(0)
    model = _compiled(resnet50(classes), compiled)
    x, y = torch.randn(batch, 3, size, size), torch.randint(0, classes, (batch,))
    return model, lambda: nn.functional.cross_entropy(model(x), y)


def bert(batch: int, seq: int = 128, layers: int = 4, hidden: int = 256, attn_implementation: str | None = None,
         heads: int = 4, compiled: bool = False):
    """``BertForSequenceClassification`` from a small config (``layers`` x ``hidden``, ``heads`` heads), random
    tokens (``compiled``: as for ``resnet``)."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    options = {"attn_implementation": attn_implementation} if attn_implementation else {}
    cfg = BertConfig(vocab_size=2000, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                     intermediate_size=4 * hidden, max_position_embeddings=max(seq, 64), **options)
    model = _compiled(BertForSequenceClassification(cfg).train(), compiled)
    ids, labels = torch.randint(0, 2000, (batch, seq)), torch.randint(0, 2, (batch,))
    return model, lambda: model(input_ids=ids, labels=labels).loss


def gcn(nodes: int, degree: int = 10, features: int = 128, hidden: int = 256, classes: int = 16):
    """A two-layer torch_geometric GCN (ReLU, dropout) on a random graph of ``nodes`` nodes, full batch."""
    from torch_geometric.nn import GCNConv

    torch.manual_seed(0)

    class GCN(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.conv2 = GCNConv(features, hidden), GCNConv(hidden, classes)
            self.dropout = nn.Dropout(0.5)

        def forward(self, x, edge_index):
            return self.conv2(self.dropout(torch.relu(self.conv1(x, edge_index))), edge_index)

    model = GCN()
    x, y = torch.randn(nodes, features), torch.randint(0, classes, (nodes,))
    edge_index = torch.randint(0, nodes, (2, nodes * degree))
    return model, lambda: nn.functional.cross_entropy(model(x, edge_index), y)


def train_step(model: nn.Module, loss_fn, compressor=None) -> float:
    """Seconds of one forward + backward (inside ``compressor.compress()`` when given). The gradients are
    dropped afterwards, so every step starts from the same state and a step's peak memory includes them."""
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    if compressor is None:
        loss = loss_fn()
    else:
        with compressor.compress():
            loss = loss_fn()
    loss.backward()
    seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return seconds


def alternating_steps(model: nn.Module, loss_fn, compressors: dict, repeats: int, warmup: int = 2,
                      peaks: bool = False) -> dict[str, list[float]]:
    """Per entry of ``compressors`` (``None``: no compression), the seconds of every measured step, or with
    ``peaks`` its peak resident-set growth in bytes (``peak_memory.peak_step_bytes``; a pinned process's step
    times are not a user's: see ``peak_memory``). The entries take turns step by step after ``warmup`` rounds,
    so every configuration sees the same machine state."""
    measured = {name: [] for name in compressors}
    for round_index in range(warmup + repeats):
        for name, compressor in compressors.items():
            step = functools.partial(train_step, model, loss_fn, compressor)
            value = peak_step_bytes(step) if peaks else step()
            if round_index >= warmup:
                measured[name].append(value)
    return measured


def median_step_times(model: nn.Module, loss_fn, compressors: dict, repeats: int, warmup: int = 2) -> dict:
    """Median step seconds per entry of ``compressors`` (``None``: no compression), measured alternately
    (``alternating_steps``)."""
    measured = alternating_steps(model, loss_fn, compressors, repeats, warmup)
    return {name: statistics.median(seconds) for name, seconds in measured.items()}


def machine() -> str:
    """What the numbers were measured on: platform, CPU model and count, torch threads and version."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{platform.system()} {platform.machine()}, {cpu}, {os.cpu_count()} CPUs, "
            f"{torch.get_num_threads()} threads, torch {torch.__version__}")


def publish(text: str, out: Path | None) -> None:
    """Print a result and write it to ``out`` when given."""
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)


# ---- what else ran on the machine -----------------------------------------------------------------------------
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _process_ticks() -> dict[int, tuple[int, int, int, str]]:
    """pid -> (parent pid, own CPU ticks, reaped children's CPU ticks, command) of every visible process."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # exited meanwhile
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        name = command or stat[stat.find("(") + 1:stat.rfind(")")]
        table[int(entry)] = (int(fields[1]), int(fields[11]) + int(fields[12]), int(fields[13]) + int(fields[14]),
                             name[:70])
    return table


def _busy_ticks() -> int:
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    return user + nice + system + irq + softirq + steal


class MachineLoad:
    """CPU time the rest of the machine used while a benchmark ran (``with MachineLoad() as load: ...``, then
    ``load.summary()``): all CPUs' busy time from ``/proc/stat`` minus this process tree's, from ``/proc``
    (Linux). Load averages at start and end, and the other processes that used the most CPU."""

    def __enter__(self) -> "MachineLoad":
        self._start = (time.monotonic(), _busy_ticks(), _process_ticks(), os.getloadavg())
        return self

    def __exit__(self, *exc) -> None:
        self._end = (time.monotonic(), _busy_ticks(), _process_ticks(), os.getloadavg())

    def summary(self) -> dict:
        (t0, busy0, procs0, load0), (t1, busy1, procs1, load1) = self._start, self._end
        ours = {os.getpid()}
        for _ in range(8):  # descendants: a few generations are enough (run_all -> forkserver -> probe)
            ours |= {pid for pid, (parent, *_) in procs1.items() if parent in ours}
        me0 = sum(procs0[p][1] + procs0[p][2] for p in ours if p in procs0)
        me1 = sum(procs1[p][1] + procs1[p][2] for p in ours)
        others = {}
        for pid, (_, own, _, command) in procs1.items():
            if pid not in ours:
                used = own - (procs0[pid][1] if pid in procs0 and procs0[pid][3] == command else 0)
                others[command] = others.get(command, 0) + used
        wall = t1 - t0
        other_seconds = max(busy1 - busy0 - (me1 - me0), 0) / _TICK
        return {"wall_s": wall, "cpus": os.cpu_count(), "own_cpu_s": (me1 - me0) / _TICK,
                "other_cpu_s": other_seconds, "other_cores": other_seconds / wall if wall else 0.0,
                "loadavg_start": load0[0], "loadavg_end": load1[0],
                "top_others": sorted(((c, s / _TICK) for c, s in others.items() if s / _TICK >= 1.0),
                                     key=lambda cs: -cs[1])[:5]}
