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
}

/// A random paged bf16 problem whose cache is quantized to e4m3 with per-KV-head amax scales.
struct PagedFp8 {
    x: fa4::paged::random::PagedInputs<bf16>,
    k8: Vec<F8E4M3>,
    v8: Vec<F8E4M3>,
    scales: [Vec<f32>; 2],
}

fn paged_fp8(spec: &fa4::paged::random::PagedSpec, seed: u64) -> PagedFp8 {
    let x = fa4::paged::random::random_paged::<bf16, _>(&mut StdRng::seed_from_u64(seed), spec)
        .unwrap();
    let (k8, ks) = fa4::paged::quantize_cache(&x.k_cache, spec.heads_kv, spec.head_dim);
    let (v8, vs) = fa4::paged::quantize_cache(&x.v_cache, spec.heads_kv, spec.head_dim_v);
    PagedFp8 {
        x,
        k8,
        v8,
        scales: [ks, vs],
    }
}

#[test]
fn an_fp8_paged_cache_on_the_cpu_matches_the_oracle() {
    use fa4::paged::random::PagedSpec;
    use fa4::paged::{reference, KvScales, PagedKv, PagedOptions};
    for (page_size, varlen, seqlens_q, splits) in [
        (1, false, vec![1, 1, 1], 1),
        (16, true, vec![1, 5, 3], 3),
        (64, false, vec![4, 4, 4], 2),
    ] {
        let spec = PagedSpec {
            seqlens_q,
            seqlens_k: vec![37, 5, 200],
            heads_q: 8,
            heads_kv: 2,
            head_dim: 64,
            head_dim_v: 64,
            page_size,
            varlen,
        };
        let c = paged_fp8(&spec, 11);
        let x = &c.x;
        let kv = PagedKv::new(
            Tensor::new(&c.k8, &x.k_shape).unwrap(),
            Tensor::new(&c.v8, &x.v_shape).unwrap(),
            &x.page_table,
            x.max_pages_per_seq,
            &x.seqlens_k,
        )
        .unwrap();
        let opts = Options::new().causal();
        let p = x.problem(&opts).unwrap();
        let scales = KvScales {
            k: &c.scales[0],
            v: &c.scales[1],
        };
        let mut o_shape = x.q_shape.clone();
        *o_shape.last_mut().unwrap() = 64;
        let run = |s: &KvScales| {
            let mut o = vec![bf16::NAN; p.o_layout().numel()];
            let mut lse = vec![f32::NAN; p.lse_len()];
            let plan = Backend::Cpu
                .forward_paged_fp8(
                    &Tensor::new(&x.q, &x.q_shape).unwrap(),
                    &kv,
                    s,
                    x.cu_seqlens_q.as_deref(),
                    &mut TensorMut::new(&mut o, &o_shape).unwrap(),
                    Some(&mut lse),
                    &PagedOptions::new(opts).num_splits(splits),
                )
                .unwrap();
            assert_eq!(plan.num_splits, splits);
            (o, lse)
        };
        let (o, lse) = run(&scales);
        let r = reference::check_fp8(&p, &x.q, &c.k8, &c.v8, &scales, &o, Some(&lse)).unwrap();
        assert!(r.passed(), "page {page_size}: {r}");
        // The same bytes read with the scales of the other head fail.
        let swapped = [c.scales[0][1], c.scales[0][0]];
        let (o2, l2) = run(&KvScales {
            k: &swapped,
            v: &c.scales[1],
        });
        let r = reference::check_fp8(&p, &x.q, &c.k8, &c.v8, &scales, &o2, Some(&l2)).unwrap();
        assert!(!r.passed(), "page {page_size}: swapped scales passed: {r}");
        // Scales are checked by name.
        let e = Backend::Cpu
            .forward_paged_fp8(
                &Tensor::new(&x.q, &x.q_shape).unwrap(),
                &kv,
                &KvScales {
                    k: &c.scales[0],
                    v: &[1.0, 0.0],
                },
                x.cu_seqlens_q.as_deref(),
                &mut TensorMut::new(&mut vec![bf16::NAN; p.o_layout().numel()], &o_shape).unwrap(),
                None,
                &PagedOptions::new(opts),
            )
            .unwrap_err();
        assert!(e.to_string().contains("`v_scale`"), "{e}");
    }
}

