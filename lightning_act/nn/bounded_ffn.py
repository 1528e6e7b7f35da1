"""Linear -> elementwise activation (a transformer's first feed-forward layer: HuggingFace's ``BertIntermediate``,
or ``nn.Linear`` followed by ``nn.GELU``/``nn.ReLU``/... in an ``nn.Sequential``) with a backward that holds the
incoming and the outgoing gradient plus row chunks (issue #17 item 1: bounded backward transients).

Unfused, autograd runs the pair's backward as two nodes. The activation's (``GeluBackward0``) holds the incoming
gradient ``grad_a`` (4H wide), the decoded pre-activation ``h`` (4H wide: under an ``ActivationCompressor`` one
whole decoded tensor) and its output ``grad_h`` (4H wide); the Linear's then turns ``grad_h`` into the input
gradient. On BERT with chunked attention that node holds the step's peak.

Here one autograd Function computes ``a = act(x @ W^T + b)`` with the modules themselves (the ``nn.Linear`` module
is called, so autocast casts ``x`` and the weight as it would and the Linear's forward hooks run; then the
activation module or function) and saves, per row chunk of the flattened ``(rows, features)`` view, the Linear's
input in the dtype the Linear ran in (autocast's copy) and the pre-activation ``h``: each chunk a separate saved
tensor, so the compressor stores and decodes them one at a time. ReLU saves ``h > 0`` bit-packed instead (1 bit,
exact: the derivative needs nothing else). Its backward walks the chunks: decode ``h``'s chunk, ``grad_h =
act'(h) * grad_a[rows]`` (by autograd on the chunk: the activation re-run under the forward's autocast state, so
the derivative is PyTorch's own formula), ``grad_x[rows] = grad_h @ W``, ``grad_W += grad_h^T @ x[rows]``,
``grad_b += grad_h.sum(0)`` (accumulated in float32 for 16-bit weights, else in the weight's dtype). It holds
``grad_a``, ``grad_x`` and chunk-sized pieces (and a weight-sized partial product per chunk for 16-bit
weights); no whole 4H-wide ``h`` or ``grad_h``.

Under saved-tensor hooks (an ``ActivationCompressor``, or torch checkpointing's) the forward runs by row chunks
too: each chunk's ``h`` (and input) goes through the pack hook as soon as it is made, so the forward holds the output
and chunk-sized pieces, never a whole ``h`` beside it (the pack hooks in effect are read with
``torch._C._autograd._top_saved_tensors_default_hooks``; a torch without it runs the whole forward). Its row-blocked
matmuls may round differently from the whole one. Without hooks, or when the Linear or the activation has forward
hooks (they would run once per chunk), the forward is the unfused one bit for bit. Gradients equal the unfused ones
up to the order of the sums.
Not fused (left as they are): a Linear subclass, a Linear or activation with backward hooks (they would not
fire inside the fused node), activations with parameters or ``inplace=True`` (except ReLU), and anything that is
not a known elementwise activation (:func:`fusable_activation`). Forward hooks and forward pre-hooks of both
modules run (inside the fused node's forward); full backward hooks registered after conversion do not fire.
"""
from __future__ import annotations

import types

import torch
from torch import nn
from torch.nn import functional as F

from ..formats._bitpack import pack_bits, unpack_bits
from ._chunks import DEFAULT_CHUNK_BYTES, chunk_rows, row_bounds, unpack_saved
from .bounded_cnn import BoundedSequential, _sequence

__all__ = ["convert_bounded_ffn", "fusable_activation", "is_bounded_ffn", "linear_act", "unconvert_bounded_ffn"]

# torch's elementwise activation modules (exact types: a subclass may change forward)
_TORCH_ACTIVATIONS = (nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Mish, nn.LeakyReLU, nn.ELU, nn.CELU,
                      nn.SELU, nn.Softplus, nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.ReLU6, nn.Softsign,
                      nn.Tanhshrink, nn.LogSigmoid, nn.Hardshrink, nn.Softshrink)
_FUNCTIONS = (F.gelu, F.relu, torch.relu, F.silu, torch.tanh, torch.sigmoid, F.mish, F.tanh, F.sigmoid)
_RELU_FUNCTIONS = (F.relu, torch.relu)
_HF_ACTIVATIONS = "transformers.activations"  # every class there is elementwise; XIELU has parameters


