// PTX wrappers the decode kernels add to `../sm80/ptx.cuh`: the 16-byte global load of the Q
// tile, the f32 vector stores of the split workspace (and the heads kernel's 4- and 8-byte
// stores of O), and the scalar V reads and finiteness test of blocks with non-finite V.

__device__ __forceinline__ void ld_global_v4(u32 (&x)[4], const void* src) {
    asm volatile("ld.global.nc.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(x[0]), "=r"(x[1]), "=r"(x[2]), "=r"(x[3])
                 : "l"(src));
}
__device__ __forceinline__ void st_global_f32x4(float* dst, float a, float b, float c, float d) {
    asm volatile("st.global.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "f"(a), "f"(b), "f"(c), "f"(d));
}

__device__ __forceinline__ void st_global_f32x2(float* dst, float a, float b) {
    asm volatile("st.global.v2.f32 [%0], {%1, %2};\n" ::"l"(dst), "f"(a), "f"(b));
}
__device__ __forceinline__ void st_global_b32(void* dst, u32 x) {
    asm volatile("st.global.b32 [%0], %1;\n" ::"l"(dst), "r"(x));
}

__device__ __forceinline__ void st_shared_f32(u32 addr, float x) {
    asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(addr), "f"(x));
}
__device__ __forceinline__ float ld_shared_f32(u32 addr) {
    float x;
    asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(x) : "r"(addr));
    return x;
}

// One 16-bit element of shared memory as f32 (the scalar P·V of blocks with non-finite V).
__device__ __forceinline__ float ld_shared_16_f32(u32 addr) {
    unsigned short h;
    asm volatile("ld.shared.u16 %0, [%1];\n" : "=h"(h) : "r"(addr));
    if constexpr (IS_BF16) {
        return __uint_as_float(static_cast<u32>(h) << 16);
    } else {
        float f;
        asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(h));
        return f;
    }
}

// Whether any 16-bit value of a packed pair is an infinity or NaN (exponent bits all ones).
__device__ __forceinline__ bool nonfinite_pair(u32 x) {
    constexpr u32 EXP = IS_BF16 ? 0x7f807f80u : 0x7c007c00u;
    return (x & 0x0000ffffu & EXP) == (0x0000ffffu & EXP) || (x & 0xffff0000u & EXP) == (0xffff0000u & EXP);
}
