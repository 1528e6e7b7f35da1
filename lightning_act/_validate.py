"""User-input checks with errors that say what was given and what is allowed."""
from __future__ import annotations

from typing import Any, Iterable


def _fmt(values: Iterable[Any]) -> str:
    return ", ".join(repr(v) if isinstance(v, str) else str(v) for v in values)


def check_choice(field: str, value: Any, allowed: Iterable[Any]) -> None:
    allowed = tuple(allowed)
    # bool is an int subclass: bits=True must not pass as bits=1
    if isinstance(value, bool) and not any(isinstance(a, bool) for a in allowed):
        raise ValueError(f"{field}={value!r}; expected one of {_fmt(allowed)}")
    if value not in allowed:
        raise ValueError(f"{field}={value!r}; expected one of {_fmt(allowed)}")


def check_int(field: str, value: Any, minimum: int, multiple_of: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or value % multiple_of:
        rule = f"an integer >= {minimum}" + (f" and a multiple of {multiple_of}" if multiple_of > 1 else "")
        raise ValueError(f"{field}={value!r}; expected {rule}")


def check_positive_float(field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < float(value) < float("inf")):
        raise ValueError(f"{field}={value!r}; expected a finite number > 0")
