//! The planner of the Hopper kernel (sm_90a): the sibling of [`super::sm100::FA4Config`] for
//! H100/H200.
//!
//! The kernel it plans is warp-specialised. One CTA holds a producer warpgroup, which issues TMA
//! bulk-tensor loads of Q and of a ring of K/V stages into shared memory (each stage guarded by a
//! "full" mbarrier that the copies complete and an "empty" one the consumers release), and
//! `consumer_wgs` consumer warpgroups of 64 query rows each (the M of `wgmma`), which compute
//! S = Q·Kᵀ and O += P·V with `wgmma` (P from registers) and the online softmax in registers.
//! `setmaxnreg` moves registers from the producer, which needs few, to the consumers.
//!
//! Everything the kernel's shape depends on is decided here and checked against [`GpuArch`]:
//! the tiles, the ring depth, the warpgroup roles and their register budgets, and the shared-
//! memory budget. [`Sm90Plan`] explains itself through `Display` (`fa4 plan --arch sm90`), and
//! [`dispatch`] says which kernel a problem gets on an sm_90 GPU and why.

use std::fmt;

use serde::Serialize;

use crate::arch::{Family, GpuArch};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::problem::Problem;

/// Head dims the Hopper kernel is compiled for (exactly: other head dims go to the sm80 kernel).
pub const HEAD_DIMS: [usize; 3] = [64, 128, 256];
/// Threads in a warpgroup (the unit of `wgmma` and `setmaxnreg`).
pub const WARPGROUP_THREADS: usize = 128;
/// Query rows per consumer warpgroup: the M of `wgmma.mma_async.m64nNk16`.
pub const ROWS_PER_CONSUMER: usize = 64;
/// Elements per 128-byte swizzle atom row (16-bit): TMA boxes and `wgmma` descriptors move the
/// head dim in slabs of this width.
pub const SWIZZLE_ELEMS: usize = 64;
/// Alignment of every shared-memory tile: the 128-byte swizzle pattern repeats every 1024 bytes.
pub const TILE_ALIGN: usize = 1024;
/// `setmaxnreg` bounds: a multiple of 8 in 24..=256.
pub const MIN_REGS: u32 = 24;
/// See [`MIN_REGS`].
pub const MAX_REGS: u32 = 256;
/// Registers per consumer thread the kernel needs beyond its S and O accumulators (addresses,
/// row statistics, loop state, packed P in flight): a planning margin, confirmed by ptxas
/// reporting no spills for every planned variant (`tests/nvrtc_compile.rs`).
pub const CONSUMER_REG_MARGIN: u32 = 32;
/// Problems of at most this many query blocks per sequence get the persistent launch when the
/// planner picks the tiles: with few key blocks per tile, hiding each tile's start (Q and first
/// K/V loads) and end behind its neighbour's pays; on long sequences the hardware's own dynamic
/// order of one CTA per tile balances causal work better. Measured on an H200 (docs/perf.md):
/// persistent +7–16% at 1k tokens, ±2% at 4k, −1–3% at 16k.
pub const PERSISTENT_MAX_M_BLOCKS: usize = 32;

/// Most tiles a launch may have: the kernel numbers them in int32, with room for a grid's worth
/// past the last.
pub const MAX_TILES: u128 = i32::MAX as u128 / 2;

/// The tile shape and warpgroup roles of one launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct Tiles {
    /// Keys per inner step: the N of the Q·Kᵀ `wgmma` and the K of the P·V one (multiple of 16).
    pub block_n: usize,
    /// Consumer warpgroups, 64 query rows each: `block_m = 64 · consumer_wgs`.
    pub consumer_wgs: usize,
    /// K/V stages in the shared-memory ring (≥ 2).
    pub stages: usize,
    /// `setmaxnreg` target of the producer warpgroup.
    pub producer_regs: u32,
    /// `setmaxnreg` target of each consumer warpgroup.
    pub consumer_regs: u32,
    /// Conditional rescaling (FlashAttention-4): rescale O only when a row max grew by more
    /// than 2^8 (exact: numerator and denominator share the stale max).
    pub lazy_rescale: bool,
    /// Issue block j + 1's Q·Kᵀ with block j's P·V and run its softmax while P·V is in flight.
    pub intra_wg_overlap: bool,
    /// The consumer warpgroups take turns issuing their wgmma groups (named barriers), so one's
    /// softmax overlaps the other's matrix products. Needs two consumer warpgroups.
    pub pingpong: bool,
    /// Persistent launch: one CTA per SM walks a list of tiles (pairs of a head's last and
    /// first query block, then second last and second, …: equal causal cost per pair), loading
    /// the next tile's Q and K/V while it finishes the last. Off: one CTA per tile, the last
    /// query block first. The kernel is the same; only the grid differs.
    pub persistent: bool,
    /// Exponentials on the FMA units (FlashAttention-4): this many of every 8 are computed by a
    /// polynomial instead of MUFU.EX2 (0..=8).
    pub poly_exp2: usize,
}

/// The command-line spelling of a Hopper tile override (`fa4 bench --sm90-tiles`):
/// `block_n,consumer_wgs,stages,producer_regs,consumer_regs,lazy,overlap,pingpong,persistent,poly`
/// (flags 0|1; `poly` is [`Tiles::poly_exp2`], 0..=8).
impl std::str::FromStr for Tiles {
    type Err = Error;

    fn from_str(s: &str) -> Result<Tiles> {
        const WHAT: &str = "sm90 tiles";
        let [block_n, consumer_wgs, stages, producer_regs, consumer_regs, lazy, overlap, pingpong, persistent, poly_exp2] =
            super::override_fields(s, WHAT)?;
        let regs = |x: usize| {
            u32::try_from(x)
                .map_err(|_| Error::invalid(WHAT, format!("expected ten integers, got `{s}`")))
        };
        let flag = |x: usize, name: &str| super::override_flag(x, name, WHAT);
        Ok(Tiles {
            block_n,
            consumer_wgs,
            stages,
            producer_regs: regs(producer_regs)?,
            consumer_regs: regs(consumer_regs)?,
            lazy_rescale: flag(lazy, "lazy")?,
            intra_wg_overlap: flag(overlap, "overlap")?,
            pingpong: flag(pingpong, "pingpong")?,
            persistent: flag(persistent, "persistent")?,
            poly_exp2,
        })
    }
}

/// The shared-memory budget of a launch, in bytes, tile by tile.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct SmemBudget {
    /// Q, [`Tiles::q_stages`] × (block_m, head_dim).
    pub q: usize,
    /// K ring, stages × (block_n, head_dim).
    pub k: usize,
    /// V ring, stages × (block_n, head_dim).
    pub v: usize,
    /// mbarriers: Q full and empty, and per stage K full, V full, K empty, V empty and V tail
    /// (varlen) (8 bytes each).
    pub barriers: usize,
    /// Slack to align the dynamic shared-memory base to [`TILE_ALIGN`].
    pub align_slack: usize,
}

