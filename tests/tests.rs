//! The single integration test binary: one module per area, plus the shared fixture helper.

mod cli;
#[cfg(feature = "torch")]
mod learner;
mod orchestrator;
mod run_experience;
mod sync_shm;
mod transport;
mod util;
