//! `FA4Config`: the FlashAttention-4 forward plan for SM100 (B200-class) GPUs.
//!
//! A faithful implementation of the `FA4Config` struct of Modular MAX (its API document is the
//! project's seed; every formula is restated in this module's item docs): tile sizes, the tensor-memory (TMEM) map, the
//! shared-memory budget and the pipeline depth of one kernel. Every valid input yields a config;
//! configs the kernel cannot run report [`FA4Config::supported`] `== false`, and
//! [`FA4Config::unsupported_reasons`] names each failed condition with its numbers.
//!
//! One deliberate difference from upstream: in the split-M layout (`depth > 128`) the second
//! tile's TMEM addresses are `X + (16 << 16)` (lane 16, same column). Upstream wrote
//! `X + 16 << 16`, which parses as `(X + 16) << 16`; see the field docs.
//!
//! All arithmetic is done in 64-bit integers from 32-bit inputs, so no input overflows.

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

use crate::arch;
use crate::error::{Error, Result};

/// TMA swizzle mode of the shared-memory tiles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Swizzle {
    /// No swizzle; [`Swizzle::bytes`] is 16 (one 16-byte atom), not 0.
    None,
    /// 32-byte swizzle.
    B32,
    /// 64-byte swizzle.
    B64,
    /// 128-byte swizzle, the default and the only mode the FA4 kernel path uses.
    #[default]
    B128,
}

impl Swizzle {
    /// Every mode, in the order of the upstream enum values.
    pub const ALL: [Swizzle; 4] = [Swizzle::None, Swizzle::B32, Swizzle::B64, Swizzle::B128];

    /// Bytes of one swizzle row: `16 · 2^v` for the enum value `v` (none = 16).
    pub const fn bytes(self) -> u32 {
        match self {
            Swizzle::None => 16,
            Swizzle::B32 => 32,
            Swizzle::B64 => 64,
            Swizzle::B128 => 128,
        }
    }

    /// The name in the machine-readable form: `"none"`, `"32B"`, `"64B"`, `"128B"`.
    pub const fn name(self) -> &'static str {
        match self {
            Swizzle::None => "none",
            Swizzle::B32 => "32B",
            Swizzle::B64 => "64B",
            Swizzle::B128 => "128B",
        }
    }
}

impl fmt::Display for Swizzle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Swizzle {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        Swizzle::ALL
            .into_iter()
            .find(|m| m.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| {
                Error::invalid(
                    "swizzle",
                    format!("expected one of none, 32B, 64B, 128B; got `{s}`"),
                )
            })
    }
}

impl Serialize for Swizzle {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

/// A tensor-memory address: `(lane << 16) | column`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TmemAddr {
    lane: u16,
    column: u16,
}

impl TmemAddr {
    /// Lane 0, column 0.
    pub const ZERO: TmemAddr = TmemAddr { lane: 0, column: 0 };

    /// An address from its parts.
    pub const fn new(lane: u16, column: u16) -> Self {
        TmemAddr { lane, column }
    }

    /// The lane (row of the 128-lane tensor memory).
    pub const fn lane(self) -> u16 {
        self.lane
    }

    /// The 32-bit column.
    pub const fn column(self) -> u16 {
        self.column
    }

    /// The 32-bit value the hardware and the seed use: `(lane << 16) | column`.
    pub const fn raw(self) -> u32 {
        ((self.lane as u32) << 16) | self.column as u32
    }

    /// The same column, `lanes` lanes further down.
    pub const fn add_lanes(self, lanes: u16) -> Self {
        TmemAddr::new(self.lane + lanes, self.column)
    }

    /// The same lane, `cols` columns further right.
    pub const fn add_columns(self, cols: u16) -> Self {
        TmemAddr::new(self.lane, self.column + cols)
    }
}

impl fmt::Display for TmemAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "lane {} col {}", self.lane, self.column)
    }
}

/// The constructor's inputs (the seed's keyword arguments).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FA4Inputs {
    /// Query heads `H`, at least 1.
    pub num_q_heads: u32,
    /// Query heads per KV head `g` (the GQA ratio), at least 1 and dividing `num_q_heads`.
    pub group: u32,
    /// Head dimension `d`, at least 1.
    pub depth: u32,
    /// Bytes per Q/K/V element: 1 (fp8), 2 (bf16, fp16) or 4 (f32).
    pub dtype_size: u32,
    /// TMA swizzle of the shared-memory tiles.
    pub swizzle_mode: Swizzle,
}

