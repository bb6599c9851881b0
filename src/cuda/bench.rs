//! Timing the CUDA backend: device-resident random inputs, warm-up, CUDA events around each
//! launch, median of many. Benchmarks are not tests; `fa4 bench --backend cuda` prints these
//! beside the peers measured in the same run (`bench/peers_sdpa.py`).

use cudarc::driver::sys::CUevent_flags;
use rand::rngs::StdRng;
use rand::SeedableRng;

use super::CudaBackend;
use crate::check::random_fill;
use crate::error::{Error, Result};
use crate::problem::Problem;
use crate::tensor::Element;

/// Timings of one problem.
#[derive(Debug, Clone, PartialEq)]
pub struct Timing {
    /// Median milliseconds per forward.
    pub median_ms: f64,
    /// Fastest run.
    pub min_ms: f64,
    /// Runs timed.
    pub reps: usize,
    /// TFLOP/s at the median, FLOPs from [`Problem::flops`].
    pub tflops: f64,
}

/// Times the forward of `p` (contiguous fixed-length layouts) on random inputs: `warmup`
/// untimed launches, then `reps` launches each between two events.
pub fn time_forward<T: Element>(
    cuda: &CudaBackend,
    p: &Problem,
    warmup: usize,
    reps: usize,
    seed: u64,
) -> Result<Timing> {
    let ext = |l: &crate::tensor::Layout| l.extent().unwrap_or(0).max(1);
    let mut rng = StdRng::seed_from_u64(seed);
    let mut host = |n: usize, row: usize| {
        let mut v = vec![T::from_f32(0.0); n];
        random_fill(&mut rng, &mut v, row, 1.0);
        v
    };
    let q = cuda.upload(&host(ext(p.q_layout()), p.head_dim()))?;
    let k = cuda.upload(&host(ext(p.k_layout()), p.head_dim()))?;
    let v = cuda.upload(&host(ext(p.v_layout()), p.head_dim_v()))?;
    let mut o = cuda.alloc::<T>(ext(p.o_layout()))?;
    let mut lse = cuda.alloc::<f32>(p.lse_len().max(1))?;
    let cu = if p.is_varlen() {
        let (cq, ck) = super::offsets(p);
        Some((cuda.upload_i32(&cq)?, cuda.upload_i32(&ck)?))
    } else {
        None
    };
    let run = |o: &mut _, lse: &mut _| {
        cuda.forward_device_trusted(
            p,
            &q,
            &k,
            &v,
            cu.as_ref().map(|(a, b)| (a, b)),
            o,
            Some(lse),
        )
    };
    for _ in 0..warmup {
        run(&mut o, &mut lse)?;
    }
    let ctx = cuda.context();
    let ev = || {
        ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| Error::cuda("cuEventCreate", e))
    };
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps.max(1) {
        let (start, end) = (ev()?, ev()?);
        start
            .record(cuda.stream())
            .map_err(|e| Error::cuda("cuEventRecord", e))?;
        run(&mut o, &mut lse)?;
        end.record(cuda.stream())
            .map_err(|e| Error::cuda("cuEventRecord", e))?;
        times.push(f64::from(
            start
                .elapsed_ms(&end)
                .map_err(|e| Error::cuda("cuEventElapsedTime", e))?,
        ));
    }
    cuda.synchronize()?;
    times.sort_by(f64::total_cmp);
    let median_ms = times[times.len() / 2];
    Ok(Timing {
        median_ms,
        min_ms: times[0],
        reps: times.len(),
        tflops: p.flops() / (median_ms * 1e-3) / 1e12,
    })
}
