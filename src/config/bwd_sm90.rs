//! The Hopper backward's plan (`kernels/bwd_sm90/`): which problems its main kernel covers, its
//! tiles, register split, shared memory and grid. The row kernels around it (`pre`, `convert`)
//! are the Ampere-class backward's ([`super::bwd`]); a problem the Hopper kernel does not cover
//! runs the Ampere-class backward whole.
//!
//! One CTA per (key block of `block_n` = 128 keys, KV head, batch entry): a producer warpgroup
//! (TMA: K, V once, Q and dO per query block through a `stages`-deep ring) and two consumer
//! warpgroups of 64 keys each (the M of `wgmma`); each step's LSE and D rows come by bulk copy
//! with its Q and dO, padded by `pre` to whole query blocks. Per query block of
//! `block_m` rows each consumer holds Sᵀ and dPᵀ (64 × `block_m` f32) and its dK and dV
//! (64 × head_dim f32) in registers; dSᵀ goes through shared memory for dQ = dS·K, which the
//! consumers split into 64 × 64 tiles (or, with one tile, take turns on); each tile goes to the
//! warpgroup's shared buffer and each warp adds its 16 rows with one bulk reduce-add (TMA) to
//! the f32 accumulator, which for this kernel is laid out in those tiles ([`Plan::base`]'s
//! `accum_len` covers the padded rows).
//!
//! The deterministic mode ([`Tiles::deterministic`]) is the same kernel with dQ added in a fixed
//! order: each (KV head, sequence)'s key blocks are handed out from the last, and key block n
//! adds to a query block's rows when a semaphore per query block (after the tile counter in the
//! D workspace, zeroed by `pre`) says that every later key block that sees those rows has added.
//! To head dim 128 warp 1 of the producer warpgroup takes the turns and the bulk reduce-adds
//! (the consumers hand it their tiles through named barriers); in the shared-keys form each
//! consumer waits for its turn itself.

use std::fmt;

use super::bwd::{self, BwdKernel, BwdPlan, BwdSpec};
use super::prelude::{Prelude, RoleWarps};
use super::sm90::wgmma::{OperandA, Wgmma};
use crate::arch::{Family, GpuArch};
use crate::error::{Error, Result};
use crate::problem::Problem;

/// Tile widths of the Hopper backward: a head dim that is a multiple of 8 up to 256 runs in the
/// first that holds it ([`padded_head_dim`]). The 256-wide tiles are the shared-keys form
/// ([`shared_keys`]).
pub const HEAD_DIMS: [usize; 3] = [64, 128, 256];

/// The tile width a head dim runs in: the first of [`HEAD_DIMS`] that holds it, for multiples
/// of 8 (the TMA maps' 16-byte row rule), else `None`. Q, K, V and dO narrower than the tile
/// come through per-slab maps over their real columns, the rest of the tile zero-filled by the
/// hardware; Sᵀ and dPᵀ run over the head dim rounded up to 16 (`QK_DIM`), dK, dV and dQ over
/// the whole tile, and only the real columns are stored. Measured against the Ampere-class
/// backward on the H200: docs/perf.md, "Backward".
pub fn padded_head_dim(head_dim: usize) -> Option<usize> {
    if head_dim == 0 || !head_dim.is_multiple_of(8) {
        return None;
    }
    HEAD_DIMS.into_iter().find(|&t| head_dim <= t)
}
/// Threads of a warpgroup (the unit of `wgmma` and `setmaxnreg`).
pub const WARPGROUP_THREADS: usize = 128;
/// Keys per consumer warpgroup: the M of `wgmma`.
pub const KEYS_PER_CONSUMER: usize = 64;
/// Consumer warpgroups per CTA.
pub const CONSUMER_WGS: usize = 2;

/// Whether tiles `head_dim` wide take the shared-keys form: both consumers take the block's 64
/// keys (the M of `wgmma`), consumer c the queries `[c·block_m/2, …)` of Sᵀ and dPᵀ and the
/// columns `[c·head_dim/2, …)` of dK, dV and dQ; Pᵀ and dSᵀ go through shared memory and dV,
/// dK read them from there. Past 128 columns a consumer's own 64 keys would need dK and dV of
/// 64 × head_dim each, 2 · head_dim / 2 ≥ 256 f32 registers per thread: more than it has.
pub fn shared_keys(head_dim: usize) -> bool {
    head_dim > 128
}

/// Keys per CTA at tile width `head_dim`: 64 per consumer, or 64 shared ([`shared_keys`]).
pub fn block_n(head_dim: usize) -> usize {
    if shared_keys(head_dim) {
        KEYS_PER_CONSUMER
    } else {
        KEYS_PER_CONSUMER * CONSUMER_WGS
    }
}
/// Registers per thread of the CTA at launch (`__launch_bounds__(384, 1)`): the register file
/// (64K) over 384 threads, rounded down to the allocation granularity of 8.
pub const LAUNCH_REGS: u32 = 168;
/// Alignment of every shared-memory tile (the 128-byte swizzle repeats every 1024 bytes).
pub const TILE_ALIGN: usize = 1024;
/// Shared memory the kernel keeps its tiles' work descriptions in (block, trip bounds; read
/// where needed instead of held in registers): two slots of 128 bytes, the tile the consumers
/// work on and the next.
pub const WORK_BYTES: usize = 2 * 128;
/// Named barriers of the kernel, in id order (id 0 is `__syncthreads`).
/// `STATS_FREE0`/`1`/`2`: the consumers have read a stage's row statistics (producer warp 0
/// syncs before the stage's next bulk copies; one per stage of a ring of 2 or 3).
/// `DQ_FULL0`/`1`, `DQ_EMPTY0`/`1` (deterministic, to head dim 128): consumer warpgroup c's dQ
/// tile is in its buffer / the dQ writer warp has read it out. `DQ_TURN0`/`1` (deterministic,
/// shared keys): consumer warpgroup c's own wait for its turn and its release.
pub const NAMED_BARRIERS: [&str; 12] = [
    "SYNC_ALL",
    "DS_READY",
    "CLEANED",
    "STATS_FREE0",
    "STATS_FREE1",
    "STATS_FREE2",
    "DQ_FULL0",
    "DQ_FULL1",
    "DQ_EMPTY0",
    "DQ_EMPTY1",
    "DQ_TURN0",
    "DQ_TURN1",
];
/// The deterministic mode's notes from the consumers to the dQ writer warp (to head dim 128),
/// two of 32 bytes: where a step's dQ tiles go, their semaphore and the turn they wait for,
/// after the work slots.
pub const DQ_INFO_BYTES: usize = 64;
/// A consumer warpgroup's dQ tile (64 × 64 f32): the unit of its shared buffer, of the bulk
/// reduce-add and of the accumulator's layout.
pub const DQ_TILE_BYTES: usize = 64 * 64 * 4;

