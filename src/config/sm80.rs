//! The planner of the Ampere-class kernel (`kernels/sm80/fwd.cu`): `mma.sync` m16n8k16,
//! `cp.async` K/V ring, `ldmatrix` fragments. It runs on every GPU from sm_80 on.
//!
//! A plan is a [`KernelSpec`] (everything the kernel is specialised on: the compile-cache key)
//! plus the launch geometry. Every number the kernel uses comes from here through the generated
//! prelude; the kernel `static_assert`s what it relies on.
//!
//! One warp owns 16 query rows (the M of one m16n8k16 MMA), so BLOCK_M = 16 · warps; the tile
//! candidates per head dim, and the measurements behind their order, are in [`tiles`].

use super::prelude::Prelude;
use std::fmt;

use crate::arch::GpuArch;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::problem::Problem;

/// Head dimensions the kernel is compiled for; a problem's head dim is padded up to the next.
pub const HEAD_DIMS: [usize; 4] = [64, 128, 192, 256];
/// Query rows per warp (the M of one m16n8k16 MMA).
pub const ROWS_PER_WARP: usize = 16;
/// Elements of one 16-byte copy: the alignment every row stride and head dim must keep.
pub const VECTOR_ELEMS: usize = 8;

/// The tile shape of one launch: what the planner chooses per head dim and GPU, and what a
/// benchmark may override (validated by [`Tiles::check`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tiles {
    /// Query rows per CTA: `16 · m_tiles · num_warps`.
    pub block_m: usize,
    /// Keys per inner step (a multiple of 16).
    pub block_n: usize,
    /// Warps per CTA.
    pub num_warps: usize,
    /// K/V ring stages (≥ 2).
    pub stages: usize,
    /// 16-row MMA tiles per warp (1 or 2): two reuse each K/V fragment twice.
    pub m_tiles: usize,
    /// CTAs per SM the register allocation is made for (`__launch_bounds__`).
    pub min_blocks_per_sm: usize,
    /// Keep the warp's Q fragments in registers (else reload them from shared memory).
    pub q_in_regs: bool,
    /// Conditional rescaling (FlashAttention-4): keep a row's stale max until the new one is
    /// more than 2^8 larger, and rescale O only then (exact: numerator and denominator share
    /// the stale max; P grows to at most 2^8).
    pub lazy_rescale: bool,
}

impl Tiles {
    /// Dynamic shared memory: Q tile (reused for O) and `stages` K and V tiles, 16-bit.
    pub fn smem_bytes(&self, head_dim: usize) -> usize {
        2 * (self.block_m * head_dim + 2 * self.stages * self.block_n * head_dim)
    }

    /// Checks the tiles against the kernel's rules and the GPU's limits.
    pub fn check(&self, head_dim: usize, arch: &GpuArch) -> Result<()> {
        let bad = |why: String| {
            Err(Error::invalid(
                "tiles",
                format!("{self:?} for head_dim {head_dim}: {why}"),
            ))
        };
        let threads = self.num_warps * 32;
        if !(1..=2).contains(&self.m_tiles) {
            return bad("m_tiles must be 1 or 2".into());
        }
        if self.num_warps == 0 || self.block_m != self.num_warps * self.m_tiles * ROWS_PER_WARP {
            return bad(format!(
                "block_m must be {ROWS_PER_WARP} · m_tiles · num_warps"
            ));
        }
        if self.block_n == 0 || !self.block_n.is_multiple_of(16) {
            return bad("block_n must be a positive multiple of 16".into());
        }
        if !(2..=4).contains(&self.stages) {
            return bad("stages must be 2 to 4".into());
        }
        let chunks = head_dim / VECTOR_ELEMS;
        if !(self.block_n * chunks).is_multiple_of(threads)
            || !(self.block_m * chunks).is_multiple_of(threads)
        {
            return bad("tiles must split evenly over the threads' 16-byte copies".into());
        }
        if self.min_blocks_per_sm == 0
            || self.min_blocks_per_sm * threads > arch.max_threads_per_sm as usize
        {
            return bad(format!(
                "{} CTAs of {threads} threads do not fit an SM",
                self.min_blocks_per_sm
            ));
        }
        let smem = self.smem_bytes(head_dim);
        let budget = arch.max_smem_per_block() as usize;
        let per_sm = arch.smem_per_sm as usize;
        if smem > budget
            || self.min_blocks_per_sm * (smem + arch.smem_reserved_per_block as usize) > per_sm
        {
            return bad(format!(
                "{smem} bytes of shared memory × {} CTAs do not fit {} ({budget} per block, {per_sm} per SM)",
                self.min_blocks_per_sm, arch.name
            ));
        }
        Ok(())
    }
}

