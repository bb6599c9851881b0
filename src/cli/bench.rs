//! `fa4 bench`: GFLOP/s of a backend over a grid of shapes, beside its peers measured in the
//! same run.
//!
//! On the CPU the peers are the materialised evaluation ([`fa4::cpu::materialized`], candle's
//! passes: the whole score matrix, scale, mask, `softmax_last_dim`, second product, with the
//! same microkernels and threads; `--fused-peer` adds its fused variant) and this machine's f32
//! FMA peak ([`fa4::cpu::peak`], measured at the start of the run). Every number is the median
//! of `--reps` timed runs after `--warmup` untimed ones, on random normal inputs (a few rows
//! scaled up, as in the tests); FLOPs come from [`Problem::flops`] for fa4 and the peer alike
//! (useful FLOPs: causal is half), so their ratio is a time ratio. The peer's output is
//! compared with fa4's (`max_abs_diff` in `--json`).
//!
//! Default grid: seqlens 512–8192, d = 64 and 128, with and without a causal mask, f32, batch 1
//! and `8192 / seqlen` heads (16 at 512, 1 at 8192): every shape does the same number of query
//! rows, so a run takes 5–200 ms and even the shortest gives every thread dozens of work items.
//! The whole default bench takes about a minute on a 2-core machine (70 s with `--fused-peer`).

use std::time::Instant;

use clap::{Args, ValueEnum};
use rand::rngs::StdRng;
use rand::SeedableRng;
use serde::Serialize;

use fa4::check::random_qkv;
use fa4::cpu::materialized::{self, Style};
use fa4::cpu::{peak, CpuBackend, Isa};
use fa4::tensor::Layout;
use fa4::{DType, Element, Error, Options, Problem, Result};

use super::BackendArg;

#[path = "decode_bench.rs"]
mod decode_bench;

/// Query rows per run when `--heads` is not given: heads = this / seqlen (at least 1), so that
/// short sequences still give runs long enough to time and enough work items for every thread.
const DEFAULT_ROWS: usize = 8192;
/// `--seqlens` when not given.
const DEFAULT_SEQLENS: [usize; 5] = [512, 1024, 2048, 4096, 8192];
/// `--head-dims` when not given.
const DEFAULT_HEAD_DIMS: [usize; 2] = [64, 128];

/// The materialised peer is skipped when its score matrix would exceed this many bytes.
const MATERIALIZED_LIMIT_BYTES: usize = 4 << 30;

/// Which masks to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CausalArg {
    /// Each shape without a mask, then causal.
    Both,
    /// Causal only.
    On,
    /// No mask only.
    Off,
}

impl CausalArg {
    /// Each run's mask: causal or not.
    fn masks(self) -> &'static [bool] {
        match self {
            CausalArg::Both => &[false, true],
            CausalArg::On => &[true],
            CausalArg::Off => &[false],
        }
    }
}

