//! `fa4 bench --decode`: decode over a paged KV cache on the CPU, in GB/s of K and V read,
//! beside fa4's own contiguous forward on the same keys (the peer a caller without a paged path
//! would use: gather the cache, then `Backend::run` on a varlen batch).
//!
//! A child module of `bench`: it reads `--dtype`, `--reps`, `--warmup`, `--threads` (through the
//! pool `bench` installs) and `--json`. Every sequence of a shape has the full key count (the
//! issue's grid is uniform); pages are shuffled. Bandwidth is [`PagedCache::kv_bytes`] (every key
//! of every sequence and KV head, K and V) over the median time; the peer is credited with the
//! same bytes, so the two ratios are time ratios. The default grid is the H200 decode
//! grid with the keys divided by 8, so that a 2-core machine runs it in about a minute.
//!
//! With `--backend cuda` it times the GPU decode kernels on the full grid by default: the
//! inputs uploaded into enough copies that a round's calls read more than 400 MB (past the L2),
//! one event pair around 10 back-to-back calls per round on rotating copies, the median of
//! `--reps` rounds after `--warmup` calls, TB/s of K and V read; the output is cross-checked
//! against the CPU backend (max |O_gpu − O_cpu|). fa4 beside its peers (cuDNN,
//! FlashAttention-2 and -3, FlashAttention-4), in one process on the same tensors:
//! `bench/peers.py decode`.
//!
//! [`PagedCache::kv_bytes`]: fa4::paged::PagedCache::kv_bytes

use std::time::Instant;

use clap::Args;
use rand::rngs::StdRng;
use rand::SeedableRng;
use serde::Serialize;

use fa4::paged::random::{random_paged, PagedSpec};
use fa4::paged::reference::gather;
use fa4::{Backend, DType, Element, Error, Options, Result};

use super::BenchArgs;

/// The grid (batch, keys) with keys / 8.
const DEFAULT_SHAPES: &str = "1:4096,8:1024,8:4096,32:512,4:16384";

/// The decode flags of `fa4 bench`.
#[derive(Args, Debug, Default)]
pub struct DecodeBenchArgs {
    /// Benchmark decode over a paged KV cache instead of the prefill grid.
    #[arg(long, help_heading = "Decode")]
    decode: bool,
    /// BATCH:KEYS pairs, comma-separated [default: 1:4096,8:1024,8:4096,32:512,4:16384].
    #[arg(long, value_name = "B:N,...", help_heading = "Decode")]
    decode_shapes: Option<String>,
    /// Keys per page [default: 16].
    #[arg(long, help_heading = "Decode")]
    page_size: Option<usize>,
    /// Query rows per sequence (1 decode, 4 speculative) [default: 1].
    #[arg(long, help_heading = "Decode")]
    seqlen_q: Option<usize>,
    /// Query heads [default: 32].
    #[arg(long, help_heading = "Decode")]
    heads_q: Option<usize>,
    /// KV heads [default: 8].
    #[arg(long, help_heading = "Decode")]
    heads_kv: Option<usize>,
    /// Head dim [default: 128].
    #[arg(long, help_heading = "Decode")]
    head_dim: Option<usize>,
}

impl DecodeBenchArgs {
    /// Whether `--decode` was given.
    pub fn wanted(&self) -> bool {
        self.decode
    }
    /// The first decode flag given without `--decode`, if any.
    pub fn stray(&self) -> Option<&'static str> {
        [
            ("--decode-shapes", self.decode_shapes.is_some()),
            ("--page-size", self.page_size.is_some()),
            ("--seqlen-q", self.seqlen_q.is_some()),
            ("--heads-q", self.heads_q.is_some()),
            ("--heads-kv", self.heads_kv.is_some()),
            ("--head-dim", self.head_dim.is_some()),
        ]
        .into_iter()
        .find(|&(_, given)| given && !self.decode)
        .map(|(flag, _)| flag)
    }
}

#[derive(Debug, Serialize)]
struct Row {
    batch: usize,
    keys: usize,
    page_size: usize,
    seqlen_q: usize,
    num_splits: usize,
    kv_bytes: f64,
    fa4_ms: f64,
    fa4_gbps: f64,
    contiguous_ms: f64,
    contiguous_gbps: f64,
    /// Contiguous time over paged time.
    speedup: f64,
    /// `max|O_paged − O_contiguous|`, a cross-check.
    max_abs_diff: f64,
}