/// Tiles and register split of the main kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Tiles {
    /// Query rows per step: the N of Sᵀ = K·Qᵀ and the K of dV += Pᵀ·dO (a multiple of 64).
    pub block_m: usize,
    /// Q/dO ring stages.
    pub stages: usize,
    /// `setmaxnreg` target of the producer warpgroup.
    pub producer_regs: u32,
    /// `setmaxnreg` target of each consumer warpgroup.
    pub consumer_regs: u32,
    /// The deterministic mode: dQ added in a fixed order of key blocks (a semaphore per query
    /// block); to head dim 128 through the dQ writer warp, which needs [`DQ_INFO_BYTES`].
    pub deterministic: bool,
}

impl Tiles {
    /// Threads per CTA.
    pub fn threads(&self) -> usize {
        WARPGROUP_THREADS * (1 + CONSUMER_WGS)
    }

    /// Dynamic shared memory at `head_dim`: K and V, `stages` × (Q, dO), two dSᵀ buffers (and
    /// two Pᵀ buffers in the shared-keys form), one dQ tile per consumer warpgroup (none in the
    /// shared-keys form, which adds dQ from registers), `stages` × (LSE, D) rows in f32, the
    /// mbarriers, the CTA's work and the alignment slack (the kernel static_asserts the same
    /// sum).
    pub fn smem_bytes(&self, head_dim: usize) -> usize {
        let block_n = block_n(head_dim);
        let kv = block_n * head_dim * 2;
        let qo = self.block_m * head_dim * 2;
        let ds = block_n * self.block_m * 2;
        let stats = 2 * self.block_m * 4;
        let barriers = 8 * (6 + 2 * self.stages);
        let (pt_buffers, dq_tiles) = if shared_keys(head_dim) {
            (2, 0)
        } else {
            (0, CONSUMER_WGS)
        };
        2 * kv
            + self.stages * 2 * qo
            + (2 + pt_buffers) * ds
            + dq_tiles * DQ_TILE_BYTES
            + self.stages * stats
            + barriers
            + WORK_BYTES
            + if dq_writer(self.deterministic, head_dim) {
                DQ_INFO_BYTES
            } else {
                0
            }
            + TILE_ALIGN
    }

    /// Registers of the CTA after `setmaxnreg`: must fit the launch allocation, or a
    /// warpgroup's `setmaxnreg.inc` waits forever.
    pub fn registers(&self) -> usize {
        WARPGROUP_THREADS
            * (self.producer_regs as usize + CONSUMER_WGS * self.consumer_regs as usize)
    }

    /// Checks the tiles against the kernel's static_asserts and the register file.
    pub fn check(&self, head_dim: usize) -> Result<()> {
        let ok = self.block_m.is_multiple_of(64)
            && (64..=256).contains(&self.block_m)
            && head_dim.is_multiple_of(64)
            && CONSUMER_WGS.is_multiple_of(self.block_m / 64)
            && (head_dim / 64).is_multiple_of(dq_col_groups(self.block_m, head_dim))
            && (!shared_keys(head_dim)
                || (self.block_m == 64 * CONSUMER_WGS / 2
                    && (head_dim / CONSUMER_WGS).is_multiple_of(64)))
            && (2..=3).contains(&self.stages)
            && self.producer_regs.is_multiple_of(8)
            && self.consumer_regs.is_multiple_of(8)
            && (24..=256).contains(&self.producer_regs)
            && (24..=256).contains(&self.consumer_regs)
            && self.registers() <= WARPGROUP_THREADS * (1 + CONSUMER_WGS) * LAUNCH_REGS as usize;
        if ok {
            Ok(())
        } else {
            Err(Error::invalid(
                "tiles",
                format!(
                    "Hopper backward tiles {self:?} do not fit the kernel at head_dim {head_dim}"
                ),
            ))
        }
    }
}

/// Whether tiles `head_dim` wide run the dQ writer warp: the deterministic mode to head dim
/// 128 (the shared-keys form's consumers wait for their turns themselves). The kernel's
/// `DQ_WRITER`.
fn dq_writer(deterministic: bool, head_dim: usize) -> bool {
    deterministic && !shared_keys(head_dim)
}

/// Column groups of the dQ tile (block_m × head_dim): whole 64-column slabs (an MN-major
/// wgmma operand cannot start inside a swizzle atom), at most the consumers left per 64-row
/// group; in the shared-keys form every slab. The kernel computes the same number (`DQ_COL_GROUPS`).
fn dq_col_groups(block_m: usize, head_dim: usize) -> usize {
    if shared_keys(head_dim) {
        // One part per slab, each consumer taking its columns' parts in turn.
        return head_dim / 64;
    }
    (head_dim / 64)
        .min(CONSUMER_WGS / (block_m / 64).max(1))
        .max(1)
}

