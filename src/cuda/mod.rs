//! The CUDA backend: device discovery, device buffers, run-time compiled kernels, launches.
//!
//! Built on cudarc with dynamic loading: the crate builds with no CUDA installed, and at run
//! time a missing driver or NVRTC is an [`Error::CudaUnavailable`] naming what was looked for.
//! Kernels are compiled by NVRTC for the device's exact architecture on first use (see
//! [`compile`]) and kept in memory per kernel spec ([`crate::config::sm80::KernelSpec`],
//! [`crate::config::sm90::KernelSpec`]) and on disk across runs. [`CudaBackend::plan`] picks the
//! kernel family ([`KernelChoice`]; on Hopper GPUs `config::sm90::dispatch` decides).
//!
//! Host slices go in and out through [`CudaBackend::forward_host`] (what [`crate::Backend`]
//! uses); callers who keep data on the GPU use [`CudaBackend::forward_device`] with
//! `CudaSlice`s from [`CudaBackend::upload`] or [`CudaBackend::alloc`].

pub mod backward;
pub mod bench;
pub mod compile;
pub mod decode;
mod external;
mod libs;
pub(crate) mod params;
mod tma;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr,
    LaunchConfig, PushKernelArg,
};

use crate::arch::{self, ComputeCapability, Family, GpuArch};
use crate::config::sm80::{self, Tiles};
use crate::config::{sm100_kernel, sm90, KernelKind};
use crate::error::{Error, Result};
use crate::problem::Problem;
use crate::tensor::{Element, Layout};
use compile::KernelSource;
use params::FwdParams;

/// What the live device reports, and the description planners use for it.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    /// Device ordinal.
    pub ordinal: usize,
    /// The driver's name for it.
    pub name: String,
    /// Compute capability.
    pub compute_capability: ComputeCapability,
    /// Streaming multiprocessors.
    pub sm_count: u32,
    /// The largest dynamic shared memory a block may opt into, bytes.
    pub max_smem_per_block: u32,
    /// The NVRTC target the kernels are compiled for (`sm_90`, …).
    pub target: &'static str,
    /// The planning description: the closest described part, with the live limits.
    pub arch: GpuArch,
}

fn target_for(cc: ComputeCapability) -> &'static str {
    match (cc.major, cc.minor) {
        (8, 0) => "sm_80",
        (8, 6) => "sm_86",
        (8, 7) => "sm_87",
        (8, 9) => "sm_89",
        (9, 0) => "sm_90",
        (10, 0) => "sm_100",
        (10, 3) => "sm_103",
        (12, 0) => "sm_120",
        (12, 1) => "sm_121",
        _ => "",
    }
}

/// A device, its stream and its compiled kernels. Shared by clones of a [`CudaBackend`].
struct Device {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    info: DeviceInfo,
    /// Loaded kernels by their spec's `Debug` form (which names every specialisation).
    kernels: Mutex<HashMap<String, CudaFunction>>,
}

/// Which kernel family runs a problem on the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KernelChoice {
    /// What [`sm90::dispatch`] picks: the Hopper kernel where it is enabled and covers the
    /// problem, else the Ampere-class kernel.
    #[default]
    Auto,
    /// The Ampere-class `mma.sync` kernel.
    Sm80,
    /// The Hopper kernel (an error where it does not cover the problem or the GPU).
    Sm90,
    /// The Blackwell kernel FA4Config plans (SM100 GPUs only; not yet run on hardware).
    Sm100,
}

impl KernelChoice {
    /// The choice `FA4_KERNEL` names (`auto`, `sm80`, `sm90`, `sm100`), `Auto` when unset, or an
    /// error naming the variable.
    pub fn from_env() -> Result<KernelChoice> {
        match std::env::var("FA4_KERNEL") {
            Err(std::env::VarError::NotPresent) => Ok(KernelChoice::Auto),
            Ok(v) => match v.as_str() {
                "" | "auto" => Ok(KernelChoice::Auto),
                "sm80" => Ok(KernelChoice::Sm80),
                "sm90" => Ok(KernelChoice::Sm90),
                "sm100" => Ok(KernelChoice::Sm100),
                other => Err(Error::invalid(
                    "FA4_KERNEL",
                    format!("expected auto, sm80, sm90 or sm100, got `{other}`"),
                )),
            },
            Err(e) => Err(Error::invalid("FA4_KERNEL", e.to_string())),
        }
    }
}

