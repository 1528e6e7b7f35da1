"""``Trainer(strategy="act_fsdp", devices=2, accelerator="cpu")``: FSDP2 over gloo, two processes.

One worker script (launched once, its second rank started by Lightning) runs every scenario and writes what the
tests compare: L0 against Lightning's own ``ModelParallelStrategy`` with the same sharding, 4 bits against one
process on rank 0's batch, auto-precision through a sharded checkpoint, torch's and lightning_act's
checkpointing, and a DTensor saved for backward. The model's attention projections use chunks of one fused
weight (``SplitBackward`` views): the weights FSDP all-gathers only pass as parameters when the engine knows them.
"""
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

ROOT = Path(__file__).resolve().parents[1]
WORKER = textwrap.dedent('''
    import json, os, sys, torch
    import lightning as L
    from torch import nn
    import lightning_act as act
    from lightning_act.checkpoint import checkpoint
    from lightning_act.fsdp import shard_blocks
    from tests.distributed import end_rank

    OUT = sys.argv[1]
    ARGS = dict(accelerator="cpu", devices=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, max_epochs=1)
    Q4 = dict(bits=4, adaptive=False, min_numel=64)


    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.ln, self.qkv, self.out = nn.LayerNorm(d), nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d)
            self.fc, self.proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            h = self.ln(x)
            q, k, v = (nn.functional.linear(h, w) for w in self.qkv.weight.chunk(3))
            x = x + self.out(torch.softmax(q @ k.transpose(1, 2) / 4.0, dim=-1) @ v)
            return x + self.proj(torch.relu(self.fc(x)))


    class TinyTransformer(L.LightningModule):
        def __init__(self, checkpointing=None, d=24):
            super().__init__()
            self.embed, self.head = nn.Embedding(32, d), nn.Linear(d, 5)
            self.blocks = nn.ModuleList(Block(d) for _ in range(2))
            self.checkpointing = checkpointing
            self.losses, self.grads, self.records, self.ratios = [], [], [], []

        def forward(self, tokens):
            x = self.embed(tokens)
            for block in self.blocks:
                if self.checkpointing == "act":  # CB1's compressed checkpoint
                    x = checkpoint(block, x)
                elif self.checkpointing == "torch":  # what FSDP users apply (checkpoint_wrapper is this)
                    x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
                else:
                    x = block(x)
            return self.head(x).mean(1)

        def training_step(self, batch, batch_idx):
            loss = nn.functional.cross_entropy(self(batch[0]), batch[1])
            self.losses.append(loss.item())
            return loss

        def on_before_optimizer_step(self, optimizer):
            self.grads.append([p.grad.full_tensor().flatten().tolist() for p in self.parameters()])

        def on_train_batch_end(self, outputs, batch, batch_idx):
            compressor = getattr(self.trainer.strategy, "compressor", None)
            if compressor is not None:
                self.records.append(records(compressor))
                self.ratios.append(compressor.stats().ratio)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)


    class PlainFSDP(TinyTransformer):  # the run without compression: Lightning's strategy, the same sharding
        def configure_model(self):
            shard_blocks(self, self.device_mesh["data_parallel"])


    class RestoredState(L.Callback):
        def on_train_start(self, trainer, pl_module):
            self.state = next(c for c in trainer.callbacks if isinstance(c, act.callbacks.AutoPrecision)).state_dict()


    def records(compressor):
        return [[r.kind, list(r.shape), r.codec, r.phase, r.bits] for r in compressor.stats().records]


    def loader():
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randint(0, 32, (16, 10), generator=g),
                                              torch.randint(0, 5, (16,), generator=g))
        return torch.utils.data.DataLoader(data, batch_size=4)


    def fit(model, strategy, ckpt_path=None, **kwargs):
        trainer = L.Trainer(strategy=strategy, **{**ARGS, **kwargs})
        trainer.fit(model, loader(), ckpt_path=ckpt_path)
        return trainer


    def fresh(seed=0, **kwargs):
        torch.manual_seed(seed)
        return TinyTransformer(**kwargs)


    out = {}
    torch.manual_seed(0)
    plain = PlainFSDP()
    trainer = fit(plain, L.pytorch.strategies.ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                  max_steps=2)
    rank = trainer.global_rank
    l0 = fresh()
    trainer = fit(l0, act.ACTFSDPStrategy("L0"), max_steps=2)
    out["l0"] = {"losses": l0.losses, "plain_losses": plain.losses, "grads_equal": l0.grads == plain.grads,
                 "kinds": sorted({r[0] for r in l0.records[0]}), "strategy": type(trainer.strategy).__name__}

    # bf16 autocast: the all-gathered weights' copies are held as saved (FSDP frees and gathers them again before
    # the backward), not cast again from the parameter as a single process's are
    torch.manual_seed(0)
    plain16 = PlainFSDP()
    fit(plain16, L.pytorch.strategies.ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=2, precision="bf16-mixed")
    l016 = fresh()
    fit(l016, act.ACTFSDPStrategy("L0"), max_steps=2, precision="bf16-mixed")
    out["l0_bf16"] = {"losses_equal": l016.losses == plain16.losses, "grads_equal": l016.grads == plain16.grads}

    q4 = fresh()
    fit(q4, act.ACTFSDPStrategy(act.ACTConfig(**Q4)), max_steps=1)
    out["q4"] = {"records": q4.records[0], "ratio": q4.ratios[0], "losses": q4.losses,
                 "weight_shapes": [list(p.shape) for p in q4.parameters() if p.dim() == 2]}
    if rank == 0:  # one process, the same initial model and rank 0's batch (the sampler's indices 0, 2, 4, 6)
        single = fresh()
        tokens, labels = loader().dataset.tensors
        compressor = act.ActivationCompressor(single, act.ACTConfig(**Q4))
        with compressor.compress():
            loss = single.training_step((tokens[0:8:2], labels[0:8:2]), 0)
        loss.backward()
        out["single"] = {"records": records(compressor), "ratio": compressor.stats().ratio}

    adaptive = lambda: act.ACTFSDPStrategy(act.ACTConfig(bits=4, min_numel=64, adapt_interval=10))  # noqa: E731
    first, auto = fresh(), act.callbacks.AutoPrecision()
    trainer = fit(first, adaptive(), max_steps=2, callbacks=[auto])
    path = trainer.strategy.broadcast(os.path.join(OUT, "sharded.ckpt"))
    trainer.save_checkpoint(path)
    resumed, restored = fresh(seed=1), RestoredState()
    fit(resumed, adaptive(), ckpt_path=path, max_steps=3, max_epochs=2,
        callbacks=[restored, act.callbacks.AutoPrecision()])
    out["adaptive"] = {"state": auto.state_dict(), "restored": restored.state, "sharded": os.path.isdir(path),
                       "last_bits": [r[4] for r in first.records[-1] if r[0] == "compressed"],
                       "resumed_bits": [r[4] for r in resumed.records[0] if r[0] == "compressed"]}

    for name in ("torch", "act"):
        model = fresh(checkpointing=name)
        fit(model, act.ACTFSDPStrategy(act.ACTConfig(**Q4)), max_steps=1)
        out["checkpoint_" + name] = {"records": model.records[0], "losses": model.losses}

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    leaf = distribute_tensor(torch.randn(8, 8), init_device_mesh("cpu", (2,)), [Shard(0)]).requires_grad_()
    compressor = act.ActivationCompressor(None, act.ACTConfig(bits=4, adaptive=False, min_numel=1))
    with compressor.compress():
        doubled = leaf * 2
        loss = (leaf * doubled).sum()
    loss.backward()
    out["dtensor"] = {"records": [[r.kind, r.reason] for r in compressor.stats().records],
                      "grad_exact": bool(torch.equal(leaf.grad.full_tensor(), 4 * leaf.full_tensor()))}

    from torch.distributed.fsdp import fully_shard

    class Failing(nn.Linear):  # reads the open window, then raises
        def forward(self, x):
            step = compressor.current_step
            self.seen = self.weight.untyped_storage().data_ptr() in step.param_storages
            raise RuntimeError("forward failed")

    failing = Failing(8, 8)
    fully_shard(failing)
    compressor = act.ActivationCompressor(failing, act.ACTConfig(bits=4, adaptive=False))
    with compressor.compress():
        before = set(compressor.current_step.param_storages)
        try:
            failing(torch.randn(2, 8))
        except RuntimeError:
            pass
        out["window"] = {"open_in_forward": failing.seen,
                         "closed_after_raise": compressor.current_step.param_storages == before}

    if len(sys.argv) > 2:  # the HF recipe end to end in these two processes (the model folder is argv[2])
        import hf_text_classification
        import transformers

        baseline, compressed = hf_text_classification.main(
            ["--strategy", "act_fsdp", "--devices", "2", "--train-samples", "16", "--eval-samples", "16",
             "--max-length", "16", "--max-steps", "1", "--batch-size", "4", "--gradient-checkpointing",
             "--report-to", "none", "--logdir", os.path.join(OUT, "hf")])
        config = transformers.AutoConfig.from_pretrained(sys.argv[2])
        h, i = config.hidden_size, config.intermediate_size
        out["recipe"] = {"accuracies": [baseline.accuracy, compressed.accuracy], "ratio": compressed.stats.ratio,
                         "records": [[r.kind, list(r.shape), r.codec, r.phase] for r in compressed.stats.records],
                         "weight_shapes": [[h, h], [i, h], [h, i]]}

    with open(os.path.join(OUT, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    end_rank()
''')


