//! The stale-sync canary: `actor/clip_fraction` above a threshold over a window of steps warns once, naming the knobs.
//!
//! PPO's clip fraction is healthy at 10–26 %; sustained at 30 % or more it says the rollouts act with weights
//! too old for the trainer's updates (the lesson rlsync was designed from). "Sustained" is the mean over the
//! last `window` steps: with `runner.weight_sync_interval` k > 1 the fraction saws (low right after a sync, high
//! before the next), so a stale run's steps are not all above the line, while its mean is. Built-in trainers
//! report the key, a Python trainer does by returning `clip_fraction` from `train()` (logged as
//! `actor/clip_fraction`); the canary reads the step records either way. Records without the key (an
//! evaluation's own row) or with a non-finite value are skipped.

use std::collections::VecDeque;

use crate::orchestrator::metrics::StepRecord;

/// The metric the canary watches.
pub const KEY: &str = "actor/clip_fraction";

/// Watches the step records for a clip fraction that stays high.
#[derive(Debug, Clone, PartialEq)]
pub struct StaleSyncCanary {
    threshold: f64,
    window: u32,
    /// The last `window` clip fractions.
    recent: VecDeque<f64>,
    warned: bool,
}

/// The one warning: what was seen, and what to turn.
#[derive(Debug, Clone, PartialEq)]
pub struct StaleSyncWarning {
    /// The step whose record completed the window.
    pub step: u64,
    pub threshold: f64,
    pub window: u32,
    /// The mean clip fraction over the window.
    pub mean: f64,
}

impl StaleSyncWarning {
    /// The log line: the evidence and the knobs `runner.weight_sync_interval` and
    /// `algorithm.staleness_threshold`.
    pub fn log_line(&self) -> String {
        format!(
            "stale weights? {KEY} averaged {:.3} over the last {} steps, above {:.2} (up to step {}; healthy PPO \
             clips 10-26 %): the rollouts act with weights too old for the trainer's updates; sync more often \
             (lower runner.weight_sync_interval) or accept less stale data (lower algorithm.staleness_threshold, \
             train_async); algorithm.stale_clip_fraction / algorithm.stale_clip_window set this warning",
            self.mean, self.window, self.threshold, self.step
        )
    }

    /// The progress line's short form.
    pub fn short(&self) -> String {
        format!(
            "STALE SYNC? clip {:.2} > {:.2} over {} steps (see log)",
            self.mean, self.threshold, self.window
        )
    }
}

impl StaleSyncCanary {
    /// A canary that warns once the mean of `KEY` over the last `window` steps is above `threshold`.
    pub fn new(threshold: f64, window: std::num::NonZeroU32) -> StaleSyncCanary {
        StaleSyncCanary {
            threshold,
            window: window.get(),
            recent: VecDeque::new(),
            warned: false,
        }
    }

    /// Look at one step's record; `Some` exactly once, on the first step whose window's mean is above the
    /// threshold.
    pub fn observe(&mut self, rec: &StepRecord) -> Option<StaleSyncWarning> {
        if self.warned {
            return None;
        }
        let clip = rec.get_f64(KEY).filter(|c| c.is_finite())?;
        if self.recent.len() == self.window as usize {
            self.recent.pop_front();
        }
        self.recent.push_back(clip);
        if self.recent.len() < self.window as usize {
            return None;
        }
        let mean = self.recent.iter().sum::<f64>() / f64::from(self.window);
        if mean <= self.threshold {
            return None;
        }
        self.warned = true;
        Some(StaleSyncWarning {
            step: rec.step,
            threshold: self.threshold,
            window: self.window,
            mean,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::num::NonZeroU32;

    fn rec(step: u64, clip: Option<f64>) -> StepRecord {
        let mut r = StepRecord::new(step);
        if let Some(c) = clip {
            r.float(KEY, c);
        }
        r
    }

    fn warnings(clips: &[Option<f64>], threshold: f64, window: u32) -> Vec<StaleSyncWarning> {
        let mut canary = StaleSyncCanary::new(threshold, NonZeroU32::new(window).unwrap());
        clips
            .iter()
            .enumerate()
            .filter_map(|(i, c)| canary.observe(&rec(i as u64, *c)))
            .collect()
    }

    #[test]
    fn a_clip_fraction_that_stays_high_warns_once_naming_the_knobs() {
        let clips: Vec<Option<f64>> = (0..25).map(|_| Some(0.4)).collect();
        let got = warnings(&clips, 0.3, 10);
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!(got[0].step, 9);
        assert!((got[0].mean - 0.4).abs() < 1e-12);
        let line = got[0].log_line();
        for want in [
            "actor/clip_fraction averaged 0.400 over the last 10 steps, above 0.30",
            "runner.weight_sync_interval",
            "algorithm.staleness_threshold",
        ] {
            assert!(line.contains(want), "{want}: {line}");
        }
        assert!(
            got[0].short().contains("clip 0.40 > 0.30 over 10 steps"),
            "{}",
            got[0].short()
        );
    }

    /// One sync every 8 steps: low right after a sync, rising until the next.
    fn sawtooth(low: f64, rise: f64, steps: usize) -> Vec<Option<f64>> {
        (0..steps)
            .map(|i| Some(low + rise * (i % 8) as f64))
            .collect()
    }

    #[test]
    fn a_stale_sawtooth_warns_though_no_ten_steps_in_a_row_are_above() {
        // 0.2 .. 0.55, mean 0.375: at most 5 steps in a row above 0.3, the mean well above it.
        let clips = sawtooth(0.2, 0.05, 40);
        let got = warnings(&clips, 0.3, 10);
        assert_eq!(got.len(), 1, "{got:?}");
        assert!(got[0].mean > 0.3 && got[0].step >= 9, "{got:?}");
    }

    #[test]
    fn a_healthy_clip_fraction_does_not_warn() {
        // Healthy: 10-26 %.
        let healthy: Vec<Option<f64>> =
            (0..50).map(|i| Some(0.1 + 0.16 * (i % 2) as f64)).collect();
        assert!(warnings(&healthy, 0.3, 10).is_empty());
        // A sawtooth whose peaks pass 0.3 but whose mean (0.225) does not.
        assert!(warnings(&sawtooth(0.05, 0.05, 80), 0.3, 10).is_empty());
        // Nine steps are not a window.
        assert!(warnings(&[Some(0.9); 9], 0.3, 10).is_empty());
        // A run without the key (the synthetic workload) never warns.
        assert!(warnings(&[None; 30], 0.3, 10).is_empty());
        // A non-finite clip fraction is skipped, not counted.
        assert!(warnings(&[Some(f64::NAN); 30], 0.3, 10).is_empty());
    }

    #[test]
    fn rows_without_the_key_neither_count_nor_break_the_window() {
        let mut clips = vec![Some(0.5); 5];
        clips.push(None);
        clips.extend(vec![Some(0.5); 5]);
        let got = warnings(&clips, 0.3, 10);
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].step, 10);
    }
}
