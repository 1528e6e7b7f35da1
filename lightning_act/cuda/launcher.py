"""Kernel launching shared by every backend that can run the ``.cu`` sources beside this file.

Launch functions (e.g. :mod:`lightning_act.cuda.quantize`) check tensors, compute grid, block and dynamic shared
memory, pack the kernel arguments as typed NumPy scalars (pointers as ``uint64`` data pointers: tensors are never
copied) and hand all of it to a :class:`KernelRunner`. :class:`CupyRunner` runs it on a GPU; the test suite's
emulator (``tests/cuda_emulation``) runs the very same source, grid and arguments on CPU threads.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import struct
import threading
from collections.abc import Mapping
from importlib import resources
from typing import Iterator, NamedTuple, Protocol, Sequence

import numpy as np
import torch

from .._warn import warn_user

# NVRTC options; tests/test_nvcc_compile.py compiles with the same ones. Kernels use explicit __f*_rn ops
# where the spec needs exact IEEE results; --fmad=false also keeps the compiler from contracting any other.
NVRTC_OPTIONS = ("--std=c++17", "--fmad=false")
WARP_SIZE = 32
Dim3 = tuple[int, int, int]
# common.cuh's DTYPE_* codes of the float dtypes kernels read and write
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}
# Grid cap; kernels grid-stride beyond it (tests lower it to exercise those loops).
MAX_BLOCKS = 1 << 20


# Device code every kernel source shares (RNG, 16-bit floats, ...): NVRTC has no #include, so it is prepended.
COMMON_SOURCE = "common.cuh"


def _read(name: str) -> str:
    return resources.files(__package__).joinpath(name).read_text()


def kernel_source(name: str) -> str:
    """The compilation unit of a ``.cu`` file shipped in this package: ``common.cuh`` then the file, with a
    ``#line`` directive so compiler messages name the file and line of the kernel source."""
    return f'{_read(COMMON_SOURCE)}\n#line 1 "{name}"\n{_read(name)}'


def kernel_files() -> list[str]:
    """Names of the ``.cu`` files shipped in this package."""
    return sorted(p.name for p in resources.files(__package__).iterdir() if p.name.endswith(".cu"))


class KernelRunner(Protocol):
    """Something that runs a kernel of a shipped ``.cu`` file on tensors of one ``device_type``."""

    device_type: str

    def launch(self, source: str, kernel: str, grid: Dim3, block: Dim3, args: Sequence[np.generic],
               shared_mem: int, device: torch.device) -> None: ...


# How CupyRunner launches: "driver" writes the arguments into a block prepared once per kernel and thread and calls
# cuLaunchKernel through CuPy's driver binding; "cupy" calls CuPy's Function (which wraps every argument in an
# object per launch: on an H100 host about 18 µs a launch, several per saved tensor). The environment variable
# picks one for a process, the default "driver".
LAUNCH_MODES = ("driver", "cupy")
LAUNCH_ENV = "LIGHTNING_ACT_KERNEL_LAUNCH"


def launch_mode(mode: str | None = None) -> str:
    """``mode``, else ``$LIGHTNING_ACT_KERNEL_LAUNCH``, else ``"driver"``; a ValueError names any other value."""
    source = "launch"
    if mode is None:
        mode, source = os.environ.get(LAUNCH_ENV, "driver"), LAUNCH_ENV
    if mode not in LAUNCH_MODES:
        raise ValueError(f"{source}={mode!r}; expected one of {', '.join(map(repr, LAUNCH_MODES))}")
    return mode


# Bytes per argument slot of a KernelArguments block: every scalar a kernel takes fits, each slot 8-byte aligned.
ARGUMENT_SLOT = 8
_STRUCT_CODES = {np.dtype(t): code for t, code in (
    (np.uint64, "Q"), (np.int64, "q"), (np.uint32, "I"), (np.int32, "i"), (np.uint16, "H"), (np.int16, "h"),
    (np.uint8, "B"), (np.int8, "b"), (np.float32, "f"), (np.float64, "d"))}


