#!/usr/bin/env bash
# The Hopper forward's three switches of issue 14 (longest-first tile order, TMA-store epilogue,
# cross-tile overlap), measured and checked on the GPU machine. Binaries come from
# bench/device_build.sh run on the host; `bench/fwd_device.sh pack DEST` (host) then copies this
# script and bench/sweep.py beside them, so the device call needs nothing but DEST:
#   host:   bench/device_build.sh /work/main/.device/fwdprep && bench/fwd_device.sh pack /work/main/.device/fwdprep
#   device: bash .device/fwdprep/fwd_device.sh .device/fwdprep sweep "64 128"   (carry [".device/fwdprep"])
#           bash .device/fwdprep/fwd_device.sh .device/fwdprep sweep 256
#           bash .device/fwdprep/fwd_device.sh .device/fwdprep matrix
#           bash .device/fwdprep/fwd_device.sh .device/fwdprep sanitize
# Phases (each fits one device call of at most 300 s under its own budget, sweep as split
# below; `all` runs everything in one call of up to 600 s, past the 300 s asked for):
#   sweep [DIMS]  bench/sweep.py, 3 interleaved rounds × 10 reps, the six grid shapes of each
#          head dim in DIMS (default "64 128 256"; bf16, 16k tokens, hidden 2048): the planner,
#          the persistent base tiles the switches start from, each switch alone, and all of them
#          together. First a parallel warm-up compiles the variants (30–60 s), then 3 rounds of
#          6–7 bench runs a head dim, each ~3–5 s (six shapes' random inputs are made on the host,
#          16k × 2048 × 3 values a shape). About 90–130 s a head dim: `sweep "64 128"` and
#          `sweep 256` fit a 300 s call each; all three in one call would pass it.
#          FA4_FWD_BUDGET (default 290) cuts a phase; sweep.py prints each run as it goes.
#   matrix the CUDA matrix with each switch on (tests/cuda_matrix.rs: hopper_switch_* for the
#          three and their combination, each compiling its ~48 variants in parallel and running
#          the ~70 Hopper cases; persistent_launch_equals_one_cta_per_tile, which walks hundreds
#          of tiles per CTA with them and compares bit for bit). Estimated 150–250 s (the
#          switch tests took 10–30 s each after their compiles in earlier sessions).
#   sanitize compute-sanitizer memcheck, racecheck and synccheck on one small problem per
#          switch (d128, seqlen 300, causal, 384 tiles: persistent CTAs walk 2–3 tiles each, and
#          the last query block is partial so the TMA store clips). 4 × 3 runs of a few seconds
#          to ~30 s (racecheck is the slowest). Estimated 60–200 s.
# Writes under $OUT (or ./device-out): sweep-DIMS.txt, sweep-DIMS.json; matrix-tests.txt, sanitize-*.txt and
# summary.tsv (one line a step: name, pass/FAIL/TIMEOUT, seconds). Exit 0 when all passed.
set -uo pipefail
if [ "${1:-}" = pack ]; then
    dest=${2:?pack DEST}
    here=$(dirname "$0")
    cp "$here/fwd_device.sh" "$here/sweep.py" "$dest/" && chmod +x "$dest/fwd_device.sh"
    echo "packed fwd_device.sh and sweep.py into $dest ($(du -sh "$dest" | cut -f1))"
    exit 0
fi
bin=${1:?BIN_DIR (from bench/device_build.sh)}
phase=${2:-all}
dims=${3:-64 128 256}
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-./device-out}
mkdir -p "$out" && out=$(cd "$out" && pwd)
export OUT=$out  # sweep.py writes sweep.json there
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export FA4_CACHE_DIR=${FA4_CACHE_DIR:-/tmp/fa4-fwdprep-cache}
export PYTHONUNBUFFERED=1
t_start=$(date +%s)
budget=${FA4_FWD_BUDGET:-290}
[ "$phase" = all ] && budget=${FA4_FWD_BUDGET:-590}
left() {
    local cap=$1 rest=$((budget - ($(date +%s) - t_start)))
    [ "$rest" -lt "$cap" ] && cap=$rest
    [ "$cap" -lt 1 ] && cap=1
    echo "$cap"
}
step() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" | tee -a "$out/summary.tsv"; }

# The binaries, unpacked once per machine.
work=/tmp/fa4-fwdprep-bins
if [ ! -x "$work/fa4" ]; then
    rm -rf "$work" && mkdir -p "$work"
    tar -C "$work" -xJf "$bin/bins.tar.xz" 2>/dev/null ||
        python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$bin/bins.tar.xz" "$work" ||
        { echo "fwd_device: cannot unpack $bin/bins.tar.xz" >&2; exit 1; }
fi
F=$work/fa4
BUILD_ROOT=$PWD BUILD_COMMIT=unknown
[ -f "$work/build.env" ] && . "$work/build.env"
# Tests find the CLI and the crate's files at the build machine's paths (as device_final.sh).
if [ "$BUILD_ROOT" != "$PWD" ] && [ ! -e "$BUILD_ROOT" ]; then
    mkdir -p "$(dirname "$BUILD_ROOT")" && ln -s "$PWD" "$BUILD_ROOT"
fi
if [ ! -d "$BUILD_ROOT/target/release/.fingerprint" ]; then
    mkdir -p "$BUILD_ROOT/target/release" && cp -f "$F" "$BUILD_ROOT/target/release/fa4"
fi
echo "fwd_device: build $BUILD_COMMIT, phase $phase, budget ${budget}s, out $out"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv,noheader 2>&1 | head -2

