//! fp8 e4m3 attention for candle tensors of dtype `F8E4M3` (the `float8` crate's type, which
//! fa4 uses too): the definition is fa4's (`docs/attention.md`, "FP8 (e4m3) inputs"), with
//! FlashAttention-3's descales, f32 `[batch, heads_kv]`, and O in bf16.
//!
//! One candle op over `q`, `k`, `v` as the 16-bit ones are: CPU tensors run fa4's CPU evaluation
//! on views from each layout's offset (strides passed through, no copy); CUDA tensors (the
//! `cuda` feature) run fa4's Hopper e4m3 kernel on candle's buffers and stream (`cuda.rs`), the
//! descales read where they lie, O allocated by candle's device. candle's CUDA backend stores
//! `F8E4M3` (candle ≥ 0.10), so no conversion happens on either side. On a GPU that is not a
//! Hopper one fa4 has no fp8 kernel: the error names `dtype`.

use candle::{CpuStorage, DType, Layout, Result, Shape, Tensor};
use half::bf16;

use fa4::problem::Problem;
use fa4::{Backend, Descales, Options, F8E4M3};

use crate::op::{cpu_view, fa4_err, fa4_options, Fa4Views};
use crate::AttnOptions;

/// The descales of [`attention_fp8`]: f32 tensors `[batch, heads_kv]` on `q`'s device, `None`
/// = ones. Entry `(b, h)` multiplies KV head `h`'s elements of sequence `b` (for `q`, those of
/// every query head of the group), each finite and > 0 (checked on the CPU; on CUDA they are not
/// read back, and one that is not makes the rows it scales NaN).
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
/// seqlen_k, heads_kv, head_dim]`, `v` `[batch, seqlen_k, heads_kv, head_dim_v]`, all `F8E4M3`
/// on one device (the CPU, or with the `cuda` feature a Hopper GPU), → `[batch, seqlen_q,
/// heads_q, head_dim_v]` in bf16 on that device. Errors name the argument.
pub fn attention_fp8(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    descales: &Fp8Descales,
    opts: &AttnOptions,
) -> Result<Tensor> {
    let opts = fa4_options(opts)?;
    for (name, t) in [("q", q), ("k", k), ("v", v)] {
        if t.dtype() != DType::F8E4M3 {
            candle::bail!(
                "fa4-candle: `{name}` has dtype {:?}; attention_fp8 takes F8E4M3",
                t.dtype()
            );
        }
        if t.rank() != 4 {
            candle::bail!(
                "fa4-candle: `{name}` has shape {:?}; expected rank 4",
                t.dims()
            );
        }
        if !t.device().same_device(q.device()) {
            candle::bail!(
                "fa4-candle: `{name}` is on {:?} but `q` is on {:?}",
                t.device().location(),
                q.device().location()
            );
        }
    }
    let want = [q.dim(0)?, k.dim(2)?];
    let descale = |name: &str, t: Option<&Tensor>| -> Result<Option<Tensor>> {
        let Some(t) = t else { return Ok(None) };
        if t.dtype() != DType::F32 || t.dims() != want {
            candle::bail!(
                "fa4-candle: `{name}` is {:?} {:?}; expected F32 [batch, heads_kv] = {want:?}",
                t.dtype(),
                t.dims()
            );
        }
        if !t.device().same_device(q.device()) {
            candle::bail!(
                "fa4-candle: `{name}` is on {:?} but `q` is on {:?}; descales live beside the inputs",
                t.device().location(),
                q.device().location()
            );
        }
        Ok(Some(t.contiguous()?))
    };
    let given = [descales.q, descales.k, descales.v];
    let mut held: [Option<Tensor>; 3] = Default::default();
    for ((slot, name), t) in held.iter_mut().zip(Fa4Fp8::DESCALES).zip(given) {
        *slot = descale(name, t)?;
    }
    q.apply_op3(
        k,
        v,
        Fa4Fp8 {
            opts,
            descales: held,
        },
    )
}

/// The fp8 attention op: options and the descales (contiguous, on the inputs' device).
pub(crate) struct Fa4Fp8 {
    pub(crate) opts: Options,
    /// Q's, K's and V's descales.
    pub(crate) descales: [Option<Tensor>; 3],
}

impl Fa4Fp8 {
    /// The descales' argument names, in [`Fa4Fp8::descales`]' order.
    pub(crate) const DESCALES: [&'static str; 3] = ["q_descale", "k_descale", "v_descale"];

    /// Validates the call as an fp8 problem with bf16 O on views from each layout's offset;
    /// returns it and O's (contiguous) shape.
    pub(crate) fn problem(
        &self,
        ql: &Layout,
        kl: &Layout,
        vl: &Layout,
    ) -> Result<(Problem, Shape)> {
        let x = Fa4Views::new(ql, kl, vl)?;
        let p = Problem::new_fp8(
            fa4::DType::Bf16,
            &x.q,
            &x.k,
            &x.v,
            &x.o,
            None,
            None,
            &self.opts,
        )
        .map_err(fa4_err)?;
        Ok((p, x.o_shape))
    }
}

impl candle::CustomOp3 for Fa4Fp8 {
    fn name(&self) -> &'static str {
        "fa4-attention-fp8"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        ql: &Layout,
        k: &CpuStorage,
        kl: &Layout,
        v: &CpuStorage,
        vl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (p, out_shape) = self.problem(ql, kl, vl)?;
        let (qs, ks, vs) = (
            cpu_view::<F8E4M3>(q, ql, "q")?,
            cpu_view::<F8E4M3>(k, kl, "k")?,
            cpu_view::<F8E4M3>(v, vl, "v")?,
        );
        let host = self
            .descales
            .iter()
            .map(|d| {
                d.as_ref()
                    .map(|t| t.flatten_all()?.to_vec1::<f32>())
                    .transpose()
            })
            .collect::<Result<Vec<_>>>()?;
        let descales = Descales::new(host[0].as_deref(), host[1].as_deref(), host[2].as_deref());
        let mut out = vec![bf16::ZERO; out_shape.elem_count()];
        Backend::Cpu
            .run_fp8(&p, qs, ks, vs, &descales, &mut out, None)
            .map_err(fa4_err)?;
        Ok((CpuStorage::BF16(out), out_shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        q: &candle::CudaStorage,
        ql: &Layout,
        k: &candle::CudaStorage,
        kl: &Layout,
        v: &candle::CudaStorage,
        vl: &Layout,
    ) -> Result<(candle::CudaStorage, Shape)> {
        crate::cuda::forward_fp8(self, [(q, ql), (k, kl), (v, vl)])
    }
}
