//! Failure attribution: a failure names its first cause (the earliest worker that failed on its own, the peer
//! a worker blamed), a missed deadline names the workers that did not answer (stopped processes first), and
//! the words for how a worker died.
//!
//! Pure: the supervisor gathers what it knows of each worker (a [`Record`], whether its process is stopped)
//! and these functions decide whom to name and how.

use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;

use nix::sys::signal::Signal;
use tokio::time::Instant;

use super::WorkerId;

/// What the supervisor knows of one worker's failure and of its last exchange.
#[derive(Debug, Clone, Default)]
pub struct Record {
    /// The reason a worker gave in a `Failed` report (or the supervisor's own, for a worker it killed).
    pub failure: Option<String>,
    /// The peers that report blamed.
    pub blames: Vec<WorkerId>,
    /// When the supervisor first saw this worker fail (report, broken connection or exit).
    pub failed_at: Option<Instant>,
    /// When it was last sent a command, and last heard from (for naming who did not answer).
    pub last_sent: Option<Instant>,
    pub last_heard: Option<Instant>,
}

impl Record {
    /// Whether a command it was sent has not been answered yet.
    pub fn pending(&self) -> bool {
        self.last_sent
            .is_some_and(|s| self.last_heard.is_none_or(|h| h < s))
    }
}

/// The worker to name for a failure first seen on `first`: the earliest to fail on its own (blaming no peer);
/// when every failure blames a peer, the peer the earliest one blames (one of `workers`).
pub fn first_cause(workers: &[(WorkerId, &Record)], first: WorkerId) -> WorkerId {
    let failed = |own: bool| {
        workers
            .iter()
            .filter(|(_, r)| r.failed_at.is_some() && r.blames.is_empty() == own)
            .min_by_key(|(_, r)| r.failed_at)
    };
    if let Some((id, _)) = failed(true) {
        return *id;
    }
    failed(false)
        .and_then(|(_, r)| {
            r.blames
                .iter()
                .find(|b| workers.iter().any(|(id, _)| id == *b))
        })
        .copied()
        .unwrap_or(first)
}

/// One worker still running when a deadline passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Waited {
    pub id: WorkerId,
    pub pid: u32,
    /// Its process is stopped (SIGSTOP, a debugger).
    pub stopped: bool,
    /// A command it was sent is unanswered ([`Record::pending`]).
    pub pending: bool,
}

/// The workers that did not answer, for the error of a missed deadline: stopped processes first; else those
/// with a command outstanding; else every worker still running.
pub fn silent(alive: &[Waited]) -> String {
    let name = |w: &Waited| format!("{} (pid {})", w.id, w.pid);
    let stopped: Vec<String> = alive
        .iter()
        .filter(|w| w.stopped)
        .map(|w| format!("{} (pid {}, stopped)", w.id, w.pid))
        .collect();
    if !stopped.is_empty() {
        return stopped.join(", ");
    }
    let pending: Vec<String> = alive.iter().filter(|w| w.pending).map(name).collect();
    if !pending.is_empty() {
        return pending.join(", ");
    }
    alive.iter().map(name).collect::<Vec<_>>().join(", ")
}

/// Restartable rollouts that missed the step deadline (to be killed and restarted): stopped processes;
/// else, when the trainer owes no answer, those with a command outstanding.
pub fn late(rollouts: &[Waited], trainer_owes: bool) -> Vec<WorkerId> {
    let stopped: Vec<WorkerId> = rollouts
        .iter()
        .filter(|w| w.stopped)
        .map(|w| w.id)
        .collect();
    if !stopped.is_empty() || trainer_owes {
        return stopped;
    }
    rollouts
        .iter()
        .filter(|w| w.pending)
        .map(|w| w.id)
        .collect()
}

/// How a worker's process ended.
pub fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(sig)) => {
            let name = Signal::try_from(sig)
                .map(|s| s.as_str().to_owned())
                .unwrap_or_else(|_| format!("signal {sig}"));
            format!("was killed by {name}")
        }
        _ => "ended".to_owned(),
    }
}

/// How a restartable rollout died, for its restart's log line: `exited` when its process ended, else its
/// control connection closed; `failure`: what the supervisor knew of why.
pub fn death(exited: Option<ExitStatus>, failure: Option<&str>) -> String {
    match (exited, failure) {
        (Some(status), Some(why)) => format!("{} ({why})", describe(status)),
        (Some(status), None) => describe(status),
        (None, Some(why)) => format!("closed its control connection ({why})"),
        (None, None) => "closed its control connection".to_owned(),
    }
}

