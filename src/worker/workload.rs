//! The `Workload` trait: what a trainer or rollout worker computes, independent of processes and transport.

use std::path::{Path, PathBuf};

use rlsync_core::gpu::ipc::{ReceiverDevice, SenderDevice};
use rlsync_core::protocol::ProtocolError;
use rlsync_core::protocol::messages::Role;
use rlsync_core::syncer::{SyncReceiver, SyncSender};
use rlsync_core::tensor::{DType, StateDict};

use crate::checkpoint::CheckpointError;
use crate::config::schema::{ModelType, RunConfig};
use crate::worker::synthetic::SyntheticWorkload;

#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    #[error("worker placement: {reason}")]
    Placement { reason: String },
    #[error("state dict has no tensor '{name}' that the workload expects")]
    MissingTensor { name: String },
    #[error("model tensor")]
    Tensor(#[from] rlsync_core::tensor::TensorError),
    #[error("invalid synthetic model: {reason}")]
    InvalidModel { reason: String },
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// The libtorch learner failed (its error type lives in the `rlsync-learner` crate).
    #[error("learner")]
    Learner(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// A learner model asked of an executable without the learner (the supervisor starts those workers from
    /// `rlsync-learner`; see `learner_exe`).
    #[error(
        "model `{model}` runs in the learner executable `rlsync-learner`, not in this one (built without libtorch)"
    )]
    NoLearner { model: &'static str },
    #[error("trajectory batch")]
    Trajectories(#[from] ProtocolError),
    /// The same-host GPU channel (`weight_syncer.patch.transport_device: cuda`) cannot run on this workload.
    #[error("the GPU channel (weight_syncer.patch.transport_device=cuda): {reason}")]
    GpuChannel { reason: String },
    /// A workload implemented outside Rust failed (a Python worker raised; `message` ends with the
    /// traceback's last lines).
    #[error("{message}")]
    Foreign { message: String },
}

/// Episode statistics of a rollout's chunk or evaluation, pooled over workers by episode counts.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct EpisodeMetrics {
    /// `env/return`: mean undiscounted episode return.
    pub ret: f64,
    /// `env/success_rate`: share of finished episodes that succeeded.
    pub success_rate: f64,
    /// `env/episode_len`: mean episode length in env steps.
    pub episode_len: f64,
    /// How many episodes these means cover.
    pub episodes: u64,
}

impl EpisodeMetrics {
    /// Metric names and values as the run logs them.
    pub fn named(&self) -> [(&'static str, f64); 3] {
        [
            ("env/return", self.ret),
            ("env/success_rate", self.success_rate),
            ("env/episode_len", self.episode_len),
        ]
    }

    /// Pools two reports, weighting by episode counts (for combining rollout workers).
    pub fn merge(&self, other: &EpisodeMetrics) -> EpisodeMetrics {
        let n = self.episodes + other.episodes;
        if n == 0 {
            return EpisodeMetrics::default();
        }
        let w = |a: f64, b: f64| (a * self.episodes as f64 + b * other.episodes as f64) / n as f64;
        EpisodeMetrics {
            ret: w(self.ret, other.ret),
            success_rate: w(self.success_rate, other.success_rate),
            episode_len: w(self.episode_len, other.episode_len),
            episodes: n,
        }
    }
}

/// One batch of trajectories handed to a train step: concatenated chunk payloads.
#[derive(Debug, Clone, Copy)]
pub struct Batch<'a> {
    pub chunks: u32,
    pub env_steps: u64,
    pub data: &'a [u8],
}

/// What a train step reports.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainStats {
    pub loss: f64,
    /// The workload's own metrics (`actor/…`, `env/…`, `eval/…`), logged as named.
    pub metrics: Vec<(String, f64)>,
}

/// A piece of trajectory produced by one weight version (weights never change inside a chunk).
#[derive(Debug)]
pub struct TrajectoryChunk {
    pub env_steps: u64,
    pub mean_return: f64,
    pub data: Vec<u8>,
}

