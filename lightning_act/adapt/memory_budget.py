"""Memory-budget mode: meet a step's peak-memory budget at the least estimated time cost.

``ACTConfig(memory_budget="6GiB")`` (or bytes). Before the first training step the planner profiles the user's
batch with the compressor (extra forward/backward passes whose gradients, buffers, RNG and step counters are put
back, as auto-precision's probes are). Units are the model's repeated blocks (the children of its longest
``nn.ModuleList``/``nn.Sequential``: transformer layers, ResNet bottlenecks) plus ``"(model)"`` for everything
outside them.

1. A pass with every saved tensor at 2 bits (the lowest peak a quantized plan reaches, so profiling stays within a
   budget that all-2-bit meets): each unit's saved tensors (their uncompressed bytes and elements, what stays the
   same whatever the option: lossless masks, integer indices), its input bytes and forward time; and the step's
   *timeline*: the allocator's peak (:mod:`lightning_act.profiling`'s measure: CPU allocator events, CUDA's
   ``max_memory_allocated``) in each *segment* of the step, cut where a unit's forward starts and where the
   gradient of a unit's output arrives (its backward starts). In a segment the saved tensors of the units whose
   forward has run and whose backward has not are alive; the rest of the segment's peak (weights' gradients, the
   working set of the op running) does not depend on the plan.
2. Only when keeping everything is predicted not to fit: a pass with every unit checkpointed (the others at 2
   bits), whose segments give what checkpointing each unit adds: in its forward (encoding its inputs at 4 bits)
   and in its backward (recomputing it), and what each unit then stores.
3. The time one byte costs to quantize and back, and (CUDA) to copy to host memory and back.

Every unit then gets one option: ``keep`` (32 bits), ``q8``/``q4``/``q2`` (quantize), ``checkpoint`` (store only
its inputs, at 4 bits, and recompute it in backward: CB1 for that unit) or ``swap`` (4 bits in host memory;
CUDA only). A plan's predicted peak is the largest over segments of the segment's plan-independent part, what the
alive units store under their options, and what the segment's own unit adds under its option (checkpointed: the
transients above; swapped: its 4-bit form brought back in its backward). The plan minimises ``time +
accuracy_weight * accuracy cost`` (time: quantization, recompute and copy time; accuracy: GACT's variance
``sum c_l S(b_l)`` with auto-precision's sensitivities ``c_l`` when it has estimated them, else each unit's saved
bytes as its weight) subject to the predicted peak fitting the budget. Candidates: greedily from all-``keep``, the
move that removes the most bytes over the budget (summed over segments) per unit of cost, until it fits; the plan
of least predicted peak (coordinate descent from every unit at its smallest option); every unit checkpointed;
every unit at 2 bits. Each candidate that fits is then relaxed (while a unit can move to a cheaper option and the
plan still fits, the move that lowers the cost most) and the cheapest is taken; when none fits, the one of least
predicted peak. A kept unit is predicted conservatively (its tensors count on top of the forward's working set,
which they partly are).
The plan is applied and one measured step checks it; when the measured peak exceeds the budget, the target
shrinks by the excess and the plan is solved again (twice at most); the cheapest measured plan that met the budget
is kept, else the one that came closest. When no plan fits, a warning names the shortfall.
"""
from __future__ import annotations

import contextlib
import functools
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch._C._autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from .. import checkpoint as compressed_checkpoint
from ..codecs.base import Codec, Packed
from ..engine import ActivationCompressor
from ..layer_stats import OUTSIDE, LayerStats
from .._validate import parse_bytes
from ..profiling import measure_step_memory
from ..stats import COMPRESSED, KEPT
from .allocation import variance_factor
from .sensitivity import preserved_training_state
from .._warn import warn_user

QUANTIZE_BITS = {"keep": 32, "q8": 8, "q4": 4, "q2": 2}
OPTIONS = ("keep", "q8", "q4", "q2", "checkpoint", "swap")
CHECKPOINT_BITS = 4  # what a checkpointed unit's inputs and recomputed tensors are stored at (CB1's)
# Recomputing from 4-bit inputs perturbs every recomputed tensor (ReLU masks, BatchNorm statistics): on ResNet-8
# the gradient's cosine to the exact one fell to that of 2-bit storage (0.93 against 0.997 at 4 bits), so a
# checkpointed unit's accuracy cost is that of 2 bits.
CHECKPOINT_VARIANCE_BITS = 2
PROFILE_OPTION = "q2"  # the quantized profiling pass: the lowest-peak quantized plan
MAX_REPLANS = 2
_MARK = "act_budget::"  # the profiler annotations that cut a pass into segments


