//! One training step on a trajectory: advantages (GAE with the critic, or group-relative for GRPO), then
//! clipped-ratio policy updates over epochs and minibatches with value loss, entropy bonus, gradient
//! clipping and Adam; plus `behav_approx_kl` measured before any update.

use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use tch::{Kind, Tensor};

use crate::rl::{RlError, TrainMetrics, Trajectory, gae, group_relative};
use rlsync::config::schema::{AdvantageType, RunConfig};

use super::adam::Adam;
use super::dist::{actions_tensor, entropy, log_prob};
use super::policy::Policy;
use super::torch_err;

/// Everything fixed for one step's update.
struct Batch {
    obs: Tensor,
    actions: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    returns: Option<Tensor>,
    old_values: Option<Tensor>,
}

/// Mean of `k3 = exp(d) - 1 - d`, `d = new - old`: an unbiased, non-negative KL(old ‖ new) estimate.
fn approx_kl(new_logp: &Tensor, old_logp: &Tensor) -> Tensor {
    let d = new_logp - old_logp;
    (d.exp() - 1.0 - d).mean(Kind::Float)
}

/// Runs one update of `policy` on `traj` (acted by weight versions `traj.versions`, the learner now holds
/// `version`); `seed` drives the minibatch shuffle.
pub(crate) fn train_step(
    policy: &mut Policy,
    adam: &mut Adam,
    traj: &Trajectory,
    cfg: &RunConfig,
    version: u64,
    seed: u64,
) -> Result<TrainMetrics, RlError> {
    traj.validate()?;
    if traj.obs_dim != policy.spec.obs_dim || traj.action != policy.spec.action {
        return Err(RlError::Trajectory {
            reason: format!(
                "trajectory is for obs {} / {:?}, the policy for obs {} / {:?}",
                traj.obs_dim, traj.action, policy.spec.obs_dim, policy.spec.action
            ),
        });
    }
    let n = traj.len() as i64;
    if n == 0 {
        return Err(RlError::Trajectory {
            reason: "empty trajectory".into(),
        });
    }
    let obs = Tensor::from_slice(&traj.obs)
        .f_view([n, traj.obs_dim as i64])
        .map_err(torch_err("shaping observations"))?;
    let actions = actions_tensor(&traj.actions, n)?;
    let old_logp = Tensor::from_slice(&traj.logprobs);

    let mut metrics = TrainMetrics::default();
    let (values, behav) = tch::no_grad(|| -> Result<_, RlError> {
        let heads = policy.forward(&obs)?;
        let same: Vec<bool> = traj.versions.iter().map(|v| *v == version).collect();
        let behav = if same.iter().any(|x| *x) {
            let mask = Tensor::from_slice(&same);
            let logp = log_prob(&heads, &actions);
            approx_kl(&logp.masked_select(&mask), &old_logp.masked_select(&mask)).double_value(&[])
        } else {
            f64::NAN
        };
        Ok((heads.value, behav))
    })?;
    metrics.behav_approx_kl = behav;

    let alg = &cfg.algorithm;
    let dones: Vec<bool> = traj
        .terminated
        .iter()
        .zip(&traj.truncated)
        .map(|(a, b)| *a || *b)
        .collect();
    let (adv, returns) = match (alg.adv_type, &values) {
        (AdvantageType::Gae, Some(values)) => {
            let values_v = Vec::<f32>::try_from(values).map_err(torch_err("reading values"))?;
            let next = next_values(policy, traj, &values_v)?;
            let (adv, ret) = gae(
                &traj.rewards,
                &values_v,
                &next,
                &dones,
                traj.envs,
                alg.gamma as f32,
                alg.gae_lambda as f32,
            )?;
            (adv, Some(ret))
        }
        (AdvantageType::Gae, None) => {
            return Err(RlError::UnsupportedModel {
                model: "a policy without a value head cannot use adv_type gae".into(),
            });
        }
        (AdvantageType::GrpoGroup, _) => (
            group_relative(
                &traj.rewards,
                &dones,
                traj.envs,
                alg.group_size.get() as usize,
                alg.gamma as f32,
            )?,
            None,
        ),
    };
    let mut adv = Tensor::from_slice(&adv);
    if alg.normalize_advantages && n > 1 {
        adv = (&adv - adv.mean(Kind::Float)) / (adv.std(true) + 1e-8);
    }
    let use_critic = alg.adv_type == AdvantageType::Gae;
    let batch = Batch {
        obs,
        actions,
        old_logp,
        adv,
        returns: returns
            .filter(|_| use_critic)
            .map(|r| Tensor::from_slice(&r)),
        old_values: values.filter(|_| use_critic),
    };
    update(policy, adam, &batch, cfg, seed, &mut metrics)?;
    policy.update_obs_norm(&batch.obs);
    Ok(metrics)
}