def fusable_activation(act) -> bool:
    """Whether ``act`` is an elementwise activation the fused node takes: one of torch's activation modules
    (exact type, no ``inplace=True`` except ReLU), a class of ``transformers.activations`` without parameters,
    or ``F.gelu``/``F.relu``/``F.silu``/``torch.tanh``/``torch.sigmoid``/``F.mish``."""
    if isinstance(act, nn.Module):
        if _has_backward_hooks(act) or any(True for _ in act.parameters()):
            return False
        if getattr(act, "inplace", False) and type(act) is not nn.ReLU:
            return False
        return type(act) in _TORCH_ACTIVATIONS or type(act).__module__ == _HF_ACTIVATIONS
    return any(act is f for f in _FUNCTIONS)


def _is_relu(act) -> bool:
    return type(act) is nn.ReLU or any(act is f for f in _RELU_FUNCTIONS)


def _has_backward_hooks(module: nn.Module) -> bool:
    return bool(module._backward_hooks or module._backward_pre_hooks)


def _fusable(linear, act) -> bool:
    return type(linear) is nn.Linear and not _has_backward_hooks(linear) and fusable_activation(act)


def _wide(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of the parameter gradients: float32 for 16-bit floats, else the dtype itself."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _same(t):
    return t


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``(rows, features)``: a view when its strides allow, else a contiguous copy."""
    features = t.shape[-1]
    try:
        return t.view(-1, features)
    except RuntimeError:
        return t.reshape(-1, features)


def _forward_hooked(module) -> bool:
    """Whether calling ``module`` runs forward hooks or pre-hooks (its own or the global ones): the chunked
    forward would run them once per chunk."""
    from torch.nn.modules import module as module_globals

    return isinstance(module, nn.Module) and bool(
        module._forward_hooks or module._forward_pre_hooks or module_globals._global_forward_hooks
        or module_globals._global_forward_pre_hooks)


def _saved_tensor_hooks():
    """The ``(pack, unpack)`` pair of the innermost ``torch.autograd.graph.saved_tensors_hooks`` in effect (an
    ``ActivationCompressor``'s, for one), or None: none in effect, or a torch without the accessor."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return None if top is None else top(False)


class _LinearAct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, linear, act, chunk_bytes):
        relu = _is_relu(act)
        device = x.device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.act, ctx.relu = act, relu
        ctx.saves_x = bool(ctx.needs_input_grad[1])
        out_features = weight.shape[0]
        ctx.x_meta, ctx.features = (x.shape, x.dtype), (x.shape[-1], out_features)
        x2 = _rows(x)
        row_bytes = max(out_features, x.shape[-1], 1) * x.element_size()
        ctx.bounds = bounds = row_bounds(x2.shape[0], chunk_rows(chunk_bytes, row_bytes))
        hooks = _saved_tensor_hooks()
        if hooks is not None and bounds and not (_forward_hooked(linear) or _forward_hooked(act)):
            return _LinearAct._forward_by_chunks(ctx, x, x2, weight, linear, act, hooks)
        ctx.packed = None
        h = linear(x)  # the module: autocast casts x and the weight as unfused, its forward hooks run
        a = act(h)  # ReLU may write into h: only its signs are kept
        ctx.h_dtype = h.dtype
        h2 = _rows(a if relu else h)
        saved = [weight]
        if ctx.saves_x:
            xc = _rows(x.to(h.dtype))  # what the Linear read (autocast's copy), for the weight gradient
            saved += [xc[start:stop] for start, stop in bounds]
        if relu:
            saved += [pack_bits(h2[start:stop].reshape(-1) > 0) for start, stop in bounds]
        else:
            saved += [h2[start:stop] for start, stop in bounds]
        ctx.save_for_backward(*saved)
        return a

    @staticmethod
    def _forward_by_chunks(ctx, x, x2, weight, linear, act, hooks):
        """Under saved-tensor hooks (a compressor): the Linear and the activation run per row chunk, and each
        chunk's saved tensors go through the pack hook at once, so no whole pre-activation ``h`` exists beside the
        output. The row-blocked matmul may round differently from the whole one (the values saved are the
        compressor's approximation in any case); without hooks the forward is the unfused one bit for bit."""
        pack, ctx.unpack = hooks
        ctx.save_for_backward(weight)
        packed_x, packed_h, out = [], [], None
        for start, stop in ctx.bounds:
            xc = x2[start:stop]
            h = linear(xc)
            a = act(h)  # ReLU may write into h: only its signs are kept
            if out is None:
                out = a.new_empty(x2.shape[0], a.shape[-1])
                ctx.h_dtype = h.dtype
            out[start:stop] = a
            if ctx.saves_x:
                packed_x.append(pack(xc.to(h.dtype)))  # what the Linear read (autocast's copy)
            packed_h.append(pack(pack_bits(a.reshape(-1) > 0) if ctx.relu else h))
            del h, a
        ctx.packed = (packed_x, packed_h)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_a):
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        weight = unpack_saved(ctx, 0)
        bounds, dtype = ctx.bounds, ctx.h_dtype
        x_shape, x_dtype = ctx.x_meta
        in_features, out_features = ctx.features
        if ctx.packed is None:  # saved by save_for_backward: the weight, x's chunks, h's chunks
            h_at = 1 + (len(bounds) if ctx.saves_x else 0)
            x_chunk, h_chunk = (lambda i: unpack_saved(ctx, 1 + i)), (lambda i: unpack_saved(ctx, h_at + i))
        else:  # packed one chunk at a time in the forward
            packed_x, packed_h = ctx.packed
            x_chunk, h_chunk = (lambda i: ctx.unpack(packed_x[i])), (lambda i: ctx.unpack(packed_h[i]))
        g2 = _rows(grad_a)
        device = grad_a.device
        grad_x = torch.empty(x_shape, dtype=x_dtype, device=device) if need_x else None
        gx2 = _rows(grad_x) if need_x else None
        acc = _wide(weight.dtype)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(out_features, dtype=acc, device=weight.device) if need_b else None
        device_type, autocast, autocast_dtype = ctx.autocast
        with torch.autocast(device_type, enabled=False):
            w = weight.to(dtype) if need_x else None
            for i, (start, stop) in enumerate(bounds):
                ga = g2[start:stop]
                if ctx.relu:
                    mask = unpack_bits(h_chunk(i), (stop - start) * out_features)
                    gh = torch.where(mask.view(stop - start, out_features), ga, 0)
                    del mask
                else:
                    hc = h_chunk(i).detach().requires_grad_()
                    # PyTorch's own derivative: the activation re-run on the chunk as in the forward (its
                    # autocast state), differentiated by autograd; no compressor sees this graph's saved tensors
                    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_same, _same), \
                            torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast):
                        out = ctx.act(hc)
                    gh, = torch.autograd.grad(out, hc, ga)
                    del hc, out
                gh = gh.to(dtype)
                if need_x:
                    gx2[start:stop] = gh @ w
                if need_w:
                    xi = x_chunk(i)
                    if acc == dtype:
                        grad_w.addmm_(gh.t(), xi)
                    else:  # a 16-bit product per chunk, summed in float32
                        grad_w += gh.t() @ xi
                    del xi
                if need_b:
                    grad_b += gh.sum(0, dtype=acc)
                del gh, ga
        cast = lambda t: None if t is None else t.to(weight.dtype)  # noqa: E731
        return grad_x, cast(grad_w), cast(grad_b), None, None, None


