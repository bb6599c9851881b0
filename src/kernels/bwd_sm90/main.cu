// Hopper (sm_90a) FlashAttention backward, key side: dK, dV of a key block and the block's dQ
// contributions, FlashAttention-3's design: TMA loads issued by a producer warpgroup into an
// mbarrier ring, wgmma with the keys as M, setmaxnreg moving registers to the consumers.
// The row kernels `pre` (D = rowsum(dO∘O), zeroed dQ accumulator) and `convert` (dQ = scale ·
// accumulator) are the Ampere-class backward's (`../bwd/aux.cu`).
//
// Source order: the planner's prelude (`config::bwd_sm90`: tiles, register split, role table,
// named barriers, feature switches), the shared layer `../common/*`, `../sm90/params.cuh`,
// `../sm90/ptx.cuh`, `../sm90/pipeline.cuh`, `../bwd/params.cuh`, this family's `params.cuh`,
// `ptx.cuh`, the generated wgmma wrappers (`wgmma_st`, `wgmma_dkv`, `wgmma_dq`), this file.
//
// Work: a tile is (key block of BLOCK_N keys, KV head, batch entry). The CTAs are persistent (at
// most one per SM): CTA b starts with tile b, and the producer takes each further tile from a
// counter in global memory (`pre` zeroes it) with one atomicAdd, so the tiles go out in the order
// a grid of one CTA per tile would start them (key blocks fastest: the CTAs at work at once share
// their heads' Q and dO in L2) and a CTA that finishes early takes the next. The producer hands a
// tile to the consumers through one of two Work slots in shared memory, and loads its K and V as
// soon as the consumers are done with the last tile's (`kv_free`), while they write that tile's
// dK and dV; the Q/dO ring runs on across tiles. Per tile, K and V are loaded once; the CTA then
// walks the query heads of its KV head (GQA: dK, dV sum in registers) and, per head, the query
// blocks the mask lets see its keys (`query_blocks`, as the Ampere-class kernel). Consumer
// warpgroup c owns keys [64c, 64c + 64) of the block (the M of wgmma). Per query block of
// BLOCK_M rows (i: query, j: key):
//   Sᵀ = K_c·Qᵀ, dPᵀ = V_c·dOᵀ                 wgmma, both operands in shared memory, N = BLOCK_M
//   Pᵀ = exp2(capped(Sᵀ)·LOG2E − LSE_i·LOG2E)  from the forward's LSE; masked pairs set to 0
//   dSᵀ = Pᵀ ∘ (dPᵀ − D_i) ∘ capped'           the softcap derivative; the scale comes last
//   dV += Pᵀ·dO, dK += dSᵀ·Q                   wgmma, A = Pᵀ / dSᵀ from registers, B MN-major
//   dQ_i += dS·K                               dSᵀ through shared memory (A MN-major); the f32
//                                              tile goes to shared memory and each warp's
//                                              bulk reduce-add (TMA) adds its rows to the
//                                              accumulator
// For dQ the consumers split the (BLOCK_M, HEAD_DIM) tile into DQ_PARTS ≤ CONSUMER_WGS parts,
// 64-row groups × column groups of whole 64-column slabs (an MN-major operand cannot start
// inside a swizzle atom); at step it, consumer c computes part (c + it) % CONSUMER_WGS if there
// is one (d64: two 64-row parts of 128 queries; d128: two column slabs; with one part the
// warpgroups would take turns). Each part needs every key
// of the block, so the dSᵀ tile of both warpgroups is exchanged through shared memory (two
// buffers, one barrier).
//
// The dQ accumulator (f32, zeroed by `pre`, read by `convert`) is private to the three kernels,
// so its layout is the one the consumers write fastest: per (batch, head, 64-row group of the
// padded rows `stats_rows`), HEAD_DIM / 64 tiles of 64 × 64, each tile in the accumulator's
// register order (`dq_pos`, each warp's 16 rows one contiguous 4 KB quarter): a warpgroup stores
// its 32 dQ registers with eight 16-byte stores per thread, conflict-free, into its own buffer,
// and lane 0 of each warp adds the warp's quarter with one `cp.reduce.async.bulk` (before: 16
// `red.global.add.v2` per thread and step). The buffer is reused a step later, after each lane
// 0's read wait (`bulk_wait_read`) and the DS_READY barrier.
//
// Warp roles (the prelude's `Role` and `role_of(warp)`):
//   warpgroup 0      ROLE_PRODUCER  PRODUCER_REGS  warp 0: lane 0 issues the TMA loads (K, V
//                                                  once; Q, dO and the row statistics per
//                                                  step), the warp takes the STATS_FREE syncs
//   warpgroup 1 + c  ROLE_CONSUMER  CONSUMER_REGS  keys [64c, 64c + 64): everything above
// Barriers (mbarriers; phase bits flip on every completion):
//   load_kv         producer → consumers   1 (expect_tx) + K and V bytes; a phase per tile
//                                          that has steps
//   kv_free         consumers → producer   one per consumer warp, after the tile's last
//                                          product reading K or V
//   work_full[w]    producer → consumers   1, after writing Work slot w (a tile, or the end)
//   work_empty[w]   consumers → producer   one per consumer warp, after their last read of it
//   load_q[s]       producer → consumers   1 (thread 0's expect_tx) + Q, dO and statistics bytes
//   release_q[s]    consumers → producer   one per consumer warp, after the step's last wgmma
// Named barriers (the prelude's NamedBarrier; all consumer threads, and producer warp 0 for
// the STATS_FREE barriers):
//   BAR_DS_READY    every consumer's dSᵀ is in shared memory (buffer step % 2); also orders
//                   the reuse of a buffer two steps later after everyone's dQ of it
//   BAR_CLEANED     K (once) or a masked step's Q is cleaned of non-finite values
//   BAR_STATS_FREE0/1/2  the consumers have read stage 0's / 1's / 2's row statistics (bar.arrive);
//                   producer warp 0 syncs before refilling the stage
//
//   BAR_DQ_FULL0/1, BAR_DQ_EMPTY0/1  (DETERMINISTIC to head dim 128) consumer warpgroup c's dQ
//                   tile is in its buffer / the dQ writer has read it out (consumer c and
//                   producer warp 1, 160 threads; the writer arrives on EMPTY once at the start)
//   BAR_DQ_TURN0/1  (DETERMINISTIC, SHARED_KEYS) consumer warpgroup c alone, around its turn
//
// Deterministic mode (DETERMINISTIC): dQ of a query block is added key block by key block from
// the last down, each waiting for its turn on a semaphore per query block (`dq_semaphores`,
// `dq_turn`). To head dim 128 the consumers do not wait: warp 1 of the producer warpgroup (the
// dQ writer, `dq_writer`) takes each step's two tiles from the consumers' buffers, waits for
// the turn, bulk reduce-adds them and increments the semaphore once the adds are complete. In
// the shared-keys form each consumer waits itself before its reductions from registers.
//
// Row statistics (LSE·LOG2E and D of a step's BLOCK_M rows, f32, beside the stage's Q and dO):
// the `pre` kernel writes them padded (`BwdParams::stats_rows`: [batch][heads_q][rows rounded up
// to whole query blocks], +inf and 0 past the sequence), so a step's rows are two 1-D bulk copies
// issued with the stage's Q and dO, counted in its transaction bytes. (Written by a producer warp
// with ordinary stores, ordered through the ring's mbarriers, compute-sanitizer's racecheck
// reported every reuse of a stage as a hazard; loaded by the consumers themselves, the extra
// instructions cost d64 15–21%; bulk-copied but ordered only by the mbarriers, racecheck
// reported 2 hazards per problem: hence the STATS_FREE barriers.)
//
// Non-finite inputs: a masked pair (i, j) gets P = dS = 0 (set, not multiplied), but a wgmma
// product still multiplies dS_ij = 0 by K_j (dQ) or Q_i (dK), and 0·NaN = NaN would reach a
// row that never sees key j (or a key row i never sees). So K, and Q in masked steps, are
// cleaned in shared memory (non-finite halves set to 0) before any product reads them. That
// changes no result: a row with a non-finite Q_i, or that sees a non-finite K_j, has a
// non-finite LSE, hence a NaN P and dS on every key it sees, whatever Sᵀ is.
//
// Varlen batches (VARLEN): Q, K, V and dO are packed [total, heads, head_dim], one batch entry
// of the maps, and a sequence's blocks start at its first row. A block that crosses the end of
// its sequence holds the next sequence's rows where a fixed-length batch's TMA fills zeros. A key
// block's foreign keys are masked (P = dS = 0, set) and K is cleaned, as above; a query block's
// foreign rows are zeroed in its stage (Q and dO) before any product reads them, so that they
// are what a fixed-length batch loads (zeros, their statistics the padded rows' P = 0). The row
// statistics and the dQ accumulator pad each sequence to whole query blocks (`stats_base`).
//
// Shared keys (SHARED_KEYS, tiles 256 wide: 136 ≤ head dim ≤ 256): a consumer's own 64 keys
// would need dK and dV of 64 × HEAD_DIM each, 256 f32 registers per thread at d256. So the
// block is 64 keys, which both consumers take as the M of wgmma; consumer c computes Sᵀ and dPᵀ
// for the block's queries [c·QUERIES_PER_WG, …) (N = BLOCK_M / 2), stores its Pᵀ and dSᵀ to
// shared memory (buffers g % 2, the dSᵀ layout), and after DS_READY computes dV += Pᵀ·dO and
// dK += dSᵀ·Q for its columns [c·DKV_N, …) over all the block's queries (A from shared memory,
// K-major) and dQ for the same columns, one 64 × 64 part at a time, added from registers with
// 16-byte reductions (`red.global.add.v4.f32`, in `dq_pos` order: K, V and two Q/dO stages of
// 32 KiB each and the Pᵀ/dSᵀ buffers leave no room for the dQ tiles). FlashAttention-4's sm90
// backward uses the same split at d256.
//
// Shared-memory tiles are TMA boxes with the 128-byte swizzle, as the forward's: a (rows,
// HEAD_DIM) tile is HEAD_DIM / 64 slabs of (rows, 64), each row 128 bytes, each slab
// 1024-aligned. dSᵀ (BLOCK_N, BLOCK_M) is stored the same way, written by the consumers.
//
// Head dims below the tile width (DIM < HEAD_DIM, SLAB_MAPS: 8 … 56 in tiles of 64, 72 … 120 in
// tiles of 128, 136 … 248 in tiles of 256): Q, K, V and dO come slab by slab through 4-D maps
// over their real columns (DIM for Q and K, DIM_V ≤ DIM for V and dO), and the hardware fills
// the columns past them with zeros. Sᵀ sums over QK_DIM (DIM rounded up to the k16 step), dPᵀ
// over PV_DIM (DIM_V rounded up) only; dV, dK and dQ are computed over the whole tile (their
// padded columns are zeros) and stored at their real columns only (dK: DIM, dV: DIM_V;
// `convert` skips the dQ accumulator's columns past DIM).

