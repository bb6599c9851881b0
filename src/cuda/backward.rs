//! The backward pass on the GPU: dQ, dK and dV by the Ampere-class kernels of
//! `kernels/bwd/` (planned by [`crate::config::bwd`]), which run on every GPU from sm_80 on.
//!
//! [`CudaBackend::backward_host`] is what [`crate::Backend::backward`] uses on a GPU: host slices
//! in and out. Callers who keep their tensors on the GPU call [`CudaBackend::backward_device`]
//! with [`BwdDeviceInputs`] and [`BwdDeviceOutputs`]; it checks every buffer against the
//! problem and the gradients' layouts, and runs asynchronously on [`CudaBackend::stream`].

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr};

use super::compile::{KernelSource, SM80_PTX_SRC};
use super::family::{Launch, Launchable};
use super::params::FwdParams;
use super::{make_params, offsets, CudaBackend};
use crate::config::bwd::{self, BwdKernel, BwdPlan, BwdSpec, MainTiles};
use crate::cpu::{BwdInputs, BwdOutputs};
use crate::error::{Error, Result};
use crate::problem::Problem;
use crate::tensor::{Element, Layout};

/// The backward's params header.
pub const BWD_PARAMS_SRC: &str = include_str!("../kernels/bwd/params.cuh");
/// The backward's PTX wrappers.
pub const BWD_PTX_SRC: &str = include_str!("../kernels/bwd/ptx.cuh");
/// The backward's shared-memory tiles and elementwise helpers.
pub const BWD_TILE_SRC: &str = include_str!("../kernels/bwd/tile.cuh");
/// The row kernels (`pre`, `convert`).
pub const BWD_AUX_SRC: &str = include_str!("../kernels/bwd/aux.cu");
/// The main (key-side) kernel.
pub const BWD_MAIN_SRC: &str = include_str!("../kernels/bwd/main.cu");
/// The deterministic dQ kernel.
pub const BWD_DQ_SRC: &str = include_str!("../kernels/bwd/dq.cu");
/// Environment variable overriding the main kernel's tiles, `block_m,block_n,dsplit` (tuning).
pub const TILES_ENV: &str = "FA4_BWD_TILES";

/// Launch parameters of every backward kernel (`BwdParams` in `kernels/bwd/params.cuh`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct BwdParams {
    pub f: FwdParams,
    pub d_out: u64,
    pub dq: u64,
    pub dk: u64,
    pub dv: u64,
    pub dq_accum: u64,
    pub dpsum: u64,
    pub do_strides: [i64; 3],
    pub dq_strides: [i64; 3],
    pub dk_strides: [i64; 3],
    pub dv_strides: [i64; 3],
    pub acc_batch_rows: i64,
    pub scale: f32,
    pub softcap: f32,
    pub inv_softcap: f32,
    /// The Hopper main kernel's padded row statistics (`config::bwd_sm90::Plan::stats_rows`);
    /// 0 for the Ampere-class kernels.
    pub stats_rows: i32,
    /// The Hopper main kernel's query block (a varlen batch's padding in that layout); 0 for
    /// the Ampere-class kernels.
    pub stats_block: i32,
}

/// The header's `FA4_BWD_PARAMS_SIZE`.
pub const BWD_PARAMS_SIZE: usize = 400;
const _: () = assert!(std::mem::size_of::<BwdParams>() == BWD_PARAMS_SIZE);
const _: () = assert!(std::mem::offset_of!(BwdParams, d_out) == 224);
const _: () = assert!(std::mem::offset_of!(BwdParams, do_strides) == 272);
const _: () = assert!(std::mem::offset_of!(BwdParams, acc_batch_rows) == 368);
const _: () = assert!(std::mem::offset_of!(BwdParams, scale) == 376);
// SAFETY: #[repr(C)] plain integers and floats, laid out like the header (size asserted on both
// sides, offsets here).
unsafe impl DeviceRepr for BwdParams {}

/// One of the backward plan's launches: a kernel of the plan and the grid the planner gave it.
struct BwdLaunch<'a> {
    spec: &'a BwdSpec,
    grid: (u32, u32, u32),
}

