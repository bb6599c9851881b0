// Rows the forward kernels' fast path may get wrong, and the kernel that recomputes them exactly
// (issue 12). Included by the Ampere-class and Hopper forward kernels after the shared layer;
// needs the prelude's HEAD_DIM, IS_BF16, FP8, HAS_SOFTCAP and HAS_WINDOW. With FP8 (the e4m3
// Hopper kernel) Q, K and V are e4m3 bytes, dequantized here with their descales, and O is 16-bit.
//
// The fast path is wrong in exactly three ways, each visible at the end of a row:
// (a) huge finite scores: the shift RN(m·c) loses the exponent once |m·c| is large (P = inf or 0:
//     a NaN sum, or a zero sum with a finite max), and below that it costs the corrections up to
//     half an ulp of m·c each: flagged from |m·c| ≥ EXACT_SHIFT_LIMIT on;
// (b) a +inf score on a row with few keys: a lane's partial sum 0 times the correction exp2(+inf)
//     is NaN, so the sum is not finite;
// (c) a NaN or infinity in V at a key that the row masks but its key block holds: 0 · NaN and
//     0 · inf are NaN, which leaks into O through the P·V product.
// The epilogue stores the rows of (a) and (b) as NaN (it scales them by EXACT_MARK), and a leak
// (c) is NaN where it reached (never inf: 0 · inf is NaN, and NaN stays NaN through the 1/sum
// scaling and the rounding to 16 bits). So "some stored O element of a valid row is NaN" is the
// one test: each thread folds its stored pairs with a NaN-propagating max (`nan_max2`, one
// instruction per pair) and, when the fold holds a NaN, sets the module's flag (the Hopper consumers
// once after their last tile, the Ampere-class kernel at its end). Rows that are
// NaN by the definition (NaN inputs, +inf scores) set it too; they are recomputed and come out of
// the exact path with the definition's answer (docs/attention.md, non-finite inputs): slower,
// never wrong.
//
// The recomputation is a second kernel of the same module, `fa4_exact_fixup`, which the backend
// launches after every forward: with the flag clear each CTA reads one word and exits; with it
// set every NaN row is recomputed and the last CTA clears the flag for the next launch. Keeping
// the exact path out of the forward kernel leaves its key loop as it was: inlined there, its mere
// presence grew the Ampere-class loop by 91 instructions with spills and cost 3–5% (docs/perf.md,
// H200, 2026-12-02, build b9ba3a8 of branch nonfinite10). What this form costs is in
// docs/perf.md (the exact fixup kernel, 2026-12-02, commit e525b67).

// The module's flag: [0] some forward row needs the exact path, [1] fixup CTAs done (reset by the
// last). Zero when the module is loaded.
__device__ unsigned fa4_exact_flag[2];

// |row max · scale_log2| from which a row takes the exact path. Below it the fast shift's rounding
// error is at most 2^-11 (half an ulp of 2^14 in f32), a relative error of 3.4e-4 in the weights
// of the blocks before a rescale: below the 2^-9 rounding of P to 16 bits.
constexpr float EXACT_SHIFT_LIMIT = 16384.0f;

// A quiet NaN: what the epilogue scales a row of (a) or (b) by, so that all its stored O is NaN.
#define EXACT_MARK __int_as_float(0x7fffffffu)

// Whether a float is ±inf or NaN (a bit test: independent of any compiler folding).
__device__ __forceinline__ bool not_finite(float x) { return (__float_as_uint(x) & 0x7f800000u) == 0x7f800000u; }

// The factor the epilogue scales a row's O by: 1/sum, or EXACT_MARK when the fast result may be
// wrong ((a) or (b)). `row_max`: the row's max of raw scores, `sum`: its whole sum (quad-summed).
__device__ __forceinline__ float row_out_scale(float row_max, float sum, float scale_log2) {
    const float a = fabsf(row_max);
    const bool huge = a != -NEG_INF && a * scale_log2 >= EXACT_SHIFT_LIMIT;  // a row with no key has max −inf
    return huge || not_finite(sum) ? EXACT_MARK : row_inv_sum(sum);
}

