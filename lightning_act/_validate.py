"""User-input checks with errors that say what was given and what is allowed."""
from __future__ import annotations

import math
import re
from typing import Any, Iterable

_BYTE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KiB": 2**10, "MiB": 2**20,
               "GiB": 2**30, "TiB": 2**40}


def _fmt(values: Iterable[Any]) -> str:
    return ", ".join(repr(v) if isinstance(v, str) else str(v) for v in values)


def check_choice(field: str, value: Any, allowed: Iterable[Any]) -> None:
    allowed = tuple(allowed)
    # bool is an int subclass and 4.0 == 4: bits=True must not pass as bits=1, nor bits=4.0 as 4 (a float reaches
    # sizes and shifts, and fails there, inside autograd's hook)
    if value not in allowed or (isinstance(value, bool) and not any(isinstance(a, bool) for a in allowed)) or (
            isinstance(value, float) and not any(isinstance(a, float) for a in allowed)):
        raise ValueError(f"{field}={value!r}; expected one of {_fmt(allowed)}")


def check_int(field: str, value: Any, minimum: int, multiple_of: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or value % multiple_of:
        rule = f"an integer >= {minimum}" + (f" and a multiple of {multiple_of}" if multiple_of > 1 else "")
        raise ValueError(f"{field}={value!r}; expected {rule}")


def check_type(field: str, value: Any, types: type | tuple[type, ...], expected: str, optional: bool = False) -> None:
    """Raise TypeError naming what was given (its value, or its type) and what is expected unless ``value`` is an
    instance of ``types`` (or None, where ``optional``): an AttributeError from deep inside says neither."""
    if isinstance(value, types) or (optional and value is None):
        return
    if isinstance(value, type):
        given = f"{value.__name__} (the class, not an instance of it)"
    else:
        given = repr(value) if value is None or isinstance(value, (str, int, float)) else type(value).__name__
    raise TypeError(f"{field}={given}; expected {expected}")


def check_positive_float(field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < float(value) < float("inf")):
        raise ValueError(f"{field}={value!r}; expected a finite number > 0")


def parse_bytes(field: str, value: Any) -> int:
    """``"6GiB"``, ``"512 MB"``, ``1.5e9`` or an int as a whole number of bytes (>= 1); units as in ``_BYTE_UNITS``,
    case-insensitive."""
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([KMGT]i?B|B)?\s*", value, re.IGNORECASE)
        if match is not None:
            units = {name.upper(): size for name, size in _BYTE_UNITS.items()}
            number = float(match.group(1)) * units[(match.group(2) or "B").upper()]
            if number >= 1:
                return int(number)
    elif not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value >= 1:
        return int(value)
    raise ValueError(f"{field}={value!r}; expected a number of bytes >= 1 or a size such as '6GiB' or '512 MB' "
                     f"(units: {', '.join(_BYTE_UNITS)})")
