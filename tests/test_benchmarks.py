"""benchmarks/run_all.py end to end at --quick sizes: every section measured, reported and plotted. The numbers
of a quick run are too small to compare configurations (tiny steps stay inside already-mapped memory), so the
checks are on what each measurement must satisfy, not on which configuration wins."""
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    pytest.importorskip("sklearn")
    out = tmp_path_factory.mktemp("bench")
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run_all.py"), "--quick", "--out", str(out)],
                            capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return out, json.loads((out / "report.json").read_text()), (out / "report.md").read_text()


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_report_has_every_section_with_command_and_machine(quick_run):
    _, _, report = quick_run
    for title in ("## Peak memory and step time", "## Largest batch", "## Codec throughput", "## Accuracy parity"):
        assert title in report
    assert "Command: `python benchmarks/run_all.py --quick`" in report and "torch 2." in report


def test_memory_rows_compress_and_time_every_configuration(quick_run):
    _, results, _ = quick_run
    rows = results["memory"]
    assert {r["model"] for r in rows} == {"CNN", "BERT", "GCN"}
    for r in rows:
        assert _positive(r["step_ms"]) and _positive(r["time_ratio"]) and math.isfinite(r["peak_mib"])
        if r["config"] == "baseline":
            assert r["stored_mib"] is None and r["time_ratio"] == 1.0
        else:
            assert r["stored_mib"] < r["saved_mib"] and r["ratio"] > 1
    two_bit = {r["model"]: r["ratio"] for r in rows if r["config"] == "quantize 2-bit"}
    four_bit = {r["model"]: r["ratio"] for r in rows if r["config"] == "quantize 4-bit"}
    assert all(two_bit[m] > four_bit[m] for m in two_bit)


def test_max_batch_search_finds_the_limit_it_reports(quick_run):
    _, results, _ = quick_run
    for r in results["batch"]:
        peaks = {int(b): p for b, p in r["peaks_mib"].items()}
        assert r["batch"] >= 1 and peaks[r["batch"]] <= r["budget_mib"]
        if not r["capped"]:  # a larger batch was measured over the budget, within the bisection's tolerance
            over = [b for b, p in peaks.items() if b > r["batch"] and p > r["budget_mib"]]
            assert over and min(over) <= r["batch"] + max(1, r["batch"] // 16) + 1
        assert _positive(r["batch_ratio"])


def test_throughput_rows_are_rates_next_to_clone(quick_run):
    _, results, _ = quick_run
    rows = results["throughput"]
    assert {r["codec"] for r in rows} >= {"quantize 1-bit", "quantize 8-bit", "division", "lorenzo eb=1e-2"}
    for r in rows:
        for key in ("encode_gbps", "decode_gbps", "clone_gbps", "encode_vs_clone", "decode_vs_clone", "ratio"):
            assert _positive(r[key]), (r["codec"], key)
        assert r["encode_vs_clone"] == pytest.approx(r["encode_gbps"] / r["clone_gbps"])
    ratio = {r["codec"]: r["ratio"] for r in rows}
    assert 7 < ratio["quantize 4-bit"] < 8 and ratio["quantize 1-bit"] > ratio["quantize 2-bit"] > ratio["quantize 4-bit"]


def test_accuracy_rows_cover_the_four_configurations(quick_run):
    _, results, _ = quick_run
    rows = results["accuracy"]
    assert [r["config"] for r in rows] == ["baseline", "L1 (auto-precision)", "division", "lorenzo (adaptive eb)"]
    for r in rows:
        assert all(0 <= a <= 1 for a in r["accuracies"]) and r["mean"] == pytest.approx(sum(r["accuracies"]) / len(r["accuracies"]))
    assert rows[0]["mean"] > 0.8 and rows[0]["ratio"] == 1.0  # digits trains in one epoch
    assert all(r["ratio"] > 4 for r in rows[1:])


def test_plots_are_written(quick_run):
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("needs matplotlib (pip install 'lightning-act[bench]')")
    out, _, _ = quick_run
    for name in ("peak_memory.png", "max_batch.png", "throughput.png", "accuracy.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
