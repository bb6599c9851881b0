//! Kernel families: how a planned kernel reaches the GPU.
//!
//! Every forward kernel family implements [`ForwardFamily`]: what it covers (a typed
//! [`Refusal`] naming the argument, so that a dispatcher can fall back and a user learns what
//! to change), its plan (the family's planner in [`crate::config`], which also writes the
//! prelude through the one builder, [`crate::config::prelude::Prelude`]), and its one params
//! argument built from the common [`FwdParams`]. A plan is [`Launchable`]: it gives the kernel,
//! grid and threads of a [`Launch`]. `CudaBackend::launch` (below) is the one place where any fa4
//! kernel is launched (the forward families and decode's split-KV, combine and append kernels),
//! so the crate's launch `unsafe` is written once, with the contract every plan signs by
//! implementing the `unsafe` trait [`Launchable`].
//!
//! The families are registered in one table, `families!` in `src/cuda/mod.rs`, which
//! generates [`super::Planned`] (one variant per family) and its dispatch. Adding a family is
//! one new module here and one registration line (plus the name users select it by, a
//! [`KernelKind`] variant):
//!
//! ```text
//! // src/cuda/family/sm120.rs
//! pub(crate) struct Sm120;
//! unsafe impl Launchable for sm120::Plan { fn launch(&self) -> Launch<'_> { … } }
//! impl ForwardFamily for Sm120 {
//!     const KIND: KernelKind = KernelKind::Sm120;
//!     type Plan = sm120::Plan;
//!     type Params = FwdParams;
//!     fn covers(dev: &DeviceInfo, p: &Problem) -> Result<(), Refusal> { … }
//!     fn plan(dev: &DeviceInfo, p: &Problem, o: &Overrides) -> Result<sm120::Plan> { … }
//!     fn params(plan: &sm120::Plan, p: &Problem, common: FwdParams) -> Result<FwdParams> {
//!         Ok(common)
//!     }
//! }
//! // src/cuda/mod.rs, in `families!`:
//!     Sm120 => family::sm120::Sm120,
//! ```

pub(crate) mod decode;
pub mod sm100;
pub mod sm80;
pub mod sm90;

use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};

use super::compile::KernelSource;
use super::params::FwdParams;
use super::{CudaBackend, DeviceInfo};
use crate::config::{sm80 as sm80_config, sm90 as sm90_config, KernelKind};
use crate::error::{Error, Result};
use crate::problem::Problem;

/// One kernel launch as its plan sized it.
#[derive(Clone, Copy)]
pub struct Launch<'a> {
    /// The kernel (compiled, or loaded from the cache, on first use).
    pub kernel: &'a dyn KernelSource,
    /// The grid.
    pub grid: (u32, u32, u32),
    /// Threads per CTA.
    pub threads: usize,
}

/// A plan that can be launched.
///
/// # Safety
///
/// An implementor promises that [`Launchable::launch`] gives the grid, the threads and (through
/// the kernel's [`KernelSource::smem_bytes`]) the shared memory that its planner sized for this
/// kernel (and that the kernel `static_assert`s where it can), and that with params built from
/// a validated problem whose buffers were checked against it, every CTA of that grid reads and
/// writes only inside those buffers. Each implementation's comment says why that holds.
pub unsafe trait Launchable {
    /// The kernel, grid and threads.
    fn launch(&self) -> Launch<'_>;
}

/// Why a family does not run a problem on a device: the argument to change and the reason.
/// Becomes [`Error::InvalidArgument`] when the caller forced the family.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The argument the user gave (`dtype`, `q`, `--kernel`, `device`, …).
    pub argument: &'static str,
    /// What the family needs and what came.
    pub reason: String,
}

impl From<Refusal> for Error {
    fn from(r: Refusal) -> Error {
        Error::invalid(r.argument, r.reason)
    }
}

