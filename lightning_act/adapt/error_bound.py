"""Per-layer error bounds adapted from momentum statistics (Jin et al., "SZ-style compression for training").

The paper models the weight-gradient error that a uniform activation error ``e in [-eb, eb]`` causes as a
normal distribution and keeps its spread at 1% of the average momentum (eq. 8), which gives the bound (eq. 9):

    sigma = 0.01 * mean |momentum of the layer's weight|
    eb    = sigma / (a * Lbar * sqrt(N * R)),      a = 0.32

with the choices made here (measured every ``interval`` optimizer steps; bounds refreshed right after):

* ``Lbar``: mean |dL/d(layer output)| over the measured step, read by a gradient hook on the layer's output in
  the framework's own units (a mean-reduced loss already carries the 1/batch factor the paper's average over
  the batch applies). The paper's per-input ``Lmax`` proxy (eq. 5) is not used: the mean is what eq. 6-9 use.
* ``N``: the number of products ``activation * dL/doutput`` summed into each weight-gradient entry,
  ``output.numel() / weight.shape[0]``: the batch size for a ``Linear`` on ``(batch, features)`` (the
  paper's case), batch x positions for convolutions and token sequences, whose weights are shared likewise.
* ``R``: the fraction of non-zero elements of the layer's input (eq. 7: zeros are stored exactly, they add
  no error), at least ``1 / numel``.
* momentum, in gradient units (the paper: "the target sigma is 1% of the average of gradient"): SGD's
  ``momentum_buffer`` times ``1 - dampening`` if dampening else ``1 - momentum`` (the buffer sums a geometric
  series of gradients), RMSprop's ``momentum_buffer`` (a sum of gradients over their running RMS) times that RMS
  and ``1 - momentum``, Adam's bias-corrected ``exp_avg``. An optimizer without momentum (plain SGD, RMSprop
  without momentum, Adagrad, none at all) gives nothing to adapt to: those layers get ``fallback_error_bound``,
  with a warning.

Eq. 9 bounds what a layer's weight gradient reads: the layer's input. So the tracked layers are modules with
a weight matrix or kernel of their own (``Linear``, ``ConvNd``, PyG's ``Linear``; not bias-only wrappers or
norms), and a saved tensor gets the innermost running layer's bound only when it is that layer's input (the
same storage, or a copy of the same size and last dimension, as autocast makes). Every other saved tensor
(activation-function inputs, softmax outputs, attention probabilities, GCN's edge normalisation, norm
statistics) is read by the backward as a multiplier of the gradient, which the eq. 9 model does not cover:
those use the compressor's configured codec, whose ``error_bound`` is then the bound for all of them (an
adapted bound larger than a GCN's edge weights would store them as zeros and cut the gradient to the first
layer). A storage saved twice is stored once, at the bound of its first save. Before the first refresh layer
inputs use ``initial_error_bound`` or, without one, the configured codec too.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from torch import nn

from .._validate import check_int, check_positive_float, check_type
from ..codecs import Codec
from ..codecs.lorenzo import LorenzoCodec
from ..engine import ActivationCompressor, PolicyHandle
from .._warn import warn_user

PAPER_COEFFICIENT = 0.32
PAPER_MOMENTUM_FRACTION = 0.01
DEFAULT_INTERVAL = 1000
# Fixed bound for layers whose optimizer keeps no momentum (absolute; the adapted bounds of the recipes' models
# come out between 1e-3 and 5e-2, so this errs on the accurate side).
DEFAULT_FALLBACK_ERROR_BOUND = 1e-3


@dataclass
class LayerStats:
    """What one measured step saw of a layer: the inputs of eq. 9 besides the momentum."""

    terms: float = 0.0  # N: products summed into each weight-gradient entry, over every call of the step
    nonzero: float = 1.0  # R: fraction of non-zero input elements
    grad_sum: float = 0.0  # sum of |dL/doutput| over the measured forward calls
    grad_count: int = 0

    @property
    def mean_grad(self) -> float:
        return self.grad_sum / self.grad_count if self.grad_count else 0.0


def _own_weights(module: nn.Module) -> list[nn.Parameter]:
    """Trainable floating-point parameters of ``module`` itself with at least 2 dimensions (matrices, kernels)."""
    return [p for p in module.parameters(recurse=False) if p.requires_grad and p.is_floating_point() and p.dim() >= 2]


def tracked_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Modules with a trainable weight matrix or kernel of their own, by qualified name."""
    return {name or type(module).__name__: module for name, module in model.named_modules() if _own_weights(module)}


