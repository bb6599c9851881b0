//! The Blackwell (SM100) kernel against the float64 oracle: ready for the first run on a B200.
//! It has never run (no Blackwell GPU was available); on a machine without one these tests are
//! reported as ignored. Run them with `cargo test --release --test cuda_sm100 -- --ignored`.

use fa4::check::{matrix, run_case};
use fa4::config::sm100_kernel::HEAD_DIMS;
use fa4::cuda::{CudaBackend, KernelChoice};
use fa4::{Backend, DType};

#[test]
#[ignore = "needs a Blackwell (SM100) GPU"]
fn sm100_kernel_passes_the_matrix() {
    let cuda = CudaBackend::new(0)
        .expect("a CUDA GPU")
        .with_kernel(KernelChoice::Sm100);
    assert_eq!(cuda.info().target, "sm_100", "this test needs an SM100 GPU");
    let backend = Backend::Cuda(cuda);
    let mut failed = Vec::new();
    let mut ran = 0;
    for case in matrix(&[DType::Bf16, DType::F16], &HEAD_DIMS) {
        match run_case(&backend, &case, 7) {
            Ok(r) if r.passed() => ran += 1,
            Ok(r) => failed.push(format!("{case:?}: {r}")),
            // Problems the kernel does not cover (varlen, other head dims) are refused by name.
            Err(fa4::Error::InvalidArgument { .. }) => {}
            Err(e) => failed.push(format!("{case:?}: {e}")),
        }
    }
    assert!(ran > 0, "no case ran on the sm100 kernel");
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}
