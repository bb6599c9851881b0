//! The float64 oracle and the naive low-precision evaluation used by the tolerance rule.
//!
//! Both transcribe `docs/attention.md` one query row at a time, with no tiling and no online
//! softmax: slow on purpose, so that there is nothing clever to get wrong. They share no code
//! with the backends they judge: the mask is the per-element predicate [`allowed`] written from
//! the definition (not [`crate::mask::SeqMask`]), and tensors are read through this module's
//! own stride arithmetic (not [`Layout::offset`]). Memory beyond the outputs (8 bytes per
//! element of O and LSE for the float64 oracle) is, per worker thread, one (sequence, head)
//! block of O and LSE and one row of scores: the oracle never materialises S.
//!
//! Outputs are contiguous: O in O's dims (`[batch, seqlen_q, heads_q, head_dim_v]` or
//! `[total_q, heads_q, head_dim_v]`, see [`o_offset`]), LSE in the problem's LSE layout
//! (`[batch, heads_q, seqlen_q]` or `[heads_q, total_q]`, see [`lse_offset`]).

use std::sync::Mutex;

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::fp8::{Descales, F8E4M3};
use crate::mask::Mask;
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

/// Whether key `j` is allowed for query row `i` of a sequence of `sq` queries and `sk` keys:
/// `j < sk`, `i < sq` and, with `d = i + sk − sq` (the bottom-right-aligned diagonal),
/// causal `j ≤ d`, window `d − left ≤ j ≤ d + right` (`None` sides unbounded). Evaluated in
/// signed 128-bit arithmetic, so `d` may be negative and no bound can wrap.
pub fn allowed(mask: Mask, sq: usize, sk: usize, i: usize, j: usize) -> bool {
    let (sq, sk, i, j) = (sq as i128, sk as i128, i as i128, j as i128);
    if i >= sq || j >= sk {
        return false;
    }
    let diag = i + sk - sq;
    match mask {
        Mask::None => true,
        Mask::Causal => j <= diag,
        Mask::Window { left, right } => {
            left.is_none_or(|l| diag - l as i128 <= j)
                && right.is_none_or(|r| j <= diag + r as i128)
        }
    }
}

/// Element offset of `(batch, row, head, 0)` in a strided tensor.
#[inline]
pub(crate) fn strided(l: &Layout, batch: usize, row: usize, head: usize) -> usize {
    batch * l.strides[0] + row * l.strides[1] + head * l.strides[2]
}

/// Offset of `(sequence s, head, row i, column 0)` in the oracle's contiguous O.
pub fn o_offset(p: &Problem, s: &Sequence, head: usize, i: usize) -> usize {
    let [_, rows, heads, dv] = p.o_layout().dims;
    ((s.batch_index * rows + s.q_start + i) * heads + head) * dv
}

/// Offset of `(sequence s, head, row i)` in LSE: `[batch, heads_q, seqlen_q]` for fixed-length
/// batches, `[heads_q, total_q]` for packed ones (whose batch index is always 0).
pub fn lse_offset(p: &Problem, s: &Sequence, head: usize, i: usize) -> usize {
    let rows = p.q_layout().dims[1];
    (s.batch_index * p.heads_q() + head) * rows + s.q_start + i
}

/// Elements of LSE: `batch · heads_q · seqlen_q` or `heads_q · total_q`.
fn lse_len(p: &Problem) -> usize {
    let [b, rows, ..] = p.q_layout().dims;
    b * p.heads_q() * rows
}

/// Checks that a buffer of `len` elements reaches every element of `l`, naming `name`.
pub(crate) fn check_len(name: &str, l: &Layout, len: usize) -> Result<()> {
    let need = if l.dims.contains(&0) {
        Some(0)
    } else {
        (0..3).try_fold(l.dims[3], |acc, a| {
            acc.checked_add((l.dims[a] - 1).checked_mul(l.strides[a])?)
        })
    };
    match need {
        Some(n) if n <= len => Ok(()),
        Some(n) => Err(Error::invalid(
            name,
            format!(
                "shape {:?} with strides {:?} needs {n} elements, the buffer holds {len}",
                l.dims, l.strides
            ),
        )),
        None => Err(Error::invalid(name, "shape and strides overflow usize")),
    }
}

