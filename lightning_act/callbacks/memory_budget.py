"""Lightning callback: the memory-budget planner (:mod:`lightning_act.adapt.memory_budget`) on the first batch.

Added by the strategies when ``ACTConfig(memory_budget=...)`` is set, or given explicitly:
``Trainer(strategy="act", callbacks=[MemoryBudget("6GiB")])``.
"""
from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info

from .._validate import parse_bytes
from ..adapt import memory_budget
from .auto_precision import AutoPrecision
from .monitor import log_to_loggers
from .replay import check_replayable, replayed_step


class MemoryBudget(Callback):
    """Plans on the first training batch (replaying ``training_step`` on it, state restored), keeps the plan for
    the run and undoes it at teardown. Under DDP rank 0's plan is broadcast, so every rank runs the same one.
    The plan's table goes to the log (rank 0) and, as text ``act/budget/plan``, to TensorBoard loggers; the
    :meth:`~lightning_act.adapt.memory_budget.MemoryBudget.metrics` scalars to every logger. With an
    ``AutoPrecision`` callback that has estimated sensitivities, they weigh the plan's accuracy cost.

    Args:
        budget: bytes or a size such as ``"6GiB"``; ``None`` takes the strategy config's ``memory_budget``.
        accuracy_weight: see :class:`lightning_act.adapt.memory_budget.MemoryBudget`.
    """

    def __init__(self, budget: int | str | None = None, accuracy_weight: float = 1.0):
        self.budget = None if budget is None else parse_bytes("memory_budget", budget)
        self.accuracy_weight = accuracy_weight
        self.planner: memory_budget.MemoryBudget | None = None

    @property
    def plan(self) -> memory_budget.BudgetPlan | None:
        """The plan in force, once the first batch has run."""
        return None if self.planner is None else self.planner.last_plan

    def setup(self, trainer, pl_module, stage: str) -> None:
        check_replayable(trainer, pl_module, "MemoryBudget")
        if self.budget is None:
            self.budget = trainer.strategy.act_config.memory_budget
        if self.budget is None:
            raise ValueError("MemoryBudget needs a budget: MemoryBudget('6GiB') or ACTConfig(memory_budget=...); "
                             "got neither")

    def on_train_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int) -> None:
        compressor = trainer.strategy.compressor
        if self.planner is not None and self.planner.compressor is compressor:
            return
        sensitivities = {}
        for callback in trainer.callbacks:
            if isinstance(callback, AutoPrecision):
                sensitivities = {a["index"]: a["sensitivity"] for a in callback.assignment()}
        self.planner = memory_budget.MemoryBudget(compressor, self.budget, accuracy_weight=self.accuracy_weight,
                                                  sensitivities=sensitivities)
        plan = self.planner.plan(replayed_step(trainer, pl_module, batch, batch_idx, "MemoryBudget"))
        options = trainer.strategy.broadcast(plan.options, src=0)
        if options != plan.options:
            plan.options = options
            self.planner.apply(options)
        rank_zero_info(f"lightning_act memory-budget plan:\n{plan.table()}")
        log_to_loggers(trainer.loggers, self.planner.metrics(), {}, trainer.global_step)
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_text("act/budget/plan", plan.table(), global_step=trainer.global_step)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if self.planner is not None:
            self.planner.remove()
            self.planner = None
