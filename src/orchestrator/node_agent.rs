//! A node agent: what `rlsync train_embodied …` becomes on nodes 1..n of a multi-node run. It joins the
//! orchestrator on the rendezvous address (proving the run token), receives its workers and launch file,
//! supervises them exactly as the orchestrator does on one host (the same supervisor: process group,
//! `PR_SET_PDEATHSIG`, stop and cleanup), carries their commands and reports over its one TCP link, answers
//! heartbeats, and relays the TCP weight chain into its rollouts' shared memory (elastic when rollouts are
//! restartable). With `runner.rollout_restarts` > 0 a rollout of its that dies is reported to node 0 (`lost`,
//! with the last lines of its log), whose supervisor keeps the budget and backoff and asks for the successor
//! (`restart`); the agent starts it and reports it (`restarted`) once connected; it rejoins through the chain.
//! This holds from the start: one that dies before the agent reported its workers `ready` is restarted the
//! same way, and `ready` names its successor. It stops its workers and exits
//! when the orchestrator says so, when the link closes, or when the orchestrator is silent for
//! [`ORCHESTRATOR_SILENCE`] heartbeat timeouts; it leaves no process, socket or segment behind.

use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::AbortHandle;

use super::multinode::MultiNode;
use super::supervisor::nodes::{self, FrameTx, Upstream};
use super::supervisor::{
    EventTx, Incoming, Program, ShutdownSource, Supervisor, SupervisorConfig, WorkerId,
    event_channel,
};
use super::weights::WeightReceivers;
use super::{OrchestratorError, RunOptions, RunSummary, run_files};
use crate::config::schema::RunConfig;
use crate::protocol::launch::{self, LaunchSpec};
use crate::protocol::node::{NODE_MAGIC, NodeCommand, NodeReport, NodeWorker};
use rlsync_core::protocol::auth;
use rlsync_core::protocol::frame::FrameReader;
use rlsync_core::protocol::messages::{self, Frame, PROTOCOL_VERSION};
use rlsync_core::transport::{ChainConfig, ChainRelay, ShmConfig, ShmSender, TransportError};

/// An agent gives its orchestrator this many node timeouts of silence (a cut link, a frozen host) before it
/// stops its workers; more than the orchestrator gives a node, so a briefly suspended orchestrator does not
/// lose its nodes.
pub const ORCHESTRATOR_SILENCE: u32 = 4;

