//! The host-shared receiver mode (`weight_syncer.host_shared=true`, issue 26) end to end: embodied and async
//! runs of the built binary's workers verify every version every rollout reports against the trainer's, killed
//! readers and appliers are restarted (re-attach; rejoin) while the others keep going, and no arena is left in
//! /dev/shm after a success or a failure.

use std::num::NonZeroU32;
use std::path::Path;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use rlsync::config::schema::{Deadline, Placement, RunConfig, Seconds, SyncerKind};
use rlsync::orchestrator::{
    self, Entry, OrchestratorError, RunOptions, RunSummary, ShutdownHandle, ShutdownSource,
};
use serde_json::Value;

use crate::util::{Tmp, bin, leftovers, metrics_of, processes_naming, segment_prefix};

fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).unwrap()
}

/// A small synthetic run in the host-shared mode: `rollouts` rollouts, `steps` steps, every sync verified.
fn config(kind: SyncerKind, rollouts: u32, steps: i64) -> RunConfig {
    let mut cfg = RunConfig::default();
    cfg.weight_syncer.kind = kind;
    cfg.weight_syncer.host_shared = true;
    cfg.actor.model.params = 1 << 16;
    cfg.actor.model.tensors = nz(8);
    cfg.actor.model.adam_lr = 1e-4;
    cfg.runner.max_steps = steps;
    cfg.runner.verify_sync = true;
    cfg.runner.handshake_timeout_s = Seconds::from_secs(30);
    cfg.runner.shutdown_grace_s = Seconds::from_secs(1);
    cfg.runner.step_timeout_s = Deadline::after(Seconds::from_secs(30));
    cfg.runner.rollout_restart_backoff_s = Seconds::from_secs_f64(0.05).unwrap();
    cfg.cluster.component_placement.insert(
        "rollout".into(),
        if rollouts == 1 {
            Placement::Single(0)
        } else {
            Placement::Ranges(format!("0-{}", rollouts - 1))
        },
    );
    cfg.env.train.total_num_envs = nz(2 * rollouts);
    cfg.env.eval.total_num_envs = nz(2 * rollouts);
    cfg.env.train.max_steps_per_rollout_epoch = nz(8);
    cfg.rollout.chunk_steps = nz(4);
    cfg
}

fn opts(handle: ShutdownHandle) -> RunOptions {
    RunOptions {
        worker_exe: Some(bin()),
        learner_exe: Some("/nonexistent/rlsync-learner".into()),
        shutdown: ShutdownSource::Manual(handle),
        print_summary: false,
        ..RunOptions::default()
    }
}

// The library's own error type, as `orchestrator::run` returns it.
#[allow(clippy::result_large_err)]
fn run_in(entry: Entry, cfg: &RunConfig, dir: &Path) -> Result<RunSummary, OrchestratorError> {
    orchestrator::run(entry, cfg, dir, opts(ShutdownHandle::new()))
}

/// Nothing of the run is left: no process, socket, segment — and no arena (`<tag>.arena.<node>`).
fn assert_clean(dir: &Path) {
    let tag = segment_prefix(dir).expect("the run wrote its launch file");
    let left = leftovers(&[dir.to_owned()], Tmp::Shared(&std::env::temp_dir()));
    assert!(left.is_empty(), "the run left {left:?}");
    assert!(
        !Path::new("/dev/shm")
            .join(format!("{tag}.arena.0"))
            .exists(),
        "the arena is unlinked"
    );
}

/// The launch file's host-shared entry: (arena, applier).
fn launch_host_shared(dir: &Path) -> Option<(String, u64)> {
    let bytes = std::fs::read(dir.join(".rlsync/launch.json")).ok()?;
    let v: Value = serde_json::from_slice(&bytes).ok()?;
    let hs = &v["host_shared"];
    Some((hs["arena"].as_str()?.to_owned(), hs["applier"].as_u64()?))
}

