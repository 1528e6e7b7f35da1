"""The float dtypes the formats take and the one NaN each of them stores.

NaN payloads are not portable (x86 propagates an operand's, a GPU returns 0x7fffffff, casts to bfloat16
differ between code paths), so every NaN a lossy format stores or decodes is ``CANONICAL_NAN`` of its dtype:
positive, quiet, no payload, written through an integer view.
"""
from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# The one NaN the formats store per dtype (what torch.where(isnan(x), nan, x) writes on CPU), and the integer
# dtype it is written through.
INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
            torch.float64: torch.int64}
CANONICAL_NAN = {torch.float32: 0x7FC00000, torch.float16: 0x7E00, torch.bfloat16: 0x7FC0,
                 torch.float64: 0x7FF8000000000000}


def require_tensor(codec: str, x: object) -> None:
    """Raise ValueError unless ``x`` is a tensor (a codec used on its own may be handed a list or an array)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{codec} codec encodes a torch.Tensor; got {type(x).__name__}")


def check_float_input(codec: str, x: torch.Tensor) -> None:
    """Raise ValueError naming the given dtype and the allowed ones unless ``x`` is a float tensor a codec takes."""
    if getattr(x, "dtype", None) not in FLOAT_DTYPES:
        require_tensor(codec, x)
        allowed = "/".join(str(d).removeprefix("torch.") for d in FLOAT_DTYPES)
        raise ValueError(f"{codec} codec takes {allowed} tensors; got dtype={x.dtype}")


def canonical_nan_(t: torch.Tensor) -> torch.Tensor:
    """Overwrite every NaN of ``t`` with ``CANONICAL_NAN`` of its dtype, in place, and return ``t``. Bits are
    written through an integer view: a float NaN constant would be cast, and casts of NaN differ by device."""
    t.view(INT_VIEW[t.dtype]).masked_fill_(torch.isnan(t), CANONICAL_NAN[t.dtype])
    return t


