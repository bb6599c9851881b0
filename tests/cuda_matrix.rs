//! The CUDA backend against the float64 oracle: the whole correctness matrix (fp16 and bf16,
//! every head dim), device-buffer calls, and the errors the planner gives. Runs where a GPU
//! works: every test is ignored unless run with `--include-ignored`, and fails where no GPU works.

use std::io::Write;

use fa4::check::{matrix, random_fill, run_case};
use fa4::cuda::CudaBackend;
use fa4::{Backend, DType, Error, Options, Tensor, TensorMut};
use half::bf16;
use rand::rngs::StdRng;
use rand::SeedableRng;

/// The CUDA backend on device 0. These tests are `#[ignore]`d (a machine without a GPU reports
/// them as ignored, not passed); run them with `--include-ignored` where a GPU works, and they
/// fail, not pass, where none does.
fn gpu() -> CudaBackend {
    match CudaBackend::new(0) {
        Ok(b) => {
            eprintln!("CUDA device: {:?}", b.info());
            b
        }
        Err(e) => panic!("needs a CUDA GPU (run with --include-ignored only where one works): {e}"),
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_backend_passes_the_matrix() {
    let cuda = gpu();
    let backend = Backend::Cuda(cuda);
    let cases = matrix(&[DType::F16, DType::Bf16], &[32, 64, 80, 96, 128, 192, 256]);
    let mut failures = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        match run_case(&backend, case, 5000 + i as u64) {
            Ok(r) if r.passed() => {}
            Ok(r) => failures.push(format!("{case}: {r}")),
            Err(e) => failures.push(format!("{case}: error {e}")),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn larger_problems_pass_on_the_gpu() {
    let cuda = gpu();
    let backend = Backend::Cuda(cuda);
    for (sq, sk, d, causal) in [
        (1000, 1000, 128, true),
        (513, 2049, 64, false),
        (777, 300, 256, true),
    ] {
        let case = fa4::check::Case {
            dtype: DType::Bf16,
            seqlens: fa4::check::Seqlens::Fixed {
                batch: 2,
                q: sq,
                k: sk,
            },
            heads_q: 4,
            heads_kv: 2,
            head_dim: d,
            head_dim_v: d,
            mask: if causal {
                fa4::Mask::Causal
            } else {
                fa4::Mask::None
            },
            softcap: None,
            scale: None,
            strided: false,
            nan: false,
        };
        let r = run_case(&backend, &case, 42).unwrap();
        assert!(r.passed(), "{case}: {r}");
    }
}

/// The Ampere-class kernel's causal launch order (`config::tile_order`) on a problem whose
/// (sequence, head) pairs split into unequal groups, so that the last group has spare places
/// (CTAs that return at once): every tile must still run once.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sm80_causal_launch_groups_match_the_oracle() {
    let cuda = gpu();
    let (batch, seqlen, heads_q, heads_kv, d) = (5, 1024, 7, 1, 256);
    let q = fa4::tensor::Layout::new("q", &[batch, seqlen, heads_q, d], None).unwrap();
    let kv = fa4::tensor::Layout::new("k", &[batch, seqlen, heads_kv, d], None).unwrap();
    let p = fa4::Problem::new(
        DType::Bf16,
        &q,
        &kv,
        &kv,
        &q,
        None,
        None,
        &Options::new().causal(),
    )
    .unwrap();
    let plan = fa4::config::sm80::plan(&p, &cuda.info().arch, cuda.info().target, None).unwrap();
    let (group, _, groups) = plan.grid;
    let pairs = (batch * heads_q) as u32;
    // On an H100/H200 the groups are 18 and 17 pairs. Other GPUs size them by their own
    // resident CTAs: say so where this one does not split unequally.
    if !(group > 1 && group < pairs && group * groups > pairs) {
        let _ = writeln!(
            std::io::stderr(),
            "sm80_causal_launch_groups: grid {:?} for {pairs} pairs has no spare places on this GPU; checking the oracle only",
            plan.grid
        );
    }
    let case = fa4::check::Case {
        dtype: DType::Bf16,
        seqlens: fa4::check::Seqlens::Fixed {
            batch,
            q: seqlen,
            k: seqlen,
        },
        heads_q,
        heads_kv,
        head_dim: d,
        head_dim_v: d,
        mask: fa4::Mask::Causal,
        softcap: None,
        scale: None,
        strided: false,
        nan: false,
    };
    let backend = Backend::Cuda(cuda.with_kernel(fa4::cuda::KernelChoice::Sm80));
    let r = run_case(&backend, &case, 77).unwrap();
    assert!(r.passed(), "{case}: {r}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn unsupported_problems_are_clear_errors() {
    let cuda = gpu();
    let backend = Backend::Cuda(cuda);
    let name = |e: Error| match e {
        Error::InvalidArgument { name, .. } => name,
        other => panic!("{other:?}"),
    };
    // f32 storage: the CUDA kernels are 16-bit.
    let x = vec![1.0f32; 2 * 16 * 64];
    let t = Tensor::new(&x, &[1, 16, 2, 64]).unwrap();
    let mut o = vec![0f32; 2 * 16 * 64];
    let mut out = TensorMut::new(&mut o, &[1, 16, 2, 64]).unwrap();
    assert_eq!(
        name(
            backend
                .forward(&t, &t, &t, &mut out, None, &Options::new())
                .unwrap_err()
        ),
        "dtype"
    );
    // A row stride that breaks 16-byte copies.
    let mut rng = StdRng::seed_from_u64(1);
    let mut qb = vec![bf16::ZERO; 16 * 2 * 68];
    random_fill(&mut rng, &mut qb, 64, 1.0);
    let q = Tensor::strided(&qb, &[1, 16, 2, 64], Some(&[16 * 136, 136 - 4, 64, 1])).unwrap();
    let kv = Tensor::new(&qb[..16 * 2 * 64], &[1, 16, 2, 64]).unwrap();
    let mut ob = vec![bf16::ZERO; 16 * 2 * 64];
    let mut out = TensorMut::new(&mut ob, &[1, 16, 2, 64]).unwrap();
    assert_eq!(
        name(
            backend
                .forward(&q, &kv, &kv, &mut out, None, &Options::new())
                .unwrap_err()
        ),
        "q"
    );
    // Head dim beyond 256.
    let big = vec![bf16::ONE; 4 * 264];
    let t = Tensor::new(&big, &[1, 4, 1, 264]).unwrap();
    let mut ob = vec![bf16::ZERO; 4 * 264];
    let mut out = TensorMut::new(&mut ob, &[1, 4, 1, 264]).unwrap();
    assert_eq!(
        name(
            backend
                .forward(&t, &t, &t, &mut out, None, &Options::new())
                .unwrap_err()
        ),
        "q"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn device_buffers_stay_on_the_device() {
    let cuda = gpu();
    let (b, s, h, d) = (2, 300, 4, 128);
    let mut rng = StdRng::seed_from_u64(9);
    let mut host = vec![bf16::ZERO; b * s * h * d];
    random_fill(&mut rng, &mut host, d, 2.0);
    let l = fa4::tensor::Layout::new("q", &[b, s, h, d], None).unwrap();
    let opts = Options::new().causal();
    let p = fa4::Problem::new(DType::Bf16, &l, &l, &l, &l, None, None, &opts).unwrap();
    let dq = cuda.upload(&host).unwrap();
    let mut dout = cuda.alloc::<bf16>(host.len()).unwrap();
    let mut dlse = cuda.alloc::<f32>(p.lse_len()).unwrap();
    cuda.forward_device(&p, &dq, &dq, &dq, None, &mut dout, Some(&mut dlse))
        .unwrap();
    let out = cuda.download(&dout).unwrap();
    let lse = cuda.download(&dlse).unwrap();
    let r = fa4::check::check(&p, &host, &host, &host, &out, Some(&lse)).unwrap();
    assert!(r.passed(), "{r}");
}

/// Device `cu_seqlens` are read back and must be the problem's: the kernels place every row by
/// them, so other contents would write outside the sequences (or the buffers).
#[test]
#[ignore = "needs a CUDA GPU"]
fn device_cu_seqlens_must_match_the_problem() {
    let cuda = gpu();
    let (t, h, d) = (96, 2, 64);
    let mut rng = StdRng::seed_from_u64(10);
    let mut host = vec![bf16::ZERO; t * h * d];
    random_fill(&mut rng, &mut host, d, 2.0);
    let l = fa4::tensor::Layout::new("q", &[t, h, d], None).unwrap();
    let cu = [0, 40, 96];
    let p = fa4::Problem::new(
        DType::Bf16,
        &l,
        &l,
        &l,
        &l,
        Some(&cu),
        Some(&cu),
        &Options::new(),
    )
    .unwrap();
    let dq = cuda.upload(&host).unwrap();
    let mut dout = cuda.alloc::<bf16>(host.len()).unwrap();
    let good = cuda.upload_i32(&cu).unwrap();
    let bad = cuda.upload_i32(&[0, 40, 4000]).unwrap();
    let name = |r: fa4::Result<()>| match r {
        Err(Error::InvalidArgument { name, .. }) => name,
        other => panic!("{other:?}"),
    };
    assert_eq!(
        name(cuda.forward_device(&p, &dq, &dq, &dq, Some((&bad, &good)), &mut dout, None)),
        "cu_seqlens_q"
    );
    assert_eq!(
        name(cuda.forward_device(&p, &dq, &dq, &dq, Some((&good, &bad)), &mut dout, None)),
        "cu_seqlens_k"
    );
    cuda.forward_device(&p, &dq, &dq, &dq, Some((&good, &good)), &mut dout, None)
        .unwrap();
    let out = cuda.download(&dout).unwrap();
    let r = fa4::check::check(&p, &host, &host, &host, &out, None).unwrap();
    assert!(r.passed(), "{r}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn conditional_rescaling_matches_the_oracle() {
    let cuda = gpu();
    let cases = matrix(&[DType::Bf16, DType::F16], &[64, 128, 256]);
    let mut failures = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let mut tiles = fa4::config::sm80::tiles(&cuda.info().arch, case.head_dim).unwrap();
        tiles.lazy_rescale = true;
        let backend = Backend::Cuda(cuda.with_tiles(Some(tiles)));
        match run_case(&backend, case, 9000 + i as u64) {
            Ok(r) if r.passed() => {}
            Ok(r) => failures.push(format!("{case}: {r}")),
            Err(e) => failures.push(format!("{case}: error {e}")),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn two_mma_tiles_per_warp_match_the_oracle() {
    let cuda = gpu();
    let cases = matrix(&[DType::Bf16, DType::F16], &[64, 128]);
    let mut failures = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let tiles = fa4::config::sm80::Tiles {
            block_m: 128,
            block_n: 32,
            num_warps: 4,
            m_tiles: 2,
            stages: 3,
            min_blocks_per_sm: 1,
            q_in_regs: case.head_dim <= 64,
            lazy_rescale: false,
        };
        let backend = Backend::Cuda(cuda.with_tiles(Some(tiles)));
        match run_case(&backend, case, 11000 + i as u64) {
            Ok(r) if r.passed() => {}
            Ok(r) => failures.push(format!("{case}: {r}")),
            Err(e) => failures.push(format!("{case}: error {e}")),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The Hopper kernel, forced, on every matrix case it covers (positive scale, head dims that are
/// multiples of 8 up to 256, padded to tiles of 64/128/192/256 columns, and V narrower than Q/K:
/// 192/128, 96/64; `config::sm90::uncovered` names the rest, which are listed),
/// with the planner's first-choice tiles per head dim (`config::sm90::tiles`; the tiles it picks
/// per sequence length, `tiles_for`, run through the dispatcher in
/// `cuda_backend_passes_the_matrix`). Runs on Hopper GPUs; elsewhere it says why it was skipped.
#[test]
#[ignore = "needs a CUDA GPU"]
fn hopper_kernel_matches_the_oracle() {
    let Some(cuda) = hopper("hopper_kernel_matches_the_oracle") else {
        return;
    };
    hopper_matrix(&cuda, "first-choice tiles", &every_head_dim(), |_| {});
}

/// Every planner switch of the Hopper kernel, alone and together, on the same cases: the
/// intra-warpgroup overlap, ping-pong, conditional rescaling, the persistent launch and the
/// polynomial exponentials (some and all of them). One test per switch, so each stays well
/// under a device call's limit: each compiles its ~48 variants in parallel first (the one test
/// that ran all seven in a row compiled them one by one and passed 600 s) and then runs the ~70
/// Hopper-covered matrix cases, about 10–30 s on an H200 (16 cores).
type Switch = fn(&mut fa4::config::sm90::Tiles);

/// Runs [`hopper_matrix`] with `switch` on a Hopper GPU (skipped, and said so, elsewhere).
fn hopper_switch(test: &str, switch: Switch) {
    if let Some(cuda) = hopper(test) {
        let cases = matrix(&[DType::F16, DType::Bf16], &[64, 96, 128, 256]);
        hopper_matrix(&cuda, test, &cases, switch);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn hopper_switch_no_overlap_matches_the_oracle() {
    hopper_switch("no overlap", |t| t.intra_wg_overlap = false);
}

// Ping-pong and the overlap need exactly two consumer warpgroups (d64 plans three).
#[test]
#[ignore = "needs a CUDA GPU"]
fn hopper_switch_overlap_matches_the_oracle() {
    hopper_switch("overlap", |t| t.intra_wg_overlap = t.consumer_wgs == 2);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn hopper_switch_overlap_pingpong_lazy_matches_the_oracle() {
    hopper_switch("overlap+pingpong+lazy", |t| {
        t.intra_wg_overlap = t.consumer_wgs == 2;
        t.pingpong = t.consumer_wgs == 2;
        t.lazy_rescale = true;
    });
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn hopper_switch_persistent_matches_the_oracle() {
    hopper_switch("persistent", |t| t.persistent = true);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn hopper_switch_persistent_overlap_pingpong_poly2_matches_the_oracle() {
    hopper_switch("persistent+overlap+pingpong+poly2", |t| {
        t.persistent = true;
        t.intra_wg_overlap = t.consumer_wgs == 2;
        t.pingpong = t.consumer_wgs == 2;
        t.poly_exp2 = 2;
    });
}

// The three switches of issue 14 (longest-first order, TMA-store epilogue, cross-tile overlap),
// alone and together. The matrix's problems are a few tiles each, so a persistent CTA mostly runs
// one tile: `persistent_launch_equals_one_cta_per_tile` walks hundreds per launch with them.
// The cross-tile overlap needs the intra-warpgroup overlap (two consumer warpgroups: d64's
// first choice has three, so it takes d64's two-warpgroup tiles), and with the TMA store two Q
// slots (d128's first choice, 176-key blocks, and d256 fit one).
fn cross_tile_on(t: &mut fa4::config::sm90::Tiles) {
    if t.consumer_wgs == 3 {
        (t.consumer_wgs, t.producer_regs, t.consumer_regs) = (2, 40, 232);
    }
    t.persistent = true;
    t.intra_wg_overlap = true;
    t.cross_tile = true;
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn hopper_switch_longest_first_matches_the_oracle() {
    hopper_switch("longest-first", |t| t.longest_first = true);
    hopper_switch("persistent+longest-first", |t| {
        t.persistent = true;
        t.longest_first = true;
    });
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn hopper_switch_tma_store_matches_the_oracle() {
    hopper_switch("tma-store", |t| t.tma_store = true);
    hopper_switch("tma-store, no overlap", |t| {
        t.tma_store = true;
        t.intra_wg_overlap = false;
    });
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn hopper_switch_uniform_desc_matches_the_oracle() {
    hopper_switch("uniform-desc", |t| t.uniform_desc = true);
    hopper_switch("uniform-desc+persistent+overlap+cross-tile", |t| {
        cross_tile_on(t);
        t.uniform_desc = true;
    });
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn hopper_switch_cross_tile_matches_the_oracle() {
    hopper_switch("persistent+overlap+cross-tile", cross_tile_on);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn hopper_switch_longest_first_tma_store_cross_tile_pingpong_matches_the_oracle() {
    hopper_switch("longest-first+tma-store+cross-tile+pingpong", |t| {
        cross_tile_on(t);
        t.longest_first = true;
        t.pingpong = true;
        // Two Q slots for the TMA store beside the cross-tile overlap: d128 with 128-key blocks
        // (its first choice, 176, fits one); d256 (80-key blocks) fits one at any width and
        // keeps the plain store here (the tma-store test runs it).
        if t.block_n == 176 {
            t.block_n = 128;
        }
        t.tma_store = t.block_n != 80;
    });
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn hopper_switch_poly8_matches_the_oracle() {
    hopper_switch("poly8", |t| t.poly_exp2 = 8);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn hopper_switch_two_consumer_warpgroups_match_the_oracle() {
    hopper_switch("two consumer warpgroups", |t| {
        t.consumer_wgs = 2;
        t.producer_regs = 40;
        t.consumer_regs = 232;
    });
}

/// The matrix at every head dim the Hopper kernel pads differently (8 to 256: within a 64-column
/// slab, a whole slab, a slab and a part, …), fp16 and bf16, and with V narrower than Q/K: the
/// MLA prefill shape 192/128 and 96/64 (a V width without its own tiles).
fn every_head_dim() -> Vec<fa4::check::Case> {
    let dtypes = [DType::F16, DType::Bf16];
    let mut cases = matrix(
        &dtypes,
        &[8, 32, 40, 64, 80, 96, 112, 128, 160, 192, 224, 256],
    );
    for (d, dv) in [(192, 128), (96, 64)] {
        cases.extend(matrix(&dtypes, &[d]).into_iter().map(|c| fa4::check::Case {
            head_dim_v: dv,
            ..c
        }));
    }
    cases
}

/// The padded tile widths the planner gives a case's head dims, and the head dims.
fn hopper_dims(d: usize, dv: usize) -> (fa4::config::sm90::Dims, usize, usize) {
    let pad = |x| fa4::config::sm90::padded_head_dim(x).expect("a multiple of 8 up to 256");
    let dims = fa4::config::sm90::Dims {
        qk: pad(d),
        v: pad(dv),
    };
    (dims, d, dv)
}

/// Compiles, in parallel, every Hopper variant the matrix cases can plan with the planner's
/// tiles changed by `switch` (dtype × the cases' head dims × window × softcap × varlen), into
/// the disk cache the backend then loads them from. A variant no case plans costs a compile,
/// not a result; one a case plans that is missing here is compiled at its launch, as without
/// this.
fn precompile_hopper(
    cuda: &CudaBackend,
    cases: &[fa4::check::Case],
    switch: &dyn Fn(&mut fa4::config::sm90::Tiles),
) {
    use rayon::prelude::*;
    let arch = cuda.info().arch;
    let target = match cuda.info().target {
        "sm_90" => "sm_90a",
        other => other,
    };
    let mut shapes: Vec<_> = cases
        .iter()
        .map(|c| hopper_dims(c.head_dim, c.head_dim_v))
        .collect();
    shapes.sort();
    shapes.dedup();
    let mut specs = Vec::new();
    for (dims, dim, dim_v) in shapes {
        let Some(mut tiles) = fa4::config::sm90::tiles(&arch, dims) else {
            continue;
        };
        switch(&mut tiles);
        for bits in 0..16u32 {
            let varlen = bits & 8 != 0;
            let t = tiles;
            specs.push(fa4::config::sm90::KernelSpec {
                target,
                bf16: bits & 1 != 0,
                fp8: false,
                head_dim: dims.qk,
                head_dim_v: dims.v,
                dim,
                dim_v,
                window: bits & 2 != 0,
                softcap: bits & 4 != 0,
                varlen,
                tiles: t,
            });
        }
    }
    let t0 = std::time::Instant::now();
    // A failed compile is reported by the case that plans the variant.
    let compiled = specs
        .par_iter()
        .filter(|s| fa4::cuda::compile::compile(*s).is_ok())
        .count();
    eprintln!(
        "compiled {compiled} of {} Hopper variants in {:.1} s",
        specs.len(),
        t0.elapsed().as_secs_f64()
    );
}

/// The CUDA backend when the GPU is a Hopper one; otherwise says why `test` is skipped.
fn hopper(test: &str) -> Option<fa4::cuda::CudaBackend> {
    let cuda = gpu();
    if cuda.info().arch.family != fa4::arch::Family::Hopper {
        let _ = writeln!(
            std::io::stderr(),
            "{test}: skipped: {} is not a Hopper GPU",
            cuda.info().name
        );
        return None;
    }
    Some(cuda)
}

/// Runs the covered matrix cases on the Hopper kernel with the planner's tiles changed by
/// `switch`, and asserts that every one passes.
fn hopper_matrix(
    cuda: &fa4::cuda::CudaBackend,
    name: &str,
    cases: &[fa4::check::Case],
    switch: impl Fn(&mut fa4::config::sm90::Tiles),
) {
    let arch = cuda.info().arch;
    precompile_hopper(cuda, cases, &switch);
    let t0 = std::time::Instant::now();
    let (mut ran, mut failures, mut uncovered) = (0, Vec::new(), Vec::new());
    for (i, case) in cases.iter().enumerate() {
        let features = fa4::config::sm90::Features {
            head_dim: case.head_dim,
            head_dim_v: case.head_dim_v,
            dtype_size: 2,
            varlen: matches!(case.seqlens, fa4::check::Seqlens::Varlen { .. }),
            nonpositive_scale: case.scale.is_some_and(|s| s <= 0.0),
            no_keys: matches!(case.seqlens, fa4::check::Seqlens::Fixed { k: 0, .. }),
            tiles: 0,
        };
        if let Some(why) = fa4::config::sm90::uncovered(&arch, features) {
            uncovered.push(format!("{case}: {why}"));
            continue;
        }
        let (dims, _, _) = hopper_dims(case.head_dim, case.head_dim_v);
        let mut tiles = fa4::config::sm90::tiles(&arch, dims).expect("covered head dims");
        switch(&mut tiles);
        let backend = Backend::Cuda(
            cuda.with_kernel(fa4::cuda::KernelChoice::Sm90)
                .with_sm90_tiles(Some(tiles)),
        );
        ran += 1;
        match run_case(&backend, case, 9000 + i as u64) {
            Ok(r) if r.passed() => {}
            Ok(r) => failures.push(format!("{case}: {r}")),
            Err(e) => failures.push(format!("{case}: error {e}")),
        }
    }
    eprintln!(
        "hopper kernel ({name}): {ran} cases run in {:.1} s, {} not covered (the sm80 kernel runs them):\n  {}",
        t0.elapsed().as_secs_f64(),
        uncovered.len(),
        uncovered.join("\n  ")
    );
    assert!(ran >= 8 * 6, "{name}: only {ran} cases covered");
    assert!(
        failures.is_empty(),
        "{name}: {} of {ran} cases failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// The persistent launch (one CTA per SM walking several tiles each) against one CTA per tile,
/// on problems of hundreds of tiles: the same kernel computes each tile the same way wherever it
/// runs, so output and LSE must agree bit for bit. Causal (uneven tiles), a window with GQA,
/// d256, and causal with far more queries than keys (tiles with no allowed key at all); with
/// no switches, with overlap and ping-pong, and with conditional rescaling and polynomial
/// exponentials (whose inputs then reach +8). Each head dim's first tile entry, and causal d64
/// also on two consumer warpgroups (128 rows: the dynamic schedule's candidate there, 2k causal
/// +35% on an H100, docs/perf-history.md "Varlen: the dynamic schedule").
#[test]
#[ignore = "needs a CUDA GPU"]
fn persistent_launch_equals_one_cta_per_tile() {
    let Some(cuda) = hopper("persistent_launch_equals_one_cta_per_tile") else {
        return;
    };
    let window = fa4::Mask::Window {
        left: Some(300),
        right: Some(0),
    };
    let arch = cuda.info().arch;
    let first = |d| fa4::config::sm90::tiles(&arch, d).unwrap();
    persistent_case::<bf16>(
        &cuda,
        DType::Bf16,
        [2, 2000, 2000, 16, 128],
        fa4::Mask::Causal,
        first(128),
    );
    persistent_case::<half::f16>(
        &cuda,
        DType::F16,
        [3, 1500, 1500, 12, 64],
        window,
        first(64),
    );
    persistent_case::<bf16>(
        &cuda,
        DType::Bf16,
        [3, 1100, 1100, 12, 256],
        fa4::Mask::None,
        first(256),
    );
    persistent_case::<half::f16>(
        &cuda,
        DType::F16,
        [2, 3000, 500, 16, 128],
        fa4::Mask::Causal,
        first(128),
    );
    let two_wgs = fa4::config::sm90::varlen_tiles(&arch, 64, 2048, 2048).unwrap();
    assert_eq!(two_wgs.consumer_wgs, 2);
    persistent_case::<bf16>(
        &cuda,
        DType::Bf16,
        [3, 2048, 2048, 16, 64],
        fa4::Mask::Causal,
        two_wgs,
    );
}

/// `shape`: batch, seqlen_q, seqlen_k, heads_q (heads_kv = heads_q / 4), head dim; `base`: the
/// tiles whose switches the case turns.
fn persistent_case<T: fa4::Element>(
    cuda: &CudaBackend,
    dtype: DType,
    shape: [usize; 5],
    mask: fa4::Mask,
    base: fa4::config::sm90::Tiles,
) {
    let [batch, seqlen, seqlen_k, heads, d] = shape;
    let arch = cuda.info().arch;
    let what = format!(
        "{dtype:?} b{batch} s{seqlen}/{seqlen_k} h{heads} d{d} {mask:?} {} rows",
        base.block_m()
    );
    let block_m = base.block_m();
    let tiles_total = seqlen.div_ceil(block_m) * heads * batch;
    assert!(
        tiles_total > 2 * arch.sm_count as usize,
        "{what}: {tiles_total} tiles"
    );
    let mut rng = StdRng::seed_from_u64(77);
    let heads_kv = heads / 4;
    let n_q = batch * seqlen * heads * d;
    let n_kv = batch * seqlen_k * heads_kv * d;
    let fill = |rng: &mut StdRng, n: usize| {
        let mut x = vec![T::from_f32(0.0); n];
        random_fill(rng, &mut x, d, 2.0);
        x
    };
    let (q, k, v) = (
        fill(&mut rng, n_q),
        fill(&mut rng, n_kv),
        fill(&mut rng, n_kv),
    );
    let ql = fa4::tensor::Layout::new("q", &[batch, seqlen, heads, d], None).unwrap();
    let kl = fa4::tensor::Layout::new("k", &[batch, seqlen_k, heads_kv, d], None).unwrap();
    let opts = Options::new().mask(mask);
    let p = fa4::Problem::new(dtype, &ql, &kl, &kl, &ql, None, None, &opts).unwrap();
    // Switch sets: 0 none, 1 overlap + ping-pong, 2 overlap + conditional rescaling + poly 2/8,
    // 3 overlap + longest-first + TMA store (+ cross-tile when persistent, where two Q slots
    // fit), 4 overlap + longest-first + cross-tile when persistent (plain store), 5 and 6 the
    // dynamic schedule when persistent (5: TMA store + cross-tile where it fits, 6: longest-first
    // + cross-tile, plain store). The dynamic schedule, the cross-tile
    // overlap and the longest-first order only rearrange when each tile is computed, and the TMA
    // store writes the same bits: all must equal one CTA per tile bit for bit.
    let run = |persistent: bool, switches: u8| {
        let mut tiles = base;
        tiles.persistent = persistent;
        tiles.intra_wg_overlap = switches > 0 && tiles.consumer_wgs == 2;
        tiles.pingpong = switches == 1 && tiles.consumer_wgs == 2;
        tiles.lazy_rescale = switches == 2;
        tiles.poly_exp2 = if switches == 2 { 2 } else { 0 };
        tiles.longest_first = switches == 3 || switches == 4 || switches == 6;
        tiles.tma_store = switches == 3 || switches == 5;
        tiles.cross_tile = switches >= 3
            && persistent
            && tiles.intra_wg_overlap
            && !(tiles.tma_store && tiles.q_stages(d) < 2);
        tiles.dynamic = switches >= 5 && persistent;
        let b = cuda
            .with_kernel(fa4::cuda::KernelChoice::Sm90)
            .with_sm90_tiles(Some(tiles));
        // Poisoned outputs: a tile the launch skips stays NaN.
        let mut out = vec![T::from_f32(f32::NAN); n_q];
        let mut lse = vec![f32::NAN; p.lse_len()];
        b.forward_host(&p, &q, &k, &v, &mut out, Some(&mut lse))
            .unwrap();
        assert!(
            out.iter().all(|x| x.to_f32().is_finite()) && lse.iter().all(|x| !x.is_nan()),
            "{what}: persistent={persistent} switches {switches} left outputs unwritten"
        );
        (out, lse)
    };
    for switches in [0, 1, 2, 3, 4, 5, 6] {
        let (a, b) = (run(false, switches), run(true, switches));
        let same_out =
            a.0.iter()
                .zip(&b.0)
                .all(|(x, y)| x.to_f32().to_bits() == y.to_f32().to_bits());
        let same_lse =
            a.1.iter()
                .zip(&b.1)
                .all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(
            same_out && same_lse,
            "{what} switches {switches}: the persistent launch differs (out equal {same_out}, lse equal {same_lse})"
        );
        if switches > 0 {
            // And once against the oracle.
            let r = fa4::check::check(&p, &q, &k, &v, &b.0, Some(&b.1)).unwrap();
            assert!(r.passed(), "{what} persistent: {r}");
        }
    }
}

/// Variable-length batches on the Hopper kernel: sequences longer and shorter than a tile,
/// empty ones (no queries; no keys), GQA, every mask kind, fp16 and bf16, with one CTA per tile
/// and persistent (4 heads: about one tile per CTA; 24 heads: several, the empty ones skipped),
/// with the TMA store (a sequence's partial last block stored plainly) and without, on the
/// dynamic schedule (plain, TMA store, cross-tile; 24 heads: tiles claimed from the counter), and the sm80
/// kernel on the same inputs, through tensors with implicit (packed) strides. The packed tensors put the next sequence's rows behind each sequence's last
/// key block, and here those rows hold NaN (in V) and +inf (in K): foreign scores must be masked
/// and foreign V rows must not reach P·V (0 · NaN is NaN), so only the sequences that own them
/// may turn non-finite, as the oracle says (an infinite score: LSE +inf, O NaN).
#[test]
#[ignore = "needs a CUDA GPU"]
fn varlen_batches_on_the_hopper_kernel() {
    let Some(cuda) = hopper("varlen_batches_on_the_hopper_kernel") else {
        return;
    };
    let window = fa4::Mask::Window {
        left: Some(100),
        right: Some(20),
    };
    let mut failures = Vec::new();
    for d in [64, 96, 128, 256] {
        failures.extend(varlen_case::<bf16>(&cuda, d, fa4::Mask::None, 4));
        failures.extend(varlen_case::<half::f16>(&cuda, d, fa4::Mask::Causal, 4));
        failures.extend(varlen_case::<bf16>(&cuda, d, window, 4));
        failures.extend(varlen_case::<bf16>(&cuda, d, fa4::Mask::Causal, 24));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// One varlen problem at head dim `d` with `heads` query heads (half as many KV heads), run on
/// the Hopper kernel with one CTA per tile and persistent, each with and without the TMA store
/// (all four bit for bit equal, and against the oracle), and on the sm80 kernel; the failures.
fn varlen_case<T: fa4::Element>(
    cuda: &CudaBackend,
    d: usize,
    mask: fa4::Mask,
    heads: usize,
) -> Vec<String> {
    let q_lens = [300usize, 1, 0, 517, 130, 64];
    let k_lens = [300usize, 77, 5, 600, 0, 64];
    let cu = |lens: &[usize]| -> Vec<i32> {
        std::iter::once(0)
            .chain(lens.iter().scan(0, |a, &x| {
                *a += x;
                Some(*a as i32)
            }))
            .collect()
    };
    let (cq, ck) = (cu(&q_lens), cu(&k_lens));
    let (tq, tk) = (cq[q_lens.len()] as usize, ck[k_lens.len()] as usize);
    let heads_kv = heads / 2;
    let mut rng = StdRng::seed_from_u64(d as u64);
    let fill = |rng: &mut StdRng, n: usize| {
        let mut x = vec![T::from_f32(0.0); n];
        random_fill(rng, &mut x, d, 2.0);
        x
    };
    let q = fill(&mut rng, tq * heads * d);
    let mut k = fill(&mut rng, tk * heads_kv * d);
    let mut v = fill(&mut rng, tk * heads_kv * d);
    // Sequence 1's V row 10 is NaN: sequence 0's last key block reads it.
    v[(ck[1] as usize + 10) * heads_kv * d] = T::from_f32(f32::NAN);
    // Sequence 5's K row 3 (KV head 1) is +inf: sequence 3's last key block reads it.
    k[((ck[5] as usize + 3) * heads_kv + 1) * d] = T::from_f32(f32::INFINITY);
    let dtype = T::DTYPE;
    let what = format!("{dtype:?} d{d} h{heads} {mask:?} varlen q={q_lens:?} k={k_lens:?}");
    let (qt, kt, vt) = (
        Tensor::new(&q, &[tq, heads, d]).unwrap(),
        Tensor::new(&k, &[tk, heads_kv, d]).unwrap(),
        Tensor::new(&v, &[tk, heads_kv, d]).unwrap(),
    );
    let opts = Options::new().mask(mask);
    let arch = cuda.info().arch;
    let mut failures = Vec::new();
    let mut outs = Vec::new();
    // The Hopper kernel: one CTA per tile and the static persistent walk, plain and TMA-stored
    // O; the dynamic schedule (the planner's tiles) plain, TMA-stored and with the cross-tile
    // overlap where its tiles take it; then sm80.
    let dims = fa4::config::sm90::Dims::from(fa4::config::sm90::padded_head_dim(d).unwrap());
    let mut runs: Vec<(String, Option<fa4::config::sm90::Tiles>)> = Vec::new();
    for (persistent, tma_store) in [(false, false), (true, false), (false, true), (true, true)] {
        let mut tiles = fa4::config::sm90::tiles_for(&arch, dims, 517, 600).unwrap();
        tiles.persistent = persistent;
        tiles.tma_store = tma_store;
        runs.push((
            format!("sm90 persistent={persistent} tma_store={tma_store}"),
            Some(tiles),
        ));
    }
    let dynamic = fa4::config::sm90::varlen_tiles(&arch, dims, 517, 600).unwrap();
    assert!(dynamic.dynamic && dynamic.persistent);
    runs.push(("sm90 dynamic".into(), Some(dynamic)));
    runs.push((
        "sm90 dynamic tma_store".into(),
        Some(fa4::config::sm90::Tiles {
            tma_store: true,
            ..dynamic
        }),
    ));
    let cross = fa4::config::sm90::Tiles {
        intra_wg_overlap: true,
        cross_tile: true,
        ..dynamic
    };
    if cross.check(dims, &arch).is_ok() {
        runs.push(("sm90 dynamic cross_tile".into(), Some(cross)));
    }
    runs.push(("sm80".into(), None));
    for (label, tiles) in runs {
        let kernel = if tiles.is_some() { "sm90" } else { "sm80" };
        let b = Backend::Cuda(match tiles {
            None => cuda.with_kernel(fa4::cuda::KernelChoice::Sm80),
            Some(t) => cuda
                .with_kernel(fa4::cuda::KernelChoice::Sm90)
                .with_sm90_tiles(Some(t)),
        });
        let mut o = vec![T::from_f32(f32::NAN); tq * heads * d];
        let mut lse = vec![f32::NAN; heads * tq];
        let mut ot = TensorMut::new(&mut o, &[tq, heads, d]).unwrap();
        let run = b.forward_varlen(&qt, &kt, &vt, &cq, &ck, &mut ot, Some(&mut lse), &opts);
        if let Err(e) = run {
            failures.push(format!("{what} {label}: error {e}"));
            continue;
        }
        let p = fa4::Problem::new(
            dtype,
            qt.layout(),
            kt.layout(),
            vt.layout(),
            qt.layout(),
            Some(&cq),
            Some(&ck),
            &opts,
        )
        .unwrap();
        let r = fa4::check::check(&p, &q, &k, &v, &o, Some(&lse)).unwrap();
        if !r.passed() {
            failures.push(format!("{what} {label}: {r}"));
        }
        let block_m = tiles.map_or(0, |t| t.block_m());
        outs.push((kernel, block_m, label, o, lse));
    }
    // The Hopper kernel's launches of one tile height compute every tile the same way: the
    // same bits (NaN compared by its bits too). (At d64 the dynamic schedule's tiles are 128
    // rows high, the others 192; a causal row's key blocks then differ by masked ones.)
    let bits = |o: &[T]| o.iter().map(|x| x.to_f32().to_bits()).collect::<Vec<_>>();
    let sm90: Vec<_> = outs.iter().filter(|r| r.0 == "sm90").collect();
    for (i, (_, block_m, label, o, lse)) in sm90.iter().enumerate() {
        let Some(first) = sm90[..i].iter().find(|r| r.1 == *block_m) else {
            continue;
        };
        let same_lse = lse
            .iter()
            .zip(&first.4)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        if bits(o) != bits(&first.3) || !same_lse {
            failures.push(format!(
                "{what}: Hopper launch {label} differs from {}",
                first.2
            ));
        }
    }
    let outs: Vec<_> = outs.into_iter().map(|r| r.3).collect();
    // The NaN really was read as a foreign row and stayed out: sequence 0 is finite.
    for o in &outs {
        if !o[..300 * heads * d].iter().all(|x| x.to_f32().is_finite()) {
            failures.push(format!("{what}: sequence 0 is not finite"));
        }
    }
    failures
}

/// A NaN in V at key 100 under a causal mask leaves rows 0..99 finite: P = 0 there, but the
/// block's P·V would multiply that V row by it, and 0 · NaN is NaN (docs/attention.md, rule 7).
/// The CPU backend passes the same case (`tests/cpu_matrix.rs`). Both kernels' epilogues see a NaN
/// in such a row's O and flag it; the fixup kernel recomputes it (`kernels/common/exact.cuh`).
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_non_finite_keys_reach_only_their_rows() {
    non_finite_case(true, false);
}

/// A +inf score gives LSE +inf (not NaN), in its first key block or a later one, however many
/// blocks follow. Known limit of both kernels (docs/perf.md, 2026-12-01, commit 8538b9a): rows
/// that see few keys get NaN from the fast path (0 · inf in a lane's partial sum when the
/// correction after a +inf max is exp2(+inf)); the epilogue sees the sum is not finite, stores
/// the row as NaN and the fixup kernel recomputes it (`kernels/common/exact.cuh`).
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_infinite_score_then_more_blocks_gives_infinite_lse() {
    non_finite_case(false, true);
}

/// Q, K, V of 300 rows, 2 heads, d64, causal: `nan_v` puts a NaN in V at key 100 (head 0),
/// `inf_k` a +inf in K at key 1 (head 1) and at key 200 (head 0), each against a positive Q
/// column: head 1's rows 1.. see a +inf score in their first key block and then more blocks
/// (row 0 masks key 1), head 0's rows 200.. after a finite maximum.
fn non_finite_case(nan_v: bool, inf_k: bool) {
    let cuda = gpu();
    let (s, h, d) = (300, 2, 64);
    let mut rng = StdRng::seed_from_u64(5);
    let mut q = vec![bf16::ZERO; s * h * d];
    let mut k = vec![bf16::ZERO; s * h * d];
    let mut v = vec![bf16::ZERO; s * h * d];
    for x in [&mut q, &mut k, &mut v] {
        random_fill(&mut rng, x, d, 2.0);
    }
    if nan_v {
        v[100 * h * d] = bf16::NAN;
    }
    if inf_k {
        k[h * d + d] = bf16::INFINITY; // key 1, head 1, column 0
        k[200 * h * d] = bf16::INFINITY; // key 200, head 0, column 0
        for x in q.iter_mut().step_by(d) {
            *x = bf16::from_f32(x.to_f32().abs() + 0.5); // column 0 of both heads
        }
    }
    let l = [1, s, h, d];
    let lo = fa4::tensor::Layout::new("q", &l, None).unwrap();
    let opts = Options::new().causal();
    let p = fa4::Problem::new(DType::Bf16, &lo, &lo, &lo, &lo, None, None, &opts).unwrap();
    let mut failures = Vec::new();
    for kernel in [fa4::cuda::KernelChoice::Auto, fa4::cuda::KernelChoice::Sm80] {
        let b = cuda.with_kernel(kernel);
        let mut o = vec![bf16::NAN; s * h * d];
        let mut lse = vec![f32::NAN; h * s];
        b.forward_host(&p, &q, &k, &v, &mut o, Some(&mut lse))
            .unwrap();
        if inf_k {
            // LSE is +inf exactly on the rows that see a +inf score (head 0: rows 200..; head
            // 1: rows 1..), finite on the others.
            for (head, first) in [(0, 200), (1, 1)] {
                let bad: Vec<usize> = (0..s)
                    .filter(|&i| (lse[head * s + i] == f32::INFINITY) != (i >= first))
                    .collect();
                if let Some(&i) = bad.first() {
                    failures.push(format!(
                        "{kernel:?}: head {head}: {} rows with the wrong LSE, first row {i}: {}",
                        bad.len(),
                        lse[head * s + i]
                    ));
                }
            }
        }
        let r = fa4::check::check(&p, &q, &k, &v, &o, Some(&lse)).unwrap();
        if !r.passed() {
            failures.push(format!("{kernel:?}: {r}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// NaN in V under a window (left 40, right 7) reaches exactly the rows that allow its key, in
/// both dtypes and both kernels (d64: the Hopper kernel's planned tiles there run without the
/// intra-warpgroup overlap, where the reverted fix could run): at key 100 of head 0 (rows 93..=140 see
/// it), at keys 150 and 250 of head 1 (other columns). Every other row stays finite and matches
/// the oracle: the blocks holding those keys are seen in part by the rows around them, whose
/// P = 0 must not multiply the V row. (An infinity is caught by the same check, but a 16-bit P
/// that underflows to 0 where the oracle's is tiny turns inf into NaN.) Fixed as above, by the
/// epilogue's flag and the fixup kernel.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_non_finite_v_under_a_window_reaches_only_its_rows() {
    let cuda = gpu();
    let mut failures = non_finite_v_window_case::<bf16>(&cuda, DType::Bf16);
    failures.extend(non_finite_v_window_case::<half::f16>(&cuda, DType::F16));
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

fn non_finite_v_window_case<T: fa4::Element>(cuda: &CudaBackend, dtype: DType) -> Vec<String> {
    let (s, h, d) = (300, 2, 64);
    let mut rng = StdRng::seed_from_u64(9);
    let mut q = vec![T::from_f32(0.0); s * h * d];
    let mut k = q.clone();
    let mut v = q.clone();
    for x in [&mut q, &mut k, &mut v] {
        random_fill(&mut rng, x, d, 2.0);
    }
    v[100 * h * d] = T::from_f32(f32::NAN);
    v[(150 * h + 1) * d + 5] = T::from_f32(f32::NAN);
    v[(250 * h + 1) * d + 9] = T::from_f32(f32::NAN);
    let lo = fa4::tensor::Layout::new("q", &[1, s, h, d], None).unwrap();
    let opts = Options::new().window(Some(40), Some(7));
    let p = fa4::Problem::new(dtype, &lo, &lo, &lo, &lo, None, None, &opts).unwrap();
    let mut failures = Vec::new();
    for kernel in [fa4::cuda::KernelChoice::Auto, fa4::cuda::KernelChoice::Sm80] {
        let b = cuda.with_kernel(kernel);
        let mut o = vec![T::from_f32(f32::NAN); s * h * d];
        let mut lse = vec![f32::NAN; h * s];
        b.forward_host(&p, &q, &k, &v, &mut o, Some(&mut lse))
            .unwrap();
        // Rows that see a non-finite V: head 0 rows 93..=140 (key 100), head 1 rows 143..=190
        // (key 150) and 243..=290 (key 250); the others must be finite everywhere.
        let sees = |head: usize, i: usize| {
            let keys: &[usize] = if head == 0 { &[100] } else { &[150, 250] };
            keys.iter().any(|&j| i + 7 >= j && i <= j + 40)
        };
        for head in 0..h {
            let leaked: Vec<usize> = (0..s)
                .filter(|&i| {
                    !sees(head, i)
                        && o[(i * h + head) * d..(i * h + head + 1) * d]
                            .iter()
                            .any(|x| !x.to_f32().is_finite())
                })
                .collect();
            if let Some(&i) = leaked.first() {
                failures.push(format!(
                    "{dtype:?} {kernel:?} head {head}: {} rows that mask every non-finite key are not finite, first {i}",
                    leaked.len()
                ));
            }
        }
        let r = fa4::check::check(&p, &q, &k, &v, &o, Some(&lse)).unwrap();
        if !r.passed() {
            failures.push(format!("{dtype:?} {kernel:?}: {r}"));
        }
    }
    failures
}

/// Finite scores of any magnitude give finite O and LSE within the tolerance: a Q element of
/// 1e12 (scores ~1e12), and a scale of 1e10 (exponents ~1e11), with and without a causal mask.
/// The old exponent form `exp2(s·c − RN(m·c))` lost the row max's own exponent there (P = inf or
/// 0: NaN rows, or O = 0 and LSE = −inf). Three exact forms inside the key loop cost 3–13% on
/// ordinary inputs (docs/perf.md, H200, 2026-12-01; reverted, the last two in f148c4f and
/// 8538b9a); now the loop is unchanged and the epilogue flags rows whose |max · scale · log2 e|
/// reaches 2^14 and the fixup kernel recomputes them (`kernels/common/exact.cuh`).
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_huge_finite_scores_give_finite_answers() {
    let cuda = gpu();
    let mut failures = Vec::new();
    for (d, big_q, scale, causal) in [
        (64, 1e12f32, None, false),
        (128, 1e12, None, true),
        (64, 0.0, Some(1e10f32), false),
        (128, 0.0, Some(1e10), true),
        (256, 0.0, Some(3e8), true),
    ] {
        let (s, h) = (300, 2);
        let mut rng = StdRng::seed_from_u64(11);
        let mut q = vec![bf16::ZERO; s * h * d];
        let mut k = vec![bf16::ZERO; s * h * d];
        let mut v = vec![bf16::ZERO; s * h * d];
        for x in [&mut q, &mut k, &mut v] {
            random_fill(&mut rng, x, d, 2.0);
        }
        if big_q > 0.0 {
            // Column 3 of every query row (both heads).
            for x in q.iter_mut().skip(3).step_by(d) {
                *x = bf16::from_f32(big_q);
            }
        }
        let lo = fa4::tensor::Layout::new("q", &[1, s, h, d], None).unwrap();
        let mut opts = if causal {
            Options::new().causal()
        } else {
            Options::new()
        };
        if let Some(sc) = scale {
            opts = opts.scale(sc);
        }
        let p = fa4::Problem::new(DType::Bf16, &lo, &lo, &lo, &lo, None, None, &opts).unwrap();
        for kernel in [fa4::cuda::KernelChoice::Auto, fa4::cuda::KernelChoice::Sm80] {
            let b = cuda.with_kernel(kernel);
            let mut o = vec![bf16::NAN; s * h * d];
            let mut lse = vec![f32::NAN; h * s];
            b.forward_host(&p, &q, &k, &v, &mut o, Some(&mut lse))
                .unwrap();
            let case = format!("d{d} q {big_q:e} scale {scale:?} causal {causal} {kernel:?}");
            let nonfinite = o.iter().filter(|x| !x.to_f32().is_finite()).count()
                + lse.iter().filter(|x| !x.is_finite()).count();
            if nonfinite > 0 {
                failures.push(format!("{case}: {nonfinite} non-finite outputs"));
                continue;
            }
            let r = fa4::check::check(&p, &q, &k, &v, &o, Some(&lse)).unwrap();
            let (ok, lse_max) = passes_with_relative_lse(&r, &lse);
            if !ok {
                failures.push(format!("{case}: {r} (max |LSE| {lse_max:e})"));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The fixup kernel (`kernels/common/exact.cuh`) reads Q, K and V itself: its
/// indexing and score must agree with the oracle beyond the cases above. Every row is sent there
/// by a huge negative scale (|max · scale · log2 e| far above 2^14), or, with a softcap (scores
/// stay small), by a NaN in V at key 100 that rows 96..=99 mask within its key block; GQA (4 query
/// heads on 2 KV heads), a head dim that the kernels pad (96), a window and a causal mask, and a
/// batch of 2 with strides between entries.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_exact_fallback_matches_the_oracle() {
    let cuda = gpu();
    let mut failures = Vec::new();
    for (d, scale, softcap, window) in [
        (96, -3e8f32, None, Some((30, 5))),
        (128, 0.1, Some(20f32), None),
        (64, -1e9, None, None),
    ] {
        let (b, s, hq, hk) = (2, 200, 4, 2);
        let mut rng = StdRng::seed_from_u64(17);
        let mut q = vec![bf16::ZERO; b * s * hq * d];
        let mut k = vec![bf16::ZERO; b * s * hk * d];
        let mut v = vec![bf16::ZERO; b * s * hk * d];
        for x in [&mut q, &mut k, &mut v] {
            random_fill(&mut rng, x, d, 2.0);
        }
        if softcap.is_some() {
            // Batch 1, key 100, KV head 1 (query heads 2 and 3), column 7.
            v[((s + 100) * hk + 1) * d + 7] = bf16::NAN;
        }
        let lq = fa4::tensor::Layout::new("q", &[b, s, hq, d], None).unwrap();
        let lk = fa4::tensor::Layout::new("k", &[b, s, hk, d], None).unwrap();
        let mut opts = match window {
            Some((l, r)) => Options::new().window(Some(l), Some(r)),
            None => Options::new().causal(),
        };
        opts = opts.scale(scale);
        if let Some(c) = softcap {
            opts = opts.softcap(c);
        }
        let p = fa4::Problem::new(DType::Bf16, &lq, &lk, &lk, &lq, None, None, &opts).unwrap();
        for kernel in [fa4::cuda::KernelChoice::Auto, fa4::cuda::KernelChoice::Sm80] {
            let case =
                format!("d{d} scale {scale:e} softcap {softcap:?} window {window:?} {kernel:?}");
            let bk = cuda.with_kernel(kernel);
            let mut o = vec![bf16::NAN; b * s * hq * d];
            let mut lse = vec![f32::NAN; b * hq * s];
            if let Err(e) = bk.forward_host(&p, &q, &k, &v, &mut o, Some(&mut lse)) {
                failures.push(format!("{case}: {e}"));
                continue;
            }
            let r = fa4::check::check(&p, &q, &k, &v, &o, Some(&lse)).unwrap();
            if !passes_with_relative_lse(&r, &lse).0 {
                failures.push(format!("{case}: {r}"));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The verdict of the huge-score tests, and the largest finite |LSE|: O by the rule, the LSE
/// relative to its size (huge scores put it near 1e9..1e11, where one f32 ulp reaches 2^13). A
/// first bad position without a column is an LSE, judged by the relative bound instead.
fn passes_with_relative_lse(r: &fa4::check::Report, lse: &[f32]) -> (bool, f64) {
    let lse_max = lse
        .iter()
        .filter(|x| x.is_finite())
        .fold(0f64, |m, &x| m.max(f64::from(x).abs()));
    let lse_ok = r
        .lse_err
        .is_none_or(|e| e <= r.lse_bound.max(1e-6 * lse_max));
    let o_ok = r.first_bad.is_none_or(|(pos, _, _)| pos.col.is_none())
        && r.finiteness_mismatches == 0
        && r.max_err <= r.bound;
    (o_ok && lse_ok, lse_max)
}
