//! The GPU backward's plan (`kernels/bwd/`): which kernels run, their tiles, warps, shared
//! memory and grids. Pure functions of the problem, the GPU's shared memory and the NVRTC
//! target; the kernels see these numbers only through the generated prelude.
//!
//! A backward is three or four launches on one stream:
//!
//! 1. `pre` ([`BwdKernel::Pre`]): `D_i = dO_i·O_i` per query row (f32), and the f32 dQ
//!    accumulator zeroed (not in deterministic mode);
//! 2. `main` ([`BwdKernel::Main`]): one CTA per (key block, KV head, sequence) computes dK and
//!    dV of its keys over every query head of the KV head and every query block the mask
//!    allows, and adds dS·K into the dQ accumulator with f32 atomics;
//! 3. `convert` ([`BwdKernel::Convert`]): dQ = scale · accumulator, in the storage dtype;
//!
//! or, deterministic ([`crate::BackwardOptions::deterministic`]): `pre`, `main` without its dQ
//! part, and `dq` ([`BwdKernel::Dq`]), one CTA per (query block, head, sequence) summing its dQ
//! rows in registers over the key blocks in order, no atomics.

use std::fmt;

use super::prelude::Prelude;
use crate::arch::GpuArch;
use crate::error::{Error, Result};
use crate::problem::Problem;

/// Head dims the kernels are compiled for; a problem's head dim (a multiple of 8) is padded to
/// the next one (loads zero-fill the columns past it, stores skip them).
pub const HEAD_DIMS: [usize; 3] = [64, 128, 256];
/// Warps of the row kernels (`pre`, `convert`).
pub const AUX_WARPS: usize = 4;

/// Lanes of a row kernel that share one query row: one 16-byte chunk (8 columns) each, so that
/// no lane idles at head dims below 256 (`ROW_LANES` in the kernels' prelude).
pub fn row_lanes(head_dim: usize) -> usize {
    (head_dim / 8).clamp(1, 32)
}

/// Query rows per CTA of the row kernels (the Ampere-class layout, and the Hopper `pre`).
pub fn aux_rows_per_cta(head_dim: usize) -> usize {
    AUX_WARPS * 32 / row_lanes(head_dim)
}

/// Query rows per CTA of the Hopper `convert`, which reads the accumulator's 64 × 64 tiles
/// whole: half a 64-row group (two 16-row quarters of each tile).
pub const CONVERT_TILE_ROWS: usize = 32;

/// Which of the backward's kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BwdKernel {
    /// `D = rowsum(dO ∘ O)` and the zeroed dQ accumulator.
    Pre,
    /// dK, dV (and the dQ atomics unless deterministic).
    Main,
    /// The deterministic dQ.
    Dq,
    /// The dQ accumulator to the storage dtype.
    Convert,
}

/// Tiles of the main kernel: `block_n` keys per CTA, `block_m` queries per step of its walk,
/// `num_warps = block_n / 16 · dsplit` warps (warp `w` owns 16 keys and the `w / (block_n / 16)`-th
/// of `dsplit` column groups of dK and dV).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MainTiles {
    /// Query rows per step.
    pub block_m: usize,
    /// Keys per CTA.
    pub block_n: usize,
    /// Column groups of dK/dV (1, or 2 where a warp's 16 × head_dim accumulators would not fit
    /// in registers).
    pub dsplit: usize,
}

impl MainTiles {
    /// Warps per CTA.
    pub fn num_warps(&self) -> usize {
        self.block_n / 16 * self.dsplit
    }

    /// Dynamic shared memory at a padded head dim: K and V, two buffers of Q and dO, dSᵀ (all
    /// rows padded by 8 elements), and two buffers of LSE and D (f32).
    pub fn smem_bytes(&self, head_dim: usize) -> usize {
        let ld = head_dim + 8;
        2 * (2 * self.block_n * ld + 4 * self.block_m * ld + self.block_n * (self.block_m + 8))
            + 4 * 2 * self.block_m * 4
    }

