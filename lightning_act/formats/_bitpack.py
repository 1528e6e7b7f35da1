"""Dense little-endian bit packing of small unsigned codes into uint8 (element i at bit (i % (8/b)) * b)."""
from __future__ import annotations

import torch

PACKABLE_BITS = (1, 2, 4, 8)


def packed_nbytes(numel: int, bits: int) -> int:
    return (numel * bits + 7) // 8


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack a flat uint8 tensor of codes < 2**bits into ``packed_nbytes(codes.numel(), bits)`` bytes."""
    if bits == 8:
        return codes
    per_byte = 8 // bits
    tail = (-codes.numel()) % per_byte
    if tail:
        codes = torch.cat([codes, codes.new_zeros(tail)])
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    return (codes.view(-1, per_byte) << shifts).sum(dim=1, dtype=torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: the first ``numel`` codes as uint8."""
    if bits == 8:
        return packed[:numel]
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = (packed.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return codes.view(-1)[:numel]
