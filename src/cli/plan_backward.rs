//! `fa4 plan --backward`: the backward's plan for a problem and why.
//!
//! A child module of `plan`: it reads `--arch`, `--depth`, `--dtype` and `--json` from the
//! plan's flags, the problem's shape from the flags `fa4 run` names the same way (`--batch`,
//! `--seqlen-q`, `--seqlen-k`, `--heads-q`, `--heads-kv`, shared with `--decode`), and adds the
//! mask, the softcap and `--deterministic`. GPU arches print [`fa4::config::bwd::plan`]'s
//! launches as the CUDA backend would run them on that GPU (the A100 or the H200); `--arch cpu`
//! prints the CPU backward's tiles ([`fa4::cpu::plan::plan`]) and its two passes.

use clap::Args;

use fa4::config::bwd::{self, BwdKernel, BwdPlan, BwdSpec};
use fa4::mask::Mask;
use fa4::problem::{Options, Problem};
use fa4::tensor::Layout;
use fa4::{Error, Result};

use super::{PlanArch, PlanArgs};

/// Shape defaults: those of `fa4 run`'s random problem, so that the two commands describe the
/// same problem when given the same flags.
const DEFAULT_SEQLEN: usize = 1024;
const DEFAULT_HEADS: usize = 8;

/// The backward flags of `fa4 plan`.
#[derive(Args, Debug, Default)]
pub struct BackwardPlanArgs {
    /// Plan the backward (dQ, dK, dV) of a problem given by --batch, --seqlen-q, --seqlen-k,
    /// --heads-q, --heads-kv, --depth, --dtype and the mask; --arch sm80, sm90 (default) or cpu.
    #[arg(long, help_heading = "Backward")]
    backward: bool,
    /// The deterministic backward (dQ summed in a fixed order, no atomics).
    #[arg(long, help_heading = "Backward")]
    deterministic: bool,
    /// Causal mask, aligned to the bottom-right corner (the window -1,0); also with `--arch
    /// sm90` for the forward's tiles.
    #[arg(long, help_heading = "Backward")]
    pub(crate) causal: bool,
    /// Local window: LEFT keys before the diagonal and RIGHT after; -1 is unbounded.
    #[arg(long, value_name = "LEFT,RIGHT", allow_hyphen_values = true,
          value_parser = super::super::run::parse_window, help_heading = "Backward")]
    window: Option<Mask>,
    /// Softcap: scores become X·tanh(s/X); X > 0.
    #[arg(
        long,
        value_name = "X",
        allow_hyphen_values = true,
        help_heading = "Backward"
    )]
    softcap: Option<f32>,
}

impl BackwardPlanArgs {
    /// The first backward flag given without `--backward`, if any.
    pub fn stray(&self) -> Option<&'static str> {
        crate::cli::first_stray(
            self.backward,
            [
                ("--deterministic", self.deterministic),
                ("--causal", self.causal),
                ("--window", self.window.is_some()),
                ("--softcap", self.softcap.is_some()),
            ],
        )
    }

    /// Whether `--backward` was given.
    pub fn wanted(&self) -> bool {
        self.backward
    }
}

