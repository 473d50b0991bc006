//! The orchestrator's side of weight sync: bootstrap, blocking syncs, verification of the state checksums
//! rollouts report against the trainer's (`runner.verify_sync`), and the rejoin of restarted rollouts
//! ([`Fleet`]).
//!
//! A restarted rollout (`runner.rollout_restarts`) is told `init_weights` once connected; its `joined` (it
//! joined the weight channel late) has the trainer catch it up (`rejoin`, addressed by its receiver index on the
//! weight channel: [`WeightReceivers`]), and its `rejoined` makes it Ready at
//! the version it caught up to, verified like any sync, or Deferred (bucket syncer). Its phases, and the hold
//! of the rank's next successor while the trainer serves it, are the supervisor's
//! [`Lifecycle`](crate::orchestrator::supervisor::lifecycle::Lifecycle); this module moves it through them.

use std::collections::BTreeMap;
use std::time::Instant;

use crate::orchestrator::OrchestratorError;
use crate::orchestrator::metrics::StepRecord;
use crate::orchestrator::multinode::MultiNode;
use crate::orchestrator::supervisor::lifecycle::Phase;
use crate::orchestrator::supervisor::{Incoming, Supervisor, WorkerId};
use rlsync_core::protocol::messages::{Command, Frame, InstallPhases, Report, Role, SyncStats};

/// Each rollout rank's receiver index on the trainer's weight channel: the channel numbers its receivers node by
/// node in chain order (the trainer's node first), each node's in its channel order; in the host-shared mode a
/// node's one receiver is its applier (its lowest rollout rank) and its readers are on no channel. The trainer
/// catches a restarted rollout up by this index (`Command::Rejoin`), the supervisor keeps its books by rank.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WeightReceivers {
    /// Indexed by rollout rank; `None`: a host-shared reader (or a rank no node holds).
    by_rank: Vec<Option<u32>>,
}

impl WeightReceivers {
    /// From each node's rollout ranks in channel order, the nodes in chain order (`rollouts`: the run's count).
    pub fn from_chain<I>(rollouts: u32, chain: I, host_shared: bool) -> WeightReceivers
    where
        I: IntoIterator<Item = Vec<u32>>,
    {
        let mut by_rank = vec![None; rollouts as usize];
        let mut next = 0u32;
        let mut place = |rank: u32, next: &mut u32| {
            if let Some(slot) = by_rank.get_mut(rank as usize) {
                *slot = Some(*next);
            }
            *next += 1;
        };
        for ranks in chain {
            if host_shared {
                // One receiver per node with rollouts: its applier.
                if let Some(applier) = crate::protocol::launch::host_applier(ranks) {
                    place(applier, &mut next);
                }
            } else {
                for rank in ranks {
                    place(rank, &mut next);
                }
            }
        }
        WeightReceivers { by_rank }
    }

    /// The run's mapping: one host (every rollout on the trainer's channel, rank for rank), or the placement
    /// over several nodes (each node's rollouts as its launch file lists them, `LaunchSpec::node_rollouts`).
    pub fn of_run(rollouts: u32, host_shared: bool, multi: Option<&MultiNode>) -> WeightReceivers {
        match multi {
            None => WeightReceivers::from_chain(rollouts, [(0..rollouts).collect()], host_shared),
            Some(m) => WeightReceivers::from_chain(
                rollouts,
                m.placement.chain().into_iter().map(|n| m.rollouts_on(n)),
                host_shared,
            ),
        }
    }

    /// Rollout `rank`'s receiver index (`None`: it is on no weight channel).
    pub fn of(&self, rank: u32) -> Option<u32> {
        self.by_rank.get(rank as usize).copied().flatten()
    }
}

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
    /// The trainer's whole handling of the sync (its `Synced` seconds): the phases in `stats`, its host view
    /// of the weights and its checksum.
    pub trainer_s: f64,
    /// The slowest of the installs the sync waited for (`None`: it waited for none, as a background sync).
    pub apply_max: Option<Install>,
}

/// One rollout's install of a version, as its `Applied` reported it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Install {
    pub seconds: f64,
    /// Where the time went (a host receiver's install).
    pub phases: Option<InstallPhases>,
}

/// Fold one install into the slowest so far (the first of equals stays).
pub fn slowest(so_far: &mut Option<Install>, install: Install) {
    if so_far.is_none_or(|s| install.seconds > s.seconds) {
        *so_far = Some(install);
    }
}

