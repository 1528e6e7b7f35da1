"""Every kernel source compiles for real GPUs (sm_80, sm_90) with the options CuPy's NVRTC gets.

nvcc stands in for NVRTC here, which has no headers: a source must not #include anything. Each package kernel
is compiled as the launcher hands it to NVRTC (``common.cuh`` prepended); the emulation harness's self-test
kernel is compiled too, so what the emulator accepts stays real CUDA.
"""
import re
import subprocess
from pathlib import Path

import pytest

from lightning_act.cuda.launcher import COMMON_SOURCE, NVRTC_OPTIONS, kernel_files, kernel_source
from tests.cuda_emulation.emulator import NVCC, kernel_names, requires_nvcc

ROOT = Path(__file__).resolve().parents[1]
CUDA_DIR = ROOT / "lightning_act" / "cuda"
SELFTEST = ROOT / "tests" / "cuda_emulation" / "selftest.cu"
UNITS = [*kernel_files(), SELFTEST.name]
ARCHS = ["sm_80", "sm_90"]


def unit_text(name: str) -> str:
    return SELFTEST.read_text() if name == SELFTEST.name else kernel_source(name)


def test_there_are_kernel_sources():
    assert {"quantize.cu", "division.cu", "lorenzo.cu"} <= set(kernel_files())
    assert all(kernel_names(unit_text(name)) for name in UNITS)


@pytest.mark.parametrize("source", [*sorted(CUDA_DIR.glob("*.cu*")), SELFTEST], ids=lambda p: p.name)
def test_no_include(source):
    includes = re.findall(r"^\s*#\s*include.*$", source.read_text(), flags=re.MULTILINE)
    assert not includes, f"{source.name}: NVRTC has no headers; found {includes}"


def test_common_source_is_prepended_once():
    for name in kernel_files():
        text = kernel_source(name)
        assert text.count("__device__ __forceinline__ unsigned int mix32(") == 1, name
        assert text.startswith((CUDA_DIR / COMMON_SOURCE).read_text())


@pytest.mark.toolchain
@requires_nvcc
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", UNITS)
def test_compiles_for_gpu(name, arch, tmp_path):
    source, cubin = tmp_path / name, tmp_path / "k.cubin"  # -cubin runs ptxas too: registers, shared memory
    source.write_text(unit_text(name))
    result = subprocess.run([NVCC, *NVRTC_OPTIONS, f"-arch={arch}", "-cubin", str(source), "-o", str(cubin)],
                            capture_output=True, text=True)
    assert result.returncode == 0, f"nvcc -arch={arch} failed on {name}:\n{result.stderr}"
    assert "warning" not in result.stderr.lower(), result.stderr
    # extern "C": each kernel keeps its plain name (CuPy's get_function looks it up by name)
    for kernel in kernel_names(source.read_text()):
        assert b".text." + kernel.encode() + b"\0" in cubin.read_bytes(), f"{kernel} not in the cubin under its name"
