// Blackwell (sm_100a) FlashAttention-4 forward, as `FA4Config` plans it. NOT YET RUN ON
// HARDWARE: no Blackwell GPU was available; it is compiled for sm_100a in CI, its layout is
// checked against the plan by the static_asserts below, and its barrier protocol is the one the
// CPU model (`config::sm100_protocol`) runs and checks. Nothing else is verified.
//
// Self-contained (NVRTC has no headers). The planner (`config::sm100_kernel`) prepends a prelude
// with FA4Config's numbers (BM, MMA_M, BN, PD, KV_STAGES, the TMEM map, FA4_SMEM_USED), the role
// enum and `role_of(warp)`, and the barrier table generated from the protocol (`enum Bar`,
// BAR_ARRIVALS, KV_TILE_BYTES, Q_TILE_BYTES); then the shared layer `../common/{base,params,mask,
// softmax}.cuh`, `../sm90/params.cuh` (TmaMap) and `../sm90/ptx.cuh` (mbarriers, TMA), then
// `tcgen05.cuh`, then this file, which holds no `asm`.
//
// Work: one CTA per 256 query rows (two 128-row tiles, Q0 and Q1) of one (sequence, head), grid
// (query blocks, heads, batch); fixed-length batches. Warp roles (the planner's table, `fa4 plan
// --depth D` prints it):
//   warps 0–3    ROLE_SOFTMAX0    softmax of Q0 (thread t = row t = TMEM lane t), its epilogue
//   warps 4–7    ROLE_SOFTMAX1    softmax of Q1
//   warps 8–11   ROLE_CORRECTION  rescales O0/O1 in TMEM when a row max moved
//   warp 12      ROLE_MMA         one thread issues every tcgen05.mma and commit
//   warp 13      ROLE_LOAD        one thread issues every TMA load
//   warps 14–15  ROLE_IDLE
// Barriers (the generated `enum Bar`; producer → consumer, arrivals per phase; every phase bit
// flips on each completion, producers start by waiting for parity 1, which a fresh barrier
// passes):
//   kv{s}_full   load → mma          1 (expect_tx) + K or V tile bytes (slot 0's first phase
//                                    also carries Q0)
//   kv{s}_empty  mma → load          1 (tcgen05.commit: the MMAs reading the slot are done)
//   q1_full      load → mma          1 (expect_tx) + Q tile bytes
//   s{t}_full    mma → softmax t     1 (commit of S_t = Q_t·Kᵀ)
//   s{t}_empty   softmax t → mma     128 (P_t written over S_t)
//   c{t}_full    softmax t → corr    128 (correction factor in TMEM)
//   c{t}_empty   corr → softmax t    128 (factor read)
//   o{t}_full    mma → corr, epi     1 (commit of O_t += P_t·V)
//   o{t}_empty   corr → mma          128 (O_t rescaled for the next P·V)
//   order{t}     (allocated by the plan, unused by this schedule)
// Schedule (MMA warp, `Protocol::programs` mirrors it): S0(0), S1(0), O0(0); then for each block
// j ≥ 1: S0(j), O1(j−1), S1(j), O0(j); finally O1(last). Two MMAs separate each S from its use
// as P, hiding the softmax. K/V slots are released by commit (after the MMAs read them).
//
// Shared memory, in order (the sum is FA4Config::smem_used exactly): Q0, Q1 (128 × PD each), the
// K/V ring (KV_STAGES × BN × PD), the barriers (BAR_COUNT × 8), the TMEM address slot (4).
// Tiles are TMA boxes of (rows, 64) with the 128-byte swizzle, PD / 64 slabs per tile.

constexpr int WG_THREADS = 128;
constexpr int NUM_THREADS = 512;
constexpr int SLAB_ELEMS = 64;
constexpr int SLAB_ROW_BYTES = 128;
constexpr int SLABS = PD / SLAB_ELEMS;
constexpr int TILE_ROWS = MMA_M;                        // rows of one Q tile
constexpr int Q_BYTES = TILE_ROWS * PD * 2;             // (128, PD)
constexpr int KV_BYTES = BN * PD * 2;                   // (BN, PD)
constexpr int SMEM_BYTES = 2 * Q_BYTES + KV_STAGES * KV_BYTES + 8 * BAR_COUNT + 4;
constexpr int SBO_BYTES = 8 * SLAB_ROW_BYTES;           // 8-row groups of a swizzle atom
constexpr int KSTEP_K_MAJOR_BYTES = 32;                 // k16 inside a 128-byte row
constexpr int KSTEP_V_BYTES = 16 * SLAB_ROW_BYTES;      // k16 over 16 key rows of V
constexpr u32 IDESC_QK = idesc_f16(MMA_M, BN, false);   // S = Q·Kᵀ, (128, BN)
constexpr u32 IDESC_PV = idesc_f16(MMA_M, PD, true);    // O += P·V, (128, PD)