// SAFETY: built only by `launch_bwd`, from a plan's `launches`, on the path of
// `backward_device_trusted`. The problem was validated (shapes, strides, cu_seqlens equal to
// its offsets: read back by `backward_device` or uploaded from them by `backward_host`); every
// input buffer holds its layout's extent, the gradients' layouts have their inputs' dims,
// distinct offsets and hold their extent, all strides are multiples of 8 elements and all
// pointers 16-byte aligned (the kernels' 16-byte copies and 4-byte stores). The workspaces
// were allocated with the plan's lengths, which cover every (row, head) the grid visits. The
// kernels read rows below each sequence's length and columns below head_dim only (others are
// zero-filled in shared memory) and write only those. The planner sized grid, block and shared
// memory of this spec; the kernels static_assert the same shared-memory count and the params'
// size.
unsafe impl Launchable for BwdLaunch<'_> {
    fn launch(&self) -> Launch<'_> {
        Launch::new(self.spec, self.grid, self.spec.threads())
    }
}

impl KernelSource for BwdSpec {
    fn target(&self) -> &'static str {
        self.target
    }
    fn prelude(&self) -> String {
        BwdSpec::prelude(self)
    }
    fn family_sources(&self) -> Vec<std::borrow::Cow<'static, str>> {
        let kernel = match self.kernel {
            BwdKernel::Pre | BwdKernel::Convert => BWD_AUX_SRC,
            BwdKernel::Main => BWD_MAIN_SRC,
            BwdKernel::Dq => BWD_DQ_SRC,
        };
        vec![
            BWD_PARAMS_SRC.into(),
            SM80_PTX_SRC.into(),
            BWD_PTX_SRC.into(),
            BWD_TILE_SRC.into(),
            kernel.into(),
        ]
    }
    fn entry(&self) -> &'static str {
        BwdSpec::entry(self)
    }
    fn smem_bytes(&self) -> usize {
        BwdSpec::smem_bytes(self)
    }
}

/// The backward's inputs on the device, laid out as the problem says (`d_out` in
/// `d_out_layout`: O's dims, its own strides); `cu_seqlens` for a varlen problem.
///
/// Every buffer is any cudarc device buffer (`&CudaSlice<T>` coerces), or a
/// [`super::ForeignBuffer`] over another framework's memory.
pub struct BwdDeviceInputs<'a, T> {
    /// Q.
    pub q: &'a dyn DevicePtr<T>,
    /// K.
    pub k: &'a dyn DevicePtr<T>,
    /// V.
    pub v: &'a dyn DevicePtr<T>,
    /// The forward's O.
    pub out: &'a dyn DevicePtr<T>,
    /// The forward's LSE (the problem's LSE layout).
    pub lse: &'a dyn DevicePtr<f32>,
    /// dO.
    pub d_out: &'a dyn DevicePtr<T>,
    /// dO's layout.
    pub d_out_layout: Layout,
    /// `cu_seqlens_q`, `cu_seqlens_k` (varlen problems only), equal to the problem's offsets.
    pub cu_seqlens: Option<(&'a CudaSlice<i32>, &'a CudaSlice<i32>)>,
}

/// The gradients on the device, with their layouts (the dims of Q, K, V; any strides whose
/// last dimension is contiguous). Every element of each layout is written.
pub struct BwdDeviceOutputs<'a, T> {
    /// dQ.
    pub dq: &'a mut dyn DevicePtrMut<T>,
    /// dQ's layout.
    pub dq_layout: Layout,
    /// dK.
    pub dk: &'a mut dyn DevicePtrMut<T>,
    /// dK's layout.
    pub dk_layout: Layout,
    /// dV.
    pub dv: &'a mut dyn DevicePtrMut<T>,
    /// dV's layout.
    pub dv_layout: Layout,
}

