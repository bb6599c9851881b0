//! The backward pass on the CPU: the float64 gradient oracle against central finite differences
//! of the float64 forward, the CPU backward against the oracle on a matrix, determinism bit for
//! bit, and errors naming the argument on bad input.

use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use fa4::check::grad::{grad_matrix, run_grad_case};
use fa4::cpu::reference::attention_f64;
use fa4::cpu::reference_grad::grad_f64;
use fa4::cpu::{CpuBackend, CpuTiles};
use fa4::tensor::Layout;
use fa4::{Backend, BackwardOptions, DType, Error, Mask, Options, Problem, Tensor, TensorMut};

/// Values on a 2⁻⁶ grid in [−2, 2]: x ± 2⁻¹² is exact in f32, so a finite difference perturbs
/// exactly the input it means to.
fn grid(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| rng.random_range(-128i32..=128) as f32 / 64.0)
        .collect()
}

/// A tiny problem for finite differences: Q, K, V, O contiguous.
struct Tiny {
    p: Problem,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    d_out: Vec<f32>,
    ol: Layout,
}

fn tiny(
    q_shape: &[usize],
    k_shape: &[usize],
    dv: usize,
    cu: Option<(&[i32], &[i32])>,
    opts: Options,
    seed: u64,
) -> Tiny {
    let mut v_shape = k_shape.to_vec();
    *v_shape.last_mut().unwrap() = dv;
    let mut o_shape = q_shape.to_vec();
    *o_shape.last_mut().unwrap() = dv;
    let l = |s: &[usize]| Layout::new("t", s, None).unwrap();
    let (ql, kl, vl, ol) = (l(q_shape), l(k_shape), l(&v_shape), l(&o_shape));
    let p = Problem::new(
        DType::F32,
        &ql,
        &kl,
        &vl,
        &ol,
        cu.map(|c| c.0),
        cu.map(|c| c.1),
        &opts,
    )
    .unwrap();
    let mut rng = StdRng::seed_from_u64(seed);
    Tiny {
        q: grid(&mut rng, ql.numel()),
        k: grid(&mut rng, kl.numel()),
        v: grid(&mut rng, vl.numel()),
        d_out: grid(&mut rng, ol.numel()),
        p,
        ol,
    }
}

/// `L = Σ dO·O` of the float64 forward (O contiguous, the oracle's layout).
fn loss(t: &Tiny, q: &[f32], k: &[f32], v: &[f32]) -> f64 {
    let o = attention_f64(&t.p, q, k, v)
        .expect("the oracle holds a tiny problem")
        .o;
    o.iter().zip(&t.d_out).map(|(a, &b)| a * f64::from(b)).sum()
}

/// Central differences of `L` against the oracle, for every element of Q, K and V.
fn finite_differences(t: &Tiny, what: &str) {
    const H: f32 = 1.0 / 4096.0;
    let g = grad_f64(&t.p, &t.q, &t.k, &t.v, &t.d_out, &t.ol);
    let mut worst = 0f64;
    for (name, which, want) in [("dq", 0, &g.dq), ("dk", 1, &g.dk), ("dv", 2, &g.dv)] {
        let n = [t.q.len(), t.k.len(), t.v.len()][which];
        for e in 0..n {
            let eval = |delta: f32| {
                let (mut q, mut k, mut v) = (t.q.clone(), t.k.clone(), t.v.clone());
                [&mut q, &mut k, &mut v][which][e] += delta;
                loss(t, &q, &k, &v)
            };
            let fd = (eval(H) - eval(-H)) / (2.0 * f64::from(H));
            let err = (fd - want[e]).abs();
            worst = worst.max(err);
            // The central difference's own error is O(H²·L''') ≈ 1e-7 on these inputs.
            assert!(
                err <= 2e-6 * (1.0 + want[e].abs()),
                "{what}: {name}[{e}] finite difference {fd}, oracle {}",
                want[e]
            );
        }
    }
    // The oracle is not all zeros (a vacuous pass).
    assert!(
        g.dq.iter().chain(&g.dk).any(|x| x.abs() > 1e-3),
        "{what}: gradients vanish"
    );
    eprintln!("{what}: max |fd − oracle| {worst:.1e}");
}

