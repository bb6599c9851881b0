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

use super::KernelKind;
use crate::arch::{Family, GpuArch};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::mask::Mask;
use crate::problem::Problem;

pub mod fp8;
mod report;
mod schedule;
mod spec;
mod tiles;
pub mod wgmma;

pub use report::*;
pub use schedule::*;
pub use spec::*;
pub use tiles::*;

/// Whether [`dispatch`] sends covered problems to the Hopper kernel. On since the kernel passed
/// every covered case of the correctness matrix (fp16 and bf16, d64/128/256) and memcheck,
/// racecheck and synccheck on an H200; `CudaBackend::with_kernel` forces either family.
pub const ENABLED: bool = true;

/// Which kernel a problem gets on a GPU, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Dispatch {
    /// The Hopper kernel, the Ampere-class kernel or the CPU.
    pub kernel: KernelKind,
    /// Why.
    pub reason: String,
}

/// Problem features that decide between the Hopper kernel and the Ampere-class fallback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Features {
    /// Head dim of Q/K.
    pub head_dim: usize,
    /// Head dim of V and O.
    pub head_dim_v: usize,
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
    let Some(dims) = dims_of(f) else {
        let (arg, d) = if padded_head_dim(f.head_dim).is_none() {
            ("q", f.head_dim)
        } else {
            ("v", f.head_dim_v)
        };
        return Some((
            arg,
            format!("head_dim {d}: the Hopper kernel covers multiples of 8 up to 256"),
        ));
    };
    if dims.v > dims.qk {
        return Some((
            "v",
            format!(
                "head_dim_v {} is wider than head_dim {} (padded {} > {}): the Hopper kernel stages O in a Q slot",
                f.head_dim_v, f.head_dim, dims.v, dims.qk
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
    if tiles(arch, dims).is_none() {
        return Some((
            "q",
            format!("no Hopper tiles fit head_dim {dims} on {}", arch.name),
        ));
    }
    None
}

/// The tile widths a problem's head dims are computed in ([`padded_head_dim`]), or `None` when
/// either is not a multiple of 8 up to 256.
pub fn dims_of(f: Features) -> Option<Dims> {
    Some(Dims {
        qk: padded_head_dim(f.head_dim)?,
        v: padded_head_dim(f.head_dim_v)?,
    })
}

/// Why the Hopper kernel does not cover a problem with these features on `arch`, or `None`.
pub fn uncovered(arch: &GpuArch, f: Features) -> Option<String> {
    uncovered_arg(arch, f).map(|(_, why)| why)
}

/// The kernel choice on `arch` when the caller does not force one: `sm90`, `sm80`, or `cpu`
/// where no CUDA kernel computes the problem (other dtypes, head dims above 256).
pub fn dispatch(arch: &GpuArch, f: Features) -> Dispatch {
    let widest = super::sm80::HEAD_DIMS[super::sm80::HEAD_DIMS.len() - 1];
    if f.dtype_size != 2 || f.head_dim.max(f.head_dim_v) > widest {
        return Dispatch {
            kernel: KernelKind::Cpu,
            reason: format!(
                "the CUDA kernels compute fp16/bf16 with head dims up to 256 ({}-byte elements, head_dim {})",
                f.dtype_size, f.head_dim
            ),
        };
    }
    match uncovered(arch, f) {
        Some(reason) => Dispatch {
            kernel: KernelKind::Sm80,
            reason,
        },
        None if !ENABLED => Dispatch {
            kernel: KernelKind::Sm80,
            reason: "the Hopper kernel covers this problem but is not enabled by default yet (issue 5: it has not passed the matrix on an H200)".into(),
        },
        None => Dispatch {
            kernel: KernelKind::Sm90,
            reason: format!(
                "a Hopper GPU, fp16/bf16, head dim {} (a multiple of 8 up to 256), positive scale, {} batch",
                Dims {
                    qk: f.head_dim,
                    v: f.head_dim_v
                },
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
        head_dim_v: p.head_dim_v(),
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
    /// [`Tiles::dynamic`]: the tiles the kernel's counter numbers (a varlen batch's non-empty
    /// ones); 0 otherwise.
    pub tiles: u32,
}

/// The longest sequence's query rows (every sequence's, in a fixed-length batch).
fn max_q_len(p: &Problem) -> usize {
    p.sequences().iter().map(|s| s.q_len).max().unwrap_or(0)
}

/// The 1-D grid of a launch and the tiles its counter numbers ([`Plan::tiles`]): one CTA per
/// tile (query block × head × sequence), or with [`Tiles::persistent`] one per SM at most, each
/// walking the tiles (the kernel numbers them). A varlen batch gets the longest sequence's query
/// blocks for every sequence, and the kernel skips the tiles past a shorter sequence's end;
/// with [`Tiles::dynamic`] its tiles are each sequence's own.
fn launch_grid(p: &Problem, arch: &GpuArch, tiles: &Tiles) -> Result<((u32, u32, u32), u32)> {
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
    let numbered = match (tiles.dynamic, p.is_varlen()) {
        (false, _) => 0,
        (true, false) => total,
        // Each sequence's own query blocks: no more than `total`, so within the same bound.
        (true, true) => p
            .sequences()
            .iter()
            .map(|s| (s.q_len.div_ceil(tiles.block_m()) * p.heads_q()) as u32)
            .sum(),
    };
    // `Tiles::check`: dynamic only with persistent.
    let ctas = match (tiles.persistent, tiles.dynamic) {
        (false, _) => total,
        (true, false) => total.min(arch.sm_count),
        (true, true) => numbered.min(arch.sm_count),
    };
    Ok(((ctas, 1, 1), numbered))
}

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
    let head_dim = dims_of(features(p)).expect("covered problems have padded dims");
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
            if t.dynamic && p.is_varlen() && t.consumer_wgs > MAX_DYNAMIC_VARLEN_CONSUMERS {
                return Err(Error::invalid(
                    "tiles",
                    format!(
                        "{t:?}: the dynamic schedule of a varlen batch takes at most {MAX_DYNAMIC_VARLEN_CONSUMERS} consumer warpgroups (with three the producer's 32 registers spill)"
                    ),
                ));
            }
            t
        }
        None => {
            let max_k_len = p.sequences().iter().map(|s| s.k_len).max().unwrap_or(0);
            // Varlen batches take the dynamic schedule over each sequence's own query blocks
            // (`varlen_tiles`); the static persistent walk lost to one CTA per tile on ragged
            // batches (docs/perf-history.md, "Varlen: the persistent walk and the TMA store").
            // Causal d64 takes it too (`causal_tiles`).
            let pick = if p.is_varlen() {
                varlen_tiles
            } else if p.mask() == Mask::Causal {
                causal_tiles
            } else {
                tiles_for
            };
            pick(arch, head_dim, max_q_len(p), max_k_len).expect("covered problems have tiles")
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
    let (grid, numbered) = launch_grid(p, arch, &tiles)?;
    Ok(Plan {
        spec: KernelSpec {
            target,
            bf16: p.dtype() == DType::Bf16,
            fp8: false,
            head_dim: head_dim.qk,
            head_dim_v: head_dim.v,
            dim: p.head_dim(),
            dim_v: p.head_dim_v(),
            window: p.mask().is_restrictive(),
            softcap: p.softcap().is_some(),
            varlen: p.is_varlen(),
            tiles,
        },
        grid,
        tiles: numbered,
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
        assert_eq!(name(Sm90Plan::new(&H200, 100, 2).unwrap_err()), "depth");
        let wider_v = Sm90Plan::with_dims(&H200, 64, 128, 2, None).unwrap_err();
        assert_eq!(name(wider_v), "depth-v");
        assert_eq!(
            name(Sm90Plan::with_dims(&H200, 128, 0, 2, None).unwrap_err()),
            "depth-v"
        );
        // Every multiple of 8 plans, padded to its tile width, slab maps where narrower.
        for d in (8..=256).step_by(8) {
            let p = Sm90Plan::new(&H200, d, 2).unwrap();
            assert_eq!(p.padded_head_dim, d.next_multiple_of(64));
            assert_eq!(p.slab_maps, (d % 64 != 0, d % 64 != 0));
        }
        let mla = Sm90Plan::with_dims(&H200, 192, 128, 2, Some(4096)).unwrap();
        assert_eq!((mla.padded_head_dim_v, mla.tiles.block_n), (128, 128));
        assert!(mla.to_string().contains("head_dim 192/128"), "{mla}");
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
            // The cross-tile overlap without the persistent walk, without the intra-warpgroup
            // overlap, and with the TMA store on one Q slot (176-key blocks at d128).
            Tiles {
                cross_tile: true,
                ..good
            },
            Tiles {
                cross_tile: true,
                persistent: true,
                intra_wg_overlap: false,
                ..good
            },
            Tiles {
                cross_tile: true,
                persistent: true,
                tma_store: true,
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
        // Each switch of issue 14 alone, and all three on two Q slots (128-key blocks).
        for ok in [
            Tiles {
                longest_first: true,
                ..good
            },
            Tiles {
                tma_store: true,
                ..good
            },
            Tiles {
                cross_tile: true,
                persistent: true,
                ..good
            },
            Tiles {
                block_n: 128,
                longest_first: true,
                tma_store: true,
                cross_tile: true,
                persistent: true,
                ..good
            },
        ] {
            assert!(ok.check(128, &H200).is_ok(), "{ok:?}");
        }
        assert_eq!(full.launch_regs(&H200), 168);
        assert!(good.check(128, &A100).is_err());
    }

    #[test]
    fn tile_overrides_take_ten_thirteen_fourteen_or_fifteen_fields() {
        let ten: Tiles = "128,2,2,40,232,0,1,0,1,0".parse().unwrap();
        assert!(ten.intra_wg_overlap && ten.persistent);
        assert!(!ten.longest_first && !ten.tma_store && !ten.cross_tile);
        let all: Tiles = "128,2,2,40,232,0,1,0,1,0,1,1,1".parse().unwrap();
        assert_eq!(
            all,
            Tiles {
                longest_first: true,
                tma_store: true,
                cross_tile: true,
                ..ten
            }
        );
        let lf: Tiles = "128,2,2,40,232,0,1,0,1,0,1,0,0".parse().unwrap();
        assert!(lf.longest_first && !lf.tma_store && !lf.cross_tile && !lf.dynamic);
        let dynamic: Tiles = "128,2,2,40,232,0,1,0,1,0,0,0,0,1".parse().unwrap();
        assert_eq!(
            dynamic,
            Tiles {
                dynamic: true,
                ..ten
            }
        );
        assert!(!dynamic.uniform_desc);
        let uniform: Tiles = "128,2,2,40,232,0,1,0,1,0,0,0,0,0,1".parse().unwrap();
        assert_eq!(
            uniform,
            Tiles {
                uniform_desc: true,
                ..ten
            }
        );
        for bad in [
            "128,2,2,40,232,0,1,0,1,0,1",
            "128,2,2,40,232,0,1,0,1,0,1,1",
            "128,2,2,40,232,0,1,0,1,0,1,1,2",
            "128,2,2,40,232,0,1,0,1,0,1,1,1,2",
            "128,2,2,40,232,0,1,0,1,0,1,1,1,1,2",
            "128,2,2,40,232,0,1,0,1,0,1,1,1,1,1,1",
        ] {
            let e = bad.parse::<Tiles>().unwrap_err().to_string();
            assert!(e.contains("sm90 tiles"), "{bad}: {e}");
        }
    }

    #[test]
    fn varlen_batches_take_the_dynamic_schedule() {
        use crate::problem::Options;
        use crate::tensor::Layout;
        let seqs = [0i32, 300, 1000];
        let l = Layout::new("q", &[1000, 4, 128], None).unwrap();
        let v = Problem::new(
            DType::Bf16,
            &l,
            &l,
            &l,
            &l,
            Some(&seqs),
            Some(&seqs),
            &Options::new(),
        )
        .unwrap();
        let t = Tiles {
            tma_store: true,
            persistent: true,
            ..tiles(&H200, 128).unwrap()
        };
        let forced = plan(&v, &H200, "sm_90a", Some(t)).unwrap();
        assert!(forced.spec.tiles.tma_store && forced.spec.tiles.persistent);
        assert!(!forced.spec.tiles.dynamic && forced.tiles == 0);
        // The static walk numbers the longest sequence's 6 query blocks for both sequences.
        assert_eq!(forced.grid, (6 * 4 * 2, 1, 1));
        // The planner's own choice: the dynamic schedule over each sequence's own blocks (3 and
        // 6 of 128 rows, 4 heads), the plain store.
        let planned = plan(&v, &H200, "sm_90a", None).unwrap();
        let t = planned.spec.tiles;
        assert!(t.persistent && t.dynamic && !t.tma_store, "{t:?}");
        assert_eq!(t, varlen_tiles(&H200, 128, 700, 700).unwrap());
        assert_eq!((planned.grid, planned.tiles), ((9 * 4, 1, 1), 9 * 4));
        // One CTA per tile (forced): the longest sequence's blocks for both.
        let one = Tiles {
            persistent: false,
            dynamic: false,
            ..t
        };
        let static_plan = plan(&v, &H200, "sm_90a", Some(one)).unwrap();
        assert_eq!(
            (static_plan.grid, static_plan.tiles),
            ((6 * 4 * 2, 1, 1), 0)
        );
        // At d64 it takes two consumer warpgroups; three are refused.
        assert_eq!(varlen_tiles(&H200, 64, 4096, 4096).unwrap().consumer_wgs, 2);
        let three = Tiles {
            dynamic: true,
            persistent: true,
            ..tiles_for(&H200, 64, 4096, 4096).unwrap()
        };
        assert_eq!(three.consumer_wgs, 3);
        let l64 = Layout::new("q", &[1000, 4, 64], None).unwrap();
        let v64 = Problem::new(
            DType::Bf16,
            &l64,
            &l64,
            &l64,
            &l64,
            Some(&seqs),
            Some(&seqs),
            &Options::new(),
        )
        .unwrap();
        assert!(plan(&v64, &H200, "sm_90a", Some(three)).is_err());
        // Dynamic needs the persistent launch.
        let bad = Tiles {
            dynamic: true,
            persistent: false,
            ..t
        };
        assert!(plan(&v, &H200, "sm_90a", Some(bad)).is_err());
    }

    #[test]
    fn causal_d64_takes_the_dynamic_schedule_on_two_consumer_warpgroups() {
        use crate::problem::Options;
        for sq in [1024, 2048, 4096, 16384] {
            let t = causal_tiles(&H200, 64, sq, sq).unwrap();
            if sq <= CAUSAL_DYNAMIC_MAX_ROWS {
                assert!(
                    t.consumer_wgs == 2 && t.persistent && t.dynamic && t.tma_store,
                    "{sq}: {t:?}"
                );
            } else {
                assert_eq!(Some(t), tiles_for(&H200, 64, sq, sq), "{sq}");
            }
            for d in [128, 256] {
                assert_eq!(causal_tiles(&H200, d, sq, sq), tiles_for(&H200, d, sq, sq));
            }
        }
        // Through plan: causal d64 numbers every tile; without the mask, the static tiles.
        let l = crate::tensor::Layout::new("q", &[2, 2048, 8, 64], None).unwrap();
        let problem =
            |o: &Options| Problem::new(DType::Bf16, &l, &l, &l, &l, None, None, o).unwrap();
        let causal = plan(&problem(&Options::new().causal()), &H200, "sm_90a", None).unwrap();
        assert!(causal.spec.tiles.dynamic);
        assert_eq!(
            (causal.grid, causal.tiles),
            ((H200.sm_count, 1, 1), 16 * 8 * 2)
        );
        let full = plan(&problem(&Options::new()), &H200, "sm_90a", None).unwrap();
        assert!(!full.spec.tiles.dynamic && full.spec.tiles.consumer_wgs == 3);
    }

    #[test]
    fn problem_tiles_follow_the_sequence_length() {
        // d64: 192-row tiles unless a 192-row tile would be mostly padding; persistent up to
        // 32 query blocks.
        let d64 = |sq| tiles_for(&H200, 64, sq, sq).unwrap();
        assert_eq!((d64(1024).block_m(), d64(1024).persistent), (128, true));
        assert_eq!((d64(4096).block_m(), d64(4096).persistent), (192, true));
        assert_eq!((d64(16384).block_m(), d64(16384).persistent), (192, false));
        // d128: 176-key blocks from 8k keys, 128 below.
        let d128 = |sq, sk| tiles_for(&H200, 128, sq, sk).unwrap();
        assert!(d128(4096, 4096).persistent && !d128(4097, 4097).persistent);
        assert!(d128(100, 100).persistent && d128(100, 100).intra_wg_overlap);
        assert_eq!(d128(1024, 1024).block_n, 128);
        assert_eq!(d128(4096, 4096).block_n, 128);
        assert_eq!(d128(1024, 8192).block_n, 176);
        assert_eq!(d128(16384, 8191).block_n, 128);
        // The TMA-store epilogue everywhere (plan() turns it off for varlen batches).
        assert!(d64(1024).tma_store && d64(16384).tma_store && d128(16384, 16384).tma_store);
        assert_eq!(tiles(&H200, 128).unwrap().block_n, 176);
        assert_eq!(tiles_for(&H200, 256, 1024, 1024).unwrap().block_n, 80);
        assert_eq!(
            tiles_for(&H200, 96, 1024, 1024),
            None,
            "96 is not a tile width"
        );
        assert_eq!(tiles_for(&H200, 192, 1024, 1024).unwrap().block_n, 112);
        let mla = Dims { qk: 192, v: 128 };
        assert_eq!(tiles_for(&H200, mla, 1024, 1024).unwrap().block_n, 128);
        // A narrower V without its own entry takes its Q/K width's tiles.
        let narrow = Dims { qk: 128, v: 64 };
        assert_eq!(tiles_for(&H200, narrow, 1024, 1024).unwrap().block_n, 128);
        assert_eq!(tiles_for(&A100, 128, 1024, 1024), None);
    }

    #[test]
    fn dispatch_says_why() {
        let f = Features {
            head_dim: 128,
            head_dim_v: 128,
            dtype_size: 2,
            varlen: false,
            nonpositive_scale: false,
            no_keys: false,
            tiles: 1000,
        };
        assert_eq!(dispatch(&A100, f).kernel, KernelKind::Sm80);
        let why = |g: Features| dispatch(&H200, g);
        let varlen = why(Features { varlen: true, ..f });
        assert_eq!(
            varlen.kernel,
            if ENABLED {
                KernelKind::Sm90
            } else {
                KernelKind::Sm80
            }
        );
        assert!(varlen.reason.contains("variable-length"), "{varlen:?}");
        assert_eq!(why(Features { dtype_size: 4, ..f }).kernel, KernelKind::Cpu);
        assert_eq!(why(Features { head_dim: 512, ..f }).kernel, KernelKind::Cpu);
        // Every multiple of 8 up to 256, V no wider than Q/K; the rest goes to the Ampere-class
        // planner, which says why it cannot take them either.
        for d in (8..=256).step_by(8) {
            let g = Features {
                head_dim: d,
                head_dim_v: d,
                ..f
            };
            assert_eq!(why(g).kernel, KernelKind::Sm90, "{d}");
        }
        let mla = why(Features {
            head_dim: 192,
            head_dim_v: 128,
            ..f
        });
        assert!(
            mla.kernel == KernelKind::Sm90 && mla.reason.contains("192/128"),
            "{mla:?}"
        );
        assert!(why(Features { head_dim: 100, ..f })
            .reason
            .contains("multiples of 8"));
        let wider_v = why(Features {
            head_dim: 64,
            head_dim_v: 128,
            ..f
        });
        assert!(
            wider_v.kernel == KernelKind::Sm80 && wider_v.reason.contains("wider"),
            "{wider_v:?}"
        );
        let scale = why(Features {
            nonpositive_scale: true,
            ..f
        });
        assert!(scale.kernel == KernelKind::Sm80 && scale.reason.contains("scale"));
        let keys = why(Features { no_keys: true, ..f });
        assert!(keys.kernel == KernelKind::Sm80 && keys.reason.contains("seqlen_k = 0"));
        // Past 2^30 tiles (a varlen batch walks its longest sequence's blocks for every one).
        let many = why(Features {
            tiles: MAX_TILES + 1,
            varlen: true,
            ..f
        });
        assert!(
            many.kernel == KernelKind::Sm80 && many.reason.contains("2^30"),
            "{many:?}"
        );
        assert_eq!(
            why(Features {
                tiles: MAX_TILES,
                ..f
            })
            .kernel,
            KernelKind::Sm90
        );
        assert_eq!(
            why(f).kernel,
            if ENABLED {
                KernelKind::Sm90
            } else {
                KernelKind::Sm80
            }
        );
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
        // Varlen: the dynamic schedule numbers each sequence's own query blocks (1, 3 and 1) ×
        // 4 heads, with plain stores; one CTA per tile (forced) takes the longest sequence's
        // query blocks for every sequence (3 × 4 heads × 3 sequences, the empty ones skipped
        // by the kernel).
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
        let dp = plan(&v, &H200, "sm_90a", None).unwrap();
        let t = dp.spec.tiles;
        assert!(
            dp.spec.varlen && t.persistent && t.dynamic && !t.tma_store,
            "{t:?}"
        );
        assert_eq!((dp.grid, dp.tiles), ((5 * 4, 1, 1), 5 * 4));
        let one = Tiles {
            persistent: false,
            dynamic: false,
            ..t
        };
        let vp = plan(&v, &H200, "sm_90a", Some(one)).unwrap();
        assert_eq!((vp.grid, vp.tiles), ((3 * 4 * 3, 1, 1), 0));
        assert!(!tiles.persistent && plan(&v, &H200, "sm_90a", Some(tiles)).is_ok());
        tiles.persistent = true;
        assert!(plan(&v, &H200, "sm_90a", Some(tiles)).is_ok());
        // A row stride of 516 elements is not a 16-byte multiple.
        let p = problem(64, &Options::new(), Some(4 * 128 + 4)).unwrap();
        assert_eq!(name(plan(&p, &H200, "sm_90a", None).unwrap_err()), "k");
        // 2^39 elements (2^40 bytes) is past TMA's stride range, where the layout itself allows it.
        if let Ok(p) = problem(64, &Options::new(), Some(1 << 39)) {
            assert_eq!(name(plan(&p, &H200, "sm_90a", None).unwrap_err()), "k");
        }
    }
}