def _minilm() -> list[str]:
    """The offline MiniLM's folder (installed with --no-deps), or nothing: the recipe run is then left out."""
    from lightning_act import datasets

    try:
        datasets.rotten_tomatoes(0)
        return [datasets.minilm_model_dir()]
    except ImportError:
        return []


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Both ranks' results of one two-process run (about 60 s on 2 busy cores, the HF recipe included)."""
    folder = tmp_path_factory.mktemp("fsdp")
    script = folder / "fsdp_worker.py"
    script.write_text(WORKER)
    # Lightning's second rank re-runs the script with the same imports; the recipes folder is on pytest's path
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "recipes")]), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(script), str(folder), *_minilm()], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_registered_and_built_on_model_parallel():
    assert "act_fsdp" in L.pytorch.strategies.StrategyRegistry.available_strategies()
    trainer = L.Trainer(strategy="act_fsdp", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, act.ACTFSDPStrategy)
    assert isinstance(trainer.strategy, L.pytorch.strategies.ModelParallelStrategy)
    assert trainer.strategy.act_config.opt_level == "L1"


def test_shard_blocks_refuses_parameters_held_by_the_module_itself():
    from torch import nn

    from lightning_act.fsdp import shard_blocks

    module = nn.Module()
    module.scale = nn.Parameter(torch.ones(1))
    with pytest.raises(ValueError, match=r"holds parameters \['scale'\] itself; allowed"):
        shard_blocks(module)


