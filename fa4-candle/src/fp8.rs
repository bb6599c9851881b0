//! fp8 e4m3 attention for candle tensors of dtype `F8E4M3` (the `float8` crate's type, which
//! fa4 uses too): the definition is fa4's (`docs/attention.md`, "FP8 (e4m3) inputs"), with
//! FlashAttention-3's descales, f32 `[batch, heads_kv]`, and O in bf16.
//!
//! CPU tensors only, for now (fa4's GPU kernels do not compute fp8 yet): the inputs are copied
//! to contiguous host buffers, which the CPU evaluation dequantizes into f32 anyway.

use candle::{DType, Device, Result, Tensor};
use half::bf16;

use crate::op::{fa4_err, fa4_options};
use crate::AttnOptions;

/// The descales of [`attention_fp8`]: f32 tensors `[batch, heads_kv]`, `None` = ones. Entry
/// `(b, h)` multiplies KV head `h`'s elements of sequence `b` (for `q`, those of every query head
/// of the group), each finite and > 0.
#[derive(Debug, Clone, Copy, Default)]
pub struct Fp8Descales<'a> {
    /// Q's descales.
    pub q: Option<&'a Tensor>,
    /// K's descales.
    pub k: Option<&'a Tensor>,
    /// V's descales.
    pub v: Option<&'a Tensor>,
}

/// Attention over fp8 e4m3 inputs: `q` `[batch, seqlen_q, heads_q, head_dim]`, `k` `[batch,
/// seqlen_k, heads_kv, head_dim]`, `v` `[batch, seqlen_k, heads_kv, head_dim_v]`, all `F8E4M3` on
/// the CPU, → `[batch, seqlen_q, heads_q, head_dim_v]` in bf16. Errors name the argument.
pub fn attention_fp8(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    descales: &Fp8Descales,
    opts: &AttnOptions,
) -> Result<Tensor> {
    let o = fa4_options(opts)?;
    let host = |name: &str, t: &Tensor| -> Result<(Vec<fa4::F8E4M3>, Vec<usize>)> {
        if t.dtype() != DType::F8E4M3 {
            candle::bail!(
                "fa4-candle: `{name}` has dtype {:?}; attention_fp8 takes F8E4M3",
                t.dtype()
            );
        }
        if !matches!(t.device(), Device::Cpu) {
            candle::bail!("fa4-candle: `{name}` is not on the CPU; fp8 attention runs on the CPU only, for now");
        }
        if t.rank() != 4 {
            candle::bail!(
                "fa4-candle: `{name}` has shape {:?}; expected rank 4",
                t.dims()
            );
        }
        Ok((
            t.flatten_all()?.to_vec1::<fa4::F8E4M3>()?,
            t.dims().to_vec(),
        ))
    };
    let (qv, qs) = host("q", q)?;
    let (kv, ks) = host("k", k)?;
    let (vv, vs) = host("v", v)?;
    let want = [qs[0], ks[2]];
    let scale = |name: &str, t: Option<&Tensor>| -> Result<Option<Vec<f32>>> {
        let Some(t) = t else { return Ok(None) };
        if t.dtype() != DType::F32 || t.dims() != want {
            candle::bail!(
                "fa4-candle: `{name}` is {:?} {:?}; expected F32 [batch, heads_kv] = {want:?}",
                t.dtype(),
                t.dims()
            );
        }
        Ok(Some(
            t.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?,
        ))
    };
    let (dq, dk, dv) = (
        scale("q_descale", descales.q)?,
        scale("k_descale", descales.k)?,
        scale("v_descale", descales.v)?,
    );
    let mut os = qs.clone();
    os[3] = vs[3];
    let mut out = vec![bf16::ZERO; os.iter().product()];
    fa4::Backend::Cpu
        .forward_fp8(
            &fa4::Tensor::with_name("q", &qv, &qs, None).map_err(fa4_err)?,
            &fa4::Tensor::with_name("k", &kv, &ks, None).map_err(fa4_err)?,
            &fa4::Tensor::with_name("v", &vv, &vs, None).map_err(fa4_err)?,
            &fa4::Descales::new(dq.as_deref(), dk.as_deref(), dv.as_deref()),
            &mut fa4::TensorMut::with_name("out", &mut out, &os, None).map_err(fa4_err)?,
            None,
            &o,
        )
        .map_err(fa4_err)?;
    Tensor::from_vec(out, os, &Device::Cpu)
}