#[test]
fn oracle_matches_finite_differences() {
    let w = |l: i64, r: i64| Mask::window_from_signed(l, r).unwrap();
    let cases: Vec<(&str, Tiny)> = vec![
        (
            "plain",
            tiny(&[2, 4, 2, 3], &[2, 5, 2, 3], 2, None, Options::new(), 1),
        ),
        (
            "causal sq>sk",
            tiny(
                &[1, 5, 1, 3],
                &[1, 3, 1, 3],
                3,
                None,
                Options::new().causal(),
                2,
            ),
        ),
        (
            "causal sq<sk",
            tiny(
                &[1, 3, 1, 2],
                &[1, 6, 1, 2],
                2,
                None,
                Options::new().causal(),
                3,
            ),
        ),
        (
            "window(1,0)",
            tiny(
                &[1, 5, 1, 3],
                &[1, 5, 1, 3],
                2,
                None,
                Options::new().mask(w(1, 0)),
                4,
            ),
        ),
        (
            "window(0,2)",
            tiny(
                &[1, 4, 1, 3],
                &[1, 6, 1, 3],
                2,
                None,
                Options::new().mask(w(0, 2)),
                5,
            ),
        ),
        // Scores of a few units against a cap of 1.5: tanh is well into its curve.
        (
            "softcap",
            tiny(
                &[1, 4, 1, 4],
                &[1, 4, 1, 4],
                3,
                None,
                Options::new().softcap(1.5).scale(0.9),
                6,
            ),
        ),
        (
            "gqa 4/2",
            tiny(&[1, 3, 4, 3], &[1, 4, 2, 3], 2, None, Options::new(), 7),
        ),
        (
            "mqa 3/1 causal",
            tiny(
                &[1, 4, 3, 2],
                &[1, 4, 1, 2],
                3,
                None,
                Options::new().causal(),
                8,
            ),
        ),
        (
            "varlen",
            tiny(
                &[5, 2, 3],
                &[6, 1, 3],
                2,
                Some((&[0, 2, 2, 5], &[0, 3, 5, 6])),
                Options::new().causal().softcap(2.0),
                9,
            ),
        ),
    ];
    for (what, t) in &cases {
        finite_differences(t, what);
    }
}

#[test]
fn cpu_backward_passes_the_gradient_rule_on_the_matrix() {
    let cases = grad_matrix(&[DType::F32, DType::F16, DType::Bf16], &[32, 80]);
    assert!(cases.len() > 60);
    let mut failed = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let report = run_grad_case(&Backend::Cpu, case, 7000 + i as u64).unwrap();
        if !report.passed() {
            failed.push(format!("{case}: {report}"));
        }
    }
    assert!(
        failed.is_empty(),
        "{} failed:\n{}",
        failed.len(),
        failed.join("\n")
    );
}

#[test]
fn odd_tiles_and_thread_counts_pass() {
    let tiles = [
        CpuTiles {
            block_m: 17,
            block_n: 13,
        },
        CpuTiles {
            block_m: 1,
            block_n: 64,
        },
    ];
    let cases = grad_matrix(&[DType::F32, DType::Bf16], &[24]);
    for t in tiles {
        let backend = Backend::CpuWith(CpuBackend {
            threads: Some(3),
            tiles: Some(t),
        });
        for (i, case) in cases.iter().enumerate() {
            let r = run_grad_case(&backend, case, 9000 + i as u64).unwrap();
            assert!(r.passed(), "{t:?} {case}: {r}");
        }
    }
}

