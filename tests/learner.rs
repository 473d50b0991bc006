//! The libtorch learner through real worker processes: `rlsync train_embodied` on reach learns, rollouts act
//! with exactly the trainer's weights (patch and bucket), and vla_tiny's frozen keys stay out of patches.

use serde_json::{Map, Value};

use crate::util::Dir;

type Row = Map<String, Value>;

/// A seeded PPO run on reach with mlp_policy (fp32 rollouts) plus `extra` overrides; its metrics rows.
fn train(dir: &Dir, name: &str, extra: &[&str]) -> Vec<Row> {
    let run_dir = format!("hydra.run.dir={name}");
    let mut args = vec![
        "train_embodied",
        "model@actor.model=mlp_policy",
        "env@env.train=reach",
        "env@env.eval=reach",
        "env.eval.seed=99",
        "rollout.model.precision=fp32",
        "actor.seed=7",
        "actor.optim.lr=1e-3",
        "actor.optim.value_lr=1e-3",
        "actor.optim.clip_grad=0.5",
        "actor.micro_batch_size=256",
        "actor.global_batch_size=256",
        "algorithm.entropy_bonus=0.0",
        "algorithm.value_clip=0.0",
        "rollout.chunk_steps=64",
        "env.train.total_num_envs=16",
        "runner.logger.logger_backends=[]",
        run_dir.as_str(),
    ];
    args.extend_from_slice(extra);
    dir.run(&args).ok();
    let text = std::fs::read_to_string(dir.join(name).join("metrics.jsonl")).unwrap_or_default();
    text.lines()
        .map(|l| match serde_json::from_str(l) {
            Ok(Value::Object(map)) => map,
            other => panic!("bad metrics line {l}: {other:?}"),
        })
        .collect()
}

fn num(row: &Row, key: &str) -> f64 {
    // NaN (written as null) where the learner had nothing to measure.
    row.get(key).and_then(Value::as_f64).unwrap_or(f64::NAN)
}

fn behav_kls(rows: &[Row]) -> Vec<f64> {
    rows.iter().map(|r| num(r, "actor/behav_approx_kl")).collect()
}

#[test]
fn ppo_on_reach_through_the_workers_improves_the_return() {
    let dir = Dir::new();
    let rows = train(&dir, "learn", &["runner.max_steps=40", "runner.val_check_interval=1"]);
    assert_eq!(rows.len(), 40);
    for key in ["actor/loss", "actor/approx_kl", "actor/clip_fraction", "actor/entropy", "actor/grad_norm", "env/return", "env/success_rate", "env/episode_len", "eval/return"] {
        assert!(num(&rows[0], key).is_finite(), "{key} missing in {:?}", rows[0]);
    }
    let eval: Vec<f64> = rows.iter().map(|r| num(r, "eval/return")).collect();
    let first = eval[0];
    let last = eval[eval.len() - 5..].iter().sum::<f64>() / 5.0;
    // Reach's reward is the negative distance (plus a success bonus): a clear margin is 40% less cost.
    assert!(last > first + 0.4 * first.abs(), "eval returns did not improve: {eval:?}");
}

#[test]
fn rollouts_act_with_exactly_the_trainers_weights_with_patch_and_bucket() {
    let dir = Dir::new();
    for syncer in ["weight_syncer=patch_syncer", "weight_syncer=bucket_syncer"] {
        let rows = train(&dir, syncer.trim_start_matches("weight_syncer="), &[syncer, "runner.max_steps=4"]);
        assert_eq!(rows.len(), 4);
        let kls = behav_kls(&rows);
        assert!(kls.iter().all(|kl| kl.abs() < 1e-6), "{syncer}: behaviour KL per step {kls:?}");
    }
}

#[test]
fn the_behaviour_kl_check_fails_without_exact_sync() {
    let dir = Dir::new();
    // Negative control: sync skipped after the bootstrap. The rollouts act with version 0 while the
    // trainer moves on, so from step 1 no sample is from the trainer's version and the check cannot pass.
    let rows = train(&dir, "skipped", &["runner.max_steps=3", "runner.weight_sync_interval=1000"]);
    let kls = behav_kls(&rows);
    assert!(kls[0].abs() < 1e-6, "the bootstrap did happen: {kls:?}");
    assert!(kls[1..].iter().all(|kl| !(kl.abs() < 1e-6)), "stale weights passed the check: {kls:?}");
}

#[test]
fn vla_tiny_patches_never_cover_the_frozen_backbone() {
    let dir = Dir::new();
    let rows = train(&dir, "vla", &["model@actor.model=vla_tiny", "actor.model.hidden_dim=64", "runner.max_steps=4"]);
    assert_eq!(rows.len(), 4);
    let int = |row: &Row, key: &str| row.get(key).and_then(Value::as_i64).unwrap_or(-1);
    // Step 0 reports the bootstrap: every element, frozen ones included, in bf16.
    assert_eq!(rows[0].get("sync/kind").and_then(Value::as_str), Some("init"));
    let bootstrap_elements = int(&rows[0], "sync/changed");
    for row in &rows[1..] {
        assert_eq!(row.get("sync/kind").and_then(Value::as_str), Some("patch"));
        assert_eq!(row.get("sync/verified").and_then(Value::as_bool), Some(true));
        // A patch's scope (its snapshot, bf16 = 2 bytes per element) would be at least twice the bootstrap's
        // element count if the frozen backbone were in it; the backbone holds most of the parameters.
        let scope = int(row, "sync/state_bytes");
        assert!(scope > 0 && scope < bootstrap_elements, "patch scope {scope} B vs bootstrap {bootstrap_elements} elements");
        assert!(int(row, "sync/changed") > 0, "the adapters and heads train: {row:?}");
    }
}
