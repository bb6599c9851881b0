//! The CUDA backend: device discovery, device buffers, run-time compiled kernels, launches.
//!
//! Built on cudarc with dynamic loading: the crate builds with no CUDA installed, and at run
//! time a missing driver or NVRTC is an [`Error::CudaUnavailable`] naming what was looked for.
//! Kernels are compiled by NVRTC for the device's exact architecture on first use (see
//! [`compile`]) and kept in memory per kernel spec ([`crate::config::sm80::KernelSpec`],
//! [`crate::config::sm90::KernelSpec`]) and on disk across runs. [`CudaBackend::plan`] picks the
//! kernel family ([`KernelChoice`]; on Hopper GPUs `config::sm90::dispatch` decides). Each
//! family implements one trait ([`family::ForwardFamily`]: coverage, plan, params) and is
//! registered on one line of `families!` below; every kernel, decode's included, is launched at
//! one site ([`family`]'s `CudaBackend::launch`).
//!
//! Host slices go in and out through [`CudaBackend::forward_host`] (what [`crate::Backend`]
//! uses); callers who keep data on the GPU use [`CudaBackend::forward_device`] with
//! `CudaSlice`s from [`CudaBackend::upload`] or [`CudaBackend::alloc`].

pub mod backward;
pub mod backward_sm90;
pub mod bench;
pub mod compile;
pub mod decode;
mod external;
pub mod fp8;
pub use external::ForeignBuffer;
pub mod family;
mod libs;
pub(crate) mod params;
mod tma;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};

use crate::arch::{self, ComputeCapability, Family, GpuArch};
use crate::config::sm80::Tiles;
use crate::config::{sm90, KernelKind};
use crate::error::{Error, Result};
use crate::problem::Problem;
use crate::tensor::{Element, Layout};
use compile::KernelSource;
use family::{ForwardFamily, Launchable, Overrides};
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
    /// Loaded kernels by entry point and their spec's `Debug` form (which names every
    /// specialisation).
    kernels: Mutex<HashMap<String, CudaFunction>>,
    /// Held from a forward's launch to its exact fixup's (`family::ExactFixup`), which share
    /// their module's flag.
    exact_order: Mutex<()>,
    /// Varlen offsets uploaded by the `*_views` entry points, by content: a model calls every
    /// layer with the same batch, and a reused upload keeps those calls free of host-to-device
    /// copies (which a CUDA graph could not capture from pageable memory).
    offsets: Mutex<OffsetCache>,
}

/// `(cu_seqlens_q, cu_seqlens_k)` on the device.
pub(crate) type DeviceOffsets = Arc<(CudaSlice<i32>, CudaSlice<i32>)>;

/// Device copies of `(cu_seqlens_q, cu_seqlens_k)`, at most [`OffsetCache::CAP`] pairs.
#[derive(Default)]
struct OffsetCache {
    entries: Vec<(Vec<i32>, Vec<i32>, DeviceOffsets)>,
}

impl OffsetCache {
    /// Distinct batches kept; the oldest is dropped first (its buffers are freed in stream
    /// order, after the calls that read them).
    const CAP: usize = 16;
}