/// The flags of `fa4 bench`. Each pass (the forward, `--backward`, `--decode`, `--cp`, on the
/// CPU or `--backend cuda`) reads some of them and refuses, by name, one it would not read
/// ([`Pass::reads`]); so a flag whose reading depends on the pass is an `Option` (its default
/// in the help text), which tells a flag given from one left out.
#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Backend to benchmark.
    #[arg(long, value_enum, default_value_t = BackendArg::Cpu)]
    backend: BackendArg,
    /// Sequence lengths (seqlen_q = seqlen_k), comma-separated [default: 512,1024,2048,4096,8192].
    #[arg(long, value_delimiter = ',')]
    seqlens: Option<Vec<usize>>,
    /// Head dimensions (head_dim = head_dim_v), comma-separated [default: 64,128].
    #[arg(long, value_delimiter = ',')]
    head_dims: Option<Vec<usize>>,
    /// Masks: both (none, then causal), on (causal only) or off (none only) [default: both].
    #[arg(long, value_enum)]
    causal: Option<CausalArg>,
    /// Storage dtype: f32, fp16 or bf16.
    #[arg(long, default_value = "f32")]
    dtype: DType,
    /// Batch size [default: 1].
    #[arg(long)]
    batch: Option<usize>,
    /// Heads (query and KV) [default: max(1, 8192 / seqlen): the same query rows per shape].
    #[arg(long)]
    heads: Option<usize>,
    /// Timed runs per shape and implementation; the median is reported (CUDA: rounds of
    /// `--calls` back-to-back calls).
    #[arg(long, default_value_t = 7)]
    reps: usize,
    /// Untimed warm-up runs before the timed ones.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Worker threads [default: all cores].
    #[arg(long)]
    threads: Option<usize>,
    /// Skip the materialised peer.
    #[arg(long)]
    no_materialized: bool,
    /// Also time the materialised evaluation with its softmax passes fused into one in-place,
    /// vectorised pass (a stronger peer than candle's passes).
    #[arg(long)]
    fused_peer: bool,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Time the backward pass (dQ, dK, dV; FLOPs 2.5 × the forward's) beside the forward
    /// (CUDA: of the --seqlens × --head-dims grid, or of the shapes --grid names).
    #[arg(long)]
    backward: bool,
    /// CUDA-only flags (`--backend cuda`).
    #[command(flatten)]
    cuda: super::bench_cuda::CudaBenchArgs,
    /// Decode over a paged KV cache (`src/cli/decode_bench.rs`).
    #[command(flatten)]
    decode: decode_bench::DecodeBenchArgs,
    /// Context parallelism (`--cp N`: scaling against one call).
    #[command(flatten)]
    cp: super::cp::CpArgs,
}

/// One shape's measurements.
#[derive(Debug, Serialize)]
struct Row {
    seqlen: usize,
    head_dim: usize,
    causal: bool,
    batch: usize,
    heads: usize,
    dtype: String,
    flops: f64,
    fa4_ms: f64,
    fa4_gflops: f64,
    materialized_ms: Option<f64>,
    materialized_gflops: Option<f64>,
    /// fa4 GFLOP/s over the materialised evaluation's (= its time over fa4's).
    ratio: Option<f64>,
    /// fa4 GFLOP/s as a percentage of the measured FMA peak.
    pct_of_peak: f64,
    /// `max|O_fa4 − O_materialised|`, a cross-check of the two.
    max_abs_diff: Option<f64>,
    /// The fused materialised evaluation (`--fused-peer`).
    fused_ms: Option<f64>,
    fused_gflops: Option<f64>,
    fused_ratio: Option<f64>,
}

#[derive(Debug, Serialize)]
struct PeakJson {
    isa: &'static str,
    gflops: f64,
}

#[derive(Debug, Serialize)]
struct Report {
    backend: &'static str,
    cpu: String,
    threads: usize,
    isa: &'static str,
    fma_peak_gflops: f64,
    fma_peaks: Vec<PeakJson>,
    reps: usize,
    warmup: usize,
    results: Vec<Row>,
}

/// Which pass `fa4 bench` times.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pass {
    Forward,
    Backward,
    Decode,
    Cp,
}

/// The prefill grid's shape flags, read by the CPU forward, `--backward` and `--cp`.
const SHAPE_FLAGS: [&str; 5] = ["--seqlens", "--head-dims", "--causal", "--batch", "--heads"];

