// Launch parameters of the decode kernels (split-KV attention over a paged cache, and the combine
// of its splits): the forward's FwdParams for Q, O, LSE, the mask and the scale, plus the page
// table and the split workspace (and the fused combine's arrival counters, and an fp8 cache's
// scales). Mirrored by `cuda::decode::DecodeParams` (Rust, #[repr(C)]); both sides assert the
// size; also the paged sequence bounds and output rows the split kernels share. Needs
// `../common/params.cuh`.
//
// Reuse of the forward's fields: k/v are the caches (16-bit elements, or e4m3 bytes with
// KV_FP8); k_batch_stride/v_batch_stride are the page strides, k_row_stride/v_row_stride the
// slot strides (elements). seqlen_q is the fixed batch's query rows (ignored with
// cu_seqlens_q); seqlen_k and cu_seqlens_k are unused (seqlens_k).

struct DecodeParams {
    FwdParams p;
    const int* page_table;      // [batch, max_pages] row-major, validated for the used entries
    const int* seqlens_k;       // [batch]
    float* o_part;              // [num_splits, part_rows, head_dim] f32, normalised partial O
    float* lse_part;            // [num_splits, part_rows] f32, natural log; -inf = no key
    long long part_rows;        // total query rows × heads_q: rows of one split's slab
    int page_size;
    int max_pages;
    int num_splits;             // 1: the split kernel writes O and LSE directly
    int pad1;
    unsigned int* counters;     // FUSE: [grid.x · grid.y] arrivals per row tile, 0 between launches
    const float* k_scale;       // KV_FP8: [heads_kv] what a K byte's unit stands for (null otherwise)
    const float* v_scale;       // KV_FP8: [heads_kv], likewise for V
};

#define FA4_DECODE_PARAMS_SIZE 304
static_assert(sizeof(DecodeParams) == FA4_DECODE_PARAMS_SIZE, "DecodeParams layout must match the Rust mirror");

// Where packed query row `i` (of sequence b's own rows) of head `head` lands: the batch index and
// row of O's and LSE's layouts, and the row of the split workspace. Fixed batches index the batch
// axis; varlen ones have one batch entry and the sequence's rows start at q_start.
struct OutRow {
    long long o_off;    // element offset in O (column 0)
    long long lse_off;  // element offset in LSE
    long long part_row; // row of the split workspace
};

__device__ __forceinline__ OutRow out_row(const FwdParams& p, const Seq& s, int b, int i, int head) {
    const bool packed = p.cu_seqlens_q != nullptr;
    const long long bi = packed ? 0 : b;
    const long long qi = s.q_start + i;
    OutRow r;
    r.o_off = bi * p.o_batch_stride + qi * p.o_row_stride + head * p.o_head_stride;
    r.lse_off = bi * p.lse_batch_stride + head * p.lse_head_stride + qi;
    const long long q_row = packed ? qi : bi * p.seqlen_q + qi;  // row among all query rows
    r.part_row = q_row * p.heads_q + head;
    return r;
}

// The sequence's query bounds (fixed or varlen) and its keys (seqlens_k; keys live in pages).
__device__ __forceinline__ Seq paged_sequence(const DecodeParams& d, int b) {
    Seq s = sequence(d.p, b, false);
    if (d.p.cu_seqlens_q != nullptr) {
        s.q_start = d.p.cu_seqlens_q[b];
        s.q_len = d.p.cu_seqlens_q[b + 1] - s.q_start;
    }
    s.k_start = 0;
    s.k_len = d.seqlens_k[b];
    return s;
}

// The scores' scale in log2 units (the softmax's) and the softcap's pre-tanh factor of a KV
// head's rows: the params', times an fp8 cache's k_scale of the head with KV_FP8 (with softcap
// the scale goes before the tanh). The kernels call these where they use them: a local copy of
// the param field changed the 16-bit split kernel's code (ptxas held it in a register instead
// of reading it as a constant operand; NVRTC 13.0, sm_90a).
__device__ __forceinline__ float scores_scale_log2(const FwdParams& p, float k_scale) {
#if KV_FP8
    return HAS_SOFTCAP ? p.scale_log2 : p.scale_log2 * k_scale;
#else
    return p.scale_log2;
#endif
}
__device__ __forceinline__ float scores_softcap_scale(const FwdParams& p, float k_scale) {
#if KV_FP8
    return p.softcap_scale * k_scale;
#else
    return p.softcap_scale;
#endif
}

// Page-table index and slot of key `key` (>= 0) for pages of `page_size` (>= 1) keys: a shift and
// a mask for a power-of-two size (16, 64, 256: what serving engines use), an unsigned division
// otherwise. The signed `key / page_size` and `key % page_size` took about 35 instructions per
// key row of a gather (most of a decode block's integer work on the H200).
__device__ __forceinline__ void page_slot(int key, int page_size, u32& index, u32& slot) {
    const u32 k = static_cast<u32>(key), ps = static_cast<u32>(page_size);
    if ((ps & (ps - 1)) == 0) {
        index = k >> (__ffs(page_size) - 1);
        slot = k & (ps - 1);
    } else {
        index = k / ps;
        slot = k - index * ps;
    }
}
