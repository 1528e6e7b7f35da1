"""GACT auto-precision: allocation, Algorithm 1 sensitivities, state restoration, callback, checkpoints, DDP."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn

import lightning_act as act
from lightning_act.adapt import allocate_bits, compression_variance, variance_factor
from lightning_act.callbacks.auto_precision import AutoPrecision
from tests.lightning_models import TinyCNN, random_loader

ROOT = Path(__file__).resolve().parents[1]
TRAINER_ARGS = dict(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False)


# ---- allocation -----------------------------------------------------------------------------------------
def test_variance_factor_and_allocation_follow_sensitivity_within_budget():
    assert variance_factor(32) == 0.0 and variance_factor(4) == 1 / 225 and variance_factor(1) == 1.0
    sizes = [1000, 1000, 1000, 1000]
    bits = allocate_bits([1.0, 1.0, 1.0, 1e4], sizes, budget=4)
    assert bits == [2, 2, 4, 8]
    for budget in (4, 3, 2):
        bits = allocate_bits([1.0, 3.0, 10.0, 30.0], sizes, budget)
        assert sum(b * d for b, d in zip(bits, sizes)) <= budget * sum(sizes)
        assert bits == sorted(bits)  # more sensitive, never fewer bits
    assert allocate_bits([1.0, 1.0], [10, 10], budget=32) == [32, 32]
    assert compression_variance([2.0, 3.0], [1, 32]) == 2.0


def test_allocation_errors_name_the_value():
    with pytest.raises(ValueError, match="2 sensitivities for 1 sizes"):
        allocate_bits([1.0, 2.0], [3], 4)
    with pytest.raises(ValueError, match="sensitivities holds nan"):
        allocate_bits([float("nan")], [3], 4)
    with pytest.raises(ValueError, match=r"budget=0.5; expected a number >= the smallest candidate \(1 bits\)"):
        allocate_bits([1.0], [3], 0.5)


def test_allocation_keeps_each_tensor_at_or_above_its_minimum_and_counts_its_bits():
    sizes = [100, 300]
    assert allocate_bits([1e-9, 1.0], sizes, budget=4) == [4, 4]
    # an op rule's floor: the insensitive tensor is stored at 8 bits whatever it gets, so the other pays for it
    assert allocate_bits([1e-9, 1.0], sizes, budget=4, minimums=[8, None]) == [8, 2]
    assert allocate_bits([1.0, 1.0], [300, 100], budget=2, minimums=[8, None]) == [8, 1]  # unreachable: all lowest
    assert allocate_bits([1.0, 1.0], [10, 10], budget=16, minimums=[16, None]) == [32, 1]  # 16: only 32 is above
    assert allocate_bits([1.0, 1.0], [10, 10], budget=16, minimums=[1, 0]) == [8, 8]
    with pytest.raises(ValueError, match="2 minimums for 1 sizes"):
        allocate_bits([1.0], [3], 4, minimums=[8, 8])
    with pytest.raises(ValueError, match=r"minimums=-1; expected an integer >= 0"):
        allocate_bits([1.0], [3], 4, minimums=[-1])


def test_overrides_are_validated_like_the_config():
    with pytest.raises(ValueError, match=r"adapt_fraction=0; expected a number in \(0, 1\]"):
        AutoPrecision(adapt_fraction=0)
    with pytest.raises(ValueError, match="bit_budget=40; expected a number in"):
        AutoPrecision(bit_budget=40)
    with pytest.raises(ValueError, match="AutoPrecision has no compressor"):
        AutoPrecision().maybe_adapt(0, lambda: None)


# ---- sensitivity on small models ------------------------------------------------------------------------
class TwoBranch(nn.Module):
    """Branch ``b``'s output is scaled by 1000 downstream: its hidden tensor (width 48) is far more sensitive
    than branch ``a``'s (width 64)."""

    def __init__(self):
        super().__init__()
        self.stem_a, self.stem_b = nn.Linear(32, 64), nn.Linear(32, 48)
        self.head_a, self.head_b = nn.Linear(64, 8), nn.Linear(48, 8)

    def forward(self, x):
        return self.head_a(torch.tanh(self.stem_a(x))) + 1000.0 * self.head_b(torch.tanh(self.stem_b(x)))


def _plain_setup(model, batch, config):
    compressor = act.ActivationCompressor(model, config)
    x, y = batch

    def forward_backward():
        with compressor.compress():
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
    return compressor, forward_backward


