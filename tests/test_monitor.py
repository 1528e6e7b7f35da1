"""``CompressionMonitor``: scalars equal to the compressor's statistics, per-codec breakdown, TensorBoard
histograms, once per optimizer step with accumulation, and the metric helpers on their own."""
import lightning as L
import pytest
import torch

import lightning_act as act
from lightning_act.metrics import step_metrics, tensor_histograms
from lightning_act.stats import COMPRESSED, KEPT, CompressionStats, TensorRecord
from tests.lightning_models import TRAINER_ARGS, MemoryLogger, TinyCNN, random_loader


def _record(kind, codec, bits, original, stored, index=0):
    return TensorRecord(index, (original // 4,), torch.float32, kind, codec, bits, original, stored)


def test_step_metrics_and_histograms_from_records():
    stats = CompressionStats.from_records([
        _record(COMPRESSED, "quantize", 4.0, 8192, 1100), _record(COMPRESSED, "quantize", 2.0, 4096, 300, 1),
        _record(KEPT, "none", 64.0, 800, 800, 2)])
    metrics = step_metrics(stats)
    assert metrics["act/compression_ratio"] == pytest.approx(13088 / 2200)
    assert metrics["act/original_bytes"] == 13088 and metrics["act/stored_bytes"] == 2200
    assert metrics["act/codec/quantize/ratio"] == pytest.approx(12288 / 1400)
    assert metrics["act/codec/none/stored_bytes"] == 800
    assert metrics["act/compressed_tensors"] == 2
    histograms = tensor_histograms(stats)
    assert set(histograms) == {"act/tensor_bits", "act/tensor_ratio"}  # no record carries an error bound
    assert histograms["act/tensor_bits"].tolist() == [4.0, 2.0]
    assert histograms["act/tensor_ratio"].tolist() == pytest.approx([8192 / 1100, 4096 / 300])
    assert tensor_histograms(CompressionStats()) == {}


def test_error_bounded_codecs_record_their_bound_for_the_histogram():
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 8))
    compressor = act.ActivationCompressor(model, act.ACTConfig(codec="lorenzo", error_bound=1e-3))
    with compressor.compress():
        loss = model(torch.randn(64, 64)).sum()
    loss.backward()
    stats = compressor.stats()
    bounds = [r.error_bound for r in stats.records if r.kind == COMPRESSED]
    assert bounds and all(b == 1e-3 for b in bounds)
    assert tensor_histograms(stats)["act/tensor_error_bound"].tolist() == bounds


class _CheckingCNN(TinyCNN):
    """Keeps each step's compressor statistics, to compare with what the monitor logged."""

    def __init__(self):
        super().__init__()
        self.stats_by_step = {}

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.stats_by_step[self.trainer.global_step] = self.trainer.strategy.compressor.stats()


def test_logged_scalars_equal_the_compressor_statistics_once_per_step():
    logger = MemoryLogger()
    model = _CheckingCNN()
    trainer = L.Trainer(strategy="act", callbacks=[act.callbacks.CompressionMonitor(log_every_n_steps=1)],
                        **{**TRAINER_ARGS, "logger": logger, "accumulate_grad_batches": 2})
    trainer.fit(model, random_loader())
    logged = {step: m for step, m in logger.metrics if "act/compression_ratio" in m}
    # 4 batches, 2 optimizer steps: one log per step, of the micro-batch that completed it (none at step 0, whose
    # first micro-batch only accumulated)
    assert sorted(logged) == [1, 2]
    for step, metrics in logged.items():
        assert metrics == step_metrics(model.stats_by_step[step])
        assert metrics["act/compression_ratio"] > 3 and metrics["act/codec/quantize/ratio"] > 3
    # the last step's scalars, where ModelCheckpoint and EarlyStopping look
    callback_metrics = {name: value.item() for name, value in trainer.callback_metrics.items()
                        if name.startswith("act/")}
    assert callback_metrics == logged[2]


def test_a_checkpoint_can_monitor_the_compression_ratio(tmp_path):
    """``ModelCheckpoint(monitor="act/compression_ratio")`` finds the monitor's scalar and keeps the best step."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="act/compression_ratio", mode="max", every_n_train_steps=1)
    trainer = L.Trainer(strategy="act", callbacks=[act.callbacks.CompressionMonitor(log_every_n_steps=1), checkpoint],
                        **{**TRAINER_ARGS, "enable_checkpointing": True})
    trainer.fit(TinyCNN(), random_loader())
    assert checkpoint.best_model_score is not None and checkpoint.best_model_score.item() > 3
    assert trainer.callback_metrics["act/compression_ratio"].item() == pytest.approx(
        trainer.strategy.compressor.stats().ratio)


def test_an_epoch_shorter_than_the_logging_interval_still_feeds_the_monitors(tmp_path):
    """At the default interval (the Trainer's 50 steps) a 4-step epoch logs nothing, yet an epoch-end
    ``ModelCheckpoint(monitor=...)`` finds the last step's ratio (it raised "could not find the monitored key")."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    logger = MemoryLogger()
    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="act/compression_ratio", mode="max")
    trainer = L.Trainer(strategy="act", callbacks=[act.callbacks.CompressionMonitor(), checkpoint],
                        **{**TRAINER_ARGS, "logger": logger, "enable_checkpointing": True})
    trainer.fit(TinyCNN(), random_loader())
    assert trainer.global_step == 4 and not [m for _, m in logger.metrics if "act/compression_ratio" in m]
    assert checkpoint.best_model_score.item() == pytest.approx(trainer.strategy.compressor.stats().ratio)
    assert checkpoint.best_model_score.item() > 3


def test_tensorboard_gets_scalars_and_histograms(tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(str(tmp_path), name="tb", version=0)
    trainer = L.Trainer(strategy="act", callbacks=[act.callbacks.CompressionMonitor(log_every_n_steps=2)],
                        **{**TRAINER_ARGS, "logger": logger})
    trainer.fit(TinyCNN(), random_loader())
    accumulator = EventAccumulator(str(tmp_path / "tb" / "version_0"), size_guidance={"histograms": 0}).Reload()
    scalars = accumulator.Tags()["scalars"]
    assert {"act/compression_ratio", "act/original_bytes", "act/stored_bytes", "act/average_bits",
            "act/codec/quantize/ratio"} <= set(scalars)
    assert [e.step for e in accumulator.Scalars("act/compression_ratio")] == [2, 4]
    assert {"act/tensor_bits", "act/tensor_ratio"} <= set(accumulator.Tags()["histograms"])
    logged = accumulator.Histograms("act/tensor_bits")[-1]  # step 4: the compressor's last step
    expected = [r.bits for r in trainer.strategy.compressor.stats().records if r.kind == COMPRESSED]
    assert logged.step == 4 and logged.histogram_value.num == len(expected)
    assert logged.histogram_value.sum == pytest.approx(sum(expected))
    assert logged.histogram_value.max == max(expected) and logged.histogram_value.min == min(expected)


def test_log_every_n_steps_is_validated():
    with pytest.raises(ValueError, match="log_every_n_steps must be a positive int or None; got 0"):
        act.callbacks.CompressionMonitor(log_every_n_steps=0)
