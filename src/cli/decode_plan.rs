//! `fa4 plan --decode`: the split-KV plan of a decode call ([`fa4::config::decode`]) and why.
//!
//! A child module of `plan`: it reads `--depth` from the plan's flags and adds the decode shape.
//! The units are the GPU's SMs (`--sms`, default the H100/H200's 132); the tiles are the ones the
//! GPU decode kernels are planned with ([`DecodeTiles::gpu`]). Then, per GPU (H200, A100), what a
//! call runs with the kernel variant `FA4_DECODE_VARIANT` names (`auto`, the default, when unset):
//! the kernel (` fuse` when it merges its splits itself, `+ combine` when a combine launch
//! follows), its split count and grid.

use clap::Args;

use fa4::config::decode::{plan, DecodeShape, DecodeTiles};
use fa4::{Error, Result};

use super::PlanArgs;

/// The decode flags of `fa4 plan`.
#[derive(Args, Debug, Default)]
pub struct DecodePlanArgs {
    /// Plan a decode call over a paged KV cache (split-KV, GQA packing) instead of a kernel.
    /// --batch, --seqlen-q, --seqlen-k, --heads-q and --heads-kv also shape `--backward`.
    #[arg(long, help_heading = "Decode")]
    decode: bool,
    /// Sequences [default: 1].
    #[arg(long, allow_negative_numbers = true, help_heading = "Decode")]
    batch: Option<usize>,
    /// Query rows per sequence (1 decode, 2–8 speculative) [default: 1; 1024 with --backward].
    #[arg(long, allow_negative_numbers = true, help_heading = "Decode")]
    seqlen_q: Option<usize>,
    /// Keys of the longest sequence (required with --decode; --backward: default --seqlen-q).
    #[arg(long, allow_negative_numbers = true, help_heading = "Decode")]
    seqlen_k: Option<usize>,
    /// Query heads [default: 32; 8 with --backward].
    #[arg(long, allow_negative_numbers = true, help_heading = "Decode")]
    heads_q: Option<usize>,
    /// KV heads, dividing --heads-q [default: 8; --heads-q with --backward].
    #[arg(long, allow_negative_numbers = true, help_heading = "Decode")]
    heads_kv: Option<usize>,
    /// Force the split count (1..=128).
    #[arg(long, allow_negative_numbers = true, help_heading = "Decode")]
    num_splits: Option<usize>,
    /// Streaming multiprocessors to fill [default: 132, the H100/H200].
    #[arg(long, allow_negative_numbers = true, help_heading = "Decode")]
    sms: Option<usize>,
    /// Keys per page of the cache, for the per-GPU lines (`auto` picks its kernel by it) [default: 16].
    #[arg(long, allow_negative_numbers = true, help_heading = "Decode")]
    page_size: Option<usize>,
}

impl DecodePlanArgs {
    /// The first decode flag given without `--decode`, if any.
    pub fn stray(&self) -> Option<&'static str> {
        crate::cli::first_stray(
            self.decode,
            [
                ("--batch", self.batch.is_some()),
                ("--seqlen-q", self.seqlen_q.is_some()),
                ("--seqlen-k", self.seqlen_k.is_some()),
                ("--heads-q", self.heads_q.is_some()),
                ("--heads-kv", self.heads_kv.is_some()),
                ("--num-splits", self.num_splits.is_some()),
                ("--sms", self.sms.is_some()),
                ("--page-size", self.page_size.is_some()),
            ],
        )
    }

    /// Whether `--decode` was given.
    pub fn wanted(&self) -> bool {
        self.decode
    }

    /// The problem-shape flags, which `fa4 plan --backward` reads too (they are named as in
    /// `fa4 run`).
    pub fn shape_flags(&self) -> ShapeFlags {
        ShapeFlags {
            batch: self.batch,
            seqlen_q: self.seqlen_q,
            seqlen_k: self.seqlen_k,
            heads_q: self.heads_q,
            heads_kv: self.heads_kv,
        }
    }

    /// The first flag given that only a decode plan uses (`--num-splits`, `--sms`, `--page-size`).
    pub fn split_flag(&self) -> Option<&'static str> {
        [
            ("--num-splits", self.num_splits.is_some()),
            ("--sms", self.sms.is_some()),
            ("--page-size", self.page_size.is_some()),
        ]
        .into_iter()
        .find(|&(_, given)| given)
        .map(|(flag, _)| flag)
    }
}

/// The shape flags as given (`None`: not given).
#[derive(Debug, Clone, Copy)]
pub struct ShapeFlags {
    pub batch: Option<usize>,
    pub seqlen_q: Option<usize>,
    pub seqlen_k: Option<usize>,
    pub heads_q: Option<usize>,
    pub heads_kv: Option<usize>,
}

