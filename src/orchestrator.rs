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
pub mod checkpoint;
pub mod embodied;
pub mod eval;
pub mod metrics;
pub mod multinode;
pub mod node_agent;
pub mod plan;
pub mod run_files;
pub mod supervisor;
pub mod weights;

use std::path::{Path, PathBuf};

use crate::config::schema::{RunConfig, WorkerKind};
use crate::protocol::launch::{self, LaunchSpec, LoopKind};
use checkpoint::Checkpoints;
use metrics::progress::Progress;
use metrics::{MetricsError, MetricsSink};
use rlsync_core::protocol::ProtocolError;
use rlsync_core::protocol::messages::PROTOCOL_VERSION;
use supervisor::{Program, Supervisor, SupervisorConfig};

pub use metrics::summary::RunSummary;
pub use plan::{Entry, RunPlan, plan};
pub use supervisor::{ShutdownHandle, ShutdownSource};

#[derive(Debug, thiserror::Error)]
pub enum OrchestratorError {
    #[error("invalid run configuration: {reason}")]
    Config { reason: String },
    #[error("invalid run configuration")]
    NoLearner {
        #[source]
        source: crate::learner_exe::NoLearner,
    },
    #[error("the Python workers cannot start")]
    PythonWorkers {
        #[source]
        source: Box<supervisor::interpreter_probe::InterpreterProbeError>,
    },
    #[error("invalid run configuration")]
    Cluster {
        #[source]
        source: crate::cluster::ClusterError,
    },
    #[error("invalid run configuration")]
    Placement {
        #[source]
        source: crate::config::placement::PlacementError,
    },
    #[error("cannot encode the launch file")]
    LaunchFile {
        #[source]
        source: ProtocolError,
    },
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
    #[error("handshake failed")]
    BadHello {
        #[source]
        source: supervisor::BadHello,
    },
    #[error("handshake failed: {worker}")]
    Authentication {
        worker: String,
        #[source]
        source: ProtocolError,
    },
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
    #[error(
        "{worker} died after all its {restarts} restarts were used (runner.rollout_restarts={restarts})"
    )]
    RestartsExhausted {
        worker: String,
        restarts: u32,
        #[source]
        cause: Box<OrchestratorError>,
    },
    #[error("node {node} ({host}, {addr}) {reason}")]
    NodeLost {
        node: u32,
        host: String,
        addr: String,
        reason: String,
    },
    #[error("{nodes} did not join within {timeout_s} s (runner.handshake_timeout_s)")]
    NodesMissing { nodes: String, timeout_s: f64 },
    #[error("cannot listen on {addr}")]
    Listen {
        addr: String,
        source: std::io::Error,
    },
    #[error("node {node} ({host}): {reason}")]
    Agent {
        node: u32,
        host: String,
        reason: String,
    },
    #[error("node {node} ({host}): {during}")]
    AgentLink {
        node: u32,
        host: String,
        during: &'static str,
        #[source]
        source: node_agent::LinkError,
    },
    #[error("node {node} ({host}): its weight relay failed")]
    AgentRelay {
        node: u32,
        host: String,
        #[source]
        source: rlsync_core::transport::TransportError,
    },
    #[error("handshake failed: the weight relay failed")]
    Relay {
        #[source]
        source: rlsync_core::transport::TransportError,
    },
    #[error(
        "node {node} ({host}): the run failed on node 0 ({reason}); this node's workers are stopped"
    )]
    RunFailed {
        node: u32,
        host: String,
        reason: String,
    },
    #[error(
        "node {node} ({host}): the orchestrator went away ({reason}); this node's workers are stopped"
    )]
    OrchestratorGone {
        node: u32,
        host: String,
        reason: String,
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
    /// The learner executable that runs learner workers when `worker_exe` has no libtorch (`None`:
    /// [`crate::learner_exe::learner_exe`] of `worker_exe`).
    pub learner_exe: Option<PathBuf>,
    pub shutdown: ShutdownSource,
    /// Print the final summary table to stdout.
    pub print_summary: bool,
    /// The resolved job config as plain data, handed to Python workers (see [`LaunchSpec::job`]).
    pub job: serde_json::Value,
    /// Hydra's job log (`<run_dir>/<job_name>.log`): the orchestrator's log lines are appended to it.
    pub job_log: Option<PathBuf>,
    /// Keys of the composed config that rlsync does not read (`config::typed`), listed when the run starts.
    pub unused_keys: Vec<String>,
    /// When the job started (the summary's wall time counts from it): the process's start for the CLI's first
    /// job; by default, when these options were made.
    pub started: std::time::Instant,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            worker_exe: None,
            job: serde_json::Value::Null,
            learner_exe: None,
            shutdown: ShutdownSource::OsSignals,
            print_summary: true,
            job_log: None,
            unused_keys: Vec::new(),
            started: std::time::Instant::now(),
        }
    }
}

