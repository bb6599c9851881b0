//! Runtime instruction-set dispatch for the CPU kernels.
//!
//! The kernels are plain, safe Rust over fixed-size arrays (see [`super::micro`]); LLVM turns
//! them into vector code when they are compiled with the right target features. A binary must
//! run on any x86-64 machine, so the features cannot be a build flag: instead each kernel is a
//! [`Kernel`] whose body is generic over an instruction set ([`Simd`]), and [`dispatch`] calls
//! it through a `#[target_feature]` wrapper chosen by CPUID. Everything the body calls is
//! `#[inline(always)]`, so it is compiled inside the wrapper, with its features.
//!
//! This file holds the only `unsafe` of the CPU backend: calling those wrappers.

use std::sync::OnceLock;

use super::micro::{micro_cols, micro_rows};
use crate::tensor::Element;

/// An instruction set the CPU kernels are compiled for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Isa {
    /// AVX-512F (+VL) with FMA: 16 f32 lanes, 32 vector registers.
    Avx512,
    /// AVX2 with FMA: 8 f32 lanes, 16 vector registers.
    Avx2,
    /// The target's baseline (SSE2 on x86-64, NEON on aarch64).
    Baseline,
}

impl Isa {
    /// A short name for reports (`avx512`, `avx2`, `baseline`).
    pub fn name(self) -> &'static str {
        match self {
            Isa::Avx512 => "avx512",
            Isa::Avx2 => "avx2",
            Isa::Baseline => "baseline",
        }
    }

    /// Whether this machine can run code compiled for `self`.
    pub fn available(self) -> bool {
        match self {
            Isa::Baseline => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                Isa::Avx2.available()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512vl")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// The instruction sets this machine can run, best first.
    pub fn all_available() -> Vec<Isa> {
        [Isa::Avx512, Isa::Avx2, Isa::Baseline]
            .into_iter()
            .filter(|i| i.available())
            .collect()
    }

    /// The instruction set the kernels use: the best available, unless the environment variable
    /// `FA4_CPU_ISA` (`avx512`, `avx2`, `baseline`) asks for one this machine has. Decided once.
    pub fn selected() -> Isa {
        static SELECTED: OnceLock<Isa> = OnceLock::new();
        *SELECTED.get_or_init(|| {
            let best = Isa::all_available()[0];
            match std::env::var("FA4_CPU_ISA").ok().as_deref() {
                Some("avx512") if Isa::Avx512.available() => Isa::Avx512,
                Some("avx2") if Isa::Avx2.available() => Isa::Avx2,
                Some("baseline") => Isa::Baseline,
                _ => best,
            }
        })
    }
}

/// How a microkernel starts its accumulators from the C tile it writes.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Init<'a> {
    /// From zero (C is overwritten).
    Zero,
    /// From zero, added to C at the end: blocked summation, so that no rounding chain is longer
    /// than one call's inner dimension (what keeps the scores accurate enough for the f32 LSE
    /// bound: one chain over d = 128 products of a large row lost 1.2e-5). Used with the score
    /// tiles; the 12 × 32 tiles came out with spilled accumulators in this mode.
    Add,
    /// From C with row `r` multiplied by `scale[r]` (the online-softmax rescale of O).
    Scale(&'a [f32]),
}

/// An instruction set as the kernels see it: vector width and register-blocked GEMM tiles.
///
/// Tiles are chosen so the accumulators fill most of the register file and each loaded vector
/// feeds several FMAs. P·V and generic tiles (MR × NR): AVX2 6 × 16 (12 of 16 ymm registers),
/// AVX-512 12 × 32 (24 of 32 zmm). Score tiles (SMR × SNR, two accumulator banks, see
/// [`super::micro::micro_rows_banked`]): AVX2 3 × 16 × 2, AVX-512 6 × 32 × 2; they read K rows
/// in place, one pointer per row (12 rows spilled those pointers to the stack).
/// `scores_*` and `rows_*` compute `C[r][j] (+)= Σ_p A[r·lda + p]·B[p·ldb + j]` (A by rows: K,
/// Q or P rows); `cols_*` the same with `A[p·lda + r]` (A by columns: the transposed
/// probability tile). The suffix names the tile: `mn` is MR × NR (SMR × SNR for scores), `mw`
/// MR × LANES, `m1` MR × 1; `1n`, `1w`, `11` are one row.
#[allow(clippy::too_many_arguments)]
pub(crate) trait Simd {
    /// f32 lanes of one vector register.
    const LANES: usize;
    /// Rows of a register tile.
    const MR: usize;
    /// Columns of a register tile (a multiple of `LANES`).
    const NR: usize;
    /// Independent vectors of the FMA-peak loop.
    const CHAINS: usize;
    /// Rows (keys) of the score GEMM's register tile, each read straight from its K row.
    const SMR: usize;
    /// Columns (queries) of the score GEMM's register tile.
    const SNR: usize;
    /// `a·b + c`, fused where the instruction set has FMA.
    fn fmadd(a: f32, b: f32, c: f32) -> f32;

    /// The score tile `SMR × SNR`: `C[r][j] = init + Σ_p A[r·lda + p]·B[p·ldb + j]`.
    fn scores_mn<A: Element>(
        k: usize,
        a: &[A],
        lda: usize,
        b: &[f32],
        ldb: usize,
        c: &mut [f32],
        ldc: usize,
        init: Init,
    );
    /// One row of the score tile, `1 × SNR`.
    fn scores_1n<A: Element>(
        k: usize,
        a: &[A],
        lda: usize,
        b: &[f32],
        ldb: usize,
        c: &mut [f32],
        ldc: usize,
        init: Init,
    );
    fn rows_1w<A: Element, B: Element>(
        k: usize,
        a: &[A],
        lda: usize,
        b: &[B],
        ldb: usize,
        c: &mut [f32],
        ldc: usize,
        init: Init,
    );
    fn rows_11<A: Element, B: Element>(
        k: usize,
        a: &[A],
        lda: usize,
        b: &[B],
        ldb: usize,
        c: &mut [f32],
        ldc: usize,
        init: Init,
    );
    fn cols_mn<B: Element>(
        k: usize,
        a: &[f32],
        lda: usize,
        b: &[B],
        ldb: usize,
        c: &mut [f32],
        ldc: usize,
        init: Init,
    );
    fn cols_mw<B: Element>(
        k: usize,
        a: &[f32],
        lda: usize,
        b: &[B],
        ldb: usize,
        c: &mut [f32],
        ldc: usize,
        init: Init,
    );
    fn cols_m1<B: Element>(
        k: usize,
        a: &[f32],
        lda: usize,
        b: &[B],
        ldb: usize,
        c: &mut [f32],
        ldc: usize,
        init: Init,
    );
    fn cols_1n<B: Element>(
        k: usize,
        a: &[f32],
        lda: usize,
        b: &[B],
        ldb: usize,
        c: &mut [f32],
        ldc: usize,
        init: Init,
    );
    fn cols_1w<B: Element>(
        k: usize,
        a: &[f32],
        lda: usize,
        b: &[B],
        ldb: usize,
        c: &mut [f32],
        ldc: usize,
        init: Init,
    );
    fn cols_11<B: Element>(
        k: usize,
        a: &[f32],
        lda: usize,
        b: &[B],
        ldb: usize,
        c: &mut [f32],
        ldc: usize,
        init: Init,
    );
    /// `acc = acc·x + y` on `CHAINS` independent vectors, `iters` times (the FMA peak loop).
    fn fma_chains(iters: usize, x: f32, y: f32) -> f32;
}

macro_rules! simd_impl {
    ($name:ident, $lanes:literal, $mr:literal, $nr:literal, $smr:literal, $snr:literal, $banks:literal, $fma:expr, $chains:literal) => {
        #[derive(Debug, Clone, Copy)]
        pub(crate) struct $name;

        impl Simd for $name {
            const LANES: usize = $lanes;
            const MR: usize = $mr;
            const NR: usize = $nr;
            const SMR: usize = $smr;
            const SNR: usize = $snr;
            #[inline(always)]
            fn scores_mn<A: Element>(
                k: usize,
                a: &[A],
                lda: usize,
                b: &[f32],
                ldb: usize,
                c: &mut [f32],
                ldc: usize,
                init: Init,
            ) {
                super::micro::micro_rows_banked::<Self, A, f32, $smr, $snr, $banks>(
                    k, a, lda, b, ldb, c, ldc, init,
                )
            }
            #[inline(always)]
            fn scores_1n<A: Element>(
                k: usize,
                a: &[A],
                lda: usize,
                b: &[f32],
                ldb: usize,
                c: &mut [f32],
                ldc: usize,
                init: Init,
            ) {
                super::micro::micro_rows_banked::<Self, A, f32, 1, $snr, $banks>(
                    k, a, lda, b, ldb, c, ldc, init,
                )
            }
            const CHAINS: usize = $chains;
            #[inline(always)]
            fn fmadd(a: f32, b: f32, c: f32) -> f32 {
                if $fma {
                    a.mul_add(b, c)
                } else {
                    a * b + c
                }
            }
            #[inline(always)]
            fn rows_1w<A: Element, B: Element>(
                k: usize,
                a: &[A],
                lda: usize,
                b: &[B],
                ldb: usize,
                c: &mut [f32],
                ldc: usize,
                init: Init,
            ) {
                micro_rows::<Self, A, B, 1, $lanes>(k, a, lda, b, ldb, c, ldc, init)
            }
            #[inline(always)]
            fn rows_11<A: Element, B: Element>(
                k: usize,
                a: &[A],
                lda: usize,
                b: &[B],
                ldb: usize,
                c: &mut [f32],
                ldc: usize,
                init: Init,
            ) {
                micro_rows::<Self, A, B, 1, 1>(k, a, lda, b, ldb, c, ldc, init)
            }
            #[inline(always)]
            fn cols_mn<B: Element>(
                k: usize,
                a: &[f32],
                lda: usize,
                b: &[B],
                ldb: usize,
                c: &mut [f32],
                ldc: usize,
                init: Init,
            ) {
                micro_cols::<Self, B, $mr, $nr>(k, a, lda, b, ldb, c, ldc, init)
            }
            #[inline(always)]
            fn cols_mw<B: Element>(
                k: usize,
                a: &[f32],
                lda: usize,
                b: &[B],
                ldb: usize,
                c: &mut [f32],
                ldc: usize,
                init: Init,
            ) {
                micro_cols::<Self, B, $mr, $lanes>(k, a, lda, b, ldb, c, ldc, init)
            }
            #[inline(always)]
            fn cols_m1<B: Element>(
                k: usize,
                a: &[f32],
                lda: usize,
                b: &[B],
                ldb: usize,
                c: &mut [f32],
                ldc: usize,
                init: Init,
            ) {
                micro_cols::<Self, B, $mr, 1>(k, a, lda, b, ldb, c, ldc, init)
            }
            #[inline(always)]
            fn cols_1n<B: Element>(
                k: usize,
                a: &[f32],
                lda: usize,
                b: &[B],
                ldb: usize,
                c: &mut [f32],
                ldc: usize,
                init: Init,
            ) {
                micro_cols::<Self, B, 1, $nr>(k, a, lda, b, ldb, c, ldc, init)
            }
            #[inline(always)]
            fn cols_1w<B: Element>(
                k: usize,
                a: &[f32],
                lda: usize,
                b: &[B],
                ldb: usize,
                c: &mut [f32],
                ldc: usize,
                init: Init,
            ) {
                micro_cols::<Self, B, 1, $lanes>(k, a, lda, b, ldb, c, ldc, init)
            }
            #[inline(always)]
            fn cols_11<B: Element>(
                k: usize,
                a: &[f32],
                lda: usize,
                b: &[B],
                ldb: usize,
                c: &mut [f32],
                ldc: usize,
                init: Init,
            ) {
                micro_cols::<Self, B, 1, 1>(k, a, lda, b, ldb, c, ldc, init)
            }
            #[inline(always)]
            fn fma_chains(iters: usize, x: f32, y: f32) -> f32 {
                super::micro::fma_chains::<Self, $lanes>(iters, x, y)
            }
        }
    };
}

// FMA latency 4 × 2 pipes needs ≥ 8 independent vectors in flight; 12 leave room to spare.
// Arguments: lanes, MR, NR, SMR, SNR, score banks, FMA, peak chains.
simd_impl!(Avx512, 16, 12, 32, 6, 32, 2, true, 12);
simd_impl!(Avx2, 8, 6, 16, 3, 16, 2, true, 12);
simd_impl!(
    Baseline,
    4,
    4,
    8,
    2,
    8,
    2,
    cfg!(any(target_arch = "aarch64", target_feature = "fma")),
    12
);

/// A computation whose body is compiled once per instruction set.
pub(crate) trait Kernel {
    /// What the computation returns.
    type Output;
    /// The body. Implementations are `#[inline(always)]` and call only `#[inline(always)]`
    /// helpers, so that they are compiled inside the `#[target_feature]` wrapper.
    fn run<S: Simd>(self) -> Self::Output;
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
unsafe fn run_avx512<K: Kernel>(k: K) -> K::Output {
    k.run::<Avx512>()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn run_avx2<K: Kernel>(k: K) -> K::Output {
    k.run::<Avx2>()
}

/// Runs `k` compiled for `isa`, falling back to the baseline when this machine lacks it.
pub(crate) fn dispatch_on<K: Kernel>(isa: Isa, k: K) -> K::Output {
    #[cfg(target_arch = "x86_64")]
    {
        if isa == Isa::Avx512 && Isa::Avx512.available() {
            // SAFETY: the wrapper only enables target features, and CPUID (checked just above)
            // says this CPU has every one of them: AVX-512F, AVX-512VL, AVX2 and FMA.
            return unsafe { run_avx512(k) };
        }
        if isa == Isa::Avx2 && Isa::Avx2.available() {
            // SAFETY: as above; CPUID says this CPU has AVX2 and FMA.
            return unsafe { run_avx2(k) };
        }
    }
    let _ = isa;
    k.run::<Baseline>()
}

/// The FMA-peak loop on `isa`: 12 independent vector accumulators, each `acc = acc·x + y`,
/// `iters` times. Returns a value to keep (so that nothing is optimised away) and the FLOPs of
/// one iteration. AVX2 and AVX-512 use intrinsics: autovectorised, this loop came out of one
/// build as 8-wide FMAs and of another as spilled 4-wide ones. Elsewhere the generic loop
/// ([`super::micro::fma_chains`]) runs.
pub(crate) fn fma_peak_loop(isa: Isa, iters: usize, x: f32, y: f32) -> (f32, usize) {
    #[cfg(target_arch = "x86_64")]
    {
        if isa == Isa::Avx512 && Isa::Avx512.available() {
            // SAFETY: the function only enables target features, and CPUID (checked just
            // above) says this CPU has them: AVX-512F and AVX-512VL.
            return (unsafe { peak_x86::avx512(iters, x, y) }, 2 * 12 * 16);
        }
        if isa == Isa::Avx2 && Isa::Avx2.available() {
            // SAFETY: as above; CPUID says this CPU has AVX2 and FMA.
            return (unsafe { peak_x86::avx2(iters, x, y) }, 2 * 12 * 8);
        }
    }
    struct Chains(usize, f32, f32);
    impl Kernel for Chains {
        type Output = (f32, usize);
        #[inline(always)]
        fn run<S: Simd>(self) -> (f32, usize) {
            (
                S::fma_chains(self.0, self.1, self.2),
                2 * S::CHAINS * S::LANES,
            )
        }
    }
    dispatch_on(Isa::Baseline, Chains(iters, x, y))
}

/// The FMA-peak loops with intrinsics (safe inside their `#[target_feature]` functions).
#[cfg(target_arch = "x86_64")]
mod peak_x86 {
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn avx2(iters: usize, x: f32, y: f32) -> f32 {
        let (vx, vy) = (_mm256_set1_ps(x), _mm256_set1_ps(y));
        let mut a = [_mm256_set1_ps(1.0); 12];
        for (i, v) in a.iter_mut().enumerate() {
            *v = _mm256_set1_ps(1.0 + i as f32 * 1e-3);
        }
        let [mut a0, mut a1, mut a2, mut a3, mut a4, mut a5, mut a6, mut a7, mut a8, mut a9, mut a10, mut a11] =
            a;
        for _ in 0..iters {
            a0 = _mm256_fmadd_ps(a0, vx, vy);
            a1 = _mm256_fmadd_ps(a1, vx, vy);
            a2 = _mm256_fmadd_ps(a2, vx, vy);
            a3 = _mm256_fmadd_ps(a3, vx, vy);
            a4 = _mm256_fmadd_ps(a4, vx, vy);
            a5 = _mm256_fmadd_ps(a5, vx, vy);
            a6 = _mm256_fmadd_ps(a6, vx, vy);
            a7 = _mm256_fmadd_ps(a7, vx, vy);
            a8 = _mm256_fmadd_ps(a8, vx, vy);
            a9 = _mm256_fmadd_ps(a9, vx, vy);
            a10 = _mm256_fmadd_ps(a10, vx, vy);
            a11 = _mm256_fmadd_ps(a11, vx, vy);
        }
        let s = [a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11]
            .into_iter()
            .fold(a0, |s, v| _mm256_add_ps(s, v));
        let h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps::<1>(s));
        let h = _mm_hadd_ps(h, h);
        _mm_cvtss_f32(_mm_hadd_ps(h, h))
    }

    #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
    pub(super) fn avx512(iters: usize, x: f32, y: f32) -> f32 {
        let (vx, vy) = (_mm512_set1_ps(x), _mm512_set1_ps(y));
        let mut a = [_mm512_set1_ps(1.0); 12];
        for (i, v) in a.iter_mut().enumerate() {
            *v = _mm512_set1_ps(1.0 + i as f32 * 1e-3);
        }
        let [mut a0, mut a1, mut a2, mut a3, mut a4, mut a5, mut a6, mut a7, mut a8, mut a9, mut a10, mut a11] =
            a;
        for _ in 0..iters {
            a0 = _mm512_fmadd_ps(a0, vx, vy);
            a1 = _mm512_fmadd_ps(a1, vx, vy);
            a2 = _mm512_fmadd_ps(a2, vx, vy);
            a3 = _mm512_fmadd_ps(a3, vx, vy);
            a4 = _mm512_fmadd_ps(a4, vx, vy);
            a5 = _mm512_fmadd_ps(a5, vx, vy);
            a6 = _mm512_fmadd_ps(a6, vx, vy);
            a7 = _mm512_fmadd_ps(a7, vx, vy);
            a8 = _mm512_fmadd_ps(a8, vx, vy);
            a9 = _mm512_fmadd_ps(a9, vx, vy);
            a10 = _mm512_fmadd_ps(a10, vx, vy);
            a11 = _mm512_fmadd_ps(a11, vx, vy);
        }
        let s = [a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11]
            .into_iter()
            .fold(a0, |s, v| _mm512_add_ps(s, v));
        _mm512_reduce_add_ps(s)
    }
}

/// Runs `k` compiled for [`Isa::selected`].
pub(crate) fn dispatch<K: Kernel>(k: K) -> K::Output {
    dispatch_on(Isa::selected(), k)
}
