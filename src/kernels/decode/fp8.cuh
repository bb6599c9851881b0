// The fp8 (e4m3) KV cache of the split-KV decode kernels (`splitkv.cu` and `heads.cu` built with
// KV_FP8): the widening of e4m3 bytes in registers, and a warp's steps of S = Q·Kᵀ and O += P·V
// that read the cache's bytes straight from shared memory. Needs the prelude (HEAD_DIM,
// IS_BF16), `../common/base.cuh`, `../sm80/ptx.cuh` (ldmatrix, mma, ld_shared_v4) and
// `params.cuh`; included after them, before the kernel.
//
// e4m3 ("fn": S.EEEE.MMM, exponent bias 7, no infinities, S.1111.111 is NaN, largest finite
// 448). KV head h's pages hold K / k_scale[h] and V / v_scale[h]: the kernels widen the bytes
// exactly (every e4m3 value is an f16 and a bf16) and apply the scales in f32, k_scale to the
// scores (folded into the softmax's scale) and v_scale to O (folded into the epilogue's 1/sum),
// so no element is multiplied.
//
// Why not ldmatrix: it moves 16-bit elements, and an mma.sync fragment register holds two
// elements adjacent along k. Each lane instead loads the bytes its fragments need with 16-byte
// (8-byte at d64 for V) shared loads and builds the registers itself. Two freedoms make those
// loads whole and free of bank conflicts:
//
// - Q·Kᵀ sums over the head dim in any order, as long as Q's and K's fragments agree. Lane t of
//   a quad loads dims 64c + 16t .. 64c + 16t + 15 of its key row, which feed four k16 steps:
//   in step s (0..3) of the 64-dim group c, its (b0, b1) are the byte pairs (4s, 4s + 1) and
//   (4s + 2, 4s + 3). So logical column 16s + 8hi + 2t + j of a group is physical dim
//   16t + 4s + 2hi + j, and Q's tile is stored in that logical order (`ld_q_chunk_fp8`:
//   logical 16-byte chunk c of a group holds Q's 32-bit pairs c, c + 8, c + 16, c + 24 of it),
//   so that ldmatrix hands out A fragments that match.
// - The softmax and P·V take a 16-key step's keys in any order, as long as S's columns and
//   P·V's k index agree. Column 2·tc + c of S tile 2ks + hi is key 16ks + key_in_step(hi, tc, c)
//   of the warp's keys: the rows of the 8 lanes of a 16-byte load phase then start 4 bank
//   groups apart for K (two rows × 64 bytes) and in 8 distinct groups for V (four rows × 32
//   bytes), given a row pitch that is an odd multiple of 16 bytes (8 consecutive rows start in
//   8 different 16-byte bank groups).
// - P·V's B fragment wants V at keys (2t, 2t + 1) and (2t + 8, 2t + 9) of a column in one
//   register each: bytes of four rows. Lane g loads VW contiguous bytes of each of its four
//   rows, dims 8VW·a + VW·g .. + VW − 1: column g of the VW n8 tiles VW·a .. VW·a + VW − 1 of
//   O. Byte permutes pair the rows, and the pairs widen to f16x2. O's columns are thus
//   permuted: column n of n8 tile jd is dim o_col(jd, n), and the epilogues write by it.
//
// Both products run in f16 whatever the queries' type, because e4m3 widens to f16 in one
// instruction on sm_89 and later (`cvt.rn.f16x2.e4m3x2`; before, bit operations and a multiply
// by 2^8) and to bf16 in none: the bit-operation widening of K to bf16 cost about 14
// instructions per MMA of Q·Kᵀ, most of the decode step's issue slots. P·V: P ≤ 2^8 (the lazy
// rescale's bound) fits f16 with three more mantissa bits than bf16. Q·Kᵀ with bf16 queries:
// the tile holds each row times 2^-e_r (`q_row_exp`: its largest finite |q| lands in
// [2^14, 2^15)), rounded to f16, and S's row is multiplied back by 2^e_r (`unscale_rows`) before
// anything reads it. Scaling by a power of two is exact, and a bf16 value (8 significant bits)
// is an f16 exactly wherever the scaled value is a normal f16 (≥ 2^-14): only elements under
// 2^-28 of their row's largest round, by at most 2^-25 · 2^e_r, a 2^-38 share of that largest
// |q| in the score. So S is the bf16 product's, up to the MMA's own accumulation order. Infinities
// and NaN are left out of the largest |q| and stay what they are.

