// Hopper (sm_90a) FlashAttention forward: TMA loads into an mbarrier ring issued by a producer
// warpgroup, wgmma for S = Q·Kᵀ (both operands in shared memory) and O += P·V (P from
// registers), online softmax in registers, setmaxnreg moving registers to the consumers.
//
// Self-contained (NVRTC may have no headers). The planner (`config::sm90`) prepends a prelude
// (the tile constants, the role enum and `role_of`, the named barriers, the feature switches),
// then the shared layer `../common/{base,params,mask,softmax}.cuh`, this family's `params.cuh`,
// `ptx.cuh`, the generated wgmma wrappers `wgmma_ss` (S, N = BLOCK_N) and `wgmma_rs` (O,
// N = HEAD_DIM; `wgmma_rs_acc` with an accumulate flag), `pipeline.cuh` and `tiles.cuh`; then this file, which holds no `asm`.
//
// Work: a tile is BLOCK_M query rows of one (sequence, head). The launch has one CTA per tile, or
// (persistent) fewer CTAs that each walk a list of tiles (`tile_number`), or take them one by
// one from a counter (DYNAMIC, `claim_tile`: the producer writes each tile into the word slot of
// its Q slot, where the consumers and warp 1 read it once the Q load completes, and ends with
// a mark there): the producer loads the next tile's Q (into the other of Q_STAGES slots) and
// first K/V while the consumers finish the last one.
// Warp roles (the prelude's `Role` and `role_of(warp)`, emitted from the planner's role table,
// which `fa4 plan --arch sm90` prints):
//   warpgroup 0      ROLE_PRODUCER   PRODUCER_REGS   thread 0 issues every TMA load;
//                                                    warp 1 zeroes V rows past a sequence (VARLEN)
//   warpgroup 1 + c  ROLE_CONSUMER   CONSUMER_REGS   consumer c: rows [64c, 64c + 64): S, softmax, O
// Pipelines (`pipeline.cuh`; each barrier array is named after the edge it carries, in this
// table and in the code; phase bits flip on every completion):
//   pipeline  barriers        edge                    arrivals per phase
//   pipe_q    load_q[t]       producer → consumers    1 (expect_tx) + Q bytes      (t: Q slot)
//                                                     (DYNAMIC's end mark: 1 plain arrival)
//             release_q[t]    consumers → producer    one per consumer warp (VARLEN and
//                                                     DYNAMIC: and warp 1, once it read the slot)
//   pipe_k    load_k[s]       producer → consumers    1 (expect_tx) + K bytes
//             release_k[s]    consumers → producer    one per consumer warp
//   pipe_v    load_v[s]       producer → consumers    1 (expect_tx) + V bytes, or for a VARLEN
//                                                     block with foreign rows warp 1's arrival
//             release_v[s]    consumers → producer    one per consumer warp
//   (none)    load_v_tail[s]  producer → warp 1       1 (expect_tx) + V bytes (VARLEN, below)
// K and V of a stage are released separately: with the intra-warpgroup overlap a consumer is
// done with K of block n one step before V of block n.
//
// Variable-length batches (VARLEN): Q, K and V are packed [total, heads, head_dim] and each map
// spans the whole packed tensor, so a block that crosses the end of its sequence holds the next
// sequence's rows (past the total, zeros). Their query rows are computed and not stored, their
// scores are masked (replaced by −inf), but P·V would still multiply their V rows by P = 0, and
// 0 · inf or NaN is NaN. So such a V block is loaded onto load_v_tail[s]; warp 1 of the producer
// warpgroup waits for it there, zeroes the foreign rows and then completes load_v[s] with a plain
// arrival. Fixed-length batches have a map per batch entry, whose reads past the end are zeros.
//
// Shared-memory tiles are TMA boxes with the 128-byte swizzle: a (rows, HEAD_DIM) tile is
// stored as HEAD_DIM / 64 slabs of (rows, 64), each row 128 bytes, each slab 1024-aligned.
//
// Head dims: HEAD_DIM is the tile width of Q and K, HEAD_DIM_V that of V and O (≤ HEAD_DIM; the
// MLA prefill shape is 192/128), both multiples of 64. A tensor whose head dim is narrower than
// its tile width (d80 in 128-wide tiles, say) has a 4-D map (columns, rows, heads, batch) over its
// real columns, loaded one 64-column slab per box (SLAB_MAPS_QK, SLAB_MAPS_V): the columns past
// the map's extent land as zeros, which add nothing to Q·Kᵀ and give O zero columns, and the
// stores clip them (the TMA store by the O map's extent, the plain store by p.head_dim_v). A
// tensor as wide as its tiles keeps the 5-D map and one box per tile. The products run over the
// real columns only: Q·Kᵀ over QK_DIM (the head dim rounded up to the k16 step; the zero-filled
// rest of a step adds nothing) and P·V with N = O_DIM (V's head dim), so that O's accumulator
// holds exactly the columns that are stored: a padded d80 costs its own products, not d128's.

// FP8 (e4m3 Q, K, V; `docs/attention.md`, "FP8 (e4m3) inputs"): the same kernel on bytes. A slab
// is 128 e4m3 columns, a k step 32 of them (the same 32 bytes as a 16-bit k16 step), so Q·Kᵀ
// keeps its layout and descriptors. The hardware takes 8-bit operands K-major only, so P·V reads
// Vᵀ: (HEAD_DIM_V rows, BLOCK_N keys) in slabs of 128 keys, loaded from the Vᵀ buffer that the
// module's Vᵀ pass (`vt_fp8.cu`) writes before the launch. P goes into the A operand as e4m3
// bytes scaled by 2^8 (P̃ = 2^8 · exp(s − m) ≤ 256 < 448, so the largest weights keep e4m3's
// full precision); the row sums add the unrounded P̃, and the epilogue divides the 2^8 out of
// the LSE. The k32 A operand wants bytes of consecutive keys where the S accumulator holds pairs
// 8 columns apart: instead of moving P's bytes between threads, the Vᵀ pass stores each 32-key
// group's columns in the order the registers hold them (`pack_p`, `vt_fp8.cu`), and the product
// over keys does not depend on their order. The descales of the tile's (sequence, KV head) fold
// into the score scale and O's epilogue scale (`fp8_params`). Each sequence's Vᵀ columns are
// padded with zeros to whole key blocks, so no block holds another sequence's V (no foreign rows).
constexpr int WG_THREADS = 128;
constexpr int NUM_THREADS = WG_THREADS * (1 + CONSUMER_WGS);
constexpr int ELEM_BYTES = FP8 ? 1 : 2;
constexpr int SLAB_ELEMS = 128 / ELEM_BYTES;        // one 128-byte swizzle row
constexpr int SLAB_ROW_BYTES = 128;
constexpr int KSTEP_ELEMS = 32 / ELEM_BYTES;        // the k of a wgmma: 16 (16-bit) or 32 (e4m3)
constexpr int SLABS = HEAD_DIM / SLAB_ELEMS;        // of a Q or K tile
constexpr int SLABS_V = HEAD_DIM_V / SLAB_ELEMS;    // of a V or O tile
constexpr int Q_BYTES = BLOCK_M * HEAD_DIM * ELEM_BYTES;    // (BLOCK_M, HEAD_DIM)
constexpr int K_BYTES = BLOCK_N * HEAD_DIM * ELEM_BYTES;    // (BLOCK_N, HEAD_DIM)
constexpr int V_BYTES = BLOCK_N * HEAD_DIM_V * ELEM_BYTES;  // (BLOCK_N, HEAD_DIM_V); FP8: Vᵀ
constexpr int VT_SLAB_BYTES = HEAD_DIM_V * SLAB_ROW_BYTES;  // FP8: one 128-key slab of Vᵀ
constexpr int VT_LOAD_BYTES = BLOCK_N * O_DIM;              // FP8: the Vᵀ rows a block loads
constexpr float FP8_P_EXP2 = 8.0f;                          // FP8: P̃ = 2^8 · P
constexpr int NUM_BARRIERS = 2 * Q_STAGES + 5 * STAGES;  // v_tail is allocated whether used or not
constexpr int TILE_ALIGN = 1024;
constexpr int SLOT_BYTES = 16;                     // a Q slot's tile (DYNAMIC): m0, head, batch (−1: the end)
constexpr int SMEM_BYTES = Q_STAGES * Q_BYTES + STAGES * (K_BYTES + V_BYTES) + 8 * NUM_BARRIERS +
                           (DYNAMIC ? SLOT_BYTES * (Q_STAGES + 1) : 0) + TILE_ALIGN;  // the slots, the producer's cursor
