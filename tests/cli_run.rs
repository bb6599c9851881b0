//! `fa4 run` end to end: random problems pass their check and report GFLOP/s; runs on .npy
//! files (fixed-length, varlen with a zero-length sequence, rounding to bf16) write O and LSE
//! that pass the spec's tolerance rule against the float64 oracle; bad input is one line on
//! stderr naming the argument and exit code 2.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::SeedableRng;

use fa4::npy::{self, Data};
use fa4::tensor::Layout;
use fa4::{check, DType, Element, Options, Problem};

mod common;
use common::fa4;

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "fa4-cli-run-{}-{tag}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        TempDir(dir)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    /// Writes an array and returns its path as a string argument.
    fn npy<T: npy::NpyElement>(&self, name: &str, shape: &[usize], data: &[T]) -> String {
        let p = self.path(name);
        npy::write(&p, "test", shape, data).expect("write .npy");
        s(&p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn s(p: &Path) -> String {
    p.to_str().expect("utf-8 temp path").to_string()
}

/// Standard-normal data with a few scaled rows, as the matrix draws it.
fn random<T: Element>(n: usize, row: usize, large: f32, seed: u64) -> Vec<T> {
    let mut v = vec![T::NAN; n];
    check::random_fill(&mut StdRng::seed_from_u64(seed), &mut v, row, large);
    v
}

fn read_f32(p: &Path) -> (Vec<usize>, Vec<f32>) {
    let a = npy::read(p, "test").expect("fa4 wrote a readable .npy");
    match a.data {
        Data::F32(x) => (a.shape, x),
        other => panic!("{} holds {other:?}, not float32", p.display()),
    }
}

/// The number before "GFLOP/s" on the time line.
fn gflops(out: &str) -> f64 {
    let line = out
        .lines()
        .find(|l| l.starts_with("time"))
        .unwrap_or_else(|| panic!("no time line:\n{out}"));
    let before = line
        .split(" GFLOP/s")
        .next()
        .and_then(|x| x.rsplit(' ').next())
        .unwrap_or_else(|| panic!("no GFLOP/s in {line}"));
    before
        .parse()
        .unwrap_or_else(|_| panic!("bad rate in {line}"))
}

#[test]
fn random_problems_pass_their_check_and_report_gflops() {
    let cases: [(&[&str], &[&str]); 4] = [
        (
            &[
                "--seqlen-q",
                "64",
                "--seqlen-k",
                "80",
                "--heads-q",
                "4",
                "--heads-kv",
                "2",
                "--head-dim",
                "64",
                "--dtype",
                "f32",
                "--causal",
            ],
            &["f32 b=1 sq=64 sk=80 h=4/2 d=64 causal"],
        ),
        (
            &[
                "--batch",
                "2",
                "--seqlen-q",
                "33",
                "--heads-q",
                "2",
                "--head-dim",
                "32",
                "--head-dim-v",
                "48",
                "--window",
                "8,-1",
                "--softcap",
                "10",
                "--seed",
                "7",
            ],
            // bf16 is the default dtype.
            &[
                "bf16 b=2 sq=33 sk=33 h=2/2 d=32/48 window(8,-1) softcap=10",
                "lowp",
            ],
        ),
        (
            &[
                "--seqlen-q",
                "100",
                "--seqlen-k",
                "20",
                "--heads-q",
                "3",
                "--heads-kv",
                "1",
                "--head-dim",
                "80",
                "--dtype",
                "fp16",
                "--window=-1,0",
                "--scale",
                "0.25",
            ],
            &["fp16 b=1 sq=100 sk=20 h=3/1 d=80 window(-1,0) scale=0.2500"],
        ),
        (
            &[
                "--seqlen-q",
                "1",
                "--seqlen-k",
                "300",
                "--heads-q",
                "1",
                "--head-dim",
                "256",
            ],
            &["bf16 b=1 sq=1 sk=300 h=1/1 d=256"],
        ),
    ];
    for (args, needles) in cases {
        // The CPU backend, named: these problems (f32, head_dim_v ≠ head_dim) are the CPU's,
        // and auto would take a GPU where one works.
        let mut full = vec!["run", "--backend", "cpu"];
        full.extend_from_slice(args);
        let (code, out, err) = fa4(&full);
        assert_eq!(code, 0, "{args:?}: {err}\n{out}");
        assert!(err.is_empty(), "{args:?}: {err}");
        for n in needles
            .iter()
            .chain(&["backend  cpu", "check    pass:", "float64 oracle"])
        {
            assert!(out.contains(n), "{args:?}: lacks {n:?}:\n{out}");
        }
        let rate = gflops(&out);
        assert!(
            rate.is_finite() && rate > 0.0,
            "{args:?}: rate {rate}\n{out}"
        );
    }
}

#[test]
fn the_same_seed_draws_the_same_problem() {
    let args = [
        "run",
        "--seqlen-q",
        "40",
        "--heads-q",
        "2",
        "--head-dim",
        "32",
        "--seed",
        "3",
    ];
    let check_line = |out: &str| {
        out.lines()
            .find(|l| l.starts_with("check"))
            .map(str::to_owned)
    };
    let (_, a, _) = fa4(&args);
    let (_, b, _) = fa4(&args);
    // The report holds the errors to four digits: equal for equal inputs, not for others.
    let strip = |l: Option<String>| l.map(|l| l.split(" (float64").next().unwrap().to_owned());
    assert_eq!(strip(check_line(&a)), strip(check_line(&b)), "{a}\n{b}");
    let mut other = args.to_vec();
    *other.last_mut().unwrap() = "4";
    let (_, c, _) = fa4(&other);
    assert_ne!(strip(check_line(&a)), strip(check_line(&c)), "{a}\n{c}");
}

#[test]
fn no_check_skips_the_oracle() {
    let (code, out, err) = fa4(&[
        "run",
        "--seqlen-q",
        "16",
        "--heads-q",
        "1",
        "--head-dim",
        "16",
        "--no-check",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("check    skipped (--no-check)"), "{out}");
    assert!(!out.contains("pass"), "{out}");
}

/// Contiguous layouts of rank 4 (or 3 when packed) for the test's own Problem.
fn layouts(q: &[usize], k: &[usize], v: &[usize]) -> [Layout; 4] {
    let mut o = q.to_vec();
    *o.last_mut().unwrap() = *v.last().unwrap();
    [
        Layout::new("q", q, None).unwrap(),
        Layout::new("k", k, None).unwrap(),
        Layout::new("v", v, None).unwrap(),
        Layout::new("out", &o, None).unwrap(),
    ]
}

#[test]
fn npy_inputs_fixed_length_f32() {
    let dir = TempDir::new("fixed");
    let (qs, ks, vs) = ([2, 33, 4, 32], [2, 47, 2, 32], [2, 47, 2, 48]);
    let q: Vec<f32> = random(qs.iter().product(), 32, 1.0, 1);
    let k: Vec<f32> = random(ks.iter().product(), 32, 3.0, 2);
    let v: Vec<f32> = random(vs.iter().product(), 48, 1.0, 3);
    let (o_path, lse_path) = (dir.path("o.npy"), dir.path("lse.npy"));
    let (code, out, err) = fa4(&[
        "run",
        "--backend",
        "cpu",
        "--q",
        &dir.npy("q.npy", &qs, &q),
        "--k",
        &dir.npy("k.npy", &ks, &k),
        "--v",
        &dir.npy("v.npy", &vs, &v),
        "--out",
        &s(&o_path),
        "--lse",
        &s(&lse_path),
        "--causal",
        "--softcap",
        "15",
    ]);
    assert_eq!(code, 0, "{err}\n{out}");
    for n in [
        "f32 b=2 sq=33 sk=47 h=4/2 d=32/48 causal softcap=15",
        "wrote    O [2, 33, 4, 48] float32",
        "wrote    LSE [2, 4, 33] float32",
        "check    pass",
    ] {
        assert!(out.contains(n), "lacks {n:?}:\n{out}");
    }
    assert!(gflops(&out) > 0.0);

    let (o_shape, o) = read_f32(&o_path);
    let (lse_shape, lse) = read_f32(&lse_path);
    assert_eq!((o_shape, lse_shape), (vec![2, 33, 4, 48], vec![2, 4, 33]));
    let [ql, kl, vl, ol] = layouts(&qs, &ks, &vs);
    let p = Problem::new(
        DType::F32,
        &ql,
        &kl,
        &vl,
        &ol,
        None,
        None,
        &Options::new().causal().softcap(15.0),
    )
    .unwrap();
    let report = check::check(&p, &q, &k, &v, &o, Some(&lse)).unwrap();
    assert!(report.passed(), "{report}");
    assert!(report.lse_err.is_some());
    // Causal with sq < sk: every row sees a key, so every LSE is finite.
    assert!(lse.iter().all(|x| x.is_finite()));
}

#[test]
fn npy_inputs_varlen_f16_with_empty_sequences() {
    let dir = TempDir::new("varlen");
    // Sequence 1 has no queries, sequence 2 no keys (its rows: O = 0, LSE = −inf).
    let (lq, lk) = ([5usize, 0, 20, 7], [9usize, 4, 0, 30]);
    let cum = |l: &[usize]| {
        let mut c = vec![0i32];
        for &x in l {
            c.push(c.last().unwrap() + x as i32);
        }
        c
    };
    let (cq, ck) = (cum(&lq), cum(&lk));
    let (tq, tk) = (*cq.last().unwrap() as usize, *ck.last().unwrap() as usize);
    let (hq, hkv, d) = (4, 2, 64);
    let (qs, ks) = ([tq, hq, d], [tk, hkv, d]);
    let q: Vec<f16> = random(qs.iter().product(), d, 1.0, 11);
    let k: Vec<f16> = random(ks.iter().product(), d, 3.0, 12);
    let v: Vec<f16> = random(ks.iter().product(), d, 1.0, 13);
    let (o_path, lse_path) = (dir.path("o.npy"), dir.path("lse.npy"));
    let (code, out, err) = fa4(&[
        "run",
        "--backend",
        "cpu",
        "--q",
        &dir.npy("q.npy", &qs, &q),
        "--k",
        &dir.npy("k.npy", &ks, &k),
        "--v",
        &dir.npy("v.npy", &ks, &v),
        "--cu-seqlens-q",
        &dir.npy("cq.npy", &[cq.len()], &cq),
        "--cu-seqlens-k",
        &dir.npy("ck.npy", &[ck.len()], &ck),
        "--out",
        &s(&o_path),
        "--lse",
        &s(&lse_path),
        "--window",
        "6,2",
        "--scale",
        "0.2",
    ]);
    assert_eq!(code, 0, "{err}\n{out}");
    for n in [
        "fp16 varlen b=4 total_q=32 total_k=43",
        "h=4/2 d=64 window(6,2) scale=0.2000",
        "check    pass",
        "lowp",
    ] {
        assert!(out.contains(n), "lacks {n:?}:\n{out}");
    }
    let (o_shape, o) = read_f32(&o_path);
    let (lse_shape, lse) = read_f32(&lse_path);
    assert_eq!((o_shape, lse_shape), (vec![tq, hq, d], vec![hq, tq]));
    // The file's dtype (float16) is the storage dtype: O was computed in fp16, so widening it
    // to float32 was exact.
    let o16: Vec<f16> = o.iter().map(|&x| f16::from_f32(x)).collect();
    assert!(o16.iter().zip(&o).all(|(a, &b)| a.to_f32() == b));
    let [ql, kl, vl, ol] = layouts(&qs, &ks, &ks);
    let p = Problem::new(
        DType::F16,
        &ql,
        &kl,
        &vl,
        &ol,
        Some(&cq),
        Some(&ck),
        &Options::new().window(Some(6), Some(2)).scale(0.2),
    )
    .unwrap();
    let report = check::check(&p, &q, &k, &v, &o16, Some(&lse)).unwrap();
    assert!(report.passed(), "{report}");
    // Sequence 2 (rows 5..25) has no keys.
    for row in 5..25 {
        assert!(o[row * hq * d..(row + 1) * hq * d]
            .iter()
            .all(|&x| x == 0.0));
        for h in 0..hq {
            assert_eq!(lse[h * tq + row], f32::NEG_INFINITY, "head {h} row {row}");
        }
    }
}

#[test]
fn dtype_bf16_rounds_float32_inputs() {
    let dir = TempDir::new("bf16");
    let (qs, ks) = ([1, 70, 2, 64], [1, 90, 2, 64]);
    let q: Vec<f32> = random(qs.iter().product(), 64, 1.0, 21);
    let k: Vec<f32> = random(ks.iter().product(), 64, 3.0, 22);
    let v: Vec<f32> = random(ks.iter().product(), 64, 1.0, 23);
    let o_path = dir.path("o.npy");
    let lse_path = dir.path("lse.npy");
    let (code, out, err) = fa4(&[
        "run",
        "--backend",
        "cpu",
        "--q",
        &dir.npy("q.npy", &qs, &q),
        "--k",
        &dir.npy("k.npy", &ks, &k),
        "--v",
        &dir.npy("v.npy", &ks, &v),
        "--out",
        &s(&o_path),
        "--lse",
        &s(&lse_path),
        "--dtype",
        "bf16",
    ]);
    assert_eq!(code, 0, "{err}\n{out}");
    assert!(out.contains("problem  bf16 b=1 sq=70 sk=90"), "{out}");
    let (_, o) = read_f32(&o_path);
    let (_, lse) = read_f32(&lse_path);
    let [ql, kl, vl, ol] = layouts(&qs, &ks, &ks);
    let opts = Options::new();

    // O was stored in bf16 (exactly representable) and passes the 16-bit rule against the
    // oracle of the rounded inputs.
    let ob: Vec<bf16> = o.iter().map(|&x| bf16::from_f32(x)).collect();
    assert!(ob.iter().zip(&o).all(|(a, &b)| a.to_f32() == b));
    let round = |x: &[f32]| x.iter().map(|&e| bf16::from_f32(e)).collect::<Vec<_>>();
    let (qb, kb, vb) = (round(&q), round(&k), round(&v));
    let p = Problem::new(DType::Bf16, &ql, &kl, &vl, &ol, None, None, &opts).unwrap();
    let report = check::check(&p, &qb, &kb, &vb, &ob, Some(&lse)).unwrap();
    assert!(report.passed(), "{report}");

    // The inputs really were rounded: the result is far outside the f32 rule for the
    // unrounded inputs.
    let p32 = Problem::new(DType::F32, &ql, &kl, &vl, &ol, None, None, &opts).unwrap();
    let exact = check::check(&p32, &q, &k, &v, &o, Some(&lse)).unwrap();
    assert!(!exact.passed(), "bf16 rounding left no trace: {exact}");
    assert!(exact.max_err > 10.0 * exact.bound, "{exact}");
}

/// A .npy file with a hand-written header.
fn raw_npy(descr: &str, shape: &str, data: &[u8]) -> Vec<u8> {
    let header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}\n");
    let mut b = b"\x93NUMPY\x01\x00".to_vec();
    b.extend_from_slice(&(header.len() as u16).to_le_bytes());
    b.extend_from_slice(header.as_bytes());
    b.extend_from_slice(data);
    b
}

#[test]
fn bad_input_is_one_line_naming_the_argument() {
    let dir = TempDir::new("errors");
    let (qs, ks) = ([1, 8, 2, 16], [1, 8, 2, 16]);
    let q = dir.npy("q.npy", &qs, &random::<f32>(256, 16, 1.0, 1));
    let k = dir.npy("k.npy", &ks, &random::<f32>(256, 16, 1.0, 2));
    let v = dir.npy("v.npy", &ks, &random::<f32>(256, 16, 1.0, 3));
    let v16 = dir.npy("v16.npy", &ks, &random::<f16>(256, 16, 1.0, 3));
    let k_d8 = dir.npy("k_d8.npy", &[1, 8, 2, 8], &random::<f32>(128, 8, 1.0, 4));
    let k_h3 = dir.npy("k_h3.npy", &[1, 8, 3, 16], &random::<f32>(384, 16, 1.0, 4));
    let q3 = dir.npy("q3.npy", &[8, 2, 16], &random::<f32>(256, 16, 1.0, 5));
    let k3 = dir.npy("k3.npy", &[8, 2, 16], &random::<f32>(256, 16, 1.0, 6));
    let cu_ok = dir.npy("cu.npy", &[3], &[0i32, 3, 8]);
    let cu_short = dir.npy("cu_short.npy", &[3], &[0i32, 3, 7]);
    let cu_down = dir.npy("cu_down.npy", &[3], &[0i32, 5, 3]);
    let cu_len = dir.npy("cu_len.npy", &[2], &[0i32, 8]);
    let cu_f32 = dir.npy("cu_f32.npy", &[3], &[0f32, 3.0, 8.0]);
    let cu_2d = dir.npy("cu_2d.npy", &[1, 3], &[0i32, 3, 8]);
    let write = |name: &str, bytes: &[u8]| {
        let p = dir.path(name);
        std::fs::write(&p, bytes).unwrap();
        s(&p)
    };
    let cu_i64 = write(
        "cu_i64.npy",
        &raw_npy("<i8", "(3,)", &[0i64, 3, 8].map(i64::to_le_bytes).concat()),
    );
    let q_f64 = write(
        "q_f64.npy",
        &raw_npy("<f8", "(1, 8, 2, 16)", &[0u8; 256 * 8]),
    );
    let k_bad = write("k_bad.npy", b"this is not an npy file");
    let v_short = write(
        "v_short.npy",
        &raw_npy("<f4", "(1, 8, 2, 16)", &[0u8; 1000]),
    );
    let missing = s(&dir.path("missing.npy"));
    let o = s(&dir.path("o.npy"));
    let o_nodir = s(&dir.path("no/such/dir/o.npy"));

    let files = |q: &str, k: &str, v: &str| -> Vec<String> {
        // A named backend: `--backend auto` says what it chose on a line of its own, and an
        // error found after that choice (an unwritable --out) would follow it.
        [
            "run",
            "--backend",
            "cpu",
            "--q",
            q,
            "--k",
            k,
            "--v",
            v,
            "--out",
            &o,
        ]
        .map(String::from)
        .to_vec()
    };
    let with = |mut base: Vec<String>, more: &[&str]| {
        base.extend(more.iter().map(|x| x.to_string()));
        base
    };
    let plain = |args: &[&str]| args.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    let small = [
        "run",
        "--seqlen-q",
        "8",
        "--heads-q",
        "2",
        "--head-dim",
        "16",
    ];

    let cases: Vec<(Vec<String>, &[&str])> = vec![
        // Files: missing, malformed, wrong dtype.
        (
            files(&missing, &k, &v),
            &["--q", "cannot read", "missing.npy"],
        ),
        (files(&q, &k_bad, &v), &["--k", "not a .npy file"]),
        (files(&q, &k, &v_short), &["--v", "holds 1000 bytes"]),
        (
            files(&q_f64, &k, &v),
            &["--q", "float64", "float32 ('<f4') or float16"],
        ),
        (
            with(
                files(&q3, &k3, &k3),
                &["--cu-seqlens-q", &cu_i64, "--cu-seqlens-k", &cu_ok],
            ),
            &["--cu-seqlens-q", "int64", "int32"],
        ),
        (
            with(
                files(&q3, &k3, &k3),
                &["--cu-seqlens-q", &cu_ok, "--cu-seqlens-k", &cu_f32],
            ),
            &["--cu-seqlens-k", "float32", "int32"],
        ),
        (
            with(
                files(&q3, &k3, &k3),
                &["--cu-seqlens-q", &cu_2d, "--cu-seqlens-k", &cu_ok],
            ),
            &["--cu-seqlens-q", "[batch + 1]"],
        ),
        (files(&q, &k, &v16), &["--v", "float16", "--dtype"]),
        // Shapes.
        (files(&q, &k_d8, &v), &["`--k`", "expected shape"]),
        (files(&q, &k_h3, &v), &["`--k`", "heads_kv 3"]),
        (files(&q3, &k3, &k3), &["--q", "rank 4", "--cu-seqlens-q"]),
        (
            with(
                files(&q, &k, &v),
                &["--cu-seqlens-q", &cu_ok, "--cu-seqlens-k", &cu_ok],
            ),
            &["--q", "rank 3"],
        ),
        // cu_seqlens contents.
        (
            with(
                files(&q3, &k3, &k3),
                &["--cu-seqlens-q", &cu_short, "--cu-seqlens-k", &cu_ok],
            ),
            &["`--cu-seqlens-q`", "last entry 7"],
        ),
        (
            with(
                files(&q3, &k3, &k3),
                &["--cu-seqlens-q", &cu_ok, "--cu-seqlens-k", &cu_down],
            ),
            &["`--cu-seqlens-k`", "non-decreasing"],
        ),
        (
            with(
                files(&q3, &k3, &k3),
                &["--cu-seqlens-q", &cu_ok, "--cu-seqlens-k", &cu_len],
            ),
            &["`--cu-seqlens-k`", "entries"],
        ),
        // Option combinations.
        (
            with(files(&q3, &k3, &k3), &["--cu-seqlens-q", &cu_ok]),
            &["--cu-seqlens-k", "required"],
        ),
        (
            with(files(&q3, &k3, &k3), &["--cu-seqlens-k", &cu_ok]),
            &["--cu-seqlens-q", "required"],
        ),
        (
            plain(&["run", "--q", &q, "--k", &k, "--v", &v]),
            &["--out", "required"],
        ),
        (
            plain(&["run", "--q", &q, "--v", &v, "--out", &o]),
            &["--k", "required"],
        ),
        (
            plain(&["run", "--k", &k, "--v", &v, "--out", &o]),
            &["--q", "required"],
        ),
        (
            with(files(&q, &k, &v), &["--batch", "2"]),
            &["--batch", "random problem"],
        ),
        (with(files(&q, &k, &v), &["--seed", "2"]), &["--seed"]),
        (with(plain(&small), &["--out", &o]), &["--out", "--q"]),
        (with(plain(&small), &["--lse", &o]), &["--lse", "--q"]),
        (
            with(files(&q, &k, &v), &["--dtype", "fp8", "--q-descale", &q]),
            &["`--q-descale`", "quantizes"],
        ),
        (
            with(files(&q, &k, &v), &["--q-descale", &q]),
            &["`--q-descale`", "--dtype fp8"],
        ),
        (
            plain(&[
                "run",
                "--backend",
                "cpu",
                "--q",
                &q,
                "--k",
                &k,
                "--v",
                &v,
                "--out",
                &o_nodir,
            ]),
            &["--out", "cannot write"],
        ),
        // Options.
        (
            with(plain(&small), &["--causal", "--window", "4,0"]),
            &["--window", "--causal"],
        ),
        (
            with(plain(&small), &["--window", "3"]),
            &["--window", "LEFT,RIGHT"],
        ),
        (
            with(plain(&small), &["--window", "-2,0"]),
            &["--window", "-2"],
        ),
        (with(plain(&small), &["--window", "1,x"]), &["--window"]),
        (
            with(plain(&small), &["--softcap", "0"]),
            &["`--softcap`", "> 0"],
        ),
        (with(plain(&small), &["--softcap", "-1"]), &["`--softcap`"]),
        (
            with(plain(&small), &["--scale", "inf"]),
            &["`--scale`", "finite"],
        ),
        // A value with a leading '-' that is not a number clap knows still reaches the check.
        (
            with(plain(&small), &["--scale", "-inf"]),
            &["`--scale`", "finite", "-inf"],
        ),
        (
            with(plain(&small), &["--threads", "0"]),
            &["`--threads`", "≥ 1"],
        ),
        (with(plain(&small), &["--scale", "abc"]), &["--scale"]),
        (with(plain(&small), &["--backend", "tpu"]), &["--backend"]),
        (
            with(plain(&small), &["--dtype", "fp8", "--out-dtype", "f32"]),
            &["`--out-dtype`", "bf16 or fp16"],
        ),
        (with(plain(&small), &["--dtype", "int4"]), &["dtype"]),
        (
            with(plain(&small), &["--check", "--no-check"]),
            &["--check", "--no-check"],
        ),
        (
            with(plain(&small), &["--heads-kv", "3"]),
            &["`--heads-kv`", "3 must"],
        ),
        (
            with(plain(&small), &["--head-dim-v", "0"]),
            &["`--head-dim-v`", "0 is outside"],
        ),
        (
            plain(&["run", "--head-dim", "0"]),
            &["`--head-dim`", "0 is outside"],
        ),
        (
            plain(&["run", "--heads-q", "0"]),
            &["`--heads-q`", "at least 1"],
        ),
        (plain(&["run", "--seqlen-q", "-5"]), &["--seqlen-q"]),
        (plain(&["run", "--batch", "x"]), &["--batch"]),
        (
            plain(&["run", "--seqlen-q", "1000000000000", "--heads-q", "1000"]),
            &["`--seqlen-q`", "bytes"],
        ),
        (
            plain(&[
                "run",
                "--seqlen-q",
                "100000000000000",
                "--heads-q",
                "100000000",
            ]),
            &["`--seqlen-q`", "bytes"],
        ),
    ];
    for (args, needles) in &cases {
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, out, err) = fa4(&argv);
        assert_eq!(code, 2, "{args:?}: {err}\n{out}");
        assert!(out.is_empty(), "{args:?} printed to stdout: {out}");
        assert_eq!(
            err.trim_end().lines().count(),
            1,
            "{args:?}: not one line:\n{err}"
        );
        assert!(err.starts_with("fa4: error: "), "{args:?}: {err}");
        for n in *needles {
            assert!(err.contains(n), "{args:?}: error lacks {n:?}: {err}");
        }
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
    // Nothing was written by a failing run.
    assert!(!dir.path("o.npy").exists());
}
