//! The CPU backend and the float64 oracle.
//!
//! - [`reference`]: the float64 evaluation every backend is tested against, and the naive
//!   low-precision evaluation the tolerance rule measures against.
//! - [`CpuBackend`]: tiled online softmax, multi-threaded with rayon over
//!   batch × heads × query blocks, f32 accumulation, fully masked tiles skipped, register-blocked
//!   GEMM microkernels and a polynomial `exp2`, compiled for AVX-512, AVX2 + FMA or the baseline
//!   and chosen at run time ([`Isa`]); tiles from [`plan::plan`].
//! - the backward (through [`crate::Backend::backward`], in `backward.rs`): tiled, two passes,
//!   P recomputed from the forward's LSE, deterministic; [`reference_grad`] is its float64
//!   oracle (`docs/backward.md`).
//! - [`materialized`]: the materialised evaluation (whole score matrix), `fa4 bench`'s peer.
//! - [`peak`]: this machine's measured f32 FMA peak, the bench's ceiling.
//!
//! `FA4_CPU_ISA=avx2` (or `avx512`, `baseline`) in the environment selects an instruction set
//! below the best one, for comparisons and tests.
//!
//! Precision: the CPU backend keeps P in f32 for the P·V product (GPU kernels round P to the
//! input dtype, as FlashAttention does); O is rounded to the storage dtype once, at the end.

mod backward;
pub mod materialized;
mod micro;
pub mod peak;
pub mod plan;
pub mod reference;
pub mod reference_grad;
pub(crate) mod simd;
mod tiled;

pub use plan::CpuTiles;
pub use simd::Isa;

pub(crate) use backward::{BwdInputs, BwdOutputs};

use crate::error::{Error, Result};
use crate::problem::Problem;
use crate::tensor::Element;

/// Settings of the CPU backend; the default plans tiles per problem and uses rayon's global
/// thread pool.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CpuBackend {
    /// Worker threads; `None` uses the current rayon pool (the global one, all cores, unless
    /// called inside `ThreadPool::install`).
    pub threads: Option<usize>,
    /// Tile sizes; `None` asks [`plan::plan`].
    pub tiles: Option<CpuTiles>,
}

impl CpuBackend {
    /// Runs a validated problem on slices laid out as it says. The slices are checked against
    /// the problem first ([`Problem::check_buffers`]): a short one is an error naming it.
    pub fn forward<T: Element>(
        &self,
        p: &Problem,
        q: &[T],
        k: &[T],
        v: &[T],
        out: &mut [T],
        lse: Option<&mut [f32]>,
    ) -> Result<()> {
        p.check_buffers(
            T::DTYPE,
            q.len(),
            k.len(),
            v.len(),
            out.len(),
            lse.as_deref().map(<[f32]>::len),
        )?;
        if self.threads == Some(0) {
            return Err(Error::invalid(
                "threads",
                "must be ≥ 1 (None uses the current pool)",
            ));
        }
        let tiles = self.tiles.unwrap_or_else(|| plan::plan(p));
        if tiles.block_m == 0 || tiles.block_n == 0 {
            return Err(Error::invalid(
                "tiles",
                format!("block sizes must be ≥ 1, got {tiles:?}"),
            ));
        }
        match self.threads {
            None => tiled::forward(p, tiles, q, k, v, out, lse),
            Some(n) => {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(n)
                    .build()
                    .map_err(|e| Error::invalid("threads", e.to_string()))?;
                pool.install(|| tiled::forward(p, tiles, q, k, v, out, lse));
            }
        }
        Ok(())
    }

    /// Runs the backward of a validated problem on buffers the caller checked (see
    /// [`crate::Backend::backward`]). Always deterministic: the same bits on every run and for
    /// any thread count.
    pub(crate) fn backward<T: Element>(
        &self,
        p: &Problem,
        x: &BwdInputs<'_, T>,
        out: &mut BwdOutputs<'_, T>,
    ) -> Result<()> {
        let tiles = self.tiles.unwrap_or_else(|| plan::plan(p));
        if tiles.block_m == 0 || tiles.block_n == 0 {
            return Err(Error::invalid(
                "tiles",
                format!("block sizes must be ≥ 1, got {tiles:?}"),
            ));
        }
        match self.threads {
            None => backward::backward(p, tiles, x, out),
            Some(n) => {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(n)
                    .build()
                    .map_err(|e| Error::invalid("threads", e.to_string()))?;
                pool.install(|| backward::backward(p, tiles, x, out));
            }
        }
        Ok(())
    }
}
