// Split-KV attention over a paged KV cache (decode, speculative decode, chunked prefill), on the
// Ampere-class instructions (mma.sync m16n8k16, cp.async, ldmatrix): sm_80 and later.
//
// Self-contained (no CUDA headers). The planner (`config::decode_gpu`) prepends a prelude
// defining HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, M_TILES, STAGES, IS_BF16, HAS_WINDOW,
// HAS_SOFTCAP, LAZY_RESCALE, FUSE, KV_FP8 and FA4_SMEM_BYTES; then come the shared layer
// (`../common/{base,params,mask,softmax}.cuh`), `../sm80/{ptx,tile_ops}.cuh`, `ptx.cuh`,
// `params.cuh`, `fp8.cuh` (KV_FP8 only), `merge.cuh` (FUSE only), this file.
//
// Work split: one CTA per (sequence · KV head, tile of BLOCK_M packed rows, split). GQA packing:
// packed row r of a (sequence, KV head) is query row r / group of query head
// kv_head · group + r % group, so the query heads that share a KV head read each K/V block once.
// A decode tile has few rows (4 at group 4, seqlen_q 1), so the warps split the keys, not the
// rows: every warp computes all BLOCK_M rows (M_TILES MMA tiles of 16) against its own KEYS_W
// keys of each block, with its own online softmax; the warps' states are merged at the end
// through shared memory. Keys are gathered from their pages row by row (any page size; a block
// may span pages) with cp.async into a STAGES-deep ring.
//
// Non-finite V: a masked key's P is 0, but the MMA computes 0·NaN = NaN, which would leak a NaN
// (or ∞) in V into rows that mask the key. Blocks that mask some key (the edges) check the
// warp's V rows; if one holds a non-finite value, that block's P·V runs as scalar FMAs that skip
// P = 0 (the spec's rule: rows that mask key j never see v_j).
//
// The CTA's split of the keys is whole key blocks: with one split it writes O (16-bit) and LSE;
// with more it writes its normalised partial O (f32) and LSE to the workspace, and
// `fa4_decode_combine` merges the splits; with FUSE (the `fuse` variant) the tile's last split
// CTA to finish merges them instead (`merge.cuh`), and there is no second launch.
//
// KV_FP8: the cache holds e4m3 bytes (`fp8.cuh` has the layouts and the conversions). The ring's
// rows are HEAD_DIM bytes at a pitch of HEAD_DIM + 16 (no swizzle: the fragments are built from
// 16-byte shared loads, whose lanes the pitch spreads over the banks), and a 16-byte copy moves
// 16 keys' elements, so a stage is half the 16-bit one's bytes and the ring twice as deep for
// the same shared memory. S and P·V are `fp8.cuh`'s steps; k_scale[kv_head] multiplies the
// softmax's scale, v_scale[kv_head] the merge's factors; O's columns are permuted (o_col), and
// the warps' O go through shared memory in that order, chunks swizzled (so_chunk).

constexpr int NUM_THREADS = NUM_WARPS * 32;
constexpr int KEYS_W = BLOCK_N / NUM_WARPS;       // keys of a block each warp owns
constexpr int ROW_SLOTS = 2 * M_TILES;            // rows a thread owns: g + 8·slot
constexpr int CHUNK_ELEMS = 8;                    // one 16-byte cp.async / ldmatrix row
constexpr int CHUNKS = HEAD_DIM / CHUNK_ELEMS;    // 16-byte chunks per 16-bit tile row (Q, O)
#if KV_FP8
typedef unsigned char kv_t;                       // a cache element: an e4m3 byte
constexpr int KV_PITCH = HEAD_DIM + 16;           // bytes between K/V rows in shared memory
#else
typedef u16 kv_t;                                 // a cache element: fp16 or bf16
#endif
constexpr int KV_CHUNK_ELEMS = 16 / sizeof(kv_t); // cache elements per 16-byte copy
constexpr int KV_CHUNKS = HEAD_DIM / KV_CHUNK_ELEMS;  // 16-byte copies per K/V row
constexpr int KV_ROW_STEP = NUM_THREADS / KV_CHUNKS;  // K/V rows one pass of the copies covers
#if !KV_FP8
constexpr int KSTEPS_D = HEAD_DIM / 16;           // k16 steps over the head dim (Q·Kᵀ)
#endif
constexpr int NTILES_W = KEYS_W / 8;              // n8 tiles of a warp's S
constexpr int NTILES_D = HEAD_DIM / 8;            // n8 tiles of O
constexpr int ROW_STEP = NUM_THREADS / CHUNKS;    // rows one pass of the threads' copies covers
constexpr u32 SIGN_BITS = 0x80008000u;            // the sign bits of a packed 16-bit pair
constexpr float LN2 = 0.6931471805599453f;