    /// Checks the tiles against the kernel's static_asserts at `head_dim`.
    pub fn check(&self, head_dim: usize) -> Result<()> {
        let warps = self.num_warps();
        let mw = self.block_m / 16;
        // In this order: each test guards the divisions of the next.
        let ok = self.block_n > 0
            && self.block_m > 0
            && self.block_n.is_multiple_of(16)
            && self.block_m.is_multiple_of(16)
            && matches!(self.dsplit, 1 | 2)
            && (1..=16).contains(&warps)
            && warps.is_multiple_of(mw)
            && (head_dim / (warps / mw)).is_multiple_of(16)
            && (head_dim / self.dsplit).is_multiple_of(16);
        if ok {
            Ok(())
        } else {
            Err(Error::invalid(
                "tiles",
                format!(
                    "backward main tiles {self:?} do not fit the kernel at head_dim {head_dim}"
                ),
            ))
        }
    }
}

/// Tiles of the deterministic dQ kernel: `block_m` query rows per CTA (16 per warp), `block_n`
/// keys per step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DqTiles {
    /// Query rows per CTA.
    pub block_m: usize,
    /// Keys per step.
    pub block_n: usize,
}

impl DqTiles {
    /// Warps per CTA.
    pub fn num_warps(&self) -> usize {
        self.block_m / 16
    }

    /// Dynamic shared memory: Q and dO, two buffers of K and V (rows padded by 8 elements).
    pub fn smem_bytes(&self, head_dim: usize) -> usize {
        2 * (head_dim + 8) * (2 * self.block_m + 4 * self.block_n)
    }
}

/// The planner's tiles for a padded head dim.
///
/// - d64: 128 keys × 64 queries, 8 warps; each warp's dK, dV (16 × 64) and Sᵀ, dPᵀ (16 × 64)
///   take 64 registers each.
/// - d128: 128 keys × 32 queries, 8 warps: dK, dV 128 registers, Sᵀ, dPᵀ 32 (with 64 queries
///   the kernel hits 255 registers and spills 52 bytes). On the H200 (bf16, 16k tokens) 128
///   keys ran 163–177 TFLOP/s where 64 keys × 32 queries (4 warps, 2 CTAs per SM) ran 141–151:
///   half the dQ reductions and half the Q, dO loads per key.
/// - d256: 64 keys × 32 queries, 8 warps in two column groups: dK, dV 16 × 128 per warp.
pub fn main_tiles(head_dim: usize) -> MainTiles {
    match head_dim {
        64 => MainTiles {
            block_m: 64,
            block_n: 128,
            dsplit: 1,
        },
        128 => MainTiles {
            block_m: 32,
            block_n: 128,
            dsplit: 1,
        },
        _ => MainTiles {
            block_m: 32,
            block_n: 64,
            dsplit: 2,
        },
    }
}

/// The deterministic dQ kernel's tiles: 64 rows (4 warps), 64 keys per step (32 at d256, where
/// each warp's dQ is 16 × 256 in registers).
pub fn dq_tiles(head_dim: usize) -> DqTiles {
    DqTiles {
        block_m: 64,
        block_n: if head_dim > 128 { 32 } else { 64 },
    }
}

/// Why [`main_tiles`] chose its tiles at a padded head dim, in one sentence (`fa4 plan
/// --backward` prints it; the measurements behind it are in [`main_tiles`]' docs).
pub fn main_tiles_reason(head_dim: usize) -> &'static str {
    match head_dim {
        64 => {
            "each warp's 16-key dK and dV (16 x 64) and its S^T, dP^T (16 x 64) take 64 registers \
               apiece, so 8 warps cover 128 keys against 64-query steps"
        }
        128 => {
            "a warp's dK, dV (16 x 128) take 128 registers and S^T, dP^T 32 at 32-query steps; \
                64-query steps reach 255 registers and spill, and 128 keys per CTA ran 163-177 \
                TFLOP/s on the H200 where 64 keys ran 141-151 (half the dQ reductions and the Q, \
                dO loads per key)"
        }
        _ => {
            "a warp's 16 x 256 dK and dV would not fit in registers: 8 warps split them into \
              two column groups of 16 x 128 (each group recomputes S^T and dP^T) over 64 keys \
              and 32-query steps"
        }
    }
}

