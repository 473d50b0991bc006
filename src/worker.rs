//! Worker processes (trainer, rollout) and the `Workload` trait they run; the synthetic workload.
//!
//! A worker is started by the supervisor as `rlsync worker --role trainer|rollout --rank R --run-dir D`. It
//! reads the launch file the orchestrator wrote (`<run_dir>/.rlsync/launch.json`: the resolved config, socket
//! paths), connects to the control socket, says [`Hello`] first, builds its workload and says `Built`, then
//! executes [`Command`]s until `Stop`.
//! Workers never compose configs. Exit status: 0 after `Stop`, 1 on any error (the message is on stderr, which
//! the orchestrator copies to `<run_dir>/logs/<role>-<rank>.log`, and in a `Failed` report when possible).

mod background;
pub mod gpu_channel;
pub mod host_copies;
pub mod host_shared;
pub mod local_copy;
pub mod probe;
pub mod rollout;
pub mod synthetic;
pub mod trainer;
pub mod workload;

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::net::UnixStream;
use tokio::net::unix::OwnedWriteHalf;
use tokio::sync::mpsc;

use crate::config::schema::RunConfig;
use crate::protocol::launch::{self, LaunchSpec};
use crate::worker::workload::{Workload, WorkloadError};
pub use probe::{Stage, StageProbe};
use rlsync_core::protocol::ProtocolError;
use rlsync_core::protocol::messages::{
    self, Command, Frame, Hello, InstallPhases, PROTOCOL_VERSION, Report, Role,
};
use rlsync_core::syncer::SyncReport;

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error(
        "worker usage: {reason} (expected: worker --role trainer|rollout --rank R --run-dir DIR)"
    )]
    Usage { reason: String },
    #[error("cannot read launch file {path}")]
    LaunchFile {
        path: PathBuf,
        #[source]
        error: std::io::Error,
    },
    #[error("launch file {path}")]
    LaunchFormat {
        path: PathBuf,
        #[source]
        error: ProtocolError,
    },
    #[error("cannot connect to the orchestrator at {path}")]
    Connect {
        path: PathBuf,
        #[source]
        error: std::io::Error,
    },
    #[error("control connection")]
    Protocol(#[from] ProtocolError),
    #[error("the orchestrator went away")]
    OrchestratorGone,
    #[error("weight sync")]
    Sync(#[from] rlsync_core::syncer::SyncError),
    #[error("weight transport")]
    Transport(#[from] rlsync_core::transport::TransportError),
    #[error("host-shared weights")]
    HostShared(#[from] rlsync_core::host_shared::HostSharedError),
    #[error("workload")]
    Workload(#[from] workload::WorkloadError),
    #[error("the GPU weight channel")]
    GpuChannel(#[from] rlsync_core::gpu::ipc::IpcError),
    #[error(
        "the rollouts of other hosts chose other synced tensors than the trainer's host's (the GPU channel \
         carries this host's choice): {what}"
    )]
    HostsDiffer { what: String },
    #[error("command {command} is not valid for a {role} worker")]
    UnexpectedCommand { role: &'static str, command: String },
    #[error("cannot start the worker runtime")]
    Runtime(#[source] std::io::Error),
}

impl WorkerError {
    /// The weight-channel peers this failure is about (gone, or silent past a deadline): the trainer for a
    /// rollout, rollouts by rank for the trainer. Empty when the failure is this worker's own.
    pub(crate) fn blames(&self) -> Vec<messages::Blame> {
        use rlsync_core::gpu::ipc::{IpcError, PeerError};
        use rlsync_core::host_shared::HostSharedError;
        use rlsync_core::syncer::SyncError;
        use rlsync_core::transport::{Peer, TransportError};
        // The GPU channel's ranks are the rollouts' (it serves one host).
        match self {
            WorkerError::GpuChannel(IpcError::Receiver {
                rank,
                source: PeerError::Closed | PeerError::Timeout { .. },
            }) => {
                return vec![messages::Blame {
                    role: Role::Rollout,
                    rank: *rank,
                }];
            }
            WorkerError::GpuChannel(IpcError::Sender {
                source: PeerError::Closed | PeerError::Timeout { .. },
            }) => {
                return vec![messages::Blame {
                    role: Role::Trainer,
                    rank: 0,
                }];
            }
            _ => {}
        }
        let transport = match self {
            WorkerError::Transport(e)
            | WorkerError::Sync(SyncError::Transport(e))
            | WorkerError::HostShared(HostSharedError::Sync {
                source: SyncError::Transport(e),
                ..
            }) => e,
            _ => return Vec::new(),
        };
        let peer = match transport {
            TransportError::PeerGone { peer, .. } | TransportError::Timeout { peer, .. } => peer,
            _ => return Vec::new(),
        };
        let rollout = |rank: usize| messages::Blame {
            role: Role::Rollout,
            rank: rank as u32,
        };
        match peer {
            Peer::Sender => vec![messages::Blame {
                role: Role::Trainer,
                rank: 0,
            }],
            Peer::Receiver(rank) => vec![rollout(*rank)],
            Peer::Receivers(ranks) => ranks.iter().map(|r| rollout(*r)).collect(),
            // Node agents do not exist yet: a chain peer is not a worker of this host to blame.
            Peer::Node(_) => Vec::new(),
        }
    }
}

/// Parsed `rlsync worker` arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerArgs {
    pub role: Role,
    pub rank: u32,
    pub run_dir: PathBuf,
}

/// The `worker` subcommand's flags (`--role R --rank N --run-dir D`).
pub fn parse_args(args: &[String]) -> Result<WorkerArgs, WorkerError> {
    use lexopt::{Arg, ValueExt as _};
    let usage = |reason: String| WorkerError::Usage { reason };
    // lexopt's own errors in this parser's words (the usage line names every flag).
    let word = |e: lexopt::Error| match e {
        lexopt::Error::MissingValue { option: Some(flag) } => {
            usage(format!("{flag} needs a value"))
        }
        lexopt::Error::NonUnicodeValue(value) => {
            usage(format!("{} is not UTF-8", value.to_string_lossy()))
        }
        other => usage(other.to_string()),
    };
    let (mut role, mut rank, mut run_dir) = (None, None, None);
    let mut parser = lexopt::Parser::from_args(args);
    while let Some(arg) = parser.next().map_err(word)? {
        match arg {
            Arg::Long("role") => {
                let value = parser.value().map_err(word)?.string().map_err(word)?;
                role = Some(
                    Role::parse(&value).ok_or_else(|| usage(format!("unknown role '{value}'")))?,
                )
            }
            Arg::Long("rank") => {
                let value = parser.value().map_err(word)?.string().map_err(word)?;
                rank = Some(
                    value
                        .parse::<u32>()
                        .map_err(|_| usage(format!("rank '{value}' is not a number")))?,
                )
            }
            Arg::Long("run-dir") => run_dir = Some(PathBuf::from(parser.value().map_err(word)?)),
            other => {
                let flag = match other {
                    Arg::Long(name) => format!("--{name}"),
                    Arg::Short(c) => format!("-{c}"),
                    Arg::Value(v) => v.to_string_lossy().into_owned(),
                };
                return Err(usage(format!("unknown flag '{flag}'")));
            }
        }
    }
    Ok(WorkerArgs {
        role: role.ok_or_else(|| usage("missing --role".into()))?,
        rank: rank.ok_or_else(|| usage("missing --rank".into()))?,
        run_dir: run_dir.ok_or_else(|| usage("missing --run-dir".into()))?,
    })
}

/// Builds a worker's workload once it is connected to the orchestrator: the built-in one
/// ([`workload::build`]), or the user's Python object (the `rlsync` Python package's binding).
pub type WorkloadBuilder =
    Box<dyn FnOnce(&WorkerContext) -> Result<Box<dyn Workload>, WorkloadError> + Send>;

/// Entry point of the hidden `rlsync worker` subcommand (`args` are those after `worker`).
pub fn run_worker(args: &[String]) -> Result<(), WorkerError> {
    run_worker_with(
        args,
        Box::new(|ctx| workload::build(ctx.config(), &ctx.placement())),
    )
}

/// A worker whose workload `build` makes: the same handshake, weight channel, command loop, verification and
/// failure reports for every implementation (this is what `python -m rlsync.worker` runs).
pub fn run_worker_with(args: &[String], build: WorkloadBuilder) -> Result<(), WorkerError> {
    run_worker_probed(args, build, None)
}

/// [`run_worker_with`], awaiting what `probe` gives at each [`Stage`] of the start-up (tests hold a worker
/// there; see `worker::probe`).
pub fn run_worker_probed(
    args: &[String],
    build: WorkloadBuilder,
    probe: Option<Box<dyn StageProbe>>,
) -> Result<(), WorkerError> {
    let args = parse_args(args)?;
    let path = launch::launch_file(&args.run_dir);
    let bytes = std::fs::read(&path).map_err(|error| WorkerError::LaunchFile {
        path: path.clone(),
        error,
    })?;
    let launch =
        launch::decode_launch(&bytes).map_err(|error| WorkerError::LaunchFormat { path, error })?;
    crate::logging::init_console(launch.config.runner.logger.level);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(WorkerError::Runtime)?;
    runtime.block_on(serve(args, launch, build, probe))
}

/// What every worker role gets: its identity, the launch spec and the control connection.
pub struct WorkerContext {
    pub args: WorkerArgs,
    pub launch: LaunchSpec,
    pub control: Control,
    /// What this worker awaits at each stage of its start-up (none in the shipped executables).
    pub(crate) probe: Option<Box<dyn StageProbe>>,
}

impl WorkerContext {
    pub fn config(&self) -> &RunConfig {
        &self.launch.config
    }

    /// The resolved job config as plain data (every key, also those rlsync does not read).
    pub fn job(&self) -> &serde_json::Value {
        &self.launch.job
    }

    /// Where this worker's workload runs.
    pub fn placement(&self) -> workload::Placement {
        let envs = match self.args.role {
            Role::Trainer => 1,
            Role::Rollout => self.launch.envs_per_rollout,
        };
        workload::Placement {
            role: self.args.role,
            rank: self.args.rank,
            rollouts: self.launch.rollouts,
            envs,
            run_dir: self.args.run_dir.clone(),
        }
    }

    /// Bound of every weight-transport wait. A background receiver idles for a whole train step between
    /// updates, so this is the step deadline (the orchestrator detects stuck workers itself).
    pub(crate) fn transport_timeout(&self) -> Duration {
        let runner = &self.config().runner;
        let limit = match runner.step_timeout_s.get() {
            Some(step) => step.max(runner.handshake_timeout_s.get()),
            None => Duration::from_secs(86_400),
        };
        limit.max(Duration::from_millis(100))
    }
}

/// The worker's end of the control connection: commands arrive through a reader task (so waiting for one is
/// cancel-safe inside `select!`), reports go straight to the socket.
pub struct Control {
    writer: OwnedWriteHalf,
    commands: mpsc::Receiver<Result<Frame<Command>, ProtocolError>>,
}

impl Control {
    pub async fn connect(path: &Path, hello: &Hello) -> Result<Control, WorkerError> {
        let stream = UnixStream::connect(path)
            .await
            .map_err(|error| WorkerError::Connect {
                path: path.to_owned(),
                error,
            })?;
        let (reader, mut writer) = stream.into_split();
        let mut reader = messages::control_reader(reader);
        messages::write_frame(&mut writer, &Report::Hello(hello.clone()), &[]).await?;
        let (tx, commands) = mpsc::channel(16);
        tokio::spawn(async move {
            loop {
                let frame = messages::read_frame::<Command, _>(&mut reader).await;
                let done = frame.is_err();
                if tx.send(frame).await.is_err() || done {
                    break;
                }
            }
        });
        Ok(Control { writer, commands })
    }

    /// The next command; `OrchestratorGone` when the connection closed.
    pub async fn next(&mut self) -> Result<Frame<Command>, WorkerError> {
        match self.commands.recv().await {
            Some(Ok(frame)) => Ok(frame),
            Some(Err(ProtocolError::Closed)) | None => Err(WorkerError::OrchestratorGone),
            Some(Err(e)) => Err(e.into()),
        }
    }

    pub async fn report(&mut self, report: &Report, blob: &[u8]) -> Result<(), WorkerError> {
        messages::write_frame(&mut self.writer, report, blob)
            .await
            .map_err(|e| match e {
                ProtocolError::Io(_) => WorkerError::OrchestratorGone,
                other => other.into(),
            })
    }
}

async fn serve(
    args: WorkerArgs,
    launch: LaunchSpec,
    build: WorkloadBuilder,
    probe: Option<Box<dyn StageProbe>>,
) -> Result<(), WorkerError> {
    if let Some(hold) = probe.as_ref().and_then(|p| p.at(Stage::Hello)) {
        hold.await;
    }
    let hello = Hello {
        protocol: PROTOCOL_VERSION,
        role: args.role,
        rank: args.rank,
        pid: std::process::id(),
        token: launch.token.clone(),
    };
    let control = Control::connect(&launch.control_socket, &hello).await?;
    let mut ctx = WorkerContext {
        args,
        launch,
        control,
        probe,
    };
    tracing::debug!("connected to the orchestrator");
    let result = match ctx.args.role {
        Role::Trainer => trainer::run(&mut ctx, build).await,
        Role::Rollout => rollout::run(&mut ctx, build).await,
    };
    if let Err(err) = &result {
        // Best effort: the orchestrator names this worker with the reason; it also sees the exit status.
        let _ = ctx
            .control
            .report(
                &Report::Failed {
                    message: rlsync_core::error_chain(err),
                    blames: err.blames(),
                },
                &[],
            )
            .await;
    }
    result
}

/// Tell the orchestrator the workload is built (since `building`) and the worker ready to sync: its start-up
/// ends once every worker said so.
pub(crate) async fn report_built(
    ctx: &mut WorkerContext,
    building: std::time::Instant,
) -> Result<(), WorkerError> {
    let seconds = building.elapsed().as_secs_f64();
    tracing::debug!("workload built in {seconds:.2} s");
    ctx.control.report(&Report::Built { seconds }, &[]).await
}

/// Threads for the syncer's kernels in a worker: the cores shared among the `sharers` workers that sync at the
/// same time (the syncer runs a small state on fewer: `tensor::parallel::threads_for_state`).
pub(crate) fn kernel_threads(sharers: u32) -> usize {
    let cores = rlsync_core::tensor::parallel::available_cores().get();
    (cores / sharers.max(1) as usize).max(1)
}

/// Where a rollout's install went: its receiver's phases (`report`), then, where the worker did them apart,
/// the workload's load of the written weights and the rollout's checksum.
pub(crate) fn install_phases(
    report: &SyncReport,
    load: Option<Duration>,
    checksum_s: Option<f64>,
) -> InstallPhases {
    InstallPhases {
        wait_s: report.transfer.as_secs_f64(),
        decode_s: report.decode.as_secs_f64(),
        write_s: report.apply.as_secs_f64(),
        load_s: load.map(|d| d.as_secs_f64()),
        checksum_s,
    }
}

/// The seed offset of a worker, so rollouts draw different trajectories.
pub(crate) fn worker_seed(role: Role, rank: u32) -> u64 {
    match role {
        Role::Trainer => 0,
        Role::Rollout => 1 + u64::from(rank),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn parses_worker_arguments() {
        let parsed = parse_args(&args("--role rollout --rank 3 --run-dir /tmp/x")).unwrap();
        assert_eq!(
            parsed,
            WorkerArgs {
                role: Role::Rollout,
                rank: 3,
                run_dir: "/tmp/x".into()
            }
        );
    }

    fn check_usage_error(line: &str, expect: &str) {
        let err = parse_args(&args(line)).unwrap_err().to_string();
        assert!(err.contains(expect), "'{err}' should mention '{expect}'");
    }

    #[test]
    fn a_learner_error_names_each_cause_once() {
        let rl = crate::checkpoint::CheckpointError::Invalid {
            path: "/ckpt".into(),
            reason: "metadata `version` is missing".into(),
        };
        let err = WorkerError::from(workload::WorkloadError::from(rl));
        // What the worker's `Failed` report says: every layer once, outermost first.
        let report = |e: WorkerError| rlsync_core::error_chain(&e);
        assert_eq!(
            report(err),
            "workload: checkpoint /ckpt: metadata `version` is missing"
        );
        let sync = WorkerError::from(rlsync_core::syncer::SyncError::VersionNotNewer {
            version: 2,
            last: 3,
        });
        assert_eq!(
            report(sync),
            "weight sync: version 2 is not newer than the last sent version 3"
        );
    }

    #[test]
    fn a_peer_failure_blames_the_peer() {
        use rlsync_core::transport::{Peer, TransportError};
        let gone = WorkerError::Transport(TransportError::PeerGone {
            op: "receiving",
            peer: Peer::Sender,
        });
        assert_eq!(
            gone.blames(),
            vec![messages::Blame {
                role: Role::Trainer,
                rank: 0
            }]
        );
        let late = WorkerError::Sync(rlsync_core::syncer::SyncError::Transport(
            TransportError::Timeout {
                op: "waiting for releases",
                peer: Peer::Receivers(vec![1, 3]),
                timeout: Duration::from_secs(1),
            },
        ));
        assert_eq!(
            late.blames()
                .iter()
                .map(|b| (b.role, b.rank))
                .collect::<Vec<_>>(),
            vec![(Role::Rollout, 1), (Role::Rollout, 3)]
        );
        assert!(WorkerError::OrchestratorGone.blames().is_empty());
    }

    #[test]
    fn bad_worker_arguments_are_named() {
        check_usage_error(
            "--role critic --rank 0 --run-dir d",
            "unknown role 'critic'",
        );
        check_usage_error("--role trainer --rank x --run-dir d", "rank 'x'");
        check_usage_error("--role trainer --run-dir d", "missing --rank");
        check_usage_error("--role trainer --rank 0", "missing --run-dir");
        check_usage_error("--role", "--role needs a value");
        check_usage_error("--colour red", "unknown flag '--colour'");
        check_usage_error("-r trainer", "unknown flag '-r'");
        check_usage_error("stray", "unknown flag 'stray'");
        check_usage_error("--role=trainer --rank=-1 --run-dir d", "rank '-1'");
        // A value that looks like a flag is still the value.
        let parsed = parse_args(&args("--run-dir --x --rank 0 --role=trainer")).unwrap();
        assert_eq!(parsed.run_dir, PathBuf::from("--x"));
        assert_eq!((parsed.role, parsed.rank), (Role::Trainer, 0));
    }
}
