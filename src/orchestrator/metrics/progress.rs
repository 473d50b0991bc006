//! The console: a progress bar (only when stdout is a terminal) and worker log lines printed around it.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressStyle};

use crate::orchestrator::metrics::StepRecord;

/// Prints lines without tearing the progress bar; cheap to clone into log pumps.
#[derive(Clone, Default)]
pub struct Console {
    bar: Option<ProgressBar>,
}

impl Console {
    pub fn println(&self, line: &str) {
        match &self.bar {
            Some(bar) => bar.suspend(|| crate::stdio::err(format_args!("{line}\n"))),
            None => crate::stdio::err(format_args!("{line}\n")),
        }
    }
}

/// The step progress bar, or nothing when stdout is not a terminal.
pub struct Progress {
    bar: Option<ProgressBar>,
}

impl Progress {
    /// A bar over `steps` when stdout is a terminal, with the console that prints around it.
    pub fn new(steps: u64) -> (Progress, Console) {
        if !std::io::stdout().is_terminal() {
            return (Progress { bar: None }, Console::default());
        }
        let bar = ProgressBar::new(steps);
        let style =
            ProgressStyle::with_template("{bar:30} step {pos}/{len} {msg} [{elapsed_precise}]")
                .unwrap_or_else(|_| ProgressStyle::default_bar());
        bar.set_style(style);
        (
            Progress {
                bar: Some(bar.clone()),
            },
            Console { bar: Some(bar) },
        )
    }

    pub fn update(&mut self, rec: &StepRecord) {
        if let Some(bar) = &self.bar {
            bar.set_message(message(rec));
            bar.set_position(rec.step + 1);
        }
    }

    pub fn finish(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
    }
}

/// `return 0.12 | sync 3.1 ms 1.2 MB | stale 0.50`.
pub fn message(rec: &StepRecord) -> String {
    let ret = rec.get_f64("rollout/return").unwrap_or(f64::NAN);
    let sync_ms = rec
        .get_f64("time/sync_weights")
        .map(|s| s * 1e3)
        .unwrap_or(0.0);
    let mb = rec.get_f64("sync/bytes").unwrap_or(0.0) / 1e6;
    let stale = rec.get_f64("staleness/mean").unwrap_or(0.0);
    format!("return {ret:.3} | sync {sync_ms:.1} ms {mb:.2} MB | stale {stale:.2}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_shows_return_sync_and_staleness() {
        let mut rec = StepRecord::new(0);
        rec.float("rollout/return", 0.5);
        rec.float("time/sync_weights", 0.002);
        rec.int("sync/bytes", 3_000_000);
        rec.float("staleness/mean", 0.25);
        assert_eq!(
            message(&rec),
            "return 0.500 | sync 2.0 ms 3.00 MB | stale 0.25"
        );
    }
}