impl SmemBudget {
    /// Everything the launch asks for.
    pub fn total(&self) -> usize {
        self.q + self.k + self.v + self.barriers + self.align_slack
    }
}

impl Tiles {
    /// Query rows per CTA.
    pub fn block_m(&self) -> usize {
        ROWS_PER_CONSUMER * self.consumer_wgs
    }

    /// Threads per CTA: the producer warpgroup and the consumers.
    pub fn threads(&self) -> usize {
        WARPGROUP_THREADS * (1 + self.consumer_wgs)
    }

    /// Shared memory, tile by tile, for a padded head dim of 16-bit elements.
    pub fn smem(&self, head_dim: usize) -> SmemBudget {
        self.smem_with(head_dim, self.q_stages(head_dim))
    }

    fn smem_with(&self, head_dim: usize, q_stages: usize) -> SmemBudget {
        let tile = |rows: usize| (rows * head_dim * 2).next_multiple_of(TILE_ALIGN);
        SmemBudget {
            q: q_stages * tile(self.block_m()),
            k: self.stages * tile(self.block_n),
            v: self.stages * tile(self.block_n),
            barriers: 8 * (2 * q_stages + 5 * self.stages),
            align_slack: TILE_ALIGN,
        }
    }

    /// Q slots: two where they fit in a Hopper block's shared memory (a persistent CTA then loads
    /// its next tile's Q during the current one), else one.
    pub fn q_stages(&self, head_dim: usize) -> usize {
        let limit = crate::arch::H100.max_smem_per_block() as usize;
        if self.smem_with(head_dim, 2).total() <= limit {
            2
        } else {
            1
        }
    }

    /// Registers per thread a CTA is launched with: the kernel's launch bounds (one CTA of
    /// [`Tiles::threads`] per SM) let ptxas give each thread the SM's file divided by the
    /// threads, in steps of 8, at most 248 (255 is the per-thread limit); `setmaxnreg` then moves
    /// them between warpgroups.
    pub fn launch_regs(&self, arch: &GpuArch) -> u32 {
        (arch.registers_per_sm / self.threads() as u32).min(255) / 8 * 8
    }

    /// Operand registers per consumer thread: the f32 accumulators S (64 × block_n) and O
    /// (64 × head_dim) and the packed 16-bit P (64 × block_n), spread over 128 threads. With the
    /// intra-warpgroup overlap all three are live at once.
    pub fn accumulator_regs(&self, head_dim: usize) -> u32 {
        let f32s = ROWS_PER_CONSUMER * (self.block_n + head_dim) / WARPGROUP_THREADS;
        let p = ROWS_PER_CONSUMER * self.block_n / (2 * WARPGROUP_THREADS);
        (f32s + p) as u32
    }

    /// Checks the tiles against the kernel's rules and the GPU's limits, naming each violation.
    pub fn check(&self, head_dim: usize, arch: &GpuArch) -> Result<()> {
        let bad = |why: String| {
            Err(Error::invalid(
                "tiles",
                format!("{self:?} for head_dim {head_dim}: {why}"),
            ))
        };
        if arch.family != Family::Hopper {
            return bad(format!(
                "{} is not a Hopper GPU (wgmma and setmaxnreg are sm_90a)",
                arch.name
            ));
        }
        if !HEAD_DIMS.contains(&head_dim) {
            return bad(format!("head_dim must be one of {HEAD_DIMS:?}"));
        }
        if !(1..=3).contains(&self.consumer_wgs) {
            return bad("consumer_wgs must be 1 to 3".into());
        }
        // N of the Q·Kᵀ wgmma (≤ 256, a multiple of 8) and K of the P·V one (a multiple of 16);
        // TMA boxes hold at most 256 rows.
        if self.block_n == 0 || !self.block_n.is_multiple_of(16) || self.block_n > 256 {
            return bad("block_n must be a multiple of 16 in 16..=256".into());
        }
        if !(2..=8).contains(&self.stages) {
            return bad("stages must be 2 to 8".into());
        }
        if self.pingpong && self.consumer_wgs != 2 {
            return bad("ping-pong alternates exactly two consumer warpgroups".into());
        }
        if self.intra_wg_overlap && self.consumer_wgs > 2 {
            return bad(
                "the intra-warpgroup overlap keeps the next block's S live beside P and O: three consumer warpgroups (160 registers each) spill with it"
                    .into(),
            );
        }
        if self.poly_exp2 > 8 {
            return bad(format!(
                "poly_exp2 {} must be 0..=8 (exponentials of every 8 on the FMA units)",
                self.poly_exp2
            ));
        }
        let threads = self.threads();
        if threads > arch.max_threads_per_sm as usize {
            return bad(format!(
                "{threads} threads exceed {}'s {} per SM",
                arch.name, arch.max_threads_per_sm
            ));
        }
        for (what, r) in [
            ("producer_regs", self.producer_regs),
            ("consumer_regs", self.consumer_regs),
        ] {
            if !(MIN_REGS..=MAX_REGS).contains(&r) || !r.is_multiple_of(8) {
                return bad(format!(
                    "{what} {r} must be a multiple of 8 in {MIN_REGS}..={MAX_REGS}"
                ));
            }
        }
        if self.producer_regs > self.consumer_regs {
            return bad(format!(
                "producer_regs {} must not exceed consumer_regs {} (the producer gives registers away)",
                self.producer_regs, self.consumer_regs
            ));
        }
        // setmaxnreg only moves registers between the warps of a CTA: what the consumers gain
        // the producer must give up, out of what the CTA was launched with (otherwise
        // setmaxnreg.inc waits forever).
        let total = WARPGROUP_THREADS as u32
            * (self.producer_regs + self.consumer_wgs as u32 * self.consumer_regs);
        let launched = threads as u32 * self.launch_regs(arch);
        if total > launched {
            return bad(format!(
                "{total} registers (128 × ({} + {} × {})) exceed the {launched} the CTA is launched with ({threads} threads × {})",
                self.producer_regs, self.consumer_wgs, self.consumer_regs, self.launch_regs(arch)
            ));
        }
        let need = self.accumulator_regs(head_dim) + CONSUMER_REG_MARGIN;
        if need > self.consumer_regs {
            return bad(format!(
                "consumers need about {need} registers (S and O accumulators {} + margin {CONSUMER_REG_MARGIN}), budget {}",
                self.accumulator_regs(head_dim),
                self.consumer_regs
            ));
        }
        let smem = self.smem(head_dim).total();
        if smem > arch.max_smem_per_block() as usize {
            return bad(format!(
                "{smem} bytes of shared memory exceed {}'s {} per block",
                arch.name,
                arch.max_smem_per_block()
            ));
        }
        Ok(())
    }
}

const fn t(
    block_n: usize,
    consumer_wgs: usize,
    stages: usize,
    producer_regs: u32,
    consumer_regs: u32,
    intra_wg_overlap: bool,
) -> Tiles {
    Tiles {
        block_n,
        consumer_wgs,
        stages,
        producer_regs,
        consumer_regs,
        lazy_rescale: false,
        intra_wg_overlap,
        pingpong: false,
        persistent: false,
        poly_exp2: 0,
    }
}

