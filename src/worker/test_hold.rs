//! The test-only knob `RLSYNC_TEST_HOLD`: hold a worker at a stage until a test kills it.
//!
//! A plain environment variable read once at the worker's start, not the `fail` crate's failpoints compiled
//! out of the shipped build: a Cargo feature that only the tests turn on would compile the app and the learner
//! a second time in `make test` (measured on a shared 2-core machine: 179 s wall, 100 s CPU).

use std::path::PathBuf;

use rlsync_core::protocol::messages::Role;

use crate::worker::WorkerError;

/// A test-only knob, for integration tests that kill a rollout at an exact moment (never set it in a real
/// run): `RLSYNC_TEST_HOLD=<role>-<rank>@<stage>[*<n>]:<file>` makes the first `n` (default 1) processes of
/// that worker to reach `stage` each create the first of `<file>`, `<file>.2`, … `<file>.<n>` that does not
/// exist, write its pid and a newline there, and wait until it is killed; later processes (once all `n` files
/// exist) go on. Stages: `hello` (before its hello: its supervisor, a node
/// agent's too, is still waiting for it), `handshake` (connected to its weight channel, before it sent its
/// metadata: the trainer's init bootstrap waits on it), `bootstrap` (the weight channel's plan received,
/// before the init bootstrap's payloads), `catchup` (a rejoin's catch-up announced, before its replay or full transfer). A
/// malformed value is a usage error of the worker.
pub const TEST_HOLD_VAR: &str = "RLSYNC_TEST_HOLD";

/// Where [`TEST_HOLD_VAR`] holds a worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TestHold {
    stage: HoldStage,
    /// Processes held, one file each.
    times: u32,
    file: PathBuf,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HoldStage {
    Hello,
    Handshake,
    Bootstrap,
    CatchUp,
}

impl TestHold {
    /// This worker's hold from the knob's value `spec` (`None`: unset, or another worker's).
    pub(crate) fn parse(
        spec: Option<&str>,
        role: Role,
        rank: u32,
    ) -> Result<Option<TestHold>, WorkerError> {
        let Some(spec) = spec else {
            return Ok(None);
        };
        let usage = || WorkerError::Usage {
            reason: format!(
                "{TEST_HOLD_VAR}={spec}: expected <role>-<rank>@<hello|handshake|bootstrap|catchup>[*<n>]:<file> (a test knob)"
            ),
        };
        let (who, rest) = spec.split_once('@').ok_or_else(usage)?;
        let (stage, file) = rest.split_once(':').ok_or_else(usage)?;
        let (stage, times) = match stage.split_once('*') {
            Some((stage, n)) => (
                stage,
                n.parse::<u32>().ok().filter(|n| *n > 0).ok_or_else(usage)?,
            ),
            None => (stage, 1),
        };
        let stage = match stage {
            "hello" => HoldStage::Hello,
            "handshake" => HoldStage::Handshake,
            "bootstrap" => HoldStage::Bootstrap,
            "catchup" => HoldStage::CatchUp,
            _ => return Err(usage()),
        };
        if file.is_empty() {
            return Err(usage());
        }
        if who != format!("{}-{rank}", role.name()) {
            return Ok(None);
        }
        Ok(Some(TestHold {
            stage,
            times,
            file: PathBuf::from(file),
        }))
    }

    /// Hold here if this is the stage and no earlier process of this worker held (it never returns then).
    pub(crate) async fn reach(&self, stage: HoldStage) {
        if self.stage != stage {
            return;
        }
        // The first file no predecessor made; none left (or none can be made): go on.
        let mut created = None;
        for n in 1..=self.times {
            let path = match n {
                1 => self.file.clone(),
                n => PathBuf::from(format!("{}.{n}", self.file.display())),
            };
            let made = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path);
            match made {
                Ok(file) => {
                    created = Some(file);
                    break;
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(_) => return,
            }
        }
        let Some(mut file) = created else {
            return;
        };
        use std::io::Write as _;
        let _ = writeln!(file, "{}", std::process::id());
        drop(file);
        tracing::warn!("{TEST_HOLD_VAR}: held at {stage:?} until killed (a test knob)");
        std::future::pending::<()>().await;
    }

    /// The syncer's hold for this stage, when it is one of the weight channel's.
    pub(crate) fn for_syncer(
        &self,
    ) -> Option<(rlsync_core::syncer::HoldPoint, rlsync_core::syncer::Hold)> {
        let point = match self.stage {
            HoldStage::Hello | HoldStage::Handshake => return None,
            HoldStage::Bootstrap => rlsync_core::syncer::HoldPoint::Bootstrap,
            HoldStage::CatchUp => rlsync_core::syncer::HoldPoint::CatchUp,
        };
        let (me, stage) = (self.clone(), self.stage);
        Some((point, Box::pin(async move { me.reach(stage).await })))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_test_hold_knob_names_one_worker_and_refuses_malformed_values() {
        let parse = |spec: &str, rank| TestHold::parse(Some(spec), Role::Rollout, rank);
        assert_eq!(parse("rollout-1@catchup:/tmp/h", 2).unwrap(), None);
        assert_eq!(TestHold::parse(None, Role::Rollout, 1).unwrap(), None);
        assert_eq!(
            parse("rollout-1@bootstrap:/tmp/h", 1).unwrap(),
            Some(TestHold {
                stage: HoldStage::Bootstrap,
                times: 1,
                file: PathBuf::from("/tmp/h"),
            })
        );
        assert_eq!(
            parse("rollout-1@hello*2:/tmp/h", 1)
                .unwrap()
                .map(|h| h.times),
            Some(2)
        );
        for bad in [
            "rollout-1",
            "rollout-1@later:/tmp/h",
            "rollout-1@hello:",
            "x@hello",
            "rollout-1@hello*0:/tmp/h",
        ] {
            let err = parse(bad, 1).unwrap_err().to_string();
            assert!(err.contains(TEST_HOLD_VAR) && err.contains(bad), "{err}");
        }
    }
}
