//! Inputs that used to crash `fa4`, lose data or confuse: each is a regression test (issue 12).
//! Sizes nothing can hold, a closed stdout, an oracle too big for the memory limit, an empty
//! batch, outputs naming one file, errors naming the flag typed, `--backend auto`'s account of
//! its choice, progress on long work, `--threads`, and the Hopper plan's refusals. They pass with
//! or without a GPU.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};

use fa4::npy;

mod common;
use common::fa4;

/// Asserts exit code 2 and one stderr line holding every needle.
fn one_line_error(args: &[&str], needles: &[&str]) {
    let (code, out, err) = fa4(args);
    assert_eq!(code, 2, "{args:?}: {err}\n{out}");
    assert!(out.is_empty(), "{args:?} printed to stdout: {out}");
    // `--backend auto` may say what it chose first; the error is the last line.
    let lines: Vec<&str> = err
        .lines()
        .filter(|l| !l.starts_with("fa4: --backend auto"))
        .collect();
    assert_eq!(lines.len(), 1, "{args:?}: not one line:\n{err}");
    assert!(lines[0].starts_with("fa4: error: "), "{args:?}: {err}");
    for n in needles {
        assert!(lines[0].contains(n), "{args:?}: error lacks {n:?}: {err}");
    }
}

struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "fa4-cli-robust-{}-{tag}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        TempDir(dir)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    fn npy(&self, name: &str, shape: &[usize]) -> String {
        let p = self.path(name);
        let n: usize = shape.iter().product();
        let data: Vec<f32> = (0..n).map(|i| ((i * 7) % 11) as f32 * 0.1 - 0.5).collect();
        npy::write(&p, "test", shape, &data).expect("write .npy");
        s(&p)
    }

    fn files(&self) -> Vec<String> {
        std::fs::read_dir(&self.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn argv(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

fn s(p: &Path) -> String {
    p.to_str().expect("utf-8 temp path").to_string()
}

#[test]
fn sizes_nothing_can_hold_are_refused_before_allocating() {
    // 52 GB aborted in the allocator (exit 134) building the per-sequence list on a 24 GB
    // machine; 52 TB is past any machine's memory (a 128 GB one ran 52 GB).
    one_line_error(
        &[
            "run",
            "--backend",
            "cpu",
            "--batch",
            "1000000000000",
            "--seqlen-q",
            "1",
            "--heads-q",
            "1",
            "--head-dim",
            "1",
        ],
        &["`--batch`", "bytes"],
    );
    // 2⁶²: a `capacity overflow` panic (exit 101).
    one_line_error(
        &[
            "run",
            "--backend",
            "cpu",
            "--batch",
            "4611686018427387904",
            "--seqlen-q",
            "1",
            "--heads-q",
            "1",
            "--head-dim",
            "1",
        ],
        &["`--batch`", "bytes"],
    );
    one_line_error(
        &[
            "run",
            "--backend",
            "cpu",
            "--seqlen-q",
            "18446744073709551615",
            "--head-dim",
            "1024",
        ],
        &["`--seqlen-q`", "bytes"],
    );
}

/// `fa4 … | head -1`: a closed stdout ends the program quietly (killed by SIGPIPE, as `cat` is,
/// or exit 0), never a `failed printing to stdout` panic (exit 101).
#[cfg(unix)]
#[test]
fn a_closed_stdout_ends_quietly() {
    use std::os::unix::process::ExitStatusExt;
    for args in [
        &[
            "run",
            "--backend",
            "cpu",
            "--seqlen-q",
            "8",
            "--heads-q",
            "1",
            "--head-dim",
            "8",
        ][..],
        &[
            "check",
            "--backend",
            "cpu",
            "--dtype",
            "f32",
            "--head-dim",
            "32",
        ][..],
        &[
            "bench",
            "--seqlens",
            "32",
            "--head-dims",
            "16",
            "--causal",
            "off",
            "--reps",
            "1",
            "--no-materialized",
        ][..],
        &["plan", "--depth", "64"][..],
    ] {
        // The read end is closed before the child starts, so its first write fails.
        let (reader, writer) = std::io::pipe().expect("a pipe");
        drop(reader);
        let out = Command::new(env!("CARGO_BIN_EXE_fa4"))
            .args(args)
            .stdout(writer)
            .stderr(Stdio::piped())
            .output()
            .expect("the fa4 binary runs");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        let quiet = out.status.signal() == Some(libc_sigpipe()) || out.status.code() == Some(0);
        assert!(quiet, "{args:?}: {:?}: {err}", out.status);
    }
}

#[cfg(unix)]
fn libc_sigpipe() -> i32 {
    // SIGPIPE is 13 on every Unix fa4 builds for (Linux, the BSDs, macOS).
    13
}

/// The float64 oracle sizes its memory before it runs: under a 1.5 GB address-space limit a
/// problem whose oracle needs 2.4 GB is computed and its check skipped with the bytes asked (it
/// aborted inside the oracle); with `--check` it is an error naming `--check`.
#[cfg(target_os = "linux")]
#[test]
fn the_oracle_is_skipped_when_its_memory_cannot_be_had() {
    let run = |extra: &str| {
        let cmd = format!(
            "ulimit -v 1500000 && exec '{}' run --backend cpu --seqlen-q 200000 --seqlen-k 1 \
             --heads-q 4 --head-dim 128 {extra}",
            env!("CARGO_BIN_EXE_fa4")
        );
        let out = Command::new("sh")
            .args(["-c", &cmd])
            .output()
            .expect("sh runs");
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, out, err) = run("");
    assert_eq!(code, 0, "{err}\n{out}");
    assert!(
        out.contains("check    skipped: the float64 oracle needs") && out.contains("bytes"),
        "{out}"
    );
    let (code, out, err) = run("--check");
    assert_eq!(code, 2, "{err}\n{out}");
    assert!(err.contains("`--check`") && err.contains("bytes"), "{err}");
}

/// `fa4 bench` sizes every shape before it measures or prints anything.
#[test]
fn bench_refuses_shapes_before_printing() {
    for args in [
        &["bench", "--seqlens", "100000", "--heads", "100000000"][..],
        &["bench", "--seqlens", "64,18446744073709551615"][..],
    ] {
        one_line_error(args, &["`--seqlens`"]);
    }
}

/// Issue 30: `fa4 bench --backward` ignored `--grid` without a word. Every pass of `fa4 bench`
/// (the forward, `--backward`, `--decode`, `--cp`; on the CPU and `--backend cuda`) refuses, by
/// name and before any work, each flag it would not read, even given at its default value
/// (`--batch 1` on the CUDA forward, whose shapes come from `--grid`). The CUDA passes refuse
/// before opening a device, so this runs without a GPU.
#[test]
fn bench_refuses_flags_its_pass_would_ignore() {
    let g = "128,1024,0";
    let cases: &[(&[&str], &str)] = &[
        // The CPU forward.
        (&["bench", "--grid", g], "--grid"),
        (&["bench", "--tokens", "8192"], "--tokens"),
        (&["bench", "--calls", "3"], "--calls"),
        (&["bench", "--kernel", "sm80"], "--kernel"),
        (&["bench", "--device", "0"], "--device"),
        (&["bench", "--cp-split", "contiguous"], "--cp-split"),
        // Varlen batches are timed on CUDA only; bad lengths are named before a device opens.
        (&["bench", "--lengths", "300,513"], "--lengths"),
        (&["bench", "--backward", "--varlen", "1"], "--varlen"),
        (
            &["bench", "--backend", "cuda", "--lengths", "0,0"],
            "--lengths",
        ),
        (
            &[
                "bench",
                "--backend",
                "cuda",
                "--lengths",
                "/no/such/lengths.txt",
            ],
            "--lengths",
        ),
        (
            &[
                "bench",
                "--backward",
                "--backend",
                "cuda",
                "--lengths",
                "12,x",
            ],
            "--lengths",
        ),
        // --varlen draws --tokens rows: none, or more than int32 offsets hold, is refused.
        (
            &[
                "bench",
                "--backend",
                "cuda",
                "--varlen",
                "1",
                "--tokens",
                "0",
            ],
            "--tokens",
        ),
        (
            &[
                "bench",
                "--backend",
                "cuda",
                "--varlen",
                "1",
                "--tokens",
                "1000000000000000000",
            ],
            "--tokens",
        ),
        // The CUDA forward: its shapes come from --grid, --tokens and --hidden.
        (
            &["bench", "--backend", "cuda", "--seqlens", "512"],
            "--seqlens",
        ),
        (
            &["bench", "--backend", "cuda", "--head-dims", "64"],
            "--head-dims",
        ),
        (
            &["bench", "--backend", "cuda", "--causal", "on"],
            "--causal",
        ),
        (&["bench", "--backend", "cuda", "--batch", "1"], "--batch"),
        (&["bench", "--backend", "cuda", "--heads", "4"], "--heads"),
        (
            &["bench", "--backend", "cuda", "--threads", "2"],
            "--threads",
        ),
        (
            &["bench", "--backend", "cuda", "--fused-peer"],
            "--fused-peer",
        ),
        (
            &["bench", "--backend", "cuda", "--no-materialized"],
            "--no-materialized",
        ),
        // The backward: --grid on the GPU only, and not beside the prefill grid's flags.
        (&["bench", "--backward", "--grid", g], "--grid"),
        (
            &["bench", "--backward", "--backend", "cpu", "--grid", g],
            "--grid",
        ),
        (&["bench", "--backward", "--calls", "3"], "--calls"),
        (
            &["bench", "--backward", "--no-materialized"],
            "--no-materialized",
        ),
        (&["bench", "--backward", "--fused-peer"], "--fused-peer"),
        (
            &[
                "bench",
                "--backward",
                "--backend",
                "cuda",
                "--grid",
                g,
                "--seqlens",
                "512",
            ],
            "--seqlens",
        ),
        (
            &[
                "bench",
                "--backward",
                "--backend",
                "cuda",
                "--grid",
                g,
                "--heads",
                "4",
            ],
            "--heads",
        ),
        (
            &[
                "bench",
                "--backward",
                "--backend",
                "cuda",
                "--grid",
                g,
                "--causal",
                "on",
            ],
            "--causal",
        ),
        (
            &[
                "bench",
                "--backward",
                "--backend",
                "cuda",
                "--tokens",
                "8192",
            ],
            "--tokens",
        ),
        (
            &[
                "bench",
                "--backward",
                "--backend",
                "cuda",
                "--hidden",
                "1024",
            ],
            "--hidden",
        ),
        (
            &[
                "bench",
                "--backward",
                "--backend",
                "cuda",
                "--grid",
                "128,1000,0",
            ],
            "--grid",
        ),
        (
            &[
                "bench",
                "--backward",
                "--backend",
                "cuda",
                "--grid",
                "128,1024",
            ],
            "--grid",
        ),
        (
            &[
                "bench",
                "--backward",
                "--backend",
                "cuda",
                "--tiles",
                "128,64,4,1,2,1,0,0",
            ],
            "--tiles",
        ),
        (
            &[
                "bench",
                "--backward",
                "--backend",
                "cuda",
                "--sm90-tiles",
                "x",
            ],
            "--sm90-tiles",
        ),
        (
            &[
                "bench",
                "--backward",
                "--backend",
                "cuda",
                "--rounds-from-stdin",
            ],
            "--rounds-from-stdin",
        ),
        (
            &["bench", "--backward", "--backend", "cuda", "--threads", "2"],
            "--threads",
        ),
        (
            &[
                "bench",
                "--backward",
                "--backend",
                "cuda",
                "--kernel",
                "sm100",
            ],
            "--kernel",
        ),
        (
            &["bench", "--backward", "--backend", "cuda", "--calls", "0"],
            "--calls",
        ),
        (
            &["bench", "--backward", "--backend", "cuda", "--reps", "0"],
            "--reps",
        ),
        (
            &["bench", "--backward", "--backend", "cuda", "--seqlens", "0"],
            "--seqlens",
        ),
        // Decode.
        (&["bench", "--decode", "--grid", g], "--grid"),
        (&["bench", "--decode", "--tokens", "4"], "--tokens"),
        (&["bench", "--decode", "--fused-peer"], "--fused-peer"),
        (
            &["bench", "--decode", "--backend", "cuda", "--grid", g],
            "--grid",
        ),
        (
            &["bench", "--decode", "--backend", "cuda", "--kernel", "sm90"],
            "--kernel",
        ),
        (
            &["bench", "--decode", "--backend", "cuda", "--calls", "3"],
            "--calls",
        ),
        (
            &["bench", "--decode", "--backend", "cuda", "--batch", "1"],
            "--batch",
        ),
        // Context parallelism.
        (&["bench", "--cp", "2", "--grid", g], "--grid"),
        (
            &["bench", "--cp", "2", "--no-materialized"],
            "--no-materialized",
        ),
        (
            &["bench", "--cp", "2", "--backend", "cuda", "--grid", g],
            "--grid",
        ),
        (
            &["bench", "--cp", "2", "--backend", "cuda", "--calls", "3"],
            "--calls",
        ),
        (
            &["bench", "--cp", "2", "--backend", "cuda", "--device", "1"],
            "--device",
        ),
    ];
    for &(args, flag) in cases {
        one_line_error(args, &[&format!("`{flag}`")]);
    }
    // The refusal says which pass would have ignored the flag, and where it applies.
    let (_, _, err) = fa4(&["bench", "--backward", "--grid", g]);
    assert!(
        err.contains("`fa4 bench --backward` on the CPU does not read it")
            && err.contains("--backend cuda"),
        "{err}"
    );
}

/// A window side may be any usize (`--window 18446744073709551615,0` was refused as not an
/// integer ≥ 0).
#[test]
fn window_sides_take_any_usize() {
    let (code, out, err) = fa4(&[
        "run",
        "--backend",
        "cpu",
        "--seqlen-q",
        "8",
        "--heads-q",
        "1",
        "--head-dim",
        "8",
        "--window",
        "18446744073709551615,0",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("window(18446744073709551615,0)"), "{out}");
}

#[test]
fn an_empty_batch_is_a_valid_problem() {
    // "strides make distinct elements overlap" before: O [2, 0, h, d] has batch stride 0.
    let (code, out, err) = fa4(&[
        "run",
        "--backend",
        "cpu",
        "--batch",
        "2",
        "--seqlen-q",
        "0",
        "--seqlen-k",
        "1",
    ]);
    assert_eq!(code, 0, "{err}\n{out}");
    assert!(out.contains("b=2 sq=0 sk=1"), "{out}");
    assert!(
        out.contains("check    pass") && out.contains("over 0 elements"),
        "{out}"
    );

    let dir = TempDir::new("empty");
    let (q, k) = (
        dir.npy("q.npy", &[2, 0, 2, 8]),
        dir.npy("k.npy", &[2, 3, 2, 8]),
    );
    let (o, lse) = (dir.path("o.npy"), dir.path("lse.npy"));
    let (code, out, err) = fa4(&[
        "run",
        "--backend",
        "cpu",
        "--q",
        &q,
        "--k",
        &k,
        "--v",
        &k,
        "--out",
        &s(&o),
        "--lse",
        &s(&lse),
    ]);
    assert_eq!(code, 0, "{err}\n{out}");
    let o = npy::read(&o, "o").unwrap();
    assert_eq!((o.shape.clone(), o.len()), (vec![2, 0, 2, 8], 0));
    assert_eq!(npy::read(&lse, "lse").unwrap().shape, vec![2, 2, 0]);
}

#[test]
fn outputs_never_overwrite_an_input_or_each_other() {
    let dir = TempDir::new("alias");
    let q = dir.npy("q.npy", &[1, 8, 2, 16]);
    let k = dir.npy("k.npy", &[1, 8, 2, 16]);
    let q_before = std::fs::read(&q).unwrap();
    let x = s(&dir.path("x.npy"));
    // The same file by another spelling.
    let x_again = s(&dir.path(".").join("x.npy"));
    let base = |out: &str| -> Vec<String> {
        [
            "run",
            "--backend",
            "cpu",
            "--q",
            &q,
            "--k",
            &k,
            "--v",
            &k,
            "--out",
            out,
        ]
        .map(String::from)
        .to_vec()
    };

    let mut both = base(&x);
    both.extend(["--lse".to_string(), x_again.clone()]);
    one_line_error(&argv(&both), &["`--lse`", "output file of --out"]);
    one_line_error(&argv(&base(&q)), &["`--out`", "input file of --q"]);
    let mut lse_on_k = base(&x);
    lse_on_k.extend(["--lse".to_string(), k.clone()]);
    one_line_error(&argv(&lse_on_k), &["`--lse`", "input file of --k"]);
    // Refused before anything was computed or written.
    assert_eq!(std::fs::read(&q).unwrap(), q_before);
    assert!(!dir.path("x.npy").exists());

    // A good run leaves its outputs and no temporary file.
    let mut good = base(&x);
    good.extend(["--lse".to_string(), s(&dir.path("lse.npy"))]);
    let (code, out, err) = fa4(&argv(&good));
    assert_eq!(code, 0, "{err}\n{out}");
    let mut names = dir.files();
    names.sort();
    assert_eq!(names, ["k.npy", "lse.npy", "q.npy", "x.npy"]);
}

/// Outputs are staged beside their destination and renamed: one dropped before commit leaves
/// nothing, and an existing file is replaced whole.
#[test]
fn staged_outputs_appear_whole_or_not_at_all() {
    let dir = TempDir::new("stage");
    let dest = dir.path("o.npy");
    let staged = npy::stage(&dest, "--out", &[2], &[1.0f32, 2.0]).unwrap();
    assert!(!dest.exists());
    assert_eq!(dir.files().len(), 1, "{:?}", dir.files());
    drop(staged);
    assert!(dir.files().is_empty(), "{:?}", dir.files());
    std::fs::write(&dest, b"old").unwrap();
    npy::stage(&dest, "--out", &[2], &[3.0f32, 4.0])
        .unwrap()
        .commit()
        .unwrap();
    assert_eq!(dir.files(), ["o.npy"]);
    assert_eq!(
        npy::read(&dest, "o").unwrap().data,
        npy::Data::F32(vec![3.0, 4.0])
    );
}

#[test]
fn a_malformed_header_is_one_escaped_line() {
    let dir = TempDir::new("header");
    let header = "{'descr': '<f4',\n\u{1b}[31m 'shape': (1, 8, 2, 16), }\n";
    let mut b = b"\x93NUMPY\x01\x00".to_vec();
    b.extend_from_slice(&(header.len() as u16).to_le_bytes());
    b.extend_from_slice(header.as_bytes());
    b.extend_from_slice(&[0u8; 1024]);
    let bad = dir.path("bad.npy");
    std::fs::write(&bad, b).unwrap();
    let k = dir.npy("k.npy", &[1, 8, 2, 16]);
    let o = s(&dir.path("o.npy"));
    let args = [
        "run",
        "--backend",
        "cpu",
        "--q",
        &s(&bad),
        "--k",
        &k,
        "--v",
        &k,
        "--out",
        &o,
    ];
    one_line_error(&args, &["`--q`", "malformed header", "\\n"]);
    let (_, _, err) = fa4(&args);
    assert!(!err.contains('\u{1b}'), "{err:?}");
    // An endless device is read only as far as a preamble, not into memory without bound.
    #[cfg(unix)]
    one_line_error(
        &[
            "run",
            "--backend",
            "cpu",
            "--q",
            "/dev/zero",
            "--k",
            &k,
            "--v",
            &k,
            "--out",
            &o,
        ],
        &["`--q`", "not a .npy file"],
    );
}

#[test]
fn auto_says_what_it_chose_on_one_line() {
    let (code, out, err) = fa4(&[
        "run",
        "--seqlen-q",
        "8",
        "--heads-q",
        "1",
        "--head-dim",
        "16",
        "--dtype",
        "fp16",
    ]);
    assert_eq!(code, 0, "{err}\n{out}");
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(lines[0].starts_with("fa4: --backend auto chose "), "{err}");
    if lines[0].starts_with("fa4: --backend auto chose cpu") {
        // Why not the GPU: the library that was missing and what was tried, or the device.
        assert!(lines[0].contains("no usable GPU ("), "{err}");
        assert!(out.contains("backend  cpu"), "{out}");
    } else {
        assert!(out.contains("backend  cuda"), "{out}");
    }
    // Naming a backend says nothing extra.
    let (_, _, err) = fa4(&[
        "run",
        "--backend",
        "cpu",
        "--seqlen-q",
        "8",
        "--heads-q",
        "1",
        "--head-dim",
        "16",
    ]);
    assert!(err.is_empty(), "{err}");
}

/// `--backend cuda` is an error naming `--backend` where no GPU works, and runs where one does.
#[test]
fn backend_cuda_errors_or_runs() {
    let gpu = fa4::Backend::cuda(0).is_ok();
    for args in [
        &[
            "run",
            "--backend",
            "cuda",
            "--seqlen-q",
            "8",
            "--heads-q",
            "1",
            "--head-dim",
            "16",
        ][..],
        &[
            "check",
            "--backend",
            "cuda",
            "--dtype",
            "bf16",
            "--head-dim",
            "64",
        ][..],
    ] {
        if gpu {
            let (code, out, err) = fa4(args);
            assert_eq!(code, 0, "{args:?}: {err}\n{out}");
        } else {
            one_line_error(args, &["`--backend`", "CUDA"]);
        }
    }
}

#[test]
fn long_work_shows_an_estimate_and_progress() {
    // One thread and an f32 problem whose oracle costs 2.4e9 multiply-adds: about 3 s
    // expected, so the estimate and (stderr not being a terminal) plain progress appear.
    let (code, out, err) = fa4(&[
        "run",
        "--backend",
        "cpu",
        "--threads",
        "1",
        "--dtype",
        "f32",
        "--seqlen-q",
        "1536",
        "--heads-q",
        "4",
        "--head-dim",
        "128",
    ]);
    assert_eq!(code, 0, "{err}\n{out}");
    assert!(out.contains("backend  cpu (1 thread)"), "{out}");
    assert!(
        err.contains("fa4: checking against the float64 oracle: about "),
        "{err}"
    );
    assert!(
        !err.contains('\r'),
        "a bar redrawn in place on a non-terminal: {err:?}"
    );
    // A short run stays quiet.
    let (_, _, err) = fa4(&[
        "run",
        "--backend",
        "cpu",
        "--seqlen-q",
        "64",
        "--head-dim",
        "32",
    ]);
    assert!(err.is_empty(), "{err}");
}

#[test]
fn threads_choose_the_cpu_pool() {
    let (code, out, err) = fa4(&[
        "run",
        "--backend",
        "cpu",
        "--threads",
        "3",
        "--seqlen-q",
        "16",
        "--head-dim",
        "16",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("backend  cpu (3 threads)"), "{out}");
    let (code, out, err) = fa4(&[
        "check",
        "--backend",
        "cpu",
        "--threads",
        "1",
        "--dtype",
        "f32",
        "--head-dim",
        "32",
    ]);
    assert_eq!(code, 0, "{err}\n{out}");
    assert!(out.ends_with(" 0 failed\n"), "{out}");
    one_line_error(&["check", "--threads", "0"], &["`--threads`"]);
    one_line_error(&["bench", "--threads", "0"], &["--threads"]);
}

#[test]
fn the_hopper_plan_refuses_flags_it_ignores() {
    for (flag, value) in [
        ("--swizzle", "64B"),
        ("--num-q-heads", "16"),
        ("--group", "1"),
    ] {
        one_line_error(
            &["plan", "--arch", "sm90", "--depth", "128", flag, value],
            &[&format!("`{flag}`"), "--arch sm100"],
        );
    }
    // `--seqlen` changes the Hopper plan and is refused by the SM100 one.
    let (_, a, _) = fa4(&[
        "plan", "--arch", "sm90", "--depth", "64", "--seqlen", "1024",
    ]);
    let (_, b, _) = fa4(&[
        "plan", "--arch", "sm90", "--depth", "64", "--seqlen", "16384",
    ]);
    assert_ne!(a, b);
    one_line_error(
        &["plan", "--depth", "64", "--seqlen", "100"],
        &["`--seqlen`"],
    );
    // The SM100 defaults are unchanged.
    let (code, out, _) = fa4(&["plan", "--depth", "128"]);
    assert_eq!(code, 0);
    assert!(
        out.contains("32 query heads, group 1") && out.contains("swizzle 128B"),
        "{out}"
    );
}
