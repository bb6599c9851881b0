//! The e4m3 variant of the Hopper kernel (`docs/attention.md`, "FP8 (e4m3) inputs"): Q, K and V
//! are e4m3 bytes, O is bf16 or fp16.
//!
//! It is the same kernel ([`KernelSpec::fp8`]) on bytes: tiles are whole 128-byte slabs of 128
//! elements (head dims padded to 128 or 256), the products take k32 steps, and P·V reads Vᵀ,
//! because the hardware takes 8-bit `wgmma` operands K-major only. Vᵀ is written before the
//! launch by the module's second entry ([`VT_ENTRY`], `kernels/sm90/vt_fp8.cu`) into a buffer of
//! `[heads_kv][head_dim_v][columns]` bytes, each sequence's keys padded with zero columns to
//! whole key blocks ([`Fp8Plan::vt_cols`]); that pass reads V once and writes it once (at 16k
//! tokens, d128 and 16 heads: 32 MiB each way, about 20 µs of the forward's 2 ms at the goal's
//! rate). Key blocks are whole 128-key slabs of Vᵀ. O is stored plainly (an e4m3 Q slot is too
//! narrow to stage 16-bit O for the TMA store). The descales of a tile's (sequence, KV head)
//! fold into its score scale and O's epilogue factor.

use super::*;

/// The Vᵀ pass's entry point.
pub const VT_ENTRY: &str = "fa4_vt_fp8";
/// Threads per CTA of the Vᵀ pass (`VT_THREADS` in `vt_fp8.cu`).
pub const VT_THREADS: usize = 256;
/// Vᵀ columns per CTA of the Vᵀ pass (`VT_CHUNK`).
pub const VT_CHUNK: usize = 128;

/// Static shared memory of a Vᵀ pass CTA: [`VT_CHUNK`] staged V rows of `dim_v` bytes and one
/// more word each (`ROW_BYTES` in `vt_fp8.cu`: rows whose keys differ mod 32 fall in different
/// banks).
pub fn vt_smem_bytes(dim_v: usize) -> usize {
    VT_CHUNK * (dim_v + 4)
}

/// The e4m3 tile width of Q's and K's head dim: the next multiple of 128 (whole 128-byte slabs),
/// for multiples of 8 in 8..=256 (the Vᵀ pass reads V in 8-byte words); `None` otherwise.
pub fn fp8_padded_head_dim(d: usize) -> Option<usize> {
    (d > 0 && d <= 256 && d.is_multiple_of(8)).then(|| d.next_multiple_of(FP8_SLAB_ELEMS))
}

/// The e4m3 tile width of V's head dim: the next multiple of 64 (Vᵀ's rows; any multiple of 8
/// would do, the tile table keys on these), for multiples of 8 in 8..=256; `None` otherwise.
pub fn fp8_padded_head_dim_v(d: usize) -> Option<usize> {
    (d > 0 && d <= 256 && d.is_multiple_of(8)).then(|| d.next_multiple_of(64))
}

/// Tile candidates per e4m3 tile width, first that fits wins (each taken from `min_keys` keys
/// per sequence on). Operand registers: S (block_n / 2), O (d_v / 2) and P (block_n / 8, four
/// e4m3 per register); without the intra-warpgroup overlap S is dead once P is packed.
/// FlashAttention-3's fp8 tiles are 192 × 160 at d64, 128 × 224 at d128 and 128 × 128 at d256;
/// Vᵀ's 128-key slabs make this kernel's key blocks 128 or 256.
pub(crate) const FP8_CANDIDATES: [(Dims, &[(Tiles, usize)]); 4] = [
    // Head dims up to 64 (in 128-wide tiles, Q·Kᵀ over their own k32 steps): three consumer
    // warpgroups, 192 rows; varlen batches (the dynamic schedule takes at most two) two, without
    // the overlap (with it, the softcap variant spills 4 bytes: ptxas 13.0, 2026-12-06).
    (
        Dims { qk: 128, v: 64 },
        &[
            (t(128, 3, 2, 32, 160, false), 0),
            (t(128, 2, 2, 40, 232, false), 0),
        ],
    ),
    (
        Dims { qk: 128, v: 128 },
        &[
            (pingpong(t(256, 2, 2, 40, 232, false)), 4096),
            (t(128, 2, 2, 40, 232, true), 0),
        ],
    ),
    (
        Dims { qk: 256, v: 128 },
        &[(t(128, 2, 2, 40, 232, true), 0)],
    ),
    (
        Dims { qk: 256, v: 256 },
        &[(t(128, 2, 2, 40, 232, false), 0)],
    ),
];

