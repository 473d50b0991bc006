//! The single integration test binary: every integration test module is declared here.

mod cli;
mod util;
