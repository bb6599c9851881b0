//! `fa4 run --dtype fp8`: fp8 e4m3 inputs (`docs/attention.md`, "FP8 (e4m3) inputs") on a
//! Hopper GPU (the e4m3 kernel) or the CPU backend, checked against the float64 oracle of the
//! dequantized inputs.
//!
//! Random problems draw the usual float inputs and quantize them with per-(sequence, KV head)
//! amax scales. Files: Q, K and V either all uint8 (e4m3 bytes; descales from `--q-descale`,
//! `--k-descale`, `--v-descale`, f32 `[sequences, heads_kv]`, default ones) or all float (fa4
//! quantizes them and reports the descales it chose). O (bf16, or fp16 with `--out-dtype`) is
//! written as float32, LSE as float32.

use fa4::fp8::{check_descale, quantize, Descales, Operand, F8E4M3};

use super::*;

/// The descale files and O's type (`--dtype fp8` only).
#[derive(Args, Debug, Default)]
pub struct Fp8Args {
    /// Q's descales for uint8 (e4m3) inputs: float32 .npy of shape [sequences, heads_kv]
    /// [default: ones].
    #[arg(long, value_name = "QD.npy", help_heading = "fp8 (--dtype fp8)")]
    q_descale: Option<PathBuf>,
    /// K's descales, as --q-descale.
    #[arg(long, value_name = "KD.npy", help_heading = "fp8 (--dtype fp8)")]
    k_descale: Option<PathBuf>,
    /// V's descales, as --q-descale.
    #[arg(long, value_name = "VD.npy", help_heading = "fp8 (--dtype fp8)")]
    v_descale: Option<PathBuf>,
    /// O's storage type for fp8 inputs: bf16 or fp16 [default: bf16].
    #[arg(long, value_name = "DTYPE", help_heading = "fp8 (--dtype fp8)")]
    out_dtype: Option<DType>,
}

impl Fp8Args {
    fn given(&self) -> [(&'static str, bool); 4] {
        [
            ("--q-descale", self.q_descale.is_some()),
            ("--k-descale", self.k_descale.is_some()),
            ("--v-descale", self.v_descale.is_some()),
            ("--out-dtype", self.out_dtype.is_some()),
        ]
    }

    /// Refuses these flags on a run that is not fp8.
    pub(super) fn refuse(&self) -> Result<()> {
        refuse_given(&self.given(), "belongs to --dtype fp8")
    }
}

/// Q, K, V in e4m3 with their descales, contiguous, and the problem.
struct Inputs {
    p: Problem,
    q: Vec<F8E4M3>,
    k: Vec<F8E4M3>,
    v: Vec<F8E4M3>,
    /// `[sequences, heads_kv]` each (ones where none was given).
    descales: [Vec<f32>; 3],
    /// The line that says where the descales came from.
    origin: String,
}

impl Inputs {
    fn descales(&self) -> Descales<'_> {
        let [q, k, v] = &self.descales;
        Descales::new(Some(q), Some(k), Some(v))
    }
}

pub(super) fn run(
    args: &RunArgs,
    backend: BackendArg,
    opts: &Options,
    policy: CheckPolicy,
) -> Result<ExitCode> {
    if let Some(flag) = args.grad.first_given() {
        return Err(Error::invalid(
            flag,
            "fp8 inputs have no backward; drop --dtype fp8 or the backward flags",
        ));
    }
    if args.cp.cp.is_some() {
        return Err(Error::invalid(
            "--cp",
            "the context-parallel ring does not take fp8 inputs",
        ));
    }
    let out = match args.fp8.out_dtype.unwrap_or(DType::Bf16) {
        t @ (DType::Bf16 | DType::F16) => t,
        t => {
            return Err(Error::invalid(
                "--out-dtype",
                format!("O of fp8 inputs is bf16 or fp16, not {t}"),
            ))
        }
    };
    let inputs = if args.q.is_some() || args.k.is_some() || args.v.is_some() {
        files(args, opts, out)?
    } else {
        random(args, opts, out)?
    };
    // fp8 runs on Hopper GPUs (the e4m3 kernel) and the CPU: `--backend auto` on another GPU
    // takes the CPU, `--backend cuda` there is refused by the planner naming `dtype`. Resolved
    // after the inputs, so that a bad input's error is the only line.
    let cpu = match backend.resolve()? {
        b @ Backend::Cuda(_) if backend == BackendArg::Cuda || hopper(&b) => b,
        Backend::Cuda(_) => {
            eprintln!("fa4: fp8 runs on Hopper GPUs and the CPU: on the CPU");
            Backend::Cpu
        }
        b => b,
    };

    match out {
        DType::F16 => execute::<f16>(args, &cpu, &inputs, policy),
        _ => execute::<bf16>(args, &cpu, &inputs, policy),
    }
}

