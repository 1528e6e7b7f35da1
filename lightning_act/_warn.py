"""Warnings attributed to the user's code."""
from __future__ import annotations

import contextlib
import os
import sys
import warnings

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_CONTEXTLIB = contextlib.__file__


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the first caller outside lightning_act, past the ``contextlib`` frames its
    context managers are entered through. A fixed ``stacklevel`` names a library line (or contextlib's) as soon as
    one call path to the warning differs from another: ``with compressor.compress():`` is eight frames above a
    model preparation's forward context."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and (frame.f_code.co_filename.startswith(_PACKAGE)
                                        or frame.f_code.co_filename == _CONTEXTLIB):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1)
