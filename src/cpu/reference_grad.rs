//! The float64 gradient oracle and the naive low-precision gradient evaluation used by the
//! gradient tolerance rule (`docs/backward.md`).
//!
//! Both are transcriptions of the math, one (sequence, KV head) at a time and one query row at a
//! time, with nothing shared with the CPU backward they judge: their own mask predicate (signed
//! arithmetic on `j < sk`, `i + sk − sq − left ≤ j ≤ i + sk − sq + right`), their own element
//! indexing, and their own forward pass (P and LSE recomputed from Q, K, V; the oracle needs no
//! LSE or O from a backend, and computes its own O; the storage-precision evaluation takes D from
//! the O the backend was given, as the backends do). For one row `i` with allowed keys `j`:
//!
//! ```text
//! x_ij = scale · q_i·k_j                      (the raw products, scaled)
//! s_ij = c · tanh(x_ij / c)  (softcap c)  or  x_ij
//! P_ij = exp(s_ij − LSE_i),  O_i = Σ_j P_ij v_j
//! dV_j += P_ij dO_i            dP_ij = dO_i·v_j           D_i = dO_i·O_i
//! dS_ij = P_ij (dP_ij − D_i)   dX_ij = dS_ij · (1 − tanh²(x_ij / c)) · scale
//! dQ_i = Σ_j dX_ij k_j         dK_j += dX_ij q_i
//! ```
//!
//! `dX` is the gradient of the raw product `q_i·k_j`: the scale is applied once, there, and
//! not again to Q or K. With GQA every query head of a KV head adds into that head's dK and dV.
//! Masked pairs contribute nothing; a row with no allowed key has dQ = 0 and adds nothing.
//! Outputs are contiguous in the dims of Q, K and V (packed varlen tensors: `[total, heads,
//! dim]`).

use rayon::prelude::*;

use crate::mask::Mask;
use crate::problem::{Problem, Sequence};
use crate::tensor::{Element, Layout};

/// dQ, dK and dV, each contiguous in its input's dims.
#[derive(Debug, Clone, PartialEq)]
pub struct Grads<F> {
    /// dQ, contiguous in Q's dims.
    pub dq: Vec<F>,
    /// dK, contiguous in K's dims.
    pub dk: Vec<F>,
    /// dV, contiguous in V's dims.
    pub dv: Vec<F>,
}

/// The contiguous layout of a tensor of `l`'s dims (the form [`Grads`] is written in).
pub fn contiguous(l: &Layout) -> Layout {
    let [_, s, h, d] = l.dims;
    Layout {
        dims: l.dims,
        strides: [if l.packed { 0 } else { s * h * d }, h * d, d],
        packed: l.packed,
    }
}

/// Whether key `j` is allowed for query row `i` of a sequence of `sq` queries and `sk` keys,
/// straight from the definition, in signed arithmetic.
fn allowed(mask: Mask, i: usize, j: usize, sq: usize, sk: usize) -> bool {
    let (i, j, sq, sk) = (i as i128, j as i128, sq as i128, sk as i128);
    if i >= sq || j >= sk {
        return false;
    }
    let diag = i + sk - sq;
    let (left, right) = match mask {
        Mask::None => (None, None),
        Mask::Causal => (None, Some(0)),
        Mask::Window { left, right } => (left, right),
    };
    left.is_none_or(|l| j >= diag - l as i128) && right.is_none_or(|r| j <= diag + r as i128)
}

/// Element offset of `(batch, row, head, col)` from the raw dims and strides.
fn at(l: &Layout, batch: usize, row: usize, head: usize, col: usize) -> usize {
    batch * l.strides[0] + row * l.strides[1] + head * l.strides[2] + col
}

/// Row `row` (sequence-relative) of head `head`, widened to f64.
fn load<T: Element>(x: &[T], l: &Layout, s: &Sequence, row: usize, head: usize) -> Vec<f64> {
    let off = at(l, s.batch_index, row, head, 0);
    x[off..off + l.dims[3]]
        .iter()
        .map(|e| f64::from(e.to_f32()))
        .collect()
}

/// The rows of one (sequence, KV head): dQ for its query heads, dK and dV for the KV head.
struct Part<F> {
    seq: usize,
    kv_head: usize,
    /// `group × q_len × d`.
    dq: Vec<F>,
    /// `k_len × d`.
    dk: Vec<F>,
    /// `k_len × dv`.
    dv: Vec<F>,
}

