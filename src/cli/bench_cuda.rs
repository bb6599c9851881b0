//! `fa4 bench --backend cuda`: TFLOP/s of the CUDA backend on the FlashAttention grid (16k
//! tokens, hidden 2048: batch = 16384 / seqlen, heads = 2048 / head_dim), event-timed medians.
//! The peers (PyTorch SDPA's FlashAttention-2 and cuDNN backends, FlashAttention-4 CuTe) are
//! measured in the same run by `bench/grid.py`, which calls this with `--json`.

use clap::Args;
use serde::Serialize;

use fa4::cuda::bench::time_forward;
use fa4::cuda::CudaBackend;
use fa4::tensor::Layout;
use fa4::{DType, Error, Options, Problem, Result};

/// Flags of the CUDA benchmark.
#[derive(Args, Debug, Clone)]
pub struct CudaBenchArgs {
    /// Grid points `d,seqlen,causal` (causal 0 or 1); repeatable [default: the FlashAttention
    /// grid, d 64/128/256 × seqlen 1k/4k/16k × causal 0/1].
    #[arg(long, num_args = 1.., value_name = "D,SEQLEN,CAUSAL")]
    grid: Vec<String>,
    /// Tokens per grid point (batch = tokens / seqlen).
    #[arg(long, default_value_t = 16384)]
    tokens: usize,
    /// Model width (heads = hidden / head_dim).
    #[arg(long, default_value_t = 2048)]
    hidden: usize,
    /// Override the planner's tiles:
    /// `block_m,block_n,warps,m_tiles,stages,ctas_per_sm,q_in_regs(0|1),lazy_rescale(0|1)`.
    #[arg(long)]
    tiles: Option<String>,
    /// Override the Hopper planner's tiles:
    /// `block_n,consumer_wgs,stages,producer_regs,consumer_regs,lazy,overlap,pingpong,persistent,poly`.
    #[arg(long)]
    sm90_tiles: Option<String>,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Which CUDA kernel family runs the grid.
    #[arg(long, value_enum, default_value_t = super::KernelArg::Auto)]
    kernel: super::KernelArg,
}

#[derive(Serialize)]
struct Row {
    d: usize,
    seqlen: usize,
    batch: usize,
    heads: usize,
    causal: bool,
    kernel: String,
    median_ms: f64,
    min_ms: f64,
    tflops: f64,
    first_call_s: f64,
}

fn parse_grid(items: &[String]) -> Result<Vec<(usize, usize, bool)>> {
    if items.is_empty() {
        let mut g = Vec::new();
        for d in [64, 128, 256] {
            for s in [1024, 4096, 16384] {
                for c in [false, true] {
                    g.push((d, s, c));
                }
            }
        }
        return Ok(g);
    }
    items
        .iter()
        .map(|it| {
            let f: Vec<&str> = it.split(',').collect();
            let n = |x: &str| x.trim().parse::<usize>().ok();
            match (
                f.len(),
                f.first().and_then(|x| n(x)),
                f.get(1).and_then(|x| n(x)),
                f.get(2).and_then(|x| n(x)),
            ) {
                (3, Some(d), Some(s), Some(c)) if c <= 1 && d > 0 && s > 0 => Ok((d, s, c == 1)),
                _ => Err(Error::invalid(
                    "--grid",
                    format!("expected D,SEQLEN,CAUSAL (causal 0 or 1), got `{it}`"),
                )),
            }
        })
        .collect()
}

/// Runs the CUDA benchmark; prints a table, or one JSON array with `json`.
pub fn run(a: &CudaBenchArgs, dtype: DType, warmup: usize, reps: usize, json: bool) -> Result<()> {
    let grid = parse_grid(&a.grid)?;
    let tiles = a
        .tiles
        .as_deref()
        .map(|t| super::parse_tiles("--tiles", t))
        .transpose()?;
    let cuda = CudaBackend::new(a.device)
        .map_err(|e| Error::invalid("--backend", format!("cuda: {e}")))?
        .with_tiles(tiles)
        .with_kernel(a.kernel.into())
        .with_sm90_tiles(
            a.sm90_tiles
                .as_deref()
                .map(|t| super::parse_tiles("--sm90-tiles", t))
                .transpose()?,
        );
    if !json {
        let i = cuda.info();
        println!(
            "{} ({}, {} SMs), {dtype}, {} tokens, hidden {}",
            i.name, i.target, i.sm_count, a.tokens, a.hidden
        );
        println!(
            "{:>4} {:>6} {:>5} {:>5} {:>6} {:>9} {:>8}  kernel",
            "d", "seqlen", "batch", "heads", "causal", "ms", "TFLOP/s"
        );
    }
    let mut rows = Vec::new();
    for (d, s, c) in grid {
        if !a.hidden.is_multiple_of(d) || !a.tokens.is_multiple_of(s) {
            return Err(Error::invalid(
                "--grid",
                format!(
                    "d {d} must divide --hidden {} and seqlen {s} must divide --tokens {}",
                    a.hidden, a.tokens
                ),
            ));
        }
        let (heads, batch) = (a.hidden / d, a.tokens / s);
        let l = Layout::new("q", &[batch, s, heads, d], None)?;
        let opts = if c {
            Options::new().causal()
        } else {
            Options::new()
        };
        let p = Problem::new(dtype, &l, &l, &l, &l, None, None, &opts)?;
        let plan = cuda.plan(&p)?;
        let start = std::time::Instant::now();
        cuda.prepare(&plan)?;
        let first_call_s = start.elapsed().as_secs_f64();
        let t = match dtype {
            DType::Bf16 => time_forward::<half::bf16>(&cuda, &p, warmup, reps, 7)?,
            DType::F16 => time_forward::<half::f16>(&cuda, &p, warmup, reps, 7)?,
            other => {
                return Err(Error::invalid(
                    "--dtype",
                    format!("the CUDA backend computes fp16 and bf16, not {other}"),
                ))
            }
        };
        let row = Row {
            d,
            seqlen: s,
            batch,
            heads,
            causal: c,
            kernel: plan.to_string(),
            median_ms: t.median_ms,
            min_ms: t.min_ms,
            tflops: t.tflops,
            first_call_s,
        };
        if !json {
            println!(
                "{:>4} {:>6} {:>5} {:>5} {:>6} {:>9.3} {:>8.1}  {}",
                d, s, batch, heads, c as u8, t.median_ms, t.tflops, row.kernel
            );
        }
        rows.push(row);
    }
    if json {
        println!(
            "{}",
            serde_json::to_string(&rows).map_err(|e| Error::invalid("json", e.to_string()))?
        );
    }
    Ok(())
}