def test_l0_losses_and_gradients_equal_uncompressed_fsdp(ranks):
    for r in ranks:
        assert r["l0"]["strategy"] == "ACTFSDPStrategy"
        assert len(r["l0"]["losses"]) == 2 and r["l0"]["losses"] == r["l0"]["plain_losses"]
        assert r["l0"]["grads_equal"] is True
        assert "compressed" not in r["l0"]["kinds"] and "parameter" in r["l0"]["kinds"]


def test_bf16_autocast_losses_and_gradients_equal_uncompressed_fsdp(ranks):
    for r in ranks:
        assert r["l0_bf16"] == {"losses_equal": True, "grads_equal": True}


def test_4_bits_compresses_activations_only(ranks):
    for r in ranks:
        records = r["q4"]["records"]
        weights = {tuple(s) for s in r["q4"]["weight_shapes"]} | {tuple(s[::-1]) for s in r["q4"]["weight_shapes"]}
        compressed = [tuple(rec[1]) for rec in records if rec[0] == "compressed"]
        assert len(compressed) >= 20 and not weights & set(compressed)  # every compressed record is an activation
        # the three chunks of each block's fused qkv weight (24 x 24 views) and the Linear weights pass through
        parameters = [tuple(rec[1]) for rec in records if rec[0] == "parameter"]
        assert parameters.count((24, 24)) == 2 * 4 and parameters.count((24, 96)) == 2