// The elementwise max of two packed 16-bit pairs, NaN where either is NaN (max.NaN, sm_80 on).
// Folding a thread's stored pairs with it, from 0, leaves a NaN half iff one of them was NaN.
__device__ __forceinline__ u32 nan_max2(u32 a, u32 b) {
    u32 r;
    if constexpr (IS_BF16) {
        asm("max.NaN.bf16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
    } else {
        asm("max.NaN.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
    }
    return r;
}

// Whether either half of a packed 16-bit pair is NaN.
__device__ __forceinline__ bool pair_has_nan(u32 x) {
    constexpr u32 INF16 = IS_BF16 ? 0x7f80u : 0x7c00u;
    return (x & 0x7fffu) > INF16 || ((x >> 16) & 0x7fffu) > INF16;
}

// The epilogue's last step: `folded` (the nan_max2 fold of the pairs this thread stored) holds
// a NaN, so the fixup kernel has rows to redo. Rare; a plain store of the same value
// from any number of threads.
__device__ __forceinline__ void raise_exact_flag(u32 folded) {
    if (pair_has_nan(folded)) *static_cast<volatile unsigned*>(&fa4_exact_flag[0]) = 1u;
}

// Two 16-bit values at `src` (4-byte aligned: rows are 16-byte aligned, columns even) as floats.
__device__ __forceinline__ void load_pair(const u16* src, float& lo, float& hi) {
    unpack2(*reinterpret_cast<const u32*>(src), lo, hi);
}

// Two e4m3 values at `src` (2-byte aligned) as floats (exact: e4m3 widens to f16 exactly).
__device__ __forceinline__ void load_pair(const unsigned char* src, float& lo, float& hi) {
    const unsigned short b = *reinterpret_cast<const unsigned short*>(src);
    u32 h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(h2) : "h"(b));
    asm("{\n.reg .f16 l, h;\nmov.b32 {l, h}, %2;\ncvt.f32.f16 %0, l;\ncvt.f32.f16 %1, h;\n}\n"
        : "=f"(lo), "=f"(hi)
        : "r"(h2));
}

// The element type of Q, K and V: 16-bit, or e4m3 bytes.
template <bool F>
struct InputOf {
    using type = u16;
};
template <>
struct InputOf<true> {
    using type = unsigned char;
};
using Input = InputOf<FP8>::type;

// The fixup's argument: the forward's common params, and with FP8 its descales (the layout of
// `Sm90Params::descales`), mirrored by `cuda::params::ExactFp8Params`.
struct ExactFp8Params {
    FwdParams p;
    const float* descales;  // [3][batch][heads_kv]: q, k, v
    int descale_plane;      // batch · heads_kv
    int pad0;
};
#define FA4_EXACT_FP8_PARAMS_SIZE 240
static_assert(sizeof(ExactFp8Params) == FA4_EXACT_FP8_PARAMS_SIZE, "ExactFp8Params layout must match the Rust mirror");
template <bool F>
struct ExactArgsOf {
    using type = FwdParams;
};
template <>
struct ExactArgsOf<true> {
    using type = ExactFp8Params;
};
using ExactArgs = ExactArgsOf<FP8>::type;
__device__ __forceinline__ const FwdParams& common_of(const FwdParams& a) { return a; }
__device__ __forceinline__ const FwdParams& common_of(const ExactFp8Params& a) { return a.p; }

// The descales of sequence b's KV head (1 without FP8): Q·Kᵀ's product qk, and V's v.
struct RowDescales {
    float qk, v;
};
__device__ __forceinline__ RowDescales descales_of(const FwdParams&, int, int) { return {1.0f, 1.0f}; }
__device__ __forceinline__ RowDescales descales_of(const ExactFp8Params& a, int b, int kv_head) {
    const int at = b * (a.p.heads_q / a.p.group) + kv_head;
    return {a.descales[at] * a.descales[a.descale_plane + at], a.descales[2 * a.descale_plane + at]};
}

// tanh for the softcap: the fast path's form (`tanh_accurate`, relative error ~1e-7) with the
// division by the fast reciprocal (2 ulp, 0 past 2^126 where tanh is ±1): IEEE division's slow
// path is a call, whose stack frame spilled this kernel.
__device__ __forceinline__ float exact_tanh(float x) {
    const float e = exp2_approx(2.0f * LOG2E * fabsf(x));
    return copysignf(1.0f - __fdividef(2.0f, e + 1.0f), x);
}

// Column pairs per lane: lane l owns columns 2l + 64k and 2l + 64k + 1, k < EXACT_PAIRS. HEAD_DIM
// is the kernel's Q/K width, which bounds V's too (head_dim_v ≤ head_dim wherever they differ).
constexpr int EXACT_PAIRS = (HEAD_DIM + 63) / 64;

// Row i of sequence `s` (query head `head`, batch-axis index `bi`) by the definition, with the
// whole warp: every allowed key's score in f32 (a butterfly sum, so every lane holds the same
// value), the row max, then P = exp2((s − max)·c) with the subtraction first (exact at any
// magnitude), the sum and O over the allowed keys only (a masked key's V is never read). An
// infinite max shifts by 0, as the fast path and the definition do. Writes O and the LSE.
// `d`: the row's descales (FP8; else 1): the score is qk · (Q·Kᵀ) of the bytes, O takes v.
__device__ __forceinline__ void exact_row(const FwdParams& p, const Seq s, int bi, int head, int i, int lane,
                                          RowDescales d) {
    const int kv_head = head / p.group;
    const Input* gq = static_cast<const Input*>(p.q) + bi * p.q_batch_stride + (s.q_start + i) * p.q_row_stride +
                      head * p.q_head_stride;
    const Input* gk = static_cast<const Input*>(p.k) + bi * p.k_batch_stride + s.k_start * p.k_row_stride +
                      kv_head * p.k_head_stride;
    const Input* gv = static_cast<const Input*>(p.v) + bi * p.v_batch_stride + s.k_start * p.v_row_stride +
                      kv_head * p.v_head_stride;
    float q[EXACT_PAIRS][2];
    bool col_ok[EXACT_PAIRS];  // the column pair is in Q/K
    // ... and in V/O (computed where used: a second flag array made ptxas spill this kernel).
    auto v_ok = [&](int k) { return 2 * lane + 64 * k < p.head_dim_v; };
#pragma unroll
    for (int k = 0; k < EXACT_PAIRS; ++k) {
        const int c = 2 * lane + 64 * k;
        col_ok[k] = c < p.head_dim;
        q[k][0] = q[k][1] = 0.0f;
        if (col_ok[k]) load_pair(gq + c, q[k][0], q[k][1]);
        if (p.negate_q) {
            q[k][0] = -q[k][0];
            q[k][1] = -q[k][1];
        }
    }
    // Raw score of key j (before scale_log2), the same value on every lane.
    auto score = [&](int j) {
        const Input* kj = gk + j * p.k_row_stride;
        float acc = 0.0f;
#pragma unroll
        for (int k = 0; k < EXACT_PAIRS; ++k) {
            if (!col_ok[k]) continue;
            float k0, k1;
            load_pair(kj + 2 * lane + 64 * k, k0, k1);
            acc = fmaf(q[k][1], k1, fmaf(q[k][0], k0, acc));
        }
#pragma unroll
        for (int m = 16; m >= 1; m /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, m);
        if constexpr (FP8) acc *= d.qk;
        if constexpr (HAS_SOFTCAP) acc = p.softcap * exact_tanh(acc * p.softcap_scale);
        return acc;
    };
    const int lo = key_lo(p, s, i), hi = key_hi(p, s, i);
    float mx = NEG_INF;  // fmaxf skips NaN scores; they make P, the sum and O NaN below
    for (int j = lo; j < hi; ++j) mx = fmaxf(mx, score(j));
    const bool finite_max = fabsf(mx) != -NEG_INF;
    float sum = 0.0f;
    float o[EXACT_PAIRS][2];
#pragma unroll
    for (int k = 0; k < EXACT_PAIRS; ++k) o[k][0] = o[k][1] = 0.0f;
    for (int j = lo; j < hi; ++j) {
        const float sj = score(j);
        const float pj = exp2f(finite_max ? (sj - mx) * p.scale_log2 : sj * p.scale_log2);
        sum += pj;
        const Input* vj = gv + j * p.v_row_stride;
#pragma unroll
        for (int k = 0; k < EXACT_PAIRS; ++k) {
            if (!v_ok(k)) continue;
            float v0, v1;
            load_pair(vj + 2 * lane + 64 * k, v0, v1);
            o[k][0] = fmaf(pj, v0, o[k][0]);
            o[k][1] = fmaf(pj, v1, o[k][1]);
        }
    }
    const float inv = row_inv_sum(sum) * d.v;
    u16* go = static_cast<u16*>(p.o) + bi * p.o_batch_stride + (s.q_start + i) * p.o_row_stride + head * p.o_head_stride;
#pragma unroll
    for (int k = 0; k < EXACT_PAIRS; ++k)
        if (v_ok(k)) *reinterpret_cast<u32*>(go + 2 * lane + 64 * k) = pack2(o[k][0] * inv, o[k][1] * inv);
    if (p.lse != nullptr && lane == 0) {
        // sum = 0: no key (or all −inf); NaN stays NaN; a +inf max gives sum +inf, LSE +inf.
        const float lse = sum == 0.0f ? NEG_INF : (finite_max ? mx * p.lse_scale : 0.0f) + logf(sum);
        p.lse[bi * p.lse_batch_stride + head * p.lse_head_stride + s.q_start + i] = lse;
    }
}

// Threads per CTA of the fixup kernel (`cuda::family::ExactFixup` launches it with this many).
constexpr int EXACT_THREADS = 256;

// The fixup: a no-op unless the forward kernel launched just before it (same module, same
// stream) set the flag. Then each warp takes units of 32 rows of one (sequence, query head):
// lane r scans row r's stored O for a NaN, and the warp recomputes each such row (exact_row);
// rows that are NaN by the definition come out NaN again. The last CTA to finish clears the flag
// (every CTA read it as set before any could clear it: the count only completes after all have).
extern "C" __global__ void __launch_bounds__(EXACT_THREADS) fa4_exact_fixup(const ExactArgs args) {
    if (*static_cast<volatile unsigned*>(&fa4_exact_flag[0]) == 0u) return;
    const FwdParams& p = common_of(args);
    const bool varlen = p.cu_seqlens_q != nullptr;
    const int lane = threadIdx.x % 32;
    const long long warps = static_cast<long long>(gridDim.x) * (EXACT_THREADS / 32);
    const long long row_blocks = (p.seqlen_q + 31) / 32;
    const long long units = static_cast<long long>(p.batch) * p.heads_q * row_blocks;
    for (long long u = blockIdx.x * (EXACT_THREADS / 32) + threadIdx.x / 32; u < units; u += warps) {
        const int base = static_cast<int>(u % row_blocks) * 32;
        const int head = static_cast<int>((u / row_blocks) % p.heads_q);
        const int b = static_cast<int>(u / (row_blocks * p.heads_q));
        const Seq s = sequence(p, b, varlen);
        const int bi = varlen ? 0 : b;
        const int i = base + lane;
        bool marked = false;
        if (i < s.q_len) {
            const u16* go = static_cast<const u16*>(p.o) + bi * p.o_batch_stride + (s.q_start + i) * p.o_row_stride +
                            head * p.o_head_stride;
            for (int c = 0; c < p.head_dim_v; c += 2) marked |= pair_has_nan(*reinterpret_cast<const u32*>(go + c));
        }
        u32 rows = __ballot_sync(0xffffffffu, marked);
        while (rows != 0) {
            const int r = __ffs(rows) - 1;
            rows &= rows - 1;
            exact_row(p, s, bi, head, base + r, lane, descales_of(args, b, head / p.group));
        }
    }
    __syncthreads();
    if (threadIdx.x == 0 && atomicAdd(&fa4_exact_flag[1], 1u) == gridDim.x - 1) {
        fa4_exact_flag[1] = 0u;
        *static_cast<volatile unsigned*>(&fa4_exact_flag[0]) = 0u;
    }
}
