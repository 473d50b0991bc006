//! The supervisor's node links (multi-node runs). On the orchestrator: the TCP listener node agents join
//! (token proof, `join`), one link per agent (writer, reader, heartbeats against a [`WorkerDeadline`]), and the
//! agents' workers as units the loops address exactly like local ones (a restartable rollout an agent reports
//! `lost` is lost, budgeted and restarted through its agent like a local one, also before its agent's `ready`;
//! the last lines of its log come with the report, for the error should it be past its budget). On an agent: the link up to the
//! orchestrator, whose commands reach the agent's loop as [`Upstream`] events.

use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::AbortHandle;

use super::{Event, Incoming, Supervisor, UnitState, WorkerDeadline, WorkerId};
use crate::orchestrator::OrchestratorError;
use crate::protocol::node::{NODE_MAGIC, NodeCommand, NodeReport, NodeWorker};
use rlsync_core::protocol::auth;
use rlsync_core::protocol::frame::FrameReader;
use rlsync_core::protocol::messages::{self, Frame, PROTOCOL_VERSION};

/// What a node link tells the orchestrator's supervisor about the node itself.
#[derive(Debug)]
pub enum NodeEvent {
    /// The agent started its workers and each completed its handshake.
    Ready { node: u32, workers: Vec<NodeWorker> },
    /// The node failed, closed its link or stopped answering heartbeats.
    Lost { node: u32, reason: String },
    /// The agent stopped its workers after `shutdown`.
    Stopped { node: u32 },
    /// One of its restartable rollouts died (`cause`; `status`: its raw wait status when it exited; `tail`:
    /// the last lines of its log on that node).
    WorkerLost {
        node: u32,
        id: WorkerId,
        pid: u32,
        cause: String,
        status: Option<i32>,
        tail: Vec<String>,
    },
    /// The successor it started on `restart` completed its handshake as process `pid`.
    WorkerRestarted { node: u32, id: WorkerId, pid: u32 },
}

/// What an agent's supervisor hands its loop from the orchestrator's link (and the agent's weight relay).
#[derive(Debug)]
pub enum Upstream {
    Command(Frame<NodeCommand>),
    /// The orchestrator closed the link or stopped answering.
    Gone {
        reason: String,
    },
    /// The node's weight relay ended (`Err`: how it failed).
    Relay(Result<(), rlsync_core::transport::TransportError>),
}

/// Encoded frames to one peer, written in order by the link's writer task.
#[derive(Clone, Debug)]
pub struct FrameTx(mpsc::UnboundedSender<Vec<u8>>);

impl FrameTx {
    /// Queue one frame; a link that is gone drops it (its loss arrives as an event).
    pub fn send<T: serde::Serialize>(&self, header: &T, blob: &[u8]) {
        match messages::encode(header, blob) {
            Ok(bytes) => {
                let _ = self.0.send(bytes);
            }
            Err(e) => tracing::warn!("a node message was not sent: {e}"),
        }
    }
}

/// Start the task that writes queued frames to `w` until the queue closes or a write fails.
pub fn spawn_writer(mut w: OwnedWriteHalf) -> (FrameTx, tokio::task::JoinHandle<()>) {
    let (tx, mut rx) = mpsc::unbounded_channel::<Vec<u8>>();
    let task = tokio::spawn(async move {
        while let Some(bytes) = rx.recv().await {
            if w.write_all(&bytes).await.is_err() {
                break;
            }
        }
        let _ = w.shutdown().await;
    });
    (FrameTx(tx), task)
}

/// Heartbeat period for a node timeout: four beats per timeout, at most one a second.
pub fn heartbeat_every(timeout: Duration) -> Duration {
    (timeout / 4).clamp(Duration::from_millis(20), Duration::from_secs(1))
}

/// Wait on `heard` until it closes (`false`) or stays silent for `timeout` (`true`), not counting time this
/// process itself did not run.
pub async fn silent_for(timeout: Duration, heard: &mut mpsc::UnboundedReceiver<()>) -> bool {
    let mut deadline = WorkerDeadline::after(timeout);
    loop {
        match deadline.next(heard).await {
            Some(Some(())) => deadline = WorkerDeadline::after(timeout),
            Some(None) => return false,
            None => return true,
        }
    }
}

