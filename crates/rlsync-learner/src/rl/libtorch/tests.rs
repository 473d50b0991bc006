//! Learning tests of the libtorch backend (seeded, small; they assert on metrics, never on time).

use std::num::NonZeroU32;

use crate::env::{EnvOptions, VecEnv};
use crate::rl::{ActMode, Actor, Learner, collect, evaluate};
use rlsync::config::schema::{AdvantageType, EnvType, ModelType, RunConfig, WeightDtype};
use rlsync_core::tensor::Class;

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
    cfg.algorithm.value_clip = 0.0;
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
    let before = evaluate(&mut eval_env, &mut actor).unwrap();
    let mut last = Default::default();
    for step in 0..60 {
        let traj = collect(&mut train_env, &mut actor, 64).unwrap();
        let m = learner.train_step(&traj).unwrap();
        // the actor acted with exactly the learner's weights: behaviour KL is ~0 before the update.
        assert!(m.behav_approx_kl.abs() < 1e-6, "step {step}: {m:?}");
        assert!(m.loss.is_finite() && m.grad_norm.is_finite() && m.entropy.is_finite());
        actor.load_from(&learner).unwrap();
        last = traj.episodes;
    }
    let after = evaluate(&mut eval_env, &mut actor).unwrap();
    eprintln!("before {before:?}\nafter {after:?}\nlast train {last:?}");
    // the initial policy is close to random (zero-mean actions); a clear margin is 40% less cost and
    // successes where there were none.
    assert!(
        after.ret > before.ret + 0.4 * before.ret.abs(),
        "before {before:?} after {after:?}"
    );
    assert!(
        after.success_rate >= before.success_rate + 0.15,
        "before {before:?} after {after:?}"
    );
    assert!(last.success_rate >= 0.3, "{last:?}");
}

fn weights(learner: &Learner) -> Vec<(String, Vec<u8>)> {
    learner
        .policy
        .named_tensors()
        .unwrap()
        .into_iter()
        .map(|(n, t)| {
            let t = t.detach().contiguous();
            let mut bytes = vec![0u8; t.numel() * t.kind().elt_size_in_bytes()];
            t.copy_data_u8(&mut bytes, t.numel());
            (n, bytes)
        })
        .collect()
}

fn short_run(
    learner: &mut Learner,
    actor: &mut Actor,
    env: &mut VecEnv,
    steps: usize,
) -> Vec<crate::rl::TrainMetrics> {
    (0..steps)
        .map(|_| {
            let traj = collect(env, actor, 16).unwrap();
            let m = learner.train_step(&traj).unwrap();
            actor.load_from(learner).unwrap();
            m
        })
        .collect()
}

#[test]
fn checkpoint_resume_restores_bits_step_version_and_optimizer() {
    let cfg = reach_cfg();
    let mut train_env = env(&cfg, false);
    let mut learner = Learner::new(&cfg, train_env.spec()).unwrap();
    let mut actor = learner.actor(&cfg, 1).unwrap();
    short_run(&mut learner, &mut actor, &mut train_env, 2);
    let tmp = tempfile::tempdir().unwrap();
    let info = learner.save_checkpoint(tmp.path()).unwrap();
    assert_eq!((info.global_step, info.version), (2, 2));
    assert_eq!(
        rlsync::checkpoint::latest_checkpoint(tmp.path()),
        Some(info.dir.clone())
    );

    let mut cfg2 = cfg.clone();
    cfg2.actor.seed = 999; // different init: resume must overwrite every weight
    let mut resumed = Learner::new(&cfg2, train_env.spec()).unwrap();
    assert_ne!(weights(&resumed), weights(&learner));
    let back = resumed.resume(&info.dir).unwrap();
    assert_eq!(back, info);
    assert_eq!(weights(&resumed), weights(&learner));
    assert_eq!(resumed.adam.steps(), learner.adam.steps());
    // identical state + identical data => identical next update (optimizer moments restored too).
    let traj = collect(&mut train_env, &mut actor, 16).unwrap();
    let mut cfg_same = resumed.cfg.clone();
    cfg_same.actor.seed = learner.cfg.actor.seed;
    resumed.cfg = cfg_same;
    learner.train_step(&traj).unwrap();
    resumed.train_step(&traj).unwrap();
    assert_eq!(weights(&resumed), weights(&learner));
    assert_eq!(resumed.version(), 3);
}

