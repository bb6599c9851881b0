// The merge of split-KV decode partials, one workspace row per warp: the GPU twin of
// `fa4::combine` (natural-log LSE), shared by the combine kernel (`combine.cu`) and the split
// kernels' fused combine (FUSE, `splitkv.cu` / `heads.cu`: the CTA of a row tile that arrives
// last merges the tile's rows, with no second launch). Merges the `num_splits` partial results
// of a (query row, head) of the workspace into O (16-bit) and LSE:
//
//   LSE = ln Σ_s exp(LSE_s),  O = Σ_s exp(LSE_s − LSE) · O_s
//
// evaluated relative to the largest LSE_s. A part with LSE_s = −inf saw no key: it contributes
// nothing and its O_s is not read. All −inf: O = 0, LSE = −inf. A +inf part dominates (O is the
// mean of the +inf parts' O_s); a NaN LSE_s makes O and LSE NaN.
//
// Needs the prelude's IS_BF16 and HEAD_DIM, `../common/{base,params}.cuh` and `params.cuh`.
// Every lane of the warp calls it with the same row; lane l owns the HEAD_DIM / 32 contiguous
// columns from l · HEAD_DIM / 32.
//
// Latency, not bandwidth, bounds the merge (a few hundred KB per call): every load of a row is
// issued before the first is used. Each lane computes the weights of the splits it owns, and
// the O loads of MERGE_UNROLL splits at a time are in flight together (predicated off for the
// parts that weigh +0, which are never read). The first version walked the splits one by one, a
// dependent LSE load and then an O load each: 11 µs per combine launch under Nsight Compute on
// an H200 whatever the problem size (16 splits), against 3.4–4 µs for cuDNN's reduction.

constexpr int MERGE_COLS_PER_LANE = HEAD_DIM / 32;
constexpr int MERGE_UNROLL = 8;
static_assert(HEAD_DIM % 64 == 0, "a row's columns split evenly over the lanes, in pairs");

// exp(LSE_s − M): 0 for a part that saw no key; with +inf parts (M = +inf), 1 for each of them.
// A part that saw keys but whose weight underflows (LSE_s 87 nats or more under M) weighs −0:
// its O_s is still read, so that a NaN there (a NaN in V leaves LSE_s finite) reaches O, as in
// `fa4::combine`.
__device__ __forceinline__ float merge_weight(float l, float mx, int infs) {
    if (l == NEG_INF) return 0.0f;
    if (infs > 0) return l == mx ? 1.0f : 0.0f;
    const float w = __expf(l - mx);
    return w == 0.0f ? -0.0f : w;
}

