"""The compression engine: a ``saved_tensors_hooks`` pair that compresses what autograd saves for backward.

``torch.autograd.graph.save_on_cpu`` is the primitive this grows from: the pack hook receives every tensor an
op saves, the unpack hook gives it back in backward. Between them the policy here decides what each saved
tensor is (parameter, index, mask, activation), stores each storage once, keeps autograd's in-place check,
and records the step's statistics.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import math
import threading
from typing import Callable, ContextManager, Iterator, NamedTuple, Protocol

import torch
from torch import nn

from . import codecs, module_tree, rng
from ._validate import check_type
from .codecs import op_rules
from .codecs.base import Codec, Packed
from .codecs.negative_infinity import NegativeInfinityMask
from .config import ACTConfig, resolve_config
from .optrack import FunctionTracker
from .side_stream import SideStreamEncoder
from .swap import SwapHandle, SwapStore
from .stats import COMPRESSED, DUPLICATE, KEPT, PARAMETER, CompressionStats, TensorRecord

# grad_fn names (without their numeric suffix) of ops that only view or cast their single input: walking
# through them from a saved tensor to an AccumulateGrad means it is a parameter seen through a view or cast
# (``Linear`` saves ``weight.t()``; autocast saves a fresh bf16 copy of the weight).
_VIEW_OR_CAST_FNS = frozenset({
    "TBackward", "ToCopyBackward", "ViewBackward", "PermuteBackward", "TransposeBackward", "ExpandBackward",
    "UnsafeViewBackward", "AliasBackward", "SliceBackward", "SelectBackward", "UnsqueezeBackward",
    "SqueezeBackward", "AsStridedBackward", "ReshapeAliasBackward", "NumpyTBackward", "CloneBackward",
})
_MAX_VIEW_DEPTH = 6
# The compressor whose compress() context is active in this thread (checkpoints recompute under it).
_ACTIVE = threading.local()


def active_compressor() -> "ActivationCompressor | None":
    """The ``ActivationCompressor`` whose ``compress()`` is active in this thread, if any."""
    return getattr(_ACTIVE, "compressor", None)


class _FnKinds(dict):
    """grad_fn class -> True (AccumulateGrad), False (a view or cast: walk on) or None (anything else), filled as
    classes are met: the pack hook compares class objects, one lookup each, instead of names."""

    def __missing__(self, cls: type) -> bool | None:
        name = cls.__name__
        if name == "AccumulateGrad":
            kind = self[cls] = True
        else:
            kind = self[cls] = False if name.rstrip("0123456789") in _VIEW_OR_CAST_FNS else None
        return kind


_FN_KINDS = _FnKinds()


class _IsCopy(dict):
    """grad_fn class -> whether it is ``ToCopyBackward0`` (a dtype cast's node), filled as classes are met."""

    def __missing__(self, cls: type) -> bool:
        found = self[cls] = cls.__name__ == "ToCopyBackward0"
        return found


_IS_COPY = _IsCopy()


def _derives_from_leaf(t: torch.Tensor) -> bool:
    """True when ``t`` is a leaf that requires grad, or a chain of views/casts of one."""
    fn = t.grad_fn
    base = t._base
    if fn is None:
        # a view made where autograd records nothing (a custom Function's forward) is a parameter's only when its
        # base is one
        return t.requires_grad if base is None else base.grad_fn is None and base.requires_grad
    if base is not None and _FN_KINDS[type(fn)] is False:
        # a view's history up to its base is view ops: start at the base (one step, not one per view op)
        fn = base.grad_fn
        if fn is None:
            return base.requires_grad
    for _ in range(_MAX_VIEW_DEPTH):
        kind = _FN_KINDS[type(fn)]
        if kind is not False:
            return bool(kind)
        inputs = [f for f, _ in fn.next_functions if f is not None]
        if len(inputs) != 1:
            return False
        fn = inputs[0]
    return False


class _ParameterCast:
    """What stands for a saved dtype cast of a parameter (autocast's bfloat16 copy of a weight, or a view of it):
    nothing is held; the unpack casts the parameter again, the same bits while the parameter is unchanged (its
    version is checked, as autograd checks the weight a float32 ``Linear`` saves)."""

    __slots__ = ("dtype",)

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def decode(self, parameter: torch.Tensor) -> torch.Tensor:
        return parameter.to(self.dtype)


class _ParameterCasts(dict):
    def __missing__(self, dtype: torch.dtype) -> _ParameterCast:
        cast = self[dtype] = _ParameterCast(dtype)
        return cast


_PARAMETER_CASTS = _ParameterCasts()


def _recastable(parameter, copy: torch.Tensor, own_storages: frozenset[int], reordered: bool = False) -> bool:
    """Whether casting ``parameter`` again gives ``copy`` (its dtype cast: the same device, shape and layout; or,
    ``reordered``, a cast of a view of the whole parameter, see :func:`_whole_reordering`), and the parameter's
    memory is the model's own (``own_storages``: FSDP's unsharded copies are freed after the forward and gathered
    again, a new version, before the backward)."""
    return (type(parameter) is nn.Parameter and parameter.device == copy.device and parameter.dtype != copy.dtype
            and (reordered or (parameter.shape == copy.shape and parameter.stride() == copy.stride()))
            and parameter.untyped_storage().data_ptr() in own_storages)


def _whole_reordering(parameter: torch.Tensor, copy: torch.Tensor) -> bool:
    """Whether ``copy``, the dtype cast of a dense view of the whole contiguous ``parameter`` (a transpose or
    permutation: ``x @ w.t()`` reads one), holds the parameter's elements in the parameter's own storage order.
    The cast keeps the view's strides, so the parameter cast again and seen through the saved tensor's geometry
    is that copy."""
    return parameter.is_contiguous() and copy.storage_offset() == 0 and copy.numel() == parameter.numel()


# the view functions between a parameter and autocast's copy of it that leave its storage order alone
_REORDERING_VIEWS = frozenset({"TBackward0", "TransposeBackward0", "PermuteBackward0"})


def _cast_parameter(t: torch.Tensor, own_storages: frozenset[int]) -> torch.Tensor | None:
    """The parameter ``t`` is autocast's cast of (or a view into such a cast; or of a transpose or permutation of
    the whole parameter), when :func:`_recastable`."""
    base = t if t._base is None else t._base
    fn = base.grad_fn
    if fn is None or type(fn).__name__ != "ToCopyBackward0" or len(fn.next_functions) != 1:
        return None
    source = fn.next_functions[0][0]
    parameter = getattr(source, "variable", None)
    if parameter is not None:
        return parameter if _recastable(parameter, base, own_storages) else None
    if type(source).__name__ not in _REORDERING_VIEWS or len(source.next_functions) != 1:
        return None
    parameter = getattr(source.next_functions[0][0], "variable", None)
    reordered = parameter is not None and _whole_reordering(parameter, base)
    return parameter if reordered and _recastable(parameter, base, own_storages, reordered=True) else None


def _frozen_weight_cast(t: torch.Tensor, call, own_storages: frozenset[int]) -> torch.Tensor | None:
    """The frozen weight (``requires_grad=False``) ``t`` is autocast's copy of (or a view into it), saved by the
    tracked ``call`` (``F.linear``, a convolution, a matrix product), when :func:`_recastable`: such a call saves
    nothing else without autograd history (its input is saved only for the weight's gradient). A product's weight
    may be a view of the whole parameter (``w.t()``, :func:`_whole_reordering`)."""
    position = op_rules.WEIGHT_ARGUMENT.get(call.func) if call is not None else None
    if position is None:
        return None
    weight = call.args[position] if len(call.args) > position else call.kwargs.get("weight")
    if not isinstance(weight, torch.Tensor) or weight.requires_grad:
        return None
    base = t if t._base is None else t._base
    parameter = weight._base
    if parameter is None:
        return weight if _recastable(weight, base, own_storages) else None
    reordered = (weight.storage_offset() == parameter.storage_offset() and weight.shape == base.shape
                 and weight.stride() == base.stride() and _whole_reordering(parameter, base))
    return parameter if reordered and _recastable(parameter, base, own_storages, reordered=True) else None


def _cast_source(t: torch.Tensor, fn, call) -> torch.Tensor | None:
    """The argument of the tracked ``call`` (a Linear, a matrix product, a convolution) whose copy in another dtype
    ``t`` is, or a view of it: autocast's copy of the op's input (``ToCopyBackward0``, under at most one view, fed by
    the argument's own autograd edge). Each such op casts again, so a hidden state read by three projections (a
    transformer's query, key and value) is saved as three equal copies; else None."""
    node = fn
    if not _IS_COPY[type(node)]:
        edges = node.next_functions
        node = edges[0][0] if edges else None
        if node is None or not _IS_COPY[type(node)]:
            return None
    producer, output_nr = node.next_functions[0]
    if producer is None:
        return None
    for arg in call.args:
        if type(arg) is torch.Tensor and arg.grad_fn is producer and arg.output_nr == output_nr \
                and arg.dtype != t.dtype:
            return arg
    return None


def _cast_again(parameter: torch.Tensor, t: torch.Tensor) -> "_Saved":
    """What autograd holds for ``t``, a cast of ``parameter`` (or a view of one): the parameter, cast again at unpack
    into ``t``'s view geometry, its version checked."""
    return _new_saved((parameter, parameter._version, t.shape, None, parameter, None, _PARAMETER_CASTS[t.dtype],
                       (t.shape, t.stride(), t.storage_offset()), None, 0, None))


@functools.cache
def _takes_backend(cls: type) -> bool:
    """Whether codec class ``cls`` is built with a ``backend`` (it has kernels to run or not)."""
    return "backend" in inspect.signature(cls).parameters


def _parameters_and_buffers(model: nn.Module) -> list[torch.Tensor]:
    """What ``model.parameters()`` and ``model.buffers()`` list together (shared ones possibly twice), read at
    every step from the cached module list (:mod:`lightning_act.module_tree`)."""
    tensors = []
    for module in module_tree.modules(model):
        tensors += [t for t in module._parameters.values() if t is not None]
        tensors += [t for t in module._buffers.values() if t is not None]
    return tensors


def _local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this process holds: a DTensor's local shard (FSDP2's sharded parameters), else ``t``
    (read at every step for every parameter: a plain tensor's type answers before an attribute miss would)."""
    return t if type(t) is nn.Parameter or type(t) is torch.Tensor else getattr(t, "_local_tensor", t)


# The storage every version alias points at: an alias keeps a saved tensor's version counter, not its memory.
_NO_STORAGE = torch.empty(0)


def _version_alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor sharing ``t``'s version counter but none of its memory.

    ``detach()`` shares the counter and assigning ``.data`` swaps the storage without bumping it, so nothing
    autograd or another thread can observe on ``t`` changes. (``set_`` bumps the shared counter: a tensor saved
    by two threads at once, such as one input batch fed to several replicas, then failed autograd's own
    "pack hook is modifying its input in place" check in the other thread.)"""
    alias = t.detach()
    alias.data = _NO_STORAGE
    return alias


# The decode of autocast's copies of one input, stored once (a transformer's query, key and value projections each
# cast the hidden state; without compression each holds its own copy until its backward): [unpacks still to come,
# the decoded tensor or None], shared by those saves (a list: built with no Python frame). The first unpack keeps its
# decode there for the others, the last drops it; an unpack after the count ran out (a second backward with
# retain_graph) decodes again. Other saves of one storage decode at each unpack: a bounded node that saves a chunk
# twice unpacks it at two points of its backward and must not hold it in between.
_READERS, _DECODED = 0, 1


class _Saved(NamedTuple):
    """What autograd holds for one saved tensor between forward and backward (a named tuple: one is built per saved
    tensor, by :data:`_new_saved` without a Python frame).

    ``watched`` is the tensor whose version counter autograd's in-place check reads: the saved tensor itself
    when it is kept, else a :func:`_version_alias` of it (``None``: not checked). ``side``: the side-stream
    encoder that encoded it (``ticket``: which encode), or ``None``."""

    watched: torch.Tensor | None
    version: int  # of the saved tensor when it was saved
    shape: torch.Size
    tensor: torch.Tensor | None = None  # kept as it is
    packed: Packed | None = None  # compressed form of the tensor (of its shape), or of its whole storage (flat)
    swapped: "SwapHandle | None" = None  # ... or that form moved to host memory
    codec: Codec | None = None
    geometry: tuple | None = None  # (size, stride, storage_offset) of a view into a compressed storage
    side: SideStreamEncoder | None = None
    ticket: int = 0
    shared: list | None = None  # of a compressed autocast copy: [readers, decoded tensor], shared by its copies

    def version_error(self) -> None:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: a saved tensor of shape {list(self.shape)} is at version {self.watched._version}; "
            f"expected version {self.version} instead (lightning_act keeps autograd's in-place check)"
        )


# Built from a tuple of all eleven (or all twelve) fields in the hot path: tuple.__new__ runs no Python frame.
_new_saved = functools.partial(tuple.__new__, _Saved)
_new_record = functools.partial(tuple.__new__, TensorRecord)


class _StorageRef:
    """A weak reference to a storage: tells whether it was freed (its data pointer may then be reused)."""

    __slots__ = ("cdata",)
    _free = torch.UntypedStorage._free_weak_ref  # kept here: ``torch`` may be torn down first at exit

    def __init__(self, storage: torch.UntypedStorage):
        self.cdata = storage._weak_ref()

    def expired(self) -> bool:
        return torch.UntypedStorage._expired(self.cdata)

    def __del__(self) -> None:
        self._free(self.cdata)


def _kept(t: torch.Tensor, watch: bool = True) -> _Saved:
    return _Saved(t if watch else None, t._version, t.shape, t)


class _Step:
    """Bookkeeping of one forward under ``compress()``, or of a checkpoint's recomputation in its backward
    (``phase="recompute"``, sharing the records of the step that ran the forward). The hooks are bound to their
    step, so steps of different threads never share state."""

    def __init__(self, number: int, param_storages: set[int], records: list[TensorRecord] | None = None,
                 phase: str = "forward"):
        self.number = number
        self.noise_base = rng.mix32(number)  # noise key of saved tensor i: noise_base ^ i (default policy)
        # data pointers of storages saved tensors are parameters of; integrations add the weights they
        # materialise during the forward (lightning_act.fsdp: FSDP's all-gathered parameters)
        self.param_storages = param_storages
        self.own_storages = frozenset(param_storages)  # the model's, before integrations add theirs in the forward
        self.records: list[TensorRecord] = [] if records is None else records
        self.phase = phase
        self.tracker: FunctionTracker | None = None
        self.floors: dict[int, op_rules.MinimumBits] = {}  # saved-tensor index -> what an op rule asked for it
        # (storage ptr, dtype, version, memory range or view geometry) -> [weak reference to the storage, or None
        # where a kept tensor holds it alive; {codec name (None: kept), or the codec of a rule's in-range copy:
        # _Saved of its first save}]: what is stored of each range, once per codec, and counted once in the step's
        # original bytes (a ReLU output stored as its mask and as the next layer's values counts once)
        self.stored: dict[tuple, list] = {}


def _covered_storage_numel(t: torch.Tensor, storage: torch.UntypedStorage) -> int:
    """For a non-contiguous ``t`` (whose storage is ``storage``): the element count of that storage when ``t`` covers
    most of it, else 0. A memory-order codec then compresses the whole storage, flat (channels_last and other
    permuted layouts, stride-0 expansions and transposes cost their real storage, and views of one storage are
    stored once, under the key of the contiguous tensor filling it); otherwise a contiguous copy of ``t``."""
    nbytes = storage.nbytes()
    itemsize = t.element_size()
    storage_numel = nbytes // itemsize
    return storage_numel if nbytes % itemsize == 0 and 0 < storage_numel <= 2 * t.numel() else 0


def _flat_storage(t: torch.Tensor, storage: torch.UntypedStorage, numel: int) -> torch.Tensor:
    """The ``numel`` elements of ``storage`` in memory order, as a flat tensor of ``t``'s dtype."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, (numel,))


class ModelPreparation(Protocol):
    """What a compressor does to its model besides the hooks (BLPA blocks, checkpoint routing, chunked
    attention, warnings): registered with :func:`register_model_preparation`, so the engine knows none of it."""

    def prepare(self, compressor: "ActivationCompressor") -> None:
        """Once, when ``compressor`` is built."""

    def forward_context(self, compressor: "ActivationCompressor") -> ContextManager[None]:
        """Entered around every forward under ``compressor.compress()``."""


_MODEL_PREPARATIONS: list[ModelPreparation] = []


def register_model_preparation(preparation: ModelPreparation) -> None:
    """Run ``preparation`` for every compressor built from now on (``lightning_act.model_prep`` registers at
    import of the package)."""
    _MODEL_PREPARATIONS.append(preparation)


def _geometry(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.storage_offset()


POLICY_SLOTS = ("bits", "codec", "noise")


class PolicyHandle:
    """Policies one :meth:`ActivationCompressor.install_policy` call installed; ``remove()`` (or leaving a
    ``with`` block) takes them out. Removing twice does nothing."""

    def __init__(self, compressor: "ActivationCompressor", policies: dict[str, Callable | None]):
        self.compressor = compressor
        self.policies = dict(policies)
        self.removed = False

    def remove(self) -> None:
        self.removed = True
        self.compressor._remove_policy(self)

    def __enter__(self) -> "PolicyHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def _policy_slot(slot: str, doc: str) -> property:
    """A read-only policy attribute: assigning it raises with the way to install one."""
    def get(self: "ActivationCompressor") -> Callable | None:
        return self._policies[slot]

    def refuse(self: "ActivationCompressor", value: object) -> None:
        raise AttributeError(f"ActivationCompressor.{slot}_policy is read-only: use "
                             f"handle = compressor.install_policy({slot}=...), and handle.remove() to restore "
                             "the previous one")

    return property(get, refuse, doc=doc)


class ActivationCompressor:
    """Compress the tensors autograd saves during the forward passes run inside :meth:`compress`.

    >>> compressor = ActivationCompressor(model, ACTConfig(bits=4))
    >>> with compressor.compress():
    ...     loss = model(x).sum()
    >>> loss.backward()
    >>> compressor.stats().ratio

    Only the forward needs the context: each saved tensor carries its own unpack hook into backward.
    With ``config.blpa_bits`` set, building the compressor converts the model's BatchNorm -> ReLU -> Conv/Linear
    runs into BLPA blocks (``blpa_blocks`` says how many); the parameters stay the same objects, so optimizers
    built before keep working.

    Threads: torch's saved-tensor hooks are per thread, and so are ``compress()`` steps. Several threads may run
    ``compress()`` on one compressor at once (replicas of one model): each such forward is a step of its own,
    with its own step number (so its own stochastic-rounding noise) and records; :meth:`stats` returns the
    calling thread's last completed step. The policies (``bits_policy``, ``codec_policy``, ``noise_policy``)
    are shared: install and change them (auto-precision rounds, error-bound refreshes) from one thread.

    Policies are read-only here; :meth:`install_policy` sets them and its handle's ``remove()`` restores them:
    per-tensor bits for saved tensor ``(index, tensor)`` (auto-precision), a per-tensor codec (per-layer error
    bounds), and the random-stream key for ``(step number, saved-tensor index)``; ``None`` (a slot's value, or
    what a policy returns): the configured default, fresh noise every step.
    """

    def __init__(self, model: nn.Module | None = None, config: ACTConfig | str | dict | None = None):
        check_type("model", model, nn.Module, "an nn.Module or None", optional=True)
        self.model = model
        self.config = resolve_config(config)
        self._codecs: dict[tuple[str, int | None], Codec] = {}
        self._infinity_masks: dict[Codec, Codec] = {}  # codec -> it with a -inf mask (_negative_infinity_mask)
        self._rule_codecs: dict[int, tuple[Codec, Codec]] = {}  # id -> (op rule's codec, on the config's backend)
        # Installed policies (install_policy), oldest first; _policies: each slot's value from the newest of them.
        self._policy_handles: list[PolicyHandle] = []
        self._policies: dict[str, Callable | None] = dict.fromkeys(POLICY_SLOTS)
        self._step_lock = threading.Lock()  # step numbers are handed out once each, whichever thread asks
        self._step_number = 0
        self._last_step: _Step | None = None  # last completed step of any thread
        self._thread = threading.local()  # .step: running in this thread; .last: its last completed step
        self.swap_store: SwapStore | None = SwapStore() if self.config.swap else None
        self.side_stream: SideStreamEncoder | None = SideStreamEncoder() if self.config.side_stream else None
        self.blpa_blocks = 0  # set by the BLPA conversion (lightning_act.model_prep)
        # set for a model with torch.compile'd parts (lightning_act.model_prep): hooks compiled graphs inline
        self.graph_hooks = None
        for preparation in _MODEL_PREPARATIONS:
            preparation.prepare(self)

    # ---- public API -------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def compress(self) -> Iterator["ActivationCompressor"]:
        """Context around the forward pass; the backward may run after it exits."""
        if self.current_step is not None:
            raise RuntimeError("ActivationCompressor.compress() is already active in this thread; it cannot be "
                               "nested")
        with self._step_lock:
            number = self._step_number
            self._step_number += 1
        step = _Step(number, self._model_storages())
        outer_active = getattr(_ACTIVE, "compressor", None)
        _ACTIVE.compressor = self
        try:
            with self._model_contexts(), self._hooks(step):
                yield self
        finally:
            _ACTIVE.compressor = outer_active
            if self.swap_store is not None:
                self.swap_store.end_step(step.number)
            self._last_step = self._thread.last = step

    @contextlib.contextmanager
    def _model_contexts(self) -> Iterator[None]:
        """The registered model preparations' contexts around one forward."""
        with contextlib.ExitStack() as stack:
            for preparation in _MODEL_PREPARATIONS:
                stack.enter_context(preparation.forward_context(self))
            yield

    @contextlib.contextmanager
    def recompute(self, step: "_Step") -> Iterator[None]:
        """Hooks for a checkpoint's recomputation during backward: what it saves is compressed too and
        recorded in ``step``'s statistics (``phase="recompute"``)."""
        with self._hooks(_Step(step.number, step.param_storages, step.records, phase="recompute")):
            yield

    @contextlib.contextmanager
    def _hooks(self, step: "_Step") -> Iterator[None]:
        outer = self.current_step
        self._thread.step = step
        # (not around compiled parts: dynamo would compile the tracker's own frames, op by op)
        if self.config.enabled and op_rules.OP_RULES and self.graph_hooks is None:
            step.tracker = FunctionTracker(op_rules.tracked_functions(self.config.compress_masks),
                                           op_rules.OP_REPLACEMENTS)
        try:
            with contextlib.ExitStack() as stack:
                if step.tracker is not None:
                    stack.enter_context(step.tracker)
                graph_hooks = self.graph_hooks  # in eager code they run this thread's current step's hooks
                if graph_hooks is None:
                    hooks = (functools.partial(_eager_call, self._pack, step),
                             functools.partial(_eager_call, self._unpack))
                else:
                    hooks = (graph_hooks.pack, graph_hooks.unpack)
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(*hooks))
                yield
        finally:
            self._thread.step = outer
            step.tracker = None
            step.stored.clear()  # the de-dup table must not keep saved tensors alive past the forward

    @property
    def current_step(self) -> "_Step | None":
        """The step whose forward (or recomputation) runs in this thread (what a checkpoint needs to record
        its recomputation)."""
        return getattr(self._thread, "step", None)

    def minimum_bits(self, index: int) -> int | None:
        """The least bits an op rule asked for saved tensor ``index`` of this thread's current step
        (:class:`~lightning_act.codecs.op_rules.MinimumBits`), or None: known when the engine asks a ``bits_policy``
        about that tensor, which may then count what will be stored (auto-precision does)."""
        step = getattr(self._thread, "step", None)
        floor = step.floors.get(index) if step is not None else None
        return floor.bits if floor is not None and floor.bits else None  # (0: a floor of range or infinities only)

    def stats(self) -> CompressionStats:
        """Statistics of this thread's last completed ``compress()`` step (of any thread's, when this one ran
        none), including tensors that checkpoints saved while recomputing in its backward."""
        step = getattr(self._thread, "last", None) or self._last_step
        if step is None:
            return CompressionStats()
        return CompressionStats.from_records(step.records)

    @property
    def step_number(self) -> int:
        """How many ``compress()`` steps have started (all of them completed when none is running)."""
        return self._step_number

    @contextlib.contextmanager
    def detached_steps(self) -> Iterator[None]:
        """Steps run inside leave no trace: the step counter, the last step's statistics and the policies are
        put back on exit (auto-precision's probe passes must not shift the real steps' noise keys)."""
        saved = (self._step_number, self._last_step, getattr(self._thread, "last", None))
        handles = list(self._policy_handles)
        self._thread.detached = getattr(self._thread, "detached", 0) + 1
        try:
            yield
        finally:
            self._thread.detached -= 1
            self._step_number, self._last_step, self._thread.last = saved
            for handle in self._policy_handles:
                if handle not in handles:
                    handle.removed = True  # installed inside and left there: taken out with the steps
            self._set_policy_handles([h for h in handles if not h.removed])

    @property
    def in_detached_steps(self) -> bool:
        """Whether this thread runs inside :meth:`detached_steps` (auto-precision's probes): what watches the
        training steps (the error-bound controller's statistics) skips them."""
        return getattr(self._thread, "detached", 0) > 0

    def install_policy(self, **policies: Callable | None) -> "PolicyHandle":
        """Install policies for some of the slots ``bits``, ``codec`` and ``noise`` (``None`` installs the
        default) over what is there; returns a handle whose ``remove()`` (or the end of a ``with`` block around
        it) takes them out again, restoring each slot to the newest policy still installed, or the default::

            with compressor.install_policy(noise=lambda step, index: index):
                ...

        Nested installs shadow the outer ones slot by slot; removing a handle twice does nothing."""
        unknown = sorted(set(policies) - set(POLICY_SLOTS))
        if unknown:
            raise TypeError(f"install_policy got unknown slot(s) {', '.join(unknown)}; expected some of "
                            f"{', '.join(POLICY_SLOTS)}")
        for slot, policy in policies.items():  # else it fails at the first saved tensor, inside autograd's hook
            if policy is not None and not callable(policy):
                raise TypeError(f"install_policy({slot}={policy!r}); expected a callable or None")
        handle = PolicyHandle(self, policies)
        self._set_policy_handles(self._policy_handles + [handle])
        return handle

    def _remove_policy(self, handle: "PolicyHandle") -> None:
        self._set_policy_handles([h for h in self._policy_handles if h is not handle])

    def _set_policy_handles(self, handles: list["PolicyHandle"]) -> None:
        policies = dict.fromkeys(POLICY_SLOTS)
        for handle in handles:
            policies.update(handle.policies)
        self._policy_handles, self._policies = handles, policies  # replaced whole: a reader sees old or new

    bits_policy = _policy_slot("bits", "Bits for saved tensor ``(index, tensor)``, or ``None`` (the default).")
    codec_policy = _policy_slot("codec", "Codec for saved tensor ``(index, tensor)``, or ``None`` (the default).")
    noise_policy = _policy_slot("noise", "Random-stream key for ``(step number, saved-tensor index)``.")

    # ---- policy -------------------------------------------------------------------------------------------
    def _model_storages(self) -> set[int]:
        if self.model is None:
            return set()
        tensors = _parameters_and_buffers(self.model)
        return {t.untyped_storage().data_ptr() for t in map(_local_tensor, tensors)
                if t.layout == torch.strided and torch._C._has_storage(t)}

    def codec_for(self, index: int, t: torch.Tensor, minimum_bits: int | None = None, in_range: bool = False,
                  row: int = 0) -> Codec:
        """The codec for float or bool saved tensor number ``index`` of the step: the lossless codec registered
        for its dtype (1 bit for bool tensors), else the ``codec_policy``'s, else the configured codec at the bits
        the ``bits_policy`` assigns; raised to ``minimum_bits`` where an op rule asks for it, in a codec that keeps
        values within their group's range with ``in_range``, with groups that tile rows of ``row`` elements
        (:class:`~lightning_act.codecs.op_rules.MinimumBits`): the greatest common divisor of the row and the
        codec's group size, where that is a group size (a multiple of 32)."""
        dtype_codec = codecs.dtype_codec(t.dtype)
        if dtype_codec is not None:
            return self.codec(dtype_codec)
        policies = self._policies
        codec = policies["codec"](index, t) if policies["codec"] is not None else None
        if codec is None:
            bits = policies["bits"](index, t) if policies["bits"] is not None else None
            codec = self.codec(self.config.codec, bits)
        if minimum_bits is not None and not _holds_bits(codec, minimum_bits, in_range):
            codec = self.codec(codec.name if "bits" in codec.config_fields else "quantize", minimum_bits or None)
        if row and not _tiles(codec, row) and (group := math.gcd(row, codec.group_size)) % 32 == 0:
            return self.codec(codec.name, codec.bits, group)
        return codec

    def noise_key(self, index: int, step: "_Step | None" = None) -> int:
        """Random-stream key of saved tensor ``index`` in ``step`` (default: this thread's current step)."""
        step = step or self.current_step
        policy = self._policies["noise"]
        if policy is not None:
            return policy(step.number, index)
        return step.noise_base ^ index

    def codec(self, name: str, bits: int | None = None, group_size: int | None = None) -> Codec:
        """Codec ``name``, built once per compressor: the configured codec with the config's options, ``bits``
        overriding the config's (auto-precision, the memory-budget planner) and ``group_size`` (a normalisation's
        rows); any other codec with its defaults."""
        key = (name, bits, group_size)
        codec = self._codecs.get(key)
        if codec is None:
            options = self.config.codec_kwargs() if name == self.config.codec else {}
            if name != self.config.codec and _takes_backend(codecs.codec_class(name)):
                options["backend"] = self.config.backend  # the lossless codecs' kernels follow the config too
            if bits is not None:
                options["bits"] = bits
            if group_size is not None:
                options["group_size"] = group_size
            codec = self._codecs[key] = codecs.get(name, **options)
        return codec

    def _negative_infinity_mask(self, codec: Codec) -> Codec:
        """``codec`` with the ``-inf`` of its input masked at 1 bit (an op rule's ``MinimumBits(infinities=True)``),
        built once per codec."""
        masked = self._infinity_masks.get(codec)
        if masked is None:
            masked = self._infinity_masks[codec] = NegativeInfinityMask(codec, self.config.backend)
        return masked

    def _on_config_backend(self, codec: Codec) -> Codec:
        """``codec`` (an op rule's choice: the rules hand out shared instances) on this compressor's ``backend``,
        when it is a codec with kernels to choose about."""
        if not _takes_backend(type(codec)):
            return codec
        found = self._rule_codecs.get(id(codec))
        if found is None:  # the original is kept beside its variant, so its id is never reused
            variant = copy.copy(codec)
            variant.backend, variant._routes = self.config.backend, None
            found = self._rule_codecs[id(codec)] = (codec, variant)
        return found[1]

    @staticmethod
    def _record(step, index, t, kind, codec, bits, original, stored, reason="", offloaded=False,
                error_bound=None) -> None:
        step.records.append(TensorRecord(index, t.shape, t.dtype, kind, codec, bits, original, stored, reason,
                                         step.phase, offloaded, error_bound))

    def _keep(self, step: "_Step", index: int, t: torch.Tensor, reason: str, nbytes: int, watch=True) -> _Saved:
        shape = t.shape
        step.records.append(_new_record((index, shape, t.dtype, KEPT, "none", 8.0 * t.element_size(), nbytes, nbytes,
                                         reason, step.phase, False, None)))
        return _new_saved((t if watch else None, t._version, shape, t, None, None, None, None, None, 0, None))

    def _pack(self, step: "_Step", t: torch.Tensor) -> _Saved:
        # The hot path (every saved tensor): attribute reads and identity tests first, each check once, one table
        # lookup, and no torch op beyond the codec's own, the version alias and the storage's weak reference.
        records = step.records
        index = len(records)
        kind = type(t)
        if t.layout is not torch.strided:
            return self._pack_sparse(step, index, t)
        if (kind is not torch.Tensor and kind is not nn.Parameter) or t.is_meta:
            if _derives_from_leaf(t):  # a DTensor parameter (FSDP2 with tensor parallelism) or a view of one
                self._record(step, index, t, PARAMETER, "none", 8.0 * t.element_size(), 0, 0)
                return _kept(t, watch=False)
            return self._keep(step, index, t, f"{kind.__name__} on {t.device.type}", 0, watch=False)
        shape, dtype, version = t.shape, t.dtype, t._version
        storage = None if kind is nn.Parameter else t.untyped_storage()
        fn = t.grad_fn  # an op's output (the common activation) needs no walk to a leaf
        if storage is None or storage.data_ptr() in step.param_storages or (
                (fn is None or _FN_KINDS[type(fn)] is not None) and _derives_from_leaf(t)):
            records.append(_new_record((index, shape, dtype, PARAMETER, "none", 8.0 * t.element_size(), 0, 0, "",
                                    step.phase, False, None)))
            if fn is not None and (parameter := _cast_parameter(t, step.own_storages)) is not None:
                # autocast's copy, cached for the rest of the autocast region: the backward casts again, so the
                # copy lives only as long as the op that made it (BERT-base: about 160 MiB of bf16 weights)
                torch.clear_autocast_cache()
                return _cast_again(parameter, t)
            return _new_saved((t, version, shape, t, None, None, None, None, None, 0, None))
        if fn is None and step.tracker is not None and not t.requires_grad and (
                parameter := _frozen_weight_cast(t, step.tracker.current, step.own_storages)) is not None:
            records.append(_new_record((index, shape, dtype, PARAMETER, "none", 8.0 * t.element_size(), 0, 0, "",
                                        step.phase, False, None)))
            return _cast_again(parameter, t)
        ptr = storage.data_ptr()

        contiguous = t.is_contiguous()
        if contiguous:
            # its own memory range, read in place: the chunks of a split, saved one by one, are stored apart
            covered, numel = 0, t.numel()
            key = (ptr, dtype, version, t.storage_offset(), numel)
        else:  # in memory order: its whole storage where it covers most of it, else a contiguous copy
            covered = _covered_storage_numel(t, storage)
            numel = covered or t.numel()
            key = (ptr, dtype, version, 0, covered) if covered else (ptr, dtype, version, _geometry(t))
        codec, reason = self._decide(step, index, t, numel)
        geometry = None  # of t in the decoded unit, where the unit is its storage
        if codec is None:
            if contiguous:
                storage_numel = storage.nbytes() // t.element_size()
                if numel < storage_numel <= 2 * numel:
                    # kept, a part holds its whole storage alive: counted once with the storage's other parts (an
                    # edge_index saved whole and as its two rows), as the views that cover most of a storage are
                    key, numel = (ptr, dtype, version, 0, storage_numel), storage_numel
        elif codec.logical_layout:
            # the codec reads the tensor's own shape (planes, pooling windows), not its storage in memory order
            key = (ptr, dtype, version, _geometry(t))
        elif covered:
            geometry = _geometry(t)
        owner = storage  # whose liveness tells that ``key`` still names the same values
        call = step.tracker.current if codec is not None and step.tracker is not None else None
        if call is not None and fn is not None and call.func in op_rules.WEIGHT_ARGUMENT and (
                source := _cast_source(t, fn, call)) is not None:
            # autocast's copy of an op's input: keyed by its source, so the equal copies other ops make of it (a
            # transformer's query, key and value projections) are stored once
            owner = source.untyped_storage()
            key = ("cast", owner.data_ptr(), source._version, source.storage_offset(), source.shape, source.stride(),
                   dtype, t.storage_offset(), shape, t.stride())
        name = slot = codec.name if codec is not None else None  # a mask and the values of one storage differ
        stored = step.stored
        entry = stored.get(key)
        if entry is not None and (entry[0] is None or not entry[0].expired()):
            first = entry[1].get(name)
            if first is not None and first.codec is not None and (floor := step.floors.get(index)) is not None and \
                    not _serves(first.codec, floor):
                # a rule asked for a codec that keeps ranges or for groups within rows (op_rules.MinimumBits) and an
                # earlier save took one that does not (a softmax's output under lorenzo, which a log then saves):
                # stored apart. (One that does serves: a log and a softmax reading the same rounding cancel it out.)
                slot = codec
                first = entry[1].get(slot)
            if first is not None:
                # an autocast copy is a storage of its own without compression: counted as original bytes
                copied = numel * t.element_size() if owner is not storage else 0
                records.append(_new_record((index, shape, dtype, DUPLICATE, name or "none", 0.0, copied, 0,
                                            "autocast copy" if copied else "", step.phase, False, None)))
                if first.tensor is not None:
                    return _new_saved((t, version, shape, t, None, None, None, None, None, 0, None))
                shared = first.shared
                if shared is not None:
                    shared[_READERS] += 1
                return _new_saved((_version_alias(t), version, shape, None, first.packed, first.swapped, first.codec,
                                   geometry, first.side, first.ticket, shared))
            original = 0  # the same range under another codec: the step's original bytes hold it once
        else:
            entry = None
            original = numel * t.element_size()
        if codec is None:
            saved = self._keep(step, index, t, reason, original)
        else:
            # what the codec reads, built only now: a duplicate or a kept tensor needs no copy or storage view
            unit = t
            if not (contiguous or codec.logical_layout):
                unit = _flat_storage(t, storage, covered) if covered else t.contiguous()
            policy = self._policies["noise"]
            noise = step.noise_base ^ index if policy is None else policy(step.number, index)  # noise_key()
            side = self.side_stream
            if side is not None and codec.side_stream_safe and side.takes(unit):
                packed, ticket = side.encode(codec, unit, noise)
            else:
                packed, side, ticket = codec.encode(unit, key=noise), None, 0
            nbytes, swapped = packed.nbytes, None
            if self.swap_store is not None and step.phase == "forward":  # recomputed tensors live briefly
                swapped, packed = self.swap_store.put(step.number, index, packed), None
            record = _new_record((index, shape, dtype, COMPRESSED, name, codec.bits_per_element(unit, packed),
                                  original, nbytes, "", step.phase, swapped is not None, codec.error_bound))
            records.append(record)
            if codec.shrinks_later and packed is not None:
                packed.on_resize = functools.partial(_record_resize, records, record)
            saved = _new_saved((_version_alias(t), version, shape, None, packed, swapped, codec, geometry, side,
                                ticket, None if owner is storage else [1, None]))
        if entry is None:  # a kept tensor holds its storage alive; else a weak reference tells a freed one
            stored[key] = [None if saved.tensor is not None else _StorageRef(owner), {slot: saved}]
        else:
            entry[1][slot] = saved
        return saved

    def _pack_sparse(self, step: "_Step", index: int, t: torch.Tensor) -> _Saved:
        """Kept as it is, counted once per step (a GNN's adjacency is saved by every layer)."""
        parts = _sparse_parts(t)
        key = ("sparse", t.layout, tuple(t.shape)) + tuple(x.untyped_storage().data_ptr() for x in parts)
        if key in step.stored:  # held alive by the kept tensor of its first save
            self._record(step, index, t, DUPLICATE, "none", 0.0, 0, 0)
            return _kept(t, watch=False)
        nbytes = sum(x.numel() * x.element_size() for x in parts)
        saved = self._keep(step, index, t, "sparse", nbytes, watch=False)
        if parts:
            step.stored[key] = [None, {None: saved}]
        return saved

    def _decide(self, step: "_Step", index: int, t: torch.Tensor, numel: int) -> tuple[Codec | None, str]:
        """The codec for an activation whose unit has ``numel`` elements, or ``None`` and the reason it is kept as
        it is."""
        config = self.config
        if not config.enabled:
            if config.swap and t.is_floating_point() and numel >= max(config.min_numel, 1):
                return self.codec("none"), ""  # swap the uncompressed tensor
            return None, "codec 'none'"
        codec = minimum_bits = None
        in_range = infinities = False
        row = 0
        tracker = step.tracker
        if tracker is not None and numel >= config.min_numel:
            # the saving function's rule first: it may store masks or indices losslessly, or ask for precision
            call = tracker.current
            rule = op_rules.OP_RULES.get(call.func) if call is not None else None
            if rule is not None:
                codec = rule(t, call)
                if type(codec) is op_rules.MinimumBits:
                    step.floors[index] = codec
                    codec, minimum_bits, in_range, infinities, row = (None, codec.bits, codec.in_range,
                                                                      codec.infinities, codec.row)
                elif codec is not None and codec.backend != config.backend:
                    codec = self._on_config_backend(codec)
        dtype = t.dtype
        if codec is None:
            if dtype is torch.bool:
                if not config.compress_masks:
                    return None, "mask compression off"
            elif not t.is_floating_point():
                return None, f"{dtype} values"
            if numel < max(config.min_numel, 1):
                return None, f"fewer than min_numel={config.min_numel} elements"
            codec = self.codec_for(index, t, minimum_bits, in_range, row)
            if infinities and not (codec.lossless or codec.keeps_infinities):
                codec = self._negative_infinity_mask(codec)
        if codec.dtypes is not None and dtype not in codec.dtypes:
            # a dtype the codec cannot take is kept exactly, never an error inside autograd's hook
            return None, f"{dtype} not taken by codec {codec.name!r}"
        return codec, ""

    @staticmethod
    def _unpack(saved: _Saved) -> torch.Tensor:
        watched = saved.watched
        if watched is not None and watched._version != saved.version:
            saved.version_error()
        if saved.tensor is not None:
            return saved.tensor
        shared = saved.shared
        out = shared[_DECODED] if shared is not None else None
        if out is None:
            packed = saved.packed if saved.packed is not None else saved.swapped.fetch()
            # in the shape of what was encoded: the tensor, or its storage (flat)
            out = saved.codec.decode(packed) if saved.side is None else \
                saved.side.decode(saved.codec, packed, saved.ticket)
            if shared is not None and shared[_READERS] > 1:
                shared[_DECODED] = out
        if shared is not None:
            shared[_READERS] -= 1
            if shared[_READERS] <= 0:
                shared[_DECODED] = None
        if saved.geometry is not None:
            size, stride, offset = saved.geometry
            return out.as_strided(size, stride, offset)
        return out if out.shape == saved.shape else out.view(saved.shape)


@torch._dynamo.disable
def _eager_call(hook: Callable, *args):
    """``hook(*args)`` where dynamo never compiles it. Autograd calls the hooks from code dynamo evaluates frames
    in (between graph breaks of a model compiled where the compressor cannot see it: ``torch.compile(model)`` around
    the module it was built on); it compiled the engine's hook op by op there, for every saved tensor's shape
    (minutes a step). Skipped, a call costs about 0.5 µs more (0.54 against 0.08 on this project's CPU)."""
    return hook(*args)


def _holds_bits(codec: Codec, bits: int, in_range: bool = False) -> bool:
    """Whether ``codec`` keeps at least ``bits`` per element of precision: lossless and error-bounded codecs do
    (their bound is the user's choice), a quantizing one at ``bits`` or more, no other lossy one. ``in_range``:
    and each value within its group's range (``Codec.keeps_range``)."""
    if codec.lossless:
        return True
    if in_range and not codec.keeps_range:
        return False
    if codec.error_bound is not None:
        return True
    own = getattr(codec, "bits", None)
    return own is not None and own >= bits


def _tiles(codec: Codec, row: int) -> bool:
    """Whether ``codec``'s groups (a quantizing codec's; others have none) each lie within one row of ``row``."""
    group = getattr(codec, "group_size", None)
    return codec.lossless or group is None or row % group == 0


def _serves(codec: Codec, floor: "op_rules.MinimumBits") -> bool:
    """Whether a form ``codec`` stored serves a save whose op rule asked for ``floor``'s range and rows."""
    return codec.lossless or ((codec.keeps_range or not floor.in_range) and (not floor.row or _tiles(codec, floor.row)))


def _record_resize(records: list[TensorRecord], record: TensorRecord, nbytes: int) -> None:
    """A compressed form shrank after its record was made (``Codec.shrinks_later``): its stored bytes and bits per
    element become the new size's. Runs once per form, off the pack hook."""
    position = record.index if record.index < len(records) and records[record.index] is record else next(
        i for i, r in enumerate(records) if r is record)
    bits = record.bits * nbytes / record.stored_bytes if record.stored_bytes else record.bits
    records[position] = record._replace(stored_bytes=nbytes, bits=bits)


def _sparse_parts(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if t.layout == torch.sparse_coo:
        return (t._indices(), t._values())
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return (t.crow_indices(), t.col_indices(), t.values())
    if t.layout in (torch.sparse_csc, torch.sparse_bsc):
        return (t.ccol_indices(), t.row_indices(), t.values())
    return ()
