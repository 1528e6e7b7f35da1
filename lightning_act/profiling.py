"""Peak memory of a training step, measured by the allocator (not estimated from tensor sizes).

On CUDA: ``torch.cuda.max_memory_allocated`` over the step minus what was allocated before it. On CPU: the step
runs under ``torch.profiler`` with ``profile_memory=True``; the allocator's ``[memory]`` events (signed byte
counts) summed in time order give the live bytes at every allocation, and their maximum is the step's peak above
its start. Both count tensor memory only (no allocator caching, no Python objects), so CPU and GPU figures mean
the same thing and are exact for a given run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch._C._autograd import DeviceType
from torch.profiler import ProfilerActivity, profile


@dataclass(frozen=True)
class StepMemory:
    """``peak_bytes``: the most tensor memory the step held above its start; ``end_bytes``: what it still held at
    its end (gradients, optimizer state created by the step)."""

    peak_bytes: int
    end_bytes: int


def measure_step_memory(step: Callable[[], object], device: torch.device | str = "cpu") -> StepMemory:
    """Run ``step()`` once and return its :class:`StepMemory` on ``device``.

    Free what the step would free of older tensors (gradients: ``zero_grad(set_to_none=True)``) *before* calling
    this: the CPU profiler sees the size of a freed block only if it saw its allocation in an earlier profiled
    run, so frees of older tensors would count in some measurements and not in others."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return StepMemory(torch.cuda.max_memory_allocated(device) - before,
                          torch.cuda.memory_allocated(device) - before)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    live = peak = 0
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    for event in sorted(events, key=lambda e: e.start_ns()):
        if event.device_type() == DeviceType.CPU:  # the CPU allocator (not accelerators seen by the profiler)
            live += event.nbytes()
            peak = max(peak, live)
    return StepMemory(peak, live)
