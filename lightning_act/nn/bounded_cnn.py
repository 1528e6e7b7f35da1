"""Conv2d -> BatchNorm2d (-> ReLU) runs and ResNet's residual add + ReLU, with backwards that hold about two
full tensors (issue #17 item 1: bounded backward transients).

Autograd runs such a run's backward as three nodes: ReLU's (incoming gradient, its output or decoded mask,
outgoing gradient), BatchNorm's (incoming gradient, the decoded input, its input gradient and, on CPU, a
workspace of the same size) and the convolution's (incoming gradient, the decoded input, input gradient and,
with mkldnn's NCHW path, two more buffers). Under an ``ActivationCompressor`` each decoded tensor is whole.

Here one autograd Function computes the run's forward with the modules' own parameters and buffers (the
convolution module itself, so autocast casts as it would; ``native_batch_norm`` with ``nn.BatchNorm2d``'s
momentum and running-statistics rules) and saves, per batch chunk, the convolution's input (in the dtype the
convolution ran in), BatchNorm's input (each chunk compressed on its own by the compressor, in memory order so
the codec sees the same element order as the whole tensor) and ReLU's output sign bit-packed (1 bit, exact, as
the compressor's mask codec keeps it). Its backward walks the chunks twice: per-channel sums of ``g`` and
``g * xhat`` (``g`` masked by the sign), then per chunk BatchNorm's input gradient and the convolution's
(``aten::convolution_backward`` on the chunk: input gradient written into one tensor, weight and bias
gradients accumulated in float32 or wider). It holds the incoming and the outgoing gradient plus chunk-sized
pieces; BatchNorm's input is decoded twice. In eval mode (running statistics) one pass suffices.

Residual blocks (:meth:`ResidualReLU.residual`): autograd sums a block input's gradient from its two readers
(the body's first run and the shortcut) in a buffer, so the first one waits there, whole, while the second is
built. Here the body's first run, the last reader in backward, also returns the block input as an identity
output that the shortcut reads: its backward adds its input gradient chunk by chunk into the shortcut's (the
merge's gradient, or the projection run's input gradient). Those gradients are this module's own, read by
nothing else by then, so the sum happens in place. The merge ``relu(a + b)`` adds into ``a`` when ``a`` is a run's
fresh output, saves the sign bit-packed per chunk, and its backward holds two tensors.

A run whose batch fits one chunk keeps its modules (one fused chunk would hold more than the unfused nodes do).
The gradients are the unfused ones up to the order of the sums. BatchNorm's module hooks do not run (the
convolution's do); ``padding_mode`` other than ``'zeros'`` and string paddings are left unfused.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from ..formats._bitpack import pack_bits, unpack_bits
from .. import module_tree
from ._chunks import DEFAULT_CHUNK_BYTES, SavedEntries, chunk_rows, row_bounds

__all__ = ["BoundedSequential", "ResidualReLU", "conv_bn_act", "convert_bounded_cnn", "is_bounded",
           "unconvert_bounded_cnn"]

_DIMS = (0, 2, 3)  # BatchNorm2d's reduction dims


def _channels_last(t: torch.Tensor) -> bool:
    return not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)


def _memory_order(chunk: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """``chunk`` as a contiguous view in memory order (NHWC for channels_last) for saving."""
    if channels_last:
        return chunk.permute(0, 2, 3, 1)
    return chunk if chunk.is_contiguous() else chunk.contiguous()


def _logical(t: torch.Tensor, channels_last: bool) -> torch.Tensor:
    return t.permute(0, 3, 1, 2) if channels_last else t


def _signs(out: torch.Tensor, rows: int, channels_last: bool) -> list[torch.Tensor]:
    return [pack_bits(_memory_order(c, channels_last).reshape(-1) > 0) for c in out.split(rows)]


def _sign(saved: SavedEntries, index: int, shape: torch.Size, channels_last: bool) -> torch.Tensor:
    stored = (shape[0], shape[2], shape[3], shape[1]) if channels_last else shape
    return _logical(unpack_bits(saved[index], math.prod(shape)).view(stored), channels_last)


def _wide(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float32 for 16-bit floats (as BatchNorm's CPU backward), else the dtype itself."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _bn_factor(bn: nn.BatchNorm2d) -> float:
    """``nn.BatchNorm2d.forward``'s running-average factor (counting the batch as it does)."""
    factor = 0.0 if bn.momentum is None else bn.momentum
    if bn.training and bn.track_running_stats and bn.num_batches_tracked is not None:
        bn.num_batches_tracked.add_(1)
        factor = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum
    return factor


