// Split-KV attention over a paged KV cache with all the KV heads of a cache row in one CTA (the
// "heads" decode variant: `FA4_DECODE_VARIANT=heads…`, and what `auto`, the default, runs for
// decode batches of at least 4 sequences × KV-head groups on sm_90+, with BULK). Ampere-class
// instructions (mma.sync m16n8k16, ldmatrix) and, with BULK, the Hopper 1-D bulk copy
// (cp.async.bulk … mbarrier::complete_tx) for the K/V rows.
//
// Self-contained (no CUDA headers). The planner (`config::decode_gpu::HeadsSpec`) prepends a
// prelude defining HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS (= KV heads per CTA), M_TILES, STAGES,
// BULK, FUSE, KV_FP8, IS_BF16, HAS_WINDOW, HAS_SOFTCAP, LAZY_RESCALE and FA4_SMEM_BYTES; then
// come the shared layer (`../common/{base,params,mask,softmax}.cuh`), `../sm80/{ptx,tile_ops}.cuh`,
// `ptx.cuh`, `params.cuh`, `fp8.cuh` (KV_FP8 only), `../common/mbarrier.cuh` (BULK only),
// `merge.cuh` (FUSE only), this file.
//
// Why: the default kernel gives each CTA one KV head, so of every cache row
// ([pages, page_size, heads_kv, d]: heads_kv · d contiguous elements per key) it reads one
// 256-byte piece (d128) at a 2 KB stride, and 7 other CTAs read the rest at other times. Here one
// CTA covers NUM_WARPS KV heads (all 8 of the issue's grid) of a (sequence, row tile, split):
// every key's row is one contiguous copy of NUM_WARPS · d elements, and warp w owns KV head
// head0 + w for every key of a block, with the query heads of that KV head packed into its rows
// (GQA packing as in `splitkv.cu`). A warp's S, softmax and P·V are the default kernel's for one
// warp's KEYS_W = BLOCK_N keys; no warp shares a row with another, so the in-CTA merge is gone
// and each warp writes its own rows.
//
// Shared layout of a K (or V) stage: (BLOCK_N, ROW_PITCH) bytes, key r's heads back to back
// (the global row's layout) and 16 bytes of padding per key, so that the 8 keys an ldmatrix
// phase reads at one chunk fall in 8 different 16-byte bank groups (ROW_BYTES is a multiple of
// 128). The padding keeps a key's row one contiguous span, which the 1-D bulk copy needs (a
// swizzle would not). Q: one swizzled (BLOCK_M, HEAD_DIM) tile per warp.
//
// Pipeline: a STAGES-deep ring of K/V blocks, one __syncthreads per block (everyone is done
// with the stage that gets refilled). Without BULK, every thread issues 16-byte cp.async copies
// (rows past the keys zero-filled). With BULK, warp 0's lanes issue one bulk copy per key row
// (K and V) after lane 0 armed the stage's mbarrier with the block's byte count; every thread
// waits on that barrier's phase; rows past the keys are zeroed by generic stores before the
// arrive (the tail block only), ordered before later bulk writes by a proxy fence.
//
// Non-finite V, masks, softcap, splits, the fused combine (FUSE) and the outputs: as
// `splitkv.cu` (the same formulas per warp). A masked block whose V rows (of this warp's head)
// hold a non-finite value runs its P·V as scalar FMAs that skip P = 0, with P staged in the
// warp's own K rows of the stage.
//
// KV_FP8: the cache holds e4m3 bytes (`fp8.cuh`). A key's row of the CTA's heads is
// HEADS · HEAD_DIM bytes, the pitch that plus 16 (an odd multiple of 16 bytes, which spreads
// the fragments' 16-byte loads over the banks as the 16-bit pad does for ldmatrix); S and P·V
// are `fp8.cuh`'s steps, k_scale and v_scale of the warp's head fold into the softmax's scale
// and the epilogue's 1/sum, and each lane writes its O columns (permuted: o_col) as runs of
// 2·VW consecutive dims.

