"""Every kernel source compiles for real GPUs (sm_80, sm_90) with the options CuPy's NVRTC gets.

nvcc stands in for NVRTC here, which has no headers: a source must not #include anything. The emulation
harness's self-test kernel is compiled too, so what the emulator accepts stays real CUDA.
"""
import re
import subprocess
from pathlib import Path

import pytest

from lightning_act.cuda.launcher import NVRTC_OPTIONS
from tests.cuda_emulation.emulator import NVCC, kernel_names, requires_nvcc

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "lightning_act" / "cuda").glob("*.cu")) + [ROOT / "tests" / "cuda_emulation" / "selftest.cu"]
ARCHS = ["sm_80", "sm_90"]


def test_there_are_kernel_sources():
    assert all(kernel_names(p.read_text()) for p in SOURCES)


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_no_include(source):
    includes = re.findall(r"^\s*#\s*include.*$", source.read_text(), flags=re.MULTILINE)
    assert not includes, f"{source.name}: NVRTC has no headers; found {includes}"


@pytest.mark.toolchain
@requires_nvcc
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_compiles_for_gpu(source, arch, tmp_path):
    cubin = tmp_path / "k.cubin"  # -cubin runs ptxas too: registers and shared memory are checked
    result = subprocess.run([NVCC, *NVRTC_OPTIONS, f"-arch={arch}", "-cubin", str(source), "-o", str(cubin)],
                            capture_output=True, text=True)
    assert result.returncode == 0, f"nvcc -arch={arch} failed on {source.name}:\n{result.stderr}"
    assert "warning" not in result.stderr.lower(), result.stderr
    # extern "C": each kernel keeps its plain name (CuPy's get_function looks it up by name)
    for name in kernel_names(source.read_text()):
        assert b".text." + name.encode() + b"\0" in cubin.read_bytes(), f"{name} not in the cubin under its name"
