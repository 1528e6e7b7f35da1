"""Memory-roofline estimate of the quantize kernels (lightning_act/cuda/quantize.cu): pure arithmetic, no GPU.

Traffic per element, from what the kernels read and write in DRAM (each byte once; shared memory and the
decode's re-reads of a payload byte by neighbouring lanes hit on-chip memory and are not counted):
  encode: read the input (4 or 2 bytes), write bits/8 payload bytes and 2 statistics per group
  decode: read bits/8 payload bytes and 2 statistics per group, write the output (4 or 2 bytes)
Both directions move the same bytes, so one row serves both. Time per GB is per GB of activation (the
uncompressed tensor) at the given DRAM bandwidth: a lower bound that ignores launch latency and assumes the
kernels stay memory-bound. The last columns give the work that bound implies (encode: ~18 integer ops for the
two mix32 hashes, ~8 for indexing and packing, 5 float ops; decode: ~10): compare them with the GPU's issue
rate before trusting the bound for 16-bit inputs, whose encode is the closest to compute-bound.

    python benchmarks/roofline_cuda.py [--bandwidth-tbs 3.35] [--group-size 256]
"""
from __future__ import annotations

import argparse

INPUT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
STATS_BYTES = {"float32": 4, "bfloat16": 2}
OPS_PER_ELEMENT = {"encode": 30, "decode": 10}


def compressed_bytes_per_element(bits: int, stats_bytes: int, group_size: int) -> float:
    return bits / 8 + 2 * stats_bytes / group_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bandwidth-tbs", type=float, default=3.35, help="DRAM bandwidth, TB/s (H100 SXM: 3.35)")
    parser.add_argument("--group-size", type=int, default=256)
    args = parser.parse_args()
    bandwidth = args.bandwidth_tbs * 1e12
    print(f"memory roofline at {args.bandwidth_tbs} TB/s, group_size={args.group_size} "
          f"(arithmetic from the kernels' traffic, not a measurement)\n")
    print("| dtype | stats | bits | DRAM bytes/element | ratio | us per GB of activation | encode Gop/s | "
          "decode Gop/s |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype, dtype_bytes in INPUT_BYTES.items():
        for stats, stats_bytes in STATS_BYTES.items():
            for bits in (1, 2, 4, 8):
                compressed = compressed_bytes_per_element(bits, stats_bytes, args.group_size)
                elements_per_gb = 1e9 / dtype_bytes
                seconds = elements_per_gb * (dtype_bytes + compressed) / bandwidth
                ops = {d: elements_per_gb / seconds * n / 1e9 for d, n in OPS_PER_ELEMENT.items()}
                print(f"| {dtype} | {stats} | {bits} | {dtype_bytes + compressed:.3f} | "
                      f"{dtype_bytes / compressed:.1f}x | {seconds * 1e6:.0f} | {ops['encode']:.0f} | "
                      f"{ops['decode']:.0f} |")

if __name__ == "__main__":
    main()
