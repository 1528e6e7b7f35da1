"""Row-block execution of a RowCentric stack: segments, their autograd Function, recomputation.

:func:`segment_stack` validates RowCentric's settings and cuts a stack into one
:class:`RowSegment` per checkpoint group. A segment's forward runs its row blocks without
keeping feature maps (OverL: each block reads its halo; 2PS: blocks stream top to bottom through
kept tails); its backward recomputes one backward block at a time and accumulates gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_act.nn.row_ops import ROW_DIM, RowOp, RowOpBuilder, count_windows

MODES = ("overlap", "share")


# ----------------------------------------------------------------------------------------------
# Execution: one autograd Function per segment (the whole stack, or one -H group).
# ----------------------------------------------------------------------------------------------


def row_bounds(out_size: int, rows: int) -> list[int]:
    """Even split of ``out_size`` output rows into ``min(rows, out_size)`` blocks: block edges."""
    rows = min(rows, out_size)
    return [i * out_size // rows for i in range(rows + 1)]


class RowSegment:
    """A run of layers partitioned into row blocks, with its forward/backward granularities."""

    def __init__(self, op: RowOp, slots: int, params: list[nn.Parameter], mode: str,
                 forward_rows: int, backward_rows: int) -> None:
        self.op, self.slots, self.params = op, slots, params
        self.mode, self.forward_rows, self.backward_rows = mode, forward_rows, backward_rows

    def __call__(self, x: Tensor) -> Tensor:
        """The segment's output under autograd; its feature maps are recomputed in backward."""
        return _RowSegmentFunction.apply(self, x, *self.params)

    def forward_blocks(self, in_size: int) -> tuple[list[int], list[int]]:
        """(block edges the forward runs, edges where backward blocks start)."""
        out_size = self.op.out_size(in_size)
        backward = row_bounds(out_size, self.backward_rows)
        forward = row_bounds(out_size, self.forward_rows)
        if self.mode == "share":
            # 2PS saves its kept tails at backward-block edges, so the forward stops there too.
            forward = sorted(set(forward) | set(backward))
        return forward, backward

    def chunk(self, x: Tensor, out_lo: int, out_hi: int) -> tuple[Tensor | None, int]:
        """New input rows a 2PS step reads for output rows ``[out_lo, out_hi)``."""
        size = x.shape[ROW_DIM]
        lo, hi = self.op.needed_hi(out_lo, size), self.op.needed_hi(out_hi, size)
        return (x.narrow(ROW_DIM, lo, hi - lo) if hi > lo else None), lo

    def run_forward(self, x: Tensor) -> tuple[Tensor, list[Tensor | None]]:
        """No-grad forward. Returns the output and (2PS) the kept tails at backward-block edges."""
        size = x.shape[ROW_DIM]
        edges, backward_edges = self.forward_blocks(size)
        saved: list[Tensor | None] = []
        state: list[Tensor | None] = [None] * self.slots
        out = None
        for lo, hi in zip(edges[:-1], edges[1:]):
            if self.mode == "overlap":
                block = self.op.run(x, 0, lo, hi, size)
            else:
                chunk, chunk_lo = self.chunk(x, lo, hi)
                state_out: list[Tensor | None] = [None] * self.slots
                block = self.op.step(chunk, chunk_lo, lo, hi, size, state, state_out)
                state = state_out
                if hi in backward_edges[1:-1]:
                    saved.extend(state)
            if out is None:
                shape = list(block.shape)
                shape[ROW_DIM] = edges[-1]
                out = block.new_empty(shape)
            out.narrow(ROW_DIM, lo, hi - lo).copy_(block)
            del block
        return out, saved

    def recompute_block(self, x: Tensor, saved: Sequence[Tensor | None], edges: list[int], index: int,
                        x_needs_grad: bool) -> RecomputedBlock:
        """Re-run backward block ``index`` with grad enabled on detached inputs (leaves)."""
        size = x.shape[ROW_DIM]
        lo, hi = edges[index], edges[index + 1]
        with torch.enable_grad():
            if self.mode == "overlap":
                x_lo, x_hi = self.op.in_range(lo, hi, size)
                x_block = x.narrow(ROW_DIM, x_lo, x_hi - x_lo).detach().requires_grad_(x_needs_grad)
                return RecomputedBlock(self.op.run(x_block, x_lo, lo, hi, size), x_block, x_lo, [], [])
            x_block, x_lo = self.chunk(x, lo, hi)
            if x_block is not None:
                x_block = x_block.detach().requires_grad_(x_needs_grad)
            kept = saved[(index - 1) * self.slots: index * self.slots] if index else [None] * self.slots
            # Tails upstream of every trainable layer (e.g. raw input rows) need no gradient.
            grad_slots: set[int] = set()
            self.op.collect_grad_slots(x_needs_grad, grad_slots)
            state_in = [None if t is None else t.detach().requires_grad_(slot in grad_slots)
                        for slot, t in enumerate(kept)]
            state_out: list[Tensor | None] = [None] * self.slots
            out = self.op.step(x_block, x_lo, lo, hi, size, state_in, state_out)
            return RecomputedBlock(out, x_block, x_lo, state_in, state_out)

    def run_backward(self, x: Tensor, saved: Sequence[Tensor | None], grad_out: Tensor,
                     x_needs_grad: bool) -> tuple[Tensor | None, list[Tensor | None]]:
        """Recompute each backward block and accumulate input/param grads.

        2PS blocks run bottom-up: a block's kept-tail inputs receive gradients that are passed on
        to the previous block as extra output gradients of the tails it produced.
        """
        _, edges = self.forward_blocks(x.shape[ROW_DIM])
        params = [p for p in self.params if p.requires_grad]
        grad_x = torch.zeros_like(x) if x_needs_grad else None
        grad_params: list[Tensor | None] = [None] * len(params)
        carried: list[Tensor | None] = [None] * self.slots
        for index in reversed(range(len(edges) - 1)):
            block = self.recompute_block(x, saved, edges, index, x_needs_grad)
            lo, hi = edges[index], edges[index + 1]
            outputs, grads_out = [block.out], [grad_out.narrow(ROW_DIM, lo, hi - lo)]
            for tail, grad in zip(block.state_out, carried):
                if grad is not None and tail.requires_grad:
                    outputs.append(tail)
                    grads_out.append(grad)
            x_input = [block.x] if x_needs_grad and block.x is not None else []
            tails = [t for t in block.state_in if t is not None and t.requires_grad]
            grads = torch.autograd.grad(outputs, x_input + tails + params, grads_out, allow_unused=True)
            if x_input:
                grad_x.narrow(ROW_DIM, block.x_lo, block.x.shape[ROW_DIM]).add_(grads[0])
            tail_grads = iter(grads[len(x_input):len(x_input) + len(tails)])
            # Copies: a tail's gradient is a slice of its layer's whole block gradient.
            carried = [next(tail_grads) if t is not None and t.requires_grad else None for t in block.state_in]
            carried = [None if g is None else g.clone() for g in carried]
            for i, grad in enumerate(grads[len(x_input) + len(tails):]):
                if grad is not None:
                    grad_params[i] = grad if grad_params[i] is None else grad_params[i] + grad
            # Drop this block's graph and gradients before the next block is recomputed (tails
            # outside the grad path and gradient slices would pin whole block tensors).
            del block, outputs, grads_out, tails, grads, tail_grads
        return grad_x, grad_params


