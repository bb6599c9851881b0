//! `--cp N` on `fa4 run` and `fa4 bench`: context parallelism (ring attention, [`fa4::cp`]).
//!
//! On the CPU the `N` ranks are simulated in one process (an in-memory ring, exchanges on a
//! second thread); on CUDA they are `N` GPUs exchanging K/V over NCCL. `fa4 run --cp N` checks
//! the result against one call of the same backend (printed) and the float64 oracle (the usual
//! verdict); `fa4 bench --cp N` reports the scaling against one call and the per-step compute
//! and exchange times.

use std::time::{Duration, Instant};

use clap::Args;
use rand::rngs::StdRng;
use rand::SeedableRng;
use serde::Serialize;

use fa4::check::random_qkv;
use fa4::cp::{self, Ring, SplitKind};
use fa4::cpu::CpuBackend;
use fa4::tensor::Layout;
use fa4::{Backend, DType, Element, Error, Options, Problem, Result};

use super::BackendArg;

/// The `--cp` flags.
#[derive(Args, Debug, Clone)]
pub struct CpArgs {
    /// Context parallelism over N ranks: simulated ranks on the CPU, N GPUs over NCCL on CUDA
    /// (NCCL from FA4_NCCL_LIB, LD_LIBRARY_PATH or a pip wheel; set NCCL_NVLS_ENABLE=0).
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub cp: Option<usize>,
    /// How --cp splits the sequence: zigzag (rank r holds chunks r and 2N−1−r of 2N; balanced
    /// under a causal mask) or contiguous.
    #[arg(long, value_name = "KIND", default_value = "zigzag")]
    pub cp_split: SplitKind,
}

/// The most ranks `--cp` takes. The CPU simulates the ring in one process, `N` steps of `N`
/// ranks (N² block computations and exchanges, one after another), and the CUDA ring is one
/// host's GPUs: past a few hundred ranks neither is a meaningful run, and `--cp 100000` would
/// only spin for hours.
pub const MAX_RANKS: usize = 256;

fn ranks(n: usize) -> Result<usize> {
    if n == 0 {
        return Err(Error::invalid(
            "--cp",
            "the number of ranks must be ≥ 1, got 0",
        ));
    }
    if n > MAX_RANKS {
        return Err(Error::invalid(
            "--cp",
            format!("at most {MAX_RANKS} ranks (the CPU simulates the ring's N² steps one after another), got {n}"),
        ));
    }
    Ok(n)
}

/// Library argument names as the user gave them on the command line.
fn flag(e: Error) -> Error {
    match e {
        Error::InvalidArgument { name, reason } => {
            let name = match name.as_str() {
                "cp" | "ranks" => "--cp",
                "mask" => "--window",
                "seqlen_k" => "--seqlen-k",
                "q" if reason.contains("varlen") => "--cu-seqlens-q",
                other => other,
            };
            Error::invalid(name, reason)
        }
        e => e,
    }
}

fn max_diff(a: impl Iterator<Item = (f32, f32)>) -> f64 {
    a.map(|(x, y)| {
        if x == y {
            0.0
        } else {
            f64::from((x - y).abs())
        }
    })
    .fold(0.0, f64::max)
}

fn ms(v: &[f64]) -> String {
    let parts: Vec<String> = v.iter().map(|x| format!("{x:.2}")).collect();
    format!("[{}]", parts.join(", "))
}

/// Checks `--cp N` against the problem (ranks, split, what the ring supports) before anything
/// is computed or a GPU is opened.
pub fn validate(args: &CpArgs, n: usize, p: &Problem) -> Result<()> {
    let n = ranks(n)?;
    Ring::new(p, n, args.cp_split).map_err(flag)?;
    Ok(())
}

/// What `fa4 run --cp N` computed: O, LSE, the time of the ring, and lines to print.
pub struct Computed<T> {
    pub o: Vec<T>,
    pub lse: Vec<f32>,
    pub elapsed: Duration,
    pub notes: Vec<String>,
}

