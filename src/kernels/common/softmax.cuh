// The online softmax of every kernel family, per query row: the running-max update with its
// correction of the earlier partial sums, the exponent of each score, the sum over a quad of
// lanes and the epilogue's 1/sum and LSE. Needs the prelude's LAZY_RESCALE. A row's state is its
// max of raw scores (before scale_log2) and its partial sum over this thread's columns.

// A row's new running max after a block whose scores' max is `mx`; returns the shift that the
// block's exponents subtract (`exp2(s · scale_log2 − shift)`) and sets `corr`, the factor that
// the row's earlier sum and O take.
__device__ __forceinline__ float update_row_max(float& row_max, float mx, float scale_log2, float& corr) {
    // With LAZY_RESCALE a row keeps its stale max unless the new one is more than
    // 2^RESCALE_THRESHOLD larger (from −inf it always moves; −inf to −inf is NaN: stays).
    const bool move = !LAZY_RESCALE || (mx - row_max) * scale_log2 > RESCALE_THRESHOLD;
    const float m_new = move ? mx : row_max;
    // An infinite max shifts by 0, as the spec's formula: a row with no allowed key so far
    // (−inf) gets exp2(−inf) = 0; an infinite score (+inf) makes the sum and LSE +inf, O NaN.
    const float shift = fabsf(m_new) == -NEG_INF ? 0.0f : m_new * scale_log2;
    corr = move ? exp2_approx(row_max * scale_log2 - shift) : 1.0f;
    row_max = m_new;
    return shift;
}

// The exponent (log2 units) of score s in a block whose row shift is `shift`.
__device__ __forceinline__ float score_exponent(float s, float scale_log2, float shift) {
    return fmaf(s, scale_log2, -shift);
}

// Max and sum over the 4 lanes of a quad, which share a row in the mma/wgmma accumulator layouts.
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Epilogue of a row with the quad's whole sum: the factor O takes (0 for a row with no allowed
// key, whose O is 0).
__device__ __forceinline__ float row_inv_sum(float sum) { return sum == 0.0f ? 0.0f : 1.0f / sum; }

// The row's log-sum-exp in natural-log units: −inf for no allowed key; NaN propagates.
__device__ __forceinline__ float row_lse(float row_max, float sum, float lse_scale) {
    float lse = sum == 0.0f ? NEG_INF : row_max * lse_scale + __logf(sum);
    if (sum != sum) lse = sum;
    return lse;
}
