//! The `--dry-run` report: the validated settings, the processes that would be spawned, the sync volume, and
//! pre-flight checks of the run directory and shared memory — computed without spawning anything.

use std::fmt;
use std::path::{Path, PathBuf};

use crate::config::schema::{
    Compression, ModelType, RunConfig, SyncerKind, WeightDtype, WorkerKind,
};
use crate::config::typed::Extracted;
use crate::orchestrator;
use crate::orchestrator::plan::{self, Entry, RunPlan};

/// One process the orchestrator would start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedWorker {
    pub role: &'static str,
    pub rank: u32,
    /// Envs this worker steps (rollouts only).
    pub envs: u32,
}

/// Sizes of the weights that move, for the configured model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Footprint {
    /// Elements in trainable parameters + persistent buffers (what incremental sync covers).
    pub synced_elements: u64,
    /// Elements in frozen parameters (only the init bootstrap moves them).
    pub frozen_elements: u64,
    pub dtype_bytes: u64,
}

/// The whole dry-run report.
#[derive(Debug, Clone)]
pub struct DryRun {
    pub entry: Entry,
    pub run_dir: PathBuf,
    /// The orchestrator's loop plan (None for bench_sync, or when the plan itself is invalid).
    pub loop_plan: Option<RunPlan>,
    pub workers: Vec<PlannedWorker>,
    pub footprint: Option<Footprint>,
    pub config: RunConfig,
    pub ignored: Vec<String>,
    /// The workers over nodes (None when the placement is invalid, which config extraction reports).
    pub nodes: Option<crate::config::placement::NodePlacement>,
    /// Who this process would be in a multi-node run (from `cluster.*` and the scheduler's environment).
    pub identity: Option<crate::cluster::NodeIdentity>,
    /// Pre-flight problems (the dry run fails if any).
    pub problems: Vec<String>,
}

/// Build the report for a validated configuration. Never spawns or creates anything.
pub fn dry_run(entry: Entry, extracted: &Extracted, run_dir: &Path) -> DryRun {
    let cfg = &extracted.config;
    let mut problems = Vec::new();
    let loop_plan = match entry {
        Entry::BenchSync => None,
        _ => match plan::plan(entry, cfg) {
            Ok(p) => Some(p),
            Err(e) => {
                problems.push(rlsync_core::error_chain(&e));
                None
            }
        },
    };
    let workers = loop_plan.as_ref().map(planned_workers).unwrap_or_default();
    let nodes = match entry {
        Entry::BenchSync => None,
        _ => crate::config::placement::resolve(&cfg.cluster).ok(),
    };
    let identity = match entry {
        Entry::BenchSync => None,
        _ => match crate::cluster::detect(&cfg.cluster, &crate::cluster::host_name(), |k| {
            std::env::var(k).ok()
        }) {
            Ok(id) => Some(id),
            Err(e) => {
                problems.push(e.to_string());
                None
            }
        },
    };
    let footprint = footprint(cfg);
    if let Err(e) = check_writable(run_dir) {
        problems.push(e);
    }
    if entry != Entry::BenchSync {
        // What would make the run fail at once: sockets that do not fit, a learner this build lacks, a
        // checkpoint to resume that is not there.
        if let Err(e) = orchestrator::run_files::check_socket_dir(&std::env::temp_dir()) {
            problems.push(rlsync_core::error_chain(&e));
        }
        // Python workers bring their own model: `actor.model` is theirs to read.
        // Built-in workers of a learner model need libtorch: in this build, or the learner executable beside it.
        if cfg.actor.worker.kind == WorkerKind::Builtin {
            match preflight_here(cfg.actor.model.model_type) {
                Err(e) => problems.push(format!("actor.model.model_type: {e}")),
                Ok(exe) if cfg.gpu_channel() => {
                    let this = current_exe();
                    let learner = crate::learner_exe::learner_exe(&this);
                    problems.extend(crate::learner_exe::gpu_channel_refusal(
                        &exe, &this, &learner,
                    ));
                }
                Ok(_) => {}
            }
        }
        // Python workers: their interpreter, asked once, imports rlsync and the entries (and torch on cuda).
        if let Err(e) = orchestrator::supervisor::interpreter_probe::check(cfg) {
            problems.push(rlsync_core::error_chain(&e));
        }
        if let Some(problem) = nodes
            .as_ref()
            .and_then(|n| orchestrator::multinode::refusal(cfg, n))
        {
            problems.push(problem);
        }
        if let Some(problem) = crate::orchestrator::plan::resume_problem(cfg) {
            problems.push(problem);
        } else if let Some(p) = &loop_plan
            && let Err(e) = plan::resume_point(cfg, p.steps)
        {
            // Not a checkpoint, or nothing left to train: the run would refuse it at once.
            problems.push(e.to_string());
        }
    }
    if entry != Entry::BenchSync
        && let Some(fp) = footprint
    {
        let payload = largest_payload(cfg, fp);
        // The host-shared arena lives in /dev/shm beside the channel's slots.
        let arena = if cfg.weight_syncer.host_shared {
            arena_bytes(fp)
        } else {
            0
        };
        let need = payload.saturating_add(arena);
        match shm_free_bytes() {
            Ok(free) if free < need => problems.push(format!(
                "/dev/shm has {} free but the largest sync payload needs about {}{}",
                human_bytes(free),
                human_bytes(payload),
                if arena > 0 {
                    format!(
                        " and the host-shared arena (weight_syncer.host_shared) {}",
                        human_bytes(arena)
                    )
                } else {
                    String::new()
                }
            )),
            Ok(_) => {}
            Err(e) => problems.push(format!("cannot check /dev/shm: {e}")),
        }
    }
    DryRun {
        entry,
        run_dir: run_dir.to_owned(),
        loop_plan,
        workers,
        footprint,
        config: cfg.clone(),
        ignored: extracted.ignored.clone(),
        nodes,
        identity,
        problems,
    }
}

