"""Compression inside ``torch.compile``'d regions.

Autograd calls Python saved-tensor hooks for a compiled region only after its whole forward has run
(pytorch#148222): every activation inside it is first held at full size, so the step's peak does not move.
AOTAutograd (torch 2.8 and later) inlines hooks given as ``torch.fx.GraphModule`` objects into the compiled
graphs instead, when they are the innermost hooks while the region compiles. :class:`GraphHooks` is that pair for
a compressor:

* **Forward**: where the quantize codec's kernels run (CUDA with CuPy), one opaque op per tensor,
  ``torch.ops.lightning_act.quantize``: the kernel's encode, a launch per tensor (BERT-base compiled cold in 59 s
  on CPU this way, 164 s traced, 42 s uncompressed). Elsewhere the format's encode as traced torch ops
  (:func:`encode_traced`: the statistics, noise and rounding of :func:`lightning_act.formats.compiled.quantize_groups`,
  the codes packed by shifts), which inductor fuses with the ops around it: no host work per tensor at run time.
* **Backward**: one opaque op per tensor, ``torch.ops.lightning_act.dequantize_buffer`` (the kernel encode's form)
  or ``dequantize`` (the traced one's), which decodes with the compressor's quantize codec (its CUDA kernel where
  that runs, else its torch path) and records the tensor in the step's statistics (``phase="compiled"``).
  AOTAutograd puts the unpack graphs in the backward's prologue, where every activation would be decoded as the
  backward starts (the uncompressed step's peak again); the post-grad pass :class:`SinkDecodes` moves each decode
  right before the first op that reads it.
* **Eager code** (graph breaks, uncompiled submodules, checkpoint recomputation) calls the same modules with real
  tensors: they run the compressor's own hooks, with its records, de-duplication, op rules and every codec.

Inside compiled regions float tensors are stored in the quantize format (``formats.quantize``), at the config's
``bits`` (its average when ``adaptive``), ``group_size`` and ``stats_dtype``; the traced encode's noise comes from
``torch.randint`` in the graph, the kernel encode's from the codec's keyed stream at keys counted per hooks (the ops
are tagged ``cudagraph_unsafe``: no CUDA graph replays them, so each call takes a fresh key), so neither is the
eager path's stream. Bool tensors (dropout's keep masks, the comparisons a backward selects by) are packed at 1 bit,
losslessly, when ``compress_masks`` is on (``unpack_mask`` decodes them); so is the sign of a float tensor whose
backward compares it with 0 (a ReLU output the next layer also saves), beside its codes, and the decode restores it
exactly (:func:`restore_signs`). Kept as they are there: float tensors of other codecs' configs (``division``,
``lorenzo``, ``bits`` 16/32), what an attention backward rescales rows by (SDPA's additive 0 / -inf mask and
log-sum-exp, a decomposed softmax's row maxima and sums: exact, as in eager code; the logits such a softmax is
recomputed from go at 8 bits at least), integer tensors, tensors under ``min_numel`` elements or not dense in
memory, and what AOTAutograd does not hand to the hooks (inputs, parameters, outputs of the region).
"""
from __future__ import annotations

import functools
import itertools
import math
import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._subclasses.fake_tensor import is_fake

from .codecs._chunks import chunk_elements, spans
from .codecs.base import Packed
from .cuda.launcher import PART_ALIGN, OneBuffer, runner_override
from .cuda.quantize import encoded_layout
from .formats._bitpack import PACKABLE_BITS, bit_rows, pack_codes_traced, packed_nbytes, unpack_rows
from .formats.compiled import quantize_groups
from .formats.floats import CANONICAL_NAN, FLOAT_DTYPES, INT_VIEW, canonical_nan_
from .formats.quantize import STATS_DTYPES
from .stats import COMPRESSED, TensorRecord
from ._warn import warn_user

if TYPE_CHECKING:
    from .engine import ActivationCompressor

# The encode's element counter is int32 (quantize_groups): larger tensors are kept.
MAX_NUMEL = (1 << 31) - 1
# the forms a compiled forward stores a saved tensor in: the first item of the pack hook's tuple
KEPT, QUANTIZE, KERNEL, BITS = "kept", "quantize", "kernel", "bits"
_OWNERS: weakref.WeakValueDictionary[int, GraphHooks] = weakref.WeakValueDictionary()
_OWNER_IDS = itertools.count()
_aten = torch.ops.aten
# The ops compiled graphs call once per saved tensor, defined on the dispatcher with one Python kernel per device
# type: torch.library.custom_op's wrapper cost about 5.5 µs more per call (on this project's CPU).
_LIBRARY = torch.library.Library("lightning_act", "FRAGMENT")
# Each call changes Python state that a CUDA graph's replay would skip (an encode takes a fresh noise key, a decode
# records its tensor): tagged, inductor runs the graphs that hold them without CUDA graphs (mode="reduce-overhead"
# logs the op it skipped them for), or partitions the graph around them where its graph partition is on.
_OP_TAGS = tuple(tag for tag in (getattr(torch.Tag, "cudagraph_unsafe", None),) if tag is not None)


def _op(schema: str, fake):
    """Define ``lightning_act::<schema>`` with the decorated function as its CPU and CUDA kernel and ``fake`` as
    its fake (meta) implementation."""
    def define(fn):
        name = schema.split("(", 1)[0]
        _LIBRARY.define(schema, tags=_OP_TAGS)
        for key in ("CPU", "CUDA"):
            _LIBRARY.impl(name, fn, key)
        torch.library.register_fake(f"lightning_act::{name}", fake, lib=_LIBRARY)
        return fn
    return define


def supported() -> bool:
    """Whether this torch inlines ``GraphModule`` saved-tensor hooks into compiled graphs."""
    from torch._functorch._aot_autograd import utils

    return hasattr(utils, "saved_tensors_hooks_are_inlineable")