/// How the agent's link to the orchestrator failed while it was set up.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error(transparent)]
    Auth(#[from] auth::AuthError),
    #[error(transparent)]
    Protocol(#[from] rlsync_core::protocol::ProtocolError),
}

fn agent_err(multi: &MultiNode, reason: String) -> OrchestratorError {
    OrchestratorError::Agent {
        node: multi.identity.node_rank,
        host: multi.identity.host.clone(),
        reason,
    }
}

/// Run this node's agent until the run ends. `run_dir` is the job's dir; the agent works in
/// `<run_dir>/node-<rank>` (its workers' logs, launch file and lock).
pub async fn run(
    cfg: &RunConfig,
    run_dir: &Path,
    multi: MultiNode,
    opts: RunOptions,
) -> Result<RunSummary, OrchestratorError> {
    let node = multi.identity.node_rank;
    let node_dir = run_dir.join(format!("node-{node}"));
    std::fs::create_dir_all(&node_dir).map_err(|source| OrchestratorError::RunDir {
        path: node_dir.clone(),
        source,
    })?;
    let node_dir =
        std::fs::canonicalize(&node_dir).map_err(|source| OrchestratorError::RunDir {
            path: node_dir.clone(),
            source,
        })?;
    if let Some(name) = opts.job_log.as_ref().and_then(|p| p.file_name()) {
        let path = node_dir.join(name);
        if let Err(source) = crate::logging::set_job_log(Some(&path)) {
            return Err(OrchestratorError::RunDir { path, source });
        }
    }
    let result = run_in(cfg, &node_dir, &multi, opts).await;
    if let Err(err) = &result {
        crate::logging::to_job_log(&format!("Error: {}", rlsync_core::error_chain(err)));
    }
    let _ = crate::logging::set_job_log(None);
    result.map(|()| RunSummary {
        run_dir: Some(node_dir),
        ..RunSummary::default()
    })
}

async fn run_in(
    cfg: &RunConfig,
    node_dir: &Path,
    multi: &MultiNode,
    opts: RunOptions,
) -> Result<(), OrchestratorError> {
    let _lock = run_files::lock_run_dir(node_dir)?;
    // The rollouts' local weights copies (what a restarted one reloads) are this run's only.
    run_files::remove_rollout_copies(node_dir);
    let node = multi.identity.node_rank;
    let rollouts = multi.rollouts_on(node);
    let chain = if rollouts.is_empty() {
        None
    } else {
        Some(chain_listener(cfg, multi).await?)
    };
    let chain_addr = chain
        .as_ref()
        .map(|(_, addr)| addr.to_string())
        .unwrap_or_default();
    let (link, orchestrator) = join(cfg, multi, &chain_addr).await?;
    tracing::info!(
        "{}: joined the orchestrator {orchestrator}{}",
        multi.name(),
        if chain_addr.is_empty() {
            String::new()
        } else {
            format!("; weight chain listener {chain_addr}")
        }
    );
    let (link, assigned, chain_next) = await_assignment(link, cfg, multi).await?;
    let tmp = std::env::temp_dir();
    let swept = run_files::sweep_leftovers(&tmp);
    if !swept.dirs.is_empty() || swept.segments > 0 {
        tracing::info!(
            "removed leftovers of {} dead run(s) and {} shared-memory segment(s)",
            swept.dirs.len(),
            swept.segments
        );
    }
    let tag = run_files::new_tag();
    let files = run_files::PrivateDir::create(&tmp, &tag)?;
    let mut launch = *assigned.launch;
    launch.token = multi.token.clone();
    launch.control_socket = files.control_socket.clone();
    launch.weight_socket = files.weight_socket.clone();
    launch.segment_prefix = tag.clone();
    launch.node_rollouts = Some(rollouts);
    launch.chain_next = None;
    // This host's arena (`weight_syncer.host_shared`): this agent owns its name.
    launch.host_shared = launch.host_shared_for(&tag, node);
    let launch_arena = launch.host_shared.as_ref().map(|h| h.arena.clone());
    let result = serve(
        cfg,
        node_dir,
        multi,
        opts,
        link,
        launch,
        &assigned.workers,
        chain.map(|(l, _)| (l, chain_next)),
    )
    .await;
    files.remove();
    run_files::remove_rollout_copies(node_dir);
    run_files::remove_arena(launch_arena.as_deref());
    if let Err(err) = rlsync_core::transport::shm::remove_leftovers(&tag) {
        tracing::warn!(
            "removing shared-memory leftovers of {tag}: {}",
            rlsync_core::error_chain(&err)
        );
    }
    result
}

/// The address this node's weight-chain listener binds and advertises: `cluster.network.interface` (an IP
/// address or an interface name), else the local address that routes to the rendezvous host; the first free
/// port of `cluster.network.port_min..=port_max`.
async fn chain_listener(
    cfg: &RunConfig,
    multi: &MultiNode,
) -> Result<(TcpListener, SocketAddr), OrchestratorError> {
    let net = &cfg.cluster.network;
    let ip = match &net.interface {
        Some(text) => match text.parse::<IpAddr>() {
            Ok(ip) => ip,
            Err(_) => interface_ip(text).ok_or_else(|| {
                agent_err(
                    multi,
                    format!(
                        "cluster.network.interface={text}: no such interface with an IPv4 address on this host"
                    ),
                )
            })?,
        },
        None => route_to(&multi.identity.master_addr, multi.identity.master_port).map_err(
            |e| {
                agent_err(
                    multi,
                    format!(
                        "no route to the rendezvous host {}:{} ({e}); set cluster.network.interface",
                        multi.identity.master_addr, multi.identity.master_port
                    ),
                )
            },
        )?,
    };
    let mut last = None;
    for port in net.port_min..=net.port_max {
        match TcpListener::bind((ip, port)).await {
            Ok(listener) => return Ok((listener, SocketAddr::new(ip, port))),
            Err(e) => last = Some(e),
        }
    }
    Err(OrchestratorError::Listen {
        addr: format!(
            "{ip}:{}-{} (cluster.network.port_min/port_max)",
            net.port_min, net.port_max
        ),
        source: last.unwrap_or_else(|| std::io::Error::other("empty port range")),
    })
}

/// The local address the kernel would use to reach `host:port` (no packet is sent).
fn route_to(host: &str, port: u16) -> std::io::Result<IpAddr> {
    let socket = std::net::UdpSocket::bind(("0.0.0.0", 0))?;
    socket.connect((host, port))?;
    Ok(socket.local_addr()?.ip())
}

/// The first IPv4 address of interface `name`.
fn interface_ip(name: &str) -> Option<IpAddr> {
    let mut found = None;
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `list` with a linked list we only read and free once with freeifaddrs.
    unsafe {
        if libc::getifaddrs(&mut list) != 0 {
            return None;
        }
        let mut cur = list;
        while !cur.is_null() && found.is_none() {
            let ifa = &*cur;
            let addr = ifa.ifa_addr;
            if !addr.is_null()
                && i32::from((*addr).sa_family) == libc::AF_INET
                && std::ffi::CStr::from_ptr(ifa.ifa_name).to_bytes() == name.as_bytes()
            {
                let sin = &*(addr as *const libc::sockaddr_in);
                found = Some(IpAddr::V4(std::net::Ipv4Addr::from(u32::from_be(
                    sin.sin_addr.s_addr,
                ))));
            }
            cur = ifa.ifa_next;
        }
        libc::freeifaddrs(list);
    }
    found
}

/// The agent's end of its link: one frame reader for the link's life (it reads ahead), and the writer.
struct Link {
    reader: FrameReader<OwnedReadHalf>,
    writer: OwnedWriteHalf,
}

/// Connect to the orchestrator (retrying while it is not listening yet, within the handshake timeout), prove
/// the token and say who this node is.
async fn join(
    cfg: &RunConfig,
    multi: &MultiNode,
    chain_addr: &str,
) -> Result<(Link, String), OrchestratorError> {
    let id = &multi.identity;
    let addr = format!("{}:{}", id.master_addr, id.master_port);
    let timeout = cfg.runner.handshake_timeout_s.get();
    let connect = async {
        loop {
            match TcpStream::connect((id.master_addr.as_str(), id.master_port)).await {
                Ok(s) => break Ok(s),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => break Err(e),
            }
        }
    };
    let mut stream = match tokio::time::timeout(timeout, connect).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            return Err(agent_err(
                multi,
                format!("cannot reach the orchestrator at {addr}: {e}"),
            ));
        }
        Err(_) => {
            return Err(agent_err(
                multi,
                format!(
                    "the orchestrator at {addr} did not listen within {:.1} s (runner.handshake_timeout_s)",
                    timeout.as_secs_f64()
                ),
            ));
        }
    };
    let _ = stream.set_nodelay(true);
    let setup = async {
        let peer = auth::client(
            &mut stream,
            NODE_MAGIC,
            multi.token.as_bytes(),
            &multi.name(),
            &addr,
        )
        .await?;
        let join = NodeReport::Join {
            protocol: PROTOCOL_VERSION,
            node_rank: id.node_rank,
            host: id.host.clone(),
            pid: std::process::id(),
            chain_addr: chain_addr.to_owned(),
        };
        messages::write_frame(&mut stream, &join, &[]).await?;
        Ok::<String, LinkError>(peer)
    };
    match tokio::time::timeout(timeout, setup).await {
        Ok(Ok(peer)) => {
            let (r, writer) = stream.into_split();
            let reader = messages::control_reader(r);
            Ok((Link { reader, writer }, peer))
        }
        Ok(Err(source)) => Err(OrchestratorError::AgentLink {
            node: multi.identity.node_rank,
            host: multi.identity.host.clone(),
            during: "joining the orchestrator",
            source,
        }),
        Err(_) => Err(agent_err(
            multi,
            format!("the orchestrator at {addr} did not complete the node handshake"),
        )),
    }
}

