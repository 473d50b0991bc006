//! Per-step metrics: the record the loops fill, staleness statistics, and the sink that fans a record out to
//! `metrics.jsonl`, TensorBoard event files, the progress bar and the stale-sync canary.

pub mod canary;
pub mod csv;
pub mod jsonl;
pub mod progress;
pub mod summary;
pub mod tensorboard;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::config::schema::LoggerBackend;
use progress::Progress;

#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("cannot write {path}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// One metric value.
#[derive(Debug, Clone, PartialEq)]
pub enum MetricValue {
    Int(i64),
    Float(f64),
    Bool(bool),
    Text(String),
}

impl MetricValue {
    /// The value as a scalar for TensorBoard (text has none).
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            MetricValue::Int(v) => Some(*v as f64),
            MetricValue::Float(v) => Some(*v),
            MetricValue::Bool(v) => Some(f64::from(u8::from(*v))),
            MetricValue::Text(_) => None,
        }
    }
}

/// The metrics of one step, in insertion order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepRecord {
    pub step: u64,
    pub entries: Vec<(String, MetricValue)>,
}

impl StepRecord {
    pub fn new(step: u64) -> StepRecord {
        StepRecord {
            step,
            entries: Vec::new(),
        }
    }
    pub fn float(&mut self, key: &str, value: f64) {
        self.entries
            .push((key.to_owned(), MetricValue::Float(value)));
    }
    pub fn int(&mut self, key: &str, value: i64) {
        self.entries.push((key.to_owned(), MetricValue::Int(value)));
    }
    pub fn flag(&mut self, key: &str, value: bool) {
        self.entries
            .push((key.to_owned(), MetricValue::Bool(value)));
    }
    pub fn text(&mut self, key: &str, value: &str) {
        self.entries
            .push((key.to_owned(), MetricValue::Text(value.to_owned())));
    }
    pub fn get(&self, key: &str) -> Option<&MetricValue> {
        self.entries.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }
    pub fn get_f64(&self, key: &str) -> Option<f64> {
        self.get(key).and_then(MetricValue::as_f64)
    }
}

/// Staleness of the data one train step consumed: lag = trainer version − version that produced a sample.
#[derive(Debug, Clone, PartialEq)]
pub struct Staleness {
    /// Share of env steps per lag.
    pub ratios: BTreeMap<u64, f64>,
    pub mean: f64,
    pub max: u64,
    /// Mean weight version of the trained data.
    pub average_version: f64,
}

/// `samples`: (version that produced the data, env steps); weights by env steps.
pub fn staleness(trainer_version: u64, samples: &[(u64, u64)]) -> Staleness {
    let total: u64 = samples.iter().map(|(_, n)| n).sum();
    let total_f = total.max(1) as f64;
    let mut counts: BTreeMap<u64, u64> = BTreeMap::new();
    let (mut lag_sum, mut version_sum, mut max) = (0.0, 0.0, 0);
    for (version, n) in samples {
        let lag = trainer_version.saturating_sub(*version);
        *counts.entry(lag).or_default() += n;
        lag_sum += (lag * n) as f64;
        version_sum += (*version as f64) * (*n as f64);
        if *n > 0 {
            max = max.max(lag);
        }
    }
    Staleness {
        ratios: counts
            .into_iter()
            .map(|(lag, n)| (lag, n as f64 / total_f))
            .collect(),
        mean: lag_sum / total_f,
        max,
        average_version: version_sum / total_f,
    }
}

impl Staleness {
    /// Add the staleness keys; lags `0..=up_to` are always present so columns are stable.
    pub fn record(&self, rec: &mut StepRecord, up_to: u64) {
        rec.float("actor/average_version", self.average_version);
        let last = self
            .ratios
            .keys()
            .next_back()
            .copied()
            .unwrap_or(0)
            .max(up_to);
        for lag in 0..=last {
            rec.float(
                &format!("rollout/data_staleness_{lag}/ratio"),
                self.ratios.get(&lag).copied().unwrap_or(0.0),
            );
        }
        rec.float("staleness/mean", self.mean);
        rec.int("staleness/max", self.max as i64);
    }
}

/// Where step records go.
pub struct MetricsSink {
    jsonl: jsonl::JsonlWriter,
    csv: Option<csv::CsvWriter>,
    tensorboard: Option<tensorboard::EventWriter>,
    progress: Progress,
    canary: Option<canary::StaleSyncCanary>,
    pub history: Vec<StepRecord>,
    pub metrics_file: PathBuf,
    pub tensorboard_dir: Option<PathBuf>,
}

