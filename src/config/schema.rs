//! Typed sections of the run configuration: what rlsync reads after composition and resolution.
//!
//! Key paths follow RLinf wherever RLinf has a key for the concept (`weight_syncer.patch.compression`,
//! `actor.sync_weight_no_wait`, `runner.weight_sync_interval`, `algorithm.staleness_threshold`,
//! `cluster.component_placement`). Every struct has defaults, so a section may be partial; unknown keys are
//! reported by `config::typed` (errors inside rlsync-owned sections, "did you mean" elsewhere).
//! Settings are enums, `NonZero*` and durations, never strings, past this module.

use std::fmt;
use std::num::{NonZeroU32, NonZeroU64};
use std::path::PathBuf;
use std::time::Duration;

use indexmap::IndexMap;
use serde::{Deserialize, Serialize};

pub use rlsync_core::syncer::settings::{
    BucketConfig, Compression, Device, FloatDtype, InitSyncConfig, MAX_REPLAY_VERSIONS,
    PatchConfig, SyncerKind, WeightSyncerConfig,
};

/// The whole typed configuration handed to workers (they never re-compose).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct RunConfig {
    pub weight_syncer: WeightSyncerConfig,
    pub runner: RunnerConfig,
    pub cluster: ClusterConfig,
    pub actor: ActorConfig,
    pub rollout: RolloutConfig,
    pub algorithm: AlgorithmConfig,
    pub env: EnvConfig,
    /// Only read by `rlsync bench_sync`.
    pub bench: BenchConfig,
}

impl RunConfig {
    /// The same-host GPU channel carries the versions (`weight_syncer.patch.transport_device: cuda` with the
    /// patch syncer; see `worker::gpu_channel`).
    pub fn gpu_channel(&self) -> bool {
        self.weight_syncer.kind == SyncerKind::Patch
            && self.weight_syncer.patch.transport_device == Device::Cuda
    }

    /// The weight syncer's settings for the host channel: with the GPU channel, it runs only the handshake
    /// and the init bootstrap, on the host (`transport_device: cpu`).
    pub fn host_syncer(&self) -> WeightSyncerConfig {
        let mut syncer = self.weight_syncer.clone();
        if self.gpu_channel() {
            syncer.patch.transport_device = Device::Cpu;
        }
        syncer
    }

    /// The weight syncer's settings for the TCP chain to other hosts in a run over the GPU channel (which
    /// serves only the trainer's host): the host syncer's, its snapshot in pinned host memory (the trainer's
    /// GPU keeps one snapshot copy, the channel's).
    pub fn chain_syncer(&self) -> WeightSyncerConfig {
        let mut syncer = self.host_syncer();
        syncer.patch.snapshot_device = Device::Cpu;
        syncer
    }
}

// ---------------------------------------------------------------------------------------------------------
// durations

/// The longest duration a `*_s` setting may hold (7 days): beyond it a value is a typo, and every deadline
/// computed from it (`now + d`) stays far from the clock's limits.
pub(crate) const MAX_SECONDS: f64 = 7.0 * 24.0 * 3600.0;

/// A duration written in seconds (`runner.handshake_timeout_s: 30`): finite, `>= 0` and at most
/// [`MAX_SECONDS`], checked when the config is read (YAML or the launch file), so no later
/// `Duration::from_secs_f64` can panic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct Seconds(Duration);

impl Seconds {
    pub const fn from_secs(secs: u64) -> Seconds {
        Seconds(Duration::from_secs(secs))
    }

    /// `None` when `secs` is not finite, negative or beyond [`MAX_SECONDS`].
    pub fn from_secs_f64(secs: f64) -> Option<Seconds> {
        (secs.is_finite() && (0.0..=MAX_SECONDS).contains(&secs))
            .then(|| Seconds(Duration::from_secs_f64(secs)))
    }

    pub fn get(self) -> Duration {
        self.0
    }
}

impl fmt::Display for Seconds {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} s", self.0.as_secs_f64())
    }
}

impl Serialize for Seconds {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(self.0.as_secs_f64())
    }
}

/// Reads a number of seconds; `allow_off` lets `<= 0` through as "off" (for [`Deadline`]).
struct SecondsVisitor {
    allow_off: bool,
}

