//! Elastic rollouts (issue 13) against the real binary: rollout workers killed with SIGKILL at random moments
//! (bootstrap, sync, rollout) are restarted, rejoin the weight channel, catch up and the run finishes every
//! step with every sync verified and nothing left behind; without restarts, or past the restart budget, the run
//! fails naming the worker.
//!
//! `make test` runs one trial of each; the full campaign (20 trials, as issue 13 asks):
//! `RLSYNC_FAULT_TRIALS=20 cargo test --release --locked --test tests elastic:: -- --test-threads=1 --nocapture`

use std::process::{Child, Command};
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use rand::Rng as _;

use crate::util::{Scratch, finish, trials, wait_until, worker_pid, workers_of};

/// Steps of a run; kills land in its first half.
const STEPS: usize = 60;

/// `rlsync <entry>` in `s` on the small synthetic workload, two rollouts, with `extra` overrides.
fn command(s: &Scratch, entry: &str, extra: &[&str]) -> Command {
    let steps = format!("runner.max_steps={STEPS}");
    let mut args = vec![
        entry,
        "model@actor.model=synthetic_small",
        "env@env.train=synthetic",
        "env@env.eval=synthetic",
        "actor.model.params=65536",
        "actor.model.tensors=8",
        "actor.model.train_ms=10",
        "actor.model.rollout_ms_per_step=2",
        "env.train.total_num_envs=4",
        "env.train.max_steps_per_rollout_epoch=8",
        "rollout.chunk_steps=4",
        "runner.shutdown_grace_s=1",
        "runner.handshake_timeout_s=60",
        "runner.step_timeout_s=60",
        "runner.rollout_restart_backoff_s=0.05",
        &steps,
    ];
    args.extend_from_slice(extra);
    s.command(args)
}

/// The pid of the run's rollout `rank` now, if it runs.
fn rollout_pid(s: &Scratch, rank: u32) -> Option<i32> {
    worker_pid(&s.run_dir, "rollout", rank)
}

/// When a kill lands.
#[derive(Debug, Clone, Copy)]
enum Moment {
    /// Within moments of the worker's start: its handshake, the weight bootstrap.
    Bootstrap,
    /// At a random time after a random step (syncs and rollouts alternate every few milliseconds).
    Running,
}

/// SIGKILL rollout `rank` at `moment`; the pid killed, if a live rollout was.
fn kill_rollout(
    s: &Scratch,
    child: &mut Child,
    rank: u32,
    moment: Moment,
) -> Result<Option<i32>, String> {
    let mut rng = rand::thread_rng();
    match moment {
        Moment::Bootstrap => {
            wait_until(child, "the rollout's start", || {
                rollout_pid(s, rank).is_some()
            })?;
            std::thread::sleep(Duration::from_millis(rng.gen_range(0..250)));
        }
        Moment::Running => {
            let at = s.metrics().len() + rng.gen_range(1..STEPS / 4);
            wait_until(child, "the step to kill at", || s.metrics().len() >= at)?;
            std::thread::sleep(Duration::from_micros(rng.gen_range(0..30_000)));
        }
    }
    if s.metrics().len() >= STEPS / 2 {
        return Ok(None);
    }
    Ok(rollout_pid(s, rank).filter(|pid| kill(Pid::from_raw(*pid), Signal::SIGKILL).is_ok()))
}

/// The weight sync of a campaign: its overrides, and whether the workers hold their weights on the test
/// worker's simulated device (`RLSYNC_TEST_DEVICE`, `examples/held_worker/sim_device.rs`).
struct Sync<'a> {
    overrides: &'a [&'a str],
    device: bool,
}

/// The same-host GPU channel between the test worker's simulated devices, every sync verified.
const GPU_CHANNEL: Sync<'static> = Sync {
    overrides: &[
        "weight_syncer=patch_syncer",
        "weight_syncer.patch.transport_device=cuda",
        "weight_syncer.patch.snapshot_device=cuda",
        "runner.verify_sync=true",
    ],
    device: true,
};

