"""Replaying a batch's ``training_step`` for probes and profiling passes (auto-precision, the memory budget)."""
from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, Callable, Iterator

import torch


def replayed_step(trainer, pl_module, batch: Any, batch_idx: int, caller: str) -> Callable[[], None]:
    """``forward_backward()``: the strategy's ``training_step`` on ``batch`` (its ``self.log`` calls muted) and the
    loss's backward, no optimizer step. ``caller`` names the callback in the error for a step without a loss."""
    strategy = trainer.strategy

    def forward_backward() -> None:
        with _logging_muted(pl_module):
            output = strategy.training_step(batch, batch_idx)
        loss = output.get("loss") if isinstance(output, Mapping) else output
        if not isinstance(loss, torch.Tensor):
            raise ValueError(f"training_step returned {type(output).__name__}; {caller} needs a loss tensor or a "
                             "dict with 'loss'")
        loss.backward()

    return forward_backward


def check_replayable(trainer, pl_module, caller: str) -> None:
    """``caller`` needs an activation-compressing strategy and automatic optimization (a replayed
    ``training_step`` under manual optimization would step the optimizer)."""
    if not hasattr(trainer.strategy, "compressor"):
        raise ValueError(
            f"{caller} needs an activation-compressing strategy; got {type(trainer.strategy).__name__}"
            " (use Trainer(strategy='act') or strategy=lightning_act.ACTStrategy(...))")
    if not pl_module.automatic_optimization:
        raise ValueError(
            f"{caller} replays training_step, which steps the optimizer under manual optimization; use its "
            "plain-PyTorch API from training_step instead")


@contextlib.contextmanager
def _logging_muted(pl_module) -> Iterator[None]:
    """``self.log`` calls of a replayed ``training_step`` must not reach the logs."""
    pl_module.log = lambda *args, **kwargs: None
    try:
        yield
    finally:
        del pl_module.log
