#!/usr/bin/env bash
# The GPU check of a build on the GPU machine: every test binary with --include-ignored, and
# compute-sanitizer on each kernel family. The binaries come from bench/device_build.sh, run on
# the host (an archive, bins.tar.xz, and where built the decode kernel cache, cache.tar.xz):
#   bash bench/device_check.sh DIR [SECTION ...]     (from the repository root; DIR carried)
# Sections (default `tests sanitize`, which run at once in three lanes: GPU test binaries one
# after another, CPU-only test binaries niced, and the sanitizers; the others run after them):
#   tests     every test binary with --include-ignored, each under a timeout, GPU binaries with
#             FA4_GPU_TEST_THREADS tests at once (4), CPU ones with FA4_CPU_TEST_THREADS (8).
#             About 300 s on an H200 (cuda_matrix is the longest: its switch tests compile
#             their variants first).
#   sanitize  memcheck, racecheck (--racecheck-report hazard: every hazard printed, not only a
#             count) and synccheck on the cases of FA4_CHECK_FAMILIES (below); each case first
#             runs plainly, so that a family this build lacks is reported, not sanitized.
#   decode    tests/cuda_decode.rs once per FA4_DECODE_VARIANT value in FA4_CHECK_DECODE_VARIANTS
#             (one of its tests proves the variant ran), then memcheck and racecheck on the
#             planned-variant test (the issue's layout, planned and forced splits) per variant
#             in FA4_CHECK_DECODE_MEMCHECK / FA4_CHECK_DECODE_RACECHECK. About 150–200 s.
#   decode-fp8  the same for the fp8-cache kernels: tests/cuda_decode_fp8.rs once per variant in
#             FA4_CHECK_DECODE_FP8_VARIANTS (the all-variants test under `auto` only), then
#             memcheck and racecheck on its environment-variant test (planned and forced splits)
#             per variant in FA4_CHECK_DECODE_FP8_MEMCHECK / FA4_CHECK_DECODE_FP8_RACECHECK.
#   cp        2+ GPUs (nvidia-h200-x2): the NCCL ring's tests (tests/cp_nccl.rs), `fa4 run --cp 2`
#             against the oracle, and the one-line error for more ranks than GPUs; NVLink
#             multicast off (NCCL_NVLS_ENABLE=0). About 2 min.
# Every step runs under `timeout`, cut to what is left of FA4_CHECK_BUDGET seconds (default 400,
# for a device call of 420 s), so that a hang (a wrong mbarrier phase hangs a kernel) costs its
# step, not the call. Logs under $OUT (default ./device-out): tests/, sanitize/, decode/, cp/,
# and summary.txt, one line per step (pass / FAIL / TIMEOUT / skipped, seconds, what it said).
# Exit status 0 when every step passed or was skipped, else 1.
#
# Selection (environment):
#   FA4_CHECK_TESTS      test binaries to run (archive names, e.g. `cuda_matrix cuda_decode`;
#                        default all; `none`)
#   FA4_CHECK_FILTER     libtest filter words for every binary (e.g. `hopper`); default none
#   FA4_CHECK_SKIP       tests skipped (libtest --skip, substring); default: those whose hardware
#                        this is not (the SM100 kernel, the NCCL ring on 2 GPUs), the SASS dump
#                        (a tool: FA4_SASS_DUMP_DIR, bench/sass_diff.sh) and a microbenchmark
#   FA4_CHECK_KNOWN      tests whose failure is a documented known limit: reported, not counted
#   FA4_CHECK_FAMILIES   sanitized families (default `sm80 sm90 decode backward`; also
#                        `decode-fp8`: `fa4 run --paged --kv-dtype fp8`, the all-heads kernel with
#                        bulk copies (auto) and the split kernel (plain, causal, fp16 and
#                        bf16 queries: the bf16 form writes its rows' factors into the ring);
#                        `bwd-sm90`: eleven Hopper backward problems, nine of them walking more
#                        steps than the ring has stages, three at head dims narrower than the
#                        tiles, three in the shared-keys form (d256, d192, 192/128), two with V
#                        narrower than Q (192/128, 128/64); `bwd-sm90-det`: its deterministic
#                        mode on five (d64 GQA causal, d128 window softcap, d96, d256 GQA
#                        causal, 192/128 causal), on 2 persistent CTAs; `sm90-tiles`: the Hopper forward's
#                        longest-first, TMA-store and cross-tile switches; `sm90-dims`: the
#                        Hopper forward at head dims off 64/128/256 and d_v < d_qk;
#                        `sm90-dynamic`: its dynamic schedule, fixed-length and varlen;
#                        `sm90-fp8`: the e4m3 kernel (and its Vᵀ pass and fixup) at d128, d64
#                        (slab maps, softcap, fp16 O), d256 and 192/128 with a window; `none`).
#                        FA4_BWD_SM90_CTAS=N, when set, makes the Hopper backward's persistent
#                        CTAs walk several tiles each.
#   FA4_CHECK_CASES      when set, only these sanitized cases of those families (names such as
#                        `sm90-tiles-uniform-desc`); default every case
#   FA4_CHECK_TOOLS      sanitizer tools (default memcheck racecheck synccheck)
#   FA4_CHECK_DECODE_VARIANTS / _MEMCHECK / _RACECHECK   the decode section's variants
#   FA4_CHECK_DECODE_FP8_VARIANTS / _MEMCHECK / _RACECHECK   the decode-fp8 section's
set -uo pipefail
bin=${1:?usage: device_check.sh DIR [tests sanitize decode decode-fp8 cp]}
shift
sections=${*:-tests sanitize}
out=${OUT:-./device-out}
mkdir -p "$out" && out=$(cd "$out" && pwd)
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export FA4_CACHE_DIR=${FA4_CACHE_DIR:-/tmp/fa4-check-cache}
unset FA4_KERNEL FA4_BWD_KERNEL FA4_BWD_TILES FA4_DECODE_VARIANT
t_start=$(date +%s)
budget=${FA4_CHECK_BUDGET:-400}
gpu_threads=${FA4_GPU_TEST_THREADS:-4}
cpu_threads=${FA4_CPU_TEST_THREADS:-8}
skip=${FA4_CHECK_SKIP:-sm100_kernel_passes_the_matrix nccl_ring_on_two_gpus the_nccl_library_loads one_rank_per_thread dump_every_variant_cubin microkernel_gflops}
known=${FA4_CHECK_KNOWN:-}
families=${FA4_CHECK_FAMILIES:-sm80 sm90 decode backward}
[ "$families" = none ] && families=""
tools=${FA4_CHECK_TOOLS:-memcheck racecheck synccheck}
cs=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)