constexpr int HEADS = NUM_WARPS;                   // KV heads per CTA, one per warp
constexpr int NUM_THREADS = NUM_WARPS * 32;
constexpr int ROW_SLOTS = 2 * M_TILES;             // rows a thread owns: g + 8·slot
constexpr int CHUNK_ELEMS = 8;                     // one 16-byte copy / ldmatrix row, 16-bit
constexpr int CHUNKS = HEAD_DIM / CHUNK_ELEMS;     // 16-byte chunks per 16-bit head row (Q)
#if KV_FP8
typedef unsigned char kv_t;                        // a cache element: an e4m3 byte
#else
typedef u16 kv_t;                                  // a cache element: fp16 or bf16
#endif
constexpr int KV_CHUNK_ELEMS = 16 / sizeof(kv_t);  // cache elements per 16-byte copy
constexpr int KV_CHUNKS = HEAD_DIM / KV_CHUNK_ELEMS;  // 16-byte chunks per K/V head row
#if !KV_FP8
constexpr int KSTEPS_D = HEAD_DIM / 16;            // k16 steps over the head dim (Q·Kᵀ)
#endif
constexpr int NTILES_W = BLOCK_N / 8;              // n8 tiles of a warp's S
constexpr int NTILES_D = HEAD_DIM / 8;             // n8 tiles of O
constexpr int HEAD_BYTES = HEAD_DIM * sizeof(kv_t);  // one head of one key
constexpr int ROW_BYTES = HEADS * HEAD_BYTES;      // one key's row of the CTA's heads
constexpr int ROW_CHUNKS = HEADS * KV_CHUNKS;      // 16-byte chunks of such a row
constexpr int ROW_PITCH = ROW_BYTES + 16;          // its pitch in shared memory (see the header)
constexpr int KV_ROW_STEP = NUM_THREADS / ROW_CHUNKS;  // K/V rows one pass of the CTA covers
constexpr u32 SIGN_BITS = 0x80008000u;             // the sign bits of a packed 16-bit pair
constexpr float LN2 = 0.6931471805599453f;

static_assert(BLOCK_M == 16 * M_TILES, "a tile is M_TILES MMA tiles of 16 rows");
static_assert(BLOCK_N % 16 == 0, "a block is whole k16 steps of P·V");
static_assert(HEAD_DIM % 64 == 0, "the Q swizzle permutes 8 chunks; rows are whole 128-byte groups");
#if KV_FP8
static_assert(ROW_BYTES % 64 == 0, "the 16-byte pad makes the pitch an odd multiple of 16 bytes");
static_assert(BLOCK_M * BLOCK_N * 2 <= BLOCK_N * HEAD_BYTES, "P (BLOCK_M, BLOCK_N) f16 fits in the warp's K rows");
#else
static_assert(ROW_BYTES % 128 == 0, "the 16-byte pad rotates 8 keys over the 8 bank groups");
static_assert(BLOCK_M * BLOCK_N * 4 <= BLOCK_N * HEAD_BYTES, "P (BLOCK_M, BLOCK_N) f32 fits in the warp's K rows");
#endif
static_assert(CHUNKS <= 32 && NUM_THREADS % ROW_CHUNKS == 0 && BLOCK_N % KV_ROW_STEP == 0,
              "K/V copies split evenly over the threads, one fixed chunk per thread");
static_assert(STAGES >= 2, "the K/V ring needs at least double buffering");
static_assert(!BULK || 2 * BLOCK_N <= 32 * 4, "warp 0 issues the bulk copies, a few rows per lane");

constexpr int Q_TILE_BYTES = BLOCK_M * HEAD_DIM * 2;   // per warp: (BLOCK_M, HEAD_DIM) 16-bit
constexpr int KV_TILE_BYTES = BLOCK_N * ROW_PITCH;     // (BLOCK_N, ROW_PITCH) bytes
constexpr int BAR_BYTES = BULK ? 8 * STAGES : 0;       // one mbarrier per stage
constexpr int SMEM_BYTES = HEADS * Q_TILE_BYTES + 2 * STAGES * KV_TILE_BYTES + BAR_BYTES;
static_assert(SMEM_BYTES == FA4_SMEM_BYTES, "the planner's shared-memory count must match");
static_assert((HEADS * Q_TILE_BYTES + 2 * STAGES * KV_TILE_BYTES) % 8 == 0, "mbarriers are 8-byte aligned");

// Byte offset of 16-byte chunk `c` of row `r` in a swizzled (rows, HEAD_DIM) Q tile.
__device__ __forceinline__ u32 q_swizzle(int r, int c) {
    return static_cast<u32>((r * CHUNKS + ((c & ~7) | ((c ^ r) & 7))) * 16);
}
// Byte offset of 16-byte chunk `c` of head `h` of key row `r` in a K/V stage.
__device__ __forceinline__ u32 kv_at(int r, int h, int c) {
    return static_cast<u32>(r * ROW_PITCH + h * HEAD_BYTES + c * 16);
}

