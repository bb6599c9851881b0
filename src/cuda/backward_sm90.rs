//! The Hopper backward (`kernels/bwd_sm90/`, planned by [`crate::config::bwd_sm90`]): which
//! backward a problem runs, the main kernel's params (four TMA maps around the backward's
//! params) and its launch. [`super::backward`] calls [`CudaBackend::plan_backward_sm90`] and,
//! where it gives a plan, launches the Ampere-class `pre`, this main kernel and the
//! Ampere-class `convert`.
//!
//! Which backward runs: `FA4_BWD_KERNEL` (`auto`, `sm80`, `sm90`) where set, for A/B runs of
//! one binary; else the backend's [`KernelChoice`] (`Sm80`/`Sm90` force the family, anything
//! else is `auto`). `auto` takes the Hopper kernel where it covers the problem
//! ([`bwd_sm90::uncovered`]), the Ampere-class one elsewhere; a forced `sm90` on a problem it
//! does not cover is an error naming the argument to change.

use std::borrow::Cow;

use cudarc::driver::DeviceRepr;

use super::backward::{BwdParams, BWD_PARAMS_SRC};
use super::compile::{
    KernelSource, MBARRIER_SRC, SM90_PARAMS_SRC, SM90_PIPELINE_SRC, SM90_PTX_SRC,
};
use super::family::{Launch, Launchable};
use super::params::TmaMap;
use super::tma::{self, MapSpec};
use super::{CudaBackend, KernelChoice};
use crate::config::bwd_sm90::{self, Plan, Spec};
use crate::error::{Error, Result};
use crate::problem::Problem;
use crate::tensor::Layout;

/// The Hopper backward's params header.
pub const SM90_BWD_PARAMS_SRC: &str = include_str!("../kernels/bwd_sm90/params.cuh");
/// Its PTX wrappers.
pub const SM90_BWD_PTX_SRC: &str = include_str!("../kernels/bwd_sm90/ptx.cuh");
/// The main kernel.
pub const SM90_BWD_MAIN_SRC: &str = include_str!("../kernels/bwd_sm90/main.cu");
/// Environment variable choosing the backward's kernel family: `auto`, `sm80` or `sm90`.
pub const KERNEL_ENV: &str = "FA4_BWD_KERNEL";

/// Which backward kernel family runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BwdChoice {
    /// The Hopper kernel where it covers the problem, else the Ampere-class one.
    #[default]
    Auto,
    /// The Ampere-class kernels.
    Sm80,
    /// The Hopper main kernel (an error where it does not cover the problem).
    Sm90,
}

impl BwdChoice {
    /// The choice [`KERNEL_ENV`] names, `None` when unset, or an error naming the variable.
    pub fn from_env() -> Result<Option<BwdChoice>> {
        match std::env::var(KERNEL_ENV) {
            Err(std::env::VarError::NotPresent) => Ok(None),
            Ok(v) => match v.as_str() {
                "" | "auto" => Ok(Some(BwdChoice::Auto)),
                "sm80" => Ok(Some(BwdChoice::Sm80)),
                "sm90" => Ok(Some(BwdChoice::Sm90)),
                other => Err(Error::invalid(
                    KERNEL_ENV,
                    format!("expected auto, sm80 or sm90, got `{other}`"),
                )),
            },
            Err(e) => Err(Error::invalid(KERNEL_ENV, e.to_string())),
        }
    }

    /// The backward family a forward kernel choice implies.
    pub fn of(choice: KernelChoice) -> BwdChoice {
        match choice {
            KernelChoice::Sm80 => BwdChoice::Sm80,
            KernelChoice::Sm90 => BwdChoice::Sm90,
            KernelChoice::Auto | KernelChoice::Sm100 => BwdChoice::Auto,
        }
    }
}

/// Launch parameters of the Hopper main kernel (`Sm90BwdParams` in
/// `kernels/bwd_sm90/params.cuh`).
#[repr(C, align(64))]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Sm90BwdParams {
    pub tq: TmaMap,
    pub tk: TmaMap,
    pub tv: TmaMap,
    pub tdo: TmaMap,
    pub b: BwdParams,
}

/// The header's `FA4_SM90_BWD_PARAMS_SIZE`.
pub const SM90_BWD_PARAMS_SIZE: usize = 960;
const _: () = assert!(std::mem::size_of::<Sm90BwdParams>() == SM90_BWD_PARAMS_SIZE);
const _: () = assert!(std::mem::offset_of!(Sm90BwdParams, b) == 512);
// SAFETY: #[repr(C)] plain data (opaque map bytes and the DeviceRepr BwdParams), laid out like
// the header's struct (size asserted on both sides, alignment 64 on both).
unsafe impl DeviceRepr for Sm90BwdParams {}

