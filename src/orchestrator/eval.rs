//! Evaluation on the rollout workers (`runner.val_check_interval`, `runner.only_eval`): each rollout plays one
//! deterministic episode per env of its share of `env.eval` with the weights it holds, and the orchestrator
//! pools the reports into `eval/*` metrics, with `eval/version` the weight version evaluated.

use crate::orchestrator::metrics::StepRecord;

/// Whether an evaluation is due once `steps_done` trainer steps of `total` are complete (RLinf: every
/// `val_check_interval` steps and at the end of training; `<= 0`: never).
pub fn due(val_check_interval: i64, steps_done: u64, total: u64) -> bool {
    val_check_interval > 0
        && (steps_done.is_multiple_of(val_check_interval as u64) || steps_done == total)
}

/// The `Evaluated` reports of one evaluation, pooled.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EvalTally {
    pub reports: u32,
    pub version_min: u64,
    pub version_max: u64,
    pub episodes: u64,
    return_sum: f64,
    success_sum: f64,
    len_sum: f64,
}

impl EvalTally {
    /// Add one rollout's report (means over its `episodes`).
    pub fn add(
        &mut self,
        version: u64,
        episodes: u64,
        mean_return: f64,
        success_rate: f64,
        episode_len: f64,
    ) {
        if self.reports == 0 {
            (self.version_min, self.version_max) = (version, version);
        }
        self.version_min = self.version_min.min(version);
        self.version_max = self.version_max.max(version);
        self.reports += 1;
        let n = episodes as f64;
        self.episodes += episodes;
        self.return_sum += mean_return * n;
        self.success_sum += success_rate * n;
        self.len_sum += episode_len * n;
    }

    /// `eval/version` (the oldest when rollouts held different versions, with `eval/version_max` then),
    /// `eval/episodes`, and the means `eval/return`, `eval/success_rate`, `eval/episode_len` when there were
    /// episodes (the synthetic workload has none).
    pub fn record(&self, rec: &mut StepRecord) {
        rec.int("eval/version", self.version_min as i64);
        if self.version_max != self.version_min {
            rec.int("eval/version_max", self.version_max as i64);
        }
        rec.int("eval/episodes", self.episodes as i64);
        if self.episodes > 0 {
            let n = self.episodes as f64;
            rec.float("eval/return", self.return_sum / n);
            rec.float("eval/success_rate", self.success_sum / n);
            rec.float("eval/episode_len", self.len_sum / n);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_pool_by_episodes_and_name_the_version() {
        let mut t = EvalTally::default();
        t.add(7, 4, -2.0, 0.5, 10.0);
        t.add(7, 12, -1.0, 1.0, 6.0);
        let mut rec = StepRecord::new(3);
        t.record(&mut rec);
        assert_eq!(rec.get_f64("eval/version"), Some(7.0));
        assert_eq!(rec.get("eval/version_max"), None);
        assert_eq!(rec.get_f64("eval/episodes"), Some(16.0));
        assert_eq!(rec.get_f64("eval/return"), Some(-1.25));
        assert_eq!(rec.get_f64("eval/success_rate"), Some(0.875));
        assert_eq!(rec.get_f64("eval/episode_len"), Some(7.0));
        t.add(9, 0, 0.0, 0.0, 0.0);
        let mut rec = StepRecord::new(3);
        t.record(&mut rec);
        assert_eq!(
            (rec.get_f64("eval/version"), rec.get_f64("eval/version_max")),
            (Some(7.0), Some(9.0))
        );
        let mut none = StepRecord::new(0);
        let mut empty = EvalTally::default();
        empty.add(2, 0, 0.0, 0.0, 0.0);
        empty.record(&mut none);
        assert_eq!(none.get("eval/return"), None);
    }

    #[test]
    fn due_every_interval_and_at_the_end() {
        let steps: Vec<u64> = (1..=25).filter(|s| due(10, *s, 25)).collect();
        assert_eq!(steps, [10, 20, 25]);
        assert!(!due(-1, 10, 10) && !due(0, 10, 10));
    }
}