/// One condition of [`FA4Config::supported`] that a config fails, with its numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unsupported {
    /// `depth < 64`.
    DepthTooSmall {
        /// The head dimension.
        depth: u64,
    },
    /// `BN < 64`.
    BlockNTooSmall {
        /// The planned key-block size.
        bn: u64,
    },
    /// Fewer than two K/V shared-memory slots fit.
    TooFewKvStages {
        /// Slots that fit.
        stages: u64,
        /// Bytes of one slot (a K or V tile and its two barriers).
        per_stage: u64,
        /// Bytes left for the ring after the fixed part.
        available: u64,
    },
    /// More TMEM columns than the SM has.
    TmemOverflow {
        /// Columns used.
        used: u64,
    },
    /// More shared memory than one block may have.
    SmemOverflow {
        /// Bytes used.
        used: u64,
    },
}

impl fmt::Display for Unsupported {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Unsupported::DepthTooSmall { depth } => write!(
                f,
                "depth {depth} < {}: the kernel needs at least {} columns per head",
                FA4Config::MIN_DEPTH,
                FA4Config::MIN_DEPTH
            ),
            Unsupported::BlockNTooSmall { bn } => write!(
                f,
                "BN {bn} < {}: TMEM leaves too few columns for the score tile",
                FA4Config::MIN_BN
            ),
            Unsupported::TooFewKvStages {
                stages,
                per_stage,
                available,
            } => write!(
                f,
                "{stages} K/V stage(s) < {}: {available} bytes left after Q and barriers hold \
                 {stages} slot(s) of {per_stage} bytes",
                FA4Config::MIN_KV_STAGES
            ),
            Unsupported::TmemOverflow { used } => write!(
                f,
                "TMEM use {used} columns > {} available",
                FA4Config::SM100_TMEM_COLS
            ),
            Unsupported::SmemOverflow { used } => write!(
                f,
                "shared memory {used} bytes > carveout {}",
                FA4Config::SM100_SMEM_CARVEOUT
            ),
        }
    }
}

/// One region of the TMEM map, for reports and overlap checks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TmemRegion {
    /// `S0`, `P0`, `C0`, `O0`, … (the digit is the Q/O tile).
    pub name: &'static str,
    /// Which Q/O tile (0 or 1) the region belongs to.
    pub tile: u32,
    /// Where it starts.
    pub start: TmemAddr,
    /// Columns covered, from `start.column()`.
    pub columns: u64,
    /// Accumulator rows held (`MMA_M`). With M = 128 row r is lane r; with M = 64 (split-M) the
    /// rows sit in 16 lanes of each 32-lane sub-partition, which is why the second tile can
    /// start at lane 16 of the same columns.
    pub rows: u64,
    /// What the region holds.
    pub what: &'static str,
}

impl TmemRegion {
    /// Columns `[first, end)`.
    pub fn column_range(&self) -> std::ops::Range<u64> {
        let c = u64::from(self.start.column());
        c..c + self.columns
    }
}

/// The shared-memory budget, item by item; the items add up to [`FA4Config::smem_used`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct SmemBudget {
    /// The u32 slot holding the TMEM base address.
    pub tmem_addr_slot: u64,
    /// The 11 miscellaneous mbarriers (S, C, order, Q1).
    pub misc_barriers: u64,
    /// The 4 mbarriers of the O pipeline.
    pub o_barriers: u64,
    /// Q0 and Q1 tiles, `BM · pd · s`.
    pub q_tiles: u64,
    /// The K/V ring's tiles, `num_kv_stages · BN · pd · s`.
    pub kv_tiles: u64,
    /// The K/V ring's producer and consumer barriers.
    pub kv_barriers: u64,
    /// The sum of the above.
    pub total: u64,
    /// What one block may use.
    pub carveout: u64,
}