/// Every step's sync verified: each rollout's checksum (the arena buffer it holds) equals the trainer's.
fn assert_verified(dir: &Path, steps: usize) {
    let rows = metrics_of(dir);
    assert_eq!(rows.len(), steps);
    for row in &rows {
        assert_eq!(
            row.get("sync/verified"),
            Some(&Value::Bool(true)),
            "step {:?} not verified",
            row.get("step")
        );
    }
}

/// Every row with a slowest install says where its time went, whether the applier or a reader (whose install
/// is its wait for the applier's publish: nothing decoded or written) was the slowest.
fn assert_install_phases(dir: &Path) {
    let rows = metrics_of(dir);
    let timed: Vec<_> = rows
        .iter()
        .filter(|r| r.contains_key("time/sync_apply_max"))
        .collect();
    assert!(!timed.is_empty(), "no row has a slowest install: {rows:?}");
    for row in timed {
        for key in [
            "time/sync_apply_wait",
            "time/sync_apply_decode",
            "time/sync_apply_write",
        ] {
            let phase = row.get(key).and_then(Value::as_f64);
            let max = row["time/sync_apply_max"].as_f64().unwrap();
            assert!(
                phase.is_some_and(|s| (0.0..=max).contains(&s)),
                "{key} of step {:?}: {phase:?} (slowest install {max} s)",
                row.get("step")
            );
        }
        assert!(!row.contains_key("time/sync_apply_load"), "{row:?}");
    }
}

fn check_run(entry: Entry, kind: SyncerKind, rollouts: u32, no_wait: bool) {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(kind, rollouts, 8);
    cfg.actor.sync_weight_no_wait = no_wait;
    cfg.algorithm.staleness_threshold = 1;
    let summary = run_in(entry, &cfg, dir.path()).unwrap();
    assert_eq!(summary.steps, 8);
    let (arena, applier) = launch_host_shared(dir.path()).expect("the launch file names the arena");
    let tag = segment_prefix(dir.path()).unwrap();
    assert_eq!((arena, applier), (format!("{tag}.arena.0"), 0));
    if entry == Entry::Embodied || !no_wait {
        assert_verified(dir.path(), 8);
        assert_eq!(summary.verified_syncs, summary.syncs, "{summary:?}");
        assert_install_phases(dir.path());
    }
    // The applier received for the host; the readers attached to its arena and never joined the channel.
    let log = |rank: u32| {
        std::fs::read_to_string(dir.path().join(format!("logs/rollout-{rank}.log"))).unwrap()
    };
    assert!(log(0).contains("into the host's arena"), "{}", log(0));
    // Each says how its workload acts on the held buffer: the synthetic one reads it in place.
    for rank in 0..rollouts {
        assert!(
            log(rank).contains("acts on the host's shared weights")
                && log(rank).contains("in place (no copy)"),
            "{}",
            log(rank)
        );
    }
    for rank in 1..rollouts {
        assert!(
            log(rank).contains("attached to the host's weights"),
            "{}",
            log(rank)
        );
    }
    assert_clean(dir.path());
}

#[test]
fn embodied_patch_three_rollouts_share_one_verified_copy() {
    check_run(Entry::Embodied, SyncerKind::Patch, 3, false);
}

#[test]
fn embodied_bucket_one_rollout_is_verified() {
    check_run(Entry::Embodied, SyncerKind::Bucket, 1, false);
}

#[test]
fn embodied_bucket_three_rollouts_share_one_verified_copy() {
    check_run(Entry::Embodied, SyncerKind::Bucket, 3, false);
}

#[test]
fn async_blocking_patch_three_rollouts_are_verified() {
    check_run(Entry::Async, SyncerKind::Patch, 3, false);
}

#[test]
fn async_no_wait_installs_in_the_background() {
    check_run(Entry::Async, SyncerKind::Patch, 3, true);
    check_run(Entry::Async, SyncerKind::Bucket, 1, true);
}

