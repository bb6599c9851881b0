//! `fa4 run`: attention on a random problem, checked against the float64 oracle, or on Q, K and
//! V read from `.npy` files, with O and LSE written to `.npy` files.
//!
//! Both forms print the problem, the backend, the time of one call and GFLOP/s (FLOPs from
//! [`Problem::flops`]), then the check's verdict ([`fa4::check::Report`]) or why it was skipped.
//! A failed check exits with code 1; any error is one line and code 2.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::SeedableRng;

use fa4::npy::{self, Array, Data, NpyDType};
use fa4::problem::MAX_HEAD_DIM;
use fa4::tensor::Layout;
use fa4::{check, Backend, DType, Element, Error, Mask, Options, Problem, Result};

use super::memory;
use super::progress::{Progress, ORACLE_MACS_PER_THREAD_S};
use super::BackendArg;

#[path = "decode.rs"]
mod decode;
#[path = "run_fp8.rs"]
pub(super) mod fp8run;

/// The check runs unless told otherwise when the oracle costs at most this many multiply-adds
/// (the float64 pass, plus the storage-precision pass for 16-bit dtypes). Measured on a 2-core
/// machine: about 1e9 multiply-adds per second per core, so the limit is under 3 s there (the
/// default bf16 problem, 4.3e9, checks in 2.2 s) and well under a second on a workstation.
const CHECK_LIMIT_MACS: f64 = 5e9;

/// Defaults of a random problem: one FlashAttention-sized head configuration (d = 128) at a
/// sequence length the CPU finishes in well under a second and the oracle checks in seconds.
const DEFAULT_SEQLEN: usize = 1024;
const DEFAULT_HEADS: usize = 8;
const DEFAULT_HEAD_DIM: usize = 128;

/// FLOP/s per thread assumed for the CPU backend's time estimate: `docs/perf.md` measures 75–90
/// per thread at d = 128 and long sequences (2 threads, AVX-512); small heads and short or
/// memory-bound problems run well below that, so the estimate assumes about half.
const CPU_FLOPS_PER_THREAD_S: f64 = 40e9;

#[derive(Args, Debug)]
pub struct RunArgs {
    /// Batch size [default: 1].
    #[arg(long, allow_negative_numbers = true, help_heading = "Random problem")]
    batch: Option<usize>,
    /// Query rows per sequence [default: 1024].
    #[arg(long, allow_negative_numbers = true, help_heading = "Random problem")]
    seqlen_q: Option<usize>,
    /// Key rows per sequence [default: --seqlen-q].
    #[arg(long, allow_negative_numbers = true, help_heading = "Random problem")]
    seqlen_k: Option<usize>,
    /// Query heads [default: 8].
    #[arg(long, allow_negative_numbers = true, help_heading = "Random problem")]
    heads_q: Option<usize>,
    /// KV heads, dividing --heads-q (GQA/MQA) [default: --heads-q].
    #[arg(long, allow_negative_numbers = true, help_heading = "Random problem")]
    heads_kv: Option<usize>,
    /// Head dimension of Q and K [default: 128].
    #[arg(long, allow_negative_numbers = true, help_heading = "Random problem")]
    head_dim: Option<usize>,
    /// Head dimension of V and O [default: --head-dim].
    #[arg(long, allow_negative_numbers = true, help_heading = "Random problem")]
    head_dim_v: Option<usize>,
    /// Seed of the random inputs (standard normal, a few rows scaled up) [default: 0].
    #[arg(long, allow_negative_numbers = true, help_heading = "Random problem")]
    seed: Option<u64>,

    /// Q, float32 or float16 .npy: [batch, seqlen_q, heads_q, head_dim], or
    /// [total_q, heads_q, head_dim] with --cu-seqlens-q/k.
    #[arg(long, value_name = "Q.npy", help_heading = "Inputs from files")]
    q: Option<PathBuf>,
    /// K: [batch, seqlen_k, heads_kv, head_dim] or [total_k, heads_kv, head_dim].
    #[arg(long, value_name = "K.npy", help_heading = "Inputs from files")]
    k: Option<PathBuf>,
    /// V: [batch, seqlen_k, heads_kv, head_dim_v] or [total_k, heads_kv, head_dim_v].
    #[arg(long, value_name = "V.npy", help_heading = "Inputs from files")]
    v: Option<PathBuf>,
    /// Varlen query offsets, int32 .npy [batch + 1]: 0, non-decreasing, ending at total_q.
    #[arg(long, value_name = "CU.npy", help_heading = "Inputs from files")]
    cu_seqlens_q: Option<PathBuf>,
    /// Varlen key offsets, int32 .npy [batch + 1]: 0, non-decreasing, ending at total_k.
    #[arg(long, value_name = "CU.npy", help_heading = "Inputs from files")]
    cu_seqlens_k: Option<PathBuf>,
    /// Where O is written (required with --q): float32 .npy, Q's shape with head_dim_v.
    #[arg(long, value_name = "O.npy", help_heading = "Inputs from files")]
    out: Option<PathBuf>,
    /// Where LSE is written: float32 .npy, [batch, heads_q, seqlen_q] or [heads_q, total_q].
    #[arg(long, value_name = "LSE.npy", help_heading = "Inputs from files")]
    lse: Option<PathBuf>,

