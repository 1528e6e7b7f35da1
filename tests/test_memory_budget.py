"""Memory-budget mode (issue 17): budgets met on a small BERT and a small ResNet with profiler-measured peaks,
the shortfall warning, the solver's choices, undoing a plan, and the Lightning callback."""
import contextlib
import warnings

import lightning as L
import pytest
import torch
from torch import nn

import lightning_act as act
from lightning_act.adapt.memory_budget import MemoryBudget, PeakModel, Segment, UnitProfile, budget_units
from lightning_act.callbacks import MemoryBudget as MemoryBudgetCallback
from lightning_act.layer_stats import OUTSIDE
from lightning_act.models import resnet8
from lightning_act.profiling import measure_step_memory
from tests.lightning_models import TRAINER_ARGS, MemoryLogger, TinyCNN, random_loader


def small_bert():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(hidden_size=128, num_hidden_layers=3, num_attention_heads=4, intermediate_size=512,
                        vocab_size=500, max_position_embeddings=64)
    model = BertForSequenceClassification(config)
    ids, labels = torch.randint(0, 500, (8, 64)), torch.randint(0, 2, (8,))
    return model, lambda: model(input_ids=ids, labels=labels).loss


def small_resnet():
    torch.manual_seed(0)
    model = resnet8(3, 10, width=32)
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    return model, lambda: nn.functional.cross_entropy(model(x), y)


def peaks(model, loss_fn, compressor):
    """Profiler-measured step peaks: uncompressed, and under the compressor's context."""
    def plain():
        loss_fn().backward()

    def compressed():
        with compressor.compress():
            loss = loss_fn()
        loss.backward()

    def measure(step):
        model.zero_grad(set_to_none=True)
        return measure_step_memory(step).peak_bytes

    return measure(plain), measure(compressed), compressed


@contextlib.contextmanager
def met_plan(compressor, budget, step):
    """The memory-budget plan for ``budget`` (one that can be met: a shortfall warning fails the test), applied
    until the block ends."""
    planner = MemoryBudget(compressor, budget)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        plan = planner.plan(step)
    try:
        yield plan
    finally:
        planner.remove()


@pytest.mark.parametrize("build", [small_bert, small_resnet], ids=["bert", "resnet"])
def test_budget_is_met_within_ten_percent(build):
    model, loss_fn = build()
    model.train()
    compressor = act.ActivationCompressor(model, act.ACTConfig(bits=4, adaptive=False))
    uncompressed, _, step = peaks(model, loss_fn, compressor)
    budget = int(0.7 * uncompressed)
    with met_plan(compressor, budget, step) as plan:
        assert plan.fits and set(plan.options) == {*budget_units(model), OUTSIDE}
        assert set(plan.options.values()) != {"keep"}  # 70% of the uncompressed peak needs some compression
        model.zero_grad(set_to_none=True)
        measured = measure_step_memory(step).peak_bytes
        assert measured <= 1.10 * budget, plan.table()
        assert plan.measured_peak_bytes <= 1.10 * budget


def test_shortfall_warns_with_the_numbers_and_keeps_the_most_aggressive_plan():
    model, loss_fn = small_resnet()
    compressor = act.ActivationCompressor(model, act.ACTConfig(bits=4, adaptive=False))
    _, _, step = peaks(model, loss_fn, compressor)
    planner = MemoryBudget(compressor, "64KiB")
    with pytest.warns(RuntimeWarning, match=r"memory_budget=0\.1 MiB cannot be met: the best plan found peaks at "
                                            r"[0-9.]+ MiB, [0-9.]+ MiB short"):
        plan = planner.plan(step)
    planner.remove()
    assert not plan.fits and plan.measured_peak_bytes > 64 * 1024
    # the plan's peak is at most that of every unit at 2 bits, and of every unit checkpointed (the most aggressive
    # uniform plans), predicted and measured
    uniform = [dict.fromkeys(plan.units, "q2"),
               {name: "checkpoint" if unit.checkpointable else "q2" for name, unit in plan.units.items()}]
    assert plan.predicted_peak_bytes <= min(plan.model.peak(options) for options in uniform)
    assert plan.measured_peak_bytes <= 1.02 * min(plan.model.peak(options) for options in uniform)