/// `fa4 run --cp N` on `backend`.
pub fn execute<T: Element>(
    args: &CpArgs,
    n: usize,
    backend: &Backend,
    p: &Problem,
    q: &[T],
    k: &[T],
    v: &[T],
) -> Result<Computed<T>> {
    let n = ranks(n)?;
    let ring = Ring::new(p, n, args.cp_split).map_err(flag)?;
    let mut o = vec![T::NAN; p.o_layout().numel()];
    let mut lse = vec![f32::NAN; p.lse_len()];
    let mut o1 = vec![T::NAN; p.o_layout().numel()];
    let mut lse1 = vec![f32::NAN; p.lse_len()];
    let mut notes = Vec::new();
    let elapsed = match backend {
        Backend::Cuda(_) => {
            let gpus = cp::cuda::open_devices(n)?;
            let t0 = Instant::now();
            let t =
                cp::cuda::forward(&ring, &gpus, q, k, v, &mut o, Some(&mut lse)).map_err(flag)?;
            let elapsed = t0.elapsed();
            notes.push(format!(
                "{n} GPUs over NCCL ({}), {} split; ring {:.2} ms (host merge tail {:.2} ms)",
                cp::nccl::Nccl::get()?.path(),
                args.cp_split,
                t.total_ms,
                t.tail_merge_ms
            ));
            for r in 0..n {
                notes.push(format!(
                    "rank {r}: compute ms per step {}, exchange ms per step {}",
                    ms(&t.compute_ms[r]),
                    ms(&t.exchange_ms[r])
                ));
            }
            backend.run(p, q, k, v, &mut o1, Some(&mut lse1))?;
            elapsed
        }
        _ => {
            let cpu = match backend {
                Backend::CpuWith(c) => c.clone(),
                _ => CpuBackend::default(),
            };
            rayon::current_num_threads();
            let t0 = Instant::now();
            let t =
                cp::forward_simulated(p, n, args.cp_split, &cpu, q, k, v, &mut o, Some(&mut lse))
                    .map_err(flag)?;
            let elapsed = t0.elapsed();
            notes.push(format!(
                "{n} simulated ranks (in-memory ring), {} split; per step: compute ms {} (all \
                 ranks, one after another), exchange ms {} (own thread, overlapped); projected \
                 time of {n} real ranks {:.3} ms",
                args.cp_split,
                ms(&t.compute_s.iter().map(|x| x * 1e3).collect::<Vec<_>>()),
                ms(&t.exchange_s.iter().map(|x| x * 1e3).collect::<Vec<_>>()),
                t.projected_s() * 1e3
            ));
            cpu.forward(p, q, k, v, &mut o1, Some(&mut lse1))?;
            elapsed
        }
    };
    notes.push(format!(
        "max|O_cp − O_one call| {:.3e}, max|LSE_cp − LSE_one call| {:.3e} (finite rows)",
        max_diff(o.iter().zip(&o1).map(|(a, b)| (a.to_f32(), b.to_f32()))),
        max_diff(
            lse.iter()
                .zip(&lse1)
                .filter(|(a, b)| a.is_finite() && b.is_finite())
                .map(|(a, b)| (*a, *b))
        )
    ));
    Ok(Computed {
        o,
        lse,
        elapsed,
        notes,
    })
}

/// What `fa4 bench --cp N` measures, from the bench's own flags.
pub struct BenchPlan<'a> {
    pub backend: BackendArg,
    pub seqlens: &'a [usize],
    pub head_dims: &'a [usize],
    pub masks: &'a [bool],
    pub dtype: DType,
    pub batch: usize,
    pub heads: Option<usize>,
    pub reps: usize,
    pub warmup: usize,
    pub json: bool,
}

