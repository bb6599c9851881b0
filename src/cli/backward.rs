//! The backward pass on the command line:
//!
//! - `fa4 run --backward` (random problem) and `fa4 run --q … --do DO.npy [--dq DQ.npy --dk
//!   DK.npy --dv DV.npy]` (inputs from files): after the forward, the backward of the same
//!   inputs, timed, its gradients written (files) and checked against the float64 gradient
//!   oracle by the rule of `docs/backward.md` (skipped when expensive, as the forward's check);
//! - `fa4 check --backward`: the gradient matrix ([`fa4::check::grad::grad_matrix`]);
//! - `fa4 bench --backward`: backward GFLOP/s (2.5 × the forward's FLOPs) beside the forward's
//!   from the same run and the machine's FMA peak.
//!
//! `--backend cuda` runs the GPU backward kernels (fp16/bf16); `--backend auto` computes a
//! requested backward (and its forward) on the CPU, which computes every dtype.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;
use rand::rngs::StdRng;
use rand::SeedableRng;
use serde::Serialize;

use fa4::check::grad::{check_grads, grad_matrix, run_grad_case, view_args, GradsView};
use fa4::check::{random_fill, random_qkv};
use fa4::cpu::{peak, CpuBackend, Isa};
use fa4::npy::{self, Data, NpyDType};
use fa4::tensor::Layout;
use fa4::{Backend, BackwardOptions, DType, Element, Error, Options, Problem, Result};

use super::bench_cuda::Shape;
use super::run::{skip_reason, CheckPolicy};
use super::BackendArg;

/// Backward FLOPs as a multiple of the forward's: the forward's two products are recomputed
/// or mirrored as five (S, dP, dV, dK, dQ), the convention of FlashAttention's benchmarks.
pub const BACKWARD_FLOP_FACTOR: f64 = 2.5;

/// The gradient oracle's multiply-adds per allowed (query, key) pair and head, as a multiple of
/// the forward oracle's (`head_dim + head_dim_v`): scores and O, then dP, dV, dQ, dK.
const ORACLE_COST_FACTOR: f64 = 3.0;

/// `fa4 run`'s backward flags.
#[derive(Args, Debug, Default)]
pub struct GradArgs {
    /// Also compute the backward (dQ, dK, dV) for a random upstream gradient dO, and check it
    /// against the float64 gradient oracle.
    #[arg(long, help_heading = "Backward")]
    backward: bool,
    /// Upstream gradient dO (float32 or float16 .npy, O's shape): computes the backward of the
    /// files' inputs.
    #[arg(long = "do", value_name = "DO.npy", help_heading = "Backward")]
    d_out: Option<PathBuf>,
    /// Where dQ is written (float32 .npy, Q's shape); needs --do.
    #[arg(long, value_name = "DQ.npy", help_heading = "Backward")]
    dq: Option<PathBuf>,
    /// Where dK is written (float32 .npy, K's shape); needs --do.
    #[arg(long, value_name = "DK.npy", help_heading = "Backward")]
    dk: Option<PathBuf>,
    /// Where dV is written (float32 .npy, V's shape); needs --do.
    #[arg(long, value_name = "DV.npy", help_heading = "Backward")]
    dv: Option<PathBuf>,
    /// The deterministic backward: dQ summed in a fixed order, the same bits on every run
    /// (needs --backward or --do).
    #[arg(long, help_heading = "Backward")]
    deterministic: bool,
}

impl GradArgs {
    /// With a backward asked for, [`plan_on`] `backend` for `p` in the asked mode.
    pub fn plan(&self, backend: &Backend, p: &Problem) -> Result<()> {
        if self.wanted() {
            plan_on(backend, p, self.deterministic)
        } else {
            Ok(())
        }
    }

    /// Whether a backward is asked for.
    pub fn wanted(&self) -> bool {
        self.backward || self.d_out.is_some()
    }