def budget_units(model: nn.Module) -> dict[str, nn.Module]:
    """The model's repeated blocks by qualified name: the children of its longest ``nn.ModuleList`` or
    ``nn.Sequential`` (transformer layers, ResNet bottlenecks); none for a model without one."""
    containers = [(name, m) for name, m in model.named_modules() if isinstance(m, (nn.ModuleList, nn.Sequential))]
    if not containers:
        return {}
    name, longest = max(containers, key=lambda item: len(item[1]))
    if len(longest) < 2:
        return {}
    prefix = f"{name}." if name else ""
    return {f"{prefix}{child_name}": child for child_name, child in longest.named_children()}


@dataclass
class UnitProfile:
    """What the profiling passes measured of one unit: its quantizable saved tensors (floating point, as saved:
    ``value_bytes``, ``value_elements``; ``stats_bytes``: their per-group statistics, the same at any bit width),
    what it stores whatever the option (``fixed_bytes``: lossless masks, integer indices, tensors too small to
    compress), what it stores when checkpointed (``checkpoint_bytes``: measured, else its inputs at 4 bits), its
    input bytes and forward seconds."""

    name: str
    value_bytes: int = 0
    value_elements: int = 0
    stats_bytes: int = 0
    fixed_bytes: int = 0
    checkpoint_bytes: int | None = None
    input_bytes: int = 0
    forward_seconds: float = 0.0
    sensitivity: float | None = None
    # a unit that changes its input in place cannot be recomputed from it (nor can the rest of the model)
    checkpointable: bool = True

    @property
    def kept_bytes(self) -> int:
        """What the unit's saved tensors hold as they are."""
        return self.fixed_bytes + self.value_bytes

    def stored_bytes(self, option: str) -> int:
        """Device bytes the unit's saved tensors hold under ``option`` (between forward and backward)."""
        if option in QUANTIZE_BITS:
            bits = QUANTIZE_BITS[option]
            if bits >= 32:
                return self.kept_bytes
            return self.fixed_bytes + math.ceil(self.value_elements * bits / 8) + self.stats_bytes
        if option == "checkpoint":
            return self.checkpoint_bytes if self.checkpoint_bytes is not None else \
                _quantized(self.input_bytes, CHECKPOINT_BITS)
        return self.fixed_bytes  # swap: the values in host memory (masks stay: the op rules choose them)

    def transient_bytes(self, option: str) -> int:
        """Bytes a swapped unit brings back to the device in its backward (its 4-bit values)."""
        return self.stored_bytes("q4") - self.fixed_bytes if option == "swap" else 0


def _quantized(nbytes: int, bits: int) -> int:
    """Bytes of float32 values at ``bits`` per element with 256-element groups of two float32 statistics."""
    if bits >= 32:
        return nbytes
    elements = nbytes / 4
    return int(elements * bits / 8 + elements / 256 * 8)


@dataclass
class Segment:
    """A stretch of the profiled step. ``label``: ``""`` (before the first unit), ``"f:<unit>"`` (from that unit's
    forward to the next mark) or ``"b:<unit>"`` (from the moment the gradient of the unit's output arrives to the
    next mark: its backward); ``alive``: the units whose saved tensors are held in it; ``base_bytes``: its peak
    less what those stored in the profiled pass (weights' gradients, the running op's working set);
    ``checkpoint_bytes``: what the segment's unit adds to it when checkpointed (in its forward: encoding its
    inputs at 4 bits; in its backward: recomputing it)."""

    label: str
    alive: frozenset[str]
    base_bytes: int
    checkpoint_bytes: int = 0

    @property
    def unit(self) -> str | None:
        """The unit whose forward (``"f:"``) or backward (``"b:"``) the segment is."""
        return self.label[2:] if self.label[:2] in ("f:", "b:") else None


class PeakModel:
    """A plan's predicted peak: per :class:`Segment`, its base, what its alive units store under their options
    and the transient of the unit whose backward it is; the peak is the largest segment."""

    def __init__(self, units: dict[str, UnitProfile], segments: list[Segment]):
        self.units, self.segments = units, segments
        self._alive_in = {name: [i for i, s in enumerate(segments) if name in s.alive] for name in units}
        self._own = {name: [i for i, s in enumerate(segments) if s.unit == name] for name in units}
        self.checkpoint_profiled = False  # the checkpointed pass was tried
        self.checkpoint_usable = False  # ... and measured: the solver may checkpoint

    @classmethod
    def additive(cls, units: dict[str, UnitProfile], base_bytes: int, recompute_bytes: int = 0) -> "PeakModel":
        """One segment where every unit is alive, plus, per unit, its backward where recomputing it adds
        ``recompute_bytes``: the whole step's peak as base + everything stored (+ one recomputation)."""
        everything = frozenset(units)
        segments = [Segment("", everything, base_bytes)]
        segments += [Segment(f"b:{name}", everything, base_bytes, recompute_bytes) for name in units]
        model = cls(units, segments)
        model.checkpoint_profiled = model.checkpoint_usable = True
        return model

    def _transient(self, segment: Segment, option: str) -> int:
        if option == "checkpoint":
            return segment.checkpoint_bytes
        return self.units[segment.unit].transient_bytes(option) if segment.label.startswith("b:") else 0

    def peaks(self, options: dict[str, str]) -> list[int]:
        """Each segment's predicted peak under ``options`` (unit -> option)."""
        out = [s.base_bytes for s in self.segments]
        for name, option in options.items():
            stored = self.units[name].stored_bytes(option)
            for i in self._alive_in[name]:
                out[i] += stored
            for i in self._own[name]:
                out[i] += self._transient(self.segments[i], option)
        return out

    def moved(self, peaks: list[int], options: dict[str, str], name: str, option: str) -> list[int]:
        """``peaks`` (of ``options``) after ``name`` moves to ``option``."""
        out = list(peaks)
        unit, current = self.units[name], options[name]
        delta = unit.stored_bytes(option) - unit.stored_bytes(current)
        for i in self._alive_in[name]:
            out[i] += delta
        for i in self._own[name]:
            out[i] += self._transient(self.segments[i], option) - self._transient(self.segments[i], current)
        return out

    def peak(self, options: dict[str, str]) -> int:
        return max(self.peaks(options), default=0)

    def base_at_peak(self, options: dict[str, str]) -> int:
        """The base of the segment that holds the predicted peak."""
        peaks = self.peaks(options)
        return self.segments[peaks.index(max(peaks))].base_bytes if peaks else 0


