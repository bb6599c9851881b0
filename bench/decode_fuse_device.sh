#!/usr/bin/env bash
# The fused combine of split-KV decode (`fuse`, issue 15) on the H200, in one device call of at
# most ~280 s, from a folder that bench/decode_device_build.sh filled here (binaries, the kernel
# cache of the grid's kernels, this script, decode_peers.py). Every step gets what is left of a
# 275 s budget at most, so the call ends in time whatever hangs; everything lands under $OUT and
# is packed into $OUT/decfuse.tar.gz (summary.txt also beside it). The carried cache
# (cache.tar.xz, NVRTC 13.0) holds every kernel below; an NVRTC of another version on the device
# misses it, and step 2 then compiles on all cores what the tests need.
#
#   1. timing (~60–80 s): decode_peers.py, 5 rounds, cases 16:1,256:1,1:1 (the five shapes
#      each), fa4 columns auto, heads+bulk+best+fuse, best+fuse beside cuDNN and FA2:
#      peers.log (medians, TB/s, ± half-spread, each column / cuDNN), peers.json, plans.txt.
#   2. kernel cache (a few s when the carried cache hits, else ≤ 80 s): `decode_bench
#      --precompile` on all cores: every split and all-heads kernel, fused and not, that the
#      tests may plan (cached ones are only read, and a cut-short run still helps):
#      precompile.log.
#   3. tests (≤ 50 s + ≤ 35 s): tests/cuda_decode.rs with --include-ignored under
#      FA4_DECODE_VARIANT=heads+bulk+best+fuse (all tests), then best+fuse (without the
#      all-variants test, which switches variants itself, fuse ones included):
#      tests_<variant>.log.
#   4. sanitizers (≤ 25 s each): compute-sanitizer memcheck and racecheck
#      (--racecheck-report hazard) on the_environments_variant_is_the_one_planned under
#      heads+bulk+best+fuse (2 sequences of 5000 and 777 keys, 32/8 heads: the fused all-heads
#      kernel with bulk copies, several splits), then memcheck under best+fuse (the fused split
#      kernel) if time is left: memcheck_<variant>.log, racecheck_<variant>.log (full logs).
#
# Device call (from the repository root, the folder carried):
#   run(carry=[".device/decfuse"], timeout_s=300,
#       command="bash .device/decfuse/decode_fuse_device.sh .device/decfuse")
set -uo pipefail
D=${1:?usage: decode_fuse_device.sh DIR}
OUT=${OUT:-/tmp/decode_fuse_out}
mkdir -p "$OUT"
BUDGET=${BUDGET:-275}
t0=$(date +%s)
# Seconds left of the budget, at most $1 (never below 1).
left() {
    local l=$((BUDGET - ($(date +%s) - t0)))
    [ "$l" -gt "$1" ] && l=$1
    [ "$l" -lt 1 ] && l=1
    echo "$l"
}
say() { echo "$*" | tee -a "$OUT/summary.txt"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
rm -rf /tmp/fa4cache && mkdir -p /tmp/fa4cache
if [ -f "$D/cache.tar.xz" ]; then tar -xJf "$D/cache.tar.xz" -C /tmp/fa4cache; else cp -r "$D/cache/." /tmp/fa4cache/; fi
export FA4_CACHE_DIR=/tmp/fa4cache
bins=/tmp/decfuse-bins
rm -rf "$bins" && mkdir -p "$bins" && tar -xJf "$D/bins.tar.xz" -C "$bins"
: > "$OUT/summary.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv > "$OUT/gpu.txt" 2>&1
say "gpu: $(tail -1 "$OUT/gpu.txt"); $(nproc) cores; build $(cat "$bins/build.env" | tr '\n' ' ')"
say "setup: $(($(date +%s) - t0)) s"

# 1. Timing first: it needs only the grid's kernels, which the carried cache holds.
VARIANTS=auto,heads+bulk+best+fuse,best+fuse
"$D/decode_bench" --plans "$VARIANTS" > "$OUT/plans.txt" 2>&1 || say "plans failed (see plans.txt)"
t1=$(date +%s)
PYTHONUNBUFFERED=1 timeout "$(left 110)" python3 "$D/decode_peers.py" --fa4 "$D/decode_bench" --rounds 5 \
    --cases 16:1,256:1,1:1 --variants "$VARIANTS" --json "$OUT/peers.json" > "$OUT/peers.log" 2>&1
say "peers: rc $?, $(grep -c '^page' "$OUT/peers.log") of 15 cases, $(($(date +%s) - t1)) s"
grep '^page' "$OUT/peers.log" | sed 's/.*\(page [0-9]* sq [0-9]* b [0-9]* keys [0-9]*\):.*\(vs cudnn:.*\)/\1: \2/' >> "$OUT/summary.txt"

# 2. The tests' kernels, on every core: only what the carried cache lacks is compiled.
t1=$(date +%s)
timeout "$(left 80)" "$D/decode_bench" --precompile > "$OUT/precompile.log" 2>&1
say "precompile: rc $?, $(grep -c ' s$\| s (cached)$' "$OUT/precompile.log") kernels, $(grep -c '(cached)$' "$OUT/precompile.log") cached, $(($(date +%s) - t1)) s"

# 3. The GPU tests under the fused variants.
for v in heads+bulk+best+fuse best+fuse; do
    t1=$(date +%s)
    skip=()
    lim=50
    if [ "$v" = best+fuse ]; then
        skip=(--skip every_variant_matches_the_oracle_in_one_process)
        lim=35
    fi
    FA4_DECODE_VARIANT=$v timeout "$(left $lim)" "$bins/cuda_decode" --include-ignored "${skip[@]}" > "$OUT/tests_$v.log" 2>&1
    say "tests $v: rc $?, $(grep -h '^test result' "$OUT/tests_$v.log" | tail -1), $(($(date +%s) - t1)) s"
    grep -h '^test .* \(ok\|FAILED\)$' "$OUT/tests_$v.log" | sed 's/^/  /' >> "$OUT/summary.txt"
done

# 4. Sanitizers on one fused case (full logs kept).
case_=the_environments_variant_is_the_one_planned
v=heads+bulk+best+fuse
FA4_DECODE_VARIANT=$v timeout "$(left 25)" compute-sanitizer --tool memcheck --error-exitcode 9 \
    "$bins/cuda_decode" --include-ignored --exact "$case_" > "$OUT/memcheck_$v.log" 2>&1
say "memcheck $v: rc $? $(grep -h 'ERROR SUMMARY' "$OUT/memcheck_$v.log" | tail -1)"
FA4_DECODE_VARIANT=$v timeout "$(left 25)" compute-sanitizer --tool racecheck --racecheck-report hazard \
    --error-exitcode 9 "$bins/cuda_decode" --include-ignored --exact "$case_" > "$OUT/racecheck_$v.log" 2>&1
say "racecheck $v: rc $? $(grep -h 'RACECHECK SUMMARY\|ERROR SUMMARY' "$OUT/racecheck_$v.log" | tail -1)"
v=best+fuse
if [ $((BUDGET - ($(date +%s) - t0))) -gt 15 ]; then
    FA4_DECODE_VARIANT=$v timeout "$(left 25)" compute-sanitizer --tool memcheck --error-exitcode 9 \
        "$bins/cuda_decode" --include-ignored --exact "$case_" > "$OUT/memcheck_$v.log" 2>&1
    say "memcheck $v: rc $? $(grep -h 'ERROR SUMMARY' "$OUT/memcheck_$v.log" | tail -1)"
else
    say "memcheck $v: skipped (budget spent)"
fi
say "total: $(($(date +%s) - t0)) s"

# One archive (a call returns at most 8 files), the summary beside it.
tar -czf /tmp/decfuse.tar.gz -C "$OUT" .
find "$OUT" -mindepth 1 -maxdepth 1 ! -name summary.txt -exec rm -rf {} +
mv /tmp/decfuse.tar.gz "$OUT/decfuse.tar.gz"
cat "$OUT/summary.txt"