@dataclass
class RecomputedBlock:
    """One backward block rebuilt with autograd: its output, input leaves and 2PS kept tails."""

    out: Tensor
    x: Tensor | None
    x_lo: int
    state_in: list[Tensor | None]
    state_out: list[Tensor | None]


class _RowSegmentFunction(torch.autograd.Function):
    """Forward without keeping feature maps; backward recomputes row block by row block.

    Saves only the segment input (and 2PS kept tails) with ``save_for_backward``, so a surrounding
    ``saved_tensors_hooks`` context (e.g. the compression engine) sees them; the recomputation's
    saved tensors go through whatever hooks are active during backward.
    """

    @staticmethod
    def forward(ctx, segment: RowSegment, x: Tensor, *params: Tensor) -> Tensor:
        out, saved = segment.run_forward(x)
        ctx.segment = segment
        ctx.save_for_backward(x, *saved)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        segment: RowSegment = ctx.segment
        x, *saved = ctx.saved_tensors
        grad_x, grad_params = segment.run_backward(x, saved, grad_out, ctx.needs_input_grad[1])
        trainable = iter(grad_params)
        params = [next(trainable) if p.requires_grad else None for p in segment.params]
        return (None, grad_x, *params)


# ----------------------------------------------------------------------------------------------
# Cutting a stack into segments (-H: one per checkpoint group).
# ----------------------------------------------------------------------------------------------


