//! Orchestrator end to end: real worker processes of the built binary, driven through `orchestrator::run`.

use std::num::NonZeroU32;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use rlsync::config::schema::{Deadline, FloatDtype, RunConfig, Seconds, SyncerKind, WeightDtype};
use rlsync::orchestrator::{
    self, Entry, OrchestratorError, RunOptions, RunSummary, ShutdownHandle, ShutdownSource,
};
use serde_json::Value;

use crate::util::{Tmp, bin, leftovers, processes_naming as processes_of, segment_prefix};

const REQUIRED_KEYS: &[&str] = &[
    "step",
    "time/step",
    "time/sync_weights",
    "time/rollout",
    "time/train",
    "sync/version",
    "sync/kind",
    "sync/bytes",
    "sync/changed",
    "sync/compression_ratio",
    "sync/verified",
    "actor/current_version",
    "actor/average_version",
    "rollout/data_staleness_0/ratio",
    "staleness/mean",
    "staleness/max",
    "rollout/discarded_unused_trajs",
    "trainer/idle_ratio",
    "rollout/idle_ratio",
    "throughput/env_steps_per_s",
];

fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).unwrap()
}

/// A small, fast synthetic run: 2 rollouts, 10 steps.
fn small_config() -> RunConfig {
    let mut cfg = RunConfig::default();
    cfg.actor.model.params = 1 << 16;
    cfg.actor.model.tensors = nz(8);
    cfg.actor.model.adam_lr = 1e-4;
    cfg.runner.max_steps = 10;
    cfg.runner.handshake_timeout_s = Seconds::from_secs(20);
    cfg.runner.shutdown_grace_s = Seconds::from_secs(1);
    // A stuck loop fails the test instead of hanging it.
    cfg.runner.step_timeout_s = Deadline::after(Seconds::from_secs(30));
    cfg.env.train.total_num_envs = nz(4);
    cfg.env.train.max_steps_per_rollout_epoch = nz(8);
    cfg.rollout.chunk_steps = nz(4);
    cfg
}

/// A learner executable that does not exist: runs of a build without libtorch must not find one that `make
/// build` left next to the test binary.
const NO_LEARNER: &str = "/nonexistent/rlsync-learner";

fn opts(shutdown: ShutdownSource) -> RunOptions {
    RunOptions {
        worker_exe: Some(bin()),
        learner_exe: Some(NO_LEARNER.into()),
        shutdown,
        print_summary: false,
        ..RunOptions::default()
    }
}

// The library's own error type, as `orchestrator::run` returns it.
#[allow(clippy::result_large_err)]
fn run_in(entry: Entry, cfg: &RunConfig, dir: &Path) -> Result<RunSummary, OrchestratorError> {
    orchestrator::run(
        entry,
        cfg,
        dir,
        opts(ShutdownSource::Manual(ShutdownHandle::new())),
    )
}

fn metrics(dir: &Path) -> Vec<serde_json::Map<String, Value>> {
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap_or_default();
    text.lines()
        .map(|l| match serde_json::from_str(l) {
            Ok(Value::Object(map)) => map,
            other => panic!("bad metrics line {l}: {other:?}"),
        })
        .collect()
}

/// No process, shared-memory segment or socket of the run is left.
fn assert_clean(dir: &Path) {
    assert!(
        segment_prefix(dir).is_some(),
        "the run wrote its launch file"
    );
    let left = leftovers(&[dir.to_owned()], Tmp::Shared(&std::env::temp_dir()));
    assert!(left.is_empty(), "the run left {left:?}");
}

