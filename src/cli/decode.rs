//! `fa4 run` over a paged KV cache: a random paged problem (`--paged`) or one from `.npy` files
//! (`--k-cache`, `--v-cache`, `--page-table`, `--seqlens-k`), checked against the float64
//! paged oracle ([`fa4::paged::reference`]) like the other forms.
//!
//! A child module of `run`: it reads the run's flags (shapes, mask, dtype, backend, check
//! policy) and reuses its helpers, and adds only the paged flags ([`PagedRunArgs`]).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use fa4::config::decode::DecodePlan;
use fa4::config::decode_gpu::DecodeVariant;
use fa4::npy::{self, Array, Data, NpyDType};
use fa4::paged::random::{random_paged, PagedSpec};
use fa4::paged::{reference, PagedCache, PagedProblem};
use fa4::tensor::Layout;
use fa4::{Backend, DType, Element, Error, Mask, Options, Result};

use super::{
    alloc, convert, cu_seqlens, file_dtype, fp8, refuse_given, skip_reason, CheckPolicy, RunArgs,
};
use crate::cli::BackendArg;

#[path = "decode_fp8.rs"]
mod fp8kv;

/// Defaults of a random paged problem: a decode step of a small batch against caches of up to
/// 1024 keys, with the head configuration (32 query heads over 8 KV heads, d = 128) and
/// vLLM's page size.
const DEFAULT_BATCH: usize = 4;
const DEFAULT_SEQLEN_K: usize = 1024;
const DEFAULT_HEADS_Q: usize = 32;
const DEFAULT_HEADS_KV: usize = 8;
const DEFAULT_HEAD_DIM: usize = 128;
const DEFAULT_PAGE_SIZE: usize = 16;

/// The paged flags of `fa4 run`.
#[derive(Args, Debug, Default)]
pub struct PagedRunArgs {
    /// A random paged problem: shuffled page tables, ragged lengths (the first sequence has
    /// --seqlen-k keys, the others between half of it and all), --seqlen-q defaults to 1.
    #[arg(long, help_heading = "Paged KV cache")]
    paged: bool,
    /// Keys per page of a random paged problem [default: 16].
    #[arg(long, allow_negative_numbers = true, help_heading = "Paged KV cache")]
    page_size: Option<usize>,
    /// K cache, float32 or float16 .npy: [num_pages, page_size, heads_kv, head_dim].
    #[arg(long, value_name = "KC.npy", help_heading = "Paged KV cache")]
    k_cache: Option<PathBuf>,
    /// V cache: [num_pages, page_size, heads_kv, head_dim_v].
    #[arg(long, value_name = "VC.npy", help_heading = "Paged KV cache")]
    v_cache: Option<PathBuf>,
    /// Page table, int32 .npy [batch, max_pages_per_seq]: key j of sequence b is in page
    /// table[b][j / page_size].
    #[arg(long, value_name = "PT.npy", help_heading = "Paged KV cache")]
    page_table: Option<PathBuf>,
    /// Keys per sequence, int32 .npy [batch].
    #[arg(long, value_name = "SK.npy", help_heading = "Paged KV cache")]
    seqlens_k: Option<PathBuf>,
    /// Splits over the keys, 1..=128 [default: the planner's choice, `fa4 plan --decode`].
    #[arg(long, allow_negative_numbers = true, help_heading = "Paged KV cache")]
    num_splits: Option<usize>,
    /// The cache's element type when it differs from the queries': fp8 (e4m3 bytes with one
    /// scale per KV head; --k-cache/--v-cache files are then uint8).
    #[arg(long, value_name = "DTYPE", help_heading = "Paged KV cache")]
    kv_dtype: Option<DType>,
    /// An fp8 cache's K scales: one value for every KV head, or one per KV head
    /// (comma-separated) [default: 1].
    #[arg(long, value_name = "S[,S...]", value_parser = fp8kv::parse_scales, allow_hyphen_values = true, help_heading = "Paged KV cache")]
    k_scale: Option<fp8kv::Scales>,
    /// An fp8 cache's V scales, as --k-scale.
    #[arg(long, value_name = "S[,S...]", value_parser = fp8kv::parse_scales, allow_hyphen_values = true, help_heading = "Paged KV cache")]
    v_scale: Option<fp8kv::Scales>,
}

