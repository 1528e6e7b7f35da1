"""CUDA kernels (CuPy ``RawModule``), compiled at run time from the ``.cu`` sources shipped beside this file."""
from __future__ import annotations

import functools
import importlib.util

INSTALL_HINT = "pip install 'lightning-act[cuda13]' on CUDA 13, 'lightning-act[cuda12]' on CUDA 12 (torch.version.cuda)"


@functools.cache
def cupy_available() -> bool:
    """True when CuPy can be imported (it is never imported by this check; looked up once per process, since the
    codecs ask for every saved tensor)."""
    return importlib.util.find_spec("cupy") is not None


def require_cupy():
    """Import CuPy or raise an ImportError that says how to install it."""
    try:
        import cupy
    except ImportError as err:
        raise ImportError(f"backend='cupy' needs CuPy, which is not installed: {INSTALL_HINT}") from err
    return cupy
