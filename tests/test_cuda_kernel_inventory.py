"""Every kernel of every ``.cu`` under ``lightning_act/cuda/``, by name: an input whose encode and decode
launch it, run on the emulator and compared bit for bit with the torch reference (the per-codec files test
each codec in depth; this one makes sure no kernel goes untested), for every dtype the kernel takes, with NaNs
of every encoding in each input. A kernel added to a ``.cu`` without an entry in ``KERNEL_INPUTS`` fails
``test_every_kernel_is_listed``."""
from pathlib import Path

import pytest
import torch

import lightning_act.cuda
from lightning_act.cuda.lorenzo import KERNEL_DTYPES
from tests.cuda_emulation.checks import DTYPES, check_division, check_lorenzo, check_quantize, lorenzo_data
from tests.cuda_emulation.emulator import EmulatorRunner, kernel_names, requires_gxx
from tests.cuda_emulation.nan_payloads import nan_payload_groups

CUDA_DIR = Path(lightning_act.cuda.__file__).parent


def _quantize(runner, dtype):
    # 900 random elements, then 416 with NaNs and Infs: the last group of 256 is partial
    x = torch.cat([(torch.randn(900) * 2).to(dtype), nan_payload_groups(dtype, 32)])
    check_quantize(runner, x, 4, 256, torch.float32)


def _division(runner, dtype):
    # planes of 13 x 10, not divisible by the block of 8; the last 13 planes hold NaNs and Infs
    x = torch.cat([torch.randn(6 * 130).to(dtype), nan_payload_groups(dtype, 130)])
    check_division(runner, x.view(-1, 13, 10), 8, 2)


def _lorenzo_with_escapes(runner, dtype):
    """Smooth runs (Lorenzo blocks), noise (raw codes) and NaN/Inf, which escape (verbatim blocks): every lorenzo
    kernel runs."""
    x = torch.cat([lorenzo_data("mixed", 700).to(dtype), nan_payload_groups(dtype, 32)])
    check_lorenzo(runner, x, 1e-2)


KERNEL_INPUTS = {
    "quantize.cu": {"quantize_encode": _quantize, "quantize_decode": _quantize},
    "division.cu": {"division_lfc": _division, "division_stats": _division, "division_encode": _division,
                    "division_decode": _division},
    "lorenzo.cu": {"lorenzo_header": _lorenzo_with_escapes, "lorenzo_payload": _lorenzo_with_escapes,
                   "lorenzo_sizes": _lorenzo_with_escapes, "lorenzo_decode": _lorenzo_with_escapes},
}
SOURCE_DTYPES = {"quantize.cu": DTYPES, "division.cu": DTYPES, "lorenzo.cu": KERNEL_DTYPES}


def test_every_kernel_is_listed():
    sources = {path.name: kernel_names(path.read_text()) for path in sorted(CUDA_DIR.glob("*.cu"))}
    assert {name: sorted(kernels) for name, kernels in sources.items()} == \
           {name: sorted(kernels) for name, kernels in KERNEL_INPUTS.items()}


@pytest.mark.parametrize("source, kernel, check, dtype", [(source, kernel, check, dtype)
                                                          for source, kernels in KERNEL_INPUTS.items()
                                                          for kernel, check in kernels.items()
                                                          for dtype in SOURCE_DTYPES[source]],
                         ids=lambda value: "" if callable(value) else str(value))
@pytest.mark.toolchain
@requires_gxx
def test_kernel_runs_bit_identical_to_the_reference(source, kernel, check, dtype):
    torch.manual_seed(0)
    runner = EmulatorRunner()
    check(runner, dtype)  # asserts every output equals the torch reference bit for bit
    launched = {(name, k) for name, k, *_ in runner.launches}
    assert (source, kernel) in launched, f"{kernel} was not launched; launched: {sorted(launched)}"
