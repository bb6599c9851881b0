//! fa4-candle on the CPU against candle's own attention, `softmax(q·kᵀ·scale + mask)·v`, under
//! the repository's tolerance rule (docs/attention.md): the reference is that expression
//! evaluated by candle in f64, and for 16-bit inputs the same expression evaluated by candle in
//! the storage dtype sets the error budget. The mask here is this file's own predicate.

use candle::{DType, Device, IndexOp, Tensor, D};
use fa4_candle::{
    attention, attention_varlen_with_lse, attention_with_lse, flash_attn, flash_attn_varlen,
    flash_attn_varlen_windowed, flash_attn_windowed, flash_attn_with_lse, AttnOptions, Varlen,
};

type R<T> = candle::Result<T>;

/// One case of the fixed-length matrix.
#[derive(Debug, Clone, Copy)]
struct Case {
    dtype: DType,
    batch: usize,
    sq: usize,
    sk: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    dv: usize,
    left: Option<usize>,
    right: Option<usize>,
    softcap: Option<f32>,
}

const fn case(
    dtype: DType,
    batch: usize,
    sq: usize,
    sk: usize,
    h: (usize, usize),
    d: usize,
) -> Case {
    Case {
        dtype,
        batch,
        sq,
        sk,
        hq: h.0,
        hkv: h.1,
        d,
        dv: d,
        left: None,
        right: None,
        softcap: None,
    }
}

impl Case {
    const fn causal(self) -> Self {
        self.window(None, Some(0))
    }
    const fn window(mut self, left: Option<usize>, right: Option<usize>) -> Self {
        self.left = left;
        self.right = right;
        self
    }
    const fn dv(mut self, dv: usize) -> Self {
        self.dv = dv;
        self
    }
    const fn softcap(mut self, c: f32) -> Self {
        self.softcap = Some(c);
        self
    }
    fn opts(&self) -> AttnOptions {
        let scale = 1.0 / (self.d as f32).sqrt();
        let o = AttnOptions::new(scale).window(self.left, self.right);
        match self.softcap {
            Some(c) => o.softcap(c),
            None => o,
        }
    }
}

/// The matrix: dtypes × GQA ratios × masks × lengths (1, 17, 64±1, sq > sk with empty rows).
const CASES: &[Case] = &[
    case(DType::F32, 2, 17, 17, (4, 4), 64),
    case(DType::F32, 2, 65, 17, (2, 2), 32).causal(),
    case(DType::F32, 1, 40, 63, (4, 2), 32)
        .window(None, Some(3))
        .dv(48),
    case(DType::F16, 2, 33, 65, (8, 2), 64).causal(),
    case(DType::F16, 1, 1, 100, (4, 2), 64).causal(),
    case(DType::F16, 1, 64, 64, (4, 4), 128).window(Some(8), Some(4)),
    case(DType::BF16, 1, 64, 64, (4, 1), 128).window(Some(8), Some(0)),
    case(DType::BF16, 2, 31, 47, (6, 3), 64)
        .causal()
        .softcap(5.0),
    case(DType::BF16, 1, 17, 17, (2, 2), 16),
];

/// Normal inputs with a few rows scaled up, so the running maximum moves often.
fn input(shape: &[usize], seed_rows: usize, dtype: DType) -> R<Tensor> {
    let t = Tensor::randn(0f64, 1.0, shape, &Device::Cpu)?;
    let rows = shape[..shape.len() - 1].iter().product::<usize>();
    let scale: Vec<f64> = (0..rows)
        .map(|r| if r % 7 == seed_rows % 7 { 6.0 } else { 1.0 })
        .collect();
    let mut s = shape.to_vec();
    *s.last_mut().unwrap() = 1;
    let scale = Tensor::from_vec(scale, s, &Device::Cpu)?;
    // Rounding to the storage dtype first: the reference sees exactly what fa4 sees.
    t.broadcast_mul(&scale)?.to_dtype(dtype)
}