/// Checks a device tensor: `layout` has `want`'s dims, distinct elements at distinct offsets
/// (gradients), 16-byte strides, and the buffer holds its extent.
fn check_tensor(
    name: &str,
    layout: &Layout,
    want: &Layout,
    len: usize,
    output: bool,
) -> Result<()> {
    if layout.dims != want.dims {
        return Err(Error::invalid(
            name,
            format!("expected dims {:?}, got {:?}", want.dims, layout.dims),
        ));
    }
    if output && !crate::problem::non_overlapping(layout) {
        return Err(Error::invalid(
            name,
            format!(
                "strides {:?} make distinct elements overlap",
                layout.strides
            ),
        ));
    }
    for (axis, st) in ["batch stride", "row stride", "head stride"]
        .into_iter()
        .zip(layout.strides)
    {
        if !st.is_multiple_of(8) {
            return Err(Error::invalid(
                name,
                format!("{axis} {st} must be a multiple of 8 elements (16-byte copies) for the CUDA backward"),
            ));
        }
    }
    let extent = layout
        .extent()
        .ok_or_else(|| Error::invalid(name, "extent overflows"))?;
    if len < extent {
        return Err(Error::invalid(
            name,
            format!("buffer holds {len} elements, the layout needs {extent}"),
        ));
    }
    Ok(())
}

fn strides(l: &Layout) -> [i64; 3] {
    l.strides.map(|s| s as i64)
}

impl CudaBackend {
    /// Plans the backward of a problem for this device. `FA4_BWD_TILES=block_m,block_n,dsplit`
    /// overrides the main kernel's tiles (for tuning; checked like the planner's).
    pub fn plan_backward(&self, p: &Problem, deterministic: bool) -> Result<BwdPlan> {
        let info = self.info();
        bwd::plan(p, &info.arch, info.target, deterministic, tiles_from_env()?)
    }

    /// The backward of a validated problem on device buffers. Asynchronous on the stream.
    pub fn backward_device<T: Element>(
        &self,
        p: &Problem,
        x: &BwdDeviceInputs<'_, T>,
        o: &mut BwdDeviceOutputs<'_, T>,
        deterministic: bool,
    ) -> Result<()> {
        if let (true, Some((cq, ck))) = (p.is_varlen(), x.cu_seqlens) {
            let (want_q, want_k) = offsets(p);
            for (name, dev, want) in [("cu_seqlens_q", cq, want_q), ("cu_seqlens_k", ck, want_k)] {
                let got = if dev.len() == want.len() {
                    self.stream()
                        .clone_dtoh(dev)
                        .map_err(|e| Error::cuda(format!("reading {name} back"), e))?
                } else {
                    Vec::new()
                };
                if got != want {
                    return Err(Error::invalid(
                        name,
                        format!("the device buffer holds {got:?}, the problem was validated with {want:?}"),
                    ));
                }
            }
        }
        self.backward_device_trusted(p, x, o, deterministic)
    }

    /// [`CudaBackend::backward_device`] with the varlen offsets taken from the problem itself
    /// (uploaded once per distinct batch and reused, as
    /// [`CudaBackend::forward_device_views`] does), so nothing is read back and the call never
    /// waits: `x.cu_seqlens` must be `None`.
    pub fn backward_device_views<T: Element>(
        &self,
        p: &Problem,
        x: &BwdDeviceInputs<'_, T>,
        o: &mut BwdDeviceOutputs<'_, T>,
        deterministic: bool,
    ) -> Result<()> {
        if x.cu_seqlens.is_some() {
            return Err(Error::invalid(
                "cu_seqlens_q",
                "backward_device_views takes the offsets from the problem; pass None",
            ));
        }
        let cu = self.device_offsets(p)?;
        let x = BwdDeviceInputs {
            cu_seqlens: cu.as_deref().map(|(a, b)| (a, b)),
            ..*x
        };
        self.backward_device_trusted(p, &x, o, deterministic)
    }