constexpr int WG_THREADS = 128;
constexpr int CONSUMER_THREADS = WG_THREADS * CONSUMER_WGS;
constexpr int NUM_THREADS = WG_THREADS * (1 + CONSUMER_WGS);
constexpr int KEYS_PER_WG = 64;                    // the M of wgmma
// SHARED_KEYS (head dims past 128): the consumers share the block's 64 keys; consumer c takes
// queries [c·QUERIES_PER_WG, …) of Sᵀ and dPᵀ and columns [c·DKV_N, …) of dK, dV and dQ.
constexpr int QUERIES_PER_WG = SHARED_KEYS ? BLOCK_M / CONSUMER_WGS : BLOCK_M;  // the N of Sᵀ
constexpr int DKV_N = SHARED_KEYS ? HEAD_DIM / CONSUMER_WGS : HEAD_DIM;          // the N of dK, dV
constexpr bool DQ_SMEM = !SHARED_KEYS;             // dQ by bulk reduce-add from shared memory
constexpr int SLAB_ELEMS = 64;                     // one 128-byte swizzle row of 16-bit values
constexpr int SLAB_ROW_BYTES = 128;
constexpr int KV_BYTES = BLOCK_N * HEAD_DIM * 2;   // (BLOCK_N, HEAD_DIM)
constexpr int QO_BYTES = BLOCK_M * HEAD_DIM * 2;   // (BLOCK_M, HEAD_DIM)
constexpr int DS_BYTES = BLOCK_N * BLOCK_M * 2;    // (BLOCK_N, BLOCK_M): dSᵀ (and Pᵀ, SHARED_KEYS)
constexpr int DS_BUFFERS = 2;
constexpr int P_BUFFERS = SHARED_KEYS ? DS_BUFFERS : 0;
constexpr int ROW_STATS = 2 * BLOCK_M;             // f32 LSE·LOG2E and D of a step's rows
constexpr int DQ_TILE = 64;                        // the dQ tile: 64 rows × 64 columns, f32
constexpr int DQ_BYTES = DQ_TILE * DQ_TILE * 4;    // one consumer warpgroup's dQ buffer
constexpr int DQ_BUFFERS = DQ_SMEM ? CONSUMER_WGS : 0;
constexpr int DQ_WARP_ELEMS = 16 * DQ_TILE;        // a warp's 16 rows of it: one reduce-add
constexpr int NUM_BARRIERS = 2 + 2 * STAGES + 4;  // load_kv, kv_free, the ring, work_full/empty[2]
constexpr int WORK_SLOT = 128;                     // a tile's `Work`
constexpr int WORK_BYTES = 2 * WORK_SLOT;          // two slots, after the barriers
// The deterministic mode to head dim 128: producer warp 1 adds the consumers' dQ tiles in turn.
constexpr bool DQ_WRITER = DETERMINISTIC && DQ_SMEM;
constexpr int DQ_INFO_BYTES = DQ_WRITER ? 64 : 0;  // two notes to the dQ writer, after the work slots
constexpr int TILE_ALIGN = 1024;
constexpr int SMEM_BYTES = 2 * KV_BYTES + STAGES * 2 * QO_BYTES + (DS_BUFFERS + P_BUFFERS) * DS_BYTES +
                           DQ_BUFFERS * DQ_BYTES + STAGES * ROW_STATS * 4 + 8 * NUM_BARRIERS + WORK_BYTES +
                           DQ_INFO_BYTES + TILE_ALIGN;
constexpr int ST_REGS = QUERIES_PER_WG / 2;        // f32 Sᵀ (and dPᵀ) per thread: (64, QUERIES_PER_WG) per warpgroup
constexpr int PK_REGS = QUERIES_PER_WG / 4;        // packed 16-bit pairs of Pᵀ (and dSᵀ)
constexpr int DKV_REGS = DKV_N / 2;                // f32 dK (and dV) per thread: (64, DKV_N)
constexpr int SLABS = HEAD_DIM / SLAB_ELEMS;
constexpr int DQ_ROW_GROUPS = BLOCK_M / 64;        // dQ tile split: 64-row groups …
// SHARED_KEYS: every slab a part, consumer c taking its DKV_N columns' parts one after another.
constexpr int DQ_COL_GROUPS =
    SHARED_KEYS ? SLABS : (SLABS < CONSUMER_WGS / DQ_ROW_GROUPS ? SLABS : CONSUMER_WGS / DQ_ROW_GROUPS);
constexpr int DQ_PARTS = DQ_ROW_GROUPS * DQ_COL_GROUPS;  // … × column groups of whole slabs
constexpr int DQ_PARTS_PER_WG = SHARED_KEYS ? DQ_PARTS / CONSUMER_WGS : 1;
constexpr int DQ_N = HEAD_DIM / DQ_COL_GROUPS;     // the dQ wgmma's N
constexpr int DQ_REGS = DQ_N / 2;                  // f32 dQ per thread: (64, DQ_N)
constexpr int SBO_BYTES = 8 * SLAB_ROW_BYTES;      // 8-row core-matrix groups of a swizzle atom
constexpr int KSTEP_K_MAJOR_BYTES = 32;            // k16 step inside a 128-byte swizzle row
constexpr int KSTEP_ROWS_BYTES = 16 * SLAB_ROW_BYTES;  // k16 step over 16 rows (MN-major operands)

static_assert(BLOCK_N == (SHARED_KEYS ? KEYS_PER_WG : KEYS_PER_WG * CONSUMER_WGS),
              "a consumer warpgroup owns 64 keys, or all consumers share them");
static_assert(FIRST_CONSUMER_WARP == WG_THREADS / 32, "warpgroup 0 produces, the others consume");
static_assert(HEAD_DIM % SLAB_ELEMS == 0, "tile widths are whole 64-element slabs");
static_assert(DIM % 8 == 0 && DIM <= HEAD_DIM && DIM_V % 8 == 0 && DIM_V <= DIM &&
                  SLAB_MAPS == (DIM != HEAD_DIM || DIM_V != HEAD_DIM),
              "the head dims are multiples of 8 within the tile (V's at most Q's), loaded per slab where narrower");
