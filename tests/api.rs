//! The public API: validation errors name their argument, views and options behave, and the
//! tolerance rule catches wrong and unwritten outputs.

use fa4::check::{check, random_fill};
use fa4::{Backend, Error, Mask, Options, Tensor, TensorMut};
use rand::rngs::StdRng;
use rand::SeedableRng;

fn arg_of(e: Error) -> String {
    match e {
        Error::InvalidArgument { name, .. } => name,
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

struct Bufs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    o: Vec<f32>,
}

fn bufs(b: usize, sq: usize, sk: usize, hq: usize, hkv: usize, d: usize) -> Bufs {
    let mut rng = StdRng::seed_from_u64(7);
    let mut q = vec![0f32; b * sq * hq * d];
    let mut k = vec![0f32; b * sk * hkv * d];
    let mut v = vec![0f32; b * sk * hkv * d];
    random_fill(&mut rng, &mut q, d, 1.0);
    random_fill(&mut rng, &mut k, d, 1.0);
    random_fill(&mut rng, &mut v, d, 1.0);
    Bufs {
        q,
        k,
        v,
        o: vec![f32::NAN; b * sq * hq * d],
    }
}

#[test]
fn fixed_batch_errors_name_the_argument() {
    let x = bufs(2, 8, 8, 4, 2, 16);
    let q = Tensor::new(&x.q, &[2, 8, 4, 16]).unwrap();
    let k = Tensor::new(&x.k, &[2, 8, 2, 16]).unwrap();
    let v = Tensor::new(&x.v, &[2, 8, 2, 16]).unwrap();
    let cpu = Backend::Cpu;
    let mut o = x.o.clone();

    // K with 3 heads does not divide 4 query heads.
    let k3 = Tensor::new(&x.k[..2 * 8 * 3 * 4], &[2, 8, 3, 4]).unwrap();
    let mut out = TensorMut::new(&mut o, &[2, 8, 4, 16]).unwrap();
    assert_eq!(
        arg_of(
            cpu.forward(&q, &k3, &v, &mut out, None, &Options::new())
                .unwrap_err()
        ),
        "k"
    );

    // V with a different seqlen.
    let v_short = Tensor::new(&x.v[..2 * 7 * 2 * 16], &[2, 7, 2, 16]).unwrap();
    assert_eq!(
        arg_of(
            cpu.forward(&q, &k, &v_short, &mut out, None, &Options::new())
                .unwrap_err()
        ),
        "v"
    );

    // Output of the wrong shape.
    let mut o2 = vec![0f32; 2 * 8 * 4 * 8];
    let mut out2 = TensorMut::new(&mut o2, &[2, 8, 4, 8]).unwrap();
    assert_eq!(
        arg_of(
            cpu.forward(&q, &k, &v, &mut out2, None, &Options::new())
                .unwrap_err()
        ),
        "out"
    );

    // LSE of the wrong length.
    let mut lse = vec![0f32; 5];
    assert_eq!(
        arg_of(
            cpu.forward(&q, &k, &v, &mut out, Some(&mut lse), &Options::new())
                .unwrap_err()
        ),
        "lse"
    );

    // Bad options.
    for (opts, name) in [
        (Options::new().softcap(0.0), "softcap"),
        (Options::new().softcap(f32::NAN), "softcap"),
        (Options::new().scale(f32::INFINITY), "scale"),
    ] {
        assert_eq!(
            arg_of(cpu.forward(&q, &k, &v, &mut out, None, &opts).unwrap_err()),
            name
        );
    }

    // A view larger than its buffer, and a non-contiguous last dimension.
    assert!(Tensor::new(&x.q[..10], &[2, 8, 4, 16]).is_err());
    assert!(Tensor::strided(&x.q, &[2, 8, 4, 16], Some(&[512, 64, 16, 2])).is_err());
    // An output whose strides alias rows.
    let mut out_alias = TensorMut::strided(&mut o, &[2, 8, 4, 16], Some(&[64, 0, 16, 1])).unwrap();
    assert_eq!(
        arg_of(
            cpu.forward(&q, &k, &v, &mut out_alias, None, &Options::new())
                .unwrap_err()
        ),
        "out"
    );
}

#[test]
fn varlen_errors_name_the_argument() {
    let x = bufs(1, 10, 12, 2, 1, 8);
    let q = Tensor::new(&x.q, &[10, 2, 8]).unwrap();
    let k = Tensor::new(&x.k, &[12, 1, 8]).unwrap();
    let v = Tensor::new(&x.v, &[12, 1, 8]).unwrap();
    let mut o = x.o.clone();
    let mut out = TensorMut::new(&mut o, &[10, 2, 8]).unwrap();
    let cpu = Backend::Cpu;
    let cases: [(&[i32], &[i32], &str); 5] = [
        (&[0, 4, 10], &[0, 5, 11], "cu_seqlens_k"), // does not end at total_k
        (&[1, 4, 10], &[0, 5, 12], "cu_seqlens_q"), // does not start at 0
        (&[0, 6, 4, 10], &[0, 5, 5, 12], "cu_seqlens_q"), // decreasing
        (&[0, 4, 10], &[0, 12], "cu_seqlens_k"),    // batch mismatch
        (&[], &[0, 12], "cu_seqlens_q"),            // empty
    ];
    for (cq, ck, name) in cases {
        let e = cpu
            .forward_varlen(&q, &k, &v, cq, ck, &mut out, None, &Options::new())
            .unwrap_err();
        assert_eq!(arg_of(e), name, "{cq:?} {ck:?}");
    }
    // Packed tensors without cu_seqlens, and 4-D tensors with them.
    assert_eq!(
        arg_of(
            cpu.forward(&q, &k, &v, &mut out, None, &Options::new())
                .unwrap_err()
        ),
        "cu_seqlens_q"
    );
    let q4 = Tensor::new(&x.q, &[1, 10, 2, 8]).unwrap();
    assert_eq!(
        arg_of(
            cpu.forward_varlen(
                &q4,
                &k,
                &v,
                &[0, 10],
                &[0, 12],
                &mut out,
                None,
                &Options::new()
            )
            .unwrap_err()
        ),
        "k"
    );
    // A valid call with a zero-length sequence works.
    let mut lse = vec![f32::NAN; 2 * 10];
    cpu.forward_varlen(
        &q,
        &k,
        &v,
        &[0, 0, 4, 10],
        &[0, 3, 3, 12],
        &mut out,
        Some(&mut lse),
        &Options::new().causal(),
    )
    .unwrap();
    // Sequence 1 has 4 queries and no keys: O = 0, LSE = −inf.
    assert!(o[..4 * 2 * 8].iter().all(|&x| x == 0.0));
    assert!(lse[0..4].iter().all(|&x| x == f32::NEG_INFINITY));
}

#[test]
fn strided_views_compute_the_same_function() {
    // Q, K, V as views into one fused [b, s, 3, h, d] buffer.
    let (b, s, h, d) = (2, 19, 2, 8);
    let mut rng = StdRng::seed_from_u64(3);
    let mut qkv = vec![0f32; b * s * 3 * h * d];
    random_fill(&mut rng, &mut qkv, d, 2.0);
    let st = [s * 3 * h * d, 3 * h * d, d, 1];
    let q = Tensor::strided(&qkv, &[b, s, h, d], Some(&st)).unwrap();
    let k = Tensor::strided(&qkv[h * d..], &[b, s, h, d], Some(&st)).unwrap();
    let v = Tensor::strided(&qkv[2 * h * d..], &[b, s, h, d], Some(&st)).unwrap();
    let mut o = vec![f32::NAN; b * s * h * d];
    let mut out = TensorMut::new(&mut o, &[b, s, h, d]).unwrap();
    let opts = Options::new()
        .mask(Mask::Window {
            left: Some(4),
            right: Some(1),
        })
        .softcap(3.0);
    Backend::Cpu
        .forward(&q, &k, &v, &mut out, None, &opts)
        .unwrap();

    let p = fa4::Problem::new(
        fa4::DType::F32,
        q.layout(),
        k.layout(),
        v.layout(),
        out.layout(),
        None,
        None,
        &opts,
    )
    .unwrap();
    let report = check(&p, &qkv, &qkv[h * d..], &qkv[2 * h * d..], &o, None).unwrap();
    assert!(report.passed(), "{report}");
}

#[test]
fn the_tolerance_rule_catches_wrong_and_unwritten_outputs() {
    let x = bufs(1, 16, 16, 2, 2, 32);
    let q = Tensor::new(&x.q, &[1, 16, 2, 32]).unwrap();
    let k = Tensor::new(&x.k, &[1, 16, 2, 32]).unwrap();
    let v = Tensor::new(&x.v, &[1, 16, 2, 32]).unwrap();
    let mut o = x.o.clone();
    let mut out = TensorMut::new(&mut o, &[1, 16, 2, 32]).unwrap();
    let mut lse = vec![f32::NAN; 2 * 16];
    Backend::Cpu
        .forward(&q, &k, &v, &mut out, Some(&mut lse), &Options::new())
        .unwrap();
    let p = fa4::Problem::new(
        fa4::DType::F32,
        q.layout(),
        k.layout(),
        v.layout(),
        out.layout(),
        None,
        None,
        &Options::new(),
    )
    .unwrap();
    assert!(check(&p, &x.q, &x.k, &x.v, &o, Some(&lse))
        .unwrap()
        .passed());

    let mut wrong = o.clone();
    wrong[100] += 1e-3;
    let r = check(&p, &x.q, &x.k, &x.v, &wrong, Some(&lse)).unwrap();
    assert!(!r.passed());
    let (pos, _, _) = r.first_bad.unwrap();
    assert_eq!(
        (pos.row, pos.head, pos.col),
        (1, 1, Some(4)),
        "index 100 = row 1, head 1, col 4"
    );

    let mut unwritten = o.clone();
    unwritten[7] = f32::NAN;
    let r = check(&p, &x.q, &x.k, &x.v, &unwritten, Some(&lse)).unwrap();
    assert!(!r.passed() && r.finiteness_mismatches == 1, "{r}");

    let mut bad_lse = lse.clone();
    bad_lse[3] += 1e-3;
    assert!(!check(&p, &x.q, &x.k, &x.v, &o, Some(&bad_lse))
        .unwrap()
        .passed());
}

/// Sizes no machine holds are errors from `Problem::new`, not an abort in the allocator
/// (`[1 << 40, 1, 1, 1]`: the per-sequence list) or a `capacity overflow` panic (`1 << 62`).
#[test]
fn huge_batches_are_errors_not_aborts() {
    use fa4::tensor::Layout;
    use fa4::{DType, Problem};
    for b in [1usize << 40, 1 << 62, usize::MAX] {
        let l = Layout::new("q", &[b, 1, 1, 1], None).unwrap();
        let e = Problem::new(DType::F32, &l, &l, &l, &l, None, None, &Options::new())
            .expect_err("too many sequences to hold");
        assert!(e.to_string().contains("bytes"), "{e}");
        assert_eq!(arg_of(e), "q");
    }
    // Element counts past usize are refused when the layout is built.
    assert_eq!(
        arg_of(Layout::new("q", &[1 << 62, 4, 1, 1], None).unwrap_err()),
        "q"
    );
    assert!(Layout::new("k", &[1 << 62, 1, 2, 2], Some(&[0, 0, 0, 1])).is_err());
}

/// The CPU backend's public entry checks its slices itself: a short `k` or `out` is an error
/// naming it (it panicked on an index out of bounds).
#[test]
fn cpu_backend_forward_validates_its_slices() {
    use fa4::cpu::CpuBackend;
    use fa4::tensor::Layout;
    use fa4::{DType, Problem};
    let x = bufs(1, 8, 8, 2, 2, 16);
    let l = Layout::new("q", &[1, 8, 2, 16], None).unwrap();
    let p = Problem::new(DType::F32, &l, &l, &l, &l, None, None, &Options::new()).unwrap();
    let cpu = CpuBackend::default();
    let mut o = x.o.clone();
    let mut lse = vec![0f32; p.lse_len()];
    let e = cpu.forward(&p, &x.q, &x.k[..100], &x.v, &mut o, None);
    assert_eq!(arg_of(e.unwrap_err()), "k");
    let e = cpu.forward(&p, &x.q, &x.k, &x.v, &mut o[..255], None);
    assert_eq!(arg_of(e.unwrap_err()), "out");
    let e = cpu.forward(&p, &x.q, &x.k, &x.v, &mut o, Some(&mut lse[..3]));
    assert_eq!(arg_of(e.unwrap_err()), "lse");
    let threads0 = CpuBackend {
        threads: Some(0),
        tiles: None,
    };
    let e = threads0.forward(&p, &x.q, &x.k, &x.v, &mut o, None);
    assert_eq!(arg_of(e.unwrap_err()), "threads");
    cpu.forward(&p, &x.q, &x.k, &x.v, &mut o, Some(&mut lse))
        .unwrap();
    assert!(o.iter().all(|x| x.is_finite()));
}

/// A batch of sequences without query rows is a valid problem with empty outputs (its O has
/// batch stride 0, which was taken for overlapping elements).
#[test]
fn an_empty_batch_returns_empty_outputs() {
    let (q, k) = (Vec::<f32>::new(), vec![0.5f32; 2 * 16]);
    let mut o = Vec::<f32>::new();
    let mut lse = Vec::<f32>::new();
    Backend::Cpu
        .forward(
            &Tensor::new(&q, &[2, 0, 1, 16]).unwrap(),
            &Tensor::new(&k, &[2, 1, 1, 16]).unwrap(),
            &Tensor::new(&k, &[2, 1, 1, 16]).unwrap(),
            &mut TensorMut::new(&mut o, &[2, 0, 1, 16]).unwrap(),
            Some(&mut lse),
            &Options::new(),
        )
        .unwrap();
    // Sequences without keys are empty too, with a query row each (LSE -inf, O 0 by the spec).
    let q1 = vec![1.0f32; 2 * 16];
    let mut o1 = vec![f32::NAN; 2 * 16];
    let mut lse1 = vec![f32::NAN; 2];
    Backend::Cpu
        .forward(
            &Tensor::new(&q1, &[2, 1, 1, 16]).unwrap(),
            &Tensor::new(&q, &[2, 0, 1, 16]).unwrap(),
            &Tensor::new(&q, &[2, 0, 1, 16]).unwrap(),
            &mut TensorMut::new(&mut o1, &[2, 1, 1, 16]).unwrap(),
            Some(&mut lse1),
            &Options::new(),
        )
        .unwrap();
    assert!(lse1.iter().all(|&l| l == f32::NEG_INFINITY), "{lse1:?}");
    assert!(o1.iter().all(|&x| x == 0.0), "{o1:?}");
}

/// `Backend::auto_explained` accounts for its choice on one line.
#[test]
fn auto_explains_its_choice_on_one_line() {
    let (b, why) = Backend::auto_explained();
    assert!(!why.contains('\n'), "{why}");
    match b {
        Backend::Cpu => assert!(why.starts_with("chose cpu: no usable GPU ("), "{why}"),
        other => assert!(why.contains(&other.name()), "{why}"),
    }
}
