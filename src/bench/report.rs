//! bench_sync output: per-step records, the summary of medians, and their JSON-lines / table printing.

use std::time::Duration;

use serde_json::json;

use crate::config::schema::{OutputFormat, SyncerKind, TransportKind, UpdateKind};
use rlsync_core::tensor::DType;

/// One measured step.
#[derive(Debug, Clone)]
pub struct StepRecord {
    pub step: u64,
    pub changed: u64,
    pub payload_bytes: u64,
    pub build: Duration,
    pub encode: Duration,
    pub transfer: Duration,
    pub decode: Duration,
    pub apply: Duration,
    pub total: Duration,
    pub verified: bool,
    pub state_bytes: u64,
}

/// Facts about the run that are not per step.
#[derive(Debug, Clone)]
pub(crate) struct RunFacts {
    pub syncer: SyncerKind,
    pub params: u64,
    pub dtype: DType,
    pub synced_elems: u64,
    pub memcpy_ms: f64,
    pub scan_ms: f64,
    pub threads: usize,
    pub receivers: usize,
    pub transport: TransportKind,
    pub update: UpdateKind,
}

/// Medians over steps (`verified`: every step verified).
#[derive(Debug, Clone)]
pub struct BenchSummary {
    pub syncer: &'static str,
    pub params: u64,
    pub dtype: DType,
    pub state_bytes: u64,
    pub changed: f64,
    pub density: f64,
    pub payload_bytes: f64,
    pub bytes_per_changed: f64,
    pub build_ms: f64,
    pub encode_ms: f64,
    pub transfer_ms: f64,
    pub decode_ms: f64,
    pub apply_ms: f64,
    pub total_ms: f64,
    pub memcpy_ms: f64,
    /// One read of the synced state and a same-size copy on the syncer's threads: a patch build's floor.
    pub scan_ms: f64,
    pub threads: usize,
    pub verified: bool,
    pub receivers: usize,
    pub transport: &'static str,
    pub update: &'static str,
    pub steps: usize,
}

pub(crate) fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn per_changed(payload: u64, changed: u64) -> f64 {
    if changed == 0 {
        0.0
    } else {
        payload as f64 / changed as f64
    }
}

impl BenchSummary {
    pub(crate) fn from_steps(steps: &[StepRecord], f: RunFacts) -> BenchSummary {
        let med =
            |g: &dyn Fn(&StepRecord) -> f64| median(&mut steps.iter().map(g).collect::<Vec<_>>());
        let changed = med(&|s| s.changed as f64);
        BenchSummary {
            syncer: match f.syncer {
                SyncerKind::Patch => "patch",
                SyncerKind::Bucket => "bucket",
            },
            params: f.params,
            dtype: f.dtype,
            state_bytes: steps.first().map_or(0, |s| s.state_bytes),
            changed,
            density: if f.synced_elems == 0 {
                0.0
            } else {
                changed / f.synced_elems as f64
            },
            payload_bytes: med(&|s| s.payload_bytes as f64),
            bytes_per_changed: med(&|s| per_changed(s.payload_bytes, s.changed)),
            build_ms: med(&|s| ms(s.build)),
            encode_ms: med(&|s| ms(s.encode)),
            transfer_ms: med(&|s| ms(s.transfer)),
            decode_ms: med(&|s| ms(s.decode)),
            apply_ms: med(&|s| ms(s.apply)),
            total_ms: med(&|s| ms(s.total)),
            memcpy_ms: f.memcpy_ms,
            scan_ms: f.scan_ms,
            threads: f.threads,
            verified: !steps.is_empty() && steps.iter().all(|s| s.verified),
            receivers: f.receivers,
            transport: match f.transport {
                TransportKind::Inproc => "inproc",
                TransportKind::Shm => "shm",
            },
            update: match f.update {
                UpdateKind::Adam => "adam",
                UpdateKind::Density => "density",
            },
            steps: steps.len(),
        }
    }

