//! Deadlines the workers must meet ([`WorkerDeadline`]), not counting time the orchestrator itself did not
//! run (SIGSTOP, a frozen VM, an overloaded host).

use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;

/// How often a wait against a worker deadline wakes to look for a stall of this process.
const STALL_TICK: Duration = Duration::from_millis(250);
/// A wake this much later than planned means this process did not run (SIGSTOP, a frozen VM, an overloaded
/// host); the time it lost is not counted against the workers.
const STALL_SLACK: Duration = Duration::from_secs(1);

/// A deadline the workers must meet, which does not count time the orchestrator itself did not run: waits wake
/// at least every [`STALL_TICK`], and a wake (or a return to waiting) later than planned by more than
/// [`STALL_SLACK`] moves the deadline by that lateness.
#[derive(Debug, Clone, Copy)]
pub struct WorkerDeadline {
    at: Instant,
    /// When this process is next expected to look at the deadline again.
    planned: Instant,
    /// Time credited back because this process stalled.
    credited: Duration,
}

impl WorkerDeadline {
    pub fn after(limit: Duration) -> WorkerDeadline {
        let now = Instant::now();
        WorkerDeadline {
            at: now + limit,
            planned: now,
            credited: Duration::ZERO,
        }
    }

    /// Time given back to the workers so far because this process stalled.
    pub fn credited(&self) -> Duration {
        self.credited
    }

    fn credit_lateness(&mut self, now: Instant) {
        let late = now.saturating_duration_since(self.planned);
        if late > STALL_SLACK {
            self.at += late;
            self.credited += late;
        }
        self.planned = now;
    }

    /// The next event, or `None` once the deadline passed.
    pub async fn next<T>(&mut self, events: &mut mpsc::UnboundedReceiver<T>) -> Option<Option<T>> {
        // Time since the last return was spent by this process (or it was stopped): never the workers'.
        self.credit_lateness(Instant::now());
        loop {
            let now = Instant::now();
            if now >= self.at {
                return None;
            }
            let wake = self.at.min(now + STALL_TICK);
            self.planned = wake;
            let got = tokio::time::timeout_at(wake, events.recv()).await;
            // Woken long after `wake`, whichever branch fired: this process did not run meanwhile.
            self.credit_lateness(Instant::now().max(wake));
            if let Ok(event) = got {
                return Some(event);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 9, break 2: time this process did not run (here: its only thread blocked, as under SIGSTOP) is
    /// not counted against the workers, so their events after the stall still arrive within the deadline.
    #[test]
    fn a_stall_of_this_process_does_not_expire_a_worker_deadline() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let (tx, mut rx) = mpsc::unbounded_channel();
            let mut deadline = WorkerDeadline::after(Duration::from_millis(1500));
            tokio::spawn(async move {
                // Blocks the runtime's only thread: the deadline's timer cannot run meanwhile.
                std::thread::sleep(Duration::from_secs(4));
                for name in ["first", "second"] {
                    let _ = tx.send(name);
                }
            });
            for want in ["first", "second"] {
                match deadline.next(&mut rx).await {
                    Some(Some(name)) => assert_eq!(name, want),
                    Some(None) => panic!("the channel closed"),
                    None => panic!(
                        "the deadline expired although only this process stalled (credited {:?})",
                        deadline.credited()
                    ),
                }
            }
            assert!(
                deadline.credited() >= Duration::from_secs(2),
                "{:?}",
                deadline.credited()
            );
        });
    }

    #[test]
    fn a_deadline_still_expires_when_workers_are_silent() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let (_tx, mut rx) = mpsc::unbounded_channel::<()>();
            let mut deadline = WorkerDeadline::after(Duration::from_millis(300));
            assert!(deadline.next(&mut rx).await.is_none());
        });
    }

    /// The credit itself, on instants given: only a wake later than planned by more than the slack counts,
    /// and it moves the deadline by the whole lateness.
    #[test]
    fn only_lateness_past_the_slack_is_credited() {
        let mut deadline = WorkerDeadline::after(Duration::from_secs(10));
        let (at, planned) = (deadline.at, deadline.planned);
        deadline.credit_lateness(planned + STALL_SLACK);
        assert_eq!((deadline.at, deadline.credited()), (at, Duration::ZERO));
        let late = STALL_SLACK + Duration::from_secs(3);
        let now = deadline.planned + late;
        deadline.credit_lateness(now);
        assert_eq!(deadline.at, at + late);
        assert_eq!(deadline.credited(), late);
        assert_eq!(deadline.planned, now);
        // A wake earlier than planned credits nothing.
        deadline.credit_lateness(now);
        assert_eq!(deadline.credited(), late);
    }
}