/// The tiles per head dim.
///
/// - d64: 128 queries per step. A consumer holds Sᵀ, dPᵀ (64 × 128: 64 registers each) and
///   dK, dV (64 × 64: 32 each); dQ (128 × 64) is two 64-row parts, one per consumer. Measured
///   on the H200 on 2026-12-02 (commit dad4d20, docs/perf.md): 13–14% faster than 64 queries
///   per step, where dQ was one part the consumers took turns on. It first spilled 16 bytes
///   with a window (four step-invariant offsets); the dQ tile's offsets are now recomputed
///   from the thread index each step.
/// - d128: 64 queries per step. Sᵀ, dPᵀ 32 registers each, dK, dV 64 each (128 queries would
///   need 256 for the four accumulators alone); dQ (64 × 128) splits into two column slabs,
///   one per consumer. Three Q/dO stages (d64 has no room for a third).
/// - d256 ([`shared_keys`]): 64 keys, 64 queries per step, two Q/dO stages (32 KiB per tile:
///   K, V and two stages of Q and dO take 192 of the 227 KiB, the Pᵀ and dSᵀ buffers 32 more,
///   so dQ goes from registers to the accumulator by 16-byte reductions, as FlashAttention-3
///   does at d256). A consumer holds Sᵀ, dPᵀ (64 × 32: 16 registers each), dK, dV (64 × 128:
///   64 each) and a 64 × 64 part of dQ (32), its two parts one after the other (both at once,
///   64 × 128, spilled 20 bytes in the varlen d192 variants). FlashAttention-4 runs the same tile (64 × 64,
///   both consumers on one key block) with single stages and a dQ tile in shared memory.
///
/// Registers: 24 for the producer, 240 for each consumer, as FlashAttention-3's backward:
/// 128 · (24 + 2 · 240) = 64512 of the 65536. No variant spills (`tests/nvrtc_compile.rs`)
/// once the CTA's work description lives in shared memory; 32 + 2 · 232 spilled 40 bytes in
/// the d128 softcap consumers. The deterministic mode to head dim 128 (`deterministic`) gives
/// the producer warpgroup 40 (its warp 1 is the dQ writer: at 24 the producer warp spilled
/// beside it) and each consumer 232 (its dQ goes to the writer, not to its own bulk copies).
pub fn tiles(head_dim: usize, deterministic: bool) -> Tiles {
    let writer = dq_writer(deterministic, head_dim);
    Tiles {
        block_m: if head_dim == 64 { 128 } else { 64 },
        stages: if head_dim == 128 { 3 } else { 2 },
        producer_regs: if writer { 40 } else { 24 },
        consumer_regs: if writer { 232 } else { 240 },
        deterministic,
    }
}

/// The main kernel with everything it is specialised on: the compile-cache key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Spec {
    /// NVRTC target: `sm_90a` (wgmma and setmaxnreg need the architecture-specific target).
    pub target: &'static str,
    /// bf16 (else fp16).
    pub bf16: bool,
    /// Tile width (one of [`HEAD_DIMS`]).
    pub head_dim: usize,
    /// The problem's head dim of Q and K: at most `head_dim`, a multiple of 8.
    pub dim: usize,
    /// The head dim of V, O and dO: at most `dim`, a multiple of 8 (`dim` where they agree).
    pub dim_v: usize,
    /// A window (or causal) mask.
    pub window: bool,
    /// Softcap.
    pub softcap: bool,
    /// A varlen batch: packed maps, a sequence's blocks from its first row, the rows of the
    /// next sequence zeroed where a query block crosses its end.
    pub varlen: bool,
    /// Tiles and registers.
    pub tiles: Tiles,
}

impl Spec {
    /// Threads per CTA.
    pub fn threads(&self) -> usize {
        self.tiles.threads()
    }

    /// Dynamic shared memory of a launch.
    pub fn smem_bytes(&self) -> usize {
        self.tiles.smem_bytes(self.head_dim)
    }

    /// The entry point.
    pub fn entry(&self) -> &'static str {
        "fa4_bwd_sm90"
    }

    /// The generated prelude: the tile constants, the role table and the named barriers, and
    /// the switches the shared layer reads (`LAZY_RESCALE` is the forward softmax's, unused).
    pub fn prelude(&self) -> String {
        let t = &self.tiles;
        let consumer_warps = WARPGROUP_THREADS / 32;
        Prelude::new("config::bwd_sm90", self)
            .int("HEAD_DIM", self.head_dim)
            .int("DIM", self.dim)
            .int("DIM_V", self.dim_v)
            .int("QK_DIM", self.dim.next_multiple_of(16))
            .int("PV_DIM", self.dim_v.next_multiple_of(16))
            .flag("SLAB_MAPS", self.slab_maps())
            .int("BLOCK_M", t.block_m)
            .int("BLOCK_N", block_n(self.head_dim))
            .int("CONSUMER_WGS", CONSUMER_WGS)
            .flag("SHARED_KEYS", shared_keys(self.head_dim))
            .int("STAGES", t.stages)
            .int("PRODUCER_REGS", t.producer_regs)
            .int("CONSUMER_REGS", t.consumer_regs)
            .flag("IS_BF16", self.bf16)
            .flag("HAS_WINDOW", self.window)
            .flag("HAS_SOFTCAP", self.softcap)
            .flag("VARLEN", self.varlen)
            .flag("DETERMINISTIC", t.deterministic)
            .flag("LAZY_RESCALE", false)
            .define("FA4_SMEM_BYTES", self.smem_bytes())
            .roles(&[
                RoleWarps {
                    name: "PRODUCER".into(),
                    first_warp: 0,
                    warps: consumer_warps,
                },
                RoleWarps {
                    name: "CONSUMER".into(),
                    first_warp: consumer_warps,
                    warps: consumer_warps * CONSUMER_WGS,
                },
            ])
            .int("FIRST_CONSUMER_WARP", consumer_warps)
            .named_barriers(&NAMED_BARRIERS)
            .finish()
    }

    /// The kernel's `wgmma` shapes: `wgmma_st` (Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ, N = a consumer's
    /// queries, both operands K-major in shared memory), `wgmma_dkv` (dV += Pᵀ·dO and dK +=
    /// dSᵀ·Q, N = a consumer's columns, A from registers, B MN-major), `wgmma_dkv_ss` (the same
    /// with A = Pᵀ / dSᵀ from shared memory, the shared-keys form's) and `wgmma_dq` (dQ = dS·K,
    /// N = the dQ column group, A = dSᵀ and B = K both MN-major in shared memory). Both `dkv`
    /// forms are emitted; the kernel calls the one of its form.
    pub fn wgmma_wrappers(&self) -> String {
        let sk = shared_keys(self.head_dim);
        let split = if sk { CONSUMER_WGS } else { 1 };
        let st = Wgmma {
            name: "wgmma_st",
            n: self.tiles.block_m / split,
            a: OperandA::Smem,
            bf16: self.bf16,
            e4m3: false,
            b_transposed: false,
        };
        let dkv = Wgmma {
            name: "wgmma_dkv",
            n: self.head_dim / split,
            a: OperandA::Regs,
            bf16: self.bf16,
            e4m3: false,
            b_transposed: true,
        };
        let dkv_ss = Wgmma {
            name: "wgmma_dkv_ss",
            a: OperandA::Smem,
            ..dkv
        };
        let dq = Wgmma {
            name: "wgmma_dq",
            n: self.dq_n(),
            a: OperandA::Smem,
            bf16: self.bf16,
            e4m3: false,
            b_transposed: true,
        };
        format!(
            "// generated by config::bwd_sm90: wgmma for N = {} (Sᵀ, dPᵀ), {} (dK, dV), {} (dQ)\n{}{}{}{}",
            st.n,
            dkv.n,
            dq.n,
            st.wrapper(),
            dkv.wrapper(),
            dkv_ss.wrapper(),
            transpose_a(&dq.wrapper())
        )
    }

    /// Keys per CTA ([`block_n`]).
    pub fn block_n(&self) -> usize {
        block_n(self.head_dim)
    }

    /// Whether Q, K, V or dO are narrower than the tile: then all four are loaded slab by slab
    /// through 4-D maps over their real columns (`tma::encode_slabs`) instead of one 5-D box.
    pub fn slab_maps(&self) -> bool {
        self.dim != self.head_dim || self.dim_v != self.head_dim
    }

    /// N of the dQ product: head_dim over the dQ tile's column groups.
    pub fn dq_n(&self) -> usize {
        self.head_dim / dq_col_groups(self.tiles.block_m, self.head_dim)
    }
}