/// Prints the decode plan.
pub fn run(args: &PlanArgs) -> Result<()> {
    let a = &args.decode;
    if args.json {
        return Err(Error::invalid(
            "--json",
            "is not available with --decode yet",
        ));
    }
    let Some(seqlen_k) = a.seqlen_k else {
        return Err(Error::invalid("--seqlen-k", "is required with --decode"));
    };
    if args.depth == 0 {
        return Err(Error::invalid("--depth", "must be at least 1"));
    }
    let shape = DecodeShape {
        batch: a.batch.unwrap_or(1),
        seqlen_q: a.seqlen_q.unwrap_or(1),
        seqlen_k,
        heads_q: a.heads_q.unwrap_or(32),
        heads_kv: a.heads_kv.unwrap_or(8),
    };
    let sms = a.sms.unwrap_or(fa4::arch::H200.sm_count as usize);
    if sms == 0 {
        return Err(Error::invalid("--sms", "must be at least 1"));
    }
    let page_size = a.page_size.unwrap_or(16);
    if page_size == 0 {
        return Err(Error::invalid("--page-size", "must be at least 1"));
    }
    let p = plan(
        shape,
        DecodeTiles::gpu(args.depth as usize),
        sms,
        a.num_splits,
    )
    .map_err(|e| match e {
        Error::InvalidArgument { name, reason } => {
            let flag = match name.as_str() {
                "num_splits" => "--num-splits",
                "heads_kv" => "--heads-kv",
                "batch" => "--batch",
                _ => return Error::invalid(name, reason),
            };
            Error::invalid(flag, reason)
        }
        e => e,
    })?;
    let variant = fa4::config::decode_gpu::DecodeVariant::from_env()?;
    println!("{p}");
    println!(
        "  (the split planner's rule at the split kernel's largest row tile; a call with fewer \
         packed rows runs smaller tiles, the same count; the CPU backend plans with its own tiles \
         and its thread count as the units)"
    );
    for (gpu, target) in [(fa4::arch::H200, "sm_90a"), (fa4::arch::A100, "sm_80")] {
        println!(
            "  {}",
            gpu_line(
                shape,
                args.depth as usize,
                page_size,
                a.num_splits,
                variant,
                &gpu,
                target
            )
        );
    }
    Ok(())
}

/// What a GPU call of `shape` runs with `variant` (`FA4_DECODE_VARIANT`, `auto` when unset,
/// [`fa4::config::decode_gpu::plan_variant`]): planned on a bf16 paged problem of that shape
/// over pages of `page` keys (`auto` takes the all-heads kernel only over small pages), so it
/// says which kernel and how many splits, which the rule above alone does not: `auto` may take
/// the all-heads kernel and the split count that fills the most SMs in one wave.
fn gpu_line(
    shape: DecodeShape,
    head_dim: usize,
    page: usize,
    num_splits: Option<usize>,
    variant: fa4::config::decode_gpu::DecodeVariant,
    gpu: &fa4::arch::GpuArch,
    target: &'static str,
) -> String {
    use fa4::config::decode_gpu;
    use fa4::paged::{PagedCache, PagedProblem};
    use fa4::tensor::Layout;
    let planned = || -> Result<decode_gpu::GpuDecodePlan> {
        // The stand-in page table is built on the host: far past any real cache, say so instead.
        const MAX_PAGES: usize = 1 << 22;
        let per_seq = shape.seqlen_k.div_ceil(page).max(1);
        let pages = shape
            .batch
            .checked_mul(per_seq)
            .filter(|&n| n <= MAX_PAGES)
            .ok_or_else(|| {
                Error::invalid(
                    "--seqlen-k",
                    format!("not planned here: more than {MAX_PAGES} pages of {page} keys"),
                )
            })?;
        let table: Vec<i32> = (0..pages)
            .map(|i| {
                i32::try_from(i).map_err(|_| Error::invalid("--seqlen-k", "too many pages to plan"))
            })
            .collect::<Result<_>>()?;
        let kl = Layout::new("k_cache", &[pages, page, shape.heads_kv, head_dim], None)?;
        let lens = vec![
            i32::try_from(shape.seqlen_k)
                .map_err(|_| Error::invalid("--seqlen-k", "exceeds int32"))?;
            shape.batch
        ];
        let cache = PagedCache::new(&kl, &kl, &table, per_seq, &lens)?;
        let ql = Layout::new(
            "q",
            &[shape.batch, shape.seqlen_q, shape.heads_q, head_dim],
            None,
        )?;
        let p = PagedProblem::new(
            fa4::DType::Bf16,
            &ql,
            &ql,
            &cache,
            None,
            &fa4::Options::new(),
        )?;
        decode_gpu::plan_variant(
            &p,
            gpu.sm_count as usize,
            gpu.max_smem_per_block() as usize,
            target,
            num_splits,
            variant,
        )
    };
    match planned() {
        Ok(g) => {
            let mut kernel = match &g.heads {
                Some(h) => h.to_string(),
                None => g.spec.to_string(),
            };
            if g.decode.num_splits > 1 && !g.fused() {
                kernel.push_str(" + combine");
            }
            // A plan `auto` resolved to `plain` prints as `auto` (the unresolved default's
            // spelling): say which.
            let named = decode_gpu::DecodeVariant {
                auto: false,
                ..g.variant
            };
            let variant = if named == decode_gpu::DecodeVariant::PLAIN {
                "auto (plain)".to_string()
            } else {
                g.variant.to_string()
            };
            format!(
                "{} ({target}), pages of {page} key{}, FA4_DECODE_VARIANT={}: {kernel}, {} split{}, grid {}x{}x{}",
                gpu.name,
                if page == 1 { "" } else { "s" },
                variant,
                g.decode.num_splits,
                if g.decode.num_splits == 1 { "" } else { "s" },
                g.grid.0,
                g.grid.1,
                g.grid.2
            )
        }
        Err(e) => {
            let why = match e {
                Error::InvalidArgument { reason, .. } => reason,
                other => other.to_string(),
            };
            format!(
                "{} ({target}): no GPU plan for this shape ({why})",
                gpu.name
            )
        }
    }
}
