//! The loop plan of a run, computed from the config alone: the entry point, worker count, env split, chunking
//! and the env steps per train step. (The `--dry-run` report with byte estimates is `crate::dry_run`.)

use crate::config::schema::RunConfig;
use crate::orchestrator::OrchestratorError;
use crate::protocol::launch::StartPoint;

/// The user-facing entry points; each composes `<entry>.yaml` by default and becomes `hydra.job.name`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Entry {
    /// `train_embodied`: synchronous sync → rollout → train.
    Embodied,
    /// `train_async`: overlapped rollouts and training with a staleness bound.
    Async,
    /// `bench_sync`: the weight-sync benchmark.
    BenchSync,
}

impl Entry {
    pub fn name(self) -> &'static str {
        match self {
            Entry::Embodied => "train_embodied",
            Entry::Async => "train_async",
            Entry::BenchSync => "bench_sync",
        }
    }

    pub fn parse(name: &str) -> Option<Entry> {
        [Entry::Embodied, Entry::Async, Entry::BenchSync]
            .into_iter()
            .find(|e| e.name() == name)
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct RunPlan {
    pub entry: Entry,
    pub rollouts: u32,
    pub envs_per_rollout: u32,
    /// The run's total train steps (`runner.max_steps`): a resumed run trains steps `start.step..steps`.
    pub steps: u64,
    /// The step and weight version training starts at (a resumed run: its checkpoint's; see [`resume_point`]).
    pub start: StartPoint,
    /// Env steps of every env of a rollout per chunk.
    pub chunk_steps: u32,
    /// Chunks each rollout contributes per train step (the batch is `rollouts * chunks_per_rollout`).
    pub chunks_per_rollout: u32,
    /// Env steps trained on per train step.
    pub env_steps_per_step: u64,
}

fn invalid(reason: impl Into<String>) -> OrchestratorError {
    OrchestratorError::Config {
        reason: reason.into(),
    }
}

/// The rollout worker count: one per process of `cluster.component_placement.rollout` (one per slot unless
/// the placement gives process ranks).
pub fn rollout_workers(cfg: &RunConfig) -> Result<u32, OrchestratorError> {
    let placement = crate::config::placement::resolve(&cfg.cluster)
        .map_err(|source| OrchestratorError::Placement { source })?;
    match u32::try_from(placement.rollouts.len()) {
        Ok(0) | Err(_) => Err(invalid(
            "cluster.component_placement.rollout must list 1 or more slots",
        )),
        Ok(n) => Ok(n),
    }
}

pub fn plan(entry: Entry, cfg: &RunConfig) -> Result<RunPlan, OrchestratorError> {
    if entry == Entry::BenchSync {
        return Err(invalid(
            "bench_sync does not start workers; it is run by `rlsync bench_sync`",
        ));
    }
    let rollouts = rollout_workers(cfg)?;
    let envs = cfg.env.train.total_num_envs.get();
    if !envs.is_multiple_of(rollouts) {
        return Err(invalid(format!(
            "env.train.total_num_envs={envs} does not split evenly over {rollouts} rollout workers"
        )));
    }
    let steps = if cfg.runner.max_steps >= 0 {
        cfg.runner.max_steps
    } else {
        cfg.runner.max_epochs
    };
    if steps <= 0 {
        return Err(invalid(
            "runner.max_steps (or runner.max_epochs when max_steps is -1) must be positive",
        ));
    }
    let per_step = u64::from(cfg.env.train.max_steps_per_rollout_epoch.get())
        * u64::from(cfg.env.train.rollout_epoch.get());
    let chunk_steps = u64::from(cfg.rollout.chunk_steps.get()).min(per_step);
    let chunks_per_rollout = u32::try_from(per_step.div_ceil(chunk_steps))
        .map_err(|_| invalid("too many rollout chunks per step"))?;
    let interval = u64::from(cfg.runner.weight_sync_interval.get());
    if entry == Entry::Async && u64::from(cfg.algorithm.staleness_threshold) + 1 < interval {
        return Err(invalid(format!(
            "algorithm.staleness_threshold={} cannot be met when weights are synced only every {interval} steps \
             (runner.weight_sync_interval); use a threshold of at least {}",
            cfg.algorithm.staleness_threshold,
            interval - 1
        )));
    }
    let envs_per_rollout = envs / rollouts;
    Ok(RunPlan {
        entry,
        rollouts,
        envs_per_rollout,
        steps: steps as u64,
        start: StartPoint::default(),
        chunk_steps: chunk_steps as u32,
        chunks_per_rollout,
        env_steps_per_step: u64::from(rollouts)
            * u64::from(chunks_per_rollout)
            * chunk_steps
            * u64::from(envs_per_rollout),
    })
}

/// Where a run starts: step 0 and version 0, or, with `runner.resume_dir`, the step and version that
/// checkpoint recorded (RLinf's semantics: `runner.max_steps` stays the run's total, so a run resumed at step
/// 100 of 150 trains 50 steps). A checkpoint at or past the total is an error (there is nothing left to train)
/// unless `runner.only_eval` is set.
pub fn resume_point(cfg: &RunConfig, total: u64) -> Result<StartPoint, OrchestratorError> {
    let Some(dir) = &cfg.runner.resume_dir else {
        return Ok(StartPoint::default());
    };
    let info = crate::checkpoint::read_info(dir)
        .map_err(|e| invalid(format!("runner.resume_dir={}: {e}", dir.display())))?;
    if info.global_step >= total && !cfg.runner.only_eval {
        return Err(invalid(format!(
            "runner.resume_dir={} is at step {}, and runner.max_steps={total} is the run's total: nothing \
             is left to train (raise runner.max_steps)",
            dir.display(),
            info.global_step
        )));
    }
    Ok(StartPoint {
        step: info.global_step,
        version: info.version,
    })
}

/// A `runner.resume_dir` that is set but holds nothing to resume from (checked by the dry run and at the
/// start of a real run).
pub(crate) fn resume_problem(cfg: &RunConfig) -> Option<String> {
    let dir = cfg.runner.resume_dir.as_ref()?;
    (!dir.is_dir()).then(|| {
        format!(
            "runner.resume_dir: {} is not a directory (nothing to resume from)",
            dir.display()
        )
    })
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use super::*;
    use crate::config::schema::Placement;

    #[test]
    fn default_plan_splits_envs_and_chunks() {
        let p = plan(Entry::Embodied, &RunConfig::default()).unwrap();
        assert_eq!((p.rollouts, p.envs_per_rollout, p.steps), (2, 4, 10));
        assert_eq!((p.chunk_steps, p.chunks_per_rollout), (16, 2));
        assert_eq!(p.env_steps_per_step, 2 * 2 * 16 * 4);
    }

    fn check_error(edit: impl FnOnce(&mut RunConfig), entry: Entry, expect: &str) {
        let mut cfg = RunConfig::default();
        edit(&mut cfg);
        let err = rlsync_core::error_chain(&plan(entry, &cfg).unwrap_err());
        assert!(err.contains(expect), "'{err}' should contain '{expect}'");
    }

    #[test]
    fn impossible_configs_are_named() {
        check_error(
            |c| c.env.train.total_num_envs = NonZeroU32::new(3).unwrap(),
            Entry::Embodied,
            "total_num_envs=3",
        );
        check_error(
            |c| {
                c.runner.weight_sync_interval = NonZeroU32::new(3).unwrap();
                c.algorithm.staleness_threshold = 1;
            },
            Entry::Async,
            "staleness_threshold=1",
        );
        check_error(|c| c.runner.max_steps = 0, Entry::Embodied, "max_steps");
        check_error(
            |c| drop(c.cluster.component_placement.shift_remove("rollout")),
            Entry::Embodied,
            "no entry for rollout",
        );
        check_error(
            |c| {
                drop(
                    c.cluster
                        .component_placement
                        .insert("rollout".into(), Placement::Ranges("2-1".into())),
                )
            },
            Entry::Embodied,
            "component_placement.rollout",
        );
        check_error(|_| {}, Entry::BenchSync, "bench_sync");
    }

    #[test]
    fn slower_sync_is_fine_for_the_synchronous_loop() {
        let mut cfg = RunConfig::default();
        cfg.runner.weight_sync_interval = NonZeroU32::new(3).unwrap();
        cfg.algorithm.staleness_threshold = 0;
        assert!(plan(Entry::Embodied, &cfg).is_ok());
        cfg.cluster
            .component_placement
            .insert("rollout".into(), Placement::Single(3));
        assert_eq!(plan(Entry::Embodied, &cfg).unwrap().rollouts, 1);
    }
}
