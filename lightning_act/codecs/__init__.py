"""Codecs for saved activations, usable on their own: ``act.codecs.get("quantize", bits=2).encode(x)``."""
from __future__ import annotations

from typing import TypeVar

import torch

from .base import Codec, Packed

_REGISTRY: dict[str, type[Codec]] = {}
_DTYPE_CODECS: dict[torch.dtype, str] = {}
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


def general() -> tuple[str, ...]:
    """Names of the registered codecs that store any tensor of their dtypes (those ``ACTConfig.codec`` takes)."""
    return tuple(name for name in available() if _REGISTRY[name].general)


def register_dtype_codec(dtype: torch.dtype, name: str) -> None:
    """Make codec ``name`` the one the engine uses for every saved tensor of ``dtype`` (a lossless form)."""
    _DTYPE_CODECS[dtype] = name


def dtype_codec(dtype: torch.dtype) -> str | None:
    """The codec registered for ``dtype`` with :func:`register_dtype_codec`, if any."""
    return _DTYPE_CODECS.get(dtype)


def codec_class(name: str) -> type[Codec]:
    """The codec class registered as ``name``."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown codec {name!r}; available: {', '.join(available())}") from None


def get(name: str, **options) -> Codec:
    """Build the codec registered as ``name`` with its options (``bits=``, ``error_bound=``, ...)."""
    return codec_class(name)(**options)


# Registration happens at import of each codec module.
from . import bitmask, division, lorenzo, masks, passthrough, quantize, winner_masks  # noqa: E402,F401

__all__ = ["Codec", "Packed", "available", "codec_class", "dtype_codec", "general", "get", "register",
           "register_dtype_codec"]
