//! Times the GPU decode kernels on the decode grid (bf16, 32 query / 8 KV heads, d128):
//! one event pair around 10 back-to-back calls per round, the caches rotated over enough copies
//! that the calls of a round read more than 400 MB (the H200's L2 is 50 MB), the caches filled
//! with random values (a 32 MiB random block repeated), page tables shuffled.
//!
//! - `decode_bench [ROUNDS]`: the grid at pages 16, 64, 256, speculative decode (seqlen_q 4,
//!   causal) and page 1, the planner's plan, the median of ROUNDS (9) rounds. One line per case:
//!   page size, seqlen_q, batch, keys, splits, µs per call, TB/s of K+V read, host µs per call
//!   and the rounds' spread.
//! - `decode_bench --serve`: one round per stdin line `PAGE SQ BATCH KEYS SPLITS FILL [VARIANT]`
//!   (SPLITS 0 = the planner's; FILL `random`, or `zeros` for caches and queries of zeros;
//!   VARIANT a `FA4_DECODE_VARIANT` value, default `auto`), answered with one line `SPLITS
//!   US_PER_CALL`; the last case's buffers stay allocated between requests (a variant switch
//!   keeps them). `bench/profile.sh decode` drives it under Nsight Compute. fa4 beside its
//!   peers is `bench/peers.py decode`, in one process: timed from a second process beside
//!   PyTorch, the peers' rounds took in host time this process's did not (bench/README.md).
//! - `decode_bench --precompile [VARIANT,…]`: fills the kernel cache for an H200, no GPU
//!   needed: every split-kernel variant, and the all-heads variants that the decode grid and
//!   tests/cuda_decode.rs plan, and the grid's kernels over an fp8 cache (`fa4 bench --decode
//!   --backend cuda --kv-dtype fp8`); with a variant list, only the grid's kernels under those.
//! - `decode_bench --plans VARIANT,…`: the H200 plan (kernel, split count, grid) of each case of
//!   the grid per variant, no GPU needed.

use std::io::{BufRead, Write};

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::CudaSlice;
use fa4::config::decode_gpu::DecodeVariant;
use fa4::cuda::decode::PagedTables;
use fa4::cuda::CudaBackend;
use fa4::paged::{PagedCache, PagedProblem};
use fa4::tensor::Layout;
use fa4::{DType, Options};
use half::bf16;

const CALLS: usize = 10;
const ROTATE_BYTES: f64 = 4e8;
const HQ: usize = 32;
const HKV: usize = 8;
const D: usize = 128;
/// Elements of the random block the caches repeat.
const RANDOM_ELEMS: usize = 16 << 20;

/// One decode case's problem and device buffers.
struct Case {
    key: (usize, usize, usize, usize, bool),
    p: PagedProblem,
    tables: PagedTables,
    ks: Vec<CudaSlice<bf16>>,
    vs: Vec<CudaSlice<bf16>>,
    q: CudaSlice<bf16>,
    o: CudaSlice<bf16>,
    lse: CudaSlice<f32>,
    bytes: f64,
    i: usize,
}

/// A block of pseudo-random bf16 values in [−2, 2) (xorshift; the values only need to be
/// non-zero, varied and finite).
fn random_block(cuda: &CudaBackend) -> fa4::Result<CudaSlice<bf16>> {
    let mut s = 0x2545_f491_4f6c_dd1du64;
    let host: Vec<bf16> = (0..RANDOM_ELEMS)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            bf16::from_f32(((s >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0)
        })
        .collect();
    cuda.upload(&host)
}

/// A device buffer of `n` elements filled from the random block (repeated), or zeros.
fn random_buffer(
    cuda: &CudaBackend,
    block: &CudaSlice<bf16>,
    n: usize,
    zeros: bool,
) -> Result<CudaSlice<bf16>, Box<dyn std::error::Error>> {
    let mut b = cuda.alloc::<bf16>(n)?;
    if zeros {
        cuda.stream().memset_zeros(&mut b)?;
        return Ok(b);
    }
    let mut at = 0;
    while at < n {
        let len = RANDOM_ELEMS.min(n - at);
        cuda.stream()
            .memcpy_dtod(&block.slice(..len), &mut b.slice_mut(at..at + len))?;
        at += len;
    }
    Ok(b)
}

/// The grid's cases: (page size, seqlen_q) groups, then the five (batch, keys) shapes.
const GROUPS: [(usize, usize); 5] = [(16, 1), (64, 1), (256, 1), (16, 4), (1, 1)];
const SHAPES: [(usize, usize); 5] = [(1, 32768), (8, 8192), (8, 32768), (32, 4096), (4, 131072)];

