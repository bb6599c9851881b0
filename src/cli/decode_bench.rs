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
//! `--kv-dtype fp8` (GPU only) times each shape twice, over the `--dtype` cache and over that
//! cache quantized to e4m3 with per-KV-head scales (`fa4::paged::quantize_cache`), rounds of
//! the two interleaved (alternating which goes first), each in the method above, and prints
//! both times and their ratio (fp8 / 16-bit: the step time an fp8 cache saves); the fp8 output
//! is cross-checked against the CPU's fp8 path.
//!
//! [`PagedCache::kv_bytes`]: fa4::paged::PagedCache::kv_bytes

use std::time::Instant;

use clap::Args;
use rand::rngs::StdRng;
use rand::SeedableRng;
use serde::Serialize;

use fa4::paged::random::{random_paged, PagedInputs, PagedSpec};
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
    /// The cache's type when it differs from --dtype: fp8 (e4m3 with per-KV-head scales),
    /// timed on the GPU beside the --dtype cache, with the ratio of their times.
    #[arg(long, value_name = "DTYPE", help_heading = "Decode")]
    kv_dtype: Option<DType>,
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
            ("--kv-dtype", self.kv_dtype.is_some()),
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
    match (a.kv_dtype, gpu) {
        (None, _) => {}
        (Some(DType::Fp8E4M3), true) => return run_cuda_fp8(args, &shapes, (ps, sq, hq, hkv, d)),
        (Some(DType::Fp8E4M3), false) => {
            return Err(Error::invalid(
                "--kv-dtype",
                "fp8 caches are timed on the GPU (--backend cuda); the CPU's fp8 path widens the \
                 cache to f32 first",
            ))
        }
        (Some(t), _) => {
            return Err(Error::invalid(
                "--kv-dtype",
                format!("{t}: the cache has --dtype's type unless it is fp8"),
            ))
        }
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

/// The decode problem of a shape on the GPU: random inputs (seeded), causal with more than one
/// query row.
fn gpu_problem<T: Element>(spec: &PagedSpec) -> Result<(PagedInputs<T>, fa4::paged::PagedProblem)> {
    let mut rng = StdRng::seed_from_u64(0);
    let inputs = random_paged::<T, _>(&mut rng, spec)?;
    let opts = if spec.seqlens_q[0] > 1 {
        Options::new().causal()
    } else {
        Options::new()
    };
    let p = inputs.problem(&opts)?;
    Ok((inputs, p))
}

/// Copies of a cache a round rotates over: enough that a round's calls read more than
/// [`GPU_ROTATE_BYTES`] when one call reads `bytes`.
fn copies(bytes: f64) -> usize {
    ((GPU_ROTATE_BYTES / bytes).ceil() as usize).max(2)
}

/// One timed round: an event pair around [`GPU_CALLS`] back-to-back calls of `call` (which
/// enqueues one decode step and returns its split count); µs per call.
fn gpu_round(
    cuda: &fa4::cuda::CudaBackend,
    call: &mut dyn FnMut() -> Result<usize>,
) -> Result<f64> {
    let cu = |e| driver_error("decode bench events", e);
    // Timing events (new_event(None) makes events without timing, which elapsed_ms refuses).
    let ev = || {
        cuda.context()
            .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(cu)
    };
    let (a, b) = (ev()?, ev()?);
    a.record(cuda.stream()).map_err(cu)?;
    for _ in 0..GPU_CALLS {
        call()?;
    }
    b.record(cuda.stream()).map_err(cu)?;
    cuda.synchronize()?;
    Ok(f64::from(a.elapsed_ms(&b).map_err(cu)?) * 1e3 / GPU_CALLS as f64)
}

/// A driver error as the library's: the operation, its CUresult (code and name) and message.
fn driver_error(op: &str, e: cudarc::driver::DriverError) -> Error {
    Error::Cuda {
        op: op.into(),
        code: Some(e.0 as u32),
        name: format!("{:?}", e.0),
        message: e.to_string(),
    }
}

/// The median of `times` and their (max − min) / median.
fn median_spread(mut times: Vec<f64>) -> (f64, f64) {
    times.sort_by(f64::total_cmp);
    let med = times[times.len() / 2];
    (med, (times[times.len() - 1] - times[0]) / med)
}

fn max_abs_diff<T: Element>(a: &[T], b: &[T]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| f64::from((x.to_f32() - y.to_f32()).abs()))
        .fold(0.0, f64::max)
}