/// This file's mask predicate (bottom-right aligned window; causal is `(None, Some(0))`).
fn allowed(
    i: usize,
    j: usize,
    sq: usize,
    sk: usize,
    left: Option<usize>,
    right: Option<usize>,
) -> bool {
    let diag = i as i64 + sk as i64 - sq as i64;
    let j = j as i64;
    left.is_none_or(|l| j >= diag - l as i64) && right.is_none_or(|r| j <= diag + r as i64)
}

/// candle's attention for one fixed-length batch in `compute` precision:
/// `q` `[b, sq, hq, d]`, `k` `[b, sk, hkv, d]`, `v` `[b, sk, hkv, dv]` →
/// (`[b, sq, hq, dv]` in `compute`, LSE `[b, hq, sq]` f64).
fn candle_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    c: &Case,
    compute: DType,
) -> R<(Tensor, Tensor)> {
    let (_, sq, hq, d) = q.dims4()?;
    let (_, sk, hkv, _) = k.dims4()?;
    let group = hq / hkv;
    let heads = Tensor::from_vec(
        (0..hq).map(|h| (h / group) as u32).collect::<Vec<_>>(),
        hq,
        &Device::Cpu,
    )?;
    let q = q.to_dtype(compute)?.transpose(1, 2)?.contiguous()?;
    let k = k
        .to_dtype(compute)?
        .contiguous()?
        .index_select(&heads, 2)?
        .transpose(1, 2)?
        .contiguous()?;
    let v = v
        .to_dtype(compute)?
        .contiguous()?
        .index_select(&heads, 2)?
        .transpose(1, 2)?
        .contiguous()?;
    let scale = 1.0 / (d as f64).sqrt();
    let mut s = (q.matmul(&k.t()?)? * scale)?;
    if let Some(cap) = c.softcap {
        let cap = cap as f64;
        s = ((s / cap)?.tanh()? * cap)?;
    }
    let mask: Vec<f64> = (0..sq)
        .flat_map(|i| {
            (0..sk).map(move |j| {
                if allowed(i, j, sq, sk, c.left, c.right) {
                    0.0
                } else {
                    f64::NEG_INFINITY
                }
            })
        })
        .collect();
    let mask = Tensor::from_vec(mask, (sq, sk), &Device::Cpu)?.to_dtype(compute)?;
    let s = s.broadcast_add(&mask)?;
    // A stable softmax that gives rows without keys zeros (candle's would give NaN there).
    let m = s.max_keepdim(D::Minus1)?;
    let m_finite = m.where_cond_neg_inf_to_zero()?;
    let e = s.broadcast_sub(&m_finite)?.exp()?;
    let sum = e.sum_keepdim(D::Minus1)?;
    let empty = sum.eq(0.0)?.to_dtype(compute)?;
    let p = e.broadcast_div(&(&sum + &empty)?)?;
    let o = p.matmul(&v)?.transpose(1, 2)?.contiguous()?;
    let lse =
        (sum.to_dtype(DType::F64)?.log()? + m_finite.to_dtype(DType::F64)?)?.squeeze(D::Minus1)?;
    Ok((o, lse))
}

trait NegInfToZero {
    fn where_cond_neg_inf_to_zero(&self) -> R<Tensor>;
}

impl NegInfToZero for Tensor {
    fn where_cond_neg_inf_to_zero(&self) -> R<Tensor> {
        let is_inf = self.eq(f64::NEG_INFINITY)?;
        is_inf.where_cond(&self.zeros_like()?, self)
    }
}

fn flat(t: &Tensor) -> R<Vec<f64>> {
    t.to_dtype(DType::F64)?.flatten_all()?.to_vec1()
}

fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .filter(|d| !d.is_nan())
        .fold(0.0, f64::max)
}

