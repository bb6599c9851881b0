// PTX wrappers of the decode "heads" kernel's bulk-copy path (`heads.cu` with BULK, sm_90 and
// later): the 1-D bulk copy from global to shared memory that completes on an mbarrier's
// transaction count, the mbarrier init/arm/wait it needs, and the fences. Included only with
// BULK, so sm_80 builds never see these instructions. (The Hopper forward's own wrappers live in
// `../sm90/ptx.cuh`, which needs the tensor-map params this kernel does not use.)

__device__ __forceinline__ void mbar_init_count(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
// Makes the barriers' initialisation visible to the async proxy and the other threads.
__device__ __forceinline__ void fence_barrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// Arrives once and adds `bytes` to the transaction count the current phase waits for.
__device__ __forceinline__ void mbar_expect_tx_bytes(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Waits until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbar_wait_parity(u32 bar, u32 parity) {
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
// Orders this thread's generic-proxy shared-memory writes before later async-proxy ones.
__device__ __forceinline__ void fence_proxy_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// `bytes` (a multiple of 16; both addresses 16-byte aligned) from global `src` to shared `dst`,
// completing `bytes` of `bar`'s transaction count.
__device__ __forceinline__ void bulk_copy_g2s(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
        "l"(src), "r"(bytes), "r"(bar)
        : "memory");
}