/// Whether the driver library was found (then a driver call may describe its errors).
pub(crate) fn driver_loaded() -> bool {
    libs::driver().is_ok()
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

impl KernelChoice {
    /// The family this choice runs `p` on: a forced one, or on `Auto` what
    /// [`sm90::dispatch`] picks (its `cpu` verdict goes to the sm80 planner, whose error says
    /// why no CUDA kernel runs the problem).
    fn kind(self, arch: &arch::GpuArch, p: &Problem) -> KernelKind {
        match self {
            KernelChoice::Sm80 => KernelKind::Sm80,
            KernelChoice::Sm90 => KernelKind::Sm90,
            KernelChoice::Sm100 => KernelKind::Sm100,
            KernelChoice::Auto => match sm90::dispatch(arch, sm90::features(p)).kernel {
                KernelKind::Sm90 => KernelKind::Sm90,
                _ => KernelKind::Sm80,
            },
        }
    }
}

/// The forward kernel families, one line each: the [`KernelKind`] a family answers to and the
/// type implementing [`ForwardFamily`] (`family/*.rs`). Generates [`Planned`], one variant per
/// family holding its plan, and the dispatch from a kind to the family's planner and launch.
macro_rules! families {
    ($($kind:ident => $family:ty,)+) => {
        /// A planned launch: which kernel family, and its plan (spec and grid).
        #[derive(Debug, Clone, PartialEq, Eq)]
        pub enum Planned {
            $(
                #[doc = concat!("The `", stringify!($kind), "` family's plan.")]
                $kind(<$family as ForwardFamily>::Plan),
            )+
        }

        impl Planned {
            /// Plans `p` on the family of `kind`: its coverage first (a refusal names the
            /// argument), then its planner.
            fn new(kind: KernelKind, dev: &DeviceInfo, p: &Problem, o: &Overrides) -> Result<Planned> {
                match kind {
                    $(KernelKind::$kind => family::plan::<$family>(dev, p, o).map(Planned::$kind),)+
                    #[allow(unreachable_patterns)]
                    other => Err(Error::invalid("--kernel", format!("{other} is not a CUDA kernel family"))),
                }
            }

            /// The kernel family.
            pub fn kind(&self) -> KernelKind {
                match self {
                    $(Planned::$kind(_) => <$family as ForwardFamily>::KIND,)+
                }
            }

            /// The kernel, grid and threads of the launch.
            fn launch(&self) -> family::Launch<'_> {
                match self {
                    $(Planned::$kind(plan) => plan.launch(),)+
                }
            }

            /// Builds the family's params from the common ones and launches.
            fn run(&self, backend: &CudaBackend, p: &Problem, common: FwdParams) -> Result<()> {
                match self {
                    $(Planned::$kind(plan) => backend.forward_with::<$family>(plan, p, common),)+
                }
            }
        }
    };
}

families! {
    Sm80 => family::sm80::Sm80,
    Sm90 => family::sm90::Sm90,
    Sm100 => family::sm100::Sm100,
}

impl Planned {
    /// The kernel to compile: the family's spec, behind the one interface NVRTC needs.
    pub fn spec(&self) -> &dyn KernelSource {
        self.launch().kernel
    }

    /// The launch grid.
    pub fn grid(&self) -> (u32, u32, u32) {
        self.launch().grid
    }

