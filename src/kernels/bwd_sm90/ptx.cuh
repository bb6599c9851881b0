// PTX wrappers of the Hopper backward beyond the Hopper layer (`../sm90/ptx.cuh`): the f32
// vector reduction into the dQ accumulator and the 16-byte shared-memory access of the
// non-finite cleaning (the 4-byte `st_shared_b32` of the dSᵀ stores is the Hopper layer's).
// (`../bwd/ptx.cuh` holds the same reduction for the Ampere-class kernel
// but also a `st_global_b32` that the Hopper layer defines too, so it is not included here.)

// dst[0] += x, dst[1] += y, no return value (sm_90: one vector reduction).
__device__ __forceinline__ void red_add_v2(float* dst, float x, float y) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(dst), "f"(x), "f"(y) : "memory");
}

__device__ __forceinline__ void ld_shared_v4(u32 (&x)[4], u32 addr) {
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(x[0]), "=r"(x[1]), "=r"(x[2]), "=r"(x[3])
                 : "r"(addr)
                 : "memory");
}

__device__ __forceinline__ void st_shared_v4(u32 addr, const u32 (&x)[4]) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(x[0]), "r"(x[1]), "r"(x[2]), "r"(x[3])
                 : "memory");
}
