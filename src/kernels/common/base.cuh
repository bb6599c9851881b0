// Pieces every fa4 CUDA kernel uses: fixed-width types, constants of the softmax, and the PTX
// wrappers for shared addresses, 16-bit packing, exp2 and tanh. Self-contained (NVRTC may have
// no headers); needs the prelude's IS_BF16. Included after the prelude, before the params.

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

constexpr float LOG2E = 1.4426950408889634f;
// Conditional rescaling keeps a row's stale max until the new one is this much larger (log2
// units): P then stays below 2^8, well inside fp16/bf16 range, and O is rescaled rarely.
constexpr float RESCALE_THRESHOLD = 8.0f;
#define NEG_INF __int_as_float(0xff800000u)  // −inf (no constexpr spelling without headers)

__device__ __forceinline__ u32 smem_u32(const void* p) {
    return static_cast<u32>(__cvta_generic_to_shared(p));
}

// Two floats to a packed 16-bit pair, `lo` in the low half (round to nearest even).
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    u32 r;
    if constexpr (IS_BF16) {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    }
    return r;
}

// The two 16-bit values of a packed pair, widened (lo, hi): pack2's inverse.
__device__ __forceinline__ void unpack2(u32 x, float& lo, float& hi) {
    if constexpr (IS_BF16) {
        lo = __uint_as_float(x << 16);
        hi = __uint_as_float(x & 0xffff0000u);
    } else {
        asm("{.reg .f16 a, b;\n mov.b32 {a, b}, %2;\n cvt.f32.f16 %0, a;\n cvt.f32.f16 %1, b;}\n"
            : "=f"(lo), "=f"(hi)
            : "r"(x));
    }
}

__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// tanh from ex2 (relative error ~1e-7, far below 16-bit rounding of the scores).
__device__ __forceinline__ float tanh_accurate(float x) {
    float e = exp2_approx(2.0f * LOG2E * fabsf(x));
    float t = 1.0f - 2.0f / (e + 1.0f);
    return copysignf(t, x);
}
