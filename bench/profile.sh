#!/usr/bin/env bash
# Nsight Compute on the GPU machine: where a kernel's time goes, and kernel-only durations to
# set beside bench/peers.py's event timings. Run from the repository root:
#   bench/profile.sh fwd DIR        the Hopper forward (`fa4_fwd_sm90` through `fa4 bench
#                                   --kernel sm90`) on seven grid shapes beside cuDNN's kernel
#                                   on d128 1k (and FlashAttention-4 CuTe's on FA4CUTE_SHAPES);
#                                   sections: speed of light, compute and memory workload,
#                                   scheduler and warp states, occupancy, launch, instructions.
#                                   FA4_SHAPES / CUDNN_SHAPES="d,seqlen,causal ..." pick others.
#                                   About 2 min. Summary: bench/profile_summary.py.
#   bench/profile.sh bwd DIR        one backward call (bf16, BP_SHAPE="d seqlen causal batch
#                                   heads", default "128 4096 0 4 16"): fa4's Ampere-class
#                                   (FA4_BWD_KERNEL=sm80) and Hopper (sm90) kernels through
#                                   examples/bwd_bench, SDPA's FlashAttention-2 and cuDNN
#                                   backward; BP_LIBS (default "sm80 sm90 fa2 cudnn"; fa4cute
#                                   adds FlashAttention-4 CuTe). --set full. About 2–3 min.
#   bench/profile.sh decode DIR     one decode call (bf16, 32/8 heads, d128, one query row,
#                                   page 16) of fa4 (examples/decode_bench --serve: its 2nd and
#                                   3rd calls) and of cuDNN (SDPA on a contiguous cache,
#                                   enable_gqa), on DP_SHAPES="B:K ..." (default 1:32768 8:8192
#                                   8:32768); DP_VARIANTS: fa4's FA4_DECODE_VARIANT values
#                                   (default auto); DP_PEER=0 leaves cuDNN out. --set full.
#   bench/profile.sh durations PASS [peers.py flags]   kernel-only durations of fa4 (its Python
#                                   package) and every peer on bench/peers.py's shapes
#                                   (peers.py --profile under ncu, gpu__time_duration only, then
#                                   `peers.py ncu-table`): e.g. `durations decode --quick`,
#                                   `durations fwd --quick --only fa4,cudnn,fa4cute`.
# DIR holds bench/device_build.sh's archive (bins.tar.xz, unpacked here, and cache.tar.xz when
# built) or the binaries themselves (fa4, and examples/ or plain decode_bench, bwd_bench).
# Every mode: --cache-control all (L2 flushed before each profiled kernel, so that reads come
# from DRAM, as with the timings' rotated inputs) and --clock-control none (the workplace does
# not let us lock clocks: each kernel runs at the clocks the GPU picks, the same rule for every
# library); each ncu step under a timeout and all of them under a deadline (PROFILE_BUDGET_S,
# default 200 s; what would pass it is skipped and said so). Where ncu cannot read the counters
# (ERR_NVGPUCTRPERM) it says so. NCU=path picks the ncu binary. A Python peer's call is
# bracketed by cudaProfilerStart/Stop after its warm-ups (ncu --profile-from-start off), so that
# every kernel of that call is profiled, whatever PyTorch launches for it.
# Writes under $OUT (default ./device-out), at most four files a mode (a device call returns at
# most eight):
#   fwd        profile-summary.txt, profile-metrics.csv, profile-runs.tar.gz, profile-reports.tar.gz
#   bwd        bwd-profile.txt (one line per kernel), bwd-profile.tar.gz (details pages, reports)
#   decode     decode-profile.txt, decode-profile.tar.gz
#   durations  ncu.json (case → library → µs per call), durations.txt, ncu-raw.tar.gz
set -uo pipefail
mode=${1:?usage: profile.sh fwd|bwd|decode DIR | durations PASS [peers.py flags]}
shift
out=${OUT:-./device-out}; mkdir -p "$out" && out=$(cd "$out" && pwd)
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FA4_CACHE_DIR=${FA4_CACHE_DIR:-/tmp/fa4cache}
export PYTHONUNBUFFERED=1
here=$(cd "$(dirname "$0")" && pwd)
budget=${PROFILE_BUDGET_S:-200}
deadline=$((SECONDS + budget))
work=$(mktemp -d /tmp/fa4-profile.XXXXXX)

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