fn one_cuda<T: Element>(
    cuda: &fa4::cuda::CudaBackend,
    spec: &PagedSpec,
    args: &BenchArgs,
) -> Result<GpuRow> {
    let (inputs, p) = gpu_problem::<T>(spec)?;
    let bytes = p.cache().kv_bytes(std::mem::size_of::<T>());
    let copies = copies(bytes);
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
    let mut call = || -> Result<usize> {
        i += 1;
        let c = i % copies;
        Ok(cuda
            .forward_paged_device(
                &p,
                &mut tables,
                &q,
                &ks[c],
                &vs[c],
                &mut o,
                Some(&mut lse),
                None,
            )?
            .num_splits)
    };
    let mut splits = 1;
    for _ in 0..args.warmup.max(1) {
        splits = call()?;
    }
    cuda.synchronize()?;
    let times = (0..args.reps.max(1))
        .map(|_| gpu_round(cuda, &mut call))
        .collect::<Result<Vec<_>>>()?;
    let (med, spread) = median_spread(times);
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
    Ok(GpuRow {
        batch: spec.seqlens_k.len(),
        keys: spec.seqlens_k[0],
        page_size: spec.page_size,
        seqlen_q: spec.seqlens_q[0],
        num_splits: splits,
        kv_bytes: bytes,
        us_per_call: med,
        tbps: bytes / (med * 1e-6) / 1e12,
        spread,
        max_abs_diff_cpu: max_abs_diff(&o_gpu, &o_cpu),
    })
}

#[derive(Debug, Serialize)]
struct Fp8Row {
    batch: usize,
    keys: usize,
    page_size: usize,
    seqlen_q: usize,
    /// The 16-bit cache's split count, bytes, time and spread.
    num_splits: usize,
    kv_bytes: f64,
    us_per_call: f64,
    tbps: f64,
    spread: f64,
    /// The fp8 cache's.
    fp8_num_splits: usize,
    fp8_kv_bytes: f64,
    fp8_us_per_call: f64,
    fp8_tbps: f64,
    fp8_spread: f64,
    /// fp8 time over 16-bit time (medians).
    ratio: f64,
    /// `max|O_gpu − O_cpu|` of the fp8 cache against the CPU's fp8 path, a cross-check.
    fp8_max_abs_diff_cpu: f64,
}

fn run_cuda_fp8(
    args: &BenchArgs,
    shapes: &[(usize, usize)],
    (ps, sq, hq, hkv, d): (usize, usize, usize, usize, usize),
) -> Result<()> {
    let cuda = fa4::cuda::CudaBackend::new(0)
        .map_err(|e| Error::invalid("--backend", format!("cuda: {e}")))?;
    if !args.json {
        println!(
            "fa4 bench --decode --backend cuda --kv-dtype fp8: {} queries, {}, page {ps}, \
             seqlen_q {sq}{}, heads {hq}/{hkv}, d {d}; each shape over the {} cache and over it \
             quantized to e4m3 (per-KV-head scales), rounds interleaved; median of {} rounds of \
             {GPU_CALLS} calls after {} warm-up calls, caches rotated past the L2; TB/s = K+V \
             bytes / time; ratio = fp8 time / {} time",
            args.dtype,
            cuda.info().name,
            if sq > 1 { " causal" } else { "" },
            args.dtype,
            args.reps.max(1),
            args.warmup,
            args.dtype
        );
        println!(
            "{:>5} {:>7} {:>6} {:>9} {:>7} {:>6} {:>9} {:>7} {:>7} {:>7} {:>10}",
            "batch",
            "keys",
            "splits",
            "us/call",
            "TB/s",
            "spl8",
            "us fp8",
            "TB/s 8",
            "ratio",
            "spread",
            "|O-O_cpu|"
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
            DType::F16 => one_cuda_fp8::<half::f16>(&cuda, &spec, args)?,
            DType::Bf16 => one_cuda_fp8::<half::bf16>(&cuda, &spec, args)?,
            other => {
                return Err(Error::invalid(
                    "--dtype",
                    format!("the GPU decode kernels take fp16 or bf16 queries, got {other}"),
                ))
            }
        };
        if !args.json {
            println!(
                "{:>5} {:>7} {:>6} {:>9.1} {:>7.2} {:>6} {:>9.1} {:>7.2} {:>7.3} {:>6.1}% {:>10.2e}",
                row.batch,
                row.keys,
                row.num_splits,
                row.us_per_call,
                row.tbps,
                row.fp8_num_splits,
                row.fp8_us_per_call,
                row.fp8_tbps,
                row.ratio,
                row.spread.max(row.fp8_spread) * 100.0,
                row.fp8_max_abs_diff_cpu
            );
        }
        rows.push(row);
    }
    if args.json {
        print_json(&rows);
    } else if !rows.is_empty() {
        let geomean = (rows.iter().map(|r| r.ratio.ln()).sum::<f64>() / rows.len() as f64).exp();
        println!("ratio geomean {geomean:.3} (spread: the larger of the two caches' (max − min) / median)");
    }
    Ok(())
}