def compresses_in_graph(config) -> bool:
    """Whether a config's saved tensors can be compressed inside compiled regions (the quantize codec at 1, 2, 4
    or 8 bits)."""
    return config.enabled and config.codec == "quantize" and config.bits in PACKABLE_BITS


def dense_order(t: torch.Tensor) -> tuple[int, ...] | None:
    """The permutation of dims that makes ``t`` contiguous (its memory order), or None when no permutation does
    (overlapping or gapped strides)."""
    order = tuple(sorted(range(t.dim()), key=lambda d: (-t.stride(d), d)))
    return order if t.permute(order).is_contiguous() else None


CHANNELS_LAST_ORDER = (0, 2, 3, 1)
# forward graph -> the names of the nodes inductor stores channels_last (names: nodes would keep the graph alive)
_CHANNELS_LAST_NODES: weakref.WeakKeyDictionary[torch.fx.Graph, frozenset[str]] = weakref.WeakKeyDictionary()


def channels_last_nodes(graph: torch.fx.Graph) -> frozenset[str]:
    """The names of the 4-d nodes of the forward ``graph`` whose buffers inductor lays out channels_last: with its
    layout optimisation on (every graph with convolutions on CPU, most conv nets on CUDA), the convolutions and the
    ops around them. Inductor's own rules (``GraphLowering.decide_layout_opt``, ``find_nodes_prefer_channels_last``)
    on the graph it is handed; empty where they cannot run (a torch without them)."""
    found = _CHANNELS_LAST_NODES.get(graph)
    if found is None:
        from torch._inductor.graph import GraphLowering

        module = SimpleNamespace(graph=graph)
        try:
            found = frozenset(node.name for node in (
                GraphLowering.find_nodes_prefer_channels_last(SimpleNamespace(module=module))
                if GraphLowering.decide_layout_opt(module, is_inference=False) else ()))
        except (AttributeError, TypeError, KeyError):  # another torch's internals: the traced layouts
            found = frozenset()
        _CHANNELS_LAST_NODES[graph] = found
    return found


def _saved_tensor_hook_context() -> dict | None:
    """What AOTAutograd tells the pack hook it traces about the saved tensor (``_node``, ``_fw_graph``), or None
    where this torch tells nothing."""
    from torch._functorch._aot_autograd import graph_compile

    get = getattr(graph_compile, "_get_saved_tensor_hook_context", None)
    return get() if get is not None else None


def memory_order(x: torch.Tensor, context: dict | None) -> tuple[int, ...] | None:
    """The order of dims in which the buffer inductor makes for the saved tensor ``x`` (traced, fake; ``context``:
    :func:`_saved_tensor_hook_context`) is contiguous, or None when ``x`` is not dense. Its traced strides, unless
    inductor lays it out channels_last (:func:`channels_last_nodes`): groups of the quantize format are then runs
    of that memory, read and written in order (groups across the traced strides cost a transposed read and a
    gathered pack, about twice the encode's time in a compiled ResNet-50's forward)."""
    order = dense_order(x)
    if order is None or x.dim() != 4:
        return order
    node = context.get("_node") if context is not None else None
    if node is not None and node.name in channels_last_nodes(context["_fw_graph"]):
        return CHANNELS_LAST_ORDER
    return order


def encode_traced(x: torch.Tensor, bits: int, group_size: int, stats_dtype: torch.dtype):
    """``(payload, mn, step)`` of the flat contiguous ``x`` in the quantize format, as torch ops a graph can hold
    (no in-place ops on views, no host reads, no tensor constants): ``dequantize_reference`` decodes it."""
    n = x.numel()
    flat = x.reshape(-1)
    pad = -n % group_size
    if pad:  # the last group padded with copies of the last element (its min and max unchanged), as the format
        flat = torch.cat([flat, flat[-1:].expand(pad)])
    key = torch.randint(-(1 << 31), (1 << 31) - 1, (1,), dtype=torch.int32, device=x.device)
    # quantize_groups' counter: first element 0, the key for every element, no wrap of the low word. The noise is
    # then a pure function of the element index, and inductor schedules each encode soon after the op that makes
    # the tensor, which is then freed. With per-element random ops (inductor's own tried) the encodes stayed at
    # the forward's end and the step peaked as the uncompressed one (test_the_compiled_steps_peak_falls).
    counter = torch.cat([torch.zeros(1, dtype=torch.int32, device=x.device), key, key,
                         torch.full((1,), MAX_NUMEL, dtype=torch.int32, device=x.device)])
    levels = torch.full((), float((1 << bits) - 1), device=x.device)  # a tensor, as quantize_groups divides by it
    codes, mn, step = quantize_groups(flat.view(-1, group_size).float(), counter, levels, bits, stats_dtype)
    return pack_codes_traced(codes.view(-1)[:n], bits), mn, step