// Global element offsets of key `key`'s row (head 0 of the CTA) in K and V: slot key % page_size
// of page page_table[key / page_size]. Only called for keys below the sequence's length (the
// table's used entries, validated on the host).
__device__ __forceinline__ void row_offsets(const DecodeParams& d, const int* table, int key, long long& k_off,
                                            long long& v_off) {
    u32 index, slot;
    page_slot(key, d.page_size, index, slot);
    const long long page = table[index];
    k_off = page * d.p.k_batch_stride + slot * d.p.k_row_stride;
    v_off = page * d.p.v_batch_stride + slot * d.p.v_row_stride;
}

#if BULK
// Key block n's K and V rows into a stage by bulk copies (warp 0 only). Rows past the keys are
// zeroed first with generic stores (the tail block only), fenced for the stage's later bulk
// writes and published by lane 0's arrive (a release, after the __syncwarp that orders the
// other lanes' stores before it), which also arms the barrier with the bytes of the valid rows;
// then lane r copies rows r, r + 32, … of the 2·BLOCK_N (K rows, then V rows).
__device__ __forceinline__ void load_kv_block(const DecodeParams& d, const int* table, int k_len, int head0, int n,
                                              u32 sK, u32 sV, u32 bar, int lane) {
    const FwdParams& p = d.p;
    const int valid = min(BLOCK_N, k_len - n * BLOCK_N);
    if (valid < BLOCK_N) {
        for (int i = lane; i < 2 * BLOCK_N; i += 32) {
            const int r = i % BLOCK_N;
            if (r < valid) continue;
            const u32 dst = (i >= BLOCK_N ? sV : sK) + static_cast<u32>(r * ROW_PITCH);
#pragma unroll 1
            for (int c = 0; c < ROW_CHUNKS; ++c) st_shared_v4(dst + 16 * c, 0u, 0u, 0u, 0u);
        }
        fence_proxy_async();  // the zeros before any later bulk write of the stage
        __syncwarp();
    }
    if (lane == 0) mbar_expect_tx(bar, static_cast<u32>(2 * valid * ROW_BYTES));
    __syncwarp();
    for (int i = lane; i < 2 * valid; i += 32) {
        const bool is_v = i >= valid;
        const int r = is_v ? i - valid : i;
        long long k_off, v_off;
        row_offsets(d, table, n * BLOCK_N + r, k_off, v_off);
        const kv_t* src = is_v ? static_cast<const kv_t*>(p.v) + v_off + head0 * p.v_head_stride
                               : static_cast<const kv_t*>(p.k) + k_off + head0 * p.k_head_stride;
        bulk_copy_g2s((is_v ? sV : sK) + static_cast<u32>(r * ROW_PITCH), src, static_cast<u32>(ROW_BYTES), bar);
    }
}
#else
// Key block n's K and V rows into a stage by 16-byte cp.async copies of every thread: thread
// tid copies chunk tid % ROW_CHUNKS of rows tid / ROW_CHUNKS + KV_ROW_STEP·i, zero-filled past
// the keys without touching the table.
__device__ __forceinline__ void load_kv_block(const DecodeParams& d, const int* table, int k_len, int head0, int n,
                                              u32 sK, u32 sV, int tid) {
    const FwdParams& p = d.p;
    const int cc = tid % ROW_CHUNKS, h = cc / KV_CHUNKS, c = cc % KV_CHUNKS;
    const kv_t* gK = static_cast<const kv_t*>(p.k) + (head0 + h) * p.k_head_stride + c * KV_CHUNK_ELEMS;
    const kv_t* gV = static_cast<const kv_t*>(p.v) + (head0 + h) * p.v_head_stride + c * KV_CHUNK_ELEMS;
#pragma unroll
    for (int i = 0; i < BLOCK_N / KV_ROW_STEP; ++i) {
        const int r = tid / ROW_CHUNKS + i * KV_ROW_STEP;
        const int key = n * BLOCK_N + r;
        const bool ok = key < k_len;
        long long k_off = 0, v_off = 0;
        if (ok) row_offsets(d, table, key, k_off, v_off);
        cp_async_16(sK + kv_at(r, h, c), gK + k_off, ok ? 16 : 0);
        cp_async_16(sV + kv_at(r, h, c), gV + v_off, ok ? 16 : 0);
    }
}
#endif

