//! `fa4 plan`: the SM100 planner from the command line.

use clap::Args;

use fa4::config::sm100::{FA4Config, FA4Inputs, Swizzle};
use fa4::{DType, Result};

#[derive(Args, Debug)]
pub struct PlanArgs {
    /// Query heads.
    #[arg(long, default_value_t = 32, allow_negative_numbers = true)]
    num_q_heads: u32,
    /// Query heads per KV head (GQA ratio); must divide --num-q-heads.
    #[arg(long, default_value_t = 1, allow_negative_numbers = true)]
    group: u32,
    /// Head dimension.
    #[arg(long, allow_negative_numbers = true)]
    depth: u32,
    /// Element type of Q, K and V: bf16, fp16, fp8 or f32.
    #[arg(long, default_value = "bf16")]
    dtype: DType,
    /// TMA swizzle: none, 32B, 64B or 128B.
    #[arg(long, default_value = "128B")]
    swizzle: Swizzle,
    /// Print the machine-readable form (the seed's names) instead of the report.
    #[arg(long)]
    json: bool,
}

pub fn run(args: PlanArgs) -> Result<()> {
    let cfg = FA4Config::new(FA4Inputs {
        num_q_heads: args.num_q_heads,
        group: args.group,
        depth: args.depth,
        dtype_size: args.dtype.size_bytes(),
        swizzle_mode: args.swizzle,
    })?;
    if args.json {
        println!("{}", cfg.to_json());
    } else {
        println!("{cfg}");
    }
    Ok(())
}