/// Why [`dq_tiles`] chose its tiles (`fa4 plan --backward --deterministic`).
pub fn dq_tiles_reason(head_dim: usize) -> &'static str {
    if head_dim > 128 {
        "64 query rows per CTA, 16 per warp, whose 16 x 256 dQ stays in registers; 32 keys per \
         step keep S and dP beside it"
    } else {
        "64 query rows per CTA, 16 per warp with their dQ in registers, 64 keys per step"
    }
}

/// One kernel of the backward, with everything it is specialised on: the compile-cache key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BwdSpec {
    /// NVRTC target (`sm_80`, `sm_90`, …).
    pub target: &'static str,
    /// Which kernel.
    pub kernel: BwdKernel,
    /// bf16 (else fp16).
    pub bf16: bool,
    /// Padded head dim.
    pub head_dim: usize,
    /// A window (or causal) mask.
    pub window: bool,
    /// Softcap.
    pub softcap: bool,
    /// Deterministic mode (the main kernel leaves dQ to the `dq` kernel).
    pub deterministic: bool,
    /// The main kernel's tiles.
    pub main: MainTiles,
    /// The dQ kernel's tiles.
    pub dq: DqTiles,
}

impl BwdSpec {
    /// Threads per CTA.
    pub fn threads(&self) -> usize {
        32 * match self.kernel {
            BwdKernel::Pre | BwdKernel::Convert => AUX_WARPS,
            BwdKernel::Main => self.main.num_warps(),
            BwdKernel::Dq => self.dq.num_warps(),
        }
    }

    /// Dynamic shared memory of a launch.
    pub fn smem_bytes(&self) -> usize {
        match self.kernel {
            BwdKernel::Pre | BwdKernel::Convert => 0,
            BwdKernel::Main => self.main.smem_bytes(self.head_dim),
            BwdKernel::Dq => self.dq.smem_bytes(self.head_dim),
        }
    }

    /// The entry point.
    pub fn entry(&self) -> &'static str {
        match self.kernel {
            BwdKernel::Pre => "fa4_bwd_pre",
            BwdKernel::Main => "fa4_bwd_main",
            BwdKernel::Dq => "fa4_bwd_dq",
            BwdKernel::Convert => "fa4_bwd_convert",
        }
    }

    /// The generated prelude. Only the kernel's own numbers vary between kernels of one
    /// problem, so `pre` and `convert` compile once per dtype and head dim.
    pub fn prelude(&self) -> String {
        let (block_m, block_n, warps, dsplit) = match self.kernel {
            BwdKernel::Main => (
                self.main.block_m,
                self.main.block_n,
                self.main.num_warps(),
                self.main.dsplit,
            ),
            BwdKernel::Dq => (self.dq.block_m, self.dq.block_n, self.dq.num_warps(), 1),
            BwdKernel::Pre | BwdKernel::Convert => (16, 16, AUX_WARPS, 1),
        };
        let main = self.kernel == BwdKernel::Main;
        let rows = matches!(self.kernel, BwdKernel::Pre | BwdKernel::Convert);
        // Each kernel gets the numbers it reads: NVRTC warns (#177) about a constant nothing
        // references, and a warning-free log keeps real warnings visible. The row kernels read
        // no BLOCK_M; only the main kernel has column groups and a mode switch.
        let mut pre = Prelude::new("config::bwd", self).int("HEAD_DIM", self.head_dim);
        if !rows {
            pre = pre.int("BLOCK_M", block_m);
        }
        pre = pre.int("BLOCK_N", block_n).int("NUM_WARPS", warps);
        if rows {
            pre = pre.int("ROW_LANES", row_lanes(self.head_dim));
        }
        if main {
            pre = pre.int("DSPLIT", dsplit);
        }
        pre = pre
            .flag("IS_BF16", self.bf16)
            .flag("HAS_WINDOW", self.window && !rows)
            .flag(
                "HAS_SOFTCAP",
                self.softcap && (main || self.kernel == BwdKernel::Dq),
            )
            .flag("LAZY_RESCALE", false)
            .flag("VEC_RED", vector_reductions(self.target));
        if main {
            pre = pre.flag("DETERMINISTIC", self.deterministic);
        }
        pre.define("FA4_SMEM_BYTES", self.smem_bytes()).finish()
    }

    /// The same problem's spec of another kernel.
    pub fn with_kernel(&self, kernel: BwdKernel) -> BwdSpec {
        let mut s = BwdSpec { kernel, ..*self };
        // The row kernels do not depend on the mask, softcap or mode: one variant serves all.
        if matches!(kernel, BwdKernel::Pre | BwdKernel::Convert) {
            s.window = false;
            s.softcap = false;
            s.deterministic = false;
            s.main = main_tiles(self.head_dim);
            s.dq = dq_tiles(self.head_dim);
        }
        if kernel == BwdKernel::Dq {
            s.deterministic = true;
            s.main = main_tiles(self.head_dim);
        }
        s
    }
}