constexpr int VW = HEAD_DIM >= 128 ? 16 : 8;  // bytes of a V row one lane loads per group
constexpr int V_GROUPS = HEAD_DIM / (8 * VW);  // such groups per row (8 lanes' columns each)
constexpr u32 SIGN_PAIR = 0x80008000u;         // sign bits of a 16-bit pair
constexpr u32 NAN_HALF = 0x7fffu;              // a NaN in f16 and in bf16
constexpr u32 NEG_ZERO_HALF = 0x8000u;         // −0 in f16
static_assert(HEAD_DIM % 64 == 0, "Q·Kᵀ takes the head dim in groups of 64");
static_assert(HEAD_DIM % (8 * VW) == 0, "P·V takes V's columns in groups of 8·VW");

// Key (0..15 in a 16-key step) of column 2·tc + c of S tile 2ks + hi (see the header).
__device__ __forceinline__ int key_in_step(int hi, int tc, int c) { return 2 * (tc ^ (2 * c)) + hi + 8 * c; }
// Key (of the warp's keys) of column 2·tc + c of S tile i.
__device__ __forceinline__ int s_key(int i, int tc, int c) { return 16 * (i / 2) + key_in_step(i % 2, tc, c); }
// Dim of column n of O's n8 tile jd.
__device__ __forceinline__ int o_col(int jd, int n) { return 8 * VW * (jd / VW) + VW * n + jd % VW; }

