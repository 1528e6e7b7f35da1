"""The quantize kernels' machine code, counted on CPU: a proxy of their issue cost (issue #20).

An H200 ran the quantize encode at about 1.4 elements per SM clock whatever its grid, group size or bits
(``kernel_sweep_gpu.md``): bound by the instructions it issues, most of them 32-bit integer ones, which sm_80 and
sm_90 issue at 64 lanes a clock against 128 for float ones (``roofline_cuda.md``). What a change to the kernels
does to that count is visible without a GPU: nvcc compiles ``quantize.cu`` as the launcher hands it to NVRTC, and
nvdisasm lists each instantiation's SASS. Per instantiation (bits, input dtype) this reports the instructions by
class (integer, float, conversion, memory, shuffle and vote, control; ``CLASSES``), the registers and spills
ptxas reports, and two segments of the encode's path: the quantize block (from the reciprocal of the step to the
payload's store: a chunk of 8 elements, noise hash, rounding and packing) and the reduction (from the vector load
to the first shuffle: two chunks' min, max and NaN tests). Its first use found the branch the clamp took per
element. A whole function counts every path (the element-wise path of unaligned chunks, the teams spanning warps),
so compare counts of one function across changes, not functions with each other.

Needs nvcc and nvdisasm (``pip install nvidia-cuda-nvdisasm``: ``--nvdisasm`` or the PATH, else the wheel's copy
is found); exits 2 without them.

    python benchmarks/kernel_sass.py [--arch sm_90] [--out FILE]
"""
from __future__ import annotations

import argparse
import collections
import glob
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from lightning_act.cuda.launcher import NVRTC_OPTIONS, kernel_source
from models import machine, publish

NO_TOOLS_EXIT = 2
SOURCE = "quantize.cu"
DTYPES = {"float32": 0, "float16": 1, "bfloat16": 2, "float64": 3}  # the kernels' dtype codes (common.cuh)
INSTANTIATIONS = [("encode", 4, "bfloat16"), ("encode", 4, "float32"), ("encode", 2, "bfloat16"),
                  ("decode", 4, "bfloat16"), ("decode", 4, "float32")]
# opcode (before its first '.') -> class; anything else is "other"
CLASSES = {
    "integer": {"IMAD", "IADD3", "IADD", "LOP3", "SHF", "ISETP", "SEL", "VIADD", "VIMNMX", "IMNMX", "LEA", "PRMT",
                "IABS", "POPC", "FLO", "BREV", "PLOP3", "MOV", "CS2R", "S2R", "LDC", "ULDC", "UMOV", "ULEA",
                "USHF", "ULOP3", "UIADD3", "S2UR"},
    "float": {"FADD", "FMUL", "FFMA", "FMNMX", "FSETP", "FSEL", "FCHK", "MUFU"},
    "conversion": {"I2F", "I2FP", "F2I", "F2F", "FRND", "F2FP"},
    "memory": {"LDG", "STG", "LDS", "STS", "LDL", "STL", "ATOMG", "RED"},
    "shuffle and vote": {"SHFL", "VOTE"},
    "control": {"BRA", "BSSY", "BSYNC", "CALL", "RET", "EXIT", "BAR", "WARPSYNC", "NOP"},
}
INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")
SUBROUTINE = re.compile(r"^\$\w+\$(\w+):$")  # nvdisasm's label of a __noinline__ function inside a kernel
REGISTERS = re.compile(r"Function properties for (\w+)\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores[^\n]*"
                       r"(?:\n[^\n]*Used (\d+) registers)?")


def find_nvdisasm(given: str | None = None) -> str | None:
    """``given``, else nvdisasm on the PATH, else the copy the ``nvidia-cuda-nvdisasm`` wheel installs."""
    if given:
        return given
    found = shutil.which("nvdisasm")
    if found:
        return found
    wheels = sorted(glob.glob(str(Path(sysconfig.get_paths()["purelib"]) / "nvidia" / "cu*" / "bin" / "nvdisasm")))
    return wheels[-1] if wheels else None


def function_name(kind: str, bits: int, dtype: str) -> str:
    """The mangled name's prefix of ``encode_groups<bits, dtype>`` or ``decode_groups<bits, dtype>``."""
    return f"_Z13{kind}_groupsILi{bits}ELi{DTYPES[dtype]}E"


def disassemble(arch: str, nvcc: str, nvdisasm: str) -> tuple[dict[str, list[str]], str]:
    """``(function -> its opcodes in order, ptxas's report)`` of quantize.cu compiled for ``arch``: the kernels and
    the ``__noinline__`` functions inside them, each under its own name."""
    with tempfile.TemporaryDirectory() as work:
        source, cubin = Path(work, SOURCE), Path(work, "quantize.cubin")
        source.write_text(kernel_source(SOURCE))
        built = subprocess.run([nvcc, *NVRTC_OPTIONS, f"-arch={arch}", "-cubin", "-Xptxas", "-v", str(source),
                                "-o", str(cubin)], capture_output=True, text=True)
        if built.returncode:
            raise RuntimeError(f"nvcc failed on {SOURCE}:\n{built.stderr}")
        listing = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    functions: dict[str, list[str]] = {}
    current = None
    for line in listing.splitlines():
        if line.startswith(".text."):
            current = functions.setdefault(line[len(".text."):].rstrip(":"), [])
        elif (sub := SUBROUTINE.match(line)) is not None:
            current = functions.setdefault(sub.group(1), [])
        elif current is not None and (op := INSTRUCTION.match(line)) is not None:
            current.append(op.group(1))  # the opcode without its modifiers
    return functions, built.stderr