fn check_inputs<Tq, Tk>(p: &Problem, q: &[Tq], k: &[Tk], v: &[Tk]) -> Result<()> {
    check_len("q", p.q_layout(), q.len())?;
    check_len("k", p.k_layout(), k.len())?;
    check_len("v", p.v_layout(), v.len())
}

/// One (sequence, head) block of results: rows × dv of O and rows of LSE.
struct Block<F> {
    seq: usize,
    head: usize,
    o: Vec<F>,
    lse: Vec<F>,
}

/// Evaluates every (sequence, head) block with `f`, in parallel, each finished block copied
/// into the outputs at once: memory is the outputs plus one block per worker thread.
fn evaluate<F, B>(p: &Problem, f: B) -> Output<F>
where
    F: Copy + Default + Send,
    B: Fn(usize, usize) -> Block<F> + Sync,
{
    let dv = p.head_dim_v();
    let out = Mutex::new(Output {
        o: vec![F::default(); p.o_layout().numel()],
        lse: vec![F::default(); lse_len(p)],
    });
    let items: Vec<(usize, usize)> = (0..p.sequences().len())
        .flat_map(|s| (0..p.heads_q()).map(move |h| (s, h)))
        .collect();
    items.into_par_iter().for_each(|(si, h)| {
        let b = f(si, h);
        let s = &p.sequences()[b.seq];
        // A poisoned lock only means another block panicked; this block's rows are its own.
        let mut g = out.lock().unwrap_or_else(|e| e.into_inner());
        for i in 0..s.q_len {
            let off = o_offset(p, s, b.head, i);
            g.o[off..off + dv].copy_from_slice(&b.o[i * dv..(i + 1) * dv]);
            let l = lse_offset(p, s, b.head, i);
            g.lse[l] = b.lse[i];
        }
    });
    out.into_inner().unwrap_or_else(|e| e.into_inner())
}

/// Row `row` (within the tensor's sequence axis) of head `head`, `n` elements; the caller
/// checked the buffer with [`check_len`].
fn row<'a, T>(
    data: &'a [T],
    l: &Layout,
    s: &Sequence,
    row: usize,
    head: usize,
    n: usize,
) -> &'a [T] {
    let off = strided(l, s.batch_index, row, head);
    &data[off..off + n]
}

/// Float64 evaluation of `docs/attention.md` from the (already rounded) inputs, laid out as
/// the problem says. Errors name a buffer too short for its layout.
pub fn attention_f64<T: Element>(p: &Problem, q: &[T], k: &[T], v: &[T]) -> Result<Output<f64>> {
    check_inputs(p, q, k, v)?;
    let value = |x: &T| f64::from(x.to_f32());
    Ok(oracle(p, q, k, v, value, value, |_, _| [1.0; 3]))
}

/// The value of an e4m3 ("fn") byte, read from the format's definition (sign, four exponent
/// bits of bias 7, three mantissa bits; exponent 0 subnormal; `S.1111.111` NaN; no
/// infinities), independently of the conversions the backends use.
pub fn e4m3_value(bits: u8) -> f64 {
    let sign = if bits & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = (i32::from((bits >> 3) & 0xF), f64::from(bits & 7));
    if e == 15 && m == 7.0 {
        return f64::NAN;
    }
    let mag = if e == 0 {
        m * 2f64.powi(-9)
    } else {
        (1.0 + m / 8.0) * 2f64.powi(e - 7)
    };
    sign * mag
}

/// The descales of sequence `si`, KV head `hk` (`[sequences, heads_kv]` arrays, absent: 1),
/// read with the oracle's own indexing.
fn descales_at(p: &Problem, d: &Descales, si: usize, hk: usize) -> [f64; 3] {
    let at = |a: Option<&[f32]>| a.map_or(1.0, |a| f64::from(a[si * p.heads_kv() + hk]));
    [at(d.q), at(d.k), at(d.v)]
}

fn check_descales(p: &Problem, d: &Descales) -> Result<()> {
    let n = p.sequences().len() * p.heads_kv();
    for (name, a) in [("q_descale", d.q), ("k_descale", d.k), ("v_descale", d.v)] {
        if a.is_some_and(|a| a.len() != n) {
            return Err(Error::invalid(name, format!("expected {n} entries")));
        }
    }
    Ok(())
}