/// The command-line spelling of a tile override (`fa4 bench --tiles`, `fa4 check --tiles`):
/// `block_m,block_n,warps,m_tiles,stages,ctas_per_sm,q_in_regs(0|1),lazy_rescale(0|1)`.
/// Parsing checks the form only; [`Tiles::check`] checks the numbers against a head dim and GPU.
impl std::str::FromStr for Tiles {
    type Err = Error;

    fn from_str(s: &str) -> Result<Tiles> {
        let [block_m, block_n, num_warps, m_tiles, stages, min_blocks_per_sm, q, lazy] =
            super::override_fields(s, "tiles")?;
        Ok(Tiles {
            block_m,
            block_n,
            num_warps,
            m_tiles,
            stages,
            min_blocks_per_sm,
            q_in_regs: super::override_flag(q, "q_in_regs", "tiles")?,
            lazy_rescale: super::override_flag(lazy, "lazy_rescale", "tiles")?,
        })
    }
}

/// What the kernel is specialised on. Hash/Eq make it the compile-cache key (with the source
/// hash and NVRTC version); the prelude is a pure function of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KernelSpec {
    /// NVRTC target, e.g. `sm_90` (an exact architecture: a cubin is produced).
    pub target: &'static str,
    /// bf16 (true) or fp16 (false) storage.
    pub bf16: bool,
    /// Padded head dim (one of [`HEAD_DIMS`]).
    pub head_dim: usize,
    /// Causal or local window: row key bounds apply.
    pub window: bool,
    /// Softcap applied to the scores.
    pub softcap: bool,
    /// The tile shape.
    pub tiles: Tiles,
}

impl KernelSpec {
    /// Threads per CTA.
    pub fn threads(&self) -> usize {
        self.tiles.num_warps * 32
    }

    /// Dynamic shared memory of a launch.
    pub fn smem_bytes(&self) -> usize {
        self.tiles.smem_bytes(self.head_dim)
    }

    /// The kernel's entry point.
    pub fn entry(&self) -> &'static str {
        "fa4_fwd_sm80"
    }

    /// The constants the kernel source is compiled with.
    pub fn prelude(&self) -> String {
        let t = &self.tiles;
        Prelude::new("config::sm80", self)
            .int("HEAD_DIM", self.head_dim)
            .int("BLOCK_M", t.block_m)
            .int("BLOCK_N", t.block_n)
            .int("NUM_WARPS", t.num_warps)
            .int("STAGES", t.stages)
            .int("MIN_BLOCKS_PER_SM", t.min_blocks_per_sm)
            .int("M_TILES", t.m_tiles)
            .flag("Q_IN_REGS", t.q_in_regs)
            .flag("LAZY_RESCALE", t.lazy_rescale)
            .flag("IS_BF16", self.bf16)
            .flag("FP8", false)
            .flag("HAS_WINDOW", self.window)
            .flag("HAS_SOFTCAP", self.softcap)
            .define("FA4_SMEM_BYTES", self.smem_bytes())
            .finish()
    }
}

impl fmt::Display for KernelSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let t = &self.tiles;
        write!(
            f,
            "sm80-fwd {} {} d{} {}x{} w{} m{} s{} b{}{}{}{}{}",
            self.target,
            if self.bf16 { "bf16" } else { "fp16" },
            self.head_dim,
            t.block_m,
            t.block_n,
            t.num_warps,
            t.m_tiles,
            t.stages,
            t.min_blocks_per_sm,
            if t.q_in_regs { " qreg" } else { "" },
            if t.lazy_rescale { " lazy" } else { "" },
            if self.window { " window" } else { "" },
            if self.softcap { " softcap" } else { "" }
        )
    }
}

#[allow(clippy::too_many_arguments)]
const fn t(
    block_m: usize,
    block_n: usize,
    num_warps: usize,
    m_tiles: usize,
    stages: usize,
    min_blocks_per_sm: usize,
    q_in_regs: bool,
    lazy_rescale: bool,
) -> Tiles {
    Tiles {
        block_m,
        block_n,
        num_warps,
        m_tiles,
        stages,
        min_blocks_per_sm,
        q_in_regs,
        lazy_rescale,
    }
}

