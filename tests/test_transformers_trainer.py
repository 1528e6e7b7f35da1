"""``ACTTrainer`` / ``CompressionCallback``: compression of training steps only, statistics in the Trainer's
reporting, gradient accumulation and gradient checkpointing (tiny random BERT, no download)."""
import warnings

import pytest
import torch

import lightning_act as act

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from lightning_act.integrations import ACTTrainer, CompressionCallback, checkpointing_args  # noqa: E402
from lightning_act.stats import COMPRESSED  # noqa: E402


def _tiny_bert():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=200, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=128, max_position_embeddings=64)
    return transformers.BertForSequenceClassification(cfg)


def _dataset(n=16, length=32):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 200, (n, length), generator=g)
    labels = torch.randint(0, 2, (n,), generator=g)
    return [{"input_ids": ids[i], "labels": labels[i]} for i in range(n)]


def _trainer(tmp_path, callbacks=None, act_config=act.ACTConfig(bits=4, adaptive=False), **args):
    defaults = dict(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, logging_steps=1,
                    report_to="none", use_cpu=True, disable_tqdm=True, save_strategy="no", learning_rate=1e-3)
    act_options = {k: args.pop(k) for k in ("act_error_bound",) if k in args}
    training_args = transformers.TrainingArguments(**{**defaults, **args})
    return ACTTrainer(model=_tiny_bert(), args=training_args, train_dataset=_dataset(), eval_dataset=_dataset(8),
                      act_config=act_config, callbacks=callbacks, **act_options)


def _act_logs(trainer):
    return [entry for entry in trainer.state.log_history if "act/compression_ratio" in entry]


@pytest.mark.parametrize("extra", [{}, {"gradient_accumulation_steps": 2}])
def test_training_steps_compressed_and_logged(tmp_path, extra):
    trainer = _trainer(tmp_path, **extra)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    accumulation = extra.get("gradient_accumulation_steps", 1)
    assert trainer.compressor.step_number == 2 * accumulation  # one compress() per micro-batch
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    logs = _act_logs(trainer)
    assert [entry["step"] for entry in logs] == [1, 2]
    stats = trainer.compressor.stats()
    assert stats.ratio > 3
    assert {r.bits for r in stats.records if r.kind == COMPRESSED and r.codec == "quantize"} == {4.0}
    last = logs[-1]
    assert last["act/compression_ratio"] == pytest.approx(stats.ratio)
    assert last["act/original_bytes"] == stats.original_bytes and last["act/stored_bytes"] == stats.stored_bytes
    assert last["act/codec/quantize/ratio"] > 3


def test_a_model_the_trainer_compiles_is_compressed_inside_its_graphs(tmp_path):
    """``TrainingArguments(torch_compile=True)``: the Trainer compiles the model from outside, and the compressor is
    built on that wrapper, so the compiled graphs compress what they save."""
    trainer = _trainer(tmp_path, torch_compile=True)
    trainer.train()
    compressor = trainer.compressor
    assert compressor.model is trainer.model_wrapped and compressor.model._orig_mod is trainer.model
    assert compressor.graph_hooks is not None
    records = [r for r in compressor.stats().records if r.shape.numel() == 4 * 32 * 128]  # the FFN activations
    assert len(records) >= 2 and {(r.phase, r.codec, r.bits) for r in records} == {("compiled", "quantize", 4.0)}
    assert _act_logs(trainer)[-1]["act/compression_ratio"] > 3
    torch._dynamo.reset()


def test_evaluation_is_not_compressed(tmp_path):
    trainer = _trainer(tmp_path)
    metrics = trainer.evaluate()
    assert "eval_loss" in metrics
    assert trainer.compressor.step_number == 0
    assert not any(k.startswith("act/") for k in metrics)


def test_gradient_checkpointing_compresses_recomputed_tensors(tmp_path):
    # activation_checkpointing from transformers 5.23, gradient_checkpointing before: the helper picks the name
    trainer = _trainer(tmp_path, **checkpointing_args(True))
    assert trainer.args.gradient_checkpointing is True  # the old name stays readable (an alias from 5.23)
    trainer.train()
    stats = trainer.compressor.stats()
    recomputed = [r for r in stats.records if r.phase == "recompute" and r.kind == COMPRESSED]
    assert recomputed, "the checkpointed layers' recomputation was not compressed"
    assert stats.ratio > 3
    assert _act_logs(trainer)[-1]["act/compression_ratio"] == pytest.approx(stats.ratio)


def test_checkpointing_args_take_the_current_name_and_reject_non_bool(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # transformers 5.23 warns on the old gradient_checkpointing
        args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                                              **checkpointing_args(True))
    assert args.gradient_checkpointing is True
    assert list(checkpointing_args(False).values()) == [False]
    with pytest.raises(TypeError, match=r"checkpointing_args\(enabled='yes'\); expected True or False"):
        checkpointing_args("yes")