#[derive(Debug, Serialize)]
struct Row {
    ranks: usize,
    split: String,
    seqlen: usize,
    head_dim: usize,
    causal: bool,
    batch: usize,
    heads: usize,
    dtype: String,
    one_call_ms: f64,
    /// CPU: the simulation's wall time (ranks one after another); CUDA: the ring's.
    ring_ms: f64,
    /// CPU: the projected time of N real ranks; CUDA: the ring's time.
    projected_ms: f64,
    /// one_call_ms / projected_ms.
    scaling: f64,
    /// Per step: the slowest rank's compute (ms).
    step_compute_ms: Vec<f64>,
    /// Per step: the exchange (ms; the slowest rank's on CUDA).
    step_exchange_ms: Vec<f64>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// `fa4 bench --cp N`.
pub fn bench(args: &CpArgs, n: usize, b: &BenchPlan<'_>) -> Result<()> {
    let n = ranks(n)?;
    if b.reps == 0 {
        return Err(Error::invalid("--reps", "must be ≥ 1"));
    }
    let gpus = match b.backend {
        BackendArg::Cuda => Some(cp::cuda::open_devices(n)?),
        _ => None,
    };
    if !b.json {
        println!(
            "fa4 bench --cp {n} ({} split, {}): median of {} runs after {} warm-up",
            args.cp_split,
            if gpus.is_some() {
                "CUDA GPUs over NCCL"
            } else {
                "simulated ranks on the CPU; projected = each step's slowest rank or exchange"
            },
            b.reps,
            b.warmup
        );
        println!(
            "{:>7} {:>4} {:>6} {:>7} {:>11} {:>10} {:>12} {:>8}  per-step compute / exchange ms",
            "seqlen", "d", "causal", "b×h", "one-call ms", "ring ms", "projected ms", "scaling"
        );
    }
    let mut rows = Vec::new();
    for &d in b.head_dims {
        for &s in b.seqlens {
            for &causal in b.masks {
                let heads = b.heads.unwrap_or((8192 / s.max(1)).max(1));
                let l = |dim| Layout::new("q", &[b.batch, s, heads, dim], None);
                let mut opts = Options::new();
                if causal {
                    opts = opts.causal();
                }
                let p = Problem::new(b.dtype, &l(d)?, &l(d)?, &l(d)?, &l(d)?, None, None, &opts)?;
                let row = match b.dtype {
                    DType::F32 => bench_one::<f32>(args, n, &p, gpus.as_deref(), b)?,
                    DType::F16 => bench_one::<half::f16>(args, n, &p, gpus.as_deref(), b)?,
                    DType::Bf16 => bench_one::<half::bf16>(args, n, &p, gpus.as_deref(), b)?,
                    DType::Fp8E4M3 => {
                        return Err(Error::invalid("--dtype", "fp8 is not computed yet"))
                    }
                };
                let row = Row {
                    seqlen: s,
                    head_dim: d,
                    causal,
                    batch: b.batch,
                    heads,
                    ..row
                };
                if !b.json {
                    println!(
                        "{:>7} {:>4} {:>6} {:>7} {:>11.3} {:>10.3} {:>12.3} {:>7.2}×  {} / {}",
                        row.seqlen,
                        row.head_dim,
                        row.causal,
                        format!("{}×{}", row.batch, row.heads),
                        row.one_call_ms,
                        row.ring_ms,
                        row.projected_ms,
                        row.scaling,
                        ms(&row.step_compute_ms),
                        ms(&row.step_exchange_ms)
                    );
                }
                rows.push(row);
            }
        }
    }
    if b.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&rows)
                .map_err(|e| Error::invalid("--json", e.to_string()))?
        );
    }
    Ok(())
}

