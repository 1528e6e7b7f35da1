"""Per-tensor gradient sensitivity (GACT Algorithm 1) and the gradient's own sampling variance.

Saved tensors are identified across steps by :class:`TensorKey`: their pack order within the step, checked
against shape and dtype. A *layout* is the tuple of keys of the tensors the ``quantize`` codec compressed at
bits the engine asked the ``bits_policy`` for (kept, masked, de-duplicated or op-rule tensors are not in it).

Algorithm 1 with a shared baseline: one pass ``g0`` with every tensor's stochastic-rounding noise fixed, then
one pass per probed tensor ``l`` with only ``l``'s noise key changed: ``c_l = ||g0 - g_l||^2 / (2 S(b_l))``.
That is ``L + 1`` forward/backward passes for ``L`` tensors (GACT's code spends ``3L``). Every pass starts from
the same RNG state and BatchNorm buffers (so dropout masks and batch statistics match) and all of it -
gradients, buffers, RNG, the compressor's step counter, statistics and policies - is restored afterwards.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
from torch import nn

from .. import rng
from ..engine import ActivationCompressor
from ..stats import COMPRESSED
from .allocation import variance_factor

# A tensor allocated 32 bits is lossless (S = 0): it is probed at this many bits instead.
PROBE_MAX_BITS = 8
_PROBE_SALT = 0x5EED_AC7
_CHANGED_KEY = 0x8000_0001


@dataclass(frozen=True)
class TensorKey:
    """Identity of one saved tensor across steps: pack order within the step, shape and dtype; and the least bits
    an op rule asks for it (:class:`~lightning_act.codecs.op_rules.MinimumBits`: stored at that many bits whatever
    it is allocated, so the allocation counts them), or None."""

    index: int
    shape: tuple[int, ...]
    dtype: str
    minimum_bits: int | None = None

    @classmethod
    def of(cls, index: int, t: torch.Tensor, minimum_bits: int | None = None) -> "TensorKey":
        return cls(index, tuple(t.shape), str(t.dtype).removeprefix("torch."), minimum_bits)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


Layout = tuple[TensorKey, ...]


class LayoutRecorder:
    """Records which saved tensors of the current step the engine asked a ``bits_policy`` about, and gives the
    layout of the last completed step. Wrap the policy: ``compressor.install_policy(bits=recorder.wrap(policy))``."""

    def __init__(self, compressor: ActivationCompressor):
        self.compressor = compressor
        self._step_number: int | None = None
        self._asked: dict[int, TensorKey] = {}

    def wrap(self, policy: Callable[[TensorKey], int]) -> Callable[[int, torch.Tensor], int]:
        def bits_policy(index: int, t: torch.Tensor) -> int:
            step = self.compressor.current_step
            if step is not None and step.number != self._step_number:
                self._step_number, self._asked = step.number, {}
            key = TensorKey.of(index, t, self.compressor.minimum_bits(index))
            self._asked[index] = key
            return policy(key)

        return bits_policy

    def last_layout(self) -> Layout:
        """Layout of the last completed ``compress()`` step (empty when the policy was not asked in it)."""
        if self._step_number is None or self._step_number != self.compressor.step_number - 1:
            return ()
        return tuple(self._asked[r.index] for r in self.compressor.stats().records
                     if r.kind == COMPRESSED and r.index in self._asked)


def probed_bits(bits: int, key: TensorKey) -> int:
    """The bits a probe pass stores ``key``'s tensor at when it is allocated ``bits``: at most PROBE_MAX_BITS,
    raised to the op rule's floor as the engine does."""
    return max(min(bits, PROBE_MAX_BITS), key.minimum_bits or 0)


@dataclass
class SensitivityRound:
    """What one estimation round measured."""

    layout: Layout  # of the probed batch
    sensitivities: dict[int, float]  # position in ``layout`` -> c_l, for the probed tensors
    passes: int  # forward/backward passes run
    seconds: float


@contextlib.contextmanager
def preserved_training_state(compressor: ActivationCompressor,
                             params: Sequence[nn.Parameter]) -> Iterator[Callable[[], None]]:
    """Put back, whatever happens inside: parameter ``.grad``s, module buffers (BatchNorm running statistics),
    the torch RNG states (dropout) and the compressor's step counter, statistics and policies
    (:meth:`~ActivationCompressor.detached_steps`). Yields ``rewind()``, which puts buffers and RNG back mid-way
    (before each probe pass). The optimizer is never touched by probes, so it needs no snapshot."""
    grads = [p.grad for p in params]
    buffers = [(b, b.detach().clone()) for b in compressor.model.buffers()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def rewind() -> None:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)

    try:
        with compressor.detached_steps():
            yield rewind
    finally:
        rewind()
        for p, g in zip(params, grads):
            p.grad = g


