"""Roofline of the CUDA kernels (lightning_act/cuda/*.cu) by design: pure arithmetic, no GPU. Expected, unmeasured.

For each kernel and dtype: the DRAM bytes read and written per element (from the format: every byte once, see
the kernels' layout comments), the instructions a thread issues per element (counted by hand from the source,
see ``INSTRUCTIONS``), and from both the expected fraction of HBM bandwidth:

    memory time / element = bytes / (MEMORY_EFFICIENCY * bandwidth)
    issue time / element  = instructions / (SMs * 128 lanes * clock)          (4 warp schedulers an SM)
    expected fraction     = bytes / max(memory, issue time) / bandwidth

MEMORY_EFFICIENCY (0.9) is what a well-formed streaming kernel (a copy with 16-byte accesses and enough bytes in
flight) reaches on HBM; the kernels are built to be such kernels (16-byte loads, whole sectors per warp store,
a few blocks resident per SM, two chunks in flight per thread). The issue bound uses the full issue rate; the
real one is lower where memory and issue bounds are close (they overlap imperfectly). Nothing here was run on a
GPU: the table is the design target the kernels are expected to meet, to be checked by benchmarks/bench_gpu.py.

    python benchmarks/roofline_cuda.py [--bandwidth-tbs 3.35] [--sms 132] [--clock-ghz 1.755] [--out PATH]
"""
from __future__ import annotations

import argparse
from pathlib import Path

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
BITS = (1, 2, 4, 8)
MEMORY_EFFICIENCY = 0.9
LANES_PER_SM_CLOCK = 128  # 4 warp schedulers x 1 instruction x 32 lanes (sm_80, sm_90)

# Instructions a thread issues per element (lane-instructions / element), by hand from the kernels, at
# group_size 256 (quantize) and block 8 on a 2D map of 56 x 56 (division). Per-group or per-chunk work is
# divided by the elements it serves.
LOAD = {"float32": 0.25, "bfloat16": 1.1, "float16": 8, "float64": 2.5}  # 16-byte loads + conversion to float32
STORE = {"float32": 2.2, "bfloat16": 6.2, "float16": 14, "float64": 3.5}  # NaN canonical, rounding, 16-byte stores
RNG = 12  # rng.uniform24 per element: xor, mix32 (3 shift-xor pairs, 2 IMUL), >> 8, I2F, FMUL (hi32 hashed per chunk)
QUANTIZE = 7  # FSUB, FMUL, FADD, FRND.FLOOR, the clamp (NaN -> 0), F2I
INSTRUCTIONS = {
    "quantize_encode": {
        d: LOAD[d] + 3  # fminf, fmaxf, NaN flag
        + 3  # team reduction: 5 xor-shuffle steps x (2 SHFL + 2 FMNMX) / 8 elements, a vote, the broadcast
        + 4  # round_stats, IEEE reciprocal (per group slot, / 8 elements a thread)
        + QUANTIZE + RNG + 3  # packing into words, the byte store, loop and address arithmetic
        for d in DTYPE_BYTES},
    "quantize_decode": {d: 0.25 + 2 + 1 + 2 + 1 + STORE[d] for d in DTYPE_BYTES},  # load, unpack, I2F, FMUL+FADD
    "division_encode": {
        d: LOAD[d] + 0.25  # stage: the only DRAM read, into shared memory
        + 2  # block means: LDS + FADD per element
        + 10  # residual min/max: LDS, lfc load, plane walk (~4), FSUB, fminf/fmaxf/NaN flag
        + 2 + 4 + 1 + QUANTIZE + RNG + 4  # codes: LDS, lfc, walk, FSUB, quantize, RNG, pack, range checks
        for d in DTYPE_BYTES},
    "division_decode": {d: 0.25 + 2 + 1 + 2 + 1 + 4 + 1 + STORE[d] for d in DTYPE_BYTES},  # + lfc, walk, FADD
}
# masks.cu, whole tiles (a warp, 8 elements a lane): encode per element a load, the flag test on the raw bits (2, a
# 64-bit one 3; bytes 1) and a ballot; per tile the address and loop arithmetic and lane 0's two 16-byte stores
# (~16 / 8 elements). Decode per element the bit test, the select (float64: 2) and the store; per tile two
# broadcast 16-byte loads and the loop (~10 / 8 elements).
MASK_DTYPE_BYTES = {**DTYPE_BYTES, "bool": 1}
MASK_INSTRUCTIONS = {
    "mask_encode": {d: 1 + {"float64": 3, "bool": 1}.get(d, 2) + 1 + 2 for d in MASK_DTYPE_BYTES},
    "mask_decode": {d: 1 + (2 if d == "float64" else 1) + 1 + 1.25 for d in MASK_DTYPE_BYTES},
}

