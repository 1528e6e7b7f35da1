"""Lightning callback: per-layer ``lorenzo`` error bounds from momentum statistics (Jin et al. eq. 8-9)."""
from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback

from ..adapt.error_bound import (DEFAULT_FALLBACK_ERROR_BOUND, DEFAULT_INTERVAL, PAPER_COEFFICIENT,
                                  PAPER_MOMENTUM_FRACTION, ErrorBoundController, check_options)
from ..metrics import error_bound_metrics


class ErrorBoundCallback(Callback):
    """Compresses each weight layer's saved input with ``lorenzo`` at a bound derived from the optimizer's
    momentum every ``interval`` steps (see :mod:`lightning_act.adapt.error_bound`; the other saved tensors use
    the strategy's configured codec, e.g. ``ACTConfig(codec="lorenzo", error_bound=1e-3)``), and logs the bounds as
    ``act/error_bound/<layer>`` whenever a refresh changes them. Needs an ``ACTStrategy``/``ACTDDPStrategy``.
    Its state (bounds, step count, history) is saved in Lightning checkpoints and restored on resume."""

    def __init__(self, interval: int = DEFAULT_INTERVAL, coefficient: float = PAPER_COEFFICIENT,
                 momentum_fraction: float = PAPER_MOMENTUM_FRACTION, initial_error_bound: float | None = None,
                 fallback_error_bound: float = DEFAULT_FALLBACK_ERROR_BOUND):
        self.options = {"interval": interval, "coefficient": coefficient, "momentum_fraction": momentum_fraction,
                        "initial_error_bound": initial_error_bound, "fallback_error_bound": fallback_error_bound}
        check_options(**self.options)  # now, not when training starts
        self.controller: ErrorBoundController | None = None
        # (global step, layer -> bound) at every refresh, for inspection after training
        self.history: list[tuple[int, dict[str, float]]] = []
        self._restored: dict | None = None
        self._stepped_at = 0  # the trainer's global step when the controller last stepped

    def setup(self, trainer, pl_module, stage: str) -> None:
        if not hasattr(trainer.strategy, "compressor"):
            raise ValueError(
                f"ErrorBoundCallback needs an activation-compressing strategy; got {type(trainer.strategy).__name__}"
                " (use Trainer(strategy='act') or strategy=lightning_act.ACTStrategy(...))")

    def on_train_start(self, trainer, pl_module) -> None:
        self.controller = ErrorBoundController(trainer.strategy.compressor, list(trainer.optimizers), model=pl_module,
                                               **self.options).attach()
        self._stepped_at = trainer.global_step
        if self._restored is not None:
            self.controller.load_state_dict(self._restored)

    def state_dict(self) -> dict[str, Any]:
        state = self.controller.state_dict() if self.controller is not None else self._restored or {}
        return {**state, "history": list(self.history)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = list(state_dict.get("history", []))
        self._restored = {k: v for k, v in state_dict.items() if k != "history"} or None

    def on_train_batch_end(self, trainer, pl_module, outputs: Any, batch: Any, batch_idx: int) -> None:
        # the controller steps with the optimizer: once per accumulated step, after it (the batches accumulated
        # before it are measured together)
        if self.controller is None or trainer.global_step == self._stepped_at:
            return
        self._stepped_at = trainer.global_step
        if not self.controller.step():
            return
        bounds = dict(self.controller.error_bounds)
        self.history.append((trainer.global_step, bounds))
        for logger in trainer.loggers:
            logger.log_metrics(error_bound_metrics(bounds), step=trainer.global_step)

    def _detach(self) -> None:
        if self.controller is not None:
            self.controller.detach()

    def on_train_end(self, trainer, pl_module) -> None:
        self._detach()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._detach()