/// One run of `entry` with `sync`, its rollouts killed at `moments`: it finishes every step, every sync it
/// reports is verified, its metrics count the restarts and nothing of it is left. Over the GPU channel, every
/// catch-up was a full copy over it.
fn survives(entry: &str, sync: &Sync<'_>, moments: &[Moment]) -> Result<(), String> {
    let s = Scratch::new("re");
    let mut extra = sync.overrides.to_vec();
    extra.push("runner.rollout_restarts=10");
    let mut cmd = command(&s, entry, &extra);
    if sync.device {
        cmd.env("RLSYNC_WORKER", crate::util::example("held_worker"))
            .env("RLSYNC_TEST_DEVICE", "1");
    }
    let mut child = cmd.spawn().map_err(|e| e.to_string())?;
    let mut kills = 0u64;
    let mut rng = rand::thread_rng();
    let mut kill_all = || -> Result<(), String> {
        for &moment in moments {
            let rank = rng.gen_range(0..2);
            if let Some(pid) = kill_rollout(&s, &mut child, rank, moment)? {
                kills += 1;
                // Its successor is up before the next kill (which would otherwise find no process to kill).
                wait_until(&mut child, "the restart", || {
                    rollout_pid(&s, rank).is_some_and(|p| p != pid)
                })?;
            }
        }
        Ok(())
    };
    let killed = kill_all();
    let (code, stderr) = finish(child)?;
    let what = format!("{entry} {:?} {moments:?} ({kills} kills)", sync.overrides);
    if let Err(why) = killed {
        return Err(format!("{what}: {why}; exit {code:?}:\n{stderr}"));
    }
    if code != Some(0) || stderr.contains("panicked") {
        return Err(format!("{what}: exit {code:?}:\n{stderr}"));
    }
    // One row per train step (train_async may add a row of its own for an evaluation that ended last).
    let rows: Vec<_> = s
        .metrics()
        .into_iter()
        .filter(|row| row.contains_key("train/loss"))
        .collect();
    if rows.len() != STEPS {
        return Err(format!("{what}: {} of {STEPS} steps", rows.len()));
    }
    let restarts = rows
        .last()
        .and_then(|m| m.get("rollout/restarts"))
        .and_then(|v| v.as_u64());
    if restarts != Some(kills) {
        return Err(format!(
            "{what}: rollout/restarts is {restarts:?}, {kills} rollouts were killed:\n{stderr}"
        ));
    }
    for row in &rows {
        if row.get("sync/verified").is_some_and(|v| v != true) {
            return Err(format!("{what}: an unverified sync: {row:?}"));
        }
    }
    let left = s.leftovers();
    if !left.is_empty() {
        return Err(format!("{what}: leftovers: {left:?}"));
    }
    if sync.device {
        let trainer = std::fs::read_to_string(s.run_dir.join("logs/trainer-0.log"))
            .map_err(|e| format!("{what}: the trainer's log: {e}"))?;
        let caught: Vec<&str> = trainer
            .lines()
            .filter(|l| l.contains("caught up rollout-"))
            .collect();
        if !trainer.contains("from now on: the same-host GPU channel")
            || caught
                .iter()
                .any(|l| !l.contains("over the same-host GPU channel"))
        {
            return Err(format!(
                "{what}: not every catch-up was over the GPU channel:\n{trainer}"
            ));
        }
        let restarted = stderr.matches("rejoined: caught up by full").count();
        if caught.len() != restarted {
            return Err(format!(
                "{what}: {} catch-ups in the trainer's log, {restarted} in the run's:\n{stderr}",
                caught.len()
            ));
        }
    }
    Ok(())
}

fn campaign(entry: &str, sync: &Sync<'_>) {
    let mut broke = Vec::new();
    let n = trials();
    for trial in 0..n {
        // Every trial kills during the bootstrap and while running; odd trials kill twice while running.
        let mut moments = vec![Moment::Bootstrap, Moment::Running];
        if trial % 2 == 1 {
            moments.push(Moment::Running);
        }
        if let Err(why) = survives(entry, sync, &moments) {
            broke.push(why);
        }
    }
    println!(
        "elastic {entry} {:?}: held {} / broke {}",
        sync.overrides,
        n - broke.len(),
        broke.len()
    );
    assert!(broke.is_empty(), "{}", broke.join("\n---\n"));
}