@dataclass
class BudgetPlan:
    """The chosen option per unit and what the plan expects of the step."""

    budget_bytes: int
    target_bytes: int
    options: dict[str, str]
    units: dict[str, UnitProfile]
    predicted_peak_bytes: int
    fits: bool
    measured_peak_bytes: int | None = None
    base_bytes: int = 0  # at the predicted peak: what the step holds besides saved tensors (gradients, transients)
    costs: dict[str, float] = field(default_factory=dict)  # estimated seconds per step, by unit
    planning_peak_bytes: int | None = None  # the highest of the planner's own passes (profiles and checks)
    model: PeakModel | None = field(default=None, repr=False)

    @property
    def cost(self) -> float:
        return sum(self.costs.values())

    def table(self) -> str:
        """One line per unit: saved MiB, option, stored MiB, estimated time; then the totals."""
        mib = 2.0 ** 20
        rows = ["| unit | saved MiB | option | stored MiB | est. ms |", "|---|---|---|---|---|"]
        for name, option in self.options.items():
            unit = self.units[name]
            rows.append(f"| {name} | {unit.kept_bytes / mib:.2f} | {option} | {unit.stored_bytes(option) / mib:.2f} | "
                        f"{self.costs.get(name, 0.0) * 1e3:.2f} |")
        measured = "n/a" if self.measured_peak_bytes is None else f"{self.measured_peak_bytes / mib:.1f} MiB"
        planning = "" if self.planning_peak_bytes is None else \
            f", planning passes peaked at {self.planning_peak_bytes / mib:.1f} MiB"
        rows.append(f"\nbudget {self.budget_bytes / mib:.1f} MiB, predicted peak {self.predicted_peak_bytes / mib:.1f} "
                    f"MiB, measured {measured}{'' if self.fits else ' (does not fit)'}{planning}")
        return "\n".join(rows)


class HostSwapCodec(Codec):
    """``inner``'s compressed form kept in pinned host memory between forward and backward (copies ordered on
    the current stream, so no buffer is freed or read before its copy)."""

    name = "swap"

    def __init__(self, inner: Codec):
        self.inner = inner
        self.dtypes = inner.dtypes

    def encode(self, x: torch.Tensor, *, key: int = 0) -> Packed:
        packed = self.inner.encode(x, key=key)
        host = {name: torch.empty(b.shape, dtype=b.dtype, pin_memory=True).copy_(b, non_blocking=True)
                for name, b in packed.buffers.items()}
        return Packed(packed.codec, packed.shape, packed.dtype, packed.device, host, packed.meta)

    def decode(self, packed: Packed) -> torch.Tensor:
        return self.inner.decode(packed.to(packed.device, non_blocking=True))

    def bits_per_element(self, x: torch.Tensor, packed: Packed | None = None) -> float:
        return self.inner.bits_per_element(x, packed)


