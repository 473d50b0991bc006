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
//! All parameters with `requires_grad` are trained. A module may declare running observation statistics as
//! non-trainable float32 parameters `obs_norm.mean`, `obs_norm.var` (`[obs_dim]`) and `obs_norm.count` (`[]`):
//! the trainer updates them from every batch (as for `mlp_policy`) and syncs them as buffers. Weights keep
//! the module's parameter names; every checkpoint also holds `policy.pt`, the module with its trained weights
//! (`torch.jit.load`-able). See `examples/torchscript/export_policy.py`.

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

use std::path::{Path, PathBuf};

pub use advantage::{gae, group_relative};
pub use backend::{Actor, Learner, available};
pub use checkpoint_layout::{
    CHECKSUM_KEY, CheckpointInfo, FORMAT_VERSION, META_FORMAT, OPTIMIZER_FILE, SCRIPT_FILE,
    WEIGHTS_FILE, checkpoint_dir, latest_checkpoint, load_weights_into, read_info, read_metadata,
    save_weights,
};
pub use metrics::TrainMetrics;
pub use trajectory::{ActMode, ActionBuf, Decision, Trajectory, collect, evaluate};
pub use workload::{RolloutWork, TrainerWork, rollout_dtype};

use crate::config::schema::ModelType;
use crate::env::EnvError;

/// File name of the learner executable: the `torch` build of the worker, which `make build` puts next to
/// `rlsync` (a build without libtorch), so that only learner workers load libtorch and every other command
/// starts in milliseconds.
pub const LEARNER_EXE: &str = "rlsync-learner";

/// Environment variable that names the learner executable instead of the one next to `rlsync`.
pub const LEARNER_ENV: &str = "RLSYNC_LEARNER";

/// Where this executable (`exe`) looks for the learner executable: `$RLSYNC_LEARNER`, else `rlsync-learner`
/// in the same directory.
pub fn learner_exe(exe: &Path) -> PathBuf {
    match std::env::var_os(LEARNER_ENV) {
        Some(path) if !path.is_empty() => PathBuf::from(path),
        _ => exe.with_file_name(LEARNER_EXE),
    }
}

/// Checks, before any worker starts, that the built-in workload of `model` (`actor.model.model_type`) can
/// run, and returns the executable its workers start from: `exe` (this build) for the synthetic workload and
/// in builds with libtorch, else the separately built learner executable `learner` — so a build without
/// libtorch and without a learner fails once, with what to do instead, rather than in every worker.
pub fn preflight(model: ModelType, exe: &Path, learner: &Path) -> Result<PathBuf, RlError> {
    match model {
        ModelType::Synthetic => Ok(exe.to_owned()),
        model => match available(model) {
            Ok(()) => Ok(exe.to_owned()),
            Err(RlError::NoTorch { model }) if !learner.is_file() => Err(RlError::NoLearner {
                model,
                path: learner.to_owned(),
            }),
            Err(RlError::NoTorch { .. }) => Ok(learner.to_owned()),
            Err(other) => Err(other),
        },
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
        "model `{model}` needs the libtorch learner: this rlsync was built without the `torch` feature and \
         there is no learner executable at {path} (set RLSYNC_LEARNER to name another): build both with \
         `make build`, or run the synthetic workload instead by adding the overrides \
         `model@actor.model=synthetic_small env@env.train=synthetic env@env.eval=synthetic`",
        path = path.display()
    )]
    NoLearner { model: &'static str, path: PathBuf },
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
    /// The checkpoint's file or directory could not be read or written (the caller can tell a missing one).
    #[error("checkpoint {path}")]
    CheckpointIo {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("weights do not match the model: {reason}")]
    WeightsMismatch { reason: String },
    #[error(transparent)]
    Env(#[from] EnvError),
}
