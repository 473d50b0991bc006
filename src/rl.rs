//! The real learner on libtorch (policies, PPO, GRPO, TorchScript); a dummy without the `torch` feature.
//!
//! This module is the backend selector: the only place in the crate that names the `torch` feature. Both
//! backends expose the same types with the same signatures ([`Learner`] on the trainer, [`Actor`] on
//! rollouts), so call sites never branch on features; the dummy's constructors return
//! [`RlError::NoTorch`]. Everything that needs no tensors (trajectory layout, rollout collection, advantage
//! estimation, metrics) lives here, outside the backend, and is tested in the plain build.
//!
//! # TorchScript policy signature
//! A scripted policy (`actor.model.model_type: torchscript`, `actor.model.torchscript_path`) is a
//! `torch.jit.ScriptModule` whose `forward(obs)` takes a float32 tensor `[B, obs_dim]` and returns a tuple
//! `(head, log_std, value)`: `head` is `[B, A]` (action means for continuous tasks, logits for discrete ones),
//! `log_std` is `[A]` or `[B, A]` (ignored for discrete tasks; return any tensor), `value` is `[B]` or `[B, 1]`.
//! All parameters with `requires_grad` are trained. See `examples/torchscript/export_policy.py`.

mod advantage;
mod checkpoint_layout;
mod metrics;
mod trajectory;
mod workload;

#[cfg(feature = "torch")]
mod libtorch;
#[cfg(feature = "torch")]
use libtorch as backend;

#[cfg(not(feature = "torch"))]
mod dummy;
#[cfg(not(feature = "torch"))]
use dummy as backend;

use std::path::PathBuf;

pub use advantage::{gae, group_relative};
pub use backend::{Actor, Learner, available};
pub use checkpoint_layout::{
    CHECKSUM_KEY, CheckpointInfo, FORMAT_VERSION, META_FORMAT, OPTIMIZER_FILE, WEIGHTS_FILE,
    checkpoint_dir, latest_checkpoint, load_weights_into, read_info, read_metadata, save_weights,
};
pub use metrics::TrainMetrics;
pub use trajectory::{ActMode, ActionBuf, Decision, Trajectory, collect, evaluate};
pub use workload::{RolloutWork, TrainerWork, rollout_dtype};

use crate::config::schema::ModelType;
use crate::env::EnvError;

/// Checks, before any worker starts, that this build can run the workload `actor.model.model_type` names, so
/// a build without libtorch fails once with what to do instead of failing in every worker.
pub fn preflight(model: ModelType) -> Result<(), RlError> {
    match model {
        ModelType::Synthetic => Ok(()),
        learner => available(learner),
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RlError {
    #[error(
        "model `{model}` needs the libtorch learner, and this rlsync was built without the `torch` feature: \
         build it with `make build` (cargo build --release --features torch, with LIBTORCH_USE_PYTORCH=1), or run \
         the synthetic workload instead by adding the overrides \
         `model@actor.model=synthetic_small env@env.train=synthetic env@env.eval=synthetic`"
    )]
    NoTorch { model: &'static str },
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
    #[error("checkpoint {path}: {reason}")]
    Checkpoint { path: PathBuf, reason: String },
    #[error("weights do not match the model: {reason}")]
    WeightsMismatch { reason: String },
    #[error(transparent)]
    Env(#[from] EnvError),
}
