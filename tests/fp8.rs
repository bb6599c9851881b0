//! fp8 e4m3 inputs (`docs/attention.md`, "FP8 (e4m3) inputs") on the CPU: the oracle's own
//! reading of the bytes agrees with the element type's, the matrix passes, the rule fails a
//! backend that ignores the descales or gets one element wrong, the API validates what it takes,
//! and `fa4 run --dtype fp8` on files writes what the library computes and names bad flags.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use half::bf16;
use rand::rngs::StdRng;
use rand::SeedableRng;

use fa4::check::{self, check_fp8, matrix, run_case};
use fa4::cpu::reference::e4m3_value;
use fa4::fp8::{quantize, Operand};
use fa4::npy::{self, Data};
use fa4::tensor::Layout;
use fa4::{Backend, DType, Descales, Options, Problem, Tensor, TensorMut, F8E4M3};

mod common;
use common::fa4;

#[test]
fn the_oracle_reads_every_byte_as_the_element_type_does() {
    for b in 0..=255u8 {
        let mine = e4m3_value(b);
        let theirs = f64::from(F8E4M3::from_bits(b).to_f32());
        assert!(
            mine == theirs || (mine.is_nan() && theirs.is_nan()),
            "{b:#04x}: {mine} against {theirs}"
        );
        // No infinities: every code is finite but the two NaNs.
        assert_eq!(mine.is_nan(), b & 0x7F == 0x7F, "{b:#04x}");
    }
    assert_eq!(e4m3_value(0x7E), 448.0);
    assert_eq!(e4m3_value(0x01), 2f64.powi(-9));
}

#[test]
fn cpu_passes_the_fp8_matrix() {
    let cases = matrix(&[DType::Fp8E4M3], &[32, 64, 80, 128, 256]);
    assert!(cases.len() >= 60);
    for (i, case) in cases.iter().enumerate() {
        let r = run_case(&Backend::Cpu, case, 2000 + i as u64).unwrap();
        assert!(r.passed(), "{case}: {r}");
        assert!(
            r.lowp_err > 0.0,
            "{case}: the naive fp8 evaluation costs something"
        );
    }
}

/// A fixed-length fp8 problem: float draws quantized per (sequence, KV head).
struct Fp8Case {
    p: Problem,
    q: Vec<F8E4M3>,
    k: Vec<F8E4M3>,
    v: Vec<F8E4M3>,
    d: [Vec<f32>; 3],
}

fn fp8_case(b: usize, s: usize, hq: usize, hkv: usize, d: usize, opts: &Options) -> Fp8Case {
    let ql = Layout::new("q", &[b, s, hq, d], None).unwrap();
    let kl = Layout::new("k", &[b, s, hkv, d], None).unwrap();
    let p = Problem::new_fp8(DType::Bf16, &ql, &kl, &kl, &ql, None, None, opts).unwrap();
    let mut rng = StdRng::seed_from_u64(7);
    let (mut q, mut k, mut v) = (
        vec![0f32; ql.numel()],
        vec![0f32; kl.numel()],
        vec![0f32; kl.numel()],
    );
    check::random_qkv(&mut rng, &mut q, &mut k, &mut v, d, d);
    // Spread the scales apart so that a descale applied to the wrong head shows.
    for (i, x) in k.iter_mut().enumerate() {
        *x *= 1.0 + ((i / d) % hkv) as f32;
    }
    let (q, dq) = quantize(&p, Operand::Q, "q", &q).unwrap();
    let (k, dk) = quantize(&p, Operand::K, "k", &k).unwrap();
    let (v, dv) = quantize(&p, Operand::V, "v", &v).unwrap();
    Fp8Case {
        p,
        q,
        k,
        v,
        d: [dq, dk, dv],
    }
}

#[test]
fn the_rule_fails_wrong_answers() {
    let c = fp8_case(2, 40, 4, 2, 64, &Options::new().causal());
    let ds = Descales::new(Some(&c.d[0]), Some(&c.d[1]), Some(&c.d[2]));
    let mut o = vec![bf16::NAN; c.p.o_layout().numel()];
    let mut lse = vec![f32::NAN; c.p.lse_len()];
    Backend::Cpu
        .run_fp8(&c.p, &c.q, &c.k, &c.v, &ds, &mut o, Some(&mut lse))
        .unwrap();
    let good = check_fp8(&c.p, &c.q, &c.k, &c.v, &ds, &o, Some(&lse)).unwrap();
    assert!(good.passed(), "{good}");
    // Ignoring the descales (all ones) is a different function.
    let (mut o1, mut l1) = (o.clone(), lse.clone());
    Backend::Cpu
        .run_fp8(
            &c.p,
            &c.q,
            &c.k,
            &c.v,
            &Descales::ones(),
            &mut o1,
            Some(&mut l1),
        )
        .unwrap();
    let r = check_fp8(&c.p, &c.q, &c.k, &c.v, &ds, &o1, Some(&l1)).unwrap();
    assert!(!r.passed(), "{r}");
    // Only V's descale ignored: LSE still right, O wrong.
    let only_qk = Descales::new(Some(&c.d[0]), Some(&c.d[1]), None);
    Backend::Cpu
        .run_fp8(&c.p, &c.q, &c.k, &c.v, &only_qk, &mut o1, Some(&mut l1))
        .unwrap();
    let r = check_fp8(&c.p, &c.q, &c.k, &c.v, &ds, &o1, Some(&l1)).unwrap();
    assert!(!r.passed() && r.lse_worst.unwrap() <= 1.0, "{r}");
    // One element off by 0.25: past the bound, which is about 0.1 here (rounding P to e4m3
    // costs the naive evaluation about 0.05 in O's largest error).
    let mut bad = o.clone();
    let i = bad.len() / 2;
    bad[i] = bf16::from_f32(bad[i].to_f32() + 0.25);
    let r = check_fp8(&c.p, &c.q, &c.k, &c.v, &ds, &bad, Some(&lse)).unwrap();
    assert!(!r.passed(), "{r}");
}

