//! `fa4 plan`: the planners from the command line: SM100 (FA4Config, the default) or the
//! Hopper plan (`--arch sm90`; with `--dtype fp8` the e4m3 kernel's, with its Vᵀ pass), which
//! also says which kernel the problem gets and why.

use clap::{Args, ValueEnum};

use fa4::config::sm100::{FA4Config, FA4Inputs, Swizzle};
use fa4::config::sm100_kernel;
use fa4::config::sm90::{self, Sm90Plan};
use fa4::{DType, Error, Result};

#[path = "decode_plan.rs"]
mod decode_plan;
#[path = "plan_backward.rs"]
mod plan_backward;

/// The most rows (`--seqlen`) a Hopper forward plans: its TMA coordinates and row arithmetic are
/// int32, and `config::sm90` refuses past 2^30.
const HOPPER_MAX_ROWS: usize = (i32::MAX / 2) as usize;

/// Which planner to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PlanArch {
    /// Blackwell (B200): FA4Config, the seed's planner.
    Sm100,
    /// Hopper (H100/H200): the TMA + wgmma kernel's plan and the kernel dispatch.
    Sm90,
    /// Ampere (A100): `--backward` only.
    Sm80,
    /// The CPU backend: `--backward` only.
    Cpu,
}

#[derive(Args, Debug)]
pub struct PlanArgs {
    /// The GPU family (or the CPU) to plan for [default: sm100; sm90 with --backward].
    #[arg(long, value_enum)]
    arch: Option<PlanArch>,
    /// Query heads (SM100) [default: 32].
    #[arg(long, allow_negative_numbers = true)]
    num_q_heads: Option<u32>,
    /// Query heads per KV head (GQA ratio, SM100); must divide --num-q-heads [default: 1].
    #[arg(long, allow_negative_numbers = true)]
    group: Option<u32>,
    /// Head dimension (of Q and K).
    #[arg(long, allow_negative_numbers = true)]
    depth: u32,
    /// Head dimension of V and the output (`--arch sm90`, and `--backward`), e.g. 128 beside
    /// `--depth 192` (MLA prefill) [default: --depth].
    #[arg(long, allow_negative_numbers = true)]
    depth_v: Option<u32>,
    /// Element type of Q, K and V: bf16, fp16, fp8 or f32.
    #[arg(long, default_value = "bf16")]
    dtype: DType,
    /// TMA swizzle (SM100): none, 32B, 64B or 128B [default: 128B].
    #[arg(long)]
    swizzle: Option<Swizzle>,
    /// Variable-length (packed) batches (`--arch sm90`: decides the kernel; with --backward: a
    /// packed batch of --batch sequences of --seqlen-q x --seqlen-k, the longest of a ragged one).
    #[arg(long)]
    varlen: bool,
    /// Query rows per sequence (`--arch sm90`: the tiles and launch a problem of this length
    /// gets; without it, the head dim's first-choice tiles). With `--dtype fp8` also the keys,
    /// which size the Vᵀ scratch.
    #[arg(long)]
    seqlen: Option<usize>,
    /// Print the machine-readable form (the seed's names) instead of the report.
    #[arg(long)]
    json: bool,
    /// Compile the SM100 kernel for this config with NVRTC (sm_100a; needs NVRTC, no GPU) and
    /// report its registers, shared memory and cubin size. The kernel has not run on hardware.
    #[arg(long)]
    compile: bool,
    /// Decode over a paged KV cache (`src/cli/decode_plan.rs`).
    #[command(flatten)]
    decode: decode_plan::DecodePlanArgs,
    /// The backward's plan (`src/cli/plan_backward.rs`).
    #[command(flatten)]
    backward: plan_backward::BackwardPlanArgs,
}

