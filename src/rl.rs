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
    checkpoint_dir, latest_checkpoint, read_info, read_metadata,
};
pub use metrics::TrainMetrics;
pub use trajectory::{ActMode, ActionBuf, Decision, Trajectory, collect, evaluate};
pub use workload::{RolloutWork, TrainerWork, rollout_dtype};

use crate::env::EnvError;

/// Role of a named weight, as the syncer sees it: trainable and buffer entries are synced after every step,
/// frozen ones only at bootstrap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ParamRole {
    Trainable,
    Buffer,
    Frozen,
}

impl ParamRole {
    pub fn name(self) -> &'static str {
        match self {
            ParamRole::Trainable => "trainable",
            ParamRole::Buffer => "buffer",
            ParamRole::Frozen => "frozen",
        }
    }

    pub fn parse(s: &str) -> Option<ParamRole> {
        [ParamRole::Trainable, ParamRole::Buffer, ParamRole::Frozen]
            .into_iter()
            .find(|r| r.name() == s)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_round_trip_by_name() {
        for r in [ParamRole::Trainable, ParamRole::Buffer, ParamRole::Frozen] {
            assert_eq!(ParamRole::parse(r.name()), Some(r));
        }
        assert_eq!(ParamRole::parse("persistent"), None);
    }
}
