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
