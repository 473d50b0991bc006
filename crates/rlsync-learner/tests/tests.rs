//! The learner's integration tests: real runs of `rlsync` whose learner workers start from `rlsync-learner`.
//!
//! They run the `rlsync` binary next to this crate's `rlsync-learner` in the target directory: `make test`
//! builds both first (`cargo test --workspace` does too).

mod learner_runs;
/// The app's run fixture, shared (this crate uses part of it).
#[allow(dead_code)]
#[path = "../../../tests/util.rs"]
mod util;