/// The critic's value of the state each entry led to: 0 when terminated, the final observation's value
/// when truncated, the next entry's (or `last_obs`') value otherwise.
fn next_values(policy: &Policy, traj: &Trajectory, values: &[f32]) -> Result<Vec<f32>, RlError> {
    let d = traj.obs_dim as i64;
    let value_of = |obs: &[f32]| -> Result<Vec<f32>, RlError> {
        if obs.is_empty() {
            return Ok(Vec::new());
        }
        let t = Tensor::from_slice(obs)
            .f_view([-1, d])
            .map_err(torch_err("shaping observations"))?;
        let v = tch::no_grad(|| policy.forward(&t))?
            .value
            .ok_or(RlError::UnsupportedModel {
                model: "policy without a value head".into(),
            })?;
        Vec::<f32>::try_from(v).map_err(torch_err("reading values"))
    };
    let last = value_of(&traj.last_obs)?;
    let truncated = value_of(&traj.truncated_obs)?;
    let envs = traj.envs;
    let mut trunc_i = 0;
    let mut next = vec![0.0f32; traj.len()];
    for (i, slot) in next.iter_mut().enumerate() {
        *slot = if traj.terminated[i] {
            0.0
        } else if traj.truncated[i] {
            trunc_i += 1;
            truncated.get(trunc_i - 1).copied().unwrap_or(0.0)
        } else if i + envs < traj.len() {
            values[i + envs]
        } else {
            last.get(i % envs).copied().unwrap_or(0.0)
        };
    }
    Ok(next)
}

fn update(
    policy: &mut Policy,
    adam: &mut Adam,
    b: &Batch,
    cfg: &RunConfig,
    seed: u64,
    m: &mut TrainMetrics,
) -> Result<(), RlError> {
    let alg = &cfg.algorithm;
    let n = b.obs.size()[0] as usize;
    let minibatch = (cfg.actor.global_batch_size.get() as usize).min(n);
    let micro = (cfg.actor.micro_batch_size.get() as usize).min(minibatch);
    let (low, high) = (alg.clip_ratio_low, alg.clip_ratio_high);
    let mut rng = StdRng::seed_from_u64(seed);
    let mut order: Vec<i64> = (0..n as i64).collect();
    let (mut sums, mut count) = ([0.0f64; 6], 0.0f64);
    for _ in 0..alg.update_epoch.get() {
        order.shuffle(&mut rng);
        for mb in order.chunks(minibatch) {
            adam.zero_grad();
            for chunk in mb.chunks(micro) {
                let idx = Tensor::from_slice(chunk);
                let heads = policy.forward(&b.obs.index_select(0, &idx))?;
                let logp = log_prob(&heads, &b.actions.index_select(0, &idx));
                let old = b.old_logp.index_select(0, &idx);
                let adv = b.adv.index_select(0, &idx);
                let ratio = (&logp - &old).exp();
                let pg = -(&ratio * &adv)
                    .minimum(&(ratio.clamp(1.0 - low, 1.0 + high) * &adv))
                    .mean(Kind::Float);
                let ent = entropy(&heads).mean(Kind::Float);
                let mut loss = &pg - &ent * alg.entropy_bonus;
                let mut vloss_v = 0.0;
                if let (Some(ret), Some(oldv), Some(v)) = (&b.returns, &b.old_values, &heads.value)
                {
                    let ret = ret.index_select(0, &idx);
                    let oldv = oldv.index_select(0, &idx);
                    let unclipped = (v - &ret).square();
                    let vloss = if alg.value_clip > 0.0 {
                        let clipped = &oldv + (v - &oldv).clamp(-alg.value_clip, alg.value_clip);
                        unclipped.maximum(&(clipped - &ret).square())
                    } else {
                        unclipped
                    };
                    let vloss = vloss.mean(Kind::Float) * 0.5;
                    vloss_v = vloss.double_value(&[]);
                    // Not `+=`: tch's `+=` is the in-place `add_`, and autograd must see a new tensor.
                    let sum = loss + vloss * alg.value_coef;
                    loss = sum;
                }
                let share = chunk.len() as f64 / mb.len() as f64;
                (loss * share)
                    .f_backward()
                    .map_err(torch_err("backpropagating the loss"))?;
                tch::no_grad(|| {
                    let clipped = ratio
                        .lt(1.0 - low)
                        .logical_or(&ratio.gt(1.0 + high))
                        .to_kind(Kind::Float)
                        .mean(Kind::Float);
                    let w = chunk.len() as f64;
                    sums[0] += pg.double_value(&[]) * w;
                    sums[1] += approx_kl(&logp, &old).double_value(&[]) * w;
                    sums[2] += clipped.double_value(&[]) * w;
                    sums[3] += ent.double_value(&[]) * w;
                    sums[5] += vloss_v * w;
                    count += w;
                });
            }
            let norm = adam.clip_grad_norm(cfg.actor.optim.clip_grad);
            sums[4] += norm * mb.len() as f64;
            adam.step();
            m.optimizer_steps += 1;
        }
    }
    let c = count.max(1.0);
    m.loss = sums[0] / c;
    m.approx_kl = sums[1] / c;
    m.clip_fraction = sums[2] / c;
    m.entropy = sums[3] / c;
    m.grad_norm = sums[4] / c;
    m.value_loss = sums[5] / c;
    Ok(())
}
