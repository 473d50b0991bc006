//! The console: a progress bar with an ETA when stderr is a terminal, else a progress line every few seconds
//! (step, return, sync time, env steps/s, ETA, a warning once), and worker log lines printed around either.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

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
            Some(bar) => bar.suspend(|| hydra_compose::stdio::err(format_args!("{line}\n"))),
            None => hydra_compose::stdio::err(format_args!("{line}\n")),
        }
    }
}

/// Seconds between two progress lines when stderr is not a terminal.
pub const LINE_EVERY: Duration = Duration::from_secs(5);

/// Progress lines for logs and pipes: the first step, then at most one line per [`LINE_EVERY`], and the last.
#[derive(Debug)]
pub struct Lines {
    total: u64,
    first: u64,
    /// When the loop started: set back from the first record by its `time/step`, so that start-up and the init
    /// bootstrap count in neither the rate nor the ETA.
    started: Instant,
    timed: bool,
    last: Option<Instant>,
    env_steps: f64,
    /// A warning the next line carries (and is printed for, due or not), then drops.
    warning: Option<String>,
}

impl Lines {
    pub fn new(total: u64, first: u64, started: Instant) -> Lines {
        Lines {
            total,
            first,
            started,
            timed: false,
            last: None,
            env_steps: 0.0,
            warning: None,
        }
    }

    /// Put `warning` on the next line (printed with the next record, due or not).
    pub fn warn(&mut self, warning: String) {
        self.warning = Some(warning);
    }

    /// The line to print for `rec` at `now`, if one is due.
    pub fn update_at(&mut self, rec: &StepRecord, now: Instant) -> Option<String> {
        if !self.timed {
            self.timed = true;
            let step = rec
                .get_f64("time/step")
                .filter(|s| s.is_finite() && *s >= 0.0)
                .map_or(Duration::ZERO, Duration::from_secs_f64);
            self.started = now.checked_sub(step).unwrap_or(now);
        }
        self.env_steps += rec.get_f64("rollout/env_steps").unwrap_or(0.0);
        let done = rec.step + 1;
        let due = match self.last {
            None => true,
            Some(last) => {
                now.duration_since(last) >= LINE_EVERY
                    || done >= self.total
                    || self.warning.is_some()
            }
        };
        if !due {
            return None;
        }
        self.last = Some(now);
        let elapsed = now.duration_since(self.started).as_secs_f64();
        let steps_run = done.saturating_sub(self.first).max(1) as f64;
        let left = self.total.saturating_sub(done) as f64;
        let eta = format_duration(elapsed / steps_run * left);
        let rate = if elapsed > 0.0 {
            self.env_steps / elapsed
        } else {
            0.0
        };
        let ret = rec.get_f64("rollout/return").unwrap_or(f64::NAN);
        let sync_ms = rec.get_f64("time/sync_weights").unwrap_or(0.0) * 1e3;
        let warning = self
            .warning
            .take()
            .map(|w| format!(" | {w}"))
            .unwrap_or_default();
        Some(format!(
            "step {done}/{} | return {ret:.3} | sync {sync_ms:.1} ms | {rate:.0} env steps/s | ETA {eta}{warning}",
            self.total
        ))
    }
}

/// `1:02:03`, `4:05`.
pub fn format_duration(secs: f64) -> String {
    let s = if secs.is_finite() && secs > 0.0 {
        secs.round() as u64
    } else {
        0
    };
    match s / 3600 {
        0 => format!("{}:{:02}", s / 60, s % 60),
        h => format!("{h}:{:02}:{:02}", (s / 60) % 60, s % 60),
    }
}

/// The step progress bar (stderr a terminal) or the progress lines (anything else).
pub struct Progress {
    bar: Option<ProgressBar>,
    lines: Option<Lines>,
    /// The bar's warning, shown after its message from the step it came on.
    warning: Option<String>,
}

