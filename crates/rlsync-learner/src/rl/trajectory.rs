//! Rollout data: the time-major trajectory a rollout collects (with behaviour log-probs and weight versions),
//! rollout collection over a [`VecEnv`], and deterministic evaluation.

use crate::env::{ActionSpace, Actions, EpisodeMetrics, VecEnv};

use super::{Actor, RlError};

/// Actions of a batch, one row per sample.
#[derive(Debug, Clone, PartialEq)]
pub enum ActionBuf {
    Continuous(Vec<f32>),
    Discrete(Vec<i64>),
}

impl ActionBuf {
    fn empty_for(space: ActionSpace) -> ActionBuf {
        match space {
            ActionSpace::Continuous { .. } => ActionBuf::Continuous(Vec::new()),
            ActionSpace::Discrete { .. } => ActionBuf::Discrete(Vec::new()),
        }
    }

    pub(crate) fn as_actions(&self) -> Actions<'_> {
        match self {
            ActionBuf::Continuous(a) => Actions::Continuous(a),
            ActionBuf::Discrete(a) => Actions::Discrete(a),
        }
    }

    fn extend(&mut self, other: &ActionBuf) -> Result<(), RlError> {
        match (self, other) {
            (ActionBuf::Continuous(a), ActionBuf::Continuous(b)) => a.extend_from_slice(b),
            (ActionBuf::Discrete(a), ActionBuf::Discrete(b)) => a.extend_from_slice(b),
            _ => {
                return Err(RlError::Trajectory {
                    reason: "continuous and discrete actions mixed".into(),
                });
            }
        }
        Ok(())
    }

    fn len(&self) -> usize {
        match self {
            ActionBuf::Continuous(a) => a.len(),
            ActionBuf::Discrete(a) => a.len(),
        }
    }
}

/// What an actor decided for a batch of observations.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub actions: ActionBuf,
    /// Log-probability of each env's action under the acting policy.
    pub logprobs: Vec<f32>,
}

/// How an actor picks actions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActMode {
    /// Sample from the policy (the actor's own seeded RNG).
    Sample,
    /// The mode of the distribution (mean / argmax): evaluation.
    Deterministic,
}

/// `steps x envs` transitions, time-major (entry `t * envs + e`).
#[derive(Debug, Clone, PartialEq)]
pub struct Trajectory {
    pub envs: usize,
    pub obs_dim: usize,
    pub action: ActionSpace,
    /// Observation acted on, `obs_dim` values per entry.
    pub obs: Vec<f32>,
    pub actions: ActionBuf,
    /// Behaviour log-probs recorded by the rollout.
    pub logprobs: Vec<f32>,
    pub rewards: Vec<f32>,
    pub terminated: Vec<bool>,
    pub truncated: Vec<bool>,
    /// Final observation of every truncated entry, in entry order (for bootstrapping).
    pub truncated_obs: Vec<f32>,
    /// Observation after the last step (bootstrap for unfinished episodes), `envs * obs_dim` values.
    pub last_obs: Vec<f32>,
    /// Weight version the rollout acted with, per entry.
    pub versions: Vec<u64>,
    /// Episodes that finished during this chunk.
    pub episodes: EpisodeMetrics,
}

impl Trajectory {
    pub fn new(envs: usize, obs_dim: usize, action: ActionSpace) -> Trajectory {
        Trajectory {
            envs,
            obs_dim,
            action,
            obs: Vec::new(),
            actions: ActionBuf::empty_for(action),
            logprobs: Vec::new(),
            rewards: Vec::new(),
            terminated: Vec::new(),
            truncated: Vec::new(),
            truncated_obs: Vec::new(),
            last_obs: Vec::new(),
            versions: Vec::new(),
            episodes: EpisodeMetrics::default(),
        }
    }

    /// Entries (`steps * envs`).
    pub fn len(&self) -> usize {
        self.rewards.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rewards.is_empty()
    }

    pub fn steps(&self) -> usize {
        self.len().checked_div(self.envs).unwrap_or(0)
    }