/// `learner_exe::preflight` for the workers' executable (this one, or `$RLSYNC_WORKER`) and the learner
/// executable it would start.
fn preflight_here(
    model: crate::config::schema::ModelType,
) -> Result<PathBuf, crate::learner_exe::NoLearner> {
    let this = current_exe();
    let worker = crate::learner_exe::worker_exe(&this);
    crate::learner_exe::preflight(model, &worker, &crate::learner_exe::learner_exe(&this))
}

fn current_exe() -> PathBuf {
    std::env::current_exe().unwrap_or_else(|_| PathBuf::from("rlsync"))
}

/// Trainer rank 0 plus the rollouts of the orchestrator's own loop plan (so the report cannot disagree with
/// what a run would start).
pub(crate) fn planned_workers(plan: &RunPlan) -> Vec<PlannedWorker> {
    let mut workers = vec![PlannedWorker {
        role: "trainer",
        rank: 0,
        envs: 0,
    }];
    workers.extend((0..plan.rollouts).map(|rank| PlannedWorker {
        role: "rollout",
        rank,
        envs: plan.envs_per_rollout,
    }));
    workers
}

/// Weight sizes for models whose size follows from the config alone (the synthetic workload).
pub(crate) fn footprint(cfg: &RunConfig) -> Option<Footprint> {
    let model = &cfg.actor.model;
    match model.model_type {
        ModelType::Synthetic => {
            let frozen = (model.params as f64 * model.frozen_fraction).round() as u64;
            Some(Footprint {
                synced_elements: model.params - frozen.min(model.params),
                frozen_elements: frozen.min(model.params),
                dtype_bytes: dtype_bytes(cfg.rollout.model.precision),
            })
        }
        // Policy sizes come from building the network (needs the `torch` feature); reported at run start.
        ModelType::MlpPolicy | ModelType::VlaTiny | ModelType::Torchscript => None,
    }
}

