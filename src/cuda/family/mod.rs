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
    /// The kernel's module (compiled, or loaded from the cache, on first use).
    pub kernel: &'a dyn KernelSource,
    /// The entry point launched: the module's own ([`KernelSource::entry`]) or one of its
    /// [`KernelSource::extra_entries`].
    pub entry: &'static str,
    /// The grid.
    pub grid: (u32, u32, u32),
    /// Threads per CTA.
    pub threads: usize,
    /// Dynamic shared memory, bytes.
    pub smem_bytes: usize,
}

impl<'a> Launch<'a> {
    /// A launch of the module's own entry point with the shared memory its spec sizes.
    pub fn new(kernel: &'a dyn KernelSource, grid: (u32, u32, u32), threads: usize) -> Launch<'a> {
        Launch {
            kernel,
            entry: kernel.entry(),
            grid,
            threads,
            smem_bytes: kernel.smem_bytes(),
        }
    }
}

/// The entry point of the exact fixup kernel that the forward modules with
/// [`KernelSource::exact_fixup`] hold (`kernels/common/exact.cuh`).
pub const EXACT_FIXUP_ENTRY: &str = "fa4_exact_fixup";
/// Its threads per CTA (`EXACT_THREADS` in the header).
pub const EXACT_FIXUP_THREADS: usize = 256;

/// The exact fixup after a forward launch: the second kernel of the forward's module, which
/// recomputes the rows the forward flagged (a no-op when it flagged none).
pub(crate) struct ExactFixup<'a> {
    module: &'a dyn KernelSource,
    blocks: u32,
}

impl<'a> ExactFixup<'a> {
    /// The fixup of the forward kernel `module` over the rows of `params`: one warp per 32 rows
    /// of a (sequence, query head), at most one CTA per SM (the warps loop over the rest; with
    /// the flag clear, the fewer CTAs, the cheaper the launch).
    pub(crate) fn new(
        module: &'a dyn KernelSource,
        params: &FwdParams,
        sm_count: u32,
    ) -> ExactFixup<'a> {
        let rows = (params.seqlen_q.max(0) as u64).div_ceil(32);
        let units = params.batch.max(0) as u64 * params.heads_q.max(0) as u64 * rows;
        let warps = (EXACT_FIXUP_THREADS / 32) as u64;
        let blocks = units.div_ceil(warps).clamp(1, u64::from(sm_count.max(1)));
        ExactFixup {
            module,
            blocks: blocks as u32,
        }
    }
}

// SAFETY: the fixup takes the forward's own common params (a validated problem, buffers checked
// against it). With its module's flag clear every CTA returns at once. Otherwise each warp reads
// the stored O of rows i < q_len of its (sequence, query head), columns < head_dim, and for a row
// holding a NaN reads Q row i, the K and V rows of its allowed keys [key_lo(i), key_hi(i)) (inside
// [0, k_len)) and writes O row i and its LSE entry: the elements the forward itself reads and
// writes. No shared memory; the grid is any positive size (the warps stride over the rows).
unsafe impl Launchable for ExactFixup<'_> {
    fn launch(&self) -> Launch<'_> {
        Launch {
            kernel: self.module,
            entry: EXACT_FIXUP_ENTRY,
            grid: (self.blocks, 1, 1),
            threads: EXACT_FIXUP_THREADS,
            smem_bytes: 0,
        }
    }
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
        let module = plan.launch().kernel;
        if !module.exact_fixup() {
            return self.launch(plan, &args);
        }
        // The forward and its fixup share the module's flag: no other forward of this device may
        // come between them on the stream.
        let _order = self.exact_order();
        self.launch(plan, &args)?;
        self.launch(
            &ExactFixup::new(module, &common, self.info().sm_count),
            &common,
        )
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
        let func = self.kernel_entry(l.kernel, l.entry)?;
        let cfg = LaunchConfig {
            grid_dim: l.grid,
            block_dim: (l.threads as u32, 1, 1),
            shared_mem_bytes: l.smem_bytes as u32,
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
pub(crate) fn map_spec(
    ptr: u64,
    bf16: bool,
    l: &crate::tensor::Layout,
    box_rows: usize,
) -> super::tma::MapSpec {
    super::tma::MapSpec {
        ptr,
        elem: if bf16 {
            super::tma::MapElem::Bf16
        } else {
            super::tma::MapElem::F16
        },
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
    fn forward_modules_carry_the_exact_fixup_and_size_its_grid() {
        let o = Overrides::default();
        let p = problem(DType::Bf16, 128);
        let h200 = device(H200, "sm_90");
        for kind in [KernelKind::Sm80, KernelKind::Sm90] {
            let plan = Planned::new(kind, &h200, &p, &o).unwrap();
            let module = plan.spec();
            assert!(module.exact_fixup(), "{module}");
            assert_eq!(module.extra_entries(), &[EXACT_FIXUP_ENTRY]);
            assert!(module.source().contains(&format!(
                "void __launch_bounds__(EXACT_THREADS) {EXACT_FIXUP_ENTRY}("
            )));
            assert!(module.source().contains(&format!(
                "constexpr int EXACT_THREADS = {EXACT_FIXUP_THREADS};"
            )));
        }
        // Decode and the Blackwell kernel have none.
        let b200 = device(B200, "sm_100");
        let plan = Planned::new(KernelKind::Sm100, &b200, &p, &o).unwrap();
        assert!(!plan.spec().exact_fixup() && plan.spec().extra_entries().is_empty());
        let a = decode::Append::new("sm_90", 5).unwrap();
        assert!(!a.launch().kernel.exact_fixup());
        // One warp per 32 rows of a (sequence, head), 8 warps a CTA, at most one CTA per SM.
        let params = crate::cuda::make_params(&p, [0; 7]);
        let plan = Planned::new(KernelKind::Sm90, &h200, &p, &o).unwrap();
        let fixup = ExactFixup::new(plan.spec(), &params, 132);
        let l = fixup.launch();
        // 300 rows → 10 units per head, 4 heads: 40 warps, 5 CTAs.
        assert_eq!(
            (l.grid, l.threads, l.smem_bytes, l.entry),
            ((5, 1, 1), 256, 0, EXACT_FIXUP_ENTRY)
        );
        let big = Problem::new(
            DType::Bf16,
            &Layout::new("q", &[8, 4096, 32, 128], None).unwrap(),
            &Layout::new("k", &[8, 4096, 32, 128], None).unwrap(),
            &Layout::new("v", &[8, 4096, 32, 128], None).unwrap(),
            &Layout::new("out", &[8, 4096, 32, 128], None).unwrap(),
            None,
            None,
            &Options::new(),
        )
        .unwrap();
        let params = crate::cuda::make_params(&big, [0; 7]);
        assert_eq!(
            ExactFixup::new(plan.spec(), &params, 132).launch().grid,
            (132, 1, 1)
        );
        // An empty problem still launches one CTA (the forward returns before either launch).
        let empty = crate::cuda::params::FwdParams::default();
        assert_eq!(
            ExactFixup::new(plan.spec(), &empty, 132).launch().grid,
            (1, 1, 1)
        );
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