/// Prints the backward's plan.
pub fn run(args: &PlanArgs) -> Result<()> {
    // Flags that would change nothing here are refused rather than ignored.
    let refused: [(&str, bool, &str); 7] = [
        ("--num-q-heads", args.num_q_heads.is_some(), "use --heads-q"),
        ("--group", args.group.is_some(), "use --heads-kv"),
        ("--seqlen", args.seqlen.is_some(), "use --seqlen-q (and --seqlen-k)"),
        ("--swizzle", args.swizzle.is_some(), "the backward kernels take no TMA swizzle"),
        ("--compile", args.compile, "compiles the SM100 forward kernel only"),
        ("--decode", args.decode.wanted(), "plans a decode call, not a backward"),
        ("--arch", args.arch == Some(PlanArch::Sm100), "fa4 has no Blackwell backward; the Ampere-class kernels run there: use --arch sm80 or sm90"),
    ];
    if let Some((flag, _, why)) = refused.into_iter().find(|r| r.1) {
        return Err(Error::invalid(
            flag,
            format!("does not apply to `--backward`: {why}"),
        ));
    }
    if let Some(flag) = args.decode.split_flag() {
        return Err(Error::invalid(flag, "belongs to `fa4 plan --decode`"));
    }
    let b = &args.backward;
    let p = problem(args)?;
    let arch = args.arch.unwrap_or(PlanArch::Sm90);
    match arch {
        PlanArch::Cpu => {
            if args.json {
                println!("{}", pretty(&cpu_json(&p, b.deterministic)));
            } else {
                print_cpu(&p, b.deterministic);
            }
            Ok(())
        }
        PlanArch::Sm80 | PlanArch::Sm90 => {
            let gpu = Gpu::of(arch);
            // Where the Hopper kernel covers the problem it runs both modes, with the row
            // kernels of the non-deterministic plan (pre, then convert).
            let plan = |det: bool| {
                if gpu.family(&p, det) == "sm90" {
                    bwd::plan_rows_for_hopper(&p, &gpu.arch, gpu.target)
                } else {
                    bwd::plan(&p, &gpu.arch, gpu.target, det, None)
                }
                .map_err(flag_error)
            };
            let det = b.deterministic;
            let (this, other) = (plan(det)?, plan(!det)?);
            if args.json {
                println!("{}", pretty(&gpu_json(&gpu, &p, &this, &other, det)));
            } else {
                print_gpu(&gpu, &p, &this, &other, det);
            }
            Ok(())
        }
        PlanArch::Sm100 => unreachable!("refused above"),
    }
}

/// The problem the flags describe, each bad value an error naming its flag.
fn problem(args: &PlanArgs) -> Result<Problem> {
    let s = args.decode.shape_flags();
    let depth = args.depth as usize;
    let depth_v = args.depth_v.map_or(depth, |d| d as usize);
    let batch = s.batch.unwrap_or(1);
    let sq = s.seqlen_q.unwrap_or(DEFAULT_SEQLEN);
    let sk = s.seqlen_k.unwrap_or(sq);
    let hq = s.heads_q.unwrap_or(DEFAULT_HEADS);
    let hkv = s.heads_kv.unwrap_or(hq);
    for (flag, v) in [
        ("--depth", depth),
        ("--depth-v", depth_v),
        ("--batch", batch),
        ("--seqlen-q", sq),
        ("--seqlen-k", sk),
        ("--heads-q", hq),
        ("--heads-kv", hkv),
    ] {
        if v == 0 {
            return Err(Error::invalid(flag, "must be at least 1"));
        }
    }
    if !hq.is_multiple_of(hkv) {
        return Err(Error::invalid(
            "--heads-kv",
            format!("{hkv} does not divide --heads-q {hq}"),
        ));
    }
    // Every tensor's element count must fit: the layouts check it, but would name `q`.
    for (flag, rows, heads) in [("--seqlen-q", sq, hq), ("--seqlen-k", sk, hkv)] {
        if batch
            .checked_mul(rows)
            .and_then(|x| x.checked_mul(heads))
            .and_then(|x| x.checked_mul(depth.max(depth_v)))
            .is_none_or(|n| n > isize::MAX as usize / 4)
        {
            return Err(Error::invalid(
                flag,
                "the problem's tensors would not fit in memory",
            ));
        }
    }
    let b = &args.backward;
    let mut opts = Options::new();
    if b.causal && b.window.is_some() {
        return Err(Error::invalid(
            "--window",
            "give --causal or --window, not both",
        ));
    }
    if b.causal {
        opts = opts.causal();
    }
    if let Some(m) = b.window {
        opts = opts.mask(m);
    }
    if let Some(c) = b.softcap {
        opts = opts.softcap(c);
    }
    if args.varlen {
        // A packed batch of `batch` sequences of sq query rows and sk keys each: the plan of a
        // ragged batch is that of its longest sequence (the grid covers it for every one).
        let cu = |n: usize, flag: &'static str| -> Result<Vec<i32>> {
            (0..=batch)
                .map(|b| {
                    i32::try_from(b * n).map_err(|_| {
                        Error::invalid(flag, "a packed batch's rows must fit in int32")
                    })
                })
                .collect()
        };
        let (cq, ck) = (cu(sq, "--seqlen-q")?, cu(sk, "--seqlen-k")?);
        let lq = Layout::new("q", &[batch * sq, hq, depth], None)?;
        let lk = Layout::new("k", &[batch * sk, hkv, depth], None)?;
        let lv = Layout::new("v", &[batch * sk, hkv, depth_v], None)?;
        let lo = Layout::new("out", &[batch * sq, hq, depth_v], None)?;
        return Problem::new(args.dtype, &lq, &lk, &lv, &lo, Some(&cq), Some(&ck), &opts)
            .map_err(flag_error);
    }
    let lq = Layout::new("q", &[batch, sq, hq, depth], None)?;
    let lk = Layout::new("k", &[batch, sk, hkv, depth], None)?;
    let lv = Layout::new("v", &[batch, sk, hkv, depth_v], None)?;
    let lo = Layout::new("out", &[batch, sq, hq, depth_v], None)?;
    Problem::new(args.dtype, &lq, &lk, &lv, &lo, None, None, &opts).map_err(flag_error)
}