# Seconds left for a step: its own cap, cut to what is left of the budget (at least 1).
left() {
    local cap=$1 rest=$((budget - ($(date +%s) - t_start)))
    [ "$rest" -lt "$cap" ] && cap=$rest
    [ "$cap" -lt 1 ] && cap=1
    echo "$cap"
}
# note LANE STEP STATUS SECONDS TEXT: one line of the summary.
note() { printf '%s\t%s\t%s\t%s\n' "$2" "$3" "$4" "$5" >> "$out/summary-$1.tsv"; }
# status RC: pass, TIMEOUT or FAIL.
status() {
    case $1 in 0) echo pass ;; 124 | 137) echo TIMEOUT ;; *) echo FAIL ;; esac
}

# The binaries: unpacked from device_build.sh's archive, or a folder of them.
work=$bin
if [ -f "$bin/bins.tar.xz" ]; then
    work=/tmp/fa4-check-bins
    rm -rf "$work" && mkdir -p "$work"
    tar -C "$work" -xJf "$bin/bins.tar.xz" 2>/dev/null ||
        python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$bin/bins.tar.xz" "$work" ||
        { echo "device_check: cannot unpack $bin/bins.tar.xz" >&2; exit 1; }
fi
if [ -f "$bin/cache.tar.xz" ]; then
    mkdir -p "$FA4_CACHE_DIR" && tar -xJf "$bin/cache.tar.xz" -C "$FA4_CACHE_DIR"
fi
F=$work/fa4
[ -x "$F" ] || { echo "device_check: no fa4 binary in $work" >&2; exit 1; }
BUILD_ROOT=$PWD BUILD_COMMIT=unknown
[ -f "$work/build.env" ] && . "$work/build.env"
# Tests find the CLI (CARGO_BIN_EXE_fa4) and the crate's files (CARGO_MANIFEST_DIR) at the
# paths of the build machine: make those paths lead here.
if [ "$BUILD_ROOT" != "$PWD" ] && [ ! -e "$BUILD_ROOT" ]; then
    mkdir -p "$(dirname "$BUILD_ROOT")" && ln -s "$PWD" "$BUILD_ROOT"
fi
# (Not over a cargo target folder: on the build machine the tests' own CLI is there.)
if [ ! -d "$BUILD_ROOT/target/release/.fingerprint" ]; then
    mkdir -p "$BUILD_ROOT/target/release" && cp -f "$F" "$BUILD_ROOT/target/release/fa4"
fi

