"""``Trainer(strategy="act")`` and friends, on CPU."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning as L
import pytest
import torch

import lightning_act as act
from tests.lightning_models import TRAINER_ARGS, MemoryLogger, TinyCNN, random_loader

ROOT = Path(__file__).resolve().parents[1]


def _bits_by_codec(stats):
    out = {}
    for r in stats.records:
        if r.kind == "compressed":
            out.setdefault(r.codec, set()).add(r.bits)
    return out


def _params(model):
    return torch.cat([p.detach().flatten().clone() for p in model.parameters()])


@pytest.mark.parametrize("extra", [{}, {"accumulate_grad_batches": 2}, {"precision": "bf16-mixed"}])
def test_act_strategy_trains_and_compresses(extra):
    torch.manual_seed(0)
    model = TinyCNN()
    before = _params(model)
    trainer = L.Trainer(strategy="act", **TRAINER_ARGS, **extra)
    assert isinstance(trainer.strategy, act.ACTStrategy)
    trainer.fit(model, random_loader())
    assert not torch.equal(before, _params(model))
    assert len(model.compressed_ratios) == 4
    assert all(r > 3 for r in model.compressed_ratios)
    stats = trainer.strategy.compressor.stats()
    # L1 is adaptive (GACT Table 1): the strategy added AutoPrecision, which spread the bits at 4 on average;
    # ReLU outputs are also stored as 1-bit masks for the ReLU backward
    assert sum(isinstance(c, act.callbacks.AutoPrecision) for c in trainer.callbacks) == 1
    bits = _bits_by_codec(stats)
    assert bits["positive_mask"] == {1.0} and bits["quantize"] <= {1.0, 2.0, 4.0, 8.0, 32.0}
    quantized = [(r.bits, r.original_bytes) for r in stats.records if r.codec == "quantize"]
    average = sum(b * n for b, n in quantized) / sum(n for _, n in quantized)
    assert 2.0 <= average <= 4.0


def test_fixed_bits_without_auto_precision():
    torch.manual_seed(0)
    trainer = L.Trainer(strategy=act.ACTStrategy(act.ACTConfig(bits=4, adaptive=False)), **TRAINER_ARGS)
    trainer.fit(TinyCNN(), random_loader())
    assert not any(isinstance(c, act.callbacks.AutoPrecision) for c in trainer.callbacks)
    assert _bits_by_codec(trainer.strategy.compressor.stats()) == {"quantize": {4.0}, "positive_mask": {1.0}}


def test_a_module_the_user_compiled_is_compressed_inside_its_graphs():
    """``trainer.fit(torch.compile(model))``: Lightning unwraps the module and compiles its forward in place; the
    strategy's compressor then compresses inside the compiled graphs (not after each compiled forward, which would
    hold every activation at full size first), and auto-precision leaves them at the config's bits."""
    torch.manual_seed(0)
    model = TinyCNN()
    before = _params(model)
    trainer = L.Trainer(strategy="act", **TRAINER_ARGS)
    trainer.fit(torch.compile(model), random_loader())
    assert not torch.equal(before, _params(model))
    compressor = trainer.strategy.compressor
    assert compressor.graph_hooks is not None
    stats = compressor.stats()
    compiled = [r for r in stats.records if r.phase == "compiled"]
    assert compiled and {(r.codec, r.bits) for r in compiled if r.dtype != torch.bool} == {("quantize", 4.0)}
    assert stats.ratio > 3


def test_manual_optimization():
    torch.manual_seed(0)
    model = TinyCNN(manual=True)
    before = _params(model)
    trainer = L.Trainer(strategy=act.ACTStrategy(act.ACTConfig(bits=2)), **TRAINER_ARGS)
    with pytest.warns(UserWarning, match="auto-precision replays training_step.*fixed bits=2"):
        trainer.fit(model, random_loader())
    assert not torch.equal(before, _params(model))
    assert _bits_by_codec(trainer.strategy.compressor.stats()) == {"quantize": {2.0}, "positive_mask": {1.0}}


def test_l0_strategy_matches_plain_training_exactly():
    results = []
    for strategy in ("auto", act.ACTStrategy("L0")):
        torch.manual_seed(0)
        model = TinyCNN()
        L.Trainer(strategy=strategy, **TRAINER_ARGS).fit(model, random_loader())
        results.append(_params(model))
    assert torch.equal(*results)


def test_compression_monitor_logs_ratio():
    logger = MemoryLogger()
    args = {**TRAINER_ARGS, "logger": logger, "log_every_n_steps": 1}
    trainer = L.Trainer(strategy="act", callbacks=[act.callbacks.CompressionMonitor()], **args)
    trainer.fit(TinyCNN(), random_loader())
    logged = [m for _, m in logger.metrics if "act/compression_ratio" in m]
    assert len(logged) == 4
    assert all(m["act/compression_ratio"] > 3 and m["act/stored_bytes"] < m["act/original_bytes"] for m in logged)