/// A planner's or the problem's error, named by the flag that set what it names.
fn flag_error(e: Error) -> Error {
    match e {
        Error::InvalidArgument { name, reason } => {
            let flag = match name.as_str() {
                "dtype" => "--dtype",
                "softcap" => "--softcap",
                "window" | "mask" => "--window",
                // The planner names `q` for the grid's limits and the row count too.
                "q" if reason.ends_with("heads exceed the CUDA grid") => "--heads-q",
                "q" if reason.ends_with("sequences exceed the CUDA grid") => "--batch",
                "q" if reason.ends_with("exceed the CUDA grid") || reason.contains("2^31 rows") => {
                    "--seqlen-q"
                }
                // The head dims (too large, not a multiple of 8) and the shared memory they need.
                "v" | "out" => "--depth-v",
                "q" | "k" => "--depth",
                _ => return Error::invalid(name, reason),
            };
            Error::invalid(flag, reason)
        }
        e => e,
    }
}

/// The GPU a GPU arch stands for, and the NVRTC target the CUDA backend compiles the backward
/// for on it (the plain `sm_XY` of its compute capability: the kernels use no `a` features).
struct Gpu {
    flag: &'static str,
    arch: fa4::arch::GpuArch,
    target: &'static str,
}

impl Gpu {
    fn of(a: PlanArch) -> Gpu {
        match a {
            PlanArch::Sm80 => Gpu {
                flag: "sm80",
                arch: fa4::arch::A100,
                target: "sm_80",
            },
            _ => Gpu {
                flag: "sm90",
                arch: fa4::arch::H200,
                target: "sm_90",
            },
        }
    }