static_assert(QK_DIM % 16 == 0 && QK_DIM >= DIM && QK_DIM <= HEAD_DIM && PV_DIM % 16 == 0 && PV_DIM >= DIM_V &&
                  PV_DIM <= QK_DIM,
              "Sᵀ and dPᵀ sum whole k16 steps");
static_assert(BLOCK_M % 64 == 0 && BLOCK_M <= 256, "BLOCK_M is a wgmma N and a multiple of the dQ M");
static_assert(CONSUMER_WGS % DQ_ROW_GROUPS == 0 && SLABS % DQ_COL_GROUPS == 0 &&
                  (SHARED_KEYS || DQ_PARTS <= CONSUMER_WGS),
              "the dQ tile splits into at most CONSUMER_WGS parts: 64-row groups × whole column slabs");
static_assert(KV_BYTES % TILE_ALIGN == 0 && QO_BYTES % TILE_ALIGN == 0 && DS_BYTES % TILE_ALIGN == 0,
              "tiles keep 1024-byte alignment");
static_assert(SMEM_BYTES == FA4_SMEM_BYTES, "the planner's shared-memory count must match");
static_assert(STAGES >= 2, "the Q/dO ring needs two stages to overlap loads with compute");
static_assert((BLOCK_M * 4) % 16 == 0, "a step's statistics are whole 16-byte bulk copies");
static_assert(DQ_N == DQ_TILE && DQ_REGS == 32, "a dQ part is one 64 × 64 tile of the accumulator");
static_assert(!DQ_WRITER || (DQ_PARTS == CONSUMER_WGS && CONSUMER_WGS == 2),
              "the dQ writer takes one part from each of the two consumers every step");
static_assert(!SHARED_KEYS || (QUERIES_PER_WG % 16 == 0 && DKV_N % SLAB_ELEMS == 0 &&
                               DQ_PARTS_PER_WG * DQ_N == DKV_N && DQ_ROW_GROUPS == 1),
              "shared keys: each consumer a whole k16 of queries and whole column slabs, its dQ parts its columns");

// Accumulator layout of wgmma m64nN (f32), as in the forward: thread t of the warpgroup (warp
// w, lane l) holds register i at row 16w + l/4 + 8·slot(i) and column 8·(i/4) + 2·(l%4) + i%2.
__device__ __forceinline__ int acc_slot(int i) { return (i >> 1) & 1; }
__device__ __forceinline__ int acc_col(int i, int lane) { return 8 * (i >> 2) + 2 * (lane % 4) + (i & 1); }

using QState = PipeState<STAGES>;

struct Smem {
    u32 k, v;        // (BLOCK_N, HEAD_DIM) each
    u32 q, dout;     // STAGES × (BLOCK_M, HEAD_DIM) each
    u32 ds;          // DS_BUFFERS × (BLOCK_N, BLOCK_M): dSᵀ
    u32 pt;          // P_BUFFERS × (BLOCK_N, BLOCK_M): Pᵀ (SHARED_KEYS)
    u32 dq;          // DQ_BUFFERS × (64, 64) f32: each warpgroup's dQ tile, in `dq_pos` order
    float* stats;    // STAGES × [LSE·LOG2E (BLOCK_M), D (BLOCK_M)]
    u32 dq_info;     // DQ_WRITER: two DqInfo slots, step g's in slot g % 2
    Barriers load_kv, kv_free, load_q, release_q, work_full, work_empty;
    __device__ Pipeline<STAGES> pipe_q() const { return {load_q, release_q}; }
    __device__ u32 q_stage(int s) const { return q + s * QO_BYTES; }
    __device__ u32 do_stage(int s) const { return dout + s * QO_BYTES; }
    __device__ u32 ds_buf(int b) const { return ds + b * DS_BYTES; }
    __device__ u32 p_buf(int b) const { return pt + b * DS_BYTES; }
    __device__ u32 dq_buf(int c) const { return dq + c * DQ_BYTES; }
    __device__ float* lse2(int s) const { return stats + s * ROW_STATS; }
    __device__ float* dsum(int s) const { return lse2(s) + BLOCK_M; }
};

// The CTA's work: its keys, and the trip of (query head, query block) pairs, heads outer.
struct Work {
    int n0, valid_n, kv_head, batch;
    Seq s;
    long long stats0;  // the sequence's row 0 of head 0 in the padded statistics (`stats_base`)
    QueryBlocks qb;
    int per_head, trips;
    __device__ __forceinline__ int head(const FwdParams& p, int it) const { return kv_head * p.group + it / per_head; }
    __device__ __forceinline__ int m_block(int it) const { return qb.m_begin + it % per_head; }
};

static_assert(sizeof(Work) <= WORK_SLOT, "the planner reserves WORK_SLOT bytes per tile's work");

// The tiles: key blocks fastest, then KV heads, then batch entries.
__device__ __forceinline__ int num_tiles(const FwdParams& p) {
    return ((p.seqlen_k + BLOCK_N - 1) / BLOCK_N) * (p.heads_q / p.group) * p.batch;
}

// Tile t's work; t < 0 is the end of the CTA's walk (n0 = −1).
__device__ __forceinline__ Work work_of(const BwdParams& bp, int t) {
    const FwdParams& p = bp.f;
    Work w;
    if (t < 0) {
        w.n0 = -1;
        w.trips = 0;
        return w;
    }
    const int blocks = (p.seqlen_k + BLOCK_N - 1) / BLOCK_N, heads_kv = p.heads_q / p.group;
    // The deterministic mode hands a (KV head, sequence)'s key blocks out from the last: a key
    // block's dQ turn waits only for blocks handed out before it (`dq_turn`).
    w.n0 = (DETERMINISTIC ? blocks - 1 - t % blocks : t % blocks) * BLOCK_N;
    w.kv_head = (t / blocks) % heads_kv;
    w.batch = t / (blocks * heads_kv);
    w.s = sequence(p, w.batch, VARLEN);
    if constexpr (VARLEN) w.stats0 = stats_base(bp, w.batch, BLOCK_M);
    w.valid_n = max(0, min(BLOCK_N, w.s.k_len - w.n0));
    // A key block no query sees (or past the keys) has no trip: its dK, dV are written as zeros.
    w.qb = query_blocks(p, w.s, w.n0, w.n0 + max(w.valid_n, 1) - 1, BLOCK_M);
    w.per_head = w.valid_n > 0 ? max(0, w.qb.m_end - w.qb.m_begin) : 0;
    w.trips = w.per_head * p.group;
    return w;
}

// ---------------------------------------------------------------------------------------------
// Producer. Warp 0 (lane 0 issues): K and V once, then Q, dO and the row statistics of every
// step into the ring.

// The STATS_FREE barriers: the consumers arrive once they have read the statistics of the step
// in stage `stage` and a later step will refill it; producer warp 0 syncs before that refill.
// One barrier per stage, so a consumer's arrival for a stage's next step can only come after
// the producer refilled it, hence after the producer's sync on the previous generation. (The
// ring's release mbarrier orders the same reads too, but compute-sanitizer's racecheck does not
// follow mbarriers for ordinary loads.)
constexpr int STATS_SYNC_THREADS = 32 + 128 * CONSUMER_WGS;
static_assert(STAGES == 2 || STAGES == 3, "one STATS_FREE barrier per stage: the planner names three");
__device__ __forceinline__ void stats_free_sync(int stage) {
    __syncwarp();
    if (stage == 0)
        named_bar_sync<BAR_STATS_FREE0, STATS_SYNC_THREADS>();
    else if (STAGES == 2 || stage == 1)
        named_bar_sync<BAR_STATS_FREE1, STATS_SYNC_THREADS>();
    else
        named_bar_sync<BAR_STATS_FREE2, STATS_SYNC_THREADS>();
}
__device__ __forceinline__ void stats_free_arrive(int stage) {
    if (stage == 0)
        named_bar_arrive<BAR_STATS_FREE0, STATS_SYNC_THREADS>();
    else if (STAGES == 2 || stage == 1)
        named_bar_arrive<BAR_STATS_FREE1, STATS_SYNC_THREADS>();
    else
        named_bar_arrive<BAR_STATS_FREE2, STATS_SYNC_THREADS>();
}