/// Tile candidates per head dim, first that fits wins; [`plan`] then turns on the persistent
/// launch for short sequences ([`PERSISTENT_MAX_M_BLOCKS`]). A CTA of 384 threads (two consumer
/// warpgroups, 128 query rows) is launched with 168 registers per thread (64,512); the consumers
/// take 232 each and leave the producer 40 (its tile loop spills at 24). At d64 three consumers
/// (192 rows, 512 threads launched with 128) take 160 each and leave the producer 32, as
/// FlashAttention-3 does. The key-block widths
/// follow the register budget (S, O and packed P plus the margin) and shared memory (d256: Q and
/// two stages of 80-key K and V fill 224 of the 227 KiB). Measured on an H200 (bf16, 16k tokens;
/// `docs/perf.md`): 128-key blocks beat 64 (d64 483 vs 369, d128 629 vs 576 TFLOP/s), 80 beat 64
/// at d256 (+2 to +10% on every shape of the grid), and 176 beat 128 at d128 from 4k keys on
/// (+2 to +6%) but not at 1k (−2%, causal −13%: a 1k sequence is 5.8 blocks of 176, and the
/// diagonal blocks waste more); two stages beat three; the intra-warpgroup overlap gains 2–7% at
/// d128 and d256 and loses at d64; ping-pong is within ±3%, conditional rescaling and the
/// polynomial exponentials lose 2–5% at d128/d256 and 8–28% at d64 (the softmax is off the
/// critical path once it overlaps), so those are off.
///
/// Each candidate is taken only for at least its `min_keys` keys per sequence.
const CANDIDATES: [(usize, &[(Tiles, usize)]); 3] = [
    (
        64,
        &[
            (t(128, 3, 2, 32, 160, false), 0),
            (t(128, 2, 2, 40, 232, false), 0),
        ],
    ),
    (
        128,
        &[
            (t(176, 2, 2, 40, 232, true), 4096),
            (t(128, 2, 2, 40, 232, true), 0),
        ],
    ),
    (256, &[(t(80, 2, 2, 40, 232, true), 0)]),
];

/// Tiles for one padded head dim on one GPU: the first candidate that fits, or `None`.
pub fn tiles(arch: &GpuArch, head_dim: usize) -> Option<Tiles> {
    fitting(arch, head_dim).next()
}

/// The fitting candidates of a head dim, in order, with their `min_keys`.
fn fitting_with_min_keys(
    arch: &GpuArch,
    head_dim: usize,
) -> impl Iterator<Item = (Tiles, usize)> + '_ {
    CANDIDATES
        .iter()
        .filter(move |(d, _)| *d == head_dim)
        .flat_map(|(_, c)| c.iter().copied())
        .filter(move |(t, _)| t.check(head_dim, arch).is_ok())
}

fn fitting(arch: &GpuArch, head_dim: usize) -> impl Iterator<Item = Tiles> + '_ {
    fitting_with_min_keys(arch, head_dim).map(|(t, _)| t)
}

/// Tiles for a problem with `seqlen_q` query rows and `seqlen_k` keys per sequence (the longest,
/// in a varlen batch): among the fitting candidates taken for `seqlen_k` keys, the first whose
/// padding (rows computed past the end of the last query block) is within 5% of the sequence of
/// the least padding any of them has, with the persistent launch for at most
/// [`PERSISTENT_MAX_M_BLOCKS`] query blocks. At d64 this keeps 192-row tiles for 4k and 16k
/// tokens but takes 128 rows at 1k, where a 192-row tile would be a third full: measured on an
/// H200 (docs/perf.md), 1k causal 273 against 233 TFLOP/s. At d128, 176-key blocks from 4k keys.
pub fn tiles_for(
    arch: &GpuArch,
    head_dim: usize,
    seqlen_q: usize,
    seqlen_k: usize,
) -> Option<Tiles> {
    let taken = || {
        fitting_with_min_keys(arch, head_dim)
            .filter(|&(_, min_keys)| seqlen_k >= min_keys)
            .map(|(t, _)| t)
    };
    let pad = |t: &Tiles| seqlen_q.div_ceil(t.block_m()) * t.block_m() - seqlen_q;
    let least = taken().map(|t| pad(&t)).min()?;
    let mut t = taken().find(|t| pad(t) <= least + seqlen_q / 20)?;
    t.persistent = seqlen_q.div_ceil(t.block_m()) <= PERSISTENT_MAX_M_BLOCKS;
    Some(t)
}

/// What the Hopper kernel is specialised on: the compile-cache key (with the source hash and the
/// NVRTC version); the prelude and the generated `wgmma` wrappers are pure functions of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KernelSpec {
    /// NVRTC target: `sm_90a` (wgmma and setmaxnreg need the `a` target).
    pub target: &'static str,
    /// bf16 (true) or fp16 (false) storage.
    pub bf16: bool,
    /// Head dim (one of [`HEAD_DIMS`]).
    pub head_dim: usize,
    /// Causal or local window: row key bounds apply.
    pub window: bool,
    /// Softcap applied to the scores.
    pub softcap: bool,
    /// Packed variable-length batch (`cu_seqlens`): TMA maps over the whole packed tensors, and
    /// the V rows of the next sequence in a block zeroed before P·V.
    pub varlen: bool,
    /// The tiles.
    pub tiles: Tiles,
}

impl KernelSpec {
    /// Threads per CTA.
    pub fn threads(&self) -> usize {
        self.tiles.threads()
    }

    /// Dynamic shared memory of a launch.
    pub fn smem_bytes(&self) -> usize {
        self.tiles.smem(self.head_dim).total()
    }

