//! The Hopper kernel's tiles: their shape and switches, what they cost in shared memory and
//! registers, the candidates per head dim and the choice for a sequence length.

use super::*;

/// Tile widths the Hopper kernel is compiled for: every head dim that is a multiple of 8 up to
/// 256 is padded to the next of them ([`padded_head_dim`]). The tiles are whole 64-column slabs
/// (the 128-byte swizzle); a narrower tensor's TMA map covers its real columns and the hardware
/// fills the rest of the tile with zeros.
pub const HEAD_DIMS: [usize; 4] = [64, 128, 192, 256];

/// The tile width a head dim is computed in: the next multiple of 64, for multiples of 8 in
/// 8..=256 (TMA strides are multiples of 16 bytes); `None` otherwise.
pub fn padded_head_dim(d: usize) -> Option<usize> {
    (d > 0 && d <= 256 && d.is_multiple_of(8)).then(|| d.next_multiple_of(SWIZZLE_ELEMS))
}

/// The tile widths of one launch: Q and K's head dim (`qk`) and V and O's (`v`), each one of
/// [`HEAD_DIMS`], `v ≤ qk` (O is staged in a Q slot for the TMA store). A plain `usize` converts
/// to the square dims `(d, d)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct Dims {
    /// Tile width of Q and K.
    pub qk: usize,
    /// Tile width of V and O.
    pub v: usize,
}

impl From<usize> for Dims {
    fn from(d: usize) -> Dims {
        Dims { qk: d, v: d }
    }
}

impl fmt::Display for Dims {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.qk == self.v {
            write!(f, "{}", self.qk)
        } else {
            write!(f, "{}/{}", self.qk, self.v)
        }
    }
}
/// Threads in a warpgroup (the unit of `wgmma` and `setmaxnreg`).
pub const WARPGROUP_THREADS: usize = 128;
/// Query rows per consumer warpgroup: the M of `wgmma.mma_async.m64nNk16`.
pub const ROWS_PER_CONSUMER: usize = 64;
/// Elements per 128-byte swizzle atom row (16-bit): TMA boxes and `wgmma` descriptors move the
/// head dim in slabs of this width.
pub const SWIZZLE_ELEMS: usize = 64;
/// Elements per 128-byte swizzle atom row of e4m3 (the e4m3 kernel's slab width, and its Vᵀ
/// slabs' keys).
pub const FP8_SLAB_ELEMS: usize = 128;
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
    /// Longest-first tile order (FlashAttention-3): tiles numbered query block slowest, the
    /// last (under a causal mask the heaviest) query block of every (sequence, head) first, so
    /// each CTA's k-th tile costs about the same as every other CTA's and the launch ends on
    /// the lightest tiles. Off: query block fastest (pairs of equal causal cost when persistent).
    pub longest_first: bool,
    /// TMA-store epilogue: each consumer warpgroup writes its normalised O rows into its own
    /// rows of the tile's Q slot (swizzled), and one thread stores them with
    /// `cp.async.bulk.tensor`; Q is released once the store has read them. LSE stays a plain
    /// store. A fixed-length batch's O map is per batch entry, so rows past a sequence are
    /// clipped by its bounds; a varlen batch's one packed map would not clip a block's rows of
    /// the next sequence, so there a sequence's last, partial 64-row block is stored plainly.
    pub tma_store: bool,
    /// Cross-tile overlap (persistent launch, with the intra-warpgroup overlap): the next
    /// tile's first Q·Kᵀ is issued together with the current tile's last P·V, and its softmax
    /// runs before the current tile's epilogue, hiding the per-tile prologue.
    pub cross_tile: bool,
    /// Dynamic persistent schedule (with [`Tiles::persistent`]): CTA b starts with tile b and
    /// takes each further tile from a counter in global memory as soon as its last tile's loads
    /// are issued, in the order one CTA per tile would start them (FlashAttention-3's scheduler
    /// for causal and varlen batches): a CTA whose tiles were light takes more. A varlen batch's
    /// tiles are numbered over each sequence's own query blocks, so none is empty. Off: the
    /// static walk of [`Tiles::persistent`].
    pub dynamic: bool,
    /// `wgmma` descriptors in uniform registers, each operand's built once per tile or stage
    /// and advanced by a constant per k16 step (FlashAttention-3's way), and the warpgroup index
    /// broadcast from lane 0 so that the addresses derived from it are warp-uniform to ptxas.
    /// Off: each descriptor rebuilt from its address (mask, shift, or), the addresses moved into
    /// uniform registers with `R2UR`. At d128 × 176 keys, 612 instructions per key block and
    /// warp against 714 (FlashAttention-3: 594; SASS, 2026-12-06, docs/perf-history.md "The
    /// steady loop beside FlashAttention-3's"), and 2.4–14.5% faster on 23 of the 24 grid
    /// shapes, level on one (H100, 2026-12-06, docs/perf-history.md "Uniform wgmma descriptors on
    /// the GPU"). On in every entry of the tile table; a `--sm90-tiles` override that leaves
    /// the field out has it off.
    pub uniform_desc: bool,
}

