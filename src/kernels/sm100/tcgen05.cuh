// PTX wrappers of the Blackwell (sm_100a) fifth-generation tensor core: tensor memory (TMEM)
// allocation, the MMA with its instruction and shared-memory descriptors, the commit that
// arrives on an mbarrier once the MMAs issued before it are done, TMEM loads and stores, and the
// fences that order them against thread synchronisation. mbarriers and TMA come from the shared
// layer (`../sm90/ptx.cuh`), which sm_100a runs unchanged. Needs `../common/base.cuh`.
//
// A TMEM address is (lane << 16) | column; each warp of a warpgroup reaches the 32 lanes of its
// sub-partition (warp % 4), so a warpgroup's thread t owns lane t: one accumulator row.

// ---- allocation (one warp) ----

// Allocates `COLS` columns (a power of two, 32 ..= 512) and writes the base address to `slot`.
template <int COLS>
__device__ __forceinline__ void tmem_alloc(u32 slot) {
    static_assert(COLS >= 32 && COLS <= 512 && (COLS & (COLS - 1)) == 0, "TMEM columns: a power of two");
    asm volatile("tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [%0], %1;\n" ::"r"(slot), "n"(COLS)
                 : "memory");
    asm volatile("tcgen05.relinquish_alloc_permit.cta_group::1.sync.aligned;\n" ::: "memory");
}
template <int COLS>
__device__ __forceinline__ void tmem_dealloc(u32 taddr) {
    asm volatile("tcgen05.dealloc.cta_group::1.sync.aligned.b32 %0, %1;\n" ::"r"(taddr), "n"(COLS) : "memory");
}

// ---- fences around thread synchronisation (mbarrier waits and arrivals, bar.sync) ----

// Before signalling another thread about this thread's tcgen05 work (ld/st/mma issue).
__device__ __forceinline__ void tc_fence_before() { asm volatile("tcgen05.fence::before_thread_sync;\n" ::: "memory"); }
// After waiting for another thread's signal, before this thread's tcgen05 work.
__device__ __forceinline__ void tc_fence_after() { asm volatile("tcgen05.fence::after_thread_sync;\n" ::: "memory"); }

// ---- descriptors ----

// Instruction descriptor of `kind::f16` with an f32 accumulator: A and B fp16 or bf16 (IS_BF16),
// A K-major, B K-major or (`b_mn_major`) N-major, shape M × N.
__host__ __device__ constexpr u32 idesc_f16(int m, int n, bool b_mn_major) {
    return (1u << 4)                                   // D: f32
           | ((IS_BF16 ? 1u : 0u) << 7)                // A type
           | ((IS_BF16 ? 1u : 0u) << 10)               // B type
           | ((b_mn_major ? 1u : 0u) << 16)            // B transposed (N-major)
           | (static_cast<u32>(n >> 3) << 17)          // N >> 3
           | (static_cast<u32>(m >> 4) << 24);         // M >> 4
}

// Shared-memory descriptor of a 128-byte-swizzled operand: start address, leading and stride
// byte offsets (each >> 4), the fixed version field of tcgen05 descriptors (bits 46–48 = 1), base
// offset 0 (tiles are 1024-aligned) and the 128-byte swizzle (layout type 2, bits 61–63).
__device__ __forceinline__ u64 umma_desc_sw128(u32 addr, u32 lbo, u32 sbo) {
    return static_cast<u64>((addr & 0x3FFFF) >> 4) | (static_cast<u64>((lbo & 0x3FFFF) >> 4) << 16) |
           (static_cast<u64>((sbo & 0x3FFFF) >> 4) << 32) | (1ull << 46) | (2ull << 61);
}

// ---- MMA (one thread issues) ----

// D[tmem] (+)= A[smem] · B[smem]; `accumulate` = 0 overwrites D.
__device__ __forceinline__ void umma_ss(u32 d_tmem, u64 a_desc, u64 b_desc, u32 idesc, u32 accumulate) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %4, 0;\n"
        "tcgen05.mma.cta_group::1.kind::f16 [%0], %1, %2, %3, p;\n"
        "}\n" ::"r"(d_tmem),
        "l"(a_desc), "l"(b_desc), "r"(idesc), "r"(accumulate)
        : "memory");
}
// D[tmem] (+)= A[tmem] · B[smem] (A: 16-bit values packed two per column).
__device__ __forceinline__ void umma_ts(u32 d_tmem, u32 a_tmem, u64 b_desc, u32 idesc, u32 accumulate) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %4, 0;\n"
        "tcgen05.mma.cta_group::1.kind::f16 [%0], [%1], %2, %3, p;\n"
        "}\n" ::"r"(d_tmem),
        "r"(a_tmem), "l"(b_desc), "r"(idesc), "r"(accumulate)
        : "memory");
}
// One arrival on `bar` once every MMA this thread issued before has completed.
__device__ __forceinline__ void umma_commit(u32 bar) {
    asm volatile("tcgen05.commit.cta_group::1.mbarrier::arrive::one.shared::cluster.b64 [%0];\n" ::"r"(bar)
                 : "memory");
}