#if !KV_FP8
// Whether any value of this warp's head in the V stage is an infinity or NaN (warp-uniform).
__device__ __forceinline__ bool warp_v_nonfinite(u32 sVs, int warp, int lane) {
    bool bad = false;
#pragma unroll
    for (int i = 0; i < BLOCK_N * CHUNKS / 32; ++i) {
        const int idx = lane + 32 * i;
        u32 x[4];
        ld_shared_v4(x, sVs + kv_at(idx / CHUNKS, warp, idx % CHUNKS));
        bad |= nonfinite_pair(x[0]) || nonfinite_pair(x[1]) || nonfinite_pair(x[2]) || nonfinite_pair(x[3]);
    }
    return __any_sync(0xffffffffu, bad);
}
#endif

// Byte `e` of P (BLOCK_M, BLOCK_N) row-major (f32, or f16 with KV_FP8), laid into this warp's
// head's K rows of the stage: HEAD_BYTES per key row, at the row pitch.
__device__ __forceinline__ u32 p_at(u32 sKs, int warp, int e) {
    return sKs + static_cast<u32>((e / HEAD_BYTES) * ROW_PITCH + warp * HEAD_BYTES + e % HEAD_BYTES);
}

#if !KV_FP8

// O += P·V over the block's keys as scalar FMAs that skip P = 0 (see `splitkv.cu`'s
// pv_skip_zero): P goes into this warp's own K rows, which it has read for S and no other warp
// reads; the stage is refilled only after the next __syncthreads.
__device__ __forceinline__ void pv_skip_zero(float (&rO)[M_TILES][NTILES_D][4], const float (&rS)[M_TILES][NTILES_W][4],
                                             u32 sKs, u32 sVs, int warp, int g, int t) {
    __syncwarp();  // every lane's ldmatrix of these K rows is done
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int i = 0; i < NTILES_W; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = 16 * mt + g + 8 * (e / 2), key = 8 * i + 2 * t + (e & 1);
                st_shared_f32(p_at(sKs, warp, (row * BLOCK_N + key) * 4), rS[mt][i][e]);
            }
    __syncwarp();
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = 16 * mt + g + 8 * h;
#pragma unroll
            for (int j = 0; j < NTILES_D; ++j)
#pragma unroll
                for (int c2 = 0; c2 < 2; ++c2) {
                    float acc = 0.0f;
#pragma unroll 1
                    for (int k = 0; k < BLOCK_N; ++k) {
                        const float pv = ld_shared_f32(p_at(sKs, warp, (row * BLOCK_N + k) * 4));
                        if (pv != 0.0f) acc = fmaf(pv, ld_shared_16_f32(sVs + kv_at(k, warp, j) + 2 * (2 * t + c2)), acc);
                    }
                    rO[mt][j][2 * h + c2] += acc;
                }
        }
    __syncwarp();
#if BULK
    fence_proxy_async();  // P's generic stores before the stage's next bulk fill
#endif
}
#endif

