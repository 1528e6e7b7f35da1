"""What the CUDA kernel tests share: bit-for-bit equality, refusal before any launch, and per format the check
that emulated kernels and torch reference agree on encode and decode."""
from __future__ import annotations

import pytest
import torch

from lightning_act.cuda.division import division_decode_cuda, division_encode_cuda
from lightning_act.cuda.lorenzo import lorenzo_decode_cuda, lorenzo_encode_cuda
from lightning_act.cuda.quantize import dequantize_cuda, quantize_cuda
from lightning_act.formats.division import division_decode_reference, division_encode_reference
from lightning_act.formats.lorenzo import lorenzo_decode_reference, lorenzo_encode_reference, reserved_payload_bytes
from lightning_act.formats.quantize import dequantize_reference, quantize_reference
from tests.cuda_emulation.emulator import EmulatorRunner
from tests.cuda_emulation.nan_payloads import INT_VIEW

# Every float dtype the kernels read (lorenzo's take fewer: lightning_act.cuda.lorenzo.KERNEL_DTYPES).
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, zero_sign_free: bool = False):
    """Same dtype, shape and bits (``zero_sign_free``: +0 and -0 count as equal)."""
    assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape)
    if not actual.is_floating_point():
        assert torch.equal(actual, expected)
        return
    loose = torch.zeros_like(expected, dtype=torch.bool)
    if zero_sign_free:
        assert torch.equal(actual == 0, expected == 0), "zero positions differ"
        loose = expected == 0
    a, e = actual.view(INT_VIEW[actual.dtype]), expected.view(INT_VIEW[expected.dtype])
    assert torch.equal(a[~loose], e[~loose]), f"{int((a != e)[~loose].sum())} elements differ in their bits"


def assert_refused_before_launch(call, match):
    """``call(runner)`` raises ValueError matching ``match`` before launching anything."""
    runner = EmulatorRunner()
    with pytest.raises(ValueError, match=match):
        call(runner)
    assert runner.launches == []


def assert_same_encoding(actual, expected):
    """(payload, mn, step) of the kernel == of the reference."""
    assert_same_bits(actual[0], expected[0])
    for a, e in zip(actual[1:], expected[1:]):
        assert_same_bits(a, e, zero_sign_free=True)


def check_quantize(runner, x, bits, group_size, stats_dtype, seed=3, key=11):
    """Emulated kernels == torch reference: encode outputs, and decode of the reference's encoding."""
    expected = quantize_reference(x, bits, group_size, stats_dtype, seed, key)
    assert_same_encoding(quantize_cuda(x.contiguous(), bits, group_size, stats_dtype, seed, key, runner=runner),
                         expected)
    decode_args = (*expected, x.numel(), bits, group_size, x.dtype)
    assert_same_bits(dequantize_cuda(*decode_args, runner=runner), dequantize_reference(*decode_args))


def check_division(runner, x, block, bits, seed=3, key=11):
    """Emulated kernels == torch reference on ``x`` (planes x spatial): encode outputs, and decode of the
    reference's encoding."""
    expected = division_encode_reference(x, block, bits, seed, key)
    lfc, payload, mn, step = division_encode_cuda(x.contiguous(), block, bits, seed, key, runner=runner)
    assert_same_bits(lfc, expected[0])
    assert_same_bits(payload, expected[1])
    assert_same_bits(mn, expected[2], zero_sign_free=True)
    assert_same_bits(step, expected[3], zero_sign_free=True)
    decode_args = (*expected, x.shape[0], tuple(x.shape[1:]), block, bits, x.dtype)
    assert_same_bits(division_decode_cuda(*decode_args, runner=runner), division_decode_reference(*decode_args))


def check_lorenzo(runner, flat, error_bound):
    """Emulated kernels == torch reference: the header, the payload's first bytes and its size (kept on the device
    by the kernels, whose payload buffer is the reservation), then decode of the reference's encoding both ways."""
    expected = lorenzo_encode_reference(flat, error_bound)
    encoded, payload_bytes = lorenzo_encode_cuda(flat.contiguous(), error_bound, runner=runner)
    assert encoded.keys() == expected.keys()
    assert_same_bits(encoded["header"], expected["header"])
    size = expected["payload"].numel()
    assert payload_bytes.tolist() == [size]
    assert encoded["payload"].numel() == reserved_payload_bytes(flat.numel(), flat.element_size())
    assert_same_bits(encoded["payload"][:size], expected["payload"])
    decode_args = (expected, flat.numel(), error_bound, flat.dtype)
    decoded = lorenzo_decode_cuda(*decode_args, runner=runner)
    assert_same_bits(decoded, lorenzo_decode_reference(*decode_args))
    # and the other way round: the torch decode of the kernels' encoding
    assert_same_bits(lorenzo_decode_reference(encoded, flat.numel(), error_bound, flat.dtype), decoded)
    return expected


def lorenzo_data(kind: str, n: int) -> torch.Tensor:
    """Test data of one ``kind``: which lorenzo block mode (raw, Lorenzo, sparse, header-only, all) it exercises."""
    gen = torch.Generator().manual_seed(n)
    if kind == "noise":  # raw codes
        return torch.randn(n, generator=gen) * 3
    if kind == "smooth":  # Lorenzo deltas
        return torch.linspace(-3, 5, n) + 0.01 * torch.randn(n, generator=gen)
    if kind == "relu":  # sparse blocks
        return torch.relu(torch.randn(n, generator=gen)) * (torch.rand(n, generator=gen) < 0.15)
    if kind == "zeros":  # header-only blocks
        return torch.zeros(n)
    if kind == "mixed":  # every mode in one tensor
        x = torch.randn(n, generator=gen)
        x[: n // 3] = torch.linspace(0, 1, n // 3)
        x[n // 3: 2 * n // 3] *= torch.rand(2 * n // 3 - n // 3, generator=gen) < 0.1
        return x
    raise ValueError(kind)