/// A planned launch: which kernel, its spec and grid.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Planned {
    /// The Ampere-class kernel.
    Sm80(sm80::Plan),
    /// The Hopper kernel.
    Sm90(sm90::Plan),
    /// The Blackwell kernel (not yet run on hardware).
    Sm100(sm100_kernel::Plan),
}

impl Planned {
    /// The kernel family.
    pub fn kind(&self) -> KernelKind {
        match self {
            Planned::Sm80(_) => KernelKind::Sm80,
            Planned::Sm90(_) => KernelKind::Sm90,
            Planned::Sm100(_) => KernelKind::Sm100,
        }
    }

    /// The kernel to compile: the family's spec, behind the one interface NVRTC needs.
    pub fn spec(&self) -> &dyn KernelSource {
        match self {
            Planned::Sm80(p) => &p.spec,
            Planned::Sm90(p) => &p.spec,
            Planned::Sm100(p) => &p.spec,
        }
    }

    /// The launch grid.
    pub fn grid(&self) -> (u32, u32, u32) {
        match self {
            Planned::Sm80(p) => p.grid,
            Planned::Sm90(p) => p.grid,
            Planned::Sm100(p) => p.grid,
        }
    }

    /// Threads per CTA.
    pub fn threads(&self) -> usize {
        match self {
            Planned::Sm80(p) => p.spec.threads(),
            Planned::Sm90(p) => p.spec.threads(),
            Planned::Sm100(p) => p.spec.threads(),
        }
    }
}

impl std::fmt::Display for Planned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.spec())
    }
}

/// The CUDA backend on one device. Cheap to clone.
#[derive(Clone)]
pub struct CudaBackend {
    dev: Arc<Device>,
    tiles: Option<Tiles>,
    sm90_tiles: Option<sm90::Tiles>,
    choice: KernelChoice,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("device", &self.dev.info)
            .field("tiles", &self.tiles)
            .field("sm90_tiles", &self.sm90_tiles)
            .field("choice", &self.choice)
            .finish()
    }
}