#[test]
fn embodied_patch_survives_killed_rollouts() {
    campaign(
        "train_embodied",
        &Sync {
            overrides: &["weight_syncer=patch_syncer"],
            device: false,
        },
    );
}

#[test]
fn embodied_bucket_survives_killed_rollouts() {
    campaign(
        "train_embodied",
        &Sync {
            overrides: &["weight_syncer=bucket_syncer"],
            device: false,
        },
    );
}

#[test]
fn async_patch_survives_killed_rollouts() {
    campaign(
        "train_async",
        &Sync {
            overrides: &["weight_syncer=patch_syncer"],
            device: false,
        },
    );
}

/// Restartable rollouts over the same-host GPU channel (on the test worker's simulated devices): a killed
/// rollout is dropped from the channel, its successor checked and given the frozen keys on the host channel,
/// then a full copy of the current version over the channel.
#[test]
fn embodied_gpu_channel_survives_killed_rollouts() {
    campaign("train_embodied", &GPU_CHANNEL);
}

/// As above, with no-wait installs in the background (`train_async`): the successor waits for the next
/// version on its thread at once, and a detached sync does not wait for its predecessor's ack.
#[test]
fn async_gpu_channel_survives_killed_rollouts() {
    let mut overrides = GPU_CHANNEL.overrides.to_vec();
    overrides.push("actor.sync_weight_no_wait=true");
    campaign(
        "train_async",
        &Sync {
            overrides: &overrides,
            device: true,
        },
    );
}

#[test]
fn async_bucket_survives_killed_rollouts() {
    campaign(
        "train_async",
        &Sync {
            overrides: &["weight_syncer=bucket_syncer"],
            device: false,
        },
    );
}

/// A restarted rollout catches up (replay when its weights are a logged base, else a full transfer), and what
/// it cost is in the metrics and the log.
#[test]
fn a_catch_up_is_measured() {
    let s = Scratch::new("re");
    let mut child = command(&s, "train_embodied", &["runner.rollout_restarts=1"])
        .spawn()
        .unwrap();
    assert!(
        kill_rollout(&s, &mut child, 1, Moment::Running)
            .unwrap()
            .is_some()
    );
    let (code, stderr) = finish(child).unwrap();
    assert_eq!(code, Some(0), "{stderr}");
    let rows = s.metrics();
    let caught: Vec<_> = rows
        .iter()
        .filter(|r| r.contains_key("sync/catchup_kind"))
        .collect();
    assert_eq!(caught.len(), 1, "one catch-up recorded");
    let row = caught[0];
    assert!(row["sync/catchup_bytes"].as_u64().unwrap() > 0, "{row:?}");
    assert!(row["sync/catchup_ms"].as_f64().unwrap() >= 0.0, "{row:?}");
    assert!(matches!(row["sync/catchup_kind"].as_u64(), Some(0 | 1)));
    assert!(
        stderr.contains("rollout-1 rejoined: caught up by"),
        "the log says what the rejoin cost:\n{stderr}"
    );
}

/// `runner.rollout_restarts=0` (the default): a killed rollout still fails the run at once, named.
#[test]
fn without_restarts_a_killed_rollout_fails_the_run() {
    let s = Scratch::new("re");
    let mut child = command(&s, "train_embodied", &[]).spawn().unwrap();
    let rank = rand::thread_rng().gen_range(0..2);
    wait_until(&mut child, "a step", || !s.metrics().is_empty()).unwrap();
    let pid = rollout_pid(&s, rank).unwrap();
    kill(Pid::from_raw(pid), Signal::SIGKILL).unwrap();
    let (code, stderr) = finish(child).unwrap();
    let want = format!("worker rollout-{rank} (pid {pid}) was killed by SIGKILL");
    assert!(
        code == Some(1) && stderr.contains(&want),
        "{code:?}\n{stderr}"
    );
    assert!(s.leftovers().is_empty(), "{:?}", s.leftovers());
}

