//! The Ampere-class `mma.sync` kernel (`kernels/sm80/`, planned by [`crate::config::sm80`]):
//! every GPU from sm_80 on, fp16 and bf16, head dims up to 256.

use super::{ForwardFamily, Launch, Launchable, Overrides, Refusal};
use crate::config::{sm80, KernelKind};
use crate::cuda::params::FwdParams;
use crate::cuda::DeviceInfo;
use crate::error::Result;
use crate::problem::Problem;
use crate::DType;

/// The family.
pub struct Sm80;

// SAFETY: `config::sm80::plan` sized the grid as (group, query blocks, groups) over the
// problem's (sequence, head) pairs and longest sequence, the block as the tiles' warps and the
// shared memory as the tiles' (the kernel static_asserts the same count); it checked the head
// dim and every stride against the kernel's 16-byte copies, and the kernel masks rows and keys
// past each sequence's length, so it touches only the layouts' extents.
unsafe impl Launchable for sm80::Plan {
    fn launch(&self) -> Launch<'_> {
        Launch::new(&self.spec, self.grid, self.spec.threads())
    }
}

impl ForwardFamily for Sm80 {
    const KIND: KernelKind = KernelKind::Sm80;
    type Plan = sm80::Plan;
    type Params = FwdParams;

    fn covers(_dev: &DeviceInfo, p: &Problem) -> std::result::Result<(), Refusal> {
        // Every device the backend opens (sm_80 on) runs it; the planner names the head dim,
        // stride and scale limits.
        match p.dtype() {
            DType::F16 | DType::Bf16 => Ok(()),
            other => Err(Refusal {
                argument: "dtype",
                reason: format!(
                    "the CUDA backend computes fp16 and bf16, not {other}; use the CPU backend"
                ),
            }),
        }
    }

    fn plan(dev: &DeviceInfo, p: &Problem, o: &Overrides) -> Result<sm80::Plan> {
        sm80::plan(p, &dev.arch, dev.target, o.sm80)
    }

    fn params(_plan: &sm80::Plan, _p: &Problem, common: FwdParams) -> Result<FwdParams> {
        Ok(common)
    }
}
