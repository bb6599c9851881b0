// Ampere-class FlashAttention forward: mma.sync m16n8k16 (fp16/bf16 in, f32 accumulate),
// cp.async multi-stage K/V ring, ldmatrix fragments, online softmax in registers.
// Valid on sm_80 and later (A100, RTX 30/40, L4, H100/H200, sm_120).
//
// Self-contained: no CUDA headers (NVRTC may have none). The planner (`config::sm80`) prepends
// a prelude defining HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, STAGES, MIN_BLOCKS_PER_SM,
// M_TILES, Q_IN_REGS, LAZY_RESCALE, IS_BF16, HAS_WINDOW, HAS_SOFTCAP, then the shared layer
// (`../common/{base,params,mask,softmax}.cuh`), its PTX wrappers (`ptx.cuh`), the tile steps it
// shares with the decode kernel (`tile_ops.cuh`), then this file.
//
// Work split: one CTA = BLOCK_M query rows of one (batch, head); warp w owns M_TILES MMA tiles
// of 16 rows, [16·M_TILES·w, 16·M_TILES·(w + 1)); in each, lane = 4·g + t owns rows g and g + 8
// and columns 2t, 2t + 1 of every 8-wide MMA tile (the m16n8k16 accumulator layout). With two
// tiles a warp reuses every K and V fragment it loads twice, halving ldmatrix traffic per MMA.

constexpr int NUM_THREADS = NUM_WARPS * 32;
constexpr int ROWS_PER_WARP = 16 * M_TILES;
constexpr int ROW_SLOTS = 2 * M_TILES;              // rows a thread owns: g + 8·slot
constexpr int CHUNK_ELEMS = 8;                    // one 16-byte cp.async / ldmatrix row
constexpr int CHUNKS = HEAD_DIM / CHUNK_ELEMS;    // 16-byte chunks per tile row
constexpr int KSTEPS_D = HEAD_DIM / 16;           // k16 steps over the head dim (Q·Kᵀ)
constexpr int NTILES_N = BLOCK_N / 8;             // n8 tiles of S
constexpr int KSTEPS_N = BLOCK_N / 16;            // k16 steps over keys (P·V)
constexpr int NTILES_D = HEAD_DIM / 8;            // n8 tiles of O
constexpr u32 SIGN_BITS = 0x80008000u;             // the sign bits of a packed 16-bit pair

static_assert(BLOCK_M == NUM_WARPS * ROWS_PER_WARP, "each warp owns M_TILES tiles of 16 rows");
static_assert(HEAD_DIM % 64 == 0, "the swizzle permutes 8 chunks: rows are whole 128-byte groups");
static_assert(BLOCK_N % 16 == 0, "P·V steps over keys in k16 slices");
static_assert(STAGES >= 2, "the K/V ring needs at least double buffering");
static_assert((BLOCK_N * CHUNKS) % NUM_THREADS == 0, "K/V tiles split evenly over threads");
static_assert((BLOCK_M * CHUNKS) % NUM_THREADS == 0, "Q tiles split evenly over threads");

constexpr int Q_TILE_ELEMS = BLOCK_M * HEAD_DIM;  // (BLOCK_M, HEAD_DIM)
constexpr int KV_TILE_ELEMS = BLOCK_N * HEAD_DIM; // (BLOCK_N, HEAD_DIM)
constexpr int SMEM_BYTES = 2 * (Q_TILE_ELEMS + 2 * STAGES * KV_TILE_ELEMS);
static_assert(SMEM_BYTES == FA4_SMEM_BYTES, "the planner's shared-memory count must match");

// Byte offset of 16-byte chunk `c` of row `r` in a swizzled (rows, HEAD_DIM) tile: the low
// three chunk bits are XORed with the row, so 8 consecutive rows of one logical chunk land in
// 8 different bank groups (conflict-free ldmatrix and cp.async).
__device__ __forceinline__ u32 swz(int r, int c) {
    return static_cast<u32>((r * CHUNKS + ((c & ~7) | ((c ^ r) & 7))) * 16);
}

