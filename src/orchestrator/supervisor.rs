//! The supervisor: spawns the workers, owns their process group, and dispatches one closed [`Event`] stream
//! (connections, reports, exits, signals) into per-worker unit state; the training loops only see reports.
//!
//! Failure policy: a worker that exits (any status) before it is told to stop, sends `Failed`, drops its
//! control connection, misses the handshake or the step deadline fails the run with an error naming it, its
//! exit status or signal, and the last lines of its log. Stopping is always: `Stop` command → grace → SIGTERM
//! to the group → grace → SIGKILL to the group; a second stop request skips straight to SIGKILL.
//!
//! Restartable rollouts (`runner.rollout_restarts` > 0): a rollout that dies (crash, kill, `Failed`, a broken
//! connection, a missed handshake; one that misses the step deadline is killed first) is instead reported to
//! the loop as [`Incoming::Lost`] and respawned with the same rank after a backoff
//! (`runner.rollout_restart_backoff_s`, doubling per restart of that worker); once connected it is reported as
//! [`Incoming::Restarted`]. A rollout that dies with its restarts used up fails the run naming it and the
//! count. The trainer dying always fails the run (resume from a checkpoint).
//!
//! Over several nodes the budget, the backoff and the hold stay with node 0's supervisor: a node agent's
//! supervisor (`upstream`) only reports the death of its restartable rollout (`Incoming::Lost`, sent up as
//! `lost` with the last lines of its log) and starts the successor when node 0 asks (`restart`), reporting it
//! once connected (`restarted`; during the agent's start-up its `ready` names it instead); node 0 treats the
//! remote worker exactly like a local one, a death during the start-up included.
//!
//! The rollouts' phases, restart budget, backoff and hold are one pure state machine, [`lifecycle::Lifecycle`],
//! which the weights loop reads and moves through the weight phases; whom a failure or a missed deadline names
//! is [`attribution`]'s decision, and the deadlines that do not count the orchestrator's own stalls are
//! [`deadline`]'s.

pub mod attribution;
pub mod deadline;
pub mod interpreter_probe;
pub mod lifecycle;
pub mod nodes;
pub mod spawn;
pub mod unix;

use std::collections::VecDeque;
use std::fmt;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::ExitStatus;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::net::UnixListener;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::orchestrator::OrchestratorError;
use crate::orchestrator::metrics::progress::Console;
use crate::orchestrator::weights::WeightReceivers;
use crate::protocol::node::{NodeCommand, NodeReport};
use attribution::{Record, Waited, describe};
pub use deadline::WorkerDeadline;
use lifecycle::{Lifecycle, Loss, RestartPolicy};
use rlsync_core::protocol::ProtocolError;
use rlsync_core::protocol::frame::FrameReader;
use rlsync_core::protocol::messages::{self, Command, Frame, Hello, Report, Role};
use spawn::LogTail;
pub use spawn::Program;
pub use unix::{ShutdownHandle, ShutdownSource};

/// A worker's identity; displayed as `trainer-0`, `rollout-3` (also its log file name).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WorkerId {
    pub role: Role,
    pub rank: u32,
}

impl WorkerId {
    pub const TRAINER: WorkerId = WorkerId {
        role: Role::Trainer,
        rank: 0,
    };

    pub fn rollout(rank: u32) -> WorkerId {
        WorkerId {
            role: Role::Rollout,
            rank,
        }
    }
}

impl fmt::Display for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.role.name(), self.rank)
    }
}

/// Everything the supervisor reacts to.
pub enum Event {
    /// A worker connected and said hello.
    Connected {
        hello: Hello,
        /// The connecting process (`SO_PEERCRED`).
        peer_pid: Option<i32>,
        reader: FrameReader<OwnedReadHalf>,
        writer: OwnedWriteHalf,
    },
    /// A connection that did not produce a valid hello.
    BadHandshake {
        fault: BadHello,
        peer_pid: Option<i32>,
    },
    Report {
        id: WorkerId,
        /// The process it came from (events of a restarted worker's predecessor are ignored).
        pid: u32,
        frame: Frame<Report>,
    },
    /// The control connection of a worker closed or broke.
    Disconnected {
        id: WorkerId,
        pid: u32,
        reason: String,
    },
    Exited {
        id: WorkerId,
        pid: u32,
        status: ExitStatus,
    },
    /// A dead rollout's backoff is over: start its successor.
    Respawn {
        id: WorkerId,
    },
    /// The handshake deadline of restarted worker `pid`.
    HandshakeDue {
        id: WorkerId,
        pid: u32,
    },
    Signal {
        name: &'static str,
    },
    /// Multi-node, on the orchestrator: a node agent's link.
    Node(nodes::NodeEvent),
    /// Multi-node, on an agent: its orchestrator's link.
    Upstream(nodes::Upstream),
}

/// Why a control connection's first frame was no valid hello.
#[derive(Debug, thiserror::Error)]
pub enum BadHello {
    /// Another report (its debug form).
    #[error("first frame was {0}, not a hello")]
    NotHello(String),
    #[error("reading the hello failed")]
    Read(#[source] ProtocolError),
}

/// The sending half of a supervisor's event stream (node links and tests feed it).
pub type EventTx = mpsc::UnboundedSender<Event>;

/// A supervisor's event stream, made before it starts when something must feed it from the start.
pub fn event_channel() -> (EventTx, mpsc::UnboundedReceiver<Event>) {
    mpsc::unbounded_channel()
}

/// How commands reach a connected worker.
enum Link {
    /// Its control connection on this host.
    Local(OwnedWriteHalf),
    /// Through its node's agent.
    Remote(nodes::FrameTx),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum UnitState {
    Spawned,
    Connected,
    Stopping,
    Exited(ExitStatus),
    /// Its process was killed as lost (a restartable rollout; the [`Lifecycle`] has the rank's successor, or
    /// the run stops): its events and its exit are no longer awaited.
    Down,
}

/// What the loops get from [`Supervisor::recv`].
#[derive(Debug)]
pub enum Incoming {
    /// A worker's report.
    Report(WorkerId, Frame<Report>),
    /// A restartable rollout died: whatever it was doing is lost; its successor comes as `Restarted`.
    /// `status`: its raw wait status, when it exited.
    Lost {
        id: WorkerId,
        reason: String,
        status: Option<i32>,
    },
    /// The successor of a lost rollout connected: it needs `InitWeights` (it rejoins the weight channel).
    Restarted(WorkerId),
    /// On a node agent: what its orchestrator sent.
    Upstream(nodes::Upstream),
}

/// One worker as the supervisor sees it.
struct Unit {
    id: WorkerId,
    pid: u32,
    state: UnitState,
    link: Option<Link>,
    /// The node it runs on when that is not this host (its agent starts and stops it).
    node: Option<u32>,
    tail: LogTail,
    log_path: PathBuf,
    /// Its failure and its last exchange, for naming the first cause.
    record: Record,
}

impl Unit {
    /// A worker that node `node`'s agent starts; connected once the agent reports it ready.
    fn remote(id: WorkerId, node: u32, log_path: PathBuf) -> Unit {
        Unit::spawned(id, 0, Some(node), LogTail::default(), log_path)
    }

