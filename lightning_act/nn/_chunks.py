"""Row chunks of a saved tensor, each packed and unpacked on its own.

``ctx.save_for_backward(*x.split(rows))`` hands every chunk to the saved-tensor pack hook separately (under an
``ActivationCompressor`` each is compressed separately), but ``ctx.saved_tensors`` unpacks all of them at once:
a backward that reads them through it holds the whole decoded tensor again. :func:`unpack_saved` unpacks one
(autograd's version check included), so a backward that walks the chunks holds one decoded chunk at a time.
"""
from __future__ import annotations

import torch

from .._validate import parse_bytes

DEFAULT_CHUNK_BYTES = 4 * 2**20


def chunk_rows(chunk_bytes: int | str, row_bytes: int) -> int:
    """Rows per chunk: as many rows of ``row_bytes`` as fit in ``chunk_bytes`` (an int or a size such as
    ``"4MiB"``), at least one. Bad sizes raise ``ValueError`` naming the value."""
    return max(1, parse_bytes("chunk_bytes", chunk_bytes) // max(1, row_bytes))


def row_bounds(n: int, rows: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` of ``rows``-row chunks covering ``n`` rows (the last may be shorter)."""
    return [(start, min(start + rows, n)) for start in range(0, n, rows)]


def unpack_saved(ctx, index: int) -> torch.Tensor:
    """Saved tensor ``index`` of ``ctx`` alone (the pack hook's unpack runs for it only)."""
    raw = getattr(ctx, "_raw_saved_tensors", None)
    if raw is None or not hasattr(raw[index], "unpack"):  # a torch without per-tensor unpacking: correct, not bounded
        return ctx.saved_tensors[index]
    return raw[index].unpack()
