"""Step time of ``lightning_act.nn.convert_bounded_cnn`` on ResNet-50 (CPU): plain and converted models
alternate, uncompressed and 4-bit, so machine load hits both alike; median of ``--reps`` steps each.

    python benchmarks/bench_bounded_cnn_time.py --batch 32 --size 224 --reps 3
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch
from torch import nn

import lightning_act as act
from lightning_act.models import resnet50
from lightning_act.nn import convert_bounded_cnn
from models import MachineLoad, machine


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    plain = resnet50(1000).to(memory_format=torch.channels_last).train()
    bounded = copy.deepcopy(plain)
    convert_bounded_cnn(bounded)
    x = torch.randn(args.batch, 3, args.size, args.size).to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (args.batch,))
    configs = {"uncompressed": None, "4-bit": act.ACTConfig(bits=4, adaptive=False)}
    times: dict[tuple[str, str], list[float]] = {}
    with MachineLoad() as load:
        for rep in range(args.reps + 1):  # the first round warms up
            for config_name, config in configs.items():
                for model_name, model in (("plain", plain), ("bounded", bounded)):
                    compressor = act.ActivationCompressor(model, config) if config is not None else None
                    model.zero_grad(set_to_none=True)
                    started = time.perf_counter()
                    if compressor is not None:
                        with compressor.compress():
                            loss = nn.functional.cross_entropy(model(x), y)
                    else:
                        loss = nn.functional.cross_entropy(model(x), y)
                    loss.backward()
                    if rep:
                        times.setdefault((config_name, model_name), []).append(time.perf_counter() - started)
    summary = load.summary()
    print(f"ResNet-50 {args.batch}x{args.size}², channels_last, fp32, {machine()}; other processes used "
          f"{summary['other_cores']:.2f} of {summary['cpus']} cores")
    print("| config | plain s | bounded s | bounded / plain |\n|---|---|---|---|")
    for config_name in configs:
        p, b = (statistics.median(times[(config_name, m)]) for m in ("plain", "bounded"))
        print(f"| {config_name} | {p:.1f} | {b:.1f} | {b / p:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
