//! The Hopper plan as a reader sees it (`fa4 plan --arch sm90`): tiles, the role table,
//! registers and shared memory.

use super::*;

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

/// The kernel's role table, one row per warpgroup: the planner's single list of roles, which
/// the prelude emits as `Role` and `role_of(warp)` ([`KernelSpec::prelude`]) and the report
/// prints.
pub fn roles(tiles: &Tiles, dims: impl Into<Dims>) -> Vec<Role> {
    let padded = dims.into();
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
                "query rows {}..{}: wgmma S = Q·Kᵀ (64×{}), softmax, wgmma O += P·V (64×{})",
                w * ROWS_PER_CONSUMER,
                (w + 1) * ROWS_PER_CONSUMER,
                tiles.block_n,
                padded.v
            ),
            registers: tiles.consumer_regs,
        });
    }
    roles
}

/// The Hopper plan for a head dim and dtype: tiles, roles and budgets.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Sm90Plan {
    /// The GPU planned for.
    pub arch: &'static str,
    /// The problem's head dim (of Q and K).
    pub head_dim: usize,
    /// The problem's head dim of V and O.
    pub head_dim_v: usize,
    /// The Q/K tile width the kernel is compiled for ([`padded_head_dim`]).
    pub padded_head_dim: usize,
    /// The V/O tile width.
    pub padded_head_dim_v: usize,
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
    /// TMA boxes per tile: (64-element head-dim slabs of Q/K, rows of a K/V box).
    pub tma_box: (usize, usize),
    /// Q/K and V/O tensors narrower than their tiles, loaded (and stored) slab by slab through
    /// 4-D maps over their real columns.
    pub slab_maps: (bool, bool),
    /// Planned for a varlen batch (the longest sequence's query blocks for every sequence).
    pub varlen: bool,
}

impl Sm90Plan {
    /// Plans head dim `head_dim` of 16-bit elements (`dtype_size` 2) on `arch`, V as wide.
    pub fn new(arch: &GpuArch, head_dim: usize, dtype_size: usize) -> Result<Sm90Plan> {
        Self::with_dims(arch, head_dim, head_dim, dtype_size, None)
    }

    /// As [`Sm90Plan::new`], with the tiles a fixed-length problem of `seqlen_q` query rows per
    /// sequence gets ([`tiles_for`]: the tile height and the persistent launch).
    pub fn for_seqlen(
        arch: &GpuArch,
        head_dim: usize,
        dtype_size: usize,
        seqlen_q: usize,
    ) -> Result<Sm90Plan> {
        Self::with_dims(arch, head_dim, head_dim, dtype_size, Some(seqlen_q))
    }

    /// Plans head dims `head_dim` (Q, K) and `head_dim_v` (V, O) of `dtype_size`-byte elements
    /// on `arch`, with the tiles of `seqlen_q` query rows per sequence where given. Errors name
    /// `depth` and `depth-v` (`fa4 plan`'s flags).
    pub fn with_dims(
        arch: &GpuArch,
        head_dim: usize,
        head_dim_v: usize,
        dtype_size: usize,
        seqlen_q: Option<usize>,
    ) -> Result<Sm90Plan> {
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
        let pad = |d: usize, flag: &'static str| {
            padded_head_dim(d).ok_or_else(|| {
                Error::invalid(
                    flag,
                    format!("head dim {d}: the Hopper kernel takes multiples of 8 up to 256"),
                )
            })
        };
        let dims = Dims {
            qk: pad(head_dim, "depth")?,
            v: pad(head_dim_v, "depth-v")?,
        };
        if dims.v > dims.qk {
            return Err(Error::invalid(
                "depth-v",
                format!(
                    "head_dim_v {head_dim_v} pads to {}, wider than head_dim {head_dim}'s {}: the Hopper kernel stages O in a Q slot",
                    dims.v, dims.qk
                ),
            ));
        }
        let generic = tiles(arch, dims).ok_or_else(|| {
            Error::invalid(
                "depth",
                format!("no Hopper tiles fit head_dim {dims} on {}", arch.name),
            )
        })?;
        let tiles = seqlen_q
            .and_then(|sq| tiles_for(arch, dims, sq, sq))
            .unwrap_or(generic);
        let mut plan = Self::with_tiles(arch, head_dim, dims, tiles);
        plan.head_dim_v = head_dim_v;
        plan.slab_maps = (head_dim != dims.qk, head_dim_v != dims.v);
        Ok(plan)
    }

    fn with_tiles(arch: &GpuArch, head_dim: usize, padded: Dims, tiles: Tiles) -> Sm90Plan {
        let roles = roles(&tiles, padded);
        let smem = tiles.smem(padded);
        Sm90Plan {
            arch: arch.name,
            head_dim,
            head_dim_v: head_dim,
            padded_head_dim: padded.qk,
            padded_head_dim_v: padded.v,
            block_m: tiles.block_m(),
            tiles,
            threads: tiles.threads(),
            roles,
            smem,
            smem_total: smem.total(),
            smem_limit: arch.max_smem_per_block() as usize,
            accumulator_regs: tiles.accumulator_regs(padded),
            launch_regs: tiles.launch_regs(arch),
            tma_box: (padded.qk / SWIZZLE_ELEMS, tiles.block_n),
            slab_maps: (false, false),
            varlen: false,
        }
    }

    /// The plan for a varlen batch whose longest sequence has `seqlen_q` rows (unknown: the
    /// tile table's first entry, as [`Sm90Plan::new`]): the dynamic schedule's tiles
    /// ([`varlen_tiles`]), as [`plan`] takes them.
    pub fn for_varlen(self, arch: &GpuArch, seqlen_q: Option<usize>) -> Sm90Plan {
        let dims = Dims {
            qk: self.padded_head_dim,
            v: self.padded_head_dim_v,
        };
        let sq = seqlen_q.unwrap_or(ANY_LENGTH);
        let plan = match varlen_tiles(arch, dims, sq, sq) {
            Some(tiles) => Sm90Plan {
                head_dim_v: self.head_dim_v,
                slab_maps: self.slab_maps,
                ..Self::with_tiles(arch, self.head_dim, dims, tiles)
            },
            None => self,
        };
        Sm90Plan {
            varlen: true,
            ..plan
        }
    }

    /// The plan for a causal fixed-length problem of `seqlen_q` rows: [`causal_tiles`] where
    /// they differ from [`tiles_for`]'s, as [`plan`] takes them.
    pub fn for_causal(self, arch: &GpuArch, seqlen_q: Option<usize>) -> Sm90Plan {
        let dims = Dims {
            qk: self.padded_head_dim,
            v: self.padded_head_dim_v,
        };
        let sq = seqlen_q.unwrap_or(ANY_LENGTH);
        match causal_tiles(arch, dims, sq, sq) {
            Some(tiles) if Some(tiles) != tiles_for(arch, dims, sq, sq) => Sm90Plan {
                head_dim_v: self.head_dim_v,
                slab_maps: self.slab_maps,
                ..Self::with_tiles(arch, self.head_dim, dims, tiles)
            },
            _ => self,
        }
    }

    /// The machine-readable form (`fa4 plan --arch sm90 --json`).
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("plain data serializes")
    }
}

