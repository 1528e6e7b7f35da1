"""Accelerate: the context API and ``compress_forward`` with bf16 mixed precision, gradient accumulation and two
CPU processes. ``accelerate launch --cpu --num_processes 2`` starts one process (its multi-CPU path needs MPI):
torchrun starts two, and ``Accelerator(cpu=True)`` picks up its environment (gloo DDP)."""
import contextlib
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import lightning_act as act
from lightning_act.engine import active_compressor

accelerate = pytest.importorskip("accelerate")
from accelerate.state import AcceleratorState  # noqa: E402

from lightning_act.integrations import compress_forward, compressed_module, unpatch  # noqa: E402
from tests.accelerate_models import mlp, random_batches  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    # each test builds its own Accelerator; a transformers Trainer elsewhere in the session may have left one
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def _params(model):
    return torch.cat([p.detach().flatten().clone() for p in model.parameters()])


def test_context_api_bf16_with_gradient_accumulation():
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=2)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    compressor = act.ActivationCompressor(accelerator.unwrap_model(model), act.ACTConfig(bits=4))
    before, steps_taken = _params(model), 0
    for x, y in random_batches():
        with accelerator.accumulate(model):
            with compressor.compress():
                loss = nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss)
            steps_taken += accelerator.sync_gradients
            optimizer.step()
            optimizer.zero_grad()
    assert steps_taken == 2 and compressor.step_number == 4
    assert not torch.equal(before, _params(model))
    stats = compressor.stats()
    compressed = [r for r in stats.records if r.kind == "compressed"]
    assert stats.ratio > 2 and {r.dtype for r in compressed} == {torch.bfloat16}  # autocast's activations


def test_compress_forward_gradients_close_and_unpatch_restores():
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
    model = accelerator.prepare(mlp())
    autocast_forward = model.__dict__["forward"]  # Accelerate's own patch
    x, y = random_batches(1)[0]

    def grad():
        model.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    exact = grad()
    compressor = compress_forward(model, act.ACTConfig(bits=8))
    approx = grad()
    assert compressor.step_number == 1 and compressor.stats().ratio > 1.5
    assert torch.nn.functional.cosine_similarity(exact.float(), approx.float(), dim=0).item() > 0.999
    with torch.no_grad():
        model(x)
    model.eval()
    model(x)
    assert compressor.step_number == 1  # evaluation forwards are not compressed
    assert unpatch(model) is compressor
    assert model.__dict__["forward"] is autocast_forward


def test_patched_forward_leaves_no_active_context_when_it_raises():
    model = mlp()
    compressor = compress_forward(model)
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied"):
        model(torch.randn(2, 5))
    assert active_compressor() is None
    model(torch.randn(2, 32)).sum().backward()
    assert compressor.step_number == 2
    unpatch(model)
    assert "forward" not in model.__dict__


def test_patch_errors():
    model = mlp()
    with pytest.raises(ValueError, match="Sequential is not patched by compress_forward; nothing to unpatch"):
        unpatch(model)
    compress_forward(model)
    with pytest.raises(ValueError, match="Sequential is already patched by compress_forward; call unpatch"):
        compress_forward(model)
    unpatch(model)