// ldmatrix addresses without per-call swizzle arithmetic. Every fragment load reads rows
// R0 + rl (R0 a multiple of 8, rl the lane's row, so (R0 + rl) & 7 == rl & 7) at chunk
// 8a + 2j + cl (cl the lane's chunk bit). Its swizzled chunk is 8a + (2j ^ x) with
// x = (cl ^ rl) & 7, so four per-thread bases (j = 0..3) plus compile-time offsets address
// every fragment: 4 registers per operand instead of one per (row block, k step).
struct SwzBases {
    u32 b[4];
};

__device__ __forceinline__ SwzBases swz_bases(u32 tile, int rl, int cl) {
    SwzBases r;
    const int x = (cl ^ rl) & 7;
#pragma unroll
    for (int j = 0; j < 4; ++j) r.b[j] = tile + static_cast<u32>((rl * CHUNKS + ((2 * j) ^ x)) * 16);
    return r;
}

// Address of the fragment at row block R0 and logical chunk c0 = 8a + 2j (both compile-time).
__device__ __forceinline__ u32 swz_at(const SwzBases& s, int r0, int c0) {
    return s.b[(c0 / 2) % 4] + static_cast<u32>((r0 * CHUNKS + (c0 & ~7)) * 16);
}

// ---------------------------------------------------------------------------------------------
// Tile loads: (rows, HEAD_DIM) from global rows [0, valid_rows) and columns [0, head_dim);
// everything else is zero-filled so that padding never carries NaN into an MMA.

// When the threads split a row's chunks evenly, thread tid copies chunk tid % CHUNKS of rows
// tid / CHUNKS + ROW_STEP · i: one pointer walks down the rows, and the swizzled destinations
// differ by compile-time offsets when ROW_STEP is a multiple of the 8-row swizzle period.
// Otherwise (d192: 24 chunks) copy idx = tid + NUM_THREADS · i goes to row idx / CHUNKS.
constexpr bool ROW_WALK = NUM_THREADS % CHUNKS == 0;
constexpr int ROW_STEP = ROW_WALK ? NUM_THREADS / CHUNKS : 1;