# bins DIR: F (the CLI), BB (bwd_bench), DB (decode_bench) of DIR.
bins() {
    local d=$1 b=$1
    if [ -f "$d/bins.tar.xz" ]; then
        b=/tmp/fa4-profile-bins
        rm -rf "$b" && mkdir -p "$b" && tar -C "$b" -xJf "$d/bins.tar.xz"
        if [ -f "$d/cache.tar.xz" ]; then mkdir -p "$FA4_CACHE_DIR" && tar -xJf "$d/cache.tar.xz" -C "$FA4_CACHE_DIR"; fi
    fi
    F=$b/fa4 BB=$b/examples/bwd_bench DB=$b/examples/decode_bench
    [ -x "$BB" ] || BB=$b/bwd_bench
    [ -x "$DB" ] || DB=$b/decode_bench
}
# Seconds left of the deadline, at most $1 (default 60).
left_s() { local l=$((deadline - SECONDS)); [ "$l" -gt "${1:-60}" ] && l=${1:-60}; echo "$l"; }

# ---- fwd: the Hopper forward's profile ----------------------------------------------------

fwd_mode() {
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

# FlashAttention-4 (CuTe) where its wheels were installed (bench/README.md; FA4CUTE_SHAPES, none by
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
}

# ---- bwd and decode: one line per kernel ---------------------------------------------------

# kernel_lines LABEL REPORT METRICS: one line per profiled kernel of REPORT: LABEL, the kernel's
# name, its duration in µs, then each metric of the comma-separated METRICS (bytes in MB; after
# dram__bytes_read.sum, the read bandwidth over the duration in TB/s).
kernel_lines() {
    "$ncu" --import "$2" --csv --page raw --metrics "$3" 2>/dev/null | python3 -c '
import csv, sys
label, metrics = sys.argv[1], sys.argv[2].split(",")
rows = list(csv.reader(sys.stdin))
if len(rows) < 3:
    print(label, "no kernels profiled")
    sys.exit()
h, u = rows[0], rows[1]  # names, units
SCALE = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6, "ns": 1e-3, "us": 1.0, "ms": 1e3,
         "s": 1e6, "byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3, "Tbyte": 1e6}
def value(r, n):
    if n not in h:
        return None
    i = h.index(n)
    try:
        return float(r[i].replace(",", "")) * SCALE.get(u[i], 1.0)
    except ValueError:
        return r[i] or None
for r in rows[2:]:
    dur = value(r, "gpu__time_duration.sum")
    name = r[h.index("Kernel Name")][:48].replace(" ", "_") if "Kernel Name" in h else "?"
    cells = [label, name, "%.2f" % dur if isinstance(dur, float) else "?"]
    for m in metrics[1:]:
        v = value(r, m)
        if isinstance(v, float):
            cells.append("%d" % v if v == int(v) and abs(v) < 1e15 else "%.1f" % v)
        else:
            cells.append(str(v if v is not None else "-"))
        if m == "dram__bytes_read.sum" and isinstance(v, float) and isinstance(dur, float) and dur > 0:
            cells.append("%.2f" % (v / dur))  # MB / µs = TB/s
    print(" ".join(cells))
' "$1" "$3"
}

