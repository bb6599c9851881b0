#!/usr/bin/env bash
# Nsight Compute profiles of one backward call on one shape (bf16, d128, 4k tokens per sequence,
# batch 4, 16 heads, non-causal unless BP_SHAPE says otherwise): fa4's Ampere-class kernels
# (FA4_BWD_KERNEL=sm80), fa4's Hopper kernels (sm90), PyTorch SDPA's backward with
# FlashAttention-2 and with cuDNN, and FlashAttention-4 (CuTe DSL; `flash_attn.cute` must import:
# bench/device_session.sh says how its wheels travel), to say where the gap between them is
# (tensor-pipe use, shared memory traffic and bank conflicts, registers, occupancy, stalls).
#   bench/bwd_profile.sh DIR      DIR holds bwd_bench (examples/bwd_bench.rs)
# fa4: `bwd_bench` sets the shape up (warm-up calls), then one round of 2 calls; ncu profiles 4
# launches of the fa4_bwd_* kernels after the first 8 (one call is pre, main, convert or dq).
# Peers: a Python harness warms up, then brackets one backward with cudaProfilerStart/Stop
# (ncu --profile-from-start off): every kernel of that backward is profiled.
# BP_LIBS (default "sm80 sm90 fa2 cudnn") picks the libraries; "fa4cute" adds FlashAttention-4.
# --cache-control all, --clock-control none, --set full. Writes under $OUT: bwd-profile.txt (one
# line per kernel) and bwd-profile.tar.gz (details pages as text, .ncu-rep reports).
set -uo pipefail
D=${1:?usage: bwd_profile.sh DIR}
out=${OUT:-./device-out}; mkdir -p "$out" && out=$(cd "$out" && pwd)
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export FA4_CACHE_DIR=${FA4_CACHE_DIR:-/tmp/fa4-bprof-cache}
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || ls -d /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
[ -x "$ncu" ] || { echo "bwd_profile: no ncu" | tee "$out/bwd-profile.txt"; exit 1; }
work=$(mktemp -d /tmp/fa4-bprof.XXXXXX)
deadline=$((SECONDS + ${BP_BUDGET:-170}))
read -r d seq causal b h <<< "${BP_SHAPE:-128 4096 0 4 16}"
cat > "$work/peer.py" <<'EOF'
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
EOF
metrics=gpu__time_duration.sum,launch__grid_size,launch__block_size,launch__registers_per_thread,launch__shared_mem_per_block_dynamic,sm__warps_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed
common=(--cache-control all --clock-control none --set full --metrics "$metrics")
summ=$out/bwd-profile.txt
{
    echo "# backward profiles, shape d=$d seq=$seq causal=$causal batch=$b heads=$h, $(date -u +%FT%TZ), $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
    echo "# lib kernel duration_us grid block regs smem_dyn warps_active% tensor_active% lsu_issue% smem_wavefronts(M) bank_conflicts(M) dram% sm%"
} > "$summ"
row() { # lib report
    "$ncu" --import "$2" --csv --page raw --metrics "$metrics" 2>/dev/null | python3 -c '
import csv, sys
lib = sys.argv[1]
rows = list(csv.reader(sys.stdin))
if len(rows) < 3:
    print(lib, "no kernels profiled"); sys.exit()
h, u = rows[0], rows[1]  # names, units
US = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6, "ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}
def g(r, n):
    return r[h.index(n)] if n in h else "?"
def num(x):
    try: return float(x.replace(",", ""))
    except ValueError: return float("nan")
for r in rows[2:]:
    i = h.index("gpu__time_duration.sum") if "gpu__time_duration.sum" in h else None
    dur = float("nan") if i is None else num(r[i]) * US.get(u[i], float("nan"))  # µs
    wf = num(g(r, "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum")) / 1e6
    bc = num(g(r, "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum")) / 1e6
    print(lib, g(r, "Kernel Name")[:40].replace(" ", "_"), "%.1f" % dur,
          g(r, "launch__grid_size"), g(r, "launch__block_size"), g(r, "launch__registers_per_thread"),
          g(r, "launch__shared_mem_per_block_dynamic"), g(r, "sm__warps_active.avg.pct_of_peak_sustained_active"),
          g(r, "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"),
          g(r, "sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active"), "%.1f" % wf, "%.1f" % bc,
          g(r, "dram__throughput.avg.pct_of_peak_sustained_elapsed"), g(r, "sm__throughput.avg.pct_of_peak_sustained_elapsed"))
' "$1" >> "$summ"
}
left() { local l=$((deadline - SECONDS)); [ "$l" -gt 60 ] && l=60; echo "$l"; }
libs=" ${BP_LIBS:-sm80 sm90 fa2 cudnn} "
for kern in sm80 sm90; do
    [[ $libs == *" $kern "* ]] || continue
    [ "$((deadline - SECONDS))" -lt 15 ] && { echo "skipped fa4-$kern: budget spent" >> "$summ"; continue; }
    rep=$work/fa4-$kern
    printf 'shape %s %s %s %s %s\nround 2\n' "$d" "$seq" "$causal" "$b" "$h" |
        FA4_BWD_KERNEL=$kern timeout -k 5 "$(left)" "$ncu" "${common[@]}" --kernel-name regex:'fa4_bwd' \
            --launch-skip 8 --launch-count 4 -f -o "$rep" "$D/bwd_bench" > "$rep.log" 2>&1
    if [ -f "$rep.ncu-rep" ]; then
        row "fa4-$kern" "$rep.ncu-rep"
        "$ncu" --import "$rep.ncu-rep" --page details > "$rep.txt" 2>&1
    else
        echo "fa4-$kern: no report ($(tail -1 "$rep.log"))" >> "$summ"
    fi
done
for peer in fa2 cudnn fa4cute; do
    [[ $libs == *" $peer "* ]] || continue
    [ "$((deadline - SECONDS))" -lt 20 ] && { echo "skipped $peer: budget spent" >> "$summ"; continue; }
    rep=$work/$peer
    timeout -k 5 "$(left)" "$ncu" "${common[@]}" --profile-from-start off -f -o "$rep" \
        python3 "$work/peer.py" "$peer" "$d" "$seq" "$causal" "$b" "$h" > "$rep.log" 2>&1
    if [ -f "$rep.ncu-rep" ]; then
        row "$peer" "$rep.ncu-rep"
        "$ncu" --import "$rep.ncu-rep" --page details > "$rep.txt" 2>&1
    else
        echo "$peer: no report ($(tail -1 "$rep.log"))" >> "$summ"
    fi
done
tar -C "$work" -czf "$out/bwd-profile.tar.gz" . 2>/dev/null
cat "$summ"