def _weight(module: nn.Module) -> nn.Parameter:
    weight = getattr(module, "weight", None)
    if isinstance(weight, nn.Parameter) and weight.dim() >= 2:
        return weight
    return _own_weights(module)[0]


def _is_input(t: torch.Tensor, x: torch.Tensor | None) -> bool:
    """Whether saved tensor ``t`` is layer input ``x``: a view of its storage, or a same-sized copy with the
    same last dimension (autocast saves the cast input)."""
    if x is None:
        return False
    if t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        return True
    return t.numel() == x.numel() and t.dim() > 0 and x.dim() > 0 and t.shape[-1] == x.shape[-1]


def _group_of(optimizer: torch.optim.Optimizer, param: nn.Parameter) -> dict | None:
    """The parameter group of ``optimizer`` that holds ``param`` (None: it holds none)."""
    return next((g for g in optimizer.param_groups if any(p is param for p in g["params"])), None)


def momentum_magnitude(optimizer: torch.optim.Optimizer | None, param: nn.Parameter) -> float | None:
    """Mean |momentum| of ``param`` in gradient units (an average of recent gradients); ``None`` when the
    optimizer keeps no momentum for it."""
    state = optimizer.state.get(param, {}) if optimizer is not None else {}
    if state.get("momentum_buffer") is not None:
        group = _group_of(optimizer, param)
        if "square_avg" in state:
            # RMSprop's buffer sums gradients divided by their running RMS: multiplied back into gradient units
            square = state["square_avg"] - state["grad_avg"] ** 2 if "grad_avg" in state else state["square_avg"]
            rms = square.clamp_min(0).sqrt() + group.get("eps", 0.0)
            return float((state["momentum_buffer"] * rms).abs().mean()) * (1 - group.get("momentum", 0.0))
        dampening = group.get("dampening", 0.0)
        scale = 1 - dampening if dampening else 1 - group.get("momentum", 0.0)
        return float(state["momentum_buffer"].abs().mean()) * scale
    if "exp_avg" in state:
        beta1 = _group_of(optimizer, param)["betas"][0]
        step = float(state.get("step", 1))
        correction = 1 - beta1 ** step if step > 0 else 1.0
        return float(state["exp_avg"].abs().mean()) / correction
    return None


def check_options(interval: int = DEFAULT_INTERVAL, coefficient: float = PAPER_COEFFICIENT,
                  momentum_fraction: float = PAPER_MOMENTUM_FRACTION, initial_error_bound: float | None = None,
                  fallback_error_bound: float = DEFAULT_FALLBACK_ERROR_BOUND) -> None:
    """Raise ValueError for a bad :class:`ErrorBoundController` option (its callbacks check them when built, not
    when training starts)."""
    check_int("interval", interval, minimum=1)
    check_positive_float("coefficient", coefficient)
    check_positive_float("momentum_fraction", momentum_fraction)
    check_positive_float("fallback_error_bound", fallback_error_bound)
    if initial_error_bound is not None:
        check_positive_float("initial_error_bound", initial_error_bound)


def paper_error_bound(momentum: float, mean_grad: float, terms: float, nonzero: float,
                      coefficient: float = PAPER_COEFFICIENT,
                      momentum_fraction: float = PAPER_MOMENTUM_FRACTION) -> float | None:
    """Eq. 8-9: ``0.01 * momentum / (a * Lbar * sqrt(N * R))``; ``None`` when it is not a finite positive number."""
    denominator = coefficient * mean_grad * math.sqrt(max(terms * nonzero, 0.0))
    if not denominator > 0 or not momentum > 0:
        return None
    bound = momentum_fraction * momentum / denominator
    return bound if math.isfinite(bound) else None


