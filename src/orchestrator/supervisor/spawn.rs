//! Starting one worker process: own process group, stdin null, death signal tied to the orchestrator,
//! stdout/stderr pumped line by line into `<run_dir>/logs/<role>-<rank>.log` and onto the console.

use std::collections::VecDeque;
use std::io::Write;
use std::path::Path;
use std::process::Stdio;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::process::{Child, Command};

use crate::orchestrator::metrics::progress::Console;
use crate::orchestrator::supervisor::WorkerId;

/// Lines of a worker's log kept in memory to quote when it fails.
pub const TAIL_LINES: usize = 20;

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

    pub fn lines(&self) -> Vec<String> {
        self.0
            .lock()
            .map(|tail| tail.iter().cloned().collect())
            .unwrap_or_default()
    }
}

/// Spawn `exe worker --role R --rank N --run-dir D`. `pgid`: `None` makes the child the leader of a new
/// process group; `Some(g)` puts it into the run's group `g`.
pub fn spawn_worker(
    exe: &Path,
    id: WorkerId,
    run_dir: &Path,
    pgid: Option<i32>,
) -> std::io::Result<Child> {
    let mut cmd = Command::new(exe);
    cmd.arg("worker")
        .args(["--role", id.role.name(), "--rank", &id.rank.to_string()])
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
}
