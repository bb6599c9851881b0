//! The decode kernel variants of `FA4_DECODE_VARIANT` (`config::decode_gpu::DecodeVariant`),
//! without a GPU: what the planner makes of each on the H200 and the A100 (grid, heads per CTA,
//! split counts, refusals), and that a handful of the all-heads kernel's variants compile with
//! NVRTC for sm_80 and sm_90a without spilling where the decode grid runs. Their speed and their
//! results on a GPU are tests/cuda_decode.rs (run once per variant by `bench/device_check.sh DIR
//! decode`) and `bench/peers.py decode` (one variant a column: `--fa4-env
//! NAME=FA4_DECODE_VARIANT=V`).

use std::io::Write;

use fa4::arch::{A100, H200};
use fa4::config::decode_gpu::{
    heads_specs, plan, plan_variant, DecodeVariant, GpuDecodePlan, HeadsSpec, SplitKvSpec,
    VARIANT_ENV,
};
use fa4::cuda::compile::{compile_with_log, nvrtc_version};
use fa4::paged::{PagedCache, PagedProblem};
use fa4::tensor::Layout;
use fa4::{DType, Error, Options};
use rayon::prelude::*;

/// The decode layout (32 query / 8 KV heads, d128, bf16) at `batch` × `keys` in pages
/// of 16, seqlen_q 1; `k_strides` overrides the cache's strides.
fn problem(batch: usize, keys: usize, k_strides: Option<&[usize]>) -> PagedProblem {
    problem_paged(batch, keys, 16, k_strides)
}

/// [`problem`] over pages of `page` keys.
fn problem_paged(
    batch: usize,
    keys: usize,
    page: usize,
    k_strides: Option<&[usize]>,
) -> PagedProblem {
    let per_seq = keys.div_ceil(page);
    let num_pages = batch * per_seq;
    let table: Vec<i32> = (0..num_pages as i32).rev().collect();
    let kl = Layout::new("k_cache", &[num_pages, page, 8, 128], k_strides).unwrap();
    let cache = PagedCache::new(&kl, &kl, &table, per_seq, &vec![keys as i32; batch]).unwrap();
    let ql = Layout::new("q", &[batch, 1, 32, 128], None).unwrap();
    PagedProblem::new(DType::Bf16, &ql, &ql, &cache, None, &Options::new()).unwrap()
}

fn h200(p: &PagedProblem, variant: &str, splits: Option<usize>) -> GpuDecodePlan {
    let v = DecodeVariant::parse(variant).unwrap();
    plan_variant(
        p,
        H200.sm_count as usize,
        H200.max_smem_per_block() as usize,
        "sm_90a",
        splits,
        v,
    )
    .unwrap_or_else(|e| panic!("{variant}: {e}"))
}

#[test]
fn auto_is_the_default_and_picks_by_the_number_of_head_groups() {
    let sms = H200.sm_count as usize;
    let smem = H200.max_smem_per_block() as usize;
    for (b, k, wide) in [
        (1, 32768, false),
        (2, 8192, false),
        (4, 131072, true),
        (8, 8192, true),
        (32, 4096, true),
    ] {
        let p = problem(b, k, None);
        let auto = plan(&p, sms, smem, "sm_90a", None).unwrap();
        assert_eq!(auto, h200(&p, "auto", None), "({b}, {k}): plan() is auto");
        assert_eq!(auto, h200(&p, "", None));
        assert!(auto.variant.auto);
        let named = if wide { "heads+bulk+best" } else { "best" };
        let mut want = h200(&p, named, None);
        want.variant.auto = true;
        assert_eq!(auto, want, "({b}, {k}) should run {named}");
        assert_eq!(auto.variant.to_string(), format!("auto ({named})"));
        // Before sm_90 (not measured there): the split kernel with the planner's count.
        let a100 = |v: &str| {
            plan_variant(
                &p,
                A100.sm_count as usize,
                A100.max_smem_per_block() as usize,
                "sm_80",
                None,
                DecodeVariant::parse(v).unwrap(),
            )
            .unwrap()
        };
        let mut want = a100("plain");
        want.variant.auto = true;
        assert_eq!(a100("auto"), want, "({b}, {k}) on sm_80");
        assert_eq!(a100("auto").variant.to_string(), "auto");
        // `plain` is the split kernel with the planner's own count.
        let plain = h200(&p, "plain", None);
        assert!(plain.heads.is_none() && !plain.variant.auto && !plain.variant.best_splits);
    }
    // Pages of 64 keys and more keep the split kernel at every batch (AUTO_HEADS_MAX_PAGE); 32
    // still takes the all-heads kernel; pages of 1 key take it for one sequence too.
    for (b, page, named) in [
        (8, 32, "heads+bulk+best"),
        (8, 64, "best"),
        (8, 256, "best"),
        (1, 1, "heads+bulk+best"),
        (1, 16, "best"),
    ] {
        let p = problem_paged(b, 8192, page, None);
        let auto = h200(&p, "auto", None);
        let mut want = h200(&p, named, None);
        want.variant.auto = true;
        assert_eq!(auto, want, "({b} sequences) page {page} should run {named}");
    }
    let p = problem(8, 8192, None);
    let forced = h200(&p, "auto", Some(3));
    assert_eq!(
        forced.decode.num_splits, 3,
        "a forced split count stays forced"
    );
}