pub fn run(args: PlanArgs) -> Result<()> {
    let sm90_forward =
        args.arch == Some(PlanArch::Sm90) && !args.backward.wanted() && !args.decode.wanted();
    if args.depth_v.is_some() && !sm90_forward && !args.backward.wanted() {
        return Err(Error::invalid(
            "--depth-v",
            "applies to the Hopper forward plan (`--arch sm90`, without --decode) and to --backward",
        ));
    }
    if args.backward.wanted() {
        if args.dtype == DType::Fp8E4M3 {
            return Err(Error::invalid(
                "--dtype",
                "fp8 inputs have no backward (the fp8 forward is for inference); --backward plans bf16, fp16 or f32",
            ));
        }
        return plan_backward::run(&args);
    }
    // `--causal` also picks the Hopper forward's tiles (d64 takes the dynamic schedule).
    if let Some(flag) = args.backward.stray() {
        if !(sm90_forward && flag == "--causal") {
            return Err(Error::invalid(flag, "belongs to `fa4 plan --backward`"));
        }
    }
    if let Some(flag) = args.decode.stray() {
        return Err(Error::invalid(flag, "belongs to `fa4 plan --decode`"));
    }
    if args.decode.wanted() {
        return run_decode(&args);
    }
    let arch = args.arch.unwrap_or(PlanArch::Sm100);
    if matches!(arch, PlanArch::Sm80 | PlanArch::Cpu) {
        return Err(Error::invalid(
            "--arch",
            "sm80 and cpu plan only the backward (`--backward`); the forward's plans are sm100 and sm90",
        ));
    }
    if arch == PlanArch::Sm90 {
        if args.compile {
            return Err(Error::invalid(
                "--compile",
                "compiles the SM100 kernel; leave out `--arch sm90`",
            ));
        }
        return run_sm90(&args);
    }
    if args.varlen {
        return Err(Error::invalid(
            "--varlen",
            "only `--arch sm90` plans a kernel dispatch",
        ));
    }
    if args.seqlen.is_some() {
        return Err(Error::invalid(
            "--seqlen",
            "only `--arch sm90` plans per sequence length",
        ));
    }
    let cfg = FA4Config::new(FA4Inputs {
        num_q_heads: args.num_q_heads.unwrap_or(32),
        group: args.group.unwrap_or(1),
        depth: args.depth,
        dtype_size: args.dtype.size_bytes(),
        swizzle_mode: args.swizzle.unwrap_or(Swizzle::B128),
    })
    .map_err(sm100_flag)?;
    let compiled = if args.compile {
        Some(compile_sm100(&args, &cfg)?)
    } else {
        None
    };
    if args.json {
        let mut v: serde_json::Value =
            serde_json::from_str(&cfg.to_json()).expect("FA4Config's JSON parses");
        if let Some(c) = &compiled {
            v["compiled"] = serde_json::to_value(c).expect("plain data serializes");
        }
        println!(
            "{}",
            if compiled.is_some() {
                serde_json::to_string_pretty(&v).expect("plain data serializes")
            } else {
                cfg.to_json()
            }
        );
    } else {
        println!("{cfg}");
        if let Some(c) = &compiled {
            print_compiled(c);
        }
    }
    Ok(())
}

/// FA4Config's errors, named by the flag that set what they name (`depth` → `--depth`).
fn sm100_flag(e: Error) -> Error {
    match e {
        Error::InvalidArgument { name, reason } => {
            let flag = match name.as_str() {
                "num_q_heads" => "--num-q-heads",
                "group" => "--group",
                "depth" => "--depth",
                "dtype_size" => "--dtype",
                "swizzle" | "swizzle_mode" => "--swizzle",
                _ => return Error::InvalidArgument { name, reason },
            };
            Error::invalid(flag, reason.replace("num_q_heads", "--num-q-heads"))
        }
        e => e,
    }
}

/// `fa4 plan --decode`: the split plan of `decode_plan`, after refusing the flags it would
/// ignore.
fn run_decode(args: &PlanArgs) -> Result<()> {
    let refused: [(&str, bool, &str); 7] = [
        ("--num-q-heads", args.num_q_heads.is_some(), "use --heads-q"),
        ("--group", args.group.is_some(), "use --heads-kv"),
        (
            "--seqlen",
            args.seqlen.is_some(),
            "use --seqlen-q (and --seqlen-k)",
        ),
        (
            "--swizzle",
            args.swizzle.is_some(),
            "the decode kernels take no TMA swizzle",
        ),
        (
            "--varlen",
            args.varlen,
            "a decode batch is planned by its longest sequence, --seqlen-k",
        ),
        (
            "--compile",
            args.compile,
            "compiles the SM100 forward kernel only",
        ),
        (
            "--arch",
            args.arch.is_some(),
            "the decode plan reports the H200 and the A100 together; leave --arch out",
        ),
    ];
    if let Some((flag, _, why)) = refused.into_iter().find(|r| r.1) {
        return Err(Error::invalid(
            flag,
            format!("does not apply to `--decode`: {why}"),
        ));
    }
    if !matches!(args.dtype, DType::Bf16 | DType::F16) {
        return Err(Error::invalid(
            "--dtype",
            format!(
                "the decode plan is the GPU kernels', for bf16 and fp16 inputs, not {}",
                args.dtype
            ),
        ));
    }
    // The planner names `heads_kv` for a zero head count (`heads_kv 8 must … divide heads_q 0`).
    if args.decode.shape_flags().heads_q == Some(0) {
        return Err(Error::invalid("--heads-q", "must be at least 1"));
    }
    // Its reasons name the head counts as the library does; the flags set them.
    decode_plan::run(args).map_err(|e| match e {
        Error::InvalidArgument { name, reason } => Error::InvalidArgument {
            name,
            reason: reason
                .replace("heads_kv", "--heads-kv")
                .replace("heads_q", "--heads-q"),
        },
        e => e,
    })
}