constexpr int S_REGS = BLOCK_N / 2;                 // f32 S accumulator per thread, (64, BLOCK_N) per warpgroup
constexpr int O_REGS = O_DIM / 2;                   // f32 O accumulator per thread, (64, O_DIM)
constexpr int P_REGS = BLOCK_N * ELEM_BYTES / 8;    // packed P per thread: 16-bit pairs, or e4m3 quads
constexpr int SBO_BYTES = 8 * SLAB_ROW_BYTES;       // 8-row core-matrix groups of a swizzle atom
constexpr int KSTEP_K_MAJOR_BYTES = 32;             // k16 step inside a 128-byte swizzle row
constexpr int KSTEP_V_BYTES = 16 * SLAB_ROW_BYTES;  // k16 step over 16 key rows of V

static_assert(BLOCK_M == 64 * CONSUMER_WGS, "a consumer warpgroup owns 64 query rows (the M of wgmma)");
static_assert(FIRST_CONSUMER_WARP == WG_THREADS / 32, "warpgroup 0 produces, the others consume");
static_assert(SLABS * SLAB_ELEMS == HEAD_DIM && (FP8 ? HEAD_DIM_V % 8 == 0 : SLABS_V * SLAB_ELEMS == HEAD_DIM_V),
              "tile widths are whole 128-byte slabs (FP8: Vᵀ's rows, whole 8-row core matrices)");
static_assert(HEAD_DIM_V <= HEAD_DIM, "O is staged in the Q slot for the TMA store, and the exact path's columns");
static_assert(QK_DIM % KSTEP_ELEMS == 0 && QK_DIM <= HEAD_DIM && O_DIM % 8 == 0 && O_DIM <= HEAD_DIM_V,
              "Q·Kᵀ runs over whole k steps of the tile, P·V over O's columns");
static_assert(!FP8 || (BLOCK_N % SLAB_ELEMS == 0 && !TMA_STORE && !CROSS_TILE && !LAZY_RESCALE),
              "FP8: key blocks of whole Vᵀ slabs, O stored plainly, P̃ ≤ 256 (exact row max)");
static_assert(BLOCK_N % 16 == 0 && BLOCK_N <= 256, "BLOCK_N is a wgmma N and a multiple of k16");
static_assert(Q_BYTES % TILE_ALIGN == 0 && K_BYTES % TILE_ALIGN == 0 && V_BYTES % TILE_ALIGN == 0,
              "tiles keep 1024-byte alignment");
static_assert(SMEM_BYTES == FA4_SMEM_BYTES, "the planner's shared-memory count must match");
static_assert(STAGES >= 2, "the K/V ring needs at least two stages");
static_assert(Q_STAGES == 1 || Q_STAGES == 2, "one or two Q slots");
static_assert(SMEM_BYTES <= (1 << 18), "UNIFORM_DESC: desc_plus never carries below 256 KiB");

// ---------------------------------------------------------------------------------------------
// Accumulator layout of wgmma m64nN (f32): thread t of the warpgroup (warp w = t / 32, lane l)
// holds register i at row 16w + l/4 + 8·slot(i) and column 8·(i/4) + 2·(l%4) + (i%2): per warp
// the mma.sync m16n8 layout, repeated every 8 columns. The S accumulator packs pairwise into
// the A-register operand of the next wgmma without any exchange between threads.

__device__ __forceinline__ int acc_slot(int i) { return (i >> 1) & 1; }
__device__ __forceinline__ int acc_col(int i, int lane) { return 8 * (i >> 2) + 2 * (lane % 4) + (i & 1); }

// A role's place in the K/V ring (the j-th key block it visits) and in the Q slots (the k-th tile).
using KvState = PipeState<STAGES>;
using QState = PipeState<Q_STAGES>;

// The tiles and pipelines in shared memory.
struct Smem {
    u32 q, k, v;                // tiles: Q_STAGES × (BLOCK_M, HEAD_DIM), STAGES × (BLOCK_N, HEAD_DIM(_V))
    // The barriers, by edge (the table at the top), in their shared-memory order.
    Barriers load_q, release_q, load_k, load_v, release_k, release_v, load_v_tail;
    u32 slots;                  // DYNAMIC: Q slot t's tile at slots + SLOT_BYTES · t (written before its Q load)
    __device__ Pipeline<Q_STAGES> pipe_q() const { return {load_q, release_q}; }
    __device__ Pipeline<STAGES> pipe_k() const { return {load_k, release_k}; }
    __device__ Pipeline<STAGES> pipe_v() const { return {load_v, release_v}; }
    __device__ u32 q_slot(int t) const { return q + t * Q_BYTES; }
    __device__ u32 k_stage(int s) const { return k + s * K_BYTES; }
    __device__ u32 v_stage(int s) const { return v + s * V_BYTES; }
    __device__ u32 slot(int t) const { return slots + t * SLOT_BYTES; }
};

