// Hopper (sm_90a) FlashAttention forward: TMA loads into an mbarrier ring issued by a producer
// warpgroup, wgmma for S = Q·Kᵀ (both operands in shared memory) and O += P·V (P from
// registers), online softmax in registers, setmaxnreg moving registers to the consumers.
//
// Self-contained (NVRTC may have no headers). The planner (`config::sm90`) prepends a prelude
// defining HEAD_DIM, BLOCK_N, CONSUMER_WGS, STAGES, PRODUCER_REGS, CONSUMER_REGS,
// LAZY_RESCALE, INTRA_WG_OVERLAP, PINGPONG, IS_BF16, HAS_WINDOW, HAS_SOFTCAP, FA4_SMEM_BYTES, and generates the wgmma wrappers
// `wgmma_ss` (N = BLOCK_N) and `wgmma_rs` (N = HEAD_DIM); then `../common.cuh`,
// `../sm80/params.cuh` and `params.cuh`; then the generated wgmma wrappers; then this file.
//
// Warp roles (one CTA = BLOCK_M query rows of one (batch, head)):
//   warpgroup 0      producer   PRODUCER_REGS   thread 0 issues every TMA load
//   warpgroup 1 + c  consumer c CONSUMER_REGS   rows [64c, 64c + 64): S, softmax, O
// Pipelines (mbarriers, one phase bit each, flipped on every reuse of a stage):
//   load_q       producer → consumers  q_full          1 arrival + Q bytes
//   load_k[s]    producer → consumers  k_full[s]       1 arrival + K bytes
//   load_v[s]    producer → consumers  v_full[s]       1 arrival + V bytes
//   release[s]   consumers → producer  kv_empty[s]     one arrival per consumer warp
//
// Shared-memory tiles are TMA boxes with the 128-byte swizzle: a (rows, HEAD_DIM) tile is
// stored as HEAD_DIM / 64 slabs of (rows, 64), each row 128 bytes, each slab 1024-aligned.

constexpr int WG_THREADS = 128;
constexpr int BLOCK_M = 64 * CONSUMER_WGS;
constexpr int NUM_THREADS = WG_THREADS * (1 + CONSUMER_WGS);
constexpr int SLAB_ELEMS = 64;                      // one 128-byte swizzle row of 16-bit values
constexpr int SLAB_ROW_BYTES = 128;
constexpr int SLABS = HEAD_DIM / SLAB_ELEMS;
constexpr int Q_BYTES = BLOCK_M * HEAD_DIM * 2;     // (BLOCK_M, HEAD_DIM)
constexpr int KV_BYTES = BLOCK_N * HEAD_DIM * 2;    // (BLOCK_N, HEAD_DIM)
constexpr int NUM_BARRIERS = 1 + 3 * STAGES;
constexpr int TILE_ALIGN = 1024;
constexpr int SMEM_BYTES = Q_BYTES + 2 * STAGES * KV_BYTES + 8 * NUM_BARRIERS + TILE_ALIGN;
constexpr int S_REGS = BLOCK_N / 2;                 // f32 S accumulator per thread, (64, BLOCK_N) per warpgroup
constexpr int O_REGS = HEAD_DIM / 2;                // f32 O accumulator per thread, (64, HEAD_DIM)
constexpr int P_REGS = BLOCK_N / 4;                 // packed 16-bit P pairs per thread
constexpr int SBO_BYTES = 8 * SLAB_ROW_BYTES;       // 8-row core-matrix groups of a swizzle atom
constexpr int KSTEP_K_MAJOR_BYTES = 32;             // k16 step inside a 128-byte swizzle row
constexpr int KSTEP_V_BYTES = 16 * SLAB_ROW_BYTES;  // k16 step over 16 key rows of V