/// Compiles the SM100 kernel for the plan's depth and dtype, or says why it cannot.
fn compile_sm100(args: &PlanArgs, cfg: &FA4Config) -> Result<sm100_kernel::CompileReport> {
    let bf16 = match args.dtype {
        DType::Bf16 => true,
        DType::F16 => false,
        other => {
            return Err(Error::invalid(
                "--dtype",
                format!("the SM100 kernel is built for bf16 and fp16 inputs, not {other}"),
            ))
        }
    };
    if !cfg.supported() {
        let why: Vec<String> = cfg
            .unsupported_reasons()
            .iter()
            .map(ToString::to_string)
            .collect();
        return Err(Error::invalid(
            "--depth",
            format!(
                "FA4Config does not support this config ({}); nothing compiled",
                why.join("; ")
            ),
        ));
    }
    let spec = sm100_kernel::KernelSpec::new(args.depth as usize, bf16, false, false)
        .map_err(|e| Error::invalid("--depth", format!("{e}; nothing compiled")))?;
    debug_assert_eq!(spec.cfg.smem_used(), cfg.smem_used());
    let (cubin, log) = fa4::cuda::compile::compile_with_log(&spec, &["--ptxas-options=-v"])?;
    let (registers, static_smem_bytes) = sm100_kernel::parse_ptxas(&log).ok_or_else(|| {
        Error::invalid("--compile", "ptxas printed no register report".to_string())
    })?;
    Ok(sm100_kernel::CompileReport {
        target: spec.target,
        registers,
        smem_bytes: static_smem_bytes + spec.smem_bytes(),
        static_smem_bytes,
        cubin_bytes: cubin.len(),
    })
}

fn print_compiled(c: &sm100_kernel::CompileReport) {
    println!();
    println!(
        "compiled (NVRTC, {}; NOT RUN ON HARDWARE: no Blackwell GPU was available)",
        c.target
    );
    println!("  registers      {} per thread at launch (setmaxnreg: softmax {}, correction {}, MMA/load {})",
        c.registers, sm100_kernel::SOFTMAX_REGS, sm100_kernel::CORRECTION_REGS, sm100_kernel::OTHER_REGS);
    println!(
        "  shared memory  {} bytes ({} static + {} dynamic = smem_used)",
        c.smem_bytes,
        c.static_smem_bytes,
        c.smem_bytes - c.static_smem_bytes
    );
    println!("  cubin          {} bytes", c.cubin_bytes);
    println!(
        "  warp roles     {}",
        sm100_kernel::ROLES
            .iter()
            .map(|(n, w)| format!("{} ×{w}", n.to_lowercase()))
            .collect::<Vec<_>>()
            .join(", ")
    );
}

fn run_sm90(args: &PlanArgs) -> Result<()> {
    // The Hopper plan depends on neither heads nor swizzle (its swizzle follows the head dim):
    // a flag that would change nothing is refused rather than silently ignored.
    for (flag, given) in [
        ("--num-q-heads", args.num_q_heads.is_some()),
        ("--group", args.group.is_some()),
        ("--swizzle", args.swizzle.is_some()),
    ] {
        if given {
            return Err(Error::invalid(
                flag,
                "the Hopper plan (`--arch sm90`) does not depend on it; it applies to `--arch sm100`",
            ));
        }
    }
    let arch = fa4::arch::H200;
    let depth = args.depth as usize;
    let depth_v = args.depth_v.map_or(depth, |d| d as usize);
    let size = args.dtype.size_bytes() as usize;
    if depth == 0 {
        return Err(Error::invalid("--depth", "must be at least 1"));
    }
    if depth_v == 0 {
        return Err(Error::invalid("--depth-v", "must be at least 1"));
    }
    if args.seqlen == Some(0) {
        return Err(Error::invalid("--seqlen", "must be at least 1"));
    }
    // Both Hopper forwards address rows by int32 TMA coordinates (`config::sm90` refuses past
    // 2^30 rows): a longer sequence has no plan, whatever the dtype.
    if let Some(n) = args.seqlen.filter(|&n| n > HOPPER_MAX_ROWS) {
        return Err(Error::invalid(
            "--seqlen",
            format!("{n} rows exceed the Hopper kernel's TMA coordinate range (2^30)"),
        ));
    }
    if args.dtype == DType::Fp8E4M3 {
        return run_sm90_fp8(args, &arch, depth, depth_v);
    }
    let dispatch = sm90::dispatch(
        &arch,
        sm90::Features {
            head_dim: depth,
            head_dim_v: depth_v,
            dtype_size: size,
            varlen: args.varlen,
            nonpositive_scale: false,
            no_keys: false,
            tiles: 0,
        },
    );
    // A problem the Hopper kernel does not cover still gets an answer: which kernel, and why.
    let plan = Sm90Plan::with_dims(&arch, depth, depth_v, size, args.seqlen).ok();
    let plan = plan.map(|p| {
        if args.varlen {
            p.for_varlen(&arch, args.seqlen)
        } else if args.backward.causal {
            p.for_causal(&arch, args.seqlen)
        } else {
            p
        }
    });
    if args.json {
        let mut v = match &plan {
            Some(plan) => serde_json::to_value(plan).expect("plain data serializes"),
            None => serde_json::json!({}),
        };
        v["dispatch"] = serde_json::to_value(&dispatch).expect("plain data serializes");
        println!(
            "{}",
            serde_json::to_string_pretty(&v).expect("plain data serializes")
        );
    } else {
        match &plan {
            Some(plan) => println!("{plan}"),
            None if depth_v != depth => println!(
                "no Hopper plan for head_dim {depth}, head_dim_v {depth_v}, {}",
                args.dtype
            ),
            None => println!("no Hopper plan for head_dim {depth}, {}", args.dtype),
        }
        println!(
            "  kernel for this problem: {} ({})",
            dispatch.kernel, dispatch.reason
        );
    }
    Ok(())
}