// Merges workspace row `row` (query row among all · heads_q + head) and writes O and LSE at the
// places the split kernel would have with one split.
__device__ __forceinline__ void merge_split_row(const DecodeParams& d, long long row, int lane) {
    const FwdParams& p = d.p;
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

    float acc[MERGE_COLS_PER_LANE];
#pragma unroll
    for (int i = 0; i < MERGE_COLS_PER_LANE; ++i) acc[i] = 0.0f;
    float lse;
    if (nan) {
        lse = __int_as_float(0x7fc00000);
#pragma unroll
        for (int i = 0; i < MERGE_COLS_PER_LANE; ++i) acc[i] = lse;
    } else if (mx == NEG_INF) {
        lse = NEG_INF;  // no part saw a key
    } else {
        // Weights exp(LSE_s − M) (1 for each +inf part when M = +inf), normalised by their sum.
        float total = 0.0f;  // this lane's splits' weights; summed over the warp below
        for (int base = 0; base < n; base += 32) {
            const int mine = base + lane;
            const float l = base == 0 ? first : (mine < n ? d.lse_part[mine * d.part_rows + row] : NEG_INF);
            const float w = merge_weight(l, mx, infs);  // 0 past the last split
            total += w;
            const int cnt = min(32, n - base);
            for (int j0 = 0; j0 < cnt; j0 += MERGE_UNROLL) {  // j0 <= 24: every j below is a lane
                float ws[MERGE_UNROLL];
                float2 v[MERGE_UNROLL][MERGE_COLS_PER_LANE / 2];
#pragma unroll
                for (int u = 0; u < MERGE_UNROLL; ++u) {
                    ws[u] = __shfl_sync(0xffffffffu, w, j0 + u);
                    const float2* src = reinterpret_cast<const float2*>(
                        d.o_part + ((base + j0 + u) * d.part_rows + row) * HEAD_DIM + lane * MERGE_COLS_PER_LANE);
#pragma unroll
                    for (int c = 0; c < MERGE_COLS_PER_LANE / 2; ++c)
                        v[u][c] = __float_as_uint(ws[u]) != 0u ? src[c] : make_float2(0.0f, 0.0f);
                }
#pragma unroll
                for (int u = 0; u < MERGE_UNROLL; ++u)
#pragma unroll
                    for (int c = 0; c < MERGE_COLS_PER_LANE / 2; ++c) {
                        acc[2 * c] += ws[u] * v[u][c].x;
                        acc[2 * c + 1] += ws[u] * v[u][c].y;
                    }
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o /= 2) total += __shfl_xor_sync(0xffffffffu, total, o);
        const float inv = 1.0f / total;
#pragma unroll
        for (int i = 0; i < MERGE_COLS_PER_LANE; ++i) acc[i] *= inv;
        lse = infs > 0 ? mx : mx + __logf(total);
    }

    // The workspace row is (query row among all, head): find O's and LSE's places.
    const long long q_row = row / p.heads_q;
    const int head = static_cast<int>(row % p.heads_q);
    const bool packed = p.cu_seqlens_q != nullptr;
    const long long bi = packed ? 0 : q_row / p.seqlen_q;
    const long long qi = packed ? q_row : q_row % p.seqlen_q;
    u16* out = static_cast<u16*>(p.o) + bi * p.o_batch_stride + qi * p.o_row_stride + head * p.o_head_stride +
               lane * MERGE_COLS_PER_LANE;
#pragma unroll
    for (int i = 0; i < MERGE_COLS_PER_LANE; ++i) out[i] = static_cast<u16>(pack2(acc[i], 0.0f) & 0xffffu);
    if (lane == 0 && p.lse != nullptr) p.lse[bi * p.lse_batch_stride + head * p.lse_head_stride + qi] = lse;
}

#if defined(FUSE) && FUSE
// The arrival of a split CTA at its row tile's counter (the fused combine), called by every
// thread once the CTA's partial rows are written; true in the CTA that arrives last, which then
// merges the tile's rows with merge_split_row. The counter of CTA row tile (blockIdx.x,
// blockIdx.y) lives in d.counters (zeroed when the workspace is allocated); the last CTA sets it
// back to 0, so every launch starts from zero (no other CTA of the launch touches it after the
// last arrival, and the next launch is ordered after this one by the stream).
//
// Ordering (the pattern of cooperative groups' grid sync): __syncthreads orders every thread's
// partial stores before thread 0's __threadfence and its acq_rel atomic at gpu scope (release:
// the CTA's partials are visible before its arrival counts); in the last CTA the atomic's
// acquire and a second fence make every other CTA's partials visible to thread 0, and the
// barrier of __syncthreads_or passes them on to the CTA's other threads.
__device__ __forceinline__ bool fused_combine_arrive(const DecodeParams& d) {
    __syncthreads();
    bool last = false;
    if (threadIdx.x == 0) {
        unsigned int* counter = d.counters + static_cast<long long>(blockIdx.x) * gridDim.y + blockIdx.y;
        __threadfence();
        unsigned int arrived;
        asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;\n" : "=r"(arrived) : "l"(counter) : "memory");
        last = arrived == static_cast<unsigned int>(d.num_splits - 1);
        if (last) {
            __threadfence();
            asm volatile("st.relaxed.gpu.global.u32 [%0], 0;\n" ::"l"(counter) : "memory");
        }
    }
    return __syncthreads_or(last) != 0;
}
#endif