def _channel(v: torch.Tensor) -> torch.Tensor:
    return v.view(1, -1, 1, 1)


# Gradients this module's nodes created and handed only to its own nodes, which a fork's identity output
# receives once their other readers are done (the graph ResidualReLU.residual builds): it may add into them.
_OWNED = WeakIdKeyDictionary()


class _Fork(torch.autograd.Function):
    """A Conv2d -> BatchNorm2d (-> ReLU) run and, with ``identity``, its input as a second output (a residual
    shortcut): the backward adds the run's input gradient chunk by chunk into that output's gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias, gamma, beta, conv, bn, relu, identity, rows):
        z = conv(x)  # the module: autocast casts x and the weight as in the unfused model
        batch_stats = bn.training or (bn.running_mean is None and bn.running_var is None)
        keep_running = not bn.training or bn.track_running_stats
        out, mean, invstd = torch.native_batch_norm(
            z, gamma, beta, bn.running_mean if keep_running else None, bn.running_var if keep_running else None,
            batch_stats, _bn_factor(bn), bn.eps)
        if relu:
            out.relu_()
        wide = _wide(z.dtype)
        if not batch_stats:  # normalised by the running statistics: those of this step are the ones to keep
            mean = bn.running_mean.to(wide, copy=True)
            invstd = (bn.running_var.to(wide) + bn.eps).rsqrt()
        ctx.mean, ctx.invstd, ctx.batch_stats = _channel(mean.to(wide)), _channel(invstd.to(wide)), batch_stats
        ctx.conv, ctx.relu, ctx.identity, ctx.x_meta = conv, relu, identity, (x.shape, x.dtype, _channels_last(x))
        xc = x.to(z.dtype)  # what the convolution read (autocast's copy), saved for its weight gradient
        ctx.bounds, ctx.z_cl, ctx.xc_cl = row_bounds(z.shape[0], rows), _channels_last(z), _channels_last(xc)
        ctx.z_shape, ctx.conv_dtype, ctx.out_cl = z.shape, z.dtype, _channels_last(out)
        ctx.bn_dtype = (gamma if gamma is not None else beta if beta is not None else z).dtype
        ctx.saves_x = bool(ctx.needs_input_grad[1])
        saved = [weight, gamma]
        saved += [_memory_order(c, ctx.xc_cl) for c in xc.split(rows)] if ctx.saves_x else []
        # BN's input and the signs once per backward pass: each saved entry is unpacked once (torch.utils.checkpoint
        # allows no more); the compressor stores the second entry as a duplicate of the first
        passes = []
        for _ in range(2 if batch_stats else 1):
            passes.append((len(saved), len(saved) + len(ctx.bounds)))
            saved += [_memory_order(c, ctx.z_cl) for c in z.split(rows)]
            saved += _signs(out, rows, ctx.out_cl) if relu else []
        ctx.passes = passes
        ctx.save_for_backward(*saved)
        return (out, x.view_as(x)) if identity else out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, shortcut=None):
        need_x, need_w, need_b, need_gamma, need_beta = ctx.needs_input_grad[:5]
        bounds, conv, x_at = ctx.bounds, ctx.conv, 2
        x_shape, x_dtype, x_cl = ctx.x_meta
        saved = SavedEntries(ctx)
        weight, gamma = saved[0], saved[1]
        wide = ctx.mean.dtype
        scale = ctx.invstd if gamma is None else ctx.invstd * _channel(gamma.to(wide))
        count = ctx.z_shape[0] * ctx.z_shape[2] * ctx.z_shape[3]

        def chunk(i, saved_pass):
            """The masked incoming gradient and ``xhat`` of chunk ``i``, in the accumulation dtype."""
            start, stop = bounds[i]
            z_at, sign_at = ctx.passes[saved_pass]
            g = grad_out[start:stop]
            if ctx.relu:
                g = torch.where(_sign(saved, sign_at + i, g.shape, ctx.out_cl), g, 0)
            z = _logical(saved[z_at + i], ctx.z_cl)
            return g.to(wide), (z.to(wide) - ctx.mean).mul_(ctx.invstd)

        if not need_x:
            grad_x = None
        elif shortcut is not None and shortcut in _OWNED and shortcut.dtype == x_dtype:
            grad_x = shortcut  # this module's gradient, its other readers done: the sum accumulates in place
        elif shortcut is not None:
            grad_x = shortcut.to(x_dtype, copy=True)
        else:
            grad_x = torch.empty(x_shape, dtype=x_dtype, device=grad_out.device,
                                 memory_format=torch.channels_last if x_cl else torch.contiguous_format).zero_()
            _OWNED[grad_x] = True  # its one reader: the body's first fork may add into it
        sum_g = torch.zeros(ctx.z_shape[1], dtype=wide, device=grad_out.device)
        sum_gxhat = torch.zeros_like(sum_g)

        def accumulate(g, xhat):
            sum_g.add_(g.sum(_DIMS))
            sum_gxhat.add_((g * xhat).sum(_DIMS))

        acc = _wide(weight.dtype)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_b else None
        with torch.autocast(grad_out.device.type, enabled=False):
            if ctx.batch_stats:  # the input gradient needs the whole batch's sums first
                for i in range(len(bounds)):
                    accumulate(*chunk(i, 0))
            w = weight.to(ctx.conv_dtype)
            for i, (start, stop) in enumerate(bounds):
                g, xhat = chunk(i, len(ctx.passes) - 1)
                if ctx.batch_stats:  # in place on xhat (this backward's own chunk; g may be grad_out's view)
                    gz = xhat.mul_(_channel(-sum_gxhat / count)).add_(g).sub_(_channel(sum_g / count)).mul_(scale)
                else:
                    accumulate(g, xhat)
                    gz = g * scale
                del g, xhat  # freed before the convolution's chunk
                if not (need_x or need_w or need_b):
                    continue
                gz = gz.to(ctx.conv_dtype)
                if ctx.saves_x:
                    xi = _logical(saved[x_at + i], ctx.xc_cl)
                else:  # the input gradient needs only the input's shape
                    xi = gz.new_empty(1).expand(stop - start, *x_shape[1:])
                gxi, gwi, gbi = torch.ops.aten.convolution_backward(
                    gz, xi, w, [w.shape[0]] if need_b else None, conv.stride, conv.padding, conv.dilation, False,
                    [0] * len(conv.padding), conv.groups, [need_x, need_w, need_b])
                if need_x:
                    grad_x[start:stop].add_(gxi)
                if need_w:
                    grad_w.add_(gwi)
                if need_b:
                    grad_b.add_(gbi)
        cast = lambda t, dtype: None if t is None else t.to(dtype)  # noqa: E731
        return (grad_x, cast(grad_w, weight.dtype), cast(grad_b, weight.dtype),
                cast(sum_gxhat if need_gamma else None, ctx.bn_dtype), cast(sum_g if need_beta else None, ctx.bn_dtype),
                None, None, None, None, None)


def _rows_per_chunk(x: torch.Tensor, conv: nn.Conv2d, chunk_bytes: int | str) -> int:
    """Batch rows per chunk of the run on ``x``: rows of the convolution's input and output in the dtype the
    convolution runs in (autocast's lower precision for a float32, float16 or bfloat16 input), as saved."""
    device = x.device.type
    dtype = x.dtype
    if torch.is_autocast_enabled(device) and x.is_floating_point() and dtype != torch.float64:
        dtype = torch.get_autocast_dtype(device)
    spatial = [(size + 2 * pad - dilation * (kernel - 1) - 1) // stride + 1 for size, pad, dilation, kernel, stride
               in zip(x.shape[2:], conv.padding, conv.dilation, conv.kernel_size, conv.stride)]
    row = max(conv.out_channels * math.prod(spatial), math.prod(x.shape[1:]), 1)
    return chunk_rows(chunk_bytes, row * dtype.itemsize, x.shape[0], x.device)


def _fork(x: torch.Tensor, conv: nn.Conv2d, bn: nn.BatchNorm2d, relu: bool, identity: bool,
          chunk_bytes: int | str):
    """The run's output on ``x`` and, with ``identity``, ``x`` itself. Without autograd (no gradient wanted), or
    when the batch fits one chunk (the fused backward would then hold the whole masked gradient, BatchNorm's
    decoded input, its normalised copy and the convolution's gradients at once: more than the unfused nodes, one
    after the other), the modules run as they are."""
    params = (conv.weight, conv.bias, bn.weight, bn.bias)
    if torch.is_grad_enabled() and (x.requires_grad or any(p is not None and p.requires_grad for p in params)):
        rows = _rows_per_chunk(x, conv, chunk_bytes)
        if x.shape[0] > rows:
            return _Fork.apply(x, *params, conv, bn, relu, identity, rows)
    out = bn(conv(x))
    out = torch.relu(out) if relu else out
    return (out, x) if identity else out


def conv_bn_act(x: torch.Tensor, conv: nn.Conv2d, bn: nn.BatchNorm2d, relu: bool,
                chunk_bytes: int | str = DEFAULT_CHUNK_BYTES) -> torch.Tensor:
    """``relu(bn(conv(x)))`` (without ``relu`` if False) with the bounded backward of the module docstring; row
    chunks of about ``chunk_bytes``. Without autograd (no gradient wanted) the modules run as they are."""
    return _fork(x, conv, bn, relu, False, chunk_bytes)


class _AddReLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, chunk_bytes, into_a):
        if into_a:  # a is a fork's fresh output read by nothing else: the sum needs no third tensor
            ctx.mark_dirty(a)
            out = a.add_(b).relu_()
        else:
            out = torch.add(a, b).relu_()
        rows = chunk_rows(chunk_bytes, max(out[0].numel() * out.element_size(), 1), out.shape[0], out.device)
        ctx.bounds, ctx.cl, ctx.dtypes = row_bounds(out.shape[0], rows), _channels_last(out), (a.dtype, b.dtype)
        ctx.save_for_backward(*_signs(out, rows, ctx.cl))
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        grad, saved = torch.empty_like(grad_out), SavedEntries(ctx)
        for i, (start, stop) in enumerate(ctx.bounds):
            g = grad_out[start:stop]
            grad[start:stop] = torch.where(_sign(saved, i, g.shape, ctx.cl), g, 0)
        _OWNED[grad] = True
        # one tensor for both summands, as AddBackward hands out
        return grad.to(ctx.dtypes[0]), grad.to(ctx.dtypes[1]), None, None