def test_remove_restores_forwards_and_policies_and_training_state():
    model, loss_fn = small_resnet()
    compressor = act.ActivationCompressor(model, act.ACTConfig(bits=4, adaptive=False))
    _, _, step = peaks(model, loss_fn, compressor)
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    grads = {name: param.grad.clone() for name, param in model.named_parameters()}  # from peaks()
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    planner = MemoryBudget(compressor, 1)  # everything at 2 bits or checkpointed
    with pytest.warns(RuntimeWarning):
        planner.plan(step)
    assert compressor.codec_policy is not None
    planner.apply({name: "checkpoint" for name in planner.units})
    assert all("forward" in unit.__dict__ for unit in planner.units.values())
    planner.remove()
    assert compressor.codec_policy is None
    assert not any("forward" in unit.__dict__ for unit in planner.units.values())
    assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters())  # profiling's are put back
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())  # BatchNorm statistics too


def test_checkpointed_units_give_gradients_close_to_kept_ones_but_further_than_four_bits():
    model, loss_fn = small_resnet()
    compressor = act.ActivationCompressor(model, act.ACTConfig(bits=4, adaptive=False))
    planner = MemoryBudget(compressor, 1 << 40)
    grads = {}
    for option in ("keep", "q4", "checkpoint"):
        planner.apply({**{name: option for name in planner.units}, OUTSIDE: "keep"})
        model.zero_grad(set_to_none=True)
        with compressor.compress():
            loss = loss_fn()
        loss.backward()
        grads[option] = torch.cat([p.grad.flatten() for p in model.parameters()])
        planner.remove()
    similarity = {option: torch.nn.functional.cosine_similarity(grads["keep"], grads[option], dim=0).item()
                  for option in ("q4", "checkpoint")}
    # recomputing from 4-bit inputs perturbs every recomputed tensor (ReLU masks, BatchNorm statistics): further
    # from the exact gradient than storing each tensor at 4 bits, which the planner's accuracy cost accounts for
    assert similarity["q4"] > 0.99 and 0.9 < similarity["checkpoint"] < similarity["q4"]


def _profiles():
    # two units that store 10 MiB each when kept (float32 values); "(model)" stores nothing
    mib = 1 << 20
    units = {name: UnitProfile(name, value_bytes=10 * mib, value_elements=10 * mib // 4, stats_bytes=10 * mib // 128,
                               input_bytes=mib, forward_seconds=1.0) for name in ("a", "b")}
    units[OUTSIDE] = UnitProfile(OUTSIDE)
    return units


def test_units_that_change_their_input_in_place_are_never_checkpointed():
    # a flat Sequential (ResNet's stem as units): recomputing ReLU(inplace=True) from its saved input would change
    # a leaf in place in backward; the planner must leave such a unit to the codecs, even at its most aggressive
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                          nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 16 * 16, 10))
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
    compressor = act.ActivationCompressor(model, act.ACTConfig(bits=4, adaptive=False))

    def step():
        with compressor.compress():
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()

    planner = MemoryBudget(compressor, 1)  # no plan fits: every unit takes its most aggressive option
    with pytest.warns(RuntimeWarning, match="cannot be met"):
        plan = planner.plan(step)
    try:
        assert [n for n, u in plan.units.items() if not u.checkpointable] == ["2", OUTSIDE]
        assert plan.options["2"] != "checkpoint"
        model.zero_grad(set_to_none=True)
        step()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    finally:
        planner.remove()


