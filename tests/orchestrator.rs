//! Orchestrator end to end: real worker processes of the built binary, driven through `orchestrator::run`.

use std::num::NonZeroU32;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use rlsync::config::schema::{Deadline, RunConfig, Seconds, SyncerKind};
use rlsync::orchestrator::{
    self, Entry, OrchestratorError, RunOptions, RunSummary, ShutdownHandle, ShutdownSource,
};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_rlsync");

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

fn opts(shutdown: ShutdownSource) -> RunOptions {
    RunOptions {
        worker_exe: Some(BIN.into()),
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

fn segment_prefix(dir: &Path) -> String {
    let launch: Value =
        serde_json::from_slice(&std::fs::read(dir.join(".rlsync/launch.json")).unwrap()).unwrap();
    launch["segment_prefix"].as_str().unwrap().to_owned()
}

/// Processes whose command line mentions `dir` (every worker of the run does, via --run-dir).
fn processes_of(dir: &Path) -> Vec<(u32, String)> {
    let needle = dir.to_string_lossy().into_owned();
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(raw) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&raw).replace('\0', " ");
        if cmdline.contains(&needle) && pid != std::process::id() {
            found.push((pid, cmdline));
        }
    }
    found
}

/// No process, shared-memory segment or socket of the run is left.
fn assert_clean(dir: &Path) {
    let prefix = segment_prefix(dir);
    // Reaping is done before `run` returns; give the kernel a moment to drop /proc entries of zombies' parents.
    let deadline = Instant::now() + Duration::from_secs(2);
    while !processes_of(dir).is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(processes_of(dir), vec![], "processes of the run remain");
    let leftovers = |d: &Path| -> Vec<PathBuf> {
        std::fs::read_dir(d)
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.path())
                    .filter(|p| p.to_string_lossy().contains(&prefix))
                    .collect()
            })
            .unwrap_or_default()
    };
    assert_eq!(
        leftovers(Path::new("/dev/shm")),
        Vec::<PathBuf>::new(),
        "shm segments remain"
    );
    assert_eq!(
        leftovers(&std::env::temp_dir()),
        Vec::<PathBuf>::new(),
        "sockets remain"
    );
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
    assert_eq!(rows[0]["sync/kind"], "init");
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
    for row in &rows {
        let max = row["staleness/max"].as_i64().unwrap();
        assert!(
            max <= 1,
            "no_wait={no_wait}: step {} trained on lag {max}",
            row["step"]
        );
        assert!(row.contains_key("rollout/discarded_unused_trajs"));
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
    assert!(
        !metrics(dir.path()).is_empty(),
        "metrics of finished steps are kept"
    );
    assert_clean(dir.path());
}

#[test]
fn worker_without_handshake_times_out_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    // A worker binary whose rollout-1 never connects (but keeps running until killed).
    let script = dir.path().join("fake-rlsync");
    std::fs::write(
        &script,
        format!("#!/bin/sh\ncase \"$*\" in *'--role rollout --rank 1 '*) exec sh -c 'sleep 60' sh \"$@\";; esac\nexec {BIN} \"$@\"\n"),
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

#[cfg(not(feature = "torch"))]
#[test]
fn a_learner_model_without_libtorch_fails_before_any_worker_starts() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = small_config();
    cfg.actor.model.model_type = rlsync::config::schema::ModelType::MlpPolicy;
    let err = run_in(Entry::Embodied, &cfg, dir.path()).unwrap_err();
    assert!(matches!(&err, OrchestratorError::Config { .. }), "{err}");
    let text = err.to_string();
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
    assert!(!dir.path().join("logs").exists(), "no worker was started");

    // The embedded default (reach with mlp_policy) from the command line: one error, said once.
    let run_dir = format!("hydra.run.dir={}", dir.path().join("cli").display());
    let out = std::process::Command::new(BIN)
        .args(["train_embodied", run_dir.as_str()])
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
}

#[test]
fn sigterm_to_the_orchestrator_process_stops_everything() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let mut child = std::process::Command::new(BIN)
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