// ---- TMEM loads and stores (a warp, 32 lanes × columns) ----

// 32 consecutive columns of this thread's lane.
__device__ __forceinline__ void tmem_ld32(u32 taddr, float (&v)[32]) {
    u32 r[32];
    asm volatile(
        "tcgen05.ld.sync.aligned.32x32b.x32.b32 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, "
        "%15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, [%32];\n"
        : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]), "=r"(r[4]), "=r"(r[5]), "=r"(r[6]), "=r"(r[7]),
          "=r"(r[8]), "=r"(r[9]), "=r"(r[10]), "=r"(r[11]), "=r"(r[12]), "=r"(r[13]), "=r"(r[14]), "=r"(r[15]),
          "=r"(r[16]), "=r"(r[17]), "=r"(r[18]), "=r"(r[19]), "=r"(r[20]), "=r"(r[21]), "=r"(r[22]), "=r"(r[23]),
          "=r"(r[24]), "=r"(r[25]), "=r"(r[26]), "=r"(r[27]), "=r"(r[28]), "=r"(r[29]), "=r"(r[30]), "=r"(r[31])
        : "r"(taddr)
        : "memory");
    asm volatile("tcgen05.wait::ld.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int i = 0; i < 32; ++i) v[i] = __uint_as_float(r[i]);
}
// One column of this thread's lane.
__device__ __forceinline__ float tmem_ld1(u32 taddr) {
    u32 r;
    asm volatile("tcgen05.ld.sync.aligned.32x32b.x1.b32 {%0}, [%1];\n" : "=r"(r) : "r"(taddr) : "memory");
    asm volatile("tcgen05.wait::ld.sync.aligned;\n" ::: "memory");
    return __uint_as_float(r);
}
__device__ __forceinline__ void tmem_st32(u32 taddr, const float (&v)[32]) {
    asm volatile(
        "tcgen05.st.sync.aligned.32x32b.x32.b32 [%0], {%1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, "
        "%15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32};\n" ::"r"(taddr),
        "f"(v[0]), "f"(v[1]), "f"(v[2]), "f"(v[3]), "f"(v[4]), "f"(v[5]), "f"(v[6]), "f"(v[7]), "f"(v[8]),
        "f"(v[9]), "f"(v[10]), "f"(v[11]), "f"(v[12]), "f"(v[13]), "f"(v[14]), "f"(v[15]), "f"(v[16]),
        "f"(v[17]), "f"(v[18]), "f"(v[19]), "f"(v[20]), "f"(v[21]), "f"(v[22]), "f"(v[23]), "f"(v[24]),
        "f"(v[25]), "f"(v[26]), "f"(v[27]), "f"(v[28]), "f"(v[29]), "f"(v[30]), "f"(v[31])
        : "memory");
}
// 16 consecutive columns (32 packed 16-bit values) of this thread's lane.
__device__ __forceinline__ void tmem_st16(u32 taddr, const u32 (&v)[16]) {
    asm volatile(
        "tcgen05.st.sync.aligned.32x32b.x16.b32 [%0], {%1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, "
        "%14, %15, %16};\n" ::"r"(taddr),
        "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3]), "r"(v[4]), "r"(v[5]), "r"(v[6]), "r"(v[7]), "r"(v[8]),
        "r"(v[9]), "r"(v[10]), "r"(v[11]), "r"(v[12]), "r"(v[13]), "r"(v[14]), "r"(v[15])
        : "memory");
}
__device__ __forceinline__ void tmem_st1(u32 taddr, float v) {
    asm volatile("tcgen05.st.sync.aligned.32x32b.x1.b32 [%0], {%1};\n" ::"r"(taddr), "f"(v) : "memory");
}
// Waits until this thread's TMEM stores are done (before signalling their consumer).
__device__ __forceinline__ void tmem_wait_st() { asm volatile("tcgen05.wait::st.sync.aligned;\n" ::: "memory"); }