def test_tensor_scaled_up_downstream_gets_more_bits():
    torch.manual_seed(0)
    batch = (torch.randn(128, 32), torch.randint(0, 8, (128,)))
    compressor, forward_backward = _plain_setup(TwoBranch(), batch, act.ACTConfig(bits=4, min_numel=0))
    auto = AutoPrecision(compressor, bit_budget=4)
    assert auto.maybe_adapt(0, forward_backward)
    sensitive = [a for a in auto.assignment() if a["shape"] == [128, 48]]
    others = [a for a in auto.assignment() if a["shape"] == [128, 64]]  # branch a's tanh output
    assert len(sensitive) == 1 and others
    assert sensitive[0]["sensitivity"] > 100 * max(a["sensitivity"] for a in others)
    assert all(sensitive[0]["bits"] > a["bits"] for a in others)
    assert auto.last_round.passes == 1 + len(auto.layout)
    assert auto.average_bits <= 4.0


def _bert(hidden=32, layers=1):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=200, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
                                  intermediate_size=2 * hidden, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    model = transformers.BertForSequenceClassification(cfg).train()
    g = torch.Generator().manual_seed(1)
    return model, {"input_ids": torch.randint(0, 200, (8, 16), generator=g),
                   "labels": torch.randint(0, 2, (8,), generator=g)}


def _cnn():
    """Conv-BN-ReLU stages, max-pool and a linear head on the flattened map (a sensitive, large input)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Flatten(),
                          nn.Linear(16 * 6 * 6, 10))
    g = torch.Generator().manual_seed(1)
    return model, (torch.randn(8, 3, 12, 12, generator=g), torch.randint(0, 10, (8,), generator=g))


def _gradient_variance(compressor, loss_fn, repeats=6) -> float:
    """Total variance of the gradient over stochastic-rounding seeds, same batch and parameters."""
    grads = []
    for seed in range(repeats):
        compressor.model.zero_grad(set_to_none=True)
        with compressor.install_policy(noise=lambda step, i, seed=seed: 7919 * seed + i), compressor.compress():
            loss = loss_fn()
        loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in compressor.model.parameters() if p.grad is not None]))
    stacked = torch.stack(grads).double()
    return float((stacked - stacked.mean(0)).pow(2).sum(1).mean())


@pytest.mark.parametrize("which", ["bert", "cnn"])
def test_adaptive_4_bit_has_lower_gradient_variance_than_uniform_at_the_same_ratio(which):
    if which == "bert":
        model, batch = _bert()
        loss_fn = lambda: model(**batch).loss  # noqa: E731
    else:
        model, (x, y) = _cnn()
        loss_fn = lambda: nn.functional.cross_entropy(model(x), y)  # noqa: E731
    config = act.ACTConfig(bits=4, min_numel=256)
    uniform = act.ActivationCompressor(model, config)
    uniform_variance = _gradient_variance(uniform, loss_fn)
    uniform_ratio = uniform.stats().ratio

    adaptive = act.ActivationCompressor(model, config)
    auto = AutoPrecision(adaptive, bit_budget=4)

    def forward_backward():
        with adaptive.compress():
            loss = loss_fn()
        loss.backward()
    auto.maybe_adapt(0, forward_backward)
    adaptive_variance = _gradient_variance(adaptive, loss_fn)
    assert len(set(auto.bits)) > 1  # not uniform
    assert adaptive_variance < 0.7 * uniform_variance
    assert adaptive.stats().ratio == pytest.approx(uniform_ratio, rel=0.05)


# ---- op-rule floors (cross-entropy's log-probabilities at 8 bits or more) ---------------------------------
def _classifier(classes: int):
    """Two tanh layers and a head of ``classes`` outputs under cross-entropy: its (batch x classes)
    log-probabilities are saved with an 8-bit floor (``op_rules.MinimumBits``), the rest at the allocated bits."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, classes))
    g = torch.Generator().manual_seed(1)
    return _plain_setup(model, (torch.randn(32, 16, generator=g), torch.randint(0, classes, (32,), generator=g)),
                        act.ACTConfig(bits=4, min_numel=0))


def _log_probabilities(auto):
    """The floored tensors of the step: the log-probabilities, and nll_loss's 0-d total weight (min_numel=0)."""
    floored = [a for a in auto.assignment() if a["minimum_bits"] is not None]
    assert [(a["shape"], a["minimum_bits"]) for a in floored] == [([32, 256], 8), ([], 8)]
    return floored[0]


