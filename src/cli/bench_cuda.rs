//! `fa4 bench --backend cuda`: TFLOP/s of the CUDA backend, by default on the FlashAttention
//! grid (16k tokens, hidden 2048: batch = 16384 / seqlen, heads = 2048 / head_dim).
//!
//! Method (the one `bench/peers.py` applies to every library, docs/perf.md): `--warmup` untimed
//! calls, then `--reps` rounds of `--calls` back-to-back calls between one pair of CUDA events;
//! per call, the median round and the spread between rounds (interquartile range / median).
//! The per-call column is one call and a synchronize between host clock reads, so it includes
//! the host launch path. FLOPs come from `Problem::flops` (4·b·h·sq·sk·d, halved for causal),
//! which `--json` prints, the count `bench/peers.py` also uses.
//!
//! `--rounds-from-stdin` hands the rounds to a driver: per shape it prints one JSON line when
//! the inputs are on the device and warmed up, then answers each line it reads:
//! - `round CALLS`: one round, `{"ms": GPU ms per call, "host_ms": host ms to enqueue one}`;
//! - `call`: one synchronised call after an untimed one, host clock, `{"ms": …}`;
//! - `next`: on to the next shape.
//!
//! A driver in another process can so interleave fa4's rounds with its own; `bench/peers.py`
//! times fa4 in its own process instead, through the Python package.

use std::io::BufRead;

use clap::Args;
use serde::Serialize;

use fa4::cuda::bench::{time_forward, Bench};
use fa4::cuda::CudaBackend;
use fa4::tensor::Layout;
use fa4::{DType, Element, Error, Options, Problem, Result};

/// Seed of the random inputs (the same for every shape: each shape's sizes differ anyway).
const SEED: u64 = 7;
/// `--tokens` when not given: the FlashAttention grid's 16k tokens per shape.
const DEFAULT_TOKENS: usize = 16384;
/// `--hidden` when not given: the FlashAttention grid's model width.
const DEFAULT_HIDDEN: usize = 2048;
/// `--calls` when not given.
const DEFAULT_CALLS: usize = 10;

/// Flags of the CUDA benchmark. Those with a default are `Option`s, so that `fa4 bench` can
/// tell a flag given from one left out and refuse, by name, one that a pass would not read.
#[derive(Args, Debug, Clone)]
pub struct CudaBenchArgs {
    /// Shapes `D[/DV],SEQLEN,CAUSAL[,BATCH,HEADS[,KV_HEADS]]` (DV: V's head dim, default D;
    /// causal 0 or 1; batch and heads default to --tokens / SEQLEN and --hidden / D, KV heads
    /// to HEADS); repeatable [default: the
    /// FlashAttention grid, d 64/128/256 × seqlen 1k/4k/16k × causal 0/1; with --backward,
    /// the --seqlens × --head-dims grid].
    #[arg(long, num_args = 1.., value_name = "SHAPE")]
    pub grid: Vec<String>,
    /// Tokens per grid point (batch = tokens / seqlen) [default: 16384].
    #[arg(long)]
    pub tokens: Option<usize>,
    /// Model width (heads = hidden / head_dim) [default: 2048].
    #[arg(long)]
    pub hidden: Option<usize>,
    /// Back-to-back calls per timed round (one event pair around them; --reps is the rounds)
    /// [default: 10].
    #[arg(long)]
    pub calls: Option<usize>,
    /// Take the rounds from stdin, for a driver in another process that interleaves libraries.
    #[arg(long)]
    pub rounds_from_stdin: bool,
    /// Override the planner's tiles:
    /// `block_m,block_n,warps,m_tiles,stages,ctas_per_sm,q_in_regs(0|1),lazy_rescale(0|1)`.
    #[arg(long)]
    pub tiles: Option<String>,
    /// Override the Hopper planner's tiles:
    /// `block_n,consumer_wgs,stages,producer_regs,consumer_regs,lazy,overlap,pingpong,persistent,poly`.
    #[arg(long)]
    pub sm90_tiles: Option<String>,
    /// Packed varlen batches: every shape's sequences become these lengths (seqlen_q =
    /// seqlen_k; the shape's SEQLEN and BATCH are replaced), comma-separated, or a file of
    /// lengths separated by commas or whitespace (e.g. `bench/peers.py lengths`: its ragged
    /// batch).
    #[arg(long, value_name = "L,L,...|FILE", conflicts_with = "varlen")]
    pub lengths: Option<String>,
    /// Packed varlen batches of ragged lengths drawn from SEED: a truncated exponential of
    /// mean 2048 over 1..8192, summing to --tokens (peers.py's distribution; its draws come
    /// from Python's generator: give them with --lengths to time the same batch).
    #[arg(long, value_name = "SEED")]
    pub varlen: Option<u64>,
    /// CUDA device ordinal [default: 0].
    #[arg(long)]
    pub device: Option<usize>,
    /// Which CUDA kernel family runs the grid [default: auto, or what FA4_KERNEL names; with
    /// --backward: auto, sm80 or sm90, the backward's family, unless FA4_BWD_KERNEL is set].
    #[arg(long, value_enum)]
    pub kernel: Option<super::KernelArg>,
}

