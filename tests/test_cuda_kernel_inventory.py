"""Every kernel of every ``.cu`` under ``lightning_act/cuda/``, by name: an input whose encode and decode
launch it, run on the emulator and compared bit for bit with the torch reference (the per-codec files test
each codec in depth; this one makes sure no kernel goes untested). A kernel added to a ``.cu`` without an
entry in ``KERNEL_INPUTS`` fails ``test_every_kernel_is_listed``."""
from pathlib import Path

import pytest
import torch

import lightning_act.cuda
from tests import test_cuda_division, test_cuda_lorenzo, test_cuda_quantize
from tests.cuda_emulation.emulator import EmulatorRunner, kernel_names, requires_gxx
from tests.test_cuda_quantize import DTYPES

CUDA_DIR = Path(lightning_act.cuda.__file__).parent


def _quantize(runner, dtype):
    x = (torch.randn(3, 300) * 2).to(dtype)  # 900 elements: the last group of 256 is partial
    test_cuda_quantize.check_encode_and_decode(runner, x, 4, 256, torch.float32)


def _division(runner, dtype):
    x = torch.randn(2, 3, 13, 10).to(dtype)  # spatial sizes not divisible by the block of 8
    test_cuda_division.check_encode_and_decode(runner, x.view(6, 13, 10), 8, 2)


def _lorenzo_with_escapes(runner, dtype):
    """Smooth runs (Lorenzo blocks), noise (raw codes) and NaN/Inf, which escape: every lorenzo kernel runs."""
    x = test_cuda_lorenzo._data("mixed", 700)
    x[::97] = float("nan")
    x[5::131] = float("inf")
    test_cuda_lorenzo.check_encode_and_decode(runner, x.to(dtype), 1e-2)


KERNEL_INPUTS = {
    "quantize.cu": {"quantize_encode": _quantize, "quantize_decode": _quantize},
    "division.cu": {"division_lfc": _division, "division_stats": _division, "division_encode": _division,
                    "division_decode": _division},
    "lorenzo.cu": {"lorenzo_header": _lorenzo_with_escapes, "lorenzo_payload": _lorenzo_with_escapes,
                   "lorenzo_decode": _lorenzo_with_escapes, "lorenzo_scatter": _lorenzo_with_escapes},
}


def test_every_kernel_is_listed():
    sources = {path.name: kernel_names(path.read_text()) for path in sorted(CUDA_DIR.glob("*.cu"))}
    assert {name: sorted(kernels) for name, kernels in sources.items()} == \
           {name: sorted(kernels) for name, kernels in KERNEL_INPUTS.items()}


@pytest.mark.parametrize("source, kernel, check", [(source, kernel, check)
                                                   for source, kernels in KERNEL_INPUTS.items()
                                                   for kernel, check in kernels.items()],
                         ids=lambda value: value if isinstance(value, str) else "")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.toolchain
@requires_gxx
def test_kernel_runs_bit_identical_to_the_reference(source, kernel, check, dtype):
    torch.manual_seed(0)
    runner = EmulatorRunner()
    check(runner, dtype)  # asserts every output equals the torch reference bit for bit
    launched = {(name, k) for name, k, *_ in runner.launches}
    assert (source, kernel) in launched, f"{kernel} was not launched; launched: {sorted(launched)}"
