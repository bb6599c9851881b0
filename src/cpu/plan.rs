//! The CPU planner: tile sizes for the tiled backend, a pure function of the problem.
//!
//! Why 96 × 96 (measured on a 2-core AMD EPYC Zen 4, f32, d = 64 and 128, `fa4 bench`):
//!
//! - 96 is a multiple of every register tile: the score tile (6 keys × 32 queries with AVX-512,
//!   3 × 16 with AVX2) and the P·V tile (12 queries × 32 columns, 6 × 16), so full blocks carry
//!   no padding.
//! - A key block of 96 keeps the per-tile costs (the O rescale, the softmax bookkeeping, the
//!   microkernel prologues) to a few percent, and the scores tile (96 × 96 f32, 36 KiB) next to
//!   the Qᵀ panel (48 KiB at d = 128) stays in L2.
//! - A query block of 96 bounds the work lost on the diagonal of a causal mask (a partial tile
//!   costs a full one) and gives enough work items for every thread: 96 × 96 was as fast as
//!   96 × 192, 192 × 96 and 192 × 192 without a mask (within noise, ~187 GFLOP/s at seqlen
//!   2048) and the fastest with one (512 causal: 116 vs 99–105 GFLOP/s; 2048 causal d = 64:
//!   155 vs 148).
//! - K and V are re-read once per query block: at 96 rows per block that stream is well under
//!   the memory bandwidth, so larger blocks bought nothing measurable.

use crate::problem::Problem;

/// Tile sizes of the CPU backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CpuTiles {
    /// Query rows per work item.
    pub block_m: usize,
    /// Keys per inner step.
    pub block_n: usize,
}

/// Query rows per work item and keys per step (see the module docs).
pub const BLOCK: usize = 96;

/// Chooses tiles for a problem: [`BLOCK`] × [`BLOCK`], shrunk to the longest sequence (a
/// block longer than every sequence only costs scratch memory).
pub fn plan(p: &Problem) -> CpuTiles {
    let longest = |f: fn(&crate::problem::Sequence) -> usize| {
        p.sequences().iter().map(f).max().unwrap_or(0).max(1)
    };
    CpuTiles {
        block_m: BLOCK.min(longest(|s| s.q_len)),
        block_n: BLOCK.min(longest(|s| s.k_len)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::Options;
    use crate::tensor::Layout;
    use crate::DType;

    #[test]
    fn tiles_are_96_or_the_sequence() {
        let l = |s: usize| Layout::new("t", &[1, s, 1, 64], None).unwrap();
        let p = |sq: usize, sk: usize| {
            Problem::new(
                DType::F32,
                &l(sq),
                &l(sk),
                &l(sk),
                &l(sq),
                None,
                None,
                &Options::new(),
            )
            .unwrap()
        };
        assert_eq!(
            plan(&p(2048, 2048)),
            CpuTiles {
                block_m: 96,
                block_n: 96
            }
        );
        assert_eq!(
            plan(&p(17, 40)),
            CpuTiles {
                block_m: 17,
                block_n: 40
            }
        );
        assert_eq!(plan(&p(0, 0)).block_m, 1);
    }
}