#[test]
fn resume_rejects_a_foreign_or_mismatched_checkpoint() {
    let cfg = reach_cfg();
    let spec = env(&cfg, false).spec();
    let learner = Learner::new(&cfg, spec).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let info = learner.save_checkpoint(tmp.path()).unwrap();
    let mut bigger = cfg.clone();
    bigger.actor.model.hidden_dim = nz(32);
    let err = Learner::new(&bigger, spec)
        .unwrap()
        .resume(&info.dir)
        .unwrap_err();
    assert!(
        matches!(err, crate::rl::RlError::WeightsMismatch { .. }),
        "{err}"
    );
    // Weights that do not match the checksum the checkpoint recorded (a corrupted or edited file).
    let path = info.dir.join(rlsync::checkpoint::WEIGHTS_FILE);
    let (mut tensors, meta) = super::checkpoint::load(&path).unwrap();
    tensors[0].1 = &tensors[0].1 + 1.0;
    super::checkpoint::save(&path, &tensors, meta).unwrap();
    let err = Learner::new(&cfg, spec)
        .unwrap()
        .resume(&info.dir)
        .unwrap_err();
    assert!(
        matches!(err, crate::rl::RlError::Checkpoint(_)) && err.to_string().contains("checksum"),
        "{err}"
    );
    std::fs::write(
        info.dir.join(rlsync::checkpoint::WEIGHTS_FILE),
        b"not safetensors",
    )
    .unwrap();
    let err = Learner::new(&cfg, spec)
        .unwrap()
        .resume(&info.dir)
        .unwrap_err();
    assert!(matches!(err, crate::rl::RlError::Checkpoint(_)), "{err}");
}

#[test]
fn grpo_runs_without_a_critic() {
    let mut cfg = reach_cfg();
    cfg.algorithm.adv_type = AdvantageType::GrpoGroup;
    cfg.algorithm.group_size = nz(4);
    let mut opts = EnvOptions::for_worker(&cfg.env.train, 0, nz(1));
    opts.group_size = nz(4);
    let mut train_env = VecEnv::new(&opts).unwrap();
    let mut learner = Learner::new(&cfg, train_env.spec()).unwrap();
    let mut actor = learner.actor(&cfg, 3).unwrap();
    let before = weights(&learner);
    for m in short_run(&mut learner, &mut actor, &mut train_env, 3) {
        assert_eq!(m.value_loss, 0.0);
        assert!(
            m.loss.is_finite() && m.entropy.is_finite() && m.grad_norm > 0.0,
            "{m:?}"
        );
        assert!(m.behav_approx_kl.abs() < 1e-6, "{m:?}");
    }
    // the critic is untouched (no value loss), the actor moved.
    let after = weights(&learner);
    let changed = |prefix: &str| {
        before
            .iter()
            .zip(&after)
            .any(|(a, b)| a.0.starts_with(prefix) && a.1 != b.1)
    };
    assert!(changed("actor.head"));
    assert!(!changed("critic."));
    // a group size that does not divide the envs is an error, not a panic.
    cfg.algorithm.group_size = nz(5);
    let mut l = Learner::new(&cfg, train_env.spec()).unwrap();
    let traj = collect(&mut train_env, &mut actor, 4).unwrap();
    assert!(matches!(
        l.train_step(&traj),
        Err(crate::rl::RlError::GroupSize { .. })
    ));
}

#[test]
fn vla_tiny_trains_adapters_and_never_touches_the_frozen_backbone() {
    let mut cfg = reach_cfg();
    cfg.actor.model.model_type = ModelType::VlaTiny;
    cfg.actor.model.hidden_dim = nz(128);
    cfg.actor.model.num_layers = nz(3);
    cfg.actor.model.lora_rank = nz(4);
    let mut train_env = env(&cfg, false);
    let mut learner = Learner::new(&cfg, train_env.spec()).unwrap();
    let classes = learner.param_classes();
    let numel = |class: Class| -> usize {
        let tensors = learner.policy.named_tensors().unwrap();
        classes
            .iter()
            .filter(|(_, r)| *r == class)
            .map(|(n, _)| tensors.iter().find(|(m, _)| m == n).unwrap().1.numel())
            .sum()
    };
    let (frozen, trainable, buffers) = (
        numel(Class::Frozen),
        numel(Class::Trainable),
        numel(Class::Buffer),
    );
    assert!(
        frozen > 4 * trainable,
        "frozen {frozen} trainable {trainable}"
    );
    assert!(buffers > 0);
    assert!(
        classes
            .iter()
            .all(|(n, r)| (*r == Class::Frozen) == n.starts_with("backbone.")),
        "{classes:?}"
    );
    let mut actor = learner.actor(&cfg, 5).unwrap();
    let before = weights(&learner);
    short_run(&mut learner, &mut actor, &mut train_env, 2);
    let after = weights(&learner);
    for ((name, a), (_, b)) in before.iter().zip(&after) {
        let class = classes.iter().find(|(n, _)| n == name).unwrap().1;
        match class {
            Class::Frozen => assert_eq!(a, b, "{name} changed"),
            // lora_b starts at zero, so lora_a only moves once lora_b did; the head and lora_b move at once.
            Class::Trainable if name.ends_with("lora_b") || name.starts_with("action_head") => {
                assert_ne!(a, b, "{name}")
            }
            _ => {}
        }
    }
}

