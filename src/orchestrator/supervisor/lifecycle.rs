//! The rollouts' lifecycle in one place: each rollout's phase, its restart budget and doubling backoff, and
//! the hold of a rank's successor while the trainer still serves that rank; a pure state machine.
//!
//! The supervisor drives the process side (a rollout is lost, its backoff ends, its successor is started and
//! connects, node 0 asks an agent for a successor) and the weights loop the weight side (it joined the weight
//! channel late, the trainer caught it up, it applied a version). Both read the same [`Lifecycle`].
//!
//! A rollout goes Joining (bootstrapped with the others) → Ready. Lost: Down (its successor is due after the
//! backoff; a rollout past its budget fails the run instead) → Restarting (its successor was started; or
//! Held first, when the backoff ended while the trainer still served the rank's previous incarnation, so one
//! incarnation at a time is ever caught up) → Joining (connected and told `init_weights`) → `joined`:
//! CatchingUp (the trainer got `rejoin`) → `rejoined`: Ready at the version it caught up to, or Deferred
//! (bucket syncer: it takes the next version before any work). A successor that joined while the trainer was
//! still bootstrapping is bootstrapped like the others (`applied`, version 0).
//!
//! No processes, no clocks and no I/O here: the callers act on what each transition returns.

use std::collections::BTreeMap;
use std::time::Duration;

/// Where one rollout stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Being bootstrapped with the others, or a successor told `init_weights` that has not joined yet.
    Joining,
    /// Joined late; the trainer was told to catch it up (it takes every later sync).
    CatchingUp,
    /// Caught up without a version of the trainer's (bucket syncer): takes the next sync before any work.
    Deferred,
    /// Holds a verified version: takes work and every sync.
    Ready,
    /// Dead (its process killed); its successor is due after the backoff, or when node 0 asks for it.
    Down,
    /// Dead and its backoff over, while the trainer still serves the rank: its successor starts on release.
    Held,
    /// Its successor was started and has not connected yet.
    Restarting,
}

impl Phase {
    /// Dead with no successor started: no process of this rank runs.
    pub fn is_down(self) -> bool {
        matches!(self, Phase::Down | Phase::Held)
    }
}

/// Who keeps a rollout's restart budget and backoff.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RestartPolicy {
    /// This supervisor: `restarts` per rollout (`runner.rollout_restarts`), the first after `backoff`
    /// (`runner.rollout_restart_backoff_s`), each next one after twice the wait of the one before.
    Budget { restarts: u32, backoff: Duration },
    /// Node 0 (this is a node agent): a death is only reported up; node 0 asks for the successor.
    Upstream,
}

/// What becomes of a rollout that was lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Loss {
    /// Start its successor after `delay`: restart `n` of `budget`.
    Restart {
        n: u32,
        budget: u32,
        delay: Duration,
    },
    /// Node 0 decides (this is a node agent).
    ReportUp,
    /// Its restarts are used up (`restarts` of them): the run fails.
    Exhausted { restarts: u32 },
}

/// The wait before the `n`-th restart (from 1) of one worker: `base · 2^(n-1)`, at most the schema's cap.
pub fn restart_delay(base: Duration, n: u32) -> Duration {
    let cap = Duration::from_secs(crate::config::schema::MAX_RESTART_BACKOFF_S);
    base.saturating_mul(1u32 << n.saturating_sub(1).min(20))
        .min(cap)
}

/// One rollout rank.
#[derive(Debug, Clone, Copy)]
struct Rollout {
    phase: Phase,
    /// The version it holds (meaningful when Ready).
    version: u64,
    /// Times this rank's worker was restarted.
    restarts: u32,
    /// The trainer owes a `caught_up` for this rank: its next successor is held back meanwhile.
    serving: bool,
}

/// Every rollout of a supervisor, by rank.
#[derive(Debug, Clone)]
pub struct Lifecycle {
    policy: RestartPolicy,
    ranks: BTreeMap<u32, Rollout>,
}