// This warp's KV head's packed rows into its Q tile (rows past `valid` zero), negated for a
// negative scale. With an fp8 cache the tile takes the f16 form of fp8.cuh's Q·Kᵀ, and
// factor[r] receives 2^e_r of this lane's row slot r (row g + 8·(r % 2) of MMA tile r / 2).
__device__ __forceinline__ void load_q_tile(const DecodeParams& d, const Seq& s, int b, int kv_head, int m0,
                                            int valid, u32 sQ, int lane, float (&factor)[ROW_SLOTS]) {
    const FwdParams& p = d.p;
    const bool packed = p.cu_seqlens_q != nullptr;
    const u32 flip = p.negate_q ? SIGN_BITS : 0u;
    static_assert(32 % CHUNKS == 0 && BLOCK_M * CHUNKS % 32 == 0, "a pass holds whole rows; the warp runs every pass");
#pragma unroll
    for (int r = 0; r < ROW_SLOTS; ++r) factor[r] = 1.0f;
    for (int idx = lane; idx < BLOCK_M * CHUNKS; idx += 32) {
        const int r = idx / CHUNKS, c = idx % CHUNKS;
        u32 x[4] = {0u, 0u, 0u, 0u};
        if (r < valid) {
            const int pr = m0 + r;
            const int qi = s.q_start + pr / p.group, head = kv_head * p.group + pr % p.group;
            const u16* row = static_cast<const u16*>(p.q) + (packed ? 0 : b * p.q_batch_stride) +
                             qi * p.q_row_stride + head * p.q_head_stride;
#if KV_FP8
            ld_q_chunk_fp8(x, row, c);  // the dims in the order fp8.cuh's Q·Kᵀ takes them
#else
            ld_global_v4(x, row + c * CHUNK_ELEMS);
#endif
        }
#if KV_FP8
        const int e_r = q_chunk_to_f16<CHUNKS>(x);  // the row's CHUNKS lanes together
        if constexpr (IS_BF16) {
            // Each lane takes its rows' factors from the first lane of the row in this pass.
            const float f = exp2_int(e_r);
            const int pass = idx / 32;
#pragma unroll
            for (int slot = 0; slot < ROW_SLOTS; ++slot) {
                const int row = 16 * (slot / 2) + lane / 4 + 8 * (slot % 2);
                const float v = __shfl_sync(0xffffffffu, f, row * CHUNKS % 32);
                if (row * CHUNKS / 32 == pass) factor[slot] = v;
            }
        }
#endif
#pragma unroll
        for (int e = 0; e < 4; ++e) x[e] ^= flip;
        st_shared_v4(sQ + q_swizzle(r, c), x[0], x[1], x[2], x[3]);
    }
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1) fa4_decode_heads(const __grid_constant__ DecodeParams d) {
    extern __shared__ __align__(128) unsigned char smem[];
    const FwdParams& p = d.p;
    const int tid = threadIdx.x;
    const int warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;

    const int head_groups = p.heads_q / p.group / HEADS;  // CTAs per sequence along the heads
    const int b = blockIdx.x / head_groups, head0 = (blockIdx.x % head_groups) * HEADS;
    const int kv_head = head0 + warp;
    const int split = blockIdx.z;
    const Seq s = paged_sequence(d, b);
    const int rows = s.q_len * p.group;  // packed rows of this (sequence, KV head)
    const int m0 = blockIdx.y * BLOCK_M;
    if (m0 >= rows) return;
    const int valid_m = min(BLOCK_M, rows - m0);
    const int* table = d.page_table + static_cast<long long>(b) * d.max_pages;

    // This split's key blocks, cut to those the tile's rows may see (as `splitkv.cu`).
    const int blocks = (s.k_len + BLOCK_N - 1) / BLOCK_N;
    const int per_split = (blocks + d.num_splits - 1) / d.num_splits;
    const KeyBlocks kb = key_blocks(p, s, m0 / p.group, (m0 + valid_m - 1) / p.group, true);
    const int n_begin = max(kb.n_begin, split * per_split);
    const int n_end = min(kb.n_end, min(blocks, (split + 1) * per_split));

    const u32 sQ = smem_u32(smem) + warp * Q_TILE_BYTES;  // (BLOCK_M, HEAD_DIM), this warp's head
    const u32 sK = smem_u32(smem) + HEADS * Q_TILE_BYTES;  // STAGES × (BLOCK_N, ROW_PITCH)
    const u32 sV = sK + STAGES * KV_TILE_BYTES;
#if KV_FP8
    // The cache's scales of this warp's head: k_scale multiplies every score
    // (scores_scale_log2 and scores_softcap_scale fold it in), v_scale the normalised O.
    const float k_scale = d.k_scale[kv_head], v_scale = d.v_scale[kv_head];
#else
    constexpr float k_scale = 1.0f;  // a 16-bit cache has no scales
#endif
#if BULK
    // full[st]: producer lane 0 of warp 0 (one arrival with the block's bytes) and the bulk
    // copies' complete_tx; consumers all threads; phase i of stage st is block st + STAGES·i.
    const u32 full = sV + STAGES * KV_TILE_BYTES;
    if (tid == 0) {
        for (int st = 0; st < STAGES; ++st) mbar_init(full + 8 * st, 1);
        fence_mbarrier_init();
    }
    __syncthreads();
    if (warp == 0) {
#pragma unroll
        for (int st = 0; st < STAGES - 1; ++st)
            if (n_begin + st < n_end)
                load_kv_block(d, table, s.k_len, head0, n_begin + st, sK + st * KV_TILE_BYTES,
                              sV + st * KV_TILE_BYTES, full + 8 * st, lane);
    }
#else
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
        if (n_begin + st < n_end)
            load_kv_block(d, table, s.k_len, head0, n_begin + st, sK + st * KV_TILE_BYTES, sV + st * KV_TILE_BYTES,
                          tid);
        cp_async_commit();
    }
