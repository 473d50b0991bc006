//! Learning tests of the libtorch backend (seeded, small; they assert on metrics, never on time).

use std::num::NonZeroU32;

use crate::config::schema::{AdvantageType, EnvType, ModelType, RunConfig, WeightDtype};
use crate::env::{EnvOptions, VecEnv};
use crate::rl::{ActMode, Actor, Learner, ParamRole, collect, evaluate};

fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).unwrap()
}

fn reach_cfg() -> RunConfig {
    let mut cfg = RunConfig::default();
    cfg.actor.model.model_type = ModelType::MlpPolicy;
    cfg.actor.model.hidden_dim = nz(64);
    cfg.actor.model.num_layers = nz(2);
    cfg.actor.global_batch_size = nz(256);
    cfg.actor.micro_batch_size = nz(256);
    cfg.actor.optim.lr = 1e-3;
    cfg.actor.optim.value_lr = 1e-3;
    cfg.actor.optim.clip_grad = 0.5;
    cfg.rollout.model.precision = WeightDtype::F32;
    cfg.algorithm.update_epoch = nz(4);
    cfg.algorithm.entropy_bonus = 0.0;
    cfg.env.train.env_type = EnvType::Reach;
    cfg.env.train.total_num_envs = nz(16);
    cfg.env.train.max_episode_steps = nz(50);
    cfg.env.train.num_links = nz(2);
    cfg.env.train.seed = 1;
    cfg.env.eval = cfg.env.train.clone();
    cfg.env.eval.seed = 99;
    cfg
}

fn env(cfg: &RunConfig, eval: bool) -> VecEnv {
    let split = if eval { &cfg.env.eval } else { &cfg.env.train };
    VecEnv::new(&EnvOptions::for_worker(split, 0, nz(1))).unwrap()
}

#[test]
fn ppo_on_reach_beats_the_initial_policy_clearly() {
    tch::set_num_threads(1);
    let cfg = reach_cfg();
    let mut train_env = env(&cfg, false);
    let mut eval_env = env(&cfg, true);
    let mut learner = Learner::new(&cfg, train_env.spec()).unwrap();
    let mut actor = learner.actor(&cfg, 7).unwrap();
    let before = evaluate(&mut eval_env, &mut actor, 32).unwrap();
    let mut last = Default::default();
    for step in 0..40 {
        let traj = collect(&mut train_env, &mut actor, 64).unwrap();
        let m = learner.train_step(&traj).unwrap();
        // the actor acted with exactly the learner's weights: behaviour KL is ~0 before the update.
        assert!(m.behav_approx_kl.abs() < 1e-6, "step {step}: {m:?}");
        assert!(m.loss.is_finite() && m.grad_norm.is_finite() && m.entropy.is_finite());
        actor.load_from(&learner).unwrap();
        last = traj.episodes;
        eprintln!("step {step}: return {:.2} success {:.2} len {:.1} kl {:.4} clip {:.3}", last.ret, last.success_rate, last.episode_len, m.approx_kl, m.clip_fraction);
    }
    let after = evaluate(&mut eval_env, &mut actor, 32).unwrap();
    eprintln!("before {before:?}\nafter {after:?}\nlast train {last:?}");
    assert!(after.ret > before.ret + 0.5 * before.ret.abs(), "before {before:?} after {after:?}");
    assert!(after.success_rate > before.success_rate + 0.3, "before {before:?} after {after:?}");
}
