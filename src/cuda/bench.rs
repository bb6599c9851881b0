//! Timing the CUDA backend the way `bench/peers.py` times fa4 and its peers, so that the two can
//! be set side by side: device-resident random inputs, untimed warm-up calls, then rounds of
//! `calls` back-to-back forwards between one pair of CUDA events (the GPU never waits on the host
//! inside a round, so a library's host launch path is hidden as it is in a real model),
//! the median over rounds and the spread between them.
//!
//! [`Bench`] exposes one round at a time, so that a driver in another process (`fa4 bench
//! --backend cuda --rounds-from-stdin`; bench/grid.py until 2026-12-03, when bench/peers.py timed
//! every library in one process instead) can interleave fa4's rounds with the peers' and clock
//! or thermal drift hits every library alike. [`Bench::per_call`] is the other
//! measure: one forward, then a synchronize, between two host clock reads; it includes the host
//! path (argument checks, the launch itself) and is reported as such.
//!
//! Inputs are rotated when one set of Q, K, V and O is smaller than twice the L2 cache, so that
//! back-to-back calls cannot be served from the cache the previous call filled; on the
//! FlashAttention grid (16k tokens × hidden 2048, 256 MiB a set) there is a single set.

use std::time::Instant;

use cudarc::driver::sys::{CUdevice_attribute, CUevent_flags};
use cudarc::driver::CudaSlice;
use rand::rngs::StdRng;
use rand::SeedableRng;

use super::CudaBackend;
use crate::check::random_fill;
use crate::error::{Error, Result};
use crate::problem::Problem;
use crate::tensor::Element;

/// At most this many input sets are rotated, whatever the L2 size.
const MAX_INPUT_SETS: usize = 16;

/// Order statistics of a sample of times, milliseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Spread {
    /// Median.
    pub median: f64,
    /// Fastest.
    pub min: f64,
    /// Slowest.
    pub max: f64,
    /// First quartile (linear interpolation between order statistics).
    pub q1: f64,
    /// Third quartile.
    pub q3: f64,
    /// Samples.
    pub n: usize,
}

impl Spread {
    /// The statistics of `samples`; an error for an empty or non-finite sample.
    pub fn of(samples: &[f64]) -> Result<Self> {
        if samples.is_empty() || samples.iter().any(|x| !x.is_finite()) {
            return Err(Error::invalid(
                "samples",
                format!("need one or more finite times, got {samples:?}"),
            ));
        }
        let mut s = samples.to_vec();
        s.sort_by(f64::total_cmp);
        let at = |f: f64| {
            let x = f * (s.len() - 1) as f64;
            let (lo, hi) = (x.floor() as usize, x.ceil() as usize);
            s[lo] + (s[hi] - s[lo]) * (x - lo as f64)
        };
        Ok(Self {
            median: at(0.5),
            min: s[0],
            max: s[s.len() - 1],
            q1: at(0.25),
            q3: at(0.75),
            n: s.len(),
        })
    }

    /// (max − min) / median: the whole range between rounds, relative.
    pub fn range_rel(&self) -> f64 {
        (self.max - self.min) / self.median
    }

    /// (q3 − q1) / median: the interquartile range, relative. The spread the verdicts use: one
    /// slow round (a clock dip) widens the whole range but not this.
    pub fn iqr_rel(&self) -> f64 {
        (self.q3 - self.q1) / self.median
    }
}

/// One round's result, milliseconds per call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Round {
    /// GPU time between the events, per call.
    pub ms: f64,
    /// Host time spent enqueueing the calls (argument checks and launches), per call: when it
    /// exceeds `ms` the round measures the host path, not the kernel.
    pub host_ms: f64,
}

/// Timings of one problem.
#[derive(Debug, Clone, PartialEq)]
pub struct Timing {
    /// Milliseconds per forward in each round (event pair around `calls` back-to-back calls).
    pub rounds: Spread,
    /// Back-to-back calls per round.
    pub calls: usize,
    /// Milliseconds of one forward followed by a synchronize, host clock: includes the host path.
    pub per_call: Spread,
    /// Host milliseconds to enqueue one call inside a round.
    pub host_enqueue: Spread,
    /// Input sets rotated between calls.
    pub input_sets: usize,
    /// TFLOP/s at the median round, FLOPs from [`Problem::flops`].
    pub tflops: f64,
}