    /// The kernel's entry point.
    pub fn entry(&self) -> &'static str {
        "fa4_fwd_sm90"
    }

    /// The constants the kernel source is compiled with.
    pub fn prelude(&self) -> String {
        let t = &self.tiles;
        format!(
            "// generated by config::sm90 for {self}\n\
             constexpr int HEAD_DIM = {};\n\
             constexpr int BLOCK_N = {};\n\
             constexpr int CONSUMER_WGS = {};\n\
             constexpr int STAGES = {};\n\
             constexpr int Q_STAGES = {};\n\
             constexpr int PRODUCER_REGS = {};\n\
             constexpr int CONSUMER_REGS = {};\n\
             constexpr bool LAZY_RESCALE = {};\n\
             constexpr bool INTRA_WG_OVERLAP = {};\n\
             constexpr bool PINGPONG = {};\n\
             constexpr int POLY_EXP2 = {};\n\
             constexpr bool IS_BF16 = {};\n\
             constexpr bool HAS_WINDOW = {};\n\
             constexpr bool HAS_SOFTCAP = {};\n\
             constexpr bool VARLEN = {};\n\
             #define FA4_SMEM_BYTES {}\n",
            self.head_dim,
            t.block_n,
            t.consumer_wgs,
            t.stages,
            t.q_stages(self.head_dim),
            t.producer_regs,
            t.consumer_regs,
            t.lazy_rescale,
            t.intra_wg_overlap,
            t.pingpong,
            t.poly_exp2,
            self.bf16,
            self.window,
            self.softcap,
            self.varlen,
            self.smem_bytes()
        )
    }

    /// The two `wgmma` wrappers the kernel calls, written out for this spec's N and dtype (an
    /// inline-asm operand list cannot be produced by a C++ template):
    /// `wgmma_ss(d, desc_a, desc_b, accumulate)`, m64 n`block_n` k16, both operands in shared
    /// memory and K-major; `wgmma_rs(d, a0..a3, desc_b)`, m64 n`head_dim` k16, A from
    /// registers, B MN-major (transposed), always accumulating.
    pub fn wgmma_wrappers(&self) -> String {
        let ty = if self.bf16 { "bf16" } else { "f16" };
        let regs = |n: usize| {
            let list: Vec<String> = (0..n / 2).map(|i| format!("%{i}")).collect();
            let outs: Vec<String> = (0..n / 2).map(|i| format!("\"+f\"(d[{i}])")).collect();
            (list.join(", "), outs.join(", "))
        };
        let n = self.tiles.block_n;
        let (list, outs) = regs(n);
        let half = n / 2;
        let ss = format!(
            "__device__ __forceinline__ void wgmma_ss(float (&d)[{half}], u64 desc_a, u64 desc_b, int accumulate) {{\n\
             \x20   asm volatile(\"{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{acc}, 0;\\n\"\n\
             \x20                \"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ty}.{ty} {{{list}}}, %{a}, %{b}, p, 1, 1, 0, 0;\\n}}\\n\"\n\
             \x20                : {outs}\n\
             \x20                : \"l\"(desc_a), \"l\"(desc_b), \"r\"(accumulate));\n\
             }}\n",
            a = half,
            b = half + 1,
            acc = half + 2,
        );
        let n = self.head_dim;
        let (list, outs) = regs(n);
        let half = n / 2;
        let rs = format!(
            "__device__ __forceinline__ void wgmma_rs(float (&d)[{half}], u32 a0, u32 a1, u32 a2, u32 a3, u64 desc_b) {{\n\
             \x20   asm volatile(\"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ty}.{ty} {{{list}}}, {{%{a0}, %{a1}, %{a2}, %{a3}}}, %{b}, 1, 1, 1, 1;\\n\"\n\
             \x20                : {outs}\n\
             \x20                : \"r\"(a0), \"r\"(a1), \"r\"(a2), \"r\"(a3), \"l\"(desc_b));\n\
             }}\n",
            a0 = half,
            a1 = half + 1,
            a2 = half + 2,
            a3 = half + 3,
            b = half + 4,
        );
        format!(
            "// generated by config::sm90: wgmma for N = {} (S) and N = {} (O)\n{ss}{rs}",
            self.tiles.block_n, self.head_dim
        )
    }
}

impl fmt::Display for KernelSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let t = &self.tiles;
        write!(
            f,
            "sm90-fwd {} {} d{} {}x{} c{} s{} r{}/{}{}{}{}{}{}{}{}{}",
            self.target,
            if self.bf16 { "bf16" } else { "fp16" },
            self.head_dim,
            t.block_m(),
            t.block_n,
            t.consumer_wgs,
            t.stages,
            t.producer_regs,
            t.consumer_regs,
            if t.lazy_rescale { " lazy" } else { "" },
            if t.intra_wg_overlap { " overlap" } else { "" },
            if t.pingpong { " pingpong" } else { "" },
            if t.persistent { " persistent" } else { "" },
            if t.poly_exp2 > 0 {
                format!(" poly{}/8", t.poly_exp2)
            } else {
                String::new()
            },
            if self.window { " window" } else { "" },
            if self.softcap { " softcap" } else { "" },
            if self.varlen { " varlen" } else { "" }
        )
    }
}

/// Every spec the planner can emit for `arch` (for compile tests and warm-up).
pub fn all_specs(arch: &GpuArch, target: &'static str) -> Vec<KernelSpec> {
    let mut out = Vec::new();
    // Every fitting candidate: `tiles_for` may pick any of them for a sequence length.
    for (head_dim, tiles) in HEAD_DIMS
        .into_iter()
        .flat_map(|d| fitting(arch, d).map(move |t| (d, t)))
    {
        out.extend(
            super::feature_variants().flat_map(|(bf16, window, softcap)| {
                [false, true].map(|varlen| KernelSpec {
                    target,
                    bf16,
                    head_dim,
                    window,
                    softcap,
                    varlen,
                    tiles,
                })
            }),
        );
    }
    out
}

/// A warpgroup's role, for the report: who it is, what it does, its registers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Role {
    /// Warpgroup index in the CTA.
    pub warpgroup: usize,
    /// `producer` or `consumer`.
    pub role: &'static str,
    /// What it does.
    pub work: String,
    /// Its `setmaxnreg` target.
    pub registers: u32,
}

/// The Hopper plan for a head dim and dtype: tiles, roles and budgets.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Sm90Plan {
    /// The GPU planned for.
    pub arch: &'static str,
    /// The problem's head dim.
    pub head_dim: usize,
    /// The head dim the kernel is compiled for.
    pub padded_head_dim: usize,
    /// Query rows per CTA.
    pub block_m: usize,
    /// The tiles.
    pub tiles: Tiles,
    /// Threads per CTA.
    pub threads: usize,
    /// Warpgroup roles.
    pub roles: Vec<Role>,
    /// The shared-memory budget.
    pub smem: SmemBudget,
    /// Total dynamic shared memory.
    pub smem_total: usize,
    /// The per-block limit it is checked against.
    pub smem_limit: usize,
    /// Operand registers per consumer thread (S and O accumulators, packed P).
    pub accumulator_regs: u32,
    /// Registers per thread the CTA is launched with ([`Tiles::launch_regs`]).
    pub launch_regs: u32,
    /// TMA boxes per tile: (64-element head-dim slabs, rows).
    pub tma_box: (usize, usize),
    /// Planned for a varlen batch (one CTA per tile).
    pub varlen: bool,
}

impl Sm90Plan {
    /// Plans head dim `head_dim` of 16-bit elements (`dtype_size` 2) on `arch`.
    pub fn new(arch: &GpuArch, head_dim: usize, dtype_size: usize) -> Result<Sm90Plan> {
        if dtype_size != 2 {
            return Err(Error::invalid(
                "dtype",
                format!("the Hopper kernel computes fp16 and bf16 (2 bytes), not {dtype_size}-byte elements"),
            ));
        }
        if arch.family != Family::Hopper {
            return Err(Error::invalid(
                "arch",
                format!(
                    "{} is not a Hopper GPU; the sm90 plan is for H100/H200",
                    arch.name
                ),
            ));
        }
        if !HEAD_DIMS.contains(&head_dim) {
            return Err(Error::invalid(
                "depth",
                format!("head_dim {head_dim}: the Hopper kernel is planned for exactly {HEAD_DIMS:?} (its TMA boxes read whole 64-column slabs)"),
            ));
        }
        let padded = head_dim;
        let tiles = tiles(arch, padded).ok_or_else(|| {
            Error::invalid(
                "depth",
                format!("no Hopper tiles fit head_dim {padded} on {}", arch.name),
            )
        })?;
        Ok(Self::with_tiles(arch, head_dim, padded, tiles))
    }

