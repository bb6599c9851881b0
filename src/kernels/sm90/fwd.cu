// Hopper (sm_90a) FlashAttention forward: TMA loads into an mbarrier ring issued by a producer
// warpgroup, wgmma for S = Q·Kᵀ (both operands in shared memory) and O += P·V (P from
// registers), online softmax in registers, setmaxnreg moving registers to the consumers.
//
// Self-contained (NVRTC may have no headers). The planner (`config::sm90`) prepends a prelude
// defining HEAD_DIM, BLOCK_N, CONSUMER_WGS, STAGES, PRODUCER_REGS, CONSUMER_REGS,
// Q_STAGES, LAZY_RESCALE, INTRA_WG_OVERLAP, PINGPONG, POLY_EXP2, IS_BF16, HAS_WINDOW, HAS_SOFTCAP, VARLEN,
// FA4_SMEM_BYTES, and
// generates the wgmma wrappers
// `wgmma_ss` (N = BLOCK_N) and `wgmma_rs` (N = HEAD_DIM); then `../common.cuh`,
// `../sm80/params.cuh` and `params.cuh`; then the generated wgmma wrappers; then this file.
//
// Work: a tile is BLOCK_M query rows of one (sequence, head). The launch has one CTA per tile, or
// (persistent) fewer CTAs that each walk a list of tiles (`tile_number`): the producer then
// loads the next tile's Q (into the other of Q_STAGES slots) and first K/V while the consumers
// finish the last one.
// Warp roles:
//   warpgroup 0      producer   PRODUCER_REGS   thread 0 issues every TMA load;
//                                               warp 1 zeroes V rows past a sequence (VARLEN)
//   warpgroup 1 + c  consumer c CONSUMER_REGS   rows [64c, 64c + 64): S, softmax, O
// Pipelines (mbarriers, one phase bit each, flipped on every reuse):
//   load_q[t]    producer → consumers  q_full[t]       1 arrival + Q bytes   (t: Q slot)
//   release_q[t] consumers → producer  q_empty[t]      one arrival per consumer warp
//   load_k[s]    producer → consumers  k_full[s]       1 arrival + K bytes
//   load_v[s]    producer → consumers  v_full[s]       1 arrival + V bytes (a VARLEN block with
//                                                      foreign rows: warp 1's plain arrival)
//   release_k[s] consumers → producer  k_empty[s]      one arrival per consumer warp
//   release_v[s] consumers → producer  v_empty[s]      one arrival per consumer warp
//   load_v_tail[s] producer → warp 1   v_tail[s]       1 arrival + V bytes (VARLEN, below)
// K and V of a stage are released separately: with the intra-warpgroup overlap a consumer is
// done with K of block n one step before V of block n.
//
// Variable-length batches (VARLEN): Q, K and V are packed [total, heads, head_dim] and each map
// spans the whole packed tensor, so a block that crosses the end of its sequence holds the next
// sequence's rows (past the total, zeros). Their query rows are computed and not stored, their
// scores are masked (replaced by −inf), but P·V would still multiply their V rows by P = 0, and
// 0 · inf or NaN is NaN. So such a V block is loaded onto v_tail[s]; warp 1 of the producer
// warpgroup waits for it there, zeroes the foreign rows and then completes v_full[s] with a plain
// arrival. Fixed-length batches have a map per batch entry, whose reads past the end are zeros.
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
constexpr int NUM_BARRIERS = 2 * Q_STAGES + 5 * STAGES;  // v_tail is allocated whether used or not
constexpr int TILE_ALIGN = 1024;
constexpr int SMEM_BYTES = Q_STAGES * Q_BYTES + 2 * STAGES * KV_BYTES + 8 * NUM_BARRIERS + TILE_ALIGN;
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
static_assert(Q_STAGES == 1 || Q_STAGES == 2, "one or two Q slots");

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

// The barriers, and the per-stage tile addresses.
struct Smem {
    u32 q, k, v;          // tiles: Q_STAGES × (BLOCK_M, HEAD_DIM), STAGES × (BLOCK_N, HEAD_DIM) each
    u32 q_full, q_empty;  // load_q[t], release_q[t]: + 8·t
    u32 k_full, v_full;   // load_k[s], load_v[s]: + 8·s
    u32 k_empty, v_empty; // release_k[s], release_v[s]: + 8·s
    u32 v_tail;           // load_v_tail[s]: + 8·s (VARLEN)
    __device__ u32 q_slot(int t) const { return q + t * Q_BYTES; }
    __device__ u32 k_stage(int s) const { return k + s * KV_BYTES; }
    __device__ u32 v_stage(int s) const { return v + s * KV_BYTES; }
};

