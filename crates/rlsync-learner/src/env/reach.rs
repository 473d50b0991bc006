//! `reach`: a planar multi-link arm moved by joint-velocity actions towards a random target.
//!
//! The arm has `L` links of length `1/L` (total reach 1) anchored at the origin. Each step an action in
//! `[-1, 1]^L` (clipped) moves joint `i` by `action_i * MAX_JOINT_STEP` radians. The target is drawn on reset
//! at a random angle and a radius in `[0.2, 0.9]` (on the unit circle for a one-link arm). Reward is dense:
//! `-distance - ACTION_COST * |a|^2`, plus `SUCCESS_BONUS` on the step the end effector comes within
//! `SUCCESS_RADIUS` of the target, which ends the episode (terminated, success).
//!
//! Observation (`2L + 6` values): `cos q_i`, `sin q_i` for every joint, end effector `(x, y)`, target `(x, y)`,
//! and `target - end effector`.

use std::f32::consts::PI;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::{ActionSpace, EnvSpec, Transition, env_seed};

/// Largest joint move per step, in radians.
pub(crate) const MAX_JOINT_STEP: f32 = 0.2;
/// The end effector within this distance of the target is a success.
pub(crate) const SUCCESS_RADIUS: f32 = 0.08;
pub(crate) const SUCCESS_BONUS: f32 = 5.0;
pub(crate) const ACTION_COST: f32 = 0.01;

/// Joint angles and targets of N arms.
#[derive(Debug, Clone)]
pub struct Reach {
    links: usize,
    /// `links` angles per env.
    q: Vec<f32>,
    target: Vec<[f32; 2]>,
    rngs: Vec<StdRng>,
}

impl Reach {
    pub fn new(links: usize, seed: u64, streams: &[usize]) -> Reach {
        let n = streams.len();
        Reach {
            links: links.max(1),
            q: vec![0.0; n * links.max(1)],
            target: vec![[0.0; 2]; n],
            rngs: streams
                .iter()
                .map(|&i| StdRng::seed_from_u64(env_seed(seed, i)))
                .collect(),
        }
    }

    pub fn spec(&self) -> EnvSpec {
        EnvSpec {
            obs_dim: 2 * self.links + 6,
            action: ActionSpace::Continuous {
                dim: self.links,
                bound: 1.0,
            },
        }
    }

    fn link_len(&self) -> f32 {
        1.0 / self.links as f32
    }

    /// Forward kinematics: end effector of env `env`.
    pub(crate) fn end_effector(&self, env: usize) -> [f32; 2] {
        let l = self.link_len();
        let mut angle = 0.0f32;
        let mut p = [0.0f32; 2];
        for &qi in self
            .q
            .get(env * self.links..(env + 1) * self.links)
            .unwrap_or(&[])
        {
            angle += qi;
            p[0] += l * angle.cos();
            p[1] += l * angle.sin();
        }
        p
    }

    pub fn target(&self, env: usize) -> Option<[f32; 2]> {
        self.target.get(env).copied()
    }

    fn distance(&self, env: usize) -> f32 {
        let (p, t) = (
            self.end_effector(env),
            self.target.get(env).copied().unwrap_or_default(),
        );
        ((t[0] - p[0]).powi(2) + (t[1] - p[1]).powi(2)).sqrt()
    }

    pub(crate) fn reset(&mut self, env: usize, obs: &mut [f32]) {
        let links = self.links;
        let Some(rng) = self.rngs.get_mut(env) else {
            return;
        };
        for qi in &mut self.q[env * links..(env + 1) * links] {
            *qi = rng.gen_range(-PI..PI);
        }
        let radius = if links == 1 {
            1.0
        } else {
            rng.gen_range(0.2f32..0.9)
        };
        let theta = rng.gen_range(-PI..PI);
        self.target[env] = [radius * theta.cos(), radius * theta.sin()];
        // a start already inside the success radius would end at once: push the target to the far side.
        if self.distance(env) < 2.0 * SUCCESS_RADIUS {
            self.target[env] = [-self.target[env][0], -self.target[env][1]];
        }
        self.write_obs(env, obs);
    }

