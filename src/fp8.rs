//! fp8 e4m3 inputs (`docs/attention.md`, "FP8 (e4m3) inputs"): the descales that say what the
//! bytes stand for, quantization of float tensors with per-(sequence, KV head) amax scales, and
//! the CPU evaluation (dequantize into f32, run the f32 backend, round O once).
//!
//! The element is [`float8::F8E4M3`] (the crate candle uses for its `F8E4M3` dtype): its
//! conversions round to nearest even and saturate at ±448, as CUDA's `__nv_cvt_float_to_fp8`
//! with `__NV_SATFINITE` does. Its `MAX` constant is not e4m3fn's largest value (448, `0x7E`):
//! fa4 uses [`E4M3_MAX`].

pub use float8::F8E4M3;

use crate::cpu::CpuBackend;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::problem::{Problem, Sequence};
use crate::tensor::{Element, Layout};

/// The largest finite e4m3 value.
pub const E4M3_MAX: f32 = 448.0;

/// Which input a descale or a quantization is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operand {
    /// The queries (a descale shared by the query heads of one KV head's group).
    Q,
    /// The keys.
    K,
    /// The values.
    V,
}

impl Operand {
    /// The argument's name in the API (`q_descale`, …).
    pub fn descale_name(self) -> &'static str {
        match self {
            Operand::Q => "q_descale",
            Operand::K => "k_descale",
            Operand::V => "v_descale",
        }
    }
}

/// The three descale arrays of an fp8 call, each `[sequences, heads_kv]` f32 (a fixed-length
/// batch has `batch` sequences); `None` means all ones. Entry `(b, hk)` multiplies every
/// element of sequence `b`'s KV head `hk` (for Q: of every query head of that head's group).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Descales<'a> {
    /// Q's descales.
    pub q: Option<&'a [f32]>,
    /// K's descales.
    pub k: Option<&'a [f32]>,
    /// V's descales.
    pub v: Option<&'a [f32]>,
}

impl<'a> Descales<'a> {
    /// All three arrays (any may be `None`).
    pub fn new(q: Option<&'a [f32]>, k: Option<&'a [f32]>, v: Option<&'a [f32]>) -> Self {
        Descales { q, k, v }
    }

    /// All ones.
    pub fn ones() -> Self {
        Self::default()
    }

    fn array(&self, op: Operand) -> Option<&'a [f32]> {
        match op {
            Operand::Q => self.q,
            Operand::K => self.k,
            Operand::V => self.v,
        }
    }

    /// Checks every given array against the problem: `sequences · heads_kv` entries, each
    /// finite and greater than 0. Errors name `q_descale`, `k_descale` or `v_descale`.
    pub fn validate(&self, p: &Problem) -> Result<()> {
        let n = p.sequences().len() * p.heads_kv();
        for op in [Operand::Q, Operand::K, Operand::V] {
            if let Some(a) = self.array(op) {
                check_descale(op.descale_name(), a, n)?;
            }
        }
        Ok(())
    }

    /// The descale of `op` for sequence `seq` and KV head `hk` (1 where the array is absent).
    /// The caller validated the arrays ([`Descales::validate`]).
    #[inline]
    pub fn get(&self, op: Operand, seq: usize, hk: usize, heads_kv: usize) -> f32 {
        self.array(op).map_or(1.0, |a| a[seq * heads_kv + hk])
    }
}

/// Checks one descale array: `expected` entries, each finite and > 0. The error names `name`
/// (an argument or a command-line flag).
pub fn check_descale(name: &str, d: &[f32], expected: usize) -> Result<()> {
    if d.len() != expected {
        return Err(Error::invalid(
            name,
            format!(
                "expected {expected} entries ([sequences, heads_kv]), got {}",
                d.len()
            ),
        ));
    }
    if let Some((i, x)) = d
        .iter()
        .enumerate()
        .find(|(_, x)| !(x.is_finite() && **x > 0.0))
    {
        return Err(Error::invalid(
            name,
            format!("entry {i} is {x}: descales must be finite and greater than 0"),
        ));
    }
    Ok(())
}

/// The rows of `op`'s tensor that sequence `s` owns: (first row, rows).
fn rows(op: Operand, s: &Sequence) -> (usize, usize) {
    match op {
        Operand::Q => (s.q_start, s.q_len),
        Operand::K | Operand::V => (s.k_start, s.k_len),
    }
}