fn assemble<F: Copy + Default>(p: &Problem, parts: Vec<Part<F>>) -> Grads<F> {
    let (ql, kl, vl) = (
        contiguous(p.q_layout()),
        contiguous(p.k_layout()),
        contiguous(p.v_layout()),
    );
    let (d, dv, g) = (p.head_dim(), p.head_dim_v(), p.group());
    let mut out = Grads {
        dq: vec![F::default(); ql.numel()],
        dk: vec![F::default(); kl.numel()],
        dv: vec![F::default(); vl.numel()],
    };
    for part in parts {
        let s = &p.sequences()[part.seq];
        for gi in 0..g {
            let h = part.kv_head * g + gi;
            for i in 0..s.q_len {
                let o = at(&ql, s.batch_index, s.q_start + i, h, 0);
                let src = (gi * s.q_len + i) * d;
                out.dq[o..o + d].copy_from_slice(&part.dq[src..src + d]);
            }
        }
        for j in 0..s.k_len {
            let o = at(&kl, s.batch_index, s.k_start + j, part.kv_head, 0);
            out.dk[o..o + d].copy_from_slice(&part.dk[j * d..(j + 1) * d]);
            let o = at(&vl, s.batch_index, s.k_start + j, part.kv_head, 0);
            out.dv[o..o + dv].copy_from_slice(&part.dv[j * dv..(j + 1) * dv]);
        }
    }
    out
}