/// How a rollout's workload uses the host's shared weights (`weight_syncer.host_shared`), as it answered
/// [`Workload::act_on_shared`].
#[derive(Debug)]
pub enum SharedWeights {
    /// It acts on the state it is handed itself, copying nothing (the default: the synthetic workload reads
    /// it, a Python rollout's parameters are views of it).
    InPlace,
    /// Its model's weights are views of the state it is handed, pointed at it for the length of each call
    /// (a libtorch policy): no copy per version, and the model's own weights are released.
    Views,
    /// It copies each new version into its own weights: `why` it cannot act on the shared ones in place.
    Imports {
        why: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// The compute of a run. The trainer calls `init_state` then `train_step` per batch; each rollout calls
/// `init_state` then `rollout` per chunk. Both sides build the same layout from the same config, so frozen
/// tensors agree without being synced. Implementations may block (they run on dedicated threads).
pub trait Workload: Send {
    /// Build the model state dict with tensor classes (trainable | buffer | frozen) and initial values.
    fn init_state(&mut self) -> Result<StateDict, WorkloadError>;
    /// One optimisation step on `batch`, updating `state` in place.
    fn train_step(
        &mut self,
        state: &mut StateDict,
        batch: &Batch<'_>,
    ) -> Result<TrainStats, WorkloadError>;
    /// Act in the environments for `steps` steps of every env with the weights in `state`, which are the
    /// weights of `version` (the chunk's trajectories are tagged with it).
    fn rollout(
        &mut self,
        state: &StateDict,
        version: u64,
        steps: u32,
    ) -> Result<TrajectoryChunk, WorkloadError>;
    /// Rollout: deterministic evaluation of `state` (the weights of `version`), one episode per env of this
    /// worker's share of `env.eval`. `None` for workloads without envs.
    fn evaluate(
        &mut self,
        _state: &StateDict,
        _version: u64,
    ) -> Result<Option<EpisodeMetrics>, WorkloadError> {
        Ok(None)
    }
    /// Rollout in the host-shared mode, once, after it first holds a buffer of the host's arena and before
    /// any `rollout` or `evaluate`: every state those are handed from now on is a buffer of the host's shared
    /// memory laid out like `state` — a read-only mapping, never to be written, whose bytes may be read only
    /// during the call it is handed to (between calls the buffer may flip, and the applier writes the one
    /// nobody holds). The workload says how it acts on them. Not called outside the host-shared mode.
    fn act_on_shared(&mut self, _state: &StateDict) -> Result<SharedWeights, WorkloadError> {
        Ok(SharedWeights::InPlace)
    }
    /// Rollout: bytes of weights this workload copied out of the states it was handed so far; `None` when it
    /// does not count them.
    fn imported_weight_bytes(&self) -> Option<u64> {
        None
    }
    /// After the init bootstrap (trainer): a workload whose tensors live on a device may move the sender's
    /// per-sync work there (a Python model on a GPU: the patch build reads its CUDA tensors in place, buckets
    /// are packed on the GPU). Returns what now runs on the device, for the log; `None`: nothing moved, every
    /// sync reads `state`. The runtime still asks for [`Workload::host_view`] before any read of `state` the
    /// sender says it needs ([`SyncSender::needs_host_view`]).
    fn attach_sender(&mut self, _sender: &mut SyncSender, _state: &StateDict) -> Option<String> {
        None
    }

    /// After the init bootstrap or a rejoin (rollout): a workload whose tensors live on a device may have the
    /// receiver install versions into them there. Returns what now runs on the device, for the log; `None`:
    /// versions are installed into `state`.
    fn attach_receiver(&mut self, _receiver: &SyncReceiver) -> Option<String> {
        None
    }

    /// The checksum of `keys` of the weights, computed where they live: `state_checksum(state, keys)` of the
    /// workload's current weights (a Python model on a GPU hashes its CUDA tensors there instead of copying
    /// the state to the host per verified sync). `None`: the runtime hashes `state` after
    /// [`Workload::host_view`], as it does for a workload whose weights are `state`.
    fn weights_checksum(
        &mut self,
        _state: &StateDict,
        _keys: &[String],
    ) -> Result<Option<u64>, WorkloadError> {
        Ok(None)
    }

    /// Trainer, with the same-host GPU channel (`weight_syncer.patch.transport_device: cuda`), after the init
    /// bootstrap: the channel's sending device over the device tensors of `keys` (the synced keys, in order),
    /// which the rollouts hold in `dtypes` (floating tensors in another dtype are cast on the device:
    /// [`rlsync_core::gpu::ipc::cast`]), on the stream the workload's own work runs on
    /// ([`crate::worker::gpu_channel`]). By default, and for weights that are not all tensors of one GPU, the
    /// error says why it cannot.
    fn gpu_sender_device(
        &mut self,
        _state: &StateDict,
        _keys: &[String],
        _dtypes: &[DType],
    ) -> Result<Box<dyn SenderDevice + Send>, WorkloadError> {
        Err(no_gpu_channel())
    }

    /// Rollout, with the same-host GPU channel, after the init bootstrap: the channel's receiving device,
    /// which installs into the device tensors of `keys`.
    fn gpu_receiver_device(
        &mut self,
        _state: &StateDict,
        _keys: &[String],
    ) -> Result<Box<dyn ReceiverDevice + Send>, WorkloadError> {
        Err(no_gpu_channel())
    }

    /// The runtime is about to read `state`'s bytes (a sync on the host path, a checksum, a checkpoint, a
    /// local copy, a rejoin): a workload that keeps its weights elsewhere too (host copies of CUDA tensors)
    /// brings `state` up to date first. A no-op when `state` is the weights.
    fn host_view(&mut self) -> Result<(), WorkloadError> {
        Ok(())
    }

    /// The runtime wrote the weights: into `state` (`on_device` false: a bootstrap, a rejoin, a local copy, an
    /// install on the host path), which a workload that keeps its weights elsewhere too copies there now; or,
    /// through an attached installer, into the device tensors (`true`), which leaves `state` stale until the
    /// next [`Workload::host_view`].
    fn weights_written(&mut self, _on_device: bool) -> Result<(), WorkloadError> {
        Ok(())
    }

    /// Trainer: save a checkpoint of `state` (and whatever resuming needs) after `step` trainer steps, holding
    /// weight `version`, to `<run_dir>/checkpoints/global_step_<step>/`; returns that directory. By default the
    /// weights alone (`model.safetensors` with the checkpoint metadata, see `checkpoint::save_weights`).
    fn save_checkpoint(
        &mut self,
        state: &StateDict,
        run_dir: &Path,
        step: u64,
        version: u64,
    ) -> Result<PathBuf, WorkloadError> {
        Ok(crate::checkpoint::save_weights(
            state, run_dir, step, version,
        )?)
    }
    /// Trainer of a resumed run (`runner.resume_dir`), right after `init_state`: load the checkpoint in `dir`
    /// into `state`. By default its weights, in place (see `checkpoint::load_weights_into`).
    fn restore(&mut self, state: &mut StateDict, dir: &Path) -> Result<(), WorkloadError> {
        crate::checkpoint::load_weights_into(state, dir)?;
        Ok(())
    }
}

/// A workload whose weights are host tensors: the GPU channel needs them on a GPU.
fn no_gpu_channel() -> WorkloadError {
    WorkloadError::GpuChannel {
        reason: "this worker's weights are host tensors; the channel moves versions between CUDA tensors: \
                 Python workers with their models on a GPU (actor.worker.device=cuda, rollout.worker.device=cuda), \
                 or set weight_syncer.patch.transport_device=cpu"
            .into(),
    }
}

/// Where a workload runs: its worker's role and rank, the run's shape and directory.
#[derive(Debug, Clone, PartialEq)]
pub struct Placement {
    pub role: Role,
    pub rank: u32,
    /// Rollout workers of the run.
    pub rollouts: u32,
    /// Envs this worker simulates (rollouts; 1 for the trainer).
    pub envs: u32,
    /// Checkpoints go to `<run_dir>/checkpoints/`.
    pub run_dir: PathBuf,
}

/// Build the workload that `actor.model.model_type` names for the worker at `place`: the synthetic one (a
/// rollout's weights in `rollout.model.precision`). The
/// learner models (`mlp_policy`, `vla_tiny`, `torchscript`) are built by the `rlsync-learner` executable, whose
/// builder hands the synthetic model back to this one.
pub fn build(cfg: &RunConfig, place: &Placement) -> Result<Box<dyn Workload>, WorkloadError> {
    match cfg.actor.model.model_type {
        ModelType::Synthetic => {
            let seed = crate::worker::worker_seed(place.role, place.rank);
            // The trainer holds its weights in `actor.model.precision`, a rollout in
            // `rollout.model.precision` (RLinf's keys; the syncs cast floating tensors between them).
            let mut model = cfg.actor.model.clone();
            if place.role == Role::Rollout {
                model.precision = cfg.rollout.model.precision;
            }
            Ok(Box::new(SyntheticWorkload::new(
                &model,
                place.envs,
                cfg.actor.seed,
                seed,
            )?))
        }
        model => Err(WorkloadError::NoLearner {
            model: model.name(),
        }),
    }
}