/// The tolerance rule on O and LSE; panics with the first bad index and the statistics.
fn judge(
    what: &str,
    dtype: DType,
    out: &Tensor,
    lse: Option<&Tensor>,
    o_ref: &Tensor,
    lse_ref: &Tensor,
    o_lowp: &Tensor,
) -> R<()> {
    assert_eq!(out.dtype(), dtype, "{what}: output dtype");
    assert_eq!(out.dims(), o_ref.dims(), "{what}: output shape");
    let (o, r, lowp) = (flat(out)?, flat(o_ref)?, flat(o_lowp)?);
    let r_max = r.iter().fold(0f64, |a, x| a.max(x.abs()));
    let bound = match dtype {
        DType::F32 => 2e-5 * r_max.max(1.0),
        _ => {
            let rounded = flat(&o_ref.to_dtype(dtype)?)?;
            2.0 * max_abs_diff(&lowp, &r) + max_abs_diff(&rounded, &r)
        }
    };
    for (i, (x, y)) in o.iter().zip(&r).enumerate() {
        if x.is_finite() != y.is_finite() || (x - y).abs() > bound {
            panic!(
                "{what}: O[{i}] = {x}, reference {y}; max error {:.3e} > bound {bound:.3e} (|O_ref| ≤ {r_max:.3})",
                max_abs_diff(&o, &r)
            );
        }
    }
    if let Some(lse) = lse {
        assert_eq!(lse.dtype(), DType::F32, "{what}: LSE dtype");
        assert_eq!(lse.dims(), lse_ref.dims(), "{what}: LSE shape");
        let a = if dtype == DType::F32 { 1e-5 } else { 1e-3 };
        for (i, (x, y)) in flat(lse)?.iter().zip(flat(lse_ref)?).enumerate() {
            let ok = if y.is_finite() {
                (x - y).abs() <= a + 8e-7 * y.abs()
            } else {
                *x == y
            };
            assert!(ok, "{what}: LSE[{i}] = {x}, reference {y}");
        }
    }
    Ok(())
}

#[test]
fn fixed_length_matches_candle_attention() -> R<()> {
    for (n, c) in CASES.iter().enumerate() {
        let q = input(&[c.batch, c.sq, c.hq, c.d], n, c.dtype)?;
        let k = input(&[c.batch, c.sk, c.hkv, c.d], n + 1, c.dtype)?;
        let v = input(&[c.batch, c.sk, c.hkv, c.dv], n + 2, c.dtype)?;
        let (o_ref, lse_ref) = candle_attention(&q, &k, &v, c, DType::F64)?;
        let (o_lowp, _) = candle_attention(&q, &k, &v, c, c.dtype)?;
        let (out, lse) = attention_with_lse(&q, &k, &v, &c.opts())?;
        judge(
            &format!("{c:?}"),
            c.dtype,
            &out,
            Some(&lse),
            &o_ref,
            &lse_ref,
            &o_lowp,
        )?;
        // The candle-flash-attn names give the same numbers.
        let scale = c.opts().softmax_scale;
        if c.softcap.is_none() {
            let named = match (c.left, c.right) {
                (None, None) => flash_attn(&q, &k, &v, scale, false)?,
                (None, Some(0)) => flash_attn(&q, &k, &v, scale, true)?,
                (l, r) => flash_attn_windowed(&q, &k, &v, scale, l, r)?,
            };
            assert_eq!(flat(&named)?, flat(&out)?, "{c:?}: named entry");
        }
    }
    Ok(())
}

#[test]
fn strided_views_are_used_in_place() -> R<()> {
    // q, k, v as views of one fused [b, s, 3·h, d] projection, the usual layout after a QKV
    // matmul: non-contiguous heads, contiguous last dim.
    let (b, s, h, d) = (2, 23, 4, 32);
    let qkv = input(&[b, s, 3 * h, d], 3, DType::F16)?;
    let q = qkv.narrow(2, 0, h)?;
    let k = qkv.narrow(2, h, h)?;
    let v = qkv.narrow(2, 2 * h, h)?;
    assert!(!q.is_contiguous() && !k.is_contiguous());
    let c = case(DType::F16, b, s, s, (h, h), d).causal();
    let (o_ref, lse_ref) = candle_attention(&q, &k, &v, &c, DType::F64)?;
    let (o_lowp, _) = candle_attention(&q, &k, &v, &c, DType::F16)?;
    let (out, lse) = attention_with_lse(&q, &k, &v, &c.opts())?;
    judge(
        "fused qkv views",
        DType::F16,
        &out,
        Some(&lse),
        &o_ref,
        &lse_ref,
        &o_lowp,
    )?;
    // A view of a transposed [b, h, s, d] tensor (what Llama-style code holds) works as well.
    let qt = q.transpose(1, 2)?.contiguous()?.transpose(1, 2)?;
    assert!(!qt.is_contiguous());
    assert_eq!(flat(&attention(&qt, &k, &v, &c.opts())?)?, flat(&out)?);
    Ok(())
}