#[test]
fn the_heads_variant_covers_all_kv_heads_per_cta_and_replans_the_splits() {
    // (1, 32k): one CTA per sequence before splitting, 2048 blocks of 16 keys; the planner's
    // rule then fills most of the 132 SMs (it caps at 128 splits).
    let p = problem(1, 32768, None);
    let v = h200(&p, "heads", None);
    let h = v.heads.expect("the heads kernel");
    assert_eq!((h.heads, h.block_n, h.head_dim, h.m_tiles), (8, 16, 128, 1));
    assert_eq!(h.threads(), 256);
    assert!(!h.bulk);
    assert_eq!(v.decode.tiles_unsplit, 1);
    assert_eq!(v.grid.0, 1, "one CTA per sequence along the heads");
    assert!(
        (100..=128).contains(&v.decode.num_splits),
        "{}",
        v.decode.num_splits
    );
    assert_eq!(v.grid.2 as usize, v.decode.num_splits);
    assert_eq!(
        v.decode.shape,
        p.decode_shape(),
        "the plan reports the real heads"
    );
    assert!(h.smem_bytes() <= H200.max_smem_per_block() as usize);
    // heads4: two CTAs per sequence.
    let v4 = h200(&p, "heads4", None);
    assert_eq!(v4.heads.unwrap().heads, 4);
    assert_eq!(v4.grid.0, 2);
    // (32, 4k): 32 CTAs; a split count that fills the SMs.
    let v = h200(&problem(32, 4096, None), "heads", None);
    assert_eq!(v.grid.0, 32);
    assert!(v.decode.num_splits >= 4, "{}", v.decode.num_splits);
    // A forced count stays forced.
    assert_eq!(h200(&p, "heads+best", Some(7)).decode.num_splits, 7);
}

#[test]
fn best_takes_the_best_wave_efficiency() {
    // (1, 32k) with the default kernel: 8 tiles; the planner takes 14 splits (112 of 132
    // SMs), the best one-wave efficiency is 16 (128 of 132).
    let p = problem(1, 32768, None);
    assert_eq!(h200(&p, "plain", None).decode.num_splits, 14);
    let best = h200(&p, "best", None);
    assert_eq!(best.decode.num_splits, 16);
    assert_eq!(best.grid.2, 16);
    assert!(best.heads.is_none());
    // One wave only: (4, 128k) keeps 4 splits of 32 tiles (128 of 132 SMs), not the 103 of
    // 25 full waves.
    assert_eq!(
        h200(&problem(4, 131072, None), "best", None)
            .decode
            .num_splits,
        4
    );
    // The heads kernel at (1, 32k): 128 splits, the cap; (8, 8k): 16 (128 CTAs).
    assert_eq!(h200(&p, "heads+best", None).decode.num_splits, 128);
    assert_eq!(
        h200(&problem(8, 8192, None), "heads+best", None)
            .decode
            .num_splits,
        16
    );
}