/// Whether `b` is a Hopper GPU, where the e4m3 kernel runs.
pub(crate) fn hopper(b: &Backend) -> bool {
    matches!(b, Backend::Cuda(c) if c.info().arch.family == fa4::arch::Family::Hopper)
}

fn random(args: &RunArgs, opts: &Options, out: DType) -> Result<Inputs> {
    refuse_given(
        &[
            ("--cu-seqlens-q", args.cu_seqlens_q.is_some()),
            ("--cu-seqlens-k", args.cu_seqlens_k.is_some()),
            ("--out", args.out.is_some()),
            ("--lse", args.lse.is_some()),
            ("--q-descale", args.fp8.q_descale.is_some()),
            ("--k-descale", args.fp8.k_descale.is_some()),
            ("--v-descale", args.fp8.v_descale.is_some()),
        ],
        "belongs to a run on files; give --q, --k and --v too",
    )?;
    let b = args.batch.unwrap_or(1);
    let sq = args.seqlen_q.unwrap_or(DEFAULT_SEQLEN);
    let sk = args.seqlen_k.unwrap_or(sq);
    let hq = args.heads_q.unwrap_or(DEFAULT_HEADS);
    let hkv = args.heads_kv.unwrap_or(hq);
    let d = args.head_dim.unwrap_or(DEFAULT_HEAD_DIM);
    let dv = args.head_dim_v.unwrap_or(d);
    if hq == 0 {
        return Err(Error::invalid("--heads-q", "must be at least 1"));
    }
    if hkv == 0 || !hq.is_multiple_of(hkv) {
        return Err(Error::invalid(
            "--heads-kv",
            format!("{hkv} must be at least 1 and divide --heads-q {hq} (GQA/MQA)"),
        ));
    }
    for (flag, x) in [("--head-dim", d), ("--head-dim-v", dv)] {
        if !(1..=MAX_HEAD_DIM).contains(&x) {
            return Err(Error::invalid(
                flag,
                format!("{x} is outside 1..={MAX_HEAD_DIM}"),
            ));
        }
    }
    // The float draws (4 bytes), their bytes, O and its f32 copy, LSE.
    let (bf, sqf, skf, hqf, hkvf) = (b as f64, sq as f64, sk as f64, hq as f64, hkv as f64);
    let bytes = 5.0 * bf * (sqf * hqf * (d + dv) as f64 + skf * hkvf * (d + dv) as f64)
        + 4.0 * bf * hqf * sqf;
    memory::ensure("--seqlen-q", "the problem", bytes)?;
    let shapes = Shapes {
        q: vec![b, sq, hq, d],
        k: vec![b, sk, hkv, d],
        v: vec![b, sk, hkv, dv],
    };
    let p = shapes.problem_fp8(out, None, opts).map_err(|e| {
        flag_named(
            e,
            &[
                ("q", "--seqlen-q"),
                ("k", "--heads-kv"),
                ("v", "--head-dim-v"),
                ("out", "--seqlen-q"),
            ],
        )
    })?;
    let mut rng = StdRng::seed_from_u64(args.seed.unwrap_or(0));
    let mut q = alloc("q", p.q_layout().numel(), f32::NAN)?;
    let mut k = alloc("k", p.k_layout().numel(), f32::NAN)?;
    let mut v = alloc("v", p.v_layout().numel(), f32::NAN)?;
    check::random_qkv(&mut rng, &mut q, &mut k, &mut v, d, dv);
    quantized(p, [q, k, v])
}

/// Quantizes float inputs with per-(sequence, KV head) amax scales.
fn quantized(p: Problem, [q, k, v]: [Vec<f32>; 3]) -> Result<Inputs> {
    let (q8, dq) = quantize(&p, Operand::Q, "--q", &q)?;
    drop(q);
    let (k8, dk) = quantize(&p, Operand::K, "--k", &k)?;
    drop(k);
    let (v8, dv) = quantize(&p, Operand::V, "--v", &v)?;
    let origin = format!(
        "quantized by fa4, per (sequence, KV head) amax / 448: q_descale {}, k_descale {}, v_descale {}",
        span(&dq),
        span(&dk),
        span(&dv)
    );
    Ok(Inputs {
        p,
        q: q8,
        k: k8,
        v: v8,
        descales: [dq, dk, dv],
        origin,
    })
}

/// `0.0061` for one value, else `0.0052..0.0093 (N values)`.
fn span(d: &[f32]) -> String {
    let lo = d.iter().copied().fold(f32::INFINITY, f32::min);
    let hi = d.iter().copied().fold(0f32, f32::max);
    match d.len() {
        0 => "none".into(),
        1 => format!("{lo:.4e}"),
        n => format!("{lo:.4e}..{hi:.4e} ({n} values)"),
    }
}