impl fmt::Display for BwdSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let dt = if self.bf16 { "bf16" } else { "fp16" };
        let feats = format!(
            "{}{}{}",
            if self.window { " window" } else { "" },
            if self.softcap { " softcap" } else { "" },
            if self.deterministic {
                " deterministic"
            } else {
                ""
            }
        );
        match self.kernel {
            BwdKernel::Main => write!(
                f,
                "bwd main {} {dt} d{} {}x{} {} warps{feats}",
                self.target,
                self.head_dim,
                self.main.block_n,
                self.main.block_m,
                self.main.num_warps()
            ),
            BwdKernel::Dq => write!(
                f,
                "bwd dq {} {dt} d{} {}x{} {} warps{feats}",
                self.target,
                self.head_dim,
                self.dq.block_m,
                self.dq.block_n,
                self.dq.num_warps()
            ),
            BwdKernel::Pre => write!(f, "bwd pre {} {dt} d{}", self.target, self.head_dim),
            BwdKernel::Convert => write!(f, "bwd convert {} {dt} d{}", self.target, self.head_dim),
        }
    }
}

/// Whether a target has `red.global.add.v2.f32` (sm_90 and later).
fn vector_reductions(target: &str) -> bool {
    target
        .trim_start_matches("sm_")
        .trim_end_matches(|c: char| c.is_ascii_alphabetic())
        .parse::<u32>()
        .is_ok_and(|v| v >= 90)
}

/// A planned backward: the specs and grids of its launches, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BwdPlan {
    /// `(spec, grid)` of each launch, in stream order.
    pub launches: Vec<(BwdSpec, (u32, u32, u32))>,
    /// f32 elements of the dQ accumulator (0 in deterministic mode).
    pub accum_len: usize,
    /// f32 elements of D (`acc_rows · heads_q`).
    pub dpsum_len: usize,
    /// Accumulator rows per batch entry (the `acc_batch_rows` param).
    pub acc_batch_rows: usize,
}

impl fmt::Display for BwdPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (spec, grid)) in self.launches.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(
                f,
                "{spec}: grid {}x{}x{}, {} threads, {} B smem",
                grid.0,
                grid.1,
                grid.2,
                spec.threads(),
                spec.smem_bytes()
            )?;
        }
        Ok(())
    }
}