def test_compression_monitor_needs_act_strategy():
    trainer = L.Trainer(strategy="auto", callbacks=[act.callbacks.CompressionMonitor()], **TRAINER_ARGS)
    with pytest.raises(ValueError, match="CompressionMonitor needs an activation-compressing strategy; got"):
        trainer.fit(TinyCNN(), random_loader())


@pytest.fixture
def four_cuda_devices(monkeypatch):
    """Lightning's device resolution sees four CUDA devices (only Trainer construction: nothing runs on them)."""
    import lightning.fabric.accelerators.cuda as fabric_cuda
    import lightning.pytorch.accelerators.cuda as pl_cuda

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(fabric_cuda, "num_cuda_devices", lambda: 4)
    monkeypatch.setattr(pl_cuda, "num_cuda_devices", lambda: 4)


@pytest.mark.parametrize("devices, root", [([2], "cuda:2"), ([3], "cuda:3"), (1, "cuda:0"), ("1", "cuda:0")])
def test_act_trains_on_the_device_the_trainer_was_given(four_cuda_devices, recwarn, devices, root):
    trainer = L.Trainer(strategy="act", accelerator="gpu", devices=devices, logger=False)
    assert trainer.strategy.root_device == torch.device(root)
    assert trainer.device_ids == [torch.device(root).index]
    assert not [w for w in recwarn if "act_ddp" in str(w.message)]


@pytest.mark.parametrize("accelerator, devices, named", [("gpu", 2, "cuda:0, cuda:1"), ("gpu", [1, 3], "cuda:1, cuda:3"),
                                                          ("gpu", "auto", "cuda:0, cuda:1, cuda:2, cuda:3"),
                                                          ("cpu", 2, "cpu, cpu")])
def test_act_given_several_devices_says_it_trains_on_the_first(four_cuda_devices, accelerator, devices, named):
    first = named.split(",")[0]
    with pytest.warns(UserWarning, match=rf"trains on one device, {first}, of the {named.count(',') + 1} the Trainer "
                                         rf"was given \({named}\); use strategy='act_ddp'"):
        trainer = L.Trainer(strategy="act", accelerator=accelerator, devices=devices, logger=False)
    assert trainer.strategy.root_device == torch.device(first)


def test_act_with_a_device_of_its_own_keeps_it(four_cuda_devices, recwarn):
    trainer = L.Trainer(strategy=act.ACTStrategy(device="cuda:1"), accelerator="gpu", devices=2, logger=False)
    assert trainer.strategy.root_device == torch.device("cuda:1")
    assert not [w for w in recwarn if "act_ddp" in str(w.message)]


def test_registered_in_pytorch_lightning_too():
    pl = pytest.importorskip("pytorch_lightning")
    from lightning_act.strategies import PLACTDDPStrategy, PLACTStrategy

    assert {"act", "act_ddp", "act_ddp_spawn"} <= set(pl.strategies.StrategyRegistry.available_strategies())
    trainer = pl.Trainer(strategy="act", accelerator="cpu", logger=False, enable_checkpointing=False)
    assert isinstance(trainer.strategy, PLACTStrategy)
    assert issubclass(PLACTDDPStrategy, pl.strategies.DDPStrategy)


def test_act_ddp_two_processes_both_compress(tmp_path: Path):
    script = tmp_path / "ddp_run.py"
    script.write_text(textwrap.dedent(f"""
        import json, torch
        import lightning as L
        import lightning_act as act
        from tests.distributed import end_rank
        from tests.lightning_models import TRAINER_ARGS, TinyCNN, random_loader
        torch.manual_seed(0)
        model = TinyCNN()
        trainer = L.Trainer(strategy="act_ddp", devices=2, **TRAINER_ARGS)
        assert isinstance(trainer.strategy, act.ACTDDPStrategy)
        trainer.fit(model, random_loader())
        out = {{"rank": trainer.global_rank, "ratios": model.compressed_ratios,
                "param_sum": float(sum(p.sum() for p in model.parameters()))}}
        with open({str(tmp_path)!r} + f"/rank{{trainer.global_rank}}.json", "w") as f:
            json.dump(out, f)
        end_rank()
    """))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # the script imports tests.lightning_models
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        assert len(r["ratios"]) == 2 and all(x > 3 for x in r["ratios"])  # 64 samples / 2 ranks / batch 16
    assert ranks[0]["param_sum"] == pytest.approx(ranks[1]["param_sum"], rel=1e-6)  # gradients all-reduced