fn check_embodied(kind: SyncerKind) {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = small_config();
    cfg.weight_syncer.kind = kind;
    let summary = run_in(Entry::Embodied, &cfg, dir.path()).unwrap();
    assert_eq!(summary.steps, 10);
    let rows = metrics(dir.path());
    assert_eq!(rows.len(), 10);
    let mut last_version = None;
    for row in &rows {
        for key in REQUIRED_KEYS {
            assert!(
                row.contains_key(*key),
                "{kind:?}: step {:?} lacks {key}",
                row.get("step")
            );
        }
        let version = row["sync/version"].as_i64().unwrap();
        assert!(
            last_version.is_none_or(|v| version > v),
            "versions must increase: {last_version:?} then {version}"
        );
        last_version = Some(version);
        assert_eq!(
            row["sync/verified"],
            Value::Bool(true),
            "step {:?} not verified",
            row["step"]
        );
    }
    // The sync's phases: the trainer's build, encode and wait on the transport, and the slowest rollout's
    // install, each within the step's sync time (the bootstrap's: `time/init_weights`) that holds them.
    for (i, row) in rows.iter().enumerate() {
        let t = |key: &str| {
            row.get(key)
                .and_then(Value::as_f64)
                .unwrap_or_else(|| panic!("{kind:?}: step {i} lacks {key}: {row:?}"))
        };
        let (build, encode, transfer, apply) = (
            t("time/sync_build"),
            t("time/sync_encode"),
            t("time/sync_transfer"),
            t("time/sync_apply_max"),
        );
        let whole = if i == 0 {
            t("time/init_weights")
        } else {
            t("time/sync_weights")
        };
        // A bucket's packing is its encoding; a patch builds.
        assert!(
            build >= 0.0 && encode >= 0.0 && build + encode > 0.0 && apply > 0.0,
            "{kind:?} step {i}: {row:?}"
        );
        if kind == SyncerKind::Patch && i > 0 {
            assert!(build > 0.0, "step {i}: {row:?}");
        }
        // The trainer's whole handling holds its phases and lies within the sync.
        let trainer = t("time/sync_trainer");
        assert!(
            build + encode + transfer <= trainer && trainer <= whole && apply <= whole,
            "{kind:?} step {i}: phases outside the sync's {whole} s: {row:?}"
        );
        // The slowest install's own phases (its receiver's wait, decode and write, the workload's load of
        // the weights, the checksum `runner.verify_sync` asks for) lie within it; an install of changes
        // writes.
        let install = ["wait", "decode", "write", "load", "checksum"]
            .map(|phase| t(&format!("time/sync_apply_{phase}")));
        let changed = row["sync/changed"].as_u64().unwrap();
        assert!(
            install.iter().all(|&s| s >= 0.0)
                && (changed == 0 || install[2] > 0.0)
                && install.iter().sum::<f64>() <= apply + 1e-9,
            "{kind:?} step {i}: install phases {install:?} outside its {apply} s: {row:?}"
        );
    }
    assert_eq!(rows[0]["sync/kind"], "init");
    // The bootstrap's time is its own key, not the first step's sync time.
    assert!(rows[0]["time/init_weights"].as_f64().unwrap() > 0.0);
    assert_eq!(rows[0]["time/sync_weights"].as_f64(), Some(0.0));
    // The summary: per-step syncs without the bootstrap, and each part of the run's time apart.
    assert_eq!((summary.syncs, summary.verified_syncs), (9, 9));
    let t = summary.times;
    assert!(
        t.startup_s > 0.0 && t.bootstrap_s > 0.0 && t.loop_s > 0.0,
        "{t:?}"
    );
    let parts = t.before_s + t.startup_s + t.bootstrap_s + t.loop_s + t.shutdown_s;
    assert!(t.wall_s >= parts && t.shutdown_s > 0.0, "{t:?}");
    assert_eq!(
        Some(summary.bootstrap_bytes),
        rows[0]["sync/bytes"].as_u64()
    );
    let per_step: Vec<f64> = rows[1..]
        .iter()
        .map(|r| r["time/sync_weights"].as_f64().unwrap() * 1e3)
        .collect();
    let max = per_step.iter().copied().fold(0.0, f64::max);
    assert!((summary.sync_ms_max - max).abs() < 1e-9, "{summary:?}");
    assert!(summary.sync_ms_p50 <= max && summary.sync_ms_mean <= max);
    let loop_rate = summary.env_steps as f64 / t.loop_s;
    assert!((summary.loop_env_steps_per_s - loop_rate).abs() < 1e-6 * loop_rate);
    let later = if kind == SyncerKind::Patch {
        "patch"
    } else {
        "bucket"
    };
    assert_eq!(rows[1]["sync/kind"], later);
    assert_eq!(rows[9]["actor/current_version"], 10);
    assert!(
        dir.path().join("logs/trainer-0.log").exists()
            && dir.path().join("logs/rollout-1.log").exists()
    );
    let tb: Vec<_> = std::fs::read_dir(dir.path().join("tensorboard"))
        .unwrap()
        .flatten()
        .collect();
    assert_eq!(tb.len(), 1, "one tensorboard event file");
    assert_clean(dir.path());
}