class MemoryBudget:
    """Plans and applies per-unit options so a training step's peak memory fits ``budget`` (module docstring).

    >>> budget = MemoryBudget(compressor, "6GiB")
    >>> plan = budget.plan(forward_backward)    # profiles the batch (state restored), applies the plan
    >>> print(plan.table())
    ...                                          # train; budget.remove() undoes the plan

    Args:
        compressor: the compressor whose model is trained.
        budget: bytes, or a size such as ``"6GiB"``.
        accuracy_weight: how much a unit's accuracy cost counts against its time cost (0: time only).
        units: a callable ``model -> {name: module}`` choosing the units (default :func:`budget_units`).
        sensitivities: GACT sensitivity ``c_l`` per saved-tensor index of the step (auto-precision's:
            ``{a["index"]: a["sensitivity"] for a in auto_precision.assignment()}``), summed per unit as its
            accuracy weight; without them each unit's saved bytes weigh.
    """

    def __init__(self, compressor: ActivationCompressor, budget: int | str, *, accuracy_weight: float = 1.0,
                 units: Callable[[nn.Module], dict[str, nn.Module]] = budget_units,
                 sensitivities: dict[int, float] | None = None):
        if compressor.model is None:
            raise ValueError("MemoryBudget needs ActivationCompressor(model, ...) with its model; got model=None")
        if isinstance(accuracy_weight, bool) or not isinstance(accuracy_weight, (int, float)) or accuracy_weight < 0:
            raise ValueError(f"accuracy_weight={accuracy_weight!r}; expected a number >= 0")
        self.compressor = compressor
        self.budget_bytes = parse_bytes("memory_budget", budget)
        self.accuracy_weight = float(accuracy_weight)
        self.units = units(compressor.model)
        if not self.units:
            raise ValueError(f"MemoryBudget found no units in {type(compressor.model).__name__} (no nn.ModuleList or "
                             "nn.Sequential of two or more blocks); pass units=lambda model: {name: module, ...}")
        self.sensitivities = dict(sensitivities or {})
        self.last_plan: BudgetPlan | None = None
        self.pass_peaks: dict[str, int] = {}  # the last plan()'s passes: name -> measured peak bytes
        self._unit_codecs: dict[str, Codec] = {}  # the codec of each unit's option, built when a plan is applied
        self._keep_codec = self._option_codec("keep")
        self._running: list[str] = []
        self._handles: list = []
        self._patched: dict[str, Any] = {}
        self._policy = None

    # ---- planning -------------------------------------------------------------------------------------------
    def plan(self, forward_backward_fn: Callable[[], object]) -> BudgetPlan:
        """Profile ``forward_backward_fn`` (a forward under ``compressor.compress()`` and its backward, no optimizer
        step; same batch every call), choose the options, apply them and check them on one measured step."""
        self.remove()
        device = self._device()
        params = [p for p in self.compressor.model.parameters() if p.requires_grad]
        self.pass_peaks = {}
        attempts: list[BudgetPlan] = []
        with preserved_training_state(self.compressor, params) as rewind:
            model = self._profile(forward_backward_fn, rewind, device)
            byte_seconds, swap_seconds = _codec_seconds_per_byte(self.compressor, device)
            target = self.budget_bytes
            for attempt in range(MAX_REPLANS + 1):
                if not model.checkpoint_profiled and model.peak(dict.fromkeys(model.units, "keep")) > target:
                    try:
                        self._profile_checkpoint(model, forward_backward_fn, rewind, device)
                    except torch.OutOfMemoryError:  # the checkpointed pass did not fit the device
                        for p in params:
                            p.grad = None
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
                        warn_user("lightning_act memory_budget: the profiling pass with every unit checkpointed "
                                  "ran out of memory; planning without checkpointing", RuntimeWarning)
                plan = self._solve(model, target, byte_seconds, swap_seconds, device)
                self.apply(plan.options)
                rewind()
                plan.measured_peak_bytes = self._measure(forward_backward_fn, params, device)
                self.pass_peaks[f"check {attempt + 1}"] = plan.measured_peak_bytes
                self.remove()  # the probes' policies do not outlive them: applied for good below
                attempts.append(plan)
                excess = plan.measured_peak_bytes - self.budget_bytes
                if excess <= 0 or not plan.fits:
                    break
                target -= excess
        met = [p for p in attempts if p.measured_peak_bytes <= self.budget_bytes]
        plan = min(met, key=lambda p: p.cost) if met else min(attempts, key=lambda p: p.measured_peak_bytes)
        plan.planning_peak_bytes = max(self.pass_peaks.values())
        self.apply(plan.options)
        if plan.measured_peak_bytes > self.budget_bytes:
            peak = max(plan.predicted_peak_bytes, plan.measured_peak_bytes)
            warn_user(
                f"lightning_act memory_budget={_mib(self.budget_bytes)} cannot be met: the best plan found "
                f"peaks at {_mib(peak)}, {_mib(peak - self.budget_bytes)} short ({_mib(plan.base_bytes)} of the "
                "peak is weights' gradients and what the step holds besides saved activations); using that plan. "
                "Lower the batch size or raise the budget.", RuntimeWarning)
        self.last_plan = plan
        return plan

    def _device(self) -> torch.device:
        parameter = next(self.compressor.model.parameters(), None)
        return parameter.device if parameter is not None else torch.device("cpu")

    @staticmethod
    def _measure(forward_backward_fn: Callable[[], object], params: list[nn.Parameter], device) -> int:
        """Peak bytes of one pass, gradients freed before it (so the pass allocates them, as a step with
        ``zero_grad(set_to_none=True)`` does, and no free of an older tensor shows in the measurement)."""
        for p in params:
            p.grad = None
        return measure_step_memory(forward_backward_fn, device).peak_bytes

    def _timeline(self, forward_backward_fn, params, device) -> dict[str, int]:
        """One pass cut into segments (:class:`_Marks`): the peak of each, by label, gradients freed before."""
        for p in params:
            p.grad = None
        marks = _Marks(self.units, device)
        if device.type == "cuda":
            with marks:
                forward_backward_fn()
            return marks.finish()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, marks:
            forward_backward_fn()
        return _segment_peaks(prof)

    def _profile(self, forward_backward_fn, rewind, device) -> PeakModel:
        """The quantized pass (every saved tensor at 2 bits): per-unit bytes and times, and the segments' bases."""
        params = [p for p in self.compressor.model.parameters() if p.requires_grad]
        profiles = {name: UnitProfile(name) for name in [*self.units, OUTSIDE]}
        profiles[OUTSIDE].checkpointable = False  # what runs outside the units is no module to recompute
        forward_time = _UnitTimer(self.units, device)
        rewind()
        with LayerStats(self.compressor.model, self.compressor, lambda m: self.units) as layers, \
                self.compressor.install_policy(codec=self._fixed(PROFILE_OPTION)), forward_time:
            peaks = self._timeline(forward_backward_fn, params, device)
        self.pass_peaks["profile, 2 bits"] = max(peaks.values())
        for name, stats in layers.per_layer().items():
            unit = profiles[name]
            quantized_bytes = 0
            for r in stats.records:
                if r.kind == COMPRESSED and r.codec == "quantize":
                    numel = math.prod(r.shape)
                    unit.value_elements += numel
                    # a storage first saved under another codec (a ReLU's output as a mask, then a conv's input) has
                    # no original bytes of its own in the step's totals, but keeping its values holds it whole
                    unit.value_bytes += r.original_bytes or numel * r.dtype.itemsize
                    quantized_bytes += r.stored_bytes
                elif r.kind in (COMPRESSED, KEPT):
                    unit.fixed_bytes += r.stored_bytes
            unit.stats_bytes = max(quantized_bytes - math.ceil(unit.value_elements * QUANTIZE_BITS[PROFILE_OPTION] / 8),
                                   0)
            known = [self.sensitivities[r.index] for r in stats.records if r.index in self.sensitivities]
            unit.sensitivity = sum(known) if known else None
        for name, seconds in forward_time.seconds.items():
            profiles[name].forward_seconds = seconds
            profiles[name].input_bytes = forward_time.input_bytes[name]
            profiles[name].checkpointable = name not in forward_time.mutates_input
        profiled = dict.fromkeys(profiles, PROFILE_OPTION)
        segments = []
        for label, alive in _alive_units(peaks):
            stored = sum(profiles[n].stored_bytes(profiled[n]) for n in alive)
            segments.append(Segment(label, alive, peaks[label] - stored))
        return PeakModel(profiles, segments)

    def _profile_checkpoint(self, model: PeakModel, forward_backward_fn, rewind, device) -> None:
        """The pass with every checkpointable unit checkpointed (the others at 2 bits): what each unit stores then,
        and what checkpointing it adds to its forward's and its backward's segments (over their bases)."""
        params = [p for p in self.compressor.model.parameters() if p.requires_grad]
        profiles = model.units
        options = {n: "checkpoint" if u.checkpointable else PROFILE_OPTION for n, u in profiles.items()}
        model.checkpoint_profiled = True  # tried once: after an out-of-memory error checkpointing stays off
        if "checkpoint" not in options.values():
            return
        self.apply(options)
        try:
            rewind()
            with LayerStats(self.compressor.model, self.compressor, lambda m: self.units) as layers:
                peaks = self._timeline(forward_backward_fn, params, device)
            per_layer = layers.per_layer()
        finally:
            self.remove()
        self.pass_peaks["profile, checkpointed"] = max(peaks.values())
        for name, option in options.items():
            if option == "checkpoint":
                stats = per_layer.get(name)
                profiles[name].checkpoint_bytes = 0 if stats is None else \
                    sum(r.stored_bytes for r in stats.records if r.phase == "forward")
        for segment in model.segments:
            name = segment.unit
            if name is None or options.get(name) != "checkpoint" or segment.label not in peaks:
                continue
            stored = sum(profiles[n].stored_bytes(options[n]) for n in segment.alive)
            segment.checkpoint_bytes = max(peaks[segment.label] - stored - segment.base_bytes, 0)
        model.checkpoint_usable = True

    def _fixed(self, option: str) -> Callable[[int, torch.Tensor], Codec | None]:
        codec = self._option_codec(option)
        return lambda index, t: codec if t.is_floating_point() else None

    def _solve(self, model: PeakModel, target: int, byte_seconds: float, swap_seconds: float,
               device: torch.device) -> BudgetPlan:
        profiles = model.units
        allowed = {name: [o for o in OPTIONS if (o != "checkpoint" or (profiles[name].checkpointable
                                                                         and model.checkpoint_usable))
                          and (o != "swap" or device.type == "cuda")] for name in profiles}
        total_kept = sum(u.kept_bytes for u in profiles.values()) or 1
        total_sensitivity = sum(u.sensitivity or 0.0 for u in profiles.values())
        step_seconds = _step_seconds(profiles)

        @functools.lru_cache(maxsize=None)
        def cost(name: str, option: str) -> float:
            unit = profiles[name]
            seconds = 0.0 if option == "keep" else unit.kept_bytes * byte_seconds
            if option == "checkpoint":
                seconds = unit.forward_seconds + unit.input_bytes * byte_seconds
            elif option == "swap":
                seconds += unit.stored_bytes("q4") * swap_seconds
            bits = QUANTIZE_BITS.get(option, CHECKPOINT_VARIANCE_BITS if option == "checkpoint" else CHECKPOINT_BITS)
            weight = (unit.sensitivity or 0.0) / total_sensitivity if total_sensitivity > 0 else \
                unit.kept_bytes / total_kept
            return seconds + self.accuracy_weight * weight * variance_factor(bits) * step_seconds

        def total(options: dict[str, str]) -> float:
            return sum(cost(n, o) for n, o in options.items())

        def over(peaks: list[int]) -> int:
            return sum(max(p - target, 0) for p in peaks)

        def greedy() -> dict[str, str]:
            """From all-keep, the move removing the most bytes over the target per unit of cost, until it fits."""
            options = dict.fromkeys(profiles, "keep")
            peaks = model.peaks(options)
            while max(peaks) > target:
                excess, best, best_rate = over(peaks), None, 0.0
                for name, current in options.items():
                    for option in allowed[name]:
                        if option == current:
                            continue
                        gain = excess - over(model.moved(peaks, options, name, option))
                        if gain <= 0:
                            continue
                        rate = gain / max(cost(name, option) - cost(name, current), 1e-12)
                        if best is None or rate > best_rate:
                            best, best_rate = (name, option), rate
                if best is None:
                    break
                peaks = model.moved(peaks, options, *best)
                options[best[0]] = best[1]
            return options

        def least_peak() -> dict[str, str]:
            """Coordinate descent on (peak, sum of segment peaks) from every unit at its smallest option."""
            options = {n: min(allowed[n], key=lambda o: (profiles[n].stored_bytes(o), cost(n, o))) for n in profiles}
            peaks = model.peaks(options)
            for _ in range(4 * len(options)):
                best = None
                for name, current in options.items():
                    for option in allowed[name]:
                        if option == current:
                            continue
                        moved = model.moved(peaks, options, name, option)
                        key = (max(moved), sum(moved))
                        if key < (max(peaks), sum(peaks)) and (best is None or key < best[0]):
                            best = (key, name, option, moved)
                if best is None:
                    break
                _, name, option, peaks = best
                options[name] = option
            return options

        def relaxed(options: dict[str, str]) -> dict[str, str]:
            """While some unit can move to a cheaper option and the plan still fits, the move lowering cost most."""
            options, peaks = dict(options), model.peaks(options)
            while True:
                moves = [(cost(name, option) - cost(name, current), name, option)
                         for name, current in options.items() for option in allowed[name]
                         if cost(name, option) < cost(name, current)
                         and max(model.moved(peaks, options, name, option)) <= target]
                if not moves:
                    return options
                _, name, option = min(moves)
                peaks = model.moved(peaks, options, name, option)
                options[name] = option

        uniform_q2 = {n: "q2" for n in profiles}
        uniform_checkpoint = {n: "checkpoint" if "checkpoint" in allowed[n] else "q2" for n in profiles}
        candidates = [greedy(), least_peak(), uniform_checkpoint, uniform_q2]
        fitting = [relaxed(c) for c in candidates if model.peak(c) <= target]
        options = min(fitting, key=total) if fitting else min(candidates, key=lambda c: (model.peak(c), total(c)))
        predicted = model.peak(options)
        return BudgetPlan(self.budget_bytes, target, options, profiles, predicted, predicted <= target,
                          base_bytes=model.base_at_peak(options), costs={n: cost(n, o) for n, o in options.items()},
                          model=model)

    # ---- applying -------------------------------------------------------------------------------------------
    def apply(self, options: dict[str, str]) -> None:
        """Put ``options`` (unit name -> option, e.g. another rank's plan) in force, replacing what was."""
        self.remove()
        self._unit_codecs = {name: self._option_codec(option) for name, option in options.items()}
        for name, module in self.units.items():
            self._handles.append(module.register_forward_pre_hook(functools.partial(self._enter, name)))
            self._handles.append(module.register_forward_hook(functools.partial(self._exit, name), always_call=True))
            if options.get(name) == "checkpoint":
                self._patched[name] = module.__dict__.get("forward")
                forward = self._running_as(name, module.forward)
                module.forward = functools.partial(compressed_checkpoint.checkpoint, forward)
        self._policy = self.compressor.install_policy(codec=self._codec_for)

    def remove(self) -> None:
        """Undo the plan: hooks, patched forwards and the codec policy."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._running.clear()
        for name, original in self._patched.items():
            module = self.units[name]
            del module.forward
            if original is not None:
                module.forward = original
        self._patched.clear()
        if self._policy is not None:
            self._policy.remove()
            self._policy = None

    def _enter(self, name: str, module: nn.Module, args) -> None:
        self._running.append(name)

    def _running_as(self, name: str, forward: Callable) -> Callable:
        """``forward`` with ``name`` the running unit: a checkpoint's recomputation calls it in backward, where the
        module's hooks do not run, and what it saves must take the unit's codec (4 bits), not ``"(model)"``'s."""

        @functools.wraps(forward)
        def run(*args, **kwargs):
            self._running.append(name)
            try:
                return forward(*args, **kwargs)
            finally:
                if self._running and self._running[-1] == name:
                    self._running.pop()

        return run

    def _exit(self, name: str, module: nn.Module, args, output) -> None:
        if self._running and self._running[-1] == name:
            self._running.pop()

    def _option_codec(self, option: str) -> Codec:
        if option in QUANTIZE_BITS:
            return self.compressor.codec("quantize", QUANTIZE_BITS[option])
        inner = self.compressor.codec("quantize", CHECKPOINT_BITS)
        return HostSwapCodec(inner) if option == "swap" else inner

    def _codec_for(self, index: int, t: torch.Tensor) -> Codec | None:
        """The engine's codec policy (every saved tensor): the running unit's codec (outside every unit,
        ``"(model)"``'s; a unit the plan does not name keeps its tensors)."""
        if not t.is_floating_point():
            return None
        return self._unit_codecs.get(self._running[-1] if self._running else OUTSIDE) or self._keep_codec

    def metrics(self) -> dict[str, float]:
        """``act/budget/...`` scalars of the last plan (bytes, and each unit's bits; checkpoint = -1, swap = -2)."""
        plan = self.last_plan
        if plan is None:
            return {}
        codes = {**{o: float(b) for o, b in QUANTIZE_BITS.items()}, "checkpoint": -1.0, "swap": -2.0}
        values = {"budget_bytes": float(plan.budget_bytes), "predicted_peak_bytes": float(plan.predicted_peak_bytes),
                  "fits": float(plan.fits)}
        if plan.measured_peak_bytes is not None:
            values["measured_peak_bytes"] = float(plan.measured_peak_bytes)
        if plan.planning_peak_bytes is not None:
            values["planning_peak_bytes"] = float(plan.planning_peak_bytes)
        values.update({f"unit/{name}": codes[option] for name, option in plan.options.items()})
        return {f"act/budget/{k}": v for k, v in values.items()}