impl CudaBenchArgs {
    /// `--tokens`, or its default.
    pub fn tokens(&self) -> usize {
        self.tokens.unwrap_or(DEFAULT_TOKENS)
    }
    /// `--hidden`, or its default.
    pub fn hidden(&self) -> usize {
        self.hidden.unwrap_or(DEFAULT_HIDDEN)
    }
    /// `--calls`, or its default.
    pub fn calls(&self) -> usize {
        self.calls.unwrap_or(DEFAULT_CALLS)
    }
    /// The varlen lengths `--lengths` or `--varlen` give, or `None` (fixed-length shapes).
    pub fn lengths(&self) -> Result<Option<Vec<usize>>> {
        match (&self.lengths, self.varlen) {
            (Some(spec), _) => parse_lengths(spec).map(Some),
            (None, Some(seed)) => {
                // The draws sum to --tokens, and the offsets are int32.
                let tokens = self.tokens();
                if tokens == 0 || tokens > i32::MAX as usize {
                    return Err(Error::invalid(
                        "--tokens",
                        format!("{tokens}: with --varlen the packed batch's rows, 1 to 2^31 − 1"),
                    ));
                }
                Ok(Some(ragged_lengths(seed, tokens)))
            }
            (None, None) => Ok(None),
        }
    }
    /// `--device`, or device 0.
    pub fn device(&self) -> usize {
        self.device.unwrap_or(0)
    }
    /// The kernel choice: `--kernel` where it names a family, else `FA4_KERNEL`'s (an error
    /// naming the variable if it names none).
    pub fn kernel_choice(&self) -> Result<fa4::cuda::KernelChoice> {
        match self.kernel {
            Some(k) if k != super::KernelArg::Auto => Ok(k.into()),
            _ => fa4::cuda::KernelChoice::from_env(),
        }
    }
}

/// One benchmark shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub d: usize,
    /// Head dim of V and O (`D/DV` in `--grid`; D when left out).
    pub dv: usize,
    pub seqlen: usize,
    pub causal: bool,
    pub batch: usize,
    pub heads: usize,
    pub kv_heads: usize,
}

/// What a shape is, printed before its times (and alone, as the ready line of
/// `--rounds-from-stdin`).
#[derive(Serialize)]
struct Head {
    d: usize,
    dv: usize,
    seqlen: usize,
    batch: usize,
    heads: usize,
    kv_heads: usize,
    causal: bool,
    /// A packed varlen batch's lengths (`--lengths`, `--varlen`): `batch` of them, the longest
    /// `seqlen`.
    #[serde(skip_serializing_if = "Option::is_none")]
    lengths: Option<Vec<usize>>,
    kernel: String,
    flops: f64,
    input_sets: usize,
    first_call_s: f64,
}

#[derive(Serialize)]
struct Row {
    #[serde(flatten)]
    head: Head,
    calls: usize,
    rounds: usize,
    median_ms: f64,
    min_ms: f64,
    max_ms: f64,
    q1_ms: f64,
    q3_ms: f64,
    /// (q3 − q1) / median across rounds (the interquartile range; min_ms/max_ms give the range).
    spread: f64,
    tflops: f64,
    /// One call and a synchronize, host clock: includes the host path.
    per_call_ms: f64,
    /// Host time to enqueue one call inside a round (median).
    host_enqueue_ms: f64,
}

