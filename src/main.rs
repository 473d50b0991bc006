//! The `rlsync` binary: parse the command line, run the app, and decide the exit code (nowhere else does).

use std::process::ExitCode;

fn main() -> ExitCode {
    let args = match rlsync::cli::utf8_args() {
        Ok(args) => args,
        Err(raw) => {
            hydra_compose::stdio::err(format_args!("Error: argument {raw:?} is not valid UTF-8\n"));
            return rlsync::cli::ExitStatus::Failure.into();
        }
    };
    match rlsync::cli::run(&args) {
        Ok(code) => code.into(),
        Err(err) => {
            hydra_compose::stdio::err(format_args!("{}\n", rlsync::cli::error_text(&err)));
            rlsync::cli::ExitStatus::Failure.into()
        }
    }
}