// DYNAMIC: the slot words' readers (every consumer thread; VARLEN: warp 1 too) arrive on
// SLOT_FREE<t> once they have read Q slot t's words, and the producer's thread 0 (its warp's
// other lanes have exited) waits there before it writes them again, and once more per slot at
// the end, so that every generation completes. The release_q mbarrier already orders the same
// reads before the rewrite, but compute-sanitizer's racecheck does not follow mbarriers for
// ordinary shared-memory accesses (it reported each rewrite as a WAR hazard, H100, 2026-12-06);
// the named barrier is an ordering it follows, as the backward's STATS_FREE barriers are.
constexpr int SLOT_READERS = WG_THREADS * CONSUMER_WGS + (VARLEN ? 32 : 0);
constexpr int SLOT_SYNC_THREADS = 32 + SLOT_READERS;  // the producer's warp counts whole
__device__ __forceinline__ void slot_free_arrive(int t) {
    if (t == 0)
        named_bar_arrive<BAR_SLOT_FREE0, SLOT_SYNC_THREADS>();
    else
        named_bar_arrive<BAR_SLOT_FREE1, SLOT_SYNC_THREADS>();
}
__device__ __forceinline__ void slot_free_wait(int t) {
    if (t == 0)
        named_bar_sync_lone<BAR_SLOT_FREE0, SLOT_SYNC_THREADS>();
    else
        named_bar_sync_lone<BAR_SLOT_FREE1, SLOT_SYNC_THREADS>();
}

// DYNAMIC: the tile of the kq-th Q slot use, waited for (the producer writes the slot before the
// arrival that starts the Q load, whose completion the wait acquires), or false at the
// producer's end mark.
__device__ __forceinline__ bool slot_tile(const FwdParams& p, const Smem& sm, int kq, Tile& w) {
    const QState qs = QState::at(kq);
    sm.pipe_q().wait(qs);
    const u32 a = sm.slot(qs.stage);
    const int batch = static_cast<int>(ld_shared_b32(a + 8));
    const int m0 = static_cast<int>(ld_shared_b32(a)), head = static_cast<int>(ld_shared_b32(a + 4));
    slot_free_arrive(qs.stage);
    if (batch < 0) return false;
    w = tile_of(p, m0, head, batch);
    return true;
}

// ---------------------------------------------------------------------------------------------
// Producer: one thread loads, tile after tile, Q and then K and V of every key block into the
// ring (whose position runs on across tiles).

// FP8: the first Vᵀ column of sequence `batch` (`params.cuh`).
__device__ __forceinline__ int vt_start(const Sm90Params& P, int batch) {
    return VARLEN ? P.cu_vt[batch] : batch * P.vt_seq_keys;
}

// One tile's loads: Q into Q slot use kq (DYNAMIC: its tile into the slot's words first), then K
// and V of each key block from ring position j on (j moves past them).
__device__ __forceinline__ void load_tile(const Sm90Params& P, const Smem& sm, const Tile& w, int kq, int& j) {
    const FwdParams& p = P.p;
    const int kv_head = w.head / p.group;
    const QState qs = QState::at(kq);
    sm.pipe_q().acquire(qs);  // the slot's last Q is consumed
    if constexpr (DYNAMIC) {
        if (kq >= Q_STAGES) slot_free_wait(qs.stage);  // its last words are read
        const u32 a = sm.slot(qs.stage);
        st_shared_b32(a, static_cast<u32>(w.m0));
        st_shared_b32(a + 4, static_cast<u32>(w.head));
        st_shared_b32(a + 8, static_cast<u32>(w.batch));
    }
    sm.pipe_q().expect(qs, Q_BYTES);
    tma_load_tile<SLAB_MAPS_QK, SLABS, SLAB_ELEMS>(sm.q_slot(qs.stage), &P.tq, sm.load_q[qs.stage], BLOCK_M,
                                                   w.s.q_start + w.m0, w.head, w.bi);
    for (int n = w.kb.n_begin; n < w.kb.n_end; ++n, ++j) {
        const KvState r = KvState::at(j);
        const int row = w.s.k_start + n * BLOCK_N;
        sm.pipe_k().acquire(r);
        sm.pipe_k().expect(r, K_BYTES);
        tma_load_tile<SLAB_MAPS_QK, SLABS, SLAB_ELEMS>(sm.k_stage(r.stage), &P.tk, sm.load_k[r.stage], BLOCK_N, row,
                                                       kv_head, w.bi);
        sm.pipe_v().acquire(r);
        if constexpr (FP8) {
            // Vᵀ: one box of (128 keys, O_DIM rows) per slab.
            const int col = vt_start(P, w.batch) + n * BLOCK_N;
            const u32 v_bar = sm.load_v[r.stage];
            mbar_expect_tx(v_bar, VT_LOAD_BYTES);
#pragma unroll
            for (int slab = 0; slab < BLOCK_N / SLAB_ELEMS; ++slab)
                tma_load_3d(sm.v_stage(r.stage) + slab * VT_SLAB_BYTES, &P.tv, v_bar, col + slab * SLAB_ELEMS, 0,
                            kv_head);
        } else {
            // A block with foreign rows lands on load_v_tail; warp 1 completes its load_v.
            const u32 v_bar = (foreign_rows(w.s, n) ? sm.load_v_tail : sm.load_v)[r.stage];
            mbar_expect_tx(v_bar, V_BYTES);
            tma_load_tile<SLAB_MAPS_V, SLABS_V, SLAB_ELEMS>(sm.v_stage(r.stage), &P.tv, v_bar, BLOCK_N, row, kv_head,
                                                            w.bi);
        }
    }
}

__device__ __forceinline__ void producer(const Sm90Params& P, const Smem& sm) {
    const FwdParams& p = P.p;
    prefetch_tensormap(&P.tq);
    prefetch_tensormap(&P.tk);
    prefetch_tensormap(&P.tv);
    int j = 0;   // key blocks loaded so far
    int kq = 0;  // tiles loaded so far (VARLEN skips empty ones)
    if constexpr (DYNAMIC) {
        // The planner launches at most P.tiles CTAs; each ends with the end mark in its next slot.
        // VARLEN: the cursor waits in shared memory while the tile's loads go out (in registers
        // beside them, the 32-register producer at d64 spilled 44 bytes).
        const u32 cur_at = sm.slot(Q_STAGES);
        const auto put = [&](const SeqCursor& c) {
            st_shared_b32(cur_at, static_cast<u32>(c.b));
            st_shared_b32(cur_at + 4, static_cast<u32>(c.first));
            st_shared_b32(cur_at + 8, static_cast<u32>(c.blocks));
        };
        if constexpr (VARLEN) put(first_cursor(p));
        for (int t = blockIdx.x; t >= 0; t = static_cast<int>(gridDim.x) < P.tiles ? claim_tile(P.tiles) : -1) {
            SeqCursor cur{};
            if constexpr (VARLEN) {
                cur = SeqCursor{static_cast<int>(ld_shared_b32(cur_at)), static_cast<int>(ld_shared_b32(cur_at + 4)),
                                static_cast<int>(ld_shared_b32(cur_at + 8))};
            }
            const Tile w = dynamic_tile_at(p, t, cur);
            if constexpr (VARLEN) put(cur);
            load_tile(P, sm, w, kq++, j);
        }
        const QState qs = QState::at(kq);
        sm.pipe_q().acquire(qs);
        if (kq >= Q_STAGES) slot_free_wait(qs.stage);
        st_shared_b32(sm.slot(qs.stage) + 8, ~0u);
        mbar_arrive(sm.load_q[qs.stage]);
        // Every slot was written (CTA b has tile b; the end mark follows it): the last words'
        // generation of each completes once they are read.
        for (int t = 0; t < Q_STAGES; ++t) slot_free_wait(t);
        return;
    }
    const int total = num_tiles(p);
    for (int k = 0;; ++k) {
        const int t = tile_number(k, total);
        if (t < 0) break;
        const Tile w = tile_at(p, t);
        if (w.empty) continue;
        load_tile(P, sm, w, VARLEN ? kq++ : k, j);
    }
}

