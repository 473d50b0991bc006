//! The single integration test binary: one module per area, plus the shared fixture helper.

mod cli;
mod transport;
mod util;