#[test]
fn bf16_actor_holds_bf16_weights_and_acts() {
    let mut cfg = reach_cfg();
    cfg.rollout.model.precision = WeightDtype::Bf16;
    let mut train_env = env(&cfg, false);
    let learner = Learner::new(&cfg, train_env.spec()).unwrap();
    let mut actor = learner.actor(&cfg, 0).unwrap();
    for (name, t) in actor.policy.named_tensors().unwrap() {
        assert_eq!(t.kind(), tch::Kind::BFloat16, "{name}");
    }
    let d = actor.act(train_env.obs(), ActMode::Sample).unwrap();
    assert!(d.logprobs.iter().all(|l| l.is_finite()));
    train_env.step(d.actions.as_actions()).unwrap();
    // a bf16 rollout is close to, but not exactly, the fp32 trainer.
    let mut fp32 = cfg.clone();
    fp32.rollout.model.precision = WeightDtype::F32;
    let mut exact = learner.actor(&fp32, 0).unwrap();
    let a = actor.act(train_env.obs(), ActMode::Deterministic).unwrap();
    let b = exact.act(train_env.obs(), ActMode::Deterministic).unwrap();
    let (crate::rl::ActionBuf::Continuous(a), crate::rl::ActionBuf::Continuous(b)) =
        (a.actions, b.actions)
    else {
        panic!("continuous")
    };
    assert!(a.iter().zip(&b).all(|(x, y)| (x - y).abs() < 0.05));
    assert!(actor.act(&[0.0; 3], ActMode::Sample).is_err());
}

#[test]
fn ppo_on_cartpole_runs_with_categorical_actions() {
    let mut cfg = reach_cfg();
    cfg.env.train.env_type = EnvType::Cartpole;
    let mut train_env = env(&cfg, false);
    let mut learner = Learner::new(&cfg, train_env.spec()).unwrap();
    let mut actor = learner.actor(&cfg, 2).unwrap();
    let ms = short_run(&mut learner, &mut actor, &mut train_env, 3);
    for m in &ms {
        assert!(
            m.behav_approx_kl.abs() < 1e-6
                && m.entropy > 0.0
                && m.entropy <= std::f64::consts::LN_2 + 1e-6,
            "{m:?}"
        );
    }
}

fn python() -> std::path::PathBuf {
    std::env::var_os("RLSYNC_PYTHON")
        .map(Into::into)
        .unwrap_or_else(|| {
            std::path::PathBuf::from(std::env::var("HOME").unwrap_or_default())
                .join(".cache/rlsync/venv/bin/python")
        })
}

