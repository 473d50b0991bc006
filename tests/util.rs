//! Fixture helper for integration tests: a temporary config tree and a way to run the `rlsync` binary in it.

use std::path::{Path, PathBuf};
use std::process::Command;

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
        let out = Command::new(bin())
            .args(args)
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