/// Packs per-sequence [len, h, d] tensors and returns the packed tensor and the cumulative
/// lengths as a u32 tensor (candle-flash-attn's convention).
fn pack(parts: &[Tensor]) -> R<(Tensor, Tensor)> {
    let mut cu = vec![0u32];
    for p in parts {
        cu.push(cu.last().unwrap() + p.dim(0)? as u32);
    }
    let n = cu.len();
    Ok((
        Tensor::cat(parts, 0)?,
        Tensor::from_vec(cu, n, &Device::Cpu)?,
    ))
}

#[test]
fn varlen_matches_candle_attention_per_sequence() -> R<()> {
    // Ragged lengths with a zero-length query sequence, a zero-length key sequence, sq > sk.
    let lens = [
        (5usize, 7usize),
        (0, 3),
        (17, 20),
        (18, 40),
        (9, 0),
        (33, 4),
    ];
    for (dtype, (hq, hkv), window) in [
        (DType::F32, (4, 2), (None, Some(0))),
        (DType::F16, (4, 4), (None, None)),
        (DType::BF16, (6, 2), (Some(5), Some(2))),
    ] {
        let d = 64;
        let mut qs = Vec::new();
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        for (n, &(sq, sk)) in lens.iter().enumerate() {
            qs.push(input(&[sq, hq, d], n, dtype)?);
            ks.push(input(&[sk, hkv, d], n + 1, dtype)?);
            vs.push(input(&[sk, hkv, d], n + 2, dtype)?);
        }
        let (q, cu_q) = pack(&qs)?;
        let (k, cu_k) = pack(&ks)?;
        let (v, _) = pack(&vs)?;
        let c = case(dtype, 1, 0, 0, (hq, hkv), d).window(window.0, window.1);
        let varlen = Varlen {
            seqlens_q: &cu_q,
            seqlens_k: &cu_k,
            max_seqlen_q: 33,
            max_seqlen_k: 40,
        };
        let (out, lse) = attention_varlen_with_lse(&q, &k, &v, &varlen, &c.opts())?;
        assert_eq!(out.dims(), &[q.dim(0)?, hq, d]);
        assert_eq!(lse.dims(), &[hq, q.dim(0)?]);
        let mut row = 0;
        for (n, &(sq, sk)) in lens.iter().enumerate() {
            let what = format!("{dtype:?} window {window:?} sequence {n} ({sq}×{sk})");
            let c = Case { sq, sk, ..c };
            if sq == 0 {
                continue;
            }
            if sk == 0 {
                // No keys: zeros and an LSE of −inf (candle's softmax has nothing to reduce).
                let o = out.narrow(0, row, sq)?;
                assert!(flat(&o)?.iter().all(|&x| x == 0.0), "{what}");
                let l = flat(&lse.narrow(1, row, sq)?)?;
                assert!(l.iter().all(|&x| x == f64::NEG_INFINITY), "{what}");
                row += sq;
                continue;
            }
            let (qb, kb, vb) = (
                qs[n].unsqueeze(0)?,
                ks[n].unsqueeze(0)?,
                vs[n].unsqueeze(0)?,
            );
            let (o_ref, lse_ref) = candle_attention(&qb, &kb, &vb, &c, DType::F64)?;
            let (o_lowp, _) = candle_attention(&qb, &kb, &vb, &c, dtype)?;
            let o = out.narrow(0, row, sq)?.unsqueeze(0)?;
            let l = lse.narrow(1, row, sq)?.unsqueeze(0)?;
            judge(&what, dtype, &o, Some(&l), &o_ref, &lse_ref, &o_lowp)?;
            row += sq;
        }
        // The candle-flash-attn names agree with the options form.
        let scale = c.opts().softmax_scale;
        let named = match window {
            (None, Some(0)) => flash_attn_varlen(&q, &k, &v, &cu_q, &cu_k, 33, 40, scale, true)?,
            (None, None) => flash_attn_varlen(&q, &k, &v, &cu_q, &cu_k, 33, 40, scale, false)?,
            (l, r) => flash_attn_varlen_windowed(&q, &k, &v, &cu_q, &cu_k, 33, 40, scale, l, r)?,
        };
        assert_eq!(flat(&named)?, flat(&out)?);
    }
    Ok(())
}

