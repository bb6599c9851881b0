//! The CUDA forward: candle's device buffers in place, fa4's kernels on candle's own stream.
//!
//! candle ≥ 0.10 and fa4 share cudarc 0.19, so a candle `CudaSlice` is the type fa4's backend
//! takes: views at each tensor's offset go to the kernel as they are (no copy, no host round
//! trip), and the launch is ordered on candle's stream after the work that produced the inputs
//! (no synchronisation). The output and LSE are allocated by candle's device on that stream.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use candle::backend::{BackendDevice, BackendStorage};
use candle::cuda_backend::cudarc::driver::CudaView;
use candle::cuda_backend::{CudaDType, CudaDevice, DeviceId};
use candle::{CudaStorage, DType, Layout, Result, Shape, Storage};
use half::{bf16, f16};

use fa4::cuda::CudaBackend;

use crate::op::{cpu_view, fa4_err, Fa4Attn};
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

pub(crate) fn forward(
    op: &Fa4Attn,
    q: &CudaStorage,
    ql: &Layout,
    k: &CudaStorage,
    kl: &Layout,
    v: &CudaStorage,
    vl: &Layout,
) -> Result<(CudaStorage, Shape)> {
    match q.dtype() {
        DType::F16 => forward_t::<f16>(op, q, ql, k, kl, v, vl),
        DType::BF16 => forward_t::<bf16>(op, q, ql, k, kl, v, vl),
        dt => candle::bail!(
            "fa4-candle: `q` has dtype {dt:?}; on CUDA fa4 computes f16 and bf16 (convert with .to_dtype(), or run f32 on the CPU)"
        ),
    }
}

/// `s`'s elements from `l`'s offset on.
fn view<'a, T: CudaDType>(s: &'a CudaStorage, l: &Layout, name: &str) -> Result<CudaView<'a, T>> {
    let all = s.as_cuda_slice::<T>()?;
    if l.start_offset() > all.len() {
        candle::bail!("fa4-candle: `{name}` starts past its storage");
    }
    Ok(all.slice(l.start_offset()..))
}

fn forward_t<T>(
    op: &Fa4Attn,
    q: &CudaStorage,
    ql: &Layout,
    k: &CudaStorage,
    kl: &Layout,
    v: &CudaStorage,
    vl: &Layout,
) -> Result<(CudaStorage, Shape)>
where
    T: fa4::Element + CudaDType,
{
    let dev = q.device().clone();
    for (name, s) in [("k", k), ("v", v)] {
        if s.device().id() != dev.id() {
            candle::bail!("fa4-candle: `{name}` is on another CUDA device than `q`");
        }
    }
    let (p, out_shape) = op.problem(<T as fa4::Element>::DTYPE, ql, kl, vl)?;
    let backend = backend_for(&dev)?;
    let (qv, kv, vv) = (
        view::<T>(q, ql, "q")?,
        view::<T>(k, kl, "k")?,
        view::<T>(v, vl, "v")?,
    );
    // Zeroed, so that no element is ever uninitialised memory (a zero-size tensor still gets
    // one element: cudarc does not allocate nothing).
    let mut out = dev.alloc_zeros::<T>(out_shape.elem_count().max(1))?;
    let mut lse = match op.wants_lse() {
        true => Some(dev.alloc_zeros::<f32>(p.lse_len().max(1))?),
        false => None,
    };
    // The LSE buffer is exactly the problem's length (fa4 checks it), also when that is 0.
    let mut lse_view = lse.as_mut().map(|l| l.slice_mut(..p.lse_len()));
    backend
        .forward_device_views(&p, &qv, &kv, &vv, &mut out, lse_view.as_mut())
        .map_err(fa4_err)?;
    if let Some(lse) = lse {
        let lse = CudaStorage::wrap_cuda_slice(lse, dev.clone());
        op.store_lse(&p, Storage::Cuda(lse));
    }
    Ok((CudaStorage::wrap_cuda_slice(out, dev), out_shape))
}

/// The paged forward on CUDA tensors, through fa4's [`fa4::Backend::run_paged`] on
/// [`fa4::Backend::Cuda`].
///
/// fa4's paged entry takes host slices (its GPU decode kernels are being written; until they
/// land it returns an error naming `backend`, passed on here with the entry's name). So this path
/// copies `q` and the caches to the host and the result back: correct once fa4 runs it, but a
/// round trip per call, until fa4 has a paged entry on device buffers to call instead.
pub(crate) fn forward_paged(
    op: &Fa4Paged,
    q: &CudaStorage,
    ql: &Layout,
    k: &CudaStorage,
    kl: &Layout,
    v: &CudaStorage,
    vl: &Layout,
) -> Result<(CudaStorage, Shape)> {
    match q.dtype() {
        DType::F16 => forward_paged_t::<f16>(op, q, ql, k, kl, v, vl),
        DType::BF16 => forward_paged_t::<bf16>(op, q, ql, k, kl, v, vl),
        dt => candle::bail!(
            "fa4-candle: {}: `q` has dtype {dt:?}; on CUDA fa4 computes f16 and bf16 (convert with .to_dtype(), or run f32 on the CPU)",
            op.entry
        ),
    }
}

fn forward_paged_t<T>(
    op: &Fa4Paged,
    q: &CudaStorage,
    ql: &Layout,
    k: &CudaStorage,
    kl: &Layout,
    v: &CudaStorage,
    vl: &Layout,
) -> Result<(CudaStorage, Shape)>
where
    T: fa4::Element + CudaDType + candle::WithDType,
{
    let dev = q.device().clone();
    for (name, s) in [("k_cache", k), ("v_cache", v)] {
        if s.device().id() != dev.id() {
            candle::bail!(
                "fa4-candle: {}: `{name}` is on another CUDA device than `q`",
                op.entry
            );
        }
    }
    // Validated before any copy: argument errors cost nothing.
    let (p, out_shape) = op.problem(<T as fa4::Element>::DTYPE, ql, kl, vl)?;
    let backend = fa4::Backend::Cuda(backend_for(&dev)?);
    let (qh, kh, vh) = (
        q.to_cpu_storage()?,
        k.to_cpu_storage()?,
        v.to_cpu_storage()?,
    );
    let mut out = vec![T::from_f32(0.0); out_shape.elem_count()];
    let mut lse = op.wants_lse().then(|| vec![0f32; p.lse_len()]);
    backend
        .run_paged(
            &p,
            cpu_view::<T>(&qh, ql, "q")?,
            cpu_view::<T>(&kh, kl, "k_cache")?,
            cpu_view::<T>(&vh, vl, "v_cache")?,
            &mut out,
            lse.as_deref_mut(),
            op.num_splits,
        )
        .map_err(|e| op.err(e))?;
    if let Some(lse) = lse {
        op.store_lse(&p, Storage::Cuda(upload(&dev, &lse)?));
    }
    Ok((upload(&dev, &out)?, out_shape))
}

/// A host result on candle's device; an empty one still gets one zeroed element (cudarc does
/// not allocate nothing), as in [`forward`].
fn upload<T>(dev: &CudaDevice, host: &[T]) -> Result<CudaStorage>
where
    T: fa4::Element + CudaDType + candle::WithDType,
{
    if host.is_empty() {
        Ok(CudaStorage::wrap_cuda_slice(
            dev.alloc_zeros::<T>(1)?,
            dev.clone(),
        ))
    } else {
        dev.storage_from_slice(host)
    }
}
