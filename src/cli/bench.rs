//! `fa4 bench`.

use clap::Args;

use fa4::{Error, Result};

#[derive(Args, Debug)]
pub struct BenchArgs {}

pub fn run(_args: BenchArgs) -> Result<()> {
    Err(Error::invalid("command", "`bench` is not implemented yet"))
}