/// Weight memory of the trainer and of one rollout (bytes, estimate): the trainer keeps fp32 master weights
/// plus its state and the sync snapshot in the rollout dtype; a rollout keeps its weights and a staging copy.
pub(crate) fn process_memory(fp: Footprint) -> (u64, u64) {
    let elements = fp.synced_elements.saturating_add(fp.frozen_elements);
    let trainer = elements.saturating_mul(4 + 2 * fp.dtype_bytes);
    let rollout = elements.saturating_mul(2 * fp.dtype_bytes);
    (trainer, rollout)
}

/// The host-shared arena of one host (`weight_syncer.host_shared`): two whole-state buffers, frozen tensors
/// included, in the rollouts' dtype.
pub(crate) fn arena_bytes(fp: Footprint) -> u64 {
    fp.synced_elements
        .saturating_add(fp.frozen_elements)
        .saturating_mul(fp.dtype_bytes)
        .saturating_mul(2)
}

/// The hosts that hold rollouts and their rollout ranks, lowest first (node 0 alone on one host).
fn rollout_hosts(self_: &DryRun) -> Vec<(u32, Vec<u32>)> {
    let ranks = || {
        self_
            .workers
            .iter()
            .filter(|w| w.role == "rollout")
            .map(|w| w.rank)
    };
    match self_.nodes.as_ref().filter(|n| n.num_nodes > 1) {
        Some(nodes) => (0..nodes.num_nodes)
            .map(|node| {
                let mut on: Vec<u32> = nodes
                    .rollouts
                    .iter()
                    .filter(|w| w.node == node)
                    .map(|w| w.rank)
                    .collect();
                on.sort_unstable();
                (node, on)
            })
            .filter(|(_, on)| !on.is_empty())
            .collect(),
        None => {
            let on: Vec<u32> = ranks().collect();
            if on.is_empty() {
                Vec::new()
            } else {
                vec![(0, on)]
            }
        }
    }
}

fn dtype_bytes(d: WeightDtype) -> u64 {
    match d {
        WeightDtype::Bf16 | WeightDtype::F16 => 2,
        WeightDtype::F32 => 4,
    }
}

/// Estimated bytes per incremental sync: dense for bucket; for patch, a changed share times ~2 bytes per
/// changed element (the patch codec's measured cost on realistic updates; see README's bench_sync figures).
pub(crate) fn estimated_sync_bytes(cfg: &RunConfig, fp: Footprint) -> u64 {
    let synced = fp.synced_elements;
    match cfg.weight_syncer.kind {
        SyncerKind::Bucket => {
            let bytes = match cfg.weight_syncer.bucket.bucket_dtype {
                Some(crate::config::schema::FloatDtype::Float32) => 4,
                Some(_) => 2,
                None => fp.dtype_bytes,
            };
            synced * bytes
        }
        SyncerKind::Patch => {
            let share = assumed_changed_share(cfg.actor.model.adam_lr, cfg.rollout.model.precision);
            let per_changed = if cfg.weight_syncer.patch.compression == Compression::None {
                2.5
            } else {
                2.0
            };
            (synced as f64 * share * per_changed).ceil() as u64
        }
    }
}

/// Share of elements whose receiver-dtype bits change per Adam step at `lr`: an Adam step moves each weight by
/// about `lr`; a bf16 value of magnitude ~|w| changes when the step crosses half an ulp (|w| * 2^-8).
fn assumed_changed_share(lr: f64, dtype: WeightDtype) -> f64 {
    let mantissa_bits = match dtype {
        WeightDtype::Bf16 => 8.0,
        WeightDtype::F16 => 11.0,
        WeightDtype::F32 => 24.0,
    };
    let typical_weight = 0.02_f64;
    let half_ulp = typical_weight * 2f64.powf(-mantissa_bits);
    (lr / half_ulp).clamp(0.0, 1.0)
}