def linear_act(x: torch.Tensor, linear: nn.Linear, act, chunk_bytes: int | str = DEFAULT_CHUNK_BYTES) -> torch.Tensor:
    """``act(linear(x))`` with the bounded backward of the module docstring; row chunks of about ``chunk_bytes``
    (of the wider of ``x`` and the output per row). Without autograd (no gradient wanted) the modules run as they
    are and nothing is saved."""
    params = (linear.weight, linear.bias)
    if torch.is_grad_enabled() and (x.requires_grad or any(p is not None and p.requires_grad for p in params)):
        return _LinearAct.apply(x, linear.weight, linear.bias, linear, act, chunk_bytes)
    return act(linear(x))


# ---- conversion -------------------------------------------------------------------------------------------------

def _intermediate_reference(self, hidden_states):  # BertIntermediate.forward's body (compared as bytecode)
    hidden_states = self.dense(hidden_states)
    hidden_states = self.intermediate_act_fn(hidden_states)
    return hidden_states


def _same_code(fn, reference) -> bool:
    code, ref = getattr(fn, "__code__", None), reference.__code__
    return code is not None and all(getattr(code, name) == getattr(ref, name) for name in
                                    ("co_code", "co_names", "co_varnames", "co_consts", "co_argcount"))


def _is_intermediate(module: nn.Module) -> bool:
    """A ``BertIntermediate``-shaped module: ``dense`` then ``intermediate_act_fn`` (its class's forward is that
    body, bytecode for bytecode: the copies HuggingFace makes of it for RoBERTa, ViT, ... qualify)."""
    return (_same_code(type(module).forward, _intermediate_reference)
            and _fusable(getattr(module, "dense", None), getattr(module, "intermediate_act_fn", None)))