fn grid_dim(name: &str, x: usize) -> Result<u32> {
    u32::try_from(x)
        .ok()
        .filter(|&v| v <= 65_535 || name == "x")
        .ok_or_else(|| Error::invalid("q", format!("{x} {name} exceed the CUDA grid")))
}

/// Plans the backward of a validated problem for a GPU, or says why the kernels cannot run it.
/// `main` overrides the main kernel's tiles (tuning); they are checked like the planner's.
pub fn plan(
    p: &Problem,
    arch: &GpuArch,
    target: &'static str,
    deterministic: bool,
    main: Option<MainTiles>,
) -> Result<BwdPlan> {
    plan_with(p, arch, target, deterministic, main, false)
}

/// The non-deterministic plan whose row kernels (`pre`, `convert`) and workspaces the Hopper
/// main kernel takes ([`super::bwd_sm90::plan`]). Unlike [`plan`] it accepts a head dim of V
/// (and O, dO) below Q's: `pre` sums D = rowsum(dO ∘ O) over V's columns and `convert` writes
/// dQ over Q's, while this plan's own main kernel, which assumes them equal, is never launched.
pub fn plan_rows_for_hopper(p: &Problem, arch: &GpuArch, target: &'static str) -> Result<BwdPlan> {
    plan_with(p, arch, target, false, None, true)
}