/// `fuse` changes nothing but the kernels' FUSE switch: the same kernel, split count and grid
/// as without it, the switch on only with more than one split (one split writes O directly),
/// and `auto` never takes it (not measured yet).
#[test]
fn fuse_keeps_the_plan_and_switches_the_kernel_only_with_splits() {
    for (b, k) in [(1, 32768), (8, 8192), (4, 131072), (32, 4096)] {
        let p = problem(b, k, None);
        for base in ["plain", "best", "heads", "heads+bulk+best", "heads4+best"] {
            let plain = h200(&p, base, None);
            let fused_name = match base {
                "plain" => "fuse".to_string(),
                b => format!("{b}+fuse"),
            };
            let fused = h200(&p, &fused_name, None);
            assert!(fused.variant.fuse && !plain.variant.fuse);
            assert_eq!(fused.decode, plain.decode, "{base} ({b}, {k})");
            assert_eq!(fused.grid, plain.grid, "{base} ({b}, {k})");
            assert!(!plain.fused());
            assert_eq!(
                fused.fused(),
                fused.decode.num_splits > 1,
                "{base} ({b}, {k})"
            );
            match (fused.heads, plain.heads) {
                (Some(f), Some(h)) => {
                    assert_eq!(f.fuse, fused.fused());
                    assert_eq!(HeadsSpec { fuse: false, ..f }, h);
                }
                (None, None) => {
                    assert_eq!(fused.spec.fuse, fused.fused());
                    assert_eq!(
                        SplitKvSpec {
                            fuse: false,
                            ..fused.spec
                        },
                        plain.spec
                    );
                }
                other => panic!("{base}: {other:?}"),
            }
            // One split: the unfused kernel.
            let one = h200(&p, &fused_name, Some(1));
            assert!(!one.fused() && !one.spec.fuse && one.heads.is_none_or(|h| !h.fuse));
        }
        assert!(
            !plan(&p, 132, H200.max_smem_per_block() as usize, "sm_90a", None)
                .unwrap()
                .fused()
        );
    }
}

#[test]
fn bulk_is_refused_before_hopper_and_falls_back_on_strided_heads() {
    let p = problem(8, 8192, None);
    let bulk = h200(&p, "heads+bulk", None);
    assert!(bulk.heads.unwrap().bulk);
    match plan_variant(
        &p,
        A100.sm_count as usize,
        A100.max_smem_per_block() as usize,
        "sm_80",
        None,
        DecodeVariant::parse("bulk").unwrap(),
    ) {
        Err(Error::InvalidArgument { name, reason }) => {
            assert_eq!(name, VARIANT_ENV);
            assert!(reason.contains("sm_80"), "{reason}");
        }
        other => panic!("expected a refusal naming {VARIANT_ENV}, got {other:?}"),
    }
    // The cp.async heads kernel runs on the A100 (2 stages fit its 163 KiB).
    let a100 = plan_variant(
        &p,
        A100.sm_count as usize,
        A100.max_smem_per_block() as usize,
        "sm_80",
        None,
        DecodeVariant::parse("heads").unwrap(),
    )
    .unwrap();
    assert_eq!(a100.heads.unwrap().stages, 2);
    // Heads 256 elements apart (d128 in a padded row): one key's heads are no single span.
    let strided = problem(8, 8192, Some(&[16 * 8 * 256, 8 * 256, 256, 1]));
    let h = h200(&strided, "bulk", None).heads.unwrap();
    assert!(!h.bulk, "strided heads fall back to cp.async copies");
}