/// An agent that proved the token and said who it is.
pub struct Joined {
    pub node: u32,
    pub host: String,
    /// The agent's address as seen from here.
    pub addr: String,
    /// Its weight-chain listener (empty: it hosts no rollouts).
    pub chain_addr: String,
    reader: FrameReader<OwnedReadHalf>,
    writer: OwnedWriteHalf,
}

/// One agent's link, owned by the orchestrator's supervisor; its tasks end when it is dropped.
pub struct NodeLink {
    pub node: u32,
    pub host: String,
    pub addr: String,
    pub tx: FrameTx,
    tasks: Vec<AbortHandle>,
}

impl Drop for NodeLink {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// The node links of a run (empty on one host, and on an agent).
#[derive(Default)]
pub struct Cluster {
    pub links: Vec<NodeLink>,
    /// The listener's tasks, which keep refusing (and logging) late or foreign connections.
    listener: Vec<AbortHandle>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for t in &self.listener {
            t.abort();
        }
    }
}

impl Cluster {
    pub fn link(&self, node: u32) -> Option<&NodeLink> {
        self.links.iter().find(|l| l.node == node)
    }
}

/// Accept node agents on `listener` until nodes `1..num_nodes` each joined once, within `timeout` (time this
/// process did not run not counted). A peer without the token, speaking another protocol or claiming a rank
/// already taken is refused and logged, and the wait goes on; so is any connection after every node joined
/// (the listener keeps running until the returned [`Cluster`] is dropped).
pub async fn gather(
    listener: TcpListener,
    token: Vec<u8>,
    name: String,
    num_nodes: u32,
    timeout: Duration,
) -> Result<(Vec<Joined>, Cluster), OrchestratorError> {
    let (tx, mut rx) = mpsc::unbounded_channel::<Result<Joined, String>>();
    let accept = tokio::spawn(async move {
        loop {
            let Ok((stream, addr)) = listener.accept().await else {
                break;
            };
            let (tx, token, name) = (tx.clone(), token.clone(), name.clone());
            tokio::spawn(async move {
                let addr = addr.to_string();
                let joined =
                    tokio::time::timeout(timeout, handshake(stream, &token, &name, &addr)).await;
                let _ = tx.send(match joined {
                    Ok(r) => r,
                    Err(_) => Err(format!(
                        "{addr} did not complete the node handshake in {:.1} s",
                        timeout.as_secs_f64()
                    )),
                });
            });
        }
    });
    let mut cluster = Cluster {
        links: Vec::new(),
        listener: vec![accept.abort_handle()],
    };
    let mut joined: Vec<Joined> = Vec::new();
    let missing = |joined: &[Joined]| -> Vec<u32> {
        (1..num_nodes)
            .filter(|n| !joined.iter().any(|j| j.node == *n))
            .collect()
    };
    let mut deadline = WorkerDeadline::after(timeout);
    while !missing(&joined).is_empty() {
        match deadline.next(&mut rx).await {
            Some(Some(Ok(j))) => {
                if j.node == 0 || j.node >= num_nodes {
                    tracing::warn!(
                        "refused node {} ({}) at {}: this run has nodes 0..{} (cluster.num_nodes)",
                        j.node,
                        j.host,
                        j.addr,
                        num_nodes - 1
                    );
                } else if let Some(first) = joined.iter().find(|k| k.node == j.node) {
                    tracing::warn!(
                        "refused a second node {} ({}) at {}: node {} already joined from {} ({})",
                        j.node,
                        j.host,
                        j.addr,
                        j.node,
                        first.addr,
                        first.host
                    );
                } else {
                    tracing::info!("node {} ({}) joined from {}", j.node, j.host, j.addr);
                    joined.push(j);
                }
            }
            Some(Some(Err(why))) => tracing::warn!("refused a node connection: {why}"),
            Some(None) | None => {
                let names: Vec<String> = missing(&joined)
                    .iter()
                    .map(|n| format!("node {n}"))
                    .collect();
                return Err(OrchestratorError::NodesMissing {
                    nodes: names.join(", "),
                    timeout_s: timeout.as_secs_f64(),
                });
            }
        }
    }
    // From now on every connection is refused; the refusals are logged.
    let refuse = tokio::spawn(async move {
        while let Some(r) = rx.recv().await {
            match r {
                Ok(j) => tracing::warn!(
                    "refused node {} ({}) at {}: every node of this run has joined",
                    j.node,
                    j.host,
                    j.addr
                ),
                Err(why) => tracing::warn!("refused a node connection: {why}"),
            }
        }
    });
    cluster.listener.push(refuse.abort_handle());
    joined.sort_by_key(|j| j.node);
    Ok((joined, cluster))
}