    /// The kernel family of the main backward: `sm90` where the Hopper kernel covers the problem
    /// on an sm90 target, else `sm80` (the Ampere-class kernels).
    fn family(&self, p: &Problem, deterministic: bool) -> &'static str {
        let hopper = self.flag == "sm90"
            && fa4::config::bwd_sm90::uncovered(p, &self.arch).is_none()
            && fa4::config::bwd_sm90::plan(p, &self.arch, self.target, deterministic).is_ok();
        if hopper {
            "sm90"
        } else {
            "sm80"
        }
    }

    /// Which kernels run: on sm90, the Hopper main kernel where it covers the problem (the
    /// launches printed below are then the Ampere-class plan, whose pre and convert it shares).
    fn family_note(&self, p: &Problem, deterministic: bool) -> String {
        let ampere = "the Ampere-class kernels (mma.sync m16n8k16, cp.async, ldmatrix)";
        if self.flag != "sm90" {
            return ampere.to_string();
        }
        match fa4::config::bwd_sm90::uncovered(p, &self.arch) {
            Some((_, why)) => {
                format!("{ampere} run: the Hopper backward does not cover this problem ({why})")
            }
            None => match fa4::config::bwd_sm90::plan(p, &self.arch, self.target, deterministic) {
                Ok(h) => format!(
                    "the Hopper backward (kernels/bwd_sm90: a TMA producer warpgroup, two consumer \
                     warpgroups, wgmma) replaces launch 2 below with {}: {} persistent CTAs \
                     (at most one per SM) taking {} tiles ({} keys, KV head, sequence) from a \
                     counter, {} threads, {} B shared memory; launches 1 and 3 are as listed, \
                     except that launch 1 covers {} (grid \
                     {}x{}x{}) and writes D and LSE·log2e padded to them ({} B in place of the D \
                     workspace below, the tile counter and a semaphore per query block included), which the \
                     Hopper kernel \
                     bulk-copies per step, and zeroes a dQ accumulator of {} B laid out in 64 x \
                     64 tiles over those rows, which it adds to tile by tile {}, and launch 3 \
                     reads those tiles whole, 32 rows per \
                     CTA (grid {}x{}x{}); FA4_BWD_KERNEL=sm80 runs the Ampere-class main kernel \
                     instead",
                    h.spec,
                    h.grid.0,
                    h.tiles,
                    h.spec.block_n(),
                    h.spec.threads(),
                    h.spec.smem_bytes(),
                    if p.is_varlen() {
                        format!(
                            "each sequence's rows rounded up to whole query blocks, {} padded \
                             rows in one packed entry",
                            h.stats_rows
                        )
                    } else {
                        format!("{} rows per sequence (whole query blocks)", h.stats_rows)
                    },
                    h.pre.1 .0,
                    h.pre.1 .1,
                    h.pre.1 .2,
                    h.base.dpsum_len * 4,
                    h.base.accum_len * 4,
                    if fa4::config::bwd_sm90::shared_keys(h.spec.head_dim) {
                        "from registers (red.global.add.v4.f32; both consumers share the 64 keys \
                         and split the head dim)"
                    } else {
                        "from shared memory (cp.reduce.async.bulk)"
                    },
                    h.convert.1 .0,
                    h.convert.1 .1,
                    h.convert.1 .2
                ),
                Err(e) => {
                    format!("{ampere} run: the Hopper backward does not cover this problem ({e})")
                }
            },
        }
    }

    /// How the main kernel adds into the dQ accumulator on this target: the Ampere-class
    /// kernel's reductions, and the Hopper kernel's bulk reduce-add where it covers `p`.
    fn reduction(&self, p: &Problem) -> String {
        if self.flag != "sm90" {
            return "red.global.add.f32 (scalar reductions; the vector form needs sm_90)".into();
        }
        let ampere =
            "red.global.add.v2.f32 (one vector reduction per pair of f32, sm_90 and later)";
        match fa4::config::bwd_sm90::plan(p, &self.arch, self.target, false) {
            Ok(h) if fa4::config::bwd_sm90::shared_keys(h.spec.head_dim) => format!(
                "red.global.add.v4.f32 of 64 x 64 tiles from registers (the Hopper main \
                 kernel at tiles of {}; the Ampere-class one: {ampere})",
                h.spec.head_dim
            ),
            Ok(_) => format!(
                "cp.reduce.async.bulk add.f32 of 64 x 64 tiles from shared memory (the Hopper \
                 main kernel; the Ampere-class one: {ampere})"
            ),
            Err(_) => ampere.into(),
        }
    }
}

/// What a launch of a (deterministic or not) backward computes, and how its warps divide the
/// work.
fn role(s: &BwdSpec, det: bool) -> (&'static str, String) {
    match s.kernel {
        BwdKernel::Pre => (
            if det {
                "D_i = rowsum(dO∘O) in f32 from the stored O"
            } else {
                "D_i = rowsum(dO∘O) in f32 from the stored O; the dQ accumulator zeroed"
            },
            format!(
                "{} warps, {} lanes per query row",
                bwd::AUX_WARPS,
                bwd::row_lanes(s.head_dim)
            ),
        ),
        BwdKernel::Main => (
            if det {
                "dK, dV of a key block over every query head of its KV head (GQA sums in \
                 registers) and every query block the mask lets see it; no dQ"
            } else {
                "dK, dV of a key block over every query head of its KV head (GQA sums in \
                 registers) and every query block the mask lets see it; dS·K added into the dQ \
                 accumulator"
            },
            format!(
                "{} keys x {} queries per step, {} warps (16 keys each{})",
                s.main.block_n,
                s.main.block_m,
                s.main.num_warps(),
                if s.main.dsplit > 1 {
                    format!(", {} column groups of dK, dV", s.main.dsplit)
                } else {
                    String::new()
                }
            ),
        ),
        BwdKernel::Dq => (
            "dQ of a query block, its warps walking the key blocks in order (S, dP recomputed), \
             dQ in registers",
            format!(
                "{} query rows x {} keys per step, {} warps (16 rows each)",
                s.dq.block_m,
                s.dq.block_n,
                s.dq.num_warps()
            ),
        ),
        BwdKernel::Convert => (
            "dQ = scale · accumulator, rounded to the storage dtype",
            format!(
                "{} warps, {} lanes per query row",
                bwd::AUX_WARPS,
                bwd::row_lanes(s.head_dim)
            ),
        ),
    }
}

