//! The final summary of a run: totals and means over the step records, rendered as a table.

use std::path::PathBuf;

use crate::orchestrator::metrics::StepRecord;

/// Totals of a finished (or stopped) run.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RunSummary {
    pub steps: u64,
    pub final_version: u64,
    pub env_steps: u64,
    pub wall_s: f64,
    pub env_steps_per_s: f64,
    pub syncs: u64,
    pub sync_bytes: u64,
    pub mean_sync_ms: f64,
    pub mean_step_ms: f64,
    pub mean_staleness: f64,
    pub max_staleness: u64,
    pub discarded: u64,
    pub verified_syncs: u64,
    pub trainer_idle: f64,
    pub rollout_idle: f64,
    /// Learning curves' ends, for the metrics of [`LEARNING_KEYS`] the run reported (none for the synthetic
    /// workload): the mean over the last [`LEARNING_WINDOW`] steps, or the last value when none of them has it.
    pub learning: Vec<(&'static str, f64)>,
    /// Where the run's outputs are (set by the orchestrator; shown at the end of the table when present).
    pub run_dir: Option<PathBuf>,
    pub metrics_file: Option<PathBuf>,
    pub tensorboard_dir: Option<PathBuf>,
    /// The last checkpoint written (`<run_dir>/checkpoints/global_step_<n>`).
    pub checkpoint: Option<PathBuf>,
}

/// Metrics whose final values the summary shows, and over how many of the last steps each is averaged (single
/// steps are noisy: few episodes end in one step).
const LEARNING_KEYS: [&str; 4] = [
    "env/success_rate",
    "env/return",
    "eval/success_rate",
    "eval/return",
];
const LEARNING_WINDOW: usize = 10;

fn mean(values: impl Iterator<Item = f64>) -> f64 {
    let (sum, n) = values.fold((0.0, 0u64), |(s, n), v| (s + v, n + 1));
    if n == 0 { 0.0 } else { sum / n as f64 }
}

impl RunSummary {
    /// Summarise `records`; `wall_s` is the loop's wall time and `env_steps` the env steps trained on.
    pub fn from_records(records: &[StepRecord], wall_s: f64, env_steps: u64) -> RunSummary {
        let synced: Vec<&StepRecord> = records
            .iter()
            .filter(|r| r.get("sync/kind").is_some())
            .collect();
        let get = |r: &StepRecord, k: &str| r.get_f64(k).unwrap_or(0.0);
        RunSummary {
            steps: records.len() as u64,
            final_version: records
                .last()
                .map(|r| get(r, "actor/current_version") as u64)
                .unwrap_or(0),
            env_steps,
            wall_s,
            env_steps_per_s: if wall_s > 0.0 {
                env_steps as f64 / wall_s
            } else {
                0.0
            },
            syncs: synced.len() as u64,
            sync_bytes: synced.iter().map(|r| get(r, "sync/bytes") as u64).sum(),
            mean_sync_ms: mean(synced.iter().map(|r| get(r, "time/sync_weights") * 1e3)),
            mean_step_ms: mean(records.iter().map(|r| get(r, "time/step") * 1e3)),
            mean_staleness: mean(records.iter().map(|r| get(r, "staleness/mean"))),
            max_staleness: records
                .iter()
                .map(|r| get(r, "staleness/max") as u64)
                .max()
                .unwrap_or(0),
            discarded: records
                .iter()
                .map(|r| get(r, "rollout/discarded_unused_trajs") as u64)
                .sum(),
            verified_syncs: synced
                .iter()
                .filter(|r| r.get_f64("sync/verified") == Some(1.0))
                .count() as u64,
            trainer_idle: mean(records.iter().map(|r| get(r, "trainer/idle_ratio"))),
            rollout_idle: mean(records.iter().map(|r| get(r, "rollout/idle_ratio"))),
            learning: LEARNING_KEYS
                .into_iter()
                .filter_map(|key| {
                    let tail = &records[records.len().saturating_sub(LEARNING_WINDOW)..];
                    let recent: Vec<f64> = tail.iter().filter_map(|r| r.get_f64(key)).collect();
                    if recent.is_empty() {
                        records
                            .iter()
                            .rev()
                            .find_map(|r| r.get_f64(key))
                            .map(|v| (key, v))
                    } else {
                        Some((key, mean(recent.into_iter())))
                    }
                })
                .collect(),
            ..RunSummary::default()
        }
    }

