//! The `fa4` command: plan kernels (and, as backends land, run, check and benchmark attention).

mod cli;

fn main() -> std::process::ExitCode {
    cli::main()
}
