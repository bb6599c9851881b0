#!/usr/bin/env bash
# The Hopper backward's first GPU check, in one device call of at most ~300 s on an H200:
#   1. its GPU tests (tests/cuda_backward.rs, names containing `hopper`): the gradient matrix
#      with the Hopper kernel forced, long problems against the rule beside the Ampere-class
#      backward, the refusals, the small sanitizer case;
#   2. compute-sanitizer memcheck, racecheck and synccheck on `fa4 run --backward` of small
#      problems with FA4_BWD_KERNEL=sm90 (d64 causal GQA, d128 window softcap, and three where
#      CTAs walk more trips than the ring has stages: d64 causal and non-causal, d128 causal GQA);
#   3. bench/bwd_grid.py on the d64/d128 shapes, fa4 with FA4_BWD_KERNEL=sm90 (column `fa4`)
#      and =sm80 (column `alt`), cuDNN and FlashAttention-2 interleaved (bf16, 16k tokens,
#      hidden 2048).
# Binaries come from bench/device_build.sh DIR (every test binary and the CLI, packed) plus
# `bwd_bench` (the example bwd_grid.py drives) and bwd_grid.py copied beside them, here:
#   run carry [".device/hopperbwd"], command
#   bash .device/hopperbwd/hopper_bwd_device.sh .device/hopperbwd
# HB_GRID=0 skips the grid; HB_GRID_SECS caps it (default 150). HB_BINS="NAME=PATH ..." adds
# other builds' bwd_bench to the grid's interleaved rounds (an A/B of kernel changes; paths
# relative to DIR); HB_ALT=0 drops the Ampere-class column. HB_SAN_CTAS=N runs the sanitized
# problems with N persistent CTAs (FA4_BWD_SM90_CTAS), so that each walks several tiles.
# Logs and a summary under $OUT. Each step runs under `timeout`, cut to what is left of
# HB_BUDGET seconds (default 290), so a hang (a wrong mbarrier phase would hang the kernel)
# costs its step, not the call; a hang shows as TIMEOUT in the summary.
# What to look at: $OUT/summary.tsv (pass/FAIL per step), $OUT/tests.txt (failing cases print
# the first bad index and the error statistics), $OUT/sanitize-*.txt, $OUT/grid.txt (TFLOP/s).
set -uo pipefail
bin=${1:-$(dirname "$0")}
out=${OUT:-./device-out}
mkdir -p "$out"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export FA4_CACHE_DIR=${FA4_CACHE_DIR:-/tmp/fa4-hopperbwd-cache}
unset FA4_BWD_KERNEL FA4_KERNEL FA4_BWD_TILES
t_start=$(date +%s)
budget=${HB_BUDGET:-290}
left() {
    local cap=$1 rest=$((budget - ($(date +%s) - t_start)))
    [ "$rest" -lt "$cap" ] && cap=$rest
    [ "$cap" -lt 1 ] && cap=1
    echo "$cap"
}
summary=$out/summary.tsv
: > "$summary"
note() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >> "$summary"; }

work=$bin
if [ -f "$bin/bins.tar.xz" ]; then
    work=/tmp/fa4-hopperbwd-bins
    rm -rf "$work" && mkdir -p "$work"
    tar -C "$work" -xJf "$bin/bins.tar.xz" 2>/dev/null ||
        python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$bin/bins.tar.xz" "$work" ||
        { echo "hopper_bwd_device: cannot unpack $bin/bins.tar.xz" >&2; exit 1; }
fi
F=$work/fa4
T=$work/cuda_backward
for x in "$F" "$T" "$bin/bwd_bench"; do
    [ -x "$x" ] || { echo "hopper_bwd_device: $x missing" >&2; exit 1; }
done
BUILD_ROOT=$PWD BUILD_COMMIT=unknown
[ -f "$work/build.env" ] && . "$work/build.env"
if [ "$BUILD_ROOT" != "$PWD" ] && [ ! -e "$BUILD_ROOT" ]; then
    mkdir -p "$(dirname "$BUILD_ROOT")" && ln -s "$PWD" "$BUILD_ROOT"
fi
echo "hopper_bwd_device: build $BUILD_COMMIT, budget ${budget}s, logs in $out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -2

# 1. The tests (about 100 s: NVRTC compiles the 16 variants on first use, then the matrix and
#    the long problems, whose f64 oracle runs on the CPU).
t0=$(date +%s)
timeout -k 5 "$(left 160)" "$T" --include-ignored --test-threads 4 hopper > "$out/tests.txt" 2>&1
rc=$? secs=$(($(date +%s) - t0))
res=$(grep -E '^test result:' "$out/tests.txt" | tail -1 | sed 's/; finished in.*//')
failed=$(sed -n 's/^test \(.*\) \.\.\. FAILED$/\1/p' "$out/tests.txt" | tr '\n' ' ')
case $rc in
0) note tests pass "$secs" "$res" ;;
124 | 137) note tests TIMEOUT "$secs" "last: $(grep -E '^test ' "$out/tests.txt" | tail -1)" ;;
*) note tests FAIL "$secs" "rc $rc; $res; failed: $failed" ;;
esac