// VARLEN, producer warp 1: walks the same tiles and key blocks as the producer; for each block
// with rows of the next sequence, waits for its V (v_tail), zeroes those rows (whole 128-byte
// swizzle rows of every slab, so the swizzle does not matter), makes the writes visible to
// wgmma (the async proxy) and completes the block's load_v.
// One tile's blocks with foreign rows: each waited for on load_v_tail, its foreign rows zeroed,
// its load_v completed. `j`: the ring position of the tile's first key block (moves past them).
// FP8 has no foreign rows (`foreign_rows`): nothing to do (HAS_FOREIGN = !FP8; a template, so
// that the discarded body is not compiled).
template <bool HAS_FOREIGN>
__device__ __forceinline__ void zero_tile_v_rows(const Smem& sm, const Tile& w, int lane, int& j, u32& tail_phase) {
    if constexpr (HAS_FOREIGN) {
        for (int n = w.kb.n_begin; n < w.kb.n_end; ++n, ++j) {
            if (!foreign_rows(w.s, n)) continue;
            const KvState r = KvState::at(j);
            mbar_wait(sm.load_v_tail[r.stage], (tail_phase >> r.stage) & 1);
            tail_phase ^= 1u << r.stage;
            const int valid = w.s.k_len - n * BLOCK_N;  // ≥ 1: the block holds an allowed key
            const int chunks = (BLOCK_N - valid) * (SLAB_ROW_BYTES / 16);
            for (int slab = 0; slab < SLABS_V; ++slab) {
                const u32 base = sm.v_stage(r.stage) + slab * (BLOCK_N * SLAB_ROW_BYTES) + valid * SLAB_ROW_BYTES;
                for (int c = lane; c < chunks; c += 32) st_shared_zero16(base + 16 * c);
            }
            fence_proxy_async();
            __syncwarp();
            if (lane == 0) mbar_arrive(sm.load_v[r.stage]);
        }
    }
}

__device__ __forceinline__ void zero_foreign_v_rows(const Sm90Params& P, const Smem& sm, int lane) {
    const FwdParams& p = P.p;
    int j = 0;
    u32 tail_phase = 0;  // bit s: phase of load_v_tail[s] (only some blocks use it: no PipeState)
    if constexpr (DYNAMIC) {
        Tile w;
        // The tile from its slot, which this warp releases too (one more arrival).
        for (int kq = 0; slot_tile(p, sm, kq, w); ++kq) {
            sm.pipe_q().release(QState::at(kq), lane);
            zero_tile_v_rows<!FP8>(sm, w, lane, j, tail_phase);
        }
        return;
    }
    const int total = num_tiles(p);
    for (int k = 0;; ++k) {
        const int t = tile_number(k, total);
        if (t < 0) break;
        const Tile w = tile_at(p, t);
        if (w.empty) continue;
        zero_tile_v_rows<!FP8>(sm, w, lane, j, tail_phase);
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

// The prelude's named barriers BAR_CONSUMER0_TURN and BAR_CONSUMER1_TURN (BAR_SYNC_ALL is
// __syncthreads): consumer warpgroup c waits on its own and passes the turn by arriving on the
// other's. Warpgroup 1 opens with one pass, so warpgroup 0 issues first; both take the same
// number of turns per tile, so the turn carries over from tile to tile, and the opening arrival
// is left pending on warpgroup 0's barrier when the CTA ends.
__device__ __forceinline__ void sched_wait(int c) {
    if constexpr (PINGPONG && CONSUMER_WGS == 2) {
        if (c == 0)
            named_bar_sync<BAR_CONSUMER0_TURN, 2 * WG_THREADS>();
        else
            named_bar_sync<BAR_CONSUMER1_TURN, 2 * WG_THREADS>();
    }
}
__device__ __forceinline__ void sched_pass(int c) {
    if constexpr (PINGPONG && CONSUMER_WGS == 2) {
        if (c == 0)
            named_bar_arrive<BAR_CONSUMER1_TURN, 2 * WG_THREADS>();
        else
            named_bar_arrive<BAR_CONSUMER0_TURN, 2 * WG_THREADS>();
    }
}

// Issues S = Q·Kᵀ for the K tile at `k_base` (one commit group). UNIFORM_DESC: each operand's
// descriptor built once and advanced per k16 step (`desc_plus`), else rebuilt per step.
__device__ __forceinline__ void issue_qk(float (&rS)[S_REGS], u32 q_base, u32 k_base) {
    const u64 q_desc = smem_desc(q_base, 16, SBO_BYTES), k_desc = smem_desc(k_base, 16, SBO_BYTES);
#pragma unroll
    for (int kk = 0; kk < QK_DIM / KSTEP_ELEMS; ++kk) {
        const u32 a = (kk / 4) * (BLOCK_M * SLAB_ROW_BYTES) + (kk % 4) * KSTEP_K_MAJOR_BYTES;
        const u32 b = (kk / 4) * (BLOCK_N * SLAB_ROW_BYTES) + (kk % 4) * KSTEP_K_MAJOR_BYTES;
        if constexpr (UNIFORM_DESC)
            wgmma_ss(rS, desc_plus(q_desc, a), desc_plus(k_desc, b), kk > 0 ? 1 : 0);
        else
            wgmma_ss(rS, smem_desc(q_base + a, 16, SBO_BYTES), smem_desc(k_base + b, 16, SBO_BYTES), kk > 0 ? 1 : 0);
    }
    wgmma_commit();
}

// Issues O += P·V for the V tile at `v_base` (one commit group). V (BLOCK_N keys, HEAD_DIM_V) is
// MN-major for this product; its 64-column slabs are BLOCK_N rows apart (the leading offset).
// `fresh` (CROSS_TILE only): O = P·V, the old O not read (the tile's first P·V).
__device__ __forceinline__ void issue_pv(float (&rO)[O_REGS], const u32 (&rP)[P_REGS], u32 v_base,
                                         bool fresh = false) {
    if constexpr (FP8) {
        // Vᵀ (O_DIM rows, BLOCK_N keys) is K-major like K in Q·Kᵀ: k32 steps of 32 bytes inside
        // a 128-byte swizzle row, slabs of 128 keys VT_SLAB_BYTES apart.
        const u64 vt_desc = smem_desc(v_base, 16, SBO_BYTES);
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / KSTEP_ELEMS; ++kk) {
            const u32 off = (kk / 4) * VT_SLAB_BYTES + (kk % 4) * KSTEP_K_MAJOR_BYTES;
            const u64 desc = UNIFORM_DESC ? desc_plus(vt_desc, off) : smem_desc(v_base + off, 16, SBO_BYTES);
            if constexpr (CROSS_TILE)
                wgmma_rs_acc(rO, rP[4 * kk], rP[4 * kk + 1], rP[4 * kk + 2], rP[4 * kk + 3], desc, kk > 0 || !fresh);
            else
                wgmma_rs(rO, rP[4 * kk], rP[4 * kk + 1], rP[4 * kk + 2], rP[4 * kk + 3], desc);
        }
        wgmma_commit();
        return;
    }
    const u64 v_desc = smem_desc(v_base, BLOCK_N * SLAB_ROW_BYTES, SBO_BYTES);
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
        const u64 desc = UNIFORM_DESC ? desc_plus(v_desc, kk * KSTEP_V_BYTES)
                                      : smem_desc(v_base + kk * KSTEP_V_BYTES, BLOCK_N * SLAB_ROW_BYTES, SBO_BYTES);
        if constexpr (CROSS_TILE)
            wgmma_rs_acc(rO, rP[4 * kk], rP[4 * kk + 1], rP[4 * kk + 2], rP[4 * kk + 3], desc, kk > 0 || !fresh);
        else
            wgmma_rs(rO, rP[4 * kk], rP[4 * kk + 1], rP[4 * kk + 2], rP[4 * kk + 3], desc);
    }
    wgmma_commit();
}

