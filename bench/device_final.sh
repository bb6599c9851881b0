#!/usr/bin/env bash
# The final GPU check of a build, in one device call of at most ~420 s on an H200: every test
# binary with --include-ignored, then compute-sanitizer (memcheck, racecheck, synccheck) on one
# small case of each kernel family. Binaries come from bench/device_build.sh (run on the host):
#   bash .device/final/device_final.sh .device/final      (from the repository root on the GPU
#                                                          machine; logs and summary under $OUT)
# Three lanes run at once, so the call takes about as long as the longest: the test binaries
# with GPU tests (one after another, each with FA4_GPU_TEST_THREADS tests at once), the CPU-only
# test binaries (niced), and the sanitizers. Every step runs under `timeout`, cut to what is
# left of FA4_FINAL_BUDGET seconds, so a hang costs its step, not the call.
#
# Selection (environment):
#   FA4_FINAL_TESTS     test binaries to run (names as in the archive, e.g. `cuda_matrix
#                       cuda_decode`); default all; `none` for none
#   FA4_FINAL_SKIP      tests skipped (libtest --skip, substring match); default: the ones whose
#                       hardware this machine is not (see `skip` below)
#   FA4_FINAL_KNOWN     tests whose failure is a documented known limit: reported, not counted
#   FA4_FINAL_FAMILIES  families sanitized: sm80 sm90 decode backward (default all; `none`)
#   FA4_FINAL_TOOLS     sanitizer tools (default memcheck racecheck synccheck)
#   FA4_FINAL_BUDGET    seconds for the whole script (default 400, under the 420 s target)
#   FA4_GPU_TEST_THREADS / FA4_CPU_TEST_THREADS   libtest threads per lane (default 4 / 8)
# Exit status: 0 when every step passed (known limits aside), 1 otherwise.
set -uo pipefail
bin=${1:-$(dirname "$0")}
out=${OUT:-./device-out}
mkdir -p "$out/tests" "$out/sanitize"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export FA4_CACHE_DIR=${FA4_CACHE_DIR:-/tmp/fa4-final-cache}
t_start=$(date +%s)
budget=${FA4_FINAL_BUDGET:-400}
gpu_threads=${FA4_GPU_TEST_THREADS:-4}
cpu_threads=${FA4_CPU_TEST_THREADS:-8}
# Not this machine's hardware (one H200): the SM100 kernel's matrix, the NCCL ring (2+ GPUs),
# the SASS dump (a tool: needs FA4_SASS_DUMP_DIR) and the microkernel timing (a benchmark).
skip=${FA4_FINAL_SKIP:-sm100_kernel_passes_the_matrix nccl_ring_on_two_gpus the_nccl_library_loads one_rank_per_thread dump_every_variant_cubin microkernel_gflops}
# Tests whose failure is a documented known limit (none since the exact fixup kernel of issue 12:
# the four non-finite cases of tests/cuda_matrix.rs must pass).
known=${FA4_FINAL_KNOWN:-}
families=${FA4_FINAL_FAMILIES:-sm80 sm90 decode backward}
tools=${FA4_FINAL_TOOLS:-memcheck racecheck synccheck}

# Seconds left for a step: its own cap, cut to what is left of the budget (at least 1).
left() {
    local cap=$1 rest=$((budget - ($(date +%s) - t_start)))
    [ "$rest" -lt "$cap" ] && cap=$rest
    [ "$cap" -lt 1 ] && cap=1
    echo "$cap"
}

# The binaries: unpacked from the archive device_build.sh made, or a folder of them.
work=$bin
if [ -f "$bin/bins.tar.xz" ]; then
    work=/tmp/fa4-final-bins
    rm -rf "$work" && mkdir -p "$work"
    tar -C "$work" -xJf "$bin/bins.tar.xz" 2>/dev/null ||
        python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$bin/bins.tar.xz" "$work" ||
        { echo "device_final: cannot unpack $bin/bins.tar.xz" >&2; exit 1; }
fi
F=$work/fa4
[ -x "$F" ] || { echo "device_final: no fa4 binary in $work" >&2; exit 1; }
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

echo "device_final: build $BUILD_COMMIT, budget ${budget}s, logs in $out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -2

rm -f "$out"/summary-*.tsv
tests=${FA4_FINAL_TESTS:-$(cd "$work" && ls | grep -v -e '^fa4$' -e '^build.env$' | sort | tr '\n' ' ')}
[ "$tests" = none ] && tests=""
skip_args=()
for s in $skip; do skip_args+=(--skip "$s"); done
gpu_bins="" cpu_bins=""
for t in $tests; do
    [ -x "$work/$t" ] || { printf '%s\tmissing\t0\tnot in the archive\n' "$t" >> "$out/summary-cpu.tsv"; continue; }
    # A binary with GPU tests carries their ignore reason.
    if grep -q "needs a CUDA GPU\|needs a Blackwell" "$work/$t"; then gpu_bins+="$t "; else cpu_bins+="$t "; fi
done

# Runs one test binary; appends `name, status, seconds, note` to the lane's summary.
run_bin() {
    local lane=$1 name=$2 threads=$3 cap=$4 log="$out/tests/$2.txt" t0 rc secs failed unknown status note
    t0=$(date +%s)
    timeout -k 5 "$(left "$cap")" "$work/$name" --include-ignored --test-threads "$threads" "${skip_args[@]}" > "$log" 2>&1
    rc=$? secs=$(($(date +%s) - t0))
    failed=$(sed -n 's/^test \(.*\) \.\.\. FAILED$/\1/p' "$log" | tr '\n' ' ')
    unknown=""
    for f in $failed; do
        case " $known " in *" ${f##*::} "*) ;; *) unknown+="$f " ;; esac
    done
    note=$(grep -E '^test result:' "$log" | tail -1 | sed 's/^test result: //; s/; finished in.*//')
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        status=TIMEOUT note="cut at ${secs}s; last: $(grep -E '^test ' "$log" | tail -1)"
    elif [ "$rc" -eq 0 ]; then
        status=pass
    elif [ -n "$failed" ] && [ -z "$unknown" ]; then
        status=pass note="$note; known limits failed: $failed"
    else
        status=FAIL note="rc $rc; $note; failed: ${unknown:-none named (see the log)}"
    fi
    printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$secs" "$note" >> "$out/summary-$lane.tsv"
}