fn parse_shapes(s: &str) -> Result<Vec<(usize, usize)>> {
    let bad = || {
        Error::invalid(
            "--decode-shapes",
            format!("expected BATCH:KEYS pairs (each ≥ 1), comma-separated, got `{s}`"),
        )
    };
    s.split(',')
        .map(|pair| {
            let (b, n) = pair.trim().split_once(':').ok_or_else(bad)?;
            let b: usize = b.trim().parse().map_err(|_| bad())?;
            let n: usize = n.trim().parse().map_err(|_| bad())?;
            if b == 0 || n == 0 {
                return Err(bad());
            }
            Ok((b, n))
        })
        .collect()
}

fn print_json<R: Serialize>(rows: &[R]) {
    println!(
        "{}",
        serde_json::to_string_pretty(rows).expect("plain data serializes")
    );
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// The H200 decode grid (batch, keys), the GPU default.
const GPU_SHAPES: &str = "1:32768,8:8192,8:32768,32:4096,4:131072";

/// Runs the decode bench inside `bench`'s thread pool (`gpu`: on CUDA device 0).
pub fn run(args: &BenchArgs, gpu: bool) -> Result<()> {
    let a = &args.decode;
    let default = if gpu { GPU_SHAPES } else { DEFAULT_SHAPES };
    let shapes = parse_shapes(a.decode_shapes.as_deref().unwrap_or(default))?;
    let ps = a.page_size.unwrap_or(16);
    let sq = a.seqlen_q.unwrap_or(1);
    let hq = a.heads_q.unwrap_or(32);
    let hkv = a.heads_kv.unwrap_or(8);
    let d = a.head_dim.unwrap_or(128);
    for (flag, x) in [
        ("--page-size", ps),
        ("--seqlen-q", sq),
        ("--heads-q", hq),
        ("--heads-kv", hkv),
        ("--head-dim", d),
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
    if gpu {
        return run_cuda(args, &shapes, (ps, sq, hq, hkv, d));
    }
    if !args.json {
        println!(
            "fa4 bench --decode --backend cpu: {}, {} threads, page {ps}, seqlen_q {sq}, heads \
             {hq}/{hkv}, d {d}; median of {} runs after {} warm-up; GB/s = K+V bytes / time; \
             peer: gather + fa4's contiguous varlen forward, same run",
            args.dtype,
            rayon::current_num_threads(),
            args.reps,
            args.warmup
        );
        println!(
            "{:>5} {:>7} {:>6} {:>9} {:>9} {:>9} {:>9} {:>8}",
            "batch", "keys", "splits", "fa4 ms", "fa4 GB/s", "cont ms", "cont GB/s", "speedup"
        );
    }
    let mut rows = Vec::new();
    for (batch, keys) in shapes {
        let spec = PagedSpec {
            seqlens_q: vec![sq; batch],
            seqlens_k: vec![keys; batch],
            heads_q: hq,
            heads_kv: hkv,
            head_dim: d,
            head_dim_v: d,
            page_size: ps,
            varlen: false,
        };
        let row = match args.dtype {
            DType::F32 => one::<f32>(&spec, args)?,
            DType::F16 => one::<half::f16>(&spec, args)?,
            DType::Bf16 => one::<half::bf16>(&spec, args)?,
            DType::Fp8E4M3 => return Err(Error::invalid("--dtype", "fp8 is not computed yet")),
        };
        if !args.json {
            println!(
                "{:>5} {:>7} {:>6} {:>9.3} {:>9.2} {:>9.3} {:>9.2} {:>7.2}×",
                row.batch,
                row.keys,
                row.num_splits,
                row.fa4_ms,
                row.fa4_gbps,
                row.contiguous_ms,
                row.contiguous_gbps,
                row.speedup
            );
        }
        rows.push(row);
    }
    if args.json {
        print_json(&rows);
    }
    Ok(())
}

fn one<T: Element>(spec: &PagedSpec, args: &BenchArgs) -> Result<Row> {
    let mut rng = StdRng::seed_from_u64(0);
    let inputs = random_paged::<T, _>(&mut rng, spec)?;
    let opts = Options::new();
    let p = inputs.problem(&opts)?;
    let g = gather(&p, &inputs.q, &inputs.k_cache, &inputs.v_cache)?;
    let backend = Backend::Cpu;
    let mut o = vec![T::NAN; p.o_layout().numel()];
    let mut o_ref = vec![T::NAN; p.o_layout().numel()];
    let mut lse = vec![0f32; p.lse_len()];
    let mut plan = None;
    let (mut paged_t, mut cont_t) = (Vec::new(), Vec::new());
    // Interleaved rounds: both implementations see the same machine state.
    for round in 0..args.warmup + args.reps.max(1) {
        let t0 = Instant::now();
        plan = Some(backend.run_paged(
            &p,
            &inputs.q,
            &inputs.k_cache,
            &inputs.v_cache,
            &mut o,
            Some(&mut lse),
            None,
        )?);
        let t1 = Instant::now();
        backend.run(&g.problem, &g.q, &g.k, &g.v, &mut o_ref, Some(&mut lse))?;
        let t2 = Instant::now();
        if round >= args.warmup {
            paged_t.push((t1 - t0).as_secs_f64());
            cont_t.push((t2 - t1).as_secs_f64());
        }
    }
    let bytes = p.cache().kv_bytes(std::mem::size_of::<T>());
    let (tp, tc) = (median(paged_t), median(cont_t));
    let max_abs_diff = o
        .iter()
        .zip(&o_ref)
        .map(|(a, b)| f64::from((a.to_f32() - b.to_f32()).abs()))
        .fold(0.0, f64::max);
    Ok(Row {
        batch: spec.seqlens_k.len(),
        keys: spec.seqlens_k[0],
        page_size: spec.page_size,
        seqlen_q: spec.seqlens_q[0],
        num_splits: plan.map_or(1, |p| p.num_splits),
        kv_bytes: bytes,
        fa4_ms: tp * 1e3,
        fa4_gbps: bytes / tp / 1e9,
        contiguous_ms: tc * 1e3,
        contiguous_gbps: bytes / tc / 1e9,
        speedup: tc / tp,
        max_abs_diff,
    })
}

#[derive(Debug, Serialize)]
struct GpuRow {
    batch: usize,
    keys: usize,
    page_size: usize,
    seqlen_q: usize,
    num_splits: usize,
    kv_bytes: f64,
    us_per_call: f64,
    tbps: f64,
    /// (max − min) / median of the rounds.
    spread: f64,
    /// `max|O_gpu − O_cpu|` against the CPU backend, a cross-check.
    max_abs_diff_cpu: f64,
}

/// Calls per timed round (one event pair around them).
const GPU_CALLS: usize = 10;
/// A round reads at least this many bytes, so that the 50 MB L2 of an H200 holds little of it.
const GPU_ROTATE_BYTES: f64 = 4e8;

fn run_cuda(
    args: &BenchArgs,
    shapes: &[(usize, usize)],
    (ps, sq, hq, hkv, d): (usize, usize, usize, usize, usize),
) -> Result<()> {
    let cuda = fa4::cuda::CudaBackend::new(0)
        .map_err(|e| Error::invalid("--backend", format!("cuda: {e}")))?;
    if !args.json {
        println!(
            "fa4 bench --decode --backend cuda: {}, {}, page {ps}, seqlen_q {sq}{}, heads \
             {hq}/{hkv}, d {d}; median of {} rounds of {GPU_CALLS} calls after {} warm-up calls, \
             caches rotated past the L2; TB/s = K+V bytes / time; peers: bench/peers.py decode",
            args.dtype,
            cuda.info().name,
            if sq > 1 { " causal" } else { "" },
            args.reps.max(1),
            args.warmup
        );
        println!(
            "{:>5} {:>7} {:>6} {:>9} {:>7} {:>7} {:>10}",
            "batch", "keys", "splits", "us/call", "TB/s", "spread", "|O-O_cpu|"
        );
    }
    let mut rows = Vec::new();
    for &(batch, keys) in shapes {
        let spec = PagedSpec {
            seqlens_q: vec![sq; batch],
            seqlens_k: vec![keys; batch],
            heads_q: hq,
            heads_kv: hkv,
            head_dim: d,
            head_dim_v: d,
            page_size: ps,
            varlen: false,
        };
        let row = match args.dtype {
            DType::F16 => one_cuda::<half::f16>(&cuda, &spec, args)?,
            DType::Bf16 => one_cuda::<half::bf16>(&cuda, &spec, args)?,
            other => {
                return Err(Error::invalid(
                    "--dtype",
                    format!("the GPU decode kernels take fp16 or bf16, got {other}"),
                ))
            }
        };
        if !args.json {
            println!(
                "{:>5} {:>7} {:>6} {:>9.1} {:>7.2} {:>6.1}% {:>10.2e}",
                row.batch,
                row.keys,
                row.num_splits,
                row.us_per_call,
                row.tbps,
                row.spread * 100.0,
                row.max_abs_diff_cpu
            );
        }
        rows.push(row);
    }
    if args.json {
        print_json(&rows);
    }
    Ok(())
}

fn one_cuda<T: Element>(
    cuda: &fa4::cuda::CudaBackend,
    spec: &PagedSpec,
    args: &BenchArgs,
) -> Result<GpuRow> {
    let mut rng = StdRng::seed_from_u64(0);
    let inputs = random_paged::<T, _>(&mut rng, spec)?;
    let opts = if spec.seqlens_q[0] > 1 {
        Options::new().causal()
    } else {
        Options::new()
    };
    let p = inputs.problem(&opts)?;
    let bytes = p.cache().kv_bytes(std::mem::size_of::<T>());
    let copies = ((GPU_ROTATE_BYTES / bytes).ceil() as usize).max(2);
    let q = cuda.upload(&inputs.q)?;
    let ks = (0..copies)
        .map(|_| cuda.upload(&inputs.k_cache))
        .collect::<Result<Vec<_>>>()?;
    let vs = (0..copies)
        .map(|_| cuda.upload(&inputs.v_cache))
        .collect::<Result<Vec<_>>>()?;
    let mut o = cuda.alloc::<T>(p.o_layout().numel())?;
    let mut lse = cuda.alloc::<f32>(p.lse_len().max(1))?;
    let mut tables = cuda.paged_tables(&p)?;
    let mut i = 0usize;
    let mut call = |o: &mut _, lse: &mut _| -> Result<usize> {
        i += 1;
        let c = i % copies;
        Ok(cuda
            .forward_paged_device(&p, &mut tables, &q, &ks[c], &vs[c], o, Some(lse), None)?
            .num_splits)
    };
    let mut splits = 1;
    for _ in 0..args.warmup.max(1) {
        splits = call(&mut o, &mut lse)?;
    }
    cuda.synchronize()?;
    let ctx = cuda.context();
    // The driver error keeps its CUresult (code and name), as the library's own errors do.
    let cu = |e: cudarc::driver::DriverError| Error::Cuda {
        op: "decode bench events".into(),
        code: Some(e.0 as u32),
        name: format!("{:?}", e.0),
        message: e.to_string(),
    };
    let mut times = Vec::new();
    for _ in 0..args.reps.max(1) {
        // Timing events (new_event(None) makes events without timing, which elapsed_ms refuses).
        let ev = || {
            ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(cu)
        };
        let (a, b) = (ev()?, ev()?);
        a.record(cuda.stream()).map_err(cu)?;
        for _ in 0..GPU_CALLS {
            call(&mut o, &mut lse)?;
        }
        b.record(cuda.stream()).map_err(cu)?;
        cuda.synchronize()?;
        times.push(f64::from(a.elapsed_ms(&b).map_err(cu)?) * 1e3 / GPU_CALLS as f64);
    }
    times.sort_by(f64::total_cmp);
    let med = times[times.len() / 2];
    let o_gpu = cuda.download(&o)?;
    let mut o_cpu = vec![T::NAN; p.o_layout().numel()];
    Backend::Cpu.run_paged(
        &p,
        &inputs.q,
        &inputs.k_cache,
        &inputs.v_cache,
        &mut o_cpu,
        None,
        None,
    )?;
    let max_abs_diff_cpu = o_gpu
        .iter()
        .zip(&o_cpu)
        .map(|(a, b)| f64::from((a.to_f32() - b.to_f32()).abs()))
        .fold(0.0, f64::max);
    Ok(GpuRow {
        batch: spec.seqlens_k.len(),
        keys: spec.seqlens_k[0],
        page_size: spec.page_size,
        seqlen_q: spec.seqlens_q[0],
        num_splits: splits,
        kv_bytes: bytes,
        us_per_call: med,
        tbps: bytes / (med * 1e-6) / 1e12,
        spread: (times[times.len() - 1] - times[0]) / med,
        max_abs_diff_cpu,
    })
}
