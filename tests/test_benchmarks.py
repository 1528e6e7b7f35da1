"""benchmarks/run_all.py end to end at --quick sizes (every section measured, reported and plotted), and the
max-batch search on a synthetic peak curve."""
import importlib.util
import functools
import gc
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.cuda_emulation.emulator import NVCC, requires_gxx

ROOT = Path(__file__).resolve().parents[1]


def _errors(stderr: str) -> str:
    """A benchmark's stderr for an assertion message, without the profiler's per-step USDT lines (which filled the
    message where a traceback should have been)."""
    return "\n".join(line for line in stderr.splitlines() if not line.startswith("USDT:"))[-3000:]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    pytest.importorskip("sklearn")
    pytest.importorskip("torch_geometric")
    if importlib.util.find_spec("graspologic") is None:  # only its data files are read (drosophila connectome)
        pytest.skip("needs the graspologic package files: pip install --no-deps graspologic")
    out = tmp_path_factory.mktemp("bench")
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run_all.py"), "--quick", "--out", str(out)],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, _errors(result.stderr)
    return out, json.loads((out / "report.json").read_text()), (out / "report.md").read_text()


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def test_report_has_every_section_with_command_and_machine(quick_run):
    out, results, report = quick_run
    for title in ("## Summary", "## Peak memory and step time", "## Largest batch", "## Codec throughput",
                  "## Accuracy parity", "Machine load while this ran"):
        assert title in report
    assert f"Command: `python benchmarks/run_all.py --quick --out {out}`" in report
    assert "torch 2." in report and "CPUs" in report
    load = results["load"]
    assert _positive(load["wall_s"]) and load["other_cpu_s"] >= 0 and load["cpus"] >= 1


def test_memory_rows_compress_and_the_two_bit_resnet_peaks_lower(quick_run):
    _, results, _ = quick_run
    rows = results["memory"]
    assert {r["model"] for r in rows} == {"ResNet-50", "BERT", "GCN"}
    assert {r["model"] for r in rows if r["config"] == "torch checkpoint"} == {"ResNet-50", "BERT", "GCN"}
    for r in rows:
        assert _positive(r["step_ms"]) and _positive(r["time_ratio"])
        assert math.isfinite(r["peak_mib"])
        if r["config"] == "baseline":
            assert r["stored_mib"] == r["saved_mib"] and r["time_ratio"] == 1.0 and r["ratio"] == 1.0
        elif r["config"] == "torch checkpoint":  # the peer stores nothing compressed: no ratio to report
            assert r["stored_mib"] is None and r["ratio"] is None
        else:
            assert r["stored_mib"] < r["saved_mib"] and r["ratio"] > 1
    peak = {r["config"]: r["peak_mib"] for r in rows if r["model"] == "ResNet-50"}
    assert 0 < peak["quantize 2-bit"] < peak["baseline"]
    assert 0 < peak["torch checkpoint"] < peak["baseline"]


def test_max_batch_search_finds_the_limit_and_compression_fits_more(quick_run):
    _, results, _ = quick_run
    rows = results["batch"]
    for r in rows:
        peaks = {int(b): p for b, p in r["peaks_mib"].items()}
        assert r["batch"] >= 1 and peaks[r["batch"]] <= r["budget_mib"] and _positive(r["batch_ratio"])
        if not r["capped"]:  # a larger batch was measured over the budget, within the search's tolerance
            over = [b for b, p in peaks.items() if b > r["batch"] and p > r["budget_mib"]]
            assert over and min(over) - r["batch"] <= max(1, math.ceil(r["tolerance"] * r["batch"]))
    batch = {r["config"]: r["batch"] for r in rows if r["model"] == "ResNet-50"}
    assert batch["quantize 2-bit"] >= batch["baseline"]


def test_throughput_rows_are_rates_next_to_clone(quick_run):
    _, results, _ = quick_run
    rows = results["throughput"]
    assert {r["codec"] for r in rows} >= {"quantize 1-bit", "quantize 8-bit", "division", "lorenzo eb=1e-2"}
    for r in rows:
        for key in ("encode_gbps", "decode_gbps", "clone_gbps", "encode_vs_clone", "decode_vs_clone", "ratio"):
            assert _positive(r[key]), (r["codec"], key)
        assert r["encode_vs_clone"] == pytest.approx(r["encode_gbps"] / r["clone_gbps"])
    ratio = {r["codec"]: r["ratio"] for r in rows}
    assert 7 < ratio["quantize 4-bit"] < 8
    assert ratio["quantize 1-bit"] > ratio["quantize 2-bit"] > ratio["quantize 4-bit"]


def test_accuracy_rows_cover_the_four_configurations_per_task(quick_run):
    _, results, _ = quick_run
    rows = results["accuracy"]
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    assert len(tasks) == 2 and tasks[0].startswith("digits CNN") and tasks[1].startswith("GCN on drosophila")
    for task in tasks:
        task_rows = [r for r in rows if r["task"] == task]
        assert [r["config"] for r in task_rows] == ["baseline", "L1 (auto-precision)", "division",
                                                    "lorenzo (adaptive eb)"]
        for r in task_rows:
            assert all(0 <= a <= 1 for a in r["accuracies"]) and r["std"] >= 0
            assert r["mean"] == pytest.approx(sum(r["accuracies"]) / len(r["accuracies"]))
        assert task_rows[0]["ratio"] == 1.0 and all(r["ratio"] > 1 for r in task_rows[1:])
    digits_baseline = next(r for r in rows if r["task"] == tasks[0] and r["config"] == "baseline")
    assert digits_baseline["mean"] > 0.3  # six steps already beat chance (0.1) by far


def test_summary_table_has_a_row_per_compressed_configuration(quick_run):
    _, results, report = quick_run
    summary = report.split("## Summary")[1].split("##")[0]
    for config in {r["config"] for r in results["memory"]} - {"baseline"}:
        assert f"| {config} |" in summary