def estimate_sensitivities(compressor: ActivationCompressor, forward_backward_fn: Callable[[], object],
                           bits_for: Callable[[TensorKey], int], choose: Callable[[Layout], Sequence[int]],
                           round_seed: int = 0, ddp_model: nn.Module | None = None) -> SensitivityRound:
    """Run Algorithm 1 on one batch.

    Args:
        compressor: the compressor whose ``model`` is trained.
        forward_backward_fn: runs the user's forward inside ``compressor.compress()`` and its backward, on the
            same batch every call (e.g. ``with compressor.compress(): loss = model(x)...`` then
            ``loss.backward()``); no optimizer step.
        bits_for: bits currently allocated to a tensor (probes use :func:`probed_bits` of them).
        choose: positions in the batch's layout to probe (``range(len(layout))`` for all).
        round_seed: varies the fixed noise from round to round.
        ddp_model: a ``DistributedDataParallel`` wrapper: passes run under its ``no_sync()``.
    """
    model = compressor.model
    if model is None:
        raise ValueError("estimate_sensitivities needs ActivationCompressor(model, ...) with its model; got model=None")
    params = [p for p in model.parameters() if p.requires_grad]
    started = time.perf_counter()
    base = rng.mix32(round_seed ^ _PROBE_SALT)
    recorder = LayoutRecorder(compressor)
    probe_bits = recorder.wrap(lambda key: probed_bits(bits_for(key), key))
    with preserved_training_state(compressor, params) as rewind, compressor.install_policy(bits=probe_bits):

        def gradient(changed_index: int | None) -> list[torch.Tensor]:
            rewind()
            for p in params:
                p.grad = None

            def noise(_step: int, i: int) -> int:
                return rng.mix32(base ^ i) ^ (_CHANGED_KEY * (i == changed_index))

            before = compressor.step_number
            with compressor.install_policy(noise=noise), \
                    ddp_model.no_sync() if ddp_model is not None else contextlib.nullcontext():
                forward_backward_fn()
            if compressor.step_number != before + 1:
                raise ValueError(
                    f"forward_backward_fn ran {compressor.step_number - before} compress() steps; expected 1: run "
                    "its forward inside compressor.compress() (and no other forward under it)")
            return [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in params]

        g0 = gradient(None)
        layout = recorder.last_layout()
        sensitivities = {}
        for position in choose(layout):
            key = layout[position]
            g1 = gradient(key.index)
            if recorder.last_layout() != layout:
                raise RuntimeError(
                    "the saved-tensor sequence changed between probe passes on one batch; forward_backward_fn must "
                    "run the same computation every call")
            squared = sum(_total((a.double() - b.double()).pow(2).sum()) for a, b in zip(g0, g1))
            sensitivities[position] = squared / (2.0 * variance_factor(probed_bits(bits_for(key), key)))
        passes = 1 + len(sensitivities)
    return SensitivityRound(layout, sensitivities, passes, time.perf_counter() - started)


def _total(scalar: torch.Tensor) -> float:
    """A scalar tensor's value; for a DTensor (sums over FSDP's sharded gradients) the sum over all shards, so
    every rank measures the whole gradient (a collective: every rank calls it alike)."""
    return float(scalar.full_tensor() if hasattr(scalar, "full_tensor") else scalar)


class GradientVariance:
    """Running (exponentially weighted) total variance ``E||g - E g||^2`` of the training gradient, the
    denominator of GACT's failure alert. Feed it each step's gradient with :meth:`update`."""

    def __init__(self, decay: float = 0.05):
        self.decay = decay
        self.count = 0
        self.value = 0.0
        self._mean: list[torch.Tensor] | None = None

    def update(self, grads: Sequence[torch.Tensor]) -> None:
        grads = [g.detach().float() for g in grads]
        if self._mean is None or len(self._mean) != len(grads):
            if self._mean is not None:  # another model: start over
                self.count, self.value = 0, 0.0
            self._mean, self.count = [g.clone() for g in grads], max(self.count, 1)
            return
        self.count += 1
        weight = max(1.0 / self.count, self.decay)
        deviation = sum(_total((g - m).double().pow(2).sum()) for g, m in zip(grads, self._mean))
        self.value = (1.0 - weight) * (self.value + weight * deviation)
        for m, g in zip(self._mean, grads):
            m.add_(g - m, alpha=weight)

    @property
    def ready(self) -> bool:
        """Whether enough gradients were seen for a variance."""
        return self.count >= 2

    def state_dict(self) -> dict:
        return {"count": self.count, "value": self.value}

    def load_state_dict(self, state: dict) -> None:
        # the mean vector is not checkpointed (model-sized): the next gradient restarts it, the variance stays
        self.count, self.value, self._mean = int(state["count"]), float(state["value"]), None