/// A case's problem: `batch` sequences of `keys` keys in shuffled pages of `page`, `sq` query
/// rows (causal when more than one). Host only.
fn problem(
    (page, sq, batch, keys): (usize, usize, usize, usize),
) -> Result<PagedProblem, Box<dyn std::error::Error>> {
    let per_seq = keys.div_ceil(page);
    let num_pages = batch * per_seq;
    // A shuffled pool: page i of sequence b is a pseudo-random permutation's entry.
    let mut table: Vec<i32> = (0..num_pages as i32).collect();
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    for i in (1..table.len()).rev() {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        table.swap(i, (state >> 33) as usize % (i + 1));
    }
    let kl = Layout::new("k_cache", &[num_pages, page, HKV, D], None)?;
    let seqlens = vec![keys as i32; batch];
    let cache = PagedCache::new(&kl, &kl, &table, per_seq, &seqlens)?;
    let ql = Layout::new("q", &[batch, sq, HQ, D], None)?;
    let opts = if sq > 1 {
        Options::new().causal()
    } else {
        Options::new()
    };
    Ok(PagedProblem::new(
        DType::Bf16,
        &ql,
        &ql,
        &cache,
        None,
        &opts,
    )?)
}

impl Case {
    fn new(
        cuda: &CudaBackend,
        block: &CudaSlice<bf16>,
        (page, sq, batch, keys, zeros): (usize, usize, usize, usize, bool),
    ) -> Result<Case, Box<dyn std::error::Error>> {
        let p = problem((page, sq, batch, keys))?;
        let cache = p.cache().clone();
        let num_pages = batch * keys.div_ceil(page);
        let bytes = cache.kv_bytes(2);
        let copies = ((ROTATE_BYTES / bytes).ceil() as usize).max(2);
        let elems = num_pages * page * HKV * D;
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        for _ in 0..copies {
            ks.push(random_buffer(cuda, block, elems, zeros)?);
            vs.push(random_buffer(cuda, block, elems, zeros)?);
        }
        let q = random_buffer(cuda, block, batch * sq * HQ * D, zeros)?;
        Ok(Case {
            key: (page, sq, batch, keys, zeros),
            tables: cuda.paged_tables(&p)?,
            o: cuda.alloc::<bf16>(batch * sq * HQ * D)?,
            lse: cuda.alloc::<f32>(p.lse_len())?,
            p,
            ks,
            vs,
            q,
            bytes,
            i: 0,
        })
    }

    /// One call on the next cache copy; returns the split count run.
    fn call(&mut self, cuda: &CudaBackend, splits: Option<usize>) -> fa4::Result<usize> {
        self.i += 1;
        let c = self.i % self.ks.len();
        Ok(cuda
            .forward_paged_device(
                &self.p,
                &mut self.tables,
                &self.q,
                &self.ks[c],
                &self.vs[c],
                &mut self.o,
                Some(&mut self.lse),
                splits,
            )?
            .num_splits)
    }

    /// One round: an event pair around CALLS calls; (splits, µs per call, host µs per call).
    fn round(
        &mut self,
        cuda: &CudaBackend,
        splits: Option<usize>,
    ) -> Result<(usize, f64, f64), Box<dyn std::error::Error>> {
        let ctx = cuda.context();
        let ev = || ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT));
        let (a, b) = (ev()?, ev()?);
        a.record(cuda.stream())?;
        let t0 = std::time::Instant::now();
        let mut s = 0;
        for _ in 0..CALLS {
            s = self.call(cuda, splits)?;
        }
        let host = t0.elapsed().as_secs_f64() * 1e6 / CALLS as f64;
        b.record(cuda.stream())?;
        cuda.synchronize()?;
        Ok((s, f64::from(a.elapsed_ms(&b)?) * 1e3 / CALLS as f64, host))
    }
}