class KernelArguments:
    """A kernel's arguments as ``cuLaunchKernel`` reads them: each value in an 8-byte slot of one ctypes buffer, and
    an array of pointers to the slots at ``address``. Built once per kernel and thread from the types of its first
    launch's arguments (NumPy scalars, as every launcher passes); :meth:`pack` writes a launch's values in place
    with one ``struct.pack_into`` (the driver copies them before the launch returns, so the block is reused at
    once). Float values pass through a Python float: exact for every value but signalling NaNs (the launchers'
    float arguments are finite error bounds)."""

    __slots__ = ("address", "_buffer", "_pointers", "pack")

    def __init__(self, args: Sequence[np.generic]):
        codes = []
        for position, arg in enumerate(args):
            code = _STRUCT_CODES.get(getattr(arg, "dtype", None))
            if code is None:
                raise TypeError(f"kernel argument {position} is {type(arg).__name__}; expected a NumPy scalar of "
                                f"one of {', '.join(str(d) for d in _STRUCT_CODES)}")
            codes.append(f"{code}{ARGUMENT_SLOT - arg.dtype.itemsize}x")
        self._buffer = ctypes.create_string_buffer(ARGUMENT_SLOT * max(len(args), 1))
        base = ctypes.addressof(self._buffer)
        self._pointers = (ctypes.c_void_p * max(len(args), 1))(*[base + ARGUMENT_SLOT * i for i in range(len(args))])
        self.address = ctypes.addressof(self._pointers)
        # "=": native byte order (the device's: little-endian), no alignment beyond the explicit padding
        self.pack = functools.partial(struct.Struct("=" + "".join(codes)).pack_into, self._buffer, 0)


class CupyRunner:
    """Runs kernels with CuPy: one ``RawModule`` per (source, device), compiled on first use, launched on the
    current torch CUDA stream of the tensors' device, without host synchronisation.

    A launch is on the hot path (several per saved tensor), so everything that can be is built once: the
    compiled function per (source, kernel, device); with ``launch="driver"`` (the default, see :func:`launch_mode`)
    a :class:`KernelArguments` block per kernel and thread, launched on torch's raw stream handle through
    ``cupy.cuda.driver.launchKernel``; with ``"cupy"``, CuPy's own call and one CuPy stream object per torch stream.
    A CuPy device context is entered only when torch's current device is not the tensors'."""

    device_type = "cuda"

    def __init__(self, launch: str | None = None):
        from . import require_cupy

        self.launch_mode = launch_mode(launch)
        self._cupy = require_cupy()
        self._modules = {}  # (source, device index) -> RawModule
        self._functions = {}  # (source, kernel, device index) -> RawKernel
        self._streams = {}  # (device index, raw cudaStream_t) -> cupy ExternalStream
        self._multiprocessors = {}  # device index -> SM count, read once
        self._thread = threading.local()  # .blocks: (source, kernel, device index) -> (CUfunction, KernelArguments)
        # torch's current device: the C binding where torch has it (it initialises CUDA itself), without
        # torch.cuda.current_device's Python layer, read on every launch
        self._current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
        # "driver" by default falls back to CuPy's call where the binding is missing or refuses the first launch;
        # "driver" asked for by name (argument or environment) raises instead
        self._driver_chosen = self.launch_mode == "driver" and (launch is not None or LAUNCH_ENV in os.environ)
        launch_kernel = getattr(getattr(self._cupy.cuda, "driver", None), "launchKernel", None)
        if self.launch_mode == "driver" and launch_kernel is None:
            if self._driver_chosen:
                raise RuntimeError(f"launch='driver' needs cupy.cuda.driver.launchKernel, which CuPy "
                                   f"{getattr(self._cupy, '__version__', '?')} lacks; use launch='cupy'")
            self.launch_mode = "cupy"
        if self.launch_mode == "driver":
            self._launch, self._launch_kernel = self._launch_first, launch_kernel
        else:
            self._launch = self._launch_call

    def _function(self, source: str, kernel: str, device_index: int):
        function_key = (source, kernel, device_index)
        if function_key not in self._functions:
            module_key = (source, device_index)
            if module_key not in self._modules:
                self._modules[module_key] = self._cupy.RawModule(code=kernel_source(source), options=NVRTC_OPTIONS)
            # compiles the module for the current device at its first get_function
            self._functions[function_key] = self._modules[module_key].get_function(kernel)
        return self._functions[function_key]

    def _stream(self, device_index: int):
        raw = _current_raw_stream(device_index)
        stream = self._streams.get((device_index, raw))
        if stream is None:
            stream = self._streams[(device_index, raw)] = self._cupy.cuda.ExternalStream(raw, device_index)
        return stream

    def multiprocessors(self, device: torch.device) -> int:
        count = self._multiprocessors.get(device.index)
        if count is None:
            index = device.index if device.index is not None else torch.cuda.current_device()
            count = self._cupy.cuda.Device(index).attributes["MultiProcessorCount"]
            self._multiprocessors[device.index] = count
        return count

    def launch(self, source, kernel, grid, block, args, shared_mem, device):
        current = self._current_device()
        index = device.index if device.index is not None else current
        if index == current:
            self._launch(source, kernel, grid, block, args, shared_mem, index)
        else:
            with self._cupy.cuda.Device(index):
                self._launch(source, kernel, grid, block, args, shared_mem, index)

    def _launch_call(self, source, kernel, grid, block, args, shared_mem, index):
        function = self._function(source, kernel, index)
        function(grid, block, tuple(args), shared_mem=shared_mem, stream=self._stream(index))

    def _launch_first(self, source, kernel, grid, block, args, shared_mem, index):
        try:
            self._launch_driver(source, kernel, grid, block, args, shared_mem, index)
        except Exception as error:
            if self._driver_chosen:
                raise
            warn_user(f"lightning_act: launching {kernel} through cupy.cuda.driver.launchKernel failed "
                      f"({type(error).__name__}: {error}); kernels launch through CuPy's own call from now on "
                      f"({LAUNCH_ENV}=cupy skips this attempt)", RuntimeWarning)
            self.launch_mode, self._launch = "cupy", self._launch_call
            self._launch_call(source, kernel, grid, block, args, shared_mem, index)
        else:
            self._launch = self._launch_driver

    def _launch_driver(self, source, kernel, grid, block, args, shared_mem, index):
        thread = self._thread
        try:
            blocks = thread.blocks
        except AttributeError:
            blocks = thread.blocks = {}
        found = blocks.get((source, kernel, index))
        if found is None:  # RawModule.get_function gives a RawKernel: its .kernel is the device's CUfunction
            found = blocks[(source, kernel, index)] = (self._function(source, kernel, index).kernel.ptr,
                                                       KernelArguments(args))
        function, arguments = found
        arguments.pack(*args)
        self._launch_kernel(function, grid[0], grid[1], grid[2], block[0], block[1], block[2],
                            shared_mem, _current_raw_stream(index), arguments.address, 0)


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # CUDA builds of torch only


