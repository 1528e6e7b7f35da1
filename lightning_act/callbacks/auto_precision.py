"""Lightning callback: GACT auto-precision (:class:`lightning_act.adapt.AutoPrecision`) run before training steps.

``Trainer(strategy="act", callbacks=[AutoPrecision()])``; settings default to the strategy's ``ACTConfig``
(``adapt_interval``, ``bit_budget``, ``adapt_fraction``, ``alert_ratio``). The callback is also the controller,
so its plain-PyTorch API (``AutoPrecision(compressor).maybe_adapt(step, forward_backward_fn)``) works as well.
"""
from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, Iterator

import torch
from lightning.pytorch.callbacks import Callback
from torch.nn.parallel import DistributedDataParallel

from ..adapt import auto_precision
from ..metrics import adapt_histograms, adapt_metrics
from .monitor import log_to_loggers


class AutoPrecision(auto_precision.AutoPrecision, Callback):
    """:class:`lightning_act.adapt.AutoPrecision` (GACT's per-tensor bits, same arguments and plain API) as a
    Lightning callback: before each training batch it replays ``training_step`` on the batch for the probes when
    a round is due (its ``self.log`` calls muted), broadcasts rank 0's allocation through the strategy, feeds the
    gradient before each optimizer step, and logs the :func:`~lightning_act.metrics.adapt_metrics` scalars and
    :func:`~lightning_act.metrics.adapt_histograms` after every round. Needs an ``ACTStrategy``/``ACTDDPStrategy``
    and automatic optimization; its state is saved in Lightning checkpoints.
    """

    def setup(self, trainer, pl_module, stage: str) -> None:
        if not hasattr(trainer.strategy, "compressor"):
            raise ValueError(
                f"AutoPrecision needs an activation-compressing strategy; got {type(trainer.strategy).__name__}"
                " (use Trainer(strategy='act') or strategy=lightning_act.ACTStrategy(...))")
        if not pl_module.automatic_optimization:
            raise ValueError(
                "AutoPrecision replays training_step, which steps the optimizer under manual optimization; "
                "call AutoPrecision(compressor).maybe_adapt(step, forward_backward_fn) from training_step instead")

    def on_train_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int) -> None:
        strategy = trainer.strategy
        if strategy.compressor is not self.compressor:
            self.attach(strategy.compressor)
        self._broadcast = lambda obj: strategy.broadcast(obj, src=0)
        self.ddp_model = strategy.model if isinstance(strategy.model, DistributedDataParallel) else None

        def forward_backward() -> None:
            with _logging_muted(pl_module):
                output = strategy.training_step(batch, batch_idx)
            loss = output.get("loss") if isinstance(output, Mapping) else output
            if not isinstance(loss, torch.Tensor):
                raise ValueError(f"training_step returned {type(output).__name__}; AutoPrecision needs a loss "
                                 "tensor or a dict with 'loss'")
            loss.backward()

        if self.maybe_adapt(trainer.global_step, forward_backward):
            log_to_loggers(trainer.loggers, adapt_metrics(self), adapt_histograms(self), trainer.global_step)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.observe_gradient()


@contextlib.contextmanager
def _logging_muted(pl_module) -> Iterator[None]:
    """``self.log`` calls of a replayed ``training_step`` must not reach the logs."""
    pl_module.log = lambda *args, **kwargs: None
    try:
        yield
    finally:
        del pl_module.log
