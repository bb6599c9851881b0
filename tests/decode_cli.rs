//! `fa4 run` over a paged KV cache end to end: random paged problems pass their check; runs on
//! .npy files (fixed and varlen queries) write O and LSE that pass the tolerance rule against
//! the float64 paged oracle; bad tables and lengths are one line naming the flag, exit 2.

use std::path::PathBuf;

use rand::rngs::StdRng;
use rand::SeedableRng;

use fa4::npy::{self, Data};
use fa4::paged::random::{random_paged, PagedInputs, PagedSpec};
use fa4::paged::reference;
use fa4::Options;

mod common;
use common::fa4;

struct Dir(PathBuf);

impl Dir {
    fn new(tag: &str) -> Dir {
        let d = std::env::temp_dir().join(format!("fa4-decode-cli-{}-{tag}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        Dir(d)
    }
    fn path(&self, name: &str) -> String {
        self.0.join(name).to_string_lossy().into_owned()
    }
    fn npy<T: npy::NpyElement>(&self, name: &str, shape: &[usize], data: &[T]) -> String {
        let p = self.path(name);
        npy::write(std::path::Path::new(&p), "test", shape, data).unwrap();
        p
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn one_error_line(err: &str, flag: &str) {
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.starts_with("fa4: error:") && err.contains(flag),
        "want {flag}: {err}"
    );
}

#[test]
fn random_paged_runs_pass_their_check() {
    for extra in [
        &["--page-size", "1", "--seqlen-k", "70", "--causal"][..],
        &[
            "--page-size",
            "16",
            "--seqlen-q",
            "4",
            "--heads-q",
            "8",
            "--heads-kv",
            "1",
            "--num-splits",
            "3",
        ],
        &[
            "--page-size",
            "256",
            "--batch",
            "2",
            "--window",
            "33,0",
            "--softcap",
            "20",
            "--dtype",
            "f32",
        ],
    ] {
        let mut args = vec!["run", "--paged", "--backend", "cpu", "--head-dim", "64"];
        args.extend_from_slice(extra);
        let (code, out, err) = fa4(&args);
        assert_eq!(code, 0, "{args:?}: {out}{err}");
        assert!(out.contains("check    pass"), "{out}");
        assert!(out.contains("GB/s"), "{out}");
    }
}

fn write_inputs(dir: &Dir, inputs: &PagedInputs<f32>) -> Vec<String> {
    let (nt, mp) = (inputs.seqlens_k.len(), inputs.max_pages_per_seq);
    let mut args = vec![
        "run".into(),
        "--backend".into(),
        "cpu".into(),
        "--q".into(),
        dir.npy("q.npy", &inputs.q_shape, &inputs.q),
        "--k-cache".into(),
        dir.npy("kc.npy", &inputs.k_shape, &inputs.k_cache),
        "--v-cache".into(),
        dir.npy("vc.npy", &inputs.v_shape, &inputs.v_cache),
        "--page-table".into(),
        dir.npy("pt.npy", &[nt, mp], &inputs.page_table),
        "--seqlens-k".into(),
        dir.npy("sk.npy", &[nt], &inputs.seqlens_k),
        "--out".into(),
        dir.path("o.npy"),
        "--lse".into(),
        dir.path("lse.npy"),
    ];
    if let Some(cu) = &inputs.cu_seqlens_q {
        args.push("--cu-seqlens-q".into());
        args.push(dir.npy("cu.npy", &[cu.len()], cu));
    }
    args
}

fn floats(path: &str) -> Vec<f32> {
    match npy::read(std::path::Path::new(path), "test").unwrap().data {
        Data::F32(x) => x,
        _ => panic!("float32 expected"),
    }
}

#[test]
fn runs_on_files_write_outputs_that_pass_the_oracle() {
    let mut rng = StdRng::seed_from_u64(21);
    for varlen in [false, true] {
        let spec = PagedSpec {
            seqlens_q: if varlen { vec![1, 3, 0] } else { vec![2, 2, 2] },
            seqlens_k: vec![40, 0, 17],
            heads_q: 4,
            heads_kv: 2,
            head_dim: 16,
            head_dim_v: 16,
            page_size: 8,
            varlen,
        };
        let inputs = random_paged::<f32, _>(&mut rng, &spec).unwrap();
        let dir = Dir::new(if varlen { "varlen" } else { "fixed" });
        let mut args = write_inputs(&dir, &inputs);
        args.extend(["--causal".into(), "--num-splits".into(), "2".into()]);
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, out, err) = fa4(&argv);
        assert_eq!(code, 0, "{out}{err}");
        assert!(out.contains("check    pass"), "{out}");
        let o = floats(&dir.path("o.npy"));
        let lse = floats(&dir.path("lse.npy"));
        let p = inputs.problem(&Options::new().causal()).unwrap();
        let r = reference::check(
            &p,
            &inputs.q,
            &inputs.k_cache,
            &inputs.v_cache,
            &o,
            Some(&lse),
        )
        .unwrap();
        assert!(r.passed(), "{r}");
    }
}

#[test]
fn bad_tables_lengths_and_flags_name_the_flag() {
    let mut rng = StdRng::seed_from_u64(2);
    let spec = PagedSpec {
        seqlens_q: vec![1, 1],
        seqlens_k: vec![9, 4],
        heads_q: 2,
        heads_kv: 2,
        head_dim: 8,
        head_dim_v: 8,
        page_size: 4,
        varlen: false,
    };
    let good = random_paged::<f32, _>(&mut rng, &spec).unwrap();
    let dir = Dir::new("bad");
    let run = |inputs: &PagedInputs<f32>, extra: &[&str]| {
        let mut args = write_inputs(&dir, inputs);
        args.extend(extra.iter().map(|s| s.to_string()));
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        fa4(&argv)
    };
    let (code, out, err) = run(&good, &[]);
    assert_eq!(code, 0, "{out}{err}");

    let mut bad = good.clone();
    bad.page_table[0] = bad.k_shape[0] as i32;
    let (code, _, err) = run(&bad, &[]);
    assert_eq!(code, 2);
    one_error_line(&err, "--page-table");

    let mut bad = good.clone();
    bad.seqlens_k[1] = -3;
    let (code, _, err) = run(&bad, &[]);
    assert_eq!(code, 2);
    one_error_line(&err, "--seqlens-k");

    let mut bad = good.clone();
    bad.seqlens_k[0] = (bad.max_pages_per_seq * 4 + 1) as i32;
    let (code, _, err) = run(&bad, &[]);
    assert_eq!(code, 2);
    one_error_line(&err, "--seqlens-k");

    let (code, _, err) = run(&good, &["--num-splits", "500"]);
    assert_eq!(code, 2);
    one_error_line(&err, "--num-splits");

    let (code, _, err) = run(&good, &["--page-size", "4"]);
    assert_eq!(code, 2);
    one_error_line(&err, "--page-size");

    let (code, _, err) = run(&good, &["--paged"]);
    assert_eq!(code, 2);
    one_error_line(&err, "--paged");

    // A missing piece of the paged inputs is named.
    let (code, _, err) = fa4(&["run", "--backend", "cpu", "--k-cache", &dir.path("kc.npy")]);
    assert_eq!(code, 2);
    one_error_line(&err, "--q");
}

#[test]
fn plan_and_bench_decode_explain_and_validate() {
    let (code, out, err) = fa4(&[
        "plan",
        "--decode",
        "--batch",
        "1",
        "--seqlen-k",
        "32768",
        "--heads-q",
        "32",
        "--heads-kv",
        "8",
        "--depth",
        "128",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("wave efficiency") && out.contains("num_splits 14"),
        "{out}"
    );
    let (code, out, _) = fa4(&[
        "plan",
        "--decode",
        "--batch",
        "32",
        "--seqlen-k",
        "4096",
        "--depth",
        "128",
    ]);
    assert_eq!(code, 0);
    assert!(out.contains("num_splits 1:"), "{out}");
    for (args, flag) in [
        (&["plan", "--decode", "--depth", "128"][..], "--seqlen-k"),
        (
            &[
                "plan",
                "--decode",
                "--seqlen-k",
                "9",
                "--depth",
                "64",
                "--num-splits",
                "0",
            ],
            "--num-splits",
        ),
        (
            &[
                "plan",
                "--decode",
                "--seqlen-k",
                "9",
                "--depth",
                "64",
                "--heads-kv",
                "5",
            ],
            "--heads-kv",
        ),
        (&["plan", "--depth", "64", "--batch", "2"], "--batch"),
        // A random paged problem too large to hold names the length that made it so.
        (
            &[
                "run",
                "--backend",
                "cpu",
                "--paged",
                "--seqlen-q",
                "100000000",
            ],
            "--seqlen-q",
        ),
        (
            &[
                "run",
                "--backend",
                "cpu",
                "--paged",
                "--seqlen-k",
                "100000000000",
            ],
            "--seqlen-k",
        ),
        (&["bench", "--page-size", "4"], "--page-size"),
        (
            &["bench", "--decode", "--decode-shapes", "8"],
            "--decode-shapes",
        ),
    ] {
        let (code, _, err) = fa4(args);
        assert_eq!(code, 2, "{args:?}");
        one_error_line(&err, flag);
    }
    let (code, out, err) = fa4(&[
        "bench",
        "--decode",
        "--decode-shapes",
        "2:300",
        "--page-size",
        "7",
        "--reps",
        "1",
        "--head-dim",
        "32",
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let rows: serde_json::Value = serde_json::from_str(&out).unwrap();
    let diff = rows[0]["max_abs_diff"].as_f64().unwrap();
    assert!(diff < 1e-4, "paged and contiguous disagree by {diff}");
    assert!(rows[0]["fa4_gbps"].as_f64().unwrap() > 0.0);
}

/// Zero query rows per sequence is a valid (empty) paged problem, as it is for the forward: it
/// runs and its (empty) check passes, rather than being refused for overlapping strides.
#[test]
fn zero_query_rows_are_an_empty_problem() {
    for extra in [&[][..], &["--causal"][..]] {
        let mut args = vec!["run", "--backend", "cpu", "--paged", "--seqlen-q", "0"];
        args.extend_from_slice(extra);
        let (code, out, err) = fa4(&args);
        assert_eq!(code, 0, "{args:?}\n{out}{err}");
        assert!(out.contains("check    pass"), "{out}");
    }
}

/// `fa4 bench --decode` refuses the prefill grid's flags instead of ignoring them.
#[test]
fn bench_decode_refuses_prefill_grid_flags() {
    for (args, flag) in [
        (&["bench", "--decode", "--batch", "4"][..], "--batch"),
        (&["bench", "--decode", "--seqlens", "1024"], "--seqlens"),
        (&["bench", "--decode", "--head-dims", "128"], "--head-dims"),
        (&["bench", "--decode", "--heads", "8"], "--heads"),
        (&["bench", "--decode", "--causal", "on"], "--causal"),
    ] {
        let (code, _, err) = fa4(args);
        assert_eq!(code, 2, "{args:?}: {err}");
        one_error_line(&err, flag);
    }
}

/// A malformed `FA4_DECODE_VARIANT` is an error naming it (exit 2) on every backend: with
/// `--backend auto` on a GPU machine it once made the run fall back to the CPU silently.
#[test]
fn a_bad_decode_variant_is_an_error_on_every_backend() {
    for backend in ["cpu", "auto"] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_fa4"))
            .args(["run", "--paged", "--backend", backend, "--head-dim", "64"])
            .env("FA4_DECODE_VARIANT", "heads+fast")
            .output()
            .expect("the fa4 binary runs");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{backend}: {err}");
        let last = err.lines().last().unwrap_or("");
        assert!(
            last.starts_with("fa4: error:")
                && last.contains("FA4_DECODE_VARIANT")
                && last.contains("fast"),
            "{backend}: {err}"
        );
        // The auto backend's one note line comes before it, nothing else.
        assert!(err.lines().count() <= 2, "{err}");
    }
    // `auto` and `plain` are accepted names.
    for v in ["auto", "plain", ""] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_fa4"))
            .args(["run", "--paged", "--backend", "cpu", "--head-dim", "64"])
            .env("FA4_DECODE_VARIANT", v)
            .output()
            .expect("the fa4 binary runs");
        assert_eq!(
            out.status.code(),
            Some(0),
            "`{v}`: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// `fa4 plan --decode` says what a GPU call runs with the default variant (`auto`), per GPU:
/// on the H200 the all-heads kernel with bulk copies for 8 sequences, the split kernel for one;
/// on the A100 the split kernel with the planner's count (`auto (plain)`); a head dim the
/// kernels do not take is said, not an error.
#[test]
fn plan_decode_names_the_kernel_auto_runs() {
    let line = |out: &str, gpu: &str| -> String {
        out.lines()
            .find(|l| l.trim_start().starts_with(gpu))
            .unwrap_or_else(|| panic!("no {gpu} line: {out}"))
            .to_string()
    };
    let (code, out, err) = fa4(&[
        "plan",
        "--decode",
        "--depth",
        "128",
        "--batch",
        "8",
        "--seqlen-k",
        "8192",
    ]);
    assert_eq!(code, 0, "{err}");
    let h200 = line(&out, "H200");
    assert!(
        h200.contains("auto (heads+bulk+best)") && h200.contains("decode heads sm_90a"),
        "{h200}"
    );
    // 8 sequences × 1 group of 8 KV heads: 8 CTAs a split; the best single wave is 16 splits.
    assert!(h200.contains("16 splits, grid 8x1x16"), "{h200}");
    let a100 = line(&out, "A100");
    assert!(
        a100.contains("auto (plain)") && a100.contains("decode splitkv sm_80"),
        "{a100}"
    );

    let (code, out, _) = fa4(&[
        "plan",
        "--decode",
        "--depth",
        "128",
        "--batch",
        "1",
        "--seqlen-k",
        "32768",
    ]);
    assert_eq!(code, 0);
    let h200 = line(&out, "H200");
    assert!(
        h200.contains("auto (best)") && h200.contains("decode splitkv sm_90a"),
        "{h200}"
    );

    // Over pages of 256 keys `auto` keeps the split kernel at 8 sequences too; a page size of
    // 0 is refused, and --page-size needs --decode.
    let (code, out, err) = fa4(&[
        "plan",
        "--decode",
        "--depth",
        "128",
        "--batch",
        "8",
        "--seqlen-k",
        "8192",
        "--page-size",
        "256",
    ]);
    assert_eq!(code, 0, "{err}");
    let h200 = line(&out, "H200");
    assert!(
        h200.contains("pages of 256 keys")
            && h200.contains("auto (best)")
            && h200.contains("decode splitkv sm_90a"),
        "{h200}"
    );
    let (code, _, err) = fa4(&[
        "plan",
        "--decode",
        "--depth",
        "128",
        "--seqlen-k",
        "64",
        "--page-size",
        "0",
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("--page-size"), "{err}");
    let (code, _, err) = fa4(&["plan", "--depth", "128", "--page-size", "64"]);
    assert_eq!(code, 2);
    assert!(err.contains("--page-size"), "{err}");

    let (code, out, _) = fa4(&["plan", "--decode", "--depth", "96", "--seqlen-k", "100"]);
    assert_eq!(code, 0);
    assert!(
        line(&out, "H200").contains("no GPU plan for this shape"),
        "{out}"
    );
}

/// `fa4 plan --decode` plans `FA4_DECODE_VARIANT` when set: `fuse` shows in the variant and the
/// kernel's name, and no combine launch follows; without it the split kernel's line says
/// `+ combine`.
#[test]
fn plan_decode_shows_the_fused_combine() {
    let run = |variant: &str| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_fa4"))
            .args([
                "plan",
                "--decode",
                "--depth",
                "128",
                "--batch",
                "8",
                "--seqlen-k",
                "8192",
            ])
            .env("FA4_DECODE_VARIANT", variant)
            .output()
            .expect("the fa4 binary runs");
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        assert_eq!(
            out.status.code(),
            Some(0),
            "{variant}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        text.lines()
            .find(|l| l.trim_start().starts_with("H200"))
            .unwrap_or_else(|| panic!("no H200 line: {text}"))
            .to_string()
    };
    let fused = run("heads+bulk+best+fuse");
    assert!(
        fused.contains("FA4_DECODE_VARIANT=heads+bulk+best+fuse")
            && fused.contains("bulk fuse, 16 splits")
            && !fused.contains("combine"),
        "{fused}"
    );
    let split = run("best");
    assert!(split.contains("+ combine"), "{split}");
    let fused = run("best+fuse");
    assert!(
        fused.contains("FA4_DECODE_VARIANT=best+fuse") && fused.contains(" fuse, "),
        "{fused}"
    );
}