#[test]
fn embodied_patch_runs_verified_with_every_key() {
    check_embodied(SyncerKind::Patch);
}

#[test]
fn embodied_bucket_runs_verified_with_every_key() {
    check_embodied(SyncerKind::Bucket);
}

/// An fp32 trainer and bf16 rollouts (`rollout.model.precision`), every floating tensor sent as fp16
/// (`bucket_dtype`) or cast on the way by the patch syncer: each version verified, the bootstrap's too (the
/// bucket syncer sends nothing at init: its version 0 is the rollouts' own weights, the state as cast to
/// their dtype).
#[test]
fn mixed_precision_runs_verify_every_version() {
    for (kind, wire) in [
        (SyncerKind::Bucket, Some(FloatDtype::Float16)),
        (SyncerKind::Bucket, None),
        (SyncerKind::Patch, None),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = small_config();
        cfg.runner.max_steps = 4;
        cfg.actor.model.precision = WeightDtype::F32;
        cfg.rollout.model.precision = WeightDtype::Bf16;
        cfg.weight_syncer.kind = kind;
        cfg.weight_syncer.bucket.bucket_dtype = wire;
        let summary = run_in(Entry::Embodied, &cfg, dir.path())
            .unwrap_or_else(|e| panic!("{kind:?} {wire:?}: {}", rlsync_core::error_chain(&e)));
        assert_eq!(
            (summary.syncs, summary.verified_syncs),
            (3, 3),
            "{kind:?} {wire:?}"
        );
        let rows = metrics(dir.path());
        assert!(
            rows.iter().all(|r| r["sync/verified"] == Value::Bool(true)),
            "{kind:?} {wire:?}"
        );
        // The rollouts hold bf16: 2 bytes per element on the wire after the bootstrap (fp16 or bf16).
        let state = rows[1]["sync/state_bytes"].as_u64().unwrap();
        assert_eq!(state, 2 * (1 << 16), "{kind:?} {wire:?}");
    }
}

