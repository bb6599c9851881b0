//! `fa4._fa4`: the extension module behind the `fa4` Python package.
//!
//! The package's Python layer (`python/fa4/`) turns FlashAttention's functions into calls of
//! this module; everything is validated here by the `fa4` crate, as for a Rust caller, and a
//! bad argument comes back as `ValueError` naming it.
//!
//! Two kinds of data cross:
//!
//! - **Host data** (numpy arrays, CPU torch tensors) crosses as `bytes`, C-contiguous, and the
//!   outputs come back as `bytearray`s that the Python layer views. The stable ABI this module
//!   is built for (abi3, CPython ≥ 3.9) has no buffer protocol before 3.11, and the CPU backend
//!   is compute-bound, so the copies cost little beside the attention itself.
//! - **Device data** (CUDA torch tensors) crosses as addresses with shapes and element strides,
//!   and runs on the caller's CUDA stream (`torch.cuda.current_stream()`), with no copies. Each
//!   address range is checked against the driver's record of the allocation holding it
//!   ([`fa4::cuda::ForeignBuffer`]), so a wrong shape or a host address is an error, not a
//!   fault in a kernel.
//!
//! fp8 (e4m3) inputs have entry points of their own ([`forward_fp8_cpu`], [`forward_fp8_cuda`]):
//! they take the descales and the output dtype (`docs/attention.md`, "FP8 (e4m3) inputs"). So
//! do fp8 KV caches ([`paged_fp8_cpu`], [`paged_fp8_cuda`]): e4m3 pages with one scale per KV
//! head, `k_scale` and `v_scale` (`docs/decode.md`, "An fp8 cache").

use std::sync::Mutex;

use cudarc::driver::{sys::CUstream, CudaContext};
use fa4::backward::BackwardOptions;
use fa4::cuda::backward::{BwdDeviceInputs, BwdDeviceOutputs};
use fa4::cuda::decode::{DeviceKvScales, PagedTables};
use fa4::cuda::fp8::DeviceDescales;
use fa4::cuda::{CudaBackend, ForeignBuffer};
use fa4::paged::{KvScales, PagedCache, PagedKv, PagedOptions, PagedProblem};
use fa4::tensor::Layout;
use fa4::{Backend, DType, Descales, Element, Mask, Options, Problem, Tensor, TensorMut, F8E4M3};
use half::{bf16, f16};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes};

/// A `fa4::Error` as a Python exception: bad arguments are `ValueError`s that name the
/// argument (the crate's message starts with it); CUDA and compile failures `RuntimeError`s.
fn py_err(e: fa4::Error) -> PyErr {
    match e {
        fa4::Error::InvalidArgument { .. } => PyValueError::new_err(e.to_string()),
        _ => PyRuntimeError::new_err(e.to_string()),
    }
}

/// [`py_err`] for the paged entry points, with the crate's argument names replaced by
/// FlashAttention's (`flash_attn_with_kvcache`'s).
fn py_err_paged(e: fa4::Error) -> PyErr {
    match e {
        fa4::Error::InvalidArgument { name, reason } => {
            let name = match name.as_str() {
                "page_table" | "max_pages_per_seq" => "block_table".to_string(),
                "seqlens_k" | "cu_new" => "cache_seqlens".to_string(),
                _ => name,
            };
            py_err(fa4::Error::InvalidArgument { name, reason })
        }
        e => py_err(e),
    }
}

fn dtype_of(name: &str) -> PyResult<DType> {
    match name {
        "bf16" => Ok(DType::Bf16),
        "fp16" => Ok(DType::F16),
        "f32" => Ok(DType::F32),
        other => Err(PyValueError::new_err(format!(
            "invalid argument `dtype`: fa4 computes bfloat16, float16 and float32, got {other}"
        ))),
    }
}

/// O's dtype for fp8 inputs: bf16 or fp16.
fn out_dtype_of(name: &str) -> PyResult<DType> {
    match name {
        "bf16" => Ok(DType::Bf16),
        "fp16" => Ok(DType::F16),
        other => Err(PyValueError::new_err(format!(
            "invalid argument `out_dtype`: O of fp8 inputs is bfloat16 or float16, got {other}"
        ))),
    }
}

/// FlashAttention's mask arguments as a [`Mask`]: `causal` is the bottom-right diagonal, and
/// with a window its right side is 0; `window_size` is `(left, right)` with −1 unbounded.
fn options(
    causal: bool,
    window: (i64, i64),
    scale: Option<f32>,
    softcap: f32,
) -> PyResult<Options> {
    let (left, right) = window;
    let mask = match (causal, left, right) {
        (true, -1, _) => Mask::Causal,
        (true, l, _) => Mask::window_from_signed(l, 0).map_err(py_err)?,
        (false, -1, -1) => Mask::None,
        (false, l, r) => Mask::window_from_signed(l, r).map_err(py_err)?,
    };
    let mask = rename_window(mask);
    let mut o = Options::new().mask(mask);
    if let Some(s) = scale {
        o = o.scale(s);
    }
    if softcap != 0.0 {
        o = o.softcap(softcap);
    }
    Ok(o)
}

/// A window unbounded on both sides is no mask.
fn rename_window(m: Mask) -> Mask {
    match m {
        Mask::Window {
            left: None,
            right: None,
        } => Mask::None,
        m => m,
    }
}

/// Host bytes as elements (little-endian, as every platform fa4 runs on).
fn elems<T: FromBits>(name: &str, b: &[u8], want: usize) -> PyResult<Vec<T>> {
    let size = std::mem::size_of::<T>();
    if b.len() != want * size {
        return Err(PyValueError::new_err(format!(
            "invalid argument `{name}`: {} bytes for {want} elements of {size} bytes",
            b.len()
        )));
    }
    Ok(b.chunks_exact(size).map(T::from_le).collect())
}

fn to_bytes<T: FromBits>(v: &[T]) -> Vec<u8> {
    let mut out = Vec::with_capacity(std::mem::size_of_val(v));
    for x in v {
        x.put_le(&mut out);
    }
    out
}

/// The element types' byte forms.
trait FromBits: Copy {
    fn from_le(b: &[u8]) -> Self;
    fn put_le(&self, out: &mut Vec<u8>);
}

impl FromBits for f32 {
    fn from_le(b: &[u8]) -> Self {
        f32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
    fn put_le(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
}

impl FromBits for f16 {
    fn from_le(b: &[u8]) -> Self {
        f16::from_bits(u16::from_le_bytes([b[0], b[1]]))
    }
    fn put_le(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_bits().to_le_bytes());
    }
}

impl FromBits for bf16 {
    fn from_le(b: &[u8]) -> Self {
        bf16::from_bits(u16::from_le_bytes([b[0], b[1]]))
    }
    fn put_le(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_bits().to_le_bytes());
    }
}

impl FromBits for F8E4M3 {
    fn from_le(b: &[u8]) -> Self {
        F8E4M3::from_bits(b[0])
    }
    fn put_le(&self, out: &mut Vec<u8>) {
        out.push(self.to_bits());
    }
}