impl KernelSource for Spec {
    fn target(&self) -> &'static str {
        self.target
    }
    fn prelude(&self) -> String {
        Spec::prelude(self)
    }
    fn family_sources(&self) -> Vec<Cow<'static, str>> {
        vec![
            SM90_PARAMS_SRC.into(),
            MBARRIER_SRC.into(),
            SM90_PTX_SRC.into(),
            SM90_PIPELINE_SRC.into(),
            BWD_PARAMS_SRC.into(),
            SM90_BWD_PARAMS_SRC.into(),
            SM90_BWD_PTX_SRC.into(),
            self.wgmma_wrappers().into(),
            SM90_BWD_MAIN_SRC.into(),
        ]
    }
    fn entry(&self) -> &'static str {
        Spec::entry(self)
    }
    fn smem_bytes(&self) -> usize {
        Spec::smem_bytes(self)
    }
    fn setmaxnreg_launch_regs(&self) -> Option<u32> {
        Some(self.tiles.registers().div_ceil(self.tiles.threads()) as u32)
    }
}

/// The environment variable that sets the Hopper backward's CTA count, at most one per tile
/// (tests: several tiles per CTA on problems small enough for compute-sanitizer; measurements:
/// one tile per CTA against the persistent grid).
pub const CTAS_ENV: &str = "FA4_BWD_SM90_CTAS";

/// [`CTAS_ENV`]: a positive CTA count, or `None` when unset.
fn ctas_from_env() -> Result<Option<u32>> {
    match std::env::var(CTAS_ENV) {
        Err(std::env::VarError::NotPresent) => Ok(None),
        Ok(v) => match v.parse::<u32>() {
            Ok(n) if n > 0 => Ok(Some(n)),
            _ => Err(Error::invalid(
                CTAS_ENV,
                format!("expected a positive CTA count, got `{v}`"),
            )),
        },
        Err(e) => Err(Error::invalid(CTAS_ENV, e.to_string())),
    }
}

/// `plan` with [`CTAS_ENV`]'s CTA count where it is set, at most one per tile (few: small
/// problems, what the sanitizers can afford, still walk several tiles per CTA; one per tile:
/// each CTA takes one tile, as a grid that is not persistent).
fn with_ctas_from_env(mut plan: Plan) -> Result<Plan> {
    if let Some(ctas) = ctas_from_env()? {
        plan.grid.0 = u32::try_from(plan.tiles).unwrap_or(u32::MAX).min(ctas);
    }
    Ok(plan)
}

/// The main kernel of a Hopper plan.
struct MainLaunch<'a>(&'a Plan);

// SAFETY: built only by `launch_bwd_sm90` from a plan of `bwd_sm90::plan`, which accepted only
// problems with a head_dim that is a multiple of 8 up to 256 (V's a multiple of 8 up to it; the
// tile width 64, 128 or 256 at least that) and query rows and keys in every fixed-length sequence, or in the packed
// tensors of a varlen batch, on the path of `backward_device_trusted`: the problem was
// validated (cu_seqlens its own offsets, checked there), every input buffer holds its layout's
// extent, is 16-byte aligned with strides of multiples of 8 elements (checked there), so the
// four TMA maps describe exactly those extents (reads past them, and with slab maps past
// head_dim's columns, are zero-filled by the hardware, not performed). The kernel writes dK, dV
// only at rows below the sequence's keys and columns below head_dim (DIM; DIM_V for dV) through the checked
// gradient layouts, and reduces into the dQ accumulator at rows of the sequence's padded
// blocks (`stats_base`), which the plan's workspace length covers (`stats_layout`). The grid
// is persistent CTAs, each walking tiles (key block, KV head, batch entry) below the kernel's
// own count of them, taken from the counter after the statistics in the D workspace (inside
// `dpsum_len`, zeroed by `pre` on the same stream before this launch; the deterministic mode
// also waits on and increments the semaphores after it, inside `dpsum_len` and zeroed by `pre`
// too, and every CTA claims its tiles from that counter, so a wait is only ever on a tile that
// a running CTA claimed earlier and cannot close a cycle); block and shared memory
// are the planner's (static_asserted by the kernel), and the register split fits the launch
// allocation (`Tiles::check`), so `setmaxnreg` cannot wait forever.
unsafe impl Launchable for MainLaunch<'_> {
    fn launch(&self) -> Launch<'_> {
        Launch::new(&self.0.spec, self.0.grid, self.0.spec.threads())
    }
}