impl Pass {
    /// The pass as typed, on the CPU or on the GPU.
    fn name(self, cuda: bool) -> &'static str {
        match (self, cuda) {
            (Pass::Forward, false) => "`fa4 bench` on the CPU",
            (Pass::Forward, true) => "`fa4 bench --backend cuda`",
            (Pass::Backward, false) => "`fa4 bench --backward` on the CPU",
            (Pass::Backward, true) => "`fa4 bench --backward --backend cuda`",
            (Pass::Decode, false) => "`fa4 bench --decode` on the CPU",
            (Pass::Decode, true) => "`fa4 bench --decode --backend cuda`",
            (Pass::Cp, false) => "`fa4 bench --cp` on the CPU",
            (Pass::Cp, true) => "`fa4 bench --cp --backend cuda`",
        }
    }

    /// The flags of [`BenchArgs::given`] the pass reads (every pass reads --backend, --dtype,
    /// --reps and --warmup; `--decode` also its own flags, which `DecodeBenchArgs::stray`
    /// checks).
    fn reads(self, cuda: bool) -> Vec<&'static str> {
        let mut r: Vec<&str> = match (self, cuda) {
            (Pass::Forward, false) | (Pass::Backward, false) | (Pass::Cp, _) => {
                SHAPE_FLAGS.to_vec()
            }
            (Pass::Backward, true) => [
                &SHAPE_FLAGS[..],
                &["--grid", "--tokens", "--hidden", "--lengths", "--varlen"],
            ]
            .concat(),
            (Pass::Forward, true) => {
                vec!["--grid", "--tokens", "--hidden", "--lengths", "--varlen"]
            }
            (Pass::Decode, _) => vec![],
        };
        r.extend(match (self, cuda) {
            (Pass::Forward, false) => &["--threads", "--no-materialized", "--fused-peer"][..],
            (Pass::Forward, true) => &[
                "--calls",
                "--rounds-from-stdin",
                "--tiles",
                "--sm90-tiles",
                "--device",
                "--kernel",
            ][..],
            (Pass::Backward, false) => &["--threads"][..],
            (Pass::Backward, true) => &["--calls", "--device", "--kernel"][..],
            // The GPU decode bench checks its output against the CPU's.
            (Pass::Decode, _) => &["--threads"][..],
            (Pass::Cp, _) => &["--threads", "--cp-split"][..],
        });
        r.push("--json");
        r
    }
}

impl BenchArgs {
    /// The flags whose reading depends on the pass, each with whether it was given.
    fn given(&self) -> [(&'static str, bool); 21] {
        let c = &self.cuda;
        [
            ("--seqlens", self.seqlens.is_some()),
            ("--head-dims", self.head_dims.is_some()),
            ("--causal", self.causal.is_some()),
            ("--batch", self.batch.is_some()),
            ("--heads", self.heads.is_some()),
            ("--threads", self.threads.is_some()),
            ("--no-materialized", self.no_materialized),
            ("--fused-peer", self.fused_peer),
            ("--json", self.json),
            ("--grid", !c.grid.is_empty()),
            ("--tokens", c.tokens.is_some()),
            ("--hidden", c.hidden.is_some()),
            ("--calls", c.calls.is_some()),
            ("--rounds-from-stdin", c.rounds_from_stdin),
            ("--tiles", c.tiles.is_some()),
            ("--sm90-tiles", c.sm90_tiles.is_some()),
            ("--device", c.device.is_some()),
            ("--kernel", c.kernel.is_some()),
            ("--lengths", c.lengths.is_some()),
            ("--varlen", c.varlen.is_some()),
            // `--cp-split zigzag`, the default, cannot be told from no flag (cp.rs's CpArgs).
            (
                "--cp-split",
                self.cp.cp_split != fa4::cp::SplitKind::default(),
            ),
        ]
    }

    /// `--seqlens`, or its default.
    fn seqlens(&self) -> &[usize] {
        self.seqlens.as_deref().unwrap_or(&DEFAULT_SEQLENS)
    }
    /// `--head-dims`, or its default.
    fn head_dims(&self) -> &[usize] {
        self.head_dims.as_deref().unwrap_or(&DEFAULT_HEAD_DIMS)
    }
    /// Each shape's masks (`--causal`, default both).
    fn masks(&self) -> &'static [bool] {
        self.causal.unwrap_or(CausalArg::Both).masks()
    }
    /// `--batch`, or 1.
    fn batch(&self) -> usize {
        self.batch.unwrap_or(1)
    }