    /// Storage dtype: f32, fp16, bf16 or fp8 (e4m3 inputs, O in bf16 or --out-dtype; uint8
    /// files hold e4m3 bytes, float files are quantized); file inputs are rounded to it
    /// [default: bf16 for a random problem, the files' dtype otherwise].
    #[arg(long)]
    dtype: Option<DType>,
    /// Causal mask, aligned to the bottom-right corner (the window -1,0).
    #[arg(long)]
    causal: bool,
    /// Local window: LEFT keys before the diagonal and RIGHT after; -1 is unbounded.
    #[arg(long, value_name = "LEFT,RIGHT", allow_hyphen_values = true, value_parser = parse_window)]
    window: Option<Mask>,
    /// Softcap: scores become X·tanh(s/X); X > 0.
    #[arg(long, value_name = "X", allow_hyphen_values = true)]
    softcap: Option<f32>,
    /// Score scale, finite [default: 1/sqrt(head_dim)].
    #[arg(long, value_name = "X", allow_hyphen_values = true)]
    scale: Option<f32>,
    /// Where attention is computed.
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    backend: BackendArg,
    /// Check against the float64 oracle even when it is expensive.
    #[arg(long, conflicts_with = "no_check")]
    check: bool,
    /// Skip the check against the float64 oracle.
    #[arg(long)]
    no_check: bool,
    /// Worker threads of the CPU backend and of the float64 oracle [default: all cores].
    #[arg(long, allow_negative_numbers = true)]
    threads: Option<usize>,
    /// Decode over a paged KV cache (`src/cli/decode.rs`).
    #[command(flatten)]
    paged: decode::PagedRunArgs,
    /// The backward pass (`src/cli/backward.rs`).
    #[command(flatten)]
    grad: super::backward::GradArgs,
    /// Context parallelism (`--cp N`, `--cp-split`).
    #[command(flatten)]
    cp: super::cp::CpArgs,
    /// fp8 inputs' descales and O's type (`src/cli/run_fp8.rs`).
    #[command(flatten)]
    fp8: fp8run::Fp8Args,
}

impl RunArgs {
    /// The flags that describe a random problem, and whether each was given (a run on files
    /// refuses them: its shapes come from the files).
    pub(super) fn random_flags(&self) -> [(&'static str, bool); 8] {
        [
            ("--batch", self.batch.is_some()),
            ("--seqlen-q", self.seqlen_q.is_some()),
            ("--seqlen-k", self.seqlen_k.is_some()),
            ("--heads-q", self.heads_q.is_some()),
            ("--heads-kv", self.heads_kv.is_some()),
            ("--head-dim", self.head_dim.is_some()),
            ("--head-dim-v", self.head_dim_v.is_some()),
            ("--seed", self.seed.is_some()),
        ]
    }
}

/// Parses `LEFT,RIGHT`, each ≥ 0 or -1 (unbounded).
pub(super) fn parse_window(s: &str) -> std::result::Result<Mask, String> {
    let parts: Vec<&str> = s.split(',').map(str::trim).collect();
    let [l, r] = parts.as_slice() else {
        return Err(format!(
            "expected LEFT,RIGHT (two integers, -1 = unbounded), got `{s}`"
        ));
    };
    let side = |x: &str| match (x, x.parse::<usize>()) {
        ("-1", _) => Ok(None),
        (_, Ok(v)) => Ok(Some(v)),
        _ => Err(format!(
            "window sides are integers from 0 to {} or -1 (unbounded), got `{x}`",
            usize::MAX
        )),
    };
    Ok(Mask::Window {
        left: side(l)?,
        right: side(r)?,
    })
}

/// Whether to compare with the oracle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum CheckPolicy {
    /// When it costs at most [`CHECK_LIMIT_MACS`].
    Affordable,
    Always,
    Never,
}

/// Multiply-adds the check costs: the float64 oracle, plus the storage-precision evaluation the
/// 16-bit tolerance is measured against. Both visit each allowed (query, key) pair once per head
/// with `head_dim + head_dim_v` multiply-adds, which is half of [`Problem::flops`].
fn check_cost(p: &Problem) -> f64 {
    let passes = if p.dtype() == DType::F32 { 1.0 } else { 2.0 };
    passes * p.flops() / 2.0
}

/// `None` to run the check, or why it is skipped.
pub(super) fn skip_reason(policy: CheckPolicy, cost: f64) -> Option<String> {
    match policy {
        CheckPolicy::Always => None,
        CheckPolicy::Never => Some("skipped (--no-check)".into()),
        CheckPolicy::Affordable if cost <= CHECK_LIMIT_MACS => None,
        CheckPolicy::Affordable => Some(format!(
            "skipped: the float64 oracle would take {cost:.2e} multiply-adds (limit \
             {CHECK_LIMIT_MACS:.0e}); --check runs it anyway"
        )),
    }
}

pub fn run(args: RunArgs) -> Result<ExitCode> {
    super::with_threads(args.threads, || run_in_pool(args))
}