#[test]
fn torchscript_export_train_checkpoint_resume() {
    let tmp = tempfile::tempdir().unwrap();
    let script = tmp.path().join("policy.pt");
    let example = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../examples/torchscript/export_policy.py");
    let out = std::process::Command::new(python())
        .args([
            example.as_os_str(),
            "--obs-dim".as_ref(),
            "10".as_ref(),
            "--actions".as_ref(),
            "2".as_ref(),
            "--out".as_ref(),
            script.as_os_str(),
        ])
        .output()
        .expect("the venv python (RLSYNC_PYTHON) runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let mut cfg = reach_cfg();
    cfg.actor.model.model_type = ModelType::Torchscript;
    cfg.actor.model.torchscript_path = Some(script.clone());
    let mut train_env = env(&cfg, false);
    let mut learner = Learner::new(&cfg, train_env.spec()).unwrap();
    assert!(
        learner
            .param_classes()
            .iter()
            .any(|(n, r)| n == "mu.weight" && *r == Class::Trainable),
        "{:?}",
        learner.param_classes()
    );
    let mut actor = learner.actor(&cfg, 4).unwrap();
    let before = weights(&learner);
    for m in short_run(&mut learner, &mut actor, &mut train_env, 3) {
        assert!(
            m.behav_approx_kl.abs() < 1e-6 && m.loss.is_finite(),
            "{m:?}"
        );
    }
    assert_ne!(weights(&learner), before);
    let info = learner.save_checkpoint(tmp.path()).unwrap();
    assert_eq!(info.global_step, 3);

    let mut resumed = Learner::new(&cfg, train_env.spec()).unwrap();
    resumed.resume(&info.dir).unwrap();
    assert_eq!(weights(&resumed), weights(&learner));
    let mut actor = resumed.actor(&cfg, 4).unwrap();
    assert_eq!(actor.version(), 3);
    let m = short_run(&mut resumed, &mut actor, &mut train_env, 1);
    assert!(m[0].loss.is_finite());
    assert_eq!(resumed.global_step(), 4);

    // A scripted module's parameters can be views of a shared state dict too.
    views_act_like_an_imported_copy(&cfg);

    let mut missing = cfg.clone();
    missing.actor.model.torchscript_path = Some(tmp.path().join("nope.pt"));
    assert!(matches!(
        Learner::new(&missing, train_env.spec()),
        Err(crate::rl::RlError::Torchscript { .. })
    ));
}

#[test]
fn evaluation_on_a_fresh_env_is_deterministic() {
    let cfg = reach_cfg();
    let spec = env(&cfg, true).spec();
    let learner = Learner::new(&cfg, spec).unwrap();
    // different sampling seeds: evaluation uses the mode, so they must not matter.
    let a = evaluate(&mut env(&cfg, true), &mut learner.actor(&cfg, 1).unwrap()).unwrap();
    let b = evaluate(&mut env(&cfg, true), &mut learner.actor(&cfg, 2).unwrap()).unwrap();
    assert_eq!(a, b);
    let envs = env(&cfg, true).num_envs() as u64;
    assert_eq!(a.episodes, envs, "one episode per eval env: {a:?}");
}

fn entry_bytes(
    state: &rlsync_core::tensor::StateDict,
) -> Vec<(String, rlsync_core::tensor::DType, Vec<u8>)> {
    state
        .iter()
        .map(|(n, t)| (n.to_owned(), t.dtype(), t.bytes().to_vec()))
        .collect()
}

#[test]
fn state_dict_round_trips_keep_bits_dtypes_and_classes() {
    use rlsync_core::tensor::DType;
    let mut cfg = reach_cfg();
    cfg.actor.model.model_type = ModelType::VlaTiny;
    cfg.actor.model.hidden_dim = nz(32);
    let mut train_env = env(&cfg, false);
    let mut learner = Learner::new(&cfg, train_env.spec()).unwrap();
    let mut actor = learner.actor(&cfg, 0).unwrap();
    short_run(&mut learner, &mut actor, &mut train_env, 1);

    // fp32 export is the master weights bit for bit, with classes from the model.
    let master = learner.state_dict(None).unwrap();
    let direct = weights(&learner);
    assert_eq!(master.len(), direct.len());
    for ((name, bytes), (sname, t)) in direct.iter().zip(master.iter()) {
        assert_eq!((name.as_str(), bytes.as_slice()), (sname, t.bytes()));
        assert_eq!(t.dtype(), DType::F32);
        let class = learner
            .param_classes()
            .into_iter()
            .find(|(n, _)| n == name)
            .unwrap()
            .1;
        assert_eq!(t.class(), class, "{name}");
    }
    assert!(
        master
            .synced_keys()
            .iter()
            .all(|k| !k.starts_with("backbone."))
    );

    // fp32 -> actor -> fp32 and bf16 -> bf16 actor -> bf16 keep every bit.
    for (precision, float) in [
        (WeightDtype::F32, None),
        (WeightDtype::Bf16, Some(DType::Bf16)),
    ] {
        let mut c = cfg.clone();
        c.rollout.model.precision = precision;
        let sent = learner.state_dict(float).unwrap();
        let mut receiver = Actor::new(&c, train_env.spec(), 0).unwrap();
        receiver.import_state(&sent, 42).unwrap();
        assert_eq!(receiver.version(), 42);
        assert_eq!(
            entry_bytes(&receiver.state_dict().unwrap()),
            entry_bytes(&sent),
            "{precision:?}"
        );
    }
    // the bf16 export equals libtorch's own cast of the master weights.
    let bf16 = learner.state_dict(Some(DType::Bf16)).unwrap();
    let mut c = cfg.clone();
    c.rollout.model.precision = WeightDtype::Bf16;
    let cast = learner.actor(&c, 0).unwrap().state_dict().unwrap();
    assert_eq!(entry_bytes(&bf16), entry_bytes(&cast));

    // export_into refreshes in place: after a step only synced entries change.
    let mut state = learner.state_dict(Some(DType::Bf16)).unwrap();
    let before = entry_bytes(&state);
    short_run(&mut learner, &mut actor, &mut train_env, 1);
    learner.export_into(&mut state).unwrap();
    let after = entry_bytes(&state);
    let synced = state.synced_keys();
    for ((name, _, a), (_, _, b)) in before.iter().zip(&after) {
        if !synced.contains(name) {
            assert_eq!(a, b, "frozen {name} changed");
        }
    }
    assert!(before.iter().zip(&after).any(|(a, b)| a.2 != b.2));

    // a state dict of another model is rejected without touching the actor.
    let mut other = cfg.clone();
    other.actor.model.hidden_dim = nz(16);
    let foreign = Learner::new(&other, train_env.spec())
        .unwrap()
        .state_dict(None)
        .unwrap();
    let keep = entry_bytes(&actor.state_dict().unwrap());
    assert!(matches!(
        actor.import_state(&foreign, 9),
        Err(crate::rl::RlError::WeightsMismatch { .. })
    ));
    assert_eq!(entry_bytes(&actor.state_dict().unwrap()), keep);
    assert_ne!(actor.version(), 9);
}

/// How the sync test's rollout gets its weights after each step.
#[derive(Debug, Clone, Copy, PartialEq)]
enum SyncMode {
    Real(rlsync::config::schema::SyncerKind),
    /// The negative control: the sync is skipped but the rollout believes it holds the new version.
    Skipped,
}

/// Trainer → syncer (over an in-process channel) → rollout for `steps` steps; returns every step's metrics
/// and, per sync, whether the rollout's whole state (frozen entries included) equals the trainer's export.
fn run_with_sync(
    cfg: &RunConfig,
    mode: SyncMode,
    steps: usize,
) -> (Vec<crate::rl::TrainMetrics>, Vec<bool>) {
    use rlsync_core::syncer::{SyncOptions, WeightSyncer};
    use rlsync_core::tensor::DType;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut cfg = cfg.clone();
    if let SyncMode::Real(kind) = mode {
        cfg.weight_syncer.kind = kind;
    }
    let mut train_env = env(&cfg, false);
    let mut learner = Learner::new(&cfg, train_env.spec()).unwrap();
    let rollout_dtype = match cfg.rollout.model.precision {
        WeightDtype::Bf16 => DType::Bf16,
        WeightDtype::F16 => DType::F16,
        WeightDtype::F32 => DType::F32,
    };
    // the trainer's sync buffer holds the rollout dtype; export_into casts the fp32 masters into it.
    let mut sent = learner.state_dict(Some(rollout_dtype)).unwrap();
    // with patch sync the rollout builds its model from another seed, so only the init bootstrap can make
    // its weights the trainer's; bucket sync has no bootstrap, and both sides start from the same config.
    let mut rollout_cfg = cfg.clone();
    if mode == SyncMode::Real(rlsync::config::schema::SyncerKind::Patch) {
        rollout_cfg.actor.seed += 1;
    }
    let mut actor = Actor::new(&rollout_cfg, train_env.spec(), 11).unwrap();
    let mut received = actor.state_dict().unwrap();
    let (tx, mut rxs) = rlsync_core::transport::inproc_channel(1);
    let rx = rxs.pop().unwrap();
    let sender = WeightSyncer::from_config(&cfg.weight_syncer, SyncOptions::default()).unwrap();
    let receiver = WeightSyncer::from_config(&cfg.weight_syncer, SyncOptions::default()).unwrap();
    let keys = sent.synced_keys();
    let ((mut sender, _), (mut receiver, _)) = rt.block_on(async {
        let (a, b) = tokio::join!(
            sender.init_sender(&sent, &keys, tx),
            receiver.init_receiver(&mut received, rx)
        );
        (a.unwrap(), b.unwrap())
    });
    actor.import_state(&received, learner.version()).unwrap();
    let same = |a: &rlsync_core::tensor::StateDict, b: &rlsync_core::tensor::StateDict| {
        entry_bytes(a) == entry_bytes(b)
    };
    let mut equal = vec![same(&sent, &received)];
    let mut metrics = Vec::new();
    for _ in 0..steps {
        let traj = collect(&mut train_env, &mut actor, 16).unwrap();
        metrics.push(learner.train_step(&traj).unwrap());
        learner.export_into(&mut sent).unwrap();
        match mode {
            SyncMode::Real(_) => {
                let version = learner.version();
                let applied = rt.block_on(async {
                    let (a, b) =
                        tokio::join!(sender.sync(&sent, version), receiver.apply(&mut received));
                    a.unwrap();
                    b.unwrap()
                });
                assert_eq!(applied.version, version);
                actor.import_state(&received, applied.version).unwrap();
            }
            SyncMode::Skipped => actor.import_state(&received, learner.version()).unwrap(),
        }
        equal.push(same(&sent, &received));
    }
    (metrics, equal)
}

#[test]
fn behaviour_kl_is_zero_with_patch_and_bucket_sync_and_not_when_sync_is_skipped() {
    use rlsync::config::schema::SyncerKind;
    let cfg = reach_cfg(); // fp32 rollouts: the rollout's log-probs must equal the trainer's exactly
    for kind in [SyncerKind::Patch, SyncerKind::Bucket] {
        let (metrics, equal) = run_with_sync(&cfg, SyncMode::Real(kind), 3);
        for (step, m) in metrics.iter().enumerate() {
            assert!(
                m.behav_approx_kl.abs() < 1e-6,
                "{kind:?} step {step}: {m:?}"
            );
        }
        assert!(equal.iter().all(|e| *e), "{kind:?}: {equal:?}");
    }
    let (metrics, equal) = run_with_sync(&cfg, SyncMode::Skipped, 3);
    assert!(
        metrics[0].behav_approx_kl.abs() < 1e-6,
        "the bootstrap did happen: {:?}",
        metrics[0]
    );
    for m in &metrics[1..] {
        assert!(m.behav_approx_kl > 1e-6, "stale weights must show: {m:?}");
    }
    assert!(!equal[1..].iter().any(|e| *e));
}

#[test]
fn vla_tiny_with_patch_sync_bootstraps_frozen_keys_and_never_patches_them() {
    use rlsync::config::schema::SyncerKind;
    let mut cfg = reach_cfg();
    cfg.actor.model.model_type = ModelType::VlaTiny;
    cfg.actor.model.hidden_dim = nz(64);
    cfg.rollout.model.precision = WeightDtype::Bf16;
    let spec = env(&cfg, false).spec();
    let learner = Learner::new(&cfg, spec).unwrap();
    let state = learner
        .state_dict(Some(rlsync_core::tensor::DType::Bf16))
        .unwrap();
    assert!(
        state
            .synced_keys()
            .iter()
            .all(|k| !k.starts_with("backbone."))
    );
    assert!(state.keys().any(|k| k.starts_with("backbone.")));
    // run_with_sync builds the rollout from another seed, so its backbone starts different and only the
    // init bootstrap can align it; later patches cover synced keys only.
    let mut other = cfg.clone();
    other.actor.seed += 1;
    let fresh = Actor::new(&other, spec, 0).unwrap().state_dict().unwrap();
    assert!(
        fresh
            .iter()
            .zip(state.iter())
            .any(|((n, a), (_, b))| n.starts_with("backbone.") && a.bytes() != b.bytes())
    );
    let (metrics, equal) = run_with_sync(&cfg, SyncMode::Real(SyncerKind::Patch), 2);
    assert!(equal.iter().all(|e| *e), "{equal:?}");
    assert!(metrics.iter().all(|m| m.loss.is_finite()));
}

#[test]
fn trainer_and_two_rollout_workers_train_checkpoint_and_resume() {
    use crate::rl::{RolloutWork, TrainerWork};
    let tmp = tempfile::tempdir().unwrap();
    let cfg = reach_cfg();
    let workers = nz(2);
    let mut trainer = TrainerWork::new(&cfg, tmp.path()).unwrap();
    let mut state = trainer.init_state().unwrap();
    let mut rollouts: Vec<RolloutWork> = (0..2)
        .map(|r| RolloutWork::new(&cfg, r, workers).unwrap())
        .collect();
    for r in &rollouts {
        let own = r.init_state().unwrap();
        assert_eq!(
            own.keys().collect::<Vec<_>>(),
            state.keys().collect::<Vec<_>>()
        );
    }
    let mut saved = Vec::new();
    for _ in 0..3 {
        let version = trainer.learner().version();
        // stands in for the syncer: every rollout receives the trainer's buffer as is.
        let chunks: Vec<_> = rollouts
            .iter_mut()
            .map(|r| r.rollout(&state, version, 8).unwrap())
            .collect();
        assert_eq!(chunks.iter().map(|c| c.envs).sum::<usize>(), 16);
        let m = trainer.train_step(&mut state, &chunks).unwrap();
        assert!(m.behav_approx_kl.abs() < 1e-6, "{m:?}");
        if trainer.learner().global_step() == 2 {
            saved.push(trainer.save_checkpoint().unwrap());
        }
    }
    assert_eq!(
        saved.iter().map(|c| c.global_step).collect::<Vec<_>>(),
        vec![2]
    );
    let a = rollouts[0].evaluate().unwrap();
    let b = rollouts[0].evaluate().unwrap();
    assert_eq!(a, b);

    // What the orchestrator reads without libtorch is what the learner saved.
    assert_eq!(
        rlsync::checkpoint::read_info(&saved[0].dir).unwrap(),
        saved[0]
    );
    let mut resumed_cfg = cfg.clone();
    resumed_cfg.runner.resume_dir = Some(saved[0].dir.clone());
    let resumed = TrainerWork::new(&resumed_cfg, tmp.path()).unwrap();
    assert_eq!(
        (resumed.learner().global_step(), resumed.learner().version()),
        (2, 2)
    );
}

/// A forward's outputs (head, log_std, value) as raw float32 bits.
fn forward_bits(actor: &Actor, obs: &[f32]) -> Vec<u32> {
    let d = actor.policy.spec.obs_dim as i64;
    let x = tch::Tensor::from_slice(obs).view([-1, d]);
    let heads = tch::no_grad(|| actor.policy.forward(&x)).unwrap();
    let mut bits = Vec::new();
    for t in [Some(heads.head), heads.log_std, heads.value]
        .into_iter()
        .flatten()
    {
        let t = t.flatten(0, -1).contiguous();
        bits.extend(
            Vec::<f32>::try_from(&t)
                .unwrap()
                .iter()
                .map(|v| v.to_bits()),
        );
    }
    bits
}

/// An actor acting on views of a state dict acts bit for bit like one that imported it; its weights' data lie
/// in the state dict's bytes during the call, it follows a rebind to another state dict, it copies nothing,
/// and outside the call it holds no weights (and refuses to act or to be written).
fn views_act_like_an_imported_copy(cfg: &RunConfig) {
    let mut train_env = env(cfg, false);
    let spec = train_env.spec();
    let dtype = crate::rl::rollout_dtype(cfg);
    let mut learner = Learner::new(cfg, spec).unwrap();
    let mut copy = learner.actor(cfg, 0).unwrap();
    let first = learner.state_dict(Some(dtype)).unwrap();
    short_run(&mut learner, &mut copy, &mut train_env, 2);
    let second = learner.state_dict(Some(dtype)).unwrap();
    assert_ne!(entry_bytes(&first), entry_bytes(&second), "training moved");
    let obs = train_env.obs().to_vec();

    let mut viewer = Actor::new(cfg, spec, 0).unwrap();
    viewer.viewable(&first).unwrap();
    let mut outputs = Vec::new();
    for (version, state) in [(1, &first), (2, &second), (1, &first)] {
        let viewed = viewer
            .with_views(state, version, |actor| {
                for (name, t) in actor.policy.named_tensors().unwrap() {
                    let entry = state.get(&name).unwrap();
                    assert_eq!(
                        t.data_ptr() as usize,
                        entry.bytes().as_ptr() as usize,
                        "{name} is a view of the state dict's bytes"
                    );
                    assert_eq!(t.numel(), entry.numel(), "{name}");
                }
                assert!(matches!(
                    actor.import_state(state, version),
                    Err(crate::rl::RlError::ReadOnlyViews)
                ));
                assert_eq!(actor.version(), version);
                actor.act(&obs, ActMode::Deterministic)?;
                Ok(forward_bits(actor, &obs))
            })
            .unwrap();
        copy.import_state(state, version).unwrap();
        assert_eq!(viewed, forward_bits(&copy, &obs), "version {version}");
        outputs.push(viewed);
    }
    assert_ne!(
        outputs[0], outputs[1],
        "the rebind to the second state is followed"
    );
    assert_eq!(outputs[0], outputs[2], "and back");
    assert_eq!(viewer.imported_bytes(), 0);
    assert!(copy.imported_bytes() > 0);
    // Outside the call: no bytes held, nothing acted on, nothing written.
    for (name, t) in viewer.policy.named_tensors().unwrap() {
        assert_eq!(t.numel(), 0, "{name} released");
    }
    assert!(matches!(
        viewer.act(&obs, ActMode::Deterministic),
        Err(crate::rl::RlError::NoWeights)
    ));
    assert!(matches!(
        viewer.import_state(&first, 1),
        Err(crate::rl::RlError::NoWeights)
    ));
    // A refused state dict (a weight missing) leaves the actor as it was: released, and the call fails.
    let mut partial = rlsync_core::tensor::StateDict::new();
    for (name, t) in first.iter().skip(1) {
        let zeros = rlsync_core::tensor::Tensor::zeros(t.dtype(), t.shape(), t.class()).unwrap();
        partial.insert(name.to_owned(), zeros);
    }
    assert!(matches!(
        viewer.viewable(&partial),
        Err(crate::rl::NoViews::Missing { .. })
    ));
    assert!(matches!(
        viewer.with_views(&partial, 3, |_| Ok(())),
        Err(crate::rl::RlError::NoViews(
            crate::rl::NoViews::Missing { .. }
        ))
    ));
    assert!(viewer.with_views(&second, 2, |_| Ok(())).is_ok());
}

#[test]
fn mlp_policy_on_views_acts_like_an_imported_copy_in_fp32_and_bf16() {
    for precision in [WeightDtype::F32, WeightDtype::Bf16] {
        let mut cfg = reach_cfg();
        cfg.rollout.model.precision = precision;
        views_act_like_an_imported_copy(&cfg);
    }
}

#[test]
fn vla_tiny_on_views_acts_like_an_imported_copy() {
    let mut cfg = reach_cfg();
    cfg.actor.model.model_type = ModelType::VlaTiny;
    cfg.actor.model.hidden_dim = nz(64);
    cfg.actor.model.lora_rank = nz(4);
    cfg.rollout.model.precision = WeightDtype::Bf16;
    views_act_like_an_imported_copy(&cfg);
}

#[test]
fn a_state_in_another_dtype_is_refused_for_views_and_imported_instead() {
    use rlsync_core::tensor::DType;
    let mut cfg = reach_cfg();
    cfg.rollout.model.precision = WeightDtype::Bf16;
    let spec = env(&cfg, false).spec();
    let learner = Learner::new(&cfg, spec).unwrap();
    let fp32 = learner.state_dict(Some(DType::F32)).unwrap();
    let bf16 = learner.state_dict(Some(DType::Bf16)).unwrap();

    let mut work = crate::rl::RolloutWork::new(&cfg, 0, nz(1)).unwrap();
    let refused = work.act_on_views(&fp32).unwrap_err();
    assert!(
        matches!(
            &refused,
            crate::rl::NoViews::Dtype {
                state: DType::F32,
                ..
            }
        ),
        "{refused:?}"
    );
    // The fallback imports (converting), as outside the host-shared mode.
    work.rollout(&fp32, 1, 4).unwrap();
    let imported = work.imported_bytes();
    assert!(imported > 0);
    work.evaluate_state(&fp32, 1).unwrap();
    assert_eq!(
        work.imported_bytes(),
        imported,
        "version 1 is installed already"
    );

    // Acting on views: rollouts and evaluations copy nothing, whatever the version.
    let mut work = crate::rl::RolloutWork::new(&cfg, 0, nz(1)).unwrap();
    work.act_on_views(&bf16).unwrap();
    let a = work.rollout(&bf16, 1, 4).unwrap();
    let e = work.evaluate_state(&bf16, 1).unwrap();
    work.rollout(&bf16, 2, 4).unwrap();
    assert_eq!(work.imported_bytes(), 0);
    assert_eq!(a.len(), 4 * 16);
    assert!(e.episodes > 0);
}
