//! What a user sees while the command works on something long (a model
//! opened and hashed, a slice loaded): a spinner with the elapsed time on
//! a terminal, the plain line elsewhere, and how long it took.

use std::time::{Duration, Instant};

/// Run `work`, showing `what` with a spinner and the time it takes on a
/// terminal (kept as a line when it succeeded; a failure says why itself),
/// and as one plain line elsewhere.
pub fn showing<T, E>(what: &str, work: impl FnOnce() -> Result<T, E>) -> Result<T, E> {
    let started = Instant::now();
    let spinner = indicatif::ProgressBar::new_spinner().with_style(
        indicatif::ProgressStyle::with_template("{spinner} {msg} ({elapsed})")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
    );
    if spinner.is_hidden() {
        // Not a terminal (a log, a test): the plain line.
        eprintln!("{what} …");
    } else {
        spinner.set_message(what.to_string());
        spinner.enable_steady_tick(Duration::from_millis(100));
    }
    let done = work();
    if !spinner.is_hidden() {
        spinner.finish_and_clear();
        if done.is_ok() {
            eprintln!("{what}: {:.2} s", started.elapsed().as_secs_f64());
        }
    }
    done
}