    /// Checks the flags against the kind of run (`files`: inputs from .npy files).
    pub fn validate(&self, files: bool) -> Result<()> {
        if self.deterministic && !self.wanted() {
            return Err(Error::invalid(
                "--deterministic",
                "asks for the deterministic backward: give --backward (or --do on files)",
            ));
        }
        let outputs = [
            ("--dq", self.dq.is_some()),
            ("--dk", self.dk.is_some()),
            ("--dv", self.dv.is_some()),
        ];
        if !files {
            for (flag, given) in [("--do", self.d_out.is_some())].into_iter().chain(outputs) {
                if given {
                    return Err(Error::invalid(
                        flag,
                        "belongs to a backward on files; give --q, --k, --v and --do too \
                         (a random problem takes --backward)",
                    ));
                }
            }
            return Ok(());
        }
        if self.d_out.is_none() {
            if self.backward {
                return Err(Error::invalid(
                    "--backward",
                    "on inputs from files the backward needs the upstream gradient: --do DO.npy",
                ));
            }
            if let Some((flag, _)) = outputs.into_iter().find(|o| o.1) {
                return Err(Error::invalid(
                    flag,
                    "needs --do DO.npy (the upstream gradient)",
                ));
            }
        }
        Ok(())
    }

    /// The first backward flag given, if any (for the runs that have no backward).
    pub fn first_given(&self) -> Option<&'static str> {
        [
            ("--backward", self.backward),
            ("--do", self.d_out.is_some()),
            ("--dq", self.dq.is_some()),
            ("--dk", self.dk.is_some()),
            ("--dv", self.dv.is_some()),
            ("--deterministic", self.deterministic),
        ]
        .into_iter()
        .find(|&(_, given)| given)
        .map(|(flag, _)| flag)
    }

    /// The file the backward reads (`--do`), with its flag.
    pub fn input(&self) -> Option<(&'static str, &Path)> {
        self.d_out.as_deref().map(|p| ("--do", p))
    }

    /// The files the backward writes, with their flags.
    pub fn outputs(&self) -> Vec<(&'static str, &Path)> {
        [("--dq", &self.dq), ("--dk", &self.dk), ("--dv", &self.dv)]
            .into_iter()
            .filter_map(|(flag, p)| p.as_deref().map(|p| (flag, p)))
            .collect()
    }
}

/// The backend `fa4 run` uses: the CPU when a backward is asked for and the backend was left
/// to `auto` (no GPU backward yet, and a forward on the GPU beside a backward on the CPU would
/// not be one computation), else what `arg` resolves to.
pub fn resolve_backend(grad: &GradArgs, arg: BackendArg) -> Result<Backend> {
    if grad.wanted() && arg == BackendArg::Auto {
        eprintln!(
            "fa4: --backend auto chose cpu for the backward (--backend cuda runs it on the GPU)"
        );
        Ok(Backend::Cpu)
    } else {
        arg.resolve()
    }
}

/// Plans the backward of `p` on `backend` without running anything (on the CPU every valid
/// problem plans), so that a refusal (a head dim or size the GPU kernels do not take) comes
/// before the forward's work and output.
pub fn plan_on(backend: &Backend, p: &Problem, deterministic: bool) -> Result<()> {
    let Backend::Cuda(cuda) = backend else {
        return Ok(());
    };
    match cuda.plan_backward_sm90(p, deterministic)? {
        Some(_) => Ok(()),
        None => cuda.plan_backward(p, deterministic).map(drop),
    }
}

/// A finished forward: the problem (contiguous tensors), its inputs and outputs.
pub struct Forward<'a, T> {
    pub p: &'a Problem,
    pub q: &'a [T],
    pub k: &'a [T],
    pub v: &'a [T],
    pub o: &'a [T],
    pub lse: &'a [f32],
}

/// A random upstream gradient dO for the problem `p`, drawn from `seed`.
pub fn random_d_out<T: Element>(p: &Problem, seed: u64) -> Vec<T> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x6772_6164);
    let mut d_out = vec![T::NAN; p.o_layout().numel()];
    random_fill(&mut rng, &mut d_out, p.head_dim_v(), 1.0);
    d_out
}