echo "device_check: build $BUILD_COMMIT, sections: $sections, budget ${budget}s, logs in $out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -2
rm -f "$out"/summary-*.tsv
skip_args=()
for s in $skip; do skip_args+=(--skip "$s"); done
read -r -a filter <<< "${FA4_CHECK_FILTER:-}"

# ---- tests ---------------------------------------------------------------------------------

tests=${FA4_CHECK_TESTS:-$(cd "$work" && find . -maxdepth 1 -type f -perm -u+x ! -name fa4 -printf '%f\n' | sort | tr '\n' ' ')}
[ "$tests" = none ] && tests=""
gpu_bins="" cpu_bins=""
for t in $tests; do
    [ -x "$work/$t" ] || { note cpu "$t" missing 0 "not in the archive"; continue; }
    # A binary with GPU tests carries their ignore reason.
    if grep -q "needs a CUDA GPU\|needs a Blackwell" "$work/$t"; then gpu_bins+="$t "; else cpu_bins+="$t "; fi
done

# run_bin LANE NAME THREADS CAP: one test binary; its failures outside FA4_CHECK_KNOWN fail it.
run_bin() {
    local lane=$1 name=$2 threads=$3 cap=$4 log="$out/tests/$2.txt" t0 rc secs failed unknown st txt
    mkdir -p "$out/tests"
    t0=$(date +%s)
    timeout -k 5 "$(left "$cap")" "$work/$name" --include-ignored --test-threads "$threads" "${skip_args[@]}" \
        "${filter[@]}" > "$log" 2>&1
    rc=$? secs=$(($(date +%s) - t0))
    failed=$(sed -n 's/^test \(.*\) \.\.\. FAILED$/\1/p' "$log" | tr '\n' ' ')
    unknown=""
    for f in $failed; do
        case " $known " in *" ${f##*::} "*) ;; *) unknown+="$f " ;; esac
    done
    txt=$(grep -E '^test result:' "$log" | tail -1 | sed 's/^test result: //; s/; finished in.*//')
    st=$(status "$rc")
    if [ "$st" = TIMEOUT ]; then
        txt="cut at ${secs}s; last: $(grep -E '^test ' "$log" | tail -1)"
    elif [ "$rc" -ne 0 ] && [ -n "$failed" ] && [ -z "$unknown" ]; then
        st=pass txt="$txt; known limits failed: $failed"
    elif [ "$rc" -ne 0 ]; then
        txt="rc $rc; $txt; failed: ${unknown:-none named (see the log)}"
    fi
    note "$lane" "$name" "$st" "$secs" "$txt"
}

gpu_lane() {
    local t
    for t in $gpu_bins; do
        if [ "$t" = cuda_matrix ]; then run_bin gpu "$t" "$gpu_threads" 330; else run_bin gpu "$t" "$gpu_threads" 240; fi
    done
}
cpu_lane() {
    local t
    for t in $cpu_bins; do run_bin cpu "$t" "$cpu_threads" 180; done
}

# ---- sanitize ------------------------------------------------------------------------------