/// `op`'s layout, heads and row width in the problem.
fn geometry(p: &Problem, op: Operand) -> (&Layout, usize, usize) {
    match op {
        Operand::Q => (p.q_layout(), p.heads_q(), p.head_dim()),
        Operand::K => (p.k_layout(), p.heads_kv(), p.head_dim()),
        Operand::V => (p.v_layout(), p.heads_kv(), p.head_dim_v()),
    }
}

/// Calls `f(seq, kv_head, element offset of the row)` for every row of every head of `op`'s
/// tensor that a sequence owns.
fn for_each_row(p: &Problem, op: Operand, mut f: impl FnMut(usize, usize, usize)) {
    let (l, heads, _) = geometry(p, op);
    let group = heads / p.heads_kv();
    for (si, s) in p.sequences().iter().enumerate() {
        let (start, len) = rows(op, s);
        for r in start..start + len {
            for h in 0..heads {
                f(si, h / group, l.offset(s.batch_index, r, h));
            }
        }
    }
}

/// Quantizes a float tensor laid out as `op`'s tensor of the fp8 problem `p`: for each
/// (sequence, KV head) the largest magnitude `a` of its elements (for Q, over every query head
/// of the group) gives the descale `a / 448` (1 when `a` is 0, or not finite: a NaN or an
/// infinity stays one, saturated), and each element becomes `x / descale` rounded to e4m3.
/// Returns the bytes (the tensor's extent; elements outside every sequence's rows are 0) and
/// the descales, `[sequences, heads_kv]`. Errors name `name` when `x` is shorter than the
/// layout's extent.
pub fn quantize(
    p: &Problem,
    op: Operand,
    name: &str,
    x: &[f32],
) -> Result<(Vec<F8E4M3>, Vec<f32>)> {
    let (l, _, width) = geometry(p, op);
    l.check_fits(name, x.len())?;
    let hkv = p.heads_kv();
    let mut amax = vec![0f32; p.sequences().len() * hkv];
    for_each_row(p, op, |si, hk, off| {
        let m = &mut amax[si * hkv + hk];
        for &v in &x[off..off + width] {
            if v.is_finite() {
                *m = m.max(v.abs());
            }
        }
    });
    let descale: Vec<f32> = amax
        .iter()
        .map(|&a| if a > 0.0 { a / E4M3_MAX } else { 1.0 })
        .collect();
    let mut out = vec![F8E4M3::from_bits(0); l.extent().unwrap_or(0)];
    for_each_row(p, op, |si, hk, off| {
        let d = descale[si * hkv + hk];
        for (o, &v) in out[off..off + width].iter_mut().zip(&x[off..off + width]) {
            *o = F8E4M3::from_f32(v / d);
        }
    });
    Ok((out, descale))
}

/// `op`'s tensor times its descales, in f32 (`x̂ = descale · x`, within 2⁻²⁴ of itself);
/// elements outside every sequence's rows are 0.
fn dequantize(p: &Problem, op: Operand, x: &[F8E4M3], ds: &Descales) -> Vec<f32> {
    let (_, _, width) = geometry(p, op);
    let hkv = p.heads_kv();
    let mut out = vec![0f32; x.len()];
    for_each_row(p, op, |si, hk, off| {
        let d = ds.get(op, si, hk, hkv);
        for (o, b) in out[off..off + width].iter_mut().zip(&x[off..off + width]) {
            *o = b.to_f32() * d;
        }
    });
    out
}

