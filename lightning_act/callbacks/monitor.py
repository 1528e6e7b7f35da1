"""Log what the activation compressor did each training step."""
from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback

PREFIX = "act/"


class CompressionMonitor(Callback):
    """Logs ``act/compression_ratio``, ``act/original_bytes``, ``act/stored_bytes``, ``act/average_bits`` and
    ``act/compressed_tensors`` through the Trainer's logger every ``log_every_n_steps`` (default: the
    Trainer's). Needs an ``ACTStrategy``/``ACTDDPStrategy``."""

    def __init__(self, log_every_n_steps: int | None = None):
        self.log_every_n_steps = log_every_n_steps

    def setup(self, trainer, pl_module, stage: str) -> None:
        if not hasattr(trainer.strategy, "compressor"):
            raise ValueError(
                f"CompressionMonitor needs an activation-compressing strategy; got {type(trainer.strategy).__name__}"
                " (use Trainer(strategy='act') or strategy=lightning_act.ACTStrategy(...))")

    def on_train_batch_end(self, trainer, pl_module, outputs: Any, batch: Any, batch_idx: int) -> None:
        every = self.log_every_n_steps or trainer.log_every_n_steps
        if trainer.global_step % max(every, 1):
            return
        stats = trainer.strategy.compressor.stats()
        values = {
            "compression_ratio": stats.ratio,
            "original_bytes": float(stats.original_bytes),
            "stored_bytes": float(stats.stored_bytes),
            "average_bits": stats.average_bits,
            "compressed_tensors": float(stats.num_compressed),
        }
        for logger in trainer.loggers:
            logger.log_metrics({PREFIX + k: v for k, v in values.items()}, step=trainer.global_step)
