//! # fa4: exact, fast attention for NVIDIA GPUs and the CPU
//!
//! fa4 computes scaled dot-product attention exactly (no approximation beyond floating-point
//! rounding) with FlashAttention-style kernels. Its layers, bottom up:
//!
//! | layer | module | what it does |
//! |---|---|---|
//! | hardware | [`arch`] | limits of the GPUs fa4 plans for (SMs, shared memory, TMEM) |
//! | planners | [`config`] | pure functions from a problem's shape to a kernel plan: [`config::sm100::FA4Config`] (Blackwell, the seed), [`config::sm90`] (the Hopper kernel, and which kernel a problem gets), [`config::sm80`] (the Ampere-class kernel), [`cpu::plan`] |
//! | problem | [`problem`], [`mask`], [`tensor`] | shapes, strides, dtypes, mask, scale, softcap, varlen: validated once, trusted after |
//! | backends | [`Backend`], [`cpu`], [`cuda`] | one API for the CPU and the GPU; CUDA kernels compiled at run time by NVRTC and cached on disk |
//! | parallelism | [`cp`], [`combine`] | context parallelism (ring attention over N ranks: zigzag split, ring schedule, NCCL or simulated transport) and the exact merge of partial results |
//! | oracle | [`cpu::reference`], [`cpu::reference_grad`], [`check`] | the float64 evaluation, the tolerance rule, the correctness matrix |
//! | errors | [`error`] | one error enum; bad input is an error naming the argument, never a panic |
//!
//! ## Features
//!
//! | feature | CPU | CUDA (sm_80+) |
//! |---|---|---|
//! | f32 / f16 / bf16 storage | all | f16, bf16 |
//! | head dims | 1–1024, `head_dim_v` free | multiples of 8 up to 256, `head_dim_v == head_dim` |
//! | fixed and varlen batches, zero-length sequences, strided views | yes | yes (strides in multiples of 8 elements) |
//! | GQA/MQA, causal (bottom-right), local window, softcap, custom scale, LSE | yes | yes |
//! | backward: dQ, dK, dV ([`Backend::backward`], `docs/backward.md`) | yes, every feature above, deterministic | yes: fp16/bf16, every feature above (`head_dim_v == head_dim`), deterministic on request |
//!
//! On Hopper GPUs the CUDA backend runs fp16/bf16 problems with head dim 64, 128 or 256, a
//! fixed-length batch and a positive scale on the Hopper kernel (TMA, `wgmma`, warp
//! specialisation) and everything else on the Ampere-class kernel;
//! [`config::sm90::dispatch`] says which and why.
//!
//! ## Example
//!
//! ```
//! use fa4::{Backend, Options, Tensor, TensorMut};
//! use half::bf16;
//!
//! let (b, s, h, d) = (2, 64, 4, 64);
//! let q: Vec<bf16> = (0..b * s * h * d).map(|i| bf16::from_f32((i % 7) as f32 * 0.1)).collect();
//! let (k, v) = (q.clone(), q.clone());
//! let mut o = vec![bf16::ZERO; b * s * h * d];
//! let mut lse = vec![0f32; b * h * s];
//! Backend::auto().forward(
//!     &Tensor::new(&q, &[b, s, h, d])?,          // [batch, seqlen_q, heads_q, head_dim]
//!     &Tensor::new(&k, &[b, s, h, d])?,          // [batch, seqlen_k, heads_kv, head_dim]
//!     &Tensor::new(&v, &[b, s, h, d])?,          // [batch, seqlen_k, heads_kv, head_dim_v]
//!     &mut TensorMut::new(&mut o, &[b, s, h, d])?,
//!     Some(&mut lse),                            // [batch, heads_q, seqlen_q]
//!     &Options::new().causal().softcap(30.0),
//! )?;
//! assert!(o.iter().all(|x| x.to_f32().is_finite()));
//! # Ok::<(), fa4::Error>(())
//! ```
//!
//! The SM100 planner:
//!
//! ```
//! use fa4::config::sm100::{FA4Config, FA4Inputs, Swizzle};
//!
//! let cfg = FA4Config::new(FA4Inputs {
//!     num_q_heads: 32,
//!     group: 4,
//!     depth: 128,
//!     dtype_size: 2,
//!     swizzle_mode: Swizzle::B128,
//! })?;
//! assert_eq!((cfg.bm(), cfg.bn(), cfg.num_kv_stages()), (256, 128, 5));
//! assert!(cfg.supported());
//! # Ok::<(), fa4::Error>(())
//! ```

#![warn(missing_docs)]

pub mod arch;
pub mod backend;
pub mod backward;
pub mod check;
pub mod combine;
pub mod config;
pub mod cp;
pub mod cpu;
pub mod cuda;
pub mod dtype;
pub mod error;
pub mod fp8;
pub mod mask;
pub mod npy;
pub mod paged;
pub mod problem;
pub mod tensor;

pub use backend::Backend;
pub use backward::BackwardOptions;
pub use dtype::DType;
pub use error::{Error, Result};
pub use fp8::{Descales, F8E4M3};
pub use mask::Mask;
pub use problem::{Options, Problem};
pub use tensor::{Element, Storage, Tensor, TensorMut};