struct Assigned {
    workers: Vec<NodeWorker>,
    launch: Box<LaunchSpec>,
}

/// Wait for this node's assignment (sent once every node joined), answering heartbeats meanwhile.
async fn await_assignment(
    mut link: Link,
    cfg: &RunConfig,
    multi: &MultiNode,
) -> Result<(Link, Assigned, Option<String>), OrchestratorError> {
    let timeout =
        cfg.runner.handshake_timeout_s.get() + MultiNode::node_timeout(cfg) * ORCHESTRATOR_SILENCE;
    let wait = async {
        loop {
            let frame = messages::read_frame::<NodeCommand, _>(&mut link.reader).await?;
            match frame.header {
                NodeCommand::Assign {
                    workers,
                    chain_next,
                    launch,
                } => return Ok(Some((Assigned { workers, launch }, chain_next))),
                NodeCommand::Ping { seq } => {
                    messages::write_frame(&mut link.writer, &NodeReport::Pong { seq }, &[]).await?;
                }
                NodeCommand::Shutdown { .. } => {
                    return Ok::<_, rlsync_core::protocol::ProtocolError>(None);
                }
                NodeCommand::Worker { .. }
                | NodeCommand::Restart { .. }
                | NodeCommand::Kill { .. } => {}
            }
        }
    };
    match tokio::time::timeout(timeout, wait).await {
        Ok(Ok(Some((assigned, next)))) => Ok((link, assigned, next)),
        Ok(Ok(None)) => Err(agent_err(
            multi,
            "waiting for this node's workers: the orchestrator ended the run".to_owned(),
        )),
        Ok(Err(source)) => Err(OrchestratorError::AgentLink {
            node: multi.identity.node_rank,
            host: multi.identity.host.clone(),
            during: "waiting for this node's workers",
            source: LinkError::Protocol(source),
        }),
        Err(_) => Err(agent_err(
            multi,
            "the orchestrator sent no assignment in time".to_owned(),
        )),
    }
}