impl FromBits for i32 {
    fn from_le(b: &[u8]) -> Self {
        i32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
    fn put_le(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
}

fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// A CPU backend with `threads` threads (0: all cores).
fn cpu_backend(threads: usize) -> Backend {
    if threads == 0 {
        Backend::Cpu
    } else {
        Backend::CpuWith(fa4::cpu::CpuBackend {
            threads: Some(threads),
            ..Default::default()
        })
    }
}

macro_rules! by_dtype {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            DType::Bf16 => {
                type $t = bf16;
                $body
            }
            DType::F16 => {
                type $t = f16;
                $body
            }
            DType::F32 => {
                type $t = f32;
                $body
            }
            DType::Fp8E4M3 => Err(PyValueError::new_err(
                "invalid argument `dtype`: fp8 inputs take the fp8 entry points (forward_fp8_cpu, forward_fp8_cuda), with descales",
            )),
        }
    };
}

// ---------------------------------------------------------------------------------------------
// CPU entry points: bytes in, bytearrays out.
// ---------------------------------------------------------------------------------------------

/// The forward on the CPU. Tensors are `(bytes, shape)`; `cu` are varlen offsets. Returns
/// `(out, lse)` as bytearrays (`lse` f32 `[batch, heads_q, seqlen_q]` or `[heads_q, total_q]`).
#[pyfunction]
#[pyo3(signature = (dtype, q, k, v, cu_seqlens_q, cu_seqlens_k, causal, window, scale, softcap, threads))]
#[allow(clippy::too_many_arguments)]
fn forward_cpu<'py>(
    py: Python<'py>,
    dtype: &str,
    q: (Bound<'py, PyBytes>, Vec<usize>),
    k: (Bound<'py, PyBytes>, Vec<usize>),
    v: (Bound<'py, PyBytes>, Vec<usize>),
    cu_seqlens_q: Option<Vec<i32>>,
    cu_seqlens_k: Option<Vec<i32>>,
    causal: bool,
    window: (i64, i64),
    scale: Option<f32>,
    softcap: f32,
    threads: usize,
) -> PyResult<(Bound<'py, PyByteArray>, Bound<'py, PyByteArray>)> {
    let dt = dtype_of(dtype)?;
    let opts = options(causal, window, scale, softcap)?;
    let (o_bytes, lse_bytes) = by_dtype!(dt, T => {
        let qd: Vec<T> = elems("q", q.0.as_bytes(), numel(&q.1))?;
        let kd: Vec<T> = elems("k", k.0.as_bytes(), numel(&k.1))?;
        let vd: Vec<T> = elems("v", v.0.as_bytes(), numel(&v.1))?;
        let mut o_shape = q.1.clone();
        if let (Some(last), Some(dv)) = (o_shape.last_mut(), v.1.last()) {
            *last = *dv;
        }
        let mut od = vec![T::default(); numel(&o_shape)];
        let heads_q = if q.1.len() == 4 { q.1[2] } else { q.1.get(1).copied().unwrap_or(0) };
        let rows = if q.1.len() == 4 { q.1[0] * q.1[1] } else { q.1.first().copied().unwrap_or(0) };
        let mut lse = vec![0f32; rows * heads_q];
        let backend = cpu_backend(threads);
        py.detach(|| -> fa4::Result<()> {
            let qt = Tensor::new(&qd, &q.1)?;
            let kt = Tensor::new(&kd, &k.1)?;
            let vt = Tensor::new(&vd, &v.1)?;
            let mut ot = TensorMut::new(&mut od, &o_shape)?;
            match (&cu_seqlens_q, &cu_seqlens_k) {
                (Some(cq), Some(ck)) => backend.forward_varlen(&qt, &kt, &vt, cq, ck, &mut ot, Some(&mut lse), &opts),
                (None, None) => backend.forward(&qt, &kt, &vt, &mut ot, Some(&mut lse), &opts),
                _ => Err(fa4::Error::invalid("cu_seqlens_k", "give both cu_seqlens or neither")),
            }
        })
        .map_err(py_err)?;
        Ok::<_, PyErr>((to_bytes(&od), to_bytes(&lse)))
    })?;
    Ok((
        PyByteArray::new(py, &o_bytes),
        PyByteArray::new(py, &lse_bytes),
    ))
}

/// A descale array from the host: f32 bytes, `[sequences, heads_kv]` (its length is checked
/// against the problem by [`Descales::validate`], which names the argument).
fn host_descale(name: &str, d: &Option<Bound<'_, PyBytes>>) -> PyResult<Option<Vec<f32>>> {
    d.as_ref()
        .map(|b| elems::<f32>(name, b.as_bytes(), b.as_bytes().len() / 4))
        .transpose()
}

/// The forward of fp8 (e4m3) inputs on the CPU: q, k, v are `(bytes, shape)` of e4m3 bytes,
/// the descales f32 bytes `[sequences, heads_kv]` (None: ones), `out_dtype` "bf16" or "fp16".
/// Returns `(out, lse)` as bytearrays, laid out as [`forward_cpu`]'s.
#[pyfunction]
#[pyo3(signature = (out_dtype, q, k, v, cu_seqlens_q, cu_seqlens_k, q_descale, k_descale, v_descale, causal, window, scale, softcap, threads))]
#[allow(clippy::too_many_arguments)]
fn forward_fp8_cpu<'py>(
    py: Python<'py>,
    out_dtype: &str,
    q: (Bound<'py, PyBytes>, Vec<usize>),
    k: (Bound<'py, PyBytes>, Vec<usize>),
    v: (Bound<'py, PyBytes>, Vec<usize>),
    cu_seqlens_q: Option<Vec<i32>>,
    cu_seqlens_k: Option<Vec<i32>>,
    q_descale: Option<Bound<'py, PyBytes>>,
    k_descale: Option<Bound<'py, PyBytes>>,
    v_descale: Option<Bound<'py, PyBytes>>,
    causal: bool,
    window: (i64, i64),
    scale: Option<f32>,
    softcap: f32,
    threads: usize,
) -> PyResult<(Bound<'py, PyByteArray>, Bound<'py, PyByteArray>)> {
    let odt = out_dtype_of(out_dtype)?;
    let opts = options(causal, window, scale, softcap)?;
    let qd: Vec<F8E4M3> = elems("q", q.0.as_bytes(), numel(&q.1))?;
    let kd: Vec<F8E4M3> = elems("k", k.0.as_bytes(), numel(&k.1))?;
    let vd: Vec<F8E4M3> = elems("v", v.0.as_bytes(), numel(&v.1))?;
    let dq = host_descale("q_descale", &q_descale)?;
    let dk = host_descale("k_descale", &k_descale)?;
    let dv = host_descale("v_descale", &v_descale)?;
    let mut o_shape = q.1.clone();
    if let (Some(last), Some(d)) = (o_shape.last_mut(), v.1.last()) {
        *last = *d;
    }
    let n_out = numel(&o_shape);
    let backend = cpu_backend(threads);
    let (o_bytes, lse) = py
        .detach(|| -> fa4::Result<(Vec<u8>, Vec<f32>)> {
            let p = Problem::new_fp8(
                odt,
                &Layout::new("q", &q.1, None)?,
                &Layout::new("k", &k.1, None)?,
                &Layout::new("v", &v.1, None)?,
                &Layout::new("out", &o_shape, None)?,
                cu_seqlens_q.as_deref(),
                cu_seqlens_k.as_deref(),
                &opts,
            )?;
            let ds = Descales::new(dq.as_deref(), dk.as_deref(), dv.as_deref());
            let mut lse = vec![0f32; p.lse_len()];
            let x = (&qd[..], &kd[..], &vd[..]);
            let o = match odt {
                DType::Bf16 => fp8_host::<bf16>(&backend, &p, x, &ds, n_out, &mut lse)?,
                _ => fp8_host::<f16>(&backend, &p, x, &ds, n_out, &mut lse)?,
            };
            Ok((o, lse))
        })
        .map_err(py_err)?;
    Ok((
        PyByteArray::new(py, &o_bytes),
        PyByteArray::new(py, &to_bytes(&lse)),
    ))
}

/// [`Backend::run_fp8`] into a fresh O of `n_out` elements of `O`, returned as bytes.
fn fp8_host<O: Element + FromBits + Default>(
    backend: &Backend,
    p: &Problem,
    (q, k, v): (&[F8E4M3], &[F8E4M3], &[F8E4M3]),
    ds: &Descales,
    n_out: usize,
    lse: &mut [f32],
) -> fa4::Result<Vec<u8>> {
    let mut o = vec![O::default(); n_out];
    backend.run_fp8(p, q, k, v, ds, &mut o, Some(lse))?;
    Ok(to_bytes(&o))
}

/// The backward on the CPU: `(dq, dk, dv)` as bytearrays, shaped as q, k, v.
#[pyfunction]
#[pyo3(signature = (dtype, q, k, v, out, lse, d_out, cu_seqlens_q, cu_seqlens_k, causal, window, scale, softcap, threads))]
#[allow(clippy::too_many_arguments)]
fn backward_cpu<'py>(
    py: Python<'py>,
    dtype: &str,
    q: (Bound<'py, PyBytes>, Vec<usize>),
    k: (Bound<'py, PyBytes>, Vec<usize>),
    v: (Bound<'py, PyBytes>, Vec<usize>),
    out: (Bound<'py, PyBytes>, Vec<usize>),
    lse: Bound<'py, PyBytes>,
    d_out: (Bound<'py, PyBytes>, Vec<usize>),
    cu_seqlens_q: Option<Vec<i32>>,
    cu_seqlens_k: Option<Vec<i32>>,
    causal: bool,
    window: (i64, i64),
    scale: Option<f32>,
    softcap: f32,
    threads: usize,
) -> PyResult<(
    Bound<'py, PyByteArray>,
    Bound<'py, PyByteArray>,
    Bound<'py, PyByteArray>,
)> {
    let dt = dtype_of(dtype)?;
    let opts: BackwardOptions = options(causal, window, scale, softcap)?.into();
    let grads = by_dtype!(dt, T => {
        let qd: Vec<T> = elems("q", q.0.as_bytes(), numel(&q.1))?;
        let kd: Vec<T> = elems("k", k.0.as_bytes(), numel(&k.1))?;
        let vd: Vec<T> = elems("v", v.0.as_bytes(), numel(&v.1))?;
        let od: Vec<T> = elems("out", out.0.as_bytes(), numel(&out.1))?;
        let dod: Vec<T> = elems("dout", d_out.0.as_bytes(), numel(&d_out.1))?;
        let lsed: Vec<f32> = elems("softmax_lse", lse.as_bytes(), lse.as_bytes().len() / 4)?;
        let mut dq = vec![T::default(); qd.len()];
        let mut dk = vec![T::default(); kd.len()];
        let mut dv = vec![T::default(); vd.len()];
        let backend = cpu_backend(threads);
        py.detach(|| -> fa4::Result<()> {
            let qt = Tensor::new(&qd, &q.1)?;
            let kt = Tensor::new(&kd, &k.1)?;
            let vt = Tensor::new(&vd, &v.1)?;
            let ot = Tensor::new(&od, &out.1)?;
            let dot = Tensor::new(&dod, &d_out.1)?;
            let mut dqt = TensorMut::new(&mut dq, &q.1)?;
            let mut dkt = TensorMut::new(&mut dk, &k.1)?;
            let mut dvt = TensorMut::new(&mut dv, &v.1)?;
            match (&cu_seqlens_q, &cu_seqlens_k) {
                (Some(cq), Some(ck)) => backend.backward_varlen(
                    &qt, &kt, &vt, cq, ck, &ot, &lsed, &dot, &mut dqt, &mut dkt, &mut dvt, &opts,
                ),
                (None, None) => backend.backward(
                    &qt, &kt, &vt, &ot, &lsed, &dot, &mut dqt, &mut dkt, &mut dvt, &opts,
                ),
                _ => Err(fa4::Error::invalid("cu_seqlens_k", "give both cu_seqlens or neither")),
            }
        })
        .map_err(py_err)?;
        Ok::<_, PyErr>((to_bytes(&dq), to_bytes(&dk), to_bytes(&dv)))
    })?;
    Ok((
        PyByteArray::new(py, &grads.0),
        PyByteArray::new(py, &grads.1),
        PyByteArray::new(py, &grads.2),
    ))
}

/// Paged decode on the CPU: `(out, lse, k_cache, v_cache)` as bytearrays (the caches with
/// `k_new`/`v_new` appended at `cache_seqlens`, when given).
#[pyfunction]
#[pyo3(signature = (dtype, q, k_cache, v_cache, block_table, cache_seqlens, k_new, v_new, causal, window, scale, softcap, num_splits, threads))]
#[allow(clippy::too_many_arguments)]
fn paged_cpu<'py>(
    py: Python<'py>,
    dtype: &str,
    q: HostArg<'py>,
    k_cache: HostArg<'py>,
    v_cache: HostArg<'py>,
    block_table: (Bound<'py, PyBytes>, usize),
    cache_seqlens: Vec<i32>,
    k_new: Option<HostArg<'py>>,
    v_new: Option<HostArg<'py>>,
    causal: bool,
    window: (i64, i64),
    scale: Option<f32>,
    softcap: f32,
    num_splits: usize,
    threads: usize,
) -> PyResult<Vec<Bound<'py, PyByteArray>>> {
    let dt = dtype_of(dtype)?;
    let popts = paged_options(causal, window, scale, softcap, num_splits)?;
    let (table, max_pages) = block_table_arg(&block_table)?;
    let parts = by_dtype!(dt, T => {
        let mut c = PagedHost::<T>::new(&q, &v_cache.1, &k_new, &v_new)?;
        let mut kc: Vec<T> = elems("k_cache", k_cache.0.as_bytes(), numel(&k_cache.1))?;
        let mut vc: Vec<T> = elems("v_cache", v_cache.0.as_bytes(), numel(&v_cache.1))?;
        let backend = cpu_backend(threads);
        py.detach(|| -> fa4::Result<()> {
            let mut seqlens = cache_seqlens.clone();
            if let Some((kn, vn, cu)) = &c.new {
                let (kl, vl) = (Layout::new("k_cache", &k_cache.1, None)?, Layout::new("v_cache", &v_cache.1, None)?);
                let cache = PagedCache::new(&kl, &vl, &table, max_pages, &seqlens)?;
                seqlens = fa4::paged::append(&cache, &mut kc, &mut vc, kn, vn, cu)?;
            }
            let kv = PagedKv::new(
                Tensor::new(&kc, &k_cache.1)?,
                Tensor::new(&vc, &v_cache.1)?,
                &table,
                max_pages,
                &seqlens,
            )?;
            let qt = Tensor::new(&c.q, &q.1)?;
            let mut ot = TensorMut::new(&mut c.out, &c.o_shape)?;
            backend.forward_paged(&qt, &kv, None, &mut ot, Some(&mut c.lse), &popts).map(drop)
        })
        .map_err(py_err_paged)?;
        Ok::<_, PyErr>(vec![to_bytes(&c.out), to_bytes(&c.lse), to_bytes(&kc), to_bytes(&vc)])
    })?;
    Ok(parts.iter().map(|b| PyByteArray::new(py, b)).collect())
}

/// Paged decode on the CPU over an fp8 e4m3 cache: `k_cache`/`v_cache` are `(bytes, shape)` of
/// e4m3 bytes, `k_scale`/`v_scale` f32 bytes of `heads_kv` entries (a stored byte of KV head `h`
/// stands for `k_scale[h]` times its value), `q` and the new rows `k_new`/`v_new` of `dtype`.
/// New rows are quantized with the scales into the caches at `cache_seqlens` first. Returns
/// `(out, lse, k_cache, v_cache)` as [`paged_cpu`]'s.
#[pyfunction]
#[pyo3(signature = (dtype, q, k_cache, v_cache, k_scale, v_scale, block_table, cache_seqlens, k_new, v_new, causal, window, scale, softcap, num_splits, threads))]
#[allow(clippy::too_many_arguments)]
fn paged_fp8_cpu<'py>(
    py: Python<'py>,
    dtype: &str,
    q: HostArg<'py>,
    k_cache: HostArg<'py>,
    v_cache: HostArg<'py>,
    k_scale: Bound<'py, PyBytes>,
    v_scale: Bound<'py, PyBytes>,
    block_table: (Bound<'py, PyBytes>, usize),
    cache_seqlens: Vec<i32>,
    k_new: Option<HostArg<'py>>,
    v_new: Option<HostArg<'py>>,
    causal: bool,
    window: (i64, i64),
    scale: Option<f32>,
    softcap: f32,
    num_splits: usize,
    threads: usize,
) -> PyResult<Vec<Bound<'py, PyByteArray>>> {
    let dt = dtype_of(dtype)?;
    let popts = paged_options(causal, window, scale, softcap, num_splits)?;
    let (table, max_pages) = block_table_arg(&block_table)?;
    let ks: Vec<f32> = elems("k_scale", k_scale.as_bytes(), k_scale.as_bytes().len() / 4)?;
    let vs: Vec<f32> = elems("v_scale", v_scale.as_bytes(), v_scale.as_bytes().len() / 4)?;
    let mut kc: Vec<F8E4M3> = elems("k_cache", k_cache.0.as_bytes(), numel(&k_cache.1))?;
    let mut vc: Vec<F8E4M3> = elems("v_cache", v_cache.0.as_bytes(), numel(&v_cache.1))?;
    let parts = by_dtype!(dt, T => {
        let mut c = PagedHost::<T>::new(&q, &v_cache.1, &k_new, &v_new)?;
        let backend = cpu_backend(threads);
        py.detach(|| -> fa4::Result<()> {
            let scales = KvScales { k: &ks, v: &vs };
            let mut seqlens = cache_seqlens.clone();
            if let Some((kn, vn, cu)) = &c.new {
                let (kl, vl) = (Layout::new("k_cache", &k_cache.1, None)?, Layout::new("v_cache", &v_cache.1, None)?);
                let cache = PagedCache::new(&kl, &vl, &table, max_pages, &seqlens)?;
                seqlens = fa4::paged::append_fp8(&cache, &mut kc, &mut vc, kn, vn, cu, &scales)?;
            }
            let kv = PagedKv::new(
                Tensor::new(&kc, &k_cache.1)?,
                Tensor::new(&vc, &v_cache.1)?,
                &table,
                max_pages,
                &seqlens,
            )?;
            let qt = Tensor::new(&c.q, &q.1)?;
            let mut ot = TensorMut::new(&mut c.out, &c.o_shape)?;
            backend.forward_paged_fp8(&qt, &kv, &scales, None, &mut ot, Some(&mut c.lse), &popts).map(drop)
        })
        .map_err(py_err_paged)?;
        Ok::<_, PyErr>(vec![to_bytes(&c.out), to_bytes(&c.lse)])
    })?;
    let mut out: Vec<Bound<'py, PyByteArray>> =
        parts.iter().map(|b| PyByteArray::new(py, b)).collect();
    out.push(PyByteArray::new(py, &to_bytes(&kc)));
    out.push(PyByteArray::new(py, &to_bytes(&vc)));
    Ok(out)
}

/// A host array as the Python side passes it: its bytes and its shape.
type HostArg<'py> = (Bound<'py, PyBytes>, Vec<usize>);

/// A paged call's options (`num_splits` 0: the planner's choice).
fn paged_options(
    causal: bool,
    window: (i64, i64),
    scale: Option<f32>,
    softcap: f32,
    num_splits: usize,
) -> PyResult<PagedOptions> {
    let popts = PagedOptions::new(options(causal, window, scale, softcap)?);
    Ok(if num_splits > 0 {
        popts.num_splits(num_splits)
    } else {
        popts
    })
}

/// What the paged CPU entries share for queries and outputs of `T`: the query, the new K/V rows
/// (both or neither) with their offsets, and the output and LSE buffers.
struct PagedHost<T> {
    q: Vec<T>,
    new: Option<(Vec<T>, Vec<T>, Vec<i32>)>,
    o_shape: Vec<usize>,
    out: Vec<T>,
    lse: Vec<f32>,
}

impl<T: FromBits + Default> PagedHost<T> {
    /// `q` `[batch, seqlen_q, heads, dim]`, the cache of V of shape `v_shape` (its last entry is
    /// O's head dim), new rows `[batch, seqlen_new, heads_kv, dim]`.
    fn new(
        q: &HostArg<'_>,
        v_shape: &[usize],
        k_new: &Option<HostArg<'_>>,
        v_new: &Option<HostArg<'_>>,
    ) -> PyResult<Self> {
        let new = match new_pair(k_new, v_new).map_err(py_err_paged)? {
            Some((kn, vn)) => {
                let (b, s) = new_rows(&kn.1).map_err(py_err_paged)?;
                Some((
                    elems::<T>("k", kn.0.as_bytes(), numel(&kn.1))?,
                    elems::<T>("v", vn.0.as_bytes(), numel(&vn.1))?,
                    (0..=b).map(|i| (i * s) as i32).collect(),
                ))
            }
            None => None,
        };
        let mut o_shape = q.1.clone();
        if let (Some(last), Some(dv)) = (o_shape.last_mut(), v_shape.last()) {
            *last = *dv;
        }
        Ok(PagedHost {
            q: elems("q", q.0.as_bytes(), numel(&q.1))?,
            new,
            out: vec![T::default(); numel(&o_shape)],
            o_shape,
            lse: vec![0f32; q.1.iter().take(3).product::<usize>()],
        })
    }
}

/// `(batch, seqlen_new)` of new K/V rows `[batch, seqlen_new, heads_kv, dim]`.
fn new_rows(shape: &[usize]) -> fa4::Result<(usize, usize)> {
    match shape {
        [b, s, _, _] => Ok((*b, *s)),
        _ => Err(fa4::Error::invalid(
            "k",
            format!("expected [batch, seqlen_new, heads_kv, head_dim], got {shape:?}"),
        )),
    }
}

/// The exact merge of split-KV partial results (`fa4::combine`): `o_parts` f32
/// `[n_splits, rows, dv]`, `lse_parts` `[n_splits, rows]`; returns `(out, lse)` bytearrays.
#[pyfunction]
fn combine<'py>(
    py: Python<'py>,
    o_parts: Bound<'py, PyBytes>,
    lse_parts: Bound<'py, PyBytes>,
    n_splits: usize,
    rows: usize,
    dv: usize,
) -> PyResult<(Bound<'py, PyByteArray>, Bound<'py, PyByteArray>)> {
    let o: Vec<f32> = elems("o_parts", o_parts.as_bytes(), o_parts.as_bytes().len() / 4)?;
    let l: Vec<f32> = elems(
        "lse_parts",
        lse_parts.as_bytes(),
        lse_parts.as_bytes().len() / 4,
    )?;
    let parts = fa4::combine::Partials::new(&o, &l, n_splits, rows, dv).map_err(py_err)?;
    let mut out = vec![0f32; rows * dv];
    let mut lse = vec![0f32; rows];
    parts
        .combine_into(&mut out, Some(&mut lse))
        .map_err(py_err)?;
    Ok((
        PyByteArray::new(py, &to_bytes(&out)),
        PyByteArray::new(py, &to_bytes(&lse)),
    ))
}

// ---------------------------------------------------------------------------------------------
// CUDA entry points: device addresses, the caller's stream, no copies.
// ---------------------------------------------------------------------------------------------

/// One backend per (device, stream), with the paged tables made for it.
struct StreamBackend {
    key: (usize, u64),
    cuda: CudaBackend,
    tables: Vec<PagedTables>,
}

static BACKENDS: Mutex<Vec<StreamBackend>> = Mutex::new(Vec::new());

/// Paged tables kept per stream: one per distinct (page table, lengths), as a model's layers
/// share them within a step.
const TABLES_PER_STREAM: usize = 8;

/// Runs `f` with the backend of `(ordinal, stream)`, made on first use.
fn with_backend<R>(
    ordinal: usize,
    stream: u64,
    f: impl FnOnce(&mut StreamBackend) -> fa4::Result<R>,
) -> fa4::Result<R> {
    let mut all = BACKENDS.lock().unwrap_or_else(|p| p.into_inner());
    let key = (ordinal, stream);
    let i = match all.iter().position(|b| b.key == key) {
        Some(i) => i,
        None => {
            // Opening a backend first names a missing driver or device as the crate does.
            CudaBackend::new(ordinal)?;
            let ctx = CudaContext::new(ordinal).map_err(|e| fa4::Error::Cuda {
                op: "cuDevicePrimaryCtxRetain".into(),
                code: Some(e.0 as u32),
                name: format!("{:?}", e.0),
                message: e.to_string(),
            })?;
            // SAFETY: the stream is PyTorch's (`torch.cuda.current_stream(device).cuda_stream`)
            // on this device's primary context, which PyTorch also uses; PyTorch keeps its
            // streams alive for the life of the process. Work is ordered by launching only on
            // it, and fa4's own buffers are only used on it, so cudarc's event tracking, which
            // orders buffers across streams, is not needed.
            let s = unsafe {
                ctx.disable_event_tracking();
                ctx.wrap_borrowed_stream(stream as CUstream)
            };
            all.push(StreamBackend {
                key,
                cuda: CudaBackend::on_stream(s)?,
                tables: Vec::new(),
            });
            all.len() - 1
        }
    };
    f(&mut all[i])
}

/// The CUDA kernels' refusal of a dtype they do not compute.
fn not_on_cuda(dt: DType) -> fa4::Error {
    fa4::Error::invalid(
        "q",
        format!("the CUDA kernels compute bfloat16 and float16, got {dt}"),
    )
}

/// A device tensor from Python: address, shape, element strides.
type DevArg = (u64, Vec<usize>, Vec<usize>);

fn layout(name: &str, a: &DevArg) -> fa4::Result<Layout> {
    Layout::new(name, &a.1, Some(&a.2))
}

/// Wraps `name`'s address for `len` elements.
fn foreign<T>(
    cuda: &CudaBackend,
    name: &str,
    ptr: u64,
    len: usize,
) -> fa4::Result<ForeignBuffer<T>> {
    // SAFETY: the Python layer passes `data_ptr()`s of tensors it holds until the call returns,
    // and the work is enqueued on PyTorch's current stream, on which PyTorch's allocator orders
    // any reuse of their memory; the range is checked against the driver's allocation.
    unsafe { ForeignBuffer::new(name, ptr, len, cuda.stream()) }
}

fn extent(l: &Layout) -> usize {
    l.extent().unwrap_or(0)
}

/// The forward on the GPU: writes `out` and `lse` (f32, contiguous) in place.
#[pyfunction]
#[pyo3(signature = (device, stream, dtype, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal, window, scale, softcap))]
#[allow(clippy::too_many_arguments)]
fn forward_cuda(
    py: Python<'_>,
    device: usize,
    stream: u64,
    dtype: &str,
    q: DevArg,
    k: DevArg,
    v: DevArg,
    out: DevArg,
    lse: u64,
    cu_seqlens_q: Option<Vec<i32>>,
    cu_seqlens_k: Option<Vec<i32>>,
    causal: bool,
    window: (i64, i64),
    scale: Option<f32>,
    softcap: f32,
) -> PyResult<()> {
    let dt = dtype_of(dtype)?;
    let opts = options(causal, window, scale, softcap)?;
    py.detach(|| {
        with_backend(device, stream, |sb| {
            let (ql, kl, vl, ol) = (
                layout("q", &q)?,
                layout("k", &k)?,
                layout("v", &v)?,
                layout("out", &out)?,
            );
            let p = Problem::new(
                dt,
                &ql,
                &kl,
                &vl,
                &ol,
                cu_seqlens_q.as_deref(),
                cu_seqlens_k.as_deref(),
                &opts,
            )?;
            let lse_len = p.lse_len();
            match dt {
                DType::Bf16 => fwd_dev::<bf16>(&sb.cuda, &p, &q, &k, &v, &out, lse, lse_len),
                DType::F16 => fwd_dev::<f16>(&sb.cuda, &p, &q, &k, &v, &out, lse, lse_len),
                _ => Err(not_on_cuda(dt)),
            }
        })
    })
    .map_err(py_err)
}

#[allow(clippy::too_many_arguments)]
fn fwd_dev<T: Element>(
    cuda: &CudaBackend,
    p: &Problem,
    q: &DevArg,
    k: &DevArg,
    v: &DevArg,
    out: &DevArg,
    lse: u64,
    lse_len: usize,
) -> fa4::Result<()> {
    let qb = foreign::<T>(cuda, "q", q.0, extent(p.q_layout()))?;
    let kb = foreign::<T>(cuda, "k", k.0, extent(p.k_layout()))?;
    let vb = foreign::<T>(cuda, "v", v.0, extent(p.v_layout()))?;
    let mut ob = foreign::<T>(cuda, "out", out.0, extent(p.o_layout()))?;
    let mut lb = foreign::<f32>(cuda, "softmax_lse", lse, lse_len)?;
    cuda.forward_device_views(p, &qb, &kb, &vb, &mut ob, Some(&mut lb))
}

/// A device descale from Python: address and element count (f32, `[sequences, heads_kv]`,
/// contiguous; the Python layer checked shape, dtype and device).
type DevDescale = (u64, usize);

/// The forward of fp8 (e4m3) inputs on the GPU (a Hopper GPU; elsewhere an error naming
/// `dtype`): q, k, v e4m3 device tensors, the descales device f32 (None: ones), `out` of
/// `out_dtype` ("bf16" or "fp16"); writes `out` and `lse` (f32, contiguous) in place. The
/// descales are not read back: an entry that is not finite and positive makes its rows NaN.
#[pyfunction]
#[pyo3(signature = (device, stream, out_dtype, q, k, v, out, lse, q_descale, k_descale, v_descale, cu_seqlens_q, cu_seqlens_k, causal, window, scale, softcap))]
#[allow(clippy::too_many_arguments)]
fn forward_fp8_cuda(
    py: Python<'_>,
    device: usize,
    stream: u64,
    out_dtype: &str,
    q: DevArg,
    k: DevArg,
    v: DevArg,
    out: DevArg,
    lse: u64,
    q_descale: Option<DevDescale>,
    k_descale: Option<DevDescale>,
    v_descale: Option<DevDescale>,
    cu_seqlens_q: Option<Vec<i32>>,
    cu_seqlens_k: Option<Vec<i32>>,
    causal: bool,
    window: (i64, i64),
    scale: Option<f32>,
    softcap: f32,
) -> PyResult<()> {
    let odt = out_dtype_of(out_dtype)?;
    let opts = options(causal, window, scale, softcap)?;
    let descales = [q_descale, k_descale, v_descale];
    py.detach(|| {
        with_backend(device, stream, |sb| {
            let p = Problem::new_fp8(
                odt,
                &layout("q", &q)?,
                &layout("k", &k)?,
                &layout("v", &v)?,
                &layout("out", &out)?,
                cu_seqlens_q.as_deref(),
                cu_seqlens_k.as_deref(),
                &opts,
            )?;
            let x = Fp8Args {
                q: &q,
                k: &k,
                v: &v,
                out: &out,
                lse,
                descales: &descales,
            };
            match odt {
                DType::Bf16 => fp8_dev::<bf16>(&sb.cuda, &p, &x),
                _ => fp8_dev::<f16>(&sb.cuda, &p, &x),
            }
        })
    })
    .map_err(py_err)
}

struct Fp8Args<'a> {
    q: &'a DevArg,
    k: &'a DevArg,
    v: &'a DevArg,
    out: &'a DevArg,
    lse: u64,
    descales: &'a [Option<DevDescale>; 3],
}

fn fp8_dev<O: Element>(cuda: &CudaBackend, p: &Problem, a: &Fp8Args<'_>) -> fa4::Result<()> {
    let qb = foreign::<F8E4M3>(cuda, "q", a.q.0, extent(p.q_layout()))?;
    let kb = foreign::<F8E4M3>(cuda, "k", a.k.0, extent(p.k_layout()))?;
    let vb = foreign::<F8E4M3>(cuda, "v", a.v.0, extent(p.v_layout()))?;
    let mut ob = foreign::<O>(cuda, "out", a.out.0, extent(p.o_layout()))?;
    let mut lb = foreign::<f32>(cuda, "softmax_lse", a.lse, p.lse_len())?;
    let mut ds: [Option<ForeignBuffer<f32>>; 3] = [None, None, None];
    for (slot, (name, d)) in ds.iter_mut().zip(
        ["q_descale", "k_descale", "v_descale"]
            .into_iter()
            .zip(a.descales),
    ) {
        if let Some((ptr, len)) = d {
            *slot = Some(foreign::<f32>(cuda, name, *ptr, *len)?);
        }
    }
    let descales = DeviceDescales {
        q: ds[0].as_ref(),
        k: ds[1].as_ref(),
        v: ds[2].as_ref(),
    };
    cuda.forward_fp8_device(p, &qb, &kb, &vb, &descales, &mut ob, Some(&mut lb))
}

/// The backward on the GPU: writes `dq`, `dk`, `dv` in place.
#[pyfunction]
#[pyo3(signature = (device, stream, dtype, q, k, v, out, lse, d_out, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, causal, window, scale, softcap, deterministic))]
#[allow(clippy::too_many_arguments)]
fn backward_cuda(
    py: Python<'_>,
    device: usize,
    stream: u64,
    dtype: &str,
    q: DevArg,
    k: DevArg,
    v: DevArg,
    out: DevArg,
    lse: u64,
    d_out: DevArg,
    dq: DevArg,
    dk: DevArg,
    dv: DevArg,
    cu_seqlens_q: Option<Vec<i32>>,
    cu_seqlens_k: Option<Vec<i32>>,
    causal: bool,
    window: (i64, i64),
    scale: Option<f32>,
    softcap: f32,
    deterministic: bool,
) -> PyResult<()> {
    let dt = dtype_of(dtype)?;
    let opts = options(causal, window, scale, softcap)?;
    py.detach(|| {
        with_backend(device, stream, |sb| {
            let p = Problem::new(
                dt,
                &layout("q", &q)?,
                &layout("k", &k)?,
                &layout("v", &v)?,
                &layout("out", &out)?,
                cu_seqlens_q.as_deref(),
                cu_seqlens_k.as_deref(),
                &opts,
            )?;
            let args = BwdArgs {
                q: &q,
                k: &k,
                v: &v,
                out: &out,
                lse,
                d_out: &d_out,
                dq: &dq,
                dk: &dk,
                dv: &dv,
            };
            match dt {
                DType::Bf16 => bwd_dev::<bf16>(&sb.cuda, &p, &args, deterministic),
                DType::F16 => bwd_dev::<f16>(&sb.cuda, &p, &args, deterministic),
                _ => Err(not_on_cuda(dt)),
            }
        })
    })
    .map_err(py_err)
}

struct BwdArgs<'a> {
    q: &'a DevArg,
    k: &'a DevArg,
    v: &'a DevArg,
    out: &'a DevArg,
    lse: u64,
    d_out: &'a DevArg,
    dq: &'a DevArg,
    dk: &'a DevArg,
    dv: &'a DevArg,
}

fn bwd_dev<T: Element>(
    cuda: &CudaBackend,
    p: &Problem,
    a: &BwdArgs<'_>,
    deterministic: bool,
) -> fa4::Result<()> {
    let (dol, dql, dkl, dvl) = (
        layout("dout", a.d_out)?,
        layout("dq", a.dq)?,
        layout("dk", a.dk)?,
        layout("dv", a.dv)?,
    );
    let qb = foreign::<T>(cuda, "q", a.q.0, extent(p.q_layout()))?;
    let kb = foreign::<T>(cuda, "k", a.k.0, extent(p.k_layout()))?;
    let vb = foreign::<T>(cuda, "v", a.v.0, extent(p.v_layout()))?;
    let ob = foreign::<T>(cuda, "out", a.out.0, extent(p.o_layout()))?;
    let lb = foreign::<f32>(cuda, "softmax_lse", a.lse, p.lse_len())?;
    let dob = foreign::<T>(cuda, "dout", a.d_out.0, extent(&dol))?;
    let mut dqb = foreign::<T>(cuda, "dq", a.dq.0, extent(&dql))?;
    let mut dkb = foreign::<T>(cuda, "dk", a.dk.0, extent(&dkl))?;
    let mut dvb = foreign::<T>(cuda, "dv", a.dv.0, extent(&dvl))?;
    let x = BwdDeviceInputs {
        q: &qb,
        k: &kb,
        v: &vb,
        out: &ob,
        lse: &lb,
        d_out: &dob,
        d_out_layout: dol,
        cu_seqlens: None,
    };
    let mut o = BwdDeviceOutputs {
        dq: &mut dqb,
        dq_layout: dql,
        dk: &mut dkb,
        dk_layout: dkl,
        dv: &mut dvb,
        dv_layout: dvl,
    };
    cuda.backward_device_views(p, &x, &mut o, deterministic)
}

/// Paged decode on the GPU: appends `k_new`/`v_new` (when given) at `cache_seqlens`, then
/// attends; writes `out` and `lse` in place. `block_table` and `cache_seqlens` are host
/// values: the table is validated against the cache before any kernel reads it.
#[pyfunction]
#[pyo3(signature = (device, stream, dtype, q, k_cache, v_cache, out, lse, block_table, cache_seqlens, k_new, v_new, causal, window, scale, softcap, num_splits))]
#[allow(clippy::too_many_arguments)]
fn paged_cuda<'py>(
    py: Python<'py>,
    device: usize,
    stream: u64,
    dtype: &str,
    q: DevArg,
    k_cache: DevArg,
    v_cache: DevArg,
    out: DevArg,
    lse: u64,
    block_table: (Bound<'py, PyBytes>, usize),
    cache_seqlens: Vec<i32>,
    k_new: Option<DevArg>,
    v_new: Option<DevArg>,
    causal: bool,
    window: (i64, i64),
    scale: Option<f32>,
    softcap: f32,
    num_splits: usize,
) -> PyResult<()> {
    let dt = dtype_of(dtype)?;
    let opts = options(causal, window, scale, softcap)?;
    let splits = (num_splits > 0).then_some(num_splits);
    let block_table = block_table_arg(&block_table)?;
    py.detach(|| {
        with_backend(device, stream, |sb| {
            let a = PagedArgs {
                q: &q,
                k_cache: &k_cache,
                v_cache: &v_cache,
                out: &out,
                lse,
                block_table: &block_table,
                cache_seqlens: &cache_seqlens,
                new: new_pair(&k_new, &v_new)?,
            };
            match dt {
                DType::Bf16 => paged_dev::<bf16>(sb, &a, &opts, splits),
                DType::F16 => paged_dev::<f16>(sb, &a, &opts, splits),
                _ => Err(not_on_cuda(dt)),
            }
        })
    })
    .map_err(py_err_paged)
}

/// A block table as the Python side passes it: int32 bytes and the row width (pages per
/// sequence).
fn block_table_arg(bt: &(Bound<'_, PyBytes>, usize)) -> PyResult<(Vec<i32>, usize)> {
    let bytes = bt.0.as_bytes();
    Ok((elems("block_table", bytes, bytes.len() / 4)?, bt.1))
}

/// The new K/V rows, both or neither.
fn new_pair<'a, A>(k: &'a Option<A>, v: &'a Option<A>) -> fa4::Result<Option<(&'a A, &'a A)>> {
    match (k, v) {
        (Some(k), Some(v)) => Ok(Some((k, v))),
        (None, None) => Ok(None),
        _ => Err(fa4::Error::invalid("v", "give k and v together")),
    }
}

struct PagedArgs<'a> {
    q: &'a DevArg,
    k_cache: &'a DevArg,
    v_cache: &'a DevArg,
    out: &'a DevArg,
    lse: u64,
    block_table: &'a (Vec<i32>, usize),
    cache_seqlens: &'a [i32],
    new: Option<(&'a DevArg, &'a DevArg)>,
}

/// New K/V rows on the device (`k_new` and `v_new` contiguous `[batch, seqlen_new, heads_kv,
/// dim]`) and their offsets `cu_new`.
fn new_rows_dev<T>(
    cuda: &CudaBackend,
    (kn, vn): (&DevArg, &DevArg),
) -> fa4::Result<(ForeignBuffer<T>, ForeignBuffer<T>, Vec<i32>)> {
    let (knl, vnl) = (layout("k", kn)?, layout("v", vn)?);
    let (b, s) = new_rows(&kn.1)?;
    for (name, l, a) in [("k", &knl, kn), ("v", &vnl, vn)] {
        if l.strides != Layout::new(name, &a.1, None)?.strides {
            return Err(fa4::Error::invalid(name, "new rows must be contiguous"));
        }
    }
    let knb = foreign::<T>(cuda, "k", kn.0, extent(&knl))?;
    let vnb = foreign::<T>(cuda, "v", vn.0, extent(&vnl))?;
    let cu: Vec<i32> = (0..=b).map(|i| (i * s) as i32).collect();
    Ok((knb, vnb, cu))
}

/// The index in `sb.tables` of the paged tables for `p`'s cache, made (and the oldest dropped
/// past [`TABLES_PER_STREAM`]) when none matches.
fn tables_for(sb: &mut StreamBackend, p: &PagedProblem) -> fa4::Result<usize> {
    if let Some(i) = sb.tables.iter().position(|t| t.matches(p)) {
        return Ok(i);
    }
    if sb.tables.len() >= TABLES_PER_STREAM {
        sb.tables.remove(0);
    }
    let t = sb.cuda.paged_tables(p)?;
    sb.tables.push(t);
    Ok(sb.tables.len() - 1)
}

fn paged_dev<T: Element>(
    sb: &mut StreamBackend,
    a: &PagedArgs<'_>,
    opts: &Options,
    splits: Option<usize>,
) -> fa4::Result<()> {
    let cuda = sb.cuda.clone();
    let (kl, vl) = (layout("k_cache", a.k_cache)?, layout("v_cache", a.v_cache)?);
    let mut kc = foreign::<T>(&cuda, "k_cache", a.k_cache.0, extent(&kl))?;
    let mut vc = foreign::<T>(&cuda, "v_cache", a.v_cache.0, extent(&vl))?;
    let (table, max_pages) = (&a.block_table.0, a.block_table.1);
    let mut seqlens = a.cache_seqlens.to_vec();
    if let Some(new) = a.new {
        let cache = PagedCache::new(&kl, &vl, table, max_pages, &seqlens)?;
        let (knb, vnb, cu) = new_rows_dev::<T>(&cuda, new)?;
        seqlens = cuda.append_paged(&cache, &mut kc, &mut vc, &knb, &vnb, &cu)?;
    }
    let cache = PagedCache::new(&kl, &vl, table, max_pages, &seqlens)?;
    let (ql, ol) = (layout("q", a.q)?, layout("out", a.out)?);
    let p = PagedProblem::new(T::DTYPE, &ql, &ol, &cache, None, opts)?;
    let qb = foreign::<T>(&cuda, "q", a.q.0, extent(&ql))?;
    let mut ob = foreign::<T>(&cuda, "out", a.out.0, extent(&ol))?;
    let mut lb = foreign::<f32>(&cuda, "softmax_lse", a.lse, p.lse_len())?;
    let i = tables_for(sb, &p)?;
    cuda.forward_paged_views(
        &p,
        &mut sb.tables[i],
        &qb,
        &kc,
        &vc,
        &mut ob,
        Some(&mut lb),
        splits,
    )?;
    Ok(())
}

/// Paged decode on the GPU over an fp8 e4m3 cache: [`paged_cuda`]'s arguments with e4m3
/// `k_cache`/`v_cache` and the scales `k_scale`/`v_scale` as `(address, length)` of f32 device
/// arrays of `heads_kv` entries (not read back: each must be finite and > 0). New rows
/// (`k_new`/`v_new`, of `dtype`) are quantized with the scales into the caches first.
#[pyfunction]
#[pyo3(signature = (device, stream, dtype, q, k_cache, v_cache, k_scale, v_scale, out, lse, block_table, cache_seqlens, k_new, v_new, causal, window, scale, softcap, num_splits))]
#[allow(clippy::too_many_arguments)]
fn paged_fp8_cuda<'py>(
    py: Python<'py>,
    device: usize,
    stream: u64,
    dtype: &str,
    q: DevArg,
    k_cache: DevArg,
    v_cache: DevArg,
    k_scale: DevDescale,
    v_scale: DevDescale,
    out: DevArg,
    lse: u64,
    block_table: (Bound<'py, PyBytes>, usize),
    cache_seqlens: Vec<i32>,
    k_new: Option<DevArg>,
    v_new: Option<DevArg>,
    causal: bool,
    window: (i64, i64),
    scale: Option<f32>,
    softcap: f32,
    num_splits: usize,
) -> PyResult<()> {
    let dt = dtype_of(dtype)?;
    let opts = options(causal, window, scale, softcap)?;
    let splits = (num_splits > 0).then_some(num_splits);
    let block_table = block_table_arg(&block_table)?;
    py.detach(|| {
        with_backend(device, stream, |sb| {
            let a = PagedArgs {
                q: &q,
                k_cache: &k_cache,
                v_cache: &v_cache,
                out: &out,
                lse,
                block_table: &block_table,
                cache_seqlens: &cache_seqlens,
                new: new_pair(&k_new, &v_new)?,
            };
            let scales = (k_scale, v_scale);
            match dt {
                DType::Bf16 => paged_fp8_dev::<bf16>(sb, &a, scales, &opts, splits),
                DType::F16 => paged_fp8_dev::<f16>(sb, &a, scales, &opts, splits),
                _ => Err(not_on_cuda(dt)),
            }
        })
    })
    .map_err(py_err_paged)
}

fn paged_fp8_dev<T: Element>(
    sb: &mut StreamBackend,
    a: &PagedArgs<'_>,
    (k_scale, v_scale): (DevDescale, DevDescale),
    opts: &Options,
    splits: Option<usize>,
) -> fa4::Result<()> {
    let cuda = sb.cuda.clone();
    let (kl, vl) = (layout("k_cache", a.k_cache)?, layout("v_cache", a.v_cache)?);
    let mut kc = foreign::<F8E4M3>(&cuda, "k_cache", a.k_cache.0, extent(&kl))?;
    let mut vc = foreign::<F8E4M3>(&cuda, "v_cache", a.v_cache.0, extent(&vl))?;
    let ks = foreign::<f32>(&cuda, "k_scale", k_scale.0, k_scale.1)?;
    let vs = foreign::<f32>(&cuda, "v_scale", v_scale.0, v_scale.1)?;
    let scales = DeviceKvScales { k: &ks, v: &vs };
    let (table, max_pages) = (&a.block_table.0, a.block_table.1);
    let mut seqlens = a.cache_seqlens.to_vec();
    if let Some(new) = a.new {
        let cache = PagedCache::new(&kl, &vl, table, max_pages, &seqlens)?;
        let (knb, vnb, cu) = new_rows_dev::<T>(&cuda, new)?;
        seqlens = cuda.append_paged_fp8(&cache, &mut kc, &mut vc, &knb, &vnb, &cu, &scales)?;
    }
    let cache = PagedCache::new(&kl, &vl, table, max_pages, &seqlens)?;
    let (ql, ol) = (layout("q", a.q)?, layout("out", a.out)?);
    let p = PagedProblem::new(T::DTYPE, &ql, &ol, &cache, None, opts)?.with_fp8_cache();
    let qb = foreign::<T>(&cuda, "q", a.q.0, extent(&ql))?;
    let mut ob = foreign::<T>(&cuda, "out", a.out.0, extent(&ol))?;
    let mut lb = foreign::<f32>(&cuda, "softmax_lse", a.lse, p.lse_len())?;
    let i = tables_for(sb, &p)?;
    cuda.forward_paged_fp8_device(
        &p,
        &mut sb.tables[i],
        &qb,
        &kc,
        &vc,
        &scales,
        &mut ob,
        Some(&mut lb),
        splits,
    )?;
    Ok(())
}

/// FA4Config's fields, constants and methods for one configuration, as JSON (the Python layer
/// returns it as a dict).
#[pyfunction]
#[pyo3(signature = (depth, num_q_heads=32, group=1, dtype="bf16", swizzle="128B"))]
fn plan(depth: u32, num_q_heads: u32, group: u32, dtype: &str, swizzle: &str) -> PyResult<String> {
    use fa4::config::sm100::{FA4Config, FA4Inputs, Swizzle};
    let dtype_size = match dtype {
        "bf16" | "fp16" => 2,
        "fp8" => 1,
        "f32" => 4,
        other => {
            return Err(PyValueError::new_err(format!(
                "invalid argument `dtype`: expected bf16, fp16, fp8 or f32, got {other}"
            )))
        }
    };
    let swizzle_mode = match swizzle {
        "none" => Swizzle::None,
        "32B" => Swizzle::B32,
        "64B" => Swizzle::B64,
        "128B" => Swizzle::B128,
        other => {
            return Err(PyValueError::new_err(format!(
                "invalid argument `swizzle`: expected none, 32B, 64B or 128B, got {other}"
            )))
        }
    };
    let cfg = FA4Config::new(FA4Inputs {
        num_q_heads,
        group,
        depth,
        dtype_size,
        swizzle_mode,
    })
    .map_err(py_err)?;
    Ok(cfg.to_json())
}

/// What this build is: crate version and the commit it was built from.
#[pyfunction]
fn build_info() -> (String, String) {
    (
        env!("CARGO_PKG_VERSION").to_string(),
        option_env!("FA4_GIT_COMMIT")
            .unwrap_or("unknown")
            .to_string(),
    )
}

/// Whether a CUDA device and NVRTC are usable here, and why not.
#[pyfunction]
fn cuda_status() -> (bool, String) {
    let (b, why) = Backend::auto_explained();
    (matches!(b, Backend::Cuda(_)), why)
}

#[pymodule]
fn _fa4(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(forward_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(forward_fp8_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(backward_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(paged_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(paged_fp8_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(combine, m)?)?;
    m.add_function(wrap_pyfunction!(forward_cuda, m)?)?;
    m.add_function(wrap_pyfunction!(forward_fp8_cuda, m)?)?;
    m.add_function(wrap_pyfunction!(backward_cuda, m)?)?;
    m.add_function(wrap_pyfunction!(paged_cuda, m)?)?;
    m.add_function(wrap_pyfunction!(paged_fp8_cuda, m)?)?;
    m.add_function(wrap_pyfunction!(plan, m)?)?;
    m.add_function(wrap_pyfunction!(build_info, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_status, m)?)?;
    Ok(())
}