static_assert(SLABS * SLAB_ELEMS == HEAD_DIM, "head dims are whole 64-element slabs");
static_assert(BLOCK_N % 16 == 0 && BLOCK_N <= 256, "BLOCK_N is a wgmma N and a multiple of k16");
static_assert(Q_BYTES % TILE_ALIGN == 0 && KV_BYTES % TILE_ALIGN == 0, "tiles keep 1024-byte alignment");
static_assert(SMEM_BYTES == FA4_SMEM_BYTES, "the planner's shared-memory count must match");
static_assert(STAGES >= 2, "the K/V ring needs at least two stages");

// ---------------------------------------------------------------------------------------------
// PTX wrappers

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
// Arrive once and add `bytes` to the transaction count the phase waits for (the TMA loads).
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Waits until the phase with parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n"
        "}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}

// One TMA box of a 5-D map (coordinates innermost first) into shared memory, completing on `bar`.
__device__ __forceinline__ void tma_load_5d(u32 dst, const TmaMap* map, u32 bar, int c0, int c1, int c2, int c3,
                                            int c4) {
    asm volatile(
        "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6, "
        "%7}], [%2];\n" ::"r"(dst),
        "l"(reinterpret_cast<u64>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
        : "memory");
}

// A wgmma shared-memory descriptor: 128-byte swizzle, start address, leading and stride byte
// offsets (each encoded >> 4). Tiles are 1024-aligned, so the base offset is 0.
__device__ __forceinline__ u64 smem_desc(u32 addr, u32 lbo, u32 sbo) {
    return static_cast<u64>((addr & 0x3FFFF) >> 4) | (static_cast<u64>((lbo & 0x3FFFF) >> 4) << 16) |
           (static_cast<u64>((sbo & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }

// ---------------------------------------------------------------------------------------------
// Accumulator layout of wgmma m64nN (f32): thread t of the warpgroup (warp w = t / 32, lane l)
// holds register i at row 16w + l/4 + 8·slot(i) and column 8·(i/4) + 2·(l%4) + (i%2): per warp
// the mma.sync m16n8 layout, repeated every 8 columns. The S accumulator packs pairwise into
// the A-register operand of the next wgmma without any exchange between threads.

__device__ __forceinline__ int acc_slot(int i) { return (i >> 1) & 1; }
__device__ __forceinline__ int acc_col(int i, int lane) { return 8 * (i >> 2) + 2 * (lane % 4) + (i & 1); }

// Allowed keys of query row i: [key_lo(i), key_hi(i)) (spec/attention.md, bottom-right aligned).
__device__ __forceinline__ int key_lo(const FwdParams& p, int i) {
    if (!HAS_WINDOW || p.window_left < 0) return 0;
    return max(0, i + p.seqlen_k - p.seqlen_q - p.window_left);
}
__device__ __forceinline__ int key_hi(const FwdParams& p, int i) {
    if (!HAS_WINDOW || p.window_right < 0) return p.seqlen_k;
    return max(0, min(p.seqlen_k, i + p.seqlen_k - p.seqlen_q + p.window_right + 1));
}

// The barriers, and the per-stage tile addresses.
struct Smem {
    u32 q, k, v;        // tiles: (BLOCK_M, HEAD_DIM), STAGES × (BLOCK_N, HEAD_DIM) each
    u32 q_full;         // load_q
    u32 k_full, v_full; // load_k[s], load_v[s]: + 8·s
    u32 kv_empty;       // release[s]: + 8·s
    __device__ u32 k_stage(int s) const { return k + s * KV_BYTES; }
    __device__ u32 v_stage(int s) const { return v + s * KV_BYTES; }
};

// Stage and phase of the j-th key block a role visits: one helper for both sides of the ring.
struct Ring {
    int stage;
    u32 phase;
    __device__ static Ring at(int j) { return Ring{j % STAGES, static_cast<u32>((j / STAGES) & 1)}; }
};

// ---------------------------------------------------------------------------------------------
// Producer: one thread loads Q once, then K and V of every key block into the ring.

__device__ __forceinline__ void producer(const Sm90Params& P, const Smem& sm, int m0, int head, int batch,
                                         int n_begin, int n_end) {
    const int kv_head = head / P.p.group;
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<u64>(&P.tq)) : "memory");
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<u64>(&P.tk)) : "memory");
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<u64>(&P.tv)) : "memory");
    mbar_expect_tx(sm.q_full, Q_BYTES);
    tma_load_5d(sm.q, &P.tq, sm.q_full, 0, m0, 0, head, batch);
    for (int n = n_begin; n < n_end; ++n) {
        const Ring r = Ring::at(n - n_begin);
        mbar_wait(sm.kv_empty + 8 * r.stage, r.phase ^ 1);  // a fresh barrier passes phase "-1"
        mbar_expect_tx(sm.k_full + 8 * r.stage, KV_BYTES);
        tma_load_5d(sm.k_stage(r.stage), &P.tk, sm.k_full + 8 * r.stage, 0, n * BLOCK_N, 0, kv_head, batch);
        mbar_expect_tx(sm.v_full + 8 * r.stage, KV_BYTES);
        tma_load_5d(sm.v_stage(r.stage), &P.tv, sm.v_full + 8 * r.stage, 0, n * BLOCK_N, 0, kv_head, batch);
    }
}