def test_plots_are_written(quick_run):
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("needs matplotlib (pip install 'lightning-act[bench]')")
    out, _, _ = quick_run
    for name in ("peak_memory.png", "max_batch.png", "throughput.png", "accuracy.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("limit", [1, 37, 100, 999, 5000])
def test_max_batch_search_on_a_linear_peak_curve(monkeypatch, limit):
    import bench_max_batch

    budget, per_sample, fixed = 1000.0, 1000.0 / (limit + 0.5), 0.0  # batch `limit` fits, `limit + 1` does not
    measured = []

    def fake_peak(build, config, batch):
        measured.append(batch)
        return fixed + per_sample * batch

    monkeypatch.setattr(bench_max_batch, "trial_peak", fake_peak)
    found = bench_max_batch.largest_batch(None, None, budget, max_batch=4096, tolerance=0.0)
    assert found["batch"] == min(limit, 4096) and found["capped"] == (limit >= 4096)
    assert len(measured) <= 12  # the secant lands next to the limit; never a bisection of 4096


def test_bench_gnn_sparse_quick_measures_every_configuration(tmp_path):
    pytest.importorskip("torch_geometric")
    out = tmp_path / "gnn_sparse.md"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_gnn_sparse.py"), "--quick", "--out",
                             str(out)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, _errors(result.stderr)
    peaks = {}
    for line in out.read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 7 and cells[0] == "2":  # layers, config, peak MiB, peak ÷, ÷ fused, saved / stored, step s
            peaks[cells[1]] = float(cells[2])
            assert float(cells[6]) > 0
    assert set(peaks) == {"edge_index, uncompressed", "sparse, uncompressed", "sparse, 4-bit", "sparse, 2-bit",
                          "sparse, L1 (auto-precision)", "sparse, checkpoint per layer", "fused sparse, uncompressed",
                          "fused sparse, 4-bit", "fused sparse, 2-bit", "fused convs only, 4-bit"}
    assert peaks["edge_index, uncompressed"] > peaks["sparse, uncompressed"] > 0
    assert peaks["fused sparse, 4-bit"] < peaks["sparse, 4-bit"]
    assert "| sparse | 4-bit |" in out.read_text() and "| sparse, fused | 4-bit |" in out.read_text()


def test_bench_gnn_layers_quick_shows_what_the_gradient_rules_prevent():
    """bench_gnn_layers.py --quick in-process: with the exact-value rules every gradient is finite and close; a
    max aggregation without them trains on NaN; the registry is whole again afterwards."""
    pytest.importorskip("torch_geometric")
    import bench_gnn_layers

    from lightning_act.codecs import op_rules

    rules, replacements = dict(op_rules.OP_RULES), dict(op_rules.OP_REPLACEMENTS)
    rows = bench_gnn_layers.main(["--quick"])
    by = {(r["layer"], r["config"], r["rules"]): r for r in rows}
    assert len(by) == 8 and all(r["finite"] and r["cosine"] > 0.95 for r in rows if r["rules"] == "with")
    assert not by[("SAGEConv max", "L1", "without")]["finite"]
    assert by[("SAGEConv max", "L1", "with")]["cosine"] > 0.99 and by[("SAGEConv max", "L1", "with")]["ratio"] > 1
    assert op_rules.OP_RULES == rules and op_rules.OP_REPLACEMENTS == replacements
    assert torch.amax in op_rules.GRADIENT_RULE_FUNCTIONS
    assert "| SAGEConv max | L1 | without | **no** | nan |" in bench_gnn_layers.table(rows, "x")


def test_host_overhead_quick_mode_measures_the_cuda_path_with_no_op_kernels():
    """bench_host_overhead.py --quick in-process: the figures exist and the CUDA path ran (kernel launches); no
    speed is asserted here (the targets live in the benchmark and its results file)."""
    pytest.importorskip("transformers")
    import bench_host_overhead

    rows = bench_host_overhead.run(quick=True)
    configs = list(bench_host_overhead.CONFIGS)[:2]
    assert [(r["model"], r["config"]) for r in rows] == [(m, c) for m in bench_host_overhead.MODELS for c in configs]
    assert bench_host_overhead.MODELS == ("BERT-base", "narrow", "ResNet-50")
    for r in rows:
        assert r["saved"] > r["compressed"] > 0 and r["launches_per_step"] > 0
        assert all(math.isfinite(r[k]) for k in ("step_us_per_saved", "hook_us_per_saved", "plain_ms"))
        assert r["hook_us_per_saved"] > 0
    table = bench_host_overhead.comparison_table([rows], [rows])
    first = rows[0]
    assert (f"| {first['model']} | {first['config']} | {first['step_us_per_saved']:.1f} -> "
            f"{first['step_us_per_saved']:.1f} |") in table
    # the one-line summary that ends the report: each model's hooks-only figure for the first configuration
    expected = ", ".join(f"{r['model']} {r['hook_us_per_saved']:.1f}" for r in rows if r["config"] == configs[0])
    assert bench_host_overhead.headline(rows) == (f"Hooks only, host µs per saved tensor ({configs[0]}): {expected} "
                                                  "(issue #20: at most 30, goal 15)")


def test_bench_host_overhead_measures_the_op_trackers_own_cost_per_model():
    """--tracking: forwards without and with a FunctionTracker, per model; the table compares two checkouts."""
    pytest.importorskip("transformers")
    import bench_host_overhead

    rows = bench_host_overhead.run(quick=True, tracking=True)
    assert [r["model"] for r in rows] == list(bench_host_overhead.MODELS)
    assert all(r["untracked_ms"] > 0 and math.isfinite(r["tracking_ms"]) for r in rows)
    table = bench_host_overhead.tracking_table([rows], [rows])
    first = rows[0]
    assert (f"| {first['model']} | {first['untracked_ms']:.1f} | {first['tracking_ms']:.2f} -> "
            f"{first['tracking_ms']:.2f} |") in table
    assert f"| {first['tracking_ms']:.2f} |" in bench_host_overhead.tracking_table(None, [rows])


def test_bench_host_overhead_measures_a_compiled_model_through_the_kernel_ops():
    """--compiled: the narrow model compiled, compressed inside its graphs; one encode launch per quantized
    tensor and none for the masks (packed by traced ops) or any decode (traced ops the backward inlines), the
    host time per compressed tensor measured."""
    import bench_host_overhead

    row = bench_host_overhead.measure_compiled(layers=1, repeats=2)
    masks = row["compressed"] - row["quantized"]
    assert row["quantized"] >= 4 and masks >= 1
    assert row["launches_per_step"] == row["quantized"]
    assert row["compile_s"] > 0 and row["plain_ms"] > 0 and math.isfinite(row["step_us_per_compressed"])
    assert f"| narrow | {row['config']} | {row['compressed']} |" in bench_host_overhead.compiled_table([row])


def test_bench_gpu_tiny_runs_every_configuration_and_exits_2_without_cuda(tmp_path):
    """bench_gpu.py --tiny: the GPU benchmark's code path on CPU with tiny models, every model and configuration;
    without CUDA and without --tiny it measures nothing and exits 2."""
    pytest.importorskip("transformers")
    pytest.importorskip("torch_geometric")
    import bench_gpu
    import torch

    if not torch.cuda.is_available():
        assert bench_gpu.main([]) == bench_gpu.NO_CUDA_EXIT == 2
    out = tmp_path / "gpu.md"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py"), "--tiny", "--repeats", "2",
                             "--warmup", "1", "--out", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, _errors(result.stderr)
    table, rows = out.read_text(), json.loads(out.with_suffix(".json").read_text())["rows"]
    assert table.startswith("# GPU training steps: CPU (--tiny)") and "| model | batch | config | ratio |" in table
    assert table.count("\n| ") == len(rows) + 1  # the header and one line per row
    by_model = {}
    for r in rows:
        assert "error" not in r, r
        by_model.setdefault(r["model"], {})[r["config"]] = r
    assert len(by_model) == 4
    for model, configs in by_model.items():
        expected = set(bench_gpu.DEFAULT_CONFIGS) - (set() if model.startswith("BERT") else {"CB2"})
        assert set(configs) == expected, model
        base = configs["baseline"]
        assert base["ratio"] == base["peak_reduction"] == base["time_ratio"] == 1.0
        assert base["stored_mib"] > 0 and base["max_batch"] > base["size"] and base["max_batch_ratio"] == 1.0
        for name, r in configs.items():
            assert _positive(r["peak_mib"]) and _positive(r["step_ms"]) and _positive(r["time_ratio"])
            assert _positive(r["peak_reduction"]) and _positive(r["max_batch"]), (model, name)
            if bench_gpu.METHODS[name].config is not None or bench_gpu.METHODS[name].budget:
                assert r["ratio"] > 1 and r["stored_mib"] < base["stored_mib"], (model, name)
            elif name != "baseline":
                assert r.get("ratio") is None  # the peers store nothing compressed
        assert configs["2-bit"]["ratio"] > configs["4-bit"]["ratio"]
        # where the stored bytes go: groups that add up to no more than the row stores, the largest first
        groups = configs["4-bit"]["stored_by"]
        assert any(g["codec"] == "quantize" and g["bits"] == 4 and g["kind"] == "compressed" for g in groups)
        assert [g["stored_mib"] for g in groups] == sorted((g["stored_mib"] for g in groups), reverse=True)
        assert sum(g["stored_mib"] for g in groups) <= configs["4-bit"]["stored_mib"] + 1e-6
        assert f"- {model}, 4-bit: {groups[0]['count']} " in table
        assert configs["L1"]["allocated"][0] > 0  # the auto-precision allocation applied to saved tensors
        budget = configs["memory budget"]
        assert budget["budget_mib"] == pytest.approx(configs["torch checkpoint"]["peak_mib"])
        if budget["plan_met"]:  # else the planner warned that even its most aggressive plan does not fit
            assert budget["peak_mib"] <= 1.1 * budget["budget_mib"]  # met within 10%


def test_bench_gpu_reports_the_kernel_time_of_profiled_rows():
    """With --profile on CUDA each row has the device's kernel time in a profiled step: one more column; the
    step time's min-max beside its median; a failed row keeps the columns."""
    import argparse

    import bench_gpu

    rows = [{"model": "M", "size": 8, "config": c, "ratio": 1.0, "stored_mib": 10.0, "peak_mib": 12.0,
             "peak_reduction": 1.0, "step_ms": 50.0, "time_ratio": 1.0, "max_batch": None, "kernel_ms": k}
            for c, k in (("baseline", 41.5), ("4-bit", 60.25))]
    env = {"device": "GPU", "torch": "2", "cuda": "13", "cupy": "cupy 14", "codecs": "CuPy kernels"}
    args = argparse.Namespace(repeats=5, warmup=2, memory_budget="checkpoint")
    rows[0]["step_ms_range"] = (48.04, 55.51)  # the fastest and slowest timed step
    failed = {"model": "M", "size": 8, "config": "2-bit", "error": "RuntimeError: out of memory"}
    lines = bench_gpu.report(rows + [failed], [], [], env, "cmd", args).splitlines()
    table = [line for line in lines if line.startswith("| ")]
    assert table[0].endswith("| kernels ms |") and table[1].endswith("| 41.5 |") and table[2].endswith("| 60.2 |")
    assert "| 50.0 | 48.0-55.5 | 1.00 |" in table[1] and "| 50.0 | - | 1.00 |" in table[2]
    assert "failed: RuntimeError: out of memory" in table[3]
    assert all(line.count("|") == table[0].count("|") for line in table)
    rows = [{k: v for k, v in r.items() if k != "kernel_ms"} for r in rows]
    assert "kernels ms" not in bench_gpu.report(rows, [], [], env, "cmd", args)


def test_bench_gpu_finds_where_the_device_waits_in_a_profiled_step():
    """device_gaps: the union of a step's kernels (overlapping ones on two streams counted once) against their span,
    the idle time between, and the longest gaps with the kernels around them; the report lists them per row."""
    import argparse

    import bench_gpu

    kernels = [(0.0, 100.0, "conv"), (50.0, 150.0, "encode"),  # two streams: busy 0-150
               (1150.0, 1200.0, "bn"), (1200.0, 1300.0, "relu"), (1800.0, 2000.0, "decode"), (2010.0, 2020.0, "add")]
    idle = bench_gpu.device_gaps(kernels, top=2)
    assert idle["span_ms"] == 2.02 and math.isclose(idle["busy_ms"], 0.51) and math.isclose(idle["idle_ms"], 1.51)
    assert idle["gaps"] == [(1.0, "encode", "bn"), (0.5, "relu", "decode")]
    assert bench_gpu.device_gaps([(5.0, 9.0, "only")]) == {"busy_ms": 0.004, "span_ms": 0.004, "idle_ms": 0.0,
                                                            "gaps": []}
    row = {"model": "M", "size": 8, "config": "4-bit", "ratio": 4.0, "stored_mib": 1.0, "peak_mib": 2.0,
           "step_ms": 3.0, "kernel_ms": 0.51, "device_idle": idle}
    env = {"device": "GPU", "torch": "2", "cuda": "13", "cupy": "cupy 14", "codecs": "CuPy kernels"}
    text = bench_gpu.report([row], [], [], env, "cmd", argparse.Namespace(repeats=5, warmup=2, memory_budget="x"))
    assert "- M, 4-bit: 1.5 ms idle of 2.0; 1.00 ms after encode before bn; 0.50 ms after relu before decode" in text


def test_bench_gpu_counts_the_host_events_of_timed_steps():
    """HostEvents: the garbage collector's collections inside it, with their time, per step in the report (on
    CUDA the allocator's device calls too); its callback is gone after it, even when the body raises."""
    import argparse

    import bench_gpu

    callbacks = list(gc.callbacks)
    with bench_gpu.HostEvents(torch.device("cpu")) as events:
        gc.collect()
        gc.collect(1)
    assert gc.callbacks == callbacks
    summary = events.summary(steps=2)
    assert summary["steps"] == 2 and summary["gc_collections"] == 2 and 0 < summary["gc_ms"] < 10_000
    assert set(summary) == {"steps", "gc_collections", "gc_ms"}  # no allocator counters off CUDA
    with pytest.raises(RuntimeError, match="step failed"), bench_gpu.HostEvents(torch.device("cpu")):
        raise RuntimeError("step failed")
    assert gc.callbacks == callbacks
    row = {"model": "M", "size": 8, "config": "4-bit", "ratio": 4.0, "stored_mib": 1.0, "peak_mib": 2.0,
           "step_ms": 3.0, "host_events": {"steps": 4, "gc_collections": 2, "gc_ms": 3.0, "num_device_alloc": 8}}
    env = {"device": "GPU", "torch": "2", "cuda": "13", "cupy": "cupy 14", "codecs": "CuPy kernels"}
    text = bench_gpu.report([row], [], [], env, "cmd", argparse.Namespace(repeats=4, warmup=2, memory_budget="x"))
    assert "- M, 4-bit: 0.5 gc_collections, 0.8 gc_ms, 2.0 num_device_alloc" in text


def test_bench_gpu_compiled_configurations_compress_inside_the_graphs(tmp_path):
    """bench_gpu.py's compiled rows (named on the command line: each compiles the model; the peaks are
    tests/test_compiled_regions.py's): the 4-bit ones store compressed activations, in torch.compile's default mode
    and in "reduce-overhead" (CUDA graphs on a GPU; on CPU the same graphs without them)."""
    pytest.importorskip("transformers")
    out = tmp_path / "gpu.md"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py"), "--tiny", "--models",
                             "bert-base", "--configs", "baseline", "compiled, 4-bit",
                             "compiled (reduce-overhead), 4-bit", "compiled, 4-bit traced", "--repeats", "2",
                             "--warmup", "1", "--out", str(out), "--profile", str(tmp_path / "profiles")],
                            capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, _errors(result.stderr)
    rows = {r["config"]: r for r in json.loads(out.with_suffix(".json").read_text())["rows"]}
    assert set(rows) == {"baseline", "compiled, 4-bit", "compiled (reduce-overhead), 4-bit", "compiled, 4-bit traced"}
    assert all("error" not in r for r in rows.values()), rows
    for name in ("compiled, 4-bit", "compiled (reduce-overhead), 4-bit", "compiled, 4-bit traced"):
        assert rows[name]["ratio"] > 3 and rows[name]["stored_mib"] < rows["baseline"]["stored_mib"]
    # --profile: one profiled step per configuration, its ops by their own time (the backward's one count op
    # among them: its decodes are inlined ops)
    profiles = {p.name: p.read_text() for p in (tmp_path / "profiles").iterdir()}
    baseline, compressed = (next(text for name, text in profiles.items() if name.endswith(f"{suffix}.txt"))
                            for suffix in ("_baseline", "_compiled_4_bit"))
    # and one more step under cProfile per configuration: the host's Python by its own time
    host = [text for name, text in profiles.items() if name.endswith("_host.txt")]
    assert len(host) == 4 and all("under cProfile" in text and "function calls" in text for text in host)
    assert len(profiles) == 8 and "aten::" in baseline and "lightning_act::dequantize" not in baseline
    assert "lightning_act::record_decoded" in compressed and "lightning_act::dequantize" not in compressed
    assert all("kernel_ms" not in r for r in rows.values())  # no device here: no kernel time, no column
    assert "kernels ms" not in out.read_text()
    # the first step's time (the compiled configuration's compilation) is reported for the compiled rows
    assert rows["compiled, 4-bit"]["first_step_s"] > 0
    assert f"compiled, 4-bit {rows['compiled, 4-bit']['first_step_s']:.0f} s" in out.read_text()


