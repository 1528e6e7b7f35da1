"""HuggingFace ``transformers``: a ``Trainer`` whose training forwards compress their activations.

    trainer = ACTTrainer(model=model, args=TrainingArguments(...), train_dataset=..., act_config=act.ACTConfig(bits=4))
    trainer.train()
    trainer.compressor.stats()

``compute_loss_context_manager`` is the hook transformers gives for contexts around the forward; it is also
used by evaluation, so the compressor is entered only for training steps (model in training mode, grad
enabled). With gradient accumulation every micro-batch is compressed; the logged statistics are the last
micro-batch's. ``gradient_checkpointing=True`` goes through the engine's compressed checkpoint: segment inputs
and recomputed tensors are compressed and counted.

``CompressionCallback`` adds the ``act/`` scalars to every training log, so the Trainer's reporting
(``report_to``: TensorBoard, W&B, ...) and ``trainer.state.log_history`` carry them; HF's TensorBoard writer
prefixes them with ``train/``.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from ..callbacks.monitor import step_metrics
from ..config import ACTConfig, resolve_config
from ..engine import ActivationCompressor


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


class ACTTrainerMixin:
    """Mix into a ``transformers.Trainer`` subclass (before it) to compress training activations.

    Takes ``act_config=`` (``ACTConfig``, level name or dict) and ``act_logging=True`` (add a
    :class:`CompressionCallback`, or move the one given in ``callbacks`` first).
    """

    def __init__(self, *args: Any, act_config: ACTConfig | str | dict | None = None, act_logging: bool = True,
                 **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.act_config = resolve_config(act_config)
        self._compressor: ActivationCompressor | None = None
        handler = self.callback_handler
        given = [cb for cb in handler.callbacks if isinstance(cb, CompressionCallback)]
        for cb in given:
            handler.remove_callback(cb)
        self._compression_callback = given[0] if given else (CompressionCallback() if act_logging else None)
        if self._compression_callback is not None:
            handler.callbacks.insert(0, self._compression_callback)  # before the reporters read the logs

    @property
    def compressor(self) -> ActivationCompressor:
        """The compressor of the current model (rebuilt when ``model_init`` replaces the model)."""
        if self._compressor is None or self._compressor.model is not self.model:
            self._compressor = ActivationCompressor(self.model, self.act_config)
            if self._compression_callback is not None:
                self._compression_callback.compressor = self._compressor
        return self._compressor

    def compute_loss_context_manager(self) -> contextlib.ExitStack:
        stack = super().compute_loss_context_manager()
        if self.model.training and torch.is_grad_enabled():
            stack.enter_context(self.compressor.compress())
        return stack


class ACTTrainer(ACTTrainerMixin, Trainer):
    """``transformers.Trainer`` with compressed activations: ``ACTTrainer(..., act_config=ACTConfig(bits=4))``."""