/// The command-line spelling of a Hopper tile override (`fa4 bench --sm90-tiles`):
/// `block_n,consumer_wgs,stages,producer_regs,consumer_regs,lazy,overlap,pingpong,persistent,poly`
/// (flags 0|1; `poly` is [`Tiles::poly_exp2`], 0..=8), optionally followed by
/// `,longest_first,tma_store,cross_tile[,dynamic[,uniform_desc]]` (flags 0|1; off when left out).
impl std::str::FromStr for Tiles {
    type Err = Error;

    fn from_str(s: &str) -> Result<Tiles> {
        const WHAT: &str = "sm90 tiles";
        // Ten fields (the switches before longest_first), thirteen, fourteen or fifteen.
        let [block_n, consumer_wgs, stages, producer_regs, consumer_regs, lazy, overlap, pingpong, persistent, poly_exp2, longest_first, tma_store, cross_tile, dynamic, uniform_desc] =
            match s.split(',').count() {
                10 => {
                    let [a, b, c, d, e, f, g, h, i, j] = crate::config::override_fields(s, WHAT)?;
                    [a, b, c, d, e, f, g, h, i, j, 0, 0, 0, 0, 0]
                }
                13 => {
                    let [a, b, c, d, e, f, g, h, i, j, k, l, m] =
                        crate::config::override_fields(s, WHAT)?;
                    [a, b, c, d, e, f, g, h, i, j, k, l, m, 0, 0]
                }
                14 => {
                    let [a, b, c, d, e, f, g, h, i, j, k, l, m, n] =
                        crate::config::override_fields(s, WHAT)?;
                    [a, b, c, d, e, f, g, h, i, j, k, l, m, n, 0]
                }
                15 => crate::config::override_fields(s, WHAT)?,
                n => {
                    return Err(Error::invalid(
                        WHAT,
                        format!(
                            "expected 10, 13, 14 or 15 comma-separated integers, got {n} in `{s}`"
                        ),
                    ))
                }
            };
        let regs = |x: usize| {
            u32::try_from(x).map_err(|_| {
                Error::invalid(WHAT, format!("register count {x} out of range in `{s}`"))
            })
        };
        let flag = |x: usize, name: &str| crate::config::override_flag(x, name, WHAT);
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
            longest_first: flag(longest_first, "longest_first")?,
            tma_store: flag(tma_store, "tma_store")?,
            cross_tile: flag(cross_tile, "cross_tile")?,
            dynamic: flag(dynamic, "dynamic")?,
            uniform_desc: flag(uniform_desc, "uniform_desc")?,
        })
    }
}