/// `fa4 plan --arch sm90 --dtype fp8`: the e4m3 kernel's launch as [`sm90::fp8::plan_fp8`] plans
/// it for a problem of one head whose sequences have `--seqlen` query rows and keys (without it,
/// a length at which every tile entry is allowed, as the 16-bit plan's first choice), and the
/// Vᵀ pass it runs first. What the kernel does not take is an error naming the flag: fp8 inputs
/// have no other GPU kernel to fall back to.
fn run_sm90_fp8(
    args: &PlanArgs,
    arch: &fa4::arch::GpuArch,
    depth: usize,
    depth_v: usize,
) -> Result<()> {
    use fa4::problem::{Options, Problem};
    use fa4::tensor::Layout;

    // Past HOPPER_MAX_ROWS the caller refused --seqlen.
    let len = args.seqlen.unwrap_or(sm90::ANY_LENGTH);
    // Covered head dims that are multiples of 8 but not 16 pass the kernel's own check, then fail
    // on a contiguous tensor's strides: say so in terms of the head dim.
    if sm90::fp8::fp8_padded_head_dim(depth).is_some() && !depth.is_multiple_of(16) {
        return Err(Error::invalid(
            "--depth",
            format!(
                "head_dim {depth}: the fp8 Hopper kernel loads Q and K rows through TMA maps, whose strides are multiples of 16 bytes, so contiguous e4m3 Q and K take multiples of 16"
            ),
        ));
    }
    let flag = |e: Error| match e {
        Error::InvalidArgument { name, reason } => {
            let flag = match name.as_str() {
                "q" => "--depth",
                "v" => "--depth-v",
                "k" | "cu_seqlens_q" => "--seqlen",
                _ => return Error::InvalidArgument { name, reason },
            };
            Error::invalid(flag, reason)
        }
        e => e,
    };
    let shape = |d: usize| -> Vec<usize> {
        if args.varlen {
            vec![len, 1, d]
        } else {
            vec![1, len, 1, d]
        }
    };
    let (qk, v) = (
        Layout::new("q", &shape(depth), None).map_err(flag)?,
        Layout::new("v", &shape(depth_v), None).map_err(flag)?,
    );
    let cu = [0, len as i32];
    let cu = args.varlen.then_some(&cu[..]);
    let mut opts = Options::new();
    if args.backward.causal {
        opts = opts.causal();
    }
    let p = Problem::new_fp8(DType::Bf16, &qk, &qk, &v, &v, cu, cu, &opts).map_err(flag)?;
    let f = sm90::fp8::plan_fp8(&p, arch, "sm_90a", None).map_err(flag)?;
    let plan = Sm90Plan::for_fp8(arch, &f, args.seqlen);
    let dispatch = sm90::Dispatch {
        kernel: fa4::config::KernelKind::Sm90,
        reason: format!(
            "a Hopper GPU, fp8 e4m3 inputs, head dim {}: the Hopper kernel's e4m3 variant, after the Vᵀ pass",
            sm90::Dims {
                qk: depth,
                v: depth_v
            }
        ),
    };
    if args.json {
        let mut v = serde_json::to_value(&plan).expect("plain data serializes");
        v["dispatch"] = serde_json::to_value(&dispatch).expect("plain data serializes");
        println!(
            "{}",
            serde_json::to_string_pretty(&v).expect("plain data serializes")
        );
    } else {
        println!("{plan}");
        println!(
            "  kernel for this problem: {} ({})",
            dispatch.kernel, dispatch.reason
        );
    }
    Ok(())
}
