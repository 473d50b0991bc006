//! `metrics.jsonl`: one JSON object per step, `step` first, then the record's keys in order.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde_json::{Map, Number, Value};

use crate::orchestrator::metrics::{MetricValue, MetricsError, StepRecord};

pub struct JsonlWriter {
    path: PathBuf,
    out: BufWriter<File>,
}

/// The JSON line of a record (non-finite floats become `null`: JSON has no NaN).
pub fn to_line(rec: &StepRecord) -> String {
    let mut obj = Map::new();
    obj.insert("step".into(), Value::from(rec.step));
    for (key, value) in &rec.entries {
        let v = match value {
            MetricValue::Int(i) => Value::from(*i),
            MetricValue::Float(f) => Number::from_f64(*f)
                .map(Value::Number)
                .unwrap_or(Value::Null),
            MetricValue::Bool(b) => Value::Bool(*b),
            MetricValue::Text(t) => Value::String(t.clone()),
        };
        obj.insert(key.clone(), v);
    }
    Value::Object(obj).to_string()
}

impl JsonlWriter {
    /// Open `path` for appending (created if missing): a resumed run continues the file.
    pub fn append(path: &Path) -> Result<JsonlWriter, MetricsError> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|source| MetricsError::Io {
                path: path.to_owned(),
                source,
            })?;
        Ok(JsonlWriter {
            path: path.to_owned(),
            out: BufWriter::new(file),
        })
    }

    /// Written and flushed per step, so a crash keeps every finished step.
    pub fn write(&mut self, rec: &StepRecord) -> Result<(), MetricsError> {
        let io = |source| MetricsError::Io {
            path: self.path.clone(),
            source,
        };
        writeln!(self.out, "{}", to_line(rec)).map_err(io)?;
        self.out.flush().map_err(|source| MetricsError::Io {
            path: self.path.clone(),
            source,
        })
    }

    pub fn flush(&mut self) -> Result<(), MetricsError> {
        self.out.flush().map_err(|source| MetricsError::Io {
            path: self.path.clone(),
            source,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_has_step_first_and_typed_values() {
        let mut rec = StepRecord::new(3);
        rec.float("time/step", 0.5);
        rec.int("sync/bytes", 10);
        rec.flag("sync/verified", true);
        rec.text("sync/kind", "patch");
        rec.float("bad", f64::NAN);
        assert_eq!(
            to_line(&rec),
            r#"{"step":3,"time/step":0.5,"sync/bytes":10,"sync/verified":true,"sync/kind":"patch","bad":null}"#
        );
    }
}
