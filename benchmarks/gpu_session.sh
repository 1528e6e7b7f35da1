#!/usr/bin/env bash
# What a session that is lent a GPU runs (issue #20), as ONE command within the device tool's limits (10 minutes a
# command, about 15 of device time a session):
#
#   bash benchmarks/gpu_session.sh [SECONDS]     # in all, default 500: give the device tool timeout_s=590
#
# 1. check_gpu.py: the driver launch against CuPy's call (alone first: see below), the kernels against the
#    specification on the device, no host synchronisation, lorenzo's trim, a GNN's scatter max/min through its
#    winner masks, the compiled (Triton) path, side-stream gradients, a compressed bf16 step, a compiled model (the
#    kernel encode op), host µs per saved tensor (and a cProfile of those hooks);
# 2. bench_gpu.py on BERT-base torch.compile'd (alone; 4-bit inside its graphs, the traced encode and the kernel
#    encode op, whose backwards decode by inlined traced ops; with torch checkpointing), each compiling first
#    (the compile times are reported);
# 3. bench_gpu.py, the rows issue #20 judges (ResNet-50, then BERT-base in a process of its own: baseline, 4-bit,
#    L1, torch checkpointing, 2-bit), each row with a profiled step (its kernel time; its ops in profiles/);
# 4. bench_kernel_sweep.py: what bounds the quantize kernels, and what each part of the encode costs (30-60 s);
# 5. bench_host_overhead.py --quick, the CPU proxy of the host figure on this host; bench_host_calls.py, host µs
#    per call of each layer of the per-tensor path with the real kernels; bench_torch_path.py --device
#    cuda: each codec's torch path, and two codecs' compiled pipeline, against the kernels (GB/s, how many times);
#    in the time left the other models and configurations.
# Every report is rewritten as its rows arrive, so a run cut short keeps what it measured. Results go to
# benchmarks/results, or where the device tool's $OUT is set, to one archive there, $OUT/gpu_results.tgz, packed
# again after every stage (the tool brings back at most 8 files); unpack it into benchmarks/results and commit.
set -u
cd "$(dirname "$0")/.."
if [ -n "${OUT:-}" ]; then out=$(mktemp -d); else out=benchmarks/results; fi
deadline=$(( $(date +%s) + ${1:-500} ))
left() { echo $(( deadline - $(date +%s) )); }
pack() { [ -n "${OUT:-}" ] && tar czf "$OUT/gpu_results.tgz.part" -C "$out" . && mv "$OUT/gpu_results.tgz.part" "$OUT/gpu_results.tgz"; }
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this working tree's package: nothing to install (offline)
export PYTHONUNBUFFERED=1  # a stage its timeout ends keeps its log (run 6's sweep left an empty one)
{ nvidia-smi; python -c "import torch, cupy; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'cupy', cupy.__version__)"; } \
    > "$out/gpu_env.txt" 2>&1
# the driver launch (the default) against CuPy's own call, first: should they differ, the rest of the run launches
# through CuPy's call, so its figures still count (and gpu_launch_check.md says why)
if ! timeout 60 python benchmarks/check_gpu.py --only launch --out "$out/gpu_launch_check.md" \
        > "$out/gpu_launch_check.log" 2>&1; then
    export LIGHTNING_ACT_KERNEL_LAUNCH=cupy
    echo "the driver launch failed its check: this run launches through CuPy's call"
fi
echo "kernel launch: ${LIGHTNING_ACT_KERNEL_LAUNCH:-driver}" >> "$out/gpu_env.txt"
timeout 200 python benchmarks/check_gpu.py --out "$out/gpu_checks.md" --host-profile "$out/gpu_host_profile.txt" \
    > "$out/gpu_checks.log" 2>&1
echo "check_gpu.py: exit $?, $(left) s left"
pack
# torch.compile'd BERT-base first (never measured since its backward decodes by traced ops inlined by the sink
# pass, no Python per saved tensor: the route to issue #20's targets), against the compiled model alone: the
# traced encode (no Python per tensor in the forward either; with CUDA graphs between the graph's one count op),
# then the kernel encode op; each configuration compiles first (about a minute each): --time-budget stops
# starting configurations, timeout ends one still running (its rows so far are written)
compiled=$(( $(left) < 200 ? $(left) : 200 ))
if [ "$compiled" -gt 120 ]; then
    timeout "$compiled" python benchmarks/bench_gpu.py --time-budget $(( compiled - 110 )) --models bert-base \
        --configs baseline "compiled (reduce-overhead), 4-bit traced" "compiled, 4-bit traced" "compiled, 4-bit" \
        compiled "compiled (reduce-overhead), 4-bit" "compiled, torch checkpoint" \
        --out "$out/gpu_compiled.md" \
        --profile "$out/profiles_compiled" > "$out/bench_gpu_compiled.log" 2>&1
    echo "bench_gpu.py, compiled rows: exit $?, $(left) s left"
    pack
