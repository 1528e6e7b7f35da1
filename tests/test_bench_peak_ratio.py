"""benchmarks/bench_peak_ratio.py end to end on tiny models, and profiling.peak_breakdown on steps whose peak is
known."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import lightning_act as act
from lightning_act.profiling import annotate_codecs, measure_step_memory, peak_breakdown

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20


def test_bench_peak_ratio_tiny_reports_every_row_with_its_breakdown(tmp_path):
    out = tmp_path / "peak_ratio.md"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_peak_ratio.py"), "--tiny",
                             "--out", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = out.read_text()
    assert "Command: `python benchmarks/bench_peak_ratio.py --tiny" in report and "torch 2." in report
    for model in ("default (sdpa)", "eager", "act_chunked", "ResNet-8 (w8) 4x32²", "channels_last"):
        assert model in report
    rows = [line for line in report.splitlines() if line.startswith("| ") and "| 4-bit |" in line]
    assert len(rows) == 2 * 5  # one in the ratio table, one in the breakdown, per model
    assert report.count("| torch checkpoint |") == 2 * 5
    ratio_rows = [r for r in rows if "%" in r]
    assert len(ratio_rows) == 5 and all("failed" not in r for r in rows)


def test_bench_peak_ratio_tiny_bounded_rows_compare_with_the_unconverted_baseline(tmp_path):
    out = tmp_path / "bounded.md"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_peak_ratio.py"), "--tiny", "--models",
                             "resnet50-cl", "resnet50-cl-bounded", "--no-breakdown", "--out", str(out)],
                            capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {tuple(cells[:2]): cells for cells in (line.strip("| ").split(" | ") for line in out.read_text().splitlines()
                                                  if line.startswith("| ResNet-8"))}
    plain = "ResNet-8 (w8) 4x32², channels_last"
    bounded = rows[(plain + ", bounded", "4-bit")]
    peak = float(bounded[5])
    # peak ÷ against its own baseline and against the unconverted one (table figures rounded to 0.1 MiB)
    assert float(bounded[6]) == pytest.approx(float(rows[(plain + ", bounded", "baseline")][5]) / peak, rel=0.1)
    assert float(bounded[8]) == pytest.approx(float(rows[(plain, "baseline")][5]) / peak, rel=0.1)
    assert rows[(plain, "4-bit")][8] == "-"


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 512))


def test_peak_breakdown_splits_forward_gradients_and_backward():
    model, x = _mlp(), torch.randn(1024, 512)

    def step():
        model(x).square().sum().backward()

    step()
    model.zero_grad(set_to_none=True)
    expected = measure_step_memory(step).peak_bytes
    model.zero_grad(set_to_none=True)
    b = peak_breakdown(step, list(model.parameters()))
    assert b.peak_bytes == expected
    assert sum(block.nbytes for block in b.live) - b.older_freed_bytes >= b.peak_bytes - MiB
    kinds = b.bytes_by()
    assert kinds.get("forward", 0) >= 8 * MiB  # the ReLU output (8 MiB) saved for backward
    assert kinds.get("backward", 0) >= 8 * MiB  # a hidden-sized gradient
    assert b.at_node  # the peak is reached in backward
    forward_only = peak_breakdown(step, list(model.parameters()), phase="forward")
    assert forward_only.at_node == "" and forward_only.peak_bytes <= b.peak_bytes


def test_annotated_codecs_name_the_decoded_tensor_in_backward():
    model, x = _mlp(), torch.randn(1024, 512)
    compressor = act.ActivationCompressor(model, act.ACTConfig(bits=4, adaptive=False))

    def step():
        with compressor.compress():
            loss = model(x).square().sum()
        loss.backward()

    step()
    model.zero_grad(set_to_none=True)
    with annotate_codecs():
        b = peak_breakdown(step, list(model.parameters()), phase="backward")
    # the peak: ReLU's backward, with the decoded 1-bit mask (8 MiB as float), its output and the gradient of
    # the hidden layer alive, and the compressed forms still held from the forward
    assert b.at_node == "ReluBackward0"
    sources = b.bytes_by("source")
    assert sources["act::decode positive_mask"] == 8 * MiB
    assert sources["act::encode quantize"] > 0 and sources["act::encode positive_mask"] == 256 * 1024
    assert act.codecs.get("quantize").encode.__name__ == "encode"  # the annotation is taken off again
