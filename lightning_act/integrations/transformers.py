"""HuggingFace ``transformers``: a ``Trainer`` whose training forwards compress their activations.

    trainer = ACTTrainer(model=model, args=TrainingArguments(...), train_dataset=..., act_config=act.ACTConfig(bits=4))
    trainer.train()
    trainer.compressor.stats()

``compute_loss_context_manager`` is the hook transformers gives for contexts around the forward; it is also
used by evaluation, so the compressor is entered only for training steps (model in training mode, grad
enabled). With gradient accumulation every micro-batch is compressed; the logged statistics are the last
micro-batch's. HF gradient checkpointing goes through the engine's compressed checkpoint: segment inputs and
recomputed tensors are compressed and counted. Its ``TrainingArguments`` switch is ``activation_checkpointing``
from transformers 5.23 and ``gradient_checkpointing`` before (then a deprecated alias, removed in v6):
``TrainingArguments(..., **checkpointing_args(True))`` uses the name the installed version takes.

``CompressionCallback`` adds the ``act/`` scalars to every training log, so the Trainer's reporting
(``report_to``: TensorBoard, W&B, ...) and ``trainer.state.log_history`` carry them; HF's TensorBoard writer
prefixes them with ``train/``.

With an ``adaptive`` config (GACT's L1 and up, the default) the trainer runs auto-precision
(:class:`~lightning_act.adapt.AutoPrecision`): before the first micro-batch of every ``adapt_interval``-th
optimizer step it re-estimates sensitivities on that micro-batch (extra forward/backward passes whose gradients,
buffers and RNG are restored) and re-allocates bits. ``act_error_bound=True`` (or a dict of
:class:`~lightning_act.adapt.error_bound.ErrorBoundController` options) adapts the ``lorenzo`` bounds of weight
layers' inputs from the optimizer's momentum (Jin et al.), refreshed after optimizer steps. With
``ACTConfig(memory_budget=...)`` the first training step's micro-batch is profiled and the memory-budget plan
(:mod:`lightning_act.adapt.memory_budget`) holds for the run; its table goes to the log. Under DDP each rank plans
for itself.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
from typing import Any, Callable

import torch
from torch.nn.parallel import DistributedDataParallel
from transformers import Trainer, TrainerCallback, TrainingArguments

from ..adapt.auto_precision import AutoPrecision
from ..adapt.error_bound import ErrorBoundController, check_options
from ..adapt.memory_budget import MemoryBudget
from ..config import ACTConfig, resolve_config
from ..engine import ActivationCompressor
from ..metrics import step_metrics
from ..model_prep import compiled_wrapper

_CHECKPOINTING_ARG = ("activation_checkpointing"
                      if "activation_checkpointing" in {f.name for f in dataclasses.fields(TrainingArguments)}
                      else "gradient_checkpointing")


def checkpointing_args(enabled: bool = True) -> dict[str, bool]:
    """The ``TrainingArguments`` keyword that switches HF gradient checkpointing, under the name the installed
    transformers takes: ``{"activation_checkpointing": enabled}`` from 5.23, ``{"gradient_checkpointing": enabled}``
    before."""
    if not isinstance(enabled, bool):
        raise TypeError(f"checkpointing_args(enabled={enabled!r}); expected True or False")
    return {_CHECKPOINTING_ARG: enabled}


class CompressionCallback(TrainerCallback):
    """Adds the compressor's last-step ``act/`` scalars to the Trainer's training logs (those with ``loss``).

    It has to run before the reporting callbacks: :class:`ACTTrainerMixin` puts it first.
    """

    def __init__(self, compressor: ActivationCompressor | None = None):
        self.compressor = compressor

    def on_log(self, args, state, control, logs: dict[str, Any] | None = None, **kwargs):
        if self.compressor is None or logs is None or "loss" not in logs or self.compressor.step_number == 0:
            return
        metrics = step_metrics(self.compressor.stats())
        logs.update(metrics)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(metrics)  # Trainer.log appended a copy of logs before calling us


class _AdaptationCallback(TrainerCallback):
    """Feeds auto-precision the accumulated gradient before each optimizer step, and builds and steps the
    error-bound controller once the Trainer has created its optimizer."""

    def __init__(self, trainer: "ACTTrainerMixin"):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        options = self.trainer.act_error_bound
        if options is None:
            return
        previous = self.trainer.error_bound_controller
        controller = ErrorBoundController(self.trainer.compressor, optimizer, model=self.trainer.model, **options)
        if previous is not None:  # a second train() keeps the bounds and the refresh schedule
            controller.load_state_dict(previous.state_dict())
        self.trainer.error_bound_controller = controller.attach()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.trainer.auto_precision is not None and self.trainer.auto_precision.compressor is not None:
            self.trainer.auto_precision.observe_gradient()

    def on_step_end(self, args, state, control, **kwargs):
        if self.trainer.error_bound_controller is not None:
            self.trainer.error_bound_controller.step()


class ACTTrainerMixin:
    """Mix into a ``transformers.Trainer`` subclass (before it) to compress training activations.

    Takes ``act_config=`` (``ACTConfig``, level name or dict; ``adaptive`` configs run auto-precision),
    ``act_logging=True`` (add a :class:`CompressionCallback`, or move the one given in ``callbacks`` first) and
    ``act_error_bound=False`` (``True`` or a dict of ``ErrorBoundController`` options: adaptive ``lorenzo``
    bounds). ``auto_precision``, ``error_bound_controller`` and ``memory_budget`` (the planner, once the first
    step has planned) expose the adaptation state.
    """

    def __init__(self, *args: Any, act_config: ACTConfig | str | dict | None = None, act_logging: bool = True,
                 act_error_bound: bool | dict[str, Any] = False, **kwargs: Any):
        self.act_error_bound = _error_bound_options(act_error_bound)
        super().__init__(*args, **kwargs)
        self.act_config = resolve_config(act_config)
        self.auto_precision = AutoPrecision() if self.act_config.adaptive else None
        self.error_bound_controller: ErrorBoundController | None = None
        self.memory_budget: MemoryBudget | None = None
        self._compressor: ActivationCompressor | None = None
        self.callback_handler.add_callback(_AdaptationCallback(self))
        handler = self.callback_handler
        given = [cb for cb in handler.callbacks if isinstance(cb, CompressionCallback)]
        for cb in given:
            handler.remove_callback(cb)
        self._compression_callback = given[0] if given else (CompressionCallback() if act_logging else None)
        if self._compression_callback is not None:
            handler.callbacks.insert(0, self._compression_callback)  # before the reporters read the logs

    @property
    def compressor(self) -> ActivationCompressor:
        """The compressor of the current model (rebuilt when ``model_init`` replaces the model). Built on the
        ``torch.compile`` wrapper the Trainer runs the model in (``TrainingArguments(torch_compile=True)``), so that
        the compiled graphs compress their activations inside them (:mod:`lightning_act.compiled_regions`)."""
        model = compiled_wrapper(self.model_wrapped)
        model = self.model if model is None else model
        if self._compressor is None or self._compressor.model is not model:
            self._compressor = ActivationCompressor(model, self.act_config)
            if self._compression_callback is not None:
                self._compression_callback.compressor = self._compressor
            if self.auto_precision is not None:
                self.auto_precision.attach(self._compressor)
        return self._compressor

    def train(self, *args: Any, **kwargs: Any):
        try:
            return super().train(*args, **kwargs)
        finally:  # the controllers' module hooks go, also when training raises
            if self.error_bound_controller is not None:
                self.error_bound_controller.detach()
            if self.memory_budget is not None:
                self.memory_budget.remove()

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch=None) -> torch.Tensor:
        if self.auto_precision is not None:
            self._maybe_adapt(model, inputs, num_items_in_batch)
        if self.act_config.memory_budget is not None:
            self._maybe_plan(model, inputs, num_items_in_batch)
        return super().training_step(model, inputs, num_items_in_batch)

    def _replayed_step(self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch) -> Callable[[], None]:
        def forward_backward() -> None:  # prepares inputs only on the steps that probe
            model.train()
            with self.compute_loss_context_manager():
                loss = self.compute_loss(model, self._prepare_inputs(inputs), num_items_in_batch=num_items_in_batch)
            loss.backward()

        return forward_backward

    def _maybe_adapt(self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch) -> None:
        _ = self.compressor  # (re)attaches auto-precision to the current model's compressor
        self.auto_precision.ddp_model = model if isinstance(model, DistributedDataParallel) else None
        self.auto_precision.maybe_adapt(self.state.global_step,
                                        self._replayed_step(model, inputs, num_items_in_batch))

    def _maybe_plan(self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch) -> None:
        compressor = self.compressor
        if self.memory_budget is not None and self.memory_budget.compressor is compressor:
            return
        if self.memory_budget is not None:
            self.memory_budget.remove()
        sensitivities = ({a["index"]: a["sensitivity"] for a in self.auto_precision.assignment()}
                         if self.auto_precision is not None else None)
        self.memory_budget = MemoryBudget(compressor, self.act_config.memory_budget, sensitivities=sensitivities)
        plan = self.memory_budget.plan(self._replayed_step(model, inputs, num_items_in_batch))
        logging.getLogger(__name__).info("lightning_act memory-budget plan:\n%s", plan.table())

    def compute_loss_context_manager(self) -> contextlib.ExitStack:
        stack = super().compute_loss_context_manager()
        if self.model.training and torch.is_grad_enabled():
            stack.enter_context(self.compressor.compress())
        return stack


class ACTTrainer(ACTTrainerMixin, Trainer):
    """``transformers.Trainer`` with compressed activations: ``ACTTrainer(..., act_config=ACTConfig(bits=4))``."""


def _error_bound_options(spec: bool | dict[str, Any]) -> dict[str, Any] | None:
    """``act_error_bound`` as controller options (``None``: off), unknown option names rejected up front."""
    if spec is False:
        return None
    if spec is True:
        return {}
    if not isinstance(spec, dict):
        raise TypeError(f"act_error_bound={spec!r}; expected True, False or a dict of ErrorBoundController options")
    allowed = [name for name, p in inspect.signature(ErrorBoundController).parameters.items()
               if p.kind is p.KEYWORD_ONLY and name != "model"]
    unknown = sorted(set(spec) - set(allowed))
    if unknown:
        raise ValueError(f"act_error_bound has unknown options {', '.join(unknown)}; expected some of "
                         f"{', '.join(allowed)}")
    check_options(**spec)  # the values too, before training starts
    return dict(spec)