impl MetricsSink {
    /// Open the backends of a run whose first step is `first_step` (non-zero when resumed). Files are appended
    /// to, never truncated; TensorBoard gets a new event file that starts with a session start at
    /// `first_step`, so TensorBoard drops the points an earlier run wrote from that step on.
    pub fn open(
        dir: &Path,
        backends: &[LoggerBackend],
        first_step: u64,
        progress: Progress,
    ) -> Result<MetricsSink, MetricsError> {
        std::fs::create_dir_all(dir).map_err(|source| MetricsError::Io {
            path: dir.to_owned(),
            source,
        })?;
        let metrics_file = dir.join("metrics.jsonl");
        let jsonl = jsonl::JsonlWriter::append(&metrics_file)?;
        let csv = match backends.contains(&LoggerBackend::Csv) {
            true => Some(csv::CsvWriter::append(&dir.join("metrics.csv"))?),
            false => None,
        };
        let tensorboard_dir = backends
            .contains(&LoggerBackend::Tensorboard)
            .then(|| dir.join("tensorboard"));
        let tensorboard = match &tensorboard_dir {
            Some(dir) => Some(tensorboard::EventWriter::create(dir, first_step)?),
            None => None,
        };
        Ok(MetricsSink {
            jsonl,
            csv,
            tensorboard,
            progress,
            canary: None,
            history: Vec::new(),
            metrics_file,
            tensorboard_dir,
        })
    }

    /// Watch the records with `canary` from now on: its one warning goes to the log and the progress line.
    pub fn watch(&mut self, canary: canary::StaleSyncCanary) {
        self.canary = Some(canary);
    }

    pub fn record(&mut self, rec: StepRecord) -> Result<(), MetricsError> {
        if let Some(warning) = self.canary.as_mut().and_then(|c| c.observe(&rec)) {
            tracing::warn!("{}", warning.log_line());
            self.progress.warn(warning.short());
        }
        self.jsonl.write(&rec)?;
        if let Some(csv) = &mut self.csv {
            csv.write(&rec)?;
        }
        if let Some(tb) = &mut self.tensorboard {
            tb.write(&rec)?;
        }
        self.progress.update(&rec);
        self.history.push(rec);
        Ok(())
    }

    /// Flush every backend (also on error paths, so what was measured is kept).
    pub fn finish(&mut self) -> Result<(), MetricsError> {
        self.progress.finish();
        self.jsonl.flush()?;
        if let Some(tb) = &mut self.tensorboard {
            tb.flush()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(
        trainer: u64,
        samples: &[(u64, u64)],
        ratios: &[(u64, f64)],
        mean: f64,
        max: u64,
        avg: f64,
    ) {
        let s = staleness(trainer, samples);
        assert_eq!(s.ratios, ratios.iter().copied().collect::<BTreeMap<_, _>>());
        assert!((s.mean - mean).abs() < 1e-12, "mean {} vs {mean}", s.mean);
        assert_eq!(s.max, max);
        assert!((s.average_version - avg).abs() < 1e-12);
    }

    #[test]
    fn staleness_is_weighted_by_env_steps() {
        check(5, &[(5, 10)], &[(0, 1.0)], 0.0, 0, 5.0);
        check(
            5,
            &[(5, 10), (4, 30)],
            &[(0, 0.25), (1, 0.75)],
            0.75,
            1,
            4.25,
        );
        check(
            3,
            &[(1, 1), (3, 1), (2, 2)],
            &[(0, 0.25), (1, 0.5), (2, 0.25)],
            1.0,
            2,
            2.0,
        );
        check(0, &[], &[], 0.0, 0, 0.0);
    }

    #[test]
    fn staleness_keys_cover_the_threshold() {
        let mut rec = StepRecord::new(0);
        staleness(2, &[(2, 4)]).record(&mut rec, 2);
        for key in [
            "rollout/data_staleness_0/ratio",
            "rollout/data_staleness_2/ratio",
            "staleness/max",
            "actor/average_version",
        ] {
            assert!(rec.get(key).is_some(), "{key} missing");
        }
        assert_eq!(rec.get_f64("rollout/data_staleness_0/ratio"), Some(1.0));
        assert_eq!(rec.get_f64("rollout/data_staleness_1/ratio"), Some(0.0));
    }
}
