"""BLPA's BatchNorm -> ReLU -> Conv/Linear block (Chakrabarti & Moseley, NeurIPS 2019, section 3.2).

The forward is exact: it runs the three modules as they are. For the backward it keeps only a ``bits``-bit
(4 or 8) code per element of the post-BN, pre-ReLU tensor ``A2 = gamma * A1 + beta`` (eq. 9): with
``s = 2**bits / (6 |gamma|)`` per channel, ``k = floor(A2 * s)`` for ``A2 > 0`` and ``ceil(A2 * s) - 1``
otherwise (so 0 and NaN count as negative, as ReLU's backward sees them), clipped to the ``2**bits`` codes
around ``floor(beta * s)``, i.e. ``beta +- 3 gamma``. The window is shifted to contain codes -1 and 0 when
``beta +- 3 gamma`` excludes 0, so clipping never flips a sign. Backward (eq. 10) rebuilds the interval
midpoints ``A2~ = (k + 0.5) / s``, ``A3~ = relu(A2~)`` and ``A1~ = (A2~ - beta) / gamma``:

- ReLU's backward is exact (the sign of every ``A2`` is kept), so are the gradients of the layer's input and
  bias and of ``beta``;
- the layer's weight gradient uses ``A3~`` and BN's ``gamma`` and input gradients use ``A1~``: errors of at
  most ``3 |gamma| / 2**bits`` in ``A2`` for unclipped values. A channel with ``gamma = 0`` has ``A2 = beta``
  whatever ``A1`` is: ``A1~`` is taken as 0 there (its ``gamma`` gradient is then 0).

Saved for backward: the packed codes (``bits`` per element) and BN's per-channel inverse std; the BN input
and the ReLU output are not kept.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from .._validate import check_choice, check_type
from ..formats._bitpack import pack_codes, unpack_codes

ALLOWED_BITS = (4, 8)
# |gamma| floor of the code scale: a zero gamma gets a finite scale, so 0 * scale stays 0, never NaN
_MIN_GAMMA = 1e-30
_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_LAYERS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)


def _channel_view(v: torch.Tensor, ndim: int) -> torch.Tensor:
    """A per-channel vector shaped to broadcast over dim 1 of an ``ndim``-d activation."""
    return v.view(1, -1, *([1] * (ndim - 2)))


def _code_window(beta: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """Lowest code of each channel: ``floor(beta * s) - 2**(bits-1)``, moved so the window holds -1 and 0."""
    half = 1 << (bits - 1)
    return (beta * scale).floor().clamp(1 - half, half - 1) - half


def sign_preserving_codes(a2: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, bits: int) -> torch.Tensor:
    """Eq. 9 with the sign kept: uint8 codes in ``[0, 2**bits)`` of the pre-ReLU tensor ``a2``."""
    scale = _channel_view(2.0**bits / (6 * gamma.abs().clamp(min=_MIN_GAMMA)), a2.dim())
    low = _code_window(_channel_view(beta, a2.dim()), scale, bits)
    v = a2 * scale
    k = torch.where(a2 > 0, v.floor(), v.ceil() - 1).nan_to_num_(nan=-1.0)
    return (k.clamp_(low, low + (1 << bits) - 1) - low).to(torch.uint8)


def decode_codes(codes: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, bits: int):
    """Eq. 10: ``(A2~, positive)``, the interval midpoints and where ``A2 > 0``."""
    scale = _channel_view(2.0**bits / (6 * gamma.abs().clamp(min=_MIN_GAMMA)), codes.dim())
    k = codes.float() + _code_window(_channel_view(beta, codes.dim()), scale, bits)
    return (k + 0.5) / scale, k >= 0


class _BNReLULayer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bn_weight, bn_bias, layer_weight, layer_bias, block: "BNReLUBlock"):
        bn, bits = block.bn, block.bits
        a2 = bn(x)  # the modules themselves: same output, running statistics updated as unfused
        out = block.layer(torch.relu(a2))
        batch_stats = bn.training or (bn.running_mean is None and bn.running_var is None)
        if batch_stats:
            var = x.float().var(dim=[d for d in range(x.dim()) if d != 1], correction=0)
        else:
            var = bn.running_var.float()
        gamma, beta = _gamma_beta(bn_weight, bn_bias, var)
        codes = sign_preserving_codes(a2.float(), gamma, beta, bits)
        ctx.block, ctx.shape, ctx.dtype, ctx.batch_stats = block, a2.shape, a2.dtype, batch_stats
        ctx.input_dtype = x.dtype
        device = x.device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.save_for_backward(pack_codes(codes.reshape(-1), bits), (var + bn.eps).rsqrt(), bn_weight, bn_bias,
                              layer_weight, layer_bias)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        packed, invstd, bn_weight, bn_bias, layer_weight, layer_bias = ctx.saved_tensors
        block, shape = ctx.block, ctx.shape
        codes = unpack_codes(packed, block.bits, shape.numel()).view(shape)
        gamma, beta = _gamma_beta(bn_weight, bn_bias, invstd)
        a2, positive = decode_codes(codes, gamma, beta, block.bits)
        device, autocast, autocast_dtype = ctx.autocast
        # the layer's own backward, on the rebuilt ReLU output, under the forward's autocast state (the same casts)
        with torch.enable_grad(), torch.autocast(device, dtype=autocast_dtype, enabled=autocast):
            a3 = torch.relu(a2).to(ctx.dtype).requires_grad_()
            weight = layer_weight.detach().requires_grad_()
            bias = layer_bias.detach().requires_grad_() if layer_bias is not None else None
            inputs = [a3, weight] + ([bias] if bias is not None else [])
            grad_a3, grad_weight, *grad_bias = torch.autograd.grad(block.layer_forward(a3, weight, bias), inputs,
                                                                   grad_out)
        grad_bias = grad_bias[0] if grad_bias else None
        grad_a2 = torch.where(positive, grad_a3.float(), 0.0)  # ReLU's backward, exact
        dims = [d for d in range(grad_a2.dim()) if d != 1]
        gamma_c, beta_c, invstd_c = (_channel_view(v, a2.dim()) for v in (gamma, beta, invstd))
        a1 = torch.where(gamma_c != 0, (a2 - beta_c) / gamma_c, 0.0)
        affine = bn_weight is not None
        grad_gamma = (grad_a2 * a1).sum(dims) if affine else None
        grad_beta = grad_a2.sum(dims) if affine else None
        grad_a1 = grad_a2 * gamma_c
        if ctx.batch_stats:
            grad_a1 = grad_a1 - grad_a1.mean(dims, keepdim=True) - a1 * (grad_a1 * a1).mean(dims, keepdim=True)
        grad_x = (grad_a1 * invstd_c).to(ctx.input_dtype)
        if grad_gamma is not None:
            grad_gamma, grad_beta = grad_gamma.to(bn_weight.dtype), grad_beta.to(bn_bias.dtype)
        return grad_x, grad_gamma, grad_beta, grad_weight, grad_bias, None


def _gamma_beta(weight: torch.Tensor | None, bias: torch.Tensor | None, like: torch.Tensor):
    """BN's gamma and beta in float32; 1 and 0 without affine parameters (``like``: a per-channel vector)."""
    gamma = weight.detach().float() if weight is not None else torch.ones_like(like, dtype=torch.float32)
    beta = bias.detach().float() if bias is not None else torch.zeros_like(like, dtype=torch.float32)
    return gamma, beta