fn bench_one<T: Element>(
    args: &CpArgs,
    n: usize,
    p: &Problem,
    gpus: Option<&[fa4::cuda::CudaBackend]>,
    b: &BenchPlan<'_>,
) -> Result<Row> {
    let mut rng = StdRng::seed_from_u64(0);
    let mut q = vec![T::NAN; p.q_layout().numel()];
    let mut k = vec![T::NAN; p.k_layout().numel()];
    let mut v = vec![T::NAN; p.v_layout().numel()];
    random_qkv(
        &mut rng,
        &mut q,
        &mut k,
        &mut v,
        p.head_dim(),
        p.head_dim_v(),
    );
    let mut o = vec![T::NAN; p.o_layout().numel()];
    let ring = Ring::new(p, n, args.cp_split).map_err(flag)?;
    let empty = Row {
        ranks: n,
        split: args.cp_split.to_string(),
        seqlen: 0,
        head_dim: 0,
        causal: false,
        batch: 0,
        heads: 0,
        dtype: T::DTYPE.to_string(),
        one_call_ms: 0.0,
        ring_ms: 0.0,
        projected_ms: 0.0,
        scaling: 0.0,
        step_compute_ms: Vec::new(),
        step_exchange_ms: Vec::new(),
    };
    match gpus {
        Some(gpus) => {
            // One call per round, `reps` rounds: an event pair around each single forward.
            let one = fa4::cuda::bench::time_forward::<T>(&gpus[0], p, b.warmup, 1, b.reps, 7)?;
            let mut runs = Vec::new();
            for i in 0..b.warmup + b.reps {
                let t = cp::cuda::forward(&ring, gpus, &q, &k, &v, &mut o, None).map_err(flag)?;
                if i >= b.warmup {
                    runs.push(t);
                }
            }
            runs.sort_by(|a, b| a.total_ms.total_cmp(&b.total_ms));
            let t = &runs[runs.len() / 2];
            let steps = t.compute_ms.first().map_or(0, Vec::len);
            let worst = |x: &Vec<Vec<f64>>, s: usize| {
                x.iter()
                    .filter_map(|r| r.get(s))
                    .copied()
                    .fold(0.0, f64::max)
            };
            Ok(Row {
                one_call_ms: one.rounds.median,
                ring_ms: t.total_ms,
                projected_ms: t.total_ms,
                scaling: one.rounds.median / t.total_ms,
                step_compute_ms: (0..steps).map(|s| worst(&t.compute_ms, s)).collect(),
                step_exchange_ms: (0..steps.saturating_sub(1))
                    .map(|s| worst(&t.exchange_ms, s))
                    .collect(),
                ..empty
            })
        }
        None => {
            let cpu = CpuBackend::default();
            let mut one = Vec::new();
            for i in 0..b.warmup + b.reps {
                let t0 = Instant::now();
                cpu.forward(p, &q, &k, &v, &mut o, None)?;
                if i >= b.warmup {
                    one.push(t0.elapsed().as_secs_f64() * 1e3);
                }
            }
            let mut runs = Vec::new();
            for i in 0..b.warmup + b.reps {
                let t0 = Instant::now();
                let t = cp::forward_simulated(p, n, args.cp_split, &cpu, &q, &k, &v, &mut o, None)
                    .map_err(flag)?;
                if i >= b.warmup {
                    runs.push((t0.elapsed().as_secs_f64() * 1e3, t));
                }
            }
            runs.sort_by(|a, b| a.1.projected_s().total_cmp(&b.1.projected_s()));
            let (wall, t) = &runs[runs.len() / 2];
            let one = median(one);
            let projected = t.projected_s() * 1e3;
            Ok(Row {
                one_call_ms: one,
                ring_ms: *wall,
                projected_ms: projected,
                scaling: one / projected,
                step_compute_ms: t
                    .rank_compute_s
                    .iter()
                    .map(|c| c.iter().copied().fold(0.0, f64::max) * 1e3)
                    .collect(),
                step_exchange_ms: t.exchange_s.iter().map(|x| x * 1e3).collect(),
                ..empty
            })
        }
    }
}
