//! `metrics.csv` (`runner.logger.logger_backends: [csv]`): a header of `step` and every metric seen so far, one
//! row per step, flushed per step.
//!
//! Metrics can first appear late (`eval/*` at the first eval step), so a new key extends the header: the file's
//! first line is rewritten with the new column at the end, and rows written before it are one field short,
//! which CSV readers (pandas, Python's `csv.DictReader`) read as empty. Values: integers and floats as
//! written by Rust's shortest round-trip formatting, booleans `true`/`false`, NaN or infinite floats empty,
//! text quoted when it holds a comma, quote or line break. A resumed run appends to an existing file and keeps
//! its columns.

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use crate::orchestrator::metrics::{MetricValue, MetricsError, StepRecord};
use rlsync_core::atomic_file::{Access, AtomicFile};

pub struct CsvWriter {
    path: PathBuf,
    columns: Vec<String>,
}

fn field(text: &str) -> String {
    if text.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", text.replace('"', "\"\""))
    } else {
        text.to_owned()
    }
}

fn value(v: &MetricValue) -> String {
    match v {
        MetricValue::Int(i) => i.to_string(),
        MetricValue::Float(f) if f.is_finite() => f.to_string(),
        MetricValue::Float(_) => String::new(),
        MetricValue::Bool(b) => b.to_string(),
        MetricValue::Text(t) => field(t),
    }
}

/// Split one header line into its column names (names never hold line breaks).
fn parse_header(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match (c, quoted) {
            ('"', true) if chars.peek() == Some(&'"') => {
                chars.next();
                cur.push('"');
            }
            ('"', _) => quoted = !quoted,
            (',', false) => out.push(std::mem::take(&mut cur)),
            (c, _) => cur.push(c),
        }
    }
    out.push(cur);
    out
}

impl CsvWriter {
    /// Open `path` for appending, taking its columns from an existing header.
    pub fn append(path: &Path) -> Result<CsvWriter, MetricsError> {
        let io = |source| MetricsError::Io {
            path: path.to_owned(),
            source,
        };
        let columns = match File::open(path) {
            Ok(file) => {
                let mut first = String::new();
                BufReader::new(file).read_line(&mut first).map_err(io)?;
                let first = first.trim_end_matches(['\n', '\r']);
                if first.is_empty() {
                    Vec::new()
                } else {
                    parse_header(first)
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(io(e)),
        };
        Ok(CsvWriter {
            path: path.to_owned(),
            columns,
        })
    }

    fn io(&self) -> impl Fn(std::io::Error) -> MetricsError + '_ {
        move |source| MetricsError::Io {
            path: self.path.clone(),
            source,
        }
    }

    /// Write the header line `columns` in place of the file's first line (through a temporary file).
    fn rewrite_header(&self) -> Result<(), MetricsError> {
        let header = self
            .columns
            .iter()
            .map(|c| field(c))
            .collect::<Vec<_>>()
            .join(",");
        let old = match std::fs::read_to_string(&self.path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err((self.io())(e)),
        };
        let rows = old.split_once('\n').map(|(_, rest)| rest).unwrap_or("");
        let mut file = AtomicFile::create(&self.path, Access::Shared).map_err(self.io())?;
        file.file()
            .write_all(format!("{header}\n{rows}").as_bytes())
            .map_err(self.io())?;
        file.commit().map_err(self.io())
    }

    /// Append the row of `rec` (extending the header first when it has new metrics).
    pub fn write(&mut self, rec: &StepRecord) -> Result<(), MetricsError> {
        let before = self.columns.len();
        if self.columns.is_empty() {
            self.columns.push("step".into());
        }
        for (key, _) in &rec.entries {
            if !self.columns.iter().any(|c| c == key) {
                self.columns.push(key.clone());
            }
        }
        if self.columns.len() != before {
            self.rewrite_header()?;
        }
        let row: Vec<String> = self
            .columns
            .iter()
            .map(|c| match c.as_str() {
                "step" => rec.step.to_string(),
                key => rec.get(key).map(value).unwrap_or_default(),
            })
            .collect();
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(&self.path)
            .map_err(self.io())?;
        writeln!(file, "{}", row.join(",")).map_err(self.io())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn late_metrics_extend_the_header_and_a_resume_keeps_the_columns() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("metrics.csv");
        let mut w = CsvWriter::append(&path).unwrap();
        let mut a = StepRecord::new(0);
        a.float("loss", 0.5);
        a.flag("sync/verified", true);
        w.write(&a).unwrap();
        let mut b = StepRecord::new(1);
        b.float("loss", f64::NAN);
        b.text("note", "a,\"b\"");
        b.int("eval/episodes", 4);
        w.write(&b).unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "step,loss,sync/verified,note,eval/episodes\n0,0.5,true\n1,,,\"a,\"\"b\"\"\",4\n"
        );
        // A resumed run appends under the same columns.
        let mut again = CsvWriter::append(&path).unwrap();
        let mut c = StepRecord::new(1);
        c.int("eval/episodes", 5);
        again.write(&c).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.ends_with("\n1,,,,5\n"), "{text}");
        assert_eq!(text.lines().count(), 4);
        assert_eq!(
            parse_header("step,\"x,\"\"y\"\"\",z"),
            ["step", "x,\"y\"", "z"]
        );
    }
}