/// One problem's gradients on `backend`, as bits.
fn grads_bits(backend: &Backend, seed: u64) -> Vec<u16> {
    let (b, sq, sk, hq, hkv, d) = (2, 150, 170, 4, 2, 40);
    let mut rng = StdRng::seed_from_u64(seed);
    let mut draw = |n: usize| -> Vec<bf16> {
        (0..n)
            .map(|_| bf16::from_f32(rng.random_range(-2.0f32..2.0)))
            .collect()
    };
    let (q, k, v) = (
        draw(b * sq * hq * d),
        draw(b * sk * hkv * d),
        draw(b * sk * hkv * d),
    );
    let d_out = draw(b * sq * hq * d);
    let qs = [b, sq, hq, d];
    let ks = [b, sk, hkv, d];
    let opts = Options::new().mask(Mask::window_from_signed(60, 5).unwrap());
    let mut o = vec![bf16::NAN; q.len()];
    let mut lse = vec![f32::NAN; b * hq * sq];
    let qt = Tensor::new(&q, &qs).unwrap();
    let kt = Tensor::new(&k, &ks).unwrap();
    let vt = Tensor::new(&v, &ks).unwrap();
    Backend::Cpu
        .forward(
            &qt,
            &kt,
            &vt,
            &mut TensorMut::new(&mut o, &qs).unwrap(),
            Some(&mut lse),
            &opts,
        )
        .unwrap();
    let (mut dq, mut dk, mut dv) = (
        vec![bf16::NAN; q.len()],
        vec![bf16::NAN; k.len()],
        vec![bf16::NAN; v.len()],
    );
    backend
        .backward(
            &qt,
            &kt,
            &vt,
            &Tensor::new(&o, &qs).unwrap(),
            &lse,
            &Tensor::new(&d_out, &qs).unwrap(),
            &mut TensorMut::new(&mut dq, &qs).unwrap(),
            &mut TensorMut::new(&mut dk, &ks).unwrap(),
            &mut TensorMut::new(&mut dv, &ks).unwrap(),
            &BackwardOptions::new(opts).deterministic(true),
        )
        .unwrap();
    dq.iter()
        .chain(&dk)
        .chain(&dv)
        .map(|x| x.to_bits())
        .collect()
}

#[test]
fn backward_is_deterministic_across_runs_and_thread_counts() {
    let first = grads_bits(&Backend::Cpu, 5);
    assert!(first.iter().any(|&b| b != 0 && b != bf16::NAN.to_bits()));
    for threads in [1, 2, 3, 5] {
        for _ in 0..2 {
            let cpu = Backend::CpuWith(CpuBackend {
                threads: Some(threads),
                tiles: None,
            });
            assert!(
                grads_bits(&cpu, 5) == first,
                "{threads} threads gave other bits"
            );
        }
    }
}

#[test]
fn bad_inputs_name_the_argument() {
    let (s, h, d) = (8, 2, 4);
    let shape = [1, s, h, d];
    let x = vec![1.0f32; s * h * d];
    let lse = vec![0.0f32; h * s];
    let t = Tensor::new(&x, &shape).unwrap();
    let opts: BackwardOptions = Options::new().into();
    let name_of = |r: fa4::Result<()>| match r {
        Err(Error::InvalidArgument { name, .. }) => name,
        other => panic!("expected an invalid-argument error, got {other:?}"),
    };
    let run =
        |lse: &[f32], g: &Tensor<'_, f32>, dq_shape: &[usize], dk_strides: Option<&[usize]>| {
            let (mut a, mut b, mut c) = (
                vec![0f32; 4 * x.len()],
                vec![0f32; x.len()],
                vec![0f32; x.len()],
            );
            let mut dq = TensorMut::new(&mut a, dq_shape).unwrap();
            let mut dk = TensorMut::strided(&mut b, &shape, dk_strides).unwrap();
            let mut dv = TensorMut::new(&mut c, &shape).unwrap();
            Backend::Cpu.backward(&t, &t, &t, &t, lse, g, &mut dq, &mut dk, &mut dv, &opts)
        };
    assert!(run(&lse, &t, &shape, None).is_ok());
    assert_eq!(name_of(run(&lse[1..], &t, &shape, None)), "lse");
    let short = Tensor::new(&x[..s * h * d / 2], &[1, s / 2, h, d]).unwrap();
    assert_eq!(name_of(run(&lse, &short, &shape, None)), "d_out");
    assert_eq!(name_of(run(&lse, &t, &[1, s, h, 2 * d], None)), "dq");
    // Rows of dK overlapping each other.
    assert_eq!(name_of(run(&lse, &t, &shape, Some(&[0, 4, 4, 1]))), "dk");
    // A varlen call whose offsets do not end at the total.
    let packed = Tensor::new(&x, &[s, h, d]).unwrap();
    let (mut a, mut b, mut c) = (x.clone(), x.clone(), x.clone());
    let r = Backend::Cpu.backward_varlen(
        &packed,
        &packed,
        &packed,
        &[0, 3, 7],
        &[0, 3, 8],
        &packed,
        &lse,
        &packed,
        &mut TensorMut::new(&mut a, &[s, h, d]).unwrap(),
        &mut TensorMut::new(&mut b, &[s, h, d]).unwrap(),
        &mut TensorMut::new(&mut c, &[s, h, d]).unwrap(),
        &opts,
    );
    assert_eq!(name_of(r), "cu_seqlens_q");
}