fn run_in_pool(args: RunArgs) -> Result<ExitCode> {
    // The backend is resolved once the arguments are known to be good, just before the work:
    // `--backend auto`'s account of its choice is then never printed beside a usage error.
    let backend = args.backend;
    let fp8 = args.dtype == Some(DType::Fp8E4M3);
    if !fp8 {
        args.fp8.refuse()?;
    }
    if fp8 && args.paged.wanted() {
        return Err(Error::invalid(
            "--dtype",
            "fp8 queries over a paged cache are not computed yet (the paged run takes bf16, fp16 \
             or f32)",
        ));
    }
    let mut opts = Options::new();
    match (args.causal, args.window) {
        (true, Some(_)) => {
            return Err(Error::invalid(
                "--window",
                "given with --causal; causal is the window -1,0, so give one of them \
                 (e.g. --window LEFT,0 for a causal local window)",
            ))
        }
        (true, None) => opts = opts.causal(),
        (false, Some(w)) => opts = opts.mask(w),
        (false, None) => {}
    }
    if let Some(c) = args.softcap {
        opts = opts.softcap(c);
    }
    if let Some(s) = args.scale {
        opts = opts.scale(s);
    }
    if let Some(s) = args.scale {
        if !s.is_finite() {
            return Err(Error::invalid(
                "--scale",
                format!("must be finite, got {s}"),
            ));
        }
    }
    let policy = match (args.check, args.no_check) {
        (true, _) => CheckPolicy::Always,
        (_, true) => CheckPolicy::Never,
        _ => CheckPolicy::Affordable,
    };
    if fp8 {
        return fp8run::run(&args, backend, &opts, policy);
    }
    if args.cp.cp.is_some() {
        if let Some(flag) = args.grad.first_given() {
            return Err(Error::invalid(
                flag,
                "the context-parallel ring (--cp) has no backward yet; drop --cp or the \
                 backward flags",
            ));
        }
    }
    if args.paged.wanted() {
        if let Some(flag) = args.grad.first_given() {
            return Err(Error::invalid(
                flag,
                "the paged (decode) run has no backward; drop the backward flags or the paged ones",
            ));
        }
        if args.cp.cp.is_some() {
            return Err(Error::invalid(
                "--cp",
                "belongs to a contiguous run; the paged (decode) run has no context parallelism",
            ));
        }
        return decode::run(&args, &backend.resolve()?, &opts, policy);
    }
    if args.q.is_some() || args.k.is_some() || args.v.is_some() {
        from_files(&args, backend, &opts, policy)
    } else {
        random(&args, backend, &opts, policy)
    }
}

// ---- random problems ------------------------------------------------------------------------

fn random(
    args: &RunArgs,
    backend: BackendArg,
    opts: &Options,
    policy: CheckPolicy,
) -> Result<ExitCode> {
    refuse_given(
        &[
            ("--cu-seqlens-q", args.cu_seqlens_q.is_some()),
            ("--cu-seqlens-k", args.cu_seqlens_k.is_some()),
            ("--out", args.out.is_some()),
            ("--lse", args.lse.is_some()),
        ],
        "belongs to a run on files; give --q, --k and --v too",
    )?;
    args.grad.validate(false)?;
    let b = args.batch.unwrap_or(1);
    let sq = args.seqlen_q.unwrap_or(DEFAULT_SEQLEN);
    let sk = args.seqlen_k.unwrap_or(sq);
    let hq = args.heads_q.unwrap_or(DEFAULT_HEADS);
    let hkv = args.heads_kv.unwrap_or(hq);
    let d = args.head_dim.unwrap_or(DEFAULT_HEAD_DIM);
    let dv = args.head_dim_v.unwrap_or(d);
    let seed = args.seed.unwrap_or(0);
    let dtype = args.dtype.unwrap_or(DType::Bf16);
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
    // The flag to blame for a size nothing can hold: the largest one given.
    let size_flag = [
        ("--batch", args.batch),
        ("--seqlen-q", args.seqlen_q),
        ("--seqlen-k", args.seqlen_k),
        ("--heads-q", args.heads_q),
        ("--heads-kv", args.heads_kv),
        ("--head-dim", args.head_dim),
        ("--head-dim-v", args.head_dim_v),
    ]
    .into_iter()
    .filter_map(|(f, x)| x.map(|x| (x, f)))
    .max()
    .map_or("--seqlen-q", |(_, f)| f);
    // Everything the run holds at once, in f64 so no product overflows: Q, K, V and O in the
    // storage type, LSE, and the problem's per-sequence records.
    let (bf, sqf, skf, hqf, hkvf) = (b as f64, sq as f64, sk as f64, hq as f64, hkv as f64);
    let elem = dtype.size_bytes() as f64;
    // A backward doubles the tensors: dO, dQ, dK and dV beside O, Q, K and V.
    let tensors = if args.grad.wanted() { 2.0 } else { 1.0 };
    let bytes = tensors * elem * bf * (sqf * hqf * (d + dv) as f64 + skf * hkvf * (d + dv) as f64)
        + 4.0 * bf * hqf * sqf
        + bf * std::mem::size_of::<fa4::problem::Sequence>() as f64;
    memory::ensure(size_flag, "the problem", bytes)?;
    let shapes = Shapes {
        q: vec![b, sq, hq, d],
        k: vec![b, sk, hkv, d],
        v: vec![b, sk, hkv, dv],
    };
    let p = shapes.problem(dtype, None, opts).map_err(|e| {
        flag_named(
            e,
            &[
                ("q", size_flag),
                ("k", "--heads-kv"),
                ("v", "--head-dim-v"),
                ("out", size_flag),
            ],
        )
    })?;
    match dtype {
        DType::F32 => random_typed::<f32>(p, seed, backend, policy, &args.grad, &args.cp),
        DType::F16 => random_typed::<f16>(p, seed, backend, policy, &args.grad, &args.cp),
        DType::Bf16 => random_typed::<bf16>(p, seed, backend, policy, &args.grad, &args.cp),
        DType::Fp8E4M3 => Err(fp8()),
    }
}

