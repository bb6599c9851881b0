//! Planners: pure functions from a problem's static shape to a kernel configuration.
//!
//! Each GPU family has its planner; the planner alone decides tile sizes, stage counts, thread
//! counts and shared-memory bytes, and kernels receive those numbers from it.
//!
//! - [`sm100`]: [`sm100::FA4Config`], the FlashAttention-4 plan for Blackwell (the seed).
//! - [`sm90`]: the Hopper plan (TMA, `wgmma`, warp specialisation): tiles, warpgroup roles and
//!   register budgets, shared memory, and which kernel a problem gets on an sm_90 GPU.
//! - [`sm80`]: the Ampere-class `mma.sync` kernel, which runs on every GPU from sm_80 on.

pub mod sm100;
pub mod sm80;
pub mod sm90;
