"""Choosing RowCentric's forward and backward row counts from layer shapes (seed 004, III-C).

Estimates come from a dry run on the ``meta`` device (shapes only, no memory, no arithmetic):
the stack is copied with meta parameters and each row block is executed exactly as RowCentric
would. The model of one training step's peak (bytes):

* kept: every segment input (the stack input and, for -H, every group's output checkpoint),
  the final output, parameters and their gradients;
* forward block: two times the largest tensor autograd would save in any forward block (a
  layer's input and output are alive together; the rest of the block is already freed);
* backward block: all tensors the recomputed block saves, plus two times the largest one
  (the gradient flowing in and the one being produced), plus the segment's input and output
  gradients; 2PS adds its kept tails, which live from forward until their block's backward.

Memory falls as rows grow (monotone for the stacks we model), so the smallest row count that
fits is found by bisection, separately for forward and backward (the paper's FP/BP granularities).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_act.nn.row_executor import RowSegment, segment_stack
from lightning_act.nn.row_ops import ROW_DIM


@dataclass(frozen=True)
class RowPlan:
    """Chosen row granularities and the estimated peak memory of one forward+backward step."""

    mode: str
    checkpoint_groups: int | None
    input_shape: tuple[int, ...]
    forward_rows: int
    backward_rows: int
    kept_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    plain_peak_bytes: int
    budget_bytes: int | None

    @property
    def peak_bytes(self) -> int:
        return max(self.forward_peak_bytes, self.backward_peak_bytes)

    def __str__(self) -> str:
        mib = 2.0 ** 20
        budget = "none" if self.budget_bytes is None else f"{self.budget_bytes / mib:.2f} MiB"
        hybrid = "" if self.checkpoint_groups in (None, 1) else f"-H ({self.checkpoint_groups} groups)"
        return "\n".join([
            f"RowCentric plan: mode={self.mode}{hybrid}, input {tuple(self.input_shape)}",
            f"  forward_rows={self.forward_rows}  backward_rows={self.backward_rows}  budget={budget}",
            f"  estimated peak: forward {self.forward_peak_bytes / mib:.2f} MiB, "
            f"backward {self.backward_peak_bytes / mib:.2f} MiB (kept {self.kept_bytes / mib:.2f} MiB; "
            f"plain stack {self.plain_peak_bytes / mib:.2f} MiB)",
        ])


def _meta_copy(stack: nn.Sequential) -> nn.Sequential:
    """Deep copy whose parameters and buffers live on the meta device (weights are not copied)."""
    memo = {}
    for tensor in [*stack.parameters(), *stack.buffers()]:
        meta = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
    return copy.deepcopy(stack, memo)


class _SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Records the activations autograd saves (parameters excluded, each tensor once)."""

    def __init__(self, params: set[int]) -> None:
        self.sizes: dict[int, int] = {}
        self.alive: list[Tensor] = []  # keeps ids unique while counting

        def pack(tensor: Tensor) -> Tensor:
            if id(tensor) not in params:
                self.sizes[id(tensor)] = tensor.numel() * tensor.element_size()
                self.alive.append(tensor)
            return tensor

        super().__init__(pack, lambda tensor: tensor)