    /// A worker just started (`pid` 0 until its agent names it, for a remote one), not yet connected.
    fn spawned(
        id: WorkerId,
        pid: u32,
        node: Option<u32>,
        tail: LogTail,
        log_path: PathBuf,
    ) -> Unit {
        Unit {
            id,
            pid,
            state: UnitState::Spawned,
            link: None,
            node,
            tail,
            log_path,
            record: Record::default(),
        }
    }

    /// Whether its process may still run (a lost rollout's was killed).
    fn alive(&self) -> bool {
        !matches!(self.state, UnitState::Exited(_) | UnitState::Down)
    }
}

/// Settings of one supervised run.
pub struct SupervisorConfig {
    /// What the trainer runs.
    pub trainer: Program,
    /// What every rollout runs.
    pub rollout: Program,
    pub run_dir: PathBuf,
    pub control_socket: PathBuf,
    pub rollouts: u32,
    pub handshake_timeout: Duration,
    /// `None`: no step deadline.
    pub step_timeout: Option<Duration>,
    pub grace: Duration,
    /// The run's token (launch file); every hello must carry it.
    pub token: String,
    /// `runner.rollout_restarts`: restarts per rollout worker (0: a dead rollout fails the run).
    pub rollout_restarts: u32,
    /// `runner.rollout_restart_backoff_s`: the wait before a first restart.
    pub restart_backoff: Duration,
    /// The workers to start on this host (`None`: the trainer and every rollout).
    pub local: Option<Vec<WorkerId>>,
    /// Multi-node: workers on other nodes (with their node), started by those nodes' agents.
    pub remote: Vec<(WorkerId, u32)>,
    /// Multi-node: the links to the node agents.
    pub cluster: nodes::Cluster,
    /// On a node agent, its link up to node 0: a restartable rollout's death is only reported there (`lost`,
    /// with the last lines of its log), also while the agent's workers are still starting (before its
    /// `ready`); node 0 keeps its budget and backoff and asks for its successor ([`Supervisor::restart`], also
    /// honoured during the start-up). `None` on node 0 and on one host.
    pub upstream: Option<nodes::FrameTx>,
    /// Each rollout's receiver index on the trainer's weight channel (a restarted one is caught up by it);
    /// empty on a node agent, whose workers' rejoins node 0 serves.
    pub weight_receivers: WeightReceivers,
}

pub struct Supervisor {
    units: Vec<Unit>,
    events: mpsc::UnboundedReceiver<Event>,
    /// Handed to connection readers.
    tx: mpsc::UnboundedSender<Event>,
    pgid: i32,
    cfg: SupervisorConfig,
    step_deadline: Option<WorkerDeadline>,
    stop_requests: u32,
    logs: PathBuf,
    console: Console,
    /// The first node lost while a worker failure was being settled (it is then the first cause).
    node_lost: Option<OrchestratorError>,
    /// Why the run failed, for the node agents' `shutdown` (they exit non-zero and log it).
    failed: Option<String>,
    /// Every first handshake is done (`start_on` returned).
    started: bool,
    /// Nodes whose agent said it stopped, or that were lost: nothing of theirs runs any more.
    nodes_ended: Vec<u32>,
    /// The rollouts' phases, restart budgets and holds.
    lifecycle: Lifecycle,
    /// Reports that arrived during the handshakes (a worker's `built` before the others' hellos), handed out
    /// first by [`Supervisor::recv`].
    early: VecDeque<Incoming>,
}

impl Supervisor {
    /// Bind the control socket, spawn the trainer and the rollouts, and wait for every handshake.
    pub async fn start(
        cfg: SupervisorConfig,
        shutdown: ShutdownSource,
        console: Console,
    ) -> Result<Supervisor, OrchestratorError> {
        Self::start_on(cfg, shutdown, console, event_channel()).await
    }

    /// [`Supervisor::start`] on an event stream made beforehand ([`event_channel`]): this host's workers
    /// (`cfg.local`) are spawned, other nodes' (`cfg.remote`) are started by their agents, and every handshake
    /// is awaited.
    pub async fn start_on(
        cfg: SupervisorConfig,
        shutdown: ShutdownSource,
        console: Console,
        (tx, events): (EventTx, mpsc::UnboundedReceiver<Event>),
    ) -> Result<Supervisor, OrchestratorError> {
        unix::forward_signals(shutdown, tx.clone())
            .map_err(|source| OrchestratorError::Signals { source })?;
        let _ = std::fs::remove_file(&cfg.control_socket);
        let listener = UnixListener::bind(&cfg.control_socket).map_err(|source| {
            OrchestratorError::Socket {
                path: cfg.control_socket.clone(),
                source,
            }
        })?;
        // Owner only, whatever the umask (the directory holding it is 0700 too).
        std::fs::set_permissions(
            &cfg.control_socket,
            std::os::unix::fs::PermissionsExt::from_mode(0o600),
        )
        .map_err(|source| OrchestratorError::Socket {
            path: cfg.control_socket.clone(),
            source,
        })?;
        accept_loop(listener, tx.clone(), cfg.handshake_timeout);

        let logs = cfg.run_dir.join("logs");
        std::fs::create_dir_all(&logs).map_err(|source| OrchestratorError::RunDir {
            path: logs.clone(),
            source,
        })?;
        let ids: Vec<WorkerId> = match &cfg.local {
            Some(ids) => ids.clone(),
            None => std::iter::once(WorkerId::TRAINER)
                .chain((0..cfg.rollouts).map(WorkerId::rollout))
                .collect(),
        };
        let remote = cfg.remote.clone();
        let policy = match cfg.upstream {
            Some(_) => RestartPolicy::Upstream,
            None => RestartPolicy::Budget {
                restarts: cfg.rollout_restarts,
                backoff: cfg.restart_backoff,
            },
        };
        let ranks = (ids.iter().copied())
            .chain(remote.iter().map(|(id, _)| *id))
            .filter(|id| id.role == Role::Rollout)
            .map(|id| id.rank);
        let lifecycle = Lifecycle::new(policy, ranks);
        let mut sup = Supervisor {
            units: Vec::new(),
            events,
            tx: tx.clone(),
            pgid: 0,
            cfg,
            step_deadline: None,
            stop_requests: 0,
            logs,
            console,
            node_lost: None,
            failed: None,
            started: false,
            nodes_ended: Vec::new(),
            early: VecDeque::new(),
            lifecycle,
        };
        for (id, node) in remote {
            // On that node's disk: the agent's run dir is `<run_dir>/node-<k>`.
            let log_path = (sup.cfg.run_dir.join(format!("node-{node}")).join("logs"))
                .join(format!("{id}.log"));
            sup.units.push(Unit::remote(id, node, log_path));
        }
        for id in ids {
            match sup.spawn_process(id, false) {
                Ok(unit) => sup.units.push(unit),
                Err(err) => {
                    sup.run_failed(&err);
                    sup.stop(false).await;
                    return Err(err);
                }
            }
        }
        if let Err(err) = sup.await_handshakes().await {
            sup.run_failed(&err);
            sup.stop(false).await;
            return Err(err);
        }
        sup.started = true;
        Ok(sup)
    }

