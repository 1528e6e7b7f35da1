"""Adaptive per-layer error bounds (Jin et al. eq. 8-9): formula, momentum reading, hooks, policy, Lightning."""
import contextlib
import math
import os
import tempfile

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn

import lightning_act as act
from lightning_act.adapt.error_bound import (ErrorBoundController, momentum_magnitude, paper_error_bound,
                                             tracked_layers)
from lightning_act.callbacks.error_bound import ErrorBoundCallback
from lightning_act.codecs.lorenzo import LorenzoCodec


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _train_step(model, compressor, optimizer, controller, x, y):
    with compressor.compress():
        loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return controller.step()


def test_paper_formula():
    bound = paper_error_bound(momentum=2.0, mean_grad=0.5, terms=64, nonzero=0.25)
    assert bound == pytest.approx(0.01 * 2.0 / (0.32 * 0.5 * math.sqrt(16)))
    assert paper_error_bound(momentum=0.0, mean_grad=0.5, terms=64, nonzero=1.0) is None
    assert paper_error_bound(momentum=1.0, mean_grad=0.0, terms=64, nonzero=1.0) is None


class _BiasOnly(nn.Module):
    """A GCN-like wrapper: a weight layer inside, a bias and a multiplicative normaliser of its own."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64, bias=False)
        self.bias = nn.Parameter(torch.zeros(64))

    def forward(self, x):
        norm = torch.rand(x.shape[0], 1, generator=torch.Generator().manual_seed(0)) * 0.1  # like 1/sqrt(deg)
        return self.lin(x) * norm + self.bias


def test_tracked_layers_are_modules_with_a_weight_matrix_or_kernel():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2)),
                          _BiasOnly())
    assert list(tracked_layers(model)) == ["0", "2.0", "3.lin"]


def test_momentum_in_gradient_units_for_sgd_and_adam():
    p = nn.Parameter(torch.ones(10))
    sgd = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.full((10,), 2.0)
    sgd.step()
    assert momentum_magnitude(sgd, p) == pytest.approx(2.0 * 0.1)  # buffer = grad, times 1 - momentum
    adam = torch.optim.Adam([p], betas=(0.9, 0.99))
    adam.step()
    assert momentum_magnitude(adam, p) == pytest.approx(2.0)  # bias-corrected exp_avg
    assert momentum_magnitude(None, p) is None  # no optimizer, no momentum
    assert momentum_magnitude(torch.optim.SGD([p], lr=0.1), p) is None  # plain SGD keeps none


def test_rmsprop_momentum_in_gradient_units():
    """RMSprop's momentum buffer holds gradients over their running RMS (about 1 / (1 - momentum) whatever the
    gradient's scale): in gradient units a constant gradient's momentum is that gradient."""
    p = nn.Parameter(torch.ones(10))
    rmsprop = torch.optim.RMSprop([p], lr=1e-6, momentum=0.5, alpha=0.5)
    for _ in range(40):
        p.grad = torch.full((10,), 3e-4)
        rmsprop.step()
    assert momentum_magnitude(rmsprop, p) == pytest.approx(3e-4, rel=1e-3)


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "rmsprop", "rmsprop_centered"])
def test_momentum_tracks_the_gradients_scale_for_every_optimizer(optimizer):
    """On a model trained by minibatches, the momentum of a layer's weight is a fraction of its mean |gradient|
    (noisy gradients average out), the same fraction for every optimizer: RMSprop's was 250 times larger."""
    make = {"sgd": lambda ps: torch.optim.SGD(ps, 0.01, momentum=0.9),
            "adam": lambda ps: torch.optim.Adam(ps, 1e-4),
            "rmsprop": lambda ps: torch.optim.RMSprop(ps, 1e-4, momentum=0.9),
            "rmsprop_centered": lambda ps: torch.optim.RMSprop(ps, 1e-4, momentum=0.9, centered=True)}[optimizer]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 4))
    opt = make(model.parameters())
    x, y = torch.randn(256, 64), torch.randint(0, 4, (256,))
    ratios = []
    for step in range(60):
        batch = torch.randint(0, 256, (32,))
        nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
        grad = float(model[0].weight.grad.abs().mean())
        opt.step()
        opt.zero_grad()
        if step % 10 == 9:
            ratios.append(momentum_magnitude(opt, model[0].weight) / grad)
    assert all(0.2 < r < 0.7 for r in ratios), ratios


