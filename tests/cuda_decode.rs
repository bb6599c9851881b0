//! The GPU decode kernels (split-KV over a paged cache, the combine, the append) against the
//! float64 paged oracle: tests/decode.rs's matrix (page sizes 1/3/16/64/256, shuffled tables
//! with NaN in every unused slot, seqlens_k 0 and page boundaries, split counts from 1 past the
//! key blocks, GQA 1/4/8, causal/window/softcap, seqlen_q 1 and 4, varlen queries) in fp16 and
//! bf16 at head dims 64/128/256, with outputs poisoned with NaN before each call. Every test is
//! ignored unless run with `--include-ignored`, and fails, not passes, where no GPU works.
//!
//! Kernel variants: every test runs the variant `FA4_DECODE_VARIANT` names (`auto` when
//! unset), so `bench/device_check.sh DIR decode` runs this binary once per variant;
//! `the_environments_variant_is_the_one_planned` proves which ran, and
//! `every_variant_matches_the_oracle_in_one_process` switches variants on one set of tables.
//! The fused combine (`fuse`): `the_fused_combine_matches_the_oracle_call_after_call` (split
//! counts 1 to MAX_SPLITS, calls back to back that rely on the arrival counters' reset).

use fa4::config::decode::{DecodeTiles, MAX_SPLITS};
use fa4::config::decode_gpu::DecodeVariant;
use fa4::cuda::CudaBackend;
use fa4::paged::random::{random_paged, PagedInputs, PagedSpec};
use fa4::paged::{self, reference, PagedCache, PagedOptions};
use fa4::tensor::Layout;
use fa4::{Backend, Element, Error, Options, Tensor, TensorMut};
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn gpu() -> CudaBackend {
    match CudaBackend::new(0) {
        Ok(b) => b,
        Err(e) => panic!("needs a CUDA GPU (run with --include-ignored only where one works): {e}"),
    }
}