    /// [`CudaBackend::backward_device`] with `cu_seqlens` uploaded by the crate from the
    /// problem's offsets, so not read back.
    fn backward_device_trusted<T: Element>(
        &self,
        p: &Problem,
        x: &BwdDeviceInputs<'_, T>,
        o: &mut BwdDeviceOutputs<'_, T>,
        deterministic: bool,
    ) -> Result<()> {
        p.check_buffers(
            T::DTYPE,
            x.q.len(),
            x.k.len(),
            x.v.len(),
            x.out.len(),
            Some(x.lse.len()),
        )?;
        check_tensor("q", p.q_layout(), p.q_layout(), x.q.len(), false)?;
        check_tensor("k", p.k_layout(), p.k_layout(), x.k.len(), false)?;
        check_tensor("v", p.v_layout(), p.v_layout(), x.v.len(), false)?;
        check_tensor("out", p.o_layout(), p.o_layout(), x.out.len(), false)?;
        check_tensor("d_out", &x.d_out_layout, p.o_layout(), x.d_out.len(), false)?;
        check_tensor("dq", &o.dq_layout, p.q_layout(), o.dq.len(), true)?;
        check_tensor("dk", &o.dk_layout, p.k_layout(), o.dk.len(), true)?;
        check_tensor("dv", &o.dv_layout, p.v_layout(), o.dv.len(), true)?;
        let batch = p.sequences().len();
        match (p.is_varlen(), x.cu_seqlens) {
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
        // The Hopper main kernel where chosen (`backward_sm90`), with the Ampere-class plan's
        // row kernels and workspaces; else the Ampere-class backward whole.
        let hopper = self.plan_backward_sm90(p, deterministic)?;
        let plan = match &hopper {
            Some(h) => h.base.clone(),
            None => self.plan_backward(p, deterministic)?,
        };
        let stream = self.stream().clone();
        // Workspaces: D and (unless deterministic) the dQ accumulator, at least one element each.
        // SAFETY (of the uninitialised allocations): the `pre` kernel writes every element the
        // later kernels read (D and the accumulator of every query row of every head) before
        // they run on the same stream; nothing reads them on the host.
        let mut dpsum = unsafe { stream.alloc::<f32>(plan.dpsum_len.max(1)) }
            .map_err(|e| Error::cuda("alloc", e))?;
        let mut accum = unsafe { stream.alloc::<f32>(plan.accum_len.max(1)) }
            .map_err(|e| Error::cuda("alloc", e))?;

        let (q_ptr, _q) = x.q.device_ptr(&stream);
        let (k_ptr, _k) = x.k.device_ptr(&stream);
        let (v_ptr, _v) = x.v.device_ptr(&stream);
        let (o_ptr, _o) = x.out.device_ptr(&stream);
        let (lse_ptr, _l) = x.lse.device_ptr(&stream);
        let (do_ptr, _do) = x.d_out.device_ptr(&stream);
        let (dq_ptr, _dq) = o.dq.device_ptr_mut(&stream);
        let (dk_ptr, _dk) = o.dk.device_ptr_mut(&stream);
        let (dv_ptr, _dv) = o.dv.device_ptr_mut(&stream);
        let (dpsum_ptr, _dp) = dpsum.device_ptr_mut(&stream);
        let (acc_ptr, _acc) = accum.device_ptr_mut(&stream);
        let (cq_ptr, ck_ptr, _cu) = match x.cu_seqlens {
            Some((cq, ck)) => {
                let (a, sa) = cq.device_ptr(&stream);
                let (b, sb) = ck.device_ptr(&stream);
                (a, b, Some((sa, sb)))
            }
            None => (0, 0, None),
        };
        for (name, ptr) in [
            ("q", q_ptr),
            ("k", k_ptr),
            ("v", v_ptr),
            ("out", o_ptr),
            ("d_out", do_ptr),
            ("dq", dq_ptr),
            ("dk", dk_ptr),
            ("dv", dv_ptr),
        ] {
            if ptr % 16 != 0 {
                return Err(Error::invalid(
                    name,
                    "device buffer must be 16-byte aligned",
                ));
            }
        }
        let softcap = p.softcap().unwrap_or(0.0);
        let params = BwdParams {
            f: make_params(p, [q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, cq_ptr, ck_ptr]),
            d_out: do_ptr,
            dq: dq_ptr,
            dk: dk_ptr,
            dv: dv_ptr,
            // The Ampere-class deterministic mode has no accumulator (`fa4_bwd_dq` writes dQ);
            // the Hopper one adds to it in a fixed order.
            dq_accum: if deterministic && hopper.is_none() {
                0
            } else {
                acc_ptr
            },
            dpsum: dpsum_ptr,
            do_strides: strides(&x.d_out_layout),
            dq_strides: strides(&o.dq_layout),
            dk_strides: strides(&o.dk_layout),
            dv_strides: strides(&o.dv_layout),
            acc_batch_rows: plan.acc_batch_rows as i64,
            scale: p.scale(),
            softcap,
            inv_softcap: if softcap > 0.0 { 1.0 / softcap } else { 0.0 },
            // Checked against int32 by the Hopper planner.
            stats_rows: hopper.as_ref().map_or(0, |h| h.stats_rows as i32),
            stats_block: hopper.as_ref().map_or(0, |h| h.spec.tiles.block_m as i32),
        };
        match &hopper {
            Some(h) => {
                self.launch_bwd(&h.pre.0, h.pre.1, &params)?;
                self.launch_bwd_sm90(h, p, &x.d_out_layout, &params)?;
                self.launch_bwd(&h.convert.0, h.convert.1, &params)?;
            }
            None => {
                for (spec, grid) in &plan.launches {
                    self.launch_bwd(spec, *grid, &params)?;
                }
            }
        }
        Ok(())
    }

    /// Launches one backward kernel through the crate's one launch site
    /// ([`CudaBackend::launch`]); an empty grid (no rows) launches nothing.
    fn launch_bwd(&self, spec: &BwdSpec, grid: (u32, u32, u32), params: &BwdParams) -> Result<()> {
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        self.launch(&BwdLaunch { spec, grid }, params)
    }

    /// The backward on host slices: copies in, launches, copies the gradients out, waits.
    pub(crate) fn backward_host<T: Element>(
        &self,
        p: &Problem,
        x: &BwdInputs<'_, T>,
        o: &mut BwdOutputs<'_, T>,
        deterministic: bool,
    ) -> Result<()> {
        // Plan first, so an unsupported problem costs no copies.
        if self.plan_backward_sm90(p, deterministic)?.is_none() {
            self.plan_backward(p, deterministic)?;
        }
        // The slices were checked against the layouts by the caller; an empty tensor gets a
        // one-element buffer (nothing is read from it).
        let up = |_name: &str, s: &[T], l: &Layout| -> Result<CudaSlice<T>> {
            let n = l.extent().unwrap_or(0).min(s.len());
            if n == 0 {
                self.alloc::<T>(1)
            } else {
                self.upload(&s[..n])
            }
        };
        let q = up("q", x.q, p.q_layout())?;
        let k = up("k", x.k, p.k_layout())?;
        let v = up("v", x.v, p.v_layout())?;
        let out = up("out", x.o, p.o_layout())?;
        let d_out = up("d_out", x.d_out, &x.d_out_layout)?;
        let lse = self.upload::<f32>(if x.lse.is_empty() { &[0.0] } else { x.lse })?;
        // The gradients are uploaded too: elements between strided rows must survive.
        let mut dq = up("dq", o.dq, &o.dq_layout)?;
        let mut dk = up("dk", o.dk, &o.dk_layout)?;
        let mut dv = up("dv", o.dv, &o.dv_layout)?;
        let cu = if p.is_varlen() {
            let (cq, ck) = offsets(p);
            Some((self.upload_i32(&cq)?, self.upload_i32(&ck)?))
        } else {
            None
        };
        let inputs = BwdDeviceInputs {
            q: &q,
            k: &k,
            v: &v,
            out: &out,
            lse: &lse,
            d_out: &d_out,
            d_out_layout: x.d_out_layout,
            cu_seqlens: cu.as_ref().map(|(a, b)| (a, b)),
        };
        let mut outputs = BwdDeviceOutputs {
            dq: &mut dq,
            dq_layout: o.dq_layout,
            dk: &mut dk,
            dk_layout: o.dk_layout,
            dv: &mut dv,
            dv_layout: o.dv_layout,
        };
        self.backward_device_trusted(p, &inputs, &mut outputs, deterministic)?;
        for (name, dev, host) in [
            ("dq", &dq, &mut *o.dq),
            ("dk", &dk, &mut *o.dk),
            ("dv", &dv, &mut *o.dv),
        ] {
            let n = dev.len().min(host.len());
            if n == 0 {
                continue;
            }
            self.stream()
                .memcpy_dtoh(&dev.slice(..n), &mut host[..n])
                .map_err(|e| Error::cuda(format!("download {name}"), e))?;
        }
        self.synchronize()
    }
}

/// The main kernel's tiles from [`TILES_ENV`], if set.
fn tiles_from_env() -> Result<Option<MainTiles>> {
    let Ok(v) = std::env::var(TILES_ENV) else {
        return Ok(None);
    };
    let parts: Vec<usize> = v
        .split(',')
        .map(|s| s.trim().parse::<usize>())
        .collect::<std::result::Result<_, _>>()
        .map_err(|_| {
            Error::invalid(
                TILES_ENV,
                format!("expected block_m,block_n,dsplit, got `{v}`"),
            )
        })?;
    match parts[..] {
        [block_m, block_n, dsplit] => Ok(Some(MainTiles {
            block_m,
            block_n,
            dsplit,
        })),
        _ => Err(Error::invalid(
            TILES_ENV,
            format!("expected block_m,block_n,dsplit, got `{v}`"),
        )),
    }
}

/// Milliseconds per backward call of a problem (fixed-length or varlen) on this device,
/// bf16/fp16 random normal inputs (the forward on the GPU for O and LSE): `warmup` untimed
/// calls, then `rounds` rounds of one CUDA event pair around `calls` back-to-back calls (the
/// fair grid's method, docs/perf.md). Returns each round's milliseconds per call.
pub fn time_backward<T: Element>(
    cuda: &CudaBackend,
    p: &Problem,
    deterministic: bool,
    warmup: usize,
    rounds: usize,
    calls: usize,
) -> Result<Vec<f64>> {
    use cudarc::driver::sys::CUevent_flags;
    if cuda.plan_backward_sm90(p, deterministic)?.is_none() {
        cuda.plan_backward(p, deterministic)?;
    }
    let mut rng = rand::SeedableRng::seed_from_u64(1);
    let mut host = |l: &Layout| -> Result<CudaSlice<T>> {
        let mut v = vec![T::from_f32(0.0); l.extent().unwrap_or(0).max(1)];
        crate::check::random_fill::<T, rand::rngs::StdRng>(&mut rng, &mut v, l.dims[3], 1.0);
        cuda.upload(&v)
    };
    let (q, k, v) = (
        host(p.q_layout())?,
        host(p.k_layout())?,
        host(p.v_layout())?,
    );
    let d_out = host(p.o_layout())?;
    let mut out = cuda.alloc::<T>(p.o_layout().extent().unwrap_or(0).max(1))?;
    let mut lse = cuda.alloc::<f32>(p.lse_len().max(1))?;
    // A varlen problem's offsets, uploaded from the problem itself (so trusted below).
    let cu = cuda.device_offsets(p)?;
    let cu = cu.as_deref().map(|(a, b)| (a, b));
    cuda.forward_device(p, &q, &k, &v, cu, &mut out, Some(&mut lse))?;
    let mut dq = cuda.alloc::<T>(q.len())?;
    let mut dk = cuda.alloc::<T>(k.len())?;
    let mut dv = cuda.alloc::<T>(v.len())?;
    let x = BwdDeviceInputs {
        q: &q,
        k: &k,
        v: &v,
        out: &out,
        lse: &lse,
        d_out: &d_out,
        d_out_layout: *p.o_layout(),
        cu_seqlens: cu,
    };
    let mut o = BwdDeviceOutputs {
        dq: &mut dq,
        dq_layout: *p.q_layout(),
        dk: &mut dk,
        dk_layout: *p.k_layout(),
        dv: &mut dv,
        dv_layout: *p.v_layout(),
    };
    for _ in 0..warmup {
        cuda.backward_device_trusted(p, &x, &mut o, deterministic)?;
    }
    cuda.synchronize()?;
    let ev = || {
        cuda.context()
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| Error::cuda("cuEventCreate", e))
    };
    let mut ms = Vec::with_capacity(rounds);
    for _ in 0..rounds.max(1) {
        let (start, end) = (ev()?, ev()?);
        cuda.synchronize()?;
        start
            .record(cuda.stream())
            .map_err(|e| Error::cuda("cuEventRecord", e))?;
        for _ in 0..calls.max(1) {
            cuda.backward_device_trusted(p, &x, &mut o, deterministic)?;
        }
        end.record(cuda.stream())
            .map_err(|e| Error::cuda("cuEventRecord", e))?;
        cuda.synchronize()?;
        let t = start
            .elapsed_ms(&end)
            .map_err(|e| Error::cuda("cuEventElapsedTime", e))?;
        ms.push(f64::from(t) / calls.max(1) as f64);
    }
    Ok(ms)
}
