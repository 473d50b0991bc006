//! The libtorch learner through real worker processes: `rlsync train_embodied` on reach learns, rollouts act
//! with exactly the trainer's weights (patch and bucket, and host-shared: acting on the arena through views,
//! no copy), vla_tiny's frozen keys stay out of patches, and checkpoints (mlp_policy and the TorchScript
//! example) resume where they were saved.

use std::collections::HashMap;
use std::path::Path;

use rlsync_core::tensor::{Class, DType, StateDict, Tensor, state_checksum, state_checksum_v1};
use serde_json::{Map, Value};

use crate::util::{self, Dir};

type Row = Map<String, Value>;

/// The metrics rows of the run in `<dir>/<name>` (none if it wrote none).
fn rows_of(dir: &Dir, name: &str) -> Vec<Row> {
    let text = std::fs::read_to_string(dir.join(name).join("metrics.jsonl")).unwrap_or_default();
    text.lines()
        .map(|l| match serde_json::from_str(l) {
            Ok(Value::Object(map)) => map,
            other => panic!("bad metrics line {l}: {other:?}"),
        })
        .collect()
}

/// A seeded PPO run on reach with mlp_policy (fp32 rollouts) plus `extra` overrides; its metrics rows.
fn train(dir: &Dir, name: &str, extra: &[&str]) -> Vec<Row> {
    let run_dir = format!("hydra.run.dir={name}");
    let mut args = vec![
        "train_embodied",
        "model@actor.model=mlp_policy",
        "env@env.train=reach",
        "env@env.eval=reach",
        "env.eval.seed=99",
        "env.eval.total_num_envs=4",
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
    rows_of(dir, name)
}

fn num(row: &Row, key: &str) -> f64 {
    // NaN (written as null) where the learner had nothing to measure.
    row.get(key).and_then(Value::as_f64).unwrap_or(f64::NAN)
}

fn behav_kls(rows: &[Row]) -> Vec<f64> {
    rows.iter()
        .map(|r| num(r, "actor/behav_approx_kl"))
        .collect()
}

#[test]
fn ppo_on_reach_through_the_workers_improves_the_return() {
    let dir = Dir::new();
    let rows = train(
        &dir,
        "learn",
        &["runner.max_steps=40", "runner.val_check_interval=1"],
    );
    assert_eq!(rows.len(), 40);
    for key in [
        "actor/loss",
        "actor/approx_kl",
        "actor/clip_fraction",
        "actor/entropy",
        "actor/grad_norm",
        "env/return",
        "env/success_rate",
        "env/episode_len",
        "eval/return",
    ] {
        assert!(
            num(&rows[0], key).is_finite(),
            "{key} missing in {:?}",
            rows[0]
        );
    }
    let eval: Vec<f64> = rows.iter().map(|r| num(r, "eval/return")).collect();
    let first = eval[0];
    let last = eval[eval.len() - 5..].iter().sum::<f64>() / 5.0;
    // Reach's reward is the negative distance (plus a success bonus): a clear margin is 40% less cost.
    assert!(
        last > first + 0.4 * first.abs(),
        "eval returns did not improve: {eval:?}"
    );
}

#[test]
fn rollouts_act_with_exactly_the_trainers_weights_with_patch_and_bucket() {
    let dir = Dir::new();
    for syncer in ["weight_syncer=patch_syncer", "weight_syncer=bucket_syncer"] {
        let rows = train(
            &dir,
            syncer.trim_start_matches("weight_syncer="),
            &[syncer, "runner.max_steps=4"],
        );
        assert_eq!(rows.len(), 4);
        let kls = behav_kls(&rows);
        assert!(
            kls.iter().all(|kl| kl.abs() < 1e-6),
            "{syncer}: behaviour KL per step {kls:?}"
        );
    }
}

/// Every rollout of the run in `<dir>/<name>` said it acts on the host's shared weights through views, and
/// copied no weights out of them.
fn assert_rollouts_viewed(dir: &Dir, name: &str, rollouts: u32) {
    for rank in 0..rollouts {
        let log = std::fs::read_to_string(dir.join(&format!("{name}/logs/rollout-{rank}.log")))
            .unwrap_or_default();
        assert!(
            log.contains("the policy's weights are views of the held buffer"),
            "rollout-{rank}: {log}"
        );
        assert!(
            log.contains("copied 0 bytes of weights out of the host's shared buffers"),
            "rollout-{rank}: {log}"
        );
    }
}

#[test]
fn host_shared_rollouts_act_on_the_arena_through_views_exactly_as_with_their_own_copies() {
    let dir = Dir::new();
    let three = [
        "cluster.component_placement.rollout=0-2",
        "env.train.total_num_envs=12",
        "env.eval.total_num_envs=6",
        "runner.max_steps=4",
        "runner.val_check_interval=2",
        "runner.verify_sync=true",
    ];
    let shared = [&three[..], &["weight_syncer.host_shared=true"]].concat();
    let rows = train(&dir, "shared", &shared);
    assert_eq!(rows.len(), 4);
    for row in &rows {
        assert_eq!(
            row.get("sync/verified").and_then(Value::as_bool),
            Some(true),
            "{row:?}"
        );
    }
    let kls = behav_kls(&rows);
    assert!(
        kls.iter().all(|kl| kl.abs() < 1e-6),
        "the rollouts act with the trainer's weights: behaviour KL per step {kls:?}"
    );
    // Evaluations act on the views too: every eval env finished its one episode.
    let evals: Vec<i64> = rows
        .iter()
        .filter_map(|r| r.get("eval/episodes").and_then(Value::as_i64))
        .collect();
    assert_eq!(evals, [6, 6], "{rows:?}");
    assert_rollouts_viewed(&dir, "shared", 3);
    // The same run with a copy of the weights per rollout: the same actions, so the same losses, bit for bit.
    let own = train(&dir, "own", &three);
    let column = |rows: &[Row], key: &str| -> Vec<Option<f64>> {
        rows.iter()
            .map(|r| r.get(key).and_then(Value::as_f64))
            .collect()
    };
    for key in ["actor/loss", "eval/return"] {
        assert_eq!(column(&rows, key), column(&own, key), "{key}");
    }
    assert!(column(&own, "actor/loss").iter().all(Option::is_some));
}

#[test]
fn host_shared_rollouts_on_views_run_beside_background_installs() {
    // train_async with no-wait installs: the applier writes the back buffer while the rollouts act on views of
    // the buffer each holds, flipping between chunks.
    let dir = Dir::new();
    let run_dir = "hydra.run.dir=async";
    let out = dir.run(&[
        "train_async",
        "model@actor.model=mlp_policy",
        "env@env.train=reach",
        "env@env.eval=reach",
        "cluster.component_placement.rollout=0-2",
        "env.train.total_num_envs=12",
        "env.eval.total_num_envs=6",
        "runner.max_steps=6",
        "runner.val_check_interval=3",
        "weight_syncer.host_shared=true",
        "actor.sync_weight_no_wait=true",
        "runner.logger.logger_backends=[]",
        run_dir,
    ]);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    // One row per train step; the final evaluation may land in the last step's row or, finishing after it
    // was written (the rollouts run on in the background), in a row of its own.
    let rows = rows_of(&dir, "async");
    let train: Vec<&Row> = rows
        .iter()
        .filter(|r| r.contains_key("actor/loss"))
        .collect();
    assert_eq!(train.len(), 6, "{rows:?}");
    assert!(
        train.iter().all(|r| r
            .get("actor/loss")
            .and_then(Value::as_f64)
            .is_some_and(f64::is_finite)),
        "{rows:?}"
    );
    assert!(
        rows.iter()
            .all(|r| r.contains_key("actor/loss") || r.contains_key("eval/return")),
        "{rows:?}"
    );
    assert_rollouts_viewed(&dir, "async", 3);
}

#[test]
fn the_behaviour_kl_check_fails_without_exact_sync() {
    let dir = Dir::new();
    // Negative control: sync skipped after the bootstrap. The rollouts act with version 0 while the
    // trainer moves on, so from step 1 no sample is from the trainer's version and the check cannot pass.
    let rows = train(
        &dir,
        "skipped",
        &["runner.max_steps=3", "runner.weight_sync_interval=1000"],
    );
    let kls = behav_kls(&rows);
    assert!(kls[0].abs() < 1e-6, "the bootstrap did happen: {kls:?}");
    assert!(
        kls[1..].iter().all(|kl| kl.abs() >= 1e-6 || kl.is_nan()),
        "stale weights passed the check: {kls:?}"
    );
}

#[test]
fn vla_tiny_patches_never_cover_the_frozen_backbone() {
    let dir = Dir::new();
    let rows = train(
        &dir,
        "vla",
        &[
            "model@actor.model=vla_tiny",
            "actor.model.hidden_dim=64",
            "runner.max_steps=4",
        ],
    );
    assert_eq!(rows.len(), 4);
    let int = |row: &Row, key: &str| row.get(key).and_then(Value::as_i64).unwrap_or(-1);
    // Step 0 reports the bootstrap: every element, frozen ones included, in bf16.
    assert_eq!(
        rows[0].get("sync/kind").and_then(Value::as_str),
        Some("init")
    );
    let bootstrap_elements = int(&rows[0], "sync/changed");
    for row in &rows[1..] {
        assert_eq!(row.get("sync/kind").and_then(Value::as_str), Some("patch"));
        assert_eq!(
            row.get("sync/verified").and_then(Value::as_bool),
            Some(true)
        );
        // A patch's scope (its snapshot, bf16 = 2 bytes per element) would be at least twice the bootstrap's
        // element count if the frozen backbone were in it; the backbone holds most of the parameters.
        let scope = int(row, "sync/state_bytes");
        assert!(
            scope > 0 && scope < bootstrap_elements,
            "patch scope {scope} B vs bootstrap {bootstrap_elements} elements"
        );
        assert!(
            int(row, "sync/changed") > 0,
            "the adapters and heads train: {row:?}"
        );
    }
}

/// The Python that has torch: the one tch was built against (`PYTHON_SYS_EXECUTABLE`, which `make test`
/// exports), else `python` on PATH.
fn python() -> String {
    std::env::var("PYTHON_SYS_EXECUTABLE")
        .ok()
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| "python".into())
}