fn files(args: &RunArgs, opts: &Options, out: DType) -> Result<Inputs> {
    refuse_given(
        &args.random_flags(),
        "describes a random problem; with --q/--k/--v the shapes come from the files",
    )?;
    let need = |flag: &str, path: &Option<PathBuf>| {
        path.clone()
            .ok_or_else(|| Error::invalid(flag, "is required: Q, K and V come from files together"))
    };
    let (qp, kp, vp) = (
        need("--q", &args.q)?,
        need("--k", &args.k)?,
        need("--v", &args.v)?,
    );
    let outp = need("--out", &args.out)?;
    let cu_paths = match (&args.cu_seqlens_q, &args.cu_seqlens_k) {
        (None, None) => None,
        (Some(cq), Some(ck)) => Some((cq, ck)),
        (Some(_), None) => {
            return Err(Error::invalid(
                "--cu-seqlens-k",
                "is required with --cu-seqlens-q",
            ))
        }
        (None, Some(_)) => {
            return Err(Error::invalid(
                "--cu-seqlens-q",
                "is required with --cu-seqlens-k",
            ))
        }
    };
    let f = &args.fp8;
    let mut inputs: Vec<(&str, &Path)> = vec![("--q", &qp), ("--k", &kp), ("--v", &vp)];
    if let Some((cq, ck)) = cu_paths {
        inputs.push(("--cu-seqlens-q", cq));
        inputs.push(("--cu-seqlens-k", ck));
    }
    for (flag, path) in [
        ("--q-descale", &f.q_descale),
        ("--k-descale", &f.k_descale),
        ("--v-descale", &f.v_descale),
    ] {
        if let Some(path) = path {
            inputs.push((flag, path));
        }
    }
    let mut outputs: Vec<(&str, &Path)> = vec![("--out", &outp)];
    if let Some(l) = &args.lse {
        outputs.push(("--lse", l));
    }
    distinct_outputs(&inputs, &outputs)?;

    const TYPES: [NpyDType; 3] = [NpyDType::U8, NpyDType::F32, NpyDType::F16];
    let qa = npy::read_as(&qp, "--q", &TYPES)?;
    let ka = npy::read_as(&kp, "--k", &TYPES)?;
    let va = npy::read_as(&vp, "--v", &TYPES)?;
    let bytes_in = qa.dtype() == NpyDType::U8;
    for (flag, a) in [("--k", &ka), ("--v", &va)] {
        if (a.dtype() == NpyDType::U8) != bytes_in {
            return Err(Error::invalid(
                flag,
                format!(
                    "is {} but --q is {}: give Q, K and V all as uint8 e4m3 bytes, or all as floats \
                     for fa4 to quantize",
                    a.dtype(),
                    qa.dtype()
                ),
            ));
        }
    }
    let cu = match cu_paths {
        None => None,
        Some((cq, ck)) => Some((
            cu_seqlens(cq, "--cu-seqlens-q")?,
            cu_seqlens(ck, "--cu-seqlens-k")?,
        )),
    };
    let rank = if cu.is_some() { 3 } else { 4 };
    for (flag, path, a) in [("--q", &qp, &qa), ("--k", &kp, &ka), ("--v", &vp, &va)] {
        if a.shape.len() != rank {
            return Err(Error::invalid(
                flag,
                format!(
                    "`{}` has shape {:?}; expected [batch, seqlen, heads, dim], or [total, heads, dim] \
                     with --cu-seqlens-q and --cu-seqlens-k",
                    path.display(),
                    a.shape
                ),
            ));
        }
    }
    let shapes = Shapes {
        q: qa.shape.clone(),
        k: ka.shape.clone(),
        v: va.shape.clone(),
    };
    let cu_ref = cu.as_ref().map(|(a, b)| (a.as_slice(), b.as_slice()));
    let p = shapes.problem_fp8(out, cu_ref, opts).map_err(|e| {
        flag_named(
            e,
            &[
                ("q", "--q"),
                ("k", "--k"),
                ("v", "--v"),
                ("out", "--out"),
                ("cu_seqlens_q", "--cu-seqlens-q"),
                ("cu_seqlens_k", "--cu-seqlens-k"),
            ],
        )
    })?;
    let inputs = if bytes_in {
        let bytes = |a: Array| match a.data {
            Data::U8(x) => x.into_iter().map(F8E4M3::from_bits).collect::<Vec<_>>(),
            _ => unreachable!("checked to be uint8"),
        };
        let n = p.sequences().len() * p.heads_kv();
        let mut descales = [vec![1f32; n], vec![1f32; n], vec![1f32; n]];
        let mut from = Vec::new();
        for (i, (flag, path)) in [
            ("--q-descale", &f.q_descale),
            ("--k-descale", &f.k_descale),
            ("--v-descale", &f.v_descale),
        ]
        .into_iter()
        .enumerate()
        {
            if let Some(path) = path {
                descales[i] = read_descale(path, flag, &p)?;
                from.push(flag);
            }
        }
        let origin = if from.is_empty() {
            "ones (no --q-descale, --k-descale or --v-descale given)".to_string()
        } else {
            format!("from {} (ones for the others)", from.join(", "))
        };
        Inputs {
            q: bytes(qa),
            k: bytes(ka),
            v: bytes(va),
            p,
            descales,
            origin,
        }
    } else {
        if let Some((flag, _)) = f.given()[..3].iter().find(|(_, g)| *g) {
            return Err(Error::invalid(
                *flag,
                "given with float --q/--k/--v, which fa4 quantizes with descales of its own; \
                 give uint8 e4m3 files to use yours",
            ));
        }
        let floats = |a: Array| match a.data {
            Data::F32(x) => x,
            Data::F16(x) => x.into_iter().map(f16::to_f32).collect(),
            _ => unreachable!("checked to be float"),
        };
        quantized(p, [floats(qa), floats(ka), floats(va)])?
    };
    Ok(inputs)
}

