"""What one step's compression did: per saved tensor records and their totals."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

# Kinds of saved tensor, as the engine's policy classifies them.
COMPRESSED = "compressed"  # encoded by a codec
DUPLICATE = "duplicate"  # same storage and version as an earlier saved tensor of the step: stored once
PARAMETER = "parameter"  # a parameter or buffer, or a view/cast of one: not an activation, not counted
KEPT = "kept"  # kept as it is (integer, sparse, too small, ...): counted on both sides


class TensorRecord(NamedTuple):
    """One saved tensor of a step (a named tuple: one is built per saved tensor, in the pack hook)."""

    index: int
    shape: torch.Size
    dtype: torch.dtype
    kind: str
    codec: str
    bits: float
    original_bytes: int
    stored_bytes: int
    reason: str = ""
    # or "recompute": saved while a checkpoint recomputed its segment in backward; or "compiled": saved inside a
    # compiled graph (recorded when its backward decodes it)
    phase: str = "forward"
    offloaded: bool = False  # stored in host memory (swap), not on the device
    error_bound: float | None = None  # the codec's absolute error bound, for error-bounded codecs


@dataclass(frozen=True)
class CompressionStats:
    """Totals of one step. ``original_bytes`` counts each storage once, as it would have been kept without
    compression; ``stored_bytes`` what the compressed forms hold (statistics and headers included)."""

    original_bytes: int = 0
    stored_bytes: int = 0
    records: tuple[TensorRecord, ...] = field(default=(), repr=False)

    @property
    def ratio(self) -> float:
        return self.original_bytes / self.stored_bytes if self.stored_bytes else 1.0

    @property
    def num_saved(self) -> int:
        return len(self.records)

    @property
    def device_bytes(self) -> int:
        """Stored bytes kept on the device between forward and backward (not swapped, not recomputed)."""
        return sum(r.stored_bytes for r in self.records if not r.offloaded and r.phase != "recompute")

    @property
    def offloaded_bytes(self) -> int:
        """Stored bytes held in host memory by swap."""
        return sum(r.stored_bytes for r in self.records if r.offloaded)

    def count(self, kind: str) -> int:
        return sum(r.kind == kind for r in self.records)

    @property
    def num_compressed(self) -> int:
        return self.count(COMPRESSED)

    @property
    def average_bits(self) -> float:
        """Element-weighted payload bits of the compressed tensors (32 when nothing was compressed)."""
        weights = [(r.bits, _numel(r.shape)) for r in self.records if r.kind == COMPRESSED]
        total = sum(n for _, n in weights)
        return sum(b * n for b, n in weights) / total if total else 32.0

    def per_codec(self) -> dict[str, tuple[int, int]]:
        """``{codec: (original_bytes, stored_bytes)}`` over the records counted in the totals."""
        out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for r in self.records:
            if r.kind in (COMPRESSED, KEPT):
                out[r.codec][0] += r.original_bytes
                out[r.codec][1] += r.stored_bytes
        return {k: (v[0], v[1]) for k, v in out.items()}

    @classmethod
    def from_records(cls, records: list[TensorRecord]) -> "CompressionStats":
        return cls(sum(r.original_bytes for r in records), sum(r.stored_bytes for r in records), tuple(records))

    def summary(self) -> str:
        return (f"{self.num_saved} saved tensors, {self.num_compressed} compressed: "
                f"{self.original_bytes / 2**20:.2f} MiB -> {self.stored_bytes / 2**20:.2f} MiB "
                f"(ratio {self.ratio:.2f}x, {self.average_bits:.2f} bits on average)")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
