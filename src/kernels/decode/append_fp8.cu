// The append of new K/V rows into an fp8 (e4m3) paged cache: each new element x of KV head h
// becomes the e4m3 value nearest x / scale[h] (ties to even, saturating at ±448, NaN kept
// NaN), byte for byte what the CPU's `paged::append_fp8` writes. The host
// (`paged::append_targets`) validated every destination (page in range, no slot written twice,
// lengths within the table) and resolved each new row to its element offset in each cache.
//
// Self-contained; needs `../common/base.cuh` (u16, u32) and the prelude's SRC_BYTES (the new
// rows' element: 4 f32, 2 fp16 or bf16, told apart by IS_BF16). One CTA per new row. The
// quotient is an IEEE f32 division, as on the CPU, and its rounding to e4m3 is done on its bits
// (the rule of CUDA's `__nv_cvt_float_to_fp8` with `__NV_SATFINITE`, which the CPU's element
// type follows), so every target writes the same bytes (sm_80 has no e4m3 conversion).

struct AppendFp8Params {
    const void* k_new;          // [rows, heads_kv, head_dim] contiguous, SRC_BYTES each
    const void* v_new;          // [rows, heads_kv, head_dim_v] contiguous
    unsigned char* k_cache;     // e4m3 bytes
    unsigned char* v_cache;
    const long long* k_dst;     // [rows]: element offset of the row's slot (head 0) in k_cache
    const long long* v_dst;     // [rows]: in v_cache
    const float* k_scale;       // [heads_kv], finite and > 0
    const float* v_scale;       // [heads_kv]
    long long k_head_stride;    // elements
    long long v_head_stride;    // elements
    int rows;
    int heads_kv;
    int head_dim;
    int head_dim_v;
};

#define FA4_APPEND_FP8_PARAMS_SIZE 96
static_assert(sizeof(AppendFp8Params) == FA4_APPEND_FP8_PARAMS_SIZE, "AppendFp8Params layout must match the Rust mirror");

// Element i of a new-row buffer, widened to f32 (exact).
__device__ __forceinline__ float new_value(const void* base, long long i) {
    if constexpr (SRC_BYTES == 4) {
        return static_cast<const float*>(base)[i];
    } else {
        const u16 h = static_cast<const u16*>(base)[i];
        if constexpr (IS_BF16) {
            return __uint_as_float(static_cast<u32>(h) << 16);
        } else {
            float f;
            asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(h));
            return f;
        }
    }
}

constexpr u32 E4M3_NAN = 0x7fu;       // S.1111.111
constexpr u32 E4M3_MAX = 0x7eu;       // 448
constexpr u32 F32_OVERFLOW = 0x43e80000u;  // 464 = 448 + half an ulp: larger magnitudes saturate
constexpr u32 F32_UNDERFLOW = 0x3a800000u; // 2^-10, half the smallest subnormal: this or less is 0
constexpr u32 HALF_ULP = 0x80000u;    // half an e4m3 ulp in an f32 mantissa (bit 19)

// x rounded to e4m3: nearest, ties to even, ±448 beyond ±464 (infinities included), NaN to
// S.1111.111 with x's sign.
__device__ __forceinline__ unsigned char f32_to_e4m3(float x) {
    const u32 xb = __float_as_uint(x);
    const u32 sign = (xb >> 24) & 0x80u;
    const u32 ax = xb & 0x7fffffffu;
    u32 r;
    if (ax > 0x7f800000u) {
        r = E4M3_NAN;
    } else if (ax > F32_OVERFLOW) {
        r = E4M3_MAX;
    } else if (ax <= F32_UNDERFLOW) {
        r = 0u;
    } else {
        const int e = static_cast<int>(ax >> 23) - 127 + 7;  // e4m3's biased exponent
        const u32 mant = (ax >> 20) & 7u;                      // its 3 mantissa bits
        if (e >= 1) {
            // Normal (x ≥ 2^-6): round the 20 bits below; a carry moves into the exponent.
            r = (static_cast<u32>(e) << 3) | mant;
            const u32 rest = ax & 0xfffffu;
            if (rest > HALF_ULP || (rest == HALF_ULP && (r & 1u))) ++r;
        } else {
            // Subnormal: the significand (implicit bit at 3) shifted right by 1 .. 4.
            const int shift = 1 - e;
            r = (mant | 8u) >> shift;
            const u32 rest = (ax | 0x800000u) & ((HALF_ULP << (shift + 1)) - 1u);
            const u32 half = HALF_ULP << shift;
            if (rest > half || (rest == half && (r & 1u))) ++r;
        }
    }
    return static_cast<unsigned char>(r | sign);
}

extern "C" __global__ void __launch_bounds__(128) fa4_paged_append_fp8(const __grid_constant__ AppendFp8Params a) {
    const int row = blockIdx.x;
    if (row >= a.rows) return;
    const long long k_src = static_cast<long long>(row) * a.heads_kv * a.head_dim;
    const long long v_src = static_cast<long long>(row) * a.heads_kv * a.head_dim_v;
    for (int i = threadIdx.x; i < a.heads_kv * a.head_dim; i += blockDim.x) {
        const int h = i / a.head_dim, c = i % a.head_dim;
        const float x = __fdiv_rn(new_value(a.k_new, k_src + i), a.k_scale[h]);
        a.k_cache[a.k_dst[row] + h * a.k_head_stride + c] = f32_to_e4m3(x);
    }
    for (int i = threadIdx.x; i < a.heads_kv * a.head_dim_v; i += blockDim.x) {
        const int h = i / a.head_dim_v, c = i % a.head_dim_v;
        const float x = __fdiv_rn(new_value(a.v_new, v_src + i), a.v_scale[h]);
        a.v_cache[a.v_dst[row] + h * a.v_head_stride + c] = f32_to_e4m3(x);
    }
}
