//! The single integration test binary: one module per area.

mod sync_shm;
mod transport;