/// The TMA map of one tensor: `[batch, rows, heads, head_dim]` boxes of `box_rows` rows, one
/// 5-D box per tile, or (`slabs`: the head dim is narrower than the tile) 4-D boxes of one
/// 64-column slab over the tensor's real columns.
fn map(
    name: &str,
    ptr: u64,
    bf16: bool,
    l: &Layout,
    box_rows: usize,
    slabs: bool,
) -> Result<TmaMap> {
    let m = MapSpec {
        ptr,
        elem: if bf16 {
            tma::MapElem::Bf16
        } else {
            tma::MapElem::F16
        },
        dims: l.dims,
        strides: l.strides,
        box_rows,
    };
    if slabs {
        tma::encode_slabs(name, &m)
    } else {
        tma::encode(name, &m)
    }
}

impl CudaBackend {
    /// The Hopper backward's plan for `p`, or `None` where the Ampere-class backward runs it
    /// (see the module docs for the choice).
    pub fn plan_backward_sm90(&self, p: &Problem, deterministic: bool) -> Result<Option<Plan>> {
        let choice = BwdChoice::from_env()?.unwrap_or(BwdChoice::of(self.choice));
        let info = self.info();
        // The persistent grid is one CTA per SM of this device (an H100 PCIe has 114 where the
        // architecture's table, the SXM part, says 132).
        let arch = crate::arch::GpuArch {
            sm_count: info.sm_count,
            ..info.arch
        };
        let plan = match choice {
            BwdChoice::Sm80 => return Ok(None),
            BwdChoice::Auto => {
                if bwd_sm90::uncovered(p, &arch).is_some() {
                    return Ok(None);
                }
                bwd_sm90::plan(p, &arch, info.target, deterministic)?
            }
            BwdChoice::Sm90 => {
                if let Some((arg, why)) = bwd_sm90::uncovered(p, &arch) {
                    return Err(Error::invalid(
                        arg,
                        format!(
                            "the Hopper backward (sm90 forced) does not cover this problem: {why}"
                        ),
                    ));
                }
                bwd_sm90::plan(p, &arch, info.target, deterministic)?
            }
        };
        Ok(Some(with_ctas_from_env(plan)?))
    }

    /// Launches the Hopper main kernel of `plan` with the backward's params and the layouts of
    /// Q, K, V (the problem's) and dO, whose device addresses `params` holds.
    pub(super) fn launch_bwd_sm90(
        &self,
        plan: &Plan,
        p: &Problem,
        d_out_layout: &Layout,
        params: &BwdParams,
    ) -> Result<()> {
        if plan.grid.0 == 0 || plan.grid.1 == 0 || plan.grid.2 == 0 {
            return Ok(());
        }
        let (bf16, rows_m) = (plan.spec.bf16, plan.spec.tiles.block_m);
        let slabs = plan.spec.slab_maps();
        let f = &params.f;
        let n = plan.spec.block_n();
        let args = Sm90BwdParams {
            tq: map("q", f.q, bf16, p.q_layout(), rows_m, slabs)?,
            tk: map("k", f.k, bf16, p.k_layout(), n, slabs)?,
            tv: map("v", f.v, bf16, p.v_layout(), n, slabs)?,
            tdo: map("d_out", params.d_out, bf16, d_out_layout, rows_m, slabs)?,
            b: *params,
        };
        self.launch(&MainLaunch(plan), &args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_header_states_the_same_size_and_the_choice_maps() {
        assert!(SM90_BWD_PARAMS_SRC.contains(&format!(
            "#define FA4_SM90_BWD_PARAMS_SIZE {SM90_BWD_PARAMS_SIZE}"
        )));
        assert_eq!(BwdChoice::of(KernelChoice::Sm80), BwdChoice::Sm80);
        assert_eq!(BwdChoice::of(KernelChoice::Sm90), BwdChoice::Sm90);
        assert_eq!(BwdChoice::of(KernelChoice::Auto), BwdChoice::Auto);
    }

    /// The registers a warp-specialised kernel must be launched with, which loading checks
    /// against ptxas's count: the planned Hopper kernels take the whole launch-bounds share of
    /// an H200 (168 per thread at 384 threads).
    #[test]
    fn planned_hopper_kernels_need_their_whole_launch_share() {
        use crate::arch::H200;
        for spec in crate::config::sm90::all_specs(&H200, "sm_90a") {
            let need = spec.setmaxnreg_launch_regs().unwrap();
            assert_eq!(need, spec.tiles.launch_regs(&H200), "{spec}");
        }
        for head_dim in crate::config::bwd_sm90::HEAD_DIMS {
            let spec = Spec {
                target: "sm_90a",
                bf16: true,
                head_dim,
                dim: head_dim,
                dim_v: head_dim,
                window: true,
                softcap: false,
                varlen: false,
                tiles: crate::config::bwd_sm90::tiles(head_dim, false),
            };
            let want = Some(crate::config::bwd_sm90::LAUNCH_REGS);
            assert_eq!(spec.setmaxnreg_launch_regs(), want, "{spec}");
        }
    }
}
