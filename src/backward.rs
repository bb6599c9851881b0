//! The backward pass: dQ, dK and dV of attention, through [`Backend::backward`] (fixed-length
//! batches) and [`Backend::backward_varlen`] (packed variable-length batches).
//!
//! The gradients are those of the function `Backend::forward` computes, for an upstream
//! gradient dO; the math and the tolerance rule they are tested by are in `docs/backward.md`.
//! The call takes the forward's O and LSE: P is recomputed from LSE, and `D_i = dO_i·O_i`
//! from O, so both must come from a forward of the same inputs and options.
//!
//! Backends: the CPU computes it (always deterministic); the CUDA backend runs the
//! Ampere-class backward kernels (`cuda::backward`, fp16/bf16), deterministic on request.
//!
//! ```
//! use fa4::{Backend, BackwardOptions, Options, Tensor, TensorMut};
//!
//! let shape = [1, 128, 4, 64]; // [batch, seqlen, heads, head_dim]
//! let n = shape.iter().product();
//! let x: Vec<f32> = (0..n).map(|i| ((i * 7919) % 13) as f32 * 0.1 - 0.6).collect();
//! let (q, k, v, d_out) = (x.clone(), x.clone(), x.clone(), x.clone());
//! let opts = Options::new().causal();
//! let (mut o, mut lse) = (vec![0f32; n], vec![0f32; 4 * 128]);
//! let (qt, kt, vt) = (Tensor::new(&q, &shape)?, Tensor::new(&k, &shape)?, Tensor::new(&v, &shape)?);
//! Backend::Cpu.forward(&qt, &kt, &vt, &mut TensorMut::new(&mut o, &shape)?, Some(&mut lse), &opts)?;
//! let (mut dq, mut dk, mut dv) = (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
//! Backend::Cpu.backward(
//!     &qt, &kt, &vt,
//!     &Tensor::new(&o, &shape)?,                   // the forward's O …
//!     &lse,                                        // … and LSE, [batch, heads_q, seqlen_q]
//!     &Tensor::new(&d_out, &shape)?,               // dO, O's shape
//!     &mut TensorMut::new(&mut dq, &shape)?,
//!     &mut TensorMut::new(&mut dk, &shape)?,
//!     &mut TensorMut::new(&mut dv, &shape)?,
//!     &BackwardOptions::new(opts).deterministic(true),
//! )?;
//! assert!(dq.iter().chain(&dk).chain(&dv).all(|g| g.is_finite()));
//! # Ok::<(), fa4::Error>(())
//! ```

use crate::backend::Backend;
use crate::cpu::{BwdInputs, BwdOutputs, CpuBackend};
use crate::error::{Error, Result};
use crate::problem::{Options, Problem};
use crate::tensor::{Element, Layout, Tensor, TensorMut};

/// Options of a backward call: the forward's [`Options`] (mask, scale, softcap, which must be
/// those of the forward that produced O and LSE) and the backward's own settings.
///
/// `BackwardOptions::from(Options::new().causal())`, or `.into()` at the call.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct BackwardOptions {
    /// The attention options of the forward.
    pub attention: Options,
    /// Ask for the same bits on every run (as FlashAttention's `deterministic=True`). The CPU
    /// backend is deterministic whether or not this is set, at no extra cost to the flag (see
    /// `docs/backward.md`); GPU kernels that accumulate dQ with atomics honour it by fixing
    /// the order of the accumulation.
    pub deterministic: bool,
}

impl BackwardOptions {
    /// The backward of a forward run with `attention`, not asking for determinism.
    pub fn new(attention: Options) -> Self {
        Self {
            attention,
            deterministic: false,
        }
    }

    /// Sets [`BackwardOptions::deterministic`].
    pub fn deterministic(mut self, on: bool) -> Self {
        self.deterministic = on;
        self
    }
}

impl From<Options> for BackwardOptions {
    fn from(attention: Options) -> Self {
        Self::new(attention)
    }
}

/// Checks that an output gradient has its input's dims and no two elements share an offset.
fn check_grad_layout(name: &str, got: &Layout, want: &Layout, input: &str) -> Result<()> {
    if got.dims != want.dims || got.packed != want.packed {
        let dims = |l: &Layout| {
            if l.packed {
                l.dims[1..].to_vec()
            } else {
                l.dims.to_vec()
            }
        };
        return Err(Error::invalid(
            name,
            format!(
                "expected {input}'s shape {:?}, got {:?}",
                dims(want),
                dims(got)
            ),
        ));
    }
    if !crate::problem::non_overlapping(got) {
        return Err(Error::invalid(
            name,
            format!("strides {:?} make distinct elements overlap", got.strides),
        ));
    }
    Ok(())
}

