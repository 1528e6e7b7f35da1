"""The codec interface: ``encode(tensor) -> Packed`` and ``decode(Packed) -> tensor`` with exact stored bytes."""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch

from ..cuda.launcher import KernelRunner, OneBuffer, default_runner, runner_override
from . import backend

_MAX_ROUTES = 64


@dataclass
class Packed:
    """A compressed tensor: the buffers it stores and what is needed to rebuild the original.

    ``buffers`` holds every tensor the compressed form keeps alive (payload, per-group statistics, ...): a dict,
    or a :class:`~lightning_act.cuda.launcher.OneBuffer` (the parts as views of one allocation, built on first
    access); ``nbytes`` is their exact total, the number the engine reports as stored bytes. A codec whose forms
    shrink after encode (``Codec.shrinks_later``) calls ``on_resize(nbytes)`` when one does.
    """

    codec: str
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    buffers: Mapping[str, torch.Tensor]
    meta: dict[str, Any] = field(default_factory=dict)
    on_resize: Callable[[int], None] | None = field(default=None, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        if type(self.buffers) is OneBuffer:
            return self.buffers.nbytes
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Packed":
        """The same compressed form with its buffers on ``device`` (used by CPU swap)."""
        if type(self.buffers) is OneBuffer:
            moved = self.buffers.to(device, non_blocking)
        else:
            moved = {k: v.to(device, non_blocking=non_blocking) for k, v in self.buffers.items()}
        return Packed(self.codec, self.shape, self.dtype, self.device, moved, dict(self.meta))


class Codec(ABC):
    """One compression technique. Subclasses set ``name`` and register with :func:`lightning_act.codecs.register`."""

    name: ClassVar[str]
    lossless: ClassVar[bool] = False
    # Absolute bound on |x - decode(encode(x))| the codec guarantees per element (error-bounded codecs), else None.
    error_bound: float | None = None
    # The dtypes ``encode`` takes (None: any); the engine keeps tensors of other dtypes exactly.
    dtypes: ClassVar[frozenset[torch.dtype] | None] = None
    # False: the codec reads its input in memory order, so the engine may hand it a whole storage (channels_last
    # and other permuted layouts, views) flattened. True: it reads the tensor's own shape (planes, pooling
    # windows) and gets the saved tensor as it is, any strides; ``decode`` then returns it contiguous.
    logical_layout: ClassVar[bool] = False
    # The ``ACTConfig`` fields passed to the constructor when the config names this codec (``ACTConfig.codec``);
    # ``ACTConfig.codec_options`` gives any other constructor argument.
    config_fields: ClassVar[tuple[str, ...]] = ()
    # Whether ``encode`` may run on a side CUDA stream (``ACTConfig(side_stream=True)``): all its device work is
    # queued on the current stream and nothing it keeps on the host refers to that stream's progress.
    side_stream_safe: ClassVar[bool] = True
    # Whether a form's ``nbytes`` may fall after ``encode`` returns (lorenzo's lazy trim on CUDA): the codec then
    # calls the form's ``on_resize`` with its new size.
    shrinks_later: ClassVar[bool] = False
    # Whether every decoded value lies between the least and the greatest input value of its group, so positive
    # values stay positive: what a backward divides by or takes a logarithm's derivative of needs it
    # (``op_rules.MinimumBits(in_range=True)``). Quantize's grid does; division's residuals and lorenzo's zeros
    # under its bound do not.
    keeps_range: ClassVar[bool] = False
    # Whether -inf and +inf decode as themselves (lossless codecs' do; lorenzo stores them raw): what a masked
    # logit's log-softmax saves needs it (``op_rules.MinimumBits(infinities=True)``). Quantize's and division's
    # grids turn a group or plane holding one into NaN.
    keeps_infinities: ClassVar[bool] = False
    # Whether the codec stores any tensor of its dtypes, so that ``ACTConfig.codec`` may name it. False: it holds
    # only what one op saves (a ReLU output's signs, dropout noise, max-pool indices, a bool mask) and is chosen
    # by that op's rule: as the codec of every activation it would silently store the wrong values.
    general: ClassVar[bool] = True

    @abstractmethod
    def encode(self, x: torch.Tensor, *, key: int = 0) -> Packed:
        """Compress ``x``. ``key`` selects the random stream (stochastic codecs): same key, same bits."""

    @abstractmethod
    def decode(self, packed: Packed) -> torch.Tensor:
        """Rebuild a contiguous tensor of the original shape, dtype and device."""

    backend: str = "torch"  # "auto", "torch" or "cupy" (lightning_act.codecs.backend), for codecs with kernels

    def kernels_take(self, dtype: torch.dtype) -> bool:
        """Whether this codec's CUDA kernels handle its format for values of ``dtype`` (codecs without kernels:
        never)."""
        return False

    def runs_kernels(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
        """Whether encoding ``t`` (or decoding buffer ``t`` into values of ``dtype``) runs the kernels rather than
        the format's torch reference: :func:`lightning_act.codecs.backend.uses_kernels` decides, once per device,
        dtype and installed runner (:func:`~lightning_act.cuda.launcher.use_runner`); codecs ask for every saved
        tensor, so later answers are a lookup."""
        dtype = dtype or t.dtype
        routes = self._routes
        key = (t.device, dtype, runner_override())
        if routes is not None and key in routes:
            return routes[key]
        uses = backend.uses_kernels(self.backend, t, self.kernels_take(dtype))  # raises on a bad device: never kept
        if routes is None or len(routes) >= _MAX_ROUTES:
            routes = self._routes = {}  # (tests install many runners; a model meets a few devices and dtypes)
        routes[key] = uses
        return uses

    _routes: dict | None = None  # (device, dtype, installed runner) -> runs_kernels, per instance

    def kernel_runner(self, t: torch.Tensor, dtype: torch.dtype) -> KernelRunner | None:
        """The runner that launches this codec's kernels on ``t`` when :meth:`runs_kernels`, else ``None``."""
        return default_runner() if self.runs_kernels(t, dtype) else None

    def bits_per_element(self, x: torch.Tensor, packed: Packed | None = None) -> float:
        """Payload bits per element of ``x`` (for statistics; ``packed``, its encoding, for codecs whose size
        depends on the data); subclasses refine it."""
        return 8.0 * x.element_size()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"