/// The FlashAttention-4 forward plan for one SM100 kernel.
///
/// Fields are read through methods named after the seed's fields in snake case
/// ([`FA4Config::bm`] is the seed's `BM`, [`FA4Config::tmem_o1`] its `TMEM_O1`); the JSON form
/// ([`FA4Config::to_json`]) uses the seed's names exactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FA4Config {
    mma_m: u64,
    bm: u64,
    bn: u64,
    bk0: u64,
    bk1: u64,
    depth: u64,
    padded_depth: u64,
    group: u64,
    num_q_heads: u64,
    num_kv_heads: u64,
    tmem_s1: TmemAddr,
    tmem_o0: TmemAddr,
    tmem_o1: TmemAddr,
    tmem_p0: TmemAddr,
    tmem_p1: TmemAddr,
    tmem_c0: TmemAddr,
    tmem_c1: TmemAddr,
    tmem_used: u64,
    num_kv_stages: u64,
    num_mma_stages: u64,
    smem_used: u64,
    dtype_size: u64,
    split_m: bool,
    swizzle_mode: Swizzle,
}

fn align_up(x: i64, a: i64) -> i64 {
    x.div_euclid(a) * a + if x.rem_euclid(a) == 0 { 0 } else { a }
}

fn align_down(x: i64, a: i64) -> i64 {
    x.div_euclid(a) * a
}

/// A column that fits the 16-bit column field of a TMEM address (every column the planner
/// places is below 2 · 256 + 128).
fn col(x: i64) -> u16 {
    u16::try_from(x).expect("TMEM columns of a plan are below 1024 by construction")
}

impl FA4Config {
    /// K step of one tcgen05 MMA for 16-bit types, in elements.
    pub const MMA_K: u64 = 16;
    /// Threads per CTA: softmax ×2, correction, other (MMA + TMA warps), 128 each.
    pub const NUM_THREADS: u64 = 512;
    /// Shared memory one B200 block can use: per-SM shared memory less the per-block reservation.
    pub const SM100_SMEM_CARVEOUT: u64 = arch::B200.max_smem_per_block() as u64;
    /// TMEM columns per SM (128 lanes × 512 columns of 32-bit cells).
    pub const SM100_TMEM_COLS: u64 = match arch::B200.tmem_cols {
        Some(c) => c as u64,
        None => panic!("the B200 description must have TMEM"),
    };
    /// Bytes of one mbarrier (an int64).
    pub const MBAR_SIZE: u64 = std::mem::size_of::<u64>() as u64;
    /// One fp32 correction factor per row.
    pub const NUM_CORRECTION_COLS: u64 = 1;
    /// S0 sits at the origin of tensor memory.
    pub const TMEM_S0: TmemAddr = TmemAddr::ZERO;

    /// S0/S1 producer+consumer (4), C0/C1 producer+consumer (4), softmax order (2), Q1 (1).
    pub const NUM_MISC_MBARS: u64 = 11;
    /// O pipeline: two producers, two consumers.
    pub const NUM_O_MBARS: u64 = 4;
    /// The u32 holding the TMEM base address.
    pub const TMEM_ADDR_SLOT_BYTES: u64 = 4;
    /// The lane offset of the second tile in the split-M layout: `16 << 16` as an address.
    pub const SPLIT_M_LANE_OFFSET: u16 = 16;
    /// `supported()` needs `depth ≥ MIN_DEPTH`.
    pub const MIN_DEPTH: u64 = 64;
    /// `supported()` needs `BN ≥ MIN_BN`.
    pub const MIN_BN: u64 = 64;
    /// `supported()` needs at least this many K/V slots.
    pub const MIN_KV_STAGES: u64 = 2;
    /// BN never exceeds this (the N limit of one tcgen05 MMA).
    pub const MAX_BN: i64 = 256;

