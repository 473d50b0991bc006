//! The supervisor: spawns the workers, owns their process group, and dispatches one closed [`Event`] stream
//! (connections, reports, exits, signals) into per-worker unit state; the training loops only see reports.
//!
//! Failure policy: a worker that exits (any status) before it is told to stop, sends `Failed`, drops its
//! control connection, misses the handshake or the step deadline fails the run with an error naming it, its
//! exit status or signal, and the last lines of its log. Stopping is always: `Stop` command → grace → SIGTERM
//! to the group → grace → SIGKILL to the group; a second stop request skips straight to SIGKILL.

pub mod spawn;
pub mod unix;

use std::fmt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
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
use crate::protocol::ProtocolError;
use crate::protocol::frame::FrameReader;
use crate::protocol::messages::{self, Command, Frame, Hello, Report, Role};
use spawn::LogTail;
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
        reader: FrameReader<OwnedReadHalf>,
        writer: OwnedWriteHalf,
    },
    /// A connection that did not produce a valid hello.
    BadHandshake {
        reason: String,
    },
    Report {
        id: WorkerId,
        frame: Frame<Report>,
    },
    /// The control connection of a worker closed or broke.
    Disconnected {
        id: WorkerId,
        reason: String,
    },
    Exited {
        id: WorkerId,
        status: ExitStatus,
    },
    Signal {
        name: &'static str,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum UnitState {
    Spawned,
    Connected,
    Stopping,
    Exited(ExitStatus),
}

/// One worker as the supervisor sees it.
struct Unit {
    id: WorkerId,
    pid: u32,
    state: UnitState,
    writer: Option<OwnedWriteHalf>,
    tail: LogTail,
    log_path: PathBuf,
    /// The reason a worker gave in a `Failed` report.
    failure: Option<String>,
}

/// Settings of one supervised run.
pub struct SupervisorConfig {
    pub exe: PathBuf,
    pub run_dir: PathBuf,
    pub control_socket: PathBuf,
    pub rollouts: u32,
    pub handshake_timeout: Duration,
    /// `None`: no step deadline.
    pub step_timeout: Option<Duration>,
    pub grace: Duration,
}

pub struct Supervisor {
    units: Vec<Unit>,
    events: mpsc::UnboundedReceiver<Event>,
    /// Handed to connection readers.
    tx: mpsc::UnboundedSender<Event>,
    pgid: i32,
    cfg: SupervisorConfig,
    step_deadline: Option<Instant>,
    stop_requests: u32,
}

