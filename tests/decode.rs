//! Decode over a paged KV cache on the CPU, judged by the float64 paged oracle (gather, then the
//! definition): a matrix of page sizes, shuffled tables, ragged lengths (0, a page boundary),
//! every split count, GQA ratios, masks, softcap, seqlen_q 1 and 4, varlen queries; and the
//! errors of bad tables, lengths and appends.

use fa4::config::decode::MAX_SPLITS;
use fa4::paged::random::{random_paged, PagedInputs, PagedSpec};
use fa4::paged::{self, reference, PagedCache, PagedKv, PagedOptions, CPU_TILES};
use fa4::tensor::Layout;
use fa4::{Backend, Element, Error, Mask, Options, Tensor, TensorMut};
use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn arg_of(e: Error) -> String {
    match e {
        Error::InvalidArgument { name, .. } => name,
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

/// Runs the CPU backend with `splits` and judges it; returns the split count that ran.
fn run_and_check<T: Element>(
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
    let plan = Backend::Cpu
        .forward_paged(
            &q,
            &kv,
            inputs.cu_seqlens_q.as_deref(),
            &mut TensorMut::new(&mut o, &o_shape).unwrap(),
            Some(&mut lse),
            &popts,
        )
        .unwrap();
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
            "window 17,3 softcap",
            Options::new().window(Some(17), Some(3)).softcap(5.0),
        ),
        ("softcap", Options::new().softcap(2.0)),
    ]
}

/// Ragged lengths for a page size: empty, exactly one and two pages, a page and one key, and
/// a random length.
fn ragged(rng: &mut StdRng, page_size: usize) -> Vec<usize> {
    vec![
        0,
        page_size,
        2 * page_size,
        page_size + 1,
        rng.random_range(1..300),
    ]
}

#[test]
fn paged_matrix_against_the_oracle() {
    let mut rng = StdRng::seed_from_u64(15);
    let mut case = 0;
    for page_size in [1, 3, 16, 64, 256] {
        for (hq, hkv) in [(2, 2), (4, 1), (8, 1)] {
            for (seqlen_q, varlen) in [(1, false), (4, false), (0, true)] {
                let seqlens_k = ragged(&mut rng, page_size);
                let seqlens_q = if varlen {
                    // Ragged query counts, including none, against the same caches.
                    vec![1, 0, 4, 3, 2]
                } else {
                    vec![seqlen_q; seqlens_k.len()]
                };
                let spec = PagedSpec {
                    seqlens_q,
                    seqlens_k,
                    heads_q: hq,
                    heads_kv: hkv,
                    head_dim: 16,
                    head_dim_v: 8,
                    page_size,
                    varlen,
                };
                let all = masks();
                let (name, opts) = all[case % all.len()];
                case += 1;
                let inputs = random_paged::<f32, _>(&mut rng, &spec).unwrap();
                let what = format!(
                    "page {page_size} heads {hq}/{hkv} sq {seqlen_q} varlen {varlen} {name}"
                );
                run_and_check(&inputs, opts, None, &what);
                // Forced splits: 1, a middle one, and one past the longest sequence's blocks
                // (empty parts are merged away).
                let blocks = spec
                    .seqlens_k
                    .iter()
                    .max()
                    .unwrap()
                    .div_ceil(CPU_TILES.block_n);
                for s in [1, blocks.div_ceil(2).max(1), blocks + 1] {
                    assert_eq!(run_and_check(&inputs, opts, Some(s), &what), s);
                }
            }
        }
    }
}

#[test]
fn every_split_count_and_16_bit_storage() {
    let mut rng = StdRng::seed_from_u64(3);
    let spec = PagedSpec {
        seqlens_q: vec![4, 4, 4],
        seqlens_k: vec![257, 96, 0],
        heads_q: 8,
        heads_kv: 2,
        head_dim: 64,
        head_dim_v: 64,
        page_size: 16,
        varlen: false,
    };
    let blocks = 257usize.div_ceil(CPU_TILES.block_n);
    let f32_inputs = random_paged::<f32, _>(&mut rng, &spec).unwrap();
    let bf16_inputs = random_paged::<bf16, _>(&mut rng, &spec).unwrap();
    for s in 1..=blocks + 1 {
        run_and_check(&f32_inputs, Options::new().causal(), Some(s), "f32 causal");
        run_and_check(&bf16_inputs, Options::new(), Some(s), "bf16");
    }
    run_and_check(&f32_inputs, Options::new(), Some(MAX_SPLITS), "max splits");
}

