"""Accelerate: train the digits CNN plain and with compressed activations, in any Accelerate setup.

One process on CPU (the default) or several (``Accelerator`` reads torchrun's environment; on CPU
``accelerate launch --cpu --num_processes 2`` starts a single process unless MPI is configured)::

    python recipes/accelerate_example.py [--mixed-precision bf16] [--grad-accum 2] [--api patch]
    torchrun --nproc_per_node 2 recipes/accelerate_example.py --epochs 2

``--api context`` puts ``compressor.compress()`` around each forward (the compressor built on
``lightning_act.integrations.compressed_module(model)``); ``--api patch`` calls
``lightning_act.integrations.compress_forward(model)`` once after ``accelerator.prepare``. ``--compile`` has
Accelerate compile the model; the compressed run then quantizes inside the compiled graphs. Prints the
baseline-vs-compressed summary (accuracy, activation bytes, ratio, step-time ratio) on the main process and
writes TensorBoard logs (``act/`` scalars and histograms) under ``--logdir``.
"""
from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

import torch
from torch import nn

import lightning_act as act
from lightning_act.codecs.quantize import ALLOWED_BITS
from lightning_act.datasets import digits_loaders
from lightning_act.integrations import compress_forward, compressed_module, unpatch
from lightning_act.metrics import write_stats
from lightning_act.models import DigitsCNN
from lightning_act.reporting import RunResult, StepClock, summary_table


def train(args, compress: bool) -> RunResult:
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision,
                              gradient_accumulation_steps=args.grad_accum,
                              dynamo_backend="inductor" if args.compile else "no")
    set_seed(args.seed)
    model = DigitsCNN().net
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    train_loader, val_loader = digits_loaders(args.batch_size, args.seed)
    model, optimizer, train_loader, val_loader = accelerator.prepare(model, optimizer, train_loader, val_loader)

    compressor = None
    if compress and args.api == "patch":
        compressor = compress_forward(model, act.ACTConfig(bits=args.bits))
    elif compress:
        compressor = act.ActivationCompressor(compressed_module(model), act.ACTConfig(bits=args.bits))
    writer = _writer(args.logdir, "compressed" if compress else "baseline") if accelerator.is_main_process else None

    clock, step = StepClock(), 0
    try:
        for _ in range(args.epochs):
            model.train()
            for x, y in train_loader:
                with clock, accelerator.accumulate(model):
                    context = compressor.compress() if compress and args.api == "context" else contextlib.nullcontext()
                    with context:
                        loss = nn.functional.cross_entropy(model(x), y)
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
                step += 1
                if writer is not None:
                    writer.add_scalar("train/loss", loss.item(), step)
                    if compressor is not None:
                        write_stats(writer, compressor.stats(), step)
                if step == args.max_steps:
                    break
    finally:
        if compress and args.api == "patch":
            unpatch(model)
        if writer is not None:
            writer.close()
    accuracy = _accuracy(accelerator, model, val_loader)
    return RunResult(accuracy, clock.times, compressor.stats() if compressor is not None else None)


def _writer(logdir: str, run: str):
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(Path(logdir) / run))


@torch.no_grad()
def _accuracy(accelerator, model, loader) -> float:
    model.eval()
    correct = total = 0
    for x, y in loader:
        predictions, labels = accelerator.gather_for_metrics((model(x).argmax(1), y))
        correct += (predictions == labels).sum().item()
        total += len(labels)
    return correct / total


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=-1, help="stop each run after this many batches (-1: all)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--bits", type=int, default=4, choices=ALLOWED_BITS,
                        help="bits per activation element")
    parser.add_argument("--mixed-precision", choices=("no", "bf16", "fp16"), default="no")
    parser.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps")
    parser.add_argument("--api", choices=("context", "patch"), default="context",
                        help="compressor.compress() around the forward, or compress_forward(model) once")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the prepared model (Accelerate's dynamo_backend) in both runs; the compressed "
                        "run quantizes inside the compiled graphs")
    parser.add_argument("--cpu", action=argparse.BooleanOptionalAction, default=True,
                        help="train on CPU even when a GPU is present (default: on)")
    parser.add_argument("--logdir", default="runs/accelerate", help="TensorBoard log directory")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv=None) -> tuple[RunResult, RunResult]:
    args = parse_args(argv)
    baseline = train(args, compress=False)
    compressed = train(args, compress=True)
    from accelerate import PartialState

    if PartialState().is_main_process:
        title = (f"Digits CNN with Accelerate ({PartialState().num_processes} process(es), mixed precision "
                 f"{args.mixed_precision}, accumulation {args.grad_accum}, api {args.api}"
                 f"{', torch.compile' if args.compile else ''}), {args.bits}-bit")
        print(summary_table(title, baseline, compressed))
    return baseline, compressed


if __name__ == "__main__":
    main()
