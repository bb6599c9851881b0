// PTX wrappers of the backward kernels beyond the Ampere-class layer (`../sm80/ptx.cuh`): the
// f32 reduction into the dQ accumulator, 16-byte global loads and the 16-bit-to-f32 widening.

// *dst += x, without a return value (the accumulator is only read by the convert kernel).
__device__ __forceinline__ void red_add_f32(float* dst, float x) {
    asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(dst), "f"(x) : "memory");
}

// dst[0] += x, dst[1] += y: one vector reduction on sm_90 and later (VEC_RED), two before.
// Halves the reduction instructions of the dQ accumulation, the main kernel's bottleneck
// with scalar ones (measured on the H200: the deterministic mode, which has none, was faster).
__device__ __forceinline__ void red_add_f32x2(float* dst, float x, float y) {
    if constexpr (VEC_RED) {
        asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(dst), "f"(x), "f"(y) : "memory");
    } else {
        red_add_f32(dst, x);
        red_add_f32(dst + 1, y);
    }
}

__device__ __forceinline__ void ld_global_v4(u32 (&x)[4], const void* src) {
    asm volatile("ld.global.nc.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(x[0]), "=r"(x[1]), "=r"(x[2]), "=r"(x[3])
                 : "l"(src));
}

__device__ __forceinline__ void st_global_b32(void* dst, u32 v) {
    asm volatile("st.global.b32 [%0], %1;\n" ::"l"(dst), "r"(v) : "memory");
}

// The two 16-bit values of a packed pair, widened (lo, hi).
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