    /// Start worker `id`'s process; `restart`: it succeeds a dead one. Its log is appended to, as metrics.jsonl
    /// and the job log are: a run resumed in place (or a restarted worker) keeps the earlier output.
    fn spawn_process(&mut self, id: WorkerId, restart: bool) -> Result<Unit, OrchestratorError> {
        let log_path = self.logs.join(format!("{id}.log"));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|source| OrchestratorError::RunDir {
                path: log_path.clone(),
                source,
            })?;
        // A group whose every member is gone cannot be joined (a node agent's only worker died): the new
        // worker leads a new one.
        if self.pgid != 0
            && nix::sys::signal::killpg(nix::unistd::Pid::from_raw(self.pgid), None)
                == Err(nix::errno::Errno::ESRCH)
        {
            self.pgid = 0;
        }
        let pgid = (self.pgid != 0).then_some(self.pgid);
        let program = match id.role {
            Role::Trainer => &self.cfg.trainer,
            Role::Rollout => &self.cfg.rollout,
        };
        let mut child =
            spawn::spawn_worker(program, id, &self.cfg.run_dir, pgid).map_err(|source| {
                OrchestratorError::Spawn {
                    worker: id.to_string(),
                    exe: program.executable().to_owned(),
                    source,
                }
            })?;
        let pid = child.id().unwrap_or(0);
        if self.pgid == 0 {
            self.pgid = pid as i32;
        }
        let tail = LogTail::default();
        let log = Arc::new(Mutex::new(file));
        if restart && let Ok(mut f) = log.lock() {
            use std::io::Write as _;
            let _ = writeln!(f, "--- {id} restarted (pid {pid}) ---");
        }
        if let Some(out) = child.stdout.take() {
            spawn::pump_lines(out, id, log.clone(), tail.clone(), self.console.clone());
        }
        if let Some(err) = child.stderr.take() {
            spawn::pump_lines(err, id, log, tail.clone(), self.console.clone());
        }
        let exits = self.tx.clone();
        tokio::spawn(async move {
            if let Ok(status) = child.wait().await {
                let _ = exits.send(Event::Exited { id, pid, status });
            }
        });
        tracing::debug!("spawned {id} (pid {pid})");
        Ok(Unit::spawned(id, pid, None, tail, log_path))
    }

    /// Start the successor of dead rollout `id` (same rank), with a handshake deadline of its own.
    fn respawn(&mut self, id: WorkerId) -> Result<(), OrchestratorError> {
        if let Some((node, log_path)) = self
            .units
            .iter()
            .find(|u| u.id == id)
            .and_then(|u| u.node.map(|n| (n, u.log_path.clone())))
        {
            // On another node: its agent starts it (and bounds its handshake), then reports it `restarted`.
            let tx = self.cfg.cluster.link(node).map(|l| l.tx.clone());
            let restarts = self.lifecycle.restarts_of(id.rank);
            let Some(unit) = self.unit_mut(id) else {
                return Ok(());
            };
            *unit = Unit::remote(id, node, log_path);
            tracing::info!("{id}: restarting it on node {node} (restart {restarts})");
            if let Some(tx) = tx {
                tx.send(
                    &NodeCommand::Restart {
                        role: id.role,
                        rank: id.rank,
                    },
                    &[],
                );
            }
            return Ok(());
        }
        let fresh = self.spawn_process(id, true)?;
        let pid = fresh.pid;
        let restarts = self.lifecycle.restarts_of(id.rank);
        let Some(unit) = self.unit_mut(id) else {
            return Ok(());
        };
        *unit = fresh;
        tracing::info!("{id}: restarted as pid {pid} (restart {restarts})");
        let due = self.tx.clone();
        let limit = self.cfg.handshake_timeout;
        tokio::spawn(async move {
            tokio::time::sleep(limit).await;
            let _ = due.send(Event::HandshakeDue { id, pid });
        });
        Ok(())
    }

    /// Whether a failure of `id` is handled by restarting it: a rollout, restarts configured, the run not
    /// stopping, the trainer not failed, and the failure not blamed on the trainer.
    fn restartable(&self, id: WorkerId, blames: &[messages::Blame]) -> bool {
        id.role == Role::Rollout
            && self.cfg.rollout_restarts > 0
            && self.stop_requests == 0
            && !blames.iter().any(|b| b.role == Role::Trainer)
            && self
                .units
                .iter()
                .find(|u| u.id == WorkerId::TRAINER)
                .is_none_or(|t| {
                    t.record.failed_at.is_none() && !matches!(t.state, UnitState::Exited(_))
                })
    }

