#!/usr/bin/env bash
# Nsight Compute profiles that say where the Hopper kernel's time goes, beside cuDNN's: one launch
# of `fa4_fwd_sm90` (through `fa4 bench --backend cuda --kernel sm90`) on each of seven shapes of
# the FlashAttention grid (bf16, 16k tokens, hidden 2048: heads = 2048 / d, batch = 16384 / seqlen),
# and one launch of cuDNN's attention kernel through PyTorch SDPA on d128 1k, causal and not (and
# of FlashAttention-4 (CuTe) on FA4CUTE_SHAPES, where it is installed).
# Sections: speed of light, compute and memory workload (tensor / XU / FMA pipes, shared memory,
# L2, DRAM), scheduler and warp-state statistics (issue slots, stall reasons), occupancy, launch
# and instruction statistics, plus a few sm90 pipe metrics named outright.
# Run on the GPU machine from the repository root, with the fa4 binary built on the host and
# carried in BIN_DIR (default .device/, as for bench/device_session.sh):
#   bench/profile.sh [BIN_DIR]          (FA4_SHAPES="d,seqlen,causal ..." CUDNN_SHAPES=... pick others)
# About 2 minutes: a few seconds per fa4 launch (process start, ~30 replay passes), 20-30 s per
# PyTorch one. Every ncu step has a timeout and all of them a deadline (PROFILE_BUDGET_S, default
# 200 s); what would run past it is skipped and said so. Clocks are left alone (--clock-control
# none), so durations are at the clocks the benchmarks run at; ncu flushes the caches before the
# launch. Where ncu cannot read the counters (ERR_NVGPUCTRPERM, or a profiler that does not load)
# it says so and skips the rest. NCU=path picks the ncu binary.
# Writes under $OUT (or ./device-out), in four files since a device call returns at most eight:
#   profile-summary.txt     the table of bench/profile_summary.py, one row per profiled launch
#   profile-metrics.csv     every collected metric, one row per launch (ncu's raw pages, merged)
#   profile-runs.tar.gz     per launch ncu's raw CSV and log, and the event-timed `fa4 bench` run
#   profile-reports.tar.gz  the .ncu-rep reports, for `ncu --import` or the Nsight Compute UI
set -uo pipefail
bin=${1:-.device}
out=${OUT:-./device-out}; mkdir -p "$out" && out=$(cd "$out" && pwd)
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FA4_CACHE_DIR=${FA4_CACHE_DIR:-/tmp/fa4cache}
F=$bin/fa4
here=$(dirname "$0")
budget=${PROFILE_BUDGET_S:-200}
deadline=$((SECONDS + budget))
work=$(mktemp -d /tmp/fa4-profile.XXXXXX)

if [ ! -x "$F" ]; then
    echo "no fa4 binary at $F; usage: $0 [BIN_DIR]" >&2
    exit 2