#[test]
fn strided_views_give_the_bits_of_contiguous_ones() {
    // dO a view into a wider buffer (its own strides, not O's), dQ/dK/dV likewise.
    let (b, sq, sk, hq, hkv, d) = (2, 37, 41, 4, 2, 24);
    let mut rng = StdRng::seed_from_u64(11);
    let mut draw = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-2.0..2.0)).collect() };
    let (qs, ks) = ([b, sq, hq, d], [b, sk, hkv, d]);
    let (q, k, v) = (
        draw(b * sq * hq * d),
        draw(b * sk * hkv * d),
        draw(b * sk * hkv * d),
    );
    let d_out = draw(b * sq * hq * d);
    let opts = Options::new().causal();
    let (qt, kt, vt) = (
        Tensor::new(&q, &qs).unwrap(),
        Tensor::new(&k, &ks).unwrap(),
        Tensor::new(&v, &ks).unwrap(),
    );
    let mut o = vec![0f32; q.len()];
    let mut lse = vec![0f32; b * hq * sq];
    let cpu = Backend::Cpu;
    cpu.forward(
        &qt,
        &kt,
        &vt,
        &mut TensorMut::new(&mut o, &qs).unwrap(),
        Some(&mut lse),
        &opts,
    )
    .unwrap();
    let ot = Tensor::new(&o, &qs).unwrap();
    let bopts: BackwardOptions = opts.into();

    let (mut dq, mut dk, mut dv) = (
        vec![0f32; q.len()],
        vec![0f32; k.len()],
        vec![0f32; v.len()],
    );
    cpu.backward(
        &qt,
        &kt,
        &vt,
        &ot,
        &lse,
        &Tensor::new(&d_out, &qs).unwrap(),
        &mut TensorMut::new(&mut dq, &qs).unwrap(),
        &mut TensorMut::new(&mut dk, &ks).unwrap(),
        &mut TensorMut::new(&mut dv, &ks).unwrap(),
        &bopts,
    )
    .unwrap();

    // Padded: each row of heads followed by 5 spare elements, poisoned.
    let pad = |s: [usize; 4]| [s[1] * (s[2] * s[3] + 5), s[2] * s[3] + 5, s[3], 1];
    let (qp, kp) = (pad(qs), pad(ks));
    let mut d_out_w = vec![f32::NAN; b * qp[0]];
    for bi in 0..b {
        for r in 0..sq {
            for h in 0..hq {
                let src = ((bi * sq + r) * hq + h) * d;
                let dst = bi * qp[0] + r * qp[1] + h * qp[2];
                d_out_w[dst..dst + d].copy_from_slice(&d_out[src..src + d]);
            }
        }
    }
    let (mut dq_w, mut dk_w, mut dv_w) = (
        vec![f32::NAN; b * qp[0]],
        vec![f32::NAN; b * kp[0]],
        vec![f32::NAN; b * kp[0]],
    );
    cpu.backward(
        &qt,
        &kt,
        &vt,
        &ot,
        &lse,
        &Tensor::strided(&d_out_w, &qs, Some(&qp)).unwrap(),
        &mut TensorMut::strided(&mut dq_w, &qs, Some(&qp)).unwrap(),
        &mut TensorMut::strided(&mut dk_w, &ks, Some(&kp)).unwrap(),
        &mut TensorMut::strided(&mut dv_w, &ks, Some(&kp)).unwrap(),
        &bopts,
    )
    .unwrap();
    let gather = |w: &[f32], s: [usize; 4], st: [usize; 4]| -> Vec<u32> {
        let mut out = Vec::new();
        for bi in 0..s[0] {
            for r in 0..s[1] {
                for h in 0..s[2] {
                    let o = bi * st[0] + r * st[1] + h * st[2];
                    out.extend(w[o..o + s[3]].iter().map(|x| x.to_bits()));
                }
            }
        }
        out
    };
    let bits = |x: &[f32]| x.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    assert!(gather(&dq_w, qs, qp) == bits(&dq));
    assert!(gather(&dk_w, ks, kp) == bits(&dk));
    assert!(gather(&dv_w, ks, kp) == bits(&dv));
    // The padding was not written.
    assert!(dq_w[qp[1] - 5..qp[1]].iter().all(|x| x.is_nan()));
}

