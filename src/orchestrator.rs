//! The orchestrator: supervisor, synchronous and asynchronous training loops, metrics.
//!
//! [`run`] is what `rlsync train_embodied` / `train_async` call after composing the config: it writes the
//! launch file, spawns one trainer and N rollout workers through the [`supervisor`], bootstraps the rollout
//! weights, drives the [`embodied`] or [`async_loop`] loop, writes [`metrics`], and always stops every worker
//! and removes the run's sockets before returning.
//!
//! Exit codes (decided by `main`): 0 when `run` returns `Ok`; 1 for any [`OrchestratorError`] — a failed,
//! killed or silent worker (named in the message with its exit status or signal and its last log lines), a
//! handshake or step timeout, a verification mismatch, or an interrupt (`SIGINT`/`SIGTERM`: the step in
//! progress is abandoned, metrics are flushed, workers are stopped; a second signal kills them at once).

pub mod async_loop;
pub mod embodied;
pub mod metrics;
pub mod plan;
pub mod supervisor;
pub mod weights;

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::config::schema::{LoggerBackend, RunConfig};
use crate::protocol::ProtocolError;
use crate::protocol::launch::{self, LaunchSpec, LoopKind};
use crate::protocol::messages::PROTOCOL_VERSION;
use metrics::progress::Progress;
use metrics::{MetricsError, MetricsSink};
use supervisor::{Supervisor, SupervisorConfig};

pub use crate::plan::Entry;
pub use metrics::summary::RunSummary;
pub use plan::{RunPlan, plan};
pub use supervisor::{ShutdownHandle, ShutdownSource};

#[derive(Debug, thiserror::Error)]
pub enum OrchestratorError {
    #[error("invalid run configuration: {reason}")]
    Config { reason: String },
    #[error("cannot prepare {path}: {source}")]
    RunDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot start {worker} from {exe}: {source}")]
    Spawn {
        worker: String,
        exe: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot bind the control socket {path}: {source}")]
    Socket {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot install signal handlers: {source}")]
    Signals { source: std::io::Error },
    #[error(
        "{workers} did not complete the handshake within {timeout_s} s (runner.handshake_timeout_s)"
    )]
    HandshakeTimeout { workers: String, timeout_s: f64 },
    #[error("handshake failed: {reason}")]
    Handshake { reason: String },
    #[error("worker {worker} (pid {pid}) {status}{message}\n--- last lines of {} ---\n{tail}", log.display())]
    WorkerFailed {
        worker: String,
        pid: u32,
        status: String,
        message: String,
        log: PathBuf,
        tail: String,
    },
    #[error(
        "step deadline of {timeout_s} s (runner.step_timeout_s) passed while waiting for {waiting_for}"
    )]
    StepTimeout { timeout_s: f64, waiting_for: String },
    #[error(
        "weight verification failed: {worker} holds version {version} with checksum {got:#018x}, the trainer's is {expected:#018x}"
    )]
    VerifyFailed {
        worker: String,
        version: u64,
        got: u64,
        expected: u64,
    },
    #[error("interrupted by {signal}; workers stopped")]
    Interrupted { signal: &'static str },
    #[error("control message for {worker}: {source}")]
    Protocol {
        worker: String,
        source: ProtocolError,
    },
    #[error("unexpected report from {worker}: {report}")]
    Unexpected { worker: String, report: String },
    #[error("metrics: {0}")]
    Metrics(#[from] MetricsError),
    #[error("cannot start the orchestrator runtime: {0}")]
    Runtime(std::io::Error),
}

/// How a run is started beyond its config.
pub struct RunOptions {
    /// The `rlsync` binary to start workers from (`None`: this executable).
    pub worker_exe: Option<PathBuf>,
    pub shutdown: ShutdownSource,
    /// Print the final summary table to stdout.
    pub print_summary: bool,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            worker_exe: None,
            shutdown: ShutdownSource::OsSignals,
            print_summary: true,
        }
    }
}

/// Totals a loop hands back.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LoopTotals {
    pub steps: u64,
    pub env_steps: u64,
    pub wall_s: f64,
    /// train_async: chunks generated or in flight when the run ended, never trained on.
    pub unused_at_end: u64,
}

/// Names of the run's sockets and shared-memory segments; unique per run so runs never collide.
fn run_tag() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("rlsync-{}-{nanos:08x}", std::process::id())
}

fn secs(value: f64) -> Duration {
    Duration::from_secs_f64(if value.is_finite() && value > 0.0 {
        value
    } else {
        0.0
    })
}

