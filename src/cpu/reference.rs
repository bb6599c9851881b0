//! The float64 oracle and the naive low-precision evaluation used by the tolerance rule.
//!
//! Both are direct transcriptions of `spec/attention.md`, one query row at a time, with no
//! tiling and no online softmax: slow on purpose, so that there is nothing clever to get wrong.
//! Outputs are contiguous: O in O's dims (`[batch, seqlen_q, heads_q, head_dim_v]` or
//! `[total_q, heads_q, head_dim_v]`), LSE in the problem's LSE layout.

use rayon::prelude::*;

use crate::problem::{Problem, Sequence};
use crate::tensor::{Element, Layout};

/// O and LSE of an evaluation, contiguous (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct Output<F> {
    /// O, contiguous in O's dims.
    pub o: Vec<F>,
    /// LSE (natural log), in the problem's LSE layout; `-inf` for rows with no allowed key.
    pub lse: Vec<F>,
}

/// The contiguous layout the reference writes O in.
pub fn contiguous_o_layout(p: &Problem) -> Layout {
    let l = p.o_layout();
    let shape: Vec<usize> = if l.packed {
        l.dims[1..].to_vec()
    } else {
        l.dims.to_vec()
    };
    Layout::new("out", &shape, None).expect("a validated O shape is a valid contiguous layout")
}

/// One (sequence, head) block of results: rows × dv of O and rows of LSE.
struct Block<F> {
    seq: usize,
    head: usize,
    o: Vec<F>,
    lse: Vec<F>,
}

fn assemble<F: Copy + Default + Send>(p: &Problem, blocks: Vec<Block<F>>) -> Output<F> {
    let ol = contiguous_o_layout(p);
    let dv = p.head_dim_v();
    let mut o = vec![F::default(); ol.numel()];
    let mut lse = vec![F::default(); p.lse_len()];
    for b in blocks {
        let s = &p.sequences()[b.seq];
        for i in 0..s.q_len {
            let off = ol.offset(s.batch_index, s.q_start + i, b.head);
            o[off..off + dv].copy_from_slice(&b.o[i * dv..(i + 1) * dv]);
            lse[p.lse_offset(s, b.head, i)] = b.lse[i];
        }
    }
    Output { o, lse }
}

fn work_items(p: &Problem) -> Vec<(usize, usize)> {
    (0..p.sequences().len())
        .flat_map(|s| (0..p.heads_q()).map(move |h| (s, h)))
        .collect()
}

fn row<'a, T: Element>(
    data: &'a [T],
    l: &Layout,
    s: &Sequence,
    row: usize,
    head: usize,
    n: usize,
) -> &'a [T] {
    let off = l.offset(s.batch_index, row, head);
    &data[off..off + n]
}

/// Float64 evaluation of `spec/attention.md` from the (already rounded) inputs.
pub fn attention_f64<T: Element>(p: &Problem, q: &[T], k: &[T], v: &[T]) -> Output<f64> {
    let (d, dv) = (p.head_dim(), p.head_dim_v());
    let scale = f64::from(p.scale());
    let softcap = p.softcap().map(f64::from);
    let blocks = work_items(p)
        .into_par_iter()
        .map(|(si, h)| {
            let s = &p.sequences()[si];
            let hk = h / p.group();
            let m = p.seq_mask(s);
            let mut o = vec![0f64; s.q_len * dv];
            let mut lse = vec![f64::NEG_INFINITY; s.q_len];
            let mut scores = Vec::with_capacity(s.k_len);
            for i in 0..s.q_len {
                let qi = row(q, p.q_layout(), s, s.q_start + i, h, d);
                scores.clear();
                for j in m.key_range(i) {
                    let kj = row(k, p.k_layout(), s, s.k_start + j, hk, d);
                    let dot: f64 = qi
                        .iter()
                        .zip(kj)
                        .map(|(a, b)| f64::from(a.to_f32()) * f64::from(b.to_f32()))
                        .sum();
                    let mut x = scale * dot;
                    if let Some(c) = softcap {
                        x = c * (x / c).tanh();
                    }
                    scores.push((j, x));
                }
                if scores.is_empty() {
                    continue;
                }
                let mx = scores
                    .iter()
                    .map(|&(_, x)| x)
                    .fold(f64::NEG_INFINITY, f64::max);
                // A NaN score makes the max NaN-free under f64::max; propagate it explicitly.
                let any_nan = scores.iter().any(|&(_, x)| x.is_nan());
                let shift = if mx.is_finite() { mx } else { 0.0 };
                let sum: f64 = scores.iter().map(|&(_, x)| (x - shift).exp()).sum();
                let l = if any_nan { f64::NAN } else { shift + sum.ln() };
                lse[i] = l;
                let oi = &mut o[i * dv..(i + 1) * dv];
                for &(j, x) in &scores {
                    let w = (x - l).exp();
                    let vj = row(v, p.v_layout(), s, s.k_start + j, hk, dv);
                    for (acc, val) in oi.iter_mut().zip(vj) {
                        *acc += w * f64::from(val.to_f32());
                    }
                }
            }
            Block {
                seq: si,
                head: h,
                o,
                lse,
            }
        })
        .collect();
    assemble(p, blocks)
}