// ---------------------------------------------------------------------------------------------
// Consumer c: rows [m0 + 64c, m0 + 64c + 64) of the CTA's query block.
//
// Per key block: S = Q·Kᵀ (wgmma, async), masks and online softmax on S in registers, O rescale,
// P packed from S, O += P·V (wgmma, async). With INTRA_WG_OVERLAP the Q·Kᵀ of block j + 1 and
// the P·V of block j are issued together and the softmax of block j + 1 runs while the P·V of
// block j is still in the tensor cores (S and P live in separate registers, so the softmax never
// touches an operand in flight). With PINGPONG the two consumer warpgroups take turns issuing
// their wgmma groups (named barriers), so one's softmax overlaps the other's matrix products.

// The consumer's running state: O, and each of its two rows' max and partial sum.
struct RowState {
    float max[2];  // raw scores (before scale_log2)
    float sum[2];  // this thread's columns only
};

// Named barriers 1 and 2 (0 is __syncthreads): consumer warpgroup c waits on 1 + c and passes
// the turn by arriving on the other's. Warpgroup 1 opens with one pass, so warpgroup 0 issues
// first; that opening arrival leaves one arrival pending on barrier 1 when the CTA ends (one
// tile per CTA today; a persistent scheduler must consume it before the next tile). The ids are
// immediates so that ptxas reserves only these two barriers.
__device__ __forceinline__ void sched_wait(int c) {
    if constexpr (PINGPONG && CONSUMER_WGS == 2) {
        if (c == 0)
            asm volatile("bar.sync 1, %0;\n" ::"n"(2 * WG_THREADS) : "memory");
        else
            asm volatile("bar.sync 2, %0;\n" ::"n"(2 * WG_THREADS) : "memory");
    }
}
__device__ __forceinline__ void sched_pass(int c) {
    if constexpr (PINGPONG && CONSUMER_WGS == 2) {
        if (c == 0)
            asm volatile("bar.arrive 2, %0;\n" ::"n"(2 * WG_THREADS) : "memory");
        else
            asm volatile("bar.arrive 1, %0;\n" ::"n"(2 * WG_THREADS) : "memory");
    }
}

// Issues S = Q·Kᵀ for the K tile at `k_base` (one commit group).
__device__ __forceinline__ void issue_qk(float (&rS)[S_REGS], u32 q_base, u32 k_base) {
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
        const u32 a = q_base + (kk / 4) * (BLOCK_M * SLAB_ROW_BYTES) + (kk % 4) * KSTEP_K_MAJOR_BYTES;
        const u32 b = k_base + (kk / 4) * (BLOCK_N * SLAB_ROW_BYTES) + (kk % 4) * KSTEP_K_MAJOR_BYTES;
        wgmma_ss(rS, smem_desc(a, 16, SBO_BYTES), smem_desc(b, 16, SBO_BYTES), kk > 0 ? 1 : 0);
    }
    wgmma_commit();
}