fn check_async(no_wait: bool) {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = small_config();
    cfg.algorithm.staleness_threshold = 1;
    cfg.actor.sync_weight_no_wait = no_wait;
    cfg.actor.model.rollout_ms_per_step = 1.0;
    cfg.actor.model.train_ms = 10.0;
    cfg.runner.max_steps = 12;
    let summary = run_in(Entry::Async, &cfg, dir.path()).unwrap();
    assert_eq!(summary.steps, 12);
    let rows = metrics(dir.path());
    assert_eq!(rows.len(), 12);
    let patched = rows
        .iter()
        .filter(|r| r.get("sync/kind").and_then(Value::as_str) == Some("patch"))
        .count();
    assert!(
        patched >= 6,
        "no_wait={no_wait}: {patched} rows synced a patch"
    );
    for row in &rows {
        let max = row["staleness/max"].as_i64().unwrap();
        assert!(
            max <= 1,
            "no_wait={no_wait}: step {} trained on lag {max}",
            row["step"]
        );
        assert!(row.contains_key("rollout/discarded_unused_trajs"));
        // A step's sync holds the trainer's phases of it (in the background too: its Synced ends it).
        if row.get("sync/kind").and_then(Value::as_str) == Some("patch") {
            let t = |key: &str| row[key].as_f64().unwrap();
            let phases = t("time/sync_build") + t("time/sync_encode") + t("time/sync_transfer");
            assert!(
                t("time/sync_build") > 0.0
                    && phases <= t("time/sync_trainer")
                    && t("time/sync_trainer") <= t("time/sync_weights"),
                "no_wait={no_wait}: {row:?}"
            );
            // A blocking sync waited for its installs and has the slowest; a background one waited for
            // none (its installs land in later rows' `time/apply_max`).
            let apply = row.get("time/sync_apply_max").and_then(Value::as_f64);
            if no_wait {
                assert_eq!(apply, None, "{row:?}");
                assert!(!row.contains_key("time/sync_apply_write"), "{row:?}");
            } else {
                assert!(
                    apply.is_some_and(|a| a > 0.0 && a <= t("time/sync_weights")),
                    "{row:?}"
                );
            }
        }
        for key in REQUIRED_KEYS {
            assert!(
                row.contains_key(*key),
                "step {:?} lacks {key}",
                row.get("step")
            );
        }
        for (key, value) in row {
            if let Some(lag) = key
                .strip_prefix("rollout/data_staleness_")
                .and_then(|k| k.strip_suffix("/ratio"))
                && lag.parse::<u32>().unwrap() > 1
            {
                assert_eq!(value.as_f64(), Some(0.0), "{key}");
            }
        }
    }
    assert_eq!(
        summary.discarded,
        rows.iter()
            .map(|r| r["rollout/discarded_unused_trajs"].as_u64().unwrap())
            .sum::<u64>()
    );
    assert_eq!(rows[11]["actor/current_version"], 12);
    // Every install is reported in some row, a background one too.
    let reported = rows
        .iter()
        .filter(|r| {
            r.get("time/apply_max")
                .is_some_and(|a| a.as_f64() > Some(0.0))
        })
        .count();
    assert!(reported >= 3, "no_wait={no_wait}: {reported} rows");
    assert_clean(dir.path());
}

#[test]
fn async_no_wait_respects_staleness_threshold() {
    check_async(true);
}

#[test]
fn async_blocking_respects_staleness_threshold() {
    check_async(false);
}

/// Start a long run on a thread; returns the result channel.
fn start_long_run(
    dir: &Path,
    handle: ShutdownHandle,
) -> mpsc::Receiver<Result<RunSummary, OrchestratorError>> {
    let mut cfg = small_config();
    cfg.runner.max_steps = 100_000;
    cfg.actor.model.rollout_ms_per_step = 2.0;
    let (tx, rx) = mpsc::channel();
    let run_dir = dir.to_owned();
    std::thread::spawn(move || {
        let _ = tx.send(orchestrator::run(
            Entry::Embodied,
            &cfg,
            &run_dir,
            opts(ShutdownSource::Manual(handle)),
        ));
    });
    // Mid-run: a few steps are done.
    let deadline = Instant::now() + Duration::from_secs(60);
    while metrics(dir).len() < 3 {
        assert!(Instant::now() < deadline, "run did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    rx
}

#[test]
fn killed_rollout_fails_the_run_naming_it_and_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let rx = start_long_run(dir.path(), ShutdownHandle::new());
    let victim = processes_of(dir.path())
        .into_iter()
        .find(|(_, cmd)| cmd.contains("--role rollout --rank 1 "))
        .expect("rollout-1 is running");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(victim.0 as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let result = rx
        .recv_timeout(Duration::from_secs(5))
        .expect("the orchestrator must stop within 5 s");
    let err = result.unwrap_err().to_string();
    assert!(
        err.contains("rollout-1") && err.contains("SIGKILL"),
        "error should name rollout-1 and SIGKILL: {err}"
    );
    assert_clean(dir.path());
}

#[test]
fn shutdown_request_stops_the_run_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let handle = ShutdownHandle::new();
    let rx = start_long_run(dir.path(), handle.clone());
    handle.request();
    let result = rx
        .recv_timeout(Duration::from_secs(5))
        .expect("the orchestrator must stop within 5 s");
    assert!(
        matches!(result, Err(OrchestratorError::Interrupted { .. })),
        "{result:?}"
    );
    let rows = metrics(dir.path()).len() as u64;
    assert!(rows > 0, "metrics of finished steps are kept");
    // The interrupt leaves a checkpoint of what the trainer held (the step in progress may have finished).
    let saved = rlsync::checkpoint::latest_checkpoint(dir.path())
        .expect("a checkpoint after the interrupt");
    let info = rlsync::checkpoint::read_info(&saved).unwrap();
    assert!(
        info.global_step == rows || info.global_step == rows + 1,
        "checkpoint at step {} after {rows} recorded steps",
        info.global_step
    );
    assert_eq!(info.version, info.global_step, "one version per step");
    assert_clean(dir.path());
}

/// The TFRecord payloads of a TensorBoard event file.
fn event_records(path: &Path) -> Vec<Vec<u8>> {
    let bytes = std::fs::read(path).unwrap();
    let mut out = Vec::new();
    let mut at = 0;
    while at + 12 <= bytes.len() {
        let len = u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()) as usize;
        out.push(bytes[at + 12..at + 12 + len].to_vec());
        at += 12 + len + 4;
    }
    out
}