/// One connection's set-up: the token proof, then the agent's `join`.
async fn handshake(
    mut stream: TcpStream,
    token: &[u8],
    name: &str,
    addr: &str,
) -> Result<Joined, String> {
    let _ = stream.set_nodelay(true);
    let peer = auth::server(&mut stream, NODE_MAGIC, token, name, addr)
        .await
        .map_err(|e| rlsync_core::error_chain(&e))?;
    let (r, writer) = stream.into_split();
    let mut reader = messages::control_reader(r);
    let frame = messages::read_frame::<NodeReport, _>(&mut reader)
        .await
        .map_err(|e| format!("{peer}: {}", rlsync_core::error_chain(&e)))?;
    match frame.header {
        NodeReport::Join {
            protocol,
            node_rank,
            host,
            chain_addr,
            ..
        } => {
            if protocol != PROTOCOL_VERSION {
                return Err(format!(
                    "{peer} speaks protocol {protocol}, this orchestrator {PROTOCOL_VERSION} (run the same rlsync on every node)"
                ));
            }
            Ok(Joined {
                node: node_rank,
                host,
                addr: addr.to_owned(),
                chain_addr,
                reader,
                writer,
            })
        }
        other => Err(format!("{peer}: first message was {other:?}, not a join")),
    }
}

/// Start the tasks of one joined agent's link: frames out, frames in (reports become the events a local
/// worker's would), heartbeats out every [`heartbeat_every`], and the watchdog that reports the node lost
/// once it was silent for `timeout`.
pub fn attach(j: Joined, events: mpsc::UnboundedSender<Event>, timeout: Duration) -> NodeLink {
    let (tx, writer) = spawn_writer(j.writer);
    let writer = writer.abort_handle();
    let (heard_tx, mut heard) = mpsc::unbounded_channel::<()>();
    let node = j.node;
    let reader = tokio::spawn(read_node(node, j.reader, events.clone(), heard_tx));
    let pinger = {
        let tx = tx.clone();
        tokio::spawn(async move {
            let mut seq = 0u64;
            loop {
                tx.send(&NodeCommand::Ping { seq }, &[]);
                seq += 1;
                tokio::time::sleep(heartbeat_every(timeout)).await;
            }
        })
    };
    let watchdog = tokio::spawn(async move {
        if silent_for(timeout, &mut heard).await {
            let _ = events.send(Event::Node(NodeEvent::Lost {
                node,
                reason: format!(
                    "did not answer for {:.1} s (cluster.node_timeout_s): its agent is stopped, \
                     frozen or cut off",
                    timeout.as_secs_f64()
                ),
            }));
        }
    });
    NodeLink {
        node,
        host: j.host,
        addr: j.addr,
        tx,
        tasks: vec![
            writer,
            reader.abort_handle(),
            pinger.abort_handle(),
            watchdog.abort_handle(),
        ],
    }
}