    /// Rollout `id` died (`cause` says how): kill what is left of it and schedule its successor, or fail the
    /// run once its restarts are used up.
    async fn lose(
        &mut self,
        id: WorkerId,
        cause: String,
    ) -> Result<Option<Incoming>, OrchestratorError> {
        let upstream = self.cfg.upstream.clone();
        if self.unit_mut(id).is_none() {
            return Ok(None);
        }
        let loss = self.lifecycle.lost(id.rank);
        let Some(unit) = self.unit_mut(id) else {
            return Ok(None);
        };
        if !matches!(unit.state, UnitState::Exited(_)) && unit.node.is_none() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(unit.pid as i32),
                Signal::SIGKILL,
            );
        }
        let status = match unit.state {
            UnitState::Exited(status) => Some(status.into_raw()),
            _ => None,
        };
        // A worker of another node is named with its node.
        let on = unit.node.map_or(String::new(), |n| format!(" on node {n}"));
        let (n, budget, delay) = match loss {
            Loss::Exhausted { restarts } => {
                unit.record.failed_at.get_or_insert(Instant::now());
                let err = self.worker_failed(id).await;
                return Err(OrchestratorError::RestartsExhausted {
                    worker: format!("{id}{on}"),
                    restarts,
                    cause: Box::new(err),
                });
            }
            Loss::ReportUp => (0, 0, Duration::ZERO),
            Loss::Restart { n, budget, delay } => (n, budget, delay),
        };
        unit.state = UnitState::Down;
        unit.link = None;
        let (pid, tail) = (unit.pid, unit.tail.lines());
        let last_lines = if tail.is_empty() {
            String::new()
        } else {
            format!("; its last lines:\n{}", tail.join("\n"))
        };
        if let Some(up) = upstream {
            // A node agent: node 0 counts the restart, waits the backoff and asks for the successor; it quotes
            // the last lines of the log should this death be one too many.
            tracing::warn!(
                "{id} (pid {pid}) {cause}; node 0 decides on its restart (runner.rollout_restarts){last_lines}"
            );
            up.send(
                &NodeReport::Lost {
                    role: id.role,
                    rank: id.rank,
                    pid,
                    cause: cause.clone(),
                    status,
                    tail: spawn::bounded_tail(tail),
                },
                &[],
            );
        } else {
            tracing::warn!(
                "{id} (pid {pid}{on}) {cause}; restarting it in {:.1} s (restart {n} of {budget}, runner.rollout_restarts){last_lines}",
                delay.as_secs_f64(),
            );
            let due = self.tx.clone();
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                let _ = due.send(Event::Respawn { id });
            });
        }
        Ok(Some(Incoming::Lost {
            id,
            reason: cause,
            status,
        }))
    }

    /// The rollouts' lifecycle: phases, versions, restarts (the weights loop reads it, and moves a rollout
    /// through its weight phases with [`Supervisor::lifecycle_mut`]).
    pub fn lifecycle(&self) -> &Lifecycle {
        &self.lifecycle
    }

    /// The rollouts' lifecycle, for the weight phases; the process side (losses, backoffs, successors) is the
    /// supervisor's own.
    pub fn lifecycle_mut(&mut self) -> &mut Lifecycle {
        &mut self.lifecycle
    }

    /// The trainer is done serving rollout `rank` (its catch-up ended): a successor of that rank held back
    /// meanwhile, so that one incarnation at a time is ever caught up, starts now.
    pub fn served(&mut self, rank: u32) -> Result<(), OrchestratorError> {
        if self.lifecycle.served(rank) {
            self.respawn(WorkerId::rollout(rank))?;
        }
        Ok(())
    }

    /// On a node agent: start the successor of lost rollout `id` now (node 0 asked; it keeps the budget and
    /// the backoff). A worker that is not lost is left alone.
    pub fn restart(&mut self, id: WorkerId) -> Result<(), OrchestratorError> {
        if id.role == Role::Rollout
            && self.unit_mut(id).is_some()
            && self.lifecycle.restart_asked(id.rank)
        {
            return self.respawn(id);
        }
        tracing::debug!("{id} is not lost: no restart");
        Ok(())
    }

    /// Kill worker `id` of this host (`reason` is what its death reports): a restartable rollout that missed
    /// the step deadline. Its death arrives as an event.
    pub fn kill(&mut self, id: WorkerId, reason: String) {
        let Some(unit) = self.unit_mut(id).filter(|u| u.node.is_none() && u.alive()) else {
            return;
        };
        tracing::warn!("{id} (pid {}): killing it: {reason}", unit.pid);
        unit.record.failure = Some(reason);
        let pid = nix::unistd::Pid::from_raw(unit.pid as i32);
        let _ = nix::sys::signal::kill(pid, Signal::SIGKILL);
        // SIGKILL stops nothing that is stopped from dying, but wake it anyway.
        let _ = nix::sys::signal::kill(pid, Signal::SIGCONT);
    }

    /// Restarts of all rollouts so far.
    pub fn restarts(&self) -> u64 {
        self.lifecycle.restarts()
    }

    /// Rollout `id`'s process connected: whether it succeeds a lost one (it rejoins the weight channel).
    fn connected_successor(&mut self, id: WorkerId) -> bool {
        id.role == Role::Rollout && self.lifecycle.connected(id.rank)
    }

    /// Whether worker `id` is connected (and not lost).
    pub fn is_connected(&self, id: WorkerId) -> bool {
        self.units
            .iter()
            .any(|u| u.id == id && u.state == UnitState::Connected)
    }

    /// The failure of a restartable rollout, or `None` when the event is not one (or is stale).
    fn loss_cause(&self, event: &Event) -> Option<(WorkerId, String)> {
        let (id, pid) = match event {
            Event::Report {
                id,
                pid,
                frame:
                    Frame {
                        header: Report::Failed { .. },
                        ..
                    },
            }
            | Event::Disconnected { id, pid, .. }
            | Event::Exited { id, pid, .. } => (*id, *pid),
            _ => return None,
        };
        let unit = self.units.iter().find(|u| u.id == id && u.pid == pid)?;
        let blames = match event {
            Event::Report {
                frame:
                    Frame {
                        header: Report::Failed { blames, .. },
                        ..
                    },
                ..
            } => blames.as_slice(),
            _ => &[],
        };
        if !self.restartable(id, blames) {
            return None;
        }
        let cause = match event {
            Event::Report {
                frame:
                    Frame {
                        header: Report::Failed { message, .. },
                        ..
                    },
                ..
            } => format!("failed: {message}"),
            Event::Exited { status, .. } => {
                attribution::death(Some(*status), unit.record.failure.as_deref())
            }
            _ => attribution::death(None, unit.record.failure.as_deref()),
        };
        Some((id, cause))
    }

    /// Whether an event comes from a process of a worker that is no longer the current one (a restarted
    /// worker's predecessor), or from a dead restartable worker: nothing to act on.
    fn is_stale(&self, event: &Event) -> bool {
        let (id, pid) = match event {
            Event::Report { id, pid, .. }
            | Event::Disconnected { id, pid, .. }
            | Event::Exited { id, pid, .. } => (*id, *pid),
            _ => return false,
        };
        self.units
            .iter()
            .find(|u| u.id == id)
            .is_some_and(|u| u.pid != pid || u.state == UnitState::Down)
    }

    async fn await_handshakes(&mut self) -> Result<(), OrchestratorError> {
        let mut deadline = WorkerDeadline::after(self.cfg.handshake_timeout);
        while self
            .units
            .iter()
            .any(|u| matches!(u.state, UnitState::Spawned | UnitState::Down))
        {
            let event = match deadline.next(&mut self.events).await {
                Some(Some(event)) => event,
                Some(None) => {
                    return Err(OrchestratorError::Handshake {
                        reason: "event channel closed".into(),
                    });
                }
                None => {
                    let missing: Vec<String> = self
                        .units
                        .iter()
                        .filter(|u| matches!(u.state, UnitState::Spawned | UnitState::Down))
                        .map(|u| u.id.to_string())
                        .collect();
                    return Err(OrchestratorError::HandshakeTimeout {
                        workers: missing.join(", "),
                        timeout_s: self.cfg.handshake_timeout.as_secs_f64(),
                    });
                }
            };
            // A rollout lost (and restarted) before the run began has nothing to catch up: every rollout
            // gets `InitWeights` next.
            match self.dispatch(event).await? {
                // A worker that built its workload before the others said hello: the bootstrap waits for it.
                Some(
                    early @ Incoming::Report(
                        _,
                        Frame {
                            header: Report::Built { .. },
                            ..
                        },
                    ),
                ) => self.early.push_back(early),
                Some(Incoming::Report(id, frame)) => {
                    return Err(OrchestratorError::Unexpected {
                        worker: id.to_string(),
                        report: format!("{:?}", frame.header),
                    });
                }
                // On an agent: the orchestrator ended the run, or went away, before the workers were up.
                Some(Incoming::Upstream(nodes::Upstream::Gone { reason })) => {
                    return Err(OrchestratorError::Handshake {
                        reason: format!("the orchestrator went away ({reason})"),
                    });
                }
                Some(Incoming::Upstream(nodes::Upstream::Command(Frame {
                    header: NodeCommand::Shutdown { failed },
                    ..
                }))) => {
                    return Err(OrchestratorError::Handshake {
                        reason: match failed {
                            // E.g. a rollout of this node lost once more than its budget allows.
                            Some(why) => format!("the run failed on node 0 ({why})"),
                            None => "the orchestrator ended the run".into(),
                        },
                    });
                }
                Some(Incoming::Upstream(nodes::Upstream::Relay(Err(source)))) => {
                    return Err(OrchestratorError::Relay { source });
                }
                // On an agent: node 0 restarts a rollout lost during the start-up (it kept the budget and
                // waited the backoff); `ready` names the successor, so its `restarted` is not sent.
                Some(Incoming::Upstream(nodes::Upstream::Command(Frame {
                    header: NodeCommand::Restart { role, rank },
                    ..
                }))) => self.restart(WorkerId { role, rank })?,
                Some(Incoming::Upstream(nodes::Upstream::Command(Frame {
                    header: NodeCommand::Kill { role, rank, reason },
                    ..
                }))) => self.kill(WorkerId { role, rank }, reason),
                _ => {}
            }
        }
        Ok(())
    }

    /// Whether `pid` is a worker this run spawned that has not connected yet.
    fn is_spawned_unconnected(&self, pid: Option<i32>) -> bool {
        self.spawned_unconnected(pid).is_some()
    }

    /// The worker spawned as process `pid` that has not said hello yet.
    fn spawned_unconnected(&self, pid: Option<i32>) -> Option<WorkerId> {
        let pid = pid?;
        self.units
            .iter()
            .find(|u| u.pid as i32 == pid && u.state == UnitState::Spawned)
            .map(|u| u.id)
    }

    fn unit_mut(&mut self, id: WorkerId) -> Option<&mut Unit> {
        self.units.iter_mut().find(|u| u.id == id)
    }

    /// Update unit state for one event; reports are handed back, failures become errors.
    async fn dispatch(&mut self, event: Event) -> Result<Option<Incoming>, OrchestratorError> {
        if self.is_stale(&event) {
            if let Event::Exited { id, pid, status } = &event {
                tracing::debug!("{id}: earlier process {pid} {}", describe(*status));
            }
            return Ok(None);
        }
        if let Some((id, cause)) = self.loss_cause(&event) {
            if let Event::Exited { status, .. } = &event
                && let Some(unit) = self.unit_mut(id)
            {
                unit.state = UnitState::Exited(*status);
            }
            // Its own words, should this death fail the run.
            if let Event::Report {
                frame:
                    Frame {
                        header: Report::Failed { message, .. },
                        ..
                    },
                ..
            } = &event
                && let Some(unit) = self.unit_mut(id)
            {
                unit.record.failure = Some(message.clone());
            }
            return self.lose(id, cause).await;
        }
        match event {
            Event::Connected {
                hello,
                peer_pid,
                reader,
                writer,
            } => {
                // Only the processes this run spawned may speak on its control socket; anyone else (another
                // run's stray worker, a same-user stranger) is dropped and logged, and the run goes on.
                if !self.is_spawned_unconnected(peer_pid) {
                    tracing::warn!(
                        "dropped a control connection from pid {}: not a worker this run is waiting for (its hello claims {}-{})",
                        peer_pid.map_or("?".to_owned(), |p| p.to_string()),
                        hello.role.name(),
                        hello.rank
                    );
                    return Ok(None);
                }
                messages::authenticate(&hello, &self.cfg.token).map_err(|source| {
                    OrchestratorError::Authentication {
                        worker: format!("{}-{}", hello.role.name(), hello.rank),
                        source,
                    }
                })?;
                let id = WorkerId {
                    role: hello.role,
                    rank: hello.rank,
                };
                let events = self.tx.clone();
                let unit = self
                    .unit_mut(id)
                    .ok_or_else(|| OrchestratorError::Handshake {
                        reason: format!("hello from unknown worker {id} (pid {})", hello.pid),
                    })?;
                if unit.state != UnitState::Spawned {
                    return Err(OrchestratorError::Handshake {
                        reason: format!("second connection claiming to be {id}"),
                    });
                }
                if peer_pid != Some(unit.pid as i32) {
                    return Err(OrchestratorError::Handshake {
                        reason: format!(
                            "the hello of {id} came from pid {}, not from the spawned pid {}",
                            peer_pid.map_or("?".to_owned(), |p| p.to_string()),
                            unit.pid
                        ),
                    });
                }
                unit.state = UnitState::Connected;
                unit.link = Some(Link::Local(writer));
                let pid = unit.pid;
                read_loop(id, pid, reader, events);
                let restarted = self.connected_successor(id);
                Ok(restarted.then_some(Incoming::Restarted(id)))
            }
            Event::BadHandshake { fault, peer_pid } => {
                if let Some(id) = self.spawned_unconnected(peer_pid) {
                    if self.restartable(id, &[]) {
                        // A restartable rollout whose hello broke (typically killed while saying it) is lost
                        // like one that died before connecting: restarted, or the run fails once its restarts
                        // are used up.
                        let cause = rlsync_core::error_chain(&fault);
                        return self
                            .lose(id, format!("broke its handshake ({cause})"))
                            .await;
                    }
                    Err(OrchestratorError::BadHello { source: fault })
                } else {
                    tracing::warn!(
                        "dropped a control connection from pid {}: {}",
                        peer_pid.map_or("?".to_owned(), |p| p.to_string()),
                        rlsync_core::error_chain(&fault)
                    );
                    Ok(None)
                }
            }
            Event::Report { id, pid, frame } => {
                if let Some(unit) = self.unit_mut(id) {
                    unit.record.last_heard = Some(Instant::now());
                }
                match frame.header {
                    Report::Failed { .. } => {
                        self.note_failure(Event::Report { id, pid, frame });
                        Err(self.worker_failed(id).await)
                    }
                    _ => Ok(Some(Incoming::Report(id, frame))),
                }
            }
            Event::Disconnected { id, pid, reason } => {
                tracing::debug!("{id} disconnected: {reason}");
                self.note_failure(Event::Disconnected { id, pid, reason });
                Err(self.worker_failed(id).await)
            }
            Event::Exited { id, pid, status } => {
                self.note_failure(Event::Exited { id, pid, status });
                Err(self.worker_failed(id).await)
            }
            Event::Respawn { id } => {
                // Held while the trainer still serves the rank: it starts on `served`.
                if id.role == Role::Rollout
                    && self.unit_mut(id).is_some()
                    && self.lifecycle.backoff_over(id.rank)
                {
                    self.respawn(id)?;
                }
                Ok(None)
            }
            Event::HandshakeDue { id, pid } => {
                let timeout_s = self.cfg.handshake_timeout.as_secs_f64();
                match self.unit_mut(id) {
                    Some(unit) if unit.pid == pid && unit.state == UnitState::Spawned => {
                        unit.record.failure = Some(format!(
                            "did not complete the handshake within {timeout_s} s (runner.handshake_timeout_s)"
                        ));
                        let cause = format!(
                            "did not complete its handshake within {timeout_s} s (runner.handshake_timeout_s)"
                        );
                        self.lose(id, cause).await
                    }
                    _ => Ok(None),
                }
            }
            Event::Signal { name } => {
                self.stop_requests += 1;
                Err(OrchestratorError::Interrupted { signal: name })
            }
            Event::Node(event) => self.on_node_event(event).await,
            Event::Upstream(event) => Ok(Some(Incoming::Upstream(event))),
        }
    }

    /// Record what a failure event says about its worker (first failure time, exit status, reason, blames).
    fn note_failure(&mut self, event: Event) {
        let now = Instant::now();
        if self.is_stale(&event) {
            return;
        }
        let (id, status, report) = match event {
            Event::Exited { id, status, .. } => (id, Some(status), None),
            Event::Disconnected { id, .. } => (id, None, None),
            Event::Report {
                id,
                frame:
                    Frame {
                        header: Report::Failed { message, blames },
                        ..
                    },
                ..
            } => (id, None, Some((message, blames))),
            Event::Signal { .. } => {
                self.stop_requests += 1;
                return;
            }
            Event::Node(nodes::NodeEvent::Lost { node, reason }) => {
                self.node_ended(node);
                if self.node_lost.is_none() {
                    self.node_lost = Some(self.lost_node_error(node, reason));
                }
                return;
            }
            _ => return,
        };
        let Some(unit) = self.unit_mut(id) else {
            return;
        };
        unit.record.failed_at.get_or_insert(now);
        if let Some(status) = status {
            unit.state = UnitState::Exited(status);
        }
        if let Some((message, blames)) = report {
            unit.record.failure = Some(message);
            unit.record.blames = blames
                .into_iter()
                .map(|b| WorkerId {
                    role: b.role,
                    rank: b.rank,
                })
                .collect();
        }
    }

    /// Build the error for a failed worker. The first cause in time is the one named: the supervisor gives the
    /// failing worker a moment to exit (so its status can be named) and the others a short moment to report
    /// failures already under way, then names the earliest worker that failed on its own; a worker that only
    /// failed because of a peer (gone, or silent past a deadline) hands the blame to that peer.
    async fn worker_failed(&mut self, id: WorkerId) -> OrchestratorError {
        let deadline = Instant::now() + Duration::from_secs(2);
        while !matches!(
            self.unit_mut(id).map(|u| u.state),
            Some(UnitState::Exited(_)) | None
        ) {
            match tokio::time::timeout_at(deadline, self.events.recv()).await {
                Ok(Some(event)) => self.note_failure(event),
                Ok(None) | Err(_) => break,
            }
        }
        // Failures of other workers already on their way (a peer's exit, its report) arrive within moments.
        let settle = Instant::now() + Duration::from_millis(500);
        while let Ok(Some(event)) = tokio::time::timeout_at(settle, self.events.recv()).await {
            self.note_failure(event);
        }
        // A node lost meanwhile is the first cause (a worker on this host failed because its chain broke).
        if let Some(err) = self.node_lost.take() {
            return err;
        }
        let records: Vec<(WorkerId, &Record)> =
            self.units.iter().map(|u| (u.id, &u.record)).collect();
        let culprit = attribution::first_cause(&records, id);
        let Some(unit) = self.units.iter().find(|u| u.id == culprit) else {
            return OrchestratorError::Handshake {
                reason: format!("unknown worker {culprit}"),
            };
        };
        let exited = match unit.state {
            UnitState::Exited(status) => Some(status),
            _ => None,
        };
        let first = (culprit != id)
            .then(|| self.units.iter().find(|u| u.id == id))
            .flatten()
            .map(|u| (u.id, &u.record));
        let (status, message) = attribution::culprit_words(
            attribution::Culprit {
                record: &unit.record,
                exited,
                remote: unit.node.is_some(),
                stopped: unit.node.is_none() && exited.is_none() && process_stopped(unit.pid),
            },
            first,
        );
        OrchestratorError::WorkerFailed {
            worker: culprit.to_string(),
            pid: unit.pid,
            status,
            message,
            log: unit.log_path.clone(),
            tail: unit.tail.lines().join("\n"),
        }
    }

    /// A worker as a missed deadline sees it.
    fn waited(u: &Unit) -> Waited {
        Waited {
            id: u.id,
            pid: u.pid,
            stopped: u.node.is_none() && process_stopped(u.pid),
            pending: u.record.pending(),
        }
    }

    /// The workers that did not answer ([`attribution::silent`]).
    fn silent_workers(&self) -> String {
        let alive: Vec<Waited> = self
            .units
            .iter()
            .filter(|u| !matches!(u.state, UnitState::Exited(_) | UnitState::Down))
            .map(Self::waited)
            .collect();
        attribution::silent(&alive)
    }

    /// Record that the run failed (before [`Supervisor::stop`]): node agents are told why.
    pub fn run_failed(&mut self, err: &OrchestratorError) {
        self.failed
            .get_or_insert_with(|| rlsync_core::error_chain(err));
    }

    /// The pid of worker `id`'s current process (on its own host).
    pub fn pid_of(&self, id: WorkerId) -> Option<u32> {
        self.units.iter().find(|u| u.id == id).map(|u| u.pid)
    }

    /// Number of rollout workers.
    pub fn rollouts(&self) -> u32 {
        self.cfg.rollouts
    }

    /// Each rollout's receiver index on the trainer's weight channel.
    pub fn weight_receivers(&self) -> &WeightReceivers {
        &self.cfg.weight_receivers
    }

    /// Start the deadline of a new step (if `runner.step_timeout_s` sets one).
    pub fn begin_step(&mut self) {
        self.step_deadline = self.cfg.step_timeout.map(WorkerDeadline::after);
    }

    /// Send a command to one worker.
    pub async fn send(
        &mut self,
        id: WorkerId,
        cmd: &Command,
        blob: &[u8],
    ) -> Result<(), OrchestratorError> {
        let elastic = self.restartable(id, &[]);
        let unit = self.units.iter_mut().find(|u| u.id == id).ok_or_else(|| {
            OrchestratorError::Handshake {
                reason: format!("no worker {id}"),
            }
        })?;
        if elastic && unit.link.is_none() {
            // Lost (or not yet connected): the loop learns of it from `Incoming::Lost` / `Restarted`.
            tracing::debug!("{id} is not connected; command dropped: {cmd:?}");
            return Ok(());
        }
        let link = unit
            .link
            .as_mut()
            .ok_or_else(|| OrchestratorError::Handshake {
                reason: format!("{id} is not connected"),
            })?;
        unit.record.last_sent = Some(Instant::now());
        let writer = match link {
            Link::Local(writer) => writer,
            Link::Remote(tx) => {
                let cmd = NodeCommand::Worker {
                    role: id.role,
                    rank: id.rank,
                    command: cmd.clone(),
                };
                // A node that is gone says so through its link's events.
                tx.send(&cmd, blob);
                return Ok(());
            }
        };
        match messages::write_frame(writer, cmd, blob).await {
            Ok(()) => Ok(()),
            // Its death arrives as an event and becomes `Incoming::Lost`.
            Err(ProtocolError::Io(_)) if elastic => Ok(()),
            Err(ProtocolError::Io(_)) => Err(self.worker_failed(id).await),
            Err(source) => Err(OrchestratorError::Protocol {
                worker: id.to_string(),
                source,
            }),
        }
    }

    /// Send one command to every rollout (restartable ones: every connected one).
    pub async fn send_rollouts(&mut self, cmd: &Command) -> Result<(), OrchestratorError> {
        for rank in 0..self.cfg.rollouts {
            self.send(WorkerId::rollout(rank), cmd, &[]).await?;
        }
        Ok(())
    }

    /// Restartable rollouts that missed the step deadline ([`attribution::late`]).
    fn late_rollouts(&self) -> Vec<WorkerId> {
        let rollouts: Vec<Waited> = self
            .units
            .iter()
            .filter(|u| u.id.role == Role::Rollout && self.restartable(u.id, &[]))
            .filter(|u| matches!(u.state, UnitState::Connected | UnitState::Spawned))
            .map(Self::waited)
            .collect();
        let trainer_owes = self
            .units
            .iter()
            .any(|u| u.id == WorkerId::TRAINER && u.record.pending());
        attribution::late(&rollouts, trainer_owes)
    }

    /// The next report of any worker. `waiting_for` names whom the caller waits on, for the step-deadline
    /// error.
    pub async fn recv(&mut self, waiting_for: &str) -> Result<Incoming, OrchestratorError> {
        if let Some(early) = self.early.pop_front() {
            return Ok(early);
        }
        loop {
            let next = match self.step_deadline.as_mut() {
                Some(deadline) => match deadline.next(&mut self.events).await {
                    Some(event) => event,
                    None => {
                        let timeout_s = self
                            .cfg
                            .step_timeout
                            .map(|t| t.as_secs_f64())
                            .unwrap_or_default();
                        let late = self.late_rollouts();
                        if !late.is_empty() {
                            // Restartable: kill them; their deaths come back as `Lost`, and the step goes on.
                            for id in late {
                                if let Some(node) =
                                    self.units.iter().find(|u| u.id == id).and_then(|u| u.node)
                                {
                                    // On another node: its agent kills it; its death comes back as `lost`.
                                    tracing::warn!(
                                        "{id} (node {node}) missed the step deadline of {timeout_s} s while the run waited for {waiting_for}: killing it"
                                    );
                                    if let Some(link) = self.cfg.cluster.link(node) {
                                        link.tx.send(
                                            &NodeCommand::Kill {
                                                role: id.role,
                                                rank: id.rank,
                                                reason: format!(
                                                    "missed the step deadline of {timeout_s} s (runner.step_timeout_s)"
                                                ),
                                            },
                                            &[],
                                        );
                                    }
                                    continue;
                                }
                                if let Some(unit) = self.unit_mut(id) {
                                    tracing::warn!(
                                        "{id} (pid {}) missed the step deadline of {timeout_s} s while the run waited for {waiting_for}: killing it",
                                        unit.pid
                                    );
                                    unit.record.failure = Some(format!(
                                        "missed the step deadline of {timeout_s} s (runner.step_timeout_s)"
                                    ));
                                    let _ = nix::sys::signal::kill(
                                        nix::unistd::Pid::from_raw(unit.pid as i32),
                                        Signal::SIGKILL,
                                    );
                                    // SIGKILL stops nothing that is stopped from dying, but wake it anyway.
                                    let _ = nix::sys::signal::kill(
                                        nix::unistd::Pid::from_raw(unit.pid as i32),
                                        Signal::SIGCONT,
                                    );
                                }
                            }
                            self.begin_step();
                            continue;
                        }
                        return Err(OrchestratorError::StepTimeout {
                            timeout_s,
                            waiting_for: waiting_for.to_owned(),
                            silent: self.silent_workers(),
                        });
                    }
                },
                None => self.events.recv().await,
            };
            let Some(event) = next else {
                return Err(OrchestratorError::Handshake {
                    reason: "every worker channel closed".into(),
                });
            };
            if let Some(report) = self.dispatch(event).await? {
                return Ok(report);
            }
        }
    }

    /// Stop every worker: `Stop` command (when `graceful`), then SIGTERM, then SIGKILL to the group, each
    /// after the grace period; a stop request arriving meanwhile kills at once. Returns once every worker is
    /// reaped (or a last bounded wait ran out).
    pub async fn stop(&mut self, graceful: bool) {
        let grace = self.cfg.grace;
        // Other nodes first: their agents stop their workers (rollouts) and say so.
        self.stop_nodes().await;
        if graceful && self.stop_requests < 2 {
            // Rollouts first: a rollout that outlives the trainer would see its weight channel break.
            for role in [Role::Rollout, Role::Trainer] {
                for unit in self.units.iter_mut().filter(|u| u.id.role == role) {
                    if let (UnitState::Connected, Some(Link::Local(writer))) =
                        (unit.state, unit.link.as_mut())
                    {
                        let _ = messages::write_frame(writer, &Command::Stop, &[]).await;
                        unit.state = UnitState::Stopping;
                    }
                }
                self.wait_exits_of(role, grace).await;
            }
        }
        if self.any_alive() && self.stop_requests < 2 {
            unix::signal_group(self.pgid, Signal::SIGTERM);
            self.wait_exits(grace).await;
        }
        if self.any_alive() {
            unix::signal_group(self.pgid, Signal::SIGKILL);
            self.wait_exits(Duration::from_secs(5)).await;
        }
        // Anything else left in the group (a worker's own children) goes too.
        unix::signal_group(self.pgid, Signal::SIGKILL);
        for unit in &mut self.units {
            unit.link = None;
        }
        let _ = std::fs::remove_file(&self.cfg.control_socket);
    }

    fn any_alive(&self) -> bool {
        self.units.iter().any(Unit::alive)
    }

    async fn wait_exits(&mut self, limit: Duration) {
        self.wait_until(limit, |sup| sup.units.iter().any(Unit::alive))
            .await
    }

    async fn wait_exits_of(&mut self, role: Role, limit: Duration) {
        let alive =
            move |sup: &Supervisor| sup.units.iter().any(|u| u.id.role == role && u.alive());
        self.wait_until(limit, alive).await
    }

    /// Process exit and signal events until `alive` is false or `limit` passes.
    async fn wait_until(&mut self, limit: Duration, alive: impl Fn(&Supervisor) -> bool) {
        let deadline = Instant::now() + limit;
        while alive(self) {
            match tokio::time::timeout_at(deadline, self.events.recv()).await {
                Ok(Some(Event::Exited { id, pid, status })) => {
                    if let Some(unit) = self.unit_mut(id)
                        && unit.pid == pid
                    {
                        unit.state = UnitState::Exited(status);
                    }
                }
                Ok(Some(Event::Signal { name })) => {
                    self.stop_requests += 1;
                    tracing::warn!("{name} while stopping: killing the workers now");
                    unix::signal_group(self.pgid, Signal::SIGKILL);
                }
                Ok(Some(Event::Node(
                    nodes::NodeEvent::Stopped { node } | nodes::NodeEvent::Lost { node, .. },
                ))) => self.node_ended(node),
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => return,
            }
        }
    }

    /// Whether the run was asked to stop (signal or handle) at least once.
    pub fn interrupted(&self) -> bool {
        self.stop_requests > 0
    }
}

