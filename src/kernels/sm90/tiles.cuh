// The Hopper kernel's tile scheduler: which query block of which (sequence, head) the k-th tile
// of a CTA is, and its key blocks. `config::sm90::schedule` (Rust) mirrors this walk, and its
// tests check that every (query block, head, sequence) is visited exactly once in this order.
// Needs the prelude's BLOCK_M, BLOCK_N and VARLEN, and `../common/{params,mask}.cuh`.

struct Tile {
    int m0, head, batch;
    int bi;                // index into the tensors' batch axis (0 when packed)
    Seq s;                 // the sequence
    bool empty;            // past the sequence's queries (VARLEN: shorter than the longest)
    KeyBlocks kb;          // its key blocks (`../common/mask.cuh`)
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
// LONGEST_FIRST: tiles are numbered query block slowest, the last query block of every
// (sequence, head) first, and CTA b runs tiles b, b + gridDim.x, …: each round of the grid takes
// tiles of one query block (causal: of one cost), from the heaviest down, so no CTA is left with
// a heavy tile while the others finish (FlashAttention-3's order). The tiles that run at once
// then share no K/V (different heads), which L2 has to absorb: measured against the pairs.
// The number of this CTA's k-th tile, or −1 when it has none. Strictly increasing in k.
__device__ __forceinline__ int tile_number(int k, int total) {
    const int g = gridDim.x, b = blockIdx.x;
    if (g >= total) return k == 0 ? b : -1;
    if constexpr (LONGEST_FIRST) {
        const int t = k * g + b;  // no overflow, as below
        return t < total ? t : -1;
    }
    // No overflow: the planner keeps total ≤ 2^30, and t stops at the first value ≥ total.
    const int t = 2 * ((k / 2) * g + b) + (k & 1);
    return t < total ? t : -1;
}

// The rest of a tile from its query block, head and sequence.
__device__ __forceinline__ Tile tile_of(const FwdParams& p, int m0, int head, int batch) {
    Tile w;
    w.m0 = m0;
    w.head = head;
    w.batch = batch;
    w.bi = VARLEN ? 0 : w.batch;
    w.s = sequence(p, w.batch, VARLEN);
    w.empty = VARLEN && w.m0 >= w.s.q_len;
    w.kb = key_blocks(p, w.s, w.m0, min(w.m0 + BLOCK_M, w.s.q_len) - 1, !w.empty);
    return w;
}

__device__ __forceinline__ Tile tile_at(const FwdParams& p, int t) {
    Tile w;
    int hb;
    if constexpr (LONGEST_FIRST) {
        const int hbs = p.heads_q * p.batch;
        hb = t % hbs;
        w.m0 = (m_blocks(p) - 1 - t / hbs) * BLOCK_M;
    } else {
        const int mb = m_blocks(p), r = t % mb;
        hb = t / mb;
        const bool paired = static_cast<int>(gridDim.x) < num_tiles(p);
        w.m0 = (paired && (r & 1) ? r / 2 : mb - 1 - (paired ? r / 2 : r)) * BLOCK_M;
    }
    w.head = hb % p.heads_q;
    w.batch = hb / p.heads_q;
    w.bi = VARLEN ? 0 : w.batch;
    w.s = sequence(p, w.batch, VARLEN);
    w.empty = VARLEN && w.m0 >= w.s.q_len;
    w.kb = key_blocks(p, w.s, w.m0, min(w.m0 + BLOCK_M, w.s.q_len) - 1, !w.empty);
    return w;
}

// Whether key block n of sequence s holds rows of the next sequence (VARLEN only: see the top).
// FP8 reads V from the Vᵀ buffer, whose sequences are padded with zero columns: none there.
__device__ __forceinline__ bool foreign_rows(const Seq& s, int n) {
    return VARLEN && !FP8 && (n + 1) * BLOCK_N > s.k_len;
}

// ---------------------------------------------------------------------------------------------
// DYNAMIC (persistent launches): CTA b starts with tile b, and its producer takes every further
// tile from the module's counter with one atomicAdd once the last tile's loads are issued, so the
// tiles go out in the order a grid of one CTA per tile would start them and a CTA whose tiles were
// light takes the next (FlashAttention-3's scheduler for causal and varlen batches). The numbers
// run over `Sm90Params::tiles` tiles: query block fastest, a (sequence, head)'s last first, or
// with LONGEST_FIRST as `tile_at` numbers them; VARLEN (whatever LONGEST_FIRST says) over each
// sequence's own query blocks only, so no number is an empty tile. The producer hands each tile to the consumers (and to warp 1) in the
// word slot beside its Q slot (`fwd.cu`). `config::sm90::schedule` mirrors the numbering and the
// counter's protocol.

// The tiles the counter has handed out past the grid's first ones. Zero when the module is
// loaded, and zero again after each launch: every CTA takes exactly one number past the last
// tile, so a launch takes `tiles` numbers in all, and the CTA that takes the last (tiles − 1)
// knows every other CTA has taken its own and resets it. The next launch on the stream (each
// backend has its own module and stream) starts at zero.
__device__ unsigned fa4_tile_counter;

// The CTA's next tile number, or −1 (DYNAMIC, fewer CTAs than tiles).
__device__ __forceinline__ int claim_tile(int tiles) {
    const int v = static_cast<int>(atomicAdd(&fa4_tile_counter, 1u));
    if (v == tiles - 1) atomicExch(&fa4_tile_counter, 0u);
    const int t = v + static_cast<int>(gridDim.x);  // no overflow: tiles ≤ 2^30
    return t < tiles ? t : -1;
}

// VARLEN, DYNAMIC: the sequence whose tiles the producer's numbers are in, tiles
// [first, first + heads · blocks). A CTA's numbers only grow, so it only moves forward.
struct SeqCursor {
    int b, first, blocks;
};

__device__ __forceinline__ int seq_q_blocks(const FwdParams& p, int b) {
    return (p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b] + BLOCK_M - 1) / BLOCK_M;
}

__device__ __forceinline__ SeqCursor first_cursor(const FwdParams& p) {
    return SeqCursor{0, 0, VARLEN ? seq_q_blocks(p, 0) : 0};
}

// Tile number t of the DYNAMIC numbering.
__device__ __forceinline__ Tile dynamic_tile_at(const FwdParams& p, int t, SeqCursor& c) {
    if constexpr (VARLEN) {
        while (t >= c.first + p.heads_q * c.blocks) {
            c.first += p.heads_q * c.blocks;
            c.blocks = seq_q_blocks(p, ++c.b);
        }
        const int r = t - c.first;
        return tile_of(p, (c.blocks - 1 - r % c.blocks) * BLOCK_M, r / c.blocks, c.b);
    }
    if constexpr (LONGEST_FIRST) return tile_at(p, t);
    const int mb = m_blocks(p), hb = t / mb;
    return tile_of(p, (mb - 1 - t % mb) * BLOCK_M, hb % p.heads_q, hb / p.heads_q);
}
