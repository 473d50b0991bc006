//! The learner as the two halves a run's workers drive: [`TrainerWork`] (learner, checkpoints, state dict
//! export for the syncer) and [`RolloutWork`] (actor, envs, trajectories, evaluation). They map one to one
//! onto the worker `Workload` hooks (`init_state`, `train_step`, `rollout`); moving trajectories between
//! processes (their byte encoding) belongs to the orchestrator's protocol, not here.

use std::num::NonZeroU32;
use std::path::{Path, PathBuf};

use crate::env::{EnvOptions, EpisodeMetrics, VecEnv, spec_for};
use rlsync::config::schema::{RunConfig, WeightDtype};
use rlsync_core::tensor::{DType, StateDict};

use rlsync::checkpoint::CheckpointInfo;

use super::{Actor, Learner, NoViews, RlError, TrainMetrics, Trajectory, collect, evaluate};

/// The dtype rollouts hold weights in, which is also the dtype of the trainer's sync buffer.
pub fn rollout_dtype(cfg: &RunConfig) -> DType {
    match cfg.rollout.model.precision {
        WeightDtype::Bf16 => DType::Bf16,
        WeightDtype::F16 => DType::F16,
        WeightDtype::F32 => DType::F32,
    }
}

/// The trainer's half: fp32 master weights, optimizer, checkpoints.
pub struct TrainerWork {
    learner: Learner,
    cfg: RunConfig,
    run_dir: PathBuf,
    resumed: Option<CheckpointInfo>,
}

impl TrainerWork {
    /// Builds the learner for `env.train`'s task and resumes from `runner.resume_dir` when set.
    pub fn new(cfg: &RunConfig, run_dir: &Path) -> Result<TrainerWork, RlError> {
        let mut learner = Learner::new(cfg, spec_for(&cfg.env.train)?)?;
        let resumed = match &cfg.runner.resume_dir {
            Some(dir) => {
                let info = learner.resume(dir)?;
                tracing::info!(
                    "resumed from {}: global step {}, version {}, weights checksum {:#018x}",
                    info.dir.display(),
                    info.global_step,
                    info.version,
                    info.weights_checksum
                );
                Some(info)
            }
            None => None,
        };
        Ok(TrainerWork {
            learner,
            cfg: cfg.clone(),
            run_dir: run_dir.to_owned(),
            resumed,
        })
    }

    pub fn learner(&self) -> &Learner {
        &self.learner
    }

    /// The checkpoint this run resumed from, if any.
    pub fn resumed(&self) -> Option<&CheckpointInfo> {
        self.resumed.as_ref()
    }

    /// The state dict the syncer sends from: every weight with its class, floating ones in the rollouts'
    /// dtype (the trainer keeps fp32 masters; `export_into` casts into this buffer after every step).
    pub fn init_state(&self) -> Result<StateDict, RlError> {
        self.learner.state_dict(Some(rollout_dtype(&self.cfg)))
    }

    /// One update on the chunks of every rollout worker (same steps, disjoint envs, worker order), then
    /// the new weights are written into `state`.
    pub fn train_step(
        &mut self,
        state: &mut StateDict,
        chunks: &[Trajectory],
    ) -> Result<TrainMetrics, RlError> {
        let traj = Trajectory::concat_envs(chunks)?;
        let metrics = self.learner.train_step(&traj)?;
        self.learner.export_into(state)?;
        Ok(metrics)
    }

    /// Saves weights and optimizer state to `<run_dir>/checkpoints/global_step_<n>/` (the orchestrator decides
    /// when: every `runner.save_interval` steps, at the final step and on an interrupt).
    pub fn save_checkpoint(&self) -> Result<CheckpointInfo, RlError> {
        self.learner.save_checkpoint(&self.run_dir)
    }
}

/// A rollout worker's half: its share of the envs and a copy of the policy (or, in the host-shared mode, the
/// policy's weights as views of each state dict it is handed).
pub struct RolloutWork {
    actor: Actor,
    env: VecEnv,
    cfg: RunConfig,
    rank: usize,
    workers: NonZeroU32,
    /// Version of the weights last imported from a state dict.
    installed: Option<u64>,
    /// [`RolloutWork::act_on_views`] was called: every rollout and evaluation acts on the state dict it is
    /// handed in place, for the length of the call; nothing is imported.
    views: bool,
}