// Exponential of accumulator register i: POLY_EXP2 of every 8 on the FMA units, the rest on MUFU.
__device__ __forceinline__ float exp2_mixed(int i, float x) {
    if (POLY_EXP2 > 0 && i % 8 < POLY_EXP2) return exp2_poly(x);
    return exp2_approx(x);
}

// Softcap, masks and the online softmax of key block n on S (in place: S becomes P in f32).
// Returns each row's O correction factor.
__device__ __forceinline__ void softmax_block(const FwdParams& p, const Seq& s, float (&rS)[S_REGS], RowState& st, int n,
                                              int row0, int lane, const KeyBlocks& kb, float (&corr)[2]) {
    // FP8 takes a scale ≤ 0 too: with a negative one the scores are negated here (the scale's
    // magnitude is in scale_log2), where the 16-bit kernels negate Q.
    if constexpr (FP8) {
        if (p.negate_q) {
#pragma unroll
            for (int i = 0; i < S_REGS; ++i) rS[i] = -rS[i];
        }
    }
    if constexpr (HAS_SOFTCAP) {
#pragma unroll
        for (int i = 0; i < S_REGS; ++i) rS[i] = p.softcap * tanh_accurate(rS[i] * p.softcap_scale);
    }
    // Mask: only blocks that cross a row's key bounds (or the end of the keys).
    const int key0 = n * BLOCK_N;
    if (kb.masked(n)) {
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
        const float shift = update_row_max(st.max[h], quad_max(mx), p.scale_log2, corr[h]);
        const float p_shift = FP8 ? shift - FP8_P_EXP2 : shift;  // FP8: P̃ = 2^8 · P
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < S_REGS; ++i)
            if (acc_slot(i) == h) {
                rS[i] = exp2_mixed(i, score_exponent(rS[i], p.scale_log2, p_shift));
                sum += rS[i];
            }
        st.sum[h] = st.sum[h] * corr[h] + sum;
    }
}

// P in the A-register layout: k step kk takes S registers 8kk .. 8kk + 7, pairwise. FP8: k step
// kk (32 keys) takes S registers 16kk .. 16kk + 15, which hold, for this thread's rows r and
// r + 8, keys 2c, 2c + 1, 8 + 2c, 9 + 2c, 16 + 2c, … (c = lane % 4; `acc_col`); the A operand's
// register a0 is row r's bytes at k = 4c .. 4c + 3, a1 row r + 8's, a2 and a3 the same at
// k = 16 + 4c … So register a0 carries keys (2c, 2c + 1, 8 + 2c, 9 + 2c) at k = 4c .. 4c + 3, and
// Vᵀ holds key 16h + 8(j / 2) + 2c + j % 2 at column k = 16h + 4c + j (`vt_fp8.cu`, `vt_key`).
__device__ __forceinline__ void pack_p(const float (&rS)[S_REGS], u32 (&rP)[P_REGS]) {
    if constexpr (FP8) {
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 32; ++kk) {
            const float* x = rS + 16 * kk;
            rP[4 * kk + 0] = pack_e4m3x4(x[0], x[1], x[4], x[5]);
            rP[4 * kk + 1] = pack_e4m3x4(x[2], x[3], x[6], x[7]);
            rP[4 * kk + 2] = pack_e4m3x4(x[8], x[9], x[12], x[13]);
            rP[4 * kk + 3] = pack_e4m3x4(x[10], x[11], x[14], x[15]);
        }
    } else {
#pragma unroll
        for (int j = 0; j < P_REGS; ++j) rP[j] = pack2(rS[2 * j], rS[2 * j + 1]);
    }
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
__device__ __forceinline__ void qk_block(float (&rS)[S_REGS], const Smem& sm, KvState r, u32 q_base, int c, int lane) {
    zero(rS, S_REGS);
    sm.pipe_k().wait(r);
    sched_wait(c);
    wgmma_fence();
    issue_qk(rS, q_base, sm.k_stage(r.stage));
    sched_pass(c);
    wgmma_wait<0>();
    sm.pipe_k().release(r, lane);
}

// Key blocks n_begin + 1 .. n_end of a tile with the intra-warpgroup overlap (block n_begin's S
// is already P in rP, its correction in corr): block n's Q·Kᵀ is issued with block n − 1's P·V.
// Ring position j is block n_begin's.
// `fresh` (CROSS_TILE): O holds another tile's values, which the first P·V replaces.
__device__ __forceinline__ void overlap_blocks(const FwdParams& p, const Smem& sm, const Tile& w, int j, u32 q_base,
                                               int c, int row0, int lane, float (&rO)[O_REGS], float (&rS)[S_REGS],
                                               u32 (&rP)[P_REGS], RowState& st, float (&corr)[2],
                                               bool fresh = false) {
    const int n_begin = w.kb.n_begin, n_end = w.kb.n_end;
    for (int n = n_begin + 1; n < n_end; ++n) {
        const KvState r = KvState::at(j + n - n_begin), prev = KvState::at(j + n - n_begin - 1);
        zero(rS, S_REGS);
        sm.pipe_k().wait(r);
        sm.pipe_v().wait(prev);
        sched_wait(c);
        wgmma_fence();
        issue_qk(rS, q_base, sm.k_stage(r.stage));  // block n's S …
        rescale_o(rO, corr);                        // (block n - 1's correction, while Q·Kᵀ runs)
        wgmma_fence();
        issue_pv(rO, rP, sm.v_stage(prev.stage), fresh && n == n_begin + 1);  // … and block n - 1's P·V
        sched_pass(c);
        wgmma_wait<1>();  // S is in
        sm.pipe_k().release(r, lane);
        softmax_block(p, w.s, rS, st, n, row0, lane, w.kb, corr);
        // Wait for the next K here, before the P·V wait: this branch ends the basic block,
        // which keeps ptxas from hoisting the wgmma wait above the softmax (it does so
        // otherwise, and nothing would overlap).
        if (n + 1 < n_end) {
            sm.pipe_k().wait(KvState::at(j + n + 1 - n_begin));
        }
        wgmma_wait<0>();  // P·V of block n - 1 is in: its V is free, O and P may change
        sm.pipe_v().release(prev, lane);
        pack_p(rS, rP);
    }
}