impl SyncOutcome {
    pub fn record(&self, rec: &mut StepRecord) {
        rec.int("sync/version", self.stats.version as i64);
        rec.text("sync/kind", &self.stats.kind);
        rec.int("sync/bytes", self.stats.payload_bytes as i64);
        rec.int("sync/changed", self.stats.changed as i64);
        rec.int("sync/state_bytes", self.stats.state_bytes as i64);
        rec.float("sync/compression_ratio", self.stats.compression_ratio);
        rec.int("sync/dense_segments", self.stats.dense_segments as i64);
        rec.flag("sync/verified", self.verified);
        rec.float("time/sync_build", self.stats.build_s);
        rec.float("time/sync_encode", self.stats.encode_s);
        rec.float("time/sync_transfer", self.stats.seconds);
        rec.float("time/sync_trainer", self.trainer_s);
        if let Some(slowest) = &self.apply_max {
            rec.float("time/sync_apply_max", slowest.seconds);
            if let Some(p) = &slowest.phases {
                rec.float("time/sync_apply_wait", p.wait_s);
                rec.float("time/sync_apply_decode", p.decode_s);
                rec.float("time/sync_apply_write", p.write_s);
                if let Some(seconds) = p.load_s {
                    rec.float("time/sync_apply_load", seconds);
                }
                if let Some(seconds) = p.checksum_s {
                    rec.float("time/sync_apply_checksum", seconds);
                }
            }
        }
    }
}

/// What [`Fleet::handle`] made of an incoming event.
#[derive(Debug)]
pub enum Handled {
    /// A report for the loop itself.
    Report(WorkerId, Frame<Report>),
    /// Rollout `rank` is gone: its unfinished work is lost.
    Lost(u32),
    /// Rollout `rank` installed (and, when verifying, verified) `version` after a sync or its bootstrap, in
    /// `install.seconds` (its report's: the install and its checksum, for a blocking install with its wait
    /// for the payload).
    Applied {
        rank: u32,
        version: u64,
        install: Install,
    },
    /// Rollout `rank` caught up after a restart: it holds verified `version` and may take work.
    Ready { rank: u32, version: u64 },
    /// Nothing for the loop.
    Nothing,
}

/// Catch-ups and losses since the last metrics record.
#[derive(Debug, Default, Clone)]
struct Since {
    catchups: u32,
    full: u32,
    bytes: u64,
    ms: f64,
    lost_trajs: u64,
    /// The slowest install a rollout reported (its `Applied`), whatever sync it belonged to.
    apply_max: Option<Install>,
}

/// The restart and rejoin traffic of the rollouts and what the rejoins cost (their phases are the
/// supervisor's [`Lifecycle`](crate::orchestrator::supervisor::lifecycle::Lifecycle)).
#[derive(Debug, Default)]
pub struct Fleet {
    since: Since,
}

impl Fleet {
    /// Count chunks a lost rollout did not finish (`rollout/lost_trajs`).
    pub fn lost_trajs(&mut self, chunks: u64) {
        self.since.lost_trajs += chunks;
    }