fi
# issue #20's rows, each model in its own process (run 5: BERT-base's baseline after ResNet-50 in one process
# spread from 48 to 61 ms, alone 39.4), about 70 s each; last, run 6's host split again (host ms per row: the
# forward's host time with the hooks doing nothing, and with no kernel launched)
core=$(( $(left) < 100 ? $(left) : 100 ))
timeout "$core" python benchmarks/bench_gpu.py --time-budget $(( core - 30 )) --models resnet50 \
    --configs baseline 4-bit L1 "torch checkpoint" 2-bit "4-bit, no kernels" \
    --out "$out/gpu.md" --profile "$out/profiles" > "$out/bench_gpu.log" 2>&1
echo "bench_gpu.py, issue #20's ResNet-50 rows: exit $?, $(left) s left"
pack
core=$(( $(left) < 100 ? $(left) : 100 ))
timeout "$core" python benchmarks/bench_gpu.py --time-budget $(( core - 30 )) --models bert-base \
    --configs baseline 4-bit L1 "torch checkpoint" 2-bit "empty hooks" "4-bit, no kernels" \
    --out "$out/gpu_bert.md" --profile "$out/profiles" > "$out/bench_gpu_bert.log" 2>&1
echo "bench_gpu.py, issue #20's BERT-base rows: exit $?, $(left) s left"
pack
# what bounds the quantize kernels (grid, group size, bits, dtype against copy_ and the mask kernels; the encode
# with one part of its work removed at a time): 30-60 s (run 6: over 60 s once, with a cold compile cache)
timeout 120 python benchmarks/bench_kernel_sweep.py --out "$out/kernel_sweep_gpu.md" > "$out/kernel_sweep_gpu.log" 2>&1
echo "bench_kernel_sweep.py: exit $?, $(left) s left"
pack
# the CPU proxy of the host check on this machine's CPU (no-op kernels): what the real launches add to it
timeout 60 python benchmarks/bench_host_overhead.py --quick --out "$out/gpu_host_overhead_proxy.md" \
    > "$out/gpu_host_overhead_proxy.log" 2>&1
pack
# host µs per call of each layer of the per-tensor path, and the narrow BERT eager and compiled (about 75 s)
if [ "$(left)" -gt 120 ]; then
    timeout 100 python benchmarks/bench_host_calls.py --device cuda --out "$out/host_calls_gpu.md" \
        > "$out/host_calls_gpu.log" 2>&1
    echo "bench_host_calls.py --device cuda: exit $?, $(left) s left"
    pack
fi
# the torch path (what a GPU user without CuPy runs) beside the kernels, per codec and dtype: issue #20's "within
# 5x" (a bare --compiled: no compiled pipeline here, each variant compiles for seconds), on a 16 x 256 x 56 x 56
# activation (two runs measured 64 x ... too); then the compiled pipeline (backend="compile") of two codecs. A
# report is written when its run ends.
if [ "$(left)" -gt 100 ]; then
    timeout 100 python benchmarks/bench_torch_path.py --device cuda --repeats 3 --compiled \
        --shapes 16x256x56x56 --out "$out/torch_path_gpu.md" > "$out/torch_path_gpu.log" 2>&1
    echo "bench_torch_path.py --device cuda: exit $?, $(left) s left"
    pack
fi
if [ "$(left)" -gt 100 ]; then
    timeout 90 python benchmarks/bench_torch_path.py --device cuda --repeats 3 --codecs "quantize 4-bit" division \
        --dtypes float32 bfloat16 --out "$out/torch_path_gpu_compiled.md" > "$out/torch_path_gpu_compiled.log" 2>&1
    echo "bench_torch_path.py --device cuda, compiled: exit $?, $(left) s left"
    pack
fi
if [ "$(left)" -gt 90 ]; then
    timeout "$(left)" python benchmarks/bench_gpu.py --time-budget $(( $(left) - 60 )) \
        --models bert-base resnet50-cl gcn gcn-csr resnet50 \
        --configs baseline "4-bit, bounded" "L1, side stream" "4-bit, side stream" "4-bit, compile" division \
        "lorenzo eb=1e-2" CB2 \
        "torch checkpoint" "memory budget" save_on_cpu --out "$out/gpu_more.md" --profile "$out/profiles_more" \
        > "$out/bench_gpu_more.log" 2>&1
    echo "bench_gpu.py, the other rows: exit $?, $(left) s left"
    pack
fi
tail -n 4 "$out/gpu_checks.md" "$out/torch_path_gpu.md" "$out/gpu.md" "$out/gpu_bert.md" "$out/gpu_compiled.md" 2>/dev/null