impl Lifecycle {
    /// Rollouts `ranks`, each about to be bootstrapped.
    pub fn new(policy: RestartPolicy, ranks: impl IntoIterator<Item = u32>) -> Lifecycle {
        let fresh = Rollout {
            phase: Phase::Joining,
            version: 0,
            restarts: 0,
            serving: false,
        };
        Lifecycle {
            policy,
            ranks: ranks.into_iter().map(|r| (r, fresh)).collect(),
        }
    }

    fn get(&self, rank: u32) -> Option<&Rollout> {
        self.ranks.get(&rank)
    }

    /// The phase of rollout `rank` (an unknown rank is Down).
    pub fn phase(&self, rank: u32) -> Phase {
        self.get(rank).map_or(Phase::Down, |r| r.phase)
    }

    pub fn is_ready(&self, rank: u32) -> bool {
        self.phase(rank) == Phase::Ready
    }

    /// Dead with no successor started ([`Phase::is_down`]).
    pub fn is_down(&self, rank: u32) -> bool {
        self.get(rank).is_some_and(|r| r.phase.is_down())
    }

    /// The version rollout `rank` holds (meaningful when Ready).
    pub fn version(&self, rank: u32) -> u64 {
        self.get(rank).map_or(0, |r| r.version)
    }

    /// Times rollout `rank` was restarted.
    pub fn restarts_of(&self, rank: u32) -> u32 {
        self.get(rank).map_or(0, |r| r.restarts)
    }

    /// Restarts of all rollouts so far.
    pub fn restarts(&self) -> u64 {
        self.ranks.values().map(|r| u64::from(r.restarts)).sum()
    }

    fn ranks_in(&self, phases: &[Phase]) -> Vec<u32> {
        self.ranks
            .iter()
            .filter(|(_, r)| phases.contains(&r.phase))
            .map(|(rank, _)| *rank)
            .collect()
    }

    /// Ranks the next sync reaches (so they must apply it): Ready, Deferred, and those the trainer catches up
    /// first (its commands run in order).
    pub fn attached(&self) -> Vec<u32> {
        self.ranks_in(&[Phase::Ready, Phase::Deferred, Phase::CatchingUp])
    }

    /// Ranks waiting for a version before they may work.
    pub fn deferred(&self) -> Vec<u32> {
        self.ranks_in(&[Phase::Deferred])
    }

    /// Whether no rollout is between a (re)start and its first verified version: a bootstrap waits for them.
    pub fn settled(&self) -> bool {
        self.ranks_in(&[Phase::Joining, Phase::CatchingUp])
            .is_empty()
    }

    fn with(&mut self, rank: u32, f: impl FnOnce(&mut Rollout)) {
        if let Some(r) = self.ranks.get_mut(&rank) {
            f(r);
        }
    }

    /// Rollout `rank` died: Down and a restart counted, or past its budget. Unknown ranks are exhausted at once.
    pub(super) fn lost(&mut self, rank: u32) -> Loss {
        let policy = self.policy;
        let Some(r) = self.ranks.get_mut(&rank) else {
            return Loss::Exhausted { restarts: 0 };
        };
        let loss = match policy {
            RestartPolicy::Upstream => Loss::ReportUp,
            RestartPolicy::Budget { restarts, .. } if r.restarts >= restarts => {
                return Loss::Exhausted {
                    restarts: r.restarts,
                };
            }
            RestartPolicy::Budget { restarts, backoff } => Loss::Restart {
                n: r.restarts + 1,
                budget: restarts,
                delay: restart_delay(backoff, r.restarts + 1),
            },
        };
        r.restarts += 1;
        r.phase = Phase::Down;
        loss
    }

    /// The backoff of lost rollout `rank` is over: whether its successor starts now (else it is Held until
    /// the trainer served the rank, or it is not down at all).
    pub(super) fn backoff_over(&mut self, rank: u32) -> bool {
        let mut start = false;
        self.with(rank, |r| {
            if r.phase == Phase::Down {
                if r.serving {
                    r.phase = Phase::Held;
                } else {
                    r.phase = Phase::Restarting;
                    start = true;
                }
            }
        });
        start
    }

