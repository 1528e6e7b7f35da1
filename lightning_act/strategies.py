"""Lightning strategies: ``Trainer(strategy="act")``, ``"act_ddp"`` / ``"act_ddp_spawn"`` and ``"act_fsdp"``.

The compressor's context only has to cover the forward: each saved tensor carries its unpack hook into
backward, so wrapping ``Strategy.training_step`` is enough for automatic optimisation (backward outside) and
manual optimisation (backward inside). DDP is composed by subclassing, so its ``pre_backward`` /
``post_backward`` and gradient all-reduce run unchanged; so is FSDP2 (Lightning's ``ModelParallelStrategy``), whose
all-gathered weights the engine passes through as parameters (``lightning_act.fsdp``).

The strategies are built for ``lightning.pytorch`` and, when installed, for the standalone
``pytorch_lightning`` package: the two have separate class hierarchies and registries.
"""
from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import torch

from .config import ACTConfig, resolve_config
from .engine import ActivationCompressor
from .fsdp import fsdp_modules, shard_blocks
from ._warn import warn_user

STRATEGY_NAMES = ("act", "act_ddp", "act_ddp_spawn", "act_fsdp")


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
                warn_user(
                    "lightning_act: auto-precision replays training_step, which steps the optimizer under manual "
                    f"optimization; every tensor gets the fixed bits={self.act_config.bits}. Call "
                    "AutoPrecision(compressor).maybe_adapt(step, forward_backward_fn) from training_step to adapt, "
                    "or pass ACTConfig(adaptive=False) to silence this.")
        if self.act_config.memory_budget is not None and not any(isinstance(c, MemoryBudget)
                                                                 for c in trainer.callbacks):
            trainer.callbacks.append(MemoryBudget())