/// What a planner is told beside the problem and the device: the tile overrides a backend
/// carries ([`CudaBackend::with_tiles`], [`CudaBackend::with_sm90_tiles`]), checked by the
/// planners like their own choices.
#[derive(Debug, Clone, Copy, Default)]
pub struct Overrides {
    /// The Ampere-class kernel's tiles.
    pub sm80: Option<sm80_config::Tiles>,
    /// The Hopper kernel's tiles.
    pub sm90: Option<sm90_config::Tiles>,
}

/// A forward kernel family: one kernel source, its planner and its params.
pub trait ForwardFamily {
    /// The family's name (`--kernel`, `FA4_KERNEL`, plans and reports).
    const KIND: KernelKind;
    /// The planner's output.
    type Plan: Launchable + std::fmt::Debug + Clone + PartialEq + Eq;
    /// The kernel's one argument (a `#[repr(C)]` struct mirrored in its header).
    type Params: DeviceRepr;
    /// Whether the family runs problems like `p` on this device at all (device, dtype, head
    /// dims); the planner's own errors name the finer limits.
    fn covers(dev: &DeviceInfo, p: &Problem) -> std::result::Result<(), Refusal>;
    /// The family's plan for a problem it covers.
    fn plan(dev: &DeviceInfo, p: &Problem, o: &Overrides) -> Result<Self::Plan>;
    /// The kernel's argument: the common params of the validated problem and its checked
    /// buffers (`common`), plus what the family adds (TMA maps, …).
    fn params(plan: &Self::Plan, p: &Problem, common: FwdParams) -> Result<Self::Params>;
}

/// [`ForwardFamily::covers`], then [`ForwardFamily::plan`].
pub(crate) fn plan<F: ForwardFamily>(
    dev: &DeviceInfo,
    p: &Problem,
    o: &Overrides,
) -> Result<F::Plan> {
    F::covers(dev, p)?;
    F::plan(dev, p, o)
}

impl CudaBackend {
    /// Runs a family's plan: its params from the common ones, then the launch.
    pub(super) fn forward_with<F: ForwardFamily>(
        &self,
        plan: &F::Plan,
        p: &Problem,
        common: FwdParams,
    ) -> Result<()> {
        let args = F::params(plan, p, common)?;
        self.launch(plan, &args)
    }

    /// Launches a plan's kernel with its one argument: the one launch site of every fa4
    /// kernel. Callers pass params built from a validated problem and buffers checked against
    /// it (the forward's `forward_device_trusted`, decode's `forward_paged_device` and
    /// `append_paged`), and hold the buffers' sync guards past this call.
    pub(super) fn launch<L: Launchable + ?Sized, A: DeviceRepr>(
        &self,
        plan: &L,
        args: &A,
    ) -> Result<()> {
        let l = plan.launch();
        let func = self.kernel(l.kernel)?;
        let cfg = LaunchConfig {
            grid_dim: l.grid,
            block_dim: (l.threads as u32, 1, 1),
            shared_mem_bytes: l.kernel.smem_bytes() as u32,
        };
        let mut launch = self.dev.stream.launch_builder(&func);
        launch.arg(args);
        // SAFETY: `plan` is `Launchable`, so its grid, block and shared memory are the ones its
        // planner sized for this kernel, and each CTA stays inside buffers that were checked
        // against the validated problem (each implementation says why: family/sm80.rs,
        // sm90.rs, sm100.rs, decode.rs). `args` is the kernel's own `#[repr(C)]` params type
        // (size and offsets asserted against its header on both sides), built by the only
        // callers (this module's parent and its decode path) from that problem and those
        // buffers: every buffer holds its layout's extent and is 16-byte aligned, and its sync
        // guard is held by the caller past this launch.
        unsafe { launch.launch(cfg) }
            .map_err(|e| Error::cuda(format!("launch {}", l.kernel), e))?;
        Ok(())
    }
}

