//! Context parallelism on the CPU: the ring simulated over N ranks equals one call and the
//! float64 oracle; the schedule computes every allowed (row, key) pair exactly once; the zigzag
//! split balances causal work.

use fa4::check::{self, random_qkv};
use fa4::cp::{self, Ring, Schedule, Split, SplitKind};
use fa4::cpu::CpuBackend;
use fa4::tensor::Layout;
use fa4::{DType, Element, Error, Mask, Options, Problem};
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::SeedableRng;

/// The test's own mask predicate (bottom-right causal), sharing nothing with the crate.
fn allowed(causal: bool, sq: usize, sk: usize, i: usize, j: usize) -> bool {
    i < sq && j < sk && (!causal || (j as i64) <= i as i64 + sk as i64 - sq as i64)
}

#[derive(Debug, Clone, Copy)]
struct Case {
    ranks: usize,
    kind: SplitKind,
    batch: usize,
    sq: usize,
    sk: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    dv: usize,
    causal: bool,
    softcap: Option<f32>,
}

fn problem(c: &Case, dtype: DType) -> Problem {
    let l = |s: usize, h: usize, d: usize| Layout::new("t", &[c.batch, s, h, d], None).unwrap();
    let mut opts = Options::new();
    if c.causal {
        opts = opts.causal();
    }
    if let Some(x) = c.softcap {
        opts = opts.softcap(x);
    }
    Problem::new(
        dtype,
        &l(c.sq, c.hq, c.d),
        &l(c.sk, c.hkv, c.d),
        &l(c.sk, c.hkv, c.dv),
        &l(c.sq, c.hq, c.dv),
        None,
        None,
        &opts,
    )
    .unwrap()
}

fn run_case<T: Element>(c: &Case, seed: u64) {
    let p = problem(c, T::DTYPE);
    let mut rng = StdRng::seed_from_u64(seed);
    let mut q = vec![T::NAN; p.q_layout().numel()];
    let mut k = vec![T::NAN; p.k_layout().numel()];
    let mut v = vec![T::NAN; p.v_layout().numel()];
    random_qkv(&mut rng, &mut q, &mut k, &mut v, c.d, c.dv);
    let cpu = CpuBackend::default();
    let mut o = vec![T::NAN; p.o_layout().numel()];
    let mut lse = vec![f32::NAN; p.lse_len()];
    let timings = cp::forward_simulated(
        &p,
        c.ranks,
        c.kind,
        &cpu,
        &q,
        &k,
        &v,
        &mut o,
        Some(&mut lse),
    )
    .unwrap();
    assert_eq!(timings.compute_s.len(), c.ranks);
    let report =
        check::check(&p, &q, &k, &v, &o, Some(&lse)).expect("the oracle holds the problem");
    assert!(report.passed(), "{c:?} {}: {report}", T::DTYPE);
    // And against one call of the same backend.
    let mut o1 = vec![T::NAN; p.o_layout().numel()];
    let mut lse1 = vec![f32::NAN; p.lse_len()];
    cpu.forward(&p, &q, &k, &v, &mut o1, Some(&mut lse1))
        .unwrap();
    let max_o = o
        .iter()
        .zip(&o1)
        .map(|(a, b)| (a.to_f32() - b.to_f32()).abs())
        .fold(0f32, f32::max);
    let lse_ok = lse.iter().zip(&lse1).all(|(a, b)| {
        (a == b) || (a.is_finite() && b.is_finite() && (a - b).abs() <= 1e-4 * (1.0 + b.abs()))
    });
    // f32: a few f32 roundings of the merge; 16-bit: at most one storage ulp of |O| ≤ ~4.
    let tol = if T::DTYPE == DType::F32 {
        1e-5
    } else {
        4.0 / 64.0
    };
    assert!(max_o <= tol && lse_ok, "{c:?}: max|O_cp − O_one| {max_o}");
}

