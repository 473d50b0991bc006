//! Built-in vectorised embodied tasks (reach, cartpole), deterministic under a seed.
//!
//! A [`VecEnv`] steps N independent copies of one task in lock step. Every copy owns its own RNG seeded from
//! `(seed, global env index)`, so splitting `total_num_envs` across rollout workers (each worker gets a
//! contiguous `first_index..first_index + num_envs` range) yields the same episodes as one worker running them
//! all. Finished episodes reset automatically inside `step`; the observation they ended on is kept in
//! [`StepResult::final_obs`] so learners can bootstrap truncated episodes.

mod cartpole;
mod reach;
mod stats;

use std::num::NonZeroU32;

use rlsync::config::schema::{EnvSplitConfig, EnvType};

pub use cartpole::Cartpole;
pub use reach::Reach;
pub use rlsync::worker::workload::EpisodeMetrics;
pub use stats::EpisodeStats;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum EnvError {
    #[error("env type `{env_type:?}` is not a built-in vectorised task (use reach or cartpole)")]
    NotBuiltIn { env_type: EnvType },
    #[error("{what} has {got} entries, expected {expected} ({num_envs} envs)")]
    ActionShape {
        what: &'static str,
        got: usize,
        expected: usize,
        num_envs: usize,
    },
    #[error("{task} takes {expected} actions, got {got}")]
    ActionKind {
        task: &'static str,
        expected: &'static str,
        got: &'static str,
    },
    #[error("discrete action {action} of env {env} is out of range 0..{n}")]
    ActionOutOfRange { env: usize, action: i64, n: usize },
}

/// What a policy must output for a task.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ActionSpace {
    /// `dim` real actions per env; values outside `[-bound, bound]` are clipped by the env.
    Continuous { dim: usize, bound: f32 },
    /// One of `n` choices per env.
    Discrete { n: usize },
}

impl ActionSpace {
    /// Number of policy outputs (mean dims or logits).
    pub(crate) fn head_dim(&self) -> usize {
        match *self {
            ActionSpace::Continuous { dim, .. } => dim,
            ActionSpace::Discrete { n } => n,
        }
    }
}

/// Shape of one task: observation width and action space.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EnvSpec {
    pub obs_dim: usize,
    pub action: ActionSpace,
}

/// A batch of actions, one row per env (row-major for continuous actions).
#[derive(Debug, Clone, Copy)]
pub enum Actions<'a> {
    Continuous(&'a [f32]),
    Discrete(&'a [i64]),
}

impl Actions<'_> {
    fn kind(&self) -> &'static str {
        match self {
            Actions::Continuous(_) => "continuous",
            Actions::Discrete(_) => "discrete",
        }
    }
}

/// Which envs to build: a task, how many copies, and where they sit in the global env numbering.
#[derive(Debug, Clone, PartialEq)]
pub struct EnvOptions {
    pub env_type: EnvType,
    pub num_envs: usize,
    /// Global index of this batch's first env (its RNG stream and thus its episodes depend on it).
    pub first_index: usize,
    pub seed: u64,
    pub max_episode_steps: NonZeroU32,
    /// reach only: links of the arm.
    pub num_links: NonZeroU32,
    /// Consecutive envs sharing one reset stream (GRPO groups start from identical states); 1 otherwise.
    pub group_size: NonZeroU32,
}

impl EnvOptions {
    /// Options for the share of rollout worker `rank` out of `workers`: `total_num_envs` split evenly in
    /// whole groups of `group_size` envs, the first ranks taking one more group when they do not divide.
    pub(crate) fn for_worker(cfg: &EnvSplitConfig, rank: usize, workers: NonZeroU32) -> EnvOptions {
        let group = cfg.group_size.get() as usize;
        let groups = (cfg.total_num_envs.get() as usize).div_ceil(group);
        let workers = workers.get() as usize;
        let (base, extra) = (groups / workers, groups % workers);
        let num_envs = (base + usize::from(rank < extra)) * group;
        let first_index = (rank * base + rank.min(extra)) * group;
        EnvOptions {
            env_type: cfg.env_type,
            num_envs,
            first_index,
            seed: cfg.seed,
            max_episode_steps: cfg.max_episode_steps,
            num_links: cfg.num_links,
            group_size: cfg.group_size,
        }
    }

    /// The reset-stream index of global env `index`.
    fn stream(&self, index: usize) -> usize {
        index / self.group_size.get() as usize
    }
}

/// The observation and action shape of a task, without building its envs (the trainer needs no envs).
pub(crate) fn spec_for(cfg: &EnvSplitConfig) -> Result<EnvSpec, EnvError> {
    match cfg.env_type {
        EnvType::Reach => Ok(Reach::new(cfg.num_links.get() as usize, 0, &[]).spec()),
        EnvType::Cartpole => Ok(Cartpole::spec()),
        other => Err(EnvError::NotBuiltIn { env_type: other }),
    }
}

