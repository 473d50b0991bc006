//! `cartpole`: the classic cart-pole balance task (Barto, Sutton & Anderson 1983) with discrete push actions.
//!
//! Physics and limits follow the common Gym formulation: action 0 pushes left, 1 pushes right with
//! `FORCE_MAG`; Euler integration with `TAU`; the episode terminates (failure) when the pole leans more than
//! 12 degrees or the cart leaves `[-2.4, 2.4]`. Reward is 1 per step survived; reaching the episode cap counts
//! as a success. Observation: `[x, x_dot, theta, theta_dot]`, each drawn in `[-0.05, 0.05]` on reset.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::{ActionSpace, EnvSpec, Transition, env_seed};

const GRAVITY: f32 = 9.8;
const MASS_CART: f32 = 1.0;
const MASS_POLE: f32 = 0.1;
const HALF_POLE_LEN: f32 = 0.5;
const FORCE_MAG: f32 = 10.0;
const TAU: f32 = 0.02;
pub(crate) const THETA_LIMIT: f32 = 12.0 * 2.0 * std::f32::consts::PI / 360.0;
pub(crate) const X_LIMIT: f32 = 2.4;

/// States `[x, x_dot, theta, theta_dot]` of N cart-poles.
#[derive(Debug, Clone)]
pub struct Cartpole {
    state: Vec<[f32; 4]>,
    rngs: Vec<StdRng>,
}

impl Cartpole {
    pub fn new(seed: u64, streams: &[usize]) -> Cartpole {
        Cartpole {
            state: vec![[0.0; 4]; streams.len()],
            rngs: streams
                .iter()
                .map(|&i| StdRng::seed_from_u64(env_seed(seed, i)))
                .collect(),
        }
    }

    pub fn spec() -> EnvSpec {
        EnvSpec {
            obs_dim: 4,
            action: ActionSpace::Discrete { n: 2 },
        }
    }

    pub(crate) fn reset(&mut self, env: usize, obs: &mut [f32]) {
        let (Some(s), Some(rng)) = (self.state.get_mut(env), self.rngs.get_mut(env)) else {
            return;
        };
        for v in s.iter_mut() {
            *v = rng.gen_range(-0.05f32..0.05);
        }
        obs.copy_from_slice(s);
    }

    pub(crate) fn step(&mut self, env: usize, action: i64, obs: &mut [f32]) -> Transition {
        let Some(s) = self.state.get_mut(env) else {
            return Transition {
                reward: 0.0,
                terminated: true,
                success: false,
            };
        };
        *s = physics(*s, if action == 1 { FORCE_MAG } else { -FORCE_MAG });
        obs.copy_from_slice(s);
        let failed = s[0].abs() > X_LIMIT || s[2].abs() > THETA_LIMIT;
        Transition {
            reward: 1.0,
            terminated: failed,
            success: false,
        }
    }
}

fn physics([x, x_dot, theta, theta_dot]: [f32; 4], force: f32) -> [f32; 4] {
    let total_mass = MASS_CART + MASS_POLE;
    let pole_mass_len = MASS_POLE * HALF_POLE_LEN;
    let (sin, cos) = theta.sin_cos();
    let temp = (force + pole_mass_len * theta_dot * theta_dot * sin) / total_mass;
    let theta_acc = (GRAVITY * sin - cos * temp)
        / (HALF_POLE_LEN * (4.0 / 3.0 - MASS_POLE * cos * cos / total_mass));
    let x_acc = temp - pole_mass_len * theta_acc * cos / total_mass;
    [
        x + TAU * x_dot,
        x_dot + TAU * x_acc,
        theta + TAU * theta_dot,
        theta_dot + TAU * theta_acc,
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upright_pole_at_rest_falls_only_when_pushed() {
        let s = physics([0.0; 4], FORCE_MAG);
        // pushing the cart right accelerates it right and tips the pole left (negative theta acceleration).
        assert!(s[1] > 0.0 && s[3] < 0.0, "{s:?}");
        let s = physics([0.0, 0.0, 0.1, 0.0], 0.0);
        // gravity makes a leaning pole lean further.
        assert!(s[3] > 0.0, "{s:?}");
    }

    #[test]
    fn constant_push_fails_and_balancing_survives_longer() {
        let mut c = Cartpole::new(0, &[0]);
        let mut obs = [0.0; 4];
        c.reset(0, &mut obs);
        let mut pushed = 0;
        while !c.step(0, 1, &mut obs).terminated {
            pushed += 1;
            assert!(pushed < 500);
        }
        c.reset(0, &mut obs);
        // push against the lean: a simple controller.
        let mut balanced = 0;
        loop {
            let a = i64::from(obs[2] + 0.5 * obs[3] > 0.0);
            if c.step(0, a, &mut obs).terminated || balanced >= 200 {
                break;
            }
            balanced += 1;
        }
        assert!(balanced > 2 * pushed, "{balanced} vs {pushed}");
    }
}