def test_the_gpu_session_script_names_only_models_and_configurations_bench_gpu_has():
    """gpu_session.sh runs on a lent GPU (rare, minutes): a misspelt name there would cost a whole run."""
    import shlex

    import bench_gpu

    script = (ROOT / "benchmarks" / "gpu_session.sh").read_text().replace("\\\n", " ")
    calls = [shlex.split(line, comments=True) for line in script.splitlines() if "benchmarks/bench_gpu.py" in line]
    assert len(calls) >= 3
    for words in calls:
        for flag, known in (("--models", bench_gpu.WORKLOADS), ("--configs", bench_gpu.METHODS)):
            start = words.index(flag) + 1
            end = next(i for i in range(start, len(words)) if words[i].startswith(("--", ">")))
            assert end > start and all(name in known for name in words[start:end]), words[start:end]


def test_the_gpu_session_script_packs_its_results_and_times_the_compiled_torch_paths(tmp_path, monkeypatch):
    """gpu_session.sh with a stand-in ``python`` (it logs each call and writes each ``--out``): with the device
    tool's $OUT set, every report comes back in one archive (the tool returns at most 8 files), and its
    bench_torch_path.py calls, parsed by that script, measure the compiled pipelines of two codecs too."""
    import shlex
    import tarfile

    import bench_torch_path

    stand_in, calls, out = tmp_path / "bin", tmp_path / "calls.txt", tmp_path / "out"
    stand_in.mkdir()
    out.mkdir()
    # it logs each call with the kernel launch it would use; FAIL_LAUNCH: the launch check fails
    (stand_in / "python").write_text(f'#!/usr/bin/env bash\nprintf "%q " "${{LIGHTNING_ACT_KERNEL_LAUNCH:-driver}}" '
                                     f'"$@" >> {calls}; echo >> {calls}\n'
                                     '[ -n "${FAIL_LAUNCH:-}" ] && [ "$2 $3" = "--only launch" ] && exit 1\n'
                                     'while [ $# -gt 0 ]; do [ "$1" = --out ] && echo rows > "$2"; shift; done\n')
    (stand_in / "python").chmod(0o755)
    env = {"PATH": f"{stand_in}:/usr/bin:/bin", "OUT": str(out), "HOME": str(tmp_path)}
    subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_session.sh"), "500"], env=env, check=True,
                   capture_output=True, timeout=60)
    assert sorted(p.name for p in out.iterdir()) == ["gpu_results.tgz"]
    with tarfile.open(out / "gpu_results.tgz") as archive:
        names = {Path(name).name for name in archive.getnames()}
    assert {"gpu_launch_check.md", "gpu_checks.md", "kernel_sweep_gpu.md", "torch_path_gpu.md",
            "torch_path_gpu_compiled.md", "gpu.md", "gpu_bert.md", "gpu_compiled.md", "gpu_more.md"} <= names
    asked = []
    for name in ("_clock", "_sync"):  # main() sets them for CUDA: restored after the test
        monkeypatch.setattr(bench_torch_path, name, getattr(bench_torch_path, name))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench_torch_path, "measure", lambda *args, **kwargs: asked.append(kwargs) or [])
    monkeypatch.setattr(bench_torch_path, "report", lambda *args: "")
    for line in calls.read_text().splitlines():
        if "bench_torch_path.py" in line:
            words = shlex.split(line)[1:]  # after the kernel launch
            words[words.index("--out") + 1] = str(tmp_path / "torch_path.md")
            bench_torch_path.main(words[1:])
    every = ("cuda", tuple(bench_torch_path.CODECS), ())  # the first call: one shape, no compiled pipeline
    assert [(a["device"], a["codecs"], a["compiled"]) for a in asked] == [
        every, ("cuda", ("quantize 4-bit", "division"), bench_torch_path.COMPILED)]
    # the compiled model's rows first (its backward runs no Python per saved tensor since run 6), then issue
    # #20's rows, ResNet-50 and BERT-base each in its own process
    runs = [shlex.split(line) for line in calls.read_text().splitlines()
            if "bench_gpu.py" in line or "bench_torch_path" in line]
    assert [(r[r.index("--models") + 1], Path(r[r.index("--out") + 1]).name) for r in runs[:3]] == [
        ("bert-base", "gpu_compiled.md"), ("resnet50", "gpu.md"), ("bert-base", "gpu_bert.md")]
    assert "compiled, 4-bit traced" in runs[0] and runs[1][runs[1].index("--models") + 2] == "--configs"  # one model
    # the driver launch is checked first; every call launches through it while it holds, through CuPy's call after
    # it failed
    first = shlex.split(calls.read_text().splitlines()[1])  # after nvidia-smi's environment line
    assert first[1:] == ["benchmarks/check_gpu.py", "--only", "launch", "--out", first[-1]]
    assert {line.split()[0] for line in calls.read_text().splitlines()} == {"driver"}
    calls.unlink()
    subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_session.sh"), "500"], env={**env, "FAIL_LAUNCH": "1"},
                   check=True, capture_output=True, timeout=60)
    launches = [line.split()[0] for line in calls.read_text().splitlines()]
    assert launches[:2] == ["driver", "driver"] and set(launches[2:]) == {"cupy"}, launches