impl Progress {
    /// Progress over the steps `first..total`, and the console that prints around it.
    pub fn new(total: u64, first: u64) -> (Progress, Console) {
        if !std::io::stderr().is_terminal() {
            let lines = Lines::new(total, first, Instant::now());
            let progress = Progress {
                bar: None,
                lines: Some(lines),
                warning: None,
            };
            return (progress, Console::default());
        }
        let bar = ProgressBar::new(total);
        bar.set_position(first);
        bar.reset_eta();
        let style = ProgressStyle::with_template(
            "{bar:30} step {pos}/{len} {msg} [{elapsed_precise}, ETA {eta}]",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar());
        bar.set_style(style);
        (
            Progress {
                bar: Some(bar.clone()),
                lines: None,
                warning: None,
            },
            Console { bar: Some(bar) },
        )
    }

    /// Show `warning` once: on the next progress line, or on the bar from now on.
    pub fn warn(&mut self, warning: String) {
        if let Some(lines) = &mut self.lines {
            lines.warn(warning.clone());
        }
        self.warning = Some(warning);
    }

    pub fn update(&mut self, rec: &StepRecord) {
        if let Some(bar) = &self.bar {
            let msg = match &self.warning {
                Some(w) => format!("{} | {w}", message(rec)),
                None => message(rec),
            };
            bar.set_message(msg);
            bar.set_position(rec.step + 1);
        }
        if let Some(line) = self
            .lines
            .as_mut()
            .and_then(|l| l.update_at(rec, Instant::now()))
        {
            tracing::info!("{line}");
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
    fn lines_come_at_the_first_step_every_few_seconds_and_at_the_end() {
        let t0 = Instant::now();
        // Made 30 s before the loop: start-up and the bootstrap count in neither the rate nor the ETA.
        let mut lines = Lines::new(10, 2, t0.checked_sub(Duration::from_secs(30)).unwrap_or(t0));
        let rec = |step: u64| {
            let mut r = StepRecord::new(step);
            r.float("rollout/return", -1.5);
            r.float("time/sync_weights", 0.004);
            r.float("time/step", 2.0);
            r.int("rollout/env_steps", 100);
            r
        };
        let at = |s: u64| t0 + Duration::from_secs(s);
        let first = lines
            .update_at(&rec(2), at(2))
            .expect("the first step prints");
        assert_eq!(
            first,
            "step 3/10 | return -1.500 | sync 4.0 ms | 50 env steps/s | ETA 0:14"
        );
        assert_eq!(lines.update_at(&rec(3), at(3)), None);
        let later = lines.update_at(&rec(4), at(7)).expect("5 s later");
        // 3 steps in 7 s, 5 left; 300 env steps in 7 s.
        assert!(
            later.starts_with("step 5/10 |") && later.ends_with("| 43 env steps/s | ETA 0:12"),
            "{later}"
        );
        assert!(
            lines.update_at(&rec(9), at(8)).is_some(),
            "the last step prints"
        );
        assert_eq!(format_duration(3725.0), "1:02:05");
    }

    #[test]
    fn a_warning_rides_on_the_next_line_once_even_when_no_line_is_due() {
        let t0 = Instant::now();
        let mut lines = Lines::new(100, 0, t0);
        let rec = |step: u64| StepRecord::new(step);
        assert!(lines.update_at(&rec(0), t0).is_some());
        assert_eq!(lines.update_at(&rec(1), t0), None);
        lines.warn("STALE SYNC? clip 0.40 > 0.30 over 10 steps (see log)".into());
        let warned = lines
            .update_at(&rec(2), t0)
            .expect("the warning's line is due");
        assert!(
            warned.ends_with("| STALE SYNC? clip 0.40 > 0.30 over 10 steps (see log)"),
            "{warned}"
        );
        // Once: the next line is back to its schedule and its form.
        assert_eq!(lines.update_at(&rec(3), t0), None);
        let later = lines
            .update_at(&rec(4), t0 + LINE_EVERY)
            .expect("due again");
        assert!(!later.contains("STALE"), "{later}");
    }

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
