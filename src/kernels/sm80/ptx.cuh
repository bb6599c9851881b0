// PTX wrappers of the Ampere-class kernel (sm_80 and later): cp.async copies, ldmatrix,
// mma.sync m16n8k16 and the vector shared/global accesses of its prologue and epilogue. Needs
// `../common/base.cuh` (u32, IS_BF16). Every `asm` of the kernel is here, so that its `.cu`
// file reads as the algorithm.

// 16-byte async copy; src_bytes = 0 zero-fills the destination (rows/cols out of range).
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// D = A·B + D, m16n8k16, A row-major (4 regs), B column-major (2 regs), D f32 (4 regs).
__device__ __forceinline__ void mma_16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    if constexpr (IS_BF16) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
            "{%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
            "{%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

// A value the compiler must treat as new on every use: keeps loop-invariant code motion from
// turning each copy's address into its own 64-bit induction variable. Without it the K/V loads
// of the two-tile d128 kernel held 14 precomputed pointers across the key loop and spilled them
// (280 B of spill stores).
__device__ __forceinline__ long long opaque(long long x) {
    long long y;
    asm volatile("mov.b64 %0, %1;\n" : "=l"(y) : "l"(x));
    return y;
}

__device__ __forceinline__ void ld_shared_v4(u32 (&x)[4], u32 addr) {
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n" : "=r"(x[0]), "=r"(x[1]), "=r"(x[2]), "=r"(x[3]) : "r"(addr));
}
__device__ __forceinline__ void st_shared_v4(u32 addr, u32 x0, u32 x1, u32 x2, u32 x3) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(x0), "r"(x1), "r"(x2), "r"(x3));
}
__device__ __forceinline__ void st_shared_b32(u32 addr, u32 v) {
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v));
}
__device__ __forceinline__ void st_global_v4(void* dst, const u32 (&x)[4]) {
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "r"(x[0]), "r"(x[1]), "r"(x[2]), "r"(x[3]));
}
