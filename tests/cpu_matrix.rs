//! The CPU backend against the float64 oracle over the whole correctness matrix.

use fa4::check::{matrix, run_case};
use fa4::{Backend, DType};

#[test]
fn cpu_backend_passes_the_matrix() {
    let cases = matrix(
        &[DType::F32, DType::F16, DType::Bf16],
        &[32, 64, 80, 96, 128, 192, 256],
    );
    assert!(cases.len() >= 200);
    let backend = Backend::Cpu;
    let mut failures = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let report =
            run_case(&backend, case, 1000 + i as u64).unwrap_or_else(|e| panic!("{case}: {e}"));
        if !report.passed() {
            failures.push(format!("{case}: {report}"));
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

/// Non-finite inputs where a tile holds keys some of its rows may not see: a NaN in V at key
/// 100 under a causal mask (rows before 100 never attend it and stay finite), and a +inf score
/// at key 0 followed by more key blocks (LSE +inf, O NaN for the rows that see it), as the
/// spec's formula and the oracle say.
#[test]
fn cpu_non_finite_keys_reach_only_their_rows() {
    use fa4::{Options, Tensor, TensorMut};
    let (s, h, d) = (300, 2, 64);
    let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(5);
    let mut q = vec![0f32; s * h * d];
    let mut k = vec![0f32; s * h * d];
    let mut v = vec![0f32; s * h * d];
    for x in [&mut q, &mut k, &mut v] {
        fa4::check::random_fill(&mut rng, x, d, 2.0);
    }
    v[100 * h * d] = f32::NAN; // V row 100, head 0, column 0
    k[(h * d) + d] = f32::INFINITY; // K row 1, head 1, column 0
    for x in q.iter_mut().skip(d).step_by(h * d) {
        *x = x.abs() + 0.5; // head 1: q[.][0] > 0, so key 1 scores +inf
    }
    let l = [1, s, h, d];
    let (qt, kt, vt) = (
        Tensor::new(&q, &l).unwrap(),
        Tensor::new(&k, &l).unwrap(),
        Tensor::new(&v, &l).unwrap(),
    );
    let mut o = vec![f32::NAN; s * h * d];
    let mut lse = vec![f32::NAN; h * s];
    let opts = Options::new().causal();
    Backend::Cpu
        .forward(
            &qt,
            &kt,
            &vt,
            &mut TensorMut::new(&mut o, &l).unwrap(),
            Some(&mut lse),
            &opts,
        )
        .unwrap();
    let lo = fa4::tensor::Layout::new("q", &l, None).unwrap();
    let p = fa4::Problem::new(DType::F32, &lo, &lo, &lo, &lo, None, None, &opts).unwrap();
    let r = fa4::check::check(&p, &q, &k, &v, &o, Some(&lse)).unwrap();
    assert!(r.passed(), "{r}");
    // Head 0: rows before 100 are finite, rows from 100 on are NaN.
    let row = |i: usize, hh: usize| &o[(i * h + hh) * d..(i * h + hh + 1) * d];
    assert!((0..100).all(|i| row(i, 0).iter().all(|x| x.is_finite())));
    assert!((100..s).all(|i| row(i, 0)[0].is_nan()));
    // Head 1: row 0 does not see key 1; every later row does (LSE +inf).
    assert!(lse[s].is_finite() && (1..s).all(|i| lse[s + i] == f32::INFINITY));
}