def test_solver_meets_the_target_at_the_least_cost_and_prefers_eight_bits_when_they_fit():
    planner = MemoryBudget(act.ActivationCompressor(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))), "1GiB")
    mib, cpu = 1 << 20, torch.device("cpu")
    profiles = _profiles()
    model = PeakModel.additive(profiles, 0)
    # 20 MiB kept; a target of 16 MiB is met by one unit at 8 bits (10 -> ~2.6 MiB): no need for 4 bits
    plan = planner._solve(model, 16 * mib, 1e-9, float("inf"), cpu)
    assert plan.fits and sorted(plan.options.values()) == ["keep", "keep", "q8"]
    assert plan.predicted_peak_bytes == 10 * mib + 10 * mib // 4 + 10 * mib // 128  # one kept, one at 8 bits
    # 6 MiB needs both units compressed; checkpointing costs a forward (1 s) per unit, quantizing ~10 ms
    plan = planner._solve(model, 6 * mib, 1e-9, float("inf"), cpu)
    assert plan.fits and plan.predicted_peak_bytes <= 6 * mib
    assert {plan.options["a"], plan.options["b"]} <= {"q8", "q4"}
    # 0.5 MiB: only checkpointing both (inputs at 4 bits) fits; swap is CUDA-only
    plan = planner._solve(model, mib // 2, 1e-9, float("inf"), cpu)
    assert plan.fits and plan.options["a"] == plan.options["b"] == "checkpoint"
    # a recomputation that costs more than it saves is never taken, even when nothing fits
    plan = planner._solve(PeakModel.additive(profiles, 0, recompute_bytes=30 * mib), mib // 2, 1e-9, float("inf"), cpu)
    assert not plan.fits and "checkpoint" not in plan.options.values()
    assert plan.predicted_peak_bytes == 2 * profiles["a"].stored_bytes("q2")
    # the base alone exceeds the target: the plan does not fit and says so
    plan = planner._solve(PeakModel.additive(profiles, 2 * mib), 1 * mib, 1e-9, float("inf"), cpu)
    assert not plan.fits and "does not fit" in plan.table()


def test_solver_compresses_only_what_is_alive_at_the_peak():
    # a's saved tensors live through the whole step, b's are freed when b's backward is done; the peak is in a's
    # backward (gradients, working set: 15 MiB of base): only compressing a lowers it, and b stays kept
    mib, cpu = 1 << 20, torch.device("cpu")
    profiles = _profiles()
    segments = [Segment("f:a", frozenset({"a", OUTSIDE}), 0), Segment("f:b", frozenset({"a", "b", OUTSIDE}), 0),
                Segment("b:b", frozenset({"a", "b", OUTSIDE}), 0), Segment("b:a", frozenset({"a", OUTSIDE}), 15 * mib)]
    model = PeakModel(profiles, segments)
    assert model.peaks(dict.fromkeys(profiles, "keep")) == [10 * mib, 20 * mib, 20 * mib, 25 * mib]
    planner = MemoryBudget(act.ActivationCompressor(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))), "1GiB")
    plan = planner._solve(model, 22 * mib, 1e-9, float("inf"), cpu)
    assert plan.fits and plan.options == {"a": "q8", "b": "keep", OUTSIDE: "keep"}
    assert plan.predicted_peak_bytes == 15 * mib + profiles["a"].stored_bytes("q8")  # still in a's backward


class _Blocks(nn.Module):
    """32 residual MLP blocks (32 -> 128 -> 32): each block saves 9x its input and its backward's working set is
    small, so storing every block's input at 4 bits (checkpointing) holds less than everything at 2 or 4 bits."""

    def __init__(self, width: int = 32, blocks: int = 32):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                                    for _ in range(blocks))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def _uniform_peaks(planner, step, model):
    """Measured step peaks with every unit at 2 bits, and checkpointed ("(model)" at 2 bits)."""
    out = {}
    for name, option in {"q2": "q2", "checkpoint": "checkpoint"}.items():
        planner.apply({**dict.fromkeys(planner.units, option), OUTSIDE: "q2" if option == "checkpoint" else option})
        model.zero_grad(set_to_none=True)
        out[name] = measure_step_memory(step).peak_bytes
        planner.remove()
    return out