fn random_typed<T: Element>(
    p: Problem,
    seed: u64,
    backend: BackendArg,
    policy: CheckPolicy,
    grad: &super::backward::GradArgs,
    cp: &super::cp::CpArgs,
) -> Result<ExitCode> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut q = alloc("q", p.q_layout().numel(), T::NAN)?;
    let mut k = alloc("k", p.k_layout().numel(), T::NAN)?;
    let mut v = alloc("v", p.v_layout().numel(), T::NAN)?;
    check::random_qkv(
        &mut rng,
        &mut q,
        &mut k,
        &mut v,
        p.head_dim(),
        p.head_dim_v(),
    );
    let job = Job { p, q, k, v };
    let skip = job.check_plan(policy)?;
    if let Some(n) = cp.cp {
        super::cp::validate(cp, n, &job.p)?;
    }
    let backend = super::backward::resolve_backend(grad, backend)?;
    grad.plan(&backend, &job.p)
        .map_err(|e| flag_named(e, &[("v", "--head-dim-v")]))?;
    let done = job.execute(&backend, cp)?;
    job.print(&backend, &done, &[]);
    let code = job.verify(&done, skip);
    if grad.wanted() {
        let f = job.forward(&done);
        let d_out = super::backward::random_d_out(&job.p, seed);
        let grads = super::backward::compute(&f, &backend, d_out, grad)?;
        if !grads.report(&f, &[], policy) {
            return Ok(ExitCode::from(1));
        }
    }
    Ok(code)
}

// ---- inputs from files ----------------------------------------------------------------------

fn from_files(
    args: &RunArgs,
    backend: BackendArg,
    opts: &Options,
    policy: CheckPolicy,
) -> Result<ExitCode> {
    refuse_given(
        &args.random_flags(),
        "describes a random problem; with --q/--k/--v the shapes come from the files",
    )?;
    args.grad.validate(true)?;
    let need = |flag: &str, path: &Option<PathBuf>, why: &str| {
        path.clone()
            .ok_or_else(|| Error::invalid(flag, why.to_string()))
    };
    let qp = need("--q", &args.q, "is required with --k and --v")?;
    let kp = need(
        "--k",
        &args.k,
        "is required with --q: Q, K and V come from files together",
    )?;
    let vp = need(
        "--v",
        &args.v,
        "is required with --q: Q, K and V come from files together",
    )?;
    let out = need(
        "--out",
        &args.out,
        "is required with --q: where O is written (float32 .npy)",
    )?;
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

    // Before reading or computing anything: no output may overwrite an input or another output.
    let mut inputs: Vec<(&str, &Path)> = vec![("--q", &qp), ("--k", &kp), ("--v", &vp)];
    if let Some((cq, ck)) = cu_paths {
        inputs.push(("--cu-seqlens-q", cq));
        inputs.push(("--cu-seqlens-k", ck));
    }
    let mut outputs: Vec<(&str, &Path)> = vec![("--out", &out)];
    if let Some(l) = &args.lse {
        outputs.push(("--lse", l));
    }
    inputs.extend(args.grad.input());
    outputs.extend(args.grad.outputs());
    distinct_outputs(&inputs, &outputs)?;

    const FLOATS: [NpyDType; 2] = [NpyDType::F32, NpyDType::F16];
    let qa = npy::read_as(&qp, "--q", &FLOATS)?;
    let ka = npy::read_as(&kp, "--k", &FLOATS)?;
    let va = npy::read_as(&vp, "--v", &FLOATS)?;
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
            let why = if cu.is_some() {
                "with --cu-seqlens-q/k tensors are packed [total, heads, dim] (rank 3)"
            } else {
                "expected [batch, seqlen, heads, dim] (rank 4), or [total, heads, dim] with \
                 --cu-seqlens-q and --cu-seqlens-k"
            };
            return Err(Error::invalid(
                flag,
                format!("`{}` has shape {:?}; {why}", path.display(), a.shape),
            ));
        }
    }
    let dtype = file_dtype(args.dtype, &qa, [("--k", &ka), ("--v", &va)])?;
    let shapes = Shapes {
        q: qa.shape.clone(),
        k: ka.shape.clone(),
        v: va.shape.clone(),
    };
    let cu_ref = cu.as_ref().map(|(a, b)| (a.as_slice(), b.as_slice()));
    let p = shapes.problem(dtype, cu_ref, opts).map_err(|e| {
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
    // The inputs converted to the storage type, O and LSE, and their float32 copies and bytes
    // for writing (the files' own arrays are already held).
    let (ql, kl, vl, ol) = (p.q_layout(), p.k_layout(), p.v_layout(), p.o_layout());
    let elem = dtype.size_bytes() as f64;
    let n = |x: usize| x as f64;
    let mut bytes = elem * (n(ql.numel()) + n(kl.numel()) + n(vl.numel()) + n(ol.numel()))
        + 8.0 * (n(ol.numel()) + n(p.lse_len()));
    // A backward adds dO and dQ, dK, dV in the storage type, and each gradient's float32 copy
    // while it is staged.
    if args.grad.wanted() {
        bytes += elem * (n(ol.numel()) + n(ql.numel()) + n(kl.numel()) + n(vl.numel()))
            + 4.0 * n(ql.numel().max(kl.numel()).max(vl.numel()));
    }
    memory::ensure("--q", "the run", bytes)?;
    let outputs = Outputs {
        out: &out,
        lse: args.lse.as_deref(),
        o_shape: shapes.o(),
    };
    match dtype {
        DType::F32 => files_typed::<f32>(
            p,
            [qa, ka, va],
            backend,
            policy,
            outputs,
            &args.grad,
            &args.cp,
        ),
        DType::F16 => files_typed::<f16>(
            p,
            [qa, ka, va],
            backend,
            policy,
            outputs,
            &args.grad,
            &args.cp,
        ),
        DType::Bf16 => files_typed::<bf16>(
            p,
            [qa, ka, va],
            backend,
            policy,
            outputs,
            &args.grad,
            &args.cp,
        ),
        DType::Fp8E4M3 => Err(fp8()),
    }
}

/// Where a run on files writes, and O's shape.
struct Outputs<'a> {
    out: &'a Path,
    lse: Option<&'a Path>,
    o_shape: Vec<usize>,
}