    /// The pass the flags ask for, and whether it runs on CUDA (`--backend auto` benchmarks
    /// the CPU), after the refusals of flags that pick two passes.
    fn pass(&self) -> Result<(Pass, bool)> {
        if let Some(flag) = self.decode.stray() {
            return Err(Error::invalid(flag, "belongs to `fa4 bench --decode`"));
        }
        if self.decode.wanted() && self.backward {
            return Err(Error::invalid(
                "--backward",
                "`fa4 bench --decode` times the forward only; drop one of --decode and --backward",
            ));
        }
        if self.cp.cp.is_some() {
            for (flag, given) in [
                ("--decode", self.decode.wanted()),
                ("--backward", self.backward),
            ] {
                if given {
                    return Err(Error::invalid(
                        flag,
                        "`fa4 bench --cp` times the contiguous forward only; drop --cp or this flag",
                    ));
                }
            }
        }
        let pass = if self.cp.cp.is_some() {
            Pass::Cp
        } else if self.decode.wanted() {
            Pass::Decode
        } else if self.backward {
            Pass::Backward
        } else {
            Pass::Forward
        };
        Ok((pass, self.backend == BackendArg::Cuda))
    }

    /// An error naming the first flag given that `pass` would not read (it would be ignored
    /// without a word), and the flags the pass does read.
    fn refuse_unread(&self, pass: Pass, cuda: bool) -> Result<()> {
        let reads = pass.reads(cuda);
        let Some((flag, _)) = self
            .given()
            .into_iter()
            .find(|&(flag, given)| given && !reads.contains(&flag))
        else {
            return Ok(());
        };
        let elsewhere = if pass.reads(!cuda).contains(&flag) {
            if cuda {
                " (it applies on the CPU: --backend cpu)"
            } else {
                " (it applies with --backend cuda)"
            }
        } else {
            ""
        };
        let decode = if pass == Pass::Decode {
            "--decode-shapes, --page-size, --seqlen-q, --heads-q, --heads-kv, --head-dim, \
             --kv-dtype, "
        } else {
            ""
        };
        let (last, rest) = reads.split_last().expect("every pass reads --json");
        Err(Error::invalid(
            flag,
            format!(
                "{} does not read it{elsewhere}; that pass reads {decode}{} and {last}, beside \
                 --backend, --dtype, --reps and --warmup",
                pass.name(cuda),
                rest.join(", ")
            ),
        ))
    }

    /// The shapes of `fa4 bench --backward`: `--grid`'s on CUDA where given (then the prefill
    /// grid's shape flags are refused: they would be ignored), else the prefill grid's.
    fn backward_grid(&self, cuda: bool) -> Result<super::backward::BenchGrid> {
        let c = &self.cuda;
        let (shapes, flag) = if cuda && !c.grid.is_empty() {
            if let Some((flag, _)) = self
                .given()
                .into_iter()
                .find(|&(flag, given)| given && SHAPE_FLAGS.contains(&flag))
            {
                return Err(Error::invalid(
                    flag,
                    "--grid gives the shapes of `fa4 bench --backward --backend cuda`; give \
                     --grid or --seqlens/--head-dims/--causal/--batch/--heads, not both",
                ));
            }
            let shapes = super::bench_cuda::parse_grid(&c.grid, c.tokens(), c.hidden())?;
            (shapes, "--grid")
        } else {
            if let Some(flag) = [("--tokens", c.tokens), ("--hidden", c.hidden)]
                .into_iter()
                .find_map(|(flag, v)| v.map(|_| flag))
            {
                return Err(Error::invalid(
                    flag,
                    "sets the batch and heads of --grid's D,SEQLEN,CAUSAL shapes; give --grid \
                     too (without it the backward times the --seqlens × --head-dims grid)",
                ));
            }
            let shapes = super::backward::BenchGrid::product(
                self.seqlens(),
                self.head_dims(),
                self.masks(),
                self.batch(),
                self.heads,
            );
            (shapes, "--seqlens")
        };
        let lengths = if cuda { c.lengths()? } else { None };
        let shapes = match &lengths {
            Some(l) => shapes.into_iter().map(|s| s.packed(l)).collect(),
            None => shapes,
        };
        Ok(super::backward::BenchGrid {
            shapes,
            flag,
            dtype: self.dtype,
            reps: self.reps,
            warmup: self.warmup,
            calls: c.calls(),
            json: self.json,
            lengths,
        })
    }
}

