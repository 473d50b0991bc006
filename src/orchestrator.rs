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
pub mod run_files;
pub mod supervisor;
pub mod weights;

use std::path::{Path, PathBuf};

use crate::config::schema::{LoggerBackend, RunConfig, WorkerKind};
use crate::protocol::ProtocolError;
use crate::protocol::launch::{self, LaunchSpec, LoopKind};
use crate::protocol::messages::PROTOCOL_VERSION;
use metrics::progress::Progress;
use metrics::{MetricsError, MetricsSink};
use supervisor::{Program, Supervisor, SupervisorConfig};

pub use metrics::summary::RunSummary;
pub use plan::{Entry, RunPlan, plan};
pub use supervisor::{ShutdownHandle, ShutdownSource};

#[derive(Debug, thiserror::Error)]
pub enum OrchestratorError {
    #[error("invalid run configuration: {reason}")]
    Config { reason: String },
    #[error("cannot prepare {path}")]
    RunDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot start {worker} from {exe}")]
    Spawn {
        worker: String,
        exe: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot bind the control socket {path}")]
    Socket {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot install signal handlers")]
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
        "step deadline of {timeout_s} s (runner.step_timeout_s) passed while waiting for {waiting_for}; no answer from {silent}"
    )]
    StepTimeout {
        timeout_s: f64,
        waiting_for: String,
        /// The workers that did not answer (stopped ones first).
        silent: String,
    },
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
    #[error("control message for {worker}")]
    Protocol {
        worker: String,
        source: ProtocolError,
    },
    #[error("unexpected report from {worker}: {report}")]
    Unexpected { worker: String, report: String },
    #[error("metrics")]
    Metrics(#[from] MetricsError),
    #[error("cannot start the orchestrator runtime")]
    Runtime(#[source] std::io::Error),
    #[error(transparent)]
    RunFiles(#[from] run_files::RunFilesError),
}

/// How a run is started beyond its config.
pub struct RunOptions {
    /// The `rlsync` binary to start workers from (`None`: this executable).
    pub worker_exe: Option<PathBuf>,
    pub shutdown: ShutdownSource,
    /// Print the final summary table to stdout.
    pub print_summary: bool,
    /// The resolved job config as plain data, handed to Python workers (see [`LaunchSpec::job`]).
    pub job: serde_json::Value,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            worker_exe: None,
            job: serde_json::Value::Null,
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

/// Run one training job with `cfg` in `run_dir` (created if missing). Blocks until the job ends.
pub fn run(
    entry: Entry,
    cfg: &RunConfig,
    run_dir: &Path,
    opts: RunOptions,
) -> Result<RunSummary, OrchestratorError> {
    // Python workers bring their own model: `actor.model` is theirs to read.
    if cfg.actor.worker.kind == WorkerKind::Builtin {
        crate::rl::preflight(cfg.actor.model.model_type).map_err(|e| {
            OrchestratorError::Config {
                reason: e.to_string(),
            }
        })?;
    }
    if let Some(reason) = crate::dry_run::resume_problem(cfg) {
        return Err(OrchestratorError::Config { reason });
    }
    let plan = plan::plan(entry, cfg)?;
    if cfg.cluster.num_nodes.get() > 1 {
        return Err(OrchestratorError::Config {
            reason: format!(
                "cluster.num_nodes={}: this build places workers over nodes (see --dry-run) but does not \
                 start node agents yet; run on one node (cluster.num_nodes=1)",
                cfg.cluster.num_nodes
            ),
        });
    }
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
    // Held until this function returns (or the process dies): a second run in this dir is refused.
    let _lock = run_files::lock_run_dir(&run_dir)?;
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
    let result = run_in_private_dir(plan, cfg, &run_dir, opts, &tag, &files).await;
    files.remove();
    if let Err(err) = crate::transport::shm::remove_leftovers(&tag) {
        tracing::warn!(
            "removing shared-memory leftovers of {tag}: {}",
            crate::stdio::error_chain(&err)
        );
    }
    result
}

async fn run_in_private_dir(
    plan: RunPlan,
    cfg: &RunConfig,
    run_dir: &Path,
    opts: RunOptions,
    tag: &str,
    files: &run_files::PrivateDir,
) -> Result<RunSummary, OrchestratorError> {
    let run_dir = run_dir.to_owned();
    let launch = LaunchSpec {
        format_version: PROTOCOL_VERSION,
        loop_kind: if plan.entry == Entry::Async {
            LoopKind::Async
        } else {
            LoopKind::Embodied
        },
        rollouts: plan.rollouts,
        envs_per_rollout: plan.envs_per_rollout,
        control_socket: files.control_socket.clone(),
        weight_socket: files.weight_socket.clone(),
        segment_prefix: tag.to_owned(),
        token: crate::protocol::messages::new_token(),
        config: cfg.clone(),
        job: opts.job,
    };
    let launch_path = launch::launch_file(&run_dir);
    let bytes = launch::encode_launch(&launch).map_err(|e| OrchestratorError::Config {
        reason: e.to_string(),
    })?;
    run_files::write_private(&launch_path, &bytes)?;

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
        trainer: Program::for_worker(&cfg.actor.worker, &exe),
        rollout: Program::for_worker(&cfg.rollout.worker, &exe),
        run_dir: run_dir.clone(),
        control_socket: launch.control_socket.clone(),
        token: launch.token.clone(),
        rollouts: plan.rollouts,
        handshake_timeout: cfg.runner.handshake_timeout_s.get(),
        step_timeout: cfg.runner.step_timeout_s.get(),
        grace: cfg.runner.shutdown_grace_s.get(),
    };
    let result = match Supervisor::start(sup_cfg, opts.shutdown, console).await {
        Ok(mut sup) => {
            let result = drive(&mut sup, &plan, cfg, &mut sink).await;
            sup.stop(true).await;
            result
        }
        Err(err) => Err(err),
    };
    // Workers are gone now; the caller removes the private dir (sockets) and sweeps the run's segments.
    let flushed = sink.finish();
    let totals = result?;
    flushed?;
    let summary = RunSummary::from_records(&sink.history, totals.wall_s, totals.env_steps);
    if opts.print_summary {
        crate::stdio::out(format_args!("{}\n", summary.table()));
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