def test_compression_ratio_equals_the_single_process_run(ranks):
    single = ranks[0]["single"]
    for r in ranks:
        assert [rec[:4] for rec in r["q4"]["records"]] == [rec[:4] for rec in single["records"]]
        assert r["q4"]["ratio"] == pytest.approx(single["ratio"], rel=1e-12) and single["ratio"] > 5


def test_auto_precision_same_on_every_rank_and_restored_from_sharded_checkpoint(ranks):
    states = [r["adaptive"]["state"] for r in ranks]
    assert states[0] == states[1] and states[0]["rounds"] == 1
    assert len(set(states[0]["bits"])) > 1  # a real allocation, not the fallback
    for r in ranks:
        assert r["adaptive"]["sharded"] is True  # a folder of shards
        assert r["adaptive"]["restored"] == states[0]
        assert r["adaptive"]["resumed_bits"] == r["adaptive"]["last_bits"]  # the resumed step used the allocation


@pytest.mark.parametrize("name", ["torch", "act"])
def test_checkpointing_composes(ranks, name):
    for r in ranks:
        result = r[f"checkpoint_{name}"]
        assert result["losses"] == r["q4"]["losses"]  # the forward is exact
        compressed = [tuple(rec[1]) for rec in result["records"] if rec[0] == "compressed"]
        weights = {tuple(s) for s in r["q4"]["weight_shapes"]} | {tuple(s[::-1]) for s in r["q4"]["weight_shapes"]}
        assert compressed and not weights & set(compressed)
        recomputed = [rec for rec in result["records"] if rec[3] == "recompute"]
        if name == "act":  # CB1: segment inputs, and what the recomputation saves, compressed
            assert sum(rec[0] == "compressed" for rec in recomputed) >= 20
            assert sum(rec[0] == "parameter" for rec in recomputed) >= 2 * 6
        else:  # torch's checkpoint keeps its own hooks innermost: the compressor sees no recomputation
            assert recomputed == []


def test_dtensor_saved_for_backward_is_kept_exactly(ranks):
    for r in ranks:
        assert r["dtensor"]["records"] == [["kept", "DTensor on cpu"], ["parameter", ""]]  # doubled, then leaf
        assert r["dtensor"]["grad_exact"] is True


def test_hf_recipe_with_act_fsdp_end_to_end(ranks):
    if "recipe" not in ranks[0]:
        pytest.skip("the offline MiniLM or Rotten Tomatoes package is not installed")
    for r in ranks:
        recipe = r["recipe"]
        assert all(0.0 <= a <= 1.0 for a in recipe["accuracies"]) and recipe["ratio"] > 4
        weights = {tuple(s) for s in recipe["weight_shapes"]}
        compressed = [tuple(rec[1]) for rec in recipe["records"] if rec[0] == "compressed"]
        assert compressed and not weights & set(compressed)
        # --gradient-checkpointing: the encoder layers went through the compressed checkpoint (CB1)
        assert any(rec[3] == "recompute" and rec[0] == "compressed" for rec in recipe["records"])
        assert any(rec[3] == "recompute" and rec[0] == "parameter" for rec in recipe["records"])


def test_all_gathered_weights_are_parameters_during_forward_only(ranks):
    for r in ranks:
        assert r["window"] == {"open_in_forward": True, "closed_after_raise": True}