/// The worker a failed run names, as its error says it.
#[derive(Debug, Clone, Copy)]
pub struct Culprit<'a> {
    pub record: &'a Record,
    /// Its exit status, when its process ended.
    pub exited: Option<ExitStatus>,
    /// It runs on another node (its agent's words say how it died).
    pub remote: bool,
    /// Its process (on this host) is stopped.
    pub stopped: bool,
}

/// The error's `status` (how the culprit ended) and `message` (`: <its words>`, and `; <first> failed because
/// of it: …` when the failure was first seen on another worker, `first`).
pub fn culprit_words(culprit: Culprit<'_>, first: Option<(WorkerId, &Record)>) -> (String, String) {
    let record = culprit.record;
    // A worker of another node that died without an exit status (its connection broke first): its agent's
    // words say how.
    let remote_words = (culprit.remote && culprit.exited.is_none())
        .then(|| record.failure.clone())
        .flatten();
    let status = match (culprit.exited, &remote_words) {
        (Some(status), _) => describe(status),
        (None, Some(words)) => words.clone(),
        _ if record.failed_at.is_some() => "closed its control connection".to_owned(),
        _ if !culprit.remote && culprit.stopped => {
            "did not answer (the process is stopped)".to_owned()
        }
        _ => "did not answer".to_owned(),
    };
    let mut message = record
        .failure
        .clone()
        .filter(|_| remote_words.is_none())
        .map(|m| format!(": {m}"))
        .unwrap_or_default();
    if let Some((id, first)) = first {
        message.push_str(&format!(
            "; {id} failed because of it: {}",
            first.failure.as_deref().unwrap_or("its connection broke")
        ));
    }
    (status, message)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn failed(at: Instant, secs: u64, blames: &[WorkerId]) -> Record {
        Record {
            failed_at: Some(at + Duration::from_secs(secs)),
            blames: blames.to_vec(),
            ..Record::default()
        }
    }

    #[test]
    fn the_earliest_worker_that_failed_on_its_own_is_named() {
        let t0 = Instant::now();
        let (trainer, r0, r1) = (
            WorkerId::TRAINER,
            WorkerId::rollout(0),
            WorkerId::rollout(1),
        );
        // The trainer failed first, because of rollout-1; rollout-1 failed later on its own.
        let blamer = failed(t0, 0, &[r1]);
        let own = failed(t0, 2, &[]);
        let quiet = Record::default();
        let workers = [(trainer, &blamer), (r0, &quiet), (r1, &own)];
        assert_eq!(first_cause(&workers, trainer), r1);
        // Two on their own: the earlier.
        let earlier = failed(t0, 1, &[]);
        let workers = [(trainer, &blamer), (r0, &earlier), (r1, &own)];
        assert_eq!(first_cause(&workers, r1), r0);
    }

    #[test]
    fn when_every_failure_blames_a_peer_the_earliest_ones_peer_is_named() {
        let t0 = Instant::now();
        let (trainer, r0, r2) = (
            WorkerId::TRAINER,
            WorkerId::rollout(0),
            WorkerId::rollout(2),
        );
        let first = failed(t0, 0, &[WorkerId::rollout(9), r2]);
        let later = failed(t0, 1, &[trainer]);
        let quiet = Record::default();
        let workers = [(trainer, &first), (r0, &later), (r2, &quiet)];
        assert_eq!(first_cause(&workers, r0), r2, "rollout-9 is no worker here");
        // Nobody failed at all: the worker the failure was seen on.
        let workers = [(trainer, &quiet), (r0, &quiet)];
        assert_eq!(first_cause(&workers, r0), r0);
    }

    fn waited(id: WorkerId, stopped: bool, pending: bool) -> Waited {
        Waited {
            id,
            pid: 100 + id.rank,
            stopped,
            pending,
        }
    }

    #[test]
    fn a_missed_deadline_names_stopped_processes_first_then_the_unanswered() {
        let trainer = waited(WorkerId::TRAINER, false, true);
        let r1 = waited(WorkerId::rollout(1), false, false);
        let r2 = waited(WorkerId::rollout(2), true, false);
        assert_eq!(silent(&[trainer, r1, r2]), "rollout-2 (pid 102, stopped)");
        assert_eq!(silent(&[trainer, r1]), "trainer-0 (pid 100)");
        let idle = waited(WorkerId::TRAINER, false, false);
        assert_eq!(
            silent(&[idle, r1]),
            "trainer-0 (pid 100), rollout-1 (pid 101)"
        );
        assert_eq!(silent(&[]), "");
    }

    #[test]
    fn late_rollouts_are_stopped_ones_or_unanswered_ones_when_the_trainer_owes_nothing() {
        let r0 = waited(WorkerId::rollout(0), false, true);
        let r1 = waited(WorkerId::rollout(1), true, false);
        let r2 = waited(WorkerId::rollout(2), false, false);
        assert_eq!(late(&[r0, r1, r2], true), vec![WorkerId::rollout(1)]);
        assert_eq!(late(&[r0, r1, r2], false), vec![WorkerId::rollout(1)]);
        assert_eq!(late(&[r0, r2], false), vec![WorkerId::rollout(0)]);
        assert!(
            late(&[r0, r2], true).is_empty(),
            "the trainer is the one who owes an answer"
        );
    }

    #[test]
    fn a_pending_command_is_one_sent_after_the_last_answer() {
        let t0 = Instant::now();
        let at = |s| Some(t0 + Duration::from_secs(s));
        let record = |last_sent, last_heard| Record {
            last_sent,
            last_heard,
            ..Record::default()
        };
        assert!(!record(None, None).pending());
        assert!(record(at(1), None).pending());
        assert!(record(at(2), at(1)).pending());
        assert!(!record(at(1), at(2)).pending());
    }

    #[test]
    fn deaths_are_described_as_the_errors_say_them() {
        let exit = |code: i32| ExitStatus::from_raw(code << 8);
        let killed = ExitStatus::from_raw(9);
        assert_eq!(describe(exit(3)), "exited with status 3");
        assert_eq!(describe(killed), "was killed by SIGKILL");
        assert_eq!(death(Some(killed), None), "was killed by SIGKILL");
        assert_eq!(
            death(Some(killed), Some("missed the step deadline")),
            "was killed by SIGKILL (missed the step deadline)"
        );
        assert_eq!(death(None, None), "closed its control connection");
        assert_eq!(
            death(None, Some("why")),
            "closed its control connection (why)"
        );
    }

    #[test]
    fn the_culprit_is_named_with_its_status_its_words_and_who_failed_because_of_it() {
        let own = Record {
            failure: Some("workload: boom".into()),
            failed_at: Some(Instant::now()),
            ..Record::default()
        };
        let local = |exited, stopped, record| Culprit {
            record,
            exited,
            remote: false,
            stopped,
        };
        let exited = Some(ExitStatus::from_raw(1 << 8));
        assert_eq!(
            culprit_words(local(exited, false, &own), None),
            (
                "exited with status 1".to_owned(),
                ": workload: boom".to_owned()
            )
        );
        let quiet = Record::default();
        assert_eq!(
            culprit_words(local(None, true, &quiet), None).0,
            "did not answer (the process is stopped)"
        );
        assert_eq!(
            culprit_words(local(None, false, &quiet), None).0,
            "did not answer"
        );
        let broke = Record {
            failed_at: Some(Instant::now()),
            ..Record::default()
        };
        let trainer = Record {
            failure: Some("weight transport: rollout-1 gone".into()),
            ..Record::default()
        };
        assert_eq!(
            culprit_words(
                local(None, false, &broke),
                Some((WorkerId::TRAINER, &trainer))
            ),
            (
                "closed its control connection".to_owned(),
                "; trainer-0 failed because of it: weight transport: rollout-1 gone".to_owned()
            )
        );
        // On another node without an exit status: its agent's words are the status, not the message.
        let remote = Culprit {
            record: &own,
            exited: None,
            remote: true,
            stopped: true,
        };
        assert_eq!(
            culprit_words(remote, None),
            ("workload: boom".to_owned(), String::new())
        );
        assert_eq!(
            culprit_words(
                local(None, false, &broke),
                Some((WorkerId::TRAINER, &quiet))
            )
            .1,
            "; trainer-0 failed because of it: its connection broke"
        );
    }
}