impl CudaBackend {
    /// Opens device `ordinal`. Errors say which library or device was missing.
    pub fn new(ordinal: usize) -> Result<Self> {
        libs::driver()?;
        let count = CudaContext::device_count().map_err(|e| Error::cuda("cuDeviceGetCount", e))?;
        if ordinal >= count.max(0) as usize {
            return Err(Error::invalid(
                "device",
                format!("CUDA device {ordinal} requested, {count} present"),
            ));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| Error::cuda("cuCtxCreate", e))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| Error::cuda("compute capability", e))?;
        let cc = ComputeCapability {
            major: major as u32,
            minor: minor as u32,
        };
        if cc.major < 8 {
            return Err(Error::invalid(
                "device",
                format!("{cc} is older than sm_80; fa4's kernels need Ampere or newer"),
            ));
        }
        let attr = |a: CUdevice_attribute, what: &str| {
            ctx.attribute(a)
                .map_err(|e| Error::cuda(what, e))
                .map(|v| v.max(0) as u32)
        };
        let sm_count = attr(
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            "SM count",
        )?;
        let max_smem = attr(
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            "shared memory per block",
        )?;
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let family = match cc.major {
            8 => Family::Ampere,
            9 => Family::Hopper,
            10 | 11 => Family::Blackwell,
            _ => Family::ConsumerBlackwell,
        };
        let base = arch::ALL
            .into_iter()
            .find(|a| a.compute_capability == cc)
            .unwrap_or(arch::A100);
        // Live limits win over the description: the planner sees what this device has.
        let arch = GpuArch {
            family,
            compute_capability: cc,
            sm_count,
            smem_per_sm: max_smem + base.smem_reserved_per_block,
            ..base
        };
        let mut target = target_for(cc);
        if target.is_empty() {
            // A part newer than this build knows: its own name is the best guess for NVRTC.
            target = Box::leak(format!("sm_{}{}", cc.major, cc.minor).into_boxed_str());
        }
        // SAFETY: fa4 orders every operation of a backend on its one stream, so cudarc's
        // per-buffer cross-stream events are not needed (and would add work to every launch).
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        Ok(CudaBackend {
            dev: Arc::new(Device {
                ctx,
                stream,
                info: DeviceInfo {
                    ordinal,
                    name,
                    compute_capability: cc,
                    sm_count,
                    max_smem_per_block: max_smem,
                    target,
                    arch,
                },
                kernels: Mutex::new(HashMap::new()),
            }),
            tiles: None,
            sm90_tiles: None,
            choice: KernelChoice::from_env()?,
        })
    }

    /// The same device with the planner's tile choice replaced by `tiles` (for benchmarks and
    /// tuning; each launch still checks the tiles against the kernel and the GPU).
    pub fn with_tiles(&self, tiles: Option<Tiles>) -> CudaBackend {
        CudaBackend {
            tiles,
            ..self.clone()
        }
    }

    /// The same device with the Hopper planner's tile choice replaced by `tiles`.
    pub fn with_sm90_tiles(&self, tiles: Option<sm90::Tiles>) -> CudaBackend {
        CudaBackend {
            sm90_tiles: tiles,
            ..self.clone()
        }
    }

    /// The same device with the kernel family chosen by `choice`.
    pub fn with_kernel(&self, choice: KernelChoice) -> CudaBackend {
        CudaBackend {
            choice,
            ..self.clone()
        }
    }

    /// The device.
    pub fn info(&self) -> &DeviceInfo {
        &self.dev.info
    }

    /// The stream every operation of this backend is ordered on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.dev.stream
    }

    /// Copies a host slice to a new device buffer.
    pub fn upload<T: Element>(&self, host: &[T]) -> Result<CudaSlice<T>> {
        self.dev
            .stream
            .clone_htod(host)
            .map_err(|e| Error::cuda("upload", e))
    }

    /// A zeroed device buffer of `len` elements.
    pub fn alloc<T: Element>(&self, len: usize) -> Result<CudaSlice<T>> {
        self.dev
            .stream
            .alloc_zeros(len)
            .map_err(|e| Error::cuda("alloc", e))
    }

    /// Copies int32 offsets (`cu_seqlens`) to the device.
    pub fn upload_i32(&self, host: &[i32]) -> Result<CudaSlice<i32>> {
        self.dev
            .stream
            .clone_htod(host)
            .map_err(|e| Error::cuda("upload", e))
    }

    /// The CUDA context (for events and advanced use).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.dev.ctx
    }

    /// Copies a device buffer back (waits for the stream).
    pub fn download<T: Element>(&self, dev: &CudaSlice<T>) -> Result<Vec<T>> {
        self.dev
            .stream
            .clone_dtoh(dev)
            .map_err(|e| Error::cuda("download", e))
    }

    /// Waits for all work on the stream.
    pub fn synchronize(&self) -> Result<()> {
        self.dev
            .stream
            .synchronize()
            .map_err(|e| Error::cuda("synchronize", e))
    }

    /// Plans a problem for this device, or says why it cannot run here.
    pub fn plan(&self, p: &Problem) -> Result<Planned> {
        let info = &self.dev.info;
        let hopper = match self.choice {
            KernelChoice::Sm100 => {
                if info.target != "sm_100" {
                    return Err(Error::invalid(
                        "--kernel",
                        format!(
                            "sm100 runs on SM100 (B200-class) GPUs; this is {} ({})",
                            info.name, info.target
                        ),
                    ));
                }
                let mut plan = sm100_kernel::plan(p, &info.arch)?;
                plan.spec.target = "sm_100a";
                return Ok(Planned::Sm100(plan));
            }
            KernelChoice::Sm80 => false,
            KernelChoice::Sm90 => true,
            KernelChoice::Auto => {
                sm90::dispatch(&info.arch, sm90::features(p)).kernel == KernelKind::Sm90
            }
        };
        if hopper {
            // wgmma and setmaxnreg need the architecture-specific target.
            let target = match info.target {
                "sm_90" => "sm_90a",
                other => other,
            };
            sm90::plan(p, &info.arch, target, self.sm90_tiles).map(Planned::Sm90)
        } else {
            sm80::plan(p, &info.arch, info.target, self.tiles).map(Planned::Sm80)
        }
    }

    /// Compiles (or loads from the cache) the kernel of a plan, ahead of its first launch.
    pub fn prepare(&self, plan: &Planned) -> Result<()> {
        self.kernel(plan.spec()).map(drop)
    }

    /// The loaded kernel of a spec: compiled (or read from the disk cache) on first use.
    pub fn kernel<S: KernelSource + ?Sized>(&self, spec: &S) -> Result<CudaFunction> {
        let key = format!("{}:{spec:?}", spec.entry());
        let mut kernels = self.dev.kernels.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = kernels.get(&key) {
            return Ok(f.clone());
        }
        let compiled = compile::compile(spec)?;
        let module = self
            .dev
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(compiled.cubin))
            .map_err(|e| Error::cuda(format!("loading {spec}"), e))?;
        let f = module
            .load_function(spec.entry())
            .map_err(|e| Error::cuda("cuModuleGetFunction", e))?;
        f.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            spec.smem_bytes() as i32,
        )
        .map_err(|e| Error::cuda("setting the shared-memory limit", e))?;
        kernels.insert(key, f.clone());
        Ok(f)
    }

    /// Runs a validated problem on device buffers laid out as it says. `cu_seqlens` (varlen
    /// problems only) are the problem's offsets as int32 device buffers: the kernels place every
    /// row by them, so they are read back and compared with the problem's first (a varlen call
    /// waits for the stream once for that). Otherwise asynchronous on [`CudaBackend::stream`].
    #[allow(clippy::too_many_arguments)]
    pub fn forward_device<T: Element>(
        &self,
        p: &Problem,
        q: &CudaSlice<T>,
        k: &CudaSlice<T>,
        v: &CudaSlice<T>,
        cu_seqlens: Option<(&CudaSlice<i32>, &CudaSlice<i32>)>,
        out: &mut CudaSlice<T>,
        lse: Option<&mut CudaSlice<f32>>,
    ) -> Result<()> {
        if let (true, Some((cq, ck))) = (p.is_varlen(), cu_seqlens) {
            let (want_q, want_k) = offsets(p);
            let checks = [("cu_seqlens_q", cq, want_q), ("cu_seqlens_k", ck, want_k)];
            // Wrong lengths are named by the trusted path's check.
            if checks.iter().all(|(_, dev, want)| dev.len() == want.len()) {
                let mut got = [vec![0i32; cq.len()], vec![0i32; ck.len()]];
                for ((name, dev, _), host) in checks.iter().zip(&mut got) {
                    self.dev
                        .stream
                        .memcpy_dtoh(*dev, host)
                        .map_err(|e| Error::cuda(format!("reading {name} back"), e))?;
                }
                self.synchronize()?;
                for ((name, _, want), got) in checks.iter().zip(&got) {
                    if got != want {
                        return Err(Error::invalid(
                            *name,
                            format!("the device buffer holds {got:?}, the problem was validated with {want:?}"),
                        ));
                    }
                }
            }
        }
        self.forward_device_trusted(p, q, k, v, cu_seqlens, out, lse)
    }

    /// [`CudaBackend::forward_device`] with `cu_seqlens` the caller uploaded itself from the
    /// problem's offsets ([`offsets`]), so not read back.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward_device_trusted<T: Element>(
        &self,
        p: &Problem,
        q: &impl DevicePtr<T>,
        k: &impl DevicePtr<T>,
        v: &impl DevicePtr<T>,
        cu_seqlens: Option<(&impl DevicePtr<i32>, &impl DevicePtr<i32>)>,
        out: &mut impl DevicePtrMut<T>,
        lse: Option<&mut impl DevicePtrMut<f32>>,
    ) -> Result<()> {
        p.check_buffers(
            T::DTYPE,
            q.len(),
            k.len(),
            v.len(),
            out.len(),
            lse.as_deref().map(|l| l.len()),
        )?;
        let batch = p.sequences().len();
        match (p.is_varlen(), cu_seqlens) {
            (true, Some((cq, ck))) if cq.len() == batch + 1 && ck.len() == batch + 1 => {}
            (true, _) => {
                return Err(Error::invalid(
                    "cu_seqlens_q",
                    format!(
                        "a varlen problem needs both cu_seqlens on the device, {} entries each",
                        batch + 1
                    ),
                ))
            }
            (false, Some(_)) => {
                return Err(Error::invalid(
                    "cu_seqlens_q",
                    "given for a fixed-length problem",
                ))
            }
            (false, None) => {}
        }
        let plan = self.plan(p)?;
        let grid = plan.grid();
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 || batch == 0 {
            return Ok(());
        }
        let stream = &self.dev.stream;

        let (q_ptr, _q_sync) = q.device_ptr(stream);
        let (k_ptr, _k_sync) = k.device_ptr(stream);
        let (v_ptr, _v_sync) = v.device_ptr(stream);
        let (o_ptr, _o_sync) = out.device_ptr_mut(stream);
        let (lse_ptr, _lse_sync) = match lse {
            Some(l) => {
                let (ptr, sync) = l.device_ptr_mut(stream);
                (ptr, Some(sync))
            }
            None => (0, None),
        };
        let (cq_ptr, ck_ptr, _cu_sync) = match cu_seqlens {
            Some((cq, ck)) => {
                // The kernel reads batch + 1 entries of each (checked above).
                let (a, sa) = cq.device_ptr(stream);
                let (b, sb) = ck.device_ptr(stream);
                (a, b, Some((sa, sb)))
            }
            None => (0, 0, None),
        };
        for (name, ptr) in [("q", q_ptr), ("k", k_ptr), ("v", v_ptr), ("out", o_ptr)] {
            if ptr % 16 != 0 {
                return Err(Error::invalid(
                    name,
                    "device buffer must be 16-byte aligned",
                ));
            }
        }
        let params = make_params(p, [q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, cq_ptr, ck_ptr]);
        match &plan {
            Planned::Sm80(_) => self.launch(&plan, &params),
            Planned::Sm90(sm90_plan) => {
                let t = &sm90_plan.spec.tiles;
                let bf16 = sm90_plan.spec.bf16;
                // A map per tensor over its whole layout: per batch entry for fixed-length
                // batches, the packed rows of every sequence for varlen ones.
                let map = |name: &str, ptr: u64, l: &Layout, box_rows: usize| {
                    tma::encode(
                        name,
                        &tma::MapSpec {
                            ptr,
                            bf16,
                            dims: l.dims,
                            strides: l.strides,
                            box_rows,
                        },
                    )
                };
                let sp = params::Sm90Params {
                    tq: map("q", q_ptr, p.q_layout(), t.block_m())?,
                    tk: map("k", k_ptr, p.k_layout(), t.block_n)?,
                    tv: map("v", v_ptr, p.v_layout(), t.block_n)?,
                    p: params,
                };
                self.launch(&plan, &sp)
            }
            Planned::Sm100(sm100_plan) => {
                let bf16 = sm100_plan.spec.bf16;
                let map = |name: &str, ptr: u64, l: &Layout, box_rows: usize| {
                    tma::encode_slabs(
                        name,
                        &tma::MapSpec {
                            ptr,
                            bf16,
                            dims: l.dims,
                            strides: l.strides,
                            box_rows,
                        },
                    )
                };
                let cfg = &sm100_plan.spec.cfg;
                // The kernel takes the Hopper params' layout (three maps, then FwdParams).
                let sp = params::Sm90Params {
                    tq: map("q", q_ptr, p.q_layout(), cfg.mma_m() as usize)?,
                    tk: map("k", k_ptr, p.k_layout(), cfg.bn() as usize)?,
                    tv: map("v", v_ptr, p.v_layout(), cfg.bn() as usize)?,
                    p: params,
                };
                self.launch(&plan, &sp)
            }
        }
    }

    /// Launches a plan's kernel with its one params argument: the one launch site of every
    /// family. The caller built `args` from a validated problem and buffers checked against it
    /// (see the SAFETY comment).
    fn launch<A: DeviceRepr>(&self, plan: &Planned, args: &A) -> Result<()> {
        let spec = plan.spec();
        let func = self.kernel(spec)?;
        let cfg = LaunchConfig {
            grid_dim: plan.grid(),
            block_dim: (plan.threads() as u32, 1, 1),
            shared_mem_bytes: spec.smem_bytes() as u32,
        };
        let mut launch = self.dev.stream.launch_builder(&func);
        launch.arg(args);
        // SAFETY: `forward_device_trusted` is the only caller. The problem was validated (shapes,
        // strides, non-overlapping output, cu_seqlens equal to the problem's offsets, which run
        // from 0 non-decreasing to the totals: read back by forward_device, uploaded from them
        // by the crate's own callers); every buffer was checked to hold the layout's extent and
        // to be 16-byte aligned, and its sync guard is held by the caller past this launch. The
        // family's planner sized the grid, block and shared memory of this spec, and the kernel
        // static_asserts the same shared-memory count and the params size.
        // - sm80: the planner checked the head dim and every stride against the kernel's
        //   16-byte copies.
        // - sm90: the planner accepted only head_dim 64/128/256 and 16-byte strides below 2^40;
        //   the TMA maps describe exactly the layouts' extents (reads past the end are
        //   zero-filled by the hardware, not performed), and the output is written only at rows
        //   below each sequence's length and columns below head_dim (a varlen batch's foreign
        //   rows are read, masked and their V zeroed, never written). The grid is one CTA per
        //   tile or, persistent, at most one per SM; the kernel numbers the tiles from the
        //   params (the planner checked that they fit in int32) and visits each exactly once
        //   (`config::sm90::schedule` mirrors the walk and tests it). The planner's register
        //   split fits the CTA's launch allocation, so `setmaxnreg` cannot wait forever.
        unsafe { launch.launch(cfg) }.map_err(|e| Error::cuda(format!("launch {spec}"), e))?;
        Ok(())
    }

    /// Runs a validated problem on host slices: copies in, launches, copies out, waits.
    pub fn forward_host<T: Element>(
        &self,
        p: &Problem,
        q: &[T],
        k: &[T],
        v: &[T],
        out: &mut [T],
        lse: Option<&mut [f32]>,
    ) -> Result<()> {
        // Plan first, so an unsupported problem costs no copies.
        self.plan(p)?;
        let extent = |l: &Layout| l.extent().unwrap_or(0).max(1);
        let dq = self.upload(&q[..extent(p.q_layout()).min(q.len())])?;
        let dk = self.upload(&k[..extent(p.k_layout()).min(k.len())])?;
        let dv = self.upload(&v[..extent(p.v_layout()).min(v.len())])?;
        let on = extent(p.o_layout()).min(out.len());
        // The output is uploaded too: elements between strided rows must survive.
        let mut dout = self.upload(&out[..on])?;
        let mut dlse = match &lse {
            Some(l) => Some(self.upload::<f32>(l)?),
            None => None,
        };
        let cu = if p.is_varlen() {
            let (cq, ck) = offsets(p);
            Some((self.upload_i32(&cq)?, self.upload_i32(&ck)?))
        } else {
            None
        };
        self.forward_device_trusted(
            p,
            &dq,
            &dk,
            &dv,
            cu.as_ref().map(|(a, b)| (a, b)),
            &mut dout,
            dlse.as_mut(),
        )?;
        self.dev
            .stream
            .memcpy_dtoh(&dout, &mut out[..on])
            .map_err(|e| Error::cuda("download out", e))?;
        if let (Some(l), Some(d)) = (lse, dlse) {
            self.dev
                .stream
                .memcpy_dtoh(&d, l)
                .map_err(|e| Error::cuda("download lse", e))?;
        }
        self.synchronize()
    }
}