#[test]
fn a_resumed_run_continues_steps_versions_metrics_and_tensorboard() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = small_config();
    cfg.runner.max_steps = 4;
    cfg.runner.save_interval = 2;
    let first = run_in(Entry::Embodied, &cfg, dir.path()).unwrap();
    let ckpt = |step: u64| rlsync::checkpoint::checkpoint_dir(dir.path(), step);
    let saved: Vec<bool> = (1..=4).map(|s| ckpt(s).is_dir()).collect();
    assert_eq!(saved, [false, true, false, true]);
    assert_eq!(
        first.checkpoint,
        Some(std::fs::canonicalize(ckpt(4)).unwrap())
    );

    // Resume in place from step 2 with a total of 6: steps 2..=5, appended to the same files.
    cfg.runner.max_steps = 6;
    cfg.runner.resume_dir = Some(ckpt(2));
    let second = run_in(Entry::Embodied, &cfg, dir.path()).unwrap();
    assert_eq!(second.steps, 4);
    let rows = metrics(dir.path());
    let steps: Vec<u64> = rows.iter().map(|r| r["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, [0, 1, 2, 3, 2, 3, 4, 5], "appended, never truncated");
    let versions: Vec<i64> = rows[4..]
        .iter()
        .map(|r| r["actor/current_version"].as_i64().unwrap())
        .collect();
    assert_eq!(
        versions,
        [3, 4, 5, 6],
        "versions continue from the checkpoint's 2"
    );
    assert_eq!(rows[4]["sync/kind"], "init");
    assert_eq!(
        rows[4]["actor/average_version"], 2.0,
        "acted with the checkpoint's weights"
    );
    assert_eq!(rows[5]["sync/version"], 3);
    assert!(
        rows[4..].iter().all(|r| r["sync/verified"] == true),
        "{rows:?}"
    );
    assert_eq!(
        second.checkpoint,
        Some(std::fs::canonicalize(ckpt(6)).unwrap())
    );
    // The resumed weights are the checkpoint's: its step-6 checkpoint holds version 6.
    assert_eq!(rlsync::checkpoint::read_info(&ckpt(6)).unwrap().version, 6);

    // TensorBoard: a second event file whose first events are the file version and a session start at step
    // 2, so TensorBoard drops the first run's points from step 2 on (no out-of-order steps).
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir.path().join("tensorboard"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    files.sort();
    assert_eq!(files.len(), 2, "{files:?}");
    let records = event_records(&files[1]);
    assert_eq!(
        &records[1][9..],
        [0x10, 2, 0x3A, 2, 0x08, 0x01],
        "session start at step 2"
    );
    assert_eq!(records.len(), 2 + 4, "one event per resumed step");

    // Resuming at the total is an error naming both numbers; nothing starts.
    cfg.runner.resume_dir = Some(ckpt(6));
    let err = run_in(Entry::Embodied, &cfg, dir.path())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("step 6") && err.contains("max_steps=6"),
        "{err}"
    );
    assert_eq!(metrics(dir.path()).len(), 8);
}

#[test]
fn a_resumed_async_run_continues_steps_and_versions() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = small_config();
    cfg.runner.max_steps = 3;
    cfg.actor.sync_weight_no_wait = true;
    let first = run_in(Entry::Async, &cfg, dir.path()).unwrap();
    let ckpt = rlsync::checkpoint::checkpoint_dir(dir.path(), 3);
    assert_eq!(
        first.checkpoint,
        Some(std::fs::canonicalize(&ckpt).unwrap())
    );
    cfg.runner.max_steps = 5;
    cfg.runner.resume_dir = Some(ckpt);
    run_in(Entry::Async, &cfg, dir.path()).unwrap();
    let rows = metrics(dir.path());
    let steps: Vec<u64> = rows.iter().map(|r| r["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, [0, 1, 2, 3, 4]);
    let versions: Vec<i64> = rows
        .iter()
        .map(|r| r["actor/current_version"].as_i64().unwrap())
        .collect();
    assert_eq!(versions, [1, 2, 3, 4, 5]);
    for r in &rows[3..] {
        let avg = r["actor/average_version"].as_f64().unwrap();
        assert!(avg >= 3.0, "resumed chunks come from version 3 on: {r:?}");
    }
    assert!(rlsync::checkpoint::checkpoint_dir(dir.path(), 5).is_dir());
}

#[test]
fn worker_without_handshake_times_out_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    // A worker binary whose rollout-1 never connects (but keeps running until killed).
    let script = dir.path().join("fake-rlsync");
    std::fs::write(
        &script,
        format!("#!/bin/sh\ncase \"$*\" in *'--role rollout --rank 1 '*) exec sh -c 'sleep 60' sh \"$@\";; esac\nexec {} \"$@\"\n", bin().display()),
    )
    .unwrap();
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let mut cfg = small_config();
    // Long enough for the other workers to start on a loaded machine (a torch build loads libtorch first), so
    // only the silent one is named.
    cfg.runner.handshake_timeout_s = Seconds::from_secs(5);
    let run_dir = dir.path().join("run");
    let opts = RunOptions {
        worker_exe: Some(script),
        learner_exe: None,
        shutdown: ShutdownSource::Manual(ShutdownHandle::new()),
        print_summary: false,
        ..RunOptions::default()
    };
    let err = orchestrator::run(Entry::Embodied, &cfg, &run_dir, opts).unwrap_err();
    assert!(
        matches!(&err, OrchestratorError::HandshakeTimeout { workers, .. } if workers == "rollout-1"),
        "{err}"
    );
    assert!(err.to_string().contains("handshake"));
    assert_clean(&run_dir);
}

#[test]
fn second_shutdown_request_kills_at_once_and_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let handle = ShutdownHandle::new();
    let rx = start_long_run(dir.path(), handle.clone());
    handle.request();
    handle.request();
    let result = rx
        .recv_timeout(Duration::from_secs(5))
        .expect("the orchestrator must stop within 5 s");
    assert!(
        matches!(result, Err(OrchestratorError::Interrupted { .. })),
        "{result:?}"
    );
    assert_clean(dir.path());
}