#[test]
fn unread_slots_are_not_read_and_outputs_match_across_splits() {
    // The spare pages and slots past each length hold NaN (random_paged): a finite O proves
    // they were not read. Split counts change the rounding only a little.
    let mut rng = StdRng::seed_from_u64(9);
    let spec = PagedSpec {
        seqlens_q: vec![1, 1],
        seqlens_k: vec![100, 37],
        heads_q: 4,
        heads_kv: 4,
        head_dim: 32,
        head_dim_v: 32,
        page_size: 7,
        varlen: false,
    };
    let inputs = random_paged::<f32, _>(&mut rng, &spec).unwrap();
    assert!(inputs.k_cache.iter().any(|x| x.is_nan()));
    let run = |s: usize| {
        let kv = inputs.kv().unwrap();
        let q = Tensor::new(&inputs.q, &inputs.q_shape).unwrap();
        let mut o = vec![f32::NAN; inputs.q.len()];
        Backend::Cpu
            .forward_paged(
                &q,
                &kv,
                None,
                &mut TensorMut::new(&mut o, &inputs.q_shape).unwrap(),
                None,
                &PagedOptions::new(Options::new()).num_splits(s),
            )
            .unwrap();
        o
    };
    let one = run(1);
    assert!(one.iter().all(|x| x.is_finite()));
    for s in [2, 3, 4] {
        let other = run(s);
        let diff = one
            .iter()
            .zip(&other)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(diff < 1e-5, "splits {s}: {diff}");
    }
}

#[test]
fn repeated_and_shared_pages_read_fine() {
    // Two sequences share page 0 (a shared prefix) and sequence 1 repeats it.
    let (ps, h, d) = (2, 1, 4);
    let mut rng = StdRng::seed_from_u64(1);
    let k: Vec<f32> = (0..3 * ps * h * d)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let v: Vec<f32> = (0..3 * ps * h * d)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let table = [0, 1, 0, 0];
    let seqlens = [4, 4];
    let kv = PagedKv::new(
        Tensor::new(&k, &[3, ps, h, d]).unwrap(),
        Tensor::new(&v, &[3, ps, h, d]).unwrap(),
        &table,
        2,
        &seqlens,
    )
    .unwrap();
    let q: Vec<f32> = (0..2 * d).map(|i| i as f32 * 0.1).collect();
    let qt = Tensor::new(&q, &[2, 1, h, d]).unwrap();
    let mut o = vec![0f32; 2 * d];
    let mut lse = vec![0f32; 2];
    Backend::Cpu
        .forward_paged(
            &qt,
            &kv,
            None,
            &mut TensorMut::new(&mut o, &[2, 1, h, d]).unwrap(),
            Some(&mut lse),
            &PagedOptions::new(Options::new()),
        )
        .unwrap();
    let p = paged::PagedProblem::new(
        fa4::DType::F32,
        qt.layout(),
        &Layout::new("out", &[2, 1, h, d], None).unwrap(),
        kv.cache(),
        None,
        &Options::new(),
    )
    .unwrap();
    let r = reference::check(&p, &q, &k, &v, &o, Some(&lse)).unwrap();
    assert!(r.passed(), "{r}");
}

fn tiny_cache(table: &[i32], seqlens: &[i32]) -> fa4::Result<PagedCache> {
    let k = Layout::new("k_cache", &[4, 8, 2, 16], None)?;
    let max_pages = table.len() / seqlens.len().max(1);
    PagedCache::new(&k, &k, table, max_pages, seqlens)
}