/// A rollout that dies once more than `runner.rollout_restarts` allows fails the run naming it and the count.
#[test]
fn exceeding_the_restart_budget_names_the_rollout_and_the_count() {
    let s = Scratch::new("re");
    let mut child = command(&s, "train_embodied", &["runner.rollout_restarts=1"])
        .arg("runner.max_steps=100000")
        .spawn()
        .unwrap();
    wait_until(&mut child, "a step", || !s.metrics().is_empty()).unwrap();
    let first = rollout_pid(&s, 1).unwrap();
    kill(Pid::from_raw(first), Signal::SIGKILL).unwrap();
    wait_until(&mut child, "the restart", || {
        rollout_pid(&s, 1).is_some_and(|p| p != first)
    })
    .unwrap();
    let second = rollout_pid(&s, 1).unwrap();
    kill(Pid::from_raw(second), Signal::SIGKILL).unwrap();
    let (code, stderr) = finish(child).unwrap();
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains(
            "rollout-1 died after all its 1 restarts were used (runner.rollout_restarts=1)"
        ) && stderr.contains(&format!("rollout-1 (pid {second})")),
        "{stderr}"
    );
    assert!(s.leftovers().is_empty(), "{:?}", s.leftovers());
}

/// The trainer dying still fails the run, naming it, restarts or not (resume from a checkpoint instead).
#[test]
fn a_killed_trainer_fails_the_run_even_with_restarts() {
    let s = Scratch::new("re");
    let mut child = command(&s, "train_async", &["runner.rollout_restarts=5"])
        .arg("runner.max_steps=100000")
        .spawn()
        .unwrap();
    wait_until(&mut child, "a step", || !s.metrics().is_empty()).unwrap();
    let needle = "--role trainer --rank 0 ";
    let pid = workers_of(&s.run_dir)
        .into_iter()
        .find(|(_, c)| c.contains(needle))
        .map(|(p, _)| p)
        .unwrap();
    kill(Pid::from_raw(pid as i32), Signal::SIGKILL).unwrap();
    let (code, stderr) = finish(child).unwrap();
    let want = format!("worker trainer-0 (pid {pid}) was killed by SIGKILL");
    assert!(
        code == Some(1) && stderr.contains(&want),
        "{code:?}\n{stderr}"
    );
    assert!(s.leftovers().is_empty(), "{:?}", s.leftovers());
}

/// A stopped rollout misses the step deadline: it is killed and restarted, and the run goes on.
#[test]
fn a_rollout_past_the_step_deadline_is_killed_and_restarted() {
    let s = Scratch::new("re");
    let mut child = command(
        &s,
        "train_embodied",
        &["runner.rollout_restarts=2", "runner.step_timeout_s=2"],
    )
    .spawn()
    .unwrap();
    wait_until(&mut child, "a step", || s.metrics().len() >= 2).unwrap();
    let pid = rollout_pid(&s, 0).unwrap();
    kill(Pid::from_raw(pid), Signal::SIGSTOP).unwrap();
    let (code, stderr) = finish(child).unwrap();
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        stderr.contains(&format!("rollout-0 (pid {pid}) missed the step deadline")),
        "{stderr}"
    );
    let rows = s.metrics();
    assert_eq!(rows.len(), STEPS);
    assert_eq!(rows.last().unwrap()["rollout/restarts"], 1);
    assert!(s.leftovers().is_empty(), "{:?}", s.leftovers());
}

/// What a test does to rollout-1's local weights copy before it kills the rollout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tamper {
    /// Nothing: the successor loads it.
    Keep,
    /// One flipped byte of tensor data: the successor refuses it (checksum) and starts from version 0.
    Corrupt,
    /// A sound copy (its checksum matches) of weights that are not the version it claims: the successor loads
    /// it, the trainer's checksum check refuses a replay onto it.
    Foreign,
}