impl PagedRunArgs {
    /// Whether any paged flag was given (the run is then a paged one).
    pub fn wanted(&self) -> bool {
        self.paged
            || self.page_size.is_some()
            || self.k_cache.is_some()
            || self.v_cache.is_some()
            || self.page_table.is_some()
            || self.seqlens_k.is_some()
            || self.num_splits.is_some()
            || self.kv_dtype.is_some()
            || self.k_scale.is_some()
            || self.v_scale.is_some()
    }
}

/// Runs a paged `fa4 run`.
pub fn run(
    args: &RunArgs,
    backend: &Backend,
    opts: &Options,
    policy: CheckPolicy,
) -> Result<ExitCode> {
    let pa = &args.paged;
    let files = pa.k_cache.is_some()
        || pa.v_cache.is_some()
        || pa.page_table.is_some()
        || pa.seqlens_k.is_some();
    if pa.num_splits == Some(0) {
        return Err(Error::invalid("--num-splits", "must be at least 1"));
    }
    if pa.kv_dtype != Some(DType::Fp8E4M3) {
        refuse_given(
            &[
                ("--k-scale", pa.k_scale.is_some()),
                ("--v-scale", pa.v_scale.is_some()),
            ],
            "belongs to an fp8 cache (--kv-dtype fp8)",
        )?;
    }
    match pa.kv_dtype {
        None => {}
        Some(DType::Fp8E4M3) => return fp8kv::run(args, backend, opts, policy),
        Some(t) => {
            return Err(Error::invalid(
                "--kv-dtype",
                format!("{t}: the cache has the queries' type (--dtype) unless it is fp8"),
            ))
        }
    }
    refuse_given(
        &[
            ("--k", args.k.is_some()),
            ("--v", args.v.is_some()),
            ("--cu-seqlens-k", args.cu_seqlens_k.is_some()),
        ],
        "belongs to a contiguous run; a paged run reads --k-cache, --v-cache, \
         --page-table and --seqlens-k",
    )?;
    match (pa.paged, files) {
        (true, true) => Err(Error::invalid(
            "--paged",
            "draws a random problem; with --k-cache/--v-cache/--page-table/--seqlens-k the \
             problem comes from files",
        )),
        (true, false) => random(args, backend, opts, policy),
        (false, true) => from_files(args, backend, opts, policy),
        (false, false) => Err(Error::invalid(
            if pa.page_size.is_some() {
                "--page-size"
            } else {
                "--num-splits"
            },
            "belongs to a paged run; give --paged, or --k-cache/--v-cache/--page-table/--seqlens-k",
        )),
    }
}

fn random(
    args: &RunArgs,
    backend: &Backend,
    opts: &Options,
    policy: CheckPolicy,
) -> Result<ExitCode> {
    let (spec, mut rng, dtype) = random_spec(args)?;
    match dtype {
        DType::F32 => random_typed::<f32>(&spec, &mut rng, backend, opts, policy, args),
        DType::F16 => random_typed::<f16>(&spec, &mut rng, backend, opts, policy, args),
        DType::Bf16 => random_typed::<bf16>(&spec, &mut rng, backend, opts, policy, args),
        DType::Fp8E4M3 => Err(fp8()),
    }
}