// `stats_half` and `stats_base` with the batch's kind known at compile time: a fixed-length
// batch's expressions are the ones this kernel had before varlen (with the varlen forms in
// every variant, fixed-length causal shapes measured 1–2% slower, 2026-12-04).
__device__ __forceinline__ long long half_of(const BwdParams& bp) {
    if constexpr (VARLEN) return stats_half(bp);
    return static_cast<long long>(bp.f.batch) * bp.f.heads_q * bp.stats_rows;
}
// Row 0 of (sequence, head) in the padded statistics and the dQ accumulator.
// (Fixed-length batches; the varlen form, w.stats0 + head · stats_rows, is written out where
// used: folded into one helper, the varlen variants spilled 8 bytes.)
__device__ __forceinline__ long long stats_row(const BwdParams& bp, const Work& w, int head) {
    return (static_cast<long long>(w.batch) * bp.f.heads_q + head) * bp.stats_rows;
}

// The tile counter: in the D workspace, after the row statistics (`pre` zeroes it).
__device__ __forceinline__ unsigned* tile_counter(const BwdParams& bp) {
    return reinterpret_cast<unsigned*>(bp.dpsum + 2 * half_of(bp));
}

// ---------------------------------------------------------------------------------------------
// The deterministic mode: the dQ of a query block is added key block by key block in one order,
// from its last key block down. A semaphore per padded query block (after the tile counter,
// zeroed by `pre`; index = the block's first row in the padded statistics / BLOCK_M) counts the
// key blocks done; key block n adds when it reaches n's turn, then increments it. Tiles are
// handed out from each (KV head, sequence)'s last key block (`work_of`) and every CTA takes
// its first tile from the counter too, so a tile only waits for tiles already taken by running
// CTAs, which wait only for earlier ones: no wait can close a cycle, whatever the residency.

__device__ __forceinline__ int* dq_semaphores(const BwdParams& bp) {
    return reinterpret_cast<int*>(bp.dpsum + 2 * half_of(bp) + 4);
}

// Key block n0 / BLOCK_N's turn at query block m of sequence s: the number of key blocks after
// it that add to the block's dQ rows. Those are the blocks up to `hi`, the last whose first key
// a row of block m sees (key blocks see query blocks in a band: `query_blocks` of a later key
// block starts no earlier and ends no earlier), bounded by the sequence's last key block.
__device__ __forceinline__ int dq_turn(const FwdParams& p, const Seq& s, int n0, int m) {
    const int last_block = (s.k_len - 1) / BLOCK_N;
    int hi = last_block;
    if (HAS_WINDOW && p.window_right >= 0) {
        const int last_row = min((m + 1) * BLOCK_M, s.q_len) - 1;
        const long long x = static_cast<long long>(last_row) + (s.k_len - s.q_len) + p.window_right;
        hi = static_cast<int>(min(static_cast<long long>(last_block), x / BLOCK_N));
    }
    return hi - n0 / BLOCK_N;
}

// What the consumers tell the dQ writer about a step (DQ_WRITER), 32 bytes in slot g % 2 of
// `Smem::dq_info`: the query block's first tile in the accumulator (8 bytes), its semaphore
// (8), the turn (4; a negative turn ends the walk). Worked out here, the writer needs no more
// than the producer warpgroup's registers (with the row and the semaphore's index computed by
// the writer from the params, it spilled at 24 registers). Consumer 0's thread 0 writes
// step g's at the step's start (then only dK and dV are live: written after the dQ product,
// the consumers spilled); the writer reads it after DQ_FULL of step g. Slot g % 2 was last read
// for step g − 2, before the writer's DQ_EMPTY of it, which consumer 0 synced on at step g − 1.
__device__ __forceinline__ u32 dq_info_slot(const Smem& sm, int g) { return sm.dq_info + 32 * (g & 1); }
constexpr int DQ_SYNC_THREADS = 32 + WG_THREADS;  // the writer warp and one consumer warpgroup

// Consumer c's side of its DQ_FULL / DQ_EMPTY pair. The arrival names its barrier as an
// immediate (compute-sanitizer's racecheck did not follow the note's write to the writer's read
// through an arrival on an id in a register); the sync takes the id from a register (with a
// branch on c there, the d64 softcap consumers spilled 8 bytes at 240 registers).
static_assert(BAR_DQ_FULL1 == BAR_DQ_FULL0 + 1 && BAR_DQ_EMPTY1 == BAR_DQ_EMPTY0 + 1, "a barrier pair per consumer");
__device__ __forceinline__ void dq_full_arrive(int c) {
    if (c == 0)
        named_bar_arrive<BAR_DQ_FULL0, DQ_SYNC_THREADS>();
    else
        named_bar_arrive<BAR_DQ_FULL1, DQ_SYNC_THREADS>();
}
__device__ __forceinline__ void dq_empty_sync(int c) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(BAR_DQ_EMPTY0 + c), "n"(DQ_SYNC_THREADS) : "memory");
}

// The shared-keys form's deterministic mode: consumer warpgroup c alone (its thread 0 waited
// for the turn, or is about to increment the semaphore).
__device__ __forceinline__ void dq_turn_sync(int c) {
    if (c == 0)
        named_bar_sync<BAR_DQ_TURN0, WG_THREADS>();
    else
        named_bar_sync<BAR_DQ_TURN1, WG_THREADS>();
}

// The dQ writer (producer warp 1, DQ_WRITER): per step, once both consumers' tiles are in
// their buffers (DQ_FULL0/1), lane 0 waits for the query block's turn, reduce-adds both tiles
// (bulk, TMA), frees the buffers once read (DQ_EMPTY0/1) and, once the adds are complete,
// increments the semaphore. The consumers run on meanwhile until their next dQ tile.
__device__ __forceinline__ void dq_writer(const Smem& sm, int lane) {
    // The buffers start empty: one arrival each, which the consumers' first DQ_EMPTY takes.
    named_bar_arrive<BAR_DQ_EMPTY0, DQ_SYNC_THREADS>();
    named_bar_arrive<BAR_DQ_EMPTY1, DQ_SYNC_THREADS>();
    for (int g = 0;; ++g) {
        named_bar_sync<BAR_DQ_FULL0, DQ_SYNC_THREADS>();
        named_bar_sync<BAR_DQ_FULL1, DQ_SYNC_THREADS>();
        const int turn = static_cast<int>(ld_shared_b32(dq_info_slot(sm, g) + 16));
        if (turn < 0) break;
        int* sem = nullptr;
        if (lane == 0) {
            float* dst = reinterpret_cast<float*>(ld_shared_s64(dq_info_slot(sm, g)));
            sem = reinterpret_cast<int*>(ld_shared_s64(dq_info_slot(sm, g) + 8));
            while (ld_acquire_gpu(sem) != turn) __nanosleep(32);
#pragma unroll
            for (int c = 0; c < CONSUMER_WGS; ++c) {
                const int part = (c + g) % CONSUMER_WGS, rg = part % DQ_ROW_GROUPS, cg = part / DQ_ROW_GROUPS;
                bulk_reduce_add_f32(dst + (64 * rg) * HEAD_DIM + cg * (DQ_TILE * DQ_TILE), sm.dq_buf(c), DQ_BYTES);
            }
            bulk_commit();
            bulk_wait_read<0>();
        }
        __syncwarp();
        named_bar_arrive<BAR_DQ_EMPTY0, DQ_SYNC_THREADS>();
        named_bar_arrive<BAR_DQ_EMPTY1, DQ_SYNC_THREADS>();
        if (lane == 0) {
            bulk_wait<0>();
            red_release_gpu_add(sem, 1);
        }
    }
}