def _intermediate_forward(self, hidden_states):
    return linear_act(hidden_states, self.dense, self.intermediate_act_fn, self._bounded_ffn_chunk_bytes)


def _sequential_forward(self, x):
    """The Sequential's modules in turn, its Linear -> activation pairs fused; a ``BoundedSequential``
    (:func:`lightning_act.nn.convert_bounded_cnn`) keeps its fused Conv-BN(-ReLU) runs in the stretches between."""
    modules = list(self._modules.values())
    conv_runs = type(self) is BoundedSequential
    chunk_bytes = self._bounded_ffn_chunk_bytes
    i = start = 0
    while i <= len(modules):
        pair = i + 1 < len(modules) and _fusable(modules[i], modules[i + 1])
        if pair or i == len(modules):
            stretch = modules[start:i]
            if conv_runs and stretch:
                x = _sequence(stretch, x, self.chunk_bytes)
            else:
                for module in stretch:
                    x = module(x)
            if not pair:
                break
            x = linear_act(x, modules[i], modules[i + 1], chunk_bytes)
            i = start = i + 2
        else:
            i += 1
    return x


_FORWARDS = (_intermediate_forward, _sequential_forward)


def _converted(module: nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return getattr(forward, "__func__", None) in _FORWARDS and getattr(forward, "__self__", None) is module


def _pairs(module: nn.Module) -> int:
    """How many Linear -> activation pairs ``module`` would fuse (0: not a container this converts)."""
    if type(module) is nn.Sequential or type(module) is BoundedSequential:
        modules = list(module._modules.values())
        count, i = 0, 0
        while i + 1 < len(modules):
            if _fusable(modules[i], modules[i + 1]):
                count, i = count + 1, i + 2
            else:
                i += 1
        return count
    return int(_is_intermediate(module))


def convert_bounded_ffn(model: nn.Module, chunk_bytes: int | str = DEFAULT_CHUNK_BYTES) -> int:
    """Give ``model``'s Linear -> elementwise activation pairs (``BertIntermediate``-shaped modules and
    consecutive children of ``nn.Sequential`` containers, the model itself included) the bounded backward of the
    module docstring, in place: the containers get an instance ``forward`` (their class, children, parameters,
    module names and ``state_dict`` stay). Returns how many pairs changed; :func:`unconvert_bounded_ffn` undoes
    it. ``chunk_bytes``: bytes of one row chunk of a saved tensor (int or ``"4MiB"``); bad values raise
    ``ValueError`` naming them."""
    chunk_rows(chunk_bytes, 1)
    changed = 0
    for module in model.modules():
        pairs = _pairs(module)
        if pairs:
            forward = _intermediate_forward if _is_intermediate(module) else _sequential_forward
            module.forward = types.MethodType(forward, module)
            module._bounded_ffn_chunk_bytes = chunk_bytes
            changed += pairs
    return changed


def is_bounded_ffn(model: nn.Module) -> bool:
    """Whether :func:`convert_bounded_ffn` changed something in ``model`` that is not undone."""
    return any(_converted(m) for m in model.modules())


def unconvert_bounded_ffn(model: nn.Module) -> int:
    """Undo :func:`convert_bounded_ffn` on ``model``; returns how many containers were restored."""
    restored = 0
    for module in model.modules():
        if _converted(module):
            del module.forward, module._bounded_ffn_chunk_bytes
            restored += 1
    return restored
