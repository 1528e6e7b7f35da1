"""Lightning strategies: ``Trainer(strategy="act")`` and ``"act_ddp"`` / ``"act_ddp_spawn"``.

The compressor's context only has to cover the forward: each saved tensor carries its unpack hook into
backward, so wrapping ``Strategy.training_step`` is enough for automatic optimisation (backward outside) and
manual optimisation (backward inside). DDP is composed by subclassing, so its ``pre_backward`` /
``post_backward`` and gradient all-reduce run unchanged.

The strategies are built for ``lightning.pytorch`` and, when installed, for the standalone
``pytorch_lightning`` package: the two have separate class hierarchies and registries.
"""
from __future__ import annotations

import importlib
import importlib.util
import warnings
from typing import Any

import torch

from .config import ACTConfig, resolve_config
from .engine import ActivationCompressor

STRATEGY_NAMES = ("act", "act_ddp", "act_ddp_spawn")


class _ACTStrategyMixin:
    """Runs the LightningModule's ``training_step`` inside the activation compressor's context."""

    act_config: ACTConfig

    def _init_act(self, config: ACTConfig | str | dict | None) -> None:
        self.act_config = resolve_config(config)
        self._compressor: ActivationCompressor | None = None

    @property
    def compressor(self) -> ActivationCompressor:
        """The compressor of the current LightningModule; ``compressor.stats()`` is the last step's."""
        module = self.lightning_module
        if self._compressor is None or self._compressor.model is not module:
            self._compressor = ActivationCompressor(module, self.act_config)
        return self._compressor

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.compressor.compress():
            return super().training_step(*args, **kwargs)

    def connect(self, model: Any) -> None:
        """Attach the module; with ``adaptive`` (GACT's L1 and up) also add an ``AutoPrecision`` callback to the
        Trainer unless one is there, so the levels mean what GACT's Table 1 says without further setup; with a
        ``memory_budget`` likewise a ``MemoryBudget`` callback."""
        super().connect(model)
        trainer = getattr(model, "_trainer", None)
        if trainer is None:
            return
        from .callbacks.auto_precision import AutoPrecision
        from .callbacks.memory_budget import MemoryBudget

        if self.act_config.adaptive and not any(isinstance(c, AutoPrecision) for c in trainer.callbacks):
            if model.automatic_optimization:
                trainer.callbacks.append(AutoPrecision())
            else:
                warnings.warn(
                    "lightning_act: auto-precision replays training_step, which steps the optimizer under manual "
                    f"optimization; every tensor gets the fixed bits={self.act_config.bits}. Call "
                    "AutoPrecision(compressor).maybe_adapt(step, forward_backward_fn) from training_step to adapt, "
                    "or pass ACTConfig(adaptive=False) to silence this.", stacklevel=2)
        if self.act_config.memory_budget is not None and not any(isinstance(c, MemoryBudget)
                                                                 for c in trainer.callbacks):
            trainer.callbacks.append(MemoryBudget())


def _build(pl_name: str) -> tuple[type, type]:
    strategies = importlib.import_module(f"{pl_name}.strategies")

    class ACTStrategy(_ACTStrategyMixin, strategies.SingleDeviceStrategy):
        """Single-device training with compressed activations: ``ACTStrategy(ACTConfig(bits=2))``.

        ``device`` defaults to the first device of the Trainer's accelerator.
        """

        strategy_name = "act"

        def __init__(self, config: ACTConfig | str | dict | None = None, device: Any = None, **kwargs: Any):
            super().__init__(device=device if device is not None else "cpu", **kwargs)
            self._device_given = device is not None
            self._init_act(config)

        @property
        def root_device(self) -> torch.device:
            if not self._device_given and self.accelerator is not None:
                accelerator = self.accelerator
                return accelerator.get_parallel_devices(accelerator.parse_devices(1))[0]
            return self._root_device

    class ACTDDPStrategy(_ACTStrategyMixin, strategies.DDPStrategy):
        """DDP with compressed activations; every ``DDPStrategy`` argument is accepted."""

        strategy_name = "act_ddp"

        def __init__(self, config: ACTConfig | str | dict | None = None, **kwargs: Any):
            super().__init__(**kwargs)
            self._init_act(config)

    registry = strategies.StrategyRegistry
    registry.register("act", ACTStrategy, description="Single device, compressed activations", override=True)
    for name, start_method in (("act_ddp", "popen"), ("act_ddp_spawn", "spawn")):
        registry.register(name, ACTDDPStrategy, description=f"DDP ({start_method}), compressed activations",
                          override=True, start_method=start_method)
    return ACTStrategy, ACTDDPStrategy


ACTStrategy, ACTDDPStrategy = _build("lightning.pytorch")

# The standalone package gets its own classes; they live here under a module-level name so they pickle.
if importlib.util.find_spec("pytorch_lightning") is not None:
    PLACTStrategy, PLACTDDPStrategy = _build("pytorch_lightning")
    for _cls, _name in ((PLACTStrategy, "PLACTStrategy"), (PLACTDDPStrategy, "PLACTDDPStrategy")):
        _cls.__name__ = _cls.__qualname__ = _name
for _cls, _name in ((ACTStrategy, "ACTStrategy"), (ACTDDPStrategy, "ACTDDPStrategy")):
    _cls.__qualname__ = _name