    /// Plans a kernel. Fails only on inputs outside the contract's valid ranges; a valid input
    /// the kernel cannot run still yields a config whose [`FA4Config::supported`] is false.
    pub fn new(inputs: FA4Inputs) -> Result<Self> {
        let FA4Inputs {
            num_q_heads,
            group,
            depth,
            dtype_size,
            swizzle_mode,
        } = inputs;
        if num_q_heads == 0 {
            return Err(Error::invalid("num_q_heads", "must be at least 1, got 0"));
        }
        if group == 0 {
            return Err(Error::invalid("group", "must be at least 1, got 0"));
        }
        if num_q_heads % group != 0 {
            return Err(Error::invalid(
                "group",
                format!("{group} does not divide num_q_heads {num_q_heads}"),
            ));
        }
        if depth == 0 {
            return Err(Error::invalid("depth", "must be at least 1, got 0"));
        }
        if !matches!(dtype_size, 1 | 2 | 4) {
            return Err(Error::invalid(
                "dtype_size",
                format!("must be 1 (fp8), 2 (bf16, fp16) or 4 (f32) bytes, got {dtype_size}"),
            ));
        }

        let s = i64::from(dtype_size);
        let d = i64::from(depth);
        let elems_per_swizzle_row = i64::from(swizzle_mode.bytes()) / s;
        let pd = align_up(d, elems_per_swizzle_row);
        let split_m = depth > 128;
        let (bm, mma_m): (i64, i64) = if split_m { (128, 64) } else { (256, 128) };
        let mma_k = Self::MMA_K as i64;
        let tmem_cols = Self::SM100_TMEM_COLS as i64;
        let block_n = |budget: i64| {
            let bn = Self::MAX_BN.min(align_down(budget, mma_k));
            if bn < mma_k {
                0
            } else {
                bn
            }
        };

        let s0 = Self::TMEM_S0;
        let (bn, s1, p0, p1, c0, c1, o0, o1, tmem_used);
        if split_m {
            // One column range; the second tile's M = 64 MMAs use lanes 16.. of it.
            bn = block_n(tmem_cols - pd);
            p0 = TmemAddr::ZERO;
            o0 = TmemAddr::new(0, col(bn));
            c0 = p0.add_columns(col(bn / 2));
            s1 = s0.add_lanes(Self::SPLIT_M_LANE_OFFSET);
            p1 = p0.add_lanes(Self::SPLIT_M_LANE_OFFSET);
            o1 = o0.add_lanes(Self::SPLIT_M_LANE_OFFSET);
            c1 = c0.add_lanes(Self::SPLIT_M_LANE_OFFSET);
            tmem_used = bn + pd;
        } else {
            // Two S/P regions then two O regions, side by side: 2·BN + 2·pd ≤ 512.
            bn = block_n(tmem_cols / 2 - pd);
            s1 = TmemAddr::new(0, col(bn));
            p0 = TmemAddr::ZERO;
            p1 = s1;
            // P is 16-bit, packed two per column: it covers BN/2 columns and C follows it.
            c0 = p0.add_columns(col(bn / 2));
            c1 = p1.add_columns(col(bn / 2));
            o0 = TmemAddr::new(0, col(2 * bn));
            o1 = TmemAddr::new(0, col(2 * bn + pd));
            tmem_used = 2 * bn + 2 * pd;
        }

        let num_mma_stages: i64 = 1;
        let mbar = Self::MBAR_SIZE as i64;
        let bk0 = pd / num_mma_stages;
        let bk1 = bn / num_mma_stages;
        let fixed = (Self::TMEM_ADDR_SLOT_BYTES as i64)
            + (Self::NUM_MISC_MBARS + Self::NUM_O_MBARS) as i64 * mbar
            + bm * pd * s;
        let per_kv = bn * pd * s + 2 * mbar * num_mma_stages;
        let carveout = Self::SM100_SMEM_CARVEOUT as i64;
        let num_kv_stages = (carveout - fixed).max(0) / per_kv;
        let smem_used = fixed + num_kv_stages * per_kv;

        let u = |x: i64| u64::try_from(x).expect("plan quantities are non-negative");
        Ok(FA4Config {
            mma_m: u(mma_m),
            bm: u(bm),
            bn: u(bn),
            bk0: u(bk0),
            bk1: u(bk1),
            depth: u(d),
            padded_depth: u(pd),
            group: u64::from(group),
            num_q_heads: u64::from(num_q_heads),
            num_kv_heads: u64::from(num_q_heads / group),
            tmem_s1: s1,
            tmem_o0: o0,
            tmem_o1: o1,
            tmem_p0: p0,
            tmem_p1: p1,
            tmem_c0: c0,
            tmem_c1: c1,
            tmem_used: u(tmem_used),
            num_kv_stages: u(num_kv_stages),
            num_mma_stages: u(num_mma_stages),
            smem_used: u(smem_used),
            dtype_size: u64::from(dtype_size),
            split_m,
            swizzle_mode,
        })
    }

