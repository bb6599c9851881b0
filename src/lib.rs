//! # fa4: exact, fast attention for NVIDIA GPUs and the CPU
//!
//! fa4 computes scaled dot-product attention exactly (no approximation beyond floating-point
//! rounding) with FlashAttention-style kernels. Its layers, bottom up:
//!
//! | layer | module | what it does |
//! |---|---|---|
//! | hardware | [`arch`] | limits of the GPUs fa4 plans for (SMs, shared memory, TMEM) |
//! | planners | [`config`] | pure functions from a problem's shape to a kernel plan: [`config::sm100::FA4Config`] for Blackwell |
//! | errors | [`error`] | one error enum; bad input is an error naming the argument, never a panic |
//!
//! ## Status
//!
//! | feature | state |
//! |---|---|
//! | `FA4Config` (SM100 planner), `fa4 plan` | done, matches the contract's worked values |
//! | CPU backend (float64 oracle, tiled online softmax) | planned |
//! | CUDA: Ampere-class (`mma.sync`), Hopper (`wgmma`), Blackwell (`tcgen05`) | planned |
//!
//! ## Example
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
pub mod check;
pub mod config;
pub mod cpu;
pub mod dtype;
pub mod error;
pub mod mask;
pub mod problem;
pub mod tensor;

pub use backend::Backend;
pub use dtype::DType;
pub use error::{Error, Result};
pub use mask::Mask;
pub use problem::{Options, Problem};
pub use tensor::{Element, Tensor, TensorMut};
