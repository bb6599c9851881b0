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
