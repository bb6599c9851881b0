//! The CPU planner: tile sizes for the tiled backend, a pure function of the problem.

use crate::problem::Problem;

/// Tile sizes of the CPU backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CpuTiles {
    /// Query rows per work item.
    pub block_m: usize,
    /// Keys per inner step.
    pub block_n: usize,
}

/// Chooses tiles for a problem.
pub fn plan(_p: &Problem) -> CpuTiles {
    CpuTiles {
        block_m: 64,
        block_n: 64,
    }
}