    /// Threads per CTA.
    pub fn threads(&self) -> usize {
        self.launch().threads
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
    overrides: Overrides,
    choice: KernelChoice,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("device", &self.dev.info)
            .field("overrides", &self.overrides)
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
                exact_order: Mutex::new(()),
                offsets: Mutex::new(OffsetCache::default()),
            }),
            overrides: Overrides::default(),
            choice: KernelChoice::from_env()?,
        })
    }

    /// The same device with the planner's tile choice replaced by `tiles` (for benchmarks and
    /// tuning; each launch still checks the tiles against the kernel and the GPU).
    pub fn with_tiles(&self, tiles: Option<Tiles>) -> CudaBackend {
        CudaBackend {
            overrides: Overrides {
                sm80: tiles,
                ..self.overrides
            },
            ..self.clone()
        }
    }

    /// The same device with the Hopper planner's tile choice replaced by `tiles`.
    pub fn with_sm90_tiles(&self, tiles: Option<sm90::Tiles>) -> CudaBackend {
        CudaBackend {
            overrides: Overrides {
                sm90: tiles,
                ..self.overrides
            },
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
        Planned::new(self.choice.kind(&info.arch, p), info, p, &self.overrides)
    }

    /// Compiles (or loads from the cache) the kernel of a plan, ahead of its first launch.
    pub fn prepare(&self, plan: &Planned) -> Result<()> {
        self.kernel(plan.spec()).map(drop)
    }

    /// Held between a forward launch and its exact fixup's.
    fn exact_order(&self) -> std::sync::MutexGuard<'_, ()> {
        self.dev
            .exact_order
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// The loaded kernel of a spec: compiled (or read from the disk cache) on first use.
    pub fn kernel<S: KernelSource + ?Sized>(&self, spec: &S) -> Result<CudaFunction> {
        self.kernel_entry(spec, spec.entry())
    }

    /// Entry point `entry` of a spec's module (its own or one of its extra entries). A module is
    /// loaded once, with all its entries: they share its globals (the exact fixup's flag).
    pub fn kernel_entry<S: KernelSource + ?Sized>(
        &self,
        spec: &S,
        entry: &str,
    ) -> Result<CudaFunction> {
        let key = |e: &str| format!("{e}:{spec:?}");
        let mut kernels = self.dev.kernels.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = kernels.get(&key(entry)) {
            return Ok(f.clone());
        }
        if entry != spec.entry() && !spec.extra_entries().contains(&entry) {
            return Err(Error::invalid(
                "kernel",
                format!("{spec} has no entry point {entry}"),
            ));
        }
        let compiled = compile::compile(spec)?;
        let load = |cubin| {
            self.dev
                .ctx
                .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))
        };
        let module = match load(compiled.cubin) {
            // A cached image that verifies but that this driver refuses (another driver wrote
            // it, say) is compiled afresh, its entry replaced, and loaded once more.
            Err(e) if compiled.cached => {
                load(compile::recompile_refused(spec, &e.to_string())?.cubin)
            }
            loaded => loaded,
        }
        .map_err(|e| Error::cuda(format!("loading {spec}"), e))?;
        let f = module
            .load_function(spec.entry())
            .map_err(|e| Error::cuda("cuModuleGetFunction", e))?;
        if let Some(need) = spec.setmaxnreg_launch_regs() {
            // A compiler that gives a warp-specialised kernel fewer registers than its launch
            // bounds would make it hang: refuse it here instead.
            let got = f
                .num_regs()
                .map_err(|e| Error::cuda("cuFuncGetAttribute(NUM_REGS)", e))?;
            if (got.max(0) as u32) < need {
                return Err(Error::invalid(
                    "kernel",
                    format!(
                        "this NVRTC's ptxas gave {spec} {got} registers per thread, fewer than the \
                         {need} its warpgroups' setmaxnreg split needs (the kernel would wait \
                         forever); run the Ampere-class kernel (--kernel sm80 / FA4_KERNEL=sm80, \
                         FA4_BWD_KERNEL=sm80) or use NVRTC 13.0.88"
                    ),
                ));
            }
        }
        f.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            spec.smem_bytes() as i32,
        )
        .map_err(|e| Error::cuda("setting the shared-memory limit", e))?;
        for &extra in spec.extra_entries() {
            let g = module
                .load_function(extra)
                .map_err(|e| Error::cuda(format!("cuModuleGetFunction({extra})"), e))?;
            kernels.insert(key(extra), g);
        }
        kernels.insert(key(spec.entry()), f);
        Ok(kernels[&key(entry)].clone())
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
        plan.run(self, p, params)
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
impl CudaBackend {
    /// A varlen problem's offsets on the device (uploaded once per distinct batch, then
    /// reused); `None` for a fixed-length problem.
    pub(crate) fn device_offsets(&self, p: &Problem) -> Result<Option<DeviceOffsets>> {
        if !p.is_varlen() {
            return Ok(None);
        }
        let (cq, ck) = offsets(p);
        let mut cache = self
            .dev
            .offsets
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some((_, _, hit)) = cache.entries.iter().find(|(q, k, _)| *q == cq && *k == ck) {
            return Ok(Some(hit.clone()));
        }
        let dev = Arc::new((self.upload_i32(&cq)?, self.upload_i32(&ck)?));
        if cache.entries.len() >= OffsetCache::CAP {
            cache.entries.remove(0);
        }
        cache.entries.push((cq, ck, dev.clone()));
        Ok(Some(dev))
    }
}

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
    // Fixed-length batches: every sequence's lengths. Varlen: the longest (the Hopper kernel
    // sizes its tile walk by them; each sequence's come from cu_seqlens).
    let longest =
        |f: fn(&crate::problem::Sequence) -> usize| p.sequences().iter().map(f).max().unwrap_or(0);
    FwdParams::new(&params::Common {
        ptrs,
        layouts: [p.q_layout(), p.k_layout(), p.v_layout(), p.o_layout()],
        lse_strides: p.lse_strides(),
        sequences: p.sequences(),
        heads_q: p.heads_q(),
        group: p.group(),
        seqlens: (longest(|s| s.q_len), longest(|s| s.k_len)),
        head_dim: p.head_dim(),
        head_dim_v: p.head_dim_v(),
        bounds: p.mask().bounds(),
        scale: p.scale(),
        softcap: p.softcap(),
    })
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
