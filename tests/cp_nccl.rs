//! The NCCL ring on real GPUs: the N-GPU result against one GPU and the float64 oracle. Needs a
//! machine with 2+ GPUs and NCCL (`bench/device_check.sh DIR cp` runs it with NCCL_NVLS_ENABLE=0).

use fa4::check::{self, random_qkv};
use fa4::cp::{self, Ring, SplitKind};
use fa4::tensor::Layout;
use fa4::{Backend, Element, Options, Problem};
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::SeedableRng;

fn gpu_ring<T: Element>(n: usize, causal: bool, seqlen: usize, hq: usize, hkv: usize) {
    let l = |h: usize| Layout::new("t", &[2, seqlen, h, 128], None).unwrap();
    let opts = if causal {
        Options::new().causal()
    } else {
        Options::new()
    };
    let p = Problem::new(
        T::DTYPE,
        &l(hq),
        &l(hkv),
        &l(hkv),
        &l(hq),
        None,
        None,
        &opts,
    )
    .unwrap();
    let mut rng = StdRng::seed_from_u64(seqlen as u64);
    let mut q = vec![T::NAN; p.q_layout().numel()];
    let mut k = vec![T::NAN; p.k_layout().numel()];
    let mut v = vec![T::NAN; p.v_layout().numel()];
    random_qkv(&mut rng, &mut q, &mut k, &mut v, 128, 128);
    let gpus = cp::cuda::open_devices(n).unwrap();
    let ring = Ring::new(&p, n, SplitKind::Zigzag).unwrap();
    let mut o = vec![T::NAN; p.o_layout().numel()];
    let mut lse = vec![f32::NAN; p.lse_len()];
    let t = cp::cuda::forward(&ring, &gpus, &q, &k, &v, &mut o, Some(&mut lse)).unwrap();
    eprintln!("N={n} causal={causal} s={seqlen}: {t:?}");
    let report =
        check::check(&p, &q, &k, &v, &o, Some(&lse)).expect("the oracle holds the problem");
    assert!(
        report.passed(),
        "N={n} causal={causal} s={seqlen}: {report}"
    );
    let mut o1 = vec![T::NAN; p.o_layout().numel()];
    Backend::Cuda(gpus[0].clone())
        .run(&p, &q, &k, &v, &mut o1, None)
        .unwrap();
    let d = o
        .iter()
        .zip(&o1)
        .map(|(a, b)| (a.to_f32() - b.to_f32()).abs())
        .fold(0f32, f32::max);
    eprintln!("max|O_ring − O_one GPU| = {d}");
}

#[test]
#[ignore = "needs 2+ CUDA GPUs and NCCL"]
fn nccl_ring_on_two_gpus_passes_the_oracle() {
    for causal in [false, true] {
        // 997 rows do not divide 2N = 4 chunks: the chunks differ by a row.
        for seqlen in [1024, 997] {
            gpu_ring::<bf16>(2, causal, seqlen, 8, 2);
            gpu_ring::<f16>(2, causal, seqlen, 4, 4);
        }
    }
}

#[test]
#[ignore = "needs 2+ CUDA GPUs and NCCL"]
fn the_nccl_library_loads() {
    let nccl = cp::nccl::Nccl::get().unwrap();
    eprintln!("{nccl:?}");
    let id = cp::nccl::unique_id().unwrap();
    assert_ne!(id.0, [0u8; 128]);
}

#[test]
#[ignore = "needs 2+ CUDA GPUs and NCCL"]
fn one_rank_per_thread_with_a_shared_unique_id() {
    // The one-process-per-GPU form, with threads standing in for processes: each joins the
    // communicator named by one id and computes its own rank.
    let n = 2;
    let l = |h: usize| Layout::new("t", &[1, 512, h, 128], None).unwrap();
    let p = Problem::new(
        bf16::DTYPE,
        &l(8),
        &l(8),
        &l(8),
        &l(8),
        None,
        None,
        &Options::new().causal(),
    )
    .unwrap();
    let mut rng = StdRng::seed_from_u64(3);
    let mut q = vec![bf16::NAN; p.q_layout().numel()];
    let mut k = q.clone();
    let mut v = q.clone();
    random_qkv(&mut rng, &mut q, &mut k, &mut v, 128, 128);
    let ring = Ring::new(&p, n, SplitKind::Zigzag).unwrap();
    let (sq, sk, sv) = (
        ring.shard(cp::Operand::Q, &q).unwrap(),
        ring.shard(cp::Operand::K, &k).unwrap(),
        ring.shard(cp::Operand::V, &v).unwrap(),
    );
    let id = cp::nccl::unique_id().unwrap();
    let results: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|r| {
                let (ring, sq, sk, sv) = (&ring, &sq, &sk, &sv);
                s.spawn(move || {
                    let gpu = fa4::cuda::CudaBackend::new(r).unwrap();
                    cp::cuda::forward_rank(
                        ring,
                        r,
                        &gpu,
                        &id,
                        sq[r].clone(),
                        sk[r].clone(),
                        sv[r].clone(),
                    )
                    .unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let local = cp::cpu::LocalOutputs {
        o: results.iter().map(|r| r.0.clone()).collect(),
        lse: results.iter().map(|r| r.1.clone()).collect(),
    };
    let mut o = vec![bf16::NAN; p.o_layout().numel()];
    let mut lse = vec![f32::NAN; p.lse_len()];
    ring.gather(&local, &mut o, Some(&mut lse)).unwrap();
    let report =
        check::check(&p, &q, &k, &v, &o, Some(&lse)).expect("the oracle holds the problem");
    assert!(report.passed(), "{report}");
}
