//! The final summary of a run: totals and means over the step records, rendered as a table.

use std::path::PathBuf;

use crate::orchestrator::metrics::StepRecord;

/// Where a run's time went, each figure measured apart.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RunTimes {
    /// The job from start to end: the process's start (a multirun's later jobs: their own start) to the summary.
    pub wall_s: f64,
    /// Before the workers: composing and checking the config (the Python workers' interpreter probe included),
    /// the run's files.
    pub before_s: f64,
    /// The workers' start: spawned until every one completed its handshake and built its workload (the model, a
    /// Python worker's imports and entry): ready to sync.
    pub startup_s: f64,
    /// The init bootstrap, from then on: every rollout gets the trainer's full weights (handshake, transfer,
    /// verification).
    pub bootstrap_s: f64,
    /// The training loop alone, from after the bootstrap to its last step.
    pub loop_s: f64,
    /// After the loop: the workers stopped, the metrics flushed.
    pub shutdown_s: f64,
}

/// Totals of a finished (or stopped) run.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RunSummary {
    pub steps: u64,
    pub final_version: u64,
    pub env_steps: u64,
    pub times: RunTimes,
    /// The bootstrap's payload bytes (0 when the loop's records do not carry it).
    pub bootstrap_bytes: u64,
    /// Env steps trained per second of the loop ([`RunTimes::loop_s`]): start-up and bootstrap excluded.
    pub loop_env_steps_per_s: f64,
    /// Per-step syncs (the init bootstrap is not one of them), their bytes and how many were verified.
    pub syncs: u64,
    pub sync_bytes: u64,
    pub verified_syncs: u64,
    /// Per-step sync times (`time/sync_weights` of the steps that synced; the bootstrap excluded), in ms.
    pub sync_ms_mean: f64,
    pub sync_ms_p50: f64,
    pub sync_ms_max: f64,
    /// Medians over the per-step syncs that have them, in ms: the trainer's handling of a sync
    /// (`time/sync_trainer`) and the slowest install it waited for (`time/sync_apply_max`).
    pub trainer_ms_p50: Option<f64>,
    pub install_ms_p50: Option<f64>,
    /// Where the slowest installs went: the median of each phase (`time/sync_apply_<phase>`) the records
    /// have, in ms, in [`INSTALL_PHASES`] order.
    pub install_phases_ms_p50: Vec<(&'static str, f64)>,
    pub mean_step_ms: f64,
    pub mean_staleness: f64,
    pub max_staleness: u64,
    pub discarded: u64,
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

/// The phases of a rollout's install the records may break `time/sync_apply_max` into.
const INSTALL_PHASES: [&str; 5] = ["wait", "decode", "write", "load", "checksum"];

fn mean(values: impl Iterator<Item = f64>) -> f64 {
    let (sum, n) = values.fold((0.0, 0u64), |(s, n), v| (s + v, n + 1));
    if n == 0 { 0.0 } else { sum / n as f64 }
}

/// The median of `values` (the mean of the middle two for an even count; 0 for none).
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    match n {
        0 => 0.0,
        _ if n % 2 == 1 => values[n / 2],
        _ => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

impl RunSummary {
    /// Summarise `records`; `times` says where the run's time went and `env_steps` counts the env steps trained
    /// on. A record whose `sync/kind` is `init` carries the bootstrap: it is no per-step sync.
    pub fn from_records(records: &[StepRecord], times: RunTimes, env_steps: u64) -> RunSummary {
        let is_init = |r: &StepRecord| matches!(r.get("sync/kind"), Some(super::MetricValue::Text(k)) if k == "init");
        let synced: Vec<&StepRecord> = records
            .iter()
            .filter(|r| r.get("sync/kind").is_some() && !is_init(r))
            .collect();
        let get = |r: &StepRecord, k: &str| r.get_f64(k).unwrap_or(0.0);
        let sync_ms: Vec<f64> = synced
            .iter()
            .map(|r| get(r, "time/sync_weights") * 1e3)
            .collect();
        // The median in ms of `key` over the per-step syncs that have it (`None`: none has).
        let p50 = |key: &str| {
            let ms: Vec<f64> = synced
                .iter()
                .filter_map(|r| r.get_f64(key))
                .map(|s| s * 1e3)
                .collect();
            (!ms.is_empty()).then(|| median(ms))
        };
        RunSummary {
            steps: records.len() as u64,
            final_version: records
                .last()
                .map(|r| get(r, "actor/current_version") as u64)
                .unwrap_or(0),
            env_steps,
            times,
            bootstrap_bytes: records
                .iter()
                .find(|r| is_init(r))
                .map_or(0, |r| get(r, "sync/bytes") as u64),
            loop_env_steps_per_s: if times.loop_s > 0.0 {
                env_steps as f64 / times.loop_s
            } else {
                0.0
            },
            syncs: synced.len() as u64,
            sync_bytes: synced.iter().map(|r| get(r, "sync/bytes") as u64).sum(),
            sync_ms_mean: mean(sync_ms.iter().copied()),
            sync_ms_max: sync_ms.iter().copied().fold(0.0, f64::max),
            sync_ms_p50: median(sync_ms),
            trainer_ms_p50: p50("time/sync_trainer"),
            install_ms_p50: p50("time/sync_apply_max"),
            install_phases_ms_p50: INSTALL_PHASES
                .into_iter()
                .filter_map(|phase| Some((phase, p50(&format!("time/sync_apply_{phase}"))?)))
                .collect(),
            mean_step_ms: mean(records.iter().map(|r| get(r, "time/step") * 1e3)),
            verified_syncs: synced
                .iter()
                .filter(|r| r.get_f64("sync/verified") == Some(1.0))
                .count() as u64,
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
            (
                "wall time (start to end)".to_owned(),
                format!("{:.2} s", self.times.wall_s),
            ),
            (
                "config and checks".to_owned(),
                format!("{:.2} s", self.times.before_s),
            ),
            (
                "workers' start-up".to_owned(),
                format!("{:.2} s", self.times.startup_s),
            ),
            (
                "init bootstrap".to_owned(),
                format!(
                    "{:.2} s, {:.3} MB",
                    self.times.bootstrap_s,
                    self.bootstrap_bytes as f64 / 1e6
                ),
            ),
            (
                "loop time".to_owned(),
                format!("{:.2} s", self.times.loop_s),
            ),
            (
                "shutdown".to_owned(),
                format!("{:.2} s", self.times.shutdown_s),
            ),
            (
                "loop throughput".to_owned(),
                format!("{:.1} env steps/s", self.loop_env_steps_per_s),
            ),
            (
                "mean step time".to_owned(),
                format!("{:.2} ms", self.mean_step_ms),
            ),
            (
                "syncs after the bootstrap (verified)".to_owned(),
                format!("{} ({})", self.syncs, self.verified_syncs),
            ),
            (
                "bytes synced after the bootstrap".to_owned(),
                format!("{:.3} MB", self.sync_bytes as f64 / 1e6),
            ),
            (
                "sync time mean / p50 / max".to_owned(),
                format!(
                    "{:.2} / {:.2} / {:.2} ms",
                    self.sync_ms_mean, self.sync_ms_p50, self.sync_ms_max
                ),
            ),
        ];
        if let (Some(trainer), Some(install)) = (self.trainer_ms_p50, self.install_ms_p50) {
            rows.push((
                "sync p50: trainer / slowest install".to_owned(),
                format!("{trainer:.2} / {install:.2} ms"),
            ));
        }
        if !self.install_phases_ms_p50.is_empty() {
            let phases: Vec<String> = self
                .install_phases_ms_p50
                .iter()
                .map(|(phase, ms)| format!("{phase} {ms:.2}"))
                .collect();
            rows.push((
                "slowest install p50, by phase".to_owned(),
                format!("{} ms", phases.join(", ")),
            ));
        }
        rows.extend([
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
        ]);
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

    fn times(wall_s: f64, loop_s: f64) -> RunTimes {
        RunTimes {
            wall_s,
            before_s: 0.25,
            startup_s: 1.0,
            bootstrap_s: 0.5,
            loop_s,
            shutdown_s: 0.125,
        }
    }

    #[test]
    fn summary_totals_over_records() {
        let mut a = StepRecord::new(0);
        a.text("sync/kind", "init");
        a.int("sync/bytes", 100);
        a.flag("sync/verified", true);
        a.float("time/init_weights", 0.5);
        a.float("time/sync_weights", 0.0);
        a.float("time/step", 0.01);
        a.int("actor/current_version", 1);
        let mut b = StepRecord::new(1);
        b.float("time/step", 0.03);
        b.int("rollout/discarded_unused_trajs", 2);
        b.int("actor/current_version", 2);
        b.int("staleness/max", 1);
        b.text("sync/kind", "patch");
        b.int("sync/bytes", 7);
        b.flag("sync/verified", true);
        b.float("time/sync_weights", 0.004);
        b.float("time/sync_trainer", 0.001);
        b.float("time/sync_apply_max", 0.003);
        b.float("time/sync_apply_wait", 0.002);
        b.float("time/sync_apply_write", 0.0005);
        let s = RunSummary::from_records(&[a, b], times(5.0, 2.0), 100);
        // The init bootstrap is no per-step sync: one sync of 7 bytes, the bootstrap's 100 apart.
        assert_eq!(
            (
                s.steps,
                s.syncs,
                s.sync_bytes,
                s.verified_syncs,
                s.discarded,
                s.bootstrap_bytes
            ),
            (2, 1, 7, 1, 2, 100)
        );
        assert_eq!((s.final_version, s.max_staleness), (2, 1));
        assert!((s.mean_step_ms - 20.0).abs() < 1e-9);
        // Throughput over the loop's 2 s, not the job's 5 s.
        assert!((s.loop_env_steps_per_s - 50.0).abs() < 1e-9);
        assert!((s.sync_ms_mean - 4.0).abs() < 1e-9 && (s.sync_ms_max - 4.0).abs() < 1e-9);
        let table = s.table();
        assert!(table.contains("discarded trajectories"));
        for (row, value) in [
            ("wall time (start to end)", "5.00 s"),
            ("config and checks", "0.25 s"),
            ("workers' start-up", "1.00 s"),
            ("shutdown", "0.12 s"),
            ("init bootstrap", "0.50 s, 0.000 MB"),
            ("loop time", "2.00 s"),
            ("loop throughput", "50.0 env steps/s"),
            ("sync time mean / p50 / max", "4.00 / 4.00 / 4.00 ms"),
            ("sync p50: trainer / slowest install", "1.00 / 3.00 ms"),
            // Only the phases the records have, in their order.
            ("slowest install p50, by phase", "wait 2.00, write 0.50 ms"),
        ] {
            assert!(
                table
                    .lines()
                    .any(|l| l.trim_start().starts_with(row) && l.ends_with(value)),
                "{row}: {value} in\n{table}"
            );
        }
        assert!(s.learning.is_empty() && !table.contains("success"));
        assert!(!table.contains("last checkpoint"));
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
    fn sync_statistics_are_per_step_and_leave_the_bootstrap_out() {
        // A 3.9 s bootstrap must not be averaged into the per-step syncs (the 131.69 ms "mean").
        let mut records = Vec::new();
        let mut init = StepRecord::new(0);
        init.text("sync/kind", "init");
        init.float("time/init_weights", 3.9);
        init.float("time/sync_weights", 0.0);
        records.push(init);
        for (i, ms) in [(1, 2.0), (2, 9.0), (3, 3.0), (4, 4.0)] {
            let mut r = StepRecord::new(i);
            r.text("sync/kind", "patch");
            r.float("time/sync_weights", ms / 1e3);
            records.push(r);
        }
        // A step without a sync is no sync of 0 ms.
        records.push(StepRecord::new(5));
        let s = RunSummary::from_records(&records, times(5.7, 0.05), 0);
        assert_eq!(s.syncs, 4);
        assert!((s.sync_ms_mean - 4.5).abs() < 1e-9, "{s:?}");
        assert!((s.sync_ms_p50 - 3.5).abs() < 1e-9, "{s:?}");
        assert!((s.sync_ms_max - 9.0).abs() < 1e-9, "{s:?}");
        // Records without the phases' keys (a run with background syncs) show no such rows.
        assert_eq!((s.trainer_ms_p50, s.install_ms_p50), (None, None));
        let table = s.table();
        assert!(!table.contains("slowest install"), "{table}");
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(Vec::new()), 0.0);
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
        let s = RunSummary::from_records(&records, times(2.0, 1.0), 10);
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
