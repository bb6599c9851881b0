// The backward's row kernels; grid (ceil(rows / rows per CTA), heads_q, batch). ROW_LANES
// lanes (the prelude's: HEAD_DIM / 8, at most 32) share a query row, lane l of them the 16-byte
// chunks l, l + ROW_LANES, … (8 columns each), so no lane idles at head dims below 256.
//
// - fa4_bwd_pre: D_i = Σ_d dO_id·O_id over V's head dim in f32 (from the stored, rounded O, as
//   FlashAttention does), and the row's dQ accumulator zeroed (when there is one). For the Hopper main kernel
//   (`stats_rows` > 0) D and LSE·LOG2E go to a padded layout instead (`stats_base`), the
//   grid covering every padded row of the longest sequence.
// - fa4_bwd_convert: dQ = scale · accumulator, rounded to the storage dtype. (dK and dV are
//   written by the main kernel itself: no atomics reach them.)
//
// The accumulator's layout: (acc_rows, heads_q, HEAD_DIM) row by row for the Ampere-class main
// kernel; for the Hopper one (`stats_rows` > 0) tiles of 64 rows × 64 columns, per (sequence,
// head, 64-row group of its padded rows), each in the order its consumer warpgroup holds it in
// registers (`dq_pos` in `../bwd_sm90/main.cu`). The Hopper `convert` reads those tiles whole:
// each thread 64 contiguous bytes, which hold 8 columns of two rows 8 apart.

constexpr int AUX_WARPS = 4;
constexpr int AUX_THREADS = AUX_WARPS * 32;
constexpr int ROWS_PER_CTA = AUX_THREADS / ROW_LANES;  // `config::bwd::aux_rows_per_cta`
constexpr int TILE_ROWS_PER_CTA = 32;                  // the Hopper `convert`: `CONVERT_TILE_ROWS`
static_assert(ROW_LANES == (HEAD_DIM / 8 < 32 ? HEAD_DIM / 8 : 32) && 32 % ROW_LANES == 0,
              "a row's lanes are an aligned group of a warp");

struct RowCtx {
    int batch, head, i, sub;  // sub: the lane's place among its row's ROW_LANES
    Seq s;
    bool valid;
};

__device__ __forceinline__ RowCtx row_ctx(const BwdParams& bp) {
    RowCtx r;
    r.batch = blockIdx.z;
    r.head = blockIdx.y;
    r.i = blockIdx.x * ROWS_PER_CTA + threadIdx.x / ROW_LANES;
    r.sub = threadIdx.x % ROW_LANES;
    r.s = sequence(bp.f, r.batch, bp.f.cu_seqlens_q != nullptr);
    r.valid = r.i < r.s.q_len;
    return r;
}

// Zeroes HEAD_DIM floats from `acc` (16-byte aligned: every row span is HEAD_DIM · 4 bytes).
__device__ __forceinline__ void zero_span(float* acc, int sub) {
    for (int c = sub; c * 4 < HEAD_DIM; c += ROW_LANES) *reinterpret_cast<float4*>(acc + 4 * c) = make_float4(0.f, 0.f, 0.f, 0.f);
}