    /// Take an incoming event: the restart and rejoin traffic is handled here, the rest handed back.
    pub async fn handle(
        &mut self,
        sup: &mut Supervisor,
        verifier: &mut Verifier,
        incoming: Incoming,
    ) -> Result<Handled, OrchestratorError> {
        let (id, frame) = match incoming {
            Incoming::Lost { id, reason, .. } => {
                tracing::debug!("{id} lost: {reason}");
                return Ok(Handled::Lost(id.rank));
            }
            Incoming::Restarted(id) => {
                sup.send(id, &Command::InitWeights, &[]).await?;
                return Ok(Handled::Nothing);
            }
            Incoming::Report(id, frame) => (id, frame),
            // Only a node agent's supervisor hands these out.
            Incoming::Upstream(_) => return Ok(Handled::Nothing),
        };
        let rank = id.rank;
        match (&frame.header, id.role) {
            (Report::Joined, Role::Rollout) => {
                // A host-shared reader never joins the channel: only a receiver can be caught up.
                let Some(receiver) = sup.weight_receivers().of(rank) else {
                    return Err(unexpected(id, &frame.header));
                };
                // The trainer serves the rank until its `caught_up`: the rank's next successor waits.
                sup.lifecycle_mut().joined(rank);
                sup.send(WorkerId::TRAINER, &Command::Rejoin { rank, receiver }, &[])
                    .await?;
                Ok(Handled::Nothing)
            }
            (
                Report::CaughtUp {
                    rank,
                    ok,
                    kind,
                    from,
                    to,
                    patches,
                    payload_bytes,
                    seconds,
                    reason,
                },
                Role::Trainer,
            ) => {
                let rank = *rank;
                sup.served(rank)?;
                if *ok {
                    tracing::info!(
                        "rollout-{rank} rejoined: caught up by {kind} from version {from} to {to} ({patches} patches, {payload_bytes} bytes, {:.1} ms){}",
                        seconds * 1e3,
                        if reason.is_empty() {
                            String::new()
                        } else {
                            format!("; not a replay: {reason}")
                        }
                    );
                    self.since.catchups += 1;
                    self.since.full += u32::from(kind != "replay");
                    self.since.bytes += payload_bytes;
                    self.since.ms += seconds * 1e3;
                } else {
                    tracing::warn!("the rejoin of rollout-{rank} did not complete: {reason}");
                }
                Ok(Handled::Nothing)
            }
            (
                Report::Rejoined {
                    version,
                    checksum,
                    deferred,
                    ..
                },
                Role::Rollout,
            ) => {
                if *deferred {
                    sup.lifecycle_mut().defer(rank);
                    return Ok(Handled::Nothing);
                }
                verifier.rollout(id, *version, *checksum)?;
                sup.lifecycle_mut().rejoined(rank, *version);
                Ok(Handled::Ready {
                    rank,
                    version: *version,
                })
            }
            (
                Report::Applied {
                    version,
                    checksum,
                    seconds,
                    phases,
                },
                Role::Rollout,
            ) => {
                verifier.rollout(id, *version, *checksum)?;
                let install = Install {
                    seconds: *seconds,
                    phases: *phases,
                };
                slowest(&mut self.since.apply_max, install);
                let was = sup.lifecycle_mut().applied(rank, *version);
                let restarted = sup.lifecycle().restarts_of(rank) > 0;
                if was == Phase::Joining && version == &0 && restarted {
                    tracing::info!("{id}: bootstrapped with the others after its restart");
                }
                Ok(Handled::Applied {
                    rank,
                    version: *version,
                    install,
                })
            }
            // A restarted rollout built its workload: its `init_weights` went out when it connected.
            (Report::Built { seconds }, _) => {
                tracing::debug!("{id}: built its workload in {seconds:.2} s");
                Ok(Handled::Nothing)
            }
            _ => Ok(Handled::Report(id, frame)),
        }
    }

    /// Metrics of restarts, lost trajectories, catch-ups and the slowest install of any sync since the last
    /// record (`time/apply_max`: background installs belong to no row's sync).
    pub fn record(&mut self, sup: &Supervisor, rec: &mut StepRecord) {
        let since = std::mem::take(&mut self.since);
        rec.int("rollout/restarts", sup.restarts() as i64);
        rec.int("rollout/lost_trajs", since.lost_trajs as i64);
        if since.catchups > 0 {
            // 0: every catch-up since the last record was a replay; 1: at least one was a full transfer.
            rec.int("sync/catchup_kind", i64::from(since.full > 0));
            rec.int("sync/catchup_bytes", since.bytes as i64);
            rec.float("sync/catchup_ms", since.ms);
        }
        if let Some(slowest) = since.apply_max {
            rec.float("time/apply_max", slowest.seconds);
        }
    }
}

fn unexpected(id: WorkerId, report: &Report) -> OrchestratorError {
    OrchestratorError::Unexpected {
        worker: id.to_string(),
        report: format!("{report:?}"),
    }
}

