#!/usr/bin/env bash
# Fills the folder that bench/decode_device.sh (or bench/decode_fuse_device.sh) runs from on the
# GPU machine, here (no GPU): bench/device_build.sh's archive of every test binary and the fa4
# CLI (bins.tar.xz), the decode_bench example (stripped), the kernel cache for an H200
# (`decode_bench --precompile`: the default split kernels, combines, append and the all-heads
# variants, fused and not; packed as cache.tar.xz), decode_peers.py and the device scripts.
# Prints the folder's size (the carry limit is 64 MiB).
#   bench/decode_device_build.sh [DEST]     DEST defaults to /work/main/.device/decodeprep
# PRECOMPILE=VARIANT,… caches only the grid's kernels under those variants (a minute or two
# instead of the full cache's 6–11 on two cores; decode_fuse_device.sh compiles the rest there).
# Needs NVRTC for the cache: LD_LIBRARY_PATH=/tmp/devlib-tools/nvidia/cu13/lib.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
dest=${1:-/work/main/.device/decodeprep}
bench/device_build.sh "$dest"
cargo build --release --example decode_bench
strip -o "$dest/decode_bench" target/release/examples/decode_bench
rm -rf "$dest/cache"
mkdir -p "$dest/cache"
FA4_CACHE_DIR="$dest/cache" FA4_REQUIRE_NVRTC=1 "$dest/decode_bench" --precompile ${PRECOMPILE:-} > "$dest/precompile.log"
# Packed: the cubins of the full cache (~540 kernels, 60 MiB) pass the carry limit, xz makes
# them ~4 MiB; the device scripts unpack cache.tar.xz into their cache folder.
tar -C "$dest/cache" -cf - . | xz -T0 -6 > "$dest/cache.tar.xz"
n_cached=$(ls "$dest/cache" | wc -l)
rm -rf "$dest/cache"
cp bench/decode_peers.py bench/decode_device.sh bench/decode_fuse_device.sh "$dest/"
chmod +x "$dest/decode_device.sh" "$dest/decode_fuse_device.sh"
echo "$dest: $(du -sb "$dest" | cut -f1 | awk '{printf "%.1f MiB", $1 / 1048576}') ($n_cached cached kernels), from $(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo +dirty)"
