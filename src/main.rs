//! The `rlsync` binary: parse the command line, run the app, and decide the exit code (nowhere else does).

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match rlsync::cli::run(&args) {
        Ok(code) => code.into(),
        Err(err) => {
            eprintln!("Error: {err:#}");
            rlsync::cli::ExitStatus::Failure.into()
        }
    }
}