def test_optimizer_without_momentum_gets_the_fallback_bound_with_a_warning():
    model = _mlp()
    compressor = act.ActivationCompressor(model, act.ACTConfig(min_numel=0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    controller = ErrorBoundController(compressor, optimizer, interval=2, fallback_error_bound=5e-3)
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    with controller, pytest.warns(UserWarning, match=r"SGD keeps no momentum for layers 0, 2; .*"
                                                     r"fallback_error_bound=0.005"):
        assert _train_step(model, compressor, optimizer, controller, x, y) == {"0": 5e-3, "2": 5e-3}
    assert {r.error_bound for r in compressor.stats().records if r.codec == "lorenzo"} <= {5e-3}
    with pytest.raises(ValueError, match="fallback_error_bound=0; expected a finite number > 0"):
        ErrorBoundController(compressor, optimizer, fallback_error_bound=0)


class _TwoOptimizers:
    """SGD with momentum for the first layer, Adam for the last: one ``step`` steps both."""

    def __init__(self, model, holds_last: bool = True):
        self.sgd = torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9)
        self.adam = torch.optim.Adam(model[2].parameters() if holds_last else [model[2].bias])

    def step(self):
        self.sgd.step()
        self.adam.step()

    def zero_grad(self):
        self.sgd.zero_grad()
        self.adam.zero_grad()


def test_each_layer_reads_the_momentum_of_the_optimizer_holding_its_weight(recwarn):
    model = _mlp()
    compressor = act.ActivationCompressor(model, act.ACTConfig(min_numel=0))
    optimizers = _TwoOptimizers(model)
    controller = ErrorBoundController(compressor, [optimizers.sgd, optimizers.adam], interval=2)
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    with controller:
        bounds = _train_step(model, compressor, optimizers, controller, x, y)
    assert set(bounds) == {"0", "2"}
    for layer, optimizer in (("0", optimizers.sgd), ("2", optimizers.adam)):
        stats, weight = controller.stats[layer], model[int(layer)].weight
        assert bounds[layer] == pytest.approx(paper_error_bound(momentum_magnitude(optimizer, weight), stats.mean_grad,
                                                                stats.terms, stats.nonzero))
    assert not [w for w in recwarn if "keeps no momentum" in str(w.message)]


def test_a_layer_no_optimizer_holds_gets_the_fallback_bound_with_a_warning():
    model = _mlp()
    compressor = act.ActivationCompressor(model, act.ACTConfig(min_numel=0))
    optimizers = _TwoOptimizers(model, holds_last=False)  # the last layer's weight is frozen out of both
    controller = ErrorBoundController(compressor, (optimizers.sgd, optimizers.adam), interval=2,
                                      fallback_error_bound=5e-3)
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    with controller, pytest.warns(UserWarning, match=r"no optimizer holds the weights of layers 2; "
                                                     r"their lorenzo error bound stays at fallback_error_bound=0.005"):
        bounds = _train_step(model, compressor, optimizers, controller, x, y)
    assert bounds["2"] == 5e-3 and bounds["0"] != 5e-3


def test_products_are_counted_over_every_call_of_the_step_but_not_over_probes():
    """N counts every product summed into the weight gradient: a layer applied twice in a step sums twice as many.
    Auto-precision's probe passes (``detached_steps``) add nothing to what the step measured."""
    shared = nn.Linear(16, 16)
    model = nn.Sequential(shared)
    compressor = act.ActivationCompressor(model, act.ACTConfig(min_numel=0))
    controller = ErrorBoundController(compressor, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    x = torch.randn(8, 16)
    with controller:
        with compressor.detached_steps():
            assert compressor.in_detached_steps
            with compressor.compress():
                shared(x).sum().backward()
        assert not compressor.in_detached_steps and controller.stats == {}
        with compressor.compress():
            once = shared(x)
        once.sum().backward()
        assert controller.stats["0"].terms == 8 and controller.stats["0"].grad_count == 1
        controller.stats.clear()
        with compressor.compress():
            twice = shared(torch.tanh(shared(x)))
        twice.sum().backward()
        assert controller.stats["0"].terms == 16 and controller.stats["0"].grad_count == 2


def test_controller_state_round_trips_bounds_and_schedule():
    model = _mlp()
    compressor = act.ActivationCompressor(model, act.ACTConfig(min_numel=0))
    optimizer = torch.optim.Adam(model.parameters())
    controller = ErrorBoundController(compressor, optimizer, interval=3)
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    with controller:
        for _ in range(4):
            _train_step(model, compressor, optimizer, controller, x, y)
    state = controller.state_dict()
    assert state["steps"] == 4 and set(state["error_bounds"]) == {"0", "2"}
    resumed = ErrorBoundController(compressor, optimizer, interval=3)
    resumed.load_state_dict(state)
    assert resumed.error_bounds == controller.error_bounds
    assert not resumed._measuring  # step 4 is not a measured step (every 3rd is)
    x = torch.randn(4, 32)
    resumed._running.append(("2", x))
    assert resumed(0, x).error_bound == state["error_bounds"]["2"]


def test_bounds_per_layer_follow_the_momentum():
    model = _mlp()
    compressor = act.ActivationCompressor(model, act.ACTConfig(min_numel=0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    controller = ErrorBoundController(compressor, optimizer, interval=2)
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    with controller:
        changed = _train_step(model, compressor, optimizer, controller, x, y)
        assert set(changed) == {"0", "2"}
        first = dict(controller.error_bounds)
        # layer "2"'s input (itself, a view, an autocast copy) gets its bound; anything else the configured codec
        h = torch.randn(8, 32)
        controller._running.append(("2", h))
        for saved in (h, h.view(2, 4, 32), h.to(torch.bfloat16)):
            codec = controller(0, saved)
            assert isinstance(codec, LorenzoCodec) and codec.error_bound == first["2"]
        assert controller(0, torch.randn(8, 1)) is None
        assert controller(0, torch.randn(8, 8, 8)) is None  # softmax-like: same size, other last dimension
        controller._running.pop()
        assert controller(0, h) is None  # outside any layer

        for state in optimizer.state.values():
            state["momentum_buffer"].mul_(4)
        assert _train_step(model, compressor, optimizer, controller, x, y) == {}  # step 1: not measured
        changed = _train_step(model, compressor, optimizer, controller, x, y)  # step 2: measured, refreshed
        assert set(changed) == {"0", "2"}
        for name in first:
            assert controller.error_bounds[name] > 2 * first[name]  # momentum x ~4: bound up accordingly
    records = compressor.stats().records
    assert any(r.codec == "lorenzo" for r in records)


def test_default_codec_until_first_refresh_then_lorenzo():
    model = _mlp()
    compressor = act.ActivationCompressor(model, act.ACTConfig(min_numel=0))
    controller = ErrorBoundController(compressor, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(4, 16)
    controller._running.append(("0", x))
    assert controller(0, x) is None
    controller.initial_error_bound = 1e-3
    assert controller(0, x).error_bound == 1e-3


def test_gradient_multipliers_keep_the_configured_bound():
    """An adapted bound can exceed a normaliser's values (GCN's edge weights): only layer inputs take it."""
    model = _BiasOnly()
    compressor = act.ActivationCompressor(model, act.ACTConfig(codec="lorenzo", error_bound=1e-4, min_numel=0))
    optimizer = torch.optim.Adam(model.parameters())
    controller = ErrorBoundController(compressor, optimizer, interval=1, initial_error_bound=10.0)
    x = torch.randn(256, 64)
    with controller:
        with compressor.compress():
            loss = model(x).square().mean()
        loss.backward()
    bounds = sorted((r.shape, r.error_bound) for r in compressor.stats().records if r.codec == "lorenzo")
    # lin's input at the layer's bound; lin's output and the normaliser (the product's operands) not
    assert bounds == [((256, 1), 1e-4), ((256, 64), 1e-4), ((256, 64), 10.0)]


def test_hooks_removed_and_policy_restored_even_if_forward_raises():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(5, 4))  # the second layer cannot take the first's output
    compressor = act.ActivationCompressor(model)
    controller = ErrorBoundController(compressor)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        with controller:
            assert compressor.codec_policy is controller
            with compressor.compress():
                model(torch.randn(2, 4))
    assert controller._running == []
    assert compressor.codec_policy is None
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


@pytest.mark.parametrize("field,value,match", [
    ("interval", 0, r"interval=0; expected an integer >= 1"),
    ("coefficient", -1.0, r"coefficient=-1.0; expected a finite number > 0"),
    ("initial_error_bound", float("nan"), r"initial_error_bound=nan; expected a finite number > 0"),
])
def test_invalid_options(field, value, match):
    compressor = act.ActivationCompressor(_mlp())
    with pytest.raises(ValueError, match=match):
        ErrorBoundController(compressor, **{field: value})


def test_needs_a_model():
    with pytest.raises(ValueError, match="needs a model"):
        ErrorBoundController(act.ActivationCompressor())


def _digits(seed: int = 0):
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16
    y = torch.tensor(digits.target)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    return x[perm[:1400]], y[perm[:1400]], x[perm[1400:]], y[perm[1400:]]


class DigitsCNN(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(),
                                 nn.MaxPool2d(2), nn.Flatten(), nn.Linear(16 * 16, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _train_mlp(adaptive: bool, epochs: int = 6) -> tuple[float, ErrorBoundController]:
    """A ReLU MLP on digits in plain PyTorch: test accuracy, and the controller it used."""
    xtr, ytr, xte, yte = _digits()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    config = act.ACTConfig(codec="lorenzo", error_bound=1e-3, min_numel=0)  # for tensors other than layer inputs
    compressor = act.ActivationCompressor(model, config if adaptive else "L0")
    controller = ErrorBoundController(compressor, optimizer, interval=5)
    with controller if adaptive else contextlib.nullcontext():
        for epoch in range(epochs):
            perm = torch.randperm(len(ytr), generator=torch.Generator().manual_seed(epoch))
            for i in range(0, len(ytr), 100):
                batch = perm[i:i + 100]
                _train_step(model, compressor, optimizer, controller, xtr[batch], ytr[batch])
    with torch.no_grad():
        return (model(xte).argmax(1) == yte).float().mean().item(), controller


def test_digits_accuracy_within_one_point_of_baseline():
    baseline, _ = _train_mlp(adaptive=False)
    accuracy, controller = _train_mlp(adaptive=True)
    assert accuracy >= baseline - 0.01, (accuracy, baseline)
    assert set(controller.error_bounds) == {"1", "3"}


def test_lightning_callback_logs_bounds_that_move_with_the_momentum():
    xtr, ytr, _, _ = _digits()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xtr[:640], ytr[:640]), batch_size=64)
    callback = ErrorBoundCallback(interval=2)
    logger = CSVLogger(tempfile.mkdtemp())
    trainer = L.Trainer(strategy=act.ACTStrategy(act.ACTConfig(min_numel=0)), max_epochs=1, callbacks=[callback],
                        logger=logger, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(DigitsCNN(), loader)
    assert [step for step, _ in callback.history] == [1, 3, 5, 7, 9]
    assert set(callback.history[-1][1]) == {"net.0", "net.2", "net.6"}
    assert len({bounds["net.2"] for _, bounds in callback.history}) == 5  # refreshed bounds all differ
    logged = open(os.path.join(logger.log_dir, "metrics.csv")).readline()
    assert "act/error_bound/net.0" in logged
    assert callback.controller._handles == []  # detached at the end of training


def test_callback_state_is_saved_in_checkpoints_and_restored_on_resume(tmp_path):
    xtr, ytr, _, _ = _digits()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xtr[:320], ytr[:320]), batch_size=64)
    args = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    callback = ErrorBoundCallback(interval=2)
    trainer = L.Trainer(strategy=act.ACTStrategy(act.ACTConfig(min_numel=0)), max_epochs=1, callbacks=[callback],
                        **args)
    trainer.fit(DigitsCNN(), loader)
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    saved_bounds, saved_history = dict(callback.controller.error_bounds), list(callback.history)
    assert callback.controller.steps == 5 and saved_bounds

    class FirstBounds(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.seen = getattr(self, "seen", None) or dict(resumed.controller.error_bounds)

    resumed, probe = ErrorBoundCallback(interval=2), FirstBounds()
    trainer = L.Trainer(strategy=act.ACTStrategy(act.ACTConfig(min_numel=0)), max_epochs=2,
                        callbacks=[resumed, probe], **args)
    trainer.fit(DigitsCNN(), loader, ckpt_path=tmp_path / "last.ckpt")
    assert probe.seen == saved_bounds  # the first resumed step compresses with the saved bounds
    assert resumed.controller.steps == 10
    assert resumed.history[:len(saved_history)] == saved_history
    assert [step for step, _ in resumed.history] == [1, 3, 5, 7, 9]


class DigitsGAN(DigitsCNN):
    """Manual optimization with two optimizers (a GAN's layout): the convolutions' and the classifier's."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        convs, head = self.optimizers()
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.manual_backward(loss)
        convs.step()
        head.step()
        convs.zero_grad()
        head.zero_grad()

    def configure_optimizers(self):
        return (torch.optim.SGD(self.net[:4].parameters(), lr=0.1, momentum=0.9),
                torch.optim.Adam(self.net[6].parameters(), lr=1e-3))


def test_callback_reads_every_optimizer_of_the_module(recwarn):
    xtr, ytr, _, _ = _digits()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xtr[:256], ytr[:256]), batch_size=64)
    callback = ErrorBoundCallback(interval=2)
    trainer = L.Trainer(strategy=act.ACTStrategy(act.ACTConfig(min_numel=0, adaptive=False)), max_epochs=1,
                        callbacks=[callback], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    module = DigitsGAN()
    trainer.fit(module, loader)
    assert set(callback.history[-1][1]) == {"net.0", "net.2", "net.6"}
    head = module.optimizers()[1].optimizer
    assert momentum_magnitude(head, module.net[6].weight) is not None
    assert not [w for w in recwarn if "keeps no momentum" in str(w.message)]


def test_callback_steps_with_the_optimizer_under_gradient_accumulation(recwarn):
    """Refreshes follow optimizer steps (every 2nd of 5), after them: before, the first batch of an accumulated step
    refreshed before any optimizer step (no momentum yet: the fallback bound and a false warning)."""
    xtr, ytr, _, _ = _digits()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xtr[:640], ytr[:640]), batch_size=64)
    callback = ErrorBoundCallback(interval=2, fallback_error_bound=5e-3)
    trainer = L.Trainer(strategy=act.ACTStrategy(act.ACTConfig(min_numel=0)), max_epochs=1, callbacks=[callback],
                        accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(DigitsCNN(), loader)
    assert [step for step, _ in callback.history] == [1, 3, 5]
    assert 5e-3 not in {bound for _, bounds in callback.history for bound in bounds.values()}
    assert callback.controller.steps == 5
    assert not [w for w in recwarn if "keeps no momentum" in str(w.message)]


def test_callback_needs_a_compressing_strategy():
    trainer = L.Trainer(callbacks=[ErrorBoundCallback()], logger=False, max_epochs=1, enable_progress_bar=False)
    with pytest.raises(ValueError, match="ErrorBoundCallback needs an activation-compressing strategy"):
        trainer.fit(DigitsCNN(), torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(torch.randn(4, 1, 8, 8), torch.zeros(4, dtype=torch.long))))