static_assert(BLOCK_M == 16 * M_TILES, "a tile is M_TILES MMA tiles of 16 rows");
static_assert(KEYS_W % 16 == 0, "each warp's keys are whole k16 steps of P·V");
static_assert(HEAD_DIM % 64 == 0, "the swizzle permutes 8 chunks: rows are whole 128-byte groups");
static_assert(NUM_THREADS % CHUNKS == 0, "Q copies: each thread keeps one 16-byte chunk of the rows");
static_assert(NUM_THREADS % KV_CHUNKS == 0 && BLOCK_N % KV_ROW_STEP == 0, "K/V copies split evenly over the threads");
static_assert(STAGES >= 2, "the K/V ring needs at least double buffering");

constexpr int Q_TILE_BYTES = BLOCK_M * HEAD_DIM * 2;   // (BLOCK_M, HEAD_DIM) 16-bit
#if KV_FP8
constexpr int KV_TILE_BYTES = BLOCK_N * KV_PITCH;      // (BLOCK_N, HEAD_DIM) bytes, rows KV_PITCH apart
static_assert(2 * BLOCK_M <= HEAD_DIM, "P (BLOCK_M, KEYS_W) f16 fits in the warp's K rows (pv_skip_zero_fp8)");
#else
constexpr int KV_TILE_BYTES = BLOCK_N * HEAD_DIM * 2;  // (BLOCK_N, HEAD_DIM) 16-bit
#endif
constexpr int RING_BYTES = 2 * STAGES * KV_TILE_BYTES;
// The merge of the warps reuses the K/V ring for each warp's f32 O, (NUM_WARPS, BLOCK_M,
// HEAD_DIM), and the Q tile for the per-row statistics (max, sum, factor per warp; LSE). The
// 16-bit rings always hold the warps' O; an fp8 ring of few stages may not, and shared memory
// is then the larger of the two.
constexpr int MERGE_O_BYTES = NUM_WARPS * BLOCK_M * HEAD_DIM * 4;
constexpr int MERGE_STAT_BYTES = (3 * NUM_WARPS + 1) * BLOCK_M * 4;
constexpr int SMEM_BYTES = Q_TILE_BYTES + (RING_BYTES > MERGE_O_BYTES ? RING_BYTES : MERGE_O_BYTES);
static_assert(SMEM_BYTES == FA4_SMEM_BYTES, "the planner's shared-memory count must match");
static_assert(KV_FP8 || MERGE_O_BYTES <= RING_BYTES, "the warps' O fit in the K/V ring");
static_assert(MERGE_STAT_BYTES <= Q_TILE_BYTES, "the row statistics fit in the Q tile");

// Byte offset of 16-byte chunk `c` of row `r` in a swizzled (rows, HEAD_DIM) tile: the low three
// chunk bits are XORed with the row's, so the 8 rows an ldmatrix reads (and the rows a pass of
// copies writes) fall in 8 different bank groups.
__device__ __forceinline__ u32 swizzle(int r, int c) {
    return static_cast<u32>((r * CHUNKS + ((c & ~7) | ((c ^ r) & 7))) * 16);
}

// Byte offset of 16-byte copy `c` of K/V row `r` in a stage: the swizzled 16-bit tile, or the
// fp8 rows at their pitch.
__device__ __forceinline__ u32 kv_chunk(int r, int c) {
#if KV_FP8
    return static_cast<u32>(r * KV_PITCH + 16 * c);
#else
    return swizzle(r, c);
#endif
}