fn cases() -> Vec<Case> {
    let base = Case {
        ranks: 1,
        kind: SplitKind::Zigzag,
        batch: 1,
        sq: 64,
        sk: 64,
        hq: 4,
        hkv: 4,
        d: 32,
        dv: 32,
        causal: false,
        softcap: None,
    };
    let mut out = Vec::new();
    for ranks in 1..=4 {
        for causal in [false, true] {
            for kind in [SplitKind::Zigzag, SplitKind::Contiguous] {
                out.push(Case {
                    ranks,
                    kind,
                    causal,
                    ..base
                });
            }
            // GQA 4:1 with two sequences, and an odd length that no chunk count divides.
            out.push(Case {
                ranks,
                causal,
                batch: 2,
                sq: 37,
                sk: 37,
                hq: 4,
                hkv: 1,
                dv: 16,
                ..base
            });
            // Fewer rows than chunks: some chunks are empty.
            out.push(Case {
                ranks,
                causal,
                sq: 5,
                sk: 5,
                ..base
            });
            // seqlen_q ≠ seqlen_k: the diagonal products are trimmed.
            out.push(Case {
                ranks,
                causal,
                sq: 19,
                sk: 45,
                softcap: Some(5.0),
                ..base
            });
            out.push(Case {
                ranks,
                causal,
                sq: 45,
                sk: 19,
                ..base
            });
        }
    }
    out
}

#[test]
fn simulated_ring_equals_one_call_f32() {
    for (i, c) in cases().iter().enumerate() {
        run_case::<f32>(c, i as u64);
    }
}

#[test]
fn simulated_ring_equals_one_call_bf16_and_f16() {
    for (i, c) in cases().iter().enumerate() {
        if i % 2 == 0 {
            run_case::<bf16>(c, 100 + i as u64);
        } else {
            run_case::<f16>(c, 100 + i as u64);
        }
    }
}

