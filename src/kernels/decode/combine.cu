// The combine of split-KV decode: the GPU twin of `fa4::combine` (natural-log LSE). Merges the
// `num_splits` partial results of each (query row, head) of the workspace into O (16-bit) and
// LSE:
//
//   LSE = ln Σ_s exp(LSE_s),  O = Σ_s exp(LSE_s − LSE) · O_s
//
// evaluated relative to the largest LSE_s. A part with LSE_s = −inf saw no key: it contributes
// nothing and its O_s is not read. All −inf: O = 0, LSE = −inf. A +inf part dominates (O is the
// mean of the +inf parts' O_s); a NaN LSE_s makes O and LSE NaN.
//
// Self-contained; the prelude defines IS_BF16 and HEAD_DIM; then `../common/{base,params}.cuh`,
// `params.cuh` and this file. One warp per workspace row; lane l owns columns l + 32·i.

constexpr int COMBINE_WARPS = 4;
constexpr int COLS_PER_LANE = HEAD_DIM / 32;
static_assert(HEAD_DIM % 32 == 0, "a row's columns split evenly over the lanes");

extern "C" __global__ void __launch_bounds__(COMBINE_WARPS * 32) fa4_decode_combine(const __grid_constant__ DecodeParams d) {
    const FwdParams& p = d.p;
    const int lane = threadIdx.x % 32;
    const long long row = static_cast<long long>(blockIdx.x) * COMBINE_WARPS + threadIdx.x / 32;
    if (row >= d.part_rows) return;
    const int n = d.num_splits;

    // The largest LSE, whether any is NaN, and how many parts are +inf.
    float mx = NEG_INF;
    bool nan = false;
    int infs = 0;
    for (int s = lane; s < n; s += 32) {
        const float l = d.lse_part[s * d.part_rows + row];
        nan |= l != l;
        infs += l == -NEG_INF;
        mx = fmaxf(mx, l);
    }
#pragma unroll
    for (int o = 16; o > 0; o /= 2) {
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        infs += __shfl_xor_sync(0xffffffffu, infs, o);
    }
    nan = __any_sync(0xffffffffu, nan);

    float acc[COLS_PER_LANE];
#pragma unroll
    for (int i = 0; i < COLS_PER_LANE; ++i) acc[i] = 0.0f;
    float lse;
    if (nan) {
        lse = __int_as_float(0x7fc00000);
#pragma unroll
        for (int i = 0; i < COLS_PER_LANE; ++i) acc[i] = lse;
    } else if (mx == NEG_INF) {
        lse = NEG_INF;  // no part saw a key
    } else {
        // Weights exp(LSE_s − M) (1 for each +inf part when M = +inf), normalised by their sum.
        float total = 0.0f;
        for (int s = 0; s < n; ++s) {
            const float l = d.lse_part[s * d.part_rows + row];
            if (l == NEG_INF) continue;
            const float w = infs > 0 ? (l == mx ? 1.0f : 0.0f) : __expf(l - mx);
            if (w == 0.0f) continue;
            total += w;
            const float* src = d.o_part + (s * d.part_rows + row) * HEAD_DIM + lane;
#pragma unroll
            for (int i = 0; i < COLS_PER_LANE; ++i) acc[i] += w * src[32 * i];
        }
        const float inv = 1.0f / total;
#pragma unroll
        for (int i = 0; i < COLS_PER_LANE; ++i) acc[i] *= inv;
        lse = infs > 0 ? mx : mx + __logf(total);
    }

    // The workspace row is (query row among all, head): find O's and LSE's places.
    const long long q_row = row / p.heads_q;
    const int head = static_cast<int>(row % p.heads_q);
    const bool packed = p.cu_seqlens_q != nullptr;
    const long long bi = packed ? 0 : q_row / p.seqlen_q;
    const long long qi = packed ? q_row : q_row % p.seqlen_q;
    u16* out = static_cast<u16*>(p.o) + bi * p.o_batch_stride + qi * p.o_row_stride + head * p.o_head_stride;
#pragma unroll
    for (int i = 0; i < COLS_PER_LANE; ++i) out[lane + 32 * i] = static_cast<u16>(pack2(acc[i], 0.0f) & 0xffffu);
    if (lane == 0 && p.lse != nullptr) p.lse[bi * p.lse_batch_stride + head * p.lse_head_stride + qi] = lse;
}