/// `train_embodied` (patch syncer, a copy every 2 versions, a 16-version replay log) runs past version 20;
/// rollout-0 is stopped (SIGSTOP), so no step completes and no version passes while rollout-1's copy is
/// tampered with, rollout-1 is killed and its successor loads the copy and joins the weight channel; then
/// rollout-0 goes on, and the trainer catches the successor up. `device`: every worker's weights live on the
/// test worker's simulated device (`RLSYNC_TEST_DEVICE`), and the rollouts do not verify syncs (so no checksum
/// pulls the weights to the host before a copy is written: the copy must pull them itself). Returns the
/// orchestrator's line about the rejoin, rollout-1's log and the version its successor rejoined from.
fn rejoin_from_a_copy(tamper: Tamper, device: bool) -> (String, String, u64) {
    let s = Scratch::new("re");
    let mut extra = vec![
        "runner.rollout_restarts=1",
        "runner.rollout_weights_copy_interval=2",
        "weight_syncer.patch.replay_versions=16",
    ];
    if device {
        extra.push("runner.verify_sync=false");
    }
    let mut cmd = command(&s, "train_embodied", &extra);
    if device {
        cmd.env("RLSYNC_WORKER", crate::util::example("held_worker"))
            .env("RLSYNC_TEST_DEVICE", "1");
    }
    let mut child = cmd.spawn().unwrap();
    // Past version 16, version 0 (a fresh worker's) is out of the log: only a copy can make the rejoin a replay.
    wait_until(&mut child, "step 20", || s.metrics().len() >= 20).unwrap();
    let other = Pid::from_raw(rollout_pid(&s, 0).unwrap());
    kill(other, Signal::SIGSTOP).unwrap();
    // A copy being written finishes (the step waits for the stopped rollout).
    std::thread::sleep(Duration::from_millis(500));
    let copy = s.run_dir.join(".rlsync/rollout-1.safetensors");
    assert!(
        copy.is_file(),
        "rollout-1 keeps a copy at {}",
        copy.display()
    );
    match tamper {
        Tamper::Keep => {}
        Tamper::Corrupt => {
            let mut raw = std::fs::read(&copy).unwrap();
            let n = raw.len();
            raw[n - 1] ^= 0x10;
            std::fs::write(&copy, &raw).unwrap();
        }
        Tamper::Foreign => {
            let (mut state, meta) =
                rlsync_core::tensor::StateDict::load_safetensors_with_metadata(&copy).unwrap();
            let (version, _) = rlsync::protocol::launch::parse_copy_metadata(&meta).unwrap();
            let key = state.synced_keys()[0].clone();
            let t = state.get_mut(&key).unwrap();
            t.bytes_mut()[0] ^= 0x01;
            rlsync::worker::local_copy::write(&state, version, &copy).unwrap();
        }
    }
    let pid = rollout_pid(&s, 1).unwrap();
    kill(Pid::from_raw(pid), Signal::SIGKILL).unwrap();
    let log = s.run_dir.join("logs/rollout-1.log");
    let joined = wait_until(&mut child, "the successor's join", || {
        std::fs::read_to_string(&log).is_ok_and(|l| l.contains("rejoining from"))
    });
    let _ = kill(other, Signal::SIGCONT);
    if let Err(why) = joined {
        let (code, stderr) = finish(child).unwrap();
        panic!("{why}; exit {code:?}:\n{stderr}");
    }
    let (code, stderr) = finish(child).unwrap();
    assert_eq!(code, Some(0), "{stderr}");
    let rows: Vec<_> = s
        .metrics()
        .into_iter()
        .filter(|row| row.contains_key("train/loss"))
        .collect();
    assert_eq!(rows.len(), STEPS);
    // (Without verification the replay itself checks the copy: the log's checksum of its version must match.)
    assert!(
        device
            || rows
                .iter()
                .all(|r| r.get("sync/verified").is_none_or(|v| v == true)),
        "every sync verified"
    );
    assert_eq!(rows.last().unwrap()["rollout/restarts"], 1);
    let caught: Vec<_> = rows
        .iter()
        .filter_map(|r| r.get("sync/catchup_kind").and_then(|v| v.as_u64()))
        .collect();
    let line = stderr
        .lines()
        .find(|l| l.contains("rollout-1 rejoined: caught up by"))
        .unwrap_or_else(|| panic!("no rejoin in the log:\n{stderr}"))
        .to_string();
    let from: u64 = line
        .split("from version ")
        .nth(1)
        .and_then(|t| t.split(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap();
    let want_kind = u64::from(tamper != Tamper::Keep);
    assert_eq!(caught, vec![want_kind], "{line}");
    assert!(s.leftovers().is_empty(), "{:?}", s.leftovers());
    let log = std::fs::read_to_string(&log).unwrap();
    (line, log, from)
}

/// A successor that loads a local copy still in the replay log catches up by replay from its version, not by
/// a full transfer from version 0.
#[test]
fn a_restarted_rollout_replays_from_its_local_copy() {
    let (line, log, from) = rejoin_from_a_copy(Tamper::Keep, false);
    assert!(line.contains("caught up by replay"), "{line}");
    assert!(from >= 4, "rejoined from the copy's version: {line}");
    assert!(
        log.contains(&format!("loaded the local weights copy of version {from}")),
        "{log}"
    );
}

/// A rollout whose weights live on a device writes its local copy from the device's weights (pulled first), and
/// its successor pushes the copy and the replayed patches to the device before it installs there again.
#[test]
fn a_restarted_device_rollout_replays_from_its_local_copy_then_installs_on_the_device() {
    let (line, log, from) = rejoin_from_a_copy(Tamper::Keep, true);
    assert!(line.contains("caught up by replay"), "{line}");
    let successor = log
        .split(&format!("loaded the local weights copy of version {from}"))
        .nth(1)
        .unwrap_or_else(|| panic!("the successor loads the copy of version {from}:\n{log}"));
    assert!(
        successor.contains("weights installed on the device from now on: simulated device"),
        "{successor}"
    );
    assert!(
        successor.contains("simulated device: push"),
        "the rejoined weights reach the device: {successor}"
    );
}

/// A corrupt copy is refused by the successor: it rejoins from its initial weights, by a full transfer.
#[test]
fn a_corrupt_local_copy_falls_back_to_a_full_transfer() {
    let (line, log, from) = rejoin_from_a_copy(Tamper::Corrupt, false);
    assert!(line.contains("caught up by full"), "{line}");
    assert_eq!(from, 0, "{line}");
    assert!(
        log.contains("corrupt") && log.contains("is not used"),
        "{log}"
    );
}

/// A sound copy of weights that are not the version it claims: the trainer's checksum check refuses to
/// replay onto it, the successor gets the full state (never patches applied to unknown weights).
#[test]
fn a_mismatching_local_copy_falls_back_to_a_full_transfer() {
    let (line, _, from) = rejoin_from_a_copy(Tamper::Foreign, false);
    assert!(line.contains("caught up by full"), "{line}");
    assert!(from >= 4, "it reported the copy's version: {line}");
    assert!(
        line.contains("its weights are not those of version"),
        "{line}"
    );
}

/// Bucket syncer, `runner.weight_sync_interval=4`: a rollout restarted between syncs gets the last synced
/// version at once (the trainer keeps a copy of it), not at the next sync (a deferred catch-up).
#[test]
fn a_bucket_rollout_restarted_between_syncs_is_caught_up_at_once() {
    let s = Scratch::new("re");
    let mut child = command(
        &s,
        "train_embodied",
        &[
            "weight_syncer=bucket_syncer",
            "runner.rollout_restarts=1",
            "runner.weight_sync_interval=4",
        ],
    )
    .spawn()
    .unwrap();
    wait_until(&mut child, "step 10", || s.metrics().len() >= 10).unwrap();
    let pid = rollout_pid(&s, 1).unwrap();
    kill(Pid::from_raw(pid), Signal::SIGKILL).unwrap();
    let (code, stderr) = finish(child).unwrap();
    assert_eq!(code, Some(0), "{stderr}");
    let line = stderr
        .lines()
        .find(|l| l.contains("rollout-1 rejoined: caught up by"))
        .unwrap_or_else(|| panic!("no rejoin in the log:\n{stderr}"));
    let to: u64 = line
        .split(" to ")
        .nth(1)
        .and_then(|t| t.split(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap();
    // Synced versions: every 4th, and those an evaluation syncs (runner.val_check_interval).
    assert!(to >= 8, "caught up to the last synced version: {line}");
    let log = std::fs::read_to_string(s.run_dir.join("logs/rollout-1.log")).unwrap();
    assert!(
        log.contains(&format!(
            "rejoined the weight channel: full from version 0 to {to}, "
        )),
        "{log}"
    );
    let rows = s.metrics();
    assert_eq!(rows.last().unwrap()["rollout/restarts"], 1);
    assert!(
        rows.iter()
            .all(|r| r.get("sync/verified").is_none_or(|v| v == true))
    );
    assert!(s.leftovers().is_empty(), "{:?}", s.leftovers());
}