class ResidualReLU(nn.Module):
    """``relu(a + b)``, a residual block's merge (``lightning_act.models``' bottleneck), and :meth:`residual`, the
    block around it. With ``bounded`` set (by :func:`convert_bounded_cnn`), the merge's backward holds the
    incoming and the outgoing gradient plus a chunk instead of also the whole decoded output, and the block's
    first run and shortcut form one node whose backward builds the block's input gradient once; ``chunk_bytes``
    as :func:`conv_bn_act`'s."""

    bounded = False
    chunk_bytes: int | str = DEFAULT_CHUNK_BYTES

    def forward(self, a: torch.Tensor, b: torch.Tensor, _into_a: bool = False) -> torch.Tensor:
        if self.bounded and a.dim() == 4 and torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
            into_a = _into_a and a.shape == b.shape and a.dtype == torch.result_type(a, b)
            return _AddReLU.apply(a, b, self.chunk_bytes, into_a)
        return torch.relu(a + b)

    def residual(self, x: torch.Tensor, body: nn.Module, shortcut: nn.Module) -> torch.Tensor:
        """``self(body(x), shortcut(x))``. Bounded, with a ``body`` Sequential opening with a Conv2d -> BatchNorm2d
        (-> ReLU) run and an ``nn.Identity`` or Conv2d -> BatchNorm2d ``shortcut``, the block's input gradient
        is built once (module docstring)."""
        modules = list(body._modules.values()) if isinstance(body, nn.Sequential) else []
        projection = isinstance(shortcut, nn.Sequential) and len(shortcut) == 2 and _fusable(*shortcut)
        if (not self.bounded or not (projection or isinstance(shortcut, nn.Identity)) or len(modules) < 2
                or not _fusable(*modules[:2])):
            return self(body(x), shortcut(x))
        relu = len(modules) > 2 and type(modules[2]) is nn.ReLU
        # the first run's backward, the block input's last reader, adds its input gradient into the shortcut's
        h, skip = _fork(x, modules[0], modules[1], relu, True, self.chunk_bytes)
        rest = modules[3 if relu else 2:]
        # the body's output is a fork's own when its last modules are a run (read by the merge alone)
        fresh = len(rest) >= 2 and _fusable(*rest[-2:])
        h = _sequence(rest, h, self.chunk_bytes)
        if projection:  # after the body, as unconverted: the body's tensors are gone when the shortcut's exist
            skip = _fork(skip, shortcut[0], shortcut[1], False, False, self.chunk_bytes)
        return self(h, skip, fresh)