#if KV_FP8
// Float offset, in a warp's (BLOCK_M, HEAD_DIM) f32 O of the merge, of the 16-byte chunk that
// holds dims 4q .. 4q + 3 of `row`. A lane's O values of a row are runs of 2·VW consecutive dims
// (o_col); its stores of one run step through them 16 bytes at a time, and the 8 lanes of a
// store phase (4 lanes of a quad, 2 rows) would all hit the same bank group: the chunk index
// is XORed (within groups of 8 chunks) with the lane's run and the row's parity.
__device__ __forceinline__ int so_chunk(int row, int q) {
    const int v = VW == 16 ? (((q >> 3) & 3) | ((row & 1) << 2)) : (((q >> 3) & 1) | ((row & 1) << 1));
    return row * HEAD_DIM + 4 * (q ^ v);
}
#endif

// Issues the copies of key block n's K and V rows into a stage: row r is key n·BLOCK_N + r,
// slot key % page_size of page page_table[key / page_size]; rows past the sequence's keys are
// zero-filled without touching the table (its entries there are unvalidated).
__device__ __forceinline__ void load_kv_block(const DecodeParams& d, const int* table, int k_len, int kv_head,
                                              int n, u32 sK, u32 sV, int tid) {
    const FwdParams& p = d.p;
    const int c = tid % KV_CHUNKS;
    const kv_t* gK = static_cast<const kv_t*>(p.k) + kv_head * p.k_head_stride + c * KV_CHUNK_ELEMS;
    const kv_t* gV = static_cast<const kv_t*>(p.v) + kv_head * p.v_head_stride + c * KV_CHUNK_ELEMS;
#pragma unroll
    for (int i = 0; i < BLOCK_N / KV_ROW_STEP; ++i) {
        const int r = tid / KV_CHUNKS + i * KV_ROW_STEP;
        const int key = n * BLOCK_N + r;
        const bool ok = key < k_len;
        long long k_off = 0, v_off = 0;
        if (ok) {
            u32 index, slot;
            page_slot(key, d.page_size, index, slot);
            const long long page = table[index];
            k_off = page * p.k_batch_stride + slot * p.k_row_stride;
            v_off = page * p.v_batch_stride + slot * p.v_row_stride;
        }
        cp_async_16(sK + kv_chunk(r, c), gK + k_off, ok ? 16 : 0);
        cp_async_16(sV + kv_chunk(r, c), gV + v_off, ok ? 16 : 0);
    }
}

// Whether any value of the warp's KEYS_W rows of a V tile is an infinity or NaN (warp-uniform).
__device__ __forceinline__ bool warp_v_nonfinite(u32 sVs, int wk0, int lane) {
    bool bad = false;
#pragma unroll
    for (int i = 0; i < KEYS_W * CHUNKS / 32; ++i) {
        const int idx = lane + 32 * i;
        u32 x[4];
        ld_shared_v4(x, sVs + swizzle(wk0 + idx / CHUNKS, idx % CHUNKS));
        bad |= nonfinite_pair(x[0]) || nonfinite_pair(x[1]) || nonfinite_pair(x[2]) || nonfinite_pair(x[3]);
    }
    return __any_sync(0xffffffffu, bad);
}

// O += P·V over the warp's keys as scalar FMAs that skip P = 0, for a block whose V holds a
// non-finite value (see the header). P goes through shared memory, into this warp's own K rows
// of the stage: the warp has read them for S, no other warp reads them, and the stage is
// refilled only after the next __syncthreads. Each O element this lane owns takes its sum over
// the keys in a rolled loop, so the branch adds a few live registers: unrolled over the keys
// with shuffles, it made ptxas spill 0.4–1.6 KB per thread in every variant, slowing the hot
// loop too; with all of a key's FMAs at once, d256 spilled 0.7 KB.
__device__ __forceinline__ void pv_skip_zero(float (&rO)[M_TILES][NTILES_D][4], const float (&rS)[M_TILES][NTILES_W][4],
                                             u32 sKs, u32 sVs, int wk0, int g, int t) {
    static_assert(BLOCK_M * KEYS_W * 4 <= KEYS_W * HEAD_DIM * 2, "P (BLOCK_M, KEYS_W) f32 fits in the warp's K rows");
    const u32 sP = sKs + static_cast<u32>(wk0 * CHUNKS * 16);  // (BLOCK_M, KEYS_W) f32, row-major
    __syncwarp();  // every lane's ldmatrix of these K rows is done
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int i = 0; i < NTILES_W; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = 16 * mt + g + 8 * (e / 2), key = 8 * i + 2 * t + (e & 1);
                st_shared_f32(sP + static_cast<u32>((row * KEYS_W + key) * 4), rS[mt][i][e]);
            }
    __syncwarp();
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const u32 sProw = sP + static_cast<u32>((16 * mt + g + 8 * h) * KEYS_W * 4);
#pragma unroll
            for (int j = 0; j < NTILES_D; ++j)