#[test]
fn lse_of_rows_without_keys_is_negative_infinity() -> R<()> {
    // Causal with sq > sk: the first sq − sk rows see no key.
    let q = input(&[1, 6, 2, 16], 0, DType::F32)?;
    let k = input(&[1, 2, 2, 16], 1, DType::F32)?;
    let (out, lse) = flash_attn_with_lse(&q, &k, &k, 0.25, true)?;
    let lse: Vec<Vec<f32>> = lse.i(0)?.to_vec2()?;
    for head in &lse {
        assert!(
            head[..4].iter().all(|&x| x == f32::NEG_INFINITY),
            "{head:?}"
        );
        assert!(head[4..].iter().all(|x| x.is_finite()), "{head:?}");
    }
    let empty = out.narrow(1, 0, 4)?.abs()?.sum_all()?.to_scalar::<f32>()?;
    assert_eq!(empty, 0.0);
    Ok(())
}

fn err_of(r: R<impl std::fmt::Debug>) -> String {
    match r {
        Ok(v) => panic!("expected an error, got {v:?}"),
        Err(e) => e.to_string(),
    }
}

fn expect_err(r: R<impl std::fmt::Debug>, needles: &[&str]) {
    let msg = err_of(r);
    for n in needles {
        assert!(msg.contains(n), "error {msg:?} does not mention {n:?}");
    }
}

#[test]
fn bad_fixed_length_calls_are_errors_naming_the_argument() -> R<()> {
    let t = |shape: &[usize], dtype| Tensor::zeros(shape, dtype, &Device::Cpu).unwrap();
    let q = t(&[1, 8, 4, 32], DType::F32);
    let kv = t(&[1, 8, 2, 32], DType::F32);
    expect_err(
        flash_attn(&t(&[8, 4, 32], DType::F32), &kv, &kv, 1.0, false),
        &["`q`", "rank 4"],
    );
    expect_err(
        flash_attn(&q, &t(&[8, 2, 32], DType::F32), &kv, 1.0, false),
        &["`k`", "rank 4"],
    );
    expect_err(
        flash_attn(&q, &kv, &t(&[1, 8, 2, 32], DType::F16), 1.0, false),
        &["`v`", "dtype"],
    );
    expect_err(
        flash_attn(
            &t(&[1, 8, 4, 32], DType::F64),
            &t(&[1, 8, 2, 32], DType::F64),
            &t(&[1, 8, 2, 32], DType::F64),
            1.0,
            false,
        ),
        &["`q`", "F64"],
    );
    expect_err(
        flash_attn(
            &q,
            &t(&[1, 8, 3, 32], DType::F32),
            &t(&[1, 8, 3, 32], DType::F32),
            1.0,
            false,
        ),
        &["`k`", "heads_kv 3"],
    );
    expect_err(
        flash_attn(&q, &t(&[1, 8, 2, 16], DType::F32), &kv, 1.0, false),
        &["`k`"],
    );
    expect_err(
        flash_attn(&q, &t(&[2, 8, 2, 32], DType::F32), &kv, 1.0, false),
        &["`k`"],
    );
    expect_err(
        flash_attn(&q, &kv, &t(&[1, 9, 2, 32], DType::F32), 1.0, false),
        &["`v`"],
    );
    expect_err(
        flash_attn(&q, &kv, &kv, f32::NAN, false),
        &["`softmax_scale`"],
    );
    expect_err(
        attention(&q, &kv, &kv, &AttnOptions::new(1.0).softcap(-1.0)),
        &["`softcap`"],
    );
    // A transposed last dimension cannot be passed through: say what to do.
    let qt = t(&[1, 8, 32, 4], DType::F32).transpose(2, 3)?;
    expect_err(
        flash_attn(&qt, &kv, &kv, 1.0, false),
        &["`q`", "contiguous()"],
    );
    Ok(())
}

