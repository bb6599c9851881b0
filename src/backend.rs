//! Backends behind one type: a caller writes the same code for the CPU and the GPU.
//!
//! [`Backend::forward`] (fixed-length batches) and [`Backend::forward_varlen`] (packed
//! variable-length batches) validate the call into a [`Problem`] and run it;
//! [`Backend::run`] runs an already validated problem on raw slices.

use crate::cpu::CpuBackend;
use crate::cuda::CudaBackend;
use crate::error::Result;
use crate::fp8::{Descales, F8E4M3};
use crate::problem::{Options, Problem};
use crate::tensor::{Element, Tensor, TensorMut};

/// Where attention is computed.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub enum Backend {
    /// The tiled, multi-threaded CPU backend.
    #[default]
    Cpu,
    /// The CPU backend with explicit settings (threads, tiles).
    CpuWith(CpuBackend),
    /// A CUDA GPU.
    Cuda(CudaBackend),
}

impl Backend {
    /// The best backend this machine has: a working GPU (device 0, with NVRTC to compile its
    /// kernels), else the CPU.
    pub fn auto() -> Backend {
        Backend::auto_explained().0
    }

    /// [`Backend::auto`] and one line saying what it chose and, when it fell back to the CPU,
    /// why: the driver or NVRTC missing (with every name and place tried), or the device's
    /// error.
    pub fn auto_explained() -> (Backend, String) {
        let gpu = CudaBackend::new(0).and_then(|cuda| {
            crate::cuda::compile::nvrtc_version()?;
            Ok(cuda)
        });
        match gpu {
            Ok(cuda) => {
                let b = Backend::Cuda(cuda);
                let why = format!("chose {} (a CUDA GPU and NVRTC were found)", b.name());
                (b, why)
            }
            Err(e) => {
                // Errors such as a compile log may span lines; the account stays on one.
                let e = e
                    .to_string()
                    .split_whitespace()
                    .collect::<Vec<_>>()
                    .join(" ");
                (Backend::Cpu, format!("chose cpu: no usable GPU ({e})"))
            }
        }
    }

    /// The CUDA backend on device `ordinal`, or why there is none.
    pub fn cuda(ordinal: usize) -> Result<Backend> {
        CudaBackend::new(ordinal).map(Backend::Cuda)
    }

    /// A short name for reports.
    pub fn name(&self) -> String {
        match self {
            Backend::Cpu | Backend::CpuWith(_) => "cpu".to_string(),
            Backend::Cuda(c) => format!(
                "cuda:{} ({}, {})",
                c.info().ordinal,
                c.info().name,
                c.info().target
            ),
        }
    }

    /// Attention over a fixed-length batch.
    ///
    /// - `q`: `[batch, seqlen_q, heads_q, head_dim]`
    /// - `k`: `[batch, seqlen_k, heads_kv, head_dim]`, `heads_q % heads_kv == 0`
    /// - `v`: `[batch, seqlen_k, heads_kv, head_dim_v]`
    /// - `out`: `[batch, seqlen_q, heads_q, head_dim_v]`, written
    /// - `lse`: `batch · heads_q · seqlen_q` f32 in `[batch, heads_q, seqlen_q]` order, written
    ///   if given (natural log; `-inf` for rows with no allowed key)
    ///
    /// Each tensor's last dimension is contiguous; other strides are free.
    pub fn forward<T: Element>(
        &self,
        q: &Tensor<'_, T>,
        k: &Tensor<'_, T>,
        v: &Tensor<'_, T>,
        out: &mut TensorMut<'_, T>,
        lse: Option<&mut [f32]>,
        opts: &Options,
    ) -> Result<()> {
        self.forward_impl(q, k, v, None, out, lse, opts)
    }