#endif
    float q_factor[ROW_SLOTS];  // 2^e_r of this thread's rows (fp8.cuh's Q·Kᵀ with bf16 queries)
    load_q_tile(d, s, b, kv_head, m0, valid_m, sQ, lane, q_factor);

    float rO[M_TILES][NTILES_D][4];  // O accumulator, (BLOCK_M, HEAD_DIM) of this warp's head
    float row_max[ROW_SLOTS];        // raw scores (before scale_log2)
    float row_sum[ROW_SLOTS];        // this thread's columns only
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int i = 0; i < NTILES_D; ++i) rO[mt][i][0] = rO[mt][i][1] = rO[mt][i][2] = rO[mt][i][3] = 0.0f;
#pragma unroll
    for (int r = 0; r < ROW_SLOTS; ++r) {
        row_max[r] = NEG_INF;
        row_sum[r] = 0.0f;
    }

    // Lane roles in the ldmatrix patterns, as `splitkv.cu`.
    const int a_row = (lane % 8) + ((lane / 8) % 2) * 8, a_chunk = lane / 16;
#if !KV_FP8
    const int k_row = (lane % 8) + (lane / 16) * 8, k_chunk = (lane / 8) % 2;
#endif

    for (int n = n_begin; n < n_end; ++n) {
        const int it = n - n_begin;
        const int stage = it % STAGES;
#if BULK
        __syncthreads();  // everyone is done with block it − 1's stage (and, at it = 0, its Q)
        if (warp == 0 && n + STAGES - 1 < n_end) {
            const int st = (it + STAGES - 1) % STAGES;
            load_kv_block(d, table, s.k_len, head0, n + STAGES - 1, sK + st * KV_TILE_BYTES, sV + st * KV_TILE_BYTES,
                          full + 8 * st, lane);
        }
        mbar_wait(full + 8 * stage, static_cast<u32>((it / STAGES) & 1));  // block it has landed
#else
        cp_async_wait<STAGES - 2>();  // block `it` has landed (this thread's copies) …
        __syncthreads();              // … and everyone's; everyone is done with block it − 1.
        if (n + STAGES - 1 < n_end) {
            const int st = (it + STAGES - 1) % STAGES;
            load_kv_block(d, table, s.k_len, head0, n + STAGES - 1, sK + st * KV_TILE_BYTES, sV + st * KV_TILE_BYTES,
                          tid);
        }
        cp_async_commit();
#endif
        const u32 sKs = sK + stage * KV_TILE_BYTES, sVs = sV + stage * KV_TILE_BYTES;

        // S = Q·Kᵀ of this warp's head over the block, (BLOCK_M, BLOCK_N).
        float rS[M_TILES][NTILES_W][4];
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int i = 0; i < NTILES_W; ++i) rS[mt][i][0] = rS[mt][i][1] = rS[mt][i][2] = rS[mt][i][3] = 0.0f;
#if KV_FP8
        // This warp's head's K and V rows of the stage.
        const auto k_row = [&](int key) { return sKs + static_cast<u32>(key * ROW_PITCH + warp * HEAD_BYTES); };
        const auto v_row = [&](int key) { return sVs + static_cast<u32>(key * ROW_PITCH + warp * HEAD_BYTES); };
        qk_fp8(rS, [&](int mt, int kk) { return sQ + q_swizzle(16 * mt + a_row, 2 * kk + a_chunk); }, k_row, g, t);
        if constexpr (IS_BF16) unscale_rows(rS, q_factor);
#else
#pragma unroll
        for (int kk = 0; kk < KSTEPS_D; ++kk) {
            u32 qa[M_TILES][4];
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) ldmatrix_x4(qa[mt], sQ + q_swizzle(16 * mt + a_row, 2 * kk + a_chunk));
#pragma unroll
            for (int np = 0; np < NTILES_W / 2; ++np) {
                u32 kb4[4];
                ldmatrix_x4(kb4, sKs + kv_at(16 * np + k_row, warp, 2 * kk + k_chunk));
#pragma unroll
                for (int mt = 0; mt < M_TILES; ++mt) {
                    mma_16816(rS[mt][2 * np], qa[mt], kb4[0], kb4[1]);
                    mma_16816(rS[mt][2 * np + 1], qa[mt], kb4[2], kb4[3]);
                }
            }
        }