/// Most sequences `--lengths` takes (a batch of more would be a mistake, not a benchmark).
const MAX_SEQUENCES: usize = 1 << 20;

/// `--lengths`: comma-separated whole numbers, or else the path of a file of them (commas or
/// whitespace between). At least one sequence, at least one row in all; zero-length sequences
/// are allowed (a varlen batch may hold them).
pub fn parse_lengths(spec: &str) -> Result<Vec<usize>> {
    let bad = |why: String| Error::invalid("--lengths", why);
    let parse = |text: &str, what: &str| -> Result<Vec<usize>> {
        text.split(|c: char| c == ',' || c.is_whitespace())
            .filter(|x| !x.is_empty())
            .map(|x| {
                x.parse::<usize>()
                    .map_err(|_| bad(format!("{what}: `{x}` is not a whole number")))
            })
            .collect()
    };
    let looks_inline = spec
        .chars()
        .all(|c| c.is_ascii_digit() || c == ',' || c == ' ');
    let lengths = if looks_inline {
        parse(spec, "expected comma-separated lengths")?
    } else {
        let text = std::fs::read_to_string(spec).map_err(|e| {
            bad(format!(
                "`{spec}` is neither comma-separated lengths nor a readable file: {e}"
            ))
        })?;
        parse(&text, spec)?
    };
    if lengths.is_empty() || lengths.len() > MAX_SEQUENCES {
        return Err(bad(format!(
            "expected 1 to {MAX_SEQUENCES} lengths, got {}",
            lengths.len()
        )));
    }
    let total = lengths.iter().try_fold(0usize, |a, &n| a.checked_add(n));
    match total {
        Some(t) if t > 0 && t <= i32::MAX as usize => Ok(lengths),
        _ => Err(bad(
            "the lengths must add up to at least 1 and at most 2^31 − 1 rows".into(),
        )),
    }
}

/// The varlen offsets of packed sequences of these lengths: 0, then the running sums (whose
/// total fits int32: `parse_lengths`, `CudaBenchArgs::lengths`).
pub fn offsets_of(lengths: &[usize]) -> Vec<i32> {
    std::iter::once(0)
        .chain(lengths.iter().scan(0i32, |sum, &n| {
            *sum += n as i32;
            Some(*sum)
        }))
        .collect()
}

/// The line a table prints above the rows of packed batches of these lengths; `columns` names
/// its seqlen and batch columns.
pub fn lengths_line(lengths: &[usize], columns: &str) -> String {
    format!(
        "packed varlen batches of {} sequences, {} rows in all, the longest {} ({columns} below): {}",
        lengths.len(),
        lengths.iter().sum::<usize>(),
        lengths.iter().max().unwrap_or(&0),
        lengths.iter().map(|n| n.to_string()).collect::<Vec<_>>().join(",")
    )
}

/// Ragged lengths summing to `total`, drawn from `seed`: an exponential truncated to
/// [1, 8192] with mean 2048, the last length cut to what is left (`bench/peers.py`'s
/// `varlen_lengths`, from Rust's generator).
pub fn ragged_lengths(seed: u64, total: usize) -> Vec<usize> {
    use rand::{Rng, SeedableRng};
    const MEAN: f64 = 2048.0;
    const LO: f64 = 1.0;
    const HI: f64 = 8192.0;
    let width = HI - LO;
    // The scale θ of the exponential whose truncation to [0, width] has mean MEAN − LO:
    // m(θ) = θ − width / expm1(width / θ) increases with θ; bisect in log space.
    let (mut lo, mut hi) = (1e-9 * width, 1e6 * width);
    for _ in 0..200 {
        let th = (lo * hi).sqrt();
        let m = if width / th < 700.0 {
            th - width / (width / th).exp_m1()
        } else {
            th
        };
        if m < MEAN - LO {
            lo = th
        } else {
            hi = th
        }
    }
    let th = (lo * hi).sqrt();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let (mut out, mut left) = (Vec::new(), total);
    while left > 0 {
        let u: f64 = rng.random();
        let x = LO - th * (-u * -(-width / th).exp_m1()).ln_1p();
        let n = (x.round() as usize)
            .clamp(LO as usize, HI as usize)
            .min(left);
        out.push(n);
        left -= n;
    }
    out
}

