// PTX wrappers of the Hopper backward beyond the Hopper layer (`../sm90/ptx.cuh`, which also
// holds `desc_plus`): the bulk reduction of a dQ tile from shared memory into the f32
// accumulator, and the 16-byte shared-memory accesses of the non-finite cleaning and the dQ
// tile's stores (the 4-byte `st_shared_b32` of the dSᵀ stores and the bulk-group commit and read
// wait are the Hopper layer's). (`../bwd/ptx.cuh` holds the Ampere-class kernel's register
// reduction but also a `st_global_b32` that the Hopper layer defines too, so it is not included
// here.)

// dst[0 .. bytes / 4) += src[0 .. bytes / 4) (f32, element by element, as atomic adds in
// global memory), read from shared memory by the TMA unit in this thread's bulk async-group.
// dst and src 16-byte aligned, bytes a multiple of 16.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, u32 src, u32 bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst), "r"(src),
                 "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void st_shared_v4f(u32 addr, float a, float b, float c, float d) {
    asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
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


// dst[0 .. 4) += {a, b, c, d} (f32, one vector reduction, no return value; sm_90). dst 16-byte
// aligned.
__device__ __forceinline__ void red_add_v4f(float* dst, float a, float b, float c, float d) {
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "f"(a), "f"(b), "f"(c), "f"(d)
                 : "memory");
}

// The deterministic mode's semaphores (one int per query block, in global memory): a read with
// acquire semantics at GPU scope (what the adds of earlier turns wrote is visible after it), and
// an increment with release semantics (what this thread's adds, and those it has synchronised
// with, wrote is visible before it).
__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void red_release_gpu_add(int* p, int v) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
// Waits until at most N of this thread's bulk groups are incomplete: their global writes done
// (not only their shared-memory reads, as `bulk_wait_read`).
template <int N>
__device__ __forceinline__ void bulk_wait() {
    asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

// 8-byte shared-memory accesses at an 8-byte aligned address (the dQ writer's notes).
__device__ __forceinline__ void st_shared_s64(u32 addr, long long v) {
    asm volatile("st.shared.b64 [%0], %1;\n" ::"r"(addr), "l"(v) : "memory");
}
__device__ __forceinline__ long long ld_shared_s64(u32 addr) {
    long long v;
    asm volatile("ld.shared.b64 %0, [%1];\n" : "=l"(v) : "r"(addr) : "memory");
    return v;
}