// The last key block's P·V (ring position `last`), alone (`fresh`: as in overlap_blocks).
__device__ __forceinline__ void last_pv(const Smem& sm, KvState last, int lane, float (&rO)[O_REGS],
                                        const u32 (&rP)[P_REGS], const float (&corr)[2], bool fresh = false) {
    sm.pipe_v().wait(last);
    rescale_o(rO, corr);
    wgmma_fence();
    issue_pv(rO, rP, sm.v_stage(last.stage), fresh);
    wgmma_wait<0>();
    sm.pipe_v().release(last, lane);
}

// The TMA-store epilogue writes O through the tile's Q slot. A varlen batch's packed O has one
// map, whose bounds would not clip a block's rows of the next sequence: there only blocks of 64
// rows that end inside their sequence take it, and a sequence's last, partial block is stored
// plainly from registers (`epilogue`).
constexpr bool O_VIA_TMA = TMA_STORE;
static_assert(!CROSS_TILE || INTRA_WG_OVERLAP, "the cross-tile overlap runs on the intra-warpgroup overlap's loop");
static_assert(!(CROSS_TILE && O_VIA_TMA) || Q_STAGES == 2,
              "with the cross-tile overlap the next tile's Q loads while this tile's O sits in its Q slot");

// Consumer warpgroup c's 128 threads, before its TMA store (EPILOGUE<c>).
__device__ __forceinline__ void epilogue_sync(int c) {
    if (c == 0)
        named_bar_sync<BAR_EPILOGUE0, WG_THREADS>();
    else if (c == 1)
        named_bar_sync<BAR_EPILOGUE1, WG_THREADS>();
    else
        named_bar_sync<BAR_EPILOGUE2, WG_THREADS>();
}

// Epilogue: O = acc / sum; LSE from one lane per row. O goes out as 16-bit pairs straight from
// registers, or (O_VIA_TMA) through this warpgroup's rows of the tile's Q slot: each thread
// writes its pairs where a TMA box would put them (128-byte swizzle: 16-byte chunk c of row r at
// c ^ (r % 8); the warpgroup's rows start 1024-aligned), the writes are fenced to the async
// proxy, and thread 0 stores the SLABS_V boxes of (64 rows, 64) and releases Q for its warp once
// the store has read them; the other warps release Q after the warpgroup's barrier, so Q's slot
// is free only when all have. The sequence's offsets are read again here rather than kept in
// registers through the loop. A row the fast path may have got wrong is stored as NaN, and a NaN
// stored in a valid row raises the flag of the fixup kernel (common/exact.cuh).
// `p`: the launch's params, or (FP8) the tile's with its descales folded in (`fp8_params`), and
// `v_descale` O's factor (1 unless FP8).
__device__ __forceinline__ void epilogue(const Sm90Params& P, const FwdParams& p, float v_descale, const Smem& sm,
                                         int c, const Tile& w, QState qs, const RowState& st,
                                         const float (&rO)[O_REGS], int row0, int lane, u32& folded) {
    const Seq s = sequence(p, w.batch, VARLEN);
    float inv[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const float sum = quad_sum(st.sum[h]);
        inv[h] = row_out_scale(st.max[h], sum, p.scale_log2);
        if constexpr (FP8) inv[h] *= v_descale;
        const int i = row0 + 8 * h;
        // FP8: the sum is of P̃ = 2^8 · P; the LSE is of P (an exact power-of-two scaling).
        if (p.lse != nullptr && lane % 4 == 0 && i < s.q_len)
            p.lse[w.bi * p.lse_batch_stride + w.head * p.lse_head_stride + s.q_start + i] =
                row_lse(st.max[h], FP8 ? sum * (1.0f / 256.0f) : sum, p.lse_scale);
    }
    // `folded`: the NaN max of this thread's stored pairs over its tiles so far (the consumer
    // raises the flag once, after its last tile: a store in the tile loop slowed the d64 causal
    // key loop). The TMA store folds rows past the sequence's end too: their O is finite unless
    // an input is not, so they can only add a fixup pass that finds nothing on non-finite inputs.
    const int first_row = w.m0 + 64 * c;  // this warpgroup's first row in the sequence
    // Uniform over the warpgroup: the TMA store, or (a varlen block past its sequence's end, or
    // no TMA store) plain stores.
    const bool via_tma = O_VIA_TMA && (!VARLEN || first_row + 64 <= s.q_len);
    if (via_tma) {
        const int tid = threadIdx.x % WG_THREADS;
        const u32 sO = sm.q_slot(qs.stage) + 64 * c * SLAB_ROW_BYTES;  // (64, HEAD_DIM_V), slabs BLOCK_M rows apart
        const int r0 = 16 * (tid / 32) + lane / 4;                     // this thread's first row of the 64
#pragma unroll
        for (int i = 0; i < O_REGS; i += 2) {
            const int r = r0 + 8 * acc_slot(i), col = acc_col(i, lane);
            const int slab = col / SLAB_ELEMS, chunk = (col % SLAB_ELEMS) / 8;
            const u32 addr = sO + slab * (BLOCK_M * SLAB_ROW_BYTES) + r * SLAB_ROW_BYTES + ((chunk ^ (r % 8)) * 16) +
                             (col % 8) * 2;
            const u32 v = pack2(rO[i] * inv[acc_slot(i)], rO[i + 1] * inv[acc_slot(i)]);
            folded = nan_max2(folded, v);  // rows past q_len too: finite for finite inputs
            st_shared_b32(addr, v);
        }
        fence_proxy_async();
        epilogue_sync(c);
        if (tid == 0 && first_row < s.q_len) {
#pragma unroll
            for (int slab = 0; slab < SLABS_V; ++slab) {
                const u32 src = sO + slab * (BLOCK_M * SLAB_ROW_BYTES);
                if constexpr (SLAB_MAPS_V)
                    tma_store_4d(&P.to, src, slab * SLAB_ELEMS, s.q_start + first_row, w.head, w.bi);
                else
                    tma_store_5d(&P.to, src, 0, s.q_start + first_row, slab, w.head, w.bi);
            }
            bulk_commit();
            bulk_wait_read<0>();
        }
        sm.pipe_q().release(qs, lane);
    } else {
        u16* gO = static_cast<u16*>(p.o) + w.bi * p.o_batch_stride + s.q_start * p.o_row_stride +
                  w.head * p.o_head_stride;
#pragma unroll
        for (int i = 0; i < O_REGS; i += 2) {
            const int h = acc_slot(i), row = row0 + 8 * h, col = acc_col(i, lane);
            // Columns come in pairs and head dims are multiples of 8: a pair is in or out.
            if (row < s.q_len && (!SLAB_MAPS_V || col < p.head_dim_v)) {
                const u32 v = pack2(rO[i] * inv[h], rO[i + 1] * inv[h]);
                folded = nan_max2(folded, v);
                st_global_b32(gO + row * p.o_row_stride + col, v);
            }
        }
        // With the TMA store compiled in, the key loop left Q to the epilogue to release.
        if constexpr (O_VIA_TMA) sm.pipe_q().release(qs, lane);
    }
}

