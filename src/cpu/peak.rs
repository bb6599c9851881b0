//! This machine's f32 FMA peak, measured: every thread of the current rayon pool runs
//! independent chains of vector FMAs at once (`acc = acc·x + y` on 12 vector registers: FMA
//! latency 4 × 2 FMA pipes needs 8 in flight), compiled for one instruction set; the peak is the
//! best of a few timed runs. The loop is 12 `vfmadd213ps` on `ymm` (AVX2) or `zmm` (AVX-512)
//! registers and a counter, nothing else (checked with `objdump -d` on the `fa4` binary,
//! symbols `peak_x86::avx2` and `peak_x86::avx512`).

use std::hint::black_box;
use std::time::Instant;

use super::simd::{fma_peak_loop, Isa};

/// One measurement.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Peak {
    /// The instruction set the loop ran with.
    pub isa: Isa,
    /// Threads that ran it at once.
    pub threads: usize,
    /// Floating-point operations per second, in units of 1e9 (an FMA is 2).
    pub gflops: f64,
}

/// Measures the FMA peak of `isa` on all threads of the current rayon pool: the loop length is
/// calibrated to about `secs` seconds per run, and the best of `runs` runs is kept.
pub fn measure(isa: Isa, secs: f64, runs: usize) -> Peak {
    let threads = rayon::current_num_threads();
    let run = |iters: usize| -> f64 {
        let t0 = Instant::now();
        let per_thread =
            rayon::broadcast(|_| fma_peak_loop(isa, iters, black_box(0.999_9), black_box(1e-4)));
        let elapsed = t0.elapsed().as_secs_f64();
        let flops: usize = per_thread
            .iter()
            .map(|&(keep, f)| {
                black_box(keep);
                f * iters
            })
            .sum();
        flops as f64 / elapsed.max(1e-9)
    };
    // Calibrate on a short run (which also warms the cores up).
    let probe = 100_000;
    let rate = run(probe) / (threads as f64);
    let flops_per_iter = fma_peak_loop(isa, 0, 1.0, 0.0).1 as f64;
    let iters = ((secs * rate / flops_per_iter) as usize).max(probe);
    let best = (0..runs.max(1)).map(|_| run(iters)).fold(0.0, f64::max);
    Peak {
        isa,
        threads,
        gflops: best / 1e9,
    }
}

/// The peak of every vector instruction set this machine has (AVX-512, AVX2; the baseline only
/// where it has neither), best first.
pub fn measure_all(secs: f64, runs: usize) -> Vec<Peak> {
    let mut isas = Isa::all_available();
    if isas.len() > 1 {
        isas.retain(|&i| i != Isa::Baseline);
    }
    let mut all: Vec<Peak> = isas
        .into_iter()
        .map(|isa| measure(isa, secs, runs))
        .collect();
    all.sort_by(|a, b| b.gflops.total_cmp(&a.gflops));
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peak_is_positive_and_finite() {
        let p = measure(Isa::selected(), 0.01, 1);
        assert!(p.gflops.is_finite() && p.gflops > 0.0, "{p:?}");
    }
}