fn serve(cuda: &CudaBackend, block: &CudaSlice<bf16>) -> Result<(), Box<dyn std::error::Error>> {
    let mut case: Option<Case> = None;
    let stdout = std::io::stdout();
    for line in std::io::stdin().lock().lines() {
        let line = line?;
        let w: Vec<&str> = line.split_whitespace().collect();
        if w.len() != 6 && w.len() != 7 {
            return Err(
                format!("expected PAGE SQ BATCH KEYS SPLITS FILL [VARIANT], got `{line}`").into(),
            );
        }
        let variant = DecodeVariant::parse(w.get(6).copied().unwrap_or("auto"))?;
        let n = |i: usize| {
            w[i].parse::<usize>()
                .map_err(|e| format!("`{}`: {e}", w[i]))
        };
        let zeros = match w[5] {
            "random" => false,
            "zeros" => true,
            other => return Err(format!("FILL is random or zeros, got `{other}`").into()),
        };
        let key = (n(0)?, n(1)?, n(2)?, n(3)?, zeros);
        let splits = Some(n(4)?).filter(|&s| s > 0);
        if case.as_ref().is_none_or(|c| c.key != key) {
            drop(case.take()); // free the last case's buffers first
            let mut c = Case::new(cuda, block, key)?;
            c.call(cuda, splits)?;
            cuda.synchronize()?;
            case = Some(c);
        }
        let c = case.as_mut().expect("set above");
        c.tables.set_variant(variant);
        // An untimed call first: the switch from the driver's GPU context lands on it.
        c.call(cuda, splits)?;
        let (s, us, _) = c.round(cuda, splits)?;
        let mut out = stdout.lock();
        writeln!(out, "{s} {us:.2}")?;
        out.flush()?;
    }
    Ok(())
}

/// `--precompile`: fills the kernel cache ($FA4_CACHE_DIR) for an H200 without a GPU, so that a
/// device run spends no time in NVRTC (`bench/device_build.sh` packs it with FA4_PRECOMPILE):
/// first the kernels the grid's cases run under every variant, over a 16-bit and an fp8 cache
/// (the fp8 cache's grid is `fa4 bench --decode --kv-dtype fp8`'s), then every split-kernel variant
/// the planner emits for sm_90a, the combines and the append, and the all-heads variants (with
/// and without `bulk`) at every head dim, row-tile count, dtype and mask kind, for 8, 4, 2 and 1
/// KV heads per CTA (what the grid and tests/cuda_decode.rs plan); the split and all-heads
/// kernels each also with the fused combine (`fuse`).
fn precompile(only: Option<String>) -> Result<(), Box<dyn std::error::Error>> {
    use fa4::config::decode::DecodeTiles;
    use fa4::config::decode_gpu::{
        all_specs, heads_stages_for, plan_variant, AppendSpec, CombineSpec, HeadsSpec, SplitKvSpec,
        HEADS_BLOCK_N, HEAD_DIMS,
    };
    use fa4::cuda::compile::{compile, KernelSource};
    use rayon::prelude::*;
    let h200 = fa4::arch::H200;
    let smem = h200.max_smem_per_block() as usize;
    // First what the grid's cases run under every variant (exactly as planned), so that a cut
    // short precompile still serves the timing call; then everything else.
    let mut first: Vec<Box<dyn KernelSource + Send + Sync>> = Vec::new();
    let every = "auto,plain,heads,heads4,heads+bulk,heads4+bulk,best,heads+best,heads+bulk+best,\
                 heads+bulk+best+fuse,best+fuse";
    for v in only.as_deref().unwrap_or(every).split(',') {
        let variant = DecodeVariant::parse(v)?;
        for (page, sq) in GROUPS {
            for (batch, keys) in SHAPES {
                let p = problem((page, sq, batch, keys))?;
                for p in [p.clone(), p.with_fp8_cache()] {
                    let plan =
                        plan_variant(&p, h200.sm_count as usize, smem, "sm_90a", None, variant)?;
                    first.push(match plan.heads {
                        Some(h) => Box::new(h),
                        None => Box::new(plan.spec),
                    });
                    first.push(Box::new(plan.combine));
                }
            }
        }
    }
    let mut rest: Vec<Box<dyn KernelSource + Send + Sync>> = Vec::new();
    for s in all_specs("sm_90a", smem) {
        rest.push(Box::new(s));
        rest.push(Box::new(SplitKvSpec { fuse: true, ..s }));
    }
    for bf16 in [false, true] {
        for head_dim in HEAD_DIMS {
            rest.push(Box::new(CombineSpec {
                target: "sm_90a",
                bf16,
                head_dim,
            }));
        }
    }
    rest.push(Box::new(AppendSpec { target: "sm_90a" }));
    for head_dim in HEAD_DIMS {
        for m_tiles in 1..=DecodeTiles::gpu(head_dim).block_m / 16 {
            for heads in [8, 4, 2, 1] {
                for bulk in [true, false] {
                    let Some(stages) = heads_stages_for(head_dim, m_tiles, heads, bulk, smem)
                    else {
                        continue;
                    };
                    for bf16 in [true, false] {
                        for (window, softcap) in [(false, false), (true, false), (true, true)] {
                            for fuse in [false, true] {
                                rest.push(Box::new(HeadsSpec {
                                    target: "sm_90a",
                                    bf16,
                                    head_dim,
                                    m_tiles,
                                    block_n: HEADS_BLOCK_N,
                                    heads,
                                    stages,
                                    bulk,
                                    window,
                                    softcap,
                                    fuse,
                                    fp8: false,
                                }));
                            }
                        }
                    }
                }
            }
        }
    }
    if only.is_some() {
        rest.clear();
    }
    for (what, mut list) in [("the grid's kernels", first), ("the rest", rest)] {
        // The grid's cases share kernels: each once.
        let mut seen = std::collections::HashSet::new();
        list.retain(|s| seen.insert(format!("{s:?}")));
        let failed: Vec<String> = list
            .par_iter()
            .filter_map(|s| match compile(s.as_ref()) {
                Ok(c) => {
                    println!(
                        "{s}: {:.1} s{}",
                        c.seconds,
                        if c.cached { " (cached)" } else { "" }
                    );
                    None
                }
                Err(e) => Some(format!("{s}: {e}")),
            })
            .collect();
        if !failed.is_empty() {
            return Err(failed.join("\n").into());
        }
        println!("precompiled {what}");
    }
    Ok(())
}