/// A shared-memory-A wrapper with A read MN-major (`imm-trans-a` = 1): [`Wgmma`] generates
/// K-major A only, which every other kernel wants; dQ = dS·K reads dSᵀ as stored.
fn transpose_a(wrapper: &str) -> String {
    // The immediates after the predicate: scale-a, scale-b, trans-a, trans-b.
    const K_MAJOR_A: &str = ", p, 1, 1, 0, ";
    assert_eq!(
        wrapper.matches(K_MAJOR_A).count(),
        1,
        "a shared-memory wgmma wrapper names its immediates once"
    );
    wrapper.replacen(K_MAJOR_A, ", p, 1, 1, 1, ", 1)
}

impl fmt::Display for Spec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "bwd sm90 {} {} d{}{}{} {}x{} {}+{}x{} regs{}{}{}{}",
            self.target,
            if self.bf16 { "bf16" } else { "fp16" },
            self.dim,
            if self.dim_v != self.dim {
                format!("/{}", self.dim_v)
            } else {
                String::new()
            },
            if self.slab_maps() {
                format!(" (tiles d{})", self.head_dim)
            } else {
                String::new()
            },
            self.block_n(),
            self.tiles.block_m,
            self.tiles.producer_regs,
            CONSUMER_WGS,
            self.tiles.consumer_regs,
            if self.window { " window" } else { "" },
            if self.softcap { " softcap" } else { "" },
            if self.varlen { " varlen" } else { "" },
            if self.tiles.deterministic {
                " deterministic"
            } else {
                ""
            },
        )
    }
}

/// Why the Hopper backward does not cover a problem on `arch` (the argument to blame and the
/// reason), or `None`. What it refuses runs the Ampere-class backward.
pub fn uncovered(p: &Problem, arch: &GpuArch) -> Option<(&'static str, String)> {
    if arch.family != Family::Hopper {
        return Some(("device", format!("{} is not a Hopper GPU", arch.name)));
    }
    if p.dtype().size_bytes() != 2 {
        return Some(("dtype", "the Hopper backward computes fp16 and bf16".into()));
    }
    if padded_head_dim(p.head_dim()).is_none() {
        return Some((
            "q",
            format!(
                "head_dim {}: the Hopper backward covers multiples of 8 up to 256",
                p.head_dim()
            ),
        ));
    }
    let dv = p.head_dim_v();
    if dv == 0 || !dv.is_multiple_of(8) || dv > p.head_dim() {
        return Some((
            "v",
            format!(
                "head_dim_v {dv}: the Hopper backward covers multiples of 8 up to head_dim {}",
                p.head_dim()
            ),
        ));
    }
    // A TMA map may not have an empty dimension: a fixed-length batch's every sequence, a
    // packed one's total rows.
    let seqs = p.sequences();
    let empty = if p.is_varlen() {
        seqs.iter().all(|s| s.q_len == 0) || seqs.iter().all(|s| s.k_len == 0)
    } else {
        seqs.iter().any(|s| s.q_len == 0 || s.k_len == 0)
    };
    if empty {
        return Some(("q", "a batch without query rows or keys".into()));
    }
    None
}

/// A planned Hopper backward: the Ampere-class plan (its `pre` and `convert` launches and
/// workspaces; its main launch is replaced) and the Hopper main kernel with its grid.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The Ampere-class plan (non-deterministic: pre, main, convert): its workspaces.
    pub base: BwdPlan,
    /// Its `pre` launch (spec, grid), run before the main kernel.
    pub pre: (BwdSpec, (u32, u32, u32)),
    /// Its `convert` launch, run after.
    pub convert: (BwdSpec, (u32, u32, u32)),
    /// The main kernel.
    pub spec: Spec,
    /// Its tiles: key blocks × KV heads × batch entries.
    pub tiles: usize,
    /// Its grid: persistent CTAs, (min(tiles, SMs), 1, 1); each takes further tiles from a
    /// counter after the statistics in the D workspace.
    pub grid: (u32, u32, u32),
    /// Rows per (batch entry, head) of the padded row statistics the `pre` kernel writes for
    /// the main kernel (`BwdParams::stats_rows`, [`stats_layout`]): the query rows rounded up
    /// to whole query blocks, or a varlen batch's packed and padded rows. The D workspace
    /// (`base.dpsum_len`) holds D, then LSE·log2e, each `[entries][heads_q][stats_rows]`, so that
    /// a step's rows are one bulk copy each.
    pub stats_rows: usize,
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (pre, pre_grid) = &self.pre;
        let (conv, conv_grid) = &self.convert;
        let g = self.grid;
        writeln!(
            f,
            "{pre}: grid {}x{}x{}",
            pre_grid.0, pre_grid.1, pre_grid.2
        )?;
        writeln!(
            f,
            "{}: grid {}x{}x{}, {} threads, {} B smem",
            self.spec,
            g.0,
            g.1,
            g.2,
            self.spec.threads(),
            self.spec.smem_bytes()
        )?;
        write!(
            f,
            "{conv}: grid {}x{}x{}",
            conv_grid.0, conv_grid.1, conv_grid.2
        )
    }
}

