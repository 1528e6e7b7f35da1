"""Dense little-endian bit packing of small unsigned codes into uint8 (element i at bit (i % (8/b)) * b).

Packing works on words: ``8 / b`` codes, one per byte, read as one little-endian integer word, are gathered into
its top byte by one multiplication (``pack_codes_``); unpacking spreads a byte back over a word by shifts and ORs
(``unpack_codes_``). Each is a handful of whole-tensor integer passes, no per-code indexing.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

PACKABLE_BITS = (1, 2, 4, 8)
# bits -> (word dtype holding 8 / bits codes, the shifts that spread a byte back over a word, the mask that keeps
# one code per byte after spreading)
_WORDS = {4: (torch.int16, (4,), 0x0F0F), 2: (torch.int32, (6, 12), 0x03030303),
          1: (torch.int64, (7, 14, 28), 0x0101010101010101)}
# bits -> the multiplier that gathers the word's 8 / bits codes (c_i < 2**bits at bit 8i) into its top byte: c_i
# times 2**(8 * (w - 1) - (8 - bits) * i) lands at bit 8 * (w - 1) + bits * i (w bytes a word); every other partial
# product falls below the top byte or beyond the word, and no two overlap, so nothing carries into the top byte.
_GATHER = {4: 0x0110, 2: 0x01041040, 1: 0x0102040810204080}


def packed_nbytes(numel: int, bits: int) -> int:
    return (numel * bits + 7) // 8


def pack_codes_(codes: torch.Tensor, bits: int, out: torch.Tensor) -> torch.Tensor:
    """Pack ``codes`` (contiguous uint8 codes < 2**bits, a multiple of ``8 // bits`` of them, storage offset a
    multiple of 8) into ``out`` (``codes.numel() * bits // 8`` bytes): one multiply per word gathers its codes into
    the top byte, which a shift and the narrowing copy into ``out`` keep. ``codes`` is overwritten."""
    dtype = _WORDS[bits][0]
    words = codes.view(dtype).mul_(_GATHER[bits])  # wraps modulo 2**(8w): only the top byte is kept
    return out.copy_(words.bitwise_right_shift_(8 * words.element_size() - 8))  # narrowing keeps the low byte


def unpack_codes_(packed: torch.Tensor, bits: int, codes: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_codes_`: the ``packed.numel() * 8 // bits`` codes of ``packed`` into ``codes``
    (contiguous uint8 of exactly that size, storage offset a multiple of 8); ``scratch`` as for ``pack_codes_``."""
    dtype, shifts, mask = _WORDS[bits]
    words = codes.view(dtype)
    words.copy_(packed)
    spread = scratch[: codes.numel()].view(dtype)
    for shift in reversed(shifts):
        torch.bitwise_left_shift(words, shift, out=spread)
        words |= spread
    return codes.view(dtype).bitwise_and_(mask).view(torch.uint8)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack a flat uint8 tensor of codes < 2**bits into ``packed_nbytes(codes.numel(), bits)`` bytes."""
    if bits == 8:
        return codes
    per_byte = 8 // bits
    padded = codes.new_zeros(-(-codes.numel() // per_byte) * per_byte)
    padded[: codes.numel()] = codes
    out = codes.new_empty(padded.numel() // per_byte)
    return pack_codes_(padded, bits, out)


def unpack_codes(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: the first ``numel`` codes as uint8."""
    if bits == 8:
        return packed[:numel]
    codes = packed.new_empty(packed.numel() * 8 // bits)
    return unpack_codes_(packed, bits, codes, torch.empty_like(codes))[:numel]


def pack_codes_traced(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """:func:`pack_codes` as ops a compiled graph can hold (no in-place ops on dtype views): each byte ORs its
    ``8 / bits`` codes, shifted, in int32, which inductor fuses with the ops that made the codes."""
    if bits == 8:
        return codes
    per_byte = 8 // bits
    padded = F.pad(codes, (0, -codes.numel() % per_byte)).view(-1, per_byte).to(torch.int32)
    packed = padded[:, 0]
    for i in range(1, per_byte):
        packed = packed | (padded[:, i] << (bits * i))
    return packed.to(torch.uint8)


# 1 bit per element without pack_codes' padding copy and in-place passes: the mask codecs run once per ReLU and
# dropout, so on a GPU their launch count is host time. Products wrap modulo 2**64, as torch's int64 multiply
# does on CPU and CUDA.


def pack_bits(flags: torch.Tensor) -> torch.Tensor:
    """Pack a flat tensor of 0/1 bytes (uint8 or bool) into ``packed_nbytes(numel, 1)`` bytes, the layout of
    ``pack_codes(flags, 1)``."""
    numel = flags.numel()
    if numel % 8 or flags.storage_offset() % 8:
        padded = flags.new_zeros(numel + (-numel % 8))
        padded[:numel] = flags
        flags = padded
    # the top byte of each little-endian word product holds its 8 flags; the narrowing cast keeps the low byte
    return (flags.view(torch.int64) * _GATHER[1]).bitwise_right_shift_(56).to(torch.uint8)


# (device, dtype) -> the (256, 8) table whose row b holds the bits of byte b as 0/1 of dtype, least significant
# first: unpacking is one gather of rows (two kernels with the index conversion, against four word passes and a
# conversion)
_BIT_ROWS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def bit_rows(device: torch.device, dtype: torch.dtype = torch.bool) -> torch.Tensor:
    """The (256, 8) table whose row b holds the bits of byte b as 0/1 of ``dtype``, least significant first."""
    rows = _BIT_ROWS.get((device, dtype))
    if rows is None:  # built on the device (no host copy), once per device and dtype
        byte = torch.arange(256, dtype=torch.int32, device=device)
        bits = (byte[:, None] >> torch.arange(8, dtype=torch.int32, device=device)) & 1
        rows = _BIT_ROWS[(device, dtype)] = bits.to(dtype)
    return rows


def unpack_rows(packed: torch.Tensor, numel: int, shape: tuple[int, ...], rows: torch.Tensor) -> torch.Tensor:
    """Byte b of ``packed`` as row b of ``rows`` (a (256, 8) table): the first ``numel`` values, in ``shape``."""
    values = torch.index_select(rows, 0, packed.int())
    if numel % 8:
        return values.view(-1)[:numel].view(shape)
    return values.view(shape)


def unpack_bits(packed: torch.Tensor, numel: int, shape: tuple[int, ...] = (-1,),
                dtype: torch.dtype = torch.bool) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``numel`` flags, as a bool tensor (of ``shape``, ``numel``
    elements, when given; as 0/1 of ``dtype`` when given)."""
    return unpack_rows(packed, numel, shape, bit_rows(packed.device, dtype))