def _group_units(units: list[tuple[str, nn.Module]], windows: list[int], groups: int) -> list[list[tuple[str, nn.Module]]]:
    """Cut the top-level layers into ``groups`` runs with about equal numbers of windowed layers;
    layers without windows (activations, BatchNorm) stay with the layer before them."""
    total = sum(windows)
    assigned: list[list[tuple[str, nn.Module]]] = [[] for _ in range(groups)]
    group, before = 0, 0
    for unit, count in zip(units, windows):
        if count:
            group = max(group, groups * before // total)
        assigned[group].append(unit)
        before += count
    return [units for units in assigned if units]


def check_rows(name: str, value: object) -> int:
    """``value`` if it is an integer >= 1 (not a bool); else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r}; expected an integer >= 1")
    return value


@dataclass
class SegmentedStack:
    """A stack cut into row segments, with the validated settings it was cut with."""

    stack: nn.Sequential
    forward_rows: int
    backward_rows: int
    checkpoint_groups: int
    segments: list[RowSegment]
    spatial_dims: int | None  # 1 or 2; None for a stack without conv or pool
    batch_norms: list[tuple[str, nn.Module]]  # their mode is rechecked at every forward


def segment_stack(stack: nn.Sequential | Sequence[nn.Module], rows: int, mode: str,
                  checkpoint_groups: int | None, backward_rows: int | None) -> SegmentedStack:
    """Validate RowCentric's arguments and build one :class:`RowSegment` per checkpoint group."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}; expected one of {', '.join(map(repr, MODES))}")
    forward_rows = check_rows("rows", rows)
    backward_rows = check_rows("backward_rows", rows if backward_rows is None else backward_rows)
    if not isinstance(stack, nn.Sequential):
        if not isinstance(stack, Sequence) or not all(isinstance(m, nn.Module) for m in stack):
            raise TypeError(f"stack={type(stack).__name__}; expected nn.Sequential or a list of nn.Module")
        stack = nn.Sequential(*stack)

    units = [(str(i), m) for i, m in enumerate(stack)]
    windows = [count_windows(m) for _, m in units]
    units_with_windows = max(sum(1 for w in windows if w), 1)
    if checkpoint_groups is None:
        checkpoint_groups = 1
    elif (isinstance(checkpoint_groups, bool) or not isinstance(checkpoint_groups, int)
          or not 1 <= checkpoint_groups <= units_with_windows):
        raise ValueError(
            f"checkpoint_groups={checkpoint_groups!r}; expected None or an integer between 1 and "
            f"{units_with_windows} (the number of top-level layers with a conv or pool)"
        )

    segments: list[RowSegment] = []
    spatial_dims: set[int] = set()
    batch_norms: list[tuple[str, nn.Module]] = []
    for group in _group_units(units, windows, checkpoint_groups):
        builder = RowOpBuilder()
        op = builder.chain(group)
        params = list({id(p): p for _, m in group for p in m.parameters()}.values())
        segments.append(RowSegment(op, builder.slots, params, mode, forward_rows, backward_rows))
        spatial_dims |= builder.spatial_dims
        batch_norms += builder.batch_norms
    if len(spatial_dims) > 1:
        raise ValueError("stack mixes 1-d and 2-d convolutions/pools; RowCentric needs one kind")
    return SegmentedStack(stack, forward_rows, backward_rows, checkpoint_groups, segments,
                          spatial_dims.pop() if spatial_dims else None, batch_norms)