/// Float64 evaluation of fp8 e4m3 inputs (`docs/attention.md`, "FP8 (e4m3) inputs"): each
/// byte decoded by [`e4m3_value`] and multiplied by its descale, exactly, in float64. Errors
/// name a buffer too short for its layout or a descale array of the wrong length.
pub fn attention_f64_fp8(
    p: &Problem,
    q: &[F8E4M3],
    k: &[F8E4M3],
    v: &[F8E4M3],
    descales: &Descales,
) -> Result<Output<f64>> {
    check_inputs(p, q, k, v)?;
    check_descales(p, descales)?;
    let value = |x: &F8E4M3| e4m3_value(x.to_bits());
    Ok(oracle(p, q, k, v, value, value, |si, hk| {
        descales_at(p, descales, si, hk)
    }))
}

/// Float64 evaluation of 16-bit (or f32) queries against fp8 e4m3 keys and values with one scale
/// per KV head (an fp8 KV cache, gathered: `docs/attention.md`, "Paged KV cache"): key `j` of KV
/// head `hk` stands for `k_scale[hk] · k_j`, exactly. Errors name a buffer too short for its
/// layout or a scale array that is not `heads_kv` long.
pub fn attention_f64_kv_fp8<T: Element>(
    p: &Problem,
    q: &[T],
    k: &[F8E4M3],
    v: &[F8E4M3],
    k_scale: &[f32],
    v_scale: &[f32],
) -> Result<Output<f64>> {
    check_inputs(p, q, k, v)?;
    for (name, a) in [("k_scale", k_scale), ("v_scale", v_scale)] {
        if a.len() != p.heads_kv() {
            return Err(Error::invalid(
                name,
                format!("expected {} entries", p.heads_kv()),
            ));
        }
    }
    Ok(oracle(
        p,
        q,
        k,
        v,
        |x: &T| f64::from(x.to_f32()),
        |x: &F8E4M3| e4m3_value(x.to_bits()),
        |_, hk| [1.0, f64::from(k_scale[hk]), f64::from(v_scale[hk])],
    ))
}

