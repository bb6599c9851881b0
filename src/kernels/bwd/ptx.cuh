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