def _step_seconds(profiles: dict[str, UnitProfile]) -> float:
    """The forward time of the profiled step: the accuracy cost's scale (a unit's full variance weighs as much
    as its share of the step)."""
    return sum(u.forward_seconds for u in profiles.values()) or 1e-3


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class _Marks:
    """While active (a context), marks where each unit's forward starts (``"f:<unit>"``: a forward pre-hook) and
    where the gradient of its output arrives (``"b:<unit>"``: a hook on the output tensor), once per unit and pass,
    never inside backward (a checkpoint's recomputation). On CPU a mark is a profiler annotation
    (:func:`_segment_peaks` cuts the allocator's events there); on CUDA it reads and resets the peak allocated
    since the previous mark (:meth:`finish`)."""

    def __init__(self, units: dict[str, nn.Module], device: torch.device):
        self.units, self.device = units, device
        self._handles: list = []
        self._seen: set[str] = set()
        self._peaks: dict[str, int] = {}
        self._label = ""
        self._start = 0

    def __enter__(self) -> "_Marks":
        if self.device.type == "cuda":
            self._start = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        for name, module in self.units.items():
            self._handles.append(module.register_forward_pre_hook(functools.partial(self._forward, name)))
            self._handles.append(module.register_forward_hook(functools.partial(self._output, name)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _mark(self, label: str) -> None:
        if label in self._seen:
            return
        self._seen.add(label)
        if self.device.type == "cuda":
            self._close()
            self._label = label
        else:
            with record_function(_MARK + label):
                pass

    def _close(self) -> None:
        peak = torch.cuda.max_memory_allocated(self.device) - self._start
        self._peaks[self._label] = max(self._peaks.get(self._label, 0), peak)
        torch.cuda.reset_peak_memory_stats(self.device)

    def finish(self) -> dict[str, int]:
        """CUDA: each segment's peak above the pass's start, by label."""
        self._close()
        return dict(self._peaks)

    def _forward(self, name: str, module: nn.Module, args) -> None:
        if not _in_backward():
            self._mark(f"f:{name}")

    def _output(self, name: str, module: nn.Module, args, output) -> None:
        if _in_backward():
            return
        tensor = _first_grad_tensor(output)
        if tensor is not None:
            tensor.register_hook(functools.partial(self._gradient, f"b:{name}"))

    def _gradient(self, label: str, grad: torch.Tensor) -> None:
        self._mark(label)


def _first_grad_tensor(output) -> torch.Tensor | None:
    """The first tensor in ``output`` (a tensor, or tuples, lists, dicts of them) that requires grad."""
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    for value in values:
        found = _first_grad_tensor(value)
        if found is not None:
            return found
    return None


def _segment_peaks(prof) -> dict[str, int]:
    """CPU: the allocator's live bytes over a profiled pass (:func:`lightning_act.profiling.measure_step_memory`'s
    count) cut at the :class:`_Marks`' annotations: each segment's peak above the pass's start, by label."""
    events = [e for e in prof.profiler.kineto_results.events()
              if (e.name() == "[memory]" and e.device_type() == DeviceType.CPU) or e.name().startswith(_MARK)]
    live, label, peaks = 0, "", {"": 0}
    for event in sorted(events, key=lambda e: e.start_ns()):
        if event.name() == "[memory]":
            live += event.nbytes()
            peaks[label] = max(peaks[label], live)
        else:
            label = event.name()[len(_MARK):]
            peaks[label] = max(peaks.get(label, 0), live)
    return peaks


def _alive_units(peaks: dict[str, int]) -> list[tuple[str, frozenset[str]]]:
    """Per segment label (in pass order), the units whose saved tensors it holds: ``"(model)"`` always, and the
    units whose forward has started and whose backward has not ended (a unit's own backward holds it)."""
    out, started, ended = [], set(), set()
    for label in peaks:
        name = label[2:]
        if label.startswith("f:"):
            started.add(name)
        out.append((label, frozenset(started - ended) | {OUTSIDE}))
        if label.startswith("b:"):
            ended.add(name)
    return out


class _UnitTimer:
    """Forward seconds and input bytes of each unit while active (a context): pre/post hooks with a clock."""

    def __init__(self, units: dict[str, nn.Module], device: torch.device):
        self.units, self.device = units, device
        self.seconds = {name: 0.0 for name in units}
        self.input_bytes = {name: 0 for name in units}
        self.mutates_input: set[str] = set()  # units whose forward changed an input in place (ReLU(inplace=True))
        self._started: dict[str, float] = {}
        self._versions: dict[str, list[tuple[torch.Tensor, int]]] = {}
        self._handles: list = []

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # planning only: the profiled passes, never training steps
        return time.perf_counter()

    def __enter__(self) -> "_UnitTimer":
        for name, module in self.units.items():
            self._handles.append(module.register_forward_pre_hook(functools.partial(self._enter, name)))
            self._handles.append(module.register_forward_hook(functools.partial(self._exit, name), always_call=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _enter(self, name: str, module: nn.Module, args) -> None:
        self._started[name] = self._now()
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        self.input_bytes[name] = sum(a.numel() * a.element_size() for a in tensors)
        self._versions[name] = [(a, a._version) for a in tensors]

    def _exit(self, name: str, module: nn.Module, args, output) -> None:
        if any(a._version != version for a, version in self._versions.pop(name, ())):
            self.mutates_input.add(name)
        if name in self._started and torch.is_grad_enabled():
            self.seconds[name] += self._now() - self._started.pop(name)


def _codec_seconds_per_byte(compressor: ActivationCompressor, device: torch.device) -> tuple[float, float]:
    """Seconds per input byte to quantize at 4 bits and decode, and (CUDA) to copy 4-bit data to host and back,
    timed on a 4 MiB sample."""
    sample = torch.randn(1 << 20, device=device)
    codec = compressor.codec("quantize", 4)
    codec.decode(codec.encode(sample))  # warm-up (kernel compilation)
    start = _synchronized(device)
    codec.decode(codec.encode(sample))
    quantize = (_synchronized(device) - start) / sample.nbytes
    if device.type != "cuda":
        return quantize, math.inf
    swap = HostSwapCodec(codec)
    start = _synchronized(device)
    swap.decode(swap.encode(sample))
    return quantize, max((_synchronized(device) - start) / sample.nbytes * 8 - quantize * 8, 0.0)


def _synchronized(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


@contextlib.contextmanager
def memory_budget(compressor: ActivationCompressor, budget: int | str, forward_backward_fn: Callable[[], object],
                  **options: Any) -> Iterator[MemoryBudget]:
    """``with memory_budget(compressor, "6GiB", forward_backward) as planner:`` plan, train, and undo on exit."""
    planner = MemoryBudget(compressor, budget, **options)
    planner.plan(forward_backward_fn)
    try:
        yield planner
    finally:
        planner.remove()