/// Tile candidates per padded head dim, fastest first, as measured on an H200 (bf16, 16k tokens,
/// TFLOP/s at seqlen 4096 non-causal / causal; `docs/perf.md`); later entries are for parts with
/// less shared memory or fewer threads per SM.
/// - d64: 4 warps × two 16-row MMA tiles, Q reloaded from shared memory (318 / 284), against
///   the same in two CTAs per SM (311 / 281) or with conditional rescaling (308 / 266).
/// - d128: two 4-warp CTAs per SM, two tiles per warp, with conditional rescaling (356 / 336):
///   without it 325 / 320; one tile per warp in one 8-warp CTA with Q in registers 313 / 285
///   (every K/V fragment then feeds one MMA instead of two: shared-memory bound); 256-row
///   CTAs of 8 warps 321 / 285. Two tiles hold a 128-register O accumulator and spill 16–64 B.
/// - d192 and d256 keep Q in shared memory (the O accumulator alone is 96–128 registers), one
///   tile per warp. d256 with 80-key blocks 318 / 284 (345 causal at 16k), 64-key blocks
///   317 / 273, 48 keys (3 stages) 298 / 258, 32 keys 273 / 237 (the fastest before the K/V
///   copies stopped holding 14 precomputed pointers), and 295 / 255 with conditional
///   rescaling. Every warp reads all of K and V from shared memory for its 16 rows, so d256 is
///   bound by shared-memory bandwidth (FlashAttention-2 has the same structure there).
const CANDIDATES: [(usize, &[Tiles]); 4] = [
    (
        64,
        &[
            t(128, 64, 4, 2, 2, 1, false, false),
            t(64, 128, 4, 1, 2, 2, true, false),
            t(64, 64, 4, 1, 2, 1, true, false),
        ],
    ),
    (
        128,
        &[
            t(128, 64, 4, 2, 2, 2, false, true),
            t(128, 64, 8, 1, 2, 1, true, false),
            t(64, 64, 4, 1, 2, 1, true, false),
        ],
    ),
    (
        192,
        &[
            t(128, 64, 8, 1, 2, 1, false, false),
            t(128, 32, 8, 1, 2, 1, false, false),
            t(64, 32, 4, 1, 2, 1, false, false),
        ],
    ),
    (
        256,
        &[
            t(128, 80, 8, 1, 2, 1, false, false),
            t(128, 64, 8, 1, 2, 1, false, false),
            t(128, 32, 8, 1, 2, 1, false, false),
            t(64, 32, 4, 1, 2, 1, false, false),
        ],
    ),
];

/// Tiles for one padded head dim on one GPU (a pure function of the two): the first candidate
/// that fits, or `None` when none does.
pub fn tiles(arch: &GpuArch, head_dim: usize) -> Option<Tiles> {
    CANDIDATES
        .iter()
        .find(|(d, _)| *d == head_dim)?
        .1
        .iter()
        .copied()
        .find(|t| t.check(head_dim, arch).is_ok())
}

/// A planned launch of the Ampere-class kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The kernel to compile.
    pub spec: KernelSpec,
    /// Grid: (group, query blocks, groups), one CTA per tile (query block × head × sequence) in
    /// groups of (sequence, head) pairs (`config::tile_order`).
    pub grid: (u32, u32, u32),
}

/// Every spec the planner can emit for `arch` (for compile tests and warm-up).
pub fn all_specs(arch: &GpuArch, target: &'static str) -> Vec<KernelSpec> {
    let mut out = Vec::new();
    for head_dim in HEAD_DIMS {
        let Some(tiles) = tiles(arch, head_dim) else {
            continue;
        };
        out.extend(
            super::feature_variants().map(|(bf16, window, softcap)| KernelSpec {
                target,
                bf16,
                head_dim,
                window,
                softcap,
                tiles,
            }),
        );
    }
    out
}

/// An error naming `name` unless `v` is a whole number of 16-byte vectors (the kernels'
/// copies); `who` is what requires it (`backend`, `backward`).
pub(crate) fn aligned(name: &str, what: &str, v: usize, who: &str) -> Result<()> {
    if !v.is_multiple_of(VECTOR_ELEMS) {
        return Err(Error::invalid(
            name,
            format!("{what} {v} must be a multiple of {VECTOR_ELEMS} elements (16-byte copies) for the CUDA {who}"),
        ));
    }
    Ok(())
}