/// dO from `--do`, checked against O's shape (`None` without `--do`). Read before anything is
/// computed, so a bad file is an error before the forward's work.
pub fn read_d_out<T: Element>(p: &Problem, grad: &GradArgs) -> Result<Option<Vec<T>>> {
    let Some(path) = grad.d_out.as_deref() else {
        return Ok(None);
    };
    let a = npy::read_as(path, "--do", &[NpyDType::F32, NpyDType::F16])?;
    let want = view_args(p.o_layout()).0;
    if a.shape != want {
        return Err(Error::invalid(
            "--do",
            format!(
                "`{}` has shape {:?}; dO has O's shape {want:?}",
                path.display(),
                a.shape
            ),
        ));
    }
    Ok(Some(match a.data {
        Data::F32(x) => x.into_iter().map(T::from_f32).collect(),
        Data::F16(x) => x.into_iter().map(|e| T::from_f32(e.to_f32())).collect(),
        Data::I32(_) | Data::U8(_) => unreachable!("read_as admits only float32 and float16"),
    }))
}

/// The gradients of one backward call, its upstream gradient and its time.
pub struct Grads<T> {
    d_out: Vec<T>,
    dq: Vec<T>,
    dk: Vec<T>,
    dv: Vec<T>,
    elapsed: Duration,
}

/// Runs the backward of `f` for the upstream gradient `d_out` once, on NaN-poisoned gradients
/// (an unwritten element fails the check).
pub fn compute<T: Element>(
    f: &Forward<'_, T>,
    backend: &Backend,
    d_out: Vec<T>,
    grad: &GradArgs,
) -> Result<Grads<T>> {
    let p = f.p;
    let mut dq = vec![T::NAN; f.q.len()];
    let mut dk = vec![T::NAN; f.k.len()];
    let mut dv = vec![T::NAN; f.v.len()];
    let cu = fa4::check::grad::cu_seqlens(p);
    let cu_ref = cu.as_ref().map(|(a, b)| (a.as_slice(), b.as_slice()));
    let opts = BackwardOptions::new(attention_options(p)).deterministic(grad.deterministic);
    let t0 = Instant::now();
    fa4::check::grad::run_backward(
        backend,
        p,
        cu_ref,
        [f.q, f.k, f.v, f.o],
        f.lse,
        &d_out,
        [&mut dq, &mut dk, &mut dv],
        &opts,
    )
    .map_err(|e| match e {
        Error::InvalidArgument { name, reason } if name == "backend" => {
            Error::invalid("--backend", reason)
        }
        e => e,
    })?;
    Ok(Grads {
        d_out,
        dq,
        dk,
        dv,
        elapsed: t0.elapsed(),
    })
}

impl<T: Element> Grads<T> {
    /// Writes the gradients `grad` names (`--dq/--dk/--dv`, float32) to temporary files beside
    /// their destinations, to be committed with the forward's outputs; returns them and the
    /// lines that say what was written.
    pub fn stage(&self, p: &Problem, grad: &GradArgs) -> Result<(Vec<npy::Staged>, Vec<String>)> {
        let mut staged = Vec::new();
        let mut wrote = Vec::new();
        for (flag, path, data, l) in [
            ("--dq", &grad.dq, &self.dq, p.q_layout()),
            ("--dk", &grad.dk, &self.dk, p.k_layout()),
            ("--dv", &grad.dv, &self.dv, p.v_layout()),
        ] {
            if let Some(path) = path {
                let shape = view_args(l).0;
                let x: Vec<f32> = data.iter().map(|e| e.to_f32()).collect();
                staged.push(npy::stage(path, flag, &shape, &x)?);
                wrote.push(format!(
                    "{} {shape:?} float32 to `{}`",
                    &flag[2..].to_uppercase(),
                    path.display()
                ));
            }
        }
        Ok((staged, wrote))
    }

