//! The CPU backend and the float64 oracle.
//!
//! - [`reference`]: the float64 evaluation every backend is tested against, and the naive
//!   low-precision evaluation the tolerance rule measures against.
//! - [`CpuBackend`]: tiled online softmax, multi-threaded with rayon over
//!   batch × heads × query blocks, f32 accumulation, fully masked tiles skipped.
//!
//! Precision: the CPU backend keeps P in f32 for the P·V product (GPU kernels round P to the
//! input dtype, as FlashAttention does); O is rounded to the storage dtype once, at the end.

pub mod plan;
pub mod reference;
mod tiled;

pub use plan::CpuTiles;

use crate::error::{Error, Result};
use crate::problem::Problem;
use crate::tensor::Element;

/// Settings of the CPU backend; the default plans tiles per problem and uses rayon's global
/// thread pool.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CpuBackend {
    /// Worker threads; `None` uses rayon's global pool (all cores).
    pub threads: Option<usize>,
    /// Tile sizes; `None` asks [`plan::plan`].
    pub tiles: Option<CpuTiles>,
}

impl CpuBackend {
    /// Runs a validated problem on slices laid out as it says (the caller checked their sizes).
    pub fn forward<T: Element>(
        &self,
        p: &Problem,
        q: &[T],
        k: &[T],
        v: &[T],
        out: &mut [T],
        lse: Option<&mut [f32]>,
    ) -> Result<()> {
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
}
