//! What a user sees from the command line (issue 12): logger backends and unsupported choices, the unused-keys
//! report, the job log and worker logs, progress without a terminal, the `-m` launcher lines, `only_eval`.

use serde_json::Value;

use crate::util::{Dir, SMALL_SYNTHETIC};

/// A small synthetic run of the embedded `train_embodied` config (no libtorch needed), two steps.
fn small() -> Vec<&'static str> {
    let mut args = vec!["train_embodied"];
    args.extend_from_slice(SMALL_SYNTHETIC);
    args.push("runner.max_steps=2");
    args
}

fn run(dir: &Dir, extra: &[&str]) -> crate::util::Output {
    let mut args = small();
    args.extend_from_slice(extra);
    dir.run(&args)
}

fn rows(path: &std::path::Path) -> Vec<serde_json::Map<String, Value>> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| match serde_json::from_str(l) {
            Ok(Value::Object(map)) => map,
            other => panic!("bad metrics line {l}: {other:?}"),
        })
        .collect()
}

#[test]
fn an_unsupported_logger_backend_is_one_error_naming_the_supported_ones() {
    let dir = Dir::new();
    let out = run(
        &dir,
        &["hydra.run.dir=run", "runner.logger.logger_backends=[wandb]"],
    );
    let err = out.err();
    assert!(
        err.contains("runner.logger.logger_backends")
            && err.contains("wandb")
            && err.contains("tensorboard")
            && err.contains("csv"),
        "{err}"
    );
    assert!(
        err.contains("(1 problem)"),
        "one problem, not a second spurious one: {err}"
    );
    assert!(!dir.join("run/metrics.jsonl").exists(), "nothing ran");
}

#[test]
fn csv_backend_and_log_path_put_the_metrics_where_asked() {
    let dir = Dir::new();
    let out = run(
        &dir,
        &[
            "hydra.run.dir=run",
            "runner.logger.logger_backends=[csv]",
            "runner.logger.log_path=elsewhere",
        ],
    );
    out.ok();
    let csv = std::fs::read_to_string(dir.join("elsewhere/metrics.csv")).unwrap_or_default();
    let lines: Vec<&str> = csv.lines().collect();
    assert_eq!(lines.len(), 3, "header and 2 steps:\n{csv}");
    assert!(
        lines[0].starts_with("step,") && lines[0].contains("sync/bytes"),
        "{csv}"
    );
    assert!(
        lines[1].starts_with("0,") && lines[2].starts_with("1,"),
        "{csv}"
    );
    assert_eq!(rows(&dir.join("elsewhere/metrics.jsonl")).len(), 2);
    assert!(!dir.join("run/metrics.jsonl").exists());
    assert!(
        !dir.join("elsewhere/tensorboard").exists(),
        "tensorboard was not asked for"
    );
}

#[test]
fn dry_run_and_the_run_report_the_keys_rlsync_does_not_use() {
    let dir = Dir::new();
    let extra = ["+runner.ckpt_path=x", "+reward.use_reward_model=false"];
    let mut dry = vec!["--dry-run"];
    dry.extend(extra);
    let out = run(&dir, &dry);
    let report = out.ok();
    let line = report
        .lines()
        .find(|l| l.contains("keys in this config that rlsync does not use"))
        .unwrap_or_else(|| panic!("no unused-keys line:\n{report}"));
    for key in [
        "runner.ckpt_path",
        "reward",
        "runner.task_type",
        "actor.fsdp_config",
    ] {
        assert!(line.contains(key), "{key} missing: {line}");
    }
    for used in ["runner.max_steps", "runner.logger"] {
        assert!(!line.contains(used), "{used} is used: {line}");
    }
    // The run lists them in its first log lines, on stderr and in Hydra's job log.
    let mut args = vec!["hydra.run.dir=run"];
    args.extend(extra);
    let out = run(&dir, &args);
    out.ok();
    let first: Vec<&str> = out.stderr.lines().take(3).collect();
    assert!(
        first
            .iter()
            .any(|l| l.contains("keys in this config that rlsync does not use")),
        "{}",
        out.stderr
    );
    let log = std::fs::read_to_string(dir.join("run/train_embodied.log")).unwrap_or_default();
    assert!(
        log.lines().any(|l| l
            .contains("][rlsync][INFO] - keys in this config that rlsync does not use")
            && l.contains("runner.ckpt_path")),
        "{log}"
    );
}