fn plan_with(
    p: &Problem,
    arch: &GpuArch,
    target: &'static str,
    deterministic: bool,
    main: Option<MainTiles>,
    narrower_v: bool,
) -> Result<BwdPlan> {
    let (bf16, head_dim) =
        super::sm80::sixteen_bit_head(p, &HEAD_DIMS, "backward", "backward", narrower_v)?;
    let d = p.head_dim();
    if p.scale() == 0.0 {
        return Err(Error::invalid(
            "scale",
            "a zero scale is not supported by the CUDA backend",
        ));
    }
    let main = match main {
        Some(t) => {
            t.check(head_dim)?;
            t
        }
        None => main_tiles(head_dim),
    };
    let spec = BwdSpec {
        target,
        kernel: BwdKernel::Main,
        bf16,
        head_dim,
        window: p.mask().is_restrictive(),
        softcap: p.softcap().is_some(),
        deterministic,
        main,
        dq: dq_tiles(head_dim),
    };
    let max_smem = arch.max_smem_per_block() as usize;
    for k in [BwdKernel::Main, BwdKernel::Dq] {
        let s = spec.with_kernel(k);
        if s.smem_bytes() > max_smem {
            return Err(Error::invalid(
                "q",
                format!(
                    "head_dim {d}: the backward's {} needs {} B of shared memory, {} has {max_smem}",
                    s.entry(),
                    s.smem_bytes(),
                    arch.name
                ),
            ));
        }
    }
    let seqs = p.sequences();
    let batch = seqs.len();
    let max_q = seqs.iter().map(|s| s.q_len).max().unwrap_or(0);
    let max_k = seqs.iter().map(|s| s.k_len).max().unwrap_or(0);
    let (heads_q, heads_kv) = (p.heads_q(), p.heads_kv());
    let acc_batch_rows = if p.is_varlen() { 0 } else { max_q };
    let acc_rows = seqs.iter().map(|s| s.q_len).sum::<usize>();
    let rows_grid = |rows: usize, per: usize| -> Result<(u32, u32, u32)> {
        Ok((
            grid_dim("x", rows.div_ceil(per))?,
            grid_dim("heads", heads_q)?,
            grid_dim("sequences", batch)?,
        ))
    };
    let mut launches = vec![(
        spec.with_kernel(BwdKernel::Pre),
        rows_grid(max_q, aux_rows_per_cta(head_dim))?,
    )];
    launches.push((
        spec,
        (
            grid_dim("x", max_k.div_ceil(main.block_n))?,
            grid_dim("heads", heads_kv)?,
            grid_dim("sequences", batch)?,
        ),
    ));
    if deterministic {
        let dq = spec.with_kernel(BwdKernel::Dq);
        launches.push((dq, rows_grid(max_q, dq.dq.block_m)?));
    } else {
        launches.push((
            spec.with_kernel(BwdKernel::Convert),
            rows_grid(max_q, aux_rows_per_cta(head_dim))?,
        ));
    }
    let accum_len = if deterministic {
        0
    } else {
        acc_rows * heads_q * head_dim
    };
    // The kernels index the workspaces in int64 but the rows of one launch in int32.
    if acc_rows > i32::MAX as usize || max_k > i32::MAX as usize {
        return Err(Error::invalid("q", "more than 2^31 rows"));
    }
    Ok(BwdPlan {
        launches,
        accum_len,
        dpsum_len: acc_rows * heads_q,
        acc_batch_rows,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch;
    use crate::dtype::DType;
    use crate::problem::Options;
    use crate::tensor::Layout;

    fn problem(d: usize, causal: bool) -> Problem {
        let l = Layout::new("q", &[2, 300, 4, d], None).unwrap();
        let opts = if causal {
            Options::new().causal()
        } else {
            Options::new()
        };
        Problem::new(DType::Bf16, &l, &l, &l, &l, None, None, &opts).unwrap()
    }

    #[test]
    fn every_head_dim_fits_the_h100_and_a100_and_the_tiles_check() {
        for d in [64, 96, 128, 256] {
            for a in [arch::H100, arch::A100] {
                for det in [false, true] {
                    let plan = plan(&problem(d, true), &a, "sm_80", det, None).unwrap();
                    assert_eq!(plan.launches.len(), 3);
                    let main = &plan.launches[1].0;
                    main.main.check(main.head_dim).unwrap();
                    assert!(
                        main.smem_bytes() <= a.max_smem_per_block() as usize,
                        "{main}"
                    );
                    assert_eq!(
                        plan.launches[1].1,
                        (300u32.div_ceil(main.main.block_n as u32), 4, 2)
                    );
                }
            }
        }
    }

    #[test]
    fn deterministic_swaps_convert_for_dq_and_drops_the_accumulator() {
        let p = problem(128, false);
        let a = plan(&p, &arch::H100, "sm_90", false, None).unwrap();
        let d = plan(&p, &arch::H100, "sm_90", true, None).unwrap();
        assert_eq!(a.launches[2].0.kernel, BwdKernel::Convert);
        assert_eq!(d.launches[2].0.kernel, BwdKernel::Dq);
        assert_eq!(a.accum_len, 2 * 300 * 4 * 128);
        assert_eq!(d.accum_len, 0);
        assert_eq!(a.dpsum_len, d.dpsum_len);
        assert!(d.launches[1]
            .0
            .prelude()
            .contains("constexpr bool DETERMINISTIC = true;"));
        assert!(a.launches[1]
            .0
            .prelude()
            .contains("constexpr bool DETERMINISTIC = false;"));
    }

    #[test]
    fn vector_reductions_from_sm_90_on() {
        assert!(!vector_reductions("sm_80") && !vector_reductions("sm_89"));
        assert!(
            vector_reductions("sm_90")
                && vector_reductions("sm_90a")
                && vector_reductions("sm_120")
        );
    }

    #[test]
    fn bad_problems_and_tiles_are_errors_naming_the_argument() {
        let l = Layout::new("q", &[1, 16, 2, 512], None).unwrap();
        let p = Problem::new(DType::Bf16, &l, &l, &l, &l, None, None, &Options::new()).unwrap();
        let e = plan(&p, &arch::H100, "sm_90", false, None).unwrap_err();
        assert!(e.to_string().contains("q"), "{e}");
        let bad = MainTiles {
            block_m: 48,
            block_n: 64,
            dsplit: 1,
        };
        let e = plan(&problem(128, false), &arch::H100, "sm_90", false, Some(bad)).unwrap_err();
        assert!(e.to_string().contains("tiles"), "{e}");
    }
}
