// Launch parameters of the forward kernels (the Hopper one wraps them): one struct passed by
// value, and the sequence bounds every kernel reads from it. Shared by every kernel family.
// Mirrored field for field by `cuda::params::FwdParams` (Rust, #[repr(C)]): both sides assert the
// size; the Rust side also asserts the offsets of each group (NVRTC has no offsetof).
// Strides are in elements; every tensor's last dimension is contiguous.

struct FwdParams {
    const void* q;              // (rows, heads_q, head_dim) per batch entry
    const void* k;              // (rows, heads_kv, head_dim)
    const void* v;              // (rows, heads_kv, head_dim_v)
    void* o;                    // (rows, heads_q, head_dim_v), written
    float* lse;                 // [batch, heads_q, seqlen_q] or [heads_q, total_q]; null = not wanted
    const int* cu_seqlens_q;    // [batch + 1] or null (fixed-length batch)
    const int* cu_seqlens_k;    // [batch + 1] or null

    long long q_batch_stride, q_row_stride, q_head_stride;
    long long k_batch_stride, k_row_stride, k_head_stride;
    long long v_batch_stride, v_row_stride, v_head_stride;
    long long o_batch_stride, o_row_stride, o_head_stride;
    long long lse_batch_stride, lse_head_stride;

    int batch;
    int heads_q;
    int group;                  // heads_q / heads_kv
    int seqlen_q;               // fixed-length batches (ignored with cu_seqlens)
    int seqlen_k;
    int head_dim;               // real head dim, <= HEAD_DIM, multiple of 8
    int window_left;            // -1 = unbounded
    int window_right;           // -1 = unbounded
    int negate_q;               // 1 when the scale is negative: Q is negated, scales are |scale|
    int head_dim_v;             // real head dim of V and O, <= head_dim, multiple of 8
    float scale_log2;           // |scale| * log2(e), or log2(e) with softcap
    float softcap_scale;        // |scale| / softcap (softcap only)
    float softcap;              // 0 = none
    float lse_scale;            // ln(2) * scale_log2: score units -> natural log
};

#define FA4_PARAMS_SIZE 224
static_assert(sizeof(FwdParams) == FA4_PARAMS_SIZE, "FwdParams layout must match the Rust mirror");

// One sequence of the batch: its first query and key rows in the (packed) tensors and its
// lengths. Fixed-length batches index the batch axis instead and start at row 0. `packed`:
// the batch is varlen (cu_seqlens given); a kernel that knows it at compile time passes a
// constant and keeps one branch.
struct Seq {
    int q_start, q_len, k_start, k_len;
};

__device__ __forceinline__ Seq sequence(const FwdParams& p, int b, bool packed) {
    Seq s;
    if (packed) {
        s.q_start = p.cu_seqlens_q[b];
        s.k_start = p.cu_seqlens_k[b];
        s.q_len = p.cu_seqlens_q[b + 1] - s.q_start;
        s.k_len = p.cu_seqlens_k[b + 1] - s.k_start;
    } else {
        s.q_start = 0;
        s.q_len = p.seqlen_q;
        s.k_start = 0;
        s.k_len = p.seqlen_k;
    }
    return s;
}