template <int ROWS>
__device__ __forceinline__ void load_tile(u32 s_tile, const u16* g, long long row_stride, int valid_rows,
                                          int head_dim, int tid) {
    static_assert((ROWS * CHUNKS) % NUM_THREADS == 0, "tiles split evenly over the threads' copies");
    if constexpr (ROW_WALK) {
        const int r0 = tid / CHUNKS, c = tid % CHUNKS;
        const bool col_ok = c * CHUNK_ELEMS < head_dim;
        const long long step = opaque(row_stride * ROW_STEP);
        const u16* src = g + r0 * row_stride + c * CHUNK_ELEMS;
        const u32 dst0 = s_tile + swz(r0, c);
#pragma unroll
        for (int i = 0; i < ROWS / ROW_STEP; ++i) {
            const int r = r0 + i * ROW_STEP;
            const bool ok = col_ok && r < valid_rows;
            const u32 dst = ROW_STEP % 8 == 0 ? dst0 + static_cast<u32>(i * ROW_STEP * CHUNKS * 16) : s_tile + swz(r, c);
            cp_async_16(dst, ok ? src : g, ok ? 16 : 0);
            src += step;
        }
    } else {
        const long long stride = opaque(row_stride);
#pragma unroll
        for (int i = 0; i < ROWS * CHUNKS / NUM_THREADS; ++i) {
            const int idx = tid + i * NUM_THREADS;
            const int r = idx / CHUNKS, c = idx % CHUNKS;
            const bool ok = r < valid_rows && c * CHUNK_ELEMS < head_dim;
            cp_async_16(s_tile + swz(r, c), ok ? g + r * stride + c * CHUNK_ELEMS : g, ok ? 16 : 0);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The kernel

extern "C" __global__ void __launch_bounds__(NUM_THREADS, MIN_BLOCKS_PER_SM) fa4_fwd_sm80(const __grid_constant__ FwdParams p) {
    extern __shared__ __align__(128) unsigned char smem[];
    const int tid = threadIdx.x;
    const int warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;

    // Launch order (config::tile_order): grid (group, query blocks, groups); the hardware starts
    // CTAs x fastest, so in each group of gridDim.x (sequence, head) pairs the query blocks go
    // last first across the group: under a causal mask every group starts its longest tiles
    // first, and the tiles that start last are short. (No division on the query block: it stays
    // in uniform registers, as does the key loop derived from it.)
    const int m_block = gridDim.y - 1 - blockIdx.y;
    const int pair = blockIdx.z * gridDim.x + blockIdx.x;
    if (pair >= p.heads_q * p.batch) return;  // the last group's spare places
    const int head = pair % p.heads_q, batch = pair / p.heads_q;
    const Seq s = sequence(p, batch, p.cu_seqlens_q != nullptr);
    const int m0 = m_block * BLOCK_M;
    if (m0 >= s.q_len) return;
    const int kv_head = head / p.group;
    const int valid_m = min(BLOCK_M, s.q_len - m0);

    const u16* gQ = static_cast<const u16*>(p.q) + batch * p.q_batch_stride + (s.q_start + m0) * p.q_row_stride +
                    head * p.q_head_stride;
    const u16* gK = static_cast<const u16*>(p.k) + batch * p.k_batch_stride + s.k_start * p.k_row_stride +
                    kv_head * p.k_head_stride;
    const u16* gV = static_cast<const u16*>(p.v) + batch * p.v_batch_stride + s.k_start * p.v_row_stride +
                    kv_head * p.v_head_stride;

    const u32 sQ = smem_u32(smem);                           // (BLOCK_M, HEAD_DIM), reused for O
    const u32 sK = sQ + Q_TILE_ELEMS * 2;                    // STAGES × (BLOCK_N, HEAD_DIM)
    const u32 sV = sK + STAGES * KV_TILE_ELEMS * 2;          // STAGES × (BLOCK_N, HEAD_DIM)

    // Key blocks this CTA visits, and the rows' own key bounds (constant over the loop).
    const KeyBlocks kb = key_blocks(p, s, m0, m0 + valid_m - 1, true);
    const int n_begin = kb.n_begin, n_end = kb.n_end;

    // Prologue: Q and the first STAGES-1 K/V tiles, one cp.async group each.
    load_tile<BLOCK_M>(sQ, gQ, p.q_row_stride, valid_m, p.head_dim, tid);
    auto issue_kv = [&](int n, int stage) {
        int rows = min(BLOCK_N, s.k_len - n * BLOCK_N);
        load_tile<BLOCK_N>(sK + stage * KV_TILE_ELEMS * 2, gK + n * BLOCK_N * p.k_row_stride, p.k_row_stride, rows,
                           p.head_dim, tid);
        load_tile<BLOCK_N>(sV + stage * KV_TILE_ELEMS * 2, gV + n * BLOCK_N * p.v_row_stride, p.v_row_stride, rows,
                           p.head_dim, tid);
    };
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
        if (n_begin + st < n_end) issue_kv(n_begin + st, st);
        cp_async_commit();
    }

    u32 rQ[Q_IN_REGS ? M_TILES : 1][Q_IN_REGS ? KSTEPS_D : 1][4];  // Q fragments, (ROWS_PER_WARP, HEAD_DIM)
    float rO[M_TILES][NTILES_D][4];                          // O accumulator, (ROWS_PER_WARP, HEAD_DIM)
    float row_max[ROW_SLOTS];                                // raw scores (before scale_log2)
    float row_sum[ROW_SLOTS];                                // this thread's columns only
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int i = 0; i < NTILES_D; ++i) rO[mt][i][0] = rO[mt][i][1] = rO[mt][i][2] = rO[mt][i][3] = 0.0f;
#pragma unroll
    for (int r = 0; r < ROW_SLOTS; ++r) {
        row_max[r] = NEG_INF;
        row_sum[r] = 0.0f;
    }
    const int warp_row0 = warp * ROWS_PER_WARP;

    // Lane roles in the ldmatrix patterns (see swz_bases): the A operand (Q) and the
    // transposed B operand (V) take matrices row-block-major and share one set of bases (Q's
    // tile address is added per load: 4 registers fewer); the B operand (K) takes them
    // chunk-major, so that each n8 tile's two registers come out adjacent, as HMMA wants them.
    const SwzBases bQV = swz_bases(0, (lane % 8) + ((lane / 8) % 2) * 8, lane / 16);
    const SwzBases bK = swz_bases(0, (lane % 8) + (lane / 16) * 8, (lane / 8) % 2);

    auto q_frag = [&](int mt, int kk, u32 (&a)[4]) { ldmatrix_x4(a, sQ + swz_at(bQV, warp_row0 + 16 * mt, kk * 2)); };

    for (int n = n_begin; n < n_end; ++n) {
        const int it = n - n_begin;
        cp_async_wait<STAGES - 2>();  // Q and tile `it` have landed (this thread's copies) …
        __syncthreads();              // … and everyone's; everyone is done with tile it - 1.
        if (it == 0 && p.negate_q) {
            // A negative scale: negate this warp's own Q rows once, in place (only this warp
            // reads them), instead of flipping every fragment in the key loop.
#pragma unroll
            for (int i = 0; i < ROWS_PER_WARP * CHUNKS / 32; ++i) {
                const u32 addr = sQ + static_cast<u32>((warp_row0 * CHUNKS + lane + 32 * i) * 16);
                u32 x[4];
                ld_shared_v4(x, addr);
                st_shared_v4(addr, x[0] ^ SIGN_BITS, x[1] ^ SIGN_BITS, x[2] ^ SIGN_BITS, x[3] ^ SIGN_BITS);
            }
            __syncwarp();
        }
        if (Q_IN_REGS && it == 0) {
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
                for (int kk = 0; kk < KSTEPS_D; ++kk) q_frag(mt, kk, rQ[Q_IN_REGS ? mt : 0][Q_IN_REGS ? kk : 0]);
        }
        if (n + STAGES - 1 < n_end) issue_kv(n + STAGES - 1, (it + STAGES - 1) % STAGES);
        cp_async_commit();
        const int stage = it % STAGES;
        const u32 sKs = sK + stage * KV_TILE_ELEMS * 2, sVs = sV + stage * KV_TILE_ELEMS * 2;

        // S = Q·Kᵀ, (ROWS_PER_WARP, BLOCK_N) per warp; each K fragment feeds M_TILES MMAs.
        float rS[M_TILES][NTILES_N][4];
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int i = 0; i < NTILES_N; ++i) rS[mt][i][0] = rS[mt][i][1] = rS[mt][i][2] = rS[mt][i][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < KSTEPS_D; ++kk) {
            u32 qa[M_TILES][4];
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) {
                if constexpr (Q_IN_REGS) {
#pragma unroll
                    for (int j = 0; j < 4; ++j) qa[mt][j] = rQ[Q_IN_REGS ? mt : 0][Q_IN_REGS ? kk : 0][j];
                } else {
                    q_frag(mt, kk, qa[mt]);
                }
            }
#pragma unroll
            for (int np = 0; np < NTILES_N / 2; ++np) {
                u32 b[4];
                ldmatrix_x4(b, sKs + swz_at(bK, np * 16, kk * 2));
#pragma unroll
                for (int mt = 0; mt < M_TILES; ++mt) {
                    mma_16816(rS[mt][2 * np], qa[mt], b[0], b[1]);
                    mma_16816(rS[mt][2 * np + 1], qa[mt], b[2], b[3]);
                }
            }
        }

        if constexpr (HAS_SOFTCAP) {
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
                for (int i = 0; i < NTILES_N; ++i)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        rS[mt][i][e] = p.softcap * tanh_accurate(rS[mt][i][e] * p.softcap_scale);
        }

        // Mask: only blocks that cross a row's key bounds (or the end of the keys).
        const int key0 = n * BLOCK_N;
        if (kb.masked(n)) {
            // The rows' bounds are recomputed here (few blocks are masked) rather than held in
            // registers across the loop.
            int row_lo[ROW_SLOTS], row_hi[ROW_SLOTS];
#pragma unroll
            for (int r = 0; r < ROW_SLOTS; ++r) {
                const int i = m0 + warp_row0 + g + 8 * r;
                row_lo[r] = key_lo(p, s, i);
                row_hi[r] = key_hi(p, s, i);
            }
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
                for (int i = 0; i < NTILES_N; ++i)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        int j = key0 + i * 8 + 2 * t + (e & 1);
                        int r = 2 * mt + e / 2;
                        if (j < row_lo[r] || j >= row_hi[r]) rS[mt][i][e] = NEG_INF;
                    }
        }

        // Online softmax: row slot r is row g + 8r; the 4 lanes of a quad share a row.
        // Every row's max first, then the exponentials: the rows' shuffles overlap.
        float corr[ROW_SLOTS], row_mx[ROW_SLOTS];
