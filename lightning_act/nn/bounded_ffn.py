"""A transformer's feed-forward block, Linear -> elementwise activation (-> Linear), as one autograd node whose
backward holds the incoming and the outgoing gradient plus row chunks (issue #17 item 1: bounded backward
transients). Converted: HuggingFace's ``BertLayer``-shaped FFN (``intermediate.dense`` -> activation ->
``output.dense``, then the output's dropout and LayerNorm as before), ``BertIntermediate``-shaped modules, and
``nn.Linear`` -> ``nn.GELU``/``nn.ReLU``/... (-> ``nn.Linear``) runs in an ``nn.Sequential``.

Unfused, autograd runs the block's backward as two or three nodes. The activation's (``GeluBackward0``) holds the
incoming gradient ``grad_a`` (4H wide), the decoded pre-activation ``h`` (4H wide: under an
``ActivationCompressor`` one whole decoded tensor) and its output ``grad_h`` (4H wide); the second Linear's holds
its decoded input ``a`` (4H wide). On BERT with chunked attention these hold the step's peak.

Here one autograd Function computes ``y = act(x @ W1^T + b1)`` (then ``@ W2^T + b2``) with the modules themselves
(each ``nn.Linear`` module is called, so autocast casts as it would and forward hooks run; then the activation
module or function) and saves, per row chunk of the flattened ``(rows, features)`` view, the first Linear's input
in the dtype the Linear ran in (autocast's copy) and the pre-activation ``h``: each chunk a separate saved tensor,
so the compressor stores and decodes them one at a time. ``a`` is not saved: the backward re-runs the activation
on each decoded chunk of ``h`` (under the forward's autocast state, differentiated by autograd: PyTorch's own
derivative), for the second Linear's weight gradient and for ``grad_h``. ReLU without a second Linear saves
``h > 0`` bit-packed instead (1 bit, exact: the derivative needs nothing else). Per chunk: ``grad_a = grad_y @ W2``,
``grad_W2 += grad_y^T @ a``, ``grad_h = act'(h) * grad_a``, ``grad_x[rows] = grad_h @ W1``, ``grad_W1 += grad_h^T @
x[rows]``, bias gradients as sums (accumulated in float32 for 16-bit weights, else in the weight's dtype). It holds
``grad_y``, ``grad_x`` and chunk-sized pieces (and a weight-sized partial product per chunk for 16-bit weights); no
whole 4H-wide ``h``, ``a`` or their gradients.

Under saved-tensor hooks (an ``ActivationCompressor``, or torch checkpointing's) the forward runs by row chunks
too: each chunk's ``h`` (and input) goes through the pack hook as soon as it is made, so the forward holds the
output and chunk-sized pieces, never a whole ``h`` or ``a`` (the pack hooks in effect are read with
``torch._C._autograd._top_saved_tensors_default_hooks``; a torch without it runs the whole forward). Its
row-blocked matmuls may round differently from the whole ones. Without hooks, or when a Linear or the activation
has forward hooks (they would run once per chunk), the forward is the unfused one bit for bit. Gradients equal the
unfused ones up to the order of the sums.

Rows that fit one chunk run unfused: a single fused chunk holds the activation's output and its gradient beside
``h`` and ``grad_h``, one tensor more than the unfused backward, and bounds nothing.

Not fused (left as they are): a Linear subclass, a Linear or activation with backward hooks (they would not
fire inside the fused node), activations with parameters or ``inplace=True`` (except ReLU), and anything that is
not a known elementwise activation (:func:`fusable_activation`). Forward hooks and forward pre-hooks of the
modules run (inside the fused node's forward); a ``BertLayer``'s intermediate or output with forward hooks runs as
the class has it (the intermediate's pair still fused); full backward hooks registered after conversion do not fire.
"""
from __future__ import annotations

import functools
import types

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.modules import module as module_globals

from ..formats._bitpack import pack_bits, unpack_bits
from .. import module_tree
from ._chunks import DEFAULT_CHUNK_BYTES, SavedEntries, chunk_rows, row_bounds
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


