"""Lightning callback: GACT auto-precision (:class:`lightning_act.adapt.AutoPrecision`) run before training steps.

``Trainer(strategy="act", callbacks=[AutoPrecision()])``; settings default to the strategy's ``ACTConfig``
(``adapt_interval``, ``bit_budget``, ``adapt_fraction``, ``alert_ratio``). The callback is also the controller,
so its plain-PyTorch API (``AutoPrecision(compressor).maybe_adapt(step, forward_backward_fn)``) works as well.
"""
from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback
from torch.nn.parallel import DistributedDataParallel

from ..adapt import auto_precision
from ..metrics import adapt_histograms, adapt_metrics
from .monitor import log_to_loggers
from .replay import check_replayable, replayed_step


class AutoPrecision(auto_precision.AutoPrecision, Callback):
    """:class:`lightning_act.adapt.AutoPrecision` (GACT's per-tensor bits, same arguments and plain API) as a
    Lightning callback: before each training batch it replays ``training_step`` on the batch for the probes when
    a round is due (its ``self.log`` calls muted), broadcasts rank 0's allocation through the strategy, feeds the
    gradient before each optimizer step, and logs the :func:`~lightning_act.metrics.adapt_metrics` scalars and
    :func:`~lightning_act.metrics.adapt_histograms` after every round. Needs an ``ACTStrategy``/``ACTDDPStrategy``
    and automatic optimization; its state is saved in Lightning checkpoints.
    """

    def setup(self, trainer, pl_module, stage: str) -> None:
        check_replayable(trainer, pl_module, "AutoPrecision")

    def on_train_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int) -> None:
        strategy = trainer.strategy
        if strategy.compressor is not self.compressor:
            self.attach(strategy.compressor)
        self._broadcast = lambda obj: strategy.broadcast(obj, src=0)
        self.ddp_model = strategy.model if isinstance(strategy.model, DistributedDataParallel) else None
        forward_backward = replayed_step(trainer, pl_module, batch, batch_idx, "AutoPrecision")
        if self.maybe_adapt(trainer.global_step, forward_backward):
            log_to_loggers(trainer.loggers, adapt_metrics(self), adapt_histograms(self), trainer.global_step)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.observe_gradient()