#pragma unroll
        for (int r = 0; r < ROW_SLOTS; ++r) {
            const int mt = r / 2, h = r % 2;
            float mx = row_max[r];
#pragma unroll
            for (int i = 0; i < NTILES_N; ++i) mx = fmaxf(mx, fmaxf(rS[mt][i][2 * h], rS[mt][i][2 * h + 1]));
            row_mx[r] = quad_max(mx);
        }
#pragma unroll
        for (int r = 0; r < ROW_SLOTS; ++r) {
            const int mt = r / 2, h = r % 2;
            const float shift = update_row_max(row_max[r], row_mx[r], p.scale_log2, corr[r]);
            float sum = 0.0f;
#pragma unroll
            for (int i = 0; i < NTILES_N; ++i) {
#pragma unroll
                for (int e = 2 * h; e < 2 * h + 2; ++e) {
                    rS[mt][i][e] = exp2_approx(score_exponent(rS[mt][i][e], p.scale_log2, shift));
                    sum += rS[mt][i][e];
                }
            }
            row_sum[r] = row_sum[r] * corr[r] + sum;
        }
        // Rescale O (a warp-uniform branch under LAZY_RESCALE: after the first block it is rare).
        bool moved = false;
#pragma unroll
        for (int r = 0; r < ROW_SLOTS; ++r) moved |= corr[r] != 1.0f;
        if (!LAZY_RESCALE || __any_sync(0xffffffffu, moved)) rescale_o(rO, corr);

        // O += P·V: the S accumulator layout is the A-fragment layout, P never leaves registers.
