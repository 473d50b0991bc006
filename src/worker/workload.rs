//! The `Workload` trait: what a trainer or rollout worker computes, independent of processes and transport.

use crate::config::schema::{ModelType, RunConfig};
use crate::tensor::StateDict;
use crate::worker::synthetic::SyntheticWorkload;

#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    #[error("model type {model:?} is not available in this build: {reason}")]
    Unavailable { model: ModelType, reason: &'static str },
    #[error("state dict has no tensor '{name}' that the workload expects")]
    MissingTensor { name: String },
    #[error("model tensor: {0}")]
    Tensor(#[from] crate::tensor::TensorError),
    #[error("invalid synthetic model: {reason}")]
    InvalidModel { reason: String },
}

/// One batch of trajectories handed to a train step: concatenated chunk payloads.
#[derive(Debug, Clone, Copy)]
pub struct Batch<'a> {
    pub chunks: u32,
    pub env_steps: u64,
    pub data: &'a [u8],
}

/// What a train step reports.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrainStats {
    pub loss: f64,
}

/// A piece of trajectory produced by one weight version (weights never change inside a chunk).
#[derive(Debug)]
pub struct TrajectoryChunk {
    pub env_steps: u64,
    pub mean_return: f64,
    pub data: Vec<u8>,
}

/// The compute of a run. The trainer calls `init_state` then `train_step` per batch; each rollout calls
/// `init_state` then `rollout` per chunk. Both sides build the same layout from the same config, so frozen
/// tensors agree without being synced. Implementations may block (they run on dedicated threads).
pub trait Workload: Send {
    /// Build the model state dict with roles (trainable | buffer | frozen) and initial values.
    fn init_state(&mut self) -> Result<StateDict, WorkloadError>;
    /// One optimisation step on `batch`, updating `state` in place.
    fn train_step(&mut self, state: &mut StateDict, batch: &Batch<'_>) -> Result<TrainStats, WorkloadError>;
    /// Act in the environments for `steps` steps of every env with the weights in `state`.
    fn rollout(&mut self, state: &StateDict, steps: u32) -> Result<TrajectoryChunk, WorkloadError>;
}

/// Build the workload that `actor.model.model_type` names, for a worker simulating `envs` environments.
pub fn build(cfg: &RunConfig, envs: u32, worker_seed: u64) -> Result<Box<dyn Workload>, WorkloadError> {
    match cfg.actor.model.model_type {
        ModelType::Synthetic => Ok(Box::new(SyntheticWorkload::new(&cfg.actor.model, envs, cfg.actor.seed, worker_seed)?)),
        other => Err(WorkloadError::Unavailable {
            model: other,
            reason: "the libtorch learner is not wired into the workers yet; use actor.model.model_type=synthetic",
        }),
    }
}
