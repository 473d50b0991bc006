//! The libtorch learner as worker workloads: [`LearnerTrainer`] wraps `rl::TrainerWork`, [`LearnerRollout`]
//! wraps `rl::RolloutWork`; trajectories cross processes in the protocol's trajectory encoding.

use std::num::NonZeroU32;
use std::path::Path;

use crate::config::schema::RunConfig;
use crate::env::{EnvOptions, EpisodeMetrics, VecEnv};
use crate::protocol::trajectory::{ChunkOrigin, decode_trajectories, encode_trajectory};
use crate::rl::{RolloutWork, TrainerWork, Trajectory, evaluate};
use crate::tensor::StateDict;
use crate::worker::workload::{Batch, TrainStats, TrajectoryChunk, Workload, WorkloadError};

/// The trainer side: PPO/GRPO updates, checkpoints every `runner.save_interval` steps, and deterministic
/// eval of the trainer's weights on `env.eval` every `runner.val_check_interval` steps.
pub(crate) struct LearnerTrainer {
    work: TrainerWork,
    cfg: RunConfig,
}

impl LearnerTrainer {
    pub fn new(cfg: &RunConfig, run_dir: &Path) -> Result<LearnerTrainer, WorkloadError> {
        Ok(LearnerTrainer {
            work: TrainerWork::new(cfg, run_dir)?,
            cfg: cfg.clone(),
        })
    }

    /// Eval episodes on all of `env.eval`'s envs (one episode each), with a fresh actor holding the
    /// trainer's current weights.
    fn evaluate(&self) -> Result<EpisodeMetrics, WorkloadError> {
        let one = NonZeroU32::MIN;
        let mut env = VecEnv::new(&EnvOptions::for_worker(&self.cfg.env.eval, 0, one))
            .map_err(crate::rl::RlError::from)?;
        let mut actor = self.work.learner().actor(&self.cfg, self.cfg.actor.seed)?;
        let episodes = u64::from(self.cfg.env.eval.total_num_envs.get());
        Ok(evaluate(&mut env, &mut actor, episodes)?)
    }
}

/// Orders a batch's chunks by (chunk, rank) and treats every chunk as its own set of envs: each chunk carries
/// its own bootstrap observation, so chunks of the same envs at different times need no stitching.
fn batch_trajectories(data: &[u8]) -> Result<Vec<Trajectory>, WorkloadError> {
    let mut chunks = decode_trajectories(data)?;
    chunks.sort_by_key(|(origin, _)| (origin.chunk, origin.rank));
    Ok(chunks.into_iter().map(|(_, t)| t).collect())
}

impl Workload for LearnerTrainer {
    fn init_state(&mut self) -> Result<StateDict, WorkloadError> {
        Ok(self.work.init_state()?)
    }

    fn train_step(
        &mut self,
        state: &mut StateDict,
        batch: &Batch<'_>,
    ) -> Result<TrainStats, WorkloadError> {
        let trajs = batch_trajectories(batch.data)?;
        let episodes = trajs
            .iter()
            .fold(EpisodeMetrics::default(), |acc, t| acc.merge(&t.episodes));
        let (train, checkpoint) = self.work.train_step(state, &trajs)?;
        let mut metrics: Vec<(String, f64)> = train
            .named()
            .iter()
            .map(|(k, v)| ((*k).to_owned(), *v))
            .collect();
        // Steps where no episode finished have no env metrics (zeros would read as a failing policy).
        if episodes.episodes > 0 {
            metrics.extend(episodes.named().iter().map(|(k, v)| ((*k).to_owned(), *v)));
        }
        let step = self.work.learner().global_step();
        let every = self.cfg.runner.val_check_interval;
        if every > 0 && step.is_multiple_of(every as u64) {
            let eval = self.evaluate()?;
            metrics.extend(
                eval.named()
                    .iter()
                    .map(|(k, v)| (k.replacen("env/", "eval/", 1), *v)),
            );
        }
        if let Some(saved) = checkpoint {
            metrics.push(("checkpoint/global_step".into(), saved.global_step as f64));
        }
        // The learner's own counters continue across a resume (the run's `step` and sync versions restart).
        metrics.push(("learner/global_step".into(), step as f64));
        metrics.push((
            "learner/version".into(),
            self.work.learner().version() as f64,
        ));
        if let Some(from) = self.work.resumed() {
            metrics.push(("learner/resumed_from_step".into(), from.global_step as f64));
        }
        Ok(TrainStats {
            loss: train.loss,
            metrics,
        })
    }

    fn rollout(
        &mut self,
        _state: &StateDict,
        _version: u64,
        _steps: u32,
    ) -> Result<TrajectoryChunk, WorkloadError> {
        Err(WorkloadError::Placement {
            reason: "the trainer's learner does not generate trajectories".into(),
        })
    }
}

/// The rollout side: this worker's share of `env.train`'s envs and a policy copy.
pub(crate) struct LearnerRollout {
    work: RolloutWork,
    rank: u32,
    next_chunk: u64,
}

impl LearnerRollout {
    pub fn new(
        cfg: &RunConfig,
        rank: u32,
        workers: NonZeroU32,
    ) -> Result<LearnerRollout, WorkloadError> {
        Ok(LearnerRollout {
            work: RolloutWork::new(cfg, rank as usize, workers)?,
            rank,
            next_chunk: 0,
        })
    }
}

impl Workload for LearnerRollout {
    fn init_state(&mut self) -> Result<StateDict, WorkloadError> {
        Ok(self.work.init_state()?)
    }

    fn train_step(
        &mut self,
        _state: &mut StateDict,
        _batch: &Batch<'_>,
    ) -> Result<TrainStats, WorkloadError> {
        Err(WorkloadError::Placement {
            reason: "a rollout's learner does not train".into(),
        })
    }

    fn rollout(
        &mut self,
        state: &StateDict,
        version: u64,
        steps: u32,
    ) -> Result<TrajectoryChunk, WorkloadError> {
        let traj = self.work.rollout(state, version, steps as usize)?;
        let origin = ChunkOrigin {
            rank: self.rank,
            chunk: self.next_chunk,
        };
        self.next_chunk += 1;
        // Finished episodes' mean return when there are some, else the reward collected per env so far.
        let mean_return = if traj.episodes.episodes > 0 {
            traj.episodes.ret
        } else {
            traj.rewards.iter().map(|r| f64::from(*r)).sum::<f64>() / traj.envs.max(1) as f64
        };
        Ok(TrajectoryChunk {
            env_steps: traj.len() as u64,
            mean_return,
            data: encode_trajectory(origin, &traj),
        })
    }
}