/// A sequence length long enough that every tile entry's minimum key count is met (the plan of
/// an unknown length).
const ANY_LENGTH: usize = 1 << 20;

impl fmt::Display for Sm90Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let t = &self.tiles;
        writeln!(f, "Hopper (sm_90a) forward plan for {}", self.arch)?;
        writeln!(
            f,
            "  head_dim {} (compiled for {}), tile {}×{} (query rows × keys), {} K/V stages",
            Dims {
                qk: self.head_dim,
                v: self.head_dim_v
            },
            Dims {
                qk: self.padded_head_dim,
                v: self.padded_head_dim_v
            },
            self.block_m,
            t.block_n,
            t.stages
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
                "    wg{} {:<8} {:>3} registers  warps {}-{} (ROLE_{}): {}",
                r.warpgroup,
                r.role,
                r.registers,
                4 * r.warpgroup,
                4 * r.warpgroup + 3,
                r.role.to_ascii_uppercase(),
                r.work
            )?;
        }
        writeln!(
            f,
            "  registers: 128 × ({} + {} × {}) = {} of the {} launched ({} threads × {}); consumer accumulators {} per thread (+{} margin)",
            t.producer_regs,
            t.consumer_wgs,
            t.consumer_regs,
            t.registers(),
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
        let maps = |slab: bool| {
            if slab {
                "a 4-D map over the real columns, one box per slab (the rest of the tile arrives as zeros)"
            } else {
                "a 5-D map, one box per tile"
            }
        };
        writeln!(
            f,
            "  TMA: {} slab(s) of 64 columns (128-byte swizzle) per Q/K tile, {} rows per K/V box; Q/K: {}; V/O: {}",
            self.tma_box.0,
            self.tma_box.1,
            maps(self.slab_maps.0),
            maps(self.slab_maps.1)
        )?;
        let on = |b: bool| if b { "on" } else { "off" };
        writeln!(
            f,
            "  softmax/MMA overlap in a warpgroup: {}; ping-pong between consumers: {}; conditional rescaling: {}",
            on(t.intra_wg_overlap),
            on(t.pingpong),
            on(t.lazy_rescale)
        )?;
        writeln!(
            f,
            "  longest-first tile order: {}; TMA-store epilogue: {}; cross-tile overlap: {}; uniform wgmma descriptors: {}",
            on(t.longest_first),
            on(t.tma_store),
            on(t.cross_tile),
            on(t.uniform_desc)
        )?;
        write!(
            f,
            "  exponentials on the FMA units: {} of 8; launch: {}",
            t.poly_exp2,
            if t.persistent && t.dynamic {
                "persistent, dynamic (one CTA per SM; each takes its next tile from a counter as it finishes, a varlen batch's tiles numbered over each sequence's own query blocks)"
                    .to_string()
            } else if t.persistent {
                "persistent (one CTA per SM walks the tiles in pairs of equal causal cost)"
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