/// The naive evaluation in the storage precision: inputs in `T`, scores and P rounded to `T`,
/// f32 accumulation, O rounded to `T` (for f32 storage this is a plain f32 evaluation).
pub fn attention_lowp<T: Element>(p: &Problem, q: &[T], k: &[T], v: &[T]) -> Output<f32> {
    let (d, dv) = (p.head_dim(), p.head_dim_v());
    let scale = p.scale();
    let softcap = p.softcap();
    let round = |x: f32| T::from_f32(x).to_f32();
    let blocks = work_items(p)
        .into_par_iter()
        .map(|(si, h)| {
            let s = &p.sequences()[si];
            let hk = h / p.group();
            let m = p.seq_mask(s);
            let mut o = vec![0f32; s.q_len * dv];
            let mut lse = vec![f32::NEG_INFINITY; s.q_len];
            let mut scores = Vec::with_capacity(s.k_len);
            for i in 0..s.q_len {
                let qi = row(q, p.q_layout(), s, s.q_start + i, h, d);
                scores.clear();
                for j in m.key_range(i) {
                    let kj = row(k, p.k_layout(), s, s.k_start + j, hk, d);
                    let dot: f32 = qi
                        .iter()
                        .zip(kj)
                        .map(|(a, b)| a.to_f32() * b.to_f32())
                        .sum();
                    let mut x = scale * dot;
                    if let Some(c) = softcap {
                        x = c * (x / c).tanh();
                    }
                    scores.push((j, round(x)));
                }
                if scores.is_empty() {
                    continue;
                }
                let mx = scores
                    .iter()
                    .map(|&(_, x)| x)
                    .fold(f32::NEG_INFINITY, f32::max);
                let any_nan = scores.iter().any(|&(_, x)| x.is_nan());
                let shift = if mx.is_finite() { mx } else { 0.0 };
                let mut sum = 0f32;
                let oi = &mut o[i * dv..(i + 1) * dv];
                for &(j, x) in &scores {
                    let w = round((x - shift).exp());
                    sum += w;
                    let vj = row(v, p.v_layout(), s, s.k_start + j, hk, dv);
                    for (acc, val) in oi.iter_mut().zip(vj) {
                        *acc += w * val.to_f32();
                    }
                }
                for x in oi.iter_mut() {
                    *x = round(*x / sum);
                }
                lse[i] = if any_nan { f32::NAN } else { shift + sum.ln() };
            }
            Block {
                seq: si,
                head: h,
                o,
                lse,
            }
        })
        .collect();
    assemble(p, blocks)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::problem::Options;

    fn problem(sq: usize, sk: usize, d: usize, opts: Options) -> Problem {
        let q = Layout::new("q", &[1, sq, 1, d], None).unwrap();
        let k = Layout::new("k", &[1, sk, 1, d], None).unwrap();
        Problem::new(DType::F32, &q, &k, &k, &q, None, None, &opts).unwrap()
    }

    #[test]
    fn two_keys_by_hand() {
        // q = [1, 0], k0 = [0, 0], k1 = [2, 0], scale 1: scores 0 and 2.
        let p = problem(1, 2, 2, Options::new().scale(1.0));
        let q = [1.0f32, 0.0];
        let k = [0.0f32, 0.0, 2.0, 0.0];
        let v = [1.0f32, -1.0, 3.0, 5.0];
        let out = attention_f64(&p, &q, &k, &v);
        let (w0, w1) = (1.0 / (1.0 + 2f64.exp()), 2f64.exp() / (1.0 + 2f64.exp()));
        assert!((out.o[0] - (w0 + 3.0 * w1)).abs() < 1e-15);
        assert!((out.o[1] - (-w0 + 5.0 * w1)).abs() < 1e-15);
        assert!((out.lse[0] - (1.0 + 2f64.exp()).ln()).abs() < 1e-15);
    }

    #[test]
    fn default_scale_softcap_and_causal_by_hand() {
        // d = 4: scale 1/2. q·k = 8 → s = 4; softcap 2: s = 2·tanh(2).
        let p = problem(1, 1, 4, Options::new().softcap(2.0));
        let q = [2.0f32; 4];
        let k = [1.0f32; 4];
        let v = [7.0f32; 4];
        let out = attention_f64(&p, &q, &k, &v);
        assert_eq!(out.o, vec![7.0; 4]);
        assert!((out.lse[0] - 2.0 * 2f64.tanh()).abs() < 1e-15);

        // sq = 2 > sk = 1, causal: row 0 sees no key (O = 0, LSE = −inf), row 1 sees key 0.
        let p = problem(2, 1, 1, Options::new().causal());
        let out = attention_f64(&p, &[1.0f32, 1.0], &[3.0f32], &[5.0f32]);
        assert_eq!(out.o, vec![0.0, 5.0]);
        assert_eq!(out.lse[0], f64::NEG_INFINITY);
        assert_eq!(out.lse[1], 3.0);
    }

    #[test]
    fn nan_in_a_key_poisons_the_rows_that_see_it() {
        let p = problem(2, 2, 1, Options::new().causal().scale(1.0));
        let out = attention_f64(&p, &[1.0f32, 1.0], &[0.0f32, f32::NAN], &[1.0f32, 2.0]);
        assert_eq!(out.o[0], 1.0);
        assert!(out.o[1].is_nan() && out.lse[1].is_nan());
        let low = attention_lowp(&p, &[1.0f32, 1.0], &[0.0f32, f32::NAN], &[1.0f32, 2.0]);
        assert_eq!(low.o[0], 1.0);
        assert!(low.o[1].is_nan());
    }
}
