"""Codecs chosen by the function that saves a tensor (lossless masks for ops whose backward needs little).

``OUTPUT_CODECS`` maps a torch function (``torch.nn.functional.relu``, ``torch.relu``, ``Tensor.relu_``, ...)
to the name of a codec for the tensors that function saves. The engine asks :func:`codec_name_for` with the
function a ``FunctionTracker`` reports while the tensor is packed; ``None`` means the default codec.
The same storage saved later by another function (the next layer needs its values) is stored again with
that function's codec: the de-duplication key includes the codec.
"""
from __future__ import annotations

from typing import Callable

import torch

OUTPUT_CODECS: dict[Callable, str] = {}


def register_op_codec(functions: tuple[Callable, ...], codec_name: str) -> None:
    """Use codec ``codec_name`` for every tensor saved while one of ``functions`` runs."""
    for fn in functions:
        OUTPUT_CODECS[fn] = codec_name


def codec_name_for(function: Callable | None, t: torch.Tensor) -> str | None:
    if function is None:
        return None
    return OUTPUT_CODECS.get(function)
