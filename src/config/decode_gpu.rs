//! The GPU decode kernels' plan: which split-KV kernel variant a paged problem gets
//! (`kernels/decode/splitkv.cu`), its grid and shared memory, and the specs of the combine and
//! append kernels. Pure functions of the problem, the GPU's SM count and the NVRTC target; the
//! split count comes from [`super::decode::plan`].
//!
//! The split kernel's CTA is one (sequence · KV head, tile of packed rows, split): grid
//! `(batch · heads_kv, row tiles, num_splits)`. Its warps split each block of keys, each
//! holding all the tile's rows (see the kernel's header); the rows are `16 · m_tiles`, the
//! fewest MMA tiles that hold the packed rows of the longest query sequence, up to
//! [`DecodeTiles::gpu`]'s `block_m`.

use std::fmt;

use super::decode::{self, DecodePlan, DecodeTiles};
use super::prelude::Prelude;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::paged::PagedProblem;

/// Most warps of the split kernel: each owns `block_n / warps` keys of every block, at least 16
/// (one k16 step of P·V), so 128-key blocks get 8 warps and the 64-key blocks of d256 get 4.
/// More warps issue the cp.async gather faster: on the H200 (d128, 3 stages, bf16) 8 warps read
/// 2.1–3.4 TB/s on the grid where 4 read 1.7–2.5 (same run, `examples/decode_bench.rs`,
/// caches of zeros; on random caches the 8-warp kernel reads 1.3–2.0 TB/s, docs/perf.md).
pub const MAX_WARPS: usize = 8;

/// Warps of the split kernel for a key block.
pub fn warps_for(block_n: usize) -> usize {
    (block_n / 16).clamp(1, MAX_WARPS)
}
/// Deepest K/V ring of the split kernel. A decode CTA computes little per key block, so its
/// speed is the bytes it has in flight: the planner takes the deepest ring that fits the GPU's
/// shared memory, up to this. Measured on the H200 (d128, 128-key blocks, 1 CTA per SM, 4
/// warps): 2 stages read 1.6–2.4 TB/s on the grid (pages 16–256), 3 stages 1.7–2.5.
pub const MAX_STAGES: usize = 4;
/// Warps (one per workspace row) per CTA of the combine kernel.
pub const COMBINE_WARPS: usize = 4;
/// Threads per CTA of the append kernel (one CTA per new row).
pub const APPEND_THREADS: usize = 128;
/// Head dims the split kernel is built for (Q, K and V alike).
pub const HEAD_DIMS: [usize; 3] = [64, 128, 256];

/// A variant of the split-KV kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SplitKvSpec {
    /// NVRTC target (`sm_80`, `sm_90a`, …).
    pub target: &'static str,
    /// bf16 (else fp16).
    pub bf16: bool,
    /// Head dim of Q, K and V.
    pub head_dim: usize,
    /// MMA tiles of 16 packed rows per CTA.
    pub m_tiles: usize,
    /// Keys per block.
    pub block_n: usize,
    /// Depth of the K/V ring (cp.async groups in flight + 1).
    pub stages: usize,
    /// A window (or causal) mask.
    pub window: bool,
    /// Softcap.
    pub softcap: bool,
}

impl SplitKvSpec {
    /// Packed rows per CTA.
    pub fn block_m(&self) -> usize {
        16 * self.m_tiles
    }
    /// Threads per CTA.
    pub fn threads(&self) -> usize {
        warps_for(self.block_n) * 32
    }
    /// Dynamic shared memory: the Q tile and the K/V ring, 16-bit.
    pub fn smem_bytes(&self) -> usize {
        smem_bytes(self.head_dim, self.m_tiles, self.block_n, self.stages)
    }
    /// The entry point.
    pub fn entry(&self) -> &'static str {
        "fa4_decode_splitkv"
    }
    /// The generated prelude.
    pub fn prelude(&self) -> String {
        Prelude::new("config::decode_gpu", self)
            .int("HEAD_DIM", self.head_dim)
            .int("BLOCK_M", self.block_m())
            .int("BLOCK_N", self.block_n)
            .int("NUM_WARPS", warps_for(self.block_n))
            .int("M_TILES", self.m_tiles)
            .int("STAGES", self.stages)
            .flag("IS_BF16", self.bf16)
            .flag("HAS_WINDOW", self.window)
            .flag("HAS_SOFTCAP", self.softcap)
            .flag("LAZY_RESCALE", true)
            .define("FA4_SMEM_BYTES", self.smem_bytes())
            .finish()
    }
}