fn one_cuda_fp8<T: Element>(
    cuda: &fa4::cuda::CudaBackend,
    spec: &PagedSpec,
    args: &BenchArgs,
) -> Result<Fp8Row> {
    use fa4::cuda::decode::DeviceKvScales;
    use fa4::paged::{quantize_cache, KvScales, PagedKv, PagedOptions};
    let (inputs, p) = gpu_problem::<T>(spec)?;
    let p8 = p.clone().with_fp8_cache();
    let (k8, k_scale) = quantize_cache(&inputs.k_cache, spec.heads_kv, spec.head_dim);
    let (v8, v_scale) = quantize_cache(&inputs.v_cache, spec.heads_kv, spec.head_dim_v);
    let bytes = p.cache().kv_bytes(std::mem::size_of::<T>());
    let bytes8 = p.cache().kv_bytes(1);
    let (n16, n8) = (copies(bytes), copies(bytes8));
    let up8 = |x: &[fa4::F8E4M3]| {
        cuda.stream()
            .clone_htod(x)
            .map_err(|e| driver_error("upload the fp8 cache", e))
    };
    let q = cuda.upload(&inputs.q)?;
    let ks = (0..n16)
        .map(|_| cuda.upload(&inputs.k_cache))
        .collect::<Result<Vec<_>>>()?;
    let vs = (0..n16)
        .map(|_| cuda.upload(&inputs.v_cache))
        .collect::<Result<Vec<_>>>()?;
    let ks8 = (0..n8).map(|_| up8(&k8)).collect::<Result<Vec<_>>>()?;
    let vs8 = (0..n8).map(|_| up8(&v8)).collect::<Result<Vec<_>>>()?;
    let (dks, dvs) = (cuda.upload(&k_scale)?, cuda.upload(&v_scale)?);
    let scales = DeviceKvScales { k: &dks, v: &dvs };
    let mut o = cuda.alloc::<T>(p.o_layout().numel())?;
    let mut o8 = cuda.alloc::<T>(p.o_layout().numel())?;
    let mut lse = cuda.alloc::<f32>(p.lse_len().max(1))?;
    let mut tables = cuda.paged_tables(&p)?;
    let mut tables8 = cuda.paged_tables(&p8)?;
    let (mut i, mut i8) = (0usize, 0usize);
    let mut call16 = || -> Result<usize> {
        i += 1;
        let c = i % n16;
        Ok(cuda
            .forward_paged_device(
                &p,
                &mut tables,
                &q,
                &ks[c],
                &vs[c],
                &mut o,
                Some(&mut lse),
                None,
            )?
            .num_splits)
    };
    let mut lse8 = cuda.alloc::<f32>(p.lse_len().max(1))?;
    let mut call8 = || -> Result<usize> {
        i8 += 1;
        let c = i8 % n8;
        Ok(cuda
            .forward_paged_fp8_device(
                &p8,
                &mut tables8,
                &q,
                &ks8[c],
                &vs8[c],
                &scales,
                &mut o8,
                Some(&mut lse8),
                None,
            )?
            .num_splits)
    };
    let (mut s16, mut s8) = (1, 1);
    for _ in 0..args.warmup.max(1) {
        s16 = call16()?;
        s8 = call8()?;
    }
    cuda.synchronize()?;
    let (mut t16, mut t8) = (Vec::new(), Vec::new());
    // Rounds interleaved, the first of each pair alternating: clock or thermal drift hits both.
    for r in 0..args.reps.max(1) {
        if r % 2 == 0 {
            t16.push(gpu_round(cuda, &mut call16)?);
            t8.push(gpu_round(cuda, &mut call8)?);
        } else {
            t8.push(gpu_round(cuda, &mut call8)?);
            t16.push(gpu_round(cuda, &mut call16)?);
        }
    }
    let ((med, spread), (med8, spread8)) = (median_spread(t16), median_spread(t8));
    let o_gpu = cuda.download(&o8)?;
    let mut o_cpu = vec![T::NAN; p.o_layout().numel()];
    let mut o_shape = inputs.q_shape.clone();
    *o_shape.last_mut().expect("rank 4") = spec.head_dim_v;
    Backend::Cpu.forward_paged_fp8(
        &fa4::Tensor::new(&inputs.q, &inputs.q_shape)?,
        &PagedKv::new(
            fa4::Tensor::new(&k8, &inputs.k_shape)?,
            fa4::Tensor::new(&v8, &inputs.v_shape)?,
            &inputs.page_table,
            inputs.max_pages_per_seq,
            &inputs.seqlens_k,
        )?,
        &KvScales {
            k: &k_scale,
            v: &v_scale,
        },
        None,
        &mut fa4::TensorMut::new(&mut o_cpu, &o_shape)?,
        None,
        &PagedOptions::new(*p.options()),
    )?;
    Ok(Fp8Row {
        batch: spec.seqlens_k.len(),
        keys: spec.seqlens_k[0],
        page_size: spec.page_size,
        seqlen_q: spec.seqlens_q[0],
        num_splits: s16,
        kv_bytes: bytes,
        us_per_call: med,
        tbps: bytes / (med * 1e-6) / 1e12,
        spread,
        fp8_num_splits: s8,
        fp8_kv_bytes: bytes8,
        fp8_us_per_call: med8,
        fp8_tbps: bytes8 / (med8 * 1e-6) / 1e12,
        fp8_spread: spread8,
        ratio: med8 / med,
        fp8_max_abs_diff_cpu: max_abs_diff(&o_gpu, &o_cpu),
    })
}