    /// M of one MMA: 128, or 64 in the split-M layout.
    pub fn mma_m(&self) -> u64 {
        self.mma_m
    }
    /// Query rows per CTA (two Q tiles): 256, or 128 in the split-M layout.
    pub fn bm(&self) -> u64 {
        self.bm
    }
    /// Keys per KV block (N of the Q·Kᵀ MMA); 0 when TMEM leaves fewer than 16 columns.
    pub fn bn(&self) -> u64 {
        self.bn
    }
    /// K of the Q·Kᵀ MMA per stage: `padded_depth / num_mma_stages`.
    pub fn bk0(&self) -> u64 {
        self.bk0
    }
    /// K of the P·V MMA per stage: `BN / num_mma_stages`.
    pub fn bk1(&self) -> u64 {
        self.bk1
    }
    /// Head dimension `d`.
    pub fn depth(&self) -> u64 {
        self.depth
    }
    /// `d` rounded up to whole swizzle rows (`swizzle bytes / dtype_size` elements).
    pub fn padded_depth(&self) -> u64 {
        self.padded_depth
    }
    /// Query heads per KV head.
    pub fn group(&self) -> u64 {
        self.group
    }
    /// Query heads.
    pub fn num_q_heads(&self) -> u64 {
        self.num_q_heads
    }
    /// KV heads, `num_q_heads / group`.
    pub fn num_kv_heads(&self) -> u64 {
        self.num_kv_heads
    }
    /// Second score tile. Split-M: `TMEM_S0 + (16 << 16)`, lane 16 of the same columns.
    pub fn tmem_s1(&self) -> TmemAddr {
        self.tmem_s1
    }
    /// First output accumulator.
    pub fn tmem_o0(&self) -> TmemAddr {
        self.tmem_o0
    }
    /// Second output accumulator. Split-M: `TMEM_O0 + (16 << 16)`; upstream's
    /// `TMEM_O0 + 16 << 16` parsed as `(TMEM_O0 + 16) << 16` and was wrong.
    pub fn tmem_o1(&self) -> TmemAddr {
        self.tmem_o1
    }
    /// First P tile (16-bit probabilities written in place over S0).
    pub fn tmem_p0(&self) -> TmemAddr {
        self.tmem_p0
    }
    /// Second P tile. Split-M: `TMEM_P0 + (16 << 16)`.
    pub fn tmem_p1(&self) -> TmemAddr {
        self.tmem_p1
    }
    /// First correction-factor column, right after P0's `BN/2` columns.
    pub fn tmem_c0(&self) -> TmemAddr {
        self.tmem_c0
    }
    /// Second correction-factor column. Split-M: `TMEM_C0 + (16 << 16)`; upstream's
    /// `TMEM_C0 + 16 << 16` parsed as `(TMEM_C0 + 16) << 16` and was wrong.
    pub fn tmem_c1(&self) -> TmemAddr {
        self.tmem_c1
    }
    /// TMEM columns used (lane offsets use no extra columns).
    pub fn tmem_used(&self) -> u64 {
        self.tmem_used
    }
    /// Shared-memory slots of the K/V ring; K and V tiles alternate through it, one per slot.
    pub fn num_kv_stages(&self) -> u64 {
        self.num_kv_stages
    }
    /// MMA stages per K/V tile (1).
    pub fn num_mma_stages(&self) -> u64 {
        self.num_mma_stages
    }
    /// Shared memory used, bytes; [`FA4Config::smem_budget`] breaks it down.
    pub fn smem_used(&self) -> u64 {
        self.smem_used
    }
    /// Bytes per Q/K/V element.
    pub fn dtype_size(&self) -> u64 {
        self.dtype_size
    }
    /// `depth > 128`: two M = 64 tiles share one column range at lanes 0 and 16.
    pub fn split_m(&self) -> bool {
        self.split_m
    }
    /// TMA swizzle of the shared-memory tiles.
    pub fn swizzle_mode(&self) -> Swizzle {
        self.swizzle_mode
    }

    /// Q/O tile pairs per CTA.
    pub fn num_qo(&self) -> u64 {
        2
    }

    /// Whether the kernel can run this config.
    pub fn supported(&self) -> bool {
        self.unsupported_reasons().is_empty()
    }