/// The CPU evaluation of an fp8 problem: Q, K and V dequantized into f32, the f32 backend, O
/// rounded once into `out`'s type (only the sequences' rows are written). The caller validated
/// the problem, the buffers and the descales.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward_cpu<O: Element>(
    cpu: &CpuBackend,
    p: &Problem,
    q: &[F8E4M3],
    k: &[F8E4M3],
    v: &[F8E4M3],
    ds: &Descales,
    out: &mut [O],
    lse: Option<&mut [f32]>,
) -> Result<()> {
    let f = p.with_dtype(DType::F32);
    let q32 = dequantize(p, Operand::Q, q, ds);
    let k32 = dequantize(p, Operand::K, k, ds);
    let v32 = dequantize(p, Operand::V, v, ds);
    let mut o32 = vec![0f32; out.len()];
    cpu.forward(&f, &q32, &k32, &v32, &mut o32, lse)?;
    let (ol, dv) = (p.o_layout(), p.head_dim_v());
    for s in p.sequences() {
        for r in s.q_start..s.q_start + s.q_len {
            for h in 0..p.heads_q() {
                let off = ol.offset(s.batch_index, r, h);
                for (o, &x) in out[off..off + dv].iter_mut().zip(&o32[off..off + dv]) {
                    *o = O::from_f32(x);
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::Options;

    fn problem(b: usize, s: usize, hq: usize, hkv: usize, d: usize) -> Problem {
        let q = Layout::new("q", &[b, s, hq, d], None).unwrap();
        let k = Layout::new("k", &[b, s, hkv, d], None).unwrap();
        Problem::new_fp8(DType::Bf16, &q, &k, &k, &q, None, None, &Options::new()).unwrap()
    }

    #[test]
    fn the_element_is_e4m3fn() {
        // 448 is the largest finite value, NaN is S.1111.111, subnormals step by 2⁻⁹, and
        // out-of-range values saturate rather than becoming NaN.
        assert_eq!(F8E4M3::from_bits(0x7E).to_f32(), E4M3_MAX);
        assert!(F8E4M3::from_bits(0x7F).to_f32().is_nan());
        assert!(F8E4M3::from_bits(0xFF).to_f32().is_nan());
        assert_eq!(F8E4M3::from_bits(0x01).to_f32(), 2f32.powi(-9));
        for x in [449.0, 1e9, f32::INFINITY] {
            assert_eq!(F8E4M3::from_f32(x).to_bits(), 0x7E, "{x}");
            assert_eq!(F8E4M3::from_f32(-x).to_bits(), 0xFE, "{x}");
        }
        // Ties to even: 1 + 1/16 lies halfway between 1 and 1.125.
        assert_eq!(F8E4M3::from_f32(1.0625).to_f32(), 1.0);
        assert_eq!(F8E4M3::from_f32(1.1875).to_f32(), 1.25);
    }

    #[test]
    fn descales_are_checked_by_name() {
        let p = problem(2, 3, 4, 2, 8);
        let good = [1.0f32, 0.5, 2.0, 1e-3];
        assert!(Descales::new(Some(&good), None, Some(&good))
            .validate(&p)
            .is_ok());
        let e = Descales::new(None, Some(&good[..3]), None)
            .validate(&p)
            .unwrap_err();
        assert!(
            e.to_string().contains("`k_descale`") && e.to_string().contains("4 entries"),
            "{e}"
        );
        for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
            let d = [1.0, bad, 1.0, 1.0];
            let e = Descales::new(None, None, Some(&d))
                .validate(&p)
                .unwrap_err();
            assert!(
                e.to_string().contains("`v_descale`") && e.to_string().contains("entry 1"),
                "{e}"
            );
        }
    }

    #[test]
    fn quantization_uses_each_groups_amax() {
        // 2 sequences, 4 query heads over 2 KV heads (groups {0,1}, {2,3}), d 2.
        let p = problem(2, 1, 4, 2, 2);
        let x: Vec<f32> = vec![
            1.0,
            -2.0,
            0.5,
            0.25,
            0.0,
            0.0,
            0.0,
            0.0, // seq 0: group 0 amax 2, group 1 all zero
            3.0,
            1.0,
            -448.0 * 3.0,
            7.0,
            0.1,
            0.2,
            -0.3,
            0.4, // seq 1: amax 1344 and 0.4
        ];
        let (bytes, d) = quantize(&p, Operand::Q, "q", &x).unwrap();
        assert_eq!(d, vec![2.0 / 448.0, 1.0, 1344.0 / 448.0, 0.4 / 448.0]);
        // The largest magnitude of each group lands on ±448 exactly.
        assert_eq!(bytes[1].to_f32(), -448.0);
        assert_eq!(bytes[10].to_f32(), -448.0);
        assert_eq!(bytes[15].to_f32(), 448.0);
        assert_eq!(bytes[4].to_f32(), 0.0);
        // Dequantized, each element is within e4m3's half ulp (2⁻⁴ relative) of the input.
        let back = dequantize(&p, Operand::Q, &bytes, &Descales::new(Some(&d), None, None));
        for (a, b) in x.iter().zip(&back) {
            assert!((a - b).abs() <= a.abs() / 16.0 + 1e-6, "{a} {b}");
        }
    }
}