    /// As [`Sm90Plan::new`], with the tiles a fixed-length problem of `seqlen_q` query rows per
    /// sequence gets ([`tiles_for`]: the tile height and the persistent launch).
    pub fn for_seqlen(
        arch: &GpuArch,
        head_dim: usize,
        dtype_size: usize,
        seqlen_q: usize,
    ) -> Result<Sm90Plan> {
        let generic = Self::new(arch, head_dim, dtype_size)?;
        let tiles = tiles_for(arch, head_dim, seqlen_q, seqlen_q).unwrap_or(generic.tiles);
        Ok(Self::with_tiles(arch, head_dim, head_dim, tiles))
    }

    fn with_tiles(arch: &GpuArch, head_dim: usize, padded: usize, tiles: Tiles) -> Sm90Plan {
        let mut roles = vec![Role {
            warpgroup: 0,
            role: "producer",
            work: format!(
                "one thread issues TMA loads: each tile's Q ({} slot(s)), then K and V into a {}-stage ring",
                tiles.q_stages(padded),
                tiles.stages
            ),
            registers: tiles.producer_regs,
        }];
        for w in 0..tiles.consumer_wgs {
            roles.push(Role {
                warpgroup: w + 1,
                role: "consumer",
                work: format!(
                    "query rows {}..{}: wgmma S = Q·Kᵀ (64×{}), softmax, wgmma O += P·V (64×{padded})",
                    w * ROWS_PER_CONSUMER,
                    (w + 1) * ROWS_PER_CONSUMER,
                    tiles.block_n
                ),
                registers: tiles.consumer_regs,
            });
        }
        let smem = tiles.smem(padded);
        Sm90Plan {
            arch: arch.name,
            head_dim,
            padded_head_dim: padded,
            block_m: tiles.block_m(),
            tiles,
            threads: tiles.threads(),
            roles,
            smem,
            smem_total: smem.total(),
            smem_limit: arch.max_smem_per_block() as usize,
            accumulator_regs: tiles.accumulator_regs(padded),
            launch_regs: tiles.launch_regs(arch),
            tma_box: (padded / SWIZZLE_ELEMS, tiles.block_n),
            varlen: false,
        }
    }

    /// The plan for a varlen batch: the same tiles, one CTA per tile ([`plan`] does the same).
    pub fn for_varlen(mut self) -> Sm90Plan {
        self.tiles.persistent = false;
        self.varlen = true;
        self
    }

    /// The machine-readable form (`fa4 plan --arch sm90 --json`).
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("plain data serializes")
    }
}

impl fmt::Display for Sm90Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let t = &self.tiles;
        writeln!(f, "Hopper (sm_90a) forward plan for {}", self.arch)?;
        writeln!(
            f,
            "  head_dim {} (compiled for {}), tile {}×{} (query rows × keys), {} K/V stages",
            self.head_dim, self.padded_head_dim, self.block_m, t.block_n, t.stages
        )?;
        writeln!(
            f,
            "  {} threads: {} warpgroups",
            self.threads,
            self.roles.len()
        )?;
        for r in &self.roles {
            writeln!(
                f,
                "    wg{} {:<8} {:>3} registers  {}",
                r.warpgroup, r.role, r.registers, r.work
            )?;
        }
        writeln!(
            f,
            "  registers: 128 × ({} + {} × {}) = {} of the {} launched ({} threads × {}); consumer accumulators {} per thread (+{} margin)",
            t.producer_regs,
            t.consumer_wgs,
            t.consumer_regs,
            128 * (t.producer_regs + t.consumer_wgs as u32 * t.consumer_regs),
            self.threads as u32 * self.launch_regs,
            self.threads,
            self.launch_regs,
            self.accumulator_regs,
            CONSUMER_REG_MARGIN
        )?;
        let s = &self.smem;
        writeln!(
            f,
            "  shared memory: Q {} + K {} + V {} + barriers {} + alignment {} = {} of {} bytes",
            s.q, s.k, s.v, s.barriers, s.align_slack, self.smem_total, self.smem_limit
        )?;
        writeln!(
            f,
            "  TMA: {} box(es) of 64 columns (128-byte swizzle) per tile, {} rows per K/V box",
            self.tma_box.0, self.tma_box.1
        )?;
        let on = |b: bool| if b { "on" } else { "off" };
        writeln!(
            f,
            "  softmax/MMA overlap in a warpgroup: {}; ping-pong between consumers: {}; conditional rescaling: {}",
            on(t.intra_wg_overlap),
            on(t.pingpong),
            on(t.lazy_rescale)
        )?;
        write!(
            f,
            "  exponentials on the FMA units: {} of 8; launch: {}",
            t.poly_exp2,
            if t.persistent {
                "persistent (one CTA per SM walks the tiles in pairs of equal causal cost)"
                    .to_string()
            } else if self.varlen {
                "one CTA per tile (varlen batches: the persistent launch is not verified on them yet)"
                    .to_string()
            } else {
                format!(
                    "one CTA per tile; persistent (one CTA per SM walks the tiles) for sequences of at most {} query rows",
                    PERSISTENT_MAX_M_BLOCKS * self.block_m
                )
            }
        )
    }
}

/// Whether [`dispatch`] sends covered problems to the Hopper kernel. On since the kernel passed
/// every covered case of the correctness matrix (fp16 and bf16, d64/128/256) and memcheck,
/// racecheck and synccheck on an H200; `CudaBackend::with_kernel` forces either family.
pub const ENABLED: bool = true;

/// Which kernel a problem gets on a GPU, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Dispatch {
    /// `sm90` (the Hopper kernel), `sm80` (the Ampere-class kernel) or `cpu`.
    pub kernel: &'static str,
    /// Why.
    pub reason: String,
}

/// Problem features that decide between the Hopper kernel and the Ampere-class fallback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Features {
    /// Head dim of Q/K (equal to V's).
    pub head_dim: usize,
    /// Element size in bytes.
    pub dtype_size: usize,
    /// Variable-length (packed) sequences (covered; named in the dispatch reason).
    pub varlen: bool,
    /// A softmax scale ≤ 0 (the kernel's running max assumes scale > 0).
    pub nonpositive_scale: bool,
    /// A batch without a single key (its TMA maps would have an empty dimension). Varlen
    /// batches with some empty sequences are covered.
    pub no_keys: bool,
    /// Tiles of the launch with the smallest tile (128 query rows): the longest sequence's query
    /// blocks × query heads × sequences (a varlen batch walks the longest one's blocks for
    /// every sequence). 0 where unknown (`fa4 plan` without a problem).
    pub tiles: u128,
}

