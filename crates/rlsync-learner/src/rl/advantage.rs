//! Advantage estimation on plain buffers: GAE with a critic (PPO) and group-relative advantages (GRPO).
//!
//! Buffers are time-major: entry `t * envs + e` is env `e` at step `t`.

use super::RlError;

/// Generalised advantage estimation. `next_values[i]` is the critic's value of the state reached by step `i`
/// (zero when that step terminated; the value of the final observation when it was truncated); `dones[i]`
/// (terminated or truncated) cuts the recursion. Returns `(advantages, returns)` with
/// `returns = advantages + values`.
pub fn gae(
    rewards: &[f32],
    values: &[f32],
    next_values: &[f32],
    dones: &[bool],
    envs: usize,
    gamma: f32,
    lambda: f32,
) -> Result<(Vec<f32>, Vec<f32>), RlError> {
    let n = rewards.len();
    if envs == 0
        || !n.is_multiple_of(envs)
        || values.len() != n
        || next_values.len() != n
        || dones.len() != n
    {
        return Err(RlError::Trajectory {
            reason: format!(
                "gae buffers disagree: rewards {n}, values {}, next_values {}, dones {}, envs {envs}",
                values.len(),
                next_values.len(),
                dones.len()
            ),
        });
    }
    let steps = n / envs;
    let mut adv = vec![0.0f32; n];
    for e in 0..envs {
        let mut running = 0.0f32;
        for t in (0..steps).rev() {
            let i = t * envs + e;
            let delta = rewards[i] + gamma * next_values[i] - values[i];
            let carry = if dones[i] {
                0.0
            } else {
                gamma * lambda * running
            };
            running = delta + carry;
            adv[i] = running;
        }
    }
    let returns = adv.iter().zip(values).map(|(a, v)| a + v).collect();
    Ok((adv, returns))
}

/// GRPO advantages without a critic: every step's discounted return-to-go (within its episode, inside the
/// chunk) is normalised against the other members of its group at the same step. Groups are `group_size`
/// consecutive envs, which share their reset seeds (see `env::EnvOptions::group_size`), so members start from
/// the same state and differ only by the actions sampled.
pub fn group_relative(
    rewards: &[f32],
    dones: &[bool],
    envs: usize,
    group_size: usize,
    gamma: f32,
) -> Result<Vec<f32>, RlError> {
    let n = rewards.len();
    if group_size == 0 || envs == 0 || !envs.is_multiple_of(group_size) {
        return Err(RlError::GroupSize {
            group_size,
            num_envs: envs,
        });
    }
    if !n.is_multiple_of(envs) || dones.len() != n {
        return Err(RlError::Trajectory {
            reason: format!(
                "grpo buffers disagree: rewards {n}, dones {}, envs {envs}",
                dones.len()
            ),
        });
    }
    let steps = n / envs;
    let mut to_go = vec![0.0f32; n];
    for e in 0..envs {
        let mut running = 0.0f32;
        for t in (0..steps).rev() {
            let i = t * envs + e;
            if dones[i] {
                running = 0.0;
            }
            running = rewards[i] + gamma * running;
            to_go[i] = running;
        }
    }
    let mut adv = vec![0.0f32; n];
    for t in 0..steps {
        for g in 0..envs / group_size {
            let range = t * envs + g * group_size..t * envs + (g + 1) * group_size;
            let members = &to_go[range.clone()];
            let mean = members.iter().sum::<f32>() / group_size as f32;
            let var = members.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / group_size as f32;
            let std = var.sqrt();
            for (a, x) in adv[range].iter_mut().zip(members) {
                *a = (x - mean) / (std + 1e-6);
            }
        }
    }
    Ok(adv)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-5)
    }

    #[test]
    fn gae_with_lambda_one_is_the_discounted_return_minus_value() {
        // one env, three steps, terminated at the end.
        let r = [1.0, 2.0, 3.0];
        let v = [0.5, 0.25, 0.125];
        let next = [0.25, 0.125, 0.0];
        let (adv, ret) = gae(&r, &v, &next, &[false, false, true], 1, 0.5, 1.0).unwrap();
        let g = [1.0 + 0.5 * (2.0 + 0.5 * 3.0), 2.0 + 0.5 * 3.0, 3.0];
        assert!(close(&ret, &g), "{ret:?}");
        assert!(close(&adv, &[g[0] - 0.5, g[1] - 0.25, g[2] - 0.125]));
    }

    #[test]
    fn gae_with_lambda_zero_is_the_td_error_and_dones_cut() {
        let r = [1.0, 1.0, 1.0, 1.0]; // 2 steps x 2 envs
        let v = [0.0, 1.0, 2.0, 3.0];
        let next = [2.0, 9.0, 4.0, 5.0];
        let (adv, _) = gae(&r, &v, &next, &[false, true, false, false], 2, 1.0, 0.0).unwrap();
        assert!(close(&adv, &[3.0, 9.0, 3.0, 3.0]), "{adv:?}");
        // with lambda 1, env 1's first step is cut by its done and does not see step 2.
        let (adv, _) = gae(&r, &v, &next, &[false, true, false, false], 2, 1.0, 1.0).unwrap();
        assert!(close(&adv, &[6.0, 9.0, 3.0, 3.0]), "{adv:?}");
    }

    #[test]
    fn gae_rejects_mismatched_buffers() {
        assert!(gae(&[1.0; 4], &[0.0; 3], &[0.0; 4], &[false; 4], 2, 0.9, 0.9).is_err());
        assert!(gae(&[1.0; 3], &[0.0; 3], &[0.0; 3], &[false; 3], 2, 0.9, 0.9).is_err());
        assert!(gae(&[], &[], &[], &[], 0, 0.9, 0.9).is_err());
    }

    #[test]
    fn group_relative_normalises_within_groups_only() {
        // one step, four envs in two groups of two.
        let adv = group_relative(&[1.0, 3.0, 10.0, 10.0], &[true; 4], 4, 2, 1.0).unwrap();
        assert!(close(&adv[..2], &[-1.0, 1.0]), "{adv:?}");
        assert!(close(&adv[2..], &[0.0, 0.0]), "{adv:?}");
        assert!(matches!(
            group_relative(&[0.0; 3], &[false; 3], 3, 2, 1.0),
            Err(RlError::GroupSize { .. })
        ));
    }

    #[test]
    fn group_relative_uses_return_to_go_within_episodes() {
        // two steps, two envs (one group): env 0 earns 1 then 1, env 1 earns 0 then 2 but its episode ends at step 0.
        let adv = group_relative(
            &[1.0, 0.0, 1.0, 2.0],
            &[false, true, false, false],
            2,
            2,
            1.0,
        )
        .unwrap();
        // to-go: step0 = [2, 0], step1 = [1, 2]
        assert!(close(&adv, &[1.0, -1.0, -1.0, 1.0]), "{adv:?}");
    }
}