pub fn run(args: BenchArgs) -> Result<()> {
    let (pass, cuda) = args.pass()?;
    args.refuse_unread(pass, cuda)?;
    if SHAPE_FLAGS.iter().any(|f| pass.reads(cuda).contains(f)) {
        for (name, list) in [
            ("--seqlens", args.seqlens()),
            ("--head-dims", args.head_dims()),
        ] {
            if list.is_empty() || list.contains(&0) {
                return Err(Error::invalid(name, "give one or more values, each ≥ 1"));
            }
        }
        for (name, v) in [
            ("--batch", args.batch()),
            ("--heads", args.heads.unwrap_or(1)),
        ] {
            if v == 0 {
                return Err(Error::invalid(name, "must be ≥ 1"));
            }
        }
    }
    if args.reps == 0 {
        return Err(Error::invalid("--reps", "must be ≥ 1"));
    }
    if pass.reads(cuda).contains(&"--calls") && args.cuda.calls() == 0 {
        return Err(Error::invalid("--calls", "must be ≥ 1"));
    }
    match (pass, cuda) {
        (Pass::Cp, _) => {
            let n = args.cp.cp.expect("the --cp pass");
            let plan = super::cp::BenchPlan {
                backend: args.backend,
                seqlens: args.seqlens(),
                head_dims: args.head_dims(),
                masks: args.masks(),
                dtype: args.dtype,
                batch: args.batch(),
                heads: args.heads,
                reps: args.reps,
                warmup: args.warmup,
                json: args.json,
            };
            return super::with_threads(args.threads, || super::cp::bench(&args.cp, n, &plan));
        }
        (Pass::Decode, true) => {
            return super::with_threads(args.threads, || decode_bench::run(&args, true));
        }
        (Pass::Backward, true) => {
            if args.cuda.kernel == Some(super::KernelArg::Sm100) {
                return Err(Error::invalid(
                    "--kernel",
                    "fa4 has no Blackwell backward; with --backward it takes auto, sm80 or sm90",
                ));
            }
            let grid = args.backward_grid(true)?;
            let cuda = fa4::cuda::CudaBackend::new(args.cuda.device())
                .map_err(|e| Error::invalid("--backend", e.to_string()))?
                .with_kernel(args.cuda.kernel_choice()?);
            return super::backward::bench_cuda(&grid, &cuda);
        }
        (Pass::Forward, true) => {
            return super::bench_cuda::run(
                &args.cuda,
                args.dtype,
                args.warmup,
                args.reps,
                args.json,
            )
        }
        (Pass::Forward | Pass::Backward | Pass::Decode, false) => {}
    }
    if args.dtype == DType::Fp8E4M3 {
        return Err(Error::invalid("--dtype", "fp8 is not computed yet"));
    }
    if args.threads == Some(0) {
        return Err(Error::invalid("--threads", "must be ≥ 1"));
    }
    let mut builder = rayon::ThreadPoolBuilder::new();
    if let Some(n) = args.threads {
        builder = builder.num_threads(n);
    }
    let pool = builder
        .build()
        .map_err(|e| Error::invalid("--threads", e.to_string()))?;
    match pass {
        Pass::Decode => pool.install(|| decode_bench::run(&args, false)),
        Pass::Backward => {
            let grid = args.backward_grid(false)?;
            pool.install(|| super::backward::bench(&grid))
        }
        _ => pool.install(|| bench(&args)),
    }
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".to_string())
}

