"""GACT auto-precision: per-tensor bits from periodically re-estimated sensitivities, and a failure alert.

The controller here is framework neutral; ``lightning_act.callbacks.AutoPrecision`` is the Lightning callback
over it (``Trainer(strategy="act", callbacks=[AutoPrecision()])``, settings defaulting to the strategy's
``ACTConfig``: ``adapt_interval``, ``bit_budget``, ``adapt_fraction``, ``alert_ratio``), and ``ACTTrainer`` runs it
for HuggingFace.

Plain PyTorch / Accelerate::

    auto = AutoPrecision(compressor)
    for step, (x, y) in enumerate(loader):
        def forward_backward():
            with compressor.compress():
                loss = loss_fn(model(x), y)
            loss.backward()                     # or accelerator.backward(loss)
        auto.maybe_adapt(step, forward_backward)  # extra passes every adapt_interval steps, state restored
        optimizer.zero_grad(); forward_backward(); auto.observe_gradient(); optimizer.step()
"""
from __future__ import annotations

import logging
import math
from typing import Any, Callable

import torch
from torch.nn.parallel import DistributedDataParallel

from .._validate import check_type
from .._warn import warn_user
from ..config import ACTConfig
from ..engine import ActivationCompressor, PolicyHandle
from .allocation import CANDIDATE_BITS, allocate_bits, compression_variance
from .sensitivity import GradientVariance, Layout, LayoutRecorder, SensitivityRound, TensorKey, \
    estimate_sensitivities

log = logging.getLogger(__name__)
_SETTINGS = ("adapt_interval", "bit_budget", "adapt_fraction", "alert_ratio")