// The producer warp: per tile, the Work slot, K and V (once the consumers are done with the
// last tile's), then Q, dO and the row statistics of every step into the ring; lane 0 issues.
__device__ __forceinline__ void producer(const Sm90BwdParams& P, const Smem& sm, Work* slots, int lane) {
    const BwdParams& bp = P.b;
    if (lane == 0) {
        prefetch_tensormap(&P.tq);
        prefetch_tensormap(&P.tk);
        prefetch_tensormap(&P.tv);
        prefetch_tensormap(&P.tdo);
    }
    // The tile count and the statistics' half (below) are recomputed where used: the producer
    // has 24 registers, and held across the loops they spilled at d64.
    // The deterministic mode takes the first tile from the counter too (see `dq_semaphores`).
    int tile = blockIdx.x;
    if constexpr (DETERMINISTIC) {
        int first = 0;
        if (lane == 0) first = static_cast<int>(atomicAdd(tile_counter(bp), 1u));
        tile = __shfl_sync(0xffffffffu, first, 0);
    }
    int g = 0;       // steps issued: the ring position
    int loaded = 0;  // tiles whose K and V were loaded: the load_kv / kv_free phase
    for (int k = 0;; ++k) {
        const int slot = k & 1;
        const u32 phase = (k >> 1) & 1;
        mbar_wait(sm.work_empty[slot], phase ^ 1);  // the consumers are done with tile k − 2
        if (lane == 0) {
            slots[slot] = work_of(bp, tile < num_tiles(bp.f) ? tile : -1);
            mbar_arrive(sm.work_full[slot]);
        }
        __syncwarp();
        if (tile >= num_tiles(bp.f)) break;
        const Work& w = slots[slot];
        if (w.trips > 0) {
            if (loaded > 0) mbar_wait(sm.kv_free[0], (loaded - 1) & 1);
            ++loaded;
            if (lane == 0) {
                mbar_expect_tx(sm.load_kv[0], 2 * KV_BYTES);
                const int row = VARLEN ? w.s.k_start + w.n0 : w.n0, bi = VARLEN ? 0 : w.batch;
                tma_load_tile<SLAB_MAPS, SLABS>(sm.k, &P.tk, sm.load_kv[0], BLOCK_N, row, w.kv_head, bi);
                tma_load_tile<SLAB_MAPS, SLABS>(sm.v, &P.tv, sm.load_kv[0], BLOCK_N, row, w.kv_head, bi);
            }
        }
        for (int it = 0; it < w.trips; ++it, ++g) {
            const QState st = QState::at(g);
            const int head = w.head(bp.f, it), r0 = w.m_block(it) * BLOCK_M;
            sm.pipe_q().acquire(st);
            if (g >= STAGES) stats_free_sync(st.stage);
            if (lane != 0) continue;
            sm.pipe_q().expect(st, 2 * QO_BYTES + ROW_STATS * 4);
            const int row = VARLEN ? w.s.q_start + r0 : r0, bi = VARLEN ? 0 : w.batch;
            tma_load_tile<SLAB_MAPS, SLABS>(sm.q_stage(st.stage), &P.tq, sm.load_q[st.stage], BLOCK_M, row, head, bi);
            tma_load_tile<SLAB_MAPS, SLABS>(sm.do_stage(st.stage), &P.tdo, sm.load_q[st.stage], BLOCK_M, row, head, bi);
            // The padded statistics of (sequence, head): D at `dsum`, LSE·LOG2E half a workspace later.
            const long long half = half_of(bp);
            const float* dsum = VARLEN ? bp.dpsum + w.stats0 + static_cast<long long>(head) * bp.stats_rows + r0
                                       : bp.dpsum + stats_row(bp, w, head) + r0;
            bulk_copy_g2s(smem_u32(sm.lse2(st.stage)), dsum + half, BLOCK_M * 4, sm.load_q[st.stage]);
            bulk_copy_g2s(smem_u32(sm.dsum(st.stage)), dsum, BLOCK_M * 4, sm.load_q[st.stage]);
        }
        // The next tile, claimed once this one's loads are all issued: the consumers still have
        // up to STAGES steps of it to run, behind which the atomic's latency hides. (Claimed
        // when the tile started, the walk ran d128 causal 4k and 16k 2–4% slower than one CTA
        // per tile: a CTA in a long tile held the next one while others could have run it.)
        int next = 0;
        if (lane == 0) next = static_cast<int>(atomicAdd(tile_counter(bp), 1u)) + (DETERMINISTIC ? 0 : gridDim.x);
        tile = __shfl_sync(0xffffffffu, next, 0);
    }
    // The consumers arrive on STATS_FREE after every step; the last STAGES steps' arrivals have
    // no refill to wait for them: take them here, so that every barrier generation completes.
    for (int j = g > STAGES ? g - STAGES : 0; j < g; ++j) stats_free_sync(QState::at(j).stage);
}

// ---------------------------------------------------------------------------------------------
// Consumers.

// Sets the non-finite halves of the 16-bit values of `bytes` of shared memory from `base` to 0
// (all consumer threads, 16 bytes each per pass), then makes the writes visible to wgmma.
template <int BYTES>
__device__ __forceinline__ void clean_nonfinite(u32 base, int ctid) {
    constexpr u32 EXP = IS_BF16 ? 0x7f80u : 0x7c00u;
    static_assert(BYTES % (16 * CONSUMER_THREADS) == 0, "whole passes");
#pragma unroll 4
    for (int off = 16 * ctid; off < BYTES; off += 16 * CONSUMER_THREADS) {
        u32 x[4];
        ld_shared_v4(x, base + off);
        bool bad = false;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const u32 lo = (x[e] & EXP) == EXP ? 0u : (x[e] & 0xffffu);
            const u32 hi = ((x[e] >> 16) & EXP) == EXP ? 0u : (x[e] & 0xffff0000u);
            bad |= (lo | hi) != x[e];
            x[e] = lo | hi;
        }
        if (bad) st_shared_v4(base + off, x);
    }
    fence_proxy_async();
    named_bar_sync<BAR_CLEANED, CONSUMER_THREADS>();
}

// Zeroes rows [from, BLOCK_M) of the (BLOCK_M, HEAD_DIM) stage tiles `q` and `dout` (nothing
// when from ≥ BLOCK_M). A row is 128 contiguous bytes of each slab (the swizzle permutes chunks
// within a row), so the zeros go 16 bytes at a time, each chunk by the thread that
// `clean_nonfinite` gives it; that call's fence and barrier publish them.
__device__ __forceinline__ void zero_rows_from(u32 q, u32 dout, int from, int ctid) {
    if (from >= BLOCK_M) return;
    const u32 z[4] = {0u, 0u, 0u, 0u};
#pragma unroll 1
    for (int off = 16 * ctid; off < QO_BYTES; off += 16 * CONSUMER_THREADS) {
        if ((off / SLAB_ROW_BYTES) % BLOCK_M < from) continue;
        st_shared_v4(q + off, z);
        st_shared_v4(dout + off, z);
    }
}

// Sᵀ = K_c·Qᵀ and dPᵀ = V_c·dOᵀ (one commit group): A is the warpgroup's 64 rows of K (V),
// K-major; B is Q (dO), K-major, N = QUERIES_PER_WG (its rows from c·QUERIES_PER_WG with
// SHARED_KEYS, whose consumers all take the block's 64 keys); the sums over QK_DIM and PV_DIM
// (the columns past them are zeros).
__device__ __forceinline__ void issue_st_dpt(float (&rS)[ST_REGS], float (&rdP)[ST_REGS], const Smem& sm, int stage,
                                             int c) {
    const u32 wg_off = SHARED_KEYS ? 0u : KEYS_PER_WG * c * SLAB_ROW_BYTES;
    const u32 q_off = SHARED_KEYS ? QUERIES_PER_WG * c * SLAB_ROW_BYTES : 0u;
    const u64 k_desc = smem_desc(sm.k + wg_off, 16, SBO_BYTES), v_desc = smem_desc(sm.v + wg_off, 16, SBO_BYTES);
    const u64 q_desc = smem_desc(sm.q_stage(stage) + q_off, 16, SBO_BYTES);
    const u64 do_desc = smem_desc(sm.do_stage(stage) + q_off, 16, SBO_BYTES);
#pragma unroll
    for (int kk = 0; kk < QK_DIM / 16; ++kk) {
        const u32 a_off = (kk / 4) * (BLOCK_N * SLAB_ROW_BYTES) + (kk % 4) * KSTEP_K_MAJOR_BYTES;
        const u32 b_off = (kk / 4) * (BLOCK_M * SLAB_ROW_BYTES) + (kk % 4) * KSTEP_K_MAJOR_BYTES;
        wgmma_st(rS, desc_plus(k_desc, a_off), desc_plus(q_desc, b_off), kk > 0 ? 1 : 0);
        if (kk < PV_DIM / 16) wgmma_st(rdP, desc_plus(v_desc, a_off), desc_plus(do_desc, b_off), kk > 0 ? 1 : 0);
    }
    wgmma_commit();
}

// acc += A·B for A = a (64 keys, BLOCK_M queries) from registers and B = the (BLOCK_M, HEAD_DIM)
// tile at `b_base`, MN-major (its slabs BLOCK_M rows apart): dV += Pᵀ·dO and dK += dSᵀ·Q.
__device__ __forceinline__ void issue_dkv(float (&acc)[DKV_REGS], const u32 (&a)[PK_REGS], u32 b_base) {
    const u64 b_desc = smem_desc(b_base, BLOCK_M * SLAB_ROW_BYTES, SBO_BYTES);
#pragma unroll
    for (int kk = 0; kk < BLOCK_M / 16; ++kk)
        wgmma_dkv(acc, a[4 * kk], a[4 * kk + 1], a[4 * kk + 2], a[4 * kk + 3], desc_plus(b_desc, kk * KSTEP_ROWS_BYTES));
}