/// The line that lists the keys a config holds and rlsync does not use (`--dry-run` prints it too). With
/// Python workers, which get the whole job config, it says that they may read them.
pub fn unused_keys_line(keys: &[String], cfg: &RunConfig) -> String {
    let python = cfg.actor.worker.kind == WorkerKind::Python
        || cfg.rollout.worker.kind == WorkerKind::Python;
    format!(
        "keys in this config that rlsync does not use ({}){}: {}",
        keys.len(),
        if python {
            ", though your Python workers may (they get the whole job config)"
        } else {
            ""
        },
        keys.join(", ")
    )
}

/// Totals a loop hands back.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LoopTotals {
    pub steps: u64,
    pub env_steps: u64,
    /// The loop alone: from after the init bootstrap to its end.
    pub loop_s: f64,
    /// Before the init bootstrap: the wait until every worker built its workload (the workers' start-up's end).
    pub ready_s: f64,
    /// The init bootstrap before the loop: its time and payload bytes.
    pub bootstrap_s: f64,
    pub bootstrap_bytes: u64,
    /// train_async: chunks generated or in flight when the run ended, never trained on.
    pub unused_at_end: u64,
}

/// Run one training job with `cfg` in `run_dir` (created if missing). Blocks until the job ends.
pub fn run(
    entry: Entry,
    cfg: &RunConfig,
    run_dir: &Path,
    mut opts: RunOptions,
) -> Result<RunSummary, OrchestratorError> {
    // Python workers bring their own model: `actor.model` is theirs to read. Built-in workers of a learner model
    // start from the learner executable (see `learner_exe::preflight`).
    if cfg.actor.worker.kind == WorkerKind::Builtin {
        // `this`: the rlsync whose neighbour the learner is (the caller's, else the running one).
        let given = opts.worker_exe.take();
        let this = match &given {
            Some(exe) => exe.clone(),
            None => std::env::current_exe().map_err(|source| OrchestratorError::RunDir {
                path: "<current exe>".into(),
                source,
            })?,
        };
        let worker = given.unwrap_or_else(|| crate::learner_exe::worker_exe(&this));
        let learner = match opts.learner_exe.take() {
            Some(exe) => exe,
            None => crate::learner_exe::learner_exe(&this),
        };
        let exe = crate::learner_exe::preflight(cfg.actor.model.model_type, &worker, &learner)
            .map_err(|source| OrchestratorError::NoLearner { source })?;
        if cfg.gpu_channel()
            && let Some(reason) = crate::learner_exe::gpu_channel_refusal(&exe, &this, &learner)
        {
            return Err(OrchestratorError::Config { reason });
        }
        opts.worker_exe = Some(exe);
    }
    // Python workers: their interpreter must import rlsync and their entries (and on a GPU, its torch must see
    // it), or the run stops here, once, rather than inside every worker.
    supervisor::interpreter_probe::check(cfg).map_err(|source| {
        OrchestratorError::PythonWorkers {
            source: Box::new(source),
        }
    })?;
    if let Some(reason) = plan::resume_problem(cfg) {
        return Err(OrchestratorError::Config { reason });
    }
    let mut plan = plan::plan(entry, cfg)?;
    plan.start = plan::resume_point(cfg, plan.steps)?;
    let multi = multinode::prepare(cfg)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(OrchestratorError::Runtime)?;
    // A current-thread runtime keeps every spawn on this thread, which PR_SET_PDEATHSIG ties the workers to.
    match multi {
        // Nodes 1..n: a node agent under the orchestrator on node 0.
        Some(m) if m.identity.node_rank > 0 => {
            runtime.block_on(node_agent::run(cfg, run_dir, m, opts))
        }
        multi => runtime.block_on(run_plan(plan, cfg, run_dir, opts, multi)),
    }
}