impl Backend {
    /// Gradients of attention over a fixed-length batch.
    ///
    /// - `q` `[batch, seqlen_q, heads_q, head_dim]`, `k` `[batch, seqlen_k, heads_kv,
    ///   head_dim]`, `v` `[batch, seqlen_k, heads_kv, head_dim_v]`: the forward's inputs
    /// - `out` `[batch, seqlen_q, heads_q, head_dim_v]` and `lse` (`batch · heads_q · seqlen_q`
    ///   f32 in `[batch, heads_q, seqlen_q]` order): the forward's outputs for those inputs
    /// - `d_out` (dO): O's shape
    /// - `dq`, `dk`, `dv`: the shapes of `q`, `k`, `v`, written (every element: keys no query
    ///   sees get 0)
    ///
    /// Every tensor's last dimension is contiguous; other strides are free. `opts` holds the
    /// forward's options (`&Options::new().causal().into()`).
    #[allow(clippy::too_many_arguments)]
    pub fn backward<T: Element>(
        &self,
        q: &Tensor<'_, T>,
        k: &Tensor<'_, T>,
        v: &Tensor<'_, T>,
        out: &Tensor<'_, T>,
        lse: &[f32],
        d_out: &Tensor<'_, T>,
        dq: &mut TensorMut<'_, T>,
        dk: &mut TensorMut<'_, T>,
        dv: &mut TensorMut<'_, T>,
        opts: &BackwardOptions,
    ) -> Result<()> {
        self.backward_impl(q, k, v, None, out, lse, d_out, dq, dk, dv, opts)
    }

    /// [`Backend::backward`] over a packed variable-length batch: the tensors are `[total,
    /// heads, dim]` as in [`Backend::forward_varlen`], `lse` is `[heads_q, total_q]`.
    #[allow(clippy::too_many_arguments)]
    pub fn backward_varlen<T: Element>(
        &self,
        q: &Tensor<'_, T>,
        k: &Tensor<'_, T>,
        v: &Tensor<'_, T>,
        cu_seqlens_q: &[i32],
        cu_seqlens_k: &[i32],
        out: &Tensor<'_, T>,
        lse: &[f32],
        d_out: &Tensor<'_, T>,
        dq: &mut TensorMut<'_, T>,
        dk: &mut TensorMut<'_, T>,
        dv: &mut TensorMut<'_, T>,
        opts: &BackwardOptions,
    ) -> Result<()> {
        let cu = Some((cu_seqlens_q, cu_seqlens_k));
        self.backward_impl(q, k, v, cu, out, lse, d_out, dq, dk, dv, opts)
    }

    #[allow(clippy::too_many_arguments)]
    fn backward_impl<T: Element>(
        &self,
        q: &Tensor<'_, T>,
        k: &Tensor<'_, T>,
        v: &Tensor<'_, T>,
        cu: Option<(&[i32], &[i32])>,
        out: &Tensor<'_, T>,
        lse: &[f32],
        d_out: &Tensor<'_, T>,
        dq: &mut TensorMut<'_, T>,
        dk: &mut TensorMut<'_, T>,
        dv: &mut TensorMut<'_, T>,
        opts: &BackwardOptions,
    ) -> Result<()> {
        let p = Problem::new(
            T::DTYPE,
            q.layout(),
            k.layout(),
            v.layout(),
            out.layout(),
            cu.map(|c| c.0),
            cu.map(|c| c.1),
            &opts.attention,
        )?;
        p.check_buffers(
            T::DTYPE,
            q.data().len(),
            k.data().len(),
            v.data().len(),
            out.data().len(),
            Some(lse.len()),
        )?;
        check_grad_layout("d_out", d_out.layout(), out.layout(), "out")?;
        let (dq_data, dq_layout) = dq.parts();
        let (dk_data, dk_layout) = dk.parts();
        let (dv_data, dv_layout) = dv.parts();
        check_grad_layout("dq", &dq_layout, q.layout(), "q")?;
        check_grad_layout("dk", &dk_layout, k.layout(), "k")?;
        check_grad_layout("dv", &dv_layout, v.layout(), "v")?;
        let x = BwdInputs {
            q: q.data(),
            k: k.data(),
            v: v.data(),
            o: out.data(),
            lse,
            d_out: d_out.data(),
            d_out_layout: *d_out.layout(),
        };
        let mut o = BwdOutputs {
            dq: dq_data,
            dq_layout,
            dk: dk_data,
            dk_layout,
            dv: dv_data,
            dv_layout,
        };
        match self {
            // The CPU backward is deterministic with or without `opts.deterministic`.
            Backend::Cpu => CpuBackend::default().backward(&p, &x, &mut o),
            Backend::CpuWith(cpu) => cpu.backward(&p, &x, &mut o),
            Backend::Cuda(cuda) => cuda.backward_host(&p, &x, &mut o, opts.deterministic),
        }
    }
}
