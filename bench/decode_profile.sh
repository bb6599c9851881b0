#!/usr/bin/env bash
# Nsight Compute profiles of one decode call, fa4's and cuDNN's (PyTorch SDPA, contiguous cache),
# on the issue's decode shapes (bf16, 32 query / 8 KV heads, d128, seqlen_q 1, page 16): where
# the time of a call goes (each kernel's duration, DRAM bytes and throughput, grid, occupancy,
# stall reasons), to set beside the event-timed TB/s of bench/decode_peers.py.
#   bench/decode_profile.sh DIR     DIR holds decode_bench (and its kernel cache in DIR/cache)
# fa4: `decode_bench --serve` answers one request (one untimed call, then 10); ncu profiles the
# decode and combine kernels of the 2nd and 3rd calls. cuDNN: a Python harness warms up, then
# brackets one call with cudaProfilerStart/Stop (ncu --profile-from-start off), so every kernel
# of that call is profiled, whatever PyTorch launches for it. Both with --cache-control all (L2
# flushed before each kernel: the reads come from DRAM, as with the rotated caches of the
# timing) and --clock-control none (the clocks the timings ran at). DP_SHAPES="B:K ..." picks
# shapes, DP_VARIANTS="auto best ..." fa4's variants, DP_PEER=0 skips cuDNN. Writes under $OUT: decode-profile.txt (one line per kernel) and decode-profile.tar.gz
# (each profile's details page as text and the .ncu-rep reports).
set -uo pipefail
D=${1:?usage: decode_profile.sh DIR}
out=${OUT:-./device-out}; mkdir -p "$out" && out=$(cd "$out" && pwd)
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
if [ -d "$D/cache" ]; then
    rm -rf /tmp/fa4-dprof-cache && cp -r "$D/cache" /tmp/fa4-dprof-cache
    export FA4_CACHE_DIR=/tmp/fa4-dprof-cache
fi
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || ls -d /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
[ -x "$ncu" ] || { echo "decode_profile: no ncu" | tee "$out/decode-profile.txt"; exit 1; }
work=$(mktemp -d /tmp/fa4-dprof.XXXXXX)
budget=${DP_BUDGET:-150}
deadline=$((SECONDS + budget))
cat > "$work/peer.py" <<'EOF'
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
EOF
metrics=gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size,launch__block_size,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active,sm__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct
common=(--cache-control all --clock-control none --set full --metrics "$metrics")
summ=$out/decode-profile.txt
{
    echo "# decode profiles, $(date -u +%FT%TZ), $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
    echo "# lib batch keys kernel duration_us dram_read_MB dram_TB/s(read/duration) dram_%peak grid block regs warps_active_% l2_hit_%"
} > "$summ"
row() { # lib b sk report
    "$ncu" --import "$4" --csv --page raw --metrics "$metrics" 2>/dev/null | python3 -c '
import csv, sys
lib, b, sk = sys.argv[1:4]
rows = list(csv.reader(sys.stdin))
if len(rows) < 3:
    print(lib, b, sk, "no kernels profiled"); sys.exit()
h = rows[0]
def g(r, name):
    try:
        return r[h.index(name)]
    except ValueError:
        return "?"
u = rows[1]  # the units row
SCALE = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6,
         "ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6,
         "byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12}
def num(x):
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return float("nan")
def scaled(r, name):
    i = h.index(name) if name in h else None
    return float("nan") if i is None else num(r[i]) * SCALE.get(u[i], float("nan"))
for r in rows[2:]:
    dur = scaled(r, "gpu__time_duration.sum") * 1e3  # ns
    rd = scaled(r, "dram__bytes_read.sum")            # bytes
    name = g(r, "Kernel Name")[:48]
    print(lib, b, sk, name, f"{dur/1e3:.2f}", f"{rd/1e6:.1f}", f"{rd/dur/1e3:.2f}",
          g(r, "dram__throughput.avg.pct_of_peak_sustained_elapsed"), g(r, "launch__grid_size"),
          g(r, "launch__block_size"), g(r, "launch__registers_per_thread"),
          g(r, "sm__warps_active.avg.pct_of_peak_sustained_active"), g(r, "lts__t_sector_hit_rate.pct"))
' "$1" "$2" "$3" >> "$summ"
}
for s in ${DP_SHAPES:-1:32768 8:8192 8:32768}; do
    b=${s%%:*} sk=${s##*:}
    for v in ${DP_VARIANTS:-auto}; do
        left=$((deadline - SECONDS))
        [ "$left" -lt 15 ] && { echo "skipped $v $s: budget spent" >> "$summ"; continue; }
        rep=$work/fa4-$v-$b-$sk
        echo "16 1 $b $sk 0 random $v" | timeout -k 5 $((left < 60 ? left : 60)) "$ncu" "${common[@]}" \
            --kernel-name regex:'fa4_decode_(heads|splitkv|combine)' --launch-skip 2 --launch-count 4 \
            -f -o "$rep" "$D/decode_bench" --serve > "$rep.log" 2>&1
        [ -f "$rep.ncu-rep" ] && row "fa4:$v" "$b" "$sk" "$rep.ncu-rep" && "$ncu" --import "$rep.ncu-rep" --page details > "$rep.txt" 2>&1
        [ -f "$rep.ncu-rep" ] || echo "fa4 $v $b $sk: no report ($(tail -1 "$rep.log"))" >> "$summ"
    done
    [ "${DP_PEER:-1}" = 0 ] && continue
    left=$((deadline - SECONDS))
    [ "$left" -lt 15 ] && { echo "skipped cudnn $s: budget spent" >> "$summ"; continue; }
    rep=$work/cudnn-$b-$sk
    timeout -k 5 $((left < 60 ? left : 60)) "$ncu" "${common[@]}" --profile-from-start off \
        -f -o "$rep" python3 "$work/peer.py" "$b" "$sk" > "$rep.log" 2>&1
    [ -f "$rep.ncu-rep" ] && row cudnn "$b" "$sk" "$rep.ncu-rep" && "$ncu" --import "$rep.ncu-rep" --page details > "$rep.txt" 2>&1
    [ -f "$rep.ncu-rep" ] || echo "cudnn $b $sk: no report ($(tail -1 "$rep.log"))" >> "$summ"
done
tar -C "$work" -czf "$out/decode-profile.tar.gz" . 2>/dev/null
cat "$summ"
