//! Starting one worker process: own process group, stdin null, death signal tied to the orchestrator,
//! stdout/stderr pumped line by line into `<run_dir>/logs/<role>-<rank>.log` and onto the console.

use std::collections::VecDeque;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::process::{Child, Command};

use crate::config::schema::{WorkerConfig, WorkerKind};
use crate::orchestrator::metrics::progress::Console;
use crate::orchestrator::supervisor::WorkerId;

/// Lines of a worker's log kept in memory to quote when it fails.
pub const TAIL_LINES: usize = 20;
/// Bytes of one tail line a node agent sends up with a lost rollout (longer lines are cut, marked `…`), so a
/// `lost` report carries at most [`TAIL_LINES`] × this much of its log.
pub const TAIL_LINE_BYTES: usize = 512;

/// The last [`TAIL_LINES`] of `lines`, each cut to [`TAIL_LINE_BYTES`] (on a character boundary): what may
/// cross the node link, and what node 0 accepts from it.
pub fn bounded_tail(lines: Vec<String>) -> Vec<String> {
    let skip = lines.len().saturating_sub(TAIL_LINES);
    lines
        .into_iter()
        .skip(skip)
        .map(|mut line| {
            if line.len() > TAIL_LINE_BYTES {
                let mut end = TAIL_LINE_BYTES - '…'.len_utf8();
                while !line.is_char_boundary(end) {
                    end -= 1;
                }
                line.truncate(end);
                line.push('…');
            }
            line
        })
        .collect()
}

/// The last lines a worker printed, shared between its log pumps and the supervisor.
#[derive(Debug, Clone, Default)]
pub struct LogTail(Arc<Mutex<VecDeque<String>>>);

impl LogTail {
    fn push(&self, line: String) {
        if let Ok(mut tail) = self.0.lock() {
            if tail.len() == TAIL_LINES {
                tail.pop_front();
            }
            tail.push_back(line);
        }
    }

    /// Put `lines` in place of what it holds (a remote worker's tail, as its agent sent it).
    pub fn replace(&self, lines: Vec<String>) {
        if let Ok(mut tail) = self.0.lock() {
            *tail = bounded_tail(lines).into();
        }
    }

    pub fn lines(&self) -> Vec<String> {
        self.0
            .lock()
            .map(|tail| tail.iter().cloned().collect())
            .unwrap_or_default()
    }
}

/// The program a worker process runs; both speak the same control protocol and take the same arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Program {
    /// `EXE worker --role R --rank N --run-dir D`: the rlsync binary's built-in worker.
    Rlsync(PathBuf),
    /// `INTERPRETER -m rlsync.worker --role R --rank N --run-dir D`: a Python worker through the `rlsync`
    /// package, with `path` in front of `PYTHONPATH`. The interpreter is exec'd directly (no shell), so the
    /// pid the supervisor spawned is the pid that says hello.
    Python {
        interpreter: PathBuf,
        path: Vec<PathBuf>,
    },
}

impl Program {
    /// The program for a role's `worker` config; `exe` is the rlsync binary (for `builtin`).
    pub fn for_worker(worker: &WorkerConfig, exe: &Path) -> Program {
        match worker.kind {
            WorkerKind::Builtin => Program::Rlsync(exe.to_owned()),
            WorkerKind::Python => Program::Python {
                interpreter: worker.python.clone().unwrap_or_else(default_python),
                path: worker.path.clone(),
            },
        }
    }

    /// The executable, for error messages.
    pub fn executable(&self) -> &Path {
        match self {
            Program::Rlsync(exe) => exe,
            Program::Python { interpreter, .. } => interpreter,
        }
    }

    fn command(&self) -> Command {
        match self {
            Program::Rlsync(exe) => {
                let mut cmd = Command::new(exe);
                cmd.arg("worker");
                cmd
            }
            Program::Python { interpreter, path } => {
                let mut cmd = Command::new(interpreter);
                cmd.args(["-m", "rlsync.worker"]);
                if let Some(joined) = python_path(path, std::env::var_os("PYTHONPATH")) {
                    cmd.env("PYTHONPATH", joined);
                }
                cmd
            }
        }
    }
}