def test_floored_tensor_is_allocated_at_its_floor_and_counted_in_the_budget():
    compressor, forward_backward = _classifier(256)  # the log-probabilities: 64% of the allocated elements
    auto = AutoPrecision(compressor, bit_budget=6)
    assert auto.maybe_adapt(0, forward_backward)
    floored = _log_probabilities(auto)
    assert floored["bits"] in (8, 32) and auto.average_bits <= 6
    assert max(a["bits"] for a in auto.assignment() if a["minimum_bits"] is None) <= 4  # they pay for the floor
    forward_backward()
    stored = {r.index: r.bits for r in compressor.stats().records if r.kind == "compressed"}
    assert stored[floored["index"]] >= 8  # what was allocated is what is stored
    allocated = {a["index"]: a["bits"] for a in auto.assignment()}
    assert all(allocated[i] <= b < allocated[i] + 1 for i, b in stored.items() if i in allocated)


def test_a_budget_the_floors_make_unreachable_is_warned_about():
    compressor, forward_backward = _classifier(256)
    auto = AutoPrecision(compressor, bit_budget=4)  # 8 bits on 64% of the elements is 5.1 on average already
    with pytest.warns(RuntimeWarning, match=r"bit_budget=4 cannot be met: op rules keep 2 saved tensors \(64% of the "
                                            r"allocated elements\) at 8 bits or more, so the allocation averages "
                                            r"5\.48 bits"):  # 8 x 0.64 + 1 x 0.36
        auto.maybe_adapt(0, forward_backward)
    assert _log_probabilities(auto)["bits"] == 8
    assert {a["bits"] for a in auto.assignment() if a["minimum_bits"] is None} == {1}


def test_a_floored_tensors_sensitivity_is_measured_at_the_bits_it_is_stored_at():
    """Probes store a floored tensor at its floor whatever it is allocated, so its sensitivity divides by that
    floor's variance: the same noise gives the same estimate whatever it is allocated (dividing by the allocation's
    variance, a 2-bit allocation would read 7225 times lower than an 8-bit one)."""
    from lightning_act.adapt.sensitivity import TensorKey, estimate_sensitivities, probed_bits

    assert probed_bits(2, TensorKey(0, (4,), "float32", 8)) == 8 and probed_bits(2, TensorKey(0, (4,), "float32")) == 2
    assert probed_bits(32, TensorKey(0, (4,), "float32")) == 8
    compressor, forward_backward = _classifier(256)
    rounds = [estimate_sensitivities(compressor, forward_backward, lambda key, b=bits: b if key.minimum_bits else 4,
                                     lambda layout: range(len(layout))) for bits in (2, 8)]
    assert rounds[0].layout == rounds[1].layout
    position = next(p for p, k in enumerate(rounds[0].layout) if k.minimum_bits == 8)
    assert rounds[0].sensitivities[position] == rounds[1].sensitivities[position] > 0


def test_assignment_with_floors_survives_a_checkpoint_and_old_checkpoints_load():
    compressor, forward_backward = _classifier(256)
    auto = AutoPrecision(compressor, bit_budget=6)
    auto.maybe_adapt(0, forward_backward)
    state = json.loads(json.dumps(auto.state_dict()))
    resumed = AutoPrecision(compressor, bit_budget=6)
    resumed.load_state_dict(state)
    assert resumed.assignment() == auto.assignment()
    state["layout"] = [entry[:3] for entry in state["layout"]]  # saved before floors were part of the layout
    resumed.load_state_dict(state)
    assert all(a["minimum_bits"] is None for a in resumed.assignment())


# ---- state restoration ----------------------------------------------------------------------------------
class BNDropoutNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.3),
                                 nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                 nn.Linear(8, 4))

    def forward(self, x):
        return self.net(x)


def _train_steps(with_probes: bool, steps=3):
    """SGD with momentum on a BN + dropout net at 32-bit storage: probes quantize at 8 bits, the real steps
    are lossless, so the run must match a run without probes exactly."""
    torch.manual_seed(0)
    model = BNDropoutNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    compressor = act.ActivationCompressor(model, act.ACTConfig(bits=32, min_numel=0))
    auto = AutoPrecision(compressor, adapt_interval=1)
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(steps)]
    losses, snapshots = [], []
    for step, (x, y) in enumerate(batches):
        def forward_backward():
            with compressor.compress():
                loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            return loss
        optimizer.zero_grad()
        forward_backward()  # gradients present when the probes run: they must survive
        if with_probes:
            before = _state(model, optimizer, compressor)
            auto.maybe_adapt(step, forward_backward)
            snapshots.append((before, _state(model, optimizer, compressor)))
        optimizer.zero_grad()
        losses.append(float(forward_backward().detach()))
        optimizer.step()
    return losses, snapshots, auto