    /// Checks that every buffer agrees with `steps x envs` (data may come from another process).
    pub fn validate(&self) -> Result<(), RlError> {
        let n = self.len();
        let adim = match self.action {
            ActionSpace::Continuous { dim, .. } => dim,
            ActionSpace::Discrete { .. } => 1,
        };
        let truncs = self.truncated.iter().filter(|t| **t).count();
        let checks = [
            (
                "envs",
                self.envs > 0 && n.is_multiple_of(self.envs),
                format!("{} envs for {n} entries", self.envs),
            ),
            (
                "obs",
                is_product(self.obs.len(), n, self.obs_dim),
                format!("{} values", self.obs.len()),
            ),
            (
                "actions",
                is_product(self.actions.len(), n, adim),
                format!("{} values", self.actions.len()),
            ),
            (
                "logprobs",
                self.logprobs.len() == n,
                format!("{}", self.logprobs.len()),
            ),
            (
                "terminated",
                self.terminated.len() == n,
                format!("{}", self.terminated.len()),
            ),
            (
                "truncated",
                self.truncated.len() == n,
                format!("{}", self.truncated.len()),
            ),
            (
                "truncated_obs",
                is_product(self.truncated_obs.len(), truncs, self.obs_dim),
                format!("{}", self.truncated_obs.len()),
            ),
            (
                "last_obs",
                is_product(self.last_obs.len(), self.envs, self.obs_dim),
                format!("{}", self.last_obs.len()),
            ),
            (
                "versions",
                self.versions.len() == n,
                format!("{}", self.versions.len()),
            ),
        ];
        match checks.into_iter().find(|(_, ok, _)| !ok) {
            Some((what, _, got)) => Err(RlError::Trajectory {
                reason: format!("{what} has the wrong size ({got}, {n} entries)"),
            }),
            None => Ok(()),
        }
    }

    /// Joins chunks of disjoint env sets collected over the same number of steps (one per rollout worker)
    /// into one trajectory over all their envs, in the order given.
    pub(crate) fn concat_envs(parts: &[Trajectory]) -> Result<Trajectory, RlError> {
        let Some(first) = parts.first() else {
            return Err(RlError::Trajectory {
                reason: "no trajectories to join".into(),
            });
        };
        let steps = first.steps();
        for p in parts {
            p.validate()?;
            if p.steps() != steps || p.obs_dim != first.obs_dim || p.action != first.action {
                return Err(RlError::Trajectory {
                    reason: format!(
                        "chunks disagree: {} vs {steps} steps, obs {} vs {}",
                        p.steps(),
                        p.obs_dim,
                        first.obs_dim
                    ),
                });
            }
        }
        let envs = parts.iter().map(|p| p.envs).sum();
        let mut out = Trajectory::new(envs, first.obs_dim, first.action);
        let d = first.obs_dim;
        let adim = first.actions.len() / first.len().max(1);
        for t in 0..steps {
            for p in parts {
                let rows = t * p.envs..(t + 1) * p.envs;
                out.obs
                    .extend_from_slice(&p.obs[rows.start * d..rows.end * d]);
                let a = match &p.actions {
                    ActionBuf::Continuous(a) => {
                        ActionBuf::Continuous(a[rows.start * adim..rows.end * adim].to_vec())
                    }
                    ActionBuf::Discrete(a) => ActionBuf::Discrete(a[rows.clone()].to_vec()),
                };
                out.actions.extend(&a)?;
                out.logprobs.extend_from_slice(&p.logprobs[rows.clone()]);
                out.rewards.extend_from_slice(&p.rewards[rows.clone()]);
                out.terminated
                    .extend_from_slice(&p.terminated[rows.clone()]);
                out.truncated.extend_from_slice(&p.truncated[rows.clone()]);
                out.versions.extend_from_slice(&p.versions[rows.clone()]);
                let skip = p.truncated[..rows.start].iter().filter(|x| **x).count();
                let take = p.truncated[rows].iter().filter(|x| **x).count();
                out.truncated_obs
                    .extend_from_slice(&p.truncated_obs[skip * d..(skip + take) * d]);
            }
        }
        for p in parts {
            out.last_obs.extend_from_slice(&p.last_obs);
            out.episodes = out.episodes.merge(&p.episodes);
        }
        Ok(out)
    }
}