fn cu_seqlens(path: &Path, flag: &str) -> Result<Vec<i32>> {
    let a = npy::read_as(path, flag, &[NpyDType::I32])?;
    if a.shape.len() != 1 {
        return Err(Error::invalid(
            flag,
            format!(
                "`{}` has shape {:?}; expected [batch + 1]",
                path.display(),
                a.shape
            ),
        ));
    }
    match a.data {
        Data::I32(x) => Ok(x),
        _ => unreachable!("read_as admits only int32"),
    }
}

/// Rounds the elements of a float array to `T` (float16 → f32 is exact, so one rounding).
fn convert<T: Element>(a: Array) -> Vec<T> {
    match a.data {
        Data::F32(x) => x.into_iter().map(T::from_f32).collect(),
        Data::F16(x) => x.into_iter().map(|e| T::from_f32(e.to_f32())).collect(),
        Data::I32(_) | Data::U8(_) => unreachable!("read_as admits only float32 and float16"),
    }
}

fn files_typed<T: Element>(
    p: Problem,
    [qa, ka, va]: [Array; 3],
    backend: BackendArg,
    policy: CheckPolicy,
    outputs: Outputs<'_>,
    grad: &super::backward::GradArgs,
    cp: &super::cp::CpArgs,
) -> Result<ExitCode> {
    let job: Job<T> = Job {
        p,
        q: convert(qa),
        k: convert(ka),
        v: convert(va),
    };
    let skip = job.check_plan(policy)?;
    if let Some(n) = cp.cp {
        super::cp::validate(cp, n, &job.p)?;
    }
    let d_out = super::backward::read_d_out::<T>(&job.p, grad)?;
    let backend = super::backward::resolve_backend(grad, backend)?;
    grad.plan(&backend, &job.p)
        .map_err(|e| flag_named(e, &[("v", "--v")]))?;
    let done = job.execute(&backend, cp)?;
    // O is written as float32: exact for every storage dtype. Every output (O, LSE, and the
    // gradients of a backward) is written under a temporary name first and renamed only when
    // all are complete: a failed or interrupted run leaves none half-written.
    let o: Vec<f32> = done.o.iter().map(|x| x.to_f32()).collect();
    let mut staged = vec![npy::stage(outputs.out, "--out", &outputs.o_shape, &o)?];
    drop(o);
    let mut wrote = vec![format!(
        "O {:?} float32 to `{}`",
        outputs.o_shape,
        outputs.out.display()
    )];
    if let Some(path) = outputs.lse {
        let shape = job.p.lse_shape();
        staged.push(npy::stage(path, "--lse", &shape, &done.lse)?);
        wrote.push(format!("LSE {shape:?} float32 to `{}`", path.display()));
    }
    // The gradients are computed before anything is committed, so that O, LSE, dQ, dK and dV
    // are renamed into place together or not at all.
    let grads = match d_out {
        Some(d_out) => Some(super::backward::compute(
            &job.forward(&done),
            &backend,
            d_out,
            grad,
        )?),
        None => None,
    };
    let mut grad_wrote = Vec::new();
    if let Some(g) = &grads {
        let (s, w) = g.stage(&job.p, grad)?;
        staged.extend(s);
        grad_wrote = w;
    }
    for s in staged {
        s.commit()?;
    }
    job.print(&backend, &done, &wrote);
    let code = job.verify(&done, skip);
    if let Some(g) = &grads {
        if !g.report(&job.forward(&done), &grad_wrote, policy) {
            return Ok(ExitCode::from(1));
        }
    }
    Ok(code)
}

