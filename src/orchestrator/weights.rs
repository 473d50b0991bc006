//! The orchestrator's side of weight sync: bootstrap, blocking syncs, and verification of the state
//! checksums rollouts report against the trainer's (`runner.verify_sync`).

use std::collections::BTreeMap;
use std::time::Instant;

use crate::orchestrator::OrchestratorError;
use crate::orchestrator::metrics::StepRecord;
use crate::orchestrator::supervisor::{Supervisor, WorkerId};
use crate::protocol::messages::{Command, Report, SyncStats};

/// Matches trainer and rollout checksums per version, whichever report arrives first.
#[derive(Debug, Default)]
pub struct Verifier {
    enabled: bool,
    expected: BTreeMap<u64, u64>,
    waiting: Vec<(WorkerId, u64, u64)>,
    pub checked: u64,
}

impl Verifier {
    pub fn new(enabled: bool) -> Verifier {
        Verifier {
            enabled,
            ..Verifier::default()
        }
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    fn compare(
        &mut self,
        id: WorkerId,
        version: u64,
        got: u64,
        expected: u64,
    ) -> Result<(), OrchestratorError> {
        if got != expected {
            return Err(OrchestratorError::VerifyFailed {
                worker: id.to_string(),
                version,
                got,
                expected,
            });
        }
        self.checked += 1;
        Ok(())
    }

    pub fn trainer(&mut self, version: u64, checksum: u64) -> Result<(), OrchestratorError> {
        if !self.enabled {
            return Ok(());
        }
        self.expected.insert(version, checksum);
        // Old versions cannot be reported any more once a newer one is known to every rollout; keep a few.
        while self.expected.len() > 64 {
            self.expected.pop_first();
        }
        let (now, later): (Vec<_>, Vec<_>) =
            self.waiting.drain(..).partition(|(_, v, _)| *v == version);
        self.waiting = later;
        for (id, v, got) in now {
            self.compare(id, v, got, checksum)?;
        }
        Ok(())
    }

    pub fn rollout(
        &mut self,
        id: WorkerId,
        version: u64,
        checksum: u64,
    ) -> Result<(), OrchestratorError> {
        if !self.enabled {
            return Ok(());
        }
        match self.expected.get(&version).copied() {
            Some(expected) => self.compare(id, version, checksum, expected),
            None => {
                self.waiting.push((id, version, checksum));
                Ok(())
            }
        }
    }

    /// Whether every rollout report received so far has been matched.
    pub fn all_matched(&self) -> bool {
        self.enabled && self.waiting.is_empty()
    }
}

/// One completed weight transfer as the loops record it.
#[derive(Debug, Clone)]
pub struct SyncOutcome {
    pub stats: SyncStats,
    /// Wall time from the command until every required report arrived.
    pub seconds: f64,
    pub verified: bool,
}

impl SyncOutcome {
    pub fn record(&self, rec: &mut StepRecord) {
        rec.int("sync/version", self.stats.version as i64);
        rec.text("sync/kind", &self.stats.kind);
        rec.int("sync/bytes", self.stats.payload_bytes as i64);
        rec.int("sync/changed", self.stats.changed as i64);
        rec.int("sync/state_bytes", self.stats.state_bytes as i64);
        rec.float("sync/compression_ratio", self.stats.compression_ratio);
        rec.flag("sync/verified", self.verified);
    }
}

fn unexpected(id: WorkerId, report: &Report) -> OrchestratorError {
    OrchestratorError::Unexpected {
        worker: id.to_string(),
        report: format!("{report:?}"),
    }
}

/// Wait for the trainer's `Synced` and every rollout's `Applied` of one transfer.
async fn collect(
    sup: &mut Supervisor,
    verifier: &mut Verifier,
    started: Instant,
) -> Result<SyncOutcome, OrchestratorError> {
    let rollouts = sup.rollouts();
    let mut stats = None;
    let mut applied = 0;
    while stats.is_none() || applied < rollouts {
        let waiting = if stats.is_none() {
            "the trainer's sync"
        } else {
            "rollouts to apply weights"
        };
        let (id, frame) = sup.recv(waiting).await?;
        match frame.header {
            Report::Synced {
                stats: s, checksum, ..
            } if id == WorkerId::TRAINER && stats.is_none() => {
                verifier.trainer(s.version, checksum)?;
                stats = Some(s);
            }
            Report::Applied {
                version, checksum, ..
            } if id != WorkerId::TRAINER => {
                verifier.rollout(id, version, checksum)?;
                applied += 1;
            }
            other => return Err(unexpected(id, &other)),
        }
    }
    let stats = stats.unwrap_or_default();
    let verified = verifier.all_matched();
    Ok(SyncOutcome {
        stats,
        seconds: started.elapsed().as_secs_f64(),
        verified,
    })
}

/// Initial bootstrap (always blocking): every rollout holds version 0 when this returns.
pub async fn bootstrap(
    sup: &mut Supervisor,
    verifier: &mut Verifier,
) -> Result<SyncOutcome, OrchestratorError> {
    let started = Instant::now();
    sup.begin_step();
    sup.send(WorkerId::TRAINER, &Command::InitWeights, &[])
        .await?;
    sup.send_rollouts(&Command::InitWeights).await?;
    collect(sup, verifier, started).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verifier_matches_in_any_order() {
        let mut v = Verifier::new(true);
        v.rollout(WorkerId::rollout(0), 1, 0xAA).unwrap();
        assert!(!v.all_matched());
        v.trainer(1, 0xAA).unwrap();
        v.rollout(WorkerId::rollout(1), 1, 0xAA).unwrap();
        assert!(v.all_matched());
        assert_eq!(v.checked, 2);
    }

    #[test]
    fn verifier_names_the_mismatching_worker() {
        let mut v = Verifier::new(true);
        v.trainer(2, 1).unwrap();
        let err = v
            .rollout(WorkerId::rollout(3), 2, 9)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("rollout-3") && err.contains("version 2"),
            "{err}"
        );
        let mut v = Verifier::new(true);
        v.rollout(WorkerId::rollout(1), 5, 9).unwrap();
        assert!(
            v.trainer(5, 1)
                .unwrap_err()
                .to_string()
                .contains("rollout-1")
        );
    }

    #[test]
    fn disabled_verifier_never_claims_verification() {
        let mut v = Verifier::new(false);
        v.trainer(1, 1).unwrap();
        v.rollout(WorkerId::rollout(0), 1, 2).unwrap();
        assert!(!v.all_matched());
    }
}