DESIGN = """\
## The kernels by design

| kernel | grid x block | per thread | passes over DRAM | shared memory | registers (ptxas sm_90) |
|---|---|---|---|---|---|
| `quantize_encode` | min(groups / (teams x 2), 4 x SMs) blocks of 256 threads (1024 for groups of 8192) | 2 chunks of 8 elements (one per group slot), in registers | x read once; payload and stats written once | 1 KiB (only groups spanning warps: > 256 elements) | 64 (a few bytes spilled per instantiation) |
| `quantize_decode` | as encode | 2 chunks of 8 | payload and stats read once, output written once | none | 51 |
| `division_encode` | min(planes, (1024 / threads) x SMs) blocks of 32 to 256 threads (one per 8 elements of a plane) | one chunk of 8 per phase | x read once (plane staged in shared memory when <= 12288 elements); lfc, payload, stats written once | plane x 4 bytes (<= 48 KiB) | 64 (`__launch_bounds__(256, 4)`) |
| `division_decode` | as encode | one chunk of 8 | payload, lfc, stats read once; output written once | none | 48 |
| `mask_encode` | min(tiles / 8, 8 x SMs) blocks of 256 threads (fewer warps below 8 tiles of 256 elements) | 8 elements a tile (one per ballot), element 32k + lane | x read once; payload written once (lane 0: two 16-byte stores a tile) | none | 32 (`__launch_bounds__(256, 8)`) |
| `mask_decode` | as encode | 8 elements a tile | payload read once (two 16-byte broadcast loads a tile); output written once | none | 32 |
| `lorenzo_encode` | min(tiles, 2^20) blocks of 256 threads, each claiming tiles of 1024 elements until none is left | 4 blocks of 32 values a warp (lane i: element 32 x block + i), their state in registers across the look-back | x read once (a verbatim block's values again, from L1); header and payload (0 to the input's bytes, by the data) written once; 8 bytes of scan state a tile | 1.1 KiB | 80 |
| `lorenzo_decode` | as encode | 4 blocks of 32 values a warp | header and payload read once; output written once; 8 bytes of scan state a tile | 80 B | 48 |

- **16-byte accesses.** A thread's chunk is 8 consecutive elements: float32 two 16-byte loads (stores), 16-bit
  one, float64 four (`common.cuh` `load_chunk` / `store_chunk`). The kernel checks the address
  (`((unsigned long long)p & 15) == 0`) and falls back to one element at a time for views at odd offsets and the
  tensor's last chunk; no launcher flag, no host work.
- **Codes without shuffles.** 8 codes of `bits` bits are `bits` whole bytes, so a thread writes its codes with
  one 1-, 2-, 4- or 8-byte store and a warp's store covers 32 x `bits` consecutive bytes: full 32-byte sectors,
  the same DRAM traffic a ballot/shuffle packing into 16-byte words would give, with fewer instructions.
- **Statistics in registers.** quantize: a group of `group_size` elements is `group_size / 8` threads (a
  *team*): groups of 32 to 256 are 4 to 32 lanes of one warp (32 / team groups a warp), min/max reduced by xor
  shuffles inside the team, a ballot for the NaN flag; groups of 512 to 8192 span 2 to 32 warps, each reducing
  with shuffles and then once through shared memory (two buffers, one `__syncthreads` an iteration). Group sizes
  whose chunk count neither divides 32 nor is a multiple of it (96, 160, 288, ...) leave part of the last warp of
  the team idle (correct, slower). division: one block per plane (a plane is one quantization group).
- **Grid sized to the SM count.** `CupyRunner.multiprocessors(device)` reads `MultiProcessorCount` once per
  device; the grid is at most one wave of resident blocks (registers: 1024 threads an SM) and grid-stride loops
  cover the rest. Runners that report no count (the emulator, the host-overhead benchmark's no-op runner) get
  132. One launch per kernel, as before; the launcher computes the grid from Python ints it already has.
- **Passes.** quantize: one read, one write (the format needs nothing more). division: the old encode was three
  kernels reading x three times from DRAM (block means, per-plane statistics, codes, each recomputing cell
  indices with 64-bit divisions per element); the new `division_encode` reads each plane once into shared memory
  and runs the three phases from there (one launch), walking the plane without a division per element. Planes
  over 12288 elements (float32 staging beyond the 48 KiB a block gets without opting in) are read in each phase
  from global memory: the first read from DRAM, the next two expected to hit L2 (a block's plane, e.g. 200 KB
  for 224 x 224 float32, times the resident blocks can exceed the 50 MB L2, so expect 1 to 3 DRAM reads there).
  Chunks of 8 elements shared by two planes (plane sizes not a multiple of 8) are written by each plane's block
  with a masked compare-and-swap (no ordering between blocks needed). lorenzo: a block's payload starts where the
  blocks before it end, so its format needs a prefix sum of the blocks' sizes; each kernel runs it in its one pass
  by decoupled look-back (Merrill & Garland): a thread block claims the next tile from a counter, publishes the
  tile's payload bytes, sums what the tiles before it published, 32 at a time, until one that holds its inclusive
  prefix, and publishes its own. Encode reads x once and writes header and payload once; decode reads them once.
  The previous design ran three launches a direction (a header pass and a payload pass, each reading x, around
  torch's prefix sum; a sizes kernel and the prefix sum before the decode). Not in the tables below: its
  instruction count depends on the data (block modes), and no hand count was made.
- **Masks** (`bitmask`, `positive_mask`, `scaled_mask`): a warp handles 256 consecutive elements a tile, lane l
  the elements 32k + l (each of its 8 loads a coalesced warp-wide access, all in flight before the first vote),
  and `__ballot_sync` makes each row of 32 flags one little-endian payload word. The flags are tests on the raw
  bits (no float conversion). Decode mirrors it: the tile's 32 payload bytes read by every lane at one address
  (a broadcast), element 32k + l written by lane l. The last tile and payloads not 16-byte aligned take a
  checked path (lane k: word k, or its bytes). One launch a direction; `scaled_mask` adds torch's `amax` before
  its encode (one more read of x: 2 x dtype + 1/8 bytes an element for that encode).
"""


