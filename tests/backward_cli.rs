//! The backward on the command line: `fa4 run --backward`, `fa4 run … --do --dq --dk --dv` on
//! .npy files (gradients read back and judged by the gradient rule), `fa4 check --backward`,
//! `fa4 bench --backward`, and bad input as one line naming the flag with exit code 2.

use std::path::PathBuf;

use rand::rngs::StdRng;
use rand::SeedableRng;

use fa4::check::grad::{check_grads, GradsView};
use fa4::check::random_fill;
use fa4::npy::{self, Data};
use fa4::tensor::Layout;
use fa4::{DType, Options, Problem};

mod common;
use common::fa4;

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let dir =
            std::env::temp_dir().join(format!("fa4-backward-cli-{}-{tag}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        TempDir(dir)
    }

    fn path(&self, name: &str) -> String {
        self.0.join(name).to_string_lossy().into_owned()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn read_f32(path: &str, shape: &[usize]) -> Vec<f32> {
    let a = npy::read(std::path::Path::new(path), "test").expect("read .npy");
    assert_eq!(a.shape, shape, "{path}");
    match a.data {
        Data::F32(x) => x,
        other => panic!("{path}: expected float32, got {other:?}"),
    }
}

fn one_error_line(stderr: &str, flag: &str) {
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(lines[0].contains(&format!("`{flag}`")), "{stderr}");
}

/// `--deterministic` asks for the deterministic backward: with `--backward` it runs and passes
/// the check (on the CPU, always deterministic); without a backward it is an error naming it.
#[test]
fn run_deterministic_needs_a_backward_and_passes_its_check() {
    let shape = [
        "--head-dim",
        "64",
        "--seqlen-q",
        "70",
        "--seqlen-k",
        "90",
        "--heads-q",
        "2",
    ];
    let mut args = vec!["run", "--deterministic"];
    args.extend_from_slice(&shape);
    let (rc, _, err) = fa4(&args);
    assert_eq!(rc, 2);
    one_error_line(&err, "--deterministic");
    let mut args = vec!["run", "--backward", "--deterministic", "--causal"];
    args.extend_from_slice(&shape);
    let (rc, out, err) = fa4(&args);
    assert_eq!(rc, 0, "{out}{err}");
    assert!(out.contains("grads    pass"), "{out}");
}

/// A backward the GPU kernels refuse (V wider than Q; narrower while the default leaves it to
/// an explicit choice) is one line naming `--head-dim-v` before the forward runs or prints, on
/// the CPU it runs; where no GPU works the line names `--backend`.
#[test]
fn run_backward_refusals_come_before_the_forward() {
    let shape = |dv: &'static str, backend: &'static str| {
        vec![
            "run",
            "--backward",
            "--backend",
            backend,
            "--dtype",
            "bf16",
            "--seqlen-q",
            "40",
            "--heads-q",
            "2",
            "--head-dim",
            "64",
            "--head-dim-v",
            dv,
        ]
    };
    let (rc, out, err) = fa4(&shape("128", "cpu"));
    assert_eq!(rc, 0, "{out}{err}");
    assert!(out.contains("grads    pass"), "{out}");
    // V wider than Q: no CUDA backward takes it.
    let gpu = fa4::Backend::cuda(0).is_ok();
    let (rc, out, err) = fa4(&shape("128", "cuda"));
    assert_eq!(rc, 2, "{out}{err}");
    assert!(out.is_empty(), "{out}");
    one_error_line(&err, if gpu { "--head-dim-v" } else { "--backend" });
}

#[test]
fn run_backward_on_a_random_problem_passes_its_check() {
    let (rc, out, err) = fa4(&[
        "run",
        "--backward",
        "--seqlen-q",
        "130",
        "--seqlen-k",
        "97",
        "--heads-q",
        "4",
        "--heads-kv",
        "1",
        "--head-dim",
        "48",
        "--causal",
        "--softcap",
        "10",
        "--backend",
        "cpu",
    ]);
    assert_eq!(rc, 0, "{out}{err}");
    assert!(
        out.contains("backward ") && out.contains("GFLOP/s"),
        "{out}"
    );
    assert!(out.contains("grads    pass: dQ"), "{out}");
}

#[test]
fn run_on_files_writes_gradients_that_pass_the_rule() {
    let dir = TempDir::new("files");
    // Varlen, with a zero-length query sequence and a zero-length key sequence; GQA 4/2;
    // head_dim_v ≠ head_dim.
    let (tq, tk, hq, hkv, d, dv) = (60, 75, 4, 2, 24, 16);
    let (cq, ck) = (vec![0i32, 0, 40, 60], vec![0i32, 10, 75, 75]);
    let mut rng = StdRng::seed_from_u64(17);
    let mut draw = |n: usize, row: usize| {
        let mut x = vec![0f32; n];
        random_fill(&mut rng, &mut x, row, 2.0);
        x
    };
    let (q, k, v, d_out) = (
        draw(tq * hq * d, d),
        draw(tk * hkv * d, d),
        draw(tk * hkv * dv, dv),
        draw(tq * hq * dv, dv),
    );
    let shapes = [
        ("q.npy", vec![tq, hq, d], &q),
        ("k.npy", vec![tk, hkv, d], &k),
        ("v.npy", vec![tk, hkv, dv], &v),
        ("do.npy", vec![tq, hq, dv], &d_out),
    ];
    for (name, shape, data) in &shapes {
        npy::write(std::path::Path::new(&dir.path(name)), "t", shape, data).unwrap();
    }
    npy::write(std::path::Path::new(&dir.path("cq.npy")), "t", &[4], &cq).unwrap();
    npy::write(std::path::Path::new(&dir.path("ck.npy")), "t", &[4], &ck).unwrap();
    let p = |n: &str| dir.path(n);
    let args = [
        "run",
        "--q",
        &p("q.npy"),
        "--k",
        &p("k.npy"),
        "--v",
        &p("v.npy"),
        "--cu-seqlens-q",
        &p("cq.npy"),
        "--cu-seqlens-k",
        &p("ck.npy"),
        "--out",
        &p("o.npy"),
        "--do",
        &p("do.npy"),
        "--dq",
        &p("dq.npy"),
        "--dk",
        &p("dk.npy"),
        "--dv",
        &p("dv.npy"),
        "--window",
        "30,2",
        "--backend",
        "cpu",
    ];
    let (rc, out, err) = fa4(&args);
    assert_eq!(rc, 0, "{out}{err}");
    assert!(out.contains("grads    pass"), "{out}");
    let dq = read_f32(&p("dq.npy"), &[tq, hq, d]);
    let dk = read_f32(&p("dk.npy"), &[tk, hkv, d]);
    let dvv = read_f32(&p("dv.npy"), &[tk, hkv, dv]);
    // Judge what was written, independently of the CLI's own check.
    let l = |s: &[usize]| Layout::new("t", s, None).unwrap();
    let (ql, kl, vl, ol) = (
        l(&[tq, hq, d]),
        l(&[tk, hkv, d]),
        l(&[tk, hkv, dv]),
        l(&[tq, hq, dv]),
    );
    let opts = Options::new().window(Some(30), Some(2));
    let prob = Problem::new(DType::F32, &ql, &kl, &vl, &ol, Some(&cq), Some(&ck), &opts).unwrap();
    let got = GradsView {
        dq: (&dq, &ql),
        dk: (&dk, &kl),
        dv: (&dvv, &vl),
    };
    // O as written (the forward's output, the backward's input).
    let o = read_f32(&p("o.npy"), &[tq, hq, dv]);
    let r = check_grads(&prob, &q, &k, &v, &o, &d_out, &ol, got);
    assert!(r.passed(), "{r}");
    // Keys of the sequence without queries get zero gradients.
    assert!(dk[..10 * hkv * d].iter().all(|&x| x == 0.0));
    assert!(dq.iter().any(|&x| x.abs() > 1e-3));

    // dO of the wrong shape, --dq without --do, --backward on files without --do.
    let mut bad = args.to_vec();
    bad[14] = args[2]; // --do Q.npy: Q's head_dim is not O's
    let (rc, _, err) = fa4(&bad);
    assert_eq!(rc, 2);
    one_error_line(&err, "--do");
    let (rc, _, err) = fa4(&[
        "run",
        "--q",
        &p("q.npy"),
        "--k",
        &p("k.npy"),
        "--v",
        &p("v.npy"),
        "--cu-seqlens-q",
        &p("cq.npy"),
        "--cu-seqlens-k",
        &p("ck.npy"),
        "--out",
        &p("o.npy"),
        "--dq",
        &p("x.npy"),
    ]);
    assert_eq!(rc, 2);
    one_error_line(&err, "--dq");
    let (rc, _, err) = fa4(&[
        "run",
        "--q",
        &p("q.npy"),
        "--k",
        &p("k.npy"),
        "--v",
        &p("v.npy"),
        "--cu-seqlens-q",
        &p("cq.npy"),
        "--cu-seqlens-k",
        &p("ck.npy"),
        "--out",
        &p("o.npy"),
        "--backward",
    ]);
    assert_eq!(rc, 2);
    one_error_line(&err, "--backward");
}

#[test]
fn random_runs_reject_file_gradient_flags() {
    let (rc, _, err) = fa4(&["run", "--seqlen-q", "16", "--do", "x.npy"]);
    assert_eq!(rc, 2);
    one_error_line(&err, "--do");
}

#[test]
fn check_backward_runs_the_gradient_matrix() {
    let (rc, out, err) = fa4(&[
        "check",
        "--backward",
        "--backend",
        "cpu",
        "--dtype",
        "bf16",
        "--head-dim",
        "16",
    ]);
    assert_eq!(rc, 0, "{out}{err}");
    assert!(out.contains("gradients of 15 cases"), "{out}");
    assert!(out.contains("15 passed, 0 failed"), "{out}");
}

#[test]
fn bench_backward_reports_gflops_beside_the_forward() {
    let (rc, out, err) = fa4(&[
        "bench",
        "--backward",
        "--seqlens",
        "128",
        "--head-dims",
        "32",
        "--reps",
        "1",
        "--warmup",
        "0",
        "--json",
    ]);
    assert_eq!(rc, 0, "{out}{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON object");
    assert_eq!(v["pass"], "backward");
    let rows = v["results"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    for r in rows {
        assert!(r["backward_gflops"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["forward_gflops"].as_f64().unwrap() > 0.0, "{r}");
    }
}

/// The gradient files obey `fa4 run`'s output rules: none may name an input (`--do` included)
/// or another output, and O, LSE, dQ, dK and dV are written all together or not at all.
#[test]
fn gradient_outputs_are_distinct_and_written_together() {
    let dir = TempDir::new("outputs");
    let (s, h, d) = (9, 2, 8);
    let mut rng = StdRng::seed_from_u64(5);
    for name in ["q.npy", "k.npy", "v.npy", "do.npy"] {
        let mut x = vec![0f32; s * h * d];
        random_fill(&mut rng, &mut x, d, 1.0);
        npy::write(
            std::path::Path::new(&dir.path(name)),
            "t",
            &[1, s, h, d],
            &x,
        )
        .unwrap();
    }
    let p = |n: &str| dir.path(n);
    let run = |dq: &str, dk: &str, dv: &str| {
        fa4(&[
            "run",
            "--q",
            &p("q.npy"),
            "--k",
            &p("k.npy"),
            "--v",
            &p("v.npy"),
            "--out",
            &p("o.npy"),
            "--lse",
            &p("lse.npy"),
            "--do",
            &p("do.npy"),
            "--dq",
            dq,
            "--dk",
            dk,
            "--dv",
            dv,
            "--backend",
            "cpu",
        ])
    };
    let before = std::fs::read(p("do.npy")).unwrap();
    // --dq over the output O, --dk over the input dO, --dv over --dq.
    for ((dq, dk, dv), flag) in [
        ((p("o.npy"), p("dk.npy"), p("dv.npy")), "--dq"),
        ((p("dq.npy"), p("do.npy"), p("dv.npy")), "--dk"),
        ((p("dq.npy"), p("dk.npy"), p("dq.npy")), "--dv"),
    ] {
        let (rc, out, err) = run(&dq, &dk, &dv);
        assert_eq!(rc, 2, "{out}{err}");
        one_error_line(&err, flag);
        assert!(
            err.contains("every output needs a file of its own"),
            "{err}"
        );
    }
    assert_eq!(std::fs::read(p("do.npy")).unwrap(), before);
    // dV cannot be written (no such directory): nothing is, not even O.
    let (rc, out, err) = run(&p("dq.npy"), &p("dk.npy"), &p("missing/dv.npy"));
    assert_eq!(rc, 2, "{out}{err}");
    one_error_line(&err, "--dv");
    let left: Vec<_> = std::fs::read_dir(&dir.0)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| !["q.npy", "k.npy", "v.npy", "do.npy"].contains(&n.as_str()))
        .collect();
    assert!(left.is_empty(), "written or left behind: {left:?}");
    // All five, when all can be written.
    let (rc, out, err) = run(&p("dq.npy"), &p("dk.npy"), &p("dv.npy"));
    assert_eq!(rc, 0, "{out}{err}");
    for (name, shape) in [
        ("o.npy", vec![1, s, h, d]),
        ("dq.npy", vec![1, s, h, d]),
        ("dk.npy", vec![1, s, h, d]),
        ("dv.npy", vec![1, s, h, d]),
        ("lse.npy", vec![1, h, s]),
    ] {
        read_f32(&p(name), &shape);
    }
}

#[test]
fn paged_runs_reject_backward_flags() {
    let (rc, out, err) = fa4(&["run", "--paged", "--backward", "--backend", "cpu"]);
    assert_eq!(rc, 2, "{out}{err}");
    one_error_line(&err, "--backward");
}

/// A bench shape that cannot be held is refused before allocating, naming the flag (it aborted
/// on a 200 GB allocation).
#[test]
fn bench_backward_sizes_its_shapes_first() {
    let (code, out, err) = fa4(&[
        "bench",
        "--backward",
        "--backend",
        "cpu",
        "--batch",
        "1000000000",
        "--seqlens",
        "512",
        "--head-dims",
        "64",
    ]);
    assert_eq!(code, 2, "{out}{err}");
    one_error_line(&err, "--seqlens");
}

/// Issue 30: `fa4 bench --backward` ignored `--grid`; on CUDA it now times the shapes `--grid`
/// names (`D,SEQLEN,CAUSAL[,BATCH,HEADS[,KV_HEADS]]`), as the forward bench does. Where no GPU
/// works the run is one line naming `--backend`, after the grid was parsed (a bad shape names
/// `--grid` first; on a GPU so does a shape its backward cannot plan, before the table).
#[test]
fn bench_backward_on_cuda_times_the_grid_it_is_given() {
    // `fa4 bench --backward --backend cuda --dtype bf16` with `rest` (the grid first).
    let bench = |rest: &[&str]| {
        let mut args = vec![
            "bench",
            "--backward",
            "--backend",
            "cuda",
            "--dtype",
            "bf16",
        ];
        args.extend_from_slice(rest);
        fa4(&args)
    };
    let (code, out, err) = bench(&["--grid", "64,100,0"]);
    assert_eq!(code, 2, "{out}{err}");
    one_error_line(&err, "--grid");
    let (code, out, err) = bench(&[
        "--grid",
        "64,256,1,2,4,2",
        "128,512,0,1,2",
        "--reps",
        "1",
        "--warmup",
        "0",
        "--calls",
        "1",
        "--json",
    ]);
    if fa4::Backend::cuda(0).is_err() {
        assert_eq!(code, 2, "{out}{err}");
        one_error_line(&err, "--backend");
        return;
    }
    assert_eq!(code, 0, "{out}{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON object");
    assert_eq!(v["pass"], "backward");
    let rows = v["results"].as_array().expect("results");
    let shape = |r: &serde_json::Value| {
        [
            "head_dim", "seqlen", "causal", "batch", "heads", "kv_heads", "calls",
        ]
        .map(|k| r[k].to_string())
        .join(",")
    };
    let got: Vec<String> = rows.iter().map(shape).collect();
    assert_eq!(
        got,
        ["64,256,true,2,4,2,1", "128,512,false,1,2,2,1"],
        "{out}"
    );
    for r in rows {
        assert!(r["tflops"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["deterministic_tflops"].as_f64().unwrap() > 0.0, "{r}");
        assert_eq!(r["head_dim_v"], r["head_dim"], "{r}");
    }
    // A shape the backward cannot plan (V wider than Q) is one line naming --grid before the
    // table, whatever the GPU.
    let (code, out, err) = bench(&["--grid", "64/128,256,0,1,2", "--reps", "1", "--calls", "1"]);
    assert_eq!(code, 2, "{out}{err}");
    assert!(out.is_empty(), "{out}");
    one_error_line(&err, "--grid");
}
