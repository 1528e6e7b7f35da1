"""Memory-budget mode: meet a step's peak-memory budget at the least estimated time cost.

``ACTConfig(memory_budget="6GiB")`` (or bytes). Before the first training step the planner profiles the user's
batch with the compressor (extra forward/backward passes whose gradients, buffers, RNG and step counters are put
back, as auto-precision's probes are):

1. every saved tensor at 4 bits, then every unit checkpointed: the step's peak (:mod:`lightning_act.profiling`,
   measured by the allocator), each *unit*'s saved bytes as saved and at 4 bits, its
   input bytes and its forward time. Units are the model's repeated blocks (the children of its longest
   ``nn.ModuleList``/``nn.Sequential``: transformer layers, ResNet bottlenecks) plus ``"(model)"`` for
   everything outside them;
2. the time one byte costs to quantize and back, and (CUDA) to copy to host memory and back.

Every unit then gets one option: ``keep`` (32 bits), ``q8``/``q4``/``q2`` (quantize), ``checkpoint`` (store only
its inputs, at 4 bits, and recompute it in backward: CB1 for that unit) or ``swap`` (4 bits in host memory;
CUDA only). The predicted peak of a plan is the 4-bit profile's peak with each unit's stored bytes replaced by
what its option stores, plus, when a unit is checkpointed, what recomputing inside the backward costs (measured
by the second pass); the plan minimises ``time + accuracy_weight * accuracy cost`` (time: quantization,
recompute and copy time; accuracy: GACT's variance ``sum c_l S(b_l)`` with auto-precision's sensitivities ``c_l``
when it has estimated them, else each unit's saved bytes as its weight) subject to the predicted peak fitting
the budget, greedily: from all-``keep``, the move that saves the most bytes per unit of cost, until it fits;
then, while one exists, the move to a cheaper option that still fits.
The plan is applied and one measured step checks it; when the measured peak exceeds the budget, the target
shrinks by the excess and the plan is solved again (twice at most). When even the most aggressive plan cannot
fit, a warning names the shortfall and the most aggressive plan is used.
"""
from __future__ import annotations

import contextlib
import functools
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn

from .. import checkpoint as compressed_checkpoint
from ..codecs.base import Codec, Packed
from ..engine import ActivationCompressor
from ..layer_stats import OUTSIDE, LayerStats
from .._validate import parse_bytes
from ..profiling import measure_step_memory
from ..stats import COMPRESSED
from .allocation import variance_factor
from .sensitivity import preserved_training_state

QUANTIZE_BITS = {"keep": 32, "q8": 8, "q4": 4, "q2": 2}
OPTIONS = ("keep", "q8", "q4", "q2", "checkpoint", "swap")
CHECKPOINT_BITS = 4  # what a checkpointed unit's inputs and recomputed tensors are stored at (CB1's)
# Recomputing from 4-bit inputs perturbs every recomputed tensor (ReLU masks, BatchNorm statistics): on ResNet-8
# the gradient's cosine to the exact one fell to that of 2-bit storage (0.93 against 0.997 at 4 bits), so a
# checkpointed unit's accuracy cost is that of 2 bits.
CHECKPOINT_VARIANCE_BITS = 2
MAX_REPLANS = 2


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
    """What the profiling passes measured of one unit (bytes: as saved, then at 4 bits; seconds: forward)."""

    name: str
    kept_bytes: int = 0
    q4_bytes: int = 0
    mask_bytes: int = 0  # stored by lossless masks: the same whatever the option
    input_bytes: int = 0
    forward_seconds: float = 0.0
    sensitivity: float | None = None
    # a unit that changes its input in place cannot be recomputed from it (nor can the rest of the model)
    checkpointable: bool = True

    def stored_bytes(self, option: str) -> int:
        """Device bytes the unit's saved tensors hold under ``option`` (between forward and backward)."""
        values = self.kept_bytes - self.mask_bytes
        if option in QUANTIZE_BITS:
            return self.mask_bytes + _quantized(values, QUANTIZE_BITS[option])
        if option == "checkpoint":
            return _quantized(self.input_bytes, CHECKPOINT_BITS)
        return 0  # swap: in host memory

    def transient_bytes(self, option: str) -> int:
        """Bytes a swapped unit brings back to the device in its backward (its 4-bit form)."""
        return self.q4_bytes if option == "swap" else 0