/// Run one training job with `cfg` in `run_dir` (created if missing). Blocks until the job ends.
pub fn run(
    entry: Entry,
    cfg: &RunConfig,
    run_dir: &Path,
    opts: RunOptions,
) -> Result<RunSummary, OrchestratorError> {
    crate::rl::preflight(cfg.actor.model.model_type).map_err(|e| OrchestratorError::Config {
        reason: e.to_string(),
    })?;
    let plan = plan::plan(entry, cfg)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(OrchestratorError::Runtime)?;
    // A current-thread runtime keeps every spawn on this thread, which PR_SET_PDEATHSIG ties the workers to.
    runtime.block_on(run_plan(plan, cfg, run_dir, opts))
}

async fn run_plan(
    plan: RunPlan,
    cfg: &RunConfig,
    run_dir: &Path,
    opts: RunOptions,
) -> Result<RunSummary, OrchestratorError> {
    let private = run_dir.join(".rlsync");
    std::fs::create_dir_all(&private).map_err(|source| OrchestratorError::RunDir {
        path: private.clone(),
        source,
    })?;
    let run_dir = std::fs::canonicalize(run_dir).map_err(|source| OrchestratorError::RunDir {
        path: run_dir.to_owned(),
        source,
    })?;
    let tag = run_tag();
    let sockets = std::env::temp_dir();
    let launch = LaunchSpec {
        format_version: PROTOCOL_VERSION,
        loop_kind: if plan.entry == Entry::Async {
            LoopKind::Async
        } else {
            LoopKind::Embodied
        },
        rollouts: plan.rollouts,
        envs_per_rollout: plan.envs_per_rollout,
        control_socket: sockets.join(format!("{tag}.sock")),
        weight_socket: sockets.join(format!("{tag}-weights.sock")),
        segment_prefix: tag,
        config: cfg.clone(),
    };
    let launch_path = launch::launch_file(&run_dir);
    let bytes = launch::encode_launch(&launch).map_err(|e| OrchestratorError::Config {
        reason: e.to_string(),
    })?;
    std::fs::write(&launch_path, bytes).map_err(|source| OrchestratorError::RunDir {
        path: launch_path,
        source,
    })?;

    let exe = match opts.worker_exe {
        Some(exe) => exe,
        None => std::env::current_exe().map_err(|source| OrchestratorError::RunDir {
            path: "<current exe>".into(),
            source,
        })?,
    };
    let (progress, console) = Progress::new(plan.steps);
    let tensorboard = cfg
        .runner
        .logger
        .logger_backends
        .contains(&LoggerBackend::Tensorboard);
    let mut sink = MetricsSink::open(&run_dir, tensorboard, progress)?;
    let sup_cfg = SupervisorConfig {
        exe,
        run_dir: run_dir.clone(),
        control_socket: launch.control_socket.clone(),
        rollouts: plan.rollouts,
        handshake_timeout: secs(cfg.runner.handshake_timeout_s),
        step_timeout: (cfg.runner.step_timeout_s > 0.0).then(|| secs(cfg.runner.step_timeout_s)),
        grace: secs(cfg.runner.shutdown_grace_s),
    };
    let result = match Supervisor::start(sup_cfg, opts.shutdown, console).await {
        Ok(mut sup) => {
            let result = drive(&mut sup, &plan, cfg, &mut sink).await;
            sup.stop(true).await;
            result
        }
        Err(err) => Err(err),
    };
    // Workers are gone now; sweep what a crashed one may have left behind.
    let _ = std::fs::remove_file(&launch.weight_socket);
    let _ = std::fs::remove_file(&launch.control_socket);
    if let Err(err) = crate::transport::shm::remove_leftovers(&launch.segment_prefix) {
        tracing::warn!(
            "removing shared-memory leftovers of {}: {err}",
            launch.segment_prefix
        );
    }
    let flushed = sink.finish();
    let totals = result?;
    flushed?;
    let summary = RunSummary::from_records(&sink.history, totals.wall_s, totals.env_steps);
    if opts.print_summary {
        println!("{}", summary.table());
    }
    Ok(summary)
}

async fn drive(
    sup: &mut Supervisor,
    plan: &RunPlan,
    cfg: &RunConfig,
    sink: &mut MetricsSink,
) -> Result<LoopTotals, OrchestratorError> {
    let interval = u64::from(cfg.runner.weight_sync_interval.get());
    match plan.entry {
        Entry::Embodied | Entry::BenchSync => {
            embodied::run(sup, plan, interval, cfg.runner.verify_sync, sink).await
        }
        Entry::Async => {
            let set = async_loop::AsyncSettings {
                staleness_threshold: u64::from(cfg.algorithm.staleness_threshold),
                sync_interval: interval,
                no_wait: cfg.actor.sync_weight_no_wait,
                verify: cfg.runner.verify_sync,
                buffer_chunks: cfg.rollout.buffer_chunks.get() as usize,
            };
            async_loop::run(sup, plan, set, sink).await
        }
    }
}
