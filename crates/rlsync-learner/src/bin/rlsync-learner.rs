//! The learner executable: `rlsync`'s workers built with libtorch, started by the supervisor for learner models.
//!
//! `make build` builds `rlsync` (no libtorch: every command that does not train starts in milliseconds) and this
//! executable next to it; the supervisor starts learner workers from here (`rlsync-learner worker --role …
//! --rank … --run-dir …`), so only they load libtorch. It accepts nothing else.

use std::process::ExitCode;

fn main() -> ExitCode {
    let args = match rlsync::cli::utf8_args() {
        Ok(args) => args,
        Err(raw) => {
            eprintln!("Error: argument {raw:?} is not valid UTF-8");
            return ExitCode::FAILURE;
        }
    };
    let Some(("worker", rest)) = args
        .split_first()
        .map(|(first, rest)| (first.as_str(), rest))
    else {
        eprintln!(
            "usage: rlsync-learner worker --role trainer|rollout --rank R --run-dir DIR\n\
             rlsync-learner runs rlsync's learner workers; the supervisor of `rlsync train_embodied` starts it"
        );
        return ExitCode::from(2);
    };
    match rlsync::worker::run_worker_with(
        rest,
        Box::new(|ctx| rlsync_learner::workload::build(ctx.config(), &ctx.placement())),
    ) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("{}", rlsync::cli::error_text(&err.into()));
            ExitCode::FAILURE
        }
    }
}