/// The checks every `mma.sync` planner (this forward and the backward) makes first: a 16-bit
/// dtype (returns whether bf16), `head_dim_v == head_dim` (with `narrower_v`, the Hopper
/// backward's row kernels: `head_dim_v ≤ head_dim`), the head dim padded to the first of
/// `head_dims` that holds it (returned), and whole 16-byte vectors per row. `who` names the
/// caller in the dtype and alignment errors (`backend`, `backward`), `kernel` in the
/// head-dim limit's (`kernel`, `backward`).
pub(crate) fn sixteen_bit_head(
    p: &Problem,
    head_dims: &[usize],
    who: &str,
    kernel: &str,
    narrower_v: bool,
) -> Result<(bool, usize)> {
    let bf16 = match p.dtype() {
        DType::Bf16 => true,
        DType::F16 => false,
        other => {
            return Err(Error::invalid(
                "dtype",
                format!("the CUDA {who} computes fp16 and bf16, not {other}; use the CPU backend"),
            ))
        }
    };
    let d = p.head_dim();
    if narrower_v && p.head_dim_v() < d {
        aligned("v", "head_dim_v", p.head_dim_v(), who)?;
    } else if p.head_dim_v() > d {
        return Err(Error::invalid(
            "v",
            format!(
                "head_dim_v {} exceeds head_dim {d}: no CUDA {who} takes V wider than Q",
                p.head_dim_v()
            ),
        ));
    } else if p.head_dim_v() != d {
        return Err(Error::invalid(
            "v",
            format!(
                "head_dim_v {} must equal head_dim {d} on the CUDA {who}",
                p.head_dim_v()
            ),
        ));
    }
    let Some(&head_dim) = head_dims.iter().find(|&&h| h >= d) else {
        return Err(Error::invalid(
            "q",
            format!(
                "head_dim {d} exceeds the CUDA {kernel}'s maximum {}",
                head_dims[head_dims.len() - 1]
            ),
        ));
    };
    aligned("q", "head_dim", d, who)?;
    Ok((bf16, head_dim))
}

/// Plans a problem for a GPU, or says why this kernel cannot run it. `tiles` overrides the
/// planner's tile choice (benchmarks); it is checked like everything else.
pub fn plan(
    p: &Problem,
    arch: &GpuArch,
    target: &'static str,
    tiles: Option<Tiles>,
) -> Result<Plan> {
    let (bf16, head_dim) = sixteen_bit_head(p, &HEAD_DIMS, "backend", "kernel", false)?;
    let d = p.head_dim();
    for (name, axis, st) in super::strides(p) {
        aligned(name, axis, st, "backend")?;
    }
    if p.scale() == 0.0 {
        return Err(Error::invalid(
            "scale",
            "a zero scale is not supported by the CUDA backend",
        ));
    }
    let tiles = match tiles {
        Some(t) => {
            t.check(head_dim, arch)?;
            t
        }
        None => self::tiles(arch, head_dim).ok_or_else(|| {
            Error::invalid(
                "q",
                format!(
                    "head_dim {d} needs more shared memory than {} has per block ({} bytes)",
                    arch.name,
                    arch.max_smem_per_block()
                ),
            )
        })?,
    };
    // CTAs resident at once: the launch bound's count, or more where shared memory and threads
    // allow (registers permitting: an estimate, for the launch order only).
    let smem = tiles.smem_bytes(head_dim) + arch.smem_reserved_per_block as usize;
    let per_sm = (arch.smem_per_sm as usize / smem)
        .min(arch.max_threads_per_sm as usize / (32 * tiles.num_warps))
        .max(tiles.min_blocks_per_sm);
    let grid = super::tile_order(p, tiles.block_m, head_dim, arch.sm_count as usize * per_sm)?;
    Ok(Plan {
        spec: KernelSpec {
            target,
            bf16,
            head_dim,
            window: p.mask().is_restrictive(),
            softcap: p.softcap().is_some(),
            tiles,
        },
        grid,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::{A100, H200, RTX_5090};

    #[test]
    fn tiles_fit_every_part() {
        for arch in [A100, H200, RTX_5090] {
            for d in HEAD_DIMS {
                let t = tiles(&arch, d).unwrap_or_else(|| panic!("{} d{d}", arch.name));
                assert_eq!(t.block_m, t.num_warps * t.m_tiles * ROWS_PER_WARP);
                assert!(
                    t.smem_bytes(d) <= arch.max_smem_per_block() as usize,
                    "{} d{d}",
                    arch.name
                );
            }
        }
        let h = tiles(&H200, 128).unwrap();
        assert_eq!(
            (h.block_m, h.block_n, h.num_warps, h.m_tiles, h.stages),
            (128, 64, 4, 2, 2)
        );
        assert!(h.lazy_rescale && h.min_blocks_per_sm == 2);
        let r = tiles(&RTX_5090, 256).unwrap();
        assert_eq!(
            (r.block_m, r.block_n, r.num_warps, r.stages),
            (64, 32, 4, 2)
        );
    }

    #[test]
    fn bad_tiles_are_rejected() {
        let good = tiles(&H200, 128).unwrap();
        for bad in [
            Tiles {
                block_m: 100,
                ..good
            },
            Tiles {
                block_n: 24,
                ..good
            },
            Tiles { stages: 1, ..good },
            Tiles {
                stages: 4,
                block_n: 256,
                ..good
            },
            Tiles {
                min_blocks_per_sm: 2,
                stages: 3,
                ..good
            },
            Tiles { m_tiles: 3, ..good },
        ] {
            assert!(bad.check(128, &H200).is_err(), "{bad:?}");
        }
    }
}