def test_given_callback_is_moved_before_reporters_and_tensorboard_gets_the_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    callback = CompressionCallback()
    trainer = _trainer(tmp_path, callbacks=[callback], report_to="tensorboard")
    handler_callbacks = trainer.callback_handler.callbacks
    assert handler_callbacks[0] is callback and handler_callbacks.count(callback) == 1
    trainer.train()
    assert callback.compressor is trainer.compressor
    events = list(tmp_path.rglob("events.out.tfevents*"))  # under output_dir/runs/
    accumulator = EventAccumulator(str(events[0].parent)).Reload()
    tags = accumulator.Tags()["scalars"]
    assert {"train/act/compression_ratio", "train/act/stored_bytes", "train/act/average_bits"} <= set(tags)
    ratios = [e.value for e in accumulator.Scalars("train/act/compression_ratio")]
    assert len(ratios) == 2 and all(r > 3 for r in ratios)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_adaptive_config_allocates_bits_every_interval(tmp_path, accumulation):
    config = act.ACTConfig(bits=4, adaptive=True, adapt_interval=2, bit_budget=2)
    trainer = _trainer(tmp_path, act_config=config, max_steps=3, gradient_accumulation_steps=accumulation)
    trainer.train()
    auto = trainer.auto_precision
    assert auto.rounds == 2 and auto.last_adapted_step == 2  # steps 0 and 2, once per optimizer step
    assert trainer.compressor.step_number == 3 * accumulation  # probe passes leave the step counter alone
    assert auto.gradient_variance.count == 3  # one accumulated gradient per optimizer step
    assert auto.layout and set(auto.bits) <= {1, 2, 4, 8, 32} and len(set(auto.bits)) > 1
    assert auto.average_bits <= 2 + 1e-9
    used = {r.bits for r in trainer.compressor.stats().records if r.kind == COMPRESSED and r.codec == "quantize"}
    assert used <= {1.0, 2.0, 4.0, 8.0} and used & {1.0, 2.0}


def test_probe_passes_leave_the_real_step_unchanged(tmp_path):
    """Two trainers on the same allocation: one re-estimates before its step, one does not; same weights after."""
    config = act.ACTConfig(bits=4, adaptive=True, adapt_interval=100)
    first = _trainer(tmp_path / "a", act_config=config, max_steps=1)
    first.train()  # round at step 0, then the real step with the allocated bits
    second = _trainer(tmp_path / "b", act_config=config, max_steps=1)
    second.auto_precision.load_state_dict(first.auto_precision.state_dict())
    second.auto_precision.last_adapted_step = 0  # already adapted at step 0: no probes before the real step
    second.train()
    assert second.auto_precision.rounds == first.auto_precision.rounds == 1
    for a, b in zip(first.model.parameters(), second.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_error_bounds_adapt_from_adam_momentum_and_detach_after_training(tmp_path):
    config = act.ACTConfig(codec="lorenzo", error_bound=1e-3, adaptive=False)
    trainer = _trainer(tmp_path, act_config=config, max_steps=3, act_error_bound={"interval": 2})
    trainer.train()
    controller = trainer.error_bound_controller
    assert controller.steps == 3
    query = "bert.encoder.layer.0.attention.self.query"
    assert query in controller.error_bounds and "classifier" in controller.error_bounds
    assert all(0 < b < 1 for b in controller.error_bounds.values())
    assert not controller._handles and trainer.compressor.codec_policy is None  # detached after train()
    lorenzo = [r for r in trainer.compressor.stats().records if r.kind == COMPRESSED and r.codec == "lorenzo"]
    assert lorenzo and trainer.compressor.stats().ratio > 1.5


def test_unknown_error_bound_option_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown options intervl; expected some of interval"):
        _trainer(tmp_path, act_error_bound={"intervl": 2})
    with pytest.raises(TypeError, match="act_error_bound=1"):
        _trainer(tmp_path, act_error_bound=1)


def test_memory_budget_plans_on_the_first_step_and_is_undone_after_training(tmp_path):
    trainer = _trainer(tmp_path, act_config=act.ACTConfig(bits=4, memory_budget="64MiB"))
    trainer.train()
    planner = trainer.memory_budget
    plan = planner.last_plan
    assert plan is not None and plan.fits and plan.measured_peak_bytes <= 64 * 2**20
    assert set(plan.options) == {*planner.units, "(model)"} and "bert.encoder.layer.0" in plan.options
    assert trainer.compressor.codec_policy is None  # removed when train() ended
    assert _act_logs(trainer)[-1]["act/compression_ratio"] >= 1.0