/// `path` in front of the inherited `PYTHONPATH` (`None`: nothing to set, or an entry holds the separator).
pub(crate) fn python_path(
    path: &[PathBuf],
    inherited: Option<std::ffi::OsString>,
) -> Option<std::ffi::OsString> {
    let inherited: Vec<PathBuf> = inherited
        .map(|v| std::env::split_paths(&v).collect())
        .unwrap_or_default();
    let all: Vec<&PathBuf> = path
        .iter()
        .chain(&inherited)
        .filter(|p| !p.as_os_str().is_empty())
        .collect();
    if all.is_empty() {
        return None;
    }
    std::env::join_paths(all).ok()
}

/// The active venv's interpreter (`$VIRTUAL_ENV/bin/python`), else `python3` from `PATH`.
pub(crate) fn default_python() -> PathBuf {
    match std::env::var_os("VIRTUAL_ENV") {
        Some(venv) if !venv.is_empty() => PathBuf::from(venv).join("bin").join("python"),
        _ => PathBuf::from("python3"),
    }
}

/// Spawn `PROGRAM --role R --rank N --run-dir D` (see [`Program`]). `pgid`: `None` makes the child the
/// leader of a new process group; `Some(g)` puts it into the run's group `g`.
pub fn spawn_worker(
    program: &Program,
    id: WorkerId,
    run_dir: &Path,
    pgid: Option<i32>,
) -> std::io::Result<Child> {
    let mut cmd = program.command();
    cmd.args(["--role", id.role.name(), "--rank", &id.rank.to_string()])
        .arg("--run-dir")
        .arg(run_dir)
        .env("RLSYNC_WORKER", id.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .process_group(pgid.unwrap_or(0));
    let parent = std::process::id();
    // SAFETY: only async-signal-safe calls (prctl, getppid, _exit) run between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            // Die with the orchestrator even if it is SIGKILLed and cannot stop us itself.
            if libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0,
                0,
                0,
            ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            // The orchestrator may have died before prctl took effect.
            if libc::getppid() as u32 != parent {
                libc::_exit(1);
            }
            Ok(())
        });
    }
    cmd.spawn()
}

/// Copy a worker's output into its log file, the console (prefixed) and its in-memory tail.
pub fn pump_lines<R>(
    stream: R,
    id: WorkerId,
    log: Arc<Mutex<std::fs::File>>,
    tail: LogTail,
    console: Console,
) where
    R: AsyncRead + Unpin + Send + 'static,
{
    tokio::spawn(async move {
        let mut reader = BufReader::new(stream);
        let mut buf = Vec::new();
        loop {
            buf.clear();
            match reader.read_until(b'\n', &mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    let line = String::from_utf8_lossy(&buf).trim_end().to_owned();
                    if let Ok(mut file) = log.lock() {
                        let _ = writeln!(file, "{line}");
                    }
                    console.println(&format!("[{id}] {line}"));
                    tail.push(line);
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_path_puts_the_configured_dirs_in_front_of_the_inherited_ones() {
        let got = python_path(&["/a".into(), "/b".into()], Some("/c:/d".into())).unwrap();
        assert_eq!(got, "/a:/b:/c:/d");
        assert_eq!(python_path(&[], Some("".into())), None);
        assert_eq!(python_path(&["/a".into()], None).unwrap(), "/a");
    }

    #[test]
    fn tail_keeps_the_last_lines() {
        let tail = LogTail::default();
        for i in 0..TAIL_LINES + 5 {
            tail.push(format!("line {i}"));
        }
        let lines = tail.lines();
        assert_eq!(lines.len(), TAIL_LINES);
        assert_eq!(lines.first().map(String::as_str), Some("line 5"));
        assert_eq!(
            lines.last().map(String::as_str),
            Some(format!("line {}", TAIL_LINES + 4).as_str())
        );
    }

    #[test]
    fn a_tail_sent_over_the_node_link_is_bounded() {
        let mut lines: Vec<String> = (0..TAIL_LINES + 3).map(|i| format!("line {i}")).collect();
        lines.push("é".repeat(TAIL_LINE_BYTES));
        let tail = LogTail::default();
        tail.replace(lines);
        let got = tail.lines();
        assert_eq!(got.len(), TAIL_LINES);
        assert_eq!(got[0], "line 4");
        let long = got.last().unwrap();
        assert!(
            long.len() <= TAIL_LINE_BYTES && long.ends_with('…'),
            "{long}"
        );
        assert!(long.starts_with("éé"));
    }
}