    /// Each condition of [`FA4Config::supported`] that fails, with its numbers; empty when
    /// supported.
    pub fn unsupported_reasons(&self) -> Vec<Unsupported> {
        let mut why = Vec::new();
        if self.depth < Self::MIN_DEPTH {
            why.push(Unsupported::DepthTooSmall { depth: self.depth });
        }
        if self.bn < Self::MIN_BN {
            why.push(Unsupported::BlockNTooSmall { bn: self.bn });
        }
        if self.num_kv_stages < Self::MIN_KV_STAGES {
            let b = self.smem_budget();
            why.push(Unsupported::TooFewKvStages {
                stages: self.num_kv_stages,
                per_stage: self.kv_stage_bytes(),
                available: Self::SM100_SMEM_CARVEOUT
                    .saturating_sub(b.total - b.kv_tiles - b.kv_barriers),
            });
        }
        if self.tmem_used > Self::SM100_TMEM_COLS {
            why.push(Unsupported::TmemOverflow {
                used: self.tmem_used,
            });
        }
        if self.smem_used > Self::SM100_SMEM_CARVEOUT {
            why.push(Unsupported::SmemOverflow {
                used: self.smem_used,
            });
        }
        why
    }

    /// Whether the correction factors live in TMEM (true for every config of this version).
    pub fn use_tmem_for_correction(&self) -> bool {
        Self::TMEM_S0 == self.tmem_p0
            || u64::from(self.tmem_o1.column()) + self.depth + Self::NUM_CORRECTION_COLS
                <= Self::SM100_TMEM_COLS
    }

    /// Shared-memory elements for correction factors when they do not live in TMEM.
    pub fn correction_smem_elements(&self) -> u64 {
        if self.use_tmem_for_correction() {
            0
        } else {
            self.bm * Self::NUM_CORRECTION_COLS
        }
    }

    /// Active warps per warpgroup.
    pub fn num_active_warps_per_group(&self) -> u64 {
        4
    }

    /// Active threads per warpgroup: 32 per warp.
    pub fn num_active_threads_per_group(&self) -> u64 {
        32 * self.num_active_warps_per_group()
    }

    /// Bytes of one K/V ring slot: one K or V tile and its producer and consumer barriers.
    pub fn kv_stage_bytes(&self) -> u64 {
        self.bn * self.padded_depth * self.dtype_size + 2 * Self::MBAR_SIZE * self.num_mma_stages
    }

    /// The shared-memory budget, item by item.
    pub fn smem_budget(&self) -> SmemBudget {
        let tmem_addr_slot = Self::TMEM_ADDR_SLOT_BYTES;
        let misc_barriers = Self::NUM_MISC_MBARS * Self::MBAR_SIZE;
        let o_barriers = Self::NUM_O_MBARS * Self::MBAR_SIZE;
        let q_tiles = self.bm * self.padded_depth * self.dtype_size;
        let kv_tiles = self.num_kv_stages * self.bn * self.padded_depth * self.dtype_size;
        let kv_barriers = self.num_kv_stages * 2 * Self::MBAR_SIZE * self.num_mma_stages;
        SmemBudget {
            tmem_addr_slot,
            misc_barriers,
            o_barriers,
            q_tiles,
            kv_tiles,
            kv_barriers,
            total: tmem_addr_slot + misc_barriers + o_barriers + q_tiles + kv_tiles + kv_barriers,
            carveout: Self::SM100_SMEM_CARVEOUT,
        }
    }

    /// The TMEM map: for each Q/O tile its S, P, C and O regions. P lies over the first half of
    /// S (written in place), C in the column after P.
    pub fn tmem_regions(&self) -> Vec<TmemRegion> {
        let rows = self.mma_m;
        let tiles = [
            (0, Self::TMEM_S0, self.tmem_p0, self.tmem_c0, self.tmem_o0),
            (1, self.tmem_s1, self.tmem_p1, self.tmem_c1, self.tmem_o1),
        ];
        let mut out = Vec::with_capacity(8);
        for (tile, s, p, c, o) in tiles {
            let names: [&'static str; 4] = if tile == 0 {
                ["S0", "P0", "C0", "O0"]
            } else {
                ["S1", "P1", "C1", "O1"]
            };
            out.push(TmemRegion {
                name: names[0],
                tile,
                start: s,
                columns: self.bn,
                rows,
                what: "scores Q·Kᵀ, fp32",
            });
            out.push(TmemRegion {
                name: names[1],
                tile,
                start: p,
                columns: self.bn / 2,
                rows,
                what: "probabilities, 16-bit packed two per column, in place over S",
            });
            out.push(TmemRegion {
                name: names[2],
                tile,
                start: c,
                columns: Self::NUM_CORRECTION_COLS,
                rows,
                what: "row correction factor, fp32",
            });
            out.push(TmemRegion {
                name: names[3],
                tile,
                start: o,
                columns: self.padded_depth,
                rows,
                what: "output accumulator P·V, fp32",
            });
        }
        out
    }