def _current_raw_stream(device_index: int) -> int:
    """The ``cudaStream_t`` of torch's current stream on a device: read without building a ``torch.cuda.Stream``
    where torch has the binding (inductor's generated code reads it the same way), else from ``current_stream``."""
    if _RAW_STREAM is not None:
        return _RAW_STREAM(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


_default_runner: CupyRunner | None = None
_override: KernelRunner | None = None


def default_runner() -> KernelRunner:
    """The runner launchers use: the one installed by :func:`use_runner`, else the process-wide CuPy runner (its
    module cache is what "compiled once per device" means)."""
    global _default_runner
    if _override is not None:
        return _override
    if _default_runner is None:
        _default_runner = CupyRunner()
    return _default_runner


def runner_override() -> KernelRunner | None:
    """The runner installed by :func:`use_runner`, if any."""
    return _override


@contextlib.contextmanager
def use_runner(runner: KernelRunner) -> Iterator[KernelRunner]:
    """Run every kernel launch on ``runner`` for the duration, and let codecs with ``backend="auto"`` or
    ``"cupy"`` take the kernel path for tensors on ``runner.device_type`` (the emulator, or a no-op runner that
    measures the host cost of the CUDA path on CPU)."""
    global _override
    previous, _override = _override, runner
    try:
        yield runner
    finally:
        _override = previous


# Alignment of each part of a one_buffer allocation: 16 bytes lets kernels use vector loads and stores on it.
PART_ALIGN = 16


def one_buffer(device: torch.device, *parts: tuple[int, torch.dtype]) -> list[torch.Tensor]:
    """Flat tensors of ``(numel, dtype)`` each, as views of ONE allocation, each part starting on a
    ``PART_ALIGN`` boundary: an encoded form costs one allocator call, and its parts live and die together."""
    sizes = []  # each part's bytes, then the padding to the next boundary: one split() cuts them all
    for numel, dtype in parts:
        nbytes = numel * dtype.itemsize
        sizes += (nbytes, -nbytes % PART_ALIGN)
    pieces = torch.empty(sum(sizes), dtype=torch.uint8, device=device).split(sizes)
    return [piece if dtype == torch.uint8 else piece.view(dtype) for piece, (_, dtype) in zip(pieces[::2], parts)]


class BufferLayout(NamedTuple):
    """Where each named part of a :class:`OneBuffer` lies: built once per format and size
    (:func:`buffer_layout`), so an encode computes no offsets."""

    names: tuple[str, ...]
    numels: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]
    offsets: tuple[int, ...]  # bytes from the start, each a multiple of PART_ALIGN
    total: int  # bytes allocated, padding included
    nbytes: int  # bytes of the parts (what the encoded form stores)
    pointer_offsets: tuple[np.uint64, ...]  # offsets of the parts after the first, as kernel-argument scalars