/// What one batched step returns; every buffer has one row per env.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepResult {
    /// Observations to act on next (already reset for finished envs).
    pub obs: Vec<f32>,
    /// Observations the step ended on, before any automatic reset.
    pub final_obs: Vec<f32>,
    pub reward: Vec<f32>,
    /// The episode ended in a terminal state (success, failure): no bootstrap.
    pub terminated: Vec<bool>,
    /// The episode hit `max_episode_steps`: bootstrap from `final_obs`.
    pub truncated: Vec<bool>,
    /// The episode that ended here (terminated or truncated) counts as a success.
    pub success: Vec<bool>,
}

/// One task's physics for N envs; the vectorised wrapper handles bookkeeping and resets.
enum Task {
    Reach(Reach),
    Cartpole(Cartpole),
}

/// N copies of a built-in task stepped together.
pub struct VecEnv {
    task: Task,
    spec: EnvSpec,
    num_envs: usize,
    max_episode_steps: u32,
    obs: Vec<f32>,
    elapsed: Vec<u32>,
    stats: EpisodeStats,
}

/// The outcome of stepping one env once (the task's part of a step).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Transition {
    pub reward: f32,
    pub terminated: bool,
    pub success: bool,
}

impl VecEnv {
    pub fn new(opts: &EnvOptions) -> Result<VecEnv, EnvError> {
        let streams: Vec<usize> = (opts.first_index..opts.first_index + opts.num_envs)
            .map(|i| opts.stream(i))
            .collect();
        let task = match opts.env_type {
            EnvType::Reach => Task::Reach(Reach::new(
                opts.num_links.get() as usize,
                opts.seed,
                &streams,
            )),
            EnvType::Cartpole => Task::Cartpole(Cartpole::new(opts.seed, &streams)),
            other => return Err(EnvError::NotBuiltIn { env_type: other }),
        };
        let spec = match &task {
            Task::Reach(r) => r.spec(),
            Task::Cartpole(_) => Cartpole::spec(),
        };
        let mut env = VecEnv {
            task,
            spec,
            num_envs: opts.num_envs,
            max_episode_steps: opts.max_episode_steps.get(),
            obs: vec![0.0; opts.num_envs * spec.obs_dim],
            elapsed: vec![0; opts.num_envs],
            stats: EpisodeStats::new(opts.num_envs),
        };
        env.reset();
        Ok(env)
    }

    pub fn spec(&self) -> EnvSpec {
        self.spec
    }

    pub(crate) fn num_envs(&self) -> usize {
        self.num_envs
    }

    pub(crate) fn max_episode_steps(&self) -> u32 {
        self.max_episode_steps
    }

    /// Current observations, `num_envs * obs_dim` values.
    pub fn obs(&self) -> &[f32] {
        &self.obs
    }

    /// Starts a fresh episode in every env (each env's RNG stream continues, so resets differ).
    pub fn reset(&mut self) -> &[f32] {
        for env in 0..self.num_envs {
            self.reset_env(env);
        }
        self.stats.discard_running();
        &self.obs
    }

    fn reset_env(&mut self, env: usize) {
        let dim = self.spec.obs_dim;
        let row = &mut self.obs[env * dim..(env + 1) * dim];
        match &mut self.task {
            Task::Reach(r) => r.reset(env, row),
            Task::Cartpole(c) => c.reset(env, row),
        }
        self.elapsed[env] = 0;
    }

    /// Applies one action per env, records finished episodes and resets them.
    pub fn step(&mut self, actions: Actions<'_>) -> Result<StepResult, EnvError> {
        self.check_actions(actions)?;
        let n = self.num_envs;
        let dim = self.spec.obs_dim;
        let mut out = StepResult {
            obs: Vec::new(),
            final_obs: vec![0.0; n * dim],
            reward: vec![0.0; n],
            terminated: vec![false; n],
            truncated: vec![false; n],
            success: vec![false; n],
        };
        for env in 0..n {
            let row = &mut self.obs[env * dim..(env + 1) * dim];
            let tr = match (&mut self.task, actions) {
                (Task::Reach(r), Actions::Continuous(a)) => {
                    let adim = self.spec.action.head_dim();
                    r.step(env, &a[env * adim..(env + 1) * adim], row)
                }
                (Task::Cartpole(c), Actions::Discrete(a)) => c.step(env, a[env], row),
                // check_actions rejected every other pairing.
                _ => continue,
            };
            self.elapsed[env] += 1;
            let truncated = !tr.terminated && self.elapsed[env] >= self.max_episode_steps;
            out.final_obs[env * dim..(env + 1) * dim].copy_from_slice(row);
            out.reward[env] = tr.reward;
            out.terminated[env] = tr.terminated;
            out.truncated[env] = truncated;
            // cartpole counts surviving to the cap as success.
            let success = tr.success || (truncated && matches!(self.task, Task::Cartpole(_)));
            out.success[env] = (tr.terminated || truncated) && success;
            self.stats
                .record(env, tr.reward, tr.terminated || truncated, success);
            if tr.terminated || truncated {
                self.reset_env(env);
            }
        }
        out.obs = self.obs.clone();
        Ok(out)
    }

