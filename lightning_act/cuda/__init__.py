"""CUDA kernels (CuPy ``RawModule``), compiled at run time from the ``.cu`` sources shipped beside this file."""
from __future__ import annotations

import importlib.util

INSTALL_HINT = "pip install 'lightning-act[cuda13]' on CUDA 13, 'lightning-act[cuda12]' on CUDA 12 (torch.version.cuda)"


def cupy_available() -> bool:
    """True when CuPy can be imported (it is never imported by this check)."""
    return importlib.util.find_spec("cupy") is not None


def require_cupy():
    """Import CuPy or raise an ImportError that says how to install it."""
    try:
        import cupy
    except ImportError as err:
        raise ImportError(f"backend='cupy' needs CuPy, which is not installed: {INSTALL_HINT}") from err
    return cupy


def use_cupy_kernels(backend: str, t, supported: bool = True) -> bool:
    """Whether a codec runs its CuPy kernels on tensor ``t``: never with backend='torch', nor for a format the
    kernels do not take (``supported`` False: the torch path runs, on the same device, so no saved tensor fails
    for its format); otherwise always with 'cupy' (then ``t`` must be a CUDA tensor), and with 'auto' for CUDA
    tensors when CuPy imports."""
    if backend == "torch":
        return False
    if backend == "cupy":
        if t.device.type != "cuda":
            raise ValueError(f"backend='cupy' runs on CUDA tensors; got a tensor on {t.device} "
                             f"(use backend='auto' or 'torch' for CPU tensors)")
        return supported
    return t.is_cuda and supported and cupy_available()
