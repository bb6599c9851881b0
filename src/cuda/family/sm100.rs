//! The Blackwell kernel (`kernels/sm100/`: tcgen05, tensor memory; planned by
//! [`crate::config::sm100_kernel`] from FA4Config), on SM100 GPUs only. Not yet run on hardware.

use super::{ForwardFamily, Launch, Launchable, Overrides, Refusal};
use crate::config::{sm100_kernel, KernelKind};
use crate::cuda::params::{FwdParams, Sm90Params};
use crate::cuda::{tma, DeviceInfo};
use crate::error::Result;
use crate::problem::Problem;
use crate::tensor::Layout;

/// The family.
pub struct Sm100;

// SAFETY: `config::sm100_kernel::plan` accepted only fixed-length fp16/bf16 batches with a head
// dim of its HEAD_DIMS, head_dim_v == head_dim and strides in multiples of 8 elements, on a GPU
// with tensor memory; the grid is (query blocks, heads_q, batch) and the shared memory
// FA4Config's (static_asserted by the kernel). Its TMA maps (`Sm100::params`) describe exactly
// the layouts' extents, and the kernel stores only rows below seqlen_q.
unsafe impl Launchable for sm100_kernel::Plan {
    fn launch(&self) -> Launch<'_> {
        Launch::new(&self.spec, self.grid, self.spec.threads())
    }
}

impl ForwardFamily for Sm100 {
    const KIND: KernelKind = KernelKind::Sm100;
    type Plan = sm100_kernel::Plan;
    // The kernel takes the Hopper params' layout (three maps, then FwdParams).
    type Params = Sm90Params;

    fn covers(dev: &DeviceInfo, _p: &Problem) -> std::result::Result<(), Refusal> {
        if dev.target == "sm_100" {
            return Ok(());
        }
        Err(Refusal {
            argument: "--kernel",
            reason: format!(
                "sm100 runs on SM100 (B200-class) GPUs; this is {} ({})",
                dev.name, dev.target
            ),
        })
    }

    fn plan(dev: &DeviceInfo, p: &Problem, _o: &Overrides) -> Result<sm100_kernel::Plan> {
        let mut plan = sm100_kernel::plan(p, &dev.arch)?;
        // tcgen05 needs the architecture-specific target.
        plan.spec.target = "sm_100a";
        Ok(plan)
    }

    fn params(plan: &sm100_kernel::Plan, p: &Problem, common: FwdParams) -> Result<Sm90Params> {
        let bf16 = plan.spec.bf16;
        let map = |name: &str, ptr: u64, l: &Layout, box_rows: usize| {
            tma::encode_slabs(name, &super::map_spec(ptr, bf16, l, box_rows))
        };
        let cfg = &plan.spec.cfg;
        Ok(Sm90Params {
            tq: map("q", common.q, p.q_layout(), cfg.mma_m() as usize)?,
            tk: map("k", common.k, p.k_layout(), cfg.bn() as usize)?,
            tv: map("v", common.v, p.v_layout(), cfg.bn() as usize)?,
            p: common,
            tiles: 0,
            vt_seq_keys: 0,
            cu_vt: 0,
            descales: 0,
            descale_plane: 0,
            pad0: 0,
            // The Hopper kernel's TMA-store map; this kernel stores O itself.
            to: Default::default(),
        })
    }
}
