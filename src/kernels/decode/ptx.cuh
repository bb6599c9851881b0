// PTX wrappers the decode kernels add to `../sm80/ptx.cuh`: the 16-byte global load of the Q
// tile and the f32 vector stores of the split workspace.

__device__ __forceinline__ void ld_global_v4(u32 (&x)[4], const void* src) {
    asm volatile("ld.global.nc.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(x[0]), "=r"(x[1]), "=r"(x[2]), "=r"(x[3])
                 : "l"(src));
}
__device__ __forceinline__ void st_global_f32x4(float* dst, float a, float b, float c, float d) {
    asm volatile("st.global.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "f"(a), "f"(b), "f"(c), "f"(d));
}