@pytest.mark.parametrize("api", ["context", "patch"])
def test_a_model_compiled_from_outside_is_compressed_inside_its_graphs(api):
    """``Accelerator(dynamo_backend=...)`` compiles the prepared model, DDP wrapper and all, from outside: the
    compressor is built on the compile wrapper (so its graphs compress what they save) and the wrapper inside it
    stays in place (``DataParallel`` standing in for DDP on one CPU process)."""
    accelerator = accelerate.Accelerator(cpu=True, dynamo_backend="inductor")
    model = accelerator.prepare(nn.DataParallel(mlp()))
    parallel = model._orig_mod
    assert isinstance(parallel, nn.DataParallel)
    config = act.ACTConfig(bits=4, adaptive=False, min_numel=1)
    compressor = (compress_forward(model, config) if api == "patch"
                  else act.ActivationCompressor(compressed_module(model), config))
    assert compressor.model is model and compressor.graph_hooks is not None and model._orig_mod is parallel
    x, y = random_batches(1)[0]
    with compressor.compress() if api == "context" else contextlib.nullcontext():
        loss = nn.functional.cross_entropy(model(x), y)
    accelerator.backward(loss)
    # the hidden activations, saved inside the compiled graph (the loss outside it runs the eager hooks)
    hidden = [r for r in compressor.stats().records if r.shape.numel() == 16 * 512]
    assert len(hidden) >= 2 and {(r.phase, r.codec, r.bits) for r in hidden} == {("compiled", "quantize", 4.0)}
    if api == "patch":
        unpatch(model)
    torch._dynamo.reset()


_TWO_PROCESS_SCRIPT = """
import json, torch
from torch import nn
import accelerate, lightning_act as act
from lightning_act.integrations import compress_forward, unpatch
from tests.accelerate_models import mlp, random_batches
from tests.distributed import end_rank

accelerator = accelerate.Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=2)
model = mlp()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
compressor = compress_forward(model, act.ACTConfig(bits=4))
ratios = []
for x, y in random_batches()[accelerator.process_index::2]:
    with accelerator.accumulate(model):
        accelerator.backward(nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    ratios.append(compressor.stats().ratio)
unpatch(model)
out = {{"world": accelerator.num_processes, "wrapped": type(model).__name__, "ratios": ratios,
        "param_sum": float(sum(p.detach().double().sum() for p in model.parameters()))}}
with open({out!r} + f"/rank{{accelerator.process_index}}.json", "w") as f:
    json.dump(out, f)
end_rank()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_cpu_processes_with_torchrun(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(_TWO_PROCESS_SCRIPT.format(out=str(tmp_path))))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", str(_free_port()), str(script)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}  # the ranks import tests.accelerate_models
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        assert r["world"] == 2 and r["wrapped"] == "DistributedDataParallel"
        assert len(r["ratios"]) == 2 and all(x > 2 for x in r["ratios"])
    assert ranks[0]["param_sum"] == pytest.approx(ranks[1]["param_sum"], rel=1e-9)  # gradients all-reduced


def test_integrations_import_is_lazy_and_names_the_install_command(monkeypatch):
    # `import lightning` may itself load transformers and accelerate (its torchmetrics imports transformers, whose
    # generation code imports accelerate when installed, e.g. transformers 5.17): measured against what lightning
    # loads, lightning_act loads none of the optional libraries, and the integrations package only itself
    code = textwrap.dedent("""
        import sys, lightning
        def new(before): return sorted(set(sys.modules) - before)
        before = set(sys.modules); import lightning_act
        print(sorted({m.split('.')[0] for m in new(before)} & {'accelerate', 'transformers', 'torch_geometric'}))
        before = set(sys.modules); import lightning_act.integrations
        print(new(before))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[:2] == ["[]", "['lightning_act.integrations']"], proc.stdout

    import importlib.util

    import lightning_act.integrations as integrations

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch_geometric" else real_find_spec(name, *a))
    with pytest.raises(ImportError, match=r"needs torch_geometric; install it with: pip install 'lightning-act\[gnn\]'"):
        integrations.require("pyg")
    with pytest.raises(AttributeError, match="has no attribute 'Nope'; available: ACTTrainer"):
        integrations.Nope


def test_compress_forward_says_a_memory_budget_needs_the_planner():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    with pytest.warns(UserWarning, match=r"memory_budget=1048576 needs a planning step.*MemoryBudget\(compressor"):
        compressor = compress_forward(model, act.ACTConfig(memory_budget="1MiB"))
    assert compressor.config.memory_budget == 1 << 20
    unpatch(model)
