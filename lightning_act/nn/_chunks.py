"""Row chunks of a saved tensor, each packed and unpacked on its own.

``ctx.save_for_backward(*x.split(rows))`` hands every chunk to the saved-tensor pack hook separately (under an
``ActivationCompressor`` each is compressed separately), but ``ctx.saved_tensors`` unpacks all of them at once:
a backward that reads them through it holds the whole decoded tensor again. :class:`SavedEntries` unpacks one
(autograd's version check included), so a backward that walks the chunks holds one decoded chunk at a time.
"""
from __future__ import annotations

import torch

from .._validate import parse_bytes

DEFAULT_CHUNK_BYTES = "auto"
AUTO_CHUNK_BYTES = 4 * 2**20
# off CPU each chunk costs its kernel launches on the host: "auto" makes at most this many chunks of a tensor there
AUTO_MAX_CHUNKS = 8


def chunk_rows(chunk_bytes: int | str, row_bytes: int, rows: int = 0, device: torch.device | None = None) -> int:
    """Rows per chunk: as many rows of ``row_bytes`` as fit in ``chunk_bytes`` (an int or a size such as
    ``"4MiB"``), at least one. ``"auto"``: ``AUTO_CHUNK_BYTES``, and for ``rows`` rows on a ``device`` other than
    the CPU at most ``AUTO_MAX_CHUNKS`` chunks (a GPU's large tensors in a few large chunks rather than many kernel
    launches). Bad sizes raise ``ValueError`` naming the value."""
    if chunk_bytes == "auto":
        per_chunk = AUTO_CHUNK_BYTES // max(1, row_bytes)
        if device is not None and device.type != "cpu":
            per_chunk = max(per_chunk, -(-rows // AUTO_MAX_CHUNKS))
        return max(1, per_chunk)
    try:
        nbytes = parse_bytes("chunk_bytes", chunk_bytes)
    except ValueError as error:
        raise ValueError(f"{error}, or 'auto'") from None
    return max(1, nbytes // max(1, row_bytes))


def row_bounds(n: int, rows: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` of ``rows``-row chunks covering ``n`` rows (the last may be shorter)."""
    return [(start, min(start + rows, n)) for start in range(0, n, rows)]


class SavedEntries:
    """A backward's view of ``ctx``'s saved tensors: ``entries[i]`` unpacks entry ``i`` alone, so the pack hook's
    unpack runs for it only. Torch 2.13 unpacks one entry with autograd's version check. Torch 2.11 has no such call:
    there the entry's own unpack hook runs on its packed form (the compressor's hook checks versions itself), and
    entries saved without hooks are all read at the first read, once per backward, never unpacked twice
    (non-reentrant ``torch.utils.checkpoint`` refuses that). Made at the start of a backward and dropped with it."""

    __slots__ = ("_ctx", "_raw", "_all", "_per_entry")

    def __init__(self, ctx):
        raw = getattr(ctx, "_raw_saved_tensors", None) or ()
        self._ctx, self._raw, self._all = ctx, raw, None
        self._per_entry = bool(raw) and hasattr(raw[0], "unpack")

    def __getitem__(self, index: int) -> torch.Tensor:
        if self._per_entry:
            return self._raw[index].unpack()
        hook = getattr(self._raw[index], "unpack_hook", None) if self._raw else None
        if hook is not None:
            return hook(self._raw[index].data)
        if self._all is None:
            self._all = self._ctx.saved_tensors
        return self._all[index]