fn describe(status: ExitStatus) -> String {
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

impl Supervisor {
    /// Bind the control socket, spawn the trainer and the rollouts, and wait for every handshake.
    pub async fn start(
        cfg: SupervisorConfig,
        shutdown: ShutdownSource,
        console: Console,
    ) -> Result<Supervisor, OrchestratorError> {
        let (tx, events) = mpsc::unbounded_channel();
        unix::forward_signals(shutdown, tx.clone())
            .map_err(|source| OrchestratorError::Signals { source })?;
        let _ = std::fs::remove_file(&cfg.control_socket);
        let listener = UnixListener::bind(&cfg.control_socket).map_err(|source| {
            OrchestratorError::Socket {
                path: cfg.control_socket.clone(),
                source,
            }
        })?;
        accept_loop(listener, tx.clone(), cfg.handshake_timeout);

        let logs = cfg.run_dir.join("logs");
        std::fs::create_dir_all(&logs).map_err(|source| OrchestratorError::RunDir {
            path: logs.clone(),
            source,
        })?;
        let ids =
            std::iter::once(WorkerId::TRAINER).chain((0..cfg.rollouts).map(WorkerId::rollout));
        let mut sup = Supervisor {
            units: Vec::new(),
            events,
            tx: tx.clone(),
            pgid: 0,
            cfg,
            step_deadline: None,
            stop_requests: 0,
        };
        for id in ids {
            if let Err(err) = sup.spawn_unit(id, &logs, &tx, &console) {
                sup.stop(false).await;
                return Err(err);
            }
        }
        if let Err(err) = sup.await_handshakes().await {
            sup.stop(false).await;
            return Err(err);
        }
        Ok(sup)
    }

    fn spawn_unit(
        &mut self,
        id: WorkerId,
        logs: &Path,
        tx: &mpsc::UnboundedSender<Event>,
        console: &Console,
    ) -> Result<(), OrchestratorError> {
        let log_path = logs.join(format!("{id}.log"));
        let file =
            std::fs::File::create(&log_path).map_err(|source| OrchestratorError::RunDir {
                path: log_path.clone(),
                source,
            })?;
        let pgid = (self.pgid != 0).then_some(self.pgid);
        let mut child =
            spawn::spawn_worker(&self.cfg.exe, id, &self.cfg.run_dir, pgid).map_err(|source| {
                OrchestratorError::Spawn {
                    worker: id.to_string(),
                    exe: self.cfg.exe.clone(),
                    source,
                }
            })?;
        let pid = child.id().unwrap_or(0);
        if self.pgid == 0 {
            self.pgid = pid as i32;
        }
        let tail = LogTail::default();
        let log = Arc::new(Mutex::new(file));
        if let Some(out) = child.stdout.take() {
            spawn::pump_lines(out, id, log.clone(), tail.clone(), console.clone());
        }
        if let Some(err) = child.stderr.take() {
            spawn::pump_lines(err, id, log, tail.clone(), console.clone());
        }
        let exits = tx.clone();
        tokio::spawn(async move {
            if let Ok(status) = child.wait().await {
                let _ = exits.send(Event::Exited { id, status });
            }
        });
        tracing::debug!("spawned {id} (pid {pid})");
        self.units.push(Unit {
            id,
            pid,
            state: UnitState::Spawned,
            writer: None,
            tail,
            log_path,
            failure: None,
        });
        Ok(())
    }

    async fn await_handshakes(&mut self) -> Result<(), OrchestratorError> {
        let deadline = Instant::now() + self.cfg.handshake_timeout;
        while self.units.iter().any(|u| u.state == UnitState::Spawned) {
            let event = match tokio::time::timeout_at(deadline, self.events.recv()).await {
                Ok(Some(event)) => event,
                Ok(None) => {
                    return Err(OrchestratorError::Handshake {
                        reason: "event channel closed".into(),
                    });
                }
                Err(_) => {
                    let missing: Vec<String> = self
                        .units
                        .iter()
                        .filter(|u| u.state == UnitState::Spawned)
                        .map(|u| u.id.to_string())
                        .collect();
                    return Err(OrchestratorError::HandshakeTimeout {
                        workers: missing.join(", "),
                        timeout_s: self.cfg.handshake_timeout.as_secs_f64(),
                    });
                }
            };
            if let Some(report) = self.dispatch(event).await? {
                return Err(OrchestratorError::Unexpected {
                    worker: report.0.to_string(),
                    report: format!("{:?}", report.1.header),
                });
            }
        }
        Ok(())
    }

    fn unit_mut(&mut self, id: WorkerId) -> Option<&mut Unit> {
        self.units.iter_mut().find(|u| u.id == id)
    }

    /// Update unit state for one event; reports are handed back, failures become errors.
    async fn dispatch(
        &mut self,
        event: Event,
    ) -> Result<Option<(WorkerId, Frame<Report>)>, OrchestratorError> {
        match event {
            Event::Connected {
                hello,
                reader,
                writer,
            } => {
                messages::check_hello(&hello).map_err(|e| OrchestratorError::Handshake {
                    reason: format!("{}-{}: {e}", hello.role.name(), hello.rank),
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
                if unit.pid != hello.pid {
                    tracing::warn!(
                        "{id}: hello from pid {}, spawned pid {}",
                        hello.pid,
                        unit.pid
                    );
                }
                unit.state = UnitState::Connected;
                unit.writer = Some(writer);
                read_loop(id, reader, events);
                Ok(None)
            }
            Event::BadHandshake { reason } => Err(OrchestratorError::Handshake { reason }),
            Event::Report { id, frame } => match frame.header {
                Report::Failed { message } => {
                    if let Some(unit) = self.unit_mut(id) {
                        unit.failure = Some(message);
                    }
                    Err(self.worker_failed(id).await)
                }
                _ => Ok(Some((id, frame))),
            },
            Event::Disconnected { id, reason } => {
                tracing::debug!("{id} disconnected: {reason}");
                Err(self.worker_failed(id).await)
            }
            Event::Exited { id, status } => {
                if let Some(unit) = self.unit_mut(id) {
                    unit.state = UnitState::Exited(status);
                }
                Err(self.worker_failed(id).await)
            }
            Event::Signal { name } => {
                self.stop_requests += 1;
                Err(OrchestratorError::Interrupted { signal: name })
            }
        }
    }

    /// Build the error for a failed worker, after giving it a moment to exit so its status can be named.
    async fn worker_failed(&mut self, id: WorkerId) -> OrchestratorError {
        let deadline = Instant::now() + Duration::from_secs(2);
        while !matches!(
            self.unit_mut(id).map(|u| u.state),
            Some(UnitState::Exited(_)) | None
        ) {
            match tokio::time::timeout_at(deadline, self.events.recv()).await {
                Ok(Some(Event::Exited { id: who, status })) => {
                    if let Some(unit) = self.unit_mut(who) {
                        unit.state = UnitState::Exited(status);
                    }
                }
                Ok(Some(Event::Report { id: who, frame })) => {
                    if let (Report::Failed { message }, Some(unit)) =
                        (frame.header, self.unit_mut(who))
                    {
                        unit.failure = Some(message);
                    }
                }
                Ok(Some(Event::Signal { .. })) => self.stop_requests += 1,
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => break,
            }
        }
        let Some(unit) = self.units.iter().find(|u| u.id == id) else {
            return OrchestratorError::Handshake {
                reason: format!("unknown worker {id}"),
            };
        };
        let status = match unit.state {
            UnitState::Exited(status) => describe(status),
            _ => "closed its control connection".to_owned(),
        };
        OrchestratorError::WorkerFailed {
            worker: id.to_string(),
            pid: unit.pid,
            status,
            message: unit
                .failure
                .clone()
                .map(|m| format!(": {m}"))
                .unwrap_or_default(),
            log: unit.log_path.clone(),
            tail: unit.tail.lines().join("\n"),
        }
    }

    /// Number of rollout workers.
    pub fn rollouts(&self) -> u32 {
        self.cfg.rollouts
    }

    /// Start the deadline of a new step (if `runner.step_timeout_s` sets one).
    pub fn begin_step(&mut self) {
        self.step_deadline = self.cfg.step_timeout.map(|t| Instant::now() + t);
    }

    /// Send a command to one worker.
    pub async fn send(
        &mut self,
        id: WorkerId,
        cmd: &Command,
        blob: &[u8],
    ) -> Result<(), OrchestratorError> {
        let unit = self.units.iter_mut().find(|u| u.id == id).ok_or_else(|| {
            OrchestratorError::Handshake {
                reason: format!("no worker {id}"),
            }
        })?;
        let writer = unit
            .writer
            .as_mut()
            .ok_or_else(|| OrchestratorError::Handshake {
                reason: format!("{id} is not connected"),
            })?;
        match messages::write_frame(writer, cmd, blob).await {
            Ok(()) => Ok(()),
            Err(ProtocolError::Io(_)) => Err(self.worker_failed(id).await),
            Err(source) => Err(OrchestratorError::Protocol {
                worker: id.to_string(),
                source,
            }),
        }
    }

    /// Send one command to every rollout.
    pub async fn send_rollouts(&mut self, cmd: &Command) -> Result<(), OrchestratorError> {
        for rank in 0..self.cfg.rollouts {
            self.send(WorkerId::rollout(rank), cmd, &[]).await?;
        }
        Ok(())
    }

    /// The next report of any worker. `waiting_for` names whom the caller waits on, for the step-deadline
    /// error.
    pub async fn recv(
        &mut self,
        waiting_for: &str,
    ) -> Result<(WorkerId, Frame<Report>), OrchestratorError> {
        loop {
            let next = match self.step_deadline {
                Some(deadline) => match tokio::time::timeout_at(deadline, self.events.recv()).await
                {
                    Ok(event) => event,
                    Err(_) => {
                        let timeout_s = self
                            .cfg
                            .step_timeout
                            .map(|t| t.as_secs_f64())
                            .unwrap_or_default();
                        return Err(OrchestratorError::StepTimeout {
                            timeout_s,
                            waiting_for: waiting_for.to_owned(),
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
        if graceful && self.stop_requests < 2 {
            // Rollouts first: a rollout that outlives the trainer would see its weight channel break.
            for role in [Role::Rollout, Role::Trainer] {
                for unit in self.units.iter_mut().filter(|u| u.id.role == role) {
                    if let (UnitState::Connected, Some(writer)) = (unit.state, unit.writer.as_mut())
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
            unit.writer = None;
        }
        let _ = std::fs::remove_file(&self.cfg.control_socket);
    }

    fn any_alive(&self) -> bool {
        self.units
            .iter()
            .any(|u| !matches!(u.state, UnitState::Exited(_)))
    }

    async fn wait_exits(&mut self, limit: Duration) {
        self.wait_until(limit, |units| {
            units
                .iter()
                .any(|u| !matches!(u.state, UnitState::Exited(_)))
        })
        .await
    }

    async fn wait_exits_of(&mut self, role: Role, limit: Duration) {
        let alive = move |units: &[Unit]| {
            units
                .iter()
                .any(|u| u.id.role == role && !matches!(u.state, UnitState::Exited(_)))
        };
        self.wait_until(limit, alive).await
    }

    /// Process exit and signal events until `alive` is false or `limit` passes.
    async fn wait_until(&mut self, limit: Duration, alive: impl Fn(&[Unit]) -> bool) {
        let deadline = Instant::now() + limit;
        while alive(&self.units) {
            match tokio::time::timeout_at(deadline, self.events.recv()).await {
                Ok(Some(Event::Exited { id, status })) => {
                    if let Some(unit) = self.unit_mut(id) {
                        unit.state = UnitState::Exited(status);
                    }
                }
                Ok(Some(Event::Signal { name })) => {
                    self.stop_requests += 1;
                    tracing::warn!("{name} while stopping: killing the workers now");
                    unix::signal_group(self.pgid, Signal::SIGKILL);
                }
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

/// Accept control connections and turn each first frame into `Connected` (or `BadHandshake`).
fn accept_loop(listener: UnixListener, events: mpsc::UnboundedSender<Event>, timeout: Duration) {
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                break;
            };
            let sender = events.clone();
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
                        reader,
                        writer,
                    },
                    Ok(Ok(frame)) => Event::BadHandshake {
                        reason: format!("first frame was {:?}, not a hello", frame.header),
                    },
                    Ok(Err(e)) => Event::BadHandshake {
                        reason: format!("reading the hello failed: {e}"),
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
    mut reader: FrameReader<OwnedReadHalf>,
    events: mpsc::UnboundedSender<Event>,
) {
    tokio::spawn(async move {
        loop {
            match messages::read_frame::<Report, _>(&mut reader).await {
                Ok(frame) => {
                    if events.send(Event::Report { id, frame }).is_err() {
                        break;
                    }
                }
                Err(e) => {
                    let _ = events.send(Event::Disconnected {
                        id,
                        reason: e.to_string(),
                    });
                    break;
                }
            }
        }
    });
}