    /// Attention over a packed variable-length batch: `q` `[total_q, heads_q, head_dim]`,
    /// `k` `[total_k, heads_kv, head_dim]`, `v` `[total_k, heads_kv, head_dim_v]`, `out`
    /// `[total_q, heads_q, head_dim_v]`; sequence `b` is rows `cu[b] .. cu[b+1]` of `cu_seqlens_q`
    /// and `cu_seqlens_k` (`batch + 1` entries from 0, non-decreasing, ending at the total).
    /// `lse` is `[heads_q, total_q]`.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_varlen<T: Element>(
        &self,
        q: &Tensor<'_, T>,
        k: &Tensor<'_, T>,
        v: &Tensor<'_, T>,
        cu_seqlens_q: &[i32],
        cu_seqlens_k: &[i32],
        out: &mut TensorMut<'_, T>,
        lse: Option<&mut [f32]>,
        opts: &Options,
    ) -> Result<()> {
        self.forward_impl(q, k, v, Some((cu_seqlens_q, cu_seqlens_k)), out, lse, opts)
    }

    #[allow(clippy::too_many_arguments)]
    fn forward_impl<T: Element>(
        &self,
        q: &Tensor<'_, T>,
        k: &Tensor<'_, T>,
        v: &Tensor<'_, T>,
        cu: Option<(&[i32], &[i32])>,
        out: &mut TensorMut<'_, T>,
        lse: Option<&mut [f32]>,
        opts: &Options,
    ) -> Result<()> {
        let (o, ol) = out.parts();
        let p = Problem::new(
            T::DTYPE,
            q.layout(),
            k.layout(),
            v.layout(),
            &ol,
            cu.map(|c| c.0),
            cu.map(|c| c.1),
            opts,
        )?;
        self.run(&p, q.data(), k.data(), v.data(), o, lse)
    }

    /// Attention over a fixed-length batch of fp8 e4m3 inputs (`docs/attention.md`, "FP8
    /// (e4m3) inputs"): shapes as [`Backend::forward`], `descales` each `[batch, heads_kv]`
    /// (absent: ones), O in `O` (bf16 or fp16), LSE in f32 over the descaled scores. The CPU
    /// backend computes it, and the CUDA backend on Hopper GPUs (the e4m3 kernel,
    /// [`crate::config::sm90::fp8`]); on other GPUs it is an error naming `dtype`.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_fp8<O: Element>(
        &self,
        q: &Tensor<'_, F8E4M3>,
        k: &Tensor<'_, F8E4M3>,
        v: &Tensor<'_, F8E4M3>,
        descales: &Descales,
        out: &mut TensorMut<'_, O>,
        lse: Option<&mut [f32]>,
        opts: &Options,
    ) -> Result<()> {
        let (o, ol) = out.parts();
        let p = Problem::new_fp8(
            O::DTYPE,
            q.layout(),
            k.layout(),
            v.layout(),
            &ol,
            None,
            None,
            opts,
        )?;
        self.run_fp8(&p, q.data(), k.data(), v.data(), descales, o, lse)
    }

    /// [`Backend::forward_fp8`] over a packed variable-length batch (shapes and `cu_seqlens` as
    /// [`Backend::forward_varlen`]); the descales are `[batch, heads_kv]` per sequence.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_varlen_fp8<O: Element>(
        &self,
        q: &Tensor<'_, F8E4M3>,
        k: &Tensor<'_, F8E4M3>,
        v: &Tensor<'_, F8E4M3>,
        cu_seqlens_q: &[i32],
        cu_seqlens_k: &[i32],
        descales: &Descales,
        out: &mut TensorMut<'_, O>,
        lse: Option<&mut [f32]>,
        opts: &Options,
    ) -> Result<()> {
        let (o, ol) = out.parts();
        let p = Problem::new_fp8(
            O::DTYPE,
            q.layout(),
            k.layout(),
            v.layout(),
            &ol,
            Some(cu_seqlens_q),
            Some(cu_seqlens_k),
            opts,
        )?;
        self.run_fp8(&p, q.data(), k.data(), v.data(), descales, o, lse)
    }

    /// Runs a validated fp8 problem ([`Problem::new_fp8`]) on slices laid out as it says,
    /// after checking the buffers and the descales against it.
    #[allow(clippy::too_many_arguments)]
    pub fn run_fp8<O: Element>(
        &self,
        p: &Problem,
        q: &[F8E4M3],
        k: &[F8E4M3],
        v: &[F8E4M3],
        descales: &Descales,
        out: &mut [O],
        lse: Option<&mut [f32]>,
    ) -> Result<()> {
        p.check_fp8_buffers(
            O::DTYPE,
            q.len(),
            k.len(),
            v.len(),
            out.len(),
            lse.as_deref().map(<[f32]>::len),
        )?;
        descales.validate(p)?;
        match self {
            Backend::Cpu => {
                crate::fp8::forward_cpu(&CpuBackend::default(), p, q, k, v, descales, out, lse)
            }
            Backend::CpuWith(cpu) => crate::fp8::forward_cpu(cpu, p, q, k, v, descales, out, lse),
            Backend::Cuda(cuda) => cuda.forward_fp8_host(p, q, k, v, descales, out, lse),
        }
    }

    /// Runs a validated problem on slices laid out as the problem says.
    pub fn run<T: Element>(
        &self,
        p: &Problem,
        q: &[T],
        k: &[T],
        v: &[T],
        out: &mut [T],
        lse: Option<&mut [f32]>,
    ) -> Result<()> {
        p.check_buffers(
            T::DTYPE,
            q.len(),
            k.len(),
            v.len(),
            out.len(),
            lse.as_deref().map(<[f32]>::len),
        )?;
        match self {
            Backend::Cpu => CpuBackend::default().forward(p, q, k, v, out, lse),
            Backend::CpuWith(cpu) => cpu.forward(p, q, k, v, out, lse),
            Backend::Cuda(cuda) => cuda.forward_host(p, q, k, v, out, lse),
        }
    }
}
