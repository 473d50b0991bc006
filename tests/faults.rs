//! The fault campaign of issue 9 against the real binary: every break the hardening issue lists, repeated at
//! random moments. Each test prints `break K (what): held N / broke M` and fails if anything broke.
//!
//! `make test` runs one trial of each; the full campaign sets the trials of the process faults:
//! `RLSYNC_FAULT_TRIALS=20 cargo test --release --locked --test tests faults:: -- --test-threads=1 --nocapture`

use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use rand::Rng as _;

use crate::util::{PATIENCE, Scratch, bin, finish, trials, wait_until, worker_pid, workers_of};

/// Held/broke counts of one break, with the reason of every break.
struct Tally {
    name: &'static str,
    held: usize,
    broke: Vec<String>,
}

impl Tally {
    fn new(name: &'static str) -> Tally {
        Tally {
            name,
            held: 0,
            broke: Vec::new(),
        }
    }

    fn record(&mut self, trial: Result<(), String>) {
        match trial {
            Ok(()) => self.held += 1,
            Err(why) => self.broke.push(why),
        }
    }

    #[track_caller]
    fn finish(self) {
        println!(
            "{}: held {} / broke {}",
            self.name,
            self.held,
            self.broke.len()
        );
        assert!(
            self.broke.is_empty(),
            "{}: {} broke:\n{}",
            self.name,
            self.broke.len(),
            self.broke.join("\n---\n")
        );
    }
}

/// `rlsync train_embodied` in `s` on the small synthetic workload with `extra` overrides.
fn command(s: &Scratch, steps: u32, extra: &[&str]) -> Command {
    let steps = format!("runner.max_steps={steps}");
    let mut args = vec![
        "train_embodied",
        "model@actor.model=synthetic_small",
        "env@env.train=synthetic",
        "env@env.eval=synthetic",
        "actor.model.params=65536",
        "actor.model.tensors=8",
        "actor.model.train_ms=20",
        "actor.model.rollout_ms_per_step=2",
        "env.train.total_num_envs=4",
        "env.train.max_steps_per_rollout_epoch=8",
        "rollout.chunk_steps=4",
        "runner.shutdown_grace_s=1",
        "runner.handshake_timeout_s=60",
        "runner.step_timeout_s=60",
        &steps,
    ];
    args.extend_from_slice(extra);
    s.command(args)
}

/// Every metrics line of the run in `s` is a JSON object: how many there are.
fn metrics_valid(s: &Scratch) -> Result<usize, String> {
    let text = std::fs::read_to_string(s.run_dir.join("metrics.jsonl"))
        .map_err(|e| format!("metrics.jsonl: {e}"))?;
    for line in text.lines() {
        serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(line)
            .map_err(|e| format!("invalid metrics line {line:?}: {e}"))?;
    }
    Ok(text.lines().count())
}

/// Wait until the run in `s` wrote `n` metrics lines (it is running), or it ended.
fn wait_for_steps(s: &Scratch, child: &mut Child, n: usize) -> Result<(), String> {
    wait_until(child, &format!("step {n}"), || s.metrics_lines() >= n)
}

fn signal(child: &Child, sig: Signal) {
    let _ = kill(Pid::from_raw(child.id() as i32), sig);
}