class AutoPrecision:
    """Allocates bits per saved tensor (GACT Sec. 4) and keeps the allocation up to date.

    Every ``adapt_interval`` steps it runs GACT's Algorithm 1 on the step's batch (``1 + L`` extra
    forward/backward passes for ``L`` re-estimated tensors; the first round and rounds after a layout change
    estimate all, later rounds the next ``adapt_fraction`` of them in turn), then allocates bits from
    ``{32, 8, 4, 2, 1}`` for an average of ``bit_budget``, counting the floors op rules set (a log-probability kept
    at 8 bits or more is allocated 8 or 32, and its bits count in the average; a budget they make unreachable is
    warned about). Tensors whose (pack order, shape, dtype) is not in the
    allocation get the largest candidate within the budget; a new layout seen on two consecutive steps is
    re-estimated at once (single process only: under DDP rounds stay on the interval so ranks stay in step).
    Rank 0's allocation is broadcast. When the estimated compression variance exceeds ``alert_ratio`` times the
    running variance of the training gradient, it warns: raise ``bit_budget``.

    Args:
        compressor: the compressor to allocate bits for (or later :meth:`attach`; the Lightning callback uses
            the strategy's).
        adapt_interval, bit_budget, adapt_fraction, alert_ratio: override the ``ACTConfig`` field.
        ddp_model: plain API under DDP: the ``DistributedDataParallel`` wrapper (probes run in ``no_sync()``).
    """

    def __init__(self, compressor: ActivationCompressor | None = None, *, adapt_interval: int | None = None,
                 bit_budget: float | None = None, adapt_fraction: float | None = None,
                 alert_ratio: float | None = None, ddp_model: DistributedDataParallel | None = None):
        self._overrides = {"adapt_interval": adapt_interval, "bit_budget": bit_budget,
                           "adapt_fraction": adapt_fraction, "alert_ratio": alert_ratio}
        ACTConfig(**{k: v for k, v in self._overrides.items() if v is not None})  # validates them
        self.ddp_model = ddp_model
        self.compressor: ActivationCompressor | None = None
        self._recorder: LayoutRecorder | None = None
        self._policy: PolicyHandle | None = None
        self.layout: Layout = ()
        self.bits: list[int] = []
        self.sensitivities: list[float] = []
        self._positions: dict[TensorKey, int] = {}
        self.rounds = 0
        self.cursor = 0  # next position the round robin re-estimates
        self.last_adapted_step: int | None = None
        self.last_round: SensitivityRound | None = None
        self.variance_ratio: float | None = None
        self.gradient_variance = GradientVariance()
        self._previous_layout: Layout = ()
        self._broadcast: Callable[[Any], Any] = _torch_broadcast
        if compressor is not None:
            self._attach(compressor)

    # ---- API -------------------------------------------------------------------------------------------
    def attach(self, compressor: ActivationCompressor) -> None:
        """Make ``compressor`` take its per-tensor bits from this allocation."""
        self._attach(compressor)

    def _attach(self, compressor: ActivationCompressor) -> None:
        check_type("compressor", compressor, ActivationCompressor, "an ActivationCompressor")
        self.detach()
        if compressor.graph_hooks is not None:
            warn_user(
                f"lightning_act: the model has torch.compile'd parts, whose activations take the config's "
                f"bits={compressor.config.bits}; auto-precision allocates bits to eager code's tensors only, so "
                f"its rounds are skipped (ACTConfig(adaptive=False) says so without this warning)")
        self.compressor = compressor
        self._recorder = LayoutRecorder(compressor)
        self._policy = compressor.install_policy(bits=self._recorder.wrap(self.bits_for))

    def detach(self) -> None:
        """Take the allocation's ``bits_policy`` off the compressor (the allocation itself is kept)."""
        if self._policy is not None:
            self._policy.remove()
            self._policy = None

    def setting(self, name: str) -> Any:
        """The effective ``adapt_interval`` / ``bit_budget`` / ``adapt_fraction`` / ``alert_ratio``."""
        if name not in _SETTINGS:
            raise KeyError(f"setting {name!r}; expected one of {', '.join(_SETTINGS)}")
        value = self._overrides[name]
        config = self._require_compressor().config
        if value is None:
            value = getattr(config, name)
        return float(config.bits) if value is None else value  # bit_budget unset: the configured bits

    @property
    def fallback_bits(self) -> int:
        """Bits of tensors outside the allocation: the largest candidate within the budget."""
        return max(b for b in CANDIDATE_BITS if b <= self.setting("bit_budget"))

    def bits_for(self, key: TensorKey) -> int:
        position = self._positions.get(key)
        return self.bits[position] if position is not None else self.fallback_bits

    @property
    def average_bits(self) -> float:
        """Element-weighted average of the allocated bits (the fallback before the first round)."""
        total = sum(k.numel for k in self.layout)
        if not total:
            return float(self.fallback_bits)
        return sum(b * k.numel for b, k in zip(self.bits, self.layout)) / total

    def assignment(self) -> list[dict[str, Any]]:
        """One entry per allocated tensor: pack index, shape, dtype, bits, sensitivity ``c_l`` and the least bits
        an op rule asks for it (None: none)."""
        return [{"index": k.index, "shape": list(k.shape), "dtype": k.dtype, "bits": b, "sensitivity": c,
                 "minimum_bits": k.minimum_bits} for k, b, c in zip(self.layout, self.bits, self.sensitivities)]

    def maybe_adapt(self, step: int, forward_backward_fn: Callable[[], object]) -> bool:
        """Re-estimate and re-allocate when due (every ``adapt_interval`` steps, or on a new layout).
        ``forward_backward_fn`` runs the forward inside ``compressor.compress()`` and the backward on this
        step's batch, without an optimizer step. Returns whether a round ran (never for a model with compiled
        parts: its probes would only replay steps whose compiled graphs take the config's bits)."""
        if self._require_compressor().graph_hooks is not None:
            return False
        observed = self._require_recorder().last_layout()
        changed = bool(observed) and observed != self.layout and observed == self._previous_layout \
            and not _distributed()
        self._previous_layout = observed
        due = self.last_adapted_step is None or step - self.last_adapted_step >= self.setting("adapt_interval")
        if not (due or changed):
            return False
        self.adapt(step, forward_backward_fn)
        return True

    def adapt(self, step: int, forward_backward_fn: Callable[[], object]) -> None:
        """Run one estimation round now and allocate bits (every rank runs the probes; rank 0's result wins)."""
        self.last_round = estimate_sensitivities(self._require_compressor(), forward_backward_fn, self.bits_for,
                                                 self._choose, round_seed=self.rounds, ddp_model=self.ddp_model)
        state = self._broadcast(self._allocate(self.last_round))
        self._load_assignment(state)
        self.rounds += 1
        self.last_adapted_step = step
        self._check_variance()

    def observe_gradient(self) -> None:
        """Feed the current parameter gradients (after backward, before the optimizer step) to the running
        gradient variance the failure alert compares against."""
        params = [p for p in self._require_compressor().model.parameters() if p.requires_grad]
        self.gradient_variance.update([torch.zeros_like(p) if p.grad is None else p.grad for p in params])

    def state_dict(self) -> dict[str, Any]:
        return {**self._assignment_state(), "rounds": self.rounds, "last_adapted_step": self.last_adapted_step,
                "gradient_variance": self.gradient_variance.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._load_assignment(state_dict)
        self.rounds, self.last_adapted_step = state_dict["rounds"], state_dict["last_adapted_step"]
        self.gradient_variance.load_state_dict(state_dict["gradient_variance"])

    # ---- internals -------------------------------------------------------------------------------------
    def _require_compressor(self) -> ActivationCompressor:
        if self.compressor is None:
            raise ValueError("AutoPrecision has no compressor: pass AutoPrecision(compressor) or use it as a "
                             "callback of a Trainer with strategy='act'")
        return self.compressor

    def _require_recorder(self) -> LayoutRecorder:
        self._require_compressor()
        return self._recorder

    def _choose(self, layout: Layout) -> list[int]:
        """Positions to probe: all of a new layout, else the next ``adapt_fraction`` in turn."""
        if layout != self.layout:
            return list(range(len(layout)))
        count = math.ceil(self.setting("adapt_fraction") * len(layout))
        return [(self.cursor + j) % len(layout) for j in range(count)]

    def _allocate(self, measured: SensitivityRound) -> dict[str, Any]:
        layout = measured.layout
        same = layout == self.layout
        sensitivities = list(self.sensitivities) if same else [0.0] * len(layout)
        for position, c in measured.sensitivities.items():
            sensitivities[position] = c
        budget = self.setting("bit_budget")
        sizes = [k.numel for k in layout]
        bits = allocate_bits(sensitivities, sizes, budget, minimums=[k.minimum_bits for k in layout]) if layout else []
        average = sum(b * d for b, d in zip(bits, sizes)) / sum(sizes) if layout else 0.0
        floored = [k for k in layout if k.minimum_bits is not None]
        if average > budget and floored:  # without floors every budget the config accepts is met
            message = (f"lightning_act auto-precision: bit_budget={budget} cannot be met: op rules keep "
                       f"{len(floored)} saved tensors ({sum(k.numel for k in floored) / sum(sizes):.0%} of the "
                       f"allocated elements) at {min(k.minimum_bits for k in floored)} bits or more, so the "
                       f"allocation averages {average:.2f} bits with every other tensor at its lowest")
            log.warning(message)
            warn_user(message, RuntimeWarning)
        cursor = (self.cursor + len(measured.sensitivities)) % len(layout) if same and layout else 0
        return _state(layout, bits, sensitivities, cursor)

    def _assignment_state(self) -> dict[str, Any]:
        return _state(self.layout, self.bits, self.sensitivities, self.cursor)

    def _load_assignment(self, state: dict[str, Any]) -> None:
        # entries of checkpoints before op-rule floors hold no minimum_bits
        self.layout = tuple(TensorKey(i, tuple(shape), dtype, *floor) for i, shape, dtype, *floor in state["layout"])
        self.bits, self.sensitivities = list(state["bits"]), list(state["sensitivities"])
        self.cursor = state["cursor"]
        self._positions = {k: p for p, k in enumerate(self.layout)}

    def _check_variance(self) -> None:
        variance = compression_variance(self.sensitivities, self.bits)
        if not self.gradient_variance.ready or self.gradient_variance.value <= 0:
            self.variance_ratio = None
            return
        self.variance_ratio = variance / self.gradient_variance.value
        if self.variance_ratio > self.setting("alert_ratio"):
            message = (f"lightning_act auto-precision: the compression variance is {self.variance_ratio:.3g} times "
                       f"the gradient's sampling variance (alert_ratio={self.setting('alert_ratio')}) at "
                       f"bit_budget={self.setting('bit_budget')}; training may converge worse: raise bit_budget")
            log.warning(message)
            warn_user(message, RuntimeWarning)


def _state(layout: Layout, bits: list[int], sensitivities: list[float], cursor: int) -> dict[str, Any]:
    """The assignment as plain Python values (broadcast and checkpointed)."""
    return {"layout": [[k.index, list(k.shape), k.dtype, k.minimum_bits] for k in layout], "bits": list(bits),
            "sensitivities": [float(c) for c in sensitivities], "cursor": cursor}


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _torch_broadcast(obj: Any) -> Any:
    if not _distributed():
        return obj
    holder = [obj]
    torch.distributed.broadcast_object_list(holder, src=0)
    return holder[0]