/// The tiles with the consumer warpgroups taking turns to issue their products.
const fn pingpong(t: Tiles) -> Tiles {
    Tiles {
        pingpong: true,
        ..t
    }
}

/// The e4m3 table's candidates for padded dims (unchecked), for tests and sweeps that run each.
pub fn fp8_candidates(dims: Dims) -> Vec<Tiles> {
    FP8_CANDIDATES
        .iter()
        .filter(|(d, _)| *d == dims)
        .flat_map(|(_, c)| c.iter().map(|(t, _)| *t))
        .collect()
}

/// The fitting e4m3 candidates of padded dims, with their `min_keys`.
fn fitting_fp8(arch: &GpuArch, dims: Dims) -> impl Iterator<Item = (Tiles, usize)> + '_ {
    let key = if FP8_CANDIDATES.iter().any(|(d, _)| *d == dims) {
        dims
    } else {
        Dims {
            qk: dims.qk,
            v: dims.qk,
        }
    };
    FP8_CANDIDATES
        .iter()
        .filter(move |(d, _)| *d == key)
        .flat_map(|(_, c)| c.iter().copied())
        .filter(move |(t, _)| t.check_elem(dims, arch, 1).is_ok())
}

/// The e4m3 tiles for padded dims on one GPU (the first fitting candidate), or `None`.
pub fn fp8_tiles(arch: &GpuArch, dims: impl Into<Dims>) -> Option<Tiles> {
    fitting_fp8(arch, dims.into()).next().map(|(t, _)| t)
}

/// The padded e4m3 dims of every entry of the tile table.
pub fn fp8_planned_dims() -> impl Iterator<Item = Dims> {
    FP8_CANDIDATES.iter().map(|(d, _)| *d)
}

/// A planned e4m3 launch: the forward's plan and the Vᵀ buffer it reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fp8Plan {
    /// The forward (its spec has [`KernelSpec::fp8`]).
    pub plan: Plan,
    /// Columns of the Vᵀ buffer: every sequence's keys, each padded to whole key blocks (a
    /// multiple of [`VT_CHUNK`]).
    pub vt_cols: usize,
    /// Fixed-length batches: columns per sequence (`seqlen_k` padded to key blocks); 0 for varlen.
    pub vt_seq_keys: usize,
    /// Varlen batches: each sequence's first Vᵀ column, `batch + 1` entries; empty otherwise.
    pub cu_vt: Vec<i32>,
}

/// Why the e4m3 kernel does not run a problem on `arch` (the argument to blame and the reason),
/// or `None`.
pub fn fp8_uncovered_arg(arch: &GpuArch, p: &Problem) -> Option<(&'static str, String)> {
    if arch.family != Family::Hopper {
        return Some((
            "dtype",
            format!(
                "fp8 inputs run on Hopper GPUs (sm_90) and the CPU; {} is not a Hopper GPU",
                arch.name
            ),
        ));
    }
    for (arg, d) in [("q", p.head_dim()), ("v", p.head_dim_v())] {
        if fp8_padded_head_dim(d).is_none() {
            return Some((
                arg,
                format!("head_dim {d}: the fp8 Hopper kernel covers multiples of 8 up to 256"),
            ));
        }
    }
    if p.head_dim_v() > p.head_dim() {
        return Some((
            "v",
            format!(
                "head_dim_v {} is wider than head_dim {}: the fp8 Hopper kernel wants d_v ≤ d",
                p.head_dim_v(),
                p.head_dim()
            ),
        ));
    }
    None
}