fn items(p: &Problem) -> Vec<(usize, usize)> {
    (0..p.sequences().len())
        .flat_map(|s| (0..p.heads_kv()).map(move |h| (s, h)))
        .collect()
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Float64 gradients of attention with respect to Q, K and V for the upstream gradient `d_out`
/// (laid out as `d_out_layout`, O's dims), from the (already rounded) inputs.
pub fn grad_f64<T: Element>(
    p: &Problem,
    q: &[T],
    k: &[T],
    v: &[T],
    d_out: &[T],
    d_out_layout: &Layout,
) -> Grads<f64> {
    let (d, dvd, g) = (p.head_dim(), p.head_dim_v(), p.group());
    let scale = f64::from(p.scale());
    let cap = p.softcap().map(f64::from);
    let mask = p.mask();
    let parts = items(p)
        .into_par_iter()
        .map(|(si, hk)| {
            let s = &p.sequences()[si];
            let (sq, sk) = (s.q_len, s.k_len);
            let keys: Vec<Vec<f64>> = (0..sk)
                .map(|j| load(k, p.k_layout(), s, s.k_start + j, hk))
                .collect();
            let vals: Vec<Vec<f64>> = (0..sk)
                .map(|j| load(v, p.v_layout(), s, s.k_start + j, hk))
                .collect();
            let mut dq = vec![0f64; g * sq * d];
            let mut dk = vec![0f64; sk * d];
            let mut dv = vec![0f64; sk * dvd];
            for gi in 0..g {
                let h = hk * g + gi;
                for i in 0..sq {
                    let qi = load(q, p.q_layout(), s, s.q_start + i, h);
                    let doi = load(d_out, d_out_layout, s, s.q_start + i, h);
                    // (key, s_ij, 1 − tanh² or 1)
                    let mut row: Vec<(usize, f64, f64)> = Vec::new();
                    for j in (0..sk).filter(|&j| allowed(mask, i, j, sq, sk)) {
                        let x = scale * dot(&qi, &keys[j]);
                        let (sij, dsdx) = match cap {
                            Some(c) => {
                                let t = (x / c).tanh();
                                (c * t, 1.0 - t * t)
                            }
                            None => (x, 1.0),
                        };
                        row.push((j, sij, dsdx));
                    }
                    if row.is_empty() {
                        continue;
                    }
                    let lse = if row.iter().any(|r| r.1.is_nan()) {
                        f64::NAN
                    } else {
                        let mx = row.iter().map(|r| r.1).fold(f64::NEG_INFINITY, f64::max);
                        let shift = if mx.is_finite() { mx } else { 0.0 };
                        shift + row.iter().map(|r| (r.1 - shift).exp()).sum::<f64>().ln()
                    };
                    let probs: Vec<f64> = row.iter().map(|r| (r.1 - lse).exp()).collect();
                    let mut oi = vec![0f64; dvd];
                    for (&(j, _, _), &pij) in row.iter().zip(&probs) {
                        for (o, x) in oi.iter_mut().zip(&vals[j]) {
                            *o += pij * x;
                        }
                    }
                    let di = dot(&doi, &oi);
                    let dqi = &mut dq[(gi * sq + i) * d..(gi * sq + i + 1) * d];
                    for (&(j, _, dsdx), &pij) in row.iter().zip(&probs) {
                        for (a, x) in dv[j * dvd..(j + 1) * dvd].iter_mut().zip(&doi) {
                            *a += pij * x;
                        }
                        let dp = dot(&doi, &vals[j]);
                        let dx = pij * (dp - di) * dsdx * scale;
                        for (a, x) in dqi.iter_mut().zip(&keys[j]) {
                            *a += dx * x;
                        }
                        for (a, x) in dk[j * d..(j + 1) * d].iter_mut().zip(&qi) {
                            *a += dx * x;
                        }
                    }
                }
            }
            Part {
                seq: si,
                kv_head: hk,
                dq,
                dk,
                dv,
            }
        })
        .collect();
    assemble(p, parts)
}

/// What [`grad_lowp`] returns: the naive gradients and, per gradient, the f32 floor of the
/// rule.
#[derive(Debug, Clone, PartialEq)]
pub struct LowpGrads {
    /// dQ, dK, dV in the storage precision (as f32), contiguous in their inputs' dims.
    pub grads: Grads<f32>,
    /// `[dQ, dK, dV]`: the largest difference, over each gradient's elements, that summing
    /// `dP_ij` and `D_i` (two f32 dot products of length `head_dim_v`) in another order makes,
    /// at 4 standard deviations of the rounding noise, carried through `dS` to the gradient and
    /// summed over keys and rows as if every error had one sign. dV takes no difference of
    /// sums: 0.
    pub f32_floor: [f64; 3],
}

/// The naive gradients in the storage precision `T`, the yardstick of the 16-bit tolerance
/// rule: inputs in `T`; scores, P and dS rounded to `T` (where a GPU kernel stores them in 16
/// bits before the next product); every sum in f32; the results rounded to `T`. `D_i = dO_i·O_i`
/// is taken from `out` (laid out as `out_layout`), the O the backend judged was given, as every
/// backend takes it: the rounding of the given O then enters the model and the backend alike
/// (see docs/backward.md). For f32 storage this is a plain f32 evaluation.
#[allow(clippy::too_many_arguments)]
pub fn grad_lowp<T: Element>(
    p: &Problem,
    q: &[T],
    k: &[T],
    v: &[T],
    out: &[T],
    out_layout: &Layout,
    d_out: &[T],
    d_out_layout: &Layout,
) -> LowpGrads {
    let (d, dvd, g) = (p.head_dim(), p.head_dim_v(), p.group());
    let scale = p.scale();
    let cap = p.softcap();
    let mask = p.mask();
    let round = |x: f32| T::from_f32(x).to_f32();
    let row_of = |x: &[T], l: &Layout, s: &Sequence, r: usize, h: usize| -> Vec<f32> {
        let off = at(l, s.batch_index, r, h, 0);
        x[off..off + l.dims[3]].iter().map(|e| e.to_f32()).collect()
    };
    let dot32 = |a: &[f32], b: &[f32]| -> f32 { a.iter().zip(b).map(|(x, y)| x * y).sum() };
    let parts = items(p)
        .into_par_iter()
        .map(|(si, hk)| {
            let s = &p.sequences()[si];
            let (sq, sk) = (s.q_len, s.k_len);
            let keys: Vec<Vec<f32>> = (0..sk)
                .map(|j| row_of(k, p.k_layout(), s, s.k_start + j, hk))
                .collect();
            let vals: Vec<Vec<f32>> = (0..sk)
                .map(|j| row_of(v, p.v_layout(), s, s.k_start + j, hk))
                .collect();
            let mut dq = vec![0f32; g * sq * d];
            let mut dk = vec![0f32; sk * d];
            let mut dv = vec![0f32; sk * dvd];
            // The f32 floor's ingredients: the largest |v| per column over the keys, the
            // largest |k| per key; per key the accumulated bound of dK's f32 difference.
            let abs_max = |x: &[f32]| x.iter().fold(0f64, |m, &e| m.max(f64::from(e).abs()));
            let mut vmax = vec![0f64; dvd];
            for vj in &vals {
                for (m, &x) in vmax.iter_mut().zip(vj) {
                    *m = m.max(f64::from(x).abs());
                }
            }
            let kmax: Vec<f64> = keys.iter().map(|kj| abs_max(kj)).collect();
            let mut floor_k = vec![0f64; sk];
            let mut floor_q = 0f64;
            for gi in 0..g {
                let h = hk * g + gi;
                for i in 0..sq {
                    let qi = row_of(q, p.q_layout(), s, s.q_start + i, h);
                    let doi = row_of(d_out, d_out_layout, s, s.q_start + i, h);
                    let mut row: Vec<(usize, f32, f32)> = Vec::new();
                    for j in (0..sk).filter(|&j| allowed(mask, i, j, sq, sk)) {
                        let x = scale * dot32(&qi, &keys[j]);
                        let (sij, dsdx) = match cap {
                            Some(c) => {
                                let t = (x / c).tanh();
                                (c * t, 1.0 - t * t)
                            }
                            None => (x, 1.0),
                        };
                        row.push((j, round(sij), dsdx));
                    }
                    if row.is_empty() {
                        continue;
                    }
                    let lse = if row.iter().any(|r| r.1.is_nan()) {
                        f32::NAN
                    } else {
                        let mx = row.iter().map(|r| r.1).fold(f32::NEG_INFINITY, f32::max);
                        let shift = if mx.is_finite() { mx } else { 0.0 };
                        shift + row.iter().map(|r| (r.1 - shift).exp()).sum::<f32>().ln()
                    };
                    let probs: Vec<f32> = row.iter().map(|r| round((r.1 - lse).exp())).collect();
                    let oi = row_of(out, out_layout, s, s.q_start + i, h);
                    let di = dot32(&doi, &oi);
                    // dP_ij and D_i summed in f32 in another order: each of the n terms' sum
                    // rounds with an error of at most u times the partial sum, of random sign;
                    // their total has a standard deviation of about u·sqrt(n)·‖terms‖₂. eps_i
                    // is 4 such deviations of dP_ij − D_i for every key of the row (|v_j| ≤
                    // vmax per column). The worst case, n·u·Σ|terms|, is 10-30× larger at
                    // d = 64..256 and was never approached (measured on the H200: dS noise
                    // ≤ 1.3e-5 in dQ, dK where this gives 1e-4..1e-3).
                    let n = (dvd + 2) as f64;
                    let eps_i = F32_NOISE_SIGMAS
                        * F32_UNIT
                        * n.sqrt()
                        * doi
                            .iter()
                            .zip(vmax.iter().zip(&oi))
                            .map(|(&g, (&vm, &o))| {
                                let g = f64::from(g);
                                g * g * (vm * vm + f64::from(o) * f64::from(o))
                            })
                            .sum::<f64>()
                            .sqrt();
                    let qmax_i = abs_max(&qi);
                    let mut floor_qi = 0f64;
                    let dqi = &mut dq[(gi * sq + i) * d..(gi * sq + i + 1) * d];
                    for (&(j, _, dsdx), &pij) in row.iter().zip(&probs) {
                        for (a, x) in dv[j * dvd..(j + 1) * dvd].iter_mut().zip(&doi) {
                            *a += pij * x;
                        }
                        let ds = round(pij * (dot32(&doi, &vals[j]) - di));
                        let dx = ds * dsdx * scale;
                        for (a, x) in dqi.iter_mut().zip(&keys[j]) {
                            *a += dx * x;
                        }
                        for (a, x) in dk[j * d..(j + 1) * d].iter_mut().zip(&qi) {
                            *a += dx * x;
                        }
                        // dS_ij's f32 difference is at most P_ij·eps_i, times |dsdx·scale|
                        // on its way to dX; |k_jc| ≤ kmax_j and |q_ic| ≤ qmax_i.
                        let w = f64::from(pij) * eps_i * f64::from(dsdx * scale).abs();
                        if w.is_finite() {
                            floor_qi += w * kmax[j];
                            floor_k[j] += w * qmax_i;
                        }
                    }
                    if floor_qi.is_finite() {
                        floor_q = floor_q.max(floor_qi);
                    }
                }
            }
            let r = |x: Vec<f32>| x.into_iter().map(round).collect::<Vec<f32>>();
            let floor_k = floor_k
                .into_iter()
                .filter(|x| x.is_finite())
                .fold(0f64, f64::max);
            (
                Part {
                    seq: si,
                    kv_head: hk,
                    dq: r(dq),
                    dk: r(dk),
                    dv: r(dv),
                },
                [floor_q, floor_k],
            )
        })
        .collect::<Vec<_>>();
    let f32_floor = parts
        .iter()
        .fold([0f64; 3], |m, (_, f)| [m[0].max(f[0]), m[1].max(f[1]), 0.0]);
    LowpGrads {
        grads: assemble(p, parts.into_iter().map(|(part, _)| part).collect()),
        f32_floor,
    }
}

/// The error of one f32 addition, relative: one ulp (2⁻²³), not the half ulp of round to
/// nearest, because tensor cores' f32 accumulation need not round to nearest.
const F32_UNIT: f64 = 1.0 / (1u64 << 23) as f64;

/// Standard deviations of f32 summation noise the floor allows (a random walk of n roundings
/// exceeds 4σ with probability below 1e-4 per sum).
const F32_NOISE_SIGMAS: f64 = 4.0;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::problem::Options;

    #[test]
    fn one_key_has_no_score_gradient() {
        // With one allowed key P = 1 whatever the score: dQ = dK = 0, dV = dO.
        let l = Layout::new("q", &[1, 1, 1, 2], None).unwrap();
        let p = Problem::new(DType::F32, &l, &l, &l, &l, None, None, &Options::new()).unwrap();
        let g = grad_f64(
            &p,
            &[1.0f32, 2.0],
            &[3.0f32, -1.0],
            &[5.0f32, 7.0],
            &[0.5f32, -2.0],
            &l,
        );
        assert_eq!(g.dq, vec![0.0, 0.0]);
        assert_eq!(g.dk, vec![0.0, 0.0]);
        assert_eq!(g.dv, vec![0.5, -2.0]);
    }

    #[test]
    fn two_keys_by_hand() {
        // d = 1, scale 1, q = 1, k = (0, 1), v = (0, 1), dO = 1: s = (0, 1),
        // P = (1, e)/(1 + e), O = P1, dP = v, D = O, dS_j = P_j (v_j − O).
        let q = Layout::new("q", &[1, 1, 1, 1], None).unwrap();
        let k = Layout::new("k", &[1, 2, 1, 1], None).unwrap();
        let opts = Options::new().scale(1.0);
        let p = Problem::new(DType::F32, &q, &k, &k, &q, None, None, &opts).unwrap();
        let g = grad_f64(&p, &[1.0f32], &[0.0f32, 1.0], &[0.0f32, 1.0], &[1.0f32], &q);
        let e = 1f64.exp();
        let (p0, p1) = (1.0 / (1.0 + e), e / (1.0 + e));
        let (ds0, ds1) = (p0 * (0.0 - p1), p1 * (1.0 - p1));
        assert!((g.dq[0] - (ds0 * 0.0 + ds1 * 1.0)).abs() < 1e-15);
        assert!((g.dk[0] - ds0).abs() < 1e-15 && (g.dk[1] - ds1).abs() < 1e-15);
        assert!((g.dv[0] - p0).abs() < 1e-15 && (g.dv[1] - p1).abs() < 1e-15);
    }

    #[test]
    fn the_mask_predicate_matches_the_definition() {
        // sq = 2, sk = 5, causal: row 0 sees keys 0..=3, row 1 all five.
        assert!(allowed(Mask::Causal, 0, 3, 2, 5) && !allowed(Mask::Causal, 0, 4, 2, 5));
        assert!(allowed(Mask::Causal, 1, 4, 2, 5));
        // sq = 5 > sk = 2: rows 0..=2 see nothing.
        assert!(!allowed(Mask::Causal, 2, 0, 5, 2) && allowed(Mask::Causal, 3, 0, 5, 2));
        let w = Mask::Window {
            left: Some(1),
            right: Some(0),
        };
        assert!(!allowed(w, 3, 1, 4, 4) && allowed(w, 3, 2, 4, 4) && allowed(w, 3, 3, 4, 4));
        assert!(!allowed(Mask::None, 0, 5, 1, 5));
    }
}