// Issues O += P·V for the V tile at `v_base` (one commit group). V (BLOCK_N keys, HEAD_DIM) is
// MN-major for this product; its 64-column slabs are BLOCK_N rows apart (the leading offset).
__device__ __forceinline__ void issue_pv(float (&rO)[O_REGS], const u32 (&rP)[P_REGS], u32 v_base) {
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk)
        wgmma_rs(rO, rP[4 * kk], rP[4 * kk + 1], rP[4 * kk + 2], rP[4 * kk + 3],
                 smem_desc(v_base + kk * KSTEP_V_BYTES, BLOCK_N * SLAB_ROW_BYTES, SBO_BYTES));
    wgmma_commit();
}

// Softcap, masks and the online softmax of key block n on S (in place: S becomes P in f32).
// Returns each row's O correction factor.
__device__ __forceinline__ void softmax_block(const FwdParams& p, float (&rS)[S_REGS], RowState& st, int n, int row0,
                                              int lane, int free_lo, int free_hi, float (&corr)[2]) {
    if constexpr (HAS_SOFTCAP) {
#pragma unroll
        for (int i = 0; i < S_REGS; ++i) rS[i] = p.softcap * tanh_accurate(rS[i] * p.softcap_scale);
    }
    // Mask: only blocks that cross a row's key bounds (or the end of the keys).
    const int key0 = n * BLOCK_N;
    if (key0 < free_lo || key0 + BLOCK_N > free_hi) {
        int lo[2], hi[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            lo[h] = key_lo(p, row0 + 8 * h);
            hi[h] = key_hi(p, row0 + 8 * h);
        }
#pragma unroll
        for (int i = 0; i < S_REGS; ++i) {
            const int j = key0 + acc_col(i, lane), h = acc_slot(i);
            if (j < lo[h] || j >= hi[h]) rS[i] = NEG_INF;
        }
    }
    // The 4 lanes of a quad share a row.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float mx = st.max[h];
#pragma unroll
        for (int i = 0; i < S_REGS; ++i)
            if (acc_slot(i) == h) mx = fmaxf(mx, rS[i]);
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        // Conditional rescaling keeps the stale max unless the new one is 2^8 larger.
        const bool move = !LAZY_RESCALE || (mx - st.max[h]) * p.scale_log2 > RESCALE_THRESHOLD;
        const float m_new = move ? mx : st.max[h];
        // A row with no allowed key so far keeps max −inf; shift by 0 so exp2(−inf) = 0.
        const float shift = m_new == NEG_INF ? 0.0f : m_new * p.scale_log2;
        corr[h] = move ? exp2_approx(st.max[h] * p.scale_log2 - shift) : 1.0f;
        st.max[h] = m_new;
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < S_REGS; ++i)
            if (acc_slot(i) == h) {
                rS[i] = exp2_approx(fmaf(rS[i], p.scale_log2, -shift));
                sum += rS[i];
            }
        st.sum[h] = st.sum[h] * corr[h] + sum;
    }
}

// P in the A-register layout: k step kk takes S registers 8kk .. 8kk + 7, pairwise.
__device__ __forceinline__ void pack_p(const float (&rS)[S_REGS], u32 (&rP)[P_REGS]) {
#pragma unroll
    for (int j = 0; j < P_REGS; ++j) rP[j] = pack2(rS[2 * j], rS[2 * j + 1]);
}

__device__ __forceinline__ void rescale_o(float (&rO)[O_REGS], const float (&corr)[2]) {
#pragma unroll
    for (int i = 0; i < O_REGS; ++i) rO[i] *= corr[acc_slot(i)];
}