impl fmt::Display for SplitKvSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "decode splitkv {} {} d{} {}x{} {} stages{}{}",
            self.target,
            if self.bf16 { "bf16" } else { "fp16" },
            self.head_dim,
            self.block_m(),
            self.block_n,
            self.stages,
            if self.window { " window" } else { "" },
            if self.softcap { " softcap" } else { "" }
        )
    }
}

/// The combine kernel of one dtype and head dim.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CombineSpec {
    /// NVRTC target.
    pub target: &'static str,
    /// bf16 (else fp16) output.
    pub bf16: bool,
    /// Values per row.
    pub head_dim: usize,
}

impl CombineSpec {
    /// The generated prelude.
    pub fn prelude(&self) -> String {
        Prelude::new("config::decode_gpu", self)
            .int("HEAD_DIM", self.head_dim)
            .flag("IS_BF16", self.bf16)
            .finish()
    }
}

impl fmt::Display for CombineSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "decode combine {} {} d{}",
            self.target,
            if self.bf16 { "bf16" } else { "fp16" },
            self.head_dim
        )
    }
}

/// The append kernel (dtype-free: it moves 16-bit units).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AppendSpec {
    /// NVRTC target.
    pub target: &'static str,
}

impl AppendSpec {
    /// The generated prelude (the shared base header wants IS_BF16; the copy uses none).
    pub fn prelude(&self) -> String {
        Prelude::new("config::decode_gpu", self)
            .flag("IS_BF16", false)
            .finish()
    }
}

impl fmt::Display for AppendSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "paged append {}", self.target)
    }
}

/// Shared memory of a split kernel: the Q tile and the K/V ring, 16-bit.
fn smem_bytes(head_dim: usize, m_tiles: usize, block_n: usize, stages: usize) -> usize {
    2 * head_dim * (16 * m_tiles + 2 * stages * block_n)
}

/// The deepest K/V ring (2..=[`MAX_STAGES`]) within `max_smem` bytes per CTA, if any.
pub fn stages_for(
    head_dim: usize,
    m_tiles: usize,
    block_n: usize,
    max_smem: usize,
) -> Option<usize> {
    (2..=MAX_STAGES)
        .rev()
        .find(|&s| smem_bytes(head_dim, m_tiles, block_n, s) <= max_smem)
}

/// A planned GPU decode call.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuDecodePlan {
    /// The split count and its evidence.
    pub decode: DecodePlan,
    /// The split kernel.
    pub spec: SplitKvSpec,
    /// Its grid: `(batch · heads_kv, row tiles, num_splits)`.
    pub grid: (u32, u32, u32),
    /// The combine kernel (run when `num_splits > 1`).
    pub combine: CombineSpec,
}