fn parse_shape(it: &str, tokens: usize, hidden: usize) -> Result<Shape> {
    let bad = |why: String| Error::invalid("--grid", format!("`{it}`: {why}"));
    let form = "expected D[/DV],SEQLEN,CAUSAL[,BATCH,HEADS[,KV_HEADS]] of whole numbers";
    // The first field may be D/DV: V's head dim beside Q and K's (192/128, MLA prefill).
    let (first, rest) = it.split_once(',').unwrap_or((it, ""));
    let (d_field, dv) = match first.split_once('/') {
        Some((d, dv)) => (
            d,
            Some(dv.trim().parse::<usize>().map_err(|_| bad(form.into()))?),
        ),
        None => (first, None),
    };
    let f = std::iter::once(d_field)
        .chain(rest.split(',').filter(|_| !rest.is_empty()))
        .map(|x| x.trim().parse::<usize>())
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|_| bad(form.into()))?;
    let (d, seqlen, c) = match f[..] {
        [d, s, c, ..] if (3..=6).contains(&f.len()) && f.len() != 4 => (d, s, c),
        _ => {
            return Err(bad(
                "expected D[/DV],SEQLEN,CAUSAL or D[/DV],SEQLEN,CAUSAL,BATCH,HEADS[,KV_HEADS]"
                    .into(),
            ))
        }
    };
    let dv = dv.unwrap_or(d);
    if c > 1 || d == 0 || dv == 0 || seqlen == 0 {
        return Err(bad(
            "D, DV and SEQLEN must be ≥ 1 and CAUSAL 0 or 1".to_string()
        ));
    }
    let (batch, heads) = match f[..] {
        [_, _, _, b, h, ..] => (b, h),
        _ => {
            if !hidden.is_multiple_of(d) || !tokens.is_multiple_of(seqlen) {
                return Err(bad(format!(
                    "D must divide --hidden {hidden} and SEQLEN must divide --tokens {tokens} \
                     (or give BATCH,HEADS)"
                )));
            }
            (tokens / seqlen, hidden / d)
        }
    };
    let kv_heads = f.get(5).copied().unwrap_or(heads);
    if batch == 0 || heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
        return Err(bad(format!(
            "BATCH, HEADS and KV_HEADS must be ≥ 1, KV_HEADS dividing HEADS (got {batch}, {heads}, {kv_heads})"
        )));
    }
    Ok(Shape {
        d,
        dv,
        seqlen,
        causal: c == 1,
        batch,
        heads,
        kv_heads,
    })
}

/// The shapes `--grid` names (each item's batch and heads defaulting to `tokens` / SEQLEN and
/// `hidden` / D), or the FlashAttention grid when it names none.
pub fn parse_grid(items: &[String], tokens: usize, hidden: usize) -> Result<Vec<Shape>> {
    if items.is_empty() {
        let mut g = Vec::new();
        for d in [64, 128, 256] {
            for s in [1024, 4096, 16384] {
                for c in [0, 1] {
                    g.push(parse_shape(&format!("{d},{s},{c}"), tokens, hidden)?);
                }
            }
        }
        return Ok(g);
    }
    items
        .iter()
        .map(|it| parse_shape(it, tokens, hidden))
        .collect()
}

impl Shape {
    /// The shape with its sequences replaced by packed ones of these lengths (`--lengths`,
    /// `--varlen`): batch = their count, seqlen = the longest.
    pub fn packed(mut self, lengths: &[usize]) -> Shape {
        self.batch = lengths.len();
        self.seqlen = lengths.iter().copied().max().unwrap_or(0);
        self
    }