# FAMILY|NAME|ENVIRONMENT|fa4 ARGUMENTS: small problems, fp16/bf16, GQA and causal where the
# family has them. sm80/sm90: 300×300; decode: 4 sequences of 700 keys in pages, 3 splits so
# that the combine runs; bwd-sm90 (from the Hopper backward's first checks, 2026-12-01): GQA
# 150×190, window and softcap, and three that reuse the ring's stages (200 causal, 256, 200
# causal GQA), and d40 and d96 (narrower than their tiles: slab maps, clipped dK/dV stores) over
# several query blocks, and 192/128 and 128/64 (V narrower than Q); sm90-tiles: d128, 64 sequences of 300 × 2 heads, causal, 384 tiles on 132
# persistent CTAs, the last query block partial (the TMA store clips), and the uniform wgmma
# descriptors on the planner's d128 tiles (176 keys, TMA store); sm90-dims: head dims
# narrower than their tiles (d40, d80: slab maps, zero-filled columns, clipped stores), d192, and
# V narrower than Q/K (192/128 with its own tiles, 96/64 padded to 128/64); sm90-dynamic: the
# dynamic schedule on 384 fixed-length tiles (TMA store, cross-tile) and on a varlen batch of
# ten sequences (1..1000 rows) at d64 causal (the planner's tiles: 16 heads, 608 tiles) and at
# d128 with the TMA store and the cross-tile overlap (16 heads, 608 tiles), and causal d64 on two
# consumer warpgroups (dynamic, TMA store) on 64 sequences of 300 × 8 heads (1536 tiles).
san_cases() {
    cat <<'EOF'
sm80|sm80|FA4_KERNEL=sm80|run --backend cuda --dtype bf16 --batch 1 --seqlen-q 300 --seqlen-k 300 --heads-q 4 --heads-kv 2 --head-dim 96 --causal
sm90|sm90|FA4_KERNEL=sm90|run --backend cuda --dtype bf16 --batch 1 --seqlen-q 300 --seqlen-k 300 --heads-q 4 --heads-kv 2 --head-dim 128 --causal
sm90-dims|sm90-d80|FA4_KERNEL=sm90|run --backend cuda --dtype bf16 --batch 1 --seqlen-q 300 --seqlen-k 300 --heads-q 4 --heads-kv 2 --head-dim 80 --causal
sm90-dims|sm90-d40|FA4_KERNEL=sm90|run --backend cuda --dtype fp16 --batch 2 --seqlen-q 300 --seqlen-k 200 --heads-q 4 --heads-kv 1 --head-dim 40
sm90-dims|sm90-d192|FA4_KERNEL=sm90|run --backend cuda --dtype bf16 --batch 1 --seqlen-q 300 --seqlen-k 300 --heads-q 4 --heads-kv 2 --head-dim 192 --causal
sm90-dims|sm90-d192-v128|FA4_KERNEL=sm90|run --backend cuda --dtype bf16 --batch 1 --seqlen-q 300 --seqlen-k 300 --heads-q 4 --heads-kv 2 --head-dim 192 --head-dim-v 128 --causal
sm90-dims|sm90-d96-v64|FA4_KERNEL=sm90|run --backend cuda --dtype fp16 --batch 1 --seqlen-q 300 --seqlen-k 300 --heads-q 2 --heads-kv 2 --head-dim 96 --head-dim-v 64
sm90-fp8|sm90-fp8-d128|FA4_KERNEL=auto|run --backend cuda --dtype fp8 --batch 1 --seqlen-q 300 --seqlen-k 300 --heads-q 4 --heads-kv 2 --head-dim 128 --causal
sm90-fp8|sm90-fp8-d64-softcap|FA4_KERNEL=auto|run --backend cuda --dtype fp8 --out-dtype fp16 --batch 2 --seqlen-q 300 --seqlen-k 200 --heads-q 4 --heads-kv 1 --head-dim 64 --softcap 8
sm90-fp8|sm90-fp8-d256|FA4_KERNEL=auto|run --backend cuda --dtype fp8 --batch 1 --seqlen-q 300 --seqlen-k 400 --heads-q 2 --heads-kv 2 --head-dim 256 --causal
sm90-fp8|sm90-fp8-d192-v128|FA4_KERNEL=auto|run --backend cuda --dtype fp8 --batch 1 --seqlen-q 300 --seqlen-k 300 --heads-q 4 --heads-kv 2 --head-dim 192 --head-dim-v 128 --window 100,20
decode|decode|FA4_KERNEL=auto|run --backend cuda --paged --num-splits 3 --dtype fp16 --batch 4 --seqlen-k 700 --heads-q 8 --heads-kv 2 --head-dim 128
decode-fp8|decode-fp8-heads|FA4_DECODE_VARIANT=auto|run --backend cuda --paged --kv-dtype fp8 --num-splits 3 --dtype bf16 --batch 4 --seqlen-k 700 --heads-q 8 --heads-kv 2 --head-dim 128
decode-fp8|decode-fp8-split|FA4_DECODE_VARIANT=plain|run --backend cuda --paged --kv-dtype fp8 --num-splits 3 --dtype fp16 --batch 4 --seqlen-q 2 --seqlen-k 700 --heads-q 8 --heads-kv 2 --head-dim 128 --causal
decode-fp8|decode-fp8-split-bf16|FA4_DECODE_VARIANT=plain|run --backend cuda --paged --kv-dtype fp8 --num-splits 3 --dtype bf16 --batch 4 --seqlen-q 2 --seqlen-k 700 --heads-q 8 --heads-kv 2 --head-dim 128 --causal
backward|backward|FA4_KERNEL=auto|run --backend cuda --backward --dtype bf16 --batch 1 --seqlen-q 200 --seqlen-k 200 --heads-q 2 --head-dim 64 --causal
bwd-sm90|bwd-sm90-d64-gqa|FA4_BWD_KERNEL=sm90|run --backend cuda --backward --dtype bf16 --batch 2 --seqlen-q 150 --seqlen-k 190 --heads-q 4 --heads-kv 2 --head-dim 64 --causal
bwd-sm90|bwd-sm90-d128-window|FA4_BWD_KERNEL=sm90|run --backend cuda --backward --dtype fp16 --batch 1 --seqlen-q 150 --seqlen-k 190 --heads-q 2 --heads-kv 1 --head-dim 128 --window 40,10 --softcap 8
bwd-sm90|bwd-sm90-d64-causal-200|FA4_BWD_KERNEL=sm90|run --backend cuda --backward --dtype bf16 --batch 1 --seqlen-q 200 --seqlen-k 200 --heads-q 2 --heads-kv 2 --head-dim 64 --causal
bwd-sm90|bwd-sm90-d64-256|FA4_BWD_KERNEL=sm90|run --backend cuda --backward --dtype bf16 --batch 1 --seqlen-q 256 --seqlen-k 256 --heads-q 2 --heads-kv 2 --head-dim 64
bwd-sm90|bwd-sm90-d128-causal-gqa-200|FA4_BWD_KERNEL=sm90|run --backend cuda --backward --dtype bf16 --batch 1 --seqlen-q 200 --seqlen-k 200 --heads-q 2 --heads-kv 1 --head-dim 128 --causal
bwd-sm90|bwd-sm90-d40-causal-gqa|FA4_BWD_KERNEL=sm90|run --backend cuda --backward --dtype bf16 --batch 2 --seqlen-q 300 --seqlen-k 190 --heads-q 4 --heads-kv 2 --head-dim 40 --causal
bwd-sm90|bwd-sm90-d96-window|FA4_BWD_KERNEL=sm90|run --backend cuda --backward --dtype fp16 --batch 1 --seqlen-q 300 --seqlen-k 300 --heads-q 2 --heads-kv 1 --head-dim 96 --window 80,20 --softcap 8
bwd-sm90|bwd-sm90-d256-causal-gqa|FA4_BWD_KERNEL=sm90|run --backend cuda --backward --dtype bf16 --batch 2 --seqlen-q 150 --seqlen-k 190 --heads-q 4 --heads-kv 2 --head-dim 256 --causal
bwd-sm90|bwd-sm90-d192-window|FA4_BWD_KERNEL=sm90|run --backend cuda --backward --dtype fp16 --batch 1 --seqlen-q 300 --seqlen-k 300 --heads-q 2 --heads-kv 1 --head-dim 192 --window 80,20 --softcap 8
bwd-sm90|bwd-sm90-d192-v128-causal-gqa|FA4_BWD_KERNEL=sm90|run --backend cuda --backward --dtype bf16 --batch 2 --seqlen-q 150 --seqlen-k 190 --heads-q 4 --heads-kv 2 --head-dim 192 --head-dim-v 128 --causal
bwd-sm90|bwd-sm90-d128-v64-window|FA4_BWD_KERNEL=sm90|run --backend cuda --backward --dtype fp16 --batch 1 --seqlen-q 300 --seqlen-k 300 --heads-q 2 --heads-kv 1 --head-dim 128 --head-dim-v 64 --window 80,20 --softcap 8
bwd-sm90-det|bwd-sm90-det-d64-gqa|FA4_BWD_KERNEL=sm90 FA4_BWD_SM90_CTAS=2|run --backend cuda --backward --deterministic --dtype bf16 --batch 2 --seqlen-q 150 --seqlen-k 190 --heads-q 4 --heads-kv 2 --head-dim 64 --causal
bwd-sm90-det|bwd-sm90-det-d128-window|FA4_BWD_KERNEL=sm90 FA4_BWD_SM90_CTAS=2|run --backend cuda --backward --deterministic --dtype fp16 --batch 1 --seqlen-q 300 --seqlen-k 300 --heads-q 2 --heads-kv 1 --head-dim 128 --window 80,20 --softcap 8
bwd-sm90-det|bwd-sm90-det-d96-256|FA4_BWD_KERNEL=sm90 FA4_BWD_SM90_CTAS=2|run --backend cuda --backward --deterministic --dtype bf16 --batch 1 --seqlen-q 256 --seqlen-k 256 --heads-q 2 --heads-kv 2 --head-dim 96
bwd-sm90-det|bwd-sm90-det-d256-causal-gqa|FA4_BWD_KERNEL=sm90 FA4_BWD_SM90_CTAS=2|run --backend cuda --backward --deterministic --dtype bf16 --batch 2 --seqlen-q 150 --seqlen-k 190 --heads-q 4 --heads-kv 2 --head-dim 256 --causal
bwd-sm90-det|bwd-sm90-det-d192-v128|FA4_BWD_KERNEL=sm90 FA4_BWD_SM90_CTAS=2|run --backend cuda --backward --deterministic --dtype bf16 --batch 1 --seqlen-q 300 --seqlen-k 300 --heads-q 2 --heads-kv 1 --head-dim 192 --head-dim-v 128 --causal
sm90-tiles|sm90-tiles-longest-first|FA4_KERNEL=sm90|bench --backend cuda --kernel sm90 --dtype bf16 --tokens 19200 --hidden 256 --grid 128,300,1 --warmup 0 --reps 1 --calls 1 --sm90-tiles 128,2,2,40,232,0,1,0,1,0,1,0,0
sm90-tiles|sm90-tiles-tma-store|FA4_KERNEL=sm90|bench --backend cuda --kernel sm90 --dtype bf16 --tokens 19200 --hidden 256 --grid 128,300,1 --warmup 0 --reps 1 --calls 1 --sm90-tiles 128,2,2,40,232,0,1,0,1,0,0,1,0
sm90-tiles|sm90-tiles-cross-tile|FA4_KERNEL=sm90|bench --backend cuda --kernel sm90 --dtype bf16 --tokens 19200 --hidden 256 --grid 128,300,1 --warmup 0 --reps 1 --calls 1 --sm90-tiles 128,2,2,40,232,0,1,0,1,0,0,0,1
sm90-tiles|sm90-tiles-all|FA4_KERNEL=sm90|bench --backend cuda --kernel sm90 --dtype bf16 --tokens 19200 --hidden 256 --grid 128,300,1 --warmup 0 --reps 1 --calls 1 --sm90-tiles 128,2,2,40,232,0,1,1,1,0,1,1,1
sm90-tiles|sm90-tiles-uniform-desc|FA4_KERNEL=sm90|bench --backend cuda --kernel sm90 --dtype bf16 --tokens 19200 --hidden 256 --grid 128,300,1 --warmup 0 --reps 1 --calls 1 --sm90-tiles 176,2,2,40,232,0,1,0,1,0,0,1,0,0,1
sm90-dynamic|sm90-dynamic-fixed|FA4_KERNEL=sm90|bench --backend cuda --kernel sm90 --dtype bf16 --tokens 19200 --hidden 256 --grid 128,300,1 --warmup 0 --reps 1 --calls 1 --sm90-tiles 128,2,2,40,232,0,1,0,1,0,0,1,1,1
sm90-dynamic|sm90-dynamic-causal-d64|FA4_KERNEL=sm90|bench --backend cuda --kernel sm90 --dtype bf16 --tokens 19200 --hidden 512 --grid 64,300,1 --warmup 0 --reps 1 --calls 1 --sm90-tiles 128,2,2,40,232,0,0,0,1,0,0,1,0,1
sm90-dynamic|sm90-dynamic-varlen-d64|FA4_KERNEL=sm90|bench --backend cuda --kernel sm90 --dtype bf16 --hidden 1024 --grid 64,300,1,1,16 --lengths 300,1,517,130,64,1000,700,33,260,900 --warmup 0 --reps 1 --calls 1
sm90-dynamic|sm90-dynamic-varlen-d128-cross|FA4_KERNEL=sm90|bench --backend cuda --kernel sm90 --dtype fp16 --hidden 2048 --grid 128,300,0,1,16 --lengths 300,1,517,130,64,1000,700,33,260,900 --warmup 0 --reps 1 --calls 1 --sm90-tiles 128,2,2,40,232,0,1,0,1,0,0,1,1,1
EOF
}