def _state(model, optimizer, compressor):
    return {"grads": [p.grad.clone() for p in model.parameters()], "buffers": [b.clone() for b in model.buffers()],
            "rng": torch.get_rng_state(), "step": compressor.step_number, "stats": compressor.stats(),
            "momentum": [optimizer.state[p].get("momentum_buffer") for p in model.parameters()]}


def test_probes_leave_outputs_grads_buffers_rng_counter_and_optimizer_state_untouched():
    plain_losses, _, _ = _train_steps(with_probes=False)
    losses, snapshots, auto = _train_steps(with_probes=True)
    assert auto.rounds == 3 and auto.last_round.passes > 1 and set(auto.bits) == {32}
    assert losses == plain_losses
    for before, after in snapshots:
        assert all(torch.equal(a, b) for a, b in zip(before["grads"], after["grads"]))
        assert all(torch.equal(a, b) for a, b in zip(before["buffers"], after["buffers"]))
        assert torch.equal(before["rng"], after["rng"])
        assert before["step"] == after["step"] and before["stats"] == after["stats"]
        assert all((a is None and b is None) or torch.equal(a, b)
                   for a, b in zip(before["momentum"], after["momentum"]))


def test_forward_backward_fn_must_run_one_compress_step():
    model = nn.Linear(8, 8)
    compressor = act.ActivationCompressor(model, act.ACTConfig(bits=4, min_numel=0))
    with pytest.raises(ValueError, match="forward_backward_fn ran 0 compress\\(\\) steps; expected 1"):
        AutoPrecision(compressor).maybe_adapt(0, lambda: model(torch.randn(4, 8)).sum().backward())
    assert compressor.bits_policy is not None and compressor.noise_policy is None  # restored after the error


