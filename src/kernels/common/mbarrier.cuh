// mbarrier and proxy-fence wrappers (sm_90 and later: `try_wait.parity`, `expect_tx`), and the
// 1-D bulk copy that completes on an mbarrier's transaction count. Shared by the Hopper kernels
// (before `../sm90/ptx.cuh`, whose TMA loads complete on these barriers), the Blackwell kernel and
// the decode all-heads kernel's bulk path (`../decode/heads.cu` with BULK). Needs `base.cuh`.

// ---- mbarriers (shared::cta, 64-bit; addresses are shared-window u32) ----

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
// Arrive once and add `bytes` to the transaction count the phase waits for (the TMA loads).
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Waits until the phase with parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n"
        "}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}

// ---- fences ----

// Makes barrier initialisation visible to the async proxy (TMA) and the other threads.
__device__ __forceinline__ void fence_mbarrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// Orders this thread's generic-proxy shared-memory writes before later async-proxy accesses
// (TMA, wgmma operands).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// ---- 1-D bulk copy ----

// `bytes` (a multiple of 16; both addresses 16-byte aligned) from global `src` to shared `dst`,
// completing `bytes` of `bar`'s transaction count.
__device__ __forceinline__ void bulk_copy_g2s(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
        "l"(src), "r"(bytes), "r"(bar)
        : "memory");
}
