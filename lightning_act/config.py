"""``ACTConfig``: the one configuration object, with GACT's optimisation levels (Table 1) as presets.

=====  ======================================================  ====  ==========================================
level  what it does                                            bits  fields it sets
=====  ======================================================  ====  ==========================================
L0     no compression (saved tensors kept as they are)          32    codec="none", adaptive=False
L1     per-group quantization with auto-precision: per-tensor    4    codec="quantize", adaptive=True
       bits from sensitivities, ``bits`` on average
L2     L1 + swap to host memory with prefetch                    4    swap=True
CB1    L1 + gradient checkpointing (compressed inputs and        4    checkpointing=True
       recomputed tensors)
CB2    CB1 + memory-efficient (chunked) self-attention           4    checkpointing=True, efficient_attention=True
=====  ======================================================  ====  ==========================================

``L0`` with ``swap=True`` is GACT's uncompressed "swap" baseline; ``adaptive=False`` keeps every tensor at the
fixed ``bits``.

GACT's auto-precision needs extra forward/backward passes on the user's batch (every ``adapt_interval`` steps):
the Lightning strategies add an ``AutoPrecision`` callback for them when ``adaptive`` (automatic optimization);
in plain PyTorch call ``AutoPrecision(compressor).maybe_adapt(step, forward_backward_fn)``. Until a first
estimate exists, and without either, tensors get the fixed ``bits``.
"""
from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any

from . import codecs
from ._validate import check_choice, check_int, check_positive_float, parse_bytes
from .codecs.backend import BACKENDS
from .codecs.quantize import ALLOWED_BITS
from .formats.quantize import STATS_DTYPES

LEVELS = ("L0", "L1", "L2", "CB1", "CB2")
_OFF = {"swap": False, "checkpointing": False, "efficient_attention": False}
_L1 = {"codec": "quantize", "bits": 4}
# What each level sets when the user leaves the field unset (None).
_LEVEL_PRESETS: dict[str, dict[str, Any]] = {
    "L0": {"codec": "none", "bits": 32, "adaptive": False, **_OFF},
    "L1": {**_L1, **_OFF},
    "L2": {**_L1, **_OFF, "swap": True},
    "CB1": {**_L1, **_OFF, "checkpointing": True},
    "CB2": {**_L1, **_OFF, "checkpointing": True, "efficient_attention": True},
}