static_assert(SMEM_BYTES == FA4_SMEM_USED, "the kernel's shared memory must be FA4Config::smem_used");
static_assert(Q_BYTES == Q_TILE_BYTES && KV_BYTES == KV_TILE_BYTES, "tile bytes as the protocol counts them");
static_assert(BM == 2 * MMA_M && MMA_M == 128, "two 128-row Q tiles (the non-split plan)");
static_assert(SLABS * SLAB_ELEMS == PD && HEAD_DIM <= PD && HEAD_DIM % 16 == 0, "whole slabs; k16 steps");
static_assert(BN % 32 == 0 && BN <= 256 && PD <= 256, "MMA N limits; 32-column TMEM batches");
static_assert(TMEM_USED <= TMEM_ALLOC_COLS, "the TMEM map fits the allocation");
static_assert(TMEM_P0 == TMEM_S0 && TMEM_P1 == TMEM_S1, "P lies over S");
static_assert(TMEM_C0 == TMEM_P0 + BN / 2 && TMEM_C1 == TMEM_P1 + BN / 2, "C follows P");
static_assert(Q_BYTES % 1024 == 0 && KV_BYTES % 1024 == 0, "tiles keep the swizzle's 1024-byte alignment");
static_assert(KV_STAGES >= 2, "the ring needs two slots");

// The Hopper kernel's params layout (`Sm90Params`, mirrored in Rust), with 4-D maps.
struct __align__(64) Sm100Params {
    TmaMap tq, tk, tv;  // 4-D maps (head_dim, rows, heads, batch), boxes (64, 128 or BN, 1, 1)
    FwdParams p;
    TmaMap to;          // the Hopper kernel's TMA-store map of O: unused here
};
static_assert(sizeof(Sm100Params) == FA4_SM90_PARAMS_SIZE, "the launch passes the Sm90Params mirror");

struct Smem {
    u32 q, kv, bars, tmem_slot;
    __device__ u32 q_tile(int t) const { return q + t * Q_BYTES; }
    __device__ u32 slot(int s) const { return kv + s * KV_BYTES; }
    __device__ u32 bar(int id) const { return bars + 8 * id; }
};

// The j-th use of the K/V ring (K of block i at 2i, V at 2i + 1): slot and phase.
struct Ring {
    int slot;
    u32 phase;
    __device__ static Ring at(int pos) { return Ring{pos % KV_STAGES, static_cast<u32>((pos / KV_STAGES) & 1)}; }
};

// One tile's TMA load: PD / 64 boxes of (rows, 64), columns past HEAD_DIM arrive as zeros.
__device__ __forceinline__ void load_tile(u32 dst, const TmaMap* map, u32 bar, int rows, int row, int head, int b) {
    for (int s = 0; s < SLABS; ++s) tma_load_4d(dst + s * rows * SLAB_ROW_BYTES, map, bar, s * SLAB_ELEMS, row, head, b);
}

// ---------------------------------------------------------------------------------------------
// Load warp, one thread.