# sanitize_run LANE STEP TOOL LOG ENV COMMAND...: one sanitizer run and its summary line.
sanitize_run() {
    local lane=$1 step=$2 tool=$3 log=$4 envs=$5 t0 rc secs summ extra=()
    shift 5
    [ -n "$cs" ] || { note "$lane" "$step" FAIL 0 "compute-sanitizer not found"; return; }
    [ "$tool" = racecheck ] && extra=(--racecheck-report hazard)
    t0=$(date +%s)
    # shellcheck disable=SC2086
    env $envs timeout -k 5 "$(left 90)" "$cs" --tool "$tool" "${extra[@]}" --error-exitcode 9 "$@" > "$log" 2>&1
    rc=$? secs=$(($(date +%s) - t0))
    summ=$(grep -E '(ERROR|RACECHECK) SUMMARY' "$log" | tail -1 | sed 's/^========= //')
    note "$lane" "$step" "$(status "$rc")" "$secs" "rc $rc; ${summ:-no summary line}"
}

san_lane() {
    local fam name envs args plain t0 rc secs tool
    mkdir -p "$out/sanitize"
    for fam in $families; do
        san_cases | grep -q "^$fam|" || { note san "sanitize $fam" FAIL 0 "unknown family (sm80 sm90 decode decode-fp8 backward bwd-sm90 bwd-sm90-det sm90-tiles sm90-dims sm90-dynamic sm90-fp8)"; continue; }
        while IFS='|' read -r _ name envs args; do
            if [ -n "${FA4_CHECK_CASES:-}" ] && ! [[ " $FA4_CHECK_CASES " == *" $name "* ]]; then continue; fi
            plain=$out/sanitize/$name-plain.txt
            t0=$(date +%s)
            # shellcheck disable=SC2086
            env $envs timeout -k 5 "$(left 60)" "$F" $args > "$plain" 2>&1
            rc=$? secs=$(($(date +%s) - t0))
            if [ "$rc" -ne 0 ]; then
                note san "sanitize $name" "$([ "$fam" = backward ] && echo skipped || echo FAIL)" "$secs" \
                    "plain run rc $rc: $(grep -v '^$' "$plain" | tail -1 | cut -c1-160)"
                continue
            fi
            for tool in $tools; do
                # shellcheck disable=SC2086
                sanitize_run san "sanitize $name $tool" "$tool" "$out/sanitize/$name-$tool.txt" "$envs" "$F" $args
            done
        done < <(san_cases | grep "^$fam|")
    done
}

