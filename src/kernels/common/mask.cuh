// The mask of every kernel family: each query row's allowed keys, and from them a tile's key
// blocks and the blocks that need no per-element mask. Needs the prelude's HAS_WINDOW and
// BLOCK_N. `mask::key_range` and `mask::SeqMask::key_blocks` (Rust) define the same quantities;
// tests/mask_twin.rs checks that these formulas and the Rust ones agree on every mask kind.

// Allowed keys of query row i: [key_lo(i), key_hi(i)) (docs/attention.md, bottom-right aligned).
__device__ __forceinline__ int key_lo(const FwdParams& p, const Seq& s, int i) {
    if (!HAS_WINDOW || p.window_left < 0) return 0;
    return max(0, i + s.k_len - s.q_len - p.window_left);
}
__device__ __forceinline__ int key_hi(const FwdParams& p, const Seq& s, int i) {
    if (!HAS_WINDOW || p.window_right < 0) return s.k_len;
    return max(0, min(s.k_len, i + s.k_len - s.q_len + p.window_right + 1));
}

// The key blocks of query rows [first_row, last_row]: [n_begin, n_end) holds every key any of
// them may see (empty when none may see one, or when `any_rows` is false); a block inside
// [free_lo, free_hi) is allowed to every row, so it runs without per-element checks.
struct KeyBlocks {
    int n_begin, n_end;    // the trip: key blocks [n_begin, n_end)
    int free_lo, free_hi;  // a block inside [free_lo, free_hi) needs no mask
    // Whether key block n crosses some row's bounds (or the end of the keys).
    __device__ __forceinline__ bool masked(int n) const {
        const int key0 = n * BLOCK_N;
        return key0 < free_lo || key0 + BLOCK_N > free_hi;
    }
};

__device__ __forceinline__ KeyBlocks key_blocks(const FwdParams& p, const Seq& s, int first_row, int last_row,
                                                bool any_rows) {
    KeyBlocks kb;
    const int span_lo = key_lo(p, s, first_row), span_hi = key_hi(p, s, last_row);
    kb.n_begin = span_lo / BLOCK_N;
    kb.n_end = span_hi > span_lo && any_rows ? (span_hi + BLOCK_N - 1) / BLOCK_N : kb.n_begin;
    kb.free_lo = key_lo(p, s, last_row);
    kb.free_hi = key_hi(p, s, first_row);
    return kb;
}

// The backward's walk from the key side: the query rows that may see key j are
// [query_lo(j), query_hi(j)) (both ends never decrease with j, as the keys' bounds with i).
// `mask::SeqMask::query_range` and `query_blocks` (Rust) define the same quantities.
__device__ __forceinline__ int query_lo(const FwdParams& p, const Seq& s, int j) {
    if (!HAS_WINDOW || p.window_right < 0) return 0;
    return min(s.q_len, max(0, j - (s.k_len - s.q_len) - p.window_right));
}
__device__ __forceinline__ int query_hi(const FwdParams& p, const Seq& s, int j) {
    if (!HAS_WINDOW || p.window_left < 0) return s.q_len;
    return max(0, min(s.q_len, j - (s.k_len - s.q_len) + p.window_left + 1));
}

// The query blocks (of `block_m` rows) that keys [first_key, last_key] must visit:
// [m_begin, m_end), empty when no row sees any of them; a block inside [free_lo, free_hi) sees
// every one of those keys, so it runs without per-element checks.
struct QueryBlocks {
    int m_begin, m_end;    // the trip: query blocks [m_begin, m_end)
    int free_lo, free_hi;  // a block inside [free_lo, free_hi) needs no mask
    int block_m;
    __device__ __forceinline__ bool masked(int m) const {
        const int row0 = m * block_m;
        return row0 < free_lo || row0 + block_m > free_hi;
    }
};

__device__ __forceinline__ QueryBlocks query_blocks(const FwdParams& p, const Seq& s, int first_key, int last_key,
                                                    int block_m) {
    QueryBlocks qb;
    const int span_lo = query_lo(p, s, first_key), span_hi = query_hi(p, s, last_key);
    qb.block_m = block_m;
    qb.m_begin = span_lo / block_m;
    qb.m_end = span_hi > span_lo ? (span_hi + block_m - 1) / block_m : qb.m_begin;
    qb.free_lo = query_lo(p, s, last_key);
    qb.free_hi = query_hi(p, s, first_key);
    return qb;
}
