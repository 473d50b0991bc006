//! The learner backend of a build without the `torch` feature: same API, every constructor fails clearly.
//!
//! `Learner` and `Actor` hold an uninhabited value, so once construction has failed no method can be reached;
//! their bodies are `match self.never {}`.

use std::convert::Infallible;
use std::path::Path;

use crate::config::schema::{ModelType, RunConfig};
use crate::env::EnvSpec;
use crate::tensor::{DType, StateDict};

use super::{ActMode, CheckpointInfo, Decision, RlError, TrainMetrics, Trajectory};

/// The trainer's model, optimizer and algorithm (unavailable in this build).
#[derive(Debug)]
pub struct Learner {
    never: Infallible,
}

/// A rollout's copy of the policy (unavailable in this build).
#[derive(Debug)]
pub struct Actor {
    never: Infallible,
}

/// Whether this build can run the learner for `model`: never, in this build.
pub fn available(model: ModelType) -> Result<(), RlError> {
    Err(RlError::NoTorch {
        model: model_name(model),
    })
}

fn model_name(model: ModelType) -> &'static str {
    match model {
        ModelType::Synthetic => "synthetic",
        ModelType::MlpPolicy => "mlp_policy",
        ModelType::VlaTiny => "vla_tiny",
        ModelType::Torchscript => "torchscript",
    }
}

impl Learner {
    pub fn new(cfg: &RunConfig, _spec: EnvSpec) -> Result<Learner, RlError> {
        Err(RlError::NoTorch {
            model: model_name(cfg.actor.model.model_type),
        })
    }

    pub fn global_step(&self) -> u64 {
        match self.never {}
    }

    pub fn version(&self) -> u64 {
        match self.never {}
    }

    pub fn train_step(&mut self, _traj: &Trajectory) -> Result<TrainMetrics, RlError> {
        match self.never {}
    }

    pub fn actor(&self, _cfg: &RunConfig, _seed: u64) -> Result<Actor, RlError> {
        match self.never {}
    }

    pub fn state_dict(&self, _float: Option<DType>) -> Result<StateDict, RlError> {
        match self.never {}
    }

    pub(crate) fn export_into(&self, _state: &mut StateDict) -> Result<(), RlError> {
        match self.never {}
    }

    pub(crate) fn save_checkpoint(&self, _run_dir: &Path) -> Result<CheckpointInfo, RlError> {
        match self.never {}
    }

    pub fn resume(&mut self, _dir: &Path) -> Result<CheckpointInfo, RlError> {
        match self.never {}
    }

    pub fn weights_checksum(&self) -> Result<u64, RlError> {
        match self.never {}
    }
}

impl Actor {
    pub fn new(cfg: &RunConfig, _spec: EnvSpec, _seed: u64) -> Result<Actor, RlError> {
        Err(RlError::NoTorch {
            model: model_name(cfg.actor.model.model_type),
        })
    }

    pub fn version(&self) -> u64 {
        match self.never {}
    }

    pub fn act(&mut self, _obs: &[f32], _mode: ActMode) -> Result<Decision, RlError> {
        match self.never {}
    }

    pub fn state_dict(&self) -> Result<StateDict, RlError> {
        match self.never {}
    }

    pub(crate) fn import_state(
        &mut self,
        _state: &StateDict,
        _version: u64,
    ) -> Result<(), RlError> {
        match self.never {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::env::ActionSpace;

    #[test]
    fn constructors_say_the_feature_is_missing() {
        let spec = EnvSpec {
            obs_dim: 4,
            action: ActionSpace::Discrete { n: 2 },
        };
        let err = Learner::new(&RunConfig::default(), spec)
            .unwrap_err()
            .to_string();
        assert!(err.contains("built without the `torch` feature"), "{err}");
        let err = available(ModelType::MlpPolicy).unwrap_err().to_string();
        assert!(
            err.starts_with("model `mlp_policy` needs the libtorch learner"),
            "{err}"
        );
        assert!(
            err.contains(
                "model@actor.model=synthetic_small env@env.train=synthetic env@env.eval=synthetic"
            ),
            "{err}"
        );
        assert!(matches!(
            Actor::new(&RunConfig::default(), spec, 0),
            Err(RlError::NoTorch { .. })
        ));
    }
}