fn kernel_name(k: BwdKernel) -> &'static str {
    match k {
        BwdKernel::Pre => "pre",
        BwdKernel::Main => "main",
        BwdKernel::Dq => "dq",
        BwdKernel::Convert => "convert",
    }
}

fn grid_axes(k: BwdKernel) -> &'static str {
    match k {
        BwdKernel::Main => "key blocks x KV heads x sequences",
        _ => "query-row blocks x query heads x sequences",
    }
}

fn reason(s: &BwdSpec) -> Option<&'static str> {
    match s.kernel {
        BwdKernel::Main => Some(bwd::main_tiles_reason(s.head_dim)),
        BwdKernel::Dq => Some(bwd::dq_tiles_reason(s.head_dim)),
        BwdKernel::Pre | BwdKernel::Convert => None,
    }
}

fn describe(p: &Problem) -> String {
    let s = &p.sequences()[0];
    let mask = match p.mask() {
        Mask::None => "no mask".to_string(),
        Mask::Causal => "causal".to_string(),
        m => {
            let side = |x: Option<usize>| x.map_or("-1".to_string(), |v| v.to_string());
            let (l, r) = m.bounds();
            format!("window {},{}", side(l), side(r))
        }
    };
    format!(
        "{}, batch {}{}, seqlen {} x {} (q x k), heads {}/{} (q/kv), head_dim {}{}, {mask}{}",
        p.dtype(),
        p.sequences().len(),
        if p.is_varlen() {
            " packed (varlen)"
        } else {
            ""
        },
        s.q_len,
        s.k_len,
        p.heads_q(),
        p.heads_kv(),
        p.head_dim(),
        if p.head_dim_v() != p.head_dim() {
            format!(" (v: {})", p.head_dim_v())
        } else {
            String::new()
        },
        p.softcap()
            .map_or(String::new(), |c| format!(", softcap {c}"))
    )
}

/// The Hopper kernel's deterministic mode, for the reports.
const HOPPER_DET: &str = "the Hopper main kernel adds dQ in a fixed order of key blocks, from \
    the last down (a semaphore per query block; to head dim 128 producer warp 1 takes the turns \
    and bulk reduce-adds both consumers' tiles, in the shared-keys form each consumer waits for \
    its own), with the same launches";

