//! The materialised evaluation of attention, `fa4 bench`'s CPU peer: the whole
//! `seqlen_q × seqlen_k` score matrix of a (sequence, head) is written to memory by one GEMM,
//! soft-maxed, and read back by a second GEMM.
//!
//! [`Style::Candle`] (the default) follows candle's CPU attention (`candle-transformers`'
//! llama: `q.matmul(k.t()) / sqrt(d)`, `masked_fill(-inf)`, `candle_nn::ops::softmax_last_dim`,
//! `att.matmul(v)`): separate out-of-place passes over the score matrix for the scale, the mask
//! and the softmax, the softmax taking each row's maximum, `f32::exp` per element, the row sum
//! and a division, as `softmax_last_dim` does. [`Style::Fused`] is the same evaluation with
//! those passes fused into one in-place pass using fa4's vectorised `exp2`: a stronger peer
//! than any framework's materialised path, kept to show how much of fa4's lead comes from the
//! score matrix's round trip through memory alone.
//!
//! Both are written with the same care as the tiled backend: the GEMMs are the same
//! register-blocked microkernels with cache blocking over the inner dimension, every pass runs
//! on rayon over row blocks, and every loop is compiled for the instruction set the backend
//! uses. Like a mask tensor, the mask saves no work: masked scores are computed, then replaced
//! by −∞. Rows with no allowed key give O = 0 and LSE = −∞ (candle would give NaN); a NaN or ∞
//! in a masked key's V row still reaches the rows that do not attend to it (`0 · NaN`).

use rayon::prelude::*;

use super::micro::{exp2, gemm_rows, FAST_MAX_SCORE, LOG2E};
use super::simd::{dispatch, Kernel, Simd};
use crate::error::Result;
use crate::mask::SeqMask;
use crate::problem::Problem;
use crate::tensor::Element;

/// Rows of one parallel task of each pass (a multiple of every instruction set's `MR`).
const ROW_BLOCK: usize = 48;
/// Inner-dimension block of the score GEMM (as in the tiled backend).
const KC_SCORES: usize = 64;
/// Inner-dimension block of the P·V GEMM: a `KC × NR` strip of V stays in L1.
const KC_PV: usize = 128;

/// How the score matrix is turned into probabilities between the two GEMMs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Style {
    /// Candle's passes: scale, mask and `softmax_last_dim`, each out of place, `f32::exp`.
    #[default]
    Candle,
    /// One in-place pass: scale folded into Q, mask, softmax with the vectorised `exp2`.
    Fused,
}

/// Columns of a packed B panel: `k × PANEL` contiguous, as a GEMM library packs B so that a
/// panel stays in L1 and its rows are not a page apart (Kᵀ's rows are `seqlen_k` floats long).
const PANEL: usize = 96;

/// `C = A·B` for `m` rows, blocked over the inner dimension `k` by `kc`. B is either by rows
/// (`ldb`), or (`packed`) in panels of [`PANEL`] columns, panel `q` at `q·k·PANEL`.
struct Gemm<'a> {
    m: usize,
    n: usize,
    k: usize,
    kc: usize,
    a: &'a [f32],
    lda: usize,
    b: &'a [f32],
    ldb: usize,
    packed: bool,
    c: &'a mut [f32],
    ldc: usize,
}

impl Kernel for Gemm<'_> {
    type Output = ();

    #[inline(always)]
    fn run<S: Simd>(self) {
        let (width, ldb) = if self.packed {
            (PANEL, PANEL)
        } else {
            (self.n.max(1), self.ldb)
        };
        for j0 in (0..self.n).step_by(width) {
            let nb = width.min(self.n - j0);
            let b = if self.packed {
                &self.b[j0 * self.k..]
            } else {
                &self.b[j0..]
            };
            for p0 in (0..self.k).step_by(self.kc) {
                let kc = self.kc.min(self.k - p0);
                gemm_rows::<S, f32>(
                    self.m,
                    nb,
                    kc,
                    &self.a[p0..],
                    self.lda,
                    &b[p0 * ldb..],
                    ldb,
                    &mut self.c[j0..],
                    self.ldc,
                    p0 > 0,
                );
            }
        }
    }
}