fn arg_of(e: Error) -> String {
    match e {
        Error::InvalidArgument { name, .. } => name,
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

/// Runs the GPU with `splits` on NaN-poisoned outputs and judges it; returns the splits run.
fn run_and_check<T: Element>(
    cuda: &CudaBackend,
    inputs: &PagedInputs<T>,
    opts: Options,
    splits: Option<usize>,
    what: &str,
) -> usize {
    let kv = inputs.kv().unwrap();
    let q = Tensor::new(&inputs.q, &inputs.q_shape).unwrap();
    let p = inputs.problem(&opts).unwrap();
    let mut o_shape = inputs.q_shape.clone();
    *o_shape.last_mut().unwrap() = inputs.v_shape[3];
    let mut o = vec![T::NAN; o_shape.iter().product()];
    let mut lse = vec![f32::NAN; p.lse_len()];
    let mut popts = PagedOptions::new(opts);
    popts.num_splits = splits;
    let plan = Backend::Cuda(cuda.clone())
        .forward_paged(
            &q,
            &kv,
            inputs.cu_seqlens_q.as_deref(),
            &mut TensorMut::new(&mut o, &o_shape).unwrap(),
            Some(&mut lse),
            &popts,
        )
        .unwrap_or_else(|e| panic!("{what} splits {splits:?}: {e}"));
    let report = reference::check(
        &p,
        &inputs.q,
        &inputs.k_cache,
        &inputs.v_cache,
        &o,
        Some(&lse),
    )
    .unwrap();
    assert!(report.passed(), "{what} splits {splits:?}: {report}");
    plan.num_splits
}

fn masks() -> Vec<(&'static str, Options)> {
    vec![
        ("none", Options::new()),
        ("causal", Options::new().causal()),
        ("window 5,0", Options::new().window(Some(5), Some(0))),
        (
            "window 170,3 softcap",
            Options::new().window(Some(170), Some(3)).softcap(5.0),
        ),
        ("softcap", Options::new().softcap(2.0)),
        ("negative scale", Options::new().scale(-0.07)),
    ]
}

/// Empty, exactly one and two pages, a page and one key, and a random length of a few blocks.
fn ragged(rng: &mut StdRng, page_size: usize) -> Vec<usize> {
    vec![
        0,
        page_size,
        2 * page_size,
        page_size + 1,
        rng.random_range(1..700),
    ]
}

fn matrix_case<T: Element>(cuda: &CudaBackend, rng: &mut StdRng, spec: &PagedSpec, case: usize) {
    let all = masks();
    let (name, opts) = all[case % all.len()];
    let inputs = random_paged::<T, _>(rng, spec).unwrap();
    let what = format!(
        "{} d{} page {} heads {}/{} sq {:?} varlen {} {name}",
        T::DTYPE,
        spec.head_dim,
        spec.page_size,
        spec.heads_q,
        spec.heads_kv,
        spec.seqlens_q,
        spec.varlen
    );
    run_and_check(cuda, &inputs, opts, None, &what);
    let blocks = spec
        .seqlens_k
        .iter()
        .max()
        .unwrap()
        .div_ceil(DecodeTiles::gpu(spec.head_dim).block_n);
    for s in [1, blocks.div_ceil(2).max(1), blocks + 1] {
        assert_eq!(run_and_check(cuda, &inputs, opts, Some(s), &what), s);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn paged_matrix_against_the_oracle() {
    let cuda = gpu();
    let mut rng = StdRng::seed_from_u64(15);
    let mut case = 0;
    for page_size in [1, 3, 16, 64, 256] {
        for (hq, hkv) in [(2, 2), (8, 2), (8, 1)] {
            for (seqlen_q, varlen) in [(1, false), (4, false), (0, true)] {
                let seqlens_k = ragged(&mut rng, page_size);
                let seqlens_q = if varlen {
                    vec![1, 0, 4, 3, 2]
                } else {
                    vec![seqlen_q; seqlens_k.len()]
                };
                let head_dim = [64, 128, 256][case % 3];
                let spec = PagedSpec {
                    seqlens_q,
                    seqlens_k,
                    heads_q: hq,
                    heads_kv: hkv,
                    head_dim,
                    head_dim_v: head_dim,
                    page_size,
                    varlen,
                };
                if case % 2 == 0 {
                    matrix_case::<bf16>(&cuda, &mut rng, &spec, case);
                } else {
                    matrix_case::<f16>(&cuda, &mut rng, &spec, case);
                }
                case += 1;
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn every_split_count_and_two_row_tiles() {
    // 8 query heads on 1 KV head at seqlen_q 8: 64 packed rows, two tiles of 32 at d128.
    let cuda = gpu();
    let mut rng = StdRng::seed_from_u64(3);
    let spec = PagedSpec {
        seqlens_q: vec![8, 8, 8],
        seqlens_k: vec![1029, 300, 0],
        heads_q: 8,
        heads_kv: 1,
        head_dim: 128,
        head_dim_v: 128,
        page_size: 16,
        varlen: false,
    };
    let inputs = random_paged::<bf16, _>(&mut rng, &spec).unwrap();
    let blocks = 1029usize.div_ceil(128);
    for s in 1..=blocks + 1 {
        run_and_check(&cuda, &inputs, Options::new().causal(), Some(s), "causal");
        run_and_check(&cuda, &inputs, Options::new(), Some(s), "none");
    }
    run_and_check(
        &cuda,
        &inputs,
        Options::new(),
        Some(MAX_SPLITS),
        "max splits",
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_long_decode_splits_and_matches_the_oracle() {
    // The head layout (32/8, d128) at 20k keys in pages of 16: the planner splits.
    let cuda = gpu();
    let mut rng = StdRng::seed_from_u64(7);
    let spec = PagedSpec {
        seqlens_q: vec![1],
        seqlens_k: vec![20000],
        heads_q: 32,
        heads_kv: 8,
        head_dim: 128,
        head_dim_v: 128,
        page_size: 16,
        varlen: false,
    };
    let inputs = random_paged::<bf16, _>(&mut rng, &spec).unwrap();
    let s = run_and_check(&cuda, &inputs, Options::new(), None, "20k");
    assert!(
        s > 1,
        "the planner should split one sequence over 132 SMs, gave {s}"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn device_buffers_reuse_tables_and_reject_foreign_ones() {
    let cuda = gpu();
    let mut rng = StdRng::seed_from_u64(11);
    let spec = PagedSpec {
        seqlens_q: vec![1, 1],
        seqlens_k: vec![300, 45],
        heads_q: 8,
        heads_kv: 2,
        head_dim: 64,
        head_dim_v: 64,
        page_size: 16,
        varlen: false,
    };
    let inputs = random_paged::<f16, _>(&mut rng, &spec).unwrap();
    let p = inputs.problem(&Options::new()).unwrap();
    let mut tables = cuda.paged_tables(&p).unwrap();
    let (dq, dk, dv) = (
        cuda.upload(&inputs.q).unwrap(),
        cuda.upload(&inputs.k_cache).unwrap(),
        cuda.upload(&inputs.v_cache).unwrap(),
    );
    let mut dout = cuda.upload(&vec![f16::NAN; inputs.q.len()]).unwrap();
    let mut dlse = cuda.upload(&vec![f32::NAN; p.lse_len()]).unwrap();
    for s in [1, 3, 1] {
        cuda.forward_paged_device(
            &p,
            &mut tables,
            &dq,
            &dk,
            &dv,
            &mut dout,
            Some(&mut dlse),
            Some(s),
        )
        .unwrap();
        let (o, l) = (cuda.download(&dout).unwrap(), cuda.download(&dlse).unwrap());
        let r = reference::check(
            &p,
            &inputs.q,
            &inputs.k_cache,
            &inputs.v_cache,
            &o,
            Some(&l),
        )
        .unwrap();
        assert!(r.passed(), "splits {s}: {r}");
    }
    // Tables of another cache (other lengths) are refused before any launch.
    let mut other = inputs.clone();
    other.seqlens_k[1] = 44;
    let p2 = other.problem(&Options::new()).unwrap();
    let e = cuda
        .forward_paged_device(&p2, &mut tables, &dq, &dk, &dv, &mut dout, None, None)
        .unwrap_err();
    assert_eq!(arg_of(e), "page_table");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn unsupported_problems_are_refused_by_name() {
    let cuda = gpu();
    let mut rng = StdRng::seed_from_u64(5);
    let mut spec = PagedSpec {
        seqlens_q: vec![1],
        seqlens_k: vec![40],
        heads_q: 2,
        heads_kv: 1,
        head_dim: 96,
        head_dim_v: 96,
        page_size: 16,
        varlen: false,
    };
    let refuse = |inputs: &PagedInputs<bf16>| {
        let p = inputs.problem(&Options::new()).unwrap();
        let mut o =
            vec![bf16::ZERO; inputs.q.len() / p.cache().head_dim() * p.cache().head_dim_v()];
        Backend::Cuda(cuda.clone())
            .run_paged(
                &p,
                &inputs.q,
                &inputs.k_cache,
                &inputs.v_cache,
                &mut o,
                None,
                None,
            )
            .unwrap_err()
    };
    assert_eq!(
        arg_of(refuse(&random_paged(&mut rng, &spec).unwrap())),
        "k_cache"
    );
    spec.head_dim = 64;
    spec.head_dim_v = 128;
    assert_eq!(
        arg_of(refuse(&random_paged(&mut rng, &spec).unwrap())),
        "v_cache"
    );
    spec.head_dim_v = 64;
    let inputs = random_paged::<f32, _>(&mut rng, &spec).unwrap();
    let p = inputs.problem(&Options::new()).unwrap();
    let mut o = vec![0f32; inputs.q.len()];
    let e = Backend::Cuda(cuda.clone())
        .run_paged(
            &p,
            &inputs.q,
            &inputs.k_cache,
            &inputs.v_cache,
            &mut o,
            None,
            None,
        )
        .unwrap_err();
    assert_eq!(arg_of(e), "dtype");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_gpu_append_writes_what_the_cpu_append_writes() {
    let cuda = gpu();
    let mut rng = StdRng::seed_from_u64(21);
    for page_size in [1, 3, 16] {
        let spec = PagedSpec {
            seqlens_q: vec![1, 1, 1],
            seqlens_k: vec![5, 0, 2 * page_size],
            heads_q: 4,
            heads_kv: 2,
            head_dim: 64,
            head_dim_v: 64,
            page_size,
            varlen: false,
        };
        let inputs = random_paged::<bf16, _>(&mut rng, &spec).unwrap();
        // A table with room: every sequence gets 4 more pages' worth of rows at most.
        let k_l = Layout::new("k_cache", &inputs.k_shape, None).unwrap();
        let v_l = Layout::new("v_cache", &inputs.v_shape, None).unwrap();
        let num_pages = inputs.k_shape[0];
        let batch = 3;
        let max_pages = num_pages.div_ceil(batch) + 8;
        // Give each sequence distinct pages: a fresh table over the pool (pages by stride).
        let mut table = vec![-1i32; batch * max_pages];
        for b in 0..batch {
            for j in 0..max_pages {
                let page = b + batch * j;
                if page < num_pages {
                    table[b * max_pages + j] = page as i32;
                }
            }
        }
        let counts = [3usize, 1, page_size + 2];
        let mut seqlens = vec![0i32; batch];
        for b in 0..batch {
            let pages = (0..max_pages)
                .filter(|&j| table[b * max_pages + j] >= 0)
                .count();
            seqlens[b] = ((pages * page_size).saturating_sub(counts[b]) as i32).min(7);
        }
        let cache = PagedCache::new(&k_l, &v_l, &table, max_pages, &seqlens).unwrap();
        let mut cu = vec![0i32];
        for c in counts {
            cu.push(cu.last().unwrap() + c as i32);
        }
        let total = *cu.last().unwrap() as usize;
        let row = spec.heads_kv * spec.head_dim;
        let k_new: Vec<bf16> = (0..total * row)
            .map(|_| bf16::from_f32(rng.random()))
            .collect();
        let v_new: Vec<bf16> = (0..total * row)
            .map(|_| bf16::from_f32(rng.random()))
            .collect();
        let (mut k_cpu, mut v_cpu) = (inputs.k_cache.clone(), inputs.v_cache.clone());
        let want = paged::append(&cache, &mut k_cpu, &mut v_cpu, &k_new, &v_new, &cu).unwrap();
        let mut dk = cuda.upload(&inputs.k_cache).unwrap();
        let mut dv = cuda.upload(&inputs.v_cache).unwrap();
        let (dkn, dvn) = (cuda.upload(&k_new).unwrap(), cuda.upload(&v_new).unwrap());
        let got = cuda
            .append_paged(&cache, &mut dk, &mut dv, &dkn, &dvn, &cu)
            .unwrap();
        assert_eq!(got, want);
        // Bitwise, NaN slots included.
        let bits = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&cuda.download(&dk).unwrap()),
            bits(&k_cpu),
            "page {page_size}"
        );
        assert_eq!(
            bits(&cuda.download(&dv).unwrap()),
            bits(&v_cpu),
            "page {page_size}"
        );
        // The host validation is the CPU's: a page missing from the table is refused and
        // nothing is written.
        let mut short = table.clone();
        short[max_pages - 1] = -1;
        short[0] = -1;
        let cache2 = PagedCache::new(&k_l, &v_l, &short, max_pages, &[0, 0, 0]).unwrap();
        let e = cuda
            .append_paged(&cache2, &mut dk, &mut dv, &dkn, &dvn, &cu)
            .unwrap_err();
        assert_eq!(arg_of(e), "page_table");
    }
}

/// Sets element `c` of key `j` of sequence `b`, KV head `h` in a paged cache laid out
/// `[num_pages, page_size, heads_kv, dim]` (the test's own indexing, not the kernels').
fn set_key<T: Element>(
    inputs: &mut PagedInputs<T>,
    v: bool,
    b: usize,
    j: usize,
    h: usize,
    c: usize,
    x: f32,
) {
    let shape = if v { inputs.v_shape } else { inputs.k_shape };
    let [_, ps, hkv, dim] = shape;
    let page = inputs.page_table[b * inputs.max_pages_per_seq + j / ps] as usize;
    let at = ((page * ps + j % ps) * hkv + h) * dim + c;
    let cache = if v {
        &mut inputs.v_cache
    } else {
        &mut inputs.k_cache
    };
    cache[at] = T::from_f32(x);
}

/// The spec's non-finite rule on the GPU (docs/attention.md, rule 7): a NaN or ∞ in V at a key
/// that some rows mask reaches exactly the rows that allow it (0·NaN must not leak through the
/// masked P = 0 of an MMA), in a speculative decode with causal bottom-right masks and in a
/// window that masks part of a block; a +∞ score gives LSE = +∞ (O NaN) even with more key
/// blocks after it, at every split count. The oracle (reference::check) demands NaN where it has
/// NaN, the same infinity where it has one, and finite values elsewhere.
#[test]
#[ignore = "needs a CUDA GPU"]
fn non_finite_values_reach_only_the_rows_that_allow_them() {
    let cuda = gpu();
    let mut rng = StdRng::seed_from_u64(12);
    let spec = PagedSpec {
        seqlens_q: vec![4, 4],
        seqlens_k: vec![300, 129],
        heads_q: 8,
        heads_kv: 2,
        head_dim: 128,
        head_dim_v: 128,
        page_size: 16,
        varlen: false,
    };
    let mut inputs = random_paged::<bf16, _>(&mut rng, &spec).unwrap();
    // Causal bottom-right: key 299 is seen by query row 3 only, key 127 of the second
    // sequence by rows 2 and 3; both sit in blocks that mask them for other rows.
    set_key(&mut inputs, true, 0, 299, 0, 5, f32::NAN);
    set_key(&mut inputs, true, 1, 127, 1, 70, f32::INFINITY);
    for s in [1, 2, 3] {
        run_and_check(
            &cuda,
            &inputs,
            Options::new().causal(),
            Some(s),
            "causal NaN/inf in V",
        );
    }
    // Window (5, 0) at seqlen_q 4: keys before each row's window are masked for it; key 290
    // of the first sequence is inside no row's window (rows see 291..299 at most).
    set_key(&mut inputs, true, 0, 290, 1, 9, f32::NAN);
    run_and_check(
        &cuda,
        &inputs,
        Options::new().window(Some(5), Some(0)),
        Some(1),
        "window NaN in V",
    );

    // A +∞ score: query column 0 positive everywhere, K[5][0] = +∞ for KV head 0 of sequence
    // 0: the rows of that head group allow key 5 (no mask) and two more key blocks follow.
    let mut inf = random_paged::<bf16, _>(&mut rng, &spec).unwrap();
    for (i, x) in inf.q.iter_mut().enumerate() {
        if i % 128 == 0 {
            *x = bf16::from_f32(1.0);
        }
    }
    set_key(&mut inf, false, 0, 5, 0, 0, f32::INFINITY);
    for s in [1, 3] {
        run_and_check(&cuda, &inf, Options::new(), Some(s), "+inf score");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_environments_variant_is_the_one_planned() {
    let cuda = gpu();
    let v = DecodeVariant::from_env().unwrap();
    eprintln!("FA4_DECODE_VARIANT: {v}");
    let mut rng = StdRng::seed_from_u64(21);
    let spec = PagedSpec {
        seqlens_q: vec![1, 1],
        seqlens_k: vec![5000, 777],
        heads_q: 32,
        heads_kv: 8,
        head_dim: 128,
        head_dim_v: 128,
        page_size: 16,
        varlen: false,
    };
    let inputs = random_paged::<bf16, _>(&mut rng, &spec).unwrap();
    let p = inputs.problem(&Options::new()).unwrap();
    let plan = cuda.plan_paged(&p, None).unwrap();
    if v.auto {
        // Two sequences × one group of 8 KV heads: below AUTO_MIN_HEAD_GROUPS, the split kernel.
        assert!(plan.variant.auto && plan.variant.best_splits, "{plan:?}");
        assert!(plan.heads.is_none(), "{plan:?}");
    } else {
        assert_eq!(plan.variant, v);
        assert_eq!(plan.heads.is_some(), v.heads.is_some(), "{plan:?}");
    }
    if let (Some(h), false) = (&plan.heads, v.auto) {
        // A contiguous cache: bulk copies exactly when asked for.
        assert_eq!(h.bulk, v.bulk);
        assert_eq!(h.heads, v.heads.unwrap().min(8));
    }
    assert_eq!(cuda.paged_tables(&p).unwrap().variant(), v);
    let s = run_and_check(&cuda, &inputs, Options::new(), None, "issue layout");
    assert_eq!(s, plan.decode.num_splits);
}

/// Every variant on one set of device tables (switched with `set_variant`), against the oracle:
/// the layout with ragged lengths (0, a page boundary, long), plain and causal
/// speculative decode, at the planner's and forced split counts; then a GQA-1 fp16 d256 case.
#[test]
#[ignore = "needs a CUDA GPU"]
fn every_variant_matches_the_oracle_in_one_process() {
    let cuda = gpu();
    // Bulk copies need sm_90 or later (sm_80 and sm_86/89 refuse them: tested on the host).
    let hopper = !cuda.info().target.starts_with("sm_8");
    let mut variants = vec![
        "auto",
        "plain",
        "best",
        "heads",
        "heads4",
        "heads2+best",
        "best+fuse",
        "heads4+fuse",
    ];
    if hopper {
        variants.extend([
            "heads+bulk",
            "heads4+bulk",
            "heads+bulk+best",
            "heads+bulk+best+fuse",
        ]);
    }
    let mut rng = StdRng::seed_from_u64(23);
    let cases = [
        (
            PagedSpec {
                seqlens_q: vec![4, 4, 4, 4],
                seqlens_k: vec![0, 64, 3001, 9000],
                heads_q: 32,
                heads_kv: 8,
                head_dim: 128,
                head_dim_v: 128,
                page_size: 16,
                varlen: false,
            },
            "bf16 d128 32/8 sq 4",
        ),
        (
            PagedSpec {
                seqlens_q: vec![1, 1],
                seqlens_k: vec![700, 33],
                heads_q: 4,
                heads_kv: 4,
                head_dim: 256,
                head_dim_v: 256,
                page_size: 3,
                varlen: false,
            },
            "d256 4/4 page 3",
        ),
    ];
    for (i, (spec, what)) in cases.iter().enumerate() {
        let inputs = random_paged::<bf16, _>(&mut rng, spec).unwrap();
        for opts in [
            Options::new(),
            Options::new().causal(),
            Options::new().window(Some(100), Some(0)).softcap(4.0),
        ] {
            let p = inputs.problem(&opts).unwrap();
            let mut tables = cuda.paged_tables(&p).unwrap();
            let (dq, dk, dv) = (
                cuda.upload(&inputs.q).unwrap(),
                cuda.upload(&inputs.k_cache).unwrap(),
                cuda.upload(&inputs.v_cache).unwrap(),
            );
            let mut dout = cuda.upload(&vec![bf16::NAN; inputs.q.len()]).unwrap();
            let mut dlse = cuda.upload(&vec![f32::NAN; p.lse_len()]).unwrap();
            for v in &variants {
                tables.set_variant(DecodeVariant::parse(v).unwrap());
                for splits in [None, Some(1), Some(5)] {
                    cuda.forward_paged_device(
                        &p,
                        &mut tables,
                        &dq,
                        &dk,
                        &dv,
                        &mut dout,
                        Some(&mut dlse),
                        splits,
                    )
                    .unwrap_or_else(|e| panic!("{what} case {i} {v} {splits:?}: {e}"));
                    let (o, l) = (cuda.download(&dout).unwrap(), cuda.download(&dlse).unwrap());
                    let r = reference::check(
                        &p,
                        &inputs.q,
                        &inputs.k_cache,
                        &inputs.v_cache,
                        &o,
                        Some(&l),
                    )
                    .unwrap();
                    assert!(r.passed(), "{what} {opts:?} {v} splits {splits:?}: {r}");
                    // Poison again so that a variant that writes nothing cannot pass on the
                    // last one's output.
                    dout = cuda.upload(&vec![bf16::NAN; inputs.q.len()]).unwrap();
                    dlse = cuda.upload(&vec![f32::NAN; p.lse_len()]).unwrap();
                }
            }
        }
    }
}

/// The fused combine (`fuse`: the last split CTA of a row tile merges the splits) on one set of
/// device tables per case, switching variants (so the arrival counters are reallocated as the
/// grid grows, and reused): pages of 1 and 16 keys, GQA 4 (32/8 heads, decode) and GQA 8 (16/2,
/// causal speculative decode of 4 rows, two row tiles at d64), ragged lengths with an empty
/// sequence, split counts 1, 2, 7 and MAX_SPLITS (more than the keys' blocks: empty parts) and
/// the planner's. Each split count runs three calls back to back into three output buffers
/// before any is read (the second and third start from the counters the first left, so a
/// missing reset leaves poisoned rows), and all three are judged.
#[test]
#[ignore = "needs a CUDA GPU"]
fn the_fused_combine_matches_the_oracle_call_after_call() {
    let cuda = gpu();
    let hopper = !cuda.info().target.starts_with("sm_8");
    let mut variants = vec!["best+fuse", "fuse", "heads+fuse", "heads4+best+fuse"];
    if hopper {
        variants.push("heads+bulk+best+fuse");
    }
    let mut rng = StdRng::seed_from_u64(31);
    for page_size in [1, 16] {
        for (hq, hkv, sq, head_dim, opts) in [
            (32, 8, 1, 128, Options::new()),
            (16, 2, 4, 64, Options::new().causal()),
        ] {
            let spec = PagedSpec {
                seqlens_q: vec![sq; 5],
                seqlens_k: vec![0, 1, 129, 1500, 2 * page_size + 3],
                heads_q: hq,
                heads_kv: hkv,
                head_dim,
                head_dim_v: head_dim,
                page_size,
                varlen: false,
            };
            let what = format!("page {page_size} heads {hq}/{hkv} sq {sq} d{head_dim}");
            let inputs = random_paged::<bf16, _>(&mut rng, &spec).unwrap();
            let p = inputs.problem(&opts).unwrap();
            let mut tables = cuda.paged_tables(&p).unwrap();
            let (dq, dk, dv) = (
                cuda.upload(&inputs.q).unwrap(),
                cuda.upload(&inputs.k_cache).unwrap(),
                cuda.upload(&inputs.v_cache).unwrap(),
            );
            for v in &variants {
                tables.set_variant(DecodeVariant::parse(v).unwrap());
                for splits in [Some(2), Some(MAX_SPLITS), None, Some(1), Some(7)] {
                    let mut outs: Vec<_> = (0..3)
                        .map(|_| {
                            (
                                cuda.upload(&vec![bf16::NAN; inputs.q.len()]).unwrap(),
                                cuda.upload(&vec![f32::NAN; p.lse_len()]).unwrap(),
                            )
                        })
                        .collect();
                    let mut ran = Vec::new();
                    for (dout, dlse) in outs.iter_mut() {
                        let plan = cuda
                            .forward_paged_device(
                                &p,
                                &mut tables,
                                &dq,
                                &dk,
                                &dv,
                                dout,
                                Some(dlse),
                                splits,
                            )
                            .unwrap_or_else(|e| panic!("{what} {v} {splits:?}: {e}"));
                        ran.push(plan.num_splits);
                    }
                    if let Some(s) = splits {
                        assert_eq!(ran, vec![s; 3], "{what} {v}");
                    }
                    for (call, (dout, dlse)) in outs.iter().enumerate() {
                        let (o, l) = (cuda.download(dout).unwrap(), cuda.download(dlse).unwrap());
                        let r = reference::check(
                            &p,
                            &inputs.q,
                            &inputs.k_cache,
                            &inputs.v_cache,
                            &o,
                            Some(&l),
                        )
                        .unwrap();
                        assert!(
                            r.passed(),
                            "{what} {v} splits {splits:?} ({} run), call {call}: {r}",
                            ran[call]
                        );
                    }
                }
            }
        }
    }
}