    fn check_actions(&self, actions: Actions<'_>) -> Result<(), EnvError> {
        let task = match self.task {
            Task::Reach(_) => "reach",
            Task::Cartpole(_) => "cartpole",
        };
        match (self.spec.action, actions) {
            (ActionSpace::Continuous { dim, .. }, Actions::Continuous(a)) => {
                let expected = dim * self.num_envs;
                if a.len() != expected {
                    return Err(EnvError::ActionShape {
                        what: "continuous actions",
                        got: a.len(),
                        expected,
                        num_envs: self.num_envs,
                    });
                }
            }
            (ActionSpace::Discrete { n }, Actions::Discrete(a)) => {
                if a.len() != self.num_envs {
                    return Err(EnvError::ActionShape {
                        what: "discrete actions",
                        got: a.len(),
                        expected: self.num_envs,
                        num_envs: self.num_envs,
                    });
                }
                if let Some((env, &action)) = a
                    .iter()
                    .enumerate()
                    .find(|(_, x)| !(0..n as i64).contains(x))
                {
                    return Err(EnvError::ActionOutOfRange { env, action, n });
                }
            }
            (ActionSpace::Continuous { .. }, other) => {
                return Err(EnvError::ActionKind {
                    task,
                    expected: "continuous",
                    got: other.kind(),
                });
            }
            (ActionSpace::Discrete { .. }, other) => {
                return Err(EnvError::ActionKind {
                    task,
                    expected: "discrete",
                    got: other.kind(),
                });
            }
        }
        Ok(())
    }

    /// Metrics of the episodes finished since the last call (`env/return`, `env/success_rate`,
    /// `env/episode_len`), then forgets them.
    pub(crate) fn take_metrics(&mut self) -> EpisodeMetrics {
        self.stats.take()
    }
}