def _build(pl_name: str) -> tuple[type, type]:
    strategies = importlib.import_module(f"{pl_name}.strategies")

    class ACTStrategy(_ACTStrategyMixin, strategies.SingleDeviceStrategy):
        """Single-device training with compressed activations: ``ACTStrategy(ACTConfig(bits=2))``.

        ``device`` defaults to the first of the devices the Trainer was given (``devices=[2]`` trains on
        ``cuda:2``), as Lightning's own single-device choice does.
        """

        strategy_name = "act"

        def __init__(self, config: ACTConfig | str | dict | None = None, device: Any = None, **kwargs: Any):
            super().__init__(device=device if device is not None else "cpu", **kwargs)
            self._device_given = device is not None
            self._trainer_devices: list[torch.device] | None = None
            self._init_act(config)

        @property
        def parallel_devices(self) -> list[torch.device] | None:
            """The devices the Trainer resolved from ``accelerator=`` and ``devices=``: Lightning's accelerator
            connector sets them on every strategy that has this attribute."""
            return self._trainer_devices

        @parallel_devices.setter
        def parallel_devices(self, devices: list[torch.device] | None) -> None:
            self._trainer_devices = devices
            if not self._device_given and devices and len(devices) > 1:
                warn_user(f"lightning_act: strategy 'act' trains on one device, {devices[0]}, of the {len(devices)} "
                          f"the Trainer was given ({', '.join(map(str, devices))}); use strategy='act_ddp' to "
                          "train on all of them, or devices=1 to silence this.")

        @property
        def root_device(self) -> torch.device:
            if not self._device_given and self._trainer_devices:
                return self._trainer_devices[0]
            return self._root_device

    class ACTDDPStrategy(_ACTStrategyMixin, strategies.DDPStrategy):
        """DDP with compressed activations; every ``DDPStrategy`` argument is accepted."""

        strategy_name = "act_ddp"

        def __init__(self, config: ACTConfig | str | dict | None = None, **kwargs: Any):
            super().__init__(**kwargs)
            self._init_act(config)

    model_parallel = importlib.import_module(f"{pl_name}.strategies.model_parallel")

    class ACTFSDPStrategy(_ACTStrategyMixin, strategies.ModelParallelStrategy):
        """FSDP2 (``fully_shard``) with compressed activations; every ``ModelParallelStrategy`` argument is
        accepted. Data parallel over all processes by default (``tensor_parallel_size=1``).

        When ``configure_model`` applied no ``fully_shard`` (or there is none), the strategy shards the model
        itself: each block of every ``nn.ModuleList`` (transformer layers), then each child of the LightningModule
        that holds parameters (:func:`lightning_act.fsdp.shard_blocks`). Parameters stay sharded
        between steps; activations are compressed as in ``"act"``, the all-gathered weights pass through exactly.
        """

        strategy_name = "act_fsdp"

        def __init__(self, config: ACTConfig | str | dict | None = None, data_parallel_size: Any = "auto",
                     tensor_parallel_size: Any = 1, **kwargs: Any):
            super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size,
                             **kwargs)
            self._init_act(config)

        def setup_environment(self) -> None:
            if self._data_parallel_size == "auto" and self._tensor_parallel_size != "auto":
                # Lightning's "auto" is data parallel across nodes only; here it is every process left to it
                self._data_parallel_size = self.num_nodes * self.num_processes // self._tensor_parallel_size
            super().setup_environment()

        def setup(self, trainer: Any) -> None:
            """``ModelParallelStrategy.setup``, with :func:`shard_blocks` instead of its demand for a
            ``configure_model`` when the model has no FSDP module."""
            from torch.distributed.fsdp import FullyShardedDataParallel

            self.accelerator.setup(trainer)
            if any(isinstance(m, FullyShardedDataParallel) for m in self.model.modules()):
                raise TypeError(f"{type(self).__name__} runs FSDP2 (fully_shard); found modules wrapped in "
                                "FSDP1's FullyShardedDataParallel")
            if not fsdp_modules(self.model):
                shard_blocks(self.model, mesh=self.device_mesh["data_parallel"])
            model_parallel._materialize_distributed_module(self.model, self.root_device)
            self.model = self.precision_plugin.convert_module(self.model)
            self.model_to_device()
            self.barrier()
            fitting = trainer.state.fn == model_parallel.TrainerFn.FITTING
            if fitting:
                self.setup_optimizers(trainer)
            self.setup_precision_plugin()
            if fitting:
                model_parallel._optimizers_to_device(self.optimizers, self.root_device)

    registry = strategies.StrategyRegistry
    registry.register("act", ACTStrategy, description="Single device, compressed activations", override=True)
    for name, start_method in (("act_ddp", "popen"), ("act_ddp_spawn", "spawn")):
        registry.register(name, ACTDDPStrategy, description=f"DDP ({start_method}), compressed activations",
                          override=True, start_method=start_method)
    registry.register("act_fsdp", ACTFSDPStrategy, description="FSDP2 (fully_shard), compressed activations",
                      override=True)
    return ACTStrategy, ACTDDPStrategy, ACTFSDPStrategy


ACTStrategy, ACTDDPStrategy, ACTFSDPStrategy = _build("lightning.pytorch")

# The standalone package gets its own classes; they live here under a module-level name so they pickle.
if importlib.util.find_spec("pytorch_lightning") is not None:
    PLACTStrategy, PLACTDDPStrategy, PLACTFSDPStrategy = _build("pytorch_lightning")
    for _cls, _name in ((PLACTStrategy, "PLACTStrategy"), (PLACTDDPStrategy, "PLACTDDPStrategy"),
                        (PLACTFSDPStrategy, "PLACTFSDPStrategy")):
        _cls.__name__ = _cls.__qualname__ = _name
for _cls, _name in ((ACTStrategy, "ACTStrategy"), (ACTDDPStrategy, "ACTDDPStrategy"),
                    (ACTFSDPStrategy, "ACTFSDPStrategy")):
    _cls.__qualname__ = _name
