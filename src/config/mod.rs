//! Planners: pure functions from a problem's static shape to a kernel configuration.
//!
//! Each GPU family has its planner; the planner alone decides tile sizes, stage counts, thread
//! counts and shared-memory bytes, and kernels receive those numbers from it.
//!
//! - [`sm100`]: [`sm100::FA4Config`], the FlashAttention-4 plan for Blackwell (the seed).
//! - [`sm80`]: the Ampere-class `mma.sync` kernel, which runs on every GPU from sm_80 on.

pub mod sm100;
pub mod sm80;
