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

Row geometry convention: every op maps an output row range ``[out_lo, out_hi)`` to the input rows
it reads, clipped to the real input; rows outside the input are the layer's own zero (or -inf)
padding and are synthesised only at the true borders.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

if TYPE_CHECKING:
    from lightning_act.nn._row_plan import RowPlan

MODES = ("overlap", "share")
ROW_DIM = 2

_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d)
_POINTWISE = (
    nn.Identity, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU,
    nn.SiLU, nn.Mish, nn.Sigmoid, nn.Tanh, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Softplus,
)
_SUPPORTED = (
    "Conv1d/Conv2d (zero padding), MaxPool1d/2d, AvgPool1d/2d (ceil_mode=False), eval-mode "
    "BatchNorm1d/2d, elementwise activations, nn.Sequential and lightning_act.nn.Residual"
)


class Residual(nn.Module):
    """``body(x) + shortcut(x)``: a residual block RowCentric can partition into rows.

    Both branches must be row-separable stacks producing the same output shape; ``shortcut=None``
    is the identity. Put the post-addition activation after the block in the enclosing stack.
    """

    def __init__(self, body: nn.Module, shortcut: nn.Module | None = None) -> None:
        super().__init__()
        self.body = body
        self.shortcut = nn.Identity() if shortcut is None else shortcut

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x) + self.shortcut(x)


# ----------------------------------------------------------------------------------------------
# Row ops: the row geometry and row-block execution of one layer or container.
# ----------------------------------------------------------------------------------------------


class _RowOp:
    """Runs a layer on a row block. ``x`` always holds input rows ``[x_lo, x_lo + x.shape[2])``."""

    def out_size(self, in_size: int) -> int:
        raise NotImplementedError

    def in_range(self, out_lo: int, out_hi: int, in_size: int) -> tuple[int, int]:
        """Input rows (clipped to ``[0, in_size)``) read to produce output rows ``[out_lo, out_hi)``."""
        raise NotImplementedError

    def run(self, x: Tensor, x_lo: int, out_lo: int, out_hi: int, in_size: int) -> Tensor:
        """Output rows ``[out_lo, out_hi)`` from ``x``, which must cover :meth:`in_range`."""
        raise NotImplementedError

    def step(self, chunk: Tensor | None, chunk_lo: int, out_lo: int, out_hi: int, in_size: int,
             state_in: Sequence[Tensor | None], state_out: list[Tensor | None]) -> Tensor | None:
        """2PS streaming: consume new input rows ``chunk`` (None: no new rows), emit output rows
        ``[out_lo, out_hi)`` (None if empty). Kept input tails live in ``state_*[slot]``."""
        raise NotImplementedError

    def needed_hi(self, out_hi: int, in_size: int) -> int:
        """Input rows ``[0, needed_hi)`` suffice for output rows ``[0, out_hi)``."""
        return self.in_range(out_hi - 1, out_hi, in_size)[1] if out_hi > 0 else 0

    def collect_grad_slots(self, input_needs_grad: bool, slots: set[int]) -> bool:
        """Add the 2PS slots whose kept input tail needs a gradient; return whether the output does."""
        raise NotImplementedError


class _Leaf(_RowOp):
    """A single layer; its 2PS state is the tail of its input that later output rows still read."""

    slot: int
    module: nn.Module

    def collect_grad_slots(self, input_needs_grad, slots):
        if input_needs_grad:
            slots.add(self.slot)
        return input_needs_grad or any(p.requires_grad for p in self.module.parameters())

    def step(self, chunk, chunk_lo, out_lo, out_hi, in_size, state_in, state_out):
        kept = state_in[self.slot]
        kept_rows = 0 if kept is None else kept.shape[ROW_DIM]
        if chunk is None:
            x = kept
        else:
            x = chunk if kept is None else torch.cat([kept, chunk], ROW_DIM)
        x_lo = chunk_lo - kept_rows
        x_hi = x_lo + x.shape[ROW_DIM]
        out = self.run(x, x_lo, out_lo, out_hi, in_size) if out_hi > out_lo else None
        done = out_hi >= self.out_size(in_size)
        keep_lo = x_hi if done else min(self.in_range(out_hi, out_hi + 1, in_size)[0], x_hi)
        # A copy, not a view: a view would pin this layer's whole row block until the step ends.
        state_out[self.slot] = x.narrow(ROW_DIM, keep_lo - x_lo, x_hi - keep_lo).clone()
        return out