/// Runs reach for `steps` steps with the `model` overrides in `<dir>/<name>`, plus `extra`; asserts success.
fn run_reach(dir: &Dir, name: &str, model: &[&str], steps: u32, extra: &[&str]) -> Vec<Row> {
    reach(dir, name, model, steps, extra).ok();
    rows_of(dir, name)
}

/// The run of [`run_reach`], however it ends.
fn reach(dir: &Dir, name: &str, model: &[&str], steps: u32, extra: &[&str]) -> util::Output {
    let run_dir = format!("hydra.run.dir={name}");
    let max_steps = format!("runner.max_steps={steps}");
    let mut args = vec![
        "train_embodied",
        "env@env.train=reach",
        "env@env.eval=reach",
        "rollout.model.precision=fp32",
    ];
    args.extend_from_slice(model);
    args.extend([
        "actor.seed=7",
        "env.train.total_num_envs=8",
        "env.train.max_steps_per_rollout_epoch=16",
    ]);
    args.extend([
        "rollout.chunk_steps=16",
        "runner.logger.logger_backends=[]",
        max_steps.as_str(),
        run_dir.as_str(),
    ]);
    args.extend_from_slice(extra);
    dir.run(&args)
}

/// The string metadata of a safetensors file.
fn metadata(path: &Path) -> HashMap<String, String> {
    let bytes =
        std::fs::read(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes)
        .unwrap_or_else(|e| panic!("{}: {e:?}", path.display()));
    meta.metadata().clone().unwrap_or_default()
}