    /// The machine-readable form: the seed's 24 fields, its constants and its six methods'
    /// results, under the seed's names, in that order (then `unsupported_reasons`).
    pub fn to_json(&self) -> String {
        serde_json::to_string(&Record::from(self)).expect("a plain struct serializes")
    }
}

/// The JSON record; field names are the seed's.
#[derive(Serialize)]
#[allow(non_snake_case)]
struct Record {
    MMA_M: u64,
    BM: u64,
    BN: u64,
    BK0: u64,
    BK1: u64,
    depth: u64,
    padded_depth: u64,
    group: u64,
    num_q_heads: u64,
    num_kv_heads: u64,
    TMEM_S1: u32,
    TMEM_O0: u32,
    TMEM_O1: u32,
    TMEM_P0: u32,
    TMEM_P1: u32,
    TMEM_C0: u32,
    TMEM_C1: u32,
    tmem_used: u64,
    num_kv_stages: u64,
    num_mma_stages: u64,
    smem_used: u64,
    dtype_size: u64,
    split_m: bool,
    swizzle_mode: Swizzle,
    TMEM_S0: u32,
    MMA_K: u64,
    num_threads: u64,
    sm100_smem_carveout: u64,
    sm100_tmem_cols: u64,
    mbar_size: u64,
    num_correction_cols: u64,
    num_qo: u64,
    supported: bool,
    use_tmem_for_correction: bool,
    correction_smem_elements: u64,
    num_active_warps_per_group: u64,
    num_active_threads_per_group: u64,
    unsupported_reasons: Vec<String>,
}

impl From<&FA4Config> for Record {
    fn from(c: &FA4Config) -> Self {
        Record {
            MMA_M: c.mma_m,
            BM: c.bm,
            BN: c.bn,
            BK0: c.bk0,
            BK1: c.bk1,
            depth: c.depth,
            padded_depth: c.padded_depth,
            group: c.group,
            num_q_heads: c.num_q_heads,
            num_kv_heads: c.num_kv_heads,
            TMEM_S1: c.tmem_s1.raw(),
            TMEM_O0: c.tmem_o0.raw(),
            TMEM_O1: c.tmem_o1.raw(),
            TMEM_P0: c.tmem_p0.raw(),
            TMEM_P1: c.tmem_p1.raw(),
            TMEM_C0: c.tmem_c0.raw(),
            TMEM_C1: c.tmem_c1.raw(),
            tmem_used: c.tmem_used,
            num_kv_stages: c.num_kv_stages,
            num_mma_stages: c.num_mma_stages,
            smem_used: c.smem_used,
            dtype_size: c.dtype_size,
            split_m: c.split_m,
            swizzle_mode: c.swizzle_mode,
            TMEM_S0: FA4Config::TMEM_S0.raw(),
            MMA_K: FA4Config::MMA_K,
            num_threads: FA4Config::NUM_THREADS,
            sm100_smem_carveout: FA4Config::SM100_SMEM_CARVEOUT,
            sm100_tmem_cols: FA4Config::SM100_TMEM_COLS,
            mbar_size: FA4Config::MBAR_SIZE,
            num_correction_cols: FA4Config::NUM_CORRECTION_COLS,
            num_qo: c.num_qo(),
            supported: c.supported(),
            use_tmem_for_correction: c.use_tmem_for_correction(),
            correction_smem_elements: c.correction_smem_elements(),
            num_active_warps_per_group: c.num_active_warps_per_group(),
            num_active_threads_per_group: c.num_active_threads_per_group(),
            unsupported_reasons: c
                .unsupported_reasons()
                .iter()
                .map(|r| r.to_string())
                .collect(),
        }
    }
}