async fn run_plan(
    plan: RunPlan,
    cfg: &RunConfig,
    run_dir: &Path,
    opts: RunOptions,
    multi: Option<multinode::MultiNode>,
) -> Result<RunSummary, OrchestratorError> {
    if let Some(path) = &opts.job_log
        && let Err(source) = crate::logging::set_job_log(Some(path))
    {
        return Err(OrchestratorError::RunDir {
            path: path.clone(),
            source,
        });
    }
    let result = run_logged(plan, cfg, run_dir, opts, multi).await;
    // The failure goes to the job log only: main prints it on stderr (once, after everything else, so the
    // worker log lines it quotes never come before its own `Error:` line).
    if let Err(err) = &result {
        let text = format!("Error: {}", rlsync_core::error_chain(err));
        for line in text.lines() {
            crate::logging::to_job_log(line);
        }
    }
    let _ = crate::logging::set_job_log(None);
    result
}

async fn run_logged(
    plan: RunPlan,
    cfg: &RunConfig,
    run_dir: &Path,
    opts: RunOptions,
    multi: Option<multinode::MultiNode>,
) -> Result<RunSummary, OrchestratorError> {
    tracing::info!("run dir: {}", run_dir.display());
    if !opts.unused_keys.is_empty() {
        tracing::info!("{}", unused_keys_line(&opts.unused_keys, cfg));
    }
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
    // The rollouts' local weights copies are this run's alone: a previous run's go, and this run's at its end.
    run_files::remove_rollout_copies(&run_dir);
    let tag = run_files::new_tag();
    let files = run_files::PrivateDir::create(&tmp, &tag)?;
    let result = run_in_private_dir(plan, cfg, &run_dir, opts, &tag, &files, multi).await;
    files.remove();
    run_files::remove_rollout_copies(&run_dir);
    // The host-shared arena outlives its rollouts (a restarted one reopens it): the run removes it, however it
    // ended; `sweep_leftovers` removes it after a SIGKILL of this process.
    if cfg.weight_syncer.host_shared {
        run_files::remove_arena(Some(&launch::arena_name(&tag, 0)));
    }
    if let Err(err) = rlsync_core::transport::shm::remove_leftovers(&tag) {
        tracing::warn!(
            "removing shared-memory leftovers of {tag}: {}",
            rlsync_core::error_chain(&err)
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
    multi: Option<multinode::MultiNode>,
) -> Result<RunSummary, OrchestratorError> {
    let run_dir = run_dir.to_owned();
    // Several nodes: every agent joins before anything starts (the chain's addresses go in the launch file).
    let gathered = match &multi {
        Some(m) => Some(multinode::gather(m, cfg).await?),
        None => None,
    };
    let mut launch = LaunchSpec {
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
        gpu_socket: cfg.gpu_channel().then(|| files.gpu_socket.clone()),
        segment_prefix: tag.to_owned(),
        // Several nodes share the run's token (RLSYNC_RUN_TOKEN): the trainer proves it to the weight chain.
        token: multi
            .as_ref()
            .map_or_else(rlsync_core::protocol::messages::new_token, |m| {
                m.token.clone()
            }),
        start: plan.start,
        config: cfg.clone(),
        job: opts.job,
        node_rollouts: None,
        chain_next: None,
        host_shared: None,
    };
    if let (Some(m), Some((joined, _))) = (&multi, &gathered) {
        multinode::node0_launch(m, joined, &mut launch);
    }
    // The GPU channel serves the trainer's host; with no rollout there, every version goes over the chain.
    if launch.gpu_socket.is_some() && launch.local_rollouts() == 0 {
        tracing::warn!(
            "weight_syncer.patch.transport_device=cuda: no rollout on the trainer's host for the same-host GPU \
             channel; every version goes over the TCP chain"
        );
        launch.gpu_socket = None;
    }
    // This host's arena (`weight_syncer.host_shared`): its name is `run_logged`'s to unlink.
    launch.host_shared = launch.host_shared_for(tag, 0);
    let launch_path = launch::launch_file(&run_dir);
    let bytes = launch::encode_launch(&launch)
        .map_err(|source| OrchestratorError::LaunchFile { source })?;
    run_files::write_private(&launch_path, &bytes)?;

    let exe = match opts.worker_exe {
        Some(exe) => exe,
        None => std::env::current_exe().map_err(|source| OrchestratorError::RunDir {
            path: "<current exe>".into(),
            source,
        })?,
    };
    let (progress, console) = Progress::new(plan.steps, plan.start.step);
    let logger = &cfg.runner.logger;
    let metrics_dir = match &logger.log_path {
        Some(path) => std::path::absolute(path).map_err(|source| OrchestratorError::RunDir {
            path: path.clone(),
            source,
        })?,
        None => run_dir.clone(),
    };
    let mut sink = MetricsSink::open(
        &metrics_dir,
        &logger.logger_backends,
        plan.start.step,
        progress,
    )?;
    sink.watch(metrics::canary::StaleSyncCanary::new(
        cfg.algorithm.stale_clip_fraction,
        cfg.algorithm.stale_clip_window,
    ));
    if plan.start.step > 0 {
        tracing::info!(
            "resuming at step {} of {} (weight version {})",
            plan.start.step,
            plan.steps,
            plan.start.version
        );
    }
    let job_started = opts.started;
    let started = std::time::Instant::now();
    let mut checkpoints = Checkpoints::new(cfg.runner.save_interval, plan.steps);
    let events = supervisor::event_channel();
    let (local, remote, cluster) = match (&multi, gathered) {
        (Some(m), Some((joined, mut cluster))) => {
            let timeout = multinode::MultiNode::node_timeout(cfg);
            let remote = multinode::assign(m, joined, &launch, &mut cluster, &events.0, timeout);
            (Some(m.workers_on(0)), remote, cluster)
        }
        _ => (None, Vec::new(), supervisor::nodes::Cluster::default()),
    };
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
        rollout_restarts: cfg.runner.rollout_restarts,
        restart_backoff: cfg.runner.rollout_restart_backoff_s.get(),
        local,
        remote,
        cluster,
        upstream: None,
        weight_receivers: weights::WeightReceivers::of_run(
            plan.rollouts,
            cfg.weight_syncer.host_shared,
            multi.as_ref(),
        ),
    };
    let startup = std::time::Instant::now();
    let mut startup_s = None;
    let mut loop_done = None;
    let result = match Supervisor::start_on(sup_cfg, opts.shutdown, console, events).await {
        Ok(mut sup) => {
            startup_s = Some(startup.elapsed().as_secs_f64());
            let result = drive(&mut sup, &plan, cfg, &mut sink, &mut checkpoints).await;
            loop_done = Some(std::time::Instant::now());
            if let (Err(OrchestratorError::Interrupted { .. }), false) =
                (&result, cfg.runner.only_eval)
            {
                save_on_interrupt(&mut sup, &mut checkpoints, cfg).await;
            }
            if let Err(err) = &result {
                sup.run_failed(err);
            }
            sup.stop(true).await;
            result
        }
        Err(err) => Err(err),
    };
    // Workers are gone now; the caller removes the private dir (sockets) and sweeps the run's segments.
    let flushed = sink.finish();
    let (totals, interrupted) = match result {
        Ok(totals) => (totals, None),
        // An interrupted run still gets its summary: what it trained and the checkpoint it left.
        Err(err @ OrchestratorError::Interrupted { .. }) => {
            let env_steps = sink
                .history
                .iter()
                .filter_map(|r| r.get_f64("rollout/env_steps"))
                .sum::<f64>() as u64;
            // The loop's time is unknown here: from the start-up's end, bootstrap included.
            let after_startup = started.elapsed().as_secs_f64() - startup_s.unwrap_or(0.0);
            let totals = LoopTotals {
                steps: sink.history.len() as u64,
                env_steps,
                loop_s: after_startup.max(0.0),
                ..LoopTotals::default()
            };
            (totals, Some(err))
        }
        Err(err) => return Err(err),
    };
    let times = metrics::summary::RunTimes {
        wall_s: job_started.elapsed().as_secs_f64(),
        before_s: startup.saturating_duration_since(job_started).as_secs_f64(),
        // Spawned until every worker said hello, then until every one built its workload.
        startup_s: startup_s.unwrap_or(0.0) + totals.ready_s,
        shutdown_s: loop_done.map_or(0.0, |done| done.elapsed().as_secs_f64()),
        bootstrap_s: totals.bootstrap_s,
        loop_s: totals.loop_s,
    };
    let mut summary = RunSummary::from_records(&sink.history, times, totals.env_steps);
    if totals.bootstrap_bytes > 0 {
        summary.bootstrap_bytes = totals.bootstrap_bytes;
    }
    summary.checkpoint = checkpoints.last.map(|saved| saved.dir);
    summary.run_dir = Some(run_dir.clone());
    summary.metrics_file = Some(sink.metrics_file.clone());
    summary.tensorboard_dir = sink.tensorboard_dir.clone();
    let table = summary.table();
    if opts.print_summary {
        hydra_compose::stdio::out(format_args!("{table}\n"));
    }
    for line in table.lines() {
        crate::logging::to_job_log(line);
    }
    flushed?;
    match interrupted {
        Some(err) => Err(err),
        None => Ok(summary),
    }
}

/// After SIGINT/SIGTERM: ask the trainer for a checkpoint of what it holds now (the step in progress is
/// abandoned, a train step already running finishes first) and wait for it, bounded; a second signal, a
/// failed trainer or the bound ends the wait and the run stops without it.
async fn save_on_interrupt(sup: &mut Supervisor, checkpoints: &mut Checkpoints, cfg: &RunConfig) {
    if cfg.runner.save_interval == 0 {
        return;
    }
    sup.begin_step();
    let handshake = cfg.runner.handshake_timeout_s.get();
    let bound = cfg
        .runner
        .step_timeout_s
        .get()
        .map_or(handshake, |step| step.max(handshake));
    let save = async {
        checkpoints.request(sup).await?;
        while checkpoints.pending > 0 {
            // Rollouts lost or restarted now do not matter: the run is stopping.
            let supervisor::Incoming::Report(id, frame) = sup
                .recv("the trainer's checkpoint after the interrupt")
                .await?
            else {
                continue;
            };
            if let (
                rlsync_core::protocol::messages::Report::Checkpointed { step, version, dir },
                true,
            ) = (frame.header, id == supervisor::WorkerId::TRAINER)
            {
                checkpoints.saved(step, version, dir);
            }
        }
        Ok::<(), OrchestratorError>(())
    };
    match tokio::time::timeout(bound, save).await {
        Ok(Ok(())) => {}
        Ok(Err(err)) => tracing::warn!("no checkpoint after the interrupt: {err}"),
        Err(_) => {
            tracing::warn!("no checkpoint after the interrupt: the trainer did not answer in time")
        }
    }
}

async fn drive(
    sup: &mut Supervisor,
    plan: &RunPlan,
    cfg: &RunConfig,
    sink: &mut MetricsSink,
    checkpoints: &mut Checkpoints,
) -> Result<LoopTotals, OrchestratorError> {
    let interval = u64::from(cfg.runner.weight_sync_interval.get());
    let runner = &cfg.runner;
    if runner.only_eval {
        return embodied::eval_only(sup, plan, runner.verify_sync, sink).await;
    }
    match plan.entry {
        Entry::Embodied | Entry::BenchSync => {
            let val = runner.val_check_interval;
            embodied::run(
                sup,
                plan,
                interval,
                runner.verify_sync,
                val,
                sink,
                checkpoints,
            )
            .await
        }
        Entry::Async => {
            let set = async_loop::AsyncSettings {
                staleness_threshold: u64::from(cfg.algorithm.staleness_threshold),
                sync_interval: interval,
                no_wait: cfg.actor.sync_weight_no_wait,
                verify: cfg.runner.verify_sync,
                buffer_chunks: cfg.rollout.buffer_chunks.get() as usize,
                val_check_interval: runner.val_check_interval,
            };
            async_loop::run(sup, plan, set, sink, checkpoints).await
        }
    }
}
