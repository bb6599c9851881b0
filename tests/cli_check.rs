//! `fa4 check` end to end: one line per case of the matrix and the summary line
//! `N passed, M failed`; bad filters are one line on stderr and exit code 2.

use fa4::check::matrix;
use fa4::DType;

mod common;
use common::fa4;

/// Runs `fa4 check` with `args`, expects every case to pass and returns the case lines.
fn passes(args: &[&str], want_cases: usize) -> Vec<String> {
    // The CPU unless a test names a backend: auto would take a GPU where one works, and the
    // matrix's f32 cases are the CPU's.
    let mut full = vec!["check"];
    if !args.contains(&"--backend") {
        full.extend_from_slice(&["--backend", "cpu"]);
    }
    full.extend_from_slice(args);
    let (code, out, err) = fa4(&full);
    assert_eq!(code, 0, "{args:?}: {err}\n{out}");
    let last = out.lines().last().unwrap_or_default();
    assert_eq!(last, format!("{want_cases} passed, 0 failed"), "{out}");
    let cases: Vec<String> = out
        .lines()
        .filter(|l| l.starts_with("case "))
        .map(String::from)
        .collect();
    assert_eq!(cases.len(), want_cases, "{out}");
    for c in &cases {
        assert!(c.contains(": pass: max|O−ref|"), "{c}");
    }
    cases
}

#[test]
fn f32_head_dim_64_passes() {
    let n = matrix(&[DType::F32], &[64]).len();
    assert!(n >= 10);
    let cases = passes(&["--dtype", "f32", "--head-dim", "64"], n);
    assert!(cases.iter().all(|c| c.contains(" f32 d=64 ")), "{cases:#?}");
    assert!(cases.iter().any(|c| c.contains("varlen")));
}

#[test]
fn filters_take_lists_and_repeats() {
    let n = matrix(&[DType::Bf16, DType::F16], &[32, 80]).len();
    let cases = passes(
        &[
            "--dtype",
            "bf16,fp16",
            "--head-dim",
            "32",
            "--head-dim",
            "80",
            "--head-dim",
            "32",
            "--backend",
            "cpu",
            "--seed",
            "5",
        ],
        n,
    );
    for want in ["bf16 d=32", "bf16 d=80", "fp16 d=32", "fp16 d=80"] {
        assert!(cases.iter().any(|c| c.contains(want)), "no {want}");
    }
    assert!(!cases.iter().any(|c| c.contains("f32 d=")));
}

#[test]
fn the_default_is_the_whole_matrix() {
    let n = matrix(
        &[DType::F32, DType::F16, DType::Bf16],
        &[32, 64, 80, 96, 128, 192, 256],
    )
    .len();
    passes(&[], n);
}

#[test]
fn bad_filters_are_one_line_and_exit_2() {
    let cases: [(&[&str], &str); 7] = [
        (&["check", "--threads", "0"], "--threads"),
        (&["check", "--dtype", "fp8", "--backward"], "--backward"),
        (&["check", "--dtype", "f32,int8"], "dtype"),
        (&["check", "--head-dim", "0"], "--head-dim"),
        (&["check", "--head-dim", "64,2000"], "--head-dim"),
        (&["check", "--head-dim", "-1"], "--head-dim"),
        (&["check", "--seed", "x"], "--seed"),
    ];
    for (args, name) in cases {
        let (code, out, err) = fa4(args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(out.is_empty(), "{args:?} printed to stdout: {out}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}:\n{err}");
        assert!(
            err.contains(name),
            "{args:?}: error does not name {name}: {err}"
        );
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}