/// Renames a library error's argument (`k`, `cu_seqlens_q`) to the flag the user typed
/// (`--k`, `--cu-seqlens-q`); `scale`, `softcap` and `dtype` are their flags everywhere.
fn flag_named(e: Error, names: &[(&str, &str)]) -> Error {
    match e {
        Error::InvalidArgument { name, reason } => {
            let common = [
                ("scale", "--scale"),
                ("softcap", "--softcap"),
                ("dtype", "--dtype"),
                ("lse", "--lse"),
            ];
            let flag = names
                .iter()
                .chain(&common)
                .find(|(n, _)| *n == name)
                .map_or(name.as_str(), |(_, f)| f);
            Error::invalid(flag, reason)
        }
        other => other,
    }
}

/// What identifies a file: its device and inode when it exists, else its absolute path (with
/// the directory resolved, so `./o.npy` and `o.npy` are one file).
#[derive(Debug, PartialEq, Eq)]
enum FileId {
    Inode(u64, u64),
    Path(PathBuf),
}

fn file_id(p: &Path) -> FileId {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        if let Ok(m) = std::fs::metadata(p) {
            return FileId::Inode(m.dev(), m.ino());
        }
    }
    let dir = match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    FileId::Path(dir.join(p.file_name().unwrap_or_default()))
}

/// An error naming the output flag whose file is an input's or an earlier output's: writing it
/// would destroy that file (`--out X --lse X` kept only the LSE).
fn distinct_outputs(inputs: &[(&str, &Path)], outputs: &[(&str, &Path)]) -> Result<()> {
    let ids: Vec<(&str, &Path, FileId)> = inputs
        .iter()
        .chain(outputs)
        .map(|&(f, p)| (f, p, file_id(p)))
        .collect();
    for (i, (flag, path, id)) in ids.iter().enumerate().skip(inputs.len()) {
        if let Some((other, _, _)) = ids[..i].iter().find(|(_, _, o)| o == id) {
            let what = if ids[..inputs.len()].iter().any(|(f, _, _)| f == other) {
                "the input"
            } else {
                "the output"
            };
            return Err(Error::invalid(
                *flag,
                format!(
                    "`{}` is {what} file of {other}; every output needs a file of its own",
                    path.display()
                ),
            ));
        }
    }
    Ok(())
}

// ---- shared -----------------------------------------------------------------------------------

/// Shapes of Q, K and V as given (rank 4, or rank 3 packed).
struct Shapes {
    q: Vec<usize>,
    k: Vec<usize>,
    v: Vec<usize>,
}

impl Shapes {
    /// O: Q's shape with V's last dimension.
    fn o(&self) -> Vec<usize> {
        let mut o = self.q.clone();
        if let (Some(last), Some(&dv)) = (o.last_mut(), self.v.last()) {
            *last = dv;
        }
        o
    }

    /// The fp8 problem of these shapes, O in `out`.
    fn problem_fp8(
        &self,
        out: DType,
        cu: Option<(&[i32], &[i32])>,
        opts: &Options,
    ) -> Result<Problem> {
        self.problem(DType::F32, cu, opts)?.as_fp8(out)
    }

    fn problem(
        &self,
        dtype: DType,
        cu: Option<(&[i32], &[i32])>,
        opts: &Options,
    ) -> Result<Problem> {
        let q = Layout::new("q", &self.q, None)?;
        let k = Layout::new("k", &self.k, None)?;
        let v = Layout::new("v", &self.v, None)?;
        let o = Layout::new("out", &self.o(), None)?;
        Problem::new(
            dtype,
            &q,
            &k,
            &v,
            &o,
            cu.map(|c| c.0),
            cu.map(|c| c.1),
            opts,
        )
    }
}

/// The first of `flags` that was given, as an error saying `why` it does not belong.
pub(super) fn refuse_given(flags: &[(&str, bool)], why: &str) -> Result<()> {
    match flags.iter().find(|(_, given)| *given) {
        Some((flag, _)) => Err(Error::invalid(*flag, why)),
        None => Ok(()),
    }
}

/// The dtype a run on files computes in: `--dtype`, else the `--q` file's (f16 stays f16,
/// every other file type computes in f32), which the other inputs' files must then share.
pub(super) fn file_dtype(
    given: Option<DType>,
    q: &Array,
    others: [(&str, &Array); 2],
) -> Result<DType> {
    if let Some(t) = given {
        return Ok(t);
    }
    let of = |a: &Array| match a.dtype() {
        NpyDType::F16 => DType::F16,
        _ => DType::F32,
    };
    let t = of(q);
    for (flag, a) in others {
        if of(a) != t {
            return Err(Error::invalid(
                flag,
                format!(
                    "is {} but --q is {}; give --dtype to compute in one type",
                    a.dtype(),
                    q.dtype()
                ),
            ));
        }
    }
    Ok(t)
}

fn fp8() -> Error {
    Error::invalid(
        "--dtype",
        "fp8 is planned for but not computed yet; use f32, fp16 or bf16",
    )
}

/// A buffer of `n` copies of `fill`, or an error naming `name` if it cannot be allocated.
fn alloc<T: Clone>(name: &str, n: usize, fill: T) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| {
        Error::invalid(
            name,
            format!(
                "cannot allocate {n} elements ({:.3} GB)",
                n as f64 * std::mem::size_of::<T>() as f64 / 1e9
            ),
        )
    })?;
    v.resize(n, fill);
    Ok(v)
}

