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
    // Whether key block n holds a key that some rows allow and others mask (causal, window),
    // keys past the end not counted (every kernel reads those as zeros). Its P·V multiplies
    // that key's V row by P = 0 for the rows that mask it, and 0 · NaN or 0 · inf is NaN: such
    // a block needs its V checked for non-finite values (docs/attention.md, rule 7).
    __device__ __forceinline__ bool rows_differ(int n, int k_len) const {
        const int key0 = n * BLOCK_N;
        return key0 < free_lo || min(key0 + BLOCK_N, k_len) > free_hi;
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

// ---- Non-finite values in V at keys some rows mask ----

// Bit 15 of each 16-bit half of `x` is set where that half is ±inf or NaN: its exponent bits
// all ones carry into the sign position (no carry crosses into the high half). OR these over a
// tile and test NONFINITE_BITS.
constexpr u32 NONFINITE_BITS = 0x80008000u;
__device__ __forceinline__ u32 nonfinite_halves(u32 x) {
    constexpr u32 EXP_BITS = IS_BF16 ? 0x7F807F80u : 0x7C007C00u;
    constexpr u32 EXP_LSB = IS_BF16 ? 0x00800080u : 0x04000400u;
    return (x & EXP_BITS) + EXP_LSB;
}

// The low and high 16-bit values of a packed pair, as floats.
__device__ __forceinline__ float half_lo(u32 x) {
    if constexpr (IS_BF16) return __uint_as_float(x << 16);
    float f;
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.f32.f16 %0, l; }\n" : "=f"(f) : "r"(x));
    return f;
}
__device__ __forceinline__ float half_hi(u32 x) {
    if constexpr (IS_BF16) return __uint_as_float(x & 0xffff0000u);
    float f;
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.f32.f16 %0, h; }\n" : "=f"(f) : "r"(x));
    return f;
}

// Shared-memory loads for the checks and the exact P·V path (volatile: they read data that
// cp.async, TMA or another warp wrote, after the wait that made it visible).
__device__ __forceinline__ u32 ld_shared_u32(u32 addr) {
    u32 x;
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(x) : "r"(addr) : "memory");
    return x;
}
__device__ __forceinline__ void st_shared_u32(u32 addr, u32 x) {
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(x) : "memory");
}
// OR of nonfinite_halves over the 16 bytes at `addr`.
__device__ __forceinline__ u32 ld_shared_nonfinite16(u32 addr) {
    u32 a, b, c, d;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n" : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "r"(addr) : "memory");
    return nonfinite_halves(a) | nonfinite_halves(b) | nonfinite_halves(c) | nonfinite_halves(d);
}
