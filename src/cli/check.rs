//! `fa4 check`: the correctness matrix ([`fa4::check::matrix`], the one `cargo test` runs on
//! the CPU) against the float64 oracle, on a backend. One line per case, then the summary line
//! `N passed, M failed`; exit code 1 if any case failed.

use std::process::ExitCode;
use std::time::Instant;

use clap::Args;

use fa4::check::{matrix, run_case};
use fa4::problem::MAX_HEAD_DIM;
use fa4::{Backend, DType, Error, Result};

use super::progress::Progress;
use super::BackendArg;

/// The matrix's head dimensions when `--head-dim` is not given.
const HEAD_DIMS: [usize; 7] = [32, 64, 80, 96, 128, 192, 256];
/// The matrix's dtypes when `--dtype` is not given.
const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::Bf16];

#[derive(Args, Debug)]
pub struct CheckArgs {
    /// Where attention is computed.
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    backend: BackendArg,
    /// Only these storage dtypes (repeat or comma-separate: f32,fp16,bf16,fp8) [default:
    /// f32,fp16,bf16]. fp8 (e4m3 inputs, O in bf16) runs on Hopper GPUs and the CPU.
    #[arg(long, value_delimiter = ',')]
    dtype: Vec<DType>,
    /// Only these head dimensions (repeat or comma-separate) [default: 32,64,80,96,128,192,256].
    #[arg(long, value_delimiter = ',', allow_negative_numbers = true)]
    head_dim: Vec<usize>,
    /// Case i draws its inputs from seed + i (tests/cpu_matrix.rs uses 1000).
    #[arg(long, default_value_t = 1000, allow_negative_numbers = true)]
    seed: u64,
    /// Override the CUDA kernel's tiles (`--backend cuda` only; the form of `fa4 bench --tiles`):
    /// `block_m,block_n,warps,m_tiles,stages,ctas_per_sm,q_in_regs(0|1),lazy_rescale(0|1)`.
    #[arg(long)]
    tiles: Option<String>,
    /// Override the Hopper kernel's tiles (`--backend cuda` only; the form of `fa4 bench
    /// --sm90-tiles`).
    #[arg(long)]
    sm90_tiles: Option<String>,
    /// Which CUDA kernel family runs the matrix (`--backend cuda` only).
    #[arg(long, value_enum)]
    kernel: Option<super::KernelArg>,
    /// Worker threads of the CPU backend and of the float64 oracle [default: all cores].
    #[arg(long, allow_negative_numbers = true)]
    threads: Option<usize>,
    /// Check the gradients of the backward pass instead (the gradient matrix, on the CPU).
    #[arg(long)]
    backward: bool,
}

pub fn run(args: CheckArgs) -> Result<ExitCode> {
    super::with_threads(args.threads, || run_in_pool(args))
}

fn run_in_pool(args: CheckArgs) -> Result<ExitCode> {
    let fp8 = args.dtype.contains(&DType::Fp8E4M3);
    if fp8 && args.backward {
        return Err(Error::invalid(
            "--backward",
            "fp8 has no backward; check the fp8 forward without --backward",
        ));
    }
    if let Some(d) = args
        .head_dim
        .iter()
        .find(|&&d| !(1..=MAX_HEAD_DIM).contains(&d))
    {
        return Err(Error::invalid(
            "--head-dim",
            format!("{d} is outside 1..={MAX_HEAD_DIM}"),
        ));
    }
    let mut backend = args.backend.resolve()?;
    for (flag, given) in [
        ("--tiles", args.tiles.is_some()),
        ("--kernel", args.kernel.is_some()),
        ("--sm90-tiles", args.sm90_tiles.is_some()),
    ] {
        if given && !matches!(backend, Backend::Cuda(_)) {
            return Err(Error::invalid(
                flag,
                format!(
                    "only the CUDA backend has kernels and tiles to choose, not {}",
                    backend.name()
                ),
            ));
        }
    }
    if let Backend::Cuda(cuda) = &backend {
        let mut cuda = cuda.clone();
        if let Some(t) = args.tiles.as_deref() {
            cuda = cuda.with_tiles(Some(super::parse_tiles("--tiles", t)?));
        }
        if let Some(t) = args.sm90_tiles.as_deref() {
            cuda = cuda.with_sm90_tiles(Some(super::parse_tiles("--sm90-tiles", t)?));
        }
        if let Some(k) = args.kernel {
            cuda = cuda.with_kernel(k.into());
        }
        args.kernel.unwrap_or_default().note();
        backend = Backend::Cuda(cuda);
    }
    let dtypes = if args.dtype.is_empty() {
        DTYPES.to_vec()
    } else {
        dedup(&args.dtype)
    };
    let head_dims = if args.head_dim.is_empty() {
        HEAD_DIMS.to_vec()
    } else {
        dedup(&args.head_dim)
    };
    if args.backward {
        let auto = args.backend == BackendArg::Auto;
        return super::backward::check(backend, auto, &dtypes, &head_dims, args.seed);
    }
    let cases = matrix(&dtypes, &head_dims);
    // fp8 runs on Hopper GPUs (the e4m3 kernel) and the CPU: with `--backend auto` on another
    // GPU the fp8 cases run on the CPU; `--backend cuda` there fails them by name.
    let cpu = Backend::Cpu;
    let fp8_on_cpu = args.backend == BackendArg::Auto && !super::run::fp8run::hopper(&backend);
    let backend_for = |dtype: DType| match (&backend, dtype) {
        (Backend::Cuda(_), DType::Fp8E4M3) if fp8_on_cpu => &cpu,
        _ => &backend,
    };
    if fp8 && fp8_on_cpu && matches!(backend, Backend::Cuda(_)) {
        println!(
            "fp8 cases run on the CPU backend (the GPU's kernels compute fp8 on Hopper GPUs only)"
        );
    }
    let n = cases.len();
    let width = n.to_string().len();
    println!(
        "checking {n} cases on {} against the float64 oracle (seed {})",
        backend.name(),
        args.seed
    );
    let t0 = Instant::now();
    let (mut passed, mut failed) = (0usize, 0usize);
    // The bar starts after the first case, whose time (times the number of cases) is the
    // estimate; the fraction itself counts finished cases.
    let mut progress: Option<Progress> = None;
    for (i, case) in cases.iter().enumerate() {
        if i == 1 {
            let estimate = t0.elapsed().as_secs_f64() * n as f64;
            let p = Progress::start(&format!("checking {n} cases"), estimate, n);
            p.step();
            progress = Some(p);
        }
        let seed = args.seed.wrapping_add(i as u64);
        let verdict = match run_case(backend_for(case.dtype), case, seed) {
            Ok(report) => {
                if report.passed() {
                    passed += 1;
                } else {
                    failed += 1;
                }
                report.to_string()
            }
            Err(e) => {
                failed += 1;
                format!("FAIL: error: {e}")
            }
        };
        println!("case {:>width$}/{n} {case}: {verdict}", i + 1);
        if let Some(p) = &progress {
            p.step();
        }
    }
    if let Some(p) = progress {
        p.finish();
    }
    println!("took {:.2} s", t0.elapsed().as_secs_f64());
    println!("{passed} passed, {failed} failed");
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// The values in their first order of appearance, each once.
fn dedup<T: PartialEq + Copy>(xs: &[T]) -> Vec<T> {
    let mut out: Vec<T> = Vec::new();
    for &x in xs {
        if !out.contains(&x) {
            out.push(x);
        }
    }
    out
}