/// The random paged problem the flags describe: its shape, the generator (seeded, past the
/// lengths it drew) and the queries' dtype.
fn random_spec(args: &RunArgs) -> Result<(PagedSpec, StdRng, DType)> {
    refuse_given(
        &[
            ("--q", args.q.is_some()),
            ("--cu-seqlens-q", args.cu_seqlens_q.is_some()),
            ("--out", args.out.is_some()),
            ("--lse", args.lse.is_some()),
        ],
        "belongs to a paged run on files; --paged draws a random problem",
    )?;
    let batch = args.batch.unwrap_or(DEFAULT_BATCH);
    let sq = args.seqlen_q.unwrap_or(1);
    let sk = args.seqlen_k.unwrap_or(DEFAULT_SEQLEN_K);
    let hq = args.heads_q.unwrap_or(DEFAULT_HEADS_Q);
    let hkv = args.heads_kv.unwrap_or(if args.heads_q.is_some() {
        hq
    } else {
        DEFAULT_HEADS_KV
    });
    let d = args.head_dim.unwrap_or(DEFAULT_HEAD_DIM);
    let dv = args.head_dim_v.unwrap_or(d);
    let ps = args.paged.page_size.unwrap_or(DEFAULT_PAGE_SIZE);
    let dtype = args.dtype.unwrap_or(DType::Bf16);
    for (flag, x) in [
        ("--batch", batch),
        ("--heads-q", hq),
        ("--heads-kv", hkv),
        ("--head-dim", d),
        ("--head-dim-v", dv),
        ("--page-size", ps),
    ] {
        if x == 0 {
            return Err(Error::invalid(flag, "must be at least 1"));
        }
    }
    if !hq.is_multiple_of(hkv) {
        return Err(Error::invalid(
            "--heads-kv",
            format!("{hkv} must divide --heads-q {hq}"),
        ));
    }
    // Keep a typo from allocating the machine away: the cache and queries are bounded.
    let cache = (batch as f64) * (sk as f64) * (hkv as f64) * ((d + dv) as f64);
    let queries = (batch as f64) * (sq as f64) * (hq as f64) * (d as f64);
    let elems = cache + queries;
    if elems > 1e9 {
        // Name the length that made it large: the cache's keys or the queries' rows.
        return Err(Error::invalid(
            if queries > cache {
                "--seqlen-q"
            } else {
                "--seqlen-k"
            },
            format!("the random problem would hold {elems:.2e} elements (limit 1e9)"),
        ));
    }
    let seed = args.seed.unwrap_or(0);
    let mut rng = StdRng::seed_from_u64(seed);
    let seqlens_k: Vec<usize> = (0..batch)
        .map(|b| {
            if b == 0 {
                sk
            } else {
                rng.random_range(sk / 2..=sk)
            }
        })
        .collect();
    let spec = PagedSpec {
        seqlens_q: vec![sq; batch],
        seqlens_k,
        heads_q: hq,
        heads_kv: hkv,
        head_dim: d,
        head_dim_v: dv,
        page_size: ps,
        varlen: false,
    };
    Ok((spec, rng, dtype))
}

fn random_typed<T: Element>(
    spec: &PagedSpec,
    rng: &mut StdRng,
    backend: &Backend,
    opts: &Options,
    policy: CheckPolicy,
    args: &RunArgs,
) -> Result<ExitCode> {
    let inputs = random_paged::<T, _>(rng, spec)?;
    let p = inputs.problem(opts)?;
    let job = Job {
        p,
        q: inputs.q,
        k: inputs.k_cache,
        v: inputs.v_cache,
        num_splits: args.paged.num_splits,
        auto: matches!(args.backend, BackendArg::Auto),
    };
    let backend = &job.backend_for(backend)?;
    let done = job.execute(backend)?;
    job.print(backend, &done, &[]);
    Ok(job.verify(&done, policy))
}

fn i32_array(path: &Path, flag: &str, rank: usize, what: &str) -> Result<(Vec<i32>, Vec<usize>)> {
    let a = npy::read_as(path, flag, &[NpyDType::I32])?;
    if a.shape.len() != rank {
        return Err(Error::invalid(
            flag,
            format!(
                "`{}` has shape {:?}; expected {what}",
                path.display(),
                a.shape
            ),
        ));
    }
    match a.data {
        Data::I32(x) => Ok((x, a.shape)),
        _ => unreachable!("read_as admits only int32"),
    }
}

/// Names an error from the library's argument names after the flags that carry them.
fn flag_error(e: Error) -> Error {
    match e {
        Error::InvalidArgument { name, reason } => {
            let flag = match name.as_str() {
                "q" => "--q",
                "out" => "--out",
                "k_cache" => "--k-cache",
                "v_cache" => "--v-cache",
                "page_table" => "--page-table",
                "seqlens_k" => "--seqlens-k",
                "cu_seqlens_q" => "--cu-seqlens-q",
                "num_splits" => "--num-splits",
                "scale" => "--scale",
                "softcap" => "--softcap",
                "lse" => "--lse",
                other => return Error::invalid(other, reason),
            };
            Error::invalid(flag, reason)
        }
        e => e,
    }
}

