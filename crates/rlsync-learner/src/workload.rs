//! The libtorch learner as worker workloads: [`LearnerTrainer`] wraps `rl::TrainerWork`, [`LearnerRollout`]
//! wraps `rl::RolloutWork`; trajectories cross processes in the trajectory encoding; [`build`] is the
//! `rlsync-learner` executable's workload builder.

use std::num::NonZeroU32;
use std::path::{Path, PathBuf};

use rlsync::config::schema::{ModelType, RunConfig};
use rlsync::worker::workload::{
    Batch, EpisodeMetrics, Placement, SharedWeights, TrainStats, TrajectoryChunk, Workload,
    WorkloadError,
};
use rlsync_core::protocol::arrays::ChunkOrigin;
use rlsync_core::protocol::messages::Role;
use rlsync_core::tensor::StateDict;

use crate::rl::{RolloutWork, TrainerWork, Trajectory};
use crate::trajectory_codec::{decode_trajectories, encode_trajectory};

/// The trainer side: PPO/GRPO updates and checkpoints (when the orchestrator asks). Evaluation runs on the
/// rollout workers ([`LearnerRollout`]).
pub struct LearnerTrainer {
    work: TrainerWork,
}

impl LearnerTrainer {
    pub fn new(cfg: &RunConfig, run_dir: &Path) -> Result<LearnerTrainer, WorkloadError> {
        Ok(LearnerTrainer {
            work: TrainerWork::new(cfg, run_dir)?,
        })
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
        let train = self.work.train_step(state, &trajs)?;
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
        // The learner's own counters (they continue across a resume, as the run's steps and versions do).
        metrics.push(("learner/global_step".into(), step as f64));
        metrics.push((
            "learner/version".into(),
            self.work.learner().version() as f64,
        ));
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

    /// The learner saves its own checkpoint (weights, optimizer) under the run dir it was built with.
    fn save_checkpoint(
        &mut self,
        _state: &StateDict,
        _run_dir: &Path,
        step: u64,
        _version: u64,
    ) -> Result<PathBuf, WorkloadError> {
        let info = self.work.save_checkpoint()?;
        if info.global_step != step {
            return Err(WorkloadError::Placement {
                reason: format!(
                    "the learner is at step {}, the run at step {step}",
                    info.global_step
                ),
            });
        }
        Ok(info.dir)
    }

    /// Nothing to do: `TrainerWork::new` resumed the learner (weights and optimizer) from `runner.resume_dir`.
    fn restore(&mut self, _state: &mut StateDict, _dir: &Path) -> Result<(), WorkloadError> {
        Ok(())
    }
}

/// The rollout side: this worker's share of `env.train`'s envs and a policy copy.
pub struct LearnerRollout {
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

    fn evaluate(
        &mut self,
        state: &StateDict,
        version: u64,
    ) -> Result<Option<EpisodeMetrics>, WorkloadError> {
        Ok(Some(self.work.evaluate_state(state, version)?))
    }

    /// The policy's weights become views of each shared buffer handed to `rollout`/`evaluate` (for the call)
    /// when the buffers hold them in the policy's dtypes — they do: the arena is laid out from a rollout's
    /// own `init_state` — else each version is imported as outside the host-shared mode, naming why.
    fn act_on_shared(&mut self, state: &StateDict) -> Result<SharedWeights, WorkloadError> {
        Ok(match self.work.act_on_views(state) {
            Ok(()) => SharedWeights::Views,
            Err(refused) => SharedWeights::Imports {
                why: Box::new(refused),
            },
        })
    }

    fn imported_weight_bytes(&self) -> Option<u64> {
        Some(self.work.imported_bytes())
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
            data: encode_trajectory(origin, &traj)?,
        })
    }
}

/// The learner executable's workload builder: the learner models here, the synthetic one as `rlsync` builds it.
pub fn build(cfg: &RunConfig, place: &Placement) -> Result<Box<dyn Workload>, WorkloadError> {
    match (cfg.actor.model.model_type, place.role) {
        (ModelType::Synthetic, _) => rlsync::worker::workload::build(cfg, place),
        (_, Role::Trainer) => Ok(Box::new(LearnerTrainer::new(cfg, &place.run_dir)?)),
        (_, Role::Rollout) => {
            let workers =
                NonZeroU32::new(place.rollouts).ok_or_else(|| WorkloadError::Placement {
                    reason: "a run needs at least one rollout worker".into(),
                })?;
            Ok(Box::new(LearnerRollout::new(cfg, place.rank, workers)?))
        }
    }
}
