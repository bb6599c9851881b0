// The backward's query side for the deterministic mode: dQ with no atomics. One CTA per (query
// block of BLOCK_M rows, query head, sequence), grid (query blocks, heads_q, batch); warp w owns
// rows 16·w of the block (the forward's orientation) and walks the key blocks the mask allows
// (`key_blocks`) in order, K_j and V_j double-buffered by cp.async:
//   S = Q·Kᵀ, dP = dO·Vᵀ, P = exp2(capped(S)·LOG2E − LSE·LOG2E), dS = P ∘ (dP − D) ∘ capped',
//   dQ += dS·K                                 (16 × HEAD_DIM per warp, in registers)
// Each dQ element is summed by one thread in one order: the same bits on every run. The price
// is S and dP computed a second time (the main kernel computes them for dK and dV).
// Prelude: HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS (= BLOCK_M / 16), IS_BF16, HAS_WINDOW,
// HAS_SOFTCAP.

constexpr int NT_N = BLOCK_N / 8;  // n8 tiles of a warp's S
static_assert(BLOCK_M == 16 * NUM_WARPS, "a warp owns 16 query rows");
static_assert(BLOCK_N % 16 == 0, "k16 steps over keys");

constexpr int Q_TILE = BLOCK_M * LD;   // (BLOCK_M, HEAD_DIM), padded
constexpr int KV_TILE = BLOCK_N * LD;  // (BLOCK_N, HEAD_DIM), padded
constexpr int SMEM_BYTES = 2 * (2 * Q_TILE + 4 * KV_TILE);
static_assert(SMEM_BYTES == FA4_SMEM_BYTES, "the planner's shared-memory count must match");

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1) fa4_bwd_dq(const __grid_constant__ BwdParams bp) {
    extern __shared__ __align__(128) unsigned char smem[];
    const FwdParams& p = bp.f;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;
    const int head = blockIdx.y, batch = blockIdx.z;
    const Seq s = sequence(p, batch, p.cu_seqlens_q != nullptr);
    const int m0 = blockIdx.x * BLOCK_M;
    if (m0 >= s.q_len) return;
    const int valid_m = min(BLOCK_M, s.q_len - m0);
    const int kv_head = head / p.group;

    const u32 sQ = smem_u32(smem);        // (BLOCK_M, HEAD_DIM)
    const u32 sdO = sQ + Q_TILE * 2;      // (BLOCK_M, HEAD_DIM)
    const u32 sK = sdO + Q_TILE * 2;      // 2 × (BLOCK_N, HEAD_DIM)
    const u32 sV = sK + 2 * KV_TILE * 2;  // 2 × (BLOCK_N, HEAD_DIM)

    const long long q_row = s.q_start + m0;
    const u16* gK = static_cast<const u16*>(p.k) + batch * p.k_batch_stride + s.k_start * p.k_row_stride +
                    kv_head * p.k_head_stride;
    const u16* gV = static_cast<const u16*>(p.v) + batch * p.v_batch_stride + s.k_start * p.v_row_stride +
                    kv_head * p.v_head_stride;
    const KeyBlocks kb = key_blocks(p, s, m0, m0 + valid_m - 1, true);
    auto issue = [&](int n, int buf) {
        const int rows = min(BLOCK_N, s.k_len - n * BLOCK_N);
        load_rows<BLOCK_N>(sK + buf * KV_TILE * 2, gK + n * BLOCK_N * p.k_row_stride, p.k_row_stride, rows,
                           p.head_dim, tid);
        load_rows<BLOCK_N>(sV + buf * KV_TILE * 2, gV + n * BLOCK_N * p.v_row_stride, p.v_row_stride, rows,
                           p.head_dim, tid);
    };
    if (kb.n_begin < kb.n_end) {
        load_rows<BLOCK_M>(sQ, static_cast<const u16*>(p.q) + batch * p.q_batch_stride + q_row * p.q_row_stride +
                                   head * p.q_head_stride,
                           p.q_row_stride, valid_m, p.head_dim, tid);
        load_rows<BLOCK_M>(sdO, static_cast<const u16*>(bp.d_out) + batch * bp.do_batch_stride +
                                    q_row * bp.do_row_stride + head * bp.do_head_stride,
                           bp.do_row_stride, valid_m, p.head_dim, tid);
        issue(kb.n_begin, 0);
    }
    cp_async_commit();

    // The thread's rows g and g + 8 of the warp: their LSE (log2 units) and D.
    const int wrow = 16 * warp;
    float lse2[2], dd[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int i = m0 + wrow + g + 8 * h;
        const bool ok = i < s.q_len;
        lse2[h] = ok ? lse_log2(bp, batch, head, s, i) : -NEG_INF;
        dd[h] = ok ? bp.dpsum[acc_row(bp, batch, s, i) * p.heads_q + head] : 0.0f;
    }

    float rdQ[HEAD_DIM / 8][4];  // (16, HEAD_DIM) per warp
#pragma unroll
    for (int i = 0; i < HEAD_DIM / 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) rdQ[i][e] = 0.0f;

    for (int n = kb.n_begin; n < kb.n_end; ++n) {
        const int buf = (n - kb.n_begin) & 1;
        if (n + 1 < kb.n_end) issue(n + 1, buf ^ 1);  // released by the last barrier
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const u32 sKb = sK + buf * KV_TILE * 2, sVb = sV + buf * KV_TILE * 2;

        // S = Q·Kᵀ, dP = dO·Vᵀ: (16, BLOCK_N) per warp.
        float rS[NT_N][4], rdP[NT_N][4];
#pragma unroll
        for (int i = 0; i < NT_N; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) rS[i][e] = rdP[i][e] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
            u32 qa[4], da[4];
            ldmatrix_x4(qa, sQ + at_rows(LD, wrow, kk * 16, lane));
            ldmatrix_x4(da, sdO + at_rows(LD, wrow, kk * 16, lane));
#pragma unroll
            for (int np = 0; np < BLOCK_N / 16; ++np) {
                u32 b[4];
                ldmatrix_x4(b, sKb + at_pairs(LD, np * 16, kk * 16, lane));
                mma_16816(rS[2 * np], qa, b[0], b[1]);
                mma_16816(rS[2 * np + 1], qa, b[2], b[3]);
                ldmatrix_x4(b, sVb + at_pairs(LD, np * 16, kk * 16, lane));
                mma_16816(rdP[2 * np], da, b[0], b[1]);
                mma_16816(rdP[2 * np + 1], da, b[2], b[3]);
            }
        }

        // dS (without the scale) into rdP; masked pairs set to 0.
        const bool masked = kb.masked(n);
        const int key0 = n * BLOCK_N;
#pragma unroll
        for (int nt = 0; nt < NT_N; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int h = e >> 1;
                float dsdx;
                const float x = capped(bp, rS[nt][e], dsdx);
                const float pv = exp2_approx(x * LOG2E - lse2[h]);
                float ds = pv * (rdP[nt][e] - dd[h]) * dsdx;
                if (masked && !allowed(p, s, m0 + wrow + g + 8 * h, key0 + nt * 8 + 2 * t + (e & 1))) ds = 0.0f;
                rdP[nt][e] = ds;
            }

        // dQ += dS·K: k over the block's keys.
#pragma unroll
        for (int ks = 0; ks < BLOCK_N / 16; ++ks) {
            u32 a[4];
            acc_to_a(a, rdP[2 * ks], rdP[2 * ks + 1]);
#pragma unroll
            for (int dp = 0; dp < HEAD_DIM / 16; ++dp) {
                u32 b[4];
                ldmatrix_x4_trans(b, sKb + at_rows(LD, ks * 16, dp * 16, lane));
                if (masked) zero_nonfinite4(b);
                mma_16816(rdQ[2 * dp], a, b[0], b[1]);
                mma_16816(rdQ[2 * dp + 1], a, b[2], b[3]);
            }
        }
        __syncthreads();  // everyone is done with buffer buf
    }
    cp_async_wait<0>();

    // dQ = scale · Σ dS·K, rounded; rows below the queries' end, columns below head_dim.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int i = m0 + wrow + g + 8 * h;
        if (i >= s.q_len) continue;
        u16* gdQ = static_cast<u16*>(bp.dq) + batch * bp.dq_batch_stride + (s.q_start + i) * bp.dq_row_stride +
                   head * bp.dq_head_stride;
#pragma unroll
        for (int nt = 0; nt < HEAD_DIM / 8; ++nt) {
            const int col = nt * 8 + 2 * t;
            if (col < p.head_dim) st_global_b32(gdQ + col, pack2(rdQ[nt][2 * h] * bp.scale, rdQ[nt][2 * h + 1] * bp.scale));
        }
    }
}
