//! Entry points (`train_embodied`, `train_async`, `bench_sync`, hidden `worker`) and Hydra's command-line flags.

use std::process::ExitCode;

/// The process exit statuses rlsync uses (documented in README.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitStatus {
    /// The job (or `--cfg`, `--info`, `--dry-run`) completed.
    Success,
    /// A configuration, usage or runtime error; the message is on stderr.
    Failure,
}

impl From<ExitStatus> for ExitCode {
    fn from(status: ExitStatus) -> ExitCode {
        match status {
            ExitStatus::Success => ExitCode::SUCCESS,
            ExitStatus::Failure => ExitCode::FAILURE,
        }
    }
}

/// Run rlsync with the arguments after the program name.
pub fn run(args: &[String]) -> anyhow::Result<ExitStatus> {
    match args.first().map(String::as_str) {
        None | Some("-h") | Some("--help") => {
            println!("usage: rlsync <train_embodied|train_async|bench_sync> [HYDRA FLAGS] [OVERRIDES...]");
            Ok(ExitStatus::Success)
        }
        // Hidden: started by the orchestrator's supervisor, never by users.
        Some("worker") => {
            crate::worker::run_worker(args.get(1..).unwrap_or_default())?;
            Ok(ExitStatus::Success)
        }
        Some(other) => anyhow::bail!("'{other}' is not implemented yet"),
    }
}