#[test]
fn bad_tables_and_lengths_name_the_argument() {
    // Page out of range, negative page inside the used entries, table of the wrong size.
    assert_eq!(arg_of(tiny_cache(&[0, 4], &[9]).unwrap_err()), "page_table");
    assert_eq!(
        arg_of(tiny_cache(&[-1, 0], &[1]).unwrap_err()),
        "page_table"
    );
    assert_eq!(
        arg_of(
            PagedCache::new(
                &Layout::new("k", &[4, 8, 2, 16], None).unwrap(),
                &Layout::new("v", &[4, 8, 2, 16], None).unwrap(),
                &[0, 1, 2],
                2,
                &[1, 1]
            )
            .unwrap_err()
        ),
        "page_table"
    );
    // Entries past the used pages are not validated.
    assert!(tiny_cache(&[3, -7], &[8]).is_ok());
    assert!(tiny_cache(&[3, 99], &[0]).is_ok());
    // Negative and too-long lengths.
    assert_eq!(arg_of(tiny_cache(&[0, 1], &[-1]).unwrap_err()), "seqlens_k");
    assert_eq!(arg_of(tiny_cache(&[0, 1], &[17]).unwrap_err()), "seqlens_k");
    assert!(tiny_cache(&[0, 1], &[16]).is_ok());
    // Cache shapes.
    let k = Layout::new("k", &[4, 0, 2, 16], None).unwrap();
    assert_eq!(
        arg_of(PagedCache::new(&k, &k, &[], 0, &[]).unwrap_err()),
        "k_cache"
    );
    let k = Layout::new("k", &[4, 8, 2, 16], None).unwrap();
    let v = Layout::new("v", &[4, 8, 1, 16], None).unwrap();
    assert_eq!(
        arg_of(PagedCache::new(&k, &v, &[0], 1, &[1]).unwrap_err()),
        "v_cache"
    );
}

#[test]
fn bad_queries_splits_and_buffers_name_the_argument() {
    let cache = tiny_cache(&[0, 1, 2, 3], &[9, 16]).unwrap();
    let l = |s: &[usize]| Layout::new("t", s, None).unwrap();
    let mk = |q: &[usize], o: &[usize], cu: Option<&[i32]>, opts: Options| {
        paged::PagedProblem::new(fa4::DType::F32, &l(q), &l(o), &cache, cu, &opts)
    };
    assert!(mk(&[2, 1, 4, 16], &[2, 1, 4, 16], None, Options::new()).is_ok());
    assert_eq!(
        arg_of(mk(&[3, 1, 4, 16], &[3, 1, 4, 16], None, Options::new()).unwrap_err()),
        "q"
    );
    assert_eq!(
        arg_of(mk(&[2, 1, 3, 16], &[2, 1, 3, 16], None, Options::new()).unwrap_err()),
        "q"
    );
    assert_eq!(
        arg_of(mk(&[2, 1, 4, 8], &[2, 1, 4, 16], None, Options::new()).unwrap_err()),
        "q"
    );
    assert_eq!(
        arg_of(mk(&[2, 1, 4, 16], &[2, 2, 4, 16], None, Options::new()).unwrap_err()),
        "out"
    );
    assert_eq!(
        arg_of(mk(&[5, 4, 16], &[5, 4, 16], None, Options::new()).unwrap_err()),
        "cu_seqlens_q"
    );
    assert_eq!(
        arg_of(mk(&[5, 4, 16], &[5, 4, 16], Some(&[0, 3, 4]), Options::new()).unwrap_err()),
        "cu_seqlens_q"
    );
    assert_eq!(
        arg_of(mk(&[5, 4, 16], &[5, 4, 16], Some(&[0, 3]), Options::new()).unwrap_err()),
        "cu_seqlens_q"
    );
    assert_eq!(
        arg_of(mk(&[5, 4, 16], &[5, 4, 16], Some(&[0, 3, 2]), Options::new()).unwrap_err()),
        "cu_seqlens_q"
    );
    assert!(mk(&[5, 4, 16], &[5, 4, 16], Some(&[0, 3, 5]), Options::new()).is_ok());
    assert_eq!(
        arg_of(
            mk(
                &[2, 1, 4, 16],
                &[2, 1, 4, 16],
                None,
                Options::new().softcap(-1.0)
            )
            .unwrap_err()
        ),
        "softcap"
    );
    assert_eq!(
        arg_of(
            mk(
                &[2, 1, 4, 16],
                &[2, 1, 4, 16],
                None,
                Options::new().scale(f32::NAN)
            )
            .unwrap_err()
        ),
        "scale"
    );

    // Through the backend: forced splits and short buffers.
    let k = vec![0f32; 4 * 8 * 2 * 16];
    let kv = PagedKv::new(
        Tensor::new(&k, &[4, 8, 2, 16]).unwrap(),
        Tensor::new(&k, &[4, 8, 2, 16]).unwrap(),
        &[0, 1, 2, 3],
        2,
        &[9, 16],
    )
    .unwrap();
    let q = vec![0f32; 2 * 4 * 16];
    let qt = Tensor::new(&q, &[2, 1, 4, 16]).unwrap();
    let mut o = vec![0f32; 2 * 4 * 16];
    let call = |o: &mut [f32], lse: Option<&mut [f32]>, s: usize| {
        Backend::Cpu.forward_paged(
            &qt,
            &kv,
            None,
            &mut TensorMut::new(o, &[2, 1, 4, 16]).unwrap(),
            lse,
            &PagedOptions::new(Options::new()).num_splits(s),
        )
    };
    assert_eq!(arg_of(call(&mut o, None, 0).unwrap_err()), "num_splits");
    assert_eq!(
        arg_of(call(&mut o, None, MAX_SPLITS + 1).unwrap_err()),
        "num_splits"
    );
    assert_eq!(
        arg_of(call(&mut o, Some(&mut [0f32; 3]), 1).unwrap_err()),
        "lse"
    );
    assert!(call(&mut o, Some(&mut [0f32; 8]), 2).is_ok());
}

