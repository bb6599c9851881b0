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
// `params.cuh` and this file. One warp per workspace row; lane l owns the HEAD_DIM / 32
// contiguous columns from l · HEAD_DIM / 32.
//
// Latency, not bandwidth, bounds this kernel (a few hundred KB per call): every load of a row
// is issued before the first is used. Each lane computes the weights of the splits it owns, and
// the O loads of SPLIT_UNROLL splits at a time are in flight together (predicated off for the
// parts that weigh 0, which are never read). The first version walked the splits one by one,
// each a dependent LSE load and then an O load: 11 µs per call under Nsight Compute on an H200
// whatever the problem size (16 splits), against 3.4–4 µs for cuDNN's reduction.

constexpr int COMBINE_WARPS = 4;
constexpr int COLS_PER_LANE = HEAD_DIM / 32;
constexpr int SPLIT_UNROLL = 8;
static_assert(HEAD_DIM % 64 == 0, "a row's columns split evenly over the lanes, in pairs");

// exp(LSE_s − M): 0 for a part that saw no key; with +inf parts (M = +inf), 1 for each of them.
__device__ __forceinline__ float combine_weight(float l, float mx, int infs) {
    if (l == NEG_INF) return 0.0f;
    return infs > 0 ? (l == mx ? 1.0f : 0.0f) : __expf(l - mx);
}

// Merges the splits of workspace row `row` (the whole warp calls it): this lane's columns of O
// into `acc` and the row's LSE into `lse`.
__device__ __forceinline__ void combine_row(const DecodeParams& d, long long row, int lane,
                                            float (&acc)[COLS_PER_LANE], float& lse) {
    const int n = d.num_splits;
    // The largest LSE, whether any is NaN, and how many parts are +inf.
    float mx = NEG_INF;
    bool nan = false;
    int infs = 0;
    float first = NEG_INF;  // the LSE of split `lane` (n <= 32 is the common case)
    for (int s = lane; s < n; s += 32) {
        const float l = d.lse_part[s * d.part_rows + row];
        if (s == lane) first = l;
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

#pragma unroll
    for (int i = 0; i < COLS_PER_LANE; ++i) acc[i] = 0.0f;
    if (nan) {
        lse = __int_as_float(0x7fc00000);
#pragma unroll
        for (int i = 0; i < COLS_PER_LANE; ++i) acc[i] = lse;
        return;
    }
    if (mx == NEG_INF) {
        lse = NEG_INF;  // no part saw a key
        return;
    }
    // Weights exp(LSE_s − M) (1 for each +inf part when M = +inf), normalised by their sum.
    float total = 0.0f;  // this lane's splits' weights; summed over the warp below
    for (int base = 0; base < n; base += 32) {
        const int mine = base + lane;
        const float l = base == 0 ? first : (mine < n ? d.lse_part[mine * d.part_rows + row] : NEG_INF);
        const float w = combine_weight(l, mx, infs);  // 0 past the last split
        total += w;
        const int cnt = min(32, n - base);
        for (int j0 = 0; j0 < cnt; j0 += SPLIT_UNROLL) {  // j0 <= 24: every j below is a lane
            float ws[SPLIT_UNROLL];
            float2 v[SPLIT_UNROLL][COLS_PER_LANE / 2];
#pragma unroll
            for (int u = 0; u < SPLIT_UNROLL; ++u) {
                ws[u] = __shfl_sync(0xffffffffu, w, j0 + u);
                const float2* src = reinterpret_cast<const float2*>(
                    d.o_part + ((base + j0 + u) * d.part_rows + row) * HEAD_DIM + lane * COLS_PER_LANE);
#pragma unroll
                for (int c = 0; c < COLS_PER_LANE / 2; ++c)
                    v[u][c] = ws[u] != 0.0f ? src[c] : make_float2(0.0f, 0.0f);
            }
#pragma unroll
            for (int u = 0; u < SPLIT_UNROLL; ++u)
#pragma unroll
                for (int c = 0; c < COLS_PER_LANE / 2; ++c) {
                    acc[2 * c] += ws[u] * v[u][c].x;
                    acc[2 * c + 1] += ws[u] * v[u][c].y;
                }
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o /= 2) total += __shfl_xor_sync(0xffffffffu, total, o);
    const float inv = 1.0f / total;
#pragma unroll
    for (int i = 0; i < COLS_PER_LANE; ++i) acc[i] *= inv;
    lse = infs > 0 ? mx : mx + __logf(total);
}

extern "C" __global__ void __launch_bounds__(COMBINE_WARPS * 32) fa4_decode_combine(const __grid_constant__ DecodeParams d) {
    const FwdParams& p = d.p;
    const int lane = threadIdx.x % 32;
    const long long row = static_cast<long long>(blockIdx.x) * COMBINE_WARPS + threadIdx.x / 32;
    if (row >= d.part_rows) return;  // whole warps: part_rows is the same for every lane
    float acc[COLS_PER_LANE], lse;
    combine_row(d, row, lane, acc, lse);

    // The workspace row is (query row among all, head): find O's and LSE's places.
    const long long q_row = row / p.heads_q;
    const int head = static_cast<int>(row % p.heads_q);
    const bool packed = p.cu_seqlens_q != nullptr;
    const long long bi = packed ? 0 : q_row / p.seqlen_q;
    const long long qi = packed ? q_row : q_row % p.seqlen_q;
    u16* out = static_cast<u16*>(p.o) + bi * p.o_batch_stride + qi * p.o_row_stride + head * p.o_head_stride +
               lane * COLS_PER_LANE;
#pragma unroll
    for (int i = 0; i < COLS_PER_LANE; ++i) out[i] = static_cast<u16>(pack2(acc[i], 0.0f) & 0xffffu);
    if (lane == 0 && p.lse != nullptr) p.lse[bi * p.lse_batch_stride + head * p.lse_head_stride + qi] = lse;
}
