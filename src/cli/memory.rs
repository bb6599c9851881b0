//! How much memory this process may still allocate, so that work too large for it is refused
//! (or its check skipped) with the bytes it asks for, before anything is allocated: Linux
//! overcommits, so an allocation that cannot be backed succeeds and the process is killed later
//! while writing to it.
//!
//! The budget is the smallest of: the kernel's estimate of available memory (`MemAvailable`),
//! the address-space and data-segment limits (`ulimit -v`, `-d`) less what is in use, and the
//! cgroup's memory limit less its usage. A source that cannot be read imposes no bound.

use fa4::{Error, Result};

/// Bytes this process can still allocate, or `None` when no source says.
pub fn available() -> Option<f64> {
    let mut best: Option<f64> = None;
    let mut bound = |x: Option<f64>| {
        if let Some(x) = x {
            best = Some(best.map_or(x, |b: f64| b.min(x)));
        }
    };
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok();
    bound(
        meminfo
            .as_deref()
            .and_then(|m| kib_field(m, "MemAvailable:")),
    );
    let status = std::fs::read_to_string("/proc/self/status").ok();
    let limits = std::fs::read_to_string("/proc/self/limits").ok();
    if let (Some(status), Some(limits)) = (status.as_deref(), limits.as_deref()) {
        for (limit, used) in [
            ("Max address space", "VmSize:"),
            ("Max data size", "VmData:"),
        ] {
            if let (Some(l), Some(u)) = (soft_limit(limits, limit), kib_field(status, used)) {
                bound(Some((l - u).max(0.0)));
            }
        }
    }
    let max = std::fs::read_to_string("/sys/fs/cgroup/memory.max").ok();
    let cur = std::fs::read_to_string("/sys/fs/cgroup/memory.current").ok();
    if let (Some(max), Some(cur)) = (max, cur) {
        if let (Ok(max), Ok(cur)) = (max.trim().parse::<f64>(), cur.trim().parse::<f64>()) {
            bound(Some((max - cur).max(0.0)));
        }
    }
    best
}

/// A `Key:   123 kB` line of `/proc/meminfo` or `/proc/self/status`, in bytes.
fn kib_field(text: &str, key: &str) -> Option<f64> {
    let line = text.lines().find(|l| l.starts_with(key))?;
    let kib: f64 = line[key.len()..].split_whitespace().next()?.parse().ok()?;
    Some(kib * 1024.0)
}

/// The soft limit of a `/proc/self/limits` row, in bytes (`None` when unlimited).
fn soft_limit(text: &str, name: &str) -> Option<f64> {
    let line = text.lines().find(|l| l.starts_with(name))?;
    line[name.len()..].split_whitespace().next()?.parse().ok()
}

/// `12.3 GB` (decimal, as the bytes beside it).
pub fn gb(bytes: f64) -> String {
    format!("{:.2} GB", bytes / 1e9)
}

/// An error naming `flag` when `bytes` (what `what` needs) exceed what this process may still
/// allocate; `bytes` is an f64 so that no product of sizes can overflow on the way here.
pub fn ensure(flag: &str, what: &str, bytes: f64) -> Result<()> {
    if bytes >= usize::MAX as f64 {
        return Err(Error::invalid(
            flag,
            format!("{what} needs {bytes:.3e} bytes, more than this machine can address"),
        ));
    }
    match available() {
        Some(free) if bytes > free => Err(Error::invalid(
            flag,
            format!(
                "{what} needs {bytes:.0} bytes ({}), but only {} can be allocated here",
                gb(bytes),
                gb(free)
            ),
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_proc_files() {
        let meminfo = "MemTotal:       24000000 kB\nMemAvailable:   1000 kB\n";
        assert_eq!(kib_field(meminfo, "MemAvailable:"), Some(1_024_000.0));
        assert_eq!(kib_field(meminfo, "SwapFree:"), None);
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \n\
                      Max data size             unlimited            unlimited            bytes     \n\
                      Max address space         4294967296           unlimited            bytes     \n";
        assert_eq!(soft_limit(limits, "Max address space"), Some(4294967296.0));
        assert_eq!(soft_limit(limits, "Max data size"), None);
        assert!(ensure("--x", "it", 1e30).is_err());
        assert!(ensure("--x", "it", 1.0).is_ok());
    }
}