/// The TMA description of a tensor of the problem (the Hopper and Blackwell families' maps).
fn map_spec(
    ptr: u64,
    bf16: bool,
    l: &crate::tensor::Layout,
    box_rows: usize,
) -> super::tma::MapSpec {
    super::tma::MapSpec {
        ptr,
        bf16,
        dims: l.dims,
        strides: l.strides,
        box_rows,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::{GpuArch, A100, B200, H200};
    use crate::cuda::Planned;
    use crate::tensor::Layout;
    use crate::{DType, Options};

    fn device(arch: GpuArch, target: &'static str) -> DeviceInfo {
        DeviceInfo {
            ordinal: 0,
            name: arch.name.to_string(),
            compute_capability: arch.compute_capability,
            sm_count: arch.sm_count,
            max_smem_per_block: arch.max_smem_per_block(),
            target,
            arch,
        }
    }

    fn problem(dtype: DType, d: usize) -> Problem {
        let l = Layout::new("q", &[1, 300, 4, d], None).unwrap();
        Problem::new(dtype, &l, &l, &l, &l, None, None, &Options::new().causal()).unwrap()
    }

    #[test]
    fn every_family_plans_as_its_planner_does() {
        let o = Overrides::default();
        let p = problem(DType::Bf16, 128);
        let a100 = device(A100, "sm_80");
        let h200 = device(H200, "sm_90");
        let b200 = device(B200, "sm_100");
        let via = Planned::new(KernelKind::Sm80, &a100, &p, &o).unwrap();
        assert_eq!(
            via,
            Planned::Sm80(sm80_config::plan(&p, &A100, "sm_80", None).unwrap())
        );
        assert_eq!(via.kind(), KernelKind::Sm80);
        let via = Planned::new(KernelKind::Sm90, &h200, &p, &o).unwrap();
        // The Hopper family asks for the architecture-specific target.
        assert_eq!(
            via,
            Planned::Sm90(sm90_config::plan(&p, &H200, "sm_90a", None).unwrap())
        );
        assert_eq!(
            (via.kind(), via.spec().target()),
            (KernelKind::Sm90, "sm_90a")
        );
        let via = Planned::new(KernelKind::Sm100, &b200, &p, &o).unwrap();
        assert_eq!(
            (via.kind(), via.spec().target()),
            (KernelKind::Sm100, "sm_100a")
        );
        let launch = via.launch();
        assert_eq!((launch.grid, launch.threads), (via.grid(), via.threads()));
    }

    #[test]
    fn refusals_name_the_argument() {
        let o = Overrides::default();
        let p = problem(DType::Bf16, 128);
        let a100 = device(A100, "sm_80");
        // The Hopper kernel on an Ampere GPU, the Blackwell kernel off SM100: typed refusals
        // that become errors naming what to change.
        let r = sm90::Sm90::covers(&a100, &p).unwrap_err();
        assert_eq!(r.argument, "device");
        let r = sm100::Sm100::covers(&a100, &p).unwrap_err();
        assert_eq!(r.argument, "--kernel");
        assert!(r.reason.contains("sm_80"), "{}", r.reason);
        match Planned::new(KernelKind::Sm100, &a100, &p, &o) {
            Err(Error::InvalidArgument { name, .. }) => assert_eq!(name, "--kernel"),
            other => panic!("expected a refusal naming --kernel, got {other:?}"),
        }
        let f32_problem = problem(DType::F32, 64);
        let r = sm80::Sm80::covers(&a100, &f32_problem).unwrap_err();
        assert_eq!(r.argument, "dtype");
        match Planned::new(KernelKind::Cpu, &a100, &p, &o) {
            Err(Error::InvalidArgument { name, .. }) => assert_eq!(name, "--kernel"),
            other => panic!("expected an error naming --kernel, got {other:?}"),
        }
    }

    #[test]
    fn the_append_launches_one_cta_per_row() {
        let a = decode::Append::new("sm_90", 5).unwrap();
        let l = a.launch();
        assert_eq!((l.grid, l.kernel.smem_bytes()), ((5, 1, 1), 0));
        // More rows than a grid holds is an error naming the argument, not a truncated grid.
        match decode::Append::new("sm_90", 1 << 33) {
            Err(Error::InvalidArgument { name, .. }) => assert_eq!(name, "cu_new"),
            Err(e) => panic!("expected an error naming cu_new, got {e}"),
            Ok(_) => panic!("2^33 rows launched"),
        }
    }
}