def _fusable_linear(linear) -> bool:
    return type(linear) is nn.Linear and not _has_backward_hooks(linear)


def _fusable(linear, act) -> bool:
    return _fusable_linear(linear) and fusable_activation(act)


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
    return isinstance(module, nn.Module) and bool(
        module._forward_hooks or module._forward_pre_hooks or module_globals._global_forward_hooks
        or module_globals._global_forward_pre_hooks)


def _saved_tensor_hooks():
    """The ``(pack, unpack)`` pair of the innermost ``torch.autograd.graph.saved_tensors_hooks`` in effect (an
    ``ActivationCompressor``'s, for one), or None: none in effect, or a torch without the accessor."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return None if top is None else top(False)


class _FeedForward(torch.autograd.Function):
    """``y = act(x @ W1^T + b1)``, then ``@ W2^T + b2`` when a second Linear is given (``two``), saving per row chunk
    the first Linear's input and the pre-activation ``h`` (ReLU without a second Linear: its signs, bit-packed).
    The activation's output ``a`` is not saved: the backward re-runs the activation on each decoded chunk of ``h``
    (for the second Linear's weight gradient and the activation's derivative)."""

    @staticmethod
    def forward(ctx, x, weight1, bias1, weight2, bias2, linear1, act, linear2, per_chunk):
        ctx.two = linear2 is not None
        ctx.relu = _is_relu(act)
        ctx.signs = ctx.relu and not ctx.two  # the derivative needs nothing else; a second Linear needs a itself
        device = x.device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.act = act
        ctx.saves_x = bool(ctx.needs_input_grad[1])
        hidden = weight1.shape[0]
        ctx.x_meta, ctx.hidden = (x.shape, x.dtype), hidden
        x2 = _rows(x)
        ctx.bounds = bounds = row_bounds(x2.shape[0], per_chunk)
        hooks = _saved_tensor_hooks()
        modules = (linear1, act, linear2)
        if hooks is not None and bounds and not any(_forward_hooked(m) for m in modules):
            return _FeedForward._forward_by_chunks(ctx, x, x2, (weight1, weight2), modules, hooks)
        ctx.packed = None
        h = linear1(x)  # the module: autocast casts x and the weight as unfused, its forward hooks run
        a = act(h)  # ReLU may write into h: then a is what is kept (same signs, and relu(a) = a)
        y = linear2(a) if ctx.two else a
        ctx.h_dtype, ctx.a_dtype, ctx.y_dtype = h.dtype, a.dtype, y.dtype
        h2 = _rows(a if ctx.relu else h)
        saved = [weight1, weight2] if ctx.two else [weight1]
        if ctx.saves_x:
            xc = _rows(x.to(h.dtype))  # what the Linear read (autocast's copy), for the weight gradient
            saved += [xc[start:stop] for start, stop in bounds]
        if ctx.signs:
            saved += [pack_bits(h2[start:stop].reshape(-1) > 0) for start, stop in bounds]
        else:
            saved += [h2[start:stop] for start, stop in bounds]
        ctx.save_for_backward(*saved)
        return y

    @staticmethod
    def _forward_by_chunks(ctx, x, x2, weights, modules, hooks):
        """Under saved-tensor hooks (a compressor): the modules run per row chunk, and each chunk's saved tensors
        go through the pack hook at once, so no whole ``h`` (nor, with a second Linear, ``a``) exists beside the
        output. The row-blocked matmuls may round differently from the whole ones (the values saved are the
        compressor's approximation in any case); without hooks the forward is the unfused one bit for bit."""
        linear1, act, linear2 = modules
        pack, ctx.unpack = hooks
        ctx.save_for_backward(*(w for w in weights if w is not None))
        packed_x, packed_h, out = [], [], None
        for start, stop in ctx.bounds:
            xc = x2[start:stop]
            h = linear1(xc)
            a = act(h)
            y = linear2(a) if ctx.two else a
            if out is None:
                out = y.new_empty(x2.shape[0], y.shape[-1])
                ctx.h_dtype, ctx.a_dtype, ctx.y_dtype = h.dtype, a.dtype, y.dtype
            out[start:stop] = y
            if ctx.saves_x:
                packed_x.append(pack(xc.to(h.dtype)))  # what the Linear read (autocast's copy)
            packed_h.append(pack(pack_bits(a.reshape(-1) > 0) if ctx.signs else a if ctx.relu else h))
            del h, a, y
        ctx.packed = (packed_x, packed_h)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        need_x, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad[:5]
        need_h = need_x or need_w1 or need_b1
        saved = SavedEntries(ctx)
        weight1 = saved[0]
        weight2 = saved[1] if ctx.two else None
        bounds, dtype, hidden = ctx.bounds, ctx.h_dtype, ctx.hidden
        x_shape, x_dtype = ctx.x_meta
        if ctx.packed is None:  # saved by save_for_backward: the weights, x's chunks, h's chunks
            x_at = 2 if ctx.two else 1
            h_at = x_at + (len(bounds) if ctx.saves_x else 0)
            x_chunk, h_chunk = (lambda i: saved[x_at + i]), (lambda i: saved[h_at + i])
        else:  # packed one chunk at a time in the forward
            packed_x, packed_h = ctx.packed
            x_chunk, h_chunk = (lambda i: ctx.unpack(packed_x[i])), (lambda i: ctx.unpack(packed_h[i]))
        g2 = _rows(grad_y)
        device = grad_y.device
        grad_x = torch.empty(x_shape, dtype=x_dtype, device=device) if need_x else None
        gx2 = _rows(grad_x) if need_x else None
        zeros = lambda shape, like: torch.zeros(shape, dtype=_wide(like.dtype), device=like.device)  # noqa: E731
        grad_w1 = zeros(weight1.shape, weight1) if need_w1 else None
        grad_b1 = zeros(hidden, weight1) if need_b1 else None
        grad_w2 = zeros(weight2.shape, weight2) if need_w2 else None
        grad_b2 = zeros(weight2.shape[0], weight2) if need_b2 else None
        device_type, autocast, autocast_dtype = ctx.autocast
        # the activation re-run as in the forward (its autocast state), never in place: PyTorch's own derivative
        act = F.relu if ctx.relu else ctx.act
        with torch.autocast(device_type, enabled=False):
            w1 = weight1.to(dtype) if need_x else None
            w2 = weight2.to(ctx.y_dtype) if ctx.two and need_h else None
            for i, (start, stop) in enumerate(bounds):
                gy = g2[start:stop]
                if ctx.signs:
                    mask = unpack_bits(h_chunk(i), (stop - start) * hidden)
                    gh = torch.where(mask.view(stop - start, hidden), gy, 0)
                    del mask
                else:
                    hc = h_chunk(i).detach().requires_grad_(need_h)
                    # no compressor sees this graph's saved tensors
                    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_same, _same), \
                            torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast):
                        a = act(hc)
                    ga = gy
                    if ctx.two:
                        gy = gy.to(ctx.y_dtype)
                        _accumulate_(grad_w2, gy.t(), a.detach().to(ctx.y_dtype))
                        if need_b2:
                            grad_b2 += gy.sum(0, dtype=grad_b2.dtype)
                        ga = (gy @ w2).to(ctx.a_dtype) if need_h else None
                    gh = torch.autograd.grad(a, hc, ga)[0] if need_h else None
                    del hc, a, ga
                if gh is None:
                    continue
                gh = gh.to(dtype)
                if need_x:
                    gx2[start:stop] = gh @ w1
                if need_w1:
                    _accumulate_(grad_w1, gh.t(), x_chunk(i))
                if need_b1:
                    grad_b1 += gh.sum(0, dtype=grad_b1.dtype)
                del gh, gy
        cast = lambda t, like: None if t is None else t.to(like.dtype)  # noqa: E731
        return (grad_x, cast(grad_w1, weight1), cast(grad_b1, weight1), cast(grad_w2, weight2),
                cast(grad_b2, weight2), None, None, None, None)