#endif

        if constexpr (HAS_SOFTCAP) {
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
                for (int i = 0; i < NTILES_W; ++i)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        rS[mt][i][e] = p.softcap * tanh_accurate(rS[mt][i][e] * scores_softcap_scale(p, k_scale));
        }

        // Mask: only blocks that cross some row's key bounds (or the end of the keys).
        const bool masked = kb.masked(n);
        if (masked) {
            const int key0 = n * BLOCK_N;
#pragma unroll
            for (int r = 0; r < ROW_SLOTS; ++r) {
                const int qi = (m0 + 16 * (r / 2) + g + 8 * (r % 2)) / p.group;
                const int lo = key_lo(p, s, qi), hi = key_hi(p, s, qi);
#pragma unroll
                for (int i = 0; i < NTILES_W; ++i)
#pragma unroll
                    for (int e = 2 * (r % 2); e < 2 * (r % 2) + 2; ++e) {
#if KV_FP8
                        const int j = key0 + s_key(i, t, e & 1);
#else
                        const int j = key0 + i * 8 + 2 * t + (e & 1);
#endif
                        if (j < lo || j >= hi) rS[r / 2][i][e] = NEG_INF;
                    }
            }
        }

        // Online softmax per row slot r (row g + 8·(r % 2) of MMA tile r / 2); a quad shares a row.
        float corr[ROW_SLOTS];
#pragma unroll
        for (int r = 0; r < ROW_SLOTS; ++r) {
            const int mt = r / 2, h = r % 2;
            float mx = row_max[r];
#pragma unroll
            for (int i = 0; i < NTILES_W; ++i) mx = fmaxf(mx, fmaxf(rS[mt][i][2 * h], rS[mt][i][2 * h + 1]));
            mx = quad_max(mx);
            const float shift = update_row_max(row_max[r], mx, scores_scale_log2(p, k_scale), corr[r]);
            float sum = 0.0f;
#pragma unroll
            for (int i = 0; i < NTILES_W; ++i)
#pragma unroll
                for (int e = 2 * h; e < 2 * h + 2; ++e) {
                    rS[mt][i][e] = exp2_approx(score_exponent(rS[mt][i][e], scores_scale_log2(p, k_scale), shift));
                    sum += rS[mt][i][e];
                }
            row_sum[r] = row_sum[r] * corr[r] + sum;
        }
        // Rescale O: a warp-uniform branch under LAZY_RESCALE, rare after the first blocks.
        bool moved = false;
#pragma unroll
        for (int r = 0; r < ROW_SLOTS; ++r) moved |= corr[r] != 1.0f;
        if (!LAZY_RESCALE || __any_sync(0xffffffffu, moved)) rescale_o(rO, corr);

        // O += P·V over the block's keys.
#if KV_FP8
        if (masked && warp_v_nan_fp8<BLOCK_N>(v_row, lane)) {
            pv_skip_zero_fp8<M_TILES, NTILES_W, NTILES_D, BLOCK_N>(
                rO, rS, [&](int e) { return p_at(sKs, warp, e); }, v_row, g, t);
#if BULK
            fence_proxy_async();  // P's generic stores before the stage's next bulk fill
#endif
        } else {
#pragma unroll
            for (int ks = 0; ks < BLOCK_N / 16; ++ks) pv_fp8(rO, rS, ks, v_row, g, t);
        }
#else
        if (masked && warp_v_nonfinite(sVs, warp, lane)) {
            pv_skip_zero(rO, rS, sKs, sVs, warp, g, t);
        } else {
#pragma unroll
            for (int ks = 0; ks < BLOCK_N / 16; ++ks) {
                u32 pa[M_TILES][4];
                pack_p(pa, rS, ks);
                pv_k16(rO, pa, [&](int dp) { return sVs + kv_at(16 * ks + a_row, warp, 2 * dp + a_chunk); });
            }
        }
#endif
    }
#if !BULK
    cp_async_wait<0>();  // no copy is left in flight at exit (the tail groups are empty)
