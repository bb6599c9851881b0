//! `fa4 run`.

use clap::Args;

use fa4::{Error, Result};

#[derive(Args, Debug)]
pub struct RunArgs {}

pub fn run(_args: RunArgs) -> Result<()> {
    Err(Error::invalid("command", "`run` is not implemented yet"))
}