// SHARED_KEYS: acc += A·B for A = the (BLOCK_N, BLOCK_M) tile at `a_base` (Pᵀ or dSᵀ, stored by
// both consumers: K-major, queries contiguous) and B = DKV_N columns of the (BLOCK_M, HEAD_DIM)
// tile from `b_base` (a slab's start), MN-major: dV += Pᵀ·dO and dK += dSᵀ·Q over the block's
// queries, this consumer's columns.
__device__ __forceinline__ void issue_dkv_ss(float (&acc)[DKV_REGS], u32 a_base, u32 b_base) {
    const u64 a_desc = smem_desc(a_base, 16, SBO_BYTES);
    const u64 b_desc = smem_desc(b_base, BLOCK_M * SLAB_ROW_BYTES, SBO_BYTES);
#pragma unroll
    for (int kk = 0; kk < BLOCK_M / 16; ++kk) {
        const u32 a_off = (kk / 4) * (BLOCK_N * SLAB_ROW_BYTES) + (kk % 4) * KSTEP_K_MAJOR_BYTES;
        wgmma_dkv_ss(acc, desc_plus(a_desc, a_off), desc_plus(b_desc, kk * KSTEP_ROWS_BYTES), 1);
    }
}

// dQ (64 queries of row group `rg`, DQ_N columns of column group `cg`) = dS·K over the block's
// keys: A = dSᵀ slab rg, MN-major (queries contiguous); B = K's slabs from cg·DQ_N, MN-major.
__device__ __forceinline__ void issue_dq(float (&acc)[DQ_REGS], const Smem& sm, u32 ds_base, int rg, int cg) {
    const u64 a_desc = smem_desc(ds_base + rg * (BLOCK_N * SLAB_ROW_BYTES), BLOCK_N * SLAB_ROW_BYTES, SBO_BYTES);
    const u64 b_desc =
        smem_desc(sm.k + (cg * DQ_N / SLAB_ELEMS) * (BLOCK_N * SLAB_ROW_BYTES), BLOCK_N * SLAB_ROW_BYTES, SBO_BYTES);
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk)
        wgmma_dq(acc, desc_plus(a_desc, kk * KSTEP_ROWS_BYTES), desc_plus(b_desc, kk * KSTEP_ROWS_BYTES),
                 kk > 0 ? 1 : 0);
}

// The 128-byte swizzle of a tile of 64-column slabs, `rows` rows tall: element (row, col)
// (16-bit) sits at slab col / 64, row `row`, 16-byte chunk (col % 64) / 8 XOR row % 8. For the
// dSᵀ stores of accumulator register i of a thread, row % 8 is lane / 4 (key_row is 8-aligned
// but for it) and the rest is a constant of i, so the address is
// (tile + ds_row_base + ds_offset(i)) ^ ((lane / 4) · 16): the chunk bits 4–6 of everything but
// the constant's chunk are 0, so adding the chunk and then XOR-ing equals XOR-ing the chunk.
// Computed per store (an add and a xor) so that nothing is held across the step loop.
// `q0` is the warpgroup's first query column (SHARED_KEYS; a multiple of 8, else 0).
__device__ __forceinline__ constexpr u32 ds_offset(int i, int q0) {
    // acc_col(i, lane) = 8·(i/4) + 2·(lane % 4) + i % 2 (the lane part is in ds_row_base).
    return static_cast<u32>(((q0 + 8 * (i >> 2)) / SLAB_ELEMS) * BLOCK_N * SLAB_ROW_BYTES +
                            acc_slot(i) * 8 * SLAB_ROW_BYTES + (((q0 + 8 * (i >> 2)) % SLAB_ELEMS) / 8) * 16);
}

// Position (in f32 elements) of accumulator register i of warpgroup thread t in a dQ tile:
// warp w's registers fill elements [1024w, 1024w + 1024) (its 16 rows), registers 4k .. 4k + 3
// of its lanes elements 1024w + 128k .. + 127, lane by lane.
// The Hopper `convert` (`../bwd/aux.cu`, `convert_tiles`) reads the tiles back in this order.
__device__ __forceinline__ constexpr int dq_pos(int i, int t) {
    return 1024 * (t / 32) + 128 * (i >> 2) + 4 * (t % 32) + (i & 3);
}

// threadIdx.x, read anew at each use (volatile): for values the compiler would otherwise hold in
// a register across the step loop, or spill.
__device__ __forceinline__ u32 thread_index() {
    u32 t;
    asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(t));
    return t;
}

__device__ __forceinline__ void zero(float* r, int n) {
#pragma unroll
    for (int i = 0; i < n; ++i) r[i] = 0.0f;
}

// Pᵀ and dSᵀ (without the scale) of a step from its Sᵀ and dPᵀ, packed into A fragments: k step
// kk takes registers 8kk .. 8kk + 7 pairwise (the accumulator layout is the A layout's); the
// thread's query columns start at q0 (the warpgroup's first with SHARED_KEYS, else 0). `lse2`
// holds the step's LSE·LOG2E rows, then its D rows. MASKED: query q of the block is allowed for
// the thread's key of slot h iff q is in [q_lo[h], q_hi[h]); others get P = dS = 0 (set, not
// multiplied). An unmasked step skips that test (its instance has none).
template <bool MASKED>
__device__ __forceinline__ void p_and_ds(u32 (&rP)[PK_REGS], u32 (&rdS)[PK_REGS], const float (&rS)[ST_REGS],
                                         const float (&rdP)[ST_REGS], const float* lse2, const int (&q_lo)[2],
                                         const int (&q_hi)[2], const BwdParams& bp, int lane, int q0) {
#pragma unroll
    for (int j = 0; j < PK_REGS; ++j) {
        float pv[2], ds[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int i = 2 * j + e, q = q0 + acc_col(i, lane);
            float dsdx = 1.0f;
            if constexpr (HAS_SOFTCAP) {
                const float x = capped(bp, rS[i], dsdx);
                pv[e] = exp2_approx(x * LOG2E - lse2[q]);
            } else {
                // One FMA: the scale and LOG2E folded (a rounding apart from (raw·scale)·LOG2E).
                pv[e] = exp2_approx(fmaf(rS[i], bp.scale * LOG2E, -lse2[q]));
            }
            ds[e] = pv[e] * (rdP[i] - lse2[BLOCK_M + q]) * dsdx;
            if constexpr (MASKED) {
                const int h = acc_slot(i);
                if (q < q_lo[h] || q >= q_hi[h]) pv[e] = ds[e] = 0.0f;
            }
        }
        rP[j] = pack2(pv[0], pv[1]);
        rdS[j] = pack2(ds[0], ds[1]);
    }
}