gpu_lane() {
    for t in $gpu_bins; do
        # The CUDA matrix is the longest (its switch tests compile their variants first).
        local cap=240
        [ "$t" = cuda_matrix ] && cap=330
        run_bin gpu "$t" "$gpu_threads" "$cap"
    done
}

cpu_lane() {
    for t in $cpu_bins; do run_bin cpu "$t" "$cpu_threads" 180; done
}

# One small case per family: 300×300 (decode: 2 sequences of 700 keys in pages, 3 splits so
# the combine runs), fp16/bf16, GQA, causal where the family has it.
san_case() {
    case $1 in
    sm80) echo "FA4_KERNEL=sm80|run --backend cuda --dtype bf16 --batch 1 --seqlen-q 300 --seqlen-k 300 --heads-q 4 --heads-kv 2 --head-dim 96 --causal" ;;
    sm90) echo "FA4_KERNEL=sm90|run --backend cuda --dtype bf16 --batch 1 --seqlen-q 300 --seqlen-k 300 --heads-q 4 --heads-kv 2 --head-dim 128 --causal" ;;
    decode) echo "FA4_KERNEL=auto|run --backend cuda --paged --num-splits 3 --dtype fp16 --batch 4 --seqlen-k 700 --heads-q 8 --heads-kv 2 --head-dim 128" ;;
    backward) echo "FA4_KERNEL=auto|run --backend cuda --backward --dtype bf16 --batch 1 --seqlen-q 200 --seqlen-k 200 --heads-q 2 --head-dim 64 --causal" ;;
    *) echo "" ;;
    esac
}

san_lane() {
    local cs tool fam spec env args log t0 rc secs
    cs=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
    for fam in $families; do
        spec=$(san_case "$fam")
        if [ -z "$spec" ]; then
            printf 'sanitize %s\tFAIL\t0\tunknown family (sm80 sm90 decode backward)\n' "$fam" >> "$out/summary-san.tsv"
            continue
        fi
        env=${spec%%|*} args=${spec#*|}
        # The case must run plainly first: a family this build does not have (the GPU backward
        # before it lands) is reported as skipped with its error, not as a sanitizer failure.
        t0=$(date +%s)
        env "$env" timeout -k 5 "$(left 60)" "$F" $args > "$out/sanitize/$fam-plain.txt" 2>&1
        rc=$? secs=$(($(date +%s) - t0))
        if [ "$rc" -ne 0 ]; then
            local st=FAIL
            [ "$fam" = backward ] && st=skipped
            printf 'sanitize %s\t%s\t%s\tplain run rc %s: %s\n' "$fam" "$st" "$secs" "$rc" \
                "$(grep -v '^$' "$out/sanitize/$fam-plain.txt" | tail -1 | cut -c1-160)" >> "$out/summary-san.tsv"
            continue
        fi
        for tool in $tools; do
            log="$out/sanitize/$fam-$tool.txt"
            if [ -z "$cs" ]; then
                printf 'sanitize %s %s\tFAIL\t0\tcompute-sanitizer not found\n' "$fam" "$tool" >> "$out/summary-san.tsv"
                continue
            fi
            t0=$(date +%s)
            env "$env" timeout -k 5 "$(left 90)" "$cs" --tool "$tool" --error-exitcode 9 "$F" $args > "$log" 2>&1
            rc=$? secs=$(($(date +%s) - t0))
            local summary
            summary=$(grep -E '(ERROR|RACECHECK) SUMMARY' "$log" | tail -1 | sed 's/^========= //')
            local st=pass
            [ "$rc" -ne 0 ] && st=FAIL
            { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; } && st=TIMEOUT
            printf 'sanitize %s %s\t%s\t%s\trc %s; %s\n' "$fam" "$tool" "$st" "$secs" "$rc" "${summary:-no summary line}" >> "$out/summary-san.tsv"
        done
    done
}

[ "$families" = none ] && families=""
gpu_lane & g=$!
( renice -n 5 $BASHPID > /dev/null 2>&1; cpu_lane ) & c=$!
san_lane & s=$!
wait $g $c $s

# The table: every step, its status, seconds, and what it said.
{
    printf '%-58s %-8s %6s  %s\n' STEP STATUS SECONDS NOTE
    cat "$out"/summary-gpu.tsv "$out"/summary-cpu.tsv "$out"/summary-san.tsv 2>/dev/null |
        awk -F'\t' '{ printf "%-58s %-8s %6s  %s\n", $1, $2, $3, $4 }'
    bad=$(cat "$out"/summary-*.tsv 2>/dev/null | awk -F'\t' '$2 != "pass" && $2 != "skipped"' | wc -l)
    all=$(cat "$out"/summary-*.tsv 2>/dev/null | wc -l)
    echo "device_final: $((all - bad)) of $all steps passed or skipped, $bad not; $(($(date +%s) - t_start)) s in all (budget ${budget} s)"
} | tee "$out/summary.txt"
! grep -qE '^device_final: .*, [1-9][0-9]* not;' "$out/summary.txt"