@dataclass(frozen=True)
class ACTConfig:
    """How saved activations are compressed.

    The fields fall in three groups. The level and the engine: ``opt_level``, ``min_numel``, ``compress_masks``,
    ``blpa_bits``, ``bounded_cnn``, ``bounded_ffn``, ``swap``, ``checkpointing``, ``efficient_attention``. The
    codec: ``codec`` and its options, given by the fields its class lists in ``config_fields`` (``bits``,
    ``group_size``, ``stats_dtype``, ``seed``, ``backend``, ``error_bound``) and any other constructor argument in
    ``codec_options``. Auto-precision: ``adaptive``, ``adapt_interval``, ``bit_budget``, ``adapt_fraction``,
    ``alert_ratio``. The memory-budget mode: ``memory_budget``.

    Args:
        opt_level: GACT optimisation level, one of ``LEVELS`` (see the module table). Unset fields take the
            level's preset.
        codec: codec for float activations (``act.codecs.general()``: the op-specific masks are the op rules'
            choice); ``None`` = the level's.
        bits: bits per element for ``quantize`` (1, 2, 4, 8, 16, 32); ``None`` = the level's. With ``adaptive``,
            the average (the default ``bit_budget``) and the bits of tensors not yet estimated.
        adaptive: GACT auto-precision (per-tensor bits from estimated sensitivities) for ``quantize``; ``None`` =
            on for the compressing levels when the codec is ``quantize`` and no ``memory_budget`` is set, off
            otherwise.
        group_size: elements per quantization group (multiple of 32).
        stats_dtype: dtype of per-group statistics, ``"float32"`` or ``"bfloat16"``.
        min_numel: tensors with fewer elements are kept as they are (compressing them costs more than it saves).
        compress_masks: store what a backward reads only as a pattern losslessly: boolean saved tensors (dropout
            and attention masks) and ReLU outputs at 1 bit, max-pool indices in the fewest bits of the window.
            These choices come from the op rules (:mod:`lightning_act.codecs.op_rules`); ``False`` turns these
            off and tracks only the functions of the rules that keep gradients right (values a backward compares
            or divides by kept exact, log-probabilities at 8 bits or more, SDPA's padding masks and log-sum-exp
            stored losslessly, masked logits' -inf kept), which apply either way.
        blpa_bits: ``4`` or ``8`` replaces each BatchNorm -> ReLU -> Conv/Linear run of ``nn.Sequential``
            children by BLPA's block (exact forward, ``blpa_bits`` sign-preserving codes for backward) when the
            compressor is built, its state dict keys kept; ``None`` (default) leaves the model as it is.
        bounded_cnn: during each compressed forward, Conv2d -> BatchNorm2d (-> ReLU) runs of ``nn.Sequential``
            children and ``lightning_act.models``' residual merges run with backwards that hold two full
            tensors plus batch chunks (:func:`lightning_act.nn.convert_bounded_cnn`, undone when the forward
            ends); off by default.
        bounded_ffn: during each compressed forward, Linear -> elementwise activation pairs (HuggingFace's
            ``BertIntermediate`` and its copies, consecutive ``nn.Sequential`` children) run as one node whose
            backward holds the incoming and the outgoing gradient plus row chunks instead of the whole decoded
            pre-activation and its gradient (:func:`lightning_act.nn.convert_bounded_ffn`, undone when the forward
            ends); off by default.
        seed: seed of the counter-based stochastic-rounding noise.
        backend: ``"auto"`` (CuPy kernels for CUDA tensors when CuPy imports, else torch), ``"torch"``, ``"cupy"``,
            or ``"compile"`` (the quantize and division torch paths through ``torch.compile``: same bits, fused
            loops; needs a C++ compiler on CPU, Triton on CUDA).
        error_bound: absolute error bound for error-bounded codecs (``lorenzo``); refused beside a codec that
            takes none, where it would bound nothing.
        codec_options: other constructor arguments of the codec, e.g. ``{"block_size": 4, "bits": 4}`` for
            ``division`` (names the codec's constructor does not take are refused).
        swap: move compressed activations to host memory in forward, prefetch them in backward (L2).
        checkpointing: checkpoint HuggingFace layers with compressed inputs and recomputation (CB1, CB2).
        efficient_attention: chunked self-attention in HuggingFace models, memory linear in length (CB2).
        side_stream: encode CUDA tensors on a side stream, overlapping the forward's next ops
            (:mod:`lightning_act.side_stream`); off by default until measured on GPUs. Not with ``swap``.
        adapt_interval: auto-precision re-estimates tensor sensitivities every this many steps.
        bit_budget: average bits per element auto-precision allocates (GACT's adaptive 4/3/2 bit), in [1, 32];
            ``None`` = ``bits``. Tensors an op rule keeps at 8 bits or more (log-probabilities) count in it.
        adapt_fraction: share of the tensors re-estimated per round after the first, full one (round robin),
            in (0, 1].
        alert_ratio: auto-precision warns when the estimated compression variance exceeds this multiple of
            the gradient's sampling variance (raise ``bit_budget`` then).
        memory_budget: peak memory of a training step, in bytes or as a size such as ``"6GiB"``; the
            memory-budget planner (:mod:`lightning_act.adapt.memory_budget`) then chooses per block among keeping,
            quantizing at 8/4/2 bits, checkpointing and swapping to meet it at the least estimated time cost,
            on the first training batch. Stored as bytes. ``None`` (default): no budget.
    """

    opt_level: str = "L1"
    codec: str | None = None
    bits: int | None = None
    adaptive: bool | None = None
    group_size: int = 256
    stats_dtype: str = "float32"
    min_numel: int = 4096
    compress_masks: bool = True
    blpa_bits: int | None = None
    bounded_cnn: bool = False
    bounded_ffn: bool = False
    seed: int = 0
    backend: str = "auto"
    error_bound: float | None = None
    codec_options: dict[str, Any] = field(default_factory=dict, hash=False)
    swap: bool | None = None
    checkpointing: bool | None = None
    efficient_attention: bool | None = None
    side_stream: bool = False
    adapt_interval: int = 1000
    bit_budget: float | None = None
    adapt_fraction: float = 1.0
    alert_ratio: float = 1.0
    memory_budget: int | str | None = None

    def __post_init__(self) -> None:
        check_choice("opt_level", self.opt_level, LEVELS)
        for name, value in _LEVEL_PRESETS[self.opt_level].items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        check_choice("codec", self.codec, codecs.general())
        check_choice("bits", self.bits, ALLOWED_BITS)
        if self.memory_budget is not None:
            object.__setattr__(self, "memory_budget", parse_bytes("memory_budget", self.memory_budget))
            if self.opt_level == "L0":
                raise ValueError(f"memory_budget={self.memory_budget} plans compression; got opt_level='L0' (no "
                                 "compression): choose opt_level='L1'")
        if self.adaptive is None:
            object.__setattr__(self, "adaptive", self.codec == "quantize" and self.memory_budget is None)
        check_choice("adaptive", self.adaptive, (True, False))
        if self.adaptive and self.codec != "quantize":
            raise ValueError(f"adaptive=True allocates bits of the 'quantize' codec; got codec={self.codec!r} "
                             "(use codec='quantize', or adaptive=False)")
        if self.opt_level == "L0" and (self.codec != "none" or self.bits != 32):
            raise ValueError(
                f"opt_level='L0' means no compression; got codec={self.codec!r}, bits={self.bits}: "
                "choose opt_level='L1' to compress"
            )
        check_int("group_size", self.group_size, minimum=32, multiple_of=32)
        check_choice("stats_dtype", self.stats_dtype, STATS_DTYPES)
        check_int("min_numel", self.min_numel, minimum=0)
        for flag in ("compress_masks", "bounded_cnn", "bounded_ffn", "swap", "checkpointing", "efficient_attention",
                     "side_stream"):
            check_choice(flag, getattr(self, flag), (True, False))
        if self.side_stream and self.swap:
            raise ValueError(f"side_stream=True encodes on a side stream that swap=True's copies do not wait for; got "
                             f"opt_level={self.opt_level!r} with swap=True: choose one")
        check_choice("blpa_bits", self.blpa_bits, (None, 4, 8))
        check_int("seed", self.seed, minimum=0)
        check_choice("backend", self.backend, BACKENDS)
        if self.error_bound is not None:
            check_positive_float("error_bound", self.error_bound)
            bounded = [name for name in codecs.available() if "error_bound" in codecs.codec_class(name).config_fields]
            if self.codec not in bounded:  # it would bound nothing: said, not silently dropped
                raise ValueError(f"error_bound={self.error_bound!r} is the bound of an error-bounded codec "
                                 f"({', '.join(map(repr, bounded))}); got codec={self.codec!r}, which takes none: "
                                 f"choose codec={bounded[0]!r} or drop error_bound")
        check_int("adapt_interval", self.adapt_interval, minimum=1)
        if self.bit_budget is not None:
            _check_number_in("bit_budget", self.bit_budget, 1.0, 32.0, "a number in [1, 32]")
        _check_number_in("adapt_fraction", self.adapt_fraction, 0.0, 1.0, "a number in (0, 1]", open_low=True)
        check_positive_float("alert_ratio", self.alert_ratio)
        self._check_codec_options()

    def _check_codec_options(self) -> None:
        if not isinstance(self.codec_options, dict):
            raise ValueError(f"codec_options={self.codec_options!r}; expected a dict of {self.codec} constructor "
                             "arguments")
        object.__setattr__(self, "codec_options", dict(self.codec_options))  # the caller's dict stays theirs
        cls = codecs.codec_class(self.codec)
        allowed = [name for name in inspect.signature(cls).parameters if name not in cls.config_fields]
        unknown = sorted(set(self.codec_options) - set(allowed))
        if unknown:
            takes = f"some of {', '.join(map(repr, allowed))}" if allowed else "no codec_options"
            raise ValueError(f"codec_options has {', '.join(map(repr, unknown))}, which codec {self.codec!r} does "
                             f"not take; expected {takes} (the others "
                             f"are ACTConfig fields: {', '.join(cls.config_fields)})")
        if self.enabled:
            codecs.get(self.codec, **self.codec_kwargs())  # bad option values fail here, not in the first forward

    @property
    def enabled(self) -> bool:
        """Whether any saved tensor is compressed at all."""
        return self.codec != "none"

    def replace(self, **changes: Any) -> "ACTConfig":
        """A copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)

    def codec_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``codecs.get(self.codec, ...)``: the fields the codec takes from the config (those
        left unset, ``None``, keep the codec's defaults) and ``codec_options``."""
        cls = codecs.codec_class(self.codec)
        fields = {name: getattr(self, name) for name in cls.config_fields if getattr(self, name) is not None}
        return {**fields, **self.codec_options}


