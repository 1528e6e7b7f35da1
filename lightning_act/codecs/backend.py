"""The one place a codec's backend is chosen: the CUDA kernels (:mod:`lightning_act.cuda`) or the pure-torch
reference of its format (:mod:`lightning_act.formats`), which store the same bits. ``"compile"`` runs the torch
path through ``torch.compile`` where a format has a compiled pipeline (quantize:
:mod:`lightning_act.formats.compiled`; division: :mod:`lightning_act.formats.compiled_division`), the torch
reference elsewhere; never the kernels."""
from __future__ import annotations

import torch

from .. import cuda
from .._validate import check_choice
from ..cuda.launcher import runner_override
from .._warn import warn_user

BACKENDS = ("auto", "torch", "cupy", "compile")


def check_backend(backend: str) -> None:
    """Validate a codec's ``backend``; ``"cupy"`` needs CuPy and ``"compile"`` a working ``torch.compile`` now, not
    at the first saved tensor."""
    check_choice("backend", backend, BACKENDS)
    if backend == "cupy" and runner_override() is None:
        cuda.require_cupy()
    if backend == "compile":
        from ..formats import compiled  # torch.compile's machinery loads only for this backend

        compiled.check_available()


def uses_kernels(backend: str, t: torch.Tensor, supported: bool = True) -> bool:
    """Whether a codec runs the kernels on ``t``: never with backend='torch' or 'compile', nor for a format the
    kernels do not take (``supported`` False: the torch path runs on the same device, so no saved tensor fails for
    its format); otherwise always with 'cupy' (then ``t`` must be on the runner's device, CUDA unless a test or
    benchmark installed another runner with :func:`lightning_act.cuda.launcher.use_runner`), and with 'auto' for
    tensors on that device when CuPy imports (or another runner is installed)."""
    if backend in ("torch", "compile") or not supported:
        return False
    override = runner_override()
    device_type = override.device_type if override is not None else "cuda"
    if backend == "cupy":
        if t.device.type != device_type:
            where = "CUDA" if device_type == "cuda" else device_type
            raise ValueError(f"backend='cupy' runs on {where} tensors; got a tensor on {t.device} "
                             f"(use backend='auto' or 'torch' for CPU tensors)")
        return True
    if t.device.type != device_type:
        return False
    if override is None and not cuda.cupy_available():
        _warn_torch_path_on_cuda()
        return False
    return True


_warned_torch_path_on_cuda = False


def _warn_torch_path_on_cuda() -> None:
    """Say once per process that CUDA activations take the torch path because CuPy is missing: it stores the same
    bits, far more slowly than the kernels (what a user would otherwise only see in the step time)."""
    global _warned_torch_path_on_cuda
    if not _warned_torch_path_on_cuda:
        _warned_torch_path_on_cuda = True
        warn_user("lightning_act: CuPy is not installed, so activations on CUDA are compressed by the pure-torch "
                  f"path, 22-125x slower than the CUDA kernels on an H100: {cuda.INSTALL_HINT}. "
                  "ACTConfig(backend='compile') runs quantize and division through torch.compile instead (4-7x "
                  "slower than the kernels there, after seconds of compiling per format); "
                  "ACTConfig(backend='torch') chooses the plain path and silences this warning.")
