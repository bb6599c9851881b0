#!/usr/bin/env bash
# The fair grid on the GPU machine (docs/perf.md, "fair grid"): fa4 and its peers timed the same
# way by bench/grid.py, and kernel-only durations under Nsight Compute for a few shapes.
# Run from the repository root with the fa4 binary built on the host in BIN_DIR:
#   bench/fair_grid.sh BIN_DIR timed [grid.py flags]   interleaved event-timed rounds (~4 min with --extra)
#   bench/fair_grid.sh BIN_DIR ncu                     kernel-only durations, NCU_SHAPES (~1-2 min)
#   bench/fair_grid.sh BIN_DIR fa4-stage DIR_A | fa4-install DIR_B   FlashAttention-4 (CuTe) wheels,
#       as bench/device_session.sh (two calls on one held machine; grid.py finds it through PYTHONPATH)
# ncu: only gpu__time_duration.sum (one pass per kernel), --cache-control all (L2 flushed before
# every profiled kernel), --clock-control none for every library: the workplace does not let us
# lock clocks, so each kernel runs at the clocks the GPU picks, the same rule for all. fa4's
# kernels come from `fa4 bench --warmup 1 --reps 3 --calls 1` (7 launches a shape, the first left
# out); the peers' from `grid.py --ncu-peers` (3 calls a library and shape after warm-ups, each
# followed by a spin_kernel marker). Writes under $OUT (or ./device-out): grid.txt, grid.json,
# grid.md; ncu.md, ncu.json, ncu-raw.tar.gz.
set -uo pipefail
bin=${1:?BIN_DIR}; what=${2:?timed|ncu|fa4-stage|fa4-install}
shift 2
out=${OUT:-./device-out}; mkdir -p "$out" && out=$(cd "$out" && pwd)
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} FA4_CACHE_DIR=${FA4_CACHE_DIR:-/tmp/fa4cache}
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
here=$(dirname "$0")
F=$bin/fa4
read -r -a ncu_shapes <<< "${NCU_SHAPES:-64,1024,1 128,1024,0 128,16384,0 256,1024,0 256,16384,1}"

timed() {
    timeout 400 python3 "$here/grid.py" --fa4 "$F" "$@" 2>&1 | tee "$out/grid.txt" | grep -v '^\$'
}

ncu_run() {
    local ncu work
    ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
    work=$(mktemp -d /tmp/fa4-ncu.XXXXXX)
    common=(--metrics gpu__time_duration.sum --clock-control none --cache-control all --force-overwrite)
    # Compile outside the profiler.
    timeout 120 "$F" bench --backend cuda --dtype bf16 --warmup 1 --reps 1 --calls 1 --grid "${ncu_shapes[@]}" > "$work/compile.txt" 2>&1
    timeout 100 "$ncu" "${common[@]}" --kernel-name-base function -k regex:fa4_fwd --export "$work/fa4" \
        "$F" bench --backend cuda --dtype bf16 --warmup 1 --reps 3 --calls 1 --grid "${ncu_shapes[@]}" > "$work/fa4.log" 2>&1
    echo "ncu fa4 rc=$?"
    timeout 150 "$ncu" "${common[@]}" --profile-from-start off --target-processes all --export "$work/peers" \
        python3 "$here/grid.py" --ncu-peers "$work/labels.json" --shapes "${ncu_shapes[@]}" > "$work/peers.log" 2>&1
    echo "ncu peers rc=$?"
    for n in fa4 peers; do
        timeout 60 "$ncu" --import "$work/$n.ncu-rep" --csv --page raw --print-units base \
            --print-kernel-base function > "$work/$n.csv" 2> "$work/$n.import.log"
    done
    grep -hE '==(ERROR|WARNING)==' "$work"/*.log | sort | uniq -c | head
    OUT=$out timeout 60 python3 "$here/grid.py" --ncu-table "$work/fa4.csv" "$work/peers.csv" "$work/labels.json" \
        --shapes "${ncu_shapes[@]}"
    (cd "$work" && tar -czf "$out/ncu-raw.tar.gz" -- *.csv *.log labels.json)
}

stage=/root/stage
case $what in
    timed) timed "$@" ;;
    ncu) ncu_run ;;
    fa4-stage) mkdir -p $stage && cp "${1:?DIR_A}"/part.aa $stage/ && echo "staged $(du -sh $stage | cut -f1)" ;;
    fa4-install)
        if [ ! -f $stage/part.aa ]; then echo "fa4-install: nothing staged (a fresh machine?)"; else
            cat $stage/part.aa "${1:?DIR_B}"/part.ab > $stage/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl &&
                cp "$1"/*.whl $stage/ &&
                python3 -m pip install -q --no-index --no-deps --target /tmp/site $stage/*.whl > "$out/pip.txt" 2>&1
            echo "pip rc=$?"
        fi ;;
    *) echo "usage: $0 BIN_DIR timed|ncu|fa4-stage DIR_A|fa4-install DIR_B" >&2; exit 2 ;;
esac