__device__ __forceinline__ void zero(float* r, int n) {
#pragma unroll
    for (int i = 0; i < n; ++i) r[i] = 0.0f;
}

__device__ __forceinline__ void consumer(const Sm90Params& P, const Smem& sm, int c, int m0, int head, int batch,
                                         int n_begin, int n_end, int free_lo, int free_hi) {
    const FwdParams& p = P.p;
    const int t = threadIdx.x % WG_THREADS;
    const int warp = t / 32, lane = t % 32;
    const int row0 = m0 + 64 * c + 16 * warp + lane / 4;  // this thread's rows: row0 + 8·slot

    float rO[O_REGS];  // (64, HEAD_DIM) per warpgroup
    zero(rO, O_REGS);
    RowState st = {{NEG_INF, NEG_INF}, {0.0f, 0.0f}};
    float rS[S_REGS];  // (64, BLOCK_N) per warpgroup
    u32 rP[P_REGS];
    float corr[2];

    // Q of this warpgroup: slab kk / 4 of its 64 rows (see issue_qk).
    const u32 q_base = sm.q + 64 * c * SLAB_ROW_BYTES;
    mbar_wait(sm.q_full, 0);
    if (c == 1) sched_pass(1);  // warpgroup 0 issues first

    if constexpr (INTRA_WG_OVERLAP) {
        if (n_begin < n_end) {
            // Prologue: block n_begin's S and P.
            const Ring r = Ring::at(0);
            zero(rS, S_REGS);
            mbar_wait(sm.k_full + 8 * r.stage, r.phase);
            sched_wait(c);
            wgmma_fence();
            issue_qk(rS, q_base, sm.k_stage(r.stage));
            sched_pass(c);
            wgmma_wait_all();
            softmax_block(p, rS, st, n_begin, row0, lane, free_lo, free_hi, corr);
            pack_p(rS, rP);
        }
        for (int n = n_begin + 1; n < n_end; ++n) {
            const Ring r = Ring::at(n - n_begin), prev = Ring::at(n - n_begin - 1);
            zero(rS, S_REGS);
            mbar_wait(sm.k_full + 8 * r.stage, r.phase);
            mbar_wait(sm.v_full + 8 * prev.stage, prev.phase);
            sched_wait(c);
            wgmma_fence();
            issue_qk(rS, q_base, sm.k_stage(r.stage));  // block n's S …
            issue_pv(rO, rP, sm.v_stage(prev.stage));   // … and block n - 1's P·V, in flight together
            sched_pass(c);
            asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");  // S is in
            softmax_block(p, rS, st, n, row0, lane, free_lo, free_hi, corr);
            wgmma_wait_all();  // P·V of block n - 1 is in: its stage is free, O and P may change
            __syncwarp();
            if (lane == 0) mbar_arrive(sm.kv_empty + 8 * prev.stage);
            rescale_o(rO, corr);
            pack_p(rS, rP);
        }
        if (n_begin < n_end) {
            const Ring last = Ring::at(n_end - 1 - n_begin);
            mbar_wait(sm.v_full + 8 * last.stage, last.phase);
            wgmma_fence();
            issue_pv(rO, rP, sm.v_stage(last.stage));
            wgmma_wait_all();
            __syncwarp();
            if (lane == 0) mbar_arrive(sm.kv_empty + 8 * last.stage);
        }
    } else {
        for (int n = n_begin; n < n_end; ++n) {
            const Ring r = Ring::at(n - n_begin);
            zero(rS, S_REGS);
            mbar_wait(sm.k_full + 8 * r.stage, r.phase);
            sched_wait(c);
            wgmma_fence();
            issue_qk(rS, q_base, sm.k_stage(r.stage));
            sched_pass(c);
            wgmma_wait_all();
            softmax_block(p, rS, st, n, row0, lane, free_lo, free_hi, corr);
            rescale_o(rO, corr);
            pack_p(rS, rP);
            mbar_wait(sm.v_full + 8 * r.stage, r.phase);
            sched_wait(c);
            wgmma_fence();
            issue_pv(rO, rP, sm.v_stage(r.stage));
            sched_pass(c);
            wgmma_wait_all();
            __syncwarp();
            if (lane == 0) mbar_arrive(sm.kv_empty + 8 * r.stage);  // this warp is done with the stage
        }
    }

    // Epilogue: O = acc / sum, 16-bit pairs straight from registers; LSE from one lane per row.
    float inv[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float sum = st.sum[h];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        inv[h] = sum == 0.0f ? 0.0f : 1.0f / sum;  // no allowed key: O = 0
        const int i = row0 + 8 * h;
        if (p.lse != nullptr && lane % 4 == 0 && i < p.seqlen_q) {
            float lse = sum == 0.0f ? NEG_INF : st.max[h] * p.lse_scale + __logf(sum);
            if (sum != sum) lse = sum;  // NaN propagates
            p.lse[batch * p.lse_batch_stride + head * p.lse_head_stride + i] = lse;
        }
    }
    u16* gO = static_cast<u16*>(p.o) + batch * p.o_batch_stride + head * p.o_head_stride;
#pragma unroll
    for (int i = 0; i < O_REGS; i += 2) {
        const int h = acc_slot(i), row = row0 + 8 * h, col = acc_col(i, lane);
        if (row < p.seqlen_q) {
            const u32 v = pack2(rO[i] * inv[h], rO[i + 1] * inv[h]);
            asm volatile("st.global.b32 [%0], %1;\n" ::"l"(gO + row * p.o_row_stride + col), "r"(v) : "memory");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Entry: shared-memory carve-out, barrier init, role dispatch.

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1) fa4_fwd_sm90(const __grid_constant__ Sm90Params P) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const FwdParams& p = P.p;
    const int m_block = gridDim.x - 1 - blockIdx.x;  // longest first (causal)
    const int head = blockIdx.y, batch = blockIdx.z;
    const int m0 = m_block * BLOCK_M;
    if (m0 >= p.seqlen_q) return;
    const int valid_m = min(BLOCK_M, p.seqlen_q - m0);

    Smem sm;
    sm.q = (smem_u32(smem_raw) + TILE_ALIGN - 1) & ~static_cast<u32>(TILE_ALIGN - 1);
    sm.k = sm.q + Q_BYTES;
    sm.v = sm.k + STAGES * KV_BYTES;
    sm.q_full = sm.v + STAGES * KV_BYTES;
    sm.k_full = sm.q_full + 8;
    sm.v_full = sm.k_full + 8 * STAGES;
    sm.kv_empty = sm.v_full + 8 * STAGES;

    // Key blocks this CTA visits (both roles compute the same range).
    const int first_row = m0, last_row = m0 + valid_m - 1;
    const int span_lo = key_lo(p, first_row), span_hi = key_hi(p, last_row);
    const int n_begin = span_lo / BLOCK_N;
    const int n_end = span_hi > span_lo ? (span_hi + BLOCK_N - 1) / BLOCK_N : n_begin;
    const int free_lo = key_lo(p, last_row);
    const int free_hi = key_hi(p, first_row);

    if (threadIdx.x == 0) {
        mbar_init(sm.q_full, 1);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(sm.k_full + 8 * s, 1);
            mbar_init(sm.v_full + 8 * s, 1);
            mbar_init(sm.kv_empty + 8 * s, 4 * CONSUMER_WGS);  // one arrival per consumer warp
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    }
    __syncthreads();

    const int wg = threadIdx.x / WG_THREADS;
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGS));
        if (threadIdx.x == 0) producer(P, sm, m0, head, batch, n_begin, n_end);
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_REGS));
        consumer(P, sm, wg - 1, m0, head, batch, n_begin, n_end, free_lo, free_hi);
    }
}