// Stage and phase of the j-th key block a role visits: one helper for both sides of the ring.
struct Ring {
    int stage;
    u32 phase;
    __device__ static Ring at(int j) { return Ring{j % STAGES, static_cast<u32>((j / STAGES) & 1)}; }
    // The Q slot of a CTA's k-th tile.
    __device__ static Ring q(int k) { return Ring{k % Q_STAGES, static_cast<u32>((k / Q_STAGES) & 1)}; }
};

// ---------------------------------------------------------------------------------------------
// Tiles: which query block of which (batch, head) the k-th tile of a CTA is, and its key blocks.

struct Tile {
    int m0, head, batch;
    int bi;                // index into the tensors' batch axis (0 when packed)
    Seq s;                 // the sequence
    bool empty;            // past the sequence's queries (VARLEN: shorter than the longest)
    int n_begin, n_end;    // key blocks [n_begin, n_end) hold every allowed key of the tile
    int free_lo, free_hi;  // a block inside [free_lo, free_hi) needs no mask
};

// Query blocks per (sequence, head): of the longest sequence (VARLEN: `seqlen_q` is the longest).
__device__ __forceinline__ int m_blocks(const FwdParams& p) { return (p.seqlen_q + BLOCK_M - 1) / BLOCK_M; }
__device__ __forceinline__ int num_tiles(const FwdParams& p) { return m_blocks(p) * p.heads_q * p.batch; }

// Tiles are numbered query block fastest (the tiles that run at once share K and V in L2).
// One CTA per tile (gridDim.x = tiles): CTA b runs tile b, and a head's query blocks come last
// first, so the hardware starts the longest (under a causal mask) first. Persistent (fewer
// CTAs): CTA b runs the pairs of tiles b, b + gridDim.x, …, and a head's query blocks are
// ordered last, first, second last, second, …, so each pair costs about the same (a causal
// tile's keys grow with its query block; the pair's sum does not).
// The number of this CTA's k-th tile, or −1 when it has none. Strictly increasing in k.
__device__ __forceinline__ int tile_number(int k, int total) {
    const int g = gridDim.x, b = blockIdx.x;
    if (g >= total) return k == 0 ? b : -1;
    // No overflow: the planner keeps total ≤ 2^30, and t stops at the first value ≥ total.
    const int t = 2 * ((k / 2) * g + b) + (k & 1);
    return t < total ? t : -1;
}

__device__ __forceinline__ Tile tile_at(const FwdParams& p, int t) {
    const int mb = m_blocks(p), hb = t / mb, r = t % mb;
    const bool paired = static_cast<int>(gridDim.x) < num_tiles(p);
    Tile w;
    w.m0 = (paired && (r & 1) ? r / 2 : mb - 1 - (paired ? r / 2 : r)) * BLOCK_M;
    w.head = hb % p.heads_q;
    w.batch = hb / p.heads_q;
    w.bi = VARLEN ? 0 : w.batch;
    w.s = sequence(p, w.batch, VARLEN);
    w.empty = VARLEN && w.m0 >= w.s.q_len;
    const int last_row = min(w.m0 + BLOCK_M, w.s.q_len) - 1;
    const int span_lo = key_lo(p, w.s, w.m0), span_hi = key_hi(p, w.s, last_row);
    w.n_begin = span_lo / BLOCK_N;
    w.n_end = span_hi > span_lo && !w.empty ? (span_hi + BLOCK_N - 1) / BLOCK_N : w.n_begin;
    w.free_lo = key_lo(p, w.s, last_row);
    w.free_hi = key_hi(p, w.s, w.m0);
    return w;
}

// ---------------------------------------------------------------------------------------------
// Producer: one thread loads, tile after tile, Q and then K and V of every key block into the
// ring (whose position runs on across tiles).

// Whether key block n of sequence s holds rows of the next sequence (VARLEN only: see the top).
__device__ __forceinline__ bool foreign_rows(const Seq& s, int n) { return VARLEN && (n + 1) * BLOCK_N > s.k_len; }