def test_a_budget_only_checkpointing_meets_is_met_by_a_measured_plan():
    torch.manual_seed(0)
    model, x = _Blocks(), torch.randn(1024, 32)
    compressor = act.ActivationCompressor(model, act.ACTConfig(bits=4, adaptive=False))

    def step():
        with compressor.compress():
            loss = model(x).square().mean()
        loss.backward()

    uniform = _uniform_peaks(MemoryBudget(compressor, 1), step, model)
    assert uniform["checkpoint"] < 0.9 * uniform["q2"], uniform  # what this test is about
    budget = (uniform["checkpoint"] + uniform["q2"]) // 2  # too tight for all-2-bit (so for all-4-bit too)
    with met_plan(compressor, budget, step) as plan:
        assert plan.fits and "checkpoint" in plan.options.values(), plan.table()
        model.zero_grad(set_to_none=True)
        measured = measure_step_memory(step).peak_bytes
        assert measured <= budget and plan.measured_peak_bytes <= budget, plan.table()
        # the timeline model predicts the measured peak of the plan it chose (within 2%, never far below it)
        assert 0.98 * measured <= plan.predicted_peak_bytes <= 1.05 * measured, plan.table()
        assert plan.planning_peak_bytes >= plan.measured_peak_bytes


def test_a_loose_budget_keeps_everything_without_profiling_checkpoints():
    model, loss_fn = small_resnet()
    compressor = act.ActivationCompressor(model, act.ACTConfig(bits=4, adaptive=False))
    uncompressed, _, step = peaks(model, loss_fn, compressor)
    planner = MemoryBudget(compressor, 2 * uncompressed)
    plan = planner.plan(step)
    planner.remove()
    assert set(plan.options.values()) == {"keep"} and plan.fits
    assert plan.measured_peak_bytes <= 1.05 * uncompressed
    assert set(planner.pass_peaks) == {"profile, 2 bits", "check 1"}  # no checkpointed pass was needed


def test_a_checkpointed_profile_out_of_memory_plans_without_checkpointing(monkeypatch):
    model, loss_fn = small_resnet()
    compressor = act.ActivationCompressor(model, act.ACTConfig(bits=4, adaptive=False))
    uncompressed, _, step = peaks(model, loss_fn, compressor)
    planner = MemoryBudget(compressor, int(0.7 * uncompressed))
    timeline, calls = planner._timeline, []

    def second_pass_runs_out(*args):
        calls.append(1)
        if len(calls) == 2:  # the checkpointed pass, as a device would refuse it
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return timeline(*args)

    monkeypatch.setattr(planner, "_timeline", second_pass_runs_out)
    with pytest.warns(RuntimeWarning, match="checkpointed ran out of memory; planning without checkpointing"):
        plan = planner.plan(step)
    planner.remove()
    assert len(calls) == 2 and "checkpoint" not in plan.options.values()
    assert plan.measured_peak_bytes <= 1.10 * planner.budget_bytes
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())