fn print_gpu(gpu: &Gpu, p: &Problem, this: &BwdPlan, other: &BwdPlan, det: bool) {
    let main = &this.launches[1].0;
    let hopper = gpu.family(p, det) == "sm90";
    println!(
        "backward plan, --arch {} ({}, {} SMs, {} B of shared memory per block), NVRTC target {}",
        gpu.flag,
        gpu.arch.name,
        gpu.arch.sm_count,
        gpu.arch.max_smem_per_block(),
        gpu.target
    );
    println!("  problem    {}", describe(p));
    let padded = if main.head_dim == p.head_dim() {
        String::new()
    } else {
        format!(
            "; head_dim {} runs as {} (loads zero-fill the columns past it, stores skip them)",
            p.head_dim(),
            main.head_dim
        )
    };
    println!("  kernels    {}{padded}", gpu.family_note(p, det));
    if det && hopper {
        println!(
            "  dQ         deterministic: {HOPPER_DET}, into an f32 accumulator ({} B): the same \
             bits on every run",
            this.accum_len * 4
        );
    } else if det {
        println!(
            "  dQ         deterministic: no accumulator and no atomics; the dq kernel sums each \
             element in one thread in a fixed order: the same bits on every run"
        );
    } else {
        println!(
            "  dQ         accumulated in f32 ({} B) by {}; its bits may differ between runs \
             (dK and dV never take atomics)",
            this.accum_len * 4,
            gpu.reduction(p)
        );
    }
    println!("  launches   one stream, in order:");
    for (i, (s, grid)) in this.launches.iter().enumerate() {
        let (what, warps) = role(s, main.deterministic);
        println!("    {}. {:<16} {what}", i + 1, s.entry());
        println!(
            "       {:<16} {warps}, {} threads; grid {} x {} x {} ({}) = {} CTAs; {} B shared \
             memory",
            "",
            s.threads(),
            grid.0,
            grid.1,
            grid.2,
            grid_axes(s.kernel),
            grid.0 as u64 * grid.1 as u64 * grid.2 as u64,
            s.smem_bytes()
        );
        if let Some(why) = reason(s) {
            println!("       {:<16} tiles: {why}", "");
        }
    }
    println!(
        "  workspace  D: {} B (f32 per query row and head){}",
        this.dpsum_len * 4,
        if main.deterministic {
            String::new()
        } else {
            format!("; dQ accumulator: {} B", this.accum_len * 4)
        }
    );
    let last = &other.launches[2].0;
    let grid = other.launches[2].1;
    if hopper && det {
        println!(
            "  without --deterministic: the Hopper main kernel adds dQ as its tiles come, without \
             turns (the same launches): dQ's bits may differ run to run"
        );
    } else if hopper {
        println!(
            "  with --deterministic: {HOPPER_DET}: the same bits on every run; measured cost in \
             docs/backward.md"
        );
    } else if det {
        println!(
            "  without --deterministic: main also adds dS·K into an f32 accumulator ({} B) by \
             {}, and {} converts it ({} warps, grid {} x {} x {}) in place of dq: faster where \
             the reductions are cheap, but dQ's bits may differ run to run",
            other.accum_len * 4,
            gpu.reduction(p),
            last.entry(),
            last.threads() / 32,
            grid.0,
            grid.1,
            grid.2
        );
    } else {
        let (_, warps) = role(last, true);
        println!(
            "  with --deterministic: main skips dQ and {} computes it ({warps}, grid {} x {} x \
             {}, {} B shared memory; tiles: {}), recomputing S and dP: the same bits on every \
             run, no accumulator; measured on the H200: 13-15% slower at d64 and d256, within 3% \
             at d128 (docs/backward.md)",
            last.entry(),
            grid.0,
            grid.1,
            grid.2,
            last.smem_bytes(),
            bwd::dq_tiles_reason(last.head_dim)
        );
    }
    println!("  compile key of main: {main}");
}