@functools.lru_cache(maxsize=4096)
def buffer_layout(parts: tuple[tuple[str, int, torch.dtype], ...]) -> BufferLayout:
    """The layout of ``(name, numel, dtype)`` parts, each starting on a ``PART_ALIGN`` boundary."""
    offsets, offset, nbytes = [], 0, 0
    for _, numel, dtype in parts:
        offsets.append(offset)
        size = numel * dtype.itemsize
        offset += size + (-size % PART_ALIGN)
        nbytes += size
    names, numels, dtypes = zip(*parts) if parts else ((), (), ())
    return BufferLayout(names, numels, dtypes, tuple(offsets), offset, nbytes, tuple(map(np.uint64, offsets[1:])))


class OneBuffer(Mapping):
    """The parts of an encoded form, ``name -> flat tensor``, as views of ONE uint8 allocation ``data`` laid out
    by ``layout``. The views are built on first access: the kernels only need :meth:`pointers`, so an encode
    and its decode on the hot path cost one allocation and no view."""

    __slots__ = ("data", "layout", "_views", "_pointers")

    def __init__(self, data: torch.Tensor, layout: BufferLayout):
        self.data, self.layout, self._views, self._pointers = data, layout, None, None

    @classmethod
    def empty(cls, layout: BufferLayout, device: torch.device) -> "OneBuffer":
        return cls(torch.empty(layout.total, dtype=torch.uint8, device=device), layout)

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    def pointers(self) -> tuple[np.uint64, ...]:
        """Each part's data pointer as a kernel argument, in layout order (built once: encode and decode
        launch with the same ones)."""
        pointers = self._pointers
        if pointers is None:  # one scalar conversion, then NumPy scalar sums
            base = np.uint64(self.data.data_ptr())
            pointers = self._pointers = (base, *[base + offset for offset in self.layout.pointer_offsets])
        return pointers

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "OneBuffer":
        """The same parts in one copy of ``data`` on ``device``."""
        return OneBuffer(self.data.to(device, non_blocking=non_blocking), self.layout)

    def _built(self) -> dict[str, torch.Tensor]:
        views = self._views
        if views is None:
            layout, sizes = self.layout, []
            for numel, dtype, offset, end in zip(layout.numels, layout.dtypes, layout.offsets,
                                                 layout.offsets[1:] + (layout.total,)):
                sizes += (numel * dtype.itemsize, end - offset - numel * dtype.itemsize)
            pieces = self.data.split(sizes)[::2]
            views = self._views = {name: piece if dtype == torch.uint8 else piece.view(dtype)
                                   for name, dtype, piece in zip(layout.names, layout.dtypes, pieces)}
        return views

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._built()[name]

    def __contains__(self, name: object) -> bool:
        return name in self.layout.names

    def __iter__(self) -> Iterator[str]:
        return iter(self.layout.names)

    def __len__(self) -> int:
        return len(self.layout.names)

    def __repr__(self) -> str:
        return f"OneBuffer({dict(self._built())!r})"


def pointer(t: torch.Tensor) -> np.uint64:
    """A tensor's data pointer as a kernel pointer argument."""
    return np.uint64(t.data_ptr())


def check_tensor(name: str, t: torch.Tensor, *, device: torch.device, dtypes: Sequence[torch.dtype],
                 numel: int | None = None) -> None:
    """Raise ValueError, saying what was given and what is allowed, unless ``t`` can be handed to a kernel."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}; got {t.device}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} must have dtype in ({allowed}); got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous; got strides {t.stride()}")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} must have {numel} elements; got {t.numel()}")


def check_dtype(name: str, dtype: torch.dtype, allowed=DTYPE_CODES) -> None:
    """Raise ValueError naming ``dtype`` and the allowed ones unless a kernel reads or writes it."""
    if dtype not in allowed:
        raise ValueError(f"{name}={dtype}; expected one of {', '.join(map(str, allowed))}")


def check_runner_device(runner: KernelRunner, device: torch.device) -> None:
    if device.type != runner.device_type:
        raise ValueError(f"tensors must be on a {runner.device_type} device for {type(runner).__name__}; "
                         f"got {device}")


# Grids are sized to the GPU: a runner with a ``multiprocessors(device)`` method reports its SM count (CupyRunner:
# read once per device); others (the emulator, no-op runners) get this one, an H100's.
DEFAULT_MULTIPROCESSORS = 132


def multiprocessors(runner: KernelRunner, device: torch.device) -> int:
    count = getattr(runner, "multiprocessors", None)
    return DEFAULT_MULTIPROCESSORS if count is None else count(device)


def warps_grid(units: int, warps_per_block: int, max_blocks: int) -> tuple[Dim3, Dim3]:
    """Grid and block for kernels that give each of ``units`` work items one warp (grid-stride beyond
    ``max_blocks``)."""
    blocks = min(-(-units // warps_per_block), max_blocks)
    return (blocks, 1, 1), (warps_per_block * WARP_SIZE, 1, 1)
