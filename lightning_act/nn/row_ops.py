"""Row ops for RowCentric: the row geometry and row-block execution of each supported layer.

:class:`RowOpBuilder` validates a module tree and turns it into a tree of :class:`RowOp`: one leaf
per layer (pointwise or sliding window), a chain per ``nn.Sequential``, a residual op per
:class:`Residual`. Leaves run a row block given the input rows it needs (OverL) or stream new rows
through a kept input tail (2PS); the executor (``row_executor``) decides which blocks to run.

Row geometry convention: every op maps an output row range ``[out_lo, out_hi)`` to the input rows
it reads, clipped to the real input; rows outside the input are the layer's own zero (or -inf)
padding and are synthesised only at the true borders.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

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
_WINDOWED = (nn.Conv1d, nn.Conv2d, nn.MaxPool1d, nn.MaxPool2d, nn.AvgPool1d, nn.AvgPool2d)


# Defined beside the builder that recognises it (row_centric re-exports it), so that no module
# imports back from row_centric.
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


class RowOp:
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


class _Leaf(RowOp):
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


class _Chain(RowOp):
    """Layers applied one after another (nn.Sequential)."""

    def __init__(self, ops: list[RowOp]) -> None:
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


class _ResidualOp(RowOp):
    def __init__(self, body: RowOp, shortcut: RowOp, where: str) -> None:
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


def count_windows(module: nn.Module) -> int:
    """Number of conv and pool layers in ``module`` (itself included)."""
    return sum(isinstance(m, _WINDOWED) for m in module.modules())


def check_batch_norm(bn: nn.Module, name: str) -> None:
    """Raise unless ``bn`` normalises with running statistics (batch statistics span all rows)."""
    if bn.training or not bn.track_running_stats:
        raise ValueError(
            f"{name} is in training mode; RowCentric needs eval-mode or frozen BatchNorm "
            "(its batch statistics span all rows)"
        )


class RowOpBuilder:
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

    def build(self, module: nn.Module, where: str) -> RowOp:
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
            check_batch_norm(module, name)
            self.batch_norms.append((name, module))
            return self.leaf(_Pointwise(module))
        if isinstance(module, _POINTWISE):
            return self.leaf(_Pointwise(module))
        raise TypeError(f"{name} is not row-separable; RowCentric supports {_SUPPORTED}")