#[test]
fn bad_varlen_calls_are_errors_naming_the_argument() -> R<()> {
    let t = |shape: &[usize]| Tensor::zeros(shape, DType::F32, &Device::Cpu).unwrap();
    let cu = |v: &[u32]| Tensor::from_vec(v.to_vec(), v.len(), &Device::Cpu).unwrap();
    let (q, k) = (t(&[10, 4, 32]), t(&[12, 2, 32]));
    let (cq, ck) = (cu(&[0, 4, 10]), cu(&[0, 5, 12]));
    let ok = flash_attn_varlen(&q, &k, &k, &cq, &ck, 6, 7, 1.0, true)?;
    assert_eq!(ok.dims(), &[10, 4, 32]);
    let call = |cq: &Tensor, ck: &Tensor, mq: usize, mk: usize| {
        flash_attn_varlen(&q, &k, &k, cq, ck, mq, mk, 1.0, true)
    };
    expect_err(
        flash_attn_varlen(&t(&[1, 10, 4, 32]), &k, &k, &cq, &ck, 6, 7, 1.0, true),
        &["`q`", "rank 3"],
    );
    expect_err(
        call(&cu(&[0, 4, 9]), &ck, 6, 7),
        &["`seqlens_q`", "ends at 9", "10 rows"],
    );
    expect_err(
        call(&cq, &cu(&[1, 5, 12]), 6, 7),
        &["`seqlens_k`", "start at 0"],
    );
    expect_err(
        call(&cq, &cu(&[0, 6, 5, 12]), 6, 7),
        &["`seqlens_k`", "non-decreasing"],
    );
    expect_err(
        call(&cq, &cu(&[0, 12]), 6, 12),
        &["`seqlens_k`", "batch + 1"],
    );
    expect_err(
        call(&cq.to_dtype(DType::F32)?, &ck, 6, 7),
        &["`seqlens_q`", "integers"],
    );
    expect_err(
        call(&cq.unsqueeze(0)?, &ck, 6, 7),
        &["`seqlens_q`", "rank 1"],
    );
    expect_err(call(&cq, &ck, 5, 7), &["`max_seqlen_q`", "6 rows"]);
    expect_err(call(&cq, &ck, 6, 6), &["`max_seqlen_k`", "7 rows"]);
    Ok(())
}

#[test]
fn backward_through_the_op_is_an_error() -> R<()> {
    let q = candle::Var::from_tensor(&input(&[1, 4, 2, 8], 0, DType::F32)?)?;
    let out = flash_attn(q.as_tensor(), q.as_tensor(), q.as_tensor(), 1.0, false)?;
    assert!(out.sum_all()?.backward().is_err());
    Ok(())
}