class _Pointwise(_Leaf):
    """Elementwise (or per-channel) layer: output row i reads input row i only."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def out_size(self, in_size: int) -> int:
        return in_size

    def in_range(self, out_lo: int, out_hi: int, in_size: int) -> tuple[int, int]:
        return max(out_lo, 0), min(out_hi, in_size)

    def run(self, x, x_lo, out_lo, out_hi, in_size):
        rows = x.narrow(ROW_DIM, out_lo - x_lo, out_hi - out_lo)
        if getattr(self.module, "inplace", False):
            # The row block may be a view of the caller's tensor or shared with a residual branch.
            rows = rows.clone()
        return self.module(rows)


class _Window(_Leaf):
    """Sliding-window layer (conv or pool).

    ``compute(x, padding)`` runs the layer with symmetric native ``padding`` (row first). Row
    padding exists only where a block meets a true border: a block at the top border gets it
    natively (and drops the extra rows that native bottom padding adds); a block that needs
    bottom-only padding gets an explicit ``F.pad`` copy. Interior blocks are never padded or copied.
    Non-row padding is native when symmetric, else explicit (``col_pad``, F.pad order).
    """

    def __init__(self, module: nn.Module, compute: Callable[[Tensor, tuple[int, ...]], Tensor], kernel: int,
                 stride: int, row_pad: tuple[int, int], col_pads: list[tuple[int, int]], pad_value: float) -> None:
        self.module, self.compute = module, compute
        self.kernel, self.stride = kernel, stride
        self.pad_top, self.pad_bottom = row_pad
        symmetric = all(before == after for before, after in col_pads)
        self.native_col = tuple(before if symmetric else 0 for before, _ in col_pads)
        self.col_pad = tuple(0 if symmetric else p for pair in reversed(col_pads) for p in pair)
        self.pad_value = pad_value

    def out_size(self, in_size: int) -> int:
        return (in_size + self.pad_top + self.pad_bottom - self.kernel) // self.stride + 1

    def _window(self, out_lo: int, out_hi: int) -> tuple[int, int]:
        lo = out_lo * self.stride - self.pad_top
        return lo, (out_hi - 1) * self.stride - self.pad_top + self.kernel

    def in_range(self, out_lo: int, out_hi: int, in_size: int) -> tuple[int, int]:
        lo, hi = self._window(out_lo, out_hi)
        return max(lo, 0), min(hi, in_size)

    def run(self, x, x_lo, out_lo, out_hi, in_size):
        lo, hi = self._window(out_lo, out_hi)
        read_lo, read_hi = max(lo, 0), min(hi, in_size)
        rows = x.narrow(ROW_DIM, read_lo - x_lo, read_hi - read_lo)
        top, bottom = read_lo - lo, hi - read_hi
        native_row = top
        if bottom not in (0, top) or any(self.col_pad):
            rows = F.pad(rows, self.col_pad + (top, bottom), value=self.pad_value)
            native_row = 0
        return self.compute(rows, (native_row, *self.native_col)).narrow(ROW_DIM, 0, out_hi - out_lo)


class _Chain(_RowOp):
    """Layers applied one after another (nn.Sequential)."""

    def __init__(self, ops: list[_RowOp]) -> None:
        self.ops = ops

    def _sizes(self, in_size: int) -> list[int]:
        sizes = [in_size]
        for op in self.ops:
            sizes.append(op.out_size(sizes[-1]))
        return sizes

    def out_size(self, in_size: int) -> int:
        return self._sizes(in_size)[-1]

    def _ranges(self, out_lo: int, out_hi: int, sizes: list[int]) -> list[tuple[int, int]]:
        """Output row range of every op (last op: the requested range), derived back to front."""
        ranges = [(out_lo, out_hi)]
        for op, size in zip(reversed(self.ops[1:]), reversed(sizes[1:-1])):
            ranges.append(op.in_range(*ranges[-1], size))
        return ranges[::-1]

    def in_range(self, out_lo, out_hi, in_size):
        if not self.ops:
            return max(out_lo, 0), min(out_hi, in_size)
        sizes = self._sizes(in_size)
        return self.ops[0].in_range(*self._ranges(out_lo, out_hi, sizes)[0], in_size)

    def needed_hi(self, out_hi, in_size):
        sizes = self._sizes(in_size)
        for op, size in zip(reversed(self.ops), reversed(sizes[:-1])):
            out_hi = op.needed_hi(out_hi, size)
        return out_hi

    def run(self, x, x_lo, out_lo, out_hi, in_size):
        sizes = self._sizes(in_size)
        for op, size, (lo, hi) in zip(self.ops, sizes, self._ranges(out_lo, out_hi, sizes)):
            x, x_lo = op.run(x, x_lo, lo, hi, size), lo
        return x.narrow(ROW_DIM, out_lo - x_lo, out_hi - out_lo)

    def collect_grad_slots(self, input_needs_grad, slots):
        for op in self.ops:
            input_needs_grad = op.collect_grad_slots(input_needs_grad, slots)
        return input_needs_grad

    def step(self, chunk, chunk_lo, out_lo, out_hi, in_size, state_in, state_out):
        sizes = self._sizes(in_size)
        his = [out_hi]
        los = [out_lo]
        for op, size in zip(reversed(self.ops[1:]), reversed(sizes[1:-1])):
            his.append(op.needed_hi(his[-1], size))
            los.append(op.needed_hi(los[-1], size))
        for op, size, lo, hi in zip(self.ops, sizes, reversed(los), reversed(his)):
            chunk = op.step(chunk, chunk_lo, lo, hi, size, state_in, state_out)
            chunk_lo = lo
        return chunk


class _ResidualOp(_RowOp):
    def __init__(self, body: _RowOp, shortcut: _RowOp, where: str) -> None:
        self.body, self.shortcut, self.where = body, shortcut, where

    def out_size(self, in_size: int) -> int:
        body, shortcut = self.body.out_size(in_size), self.shortcut.out_size(in_size)
        if body != shortcut:
            raise ValueError(
                f"Residual at index {self.where}: body gives {body} rows but shortcut gives "
                f"{shortcut} for an input of {in_size} rows; both branches must keep the same height"
            )
        return body

    def in_range(self, out_lo, out_hi, in_size):
        body = self.body.in_range(out_lo, out_hi, in_size)
        shortcut = self.shortcut.in_range(out_lo, out_hi, in_size)
        return min(body[0], shortcut[0]), max(body[1], shortcut[1])

    def needed_hi(self, out_hi, in_size):
        return max(self.body.needed_hi(out_hi, in_size), self.shortcut.needed_hi(out_hi, in_size))

    def collect_grad_slots(self, input_needs_grad, slots):
        body = self.body.collect_grad_slots(input_needs_grad, slots)
        return self.shortcut.collect_grad_slots(input_needs_grad, slots) or body

    def run(self, x, x_lo, out_lo, out_hi, in_size):
        return (self.body.run(x, x_lo, out_lo, out_hi, in_size)
                + self.shortcut.run(x, x_lo, out_lo, out_hi, in_size))

    def step(self, chunk, chunk_lo, out_lo, out_hi, in_size, state_in, state_out):
        body = self.body.step(chunk, chunk_lo, out_lo, out_hi, in_size, state_in, state_out)
        shortcut = self.shortcut.step(chunk, chunk_lo, out_lo, out_hi, in_size, state_in, state_out)
        return None if body is None else body + shortcut


# ----------------------------------------------------------------------------------------------
# Wrap-time validation: module -> row op.
# ----------------------------------------------------------------------------------------------


def _tuple(value: int | Sequence[int], n: int) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, Sequence) else (value,) * n


def _conv_pads(conv: nn.Conv1d | nn.Conv2d) -> list[tuple[int, int]]:
    """(before, after) zero padding per spatial dim, resolving 'same'/'valid' like PyTorch."""
    if conv.padding == "valid":
        return [(0, 0)] * len(conv.kernel_size)
    if conv.padding == "same":
        totals = [d * (k - 1) for d, k in zip(conv.dilation, conv.kernel_size)]
        return [(t // 2, t - t // 2) for t in totals]
    return [(p, p) for p in conv.padding]


def _window_op(module: nn.Module, compute: Callable[[Tensor, tuple[int, ...]], Tensor], kernel: tuple[int, ...], stride: tuple[int, ...],
               dilation: tuple[int, ...], pads: list[tuple[int, int]], pad_value: float,
               name: str) -> _Window:
    effective = dilation[0] * (kernel[0] - 1) + 1
    if max(pads[0]) >= effective:
        raise ValueError(
            f"{name}: row padding {pads[0]} is not smaller than the kernel's extent {effective}; "
            "RowCentric needs every output row to read at least one real input row"
        )
    return _Window(module, compute, effective, stride[0], pads[0], pads[1:], pad_value)


def _conv_op(conv: nn.Conv1d | nn.Conv2d, name: str) -> _Window:
    if conv.padding_mode != "zeros":
        raise ValueError(f"{name} uses padding_mode={conv.padding_mode!r}; RowCentric supports 'zeros' only")
    conv_fn = F.conv1d if isinstance(conv, nn.Conv1d) else F.conv2d

    def compute(x: Tensor, padding: tuple[int, ...]) -> Tensor:
        return conv_fn(x, conv.weight, conv.bias, conv.stride, padding, conv.dilation, conv.groups)

    return _window_op(conv, compute, conv.kernel_size, conv.stride, conv.dilation, _conv_pads(conv), 0.0, name)


def _pool_op(pool: nn.Module, name: str) -> _Window:
    n = 1 if isinstance(pool, (nn.MaxPool1d, nn.AvgPool1d)) else 2
    if pool.ceil_mode:
        raise ValueError(f"{name} uses ceil_mode=True; RowCentric supports ceil_mode=False only")
    kernel = _tuple(pool.kernel_size, n)
    stride = _tuple(pool.stride if pool.stride is not None else pool.kernel_size, n)
    pads = [(p, p) for p in _tuple(pool.padding, n)]
    if isinstance(pool, (nn.MaxPool1d, nn.MaxPool2d)):
        if pool.return_indices:
            raise ValueError(f"{name} uses return_indices=True; RowCentric needs a single tensor output")
        dilation = _tuple(pool.dilation, n)
        max_pool = F.max_pool1d if n == 1 else F.max_pool2d

        def compute(x: Tensor, padding: tuple[int, ...]) -> Tensor:
            return max_pool(x, kernel, stride, padding, dilation)

        return _window_op(pool, compute, kernel, stride, dilation, pads, float("-inf"), name)
    if not pool.count_include_pad and any(p for pad in pads for p in pad):
        raise ValueError(
            f"{name} uses padding with count_include_pad=False; its divisor depends on the "
            "position, which RowCentric does not reproduce. Use count_include_pad=True or padding=0"
        )
    if n == 1:
        def compute(x: Tensor, padding: tuple[int, ...]) -> Tensor:
            return F.avg_pool1d(x, kernel, stride, padding)
    else:
        def compute(x: Tensor, padding: tuple[int, ...]) -> Tensor:
            return F.avg_pool2d(x, kernel, stride, padding, divisor_override=pool.divisor_override)

    return _window_op(pool, compute, kernel, stride, (1,) * n, pads, 0.0, name)


def _check_batch_norm(bn: nn.Module, name: str) -> None:
    if bn.training or not bn.track_running_stats:
        raise ValueError(
            f"{name} is in training mode; RowCentric needs eval-mode or frozen BatchNorm "
            "(its batch statistics span all rows)"
        )


class _Builder:
    """Walks a module tree, validates every layer and numbers the 2PS state slots."""

    def __init__(self) -> None:
        self.spatial_dims: set[int] = set()
        self.batch_norms: list[tuple[str, nn.Module]] = []
        self.slots = 0

    def leaf(self, op: _Leaf) -> _Leaf:
        op.slot = self.slots
        self.slots += 1
        return op

    def chain(self, modules: Iterable[tuple[str, nn.Module]]) -> _Chain:
        return _Chain([self.build(module, where) for where, module in modules])

    def build(self, module: nn.Module, where: str) -> _RowOp:
        name = f"{type(module).__name__} at index {where}"
        if isinstance(module, nn.Sequential):
            ops = self.chain((f"{where}.{i}", m) for i, m in enumerate(module))
            return ops if ops.ops else self.leaf(_Pointwise(nn.Identity()))
        if isinstance(module, Residual):
            body = self.build(module.body, f"{where}.body")
            shortcut = self.build(module.shortcut, f"{where}.shortcut")
            return _ResidualOp(body, shortcut, where)
        if isinstance(module, (nn.Conv1d, nn.Conv2d)):
            self.spatial_dims.add(len(module.kernel_size))
            return self.leaf(_conv_op(module, name))
        if isinstance(module, (nn.MaxPool1d, nn.MaxPool2d, nn.AvgPool1d, nn.AvgPool2d)):
            self.spatial_dims.add(1 if isinstance(module, (nn.MaxPool1d, nn.AvgPool1d)) else 2)
            return self.leaf(_pool_op(module, name))
        if isinstance(module, _BATCH_NORMS):
            _check_batch_norm(module, name)
            self.batch_norms.append((name, module))
            return self.leaf(_Pointwise(module))
        if isinstance(module, _POINTWISE):
            return self.leaf(_Pointwise(module))
        raise TypeError(f"{name} is not row-separable; RowCentric supports {_SUPPORTED}")


# ----------------------------------------------------------------------------------------------
# Execution: one autograd Function per segment (the whole stack, or one -H group).
# ----------------------------------------------------------------------------------------------


def row_bounds(out_size: int, rows: int) -> list[int]:
    """Even split of ``out_size`` output rows into ``min(rows, out_size)`` blocks: block edges."""
    rows = min(rows, out_size)
    return [i * out_size // rows for i in range(rows + 1)]


class _Segment:
    """A run of layers partitioned into row blocks, with its forward/backward granularities."""

    def __init__(self, op: _RowOp, slots: int, params: list[nn.Parameter], mode: str,
                 forward_rows: int, backward_rows: int) -> None:
        self.op, self.slots, self.params = op, slots, params
        self.mode, self.forward_rows, self.backward_rows = mode, forward_rows, backward_rows

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
                        x_needs_grad: bool) -> _RecomputedBlock:
        """Re-run backward block ``index`` with grad enabled on detached inputs (leaves)."""
        size = x.shape[ROW_DIM]
        lo, hi = edges[index], edges[index + 1]
        with torch.enable_grad():
            if self.mode == "overlap":
                x_lo, x_hi = self.op.in_range(lo, hi, size)
                x_block = x.narrow(ROW_DIM, x_lo, x_hi - x_lo).detach().requires_grad_(x_needs_grad)
                return _RecomputedBlock(self.op.run(x_block, x_lo, lo, hi, size), x_block, x_lo, [], [])
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
            return _RecomputedBlock(out, x_block, x_lo, state_in, state_out)

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
class _RecomputedBlock:
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
    def forward(ctx, segment: _Segment, x: Tensor, *params: Tensor) -> Tensor:
        out, saved = segment.run_forward(x)
        ctx.segment = segment
        ctx.save_for_backward(x, *saved)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        segment: _Segment = ctx.segment
        x, *saved = ctx.saved_tensors
        grad_x, grad_params = segment.run_backward(x, saved, grad_out, ctx.needs_input_grad[1])
        trainable = iter(grad_params)
        params = [next(trainable) if p.requires_grad else None for p in segment.params]
        return (None, grad_x, *params)


# ----------------------------------------------------------------------------------------------
# Public module.
# ----------------------------------------------------------------------------------------------


def _check_rows(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r}; expected an integer >= 1")
    return value


_WINDOWED = (nn.Conv1d, nn.Conv2d, nn.MaxPool1d, nn.MaxPool2d, nn.AvgPool1d, nn.AvgPool2d)


def _count_windows(module: nn.Module) -> int:
    return sum(isinstance(m, _WINDOWED) for m in module.modules())


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
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}; expected one of {', '.join(map(repr, MODES))}")
        self.mode = mode
        self.forward_rows = _check_rows("rows", rows)
        self.backward_rows = _check_rows("backward_rows", rows if backward_rows is None else backward_rows)
        if not isinstance(stack, nn.Sequential):
            if not isinstance(stack, Sequence) or not all(isinstance(m, nn.Module) for m in stack):
                raise TypeError(f"stack={type(stack).__name__}; expected nn.Sequential or a list of nn.Module")
            stack = nn.Sequential(*stack)
        self.stack = stack

        units = [(str(i), m) for i, m in enumerate(stack)]
        windows = [_count_windows(m) for _, m in units]
        units_with_windows = max(sum(1 for w in windows if w), 1)
        if checkpoint_groups is None:
            checkpoint_groups = 1
        elif (isinstance(checkpoint_groups, bool) or not isinstance(checkpoint_groups, int)
              or not 1 <= checkpoint_groups <= units_with_windows):
            raise ValueError(
                f"checkpoint_groups={checkpoint_groups!r}; expected None or an integer between 1 and "
                f"{units_with_windows} (the number of top-level layers with a conv or pool)"
            )
        self.checkpoint_groups = checkpoint_groups

        self._segments: list[_Segment] = []
        spatial_dims: set[int] = set()
        self._batch_norms: list[tuple[str, nn.Module]] = []
        for group in _group_units(units, windows, checkpoint_groups):
            builder = _Builder()
            op = builder.chain(group)
            params = list({id(p): p for _, m in group for p in m.parameters()}.values())
            self._segments.append(_Segment(op, builder.slots, params, mode, self.forward_rows, self.backward_rows))
            spatial_dims |= builder.spatial_dims
            self._batch_norms += builder.batch_norms
        if len(spatial_dims) > 1:
            raise ValueError("stack mixes 1-d and 2-d convolutions/pools; RowCentric needs one kind")
        self.spatial_dims = spatial_dims.pop() if spatial_dims else None

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
            _check_batch_norm(bn, name)
        for segment in self._segments:
            x = _RowSegmentFunction.apply(segment, x, *segment.params)
        return x

    def extra_repr(self) -> str:
        return (f"mode={self.mode!r}, rows={self.forward_rows}, backward_rows={self.backward_rows}, "
                f"checkpoint_groups={self.checkpoint_groups}")

    @staticmethod
    def plan(stack: nn.Sequential | Sequence[nn.Module], input_shape: Sequence[int], *,
             budget_bytes: int | None = None, rows: int | None = None, mode: str = "overlap",
             checkpoint_groups: int | None = None, dtype: torch.dtype = torch.float32) -> RowPlan:
        """Choose forward/backward row counts for a memory budget (or report a given ``rows``).

        See :func:`lightning_act.nn._row_plan.plan_rows`.
        """
        from lightning_act.nn._row_plan import plan_rows

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
        _Builder().build(module, where)
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
    _check_rows("min_windows", min_windows)
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
            if sum(_count_windows(items[i][1]) for i in run) >= min_windows:
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