#pragma unroll
                for (int c2 = 0; c2 < 2; ++c2) {
                    float acc = 0.0f;
#pragma unroll 1
                    for (int k = 0; k < KEYS_W; ++k) {
                        const float pv = ld_shared_f32(sProw + static_cast<u32>(k * 4));
                        if (pv != 0.0f)
                            acc = fmaf(pv, ld_shared_16_f32(sVs + swizzle(wk0 + k, j) + 2 * (2 * t + c2)), acc);
                    }
                    rO[mt][j][2 * h + c2] += acc;
                }
        }
    __syncwarp();
}

#if KV_FP8
// Shared address of row r's 2^e_r (fp8.cuh's Q·Kᵀ with bf16 queries): the 16 pad bytes that
// follow each K row of stage 0 hold four rows' factors. Neither the copies (a row's HEAD_DIM
// bytes) nor the staged P of pv_skip_zero_fp8 touch the pad, so the factors written before
// the key loop hold through it; the merge's reuse of the ring comes after.
__device__ __forceinline__ u32 q_factor_at(u32 sK, int r) {
    return sK + static_cast<u32>((r / 4) * KV_PITCH + HEAD_DIM + 4 * (r % 4));
}
static_assert(BLOCK_M <= 4 * BLOCK_N, "stage 0's K rows have pad for every row's factor");
static_assert(BLOCK_M % (32 / CHUNKS) == 0 && ROW_STEP % (32 / CHUNKS) == 0,
              "a warp's lanes run load_q_tile's passes together (its shuffles take the whole warp)");
#endif

// The tile's packed rows into sQ (rows past `valid` zero), negated for a negative scale; with
// an fp8 cache in the f16 form of fp8.cuh's Q·Kᵀ, each row's 2^e_r at q_factor_at(sK, row).
__device__ __forceinline__ void load_q_tile(const DecodeParams& d, const Seq& s, int b, int kv_head, int m0,
                                            int valid, u32 sQ, u32 sK, int tid) {
    const FwdParams& p = d.p;
    const bool packed = p.cu_seqlens_q != nullptr;
    const u32 flip = p.negate_q ? SIGN_BITS : 0u;
    const int c = tid % CHUNKS;
    // A pass of the threads may cover more rows than the tile has (d64: 32 rows of 256 threads).
    for (int r = tid / CHUNKS; r < BLOCK_M; r += ROW_STEP) {
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
        if (IS_BF16 && c == 0) st_shared_f32(q_factor_at(sK, r), exp2_int(e_r));
#endif
#pragma unroll
        for (int e = 0; e < 4; ++e) x[e] ^= flip;
        st_shared_v4(sQ + swizzle(r, c), x[0], x[1], x[2], x[3]);
    }
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1) fa4_decode_splitkv(const __grid_constant__ DecodeParams d) {
    extern __shared__ __align__(128) unsigned char smem[];
    const FwdParams& p = d.p;
    const int tid = threadIdx.x;
    const int warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;

    const int heads_kv = p.heads_q / p.group;
    const int b = blockIdx.x / heads_kv, kv_head = blockIdx.x % heads_kv;
    const int split = blockIdx.z;
    const Seq s = paged_sequence(d, b);
    const int rows = s.q_len * p.group;  // packed rows of this (sequence, KV head)
    const int m0 = blockIdx.y * BLOCK_M;
    if (m0 >= rows) return;
    const int valid_m = min(BLOCK_M, rows - m0);
    const int* table = d.page_table + static_cast<long long>(b) * d.max_pages;

    // This split's key blocks, cut to those the tile's rows may see. Packed rows m0 .. m0 +
    // valid_m − 1 are query rows m0 / group .. (m0 + valid_m − 1) / group.
    const int blocks = (s.k_len + BLOCK_N - 1) / BLOCK_N;
    const int per_split = (blocks + d.num_splits - 1) / d.num_splits;
    const KeyBlocks kb = key_blocks(p, s, m0 / p.group, (m0 + valid_m - 1) / p.group, true);
    const int n_begin = max(kb.n_begin, split * per_split);
    const int n_end = min(kb.n_end, min(blocks, (split + 1) * per_split));

    const u32 sQ = smem_u32(smem);            // (BLOCK_M, HEAD_DIM)
    const u32 sK = sQ + Q_TILE_BYTES;         // STAGES × (BLOCK_N, HEAD_DIM)
    const u32 sV = sK + STAGES * KV_TILE_BYTES;
#if KV_FP8
    // The cache's scales: k_scale multiplies every score (scores_scale_log2 and
    // scores_softcap_scale fold it in), v_scale the merged O.
    const float k_scale = d.k_scale[kv_head], v_scale = d.v_scale[kv_head];
#else
    constexpr float k_scale = 1.0f;  // a 16-bit cache has no scales
#endif

    load_q_tile(d, s, b, kv_head, m0, valid_m, sQ, sK, tid);
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
        if (n_begin + st < n_end)
            load_kv_block(d, table, s.k_len, kv_head, n_begin + st, sK + st * KV_TILE_BYTES, sV + st * KV_TILE_BYTES,
                          tid);
        cp_async_commit();
    }

    float rO[M_TILES][NTILES_D][4];  // O accumulator, (BLOCK_M, HEAD_DIM), this warp's keys
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

    // Lane roles in the ldmatrix patterns: A (Q) and transposed B (V) take the four 8×8
    // matrices row-block-major, B (K) chunk-major so that each n8 tile's registers are adjacent.
    const int a_row = (lane % 8) + ((lane / 8) % 2) * 8, a_chunk = lane / 16;