/// The same matrix on the GPU (f16/bf16): inputs made on the CPU, judged on the CPU against
/// candle's attention there. Run on a GPU machine with
/// `cargo test --release -p fa4-candle --features cuda -- --include-ignored`.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_matches_candle_attention() -> R<()> {
    let gpu = Device::new_cuda(0)?;
    let cpu = Device::Cpu;
    for (n, c) in CASES
        .iter()
        .enumerate()
        .filter(|(_, c)| c.dtype != DType::F32)
    {
        let q = input(&[c.batch, c.sq, c.hq, c.d], n, c.dtype)?;
        let k = input(&[c.batch, c.sk, c.hkv, c.d], n + 1, c.dtype)?;
        let v = input(&[c.batch, c.sk, c.hkv, c.dv], n + 2, c.dtype)?;
        let (o_ref, lse_ref) = candle_attention(&q, &k, &v, c, DType::F64)?;
        let (o_lowp, _) = candle_attention(&q, &k, &v, c, c.dtype)?;
        let (qg, kg, vg) = (q.to_device(&gpu)?, k.to_device(&gpu)?, v.to_device(&gpu)?);
        let (out, lse) = attention_with_lse(&qg, &kg, &vg, &c.opts())?;
        assert!(out.device().is_cuda() && lse.device().is_cuda());
        let (out, lse) = (out.to_device(&cpu)?, lse.to_device(&cpu)?);
        judge(
            &format!("cuda {c:?}"),
            c.dtype,
            &out,
            Some(&lse),
            &o_ref,
            &lse_ref,
            &o_lowp,
        )?;
    }
    // Strided views of a fused QKV tensor on the GPU, and varlen with CPU boundaries.
    let (b, s, h, d) = (2, 40, 4, 64);
    let qkv = input(&[b, s, 3 * h, d], 5, DType::BF16)?;
    let (q, k, v) = (
        qkv.narrow(2, 0, h)?,
        qkv.narrow(2, h, h)?,
        qkv.narrow(2, 2 * h, h)?,
    );
    let c = case(DType::BF16, b, s, s, (h, h), d).causal();
    let (o_ref, lse_ref) = candle_attention(&q, &k, &v, &c, DType::F64)?;
    let (o_lowp, _) = candle_attention(&q, &k, &v, &c, DType::BF16)?;
    let g = qkv.to_device(&gpu)?;
    let (qg, kg, vg) = (
        g.narrow(2, 0, h)?,
        g.narrow(2, h, h)?,
        g.narrow(2, 2 * h, h)?,
    );
    let (out, lse) = attention_with_lse(&qg, &kg, &vg, &c.opts())?;
    judge(
        "cuda fused qkv views",
        DType::BF16,
        &out.to_device(&cpu)?,
        Some(&lse.to_device(&cpu)?),
        &o_ref,
        &lse_ref,
        &o_lowp,
    )?;
    // The same batch packed as varlen (two sequences of s rows), boundaries on the CPU.
    let pack = |t: &Tensor| -> R<Tensor> { t.flatten(0, 1)?.contiguous()?.to_device(&gpu) };
    let cu = Tensor::from_vec(vec![0u32, s as u32, 2 * s as u32], 3, &cpu)?;
    let scale = c.opts().softmax_scale;
    let out = flash_attn_varlen(
        &pack(&q)?,
        &pack(&k)?,
        &pack(&v)?,
        &cu,
        &cu,
        s,
        s,
        scale,
        true,
    )?;
    let out = out.to_device(&cpu)?.reshape((b, s, h, d))?;
    judge(
        "cuda varlen",
        DType::BF16,
        &out,
        None,
        &o_ref,
        &lse_ref,
        &o_lowp,
    )?;
    // Boundaries on the GPU, as candle-flash-attn takes them (read back once per call).
    let cu_gpu = cu.to_device(&gpu)?;
    let (out, lse) = fa4_candle::flash_attn_varlen_with_lse(
        &pack(&q)?,
        &pack(&k)?,
        &pack(&v)?,
        &cu_gpu,
        &cu_gpu,
        s,
        s,
        scale,
        true,
    )?;
    assert_eq!(lse.dims(), &[h, b * s]);
    let out = out.to_device(&cpu)?.reshape((b, s, h, d))?;
    judge(
        "cuda varlen, boundaries on the GPU",
        DType::BF16,
        &out,
        None,
        &o_ref,
        &lse_ref,
        &o_lowp,
    )?;
    Ok(())
}
