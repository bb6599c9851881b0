//! What a Hopper kernel is compiled for ([`KernelSpec`]): its prelude, its name, and every
//! variant the planner can emit.

use super::wgmma::{OperandA, Wgmma};
use super::*;
use crate::config::prelude::{Prelude, RoleWarps};

/// What the Hopper kernel is specialised on: the compile-cache key (with the source hash and the
/// NVRTC version); the prelude and the generated `wgmma` wrappers are pure functions of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KernelSpec {
    /// NVRTC target: `sm_90a` (wgmma and setmaxnreg need the `a` target).
    pub target: &'static str,
    /// bf16 (true) or fp16 (false) storage; with `fp8`, O's type.
    pub bf16: bool,
    /// Q, K and V in e4m3 (`docs/attention.md`, "FP8 (e4m3) inputs"): k32 `wgmma`, tiles of
    /// 128-element slabs, V read transposed from the Vᵀ buffer that the module's
    /// `fa4_vt_fp8` entry writes, the descales folded into the softmax and the epilogue, O
    /// stored plainly in 16 bits ([`super::fp8`]).
    pub fp8: bool,
    /// Tile width of Q and K (one of [`HEAD_DIMS`]: the head dim, padded).
    pub head_dim: usize,
    /// Tile width of V and O (one of [`HEAD_DIMS`], at most `head_dim`).
    pub head_dim_v: usize,
    /// The problem's head dim of Q and K (a multiple of 8, at most `head_dim`). Narrower than
    /// the tile, Q and K get 4-D TMA maps over their real columns, one box per 64-column slab
    /// (the rest of the tile arrives as zeros), and Q·Kᵀ runs over `dim` rounded up to the k16
    /// step only.
    pub dim: usize,
    /// The problem's head dim of V and O (a multiple of 8, at most `head_dim_v`): the N of the
    /// P·V product, so O's accumulator holds exactly these columns; narrower than the tile, V
    /// and O get slab maps as Q and K do.
    pub dim_v: usize,
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
        self.tiles.smem_elem(self.dims(), self.elem_bytes()).total()
    }

    /// Bytes per Q, K and V element: 2, or 1 for e4m3.
    pub fn elem_bytes(&self) -> usize {
        if self.fp8 {
            1
        } else {
            2
        }
    }

    /// Elements per k step of the products: 16 (16-bit), 32 (e4m3).
    pub fn k_step(&self) -> usize {
        32 / self.elem_bytes()
    }

    /// Q and K are narrower than their tiles (slab maps).
    pub fn slab_maps_qk(&self) -> bool {
        self.dim != self.head_dim
    }

    /// V and O are narrower than their tiles (slab maps).
    pub fn slab_maps_v(&self) -> bool {
        self.dim_v != self.head_dim_v
    }

    /// The tile widths.
    pub fn dims(&self) -> Dims {
        Dims {
            qk: self.head_dim,
            v: self.head_dim_v,
        }
    }

    /// The kernel's entry point.
    pub fn entry(&self) -> &'static str {
        "fa4_fwd_sm90"
    }

    /// The module's entry points beside [`KernelSpec::entry`]: the exact fixup, and with `fp8`
    /// the Vᵀ pass.
    pub fn extra_entries(&self) -> &'static [&'static str] {
        if self.fp8 {
            &["fa4_exact_fixup", super::fp8::VT_ENTRY]
        } else {
            &["fa4_exact_fixup"]
        }
    }

    /// The constants the kernel source is compiled with: the tiles, the role table (from
    /// [`roles`], as `fa4 plan` prints it) and the named barriers.
    pub fn prelude(&self) -> String {
        let t = &self.tiles;
        Prelude::new("config::sm90", self)
            .int("HEAD_DIM", self.head_dim)
            .int("HEAD_DIM_V", self.head_dim_v)
            .flag("SLAB_MAPS_QK", self.slab_maps_qk())
            .flag("SLAB_MAPS_V", self.slab_maps_v())
            .int("QK_DIM", self.dim.next_multiple_of(self.k_step()))
            .int("O_DIM", self.dim_v)
            .int("BLOCK_M", t.block_m())
            .int("BLOCK_N", t.block_n)
            .int("CONSUMER_WGS", t.consumer_wgs)
            .int("STAGES", t.stages)
            .int("Q_STAGES", t.q_stages_elem(self.dims(), self.elem_bytes()))
            .int("PRODUCER_REGS", t.producer_regs)
            .int("CONSUMER_REGS", t.consumer_regs)
            .flag("LAZY_RESCALE", t.lazy_rescale)
            .flag("INTRA_WG_OVERLAP", t.intra_wg_overlap)
            .flag("PINGPONG", t.pingpong)
            .int("POLY_EXP2", t.poly_exp2)
            .flag("LONGEST_FIRST", t.longest_first)
            .flag("TMA_STORE", t.tma_store)
            .flag("CROSS_TILE", t.cross_tile)
            .flag("DYNAMIC", t.dynamic)
            .flag("UNIFORM_DESC", t.uniform_desc)
            .flag("IS_BF16", self.bf16)
            .flag("FP8", self.fp8)
            .flag("HAS_WINDOW", self.window)
            .flag("HAS_SOFTCAP", self.softcap)
            .flag("VARLEN", self.varlen)
            .define("FA4_SMEM_BYTES", self.smem_bytes())
            .roles(&role_warps(&roles(t, self.dims())))
            .int("FIRST_CONSUMER_WARP", WARPGROUP_THREADS / 32)
            .named_barriers(&NAMED_BARRIERS)
            .finish()
    }

    /// The `wgmma` wrappers the kernel calls ([`wgmma`]): `wgmma_ss`, S = Q·Kᵀ with
    /// N = `block_n`, both operands in shared memory; `wgmma_rs`, O += P·V with N = `head_dim`,
    /// P from registers and V MN-major (N = `dim_v`, V's real head dim); with the cross-tile overlap also `wgmma_rs_acc`, the
    /// same with an `accumulate` argument.
    pub fn wgmma_wrappers(&self) -> String {
        let s = Wgmma {
            name: "wgmma_ss",
            n: self.tiles.block_n,
            a: OperandA::Smem,
            bf16: self.bf16,
            b_transposed: false,
            e4m3: self.fp8,
        };
        // e4m3: Vᵀ is K-major, as the hardware wants 8-bit operands.
        let o = Wgmma {
            name: "wgmma_rs",
            n: self.dim_v,
            a: OperandA::Regs,
            bf16: self.bf16,
            b_transposed: !self.fp8,
            e4m3: self.fp8,
        };
        // The cross-tile overlap starts a tile's O with its first P·V (accumulate 0) instead of
        // zeroing it: a second definition of O in the persistent loop makes ptxas spill P and
        // serialise the wgmma pipeline (C7512; d128, 128-key blocks). Emitted for every variant
        // (an uncalled inline function adds no code), so that the kernel names it everywhere.
        let o_fresh = Wgmma {
            name: "wgmma_rs_acc",
            a: OperandA::RegsScaled,
            ..o
        }
        .wrapper();
        format!(
            "// generated by config::sm90: wgmma for N = {} (S) and N = {} (O)\n{}{}{o_fresh}",
            s.n,
            o.n,
            s.wrapper(),
            o.wrapper()
        )
    }
}