fn largest_payload(cfg: &RunConfig, fp: Footprint) -> u64 {
    let ws = &cfg.weight_syncer;
    let init = if ws.kind == SyncerKind::Patch && ws.patch.init_sync.enabled {
        ws.patch
            .init_sync
            .bucket_size
            .get()
            .min((fp.synced_elements + fp.frozen_elements) * fp.dtype_bytes)
    } else {
        0
    };
    let per_sync = match ws.kind {
        SyncerKind::Bucket => ws
            .bucket
            .bucket_size
            .get()
            .min(estimated_sync_bytes(cfg, fp)),
        SyncerKind::Patch => estimated_sync_bytes(cfg, fp),
    };
    init.max(per_sync)
}

/// The run directory (or its closest existing ancestor) must accept new files.
fn check_writable(run_dir: &Path) -> Result<(), String> {
    let mut probe_dir = run_dir;
    while !probe_dir.exists() {
        match probe_dir.parent() {
            Some(p) if !p.as_os_str().is_empty() => probe_dir = p,
            _ => {
                probe_dir = Path::new(".");
                break;
            }
        }
    }
    let probe = probe_dir.join(format!(".rlsync-dry-run-{}", std::process::id()));
    std::fs::write(&probe, b"")
        .and_then(|_| std::fs::remove_file(&probe))
        .map_err(|e| {
            format!(
                "run directory {} is not writable ({}: {e})",
                run_dir.display(),
                probe_dir.display()
            )
        })
}

fn shm_free_bytes() -> Result<u64, String> {
    let st = nix::sys::statvfs::statvfs("/dev/shm").map_err(|e| e.to_string())?;
    Ok(st.blocks_available() as u64 * st.fragment_size() as u64)
}

pub(crate) fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