# ---- decode --------------------------------------------------------------------------------

decode_section() {
    local T=$work/cuda_decode v t0 rc secs skip_all
    mkdir -p "$out/decode"
    [ -x "$T" ] || { note post "decode" FAIL 0 "no cuda_decode binary in the archive"; return; }
    for v in ${FA4_CHECK_DECODE_VARIANTS:-auto plain heads heads+bulk best heads+best heads4 heads+bulk+best heads4+bulk heads+bulk+best+fuse best+fuse}; do
        # The all-variants test switches variants itself: once (under auto) is enough.
        skip_all=(--skip every_variant_matches_the_oracle_in_one_process)
        [ "$v" = auto ] && skip_all=()
        t0=$(date +%s)
        FA4_DECODE_VARIANT=$v timeout -k 5 "$(left 60)" "$T" --include-ignored "${skip_all[@]}" > "$out/decode/tests-$v.txt" 2>&1
        rc=$? secs=$(($(date +%s) - t0))
        note post "decode tests $v" "$(status "$rc")" "$secs" "$(grep -E '^test result:' "$out/decode/tests-$v.txt" | tail -1 | sed 's/; finished in.*//')"
    done
    for v in ${FA4_CHECK_DECODE_MEMCHECK:-plain heads heads4+bulk heads+bulk heads+bulk+best+fuse best+fuse}; do
        sanitize_run post "decode memcheck $v" memcheck "$out/decode/memcheck-$v.txt" "FA4_DECODE_VARIANT=$v" \
            "$T" --include-ignored --exact the_environments_variant_is_the_one_planned
    done
    for v in ${FA4_CHECK_DECODE_RACECHECK:-heads heads+bulk heads+bulk+best+fuse}; do
        sanitize_run post "decode racecheck $v" racecheck "$out/decode/racecheck-$v.txt" "FA4_DECODE_VARIANT=$v" \
            "$T" --include-ignored --exact the_environments_variant_is_the_one_planned
    done
}