/// Whether process `pid` is stopped (SIGSTOP, a debugger): state `T` or `t` in `/proc/<pid>/stat`.
fn process_stopped(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with(['T', 't']))
    })
}

/// Accept control connections and turn each first frame into `Connected` (or `BadHandshake`).
fn accept_loop(listener: UnixListener, events: mpsc::UnboundedSender<Event>, timeout: Duration) {
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                break;
            };
            let sender = events.clone();
            // SO_PEERCRED: a process of another user is refused before it can send a byte.
            let cred = stream.peer_cred().ok();
            // SAFETY: getuid has no preconditions and cannot fail.
            let uid = unsafe { libc::getuid() };
            if cred.is_none_or(|c| c.uid() != uid) {
                tracing::warn!(
                    "dropped a control connection from uid {} (pid {}): not this run's user",
                    cred.map_or("?".to_owned(), |c| c.uid().to_string()),
                    cred.and_then(|c| c.pid())
                        .map_or("?".to_owned(), |p| p.to_string())
                );
                continue;
            }
            let peer_pid = cred.and_then(|c| c.pid());
            tokio::spawn(async move {
                let (reader, writer) = stream.into_split();
                let mut reader = messages::control_reader(reader);
                let event = match tokio::time::timeout(
                    timeout,
                    messages::read_frame::<Report, _>(&mut reader),
                )
                .await
                {
                    Ok(Ok(Frame {
                        header: Report::Hello(hello),
                        ..
                    })) => Event::Connected {
                        hello,
                        peer_pid,
                        reader,
                        writer,
                    },
                    Ok(Ok(frame)) => Event::BadHandshake {
                        fault: BadHello::NotHello(format!("{:?}", frame.header)),
                        peer_pid,
                    },
                    Ok(Err(e)) => Event::BadHandshake {
                        fault: BadHello::Read(e),
                        peer_pid,
                    },
                    Err(_) => return,
                };
                let _ = sender.send(event);
            });
            if events.is_closed() {
                break;
            }
        }
    });
}

/// Forward a connected worker's reports until its connection ends.
fn read_loop(
    id: WorkerId,
    pid: u32,
    mut reader: FrameReader<OwnedReadHalf>,
    events: mpsc::UnboundedSender<Event>,
) {
    tokio::spawn(async move {
        loop {
            match messages::read_frame::<Report, _>(&mut reader).await {
                Ok(frame) => {
                    if events.send(Event::Report { id, pid, frame }).is_err() {
                        break;
                    }
                }
                Err(e) => {
                    let _ = events.send(Event::Disconnected {
                        id,
                        pid,
                        reason: rlsync_core::error_chain(&e),
                    });
                    break;
                }
            }
        }
    });
}
