//! Running on a framework's stream and buffers (candle's, through `fa4-candle`).
//!
//! A framework owns its CUDA stream and its tensors' memory. [`CudaBackend::on_stream`] makes a
//! backend whose kernels launch on that stream, so they are ordered with the framework's own
//! work without any synchronisation, and [`CudaBackend::forward_device_views`] takes any cudarc
//! device buffer (a `CudaView` into a tensor's storage at its offset, say) instead of a whole
//! `CudaSlice`. [`ForeignBuffer`] is such a buffer when the memory belongs to a framework that
//! cudarc does not know (PyTorch, through the `fa4` Python package): a device address and a
//! length, checked against the driver's record of the allocation that holds it.

use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{self, CUpointer_attribute};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};

use super::{CudaBackend, Device};
use crate::error::{Error, Result};
use crate::problem::Problem;
use crate::tensor::Element;

impl CudaBackend {
    /// A backend that launches on `stream` (and loads its kernels into that stream's context).
    ///
    /// The device is described as [`CudaBackend::new`] describes it. Compiled kernels are held
    /// per backend and shared by its clones: keep one backend per stream rather than making one
    /// per call. A backend's modules are its own, and their module-wide words (the forward's
    /// exact-fixup flag, the dynamic schedule's tile counter) rely on its launches running one
    /// after another in its one stream's order. Unlike [`CudaBackend::new`], this leaves the context's cudarc event tracking
    /// as its owner set it.
    pub fn on_stream(stream: Arc<CudaStream>) -> Result<CudaBackend> {
        let ctx = stream.context().clone();
        // A backend of our own on the same device, for its description; its context handle
        // (the same primary context, a separate cudarc object) is dropped with it.
        let probe = CudaBackend::new(ctx.ordinal())?;
        let info = probe.dev.info.clone();
        Ok(CudaBackend {
            dev: Arc::new(Device {
                ctx,
                stream,
                info,
                kernels: Mutex::new(HashMap::new()),
                exact_order: Mutex::new(()),
                offsets: Mutex::new(Default::default()),
            }),
            ..probe
        })
    }

    /// Runs a validated problem on device buffers of any cudarc kind (slices, views), laid out
    /// as the problem says, asynchronously on [`CudaBackend::stream`]. For a varlen problem the
    /// sequence offsets come from the problem itself (uploaded on the stream, no wait, and
    /// reused by later calls with the same batch), so they always match what was validated.
    pub fn forward_device_views<T: Element>(
        &self,
        p: &Problem,
        q: &impl DevicePtr<T>,
        k: &impl DevicePtr<T>,
        v: &impl DevicePtr<T>,
        out: &mut impl DevicePtrMut<T>,
        lse: Option<&mut impl DevicePtrMut<f32>>,
    ) -> Result<()> {
        let cu = self.device_offsets(p)?;
        self.forward_device_trusted(p, q, k, v, cu.as_deref().map(|(a, b)| (a, b)), out, lse)
    }
}

/// `len` elements of `T` at a device address owned by another framework, for the `*_views`
/// entry points ([`CudaBackend::forward_device_views`], [`CudaBackend::backward_device_views`],
/// [`CudaBackend::forward_paged_views`]).
///
/// [`ForeignBuffer::new`] asks the driver for the allocation that holds the address and refuses
/// a range that leaves it, so a wrong length or a host address is an error naming the argument,
/// not a fault inside a kernel. What the driver cannot know, that the memory stays allocated
/// and is not written by other work while fa4's kernels run, is the caller's promise (the
/// constructor is `unsafe`). The buffer does no cross-stream synchronisation: its owner orders
/// work, as a framework does by launching on its current stream.
#[derive(Debug)]
pub struct ForeignBuffer<T> {
    ptr: u64,
    len: usize,
    stream: Arc<CudaStream>,
    _elem: PhantomData<T>,
}

impl<T> ForeignBuffer<T> {
    /// Wraps `len` elements at `ptr`, used on `stream`; `name` is the argument reported when the
    /// range is not inside one device allocation of the stream's context.
    ///
    /// # Safety
    ///
    /// The memory must stay allocated until every operation that fa4 enqueues on `stream` with
    /// this buffer has finished, and nothing may write it (or, for an output, read it)
    /// concurrently with that work unless ordered by the stream.
    pub unsafe fn new(
        name: &str,
        ptr: u64,
        len: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<ForeignBuffer<T>> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| Error::invalid(name, format!("{len} elements overflow a byte count")))?;
        if bytes > 0 {
            stream
                .context()
                .bind_to_thread()
                .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
            let (start, size) = allocation_range(ptr).map_err(|e| {
                Error::invalid(
                    name,
                    format!("{ptr:#x} is not a device address of this context ({e})"),
                )
            })?;
            let end = ptr.checked_add(bytes as u64);
            if end.is_none_or(|end| end > start + size) {
                return Err(Error::invalid(
                    name,
                    format!(
                        "{bytes} bytes at {ptr:#x} run past the end of its device allocation \
                         ({size} bytes from {start:#x})"
                    ),
                ));
            }
        }
        Ok(ForeignBuffer {
            ptr,
            len,
            stream: stream.clone(),
            _elem: PhantomData,
        })
    }

    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
}

/// The start and size of the device allocation holding `ptr`.
fn allocation_range(ptr: u64) -> std::result::Result<(u64, u64), String> {
    let mut start: sys::CUdeviceptr = 0;
    let mut size: usize = 0;
    // SAFETY: each call writes one value of the attribute's documented type (a CUdeviceptr, a
    // size_t) through a pointer to a local of that type; `ptr` is only looked up, never read.
    let r = unsafe {
        sys::cuPointerGetAttribute(
            (&mut start as *mut sys::CUdeviceptr).cast(),
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
            ptr,
        )
        .result()
        .and_then(|()| {
            sys::cuPointerGetAttribute(
                (&mut size as *mut usize).cast(),
                CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                ptr,
            )
            .result()
        })
    };
    r.map_err(|e| format!("{e:?}"))?;
    Ok((start, size as u64))
}

impl<T> DeviceSlice<T> for ForeignBuffer<T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<T> DevicePtr<T> for ForeignBuffer<T> {
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        // The owner orders work on its stream: nothing to record.
        (self.ptr, SyncOnDrop::Record(None))
    }
}

impl<T> DevicePtrMut<T> for ForeignBuffer<T> {
    fn device_ptr_mut<'a>(
        &'a mut self,
        _stream: &'a CudaStream,
    ) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Record(None))
    }
}
