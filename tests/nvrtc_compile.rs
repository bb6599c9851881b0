//! The kernel variants the planners can emit compile with NVRTC for sm_80, sm_90a and sm_100a:
//! every variant for the targets it runs on, a subset elsewhere (each test says which).
//!
//! This needs NVRTC but no GPU. Where NVRTC is missing the test says so and passes, unless
//! `FA4_REQUIRE_NVRTC=1` (CI sets it), where a missing NVRTC fails.

use std::io::Write;
use std::time::Instant;

use fa4::arch::{A100, B200, H200};
use fa4::config::sm80::all_specs;
use fa4::cuda::compile::{compile_uncached, compile_with_log, nvrtc_version};
use rayon::prelude::*;

#[test]
fn every_sm80_variant_compiles_for_every_target() {
    let required = std::env::var("FA4_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
    match nvrtc_version() {
        Ok((major, minor)) => eprintln!("NVRTC {major}.{minor}"),
        Err(e) if !required => {
            // Past the harness's capture, so that a skip is always visible.
            let _ = writeln!(std::io::stderr(), "nvrtc_compile: skipped: {e}");
            return;
        }
        Err(e) => panic!("FA4_REQUIRE_NVRTC=1 but {e}"),
    }
    // Every variant for the targets it runs on (A100, and the H200 off the Hopper kernel's
    // cover); for sm_100a, where no GPU runs it, one per head dim (bf16, causal, no softcap):
    // the dtype and feature branches are the same source on every target, and the full set
    // there cost CI a minute of its 30.
    let mut specs = Vec::new();
    for (arch, target) in [(A100, "sm_80"), (H200, "sm_90a")] {
        specs.extend(all_specs(&arch, target));
    }
    let full = specs.len();
    specs.extend(
        all_specs(&B200, "sm_100a")
            .into_iter()
            .filter(|s| s.bf16 && s.window && !s.softcap),
    );
    assert!(
        full >= 2 * 32 && specs.len() > full,
        "{} specs",
        specs.len()
    );
    let start = Instant::now();
    let failures: Vec<String> = specs
        .par_iter()
        .filter_map(|spec| match compile_uncached(spec) {
            Ok(cubin) if cubin.len() > 1000 => None,
            Ok(cubin) => Some(format!("{spec}: cubin of only {} bytes", cubin.len())),
            Err(e) => Some(e.to_string()),
        })
        .collect();
    eprintln!(
        "compiled {} variants in {:.1} s",
        specs.len(),
        start.elapsed().as_secs_f64()
    );
    assert!(
        failures.is_empty(),
        "{} failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// NVRTC (12.9 on) keeps what it compiles in the CUDA compute cache (`~/.nv/ComputeCache`, where
/// a driver is installed), and a compile served from that cache comes back without ptxas's
/// report, which these tests read: on the H200 a second run of this file failed with an empty
/// log for every variant the first run had compiled (and the device check, now
/// `bench/device_check.sh`, whose earlier steps compile the same kernels, failed here three times
/// on 2026-12-02).
/// So a test that reads the report runs its body in a child process of this binary with
/// `CUDA_CACHE_DISABLE=1`, unless it is that child. True when the child ran it (and passed):
/// the caller returns.
fn ran_without_compute_cache(test: &str) -> bool {
    if std::env::var("CUDA_CACHE_DISABLE").is_ok_and(|v| v == "1") {
        return false;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let out = std::process::Command::new(exe)
        .args(["--exact", test, "--test-threads", "1"])
        .env("CUDA_CACHE_DISABLE", "1")
        .output()
        .expect("the test binary runs as a child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "{test}, run without the compute cache:\n{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::io::stderr().write_all(&out.stderr);
    true
}

/// The Hopper kernel's variants compile for sm_90a without spilling and without ptxas
/// serialising the wgmma pipeline (which it does, with a warning, when accumulator registers
/// are touched inside a wgmma group or when registers run short).
#[test]
fn every_sm90_variant_compiles_without_spills_or_wgmma_serialization() {
    if ran_without_compute_cache(
        "every_sm90_variant_compiles_without_spills_or_wgmma_serialization",
    ) {
        return;
    }
    let required = std::env::var("FA4_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
    if let Err(e) = nvrtc_version() {
        if required {
            panic!("FA4_REQUIRE_NVRTC=1 but {e}");
        }
        let _ = writeln!(std::io::stderr(), "nvrtc_compile (sm90): skipped: {e}");
        return;
    }
    let specs = fa4::config::sm90::all_specs(&H200, "sm_90a");
    assert_eq!(
        specs.len(),
        7 * 8 + 6 * 8 + 4,
        "every planned tile shape (d64 and d128 have two; d192, 192/128, d256 one) × dtype × mask × softcap, fixed-length; varlen on the dynamic schedule (not d64's three consumer warpgroups); causal d64 on the dynamic schedule"
    );
    // The slab-map variants (tensors narrower than their tiles: per-slab loads and stores).
    let slabs = fa4::config::sm90::slab_specs(&H200, "sm_90a");
    assert_eq!(
        slabs.len(),
        7 + 6 + 1,
        "one per planned fixed-length, varlen and causal-dynamic tile shape"
    );
    // The bf16 causal ones also with every kernel switch on that its tiles take (the persistent
    // launch changes only the grid; the overlap and ping-pong need two consumer warpgroups).
    // The switches change the consumer's loop, which dtype, softcap and the maps do not touch
    // (one variant per tile shape and varlen keeps CI's compile time within its budget).
    let switched = specs
        .iter()
        .filter(|s| s.bf16 && s.window && !s.softcap)
        .map(|s| {
            let mut s = *s;
            s.tiles.intra_wg_overlap = s.tiles.consumer_wgs == 2;
            s.tiles.pingpong = s.tiles.consumer_wgs == 2;
            s.tiles.lazy_rescale = true;
            s.tiles.poly_exp2 = 2;
            s
        });
    // fp16 on the causal variants only: fp16 and bf16 differ in the wgmma's type and the pack
    // to 16 bits, which every mask and softcap variant shares (the full set cost CI minutes).
    let planned = specs
        .iter()
        .filter(|s| s.bf16 || (s.window && !s.softcap))
        .copied();
    let specs: Vec<_> = planned.chain(switched).chain(slabs).collect();
    let failures: Vec<String> = specs.par_iter().filter_map(sm90_ptxas_problems).collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn every_sm90_fp8_variant_compiles_without_spills_or_wgmma_serialization() {
    if ran_without_compute_cache(
        "every_sm90_fp8_variant_compiles_without_spills_or_wgmma_serialization",
    ) {
        return;
    }
    let required = std::env::var("FA4_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
    if let Err(e) = nvrtc_version() {
        if required {
            panic!("FA4_REQUIRE_NVRTC=1 but {e}");
        }
        let _ = writeln!(std::io::stderr(), "nvrtc_compile (sm90 fp8): skipped: {e}");
        return;
    }
    // Every e4m3 tile entry, fixed-length and varlen: bf16 O with every mask and softcap, fp16
    // O causal, and the narrower head dims (slab maps, Q·Kᵀ ending inside a k32 step) causal.
    // O's type changes only the epilogue's pack, the widths only the loads.
    let specs: Vec<_> = fa4::config::sm90::fp8::all_fp8_specs(&H200, "sm_90a")
        .into_iter()
        .filter(|s| {
            let full = s.dim == s.head_dim;
            (full && s.bf16) || (s.window && !s.softcap && (full || s.bf16))
        })
        .collect();
    assert_eq!(
        specs.len(),
        (6 + 5) * 6,
        "tile entries fixed-length and (up to two consumer warpgroups) varlen × variants"
    );
    let failures: Vec<String> = specs.par_iter().filter_map(sm90_ptxas_problems).collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// What is wrong with a Hopper variant's compile: an NVRTC error, spills, a ptxas warning (the
/// wgmma serialisation C7515/C7520 among them), or fewer registers than the launch bounds give.
fn sm90_ptxas_problems(spec: &fa4::config::sm90::KernelSpec) -> Option<String> {
    match compile_with_log(spec, &["--ptxas-options=-v"]) {
        Err(e) => Some(e.to_string()),
        Ok((_, log)) => {
            let mut bad: Vec<String> = log
                .lines()
                .filter(|l| {
                    (l.contains("spill")
                        && !l.contains(" 0 bytes spill stores, 0 bytes spill loads"))
                        || l.contains("serialized")
                        || l.contains("warning")
                })
                .map(str::to_string)
                .collect();
            // setmaxnreg moves registers within what the CTA is launched with: ptxas must give
            // the kernel the whole launch-bounds share, which the planner's register split
            // counts on (less, and setmaxnreg.inc would wait forever).
            let want = format!("Used {} registers", spec.tiles.launch_regs(&H200));
            if !log.contains(&want) {
                let used: Vec<&str> = log.lines().filter(|l| l.contains("Used ")).collect();
                let said = if used.is_empty() {
                    // No register line at all: show what the log holds instead.
                    let head: String = log.chars().take(600).collect();
                    format!(
                        "no `Used` line; the log ({} bytes) begins: {head:?}",
                        log.len()
                    )
                } else {
                    used.join(" | ")
                };
                bad.push(format!(
                    "expected `{want}` in the ptxas report, which says: {said}"
                ));
            }
            (!bad.is_empty()).then(|| format!("{spec}:\n  {}", bad.join("\n  ")))
        }
    }
}

/// The switches of issue 14 (longest-first order, TMA-store epilogue, cross-tile overlap; off
/// in every planned variant) on a handful of variants, one per planned tile shape (bf16, causal)
/// with every switch its tiles take, plus the TMA store alone at d256 (one Q slot), a varlen
/// one (the cross-tile walk skipping empty tiles) and the dynamic schedule with the cross-tile
/// overlap, varlen and not, and the uniform descriptors on each tile shape and the dynamic varlen
/// one: no spills, no serialisation.
#[test]
fn issue14_switched_sm90_variants_compile_without_spills_or_wgmma_serialization() {
    if ran_without_compute_cache(
        "issue14_switched_sm90_variants_compile_without_spills_or_wgmma_serialization",
    ) {
        return;
    }
    let required = std::env::var("FA4_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
    if let Err(e) = nvrtc_version() {
        if required {
            panic!("FA4_REQUIRE_NVRTC=1 but {e}");
        }
        let _ = writeln!(
            std::io::stderr(),
            "nvrtc_compile (sm90 issue 14): skipped: {e}"
        );
        return;
    }
    let planned = fa4::config::sm90::all_specs(&H200, "sm_90a");
    let base = |tiles_of: &dyn Fn(&fa4::config::sm90::KernelSpec) -> bool| {
        planned
            .iter()
            .filter(|s| {
                s.bf16 && s.window && !s.softcap && !s.varlen && !s.tiles.dynamic && tiles_of(s)
            })
            .copied()
            .collect::<Vec<_>>()
    };
    let mut specs = Vec::new();
    for mut s in base(&|_| true) {
        let (q_slots, dims) = (s.tiles.q_stages(s.dims()), s.dims());
        let t = &mut s.tiles;
        t.longest_first = true;
        t.persistent = true;
        t.intra_wg_overlap = t.consumer_wgs == 2;
        // Where the tiles take it (d192 does not: `Tiles::check`).
        t.cross_tile = t.intra_wg_overlap
            && fa4::config::sm90::Tiles {
                cross_tile: true,
                tma_store: false,
                ..*t
            }
            .check(dims, &H200)
            .is_ok();
        t.tma_store = !t.cross_tile || q_slots == 2;
        specs.push(s);
    }
    for mut s in base(&|s| s.head_dim == 256) {
        s.tiles.tma_store = true;
        specs.push(s);
    }
    for mut s in base(&|s| s.head_dim == 128 && s.tiles.block_n == 128) {
        s.varlen = true;
        s.tiles.tma_store = true;
        s.tiles.cross_tile = true;
        s.tiles.persistent = true;
        s.tiles.longest_first = true;
        specs.push(s);
        // The dynamic schedule with the cross-tile overlap and the TMA store, varlen (the
        // cursor, the slot reads and warp 1's) and fixed-length (the arithmetic numbering).
        s.tiles.longest_first = false;
        s.tiles.dynamic = true;
        specs.push(s);
        s.varlen = false;
        specs.push(s);
    }
    // Uniform descriptors on every planned tile shape, and on the dynamic varlen schedule with
    // the cross-tile overlap.
    let uniform: Vec<_> = base(&|_| true)
        .into_iter()
        .chain(
            specs
                .last()
                .map(|s| fa4::config::sm90::KernelSpec { varlen: true, ..*s }),
        )
        .map(|mut s| {
            s.tiles.uniform_desc = true;
            s
        })
        .collect();
    specs.extend(uniform);
    assert_eq!(specs.len(), 19, "{specs:#?}");
    let failures: Vec<String> = specs.par_iter().filter_map(sm90_ptxas_problems).collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The Blackwell kernel (not run on hardware) compiles for sm_100a in every variant CI knows:
/// each depth FA4Config supports for 16-bit inputs × dtype × mask × softcap; ptxas reports no
/// spills and no static shared memory, so a launch's shared memory is the plan's `smem_used`
/// alone (the kernel `static_assert`s that its layout adds up to it).
#[test]
fn every_sm100_variant_compiles_for_sm100a() {
    if ran_without_compute_cache("every_sm100_variant_compiles_for_sm100a") {
        return;
    }
    use fa4::config::sm100_kernel::{all_specs, parse_ptxas};
    let required = std::env::var("FA4_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
    if let Err(e) = nvrtc_version() {
        if required {
            panic!("FA4_REQUIRE_NVRTC=1 but {e}");
        }
        let _ = writeln!(std::io::stderr(), "nvrtc_compile (sm100): skipped: {e}");
        return;
    }
    let specs = all_specs();
    assert_eq!(specs.len(), 5 * 8);
    let failures: Vec<String> = specs
        .par_iter()
        .filter_map(
            |spec| match compile_with_log(spec, &["--ptxas-options=-v"]) {
                Err(e) => Some(e.to_string()),
                Ok((cubin, log)) => {
                    let mut bad = Vec::new();
                    match parse_ptxas(&log) {
                        Some((regs, static_smem)) => {
                            if static_smem != 0 {
                                bad.push(format!("{static_smem} bytes of static shared memory"));
                            }
                            if regs == 0 || regs > 128 {
                                bad.push(format!(
                                    "{regs} registers at launch (512 threads: ≤ 128)"
                                ));
                            }
                        }
                        // CI's NVRTC (13.0.88, FA4_REQUIRE_NVRTC=1) writes the report; the
                        // H200 image's NVRTC wrote none for sm_100a (2026-12-01, a5c654b), and
                        // there only the compile itself is checked.
                        None if required => bad.push(format!("no ptxas report in the log:\n{log}")),
                        None => {
                            let _ = writeln!(
                                std::io::stderr(),
                                "{spec}: this NVRTC wrote no ptxas report; registers and static \
                                 shared memory not checked"
                            );
                        }
                    }
                    if log.lines().any(|l| {
                        l.contains("spill")
                            && !l.contains(" 0 bytes spill stores, 0 bytes spill loads")
                    }) {
                        bad.push(format!("spills:\n{log}"));
                    }
                    if cubin.len() < 1000 {
                        bad.push(format!("cubin of only {} bytes", cubin.len()));
                    }
                    if spec.smem_bytes() as u64 != spec.cfg.smem_used() {
                        bad.push("launch shared memory differs from smem_used".into());
                    }
                    (!bad.is_empty()).then(|| format!("{spec}: {}", bad.join("; ")))
                }
            },
        )
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The decode kernels (split-KV, combine, append) compile for sm_80, sm_90a and sm_100a (every
/// split-KV variant for sm_90a, with and without the fused combine; the bf16 ones without
/// softcap for the other two), and the split kernel spills little: its O accumulator is sized
/// to the register file
/// (`DecodeTiles::gpu`). Measured with NVRTC 13.0: the one-MMA-tile variants of d64 and d128
/// (every decode shape up to 16 packed rows) spill nothing; 32 rows of d128 spill 40–64 bytes
/// and d256 with softcap 12 bytes (L1-resident stack traffic, once per key block).
#[test]
fn every_decode_variant_compiles_for_every_target_with_little_spilling() {
    if ran_without_compute_cache(
        "every_decode_variant_compiles_for_every_target_with_little_spilling",
    ) {
        return;
    }
    use fa4::config::decode_gpu::{all_specs, AppendSpec, CombineSpec, HEAD_DIMS};
    let required = std::env::var("FA4_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
    if let Err(e) = nvrtc_version() {
        if required {
            panic!("FA4_REQUIRE_NVRTC=1 but {e}");
        }
        let _ = writeln!(std::io::stderr(), "nvrtc_compile (decode): skipped: {e}");
        return;
    }
    const SPILL_LIMIT: usize = 128;
    let targets = ["sm_80", "sm_90a", "sm_100a"];
    // Every variant for sm_90a, where the decode kernels are measured and tested; for sm_80 and
    // sm_100a the bf16 ones without softcap (the same source: the dtype and softcap are
    // compile-time switches whose code sm_90a's compiles already cover), to keep CI's NVRTC
    // time within its budget.
    let split: Vec<_> = [(A100, targets[0]), (H200, targets[1]), (B200, targets[2])]
        .iter()
        .flat_map(|(arch, t)| {
            all_specs(
                t,
                (arch.smem_per_sm - arch.smem_reserved_per_block) as usize,
            )
            .into_iter()
            .filter(|s| s.target == targets[1] || (s.bf16 && !s.softcap))
        })
        .collect();
    assert_eq!(
        split.len(),
        5 * 8 + 2 * 5 * 2,
        "d64/d128 × 2 row tiles, d256 × 1, × dtype × mask × softcap (sm_90a; × mask elsewhere)"
    );
    // And sm_90a's with the fused combine (`fuse`: its merge runs after the main loop, so the
    // same spill limits hold).
    let fused: Vec<_> = split
        .iter()
        .filter(|s| s.target == targets[1])
        .map(|&s| fa4::config::decode_gpu::SplitKvSpec { fuse: true, ..s })
        .collect();
    let split: Vec<_> = split.into_iter().chain(fused).collect();
    let mut failures: Vec<String> = split
        .par_iter()
        .filter_map(
            |spec| match compile_with_log(spec, &["--ptxas-options=-v"]) {
                Err(e) => Some(e.to_string()),
                Ok((_, log)) => {
                    // "N bytes spill stores": at most SPILL_LIMIT, and none for one MMA tile
                    // of d64/d128.
                    let limit = if spec.m_tiles == 1 && spec.head_dim <= 128 {
                        0
                    } else {
                        SPILL_LIMIT
                    };
                    let bad: Vec<&str> = log
                        .lines()
                        .filter(|l| {
                            l.split(" bytes spill stores")
                                .next()
                                .and_then(|x| x.rsplit(' ').next())
                                .and_then(|n| n.parse::<usize>().ok())
                                .is_some_and(|n| n > limit)
                        })
                        .collect();
                    (!bad.is_empty()).then(|| format!("{spec}: {}", bad.join("; ")))
                }
            },
        )
        .collect();
    for target in targets {
        for bf16 in [false, true] {
            for head_dim in HEAD_DIMS {
                let spec = CombineSpec {
                    target,
                    bf16,
                    head_dim,
                };
                if let Err(e) = compile_uncached(&spec) {
                    failures.push(e.to_string());
                }
            }
        }
        if let Err(e) = compile_uncached(&AppendSpec { target }) {
            failures.push(e.to_string());
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Spill-store bytes of each function in a ptxas report (`--ptxas-options=-v`).
fn spill_stores(log: &str) -> Vec<usize> {
    log.lines()
        .filter(|l| l.contains(" bytes spill stores"))
        .filter_map(|l| {
            l.split(" bytes spill stores")
                .next()
                .and_then(|x| x.rsplit(' ').next())
                .and_then(|n| n.parse::<usize>().ok())
        })
        .collect()
}

/// The decode kernels' fp8-cache variants (`KV_FP8`, `kernels/decode/fp8.cuh`) and the fp8
/// append compile: every split-kernel variant for sm_90a, the bf16 window ones also with the
/// fused combine (its merge is the 16-bit kernels', after the loop); for sm_80, which widens
/// e4m3 with bit operations (no conversion instruction before sm_89), both dtypes at every head
/// dim and row tile with a window; for sm_100a the bf16 window ones; the all-heads variants of
/// `heads_fp8_specs` for sm_80 and sm_90a, the sm_90a bulk ones also fused; the append for f32,
/// fp16 and bf16 rows on all three targets (83 compiles, about 90 s on two cores). Spills
/// within the 16-bit kernels' limits: none for one MMA tile of d64/d128, at most 128 bytes
/// otherwise.
#[test]
fn every_fp8_cache_decode_variant_compiles_with_little_spilling() {
    if ran_without_compute_cache("every_fp8_cache_decode_variant_compiles_with_little_spilling") {
        return;
    }
    use fa4::config::decode_gpu::{
        all_fp8_specs, heads_fp8_specs, AppendFp8Spec, HeadsSpec, SplitKvSpec,
    };
    use fa4::cuda::compile::KernelSource;
    use fa4::DType;
    let required = std::env::var("FA4_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
    if let Err(e) = nvrtc_version() {
        if required {
            panic!("FA4_REQUIRE_NVRTC=1 but {e}");
        }
        let _ = writeln!(
            std::io::stderr(),
            "nvrtc_compile (decode fp8): skipped: {e}"
        );
        return;
    }
    let hopper = all_fp8_specs("sm_90a", H200.max_smem_per_block() as usize);
    assert_eq!(
        hopper.len(),
        5 * 8,
        "d64/d128 × 2 row tiles, d256 × 1, × dtype × mask × softcap"
    );
    assert!(hopper.iter().all(|s| s.fp8 && s.stages > 2), "{hopper:#?}");
    let fused: Vec<SplitKvSpec> = hopper
        .iter()
        .filter(|s| s.bf16 && s.window && !s.softcap)
        .map(|&s| SplitKvSpec { fuse: true, ..s })
        .collect();
    let ampere = all_fp8_specs("sm_80", A100.max_smem_per_block() as usize)
        .into_iter()
        .filter(|s| s.window && !s.softcap);
    let blackwell = all_fp8_specs("sm_100a", B200.max_smem_per_block() as usize)
        .into_iter()
        .filter(|s| s.bf16 && s.window && !s.softcap);
    // Each with its spill limit: none for one MMA tile of d64/d128 (every decode shape up to 16
    // packed rows) and for the append, 128 bytes otherwise.
    let limit = |m_tiles: usize, head_dim: usize| {
        if m_tiles == 1 && head_dim <= 128 {
            0
        } else {
            128
        }
    };
    type Job = (Box<dyn KernelSource + Send + Sync>, usize);
    let mut specs: Vec<Job> = Vec::new();
    for s in hopper
        .into_iter()
        .chain(fused)
        .chain(ampere)
        .chain(blackwell)
    {
        specs.push((Box::new(s), limit(s.m_tiles, s.head_dim)));
    }
    let mut heads = heads_fp8_specs("sm_80", A100.max_smem_per_block() as usize);
    heads.extend(heads_fp8_specs(
        "sm_90a",
        H200.max_smem_per_block() as usize,
    ));
    assert_eq!(heads.len(), 4 + 6, "sm_80: no bulk; sm_90a: all six");
    let heads_fused: Vec<HeadsSpec> = heads
        .iter()
        .filter(|h| h.bulk)
        .map(|&h| HeadsSpec { fuse: true, ..h })
        .collect();
    for h in heads.into_iter().chain(heads_fused) {
        specs.push((Box::new(h), limit(h.m_tiles, h.head_dim)));
    }
    for target in ["sm_80", "sm_90a", "sm_100a"] {
        for dtype in [DType::F32, DType::F16, DType::Bf16] {
            specs.push((Box::new(AppendFp8Spec { target, dtype }), 0));
        }
    }
    assert_eq!(specs.len(), 83);
    let start = Instant::now();
    let failures: Vec<String> = specs
        .par_iter()
        .filter_map(|(spec, lim)| {
            let text = spec.to_string();
            match compile_with_log(spec.as_ref(), &["--ptxas-options=-v"]) {
                Err(e) => Some(e.to_string()),
                Ok((cubin, log)) => {
                    let spilled = spill_stores(&log);
                    let lim = *lim;
                    if spilled.is_empty() && required {
                        Some(format!("{text}: no ptxas report in the log"))
                    } else if spilled.iter().any(|&n| n > lim) {
                        Some(format!("{text}: spills {spilled:?} bytes (limit {lim})"))
                    } else if cubin.len() < 1000 {
                        Some(format!("{text}: cubin of only {} bytes", cubin.len()))
                    } else {
                        None
                    }
                }
            }
        })
        .collect();
    eprintln!(
        "compiled {} fp8-cache decode variants in {:.1} s",
        specs.len(),
        start.elapsed().as_secs_f64()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A handful of backward variants (CI time: six compiles) cover each kernel and feature
/// switch: every entry, both dtypes, d64/d128/d256, window, softcap, deterministic. The main
/// and dQ kernels must not spill (their accumulators are sized by the planner to fit).
#[test]
fn backward_variants_compile_without_spills() {
    if ran_without_compute_cache("backward_variants_compile_without_spills") {
        return;
    }
    use fa4::config::bwd::{self, BwdKernel, BwdSpec};
    let required = std::env::var("FA4_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
    if let Err(e) = nvrtc_version() {
        if required {
            panic!("FA4_REQUIRE_NVRTC=1 but {e}");
        }
        let _ = writeln!(std::io::stderr(), "nvrtc_compile (bwd): skipped: {e}");
        return;
    }
    let spec = |kernel, bf16, head_dim, window, softcap, deterministic| BwdSpec {
        target: "sm_90",
        kernel,
        bf16,
        head_dim,
        window,
        softcap,
        deterministic,
        main: bwd::main_tiles(head_dim),
        dq: bwd::dq_tiles(head_dim),
    };
    let specs = [
        spec(BwdKernel::Pre, false, 128, false, false, false),
        spec(BwdKernel::Convert, true, 256, false, false, false),
        spec(BwdKernel::Main, true, 128, true, false, false),
        spec(BwdKernel::Main, false, 64, false, true, true),
        spec(BwdKernel::Main, true, 256, true, true, false),
        spec(BwdKernel::Dq, true, 128, true, true, true),
    ];
    let failures: Vec<String> = specs
        .par_iter()
        .filter_map(|s| match compile_with_log(s, &["--ptxas-options=-v"]) {
            Err(e) => Some(e.to_string()),
            Ok((_, log)) => {
                eprintln!("{s}:\n{log}");
                let spills = log
                    .lines()
                    .filter(|l| l.contains("spill stores") && !l.contains(" 0 bytes spill stores"))
                    .count();
                (spills > 0).then(|| format!("{s} spills:\n{log}"))
            }
        })
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The Hopper backward's main kernel (`kernels/bwd_sm90/`) compiles for sm_90a without spills,
/// without ptxas serialising its wgmma groups, and with the launch's whole register share (its
/// `setmaxnreg` split counts on it). Ten variants cover the three tile widths, a head dim
/// narrower than each (40, 96, 192), both dtypes, the window, the softcap and varlen (CI time);
/// `FA4_BWD_SM90_ALL=1` compiles all 96, and
/// `FA4_BWD_SM90_SOURCE_DIR=DIR` also writes each variant's full source there (to iterate on a
/// kernel with nvcc).
#[test]
fn hopper_backward_variants_compile_without_spills_or_wgmma_serialization() {
    if ran_without_compute_cache(
        "hopper_backward_variants_compile_without_spills_or_wgmma_serialization",
    ) {
        return;
    }
    use fa4::config::bwd_sm90::{self, Spec, LAUNCH_REGS};
    use fa4::cuda::compile::source;
    let required = std::env::var("FA4_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
    if let Err(e) = nvrtc_version() {
        if required {
            panic!("FA4_REQUIRE_NVRTC=1 but {e}");
        }
        let _ = writeln!(std::io::stderr(), "nvrtc_compile (bwd sm90): skipped: {e}");
        return;
    }
    let spec_det = |bf16, dim: usize, window, softcap, varlen, det| {
        let head_dim = bwd_sm90::padded_head_dim(dim).unwrap();
        Spec {
            target: "sm_90a",
            bf16,
            head_dim,
            dim,
            dim_v: dim,
            window,
            softcap,
            varlen,
            tiles: bwd_sm90::tiles(head_dim, det),
        }
    };
    let spec =
        |bf16, dim, window, softcap, varlen| spec_det(bf16, dim, window, softcap, varlen, false);
    let specs: Vec<Spec> = if std::env::var("FA4_BWD_SM90_ALL").is_ok_and(|v| v == "1") {
        let mut all = Vec::new();
        for bf16 in [false, true] {
            for d in [64, 128, 256, 40, 96, 192] {
                for window in [false, true] {
                    for softcap in [false, true] {
                        for varlen in [false, true] {
                            for det in [false, true] {
                                all.push(spec_det(bf16, d, window, softcap, varlen, det));
                            }
                        }
                    }
                }
            }
        }
        all
    } else {
        vec![
            spec(true, 64, true, false, false),
            spec(false, 64, false, true, false),
            spec(true, 128, true, true, false),
            spec(false, 128, false, false, false),
            // Narrower than the tile: slab maps, Sᵀ/dPᵀ over QK_DIM, clipped dK/dV stores.
            spec(true, 40, true, false, false),
            spec(false, 96, false, true, false),
            // Varlen: packed maps, the next sequence's rows zeroed in masked steps (the window
            // and softcap d64 variant has the fewest registers to spare).
            spec(true, 64, true, true, true),
            spec(false, 128, true, false, true),
            // The shared-keys form (tiles of 256): the widest, and d192 in it, varlen.
            spec(true, 256, true, true, false),
            spec(false, 192, true, false, true),
            // The deterministic mode: the dQ writer warp (d64 window softcap, the tightest
            // consumers; d128 varlen) and the shared-keys form's own waits.
            spec_det(true, 64, true, true, false, true),
            spec_det(false, 128, true, true, true, true),
            spec_det(true, 256, true, false, true, true),
            // V narrower than Q: 192/128 (the shared-keys form; deterministic too), 128/64 (varlen)
            // and 64/32 (the dQ writer).
            Spec {
                dim_v: 128,
                ..spec(true, 192, true, false, false)
            },
            Spec {
                dim_v: 128,
                ..spec_det(false, 192, false, true, true, true)
            },
            Spec {
                dim_v: 64,
                ..spec(true, 128, false, false, true)
            },
            Spec {
                dim_v: 32,
                ..spec_det(false, 64, true, false, false, true)
            },
        ]
    };
    if let Some(dir) = std::env::var_os("FA4_BWD_SM90_SOURCE_DIR") {
        for s in &specs {
            let name: String = s
                .to_string()
                .chars()
                .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
                .collect();
            std::fs::write(
                std::path::Path::new(&dir).join(format!("{name}.cu")),
                source(s),
            )
            .unwrap();
        }
    }
    let failures: Vec<String> = specs
        .par_iter()
        .filter_map(|s| match compile_with_log(s, &["--ptxas-options=-v"]) {
            Err(e) => Some(e.to_string()),
            Ok((_, log)) => {
                eprintln!("{s}:\n{log}");
                // The deterministic mode's d64 tiles without a softcap spill up to 56 bytes at
                // 232 registers per consumer (the dQ writer warp needs the producer warpgroup
                // at 40: at 24 the producer warp spills beside it; the 16-bit atomic mode at
                // 232 spills 20 bytes there too). Allowed up to 64 bytes, and only there.
                let spill_ok = |l: &str| {
                    let stores = l
                        .split(" bytes spill stores")
                        .next()
                        .and_then(|h| h.rsplit(' ').next())
                        .and_then(|n| n.parse::<usize>().ok());
                    s.tiles.deterministic
                        && s.head_dim == 64
                        && !s.softcap
                        && stores.is_some_and(|n| n <= 64)
                };
                let mut bad: Vec<String> = log
                    .lines()
                    .filter(|l| {
                        (l.contains("spill")
                            && !l.contains(" 0 bytes spill stores, 0 bytes spill loads")
                            && !(l.contains("spill stores") && spill_ok(l)))
                            || l.contains("serialized")
                            || l.contains("warning")
                    })
                    .map(str::to_string)
                    .collect();
                let want = format!("Used {LAUNCH_REGS} registers");
                if !log.contains(&want) {
                    bad.push(format!("expected `{want}` in the ptxas report"));
                }
                (!bad.is_empty()).then(|| format!("{s}:\n  {}", bad.join("\n  ")))
            }
        })
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The kernel cache on the real compile path (`cuda::compile::compile_in`, the key NVRTC's
/// version and the source make): a first compile writes the entry, a second is a hit; an entry
/// overwritten with 100 random bytes (issue 30: on the H200 every later call of that variant
/// failed with CUDA_ERROR_INVALID_IMAGE until the file was deleted) or truncated is compiled
/// again and replaced, and so is one the driver refused (`recompile_refused_in`, which the
/// backend calls when `cuModuleLoadData` fails on a cached image). No GPU.
#[test]
fn a_damaged_cache_entry_is_compiled_again() {
    use fa4::cuda::compile::{compile_in, entry_path, read_entry, recompile_refused_in, Lookup};
    let required = std::env::var("FA4_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
    if let Err(e) = nvrtc_version() {
        if required {
            panic!("FA4_REQUIRE_NVRTC=1 but {e}");
        }
        let _ = writeln!(std::io::stderr(), "nvrtc_compile (cache): skipped: {e}");
        return;
    }
    let dir = std::env::temp_dir().join(format!("fa4-nvrtc-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let spec = all_specs(&A100, "sm_80")
        .into_iter()
        .next()
        .expect("an sm80 variant");
    let path = entry_path(&dir, &spec).expect("a cache key");
    let first = compile_in(&dir, &spec).expect("compiles");
    assert!(!first.cached);
    assert_eq!(read_entry(&path), Lookup::Hit(first.cubin.clone()));
    assert!(
        compile_in(&dir, &spec).unwrap().cached,
        "a second compile is a hit"
    );
    let whole = std::fs::read(&path).unwrap();
    let random: Vec<u8> = (0..100u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8)
        .collect();
    for (what, bytes) in [
        ("100 random bytes", random),
        ("truncated", whole[..whole.len() - 7].to_vec()),
    ] {
        std::fs::write(&path, &bytes).unwrap();
        assert!(matches!(read_entry(&path), Lookup::Invalid(_)), "{what}");
        let again = compile_in(&dir, &spec).expect("compiles");
        assert!(!again.cached, "{what}: served from the damaged entry");
        assert!(again.cubin.starts_with(b"\x7fELF"), "{what}: not a cubin");
        assert_eq!(
            read_entry(&path),
            Lookup::Hit(again.cubin.clone()),
            "{what}"
        );
        assert!(
            compile_in(&dir, &spec).unwrap().cached,
            "{what}: not replaced"
        );
    }
    let fresh = recompile_refused_in(&dir, &spec, "CUDA_ERROR_INVALID_IMAGE (a test)").unwrap();
    assert!(!fresh.cached);
    assert_eq!(read_entry(&path), Lookup::Hit(fresh.cubin));
    let _ = std::fs::remove_dir_all(&dir);
}
