"""Peak memory of a training step, measured by the allocator (not estimated from tensor sizes).

On CUDA: ``torch.cuda.max_memory_allocated`` over the step minus what was allocated before it. On CPU: the step
runs under ``torch.profiler`` with ``profile_memory=True``; the allocator's ``[memory]`` events (signed byte
counts) summed in time order give the live bytes at every allocation, and their maximum is the step's peak above
its start. Both count tensor memory only (no allocator caching, no Python objects), so CPU and GPU figures mean
the same thing and are exact for a given run.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch._C._autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function


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


# ---- what holds the peak ----------------------------------------------------------------------------------------
_ALLOCATION = "_ExtraFields_Allocation"
_PY_CALL = "_ExtraFields_PyCall"
_TORCH_OP = "_ExtraFields_TorchOp"
_BACKWARD_NODE = "autograd::engine::evaluate_function: "
ANNOTATION_PREFIX = "act::"


@contextlib.contextmanager
def annotate_codecs() -> Iterator[None]:
    """Run every registered codec's ``encode``/``decode`` inside ``record_function("act::encode <name>")`` (and
    ``decode``) while the context is open, so :func:`peak_breakdown` attributes their allocations exactly (Python
    frames miss pack hooks that autograd calls from C++, such as a custom function's ``save_for_backward``).
    For measurements only: it costs a profiler call per encode and decode."""
    from . import codecs

    patched = []
    for cls in {codecs.codec_class(name) for name in codecs.available()}:
        for method in ("encode", "decode"):
            original = cls.__dict__.get(method)
            if original is None:
                continue

            def wrapper(self, *args, __original=original, __label=f"{ANNOTATION_PREFIX}{method} {cls.name}",
                        **kwargs):
                with record_function(__label):
                    return __original(self, *args, **kwargs)

            setattr(cls, method, wrapper)
            patched.append((cls, method, original))
    try:
        yield
    finally:
        for cls, method, original in patched:
            setattr(cls, method, original)


@dataclass(frozen=True)
class LiveBlock:
    """One allocation alive at a step's peak.

    ``kind``: ``"gradient"`` (a block that ends up as a ``.grad`` of the given parameters), ``"forward"``
    (allocated outside any backward node: saved tensors, kept or compressed, and what the forward still holds),
    ``"backward"`` (allocated by a backward node: gradients of activations and the node's temporaries, decoded
    saved tensors included). ``node``: the autograd node that allocated it (``"ReluBackward0"``; empty in the
    forward); ``op``: the innermost torch op; ``frame``: the innermost Python frame (``with_stack`` only) and
    ``source``: the innermost frame in ``lightning_act`` (decode/encode), if any, or the innermost ``act::``
    annotation (:func:`annotate_codecs`: ``"act::encode quantize"``, ``"act::decode positive_mask"``)."""

    nbytes: int
    kind: str
    node: str
    op: str
    frame: str = ""
    source: str = ""


@dataclass(frozen=True)
class PeakBreakdown:
    """:class:`StepMemory` figures plus the blocks alive at the peak (the moment it was first reached)."""

    peak_bytes: int
    end_bytes: int
    live: tuple[LiveBlock, ...]
    older_freed_bytes: int  # frees of blocks allocated before the step that the profiler sized (see measure)
    at_node: str = ""  # the backward node whose allocation reached the peak ("": the forward, or after backward)
    at_op: str = ""  # the op that made that allocation

    def bytes_by(self, field: str = "kind", where: Callable[[LiveBlock], bool] | None = None) -> dict[str, int]:
        """Live bytes at the peak grouped by ``field`` of the blocks (those ``where`` accepts), largest first."""
        groups: dict[str, int] = {}
        for block in self.live:
            if where is None or where(block):
                key = getattr(block, field)
                groups[key] = groups.get(key, 0) + block.nbytes
        return dict(sorted(groups.items(), key=lambda kv: -kv[1]))

    def summary(self, top: int = 8) -> str:
        """A few lines: the peak, the split by kind, the largest backward groups (node, op, source)."""
        mib = 2.0**20
        where = f"in {self.at_node}" if self.at_node else "outside backward"
        lines = [f"peak {self.peak_bytes / mib:.1f} MiB above the step's start ({where}, {self.at_op}), end "
                 f"{self.end_bytes / mib:.1f} MiB"]
        lines.append("at the peak: " + ", ".join(f"{k} {v / mib:.1f} MiB" for k, v in self.bytes_by().items()))
        groups: dict[tuple, list[int]] = {}
        for b in self.live:
            if b.kind == "backward":
                entry = groups.setdefault((b.node, b.op, b.source), [0, 0])
                entry[0] += b.nbytes
                entry[1] += 1
        for (node, op, source), (nbytes, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]:
            lines.append(f"  backward {nbytes / mib:8.1f} MiB in {count:3d} block(s): {node} / {op}"
                         + (f" / {source}" if source else ""))
        return "\n".join(lines)


def _is(node, kind: str) -> bool:
    return type(node.extra_fields).__name__ == kind


def peak_breakdown(step: Callable[[], object], parameters=None, with_stack: bool = False,
                   phase: str | None = None) -> PeakBreakdown:
    """Run ``step()`` once on CPU under the profiler and say what is alive at its peak (the first moment the
    live bytes reach their maximum, counted as :func:`measure_step_memory` counts them).

    ``phase="backward"`` (or ``"forward"``): the peak over the moments a backward node allocates (or anything
    else does) instead, to look at one phase when the other holds the step's peak.

    ``parameters``: the model's parameters; blocks that end the step as their ``.grad`` are ``"gradient"``.
    ``with_stack``: record Python frames too (slower), so each block names the ``lightning_act`` function that
    allocated it (a codec's ``decode``, the engine's pack hook). Free gradients before calling, as for
    :func:`measure_step_memory`."""
    if phase not in (None, "forward", "backward"):
        raise ValueError(f"phase={phase!r}; expected one of None, 'forward', 'backward'")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=with_stack) as prof:
        step()
    allocations = []  # (time, order, event node, context)

    def walk(nodes, node_name: str, op: str, frame: str, source: str) -> None:
        for child in nodes:
            if _is(child, _ALLOCATION):
                if child.extra_fields.device.type == "cpu":
                    allocations.append((child.start_time_ns, len(allocations), child.extra_fields,
                                        (node_name, op, frame, source)))
                continue
            name, n_node, n_op, n_frame, n_source = child.name, node_name, op, frame, source
            if _is(child, _TORCH_OP):
                if name.startswith(_BACKWARD_NODE):
                    n_node = name[len(_BACKWARD_NODE):]
                elif name.startswith(ANNOTATION_PREFIX):
                    n_source = name  # a record_function annotation (annotate_codecs): the surest source
                else:
                    n_op = name
            elif _is(child, _PY_CALL):
                n_frame = name
                if ("lightning_act/" in name and "lightning_act/profiling.py" not in name
                        and not source.startswith(ANNOTATION_PREFIX)):
                    n_source = name[name.index("lightning_act/"):]
            walk(child.children, n_node, n_op, n_frame, n_source)

    walk(prof.profiler.kineto_results.experimental_event_tree(), "", "", "", "")
    allocations.sort(key=lambda a: (a[0], a[1]))
    # first pass: the live bytes after each event (as measure_step_memory counts them) and the peak's event
    live = peak = 0
    peak_index, peak_context = -1, ("", "", "", "")
    for i, (_, _, fields, context) in enumerate(allocations):
        live += fields.alloc_size
        if live > peak and (phase is None or (phase == "backward") == bool(context[0])):
            peak, peak_index, peak_context = live, i, context
    # second pass: which blocks allocated in the step are alive after the peak's event, and at the end
    blocks: dict[int, tuple[int, int, tuple]] = {}  # ptr -> (bytes, event index, context)
    at_peak: dict[int, tuple[int, int, tuple]] = {}
    older = 0  # frees of blocks allocated before the step that the profiler sized
    for i, (_, _, fields, context) in enumerate(allocations):
        size = fields.alloc_size
        if size > 0:
            blocks[fields.ptr] = (size, i, context)
        elif fields.ptr in blocks:
            del blocks[fields.ptr]
        else:
            older -= size
        if i == peak_index:
            at_peak = dict(blocks)
    grads = set()
    for p in parameters or ():
        if p.grad is not None and p.grad.layout == torch.strided:
            grads.add(p.grad.untyped_storage().data_ptr())
    out = []
    for ptr, (size, index, (node, op, frame, source)) in at_peak.items():
        survives = ptr in blocks and blocks[ptr][1] == index  # the same block is alive at the end
        kind = "gradient" if ptr in grads and survives else "backward" if node else "forward"
        out.append(LiveBlock(size, kind, node, op, frame, source))
    out.sort(key=lambda b: -b.nbytes)
    return PeakBreakdown(peak, live, tuple(out), older, peak_context[0], peak_context[1])
