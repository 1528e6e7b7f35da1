"""Bit allocation (GACT Eq. 4): minimise the compression variance ``sum_l c_l S(b_l)`` subject to
``sum_l b_l D_l <= budget * sum_l D_l``, greedily in ``O(L log L)`` (ActNN's algorithm).

Every tensor starts lossless (32 bits); the step down that adds the least variance per bit saved is taken
until the total fits the budget, never below a tensor's minimum (an op rule's floor: a log-probability is stored
at 8 bits whatever it is allocated, so its 8 bits count against the budget). ``S`` is convex along the candidate
ladder, so each tensor's successive steps cost more per bit and the heap order is the greedy order. The last step
usually undershoots the budget; the slack is then spent again on the tensors whose step up removes the most
variance per bit. Minimums can make a budget unreachable: every tensor then sits at its lowest candidate.
"""
from __future__ import annotations

import heapq
import math
from typing import Sequence

from .._validate import check_int

# Bits per element auto-precision chooses from, lossless first; 32 means "kept raw" (S = 0).
CANDIDATE_BITS = (32, 8, 4, 2, 1)


def variance_factor(bits: int) -> float:
    """``S(b) = (2**b - 1)**-2``: a stochastic-rounding quantizer's variance for a unit range; 0 at 32 bits."""
    return 0.0 if bits >= 32 else (2.0**bits - 1.0) ** -2


def compression_variance(sensitivities: Sequence[float], bits: Sequence[int]) -> float:
    """GACT Thm. 2's bound ``sum_l c_l S(b_l)`` on the gradient variance compression adds."""
    return sum(c * variance_factor(b) for c, b in zip(sensitivities, bits))


def allocate_bits(sensitivities: Sequence[float], sizes: Sequence[int], budget: float,
                  candidates: Sequence[int] = CANDIDATE_BITS, minimums: Sequence[int | None] | None = None
                  ) -> list[int]:
    """Bits per tensor from ``candidates`` with ``sum(b * D) <= budget * sum(D)`` and least
    ``sum(c * S(b))``. ``sensitivities`` are the ``c_l`` (>= 0), ``sizes`` the element counts ``D_l``,
    ``minimums`` the least bits of each tensor (None: any candidate; a tensor gets the candidates at or above it,
    the largest always)."""
    if len(sensitivities) != len(sizes):
        raise ValueError(f"{len(sensitivities)} sensitivities for {len(sizes)} sizes; expected one per tensor")
    if minimums is not None and len(minimums) != len(sizes):
        raise ValueError(f"{len(minimums)} minimums for {len(sizes)} sizes; expected one per tensor")
    for name, values in (("sensitivities", sensitivities), ("sizes", sizes)):
        bad = [v for v in values if not (math.isfinite(v) and v >= 0)]
        if bad:
            raise ValueError(f"{name} holds {bad[0]!r}; expected finite numbers >= 0")
    for size in sizes:
        check_int("sizes", size, minimum=1)
    ladder = sorted(set(candidates), reverse=True)
    if not ladder or not (ladder[-1] <= budget):
        raise ValueError(f"budget={budget!r}; expected a number >= the smallest candidate ({min(candidates)} bits)")

    level = [0] * len(sizes)  # position of each tensor on the ladder
    lowest = [len(ladder) - 1] * len(sizes)  # the lowest position each tensor may take
    for l, least in enumerate(minimums or ()):
        if least is not None:
            check_int("minimums", least, minimum=0)
            lowest[l] = max([i for i, b in enumerate(ladder) if b >= least], default=0)
    spare = budget * sum(sizes) - ladder[0] * sum(sizes)  # bits left under the budget (negative: over it)

    def cost(l: int, i: int, j: int) -> float:
        """Variance added per bit saved moving tensor ``l`` from ladder[i] to ladder[j]; going up, the
        variance removed per bit spent."""
        added = sensitivities[l] * (variance_factor(ladder[j]) - variance_factor(ladder[i]))
        return added / ((ladder[i] - ladder[j]) * sizes[l])

    down = [(cost(l, 0, 1), l) for l in range(len(sizes)) if lowest[l] > 0]
    heapq.heapify(down)
    while spare < 0 and down:
        _, l = heapq.heappop(down)
        i = level[l]
        spare += (ladder[i] - ladder[i + 1]) * sizes[l]
        level[l] = i + 1
        if i + 2 <= lowest[l]:
            heapq.heappush(down, (cost(l, i + 1, i + 2), l))

    # spend the slack the last step left: most variance removed per bit first, while it fits
    up = [(-cost(l, level[l], level[l] - 1), l) for l in range(len(sizes)) if level[l] > 0]
    heapq.heapify(up)
    while up:
        _, l = heapq.heappop(up)
        i = level[l]
        extra = (ladder[i - 1] - ladder[i]) * sizes[l]
        if extra > spare or sensitivities[l] == 0:
            continue
        spare -= extra
        level[l] = i - 1
        if i - 1 > 0:
            heapq.heappush(up, (-cost(l, i - 1, i - 2), l))
    return [ladder[i] for i in level]