/// One problem on the device, ready to be timed.
pub struct Bench<'a, T: Element> {
    cuda: &'a CudaBackend,
    p: &'a Problem,
    sets: Vec<[CudaSlice<T>; 3]>,
    o: CudaSlice<T>,
    lse: CudaSlice<f32>,
    cu: Option<(CudaSlice<i32>, CudaSlice<i32>)>,
    next: usize,
}

impl<'a, T: Element> Bench<'a, T> {
    /// Uploads random normal inputs for `p` (seeded), as many sets as keep one call's working
    /// set out of the L2 cache.
    pub fn new(cuda: &'a CudaBackend, p: &'a Problem, seed: u64) -> Result<Self> {
        let ext = |l: &crate::tensor::Layout| l.extent().unwrap_or(0).max(1);
        let (nq, nk, nv, no) = (
            ext(p.q_layout()),
            ext(p.k_layout()),
            ext(p.v_layout()),
            ext(p.o_layout()),
        );
        let set_bytes = (nq + nk + nv + no) * std::mem::size_of::<T>();
        let l2 = cuda
            .context()
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)
            .map_err(|e| Error::cuda("cuDeviceGetAttribute(L2_CACHE_SIZE)", e))?;
        let sets = input_sets(set_bytes, usize::try_from(l2).unwrap_or(0));
        let mut rng = StdRng::seed_from_u64(seed);
        let mut host = |n: usize, row: usize| {
            let mut v = vec![T::from_f32(0.0); n];
            random_fill(&mut rng, &mut v, row, 1.0);
            v
        };
        let mut all = Vec::with_capacity(sets);
        for _ in 0..sets {
            all.push([
                cuda.upload(&host(nq, p.head_dim()))?,
                cuda.upload(&host(nk, p.head_dim()))?,
                cuda.upload(&host(nv, p.head_dim_v()))?,
            ]);
        }
        let cu = if p.is_varlen() {
            let (cq, ck) = super::offsets(p);
            Some((cuda.upload_i32(&cq)?, cuda.upload_i32(&ck)?))
        } else {
            None
        };
        Ok(Self {
            cuda,
            p,
            sets: all,
            o: cuda.alloc::<T>(no)?,
            lse: cuda.alloc::<f32>(p.lse_len().max(1))?,
            cu,
            next: 0,
        })
    }

    /// Input sets rotated between calls.
    pub fn input_sets(&self) -> usize {
        self.sets.len()
    }

    /// Enqueues one forward on the next input set; does not wait.
    fn launch(&mut self) -> Result<()> {
        let [q, k, v] = &self.sets[self.next];
        self.next = (self.next + 1) % self.sets.len();
        self.cuda.forward_device_trusted(
            self.p,
            q,
            k,
            v,
            self.cu.as_ref().map(|(a, b)| (a, b)),
            &mut self.o,
            Some(&mut self.lse),
        )
    }

    /// `calls` untimed forwards, then a synchronize.
    pub fn warm_up(&mut self, calls: usize) -> Result<()> {
        for _ in 0..calls {
            self.launch()?;
        }
        self.cuda.synchronize()
    }

    /// One round: an event pair around `calls` back-to-back forwards.
    pub fn round(&mut self, calls: usize) -> Result<Round> {
        let calls = calls.max(1);
        let ctx = self.cuda.context();
        let ev = || {
            ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| Error::cuda("cuEventCreate", e))
        };
        let (start, end) = (ev()?, ev()?);
        // The stream is idle here (the last round or warm-up ended with a synchronize), so the
        // start event does not wait behind earlier work.
        self.cuda.synchronize()?;
        start
            .record(self.cuda.stream())
            .map_err(|e| Error::cuda("cuEventRecord", e))?;
        let t0 = Instant::now();
        for _ in 0..calls {
            self.launch()?;
        }
        let host_ms = t0.elapsed().as_secs_f64() * 1e3 / calls as f64;
        end.record(self.cuda.stream())
            .map_err(|e| Error::cuda("cuEventRecord", e))?;
        self.cuda.synchronize()?;
        let ms = f64::from(
            start
                .elapsed_ms(&end)
                .map_err(|e| Error::cuda("cuEventElapsedTime", e))?,
        );
        Ok(Round {
            ms: ms / calls as f64,
            host_ms,
        })
    }

    /// One forward followed by a synchronize, host clock, milliseconds: the host path included.
    /// An untimed call runs first: when another process (a peer, in a driver of processes) used
    /// the GPU last, the switch back to this context costs a few hundred µs, which would
    /// otherwise land on the timed call.
    pub fn per_call(&mut self) -> Result<f64> {
        self.launch()?;
        self.cuda.synchronize()?;
        let t0 = Instant::now();
        self.launch()?;
        self.cuda.synchronize()?;
        Ok(t0.elapsed().as_secs_f64() * 1e3)
    }
}