def test_bench_gpu_writes_every_row_as_it_goes_and_keeps_to_its_time_budget(tmp_path):
    """A run cut short keeps its figures: ``run`` hands the rows so far (with the baseline-relative figures) to
    ``on_row`` after each one; configurations not started by the deadline are listed as not run, and with no
    time left the command writes a complete report of nothing measured."""
    pytest.importorskip("transformers")
    import bench_gpu
    import torch

    torch.set_num_threads(1)
    seen = []
    workload = bench_gpu.WORKLOADS["resnet50"](torch.device("cpu"), True)
    rows, not_run, facts = bench_gpu.run(workload, ["baseline", "4-bit"], torch.device("cpu"), 1, 0, "checkpoint",
                                         64.0, on_row=lambda r, n, f: seen.append([dict(x) for x in r]))
    assert [[r["config"] for r in rows_so_far] for rows_so_far in seen] == [["baseline"], ["baseline", "4-bit"]]
    assert seen[-1][1]["peak_reduction"] == pytest.approx(rows[0]["peak_mib"] / rows[1]["peak_mib"])
    assert not not_run and facts["capacity_mib"] == 64.0
    _, late, _ = bench_gpu.run(workload, ["baseline"], torch.device("cpu"), 1, 0, "checkpoint", 64.0,
                               deadline=0.0)
    assert late == [f"baseline on {workload.name}: the time budget was spent"]
    out = tmp_path / "gpu.md"
    assert bench_gpu.main(["--tiny", "--models", "resnet50", "bert-base", "--time-budget", "0", "--out", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["complete"] and report["rows"] == []
    assert report["not_run"] == [f"{m}: the time budget was spent before it started" for m in ("resnet50", "bert-base")]
    assert "Partial" not in out.read_text()


@pytest.mark.toolchain
@requires_gxx
def test_check_gpu_stands_in_on_cpu_and_reports_a_kernel_that_stores_other_bytes(tmp_path, monkeypatch):
    """check_gpu.py, the script a session with a GPU runs: on CPU its kernel checks run through the emulator and
    its training-step check on the torch path, each with a row; one wrong byte in a kernel's output fails its
    check and the command; without CUDA and without --cpu it checks nothing and exits 2."""
    pytest.importorskip("transformers")
    import check_gpu
    import torch

    import lightning_act as act
    from lightning_act.cuda import quantize as cuda_quantize

    if not torch.cuda.is_available():
        assert check_gpu.main([]) == check_gpu.NO_CUDA_EXIT
    checks = check_gpu.Checks(torch.device("cpu"))
    for name in ("quantize 4-bit", "division", "lorenzo"):
        codec, options = check_gpu.CODECS[name]
        checks.run("kernels", name, lambda: checks.codec_bytes(codec, options, torch.bfloat16))
    checks.run("step", "BERT", checks.step)
    checks.run("no sync", "quantize", lambda: checks.no_sync("quantize", {"bits": 4}, torch.float32))
    # the compiled-model check's code path on a 1-layer BERT (its 2 layers take a minute to compile on CPU)
    monkeypatch.setattr(checks, "_bert", functools.partial(checks._bert, layers=1, hidden=64, seq=16))
    checks.run("compiled model", "BERT", checks.compiled_model)
    checks.run("compiled model", "conv net", lambda: checks.compiled_model(
        functools.partial(checks._conv_net, batch=8, size=16)))
    assert [r["status"] for r in checks.rows] == ["ok", "ok", "ok", "ok", "skipped", "ok", "ok"], checks.rows
    assert checks.rows[3]["detail"].startswith("gradient cosine 0.9")
    assert checks.rows[5]["detail"].startswith("gradient cosine 0.9")
    assert checks.rows[6]["detail"].startswith("gradient cosine 0.9")
    assert checks.rows[5]["detail"].endswith(", 0 encodes by the kernel op")  # no kernels on CPU: the traced encode
    # the driver launch against CuPy's call needs both on a GPU (tests/test_cuda_quantize.py runs them on CPU)
    checks.run("launch", "quantize", lambda: checks.launch_modes("quantize", {"bits": 4}, torch.bfloat16))
    assert checks.rows[-1]["status"] == "skipped", checks.rows[-1]
    # a GNN's scatter max and min through the winner masks, the bitmask kernel emulated
    checks.run("winner masks", "bf16", lambda: checks.winner_masks(torch.bfloat16, edges=400))
    assert checks.rows[-1]["status"] == "ok", checks.rows[-1]
    # the whole-step no-sync check: on CPU its steps run (through the emulator) and it skips
    checks.run("step no sync", "net", lambda: checks.step_no_sync(act.ACTConfig(bits=4, adaptive=False)))
    assert checks.rows[-1]["status"] == "skipped" and "the steps ran" in checks.rows[-1]["detail"], checks.rows[-1]

    encode = cuda_quantize.QuantizeKernels.encode

    def one_wrong_byte(self, x, key, runner):
        buffers = encode(self, x, key, runner)
        buffers["payload"][3] ^= 1
        return buffers

    monkeypatch.setattr(cuda_quantize.QuantizeKernels, "encode", one_wrong_byte)
    out = tmp_path / "checks.md"
    assert check_gpu.main(["--cpu", "--only", "kernels", "--codecs", "quantize 4-bit", "division", "--out",
                           str(out)]) == 1
    table = out.read_text()
    assert "| kernels | quantize 4-bit, float32 | FAILED | payload: 1 of " in table
    assert "| kernels | division, float32 | ok |" in table


def _tiny_resnet(batch: int):
    from torch import nn

    from lightning_act.models import resnet8

    torch.manual_seed(0)
    model = resnet8(3, 10, width=16)
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    return model, lambda: nn.functional.cross_entropy(model(x), y)


def test_max_batch_trials_are_allocator_peaks_with_model_and_gradients():
    import bench_max_batch

    batch = 16
    first, again = (bench_max_batch.trial_peak(_tiny_resnet, "baseline", batch) for _ in range(2))
    model, _ = _tiny_resnet(batch)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    inputs = batch * 3 * 32 * 32 * 4
    assert first == again  # the allocator's count: exact and repeatable, unlike the resident set
    assert first > 2 * weights + inputs  # weights, their gradients and the batch are counted with the step


def test_memory_budget_trial_fits_the_budget_its_most_aggressive_options_fit():
    import bench_max_batch

    batch = 32
    peaks = {config: bench_max_batch.trial_peak(_tiny_resnet, config, batch)
             for config in ("baseline", "2-bit", "CB1")}
    assert max(peaks["2-bit"], peaks["CB1"]) < peaks["baseline"], peaks
    # a budget that the most aggressive uniform configuration just meets: the planner's plan must meet it too
    budget = min(peaks["2-bit"], peaks["CB1"])
    setup = bench_max_batch.Setup(bench_max_batch.METHODS["memory budget"], budget=budget)
    assert bench_max_batch.trial_peak(_tiny_resnet, setup, batch) <= budget, setup.plans
    options, met = setup.plans[batch]
    assert met and set(options.values()) != {"keep"}
    assert budget < setup.planning_peaks[batch] < peaks["baseline"]  # its passes: above the step, below no plan


@requires_gxx
def test_bench_torch_path_compares_the_torch_path_with_the_kernels_and_exits_2_without_cuda():
    """bench_torch_path.py: ``--device cuda`` without CUDA measures nothing and exits 2; with a kernel runner (the
    emulator standing in for a GPU) each codec has a torch-path and a kernel row, and the comparison table says
    how many times faster the kernels are (issue #20: within 5x)."""
    import bench_torch_path

    from lightning_act.cuda.launcher import use_runner
    from tests.cuda_emulation.emulator import EmulatorRunner

    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as exit_info:
            bench_torch_path.main(["--device", "cuda"])
        assert exit_info.value.code == bench_torch_path.NO_CUDA_EXIT == 2
    codecs = ("quantize 4-bit", "lorenzo eb=1e-2")
    with use_runner(EmulatorRunner()):
        rows = bench_torch_path.measure((2, 4, 8, 8), 1, codecs=codecs, dtypes=("float32",), compiled=(),
                                        kernels=True)
    assert [(r["codec"], r["backend"]) for r in rows] == [(c, b) for c in codecs for b in ("torch", "cupy")]
    assert all(r[f"{op}_gbps"] > 0 for r in rows for op in ("encode", "decode"))
    lines = bench_torch_path.kernel_comparison(rows)
    assert lines[2] == "| dtype | codec | encode GB/s: kernels / torch path | decode GB/s: kernels / torch path |"
    by_codec = {(r["codec"], r["backend"]): r for r in rows}
    for line, codec in zip(lines[4:6], codecs):
        kernel, torch_path = by_codec[codec, "cupy"], by_codec[codec, "torch"]
        ratio = kernel["encode_gbps"] / torch_path["encode_gbps"]
        assert line.startswith(f"| float32 | {codec} | {kernel['encode_gbps']:.3g} / {torch_path['encode_gbps']:.3g} "
                               f"= {ratio:.3g}{' ✗' if ratio > 5 else ''} |")
    assert bench_torch_path.kernel_comparison([r for r in rows if r["backend"] == "torch"]) == []



_FAULTS_SCRIPT = """
import os, resource, sys, torch
import peak_memory

def faults_per_block(blocks=20):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(blocks):
        torch.ones(1 << 20)  # 4 MiB, filled and freed
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / blocks

faults_per_block()  # the heap grows to hold a block where it may
result = {"argv": sys.argv[1:], "faults": faults_per_block(), "pin": os.environ.get("MALLOC_MMAP_THRESHOLD_")}
if peak_memory.is_timing_child():
    try:
        peak_memory.peak_step_bytes(lambda: None)
    except RuntimeError as error:
        result["peak_error"] = str(error)
    peak_memory.write_timings(result)
else:
    print(result["faults"])
"""


def test_timing_child_times_without_the_pin_that_faults_every_large_block(tmp_path, monkeypatch):
    """Peak benchmarks pin glibc's mmap threshold: each 4 MiB block then faults its 1024 pages in afresh, a cost
    no user's step has. timing_child runs the script without the pin (blocks reused: no faults), returns what
    it wrote, and refuses to measure peaks there."""
    import peak_memory

    script = tmp_path / "faults.py"
    script.write_text(_FAULTS_SCRIPT)
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "benchmarks"))
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", peak_memory.MMAP_THRESHOLD)  # as in a pinned benchmark
    pinned = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert pinned.returncode == 0, pinned.stderr[-2000:]
    assert float(pinned.stdout) > 900
    child = peak_memory.timing_child(script, ["--quick", "x"], timeout=120)
    assert child["argv"] == ["--quick", "x"] and child["pin"] is None
    assert child["faults"] < 50
    assert "timing child" in child["peak_error"]