// One tile: the key loop from ring position j (the key blocks this consumer saw before), then
// the epilogue. Releases Q once its last Q·Kᵀ is done (O_VIA_TMA: once O has left its slot).
// FP8: the launch's params with the descales of tile `w`'s (sequence, KV head) folded into the
// score scale (`qd · kd`; with softcap into the scale inside the tanh), and O's factor `vd`.
__device__ __forceinline__ FwdParams fp8_params(const Sm90Params& P, const Tile& w, float& v_descale) {
    FwdParams p = P.p;
    const int heads_kv = p.heads_q / p.group;
    const int at = w.batch * heads_kv + w.head / p.group;
    const float qk = P.descales[at] * P.descales[P.descale_plane + at];
    v_descale = P.descales[2 * P.descale_plane + at];
    if constexpr (HAS_SOFTCAP) {
        p.softcap_scale *= qk;
    } else {
        p.scale_log2 *= qk;
        p.lse_scale *= qk;
    }
    return p;
}

__device__ __forceinline__ void consumer_tile(const Sm90Params& P, const Smem& sm, int c, const Tile& w, int j,
                                              QState qs, u32& folded) {
    float v_descale = 1.0f;
    const FwdParams pe = FP8 ? fp8_params(P, w, v_descale) : P.p;
    const FwdParams& p = pe;
    const int tid = threadIdx.x % WG_THREADS;
    const int warp = tid / 32, lane = tid % 32;
    const int row0 = w.m0 + 64 * c + 16 * warp + lane / 4;  // this thread's rows: row0 + 8·slot (in the sequence)
    const int n_begin = w.kb.n_begin, n_end = w.kb.n_end;

    float rO[O_REGS];  // (64, HEAD_DIM) per warpgroup
    zero(rO, O_REGS);
    RowState st = {{NEG_INF, NEG_INF}, {0.0f, 0.0f}};
    float rS[S_REGS];  // (64, BLOCK_N) per warpgroup
    u32 rP[P_REGS];
    float corr[2] = {1.0f, 1.0f};

    // Q of this warpgroup: slab kk / 4 of its 64 rows (see issue_qk).
    const u32 q_base = sm.q_slot(qs.stage) + 64 * c * SLAB_ROW_BYTES;
    sm.pipe_q().wait(qs);

    if constexpr (INTRA_WG_OVERLAP) {
        if (n_begin < n_end) {
            // Prologue: block n_begin's S and P.
            qk_block(rS, sm, KvState::at(j), q_base, c, lane);
            softmax_block(p, w.s, rS, st, n_begin, row0, lane, w.kb, corr);
            pack_p(rS, rP);
        }
        overlap_blocks(p, sm, w, j, q_base, c, row0, lane, rO, rS, rP, st, corr);
        if constexpr (!O_VIA_TMA) sm.pipe_q().release(qs, lane);
        if (n_begin < n_end) last_pv(sm, KvState::at(j + n_end - 1 - n_begin), lane, rO, rP, corr);
    } else {
        for (int n = n_begin; n < n_end; ++n) {
            const KvState r = KvState::at(j + n - n_begin);
            qk_block(rS, sm, r, q_base, c, lane);
            softmax_block(p, w.s, rS, st, n, row0, lane, w.kb, corr);
            rescale_o(rO, corr);
            pack_p(rS, rP);
            sm.pipe_v().wait(r);
            sched_wait(c);
            wgmma_fence();
            issue_pv(rO, rP, sm.v_stage(r.stage));
            sched_pass(c);
            wgmma_wait<0>();
            sm.pipe_v().release(r, lane);
        }
        if constexpr (!O_VIA_TMA) sm.pipe_q().release(qs, lane);
    }
    epilogue(P, pe, v_descale, sm, c, w, qs, st, rO, row0, lane, folded);
}

// The CTA's next tile with queries from walk position k on (k moves past it), or false.
__device__ __forceinline__ bool next_tile(const FwdParams& p, int total, int& k, Tile& w) {
    for (;;) {
        const int t = tile_number(k++, total);
        if (t < 0) return false;
        w = tile_at(p, t);
        if (!w.empty) return true;
    }
}