fn bench(args: &BenchArgs) -> Result<()> {
    // Every shape is sized before the peak is measured and the table starts: an error is then
    // the only thing printed.
    for &d in args.head_dims() {
        for &seqlen in args.seqlens() {
            Shape {
                seqlen,
                d,
                causal: false,
                batch: args.batch(),
                heads: args.heads.unwrap_or((DEFAULT_ROWS / seqlen).max(1)),
            }
            .fits(args.dtype)?;
        }
    }
    let threads = rayon::current_num_threads();
    let isa = Isa::selected();
    // Five runs of 50 ms per instruction set.
    let peaks = peak::measure_all(0.05, 5);
    let best = peaks[0].gflops;
    let cpu = cpu_model();
    let masks = args.masks();
    if !args.json {
        println!(
            "fa4 bench --backend cpu: {}, {cpu}, {threads} threads, {} kernels",
            args.dtype,
            isa.name()
        );
        let list: Vec<String> = peaks
            .iter()
            .map(|p| format!("{} {:.1}", p.isa.name(), p.gflops))
            .collect();
        println!(
            "f32 FMA peak, measured on {threads} threads: {} GFLOP/s",
            list.join(", ")
        );
        println!(
            "median of {} runs after {} warm-up; peer (mat): materialised evaluation as candle runs it (score matrix, scale, mask, softmax_last_dim, second GEMM; same GEMM kernels and threads), same run",
            args.reps, args.warmup
        );
        println!(
            "{:>7} {:>4} {:>6} {:>7} {:>9} {:>11} {:>11} {:>7} {:>6}{}",
            "seqlen",
            "d",
            "causal",
            "b×h",
            "fa4 ms",
            "fa4 GFLOP/s",
            "mat GFLOP/s",
            "fa4/mat",
            "%peak",
            if args.fused_peer {
                "  fused GFLOP/s fa4/fused"
            } else {
                ""
            }
        );
    }
    let mut rows = Vec::new();
    for &d in args.head_dims() {
        for &seqlen in args.seqlens() {
            for &causal in masks {
                let heads = args.heads.unwrap_or((DEFAULT_ROWS / seqlen).max(1));
                let shape = Shape {
                    seqlen,
                    d,
                    causal,
                    batch: args.batch(),
                    heads,
                };
                let row = match args.dtype {
                    DType::F32 => shape.run::<f32>(args, best)?,
                    DType::F16 => shape.run::<half::f16>(args, best)?,
                    DType::Bf16 => shape.run::<half::bf16>(args, best)?,
                    DType::Fp8E4M3 => unreachable!("rejected above"),
                };
                if !args.json {
                    let opt = |x: Option<f64>, prec: usize| {
                        x.map_or("-".to_string(), |x| format!("{x:.prec$}"))
                    };
                    let fused = if args.fused_peer {
                        format!(
                            "  {:>13} {:>9}",
                            opt(row.fused_gflops, 1),
                            opt(row.fused_ratio, 2)
                        )
                    } else {
                        String::new()
                    };
                    println!(
                        "{:>7} {:>4} {:>6} {:>7} {:>9.2} {:>11.1} {:>11} {:>7} {:>5.1}%{fused}",
                        seqlen,
                        d,
                        if causal { "yes" } else { "no" },
                        format!("{}×{}", args.batch(), heads),
                        row.fa4_ms,
                        row.fa4_gflops,
                        opt(row.materialized_gflops, 1),
                        opt(row.ratio, 2),
                        row.pct_of_peak
                    );
                }
                rows.push(row);
            }
        }
    }
    if args.json {
        let report = Report {
            backend: "cpu",
            cpu,
            threads,
            isa: isa.name(),
            fma_peak_gflops: best,
            fma_peaks: peaks
                .iter()
                .map(|p| PeakJson {
                    isa: p.isa.name(),
                    gflops: p.gflops,
                })
                .collect(),
            reps: args.reps,
            warmup: args.warmup,
            results: rows,
        };
        println!(
            "{}",
            serde_json::to_string(&report).map_err(|e| Error::invalid("--json", e.to_string()))?
        );
    }
    Ok(())
}

