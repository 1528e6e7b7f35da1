"""NaN encodings on which CPU and GPU disagree, for tests that compare stored bytes bit for bit.

x86 arithmetic propagates an operand's NaN payload (quieted, sign kept), a GPU returns 0x7fffffff, torch's
float -> bfloat16 cast gives 0x7fc0 or 0xffff depending on its code path: the codecs store one canonical NaN
per dtype instead (``CANONICAL_NAN``, written here independently of the codecs' own table).
"""
from __future__ import annotations

import torch

INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
            torch.float64: torch.int64}
# what torch.where(isnan(x), float("nan"), x) writes on CPU
CANONICAL_NAN = {torch.float32: 0x7FC00000, torch.float16: 0x7E00, torch.bfloat16: 0x7FC0,
                 torch.float64: 0x7FF8000000000000}
# quiet and signalling, both signs, payload bits, the x86 default NaN, the GPU's canonical NaN; for float32 also
# float16 0x7d55 and bfloat16 0x7fa5 widened exactly (payload kept, as the kernels' 16-bit loads do)
NAN_BITS = {
    torch.float32: [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FC12345, 0x7FAAA000, 0x7FA50000,
                    0x7FFFFFFF],
    torch.float16: [0x7E00, 0xFE00, 0x7C01, 0xFC01, 0x7D55, 0x7E55, 0x7FFF, 0xFFFF],
    torch.bfloat16: [0x7FC0, 0xFFC0, 0x7F81, 0xFF81, 0x7FA5, 0x7FD5, 0x7FFF, 0xFFFF],
    torch.float64: [0x7FF8000000000000, 0xFFF8000000000000, 0x7FF0000000000001, 0xFFF0000000000001,
                    0x7FF4000000000000, 0x7FF8123456789ABC, 0x7FFFFFFFFFFFFFFF, 0xFFFFFFFFFFFFFFFF],
}
GROUPS = len(NAN_BITS[torch.float32]) + 5


def nan_tensor(dtype: torch.dtype) -> torch.Tensor:
    """``NAN_BITS[dtype]`` as a tensor of ``dtype``, built through an integer view (no float cast touches them)."""
    width = 8 * torch.empty(0, dtype=dtype).element_size()
    signed = [b - (1 << width) if b >> (width - 1) else b for b in NAN_BITS[dtype]]
    return torch.tensor(signed, dtype=INT_VIEW[dtype]).view(dtype)


def nan_payload_groups(dtype: torch.dtype, group: int = 32, tail: int = 0) -> torch.Tensor:
    """``GROUPS`` groups of ``group`` random values, then ``tail`` more: one NaN encoding in each of the first
    groups, then +Inf with -Inf, all +Inf and all -Inf (whose differences are NaN), a NaN with an Inf, a finite
    group; the tail holds a NaN too. ``dtype``'s own encodings, written through an integer view."""
    nans = nan_tensor(dtype).view(INT_VIEW[dtype])
    x = torch.randn(GROUPS * group + tail, generator=torch.Generator().manual_seed(group + tail)).to(dtype)
    bits = x.view(INT_VIEW[dtype])
    for g, pattern in enumerate(nans):
        bits[g * group + (5 * g + 3) % group] = pattern
    inf_groups = x[len(nans) * group:].narrow(0, 0, 4 * group).view(4, group)
    inf_groups[0, 1], inf_groups[0, 7] = float("inf"), float("-inf")
    inf_groups[1], inf_groups[2] = float("inf"), float("-inf")
    inf_groups[3, 0] = float("inf")
    bits[(len(nans) + 3) * group + 9] = nans[2]
    if tail:
        bits[-1 - tail // 2] = nans[1]
    return x


def assert_nans_canonical(t: torch.Tensor) -> None:
    """``t`` holds NaNs, each with its dtype's canonical encoding."""
    nan = torch.isnan(t)
    assert nan.any(), "no NaN to check"
    found = {int(v) for v in t.view(INT_VIEW[t.dtype])[nan].unique()}
    assert found == {CANONICAL_NAN[t.dtype]}, f"NaN encodings {sorted(map(hex, found))}"