def _fusable(conv: nn.Module, bn: nn.Module) -> bool:
    return (type(conv) is nn.Conv2d and isinstance(bn, nn.BatchNorm2d) and conv.padding_mode == "zeros"
            and not isinstance(conv.padding, str) and bn.num_features == conv.out_channels)


class BoundedSequential(nn.Sequential):
    """An ``nn.Sequential`` whose Conv2d -> BatchNorm2d (-> ReLU) runs go through :func:`conv_bn_act`; the same
    children under the same names (so the same parameters and ``state_dict``). :func:`convert_bounded_cnn`
    turns ``nn.Sequential`` containers into it in place; ``chunk_bytes`` is set there."""

    chunk_bytes: int | str = DEFAULT_CHUNK_BYTES

    def forward(self, x):
        return _sequence(list(self._modules.values()), x, self.chunk_bytes)


def _sequence(modules: list[nn.Module], x: torch.Tensor, chunk_bytes: int | str) -> torch.Tensor:
    """``modules`` applied in turn, their Conv2d -> BatchNorm2d (-> ReLU) runs through :func:`conv_bn_act`."""
    i = 0
    while i < len(modules):
        if i + 1 < len(modules) and _fusable(modules[i], modules[i + 1]):
            relu = i + 2 < len(modules) and type(modules[i + 2]) is nn.ReLU
            x = conv_bn_act(x, modules[i], modules[i + 1], relu, chunk_bytes)
            i += 3 if relu else 2
        else:
            x = modules[i](x)
            i += 1
    return x