/// Every tensor of a safetensors file, read here with the `safetensors` crate (independently of the learner's
/// reader), in the file's order.
fn load_file(path: &Path) -> StateDict {
    use safetensors::Dtype;
    let bytes =
        std::fs::read(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .unwrap_or_else(|e| panic!("{}: {e:?}", path.display()));
    let mut state = StateDict::new();
    for (name, view) in st.tensors() {
        let dtype = match view.dtype() {
            Dtype::BF16 => DType::Bf16,
            Dtype::F16 => DType::F16,
            Dtype::F32 => DType::F32,
            Dtype::F64 => DType::F64,
            Dtype::I64 => DType::I64,
            other => panic!("{}: `{name}` has dtype {other:?}", path.display()),
        };
        let t = Tensor::from_bytes(dtype, view.shape(), Class::Trainable, view.data())
            .unwrap_or_else(|e| panic!("{}: `{name}`: {e}", path.display()));
        state.insert(name, t);
    }
    state
}

/// The checksum of the weights in a checkpoint file, computed here from the file (every entry, names sorted),
/// in the `0x…` form the learner writes.
fn file_checksum(path: &Path) -> String {
    let state = load_file(path);
    let mut keys: Vec<String> = state.keys().map(str::to_owned).collect();
    keys.sort();
    format!("{:#018x}", state_checksum(&state, &keys))
}

/// Trains 3 steps saving every 2 (so at 2 and at the final step 3), checks the checkpoint's files, then resumes from step 3 with `runner.max_steps=4` as the total: one
/// more step, numbered 3, from the saved weights (checksum), versions continuing, rollouts bootstrapped with
/// them, and a final checkpoint at step 4.
fn check_checkpoint_and_resume(dir: &Dir, model: &[&str]) {
    let first = run_reach(dir, "first", model, 3, &["runner.save_interval=2"]);
    assert_eq!(first.len(), 3);
    let saved: Vec<bool> = (1..=4)
        .map(|s| {
            dir.join(&format!("first/checkpoints/global_step_{s}"))
                .is_dir()
        })
        .collect();
    assert_eq!(
        saved,
        [false, true, true, false],
        "every 2 steps and the final one"
    );

    let ckpt = dir.join("first/checkpoints/global_step_3");
    let weights = ckpt.join(rlsync::checkpoint::WEIGHTS_FILE);
    let optimizer = ckpt.join(rlsync::checkpoint::OPTIMIZER_FILE);
    let meta = metadata(&weights);
    assert_eq!(
        meta.get("global_step").map(String::as_str),
        Some("3"),
        "{meta:?}"
    );
    assert_eq!(
        meta.get("version").map(String::as_str),
        Some("3"),
        "{meta:?}"
    );
    let saved_checksum = file_checksum(&weights);
    assert_eq!(
        meta.get("weights_checksum"),
        Some(&saved_checksum),
        "the recorded checksum is the file's weights'"
    );
    let opt = metadata(&optimizer);
    let adam_steps: u64 = opt
        .get("adam_steps")
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    assert!(adam_steps >= 3, "optimizer state after 3 steps: {opt:?}");
    assert!(!load_file(&optimizer).is_empty(), "optimizer moments saved");

    let resume = format!("runner.resume_dir={}", ckpt.display());
    let resumed = run_reach(dir, "resumed", model, 4, &[resume.as_str()]);
    assert_eq!(resumed.len(), 1, "max_steps is the total: 4 - 3 steps left");
    let row = &resumed[0];
    assert_eq!(
        (
            num(row, "step"),
            num(row, "learner/global_step"),
            num(row, "learner/version"),
            num(row, "actor/current_version"),
            num(row, "actor/average_version"),
        ),
        (3.0, 4.0, 4.0, 4.0, 3.0),
        "steps and versions continue from the checkpoint: {row:?}"
    );
    assert!(
        dir.join("resumed/checkpoints/global_step_4").is_dir(),
        "the final step is saved"
    );
    // Rollouts were bootstrapped from the resumed trainer (init sync, verified), and acted with exactly the
    // weights the trainer loaded.
    assert_eq!(
        row.get("sync/kind").and_then(Value::as_str),
        Some("init"),
        "{row:?}"
    );
    assert_eq!(
        row.get("sync/verified").and_then(Value::as_bool),
        Some(true),
        "{row:?}"
    );
    let kl = num(row, "actor/behav_approx_kl");
    assert!(
        kl.abs() < 1e-6,
        "rollouts did not act with the loaded weights: behaviour KL {kl}"
    );
    // The trainer's weights right after loading have the checksum of the saved file.
    let log = std::fs::read_to_string(dir.join("resumed/logs/trainer-0.log")).unwrap_or_default();
    let want = format!("global step 3, version 3, weights checksum {saved_checksum}");
    assert!(
        log.contains("resumed from") && log.contains(&want),
        "trainer log lacks '{want}':\n{log}"
    );
}

#[test]
fn mlp_policy_checkpoints_and_resumes() {
    let dir = Dir::new();
    check_checkpoint_and_resume(&dir, &["model@actor.model=mlp_policy"]);
    check_readme_loader(&dir.join("first/checkpoints/global_step_3"));
    check_format_1_resumes(&dir, &["model@actor.model=mlp_policy"]);
}

/// A checkpoint written before checksums were chunked (`format_version` 1, the single-stream checksum) still
/// resumes, checked with that checksum; one whose recorded checksum is wrong is refused.
fn check_format_1_resumes(dir: &Dir, model: &[&str]) {
    let src = dir.join("first/checkpoints/global_step_3");
    for (name, tamper) in [("legacy", false), ("legacy_bad", true)] {
        let ckpt = dir.join(&format!("{name}/ckpt"));
        std::fs::create_dir_all(&ckpt).unwrap();
        for f in [
            rlsync::checkpoint::WEIGHTS_FILE,
            rlsync::checkpoint::OPTIMIZER_FILE,
        ] {
            std::fs::copy(src.join(f), ckpt.join(f)).unwrap();
        }
        let weights = ckpt.join(rlsync::checkpoint::WEIGHTS_FILE);
        let state = load_file(&weights);
        let mut keys: Vec<String> = state.keys().map(str::to_owned).collect();
        keys.sort();
        let v1 = state_checksum_v1(&state, &keys) ^ u64::from(tamper);
        let mut meta = metadata(&weights);
        meta.insert("format_version".into(), "1".into());
        meta.insert("weights_checksum".into(), format!("{v1:#018x}"));
        let bytes = std::fs::read(&weights).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = st.tensors();
        safetensors::serialize_to_file(views, &Some(meta), &weights).unwrap();
        let resume = format!("runner.resume_dir={}", ckpt.display());
        let run = format!("{name}_run");
        if tamper {
            let out = reach(dir, &run, model, 4, &[resume.as_str()]);
            assert_ne!(out.code, Some(0), "a wrong format-1 checksum resumed");
            assert!(
                out.stderr.contains("the checkpoint recorded"),
                "no checksum refusal: {}",
                out.stderr
            );
        } else {
            let rows = run_reach(dir, &run, model, 4, &[resume.as_str()]);
            assert_eq!(rows.len(), 1, "the format-1 checkpoint resumed one step");
            let log = std::fs::read_to_string(dir.join(&format!("{run}/logs/trainer-0.log")))
                .unwrap_or_default();
            let want = format!("weights checksum {v1:#018x}");
            assert!(log.contains(&want), "trainer log lacks '{want}':\n{log}");
        }
    }
}

/// The README's Python snippet (the block after its `checkpoint-loader` marker) loads a checkpoint strictly
/// into a PyTorch module and runs it.
fn check_readme_loader(ckpt: &Path) {
    let readme = std::fs::read_to_string(util::repo_root().join("README.md")).unwrap_or_default();
    let block = readme
        .split_once("<!-- checkpoint-loader")
        .and_then(|(_, rest)| rest.split_once("```python\n"))
        .and_then(|(_, rest)| rest.split_once("```"))
        .map(|(code, _)| code.to_owned())
        .expect("README has the checkpoint-loader block");
    let script = ckpt.with_file_name("load_checkpoint.py");
    std::fs::write(&script, block).unwrap();
    let out = std::process::Command::new(python())
        .arg(&script)
        .arg(ckpt)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", python()));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("global_step 3 version 3: action ["),
        "the README loader failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn torchscript_example_exports_trains_checkpoints_and_resumes() {
    let dir = Dir::new();
    let script = util::repo_root().join("examples/torchscript/export_policy.py");
    let policy = dir.join("reach_policy.pt");
    let out = std::process::Command::new(python())
        .arg(&script)
        .args(["--obs-dim", "10", "--actions", "2", "--out"])
        .arg(&policy)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", python()));
    assert!(
        out.status.success(),
        "export failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let path = format!("actor.model.torchscript_path={}", policy.display());
    check_checkpoint_and_resume(&dir, &["model@actor.model=torchscript", path.as_str()]);

    // The checkpoint keeps the module's own parameter names, and its policy.pt is the module with exactly
    // the checkpoint's (trained) weights, as torch.jit.load sees it.
    let ckpt = dir.join("first/checkpoints/global_step_3");
    let saved = StateDict::load_safetensors(&ckpt.join(rlsync::checkpoint::WEIGHTS_FILE))
        .unwrap_or_else(|e| panic!("{e}"));
    let params = |module: &Path| -> Map<String, Value> {
        let out = std::process::Command::new(python())
            .args([
                "-c",
                "import json, sys, torch\n\
                 m = torch.jit.load(sys.argv[1])\n\
                 print(json.dumps({n: p.detach().flatten().tolist() for n, p in m.named_parameters()}))",
            ])
            .arg(module)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", python()));
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}"))
    };
    let trained = params(&ckpt.join(rlsync::checkpoint::SCRIPT_FILE));
    let mut names: Vec<&str> = trained.keys().map(String::as_str).collect();
    names.sort();
    let mut saved_names: Vec<&str> = saved.keys().collect();
    saved_names.sort();
    assert_eq!(names, saved_names);
    assert!(names.contains(&"pi.0.weight"), "{names:?}");
    for name in names {
        let want: Vec<f32> = saved
            .get(name)
            .and_then(|t| t.as_slice::<f32>().ok())
            .map(<[f32]>::to_vec)
            .unwrap_or_default();
        let got: Vec<f32> = trained[name]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_f64)
                    .map(|v| v as f32)
                    .collect()
            })
            .unwrap_or_default();
        assert_eq!(got, want, "{name}");
    }
    let exported = params(&policy);
    assert!(
        exported.iter().any(|(n, v)| trained.get(n) != Some(v)),
        "policy.pt holds the trained weights, not the exported ones"
    );
}

