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
from lightning_act.cuda.masks import mask_decode_cuda, mask_encode_cuda
from lightning_act.formats._bitpack import pack_bits, unpack_bits
from tests.cuda_emulation.checks import (DTYPES, assert_same_bits, check_division, check_lorenzo, check_quantize,
                                        lorenzo_data)
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


def _masks(runner, dtype):
    """x != 0 and x > 0 of 900 random values and NaNs of every encoding (bool: a random mask), decoded as 0/1 and
    as 0/scale."""
    if dtype == torch.bool:
        x = torch.rand(1000) < 0.5
    else:
        x = torch.cat([torch.randn(900).to(dtype), nan_payload_groups(dtype, 32)])
    for positive in (False,) if dtype == torch.bool else (False, True):
        assert_same_bits(mask_encode_cuda(x, positive, runner=runner), pack_bits(x.gt(0) if positive else x.bool()))
    bits, scale = pack_bits(x.bool()), torch.full((), 3, dtype=dtype)
    flags = unpack_bits(bits, x.numel())
    assert_same_bits(mask_decode_cuda(bits, x.numel(), dtype, runner=runner), flags.to(dtype))
    assert_same_bits(mask_decode_cuda(bits, x.numel(), dtype, scale, runner=runner),
                     torch.where(flags, scale, torch.zeros((), dtype=dtype)))


KERNEL_INPUTS = {
    "quantize.cu": {"quantize_encode": _quantize, "quantize_decode": _quantize},
    "division.cu": {"division_encode": _division, "division_decode": _division},
    "lorenzo.cu": {"lorenzo_encode": _lorenzo_with_escapes, "lorenzo_decode": _lorenzo_with_escapes},
    "masks.cu": {"mask_encode": _masks, "mask_decode": _masks},
}
SOURCE_DTYPES = {"quantize.cu": DTYPES, "division.cu": DTYPES, "lorenzo.cu": KERNEL_DTYPES,
                 "masks.cu": [*DTYPES, torch.bool]}


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