pub(super) fn from_files(
    args: &RunArgs,
    backend: &Backend,
    opts: &Options,
    policy: CheckPolicy,
) -> Result<ExitCode> {
    // An fp8 cache (`--kv-dtype fp8`): uint8 e4m3 pages, the queries' type from --dtype or --q.
    let fp8_cache = args.paged.kv_dtype == Some(DType::Fp8E4M3);
    let mut random = args.random_flags().to_vec();
    random.push(("--page-size", args.paged.page_size.is_some()));
    refuse_given(
        &random,
        "describes a random problem; with --k-cache the shapes come from the files",
    )?;
    let pa = &args.paged;
    let need = |flag: &str, path: &Option<PathBuf>, why: &str| {
        path.clone()
            .ok_or_else(|| Error::invalid(flag, why.to_string()))
    };
    let together =
        "is required with --k-cache: the query and the paged cache come from files together";
    let qp = need("--q", &args.q, together)?;
    let kp = need("--k-cache", &pa.k_cache, together)?;
    let vp = need("--v-cache", &pa.v_cache, together)?;
    let tp = need("--page-table", &pa.page_table, together)?;
    let sp = need("--seqlens-k", &pa.seqlens_k, together)?;
    let out = need(
        "--out",
        &args.out,
        "is required with --q: where O is written (float32 .npy)",
    )?;
    const FLOATS: [NpyDType; 2] = [NpyDType::F32, NpyDType::F16];
    let qa = npy::read_as(&qp, "--q", &FLOATS)?;
    let cache_types: &[NpyDType] = if fp8_cache { &[NpyDType::U8] } else { &FLOATS };
    let ka = npy::read_as(&kp, "--k-cache", cache_types)?;
    let va = npy::read_as(&vp, "--v-cache", cache_types)?;
    let (table, tshape) = i32_array(&tp, "--page-table", 2, "[batch, max_pages_per_seq]")?;
    let (seqlens, _) = i32_array(&sp, "--seqlens-k", 1, "[batch]")?;
    let cu = match &args.cu_seqlens_q {
        Some(path) => Some(cu_seqlens(path, "--cu-seqlens-q")?),
        None => None,
    };
    let q_rank = if cu.is_some() { 3 } else { 4 };
    if qa.shape.len() != q_rank {
        return Err(Error::invalid(
            "--q",
            format!(
                "`{}` has shape {:?}; expected {}",
                qp.display(),
                qa.shape,
                if cu.is_some() {
                    "[total_q, heads_q, head_dim] with --cu-seqlens-q"
                } else {
                    "[batch, seqlen_q, heads_q, head_dim], or [total_q, heads_q, head_dim] with \
                     --cu-seqlens-q"
                }
            ),
        ));
    }
    for (flag, path, a) in [("--k-cache", &kp, &ka), ("--v-cache", &vp, &va)] {
        if a.shape.len() != 4 {
            return Err(Error::invalid(
                flag,
                format!(
                    "`{}` has shape {:?}; expected [num_pages, page_size, heads_kv, dim]",
                    path.display(),
                    a.shape
                ),
            ));
        }
    }
    if tshape[0] != seqlens.len() {
        return Err(Error::invalid(
            "--page-table",
            format!(
                "has {} rows but --seqlens-k has {} sequences",
                tshape[0],
                seqlens.len()
            ),
        ));
    }
    let dtype = if fp8_cache {
        match (args.dtype, qa.dtype()) {
            (Some(t), _) => t,
            (None, NpyDType::F16) => DType::F16,
            (None, _) => DType::F32,
        }
    } else {
        file_dtype(args.dtype, &qa, [("--k-cache", &ka), ("--v-cache", &va)])?
    };
    let problem = || -> Result<PagedProblem> {
        let kl = Layout::new("k_cache", &ka.shape, None)?;
        let vl = Layout::new("v_cache", &va.shape, None)?;
        let cache = PagedCache::new(&kl, &vl, &table, tshape[1], &seqlens)?;
        let q = Layout::new("q", &qa.shape, None)?;
        let mut o_shape = qa.shape.clone();
        *o_shape.last_mut().expect("rank ≥ 3") = va.shape[3];
        let o = Layout::new("out", &o_shape, None)?;
        PagedProblem::new(dtype, &q, &o, &cache, cu.as_deref(), opts)
    };
    let p = problem().map_err(flag_error)?;
    let outputs = (out.as_path(), args.lse.as_deref());
    if fp8_cache {
        return fp8kv::files(args, p, [qa, ka, va], backend, policy, outputs);
    }
    let auto = matches!(args.backend, BackendArg::Auto);
    let run = match dtype {
        DType::F32 => files_typed::<f32>,
        DType::F16 => files_typed::<f16>,
        DType::Bf16 => files_typed::<bf16>,
        DType::Fp8E4M3 => return Err(fp8()),
    };
    run(
        p,
        [qa, ka, va],
        backend,
        policy,
        outputs,
        pa.num_splits,
        auto,
    )
}