/// Runs `steps` batched env steps with `actor`, recording everything the trainer needs, each entry tagged
/// with the weight version the actor held.
pub fn collect(env: &mut VecEnv, actor: &mut Actor, steps: usize) -> Result<Trajectory, RlError> {
    let spec = env.spec();
    let n = env.num_envs();
    let mut traj = Trajectory::new(n, spec.obs_dim, spec.action);
    for _ in 0..steps {
        let obs = env.obs().to_vec();
        let version = actor.version();
        let decision = actor.act(&obs, ActMode::Sample)?;
        let out = env.step(decision.actions.as_actions())?;
        traj.obs.extend_from_slice(&obs);
        traj.actions.extend(&decision.actions)?;
        traj.logprobs.extend_from_slice(&decision.logprobs);
        traj.rewards.extend_from_slice(&out.reward);
        traj.terminated.extend_from_slice(&out.terminated);
        traj.truncated.extend_from_slice(&out.truncated);
        for (e, _) in out.truncated.iter().enumerate().filter(|(_, t)| **t) {
            traj.truncated_obs
                .extend_from_slice(&out.final_obs[e * spec.obs_dim..(e + 1) * spec.obs_dim]);
        }
        traj.versions.extend(std::iter::repeat_n(version, n));
    }
    traj.last_obs = env.obs().to_vec();
    traj.episodes = env.take_metrics();
    traj.validate()?;
    Ok(traj)
}

/// Deterministic evaluation: resets `env` and acts with the distribution's mode until every env has finished
/// exactly one episode; the metrics cover those episodes only, one per env (an env that finishes early waits:
/// its later episodes are not counted, so short episodes do not weigh more).
pub fn evaluate(env: &mut VecEnv, actor: &mut Actor) -> Result<EpisodeMetrics, RlError> {
    one_episode_per_env(env, |obs| {
        actor
            .act(obs, ActMode::Deterministic)
            .map(|decision| decision.actions)
    })
}

/// [`evaluate`] with any policy `act` (observations of every env → their actions).
pub fn one_episode_per_env(
    env: &mut VecEnv,
    mut act: impl FnMut(&[f32]) -> Result<ActionBuf, RlError>,
) -> Result<EpisodeMetrics, RlError> {
    env.reset();
    env.take_metrics();
    let n = env.num_envs();
    let (mut done, mut success) = (vec![false; n], vec![false; n]);
    let (mut ret, mut len) = (vec![0.0f64; n], vec![0u64; n]);
    // Every episode ends by `max_episode_steps` at the latest (truncation).
    let cap = u64::from(env.max_episode_steps());
    let mut steps = 0;
    while done.iter().any(|d| !d) && steps < cap {
        let obs = env.obs().to_vec();
        let actions = act(&obs)?;
        let out = env.step(actions.as_actions())?;
        for e in 0..n {
            if done[e] {
                continue;
            }
            ret[e] += f64::from(out.reward[e]);
            len[e] += 1;
            if out.terminated[e] || out.truncated[e] {
                done[e] = true;
                success[e] = out.success[e];
            }
        }
        steps += 1;
    }
    env.take_metrics();
    let finished: Vec<usize> = (0..n).filter(|e| done[*e]).collect();
    let episodes = finished.len() as u64;
    if episodes == 0 {
        return Ok(EpisodeMetrics::default());
    }
    let mean =
        |f: &dyn Fn(usize) -> f64| finished.iter().map(|e| f(*e)).sum::<f64>() / episodes as f64;
    Ok(EpisodeMetrics {
        ret: mean(&|e| ret[e]),
        success_rate: mean(&|e| f64::from(u8::from(success[e]))),
        episode_len: mean(&|e| len[e] as f64),
        episodes,
    })
}

