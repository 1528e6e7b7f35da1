"""Codecs for saved activations, usable on their own: ``act.codecs.get("quantize", bits=2).encode(x)``."""
from __future__ import annotations

from typing import TypeVar

from .base import Codec, Packed

_REGISTRY: dict[str, type[Codec]] = {}
C = TypeVar("C", bound=type[Codec])


def register(cls: C) -> C:
    """Class decorator: make a codec reachable by its ``name``."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"codec name {cls.name!r} is already registered by {_REGISTRY[cls.name].__name__}")
    _REGISTRY[cls.name] = cls
    return cls


def available() -> tuple[str, ...]:
    """Names of the registered codecs, sorted."""
    return tuple(sorted(_REGISTRY))


def get(name: str, **options) -> Codec:
    """Build the codec registered as ``name`` with its options (``bits=``, ``error_bound=``, ...)."""
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown codec {name!r}; available: {', '.join(available())}") from None
    return cls(**options)


# Registration happens at import of each codec module.
from . import bitmask, division, lorenzo, masks, passthrough, quantize  # noqa: E402,F401

__all__ = ["Codec", "Packed", "available", "get", "register"]