/// Mask, softcap and softmax of score rows `row0..` (`sk` long, stride `ls`) in place; LSE per
/// row.
struct Softmax<'a> {
    rows: &'a mut [f32],
    lse: &'a mut [f32],
    row0: usize,
    sk: usize,
    ls: usize,
    mask: SeqMask,
    restrictive: bool,
    softcap: Option<f32>,
}

impl Kernel for Softmax<'_> {
    type Output = ();

    #[inline(always)]
    fn run<S: Simd>(self) {
        for (r, (row, lse)) in self
            .rows
            .chunks_exact_mut(self.ls)
            .zip(self.lse.iter_mut())
            .enumerate()
        {
            let row = &mut row[..self.sk];
            if let Some(cap) = self.softcap {
                for x in row.iter_mut() {
                    *x = cap * (*x / cap).tanh();
                }
            }
            if self.restrictive {
                let kr = self.mask.key_range(self.row0 + r);
                let hi = kr.end.max(kr.start);
                row[..kr.start].fill(f32::NEG_INFINITY);
                row[hi..].fill(f32::NEG_INFINITY);
            }
            let mx = row
                .iter()
                .fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m });
            let base = if mx.is_finite() { mx } else { 0.0 };
            let mut sum = 0f32;
            // The shift in log2 units, exactly: see `FAST_MAX_SCORE` for when the fast form,
            // which rounds it to f32, is exact.
            let sh = if base.abs() > FAST_MAX_SCORE {
                for x in row.iter_mut() {
                    let e = exp2::<S>((*x - base) * LOG2E);
                    *x = e;
                    sum += e;
                }
                f64::from(base) * f64::from(LOG2E)
            } else {
                let ml = base * LOG2E;
                for x in row.iter_mut() {
                    let e = exp2::<S>(S::fmadd(*x, LOG2E, -ml));
                    *x = e;
                    sum += e;
                }
                f64::from(ml)
            };
            if sum == 0.0 {
                *lse = f32::NEG_INFINITY;
            } else {
                let inv = 1.0 / sum;
                for x in row.iter_mut() {
                    *x *= inv;
                }
                *lse = ((sh + f64::from(sum).log2()) / f64::from(LOG2E)) as f32;
            }
        }
    }
}

/// Candle's `att * scale` (and softcap): `dst = f(src)` elementwise.
struct ScalePass<'a> {
    src: &'a [f32],
    dst: &'a mut [f32],
    scale: f32,
    softcap: Option<f32>,
}

impl Kernel for ScalePass<'_> {
    type Output = ();

    #[inline(always)]
    fn run<S: Simd>(self) {
        for (d, &x) in self.dst.iter_mut().zip(self.src) {
            *d = x * self.scale;
        }
        if let Some(cap) = self.softcap {
            for d in self.dst.iter_mut() {
                *d = cap * (*d / cap).tanh();
            }
        }
    }
}

/// Candle's `masked_fill(att, mask, -inf)`: `dst = allowed ? src : −∞`, rows from `row0`.
struct MaskPass<'a> {
    src: &'a [f32],
    dst: &'a mut [f32],
    row0: usize,
    sk: usize,
    ls: usize,
    mask: SeqMask,
}

impl Kernel for MaskPass<'_> {
    type Output = ();

    #[inline(always)]
    fn run<S: Simd>(self) {
        let rows = self
            .src
            .chunks_exact(self.ls)
            .zip(self.dst.chunks_exact_mut(self.ls));
        for (r, (src, dst)) in rows.enumerate() {
            let (src, dst) = (&src[..self.sk], &mut dst[..self.sk]);
            let kr = self.mask.key_range(self.row0 + r);
            for (j, (d, &x)) in dst.iter_mut().zip(src).enumerate() {
                *d = if kr.contains(&j) {
                    x
                } else {
                    f32::NEG_INFINITY
                };
            }
        }
    }
}