# profile_one LABEL REPORT_BASE NCU_FLAGS... -- COMMAND...: ncu with "${common[@]}" and the
# flags on COMMAND; the report's kernel lines go to $summ, its details page to REPORT_BASE.txt.
profile_one() {
    local label=$1 rep=$2 l flags=()
    shift 2
    while [ "$1" != -- ]; do flags+=("$1"); shift; done
    shift
    l=$(left_s 60)
    if [ "$l" -lt 15 ]; then echo "$label: skipped (past the ${budget} s budget)" >> "$summ"; return; fi
    timeout -k 5 "$l" "$ncu" "${common[@]}" "${flags[@]}" -f -o "$rep" "$@" > "$rep.log" 2>&1
    if grep -q ERR_NVGPUCTRPERM "$rep.log"; then
        echo "$label: ncu ERR_NVGPUCTRPERM: the GPU's performance counters are not readable here" >> "$summ"
    elif [ -f "$rep.ncu-rep" ]; then
        kernel_lines "$label" "$rep.ncu-rep" "$metrics" >> "$summ"
        "$ncu" --import "$rep.ncu-rep" --page details > "$rep.txt" 2>&1
    else
        echo "$label: no report ($(tail -1 "$rep.log"))" >> "$summ"
    fi
}

bwd_mode() {
    local d seq causal b h libs kern peer
    read -r d seq causal b h <<< "${BP_SHAPE:-128 4096 0 4 16}"
    cat > "$work/peer.py" <<'PY'
import contextlib, sys, torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
d, s, causal, b, h = map(int, sys.argv[2:7])
if sys.argv[1] == "fa4cute":  # FlashAttention-4 (CuTe DSL): (batch, seqlen, heads, d)
    from flash_attn.cute.interface import flash_attn_func
    shape, ctx = (b, s, h, d), None
    fwd = lambda q, k, v: flash_attn_func(q, k, v, causal=bool(causal))
else:
    backend = {"fa2": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[sys.argv[1]]
    shape, ctx = (b, h, s, d), backend
    fwd = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal))
q, k, v = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
do = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
with (sdpa_kernel([ctx]) if ctx is not None else contextlib.nullcontext()):
    o = fwd(q, k, v)
    o = o[0] if isinstance(o, tuple) else o
    for _ in range(3):
        torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
PY
    metrics=gpu__time_duration.sum,launch__grid_size,launch__block_size,launch__registers_per_thread,launch__shared_mem_per_block_dynamic,sm__warps_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed
    common=(--cache-control all --clock-control none --set full --metrics "$metrics")
    summ=$out/bwd-profile.txt
    {
        echo "# backward profiles, shape d=$d seq=$seq causal=$causal batch=$b heads=$h, $(date -u +%FT%TZ), $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
        echo "# lib kernel duration_us grid block regs smem_dyn warps_active% tensor_active% lsu_issue% smem_wavefronts bank_conflicts dram% sm%"
    } > "$summ"
    libs=" ${BP_LIBS:-sm80 sm90 fa2 cudnn} "
    for kern in sm80 sm90; do
        [[ $libs == *" $kern "* ]] || continue
        # bwd_bench sets the shape up (warm-up calls), then one round of 2 calls: the 4 fa4_bwd
        # launches after the first 8 (a call is pre, main, convert or dq).
        printf 'shape %s %s %s %s %s\nround 2\n' "$d" "$seq" "$causal" "$b" "$h" > "$work/bwd-$kern.in"
        FA4_BWD_KERNEL=$kern profile_one "fa4-$kern" "$work/fa4-$kern" --kernel-name regex:fa4_bwd \
            --launch-skip 8 --launch-count 4 -- sh -c 'exec "$0" < "$1"' "$BB" "$work/bwd-$kern.in"
    done
    for peer in fa2 cudnn fa4cute; do
        [[ $libs == *" $peer "* ]] || continue
        profile_one "$peer" "$work/$peer" --profile-from-start off -- \
            python3 "$work/peer.py" "$peer" "$d" "$seq" "$causal" "$b" "$h"
    done
    tar -C "$work" -czf "$out/bwd-profile.tar.gz" . 2>/dev/null
    cat "$summ"
}