impl RolloutWork {
    /// Rollout `rank` of `workers`: its contiguous share of `env.train.total_num_envs` (whole GRPO groups).
    pub fn new(cfg: &RunConfig, rank: usize, workers: NonZeroU32) -> Result<RolloutWork, RlError> {
        let env = VecEnv::new(&EnvOptions::for_worker(&cfg.env.train, rank, workers))?;
        let seed = cfg.actor.seed ^ (0x5EED_0000 + rank as u64);
        let actor = Actor::new(cfg, env.spec(), seed)?;
        Ok(RolloutWork {
            actor,
            env,
            cfg: cfg.clone(),
            rank,
            workers,
            installed: None,
            views: false,
        })
    }

    /// The receiver-side state dict (same names, shapes, classes and dtypes as the trainer's sync buffer).
    pub fn init_state(&self) -> Result<StateDict, RlError> {
        self.actor.state_dict()
    }

    /// From now on act on the state dicts [`RolloutWork::rollout`] and [`RolloutWork::evaluate_state`] are
    /// handed in place (the policy's weights are views of them for the length of each call: no copy per
    /// version, and the policy's own weights are released), when `state` — laid out like every state dict to
    /// come — holds every weight in the policy's own dtype and shape. Refused (and nothing changes: the
    /// worker keeps importing each version) with the weight that would need a converting copy.
    pub fn act_on_views(&mut self, state: &StateDict) -> Result<(), NoViews> {
        self.actor.viewable(state)?;
        self.views = true;
        Ok(())
    }

    /// Bytes of weights copied out of state dicts into the policy so far (0 while it acts on views).
    pub fn imported_bytes(&self) -> u64 {
        self.actor.imported_bytes()
    }

    /// Installs `state` (the weights of `version`) unless that version is already installed — or, acting on
    /// views, points the policy at `state` for the call — then steps every env `steps` times; each entry is
    /// tagged with `version`.
    pub fn rollout(
        &mut self,
        state: &StateDict,
        version: u64,
        steps: usize,
    ) -> Result<Trajectory, RlError> {
        if self.views {
            let env = &mut self.env;
            return self
                .actor
                .with_views(state, version, |actor| collect(env, actor, steps));
        }
        self.install(state, version)?;
        collect(&mut self.env, &mut self.actor, steps)
    }

    /// Makes the actor hold `state`, the weights of `version` (a no-op when it already does).
    pub fn install(&mut self, state: &StateDict, version: u64) -> Result<(), RlError> {
        if self.installed != Some(version) {
            self.actor.import_state(state, version)?;
            self.installed = Some(version);
        }
        Ok(())
    }

    /// Deterministic evaluation of the weights this worker holds (the version installed by the last
    /// [`RolloutWork::rollout`] or [`RolloutWork::install`]) on this worker's share of `env.eval`, on freshly
    /// built envs (the same episodes at every call): exactly one episode per env.
    pub fn evaluate(&mut self) -> Result<EpisodeMetrics, RlError> {
        let mut env = self.eval_env()?;
        evaluate(&mut env, &mut self.actor)
    }

    /// [`RolloutWork::evaluate`] of `state`, the weights of `version`: installed first, or (acting on views)
    /// pointed at for the call.
    pub fn evaluate_state(
        &mut self,
        state: &StateDict,
        version: u64,
    ) -> Result<EpisodeMetrics, RlError> {
        if self.views {
            let mut env = self.eval_env()?;
            return self
                .actor
                .with_views(state, version, |actor| evaluate(&mut env, actor));
        }
        self.install(state, version)?;
        self.evaluate()
    }

    fn eval_env(&self) -> Result<VecEnv, RlError> {
        Ok(VecEnv::new(&EnvOptions::for_worker(
            &self.cfg.env.eval,
            self.rank,
            self.workers,
        ))?)
    }
}