    /// The shape's problem (seqlen_q = seqlen_k), or with `lengths` a packed varlen batch of
    /// them ([`Shape::packed`] first); `flag` names what set the shape in a layout's error
    /// (`--grid`, or `fa4 bench --backward`'s `--seqlens`).
    pub fn problem(&self, dtype: DType, flag: &str, lengths: Option<&[usize]>) -> Result<Problem> {
        let (b, s, d, dv) = (self.batch, self.seqlen, self.d, self.dv);
        let opts = if self.causal {
            Options::new().causal()
        } else {
            Options::new()
        };
        if let Some(lens) = lengths {
            let total: usize = lens.iter().sum();
            let cu = offsets_of(lens);
            let lq = Layout::new(flag, &[total, self.heads, d], None)?;
            let lk = Layout::new(flag, &[total, self.kv_heads, d], None)?;
            let lv = Layout::new(flag, &[total, self.kv_heads, dv], None)?;
            let lo = Layout::new(flag, &[total, self.heads, dv], None)?;
            return Problem::new(dtype, &lq, &lk, &lv, &lo, Some(&cu), Some(&cu), &opts);
        }
        let lq = Layout::new(flag, &[b, s, self.heads, d], None)?;
        let lk = Layout::new(flag, &[b, s, self.kv_heads, d], None)?;
        let lv = Layout::new(flag, &[b, s, self.kv_heads, dv], None)?;
        let lo = Layout::new(flag, &[b, s, self.heads, dv], None)?;
        Problem::new(dtype, &lq, &lk, &lv, &lo, None, None, &opts)
    }

    /// The head dim column: `d`, and `d/dv` where V's differs.
    pub fn d_label(&self) -> String {
        if self.dv == self.d {
            self.d.to_string()
        } else {
            format!("{}/{}", self.d, self.dv)
        }
    }
}

/// Runs the CUDA benchmark; prints a table, or one JSON array with `json`.
pub fn run(a: &CudaBenchArgs, dtype: DType, warmup: usize, reps: usize, json: bool) -> Result<()> {
    let lengths = a.lengths()?;
    if !matches!(dtype, DType::Bf16 | DType::F16) {
        return Err(Error::invalid(
            "--dtype",
            format!("the CUDA backend computes fp16 and bf16, not {dtype}"),
        ));
    }
    let calls = a.calls();
    if calls == 0 || reps == 0 {
        return Err(Error::invalid("--calls/--reps", "must be ≥ 1"));
    }
    let grid: Vec<Shape> = parse_grid(&a.grid, a.tokens(), a.hidden())?
        .into_iter()
        .map(|s| match &lengths {
            Some(l) => s.packed(l),
            None => s,
        })
        .collect();
    let lengths = lengths.as_deref();
    let tiles = a
        .tiles
        .as_deref()
        .map(|t| super::parse_tiles("--tiles", t))
        .transpose()?;
    a.kernel.unwrap_or_default().note();
    let choice = a.kernel_choice()?;
    let cuda = CudaBackend::new(a.device())
        .map_err(|e| Error::invalid("--backend", format!("cuda: {e}")))?
        .with_tiles(tiles)
        .with_kernel(choice)
        .with_sm90_tiles(
            a.sm90_tiles
                .as_deref()
                .map(|t| super::parse_tiles("--sm90-tiles", t))
                .transpose()?,
        );
    if a.rounds_from_stdin {
        let mut lines = std::io::stdin().lock().lines();
        for s in &grid {
            let keep_going = match dtype {
                DType::Bf16 => serve::<half::bf16>(&cuda, s, lengths, dtype, warmup, &mut lines)?,
                _ => serve::<half::f16>(&cuda, s, lengths, dtype, warmup, &mut lines)?,
            };
            if !keep_going {
                break;
            }
        }
        return Ok(());
    }
    if !json {
        let i = cuda.info();
        println!(
            "{} ({}, {} SMs), {dtype}, median of {reps} rounds of {} back-to-back calls (event pair \
             around each round); spread = interquartile range / median over rounds; per-call = one \
             call + synchronize, host clock (includes the host path)",
            i.name, i.target, i.sm_count, calls
        );
        if let Some(l) = lengths {
            println!("{}", lengths_line(l, "seqlen and batch"));
        }
        println!(
            "{:>7} {:>6} {:>5} {:>9} {:>6} {:>9} {:>7} {:>8} {:>9}  kernel",
            "d", "seqlen", "batch", "heads", "causal", "ms", "spread", "TFLOP/s", "per-call"
        );
    }
    let mut rows = Vec::new();
    for s in &grid {
        let row = match dtype {
            DType::Bf16 => measure::<half::bf16>(&cuda, s, lengths, dtype, warmup, calls, reps)?,
            _ => measure::<half::f16>(&cuda, s, lengths, dtype, warmup, calls, reps)?,
        };
        if !json {
            println!(
                "{:>7} {:>6} {:>5} {:>9} {:>6} {:>9.3} {:>6.1}% {:>8.1} {:>9.3}  {}",
                s.d_label(),
                s.seqlen,
                s.batch,
                format!("{}/{}", s.heads, s.kv_heads),
                s.causal as u8,
                row.median_ms,
                100.0 * row.spread,
                row.tflops,
                row.per_call_ms,
                row.head.kernel
            );
        }
        rows.push(row);
    }
    if json {
        println!(
            "{}",
            serde_json::to_string(&rows).map_err(|e| Error::invalid("--json", e.to_string()))?
        );
    }
    Ok(())
}