def _quantized(nbytes: int, bits: int) -> int:
    """Bytes of float32 values at ``bits`` per element with 256-element groups of two float32 statistics."""
    if bits >= 32:
        return nbytes
    elements = nbytes / 4
    return int(elements * bits / 8 + elements / 256 * 8)


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
    base_bytes: int = 0  # the 4-bit profile's peak minus its stored bytes: weights, gradients, transients
    costs: dict[str, float] = field(default_factory=dict)  # estimated seconds per step, by unit

    def table(self) -> str:
        """One line per unit: saved MiB, option, stored MiB, estimated time; then the totals."""
        mib = 2.0 ** 20
        rows = ["| unit | saved MiB | option | stored MiB | est. ms |", "|---|---|---|---|---|"]
        for name, option in self.options.items():
            unit = self.units[name]
            rows.append(f"| {name} | {unit.kept_bytes / mib:.2f} | {option} | {unit.stored_bytes(option) / mib:.2f} | "
                        f"{self.costs.get(name, 0.0) * 1e3:.2f} |")
        measured = "n/a" if self.measured_peak_bytes is None else f"{self.measured_peak_bytes / mib:.1f} MiB"
        rows.append(f"\nbudget {self.budget_bytes / mib:.1f} MiB, predicted peak {self.predicted_peak_bytes / mib:.1f} "
                    f"MiB, measured {measured}{'' if self.fits else ' (does not fit)'}")
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
        with preserved_training_state(self.compressor, params) as rewind:
            profiles, base, recompute = self._profile(forward_backward_fn, rewind, device)
            byte_seconds, swap_seconds = _codec_seconds_per_byte(self.compressor, device)
            target = self.budget_bytes
            for attempt in range(MAX_REPLANS + 1):
                plan = self._solve(profiles, base, recompute, target, byte_seconds, swap_seconds, device)
                self.apply(plan.options)
                rewind()
                plan.measured_peak_bytes = self._measure(forward_backward_fn, params, device)
                self.remove()  # the probes' policies do not outlive them: applied for good below
                excess = plan.measured_peak_bytes - self.budget_bytes
                if excess <= 0 or not plan.fits or attempt == MAX_REPLANS:
                    break
                target -= excess
        self.apply(plan.options)
        if not plan.fits or plan.measured_peak_bytes > self.budget_bytes:
            shortfall = max(plan.predicted_peak_bytes, plan.measured_peak_bytes) - self.budget_bytes
            warnings.warn(
                f"lightning_act memory_budget={_mib(self.budget_bytes)} cannot be met: the best plan found "
                f"peaks at {_mib(max(plan.predicted_peak_bytes, plan.measured_peak_bytes))}, {_mib(shortfall)} "
                f"short ({_mib(base)} of the peak is weights, gradients and what the step holds besides saved "
                "activations); using that plan. Lower the batch size or raise the budget.", RuntimeWarning,
                stacklevel=2)
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

    def _profile(self, forward_backward_fn, rewind, device) -> tuple[dict[str, UnitProfile], int, int]:
        """Per-unit bytes (as saved and at 4 bits) and times from one pass at 4 bits (never an uncompressed pass:
        the budget may be below its peak); the base bytes (that pass's peak minus what its saved tensors stored);
        the recompute bytes (what a pass with every unit
        checkpointed peaks at above its base and stored bytes: a recomputed unit's forward runs inside the
        backward, on top of the gradients it holds)."""
        params = [p for p in self.compressor.model.parameters() if p.requires_grad]
        profiles = {name: UnitProfile(name) for name in [*self.units, OUTSIDE]}
        profiles[OUTSIDE].checkpointable = False  # what runs outside the units is no module to recompute
        forward_time = _UnitTimer(self.units, device)
        rewind()
        with LayerStats(self.compressor.model, self.compressor, lambda m: self.units) as layers, \
                self.compressor.install_policy(codec=self._fixed("q4")), forward_time:
            peak = self._measure(forward_backward_fn, params, device)
        per_layer = layers.per_layer()
        for name, stats in per_layer.items():
            unit = profiles[name]
            masks = [r for r in stats.records if r.kind == COMPRESSED and r.codec != "quantize"]
            unit.q4_bytes, unit.mask_bytes = stats.stored_bytes, sum(r.stored_bytes for r in masks)
            # kept: what the values would hold as they are (masks stay masks whatever the option)
            unit.kept_bytes = stats.original_bytes - sum(r.original_bytes for r in masks) + unit.mask_bytes
            known = [self.sensitivities[r.index] for r in stats.records if r.index in self.sensitivities]
            unit.sensitivity = sum(known) if known else None
        for name, seconds in forward_time.seconds.items():
            profiles[name].forward_seconds = seconds
            profiles[name].input_bytes = forward_time.input_bytes[name]
            profiles[name].checkpointable = name not in forward_time.mutates_input
        base = max(peak - sum(s.stored_bytes for s in per_layer.values()), 0)
        all_checkpointed = {name: "checkpoint" if profiles[name].checkpointable else "q4" for name in self.units}
        all_checkpointed[OUTSIDE] = "q4"
        self.apply(all_checkpointed)
        try:
            rewind()
            peak = self._measure(forward_backward_fn, params, device)
        finally:
            self.remove()
        stored_checkpointed = sum(profiles[n].stored_bytes(o) for n, o in all_checkpointed.items())
        return profiles, base, max(peak - base - stored_checkpointed, 0)

    def _fixed(self, option: str) -> Callable[[int, torch.Tensor], Codec | None]:
        codec = self._option_codec(option)
        return lambda index, t: codec if t.is_floating_point() else None

    def _solve(self, profiles, base, recompute, target, byte_seconds, swap_seconds, device) -> BudgetPlan:
        options = {name: "keep" for name in profiles}
        allowed = {name: [o for o in OPTIONS if (o != "checkpoint" or profiles[name].checkpointable)
                          and (o != "swap" or device.type == "cuda")] for name in profiles}
        total_kept = sum(u.kept_bytes for u in profiles.values()) or 1
        total_sensitivity = sum(u.sensitivity or 0.0 for u in profiles.values())

        def cost(name: str, option: str) -> float:
            unit = profiles[name]
            seconds = 0.0 if option == "keep" else unit.kept_bytes * byte_seconds
            if option == "checkpoint":
                seconds = unit.forward_seconds + unit.input_bytes * byte_seconds
            elif option == "swap":
                seconds += unit.q4_bytes * swap_seconds
            bits = QUANTIZE_BITS.get(option, CHECKPOINT_VARIANCE_BITS if option == "checkpoint" else CHECKPOINT_BITS)
            weight = (unit.sensitivity or 0.0) / total_sensitivity if total_sensitivity > 0 else \
                unit.kept_bytes / total_kept
            return seconds + self.accuracy_weight * weight * variance_factor(bits) * _step_seconds(profiles)

        def peak(choice: dict[str, str]) -> int:
            transient = max((profiles[n].transient_bytes(o) for n, o in choice.items()), default=0)
            if "checkpoint" in choice.values():
                transient = max(transient, recompute)
            return base + sum(profiles[n].stored_bytes(o) for n, o in choice.items()) + transient

        while peak(options) > target:
            best, best_rate = None, 0.0
            for name, current in options.items():
                for option in allowed[name]:
                    saved = peak(options) - peak({**options, name: option})
                    extra = cost(name, option) - cost(name, current)
                    if saved <= 0:
                        continue
                    rate = saved / max(extra, 1e-12)
                    if best is None or rate > best_rate:
                        best, best_rate = (name, option), rate
            if best is None:
                break
            options[best[0]] = best[1]
        # The greedy pass may overshoot (a big saving taken where a smaller one would do): while some unit can
        # move to a cheaper option and the plan still fits, take the move that lowers the cost most.
        while peak(options) <= target:
            moves = [(cost(name, option) - cost(name, current), name, option)
                     for name, current in options.items() for option in allowed[name]
                     if cost(name, option) < cost(name, current) and peak({**options, name: option}) <= target]
            if not moves:
                break
            _, name, option = min(moves)
            options[name] = option
        predicted = peak(options)
        return BudgetPlan(self.budget_bytes, target, options, profiles, predicted, predicted <= target,
                          base_bytes=base, costs={n: cost(n, o) for n, o in options.items()})

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
                forward = module.forward
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
        values.update({f"unit/{name}": codes[option] for name, option in plan.options.items()})
        return {f"act/budget/{k}": v for k, v in values.items()}


def _step_seconds(profiles: dict[str, UnitProfile]) -> float:
    """The forward time of the profiled step: the accuracy cost's scale (a unit's full variance weighs as much
    as its share of the step)."""
    return sum(u.forward_seconds for u in profiles.values()) or 1e-3


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