/// `--plans VARIANT,…`: each grid case's H200 plan per variant (host only).
fn plans(variants: &str) -> Result<(), Box<dyn std::error::Error>> {
    use fa4::config::decode_gpu::plan_variant;
    let h200 = fa4::arch::H200;
    println!("variant | page | sq | batch | keys | kernel | splits | grid | CTAs");
    for v in variants.split(',') {
        let variant = DecodeVariant::parse(v)?;
        for (page, sq) in GROUPS {
            for (batch, keys) in SHAPES {
                let p = problem((page, sq, batch, keys))?;
                let plan = plan_variant(
                    &p,
                    h200.sm_count as usize,
                    h200.max_smem_per_block() as usize,
                    "sm_90a",
                    None,
                    variant,
                )?;
                let mut kernel = match &plan.heads {
                    Some(h) => h.to_string(),
                    None => plan.spec.to_string(),
                };
                // Say which call runs the merge of the splits (the kernel's name ends in
                // ` fuse` when it merges them itself).
                if plan.decode.num_splits > 1 && !plan.fused() {
                    kernel.push_str(" + combine");
                }
                let (x, y, z) = plan.grid;
                println!(
                    "{variant} | {page} | {sq} | {batch} | {keys} | {kernel} | {} | ({x}, {y}, {z}) | {}",
                    plan.decode.num_splits,
                    x * y * z
                );
            }
        }
    }
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::args().nth(1).as_deref() == Some("--precompile") {
        return precompile(std::env::args().nth(2));
    }
    if std::env::args().nth(1).as_deref() == Some("--plans") {
        return plans(&std::env::args().nth(2).unwrap_or_else(|| "auto".into()));
    }
    let cuda = CudaBackend::new(0)?;
    let block = random_block(&cuda)?;
    if std::env::args().nth(1).as_deref() == Some("--serve") {
        return serve(&cuda, &block);
    }
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(9);
    println!("page | sq | batch | keys | splits | us/call | TB/s | host us/call | spread");
    for (page, sq) in GROUPS {
        for (batch, keys) in SHAPES {
            let mut c = Case::new(&cuda, &block, (page, sq, batch, keys, false))?;
            for _ in 0..3 {
                c.call(&cuda, None)?;
            }
            cuda.synchronize()?;
            let mut samples = Vec::new();
            let mut host = Vec::new();
            let mut splits = 0;
            for _ in 0..rounds {
                let (s, us, h) = c.round(&cuda, None)?;
                splits = s;
                samples.push(us);
                host.push(h);
            }
            samples.sort_by(f64::total_cmp);
            host.sort_by(f64::total_cmp);
            let med = samples[samples.len() / 2];
            println!(
                "{page} | {sq} | {batch} | {keys} | {splits} | {med:.1} | {:.2} | {:.1} | {:.1}-{:.1}",
                c.bytes / (med * 1e-6) / 1e12,
                host[host.len() / 2],
                samples[0],
                samples[samples.len() - 1]
            );
        }
    }
    Ok(())
}
