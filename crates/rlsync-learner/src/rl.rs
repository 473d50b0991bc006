//! The real learner on libtorch (policies, PPO, GRPO, TorchScript): [`Learner`] on the trainer, [`Actor`] on
//! rollouts.
//!
//! Everything that needs no tensors (trajectory layout, rollout collection, advantage estimation, metrics)
//! lives here, outside `libtorch/`, and is tested without a model.
//!
//! # TorchScript policy signature
//! A scripted policy (`actor.model.model_type: torchscript`, `actor.model.torchscript_path`) is a
//! `torch.jit.ScriptModule` whose `forward(obs)` takes a float32 tensor `[B, obs_dim]` and returns a tuple
//! `(head, log_std, value)`: `head` is `[B, A]` (action means for continuous tasks, logits for discrete ones),
//! `log_std` is `[A]` or `[B, A]` (ignored for discrete tasks; return any tensor), `value` is `[B]` or `[B, 1]`.
//! All parameters with `requires_grad` are trained. A module may declare running observation statistics as
//! non-trainable float32 parameters `obs_norm.mean`, `obs_norm.var` (`[obs_dim]`) and `obs_norm.count` (`[]`):
//! the trainer updates them from every batch (as for `mlp_policy`) and syncs them as buffers. Weights keep
//! the module's parameter names; every checkpoint also holds `policy.pt`, the module with its trained weights
//! (`torch.jit.load`-able). See `examples/torchscript/export_policy.py`.

mod advantage;
mod libtorch;
mod metrics;
mod trajectory;
mod workload;

use std::path::PathBuf;

pub use advantage::{gae, group_relative};
pub use libtorch::{Actor, Learner, NoViews};
pub use metrics::TrainMetrics;
pub use trajectory::{ActMode, ActionBuf, Decision, Trajectory, collect, evaluate};
pub use workload::{RolloutWork, TrainerWork, rollout_dtype};

use crate::env::EnvError;
use rlsync::checkpoint::CheckpointError;

#[derive(Debug, thiserror::Error)]
pub enum RlError {
    #[error(
        "model type `{model}` cannot be used by the learner (use mlp_policy, vla_tiny or torchscript)"
    )]
    UnsupportedModel { model: String },
    #[error("actor.model.torchscript_path must be set for model_type torchscript")]
    MissingTorchscriptPath,
    #[error("torchscript policy {path}: {reason}")]
    Torchscript { path: PathBuf, reason: String },
    #[error("libtorch failed while {context}: {message}")]
    Torch {
        context: &'static str,
        message: String,
    },
    #[error("{what}: expected {expected}, got {got}")]
    Shape {
        what: String,
        expected: String,
        got: String,
    },
    #[error("invalid trajectory: {reason}")]
    Trajectory { reason: String },
    #[error("algorithm.group_size {group_size} must divide the number of envs {num_envs} for grpo")]
    GroupSize { group_size: usize, num_envs: usize },
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error("weights do not match the model: {reason}")]
    WeightsMismatch { reason: String },
    /// A state dict the actor's weights were to be views of does not hold them as they are.
    #[error("the actor's weights cannot be views of this state dict")]
    NoViews(#[source] NoViews),
    /// The actor's weights were views of a shared state dict, released when the call that bound them ended.
    #[error("the actor holds no weights outside a call that points it at a state dict")]
    NoWeights,
    /// Weights cannot be copied into an actor while its weights are views of a shared state dict.
    #[error(
        "the actor's weights are read-only views of a state dict now: nothing may be copied into them"
    )]
    ReadOnlyViews,
    #[error(transparent)]
    Env(#[from] EnvError),
}

impl From<RlError> for rlsync::worker::workload::WorkloadError {
    fn from(e: RlError) -> Self {
        rlsync::worker::workload::WorkloadError::Learner(Box::new(e))
    }
}
