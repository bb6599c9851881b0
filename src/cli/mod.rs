//! Command-line parsing and dispatch. Every failure is one line on stderr and exit code 2;
//! nothing here panics on user input. Exit codes: 0 success, 1 a correctness check failed
//! (`fa4 run`, `fa4 check`; the verdict is on stdout), 2 an error.

use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

use fa4::Backend;

mod backward;
mod bench;
mod bench_cuda;
mod check;
mod cp;
mod memory;
mod plan;
mod progress;
mod run;

/// Exact, fast attention (FlashAttention) on NVIDIA GPUs and the CPU.
#[derive(Parser, Debug)]
#[command(name = "fa4", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Plan a kernel and explain the plan (tiles, tensor memory, shared memory, support).
    Plan(plan::PlanArgs),
    /// Compute attention: on a random problem (checked against the float64 oracle), or on
    /// Q, K, V from .npy files.
    Run(Box<run::RunArgs>),
    /// Run the correctness matrix against the float64 oracle on a backend.
    Check(check::CheckArgs),
    /// Benchmark a backend against its peers, measured in the same run.
    Bench(bench::BenchArgs),
}

/// Parses the arguments, runs the command and maps every error to one line and exit code 2.
pub fn main() -> ExitCode {
    restore_sigpipe();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return clap_error(e),
    };
    let result = match cli.command {
        Command::Plan(args) => plan::run(args).map(|()| ExitCode::SUCCESS),
        Command::Run(args) => run::run(*args),
        Command::Check(args) => check::run(args),
        Command::Bench(args) => bench::run(args).map(|()| ExitCode::SUCCESS),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("fa4: error: {}", one_line(&e.to_string()));
            ExitCode::from(2)
        }
    }
}

/// A closed stdout (`fa4 run | head -1`) ends the program quietly, as it ends `cat`: Rust
/// ignores SIGPIPE, which turns the failed write into a panic in `println!`; the default action
/// restores the Unix convention.
fn restore_sigpipe() {
    #[cfg(unix)]
    // SAFETY: called first thing in `main`, before any other thread exists; setting a signal's
    // disposition to its default has no memory-safety preconditions.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// An error message on one line: a line break (a compiler log, say) becomes ` | `, other control
/// characters are escaped.
fn one_line(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for line in s.lines().map(str::trim_end).filter(|l| !l.is_empty()) {
        if !out.is_empty() {
            out.push_str(" | ");
        }
        for c in line.chars() {
            if c.is_control() || matches!(c, '\u{2028}' | '\u{2029}') {
                out.extend(c.escape_default());
            } else {
                out.push(c);
            }
        }
    }
    out
}

/// Runs `f` on a rayon pool of `threads` workers (`--threads`; `None`: all cores), so that the
/// CPU backend and the float64 oracle both use that many.
pub fn with_threads<R: Send>(
    threads: Option<usize>,
    f: impl FnOnce() -> fa4::Result<R> + Send,
) -> fa4::Result<R> {
    let Some(n) = threads else { return f() };
    if n == 0 {
        return Err(fa4::Error::invalid("--threads", "must be ≥ 1"));
    }
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build()
        .map_err(|e| fa4::Error::invalid("--threads", e.to_string()))?
        .install(f)
}

/// `--backend`: where attention is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum BackendArg {
    /// A working GPU if there is one, else the CPU.
    #[default]
    Auto,
    /// The tiled, multi-threaded CPU backend.
    Cpu,
    /// The CUDA backend on device 0 (an error naming what is missing if there is none).
    Cuda,
}

impl BackendArg {
    /// The backend this choice names, or an error naming `--backend` if it is unavailable.
    pub fn resolve(self) -> fa4::Result<Backend> {
        match self {
            BackendArg::Auto => {
                // Which backend, and why not the GPU, on one line: the output alone would not
                // say why a machine with a GPU ran on the CPU.
                let (b, why) = Backend::auto_explained();
                eprintln!("fa4: --backend auto {why}");
                Ok(b)
            }
            BackendArg::Cpu => Ok(Backend::Cpu),
            BackendArg::Cuda => {
                Backend::cuda(0).map_err(|e| fa4::Error::invalid("--backend", format!("cuda: {e}")))
            }
        }
    }
}

/// `--kernel`: which CUDA kernel family runs the problems.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum KernelArg {
    /// The dispatcher's choice (`fa4 plan --arch sm90` says which and why).
    #[default]
    Auto,
    /// The Ampere-class `mma.sync` kernel.
    Sm80,
    /// The Hopper TMA + wgmma kernel (an error where it does not cover the problem).
    Sm90,
    /// The Blackwell tcgen05 kernel FA4Config plans (SM100 GPUs; NOT YET RUN ON HARDWARE).
    Sm100,
}

impl KernelArg {
    /// Says on stderr, once per command, that the sm100 kernel has not been run on hardware.
    pub fn note(self) {
        let env_sm100 = std::env::var("FA4_KERNEL").is_ok_and(|v| v == "sm100");
        if self == KernelArg::Sm100 || (self == KernelArg::Auto && env_sm100) {
            eprintln!(
                "fa4: note: the sm100 kernel has not been run on hardware (no Blackwell GPU was \
                 available to its authors); check its results with `fa4 check --kernel sm100`"
            );
        }
    }
}

impl From<KernelArg> for fa4::cuda::KernelChoice {
    fn from(k: KernelArg) -> Self {
        match k {
            KernelArg::Auto => fa4::cuda::KernelChoice::Auto,
            KernelArg::Sm80 => fa4::cuda::KernelChoice::Sm80,
            KernelArg::Sm90 => fa4::cuda::KernelChoice::Sm90,
            KernelArg::Sm100 => fa4::cuda::KernelChoice::Sm100,
        }
    }
}

/// A tile override (`--tiles`, `--sm90-tiles`: the form of the planner's `Tiles::from_str`),
/// its errors naming the flag.
pub fn parse_tiles<T: std::str::FromStr<Err = fa4::Error>>(flag: &str, s: &str) -> fa4::Result<T> {
    s.parse().map_err(|e| match e {
        fa4::Error::InvalidArgument { reason, .. } => fa4::Error::invalid(flag, reason),
        e => e,
    })
}

/// Help and version go to stdout as clap formats them; a usage error becomes one line.
fn clap_error(e: clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    if matches!(
        e.kind(),
        ErrorKind::DisplayHelp
            | ErrorKind::DisplayVersion
            | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
    ) {
        // Printing help cannot meaningfully fail; a closed stdout is not an error worth a panic.
        let _ = e.print();
        return if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
            ExitCode::from(2)
        } else {
            ExitCode::SUCCESS
        };
    }
    let rendered = e.render().to_string();
    let line = rendered
        .lines()
        .map(str::trim)
        .filter(|l| {
            !l.is_empty() && !l.starts_with("For more information") && !l.starts_with("Usage:")
        })
        .map(|l| l.strip_prefix("error: ").unwrap_or(l))
        .collect::<Vec<_>>()
        .join(" ");
    eprintln!("fa4: error: {line}");
    ExitCode::from(2)
}

/// The first of `flags` (name, given) that was given although the mode that reads them (`mode`:
/// `--decode`, `--backward` of `fa4 plan`) was not: such a flag would be ignored, so it is
/// refused by name.
pub(crate) fn first_stray<const N: usize>(
    mode: bool,
    flags: [(&'static str, bool); N],
) -> Option<&'static str> {
    if mode {
        return None;
    }
    flags
        .into_iter()
        .find(|&(_, given)| given)
        .map(|(flag, _)| flag)
}