def _check_number_in(field: str, value: Any, low: float, high: float, rule: str, open_low: bool = False) -> None:
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    if not ok or not (low < value <= high if open_low else low <= value <= high):
        raise ValueError(f"{field}={value!r}; expected {rule}")


def resolve_config(spec: "ACTConfig | str | dict[str, Any] | None") -> ACTConfig:
    """Turn a config, a level name (``"L0"``, ``"l1"``, ...), a dict of fields or ``None`` into an ``ACTConfig``."""
    if spec is None:
        return ACTConfig()
    if isinstance(spec, ACTConfig):
        return spec
    if isinstance(spec, str):
        level = spec.upper()
        check_choice("opt_level", level, LEVELS)
        return ACTConfig(opt_level=level)
    if isinstance(spec, dict):
        fields = [f.name for f in dataclasses.fields(ACTConfig)]
        unknown = sorted(set(spec) - set(fields), key=str)
        if unknown:  # (a YAML or a Trainer argument: say what is allowed, not just what is not)
            raise ValueError(f"config has {', '.join(map(repr, unknown))}, which ACTConfig does not take; expected "
                             f"some of {', '.join(fields)}")
        return ACTConfig(**spec)
    raise TypeError(f"config={spec!r}; expected an ACTConfig, a level name ({', '.join(LEVELS)}), a dict or None")
