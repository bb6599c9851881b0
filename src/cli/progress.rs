//! Progress on stderr for work expected to take longer than [`SHOW_AFTER_S`]: the estimate when
//! it starts, then a bar redrawn in place when stderr is a terminal, or plain lines when it is
//! not (a log, a pipe). Work expected to be shorter prints nothing, so quick runs stay quiet.
//!
//! The fraction is the caller's count of finished steps when it has one ([`Progress::step`]);
//! otherwise the bar follows the elapsed time against the estimate, capped below 100 %, and says
//! that it is an estimate.

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Work expected to take longer than this many seconds shows progress.
pub const SHOW_AFTER_S: f64 = 2.0;

/// Multiply-adds per second per thread of the float64 oracle and the storage-precision pass: the
/// default `fa4 run` problem's 4.3e9 took 2.2 s on this project's idle 2-core machine, about
/// 1e9 per thread; rounded down, since a bar that ends early reads better than one that overruns.
pub const ORACLE_MACS_PER_THREAD_S: f64 = 0.8e9;

/// Width of the bar in characters.
const BAR: usize = 30;
/// Seconds between plain progress lines when stderr is not a terminal.
const PLAIN_EVERY_S: f64 = 10.0;

struct Shared {
    done: AtomicUsize,
    stop: AtomicBool,
}

/// A running progress report; [`Progress::finish`] (or drop) ends it.
pub struct Progress {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Progress {
    /// Reports `what`, expected to take `estimate_s` seconds over `steps` steps (0: no count,
    /// the bar follows the time).
    pub fn start(what: &str, estimate_s: f64, steps: usize) -> Progress {
        let shared = Arc::new(Shared {
            done: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
        });
        if estimate_s.is_nan() || estimate_s <= SHOW_AFTER_S {
            return Progress {
                shared,
                thread: None,
            };
        }
        let tty = std::io::stderr().is_terminal();
        eprintln!("fa4: {what}: about {} expected", seconds(estimate_s));
        let what = what.to_string();
        let s = Arc::clone(&shared);
        let thread = std::thread::spawn(move || report(&s, &what, estimate_s, steps, tty));
        Progress {
            shared,
            thread: Some(thread),
        }
    }

    /// One more step finished.
    pub fn step(&self) {
        self.shared.done.fetch_add(1, Ordering::Relaxed);
    }

    /// Ends the report (clearing the bar from a terminal).
    pub fn finish(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.stop();
    }
}

/// `12.3 s`, or `4 min 05 s`.
fn seconds(s: f64) -> String {
    if s < 120.0 {
        format!("{s:.1} s")
    } else {
        let whole = s.round() as u64;
        format!("{} min {:02} s", whole / 60, whole % 60)
    }
}

/// The fraction done and whether it is measured (counted steps) or estimated (time).
fn fraction(done: usize, steps: usize, elapsed: f64, estimate: f64) -> (f64, bool) {
    if steps > 0 {
        ((done as f64 / steps as f64).min(1.0), true)
    } else {
        ((elapsed / estimate).min(0.99), false)
    }
}

/// The bar line: `what [#########.....] 45% 3.1 s of ~7.0 s`.
fn bar_line(
    what: &str,
    f: f64,
    counted: bool,
    done: usize,
    steps: usize,
    elapsed: f64,
    estimate: f64,
) -> String {
    let filled = ((f * BAR as f64) as usize).min(BAR);
    let count = if counted {
        format!(" {done}/{steps}")
    } else {
        " (time estimate)".to_string()
    };
    // A busy or slower machine outruns the estimate: say so rather than sit at "99%, 10 s of
    // ~3 s" as if nothing were wrong.
    let time = if !counted && elapsed > estimate {
        format!(
            "{}, past the ~{} estimate",
            seconds(elapsed),
            seconds(estimate)
        )
    } else {
        format!("{} of ~{}", seconds(elapsed), seconds(estimate))
    };
    format!(
        "{what} [{}{}] {:>3.0}%{count} {time}",
        "#".repeat(filled),
        ".".repeat(BAR - filled),
        100.0 * f,
    )
}

fn report(s: &Shared, what: &str, estimate: f64, steps: usize, tty: bool) {
    let t0 = Instant::now();
    let mut last_plain = 0.0;
    let mut err = std::io::stderr();
    while !s.stop.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(200));
        let elapsed = t0.elapsed().as_secs_f64();
        let done = s.done.load(Ordering::Relaxed);
        let (f, counted) = fraction(done, steps, elapsed, estimate);
        if tty {
            // \r and erase-line redraw the bar in place.
            let _ = write!(
                err,
                "\r\x1b[K{}",
                bar_line(what, f, counted, done, steps, elapsed, estimate)
            );
            let _ = err.flush();
        } else if elapsed - last_plain >= PLAIN_EVERY_S {
            last_plain = elapsed;
            let _ = writeln!(
                err,
                "fa4: {}",
                bar_line(what, f, counted, done, steps, elapsed, estimate)
            );
        }
    }
    if tty {
        let _ = write!(err, "\r\x1b[K");
        let _ = err.flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bar_counts_steps_or_follows_time() {
        assert_eq!(fraction(3, 4, 100.0, 1.0), (0.75, true));
        assert_eq!(fraction(9, 4, 0.0, 1.0), (1.0, true));
        // By time it never claims to be done.
        assert_eq!(fraction(0, 0, 50.0, 10.0), (0.99, false));
        assert_eq!(fraction(0, 0, 5.0, 10.0), (0.5, false));
        let l = bar_line("oracle", 0.5, true, 2, 4, 1.0, 2.0);
        assert!(
            l.contains(&format!("[{}{}]", "#".repeat(15), ".".repeat(15))),
            "{l}"
        );
        assert!(l.contains(" 50% 2/4 1.0 s of ~2.0 s"), "{l}");
        assert!(bar_line("x", 0.2, false, 0, 0, 1.0, 5.0).contains("(time estimate)"));
        assert!(
            bar_line("x", 0.99, false, 0, 0, 9.0, 3.0).ends_with("9.0 s, past the ~3.0 s estimate")
        );
        assert_eq!(seconds(125.0), "2 min 05 s");
    }
}