impl SecondsVisitor {
    fn check<E: serde::de::Error>(&self, secs: f64) -> Result<Option<Seconds>, E> {
        if !secs.is_finite() {
            return Err(E::custom(format!(
                "{secs} is not a finite number of seconds"
            )));
        }
        if secs <= 0.0 && self.allow_off {
            return Ok(None);
        }
        if secs < 0.0 {
            return Err(E::custom(format!("{secs} s is negative")));
        }
        Seconds::from_secs_f64(secs).map(Some).ok_or_else(|| {
            E::custom(format!(
                "{secs} s is beyond the limit of {MAX_SECONDS} s (7 days)"
            ))
        })
    }
}

impl<'de> serde::de::Visitor<'de> for SecondsVisitor {
    type Value = Option<Seconds>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a number of seconds")
    }

    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Self::Value, E> {
        self.check(v)
    }

    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Self::Value, E> {
        self.check(v as f64)
    }

    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Self::Value, E> {
        self.check(v as f64)
    }
}

impl<'de> Deserialize<'de> for Seconds {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Seconds, D::Error> {
        d.deserialize_f64(SecondsVisitor { allow_off: false })
            .map(|s| s.unwrap_or_default())
    }
}

/// An optional deadline written in seconds: `<= 0` turns it off (`runner.step_timeout_s: 0`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Deadline(Option<Seconds>);

impl Deadline {
    #[cfg(test)]
    pub(crate) const OFF: Deadline = Deadline(None);

    pub const fn after(limit: Seconds) -> Deadline {
        Deadline(Some(limit))
    }

    pub fn get(self) -> Option<Duration> {
        self.0.map(Seconds::get)
    }
}

impl Serialize for Deadline {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(self.get().map_or(0.0, |d| d.as_secs_f64()))
    }
}

impl<'de> Deserialize<'de> for Deadline {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Deadline, D::Error> {
        d.deserialize_f64(SecondsVisitor { allow_off: true })
            .map(Deadline)
    }
}

// ---------------------------------------------------------------------------------------------------------
// runner

/// `runner.logger.logger_backends`: where metrics go besides `metrics.jsonl`, which every run writes (RLinf's
/// `wandb` and `swanlab` are not supported: naming one is an error that lists these).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LoggerBackend {
    /// `<log_path>/tensorboard/events.out.tfevents.*`.
    Tensorboard,
    /// `<log_path>/metrics.jsonl` (always written; naming it changes nothing).
    Jsonl,
    /// `<log_path>/metrics.csv`: one row per step, a column per metric.
    Csv,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct LoggerConfig {
    /// Directory of the metrics files (`metrics.jsonl`, `metrics.csv`, `tensorboard/`); `None`: the run dir.
    /// (RLinf's `project_name` and `experiment_name` name wandb/swanlab runs: not read, so reported unused.)
    pub log_path: Option<PathBuf>,
    /// RLinf's key; `backends` is accepted as an alias.
    #[serde(alias = "backends")]
    pub logger_backends: Vec<LoggerBackend>,
    /// Console level for the orchestrator and the prefixed worker logs (`error|warn|info|debug|trace`).
    pub level: LogLevel,
}