__device__ __forceinline__ void consumer(const Sm90BwdParams& P, const Smem& sm, const Work* slots, int c) {
    const BwdParams& bp = P.b;
    const FwdParams& p = bp.f;
    const int ctid = threadIdx.x - WG_THREADS;  // 0 .. CONSUMER_THREADS
    const int tid = ctid % WG_THREADS, warp = tid / 32, lane = tid % 32;
    // This thread's keys: key_row + 8·slot; with SHARED_KEYS its queries from q0 and its dK, dV
    // columns from col0.
    const int key_row = (SHARED_KEYS ? 0 : KEYS_PER_WG * c) + 16 * warp + lane / 4;
    const int q0 = SHARED_KEYS ? QUERIES_PER_WG * c : 0, col0 = SHARED_KEYS ? DKV_N * c : 0;

    int g = 0;       // steps consumed: the ring position
    int loaded = 0;  // tiles with steps so far: the load_kv phase
    for (int k = 0;; ++k) {
        const int slot = k & 1;
        mbar_wait(sm.work_full[slot], (k >> 1) & 1);
        const Work& w = slots[slot];
        if (w.n0 < 0) break;

        float rdK[DKV_REGS], rdV[DKV_REGS];  // (64, DKV_N) each per warpgroup
        zero(rdK, DKV_REGS);
        zero(rdV, DKV_REGS);

        if (w.trips > 0) {
            mbar_wait(sm.load_kv[0], loaded & 1);
            ++loaded;
            clean_nonfinite<KV_BYTES>(sm.k, ctid);  // K only: V never meets a zeroed dS
        }
        const bool keys_partial = w.valid_n < BLOCK_N;
        for (int it = 0; it < w.trips; ++it, ++g) {
            const QState st = QState::at(g);
            const int head = w.head(p, it), m = w.m_block(it), r0 = m * BLOCK_M;
            const bool masked = keys_partial || w.qb.masked(m);
            if constexpr (DQ_WRITER) {
                // The step's note to the dQ writer (`dq_info_slot`).
                if (c == 0 && thread_index() % WG_THREADS == 0) {
                    const long long row0 = VARLEN ? w.stats0 + static_cast<long long>(head) * bp.stats_rows + r0
                                                  : stats_row(bp, w, head) + r0;
                    st_shared_s64(dq_info_slot(sm, g), reinterpret_cast<long long>(bp.dq_accum + row0 * HEAD_DIM));
                    st_shared_s64(dq_info_slot(sm, g) + 8, reinterpret_cast<long long>(dq_semaphores(bp) + row0 / BLOCK_M));
                    st_shared_b32(dq_info_slot(sm, g) + 16, static_cast<u32>(dq_turn(p, w.s, w.n0, m)));
                }
            }
            sm.pipe_q().wait(st);
            if (masked) {
                // A varlen block past its sequence's end: the next sequence's rows zeroed (the
                // same threads clean the same 16-byte chunks of Q next, so no race).
                if constexpr (VARLEN) zero_rows_from(sm.q_stage(st.stage), sm.do_stage(st.stage), w.s.q_len - r0, ctid);
                clean_nonfinite<QO_BYTES>(sm.q_stage(st.stage), ctid);
            }

            float rS[ST_REGS], rdP[ST_REGS];  // (64 keys, QUERIES_PER_WG queries) each per warpgroup
            wgmma_fence();
            issue_st_dpt(rS, rdP, sm, st.stage, c);
            wgmma_wait<0>();

            // Pᵀ and dSᵀ. In a masked step query q of the block is allowed for this thread's key of
            // slot h iff q is in [q_lo[h], q_hi[h]): the queries that see the key (`query_lo`,
            // `query_hi`), which is `allowed` read from the key side; a key past the sequence's
            // end sees none.
            const float* lse2 = sm.lse2(st.stage);  // and D at lse2 + BLOCK_M (one base register)
            int q_lo[2] = {0, 0}, q_hi[2] = {BLOCK_M, BLOCK_M};
            if (masked) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int j = w.n0 + key_row + 8 * h;
                    const bool key_ok = key_row + 8 * h < w.valid_n;
                    q_lo[h] = key_ok ? query_lo(p, w.s, j) - r0 : 0;
                    q_hi[h] = key_ok ? query_hi(p, w.s, j) - r0 : 0;
                }
            }
            u32 rP[PK_REGS], rdS[PK_REGS];
            // Two instances: an unmasked step (most of them) runs no bounds test per element. The
            // flag passes through an empty volatile asm so that the compiler cannot hoist the test
            // out of the step loop (duplicating the loop; the d64 copy spilled 120 bytes).
            int masked_now = masked;
            asm volatile("" : "+r"(masked_now));
            if (masked_now)
                p_and_ds<true>(rP, rdS, rS, rdP, lse2, q_lo, q_hi, bp, lane, q0);
            else
                p_and_ds<false>(rP, rdS, rS, rdP, lse2, q_lo, q_hi, bp, lane, q0);
            // This stage's statistics are read: the producer may refill it (STATS_FREE).
            stats_free_arrive(st.stage);

            const u32 ds_base = sm.ds_buf(g % DS_BUFFERS);
            const u32 ds_row = (lane % 4) * 4 + key_row * SLAB_ROW_BYTES, ds_xor = (lane / 4) * 16;
            if constexpr (SHARED_KEYS) {
                // Pᵀ and dSᵀ of this warpgroup's queries to buffer g % 2 (the products below take
                // every query of the block, so both go through shared memory); register pair j is
                // (key_row + 8·slot, queries q0 + acc_col(2j) + 0, 1).
                const u32 p_base = sm.p_buf(g % DS_BUFFERS);
#pragma unroll
                for (int j = 0; j < PK_REGS; ++j) {
                    st_shared_b32((p_base + ds_row + ds_offset(2 * j, q0)) ^ ds_xor, rP[j]);
                    st_shared_b32((ds_base + ds_row + ds_offset(2 * j, q0)) ^ ds_xor, rdS[j]);
                }
                fence_proxy_async();
                named_bar_sync<BAR_DS_READY, CONSUMER_THREADS>();
                // dV += Pᵀ·dO, dK += dSᵀ·Q over this warpgroup's columns, then dQ = dS·K over its
                // dQ columns (part c) as a second commit group.
                const u32 slab_off = (col0 / SLAB_ELEMS) * (BLOCK_M * SLAB_ROW_BYTES);
                wgmma_fence();
                issue_dkv_ss(rdV, p_base, sm.do_stage(st.stage) + slab_off);
                issue_dkv_ss(rdK, ds_base, sm.q_stage(st.stage) + slab_off);
                wgmma_commit();
            } else {
                // dV += Pᵀ·dO, dK += dSᵀ·Q, in flight while dSᵀ goes to shared memory.
                wgmma_fence();
                issue_dkv(rdV, rP, sm.do_stage(st.stage));
                issue_dkv(rdK, rdS, sm.q_stage(st.stage));
                wgmma_commit();

                // dSᵀ to buffer g % 2: register pair j is (key_row + 8·slot, queries acc_col(2j) + 0, 1).
#pragma unroll
                for (int j = 0; j < PK_REGS; ++j) st_shared_b32((ds_base + ds_row + ds_offset(2 * j, 0)) ^ ds_xor, rdS[j]);
                fence_proxy_async();
                // This warp's previous dQ rows have been read out of the buffer (its lane 0 issued
                // their reduce-add); the barrier tells the other lanes before they store the next ones.
                if (lane == 0) bulk_wait_read<0>();
                named_bar_sync<BAR_DS_READY, CONSUMER_THREADS>();
            }

            if constexpr (SHARED_KEYS) {
                // dQ of this warpgroup's columns, one 64 × 64 part at a time (a 64 × 128 product
                // held beside dK and dV spilled in the varlen d192 variants), each added from
                // registers: four consecutive registers are 16 contiguous bytes of an
                // accumulator tile (`dq_pos`), a warp's 32 lanes 512 contiguous bytes. (No shared
                // dQ buffer: it would not fit beside the two Q/dO stages at HEAD_DIM 256.)
#pragma unroll 1
                for (int h = 0; h < DQ_PARTS_PER_WG; ++h) {
                    float rdQ[DQ_REGS];  // (64, 64)
                    wgmma_fence();
                    issue_dq(rdQ, sm, ds_base, 0, c * DQ_PARTS_PER_WG + h);
                    wgmma_commit();
                    if (h == 0) {
                        wgmma_wait<1>();  // dV and dK are in: the stage's Q and dO are free
                        sm.pipe_q().release(st, lane);
                    }
                    const int t_now = static_cast<int>(thread_index()) % WG_THREADS;
                    const long long row0 = VARLEN ? w.stats0 + static_cast<long long>(head) * bp.stats_rows + r0
                                                  : stats_row(bp, w, head) + r0;
                    if (DETERMINISTIC && h == 0) {
                        // The deterministic mode: this warpgroup's thread 0 waits until every
                        // consumer of the key blocks before this one in turn has added its
                        // columns (each counts one), then lets the warpgroup add.
                        if (t_now == 0) {
                            const int want = CONSUMER_WGS * dq_turn(p, w.s, w.n0, m);
                            const int* sem = dq_semaphores(bp) + row0 / BLOCK_M;
                            while (ld_acquire_gpu(sem) < want) __nanosleep(32);
                        }
                        dq_turn_sync(c);
                    }
                    wgmma_wait<0>();
                    float* acc = bp.dq_accum + row0 * HEAD_DIM + (c * DQ_PARTS_PER_WG + h) * (DQ_TILE * DQ_TILE);
#pragma unroll
                    for (int k = 0; k < DQ_REGS / 4; ++k)
                        red_add_v4f(acc + dq_pos(4 * k, t_now), rdQ[4 * k], rdQ[4 * k + 1], rdQ[4 * k + 2], rdQ[4 * k + 3]);
                }
                if constexpr (DETERMINISTIC) {
                    // Every thread's adds of the step are issued; thread 0 makes them visible
                    // at GPU scope before the increment.
                    dq_turn_sync(c);
                    if (thread_index() % WG_THREADS == 0) {
                        const long long row0 = VARLEN ? w.stats0 + static_cast<long long>(head) * bp.stats_rows + r0
                                                      : stats_row(bp, w, head) + r0;
                        __threadfence();
                        red_release_gpu_add(dq_semaphores(bp) + row0 / BLOCK_M, 1);
                    }
                }
                continue;
            }
            const int part = (c + g) % CONSUMER_WGS;  // this warpgroup's part of dQ, if any
            if (part >= DQ_PARTS) {
                wgmma_wait<0>();  // dV and dK are in: the stage's Q and dO are free
                sm.pipe_q().release(st, lane);
                continue;
            }
            const int rg = part % DQ_ROW_GROUPS, cg = part / DQ_ROW_GROUPS;
            float rdQ[DQ_REGS];  // (64, DQ_N) per warpgroup
            wgmma_fence();
            issue_dq(rdQ, sm, ds_base, rg, cg);
            wgmma_commit();
            wgmma_wait<1>();  // dV and dK are in: the stage's Q and dO are free (dQ reads dSᵀ and K)
            sm.pipe_q().release(st, lane);
            wgmma_wait<0>();

            // dQ_i += dS·K (the scale is applied by the convert kernel): the tile to this
            // warpgroup's buffer in register order, then one bulk reduce-add of it into its
            // accumulator tile (rows past the sequence land in the padded rows, which `convert`
            // skips). The thread's place in the tile from a fresh read of its index: held across
            // the step loop, these offsets spilled at d64 with a window (BLOCK_M 128).
            const int t_now = static_cast<int>(thread_index()) % WG_THREADS;
            const long long row0 = VARLEN ? w.stats0 + static_cast<long long>(head) * bp.stats_rows + r0 + 64 * rg
                                          : stats_row(bp, w, head) + r0 + 64 * rg;
            const u32 dq_buf = sm.dq_buf(c);
            // The deterministic mode: the writer has read the last tile out of the buffer.
            if constexpr (DQ_WRITER) dq_empty_sync(c);
#pragma unroll
            for (int k = 0; k < DQ_REGS / 4; ++k)
                st_shared_v4f(dq_buf + 4 * dq_pos(4 * k, t_now), rdQ[4 * k], rdQ[4 * k + 1], rdQ[4 * k + 2], rdQ[4 * k + 3]);
            fence_proxy_async();
            if constexpr (DQ_WRITER) {
                dq_full_arrive(c);
                continue;
            }
            __syncwarp();
            if (lane == 0) {
                const int warp_elems = DQ_WARP_ELEMS * (t_now / 32);
                bulk_reduce_add_f32(bp.dq_accum + row0 * HEAD_DIM + cg * (DQ_TILE * DQ_TILE) + warp_elems,
                                    dq_buf + 4 * warp_elems, 4 * DQ_WARP_ELEMS);
                bulk_commit();
            }
        }
        // The tile's last products have read K and V (every step ends in wgmma_wait<0>): the
        // producer may load the next tile's while this one's dK and dV go out.
        if (w.trips > 0) {
            __syncwarp();
            if (lane == 0) mbar_arrive(sm.kv_free[0]);
        }

        // dK = scale · Σ dSᵀ·Q and dV, rounded, rows below the keys' end, their real columns (DIM,
        // DIM_V: a register pair's two columns are both below either or both past it, both even).
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int j = key_row + 8 * h;
            if (j >= w.valid_n) continue;
            const long long row = w.s.k_start + w.n0 + j;
            u16* gdK = static_cast<u16*>(bp.dk) + w.batch * bp.dk_batch_stride + row * bp.dk_row_stride +
                       w.kv_head * bp.dk_head_stride;
            u16* gdV = static_cast<u16*>(bp.dv) + w.batch * bp.dv_batch_stride + row * bp.dv_row_stride +
                       w.kv_head * bp.dv_head_stride;
