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

import functools

import torch

MASK32 = 0xFFFFFFFF
# Multipliers of a 2-round xorshift-multiply hash (hash-prospector family), both < 2**31 on purpose.
_MUL1 = 0x21F0AAAD
_MUL2 = 0x735A2D97
_SEED_SALT = 0x9E3779B9
# Elements hashed per chunk by the specification: bounds its int64 temporaries whatever the tensor size.
CHUNK_ELEMENTS = 1 << 20
COUNTER_SPAN = 1 << 16  # the fast path hashes aligned runs of 2**16 indices (uniform24_codes_)


def _signed32(word: int) -> int:
    """A 32-bit word as the int32 value with the same bits."""
    return word - (1 << 32) if word >> 31 else word


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
    return keyed_stream_base(seed_hash(seed), key)


def seed_hash(seed: int) -> int:
    """The part of :func:`stream_base` that depends on the seed alone (a codec hashes it once)."""
    return mix32((seed & MASK32) ^ _SEED_SALT)


def keyed_stream_base(seed_hash: int, key: int) -> int:
    """:func:`stream_base` from :func:`seed_hash` of the seed."""
    return mix32(seed_hash ^ (key & MASK32))


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


@functools.lru_cache(maxsize=None)
def _counter(device: torch.device) -> torch.Tensor:
    """``0 .. COUNTER_SPAN - 1`` in int32 on ``device`` (read only, shared)."""
    return torch.arange(COUNTER_SPAN, dtype=torch.int32, device=device)


def uniform24_codes_(base: int, start: int, out: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """The integers ``k`` of :func:`uniform24` (``uniform24 = k * 2**-24``) for element indices ``start ..
    start + out.numel() - 1``, written into the int32 tensor ``out``; ``scratch`` is an int32 tensor of the same
    size. Bit-identical to :func:`uniform24`, in 11 int32 passes and no allocation.

    Within an aligned run of ``COUNTER_SPAN = 2**16`` indices, ``lo32(i) = A | j`` (``A`` the run's start, ``j <
    2**16``), so the hash's first step is one XOR of a counter: ``x = lo32(i) ^ K`` (``K = mix32(base ^
    hi32(i))``) gives ``x ^ (x >> 16) = j ^ D ^ (D >> 16)`` with ``D = A ^ K``, a constant of the run. Whole runs
    under one ``hi32`` take one broadcast XOR with their constants (a GPU chunk holds 64 runs: one launch, not 64).
    """
    counter = _counter(out.device)
    pos, count = 0, out.numel()
    while pos < count:
        index = start + pos
        j = index % COUNTER_SPAN
        key = mix32(base ^ (index >> 32))
        runs = min(count - pos, (1 << 32) - (index & MASK32)) // COUNTER_SPAN if j == 0 else 0
        if runs > 1:
            d = torch.arange(index & MASK32, (index & MASK32) + runs * COUNTER_SPAN, COUNTER_SPAN,
                             dtype=torch.int64, device=out.device).bitwise_xor_(key)
            d ^= d >> 16
            d = torch.where(d >= 1 << 31, d - (1 << 32), d).to(torch.int32)  # the words' bits as int32
            torch.bitwise_xor(counter, d[:, None], out=out[pos : pos + runs * COUNTER_SPAN].view(runs, COUNTER_SPAN))
            pos += runs * COUNTER_SPAN
            continue
        n = min(count - pos, COUNTER_SPAN - j)
        d = ((index - j) & MASK32) ^ key
        torch.bitwise_xor(counter[j : j + n], _signed32(d ^ (d >> 16)), out=out[pos : pos + n])
        pos += n
    for multiplier in (_MUL1, _MUL2):
        out.mul_(multiplier)  # int32: wraps modulo 2**32, the low 32 bits of the product
        torch.bitwise_right_shift(out, 15, out=scratch)
        out ^= scratch.bitwise_and_(0x1FFFF)
    return out.bitwise_right_shift_(8).bitwise_and_(0xFFFFFF)
