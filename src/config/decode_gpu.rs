//! The GPU decode kernels' plan: which split-KV kernel variant a paged problem gets
//! (`kernels/decode/splitkv.cu`), its grid and shared memory, and the specs of the combine and
//! append kernels. Pure functions of the problem, the GPU's SM count and the NVRTC target; the
//! split count comes from [`super::decode::plan`].
//!
//! The split kernel's CTA is one (sequence · KV head, tile of packed rows, split): grid
//! `(batch · heads_kv, row tiles, num_splits)`. Its 4 warps split each block of keys, each
//! holding all the tile's rows (see the kernel's header); the rows are `16 · m_tiles`, the
//! fewest MMA tiles that hold the packed rows of the longest query sequence, up to
//! [`DecodeTiles::gpu`]'s `block_m`.

use std::fmt;

use super::decode::{self, DecodePlan, DecodeTiles};
use super::prelude::Prelude;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::paged::PagedProblem;

/// Warps of the split kernel (each owns `block_n / 4` keys of every block).
pub const NUM_WARPS: usize = 4;
/// Depth of the split kernel's K/V ring: one block computed while the next one lands.
pub const STAGES: usize = 2;
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
        NUM_WARPS * 32
    }
    /// Dynamic shared memory: the Q tile and the K/V ring, 16-bit.
    pub fn smem_bytes(&self) -> usize {
        2 * self.head_dim * (self.block_m() + 2 * STAGES * self.block_n)
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
            .int("NUM_WARPS", NUM_WARPS)
            .int("M_TILES", self.m_tiles)
            .int("STAGES", STAGES)
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
            "decode splitkv {} {} d{} {}x{}{}{}",
            self.target,
            if self.bf16 { "bf16" } else { "fp16" },
            self.head_dim,
            self.block_m(),
            self.block_n,
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

/// Plans a validated paged problem for a GPU of `sm_count` SMs and an NVRTC target; errors
/// name what the kernels do not cover.
pub fn plan(
    p: &PagedProblem,
    sm_count: usize,
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
    let spec = SplitKvSpec {
        target,
        bf16,
        head_dim: d,
        m_tiles,
        block_n: tiles.block_n,
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

/// Every split-kernel variant the planner can emit for a target (for NVRTC tests).
pub fn all_specs(target: &'static str) -> Vec<SplitKvSpec> {
    let mut out = Vec::new();
    for d in HEAD_DIMS {
        let full = DecodeTiles::gpu(d);
        for m_tiles in 1..=full.block_m / 16 {
            for bf16 in [false, true] {
                for window in [false, true] {
                    for softcap in [false, true] {
                        out.push(SplitKvSpec {
                            target,
                            bf16,
                            head_dim: d,
                            m_tiles,
                            block_n: full.block_n,
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
