//! The CUDA forward: candle's device buffers in place, fa4's kernels on candle's own stream.
//!
//! candle ≥ 0.10 and fa4 share cudarc 0.19, so a candle `CudaSlice` is the type fa4's backend
//! takes: the inputs go to the kernels as they are (no copy, no host round trip), and every
//! launch is ordered on candle's stream after the work that produced the inputs (no
//! synchronisation). The output and LSE are allocated by candle's device on that stream.
//!
//! What is uploaded per call is small and comes from the host values fa4 validated: the varlen
//! offsets, or the paged table and lengths (copies on the stream, no wait). Those host values
//! are why a CUDA `seqlens_*`, `page_table` or `seqlens_k` tensor costs one device-to-host read
//! per call (see `op::host_ints`): fa4 places every row by them, so it checks them first.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use candle::backend::BackendStorage;
use candle::cuda_backend::cudarc::driver::{CudaSlice, CudaView};
use candle::cuda_backend::{CudaDType, CudaDevice, DeviceId};
use candle::{CudaStorage, DType, Layout, Result, Shape, Storage, Tensor};
use half::{bf16, f16};

use fa4::cuda::fp8::DeviceDescales;
use fa4::cuda::CudaBackend;
use fa4::paged::PagedProblem;
use fa4::problem::Problem;
use fa4::F8E4M3;

use crate::fp8::Fa4Fp8;
use crate::op::{fa4_err, AttnOp, Fa4Attn, LseOf};
use crate::paged::Fa4Paged;

/// One fa4 backend per candle device (so per stream), created on first use: it holds the
/// compiled kernels, which must not be reloaded per call. It keeps candle's stream alive for
/// the life of the process.
fn backend_for(dev: &CudaDevice) -> Result<CudaBackend> {
    static BACKENDS: OnceLock<Mutex<HashMap<DeviceId, CudaBackend>>> = OnceLock::new();
    let mut map = BACKENDS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(b) = map.get(&dev.id()) {
        return Ok(b.clone());
    }
    let b = CudaBackend::on_stream(dev.cuda_stream()).map_err(fa4_err)?;
    map.insert(dev.id(), b.clone());
    Ok(b)
}

/// One input of an op: candle's storage and its layout.
type Input<'a> = (&'a CudaStorage, &'a Layout);