/// A validated problem and its inputs, contiguous.
struct Job<T> {
    p: Problem,
    q: Vec<T>,
    k: Vec<T>,
    v: Vec<T>,
}

/// Outputs of one call and its time.
struct Done<T> {
    o: Vec<T>,
    lse: Vec<f32>,
    elapsed: Duration,
    /// Lines about how it was computed (`--cp`).
    notes: Vec<String>,
}

impl<T: Element> Job<T> {
    /// The forward's inputs and outputs, for the backward.
    fn forward<'a>(&'a self, done: &'a Done<T>) -> super::backward::Forward<'a, T> {
        super::backward::Forward {
            p: &self.p,
            q: &self.q,
            k: &self.k,
            v: &self.v,
            o: &done.o,
            lse: &done.lse,
        }
    }

    /// Runs the backend once on NaN-poisoned outputs (an unwritten element fails the check).
    fn execute(&self, backend: &Backend, cp: &super::cp::CpArgs) -> Result<Done<T>> {
        if let Some(n) = cp.cp {
            let c = super::cp::execute(cp, n, backend, &self.p, &self.q, &self.k, &self.v)?;
            return Ok(Done {
                o: c.o,
                lse: c.lse,
                elapsed: c.elapsed,
                notes: c.notes,
            });
        }
        let mut o = alloc("out", self.p.o_layout().numel(), T::NAN)?;
        let mut lse = alloc("lse", self.p.lse_len(), f32::NAN)?;
        // Start the CPU thread pool outside the timed call.
        let threads = rayon::current_num_threads();
        // A GPU's time is not estimated here: its runs are short and it has its own compile step.
        let estimate = match backend {
            Backend::Cpu | Backend::CpuWith(_) => {
                self.p.flops() / (CPU_FLOPS_PER_THREAD_S * threads as f64)
            }
            _ => 0.0,
        };
        let progress = Progress::start("computing attention on the CPU", estimate, 0);
        let t0 = Instant::now();
        let result = backend.run(&self.p, &self.q, &self.k, &self.v, &mut o, Some(&mut lse));
        let elapsed = t0.elapsed();
        progress.finish();
        result?;
        Ok(Done {
            o,
            lse,
            elapsed,
            notes: Vec::new(),
        })
    }

    /// `Ok(None)` to run the check, `Ok(Some(why))` to skip it, decided before anything is
    /// computed: by its cost, and by the memory the oracle needs (its float64 O and LSE, and for
    /// 16-bit storage the storage-precision O and LSE, each held twice while assembled). With
    /// `--check`, memory that cannot be had is an error rather than an abort mid-check.
    fn check_plan(&self, policy: CheckPolicy) -> Result<Option<String>> {
        if let Some(why) = skip_reason(policy, check_cost(&self.p)) {
            return Ok(Some(why));
        }
        let per_elem = if self.p.dtype() == DType::F32 {
            16.0
        } else {
            24.0
        };
        let longest_k = self
            .p
            .sequences()
            .iter()
            .map(|s| s.k_len)
            .max()
            .unwrap_or(0);
        let bytes = per_elem * (self.p.o_layout().numel() + self.p.lse_len()) as f64
            + 16.0 * longest_k as f64 * rayon::current_num_threads() as f64;
        let free = memory::available();
        match free {
            Some(free) if bytes > free => {
                let why = format!(
                    "the float64 oracle needs {bytes:.0} bytes ({}), but only {} can be \
                     allocated here",
                    memory::gb(bytes),
                    memory::gb(free)
                );
                if policy == CheckPolicy::Always {
                    Err(Error::invalid("--check", why))
                } else {
                    Ok(Some(format!("skipped: {why}")))
                }
            }
            _ => Ok(None),
        }
    }

    fn print(&self, backend: &Backend, done: &Done<T>, wrote: &[String]) {
        let p = &self.p;
        let gflop = p.flops() / 1e9;
        let work = if gflop >= 1.0 {
            format!("{gflop:.3} GFLOP")
        } else {
            format!("{:.3} MFLOP", gflop * 1e3)
        };
        println!("problem  {} ({work})", describe(p));
        println!("backend  {}", backend_name(backend));
        let secs = done.elapsed.as_secs_f64();
        let rate = if secs > 0.0 && gflop > 0.0 {
            format!("{} GFLOP/s", three_digits(gflop / secs))
        } else {
            "n/a GFLOP/s".into()
        };
        println!("time     {:.3} ms, {rate} (one call)", secs * 1e3);
        for n in &done.notes {
            println!("cp       {n}");
        }
        for w in wrote {
            println!("wrote    {w}");
        }
    }

    /// Prints the check's verdict (or why it was skipped); exit code 1 if it failed.
    fn verify(&self, done: &Done<T>, skip: Option<String>) -> ExitCode {
        if let Some(why) = skip {
            println!("check    {why}");
            return ExitCode::SUCCESS;
        }
        let estimate =
            check_cost(&self.p) / (ORACLE_MACS_PER_THREAD_S * rayon::current_num_threads() as f64);
        let progress = Progress::start("checking against the float64 oracle", estimate, 0);
        let t0 = Instant::now();
        let report =
            match check::check(&self.p, &self.q, &self.k, &self.v, &done.o, Some(&done.lse)) {
                Ok(r) => r,
                Err(e) => {
                    progress.finish();
                    eprintln!("error: {e}");
                    return ExitCode::from(2);
                }
            };
        progress.finish();
        println!(
            "check    {report} (float64 oracle, {:.2} s)",
            t0.elapsed().as_secs_f64()
        );
        if report.passed() {
            ExitCode::SUCCESS
        } else {
            ExitCode::from(1)
        }
    }
}

