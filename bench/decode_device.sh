#!/usr/bin/env bash
# The decode kernel variants of issue 15 (FA4_DECODE_VARIANT, config::decode_gpu::DecodeVariant)
# on the H200, in two device calls, from a folder that bench/decode_device_build.sh filled here
# (binaries, the kernel cache, this script, decode_peers.py). Writes everything under $OUT.
#
#   A (timing, ~2 min): every variant × pages 16/64/256 (seqlen_q 1), page 16 at seqlen_q 4
#     (causal) and page 1, the five shapes, interleaved round by round with cuDNN and FA2
#     (bench/decode_peers.py, 5 rounds): $OUT/peers.log (one line per case: each column's median
#     µs, TB/s and ± half-spread, then each fa4 column / cuDNN), $OUT/peers.json (every round),
#     $OUT/plans.txt (each variant's H200 plan per case, host only), $OUT/gpu.txt.
#   B (correctness, ~3–4 min): tests/cuda_decode.rs with --include-ignored once per variant
#     (FA4_DECODE_VARIANT set; one test proves the variant ran), then compute-sanitizer memcheck
#     on one case per kernel configuration and racecheck on the two all-heads copy paths:
#     $OUT/tests_<variant>.log, $OUT/memcheck_<variant>.log, $OUT/racecheck_<variant>.log,
#     $OUT/summary.txt.
#
# Device call (from the repository root, the folder carried):
#   run(carry=[".device/decodeprep"], timeout_s=300,
#       command="bash .device/decodeprep/decode_device.sh A .device/decodeprep")
# and the same with B. VARIANTS overrides the variant list (comma-separated).
set -uo pipefail
call=${1:?usage: decode_device.sh A|B DIR}
D=${2:?usage: decode_device.sh A|B DIR}
OUT=${OUT:-/tmp/decode_device_out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
# The kernel cache built here (decode_bench --precompile): no NVRTC time on the device.
rm -rf /tmp/fa4cache && mkdir -p /tmp/fa4cache
if [ -f "$D/cache.tar.xz" ]; then tar -xJf "$D/cache.tar.xz" -C /tmp/fa4cache; else cp -r "$D/cache/." /tmp/fa4cache/; fi
export FA4_CACHE_DIR=/tmp/fa4cache
VARIANTS=${VARIANTS:-auto,plain,heads,heads+bulk,best,heads+best,heads4,heads+bulk+best,heads4+bulk}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
t0=$(date +%s)
case $call in
A)
    "$D/decode_bench" --plans "$VARIANTS" > "$OUT/plans.txt" 2>&1 || echo "plans failed (see plans.txt)"
    echo "== peers (variants $VARIANTS)"
    PYTHONUNBUFFERED=1 timeout 270 python3 "$D/decode_peers.py" --fa4 "$D/decode_bench" --rounds 5 \
        --cases 16:1,64:1,256:1,16:4,1:1 --variants "$VARIANTS" --json "$OUT/peers.json" 2>&1 | tee "$OUT/peers.log"
    echo "peers: rc ${PIPESTATUS[0]}, $(($(date +%s) - t0)) s"
    ;;
B)
    bins=/tmp/decodeprep-bins
    rm -rf "$bins" && mkdir -p "$bins" && tar -xJf "$D/bins.tar.xz" -C "$bins"
    : > "$OUT/summary.txt"
    IFS=, read -ra vs <<< "$VARIANTS"
    # Within the call's 300 s: the tests stop starting new variants after 150 s, leaving the
    # sanitizer runs (6 × at most 20 s) their time. List the important variants first.
    for v in "${vs[@]}"; do
        t1=$(date +%s)
        if [ $((t1 - t0)) -gt 150 ]; then
            echo "tests $v: skipped (150 s spent)" | tee -a "$OUT/summary.txt"
            continue
        fi
        # The all-variants test switches variants itself: once (with the default) is enough.
        skip=(--skip every_variant_matches_the_oracle_in_one_process)
        [ "$v" = auto ] && skip=()
        FA4_DECODE_VARIANT=$v timeout 60 "$bins/cuda_decode" --include-ignored "${skip[@]}" > "$OUT/tests_$v.log" 2>&1
        rc=$?
        echo "tests $v: rc $rc, $(grep -h '^test result' "$OUT/tests_$v.log" | tail -1), $(($(date +%s) - t1)) s" | tee -a "$OUT/summary.txt"
    done
    # One case per kernel configuration (best only changes the split count): the planned and
    # forced splits of the issue's layout, 5000 and 777 keys (split + combine kernels).
    for v in plain heads heads4+bulk heads+bulk; do
        FA4_DECODE_VARIANT=$v timeout 20 compute-sanitizer --tool memcheck --error-exitcode 9 \
            "$bins/cuda_decode" --include-ignored --exact the_environments_variant_is_the_one_planned \
            > "$OUT/memcheck_$v.log" 2>&1
        echo "memcheck $v: rc $? $(grep -h 'ERROR SUMMARY' "$OUT/memcheck_$v.log" | tail -1)" | tee -a "$OUT/summary.txt"
    done
    for v in heads heads+bulk; do
        FA4_DECODE_VARIANT=$v timeout 20 compute-sanitizer --tool racecheck --error-exitcode 9 \
            "$bins/cuda_decode" --include-ignored --exact the_environments_variant_is_the_one_planned \
            > "$OUT/racecheck_$v.log" 2>&1
        echo "racecheck $v: rc $? $(grep -h 'RACECHECK SUMMARY\|ERROR SUMMARY' "$OUT/racecheck_$v.log" | tail -1)" | tee -a "$OUT/summary.txt"
    done
    echo "B: $(($(date +%s) - t0)) s" | tee -a "$OUT/summary.txt"
    ;;
*)
    echo "call is A or B, got $call" >&2
    exit 2
    ;;
esac