/// The layout of the padded row statistics and dQ accumulator (`stats_base` in
/// `kernels/bwd/params.cuh`): (entries, rows per entry and head). A fixed-length batch has an
/// entry per sequence of its query rows rounded up to whole blocks of `block_m`; a varlen one
/// a single entry in which sequence b starts at row `block_m · ⌊(cu_q[b] + b · block_m) /
/// block_m⌋`, `stats_rows` that start for b = batch (each sequence its rows rounded up to whole
/// blocks, at most a block more per sequence than the packed rows).
pub fn stats_layout(p: &Problem, block_m: usize) -> (usize, usize) {
    let seqs = p.sequences();
    if p.is_varlen() {
        let total: usize = seqs.iter().map(|s| s.q_len).sum();
        (1, (total + seqs.len() * block_m) / block_m * block_m)
    } else {
        let max_q = seqs.iter().map(|s| s.q_len).max().unwrap_or(0);
        (seqs.len(), max_q.div_ceil(block_m) * block_m)
    }
}

/// Plans the Hopper backward of a validated problem, or says (an error naming the argument)
/// why it does not cover it. `target` is the device's NVRTC target (`sm_90`): the row kernels
/// compile for it, the main kernel for its architecture-specific form (`sm_90a`).
pub fn plan(
    p: &Problem,
    arch: &GpuArch,
    target: &'static str,
    deterministic: bool,
) -> Result<Plan> {
    if let Some((arg, why)) = uncovered(p, arch) {
        return Err(Error::invalid(arg, why));
    }
    let base = bwd::plan_rows_for_hopper(p, arch, target)?;
    let (pre, convert) = match &base.launches[..] {
        [pre, _, convert]
            if pre.0.kernel == BwdKernel::Pre && convert.0.kernel == BwdKernel::Convert =>
        {
            (*pre, *convert)
        }
        _ => {
            return Err(Error::invalid(
                "deterministic",
                "the Hopper backward needs the row kernels of the non-deterministic plan",
            ))
        }
    };
    let dim = p.head_dim();
    let head_dim = padded_head_dim(dim).expect("covered above");
    // The row kernels pad to the same width: the dQ accumulator's rows are `head_dim` wide
    // for all three kernels.
    if pre.0.head_dim != head_dim || convert.0.head_dim != head_dim {
        return Err(Error::invalid(
            "q",
            format!(
                "head_dim {dim}: the row kernels' width {} is not the Hopper tile's {head_dim}",
                pre.0.head_dim
            ),
        ));
    }
    let tiles = tiles(head_dim, deterministic);
    tiles.check(head_dim)?;
    let spec = Spec {
        target: if target == "sm_90" { "sm_90a" } else { target },
        bf16: pre.0.bf16,
        head_dim,
        dim,
        dim_v: p.head_dim_v(),
        window: p.mask().is_restrictive(),
        softcap: p.softcap().is_some(),
        varlen: p.is_varlen(),
        tiles,
    };
    let max_smem = arch.max_smem_per_block() as usize;
    if spec.smem_bytes() > max_smem {
        return Err(Error::invalid(
            "q",
            format!(
                "head_dim {head_dim}: the Hopper backward needs {} B of shared memory, {} has {max_smem}",
                spec.smem_bytes(),
                arch.name
            ),
        ));
    }
    let max_k = p.sequences().iter().map(|s| s.k_len).max().unwrap_or(0);
    // The kernel numbers the tiles in int32.
    let n_tiles = max_k
        .div_ceil(block_n(head_dim))
        .checked_mul(p.heads_kv())
        .and_then(|t| t.checked_mul(p.sequences().len()))
        .filter(|&t| t <= i32::MAX as usize)
        .ok_or_else(|| Error::invalid("q", "more than 2^31 key blocks × KV heads × sequences"))?;
    let grid = (n_tiles.min(arch.sm_count as usize) as u32, 1, 1);
    // The padded statistics (`stats_layout`): the pre kernel covers every padded row of the
    // longest sequence (past a sequence's end it writes D = 0 and LSE·log2e = +inf, so those
    // rows' P is 0).
    let (entries, stats_rows) = stats_layout(p, tiles.block_m);
    let max_q = p.sequences().iter().map(|s| s.q_len).max().unwrap_or(0);
    let padded_q = max_q.div_ceil(tiles.block_m) * tiles.block_m;
    let too_many = || Error::invalid("q", format!("{max_q} query rows exceed the CUDA grid"));
    let per_head = entries * stats_rows;
    let fits = per_head
        .checked_mul(p.heads_q())
        .and_then(|n| n.checked_mul(2 * head_dim))
        .is_some();
    if stats_rows > i32::MAX as usize || !fits {
        return Err(too_many());
    }
    let mut base = base;
    // D and LSE·log2e, then the main kernel's tile counter (4 floats: 16-byte alignment kept),
    // then the deterministic mode's semaphores, one per padded query block (`pre` zeroes them
    // whatever the mode).
    base.dpsum_len = 2 * per_head * p.heads_q() + 4 + per_head * p.heads_q() / tiles.block_m;
    // The accumulator in 64 × 64 tiles over the padded rows (the kernel's reduce-adds cover
    // whole tiles; `pre` zeroes and `convert` reads that layout when `stats_rows` > 0).
    base.accum_len = per_head * p.heads_q() * head_dim;
    let mut pre = pre;
    let rows_dim = |per: usize| {
        u32::try_from(padded_q.div_ceil(per))
            .ok()
            .filter(|_| padded_q <= i32::MAX as usize)
            .ok_or_else(too_many)
    };
    pre.1 .0 = rows_dim(bwd::aux_rows_per_cta(head_dim))?;
    // `convert` reads the tiles whole, half a 64-row group per CTA (a sequence's padded rows
    // are whole blocks of BLOCK_M, itself a multiple of 64).
    let mut convert = convert;
    convert.1 .0 = rows_dim(bwd::CONVERT_TILE_ROWS)?;
    Ok(Plan {
        base,
        pre,
        convert,
        spec,
        tiles: n_tiles,
        grid,
        stats_rows,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch;
    use crate::dtype::DType;
    use crate::problem::Options;
    use crate::tensor::Layout;

    fn problem(d: usize, opts: Options) -> Problem {
        let q = Layout::new("q", &[2, 300, 8, d], None).unwrap();
        let k = Layout::new("k", &[2, 333, 2, d], None).unwrap();
        Problem::new(DType::Bf16, &q, &k, &k, &q, None, None, &opts).unwrap()
    }

    #[test]
    fn planned_tiles_fit_the_h100_and_its_register_file() {
        for d in HEAD_DIMS {
            let p = plan(
                &problem(d, Options::new().causal()),
                &arch::H100,
                "sm_90",
                false,
            )
            .unwrap();
            let s = &p.spec;
            s.tiles.check(d).unwrap();
            assert!(s.smem_bytes() <= 232_448, "{s}: {} B", s.smem_bytes());
            assert!(s.tiles.registers() <= 65_536, "{s}");
            assert_eq!(s.target, "sm_90a");
            assert!(s.window && !s.softcap);
            // 333 keys in blocks of 128 (64 at d256), 2 KV heads, 2 sequences: 12 tiles (24),
            // fewer than SMs.
            let tiles = if d == 256 { 24 } else { 12 };
            assert_eq!((p.tiles, p.grid), (tiles, (tiles as u32, 1, 1)));
            assert_eq!(s.block_n(), if d == 256 { 64 } else { 128 });
            assert_eq!(s.dq_n() % 64, 0);
            let prelude = s.prelude();
            assert!(prelude.contains(&format!("#define FA4_SMEM_BYTES {}", s.smem_bytes())));
            assert!(prelude.contains("ROLE_CONSUMER"));
            // The row kernels are the Ampere-class ones, for the device's own target.
            assert_eq!(p.pre.0.kernel, BwdKernel::Pre);
            assert_eq!(p.convert.0.kernel, BwdKernel::Convert);
            assert_eq!(p.pre.0.target, "sm_90");
            // The accumulator in whole 64 × 64 tiles over the padded rows.
            assert_eq!(p.base.accum_len, 2 * 8 * p.stats_rows * d);
            assert_eq!(p.base.accum_len % (DQ_TILE_BYTES / 4), 0);
            // The padded statistics: 300 rows in whole query blocks, D and LSE·log2e for each
            // of 2 sequences × 8 heads, and the pre kernel's grid over every padded row.
            let m = s.tiles.block_m;
            assert_eq!(p.stats_rows, 300usize.div_ceil(m) * m);
            assert!(p.stats_rows >= 300 && p.stats_rows < 300 + m);
            // D, LSE·log2e, the tile counter and a semaphore per query block.
            assert_eq!(
                p.base.dpsum_len,
                2 * 2 * 8 * p.stats_rows + 4 + 2 * 8 * p.stats_rows / m
            );
            // pre: 128 threads, d / 8 lanes per row (d64: 16 rows per CTA, d128: 8);
            // convert: 32 rows per CTA, whatever the head dim.
            assert_eq!(p.pre.1, ((p.stats_rows * d / 8 / 128) as u32, 8, 2));
            assert_eq!(p.convert.1, ((p.stats_rows / 32) as u32, 8, 2));
        }
        // More tiles than SMs: one persistent CTA per SM of the part (16 sequences of 1024
        // keys, 4 KV heads: 8 × 4 × 16 tiles), the counter after the statistics.
        let q = Layout::new("q", &[16, 1024, 8, 128], None).unwrap();
        let k = Layout::new("k", &[16, 1024, 4, 128], None).unwrap();
        let big = Problem::new(DType::Bf16, &q, &k, &k, &q, None, None, &Options::new()).unwrap();
        let p = plan(&big, &arch::H100, "sm_90", false).unwrap();
        assert_eq!((p.tiles, p.grid), (512, (arch::H100.sm_count, 1, 1)));
        assert_eq!(p.base.dpsum_len, 2 * 16 * 8 * 1024 + 4 + 16 * 8 * 1024 / 64);
        // The shared-memory sums, by hand: K, V + 2 × (Q, dO) + 2 × dSᵀ + 2 × dQ tiles
        // + 2 × LSE, D + 10 barriers + two work slots + slack (d64: 128 queries per step).
        assert_eq!(
            tiles(64, false).smem_bytes(64),
            2 * 16384 + 4 * 16384 + 2 * 32768 + 2 * 16384 + 2 * 1024 + 80 + 256 + 1024
        );
        // d128: three Q/dO stages, 160 bytes under the H100's and H200's 232,448.
        assert_eq!(
            tiles(128, false).smem_bytes(128),
            2 * 32768 + 6 * 16384 + 2 * 16384 + 2 * 16384 + 3 * 512 + 96 + 256 + 1024
        );
        assert_eq!(tiles(128, false).smem_bytes(128), 232_448 - 160);
        // d256, shared keys (64 keys, 64 queries): K, V + 2 × (Q, dO) + 2 × dSᵀ + 2 × Pᵀ,
        // no dQ tiles; 688 bytes under.
        assert_eq!(
            tiles(256, false).smem_bytes(256),
            2 * 32768 + 4 * 32768 + 4 * 8192 + 2 * 512 + 80 + 256 + 1024
        );
        assert_eq!(tiles(256, false).smem_bytes(256), 232_448 - 688);
    }

    #[test]
    fn head_dims_below_a_tile_width_run_in_it_through_slab_maps() {
        assert_eq!(padded_head_dim(8), Some(64));
        assert_eq!(padded_head_dim(64), Some(64));
        assert_eq!(padded_head_dim(72), Some(128));
        assert_eq!(padded_head_dim(128), Some(128));
        assert_eq!(padded_head_dim(136), Some(256));
        assert_eq!(padded_head_dim(256), Some(256));
        assert_eq!(padded_head_dim(264), None);
        assert_eq!(padded_head_dim(20), None);
        assert_eq!(padded_head_dim(0), None);
        for (d, tile, qk) in [
            (8, 64, 16),
            (40, 64, 48),
            (80, 128, 80),
            (96, 128, 96),
            (120, 128, 128),
            (136, 256, 144),
            (192, 256, 192),
        ] {
            let p = plan(&problem(d, Options::new()), &arch::H100, "sm_90", false).unwrap();
            let s = &p.spec;
            assert_eq!((s.head_dim, s.dim, s.slab_maps()), (tile, d, true), "d{d}");
            assert_eq!(s.tiles, tiles(tile, false), "d{d}");
            // The accumulator's rows are the tile's width, as the row kernels' (padded alike).
            assert_eq!(p.pre.0.head_dim, tile);
            assert_eq!(p.base.accum_len, 2 * 8 * p.stats_rows * tile);
            let prelude = s.prelude();
            assert!(
                prelude.contains(&format!("constexpr int DIM = {d};")),
                "{prelude}"
            );
            assert!(
                prelude.contains(&format!("constexpr int QK_DIM = {qk};")),
                "{prelude}"
            );
            assert!(
                prelude.contains("constexpr bool SLAB_MAPS = true;"),
                "{prelude}"
            );
            assert!(
                s.to_string().contains(&format!("d{d} (tiles d{tile})")),
                "{s}"
            );
        }
        let s = plan(&problem(128, Options::new()), &arch::H100, "sm_90", false)
            .unwrap()
            .spec;
        assert!(!s.slab_maps() && s.prelude().contains("constexpr bool SLAB_MAPS = false;"));
    }

    /// V (and O, dO) narrower than Q and K: their own real columns (`DIM_V`, dPᵀ over `PV_DIM`),
    /// slab maps wherever either is narrower than the tile; the row kernels of the
    /// non-deterministic plan take it while the Ampere-class plan refuses it, naming `v`.
    #[test]
    fn a_narrower_v_plans_its_own_columns_and_a_wider_one_is_refused() {
        let with_v = |d: usize, dv: usize| {
            let q = Layout::new("q", &[2, 300, 8, d], None).unwrap();
            let k = Layout::new("k", &[2, 333, 2, d], None).unwrap();
            let v = Layout::new("v", &[2, 333, 2, dv], None).unwrap();
            let o = Layout::new("out", &[2, 300, 8, dv], None).unwrap();
            Problem::new(DType::Bf16, &q, &k, &v, &o, None, None, &Options::new()).unwrap()
        };
        for (d, dv, tile, pv) in [
            (192, 128, 256, 128),
            (256, 128, 256, 128),
            (128, 72, 128, 80),
            (64, 8, 64, 16),
        ] {
            for det in [false, true] {
                let p = plan(&with_v(d, dv), &arch::H100, "sm_90", det).unwrap();
                let s = &p.spec;
                assert_eq!(
                    (s.head_dim, s.dim, s.dim_v, s.slab_maps()),
                    (tile, d, dv, true)
                );
                let prelude = s.prelude();
                for want in [
                    format!("constexpr int DIM_V = {dv};"),
                    format!("constexpr int PV_DIM = {pv};"),
                    "constexpr bool SLAB_MAPS = true;".to_string(),
                ] {
                    assert!(prelude.contains(&want), "{want}: {prelude}");
                }
                assert!(
                    s.to_string()
                        .contains(&format!("d{d}/{dv} (tiles d{tile})")),
                    "{s}"
                );
                assert_eq!(p.pre.0.head_dim, tile);
            }
            assert_eq!(
                bwd::plan(&with_v(d, dv), &arch::H100, "sm_90", false, None)
                    .unwrap_err()
                    .to_string()
                    .split(':')
                    .next(),
                Some("invalid argument `v`")
            );
        }
        for (d, dv) in [(128, 256), (64, 12), (192, 200)] {
            assert_eq!(
                uncovered(&with_v(d, dv), &arch::H100).unwrap().0,
                "v",
                "d{d}/{dv}"
            );
        }
    }

    #[test]
    fn the_dq_wrapper_reads_both_operands_mn_major() {
        let p = plan(&problem(128, Options::new()), &arch::H100, "sm_90", false).unwrap();
        let w = p.spec.wgmma_wrappers();
        assert!(w.contains("void wgmma_st(float (&d)[32], u64 desc_a"));
        assert!(w.contains("void wgmma_dkv(float (&d)[64], u32 a0"));
        assert!(w.contains("void wgmma_dq(float (&d)[32], u64 desc_a"));
        assert_eq!(w.matches("p, 1, 1, 1, 1;").count(), 1, "{w}");
        assert_eq!(w.matches("p, 1, 1, 0, 0;").count(), 1, "{w}");
        // The shared-keys form: each consumer half the queries of Sᵀ and half the columns of dK
        // and dV, with A from shared memory (K-major, B MN-major); dQ in 64-column parts.
        let p = plan(&problem(256, Options::new()), &arch::H100, "sm_90", false).unwrap();
        let w = p.spec.wgmma_wrappers();
        assert!(w.contains("void wgmma_st(float (&d)[16], u64 desc_a"));
        assert!(w.contains("void wgmma_dkv_ss(float (&d)[64], u64 desc_a"));
        assert!(w.contains("void wgmma_dq(float (&d)[32], u64 desc_a"));
        assert_eq!(w.matches("p, 1, 1, 0, 1;").count(), 1, "{w}");
        assert!(p
            .spec
            .prelude()
            .contains("constexpr bool SHARED_KEYS = true;"));
    }

    #[test]
    fn uncovered_problems_name_the_argument_and_others_plan() {
        let causal = problem(128, Options::new().causal());
        assert_eq!(uncovered(&causal, &arch::H100), None);
        assert_eq!(uncovered(&causal, &arch::A100).unwrap().0, "device");
        assert_eq!(uncovered(&problem(256, Options::new()), &arch::H100), None);
        assert_eq!(uncovered(&problem(136, Options::new()), &arch::H100), None);
        for d in [264, 100] {
            assert_eq!(
                uncovered(&problem(d, Options::new()), &arch::H100)
                    .unwrap()
                    .0,
                "q",
                "d{d}"
            );
        }
        let ql = Layout::new("q", &[40, 2, 64], None).unwrap();
        let varlen = Problem::new(
            DType::F16,
            &ql,
            &ql,
            &ql,
            &ql,
            Some(&[0, 10, 40][..]),
            Some(&[0, 10, 40][..]),
            &Options::new(),
        )
        .unwrap();
        assert_eq!(uncovered(&varlen, &arch::H100), None);
        assert!(
            plan(&varlen, &arch::H100, "sm_90", false)
                .unwrap()
                .spec
                .varlen
        );
        let soft = problem(64, Options::new().softcap(5.0));
        let p = plan(&soft, &arch::H100, "sm_90", false).unwrap();
        assert!(p.spec.softcap && !p.spec.window);
        assert!(p.to_string().contains("fa4_bwd_sm90") || p.to_string().contains("bwd sm90"));
    }

    /// A varlen batch: one entry of the packed rows, each sequence padded to whole query blocks
    /// from `block_m · ⌊(cu_q[b] + b · block_m) / block_m⌋`; a zero-length sequence is fine, a
    /// batch without any query row or key is not (a TMA map may not be empty).
    #[test]
    fn varlen_batches_pad_each_sequence_in_one_packed_entry() {
        let varlen = |cq: &[i32], ck: &[i32], d: usize| {
            let ql = Layout::new("q", &[*cq.last().unwrap() as usize, 8, d], None).unwrap();
            let kl = Layout::new("k", &[*ck.last().unwrap() as usize, 2, d], None).unwrap();
            let opts = Options::new().causal();
            Problem::new(DType::Bf16, &ql, &kl, &kl, &ql, Some(cq), Some(ck), &opts).unwrap()
        };
        // d64: blocks of 128 rows. Starts ⌊(0, 300 + 128, 300 + 256, 813 + 384) / 128⌋ · 128 =
        // 0, 384, 512, 1152: room for 3, 0 and 3 blocks (300, 0 and 513 rows).
        let p = varlen(&[0, 300, 300, 813], &[0, 317, 330, 1030], 64);
        let m = tiles(64, false).block_m;
        assert_eq!(m, 128);
        assert_eq!(stats_layout(&p, m), (1, 1152));
        let starts: Vec<usize> = [0usize, 300, 300, 813]
            .iter()
            .enumerate()
            .map(|(b, &c)| (c + b * m) / m * m)
            .collect();
        assert_eq!(starts, [0, 384, 512, 1152]);
        for (b, s) in p.sequences().iter().enumerate() {
            assert!(starts[b + 1] - starts[b] >= s.q_len.div_ceil(m) * m, "{b}");
        }
        let plan = plan(&p, &arch::H100, "sm_90", false).unwrap();
        assert!(
            plan.spec.varlen
                && plan
                    .spec
                    .prelude()
                    .contains("constexpr bool VARLEN = true;")
        );
        assert!(plan.spec.to_string().ends_with(" varlen"), "{}", plan.spec);
        assert_eq!(plan.stats_rows, 1152);
        assert_eq!(plan.base.dpsum_len, 2 * 8 * 1152 + 4 + 8 * 1152 / 128);
        assert_eq!(plan.base.accum_len, 8 * 1152 * 64);
        // The row kernels' grids: the longest sequence's padded rows (513 → 640) × heads × 3.
        assert_eq!(plan.pre.1, ((640 * 64 / 8 / 128) as u32, 8, 3));
        assert_eq!(plan.convert.1, ((640 / 32) as u32, 8, 3));
        // Tiles: ⌈700 / 128⌉ key blocks of the longest sequence × 2 KV heads × 3 sequences.
        assert_eq!(plan.tiles, 6 * 2 * 3);
        // Fixed-length: no flag.
        let fixed = super::plan(&problem(64, Options::new()), &arch::H100, "sm_90", false).unwrap();
        assert!(
            !fixed.spec.varlen
                && fixed
                    .spec
                    .prelude()
                    .contains("constexpr bool VARLEN = false;")
        );
        // No query row (or no key) anywhere: refused, naming q.
        let none = varlen(&[0, 0, 0], &[0, 5, 9], 64);
        assert_eq!(uncovered(&none, &arch::H100).unwrap().0, "q");
    }

    /// The deterministic mode plans the Hopper kernel: to head dim 128 with the dQ writer warp
    /// (40 registers for the producer warpgroup, 232 per consumer, a `DqInfo` of shared
    /// memory), in the shared-keys form with the consumers' own waits (the registers and
    /// shared memory of the other mode).
    #[test]
    fn the_deterministic_mode_plans_the_hopper_kernel() {
        for d in [40, 64, 96, 128, 192, 256] {
            let p = problem(d, Options::new().causal());
            let det = plan(&p, &arch::H100, "sm_90", true).unwrap();
            let fast = plan(&p, &arch::H100, "sm_90", false).unwrap();
            let t = det.spec.tiles;
            assert!(t.deterministic && !fast.spec.tiles.deterministic, "d{d}");
            t.check(det.spec.head_dim).unwrap();
            let writer = !shared_keys(det.spec.head_dim);
            assert_eq!(
                (t.producer_regs, t.consumer_regs),
                if writer { (40, 232) } else { (24, 240) },
                "d{d}"
            );
            assert_eq!(
                det.spec.smem_bytes(),
                fast.spec.smem_bytes() + if writer { DQ_INFO_BYTES } else { 0 },
                "d{d}"
            );
            assert!(det.spec.smem_bytes() <= 232_448, "d{d}");
            assert!(det
                .spec
                .prelude()
                .contains("constexpr bool DETERMINISTIC = true;"));
            assert!(
                det.spec.to_string().ends_with(" deterministic"),
                "{}",
                det.spec
            );
            // The same row kernels and workspaces (the semaphores are in both).
            assert_eq!(
                (det.base.dpsum_len, det.base.accum_len),
                (fast.base.dpsum_len, fast.base.accum_len)
            );
            assert_eq!(
                (det.pre, det.convert, det.grid),
                (fast.pre, fast.convert, fast.grid)
            );
        }
    }

    #[test]
    fn bad_tiles_are_refused() {
        // 192 query rows are not whole 64-row groups of the two consumers' dQ; 128 are.
        let t = Tiles {
            block_m: 192,
            ..tiles(128, false)
        };
        assert!(t.check(128).is_err());
        let t = Tiles {
            block_m: 128,
            ..tiles(64, false)
        };
        t.check(64).unwrap();
        assert_eq!(dq_col_groups(64, 64), 1);
        assert_eq!(dq_col_groups(64, 128), 2);
        assert_eq!(dq_col_groups(128, 128), 1);
        let t = Tiles {
            producer_regs: 56,
            consumer_regs: 256,
            ..tiles(64, false)
        };
        assert!(t.check(64).is_err(), "over the register file");
        tiles(64, false).check(64).unwrap();
    }
}