/// A handful of all-heads variants compile for sm_80 and sm_90a; the decode grid's (d128, one
/// MMA tile) spill nothing, the largest footprints (two tiles of d64 with window and softcap,
/// d256) at most 128 bytes, the default kernel's allowance in tests/nvrtc_compile.rs.
#[test]
fn the_heads_kernel_compiles_for_sm80_and_sm90a() {
    let required = std::env::var("FA4_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
    if let Err(e) = nvrtc_version() {
        if required {
            panic!("FA4_REQUIRE_NVRTC=1 but {e}");
        }
        let _ = writeln!(std::io::stderr(), "decode_variants: skipped: {e}");
        return;
    }
    let mut specs = heads_specs("sm_80", A100.max_smem_per_block() as usize);
    let sm80 = specs.len();
    specs.extend(heads_specs("sm_90a", H200.max_smem_per_block() as usize));
    assert_eq!(
        (sm80, specs.len() - sm80),
        (4, 6),
        "sm_80: no bulk; sm_90a: all six"
    );
    // Each also with the fused combine (`fuse`).
    let fused: Vec<HeadsSpec> = specs
        .iter()
        .map(|&h| HeadsSpec { fuse: true, ..h })
        .collect();
    specs.extend(fused);
    let failures: Vec<String> = specs
        .par_iter()
        .filter_map(
            |spec| match compile_with_log(spec, &["--ptxas-options=-v"]) {
                Err(e) => Some(e.to_string()),
                Ok((cubin, log)) => {
                    let limit = if spec.m_tiles == 1 && spec.head_dim <= 128 {
                        0
                    } else {
                        128
                    };
                    let spilled: Vec<usize> = log
                        .lines()
                        .filter_map(|l| {
                            l.split(" bytes spill stores")
                                .next()
                                .filter(|_| l.contains(" bytes spill stores"))
                                .and_then(|x| x.rsplit(' ').next())
                                .and_then(|n| n.parse::<usize>().ok())
                        })
                        .collect();
                    // Some NVRTC builds write no ptxas report (the device image's, for sm_100a);
                    // CI's pinned NVRTC (FA4_REQUIRE_NVRTC=1) does, and must.
                    if spilled.is_empty() && required {
                        Some(format!("{spec}: no ptxas report in the log"))
                    } else if spilled.iter().any(|&n| n > limit) {
                        Some(format!("{spec}: spills {spilled:?} bytes (limit {limit})"))
                    } else if cubin.len() < 1000 {
                        Some(format!("{spec}: cubin of only {} bytes", cubin.len()))
                    } else {
                        None
                    }
                }
            },
        )
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// An fp8 cache (`PagedProblem::with_fp8_cache`) plans the kernels' `KV_FP8` variants: the same
/// kernel, grid and split count as the 16-bit cache under every variant, a ring at least as
/// deep (a stage is half the bytes) within the GPU's shared memory; strides are whole 16-byte
/// copies of bytes (16 elements, where the 16-bit cache needs 8).
#[test]
fn an_fp8_cache_plans_the_same_grid_with_a_deeper_ring() {
    let smem = H200.max_smem_per_block() as usize;
    for (batch, keys, page) in [(1, 32768, 16), (8, 8192, 16), (8, 8192, 1), (4, 4096, 256)] {
        let p = problem_paged(batch, keys, page, None);
        let p8 = p.clone().with_fp8_cache();
        assert_eq!(p8.kv_dtype(), DType::Fp8E4M3);
        assert_eq!(p8.dtype(), DType::Bf16);
        for v in [
            "auto",
            "plain",
            "best",
            "heads",
            "heads+bulk+best",
            "best+fuse",
        ] {
            let (a, b) = (h200(&p, v, None), h200(&p8, v, None));
            let what = format!("({batch}, {keys}) page {page} {v}");
            assert_eq!((a.grid, &a.decode), (b.grid, &b.decode), "{what}");
            assert_eq!(a.variant, b.variant, "{what}");
            assert!(b.spec.fp8 && !a.spec.fp8, "{what}");
            assert!(b.spec.stages >= a.spec.stages, "{what}");
            assert!(b.spec.smem_bytes() <= smem, "{what}");
            match (a.heads, b.heads) {
                (Some(h), Some(h8)) => {
                    assert!(h8.fp8 && h8.heads == h.heads && h8.bulk == h.bulk, "{what}");
                    assert!(h8.stages >= h.stages && h8.smem_bytes() <= smem, "{what}");
                }
                (None, None) => {}
                other => panic!("{what}: {other:?}"),
            }
        }
    }
    // The decode grid's d128 tile: 6 stages of 2 × 128 rows × 144 bytes on the H200 (the
    // 16-bit kernel's 3 of 2 × 128 × 256), 4 on the A100.
    let p8 = problem(8, 8192, None).with_fp8_cache();
    assert_eq!(h200(&p8, "plain", None).spec.stages, 6);
    let a100 = plan_variant(
        &p8,
        A100.sm_count as usize,
        A100.max_smem_per_block() as usize,
        "sm_80",
        None,
        DecodeVariant::PLAIN,
    )
    .unwrap();
    assert_eq!(a100.spec.stages, 4);
    // Heads 8 elements apart (a padded row of 136 per head): fine for 16-bit copies, not for
    // 16-byte copies of bytes.
    let padded = problem(2, 1024, Some(&[16 * 8 * 136, 8 * 136, 136, 1]));
    assert!(h200(&padded, "plain", None).spec.head_dim == 128);
    let e = plan_variant(
        &padded.with_fp8_cache(),
        132,
        smem,
        "sm_90a",
        None,
        DecodeVariant::PLAIN,
    )
    .unwrap_err();
    match e {
        Error::InvalidArgument { name, reason } => {
            assert_eq!(name, "k_cache");
            assert!(reason.contains("multiples of 16 elements"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
}
