#!/usr/bin/env bash
# Context parallelism on a multi-GPU machine (nvidia-h200-x2 or larger): the NCCL ring's tests,
# `fa4 run --cp 2` against one GPU and the oracle, and `fa4 bench --cp 2` (scaling against one
# GPU, per-step compute and exchange times) at the issue's targets (bf16 d128, 32 heads, causal,
# 128k and 512k tokens). Nothing of this has run yet: no multi-GPU machine was lent when it was
# written. Run from the repository root with the binaries built on the host and carried in a
# folder (default .device/cp):
#   fa4       target/release/fa4
#   cp_nccl   the tests/cp_nccl.rs binary (`cargo test --release --test cp_nccl --no-run`)
# Usage: bench/cp_device.sh [BIN_DIR] [check|bench|all]   (`check` about 2 min, `bench` up to 9)
# Logs go under $OUT (or ./device-out). NVLink multicast stays off: NCCL_NVLS_ENABLE=0 is forced
# here (the ring uses only send/recv; multicast objects can take the host's GPUs out of service).
set -uo pipefail
bin=${1:-.device/cp}; what=${2:-all}
out=${OUT:-./device-out}; mkdir -p "$out"
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FA4_CACHE_DIR=${FA4_CACHE_DIR:-/tmp/fa4cache}
F=$bin/fa4

gpus=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
echo "GPUs: $gpus; NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE"
if [ "$gpus" -lt 2 ]; then
    echo "this needs 2 or more GPUs (ask for nvidia-h200-x2)"; exit 3
fi

# NCCL: the image's PyTorch ships one (the nvidia-nccl wheel, or inside torch/lib); fa4 looks on
# LD_LIBRARY_PATH and in pip wheel folders itself, FA4_NCCL_LIB makes the choice explicit.
if [ -z "${FA4_NCCL_LIB:-}" ]; then
    FA4_NCCL_LIB=$(python3 -c "
import glob, os
c = []
try:
    import nvidia.nccl
    c += glob.glob(os.path.join(list(nvidia.nccl.__path__)[0], 'lib', 'libnccl.so*'))
except Exception:
    pass
try:
    import torch
    c += glob.glob(os.path.join(os.path.dirname(torch.__file__), 'lib', 'libnccl*.so*'))
except Exception:
    pass
print(c[0] if c else '')
" 2>/dev/null)
    export FA4_NCCL_LIB
fi
echo "FA4_NCCL_LIB=${FA4_NCCL_LIB:-(unset: the dynamic loader path)}"
python3 -c "import torch; print('torch NCCL', torch.cuda.nccl.version())" 2>/dev/null || true

check() {
    timeout 300 "$bin/cp_nccl" --include-ignored --test-threads 1 --nocapture > "$out/cp_nccl.txt" 2>&1
    echo "cp_nccl rc=$?"; grep -E "^test |test result|max\||panicked" "$out/cp_nccl.txt"
    for args in "--causal" "" "--causal --heads-kv 2 --seqlen-q 4093"; do
        # shellcheck disable=SC2086
        timeout 120 "$F" run --backend cuda --cp 2 --seqlen-q 4096 --heads-q 8 --dtype bf16 --check $args \
            > "$out/run-cp2.txt" 2>&1
        echo "fa4 run --cp 2 $args rc=$?"; grep -E "^(cp|check|time)" "$out/run-cp2.txt"
    done
    # Fewer GPUs than ranks: a one-line error naming --cp, exit 2.
    timeout 60 "$F" run --backend cuda --cp $((gpus + 1)) --seqlen-q 1024 > "$out/run-too-many.txt" 2>&1
    echo "fa4 run --cp $((gpus + 1)) rc=$? (want 2): $(cat "$out/run-too-many.txt")"
}

# Host work dominates at 512k (random inputs of 2·10⁹ elements per tensor, drawn twice, and the
# host merge of 1 GB of partials per rank and step), so 512k gets fewer runs and more time.
bench() {
    for cfg in "131072 3 1 200" "524288 2 0 330"; do
        read -r s reps warm limit <<< "$cfg"
        timeout "$limit" "$F" bench --backend cuda --cp 2 --dtype bf16 --causal on --head-dims 128 \
            --seqlens "$s" --heads 32 --reps "$reps" --warmup "$warm" --json > "$out/bench-cp2-$s.json" 2>&1
        echo "fa4 bench --cp 2 seqlen $s rc=$?"; cat "$out/bench-cp2-$s.json"
    done
}

case $what in
    check) check ;;
    bench) bench ;;
    all) check; bench ;;
    *) echo "unknown step $what (check|bench|all)"; exit 2 ;;
esac