#endif

    // Epilogue: this warp's rows are whole (no other warp holds a part of them). With the shift
    // of the row's max (0 for an infinite max): L = sum, O = O / L, LSE = shift·ln 2 + ln L
    // (the single-warp case of `splitkv.cu`'s merge: −inf for no key, NaN propagates).
    const bool direct = d.num_splits == 1;
    float row_l[ROW_SLOTS];
#pragma unroll
    for (int r = 0; r < ROW_SLOTS; ++r) row_l[r] = quad_sum(row_sum[r]);  // every lane: shuffles
#pragma unroll
    for (int r = 0; r < ROW_SLOTS; ++r) {
        const int mt = r / 2, h = r % 2;
        const int row = 16 * mt + g + 8 * h;
        if (row >= valid_m) continue;
        const float l = row_l[r];
        const float shift = fabsf(row_max[r]) == -NEG_INF ? 0.0f : row_max[r] * scores_scale_log2(p, k_scale);
#if KV_FP8
        const float inv = row_inv_sum(l) * v_scale;
#else
        const float inv = row_inv_sum(l);
#endif
        float lse = l == 0.0f ? NEG_INF : shift * LN2 + __logf(l);
        if (l != l) lse = l;  // NaN propagates
        const int pr = m0 + row;
        const OutRow o = out_row(p, s, b, pr / p.group, kv_head * p.group + pr % p.group);
#if KV_FP8
        // Per group a, this lane's values are dims 8VW·a + 2VW·t .. + 2VW − 1 (o_col): value x
        // of the run is column 2t + x / VW of n8 tile VW·a + x % VW.
        const auto run = [&](int a, int x) { return rO[mt][VW * a + x % VW][2 * h + x / VW] * inv; };
        if (direct) {
#pragma unroll
            for (int a = 0; a < V_GROUPS; ++a) {
                u16* dst = static_cast<u16*>(p.o) + o.o_off + 8 * VW * a + 2 * VW * t;
#pragma unroll
                for (int k = 0; k < 2 * VW / 8; ++k) {
                    u32 x[4];
#pragma unroll
                    for (int e = 0; e < 4; ++e) x[e] = pack2(run(a, 8 * k + 2 * e), run(a, 8 * k + 2 * e + 1));
                    st_global_v4(dst + 8 * k, x);
                }
            }
            if (t == 0 && p.lse != nullptr) p.lse[o.lse_off] = lse;
        } else {
#pragma unroll
            for (int a = 0; a < V_GROUPS; ++a) {
                float* dst = d.o_part + (split * d.part_rows + o.part_row) * HEAD_DIM + 8 * VW * a + 2 * VW * t;
#pragma unroll
                for (int k = 0; k < 2 * VW / 4; ++k)
                    st_global_f32x4(dst + 4 * k, run(a, 4 * k), run(a, 4 * k + 1), run(a, 4 * k + 2), run(a, 4 * k + 3));
            }
            if (t == 0) d.lse_part[split * d.part_rows + o.part_row] = lse;
        }
#else
        if (direct) {
            u16* dst = static_cast<u16*>(p.o) + o.o_off + 2 * t;
#pragma unroll
            for (int j = 0; j < NTILES_D; ++j)
                st_global_b32(dst + 8 * j, pack2(rO[mt][j][2 * h] * inv, rO[mt][j][2 * h + 1] * inv));
            if (t == 0 && p.lse != nullptr) p.lse[o.lse_off] = lse;
        } else {
            float* dst = d.o_part + (split * d.part_rows + o.part_row) * HEAD_DIM + 2 * t;
#pragma unroll
            for (int j = 0; j < NTILES_D; ++j)
                st_global_f32x2(dst + 8 * j, rO[mt][j][2 * h] * inv, rO[mt][j][2 * h + 1] * inv);
            if (t == 0) d.lse_part[split * d.part_rows + o.part_row] = lse;
        }
#endif
    }
#if FUSE
    // The fused combine (merge.cuh): the tile's last split CTA merges its rows, each warp its
    // KV head's.
    if (!direct && fused_combine_arrive(d)) {
        for (int row = 0; row < valid_m; ++row) {
            const int pr = m0 + row;
            merge_split_row(d, out_row(p, s, b, pr / p.group, kv_head * p.group + pr % p.group).part_row, lane);
        }
    }
#endif
}
