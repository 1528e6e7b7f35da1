"""Chunked 1-bit packing for the lossless codecs (masks, bool tensors, bit-planes of max-pool offsets).

A whole-tensor pass makes whole-tensor temporaries: ``(x > 0)`` is a byte per element, bit packing pads a copy and
takes a scratch of the same size, decoding to float goes through unpacked bytes. Here every pass runs over chunks
of ``chunk_elements(device)`` elements (the quantize reference's chunk: 128 Ki per torch thread on CPU, 4 Mi on a
GPU): packing fills one byte buffer reused from chunk to chunk, unpacking spreads a chunk's bytes over words, so
an encode allocates its payload and a decode its output, plus workspaces of a chunk's size (issue #17: a decoded activation, not its temporaries, is what backward holds).
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch

from ..formats._bitpack import pack_codes_, packed_nbytes
from ..formats._bitpack import unpack_bits
from ..formats.quantize import chunk_elements

__all__ = ["chunk_elements", "pack_chunks", "spans", "unpack_chunks"]


def spans(n: int, chunk: int) -> Iterator[tuple[int, int]]:
    """``(start, end)`` of consecutive chunks of at most ``chunk`` covering ``range(n)``."""
    for start in range(0, n, chunk):
        yield start, min(n, start + chunk)


def _workspace(n: int, device: torch.device) -> tuple[torch.Tensor, int]:
    chunk = chunk_elements(device)  # a multiple of 8: every chunk but the last starts on a byte of the payload
    return torch.empty(-(-min(n, chunk) // 8) * 8, dtype=torch.uint8, device=device), chunk


def pack_chunks(n: int, device: torch.device, fill: Callable[[int, int, torch.Tensor], None],
              out: torch.Tensor | None = None) -> torch.Tensor:
    """Pack ``n`` bits: ``fill(start, end, codes)`` writes elements ``start:end`` as 0/1 into the uint8 tensor
    ``codes`` (``end - start`` of them, a chunk at most). Returns ``out`` (or a new ``packed_nbytes(n, 1)``-byte
    uint8 tensor) holding bit i of the stream at bit ``i % 8`` of byte ``i // 8``."""
    if out is None:
        out = torch.empty(packed_nbytes(n, 1), dtype=torch.uint8, device=device)
    if n == 0:
        return out
    codes_ws, chunk = _workspace(n, device)
    for start, end in spans(n, chunk):
        m = end - start
        whole = -(-m // 8) * 8
        codes = codes_ws[:whole]
        fill(start, end, codes[:m])
        if whole > m:
            codes[m:] = 0
        pack_codes_(codes, 1, out[start // 8: start // 8 + whole // 8])
    return out


def unpack_chunks(packed: torch.Tensor, n: int, emit: Callable[[int, int, torch.Tensor], None]) -> None:
    """Inverse of :func:`pack_chunks`: ``emit(start, end, codes)`` receives elements ``start:end`` as 0/1 uint8
    (valid until ``emit`` returns)."""
    for start, end in spans(n, chunk_elements(packed.device)):
        emit(start, end, unpack_bits(packed[start // 8: -(-end // 8)], end - start).view(torch.uint8))