/// Plans an e4m3 problem ([`Problem::new_fp8`]) for the Hopper kernel, or says (naming the
/// argument) why it cannot run it. `tiles` overrides the table (checked like its entries).
pub fn plan_fp8(
    p: &Problem,
    arch: &GpuArch,
    target: &'static str,
    tiles: Option<Tiles>,
) -> Result<Fp8Plan> {
    if p.dtype() != DType::Fp8E4M3 {
        return Err(Error::invalid(
            "dtype",
            format!("{} inputs: the e4m3 kernel takes fp8 problems", p.dtype()),
        ));
    }
    if let Some((name, why)) = fp8_uncovered_arg(arch, p) {
        return Err(Error::invalid(name, why));
    }
    let dims = Dims {
        qk: fp8_padded_head_dim(p.head_dim()).expect("covered"),
        v: fp8_padded_head_dim_v(p.head_dim_v()).expect("covered"),
    };
    // Q and K go through TMA maps (16-byte strides), V through the Vᵀ pass's 8-byte reads, O
    // through 4-byte stores of 16-bit pairs (multiples of 8 elements, as the 16-bit kernel).
    for (name, axis, st) in crate::config::strides(p) {
        let unit = match name {
            "q" | "k" => 16,
            _ => 8,
        };
        if !st.is_multiple_of(unit) || st >= TMA_MAX_STRIDE_BYTES / 2 {
            return Err(Error::invalid(
                name,
                format!("{axis} {st} must be a multiple of {unit} elements below 2^39 for the fp8 Hopper kernel"),
            ));
        }
    }
    let max_k_len = p.sequences().iter().map(|s| s.k_len).max().unwrap_or(0);
    let q_len = max_q_len(p);
    let mut tiles = match tiles {
        Some(t) => {
            t.check_elem(dims, arch, 1)?;
            if t.dynamic && p.is_varlen() && t.consumer_wgs > MAX_DYNAMIC_VARLEN_CONSUMERS {
                return Err(Error::invalid(
                    "tiles",
                    format!(
                        "{t:?}: the dynamic schedule of a varlen batch takes at most {MAX_DYNAMIC_VARLEN_CONSUMERS} consumer warpgroups"
                    ),
                ));
            }
            t
        }
        None => {
            let mut t = fitting_fp8(arch, dims)
                .filter(|&(_, min_keys)| max_k_len >= min_keys)
                .map(|(t, _)| t)
                .find(|t| !p.is_varlen() || t.consumer_wgs <= MAX_DYNAMIC_VARLEN_CONSUMERS)
                .ok_or_else(|| {
                    Error::invalid("q", format!("no fp8 Hopper tiles fit head_dim {dims}"))
                })?;
            // As the 16-bit kernel: persistent for short sequences, the dynamic schedule for
            // varlen batches.
            t.persistent = q_len.div_ceil(t.block_m()) <= PERSISTENT_MAX_M_BLOCKS;
            if p.is_varlen() {
                t.persistent = true;
                t.dynamic = true;
            }
            t
        }
    };
    tiles.tma_store = false;
    let (rows_q, rows_k) = (p.q_layout().dims[1], p.k_layout().dims[1]);
    if rows_q > i32::MAX as usize / 2 || rows_k > i32::MAX as usize / 2 {
        return Err(Error::invalid(
            "q",
            format!("{rows_q} query / {rows_k} key rows exceed the TMA coordinate range (2^30)"),
        ));
    }
    // The Vᵀ buffer's columns: every sequence padded to whole key blocks.
    let bn = tiles.block_n;
    let (vt_seq_keys, cu_vt, vt_cols) = if p.is_varlen() {
        let mut cu = Vec::with_capacity(p.sequences().len() + 1);
        let mut at = 0usize;
        for s in p.sequences() {
            cu.push(at);
            at += s.k_len.next_multiple_of(bn);
        }
        cu.push(at);
        (0, cu, at.max(bn))
    } else {
        // (At least one block: a batch without keys still gets a valid Vᵀ map, never read.)
        let per = max_k_len.next_multiple_of(bn).max(bn);
        (per, Vec::new(), per * p.sequences().len())
    };
    let heads_kv = p.heads_q() / p.group();
    if vt_cols == 0
        || vt_cols > i32::MAX as usize / 2
        || vt_cols * p.head_dim_v() * heads_kv > 1 << 40
    {
        return Err(Error::invalid(
            "k",
            format!("{vt_cols} Vᵀ columns (keys padded to {bn}-key blocks) exceed the fp8 kernel's 2^30"),
        ));
    }
    let (grid, numbered) = launch_grid(p, arch, &tiles)?;
    Ok(Fp8Plan {
        plan: Plan {
            spec: KernelSpec {
                target,
                bf16: p.out_dtype() == DType::Bf16,
                fp8: true,
                head_dim: dims.qk,
                head_dim_v: dims.v,
                dim: p.head_dim(),
                dim_v: p.head_dim_v(),
                window: p.mask().is_restrictive(),
                softcap: p.softcap().is_some(),
                varlen: p.is_varlen(),
                tiles,
            },
            grid,
            tiles: numbered,
        },
        vt_cols,
        vt_seq_keys,
        cu_vt: cu_vt.into_iter().map(|c| c as i32).collect(),
    })
}