/// `x` with one decimal from 1 up, and three significant digits below (a tiny problem on a busy
/// machine runs at 0.01 GFLOP/s, which one decimal printed as 0.0).
fn three_digits(x: f64) -> String {
    if !(x > 0.0 && x < 1.0) {
        return format!("{x:.1}");
    }
    let decimals = (2.0 - x.log10().floor()).clamp(1.0, 12.0) as usize;
    format!("{x:.decimals$}")
}

fn backend_name(b: &Backend) -> String {
    match b {
        Backend::Cpu => match rayon::current_num_threads() {
            1 => "cpu (1 thread)".to_string(),
            n => format!("cpu ({n} threads)"),
        },
        other => other.name(),
    }
}

/// `bf16 b=1 sq=1024 sk=1024 h=8/8 d=128 causal scale=0.0884`.
fn describe(p: &Problem) -> String {
    let mut s = format!("{} ", p.dtype());
    if p.is_varlen() {
        let seqs = p.sequences();
        let tq: usize = seqs.iter().map(|x| x.q_len).sum();
        let tk: usize = seqs.iter().map(|x| x.k_len).sum();
        let mq = seqs.iter().map(|x| x.q_len).max().unwrap_or(0);
        let mk = seqs.iter().map(|x| x.k_len).max().unwrap_or(0);
        s += &format!(
            "varlen b={} total_q={tq} total_k={tk} (longest sq={mq} sk={mk})",
            seqs.len()
        );
    } else {
        s += &format!(
            "b={} sq={} sk={}",
            p.q_layout().dims[0],
            p.q_layout().dims[1],
            p.k_layout().dims[1]
        );
    }
    s += &format!(" h={}/{} d={}", p.heads_q(), p.heads_kv(), p.head_dim());
    if p.head_dim_v() != p.head_dim() {
        s += &format!("/{}", p.head_dim_v());
    }
    // Not `as i64`: usize::MAX would print as the unbounded -1.
    let side = |x: Option<usize>| x.map_or_else(|| "-1".to_string(), |x| x.to_string());
    match p.mask() {
        Mask::None => {}
        Mask::Causal => s += " causal",
        Mask::Window { left, right } => s += &format!(" window({},{})", side(left), side(right)),
    }
    if let Some(c) = p.softcap() {
        s += &format!(" softcap={c}");
    }
    s += &format!(" scale={:.4}", p.scale());
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_parsing() {
        assert_eq!(
            parse_window("-1,0"),
            Ok(Mask::Window {
                left: None,
                right: Some(0)
            })
        );
        assert_eq!(
            parse_window(" 8, -1"),
            Ok(Mask::Window {
                left: Some(8),
                right: None
            })
        );
        assert_eq!(
            parse_window("18446744073709551615,0"),
            Ok(Mask::Window {
                left: Some(usize::MAX),
                right: Some(0)
            })
        );
        for bad in [
            "3",
            "1,2,3",
            "-2,0",
            "a,1",
            "",
            "1,",
            "18446744073709551616,0",
            "+-1,0",
        ] {
            assert!(parse_window(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn rates_keep_three_significant_digits_below_one() {
        assert_eq!(three_digits(172.34), "172.3");
        assert_eq!(three_digits(0.01), "0.0100");
        assert_eq!(three_digits(0.5), "0.500");
        assert_eq!(three_digits(0.000123), "0.000123");
        assert_eq!(three_digits(0.0), "0.0");
    }

    #[test]
    fn the_check_runs_when_affordable_or_asked() {
        assert_eq!(skip_reason(CheckPolicy::Affordable, CHECK_LIMIT_MACS), None);
        let why = skip_reason(CheckPolicy::Affordable, 2.0 * CHECK_LIMIT_MACS).unwrap();
        assert!(why.contains("1.00e10") && why.contains("--check"), "{why}");
        assert_eq!(skip_reason(CheckPolicy::Always, 1e15), None);
        assert!(skip_reason(CheckPolicy::Never, 1.0).is_some());
    }

    #[test]
    fn the_default_problem_is_checked() {
        let s = Shapes {
            q: vec![1, DEFAULT_SEQLEN, DEFAULT_HEADS, DEFAULT_HEAD_DIM],
            k: vec![1, DEFAULT_SEQLEN, DEFAULT_HEADS, DEFAULT_HEAD_DIM],
            v: vec![1, DEFAULT_SEQLEN, DEFAULT_HEADS, DEFAULT_HEAD_DIM],
        };
        let p = s.problem(DType::Bf16, None, &Options::new()).unwrap();
        assert!(check_cost(&p) <= CHECK_LIMIT_MACS, "{}", check_cost(&p));
        // f32 needs one pass, 16-bit two.
        let p32 = s.problem(DType::F32, None, &Options::new()).unwrap();
        assert_eq!(2.0 * check_cost(&p32), check_cost(&p));
    }
}