/// Wait for the trainer's `Synced` of the bootstrap and for every rollout to hold it (restarted ones: until
/// they caught up).
async fn collect(
    sup: &mut Supervisor,
    verifier: &mut Verifier,
    fleet: &mut Fleet,
    started: Instant,
) -> Result<SyncOutcome, OrchestratorError> {
    let (mut stats, mut trainer_s, mut apply_max) = (None, 0.0, None);
    while stats.is_none() || !sup.lifecycle().settled() {
        let waiting = if stats.is_none() {
            "the trainer's sync"
        } else {
            "rollouts to apply weights"
        };
        let incoming = sup.recv(waiting).await?;
        let (id, frame) = match fleet.handle(sup, verifier, incoming).await? {
            Handled::Report(id, frame) => (id, frame),
            Handled::Applied { install, .. } => {
                slowest(&mut apply_max, install);
                continue;
            }
            _ => continue,
        };
        match frame.header {
            Report::Synced {
                stats: s,
                checksum,
                seconds,
            } if id == WorkerId::TRAINER && stats.is_none() => {
                verifier.trainer(s.version, checksum)?;
                stats = Some(s);
                trainer_s = seconds;
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
        trainer_s,
        apply_max,
    })
}

/// The init bootstrap and the wait for the workers' workloads before it.
#[derive(Debug, Clone)]
pub struct Bootstrap {
    /// From the call until the trainer and every connected rollout built its workload (`built`): the end of
    /// the workers' start-up.
    pub ready_s: f64,
    /// The bootstrap proper, from then until every rollout holds the trainer's weights.
    pub sync: SyncOutcome,
}

/// Wait until the trainer and every rollout in `rollouts` said `built`; those lost meanwhile leave the wait,
/// their successors connected meanwhile join it. Returns the rollouts that built their workloads.
async fn await_built(
    sup: &mut Supervisor,
    verifier: &mut Verifier,
    fleet: &mut Fleet,
    rollouts: Vec<WorkerId>,
) -> Result<Vec<WorkerId>, OrchestratorError> {
    let mut waiting: Vec<WorkerId> = std::iter::once(WorkerId::TRAINER)
        .chain(rollouts.iter().copied())
        .collect();
    let mut built = Vec::new();
    while !waiting.is_empty() {
        let names: Vec<String> = waiting.iter().map(WorkerId::to_string).collect();
        let what = format!(
            "the workers to build their workloads ({})",
            names.join(", ")
        );
        let incoming = sup.recv(&what).await?;
        if let Incoming::Report(
            id,
            Frame {
                header: Report::Built { seconds },
                ..
            },
        ) = &incoming
            && let Some(at) = waiting.iter().position(|w| w == id)
        {
            tracing::debug!("{id}: built its workload in {seconds:.2} s");
            built.push(waiting.remove(at));
            continue;
        }
        // The successor of one lost meanwhile joins the bootstrap like the others, once built.
        if let Incoming::Restarted(id) = incoming {
            waiting.push(id);
            continue;
        }
        match fleet.handle(sup, verifier, incoming).await? {
            Handled::Lost(rank) => {
                waiting.retain(|w| *w != WorkerId::rollout(rank));
                built.retain(|w| *w != WorkerId::rollout(rank));
            }
            Handled::Report(id, frame) => return Err(unexpected(id, &frame.header)),
            // A successor's rejoin traffic: the lifecycle has it, the bootstrap's collect waits on it.
            Handled::Nothing | Handled::Ready { .. } | Handled::Applied { .. } => {}
        }
    }
    built.retain(|id| id.role == Role::Rollout);
    Ok(built)
}

/// Initial bootstrap (always blocking): waits for the workers' workloads, then every rollout holds version 0
/// when this returns (except restarted ones still on their way: they rejoin through [`Fleet::handle`]).
pub async fn bootstrap(
    sup: &mut Supervisor,
    verifier: &mut Verifier,
    fleet: &mut Fleet,
) -> Result<Bootstrap, OrchestratorError> {
    let waited = Instant::now();
    // One lost before the bootstrap is down or restarting: its successor gets `init_weights` when it connects.
    let connected: Vec<WorkerId> = (0..sup.rollouts())
        .map(WorkerId::rollout)
        .filter(|id| sup.is_connected(*id))
        .collect();
    // The builds run under the step deadline, as the bootstrap that waited on them did.
    sup.begin_step();
    let rollouts = await_built(sup, verifier, fleet, connected).await?;
    let ready_s = waited.elapsed().as_secs_f64();
    let started = Instant::now();
    sup.begin_step();
    sup.send(WorkerId::TRAINER, &Command::InitWeights, &[])
        .await?;
    for id in rollouts {
        sup.send(id, &Command::InitWeights, &[]).await?;
    }
    let sync = collect(sup, verifier, fleet, started).await?;
    Ok(Bootstrap { ready_s, sync })
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

    /// The run over `nodes` nodes of `slots` slots each, the trainer on slot 0 and the rollouts on `rollout`.
    fn placed(nodes: u32, slots: u32, rollout: &str) -> MultiNode {
        use crate::config::schema::{ClusterConfig, Placement};
        use std::num::NonZeroU32;
        let mut component_placement = indexmap::IndexMap::new();
        component_placement.insert("actor".to_owned(), Placement::Ranges("0".to_owned()));
        component_placement.insert("rollout".to_owned(), Placement::Ranges(rollout.to_owned()));
        let cluster = ClusterConfig {
            num_nodes: NonZeroU32::new(nodes).unwrap(),
            slots_per_node: NonZeroU32::new(slots),
            component_placement,
            ..ClusterConfig::default()
        };
        MultiNode {
            identity: crate::cluster::NodeIdentity {
                host: "h".into(),
                node_rank: 0,
                num_nodes: nodes,
                master_addr: "127.0.0.1".into(),
                master_port: 1,
                scheduler: crate::cluster::Scheduler::Config,
            },
            placement: crate::config::placement::resolve(&cluster).unwrap(),
            token: String::new(),
        }
    }

    fn receivers(map: &WeightReceivers, rollouts: u32) -> Vec<Option<u32>> {
        (0..rollouts).map(|r| map.of(r)).collect()
    }

    #[test]
    fn one_host_receivers_are_the_ranks_or_the_applier() {
        let map = WeightReceivers::of_run(3, false, None);
        assert_eq!(receivers(&map, 3), [Some(0), Some(1), Some(2)]);
        // Host-shared: rollout 0 applies and is the channel's one receiver; the readers are on no channel.
        let map = WeightReceivers::of_run(3, true, None);
        assert_eq!(receivers(&map, 3), [Some(0), None, None]);
        assert_eq!(map.of(3), None, "a rank beyond the run's");
    }

    #[test]
    fn receivers_follow_the_chain_node_by_node() {
        // Ranks in chain order: node 0 holds rollout 0, node 1 rollouts 1 and 2.
        let multi = placed(2, 2, "1-3");
        let map = WeightReceivers::of_run(3, false, Some(&multi));
        assert_eq!(receivers(&map, 3), [Some(0), Some(1), Some(2)]);
        // Host-shared: one receiver per node, its applier.
        let map = WeightReceivers::of_run(3, true, Some(&multi));
        assert_eq!(receivers(&map, 3), [Some(0), Some(1), None]);
    }

    #[test]
    fn out_of_order_placements_map_ranks_to_their_chain_receivers() {
        // Rollout 0 on node 1, rollout 1 on node 0: the trainer's node is the chain's head.
        let multi = placed(2, 1, "1,0");
        assert_eq!(multi.rollouts_on(0), [1]);
        let map = WeightReceivers::of_run(2, false, Some(&multi));
        assert_eq!(receivers(&map, 2), [Some(1), Some(0)]);
        // Node 1's slots listed first: rollouts 0 and 1 on node 1, rollout 2 on node 0.
        let multi = placed(2, 2, "2-3,1");
        let map = WeightReceivers::of_run(3, false, Some(&multi));
        assert_eq!(receivers(&map, 3), [Some(1), Some(2), Some(0)]);
        let map = WeightReceivers::of_run(3, true, Some(&multi));
        assert_eq!(receivers(&map, 3), [Some(1), None, Some(0)]);
        // Three nodes, node 2's slots before node 1's.
        let multi = placed(3, 1, "0,2,1");
        let map = WeightReceivers::of_run(3, false, Some(&multi));
        assert_eq!(receivers(&map, 3), [Some(0), Some(2), Some(1)]);
    }

    #[test]
    fn host_shared_appliers_are_each_nodes_chain_index() {
        // Two rollouts per node: node 1's applier is rollout 2, the channel's receiver 1.
        let multi = placed(2, 2, "0-3");
        let map = WeightReceivers::of_run(4, true, Some(&multi));
        assert_eq!(receivers(&map, 4), [Some(0), None, Some(1), None]);
        let map = WeightReceivers::of_run(4, false, Some(&multi));
        assert_eq!(receivers(&map, 4), [Some(0), Some(1), Some(2), Some(3)]);
        // A node's lowest rank applies, wherever the placement lists it.
        let map = WeightReceivers::from_chain(5, [vec![4, 1], vec![3, 0, 2]], true);
        assert_eq!(receivers(&map, 5), [Some(1), Some(0), None, None, None]);
        // A node without rollouts (the trainer's) has no receiver.
        let map = WeightReceivers::from_chain(2, [vec![], vec![1, 0]], true);
        assert_eq!(receivers(&map, 2), [Some(0), None]);
    }

    #[test]
    fn disabled_verifier_never_claims_verification() {
        let mut v = Verifier::new(false);
        v.trainer(1, 1).unwrap();
        v.rollout(WorkerId::rollout(0), 1, 2).unwrap();
        assert!(!v.all_matched());
    }
}