    /// A two-column table for the console.
    pub fn table(&self) -> String {
        let mut rows = vec![
            ("steps".to_owned(), self.steps.to_string()),
            (
                "final weight version".to_owned(),
                self.final_version.to_string(),
            ),
            ("env steps trained".to_owned(), self.env_steps.to_string()),
            ("wall time".to_owned(), format!("{:.2} s", self.wall_s)),
            (
                "throughput".to_owned(),
                format!("{:.1} env steps/s", self.env_steps_per_s),
            ),
            (
                "mean step time".to_owned(),
                format!("{:.2} ms", self.mean_step_ms),
            ),
            (
                "syncs (verified)".to_owned(),
                format!("{} ({})", self.syncs, self.verified_syncs),
            ),
            (
                "bytes synced".to_owned(),
                format!("{:.3} MB", self.sync_bytes as f64 / 1e6),
            ),
            (
                "mean sync time".to_owned(),
                format!("{:.2} ms", self.mean_sync_ms),
            ),
            (
                "staleness mean / max".to_owned(),
                format!("{:.2} / {}", self.mean_staleness, self.max_staleness),
            ),
            (
                "discarded trajectories".to_owned(),
                self.discarded.to_string(),
            ),
            (
                "idle trainer / rollouts".to_owned(),
                format!(
                    "{:.0}% / {:.0}%",
                    self.trainer_idle * 100.0,
                    self.rollout_idle * 100.0
                ),
            ),
        ];
        rows.extend(
            self.learning
                .iter()
                .map(|(k, v)| (format!("final {k}"), format!("{v:.3}"))),
        );
        let paths = [
            ("run dir", &self.run_dir),
            ("metrics", &self.metrics_file),
            ("tensorboard", &self.tensorboard_dir),
            ("last checkpoint", &self.checkpoint),
        ];
        for (name, path) in paths {
            if let Some(path) = path {
                rows.push((name.to_owned(), path.display().to_string()));
            }
        }
        let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
        let mut out = String::from("run summary\n");
        for (k, v) in rows {
            out.push_str(&format!("  {k:<width$}  {v}\n"));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_totals_over_records() {
        let mut a = StepRecord::new(0);
        a.text("sync/kind", "init");
        a.int("sync/bytes", 100);
        a.flag("sync/verified", true);
        a.float("time/sync_weights", 0.002);
        a.float("time/step", 0.01);
        a.int("actor/current_version", 1);
        let mut b = StepRecord::new(1);
        b.float("time/step", 0.03);
        b.int("rollout/discarded_unused_trajs", 2);
        b.int("actor/current_version", 2);
        b.int("staleness/max", 1);
        let s = RunSummary::from_records(&[a, b], 2.0, 100);
        assert_eq!(
            (
                s.steps,
                s.syncs,
                s.sync_bytes,
                s.verified_syncs,
                s.discarded
            ),
            (2, 1, 100, 1, 2)
        );
        assert_eq!((s.final_version, s.max_staleness), (2, 1));
        assert!((s.mean_step_ms - 20.0).abs() < 1e-9);
        assert!((s.env_steps_per_s - 50.0).abs() < 1e-9);
        assert!(s.table().contains("discarded trajectories"));
        assert!(s.learning.is_empty() && !s.table().contains("success"));
        assert!(!s.table().contains("last checkpoint"));
        let with_paths = RunSummary {
            run_dir: Some("/runs/a".into()),
            checkpoint: Some("/runs/a/checkpoints/global_step_2".into()),
            ..s
        };
        let table = with_paths.table();
        assert!(
            table.contains("run dir") && table.contains("/runs/a\n"),
            "{table}"
        );
        assert!(
            table.contains("last checkpoint")
                && table.contains("/runs/a/checkpoints/global_step_2"),
            "{table}"
        );
        assert!(!table.contains("tensorboard"), "{table}");
    }

    #[test]
    fn summary_shows_the_end_of_the_learning_curves() {
        let records: Vec<StepRecord> = (0..15)
            .map(|i| {
                let mut r = StepRecord::new(i);
                // success_rate is reported by every step, eval only by an early one.
                r.float("env/success_rate", i as f64 / 10.0);
                if i == 4 {
                    r.float("eval/return", -3.0);
                }
                r
            })
            .collect();
        let s = RunSummary::from_records(&records, 1.0, 10);
        // Steps 5..=14: mean 0.95.
        let keys: Vec<&str> = s.learning.iter().map(|(k, _)| *k).collect();
        assert_eq!(keys, ["env/success_rate", "eval/return"]);
        assert!(
            (s.learning[0].1 - 0.95).abs() < 1e-9 && s.learning[1].1 == -3.0,
            "{:?}",
            s.learning
        );
        let table = s.table();
        let row = |key: &str| {
            table
                .lines()
                .find(|l| l.trim_start().starts_with(key))
                .map(|l| l.split_whitespace().last().unwrap_or("").to_owned())
        };
        assert_eq!(
            row("final env/success_rate").as_deref(),
            Some("0.950"),
            "{table}"
        );
        assert_eq!(
            row("final eval/return").as_deref(),
            Some("-3.000"),
            "{table}"
        );
    }
}