    /// On a node agent, node 0 asked for the successor of rollout `rank`: whether to start it (it is down).
    pub(super) fn restart_asked(&mut self, rank: u32) -> bool {
        let mut start = false;
        self.with(rank, |r| {
            if r.phase.is_down() {
                r.phase = Phase::Restarting;
                start = true;
            }
        });
        start
    }

    /// Rollout `rank`'s process connected: a successor (whether it was restarted is returned) joins the
    /// weight channel next; a first process keeps its phase.
    pub(super) fn connected(&mut self, rank: u32) -> bool {
        let mut successor = false;
        self.with(rank, |r| {
            successor = r.restarts > 0;
            if r.phase == Phase::Restarting {
                r.phase = Phase::Joining;
            }
        });
        successor
    }

    /// Rollout `rank` joined the weight channel late: the trainer catches it up, and serves the rank (its next
    /// successor is held) until it says it is done.
    pub fn joined(&mut self, rank: u32) {
        self.with(rank, |r| {
            r.phase = Phase::CatchingUp;
            r.serving = true;
        });
    }

    /// The trainer is done serving rank `rank`: whether a successor held meanwhile starts now.
    pub(super) fn served(&mut self, rank: u32) -> bool {
        let mut start = false;
        self.with(rank, |r| {
            r.serving = false;
            if r.phase == Phase::Held {
                r.phase = Phase::Restarting;
                start = true;
            }
        });
        start
    }

    /// Rollout `rank` caught up to verified `version`: Ready.
    pub fn rejoined(&mut self, rank: u32, version: u64) {
        self.with(rank, |r| {
            r.phase = Phase::Ready;
            r.version = version;
        });
    }

    /// Rollout `rank` caught up without a version of the trainer's: Deferred.
    pub fn defer(&mut self, rank: u32) {
        self.with(rank, |r| r.phase = Phase::Deferred);
    }