class BNReLUBlock(nn.Module):
    """``layer(relu(bn(x)))`` with an exact forward and a ``bits``-bit sign-preserving copy for backward.

    Args:
        bn: ``BatchNorm1d/2d/3d``.
        layer: ``Conv1d/2d/3d`` or ``Linear`` taking the ReLU output.
        bits: 4 or 8 bits per element of the stored pre-ReLU approximation.
    """

    def __init__(self, bn: nn.Module, layer: nn.Module, bits: int = 8):
        super().__init__()
        if not isinstance(bn, _BATCH_NORMS):
            raise ValueError(f"bn={type(bn).__name__}; expected one of BatchNorm1d, BatchNorm2d, BatchNorm3d")
        if not isinstance(layer, _LAYERS):
            raise ValueError(f"layer={type(layer).__name__}; expected one of Conv1d, Conv2d, Conv3d, Linear")
        check_choice("bits", bits, ALLOWED_BITS)
        self.bn, self.layer, self.bits = bn, layer, bits

    def layer_forward(self, a3: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The layer's computation with the given parameters (the backward differentiates it)."""
        if isinstance(self.layer, nn.Linear):
            return nn.functional.linear(a3, weight, bias)
        return self.layer._conv_forward(a3, weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self.layer(torch.relu(self.bn(x)))
        return _BNReLULayer.apply(x, self.bn.weight, self.bn.bias, self.layer.weight, self.layer.bias, self)

    def extra_repr(self) -> str:
        return f"bits={self.bits}"


def convert_bn_relu(model: nn.Module, bits: int = 8) -> int:
    """Replace every ``BatchNorm -> ReLU -> Conv/Linear`` run of consecutive children of an ``nn.Sequential``
    in ``model`` (at any depth) by a :class:`BNReLUBlock` named like the BatchNorm. Returns how many.

    The state dict keeps the keys it had (``net.1.weight``, ``net.3.weight``, not ``net.1.bn.weight``,
    ``net.1.layer.weight``), and loads either: a checkpoint of the converted model loads into the model as it was
    built (``LightningModule.load_from_checkpoint``, inference without BLPA) and the other way round."""
    check_type("model", model, nn.Module, "an nn.Module")
    check_choice("bits", bits, ALLOWED_BITS)
    replaced = 0
    for module in list(model.modules()):
        if not isinstance(module, nn.Sequential):
            continue
        items = list(module._modules.items())
        kept, i = [], 0
        layer_names = {}  # block (the BatchNorm's name) -> the layer's name before
        while i < len(items):
            trio = [m for _, m in items[i:i + 3]]
            if len(trio) == 3 and isinstance(trio[0], _BATCH_NORMS) and type(trio[1]) is nn.ReLU \
                    and isinstance(trio[2], _LAYERS):
                kept.append((items[i][0], BNReLUBlock(trio[0], trio[2], bits)))
                layer_names[items[i][0]] = items[i + 2][0]
                replaced += 1
                i += 3
            else:
                kept.append(items[i])
                i += 1
        if layer_names:
            module._modules.clear()
            module._modules.update(kept)
            # (functools.partial of module functions: a model with its hooks still pickles)
            module.register_state_dict_post_hook(functools.partial(_keys_before_conversion, layer_names))
            module.register_load_state_dict_pre_hook(functools.partial(_keys_after_conversion, layer_names))
    return replaced


def _renamed(keys, prefix: str, renames: dict[str, str]) -> dict[str, str]:
    """``old -> new`` for the ``keys`` under ``prefix`` + a key of ``renames`` (a child's path), that prefix
    replaced by its value."""
    out = {}
    for key in keys:
        if key.startswith(prefix):
            for old, new in renames.items():
                if key.startswith(old, len(prefix)):
                    out[key] = prefix + new + key[len(prefix) + len(old):]
                    break
    return out


def _blpa_renames(layer_names: dict[str, str]) -> dict[str, str]:
    """Each block's paths in the converted Sequential -> in the Sequential as it was built."""
    renames = {}
    for block, layer in layer_names.items():
        renames[f"{block}.bn."], renames[f"{block}.layer."] = f"{block}.", f"{layer}."
    return renames


def _keys_before_conversion(layer_names, module, state_dict, prefix, local_metadata) -> None:
    """State-dict post hook of a converted Sequential: its blocks' keys as the Sequential had them, in order."""
    paths = _blpa_renames(layer_names)
    renames = _renamed(state_dict, prefix, paths)
    if renames:
        items = list(state_dict.items())
        state_dict.clear()
        state_dict.update((renames.get(key, key), value) for key, value in items)
    metadata = getattr(state_dict, "_metadata", None)  # per-module versions (BatchNorm's), keyed without the dot
    if metadata is not None:
        for old, new in _renamed([f"{key}." for key in metadata], prefix, paths).items():
            metadata[new[:-1]] = metadata.pop(old[:-1])


def _keys_after_conversion(layer_names, module, state_dict, prefix, *args) -> None:
    """Load-state-dict pre hook of a converted Sequential: keys as the Sequential was built (its BatchNorm's and its
    layer's) become the blocks'; converted keys stay as they are."""
    inverse = {new: old for old, new in _blpa_renames(layer_names).items()}
    converted = tuple(prefix + old for old in inverse.values())
    keys = [key for key in state_dict if not key.startswith(converted)]
    for old, new in _renamed(keys, prefix, inverse).items():
        state_dict[new] = state_dict.pop(old)