# The fp8-cache decode kernels, as decode_section: the test binary per variant, then the
# sanitizers on the test that runs the environment's variant.
decode_fp8_section() {
    local T=$work/cuda_decode_fp8 v t0 rc secs skip_all
    mkdir -p "$out/decode-fp8"
    [ -x "$T" ] || { note post "decode-fp8" FAIL 0 "no cuda_decode_fp8 binary in the archive"; return; }
    for v in ${FA4_CHECK_DECODE_FP8_VARIANTS:-auto plain heads heads+bulk best+fuse heads+bulk+best+fuse}; do
        skip_all=(--skip fp8_every_variant_matches_the_oracle_in_one_process)
        [ "$v" = auto ] && skip_all=()
        t0=$(date +%s)
        FA4_DECODE_VARIANT=$v timeout -k 5 "$(left 90)" "$T" --include-ignored "${skip_all[@]}" > "$out/decode-fp8/tests-$v.txt" 2>&1
        rc=$? secs=$(($(date +%s) - t0))
        note post "decode-fp8 tests $v" "$(status "$rc")" "$secs" "$(grep -E '^test result:' "$out/decode-fp8/tests-$v.txt" | tail -1 | sed 's/; finished in.*//')"
    done
    for v in ${FA4_CHECK_DECODE_FP8_MEMCHECK:-plain heads heads+bulk best+fuse heads+bulk+best+fuse}; do
        sanitize_run post "decode-fp8 memcheck $v" memcheck "$out/decode-fp8/memcheck-$v.txt" "FA4_DECODE_VARIANT=$v" \
            "$T" --include-ignored --exact fp8_runs_the_environments_variant
    done
    for v in ${FA4_CHECK_DECODE_FP8_RACECHECK:-plain heads heads+bulk heads+bulk+best+fuse}; do
        sanitize_run post "decode-fp8 racecheck $v" racecheck "$out/decode-fp8/racecheck-$v.txt" "FA4_DECODE_VARIANT=$v" \
            "$T" --include-ignored --exact fp8_runs_the_environments_variant
    done
}

