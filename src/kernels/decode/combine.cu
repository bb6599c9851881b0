// The combine of split-KV decode: merges the `num_splits` partial results of each (query row,
// head) of the workspace into O (16-bit) and LSE, as a second launch after the split kernel
// (the variants without `fuse`). The merge itself is `merge.cuh`'s merge_split_row, which the
// split kernels' fused combine shares.
//
// Self-contained; the prelude defines IS_BF16 and HEAD_DIM; then `../common/{base,params}.cuh`,
// `params.cuh`, `merge.cuh` and this file. One warp per workspace row.

constexpr int COMBINE_WARPS = 4;

extern "C" __global__ void __launch_bounds__(COMBINE_WARPS * 32) fa4_decode_combine(const __grid_constant__ DecodeParams d) {
    const int lane = threadIdx.x % 32;
    const long long row = static_cast<long long>(blockIdx.x) * COMBINE_WARPS + threadIdx.x / 32;
    if (row >= d.part_rows) return;
    merge_split_row(d, row, lane);
}
