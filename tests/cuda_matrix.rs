//! The CUDA backend against the float64 oracle: the whole correctness matrix (fp16 and bf16,
//! every head dim), device-buffer calls, and the errors the planner gives. Runs where a GPU
//! works and says plainly why it was skipped elsewhere.

use std::io::Write;

use fa4::check::{matrix, random_fill, run_case};
use fa4::cuda::CudaBackend;
use fa4::{Backend, DType, Error, Options, Tensor, TensorMut};
use half::bf16;
use rand::rngs::StdRng;
use rand::SeedableRng;

fn gpu() -> Option<CudaBackend> {
    match CudaBackend::new(0) {
        Ok(b) => {
            eprintln!("CUDA device: {:?}", b.info());
            Some(b)
        }
        Err(e) => {
            // Written past the test harness's capture so that a skip is always visible.
            let _ = writeln!(
                std::io::stderr(),
                "cuda_matrix: skipped: no usable CUDA device: {e}"
            );
            None
        }
    }
}

#[test]
fn cuda_backend_passes_the_matrix() {
    let Some(cuda) = gpu() else { return };
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
fn larger_problems_pass_on_the_gpu() {
    let Some(cuda) = gpu() else { return };
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

#[test]
fn unsupported_problems_are_clear_errors() {
    let Some(cuda) = gpu() else { return };
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
fn device_buffers_stay_on_the_device() {
    let Some(cuda) = gpu() else { return };
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
    let r = fa4::check::check(&p, &host, &host, &host, &out, Some(&lse));
    assert!(r.passed(), "{r}");
}

#[test]
fn conditional_rescaling_matches_the_oracle() {
    let Some(cuda) = gpu() else { return };
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
fn two_mma_tiles_per_warp_match_the_oracle() {
    let Some(cuda) = gpu() else { return };
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

/// The Hopper kernel, forced, on every matrix case it covers (fixed-length batches, positive
/// scale, head dims 64/128/256; `config::sm90::uncovered` names the rest, which are listed).
/// Runs on Hopper GPUs; elsewhere it says why it was skipped.
#[test]
fn hopper_kernel_matches_the_oracle() {
    let Some(cuda) = gpu() else { return };
    let arch = cuda.info().arch;
    if arch.family != fa4::arch::Family::Hopper {
        let _ = writeln!(
            std::io::stderr(),
            "hopper_kernel_matches_the_oracle: skipped: {} is not a Hopper GPU",
            cuda.info().name
        );
        return;
    }
    let backend = Backend::Cuda(cuda.with_kernel(fa4::cuda::KernelChoice::Sm90));
    let cases = matrix(&[DType::F16, DType::Bf16], &[64, 128, 256]);
    let (mut ran, mut failures, mut uncovered) = (0, Vec::new(), Vec::new());
    for (i, case) in cases.iter().enumerate() {
        let features = fa4::config::sm90::Features {
            head_dim: case.head_dim,
            dtype_size: 2,
            varlen: matches!(case.seqlens, fa4::check::Seqlens::Varlen { .. }),
            nonpositive_scale: case.scale.is_some_and(|s| s <= 0.0),
            no_keys: matches!(case.seqlens, fa4::check::Seqlens::Fixed { k: 0, .. }),
        };
        if let Some(why) = fa4::config::sm90::uncovered(&arch, features) {
            uncovered.push(format!("{case}: {why}"));
            continue;
        }
        ran += 1;
        match run_case(&backend, case, 9000 + i as u64) {
            Ok(r) if r.passed() => {}
            Ok(r) => failures.push(format!("{case}: {r}")),
            Err(e) => failures.push(format!("{case}: error {e}")),
        }
    }
    eprintln!(
        "hopper kernel: {ran} cases run, {} not covered (the sm80 kernel runs them):\n  {}",
        uncovered.len(),
        uncovered.join("\n  ")
    );
    assert!(ran >= 8 * 6, "only {ran} cases covered");
    assert!(
        failures.is_empty(),
        "{} of {ran} cases failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