# ---- cp ------------------------------------------------------------------------------------

cp_section() {
    local gpus args t0 rc secs i=0
    mkdir -p "$out/cp"
    export NCCL_NVLS_ENABLE=0  # the ring uses send/recv only; multicast objects can take GPUs out of service
    gpus=$(nvidia-smi -L | wc -l)
    if [ "$gpus" -lt 2 ]; then
        note post cp skipped 0 "$gpus GPU: the ring needs 2 or more (nvidia-h200-x2)"
        return
    fi
    # NCCL: the image's PyTorch ships one (the nvidia-nccl wheel or torch/lib); FA4_NCCL_LIB
    # makes the choice explicit.
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
    echo "cp: $gpus GPUs, FA4_NCCL_LIB=${FA4_NCCL_LIB:-unset, the dynamic loader path}"
    t0=$(date +%s)
    timeout -k 5 "$(left 300)" "$work/cp_nccl" --include-ignored --test-threads 1 --nocapture > "$out/cp/cp_nccl.txt" 2>&1
    rc=$? secs=$(($(date +%s) - t0))
    note post "cp cp_nccl" "$(status "$rc")" "$secs" "$(grep -E '^test result:' "$out/cp/cp_nccl.txt" | tail -1 | sed 's/; finished in.*//')"
    for args in "--causal" "" "--causal --heads-kv 2 --seqlen-q 4093"; do
        i=$((i + 1)) t0=$(date +%s)
        # shellcheck disable=SC2086
        timeout -k 5 "$(left 120)" "$F" run --backend cuda --cp 2 --seqlen-q 4096 --heads-q 8 --dtype bf16 --check $args \
            > "$out/cp/run-$i.txt" 2>&1
        rc=$? secs=$(($(date +%s) - t0))
        note post "cp run --cp 2 $args" "$(status "$rc")" "$secs" "$(grep -E '^(cp|check)' "$out/cp/run-$i.txt" | tail -1)"
    done
    timeout -k 5 "$(left 60)" "$F" run --backend cuda --cp $((gpus + 1)) --seqlen-q 1024 > "$out/cp/too-many.txt" 2>&1
    rc=$?
    note post "cp --cp $((gpus + 1)) refused" "$([ "$rc" -eq 2 ] && echo pass || echo FAIL)" 0 "rc $rc (want 2): $(head -1 "$out/cp/too-many.txt")"
}

# ---- run -----------------------------------------------------------------------------------

pids=()
case " $sections " in *" tests "*) gpu_lane & pids+=($!); ( renice -n 5 $BASHPID > /dev/null 2>&1; cpu_lane ) & pids+=($!) ;; esac
case " $sections " in *" sanitize "*) san_lane & pids+=($!) ;; esac
[ ${#pids[@]} -gt 0 ] && wait "${pids[@]}"
for s in $sections; do
    case $s in
    tests | sanitize) ;;
    decode) decode_section ;;
    decode-fp8) decode_fp8_section ;;
    cp) cp_section ;;
    *) note post "$s" FAIL 0 "unknown section (tests sanitize decode decode-fp8 cp)" ;;
    esac
done

{
    printf '%-58s %-8s %6s  %s\n' STEP STATUS SECONDS NOTE
    cat "$out"/summary-*.tsv 2>/dev/null | awk -F'\t' '{ printf "%-58s %-8s %6s  %s\n", $1, $2, $3, $4 }'
    bad=$(cat "$out"/summary-*.tsv 2>/dev/null | awk -F'\t' '$2 != "pass" && $2 != "skipped"' | wc -l)
    all=$(cat "$out"/summary-*.tsv 2>/dev/null | wc -l)
    echo "device_check: $((all - bad)) of $all steps passed or skipped, $bad not; $(($(date +%s) - t_start)) s in all (budget ${budget} s)"
} | tee "$out/summary.txt"
! grep -qE '^device_check: .*, [1-9][0-9]* not;' "$out/summary.txt"