fn files_typed<T: Element>(
    p: PagedProblem,
    [qa, ka, va]: [Array; 3],
    backend: &Backend,
    policy: CheckPolicy,
    (out, lse): (&Path, Option<&Path>),
    num_splits: Option<usize>,
    auto: bool,
) -> Result<ExitCode> {
    let job: Job<T> = Job {
        p,
        q: convert(qa),
        k: convert(ka),
        v: convert(va),
        num_splits,
        auto,
    };
    let backend = &job.backend_for(backend)?;
    let done = job.execute(backend)?;
    let mut o_shape = job.p.q_layout().dims.to_vec();
    if job.p.is_varlen() {
        o_shape.remove(0);
    }
    *o_shape.last_mut().expect("rank ≥ 3") = job.p.cache().head_dim_v();
    // O is written as float32: exact for every storage dtype.
    let o: Vec<f32> = done.o.iter().map(|x| x.to_f32()).collect();
    npy::write(out, "--out", &o_shape, &o)?;
    let mut wrote = vec![format!("O {o_shape:?} float32 to `{}`", out.display())];
    if let Some(path) = lse {
        let shape = job.p.lse_shape();
        npy::write(path, "--lse", &shape, &done.lse)?;
        wrote.push(format!("LSE {shape:?} float32 to `{}`", path.display()));
    }
    job.print(backend, &done, &wrote);
    Ok(job.verify(&done, policy))
}

/// A validated paged problem and its inputs, contiguous.
struct Job<T> {
    p: PagedProblem,
    q: Vec<T>,
    k: Vec<T>,
    v: Vec<T>,
    num_splits: Option<usize>,
    /// `--backend auto`: a problem the GPU kernels do not cover runs on the CPU (with a note).
    auto: bool,
}

struct Done<T> {
    o: Vec<T>,
    lse: Vec<f32>,
    elapsed: Duration,
    plan: DecodePlan,
}

/// Multiply-adds of the check (the f64 oracle, plus the storage-precision pass for 16-bit).
fn check_cost(p: &PagedProblem) -> f64 {
    let c = p.cache();
    let passes = if p.dtype() == DType::F32 { 1.0 } else { 2.0 };
    let pairs: f64 = p
        .sequences()
        .iter()
        .map(|s| (s.q_len * s.k_len) as f64)
        .sum();
    passes * pairs * p.heads_q() as f64 * (c.head_dim() + c.head_dim_v()) as f64
}

/// The backend that runs a paged problem (16-bit or fp8 cache): the given one, except that
/// under `--backend auto` (`auto`) a problem the GPU decode kernels refuse (dtype, head dim)
/// goes to the CPU and says why. A malformed `FA4_DECODE_VARIANT` is an error on every backend
/// (a typo must not silently time or run something else).
fn backend_for(
    backend: &Backend,
    p: &PagedProblem,
    num_splits: Option<usize>,
    auto: bool,
) -> Result<Backend> {
    DecodeVariant::from_env()?;
    if let (Backend::Cuda(cuda), true) = (backend, auto) {
        if let Err(e) = cuda.plan_paged(p, num_splits) {
            println!("note     the GPU decode kernels do not run this problem ({e}): the paged run uses the CPU backend");
            return Ok(Backend::Cpu);
        }
    }
    Ok(backend.clone())
}