def convert_bounded_cnn(model: nn.Module, chunk_bytes: int | str = DEFAULT_CHUNK_BYTES) -> int:
    """Give ``model``'s Conv2d -> BatchNorm2d (-> ReLU) runs inside ``nn.Sequential`` containers (the model
    itself included) and its :class:`ResidualReLU` merges the bounded backward of the module docstring, in
    place: the containers become :class:`BoundedSequential` (same children, parameters and ``state_dict``), the
    merges are flagged. Returns how many runs and merges changed; :func:`unconvert_bounded_cnn` undoes it.
    ``chunk_bytes``: bytes of one batch chunk of a saved tensor (int, ``"4MiB"``, or the default ``"auto"``: 4 MiB,
    at most 8 chunks off CPU); bad values raise ``ValueError`` naming them."""
    chunk_rows(chunk_bytes, 1)
    changed = 0
    for module in module_tree.modules(model):
        if type(module) is nn.Sequential or type(module) is BoundedSequential:
            modules = list(module._modules.values())
            runs = sum(_fusable(a, b) for a, b in zip(modules, modules[1:]))
            if runs:
                module.__class__ = BoundedSequential
                module.chunk_bytes = chunk_bytes
                changed += runs
        elif isinstance(module, ResidualReLU):
            module.bounded, module.chunk_bytes = True, chunk_bytes
            changed += 1
    return changed


def is_bounded(model: nn.Module) -> bool:
    """Whether :func:`convert_bounded_cnn` changed something in ``model`` that is not undone."""
    return any(type(m) is BoundedSequential or (isinstance(m, ResidualReLU) and m.bounded)
               for m in module_tree.modules(model))


def unconvert_bounded_cnn(model: nn.Module) -> int:
    """Undo :func:`convert_bounded_cnn` on ``model``; returns how many containers and merges were restored."""
    restored = 0
    for module in module_tree.modules(model):
        if type(module) is BoundedSequential:
            module.__class__ = nn.Sequential
            del module.chunk_bytes
            restored += 1
        elif isinstance(module, ResidualReLU) and module.bounded:
            del module.bounded, module.chunk_bytes
            restored += 1
    return restored