/// `cu_seqlens_q`, `cu_seqlens_k` of a varlen problem.
pub(crate) fn offsets(p: &Problem) -> (Vec<i32>, Vec<i32>) {
    let seqs = p.sequences();
    let mut cq: Vec<i32> = seqs.iter().map(|s| s.q_start as i32).collect();
    let mut ck: Vec<i32> = seqs.iter().map(|s| s.k_start as i32).collect();
    cq.push(seqs.last().map_or(0, |s| (s.q_start + s.q_len) as i32));
    ck.push(seqs.last().map_or(0, |s| (s.k_start + s.k_len) as i32));
    (cq, ck)
}

/// The kernel parameters of a validated problem and its buffers' device addresses
/// (`[q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k]`, 0 = absent).
pub(crate) fn make_params(p: &Problem, ptrs: [u64; 7]) -> FwdParams {
    let i = |x: usize| x as i64;
    let (q, k, v, o) = (p.q_layout(), p.k_layout(), p.v_layout(), p.o_layout());
    let (left, right) = p.mask().bounds();
    // A side at least as long as a sequence's queries plus keys bounds nothing: pass it as
    // unbounded (-1), so the kernels' int32 bound arithmetic cannot overflow on huge windows.
    let span = p
        .sequences()
        .iter()
        .map(|s| s.q_len + s.k_len)
        .max()
        .unwrap_or(0);
    let side = |b: Option<usize>| match b {
        Some(x) if x < span => x.min(i32::MAX as usize) as i32,
        _ => -1,
    };
    let scale = p.scale();
    let (scale_log2, softcap_scale, softcap) = match p.softcap() {
        Some(c) => (std::f32::consts::LOG2_E, scale.abs() / c, c),
        None => (scale.abs() * std::f32::consts::LOG2_E, 0.0, 0.0),
    };
    // Fixed-length batches: every sequence's lengths. Varlen: the longest (the Hopper kernel
    // sizes its tile walk by them; each sequence's come from cu_seqlens).
    let longest = |f: fn(&crate::problem::Sequence) -> usize| {
        p.sequences().iter().map(f).max().unwrap_or(0) as i32
    };
    let (lse_batch_stride, lse_head_stride) = p.lse_strides();
    FwdParams {
        q: ptrs[0],
        k: ptrs[1],
        v: ptrs[2],
        o: ptrs[3],
        lse: ptrs[4],
        cu_seqlens_q: ptrs[5],
        cu_seqlens_k: ptrs[6],
        q_batch_stride: i(q.strides[0]),
        q_row_stride: i(q.strides[1]),
        q_head_stride: i(q.strides[2]),
        k_batch_stride: i(k.strides[0]),
        k_row_stride: i(k.strides[1]),
        k_head_stride: i(k.strides[2]),
        v_batch_stride: i(v.strides[0]),
        v_row_stride: i(v.strides[1]),
        v_head_stride: i(v.strides[2]),
        o_batch_stride: i(o.strides[0]),
        o_row_stride: i(o.strides[1]),
        o_head_stride: i(o.strides[2]),
        lse_batch_stride: i(lse_batch_stride),
        lse_head_stride: i(lse_head_stride),
        batch: p.sequences().len() as i32,
        heads_q: p.heads_q() as i32,
        group: p.group() as i32,
        seqlen_q: longest(|s| s.q_len),
        seqlen_k: longest(|s| s.k_len),
        head_dim: p.head_dim() as i32,
        window_left: side(left),
        window_right: side(right),
        negate_q: i32::from(scale < 0.0),
        pad0: 0,
        scale_log2,
        softcap_scale,
        softcap,
        lse_scale: scale_log2 * std::f32::consts::LN_2,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DType, Mask, Options};

    #[test]
    fn huge_window_sides_are_passed_as_unbounded() {
        let l = Layout::new("q", &[1, 40, 2, 64], None).unwrap();
        let opts = Options::new().mask(Mask::Window {
            left: Some(usize::MAX),
            right: Some(3),
        });
        let p = Problem::new(DType::Bf16, &l, &l, &l, &l, None, None, &opts).unwrap();
        let params = make_params(&p, [0; 7]);
        assert_eq!((params.window_left, params.window_right), (-1, 3));
        let opts = Options::new().mask(Mask::Window {
            left: Some(79),
            right: Some(80),
        });
        let p = Problem::new(DType::Bf16, &l, &l, &l, &l, None, None, &opts).unwrap();
        let params = make_params(&p, [0; 7]);
        assert_eq!((params.window_left, params.window_right), (79, -1));
    }
}