/// Issue 26: the summary's figures mean what they say: the job's wall time from start to end, the workers'
/// start-up, the init bootstrap and the loop apart, throughput over the loop, per-step syncs without the bootstrap.
#[test]
fn the_summary_reports_wall_start_up_bootstrap_and_loop_time_apart() {
    let dir = Dir::new();
    let started = std::time::Instant::now();
    let out = run(&dir, &["hydra.run.dir=run", "runner.max_steps=4"]);
    let elapsed = started.elapsed().as_secs_f64();
    let stdout = out.ok();
    let row = |name: &str| summary_row(stdout, name);
    let wall = row("wall time (start to end)")[0];
    let parts: Vec<f64> = [
        "config and checks",
        "workers' start-up",
        "init bootstrap",
        "loop time",
        "shutdown",
    ]
    .iter()
    .map(|name| row(name)[0])
    .collect();
    // Printed rounded to 10 ms: it may round up past the process's exit by 5 ms.
    assert!(
        wall <= elapsed + 0.01,
        "wall {wall} s, the process took {elapsed} s"
    );
    // The parts add up to the whole (each rounded to 10 ms; between them only bookkeeping). Any part may
    // print 0.00 s: the test worker's three processes can start within 5 ms.
    let sum: f64 = parts.iter().sum();
    assert!(
        (wall - sum).abs() <= 0.03 + 0.05 * wall && parts.iter().all(|p| *p >= 0.0),
        "{stdout}"
    );
    assert!(row("loop throughput")[0] > 0.0, "{stdout}");
    // 4 steps, a sync before each but the first (whose weights are the bootstrap's).
    assert_eq!(
        row("syncs after the bootstrap (verified)"),
        [3.0, 3.0],
        "{stdout}"
    );
    let sync = row("sync time mean / p50 / max");
    assert_eq!(sync.len(), 3, "{stdout}");
    assert!(sync[0] <= sync[2] && sync[1] <= sync[2], "{stdout}");
    // Where a sync's time went: the trainer's handling and the slowest install, each within the longest sync,
    // and that install's five phases (a host receiver's, verified).
    let within = row("sync p50: trainer / slowest install");
    assert!(
        within.len() == 2 && within.iter().all(|ms| *ms <= sync[2]),
        "{stdout}"
    );
    assert_eq!(row("slowest install p50, by phase").len(), 5, "{stdout}");
    let first = &rows(&dir.join("run/metrics.jsonl"))[0];
    assert!(
        first["time/init_weights"].as_f64().unwrap() > 0.0,
        "{first:?}"
    );
    assert_eq!(first["time/sync_weights"].as_f64(), Some(0.0), "{first:?}");
    // No trainer of the synthetic workload reports a clip fraction: the canary stays quiet.
    assert!(!out.stderr.contains("stale weights?"), "{}", out.stderr);
}

/// The numbers of the summary's row `name`.
fn summary_row(stdout: &str, name: &str) -> Vec<f64> {
    let line = stdout
        .lines()
        .find(|l| l.trim_start().starts_with(name))
        .unwrap_or_else(|| panic!("no {name} row:\n{stdout}"));
    line[line.find(name).unwrap() + name.len()..]
        .split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .filter_map(|w| w.parse().ok())
        .collect()
}

/// Issue 26: the workers' start-up lasts until every worker built its workload (a model, a Python worker's
/// imports), not until its hello; the init bootstrap is the weights' transfer alone.
#[test]
fn a_slow_workload_build_counts_in_the_start_up_not_in_the_init_bootstrap() {
    const BUILD_S: f64 = 1.5;
    let dir = Dir::new();
    let worker = crate::util::example("held_worker");
    let build_s = BUILD_S.to_string();
    let mut args = small();
    args.push("hydra.run.dir=run");
    let out = dir.run_env(
        &args,
        &[
            ("RLSYNC_WORKER", worker.as_os_str()),
            ("RLSYNC_TEST_BUILD_S", std::ffi::OsStr::new(&build_s)),
        ],
    );
    let stdout = out.ok();
    let startup = summary_row(stdout, "workers' start-up")[0];
    let bootstrap = summary_row(stdout, "init bootstrap")[0];
    assert!(
        startup >= BUILD_S && bootstrap < BUILD_S / 2.0,
        "every workload takes {BUILD_S} s to build:\n{stdout}"
    );
    let first = &rows(&dir.join("run/metrics.jsonl"))[0];
    let init = first["time/init_weights"].as_f64().unwrap();
    assert!(init > 0.0 && init < BUILD_S / 2.0, "{first:?}");
}