/// What an op runs on CUDA once its problem is validated and its outputs allocated.
pub(crate) trait CudaRun: AttnOp {
    /// Launches on `backend`'s stream (candle's). `out` holds at least the output's extent;
    /// `lse`, when given, exactly the problem's LSE length.
    fn run_cuda<T: fa4::Element + CudaDType>(
        &self,
        backend: &CudaBackend,
        p: &Self::Problem,
        inputs: [Input<'_>; 3],
        out: &mut CudaSlice<T>,
        lse: Option<&mut CudaSlice<f32>>,
    ) -> Result<()>;
}

/// The CUDA forward of either op: f16 and bf16.
pub(crate) fn forward<O: CudaRun>(
    op: &O,
    q: &CudaStorage,
    ql: &Layout,
    k: &CudaStorage,
    kl: &Layout,
    v: &CudaStorage,
    vl: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let inputs = [(q, ql), (k, kl), (v, vl)];
    match q.dtype() {
        DType::F16 => forward_t::<O, f16>(op, inputs),
        DType::BF16 => forward_t::<O, bf16>(op, inputs),
        dt => candle::bail!(
            "{}: `q` has dtype {dt:?}; on CUDA fa4 computes f16 and bf16 (convert with .to_dtype(), or run f32 on the CPU)",
            op.context()
        ),
    }
}

fn forward_t<O, T>(op: &O, inputs: [Input<'_>; 3]) -> Result<(CudaStorage, Shape)>
where
    O: CudaRun,
    T: fa4::Element + CudaDType,
{
    let [q, k, v] = inputs;
    let dev = q.0.device().clone();
    for (name, (s, _)) in O::ARGS[1..].iter().zip([k, v]) {
        if s.device().id() != dev.id() {
            candle::bail!(
                "{}: `{name}` is on another CUDA device than `q`",
                op.context()
            );
        }
    }
    // Validated before anything is allocated or launched.
    let (p, out_shape) = op.problem(<T as fa4::Element>::DTYPE, q.1, k.1, v.1)?;
    let backend = backend_for(&dev)?;
    // Zeroed, so that no element is ever uninitialised memory (a zero-size tensor still gets
    // one element: cudarc does not allocate nothing).
    let mut out = dev.alloc_zeros::<T>(out_shape.elem_count().max(1))?;
    let mut lse = match op.wants_lse() {
        true => Some(dev.alloc_zeros::<f32>(p.lse_len().max(1))?),
        false => None,
    };
    // fa4 wants the LSE buffer at exactly the problem's length; an empty LSE has no row to
    // write, so its one placeholder element is not handed over.
    let lse_arg = lse.as_mut().filter(|_| p.lse_len() > 0);
    op.run_cuda(&backend, &p, inputs, &mut out, lse_arg)?;
    if let Some(lse) = lse {
        let lse = CudaStorage::wrap_cuda_slice(lse, dev.clone());
        op.store_lse(&p, Storage::Cuda(lse));
    }
    Ok((CudaStorage::wrap_cuda_slice(out, dev), out_shape))
}

/// The CUDA forward of fp8 attention: fa4's Hopper e4m3 kernel
/// ([`CudaBackend::forward_fp8_device`]: the Vᵀ pass, the forward and its fixup) on candle's
/// `F8E4M3` buffers in place and on candle's stream, the descales read from their own device
/// buffers, O allocated in bf16 by candle's device. Elsewhere than on a Hopper GPU fa4's planner
/// refuses the problem (an error naming `dtype`).
pub(crate) fn forward_fp8(op: &Fa4Fp8, inputs: [Input<'_>; 3]) -> Result<(CudaStorage, Shape)> {
    let [q, k, v] = inputs;
    let dev = q.0.device().clone();
    for (name, (s, _)) in [("k", k), ("v", v)] {
        if s.device().id() != dev.id() {
            candle::bail!("fa4-candle: `{name}` is on another CUDA device than `q`");
        }
    }
    let (p, out_shape) = op.problem(q.1, k.1, v.1)?;
    let backend = backend_for(&dev)?;
    let (qv, kv, vv) = (
        view::<F8E4M3>(q.0, q.1, "q")?,
        view::<F8E4M3>(k.0, k.1, "k")?,
        view::<F8E4M3>(v.0, v.1, "v")?,
    );
    // Each descale is a contiguous [batch, heads_kv] tensor (`attention_fp8` made it so): its
    // storage is held for the call and viewed over exactly its elements.
    let held: Vec<_> = op
        .descales
        .iter()
        .map(|d| d.as_ref().map(Tensor::storage_and_layout))
        .collect();
    let mut views: Vec<Option<CudaView<'_, f32>>> = Vec::with_capacity(3);
    for (name, h) in Fa4Fp8::DESCALES.iter().zip(&held) {
        let Some((storage, layout)) = h else {
            views.push(None);
            continue;
        };
        let Storage::Cuda(s) = &**storage else {
            candle::bail!("fa4-candle: `{name}` is not on `q`'s CUDA device");
        };
        if s.device().id() != dev.id() {
            candle::bail!("fa4-candle: `{name}` is on another CUDA device than `q`");
        }
        let start = layout.start_offset();
        let end = start + layout.shape().elem_count();
        match s.as_cuda_slice::<f32>()?.try_slice(start..end) {
            Some(view) => views.push(Some(view)),
            None => candle::bail!("fa4-candle: `{name}` runs past its storage"),
        }
    }
    let descales = DeviceDescales {
        q: views[0].as_ref(),
        k: views[1].as_ref(),
        v: views[2].as_ref(),
    };
    // Zeroed, as the 16-bit forward's output (one element for a zero-size tensor).
    let mut out = dev.alloc_zeros::<bf16>(out_shape.elem_count().max(1))?;
    backend
        .forward_fp8_device(
            &p,
            &qv,
            &kv,
            &vv,
            &descales,
            &mut out,
            None::<&mut CudaSlice<f32>>,
        )
        .map_err(fa4_err)?;
    Ok((CudaStorage::wrap_cuda_slice(out, dev), out_shape))
}

/// The storage's elements from the layout's offset on.
fn view<'a, T: CudaDType>(s: &'a CudaStorage, l: &Layout, name: &str) -> Result<CudaView<'a, T>> {
    let all = s.as_cuda_slice::<T>()?;
    if l.start_offset() > all.len() {
        candle::bail!("fa4-candle: `{name}` starts past its storage");
    }
    Ok(all.slice(l.start_offset()..))
}

impl CudaRun for Fa4Attn {
    fn run_cuda<T: fa4::Element + CudaDType>(
        &self,
        backend: &CudaBackend,
        p: &Problem,
        [(q, ql), (k, kl), (v, vl)]: [Input<'_>; 3],
        out: &mut CudaSlice<T>,
        lse: Option<&mut CudaSlice<f32>>,
    ) -> Result<()> {
        // Views at each tensor's offset, strides as the problem says: no copy.
        let (qv, kv, vv) = (
            view::<T>(q, ql, "q")?,
            view::<T>(k, kl, "k")?,
            view::<T>(v, vl, "v")?,
        );
        backend
            .forward_device_views(p, &qv, &kv, &vv, out, lse)
            .map_err(|e| self.err(e))
    }
}

impl CudaRun for Fa4Paged {
    /// fa4's device paged entry ([`CudaBackend::forward_paged_device`]) with the table and
    /// lengths of [`CudaBackend::paged_tables`], both on candle's stream.
    ///
    /// That entry takes whole `CudaSlice`s, so a tensor must start at its storage's first
    /// element. `q` (small: a decode step's rows) that does not — a view into a fused QKV
    /// projection, say — is copied on the device to a buffer of its own; a cache that does not
    /// is an error, since copying a cache per step would cost more than the attention.
    fn run_cuda<T: fa4::Element + CudaDType>(
        &self,
        backend: &CudaBackend,
        p: &PagedProblem,
        [(q, ql), (k, kl), (v, vl)]: [Input<'_>; 3],
        out: &mut CudaSlice<T>,
        lse: Option<&mut CudaSlice<f32>>,
    ) -> Result<()> {
        for (name, l) in [("k_cache", kl), ("v_cache", vl)] {
            if l.start_offset() != 0 {
                candle::bail!(
                    "{}: `{name}` starts at element {} of its storage; fa4's paged decode reads a cache from the start of its buffer: pass a cache tensor of its own (not a view into a larger one, such as one half of a [2, pages, …] pool; `.force_contiguous()` makes one)",
                    self.context(),
                    l.start_offset()
                );
            }
        }
        let q_all = q.as_cuda_slice::<T>()?;
        let q_copy = match ql.start_offset() {
            0 => None,
            start => {
                // The rows the problem reads, from the view's first element (its strides stay
                // valid in the copy).
                let extent = p.q_layout().extent().unwrap_or(0).max(1);
                let end = start.saturating_add(extent).min(q_all.len());
                if start >= end {
                    candle::bail!("{}: `q` starts past its storage", self.context());
                }
                let copy = backend
                    .stream()
                    .clone_dtod(&q_all.slice(start..end))
                    .map_err(|e| {
                        candle::Error::Msg(format!("{}: copying `q`: {e}", self.context()))
                    })?;
                Some(copy)
            }
        };
        let q_buf = q_copy.as_ref().unwrap_or(q_all);
        let mut tables = backend.paged_tables(p).map_err(|e| self.err(e))?;
        backend
            .forward_paged_device(
                p,
                &mut tables,
                q_buf,
                k.as_cuda_slice::<T>()?,
                v.as_cuda_slice::<T>()?,
                out,
                lse,
                self.num_splits,
            )
            .map_err(|e| self.err(e))?;
        Ok(())
    }
}