class ErrorBoundController:
    """Per-layer ``lorenzo`` error bounds from momentum (eq. 8-9), installed as the compressor's codec policy.

    >>> controller = ErrorBoundController(compressor, optimizer, interval=100)
    >>> with controller:                     # hooks on the model; removed on exit, also after an exception
    ...     for x, y in data:
    ...         with compressor.compress():
    ...             loss = loss_fn(model(x), y)
    ...         loss.backward(); optimizer.step(); optimizer.zero_grad()
    ...         controller.step()            # after the optimizer step: refresh every ``interval`` steps

    ``optimizer`` may be a list (a GAN's generator and discriminator optimizers): each layer's momentum is read
    from the one that holds its weight. ``error_bounds`` maps layer names to the current absolute bounds.
    Statistics are gathered on the first step and then every ``interval``-th (the paper's W); other steps only
    pick the codec. Layers whose optimizer keeps no momentum (or that no optimizer holds) get
    ``fallback_error_bound`` (warned once). ``state_dict()`` / ``load_state_dict()`` carry
    the bounds and the step count across a checkpoint.
    """

    def __init__(self, compressor, optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
                 *,
                 interval: int = DEFAULT_INTERVAL, coefficient: float = PAPER_COEFFICIENT,
                 momentum_fraction: float = PAPER_MOMENTUM_FRACTION, initial_error_bound: float | None = None,
                 fallback_error_bound: float = DEFAULT_FALLBACK_ERROR_BOUND, model: nn.Module | None = None):
        check_options(interval, coefficient, momentum_fraction, initial_error_bound, fallback_error_bound)
        check_type("compressor", compressor, ActivationCompressor, "an ActivationCompressor")
        if optimizer is None:
            optimizers = ()
        else:
            optimizers = tuple(optimizer) if isinstance(optimizer, (list, tuple)) else (optimizer,)
        for given in optimizers:
            check_type("optimizer", given, torch.optim.Optimizer, "a torch.optim.Optimizer, a list of them or None")
        check_type("model", model, nn.Module, "an nn.Module or None", optional=True)
        model = model if model is not None else compressor.model
        if model is None:
            raise ValueError("ErrorBoundController needs a model: the compressor has none; pass model=")
        self.compressor, self.optimizers, self.model = compressor, optimizers, model
        self.interval, self.coefficient, self.momentum_fraction = interval, coefficient, momentum_fraction
        self.initial_error_bound, self.fallback_error_bound = initial_error_bound, fallback_error_bound
        self.layers = tracked_layers(model)
        self._name_of = {id(m): name for name, m in self.layers.items()}
        self.error_bounds: dict[str, float] = {}
        self.stats: dict[str, LayerStats] = {}
        self.steps = 0
        self._measuring = True  # the first step is measured so bounds exist from the second on
        self._running: list[tuple[str, torch.Tensor | None]] = []  # (layer, its input) innermost last
        self._handles: list = []
        self._codecs: dict[float, Codec] = {}
        self._policy: PolicyHandle | None = None
        self._warned_fallback = False

    # ---- hooks ------------------------------------------------------------------------------------------
    def attach(self) -> "ErrorBoundController":
        """Install the module hooks and the compressor's ``codec_policy``."""
        if self._policy is not None:
            return self
        for module in self.layers.values():
            self._handles.append(module.register_forward_pre_hook(self._enter))
            self._handles.append(module.register_forward_hook(self._exit, always_call=True))
        self._policy = self.compressor.install_policy(codec=self)
        return self

    def detach(self) -> None:
        """Remove every hook and restore the compressor's previous codec policy."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._running.clear()
        if self._policy is not None:
            self._policy.remove()
            self._policy = None

    def __enter__(self) -> "ErrorBoundController":
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()

    @contextlib.contextmanager
    def attached(self) -> Iterator["ErrorBoundController"]:
        """``with controller.attached():`` the same as ``with controller:``."""
        with self:
            yield self

    def _enter(self, module: nn.Module, args) -> None:
        name = self._name_of[id(module)]
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        self._running.append((name, x))
        if self._measuring and torch.is_grad_enabled() and x is not None and not self.compressor.in_detached_steps:
            if x.is_floating_point() and x.numel():
                self.stats.setdefault(name, LayerStats()).nonzero = max(
                    float((x != 0).float().mean()), 1.0 / x.numel())

    def _exit(self, module: nn.Module, args, output) -> None:
        name = self._name_of[id(module)]
        if self._running and self._running[-1][0] == name:
            self._running.pop()
        if not (self._measuring and isinstance(output, torch.Tensor) and output.requires_grad) or \
                self.compressor.in_detached_steps:
            return
        stats = self.stats.setdefault(name, LayerStats())
        # every call adds its products to the one weight gradient: a layer applied twice, or the micro-batches of
        # an accumulated step (their loss scaled by 1/k, which the measured |dL/doutput| carries)
        stats.terms += output.numel() / max(_weight(module).shape[0], 1)

        def record(grad: torch.Tensor) -> None:
            stats.grad_sum += float(grad.abs().mean())
            stats.grad_count += 1

        output.register_hook(record)

    # ---- policy -----------------------------------------------------------------------------------------
    def __call__(self, index: int, t: torch.Tensor) -> Codec | None:
        """The engine's ``codec_policy``: a ``lorenzo`` codec at the running layer's bound for that layer's input;
        ``None`` (the configured codec) for everything else."""
        if not (t.is_floating_point() and self._running):
            return None
        layer, x = self._running[-1]
        if not _is_input(t, x):
            return None
        bound = self.error_bounds.get(layer, self.initial_error_bound)
        return self.codec(bound) if bound is not None else None

    def codec(self, bound: float) -> Codec:
        """The (cached) ``lorenzo`` codec for ``bound``."""
        if bound not in self._codecs:
            self._codecs[bound] = LorenzoCodec(error_bound=bound, backend=self.compressor.config.backend)
        return self._codecs[bound]

    # ---- refresh ----------------------------------------------------------------------------------------
    def step(self) -> dict[str, float]:
        """Call after each optimizer step: on measured steps, recompute the bounds from the momentum and the
        measured statistics; returns the bounds that changed."""
        changed = self.refresh() if self._measuring else {}
        self.steps += 1
        self._measuring = self.steps % self.interval == 0
        if self._measuring:
            self.stats.clear()
        return changed

    def refresh(self) -> dict[str, float]:
        """Recompute every layer's bound from the current momentum and the last measured step."""
        changed, fallbacks = {}, {}  # why a layer falls back -> its names
        for name, module in self.layers.items():
            stats = self.stats.get(name)
            if stats is None:
                continue
            weight = _weight(module)
            owner = next((o for o in self.optimizers if _group_of(o, weight) is not None), None)
            momentum = momentum_magnitude(owner, weight)
            if momentum is None:
                why = f"{type(owner).__name__} keeps no momentum for" if owner else "no optimizer holds the weights of"
                fallbacks.setdefault(why, []).append(name)
                bound = self.fallback_error_bound
            else:
                bound = paper_error_bound(momentum, stats.mean_grad, stats.terms, stats.nonzero, self.coefficient,
                                          self.momentum_fraction)
            if bound is not None and bound != self.error_bounds.get(name):
                self.error_bounds[name] = changed[name] = bound
        if fallbacks and not self._warned_fallback:
            self._warned_fallback = True
            reasons = "; ".join(f"{why} layers {', '.join(names)}" for why, names in fallbacks.items())
            warn_user(
                f"lightning_act: {reasons}; their lorenzo error bound stays at fallback_error_bound="
                f"{self.fallback_error_bound:g}. Use SGD or RMSprop with momentum, Adam or AdamW to adapt it "
                "(Jin et al. eq. 9).")
        self._codecs = {b: c for b, c in self._codecs.items() if b in self.error_bounds.values()}
        return changed

    def state_dict(self) -> dict:
        """The bounds and the step count (a resumed run keeps its bounds and refresh schedule)."""
        return {"error_bounds": dict(self.error_bounds), "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.error_bounds = dict(state["error_bounds"])
        self.steps = int(state["steps"])
        self._measuring = self.steps % self.interval == 0
        self.stats.clear()