async fn read_node(
    node: u32,
    mut reader: FrameReader<OwnedReadHalf>,
    events: mpsc::UnboundedSender<Event>,
    heard: mpsc::UnboundedSender<()>,
) {
    loop {
        let frame = match messages::read_frame::<NodeReport, _>(&mut reader).await {
            Ok(frame) => frame,
            Err(e) => {
                let reason = match e {
                    rlsync_core::protocol::ProtocolError::Closed => {
                        "closed its control connection (its agent exited or was killed)".to_owned()
                    }
                    rlsync_core::protocol::ProtocolError::Io(e)
                        if matches!(
                            e.kind(),
                            std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
                        ) =>
                    {
                        "closed its control connection (its agent exited or was killed)".to_owned()
                    }
                    e => format!(
                        "broke its control connection: {}",
                        rlsync_core::error_chain(&e)
                    ),
                };
                let _ = events.send(Event::Node(NodeEvent::Lost { node, reason }));
                return;
            }
        };
        let _ = heard.send(());
        let event = match frame.header {
            NodeReport::Worker {
                role,
                rank,
                pid,
                report,
            } => Event::Report {
                id: WorkerId { role, rank },
                pid,
                frame: Frame {
                    header: report,
                    blob: frame.blob,
                },
            },
            NodeReport::Ready { workers } => Event::Node(NodeEvent::Ready { node, workers }),
            NodeReport::Lost {
                role,
                rank,
                pid,
                cause,
                status,
                tail,
            } => Event::Node(NodeEvent::WorkerLost {
                node,
                id: WorkerId { role, rank },
                pid,
                cause,
                status,
                tail,
            }),
            NodeReport::Restarted { role, rank, pid } => Event::Node(NodeEvent::WorkerRestarted {
                node,
                id: WorkerId { role, rank },
                pid,
            }),
            NodeReport::Failed { message } => {
                let _ = events.send(Event::Node(NodeEvent::Lost {
                    node,
                    reason: format!("failed: {message}"),
                }));
                return;
            }
            NodeReport::Stopped => {
                let _ = events.send(Event::Node(NodeEvent::Stopped { node }));
                return;
            }
            NodeReport::Pong { .. } | NodeReport::Join { .. } => continue,
        };
        if events.send(event).is_err() {
            return;
        }
    }
}

impl Supervisor {
    /// Update the units of a node for one of its events; a lost node fails the run naming it. A rollout it
    /// lost is lost (and restarted, or the run fails) exactly like one of this host.
    pub(super) async fn on_node_event(
        &mut self,
        event: NodeEvent,
    ) -> Result<Option<Incoming>, OrchestratorError> {
        match event {
            NodeEvent::Ready { node, workers } => {
                let Some(tx) = self.cfg.cluster.link(node).map(|l| l.tx.clone()) else {
                    return Ok(None);
                };
                for w in workers {
                    let id = WorkerId {
                        role: w.role,
                        rank: w.rank,
                    };
                    let unit = self
                        .unit_mut(id)
                        .filter(|u| u.node == Some(node) && u.state == UnitState::Spawned)
                        .ok_or_else(|| OrchestratorError::Handshake {
                            reason: format!("node {node} reported {id} ready, which is not placed there or already is"),
                        })?;
                    unit.pid = w.pid;
                    unit.state = UnitState::Connected;
                    unit.link = Some(super::Link::Remote(tx.clone()));
                    // A successor of one lost during the agent's start-up: `ready` names it.
                    if self.connected_successor(id) {
                        tracing::info!(
                            "{id}: restarted as pid {} on node {node} (restart {})",
                            w.pid,
                            self.lifecycle.restarts_of(id.rank)
                        );
                    }
                }
                Ok(None)
            }
            NodeEvent::Lost { node, reason } => {
                self.node_ended(node);
                Err(self.lost_node_error(node, reason))
            }
            NodeEvent::Stopped { node } => {
                self.node_ended(node);
                Ok(None)
            }
            NodeEvent::WorkerLost {
                node,
                id,
                pid,
                cause,
                status,
                tail,
            } => {
                let restartable = self.restartable(id, &[]);
                // The agent reports each incarnation's death once; a successor asked for (`Spawned`) is not
                // known here by pid until it connected.
                let Some(unit) = self.unit_mut(id).filter(|u| {
                    u.node == Some(node)
                        && (u.pid == pid || u.state == UnitState::Spawned)
                        && u.alive()
                }) else {
                    tracing::debug!(
                        "node {node}: {id} (pid {pid}) lost, which is no longer current"
                    );
                    return Ok(None);
                };
                // A successor may die before it connected: its pid is known from its agent only.
                unit.pid = pid;
                // Its log is on that node: its last lines came with the report (bounded again here).
                unit.tail.replace(tail);
                match status {
                    Some(raw) => unit.state = UnitState::Exited(ExitStatus::from_raw(raw)),
                    // Its death has no exit status (a broken connection, a missed handshake): say so.
                    None => unit.record.failure = Some(cause.clone()),
                }
                if !restartable {
                    // The run is stopping or already failing: nothing to restart.
                    unit.state = UnitState::Down;
                    unit.link = None;
                    return Ok(None);
                }
                self.lose(id, cause).await
            }
            NodeEvent::WorkerRestarted { node, id, pid } => {
                let Some(tx) = self.cfg.cluster.link(node).map(|l| l.tx.clone()) else {
                    return Ok(None);
                };
                let Some(unit) = self
                    .unit_mut(id)
                    .filter(|u| u.node == Some(node) && u.state == UnitState::Spawned)
                else {
                    tracing::debug!(
                        "node {node}: {id} restarted as pid {pid}, which was not asked for"
                    );
                    return Ok(None);
                };
                unit.pid = pid;
                unit.state = UnitState::Connected;
                unit.link = Some(super::Link::Remote(tx));
                self.connected_successor(id);
                tracing::info!(
                    "{id}: restarted as pid {pid} on node {node} (restart {})",
                    self.lifecycle.restarts_of(id.rank)
                );
                Ok(Some(Incoming::Restarted(id)))
            }
        }
    }

