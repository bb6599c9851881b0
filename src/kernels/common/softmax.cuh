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

// 2^x on the FMA units (FlashAttention-4): 2^x = 2^j · 2^f with j = round(x) (from the low
// mantissa bits of x + 1.5·2^23) and f = x − j in [−0.5, 0.5], 2^f by a minimax polynomial
// (fitted for this kernel: relative error 7.5e-5 at degree 3 for bf16, 2.7e-6 at degree 4 for
// fp16, below the rounding of P to 16 bits), and 2^j added to the exponent bits. Below 2^−126
// (masked scores are −inf) the result is 0, as ex2.approx.ftz gives; NaN stays NaN and +inf
// (an infinite score) +inf. Finite inputs are scores less the running max in log2 units: at
// most 0, or RESCALE_THRESHOLD with conditional rescaling (the bit trick holds up to 127).
__device__ __forceinline__ float exp2_poly(float x) {
    const float shifter = 12582912.0f;  // 1.5 · 2^23
    const float xc = fmaxf(x, -126.0f);
    const float t = xc + shifter;
    const float f = xc - (t - shifter);
    float y;
    if constexpr (IS_BF16) {
        y = fmaf(fmaf(fmaf(0.0551716685f, f, 0.242611140f), f, 0.693260968f), f, 0.999928057f);
    } else {
        y = fmaf(fmaf(fmaf(fmaf(0.00957010128f, f, 0.0559178628f), f, 0.240247443f), f, 0.693121791f), f,
                 0.999999285f);
    }
    const int j = __float_as_int(t) - __float_as_int(shifter);  // in [−126, 127]: x ≤ 127 is assumed
    const float r = __int_as_float(__float_as_int(y) + j * (1 << 23));
    return x < -126.0f ? 0.0f : x <= 127.0f ? r : x * -NEG_INF;  // NaN stays NaN, +inf is +inf
}