/// How many input sets keep a call's `set_bytes` working set out of an `l2_bytes` cache: enough
/// that the sets together span twice the cache, at most [`MAX_INPUT_SETS`].
pub fn input_sets(set_bytes: usize, l2_bytes: usize) -> usize {
    if set_bytes == 0 {
        return 1;
    }
    (2 * l2_bytes).div_ceil(set_bytes).clamp(1, MAX_INPUT_SETS)
}

/// Times the forward of `p` (contiguous fixed-length layouts) on random inputs: `warmup`
/// untimed calls, `rounds` rounds of `calls` back-to-back calls, then `rounds` per-call samples.
pub fn time_forward<T: Element>(
    cuda: &CudaBackend,
    p: &Problem,
    warmup: usize,
    calls: usize,
    rounds: usize,
    seed: u64,
) -> Result<Timing> {
    let mut b = Bench::<T>::new(cuda, p, seed)?;
    b.warm_up(warmup)?;
    let r = (0..rounds.max(1))
        .map(|_| b.round(calls))
        .collect::<Result<Vec<_>>>()?;
    let pc = (0..rounds.max(1))
        .map(|_| b.per_call())
        .collect::<Result<Vec<_>>>()?;
    let host = r.iter().map(|x| x.host_ms).collect::<Vec<_>>();
    let r = r.iter().map(|x| x.ms).collect::<Vec<_>>();
    let rounds = Spread::of(&r)?;
    Ok(Timing {
        host_enqueue: Spread::of(&host)?,
        tflops: p.flops() / (rounds.median * 1e-3) / 1e12,
        rounds,
        calls: calls.max(1),
        per_call: Spread::of(&pc)?,
        input_sets: b.input_sets(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_of_an_odd_and_an_even_sample() {
        let s = Spread::of(&[5.0, 1.0, 3.0, 2.0, 4.0]).unwrap();
        assert_eq!(
            (s.min, s.q1, s.median, s.q3, s.max),
            (1.0, 2.0, 3.0, 4.0, 5.0)
        );
        let s = Spread::of(&[4.0, 1.0, 2.0, 3.0]).unwrap();
        assert_eq!(s.median, 2.5);
        assert_eq!((s.q1, s.q3), (1.75, 3.25));
        assert!((s.range_rel() - 3.0 / 2.5).abs() < 1e-12);
        assert!((s.iqr_rel() - 1.5 / 2.5).abs() < 1e-12);
    }

    #[test]
    fn spread_rejects_empty_and_nan() {
        assert!(Spread::of(&[]).is_err());
        assert!(Spread::of(&[1.0, f64::NAN]).is_err());
    }

    #[test]
    fn input_sets_span_twice_the_cache() {
        let mib = 1 << 20;
        // The grid's 256 MiB set against the H200's 60 MiB L2: one set.
        assert_eq!(input_sets(256 * mib, 60 * mib), 1);
        // 20 MiB sets: 6 of them span 120 MiB.
        assert_eq!(input_sets(20 * mib, 60 * mib), 6);
        assert_eq!(input_sets(1, 60 * mib), MAX_INPUT_SETS);
        assert_eq!(input_sets(0, 60 * mib), 1);
    }
}