/// A long run on a thread, `kill` rollout killed with SIGKILL once it ran a few steps: the result and the
/// arena's name.
fn run_and_kill(
    cfg: RunConfig,
    kill: u32,
    dir: &Path,
) -> (Result<RunSummary, OrchestratorError>, String) {
    let (tx, rx) = mpsc::channel();
    let run_dir = dir.to_owned();
    let handle = ShutdownHandle::new();
    std::thread::spawn(move || {
        let _ = tx.send(orchestrator::run(
            Entry::Embodied,
            &cfg,
            &run_dir,
            opts(handle),
        ));
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    while metrics_of(dir).len() < 3 {
        assert!(Instant::now() < deadline, "the run did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (arena, _) = launch_host_shared(dir).unwrap();
    assert!(
        Path::new("/dev/shm").join(&arena).exists(),
        "the arena exists while the run does"
    );
    let victim = processes_naming(dir)
        .into_iter()
        .find(|(_, cmd)| cmd.contains(&format!("--role rollout --rank {kill} ")))
        .expect("the rollout runs");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(victim.0 as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let result = rx
        .recv_timeout(Duration::from_secs(120))
        .expect("the run ends");
    (result, arena)
}

#[test]
fn a_killed_reader_re_attaches_while_the_others_keep_going() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(SyncerKind::Patch, 3, 40);
    cfg.runner.rollout_restarts = 3;
    cfg.actor.model.rollout_ms_per_step = 2.0;
    let (result, _) = run_and_kill(cfg, 2, dir.path());
    let summary = result.unwrap();
    assert_eq!(summary.steps, 40);
    assert_verified(dir.path(), 40);
    let rows = metrics_of(dir.path());
    assert_eq!(rows.last().unwrap()["rollout/restarts"], 1);
    // A reader's successor attaches again: the trainer never catches it up.
    let trainer = std::fs::read_to_string(dir.path().join("logs/trainer-0.log")).unwrap();
    assert!(!trainer.contains("caught up rollout-2"), "{trainer}");
    assert!(
        rows.iter().all(|r| r.get("sync/catchup_bytes").is_none()),
        "no catch-up traffic for a reader"
    );
    assert_clean(dir.path());
}

#[test]
fn a_killed_applier_reopens_the_arena_and_rejoins() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(SyncerKind::Patch, 3, 40);
    cfg.runner.rollout_restarts = 3;
    cfg.actor.model.rollout_ms_per_step = 2.0;
    let (result, _) = run_and_kill(cfg, 0, dir.path());
    let summary = result.unwrap();
    assert_eq!(summary.steps, 40);
    assert_verified(dir.path(), 40);
    let trainer = std::fs::read_to_string(dir.path().join("logs/trainer-0.log")).unwrap();
    assert!(trainer.contains("caught up rollout-0"), "{trainer}");
    let log = std::fs::read_to_string(dir.path().join("logs/rollout-0.log")).unwrap();
    assert!(
        log.contains("rejoined the weight channel into the host's weights"),
        "{log}"
    );
    assert_clean(dir.path());
}

#[test]
fn a_failed_run_leaves_no_arena() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(SyncerKind::Patch, 2, 100_000);
    cfg.actor.model.rollout_ms_per_step = 2.0;
    let (result, arena) = run_and_kill(cfg, 1, dir.path());
    let err = result.unwrap_err().to_string();
    assert!(err.contains("rollout-1"), "{err}");
    assert!(!Path::new("/dev/shm").join(arena).exists());
    assert_clean(dir.path());
}

#[test]
fn dry_run_shows_the_mode_and_refuses_gpu_rollouts() {
    let dry = |extra: &[&str]| {
        let out = std::process::Command::new(bin())
            .args([
                "train_embodied",
                "--dry-run",
                "weight_syncer.host_shared=true",
            ])
            .args(extra)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, stdout, stderr) = dry(&[
        "cluster.component_placement.rollout=0-3",
        "model@actor.model=synthetic_small",
    ]);
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    assert!(stdout.contains("host_shared    on: "), "{stdout}");
    assert!(
        stdout.contains(
            "node 0: rollout-0 receives and applies; rollout-1, rollout-2, rollout-3 read it"
        ),
        "{stdout}"
    );
    assert!(
        stdout.contains("two shared buffers in /dev/shm, instead of"),
        "{stdout}"
    );
    let (code, stdout, stderr) = dry(&[
        "worker@actor.worker=python",
        "worker@rollout.worker=python",
        "actor.worker.entry=pkg.mod:Trainer",
        "rollout.worker.entry=pkg.mod:Rollout",
        "rollout.worker.device=cuda",
    ]);
    let text = format!("{stdout}\n{stderr}");
    assert_eq!(code, Some(1), "{text}");
    assert!(
        text.contains("weight_syncer.host_shared") && text.contains("rollout.worker.device=cuda"),
        "{text}"
    );
}

#[test]
fn over_several_nodes_each_node_has_its_applier_and_restarts_are_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let dry_run = |rollout: &str| {
        let out = std::process::Command::new(bin())
            .args([
                "train_embodied",
                "--dry-run",
                "weight_syncer.host_shared=true",
                "model@actor.model=synthetic_small",
                "env@env.train=synthetic",
                "env@env.eval=synthetic",
                "cluster.num_nodes=2",
                "cluster.slots_per_node=2",
                "cluster.component_placement.actor=0",
                "runner.rollout_restarts=1",
                "env.train.total_num_envs=12",
                "env.eval.total_num_envs=12",
            ])
            .arg(format!("cluster.component_placement.rollout='{rollout}'"))
            .arg(format!(
                "hydra.run.dir={}",
                dir.path().join("run").display()
            ))
            .env("RLSYNC_RUN_TOKEN", "t")
            .env("TMPDIR", dir.path())
            .env_remove("NODE_RANK")
            .env_remove("SLURM_PROCID")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        (out.status.success(), text)
    };
    // Node 0 holds rollout 0, node 1 rollouts 1 and 2: the appliers 0 and 1 are the chain's ranks.
    let (ok, text) = dry_run("1-3");
    assert!(ok, "{text}");
    assert!(
        text.contains("node 0: rollout-0 receives and applies\n")
            && text.contains("node 1: rollout-1 receives and applies; rollout-2 reads it"),
        "{text}"
    );
    // Node 0 holds rollouts 0 and 1: node 1's applier (rank 2) is the weight channel's receiver 1, and a
    // restarted one is caught up as that receiver.
    let (ok, text) = dry_run("0-3");
    assert!(ok, "{text}");
    assert!(
        text.contains("node 0: rollout-0 receives and applies; rollout-1 reads it")
            && text.contains("node 1: rollout-2 receives and applies; rollout-3 reads it"),
        "{text}"
    );
}

#[test]
fn an_interrupted_run_leaves_no_arena() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(SyncerKind::Patch, 2, 100_000);
    cfg.actor.model.rollout_ms_per_step = 2.0;
    let handle = ShutdownHandle::new();
    let (tx, rx) = mpsc::channel();
    let (run_dir, stop) = (dir.path().to_owned(), handle.clone());
    std::thread::spawn(move || {
        let _ = tx.send(orchestrator::run(
            Entry::Embodied,
            &cfg,
            &run_dir,
            opts(stop),
        ));
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    while metrics_of(dir.path()).len() < 3 {
        assert!(Instant::now() < deadline, "the run did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (arena, _) = launch_host_shared(dir.path()).unwrap();
    assert!(Path::new("/dev/shm").join(&arena).exists());
    handle.request();
    let result = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("the run stops");
    assert!(
        matches!(result, Err(OrchestratorError::Interrupted { .. })),
        "{result:?}"
    );
    assert!(!Path::new("/dev/shm").join(arena).exists());
    assert_clean(dir.path());
}