/// Bound of the weight relay's waits, as a worker's: the step deadline, at least the handshake timeout; a day
/// without a step deadline.
fn transport_timeout(cfg: &RunConfig) -> Duration {
    let runner = &cfg.runner;
    let limit = match runner.step_timeout_s.get() {
        Some(step) => step.max(runner.handshake_timeout_s.get()),
        None => Duration::from_secs(86_400),
    };
    limit.max(Duration::from_millis(100))
}

/// Start the relay of the weight chain into this node's shared memory; its end arrives as an event.
fn spawn_relay(
    cfg: &RunConfig,
    multi: &MultiNode,
    launch: &LaunchSpec,
    listener: TcpListener,
    next: Option<String>,
    events: EventTx,
) -> AbortHandle {
    let shm = ShmConfig {
        socket_path: launch.weight_socket.clone(),
        segment_prefix: launch.segment_prefix.clone(),
        receivers: launch.weight_receivers(),
        timeout: transport_timeout(cfg),
        // Restartable rollouts: a dead one is detached and its successor rejoins through the chain.
        elastic: cfg.runner.rollout_restarts > 0,
        ..ShmConfig::default()
    };
    let chain = ChainConfig {
        token: multi.token.as_bytes().to_vec(),
        name: multi.name(),
        part_bytes: usize::try_from(cfg.cluster.network.part_bytes.get()).unwrap_or(usize::MAX),
        timeout: transport_timeout(cfg),
    };
    let task = tokio::spawn(async move {
        let relay = async {
            let local = ShmSender::bind(shm).await?;
            let relay = ChainRelay::establish(&listener, next.as_deref(), local, chain).await?;
            relay.serve().await
        };
        let result = relay.await.map(|_| ());
        let _ = events.send(super::supervisor::Event::Upstream(Upstream::Relay(result)));
    });
    task.abort_handle()
}

/// The link up to the orchestrator: heartbeats answered here, silence watched, everything else handed to
/// the agent's loop through its supervisor's events.
fn spawn_upstream(
    link: Link,
    events: EventTx,
    silence: Duration,
) -> (FrameTx, tokio::task::JoinHandle<()>, Vec<AbortHandle>) {
    let Link { mut reader, writer } = link;
    let (tx, writer) = nodes::spawn_writer(writer);
    let (heard_tx, mut heard) = tokio::sync::mpsc::unbounded_channel::<()>();
    let pongs = tx.clone();
    let gone = events.clone();
    let reader = tokio::spawn(async move {
        loop {
            match messages::read_frame::<NodeCommand, _>(&mut reader).await {
                Ok(frame) => {
                    let _ = heard_tx.send(());
                    if let NodeCommand::Ping { seq } = frame.header {
                        pongs.send(&NodeReport::Pong { seq }, &[]);
                        continue;
                    }
                    if gone
                        .send(super::supervisor::Event::Upstream(Upstream::Command(frame)))
                        .is_err()
                    {
                        return;
                    }
                }
                Err(e) => {
                    let reason = match e {
                        rlsync_core::protocol::ProtocolError::Closed => {
                            "it closed the link".to_owned()
                        }
                        e => rlsync_core::error_chain(&e),
                    };
                    let _ = gone.send(super::supervisor::Event::Upstream(Upstream::Gone {
                        reason,
                    }));
                    return;
                }
            }
        }
    });
    let watchdog = tokio::spawn(async move {
        if nodes::silent_for(silence, &mut heard).await {
            let _ = events.send(super::supervisor::Event::Upstream(Upstream::Gone {
                reason: format!(
                    "it did not send a heartbeat for {:.1} s",
                    silence.as_secs_f64()
                ),
            }));
        }
    });
    (
        tx,
        writer,
        vec![reader.abort_handle(), watchdog.abort_handle()],
    )
}