__device__ __forceinline__ void producer(const Sm90Params& P, const Smem& sm) {
    const FwdParams& p = P.p;
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<u64>(&P.tq)) : "memory");
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<u64>(&P.tk)) : "memory");
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<u64>(&P.tv)) : "memory");
    const int total = num_tiles(p);
    int j = 0;   // key blocks loaded so far
    int kq = 0;  // tiles loaded so far (VARLEN skips empty ones)
    for (int k = 0;; ++k) {
        const int t = tile_number(k, total);
        if (t < 0) break;
        const Tile w = tile_at(p, t);
        if (w.empty) continue;
        const int kv_head = w.head / p.group;
        const Ring qs = Ring::q(VARLEN ? kq++ : k);
        mbar_wait(sm.q_empty + 8 * qs.stage, qs.phase ^ 1);  // the slot's last Q is consumed (a fresh barrier passes phase "-1")
        mbar_expect_tx(sm.q_full + 8 * qs.stage, Q_BYTES);
        tma_load_5d(sm.q_slot(qs.stage), &P.tq, sm.q_full + 8 * qs.stage, 0, w.s.q_start + w.m0, 0, w.head, w.bi);
        for (int n = w.n_begin; n < w.n_end; ++n, ++j) {
            const Ring r = Ring::at(j);
            const int row = w.s.k_start + n * BLOCK_N;
            mbar_wait(sm.k_empty + 8 * r.stage, r.phase ^ 1);
            mbar_expect_tx(sm.k_full + 8 * r.stage, KV_BYTES);
            tma_load_5d(sm.k_stage(r.stage), &P.tk, sm.k_full + 8 * r.stage, 0, row, 0, kv_head, w.bi);
            mbar_wait(sm.v_empty + 8 * r.stage, r.phase ^ 1);
            const u32 v_bar = (foreign_rows(w.s, n) ? sm.v_tail : sm.v_full) + 8 * r.stage;
            mbar_expect_tx(v_bar, KV_BYTES);
            tma_load_5d(sm.v_stage(r.stage), &P.tv, v_bar, 0, row, 0, kv_head, w.bi);
        }
    }
}