    /// Prints the backward's time, what was written, and the gradient check's verdict (or why
    /// it was skipped); returns whether the check passed or was skipped.
    pub fn report(&self, f: &Forward<'_, T>, wrote: &[String], policy: CheckPolicy) -> bool {
        let p = f.p;
        let secs = self.elapsed.as_secs_f64();
        let gflop = BACKWARD_FLOP_FACTOR * p.flops() / 1e9;
        let rate = if secs > 0.0 && gflop > 0.0 {
            format!("{:.1} GFLOP/s", gflop / secs)
        } else {
            "n/a GFLOP/s".into()
        };
        println!(
            "backward {:.3} ms, {rate} (one call; {BACKWARD_FLOP_FACTOR} × the forward's FLOPs)",
            secs * 1e3
        );
        for w in wrote {
            println!("wrote    {w}");
        }
        let passes = if p.dtype() == DType::F32 { 1.0 } else { 2.0 };
        let cost = passes * ORACLE_COST_FACTOR * p.flops() / 2.0;
        if let Some(why) = skip_reason(policy, cost) {
            println!("grads    {why}");
            return true;
        }
        let t0 = Instant::now();
        let got = GradsView {
            dq: (&self.dq, p.q_layout()),
            dk: (&self.dk, p.k_layout()),
            dv: (&self.dv, p.v_layout()),
        };
        let report = check_grads(p, f.q, f.k, f.v, f.o, &self.d_out, p.o_layout(), got);
        println!(
            "grads    {report} (float64 gradient oracle, {:.2} s)",
            t0.elapsed().as_secs_f64()
        );
        report.passed()
    }
}

/// The forward's options as the problem resolved them.
fn attention_options(p: &Problem) -> Options {
    let mut o = Options::new().mask(p.mask()).scale(p.scale());
    if let Some(c) = p.softcap() {
        o = o.softcap(c);
    }
    o
}

