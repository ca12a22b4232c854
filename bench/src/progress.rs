//! Progress bars for the bench binaries (stderr, so stdout keeps only the report).
//!
//! Bars draw only when stderr is a terminal (indicatif hides them otherwise) and never with
//! `--quiet`. Updates are cheap: callers set the position at most a few times a second from
//! their own loop; the spinner, for phases with no loop of their own, ticks from indicatif's
//! thread four times a second.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::time::Duration;

fn draw_target(quiet: bool) -> ProgressDrawTarget {
    if quiet {
        ProgressDrawTarget::hidden()
    } else {
        ProgressDrawTarget::stderr_with_hz(4)
    }
}

fn styled(bar: ProgressBar, template: &str) -> ProgressBar {
    // The templates are constants of this module; a bad one only loses the styling.
    if let Ok(style) = ProgressStyle::with_template(template) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

/// A bar over `total` wall-clock time; set its position in whole seconds.
pub fn timed(total: Duration, quiet: bool) -> ProgressBar {
    styled(
        ProgressBar::with_draw_target(Some(total.as_secs().max(1)), draw_target(quiet)),
        "{spinner} [{elapsed_precise}] [{bar:24}] {pos}/{len} s {msg}",
    )
}

/// A bar over `len` steps (runs, scenarios).
pub fn counted(len: u64, quiet: bool) -> ProgressBar {
    styled(
        ProgressBar::with_draw_target(Some(len.max(1)), draw_target(quiet)),
        "{spinner} [{elapsed_precise}] [{bar:24}] {pos}/{len} {msg}",
    )
}

/// A spinner with the elapsed time, for a phase that reports no progress of its own.
pub fn spinner(message: &str, quiet: bool) -> ProgressBar {
    let bar = styled(
        ProgressBar::with_draw_target(None, draw_target(quiet)),
        "{spinner} [{elapsed_precise}] {msg}",
    );
    bar.set_message(message.to_string());
    if !quiet {
        bar.enable_steady_tick(Duration::from_millis(250));
    }
    bar
}