impl fmt::Display for DryRun {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        writeln!(f, "rlsync dry run: {}", self.entry.name())?;
        writeln!(f, "  run dir        {}", self.run_dir.display())?;
        if self.entry != Entry::BenchSync {
            let rollouts = self.workers.iter().filter(|w| w.role == "rollout").count();
            writeln!(
                f,
                "  processes      {} in all: 1 orchestrator (this process), 1 trainer, {rollouts} rollout workers",
                rollouts + 2
            )?;
            let hosts = rollout_hosts(self);
            match self.footprint {
                Some(fp) if c.weight_syncer.host_shared => {
                    let (trainer, rollout) = process_memory(fp);
                    let arena = arena_bytes(fp);
                    writeln!(
                        f,
                        "  memory         ~{} for weights in all (estimate): trainer ~{}, each host's rollouts ~{} \
                         (two shared buffers in /dev/shm, instead of ~{} per rollout)",
                        human_bytes(
                            trainer.saturating_add(arena.saturating_mul(hosts.len() as u64))
                        ),
                        human_bytes(trainer),
                        human_bytes(arena),
                        human_bytes(rollout)
                    )?;
                }
                Some(fp) => {
                    let (trainer, rollout) = process_memory(fp);
                    writeln!(
                        f,
                        "  memory         ~{} for weights in all (estimate): trainer ~{}, each rollout ~{}",
                        human_bytes(
                            trainer.saturating_add(rollout.saturating_mul(rollouts as u64))
                        ),
                        human_bytes(trainer),
                        human_bytes(rollout)
                    )?;
                }
                None => {}
            }
            if c.weight_syncer.host_shared {
                writeln!(
                    f,
                    "  host_shared    on: the rollouts of a host act on one double-buffered copy of the weights in shared memory{}",
                    match self.footprint {
                        Some(fp) => format!(" (~{} per host)", human_bytes(arena_bytes(fp))),
                        None =>
                            " (two buffers of the rollout's state per host, sized at run start)"
                                .into(),
                    }
                )?;
                for (node, ranks) in &hosts {
                    let readers: Vec<String> =
                        ranks[1..].iter().map(|r| format!("rollout-{r}")).collect();
                    writeln!(
                        f,
                        "                 node {node}: rollout-{} receives and applies{}",
                        ranks[0],
                        if readers.is_empty() {
                            String::new()
                        } else {
                            let verb = if readers.len() == 1 { "reads" } else { "read" };
                            format!("; {} {verb} it", readers.join(", "))
                        }
                    )?;
                }
            }
            for w in &self.workers {
                let envs = if w.role == "rollout" {
                    format!(" ({} envs)", w.envs)
                } else {
                    String::new()
                };
                let worker = if w.role == "trainer" {
                    &self.config.actor.worker
                } else {
                    &self.config.rollout.worker
                };
                let program = match (&worker.kind, &worker.entry) {
                    (WorkerKind::Python, Some(entry)) => {
                        format!("python -m rlsync.worker ({entry}, on {})", worker.device)
                    }
                    _ => "rlsync worker".to_owned(),
                };
                writeln!(
                    f,
                    "    - {program} --role {} --rank {}{envs}",
                    w.role, w.rank
                )?;
            }
            let multi_node = self.nodes.as_ref().is_some_and(|n| n.num_nodes > 1);
            if let Some(nodes) = self.nodes.as_ref().filter(|_| multi_node) {
                write!(f, "{nodes}")?;
                for idle in nodes.idle_nodes() {
                    writeln!(
                        f,
                        "  warning        node {idle} has no workers: its agent would only wait"
                    )?;
                }
                if let Some(id) = &self.identity {
                    writeln!(
                        f,
                        "  this host      {} is node {} of {} ({}); rendezvous {}:{}",
                        id.host,
                        id.node_rank,
                        id.num_nodes,
                        id.scheduler,
                        id.master_addr,
                        id.master_port
                    )?;
                }
                writeln!(
                    f,
                    "  transport      TCP chain between nodes (each node forwards parts while it receives), shared memory to the rollouts of each node"
                )?;
            } else {
                writeln!(
                    f,
                    "  transport      shared memory (trainer writes once, every rollout reads in place), control over Unix sockets"
                )?;
            }
            let loop_desc = match self.entry {
                Entry::Async => format!(
                    "async: staleness_threshold={}, sync_weight_no_wait={}",
                    c.algorithm.staleness_threshold, c.actor.sync_weight_no_wait
                ),
                _ => format!(
                    "synchronous: sync every {} step(s)",
                    c.runner.weight_sync_interval
                ),
            };
            writeln!(
                f,
                "  loop           {loop_desc}, verify_sync={}",
                c.runner.verify_sync
            )?;
            if let Some(p) = &self.loop_plan {
                writeln!(
                    f,
                    "                 {} train steps; per step {} env steps ({} chunk(s) of {} steps per rollout)",
                    p.steps, p.env_steps_per_step, p.chunks_per_rollout, p.chunk_steps
                )?;
            }
            if c.actor.worker.kind == WorkerKind::Python {
                writeln!(
                    f,
                    "  model          the Python workers' own (actor.worker.entry), env {:?} x {}",
                    c.env.train.env_type, c.env.train.total_num_envs
                )?;
            } else {
                writeln!(
                    f,
                    "  model          {:?}, rollout precision {:?}, env {:?} x {}",
                    c.actor.model.model_type,
                    c.rollout.model.precision,
                    c.env.train.env_type,
                    c.env.train.total_num_envs
                )?;
            }
        } else {
            let b = &c.bench;
            writeln!(
                f,
                "  bench          {} params {:?}, {} tensors, update={:?}, steps={}, receivers={}, transport={:?}",
                b.params, b.dtype, b.tensors, b.update, b.steps, b.receivers, b.transport
            )?;
        }
        let ws = &c.weight_syncer;
        match ws.kind {
            SyncerKind::Patch => {
                let p = &ws.patch;
                writeln!(
                    f,
                    "  weight_syncer  patch: snapshot_device={:?} transport_device={:?} delta_encoding={} compression={:?}",
                    p.snapshot_device, p.transport_device, p.delta_encoding, p.compression
                )?;
                if c.gpu_channel() {
                    writeln!(
                        f,
                        "                 channel: the same-host GPU channel (CUDA IPC) after the handshake and init bootstrap on the host; patches uncoded, device to device"
                    )?;
                    if c.cluster.num_nodes.get() > 1 {
                        writeln!(
                            f,
                            "                 other hosts: coded patches over the TCP chain, built from the trainer's GPU against a pinned host snapshot"
                        )?;
                    }
                }
                let prefixes = match &p.init_sync.prefixes {
                    None => "whole state dict".to_owned(),
                    Some(list) => list.join(", "),
                };
                writeln!(
                    f,
                    "                 init_sync: enabled={} ({prefixes}), bucket_size={}",
                    p.init_sync.enabled,
                    human_bytes(p.init_sync.bucket_size.get())
                )?;
            }
            SyncerKind::Bucket => {
                let b = &ws.bucket;
                writeln!(
                    f,
                    "  weight_syncer  bucket: bucket_size={} bucket_dtype={:?} bucket_device={:?} load_instant={} is_agent={}",
                    human_bytes(b.bucket_size.get()),
                    b.bucket_dtype,
                    b.bucket_device,
                    b.load_instant,
                    b.is_agent
                )?;
            }
        }
        if self.entry != Entry::BenchSync {
            match self.footprint {
                Some(fp) => {
                    writeln!(
                        f,
                        "  weights        synced {} ({} elements), frozen {} ({} elements)",
                        human_bytes(fp.synced_elements * fp.dtype_bytes),
                        fp.synced_elements,
                        human_bytes(fp.frozen_elements * fp.dtype_bytes),
                        fp.frozen_elements
                    )?;
                    writeln!(
                        f,
                        "  per sync       ~{} (estimate)",
                        human_bytes(estimated_sync_bytes(c, fp))
                    )?;
                }
                None => writeln!(
                    f,
                    "  weights        sized when the policy is built (at run start)"
                )?,
            }
        }
        if !self.ignored.is_empty() {
            writeln!(
                f,
                "  {}",
                crate::orchestrator::unused_keys_line(&self.ignored, &self.config)
            )?;
        }
        if self.problems.is_empty() {
            writeln!(f, "OK: configuration is valid; nothing was started.")
        } else {
            writeln!(f, "{} problem(s):", self.problems.len())?;
            for p in &self.problems {
                writeln!(f, "  - {p}")?;
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::typed::extract;
    use hydra_compose::node::Node;

    #[test]
    fn default_plan_has_trainer_and_two_rollouts() {
        let ex = extract(&Node::empty_dict()).expect("defaults are valid");
        let dir = tempfile::tempdir().expect("tempdir");
        let report = dry_run(Entry::Embodied, &ex, &dir.path().join("run"));
        assert_eq!(report.workers.len(), 3);
        assert_eq!(
            report.workers[1],
            PlannedWorker {
                role: "rollout",
                rank: 0,
                envs: 4
            }
        );
        assert!(report.problems.is_empty(), "{:?}", report.problems);
        let text = report.to_string();
        assert!(
            text.contains("rlsync worker --role rollout --rank 1 (4 envs)"),
            "{text}"
        );
        assert!(text.contains("OK: configuration is valid"), "{text}");
    }

    #[test]
    fn python_workers_are_listed_with_their_program_and_entry() {
        let mut ex = extract(&Node::empty_dict()).expect("defaults are valid");
        for w in [&mut ex.config.actor.worker, &mut ex.config.rollout.worker] {
            w.kind = WorkerKind::Python;
            w.entry = Some("gym_ppo".into());
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let text = dry_run(Entry::Embodied, &ex, &dir.path().join("run")).to_string();
        assert!(
            text.contains("python -m rlsync.worker (gym_ppo, on cpu) --role trainer --rank 0"),
            "{text}"
        );
        assert!(text.contains("the Python workers' own"), "{text}");
        assert!(!text.contains("rlsync worker --role"), "{text}");
    }

    /// Issue 9: the dry run catches what makes a real run fail at once.
    #[test]
    fn dry_run_catches_immediate_failures() {
        let dir = tempfile::tempdir().unwrap();
        let mut ex = extract(&Node::empty_dict()).expect("defaults are valid");
        ex.config.runner.resume_dir = Some(dir.path().join("no-such-checkpoint"));
        let report = dry_run(Entry::Embodied, &ex, &dir.path().join("run"));
        assert!(
            report
                .problems
                .iter()
                .any(|p| p.contains("runner.resume_dir") && p.contains("no-such-checkpoint")),
            "{:?}",
            report.problems
        );
        ex.config.runner.resume_dir = None;
        ex.config.actor.model.model_type = ModelType::MlpPolicy;
        let report = dry_run(Entry::Embodied, &ex, &dir.path().join("run"));
        let learner = preflight_here(ex.config.actor.model.model_type);
        assert_eq!(
            report
                .problems
                .iter()
                .any(|p| p.starts_with("actor.model.model_type")),
            learner.is_err(),
            "a build without torch must refuse mlp_policy, one with it must not: {:?}",
            report.problems
        );
    }

    #[test]
    fn dry_run_counts_processes_and_memory() {
        let ex = extract(&Node::empty_dict()).expect("defaults are valid");
        let dir = tempfile::tempdir().unwrap();
        let text = dry_run(Entry::Embodied, &ex, &dir.path().join("run")).to_string();
        assert!(text.contains("processes      4 in all"), "{text}");
        // 1 Mi bf16 elements: trainer 8 MiB, rollouts 4 MiB each.
        assert!(
            text.contains(
                "~16.0 MiB for weights in all (estimate): trainer ~8.0 MiB, each rollout ~4.0 MiB"
            ),
            "{text}"
        );
    }

    #[test]
    fn dry_run_shows_the_host_shared_mode_and_its_memory() {
        let mut ex = extract(&Node::empty_dict()).expect("defaults are valid");
        ex.config.weight_syncer.host_shared = true;
        let dir = tempfile::tempdir().unwrap();
        let text = dry_run(Entry::Embodied, &ex, &dir.path().join("run")).to_string();
        // 1 Mi bf16 elements: trainer 8 MiB, the host's two buffers 4 MiB (one copy each) for all rollouts.
        assert!(
            text.contains(
                "~12.0 MiB for weights in all (estimate): trainer ~8.0 MiB, each host's rollouts ~4.0 MiB \
                 (two shared buffers in /dev/shm, instead of ~4.0 MiB per rollout)"
            ),
            "{text}"
        );
        assert!(text.contains("host_shared    on: "), "{text}");
        assert!(
            text.contains("node 0: rollout-0 receives and applies; rollout-1 reads it"),
            "{text}"
        );
    }

    #[test]
    fn unwritable_run_dir_is_a_problem() {
        let ex = extract(&Node::empty_dict()).expect("defaults are valid");
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("not-a-dir");
        std::fs::write(&file, b"x").expect("write");
        let report = dry_run(Entry::Embodied, &ex, &file.join("run"));
        assert!(
            report.problems.iter().any(|p| p.contains("not writable")),
            "{:?}",
            report.problems
        );
    }

    #[test]
    fn bucket_estimate_is_dense_patch_is_sparse() {
        let mut cfg = RunConfig::default();
        let fp = Footprint {
            synced_elements: 1_000_000,
            frozen_elements: 0,
            dtype_bytes: 2,
        };
        cfg.weight_syncer.kind = SyncerKind::Bucket;
        assert_eq!(estimated_sync_bytes(&cfg, fp), 2_000_000);
        cfg.weight_syncer.kind = SyncerKind::Patch;
        let patch = estimated_sync_bytes(&cfg, fp);
        assert!(patch > 0 && patch < 200_000, "{patch}");
    }

    #[test]
    fn human_bytes_units() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(134217728), "128.0 MiB");
    }
}