/// Seed for env `index` of a run seeded with `seed` (splitmix64, so neighbouring indices decorrelate).
pub(crate) fn env_seed(seed: u64, index: usize) -> u64 {
    let mut z = seed
        ^ (index as u64)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .wrapping_add(0xD1B5_4A32_D192_ED03);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(env_type: EnvType, num_envs: usize, first_index: usize, seed: u64) -> EnvOptions {
        EnvOptions {
            env_type,
            num_envs,
            first_index,
            seed,
            max_episode_steps: NonZeroU32::new(20).unwrap(),
            num_links: NonZeroU32::new(2).unwrap(),
            group_size: NonZeroU32::MIN,
        }
    }

    /// A fixed pseudo-random action sequence for `env`'s spec.
    fn run(env: &mut VecEnv, steps: usize) -> Vec<StepResult> {
        let spec = env.spec();
        let n = env.num_envs();
        (0..steps)
            .map(|t| match spec.action {
                ActionSpace::Continuous { dim, .. } => {
                    let a: Vec<f32> = (0..n * dim)
                        .map(|i| (((t * 7 + i * 13) % 11) as f32 / 5.0) - 1.0)
                        .collect();
                    env.step(Actions::Continuous(&a)).unwrap()
                }
                ActionSpace::Discrete { .. } => {
                    let a: Vec<i64> = (0..n).map(|i| ((t + i) % 2) as i64).collect();
                    env.step(Actions::Discrete(&a)).unwrap()
                }
            })
            .collect()
    }

    #[test]
    fn same_seed_same_episodes_and_different_seed_differs() {
        for ty in [EnvType::Reach, EnvType::Cartpole] {
            let a = run(&mut VecEnv::new(&opts(ty, 4, 0, 7)).unwrap(), 50);
            let b = run(&mut VecEnv::new(&opts(ty, 4, 0, 7)).unwrap(), 50);
            let c = run(&mut VecEnv::new(&opts(ty, 4, 0, 8)).unwrap(), 50);
            assert_eq!(a, b, "{ty:?}");
            assert_ne!(a, c, "{ty:?}");
        }
    }

    #[test]
    fn split_across_workers_matches_one_batch() {
        for ty in [EnvType::Reach, EnvType::Cartpole] {
            let whole = VecEnv::new(&opts(ty, 5, 0, 3)).unwrap();
            let dim = whole.spec().obs_dim;
            let cfg = EnvSplitConfig {
                env_type: ty,
                total_num_envs: NonZeroU32::new(5).unwrap(),
                seed: 3,
                ..Default::default()
            };
            let mut joined = Vec::new();
            for rank in 0..2 {
                let o = EnvOptions::for_worker(&cfg, rank, NonZeroU32::new(2).unwrap());
                assert_eq!(
                    (o.num_envs, o.first_index),
                    if rank == 0 { (3, 0) } else { (2, 3) }
                );
                joined.extend_from_slice(VecEnv::new(&o).unwrap().obs());
            }
            assert_eq!(joined.len(), 5 * dim);
            assert_eq!(joined, whole.obs(), "{ty:?}");
        }
    }

    #[test]
    fn spec_without_envs_matches_the_built_envs() {
        for ty in [EnvType::Reach, EnvType::Cartpole] {
            let cfg = EnvSplitConfig {
                env_type: ty,
                num_links: NonZeroU32::new(3).unwrap(),
                ..Default::default()
            };
            let built = VecEnv::new(&EnvOptions::for_worker(&cfg, 0, NonZeroU32::MIN))
                .unwrap()
                .spec();
            assert_eq!(spec_for(&cfg).unwrap(), built);
        }
        assert!(spec_for(&EnvSplitConfig::default()).is_err());
    }

    #[test]
    fn workers_get_whole_groups() {
        let cfg = EnvSplitConfig {
            env_type: EnvType::Reach,
            total_num_envs: NonZeroU32::new(12).unwrap(),
            group_size: NonZeroU32::new(4).unwrap(),
            ..Default::default()
        };
        let split: Vec<(usize, usize)> = (0..2)
            .map(|r| EnvOptions::for_worker(&cfg, r, NonZeroU32::new(2).unwrap()))
            .map(|o| (o.first_index, o.num_envs))
            .collect();
        assert_eq!(split, vec![(0, 8), (8, 4)]);
    }

    #[test]
    fn group_members_start_identically() {
        let mut o = opts(EnvType::Reach, 4, 0, 9);
        o.group_size = NonZeroU32::new(2).unwrap();
        let env = VecEnv::new(&o).unwrap();
        let d = env.spec().obs_dim;
        let obs = env.obs();
        assert_eq!(obs[..d], obs[d..2 * d]);
        assert_eq!(obs[2 * d..3 * d], obs[3 * d..]);
        assert_ne!(obs[..d], obs[2 * d..3 * d]);
    }

    #[test]
    fn bad_actions_are_errors_not_panics() {
        let mut reach = VecEnv::new(&opts(EnvType::Reach, 2, 0, 0)).unwrap();
        let mut cart = VecEnv::new(&opts(EnvType::Cartpole, 2, 0, 0)).unwrap();
        assert!(matches!(
            reach.step(Actions::Continuous(&[0.0; 3])),
            Err(EnvError::ActionShape { expected: 4, .. })
        ));
        assert!(matches!(
            reach.step(Actions::Discrete(&[0, 1])),
            Err(EnvError::ActionKind { .. })
        ));
        assert_eq!(
            cart.step(Actions::Discrete(&[0, 2])),
            Err(EnvError::ActionOutOfRange {
                env: 1,
                action: 2,
                n: 2
            })
        );
        assert!(matches!(
            cart.step(Actions::Discrete(&[0])),
            Err(EnvError::ActionShape { .. })
        ));
        assert!(matches!(
            VecEnv::new(&opts(EnvType::Synthetic, 2, 0, 0)),
            Err(EnvError::NotBuiltIn { .. })
        ));
    }

    #[test]
    fn episodes_are_capped_and_reset() {
        // cartpole with a balancing-agnostic policy: every episode ends by failure or by the 20-step cap.
        let mut env = VecEnv::new(&opts(EnvType::Cartpole, 3, 0, 1)).unwrap();
        let results = run(&mut env, 100);
        let m = env.take_metrics();
        assert!(m.episodes >= 15, "{m:?}");
        assert!(m.episode_len <= 20.0 && m.episode_len >= 1.0, "{m:?}");
        for r in &results {
            for e in 0..3 {
                assert!(!(r.terminated[e] && r.truncated[e]));
            }
        }
        // after a finish the next obs is a fresh start, not the final one.
        let done = results
            .iter()
            .find(|r| r.terminated[0] || r.truncated[0])
            .unwrap();
        assert_ne!(done.obs[..4], done.final_obs[..4]);
        assert!(done.obs[..4].iter().all(|x| x.abs() <= 0.05));
        // take_metrics forgets what it reported.
        assert_eq!(env.take_metrics().episodes, 0);
    }
}