/// The readable report printed by `fa4 plan`.
impl fmt::Display for FA4Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "FA4Config (SM100 / {}): {} query heads, group {} ({} KV heads), depth {}, {} B/element, swizzle {}",
            arch::B200.name,
            self.num_q_heads,
            self.group,
            self.num_kv_heads,
            self.depth,
            self.dtype_size,
            self.swizzle_mode
        )?;
        writeln!(f)?;
        writeln!(f, "tiles")?;
        writeln!(
            f,
            "  BM {:>4}  query rows per CTA ({} tiles of MMA_M {}{})",
            self.bm,
            self.num_qo(),
            self.mma_m,
            if self.split_m { ", split-M" } else { "" }
        )?;
        writeln!(f, "  BN {:>4}  keys per KV block", self.bn)?;
        writeln!(
            f,
            "  BK0 {:>3}  BK1 {}  (K of Q·Kᵀ and of P·V per MMA stage, {} stage)",
            self.bk0, self.bk1, self.num_mma_stages
        )?;
        writeln!(
            f,
            "  depth {} padded to {} ({} elements per {}-byte swizzle row)",
            self.depth,
            self.padded_depth,
            u64::from(self.swizzle_mode.bytes()) / self.dtype_size,
            self.swizzle_mode.bytes()
        )?;
        writeln!(
            f,
            "  threads {} = 4 warpgroups: softmax ×2, correction, MMA + TMA",
            Self::NUM_THREADS
        )?;
        writeln!(f)?;
        writeln!(
            f,
            "tensor memory ({} of {} columns{})",
            self.tmem_used,
            Self::SM100_TMEM_COLS,
            if self.split_m {
                "; tile 1 at lane offset 16 of tile 0's columns"
            } else {
                ""
            }
        )?;
        writeln!(
            f,
            "  {:<4} {:>10} {:>5} {:>5} {:>12} {:>8}  holds",
            "", "raw", "lane", "rows", "columns", "width"
        )?;
        for r in self.tmem_regions() {
            let cols = r.column_range();
            writeln!(
                f,
                "  {:<4} {:>10} {:>5} {:>5} {:>12} {:>8}  {}",
                r.name,
                r.start.raw(),
                r.start.lane(),
                r.rows,
                format!("[{}, {})", cols.start, cols.end),
                r.columns,
                r.what
            )?;
        }
        writeln!(f)?;
        let b = self.smem_budget();
        writeln!(f, "shared memory (bytes)")?;
        let kv_tile = self.bn * self.padded_depth * self.dtype_size;
        let rows: [(String, u64); 6] = [
            ("TMEM address slot".into(), b.tmem_addr_slot),
            (
                format!(
                    "misc barriers ({} × {})",
                    Self::NUM_MISC_MBARS,
                    Self::MBAR_SIZE
                ),
                b.misc_barriers,
            ),
            (
                format!(
                    "O-pipeline barriers ({} × {})",
                    Self::NUM_O_MBARS,
                    Self::MBAR_SIZE
                ),
                b.o_barriers,
            ),
            (
                format!(
                    "Q0 + Q1 ({} × {} × {})",
                    self.bm, self.padded_depth, self.dtype_size
                ),
                b.q_tiles,
            ),
            (
                format!("K/V ring tiles ({} × {})", self.num_kv_stages, kv_tile),
                b.kv_tiles,
            ),
            (
                format!(
                    "K/V ring barriers ({} × 2 × {})",
                    self.num_kv_stages,
                    Self::MBAR_SIZE
                ),
                b.kv_barriers,
            ),
        ];
        for (what, bytes) in rows {
            writeln!(f, "  {what:<40} {bytes:>8}")?;
        }
        writeln!(f, "  {:<40} {:>8}", "total (smem_used)", b.total)?;
        writeln!(
            f,
            "  {:<40} {:>8}  ({} free)",
            "carveout",
            b.carveout,
            b.carveout as i64 - b.total as i64
        )?;
        writeln!(f)?;
        let why = self.unsupported_reasons();
        if why.is_empty() {
            write!(f, "supported: yes")
        } else {
            writeln!(f, "supported: no")?;
            for (i, w) in why.iter().enumerate() {
                if i > 0 {
                    writeln!(f)?;
                }
                write!(f, "  - {w}")?;
            }
            Ok(())
        }
    }
}