/// Every e4m3 spec the planner can emit for `arch` (compile tests and warm-up): each entry of
/// the table × O type × mask × softcap, fixed-length (one CTA per tile; the persistent launch
/// changes only the grid) and varlen on the dynamic schedule (entries of at most two consumer
/// warpgroups: with three its producer spills, as the 16-bit kernel's), at the tile widths and, narrower,
/// at widths 40 short of them (padded columns inside a slab and a k32 step).
pub fn all_fp8_specs(arch: &GpuArch, target: &'static str) -> Vec<KernelSpec> {
    let mut out = Vec::new();
    for (dims, tiles) in
        fp8_planned_dims().flat_map(|d| fitting_fp8(arch, d).map(move |(t, _)| (d, t)))
    {
        let dynamic = Tiles {
            persistent: true,
            dynamic: true,
            ..tiles
        };
        // Varlen on the dynamic schedule: entries of at most two consumer warpgroups.
        let kinds: &[(bool, Tiles)] = if tiles.consumer_wgs <= MAX_DYNAMIC_VARLEN_CONSUMERS {
            &[(false, tiles), (true, dynamic)]
        } else {
            &[(false, tiles)]
        };
        for &(varlen, tiles) in kinds {
            for (bf16, window, softcap) in crate::config::feature_variants() {
                for (dim, dim_v) in [(dims.qk, dims.v), (dims.qk - 40, dims.v - 40)] {
                    out.push(KernelSpec {
                        target,
                        bf16,
                        fp8: true,
                        head_dim: dims.qk,
                        head_dim_v: dims.v,
                        dim,
                        dim_v,
                        window,
                        softcap,
                        varlen,
                        tiles,
                    });
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::{A100, H100, H200};
    use crate::tensor::Layout;
    use crate::Options;

    fn problem(b: usize, s: usize, h: usize, d: usize, dv: usize, opts: &Options) -> Problem {
        let q = Layout::new("q", &[b, s, h, d], None).unwrap();
        let v = Layout::new("v", &[b, s, h, dv], None).unwrap();
        Problem::new_fp8(DType::Bf16, &q, &q, &v, &v, None, None, opts).unwrap()
    }

    #[test]
    fn every_head_dim_plans_within_budgets() {
        for arch in [H100, H200] {
            for d in (16..=256).step_by(16) {
                let p = problem(2, 1000, 4, d, d, &Options::new());
                let f = plan_fp8(&p, &arch, "sm_90a", None).unwrap();
                let s = &f.plan.spec;
                assert!(s.fp8 && s.bf16 && !s.tiles.tma_store && !s.tiles.lazy_rescale);
                assert_eq!(s.head_dim, d.next_multiple_of(128));
                assert!(s.smem_bytes() <= arch.max_smem_per_block() as usize, "{s}");
                assert!(s.tiles.block_n.is_multiple_of(128));
                // 1000 keys padded to the key blocks, per sequence.
                assert_eq!(f.vt_seq_keys, 1000usize.next_multiple_of(s.tiles.block_n));
                assert_eq!(f.vt_cols, 2 * f.vt_seq_keys);
                assert!(s.prelude().contains("constexpr bool FP8 = true;"));
                assert!(s.prelude().contains(&format!(
                    "constexpr int QK_DIM = {};",
                    d.next_multiple_of(32)
                )));
                assert!(s.wgmma_wrappers().contains("k32.f32.e4m3.e4m3"));
            }
        }
        // d128, first choice (from 4k keys): 256-key blocks, two Q slots of 16 KiB, two stages
        // of 32 KiB K and 32 KiB Vᵀ.
        let t = fp8_tiles(&H200, 128).unwrap();
        assert_eq!(
            (t.block_n, t.pingpong, t.intra_wg_overlap),
            (256, true, false)
        );
        let s = t.smem_elem(128, 1);
        assert_eq!((s.q, s.k, s.v), (32768, 65536, 65536));
        // d64: three consumer warpgroups, Vᵀ 64 rows.
        let p = problem(1, 4096, 4, 64, 64, &Options::new());
        let f = plan_fp8(&p, &H200, "sm_90a", None).unwrap();
        assert_eq!(
            (f.plan.spec.tiles.consumer_wgs, f.plan.spec.head_dim_v),
            (3, 64)
        );
    }

    #[test]
    fn varlen_batches_pad_each_sequence_to_key_blocks() {
        let q = Layout::new("q", &[700, 4, 128], None).unwrap();
        let cu = [0i32, 300, 300, 700];
        let p = Problem::new_fp8(
            DType::F16,
            &q,
            &q,
            &q,
            &q,
            Some(&cu),
            Some(&cu),
            &Options::new().causal(),
        )
        .unwrap();
        let f = plan_fp8(&p, &H200, "sm_90a", None).unwrap();
        let bn = f.plan.spec.tiles.block_n;
        let pad = |n: usize| n.next_multiple_of(bn) as i32;
        assert_eq!(f.cu_vt, vec![0, pad(300), pad(300), pad(300) + pad(400)]);
        assert_eq!(f.vt_cols as i32, pad(300) + pad(400));
        assert!(f.plan.spec.varlen && f.plan.spec.tiles.dynamic && !f.plan.spec.bf16);
    }

    #[test]
    fn what_the_kernel_does_not_take_is_named() {
        let name = |e: Error| match e {
            Error::InvalidArgument { name, .. } => name,
            e => panic!("{e}"),
        };
        let p = problem(1, 64, 2, 128, 128, &Options::new());
        assert_eq!(
            name(plan_fp8(&p, &A100, "sm_80", None).unwrap_err()),
            "dtype"
        );
        let wide_v = problem(1, 64, 2, 64, 128, &Options::new());
        assert_eq!(
            name(plan_fp8(&wide_v, &H200, "sm_90a", None).unwrap_err()),
            "v"
        );
        // A stride of 8 bytes is fine for V and O, not for Q's TMA map: contiguous fp8 tensors
        // need head dims that are multiples of 16 on the GPU.
        let q = Layout::new("q", &[1, 64, 1, 72], None).unwrap();
        let p = Problem::new_fp8(DType::Bf16, &q, &q, &q, &q, None, None, &Options::new()).unwrap();
        assert_eq!(name(plan_fp8(&p, &H200, "sm_90a", None).unwrap_err()), "q");
        // 16-bit problems are not the e4m3 kernel's.
        let l = Layout::new("q", &[1, 64, 2, 128], None).unwrap();
        let p16 = Problem::new(DType::Bf16, &l, &l, &l, &l, None, None, &Options::new()).unwrap();
        assert_eq!(
            name(plan_fp8(&p16, &H200, "sm_90a", None).unwrap_err()),
            "dtype"
        );
        // Tiles that break the e4m3 rules.
        let t = fp8_tiles(&H200, 128).unwrap();
        let p = problem(1, 64, 2, 128, 128, &Options::new());
        for bad in [
            Tiles { block_n: 176, ..t },
            Tiles {
                tma_store: true,
                ..t
            },
        ] {
            assert_eq!(
                name(plan_fp8(&p, &H200, "sm_90a", Some(bad)).unwrap_err()),
                "tiles"
            );
        }
    }

    #[test]
    fn the_spec_list_covers_every_table_entry() {
        let specs = all_fp8_specs(&H200, "sm_90a");
        for d in fp8_planned_dims() {
            assert!(specs.iter().any(|s| s.dims() == d && s.varlen));
            assert!(specs
                .iter()
                .any(|s| s.dims() == d && !s.varlen && s.dim == d.qk - 40));
        }
        assert!(specs.iter().all(|s| s.fp8));
    }
}