#[test]
fn append_quantizes_new_rows_with_the_scales() {
    use fa4::paged::{append_fp8, KvScales, PagedCache};
    // Two sequences of 3 and 0 keys in pages of 4, 2 KV heads of width 8.
    let (pages, ps, h, d) = (3, 4, 2, 8);
    let kl = Layout::new("k_cache", &[pages, ps, h, d], None).unwrap();
    let cache = PagedCache::new(&kl, &kl, &[0, 1, 2, -1], 2, &[3, 0]).unwrap();
    let mut k = vec![F8E4M3::from_bits(0x7F); pages * ps * h * d];
    let mut v = k.clone();
    let new: Vec<bf16> = (0..3 * h * d)
        .map(|i| bf16::from_f32((i as f32 - 20.0) * 0.37))
        .collect();
    let scales = KvScales {
        k: &[0.05, 0.5],
        v: &[1.0, 0.01],
    };
    let lens = append_fp8(&cache, &mut k, &mut v, &new, &new, &[0, 2, 3], &scales).unwrap();
    assert_eq!(lens, vec![5, 1]);
    // Sequence 0's rows land in slot 3 of page 0 and slot 0 of page 1; sequence 1's in page 2.
    for (row, (page, slot)) in [(0, (0, 3)), (1, (1, 0)), (2, (2, 0))] {
        for hh in 0..h {
            for c in 0..d {
                let x = new[(row * h + hh) * d + c].to_f32();
                let at = ((page * ps + slot) * h + hh) * d + c;
                assert_eq!(k[at], F8E4M3::from_f32(x / scales.k[hh]), "k row {row}");
                assert_eq!(v[at], F8E4M3::from_f32(x / scales.v[hh]), "v row {row}");
            }
        }
    }
    // Untouched slots keep their bytes; bad scales write nothing.
    assert_eq!(k[0].to_bits(), 0x7F);
    let bits = |x: &[F8E4M3]| x.iter().map(|e| e.to_bits()).collect::<Vec<u8>>();
    let before = bits(&k);
    let e = append_fp8(
        &cache,
        &mut k,
        &mut v,
        &new,
        &new,
        &[0, 2, 3],
        &KvScales {
            k: &[1.0],
            v: &[1.0, 1.0],
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("`k_scale`"), "{e}");
    assert!(bits(&k) == before, "a refused append wrote");
}

#[test]
fn run_over_an_fp8_paged_cache() {
    for page in ["1", "64"] {
        let (code, out, err) = fa4(&[
            "run",
            "--paged",
            "--kv-dtype",
            "fp8",
            "--page-size",
            page,
            "--seqlen-k",
            "150",
            "--seqlen-q",
            "2",
            "--causal",
            "--backend",
            "cpu",
        ]);
        assert_eq!(code, 0, "{out}{err}");
        assert!(
            out.contains("fp8 e4m3 cache") && out.contains("check    pass"),
            "{out}"
        );
    }
    for (args, flag) in [
        (&["run", "--paged", "--kv-dtype", "fp16"][..], "--kv-dtype"),
        (
            &["run", "--kv-dtype", "fp8", "--backend", "cpu"][..],
            "--kv-dtype",
        ),
        (
            &["run", "--paged", "--kv-dtype", "fp8", "--dtype", "fp8"][..],
            "--dtype",
        ),
    ] {
        let (code, _, err) = fa4(args);
        assert!(
            code == 2 && err.contains(&format!("`{flag}`")),
            "{args:?}: {err}"
        );
    }
}

#[test]
fn run_over_an_fp8_paged_cache_from_files() {
    use fa4::paged::random::PagedSpec;
    let spec = PagedSpec {
        seqlens_q: vec![2, 2],
        seqlens_k: vec![40, 17],
        heads_q: 4,
        heads_kv: 2,
        head_dim: 32,
        head_dim_v: 32,
        page_size: 8,
        varlen: false,
    };
    let c = paged_fp8(&spec, 5);
    let x = &c.x;
    let t = TempDir::new();
    let bits = |v: &[F8E4M3]| v.iter().map(|e| e.to_bits()).collect::<Vec<u8>>();
    let qf: Vec<f32> = x.q.iter().map(|e| e.to_f32()).collect();
    let q = t.npy("q.npy", &x.q_shape, &qf);
    let kc = t.npy("kc.npy", &x.k_shape, &bits(&c.k8));
    let vc = t.npy("vc.npy", &x.v_shape, &bits(&c.v8));
    let pt = t.npy("pt.npy", &[2, x.max_pages_per_seq], &x.page_table);
    let sk = t.npy("sk.npy", &[2], &x.seqlens_k);
    let (o, l) = (t.path("o.npy"), t.path("l.npy"));
    let ks = format!("{},{}", c.scales[0][0], c.scales[0][1]);
    let vs = format!("{},{}", c.scales[1][0], c.scales[1][1]);
    let base = [
        "run",
        "--backend",
        "cpu",
        "--dtype",
        "bf16",
        "--kv-dtype",
        "fp8",
        "--causal",
        "--q",
        &q,
        "--k-cache",
        &kc,
        "--v-cache",
        &vc,
        "--page-table",
        &pt,
        "--seqlens-k",
        &sk,
        "--out",
        &o,
    ];
    let mut args = base.to_vec();
    args.extend(["--lse", &l, "--k-scale", &ks, "--v-scale", &vs]);
    let (code, out, err) = fa4(&args);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("check    pass"), "{out}");
    assert!(std::path::Path::new(&o).exists() && std::path::Path::new(&l).exists());
    // O is the library's, to the bit (the scales went through as given).
    let mut want = vec![bf16::NAN; x.q.len()];
    let mut o_shape = x.q_shape.clone();
    *o_shape.last_mut().unwrap() = 32;
    Backend::Cpu
        .forward_paged_fp8(
            &Tensor::new(&x.q, &x.q_shape).unwrap(),
            &fa4::paged::PagedKv::new(
                Tensor::new(&c.k8, &x.k_shape).unwrap(),
                Tensor::new(&c.v8, &x.v_shape).unwrap(),
                &x.page_table,
                x.max_pages_per_seq,
                &x.seqlens_k,
            )
            .unwrap(),
            &fa4::paged::KvScales {
                k: &c.scales[0],
                v: &c.scales[1],
            },
            None,
            &mut TensorMut::new(&mut want, &o_shape).unwrap(),
            None,
            &fa4::paged::PagedOptions::new(Options::new().causal()),
        )
        .unwrap();
    let Data::F32(got) = npy::read(std::path::Path::new(&o), "o").unwrap().data else {
        panic!()
    };
    assert!(got
        .iter()
        .zip(&want)
        .all(|(a, b)| a.to_bits() == b.to_f32().to_bits()));
    // Bad scales are refused by name.
    for (extra, flag) in [
        (vec!["--k-scale", "1,2,3"], "--k-scale"),
        (vec!["--v-scale", "0"], "--v-scale"),
        (vec!["--v-scale", "x"], "--v-scale"),
        (vec!["--k-scale", "-1"], "--k-scale"),
        (vec!["--k-scale", "1e39"], "--k-scale"),
    ] {
        let mut a = base.to_vec();
        a.extend(extra);
        let (code, _, err) = fa4(&a);
        assert!(
            code == 2 && err.contains(flag) && err.trim().lines().count() == 1,
            "{a:?}: {err}"
        );
    }
    // A float cache with --kv-dtype fp8, and scales without it.
    let kf = t.npy("kf.npy", &x.k_shape, &vec![0.5f32; c.k8.len()]);
    let mut a = base.to_vec();
    a[11] = &kf;
    let (code, _, err) = fa4(&a);
    assert!(
        code == 2 && err.contains("`--k-cache`") && err.contains("uint8"),
        "{err}"
    );
    let (code, _, err) = fa4(&["run", "--paged", "--k-scale", "2"]);
    assert!(code == 2 && err.contains("`--k-scale`"), "{err}");
}

