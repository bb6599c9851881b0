//! `fa4 plan --decode`: the split-KV plan of a decode call ([`fa4::config::decode`]) and why.
//!
//! A child module of `plan`: it reads `--depth` from the plan's flags and adds the decode shape.
//! The units are the GPU's SMs (`--sms`, default the H100/H200's 132); the tiles are the ones the
//! GPU decode kernels are planned with ([`DecodeTiles::gpu`]).

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

    /// The first flag given that only a decode plan uses (`--num-splits`, `--sms`).
    pub fn split_flag(&self) -> Option<&'static str> {
        [
            ("--num-splits", self.num_splits.is_some()),
            ("--sms", self.sms.is_some()),
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
    println!("{p}");
    println!(
        "  (the plan of the GPU decode kernels at their largest row tile; a call with fewer packed \
         rows runs smaller tiles, the same count; the CPU backend plans with its own tiles and \
         its thread count as the units)"
    );
    Ok(())
}
