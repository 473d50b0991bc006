//! The single integration test binary: one module per area.

mod cli;
mod orchestrator;
mod transport;
mod util;