    /// Rollout `rank` installed (and, when verifying, verified) `version`: it holds it, and a rollout that
    /// was joining, deferred or catching up is Ready. Returns the phase it was in.
    pub fn applied(&mut self, rank: u32, version: u64) -> Phase {
        let mut was = Phase::Down;
        self.with(rank, |r| {
            was = r.phase;
            if matches!(
                r.phase,
                Phase::Joining | Phase::Deferred | Phase::CatchingUp
            ) {
                r.phase = Phase::Ready;
            }
            r.version = r.version.max(version);
        });
        was
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    fn budget(restarts: u32) -> Lifecycle {
        Lifecycle::new(
            RestartPolicy::Budget {
                restarts,
                backoff: S,
            },
            0..2,
        )
    }

    #[test]
    fn the_backoff_doubles_up_to_the_cap() {
        assert_eq!(restart_delay(S, 1), S);
        assert_eq!(restart_delay(S, 2), 2 * S);
        assert_eq!(restart_delay(S, 4), 8 * S);
        let cap = Duration::from_secs(crate::config::schema::MAX_RESTART_BACKOFF_S);
        assert_eq!(restart_delay(S, 40), cap);
        assert_eq!(restart_delay(Duration::ZERO, 3), Duration::ZERO);
    }

    #[test]
    fn a_rollout_is_bootstrapped_then_ready() {
        let mut life = budget(1);
        assert!(!life.settled());
        assert!(life.attached().is_empty());
        assert_eq!(life.applied(0, 0), Phase::Joining);
        assert!(!life.settled(), "rank 1 still joins");
        life.applied(1, 0);
        assert!(life.settled());
        assert_eq!(life.attached(), vec![0, 1]);
        life.applied(0, 3);
        life.applied(0, 2);
        assert_eq!(life.version(0), 3, "a version never goes back");
        assert!(life.is_ready(0));
    }

    #[test]
    fn restarts_count_up_to_the_budget_with_a_doubling_backoff() {
        let mut life = budget(2);
        life.applied(0, 0);
        assert_eq!(
            life.lost(1),
            Loss::Restart {
                n: 1,
                budget: 2,
                delay: S
            }
        );
        assert!(life.is_down(1) && !life.is_down(0));
        assert!(life.settled(), "a dead rollout is not waited for");
        assert!(life.backoff_over(1));
        assert_eq!(life.phase(1), Phase::Restarting);
        assert!(!life.backoff_over(1), "one successor per loss");
        assert_eq!(
            life.lost(1),
            Loss::Restart {
                n: 2,
                budget: 2,
                delay: 2 * S
            }
        );
        assert_eq!(life.lost(1), Loss::Exhausted { restarts: 2 });
        assert_eq!(life.restarts(), 2);
        assert_eq!(life.restarts_of(0), 0);
        assert_eq!(life.lost(7), Loss::Exhausted { restarts: 0 });
    }

    #[test]
    fn a_successor_rejoins_through_the_trainer_and_is_ready_at_its_version() {
        let mut life = budget(3);
        life.applied(0, 0);
        life.lost(0);
        assert!(!life.connected(1), "a first process is no successor");
        assert!(life.backoff_over(0));
        assert!(life.connected(0));
        assert_eq!(life.phase(0), Phase::Joining);
        assert!(!life.settled());
        life.joined(0);
        assert_eq!(life.phase(0), Phase::CatchingUp);
        assert!(life.attached().contains(&0), "it takes every later sync");
        assert!(!life.served(0), "nothing was held");
        life.rejoined(0, 5);
        assert!(life.is_ready(0));
        assert_eq!(life.version(0), 5);
    }

    #[test]
    fn a_bucket_catch_up_defers_the_rollout_until_its_next_apply() {
        let mut life = budget(1);
        life.lost(1);
        life.backoff_over(1);
        life.connected(1);
        life.joined(1);
        life.served(1);
        life.defer(1);
        assert_eq!(life.deferred(), vec![1]);
        assert!(life.attached().contains(&1) && !life.is_ready(1));
        assert_eq!(life.applied(1, 4), Phase::Deferred);
        assert!(life.is_ready(1) && life.deferred().is_empty());
    }

    #[test]
    fn a_successor_due_while_the_trainer_serves_the_rank_is_held_until_it_is_done() {
        let mut life = budget(3);
        life.lost(0);
        life.backoff_over(0);
        life.connected(0);
        life.joined(0);
        // Killed during its catch-up: the trainer still serves the rank.
        life.lost(0);
        assert!(
            !life.backoff_over(0),
            "held while the trainer serves rank 0"
        );
        assert_eq!(life.phase(0), Phase::Held);
        assert!(life.is_down(0));
        assert!(life.served(0), "released: its successor starts now");
        assert_eq!(life.phase(0), Phase::Restarting);
        // Served before the backoff ended: the successor starts when it ends.
        life.connected(0);
        life.joined(0);
        life.lost(0);
        assert!(!life.served(0));
        assert!(life.backoff_over(0));
    }

    #[test]
    fn on_a_node_agent_node_0_decides_and_asks_for_the_successor() {
        let mut life = Lifecycle::new(RestartPolicy::Upstream, [3]);
        assert!(!life.restart_asked(3), "not lost: no restart");
        assert_eq!(life.lost(3), Loss::ReportUp);
        assert_eq!(life.lost(3), Loss::ReportUp, "no budget here");
        assert!(life.restart_asked(3));
        assert!(!life.restart_asked(3));
        assert!(life.connected(3));
        assert_eq!(life.restarts_of(3), 2);
    }

    #[test]
    fn an_unknown_rank_holds_nothing() {
        let life = budget(1);
        assert_eq!(life.phase(9), Phase::Down);
        assert!(!life.is_down(9) && !life.is_ready(9));
        assert_eq!((life.version(9), life.restarts_of(9)), (0, 0));
    }
}