/// `fa4 check --backward`: the gradient matrix on `backend` (the CPU when `--backend` was
/// left to auto). One line per case, then `N passed, M failed`; exit code 1 if any failed.
pub fn check(
    backend: Backend,
    auto: bool,
    dtypes: &[DType],
    head_dims: &[usize],
    seed: u64,
) -> Result<ExitCode> {
    let backend = if auto { Backend::Cpu } else { backend };
    let cases = grad_matrix(dtypes, head_dims);
    let n = cases.len();
    let width = n.to_string().len();
    println!(
        "checking the gradients of {n} cases on {} against the float64 gradient oracle (seed {seed})",
        backend.name()
    );
    let t0 = Instant::now();
    let (mut passed, mut failed) = (0usize, 0usize);
    for (i, case) in cases.iter().enumerate() {
        let verdict = match run_grad_case(&backend, case, seed.wrapping_add(i as u64)) {
            Ok(r) => {
                if r.passed() {
                    passed += 1;
                } else {
                    failed += 1;
                }
                r.to_string()
            }
            Err(e) => {
                failed += 1;
                format!("FAIL: error: {e}")
            }
        };
        println!("case {:>width$}/{n} {case}: {verdict}", i + 1);
    }
    println!("took {:.2} s", t0.elapsed().as_secs_f64());
    println!("{passed} passed, {failed} failed");
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// `b×h` for a shape: `batch×heads`, and `/kv_heads` where they differ.
fn bh(s: &Shape) -> String {
    if s.kv_heads == s.heads {
        format!("{}×{}", s.batch, s.heads)
    } else {
        format!("{}×{}/{}", s.batch, s.heads, s.kv_heads)
    }
}

/// The grid of `fa4 bench --backward`, from `fa4 bench`'s flags: `--seqlens` × `--head-dims` ×
/// `--causal` ([`BenchGrid::product`]) or, on CUDA, the shapes `--grid` names.
pub struct BenchGrid {
    pub shapes: Vec<Shape>,
    /// The flag that set the shapes (`--seqlens` or `--grid`), for errors about their size.
    pub flag: &'static str,
    pub dtype: DType,
    pub reps: usize,
    pub warmup: usize,
    /// Back-to-back calls per timed round (CUDA; `--calls`).
    pub calls: usize,
    pub json: bool,
    /// Packed varlen batches of these lengths in place of each shape's sequences (CUDA;
    /// `--lengths`, `--varlen`).
    pub lengths: Option<Vec<usize>>,
}

/// Query rows per shape when `--heads` is not given (as `fa4 bench`).
const DEFAULT_ROWS: usize = 8192;

impl BenchGrid {
    /// The shapes of `head_dims` × `seqlens` × `masks` (in that nesting), `batch` sequences of
    /// `heads` heads each (`None`: 8192 / seqlen, at least 1, as the forward bench).
    pub fn product(
        seqlens: &[usize],
        head_dims: &[usize],
        masks: &[bool],
        batch: usize,
        heads: Option<usize>,
    ) -> Vec<Shape> {
        let mut shapes = Vec::new();
        for &head_dim in head_dims {
            for &seqlen in seqlens {
                for &causal in masks {
                    let heads = heads.unwrap_or((DEFAULT_ROWS / seqlen.max(1)).max(1));
                    shapes.push(Shape {
                        seqlen,
                        d: head_dim,
                        dv: head_dim,
                        causal,
                        batch,
                        heads,
                        kv_heads: heads,
                    });
                }
            }
        }
        shapes
    }
}

#[derive(Debug, Serialize)]
struct BenchRow {
    seqlen: usize,
    head_dim: usize,
    causal: bool,
    batch: usize,
    heads: usize,
    kv_heads: usize,
    dtype: String,
    /// Backward FLOPs: 2.5 × the forward's.
    flops: f64,
    backward_ms: f64,
    backward_gflops: f64,
    forward_ms: f64,
    forward_gflops: f64,
    /// Backward time over forward time.
    time_ratio: f64,
    pct_of_peak: f64,
}

/// One shape's row of `fa4 bench --backward --backend cuda --json`.
#[derive(Debug, Serialize)]
struct CudaBenchRow {
    seqlen: usize,
    head_dim: usize,
    head_dim_v: usize,
    causal: bool,
    batch: usize,
    heads: usize,
    kv_heads: usize,
    dtype: String,
    calls: usize,
    rounds: usize,
    /// Backward FLOPs: 2.5 × the forward's.
    flops: f64,
    /// Median round, per call: atomic dQ, then the deterministic mode.
    backward_ms: f64,
    tflops: f64,
    deterministic_ms: f64,
    deterministic_tflops: f64,
    /// A packed varlen batch's lengths (`--lengths`, `--varlen`): `batch` of them, the longest
    /// `seqlen`.
    #[serde(skip_serializing_if = "Option::is_none")]
    lengths: Option<Vec<usize>>,
}

/// `fa4 bench --backward --backend cuda`: per shape, the median of `reps` rounds of one CUDA
/// event pair around `calls` back-to-back backward calls (bench/peers.py times the peers the
/// same way), atomic dQ and deterministic.
pub fn bench_cuda(g: &BenchGrid, cuda: &fa4::cuda::CudaBackend) -> Result<()> {
    use fa4::cuda::backward::time_backward;
    if !matches!(g.dtype, DType::F16 | DType::Bf16) {
        return Err(Error::invalid(
            "--dtype",
            format!("the CUDA backward computes fp16 and bf16, not {}", g.dtype),
        ));
    }
    if g.reps == 0 || g.calls == 0 {
        return Err(Error::invalid("--reps/--calls", "must be ≥ 1"));
    }
    // Every shape is a valid problem that this GPU's backward plans, in both modes, before the
    // table starts: an error, naming the flag that set the shape, is the only output.
    let problems = g
        .shapes
        .iter()
        .map(|s| s.problem(g.dtype, g.flag, g.lengths.as_deref()))
        .collect::<Result<Vec<_>>>()?;
    let backend = Backend::Cuda(cuda.clone());
    for (s, p) in g.shapes.iter().zip(&problems) {
        for det in [false, true] {
            match plan_on(&backend, p, det) {
                // What the shape set (head dims, sizes); anything else (an environment
                // variable, the device) as it is.
                Err(Error::InvalidArgument { name, reason })
                    if matches!(name.as_str(), "q" | "k" | "v" | "out") =>
                {
                    return Err(Error::invalid(
                        g.flag,
                        format!("d {} seqlen {}: {name}: {reason}", s.d_label(), s.seqlen),
                    ));
                }
                Err(e) => return Err(e),
                Ok(()) => {}
            }
        }
    }
    if !g.json {
        println!(
            "fa4 bench --backward --backend cuda: {} on {}; median of {} rounds of {} calls; FLOPs = {BACKWARD_FLOP_FACTOR} × forward",
            g.dtype,
            cuda.info().name,
            g.reps,
            g.calls
        );
        if let Some(l) = &g.lengths {
            println!("{}", super::bench_cuda::lengths_line(l, "seqlen and b"));
        }
        println!(
            "{:>7} {:>7} {:>6} {:>9} {:>9} {:>9} {:>9}",
            "seqlen", "d", "causal", "b×h", "bwd ms", "TFLOP/s", "det TF/s"
        );
    }
    let mut rows = Vec::new();
    for (s, p) in g.shapes.iter().zip(&problems) {
        let med = |det: bool| -> Result<f64> {
            let warmup = g.warmup.max(1);
            let mut ms = match g.dtype {
                DType::F16 => time_backward::<half::f16>(cuda, p, det, warmup, g.reps, g.calls)?,
                _ => time_backward::<half::bf16>(cuda, p, det, warmup, g.reps, g.calls)?,
            };
            ms.sort_by(f64::total_cmp);
            Ok(ms[ms.len() / 2])
        };
        let (ms, det) = (med(false)?, med(true)?);
        let flops = BACKWARD_FLOP_FACTOR * p.flops();
        if !g.json {
            println!(
                "{:>7} {:>7} {:>6} {:>9} {:>9.3} {:>9.1} {:>9.1}",
                s.seqlen,
                s.d_label(),
                if s.causal { "yes" } else { "no" },
                bh(s),
                ms,
                flops / ms / 1e9,
                flops / det / 1e9
            );
        }
        rows.push(CudaBenchRow {
            seqlen: s.seqlen,
            head_dim: s.d,
            head_dim_v: s.dv,
            causal: s.causal,
            batch: s.batch,
            heads: s.heads,
            kv_heads: s.kv_heads,
            dtype: g.dtype.to_string(),
            calls: g.calls,
            rounds: g.reps,
            flops,
            backward_ms: ms,
            tflops: flops / ms / 1e9,
            deterministic_ms: det,
            deterministic_tflops: flops / det / 1e9,
            lengths: g.lengths.clone(),
        });
    }
    if g.json {
        let r = serde_json::json!({
            "backend": "cuda",
            "pass": "backward",
            "device": cuda.info().name,
            "results": rows,
        });
        println!("{r}");
    }
    Ok(())
}

/// Median of `reps` timed calls after `warmup` untimed ones, in seconds.
fn time(warmup: usize, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..warmup {
        f()?;
    }
    let mut t = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t0 = Instant::now();
        f()?;
        t.push(t0.elapsed().as_secs_f64());
    }
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

/// `fa4 bench --backward` on the CPU (inside the bench's thread pool).
pub fn bench(g: &BenchGrid) -> Result<()> {
    if g.dtype == DType::Fp8E4M3 {
        return Err(Error::invalid("--dtype", "fp8 is not computed yet"));
    }
    let threads = rayon::current_num_threads();
    let peaks = peak::measure_all(0.05, 5);
    let best = peaks[0].gflops;
    if !g.json {
        println!(
            "fa4 bench --backward --backend cpu: {}, {threads} threads, {} kernels, f32 FMA peak {best:.1} GFLOP/s",
            g.dtype,
            Isa::selected().name()
        );
        println!(
            "median of {} runs after {} warm-up; backward FLOPs = {BACKWARD_FLOP_FACTOR} × forward; \
             the forward of the same shape from the same run beside it",
            g.reps, g.warmup
        );
        println!(
            "{:>7} {:>4} {:>6} {:>7} {:>9} {:>11} {:>11} {:>8} {:>6}",
            "seqlen",
            "d",
            "causal",
            "b×h",
            "bwd ms",
            "bwd GFLOP/s",
            "fwd GFLOP/s",
            "bwd/fwd",
            "%peak"
        );
    }
    let mut rows = Vec::new();
    for s in &g.shapes {
        let row = match g.dtype {
            DType::F32 => bench_shape::<f32>(g, s, best)?,
            DType::F16 => bench_shape::<half::f16>(g, s, best)?,
            DType::Bf16 => bench_shape::<half::bf16>(g, s, best)?,
            DType::Fp8E4M3 => unreachable!("rejected above"),
        };
        if !g.json {
            println!(
                "{:>7} {:>4} {:>6} {:>7} {:>9.2} {:>11.1} {:>11.1} {:>8.2} {:>5.1}%",
                s.seqlen,
                s.d,
                if s.causal { "yes" } else { "no" },
                bh(s),
                row.backward_ms,
                row.backward_gflops,
                row.forward_gflops,
                row.time_ratio,
                row.pct_of_peak
            );
        }
        rows.push(row);
    }
    if g.json {
        #[derive(Serialize)]
        struct Report {
            backend: &'static str,
            pass: &'static str,
            threads: usize,
            isa: &'static str,
            fma_peak_gflops: f64,
            reps: usize,
            warmup: usize,
            results: Vec<BenchRow>,
        }
        let r = Report {
            backend: "cpu",
            pass: "backward",
            threads,
            isa: Isa::selected().name(),
            fma_peak_gflops: best,
            reps: g.reps,
            warmup: g.warmup,
            results: rows,
        };
        println!(
            "{}",
            serde_json::to_string(&r).map_err(|e| Error::invalid("--json", e.to_string()))?
        );
    }
    Ok(())
}

fn bench_shape<T: Element>(g: &BenchGrid, shape: &Shape, peak: f64) -> Result<BenchRow> {
    let (b, s, h, d) = (shape.batch, shape.seqlen, shape.heads, shape.d);
    let l = Layout::new(g.flag, &[b, s, h, d], None)?;
    let lk = Layout::new(g.flag, &[b, s, shape.kv_heads, d], None)?;
    // Size the shape before allocating, as the forward bench does: Q, O, dO, dQ and K, V, dK,
    // dV of the storage dtype, the f32 dQ the backward sums into, LSE and D per row.
    // `--batch 100000` aborted on a 200 GB allocation.
    let size = T::DTYPE.size_bytes() as f64;
    let (q_elems, k_elems) = (l.numel() as f64, lk.numel() as f64);
    let rows = (b as f64) * (s as f64) * (h as f64);
    super::memory::ensure(
        g.flag,
        &format!("seqlen {s}, d {d}, b×h {}", bh(shape)),
        q_elems * (4.0 * size + 4.0) + k_elems * 4.0 * size + 16.0 * rows,
    )?;
    let p = shape.problem(T::DTYPE, g.flag, None)?;
    let opts = attention_options(&p);
    let (n, nk) = (l.numel(), lk.numel());
    let mut rng = StdRng::seed_from_u64(0x5eed ^ (s * 131 + d) as u64);
    let (mut q, mut k, mut v, mut d_out) = (
        vec![T::from_f32(0.0); n],
        vec![T::from_f32(0.0); nk],
        vec![T::from_f32(0.0); nk],
        vec![T::from_f32(0.0); n],
    );
    random_qkv(&mut rng, &mut q, &mut k, &mut v, d, d);
    random_fill(&mut rng, &mut d_out, d, 1.0);
    let mut o = vec![T::NAN; n];
    let mut lse = vec![f32::NAN; p.lse_len()];
    let cpu = CpuBackend::default();
    let fwd_s = time(g.warmup, g.reps, || {
        cpu.forward(&p, &q, &k, &v, &mut o, Some(&mut lse))
    })?;
    let (mut dq, mut dk, mut dv) = (vec![T::NAN; n], vec![T::NAN; nk], vec![T::NAN; nk]);
    let backend = Backend::CpuWith(cpu);
    let bopts: BackwardOptions = opts.into();
    let bwd_s = time(g.warmup, g.reps, || {
        fa4::check::grad::run_backward(
            &backend,
            &p,
            None,
            [&q, &k, &v, &o],
            &lse,
            &d_out,
            [&mut dq, &mut dk, &mut dv],
            &bopts,
        )
    })?;
    let flops = BACKWARD_FLOP_FACTOR * p.flops();
    let backward_gflops = flops / bwd_s / 1e9;
    Ok(BenchRow {
        seqlen: s,
        head_dim: d,
        causal: shape.causal,
        batch: b,
        heads: h,
        kv_heads: shape.kv_heads,
        dtype: T::DTYPE.to_string(),
        flops,
        backward_ms: bwd_s * 1e3,
        backward_gflops,
        forward_ms: fwd_s * 1e3,
        forward_gflops: p.flops() / fwd_s / 1e9,
        time_ratio: bwd_s / fwd_s,
        pct_of_peak: 100.0 * backward_gflops / peak,
    })
}
