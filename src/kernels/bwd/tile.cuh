// Shared-memory tiles of the backward kernels: rows padded by one 16-byte chunk, so that the
// 8 rows of an ldmatrix (row stride an odd number of 16-byte chunks) fall in 8 different bank
// groups without a swizzle, and fragment addresses are plain row/column arithmetic.
// Needs the prelude's HEAD_DIM and NUM_WARPS, and `../sm80/ptx.cuh`.

// Every backward kernel's source includes this header; the row kernels (aux.cu) read
// CHUNK_ELEMS but none of the tile constants, which are [[maybe_unused]] so that their
// compiles log no NVRTC warning (#177) for them.
[[maybe_unused]] constexpr int NUM_THREADS = NUM_WARPS * 32;
constexpr int CHUNK_ELEMS = 8;                                   // one 16-byte cp.async / ldmatrix row
[[maybe_unused]] constexpr int CHUNKS = HEAD_DIM / CHUNK_ELEMS;  // 16-byte chunks per tile row
[[maybe_unused]] constexpr int LD = HEAD_DIM + CHUNK_ELEMS;      // padded row of a (rows, HEAD_DIM) tile, elements
static_assert(HEAD_DIM % 16 == 0, "k16 steps over the head dim");

// (ROWS, HEAD_DIM) from global rows [0, valid_rows) and columns [0, head_dim); everything else
// is zero-filled, so padding never carries NaN into an MMA.
template <int ROWS>
__device__ __forceinline__ void load_rows(u32 s_tile, const u16* g, long long row_stride, int valid_rows,
                                          int head_dim, int tid) {
#pragma unroll
    for (int i = 0; i < (ROWS * CHUNKS + NUM_THREADS - 1) / NUM_THREADS; ++i) {
        const int idx = tid + i * NUM_THREADS;
        if ((ROWS * CHUNKS) % NUM_THREADS == 0 || idx < ROWS * CHUNKS) {
            const int r = idx / CHUNKS, c = idx % CHUNKS;
            const bool ok = r < valid_rows && c * CHUNK_ELEMS < head_dim;
            cp_async_16(s_tile + static_cast<u32>((r * LD + c * CHUNK_ELEMS) * 2),
                        ok ? g + r * row_stride + c * CHUNK_ELEMS : g, ok ? 16 : 0);
        }
    }
}

// ldmatrix lane addresses (bytes from a tile's start, row stride `ld` elements) of a 16×16
// block at (r0, c0). Pattern "rows": lane l reads row r0 + l % 16 at column c0 + 8·(l / 16):
// the A operand of a row-major (m, k) tile, or with .trans the B operand of a (k, n) tile.
// Pattern "pairs": row r0 + l % 8 + 8·(l / 16) at column c0 + 8·((l / 8) % 2): the B operands
// of two n8 tiles of an (n, k) tile, or with .trans the A operand of a (k, m) tile.
__device__ __forceinline__ u32 at_rows(int ld, int r0, int c0, int lane) {
    return static_cast<u32>(((r0 + lane % 16) * ld + c0 + 8 * (lane / 16)) * 2);
}
__device__ __forceinline__ u32 at_pairs(int ld, int r0, int c0, int lane) {
    return static_cast<u32>(((r0 + lane % 8 + 8 * (lane / 16)) * ld + c0 + 8 * ((lane / 8) % 2)) * 2);
}

// The A fragment (16 × k16) of the bf16/fp16 values of two accumulator n8 tiles (k 0–7, 8–15).
__device__ __forceinline__ void acc_to_a(u32 (&a)[4], const float (&c0)[4], const float (&c1)[4]) {
    a[0] = pack2(c0[0], c0[1]);
    a[1] = pack2(c0[2], c0[3]);
    a[2] = pack2(c1[0], c1[1]);
    a[3] = pack2(c1[2], c1[3]);
}

// A packed 16-bit pair with its non-finite halves (exponent all ones: inf, NaN) set to 0. In a
// tile some of whose pairs are masked, the products dS·K (dQ) and dSᵀ·Q (dK) would otherwise
// carry a NaN of a masked operand row through dS = 0 (0·NaN = NaN) into rows that never see it;
// a row that does see it has a NaN score, hence a NaN dS, and stays NaN.
__device__ __forceinline__ u32 zero_nonfinite(u32 x) {
    constexpr u32 EXP = IS_BF16 ? 0x7f80u : 0x7c00u;
    const u32 lo = (x & EXP) == EXP ? 0u : (x & 0xffffu);
    const u32 hi = ((x >> 16) & EXP) == EXP ? 0u : (x & 0xffff0000u);
    return lo | hi;
}

__device__ __forceinline__ void zero_nonfinite4(u32 (&b)[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) b[i] = zero_nonfinite(b[i]);
}