fi
# ncu on PATH, else CUDA's, else the newest Nsight Compute install.
find_ncu() {
    command -v ncu && return
    [ -x /usr/local/cuda/bin/ncu ] && { echo /usr/local/cuda/bin/ncu; return; }
    printf '%s\n' /opt/nvidia/nsight-compute/*/ncu | sort -rV | while read -r c; do
        [ -x "$c" ] && { echo "$c"; break; }
    done
}
ncu=${NCU:-$(find_ncu)}
if [ -z "$ncu" ]; then
    echo "no ncu on PATH, at /usr/local/cuda/bin/ncu or under /opt/nvidia/nsight-compute" >&2
    exit 2
fi
echo "ncu: $ncu ($(timeout 30 "$ncu" --version 2>&1 | tail -1))"
timeout 30 nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader

# fa4 shapes d,seqlen,causal; cuDNN on the first two.
# d,seqlen,causal; FA4_SHAPES / CUDNN_SHAPES (space-separated) replace the defaults.
read -r -a shapes <<< "${FA4_SHAPES:-128,1024,0 128,1024,1 64,1024,1 256,1024,0 128,4096,0 256,16384,0 64,16384,0}"
read -r -a cudnn_shapes <<< "${CUDNN_SHAPES:-128,1024,0 128,1024,1}"

# Sections this ncu has (an older or newer one may name them otherwise: those are left out).
want=(SpeedOfLight ComputeWorkloadAnalysis MemoryWorkloadAnalysis MemoryWorkloadAnalysis_Tables
      WarpStateStats SchedulerStats Occupancy LaunchStats InstructionStats)
have=$(timeout 30 "$ncu" --list-sections 2>/dev/null | awk '{print $1}')
sections=()
for s in "${want[@]}"; do
    if [ -z "$have" ] || grep -qx "$s" <<< "$have"; then sections+=(--section "$s"); else echo "ncu has no section $s: left out"; fi
done
# Named outright, so that the summary's columns do not hang on what a section holds in this
# version (sm90 spellings of ncu 2025.x: wgmma counts on the tensor pipe; dram__throughput is
# absent there, read and write bytes are not). A name this ncu does not know is dropped, since
# one unknown name fails the whole run.
extra=(gpu__time_duration.sum
       sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active
       sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
       sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active
       sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active
       sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active
       sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active
       sm__pipe_tma_cycles_active.avg.pct_of_peak_sustained_active
       smsp__issue_active.avg.pct_of_peak_sustained_active
       sm__warps_active.avg.pct_of_peak_sustained_active
       launch__registers_per_thread
       l1tex__data_pipe_lsu_wavefronts_mem_shared.sum.pct_of_peak_sustained_elapsed
       l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum
       lts__throughput.avg.pct_of_peak_sustained_elapsed
       dram__bytes_read.sum.pct_of_peak_sustained_elapsed
       dram__bytes_write.sum.pct_of_peak_sustained_elapsed)
known=$(timeout 60 "$ncu" --query-metrics 2>/dev/null | awk '{print $1}')
metrics=""
for m in "${extra[@]}"; do
    if [ -z "$known" ] || grep -qx "${m%%.*}" <<< "$known"; then
        metrics+=${metrics:+,}$m
    else
        echo "ncu --query-metrics does not list ${m%%.*}: left out"
    fi
done

counters_ok=1
csvs=()
# run_ncu NAME LIMIT_S [selection flags] -- COMMAND...: profile into $work/NAME.ncu-rep, export
# its raw page to $work/NAME.csv. Returns 3 when no kernel matched the selection.
run_ncu() {
    local name=$1 limit=$2 left=$((deadline - SECONDS)) flags=() mflags=() t0=$SECONDS rc try
    shift 2
    while [ "$1" != -- ]; do flags+=("$1"); shift; done
    shift
    if [ "$counters_ok" != 1 ]; then echo "$name: skipped (ncu cannot read the counters here)"; return 1; fi
    if [ "$left" -lt 15 ]; then echo "$name: skipped (past the ${budget} s budget)"; return 1; fi
    [ "$limit" -gt "$left" ] && limit=$left
    for try in 1 2; do
        rm -f "$work/$name.ncu-rep"
        mflags=()
        [ -n "$metrics" ] && mflags=(--metrics "$metrics")
        timeout -k 10 "$limit" "$ncu" --target-processes all --clock-control none --force-overwrite \
            "${sections[@]}" "${mflags[@]}" "${flags[@]}" --export "$work/$name" \
            "$@" > "$work/$name.log" 2>&1
        rc=$?
        # An unknown metric name fails the run before any kernel: once more without the extras.
        if [ "$try" = 1 ] && [ -n "$metrics" ] && [ ! -f "$work/$name.ncu-rep" ] &&
            grep -qiE '==ERROR==.*metric' "$work/$name.log"; then
            echo "$name: ncu refused a metric ($(grep -iE '==ERROR==.*metric' "$work/$name.log" | head -1)); without the named metrics from here on"
            metrics=""
            continue
        fi
        break
    done
    if grep -q ERR_NVGPUCTRPERM "$work/$name.log"; then
        echo "$name: ncu ERR_NVGPUCTRPERM: this machine does not let ncu read the GPU performance counters" \
            "(the driver restricts them to admin users); skipping the remaining profiles"
        counters_ok=0
        return 1
    fi
    if grep -qE 'LibraryNotLoaded|Failed to initialize the profiler' "$work/$name.log"; then
        echo "$name: ncu could not start its profiler here ($(grep -m1 -E '==ERROR==' "$work/$name.log"));" \
            "skipping the remaining profiles"
        counters_ok=0
        return 1
    fi
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
        echo "$name: timed out after ${limit} s (log: $name.log)"
        return 1
    fi
    if [ ! -f "$work/$name.ncu-rep" ]; then
        echo "$name: no report (rc=$rc): $(grep -m2 -E '==(ERROR|WARNING)==' "$work/$name.log" | tr '\n' ' ')"
        grep -qi 'no kernels were profiled' "$work/$name.log" && return 3
        return 1
    fi
    timeout 60 "$ncu" --import "$work/$name.ncu-rep" --csv --page raw --print-units base \
        > "$work/$name.csv" 2> "$work/$name.import.log"
    echo "$name: rc=$rc, import rc=$?, $((SECONDS - t0)) s"
    csvs+=("$work/$name.csv")
}

# Compiles every variant into the cache outside the profiler, and gives the event-timed medians
# that the summary prints beside ncu's single-launch durations.
timeout 120 "$F" bench --backend cuda --kernel sm90 --dtype bf16 --json --reps 20 --grid "${shapes[@]}" \
    > "$work/bench.json" 2> "$work/bench.log"
echo "fa4 bench (event-timed, unprofiled) rc=$?"

for shape in "${shapes[@]}"; do
    IFS=, read -r d s c <<< "$shape"
    # bench runs --warmup launches then --reps: skip the warm-up one, profile the next.
    run_ncu "fa4-d$d-s$s-c$c" 60 --kernel-name-base function -k fa4_fwd_sm90 --launch-skip 1 --launch-count 1 -- \
        "$F" bench --backend cuda --kernel sm90 --dtype bf16 --warmup 1 --reps 1 --grid "$shape"
done

# cuDNN through SDPA, layout (batch, heads, seq, d): warm-ups (graph build, autotuning) run before
# cudaProfilerStart, so ncu sees the one call after it. Its kernel is named like
# cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_...; should the name not match,
# the window's first three launches are profiled instead, whatever they are named.
sdpa_py='
import sys, torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
d, s, causal = (int(x) for x in sys.argv[1:4])
heads, batch = 2048 // d, 16384 // s
q, k, v = (torch.randn(batch, heads, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
    for _ in range(3):
        F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal))
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal))
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
print("torch", torch.__version__, "cuDNN", torch.backends.cudnn.version())
'
for shape in "${cudnn_shapes[@]}"; do
    IFS=, read -r d s c <<< "$shape"
    run_ncu "cudnn-d$d-s$s-c$c" 90 --profile-from-start off --kernel-name-base function \
        -k 'regex:sdpa|fprop|fmha|flash|attn' --launch-count 1 -- python3 -c "$sdpa_py" "$d" "$s" "$c"
    rc=$?
    if [ "$rc" = 3 ]; then
        echo "cudnn-d$d-s$s-c$c: again, the window's first launches whatever their names"
        run_ncu "cudnn-d$d-s$s-c$c" 90 --profile-from-start off --launch-count 3 -- python3 -c "$sdpa_py" "$d" "$s" "$c"
    fi
done

# FlashAttention-4 (CuTe) where bench/device_session.sh fa4-install put it (FA4CUTE_SHAPES, none by
# default), layout (batch, seq, heads, d): warm-ups (JIT compile) before the profiling window, and
# the window's first three launches, whatever they are named.
fa4cute_py='
import sys, torch
from flash_attn.cute.interface import flash_attn_func
d, s, causal = (int(x) for x in sys.argv[1:4])
heads, batch = 2048 // d, 16384 // s
q, k, v = (torch.randn(batch, s, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for _ in range(3):
    flash_attn_func(q, k, v, causal=bool(causal))
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
flash_attn_func(q, k, v, causal=bool(causal))
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
'
read -r -a fa4cute_shapes <<< "${FA4CUTE_SHAPES:-}"
[ ${#fa4cute_shapes[@]} -gt 0 ] &&
    export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
for shape in "${fa4cute_shapes[@]}"; do
    IFS=, read -r d s c <<< "$shape"
    run_ncu "fa4cute-d$d-s$s-c$c" 150 --profile-from-start off --kernel-name-base function \
        --launch-count 3 -- python3 -c "$fa4cute_py" "$d" "$s" "$c"
done

timeout 60 python3 "$here/profile_summary.py" --bench "$work/bench.json" --merged "$out/profile-metrics.csv" \
    "${csvs[@]}" | tee "$out/profile-summary.txt"
(
    shopt -s nullglob
    cd "$work" || exit
    tar -czf "$out/profile-runs.tar.gz" -- *.csv *.log bench.json
    reports=(*.ncu-rep)
    [ ${#reports[@]} -gt 0 ] && tar -czf "$out/profile-reports.tar.gz" -- "${reports[@]}"
)
# A device call brings back files of up to 16 MiB.
for f in "$out"/profile-*; do
    echo "$f: $(du -h "$f" | cut -f1)"
    [ "$(stat -c %s "$f")" -gt $((16 << 20)) ] && echo "warning: over 16 MiB, it will not come back from a device call"
done
echo "done in $SECONDS s; work files in $work"