#if !KV_FP8
    const int k_row = (lane % 8) + (lane / 16) * 8, k_chunk = (lane / 8) % 2;
#endif
    const int wk0 = warp * KEYS_W;  // this warp's first key in a block

    for (int n = n_begin; n < n_end; ++n) {
        const int it = n - n_begin;
        cp_async_wait<STAGES - 2>();  // block `it` has landed (this thread's copies) …
        __syncthreads();              // … and everyone's; everyone is done with block it − 1.
        if (n + STAGES - 1 < n_end) {
            const int st = (it + STAGES - 1) % STAGES;
            load_kv_block(d, table, s.k_len, kv_head, n + STAGES - 1, sK + st * KV_TILE_BYTES,
                          sV + st * KV_TILE_BYTES, tid);
        }
        cp_async_commit();
        const int stage = it % STAGES;
        const u32 sKs = sK + stage * KV_TILE_BYTES, sVs = sV + stage * KV_TILE_BYTES;

        // S = Q·Kᵀ over this warp's keys, (BLOCK_M, KEYS_W).
        float rS[M_TILES][NTILES_W][4];
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int i = 0; i < NTILES_W; ++i) rS[mt][i][0] = rS[mt][i][1] = rS[mt][i][2] = rS[mt][i][3] = 0.0f;
#if KV_FP8
        // This warp's K and V rows of the stage (key `key` of its KEYS_W).
        const auto k_row = [&](int key) { return sKs + static_cast<u32>((wk0 + key) * KV_PITCH); };
        const auto v_row = [&](int key) { return sVs + static_cast<u32>((wk0 + key) * KV_PITCH); };
        qk_fp8(rS, [&](int mt, int kk) { return sQ + swizzle(16 * mt + a_row, 2 * kk + a_chunk); }, k_row, g, t);
        if constexpr (IS_BF16) {
            float factor[ROW_SLOTS];  // 2^e_r of this thread's rows (load_q_tile)
#pragma unroll
            for (int r = 0; r < ROW_SLOTS; ++r) factor[r] = ld_shared_f32(q_factor_at(sK, 16 * (r / 2) + g + 8 * (r % 2)));
            unscale_rows(rS, factor);
        }