// VARLEN, producer warp 1: walks the same tiles and key blocks as the producer; for each block
// with rows of the next sequence, waits for its V (v_tail), zeroes those rows (whole 128-byte
// swizzle rows of every slab, so the swizzle does not matter), makes the writes visible to
// wgmma (the async proxy) and completes the block's v_full.
__device__ __forceinline__ void zero_foreign_v_rows(const Sm90Params& P, const Smem& sm, int lane) {
    const FwdParams& p = P.p;
    const int total = num_tiles(p);
    int j = 0;
    u32 tail_phase = 0;  // bit s: phase of v_tail[s]
    for (int k = 0;; ++k) {
        const int t = tile_number(k, total);
        if (t < 0) break;
        const Tile w = tile_at(p, t);
        if (w.empty) continue;
        for (int n = w.n_begin; n < w.n_end; ++n, ++j) {
            if (!foreign_rows(w.s, n)) continue;
            const Ring r = Ring::at(j);
            mbar_wait(sm.v_tail + 8 * r.stage, (tail_phase >> r.stage) & 1);
            tail_phase ^= 1u << r.stage;
            const int valid = w.s.k_len - n * BLOCK_N;  // ≥ 1: the block holds an allowed key
            const int chunks = (BLOCK_N - valid) * (SLAB_ROW_BYTES / 16);
            for (int slab = 0; slab < SLABS; ++slab) {
                const u32 base = sm.v_stage(r.stage) + slab * (BLOCK_N * SLAB_ROW_BYTES) + valid * SLAB_ROW_BYTES;
                for (int c = lane; c < chunks; c += 32)
                    asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};\n" ::"r"(base + 16 * c), "r"(0) : "memory");
            }
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            __syncwarp();
            if (lane == 0) mbar_arrive(sm.v_full + 8 * r.stage);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Consumer c: rows [m0 + 64c, m0 + 64c + 64) of each tile's query block.
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
// first; both take the same number of turns per tile, so the turn carries over from tile to
// tile, and the opening arrival is left pending on barrier 1 when the CTA ends. The ids are
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

// One arrival per consumer warp on a release barrier (after the warp's wgmma wait).
__device__ __forceinline__ void release(u32 bar, int lane) {
    __syncwarp();
    if (lane == 0) mbar_arrive(bar);
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

// 2^x on the FMA units (FlashAttention-4): 2^x = 2^j · 2^f with j = round(x) (from the low
// mantissa bits of x + 1.5·2^23) and f = x − j in [−0.5, 0.5], 2^f by a minimax polynomial
// (fitted for this kernel: relative error 7.5e-5 at degree 3 for bf16, 2.7e-6 at degree 4 for
// fp16, below the rounding of P to 16 bits), and 2^j added to the exponent bits. Below 2^−126
// (masked scores are −inf) the result is 0, as ex2.approx.ftz gives; NaN stays NaN and +inf
// (an infinite score) +inf. Finite inputs are scores less the running max in log2 units: at
// most 0, or RESCALE_THRESHOLD with conditional rescaling (the bit trick holds up to 127).
__device__ __forceinline__ float exp2_poly(float x) {
    const float shifter = 12582912.0f;  // 1.5 · 2^23
    const float xc = fmaxf(x, -126.0f);
    const float t = xc + shifter;
    const float f = xc - (t - shifter);
    float y;
    if constexpr (IS_BF16) {
        y = fmaf(fmaf(fmaf(0.0551716685f, f, 0.242611140f), f, 0.693260968f), f, 0.999928057f);
    } else {
        y = fmaf(fmaf(fmaf(fmaf(0.00957010128f, f, 0.0559178628f), f, 0.240247443f), f, 0.693121791f), f,
                 0.999999285f);
    }
    const int j = __float_as_int(t) - __float_as_int(shifter);  // in [−126, 127]: x ≤ 127 is assumed
    const float r = __int_as_float(__float_as_int(y) + j * (1 << 23));
    return x < -126.0f ? 0.0f : x <= 127.0f ? r : x * -NEG_INF;  // NaN stays NaN, +inf is +inf
}

// Exponential of accumulator register i: POLY_EXP2 of every 8 on the FMA units, the rest on MUFU.
__device__ __forceinline__ float exp2_mixed(int i, float x) {
    if (POLY_EXP2 > 0 && i % 8 < POLY_EXP2) return exp2_poly(x);
    return exp2_approx(x);
}

// Softcap, masks and the online softmax of key block n on S (in place: S becomes P in f32).
// Returns each row's O correction factor.
__device__ __forceinline__ void softmax_block(const FwdParams& p, const Seq& s, float (&rS)[S_REGS], RowState& st, int n,
                                              int row0, int lane, int free_lo, int free_hi, float (&corr)[2]) {
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
            lo[h] = key_lo(p, s, row0 + 8 * h);
            hi[h] = key_hi(p, s, row0 + 8 * h);
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
        // An infinite max shifts by 0, as the spec's formula: a row with no allowed key so far
        // (−inf) gets exp2(−inf) = 0; an infinite score (+inf) makes the sum and LSE +inf, O NaN.
        const float shift = fabsf(m_new) == -NEG_INF ? 0.0f : m_new * p.scale_log2;
        corr[h] = move ? exp2_approx(st.max[h] * p.scale_log2 - shift) : 1.0f;
        st.max[h] = m_new;
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < S_REGS; ++i)
            if (acc_slot(i) == h) {
                rS[i] = exp2_mixed(i, fmaf(rS[i], p.scale_log2, -shift));
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

// S = Q·Kᵀ of the key block in ring slot r, waited for; its K stage is released.
__device__ __forceinline__ void qk_block(float (&rS)[S_REGS], const Smem& sm, Ring r, u32 q_base, int c, int lane) {
    zero(rS, S_REGS);
    mbar_wait(sm.k_full + 8 * r.stage, r.phase);
    sched_wait(c);
    wgmma_fence();
    issue_qk(rS, q_base, sm.k_stage(r.stage));
    sched_pass(c);
    wgmma_wait_all();
    release(sm.k_empty + 8 * r.stage, lane);
}

// One tile: the key loop from ring position j (the key blocks this consumer saw before), then
// the epilogue. Releases Q once its last Q·Kᵀ is done.
__device__ __forceinline__ void consumer_tile(const Sm90Params& P, const Smem& sm, int c, const Tile& w, int j,
                                              Ring qs) {
    const FwdParams& p = P.p;
    const int tid = threadIdx.x % WG_THREADS;
    const int warp = tid / 32, lane = tid % 32;
    const int row0 = w.m0 + 64 * c + 16 * warp + lane / 4;  // this thread's rows: row0 + 8·slot (in the sequence)
    const int n_begin = w.n_begin, n_end = w.n_end;

    float rO[O_REGS];  // (64, HEAD_DIM) per warpgroup
    zero(rO, O_REGS);
    RowState st = {{NEG_INF, NEG_INF}, {0.0f, 0.0f}};
    float rS[S_REGS];  // (64, BLOCK_N) per warpgroup
    u32 rP[P_REGS];
    float corr[2] = {1.0f, 1.0f};

    // Q of this warpgroup: slab kk / 4 of its 64 rows (see issue_qk).
    const u32 q_base = sm.q_slot(qs.stage) + 64 * c * SLAB_ROW_BYTES;
    const u32 q_empty = sm.q_empty + 8 * qs.stage;
    mbar_wait(sm.q_full + 8 * qs.stage, qs.phase);

    if constexpr (INTRA_WG_OVERLAP) {
        if (n_begin < n_end) {
            // Prologue: block n_begin's S and P.
            qk_block(rS, sm, Ring::at(j), q_base, c, lane);
            softmax_block(p, w.s, rS, st, n_begin, row0, lane, w.free_lo, w.free_hi, corr);
            pack_p(rS, rP);
        }
        for (int n = n_begin + 1; n < n_end; ++n) {
            const Ring r = Ring::at(j + n - n_begin), prev = Ring::at(j + n - n_begin - 1);
            zero(rS, S_REGS);
            mbar_wait(sm.k_full + 8 * r.stage, r.phase);
            mbar_wait(sm.v_full + 8 * prev.stage, prev.phase);
            sched_wait(c);
            wgmma_fence();
            issue_qk(rS, q_base, sm.k_stage(r.stage));  // block n's S …
            rescale_o(rO, corr);                        // (block n - 1's correction, while Q·Kᵀ runs)
            wgmma_fence();
            issue_pv(rO, rP, sm.v_stage(prev.stage));   // … and block n - 1's P·V, in flight together
            sched_pass(c);
            asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");  // S is in
            release(sm.k_empty + 8 * r.stage, lane);
            softmax_block(p, w.s, rS, st, n, row0, lane, w.free_lo, w.free_hi, corr);
            // Wait for the next K here, before the P·V wait: this branch ends the basic block,
            // which keeps ptxas from hoisting the wgmma wait above the softmax (it does so
            // otherwise, and nothing would overlap).
            if (n + 1 < n_end) {
                const Ring next = Ring::at(j + n + 1 - n_begin);
                mbar_wait(sm.k_full + 8 * next.stage, next.phase);
            }
            wgmma_wait_all();  // P·V of block n - 1 is in: its V is free, O and P may change
            release(sm.v_empty + 8 * prev.stage, lane);
            pack_p(rS, rP);
        }
        release(q_empty, lane);
        if (n_begin < n_end) {
            const Ring last = Ring::at(j + n_end - 1 - n_begin);
            mbar_wait(sm.v_full + 8 * last.stage, last.phase);
            rescale_o(rO, corr);
            wgmma_fence();
            issue_pv(rO, rP, sm.v_stage(last.stage));
            wgmma_wait_all();
            release(sm.v_empty + 8 * last.stage, lane);
        }
    } else {
        for (int n = n_begin; n < n_end; ++n) {
            const Ring r = Ring::at(j + n - n_begin);
            qk_block(rS, sm, r, q_base, c, lane);
            softmax_block(p, w.s, rS, st, n, row0, lane, w.free_lo, w.free_hi, corr);
            rescale_o(rO, corr);
            pack_p(rS, rP);
            mbar_wait(sm.v_full + 8 * r.stage, r.phase);
            sched_wait(c);
            wgmma_fence();
            issue_pv(rO, rP, sm.v_stage(r.stage));
            sched_pass(c);
            wgmma_wait_all();
            release(sm.v_empty + 8 * r.stage, lane);
        }
        release(q_empty, lane);
    }

    // Epilogue: O = acc / sum, 16-bit pairs straight from registers; LSE from one lane per row.
    // The sequence's offsets are read again here rather than kept in registers through the loop.
    const Seq s = sequence(p, w.batch, VARLEN);
    float inv[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float sum = st.sum[h];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        inv[h] = sum == 0.0f ? 0.0f : 1.0f / sum;  // no allowed key: O = 0
        const int i = row0 + 8 * h;
        if (p.lse != nullptr && lane % 4 == 0 && i < s.q_len) {
            float lse = sum == 0.0f ? NEG_INF : st.max[h] * p.lse_scale + __logf(sum);
            if (sum != sum) lse = sum;  // NaN propagates
            p.lse[w.bi * p.lse_batch_stride + w.head * p.lse_head_stride + s.q_start + i] = lse;
        }
    }
    u16* gO = static_cast<u16*>(p.o) + w.bi * p.o_batch_stride + s.q_start * p.o_row_stride +
              w.head * p.o_head_stride;
#pragma unroll
    for (int i = 0; i < O_REGS; i += 2) {
        const int h = acc_slot(i), row = row0 + 8 * h, col = acc_col(i, lane);
        if (row < s.q_len) {
            const u32 v = pack2(rO[i] * inv[h], rO[i + 1] * inv[h]);
            asm volatile("st.global.b32 [%0], %1;\n" ::"l"(gO + row * p.o_row_stride + col), "r"(v) : "memory");
        }
    }
}

__device__ __forceinline__ void consumer(const Sm90Params& P, const Smem& sm, int c) {
    const int total = num_tiles(P.p);
    if (c == 1) sched_pass(1);  // warpgroup 0 issues first
    int j = 0;                  // ring position: key blocks consumed so far
    int kq = 0;                 // tiles consumed so far (VARLEN skips empty ones)
    for (int k = 0;; ++k) {
        const int t = tile_number(k, total);
        if (t < 0) break;
        const Tile w = tile_at(P.p, t);
        if (w.empty) continue;
        consumer_tile(P, sm, c, w, j, Ring::q(VARLEN ? kq++ : k));
        j += w.n_end - w.n_begin;
    }
}

// ---------------------------------------------------------------------------------------------
// Entry: shared-memory carve-out, barrier init, role dispatch.

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1) fa4_fwd_sm90(const __grid_constant__ Sm90Params P) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];

    Smem sm;
    sm.q = (smem_u32(smem_raw) + TILE_ALIGN - 1) & ~static_cast<u32>(TILE_ALIGN - 1);
    sm.k = sm.q + Q_STAGES * Q_BYTES;
    sm.v = sm.k + STAGES * KV_BYTES;
    sm.q_full = sm.v + STAGES * KV_BYTES;
    sm.q_empty = sm.q_full + 8 * Q_STAGES;
    sm.k_full = sm.q_empty + 8 * Q_STAGES;
    sm.v_full = sm.k_full + 8 * STAGES;
    sm.k_empty = sm.v_full + 8 * STAGES;
    sm.v_empty = sm.k_empty + 8 * STAGES;
    sm.v_tail = sm.v_empty + 8 * STAGES;

    if (threadIdx.x == 0) {
        constexpr u32 consumer_warps = 4 * CONSUMER_WGS;  // one release arrival per consumer warp
        for (int t = 0; t < Q_STAGES; ++t) {
            mbar_init(sm.q_full + 8 * t, 1);
            mbar_init(sm.q_empty + 8 * t, consumer_warps);
        }
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(sm.k_full + 8 * s, 1);
            mbar_init(sm.v_full + 8 * s, 1);
            mbar_init(sm.k_empty + 8 * s, consumer_warps);
            mbar_init(sm.v_empty + 8 * s, consumer_warps);
            if constexpr (VARLEN) mbar_init(sm.v_tail + 8 * s, 1);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    }
    __syncthreads();

    const int wg = threadIdx.x / WG_THREADS;
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGS));
        if (threadIdx.x == 0) producer(P, sm);
        if constexpr (VARLEN) {
            if (threadIdx.x / 32 == 1) zero_foreign_v_rows(P, sm, threadIdx.x % 32);
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_REGS));
        consumer(P, sm, wg - 1);
    }
}