#[test]
fn without_a_terminal_the_run_logs_progress_worker_output_and_a_summary_naming_its_files() {
    let dir = Dir::new();
    let out = run(&dir, &["hydra.run.dir=run"]);
    let stdout = out.ok();
    // stderr is a pipe here: progress lines, not a bar.
    assert!(
        out.stderr.contains("step 1/2 | return ") && out.stderr.contains("env steps/s | ETA "),
        "{}",
        out.stderr
    );
    let run_dir = std::fs::canonicalize(dir.join("run")).unwrap();
    for (row, want) in [
        ("run dir", run_dir.clone()),
        ("metrics", run_dir.join("metrics.jsonl")),
        ("tensorboard", run_dir.join("tensorboard")),
        ("last checkpoint", run_dir.join("checkpoints/global_step_2")),
    ] {
        let line = stdout
            .lines()
            .find(|l| l.trim_start().starts_with(row))
            .unwrap_or_else(|| panic!("no {row} row:\n{stdout}"));
        assert!(line.ends_with(&want.display().to_string()), "{line}");
    }
    let trainer = std::fs::read_to_string(dir.join("run/logs/trainer-0.log")).unwrap_or_default();
    assert!(
        trainer.contains("trainer ready"),
        "trainer log: {trainer:?}"
    );
    let rollout = std::fs::read_to_string(dir.join("run/logs/rollout-1.log")).unwrap_or_default();
    assert!(
        rollout.contains("weights received"),
        "rollout log: {rollout:?}"
    );
    let log = std::fs::read_to_string(dir.join("run/train_embodied.log")).unwrap_or_default();
    assert!(log.contains("][rlsync][INFO] - step 2/2 |"), "{log}");
    assert!(
        log.contains("last checkpoint"),
        "the summary is in the job log: {log}"
    );
}

#[test]
fn multirun_prints_hydras_launcher_lines_and_the_sweep_dir() {
    let dir = Dir::new();
    let out = run(
        &dir,
        &["-m", "hydra.sweep.dir=sweep", "runner.max_steps=1,2"],
    );
    let stdout = out.ok();
    let text: Vec<&str> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("[HYDRA] "))
        .collect();
    let sweep = std::fs::canonicalize(dir.join("sweep")).unwrap();
    assert_eq!(text.len(), 4, "{stdout}");
    assert_eq!(text[0], "Launching 2 jobs locally");
    assert_eq!(text[1], format!("Sweep output dir : {}", sweep.display()));
    // Each job's task overrides, as Hydra lists them (no hydra.* ones).
    for (k, line) in text[2..].iter().enumerate() {
        let prefix = format!("\t#{k} : model@actor.model=synthetic_small ");
        let suffix = format!(" rollout.chunk_steps=4 runner.max_steps={}", k + 1);
        assert!(
            line.starts_with(&prefix) && line.ends_with(&suffix) && !line.contains("hydra."),
            "{line:?}"
        );
    }
    assert_eq!(rows(&dir.join("sweep/1/metrics.jsonl")).len(), 2);
}

#[test]
fn only_eval_evaluates_the_checkpoint_on_the_rollouts_and_trains_nothing() {
    let dir = Dir::new();
    run(&dir, &["hydra.run.dir=first"]).ok();
    let ckpt = format!(
        "runner.resume_dir={}",
        dir.join("first/checkpoints/global_step_2").display()
    );
    run(
        &dir,
        &["hydra.run.dir=eval", "runner.only_eval=true", ckpt.as_str()],
    )
    .ok();
    let got = rows(&dir.join("eval/metrics.jsonl"));
    assert_eq!(got.len(), 1, "{got:?}");
    let row = &got[0];
    assert_eq!(row["step"], 2);
    assert_eq!(row["eval/version"], 2, "the checkpoint's version: {row:?}");
    assert_eq!(
        row["eval/episodes"], 0,
        "the synthetic workload has no episodes"
    );
    assert!(row.get("train/loss").is_none(), "nothing trained: {row:?}");
    assert!(!dir.join("eval/checkpoints").exists(), "nothing to save");
}
