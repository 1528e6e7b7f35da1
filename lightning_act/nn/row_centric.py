"""LR-CNN row-centric execution of convolution stacks (seed 004, sections III-IV).

A stack of row-separable layers is run row block by row block along the height (dim 2: H of
N,C,H,W or L of N,C,L), so only one row block's feature maps are alive at a time; backward
recomputes each row block from the kept input. Two ways to deal with kernels that straddle
row-block edges:

* ``mode="overlap"`` (OverL, IV-B): every row block reads its input with the halo its receptive
  field needs, so blocks run independently. Zero padding is "semi-closed": it is applied only at
  the true image borders. Overlapped input gradients are summed by autograd, which is exact.
* ``mode="share"`` (2PS, IV-A): blocks run top to bottom and every layer keeps the tail rows of
  its input that the next block's windows need, so nothing is recomputed across blocks. The kept
  tails are saved at backward-block edges and carry gradients back to the previous block.

``checkpoint_groups`` gives the -H variants: the stack is cut into groups whose full-height
outputs are kept (checkpoints), and row partitioning runs inside each group.

The layers become row ops (``row_ops``), run by segments (``row_executor``) whose row counts
``row_plan`` can choose for a memory budget; this module holds the user-facing wrappers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from lightning_act._validate import check_type
from lightning_act.nn.row_executor import MODES, check_rows, row_bounds, segment_stack
from lightning_act.nn.row_ops import (
    ROW_DIM,
    Residual,
    RowOpBuilder,
    check_batch_norm,
    count_windows,
)
from lightning_act.nn.row_plan import RowPlan, plan_rows

# MODES, ROW_DIM and row_bounds were defined here before the row ops and executor moved out.
__all__ = ["MODES", "ROW_DIM", "Residual", "RowCentric", "RowPlan", "row_bounds", "wrap_conv_trunks"]


class RowCentric(nn.Module):
    """Run a row-separable conv stack row block by row block (LR-CNN, seed 004).

    Args:
        stack: ``nn.Sequential`` or list of modules: Conv1d/Conv2d (any kernel, stride, dilation,
            zero padding incl. 'same'), MaxPool/AvgPool, eval-mode BatchNorm, elementwise
            activations, nested ``nn.Sequential`` and :class:`Residual` blocks.
        rows: forward row blocks (split of each segment's output height; clamped to it).
        mode: ``"overlap"`` (OverL: halos recomputed, blocks independent) or ``"share"``
            (2PS: boundary rows shared between consecutive blocks, no redundant compute).
        checkpoint_groups: -H variants: cut the stack into this many groups whose full outputs
            are kept; rows are partitioned inside each group. ``None``: one group.
        backward_rows: row blocks for the backward recomputation (default: ``rows``); backward
            keeps a block's whole graph alive, so it usually wants more rows than forward.

    Input is N,C,H,W for Conv2d stacks (rows along H) or N,C,L for Conv1d stacks (rows along L).
    BatchNorm layers are kept in eval mode by :meth:`train`, since batch statistics span all rows.
    """

    def __init__(self, stack: nn.Sequential | Sequence[nn.Module], rows: int = 4,
                 mode: str = "overlap", checkpoint_groups: int | None = None,
                 backward_rows: int | None = None) -> None:
        super().__init__()
        segmented = segment_stack(stack, rows, mode, checkpoint_groups, backward_rows)
        self.stack = segmented.stack
        self.mode, self.checkpoint_groups = mode, segmented.checkpoint_groups
        self.forward_rows, self.backward_rows = segmented.forward_rows, segmented.backward_rows
        self.spatial_dims = segmented.spatial_dims
        self._segments = segmented.segments
        self._batch_norms = segmented.batch_norms

    def train(self, mode: bool = True) -> RowCentric:
        super().train(mode)
        for _, bn in self._batch_norms:
            bn.eval()  # frozen: batch statistics would span all rows
        return self

    def forward(self, x: Tensor) -> Tensor:
        expected = None if self.spatial_dims is None else self.spatial_dims + 2
        if x.dim() not in (3, 4) or (expected is not None and x.dim() != expected):
            raise ValueError(
                f"input of shape {tuple(x.shape)}; expected {expected or '3 or 4'} dims "
                "(N,C,L for 1-d stacks, N,C,H,W for 2-d stacks)"
            )
        for name, bn in self._batch_norms:
            check_batch_norm(bn, name)
        for segment in self._segments:
            x = segment(x)
        return x

    def extra_repr(self) -> str:
        return (f"mode={self.mode!r}, rows={self.forward_rows}, backward_rows={self.backward_rows}, "
                f"checkpoint_groups={self.checkpoint_groups}")

    @staticmethod
    def plan(stack: nn.Sequential | Sequence[nn.Module], input_shape: Sequence[int], *,
             budget_bytes: int | None = None, rows: int | None = None, mode: str = "overlap",
             checkpoint_groups: int | None = None, dtype: torch.dtype = torch.float32) -> RowPlan:
        """Choose forward/backward row counts for a memory budget (or report a given ``rows``).

        See :func:`lightning_act.nn.row_plan.plan_rows`.
        """
        return plan_rows(stack, input_shape, budget_bytes=budget_bytes, rows=rows, mode=mode,
                         checkpoint_groups=checkpoint_groups, dtype=dtype)

    @classmethod
    def from_plan(cls, stack: nn.Sequential | Sequence[nn.Module], plan: RowPlan) -> RowCentric:
        """Wrap ``stack`` with the granularities and mode chosen by :meth:`plan`."""
        return cls(stack, rows=plan.forward_rows, mode=plan.mode,
                   checkpoint_groups=plan.checkpoint_groups, backward_rows=plan.backward_rows)


def _row_separable(module: nn.Module, where: str) -> bool:
    """Whether ``module`` could join a RowCentric stack as it is (a train-mode BatchNorm cannot)."""
    try:
        RowOpBuilder().build(module, where)
    except (TypeError, ValueError):
        return False
    return True


def wrap_conv_trunks(model: nn.Module, rows: int = 4, mode: str = "overlap", *,
                     checkpoint_groups: int | None = None, backward_rows: int | None = None,
                     min_windows: int = 2) -> list[str]:
    """Replace each maximal run of row-separable children of every ``nn.Sequential`` in ``model`` (a VGG's
    ``features``, a ResNet-style trunk built from :class:`Residual` blocks) by a :class:`RowCentric` over
    that run, in place. Runs with fewer than ``min_windows`` conv/pool layers are left alone (nothing to gain).

    A BatchNorm in training mode ends a run (its batch statistics span all rows): call ``model.eval()`` on
    those layers, or freeze them, before converting to include them. The wrapped layers keep their parameter
    objects, so optimizers built before keep working; their state-dict keys gain the wrapper's prefix.
    Returns the wrapped runs as ``"path[first:stop]"``.
    """
    check_type("model", model, nn.Module, "an nn.Module")
    check_rows("min_windows", min_windows)
    wrapped: list[str] = []

    def convert(module: nn.Module, path: str) -> None:
        if isinstance(module, RowCentric):
            return
        if not isinstance(module, nn.Sequential):
            for name, child in module.named_children():
                convert(child, f"{path}.{name}" if path else name)
            return
        items = list(module._modules.items())
        kept: list[tuple[str, nn.Module]] = []
        run: list[int] = []

        def close_run() -> None:
            if sum(count_windows(items[i][1]) for i in run) >= min_windows:
                stack = nn.Sequential(*(items[i][1] for i in run))
                kept.append((items[run[0]][0], RowCentric(stack, rows=rows, mode=mode,
                                                          checkpoint_groups=checkpoint_groups,
                                                          backward_rows=backward_rows)))
                wrapped.append(f"{path or type(model).__name__}[{run[0]}:{run[-1] + 1}]")
            else:
                for i in run:
                    convert(items[i][1], f"{path}.{items[i][0]}" if path else items[i][0])
                    kept.append(items[i])
            run.clear()

        for i, (name, child) in enumerate(items):
            if _row_separable(child, name):
                run.append(i)
                continue
            close_run()
            convert(child, f"{path}.{name}" if path else name)
            kept.append((name, child))
        close_run()
        if [m for _, m in kept] != [m for _, m in items]:
            module._modules.clear()
            module._modules.update(kept)

    convert(model, "")
    return wrapped