# --sm90-tiles strings: block_n,wgs,stages,preg,creg,lazy,overlap,pingpong,persistent,poly,
# longest_first,tma_store,cross_tile. The base is the planner's 1k tiles of each head dim,
# persistent at every length (the switches act on persistent walks); 4k/16k therefore compare
# against a base that is not the planner's there (d64: 3 warpgroups; d128: 176-key blocks).
# d64: the overlap (off in its plan) is needed by the cross-tile overlap, so `ov` isolates it.
# d256 (one Q slot) cannot combine the TMA store with the cross-tile overlap: `all` leaves the
# store out there.
sweep_variants=(
    plan@64=plan
    base@64=128,2,2,40,232,0,0,0,1,0,0,0,0
    ov@64=128,2,2,40,232,0,1,0,1,0,0,0,0
    lf@64=128,2,2,40,232,0,0,0,1,0,1,0,0
    tma@64=128,2,2,40,232,0,0,0,1,0,0,1,0
    cross@64=128,2,2,40,232,0,1,0,1,0,0,0,1
    all@64=128,2,2,40,232,0,1,0,1,0,1,1,1
    plan@128=plan
    base@128=128,2,2,40,232,0,1,0,1,0,0,0,0
    lf@128=128,2,2,40,232,0,1,0,1,0,1,0,0
    tma@128=128,2,2,40,232,0,1,0,1,0,0,1,0
    cross@128=128,2,2,40,232,0,1,0,1,0,0,0,1
    all@128=128,2,2,40,232,0,1,0,1,0,1,1,1
    plan@256=plan
    base@256=80,2,2,40,232,0,1,0,1,0,0,0,0
    lf@256=80,2,2,40,232,0,1,0,1,0,1,0,0
    tma@256=80,2,2,40,232,0,1,0,1,0,0,1,0
    cross@256=80,2,2,40,232,0,1,0,1,0,0,0,1
    all@256=80,2,2,40,232,0,1,0,1,0,1,0,1
)

# The variants of the head dims in $dims (the third argument; default all three).
sweep() {
    local t0 rc v d picked=() tag
    t0=$(date +%s)
    for v in "${sweep_variants[@]}"; do
        d=${v%%=*} d=${d#*@}
        case " $dims " in *" $d "*) picked+=("$v") ;; esac
    done
    tag=$(echo "$dims" | tr ' ' '-')
    timeout -k 5 "$(left 290)" python3 "$here/sweep.py" --fa4 "$F" --rounds "${FA4_FWD_ROUNDS:-3}" \
        --reps "${FA4_FWD_REPS:-10}" --warm 16 "${picked[@]}" 2>&1 | tee "$out/sweep-$tag.txt"
    rc=${PIPESTATUS[0]}
    [ -f "$out/sweep.json" ] && mv "$out/sweep.json" "$out/sweep-$tag.json"
    step "sweep $dims" "$([ "$rc" -eq 0 ] && echo pass || echo "FAIL rc $rc")" $(($(date +%s) - t0))
}

# One problem per switch under each sanitizer tool: d128, 64 sequences of 300 (3 query blocks,
# the last partial) × 2 heads, causal: 384 tiles on 132 persistent CTAs.
san_tiles=(
    lf=128,2,2,40,232,0,1,0,1,0,1,0,0
    tma=128,2,2,40,232,0,1,0,1,0,0,1,0
    cross=128,2,2,40,232,0,1,0,1,0,0,0,1
    all=128,2,2,40,232,0,1,1,1,0,1,1,1
)

matrix() {
    local t0 rc
    t0=$(date +%s)
    timeout -k 5 "$(left 285)" "$work/cuda_matrix" --include-ignored --test-threads 4 \
        hopper_switch_longest_first hopper_switch_tma_store hopper_switch_cross_tile \
        persistent_launch_equals_one_cta_per_tile > "$out/matrix-tests.txt" 2>&1
    rc=$?
    grep -E '^test |^test result:|hopper kernel \(|compiled' "$out/matrix-tests.txt"
    step matrix "$([ "$rc" -eq 0 ] && echo pass || echo "FAIL rc $rc")" $(($(date +%s) - t0))
}

sanitize() {
    local t0 rc name tiles tool log cs
    cs=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
    for nt in "${san_tiles[@]}"; do
        name=${nt%%=*} tiles=${nt#*=}
        args=(bench --backend cuda --kernel sm90 --dtype bf16 --tokens 19200 --hidden 256 --grid 128,300,1
            --warmup 0 --reps 1 --calls 1 --sm90-tiles "$tiles")
        # Compiled outside the sanitizer (and a failure here is the switch's, not the tool's).
        timeout -k 5 "$(left 60)" "$F" "${args[@]}" > "$out/sanitize-$name-plain.txt" 2>&1 ||
            { step "sanitize $name" "FAIL plain run" 0; continue; }
        for tool in memcheck racecheck synccheck; do
            t0=$(date +%s) log="$out/sanitize-$name-$tool.txt"
            timeout -k 5 "$(left 60)" "$cs" --tool "$tool" --error-exitcode 9 "$F" "${args[@]}" > "$log" 2>&1
            rc=$?
            step "sanitize $name $tool" "$([ "$rc" -eq 0 ] && echo pass || echo "FAIL rc $rc: $(grep -m1 -E 'ERROR|Error|error' "$log")")" \
                $(($(date +%s) - t0))
        done
    done
}

rm -f "$out/summary.tsv"
case $phase in
    sweep) sweep ;;
    matrix) matrix ;;
    sanitize) sanitize ;;
    all) sweep && matrix && sanitize ;;
    *) echo "fwd_device: phase must be sweep, matrix, sanitize or all" >&2; exit 2 ;;
esac
echo "fwd_device: $(($(date +%s) - t_start)) s"
! grep -q -v -P '\tpass\t' "$out/summary.tsv"