/// Candle's `softmax_last_dim`, out of place: per row, the maximum, `exp(s − max)` with
/// `f32::exp`, the sum, a division; plus the LSE the API returns.
struct SoftmaxLastDim<'a> {
    src: &'a [f32],
    dst: &'a mut [f32],
    lse: &'a mut [f32],
    sk: usize,
    ls: usize,
}

impl Kernel for SoftmaxLastDim<'_> {
    type Output = ();

    #[inline(always)]
    fn run<S: Simd>(self) {
        let rows = self
            .src
            .chunks_exact(self.ls)
            .zip(self.dst.chunks_exact_mut(self.ls));
        for ((src, dst), lse) in rows.zip(self.lse.iter_mut()) {
            let (src, dst) = (&src[..self.sk], &mut dst[..self.sk]);
            let max = src.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            if max == f32::NEG_INFINITY {
                // No allowed key, or only NaN scores (candle would divide 0 by 0 here).
                let nan = src.iter().any(|x| x.is_nan());
                dst.fill(if nan { f32::NAN } else { 0.0 });
                *lse = if nan { f32::NAN } else { f32::NEG_INFINITY };
                continue;
            }
            for (d, &x) in dst.iter_mut().zip(src) {
                *d = (x - max).exp();
            }
            let sum: f32 = dst.iter().sum();
            for d in dst.iter_mut() {
                *d /= sum;
            }
            *lse = (f64::from(max) + f64::from(sum).ln()) as f32;
        }
    }
}

/// Runs a validated problem the materialised way, candle's passes ([`Style::Candle`]), on
/// slices laid out as it says; O and LSE as [`crate::Backend::run`] writes them. Uses the
/// current rayon pool.
pub fn forward<T: Element>(
    p: &Problem,
    q: &[T],
    k: &[T],
    v: &[T],
    out: &mut [T],
    lse: Option<&mut [f32]>,
) -> Result<()> {
    forward_with(Style::Candle, p, q, k, v, out, lse)
}