#[test]
fn missed_step_deadline_fails_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = small_config();
    cfg.actor.model.train_ms = 5_000.0;
    cfg.runner.step_timeout_s = Deadline::after(Seconds::from_secs_f64(0.5).unwrap());
    let err = run_in(Entry::Embodied, &cfg, dir.path()).unwrap_err();
    assert!(
        matches!(&err, OrchestratorError::StepTimeout { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("the trainer's step"), "{err}");
    assert_clean(dir.path());
}

#[test]
fn failing_workload_is_reported_with_its_reason() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = small_config();
    // A synthetic model that cannot be built (no trainable part): the worker exits and its own reason is
    // reported. Trainer and rollouts build the same workload; whichever fails first is named.
    cfg.actor.model.frozen_fraction = 1.0;
    let err = run_in(Entry::Embodied, &cfg, dir.path())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("worker ") && err.contains("exited with status 1"),
        "{err}"
    );
    // The worker's own report (its error chain on one line) or its log's `Error: … caused by: …` lines.
    assert!(
        err.contains("workload")
            && err.contains("invalid synthetic model: frozen_fraction 1 is not in [0, 1)"),
        "{err}"
    );
    assert!(err.contains("last lines of"), "{err}");
    assert_clean(dir.path());
}

#[test]
fn a_learner_model_without_libtorch_fails_before_any_worker_starts() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = small_config();
    cfg.actor.model.model_type = rlsync::config::schema::ModelType::MlpPolicy;
    let err = run_in(Entry::Embodied, &cfg, dir.path()).unwrap_err();
    assert!(matches!(&err, OrchestratorError::NoLearner { .. }), "{err}");
    let text = rlsync_core::error_chain(&err);
    assert!(
        text.contains("model `mlp_policy` needs the libtorch learner"),
        "{text}"
    );
    assert!(
        text.contains(
            "model@actor.model=synthetic_small env@env.train=synthetic env@env.eval=synthetic"
        ),
        "{text}"
    );
    assert!(text.contains(NO_LEARNER), "names where it looked: {text}");
    assert!(!dir.path().join("logs").exists(), "no worker was started");

    // The embedded default (reach with mlp_policy) from the command line: one error, said once.
    let run_dir = format!("hydra.run.dir={}", dir.path().join("cli").display());
    let out = std::process::Command::new(bin())
        .args(["train_embodied", run_dir.as_str()])
        .env("RLSYNC_LEARNER", dir.path().join("no-learner"))
        .output()
        .expect("start rlsync");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(
        stderr.matches("needs the libtorch learner").count(),
        1,
        "{stderr}"
    );
    assert!(
        stderr.contains("model `mlp_policy`") && stderr.contains("env@env.train=synthetic"),
        "{stderr}"
    );

    // The dry run refuses it too, and passes once a learner executable is there.
    let dry_run = |learner: &Path| {
        std::process::Command::new(bin())
            .args(["train_embodied", "--dry-run", run_dir.as_str()])
            .env("RLSYNC_LEARNER", learner)
            .output()
            .expect("start rlsync")
    };
    let out = dry_run(&dir.path().join("no-learner"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(stdout.contains("needs the libtorch learner"), "{stdout}");
    let out = dry_run(&bin());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
}

/// A build without libtorch starts learner workers from the learner executable (here a script that records
/// its arguments and runs this plain binary, whose workers then fail for want of libtorch), and synthetic
/// workers from itself.
#[test]
fn learner_workers_start_from_the_learner_executable() {
    let dir = tempfile::tempdir().unwrap();
    let record = dir.path().join("learner-calls");
    let learner = dir.path().join("rlsync-learner");
    std::fs::write(
        &learner,
        format!(
            "#!/bin/sh\necho \"$@\" >> '{}'\nexec '{}' \"$@\"\n",
            record.display(),
            bin().display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(
        &learner,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let mut cfg = small_config();
    cfg.actor.model.model_type = rlsync::config::schema::ModelType::MlpPolicy;
    let opts = || RunOptions {
        worker_exe: Some(bin()),
        learner_exe: Some(learner.clone()),
        shutdown: ShutdownSource::Manual(ShutdownHandle::new()),
        print_summary: false,
        ..RunOptions::default()
    };
    // The workers fail (this plain binary has no learner; the synthetic env is no learner task either).
    orchestrator::run(Entry::Embodied, &cfg, &dir.path().join("learn"), opts()).unwrap_err();
    let calls = std::fs::read_to_string(&record).unwrap_or_default();
    assert!(
        calls.contains("worker --role"),
        "the learner ran the workers: {calls:?}"
    );

    std::fs::remove_file(&record).unwrap();
    orchestrator::run(
        Entry::Embodied,
        &small_config(),
        &dir.path().join("synth"),
        opts(),
    )
    .unwrap();
    assert!(
        !record.exists(),
        "synthetic workers start from rlsync itself"
    );
}

#[test]
fn sigterm_to_the_orchestrator_process_stops_everything() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let mut child = std::process::Command::new(bin())
        .args([
            "train_embodied",
            "model@actor.model=synthetic_small",
            "env@env.train=synthetic",
            "env@env.eval=synthetic",
            &format!("hydra.run.dir={}", run_dir.display()),
            "runner.max_steps=100000",
            "runner.shutdown_grace_s=1.0",
            "actor.model.params=65536",
            "actor.model.tensors=8",
            "actor.model.rollout_ms_per_step=2.0",
            "env.train.total_num_envs=4",
            "env.train.max_steps_per_rollout_epoch=8",
            "rollout.chunk_steps=4",
        ])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start rlsync");
    let deadline = Instant::now() + Duration::from_secs(60);
    while metrics(&run_dir).len() < 3 {
        if Instant::now() > deadline || child.try_wait().ok().flatten().is_some() {
            let _ = child.kill();
            panic!(
                "run did not start: {:?}",
                child
                    .wait_with_output()
                    .map(|o| String::from_utf8_lossy(&o.stderr).into_owned())
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let stopped = Instant::now() + Duration::from_secs(5);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > stopped {
            let _ = child.kill();
            panic!("the orchestrator did not exit within 5 s of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stderr = child
        .wait_with_output()
        .map(|o| String::from_utf8_lossy(&o.stderr).into_owned())
        .unwrap_or_default();
    assert!(!status.success(), "an interrupted run exits non-zero");
    assert!(
        stderr.contains("SIGTERM"),
        "the error names the signal: {stderr}"
    );
    assert_clean(&run_dir);
}

#[test]
fn val_check_interval_evaluates_on_the_rollouts_with_the_trained_version() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = small_config();
    cfg.runner.max_steps = 5;
    cfg.runner.val_check_interval = 2;
    run_in(Entry::Embodied, &cfg, dir.path()).unwrap();
    let rows = metrics(dir.path());
    let evals: Vec<(u64, i64)> = rows
        .iter()
        .filter_map(|r| Some((r["step"].as_u64()?, r.get("eval/version")?.as_i64()?)))
        .collect();
    // After 2, 4 and 5 (the end) steps, each time the version just trained.
    assert_eq!(evals, [(1, 2), (3, 4), (4, 5)]);
    assert!(
        rows.iter()
            .all(|r| r.get("eval/version").is_none() || r["eval/episodes"] == 0)
    );
    // The sync an evaluation needed delivers the next step's weights: every step after the first still
    // records the sync its rollouts used, verified.
    let synced: Vec<i64> = rows[1..]
        .iter()
        .map(|r| r["sync/version"].as_i64().unwrap_or(-1))
        .collect();
    assert_eq!(synced, [1, 2, 3, 4]);
    assert!(rows.iter().all(|r| r["sync/verified"] == true));
    // Each row's slowest install is its own sync's, the syncs an evaluation made included (their installs
    // come during the evaluation, a row before the row that carries the sync).
    for row in &rows {
        let apply = row.get("time/sync_apply_max").and_then(Value::as_f64);
        let whole = row["time/sync_weights"].as_f64().unwrap();
        let whole = if whole > 0.0 {
            whole
        } else {
            row["time/init_weights"].as_f64().unwrap()
        };
        assert!(
            apply.is_some_and(|a| a > 0.0 && a <= whole),
            "{apply:?} outside the sync's {whole} s: {row:?}"
        );
    }
}