    /// The error naming node `node` (rank, host, address) and what happened to it.
    pub(super) fn lost_node_error(&self, node: u32, reason: String) -> OrchestratorError {
        let (host, addr) = self
            .cfg
            .cluster
            .link(node)
            .map_or(("?".to_owned(), "?".to_owned()), |l| {
                (l.host.clone(), l.addr.clone())
            });
        OrchestratorError::NodeLost {
            node,
            host,
            addr,
            reason,
        }
    }

    /// Every worker of `node` is gone (stopped by its agent, or the node is lost).
    pub(super) fn node_ended(&mut self, node: u32) {
        if !self.nodes_ended.contains(&node) {
            self.nodes_ended.push(node);
        }
        for unit in self.units.iter_mut().filter(|u| u.node == Some(node)) {
            if unit.alive() {
                unit.state = UnitState::Exited(ExitStatus::from_raw(0));
            }
            unit.link = None;
        }
    }

    /// Ask every agent to stop its workers and wait (bounded) for each to say it did; nodes that do not
    /// answer are given up on (an agent stops its workers by itself once its link closes).
    pub(super) async fn stop_nodes(&mut self) {
        if self.cfg.cluster.links.is_empty() {
            return;
        }
        let failed = self.failed.clone();
        for link in &self.cfg.cluster.links {
            link.tx.send(
                &NodeCommand::Shutdown {
                    failed: failed.clone(),
                },
                &[],
            );
        }
        let bound = self.cfg.grace * 2 + Duration::from_secs(2);
        // Every agent answers (`stopped`, or `failed`, or its link ends), also one whose workers all died
        // already (a rollout lost past its budget): its link stays up until then, so the `shutdown` with the
        // run's failure reaches it.
        self.wait_until(bound, |sup| {
            sup.cfg
                .cluster
                .links
                .iter()
                .any(|l| !sup.nodes_ended.contains(&l.node))
        })
        .await;
        let nodes: Vec<u32> = self.cfg.cluster.links.iter().map(|l| l.node).collect();
        for node in nodes {
            self.node_ended(node);
        }
        self.cfg.cluster = Cluster::default();
    }
}