#[test]
fn append_writes_pages_and_refuses_what_it_cannot_write() {
    let mut rng = StdRng::seed_from_u64(5);
    // Two sequences at lengths 3 and 0, pages of 2: sequence 0 owns pages 2, 0; sequence 1
    // owns page 1; page 3 is spare.
    let (ps, h, d) = (2, 2, 4);
    let shape = [4, ps, h, d];
    let n = 4 * ps * h * d;
    let mut kc = vec![f32::NAN; n];
    let mut vc = vec![f32::NAN; n];
    let table = [2, 0, 1, -1];
    let kl = Layout::new("k_cache", &shape, None).unwrap();
    // Grow 0 → 3 keys first (sequence 0), then 3 → 4 and 0 → 2 in one call.
    let c0 = PagedCache::new(&kl, &kl, &table, 2, &[0, 0]).unwrap();
    let rows = |r: usize, rng: &mut StdRng| -> Vec<f32> {
        (0..r * h * d)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect()
    };
    let (k1, v1) = (rows(3, &mut rng), rows(3, &mut rng));
    let lens = paged::append(&c0, &mut kc, &mut vc, &k1, &v1, &[0, 3, 3]).unwrap();
    assert_eq!(lens, vec![3, 0]);
    let c1 = PagedCache::new(&kl, &kl, &table, 2, &lens).unwrap();
    let (k2, v2) = (rows(3, &mut rng), rows(3, &mut rng));
    let lens = paged::append(&c1, &mut kc, &mut vc, &k2, &v2, &[0, 1, 3]).unwrap();
    assert_eq!(lens, vec![4, 2]);
    // Key j of sequence 0 is slot j % 2 of page table[j / 2]; check every written row.
    let at = |page: usize, slot: usize, head: usize| ((page * ps + slot) * h + head) * d;
    let seq0: Vec<&[f32]> = vec![&k1[0..8], &k1[8..16], &k1[16..24], &k2[0..8]];
    for (j, row) in seq0.iter().enumerate() {
        let page = [2, 0][j / 2];
        for hh in 0..h {
            let o = at(page, j % 2, hh);
            assert_eq!(&kc[o..o + d], &row[hh * d..(hh + 1) * d], "seq 0 key {j}");
        }
    }
    let o = at(1, 1, 1);
    assert_eq!(&vc[o..o + d], &v2[2 * h * d + d..3 * h * d]);
    // Page 3 (spare) stayed untouched.
    assert!(kc[at(3, 0, 0)..].iter().all(|x| x.is_nan()));

    // Errors, with nothing written: a page missing from the table, growth past the table,
    // a slot written twice, and bad shapes.
    let c2 = PagedCache::new(&kl, &kl, &table, 2, &lens).unwrap();
    let before = kc.clone();
    let one = rows(1, &mut rng);
    assert_eq!(
        arg_of(paged::append(&c2, &mut kc, &mut vc, &one, &one, &[0, 0, 1]).unwrap_err()),
        "page_table"
    );
    assert_eq!(
        arg_of(paged::append(&c2, &mut kc, &mut vc, &one, &one, &[0, 1, 1]).unwrap_err()),
        "cu_new"
    );
    let two = rows(2, &mut rng);
    let shared = PagedCache::new(&kl, &kl, &[3, -1, 3, -1], 2, &[0, 0]).unwrap();
    assert_eq!(
        arg_of(paged::append(&shared, &mut kc, &mut vc, &two, &two, &[0, 1, 2]).unwrap_err()),
        "page_table"
    );
    assert_eq!(
        arg_of(paged::append(&c2, &mut kc, &mut vc, &two, &one, &[0, 0, 0]).unwrap_err()),
        "k_new"
    );
    assert_eq!(
        arg_of(paged::append(&c2, &mut kc, &mut vc, &[], &[], &[0, 0]).unwrap_err()),
        "cu_new"
    );
    assert!(kc
        .iter()
        .zip(&before)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
}

#[test]
fn append_then_decode_matches_the_oracle() {
    // Fill a cache only through append, one decode step at a time, then check attention.
    let mut rng = StdRng::seed_from_u64(8);
    let (ps, hkv, hq, d, steps) = (5, 2, 8, 16, 23);
    let shape = [10, ps, hkv, d];
    let n: usize = shape.iter().product();
    let (mut kc, mut vc) = (vec![f32::NAN; n], vec![f32::NAN; n]);
    let table = [7, 2, 9, 0, 4, 1, 3, 8, 5, 6];
    let kl = Layout::new("k_cache", &shape, None).unwrap();
    let mut lens = vec![0i32, 0];
    for step in 0..steps {
        let cache = PagedCache::new(&kl, &kl, &table, 5, &lens).unwrap();
        // Sequence 1 grows every other step.
        let cu = [0, 1, 1 + step % 2];
        let rows = cu[2] as usize;
        let k: Vec<f32> = (0..rows * hkv * d)
            .map(|_| rng.random_range(-2.0..2.0))
            .collect();
        let v: Vec<f32> = (0..rows * hkv * d)
            .map(|_| rng.random_range(-2.0..2.0))
            .collect();
        lens = paged::append(&cache, &mut kc, &mut vc, &k, &v, &cu).unwrap();
    }
    assert_eq!(lens, vec![23, 11]);
    let kv = PagedKv::new(
        Tensor::new(&kc, &shape).unwrap(),
        Tensor::new(&vc, &shape).unwrap(),
        &table,
        5,
        &lens,
    )
    .unwrap();
    let q: Vec<f32> = (0..2 * hq * d)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let qt = Tensor::new(&q, &[2, 1, hq, d]).unwrap();
    let mut o = vec![f32::NAN; q.len()];
    let mut lse = vec![f32::NAN; 2 * hq];
    let opts = Options::new().mask(Mask::Causal);
    Backend::Cpu
        .forward_paged(
            &qt,
            &kv,
            None,
            &mut TensorMut::new(&mut o, &[2, 1, hq, d]).unwrap(),
            Some(&mut lse),
            &PagedOptions::new(opts).num_splits(3),
        )
        .unwrap();
    let p = paged::PagedProblem::new(
        fa4::DType::F32,
        qt.layout(),
        &Layout::new("out", &[2, 1, hq, d], None).unwrap(),
        kv.cache(),
        None,
        &opts,
    )
    .unwrap();
    let r = reference::check(&p, &q, &kc, &vc, &o, Some(&lse)).unwrap();
    assert!(r.passed(), "{r}");
}