// 0x80 in each byte of w that is an e4m3 NaN (S.1111.111), 0 elsewhere.
__device__ __forceinline__ u32 e4m3_nan_bytes(u32 w) { return ((w & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u; }

// Makes NaN the halves of (lo, hi) whose bytes of `nan` (e4m3_nan_bytes) are set: lo holds
// bytes 0 and 1, hi bytes 2 and 3.
__device__ __forceinline__ void set_nan_halves(u32 nan, u32& lo, u32& hi) {
    lo |= ((nan & 0x00000080u) ? NAN_HALF : 0u) | ((nan & 0x00008000u) ? NAN_HALF << 16 : 0u);
    hi |= ((nan & 0x00800000u) ? NAN_HALF : 0u) | ((nan & 0x80000000u) ? NAN_HALF << 16 : 0u);
}

__device__ __forceinline__ u32 mul_f16x2(u32 a, u32 b) {
    u32 d;
    asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
// The four e4m3 bytes of w widened to f16 pairs: lo = (byte 0, byte 1), hi = (byte 2, byte 3),
// the lower byte in the lower half.
__device__ __forceinline__ void e4m3x4_to_f16x2(u32 w, u32& lo, u32& hi) {
#if __CUDA_ARCH__ >= 890
    asm("{.reg .b16 a, b;\n mov.b32 {a, b}, %2;\n cvt.rn.f16x2.e4m3x2 %0, a;\n cvt.rn.f16x2.e4m3x2 %1, b;}\n"
        : "=r"(lo), "=r"(hi)
        : "r"(w));
#else
    // Each byte into the high byte of a half (S at bit 15, E at 14..11, M at 10..8); f16 has E
    // at 13..10 (of 14..10) and M at 9..7, bias 15: the magnitude moves down one bit, ×2^8.
    constexpr u32 F16_2P8 = 0x5c005c00u;  // 2^8, an f16 pair
    const u32 x01 = __byte_perm(w, 0u, 0x1404), x23 = __byte_perm(w, 0u, 0x3424);
    lo = mul_f16x2(((x01 >> 1) & 0x3f803f80u) | (x01 & SIGN_PAIR), F16_2P8);
    hi = mul_f16x2(((x23 >> 1) & 0x3f803f80u) | (x23 & SIGN_PAIR), F16_2P8);
    const u32 nan = e4m3_nan_bytes(w);
    if (nan != 0u) set_nan_halves(nan, lo, hi);
#endif
}

// One e4m3 byte (the low 8 bits of b) as f32.
__device__ __forceinline__ float e4m3_to_f32(u32 b) {
    const u32 mag = b & 0x7fu;
    // E at bits 26..23 of an f32 (of 30..23), M at 22..20: ×2^120 (a subnormal f32 for E = 0).
    float f = __uint_as_float(mag << 20) * 0x1p120f;
    if (mag == 0x7fu) f = __int_as_float(0x7fffffff);
    return (b & 0x80u) ? -f : f;
}

// D = A·B + D, m16n8k16, f16 inputs (P·V whatever the queries' type).
__device__ __forceinline__ void mma_16816_f16(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// A V row's VW bytes for one lane (16 or 8).
__device__ __forceinline__ void ld_shared_vw(u32 (&x)[4], u32 addr) { ld_shared_v4(x, addr); }
__device__ __forceinline__ void ld_shared_vw(u32 (&x)[2], u32 addr) {
    asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n" : "=r"(x[0]), "=r"(x[1]) : "r"(addr));
}
__device__ __forceinline__ u32 ld_shared_u8(u32 addr) {
    u32 x;
    asm volatile("ld.shared.u8 %0, [%1];\n" : "=r"(x) : "r"(addr));
    return x;
}
__device__ __forceinline__ void st_shared_u16(u32 addr, unsigned short x) {
    asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(addr), "h"(x));
}
__device__ __forceinline__ float ld_shared_f16_f32(u32 addr) {
    unsigned short h;
    float f;
    asm volatile("ld.shared.u16 %0, [%1];\n" : "=h"(h) : "r"(addr));
    asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u32 ld_global_nc_b32(const void* src) {
    u32 x;
    asm volatile("ld.global.nc.b32 %0, [%1];\n" : "=r"(x) : "l"(src));
    return x;
}

// Logical 16-byte chunk c of a Q row in the order Q·Kᵀ takes the dims (see the header): Q's
// 32-bit pairs 32·(c / 8) + c % 8 + 8e, e = 0..3, of the row at `row` (global).
__device__ __forceinline__ void ld_q_chunk_fp8(u32 (&x)[4], const u16* row, int c) {
    const u32* src = reinterpret_cast<const u32*>(row) + 32 * (c / 8) + c % 8;
#pragma unroll
    for (int e = 0; e < 4; ++e) x[e] = ld_global_nc_b32(src + 8 * e);
}

// 2^e as f32, for −126 ≤ e ≤ 127.
__device__ __forceinline__ float exp2_int(int e) { return __int_as_float((127 + e) << 23); }

// The largest finite |x| of a chunk's eight bf16 values (two per word), 0 if none.
__device__ __forceinline__ float chunk_amax_bf16(const u32 (&x)[4]) {
    constexpr float MAX_FINITE = 3.40282347e38f;
    float m = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float lo = fabsf(__uint_as_float(x[k] << 16)), hi = fabsf(__uint_as_float(x[k] & 0xffff0000u));
        if (lo <= MAX_FINITE) m = fmaxf(m, lo);  // false for NaN and ∞
        if (hi <= MAX_FINITE) m = fmaxf(m, hi);
    }
    return m;
}

// e_r of a Q row whose largest finite |q| is amax (see the header): amax · 2^-e_r lands in
// [2^14, 2^15), 2^15 short of f16's largest; 0 for a row of zeros (or of infinities and NaN).
// Held at −100 and above so that 2^-e_r is an f32 (a row under 2^-86 keeps its elements
// above 2^-124 exactly, and the others add under 2^-109 to a score); at most 113 (bf16's
// largest is under 2^128).
__device__ __forceinline__ int q_row_exp(float amax) {
    if (!(amax > 0.0f)) return 0;
    const int e = ((__float_as_int(amax) >> 23) & 0xff) - 127;  // ⌊log2 amax⌋; −127 for an f32 subnormal
    return max(e - 14, -100);
}

// Chunk x of a Q row, as ld_q_chunk_fp8 loaded it (16-bit pairs of the queries' type), made
// the f16 pairs that Q·Kᵀ takes: with bf16 queries, times 2^-e_r of its row and rounded to f16
// (see the header); f16 queries are kept. The row's chunks are held by ROW_LANES consecutive
// lanes (a power of two dividing 32), which share its largest |q| by shuffles, so every lane of
// the warp calls this, each with its own chunk (zeros for rows past the valid ones). Returns e_r
// (0 for f16 queries).
template <int ROW_LANES>
__device__ __forceinline__ int q_chunk_to_f16(u32 (&x)[4]) {
    static_assert(ROW_LANES >= 1 && ROW_LANES <= 32 && 32 % ROW_LANES == 0, "a row's lanes share a warp");
    if constexpr (!IS_BF16) {
        return 0;
    } else {
        float m = chunk_amax_bf16(x);
#pragma unroll
        for (int o = 1; o < ROW_LANES; o <<= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        const int e = q_row_exp(m);
        const float f = exp2_int(-e);
#pragma unroll
        for (int k = 0; k < 4; ++k)
            x[k] = pack_f16x2(__uint_as_float(x[k] << 16) * f, __uint_as_float(x[k] & 0xffff0000u) * f);
        return e;
    }
}

// S's rows back at the queries' scale: row slot r (row g + 8·(r % 2) of MMA tile r / 2) times
// factor[r] = 2^e_r of its row (exact).
template <int MT, int NT>
__device__ __forceinline__ void unscale_rows(float (&rS)[MT][NT][4], const float (&factor)[2 * MT]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int i = 0; i < NT; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) rS[mt][i][e] *= factor[2 * mt + e / 2];
}

// S (MT MMA tiles of 16 rows × NT n8 tiles of keys) = Q·Kᵀ over the warp's 8·NT keys, f16 (Q's
// tile as q_chunk_to_f16 made it: for bf16 queries, unscale_rows restores S's rows).
// q_addr(mt, kk) is this lane's ldmatrix address of Q's A fragment (tile mt, k16 step kk);
// k_row(key) the shared address of dim 0 of key row `key` (of the warp's keys).
template <int MT, int NT, class QAddr, class KRow>
__device__ __forceinline__ void qk_fp8(float (&rS)[MT][NT][4], QAddr q_addr, KRow k_row, int g, int t) {
#pragma unroll
    for (int c = 0; c < HEAD_DIM / 64; ++c) {
        u32 qa[4][MT][4];
#pragma unroll
        for (int s = 0; s < 4; ++s)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(qa[s][mt], q_addr(mt, 4 * c + s));
#pragma unroll
        for (int i = 0; i < NT; ++i) {
            // This lane feeds column g of tile i: its key's dims 64c + 16t .. + 15.
            u32 w[4];
            ld_shared_v4(w, k_row(s_key(i, g >> 1, g & 1)) + static_cast<u32>(64 * c + 16 * t));
#pragma unroll
            for (int s = 0; s < 4; ++s) {
                u32 b0, b1;
                e4m3x4_to_f16x2(w[s], b0, b1);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) mma_16816_f16(rS[mt][i], qa[s][mt], b0, b1);
            }
        }
    }
}

// One 16-key step ks of O (MT × ND n8 tiles, columns permuted: o_col) += P·V: P is S's tiles
// 2ks and 2ks + 1 (f32, rounded here to f16), v_row(key) the shared address of dim 0 of key
// row `key` (of the warp's keys).
template <int MT, int NT, int ND, class VRow>
__device__ __forceinline__ void pv_fp8(float (&rO)[MT][ND][4], const float (&rS)[MT][NT][4], int ks, VRow v_row,
                                       int g, int t) {
    static_assert(ND * 8 == HEAD_DIM, "O's n8 tiles span the head dim");
    u32 pa[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        pa[mt][0] = pack_f16x2(rS[mt][2 * ks][0], rS[mt][2 * ks][1]);
        pa[mt][1] = pack_f16x2(rS[mt][2 * ks][2], rS[mt][2 * ks][3]);
        pa[mt][2] = pack_f16x2(rS[mt][2 * ks + 1][0], rS[mt][2 * ks + 1][1]);
        pa[mt][3] = pack_f16x2(rS[mt][2 * ks + 1][2], rS[mt][2 * ks + 1][3]);
    }
    // This lane's rows: P·V's k = 2t, 2t + 1 (b0) and 2t + 8, 2t + 9 (b1), i.e. columns 2t and
    // 2t + 1 of S tiles 2ks and 2ks + 1.
    const u32 r0 = v_row(16 * ks + key_in_step(0, t, 0)), r1 = v_row(16 * ks + key_in_step(0, t, 1));
    const u32 r2 = v_row(16 * ks + key_in_step(1, t, 0)), r3 = v_row(16 * ks + key_in_step(1, t, 1));
#pragma unroll
    for (int a = 0; a < V_GROUPS; ++a) {
        const u32 off = static_cast<u32>(8 * VW * a + VW * g);
        u32 w0[VW / 4], w1[VW / 4], w2[VW / 4], w3[VW / 4];
        ld_shared_vw(w0, r0 + off);
        ld_shared_vw(w1, r1 + off);
        ld_shared_vw(w2, r2 + off);
        ld_shared_vw(w3, r3 + off);
#pragma unroll
        for (int q = 0; q < VW / 4; ++q) {
            // Byte b of each word is column g of tile VW·a + 4q + b; pair rows (0, 1) and (2, 3).
            u32 b0[4], b1[4];
            e4m3x4_to_f16x2(__byte_perm(w0[q], w1[q], 0x5140), b0[0], b0[1]);
            e4m3x4_to_f16x2(__byte_perm(w0[q], w1[q], 0x7362), b0[2], b0[3]);
            e4m3x4_to_f16x2(__byte_perm(w2[q], w3[q], 0x5140), b1[0], b1[1]);
            e4m3x4_to_f16x2(__byte_perm(w2[q], w3[q], 0x7362), b1[2], b1[3]);
#pragma unroll
            for (int e = 0; e < 4; ++e)
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) mma_16816_f16(rO[mt][VW * a + 4 * q + e], pa[mt], b0[e], b1[e]);
        }
    }
}

// Whether any V byte of the warp's KEYS rows is NaN (warp-uniform): the fp8 form of the 16-bit
// kernels' non-finite test (e4m3 has no infinities).
template <int KEYS, class VRow>
__device__ __forceinline__ bool warp_v_nan_fp8(VRow v_row, int lane) {
    constexpr int ROW_CHUNKS8 = HEAD_DIM / 16;
    static_assert(KEYS * ROW_CHUNKS8 % 32 == 0, "the rows' 16-byte chunks split evenly over the lanes");
    bool bad = false;
#pragma unroll
    for (int i = 0; i < KEYS * ROW_CHUNKS8 / 32; ++i) {
        const int idx = lane + 32 * i;
        u32 x[4];
        ld_shared_v4(x, v_row(idx / ROW_CHUNKS8) + static_cast<u32>(16 * (idx % ROW_CHUNKS8)));
        bad |= (e4m3_nan_bytes(x[0]) | e4m3_nan_bytes(x[1]) | e4m3_nan_bytes(x[2]) | e4m3_nan_bytes(x[3])) != 0u;
    }
    return __any_sync(0xffffffffu, bad);
}

// O += P·V over the warp's KEYS keys as scalar FMAs that skip P = 0, for a block whose V holds a
// NaN (the 16-bit kernels' pv_skip_zero, whose comments say why). P, rounded to f16 as the MMA
// path rounds it, is staged in the warp's own K rows: p_addr(e) is the shared address of byte e
// of P (MT·16 rows, KEYS) f16 row-major laid over them; the caller checks that it fits.
//
// Only a P that is 0 in f32 (a masked key: exp2(−inf)) is skipped. An allowed key's P of at most
// 2^-25 (a score 17.3 nats or more under the row's running max) rounds to an f16 0; it is staged
// as −0, which adds nothing to a finite V (as the MMA's rounded 0) while −0·NaN still makes the
// row NaN. Such keys are common with outlier keys: in tests/cuda_decode_fp8.rs's NaN test, 5 of
// the 28 O elements that a NaN byte must reach (all-heads kernel, causal) come only through them.
template <int MT, int NT, int ND, int KEYS, class PAddr, class VRow>
__device__ __forceinline__ void pv_skip_zero_fp8(float (&rO)[MT][ND][4], const float (&rS)[MT][NT][4], PAddr p_addr,
                                                 VRow v_row, int g, int t) {
    static_assert(NT * 8 == KEYS, "S covers the warp's keys");
    __syncwarp();  // every lane's reads of these K rows are done
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int i = 0; i < NT; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = 16 * mt + g + 8 * (e / 2), key = s_key(i, t, e & 1);
                const u32 ph = pack_f16x2(rS[mt][i][e], 0.0f) & 0xffffu;
                const u32 staged = ph == 0u && rS[mt][i][e] != 0.0f ? NEG_ZERO_HALF : ph;
                st_shared_u16(p_addr((row * KEYS + key) * 2), static_cast<unsigned short>(staged));
            }
    __syncwarp();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = 16 * mt + g + 8 * h;
#pragma unroll
            for (int jd = 0; jd < ND; ++jd)
#pragma unroll
                for (int c2 = 0; c2 < 2; ++c2) {
                    const u32 dim = static_cast<u32>(o_col(jd, 2 * t + c2));
                    float acc = 0.0f;
#pragma unroll 1
                    for (int k = 0; k < KEYS; ++k) {
                        const float pv = ld_shared_f16_f32(p_addr((row * KEYS + k) * 2));
                        if (__float_as_uint(pv) != 0u) acc = fmaf(pv, e4m3_to_f32(ld_shared_u8(v_row(k) + dim)), acc);
                    }
                    rO[mt][jd][2 * h + c2] += acc;
                }
        }
    __syncwarp();
}
