//! Helpers shared by the command-line tests (each `tests/*.rs` that says `mod common;`).

use std::process::Command;

/// Runs the `fa4` binary this test build made with `args`: (exit code, stdout, stderr); the code
/// is -1 when a signal ended it.
pub fn fa4(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_fa4"))
        .args(args)
        .output()
        .expect("the fa4 binary runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
