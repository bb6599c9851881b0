//! Vectorisable primitives of the CPU kernels: register-blocked GEMM microkernels, a
//! polynomial `exp2`, and the generic FMA-peak loop.
//!
//! Everything here is `#[inline(always)]` safe Rust over fixed-size arrays, written so that LLVM
//! keeps the accumulators in registers and emits `vbroadcastss` + `vfmadd231ps` with a memory
//! operand: 24 `zmm` accumulators per AVX-512 tile, 12 `ymm` per AVX2 tile (checked with
//! `objdump -d` on the `fa4` binary: the `simd::run_avx512`/`run_avx2` instances hold only
//! `zmm`/`ymm` FMAs and no call to `fmaf`). The instruction set comes from the caller: see
//! [`super::simd`]. A closure or a helper without `#[inline(always)]` would be compiled on its
//! own, without those target features: one such closure made the backend 50× slower.
//!
//! In L1, at the inner sizes the backend uses (64 and 96), the tiles run at 94–99% of the FMA
//! peak with AVX-512 and 91–99% with AVX2 (`cargo test --release --lib microkernel_gflops --
//! --ignored --nocapture`).

use std::array;

use super::simd::{Init, Simd};
use crate::tensor::Element;

/// `log2(e)`, to turn natural-log scores into `exp2` arguments.
pub(crate) const LOG2E: f32 = std::f32::consts::LOG2_E;

/// Largest row maximum |m| for which the softmax may subtract it in log2 units rounded to f32,
/// `exp2(fma(s, log2e, −round(m·log2e)))`: below 2^22, `m·log2e < 2^23` rounds by at most ¼, so
/// the row's largest P stays within 2^±¼ of 1. Beyond it the kernels subtract first,
/// `exp2((s − m)·log2e)`, which is exact for any finite scores and costs one more operation.
pub(crate) const FAST_MAX_SCORE: f32 = 4_194_304.0; // 2^22

/// The accumulators' start: zero, or C with row `r` scaled by `scale[r]`.
#[inline(always)]
fn load_acc<const MR: usize, const NR: usize>(
    c: &[f32],
    ldc: usize,
    scale: Option<&[f32]>,
) -> [[f32; NR]; MR] {
    // Plain loops: `array::from_fn` here was left out of line, compiled without the caller's
    // target features.
    let mut acc = [[0.0; NR]; MR];
    if let Some(s) = scale {
        for (r, a) in acc.iter_mut().enumerate() {
            let (row, s) = (&c[r * ldc..r * ldc + NR], s[r]);
            for (x, &y) in a.iter_mut().zip(row) {
                *x = y * s;
            }
        }
    }
    acc
}

/// Writes (or, `ADD`, adds) the accumulators to C. `ADD` is a constant: with the choice made at
/// run time inside the kernel, LLVM kept `acc` in memory and spilled every FMA's result.
#[inline(always)]
fn store_acc<const MR: usize, const NR: usize, const ADD: bool>(
    acc: &[[f32; NR]; MR],
    c: &mut [f32],
    ldc: usize,
) {
    for (r, a) in acc.iter().enumerate() {
        let row = &mut c[r * ldc..r * ldc + NR];
        if ADD {
            for (x, &y) in row.iter_mut().zip(a) {
                *x += y;
            }
        } else {
            row.copy_from_slice(a);
        }
    }
}

#[inline(always)]
fn widen_row<B: Element, const NR: usize>(brow: &[B]) -> [f32; NR] {
    let mut bv = [0f32; NR];
    for (x, y) in bv.iter_mut().zip(&brow[..NR]) {
        *x = y.to_f32();
    }
    bv
}