def quantize_bytes(kernel: str, dtype: str, bits: int, group_size: int, stats_bytes: int) -> float:
    compressed = bits / 8 + 2 * stats_bytes / group_size
    return DTYPE_BYTES[dtype] + compressed


def division_bytes(dtype: str, bits: int, plane: int, cell: int) -> float:
    compressed = bits / 8 + 2 / cell + 4 / plane  # codes, bfloat16 block means, bfloat16 mn and step
    return DTYPE_BYTES[dtype] + compressed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bandwidth-tbs", type=float, default=3.35, help="HBM bandwidth, TB/s (H100 SXM: 3.35)")
    parser.add_argument("--sms", type=int, default=132, help="multiprocessors (H100 SXM: 132)")
    parser.add_argument("--clock-ghz", type=float, default=1.755, help="SM clock under load, GHz")
    parser.add_argument("--group-size", type=int, default=256)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "roofline_cuda.md")
    args = parser.parse_args()
    bandwidth = args.bandwidth_tbs * 1e12
    issue = args.sms * LANES_PER_SM_CLOCK * args.clock_ghz * 1e9
    lines = [
        "# CUDA kernels: roofline by design (expected, unmeasured)",
        "",
        f"Arithmetic, no GPU involved: HBM {args.bandwidth_tbs} TB/s, {args.sms} SMs at {args.clock_ghz} GHz "
        f"({issue / 1e12:.1f} T lane-instructions/s), memory efficiency {MEMORY_EFFICIENCY} of peak for the "
        "streaming accesses. *bytes/elem* = DRAM bytes read + written per element; *instr/elem* = instructions "
        "a thread issues per element (hand count from the source, see `INSTRUCTIONS` in "
        "`benchmarks/roofline_cuda.py`); *bound* = which limit sets the time; *HBM fraction* = bytes moved / "
        "expected time / peak bandwidth. Targets (issue 20): quantize >= 70 %, division >= 50 %.",
        "",
        DESIGN,
    ]

    def row(kernel, dtype, bits, nbytes, instructions, read, written):
        memory = nbytes / (MEMORY_EFFICIENCY * bandwidth)
        compute = instructions / issue
        seconds = max(memory, compute)
        fraction = nbytes / seconds / bandwidth
        bound = "memory" if memory >= compute else "issue"
        return (f"| {kernel} | {dtype} | {bits} | {read:.3f} | {written:.3f} | {nbytes:.3f} | {instructions:.0f} | "
                f"{bound} | {fraction:.0%} | {1 / seconds / 1e9:.0f} |")

    header = ("| kernel | dtype | bits | read B/elem | written B/elem | bytes/elem | instr/elem | bound | "
              "HBM fraction | Gelem/s |")
    rule = "|---|---|---|---|---|---|---|---|---|---|"
    lines += [f"## quantize (group_size {args.group_size}, float32 statistics)", "", header, rule]
    for kernel in ("quantize_encode", "quantize_decode"):
        for dtype in DTYPE_BYTES:
            for bits in BITS:
                compressed = bits / 8 + 2 * 4 / args.group_size
                nbytes = DTYPE_BYTES[dtype] + compressed
                read, written = ((DTYPE_BYTES[dtype], compressed) if kernel.endswith("encode")
                                 else (compressed, DTYPE_BYTES[dtype]))
                lines.append(row(kernel, dtype, bits, nbytes, INSTRUCTIONS[kernel][dtype], read, written))
    plane, cell = 56 * 56, 8 * 8
    lines += ["", "## division (planes of 56 x 56, block 8: bfloat16 block means and statistics)", "", header,
              rule]
    for kernel in ("division_encode", "division_decode"):
        for dtype in DTYPE_BYTES:
            for bits in BITS:
                compressed = bits / 8 + 2 / cell + 4 / plane
                nbytes = DTYPE_BYTES[dtype] + compressed
                read, written = ((DTYPE_BYTES[dtype], compressed) if kernel.endswith("encode")
                                 else (compressed, DTYPE_BYTES[dtype]))
                lines.append(row(kernel, dtype, bits, nbytes, INSTRUCTIONS[kernel][dtype], read, written))
    lines += ["", "## masks (1 bit per element; decode writes 0/1 or the device scale)", "", header, rule]
    for kernel in ("mask_encode", "mask_decode"):
        for dtype, size in MASK_DTYPE_BYTES.items():
            read, written = (size, 1 / 8) if kernel == "mask_encode" else (1 / 8, size)
            lines.append(row(kernel, dtype, 1, size + 1 / 8, MASK_INSTRUCTIONS[kernel][dtype], read, written))
    lines += ["", """\
## Reading the table

- **float32 in, float32 out** (quantize and division, both directions) is memory-bound by design: about 32
  instructions an element against the ~38 the issue rate allows at full bandwidth, so the kernels are expected at
  the streaming efficiency (~90 % of peak counting bytes read and written).
- **16-bit inputs** move half the bytes for the same per-element work, so the encoders become issue-bound: the
  stochastic-rounding hash (12 instructions an element, fixed by the format: rng.uniform24 must stay
  bit-identical) and the quantization (7) are most of it. bfloat16 quantize encode is expected just under the
  70 % target, float16 lower (its exact software half -> float conversion costs ~8 instructions an element); the
  division encoder adds the block means and a plane walk, so its 16-bit inputs are expected around 40-50 %.
  What would lift them: hardware conversions (`cvt.f32.f16`, proven equal on the emulator only through a
  software twin), a cheaper order-preserving min/max (`redux.sync` on integer keys), or 16 elements a thread to
  amortise per-chunk work; none is done yet.
- **Masks** do a few instructions an element (5-7), far below the issue bound at any dtype: memory-bound by
  design, bool included (1.125 bytes an element). Their element-wide loads and stores (one per lane and element)
  stay under the load/store units' rate (one warp instruction a clock per SM: 232 G warp accesses/s, 7.4 T
  elements/s here, against 2.7 T elements/s of bool at full bandwidth). One reservation: a bool encode keeps 8 bytes in flight a thread,
  16 KiB an SM at 2048 threads, about what HBM's latency asks for (~18 KiB an SM at 3.35 TB/s and ~700 ns), so
  it may fall short of the streaming efficiency; a float32 one keeps 64 KiB in flight.
- **Decoders** of 16-bit outputs pay the exact float -> half / bfloat16 rounding in software (6 to 14
  instructions an element); bfloat16 stays memory-bound, float16 is close to the issue bound.
- **Measured on an H200** (`kernel_sweep_gpu.md`, `kernel_sweep_gpu_run5b.md`: one 16 x 256 x 56 x 56
  activation, group 256, 4 bits): the quantize encode at 1.3-1.5 elements per SM clock whatever the grid (0.5-4x
  the SMs), group size or bits, 0.24-0.28 of `copy_` in bfloat16 and 0.4-0.5 in float32; the decode at 2-3
  (0.5-0.6 of `copy_`). Neither is latency-bound, and both sit well under this table. The model's issue rate is
  the cause: it counts every instruction at 128 lanes a clock, where sm_80 / sm_90 run 32-bit integer
  instructions (add, logic, shift, multiply, min/max) at 64 and conversions at 16 (the CUDA programming guide's
  throughput table). nvdisasm's listing of the sm_90 encode (bfloat16, 4 bits) shows about 41 instructions an
  element on its path, not 33: 24 in the per-element code (the noise hash about 11, all integer; the clamp and
  the packing 3 more; two conversions) and the rest per chunk (64-bit addressing, the team's reduction, the
  statistics' rounding, the stores). At about 25 integer instructions an element the integer pipe alone bounds
  the encode near 2.5 elements per SM clock; the sweep's ablations (`--ablations`) measure each part's share.
  Changes since: the encode's clamp is branch-free (it had one branch an element, which kept ptxas from
  interleaving a chunk's elements: 10-17% faster on the H200). Not yet timed on a GPU (counts from nvdisasm,
  sm_90, bfloat16, 4 bits): the noise hash's first xor-shift is done once a chunk (the quantize block 196
  instructions per 8 elements, from 218); the clamp's cap is a float min, not an integer one; a short chunk's
  padding moved into the load's element path, so a whole chunk's min/max pays no select (69 instructions from
  the loads to the shuffles of two chunks, from 95); the decode of a group whose statistics are finite stores
  without the per-element NaN tests (its bfloat16 rounding 4 instructions an element, from about 7.5).
""", "command: `python benchmarks/roofline_cuda.py` (arithmetic, no GPU involved)", ""]
    text = "\n".join(lines)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