#pragma unroll
            for (int i = 0; i < DKV_REGS; i += 4) {
                const int col = col0 + acc_col(i, lane);
                if (SLAB_MAPS && col >= DIM) continue;
                st_global_b32(gdK + col, pack2(rdK[i + 2 * h] * bp.scale, rdK[i + 2 * h + 1] * bp.scale));
                if (DIM_V == DIM || col < DIM_V) st_global_b32(gdV + col, pack2(rdV[i + 2 * h], rdV[i + 2 * h + 1]));
            }
        }
        // The slot's work is read: the producer may write tile k + 2 into it.
        __syncwarp();
        if (lane == 0) mbar_arrive(sm.work_empty[slot]);
    }
    // The deterministic mode: consumer 0 ends the writer's walk with a negative turn in note g
    // (free, as for a step's note: the writer read it for step g − 2 before the DQ_EMPTY that
    // consumer 0 synced on at step g − 1), written before the last DQ_EMPTY as a step's note is
    // (written after it, compute-sanitizer's racecheck did not follow the write through the
    // DQ_FULL arrival to the writer's read); then the writer has read the last tiles out.
    if constexpr (DQ_WRITER) {
        if (c == 0 && thread_index() % WG_THREADS == 0) st_shared_b32(dq_info_slot(sm, g) + 16, static_cast<u32>(-1));
        dq_empty_sync(c);
        dq_full_arrive(c);
    }
    // The last reduce-adds have read their buffer before the CTA's shared memory goes (their
    // global writes complete before the kernel does).
    if (lane == 0) bulk_wait_read<0>();
}

// ---------------------------------------------------------------------------------------------
// Entry: shared-memory carve-out, barrier init, role dispatch.

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1) fa4_bwd_sm90(const __grid_constant__ Sm90BwdParams P) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    if (static_cast<int>(blockIdx.x) >= num_tiles(P.b.f)) return;  // more CTAs than tiles

    Smem sm;
    const u32 base = (smem_u32(smem_raw) + TILE_ALIGN - 1) & ~static_cast<u32>(TILE_ALIGN - 1);
    sm.k = base;
    sm.v = sm.k + KV_BYTES;
    sm.q = sm.v + KV_BYTES;
    sm.dout = sm.q + STAGES * QO_BYTES;
    sm.ds = sm.dout + STAGES * QO_BYTES;
    sm.pt = sm.ds + DS_BUFFERS * DS_BYTES;
    sm.dq = sm.pt + P_BUFFERS * DS_BYTES;
    const u32 stats = sm.dq + DQ_BUFFERS * DQ_BYTES;
    sm.stats = reinterpret_cast<float*>(smem_raw + (stats - smem_u32(smem_raw)));
    sm.load_kv.base = stats + STAGES * ROW_STATS * 4;
    sm.kv_free.base = sm.load_kv[1];
    sm.load_q.base = sm.kv_free[1];
    sm.release_q.base = sm.load_q[STAGES];
    sm.work_full.base = sm.release_q[STAGES];
    sm.work_empty.base = sm.work_full[2];
    // The tiles' work, in two slots after the barriers: its fields are read where needed (the
    // loops' barrier waits are memory clobbers, so the reads are not hoisted), which keeps about
    // a dozen registers free in the producer and the consumers (held in registers, the producer
    // spilled at 24 registers and the consumers at 232 with a softcap).
    Work* slots = reinterpret_cast<Work*>(smem_raw + (sm.work_empty[2] - smem_u32(smem_raw)));
    static_assert(WORK_SLOT % alignof(Work) == 0, "each slot holds a Work");
    sm.dq_info = sm.work_empty[2] + WORK_BYTES;

    if (threadIdx.x == 0) {
        mbar_init(sm.load_kv[0], 1);
        mbar_init(sm.kv_free[0], 4 * CONSUMER_WGS);         // one per consumer warp
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(sm.load_q[s], 1);                     // thread 0's expect_tx
            mbar_init(sm.release_q[s], 4 * CONSUMER_WGS);   // one per consumer warp
        }
        for (int w = 0; w < 2; ++w) {
            mbar_init(sm.work_full[w], 1);                  // the producer's lane 0
            mbar_init(sm.work_empty[w], 4 * CONSUMER_WGS);  // one per consumer warp
        }
        fence_mbarrier_init();
    }
    __syncthreads();

    const int warp = threadIdx.x / 32, wg = threadIdx.x / WG_THREADS;
    switch (role_of(warp)) {
    case ROLE_PRODUCER:
        setmaxnreg_dec<PRODUCER_REGS>();
        if (warp == 0) producer(P, sm, slots, threadIdx.x % 32);
        else if (DQ_WRITER && warp == 1) dq_writer(sm, threadIdx.x % 32);
        break;
    case ROLE_CONSUMER:
        setmaxnreg_inc<CONSUMER_REGS>();
        consumer(P, sm, slots, wg - FIRST_CONSUMER_WARP / 4);
        break;
    }
}