#else
#pragma unroll
        for (int kk = 0; kk < KSTEPS_D; ++kk) {
            u32 qa[M_TILES][4];
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) ldmatrix_x4(qa[mt], sQ + swizzle(16 * mt + a_row, 2 * kk + a_chunk));
#pragma unroll
            for (int np = 0; np < NTILES_W / 2; ++np) {
                u32 kb4[4];
                ldmatrix_x4(kb4, sKs + swizzle(wk0 + 16 * np + k_row, 2 * kk + k_chunk));
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
            const int key0 = n * BLOCK_N + wk0;
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
        // Rescale O: a warp-uniform branch under LAZY_RESCALE, rare after the first blocks (each
        // warp keeps a whole (BLOCK_M, HEAD_DIM) O: 64 multiplies per lane per block at d128).
        bool moved = false;
#pragma unroll
        for (int r = 0; r < ROW_SLOTS; ++r) moved |= corr[r] != 1.0f;
        if (!LAZY_RESCALE || __any_sync(0xffffffffu, moved)) rescale_o(rO, corr);

        // O += P·V over this warp's keys.
#if KV_FP8
        if (masked && warp_v_nan_fp8<KEYS_W>(v_row, lane)) {
            // P over the warp's K rows: HEAD_DIM bytes of each (pitch KV_PITCH).
            const auto p_addr = [&](int e) { return k_row(e / HEAD_DIM) + static_cast<u32>(e % HEAD_DIM); };
            pv_skip_zero_fp8<M_TILES, NTILES_W, NTILES_D, KEYS_W>(rO, rS, p_addr, v_row, g, t);
        } else {
#pragma unroll
            for (int ks = 0; ks < KEYS_W / 16; ++ks) pv_fp8(rO, rS, ks, v_row, g, t);
        }
#else
        if (masked && warp_v_nonfinite(sVs, wk0, lane)) {
            pv_skip_zero(rO, rS, sKs, sVs, wk0, g, t);
        } else {
#pragma unroll
            for (int ks = 0; ks < KEYS_W / 16; ++ks) {
                u32 pa[M_TILES][4];
                pack_p(pa, rS, ks);
                pv_k16(rO, pa, [&](int dp) { return sVs + swizzle(wk0 + 16 * ks + a_row, 2 * dp + a_chunk); });
            }
        }
#endif
    }
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with the K/V ring and sQ: both are reused below

    // Merge of the warps. Warp w's row state is (shift_w, sum_w, O_w): its scores' exponents
    // were taken relative to shift_w = row_max·scale_log2 (0 for an infinite max), so its row
    // holds 2^shift_w · sum_w of mass. With M the largest shift of the warps that saw a key,
    // f_w = 2^(shift_w − M), L = Σ f_w·sum_w, O = Σ f_w·O_w / L, LSE = M·ln 2 + ln L.
    float* sO = reinterpret_cast<float*>(smem + Q_TILE_BYTES);  // (NUM_WARPS, BLOCK_M, HEAD_DIM)
    float* sShift = reinterpret_cast<float*>(smem);             // (NUM_WARPS, BLOCK_M)
    float* sSum = sShift + NUM_WARPS * BLOCK_M;                 // (NUM_WARPS, BLOCK_M)
    float* sFactor = sSum + NUM_WARPS * BLOCK_M;                // (NUM_WARPS, BLOCK_M): f_w / L (· v_scale)
    float* sLse = sFactor + NUM_WARPS * BLOCK_M;                // (BLOCK_M)
#pragma unroll
    for (int r = 0; r < ROW_SLOTS; ++r) {
        const int row = 16 * (r / 2) + g + 8 * (r % 2);
        const float sum = quad_sum(row_sum[r]);
        if (t == 0) {
            sShift[warp * BLOCK_M + row] =
                fabsf(row_max[r]) == -NEG_INF ? 0.0f : row_max[r] * scores_scale_log2(p, k_scale);
            sSum[warp * BLOCK_M + row] = sum;
        }
    }
#if KV_FP8
    // Per row and group a, this lane's values are dims 8VW·a + 2VW·t .. + 2VW − 1 (o_col):
    // value x of the run is column 2t + x / VW of n8 tile VW·a + x % VW.
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = 16 * mt + g + 8 * h;
            float* dst = sO + warp * BLOCK_M * HEAD_DIM;
#pragma unroll
            for (int a = 0; a < V_GROUPS; ++a)
#pragma unroll
                for (int k = 0; k < 2 * VW / 4; ++k) {
                    float v[4];
#pragma unroll
                    for (int e = 0; e < 4; ++e) v[e] = rO[mt][VW * a + (4 * k + e) % VW][2 * h + (4 * k + e) / VW];
                    const int q = (8 * VW * a + 2 * VW * t) / 4 + k;
                    *reinterpret_cast<float4*>(dst + so_chunk(row, q)) = make_float4(v[0], v[1], v[2], v[3]);
                }
        }
