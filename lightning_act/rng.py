"""Counter-based random numbers for stochastic rounding.

Every random draw is a pure function of ``(seed, stream key, element index)``, so the torch path and the
CUDA kernels produce the same bits, and a single tensor's noise can be fixed or changed on purpose (GACT's
sensitivity estimation, Algorithm 1, needs exactly that). All arithmetic is on 32-bit words. The specification
(:func:`mix32_tensor`, :func:`uniform24`) holds them in int64 with multipliers below 2**31, so no product
overflows; the fast path the codecs run (:func:`uniform24_codes_`) computes the same words in int32 with
wraparound (two's complement multiplication keeps the low 32 bits, logical shifts are arithmetic shifts
masked), in buffers the caller reuses.

The CUDA kernels (``lightning_act/cuda/*.cu``) implement the same ``mix32`` / ``stream_base`` /
``uniform24`` functions; this module is their specification.
"""
from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
# Multipliers of a 2-round xorshift-multiply hash (hash-prospector family), both < 2**31 on purpose.
_MUL1 = 0x21F0AAAD
_MUL2 = 0x735A2D97
_SEED_SALT = 0x9E3779B9
# Elements hashed per chunk by the specification: bounds its int64 temporaries whatever the tensor size.
CHUNK_ELEMENTS = 1 << 20
_INT32_SPAN = 1 << 31  # a fast-path segment never crosses a multiple of 2**31: its int32 words never overflow


def _signed32(word: int) -> int:
    """A 32-bit word as the int32 value with the same bits."""
    return word - (1 << 32) if word >= _INT32_SPAN else word


def mix32(x: int) -> int:
    """Hash one 32-bit word (Python int), the scalar twin of :func:`mix32_tensor`."""
    x &= MASK32
    x ^= x >> 16
    x = (x * _MUL1) & MASK32
    x ^= x >> 15
    x = (x * _MUL2) & MASK32
    x ^= x >> 15
    return x


def mix32_tensor(x: torch.Tensor) -> torch.Tensor:
    """Hash int64 tensor holding 32-bit words; returns int64 words in [0, 2**32)."""
    x = x ^ (x >> 16)
    x.mul_(_MUL1).bitwise_and_(MASK32)
    x ^= x >> 15
    x.mul_(_MUL2).bitwise_and_(MASK32)
    x ^= x >> 15
    return x


def stream_base(seed: int, key: int) -> int:
    """The 32-bit base of the random stream for one (seed, tensor key) pair."""
    return mix32(mix32((seed & MASK32) ^ _SEED_SALT) ^ (key & MASK32))


def uniform24(base: int, start: int, count: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Uniform floats k * 2**-24 (k in [0, 2**24)) for element indices ``start .. start + count - 1``.

    Element ``i`` draws ``mix32(lo32(i) ^ mix32(base ^ hi32(i))) >> 8``: indices are 64-bit, so tensors
    over 2**32 elements never repeat noise. The float conversion is exact (24-bit integers).
    """
    out = torch.empty(count, dtype=torch.float32, device=device)
    pos = 0
    while pos < count:
        index = start + pos
        hi = index >> 32
        # never let a chunk cross a 2**32 boundary: hi32(i) is then one scalar per chunk
        n = min(count - pos, CHUNK_ELEMENTS, (1 << 32) - (index & MASK32))
        lo = torch.arange(index & MASK32, (index & MASK32) + n, dtype=torch.int64, device=device)
        lo ^= mix32(base ^ hi)
        h = mix32_tensor(lo)
        h >>= 8
        torch.mul(h, 2.0**-24, out=out[pos : pos + n])
        pos += n
    return out


def uniform24_codes_(base: int, start: int, out: torch.Tensor, scratch: torch.Tensor,
                     counter: torch.Tensor) -> torch.Tensor:
    """The integers ``k`` of :func:`uniform24` (``uniform24 = k * 2**-24``) for element indices ``start ..
    start + out.numel() - 1``, written into the int32 tensor ``out``; ``scratch`` is an int32 tensor of the same
    size, ``counter`` holds ``0, 1, 2, ...`` in int32, at least as many. Bit-identical to :func:`uniform24`, in
    15 int32 passes and no allocation."""
    pos, count = 0, out.numel()
    while pos < count:
        index = start + pos
        n = min(count - pos, _INT32_SPAN - (index % _INT32_SPAN))
        words = out[pos : pos + n]
        lo = _signed32(index & MASK32)
        torch.add(counter[:n], lo, out=words)  # faster than arange
        words ^= _signed32(mix32(base ^ (index >> 32)))
        t = scratch[pos : pos + n]
        for shift, mask, multiplier in ((16, 0xFFFF, _MUL1), (15, 0x1FFFF, _MUL2), (15, 0x1FFFF, None)):
            torch.bitwise_right_shift(words, shift, out=t)
            words ^= t.bitwise_and_(mask)
            if multiplier is not None:
                words.mul_(multiplier)  # int32: wraps modulo 2**32, the low 32 bits of the product
        words.bitwise_right_shift_(8).bitwise_and_(0xFFFFFF)
        pos += n
    return out