# 2. The sanitizers, on the CLI (a plain run first, which also compiles into the cache).
cs=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
for case in \
    "d64|--dtype bf16 --batch 2 --seqlen-q 150 --seqlen-k 190 --heads-q 4 --heads-kv 2 --head-dim 64 --causal" \
    "d128|--dtype fp16 --batch 1 --seqlen-q 150 --seqlen-k 190 --heads-q 2 --heads-kv 1 --head-dim 128 --window 40,10 --softcap 8" \
    "d64-causal-200|--dtype bf16 --batch 1 --seqlen-q 200 --seqlen-k 200 --heads-q 2 --heads-kv 2 --head-dim 64 --causal" \
    "d64-256|--dtype bf16 --batch 1 --seqlen-q 256 --seqlen-k 256 --heads-q 2 --heads-kv 2 --head-dim 64" \
    "d128-causal-gqa-200|--dtype bf16 --batch 1 --seqlen-q 200 --seqlen-k 200 --heads-q 2 --heads-kv 1 --head-dim 128 --causal"; do
    name=${case%%|*} args="run --backend cuda --backward ${case#*|}"
    t0=$(date +%s)
    FA4_BWD_KERNEL=sm90 timeout -k 5 "$(left 40)" "$F" $args > "$out/sanitize-$name-plain.txt" 2>&1
    rc=$? secs=$(($(date +%s) - t0))
    if [ "$rc" -ne 0 ]; then
        note "sanitize $name plain" FAIL "$secs" "rc $rc: $(tail -1 "$out/sanitize-$name-plain.txt" | cut -c1-160)"
        continue
    fi
    note "sanitize $name plain" pass "$secs" "$(tail -1 "$out/sanitize-$name-plain.txt" | cut -c1-160)"
    for tool in memcheck racecheck synccheck; do
        log=$out/sanitize-$name-$tool.txt t0=$(date +%s)
        [ -n "$cs" ] || { note "sanitize $name $tool" FAIL 0 "compute-sanitizer not found"; continue; }
        extra=()
        [ "$tool" = racecheck ] && extra=(--racecheck-report hazard)  # every hazard, not a summary
        env FA4_BWD_KERNEL=sm90 ${HB_SAN_CTAS:+FA4_BWD_SM90_CTAS=$HB_SAN_CTAS} timeout -k 5 "$(left 40)" "$cs" --tool "$tool" "${extra[@]}" --error-exitcode 3 "$F" $args > "$log" 2>&1
        rc=$? secs=$(($(date +%s) - t0))
        summ=$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1)
        case $rc in
        0) note "sanitize $name $tool" pass "$secs" "$summ" ;;
        124 | 137) note "sanitize $name $tool" TIMEOUT "$secs" "$summ" ;;
        *) note "sanitize $name $tool" FAIL "$secs" "rc $rc; $summ" ;;
        esac
    done
done

# 3. The grid: d64 and d128 (the Hopper kernel's head dims), 4k and 16k tokens, causal or not.
shapes=${HB_SHAPES:-"64,4096,0 64,4096,1 64,16384,0 64,16384,1 128,4096,0 128,4096,1 128,16384,0 128,16384,1"}
t0=$(date +%s)
cp "$bin/bwd_grid.py" "$out/bwd_grid.py" 2>/dev/null
if [ "${HB_GRID:-1}" = 0 ]; then
    echo "--- summary"
    column -t -s $'\t' "$summary" 2>/dev/null || cat "$summary"
    ! grep -q -P '\t(FAIL|TIMEOUT)\t' "$summary"
    exit
fi
grid_args=()
[ "${HB_ALT:-1}" = 0 ] || grid_args+=(--alt-env FA4_BWD_KERNEL=sm80)
for b in ${HB_BINS:-}; do grid_args+=(--bin "${b%%=*}=$bin/${b#*=}"); done
FA4_BWD_KERNEL=sm90 OUT=$out timeout -k 5 "$(left "${HB_GRID_SECS:-150}")" python3 "$bin/bwd_grid.py" --fa4 "$bin/bwd_bench" \
    "${grid_args[@]}" --calls 10 --rounds 5 --shapes $shapes > "$out/grid.txt" 2>&1
rc=$? secs=$(($(date +%s) - t0))
case $rc in
0) note grid pass "$secs" "$(wc -l < "$out/grid.txt") lines" ;;
124 | 137) note grid TIMEOUT "$secs" "$(tail -1 "$out/grid.txt" | cut -c1-160)" ;;
*) note grid FAIL "$secs" "rc $rc: $(tail -1 "$out/grid.txt" | cut -c1-160)" ;;
esac

echo "--- summary"
column -t -s $'\t' "$summary" 2>/dev/null || cat "$summary"
echo "--- grid"
cat "$out/grid.txt"
! grep -q -P '\t(FAIL|TIMEOUT)\t' "$summary"
