"""Per-layer statistics by module hooks: each saved tensor of a compressor's step is attributed to the
innermost *tracked* module running when it was saved; tensors saved outside any (functional ops in the model's
own ``forward``, the loss) go to ``"(model)"``. The GNN integration tracks ``MessagePassing`` layers
(:class:`lightning_act.integrations.LayerStats`); the memory-budget planner its budget units."""
from __future__ import annotations

from typing import Callable

from torch import nn

from ._validate import check_type
from .engine import ActivationCompressor
from .stats import CompressionStats

OUTSIDE = "(model)"


class LayerStats:
    """Attributes each saved tensor of ``compressor``'s steps to a layer of ``model``.

    ``layers`` chooses the tracked modules: a callable ``model -> {name: module}``. Hooks are attached by :meth:`attach` or ``with LayerStats(...)``, removed by
    :meth:`detach` (the ``with`` block removes them even when the forward raises).
    """

    def __init__(self, model: nn.Module, compressor: ActivationCompressor,
                 layers: Callable[[nn.Module], dict[str, nn.Module]]):
        check_type("model", model, nn.Module, "an nn.Module")
        check_type("compressor", compressor, ActivationCompressor, "an ActivationCompressor")
        self.model = model
        self.compressor = compressor
        self.layers = layers(model)
        if not self.layers:
            raise ValueError(f"no layers to track in {type(model).__name__}: the layers callable returned none")
        self._handles: list = []
        self._stack: list[str] = []
        self._step_number: int | None = None
        self._owner: list[str] = []  # layer name of each saved-tensor index of the step being recorded

    # ---- attach / detach ----------------------------------------------------------------------------------
    def attach(self) -> "LayerStats":
        if self._handles:
            raise RuntimeError("LayerStats is already attached; call detach() first")
        for name, module in self.layers.items():
            self._handles.append(module.register_forward_pre_hook(self._enter(name)))
            # always_call: the stack is popped even when the layer's forward raises
            self._handles.append(module.register_forward_hook(self._exit(name), always_call=True))
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._stack.clear()

    def __enter__(self) -> "LayerStats":
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()

    # ---- attribution ----------------------------------------------------------------------------------------
    def _claim(self) -> None:
        """Give the tensors saved since the last hook to the layer on top of the stack."""
        step = self.compressor.current_step
        if step is None:  # a forward outside compress() (evaluation): nothing is saved
            return
        if step.number != self._step_number:
            self._step_number, self._owner = step.number, []
        owner = self._stack[-1] if self._stack else OUTSIDE
        self._owner.extend([owner] * (len(step.records) - len(self._owner)))

    def _enter(self, name: str):
        def hook(module, args):
            self._claim()
            self._stack.append(name)
        return hook

    def _exit(self, name: str):
        def hook(module, args, output):
            self._claim()
            if self._stack and self._stack[-1] == name:
                self._stack.pop()
        return hook

    def per_layer(self) -> dict[str, CompressionStats]:
        """Statistics of the compressor's last step by layer, in forward order; tensors saved after the last
        tracked layer (or recomputed by checkpoints in backward) count for ``"(model)"``."""
        records = self.compressor.stats().records
        if self._step_number != self.compressor.step_number - 1:
            raise RuntimeError(
                f"LayerStats saw no forward of the compressor's last step ({self.compressor.step_number - 1}); "
                "attach it before running the forward under compress()")
        grouped: dict[str, list] = {}
        for r in records:
            owner = self._owner[r.index] if r.index < len(self._owner) else OUTSIDE
            grouped.setdefault(owner, []).append(r)
        return {name: CompressionStats.from_records(rs) for name, rs in grouped.items()}

    def table(self) -> str:
        """One line per layer: saved tensors, original and stored bytes, ratio."""
        rows = [f"{'layer':24} {'saved':>6} {'original B':>12} {'stored B':>12} {'ratio':>7}"]
        for name, s in self.per_layer().items():
            rows.append(f"{name:24} {s.num_saved:>6} {s.original_bytes:>12,} {s.stored_bytes:>12,} {s.ratio:>6.2f}x")
        return "\n".join(rows)