#[allow(clippy::too_many_arguments)]
async fn serve(
    cfg: &RunConfig,
    node_dir: &Path,
    multi: &MultiNode,
    opts: RunOptions,
    link: Link,
    launch: LaunchSpec,
    workers: &[NodeWorker],
    chain: Option<(TcpListener, Option<String>)>,
) -> Result<(), OrchestratorError> {
    let bytes = launch::encode_launch(&launch)
        .map_err(|source| OrchestratorError::LaunchFile { source })?;
    run_files::write_private(&launch::launch_file(node_dir), &bytes)?;
    let exe = match opts.worker_exe {
        Some(exe) => exe,
        None => std::env::current_exe()
            .map(|this| crate::learner_exe::worker_exe(&this))
            .map_err(|source| OrchestratorError::RunDir {
                path: "<current exe>".into(),
                source,
            })?,
    };
    let (events_tx, events_rx) = event_channel();
    let silence = MultiNode::node_timeout(cfg) * ORCHESTRATOR_SILENCE;
    let (up, writer, upstream_tasks) = spawn_upstream(link, events_tx.clone(), silence);
    let relay = chain.map(|(listener, next)| {
        spawn_relay(cfg, multi, &launch, listener, next, events_tx.clone())
    });
    let ids: Vec<WorkerId> = workers
        .iter()
        .map(|w| WorkerId {
            role: w.role,
            rank: w.rank,
        })
        .collect();
    let sup_cfg = SupervisorConfig {
        trainer: Program::for_worker(&cfg.actor.worker, &exe),
        rollout: Program::for_worker(&cfg.rollout.worker, &exe),
        run_dir: node_dir.to_owned(),
        control_socket: launch.control_socket.clone(),
        token: launch.token.clone(),
        rollouts: launch.rollouts,
        handshake_timeout: cfg.runner.handshake_timeout_s.get(),
        // The orchestrator keeps the step deadline for every worker of the run.
        step_timeout: None,
        grace: cfg.runner.shutdown_grace_s.get(),
        // Node 0 keeps the restart budget and backoff; this supervisor reports deaths and restarts on request.
        rollout_restarts: cfg.runner.rollout_restarts,
        restart_backoff: cfg.runner.rollout_restart_backoff_s.get(),
        local: Some(ids.clone()),
        remote: Vec::new(),
        cluster: nodes::Cluster::default(),
        upstream: Some(up.clone()),
        weight_receivers: WeightReceivers::default(),
    };
    let console = super::metrics::progress::Console::default();
    let outcome = match Supervisor::start_on(
        sup_cfg,
        ShutdownSource::OsSignals,
        console,
        (events_tx, events_rx),
    )
    .await
    {
        Ok(mut sup) => {
            let ready: Vec<NodeWorker> = ids
                .iter()
                .map(|&id| NodeWorker {
                    role: id.role,
                    rank: id.rank,
                    pid: sup.pid_of(id).unwrap_or(0),
                })
                .collect();
            up.send(&NodeReport::Ready { workers: ready }, &[]);
            tracing::info!("{}: {} worker(s) ready", multi.name(), ids.len());
            let outcome = relay_loop(&mut sup, &up, multi).await;
            sup.stop(true).await;
            outcome
        }
        Err(err) => Err(err),
    };
    if let Some(relay) = relay {
        relay.abort();
    }
    match &outcome {
        Ok(()) | Err(OrchestratorError::RunFailed { .. }) => up.send(&NodeReport::Stopped, &[]),
        Err(OrchestratorError::OrchestratorGone { .. }) => {}
        Err(err) => up.send(
            &NodeReport::Failed {
                message: rlsync_core::error_chain(err),
            },
            &[],
        ),
    }
    // The last frames go out before the link closes (bounded: the orchestrator may be gone).
    for t in upstream_tasks {
        t.abort();
    }
    drop(up);
    let _ = tokio::time::timeout(Duration::from_secs(2), writer).await;
    outcome
}