decode_mode() {
    local s b sk v
    cat > "$work/peer.py" <<'PY'
import sys, torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
b, sk = int(sys.argv[1]), int(sys.argv[2])
q = torch.randn(b, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
k = torch.randn(b, 8, sk, 128, device="cuda", dtype=torch.bfloat16)
v = torch.randn(b, 8, sk, 128, device="cuda", dtype=torch.bfloat16)
with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
    for _ in range(5):
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
PY
    metrics=gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size,launch__block_size,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active,sm__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct
    common=(--cache-control all --clock-control none --set full --metrics "$metrics")
    summ=$out/decode-profile.txt
    {
        echo "# decode profiles, $(date -u +%FT%TZ), $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
        echo "# lib:batch:keys kernel duration_us dram_read_MB dram_TB/s(read/duration) dram_%peak grid block regs warps_active_% sm_% l2_hit_%"
    } > "$summ"
    for s in ${DP_SHAPES:-1:32768 8:8192 8:32768}; do
        b=${s%%:*} sk=${s##*:}
        for v in ${DP_VARIANTS:-auto}; do
            # decode_bench --serve answers one request (one untimed call, then 10): the decode
            # and combine kernels of the 2nd and 3rd calls.
            echo "16 1 $b $sk 0 random $v" > "$work/dec-$v-$b-$sk.in"
            profile_one "fa4:$v:$b:$sk" "$work/fa4-$v-$b-$sk" --kernel-name 'regex:fa4_decode_(heads|splitkv|combine)' \
                --launch-skip 2 --launch-count 4 -- sh -c 'exec "$0" --serve < "$1"' "$DB" "$work/dec-$v-$b-$sk.in"
        done
        [ "${DP_PEER:-1}" = 0 ] && continue
        profile_one "cudnn:$b:$sk" "$work/cudnn-$b-$sk" --profile-from-start off -- python3 "$work/peer.py" "$b" "$sk"
    done
    tar -C "$work" -czf "$out/decode-profile.tar.gz" . 2>/dev/null
    cat "$summ"
}

# ---- durations: every library on peers.py's shapes -----------------------------------------

# peers.py --profile: warm-ups outside the profiled windows, then 3 calls per library and shape,
# each followed by a marker kernel (spin_kernel) that tells the calls apart.
durations_mode() {
    local pass=$1 rc
    shift
    timeout -k 5 "$(left_s 400)" "$ncu" --metrics gpu__time_duration.sum --clock-control none --cache-control all \
        --profile-from-start off --target-processes all --force-overwrite --export "$work/peers" \
        python3 "$here/peers.py" "$pass" --profile "$work/labels.json" "$@" > "$work/peers.log" 2>&1
    rc=$?
    echo "ncu peers.py $pass rc=$rc"
    grep -hE '==(ERROR|WARNING)==' "$work/peers.log" | sort | uniq -c | head
    timeout 60 "$ncu" --import "$work/peers.ncu-rep" --csv --page raw --print-units base > "$work/peers.csv" 2> "$work/import.log"
    timeout 60 python3 "$here/peers.py" ncu-table "$work/peers.csv" "$work/labels.json" --json "$out" | tee "$out/durations.txt"
    (cd "$work" && tar -czf "$out/ncu-raw.tar.gz" -- peers.csv peers.log labels.json 2>/dev/null)
}

case $mode in
fwd | bwd | decode)
    bins "${1:?usage: profile.sh $mode DIR}"
    case $mode in
    fwd) [ -x "$F" ] || { echo "profile.sh fwd: no fa4 binary in $1" >&2; exit 2; }; fwd_mode ;;
    bwd) [ -x "$BB" ] || { echo "profile.sh bwd: no bwd_bench in $1" >&2; exit 2; }; bwd_mode ;;
    decode) [ -x "$DB" ] || { echo "profile.sh decode: no decode_bench in $1" >&2; exit 2; }; decode_mode ;;
    esac ;;
durations) durations_mode "${1:?usage: profile.sh durations fwd|bwd|decode [peers.py flags]}" "${@:2}" ;;
*) echo "usage: profile.sh fwd|bwd|decode DIR | durations PASS [peers.py flags]" >&2; exit 2 ;;
esac
echo "done in $SECONDS s; work files in $work"
