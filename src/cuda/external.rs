//! Running on a framework's stream and buffers (candle's, through `fa4-candle`).
//!
//! A framework owns its CUDA stream and its tensors' memory. [`CudaBackend::on_stream`] makes a
//! backend whose kernels launch on that stream, so they are ordered with the framework's own
//! work without any synchronisation, and [`CudaBackend::forward_device_views`] takes any cudarc
//! device buffer (a `CudaView` into a tensor's storage at its offset, say) instead of a whole
//! `CudaSlice`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};

use super::{offsets, CudaBackend, Device};
use crate::error::Result;
use crate::problem::Problem;
use crate::tensor::Element;

impl CudaBackend {
    /// A backend that launches on `stream` (and loads its kernels into that stream's context).
    ///
    /// The device is described as [`CudaBackend::new`] describes it. Compiled kernels are held
    /// per backend and shared by its clones: keep one backend per stream rather than making one
    /// per call. Unlike [`CudaBackend::new`], this leaves the context's cudarc event tracking
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
            }),
            ..probe
        })
    }

    /// Runs a validated problem on device buffers of any cudarc kind (slices, views), laid out
    /// as the problem says, asynchronously on [`CudaBackend::stream`]. For a varlen problem the
    /// sequence offsets are uploaded here from the problem itself (on the stream, no wait), so
    /// they always match what was validated.
    pub fn forward_device_views<T: Element>(
        &self,
        p: &Problem,
        q: &impl DevicePtr<T>,
        k: &impl DevicePtr<T>,
        v: &impl DevicePtr<T>,
        out: &mut impl DevicePtrMut<T>,
        lse: Option<&mut impl DevicePtrMut<f32>>,
    ) -> Result<()> {
        let cu = if p.is_varlen() {
            let (cq, ck) = offsets(p);
            Some((self.upload_i32(&cq)?, self.upload_i32(&ck)?))
        } else {
            None
        };
        self.forward_device_trusted(p, q, k, v, cu.as_ref().map(|(a, b)| (a, b)), out, lse)
    }
}