#else
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int i = 0; i < NTILES_D; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float* dst = sO + (warp * BLOCK_M + 16 * mt + g + 8 * h) * HEAD_DIM + 8 * i + 2 * t;
                dst[0] = rO[mt][i][2 * h];
                dst[1] = rO[mt][i][2 * h + 1];
            }
#endif
    __syncthreads();
    if (tid < BLOCK_M) {
        float m = NEG_INF;
#pragma unroll
        for (int w = 0; w < NUM_WARPS; ++w)
            if (sSum[w * BLOCK_M + tid] != 0.0f) m = fmaxf(m, sShift[w * BLOCK_M + tid]);
        float f[NUM_WARPS], l = 0.0f;
#pragma unroll
        for (int w = 0; w < NUM_WARPS; ++w) {
            const float sw = sSum[w * BLOCK_M + tid];
            f[w] = sw != 0.0f ? exp2_approx(sShift[w * BLOCK_M + tid] - m) : 0.0f;
            l += f[w] * sw;
        }
#if KV_FP8
        const float inv = row_inv_sum(l) * v_scale;
#else
        const float inv = row_inv_sum(l);
#endif
#pragma unroll
        for (int w = 0; w < NUM_WARPS; ++w) sFactor[w * BLOCK_M + tid] = f[w] * inv;
        float lse = l == 0.0f ? NEG_INF : m * LN2 + __logf(l);
        if (l != l) lse = l;  // NaN propagates
        sLse[tid] = lse;
    }
    __syncthreads();

    // Writes: 8 columns per thread and step; rows past the tile's valid rows are skipped.
    const bool direct = d.num_splits == 1;
    for (int idx = tid; idx < BLOCK_M * CHUNKS; idx += NUM_THREADS) {
        const int row = idx / CHUNKS, c = idx % CHUNKS;
        if (row >= valid_m) continue;
        const int pr = m0 + row;
        const OutRow o = out_row(p, s, b, pr / p.group, kv_head * p.group + pr % p.group);
        float acc[CHUNK_ELEMS];
#pragma unroll
        for (int e = 0; e < CHUNK_ELEMS; ++e) acc[e] = 0.0f;
#pragma unroll
        for (int w = 0; w < NUM_WARPS; ++w) {
            const float fw = sFactor[w * BLOCK_M + row];
#if KV_FP8
            const float* wo = sO + w * BLOCK_M * HEAD_DIM;
            const float4 x0 = *reinterpret_cast<const float4*>(wo + so_chunk(row, 2 * c));
            const float4 x1 = *reinterpret_cast<const float4*>(wo + so_chunk(row, 2 * c + 1));
            const float src[CHUNK_ELEMS] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#else
            const float* src = sO + (w * BLOCK_M + row) * HEAD_DIM + c * CHUNK_ELEMS;
#endif
#pragma unroll
            for (int e = 0; e < CHUNK_ELEMS; ++e) acc[e] += fw * src[e];
        }
        if (direct) {
            const u32 x[4] = {pack2(acc[0], acc[1]), pack2(acc[2], acc[3]), pack2(acc[4], acc[5]),
                              pack2(acc[6], acc[7])};
            st_global_v4(static_cast<u16*>(p.o) + o.o_off + c * CHUNK_ELEMS, x);
            if (c == 0 && p.lse != nullptr) p.lse[o.lse_off] = sLse[row];
        } else {
            float* dst = d.o_part + (split * d.part_rows + o.part_row) * HEAD_DIM + c * CHUNK_ELEMS;
            st_global_f32x4(dst, acc[0], acc[1], acc[2], acc[3]);
            st_global_f32x4(dst + 4, acc[4], acc[5], acc[6], acc[7]);
            if (c == 0) d.lse_part[split * d.part_rows + o.part_row] = sLse[row];
        }
    }
#if FUSE
    // The fused combine (merge.cuh): the tile's last split CTA merges its rows, a warp per row.
    if (!direct && fused_combine_arrive(d)) {
        for (int row = warp; row < valid_m; row += NUM_WARPS) {
            const int pr = m0 + row;
            merge_split_row(d, out_row(p, s, b, pr / p.group, kv_head * p.group + pr % p.group).part_row, lane);
        }
    }
#endif
}