def _nbytes(tensor: Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


@dataclass
class RowSegmentCost:
    input_bytes: int
    output_bytes: int
    forward_block: int
    backward_block: int
    tails: int


def _segment_cost(segment: RowSegment, x: Tensor, forward_rows: int, backward_rows: int,
                  params: set[int]) -> tuple[RowSegmentCost, Tensor]:
    segment.forward_rows, segment.backward_rows = forward_rows, backward_rows
    # The forward runs without grad; with grad on meta it reports each block's tensors instead.
    forward_record = _SavedBytes(params)
    with forward_record, torch.enable_grad():
        out, saved = segment.run_forward(x.detach().requires_grad_())
    forward_block = 2 * max(forward_record.sizes.values(), default=0)
    _, edges = segment.forward_blocks(x.shape[ROW_DIM])
    backward_block = 0
    for index in range(len(edges) - 1):
        record = _SavedBytes(params)
        with record:
            segment.recompute_block(x, saved, edges, index, x_needs_grad=True)
        sizes = record.sizes.values()
        backward_block = max(backward_block, sum(sizes) + 2 * max(sizes, default=0))
    tails = sum(_nbytes(t) for t in saved)
    return RowSegmentCost(_nbytes(x), _nbytes(out), forward_block, backward_block, tails), out.detach()


def _estimate(segments: list[RowSegment], x: Tensor, forward_rows: int, backward_rows: int,
              fixed_bytes: int, params: set[int]) -> tuple[int, int, int]:
    """(kept, forward peak, backward peak) bytes for the given granularities."""
    costs = []
    for segment in segments:
        cost, x = _segment_cost(segment, x, forward_rows, backward_rows, params)
        costs.append(cost)
    kept = fixed_bytes + sum(c.input_bytes for c in costs) + costs[-1].output_bytes
    forward = kept + max(c.forward_block + c.tails for c in costs)
    backward = kept + max(c.input_bytes + c.output_bytes + c.tails + c.backward_block for c in costs)
    return kept, forward, backward


def _plain_peak(stack: nn.Sequential, x: Tensor, fixed_bytes: int, params: set[int]) -> int:
    record = _SavedBytes(params)
    with record:
        out = stack(x.detach().requires_grad_())
    sizes = record.sizes.values()
    return fixed_bytes + _nbytes(x) * 2 + _nbytes(out) * 2 + sum(sizes) + 2 * max(sizes, default=0)


def _smallest_fitting(cost: Callable[[int], int], low: int, high: int, budget: int) -> int | None:
    """Smallest rows in [low, high] with cost(rows) <= budget, assuming cost falls with rows."""
    if cost(high) > budget:
        return None
    while low < high:
        middle = (low + high) // 2
        if cost(middle) <= budget:
            high = middle
        else:
            low = middle + 1
    return high


def plan_rows(stack: nn.Sequential | Sequence[nn.Module], input_shape: Sequence[int], *,
              budget_bytes: int | None = None, rows: int | None = None, mode: str = "overlap",
              checkpoint_groups: int | None = None, dtype: torch.dtype = torch.float32) -> RowPlan:
    """Pick forward/backward row counts for ``budget_bytes``, or estimate a given ``rows``.

    Exactly one of ``budget_bytes`` (smallest row counts whose estimated peak fits) and ``rows``
    (forward and backward both use it) must be given. Raises ``ValueError`` if even one output
    row per block does not fit the budget.
    """
    if (budget_bytes is None) == (rows is None):
        raise ValueError(f"budget_bytes={budget_bytes!r}, rows={rows!r}; expected exactly one of them")
    if budget_bytes is not None and (isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int)
                                     or budget_bytes <= 0):
        raise ValueError(f"budget_bytes={budget_bytes!r}; expected a positive integer")
    meta_stack = _meta_copy(stack if isinstance(stack, nn.Sequential) else nn.Sequential(*stack))
    # Cut exactly as RowCentric would, with the same argument checks (the row counts change later).
    segments = segment_stack(meta_stack, 1 if rows is None else rows, mode, checkpoint_groups, None).segments
    params = {id(p) for p in meta_stack.parameters()}
    fixed = 2 * sum(_nbytes(p) for p in meta_stack.parameters())
    x = torch.empty(tuple(input_shape), device="meta", dtype=dtype)
    plain = _plain_peak(meta_stack, x, fixed, params)

    if rows is not None:
        forward_rows = backward_rows = rows
    else:
        most = max(_output_heights(segments, x))
        backward_rows = _smallest_fitting(lambda r: _estimate(segments, x, r, r, fixed, params)[2],
                                          1, most, budget_bytes)
        if backward_rows is None:
            smallest = _estimate(segments, x, most, most, fixed, params)[2]
            raise ValueError(
                f"budget_bytes={budget_bytes}; the smallest estimated peak for input "
                f"{tuple(input_shape)} is {smallest} bytes (rows={most}). Use a larger budget, "
                "checkpoint_groups, or a smaller batch"
            )
        # The forward estimate never exceeds the backward one, so backward_rows always fits.
        forward_rows = _smallest_fitting(
            lambda r: _estimate(segments, x, r, backward_rows, fixed, params)[1], 1, backward_rows, budget_bytes)
    kept, forward, backward = _estimate(segments, x, forward_rows, backward_rows, fixed, params)
    return RowPlan(mode, checkpoint_groups, tuple(input_shape), forward_rows, backward_rows,
                   kept, forward, backward, plain, budget_bytes)


def _output_heights(segments: list[RowSegment], x: Tensor) -> list[int]:
    heights, size = [], x.shape[ROW_DIM]
    for segment in segments:
        size = segment.op.out_size(size)
        heights.append(size)
    return heights