__device__ __forceinline__ void load_role(const Sm100Params& P, const Smem& sm, const Seq& s, int m0, int head, int b,
                          const KeyBlocks& kb) {
    const int kv_head = head / P.p.group;
    const int n = kb.n_end - kb.n_begin;
    if (n <= 0) return;
    prefetch_tensormap(&P.tq);
    prefetch_tensormap(&P.tk);
    prefetch_tensormap(&P.tv);
    for (int j = 0; j < n; ++j) {
        const int row = (kb.n_begin + j) * BN;
        for (int kv = 0; kv < 2; ++kv) {
            const Ring r = Ring::at(2 * j + kv);
            mbar_wait(sm.bar(BAR_KV0_EMPTY + r.slot), r.phase ^ 1);
            const u32 full = sm.bar(BAR_KV0_FULL + r.slot);
            if (j == 0 && kv == 0) {
                // Q0 rides on K0's barrier; Q1 has its own, so S0 can start before Q1 lands.
                mbar_expect_tx(full, KV_BYTES + Q_BYTES);
                load_tile(sm.q_tile(0), &P.tq, full, TILE_ROWS, s.q_start + m0, head, b);
                load_tile(sm.slot(r.slot), &P.tk, full, BN, row, kv_head, b);
                mbar_expect_tx(sm.bar(BAR_Q1_FULL), Q_BYTES);
                load_tile(sm.q_tile(1), &P.tq, sm.bar(BAR_Q1_FULL), TILE_ROWS, s.q_start + m0 + TILE_ROWS, head, b);
            } else {
                mbar_expect_tx(full, KV_BYTES);
                load_tile(sm.slot(r.slot), kv == 0 ? &P.tk : &P.tv, full, BN, row, kv_head, b);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// MMA warp, one thread.

__device__ __forceinline__ void mma_qk(const Smem& sm, u32 tmem, int t, int k_slot) {
#pragma unroll 1
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
        const u32 off = (kk % 4) * KSTEP_K_MAJOR_BYTES;  // k16 step inside the slab
        const u32 a = sm.q_tile(t) + (kk / 4) * TILE_ROWS * SLAB_ROW_BYTES + off;
        const u32 bk = sm.slot(k_slot) + (kk / 4) * BN * SLAB_ROW_BYTES + off;
        umma_ss(tmem + (t == 0 ? TMEM_S0 : TMEM_S1), umma_desc_sw128(a, 16, SBO_BYTES),
                umma_desc_sw128(bk, 16, SBO_BYTES), IDESC_QK, kk > 0);
    }
}

__device__ __forceinline__ void mma_pv(const Smem& sm, u32 tmem, int t, int v_slot, bool accumulate) {
#pragma unroll 1
    for (int kk = 0; kk < BN / 16; ++kk) {
        const u32 bv = sm.slot(v_slot) + kk * KSTEP_V_BYTES;
        // V is N-major: the leading offset steps from one 64-column slab of the head dim to the next.
        umma_ts(tmem + (t == 0 ? TMEM_O0 : TMEM_O1), tmem + (t == 0 ? TMEM_P0 : TMEM_P1) + kk * 8,
                umma_desc_sw128(bv, BN * SLAB_ROW_BYTES, SBO_BYTES), IDESC_PV, accumulate || kk > 0);
    }
}

__device__ __forceinline__ void mma_role(const Smem& sm, u32 tmem, const KeyBlocks& kb) {
    const int n = kb.n_end - kb.n_begin;
    if (n <= 0) return;
    auto acquire = [&](int pos) {
        const Ring r = Ring::at(pos);
        mbar_wait(sm.bar(BAR_KV0_FULL + r.slot), r.phase);
        tc_fence_after();
        return r.slot;
    };
    auto release = [&](int pos) { umma_commit(sm.bar(BAR_KV0_EMPTY + Ring::at(pos).slot)); };
    auto qk = [&](int t, int slot) {
        mma_qk(sm, tmem, t, slot);
        umma_commit(sm.bar(t == 0 ? BAR_S0_FULL : BAR_S1_FULL));
    };
    // O_t += P_t·V_j: P written (S-empty phase j) and, after the first block, O rescaled
    // (O-empty phase j − 1).
    auto pv = [&](int t, int j, int slot) {
        mbar_wait(sm.bar(t == 0 ? BAR_S0_EMPTY : BAR_S1_EMPTY), j & 1);
        if (j > 0) mbar_wait(sm.bar(t == 0 ? BAR_O0_EMPTY : BAR_O1_EMPTY), (j - 1) & 1);
        tc_fence_after();
        mma_pv(sm, tmem, t, slot, j > 0);
        umma_commit(sm.bar(t == 0 ? BAR_O0_FULL : BAR_O1_FULL));
    };
    int k_slot = acquire(0);
    qk(0, k_slot);
    mbar_wait(sm.bar(BAR_Q1_FULL), 0);
    tc_fence_after();
    qk(1, k_slot);
    release(0);
    int v_slot = acquire(1);
    pv(0, 0, v_slot);
    for (int j = 1; j < n; ++j) {
        k_slot = acquire(2 * j);
        qk(0, k_slot);
        pv(1, j - 1, v_slot);
        release(2 * (j - 1) + 1);
        qk(1, k_slot);
        release(2 * j);
        v_slot = acquire(2 * j + 1);
        pv(0, j, v_slot);
    }
    pv(1, n - 1, v_slot);
    release(2 * (n - 1) + 1);
}

// ---------------------------------------------------------------------------------------------
// Softmax warpgroup t: thread r owns row m0 + 128t + r, TMEM lane r.

// A score of the row after softcap and mask (−inf outside the row's keys).
__device__ __forceinline__ float masked_score(const FwdParams& p, float x, int key, int lo, int hi, bool masked) {
    if (p.softcap != 0.0f) x = p.softcap * tanh_accurate(x * p.softcap_scale);
    return masked && (key < lo || key >= hi) ? NEG_INF : x;
}

__device__ __forceinline__ void softmax_role(const Sm100Params& P, const Smem& sm, u32 tmem, const Seq& s, int m0, int head, int b,
                             const KeyBlocks& kb, int t, int r) {
    const FwdParams& p = P.p;
    const int i = m0 + t * TILE_ROWS + r;  // query row in the sequence
    const int lo = key_lo(p, s, i), hi = key_hi(p, s, i);
    const u32 lane = static_cast<u32>(32 * (r / 32)) << 16;
    const u32 s_addr = tmem + lane + (t == 0 ? TMEM_S0 : TMEM_S1);
    const u32 c_addr = tmem + lane + (t == 0 ? TMEM_C0 : TMEM_C1);
    const int n = kb.n_end - kb.n_begin;
    float row_max = NEG_INF, row_sum = 0.0f;
    for (int j = 0; j < n; ++j) {
        const int blk = kb.n_begin + j;
        const bool masked = kb.masked(blk);
        mbar_wait(sm.bar(t == 0 ? BAR_S0_FULL : BAR_S1_FULL), j & 1);
        tc_fence_after();
        float mx = NEG_INF;
        for (int c = 0; c < BN / 32; ++c) {
            float v[32];
            tmem_ld32(s_addr + 32 * c, v);
#pragma unroll
            for (int e = 0; e < 32; ++e) mx = fmaxf(mx, masked_score(p, v[e], blk * BN + 32 * c + e, lo, hi, masked));
        }
        float corr;
        const float shift = update_row_max(row_max, mx, p.scale_log2, corr);
        if (j > 0) {
            // The correction warpgroup has read the last factor (phase j − 2; a fresh barrier
            // passes parity 1 for j = 1).
            mbar_wait(sm.bar(t == 0 ? BAR_C0_EMPTY : BAR_C1_EMPTY), j & 1);
            tmem_st1(c_addr, corr);
            tmem_wait_st();
            tc_fence_before();
            mbar_arrive(sm.bar(t == 0 ? BAR_C0_FULL : BAR_C1_FULL));
        }
        // P over S, chunk by chunk: P's chunk c covers S columns [16c, 16c + 16), all read.
        float sum = 0.0f;
        for (int c = 0; c < BN / 32; ++c) {
            float v[32];
            u32 packed[16];
            tmem_ld32(s_addr + 32 * c, v);
#pragma unroll
            for (int e = 0; e < 32; e += 2) {
                const float xa =
                    score_exponent(masked_score(p, v[e], blk * BN + 32 * c + e, lo, hi, masked), p.scale_log2, shift);
                const float xb = score_exponent(
                    masked_score(p, v[e + 1], blk * BN + 32 * c + e + 1, lo, hi, masked), p.scale_log2, shift);
                // FlashAttention-4's split of the exponentials: POLY_EXP2 of every 8 pairs on the
                // FMA units (`exp2_poly`), the rest on MUFU, so neither unit bounds the softmax.
                const bool poly = (e / 2) % 8 < POLY_EXP2;
                const float a = poly ? exp2_poly(xa) : exp2_approx(xa);
                const float bb = poly ? exp2_poly(xb) : exp2_approx(xb);
                sum += a + bb;
                packed[e / 2] = pack2(a, bb);
            }
            tmem_st16(s_addr + 16 * c, packed);
        }
        tmem_wait_st();
        tc_fence_before();
        mbar_arrive(sm.bar(t == 0 ? BAR_S0_EMPTY : BAR_S1_EMPTY));
        row_sum = row_sum * corr + sum;
    }
    // Epilogue: the last P·V done; rows past the sequence are computed and not stored.
    if (n > 0) {
        mbar_wait(sm.bar(t == 0 ? BAR_O0_FULL : BAR_O1_FULL), (n - 1) & 1);
        tc_fence_after();
    }
    if (i >= s.q_len) return;
    const float inv = row_inv_sum(row_sum);
    char* o = static_cast<char*>(p.o) + 2 * (b * p.o_batch_stride + (s.q_start + i) * p.o_row_stride +
                                             head * p.o_head_stride);
    for (int c = 0; c < PD / 32; ++c) {
        float v[32];
        if (n > 0) {
            tmem_ld32(tmem + lane + (t == 0 ? TMEM_O0 : TMEM_O1) + 32 * c, v);
        } else {
#pragma unroll
            for (int e = 0; e < 32; ++e) v[e] = 0.0f;
        }
#pragma unroll
        for (int e = 0; e < 32; e += 2) {
            const int col = 32 * c + e;
            if (col < p.head_dim) st_global_b32(o + 2 * col, pack2(v[e] * inv, v[e + 1] * inv));
        }
    }
    if (p.lse != nullptr) {
        p.lse[b * p.lse_batch_stride + head * p.lse_head_stride + s.q_start + i] =
            row_lse(row_max, row_sum, p.lse_scale);
    }
}

// ---------------------------------------------------------------------------------------------
// Correction warpgroup: thread r owns lane r of both O tiles.

__device__ __forceinline__ void correction_role(const Smem& sm, u32 tmem, const KeyBlocks& kb, int r) {
    const u32 lane = static_cast<u32>(32 * (r / 32)) << 16;
    const int n = kb.n_end - kb.n_begin;
    for (int j = 1; j < n; ++j) {
        for (int t = 0; t < 2; ++t) {
            mbar_wait(sm.bar(t == 0 ? BAR_C0_FULL : BAR_C1_FULL), (j - 1) & 1);
            tc_fence_after();
            const float corr = tmem_ld1(tmem + lane + (t == 0 ? TMEM_C0 : TMEM_C1));
            tc_fence_before();
            mbar_arrive(sm.bar(t == 0 ? BAR_C0_EMPTY : BAR_C1_EMPTY));
            mbar_wait(sm.bar(t == 0 ? BAR_O0_FULL : BAR_O1_FULL), (j - 1) & 1);
            tc_fence_after();
            // Conditional rescaling: a warp whose rows all kept their max skips the O round trip.
            if (__any_sync(0xffffffffu, corr != 1.0f)) {
                const u32 o_addr = tmem + lane + (t == 0 ? TMEM_O0 : TMEM_O1);
                for (int c = 0; c < PD / 32; ++c) {
                    float v[32];
                    tmem_ld32(o_addr + 32 * c, v);
#pragma unroll
                    for (int e = 0; e < 32; ++e) v[e] *= corr;
                    tmem_st32(o_addr + 32 * c, v);
                }
                tmem_wait_st();
            }
            tc_fence_before();
            mbar_arrive(sm.bar(t == 0 ? BAR_O0_EMPTY : BAR_O1_EMPTY));
        }
    }
}

// ---------------------------------------------------------------------------------------------

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1) fa4_sm100_fwd(const __grid_constant__ Sm100Params P) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    Smem sm;
    sm.q = smem_u32(smem_raw);
    sm.kv = sm.q + 2 * Q_BYTES;
    sm.bars = sm.kv + KV_STAGES * KV_BYTES;
    sm.tmem_slot = sm.bars + 8 * BAR_COUNT;

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const Role role = role_of(warp);
    if (warp == 0) tmem_alloc<TMEM_ALLOC_COLS>(sm.tmem_slot);
    if (warp == 1 && lane == 0) {
        for (int id = 0; id < BAR_COUNT; ++id) mbar_init(sm.bar(id), BAR_ARRIVALS[id]);
        fence_mbarrier_init();
    }
    tc_fence_before();
    __syncthreads();
    tc_fence_after();
    const u32 tmem = *reinterpret_cast<volatile u32*>(smem_raw + (sm.tmem_slot - sm.q));

    const FwdParams& p = P.p;
    const int m0 = blockIdx.x * BM, head = blockIdx.y, b = blockIdx.z;
    const Seq s = sequence(p, b, false);
    const bool any_rows = m0 < s.q_len;
    const KeyBlocks kb = key_blocks(p, s, m0, min(m0 + BM, s.q_len) - 1, any_rows);

    if (any_rows) {
        if (role == ROLE_SOFTMAX0 || role == ROLE_SOFTMAX1) {
            setmaxnreg_inc<SOFTMAX_REGS>();
            softmax_role(P, sm, tmem, s, m0, head, b, kb, role == ROLE_SOFTMAX0 ? 0 : 1, threadIdx.x % WG_THREADS);
        } else if (role == ROLE_CORRECTION) {
            setmaxnreg_dec<CORRECTION_REGS>();
            correction_role(sm, tmem, kb, threadIdx.x % WG_THREADS);
        } else {
            setmaxnreg_dec<OTHER_REGS>();
            if (role == ROLE_MMA && lane == 0) mma_role(sm, tmem, kb);
            if (role == ROLE_LOAD && lane == 0) load_role(P, sm, s, m0, head, b, kb);
        }
    }
    tc_fence_before();
    __syncthreads();
    if (warp == 0) {
        tc_fence_after();
        tmem_dealloc<TMEM_ALLOC_COLS>(tmem);
    }
}
