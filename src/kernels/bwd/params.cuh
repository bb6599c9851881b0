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
                                // padded (`stats_base`), into dpsum instead
    int stats_block;            // the Hopper main kernel's BLOCK_M: the padding of a varlen
                                // batch's sequences in that layout
};

#define FA4_BWD_PARAMS_SIZE 400
static_assert(sizeof(BwdParams) == FA4_BWD_PARAMS_SIZE, "BwdParams layout must match the Rust mirror");

// The Hopper main kernel's padded layout of the row statistics (D, then LSE·LOG2E) and of its
// dQ accumulator (`stats_rows` > 0): query row i of sequence b and head h is row
// stats_base(b) + h·stats_rows + i. Fixed-length batches: [batch][heads_q][stats_rows], every
// sequence its rows rounded up to whole blocks. Varlen batches: [heads_q][stats_rows], sequence
// b from row B·⌊(cu_q[b] + b·B) / B⌋ (B = stats_block), which leaves it its rows rounded up
// to whole blocks before the next one starts, and stats_rows = that start for b = batch.
// `block` is stats_block (the main kernel passes its BLOCK_M, a constant). The planner keeps
// stats_rows below 2^31, so cu_q[b] + b·B fits 32 unsigned bits.
__device__ __forceinline__ long long stats_base(const BwdParams& bp, int b, int block) {
    const FwdParams& p = bp.f;
    if (p.cu_seqlens_q == nullptr) return static_cast<long long>(b) * p.heads_q * bp.stats_rows;
    const unsigned start = static_cast<unsigned>(p.cu_seqlens_q[b]) + static_cast<unsigned>(b) * block;
    return start / static_cast<unsigned>(block) * block;
}
// Where LSE·LOG2E starts, after D (and after both, the main kernel's tile counter).
__device__ __forceinline__ long long stats_half(const BwdParams& bp) {
    const int entries = bp.f.cu_seqlens_q == nullptr ? bp.f.batch : 1;
    return static_cast<long long>(entries) * bp.f.heads_q * bp.stats_rows;
}
// The padded rows of sequence `s` (its queries rounded up to whole blocks; `pre` writes them all).
__device__ __forceinline__ int stats_len(const BwdParams& bp, const Seq& s) {
    if (bp.f.cu_seqlens_q == nullptr) return bp.stats_rows;
    return (s.q_len + bp.stats_block - 1) / bp.stats_block * bp.stats_block;
}

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