fn no_panic(code: Option<i32>, stderr: &str) -> Result<(), String> {
    if code == Some(101) || stderr.contains("panicked") {
        return Err(format!("panicked (exit {code:?}):\n{stderr}"));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------------------
// break 1: two runs in one run dir

#[test]
fn break_1_a_run_dir_in_use_is_refused() {
    let mut tally = Tally::new("break 1 (two runs, one run dir)");
    for _ in 0..trials() {
        tally.record(two_runs_one_dir());
    }
    tally.finish();
}

fn two_runs_one_dir() -> Result<(), String> {
    let s = Scratch::new("rf");
    let steps = 15;
    let first = command(&s, steps, &[]).spawn().map_err(|e| e.to_string())?;
    std::thread::sleep(Duration::from_millis(rand::thread_rng().gen_range(0..300)));
    let second = command(&s, steps, &[]).spawn().map_err(|e| e.to_string())?;
    let a = finish(first)?;
    let b = finish(second)?;
    no_panic(a.0, &a.1)?;
    no_panic(b.0, &b.1)?;
    let (ok, refused) = match (a.0, b.0) {
        (Some(0), Some(1)) => (a, b),
        (Some(1), Some(0)) => (b, a),
        _ => {
            return Err(format!(
                "want one run to finish and one to be refused; exits {:?} / {:?}\n{}\n{}",
                a.0, b.0, a.1, b.1
            ));
        }
    };
    let _ = ok;
    if !refused.1.contains("is in use by another rlsync run (pid ") {
        return Err(format!(
            "the refusal does not name the holder:\n{}",
            refused.1
        ));
    }
    let lines = metrics_valid(&s)?;
    if lines != steps as usize {
        return Err(format!("{lines} metrics lines, want {steps}"));
    }
    let left = s.leftovers();
    if !left.is_empty() {
        return Err(format!("leftovers: {left:?}"));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------------------
// break 2: a suspended orchestrator

#[test]
fn break_2_a_suspended_orchestrator_does_not_fail_the_run() {
    let mut tally = Tally::new("break 2 (SIGSTOP of the orchestrator past the step deadline)");
    for _ in 0..trials() {
        tally.record(suspended_orchestrator());
    }
    tally.finish();
}

fn suspended_orchestrator() -> Result<(), String> {
    let s = Scratch::new("rf");
    let mut child = command(&s, 12, &["runner.step_timeout_s=2"])
        .spawn()
        .map_err(|e| e.to_string())?;
    let at = rand::thread_rng().gen_range(1..6);
    wait_for_steps(&s, &mut child, at)?;
    std::thread::sleep(Duration::from_millis(rand::thread_rng().gen_range(0..100)));
    signal(&child, Signal::SIGSTOP);
    std::thread::sleep(Duration::from_millis(3500));
    signal(&child, Signal::SIGCONT);
    let (code, stderr) = finish(child)?;
    no_panic(code, &stderr)?;
    if code != Some(0) {
        return Err(format!(
            "a healthy run failed after SIGSTOP at step {at}:\n{stderr}"
        ));
    }
    let left = s.leftovers();
    if !left.is_empty() {
        return Err(format!("leftovers: {left:?}"));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------------------
// break 4: signals and SIGKILL of the orchestrator

#[test]
fn break_4_every_stop_signal_cleans_up() {
    let mut tally =
        Tally::new("break 4 (SIGHUP/SIGQUIT/SIGUSR1/SIGTERM/SIGINT of the orchestrator)");
    for _ in 0..trials() {
        for sig in [
            Signal::SIGHUP,
            Signal::SIGQUIT,
            Signal::SIGUSR1,
            Signal::SIGTERM,
            Signal::SIGINT,
        ] {
            tally.record(stopped_by(sig).map_err(|e| format!("{sig}: {e}")));
        }
    }
    tally.finish();
}

fn stopped_by(sig: Signal) -> Result<(), String> {
    let s = Scratch::new("rf");
    let mut child = command(&s, 100_000, &[])
        .spawn()
        .map_err(|e| e.to_string())?;
    let at = rand::thread_rng().gen_range(1..4);
    wait_for_steps(&s, &mut child, at)?;
    std::thread::sleep(Duration::from_millis(rand::thread_rng().gen_range(0..50)));
    signal(&child, sig);
    let (code, stderr) = finish(child)?;
    no_panic(code, &stderr)?;
    if code != Some(1) || !stderr.contains(sig.as_str()) {
        return Err(format!("want exit 1 naming {sig}, got {code:?}:\n{stderr}"));
    }
    let left = s.leftovers();
    if !left.is_empty() {
        return Err(format!("leftovers: {left:?}"));
    }
    Ok(())
}

#[test]
fn break_4_leftovers_of_a_killed_orchestrator_are_swept() {
    let mut tally = Tally::new("break 4 (SIGKILL of the orchestrator, then sweeps)");
    for trial in 0..trials() {
        // Alternate the two sweepers: `rlsync --cleanup` and the next run's start.
        tally.record(killed_then_swept(trial % 2 == 1));
    }
    tally.finish();
}

fn killed_then_swept(by_next_run: bool) -> Result<(), String> {
    let s = Scratch::new("rf");
    let mut child = command(&s, 100_000, &[])
        .spawn()
        .map_err(|e| e.to_string())?;
    let at = rand::thread_rng().gen_range(1..4);
    wait_for_steps(&s, &mut child, at)?;
    std::thread::sleep(Duration::from_millis(rand::thread_rng().gen_range(0..50)));
    signal(&child, Signal::SIGKILL);
    let _ = finish(child)?;
    // The workers die with the orchestrator (PR_SET_PDEATHSIG).
    let deadline = Instant::now() + PATIENCE;
    while !workers_of(&s.run_dir).is_empty() {
        if Instant::now() > deadline {
            return Err("workers outlived the killed orchestrator".into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    if by_next_run {
        let next = command(&s, 2, &[]).spawn().map_err(|e| e.to_string())?;
        let (code, stderr) = finish(next)?;
        if code != Some(0) {
            return Err(format!("the next run failed in the same dir:\n{stderr}"));
        }
    } else {
        let out = Command::new(bin())
            .arg("--cleanup")
            .env("TMPDIR", &s.tmp)
            .output()
            .map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(format!("rlsync --cleanup failed: {out:?}"));
        }
    }
    let left = s.leftovers();
    if !left.is_empty() {
        return Err(format!("leftovers after the sweep: {left:?}"));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------------------
// breaks 5, 6, 8, 9 and the dry-run checks: hostile configs

/// `rlsync <args>` with `env`; exit code and stderr (and stdout).
fn rlsync(args: &[&str], env: &[(&str, &str)]) -> Result<(Option<i32>, String, String), String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let mut cmd = Command::new(bin());
    cmd.args(args)
        .current_dir(dir.path())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().map_err(|e| e.to_string())?;
    let mut out = child.stdout.take();
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        if let Some(out) = out.as_mut() {
            let _ = out.read_to_string(&mut text);
        }
        text
    });
    let (code, stderr) = finish(child)?;
    Ok((code, stderr, reader.join().unwrap_or_default()))
}

const S: [&str; 3] = [
    "model@actor.model=synthetic_small",
    "env@env.train=synthetic",
    "env@env.eval=synthetic",
];

#[test]
fn breaks_5_6_8_hostile_values_fail_at_their_key() {
    let mut tally = Tally::new("breaks 5, 6, 8 (hostile values: exit 1 naming the key, no panic)");
    let cases: &[(&str, &str)] = &[
        (
            "runner.handshake_timeout_s=1e300",
            "runner.handshake_timeout_s",
        ),
        ("runner.step_timeout_s=1e19", "runner.step_timeout_s"),
        ("runner.shutdown_grace_s=1e300", "runner.shutdown_grace_s"),
        ("actor.model.train_ms=1e300", "actor.model.train_ms"),
        ("algorithm.gamma=nan", "algorithm.gamma"),
        ("actor.optim.lr=nan", "actor.optim.lr"),
        ("runner.step_timeout_s=inf", "runner.step_timeout_s"),
        ("algorithm.clip_ratio_low=inf", "algorithm.clip_ratio_low"),
        (
            "cluster.component_placement.rollout=0-2000000",
            "cluster.component_placement.rollout",
        ),
        (
            "cluster.component_placement.rollout=0-9999",
            "cluster.component_placement.rollout",
        ),
    ];
    for (value, key) in cases {
        for dry in [true, false] {
            let trial = (|| {
                let run_dir = tempfile::tempdir().map_err(|e| e.to_string())?;
                let dir_arg = format!("hydra.run.dir={}", run_dir.path().display());
                let mut args = vec!["train_embodied"];
                args.extend(S);
                args.extend([*value, dir_arg.as_str()]);
                if dry {
                    args.push("--dry-run");
                }
                let (code, stderr, _) = rlsync(&args, &[])?;
                no_panic(code, &stderr)?;
                if code != Some(1) || !stderr.contains(&format!("{key}:")) {
                    return Err(format!("{value} (dry run {dry}): exit {code:?}:\n{stderr}"));
                }
                Ok(())
            })();
            tally.record(trial);
        }
    }
    tally.finish();
}

#[test]
fn break_9_a_huge_sweep_starts_at_once_in_bounded_memory() {
    let mut tally = Tally::new("break 9 (a 10^8-job sweep is iterated lazily)");
    tally.record(huge_sweep());
    tally.finish();
}

fn huge_sweep() -> Result<(), String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let mut child = Command::new(bin())
        .args(["train_embodied", "-m", "--dry-run"])
        .args(S)
        .args([
            "actor.seed=range(0,10000)",
            "algorithm.gamma=range(0,10000)",
        ])
        .current_dir(dir.path())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| e.to_string())?;
    let mut out = child.stdout.take().ok_or("no stdout")?;
    let pid = child.id();
    // Read until the third job is announced: the sweep must start long before its product is built.
    let reader = std::thread::spawn(move || {
        let mut seen = Vec::new();
        let mut buf = [0u8; 4096];
        while !String::from_utf8_lossy(&seen).contains("#2 : ") {
            match out.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => seen.extend_from_slice(&buf[..n]),
            }
        }
        String::from_utf8_lossy(&seen).into_owned()
    });
    let deadline = Instant::now() + PATIENCE;
    while !reader.is_finished() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let rss_kib = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .unwrap_or(0);
    let _ = child.kill();
    let _ = child.wait();
    let seen = reader.join().unwrap_or_default();
    if !seen.contains("Launching 100000000 jobs")
        || !seen.contains("actor.seed=0 algorithm.gamma=2\n")
    {
        return Err(format!("the sweep did not start job by job:\n{seen}"));
    }
    if rss_kib > 512 * 1024 {
        return Err(format!("{rss_kib} KiB resident after three jobs"));
    }
    Ok(())
}

#[test]
fn dry_run_catches_what_fails_a_run_at_once() {
    let mut tally = Tally::new("dry-run checks (TMPDIR too long, missing resume_dir)");
    let long_tmp = format!("/tmp/{}", "t".repeat(100));
    // (extra arguments, environment, what the report must say)
    type Case<'a> = (Vec<&'a str>, Vec<(&'a str, &'a str)>, &'a str);
    let cases: Vec<Case> = vec![
        (
            vec![],
            vec![("TMPDIR", long_tmp.as_str())],
            "set TMPDIR to a shorter directory",
        ),
        (
            vec!["runner.resume_dir=/nonexistent/ckpt"],
            vec![],
            "runner.resume_dir: /nonexistent/ckpt is not a directory",
        ),
    ];
    for (extra, env, want) in cases {
        let trial = (|| {
            let mut args = vec!["train_embodied", "--dry-run"];
            args.extend(S);
            args.extend(extra.iter().copied());
            let (code, stderr, stdout) = rlsync(&args, &env)?;
            no_panic(code, &stderr)?;
            if code != Some(1) || !stdout.contains(want) {
                return Err(format!(
                    "want exit 1 and {want:?}, got {code:?}:\n{stdout}\n{stderr}"
                ));
            }
            // The real run fails the same way, at once.
            let mut args: Vec<&str> = vec!["train_embodied"];
            args.extend(S);
            args.extend(extra.iter().copied());
            let run_dir = tempfile::tempdir().map_err(|e| e.to_string())?;
            let dir_arg = format!("hydra.run.dir={}", run_dir.path().display());
            args.push(&dir_arg);
            let (code, stderr, _) = rlsync(&args, &env)?;
            no_panic(code, &stderr)?;
            if code != Some(1) {
                return Err(format!("the real run did not fail: {code:?}\n{stderr}"));
            }
            Ok(())
        })();
        tally.record(trial);
    }
    tally.finish();
}

// ---------------------------------------------------------------------------------------------------------
// break 7: closed stdout / stderr

/// Run `rlsync args` with stdout (or stderr) a pipe whose reader is already gone.
fn with_closed(
    args: &[String],
    close_stderr: bool,
    tmp: &Path,
) -> Result<(Option<i32>, String), String> {
    let (read, write) = nix::unistd::pipe().map_err(|e| e.to_string())?;
    drop(read);
    let closed = Stdio::from(write);
    let mut cmd = Command::new(bin());
    cmd.args(args).env("TMPDIR", tmp).stdin(Stdio::null());
    if close_stderr {
        cmd.stdout(Stdio::null()).stderr(closed);
    } else {
        cmd.stdout(closed).stderr(Stdio::piped());
    }
    let child = cmd.spawn().map_err(|e| e.to_string())?;
    finish(child)
}

#[test]
fn break_7_a_closed_stdout_or_stderr_never_panics() {
    let mut tally = Tally::new("break 7 (EPIPE on stdout/stderr)");
    let s = Scratch::new("rf");
    let run: Vec<String> = {
        let cmd = command(&s, 2, &[]);
        std::iter::once(cmd.get_program())
            .chain(cmd.get_args())
            .skip(1)
            .map(|a| a.to_string_lossy().into_owned())
            .collect()
    };
    let strings = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let mut dry = strings(&["train_embodied", "--dry-run"]);
    dry.extend(strings(&S));
    let cases: Vec<(&str, Vec<String>, bool, Option<i32>)> = vec![
        ("--help", strings(&["--help"]), false, Some(0)),
        (
            "train_embodied --help",
            strings(&["train_embodied", "--help"]),
            false,
            Some(0),
        ),
        (
            "--cfg all",
            strings(&["train_embodied", "--cfg", "all"]),
            false,
            Some(0),
        ),
        ("--dry-run", dry, false, Some(0)),
        ("a finished run's summary", run, false, Some(0)),
        (
            "an error on a closed stderr",
            strings(&["train_embodied", "algorithm.gamma=nan"]),
            true,
            Some(1),
        ),
        (
            "a usage error on a closed stderr",
            strings(&["--frobnicate"]),
            true,
            // argparse's status for a usage error (issue 12 item 6).
            Some(2),
        ),
    ];
    for (what, args, close_stderr, want) in cases {
        let trial = (|| {
            let (code, stderr) = with_closed(&args, close_stderr, &s.tmp)?;
            no_panic(code, &stderr)?;
            if code != want {
                return Err(format!("{what}: exit {code:?}, want {want:?}:\n{stderr}"));
            }
            Ok(())
        })();
        tally.record(trial.map_err(|e| format!("{what}: {e}")));
    }
    let left = s.leftovers();
    tally.record(if left.is_empty() {
        Ok(())
    } else {
        Err(format!("the run left {left:?}"))
    });
    tally.finish();
}

// ---------------------------------------------------------------------------------------------------------
// done means: a shared-memory slot corrupted by another process while a sync is in flight

#[test]
fn corrupting_shared_memory_mid_sync_is_never_installed() {
    let mut tally = Tally::new("shm corruption between processes (patch and bucket)");
    for trial in 0..trials() {
        for syncer in ["patch_syncer", "bucket_syncer"] {
            tally.record(
                corrupt_mid_sync(syncer).map_err(|e| format!("trial {trial}, {syncer}: {e}")),
            );
        }
    }
    tally.finish();
}

/// Run with every step synced and verified while this process (a stranger to the run) flips random bytes in
/// the run's shared-memory segments. A run may fail on a rejected payload; it must never install one:
/// `runner.verify_sync` compares every rollout's state checksum with the trainer's.
fn corrupt_mid_sync(syncer: &str) -> Result<(), String> {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let s = Scratch::new("rf");
    let syncer_arg = format!("weight_syncer={syncer}");
    let child = command(
        &s,
        40,
        &[
            syncer_arg.as_str(),
            "runner.verify_sync=true",
            "actor.model.params=1048576",
            "actor.model.adam_lr=1e-3",
            "actor.model.train_ms=5",
        ],
    )
    .spawn()
    .map_err(|e| e.to_string())?;
    let stop = Arc::new(AtomicBool::new(false));
    let writes = Arc::new(AtomicUsize::new(0));
    let corrupter = {
        let (stop, writes) = (stop.clone(), writes.clone());
        let launch = s.run_dir.join(".rlsync/launch.json");
        std::thread::spawn(move || {
            let mut rng = rand::thread_rng();
            let mut prefix = None;
            while !stop.load(Ordering::Relaxed) {
                if prefix.is_none() {
                    prefix = std::fs::read(&launch)
                        .ok()
                        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
                        .and_then(|v| v["segment_prefix"].as_str().map(|p| format!("{p}.")));
                }
                let Some(p) = &prefix else {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                };
                let names: Vec<PathBuf> = std::fs::read_dir("/dev/shm")
                    .map(|rd| {
                        rd.flatten()
                            .filter(|e| e.file_name().to_string_lossy().starts_with(p.as_str()))
                            .map(|e| e.path())
                            .collect()
                    })
                    .unwrap_or_default();
                for name in names {
                    let Ok(file) = std::fs::OpenOptions::new()
                        .read(true)
                        .write(true)
                        .open(&name)
                    else {
                        continue;
                    };
                    // SAFETY: a deliberate stranger's write into the run's shared memory; this process reads
                    // nothing through the mapping.
                    let Ok(mut map) = (unsafe { memmap2::MmapMut::map_mut(&file) }) else {
                        continue;
                    };
                    if map.is_empty() {
                        continue;
                    }
                    for _ in 0..rng.gen_range(1..8) {
                        let at = rng.gen_range(0..map.len());
                        map[at] ^= 1 << rng.gen_range(0..8);
                        writes.fetch_add(1, Ordering::Relaxed);
                    }
                }
                std::thread::sleep(Duration::from_micros(rng.gen_range(0..2000)));
            }
        })
    };
    let result = finish(child);
    stop.store(true, Ordering::Relaxed);
    let _ = corrupter.join();
    let (code, stderr) = result?;
    no_panic(code, &stderr)?;
    if stderr.contains("weight verification failed") {
        return Err(format!("a corrupted payload was installed:\n{stderr}"));
    }
    match code {
        Some(0) => {}
        Some(1) if stderr.contains("rejected payload") || stderr.contains("checksum") => {}
        _ => {
            return Err(format!(
                "want success or a rejected payload, got {code:?} after {} corrupting writes:\n{stderr}",
                writes.load(Ordering::Relaxed)
            ));
        }
    }
    let left = s.leftovers();
    if !left.is_empty() {
        return Err(format!("leftovers: {left:?}"));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------------------
// break 3: strangers on the control socket

/// `cmd` run under `umask 000` (through `sh`), so file modes cannot come from the umask.
fn with_umask_000(cmd: &Command) -> Command {
    let mut sh = Command::new("sh");
    sh.arg("-c")
        .arg("umask 000; exec \"$0\" \"$@\"")
        .arg(cmd.get_program())
        .args(cmd.get_args())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    for (k, v) in cmd.get_envs() {
        if let Some(v) = v {
            sh.env(k, v);
        }
    }
    sh
}

#[test]
fn break_3_strangers_on_the_control_socket_never_disturb_a_run() {
    let mut tally = Tally::new("break 3 (strangers on the control socket, umask 000)");
    for trial in 0..trials() {
        for attack in 0..4 {
            tally.record(
                stranger(attack).map_err(|e| format!("trial {trial}, attack {attack}: {e}")),
            );
        }
    }
    tally.finish();
}

/// One stranger (this test process: same user, not a spawned worker) connects while the run is going and:
/// 0 sends 8 bytes of junk; 1 says hello as rollout-1 without the token; 2 says hello as rollout-1 with the
/// token it read from the launch file; 3 connects and says nothing.
fn stranger(attack: u32) -> Result<(), String> {
    use std::io::Write as _;
    use std::os::unix::fs::PermissionsExt as _;
    let s = Scratch::new("rf");
    let mut child = with_umask_000(&command(&s, 10, &[]))
        .spawn()
        .map_err(|e| e.to_string())?;
    wait_for_steps(&s, &mut child, rand::thread_rng().gen_range(1..4))?;
    let launch_path = s.run_dir.join(".rlsync/launch.json");
    let launch: serde_json::Value = serde_json::from_slice(
        &std::fs::read(&launch_path).map_err(|e| format!("launch file: {e}"))?,
    )
    .map_err(|e| e.to_string())?;
    let mode = |p: &Path| {
        std::fs::metadata(p)
            .map(|m| m.permissions().mode() & 0o777)
            .unwrap_or(0)
    };
    let socket = PathBuf::from(
        launch["control_socket"]
            .as_str()
            .ok_or("no control_socket")?,
    );
    let private = socket.parent().ok_or("no socket dir")?.to_owned();
    for (what, path, want) in [
        ("launch file", launch_path.as_path(), 0o600),
        ("control socket", socket.as_path(), 0o600),
        ("private dir", private.as_path(), 0o700),
        ("run dir .rlsync", &s.run_dir.join(".rlsync"), 0o700),
    ] {
        if mode(path) != want {
            let _ = child.kill();
            return Err(format!(
                "{what} {} has mode {:o}",
                path.display(),
                mode(path)
            ));
        }
    }
    let token = launch["token"].as_str().unwrap_or_default().to_owned();
    let mut conn = std::os::unix::net::UnixStream::connect(&socket).map_err(|e| e.to_string())?;
    let frame = |json: String| {
        let mut bytes = Vec::new();
        bytes.extend_from_slice(&((json.len() + 4) as u32).to_le_bytes());
        bytes.extend_from_slice(&(json.len() as u32).to_le_bytes());
        bytes.extend_from_slice(json.as_bytes());
        bytes
    };
    let hello = |token: &str| {
        frame(format!(
            r#"{{"report":"hello","protocol":1,"role":"rollout","rank":1,"pid":{},"token":"{token}"}}"#,
            std::process::id()
        ))
    };
    let sent = match attack {
        0 => conn.write_all(&[0xff, 0xff, 0xff, 0x7f, 1, 2, 3, 4]),
        1 => conn.write_all(&hello("")),
        2 => conn.write_all(&hello(&token)),
        _ => Ok(()),
    };
    // The run may already have dropped us: a failed write is fine.
    let _ = sent;
    let (code, stderr) = finish(child)?;
    drop(conn);
    no_panic(code, &stderr)?;
    if code != Some(0) {
        return Err(format!(
            "the stranger disturbed the run (exit {code:?}):\n{stderr}"
        ));
    }
    if metrics_valid(&s)? != 10 {
        return Err("the run did not finish its 10 steps".into());
    }
    let left = s.leftovers();
    if !left.is_empty() {
        return Err(format!("leftovers: {left:?}"));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------------------
// break 10: the first cause is the one named

#[test]
fn break_10_a_killed_trainer_is_named_not_a_rollout() {
    let mut tally = Tally::new("break 10 (SIGKILL of the trainer names the trainer)");
    for _ in 0..trials() {
        tally.record(killed_worker("trainer", 0));
    }
    tally.finish();
}

fn killed_worker(role: &str, rank: u32) -> Result<(), String> {
    let s = Scratch::new("rf");
    let mut child = command(&s, 100_000, &[])
        .spawn()
        .map_err(|e| e.to_string())?;
    wait_for_steps(&s, &mut child, rand::thread_rng().gen_range(1..4))?;
    std::thread::sleep(Duration::from_millis(rand::thread_rng().gen_range(0..60)));
    let pid = worker_pid(&s.run_dir, role, rank).ok_or("worker not found")?;
    let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
    let (code, stderr) = finish(child)?;
    no_panic(code, &stderr)?;
    let want = format!("worker {role}-{rank} (pid {pid}) was killed by SIGKILL");
    if code != Some(1) || !stderr.contains(&want) {
        return Err(format!(
            "want exit 1 naming {want:?}, got {code:?}:\n{stderr}"
        ));
    }
    let left = s.leftovers();
    if !left.is_empty() {
        return Err(format!("leftovers: {left:?}"));
    }
    Ok(())
}

#[test]
fn break_10_a_stopped_rollout_is_named() {
    let mut tally = Tally::new("break 10 (SIGSTOP of a rollout names it)");
    for _ in 0..trials() {
        tally.record(stopped_rollout());
    }
    tally.finish();
}

fn stopped_rollout() -> Result<(), String> {
    let s = Scratch::new("rf");
    let mut child = command(
        &s,
        100_000,
        &["runner.step_timeout_s=3", "runner.handshake_timeout_s=3"],
    )
    .spawn()
    .map_err(|e| e.to_string())?;
    wait_for_steps(&s, &mut child, rand::thread_rng().gen_range(1..4))?;
    std::thread::sleep(Duration::from_millis(rand::thread_rng().gen_range(0..60)));
    let rank = rand::thread_rng().gen_range(0..2);
    let pid = worker_pid(&s.run_dir, "rollout", rank).ok_or("rollout not found")?;
    let _ = kill(Pid::from_raw(pid), Signal::SIGSTOP);
    let (code, stderr) = finish(child)?;
    let _ = kill(Pid::from_raw(pid), Signal::SIGCONT);
    no_panic(code, &stderr)?;
    let named = stderr.contains(&format!("rollout-{rank} (pid {pid}, stopped)"))
        || stderr.contains(&format!(
            "worker rollout-{rank} (pid {pid}) did not answer (the process is stopped)"
        ));
    if code != Some(1) || !named {
        return Err(format!(
            "want exit 1 naming stopped rollout-{rank} (pid {pid}), got {code:?}:\n{stderr}"
        ));
    }
    let left = s.leftovers();
    if !left.is_empty() {
        return Err(format!("leftovers: {left:?}"));
    }
    Ok(())
}

/// Runs `cmd` (its program and arguments) in a new user + mount namespace whose /dev/shm is a tmpfs of
/// `shm_bytes`; after `fill_after`, a filler takes whatever space is left. Once the run ends, the names left in
/// that /dev/shm (the filler excepted) are printed to stderr as `SHM-LEFT:<names>`.
fn in_small_dev_shm(cmd: &Command, shm_bytes: usize, fill_after: Duration) -> Command {
    let script = format!(
        "mount -t tmpfs -o size={shm_bytes},mode=1777 tmpfs /dev/shm || exit 99\n\
         (sleep {fill:.3}; cat /dev/zero > /dev/shm/filler 2>/dev/null) &\n\
         \"$0\" \"$@\"; rc=$?\n\
         kill $! 2>/dev/null; wait\n\
         echo \"SHM-LEFT:$(ls /dev/shm | grep -v '^filler$' | tr '\\n' ' ')\" >&2\n\
         exit $rc",
        fill = fill_after.as_secs_f64()
    );
    let mut wrapped = Command::new("unshare");
    wrapped
        .args(namespace_flags())
        .args(["--propagation", "private", "sh", "-c", &script])
        .arg(cmd.get_program())
        .args(cmd.get_args());
    for (key, value) in cmd.get_envs() {
        if let Some(value) = value {
            wrapped.env(key, value);
        }
    }
    wrapped
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    wrapped
}

/// `unshare` flags that give this process a mount namespace where it may mount a tmpfs: a user namespace
/// mapping us to root (works unprivileged where the kernel allows it), else a plain mount namespace (root).
fn namespace_flags() -> &'static [&'static str] {
    const CHOICES: [&[&str]; 2] = [&["--user", "--map-root-user", "--mount"], &["--mount"]];
    let works = |flags: &[&str]| {
        Command::new("unshare")
            .args(flags)
            .args(["--propagation", "private", "sh", "-c"])
            .arg("mount -t tmpfs -o size=64k tmpfs /dev/shm")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    CHOICES.into_iter().find(|flags| works(flags)).expect(
        "this test needs `unshare` and a mount namespace (root, or unprivileged user namespaces)",
    )
}

#[test]
fn break_10_a_full_dev_shm_names_the_trainer() {
    let mut tally = Tally::new("break 10 (/dev/shm full: the trainer's ENOSPC names the trainer)");
    for _ in 0..trials() {
        tally.record(full_dev_shm());
    }
    tally.finish();
}

/// /dev/shm too small from the start, or filled at a random moment of the run: the run either finishes or
/// fails naming the trainer (the one that reserves segments) and the full device, never a rollout, and leaves
/// nothing behind in that /dev/shm.
fn full_dev_shm() -> Result<(), String> {
    let s = Scratch::new("rf");
    let mut rng = rand::thread_rng();
    // One full payload of this model is 4 MB (1 Mi f32 elements); a few in-flight slots need several.
    let shm_bytes = rng.gen_range(64 << 10..24 << 20);
    let fill_after = Duration::from_millis(rng.gen_range(0..1500));
    let steps = 12;
    let syncer = ["weight_syncer=patch_syncer", "weight_syncer=bucket_syncer"][rng.gen_range(0..2)];
    // A large learning rate makes patches change size from step to step, so segments are regrown mid-run.
    let run = command(
        &s,
        steps,
        &[
            "actor.model.params=1048576",
            "actor.model.adam_lr=0.001",
            syncer,
        ],
    );
    let child = in_small_dev_shm(&run, shm_bytes, fill_after)
        .spawn()
        .map_err(|e| format!("unshare: {e}"))?;
    let (code, stderr) = finish(child)?;
    let trial = format!("({syncer}, /dev/shm of {shm_bytes} bytes, filled after {fill_after:?})");
    if code == Some(99) {
        return Err(format!(
            "could not mount a tmpfs on /dev/shm in a namespace:\n{stderr}"
        ));
    }
    no_panic(code, &stderr)?;
    let error = stderr
        .lines()
        .find(|l| l.starts_with("Error: "))
        .unwrap_or_default();
    let done = s.metrics_lines();
    println!("  {trial}: exit {code:?} after {done} steps");
    match code {
        Some(0) => {
            let lines = metrics_valid(&s)?;
            if lines != steps as usize {
                return Err(format!("{trial}: exit 0 with {lines} of {steps} steps"));
            }
        }
        Some(1) => {
            if !(error.contains("worker trainer-0 ") && error.contains("No space left on device")) {
                return Err(format!(
                    "{trial}: want an error naming trainer-0 and the full device, got {error:?}:\n{stderr}"
                ));
            }
        }
        _ => return Err(format!("{trial}: exit {code:?}:\n{stderr}")),
    }
    let shm_left = stderr
        .lines()
        .find_map(|l| l.strip_prefix("SHM-LEFT:"))
        .ok_or_else(|| format!("{trial}: the wrapper did not list /dev/shm:\n{stderr}"))?;
    if !shm_left.trim().is_empty() {
        return Err(format!("{trial}: shm segments left: {shm_left}"));
    }
    let left = s.leftovers();
    if !left.is_empty() {
        return Err(format!("{trial}: leftovers: {left:?}"));
    }
    Ok(())
}