/// Plans and compiles the shape's kernel; the head of its row.
fn prepare(cuda: &CudaBackend, s: &Shape, p: &Problem, lengths: Option<&[usize]>) -> Result<Head> {
    let plan = cuda.plan(p)?;
    let start = std::time::Instant::now();
    cuda.prepare(&plan)?;
    Ok(Head {
        d: s.d,
        dv: s.dv,
        seqlen: s.seqlen,
        batch: s.batch,
        heads: s.heads,
        kv_heads: s.kv_heads,
        causal: s.causal,
        lengths: lengths.map(<[usize]>::to_vec),
        kernel: plan.to_string(),
        flops: p.flops(),
        input_sets: 0,
        first_call_s: start.elapsed().as_secs_f64(),
    })
}

fn measure<T: Element>(
    cuda: &CudaBackend,
    s: &Shape,
    lengths: Option<&[usize]>,
    dtype: DType,
    warmup: usize,
    calls: usize,
    reps: usize,
) -> Result<Row> {
    let p = s.problem(dtype, "--grid", lengths)?;
    let mut head = prepare(cuda, s, &p, lengths)?;
    let t = time_forward::<T>(cuda, &p, warmup, calls, reps, SEED)?;
    head.input_sets = t.input_sets;
    Ok(Row {
        head,
        calls: t.calls,
        rounds: t.rounds.n,
        median_ms: t.rounds.median,
        min_ms: t.rounds.min,
        max_ms: t.rounds.max,
        q1_ms: t.rounds.q1,
        q3_ms: t.rounds.q3,
        spread: t.rounds.iqr_rel(),
        tflops: t.tflops,
        per_call_ms: t.per_call.median,
        host_enqueue_ms: t.host_enqueue.median,
    })
}