def test_timeline_model_predicts_mixed_plans_on_a_resnet():
    from lightning_act.adapt.sensitivity import preserved_training_state

    model, loss_fn = small_resnet()
    compressor = act.ActivationCompressor(model, act.ACTConfig(bits=4, adaptive=False))
    _, _, step = peaks(model, loss_fn, compressor)
    planner = MemoryBudget(compressor, 1)
    params = list(model.parameters())
    with preserved_training_state(compressor, params) as rewind:  # the planner's two profiling passes
        peak_model = planner._profile(step, rewind, torch.device("cpu"))
        planner._profile_checkpoint(peak_model, step, rewind, torch.device("cpu"))
    names, cycle = list(peak_model.units), ["keep", "q8", "q4", "q2", "checkpoint"]
    assert len(peak_model.segments) == 1 + 2 * len(planner.units)  # before the units, each forward and backward
    for shift in range(3):
        options = {n: cycle[(i + shift) % 5] for i, n in enumerate(names)}
        options = {n: "q4" if o == "checkpoint" and not peak_model.units[n].checkpointable else o
                   for n, o in options.items()}
        planner.apply(options)
        model.zero_grad(set_to_none=True)
        measured = measure_step_memory(step).peak_bytes
        planner.remove()
        # conservative (a kept tensor is also the forward's working set) and never more than 1% below
        predicted = peak_model.peak(options)
        assert 0.99 * measured <= predicted <= 1.25 * measured, (options, measured, predicted)


@pytest.mark.parametrize("value, expected", [("6GiB", 6 << 30), ("512 MB", 512_000_000), (1.5e9, 1_500_000_000),
                                             (4096, 4096), ("2kib", 2048)])
def test_budget_sizes_parse(value, expected):
    assert act.ACTConfig(memory_budget=value).memory_budget == expected


@pytest.mark.parametrize("value", ["6 parsecs", 0, -5, True, float("nan"), "0.5B", [1]])
def test_bad_budgets_are_refused_naming_the_value(value):
    with pytest.raises(ValueError, match=r"memory_budget=.*; expected a number of bytes >= 1 or a size such as"):
        act.ACTConfig(memory_budget=value)


def test_a_budget_turns_auto_precision_off_by_default_and_refuses_level_zero():
    assert act.ACTConfig(memory_budget="1GiB").adaptive is False
    assert act.ACTConfig(memory_budget="1GiB", adaptive=True).adaptive is True
    with pytest.raises(ValueError, match="memory_budget=1024 plans compression; got opt_level='L0'"):
        act.ACTConfig(opt_level="L0", memory_budget=1024)


def test_planner_needs_units_and_a_model():
    with pytest.raises(ValueError, match="needs ActivationCompressor\\(model, ...\\)"):
        MemoryBudget(act.ActivationCompressor(None), "1GiB")
    with pytest.raises(ValueError, match="found no units in Linear"):
        MemoryBudget(act.ActivationCompressor(nn.Linear(2, 2)), "1GiB")


def test_lightning_config_budget_plans_on_the_first_batch_logs_it_and_undoes_it():
    model, logger = TinyCNN(), MemoryLogger()
    strategy = act.ACTStrategy(act.ACTConfig(bits=4, memory_budget="300KiB"))
    trainer = L.Trainer(strategy=strategy, **{**TRAINER_ARGS, "logger": logger}, max_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # whether 300 KiB fits is not what is tested here
        trainer.fit(model, random_loader(n=32))
    callbacks = [c for c in trainer.callbacks if isinstance(c, MemoryBudgetCallback)]
    assert len(callbacks) == 1 and callbacks[0].budget == 300 * 1024
    assert callbacks[0].planner is None  # torn down with the fit: plan undone
    assert strategy.compressor.codec_policy is None
    logged = {k: v for _, metrics in logger.metrics for k, v in metrics.items() if k.startswith("act/budget/")}
    assert logged["act/budget/budget_bytes"] == 300 * 1024
    assert logged["act/budget/measured_peak_bytes"] > 0
    assert {k for k in logged if k.startswith("act/budget/unit/")} == {
        f"act/budget/unit/{name}" for name in [*budget_units(model), OUTSIDE]}


def test_memory_budget_callback_without_a_budget_is_refused():
    trainer = L.Trainer(strategy="act", callbacks=[MemoryBudgetCallback()], **TRAINER_ARGS, max_steps=1)
    with pytest.raises(ValueError, match="MemoryBudget needs a budget"):
        trainer.fit(TinyCNN(), random_loader(n=16))
