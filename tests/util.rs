//! The integration tests' one fixture: the `rlsync` binary, a temporary config tree to run it in, and a run's
//! scratch space (start it with args and env, wait with a deadline, collect its output, its processes, and
//! what is left of it: processes, shm segments, sockets).

use std::ffi::OsStr;
use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The `rlsync` binary under test: Cargo names it to the app's own tests; the tests of the other crates of
/// the workspace find it next to their test executable's directory (`target/<profile>/rlsync`).
pub fn bin() -> PathBuf {
    if let Some(bin) = option_env!("CARGO_BIN_EXE_rlsync") {
        return PathBuf::from(bin);
    }
    let exe =
        std::env::current_exe().unwrap_or_else(|e| panic!("cannot find this test executable: {e}"));
    let bin = exe
        .parent()
        .and_then(Path::parent)
        .map(|profile| profile.join("rlsync"))
        .unwrap_or_else(|| panic!("{} has no target directory", exe.display()));
    assert!(
        bin.is_file(),
        "{} is not built: build it first (`cargo build --release -p rlsync`; `make test` does)",
        bin.display()
    );
    bin
}

/// The example executable `name`, next to the `rlsync` under test (`cargo test` builds the examples).
pub fn example(name: &str) -> PathBuf {
    let exe = bin()
        .parent()
        .map(|dir| dir.join("examples").join(name))
        .unwrap_or_else(|| panic!("the rlsync under test has no directory"));
    assert!(
        exe.is_file(),
        "{} is not built (make test-rust builds it: cargo build --release -p rlsync --example held_worker)",
        exe.display()
    );
    exe
}

/// The repository's root directory (README.md, examples/, config/).
pub fn repo_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest
        .ancestors()
        .find(|dir| dir.join("Cargo.lock").is_file())
        .unwrap_or(manifest)
        .to_owned()
}

/// A temporary directory holding config files; `rlsync` runs with it as the working directory.
pub struct Dir {
    tmp: tempfile::TempDir,
}

/// The small synthetic model and envs of the embedded configs (no libtorch needed): the overrides that follow an
/// entry point (`train_embodied`, `train_async`) in the tests' short runs.
pub const SMALL_SYNTHETIC: &[&str] = &[
    "model@actor.model=synthetic_small",
    "env@env.train=synthetic",
    "env@env.eval=synthetic",
    "actor.model.params=65536",
    "actor.model.tensors=8",
    "env.train.total_num_envs=4",
    "env.eval.total_num_envs=4",
    "env.train.max_steps_per_rollout_epoch=8",
    "rollout.chunk_steps=4",
];

/// What one run of the binary produced.
#[derive(Debug)]
pub struct Output {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl Output {
    pub fn success(&self) -> bool {
        self.code == Some(0)
    }

    /// Assert success and return stdout.
    #[track_caller]
    pub fn ok(&self) -> &str {
        assert!(
            self.success(),
            "rlsync failed ({:?}):\nstdout:\n{}\nstderr:\n{}",
            self.code,
            self.stdout,
            self.stderr
        );
        &self.stdout
    }

    /// Assert failure and return stderr.
    #[track_caller]
    pub fn err(&self) -> &str {
        assert!(
            !self.success(),
            "rlsync unexpectedly succeeded:\nstdout:\n{}",
            self.stdout
        );
        &self.stderr
    }
}

impl Dir {
    pub fn new() -> Dir {
        Dir {
            tmp: tempfile::tempdir().unwrap_or_else(|e| panic!("cannot create a temp dir: {e}")),
        }
    }