// CROSS_TILE: the consumer's walk with the intra-warpgroup overlap carried across tiles. A tile's
// last P·V is issued together with the next tile's first Q·Kᵀ, the next tile's first softmax runs
// while that P·V is in the tensor cores, and only then comes this tile's epilogue: the next
// tile's prologue (Q wait, first S) no longer waits behind this tile's tail. Both tiles must have
// key blocks (a tile without keys takes the plain tail). Live at once: this tile's O and P, the
// next one's S, and both row states (the steady loop's registers plus four).
__device__ __forceinline__ void consumer_cross_tile(const Sm90Params& P, const Smem& sm, int c) {
    const FwdParams& p = P.p;
    const int total = num_tiles(p);
    const int tid = threadIdx.x % WG_THREADS, warp = tid / 32, lane = tid % 32;
    if (c == 1) sched_pass(1);  // warpgroup 0 issues first
    int k = 0;   // walk position
    int kq = 0;  // tiles consumed so far: the Q ring position
    int j = 0;   // ring position: key blocks consumed so far
    Tile w;
    bool have = DYNAMIC ? slot_tile(p, sm, 0, w) : next_tile(p, total, k, w);
    float rO[O_REGS];  // (64, HEAD_DIM) per warpgroup
    float rS[S_REGS];  // (64, BLOCK_N) per warpgroup
    u32 rP[P_REGS];
    RowState st;
    u32 folded = 0;  // the NaN max of this thread's stored O pairs (epilogue)
    float corr[2];
    bool started = false;  // the tile's first block is already P (carried over from the last tile)
    // How O starts a tile. Up to d128 it is not zeroed between tiles (a second definition of it
    // in this loop makes ptxas spill P and serialise the wgmma pipeline, C7512 at d128 with
    // 128-key blocks): the tile's first P·V overwrites it (`fresh`), and a tile without key
    // blocks zeroes it before its epilogue. At d256 the runtime accumulate flag does the same
    // (3.7 KB of spills), and zeroing after the epilogue does not: measured with ptxas 13.0.
    constexpr bool FRESH = HEAD_DIM < 256;
    zero(rO, O_REGS);
    while (have) {
        const QState qs = QState::at(kq);
        const int row0 = w.m0 + 64 * c + 16 * warp + lane / 4;
        const u32 q_base = sm.q_slot(qs.stage) + 64 * c * SLAB_ROW_BYTES;
        const int n_blocks = w.kb.n_end - w.kb.n_begin;
        if (!started) {
            st = RowState{{NEG_INF, NEG_INF}, {0.0f, 0.0f}};
            corr[0] = corr[1] = 1.0f;
            sm.pipe_q().wait(qs);
            if (n_blocks > 0) {
                qk_block(rS, sm, KvState::at(j), q_base, c, lane);
                softmax_block(p, w.s, rS, st, w.kb.n_begin, row0, lane, w.kb, corr);
                pack_p(rS, rP);
            }
        }
        overlap_blocks(p, sm, w, j, q_base, c, row0, lane, rO, rS, rP, st, corr, FRESH);
        if constexpr (!O_VIA_TMA) sm.pipe_q().release(qs, lane);
        int k2 = k;
        Tile w2;
        const bool have2 = DYNAMIC ? slot_tile(p, sm, kq + 1, w2) : next_tile(p, total, k2, w2);
        const int j2 = j + n_blocks;  // the next tile's first key block
        started = have2 && n_blocks > 0 && w2.kb.n_begin < w2.kb.n_end;
        if (started) {
            const QState qs2 = QState::at(kq + 1);
            const u32 q_base2 = sm.q_slot(qs2.stage) + 64 * c * SLAB_ROW_BYTES;
            const int row0_2 = w2.m0 + 64 * c + 16 * warp + lane / 4;
            const KvState r2 = KvState::at(j2), last = KvState::at(j2 - 1);
            zero(rS, S_REGS);
            sm.pipe_q().wait(qs2);
            sm.pipe_k().wait(r2);
            sm.pipe_v().wait(last);
            sched_wait(c);
            wgmma_fence();
            issue_qk(rS, q_base2, sm.k_stage(r2.stage));  // the next tile's first S …
            rescale_o(rO, corr);
            wgmma_fence();
            issue_pv(rO, rP, sm.v_stage(last.stage), FRESH && n_blocks == 1);  // … and this tile's last P·V
            sched_pass(c);
            wgmma_wait<1>();  // S is in
            sm.pipe_k().release(r2, lane);
            RowState st2 = {{NEG_INF, NEG_INF}, {0.0f, 0.0f}};
            float corr2[2] = {1.0f, 1.0f};
            softmax_block(p, w2.s, rS, st2, w2.kb.n_begin, row0_2, lane, w2.kb, corr2);
            // As in overlap_blocks: a branch before the P·V wait keeps ptxas from hoisting it.
            if (w2.kb.n_begin + 1 < w2.kb.n_end) {
                sm.pipe_k().wait(KvState::at(j2 + 1));
            }
            wgmma_wait<0>();  // this tile's O is complete; its last V is free
            sm.pipe_v().release(last, lane);
            epilogue(P, P.p, 1.0f, sm, c, w, qs, st, rO, row0, lane, folded);
            pack_p(rS, rP);
            if constexpr (!FRESH) zero(rO, O_REGS);
            st = st2;
            corr[0] = corr2[0];
            corr[1] = corr2[1];
        } else {
            if (n_blocks > 0)
                last_pv(sm, KvState::at(j2 - 1), lane, rO, rP, corr, FRESH && n_blocks == 1);
            else if constexpr (FRESH)
                zero(rO, O_REGS);
            epilogue(P, P.p, 1.0f, sm, c, w, qs, st, rO, row0, lane, folded);
            if constexpr (!FRESH) zero(rO, O_REGS);
        }
        j = j2;
        ++kq;
        k = k2;
        w = w2;
        have = have2;
    }
    raise_exact_flag(folded);
}

__device__ __forceinline__ void consumer(const Sm90Params& P, const Smem& sm, int c) {
    if constexpr (CROSS_TILE) {
        consumer_cross_tile(P, sm, c);
        return;
    }
    const int total = num_tiles(P.p);
    if (c == 1) sched_pass(1);  // warpgroup 0 issues first
    int j = 0;                  // ring position: key blocks consumed so far
    int kq = 0;                 // tiles consumed so far (VARLEN skips empty ones)
    u32 folded = 0;             // the NaN max of this thread's stored O pairs (epilogue)
    for (int k = 0;; ++k) {
        Tile w;
        if constexpr (DYNAMIC) {
            if (!slot_tile(P.p, sm, kq, w)) break;
        } else {
            const int t = tile_number(k, total);
            if (t < 0) break;
            w = tile_at(P.p, t);
            if (w.empty) continue;
        }
        consumer_tile(P, sm, c, w, j, QState::at(VARLEN || DYNAMIC ? kq++ : k), folded);
        j += w.kb.n_end - w.kb.n_begin;
    }
    raise_exact_flag(folded);
}

// ---------------------------------------------------------------------------------------------
// Entry: shared-memory carve-out, barrier init, role dispatch.

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1) fa4_fwd_sm90(const __grid_constant__ Sm90Params P) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];

    Smem sm;
    sm.q = (smem_u32(smem_raw) + TILE_ALIGN - 1) & ~static_cast<u32>(TILE_ALIGN - 1);
    sm.k = sm.q + Q_STAGES * Q_BYTES;
    sm.v = sm.k + STAGES * K_BYTES;
    // Barriers after the tiles: load_q, release_q, load_k, load_v, release_k, release_v, load_v_tail.
    sm.load_q.base = sm.v + STAGES * V_BYTES;
    sm.release_q.base = sm.load_q[Q_STAGES];
    sm.load_k.base = sm.release_q[Q_STAGES];
    sm.load_v.base = sm.load_k[STAGES];
    sm.release_k.base = sm.load_v[STAGES];
    sm.release_v.base = sm.release_k[STAGES];
    sm.load_v_tail.base = sm.release_v[STAGES];
    sm.slots = sm.load_v_tail[STAGES];

    if (threadIdx.x == 0) {
        constexpr u32 consumer_warps = 4 * CONSUMER_WGS;  // one release arrival per consumer warp
        for (int t = 0; t < Q_STAGES; ++t) {
            mbar_init(sm.load_q[t], 1);
            mbar_init(sm.release_q[t], consumer_warps + (VARLEN && DYNAMIC ? 1 : 0));  // warp 1 reads the slot too
        }
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(sm.load_k[s], 1);
            mbar_init(sm.load_v[s], 1);
            mbar_init(sm.release_k[s], consumer_warps);
            mbar_init(sm.release_v[s], consumer_warps);
            if constexpr (VARLEN) mbar_init(sm.load_v_tail[s], 1);
        }
        fence_mbarrier_init();
        fence_proxy_async();
    }
    __syncthreads();

    // UNIFORM_DESC: the warp index broadcast from lane 0 (the same value), which ptxas then
    // knows to be warp-uniform, so that the consumer's addresses live in uniform registers.
    const int warp = UNIFORM_DESC ? __shfl_sync(0xffffffffu, threadIdx.x / 32, 0) : threadIdx.x / 32;
    const int wg = warp / 4;
    switch (role_of(warp)) {
    case ROLE_PRODUCER:
        setmaxnreg_dec<PRODUCER_REGS>();
        if (threadIdx.x == 0) producer(P, sm);
        if constexpr (VARLEN) {
            if (warp == 1) zero_foreign_v_rows(P, sm, threadIdx.x % 32);
        }
        break;
    case ROLE_CONSUMER:
        setmaxnreg_inc<CONSUMER_REGS>();
        consumer(P, sm, wg - FIRST_CONSUMER_WARP / 4);
        break;
    }
}