/// Huge finite scores (scale 1e30 and 3e8: scores near 1e31 and 1e9) are finite inputs, so
/// their gradients are finite. `P = exp(s − LSE)` is recomputed from the forward's LSE, and at
/// that magnitude `s` and `LSE` differ by their own rounding (ulps of 1e31): the exponent must
/// not overflow into +∞ · 0 = NaN. (How close the gradients come to the oracle at such scales
/// is a conditioning limit, stated in docs/backward.md; this test asks for finiteness.)
#[test]
fn huge_finite_scores_give_finite_gradients() {
    let shape = [1, 70, 2, 32];
    let n: usize = shape.iter().product();
    let mut rng = StdRng::seed_from_u64(7);
    let x = grid(&mut rng, 4 * n);
    let (q, k, v, d_out) = (&x[..n], &x[n..2 * n], &x[2 * n..3 * n], &x[3 * n..]);
    for scale in [1e30f32, 3e8] {
        for causal in [false, true] {
            let opts = Options::new().scale(scale);
            let opts = if causal { opts.causal() } else { opts };
            let (mut o, mut lse) = (vec![f32::NAN; n], vec![f32::NAN; 2 * 70]);
            let (qt, kt, vt) = (
                Tensor::new(q, &shape).unwrap(),
                Tensor::new(k, &shape).unwrap(),
                Tensor::new(v, &shape).unwrap(),
            );
            Backend::Cpu
                .forward(
                    &qt,
                    &kt,
                    &vt,
                    &mut TensorMut::new(&mut o, &shape).unwrap(),
                    Some(&mut lse),
                    &opts,
                )
                .unwrap();
            assert!(
                o.iter().chain(&lse).all(|x| x.is_finite()),
                "forward, scale {scale}"
            );
            let (mut dq, mut dk, mut dv) =
                (vec![f32::NAN; n], vec![f32::NAN; n], vec![f32::NAN; n]);
            Backend::Cpu
                .backward(
                    &qt,
                    &kt,
                    &vt,
                    &Tensor::new(&o, &shape).unwrap(),
                    &lse,
                    &Tensor::new(d_out, &shape).unwrap(),
                    &mut TensorMut::new(&mut dq, &shape).unwrap(),
                    &mut TensorMut::new(&mut dk, &shape).unwrap(),
                    &mut TensorMut::new(&mut dv, &shape).unwrap(),
                    &BackwardOptions::new(opts),
                )
                .unwrap();
            for (name, g) in [("dQ", &dq), ("dK", &dk), ("dV", &dv)] {
                let bad = g.iter().position(|x| !x.is_finite());
                assert!(
                    bad.is_none(),
                    "scale {scale} causal {causal}: {name}[{bad:?}] not finite"
                );
            }
        }
    }
}