#[test]
fn the_api_takes_fp8_tensors_and_checks_its_arguments() {
    let c = fp8_case(1, 33, 2, 1, 32, &Options::new());
    let (qs, ks) = ([1, 33, 2, 32], [1, 33, 1, 32]);
    let q = Tensor::new(&c.q, &qs).unwrap();
    let k = Tensor::new(&c.k, &ks).unwrap();
    let v = Tensor::new(&c.v, &ks).unwrap();
    let ds = Descales::new(Some(&c.d[0]), Some(&c.d[1]), Some(&c.d[2]));
    let mut o = vec![bf16::NAN; 33 * 2 * 32];
    let mut lse = vec![f32::NAN; 66];
    let mut out = TensorMut::new(&mut o, &qs).unwrap();
    Backend::Cpu
        .forward_fp8(&q, &k, &v, &ds, &mut out, Some(&mut lse), &Options::new())
        .unwrap();
    let r = check_fp8(&c.p, &c.q, &c.k, &c.v, &ds, &o, Some(&lse)).unwrap();
    assert!(r.passed(), "{r}");

    let err = |e: fa4::Error| e.to_string();
    let short = [1.0f32];
    let mut out = TensorMut::new(&mut o, &qs).unwrap();
    let e = Backend::Cpu
        .forward_fp8(
            &q,
            &k,
            &v,
            &Descales::new(None, Some(&[1.0, 2.0]), None),
            &mut out,
            None,
            &Options::new(),
        )
        .unwrap_err();
    assert!(err(e.clone()).contains("`k_descale`"), "{e}");
    let e = Backend::Cpu
        .forward_fp8(
            &q,
            &k,
            &v,
            &Descales::new(Some(&[-1.0]), None, None),
            &mut out,
            None,
            &Options::new(),
        )
        .unwrap_err();
    assert!(
        err(e.clone()).contains("`q_descale`") && err(e.clone()).contains("greater than 0"),
        "{e}"
    );
    assert!(Backend::Cpu
        .forward_fp8(
            &q,
            &k,
            &v,
            &Descales::new(None, None, Some(&short)),
            &mut out,
            None,
            &Options::new()
        )
        .is_ok());
    // O in f32 is not an fp8 output type; a plain problem refuses fp8.
    let mut o32 = vec![0f32; 33 * 2 * 32];
    let mut out32 = TensorMut::new(&mut o32, &qs).unwrap();
    let e = Backend::Cpu
        .forward_fp8(&q, &k, &v, &ds, &mut out32, None, &Options::new())
        .unwrap_err();
    assert!(err(e.clone()).contains("`out`"), "{e}");
    let l = Layout::new("q", &qs, None).unwrap();
    let e = Problem::new(DType::Fp8E4M3, &l, &l, &l, &l, None, None, &Options::new()).unwrap_err();
    assert!(err(e.clone()).contains("new_fp8"), "{e}");
    // A 16-bit call on an fp8 problem is refused, not misread.
    let mut o16 = vec![bf16::NAN; 33 * 2 * 32];
    let x = vec![bf16::ONE; 33 * 2 * 32];
    let e = Backend::Cpu
        .run(&c.p, &x, &x[..33 * 32], &x[..33 * 32], &mut o16, None)
        .unwrap_err();
    assert!(err(e.clone()).contains("does not match"), "{e}");
}

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> TempDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "fa4-fp8-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    fn npy<T: npy::NpyElement>(&self, name: &str, shape: &[usize], data: &[T]) -> String {
        let p = self.0.join(name);
        npy::write(&p, "test", shape, data).unwrap();
        p.to_str().unwrap().to_string()
    }

    fn path(&self, name: &str) -> String {
        self.0.join(name).to_str().unwrap().to_string()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn run_on_fp8_files_writes_what_the_library_computes() {
    let c = fp8_case(2, 24, 4, 2, 16, &Options::new().causal());
    let t = TempDir::new();
    let bits = |x: &[F8E4M3]| x.iter().map(|e| e.to_bits()).collect::<Vec<u8>>();
    let q = t.npy("q.npy", &[2, 24, 4, 16], &bits(&c.q));
    let k = t.npy("k.npy", &[2, 24, 2, 16], &bits(&c.k));
    let v = t.npy("v.npy", &[2, 24, 2, 16], &bits(&c.v));
    let [dq, dk, dv] = [0, 1, 2].map(|i| t.npy(&format!("d{i}.npy"), &[2, 2], &c.d[i]));
    let (o, l) = (t.path("o.npy"), t.path("l.npy"));
    let args = [
        "run",
        "--dtype",
        "fp8",
        "--backend",
        "cpu",
        "--causal",
        "--q",
        &q,
        "--k",
        &k,
        "--v",
        &v,
        "--q-descale",
        &dq,
        "--k-descale",
        &dk,
        "--v-descale",
        &dv,
        "--out",
        &o,
        "--lse",
        &l,
    ];
    let (code, out, err) = fa4(&args);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("check    pass") && out.contains("from --q-descale"),
        "{out}"
    );
    // The file holds exactly the library's bf16 O, as float32.
    let ds = Descales::new(Some(&c.d[0]), Some(&c.d[1]), Some(&c.d[2]));
    let mut want = vec![bf16::NAN; c.p.o_layout().numel()];
    let mut lse = vec![f32::NAN; c.p.lse_len()];
    Backend::Cpu
        .run_fp8(&c.p, &c.q, &c.k, &c.v, &ds, &mut want, Some(&mut lse))
        .unwrap();
    let got = npy::read(std::path::Path::new(&o), "o").unwrap();
    assert_eq!(got.shape, vec![2, 24, 4, 16]);
    let Data::F32(got) = got.data else {
        panic!("float32 O")
    };
    assert!(got
        .iter()
        .zip(&want)
        .all(|(a, b)| a.to_bits() == b.to_f32().to_bits()));
    let Data::F32(gl) = npy::read(std::path::Path::new(&l), "l").unwrap().data else {
        panic!()
    };
    assert!(gl.iter().zip(&lse).all(|(a, b)| a.to_bits() == b.to_bits()));

    // Float files: fa4 quantizes them and says with what.
    let fq = t.npy("fq.npy", &[2, 24, 4, 16], &vec![0.5f32; 2 * 24 * 4 * 16]);
    let fk = t.npy("fk.npy", &[2, 24, 2, 16], &vec![-0.25f32; 2 * 24 * 2 * 16]);
    let o2 = t.path("o2.npy");
    let (code, out, err) = fa4(&[
        "run", "--dtype", "fp8", "--q", &fq, "--k", &fk, "--v", &fk, "--out", &o2,
    ]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("quantized by fa4") && out.contains("check    pass"),
        "{out}"
    );

    // Bad input: one line naming the flag, exit code 2, nothing written.
    let zero = t.npy("zero.npy", &[2, 2], &[1.0f32, 0.0, 1.0, 1.0]);
    let wrong = t.npy("wrong.npy", &[2, 3], &[1.0f32; 6]);
    let flat = t.npy("flat.npy", &[2, 24 * 4 * 16], &bits(&c.q));
    let o3 = t.path("o3.npy");
    for (extra, flag) in [
        (vec!["--q", &q, "--k", &fk, "--v", &v], "--k"),
        (
            vec!["--q", &q, "--k", &k, "--v", &v, "--v-descale", &zero],
            "--v-descale",
        ),
        (
            vec!["--q", &q, "--k", &k, "--v", &v, "--q-descale", &wrong],
            "--q-descale",
        ),
        (
            vec!["--q", &fq, "--k", &fk, "--v", &fk, "--k-descale", &dk],
            "--k-descale",
        ),
        (vec!["--q", &flat, "--k", &k, "--v", &v], "--q"),
        (
            vec!["--q", &q, "--k", &k, "--v", &v, "--out-dtype", "f32"],
            "--out-dtype",
        ),
        (
            vec!["--q", &q, "--k", &k, "--v", &v, "--backend", "cuda"],
            "--backend",
        ),
    ] {
        let mut a = vec!["run", "--dtype", "fp8", "--out", &o3];
        a.extend(extra);
        let (code, out, err) = fa4(&a);
        assert_eq!(code, 2, "{a:?}: {out}{err}");
        assert!(
            err.contains(&format!("`{flag}`")) && err.trim().lines().count() == 1,
            "{a:?}: {err}"
        );
        assert!(!std::path::Path::new(&o3).exists(), "{a:?}");
    }
    let (code, _, err) = fa4(&["run", "--q-descale", &dq]);
    assert!(code == 2 && err.contains("`--q-descale`"), "{err}");
}

#[test]
fn check_runs_the_fp8_matrix() {
    let (code, out, err) = fa4(&[
        "check",
        "--dtype",
        "fp8",
        "--head-dim",
        "40,96",
        "--backend",
        "cpu",
    ]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("26 passed, 0 failed") && out.contains("fp8 d=96"),
        "{out}"
    );
    let (code, _, err) = fa4(&["check", "--dtype", "fp8", "--backend", "cuda"]);
    assert!(code == 2 && err.contains("`--backend`"), "{err}");
}
