//! Writes the cubin of every planned kernel variant to `$FA4_SASS_DUMP_DIR`, one file per
//! variant named after it, so that two builds of the crate can be compared instruction by
//! instruction (`bench/sass_diff.sh OLD NEW`). A refactor of the kernels' sources that claims to
//! change nothing must leave every variant's code sections identical.
//!
//! Ignored: it needs NVRTC and a folder to write, and it compiles ~260 variants. Run it with
//! `FA4_SASS_DUMP_DIR=DIR cargo test --release --test sass_dump -- --ignored`
//! (`FA4_SASS_DUMP_FILTER=sm90-fwd,d64` keeps the variants whose file name contains one of the
//! comma-separated parts, `FA4_SASS_DUMP_SKIP` drops them).

use std::path::PathBuf;

use fa4::arch::{A100, B200, H200};
use fa4::cuda::compile::compile_uncached;
use rayon::prelude::*;

/// Compiles one variant.
type Job = Box<dyn Fn() -> fa4::error::Result<Vec<u8>> + Send + Sync>;

/// A file name for a variant: its display form, with only `[A-Za-z0-9._-]`.
fn file_name(spec: &impl std::fmt::Display) -> String {
    let name: String = spec
        .to_string()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("{name}.cubin")
}

#[test]
#[ignore = "needs NVRTC and FA4_SASS_DUMP_DIR; compiles every variant"]
fn dump_every_variant_cubin() {
    let dir = PathBuf::from(
        std::env::var_os("FA4_SASS_DUMP_DIR").expect("set FA4_SASS_DUMP_DIR to a folder"),
    );
    std::fs::create_dir_all(&dir).expect("create FA4_SASS_DUMP_DIR");
    let mut jobs: Vec<(String, Job)> = Vec::new();
    for (arch, target) in [(A100, "sm_80"), (H200, "sm_90a"), (B200, "sm_100a")] {
        for spec in fa4::config::sm80::all_specs(&arch, target) {
            jobs.push((file_name(&spec), Box::new(move || compile_uncached(&spec))));
        }
    }
    // The Hopper kernel's planned variants, and each with every switch its tiles take on, as
    // tests/nvrtc_compile.rs compiles them.
    for spec in fa4::config::sm90::all_specs(&H200, "sm_90a") {
        let mut switched = spec;
        switched.tiles.intra_wg_overlap = spec.tiles.consumer_wgs == 2;
        switched.tiles.pingpong = spec.tiles.consumer_wgs == 2;
        switched.tiles.lazy_rescale = true;
        switched.tiles.poly_exp2 = 2;
        // And with the switches of issue 14 (see tests/nvrtc_compile.rs), where the tiles take them.
        let mut issue14 = switched;
        issue14.tiles.longest_first = true;
        issue14.tiles.persistent = true;
        issue14.tiles.cross_tile = spec.tiles.consumer_wgs == 2;
        issue14.tiles.tma_store =
            !issue14.tiles.cross_tile || spec.tiles.q_stages(spec.dims()) == 2;
        // And the planned variant with the uniform wgmma descriptors (`bench/sass_loop.py`).
        let mut uniform = spec;
        uniform.tiles.uniform_desc = true;
        for s in [spec, switched, issue14, uniform] {
            jobs.push((file_name(&s), Box::new(move || compile_uncached(&s))));
        }
    }
    // The backward's kernels: the row kernels for both reduction targets, the main and dQ
    // kernels plain and with every switch on (sm_90, where they run), each dtype and head dim.
    {
        use fa4::config::bwd::{self, BwdKernel, BwdSpec};
        for bf16 in [false, true] {
            for head_dim in bwd::HEAD_DIMS {
                let spec = |target, kernel, all: bool| BwdSpec {
                    target,
                    kernel,
                    bf16,
                    head_dim,
                    window: all,
                    softcap: all,
                    deterministic: all || kernel == BwdKernel::Dq,
                    main: bwd::main_tiles(head_dim),
                    dq: bwd::dq_tiles(head_dim),
                };
                let mut specs = Vec::new();
                for target in ["sm_80", "sm_90"] {
                    specs.push(spec(target, BwdKernel::Pre, false));
                    specs.push(spec(target, BwdKernel::Convert, false));
                }
                for all in [false, true] {
                    specs.push(spec("sm_90", BwdKernel::Main, all));
                    specs.push(spec("sm_90", BwdKernel::Dq, all));
                }
                for s in specs {
                    jobs.push((file_name(&s), Box::new(move || compile_uncached(&s))));
                }
            }
        }
    }
    // The split-KV decode kernel's planned variants (`config::decode_gpu::all_specs`).
    for (arch, target) in [(A100, "sm_80"), (H200, "sm_90a")] {
        let smem = (arch.smem_per_sm - arch.smem_reserved_per_block) as usize;
        for spec in fa4::config::decode_gpu::all_specs(target, smem) {
            jobs.push((file_name(&spec), Box::new(move || compile_uncached(&spec))));
        }
        // The all-heads decode kernel's variants (`heads_specs`: cp.async and, on sm_90a, bulk).
        for spec in fa4::config::decode_gpu::heads_specs(target, smem) {
            jobs.push((file_name(&spec), Box::new(move || compile_uncached(&spec))));
        }
        // Both kernels with the fused combine (`fuse`): new variants, for the next diff.
        for spec in fa4::config::decode_gpu::all_specs(target, smem) {
            let spec = fa4::config::decode_gpu::SplitKvSpec { fuse: true, ..spec };
            jobs.push((file_name(&spec), Box::new(move || compile_uncached(&spec))));
        }
        for spec in fa4::config::decode_gpu::heads_specs(target, smem) {
            let spec = fa4::config::decode_gpu::HeadsSpec { fuse: true, ..spec };
            jobs.push((file_name(&spec), Box::new(move || compile_uncached(&spec))));
        }
        // The combine of the splits, each dtype and head dim.
        for bf16 in [false, true] {
            for head_dim in fa4::config::decode_gpu::HEAD_DIMS {
                let spec = fa4::config::decode_gpu::CombineSpec {
                    target,
                    bf16,
                    head_dim,
                };
                jobs.push((file_name(&spec), Box::new(move || compile_uncached(&spec))));
            }
        }
    }
    // FA4_SASS_DUMP_FILTER=a,b: only variants whose file name contains one of them;
    // FA4_SASS_DUMP_SKIP=a,b: not those whose name contains one of them (e.g. `longest-first`
    // for a dump to compare with one made before those switches existed).
    let keys = |var: &str| -> Option<Vec<String>> {
        let v = std::env::var(var).ok()?;
        Some(
            v.split(',')
                .filter(|k| !k.is_empty())
                .map(String::from)
                .collect(),
        )
    };
    if let Some(keys) = keys("FA4_SASS_DUMP_FILTER") {
        jobs.retain(|(name, _)| keys.iter().any(|k| name.contains(k.as_str())));
    }
    if let Some(keys) = keys("FA4_SASS_DUMP_SKIP") {
        jobs.retain(|(name, _)| !keys.iter().any(|k| name.contains(k.as_str())));
    }
    let mut names: Vec<&String> = jobs.iter().map(|(n, _)| n).collect();
    names.sort();
    names.dedup();
    let unique = names.len();
    let failures: Vec<String> = jobs
        .par_iter()
        .filter_map(|(name, job)| match job() {
            Ok(cubin) => std::fs::write(dir.join(name), cubin)
                .err()
                .map(|e| format!("{name}: {e}")),
            Err(e) => Some(format!("{name}: {e}")),
        })
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    eprintln!(
        "wrote {unique} distinct variants ({} jobs) to {}",
        jobs.len(),
        dir.display()
    );
}