/// [`forward`] with a choice of [`Style`].
#[allow(clippy::too_many_arguments)]
pub fn forward_with<T: Element>(
    style: Style,
    p: &Problem,
    q: &[T],
    k: &[T],
    v: &[T],
    out: &mut [T],
    mut lse: Option<&mut [f32]>,
) -> Result<()> {
    p.check_buffers(
        T::DTYPE,
        q.len(),
        k.len(),
        v.len(),
        out.len(),
        lse.as_deref().map(<[f32]>::len),
    )?;
    let (d, dv) = (p.head_dim(), p.head_dim_v());
    let (ql, kl, vl, ol) = (p.q_layout(), p.k_layout(), p.v_layout(), p.o_layout());
    // Candle scales the scores; the fused pass folds the scale into Q, as fa4 does.
    let q_scale = match style {
        Style::Candle => 1.0,
        Style::Fused => p.scale(),
    };
    let (mut qs, mut kt, mut vf, mut o, mut lse_h) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    // Two score-sized buffers, reused across heads: the passes ping-pong between them.
    let (mut s_a, mut s_b) = (Vec::new(), Vec::new());
    for s in p.sequences() {
        let (sq, sk) = (s.q_len, s.k_len);
        if sq == 0 {
            continue;
        }
        for h in 0..p.heads_q() {
            let hk = h / p.group();
            // The operands as contiguous f32 tensors: Q, Kᵀ, V.
            qs.clear();
            for i in 0..sq {
                let off = ql.offset(s.batch_index, s.q_start + i, h);
                qs.extend(q[off..off + d].iter().map(|x| x.to_f32() * q_scale));
            }
            // Kᵀ in panels of PANEL keys.
            kt.clear();
            kt.resize(d * sk.div_ceil(PANEL) * PANEL, 0.0);
            vf.clear();
            for j in 0..sk {
                let off = kl.offset(s.batch_index, s.k_start + j, hk);
                let panel = &mut kt[(j / PANEL) * d * PANEL..];
                for (c, x) in k[off..off + d].iter().enumerate() {
                    panel[c * PANEL + j % PANEL] = x.to_f32();
                }
                let off = vl.offset(s.batch_index, s.k_start + j, hk);
                vf.extend(v[off..off + dv].iter().map(|x| x.to_f32()));
            }
            o.clear();
            o.resize(sq * dv, 0.0);
            lse_h.clear();
            lse_h.resize(sq, f32::NEG_INFINITY);
            if sk > 0 {
                // Rows a power of two of floats apart would share L1 sets in the P·V GEMM, whose
                // A operand reads several rows at once; a GEMM library packs A, a padded row
                // stride does the same here (measured: 80–84 against 74–83 GFLOP/s at seqlen
                // 2048, no difference at 4096).
                let ls = sk.div_ceil(16) * 16 + 16;
                s_a.resize(sq * ls, 0.0);
                s_b.resize(sq * ls, 0.0);
                let block = ROW_BLOCK * ls;
                // S = Q·Kᵀ.
                s_a.par_chunks_mut(block)
                    .zip(qs.par_chunks(ROW_BLOCK * d))
                    .for_each(|(c, a)| {
                        dispatch(Gemm {
                            m: c.len() / ls,
                            n: sk,
                            k: d,
                            kc: KC_SCORES,
                            a,
                            lda: d,
                            b: &kt,
                            ldb: PANEL,
                            packed: true,
                            c,
                            ldc: ls,
                        })
                    });
                let mask = p.seq_mask(s);
                let restrictive = p.mask().is_restrictive();
                // P, in `s_a` (fused) or `s_b` (candle's passes end there).
                let probs = match style {
                    Style::Fused => {
                        s_a.par_chunks_mut(block)
                            .zip(lse_h.par_chunks_mut(ROW_BLOCK))
                            .enumerate()
                            .for_each(|(bi, (rows, lse))| {
                                dispatch(Softmax {
                                    rows,
                                    lse,
                                    row0: bi * ROW_BLOCK,
                                    sk,
                                    ls,
                                    mask,
                                    restrictive,
                                    softcap: p.softcap(),
                                })
                            });
                        &s_a
                    }
                    Style::Candle => {
                        // att = att * scale
                        s_b.par_chunks_mut(block)
                            .zip(s_a.par_chunks(block))
                            .for_each(|(dst, src)| {
                                dispatch(ScalePass {
                                    src,
                                    dst,
                                    scale: p.scale(),
                                    softcap: p.softcap(),
                                })
                            });
                        // att = masked_fill(att, mask, −∞)
                        if restrictive {
                            s_a.par_chunks_mut(block)
                                .zip(s_b.par_chunks(block))
                                .enumerate()
                                .for_each(|(bi, (dst, src))| {
                                    dispatch(MaskPass {
                                        src,
                                        dst,
                                        row0: bi * ROW_BLOCK,
                                        sk,
                                        ls,
                                        mask,
                                    })
                                });
                            std::mem::swap(&mut s_a, &mut s_b);
                        }
                        // att = softmax_last_dim(att)
                        s_a.par_chunks_mut(block)
                            .zip(s_b.par_chunks(block))
                            .zip(lse_h.par_chunks_mut(ROW_BLOCK))
                            .for_each(|((dst, src), lse)| {
                                dispatch(SoftmaxLastDim {
                                    src,
                                    dst,
                                    lse,
                                    sk,
                                    ls,
                                })
                            });
                        &s_a
                    }
                };
                // O = P·V.
                o.par_chunks_mut(ROW_BLOCK * dv)
                    .zip(probs.par_chunks(block))
                    .for_each(|(c, a)| {
                        dispatch(Gemm {
                            m: c.len() / dv,
                            n: dv,
                            k: sk,
                            kc: KC_PV,
                            a,
                            lda: ls,
                            b: &vf,
                            ldb: dv,
                            packed: false,
                            c,
                            ldc: dv,
                        })
                    });
            }
            for i in 0..sq {
                let off = ol.offset(s.batch_index, s.q_start + i, h);
                for (dst, &x) in out[off..off + dv].iter_mut().zip(&o[i * dv..]) {
                    *dst = T::from_f32(x);
                }
                if let Some(l) = lse.as_deref_mut() {
                    l[p.lse_offset(s, h, i)] = lse_h[i];
                }
            }
        }
    }
    Ok(())
}
