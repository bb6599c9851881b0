// Ampere-class FlashAttention backward, key side: dK, dV and (unless DETERMINISTIC) the dQ
// accumulation. mma.sync m16n8k16 (fp16/bf16 in, f32 accumulate), cp.async, ldmatrix; runs on
// sm_80 and later. The planner (`config::bwd`) prepends HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS,
// DSPLIT, IS_BF16, HAS_WINDOW, HAS_SOFTCAP, DETERMINISTIC; then come the shared layer, the
// Ampere-class PTX wrappers and this family's params, wrappers and tiles.
//
// One CTA per (key block of BLOCK_N keys, KV head, sequence): grid (key blocks, heads_kv,
// batch). K_j and V_j stay in shared memory while the CTA walks the query heads of its KV head
// (GQA: their dK, dV sum in registers, no atomics) and, per head, the query blocks the mask
// lets see its keys (`query_blocks`), Q_i and dO_i double-buffered by cp.async. Per block:
//   Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ                    (16 keys × BLOCK_M queries per warp)
//   Pᵀ = exp2(capped(Sᵀ)·LOG2E − LSE_i·LOG2E)  recomputed from the forward's LSE
//   dSᵀ = Pᵀ ∘ (dPᵀ − D_i) ∘ capped'           (the softcap derivative; the scale comes last)
//   dV += Pᵀ·dO, dK += dSᵀ·Q                   (16 keys × HEAD_DIM / DSPLIT per warp)
//   dQ_i += dS·K                               (f32 red.add into the accumulator)
// Warp w owns keys 16·(w % KEY_WARPS) of the block for Sᵀ and dPᵀ and columns
// (w / KEY_WARPS)·DW of dK and dV (DSPLIT > 1 recomputes Sᵀ and dPᵀ in each column group, so
// that d256's dK and dV fit in registers); for dQ the warps tile (BLOCK_M, HEAD_DIM) instead,
// reading dSᵀ back from shared memory.

constexpr int KEY_WARPS = BLOCK_N / 16;
constexpr int DW = HEAD_DIM / DSPLIT;            // dK/dV columns per warp
constexpr int MW = BLOCK_M / 16;                 // dQ row groups
constexpr int QDW = HEAD_DIM / (NUM_WARPS / MW); // dQ columns per warp
constexpr int LDS = BLOCK_M + CHUNK_ELEMS;       // padded row of dSᵀ, (BLOCK_N, BLOCK_M)
constexpr int NT_M = BLOCK_M / 8;                // n8 tiles of a warp's Sᵀ
static_assert(NUM_WARPS == KEY_WARPS * DSPLIT, "the warps split keys × dK/dV columns");
static_assert(NUM_WARPS % MW == 0 && QDW % 16 == 0, "the warps tile dQ in 16 × 16 blocks");
static_assert(DW % 16 == 0 && BLOCK_M % 16 == 0, "k16/n16 steps");