def test_bench_host_calls_times_each_layer_of_the_path_and_an_eager_step():
    """bench_host_calls.py on CPU (no-op kernels): every layer of the per-tensor path timed in both threads, the
    dispatcher ops no cheaper than their Python kernels' share, and the eager narrow step's extra time per
    compressed tensor."""
    pytest.importorskip("transformers")
    import bench_host_calls
    from lightning_act.cuda.launcher import use_runner

    device = torch.device("cpu")
    with use_runner(bench_host_calls.NoOpRunner()):
        calls = bench_host_calls.measure_calls(device, calls=20)
        steps = bench_host_calls.measure_steps(device, layers=1, repeats=2, compile_models=False)
    names = [r["call"] for r in calls]
    assert names[0] == "torch.empty" and "compiled op dequantize_buffer, through the dispatcher" in names
    assert names[-1] == "eager hooks: pack + unpack"
    assert "kernel arguments: pack (the driver launch's host work before cuLaunchKernel)" in names
    assert all(r["main_us"] > 0 and r["thread_us"] > 0 for r in calls)
    [eager] = steps
    assert eager["model"] == "eager" and eager["compressed"] > 0 and eager["plain_ms"] > 0
    assert math.isfinite(eager["us_per_compressed"])
    text = bench_host_calls.report(device, calls, steps, "python benchmarks/bench_host_calls.py")
    assert f"| torch.empty | {calls[0]['main_us']:.1f} | {calls[0]['thread_us']:.1f} |" in text
    assert f"| eager | {eager['compressed']} | {eager['plain_ms']:.2f} |" in text
    with pytest.raises(ValueError, match="--device tpu; expected cpu or cuda"):
        bench_host_calls.main(["--device", "tpu"])