impl Default for LoggerConfig {
    fn default() -> Self {
        LoggerConfig {
            log_path: None,
            logger_backends: vec![LoggerBackend::Tensorboard],
            level: LogLevel::Info,
        }
    }
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum LogLevel {
    Error,
    Warn,
    #[default]
    Info,
    Debug,
    Trace,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct RunnerConfig {
    /// Number of training steps; RLinf's `-1` means "use `max_epochs`".
    pub max_steps: i64,
    pub max_epochs: i64,
    /// Sync the rollout weights every this many trainer steps.
    pub weight_sync_interval: NonZeroU32,
    /// After each sync, rollouts report their state checksum and version and the orchestrator checks them.
    pub verify_sync: bool,
    /// Checkpoint every this many steps (`<= 0`: never).
    pub save_interval: i64,
    /// Evaluate every this many steps (`<= 0`: never).
    pub val_check_interval: i64,
    pub resume_dir: Option<PathBuf>,
    pub only_eval: bool,
    /// A worker that has not completed its handshake by then fails the run.
    pub handshake_timeout_s: Seconds,
    /// A step that takes longer than this fails the run (`<= 0`: no deadline).
    pub step_timeout_s: Deadline,
    /// Time granted to workers to stop after SIGTERM before the group is killed.
    pub shutdown_grace_s: Seconds,
    /// Times each rollout worker may be restarted after it died (crash, kill, missed step deadline); the
    /// restarted worker rejoins the weight channel and catches up. 0: a dead rollout fails the run.
    pub rollout_restarts: u32,
    /// Wait before restarting a dead rollout; the n-th restart of one worker waits `2^(n-1)` times this
    /// (at most [`MAX_RESTART_BACKOFF_S`]).
    pub rollout_restart_backoff_s: Seconds,
    /// Restartable runs with the patch syncer: every rollout keeps a local copy of its weights
    /// (`<run_dir>/.rlsync/rollout-<rank>.safetensors`), written after an install when this many versions
    /// passed since the last copy; a restarted rollout loads it and catches up from its version (by replay
    /// when that version is still in the trainer's log). 0: no copy.
    pub rollout_weights_copy_interval: u32,
    pub logger: LoggerConfig,
}

/// Most restarts per rollout worker `runner.rollout_restarts` accepts.
pub const MAX_ROLLOUT_RESTARTS: u32 = 10_000;

/// Longest wait before one restart, however many came before (seconds).
pub const MAX_RESTART_BACKOFF_S: u64 = 300;

impl Default for RunnerConfig {
    fn default() -> Self {
        RunnerConfig {
            max_steps: 10,
            max_epochs: 1,
            weight_sync_interval: NonZeroU32::MIN,
            verify_sync: true,
            save_interval: -1,
            val_check_interval: -1,
            resume_dir: None,
            only_eval: false,
            handshake_timeout_s: Seconds::from_secs(30),
            step_timeout_s: Deadline::after(Seconds::from_secs(600)),
            shutdown_grace_s: Seconds::from_secs(3),
            rollout_restarts: 0,
            rollout_restart_backoff_s: Seconds::from_secs(1),
            rollout_weights_copy_interval: 4,
            logger: LoggerConfig::default(),
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// cluster

/// A `cluster.component_placement` value, in RLinf's syntax: slot (resource) ranges such as `0-7`, `0,2,4`, `3`
/// or `all`, optionally with process ranks (`0-1:0-3` puts processes 0-3 on slots 0-1, two per slot), either
/// directly or under `placement:` next to a `node_group`. rlsync spawns one worker per process, so
/// `rollout: 0-3` means four rollout workers. Slots are global: slot `s` lives on node
/// `s / cluster.slots_per_node` (see `crate::config::placement`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(untagged)]
pub enum Placement {
    Single(u32),
    Ranges(String),
    Grouped(GroupedPlacement),
}

/// RLinf's long form: `{node_group: <label>, placement: <ranges>}`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct GroupedPlacement {
    #[serde(default)]
    pub node_group: Option<String>,
    pub placement: PlacementRanges,
}

/// The ranges of a [`GroupedPlacement`].
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(untagged)]
pub enum PlacementRanges {
    Single(u32),
    Ranges(String),
}

impl Placement {
    /// The placement text (`0-3`, `0-1:0-7`, `all`) and the node group it names, if any.
    pub fn text(&self) -> (String, Option<&str>) {
        match self {
            Placement::Single(n) => (n.to_string(), None),
            Placement::Ranges(t) => (t.clone(), None),
            Placement::Grouped(g) => {
                let text = match &g.placement {
                    PlacementRanges::Single(n) => n.to_string(),
                    PlacementRanges::Ranges(t) => t.clone(),
                };
                (text, g.node_group.as_deref())
            }
        }
    }

    /// The slots this placement lists (`0-3,6` → 0,1,2,3,6), in order, without duplicates. Linear in the
    /// number of slots, and refuses more than [`MAX_PLACEMENT_SLOTS`] before expanding any range. Process
    /// ranks (`0-1:0-3`) and `all` need the cluster's size: see `crate::config::placement::resolve`.
    pub fn slots(&self) -> Result<Vec<u32>, String> {
        let text = match self {
            Placement::Single(n) => return Ok(vec![*n]),
            Placement::Ranges(text) => text.clone(),
            Placement::Grouped(_) => self.text().0,
        };
        let text = text.as_str();
        let mut ranges = Vec::new();
        let mut total: u64 = 0;
        for part in text.split(',').map(str::trim) {
            let bad = || format!("'{text}' is not a placement like `0-3`, `0,2,4` or `3`");
            let (lo, hi) = match part.split_once('-') {
                Some((lo, hi)) => (lo.trim(), hi.trim()),
                None => (part, part),
            };
            let lo: u32 = lo.parse().map_err(|_| bad())?;
            let hi: u32 = hi.parse().map_err(|_| bad())?;
            if hi < lo {
                return Err(format!("'{text}': range {lo}-{hi} is empty"));
            }
            total += u64::from(hi - lo) + 1;
            if total > MAX_PLACEMENT_SLOTS as u64 {
                return Err(format!(
                    "'{text}' lists more than {MAX_PLACEMENT_SLOTS} slots (one worker process each)"
                ));
            }
            ranges.push(lo..=hi);
        }
        let slots: Vec<u32> = ranges.into_iter().flatten().collect();
        let mut sorted = slots.clone();
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return Err(format!("'{text}' lists slot {} twice", w[0]));
        }
        Ok(slots)
    }
}

/// The most slots one placement may list; a placement beyond it is refused before any range is expanded.
pub(crate) const MAX_PLACEMENT_SLOTS: usize = 4096;

/// The most rollout worker processes rlsync starts on one host (every rollout is a process with its own copy
/// of the weights).
pub(crate) const MAX_ROLLOUTS_PER_HOST: usize = 256;

/// `cluster.network`: where the TCP control plane and weight chain of a multi-node run listen.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct NetworkConfig {
    /// Interface name (`eth0`, `ib0`) or IP address to bind and advertise; null: the address that routes to
    /// the rendezvous host.
    pub interface: Option<String>,
    /// First and last TCP port the weight chain may listen on (one per node; the rendezvous port is
    /// `cluster.master_port`).
    pub port_min: u16,
    pub port_max: u16,
    /// Size of the parts a payload travels in along the chain (each node forwards a part while it receives
    /// the next).
    pub part_bytes: NonZeroU64,
}

impl Default for NetworkConfig {
    fn default() -> Self {
        NetworkConfig {
            interface: None,
            port_min: 29510,
            port_max: 29599,
            part_bytes: NonZeroU64::new(256 << 10).unwrap(),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct ClusterConfig {
    pub num_nodes: NonZeroU32,
    pub component_placement: IndexMap<String, Placement>,
    /// Slots per node: slot `s` of a placement is on node `s / slots_per_node`. Null: every slot on one node
    /// when `num_nodes` is 1, else the slots in use split evenly over the nodes.
    pub slots_per_node: Option<NonZeroU32>,
    /// This host's node rank; null: from the scheduler's environment (torchrun, Slurm, OpenMPI), else 0.
    pub node_rank: Option<u32>,
    /// Rendezvous host (node 0); null: `MASTER_ADDR`, or the first host of `SLURM_JOB_NODELIST`.
    pub master_addr: Option<String>,
    /// Rendezvous port on node 0; null: `MASTER_PORT`, else 29500.
    pub master_port: Option<u16>,
    /// A node that does not answer heartbeats for this long fails the run (naming the node).
    pub node_timeout_s: f64,
    pub network: NetworkConfig,
}

impl ClusterConfig {}

impl Default for ClusterConfig {
    fn default() -> Self {
        let mut placement = IndexMap::new();
        placement.insert("actor".to_owned(), Placement::Single(0));
        placement.insert("rollout".to_owned(), Placement::Ranges("0-1".into()));
        ClusterConfig {
            num_nodes: NonZeroU32::MIN,
            component_placement: placement,
            slots_per_node: None,
            node_rank: None,
            master_addr: None,
            master_port: None,
            node_timeout_s: 30.0,
            network: NetworkConfig::default(),
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// actor / model

/// `actor.model.model_type`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum ModelType {
    /// Model-shaped state dict with a realistic Adam-like update; no learning.
    #[default]
    Synthetic,
    /// Gaussian (continuous) or categorical (discrete) MLP actor with a value head (needs `--features torch`).
    MlpPolicy,
    /// Frozen backbone + trainable LoRA-style adapters and action head (needs `--features torch`).
    VlaTiny,
    /// A user's TorchScript policy at `torchscript_path` (needs `--features torch`).
    Torchscript,
}

impl ModelType {
    /// The name configs use (`actor.model.model_type`).
    pub fn name(self) -> &'static str {
        match self {
            ModelType::Synthetic => "synthetic",
            ModelType::MlpPolicy => "mlp_policy",
            ModelType::VlaTiny => "vla_tiny",
            ModelType::Torchscript => "torchscript",
        }
    }
}

/// Element type of weights (`precision`, `bench.dtype`, synthetic `dtype`).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum WeightDtype {
    #[default]
    #[serde(alias = "bfloat16")]
    Bf16,
    #[serde(alias = "float16", alias = "fp16")]
    F16,
    #[serde(alias = "float32", alias = "fp32")]
    F32,
}

impl From<WeightDtype> for rlsync_core::tensor::DType {
    fn from(d: WeightDtype) -> rlsync_core::tensor::DType {
        use rlsync_core::tensor::DType;
        match d {
            WeightDtype::Bf16 => DType::Bf16,
            WeightDtype::F16 => DType::F16,
            WeightDtype::F32 => DType::F32,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct ModelConfig {
    pub model_type: ModelType,
    /// Weight dtype held by rollouts (the trainer keeps fp32 master weights and sync converts).
    pub precision: WeightDtype,
    /// Synthetic: total number of elements.
    pub params: u64,
    /// Synthetic: number of tensors in the state dict (realistic shape mix).
    pub tensors: NonZeroU32,
    /// Synthetic / vla_tiny: share of the parameters that are frozen (backbone).
    pub frozen_fraction: f64,
    /// Synthetic: learning rate of the emulated Adam step (sets the changed fraction per step).
    pub adam_lr: f64,
    /// Synthetic: emulated trainer compute per step.
    pub train_ms: f64,
    /// Synthetic: emulated rollout compute per env step.
    pub rollout_ms_per_step: f64,
    /// Synthetic: bytes of trajectory data per env step.
    pub traj_bytes_per_step: u64,
    /// mlp_policy / vla_tiny hidden width.
    pub hidden_dim: NonZeroU32,
    pub num_layers: NonZeroU32,
    /// vla_tiny: rank of the LoRA adapters.
    pub lora_rank: NonZeroU32,
    /// torchscript: path to the scripted policy (see examples/torchscript).
    pub torchscript_path: Option<PathBuf>,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            model_type: ModelType::Synthetic,
            precision: WeightDtype::Bf16,
            params: 1 << 20,
            tensors: NonZeroU32::new(16).unwrap(),
            frozen_fraction: 0.0,
            adam_lr: 1e-6,
            train_ms: 0.0,
            rollout_ms_per_step: 0.0,
            traj_bytes_per_step: 256,
            hidden_dim: NonZeroU32::new(64).unwrap(),
            num_layers: NonZeroU32::new(2).unwrap(),
            lora_rank: NonZeroU32::new(8).unwrap(),
            torchscript_path: None,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct OptimConfig {
    pub lr: f64,
    pub value_lr: f64,
    pub adam_beta1: f64,
    pub adam_beta2: f64,
    pub adam_eps: f64,
    pub weight_decay: f64,
    /// Global gradient-norm clip (`<= 0`: off).
    pub clip_grad: f64,
}

impl Default for OptimConfig {
    fn default() -> Self {
        OptimConfig {
            lr: 3e-4,
            value_lr: 1e-3,
            adam_beta1: 0.9,
            adam_beta2: 0.999,
            adam_eps: 1e-8,
            weight_decay: 0.0,
            clip_grad: 1.0,
        }
    }
}

/// `actor.worker.kind` / `rollout.worker.kind`: which program a role's workers run.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum WorkerKind {
    /// `rlsync worker`: the libtorch learner or the synthetic workload, as `actor.model` selects.
    #[default]
    Builtin,
    /// `PYTHON -m rlsync.worker`: the user's Python class named by `entry` (the `rlsync` package's SDK).
    Python,
}

/// `actor.worker.device` / `rollout.worker.device`: where a Python worker's model lives (`cpu` | `cuda` |
/// `cuda:N`). Written as torch names it; `cuda` is torch's current device, `cuda:N` device N.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WorkerDevice {
    #[default]
    Cpu,
    /// `cuda` (`None`: torch's current device) or `cuda:N`.
    Cuda(Option<u32>),
}

impl WorkerDevice {
    /// The largest `N` of `cuda:N` accepted (more GPUs than any host has).
    pub const MAX_INDEX: u32 = 1023;

    pub fn is_cuda(self) -> bool {
        matches!(self, WorkerDevice::Cuda(_))
    }
}

impl fmt::Display for WorkerDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WorkerDevice::Cpu => f.write_str("cpu"),
            WorkerDevice::Cuda(None) => f.write_str("cuda"),
            WorkerDevice::Cuda(Some(n)) => write!(f, "cuda:{n}"),
        }
    }
}

impl std::str::FromStr for WorkerDevice {
    type Err = String;

    fn from_str(s: &str) -> Result<WorkerDevice, String> {
        let bad = || format!("'{s}' is not a device: expected cpu, cuda or cuda:N (N a GPU index)");
        match s {
            "cpu" => Ok(WorkerDevice::Cpu),
            "cuda" => Ok(WorkerDevice::Cuda(None)),
            _ => {
                let index = s.strip_prefix("cuda:").ok_or_else(bad)?;
                if index.is_empty() || !index.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(bad());
                }
                match index.parse::<u32>() {
                    Ok(n) if n <= WorkerDevice::MAX_INDEX => Ok(WorkerDevice::Cuda(Some(n))),
                    _ => Err(format!(
                        "'{s}': GPU index out of range (at most {})",
                        WorkerDevice::MAX_INDEX
                    )),
                }
            }
        }
    }
}

impl Serialize for WorkerDevice {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for WorkerDevice {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<WorkerDevice, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = WorkerDevice;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a device: cpu, cuda or cuda:N")
            }

            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<WorkerDevice, E> {
                v.parse().map_err(E::custom)
            }
        }
        d.deserialize_str(Visitor)
    }
}