/// A descale file: float32 `[sequences, heads_kv]`, each entry finite and > 0.
fn read_descale(path: &Path, flag: &str, p: &Problem) -> Result<Vec<f32>> {
    let a = npy::read_as(path, flag, &[NpyDType::F32])?;
    let want = [p.sequences().len(), p.heads_kv()];
    if a.shape != want {
        return Err(Error::invalid(
            flag,
            format!(
                "`{}` has shape {:?}; expected [sequences, heads_kv] = {want:?}",
                path.display(),
                a.shape
            ),
        ));
    }
    let Data::F32(d) = a.data else {
        unreachable!("read_as admits only float32")
    };
    check_descale(flag, &d, want[0] * want[1])?;
    Ok(d)
}

fn execute<O: Element>(
    args: &RunArgs,
    cpu: &Backend,
    x: &Inputs,
    policy: CheckPolicy,
) -> Result<ExitCode> {
    let p = &x.p;
    // The oracle and the fp8 naive evaluation: as for 16-bit storage.
    let skip = skip_reason(policy, p.flops());
    let mut o = alloc("out", p.o_layout().numel(), O::NAN)?;
    let mut lse = alloc("lse", p.lse_len(), f32::NAN)?;
    let threads = rayon::current_num_threads();
    let progress = Progress::start(
        if matches!(cpu, Backend::Cuda(_)) {
            "computing attention on the GPU"
        } else {
            "computing attention on the CPU"
        },
        p.flops() / (CPU_FLOPS_PER_THREAD_S * threads as f64),
        0,
    );
    let t0 = Instant::now();
    let result = cpu.run_fp8(p, &x.q, &x.k, &x.v, &x.descales(), &mut o, Some(&mut lse));
    let elapsed = t0.elapsed();
    progress.finish();
    result?;
    let mut wrote = Vec::new();
    if let Some(path) = &args.out {
        let dims = &p.o_layout().dims;
        let shape = if p.is_varlen() {
            dims[1..].to_vec()
        } else {
            dims.to_vec()
        };
        let of: Vec<f32> = o.iter().map(|e| e.to_f32()).collect();
        let mut staged = vec![npy::stage(path, "--out", &shape, &of)?];
        wrote.push(format!(
            "O {shape:?} ({} values) as float32 to `{}`",
            O::DTYPE,
            path.display()
        ));
        if let Some(l) = &args.lse {
            let ls = p.lse_shape();
            staged.push(npy::stage(l, "--lse", &ls, &lse)?);
            wrote.push(format!("LSE {ls:?} float32 to `{}`", l.display()));
        }
        for s in staged {
            s.commit()?;
        }
    }
    let gflop = p.flops() / 1e9;
    println!(
        "problem  {}, O {} ({gflop:.3} GFLOP)",
        describe(p),
        O::DTYPE
    );
    println!("descales {}", x.origin);
    println!("backend  {}", backend_name(cpu));
    let secs = elapsed.as_secs_f64();
    let rate = if secs > 0.0 && gflop > 0.0 {
        format!("{} GFLOP/s", three_digits(gflop / secs))
    } else {
        "n/a GFLOP/s".into()
    };
    println!("time     {:.3} ms, {rate} (one call)", secs * 1e3);
    for w in &wrote {
        println!("wrote    {w}");
    }
    if let Some(why) = skip {
        println!("check    {why}");
        return Ok(ExitCode::SUCCESS);
    }
    let t0 = Instant::now();
    let report = check::check_fp8(p, &x.q, &x.k, &x.v, &x.descales(), &o, Some(&lse))?;
    println!(
        "check    {report} (float64 oracle, {:.2} s)",
        t0.elapsed().as_secs_f64()
    );
    Ok(if report.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