/// `C[r][j] = init(C)[r][j] + Σ_{p<k} A[r·lda + p] · B[p·ldb + j]` for `r < MR`, `j < NR`:
/// A by rows (K, Q or P rows), B by rows (Qᵀ, Kᵀ or V rows).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn micro_rows<S: Simd, A: Element, B: Element, const MR: usize, const NR: usize>(
    k: usize,
    a: &[A],
    lda: usize,
    b: &[B],
    ldb: usize,
    c: &mut [f32],
    ldc: usize,
    init: Init,
) {
    match init {
        Init::Zero => micro_rows_k::<S, A, B, MR, NR, false>(k, a, lda, b, ldb, c, ldc, None),
        Init::Add => micro_rows_k::<S, A, B, MR, NR, true>(k, a, lda, b, ldb, c, ldc, None),
        Init::Scale(s) => {
            micro_rows_k::<S, A, B, MR, NR, false>(k, a, lda, b, ldb, c, ldc, Some(s))
        }
    }
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn micro_rows_k<
    S: Simd,
    A: Element,
    B: Element,
    const MR: usize,
    const NR: usize,
    const ADD: bool,
>(
    k: usize,
    a: &[A],
    lda: usize,
    b: &[B],
    ldb: usize,
    c: &mut [f32],
    ldc: usize,
    scale: Option<&[f32]>,
) {
    let mut acc = load_acc::<MR, NR>(c, ldc, scale);
    let mut arows: [&[A]; MR] = [&[]; MR];
    for (r, row) in arows.iter_mut().enumerate() {
        *row = &a[r * lda..r * lda + k];
    }
    for p in 0..k {
        let bv = widen_row::<B, NR>(&b[p * ldb..]);
        for r in 0..MR {
            let x = arows[r][p].to_f32();
            for j in 0..NR {
                acc[r][j] = S::fmadd(x, bv[j], acc[r][j]);
            }
        }
    }
    store_acc::<MR, NR, ADD>(&acc, c, ldc);
}

/// [`micro_rows`] with `BANKS` accumulator banks, product `p` going to bank `p % BANKS`, added
/// at the end: every rounding chain is `BANKS` times shorter, for the register traffic of a
/// tile `BANKS` times smaller.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn micro_rows_banked<
    S: Simd,
    A: Element,
    B: Element,
    const MR: usize,
    const NR: usize,
    const BANKS: usize,
>(
    k: usize,
    a: &[A],
    lda: usize,
    b: &[B],
    ldb: usize,
    c: &mut [f32],
    ldc: usize,
    init: Init,
) {
    match init {
        Init::Zero => {
            micro_rows_banked_k::<S, A, B, MR, NR, BANKS, false>(k, a, lda, b, ldb, c, ldc, None)
        }
        Init::Add => {
            micro_rows_banked_k::<S, A, B, MR, NR, BANKS, true>(k, a, lda, b, ldb, c, ldc, None)
        }
        Init::Scale(s) => {
            micro_rows_banked_k::<S, A, B, MR, NR, BANKS, false>(k, a, lda, b, ldb, c, ldc, Some(s))
        }
    }
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn micro_rows_banked_k<
    S: Simd,
    A: Element,
    B: Element,
    const MR: usize,
    const NR: usize,
    const BANKS: usize,
    const ADD: bool,
>(
    k: usize,
    a: &[A],
    lda: usize,
    b: &[B],
    ldb: usize,
    c: &mut [f32],
    ldc: usize,
    scale: Option<&[f32]>,
) {
    let mut acc = [[[0f32; NR]; MR]; BANKS];
    acc[0] = load_acc::<MR, NR>(c, ldc, scale);
    let mut arows: [&[A]; MR] = [&[]; MR];
    for (r, row) in arows.iter_mut().enumerate() {
        *row = &a[r * lda..r * lda + k];
    }
    let mut p = 0;
    while p + BANKS <= k {
        for (bk, acc) in acc.iter_mut().enumerate() {
            let bv = widen_row::<B, NR>(&b[(p + bk) * ldb..]);
            for r in 0..MR {
                let x = arows[r][p + bk].to_f32();
                for j in 0..NR {
                    acc[r][j] = S::fmadd(x, bv[j], acc[r][j]);
                }
            }
        }
        p += BANKS;
    }
    for (bk, p) in (p..k).enumerate() {
        let bv = widen_row::<B, NR>(&b[p * ldb..]);
        for r in 0..MR {
            let x = arows[r][p].to_f32();
            for j in 0..NR {
                acc[bk][r][j] = S::fmadd(x, bv[j], acc[bk][r][j]);
            }
        }
    }
    let (first, rest) = acc.split_at_mut(1);
    for other in rest.iter() {
        for (a, o) in first[0].iter_mut().zip(other) {
            for (x, &y) in a.iter_mut().zip(o) {
                *x += y;
            }
        }
    }
    store_acc::<MR, NR, ADD>(&first[0], c, ldc);
}

/// `C[r][j] = init(C)[r][j] + Σ_{p<k} A[p·lda + r] · B[p·ldb + j]`: A by columns (the
/// transposed probability tile, one key per row), B by rows (V rows).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn micro_cols<S: Simd, B: Element, const MR: usize, const NR: usize>(
    k: usize,
    a: &[f32],
    lda: usize,
    b: &[B],
    ldb: usize,
    c: &mut [f32],
    ldc: usize,
    init: Init,
) {
    match init {
        Init::Zero => micro_cols_k::<S, B, MR, NR, false>(k, a, lda, b, ldb, c, ldc, None),
        Init::Add => micro_cols_k::<S, B, MR, NR, true>(k, a, lda, b, ldb, c, ldc, None),
        Init::Scale(s) => micro_cols_k::<S, B, MR, NR, false>(k, a, lda, b, ldb, c, ldc, Some(s)),
    }
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn micro_cols_k<S: Simd, B: Element, const MR: usize, const NR: usize, const ADD: bool>(
    k: usize,
    a: &[f32],
    lda: usize,
    b: &[B],
    ldb: usize,
    c: &mut [f32],
    ldc: usize,
    scale: Option<&[f32]>,
) {
    let mut acc = load_acc::<MR, NR>(c, ldc, scale);
    for p in 0..k {
        let acol = &a[p * lda..p * lda + MR];
        let bv = widen_row::<B, NR>(&b[p * ldb..]);
        for r in 0..MR {
            let x = acol[r];
            for j in 0..NR {
                acc[r][j] = S::fmadd(x, bv[j], acc[r][j]);
            }
        }
    }
    store_acc::<MR, NR, ADD>(&acc, c, ldc);
}

/// `C (+)= A·B` for an `m × n` tile of C (row stride `ldc`), A `m × k` by rows (`lda`), B
/// `k × n` by rows (`ldb`): column strips of `SNR`, then `LANES`, then 1; within a strip, the
/// (two-bank) score tiles of `SMR` rows, then single rows. The strip of B stays in L1 across
/// row tiles. (The 12 × 32 single-bank tile, with its result added to C, came out with its
/// accumulators spilled on every FMA.)
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_rows<S: Simd, A: Element>(
    m: usize,
    n: usize,
    k: usize,
    a: &[A],
    lda: usize,
    b: &[f32],
    ldb: usize,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
) {
    let init = if accumulate { Init::Add } else { Init::Zero };
    let mut c0 = 0;
    while c0 < n {
        let w = if c0 + S::SNR <= n {
            S::SNR
        } else if c0 + S::LANES <= n {
            S::LANES
        } else {
            1
        };
        let bs = &b[c0..];
        let mut r0 = 0;
        if w == S::SNR {
            while r0 + S::SMR <= m {
                let (ar, cr) = (&a[r0 * lda..], &mut c[r0 * ldc + c0..]);
                S::scores_mn(k, ar, lda, bs, ldb, cr, ldc, init);
                r0 += S::SMR;
            }
        }
        for r0 in r0..m {
            let (ar, cr) = (&a[r0 * lda..], &mut c[r0 * ldc + c0..]);
            if w == S::SNR {
                S::scores_1n(k, ar, lda, bs, ldb, cr, ldc, init);
            } else if w == S::LANES {
                S::rows_1w(k, ar, lda, bs, ldb, cr, ldc, init);
            } else {
                S::rows_11(k, ar, lda, bs, ldb, cr, ldc, init);
            }
        }
        c0 += w;
    }
}

/// `2^x` to about 1e-7 relative, vectorisable: `2^x = 2^n · 2^f`, `n = round(x)`,
/// `f ∈ [−½, ½]`, `2^f` by a degree-6 polynomial (least squares in relative error; its constant
/// term is exactly 1, so `exp2(0) = 1`). NaN stays NaN, `x < −126` gives 0 (subnormal results
/// are flushed: they are below 2^−126 of the row maximum), `x > 127` gives +∞.
#[inline(always)]
pub(crate) fn exp2<S: Simd>(x: f32) -> f32 {
    // Rounds to nearest by pushing the fraction out of the mantissa: for |x| < 2^22 the low
    // mantissa bits of `x + ROUND` are `n` (two's complement).
    const ROUND: f32 = 12_582_912.0; // 1.5 · 2^23
    const C: [f32; 6] = [
        std::f32::consts::LN_2, // the fit lands on ln 2 itself
        0.240_226_48,
        0.055_503_29,
        0.009_618_374,
        0.001_339_985_8,
        0.000_153_707_15,
    ];
    // `if` rather than `max`/`min`: a NaN must go through, not be replaced by the bound.
    let xc = if x < -126.0 { -126.0 } else { x };
    let xc = if xc > 127.0 { 127.0 } else { xc };
    let t = xc + ROUND;
    let n = t - ROUND;
    let f = xc - n;
    let mut p = C[5];
    p = S::fmadd(p, f, C[4]);
    p = S::fmadd(p, f, C[3]);
    p = S::fmadd(p, f, C[2]);
    p = S::fmadd(p, f, C[1]);
    p = S::fmadd(p, f, C[0]);
    p = S::fmadd(p, f, 1.0);
    // Exponent field n + 127 ∈ [1, 254]; the integer part of `t` above bit 23 shifts out.
    let scale = f32::from_bits(t.to_bits().wrapping_add(127) << 23);
    let r = p * scale;
    let r = if x < -126.0 { 0.0 } else { r };
    if x > 127.0 {
        f32::INFINITY
    } else {
        r
    }
}

/// One FMA per lane: `v = v·x + y`.
#[inline(always)]
fn fma_step<S: Simd, const W: usize>(v: &mut [f32; W], x: f32, y: f32) {
    for l in v.iter_mut() {
        *l = S::fmadd(*l, x, y);
    }
}

/// The FMA-peak loop: 12 independent vectors of `W` lanes, each `acc = acc·x + y`, `iters`
/// times; returns a sum so that nothing is optimised away. The chains are separate variables:
/// held in one array, LLVM vectorises across them with gathers instead of keeping each in a
/// register.
#[inline(always)]
pub(crate) fn fma_chains<S: Simd, const W: usize>(iters: usize, x: f32, y: f32) -> f32 {
    let init = |c: usize| -> [f32; W] { array::from_fn(|l| 1.0 + (c * W + l) as f32 * 1e-3) };
    let (mut a0, mut a1, mut a2, mut a3) = (init(0), init(1), init(2), init(3));
    let (mut a4, mut a5, mut a6, mut a7) = (init(4), init(5), init(6), init(7));
    let (mut a8, mut a9, mut a10, mut a11) = (init(8), init(9), init(10), init(11));
    for _ in 0..iters {
        fma_step::<S, W>(&mut a0, x, y);
        fma_step::<S, W>(&mut a1, x, y);
        fma_step::<S, W>(&mut a2, x, y);
        fma_step::<S, W>(&mut a3, x, y);
        fma_step::<S, W>(&mut a4, x, y);
        fma_step::<S, W>(&mut a5, x, y);
        fma_step::<S, W>(&mut a6, x, y);
        fma_step::<S, W>(&mut a7, x, y);
        fma_step::<S, W>(&mut a8, x, y);
        fma_step::<S, W>(&mut a9, x, y);
        fma_step::<S, W>(&mut a10, x, y);
        fma_step::<S, W>(&mut a11, x, y);
    }
    // Summed lane-wise first: a flat scalar sum here makes LLVM give up on vectorising the
    // loop for AVX2.
    let mut s = [0f32; W];
    for a in [a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11] {
        for (s, x) in s.iter_mut().zip(a) {
            *s += x;
        }
    }
    s.iter().sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::simd::Baseline;

    #[test]
    fn exp2_is_accurate_and_handles_edges() {
        let mut worst = 0f64;
        let mut x = -126.0f32;
        while x < 127.0 {
            let got = f64::from(exp2::<Baseline>(x));
            let want = 2f64.powf(f64::from(x));
            worst = worst.max((got / want - 1.0).abs());
            x += 0.0137;
        }
        assert!(worst < 2e-7, "max relative error {worst:e}");
        assert_eq!(exp2::<Baseline>(0.0), 1.0);
        assert_eq!(exp2::<Baseline>(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp2::<Baseline>(-1000.0), 0.0);
        assert_eq!(exp2::<Baseline>(f32::INFINITY), f32::INFINITY);
        assert!(exp2::<Baseline>(f32::NAN).is_nan());
    }
}

/// Microkernel throughput with operands in L1 (run by hand, see the module docs).
#[cfg(test)]
mod kernel_speed {
    use super::*;
    use crate::cpu::simd::{dispatch, Kernel};

    struct Bench {
        which: usize,
        k: usize,
        reps: usize,
    }
    impl Kernel for Bench {
        type Output = f64;
        #[inline(always)]
        fn run<S: Simd>(self) -> f64 {
            let k = self.k;
            let a = vec![0.5f32; 16 * k.max(256)];
            let b = vec![0.25f32; k * 96];
            let mut c = vec![0f32; 16 * 96];
            let scale = [1f32; 16];
            let t0 = std::time::Instant::now();
            let mut fl = 0usize;
            for _ in 0..self.reps {
                match self.which {
                    0 => {
                        S::scores_mn(k, &a, k, &b, 96, &mut c, 96, Init::Zero);
                        fl += 2 * k * S::SMR * S::SNR;
                    }
                    _ => {
                        S::cols_mn(k, &a, 16, &b, 96, &mut c, 96, Init::Scale(&scale));
                        fl += 2 * k * S::MR * S::NR;
                    }
                }
            }
            std::hint::black_box(&c);
            fl as f64 / t0.elapsed().as_secs_f64() / 1e9
        }
    }

    #[test]
    #[ignore]
    fn microkernel_gflops() {
        for (which, k) in [(0, 64), (0, 128), (0, 256), (1, 96), (1, 192)] {
            let g = dispatch(Bench {
                which,
                k,
                reps: 200_000,
            });
            println!("kernel {which} k={k}: {g:.1} GFLOP/s");
        }
    }
}