#[test]
fn the_embedded_default_trains_reach_with_mlp_policy_ppo_and_patch_sync() {
    let dir = Dir::new();
    // The default as `make run` starts it, shortened to 2 steps with an eval after each.
    dir.run(&[
        "train_embodied",
        "hydra.run.dir=default",
        "runner.max_steps=2",
        "runner.val_check_interval=1",
    ])
    .ok();
    let config =
        std::fs::read_to_string(dir.join("default/.hydra/config.yaml")).unwrap_or_default();
    for want in [
        "model_type: mlp_policy",
        "env_type: reach",
        "adv_type: gae",
        "type: patch",
    ] {
        assert!(
            config.contains(want),
            "default config lacks `{want}`:\n{config}"
        );
    }
    for worker in ["trainer-0", "rollout-0", "rollout-1"] {
        assert!(
            dir.join(&format!("default/logs/{worker}.log")).is_file(),
            "{worker} did not run"
        );
    }
    let rows = rows_of(&dir, "default");
    assert_eq!(rows.len(), 2);
    for key in [
        "actor/loss",
        "actor/behav_approx_kl",
        "eval/return",
        "eval/success_rate",
        "learner/global_step",
    ] {
        assert!(
            num(&rows[1], key).is_finite(),
            "{key} missing in {:?}",
            rows[1]
        );
    }
}
