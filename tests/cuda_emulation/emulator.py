"""Runs the package's ``.cu`` kernels on CPU threads, through the launcher's ``KernelRunner`` protocol.

``build`` compiles a ``.cu`` file together with ``cuda_shim.h`` into a shared library with g++ (cached in a
temp dir under a hash of the sources and flags) and exports, per ``extern "C" __global__`` kernel, a launcher
taking grid, block, dynamic shared bytes and the ``void** args`` array of cuLaunchKernel, plus a description of
the kernel's parameters. ``EmulatorRunner`` checks the launcher's packed NumPy scalars against that description
(so a wrongly typed argument fails here instead of silently on a GPU) and launches.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest

from lightning_act.cuda.launcher import kernel_source

GXX = shutil.which("g++")
NVCC = shutil.which("nvcc")
requires_gxx = pytest.mark.skipif(GXX is None, reason="needs g++ for the CUDA emulation harness")
requires_nvcc = pytest.mark.skipif(NVCC is None, reason="needs nvcc (CUDA toolkit) to compile kernels for sm_80/sm_90")

SHIM = Path(__file__).with_name("cuda_shim.h")
# -ffp-contract=off: the kernels' __f*_rn operations map to plain + - * / and must not be fused;
# -fno-strict-aliasing: kernels read and write tensors through vector types (float4, uint4), as CUDA code does
GXX_FLAGS = ("-std=c++20", "-O2", "-pthread", "-fPIC", "-shared", "-ffp-contract=off", "-fno-strict-aliasing")
CACHE_DIR = Path(tempfile.gettempdir()) / "lightning_act_cuda_emulation"
# extern "C" __global__ void [__launch_bounds__(...)] name(
KERNEL_PATTERN = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(')
MAX_PARAMS = 64
_LAUNCHES = threading.Lock()
# the launcher packs pointers as uint64 data pointers
NUMPY_KIND = {"p": "u", "i": "i", "u": "u", "f": "f"}


def kernel_names(cu_text: str) -> list[str]:
    return KERNEL_PATTERN.findall(cu_text)


def build(cu_text: str, name: str) -> Path:
    """The shared library of the CUDA source ``cu_text`` compiled for emulation (built once per content hash)."""
    exports = "".join(
        f'extern "C" void emu_launch_{name}(const unsigned* grid, const unsigned* block,'
        f' unsigned long long shared_bytes, void** args)'
        f' {{ cuda_emu::launch_packed({name}, grid, block, shared_bytes, args); }}\n'
        f'extern "C" int emu_params_{name}(char* kinds, int* sizes, int capacity)'
        f' {{ return cuda_emu::describe_params({name}, kinds, sizes, capacity); }}\n'
        for name in kernel_names(cu_text))
    unit = f'#include "{SHIM}"\n{cu_text}\n{exports}'
    # contents, not paths: the same source written elsewhere reuses the library
    digest = hashlib.sha256("\0".join([SHIM.read_text(), unit, *GXX_FLAGS]).encode())
    library = CACHE_DIR / f"{Path(name).stem}-{digest.hexdigest()[:20]}.so"
    if not library.exists():
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=CACHE_DIR) as work:
            source, built = Path(work, "unit.cpp"), Path(work, "unit.so")
            source.write_text(unit)
            result = subprocess.run([GXX, *GXX_FLAGS, str(source), "-o", str(built)], capture_output=True, text=True)
            if result.returncode:
                raise RuntimeError(f"g++ failed on {name}:\n{result.stderr}")
            os.replace(built, library)  # atomic: concurrent test processes never load a half-written file
    return library


class EmulatedModule:
    """The kernels of one compiled CUDA source: a ``.cu`` file (taken as it is), or ``text`` named ``name``."""

    def __init__(self, cu_path: Path | None = None, *, text: str | None = None, name: str = "module.cu"):
        if text is None:
            text, name = Path(cu_path).read_text(), Path(cu_path).name
        self._lib = ctypes.CDLL(str(build(text, name)))
        self.kernels = kernel_names(text)
        self.params = {name: self._describe(name) for name in self.kernels}

    def _describe(self, name: str) -> list[tuple[str, int]]:
        kinds, sizes = ctypes.create_string_buffer(MAX_PARAMS), (ctypes.c_int * MAX_PARAMS)()
        count = getattr(self._lib, f"emu_params_{name}")(kinds, sizes, MAX_PARAMS)
        return [(kinds.raw[i:i + 1].decode(), sizes[i]) for i in range(count)]

    def launch(self, kernel: str, grid, block, args, shared_mem: int) -> None:
        params = self.params[kernel]
        if len(args) != len(params):
            raise TypeError(f"{kernel} takes {len(params)} arguments; got {len(args)}")
        for i, ((kind, size), arg) in enumerate(zip(params, args)):
            dtype = np.asarray(arg).dtype
            if not isinstance(arg, np.generic) or dtype.kind != NUMPY_KIND[kind] or dtype.itemsize != size:
                raise TypeError(f"{kernel} argument {i} is {kind}{size} (p pointer, i/u int, f float, bytes); "
                                f"got {type(arg).__name__}")
        values = [np.array(arg) for arg in args]  # owned copies whose addresses the kernel reads
        pointers = (ctypes.c_void_p * len(values))(*(v.ctypes.data for v in values))
        self.launch_packed(kernel, grid, block, shared_mem, ctypes.addressof(pointers))

    def launch_packed(self, kernel: str, grid, block, shared_mem: int, params: int) -> None:
        """Launch with cuLaunchKernel's ``kernelParams``: the address of an array of pointers, one to each
        argument's value, read at the sizes of the kernel's parameters (as the driver reads them). One launch at a
        time in the process: ``__shared__`` arrays are function statics (cuda_shim.h), which two launches of a
        kernel from two Python threads would share."""
        with _LAUNCHES:
            getattr(self._lib, f"emu_launch_{kernel}")((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block),
                                                        ctypes.c_ulonglong(shared_mem), ctypes.c_void_p(params))


class EmulatorRunner:
    """``KernelRunner`` for CPU tensors: the package's ``.cu`` files run on CPU threads. Records each launch."""

    device_type = "cpu"

    def __init__(self):
        self._modules: dict[str, EmulatedModule] = {}
        self.launches: list[tuple] = []

    def module(self, source: str) -> EmulatedModule:
        if source not in self._modules:
            self._modules[source] = EmulatedModule(text=kernel_source(source), name=source)
        return self._modules[source]

    def launch(self, source, kernel, grid, block, args, shared_mem, device):
        self.launches.append((source, kernel, tuple(grid), tuple(block), tuple(args), shared_mem))
        self.module(source).launch(kernel, grid, block, args, shared_mem)