/// One shape under `--rounds-from-stdin`; false when stdin ended.
fn serve<T: Element>(
    cuda: &CudaBackend,
    s: &Shape,
    lengths: Option<&[usize]>,
    dtype: DType,
    warmup: usize,
    lines: &mut impl Iterator<Item = std::io::Result<String>>,
) -> Result<bool> {
    let p = s.problem(dtype, "--grid", lengths)?;
    let mut head = prepare(cuda, s, &p, lengths)?;
    let mut b = Bench::<T>::new(cuda, &p, SEED)?;
    b.warm_up(warmup)?;
    head.input_sets = b.input_sets();
    let say = |v: &serde_json::Value| println!("{v}");
    say(&serde_json::to_value(&head).map_err(|e| Error::invalid("--json", e.to_string()))?);
    for line in lines {
        let line = line.map_err(|e| Error::invalid("--rounds-from-stdin", e.to_string()))?;
        let mut w = line.split_whitespace();
        match (w.next(), w.next().map(str::parse::<usize>)) {
            (Some("round"), Some(Ok(calls))) if calls > 0 => {
                let r = b.round(calls)?;
                say(&serde_json::json!({ "ms": r.ms, "host_ms": r.host_ms }))
            }
            (Some("call"), None) => say(&serde_json::json!({ "ms": b.per_call()? })),
            (Some("next"), None) => return Ok(true),
            _ => {
                return Err(Error::invalid(
                    "--rounds-from-stdin",
                    format!("expected `round CALLS`, `call` or `next`, got `{line}`"),
                ))
            }
        }
    }
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_default_to_tokens_and_hidden() {
        let s = parse_shape("128,4096,1", 16384, 2048).unwrap();
        assert_eq!((s.batch, s.heads, s.kv_heads, s.causal), (4, 16, 16, true));
        let s = parse_shape("128,2000,0,8,16", 16384, 2048).unwrap();
        assert_eq!((s.batch, s.heads, s.kv_heads, s.seqlen), (8, 16, 16, 2000));
        let s = parse_shape("128,4096,1,4,32,8", 16384, 2048).unwrap();
        assert_eq!((s.heads, s.kv_heads, s.dv), (32, 8, 128));
        // D/DV: V's head dim apart (heads from D).
        let s = parse_shape("192/128,4096,1,4,16", 16384, 2048).unwrap();
        assert_eq!((s.d, s.dv, s.heads), (192, 128, 16));
        let p = s.problem(DType::Bf16, "--grid", None).unwrap();
        assert_eq!((p.head_dim(), p.head_dim_v()), (192, 128));
        for bad in ["192/,4096,1", "192/0,4096,1", "/128,4096,1"] {
            assert!(parse_shape(bad, 16384, 2048).is_err(), "{bad}");
        }
    }

    #[test]
    fn bad_shapes_name_the_flag() {
        for bad in [
            "128,4096",
            "128,4096,2",
            "0,4096,1",
            "128,2000,0",
            "128,4096,0,4",
            "128,4096,1,4,32,7",
            "128,4096,1,0,32",
            "x,1,0",
            "128,4096,1,4,32,8,1",
        ] {
            let e = parse_shape(bad, 16384, 2048).unwrap_err().to_string();
            assert!(e.contains("--grid"), "{bad}: {e}");
        }
    }

    /// `--lengths`: inline or from a file, zero-length sequences allowed, errors naming the
    /// flag; the packed problem has the lengths' offsets, the longest as seqlen.
    #[test]
    fn lengths_come_inline_or_from_a_file_and_pack_the_shape() {
        assert_eq!(parse_lengths("300,0,513").unwrap(), [300, 0, 513]);
        let dir = std::env::temp_dir().join(format!("fa4-lengths-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("lengths.txt");
        std::fs::write(&f, "17\n 4096,1\n").unwrap();
        assert_eq!(parse_lengths(f.to_str().unwrap()).unwrap(), [17, 4096, 1]);
        std::fs::write(&f, "17 x").unwrap();
        for bad in ["", "0,0", "5,,x", f.to_str().unwrap(), "/no/such/file"] {
            let e = parse_lengths(bad).unwrap_err().to_string();
            assert!(e.contains("--lengths"), "{bad:?}: {e}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
        let s = parse_shape("128,4096,1,4,16,4", 16384, 2048)
            .unwrap()
            .packed(&[300, 0, 513]);
        assert_eq!((s.batch, s.seqlen), (3, 513));
        let p = s
            .problem(DType::Bf16, "--grid", Some(&[300, 0, 513]))
            .unwrap();
        assert!(p.is_varlen());
        let seqs = p.sequences();
        assert_eq!(seqs.len(), 3);
        assert_eq!(
            (seqs[2].q_start, seqs[2].q_len, seqs[2].k_len),
            (300, 513, 513)
        );
        assert_eq!((p.heads_q(), p.heads_kv()), (16, 4));
    }

    /// `--varlen SEED`: lengths in [1, 8192] summing to the tokens, mean near 2048 over many
    /// draws, the same for a seed and different across seeds.
    #[test]
    fn ragged_lengths_follow_the_truncated_exponential() {
        for seed in 0..4 {
            let l = ragged_lengths(seed, 16384);
            assert_eq!(l.iter().sum::<usize>(), 16384);
            assert!(l.iter().all(|&n| (1..=8192).contains(&n)), "{l:?}");
            assert_eq!(l, ragged_lengths(seed, 16384));
        }
        assert_ne!(ragged_lengths(1, 16384), ragged_lengths(2, 16384));
        let many = ragged_lengths(5, 4_000_000);
        let body = &many[..many.len() - 1]; // the last is cut to what is left
        let mean = body.iter().sum::<usize>() as f64 / body.len() as f64;
        assert!((mean - 2048.0).abs() < 60.0, "mean {mean}");
        assert!(body.iter().any(|&n| n > 7000) && body.iter().any(|&n| n < 100));
    }

    #[test]
    fn default_grid_is_the_eighteen_shapes() {
        let g = parse_grid(&[], 16384, 2048).unwrap();
        assert_eq!(g.len(), 18);
        assert!(g
            .iter()
            .all(|s| s.batch * s.seqlen == 16384 && s.heads * s.d == 2048));
    }
}
