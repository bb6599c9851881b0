// The backward's row kernels, one warp per (query row, head); grid (ceil(seqlen_q / ROWS_PER_CTA),
// heads_q, batch). Lane l handles the 16-byte chunks l, l + 32, … of the row.
//
// - fa4_bwd_pre: D_i = Σ_d dO_id·O_id in f32 (from the stored, rounded O, as FlashAttention
//   does), and the row's dQ accumulator zeroed (when there is one). For the Hopper main kernel
//   (`stats_rows` > 0) D and LSE·LOG2E go to a padded [batch][heads_q][stats_rows] layout
//   instead, the grid covering every padded row.
// - fa4_bwd_convert: dQ = scale · accumulator, rounded to the storage dtype. (dK and dV are
//   written by the main kernel itself: no atomics reach them.)
//
// The accumulator's layout: (acc_rows, heads_q, HEAD_DIM) row by row for the Ampere-class main
// kernel; for the Hopper one (`stats_rows` > 0) tiles of 64 rows × 64 columns, per (batch, head,
// 64-row group of the padded rows), each in the order its consumer warpgroup holds it in
// registers (`dq_tile_pos`, the inverse of `../bwd_sm90/main.cu`'s `dq_pos`).

constexpr int AUX_WARPS = 4;
constexpr int ROWS_PER_CTA = AUX_WARPS;

struct RowCtx {
    int batch, head, i;
    Seq s;
    bool valid;
};

__device__ __forceinline__ RowCtx row_ctx(const BwdParams& bp) {
    RowCtx r;
    r.batch = blockIdx.z;
    r.head = blockIdx.y;
    r.i = blockIdx.x * ROWS_PER_CTA + threadIdx.x / 32;
    r.s = sequence(bp.f, r.batch, bp.f.cu_seqlens_q != nullptr);
    r.valid = r.i < r.s.q_len;
    return r;
}

extern "C" __global__ void __launch_bounds__(AUX_WARPS * 32) fa4_bwd_pre(const __grid_constant__ BwdParams bp) {
    const RowCtx r = row_ctx(bp);
    const FwdParams& p = bp.f;
    const int lane = threadIdx.x % 32;
    // The Hopper main kernel's layout (fixed-length batches): D, then LSE·LOG2E, each
    // [batch][heads_q][stats_rows], every padded row written (D = 0, LSE = +inf past the end).
    const long long padded = bp.stats_rows > 0 ? (static_cast<long long>(r.batch) * p.heads_q + r.head) * bp.stats_rows + r.i : -1;
    const long long lse_half = static_cast<long long>(p.batch) * p.heads_q * bp.stats_rows;
    // The Hopper layout's accumulator: the padded row's HEAD_DIM elements of its (batch, head)
    // span (a 64-row group's tiles are 64 such spans, whichever rows' elements they hold).
    if (padded >= 0 && r.i < bp.stats_rows && bp.dq_accum != nullptr) {
        float* acc = bp.dq_accum + padded * HEAD_DIM;
        for (int c = lane; c < HEAD_DIM; c += 32) acc[c] = 0.0f;
    }
    if (!r.valid) {
        if (padded >= 0 && r.i < bp.stats_rows && lane == 0) {
            bp.dpsum[padded] = 0.0f;
            bp.dpsum[lse_half + padded] = -NEG_INF;
        }
        return;
    }
    const long long row = r.s.q_start + r.i;
    const u16* gO = static_cast<const u16*>(p.o) + r.batch * p.o_batch_stride + row * p.o_row_stride +
                    r.head * p.o_head_stride;
    const u16* gdO = static_cast<const u16*>(bp.d_out) + r.batch * bp.do_batch_stride + row * bp.do_row_stride +
                     r.head * bp.do_head_stride;
    float sum = 0.0f;
    for (int c = lane; c * 8 < p.head_dim; c += 32) {
        u32 o[4], d[4];
        ld_global_v4(o, gO + c * 8);
        ld_global_v4(d, gdO + c * 8);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            float o0, o1, d0, d1;
            unpack2(o[e], o0, o1);
            unpack2(d[e], d0, d1);
            sum = fmaf(o0, d0, fmaf(o1, d1, sum));
        }
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    const long long arow = acc_row(bp, r.batch, r.s, r.i);
    if (lane == 0) {
        if (padded >= 0) {
            bp.dpsum[padded] = sum;
            bp.dpsum[lse_half + padded] = lse_log2(bp, r.batch, r.head, r.s, r.i);
        } else {
            bp.dpsum[arow * p.heads_q + r.head] = sum;
        }
    }
    if (bp.dq_accum != nullptr && padded < 0) {
        float* acc = bp.dq_accum + (arow * p.heads_q + r.head) * HEAD_DIM;
        for (int c = lane; c < HEAD_DIM; c += 32) acc[c] = 0.0f;
    }
}

// Element (row r, column c) of a 64 × 64 dQ tile of the Hopper layout: the wgmma accumulator
// holds it in warpgroup thread t = 32·(r / 16) + 4·(r % 8) + (c % 8) / 2, register
// i = 4·(c / 8) + 2·((r % 16) / 8) + c % 2, stored at 1024·(t / 32) + 128·(i / 4) + 4·(t % 32) + i % 4.
__device__ __forceinline__ int dq_tile_pos(int r, int c) {
    const int t = 32 * (r / 16) + 4 * (r % 8) + (c % 8) / 2;
    const int i = 4 * (c / 8) + 2 * ((r % 16) / 8) + c % 2;
    return 1024 * (t / 32) + 128 * (i / 4) + 4 * (t % 32) + i % 4;
}

extern "C" __global__ void __launch_bounds__(AUX_WARPS * 32) fa4_bwd_convert(const __grid_constant__ BwdParams bp) {
    const RowCtx r = row_ctx(bp);
    if (!r.valid) return;
    const FwdParams& p = bp.f;
    const int lane = threadIdx.x % 32;
    u16* gdQ = static_cast<u16*>(bp.dq) + r.batch * bp.dq_batch_stride + (r.s.q_start + r.i) * bp.dq_row_stride +
               r.head * bp.dq_head_stride;
    if (bp.stats_rows > 0) {
        // The Hopper layout: the row's 64-row group, then per 8 columns four pairs 4 apart.
        const float* group = bp.dq_accum + ((static_cast<long long>(r.batch) * p.heads_q + r.head) * bp.stats_rows +
                                            (r.i / 64) * 64) * HEAD_DIM;
        for (int c = lane; c * 8 < p.head_dim; c += 32) {
            const int col = c * 8;
            const float* tile = group + (col / 64) * (64 * 64) + dq_tile_pos(r.i % 64, col % 64);
            u32 x[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float2 v = *reinterpret_cast<const float2*>(tile + 4 * e);
                x[e] = pack2(v.x * bp.scale, v.y * bp.scale);
            }
            st_global_v4(gdQ + col, x);
        }
        return;
    }
    const long long arow = acc_row(bp, r.batch, r.s, r.i);
    const float* acc = bp.dq_accum + (arow * p.heads_q + r.head) * HEAD_DIM;
    for (int c = lane; c * 8 < p.head_dim; c += 32) {
        u32 x[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) x[e] = pack2(acc[c * 8 + 2 * e] * bp.scale, acc[c * 8 + 2 * e + 1] * bp.scale);
        st_global_v4(gdQ + c * 8, x);
    }
}