/// The shared-memory budget of a launch, in bytes, tile by tile.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct SmemBudget {
    /// Q, [`Tiles::q_stages`] × (block_m, qk).
    pub q: usize,
    /// K ring, stages × (block_n, qk).
    pub k: usize,
    /// V ring, stages × (block_n, v).
    pub v: usize,
    /// mbarriers: Q full and empty, and per stage K full, V full, K empty, V empty and V tail
    /// (varlen) (8 bytes each); with [`Tiles::dynamic`] then per Q slot the 16-byte word slot
    /// that names its tile, and 16 bytes for the producer's varlen cursor.
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

    /// Shared memory, tile by tile, for padded head dims of 16-bit elements.
    pub fn smem(&self, dims: impl Into<Dims>) -> SmemBudget {
        self.smem_elem(dims, 2)
    }

    /// Shared memory, tile by tile, for elements of `elem_bytes` (2, or 1 for e4m3, whose V
    /// tile is Vᵀ: `dims.v` rows of `block_n` keys, the same bytes).
    pub fn smem_elem(&self, dims: impl Into<Dims>, elem_bytes: usize) -> SmemBudget {
        let dims = dims.into();
        self.smem_with(dims, self.q_stages_elem(dims, elem_bytes), elem_bytes)
    }

    fn smem_with(&self, dims: Dims, q_stages: usize, elem_bytes: usize) -> SmemBudget {
        let tile =
            |rows: usize, width: usize| (rows * width * elem_bytes).next_multiple_of(TILE_ALIGN);
        SmemBudget {
            q: q_stages * tile(self.block_m(), dims.qk),
            k: self.stages * tile(self.block_n, dims.qk),
            v: self.stages * tile(self.block_n, dims.v),
            barriers: 8 * (2 * q_stages + 5 * self.stages)
                + if self.dynamic { 16 * (q_stages + 1) } else { 0 },
            align_slack: TILE_ALIGN,
        }
    }

    /// Q slots: two where they fit in a Hopper block's shared memory (a persistent CTA then loads
    /// its next tile's Q during the current one), else one.
    pub fn q_stages(&self, dims: impl Into<Dims>) -> usize {
        self.q_stages_elem(dims, 2)
    }

    /// [`Tiles::q_stages`] for elements of `elem_bytes`.
    pub fn q_stages_elem(&self, dims: impl Into<Dims>, elem_bytes: usize) -> usize {
        let limit = crate::arch::H100.max_smem_per_block() as usize;
        if self.smem_with(dims.into(), 2, elem_bytes).total() <= limit {
            2
        } else {
            1
        }
    }

    /// Registers of the CTA after `setmaxnreg`: a warpgroup's worth at the producer's count and
    /// at each consumer's. They must fit the launch allocation, or a warpgroup's
    /// `setmaxnreg.inc` waits forever.
    pub fn registers(&self) -> u32 {
        WARPGROUP_THREADS as u32
            * (self.producer_regs + self.consumer_wgs as u32 * self.consumer_regs)
    }

    /// Registers per thread a CTA is launched with: the kernel's launch bounds (one CTA of
    /// [`Tiles::threads`] per SM) let ptxas give each thread the SM's file divided by the
    /// threads, in steps of 8, at most 248 (255 is the per-thread limit); `setmaxnreg` then moves
    /// them between warpgroups.
    pub fn launch_regs(&self, arch: &GpuArch) -> u32 {
        (arch.registers_per_sm / self.threads() as u32).min(255) / 8 * 8
    }

    /// Operand registers per consumer thread: the f32 accumulators S (64 × block_n) and O
    /// (64 × the V width) and the packed 16-bit P (64 × block_n), spread over 128 threads. With
    /// the intra-warpgroup overlap all three are live at once.
    pub fn accumulator_regs(&self, dims: impl Into<Dims>) -> u32 {
        self.accumulator_regs_elem(dims, 2)
    }

    /// [`Tiles::accumulator_regs`] for operands of `elem_bytes`: e4m3 packs four P values per
    /// register, and without the intra-warpgroup overlap its S is dead once P is packed, so S
    /// and O bound the count (the 16-bit count keeps P beside them, as it was measured).
    pub fn accumulator_regs_elem(&self, dims: impl Into<Dims>, elem_bytes: usize) -> u32 {
        let f32s = ROWS_PER_CONSUMER * (self.block_n + dims.into().v) / WARPGROUP_THREADS;
        let p = ROWS_PER_CONSUMER * self.block_n * elem_bytes / (4 * WARPGROUP_THREADS);
        if elem_bytes == 1 && !self.intra_wg_overlap {
            return f32s as u32;
        }
        (f32s + p) as u32
    }

    /// Checks the tiles against the kernel's rules and the GPU's limits, naming each violation.
    pub fn check(&self, dims: impl Into<Dims>, arch: &GpuArch) -> Result<()> {
        self.check_elem(dims, arch, 2)
    }

    /// [`Tiles::check`] for operands of `elem_bytes` (2, or 1: the e4m3 kernel, whose Q and K
    /// tiles are whole 128-byte slabs of 128 elements, Vᵀ `dims.v` rows in slabs of 128 keys,
    /// and O stored plainly).
    pub fn check_elem(
        &self,
        dims: impl Into<Dims>,
        arch: &GpuArch,
        elem_bytes: usize,
    ) -> Result<()> {
        let dims = dims.into();
        let bad = |why: String| {
            Err(Error::invalid(
                "tiles",
                format!("{self:?} for head_dim {dims}: {why}"),
            ))
        };
        if arch.family != Family::Hopper {
            return bad(format!(
                "{} is not a Hopper GPU (wgmma and setmaxnreg are sm_90a)",
                arch.name
            ));
        }
        if !HEAD_DIMS.contains(&dims.qk) || !HEAD_DIMS.contains(&dims.v) {
            return bad(format!("tile widths must be among {HEAD_DIMS:?}"));
        }
        if dims.v > dims.qk {
            return bad(format!(
                "V's tile width {} must not exceed Q's {} (O is staged in a Q slot)",
                dims.v, dims.qk
            ));
        }
        if !(1..=3).contains(&self.consumer_wgs) {
            return bad("consumer_wgs must be 1 to 3".into());
        }
        if elem_bytes == 1 {
            if !dims.qk.is_multiple_of(FP8_SLAB_ELEMS) {
                return bad(format!(
                    "e4m3 Q and K tiles are whole {FP8_SLAB_ELEMS}-element slabs (widths 128 or 256)"
                ));
            }
            if !self.block_n.is_multiple_of(FP8_SLAB_ELEMS) {
                return bad(format!(
                    "e4m3 key blocks are whole {FP8_SLAB_ELEMS}-key slabs of Vᵀ (128 or 256)"
                ));
            }
            if self.lazy_rescale {
                return bad(
                    "the e4m3 kernel scales P by 2^8 into e4m3's range, which needs the exact row max (no lazy rescale)"
                        .into(),
                );
            }
            if self.tma_store || self.cross_tile {
                return bad(
                    "the e4m3 kernel stores its 16-bit O plainly (a Q slot of e4m3 is too narrow to stage it), without the cross-tile overlap"
                        .into(),
                );
            }
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
        if self.cross_tile && !(self.persistent && self.intra_wg_overlap) {
            return bad(
                "the cross-tile overlap carries the next tile's first S through the intra-warpgroup overlap's loop of a persistent CTA: it needs persistent and overlap on"
                    .into(),
            );
        }
        if self.dynamic && !self.persistent {
            return bad(
                "the dynamic schedule hands tiles to persistent CTAs: it needs persistent on"
                    .into(),
            );
        }
        if self.cross_tile && dims == sq(192) {
            return bad(
                "the cross-tile overlap spills at d192 (the next tile's S beside this tile's 192-column O: 200 bytes and serialised wgmma with ptxas 13.0, 2026-12-03)"
                    .into(),
            );
        }
        if self.cross_tile && self.tma_store && self.q_stages(dims) < 2 {
            return bad(format!(
                "the cross-tile overlap with the TMA-store epilogue needs two Q slots (the next tile's Q loads while this tile's O sits in its slot), and head_dim {dims} with block_n {} fits one",
                self.block_n
            ));
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
        let total = self.registers();
        let launched = threads as u32 * self.launch_regs(arch);
        if total > launched {
            return bad(format!(
                "{total} registers (128 × ({} + {} × {})) exceed the {launched} the CTA is launched with ({threads} threads × {})",
                self.producer_regs, self.consumer_wgs, self.consumer_regs, self.launch_regs(arch)
            ));
        }
        let acc = self.accumulator_regs_elem(dims, elem_bytes);
        let need = acc + CONSUMER_REG_MARGIN;
        if need > self.consumer_regs {
            return bad(format!(
                "consumers need about {need} registers (S and O accumulators {acc} + margin {CONSUMER_REG_MARGIN}), budget {}",
                self.consumer_regs
            ));
        }
        let smem = self.smem_elem(dims, elem_bytes).total();
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

pub(crate) const fn t(
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
        longest_first: false,
        tma_store: false,
        cross_tile: false,
        dynamic: false,
        uniform_desc: true,
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
/// diagonal blocks waste more); with the TMA-store epilogue (2026-12-01, commit 657bd8e)
/// 128-key blocks lead at 4k again (+3% non-causal, +6% causal over 176 with the plain store),
/// so 176 is taken from 8k keys; two stages beat three; the intra-warpgroup overlap gains 2–7% at
/// d128 and d256 and loses at d64; ping-pong is within ±3%, conditional rescaling and the
/// polynomial exponentials lose 2–5% at d128/d256 and 8–28% at d64 (the softmax is off the
/// critical path once it overlaps), so those are off.
///
/// Each candidate is taken only for at least its `min_keys` keys per sequence.
/// d192 (added 2026-12-03): 112-key blocks, the widest whose two K/V stages fit beside one
/// 48 KiB Q slot (FlashAttention-3's choice too); the MLA prefill shape 192/128 has room for
/// 128-key blocks, its V being narrower. A V narrower than Q/K without its own entry takes the
/// entries of its Q/K width.
pub(crate) const CANDIDATES: [(Dims, &[(Tiles, usize)]); 5] = [
    (
        sq(64),
        &[
            (t(128, 3, 2, 32, 160, false), 0),
            (t(128, 2, 2, 40, 232, false), 0),
        ],
    ),
    (
        sq(128),
        &[
            (t(176, 2, 2, 40, 232, true), 8192),
            (t(128, 2, 2, 40, 232, true), 0),
        ],
    ),
    (sq(192), &[(t(112, 2, 2, 40, 232, true), 0)]),
    (
        Dims { qk: 192, v: 128 },
        &[(t(128, 2, 2, 40, 232, true), 0)],
    ),
    (sq(256), &[(t(80, 2, 2, 40, 232, true), 0)]),
];

const fn sq(d: usize) -> Dims {
    Dims { qk: d, v: d }
}

/// Tiles for padded head dims on one GPU: the first candidate that fits, or `None`.
pub fn tiles(arch: &GpuArch, dims: impl Into<Dims>) -> Option<Tiles> {
    fitting(arch, dims.into()).next()
}

/// The fitting candidates of padded head dims, in order, with their `min_keys`: the entry of
/// exactly these dims, else (a V narrower than Q/K) the square entry of the Q/K width.
pub(crate) fn fitting_with_min_keys(
    arch: &GpuArch,
    dims: Dims,
) -> impl Iterator<Item = (Tiles, usize)> + '_ {
    let key = if CANDIDATES.iter().any(|(d, _)| *d == dims) {
        dims
    } else {
        sq(dims.qk)
    };
    CANDIDATES
        .iter()
        .filter(move |(d, _)| *d == key)
        .flat_map(|(_, c)| c.iter().copied())
        .filter(move |(t, _)| t.check(dims, arch).is_ok())
}

pub(crate) fn fitting(arch: &GpuArch, dims: Dims) -> impl Iterator<Item = Tiles> + '_ {
    fitting_with_min_keys(arch, dims).map(|(t, _)| t)
}

/// The padded dims of every entry of the tile table.
pub fn planned_dims() -> impl Iterator<Item = Dims> {
    CANDIDATES.iter().map(|(d, _)| *d)
}

/// Tiles for a problem with `seqlen_q` query rows and `seqlen_k` keys per sequence (the longest,
/// in a varlen batch): among the fitting candidates taken for `seqlen_k` keys, the first whose
/// padding (rows computed past the end of the last query block) is within 5% of the sequence of
/// the least padding any of them has, with the persistent launch for at most
/// [`PERSISTENT_MAX_M_BLOCKS`] query blocks. At d64 this keeps 192-row tiles for 4k and 16k
/// tokens but takes 128 rows at 1k, where a 192-row tile would be a third full: measured on an
/// H200 (docs/perf.md), 1k causal 273 against 233 TFLOP/s. At d128, 176-key blocks from 8k keys.
/// Every choice has the TMA-store epilogue on.
pub fn tiles_for(
    arch: &GpuArch,
    dims: impl Into<Dims>,
    seqlen_q: usize,
    seqlen_k: usize,
) -> Option<Tiles> {
    tiles_among(arch, dims.into(), seqlen_q, seqlen_k, |_| true)
}

/// The dynamic schedule's tiles for a varlen batch whose longest sequence has `seqlen_q` query
/// rows and `seqlen_k` keys: [`tiles_for`] among the candidates of at most two consumer
/// warpgroups, persistent, dynamic, with the plain store. With three (d64's 192-row tiles) the
/// producer warpgroup has 32 registers, and the varlen producer's tile cursor spills 12 bytes
/// there (ptxas 13.0, 2026-12-04). [`plan`] takes these tiles for every varlen batch.
pub fn varlen_tiles(
    arch: &GpuArch,
    dims: impl Into<Dims>,
    seqlen_q: usize,
    seqlen_k: usize,
) -> Option<Tiles> {
    let mut t = tiles_among(arch, dims.into(), seqlen_q, seqlen_k, |t| {
        t.consumer_wgs <= MAX_DYNAMIC_VARLEN_CONSUMERS
    })?;
    t.persistent = true;
    t.dynamic = true;
    t.tma_store = false;
    Some(t)
}

/// Tiles for a causal fixed-length problem: at d64 (the padded width) and up to
/// [`CAUSAL_DYNAMIC_MAX_ROWS`] query rows, the dynamic schedule over two consumer warpgroups'
/// 128-row tiles, with the TMA store; otherwise [`tiles_for`]. Measured on an H100
/// (2026-12-06, `bench/sweep.py`, 3 interleaved rounds, uniform descriptors on; docs/perf.md
/// "Varlen and the dynamic schedule"): against the three-consumer static tiles, d64 causal +18%
/// at 1k and +35% at 2k (where 192-row tiles walk 11 blocks badly), −6% at 4k and 16k; d128
/// causal ties everywhere and d256 causal loses 3–5%, so they keep [`tiles_for`]'s.
pub fn causal_tiles(
    arch: &GpuArch,
    dims: impl Into<Dims>,
    seqlen_q: usize,
    seqlen_k: usize,
) -> Option<Tiles> {
    let dims = dims.into();
    if dims != sq(64) || seqlen_q > CAUSAL_DYNAMIC_MAX_ROWS {
        return tiles_for(arch, dims, seqlen_q, seqlen_k);
    }
    let mut t = tiles_among(arch, dims, seqlen_q, seqlen_k, |t| t.consumer_wgs <= 2)?;
    t.persistent = true;
    t.dynamic = true;
    Some(t)
}

/// Longest causal d64 sequence (query rows) that takes the dynamic schedule ([`causal_tiles`]).
pub const CAUSAL_DYNAMIC_MAX_ROWS: usize = 2048;

/// Most consumer warpgroups of a varlen launch on the dynamic schedule ([`varlen_tiles`]).
pub const MAX_DYNAMIC_VARLEN_CONSUMERS: usize = 2;

fn tiles_among(
    arch: &GpuArch,
    dims: Dims,
    seqlen_q: usize,
    seqlen_k: usize,
    allow: impl Fn(&Tiles) -> bool,
) -> Option<Tiles> {
    let taken = || {
        fitting_with_min_keys(arch, dims)
            .filter(|&(_, min_keys)| seqlen_k >= min_keys)
            .map(|(t, _)| t)
            .filter(|t| allow(t))
    };
    let pad = |t: &Tiles| seqlen_q.div_ceil(t.block_m()) * t.block_m() - seqlen_q;
    let least = taken().map(|t| pad(&t)).min()?;
    let mut t = taken().find(|t| pad(t) <= least + seqlen_q / 20)?;
    t.persistent = seqlen_q.div_ceil(t.block_m()) <= PERSISTENT_MAX_M_BLOCKS;
    // The TMA-store epilogue (`plan` turns it off for varlen batches): measured on an
    // H200 against the plain store (docs/perf.md, 2026-12-01, commit 657bd8e), +8 to +15% at
    // 1k tokens, +3 to +8% at 4k, +1 to +5% at d256 16k, and a tie at d64/d128 16k (within 1%).
    t.tma_store = true;
    Some(t)
}