def decode_traced(payload: torch.Tensor, mn: torch.Tensor, step: torch.Tensor, numel, bits: int, group_size: int,
                  dtype: torch.dtype, signs: torch.Tensor | None = None) -> torch.Tensor:
    """``dequantize_reference`` of :func:`encode_traced`'s parts as torch ops a graph can hold: a flat tensor of
    ``numel`` (maybe symbolic) elements in ``dtype``, NaN canonical, with the 1-bit ``signs`` restored as
    :func:`restore_signs` does when given. The same bits as the reference on CPU (inductor's C++ does not contract
    the multiply and the add); inductor's Triton may fuse them into one rounding on a GPU.

    Written for inductor's scheduler, eight elements at a time (``group_size`` is a multiple of 32, so a group
    holds whole runs of eight: ``bits`` payload bytes, one byte of signs): element ``t`` of each run decoded by
    shifts that are constants of the graph, and the eight interleaved by one ``stack``, the last op. A tensor of
    shifts (``arange``) was one buffer every decode of a backward read, which the scheduler then ran together as
    the backward started (the uncompressed peak); a stack before the arithmetic, or before the signs, was a
    buffer as large as the decoded tensor. Inductor's C++ writes the stack out (a concatenation there always is)
    where its Triton may fuse it into pointwise readers; a pointwise form instead (each element's shift from its
    index) compiled to scalar C++, and ResNet-50's compiled 4-bit step took 1.22-1.53x the compiled one against
    1.10x (``benchmarks/results/compiled_inline.md``)."""
    groups, per_byte, runs = mn.shape[0], 8 // bits, group_size // 8
    words = F.pad(payload.to(torch.int32), (0, groups * runs * bits - payload.shape[0])).view(groups, runs, bits)
    scale, low = step.float()[:, None], mn.float()[:, None]
    if signs is not None:
        positive = F.pad(signs.to(torch.int32), (0, groups * runs - signs.shape[0])).view(groups, runs)
        tiny = torch.finfo(dtype).tiny

    def value(t: int) -> torch.Tensor:
        codes = words[:, :, t // per_byte]
        if bits < 8:
            codes = (codes >> (t % per_byte * bits)) & ((1 << bits) - 1)
        x = (codes.float() * scale + low).to(dtype)
        if signs is not None:
            x = torch.where(((positive >> t) & 1).bool(), x.clamp(min=tiny), x.clamp(max=0.0))
        # NaN last (a clamp of NaN may return another NaN), through the integer view: a NaN constant would be cast,
        # and casts of NaN differ by device (formats.floats)
        return torch.where(torch.isnan(x), CANONICAL_NAN[dtype], x.view(INT_VIEW[dtype])).view(dtype)

    return torch.stack([value(t) for t in range(8)], dim=-1).view(-1)[:numel]


def unpack_mask_traced(payload: torch.Tensor, numel) -> torch.Tensor:
    """:func:`unpack_mask` as torch ops a graph can hold (each bit by a constant shift, one ``stack`` last, as in
    :func:`decode_traced`)."""
    words = payload.to(torch.int32)
    return torch.stack([((words >> t) & 1).bool() for t in range(8)], dim=-1).view(-1)[:numel]


def _buffer_parts(numel, bits: int, group_size: int, stats_dtype: torch.dtype) -> list[tuple[int, int]]:
    """``(offset, bytes)`` of the payload, ``mn`` and ``step`` in ``cuda.quantize.encoded_layout``'s buffer, each
    part padded to ``PART_ALIGN``, from an element count that may be symbolic (dynamic shapes), which the layout's
    cache cannot hash; the total last, as ``(total, 0)``."""
    groups = -(-numel // group_size)
    parts, offset = [], 0
    for size in (packed_nbytes(numel, bits), groups * stats_dtype.itemsize, groups * stats_dtype.itemsize):
        parts.append((offset, size))
        offset += size + (-size % PART_ALIGN)
    return parts + [(offset, 0)]


def _buffer_bytes(numel, bits: int, group_size: int, stats_dtype: torch.dtype):
    """``cuda.quantize.encoded_layout(...).total``, ``numel`` maybe symbolic."""
    return _buffer_parts(numel, bits, group_size, stats_dtype)[-1][0]


def decode_buffer_traced(buffer: torch.Tensor, numel, bits: int, group_size: int, dtype: torch.dtype,
                         stats_dtype: torch.dtype, signs: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`decode_traced` of the kernel encode's one buffer (:func:`quantize`): its parts as slices, the
    statistics viewed in their dtype."""
    (payload_at, payload_bytes), (mn_at, stats_bytes), (step_at, _), _ = _buffer_parts(numel, bits, group_size,
                                                                                        stats_dtype)
    mn, step = (buffer[at:at + stats_bytes].view(stats_dtype) for at in (mn_at, step_at))
    return decode_traced(buffer[payload_at:payload_at + payload_bytes], mn, step, numel, bits, group_size, dtype,
                         signs)


@_op("quantize(Tensor x, int bits, int group_size, ScalarType stats_dtype, int owner) -> Tensor",
     lambda x, bits, group_size, stats_dtype, owner: x.new_empty(_buffer_bytes(x.numel(), bits, group_size,
                                                                               stats_dtype), dtype=torch.uint8))
def quantize(x: torch.Tensor, bits: int, group_size: int, stats_dtype: torch.dtype, owner: int) -> torch.Tensor:
    """The flat contiguous ``x`` in the quantize format, as the one uint8 buffer the codec's kernel encode fills
    (payload, mn and step laid out by ``cuda.quantize.encoded_layout``), by the compressor ``owner`` names, each
    call a fresh noise key: where the kernels run, a compiled forward encodes with this opaque op rather than
    :func:`encode_traced`, whose graph inductor would compile and run several times more slowly (an H100 ran the
    traced pipeline at 65 GB/s, the kernel at 427, in float32). :func:`dequantize_buffer` decodes it."""
    hooks = _OWNERS.get(owner)
    kernels = hooks.kernels(bits, group_size, stats_dtype, x, x.dtype) if hooks is not None else None
    if kernels is not None:
        return kernels[0].encode(x.contiguous(), next(hooks.keys), kernels[1]).data
    codec = _format_codec(hooks, bits, group_size, stats_dtype)
    buffers = codec.encode(x, key=next(hooks.keys) if hooks is not None else 0).buffers
    if type(buffers) is OneBuffer:
        return buffers.data
    laid_out = OneBuffer.empty(encoded_layout(x.numel(), bits, group_size, stats_dtype), x.device)  # the torch path's
    for name in laid_out:
        laid_out[name].copy_(buffers[name])
    return laid_out.data


def _decoded(hooks: GraphHooks | None, out: torch.Tensor, signs: torch.Tensor | None, numel: int, dtype: torch.dtype,
             bits: int, stored: int) -> torch.Tensor:
    """A decode op's result: the signs restored (:func:`restore_signs`) and the tensor recorded."""
    if signs is not None:
        out = restore_signs(out, signs)
        stored += signs.numel()
    if hooks is not None:
        hooks.record(numel, dtype, bits, stored)
    return out


@_op("dequantize_buffer(Tensor buffer, SymInt numel, int bits, int group_size, ScalarType dtype, "
     "ScalarType stats_dtype, int owner, Tensor? signs=None) -> Tensor",
     lambda buffer, numel, bits, group_size, dtype, stats_dtype, owner, signs=None: buffer.new_empty(numel,
                                                                                                     dtype=dtype))
def dequantize_buffer(buffer: torch.Tensor, numel: int, bits: int, group_size: int, dtype: torch.dtype,
                      stats_dtype: torch.dtype, owner: int, signs: torch.Tensor | None = None) -> torch.Tensor:
    """Decode what :func:`quantize` stored, as :func:`dequantize` does the traced encode's parts."""
    hooks = _OWNERS.get(owner)
    layout = encoded_layout(numel, bits, group_size, stats_dtype)
    kernels = hooks.kernels(bits, group_size, stats_dtype, buffer, dtype) if hooks is not None else None
    if kernels is not None:
        out = kernels[0].decode(OneBuffer(buffer, layout), (numel,), dtype, kernels[1])
    else:
        codec = _format_codec(hooks, bits, group_size, stats_dtype)
        out = codec.decode(Packed("quantize", (numel,), dtype, buffer.device, OneBuffer(buffer, layout),
                                  {"bits": bits, "group_size": group_size}))
    return _decoded(hooks, out, signs, numel, dtype, bits, layout.nbytes)


@_op("dequantize(Tensor payload, Tensor mn, Tensor step, SymInt numel, int bits, int group_size, "
     "ScalarType dtype, int owner, Tensor? signs=None) -> Tensor",
     lambda payload, mn, step, numel, bits, group_size, dtype, owner, signs=None: payload.new_empty(numel, dtype=dtype))
def dequantize(payload: torch.Tensor, mn: torch.Tensor, step: torch.Tensor, numel: int, bits: int,
               group_size: int, dtype: torch.dtype, owner: int, signs: torch.Tensor | None = None) -> torch.Tensor:
    """Decode what :func:`encode_traced` stored, with the quantize codec of the compressor
    ``owner`` names (a default one when it is gone), and record it in that compressor's last step. ``signs``: the
    tensor's ``x > 0`` at 1 bit (``pack_codes_traced``), restored exactly (:func:`restore_signs`)."""
    hooks = _OWNERS.get(owner)
    codec = hooks.codec(bits) if hooks is not None else _default_codec(bits, group_size, mn.dtype)
    parts = {"payload": payload, "mn": mn, "step": step}
    out = codec.decode(Packed("quantize", (numel,), dtype, payload.device, parts, {"bits": bits,
                                                                                  "group_size": group_size}))
    return _decoded(hooks, out, signs, numel, dtype, bits, sum(b.numel() * b.element_size() for b in parts.values()))


# (device, dtype) -> the (256, 8) tables of :func:`restore_signs`' bounds for the 8 sign bits of each byte
_SIGN_BOUNDS: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}


def restore_signs(values: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """Decoded ``values`` (flat, clamped in place) made positive where the 1-bit ``signs`` say the original was
    (at least the dtype's smallest normal) and at most 0 elsewhere: a backward's ``x <= 0`` or ``x > 0`` test
    (ReLU's) reads the original's pattern exactly, and every value moves by at most what its rounding to 0 left.
    One clamp between bounds looked up a byte at a time (a select on bool flags costs five times as much on CPU),
    by chunks: a chunk's bounds are the only temporaries."""
    key = (values.device, values.dtype)
    bounds = _SIGN_BOUNDS.get(key)
    if bounds is None:
        positive = bit_rows(values.device)
        bounds = _SIGN_BOUNDS[key] = tuple(  # filled in the dtype: float64's smallest normal is 0 in float32
            torch.full(positive.shape, other, dtype=values.dtype, device=values.device).masked_fill_(positive, bound)
            for other, bound in ((-math.inf, torch.finfo(values.dtype).tiny), (0.0, math.inf)))
    # chunk_elements is a multiple of 8: each chunk starts on a byte of signs
    for start, end in spans(values.numel(), chunk_elements(values.device)):
        part = values[start:end]
        codes = signs[start // 8:(end + 7) // 8]
        torch.clamp(part, *(unpack_rows(codes, end - start, (-1,), table) for table in bounds), out=part)
        canonical_nan_(part)  # a clamp of NaN returns another NaN (all ones in float32 and float64 on CPU)
    return values


# backward ops that test a saved tensor's sign, the tensor at args[index], compared with args[threshold] == 0
_SIGN_TESTS = {_aten.le.Scalar: (0, 1), _aten.gt.Scalar: (0, 1), _aten.threshold_backward.default: (1, 2)}


def _backward_placeholder(context: dict | None) -> torch.fx.Node | None:
    """The backward graph's input node of the saved tensor the pack hook's ``context`` is about, or None where
    this torch tells nothing."""
    if context is None or "_bw_graph" not in context:
        return None
    name = context["_node"].name  # the backward's placeholder of a saved tensor has its forward node's name
    return next((p for p in context["_bw_graph"].find_nodes(op="placeholder") if p.name == name), None)


def backward_tests_sign(context: dict | None) -> bool:
    """Whether the backward graph of the pack hook's ``context`` compares the saved tensor with 0 (ReLU's
    ``threshold_backward``, decomposed to ``le(x, 0)``)."""
    placeholder = _backward_placeholder(context)
    return placeholder is not None and any(
        user.target in _SIGN_TESTS and user.args[_SIGN_TESTS[user.target][0]] is placeholder
        and user.args[_SIGN_TESTS[user.target][1]] == 0 for user in placeholder.users)


# The arguments of attention kernels' backwards (SDPA's flash, efficient, cuDNN, ...) that must come back exactly:
# an additive mask holds -inf or the dtype's lowest value beside zeros, which no quantization grid keeps (a group
# with -inf decodes to NaN, one with -3.4e38 moves its zeros by ~1e36), and the rows' log-sum-exp rescales each row
# of recomputed probabilities, exp(scores - lse), by e^-d for an error d. Both as the eager engine's SDPA rule.
_EXACT_ATTENTION_ARGUMENTS = frozenset({"attn_mask", "attn_bias", "bias", "logsumexp"})
_VIEWS = frozenset({_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default, _aten.permute.default,
                    _aten.alias.default})
_VIEWS_AND_EXPANDS = _VIEWS | {_aten.expand.default}


def backward_reads_exactly(context: dict | None) -> bool:
    """Whether the backward graph of the pack hook's ``context`` passes the saved tensor (or a view of it) to an
    attention kernel as its mask or its rows' log-sum-exp (``_EXACT_ATTENTION_ARGUMENTS``)."""
    placeholder = _backward_placeholder(context)
    nodes = [placeholder] if placeholder is not None else []
    for node in nodes:  # grows while it is walked: views of views
        for user in node.users:
            if user.target in _VIEWS_AND_EXPANDS:
                nodes.append(user)
            elif isinstance(user.target, torch._ops.OpOverload) and "attention" in user.target.name():
                named = [a.name for a, v in zip(user.target._schema.arguments, user.args) if v is node]
                named += [name for name, v in user.kwargs.items() if v is node]
                if _EXACT_ATTENTION_ARGUMENTS.intersection(named):
                    return True
    return False


# A softmax the forward graph decomposed (amax, sub, exp, sum, div), whose backward recomputes it from the saved
# logits, maximum and sum (AOTAutograd's choice where attention with dropout is decomposed, as on CPU): an error d
# in a row's maximum or logit scales its probabilities by e^-d, one in the sum by 1 / (1 + d / sum). The maximum
# and sum, or the log of the sum (a log-softmax's, as in cross-entropy), a 1 / row-length share of the logits, are
# kept exact; the logits, as large as the probabilities the eager engine stores, go at 8 bits at least
# (e^(step / 2): a few percent).
_LOGIT_OPS = frozenset({*_VIEWS_AND_EXPANDS, _aten.mul.Tensor, _aten.div.Tensor, _aten.add.Tensor, _aten.sub.Tensor,
                        _aten.where.self, _aten.clone.default, torch.ops.prims.convert_element_type.default})
_STATISTIC_FUNCTIONS = frozenset({_aten.log.default, _aten.add.Tensor, _aten.sub.Tensor, _aten.neg.default,
                                  _aten.reciprocal.default})
SOFTMAX_STATISTIC, SOFTMAX_LOGITS = "statistic", "logits"
LOGIT_BITS = 8


def _is_softmax_statistic(node: torch.fx.Node, depth: int = 3) -> bool:
    """A row maximum, a sum of exponentials, or an elementwise function of such statistics alone (the log of the
    sum: a log-softmax's log-sum-exp)."""
    if node.target == _aten.amax.default:
        return True
    if node.target == _aten.sum.dim_IntList:
        return getattr(node.args[0], "target", None) == _aten.exp.default
    inputs = [a for a in node.args if isinstance(a, torch.fx.Node)]
    return (depth > 0 and node.target in _STATISTIC_FUNCTIONS and bool(inputs)
            and all(_is_softmax_statistic(a, depth - 1) for a in inputs))


def softmax_part(node: torch.fx.Node | None) -> str | None:
    """What the forward ``node`` (a saved tensor's) is of a decomposed softmax: ``SOFTMAX_STATISTIC`` (a row
    maximum, a sum of exponentials, or the log of one), ``SOFTMAX_LOGITS`` (what the maximum is taken over, through
    views and elementwise scaling and masking), or None."""
    if node is None:
        return None
    if _is_softmax_statistic(node):
        return SOFTMAX_STATISTIC
    nodes, seen = [node], {node}
    for current in nodes:  # grows while it is walked, a few ops deep
        for user in current.users:
            if user.target == _aten.amax.default:
                return SOFTMAX_LOGITS
            if user.target in _LOGIT_OPS and user not in seen and len(seen) < 16:
                seen.add(user)
                nodes.append(user)
    return None


@_op("unpack_mask(Tensor payload, SymInt numel, int owner) -> Tensor",
     lambda payload, numel, owner: payload.new_empty(numel, dtype=torch.bool))
def unpack_mask(payload: torch.Tensor, numel: int, owner: int) -> torch.Tensor:
    """The ``numel`` flags a compiled forward packed at 1 bit (``pack_codes_traced(flags, 1)``: the ``bitmask``
    codec's layout), as bool, decoded by the compressor's ``bitmask`` codec (its kernel, one launch, where the
    kernels run; else its torch path, by chunks); recorded in the step's statistics like :func:`dequantize`."""
    hooks = _OWNERS.get(owner)
    if hooks is not None:
        hooks.record(numel, torch.bool, 1, payload.numel(), codec="bitmask")
    codec = hooks.compressor.codec("bitmask") if hooks is not None else _default_bitmask()
    return codec.decode(Packed("bitmask", (numel,), torch.bool, payload.device, {"bits": payload}))


@functools.cache
def _default_bitmask():
    from . import codecs

    return codecs.get("bitmask")


def _format_codec(hooks: GraphHooks | None, bits: int, group_size: int, stats_dtype: torch.dtype):
    """The quantize codec of an op's format: the compressor's at ``bits`` (its seed and backend) where the format
    is its own, else a default one (the op's buffer must hold the op's format, whoever encodes it)."""
    if hooks is not None:
        codec = hooks.codec(bits)
        if (codec.group_size, codec.stats_dtype) == (group_size, stats_dtype):
            return codec
    return _default_codec(bits, group_size, stats_dtype)


def _default_codec(bits: int, group_size: int, stats_dtype: torch.dtype):
    from . import codecs

    stats = next(name for name, dtype in STATS_DTYPES.items() if dtype == stats_dtype)
    return codecs.get("quantize", bits=bits, group_size=group_size, stats_dtype=stats)


def _pack(x: torch.Tensor, owner: int):
    hooks = _OWNERS[owner]
    if not is_fake(x):  # eager code: the compressor's own hook
        return hooks.pack_eager(x)
    return hooks.pack_traced(x)


def _unpack(packed, owner: int) -> torch.Tensor:
    if type(packed) is not tuple:  # what the eager hook stored
        return _OWNERS[owner].unpack_eager(packed)
    form, *parts = packed
    if form == KEPT:
        return parts[0]
    if form == BITS:
        payload, shape, inverse = parts
        flat = torch.ops.lightning_act.unpack_mask(payload, math.prod(shape), owner)
    elif form == KERNEL:
        buffer, bits, group_size, dtype, stats_dtype, shape, inverse, signs = parts
        flat = torch.ops.lightning_act.dequantize_buffer(buffer, math.prod(shape), bits, group_size, dtype,
                                                         stats_dtype, owner, signs)
    else:
        payload, mn, step, bits, group_size, dtype, shape, inverse, signs = parts
        flat = torch.ops.lightning_act.dequantize(payload, mn, step, math.prod(shape), bits, group_size, dtype,
                                                  owner, signs)
    values = flat.view(shape)
    return values if inverse is None else values.permute(inverse)


@functools.cache
def _source_hash() -> str:
    """A hash of this package's Python sources: what the traced hooks emit is decided by them."""
    package = Path(__file__).resolve().parent
    return get_hash_for_files(tuple(sorted(str(f) for f in package.rglob("*.py")))).hex()


def _hook_module(fn, owner: int, settings: tuple) -> torch.fx.GraphModule:
    """A GraphModule whose graph is ``fn(x, owner)``: AOTAutograd traces it per saved tensor (``fn`` sees fake
    tensors and emits the ops it decides on); eager autograd calls it with real ones. Its node carries a cache
    hash (the package's sources and the compressor's ``settings``), so AOTAutograd's cache may keep the compiled
    graphs across processes: a graph calling an unknown function is compiled again in every process otherwise
    (seconds to a minute per model, every run and every rank). ``owner`` is in the graph's code, so in the key."""
    graph = torch.fx.Graph()
    node = graph.call_function(fn, (graph.placeholder("x"), owner))
    node.meta.update(is_wrapped=True, user_cache_hash=f"{_source_hash()}:{settings!r}")
    graph.output(node)
    module = torch.fx.GraphModule(torch.nn.Module(), graph)
    # Called straight, past nn.Module's call machinery (a GraphModule's class is its own), and skipped by dynamo:
    # eager code of a compiled model calls the hooks while dynamo evaluates frames, and it would compile the
    # engine's hook op by op (AOTAutograd, which traces the call with fake tensors, is not dynamo).
    type(module).__call__ = torch._dynamo.disable(lambda self, x: fn(x, owner))
    return module


class GraphHooks:
    """The saved-tensor hooks a compressor installs for a model with compiled parts: ``pack`` and ``unpack``
    (GraphModules, the same objects every step: dynamo guards on their identity, and compiles again for others)."""

    def __init__(self, compressor: ActivationCompressor):
        config = compressor.config
        self._compressor = weakref.ref(compressor)
        self.owner = next(_OWNER_IDS)
        self.keys = itertools.count(1)  # noise keys of the kernel encodes (lightning_act::quantize)
        self._kernels: dict[tuple, tuple | None] = {}  # kernels()' answers
        _OWNERS[self.owner] = self
        self.bits = config.bits if compresses_in_graph(config) else None
        self.masks = config.enabled and config.compress_masks
        self.group_size, self.min_numel = config.group_size, max(config.min_numel, 1)
        self.stats_dtype = STATS_DTYPES[config.stats_dtype]
        settings = (self.bits, self.masks, self.group_size, self.min_numel, self.stats_dtype)  # pack_traced's
        self.pack = _hook_module(_pack, self.owner, settings)
        self.unpack = _hook_module(_unpack, self.owner, settings)
        install_sink_pass()

    @property
    def compressor(self) -> ActivationCompressor:
        compressor = self._compressor()
        if compressor is None:
            raise RuntimeError("the ActivationCompressor of these hooks was deleted")
        return compressor

    def pack_eager(self, x: torch.Tensor):
        compressor = self.compressor
        return compressor._pack(compressor.current_step, x)

    def unpack_eager(self, saved) -> torch.Tensor:
        return self.compressor._unpack(saved)

    def pack_traced(self, x: torch.Tensor) -> tuple:
        """What a compiled region stores for ``x`` (a fake tensor while AOTAutograd traces): ``(BITS, ...)``, a
        bool tensor's flags at 1 bit; ``(KERNEL, ...)`` (where the kernels run: the kernel encode's one buffer) or
        ``(QUANTIZE, ...)`` (the traced encode's parts), the quantize format and what the decode needs (with
        ``x > 0`` at 1 bit when the backward tests the sign: a ReLU output); or ``(KEPT, x)``."""
        takes = (x.dtype in FLOAT_DTYPES and self.bits is not None) or (x.dtype == torch.bool and self.masks)
        context = _saved_tensor_hook_context()
        order = memory_order(x, context) if takes else None
        if order is None or not self.min_numel <= x.numel() <= MAX_NUMEL:
            return KEPT, x
        bits = self.bits
        if x.dtype != torch.bool:
            part = softmax_part(context.get("_node") if context is not None else None)
            if part == SOFTMAX_STATISTIC or backward_reads_exactly(context):
                return KEPT, x
            if part == SOFTMAX_LOGITS:
                bits = max(bits, LOGIT_BITS)
        inverse = None if order == tuple(range(x.dim())) else tuple(sorted(range(x.dim()), key=order.__getitem__))
        dense = x if inverse is None else x.permute(order)
        if x.dtype == torch.bool:  # lossless: dropout's keep masks, comparisons the backward selects by
            return BITS, pack_codes_traced(dense.reshape(-1).to(torch.uint8), 1), tuple(dense.shape), inverse
        # what ReLU's backward reads of its output, exact at 1 bit (the eager engine's positive_mask)
        signs = (pack_codes_traced(dense.reshape(-1).gt(0).to(torch.uint8), 1)
                 if self.masks and backward_tests_sign(context) else None)
        shape = tuple(dense.shape)
        if self.codec(bits).runs_kernels(x):
            buffer = torch.ops.lightning_act.quantize(dense.reshape(-1), bits, self.group_size, self.stats_dtype,
                                                      self.owner)
            return KERNEL, buffer, bits, self.group_size, x.dtype, self.stats_dtype, shape, inverse, signs
        payload, mn, step = encode_traced(dense, bits, self.group_size, self.stats_dtype)
        return QUANTIZE, payload, mn, step, bits, self.group_size, x.dtype, shape, inverse, signs

    def codec(self, bits: int):
        return self.compressor.codec("quantize", bits)

    def kernels(self, bits: int, group_size: int, stats_dtype: torch.dtype, t: torch.Tensor, dtype: torch.dtype):
        """``(QuantizeKernels, runner)`` of the quantize codec at ``bits`` where its kernels encode ``t`` (or
        decode buffer ``t`` into values of ``dtype``) in this format, else None: what the compiled ops call
        straight, past the codec's per-call checks and its ``Packed`` (1.3-1.5 µs of an op call's 9-11 on this
        project's CPU).
        Looked up per format, device, dtype and installed runner (:func:`~lightning_act.cuda.launcher.use_runner`),
        as the codec's own route."""
        key = (bits, group_size, stats_dtype, t.device, dtype, runner_override())
        found = self._kernels.get(key, self)  # self: not looked up yet (None is an answer)
        if found is self:  # another format's codec is not the compressor's: its ops take the checked path
            codec = _format_codec(self, bits, group_size, stats_dtype)
            found = codec.kernel_path(t, dtype) if codec is self.codec(bits) else None
            if len(self._kernels) >= 64:  # (tests install many runners; a model meets a few devices and dtypes)
                self._kernels.clear()
            self._kernels[key] = found
        return found

    def record(self, numel: int, dtype: torch.dtype, bits: int, stored: int, codec: str = "quantize") -> None:
        """Count a tensor a compiled backward decoded in the compressor's last step (its forward has ended)."""
        step = self.compressor._last_step
        if step is not None:
            records = step.records
            records.append(TensorRecord(len(records), torch.Size((numel,)), dtype, COMPRESSED, codec, float(bits),
                                        numel * dtype.itemsize, stored, phase="compiled"))



def _sink_decodes(graph: torch.fx.Graph) -> None:
    """Move each decode node (``lightning_act::dequantize``, ``::dequantize_buffer``, ``::unpack_mask``), with the
    views of its output, right before the first node that reads them."""
    position = {node: i for i, node in enumerate(graph.nodes)}
    decodes = [node for op in (torch.ops.lightning_act.dequantize.default,
                               torch.ops.lightning_act.dequantize_buffer.default,
                               torch.ops.lightning_act.unpack_mask.default)
               for node in graph.find_nodes(op="call_function", target=op)]
    for node in decodes:
        chain = [node]
        for link in chain:  # grows while it is walked: views of views
            chain += [user for user in link.users if user.op == "call_function" and user.target in _VIEWS]
        readers = [user for link in chain for user in link.users if user not in chain]
        if not readers:
            continue
        first = min(readers, key=position.__getitem__)
        for link in sorted(chain, key=position.__getitem__):
            first.prepend(link)


# record_decoded's ints per tensor: the codec (_QUANTIZE or _BITMASK), the dtype (index in _RECORD_DTYPES), bits,
# group size, the statistics' dtype (index in _STATS_DTYPES), and whether the signs are stored beside the codes
_QUANTIZE, _BITMASK = 0, 1
_RECORD_DTYPES = (*FLOAT_DTYPES, torch.bool)
_STATS_DTYPES = tuple(STATS_DTYPES.values())
_RECORD_FIELDS = 6

@_op("record_decoded(Tensor carried, int owner, SymInt[] numels, int[] fields) -> Tensor",
     lambda carried, owner, numels, fields: torch.empty_like(carried))
def record_decoded(carried: torch.Tensor, owner: int, numels: list[int], fields: list[int]) -> torch.Tensor:
    """Count the tensors one run of a compiled backward decoded with traced ops (:func:`_inline_decodes`), in the
    statistics of the compressor ``owner`` names, as :func:`dequantize` and :func:`unpack_mask` count theirs: one
    call per graph, where the ops made one per tensor. Returns a copy of ``carried`` (a small input of one of the
    decodes, which reads the copy): an op without an output, which inductor keeps only as a side effect, had it
    free buffers before their last reader (torch 2.13's C++ kernels, "del buf" before the loop that reads buf)."""
    hooks = _OWNERS.get(owner)
    for i, numel in enumerate(numels if hooks is not None else ()):
        codec, dtype, bits, group_size, stats, signs = fields[i * _RECORD_FIELDS:(i + 1) * _RECORD_FIELDS]
        if codec == _BITMASK:
            hooks.record(numel, torch.bool, 1, packed_nbytes(numel, 1), codec="bitmask")
            continue
        stored = encoded_layout(numel, bits, group_size, _STATS_DTYPES[stats]).nbytes  # payload, mn, step
        hooks.record(numel, _RECORD_DTYPES[dtype], bits, stored + (packed_nbytes(numel, 1) if signs else 0))
    return carried.clone()


class _Decode(NamedTuple):
    """A decode op's traced replacement (:func:`_traced_decode`): ``fn(*inputs)`` computes what the op does,
    ``carried`` is the index of its smallest tensor input, ``numel`` and ``fields`` what ``record_decoded``
    counts for it."""

    node: torch.fx.Node
    fn: Callable
    inputs: tuple
    carried: int
    numel: object
    fields: tuple[int, ...]
    owner: int


def _traced_decode(node: torch.fx.Node) -> _Decode:
    """The traced replacement of the decode op ``node``, from its arguments (nodes, or ints)."""
    if node.target is torch.ops.lightning_act.unpack_mask.default:
        payload, numel, owner = node.args
        return _Decode(node, unpack_mask_traced, (payload, numel), 0, numel,
                       (_BITMASK, _RECORD_DTYPES.index(torch.bool), 1, 1, 0, 0), owner)
    if node.target is torch.ops.lightning_act.dequantize_buffer.default:
        buffer, numel, bits, group_size, dtype, stats_dtype, owner, *rest = node.args
        parts, carried = (buffer,), 0

        def decode(buffer, numel, *signs):  # (make_fx traces every parameter: no defaults)
            return decode_buffer_traced(buffer, numel, bits, group_size, dtype, stats_dtype, *signs)
    else:
        payload, mn, step, numel, bits, group_size, dtype, owner, *rest = node.args
        parts, carried, stats_dtype = (payload, mn, step), 1, mn.meta["val"].dtype

        def decode(payload, mn, step, numel, *signs):
            return decode_traced(payload, mn, step, numel, bits, group_size, dtype, *signs)
    signs = rest[0] if rest else node.kwargs.get("signs")

    fields = (_QUANTIZE, _RECORD_DTYPES.index(dtype), bits, group_size, _STATS_DTYPES.index(stats_dtype),
              int(signs is not None))
    inputs = (*parts, numel, *([signs] if signs is not None else []))
    if signs is not None and carried == 0:  # the buffer holds the codes: the signs are smaller
        carried = len(inputs) - 1
    return _Decode(node, decode, inputs, carried, numel, fields, owner)


def _inline_decodes(graph: torch.fx.Graph) -> None:
    """Replace each decode node (``lightning_act::dequantize``, ``::dequantize_buffer``, ``::unpack_mask``) with the
    torch ops that compute it, in its place, and count them all with one ``record_decoded`` call per compressor
    and graph, which passes the first decode's smallest input through: a compiled backward then runs no Python
    per saved tensor, and inductor fuses each decode into one loop, or into the op that reads it. Where this
    torch's internals refuse (its tracing helpers moved), the ops stay, with a warning: the same values, one Python
    call each."""
    from torch._inductor.pattern_matcher import fwd_only
    from torch._inductor.virtualized import V

    nodes = [node for op in (torch.ops.lightning_act.dequantize.default,
                             torch.ops.lightning_act.dequantize_buffer.default,
                             torch.ops.lightning_act.unpack_mask.default)
             for node in graph.find_nodes(op="call_function", target=op)]
    traced = []
    for node in nodes:
        try:
            decode = _traced_decode(node)
            with V.fake_mode:
                traced.append((decode, fwd_only(decode.fn, torch.fx.map_arg(decode.inputs, lambda a: a.meta["val"]))))
        except Exception as error:  # noqa: BLE001 -- another torch's internals: the ops compute the same
            _warn_once(f"lightning_act: compiled backwards decode saved tensors through one Python call each: "
                       f"tracing the decode failed on torch {torch.__version__} ({type(error).__name__}: {error})")
            return
    position = {node: i for i, node in enumerate(graph.nodes)}
    carriers = {}  # owner -> the decode that carries the count: the first after every symbolic size it counts
    for owner in {decode.owner for decode, _ in traced}:
        decodes = sorted((d for d, _ in traced if d.owner == owner), key=lambda d: position[d.node])
        sizes = max((position[d.numel] for d in decodes if isinstance(d.numel, torch.fx.Node)), default=-1)
        carriers[owner] = next((d for d in decodes if position[d.node] > sizes), decodes[-1])
    for decode, replacement in traced:
        inputs = list(decode.inputs)
        with graph.inserting_before(decode.node):
            if carriers[decode.owner] is decode:
                counted = [d for d, _ in traced if d.owner == decode.owner]
                inputs[decode.carried] = graph.call_function(torch.ops.lightning_act.record_decoded.default, (
                    inputs[decode.carried], decode.owner, [d.numel for d in counted],
                    [field for d in counted for field in d.fields]))
            placeholders = replacement.graph.find_nodes(op="placeholder")
            out = graph.graph_copy(replacement.graph, dict(zip(placeholders, inputs)))
        decode.node.replace_all_uses_with(out)
        graph.erase_node(decode.node)


@functools.cache
def _warn_once(message: str) -> None:
    warn_user(message, RuntimeWarning)


def install_sink_pass() -> None:
    """Make :class:`SinkDecodes` inductor's post-grad pass, running after any pass the user set (once per process:
    a backward compiles lazily, after the forward's configuration context has ended)."""
    current = inductor_config.post_grad_custom_post_pass
    before = tuple(current) if isinstance(current, (list, tuple)) else () if current is None else (current,)
    if not any(isinstance(p, SinkDecodes) for p in before):
        # one pass, never a tuple: torch 2.11's inductor takes a single post-grad pass
        inductor_config.post_grad_custom_post_pass = SinkDecodes(before)


class SinkDecodes(CustomGraphPass):
    """Inductor post-grad pass: each decode of a compiled region's saved tensor runs right before its first
    reader (:func:`_sink_decodes`), so the backward holds one decoded activation at a time. ``before``: the passes
    it found set, run first."""

    def __init__(self, before: tuple = ()):
        self.before = before

    def __call__(self, graph: torch.fx.Graph) -> None:
        for custom_pass in self.before:
            custom_pass(graph)
        _sink_decodes(graph)
        _inline_decodes(graph)

    def uuid(self) -> bytes | None:
        # None (inductor then compiles without its cache) when a pass run first has no uuid: as for that pass alone
        ids = [p.uuid() if isinstance(p, CustomGraphPass) else None for p in self.before]
        return None if None in ids else get_hash_for_files((__file__,), extra=repr(ids))