    pub(crate) fn step(&mut self, env: usize, action: &[f32], obs: &mut [f32]) -> Transition {
        let links = self.links;
        let mut cost = 0.0;
        for (qi, &a) in self.q[env * links..(env + 1) * links]
            .iter_mut()
            .zip(action)
        {
            // NaN actions count as no move rather than poisoning the state.
            let a = if a.is_nan() { 0.0 } else { a.clamp(-1.0, 1.0) };
            cost += a * a;
            *qi = wrap_angle(*qi + a * MAX_JOINT_STEP);
        }
        let dist = self.distance(env);
        let success = dist < SUCCESS_RADIUS;
        self.write_obs(env, obs);
        Transition {
            reward: -dist - ACTION_COST * cost + if success { SUCCESS_BONUS } else { 0.0 },
            terminated: success,
            success,
        }
    }

    fn write_obs(&self, env: usize, obs: &mut [f32]) {
        let links = self.links;
        let q = &self.q[env * links..(env + 1) * links];
        let p = self.end_effector(env);
        let t = self.target[env];
        let tail = [p[0], p[1], t[0], t[1], t[0] - p[0], t[1] - p[1]];
        let values = q.iter().flat_map(|qi| [qi.cos(), qi.sin()]).chain(tail);
        for (o, v) in obs.iter_mut().zip(values) {
            *o = v;
        }
    }
}

fn wrap_angle(a: f32) -> f32 {
    (a + PI).rem_euclid(2.0 * PI) - PI
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forward_kinematics_of_a_straight_and_a_bent_arm() {
        let mut r = Reach::new(2, 0, &[0]);
        r.q = vec![0.0, 0.0];
        let p = r.end_effector(0);
        assert!((p[0] - 1.0).abs() < 1e-6 && p[1].abs() < 1e-6);
        r.q = vec![PI / 2.0, -PI / 2.0];
        let p = r.end_effector(0);
        assert!(
            (p[0] - 0.5).abs() < 1e-6 && (p[1] - 0.5).abs() < 1e-6,
            "{p:?}"
        );
    }

    #[test]
    fn actions_are_clipped_and_nan_safe() {
        let mut r = Reach::new(2, 0, &[0]);
        let mut obs = vec![0.0; 10];
        r.reset(0, &mut obs);
        let before = r.q.clone();
        r.step(0, &[100.0, f32::NAN], &mut obs);
        let moved = wrap_angle(r.q[0] - before[0]);
        assert!((moved - MAX_JOINT_STEP).abs() < 1e-5, "{moved}");
        assert!((r.q[1] - before[1]).abs() < 1e-6);
        assert!(obs.iter().all(|x| x.is_finite()));
    }

    #[test]
    fn reaching_the_target_succeeds_and_terminates() {
        let mut r = Reach::new(2, 0, &[0]);
        let mut obs = vec![0.0; 10];
        r.reset(0, &mut obs);
        let start_dist = r.distance(0);
        assert!(start_dist >= 2.0 * SUCCESS_RADIUS);
        // place the target just next to where one zero-action step leaves the arm.
        let p = r.end_effector(0);
        r.target[0] = [p[0] + SUCCESS_RADIUS / 2.0, p[1]];
        let tr = r.step(0, &[0.0, 0.0], &mut obs);
        assert!(tr.success && tr.terminated);
        assert!(
            (tr.reward - (SUCCESS_BONUS - SUCCESS_RADIUS / 2.0)).abs() < 1e-4,
            "{}",
            tr.reward
        );
        // the obs carries target - end effector.
        assert!(
            (obs[8] - SUCCESS_RADIUS / 2.0).abs() < 1e-5 && obs[9].abs() < 1e-5,
            "{obs:?}"
        );
    }

    #[test]
    fn moving_towards_the_target_raises_the_reward() {
        // a greedy step along the negative distance gradient (finite differences) beats the opposite step.
        let mut r = Reach::new(3, 5, &[0]);
        let mut obs = vec![0.0; 12];
        r.reset(0, &mut obs);
        let q0 = r.q.clone();
        let mut grad = [0.0; 3];
        for (j, g) in grad.iter_mut().enumerate() {
            r.q = q0.clone();
            r.q[j] += 1e-3;
            *g = (r.distance(0) - {
                r.q = q0.clone();
                r.distance(0)
            }) / 1e-3;
        }
        let toward: Vec<f32> = grad.iter().map(|g| -g.signum() * 0.5).collect();
        let away: Vec<f32> = toward.iter().map(|a| -a).collect();
        r.q = q0.clone();
        let good = r.step(0, &toward, &mut obs).reward;
        r.q = q0;
        let bad = r.step(0, &away, &mut obs).reward;
        assert!(good > bad, "{good} vs {bad}");
    }
}