/// How long an agent whose weight relay broke waits for the orchestrator's `shutdown` before it fails on its
/// own: at the run's end the node before it in the chain may stop its relay (its agent told first) before
/// this agent hears that the run ended.
const RELAY_SETTLE: Duration = Duration::from_secs(2);

/// The weight relay failed (`why`): the run's end, or its failure, when the orchestrator says so within
/// [`RELAY_SETTLE`]; else this node fails, naming its relay.
async fn settle_relay_failure(
    sup: &mut Supervisor,
    multi: &MultiNode,
    why: TransportError,
) -> Result<(), OrchestratorError> {
    let deadline = tokio::time::Instant::now() + RELAY_SETTLE;
    loop {
        match tokio::time::timeout_at(deadline, sup.recv("the orchestrator's next command")).await {
            Ok(Ok(Incoming::Upstream(Upstream::Command(Frame {
                header: NodeCommand::Shutdown { failed },
                ..
            })))) => {
                return match failed {
                    None => Ok(()),
                    Some(reason) => Err(OrchestratorError::RunFailed {
                        node: multi.identity.node_rank,
                        host: multi.identity.host.clone(),
                        reason,
                    }),
                };
            }
            Ok(Ok(Incoming::Upstream(Upstream::Gone { reason }))) => {
                return Err(OrchestratorError::OrchestratorGone {
                    node: multi.identity.node_rank,
                    host: multi.identity.host.clone(),
                    reason,
                });
            }
            // Whatever else happens meanwhile follows from the broken relay.
            Ok(Ok(_)) => {}
            Ok(Err(_)) | Err(_) => {
                return Err(OrchestratorError::AgentRelay {
                    node: multi.identity.node_rank,
                    host: multi.identity.host.clone(),
                    source: why,
                });
            }
        }
    }
}

/// Carry commands down to this node's workers and their reports up until the run ends.
async fn relay_loop(
    sup: &mut Supervisor,
    up: &FrameTx,
    multi: &MultiNode,
) -> Result<(), OrchestratorError> {
    loop {
        match sup.recv("the orchestrator's next command").await? {
            Incoming::Report(id, frame) => {
                let report = NodeReport::Worker {
                    role: id.role,
                    rank: id.rank,
                    pid: sup.pid_of(id).unwrap_or(0),
                    report: frame.header,
                };
                up.send(&report, &frame.blob);
            }
            Incoming::Upstream(Upstream::Command(Frame { header, blob })) => match header {
                NodeCommand::Worker {
                    role,
                    rank,
                    command,
                } => sup.send(WorkerId { role, rank }, &command, &blob).await?,
                NodeCommand::Shutdown { failed: None } => return Ok(()),
                NodeCommand::Shutdown {
                    failed: Some(reason),
                } => {
                    return Err(OrchestratorError::RunFailed {
                        node: multi.identity.node_rank,
                        host: multi.identity.host.clone(),
                        reason,
                    });
                }
                NodeCommand::Restart { role, rank } => sup.restart(WorkerId { role, rank })?,
                NodeCommand::Kill { role, rank, reason } => {
                    sup.kill(WorkerId { role, rank }, reason);
                }
                NodeCommand::Ping { .. } | NodeCommand::Assign { .. } => {}
            },
            Incoming::Upstream(Upstream::Gone { reason }) => {
                return Err(OrchestratorError::OrchestratorGone {
                    node: multi.identity.node_rank,
                    host: multi.identity.host.clone(),
                    reason,
                });
            }
            // The head closed the chain: the run is ending; the shutdown follows.
            Incoming::Upstream(Upstream::Relay(Ok(()))) => {}
            Incoming::Upstream(Upstream::Relay(Err(why))) => {
                return settle_relay_failure(sup, multi, why).await;
            }
            // A restartable rollout died: its supervisor reported it `lost`; node 0 decides on its restart.
            Incoming::Lost { .. } => {}
            Incoming::Restarted(id) => up.send(
                &NodeReport::Restarted {
                    role: id.role,
                    rank: id.rank,
                    pid: sup.pid_of(id).unwrap_or(0),
                },
                &[],
            ),
        }
    }
}