/// `actor.worker` / `rollout.worker` (config group `worker`: `builtin` | `python`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[serde(default)]
pub struct WorkerConfig {
    pub kind: WorkerKind,
    /// python: `package.module:Attr` (or `package.module`, whose `Trainer`/`Rollout` is used).
    pub entry: Option<String>,
    /// python: where the worker's model lives; the worker moves `model()` there before the first sync.
    pub device: WorkerDevice,
    /// python: the interpreter (`None`: `$VIRTUAL_ENV/bin/python` when a venv is active, else `python3`).
    pub python: Option<PathBuf>,
    /// python: directories put in front of the worker's `sys.path`.
    pub path: Vec<PathBuf>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct ActorConfig {
    /// `true`: rollouts receive and apply weights in the background (async entry point).
    pub sync_weight_no_wait: bool,
    pub seed: u64,
    pub micro_batch_size: NonZeroU32,
    pub global_batch_size: NonZeroU32,
    pub model: ModelConfig,
    pub optim: OptimConfig,
    /// The trainer's program.
    pub worker: WorkerConfig,
}

impl Default for ActorConfig {
    fn default() -> Self {
        ActorConfig {
            sync_weight_no_wait: false,
            seed: 1234,
            micro_batch_size: NonZeroU32::new(64).unwrap(),
            global_batch_size: NonZeroU32::new(256).unwrap(),
            model: ModelConfig::default(),
            optim: OptimConfig::default(),
            worker: WorkerConfig::default(),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct RolloutModelConfig {
    pub precision: WeightDtype,
}

impl Default for RolloutModelConfig {
    fn default() -> Self {
        RolloutModelConfig {
            precision: WeightDtype::Bf16,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct RolloutConfig {
    pub model: RolloutModelConfig,
    /// train_async: capacity of the trajectory buffer, in rollout chunks.
    pub buffer_chunks: NonZeroU32,
    /// Env steps per rollout chunk (weights are installed between chunks, never mid-forward).
    pub chunk_steps: NonZeroU32,
    /// The rollouts' program.
    pub worker: WorkerConfig,
}

impl Default for RolloutConfig {
    fn default() -> Self {
        RolloutConfig {
            model: RolloutModelConfig::default(),
            buffer_chunks: NonZeroU32::new(8).unwrap(),
            chunk_steps: NonZeroU32::new(16).unwrap(),
            worker: WorkerConfig::default(),
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// algorithm

/// `algorithm.adv_type`: GAE with a critic (PPO) or group-relative advantages without one (GRPO).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum AdvantageType {
    #[default]
    Gae,
    #[serde(alias = "grpo")]
    GrpoGroup,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct AlgorithmConfig {
    /// train_async: data older than `trainer_version - staleness_threshold` is dropped.
    pub staleness_threshold: u32,
    pub adv_type: AdvantageType,
    pub normalize_advantages: bool,
    pub group_size: NonZeroU32,
    pub gamma: f64,
    pub gae_lambda: f64,
    pub clip_ratio_low: f64,
    pub clip_ratio_high: f64,
    pub value_clip: f64,
    pub entropy_bonus: f64,
    pub value_coef: f64,
    pub update_epoch: NonZeroU32,
    /// The stale-sync canary: when `actor/clip_fraction` (the trainer's share of samples whose ratio left the
    /// clip range, built-in or Python trainer) averages above this over the last `stale_clip_window` steps, the
    /// run warns once that the rollouts act with weights too old. In (0, 1]; 1 never warns.
    pub stale_clip_fraction: f64,
    /// The steps the canary averages the clip fraction over.
    pub stale_clip_window: NonZeroU32,
}

impl Default for AlgorithmConfig {
    fn default() -> Self {
        AlgorithmConfig {
            staleness_threshold: 1,
            adv_type: AdvantageType::Gae,
            normalize_advantages: true,
            group_size: NonZeroU32::MIN,
            gamma: 0.99,
            gae_lambda: 0.95,
            clip_ratio_low: 0.2,
            clip_ratio_high: 0.2,
            value_clip: 0.2,
            entropy_bonus: 0.0,
            value_coef: 0.5,
            update_epoch: NonZeroU32::new(4).unwrap(),
            stale_clip_fraction: 0.3,
            stale_clip_window: NonZeroU32::new(10).unwrap(),
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// env

/// `env.{train,eval}.env_type`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum EnvType {
    /// Fake trajectories of configurable size (synthetic workload).
    #[default]
    Synthetic,
    /// Planar multi-link arm reaching a random target (continuous actions).
    Reach,
    /// Classic cart-pole (discrete actions).
    Cartpole,
    /// Simulated by the user's Python rollout worker (`rollout.worker.kind: python`); rlsync only splits
    /// `total_num_envs` across the rollouts.
    Python,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct EnvSplitConfig {
    pub env_type: EnvType,
    /// Split evenly across rollout workers.
    pub total_num_envs: NonZeroU32,
    pub max_episode_steps: NonZeroU32,
    /// Env steps per rollout epoch (per env).
    pub max_steps_per_rollout_epoch: NonZeroU32,
    pub rollout_epoch: NonZeroU32,
    pub seed: u64,
    /// reach: number of links of the arm.
    pub num_links: NonZeroU32,
    /// Consecutive envs sharing reset seeds, so GRPO groups start from identical states (RLinf writes
    /// `${algorithm.group_size}`).
    pub group_size: NonZeroU32,
}

impl Default for EnvSplitConfig {
    fn default() -> Self {
        EnvSplitConfig {
            env_type: EnvType::Synthetic,
            total_num_envs: NonZeroU32::new(8).unwrap(),
            max_episode_steps: NonZeroU32::new(100).unwrap(),
            max_steps_per_rollout_epoch: NonZeroU32::new(32).unwrap(),
            rollout_epoch: NonZeroU32::MIN,
            seed: 0,
            num_links: NonZeroU32::new(2).unwrap(),
            group_size: NonZeroU32::MIN,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[serde(default)]
pub struct EnvConfig {
    pub train: EnvSplitConfig,
    pub eval: EnvSplitConfig,
}

// ---------------------------------------------------------------------------------------------------------
// bench (rlsync bench_sync)

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum UpdateKind {
    /// fp32 master weights with an Adam-like step, cast to the receiver dtype.
    #[default]
    Adam,
    /// A fixed share of elements changed at random positions with random values.
    Density,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum TransportKind {
    #[default]
    Inproc,
    Shm,
}

/// Whose memory `bench_sync`'s receivers install into.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum ReceiverMemory {
    /// Tensors the receiver owns: a verified bucket is installed by swapping storages.
    #[default]
    Owned,
    /// Memory the receiver does not own, as a Python or tch rollout's tensors are to the syncer: a verified
    /// bucket is copied in (the caller's tensors keep their memory).
    Borrowed,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum OutputFormat {
    #[default]
    Table,
    Json,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct BenchConfig {
    pub params: u64,
    pub dtype: WeightDtype,
    pub tensors: NonZeroU32,
    pub update: UpdateKind,
    pub adam_lr: f64,
    pub density: f64,
    pub frozen_fraction: f64,
    pub steps: NonZeroU32,
    pub receivers: NonZeroU32,
    pub transport: TransportKind,
    pub receiver_memory: ReceiverMemory,
    /// Threads for the diff/apply kernels (`0`: all cores).
    pub threads: u32,
    pub format: OutputFormat,
    pub seed: u64,
}

impl Default for BenchConfig {
    fn default() -> Self {
        BenchConfig {
            params: 1 << 24,
            dtype: WeightDtype::Bf16,
            tensors: NonZeroU32::new(64).unwrap(),
            update: UpdateKind::Adam,
            adam_lr: 1e-6,
            density: 0.01,
            frozen_fraction: 0.0,
            steps: NonZeroU32::new(5).unwrap(),
            receivers: NonZeroU32::MIN,
            transport: TransportKind::Inproc,
            receiver_memory: ReceiverMemory::Owned,
            threads: 0,
            format: OutputFormat::Table,
            seed: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placement_slots() {
        let check = |p: Placement, want: Result<Vec<u32>, ()>| {
            assert_eq!(p.slots().map_err(|_| ()), want, "{p:?}")
        };
        check(Placement::Single(3), Ok(vec![3]));
        check(Placement::Ranges("0-3".into()), Ok(vec![0, 1, 2, 3]));
        check(Placement::Ranges("0,2, 4".into()), Ok(vec![0, 2, 4]));
        check(Placement::Ranges("0-1,5".into()), Ok(vec![0, 1, 5]));
        check(Placement::Ranges("3-1".into()), Err(()));
        check(Placement::Ranges("0-1,1".into()), Err(()));
        check(Placement::Ranges("gpu0".into()), Err(()));
    }

    #[test]
    fn placement_expansion_is_linear_and_bounded() {
        // A million-slot range is refused by counting, not by expanding it.
        let err = Placement::Ranges("0-2000000".into()).slots().unwrap_err();
        assert!(err.contains("more than 4096 slots"), "{err}");
        let err = Placement::Ranges("0-4000,4000".into()).slots().unwrap_err();
        assert!(err.contains("slot 4000 twice"), "{err}");
        assert_eq!(
            Placement::Ranges("4000-4095,0-3999".into())
                .slots()
                .map(|s| s.len()),
            Ok(4096)
        );
    }

    #[test]
    fn seconds_round_trip_through_json_and_refuse_the_unusable() {
        let cfg = RunnerConfig::default();
        let json = serde_json::to_string(&cfg).unwrap();
        let back: RunnerConfig = serde_json::from_str(&json).unwrap();
        assert_eq!(back, cfg);
        let off: Deadline = serde_json::from_str("-1").unwrap();
        assert_eq!(off, Deadline::OFF);
        for bad in ["1e300", "-0.5"] {
            assert!(serde_json::from_str::<Seconds>(bad).is_err(), "{bad}");
        }
        assert!(serde_json::from_str::<Deadline>("1e19").is_err());
        assert_eq!(Seconds::from_secs_f64(f64::NAN), None);
        assert_eq!(
            Seconds::from_secs_f64(1.5).map(Seconds::get),
            Some(Duration::from_millis(1500))
        );
    }

    #[test]
    fn a_worker_device_round_trips_through_json_as_torch_writes_it() {
        for text in ["cpu", "cuda", "cuda:3"] {
            let d: WorkerDevice = serde_json::from_str(&format!("\"{text}\"")).unwrap();
            assert_eq!(serde_json::to_string(&d).unwrap(), format!("\"{text}\""));
        }
        assert!(serde_json::from_str::<WorkerDevice>("\"cuda:01x\"").is_err());
        assert!(serde_json::from_str::<WorkerDevice>("1").is_err());
        assert_eq!(WorkerConfig::default().device, WorkerDevice::Cpu);
    }

    #[test]
    fn defaults_are_consistent() {
        let d = RunConfig::default();
        assert_eq!(
            d.cluster.component_placement["rollout"]
                .slots()
                .unwrap()
                .len(),
            2
        );
        assert_eq!(d.env.train.total_num_envs.get() % 2, 0);
        assert!(d.weight_syncer.patch.init_sync.enabled);
    }
}
