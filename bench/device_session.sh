#!/usr/bin/env bash
# Device calls that re-verify the CUDA backend and measure it beside its peers, as the H200
# entries of docs/perf.md were produced. Run on the GPU machine from the repository root, with
# the binaries built on the host and carried in a folder (default .device/):
#   fa4            target/release/fa4 (stripped)
#   cuda_matrix    the tests/cuda_matrix.rs binary (`cargo test --release --no-run` prints it)
# Usage: bench/device_session.sh [BIN_DIR] [check|grid|ablation|all|fa4-stage DIR_A|fa4-install DIR_B]
# `check`, `grid` and `ablation` take up to about 6, 4 and 4 minutes: one or two per device call
# (`all` needs a call without the 10-minute limit). FlashAttention-4 (CuTe) as a peer: its wheels
# (../shared/tools/fa4cute-wheels.sh DIR_A DIR_B) travel in two calls, `fa4-stage DIR_A` then,
# while the machine is still held (it is given back after 30 s idle), `fa4-install DIR_B` with
# the grid after it in the same call, e.g. `... fa4-install .fa4cute-b && ... grid`: grid.py
# finds FA4 through the PYTHONPATH this sets.
# Writes logs under $OUT (or ./device-out); every step has a timeout so a hang cannot eat the
# session.
set -uo pipefail
bin=${1:-.device}; what=${2:-all}
out=${OUT:-./device-out}; mkdir -p "$out"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FA4_CACHE_DIR=${FA4_CACHE_DIR:-/tmp/fa4cache}
F=$bin/fa4
here=$(dirname "$0")

check() {
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
    timeout 330 "$bin/cuda_matrix" --test-threads 1 > "$out/matrix.txt" 2>&1
    echo "cuda_matrix rc=$?"; grep -E "^test |test result" "$out/matrix.txt"
    for k in sm80 auto; do
        timeout 120 "$F" check --backend cuda --kernel $k --dtype bf16,fp16 > "$out/check-$k.txt" 2>&1
        echo "fa4 check --kernel $k rc=$? ($(tail -1 "$out/check-$k.txt"))"
    done
    timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 "$F" check --backend cuda \
        --dtype bf16,fp16 --head-dim 64,128,256 > "$out/memcheck.txt" 2>&1
    echo "memcheck rc=$?"; grep -E "ERROR SUMMARY" "$out/memcheck.txt"
    for d in 64 128 256; do
        timeout 120 compute-sanitizer --tool racecheck --error-exitcode 9 "$F" check --backend cuda \
            --dtype bf16 --head-dim $d > "$out/racecheck-$d.txt" 2>&1
        echo "racecheck d$d rc=$?"; grep -E "RACECHECK SUMMARY" "$out/racecheck-$d.txt"
    done
    timeout 100 compute-sanitizer --tool synccheck --error-exitcode 9 "$F" check --backend cuda \
        --dtype fp16 --head-dim 128,256 > "$out/synccheck.txt" 2>&1
    echo "synccheck rc=$?"; grep -E "ERROR SUMMARY" "$out/synccheck.txt"
}

# The default dispatch and the Ampere-class kernel beside FA2, cuDNN and (when installed) FA4.
grid() {
    PYTHONUNBUFFERED=1 timeout 330 python3 "$here/grid.py" --fa4 "$F" --variant sm80="--kernel sm80" 2>&1 |
        tee "$out/grid.txt" | grep -v '^\$'
}

# The Hopper kernel's planner switches on the planner's tiles, one at a time and together, on
# the grid (bf16, TFLOP/s per shape: 1k, 1k causal, 4k, 4k causal, 16k, 16k causal). Each
# variant passes its matrix cases first. Switches: lazy_rescale,intra_wg_overlap,pingpong,
# persistent,poly_exp2 (ping-pong and the overlap need two consumer warpgroups: d64 plans three,
# so its lines with them report the planner's error). bench/sweep.py compares whole tile variants.
ablation() {
    for d in 64 128 256; do
        base=$("$F" plan --arch sm90 --depth $d --json | python3 -c "import json,sys; t=json.load(sys.stdin)['tiles']; print(','.join(str(t[k]) for k in ('block_n','consumer_wgs','stages','producer_regs','consumer_regs')))")
        for f in 0,0,0,0,0 0,1,0,0,0 0,0,0,1,0 0,1,0,1,0 0,1,1,1,0 1,1,0,1,0 0,1,0,1,1 0,1,0,1,2; do
            t=$base,$f
            c=$(timeout 60 "$F" check --backend cuda --kernel sm90 --sm90-tiles $t --dtype bf16 --head-dim $d 2>&1 | tail -1)
            r=$(timeout 60 "$F" bench --backend cuda --kernel sm90 --sm90-tiles $t --json --reps 20 --dtype bf16 \
                --grid $d,1024,0 $d,1024,1 $d,4096,0 $d,4096,1 $d,16384,0 $d,16384,1 2>&1 |
                python3 -c "import json,sys; print(' '.join('%.0f' % r['tflops'] for r in json.load(sys.stdin)))" 2>&1)
            echo "d$d lazy,overlap,pingpong,persistent,poly=$f | $c | $r"
        done
    done | tee "$out/ablation.txt"
}

stage=/root/stage
fa4_stage() {
    mkdir -p $stage && cp "$1"/part.aa $stage/ && echo "staged $(du -sh $stage | cut -f1)"
}
fa4_install() {
    cat $stage/part.aa "$1"/part.ab > $stage/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl &&
        cp "$1"/*.whl $stage/ &&
        python3 -m pip install -q --no-index --no-deps --target /tmp/site $stage/*.whl > "$out/pip.txt" 2>&1
    echo "pip rc=$?"
}
# Where fa4-install put FlashAttention-4 (harmless when absent).
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}

case $what in
    check) check ;;
    grid) grid ;;
    ablation) ablation ;;
    all) check; grid; ablation ;;
    fa4-stage) fa4_stage "${3:?DIR_A}" ;;
    fa4-install) fa4_install "${3:?DIR_B}" ;;
    *) echo "usage: $0 [BIN_DIR] [check|grid|ablation|all|fa4-stage DIR_A|fa4-install DIR_B]" >&2; exit 2 ;;
esac