def test_bench_kernel_sweep_ablations_follow_the_kernel_source(monkeypatch):
    """Each ablation removes text the encode holds exactly once (the kernels' changes must carry the sweep along):
    the ablated source lacks it; a part the source lacks is a ValueError naming it."""
    import bench_kernel_sweep
    from lightning_act.cuda.launcher import kernel_source

    original = kernel_source("quantize.cu")
    for name, patches in bench_kernel_sweep.ABLATIONS.items():
        text = bench_kernel_sweep.ablated_source(name)
        assert text != original and all(old not in text for old, _ in patches), name
    assert len(bench_kernel_sweep.ABLATIONS["loads and stores alone"]) == 4
    monkeypatch.setitem(bench_kernel_sweep.ABLATIONS, "gone", [("no such text", "")])
    with pytest.raises(ValueError, match="'no such text' occurs 0 times in quantize.cu"):
        bench_kernel_sweep.ablated_source("gone")


@pytest.mark.toolchain
@requires_gxx
def test_bench_kernel_sweep_varies_one_knob_at_a_time_on_the_emulator(tmp_path):
    """bench_kernel_sweep.py (the GPU diagnosis of the quantize kernels' bound) on CPU through the emulator: per
    dtype, copy_, the mask kernels and every quantize knob, encode and decode; the grid follows the factor; without
    CUDA and without --emulate it exits 2."""
    import bench_kernel_sweep
    from tests.cuda_emulation.emulator import EmulatorRunner

    assert bench_kernel_sweep.main([]) == bench_kernel_sweep.NO_CUDA_EXIT
    scaled = bench_kernel_sweep.ScaledGrid(EmulatorRunner(), 0.25)
    assert scaled.multiprocessors(torch.device("cpu")) == 33 and scaled.device_type == "cpu"  # 132 x 0.25
    out = tmp_path / "sweep.md"
    ablation = "without the noise hash"  # one ablated source: each is a compile of its own
    assert bench_kernel_sweep.main(["--emulate", "--shape", "2", "640", "--calls", "1", "--ablations", ablation,
                                    "--out", str(out)]) == 0
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in out.read_text().splitlines()
            if line.startswith("| ") and "---" not in line][1:]  # after the header
    knobs = len(bench_kernel_sweep.GRID_FACTORS) + len(bench_kernel_sweep.GROUPS) + len(bench_kernel_sweep.BITS) - 2
    assert len(rows) == len(bench_kernel_sweep.DTYPES) * (3 + 2 * knobs + 1)
    assert [r[0] for r in rows if ablation in r[0]] == [f"quantize_encode, {ablation}"] * 2
    assert [r[0] for r in rows[:3]] == ["copy_", "mask_encode", "mask_decode"] and rows[0][8] == "1.00"
    # 1280 elements: one block at every factor; its threads follow the group size (8 elements a thread)
    grids = {(r[1], r[2], r[3], r[4]): r[5] for r in rows if r[0] == "quantize_encode"}
    assert len(grids) == len(bench_kernel_sweep.DTYPES) * knobs
    assert grids[("bfloat16", "1", "256", "4")] == "1 x 96" and grids[("bfloat16", "1", "1024", "4")] == "1 x 128"
    assert all(float(r[6]) > 0 for r in rows)


