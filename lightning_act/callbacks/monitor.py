"""Log what the activation compressor did each training step.

:func:`~lightning_act.metrics.step_metrics` and :func:`~lightning_act.metrics.tensor_histograms` (re-exported
here) turn one step's :class:`~lightning_act.CompressionStats` into the names every integration logs (Lightning
here, HuggingFace and Accelerate in ``lightning_act.integrations``).
"""
from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger

from ..metrics import PREFIX, step_metrics, tensor_histograms

__all__ = ["PREFIX", "CompressionMonitor", "log_to_loggers", "step_metrics", "tensor_histograms"]


def log_to_loggers(loggers, metrics: dict[str, float], histograms: dict[str, torch.Tensor], step: int) -> None:
    """Scalars to every Lightning logger; histograms to the TensorBoard ones (other loggers have none)."""
    for logger in loggers:
        logger.log_metrics(metrics, step=step)
        if histograms and isinstance(logger, TensorBoardLogger):
            for tag, values in histograms.items():
                logger.experiment.add_histogram(tag, values, global_step=step)


class CompressionMonitor(Callback):
    """Logs the compression of a training step every ``log_every_n_steps`` optimizer steps (default: the
    Trainer's) through the Trainer's loggers: the :func:`step_metrics` scalars to every logger, and the
    :func:`tensor_histograms` to TensorBoard loggers. Needs an ``ACTStrategy``/``ACTDDPStrategy``.

    The scalars also go to ``trainer.callback_metrics`` at every optimizer step (as ``self.log`` puts them there
    whatever the logging interval), where ``ModelCheckpoint(monitor=...)``, ``EarlyStopping`` and the progress
    bar's callbacks read them. With gradient accumulation the statistics are
    those of the micro-batch that completed the optimizer step, logged once per step.
    """

    def __init__(self, log_every_n_steps: int | None = None, histograms: bool = True):
        if log_every_n_steps is not None and (not isinstance(log_every_n_steps, int) or log_every_n_steps < 1):
            raise ValueError(f"log_every_n_steps must be a positive int or None; got {log_every_n_steps!r}")
        self.log_every_n_steps = log_every_n_steps
        self.histograms = histograms
        self._step_seen = 0

    def setup(self, trainer, pl_module, stage: str) -> None:
        if not hasattr(trainer.strategy, "compressor"):
            raise ValueError(
                f"CompressionMonitor needs an activation-compressing strategy; got {type(trainer.strategy).__name__}"
                " (use Trainer(strategy='act') or strategy=lightning_act.ACTStrategy(...))")

    def on_train_start(self, trainer, pl_module) -> None:
        self._step_seen = trainer.global_step  # after a checkpoint's restore: a resumed run goes on from there

    def on_train_batch_end(self, trainer, pl_module, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._step_seen:  # no optimizer step ended with this batch (gradients accumulating)
            return
        self._step_seen = step
        stats = trainer.strategy.compressor.stats()
        metrics = step_metrics(stats)
        # every step, as ``self.log`` does: a monitor reading them at an epoch's end must find them however few
        # steps the epoch has; float64 keeps byte counts exact
        trainer.callback_metrics.update({name: torch.tensor(value, dtype=torch.float64)
                                         for name, value in metrics.items()})
        if step % (self.log_every_n_steps or max(trainer.log_every_n_steps, 1)):
            return
        histograms = tensor_histograms(stats) if self.histograms else {}
        log_to_loggers(trainer.loggers, metrics, histograms, step)
