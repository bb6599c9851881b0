//! fp8 (e4m3) inputs on the GPU: the Hopper kernel's e4m3 variant against the float64 oracle of
//! the dequantized inputs (the fp8 correctness matrix, longer problems on every tile entry,
//! varlen batches, the descales), and the errors of the device entry point. Every test is
//! ignored unless run with `--include-ignored`, and fails where no Hopper GPU works.

use fa4::check::{matrix, run_case, Case, Seqlens};
use fa4::cuda::fp8::DeviceDescales;
use fa4::cuda::CudaBackend;
use fa4::fp8::{quantize, Descales, Operand, F8E4M3};
use fa4::tensor::Layout;
use fa4::{Backend, DType, Error, Mask, Options, Problem};
use half::bf16;
use rand::rngs::StdRng;
use rand::SeedableRng;

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
#[ignore = "needs a CUDA GPU (Hopper)"]
fn hopper_fp8_passes_the_matrix() {
    let backend = Backend::Cuda(gpu());
    let cases = matrix(&[DType::Fp8E4M3], &[32, 64, 80, 96, 128, 192, 256]);
    let mut failures = Vec::new();
    let mut worst = 0f64;
    for (i, case) in cases.iter().enumerate() {
        match run_case(&backend, case, 7000 + i as u64) {
            Ok(r) if r.passed() => worst = worst.max(r.max_err / r.bound.max(1e-30)),
            Ok(r) => failures.push(format!("{case}: {r}")),
            Err(e) => failures.push(format!("{case}: error {e}")),
        }
    }
    eprintln!(
        "{} fp8 cases; worst O error / bound {worst:.3}",
        cases.len()
    );
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

/// Problems of many key blocks and query tiles on every tile entry (d128 takes 128- and
/// 256-key blocks through the override), causal and not, GQA, d_v < d, varlen with ragged and
/// empty sequences.
#[test]
#[ignore = "needs a CUDA GPU (Hopper)"]
fn longer_fp8_problems_pass_on_every_tile_entry() {
    let cuda = gpu();
    let arch = cuda.info().arch;
    let mut failures = Vec::new();
    let fixed = |batch, sq, sk| Seqlens::Fixed {
        batch,
        q: sq,
        k: sk,
    };
    let shapes: Vec<(Seqlens, usize, usize, usize, usize, Mask)> = vec![
        (fixed(2, 1000, 1000), 4, 2, 128, 128, Mask::Causal),
        (fixed(1, 513, 2049), 4, 1, 64, 64, Mask::None),
        (fixed(2, 777, 300), 2, 2, 256, 256, Mask::Causal),
        (fixed(1, 600, 1300), 4, 4, 192, 128, Mask::None),
        (
            fixed(1, 300, 900),
            2,
            1,
            96,
            96,
            Mask::Window {
                left: Some(200),
                right: Some(50),
            },
        ),
        (
            Seqlens::Varlen {
                q: vec![700, 0, 257, 1],
                k: vec![900, 5, 257, 1000],
            },
            4,
            2,
            128,
            128,
            Mask::Causal,
        ),
    ];
    let d128 = fa4::config::sm90::fp8::fp8_candidates(128.into());
    for (i, (seqlens, hq, hkv, d, dv, mask)) in shapes.into_iter().enumerate() {
        let case = Case {
            dtype: DType::Fp8E4M3,
            seqlens,
            heads_q: hq,
            heads_kv: hkv,
            head_dim: d,
            head_dim_v: dv,
            mask,
            softcap: None,
            scale: None,
            strided: false,
            nan: false,
        };
        let mut runs: Vec<(String, Backend)> =
            vec![("planned".into(), Backend::Cuda(cuda.clone()))];
        if d == 128 {
            for t in &d128 {
                if t.check_elem(128, &arch, 1).is_ok() {
                    runs.push((
                        format!("{t:?}"),
                        Backend::Cuda(cuda.with_sm90_tiles(Some(*t))),
                    ));
                }
            }
        }
        for (what, b) in runs {
            match run_case(&b, &case, 900 + i as u64) {
                Ok(r) if r.passed() => {}
                Ok(r) => failures.push(format!("{case} ({what}): {r}")),
                Err(e) => failures.push(format!("{case} ({what}): error {e}")),
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A small varlen batch with GQA, a window and softcap (several sequences per tile walk, the
/// dynamic schedule, the Vᵀ offsets): the case the device check sanitizes.
#[test]
#[ignore = "needs a CUDA GPU (Hopper)"]
fn small_fp8_varlen_batch_passes() {
    let backend = Backend::Cuda(gpu());
    let case = Case {
        dtype: DType::Fp8E4M3,
        seqlens: Seqlens::Varlen {
            q: vec![130, 0, 61, 200],
            k: vec![150, 7, 0, 260],
        },
        heads_q: 4,
        heads_kv: 2,
        head_dim: 128,
        head_dim_v: 128,
        mask: Mask::Window {
            left: Some(90),
            right: Some(10),
        },
        softcap: Some(15.0),
        scale: None,
        strided: false,
        nan: false,
    };
    let r = run_case(&backend, &case, 5).unwrap();
    assert!(r.passed(), "{case}: {r}");
}

/// The device entry point: O equals the host path's bit for bit (the same launches), and wrong
/// descale lengths, a wrong O type and a non-Hopper refusal are errors naming the argument; a
/// device descale that is not positive makes its rows NaN (it is not read back).
#[test]
#[ignore = "needs a CUDA GPU (Hopper)"]
fn the_device_entry_point_checks_what_it_can() {
    let cuda = gpu();
    let (b, s, hq, hkv, d) = (2, 300, 4, 2, 128);
    let ql = Layout::new("q", &[b, s, hq, d], None).unwrap();
    let kl = Layout::new("k", &[b, s, hkv, d], None).unwrap();
    let p = Problem::new_fp8(
        DType::Bf16,
        &ql,
        &kl,
        &kl,
        &ql,
        None,
        None,
        &Options::new().causal(),
    )
    .unwrap();
    let mut rng = StdRng::seed_from_u64(3);
    let (mut q, mut k, mut v) = (
        vec![0f32; ql.numel()],
        vec![0f32; kl.numel()],
        vec![0f32; kl.numel()],
    );
    fa4::check::random_qkv(&mut rng, &mut q, &mut k, &mut v, d, d);
    let (q8, dq) = quantize(&p, Operand::Q, "q", &q).unwrap();
    let (k8, dk) = quantize(&p, Operand::K, "k", &k).unwrap();
    let (v8, dv) = quantize(&p, Operand::V, "v", &v).unwrap();
    let ds = Descales::new(Some(&dq), Some(&dk), Some(&dv));
    let mut host = vec![bf16::ZERO; ql.numel()];
    Backend::Cuda(cuda.clone())
        .run_fp8(&p, &q8, &k8, &v8, &ds, &mut host, None)
        .unwrap();
    let r = fa4::check::check_fp8(&p, &q8, &k8, &v8, &ds, &host, None).unwrap();
    assert!(r.passed(), "{r}");

    let st = cuda.stream().clone();
    let up = |x: &[F8E4M3]| st.clone_htod(x).unwrap();
    let (gq, gk, gv) = (up(&q8), up(&k8), up(&v8));
    let (gdq, gdk) = (st.clone_htod(&dq).unwrap(), st.clone_htod(&dk).unwrap());
    let gdv = st.clone_htod(&dv).unwrap();
    let mut out = cuda.alloc::<bf16>(ql.numel()).unwrap();
    let descales = DeviceDescales {
        q: Some(&gdq),
        k: Some(&gdk),
        v: Some(&gdv),
    };
    cuda.forward_fp8_device(
        &p,
        &gq,
        &gk,
        &gv,
        &descales,
        &mut out,
        None::<&mut cudarc::driver::CudaSlice<f32>>,
    )
    .unwrap();
    assert_eq!(
        cuda.download(&out).unwrap(),
        host,
        "device and host paths agree"
    );

    // A descale array of the wrong length names itself.
    let short = st.clone_htod(&dq[..1]).unwrap();
    let bad = DeviceDescales {
        q: None,
        k: Some(&short),
        v: None,
    };
    match cuda.forward_fp8_device(
        &p,
        &gq,
        &gk,
        &gv,
        &bad,
        &mut out,
        None::<&mut cudarc::driver::CudaSlice<f32>>,
    ) {
        Err(Error::InvalidArgument { name, .. }) => assert_eq!(name, "k_descale"),
        other => panic!("expected an error naming k_descale, got {other:?}"),
    }
    // O's type must be the problem's.
    let mut wrong = cuda.alloc::<half::f16>(ql.numel()).unwrap();
    match cuda.forward_fp8_device(
        &p,
        &gq,
        &gk,
        &gv,
        &descales,
        &mut wrong,
        None::<&mut cudarc::driver::CudaSlice<f32>>,
    ) {
        Err(Error::InvalidArgument { name, .. }) => assert_eq!(name, "out"),
        other => panic!("expected an error naming out, got {other:?}"),
    }
    // A zero V descale on the device: the rows it scales are NaN, the others as before.
    let mut dv0 = dv.clone();
    dv0[1] = 0.0; // sequence 0, KV head 1: query heads 2 and 3
    let gdv0 = st.clone_htod(&dv0).unwrap();
    let zeroed = DeviceDescales {
        q: Some(&gdq),
        k: Some(&gdk),
        v: Some(&gdv0),
    };
    cuda.forward_fp8_device(
        &p,
        &gq,
        &gk,
        &gv,
        &zeroed,
        &mut out,
        None::<&mut cudarc::driver::CudaSlice<f32>>,
    )
    .unwrap();
    let got = cuda.download(&out).unwrap();
    for (i, (x, y)) in got.iter().zip(&host).enumerate() {
        let (seq, head) = (i / (s * hq * d), (i / d) % hq);
        if seq == 0 && head >= 2 {
            assert!(x.to_f32().is_nan(), "element {i}");
        } else {
            assert_eq!(x.to_bits(), y.to_bits(), "element {i}");
        }
    }
}