#pragma unroll
        for (int ks = 0; ks < KSTEPS_N; ++ks) {
            u32 pa[M_TILES][4];
            pack_p(pa, rS, ks);
            pv_k16(rO, pa, [&](int dp) { return sVs + swz_at(bQV, ks * 16, dp * 2); });
        }
    }
    cp_async_wait<0>();

    // Epilogue: O = acc / sum in 16-bit through this warp's own rows of sQ, then 16-byte stores.
    // A row the fast path may have got wrong is stored as NaN, and a NaN stored in a valid row
    // raises the flag of the fixup kernel (common/exact.cuh).
    float inv[ROW_SLOTS];
#pragma unroll
    for (int r = 0; r < ROW_SLOTS; ++r) {
        const float sum = quad_sum(row_sum[r]);
        inv[r] = row_out_scale(row_max[r], sum, p.scale_log2);
        const int i = m0 + warp_row0 + g + 8 * r;
        if (p.lse != nullptr && t == 0 && i < s.q_len)
            p.lse[batch * p.lse_batch_stride + head * p.lse_head_stride + s.q_start + i] =
                row_lse(row_max[r], sum, p.lse_scale);
    }
    u32 folded = 0;  // the NaN max of this thread's stored pairs of valid rows
    __syncthreads();  // every warp is done reading K/V and its Q rows before sQ is reused
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int i = 0; i < NTILES_D; ++i) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = 2 * mt + h;
                u32 v = pack2(rO[mt][i][2 * h] * inv[r], rO[mt][i][2 * h + 1] * inv[r]);
                if (warp_row0 + g + 8 * r < valid_m) folded = nan_max2(folded, v);
                u32 addr = sQ + swz(warp_row0 + g + 8 * r, i) + t * 4;
                st_shared_b32(addr, v);
            }
        }
    raise_exact_flag(folded);
    __syncwarp();
    u16* gO = static_cast<u16*>(p.o) + batch * p.o_batch_stride + (s.q_start + m0) * p.o_row_stride +
              head * p.o_head_stride;
#pragma unroll
    for (int i = 0; i < ROWS_PER_WARP * CHUNKS / 32; ++i) {
        int idx = lane + i * 32;
        int r = warp_row0 + idx / CHUNKS, c = idx % CHUNKS;
        if (r < valid_m && c * CHUNK_ELEMS < p.head_dim) {
            u32 x[4];
            ld_shared_v4(x, sQ + swz(r, c));
            st_global_v4(gO + r * p.o_row_stride + c * CHUNK_ELEMS, x);
        }
    }
}