/// Plans a validated paged problem for a GPU of `sm_count` SMs and `max_smem` bytes of shared
/// memory per CTA, and an NVRTC target; errors name what the kernels do not cover.
pub fn plan(
    p: &PagedProblem,
    sm_count: usize,
    max_smem: usize,
    target: &'static str,
    num_splits: Option<usize>,
) -> Result<GpuDecodePlan> {
    let bf16 = match p.dtype() {
        DType::Bf16 => true,
        DType::F16 => false,
        other => {
            return Err(Error::invalid(
                "dtype",
                format!("the GPU decode kernels take fp16 or bf16, got {other}"),
            ))
        }
    };
    let c = p.cache();
    let d = c.head_dim();
    if !HEAD_DIMS.contains(&d) {
        return Err(Error::invalid(
            "k_cache",
            format!("the GPU decode kernels take head dims {HEAD_DIMS:?}, got {d}"),
        ));
    }
    if c.head_dim_v() != d {
        return Err(Error::invalid(
            "v_cache",
            format!(
                "the GPU decode kernels need head_dim_v equal to head_dim {d}, got {}",
                c.head_dim_v()
            ),
        ));
    }
    // Every row the kernels copy is 16-byte chunks: strides in whole 8-element chunks.
    let skip = |l: &crate::tensor::Layout| if l.packed { 1 } else { 0 };
    for (name, l) in [
        ("q", p.q_layout()),
        ("out", p.o_layout()),
        ("k_cache", c.k_layout()),
        ("v_cache", c.v_layout()),
    ] {
        if let Some(s) = l.strides[skip(l)..3]
            .iter()
            .find(|&&s| !s.is_multiple_of(8))
        {
            return Err(Error::invalid(
                name,
                format!("the GPU decode kernels need strides in multiples of 8 elements (16 bytes), got {s}"),
            ));
        }
    }
    let full = DecodeTiles::gpu(d);
    let shape = p.decode_shape();
    let rows = shape.seqlen_q * p.group();
    let m_tiles = rows.div_ceil(16).clamp(1, full.block_m / 16);
    let tiles = DecodeTiles {
        block_m: 16 * m_tiles,
        block_n: full.block_n,
    };
    let decode = decode::plan(shape, tiles, sm_count, num_splits)?;
    let too_big = |what: &str| Error::invalid("q", format!("the decode grid's {what} overflows"));
    let x = u32::try_from(shape.batch * c.heads_kv())
        .ok()
        .filter(|&x| x <= i32::MAX as u32)
        .ok_or_else(|| too_big("sequences × KV heads"))?;
    let y = u32::try_from(rows.div_ceil(tiles.block_m))
        .ok()
        .filter(|&y| y <= 65535)
        .ok_or_else(|| too_big("row tiles"))?;
    let stages = stages_for(d, m_tiles, tiles.block_n, max_smem).ok_or_else(|| {
        Error::invalid(
            "device",
            format!(
                "the GPU decode kernel needs {} bytes of shared memory per CTA, the GPU gives {max_smem}",
                smem_bytes(d, m_tiles, tiles.block_n, 2)
            ),
        )
    })?;
    let spec = SplitKvSpec {
        target,
        bf16,
        head_dim: d,
        m_tiles,
        block_n: tiles.block_n,
        stages,
        window: p.options().get_mask().is_restrictive(),
        softcap: p.softcap().is_some(),
    };
    Ok(GpuDecodePlan {
        grid: (x, y, decode.num_splits as u32),
        decode,
        spec,
        combine: CombineSpec {
            target,
            bf16,
            head_dim: d,
        },
    })
}

/// Every split-kernel variant the planner can emit for a target whose CTAs get `max_smem` bytes
/// of shared memory (for NVRTC tests).
pub fn all_specs(target: &'static str, max_smem: usize) -> Vec<SplitKvSpec> {
    let mut out = Vec::new();
    for d in HEAD_DIMS {
        let full = DecodeTiles::gpu(d);
        for m_tiles in 1..=full.block_m / 16 {
            let Some(stages) = stages_for(d, m_tiles, full.block_n, max_smem) else {
                continue;
            };
            for bf16 in [false, true] {
                for window in [false, true] {
                    for softcap in [false, true] {
                        out.push(SplitKvSpec {
                            target,
                            bf16,
                            head_dim: d,
                            m_tiles,
                            block_n: full.block_n,
                            stages,
                            window,
                            softcap,
                        });
                    }
                }
            }
        }
    }
    out
}
