//! The Hopper plan as a reader sees it (`fa4 plan --arch sm90`): tiles, the role table,
//! registers and shared memory, and for e4m3 inputs the Vᵀ pass and its scratch.

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
    roles_elem(tiles, dims, 2)
}

/// [`roles`] for operands of `elem_bytes` (1: the e4m3 kernel, whose ring holds K and Vᵀ and
/// whose P is scaled by 2^8 into e4m3 before P·V).
pub fn roles_elem(tiles: &Tiles, dims: impl Into<Dims>, elem_bytes: usize) -> Vec<Role> {
    let padded = dims.into();
    let (v, softmax) = if elem_bytes == 1 {
        ("Vᵀ", "softmax (P × 2^8 in e4m3)")
    } else {
        ("V", "softmax")
    };
    let mut roles = vec![Role {
        warpgroup: 0,
        role: "producer",
        work: format!(
            "one thread issues TMA loads: each tile's Q ({} slot(s)), then K and {v} into a {}-stage ring",
            tiles.q_stages_elem(padded, elem_bytes),
            tiles.stages
        ),
        registers: tiles.producer_regs,
    }];
    for w in 0..tiles.consumer_wgs {
        roles.push(Role {
            warpgroup: w + 1,
            role: "consumer",
            work: format!(
                "query rows {}..{}: wgmma S = Q·Kᵀ (64×{}), {softmax}, wgmma O += P·V (64×{})",
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

/// The e4m3 kernel's Vᵀ pass ([`fp8::VT_ENTRY`], launched before the forward on its stream) and
/// the scratch of one call, per (sequence, KV head): the Vᵀ buffer's columns and the gathered
/// descales ([`fp8::Fp8Plan`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VtPlan {
    /// The pass's entry point in the forward's module.
    pub entry: &'static str,
    /// Threads per CTA.
    pub threads: usize,
    /// Vᵀ columns (keys) per CTA: one CTA per chunk and KV head.
    pub chunk: usize,
    /// Static shared memory per CTA ([`fp8::vt_smem_bytes`]).
    pub smem_bytes: usize,
    /// Rows of Vᵀ per KV head: the problem's head_dim_v.
    pub rows: usize,
    /// Each sequence's keys are padded with zero columns to a multiple of this (the key block).
    pub key_block: usize,
    /// Vᵀ columns of one sequence of the planned length (`None`: no length given).
    pub seq_cols: Option<usize>,
    /// Vᵀ bytes per (sequence, KV head): `rows × seq_cols` (`None`: no length given).
    pub vt_bytes: Option<usize>,
    /// Bytes per (sequence, KV head) of the gathered descales (Q's, K's and V's, f32).
    pub descale_bytes: usize,
}

impl VtPlan {
    /// The pass of an e4m3 spec, its scratch sized for one sequence of `keys` keys.
    pub fn new(spec: &KernelSpec, keys: Option<usize>) -> VtPlan {
        let key_block = spec.tiles.block_n;
        let seq_cols = keys.map(|n| n.next_multiple_of(key_block));
        VtPlan {
            entry: fp8::VT_ENTRY,
            threads: fp8::VT_THREADS,
            chunk: fp8::VT_CHUNK,
            smem_bytes: fp8::vt_smem_bytes(spec.dim_v),
            rows: spec.dim_v,
            key_block,
            seq_cols,
            vt_bytes: seq_cols.map(|c| c * spec.dim_v),
            descale_bytes: 3 * std::mem::size_of::<f32>(),
        }
    }
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
    /// e4m3 inputs ([`Sm90Plan::for_fp8`]): the Vᵀ pass and its scratch; absent for 16-bit ones.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fp8: Option<VtPlan>,
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
            fp8: None,
        }
    }

    /// The e4m3 kernel's launch ([`fp8::plan_fp8`]) as a reader sees it: its tiles, roles and
    /// budgets for 1-byte operands (Q and K in 128-element slabs, V read as Vᵀ), and the Vᵀ pass
    /// with the scratch of one sequence of `keys` keys (`None`: per key only).
    pub fn for_fp8(arch: &GpuArch, f: &fp8::Fp8Plan, keys: Option<usize>) -> Sm90Plan {
        let spec = &f.plan.spec;
        let (dims, tiles) = (spec.dims(), spec.tiles);
        let smem = tiles.smem_elem(dims, spec.elem_bytes());
        Sm90Plan {
            arch: arch.name,
            head_dim: spec.dim,
            head_dim_v: spec.dim_v,
            padded_head_dim: dims.qk,
            padded_head_dim_v: dims.v,
            block_m: tiles.block_m(),
            tiles,
            threads: tiles.threads(),
            roles: roles_elem(&tiles, dims, spec.elem_bytes()),
            smem,
            smem_total: smem.total(),
            smem_limit: arch.max_smem_per_block() as usize,
            accumulator_regs: tiles.accumulator_regs_elem(dims, spec.elem_bytes()),
            launch_regs: tiles.launch_regs(arch),
            tma_box: (dims.qk / FP8_SLAB_ELEMS, tiles.block_n),
            // V reaches the forward as Vᵀ (a map over the scratch) and O is stored plainly.
            slab_maps: (spec.slab_maps_qk(), false),
            varlen: spec.varlen,
            fp8: Some(VtPlan::new(spec, keys)),
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
pub const ANY_LENGTH: usize = 1 << 20;

impl fmt::Display for Sm90Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let t = &self.tiles;
        let vt = self.fp8.as_ref();
        match vt {
            Some(_) => writeln!(
                f,
                "Hopper (sm_90a) e4m3 forward plan for {}: Q, K and V e4m3 (k32 wgmma), O bf16 or fp16",
                self.arch
            )?,
            None => writeln!(f, "Hopper (sm_90a) forward plan for {}", self.arch)?,
        }
        writeln!(
            f,
            "  head_dim {} (compiled for {}), tile {}×{} (query rows × keys), {} K/{} stages",
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
            t.stages,
            if vt.is_some() { "Vᵀ" } else { "V" }
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
            "  shared memory: Q {} + K {} + {} {} + barriers {} + alignment {} = {} of {} bytes",
            s.q,
            s.k,
            if vt.is_some() { "Vᵀ" } else { "V" },
            s.v,
            s.barriers,
            s.align_slack,
            self.smem_total,
            self.smem_limit
        )?;
        let maps = |slab: bool| {
            if slab {
                "a 4-D map over the real columns, one box per slab (the rest of the tile arrives as zeros)"
            } else {
                "a 5-D map, one box per tile"
            }
        };
        match vt {
            Some(vt) => {
                writeln!(
                    f,
                    "  TMA: {} slab(s) of {FP8_SLAB_ELEMS} columns (128-byte swizzle) per Q/K tile, {} rows per K box; Q/K: {}; Vᵀ: a 3-D map over the scratch, boxes of {} rows × {FP8_SLAB_ELEMS} keys; O: stored from registers",
                    self.tma_box.0,
                    self.tma_box.1,
                    maps(self.slab_maps.0),
                    vt.rows
                )?;
                writeln!(
                    f,
                    "  Vᵀ pass ({}, before the forward on its stream): one CTA of {} threads per ({}-key chunk, KV head), {} bytes of static shared memory; writes V transposed (8-bit wgmma operands are K-major only) and gathers the descales",
                    vt.entry, vt.threads, vt.chunk, vt.smem_bytes
                )?;
                match (vt.seq_cols, vt.vt_bytes) {
                    (Some(cols), Some(bytes)) => writeln!(
                        f,
                        "  scratch per (sequence, KV head): Vᵀ {} rows × {cols} columns (the keys padded with zeros to {}-key blocks) = {bytes} bytes, descales {} bytes",
                        vt.rows, vt.key_block, vt.descale_bytes
                    )?,
                    _ => writeln!(
                        f,
                        "  scratch per (sequence, KV head): Vᵀ {} bytes per key (the keys padded with zeros to {}-key blocks), descales {} bytes",
                        vt.rows, vt.key_block, vt.descale_bytes
                    )?,
                }
            }
            None => writeln!(
                f,
                "  TMA: {} slab(s) of 64 columns (128-byte swizzle) per Q/K tile, {} rows per K/V box; Q/K: {}; V/O: {}",
                self.tma_box.0,
                self.tma_box.1,
                maps(self.slab_maps.0),
                maps(self.slab_maps.1)
            )?,
        }
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