struct Shape {
    seqlen: usize,
    d: usize,
    causal: bool,
    batch: usize,
    heads: usize,
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

impl Shape {
    /// An error naming `--seqlens` if the shape overflows or its buffers (Q, K, V, O and the
    /// peer's O in `dtype`, two LSEs) exceed the memory this process may allocate.
    fn fits(&self, dtype: DType) -> Result<()> {
        let (b, s, h, d) = (self.batch, self.seqlen, self.heads, self.d);
        let l = Layout::new("--seqlens", &[b, s, h, d], None)?;
        // The layout checked b·s·h·d, so b·s·h cannot overflow.
        let (n, rows) = (l.numel() as f64, (b * s * h) as f64);
        let bytes = 5.0 * n * dtype.size_bytes() as f64 + 8.0 * rows;
        super::memory::ensure(
            "--seqlens",
            &format!("seqlen {s}, d {d}, b×h {b}×{h}"),
            bytes,
        )
    }

    fn run<T: Element>(&self, args: &BenchArgs, peak: f64) -> Result<Row> {
        let (b, s, h, d) = (self.batch, self.seqlen, self.heads, self.d);
        self.fits(T::DTYPE)?;
        let l = Layout::new("--seqlens", &[b, s, h, d], None)?;
        let opts = if self.causal {
            Options::new().causal()
        } else {
            Options::new()
        };
        let p = Problem::new(T::DTYPE, &l, &l, &l, &l, None, None, &opts)?;
        let n = l.numel();
        let mut rng = StdRng::seed_from_u64(0x5eed ^ (s * 131 + d) as u64);
        let mut q = vec![T::from_f32(0.0); n];
        let mut k = q.clone();
        let mut v = q.clone();
        random_qkv(&mut rng, &mut q, &mut k, &mut v, d, d);
        let mut o = vec![T::NAN; n];
        let mut lse = vec![f32::NAN; p.lse_len()];

        let cpu = CpuBackend::default();
        let fa4_s = time(args.warmup, args.reps, || {
            cpu.forward(&p, &q, &k, &v, &mut o, Some(&mut lse))
        })?;
        let flops = p.flops();
        let fa4_gflops = flops / fa4_s / 1e9;

        // Two score-sized f32 buffers.
        let mat_bytes = s.saturating_mul(s).saturating_mul(8);
        let skip = args.no_materialized || mat_bytes > MATERIALIZED_LIMIT_BYTES;
        let mut o_mat = vec![T::NAN; if skip { 0 } else { n }];
        let mut lse_mat = vec![f32::NAN; if skip { 0 } else { p.lse_len() }];
        let mut peer = |style: Style| -> Result<Option<f64>> {
            if skip {
                return Ok(None);
            }
            time(args.warmup, args.reps, || {
                materialized::forward_with(style, &p, &q, &k, &v, &mut o_mat, Some(&mut lse_mat))
            })
            .map(Some)
        };
        let fused_s = if args.fused_peer {
            peer(Style::Fused)?
        } else {
            None
        };
        let mat_s = peer(Style::Candle)?;
        let diff = mat_s.map(|_| {
            o.iter()
                .zip(&o_mat)
                .map(|(a, b)| f64::from((a.to_f32() - b.to_f32()).abs()))
                .fold(0.0, f64::max)
        });
        let mat_gflops = mat_s.map(|t| flops / t / 1e9);
        let fused_gflops = fused_s.map(|t| flops / t / 1e9);
        Ok(Row {
            seqlen: s,
            head_dim: d,
            causal: self.causal,
            batch: b,
            heads: h,
            dtype: T::DTYPE.to_string(),
            flops,
            fa4_ms: fa4_s * 1e3,
            fa4_gflops,
            materialized_ms: mat_s.map(|t| t * 1e3),
            materialized_gflops: mat_gflops,
            ratio: mat_gflops.map(|m| fa4_gflops / m),
            pct_of_peak: 100.0 * fa4_gflops / peak,
            max_abs_diff: diff,
            fused_ms: fused_s.map(|t| t * 1e3),
            fused_gflops,
            fused_ratio: fused_gflops.map(|m| fa4_gflops / m),
        })
    }
}
