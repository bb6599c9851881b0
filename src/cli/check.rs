//! `fa4 check`.

use clap::Args;

use fa4::{Error, Result};

#[derive(Args, Debug)]
pub struct CheckArgs {}

pub fn run(_args: CheckArgs) -> Result<()> {
    Err(Error::invalid("command", "`check` is not implemented yet"))
}