# ---- layout changes and round robin -------------------------------------------------------------------------
def test_new_layout_falls_back_then_reestimates_and_round_robin_probes_a_fraction():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    compressor = act.ActivationCompressor(model, act.ACTConfig(bits=4, min_numel=0))
    auto = AutoPrecision(compressor, adapt_interval=100, bit_budget=3, adapt_fraction=0.5)

    def step_fn(n):
        x = torch.randn(n, 16)

        def forward_backward():
            with compressor.compress():
                loss = model(x).pow(2).mean()
            loss.backward()
        return forward_backward

    assert auto.maybe_adapt(0, step_fn(8))
    first_layout, tensors = auto.layout, len(auto.layout)
    assert auto.last_round.passes == 1 + tensors and all(k.shape[0] == 8 for k in first_layout)
    step_fn(8)()
    assert not auto.maybe_adapt(1, step_fn(8))
    step_fn(16)()  # a new batch size: every tensor falls back to the largest candidate within the budget
    assert {r.bits for r in compressor.stats().records if r.kind == "compressed"} == {auto.fallback_bits} == {2}
    assert not auto.maybe_adapt(2, step_fn(16))  # one step of a new layout: not yet
    step_fn(16)()
    assert auto.maybe_adapt(3, step_fn(16))  # persistent: re-estimated in full
    assert auto.layout != first_layout and auto.last_round.passes == 1 + tensors
    assert auto.adapt(4, step_fn(16)) is None and auto.last_round.passes == 1 + -(-tensors // 2)  # round robin
    assert auto.cursor == -(-tensors // 2) % tensors


def test_failure_alert_warns_when_compression_variance_dominates():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    compressor = act.ActivationCompressor(model, act.ACTConfig(bits=4, min_numel=0))
    auto = AutoPrecision(compressor, bit_budget=1, alert_ratio=0.5)
    x = torch.randn(32, 16)

    def forward_backward():
        with compressor.compress():
            loss = model(x).pow(2).mean()
        loss.backward()
    for scale in (1.0, 1.0 + 1e-6):  # two nearly equal gradients: a tiny sampling variance
        for p in model.parameters():
            p.grad = torch.full_like(p, scale)
        auto.observe_gradient()
    with pytest.warns(RuntimeWarning, match=r"compression variance is .* times the gradient's sampling variance"):
        auto.maybe_adapt(0, forward_backward)
    assert auto.variance_ratio > 0.5


# ---- Lightning --------------------------------------------------------------------------------------------
class LossRecordingCNN(TinyCNN):
    def __init__(self):
        super().__init__()
        self.net[3] = nn.Sequential(nn.Dropout(0.2), self.net[3])  # dropout RNG must be untouched by probes
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)  # replays by the probes must not log
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        super().on_train_batch_end(outputs, batch, batch_idx)
        self.losses.append(float(outputs["loss"]))  # real steps only (probes replay training_step)


def _fit(config, callbacks, ckpt_path=None, **kwargs):
    torch.manual_seed(0)
    model = LossRecordingCNN()
    trainer = L.Trainer(strategy=act.ACTStrategy(config), callbacks=callbacks, max_epochs=1,
                        **{**TRAINER_ARGS, **kwargs})
    trainer.fit(model, random_loader(n=64, batch_size=8), ckpt_path=ckpt_path)
    return model, trainer


def test_l0_loss_curve_identical_with_and_without_the_callback():
    plain, _ = _fit("L0", [])
    auto = AutoPrecision(adapt_interval=2)
    adapted, _ = _fit("L0", [auto])
    assert auto.rounds == 4 and auto.last_round.passes == 1 and auto.layout == ()
    assert adapted.losses == plain.losses and len(plain.losses) == 8


def test_l1_callback_allocates_logs_and_resumes_from_checkpoint(tmp_path):
    logged = {}

    class Recorder(L.pytorch.loggers.logger.DummyLogger):
        def log_metrics(self, metrics, step=None):
            logged.update(metrics)

    auto = AutoPrecision(adapt_interval=100, bit_budget=3)
    model, trainer = _fit(act.ACTConfig(bits=4), [auto], logger=Recorder(), max_steps=4)
    assert auto.rounds == 1 and len(auto.layout) > 0 and auto.average_bits <= 3
    assert logged["act/adapt/average_bits"] == auto.average_bits
    assert {f"act/adapt/bits/{k.index:04d}" for k in auto.layout} <= set(logged)
    assert trainer.strategy.compressor.stats().average_bits <= 3
    path = tmp_path / "auto.ckpt"
    trainer.save_checkpoint(path)

    resumed = AutoPrecision(adapt_interval=100, bit_budget=3)
    _fit(act.ACTConfig(bits=4), [resumed], max_steps=6, ckpt_path=str(path))
    assert resumed.rounds == 1  # not due again: the restored allocation was used
    assert resumed.assignment() == auto.assignment() and resumed.last_adapted_step == 0


def test_tensorboard_gets_bits_and_sensitivity_histograms(tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    auto = AutoPrecision(adapt_interval=100, bit_budget=3)
    _fit(act.ACTConfig(bits=4), [auto], logger=TensorBoardLogger(str(tmp_path), name="tb", version=0), max_steps=2)
    events = EventAccumulator(str(tmp_path / "tb" / "version_0"), size_guidance={"histograms": 0}).Reload()
    assert {"act/adapt/average_bits", "act/adapt/compression_variance"} <= set(events.Tags()["scalars"])
    bits = events.Histograms("act/adapt/tensor_bits")[-1].histogram_value
    assert (bits.num, bits.sum, bits.max) == (len(auto.bits), sum(auto.bits), max(auto.bits))
    sensitivity = events.Histograms("act/adapt/tensor_sensitivity")[-1].histogram_value
    assert sensitivity.num == len(auto.sensitivities)
    assert sensitivity.sum == pytest.approx(sum(auto.sensitivities), rel=1e-6)


def test_ddp_two_processes_end_with_identical_assignments(tmp_path: Path):
    script = tmp_path / "ddp_auto.py"
    script.write_text(textwrap.dedent(f"""
        import json, torch
        import lightning as L
        from lightning_act.callbacks.auto_precision import AutoPrecision
        from tests.distributed import end_rank
        from tests.lightning_models import TRAINER_ARGS, TinyCNN, random_loader
        torch.manual_seed(0)
        auto = AutoPrecision(adapt_interval=1, bit_budget=3)
        trainer = L.Trainer(strategy="act_ddp", devices=2, callbacks=[auto], **TRAINER_ARGS)
        model = TinyCNN()
        trainer.fit(model, random_loader(seed=trainer.global_rank))
        with open({str(tmp_path)!r} + f"/rank{{trainer.global_rank}}.json", "w") as f:
            json.dump({{"assignment": auto.assignment(), "rounds": auto.rounds,
                       "param_sum": float(sum(p.sum() for p in model.parameters()))}}, f)
        end_rank()
    """))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["rounds"] == ranks[1]["rounds"] == 2
    assert ranks[0]["assignment"] == ranks[1]["assignment"] and len(ranks[0]["assignment"]) > 0
    assert ranks[0]["param_sum"] == pytest.approx(ranks[1]["param_sum"], rel=1e-6)  # still all-reduced