/// The `backend` line's text: `cpu (N threads)`, or the GPU's name.
fn backend_text(backend: &Backend) -> String {
    match backend {
        Backend::Cpu => format!("cpu ({} threads)", rayon::current_num_threads()),
        other => other.name(),
    }
}

impl<T: Element> Job<T> {
    /// The backend that runs the job ([`backend_for`]).
    fn backend_for(&self, backend: &Backend) -> Result<Backend> {
        backend_for(backend, &self.p, self.num_splits, self.auto)
    }

    fn execute(&self, backend: &Backend) -> Result<Done<T>> {
        let mut o = alloc("out", self.p.o_layout().numel(), T::NAN)?;
        let mut lse = alloc("lse", self.p.lse_len(), f32::NAN)?;
        rayon::current_num_threads();
        let t0 = Instant::now();
        let plan = backend
            .run_paged(
                &self.p,
                &self.q,
                &self.k,
                &self.v,
                &mut o,
                Some(&mut lse),
                self.num_splits,
            )
            .map_err(flag_error)?;
        Ok(Done {
            o,
            lse,
            elapsed: t0.elapsed(),
            plan,
        })
    }

    fn print(&self, backend: &Backend, done: &Done<T>, wrote: &[String]) {
        let p = &self.p;
        let c = p.cache();
        let bytes = c.kv_bytes(p.dtype().size_bytes() as usize);
        println!("problem  {} (K+V {:.3} MB)", describe(p), bytes / 1e6);
        println!("backend  {}", backend_text(backend));
        println!(
            "plan     num_splits {}{}, {} tiles of up to {} packed rows (GQA group {})",
            done.plan.num_splits,
            if done.plan.forced { " (forced)" } else { "" },
            done.plan.tiles_unsplit,
            done.plan.tiles.block_m,
            done.plan.group
        );
        let secs = done.elapsed.as_secs_f64();
        println!(
            "time     {:.3} ms, {:.1} GB/s of K+V read (one call)",
            secs * 1e3,
            if secs > 0.0 { bytes / secs / 1e9 } else { 0.0 }
        );
        for w in wrote {
            println!("wrote    {w}");
        }
    }

    fn verify(&self, done: &Done<T>, policy: CheckPolicy) -> ExitCode {
        let cost = check_cost(&self.p);
        if let Some(why) = skip_reason(policy, cost) {
            println!("check    {why}");
            return ExitCode::SUCCESS;
        }
        let t0 = Instant::now();
        let report =
            match reference::check(&self.p, &self.q, &self.k, &self.v, &done.o, Some(&done.lse)) {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("fa4: error: the paged oracle could not run: {e}");
                    return ExitCode::from(2);
                }
            };
        println!(
            "check    {report} (float64 paged oracle, {:.2} s)",
            t0.elapsed().as_secs_f64()
        );
        if report.passed() {
            ExitCode::SUCCESS
        } else {
            ExitCode::from(1)
        }
    }
}

/// `bf16 paged b=4 sq=1 sk≤1024 page=16 h=32/8 d=128 causal`.
fn describe(p: &PagedProblem) -> String {
    let c = p.cache();
    let seqs = p.sequences();
    let mk = seqs.iter().map(|s| s.k_len).max().unwrap_or(0);
    let mut s = format!("{} paged b={} ", p.dtype(), seqs.len());
    if p.is_varlen() {
        s += &format!("total_q={}", p.total_q());
    } else {
        s += &format!("sq={}", p.q_layout().dims[1]);
    }
    s += &format!(
        " sk≤{mk} page={} pages={} h={}/{} d={}",
        c.page_size(),
        c.num_pages(),
        p.heads_q(),
        c.heads_kv(),
        c.head_dim()
    );
    if c.head_dim_v() != c.head_dim() {
        s += &format!("/{}", c.head_dim_v());
    }
    let side = |x: Option<usize>| x.map_or(-1, |x| x as i64);
    match p.options().get_mask() {
        Mask::None => {}
        Mask::Causal => s += " causal",
        Mask::Window { left, right } => s += &format!(" window({},{})", side(left), side(right)),
    }
    if let Some(c) = p.softcap() {
        s += &format!(" softcap={c}");
    }
    s + &format!(" scale={:.4}", p.scale())
}