def _nvdisasm():
    import kernel_sass

    return kernel_sass.find_nvdisasm()


@pytest.mark.toolchain
@pytest.mark.skipif(NVCC is None or _nvdisasm() is None,
                    reason="needs nvcc and nvdisasm (pip install nvidia-cuda-nvdisasm) to list the kernels' SASS")
def test_kernel_sass_finds_no_branch_per_element_in_the_encode(tmp_path):
    """kernel_sass.py, the CPU proxy of the quantize kernels' issue cost, on nvcc's sm_90 code: every listed
    instantiation found, within the 64 registers of 1024-thread blocks and without spills; the encode's quantize
    block (one chunk of 8 elements) branches only per chunk (a branch an element serialised its elements on the
    H200) and stays under 16 integer instructions an element (each issues at half the float rate)."""
    import kernel_sass

    out = tmp_path / "sass.md"
    assert kernel_sass.main(["--out", str(out)]) == 0
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in out.read_text().splitlines()
            if line.startswith("| ") and "---" not in line][1:]
    listed = [f"{kind}_groups<{bits}, {dtype}>" for kind, bits, dtype in kernel_sass.INSTANTIATIONS]
    assert [r[0] for r in rows] == listed
    for r in rows:
        assert int(r[1]) > 100 and 0 < int(r[9]) <= 64 and r[10] == "0", r
        if r[0].startswith("encode"):
            block, branches, integer = map(int, r[11].replace("(", "").replace(",", "").replace(")", "").split())
            assert 8 * 10 < block < 8 * 30 and branches < 8 and integer < 8 * 16, r
            assert 0 < int(r[12]) < 100, r  # two chunks' min, max and NaN tests: no select an element
    with pytest.raises(ValueError, match="0 functions named _Z13encode_groupsILi3E"):
        kernel_sass.lookup({}, "_Z13encode_groupsILi3E")
