// Launch parameters of the backward kernels: the forward's params (inputs Q, K, V, O and LSE,
// their strides, the mask, cu_seqlens) and the backward's own tensors. Mirrored field for field
// by `cuda::backward::BwdParams` (Rust, #[repr(C)]); both sides assert the size.
// Strides are in elements; every tensor's last dimension is contiguous.

struct BwdParams {
    FwdParams f;                // o and lse are inputs here (the forward's outputs)
    const void* d_out;          // dO: O's dims, its own strides
    void* dq;                   // (rows, heads_q, head_dim), written
    void* dk;                   // (rows, heads_kv, head_dim), written
    void* dv;                   // (rows, heads_kv, head_dim), written
    float* dq_accum;            // (acc_rows, heads_q, HEAD_DIM) f32; null in deterministic mode
    float* dpsum;               // D = rowsum(dO·O): (acc_rows, heads_q) f32, or see stats_rows
    long long do_batch_stride, do_row_stride, do_head_stride;
    long long dq_batch_stride, dq_row_stride, dq_head_stride;
    long long dk_batch_stride, dk_row_stride, dk_head_stride;
    long long dv_batch_stride, dv_row_stride, dv_head_stride;
    long long acc_batch_rows;   // accumulator rows per batch entry (seqlen_q; 0 for varlen)
    float scale;                // the softmax scale, signed
    float softcap;              // 0 = none
    float inv_softcap;          // 1 / softcap
    int stats_rows;             // > 0 (the Hopper main kernel): `pre` writes D, then LSE·LOG2E,
                                // each [batch][heads_q][stats_rows], into dpsum instead
};

#define FA4_BWD_PARAMS_SIZE 392
static_assert(sizeof(BwdParams) == FA4_BWD_PARAMS_SIZE, "BwdParams layout must match the Rust mirror");

// Row of query i of sequence (batch, s) in the f32 workspaces (dq_accum, dpsum).
__device__ __forceinline__ long long acc_row(const BwdParams& bp, int batch, const Seq& s, int i) {
    return batch * bp.acc_batch_rows + s.q_start + i;
}

// Query row i's LSE in log2 units, as the exponent P = exp2(s·LOG2E − lse2) subtracts: a row
// with no allowed key (LSE = −inf) gets +inf, so every P of the row is 0 (its gradients are 0).
__device__ __forceinline__ float lse_log2(const BwdParams& bp, int batch, int head, const Seq& s, int i) {
    const FwdParams& p = bp.f;
    const float lse = p.lse[batch * p.lse_batch_stride + head * p.lse_head_stride + s.q_start + i];
    return lse == NEG_INF ? -NEG_INF : lse * LOG2E;
}

// The score's exponent argument and the factor dS takes back to the raw product (the softcap
// derivative): x = scale·(q·k), capped to c·tanh(x / c) with derivative 1 − tanh².
__device__ __forceinline__ float capped(const BwdParams& bp, float raw, float& dsdx) {
    float x = raw * bp.scale;
    dsdx = 1.0f;
    if constexpr (HAS_SOFTCAP) {
        const float th = tanh_accurate(x * bp.inv_softcap);
        x = bp.softcap * th;
        dsdx = 1.0f - th * th;
    }
    return x;
}

// Whether (query i, key j) of a sequence is allowed (the forward's mask, docs/attention.md).
__device__ __forceinline__ bool allowed(const FwdParams& p, const Seq& s, int i, int j) {
    return i < s.q_len && j < s.k_len && j >= key_lo(p, s, i) && j < key_hi(p, s, i);
}