/// `paged::quantize_cache` (rows in parallel) against a serial reading of its rule: head h's scale
/// is its largest finite |x| / 448 (1 for a head with none: here head 2 holds only zeros, NaN and
/// infinities), and every byte is `x / scale[h]` rounded to e4m3. Thousands of rows, so rayon
/// splits them; the heads' magnitudes are 2^±10 apart, so a scale taken from the wrong head shows.
#[test]
fn quantize_cache_takes_each_heads_largest_finite_magnitude() {
    use rand::Rng;
    let (rows, heads, width) = (3001, 3, 8);
    let mut rng = StdRng::seed_from_u64(29);
    let cache: Vec<bf16> = (0..rows * heads * width)
        .map(|i| {
            let h = (i / width) % heads;
            let x = match h {
                0 => rng.random_range(-1.0f32..1.0) * 1024.0,
                1 => rng.random_range(-1.0f32..1.0) / 1024.0,
                _ => [0.0, f32::NAN, f32::INFINITY, -f32::INFINITY][i % 4],
            };
            bf16::from_f32(x)
        })
        .collect();
    let mut amax = [0f32; 3];
    for (i, e) in cache.iter().enumerate() {
        let x = e.to_f32();
        if x.is_finite() {
            let h = (i / width) % heads;
            amax[h] = amax[h].max(x.abs());
        }
    }
    let (bytes, scales) = fa4::paged::quantize_cache(&cache, heads, width);
    assert_eq!(scales.len(), heads);
    assert_eq!(scales[0], amax[0] / 448.0);
    assert_eq!(scales[1], amax[1] / 448.0);
    assert!(scales[0] > 1.0 && scales[1] < 1e-3, "{scales:?}");
    assert_eq!(scales[2], 1.0);
    assert_eq!(bytes.len(), cache.len());
    for (i, (b, e)) in bytes.iter().zip(&cache).enumerate() {
        let want = F8E4M3::from_f32(e.to_f32() / scales[(i / width) % heads]);
        assert_eq!(b.to_bits(), want.to_bits(), "element {i}: {e}");
    }
}