constexpr int KV_TILE = BLOCK_N * LD;   // (BLOCK_N, HEAD_DIM), padded
constexpr int QO_TILE = BLOCK_M * LD;   // (BLOCK_M, HEAD_DIM), padded
constexpr int DS_TILE = BLOCK_N * LDS;  // (BLOCK_N, BLOCK_M), padded
constexpr int SMEM_BYTES = 2 * (2 * KV_TILE + 4 * QO_TILE + DS_TILE) + 4 * 2 * BLOCK_M * 4;
static_assert(SMEM_BYTES == FA4_SMEM_BYTES, "the planner's shared-memory count must match");

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1) fa4_bwd_main(const __grid_constant__ BwdParams bp) {
    extern __shared__ __align__(128) unsigned char smem[];
    const FwdParams& p = bp.f;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;
    const int n_block = blockIdx.x, kv_head = blockIdx.y, batch = blockIdx.z;
    const Seq s = sequence(p, batch, p.cu_seqlens_q != nullptr);
    const int n0 = n_block * BLOCK_N;
    if (n0 >= s.k_len) return;
    const int valid_n = min(BLOCK_N, s.k_len - n0);

    const u32 sK = smem_u32(smem);               // (BLOCK_N, HEAD_DIM)
    const u32 sV = sK + KV_TILE * 2;             // (BLOCK_N, HEAD_DIM)
    const u32 sQ = sV + KV_TILE * 2;             // 2 × (BLOCK_M, HEAD_DIM)
    const u32 sdO = sQ + 2 * QO_TILE * 2;        // 2 × (BLOCK_M, HEAD_DIM)
    const u32 sdS = sdO + 2 * QO_TILE * 2;       // (BLOCK_N, BLOCK_M): dSᵀ
    float* sL = reinterpret_cast<float*>(smem + 2 * (2 * KV_TILE + 4 * QO_TILE + DS_TILE));  // 2 × (BLOCK_M): LSE·LOG2E
    float* sD = sL + 2 * BLOCK_M;                                                             // 2 × (BLOCK_M): D

    // The trip: (query head of the group, query block), heads outer. A key block no query
    // sees has none: its dK, dV are written as zeros.
    const QueryBlocks qb = query_blocks(p, s, n0, n0 + valid_n - 1, BLOCK_M);
    const bool keys_partial = valid_n < BLOCK_N;  // padded keys are masked too
    const int per_head = max(0, qb.m_end - qb.m_begin);
    const int trips = per_head * p.group;

    // Issues trip `it`'s Q, dO (cp.async) and LSE, D (plain stores) into buffer `buf`.
    auto issue = [&](int it, int buf) {
        const int head = kv_head * p.group + it / per_head;
        const int r0 = (qb.m_begin + it % per_head) * BLOCK_M;
        const int valid_m = min(BLOCK_M, s.q_len - r0);
        const long long q_row = s.q_start + r0;
        load_rows<BLOCK_M>(sQ + buf * QO_TILE * 2,
                           static_cast<const u16*>(p.q) + batch * p.q_batch_stride + q_row * p.q_row_stride +
                               head * p.q_head_stride,
                           p.q_row_stride, valid_m, p.head_dim, tid);
        load_rows<BLOCK_M>(sdO + buf * QO_TILE * 2,
                           static_cast<const u16*>(bp.d_out) + batch * bp.do_batch_stride + q_row * bp.do_row_stride +
                               head * bp.do_head_stride,
                           bp.do_row_stride, valid_m, p.head_dim, tid);
        for (int r = tid; r < BLOCK_M; r += NUM_THREADS) {
            const bool ok = r < valid_m;
            sL[buf * BLOCK_M + r] = ok ? lse_log2(bp, batch, head, s, r0 + r) : -NEG_INF;
            sD[buf * BLOCK_M + r] = ok ? bp.dpsum[acc_row(bp, batch, s, r0 + r) * p.heads_q + head] : 0.0f;
        }
    };

    const int kw = warp % KEY_WARPS, dw = warp / KEY_WARPS;
    const int key_row = 16 * kw;  // the warp's keys within the block
    float rdV[DW / 8][4], rdK[DW / 8][4];  // (16, DW) per warp
#pragma unroll
    for (int i = 0; i < DW / 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) rdV[i][e] = rdK[i][e] = 0.0f;

    const long long k_row0 = s.k_start + n0;
    if (trips > 0) {
        load_rows<BLOCK_N>(sK, static_cast<const u16*>(p.k) + batch * p.k_batch_stride + k_row0 * p.k_row_stride +
                                   kv_head * p.k_head_stride,
                           p.k_row_stride, valid_n, p.head_dim, tid);
        load_rows<BLOCK_N>(sV, static_cast<const u16*>(p.v) + batch * p.v_batch_stride + k_row0 * p.v_row_stride +
                                   kv_head * p.v_head_stride,
                           p.v_row_stride, valid_n, p.head_dim, tid);
        issue(0, 0);
    }
    cp_async_commit();
    for (int it = 0; it < trips; ++it) {
        const int buf = it & 1;
        if (it + 1 < trips) issue(it + 1, buf ^ 1);  // buffer buf ^ 1 was released by the last barrier
        cp_async_commit();
        cp_async_wait<1>();  // K, V and trip it's tiles have landed (this thread's copies) …
        __syncthreads();     // … and everyone's, with the plain LSE/D stores.
        const int head = kv_head * p.group + it / per_head;
        const int m = qb.m_begin + it % per_head;
        const int r0 = m * BLOCK_M;
        const u32 sQb = sQ + buf * QO_TILE * 2, sdOb = sdO + buf * QO_TILE * 2;
        const float* lse2 = sL + buf * BLOCK_M;
        const float* dd = sD + buf * BLOCK_M;

        // Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ: (16, BLOCK_M) per warp.
        float sT[NT_M][4], dpT[NT_M][4];
#pragma unroll
        for (int i = 0; i < NT_M; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) sT[i][e] = dpT[i][e] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
            u32 ka[4], va[4];
            ldmatrix_x4(ka, sK + at_rows(LD, key_row, kk * 16, lane));
            ldmatrix_x4(va, sV + at_rows(LD, key_row, kk * 16, lane));
#pragma unroll
            for (int np = 0; np < BLOCK_M / 16; ++np) {
                u32 b[4];
                ldmatrix_x4(b, sQb + at_pairs(LD, np * 16, kk * 16, lane));
                mma_16816(sT[2 * np], ka, b[0], b[1]);
                mma_16816(sT[2 * np + 1], ka, b[2], b[3]);
                ldmatrix_x4(b, sdOb + at_pairs(LD, np * 16, kk * 16, lane));
                mma_16816(dpT[2 * np], va, b[0], b[1]);
                mma_16816(dpT[2 * np + 1], va, b[2], b[3]);
            }
        }

        // Pᵀ into sT, dSᵀ (without the scale) into dpT. Masked pairs are set to 0, not
        // multiplied: a NaN in a masked key's V must not reach rows that never see it.
        const bool masked = keys_partial || qb.masked(m);
#pragma unroll
        for (int nt = 0; nt < NT_M; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int i = nt * 8 + 2 * t + (e & 1);  // query within the block
                float dsdx;
                const float x = capped(bp, sT[nt][e], dsdx);
                float pv = exp2_approx(x * LOG2E - lse2[i]);
                float ds = pv * (dpT[nt][e] - dd[i]) * dsdx;
                if (masked && !allowed(p, s, r0 + i, n0 + key_row + g + 8 * (e >> 1))) pv = ds = 0.0f;
                sT[nt][e] = pv;
                dpT[nt][e] = ds;
            }

        // dV += Pᵀ·dO, dK += dSᵀ·Q: (16, DW) per warp, k over the block's queries. (dO is not
        // cleaned in masked tiles: a NaN in dO_i must reach the dV of the keys row i sees, and
        // P_ij finite would drop it; so it also reaches the dV of the keys of row i's diagonal
        // tiles that it does not see.)
#pragma unroll
        for (int ks = 0; ks < BLOCK_M / 16; ++ks) {
            u32 pa[4], da[4];
            acc_to_a(pa, sT[2 * ks], sT[2 * ks + 1]);
            acc_to_a(da, dpT[2 * ks], dpT[2 * ks + 1]);
#pragma unroll
            for (int dp = 0; dp < DW / 16; ++dp) {
                const int col = dw * DW + dp * 16;
                u32 b[4];
                ldmatrix_x4_trans(b, sdOb + at_rows(LD, ks * 16, col, lane));
                mma_16816(rdV[2 * dp], pa, b[0], b[1]);
                mma_16816(rdV[2 * dp + 1], pa, b[2], b[3]);
                ldmatrix_x4_trans(b, sQb + at_rows(LD, ks * 16, col, lane));
                if (masked) zero_nonfinite4(b);
                mma_16816(rdK[2 * dp], da, b[0], b[1]);
                mma_16816(rdK[2 * dp + 1], da, b[2], b[3]);
            }
        }

        if constexpr (!DETERMINISTIC) {
            // dSᵀ to shared memory (one column group writes it), then dQ_i += dS·K.
            if (dw == 0) {
#pragma unroll
                for (int nt = 0; nt < NT_M; ++nt)
#pragma unroll
                    for (int h = 0; h < 2; ++h)
                        st_shared_b32(sdS + static_cast<u32>(((key_row + g + 8 * h) * LDS + nt * 8 + 2 * t) * 2),
                                      pack2(dpT[nt][2 * h], dpT[nt][2 * h + 1]));
            }
            __syncthreads();  // dSᵀ complete
            const int qrow = 16 * (warp % MW), qcol = (warp / MW) * QDW;
            float rdQ[QDW / 8][4];  // (16, QDW) per warp
#pragma unroll
            for (int i = 0; i < QDW / 8; ++i)
#pragma unroll
                for (int e = 0; e < 4; ++e) rdQ[i][e] = 0.0f;
#pragma unroll
            for (int ks = 0; ks < BLOCK_N / 16; ++ks) {
                u32 a[4];
                ldmatrix_x4_trans(a, sdS + at_pairs(LDS, ks * 16, qrow, lane));
#pragma unroll
                for (int dp = 0; dp < QDW / 16; ++dp) {
                    u32 b[4];
                    ldmatrix_x4_trans(b, sK + at_rows(LD, ks * 16, qcol + dp * 16, lane));
                    if (masked) zero_nonfinite4(b);
                    mma_16816(rdQ[2 * dp], a, b[0], b[1]);
                    mma_16816(rdQ[2 * dp + 1], a, b[2], b[3]);
                }
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int i = r0 + qrow + g + 8 * h;
                if (i < s.q_len) {
                    float* acc = bp.dq_accum + (acc_row(bp, batch, s, i) * p.heads_q + head) * HEAD_DIM + qcol + 2 * t;
#pragma unroll
                    for (int nt = 0; nt < QDW / 8; ++nt) {
                        red_add_f32x2(acc + nt * 8, rdQ[nt][2 * h], rdQ[nt][2 * h + 1]);
                    }
                }
            }
        }
        __syncthreads();  // everyone is done with buffer buf and dSᵀ
    }
    cp_async_wait<0>();  // the last (empty) groups, so that no copy outlives the CTA

    // dK = scale · Σ dSᵀ·Q and dV, rounded, rows below the keys' end, columns below head_dim.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int j = key_row + g + 8 * h;
        if (j >= valid_n) continue;
        const long long row = k_row0 + j;
        u16* gdK = static_cast<u16*>(bp.dk) + batch * bp.dk_batch_stride + row * bp.dk_row_stride +
                   kv_head * bp.dk_head_stride;
        u16* gdV = static_cast<u16*>(bp.dv) + batch * bp.dv_batch_stride + row * bp.dv_row_stride +
                   kv_head * bp.dv_head_stride;
#pragma unroll
        for (int nt = 0; nt < DW / 8; ++nt) {
            const int col = dw * DW + nt * 8 + 2 * t;
            if (col < p.head_dim) {
                st_global_b32(gdK + col, pack2(rdK[nt][2 * h] * bp.scale, rdK[nt][2 * h + 1] * bp.scale));
                st_global_b32(gdV + col, pack2(rdV[nt][2 * h], rdV[nt][2 * h + 1]));
            }
        }
    }
}
