#!/usr/bin/env bash
# Builds fa4-candle's CUDA test binaries and the Llama example on a machine without a GPU or a
# CUDA toolkit, to be run where there is one.
#
#   fa4-candle/gpu-build.sh OUT_DIR
#
# candle's `cuda` feature needs two things at build time:
#   1. nvcc, for candle's own kernels (candle-kernels): the PyPI one, as .ci/run installs it.
#   2. at link time, the libraries cudarc's `dynamic-linking` names (`-lcuda -lnvrtc -lcurand
#      -lcublas -lcublasLt`, and `-lnccl` because fa4 enables cudarc's NCCL types; cudart,
#      which candle-kernels links, comes with the PyPI runtime). A GPU-less
#      machine has none of them. The binaries only need the *names* to link: each reference is
#      resolved by the dynamic loader when the binary starts, against the real libraries on the
#      GPU machine. So this script makes link-time stubs: one shared library per CUDA library,
#      with the real library's SONAME (so the binary's DT_NEEDED names `libcuda.so.1`, …) and
#      every function cudarc's bindings for it declare (parsed from cudarc's own sources, so the
#      list follows the cudarc version in Cargo.lock), each an empty body never run. They are
#      found through LIBRARY_PATH, which the compiler driver reads and cargo does not fingerprint,
#      so nothing already built is rebuilt.
# Running the binaries needs the real libraries on the loader's path (driver's libcuda.so.1,
# CUDA 13's libnvrtc.so.13, libcublas(Lt).so.13, libcurand.so.10, libnccl.so.2); the stubs must
# never be on LD_LIBRARY_PATH there.
#
# Environment: FA4_CI_NVCC_DIR (PyPI nvcc, as in .ci/run), CARGO_TARGET_DIR (a target dir of its
# own is wise: candle's CUDA build is about 12 CPU-minutes from scratch), FA4_CANDLE_STUB_DIR.
set -euo pipefail
out="${1:?usage: fa4-candle/gpu-build.sh OUT_DIR}"
cd "$(dirname "$0")/.."

nvcc_dir="${FA4_CI_NVCC_DIR:-${TMPDIR:-/tmp}/fa4-ci-nvcc-13.0.88}"
if [ ! -x "$nvcc_dir/nvidia/cu13/nvvm/bin/cicc" ]; then
    echo "== installing nvcc 13.0.88 into $nvcc_dir"
    python3 -m pip install --quiet --no-deps --target "$nvcc_dir" \
        nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-runtime==13.0.96 \
        nvidia-cuda-crt==13.0.88 nvidia-cuda-cccl==13.0.85
fi
cuda_home="$nvcc_dir/nvidia/cu13"
export CUDA_HOME="$cuda_home" CUDA_COMPUTE_CAP=90 NVCC_APPEND_FLAGS="-I$cuda_home/include/cccl"
export PATH="$cuda_home/bin:$PATH"

# cudarc's source, as Cargo.lock pins it.
cudarc_src="$(cargo metadata --format-version 1 --locked | python3 -c '
import json, os, sys
pkgs = [p for p in json.load(sys.stdin)["packages"] if p["name"] == "cudarc"]
print(os.path.dirname(pkgs[0]["manifest_path"]))')"

stubs="${FA4_CANDLE_STUB_DIR:-${TMPDIR:-/tmp}/fa4-candle-link-stubs}"
mkdir -p "$stubs"
# cudarc binding module -> library name -> SONAME of the CUDA 13 library it stands for.
while read -r module lib soname; do
    src="$cudarc_src/src/$module/sys/mod.rs"
    # Under `dynamic-linking` each binding is `extern "C" { fn NAME(...) }`.
    grep -A1 'extern "C" {' "$src" | grep -oP '^\s*fn \K\w+' | sort -u |
        sed 's/.*/void &(void) {}/' >"$stubs/$lib.c"
    cc -shared -fPIC -Wl,-soname,"$soname" -o "$stubs/lib$lib.so" "$stubs/$lib.c"
done <<'EOF'
driver cuda libcuda.so.1
nvrtc nvrtc libnvrtc.so.13
curand curand libcurand.so.10
cublas cublas libcublas.so.13
cublaslt cublasLt libcublasLt.so.13
nccl nccl libnccl.so.2
EOF
# candle-kernels links cudart itself (`-lcudart`): the PyPI runtime has the real library, under
# its SONAME only.
ln -sf "$cuda_home/lib/libcudart.so.13" "$stubs/libcudart.so"
export LIBRARY_PATH="$stubs${LIBRARY_PATH:+:$LIBRARY_PATH}"

# Prints "NAME KIND PATH" for each executable a cargo command's JSON messages report.
executables() {
    python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["target"]["name"], m["target"]["kind"][0], m["executable"])'
}
mkdir -p "$out"
echo "== cargo test --no-run -p fa4-candle --features cuda; cargo build --examples"
{
    cargo test --release --locked -p fa4-candle --features cuda --tests --no-run \
        --message-format json-render-diagnostics | executables
    cargo build --release --locked -p fa4-candle --features cuda --examples \
        --message-format json-render-diagnostics | executables
} | while read -r name kind exe; do
    # Test binaries are named after their file, examples get a prefix.
    dest="$out/$name"
    [ "$kind" = "example" ] && dest="$out/example-$name"
    cp "$exe" "$dest" && strip "$dest"
    needed="$(readelf -d "$dest" | grep -oP 'NEEDED.*\[\K[^]]+' | tr '\n' ' ')"
    echo "   $dest: needs $needed"
done