/// Why the Hopper kernel does not cover a problem with these features on `arch` (the argument
/// to blame and the reason), or `None`.
pub fn uncovered_arg(arch: &GpuArch, f: Features) -> Option<(&'static str, String)> {
    if arch.family != Family::Hopper {
        return Some(("device", format!("{} is not a Hopper GPU", arch.name)));
    }
    if f.dtype_size != 2 {
        return Some((
            "dtype",
            format!(
                "{}-byte elements: the Hopper kernel computes fp16 and bf16",
                f.dtype_size
            ),
        ));
    }
    if !HEAD_DIMS.contains(&f.head_dim) {
        return Some((
            "q",
            format!(
                "head_dim {}: the Hopper kernel covers exactly {HEAD_DIMS:?} (its TMA boxes read whole 64-column slabs)",
                f.head_dim
            ),
        ));
    }
    if f.nonpositive_scale {
        return Some((
            "scale",
            "a scale ≤ 0: the Hopper kernel assumes scale > 0".into(),
        ));
    }
    if f.no_keys {
        return Some((
            "k",
            "no keys in the batch (seqlen_k = 0): nothing for the Hopper kernel's TMA maps to describe".into(),
        ));
    }
    if f.tiles > MAX_TILES {
        return Some((
            if f.varlen { "cu_seqlens_q" } else { "q" },
            format!(
                "{} tiles (the longest sequence's 128-row query blocks × heads × sequences) exceed the Hopper kernel's 2^30",
                f.tiles
            ),
        ));
    }
    if tiles(arch, f.head_dim).is_none() {
        return Some((
            "q",
            format!(
                "no Hopper tiles fit head_dim {} on {}",
                f.head_dim, arch.name
            ),
        ));
    }
    None
}

/// Why the Hopper kernel does not cover a problem with these features on `arch`, or `None`.
pub fn uncovered(arch: &GpuArch, f: Features) -> Option<String> {
    uncovered_arg(arch, f).map(|(_, why)| why)
}

/// The kernel choice on `arch` when the caller does not force one: `sm90`, `sm80`, or `cpu`
/// where no CUDA kernel computes the problem (other dtypes, head dims above 256).
pub fn dispatch(arch: &GpuArch, f: Features) -> Dispatch {
    if f.dtype_size != 2 || f.head_dim > super::sm80::HEAD_DIMS[super::sm80::HEAD_DIMS.len() - 1] {
        return Dispatch {
            kernel: "cpu",
            reason: format!(
                "the CUDA kernels compute fp16/bf16 with head dims up to 256 ({}-byte elements, head_dim {})",
                f.dtype_size, f.head_dim
            ),
        };
    }
    match uncovered(arch, f) {
        Some(reason) => Dispatch {
            kernel: "sm80",
            reason,
        },
        None if !ENABLED => Dispatch {
            kernel: "sm80",
            reason: "the Hopper kernel covers this problem but is not enabled by default yet (issue 5: it has not passed the matrix on an H200)".into(),
        },
        None => Dispatch {
            kernel: "sm90",
            reason: format!(
                "a Hopper GPU, fp16/bf16, head dim 64/128/256, positive scale, {} batch",
                if f.varlen {
                    "variable-length"
                } else {
                    "fixed-length"
                }
            ),
        },
    }
}

/// The features of a problem.
pub fn features(p: &Problem) -> Features {
    Features {
        head_dim: p.head_dim(),
        dtype_size: p.dtype().size_bytes() as usize,
        varlen: p.is_varlen(),
        nonpositive_scale: p.scale() <= 0.0,
        no_keys: p.sequences().iter().all(|s| s.k_len == 0),
        tiles: (max_q_len(p).div_ceil(ROWS_PER_CONSUMER * 2) as u128)
            * (p.heads_q() as u128)
            * (p.sequences().len() as u128),
    }
}

/// A planned launch of the Hopper kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The kernel to compile.
    pub spec: KernelSpec,
    /// Grid: (CTAs, 1, 1), one per tile or, persistent, at most one per SM.
    pub grid: (u32, u32, u32),
}

/// The longest sequence's query rows (every sequence's, in a fixed-length batch).
fn max_q_len(p: &Problem) -> usize {
    p.sequences().iter().map(|s| s.q_len).max().unwrap_or(0)
}

/// The 1-D grid of a launch: one CTA per tile (query block × head × sequence), or with
/// [`Tiles::persistent`] one per SM at most, each walking the tiles (the kernel numbers them).
/// A varlen batch gets the longest sequence's query blocks for every sequence; the kernel skips
/// the tiles past a shorter sequence's end.
fn launch_grid(p: &Problem, arch: &GpuArch, tiles: &Tiles) -> Result<(u32, u32, u32)> {
    let q_len = max_q_len(p);
    let total = (q_len.div_ceil(tiles.block_m()) as u128)
        * (p.heads_q() as u128)
        * (p.sequences().len() as u128);
    let total = u32::try_from(total)
        .ok()
        .filter(|&t| t as u128 <= MAX_TILES)
        .ok_or_else(|| {
            Error::invalid(
                "q",
                format!(
                    "{total} tiles (query blocks × heads × batch) exceed the Hopper kernel's 2^30"
                ),
            )
        })?;
    let ctas = if tiles.persistent {
        total.min(arch.sm_count)
    } else {
        total
    };
    Ok((ctas, 1, 1))
}

/// Why varlen batches get one CTA per tile: the kernel's persistent walk over varlen tiles (empty
/// tiles skipped, the Q ring counting loaded tiles only, several foreign V blocks per CTA) is
/// written but has not run on a GPU with more than one tile per CTA.
const VARLEN_NOT_PERSISTENT: &str = "the persistent launch is not verified on varlen batches yet (a CTA walking several varlen tiles has not run on a GPU): varlen batches take one CTA per tile";

/// Largest byte stride a TMA map takes (2^40).
const TMA_MAX_STRIDE_BYTES: usize = 1 << 40;