    pub(crate) fn to_json(&self) -> serde_json::Value {
        json!({
            "summary": true,
            "syncer": self.syncer,
            "params": self.params,
            "dtype": self.dtype.name(),
            "state_bytes": self.state_bytes,
            "changed": self.changed,
            "density": self.density,
            "payload_bytes": self.payload_bytes,
            "bytes_per_changed": self.bytes_per_changed,
            "build_ms": self.build_ms,
            "encode_ms": self.encode_ms,
            "transfer_ms": self.transfer_ms,
            "decode_ms": self.decode_ms,
            "apply_ms": self.apply_ms,
            "total_ms": self.total_ms,
            "memcpy_ms": self.memcpy_ms,
            "scan_ms": self.scan_ms,
            "threads": self.threads,
            "verified": self.verified,
            "receivers": self.receivers,
            "transport": self.transport,
            "update": self.update,
            "steps": self.steps,
            "note": "receivers are threads of this process; times are medians over steps",
        })
    }
}

fn step_json(s: &StepRecord) -> serde_json::Value {
    json!({
        "step": s.step,
        "changed": s.changed,
        "payload_bytes": s.payload_bytes,
        "bytes_per_changed": per_changed(s.payload_bytes, s.changed),
        "build_ms": ms(s.build),
        "encode_ms": ms(s.encode),
        "transfer_ms": ms(s.transfer),
        "decode_ms": ms(s.decode),
        "apply_ms": ms(s.apply),
        "total_ms": ms(s.total),
        "verified": s.verified,
    })
}

/// Prints steps and the summary in the configured format.
pub(crate) struct Printer {
    format: OutputFormat,
}

impl Printer {
    pub fn new(format: OutputFormat) -> Printer {
        if format == OutputFormat::Table {
            hydra_compose::stdio::out(format_args!(
                "{:>5} {:>12} {:>14} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8}\n",
                "step",
                "changed",
                "payload_B",
                "B/chg",
                "build",
                "encode",
                "transfer",
                "decode",
                "apply",
                "total",
                "verified"
            ));
        }
        Printer { format }
    }

    pub fn step(&self, s: &StepRecord) {
        match self.format {
            OutputFormat::Json => hydra_compose::stdio::out(format_args!("{}\n", step_json(s))),
            OutputFormat::Table => hydra_compose::stdio::out(format_args!(
                "{:>5} {:>12} {:>14} {:>9.3} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>8}\n",
                s.step,
                s.changed,
                s.payload_bytes,
                per_changed(s.payload_bytes, s.changed),
                ms(s.build),
                ms(s.encode),
                ms(s.transfer),
                ms(s.decode),
                ms(s.apply),
                ms(s.total),
                s.verified
            )),
        }
    }

    pub fn summary(&self, s: &BenchSummary) {
        match self.format {
            OutputFormat::Json => hydra_compose::stdio::out(format_args!("{}\n", s.to_json())),
            OutputFormat::Table => {
                hydra_compose::stdio::out(format_args!(
                    "median {:>12.0} {:>14.0} {:>9.3} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>8}\n",
                    s.changed,
                    s.payload_bytes,
                    s.bytes_per_changed,
                    s.build_ms,
                    s.encode_ms,
                    s.transfer_ms,
                    s.decode_ms,
                    s.apply_ms,
                    s.total_ms,
                    s.verified
                ));
                hydra_compose::stdio::out(format_args!(
                    "syncer={} params={} dtype={} state_bytes={} density={:.4} memcpy_ms={:.2} scan_ms={:.2} threads={} receivers={} transport={} update={} (times in ms; receivers are threads of this process)\n",
                    s.syncer,
                    s.params,
                    s.dtype,
                    s.state_bytes,
                    s.density,
                    s.memcpy_ms,
                    s.scan_ms,
                    s.threads,
                    s.receivers,
                    s.transport,
                    s.update
                ));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(&mut []), 0.0);
    }
}
