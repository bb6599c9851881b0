#!/usr/bin/env bash
# Builds what the GPU machine runs, here (no GPU needed): every release test binary of the fa4
# package, the fa4 CLI and the examples (decode_bench, bwd_bench: the Rust sides of
# bench/profile.sh's bwd and decode modes and of bench/sweep.py --backward), stripped, packed
# into one xz archive (about 30 binaries of 1–3 MB each and the 6 MB CLI would pass a device
# call's 64 MiB carry limit unpacked; packed they take about a quarter), and where asked the
# decode kernel cache for an H200.
#   bench/device_build.sh [DEST]        DEST defaults to target/device (git-ignored)
# Then, on the device: `run` with carry ["target/device"] and e.g.
#   bash bench/device_check.sh target/device            (bench/README.md has the others)
# FA4_BUILD_PACKAGES (default `fa4`) names the cargo packages whose tests are built, e.g.
# `fa4 fa4-candle`. FA4_PRECOMPILE=1 also fills DEST/cache.tar.xz with `decode_bench
# --precompile` (every split, combine, append and all-heads decode kernel for sm_90a, ~540
# kernels, 6–11 min on two cores; FA4_PRECOMPILE=VARIANT,… only the decode grid's kernels under
# those variants, a minute or two; FA4_PRECOMPILE=fp8 the e4m3 forward's kernels, those of the fp8
# matrix and the fp8 grid's with `fp8_bench --precompile`; FA4_PRECOMPILE=bwd the backward's and
# the 16-bit forward matrix's with `bwd_bench --precompile`), so that a device call spends no time in NVRTC; it needs
# NVRTC here (LD_LIBRARY_PATH, e.g. the pip wheel's nvidia/cu13/lib). device_check.sh unpacks
# it into FA4_CACHE_DIR (an NVRTC of another version on the device misses it and compiles).
# Prints the folder's size and what it holds; exits non-zero if a build fails or the folder
# passes 60 MiB.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
dest=${1:-target/device}
packages=${FA4_BUILD_PACKAGES:-fa4}
pkg_args=()
for p in $packages; do pkg_args+=(-p "$p"); done
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bins"

# One cargo call for every test target; its JSON messages name each executable and its target,
# and the fa4 CLI it builds for the CLI tests (a separate `cargo build --bin fa4` would build
# the crate again: the tests' dev-dependencies unify other features).
cargo test --release "${pkg_args[@]}" --no-run --message-format=json-render-diagnostics \
    > "$stage/cargo.json"
python3 - "$stage/cargo.json" "$stage/bins" <<'EOF'
import json, os, subprocess, sys
msgs, out = sys.argv[1], sys.argv[2]
names = {}
for line in open(msgs):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    exe = m.get("executable")
    if m.get("reason") != "compiler-artifact" or not exe:
        continue
    t = m["target"]
    if not m.get("profile", {}).get("test"):
        if t["name"] == "fa4" and t["kind"] == ["bin"]:
            subprocess.run(["strip", "-o", f"{out}/fa4", exe], check=True)
        elif t["kind"] == ["example"] and t["name"] in ("decode_bench", "bwd_bench", "fp8_bench"):
            # `cargo test` builds the examples too; kept apart from the test binaries.
            os.makedirs(f"{out}/examples", exist_ok=True)
            subprocess.run(["strip", "-o", f"{out}/examples/{t['name']}", exe], check=True)
        continue
    pkg = m["package_id"].split("#")[-1].split("@")[0].split("/")[-1]
    kind = t["kind"][0]
    # Integration tests by their file name; unit tests of a library or binary by its kind.
    name = t["name"] if kind == "test" else f"{t['name']}-{kind}-unit"
    if pkg != "fa4":
        name = f"{pkg}.{name}"
    if name in names:
        sys.exit(f"two test binaries named {name}: {names[name]} and {exe}")
    names[name] = exe
    subprocess.run(["strip", "-o", f"{out}/{name}", exe], check=True)
print(f"{len(names)} test binaries: {' '.join(sorted(names))}")
EOF
[ -x "$stage/bins/fa4" ] || { echo "device_build: cargo built no fa4 CLI" >&2; exit 1; }
for e in decode_bench bwd_bench fp8_bench; do
    [ -x "$stage/bins/examples/$e" ] || { echo "device_build: cargo built no $e example" >&2; exit 1; }
done
# Where the binaries were built: tests find the fa4 CLI and the crate's files through paths
# compiled into them (CARGO_BIN_EXE_fa4, CARGO_MANIFEST_DIR), which the device script recreates.
printf 'BUILD_ROOT=%s\nBUILD_COMMIT=%s\n' "$root" "$(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo +dirty)" \
    > "$stage/bins/build.env"
mkdir -p "$dest"
rm -f "$dest/bins.tar.xz"
tar -C "$stage/bins" -cf - . | xz -T0 -6 > "$dest/bins.tar.xz"
rm -f "$dest/cache.tar.xz"
if [ -n "${FA4_PRECOMPILE:-}" ]; then
    cache=$stage/cache
    mkdir -p "$cache"
    only=()
    [ "$FA4_PRECOMPILE" != 1 ] && [ "$FA4_PRECOMPILE" != fp8 ] && [ "$FA4_PRECOMPILE" != bwd ] \
        && only=("$FA4_PRECOMPILE")
    if [ "$FA4_PRECOMPILE" = bwd ]; then
        # The backward's kernels and the 16-bit forward matrix's (bwd_bench --precompile).
        FA4_CACHE_DIR="$cache" FA4_REQUIRE_NVRTC=1 "$stage/bins/examples/bwd_bench" --precompile \
            > "$stage/precompile.log"
    elif [ "$FA4_PRECOMPILE" = fp8 ]; then
        # Only the e4m3 forward's kernels (fp8_bench --precompile).
        FA4_CACHE_DIR="$cache" FA4_REQUIRE_NVRTC=1 "$stage/bins/examples/fp8_bench" --precompile \
            > "$stage/precompile.log"
    else
        FA4_CACHE_DIR="$cache" FA4_REQUIRE_NVRTC=1 "$stage/bins/examples/decode_bench" --precompile "${only[@]}" \
            > "$stage/precompile.log"
    fi
    # Packed: the full cache's cubins (about 60 MiB) pass the carry limit, xz makes them ~4 MiB.
    tar -C "$cache" -cf - . | xz -T0 -6 > "$dest/cache.tar.xz"
    echo "kernel cache: $(ls "$cache" | wc -l) kernels"
fi
size=$(du -sb "$dest" | cut -f1)
echo "$dest: $((size / 1024 / 1024)) MiB ($(tar -tJf "$dest/bins.tar.xz" | grep -vc '/$') files), built from $(sed -n 's/BUILD_COMMIT=//p' "$stage/bins/build.env")"
[ "$size" -le $((60 * 1024 * 1024)) ] || { echo "device_build: $dest passes 60 MiB: the carry limit is 64 MiB in all" >&2; exit 1; }