extern "C" __global__ void __launch_bounds__(AUX_THREADS) fa4_bwd_pre(const __grid_constant__ BwdParams bp) {
    const RowCtx r = row_ctx(bp);
    const FwdParams& p = bp.f;
    // The Hopper main kernel's layout (`stats_base`): D, then LSE·LOG2E, every padded row of the
    // sequence written (D = 0, LSE = +inf past its end).
    const bool hopper = bp.stats_rows > 0;
    const bool padded_row = hopper && r.i < stats_len(bp, r.s);
    const long long padded = hopper ? stats_base(bp, r.batch, bp.stats_block) + static_cast<long long>(r.head) * bp.stats_rows + r.i : -1;
    const long long lse_half = hopper ? stats_half(bp) : 0;
    // The Hopper layout's accumulator: the padded row's HEAD_DIM elements of its (batch, head)
    // span (a 64-row group's tiles are 64 such spans, whichever rows' elements they hold).
    if (padded_row && bp.dq_accum != nullptr) zero_span(bp.dq_accum + padded * HEAD_DIM, r.sub);
    // The Hopper main kernel's tile counter, after the statistics (its persistent CTAs take
    // tiles from it).
    if (hopper && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 && threadIdx.x == 0)
        *reinterpret_cast<unsigned*>(bp.dpsum + 2 * lse_half) = 0u;
    // Its deterministic mode's semaphores, one per padded query block, after the counter.
    if (padded_row && r.sub == 0 && r.i % bp.stats_block == 0)
        reinterpret_cast<int*>(bp.dpsum + 2 * lse_half + 4)[padded / bp.stats_block] = 0;
    // Every lane takes part in the row's shuffles below (rows past the end sum nothing).
    float sum = 0.0f;
    if (r.valid) {
        const long long row = r.s.q_start + r.i;
        const u16* gO = static_cast<const u16*>(p.o) + r.batch * p.o_batch_stride + row * p.o_row_stride +
                        r.head * p.o_head_stride;
        const u16* gdO = static_cast<const u16*>(bp.d_out) + r.batch * bp.do_batch_stride + row * bp.do_row_stride +
                         r.head * bp.do_head_stride;
        for (int c = r.sub; c * 8 < p.head_dim_v; c += ROW_LANES) {
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
    }
#pragma unroll
    for (int off = ROW_LANES / 2; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    if (r.sub == 0) {
        if (hopper) {
            if (padded_row) {
                bp.dpsum[padded] = r.valid ? sum : 0.0f;
                bp.dpsum[lse_half + padded] = r.valid ? lse_log2(bp, r.batch, r.head, r.s, r.i) : -NEG_INF;
            }
        } else if (r.valid) {
            bp.dpsum[acc_row(bp, r.batch, r.s, r.i) * p.heads_q + r.head] = sum;
        }
    }
    if (!hopper && r.valid && bp.dq_accum != nullptr)
        zero_span(bp.dq_accum + (acc_row(bp, r.batch, r.s, r.i) * p.heads_q + r.head) * HEAD_DIM, r.sub);
}

// The Hopper layout's `convert`: CTA x takes rows [32x, 32x + 32) of every (batch, head), half
// a 64-row group: in each of its HEAD_DIM / 64 tiles, two 16-row quarters of 4 KB. Inverting
// `dq_pos`, element (row 16w + r8 + 8h, column 8q + 2m + e) of a tile (r8, m < 8 and 4;
// h, e < 2) sits at 1024w + 128q + 16·r8 + 4m + 2h + e: the 16 floats from 1024w + 128q + 16·r8
// are columns 8q .. 8q + 7 of rows 16w + r8 and 16w + r8 + 8, four (row, row + 8) column pairs.
// A thread reads such a chunk (four 16-byte loads, a warp 8 runs of 256 bytes) and writes two
// 16-byte pieces of dQ (a warp 128 contiguous bytes of each of 8 rows).
__device__ __forceinline__ void convert_tiles(const BwdParams& bp) {
    const FwdParams& p = bp.f;
    const int batch = blockIdx.z, head = blockIdx.y;
    const Seq s = sequence(p, batch, p.cu_seqlens_q != nullptr);
    const int row0 = blockIdx.x * TILE_ROWS_PER_CTA;
    if (row0 >= s.q_len) return;
    const float* group =
        bp.dq_accum + (stats_base(bp, batch, bp.stats_block) + static_cast<long long>(head) * bp.stats_rows + (row0 / 64) * 64) * HEAD_DIM;
    constexpr int CHUNKS = (TILE_ROWS_PER_CTA / 16) * HEAD_DIM;  // 64-byte chunks: 64 per quarter of a tile
    for (int k = threadIdx.x; k < CHUNKS; k += AUX_THREADS) {
        const int q = k % 8, r8 = (k / 8) % 8, tile = (k / 64) % (HEAD_DIM / 64), quarter = k / HEAD_DIM;
        const int w = (row0 % 64) / 16 + quarter;  // the tile's 16-row quarter
        const int col = 64 * tile + 8 * q;
        const int ra = row0 - row0 % 64 + 16 * w + r8;  // rows ra and ra + 8 of the sequence
        if (col >= p.head_dim || ra >= s.q_len) continue;
        const float4* src = reinterpret_cast<const float4*>(group + tile * (64 * 64) + 1024 * w + 128 * q + 16 * r8);
        float4 v[4];
#pragma unroll
        for (int m = 0; m < 4; ++m) v[m] = src[m];
        u32 a[4], b[4];
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            a[m] = pack2(v[m].x * bp.scale, v[m].y * bp.scale);
            b[m] = pack2(v[m].z * bp.scale, v[m].w * bp.scale);
        }
        u16* gdQ = static_cast<u16*>(bp.dq) + batch * bp.dq_batch_stride + (s.q_start + ra) * bp.dq_row_stride +
                   head * bp.dq_head_stride + col;
        st_global_v4(gdQ, a);
        if (ra + 8 < s.q_len) st_global_v4(gdQ + 8 * bp.dq_row_stride, b);
    }
}

extern "C" __global__ void __launch_bounds__(AUX_THREADS) fa4_bwd_convert(const __grid_constant__ BwdParams bp) {
    if (bp.stats_rows > 0) {
        convert_tiles(bp);
        return;
    }
    const RowCtx r = row_ctx(bp);
    if (!r.valid) return;
    const FwdParams& p = bp.f;
    u16* gdQ = static_cast<u16*>(bp.dq) + r.batch * bp.dq_batch_stride + (r.s.q_start + r.i) * bp.dq_row_stride +
               r.head * bp.dq_head_stride;
    const long long arow = acc_row(bp, r.batch, r.s, r.i);
    const float* acc = bp.dq_accum + (arow * p.heads_q + r.head) * HEAD_DIM;
    for (int c = r.sub; c * 8 < p.head_dim; c += ROW_LANES) {
        const float4 lo = *reinterpret_cast<const float4*>(acc + 8 * c);
        const float4 hi = *reinterpret_cast<const float4*>(acc + 8 * c + 4);
        u32 x[4] = {pack2(lo.x * bp.scale, lo.y * bp.scale), pack2(lo.z * bp.scale, lo.w * bp.scale),
                    pack2(hi.x * bp.scale, hi.y * bp.scale), pack2(hi.z * bp.scale, hi.w * bp.scale)};
        st_global_v4(gdQ + c * 8, x);
    }
}