/// The Hopper kernel's named barriers, by id (`BAR_<name>` in the prelude): 0 is
/// `__syncthreads`; consumer warpgroup c waits for its turn to issue wgmma on `CONSUMER<c>_TURN`
/// (ping-pong), and gathers its 128 threads' O writes before the TMA store on `EPILOGUE<c>`;
/// with the dynamic schedule the readers of Q slot t's tile words arrive on `SLOT_FREE<t>`
/// before the producer rewrites them.
pub const NAMED_BARRIERS: [&str; 8] = [
    "SYNC_ALL",
    "CONSUMER0_TURN",
    "CONSUMER1_TURN",
    "EPILOGUE0",
    "EPILOGUE1",
    "EPILOGUE2",
    "SLOT_FREE0",
    "SLOT_FREE1",
];

/// The role table in warps: consecutive warpgroups of one role make one range.
pub fn role_warps(roles: &[Role]) -> Vec<RoleWarps> {
    let mut out: Vec<RoleWarps> = Vec::new();
    for r in roles {
        let warps = WARPGROUP_THREADS / 32;
        let name = r.role.to_ascii_uppercase();
        match out.last_mut() {
            Some(last) if last.name == name => last.warps += warps,
            _ => out.push(RoleWarps {
                name,
                first_warp: r.warpgroup * warps,
                warps,
            }),
        }
    }
    out
}