def _accumulate_(acc: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` (``acc`` None: nothing wanted): in place when the dtypes agree, else a product per chunk
    (16-bit) summed in ``acc``'s float32."""
    if acc is None:
        return
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
    else:
        acc += a @ b


def linear_act(x: torch.Tensor, linear: nn.Linear, act, chunk_bytes: int | str = DEFAULT_CHUNK_BYTES,
               output: nn.Linear | None = None) -> torch.Tensor:
    """``act(linear(x))``, then ``output(...)`` when given (a transformer's whole FFN), with the bounded backward of
    the module docstring; row chunks of about ``chunk_bytes`` (of the widest of ``x``, the hidden and the output
    per row). Without autograd (no gradient wanted), or when the rows fit one chunk (the fused node would then hold
    the activation's output and its gradient beside ``h`` and ``grad_h``: more than the unfused backward), the
    modules run as they are."""
    params = (linear.weight, linear.bias) + ((output.weight, output.bias) if output is not None else (None, None))
    if torch.is_grad_enabled() and (x.requires_grad or any(p is not None and p.requires_grad for p in params)):
        features = x.shape[-1] if x.dim() else 1
        rows = x.numel() // features if features else 0
        widest = max(linear.out_features, features, output.out_features if output is not None else 0, 1)
        per_chunk = chunk_rows(chunk_bytes, widest * x.element_size(), rows, x.device)
        if rows > per_chunk:
            return _FeedForward.apply(x, *params, linear, act, output, per_chunk)
    y = act(linear(x))
    return y if output is None else output(y)


# ---- conversion -------------------------------------------------------------------------------------------------

def _intermediate_reference(self, hidden_states):  # BertIntermediate.forward's body (compared as bytecode)
    hidden_states = self.dense(hidden_states)
    hidden_states = self.intermediate_act_fn(hidden_states)
    return hidden_states


def _same_code(cls: type, method: str, reference) -> bool:
    """Whether ``cls``'s ``method`` has ``reference``'s bytecode (memoised per class: a compressed forward converts
    and unconverts the model each step)."""
    return _method_is(cls, method, reference.__code__)


@functools.lru_cache(maxsize=None)
def _method_is(cls: type, method: str, ref) -> bool:
    code = getattr(getattr(cls, method, None), "__code__", None)
    return code is not None and all(getattr(code, name) == getattr(ref, name) for name in
                                    ("co_code", "co_names", "co_varnames", "co_consts", "co_argcount"))


def _is_intermediate(module: nn.Module) -> bool:
    """A ``BertIntermediate``-shaped module: ``dense`` then ``intermediate_act_fn`` (its class's forward is that
    body, bytecode for bytecode: the copies HuggingFace makes of it for RoBERTa, ViT, ... qualify)."""
    return (_same_code(type(module), "forward", _intermediate_reference)
            and _fusable(getattr(module, "dense", None), getattr(module, "intermediate_act_fn", None)))


def _layer_reference(self, attention_output):  # BertLayer.feed_forward_chunk's body
    intermediate_output = self.intermediate(attention_output)
    layer_output = self.output(intermediate_output, attention_output)
    return layer_output


def _output_reference(self, hidden_states, input_tensor):  # BertOutput.forward's body
    hidden_states = self.dense(hidden_states)
    hidden_states = self.dropout(hidden_states)
    hidden_states = self.LayerNorm(hidden_states + input_tensor)
    return hidden_states


def _is_layer(module: nn.Module) -> bool:
    """A ``BertLayer``-shaped module: its ``feed_forward_chunk`` runs a ``BertIntermediate``-shaped ``intermediate``
    and a ``BertOutput``-shaped ``output`` (dense, dropout, LayerNorm of the sum with the input), bytecode for
    bytecode, whose ``dense`` is a plain Linear."""
    output = getattr(module, "output", None)
    return (_same_code(type(module), "feed_forward_chunk", _layer_reference)
            and _is_intermediate(getattr(module, "intermediate", None))
            and _same_code(type(output), "forward", _output_reference)
            and _fusable_linear(getattr(output, "dense", None)))


def _layer_feed_forward(self, attention_output):
    """The layer's whole FFN (dense -> activation -> dense) as one node, then the output's dropout and LayerNorm;
    the class's own when the intermediate or the output has forward hooks (they run only through the modules)."""
    intermediate, output = self.intermediate, self.output
    if _forward_hooked(intermediate) or _forward_hooked(output):
        return type(self).feed_forward_chunk(self, attention_output)
    branch = output.dropout(linear_act(attention_output, intermediate.dense, intermediate.intermediate_act_fn,
                                       self._bounded_ffn_chunk_bytes, output=output.dense))
    if branch._is_view() or _forward_hooked(output.dropout):  # dropout returned the node's (view) output as it
        summed = branch + attention_output  # is (eval), or a hook may keep dropout's output: not written into
    else:  # the sum written into dropout's output (or its copy in the sum's dtype), the same values: one
        # residual-sized tensor less alive, and on CPU, whose mixed-dtype add (a bf16 branch under autocast) first
        # copies the narrower input, two less
        summed = branch.to(torch.result_type(branch, attention_output)).add_(attention_output)
    del branch  # a bf16 branch is not held through the LayerNorm
    return output.LayerNorm(summed)


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
            output = modules[i + 2] if _closes_pair(modules, i) else None
            x = linear_act(x, modules[i], modules[i + 1], chunk_bytes, output=output)
            i = start = i + (2 if output is None else 3)
        else:
            i += 1
    return x


def _closes_pair(modules: list, i: int) -> bool:
    """Whether the pair at ``i`` is followed by a plain Linear that does not start a pair of its own: the three
    run as one node (a transformer's whole FFN)."""
    return (i + 2 < len(modules) and _fusable_linear(modules[i + 2])
            and not (i + 3 < len(modules) and _fusable(modules[i + 2], modules[i + 3])))


# the instance methods a conversion sets: (attribute, the functions it may be bound to)
_PATCHED = (("forward", (_intermediate_forward, _sequential_forward)), ("feed_forward_chunk", (_layer_feed_forward,)))


def _patched(module: nn.Module) -> str | None:
    """The attribute :func:`convert_bounded_ffn` set on ``module`` (None: not converted)."""
    for name, functions in _PATCHED:
        method = module.__dict__.get(name)
        if getattr(method, "__func__", None) in functions and getattr(method, "__self__", None) is module:
            return name
    return None


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
    consecutive children of ``nn.Sequential`` containers, the model itself included; with the Linear after them in
    a ``BertLayer``-shaped module, or in the Sequential when it starts no pair of its own) the bounded backward of
    the module docstring, in place: the containers get an instance ``forward`` (layers: ``feed_forward_chunk``;
    their class, children, parameters, module names and ``state_dict`` stay). Returns how many pairs changed;
    :func:`unconvert_bounded_ffn` undoes it. ``chunk_bytes``: bytes of one row chunk of a saved tensor (int,
    ``"4MiB"``, or the default ``"auto"``: 4 MiB, at most 8 chunks off CPU); bad values raise ``ValueError`` naming
    them."""
    chunk_rows(chunk_bytes, 1)
    changed = 0
    for module in module_tree.modules(model):
        if _is_layer(module):  # its pair is counted at its intermediate
            module.feed_forward_chunk = types.MethodType(_layer_feed_forward, module)
            module._bounded_ffn_chunk_bytes = chunk_bytes
        pairs = _pairs(module)
        if pairs:
            forward = _intermediate_forward if _is_intermediate(module) else _sequential_forward
            module.forward = types.MethodType(forward, module)
            module._bounded_ffn_chunk_bytes = chunk_bytes
            changed += pairs
    return changed


def is_bounded_ffn(model: nn.Module) -> bool:
    """Whether :func:`convert_bounded_ffn` changed something in ``model`` that is not undone."""
    return any(_patched(m) for m in module_tree.modules(model))


def unconvert_bounded_ffn(model: nn.Module) -> int:
    """Undo :func:`convert_bounded_ffn` on ``model``; returns how many modules were restored (containers of pairs
    and layers)."""
    restored = 0
    for module in module_tree.modules(model):
        name = _patched(module)
        if name is not None:
            delattr(module, name)
            del module._bounded_ffn_chunk_bytes
            restored += 1
    return restored