    /// Write `contents` at `rel` (parents created).
    pub fn create(&self, rel: &str, contents: &str) -> &Dir {
        let path = self.tmp.path().join(rel);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)
                .unwrap_or_else(|e| panic!("cannot create {}: {e}", parent.display()));
        }
        std::fs::write(&path, contents)
            .unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
        self
    }

    pub fn join(&self, rel: &str) -> PathBuf {
        self.tmp.path().join(rel)
    }

    /// Run `rlsync <args>` in this directory.
    pub fn run(&self, args: &[&str]) -> Output {
        self.run_env(args, &[])
    }

    /// Run `rlsync <args>` in this directory with `env` added to its environment.
    pub fn run_env(&self, args: &[&str], env: &[(&str, &OsStr)]) -> Output {
        let out = Command::new(bin())
            .args(args)
            .envs(env.iter().copied())
            .current_dir(self.tmp.path())
            .output()
            .unwrap_or_else(|e| panic!("cannot run rlsync: {e}"));
        Output {
            code: out.status.code(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }

    /// Run `rlsync train_embodied -cp <this dir> -cn <name> <args>`.
    pub fn compose(&self, name: &str, args: &[&str]) -> Output {
        let cp = self.tmp.path().display().to_string();
        let mut all = vec!["train_embodied", "-cp", cp.as_str(), "-cn", name];
        all.extend_from_slice(args);
        self.run(&all)
    }
}

/// Generous bound of one run, or of one wait on it (the machine may be shared and loaded); only a hang hits it.
pub const PATIENCE: Duration = Duration::from_secs(180);

/// Trials per case of the fault campaigns (`RLSYNC_FAULT_TRIALS`, default 1).
pub fn trials() -> usize {
    std::env::var("RLSYNC_FAULT_TRIALS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|n| *n > 0)
        .unwrap_or(1)
}

/// One run's scratch space: its run dir and a private TMPDIR (so what is left there is exactly the run's).
pub struct Scratch {
    dir: tempfile::TempDir,
    pub run_dir: PathBuf,
    pub tmp: PathBuf,
}

impl Scratch {
    /// A scratch directory `/tmp/<prefix>…` (short: socket paths under it stay within their limit).
    pub fn new(prefix: &str) -> Scratch {
        let dir = tempfile::Builder::new()
            .prefix(prefix)
            .tempdir_in("/tmp")
            .unwrap_or_else(|e| panic!("cannot create a scratch dir: {e}"));
        let run_dir = dir.path().join("run");
        let tmp = dir.path().join("t");
        std::fs::create_dir(&tmp)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", tmp.display()));
        Scratch { dir, run_dir, tmp }
    }

    /// The scratch directory itself (room for a test's own files).
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// `rlsync <args>` with this run dir (`hydra.run.dir`, after `args`) and TMPDIR; stdin and stdout null,
    /// stderr piped (for [`finish`]).
    pub fn command<I, S>(&self, args: I) -> Command
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut cmd = Command::new(bin());
        cmd.args(args)
            .arg(format!("hydra.run.dir={}", self.run_dir.display()))
            .env("TMPDIR", &self.tmp)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        cmd
    }

    /// The run's `metrics.jsonl` records (lines that are no JSON object are skipped).
    pub fn metrics(&self) -> Vec<serde_json::Map<String, serde_json::Value>> {
        metrics_of(&self.run_dir)
    }

    /// Lines of the run's `metrics.jsonl` so far.
    pub fn metrics_lines(&self) -> usize {
        std::fs::read_to_string(self.run_dir.join("metrics.jsonl"))
            .map(|t| t.lines().count())
            .unwrap_or(0)
    }

    /// What is left of a run over `run_dirs` (node 0's first: this run dir) with this private TMPDIR:
    /// see [`leftovers`].
    pub fn leftovers_of(&self, run_dirs: &[PathBuf]) -> Vec<String> {
        leftovers(run_dirs, Tmp::Private(&self.tmp))
    }

    /// What is left of a one-node run in this scratch space: see [`leftovers`].
    pub fn leftovers(&self) -> Vec<String> {
        self.leftovers_of(std::slice::from_ref(&self.run_dir))
    }
}

/// The `metrics.jsonl` records of the run in `run_dir` (lines that are no JSON object are skipped).
pub fn metrics_of(run_dir: &Path) -> Vec<serde_json::Map<String, serde_json::Value>> {
    std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// The shared-memory name prefix of the run in `run_dir` (from its launch file).
pub fn segment_prefix(run_dir: &Path) -> Option<String> {
    let bytes = std::fs::read(run_dir.join(".rlsync/launch.json")).ok()?;
    let v: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    v["segment_prefix"].as_str().map(str::to_owned)
}

/// The TMPDIR a run ran with.
#[derive(Debug, Clone, Copy)]
pub enum Tmp<'a> {
    /// The run's own: whatever is in it is the run's.
    Private(&'a Path),
    /// Shared with others (the test process's): the run's entries are those naming its segment prefix.
    Shared(&'a Path),
}

/// What is left of a run over `run_dirs` (each node's run dir, node 0's first), each as a line: processes
/// naming node 0's run dir (waited for up to 10 s), the run's entries in its TMPDIR (sockets, private
/// dirs), its rollouts' local weights copies and its shm segments.
pub fn leftovers(run_dirs: &[PathBuf], tmp: Tmp<'_>) -> Vec<String> {
    let running = || -> Vec<(u32, String)> {
        run_dirs
            .first()
            .map(|d| processes_naming(d))
            .unwrap_or_default()
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while !running().is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut left: Vec<String> = running()
        .into_iter()
        .map(|(pid, cmd)| format!("process {pid}: {cmd}"))
        .collect();
    let prefixes: Vec<String> = run_dirs.iter().filter_map(|d| segment_prefix(d)).collect();
    let named = |name: &str| prefixes.iter().any(|p| name.contains(p.as_str()));
    let (tmp, shared) = match tmp {
        Tmp::Private(dir) => (dir, false),
        Tmp::Shared(dir) => (dir, true),
    };
    if let Ok(rd) = std::fs::read_dir(tmp) {
        left.extend(
            rd.flatten()
                .filter(|e| !shared || named(&e.file_name().to_string_lossy()))
                .map(|e| format!("{}", e.path().display())),
        );
    }
    // The rollouts' local weights copies (kept for a restart) are removed at the run's end.
    for dir in run_dirs {
        if let Ok(rd) = std::fs::read_dir(dir.join(".rlsync")) {
            left.extend(
                rd.flatten()
                    .filter(|e| e.file_name().to_string_lossy().starts_with("rollout-"))
                    .map(|e| format!("{}", e.path().display())),
            );
        }
    }
    if let Ok(rd) = std::fs::read_dir("/dev/shm") {
        left.extend(
            rd.flatten()
                .filter(|e| {
                    let name = e.file_name().to_string_lossy().into_owned();
                    prefixes.iter().any(|p| name.starts_with(p.as_str()))
                })
                .map(|e| format!("{}", e.path().display())),
        );
    }
    left
}

/// All of `child`'s stderr (it is piped; read to its end).
pub fn stderr_of(child: &mut Child) -> String {
    let mut text = String::new();
    if let Some(mut err) = child.stderr.take() {
        let _ = err.read_to_string(&mut text);
    }
    text
}

/// Wait for `child` (killing it after [`PATIENCE`]): its exit code (None: killed by a signal) and its stderr,
/// drained meanwhile so that a chatty child never blocks on a full pipe.
pub fn finish(mut child: Child) -> Result<(Option<i32>, String), String> {
    let deadline = Instant::now() + PATIENCE;
    let mut err = child.stderr.take();
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        if let Some(err) = err.as_mut() {
            let _ = err.read_to_string(&mut text);
        }
        text
    });
    let status = loop {
        if let Some(status) = child.try_wait().map_err(|e| e.to_string())? {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("still running after {PATIENCE:?}: killed"));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Ok((status.code(), reader.join().unwrap_or_default()))
}

/// Wait until `cond` holds (polling), the run `child` ended (its stderr says why), or [`PATIENCE`] passed.
pub fn wait_until(child: &mut Child, what: &str, cond: impl Fn() -> bool) -> Result<(), String> {
    let deadline = Instant::now() + PATIENCE;
    while !cond() {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!(
                "the run ended ({status}) before {what}: {}",
                stderr_of(child)
            ));
        }
        if Instant::now() > deadline {
            return Err(format!("no {what} within {PATIENCE:?}"));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(())
}

/// The run's worker processes (their command lines name `run_dir` via `--run-dir`).
pub fn workers_of(run_dir: &Path) -> Vec<(u32, String)> {
    processes_naming(run_dir)
        .into_iter()
        .filter(|(_, cmdline)| cmdline.contains(" worker "))
        .collect()
}

/// The pid of the run's worker `<role>-<rank>` now (on whichever node), if it runs.
pub fn worker_pid(run_dir: &Path, role: &str, rank: u32) -> Option<i32> {
    let needle = format!("--role {role} --rank {rank} ");
    workers_of(run_dir)
        .into_iter()
        .find(|(_, cmd)| cmd.contains(&needle))
        .map(|(pid, _)| pid as i32)
}

/// Live processes (zombies aside) other than this test whose command line names `dir`: the processes of a run
/// in that directory (the orchestrator's `hydra.run.dir`, every worker's `--run-dir`).
pub fn processes_naming(dir: &std::path::Path) -> Vec<(u32, String)> {
    let needle = dir.to_string_lossy().into_owned();
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return found;
    };
    for entry in entries.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(raw) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&raw).replace('\0', " ");
        let zombie = std::fs::read_to_string(entry.path().join("stat")).is_ok_and(|s| {
            s.rsplit_once(')')
                .is_some_and(|(_, r)| r.trim_start().starts_with('Z'))
        });
        if cmdline.contains(&needle) && pid != std::process::id() && !zombie {
            found.push((pid, cmdline));
        }
    }
    found
}