/// Plans a problem for the Hopper kernel, or says (naming the argument) why it cannot run it.
pub fn plan(
    p: &Problem,
    arch: &GpuArch,
    target: &'static str,
    tiles: Option<Tiles>,
) -> Result<Plan> {
    if let Some((name, why)) = uncovered_arg(arch, features(p)) {
        return Err(Error::invalid(name, why));
    }
    if p.head_dim_v() != p.head_dim() {
        return Err(Error::invalid(
            "v",
            format!(
                "head_dim_v {} must equal head_dim {}",
                p.head_dim_v(),
                p.head_dim()
            ),
        ));
    }
    let head_dim = p.head_dim();
    for (name, axis, st) in super::strides(p) {
        if !st.is_multiple_of(8) || st >= TMA_MAX_STRIDE_BYTES / 2 {
            return Err(Error::invalid(
                name,
                format!("{axis} {st} must be a multiple of 8 elements (16 bytes) below 2^39 for the Hopper kernel's TMA maps"),
            ));
        }
    }
    let tiles = match tiles {
        Some(t) => {
            t.check(head_dim, arch)?;
            if t.persistent && p.is_varlen() {
                return Err(Error::invalid("tiles", VARLEN_NOT_PERSISTENT));
            }
            t
        }
        None => {
            let max_k_len = p.sequences().iter().map(|s| s.k_len).max().unwrap_or(0);
            let mut t = tiles_for(arch, head_dim, max_q_len(p), max_k_len)
                .expect("covered problems have tiles");
            t.persistent &= !p.is_varlen();
            t
        }
    };
    // TMA coordinates and the kernel's row arithmetic are int32: rows of the (packed) tensors.
    let (rows_q, rows_k) = (p.q_layout().dims[1], p.k_layout().dims[1]);
    if rows_q > i32::MAX as usize / 2 || rows_k > i32::MAX as usize / 2 {
        return Err(Error::invalid(
            "q",
            format!("{rows_q} query / {rows_k} key rows exceed the TMA coordinate range (2^30)"),
        ));
    }
    Ok(Plan {
        spec: KernelSpec {
            target,
            bf16: p.dtype() == DType::Bf16,
            head_dim,
            window: p.mask().is_restrictive(),
            softcap: p.softcap().is_some(),
            varlen: p.is_varlen(),
            tiles,
        },
        grid: launch_grid(p, arch, &tiles)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::{A100, B200, H100, H200};

    #[test]
    fn every_head_dim_plans_on_hopper_within_budgets() {
        for arch in [H100, H200] {
            for d in HEAD_DIMS {
                let p = Sm90Plan::new(&arch, d, 2).unwrap();
                assert!(p.padded_head_dim >= d && HEAD_DIMS.contains(&p.padded_head_dim));
                assert!(p.smem_total <= p.smem_limit, "{p}");
                assert_eq!(
                    p.smem_total,
                    p.smem.q + p.smem.k + p.smem.v + p.smem.barriers + p.smem.align_slack
                );
                assert_eq!(p.threads, 128 * p.roles.len());
                let t = p.tiles;
                assert!(
                    128 * (t.producer_regs + t.consumer_wgs as u32 * t.consumer_regs)
                        <= p.threads as u32 * p.launch_regs
                );
                assert!(p.accumulator_regs + CONSUMER_REG_MARGIN <= t.consumer_regs);
                assert_eq!(p.smem.q % TILE_ALIGN, 0);
            }
        }
        // d128 at 1k: two Q slots of 32 KiB, K and V 2 × 32 KiB each.
        let p = Sm90Plan::for_seqlen(&H200, 128, 2, 1024).unwrap();
        assert_eq!(p.tiles.q_stages(128), 2);
        assert_eq!((p.smem.q, p.smem.k, p.smem.v), (65536, 65536, 65536));
        // d128 first choice: 176-key blocks (2 × 44 KiB each of K and V) leave room for one Q.
        let p = Sm90Plan::new(&H200, 128, 2).unwrap();
        assert_eq!((p.tiles.block_n, p.tiles.q_stages(128)), (176, 1));
        assert_eq!((p.smem.q, p.smem.k, p.smem.v), (32768, 90112, 90112));
        assert_eq!(p.accumulator_regs, 196);
        // d256: one 64 KiB Q slot beside 2 × 40 KiB each of K and V.
        let p = Sm90Plan::new(&H200, 256, 2).unwrap();
        assert_eq!((p.tiles.q_stages(256), p.smem.q), (1, 65536));
        assert_eq!((p.smem.k, p.smem.v), (81920, 81920));
        assert_eq!(p.accumulator_regs, 188);
    }

    #[test]
    fn bad_inputs_and_tiles_are_named_errors() {
        let name = |e: Error| match e {
            Error::InvalidArgument { name, .. } => name,
            e => panic!("{e}"),
        };
        assert_eq!(name(Sm90Plan::new(&H200, 0, 2).unwrap_err()), "depth");
        assert_eq!(name(Sm90Plan::new(&H200, 257, 2).unwrap_err()), "depth");
        assert_eq!(name(Sm90Plan::new(&H200, 96, 2).unwrap_err()), "depth");
        assert_eq!(name(Sm90Plan::new(&H200, 128, 4).unwrap_err()), "dtype");
        assert_eq!(name(Sm90Plan::new(&A100, 128, 2).unwrap_err()), "arch");
        assert_eq!(name(Sm90Plan::new(&B200, 128, 2).unwrap_err()), "arch");
        let good = tiles(&H200, 128).unwrap();
        for bad in [
            Tiles {
                block_n: 120,
                ..good
            },
            Tiles {
                block_n: 272,
                ..good
            },
            Tiles { stages: 1, ..good },
            Tiles {
                consumer_wgs: 4,
                ..good
            },
            Tiles {
                consumer_regs: 244,
                ..good
            },
            Tiles {
                producer_regs: 16,
                ..good
            },
            Tiles {
                consumer_wgs: 3,
                ..good
            },
            Tiles {
                block_n: 256,
                ..good
            },
            Tiles { stages: 4, ..good },
            Tiles {
                consumer_wgs: 1,
                pingpong: true,
                ..good
            },
            Tiles {
                poly_exp2: 9,
                ..good
            },
            // 128 · (32 + 2 · 240) = 65,536 > 384 · 168: setmaxnreg.inc would wait forever.
            Tiles {
                producer_regs: 32,
                consumer_regs: 240,
                ..good
            },
        ] {
            assert!(bad.check(128, &H200).is_err(), "{bad:?}");
        }
        // The most the consumers can take from a 24-register producer: exactly the launch.
        let full = Tiles {
            producer_regs: 24,
            consumer_regs: 240,
            ..good
        };
        assert!(full.check(128, &H200).is_ok());
        assert_eq!(full.launch_regs(&H200), 168);
        assert!(good.check(128, &A100).is_err());
    }

    #[test]
    fn problem_tiles_follow_the_sequence_length() {
        // d64: 192-row tiles unless a 192-row tile would be mostly padding; persistent up to
        // 32 query blocks.
        let d64 = |sq| tiles_for(&H200, 64, sq, sq).unwrap();
        assert_eq!((d64(1024).block_m(), d64(1024).persistent), (128, true));
        assert_eq!((d64(4096).block_m(), d64(4096).persistent), (192, true));
        assert_eq!((d64(16384).block_m(), d64(16384).persistent), (192, false));
        // d128: 176-key blocks from 4k keys, 128 below.
        let d128 = |sq, sk| tiles_for(&H200, 128, sq, sk).unwrap();
        assert!(d128(4096, 4096).persistent && !d128(4097, 4097).persistent);
        assert!(d128(100, 100).persistent && d128(100, 100).intra_wg_overlap);
        assert_eq!(d128(1024, 1024).block_n, 128);
        assert_eq!(d128(1024, 4096).block_n, 176);
        assert_eq!(d128(16384, 4095).block_n, 128);
        assert_eq!(tiles(&H200, 128).unwrap().block_n, 176);
        assert_eq!(tiles_for(&H200, 256, 1024, 1024).unwrap().block_n, 80);
        assert_eq!(tiles_for(&H200, 96, 1024, 1024), None);
        assert_eq!(tiles_for(&A100, 128, 1024, 1024), None);
    }

    #[test]
    fn dispatch_says_why() {
        let f = Features {
            head_dim: 128,
            dtype_size: 2,
            varlen: false,
            nonpositive_scale: false,
            no_keys: false,
            tiles: 1000,
        };
        assert_eq!(dispatch(&A100, f).kernel, "sm80");
        let why = |g: Features| dispatch(&H200, g);
        let varlen = why(Features { varlen: true, ..f });
        assert_eq!(varlen.kernel, if ENABLED { "sm90" } else { "sm80" });
        assert!(varlen.reason.contains("variable-length"), "{varlen:?}");
        assert_eq!(why(Features { dtype_size: 4, ..f }).kernel, "cpu");
        assert_eq!(why(Features { head_dim: 512, ..f }).kernel, "cpu");
        assert!(why(Features { head_dim: 96, ..f })
            .reason
            .contains("exactly"));
        let scale = why(Features {
            nonpositive_scale: true,
            ..f
        });
        assert!(scale.kernel == "sm80" && scale.reason.contains("scale"));
        let keys = why(Features { no_keys: true, ..f });
        assert!(keys.kernel == "sm80" && keys.reason.contains("seqlen_k = 0"));
        // Past 2^30 tiles (a varlen batch walks its longest sequence's blocks for every one).
        let many = why(Features {
            tiles: MAX_TILES + 1,
            varlen: true,
            ..f
        });
        assert!(
            many.kernel == "sm80" && many.reason.contains("2^30"),
            "{many:?}"
        );
        assert_eq!(
            why(Features {
                tiles: MAX_TILES,
                ..f
            })
            .kernel,
            "sm90"
        );
        assert_eq!(why(f).kernel, if ENABLED { "sm90" } else { "sm80" });
    }

    fn problem(
        sk: usize,
        opts: &crate::problem::Options,
        row_stride: Option<usize>,
    ) -> Result<Problem> {
        use crate::tensor::Layout;
        let (b, sq, h, d) = (2, 100, 4, 128);
        let q = Layout::new("q", &[b, sq, h, d], None)?;
        let strides = row_stride.map(|r| [r * sk.max(1), r, d, 1]);
        let k = Layout::new("k", &[b, sk, h, d], strides.as_ref().map(|s| &s[..]))?;
        let o = Layout::new("out", &[b, sq, h, d], None)?;
        Problem::new(DType::Bf16, &q, &k, &k.clone(), &o, None, None, opts)
    }

    #[test]
    fn plan_names_the_argument_it_cannot_take() {
        use crate::problem::Options;
        let name = |e: Error| match e {
            Error::InvalidArgument { name, .. } => name,
            e => panic!("{e}"),
        };
        let ok = plan(
            &problem(300, &Options::new(), None).unwrap(),
            &H200,
            "sm_90a",
            None,
        )
        .unwrap();
        // One CTA per tile: 1 query block × 4 heads × 2 sequences.
        assert_eq!(ok.grid, (8, 1, 1));
        // Persistent: at most one CTA per SM.
        let mut tiles = self::tiles(&H200, 128).unwrap();
        tiles.persistent = true;
        let few = plan(
            &problem(300, &Options::new(), None).unwrap(),
            &H200,
            "sm_90a",
            Some(tiles),
        )
        .unwrap();
        assert_eq!(few.grid, (8, 1, 1));
        let l = crate::tensor::Layout::new("q", &[2, 100_000, 4, 128], None).unwrap();
        let long = Problem::new(DType::Bf16, &l, &l, &l, &l, None, None, &Options::new()).unwrap();
        assert_eq!(
            plan(&long, &H200, "sm_90a", Some(tiles)).unwrap().grid,
            (H200.sm_count, 1, 1)
        );
        tiles.persistent = false;
        assert_eq!(
            plan(&long, &H200, "sm_90a", Some(tiles)).unwrap().grid,
            (782 * 4 * 2, 1, 1)
        );
        assert_eq!(ok.spec.head_dim, 128);
        let p0 = problem(0, &Options::new(), None).unwrap();
        assert_eq!(name(plan(&p0, &H200, "sm_90a", None).unwrap_err()), "k");
        let zero = problem(64, &Options::new().scale(0.0), None).unwrap();
        assert_eq!(
            name(plan(&zero, &H200, "sm_90a", None).unwrap_err()),
            "scale"
        );
        let neg = problem(64, &Options::new().scale(-0.5), None).unwrap();
        assert_eq!(
            name(plan(&neg, &H200, "sm_90a", None).unwrap_err()),
            "scale"
        );
        assert_eq!(name(plan(&p0, &A100, "sm_80", None).unwrap_err()), "device");
        // Varlen: one CTA per tile, the longest sequence's query blocks for every sequence, and
        // the persistent launch refused (not verified on varlen batches yet).
        let (tq, tk) = (3 + 300 + 1, 5 + 300);
        let ql = crate::tensor::Layout::new("q", &[tq, 4, 128], None).unwrap();
        let kl = crate::tensor::Layout::new("k", &[tk, 4, 128], None).unwrap();
        let (cq, ck) = ([0, 3, 303, 304], [0, 5, 5, 305]);
        let v = Problem::new(
            DType::Bf16,
            &ql,
            &kl,
            &kl,
            &ql,
            Some(&cq),
            Some(&ck),
            &Options::new(),
        )
        .unwrap();
        let vp = plan(&v, &H200, "sm_90a", None).unwrap();
        assert!(vp.spec.varlen && !vp.spec.tiles.persistent);
        assert_eq!(vp.grid, (3 * 4 * 3, 1, 1));
        assert!(!tiles.persistent && plan(&v, &H200, "sm_90a", Some(tiles)).is_ok());
        tiles.persistent = true;
        assert_eq!(
            name(plan(&v, &H200, "sm_90a", Some(tiles)).unwrap_err()),
            "tiles"
        );
        // A row stride of 516 elements is not a 16-byte multiple.
        let p = problem(64, &Options::new(), Some(4 * 128 + 4)).unwrap();
        assert_eq!(name(plan(&p, &H200, "sm_90a", None).unwrap_err()), "k");
        // 2^39 elements (2^40 bytes) is past TMA's stride range, where the layout itself allows it.
        if let Ok(p) = problem(64, &Options::new(), Some(1 << 39)) {
            assert_eq!(name(plan(&p, &H200, "sm_90a", None).unwrap_err()), "k");
        }
    }
}
