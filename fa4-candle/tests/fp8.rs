//! fa4-candle's fp8 entry against candle's own arithmetic: the F8E4M3 inputs (converted by
//! candle) dequantized and descaled by candle in f64, softmax(q·kᵀ·scale + causal mask)·v
//! evaluated by candle in f64, then compared with the bf16 output within the evaluation's own
//! error: bf16's rounding of O on the CPU (P in f32), and on a Hopper GPU also the bound
//! docs/attention.md derives for P rounded to e4m3 (up to 2⁻⁴ of each weight).

use candle::{DType, Device, Tensor, D};
use fa4_candle::{attention_fp8, AttnOptions, Fp8Descales};

type R<T> = candle::Result<T>;

/// candle's attention in f64 on already dequantized inputs, causal (bottom-right aligned).
fn reference(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> R<Tensor> {
    let (hq, hkv) = (q.dim(2)?, k.dim(2)?);
    let rep = |t: &Tensor| -> R<Tensor> {
        let (b, s, h, d) = t.dims4()?;
        t.unsqueeze(3)?
            .expand((b, s, h, hq / hkv, d))?
            .reshape((b, s, hq, d))
    };
    let (q, k, v) = (
        q.transpose(1, 2)?,
        rep(k)?.transpose(1, 2)?,
        rep(v)?.transpose(1, 2)?,
    );
    let s = (q.contiguous()?.matmul(&k.contiguous()?.t()?)? * scale)?;
    let (sq, sk) = (s.dim(2)?, s.dim(3)?);
    let mask: Vec<f64> = (0..sq)
        .flat_map(|i| {
            (0..sk).map(move |j| {
                if j + sq <= i + sk {
                    0.0
                } else {
                    f64::NEG_INFINITY
                }
            })
        })
        .collect();
    let s = s.broadcast_add(&Tensor::from_vec(mask, (sq, sk), &Device::Cpu)?)?;
    let p = candle_nn::ops::softmax_last_dim(&s)?;
    p.matmul(&v.contiguous()?)?.transpose(1, 2)
}

/// One fp8 problem on `dev`: O (bf16, on `dev`) against candle's f64 attention of the
/// dequantized inputs, within `tol_o` of max |O| plus `tol_v` of max |V|. Returns the inputs, on
/// the CPU, and a descale array with a zero, for the error cases.
fn matches_candle_on(dev: &Device, tol_o: f64, tol_v: f64) -> R<(Tensor, Tensor, Tensor, Tensor)> {
    let cpu = Device::Cpu;
    let (b, sq, sk, hq, hkv, d) = (2, 33, 47, 4, 2, 64);
    let draw = |s: usize, h: usize, x: f64| -> R<Tensor> {
        (Tensor::randn(0f32, 1., (b, s, h, d), &cpu)? * x)?.to_dtype(DType::F8E4M3)
    };
    let (q8, k8, v8) = (
        draw(sq, hq, 40.0)?,
        draw(sk, hkv, 60.0)?,
        draw(sk, hkv, 100.0)?,
    );
    let ds = |vals: [f32; 4]| Tensor::from_vec(vals.to_vec(), (b, hkv), &cpu);
    let (dq, dk, dv) = (
        ds([0.02, 0.03, 0.025, 0.01])?,
        ds([0.02, 0.01, 0.015, 0.02])?,
        ds([0.01; 4])?,
    );
    let scale = 1.0 / (d as f32).sqrt();
    let on = |t: &Tensor| t.to_device(dev);
    let out = attention_fp8(
        &on(&q8)?,
        &on(&k8)?,
        &on(&v8)?,
        &Fp8Descales {
            q: Some(&on(&dq)?),
            k: Some(&on(&dk)?),
            v: Some(&on(&dv)?),
        },
        &AttnOptions::new(scale).causal(),
    )?;
    assert!(out.device().same_device(dev));
    assert_eq!(
        (out.dims(), out.dtype()),
        (&[b, sq, hq, d][..], DType::BF16)
    );
    // Dequantize with candle: q_descale[b, h / group] per query head.
    let deq = |t: &Tensor, s: &Tensor, heads: usize| -> R<Tensor> {
        let s = s.to_dtype(DType::F64)?.unsqueeze(2)?; // [b, hkv, 1]
        let s = s.expand((b, hkv, heads / hkv))?.reshape((b, 1, heads, 1))?;
        // Through f32 (exact for e4m3): candle 0.11.1's F8E4M3 → F64 conversion never returns
        // (its to_f64 calls itself).
        t.to_dtype(DType::F32)?
            .to_dtype(DType::F64)?
            .broadcast_mul(&s)
    };
    let v64 = deq(&v8, &dv, hkv)?;
    let want = reference(
        &deq(&q8, &dq, hq)?,
        &deq(&k8, &dk, hkv)?,
        &v64,
        scale as f64,
    )?;
    let err = (out.to_device(&cpu)?.to_dtype(DType::F64)? - &want)?
        .abs()?
        .flatten_all()?
        .max(D::Minus1)?
        .to_scalar::<f64>()?;
    let vmax = want
        .abs()?
        .flatten_all()?
        .max(D::Minus1)?
        .to_scalar::<f64>()?;
    let vmax_v = v64
        .abs()?
        .flatten_all()?
        .max(D::Minus1)?
        .to_scalar::<f64>()?;
    assert!(
        err <= vmax * tol_o + vmax_v * tol_v,
        "max error {err} against max |O| {vmax}, max |V| {vmax_v}"
    );
    Ok((q8, k8, v8, ds([1.0, 0.0, 1.0, 1.0])?))
}

#[test]
fn fp8_attention_matches_candles_own_arithmetic() -> R<()> {
    // The CPU keeps P in f32: only bf16's rounding of O (2⁻⁹ relative) and f32 sums remain.
    let (q8, k8, v8, zero) = matches_candle_on(&Device::Cpu, 2f64.powi(-8), 0.0)?;
    let (b, hq) = (q8.dim(0)?, q8.dim(2)?);
    let scale = 0.125;
    let dev = Device::Cpu;
    // Wrong dtypes and shapes name their argument.
    let e = attention_fp8(
        &q8.to_dtype(DType::BF16)?,
        &k8,
        &v8,
        &Fp8Descales::default(),
        &AttnOptions::new(scale),
    )
    .unwrap_err();
    assert!(e.to_string().contains("`q`"), "{e}");
    let bad = Tensor::ones((b, hq), DType::F32, &dev)?;
    let e = attention_fp8(
        &q8,
        &k8,
        &v8,
        &Fp8Descales {
            k: Some(&bad),
            ..Default::default()
        },
        &AttnOptions::new(scale),
    )
    .unwrap_err();
    assert!(e.to_string().contains("`k_descale`"), "{e}");
    let e = attention_fp8(
        &q8,
        &k8,
        &v8,
        &Fp8Descales {
            v: Some(&zero),
            ..Default::default()
        },
        &AttnOptions::new(scale),
    )
    .unwrap_err();
    assert!(e.to_string().contains("v_descale"), "{e}");
    Ok(())
}

/// The same problem on a Hopper GPU (`cargo test --release -p fa4-candle --features cuda --
/// --include-ignored` there): the e4m3 kernel rounds P to e4m3, which costs up to 2⁻⁴ of each
/// weight (docs/attention.md), so up to 2⁻⁴ of max |V|, on top of bf16's rounding of O. A
/// descale left on the CPU is an error naming it.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a Hopper GPU"]
fn fp8_attention_on_cuda_matches_candles_own_arithmetic() -> R<()> {
    let gpu = Device::new_cuda(0)?;
    let (q8, k8, v8, _) = matches_candle_on(&gpu, 2f64.powi(-8), 2f64.powi(-4))?;
    let (b, hkv) = (q8.dim(0)?, k8.dim(2)?);
    let on_cpu = Tensor::ones((b, hkv), DType::F32, &Device::Cpu)?;
    let e = attention_fp8(
        &q8.to_device(&gpu)?,
        &k8.to_device(&gpu)?,
        &v8.to_device(&gpu)?,
        &Fp8Descales {
            k: Some(&on_cpu),
            ..Default::default()
        },
        &AttnOptions::new(0.125),
    )
    .unwrap_err();
    assert!(e.to_string().contains("`k_descale`"), "{e}");
    Ok(())
}