def lookup(functions: dict[str, list[str]], prefix: str) -> tuple[str, list[str]]:
    """``(name, opcodes)`` of the one function whose name starts with ``prefix``."""
    matches = [(name, ops) for name, ops in functions.items() if name.startswith(prefix)]
    if len(matches) != 1:
        raise ValueError(f"{len(matches)} functions named {prefix}...; expected one (has quantize.cu changed?)")
    return matches[0]


def classify(ops: list[str]) -> dict[str, int]:
    counts = collections.Counter()
    for op in ops:
        counts[next((c for c, members in CLASSES.items() if op in members), "other")] += 1
    return {c: counts[c] for c in [*CLASSES, "other"]}


def segment(ops: list[str], start: str, first: str, end: str) -> list[str]:
    """The opcodes from the last ``start`` before the first ``first`` to the first ``end`` after it (``first``
    marks the segment; ``start`` and ``end`` bound it), or [] where the function lacks them."""
    if first not in ops:
        return []
    marker = ops.index(first)
    begin = max((i for i in range(marker) if ops[i] == start), default=None)
    stop = next((i for i in range(marker, len(ops)) if ops[i] == end), None)
    return [] if begin is None or stop is None else ops[begin:stop + 1]


def resources(report: str) -> dict[str, tuple[int, int]]:
    """function -> (registers, spill-store bytes) from ptxas -v; registers 0 where ptxas gives none (callees)."""
    return {m.group(1): (int(m.group(4) or 0), int(m.group(3))) for m in REGISTERS.finditer(report)}


def measure(arch: str, nvcc: str, nvdisasm: str) -> list[dict]:
    functions, report = disassemble(arch, nvcc, nvdisasm)
    used = resources(report)
    rows = []
    for kind, bits, dtype in INSTANTIATIONS:
        name, ops = lookup(functions, function_name(kind, bits, dtype))
        kernel = "quantize_" + kind
        row = {"function": f"{kind}_groups<{bits}, {dtype}>", "instructions": len(ops), **classify(ops),
               "registers": used.get(kernel, (0, 0))[0], "spill_bytes": used.get(name, (0, 0))[1]}
        if kind == "encode":
            quantize = segment(ops, "MUFU", "I2FP", "STG")  # the step's reciprocal .. the payload's store
            reduction = segment(ops, "LDG", "SHFL", "SHFL")  # the last load before the first shuffle
            row["quantize_block"] = len(quantize)
            row["quantize_block_branches"] = sum(op in ("BRA", "BSSY", "BSYNC") for op in quantize)
            row["quantize_block_integer"] = classify(quantize)["integer"]
            row["reduction"] = len(reduction)
        rows.append(row)
    return rows


def report(rows: list[dict], arch: str, command: str) -> str:
    classes = [*CLASSES, "other"]
    lines = [f"# SASS of the quantize kernels ({arch})", "", f"{machine()}. Command: `{command}`", "",
             "Instructions of each `__noinline__` instantiation (every path counted once), by class; registers of "
             "its kernel and spill bytes (ptxas -v). The encode's segments: the quantize block (from the step's "
             "reciprocal to the payload store: one chunk of 8 elements; its branches and integer instructions) "
             "and the reduction (from the last vector load to the first shuffle: two chunks).", "",
             "| function | instructions | " + " | ".join(classes) + " | registers | spill bytes | quantize block "
             "(branches, integer) | reduction |",
             "|" + "---|" * (len(classes) + 6)]
    for r in rows:
        block = (f"{r['quantize_block']} ({r['quantize_block_branches']}, {r['quantize_block_integer']})"
                 if "quantize_block" in r else "")
        lines.append(f"| {r['function']} | {r['instructions']} | " + " | ".join(str(r[c]) for c in classes) +
                     f" | {r['registers']} | {r['spill_bytes']} | {block} | {r.get('reduction', '')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_90", choices=["sm_80", "sm_90"])
    parser.add_argument("--nvdisasm", help="path of nvdisasm (default: the PATH, then the pip wheel's)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    nvcc, nvdisasm = shutil.which("nvcc"), find_nvdisasm(args.nvdisasm)
    if nvcc is None or nvdisasm is None:
        print(f"kernel_sass.py needs nvcc and nvdisasm; found nvcc={nvcc}, nvdisasm={nvdisasm} "
              "(pip install nvidia-cuda-nvdisasm)", file=sys.stderr)
        return NO_TOOLS_EXIT
    rows = measure(args.arch, nvcc, nvdisasm)
    command = "python benchmarks/kernel_sass.py " + " ".join(argv if argv is not None else sys.argv[1:])
    publish(report(rows, args.arch, command.strip()), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