#[test]
fn every_allowed_pair_is_computed_exactly_once() {
    for kind in [SplitKind::Zigzag, SplitKind::Contiguous] {
        for n in 1..=5 {
            for (sq, sk) in [
                (40, 40),
                (41, 41),
                (7, 7),
                (3, 3),
                (13, 29),
                (29, 13),
                (0, 8),
            ] {
                for causal in [false, true] {
                    let mask = if causal { Mask::Causal } else { Mask::None };
                    let s = Schedule::new(
                        Split::new(kind, sq, n).unwrap(),
                        Split::new(kind, sk, n).unwrap(),
                        mask,
                    )
                    .unwrap();
                    let mut count = vec![0u32; sq * sk];
                    for r in 0..n {
                        for t in 0..n {
                            let step = s.step(r, t);
                            assert_eq!(step.source, (r + n - t) % n);
                            for p in &step.products {
                                // The rows and keys really are this rank's and the source's.
                                let qs = s.q_split();
                                let ks = s.k_split();
                                for (li, gi) in p.q_local.clone().zip(p.q_global.clone()) {
                                    assert_eq!(qs.global_row(r, li), gi);
                                }
                                for (lj, gj) in p.k_local.clone().zip(p.k_global.clone()) {
                                    assert_eq!(ks.global_row(step.source, lj), gj);
                                }
                                let local = p
                                    .kind
                                    .mask()
                                    .for_sequence(p.q_global.len(), p.k_global.len());
                                for (i, gi) in p.q_global.clone().enumerate() {
                                    for (j, gj) in p.k_global.clone().enumerate() {
                                        if local.allowed(i, j) {
                                            count[gi * sk + gj] += 1;
                                        }
                                    }
                                }
                            }
                        }
                    }
                    for i in 0..sq {
                        for j in 0..sk {
                            let want = u32::from(allowed(causal, sq, sk, i, j));
                            assert_eq!(
                                count[i * sk + j],
                                want,
                                "{kind} N={n} {sq}x{sk} causal={causal}: pair ({i}, {j})"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn zigzag_balances_causal_work() {
    for n in 1..=8 {
        for len in [16 * n, 4 * n, 128 * n] {
            let split = |kind| Split::new(kind, len, n).unwrap();
            let zz = Schedule::new(
                split(SplitKind::Zigzag),
                split(SplitKind::Zigzag),
                Mask::Causal,
            )
            .unwrap();
            let w0 = zz.work(0);
            // 2 diagonal chunk products (own chunks at step 0) and 2N − 1 full ones per rank.
            assert_eq!((w0.full, w0.diagonal), (2 * n - 1, 2), "N={n} len={len}");
            for r in 1..n {
                assert_eq!(zz.work(r), w0, "N={n} len={len} rank {r}");
            }
            let total: u64 = (0..n).map(|r| zz.work(r).pairs).sum();
            assert_eq!(total, (len * (len + 1) / 2) as u64);
            // The contiguous split is not balanced under a causal mask (the test can fail).
            if n > 1 {
                let c = Schedule::new(
                    split(SplitKind::Contiguous),
                    split(SplitKind::Contiguous),
                    Mask::Causal,
                )
                .unwrap();
                assert!(c.work(n - 1).pairs > c.work(0).pairs);
            }
        }
    }
    // Without a mask every split is balanced.
    let s = Split::new(SplitKind::Contiguous, 60, 3).unwrap();
    let c = Schedule::new(s, s, Mask::None).unwrap();
    assert!((1..3).all(|r| c.work(r) == c.work(0)));
}

#[test]
fn a_zigzag_step_after_the_first_is_one_call() {
    let s = Split::new(SplitKind::Zigzag, 64, 4).unwrap();
    let sch = Schedule::new(s, s, Mask::Causal).unwrap();
    for r in 0..4 {
        assert_eq!(sch.calls(r, 0).len(), 3);
        for t in 1..4 {
            let calls = sch.calls(r, t);
            assert_eq!(calls.len(), 1, "rank {r} step {t}: {calls:?}");
            assert_eq!(calls[0].q_local.len() * calls[0].k_local.len(), 2 * 8 * 8);
        }
    }
}

#[test]
fn unsupported_problems_name_the_argument() {
    let name = |e: Error| match e {
        Error::InvalidArgument { name, .. } => name,
        e => panic!("{e}"),
    };
    let l = Layout::new("t", &[1, 8, 2, 16], None).unwrap();
    let window = Problem::new(
        DType::F32,
        &l,
        &l,
        &l,
        &l,
        None,
        None,
        &Options::new().window(Some(2), Some(0)),
    )
    .unwrap();
    assert_eq!(
        name(Ring::new(&window, 2, SplitKind::Zigzag).unwrap_err()),
        "mask"
    );
    let plain = Problem::new(DType::F32, &l, &l, &l, &l, None, None, &Options::new()).unwrap();
    assert_eq!(
        name(Ring::new(&plain, 0, SplitKind::Zigzag).unwrap_err()),
        "cp"
    );
    let packed = Layout::new("t", &[8, 2, 16], None).unwrap();
    let varlen = Problem::new(
        DType::F32,
        &packed,
        &packed,
        &packed,
        &packed,
        Some(&[0, 3, 8]),
        Some(&[0, 3, 8]),
        &Options::new(),
    )
    .unwrap();
    assert_eq!(
        name(Ring::new(&varlen, 2, SplitKind::Zigzag).unwrap_err()),
        "q"
    );
    // Short buffers are an error, not a panic.
    let ring = Ring::new(&plain, 2, SplitKind::Zigzag).unwrap();
    assert_eq!(
        name(ring.shard(cp::Operand::Q, &[0f32; 10]).unwrap_err()),
        "q"
    );
    let mut o = vec![0f32; 256];
    assert_eq!(
        name(
            cp::forward_simulated(
                &plain,
                2,
                SplitKind::Zigzag,
                &CpuBackend::default(),
                &[0f32; 256],
                &[0f32; 255],
                &[0f32; 256],
                &mut o,
                None
            )
            .unwrap_err()
        ),
        "k"
    );
}
