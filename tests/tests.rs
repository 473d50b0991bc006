//! The single integration test binary: one module per area, plus the shared fixture helper.

mod cli;
mod device_workers;
mod elastic;
mod faults;
mod host_shared;
mod multinode;
mod orchestrator;
mod protocol_doc;
mod run_experience;
mod sync_bridge;
mod sync_shm;
mod tidy;
mod transport;
mod util;