/// `len == a * b`, where a product past `usize` (sizes from another process) is no match rather than an
/// overflow.
fn is_product(len: usize, a: usize, b: usize) -> bool {
    a.checked_mul(b) == Some(len)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evaluation_counts_exactly_one_episode_per_env() {
        use crate::env::EnvOptions;
        use rlsync::config::schema::{EnvSplitConfig, EnvType};
        use std::num::NonZeroU32;
        // Cartpole with a constant action: episodes end at different times in different envs, and the
        // early ones would end again before the slowest ends.
        let cfg = EnvSplitConfig {
            env_type: EnvType::Cartpole,
            total_num_envs: NonZeroU32::new(6).unwrap(),
            max_episode_steps: NonZeroU32::new(200).unwrap(),
            seed: 3,
            ..EnvSplitConfig::default()
        };
        let mut env = VecEnv::new(&EnvOptions::for_worker(&cfg, 0, NonZeroU32::MIN)).unwrap();
        let mut calls = 0;
        let mut first_ends = [None; 6];
        let m = one_episode_per_env(&mut env, |obs| {
            calls += 1;
            Ok(ActionBuf::Discrete(vec![0; obs.len() / 4]))
        })
        .unwrap();
        assert_eq!(m.episodes, 6, "one episode per env, never more");
        // Replaying the same envs by hand: the mean length is that of each env's first episode.
        let mut env = VecEnv::new(&EnvOptions::for_worker(&cfg, 0, NonZeroU32::MIN)).unwrap();
        env.reset();
        for t in 1..=calls {
            let out = env
                .step(ActionBuf::Discrete(vec![0; 6]).as_actions())
                .unwrap();
            for (e, end) in first_ends.iter_mut().enumerate() {
                if end.is_none() && (out.terminated[e] || out.truncated[e]) {
                    *end = Some(t as f64);
                }
            }
        }
        let lens: Vec<f64> = first_ends.iter().map(|l| l.unwrap()).collect();
        assert!(
            lens.iter().any(|l| *l != lens[0]),
            "envs end at different steps: {lens:?}"
        );
        let want = lens.iter().sum::<f64>() / 6.0;
        assert!(
            (m.episode_len - want).abs() < 1e-9,
            "{} vs {want}",
            m.episode_len
        );
        assert_eq!(calls as f64, lens.iter().cloned().fold(0.0, f64::max));
    }

    fn chunk(envs: usize, steps: usize, base: f32) -> Trajectory {
        let n = envs * steps;
        let mut t = Trajectory::new(envs, 2, ActionSpace::Discrete { n: 2 });
        t.obs = (0..n * 2).map(|i| base + i as f32).collect();
        t.actions = ActionBuf::Discrete((0..n as i64).collect());
        t.logprobs = vec![base; n];
        t.rewards = (0..n).map(|i| base + i as f32).collect();
        t.terminated = vec![false; n];
        t.truncated = (0..n).map(|i| i == envs).collect(); // env 0 truncated at step 1
        t.truncated_obs = vec![base + 0.5; 2];
        t.last_obs = vec![base; envs * 2];
        t.versions = vec![base as u64; n];
        t
    }

    #[test]
    fn concat_interleaves_envs_per_step() {
        let a = chunk(2, 2, 0.0);
        let b = chunk(1, 2, 100.0);
        let j = Trajectory::concat_envs(&[a, b]).unwrap();
        j.validate().unwrap();
        assert_eq!(j.envs, 3);
        // step 0: a's envs 0,1 then b's env 0; step 1 likewise.
        assert_eq!(j.rewards, vec![0.0, 1.0, 100.0, 2.0, 3.0, 101.0]);
        assert_eq!(j.truncated, vec![false, false, false, true, false, true]);
        assert_eq!(j.truncated_obs, vec![0.5, 0.5, 100.5, 100.5]);
        assert_eq!(j.versions, vec![0, 0, 100, 0, 0, 100]);
        assert_eq!(j.last_obs.len(), 6);
    }

    #[test]
    fn validate_names_the_bad_buffer() {
        let mut t = chunk(2, 2, 0.0);
        t.logprobs.pop();
        let err = t.validate().unwrap_err().to_string();
        assert!(err.contains("logprobs"), "{err}");
        let mut t = chunk(2, 2, 0.0);
        t.truncated_obs.clear();
        assert!(
            t.validate()
                .unwrap_err()
                .to_string()
                .contains("truncated_obs")
        );
        assert!(Trajectory::concat_envs(&[chunk(1, 2, 0.0), chunk(1, 3, 0.0)]).is_err());
        assert!(Trajectory::concat_envs(&[]).is_err());
    }
}