impl fmt::Display for KernelSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let t = &self.tiles;
        write!(
            f,
            "sm90-fwd {} {}{} d{}{} {}x{} c{} s{} r{}/{}{}{}{}{}{}{}{}{}{}{}{}{}{}",
            self.target,
            if self.fp8 { "e4m3->" } else { "" },
            if self.bf16 { "bf16" } else { "fp16" },
            self.dims(),
            if self.slab_maps_qk() || self.slab_maps_v() {
                format!(
                    " in {}",
                    Dims {
                        qk: self.dim,
                        v: self.dim_v
                    }
                )
            } else {
                String::new()
            },
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
            if t.longest_first {
                " longest-first"
            } else {
                ""
            },
            if t.tma_store { " tma-store" } else { "" },
            if t.cross_tile { " cross-tile" } else { "" },
            if t.dynamic { " dynamic" } else { "" },
            if t.uniform_desc { " uniform-desc" } else { "" },
            if self.window { " window" } else { "" },
            if self.softcap { " softcap" } else { "" },
            if self.varlen { " varlen" } else { "" }
        )
    }
}

/// Every spec the planner can emit for `arch` with tensors as wide as their tiles (for compile
/// tests and warm-up): each entry of the tile table × dtype × mask × softcap, fixed-length with
/// the TMA store, varlen on the dynamic schedule with the plain store (entries of at most
/// [`MAX_DYNAMIC_VARLEN_CONSUMERS`] consumer warpgroups: [`varlen_tiles`]), and the dynamic
/// schedule with the TMA store of the causal d64 tiles ([`causal_tiles`]). The persistent launch
/// changes only the grid (the dynamic schedule changes the kernel). The slab-map variants of
/// narrower tensors differ only in the producer's loads and the epilogue's stores;
/// [`slab_specs`] lists one per tile entry and varlen.
pub fn all_specs(arch: &GpuArch, target: &'static str) -> Vec<KernelSpec> {
    let mut out = Vec::new();
    // Every fitting candidate: `tiles_for` may pick any of them for a sequence length.
    for (dims, tiles) in planned_dims().flat_map(|d| fitting(arch, d).map(move |t| (d, t))) {
        let fixed = Tiles {
            tma_store: true,
            ..tiles
        };
        let dynamic = |tma_store| Tiles {
            persistent: true,
            dynamic: true,
            tma_store,
            ..tiles
        };
        // (varlen, causal only, tiles)
        let mut kinds = vec![(false, false, fixed)];
        if tiles.consumer_wgs <= MAX_DYNAMIC_VARLEN_CONSUMERS {
            kinds.push((true, false, dynamic(false)));
        }
        let short = CAUSAL_DYNAMIC_MAX_ROWS;
        let causal = causal_tiles(arch, dims, short, short);
        if causal.is_some_and(|c| c.dynamic && c.block_m() == tiles.block_m()) {
            kinds.push((false, true, dynamic(true)));
        }
        for (varlen, causal_only, tiles) in kinds {
            out.extend(
                crate::config::feature_variants()
                    .filter(|&(_, window, _)| window || !causal_only)
                    .map(|(bf16, window, softcap)| KernelSpec {
                        target,
                        bf16,
                        fp8: false,
                        head_dim: dims.qk,
                        head_dim_v: dims.v,
                        dim: dims.qk,
                        dim_v: dims.v,
                        window,
                        softcap,
                        varlen,
                        tiles,
                    }),
            );
        }
    }
    out
}

/// The slab-map variants (tensors narrower than their tiles, Q/K and V both: 40 columns less,
/// so that Q·Kᵀ ends inside a slab and inside a k16 step) of [`all_specs`]'s bf16 causal specs
/// without softcap, fixed-length and varlen.
pub fn slab_specs(arch: &GpuArch, target: &'static str) -> Vec<KernelSpec> {
    all_specs(arch, target)
        .into_iter()
        .filter(|s| s.bf16 && s.window && !s.softcap)
        .map(|s| KernelSpec {
            dim: s.head_dim - 40,
            dim_v: s.head_dim_v - 40,
            ..s
        })
        .collect()
}