fn gpu_json(
    gpu: &Gpu,
    p: &Problem,
    this: &BwdPlan,
    other: &BwdPlan,
    det: bool,
) -> serde_json::Value {
    let launch = |det: bool, (s, g): &(BwdSpec, (u32, u32, u32))| {
        let (what, warps) = role(s, det);
        let (block_m, block_n) = match s.kernel {
            BwdKernel::Main => (Some(s.main.block_m), Some(s.main.block_n)),
            BwdKernel::Dq => (Some(s.dq.block_m), Some(s.dq.block_n)),
            BwdKernel::Pre | BwdKernel::Convert => (None, None),
        };
        serde_json::json!({
            "kernel": kernel_name(s.kernel),
            "entry": s.entry(),
            "computes": what,
            "work": warps,
            "block_m": block_m,
            "block_n": block_n,
            "dsplit": (s.kernel == BwdKernel::Main).then_some(s.main.dsplit),
            "warps": s.threads() / 32,
            "threads": s.threads(),
            "smem_bytes": s.smem_bytes(),
            "grid": [g.0, g.1, g.2],
            "tiles_reason": reason(s),
            "spec": s.to_string(),
        })
    };
    let main = &this.launches[1].0;
    let hopper = gpu.family(p, det) == "sm90";
    let dq_accumulation = match (det, hopper) {
        (true, true) => format!("deterministic: {HOPPER_DET}"),
        (true, false) => "deterministic".to_string(),
        (false, _) => gpu.reduction(p),
    };
    let (rows_det, other_rows_det) = (main.deterministic, other.launches[1].0.deterministic);
    serde_json::json!({
        "arch": gpu.flag,
        "gpu": gpu.arch.name,
        "target": gpu.target,
        "problem": describe(p),
        "padded_head_dim": main.head_dim,
        "family": gpu.family(p, det),
        "kernels": gpu.family_note(p, det),
        "deterministic": det,
        "dq_accumulation": dq_accumulation,
        "launches": this.launches.iter().map(|l| launch(rows_det, l)).collect::<Vec<_>>(),
        "workspace_bytes": { "d": this.dpsum_len * 4, "dq_accumulator": this.accum_len * 4 },
        "other_mode": {
            "deterministic": !det,
            "launches": other.launches.iter().map(|l| launch(other_rows_det, l)).collect::<Vec<_>>(),
            "workspace_bytes": { "d": other.dpsum_len * 4, "dq_accumulator": other.accum_len * 4 },
        },
    })
}

/// The CPU backward's work items (`cpu::backward`'s two passes): pass 1 one per (sequence with
/// queries, KV head, key block), pass 2 one per (sequence, query head, query block).
fn cpu_items(p: &Problem, t: fa4::cpu::plan::CpuTiles) -> (usize, usize) {
    let seqs = p.sequences();
    let kv = seqs
        .iter()
        .filter(|s| s.q_len > 0)
        .map(|s| s.k_len.div_ceil(t.block_n) * p.heads_kv())
        .sum();
    let q = seqs
        .iter()
        .map(|s| s.q_len.div_ceil(t.block_m) * p.heads_q())
        .sum();
    (kv, q)
}

const CPU_DETERMINISM: &str = "always deterministic: every output element is summed by one \
    work item in a fixed order, whatever the thread count, so --deterministic changes nothing \
    and costs nothing on the CPU";

fn print_cpu(p: &Problem, det_asked: bool) {
    let t = fa4::cpu::plan::plan(p);
    let (kv, q) = cpu_items(p, t);
    println!(
        "backward plan, --arch cpu (the tiled CPU backend, {} threads here)",
        rayon::current_num_threads()
    );
    println!("  problem    {}", describe(p));
    println!(
        "  tiles      {} query rows x {} keys (96 x 96, the forward's tiles, shrunk to the \
         longest sequence; src/cpu/plan.rs says why 96)",
        t.block_m, t.block_n
    );
    println!(
        "  pass 1     dK, dV: {kv} items, one per (sequence, KV head, {}-key block), each over \
         the query heads of its KV head and the query blocks that see its keys",
        t.block_n
    );
    println!(
        "  pass 2     dQ: {q} items, one per (sequence, query head, {}-row query block), over \
         its key blocks (S and dP recomputed)",
        t.block_m
    );
    println!(
        "  precision  {} storage widened to f32 once per tile; P and dS stay f32; results \
         rounded to {} once",
        p.dtype(),
        p.dtype()
    );
    println!(
        "  {}{CPU_DETERMINISM}",
        if det_asked { "--deterministic: " } else { "" }
    );
}

fn cpu_json(p: &Problem, det_asked: bool) -> serde_json::Value {
    let t = fa4::cpu::plan::plan(p);
    let (kv, q) = cpu_items(p, t);
    serde_json::json!({
        "arch": "cpu",
        "family": "cpu",
        "problem": describe(p),
        "block_m": t.block_m,
        "block_n": t.block_n,
        "passes": [
            { "pass": "dk_dv", "items": kv },
            { "pass": "dq", "items": q },
        ],
        "deterministic": true,
        "deterministic_requested": det_asked,
        "determinism": CPU_DETERMINISM,
    })
}

fn pretty(v: &serde_json::Value) -> String {
    serde_json::to_string_pretty(v).expect("plain data serializes")
}
