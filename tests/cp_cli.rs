//! `fa4 run --cp N` and `fa4 bench --cp N` on the CPU (simulated ranks): the result passes the
//! oracle and matches one call; bad `--cp` input is one line naming the flag, exit code 2.

mod common;
use common::fa4;

/// The `max|O_cp − O_one call|` the run printed.
fn diff_to_one_call(stdout: &str) -> f64 {
    let line = stdout
        .lines()
        .find(|l| l.contains("max|O_cp − O_one call|"))
        .unwrap_or_else(|| panic!("no comparison line in:\n{stdout}"));
    line.split("max|O_cp − O_one call| ")
        .nth(1)
        .and_then(|s| s.split(',').next())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or_else(|| panic!("unparsable: {line}"))
}

#[test]
fn run_cp_passes_the_oracle_and_matches_one_call() {
    for args in [
        &[
            "--cp",
            "2",
            "--causal",
            "--seqlen-q",
            "200",
            "--heads-q",
            "4",
        ][..],
        &[
            "--cp",
            "3",
            "--seqlen-q",
            "77",
            "--heads-q",
            "4",
            "--heads-kv",
            "1",
            "--dtype",
            "f32",
        ],
        &[
            "--cp",
            "4",
            "--causal",
            "--cp-split",
            "contiguous",
            "--seqlen-q",
            "64",
            "--heads-q",
            "2",
            "--dtype",
            "fp16",
            "--batch",
            "2",
        ],
    ] {
        let mut all = vec!["run", "--backend", "cpu", "--head-dim", "64"];
        all.extend_from_slice(args);
        let (code, out, err) = fa4(&all);
        assert_eq!(code, 0, "{all:?}\n{out}\n{err}");
        assert!(out.contains("check    pass"), "{out}");
        assert!(out.contains("simulated ranks"), "{out}");
        let f32_run = args.contains(&"f32");
        let d = diff_to_one_call(&out);
        assert!(d <= if f32_run { 1e-5 } else { 1e-2 }, "{args:?}: {d}");
    }
}

#[test]
fn bad_cp_input_names_the_flag() {
    for (args, flag) in [
        (&["run", "--cp", "0"][..], "--cp"),
        (&["run", "--cp", "100000"], "--cp"),
        (&["bench", "--cp", "257"], "--cp"),
        (&["run", "--cp", "-1"], "--cp"),
        (&["run", "--cp", "2", "--window", "4,0"], "--window"),
        (&["run", "--cp", "2", "--cp-split", "ring"], "--cp-split"),
        (&["bench", "--cp", "0"], "--cp"),
        // The ring has no backward, no paged form and no decode bench.
        (&["run", "--cp", "2", "--backward"], "--backward"),
        (&["run", "--cp", "2", "--paged"], "--cp"),
        (&["bench", "--cp", "2", "--decode"], "--decode"),
        (&["bench", "--cp", "2", "--backward"], "--backward"),
        (&["bench", "--cp", "2", "--threads", "0"], "--threads"),
    ] {
        let (code, out, err) = fa4(args);
        assert_eq!(code, 2, "{args:?}\n{out}\n{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(err.contains(flag), "{args:?}: {err}");
    }
}

#[test]
fn bench_cp_reports_scaling_and_per_step_times() {
    let (code, out, err) = fa4(&[
        "bench",
        "--cp",
        "2",
        "--seqlens",
        "256",
        "--head-dims",
        "32",
        "--causal",
        "on",
        "--reps",
        "2",
        "--warmup",
        "0",
        "--json",
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    let rows: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    let row = &rows[0];
    assert_eq!(row["ranks"], 2);
    assert_eq!(row["step_compute_ms"].as_array().unwrap().len(), 2);
    assert!(row["scaling"].as_f64().unwrap() > 0.0);
}