/// The float64 evaluation, reading elements with `value` and multiplying Q's, K's and V's
/// elements of sequence `si`, KV head `hk` by `descale(si, hk)`.
fn oracle<Tq: Sync, Tk: Sync>(
    p: &Problem,
    q: &[Tq],
    k: &[Tk],
    v: &[Tk],
    qvalue: impl Fn(&Tq) -> f64 + Sync,
    value: impl Fn(&Tk) -> f64 + Sync,
    descale: impl Fn(usize, usize) -> [f64; 3] + Sync,
) -> Output<f64> {
    let (d, dv) = (p.head_dim(), p.head_dim_v());
    let scale = f64::from(p.scale());
    let softcap = p.softcap().map(f64::from);
    let mask = p.mask();
    evaluate(p, |si, h| {
        let s = &p.sequences()[si];
        let hk = h / (p.heads_q() / p.heads_kv());
        let [dq, dk, dvs] = descale(si, hk);
        let mut o = vec![0f64; s.q_len * dv];
        let mut lse = vec![f64::NEG_INFINITY; s.q_len];
        let mut scores = Vec::new();
        for i in 0..s.q_len {
            let qi = row(q, p.q_layout(), s, s.q_start + i, h, d);
            scores.clear();
            for j in (0..s.k_len).filter(|&j| allowed(mask, s.q_len, s.k_len, i, j)) {
                let kj = row(k, p.k_layout(), s, s.k_start + j, hk, d);
                let dot: f64 = qi
                    .iter()
                    .zip(kj)
                    .map(|(a, b)| dq * qvalue(a) * (dk * value(b)))
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
            // f64::max skips NaN, so a NaN score is propagated explicitly.
            let any_nan = scores.iter().any(|&(_, x)| x.is_nan());
            let shift = if mx.is_finite() { mx } else { 0.0 };
            let sum: f64 = scores.iter().map(|&(_, x)| (x - shift).exp()).sum();
            let l = if any_nan { f64::NAN } else { shift + sum.ln() };
            lse[i] = l;
            if l == f64::NEG_INFINITY {
                // Every allowed score is −∞: no key carries weight, as with no allowed key.
                continue;
            }
            let oi = &mut o[i * dv..(i + 1) * dv];
            for &(j, x) in &scores {
                let w = (x - l).exp();
                let vj = row(v, p.v_layout(), s, s.k_start + j, hk, dv);
                for (acc, val) in oi.iter_mut().zip(vj) {
                    *acc += w * (dvs * value(val));
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
}

/// The naive evaluation in the storage precision: inputs in `T`, scores and P rounded to `T`,
/// f32 accumulation, O rounded to `T` (for f32 storage this is a plain f32 evaluation).
/// Errors name a buffer too short for its layout.
pub fn attention_lowp<T: Element>(p: &Problem, q: &[T], k: &[T], v: &[T]) -> Result<Output<f32>> {
    check_inputs(p, q, k, v)?;
    let (d, dv) = (p.head_dim(), p.head_dim_v());
    let scale = p.scale();
    let softcap = p.softcap();
    let mask = p.mask();
    let round = |x: f32| T::from_f32(x).to_f32();
    Ok(evaluate(p, |si, h| {
        let s = &p.sequences()[si];
        let hk = h / (p.heads_q() / p.heads_kv());
        let mut o = vec![0f32; s.q_len * dv];
        let mut lse = vec![f32::NEG_INFINITY; s.q_len];
        let mut scores = Vec::new();
        for i in 0..s.q_len {
            let qi = row(q, p.q_layout(), s, s.q_start + i, h, d);
            scores.clear();
            for j in (0..s.k_len).filter(|&j| allowed(mask, s.q_len, s.k_len, i, j)) {
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
            lse[i] = if any_nan { f32::NAN } else { shift + sum.ln() };
            if lse[i] == f32::NEG_INFINITY {
                // Every allowed score is −∞: as with no allowed key.
                oi.fill(0.0);
                continue;
            }
            for x in oi.iter_mut() {
                *x = round(*x / sum);
            }
        }
        Block {
            seq: si,
            head: h,
            o,
            lse,
        }
    }))
}

/// Largest value of `P̃ = 2⁸ · exp(s − max)` in the fp8 naive evaluation (and the GPU
/// kernel's scaling, `docs/attention.md`): P rounded to e4m3 from `(0, 256]`.
pub const FP8_P_SCALE: f32 = 256.0;

/// The naive evaluation of fp8 inputs: the dequantized values in f32, f32 scores,
/// `P̃ = 256 · exp(s − max)` rounded to e4m3 (what the P·V product takes), the row sum in f32
/// over the unrounded `P̃`, O rounded to `O`. Errors as [`attention_f64_fp8`].
pub fn attention_lowp_fp8<O: Element>(
    p: &Problem,
    q: &[F8E4M3],
    k: &[F8E4M3],
    v: &[F8E4M3],
    descales: &Descales,
) -> Result<Output<f32>> {
    check_inputs(p, q, k, v)?;
    check_descales(p, descales)?;
    let (d, dv) = (p.head_dim(), p.head_dim_v());
    let (scale, softcap, mask) = (p.scale(), p.softcap(), p.mask());
    Ok(evaluate(p, |si, h| {
        let s = &p.sequences()[si];
        let hk = h / (p.heads_q() / p.heads_kv());
        let [dq, dk, dvs] = descales_at(p, descales, si, hk).map(|x| x as f32);
        let mut o = vec![0f32; s.q_len * dv];
        let mut lse = vec![f32::NEG_INFINITY; s.q_len];
        let mut scores = Vec::new();
        for i in 0..s.q_len {
            let qi = row(q, p.q_layout(), s, s.q_start + i, h, d);
            scores.clear();
            for j in (0..s.k_len).filter(|&j| allowed(mask, s.q_len, s.k_len, i, j)) {
                let kj = row(k, p.k_layout(), s, s.k_start + j, hk, d);
                let dot: f32 = qi
                    .iter()
                    .zip(kj)
                    .map(|(a, b)| (a.to_f32() * dq) * (b.to_f32() * dk))
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
                .fold(f32::NEG_INFINITY, f32::max);
            let any_nan = scores.iter().any(|&(_, x)| x.is_nan());
            let shift = if mx.is_finite() { mx } else { 0.0 };
            let mut sum = 0f32;
            let oi = &mut o[i * dv..(i + 1) * dv];
            for &(j, x) in &scores {
                let w = FP8_P_SCALE * (x - shift).exp();
                sum += w;
                let w8 = F8E4M3::from_f32(w).to_f32();
                let vj = row(v, p.v_layout(), s, s.k_start + j, hk, dv);
                for (acc, val) in oi.iter_mut().zip(vj) {
                    *acc += w8 * (val.to_f32() * dvs);
                }
            }
            lse[i] = if any_nan {
                f32::NAN
            } else {
                shift + (sum / FP8_P_SCALE).ln()
            };
            if lse[i] == f32::NEG_INFINITY {
                oi.fill(0.0);
                continue;
            }
            for x in oi.iter_mut() {
                *x = O::from_f32(*x / sum).to_f32();
            }
        }
        Block {
            seq: si,
            head: h,
            o,
            lse,
        }
    }))
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
        let out = attention_f64(&p, &q, &k, &v).unwrap();
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
        let out = attention_f64(&p, &q, &k, &v).unwrap();
        assert_eq!(out.o, vec![7.0; 4]);
        assert!((out.lse[0] - 2.0 * 2f64.tanh()).abs() < 1e-15);

        // sq = 2 > sk = 1, causal: row 0 sees no key (O = 0, LSE = −inf), row 1 sees key 0.
        let p = problem(2, 1, 1, Options::new().causal());
        let out = attention_f64(&p, &[1.0f32, 1.0], &[3.0f32], &[5.0f32]).unwrap();
        assert_eq!(out.o, vec![0.0, 5.0]);
        assert_eq!(out.lse[0], f64::NEG_INFINITY);
        assert_eq!(out.lse[1], 3.0);
    }

    #[test]
    fn nan_in_a_key_poisons_the_rows_that_see_it() {
        let p = problem(2, 2, 1, Options::new().causal().scale(1.0));
        let out = attention_f64(&p, &[1.0f32, 1.0], &[0.0f32, f32::NAN], &[1.0f32, 2.0]).unwrap();
        assert_eq!(out.o[0], 1.0);
        assert!(out.o[1].is_nan() && out.lse[1].is_nan());
        let low = attention_lowp(&p, &[1.0f32, 1.0], &[0.0f32, f32::NAN], &[1.0f32, 2.0]).unwrap();
        assert_eq!(low.o[0], 1.0);
        assert!(low.o[1].is_nan());
    }

    #[test]
    fn infinite_scores_by_hand() {
        // Row 0: scores −∞, −∞: no key carries weight, O = 0 and LSE = −∞ (not NaN).
        // Row 1: scores +∞, +∞: LSE = +∞ and O = NaN (exp(+∞ − +∞)).
        let p = problem(2, 2, 1, Options::new().scale(1.0));
        let (q, k, v) = ([-1.0f32, 1.0], [f32::INFINITY; 2], [2.0f32, 3.0]);
        let out = attention_f64(&p, &q, &k, &v).unwrap();
        assert_eq!(out.lse[0], f64::NEG_INFINITY);
        assert_eq!(out.o[0], 0.0);
        assert_eq!(out.lse[1], f64::INFINITY);
        assert!(out.o[1].is_nan());
        let low = attention_lowp(&p, &q, &k, &v).unwrap();
        assert_eq!((low.o[0], low.lse[0]), (0.0, f32::NEG_INFINITY));
        assert_eq!(low.lse[1], f32::INFINITY);
        assert!(low.o[1].is_nan());
    }

    /// The allowed keys of each row as a string (`x` allowed, `.` masked).
    fn pattern(mask: Mask, sq: usize, sk: usize) -> Vec<String> {
        (0..sq)
            .map(|i| {
                (0..sk)
                    .map(|j| {
                        if allowed(mask, sq, sk, i, j) {
                            'x'
                        } else {
                            '.'
                        }
                    })
                    .collect()
            })
            .collect()
    }

    fn window(left: Option<usize>, right: Option<usize>) -> Mask {
        Mask::Window { left, right }
    }

    /// Each table is worked out by hand from the definition in docs/attention.md.
    #[test]
    fn mask_predicate_matches_hand_derived_tables() {
        // sq = 3, sk = 5: the diagonal of row i is key i + 2.
        assert_eq!(pattern(Mask::Causal, 3, 5), ["xxx..", "xxxx.", "xxxxx"]);
        // sq = 5, sk = 3: diagonal i − 2; rows 0 and 1 see nothing.
        let want = ["...", "...", "x..", "xx.", "xxx"];
        assert_eq!(pattern(Mask::Causal, 5, 3), want);
        assert_eq!(pattern(window(None, Some(0)), 5, 3), want);
        // Window (1, 1), square: keys i − 1 ..= i + 1.
        let want = ["xx...", "xxx..", ".xxx.", "..xxx", "...xx"];
        assert_eq!(pattern(window(Some(1), Some(1)), 5, 5), want);
        // Window (2, 0), sq = 3, sk = 6: diagonal i + 3, keys i + 1 ..= i + 3.
        let want = [".xxx..", "..xxx.", "...xxx"];
        assert_eq!(pattern(window(Some(2), Some(0)), 3, 6), want);
        // Window (0, 1), sq = 4, sk = 2: diagonal i − 2, keys i − 2 ..= i − 1.
        let want = ["..", "x.", "xx", ".x"];
        assert_eq!(pattern(window(Some(0), Some(1)), 4, 2), want);
        // Window (1, unbounded), sq = 2, sk = 4: diagonal i + 2, keys from i + 1.
        let want = [".xxx", "..xx"];
        assert_eq!(pattern(window(Some(1), None), 2, 4), want);
        // Huge sides do not wrap: a window of usize::MAX is no mask at all.
        let all = ["xxx", "xxx"];
        assert_eq!(
            pattern(window(Some(usize::MAX), Some(usize::MAX)), 2, 3),
            all
        );
        assert_eq!(pattern(Mask::None, 2, 3), all);
        // Rows and keys outside the sequence are never allowed.
        assert!(!allowed(Mask::None, 2, 3, 2, 0));
        assert!(!allowed(Mask::None, 2, 3, 0, 3));
    }

    #[test]
    fn strided_inputs_read_the_right_elements() {
        // Q viewed inside a padded buffer: rows 2 heads × (d = 2) + 3 padding elements apart,
        // heads 2 + 1 apart. The padding holds NaN, so reading it would poison the result.
        let (sq, sk, h, d) = (3, 2, 2, 2);
        let q_strides = [sq * 7, 7, 3, 1];
        let mut qs = vec![f32::NAN; sq * 7];
        let mut qc = vec![0f32; sq * h * d];
        for i in 0..sq {
            for hh in 0..h {
                for c in 0..d {
                    let x = (1 + i * 4 + hh * 2 + c) as f32 * 0.25;
                    qs[i * 7 + hh * 3 + c] = x;
                    qc[(i * h + hh) * d + c] = x;
                }
            }
        }
        let k: Vec<f32> = (0..sk * h * d).map(|x| (x as f32 * 0.7).sin()).collect();
        let v: Vec<f32> = (0..sk * h * d).map(|x| (x as f32 * 1.3).cos()).collect();
        let kl = Layout::new("k", &[1, sk, h, d], None).unwrap();
        let opts = Options::new();
        let strided = Layout::new("q", &[1, sq, h, d], Some(&q_strides)).unwrap();
        let contiguous = Layout::new("q", &[1, sq, h, d], None).unwrap();
        let run = |ql: &Layout, q: &[f32]| {
            let p = Problem::new(DType::F32, ql, &kl, &kl, &contiguous, None, None, &opts);
            attention_f64(&p.unwrap(), q, &k, &v).unwrap()
        };
        let (a, b) = (run(&strided, &qs), run(&contiguous, &qc));
        assert!(a.o.iter().all(|x| x.is_finite()));
        assert_eq!(a, b);
    }

    #[test]
    fn short_buffers_are_errors_naming_the_argument() {
        let p = problem(2, 3, 4, Options::new());
        let (q, k) = (vec![1f32; 8], vec![1f32; 12]);
        for (name, q, k, v) in [
            ("q", &q[..7], &k[..], &k[..]),
            ("k", &q[..], &k[..11], &k[..]),
            ("v", &q[..], &k[..], &k[..0]),
        ] {
            for e in [
                attention_f64(&p, q, k, v).unwrap_err(),
                attention_lowp(&p, q, k, v).unwrap_err(),
            ] {
                assert!(e.to_string().contains(&format!("`{name}`")), "{e}");
            }
        }
        assert!(attention_f64(&p, &q, &k, &k).is_ok());
    }
}
