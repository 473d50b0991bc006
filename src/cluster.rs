//! Multi-node runs on the schedulers users already have: which node this process is, and where every worker
//! of the run lives.
//!
//! The scheduler (Slurm, torchrun / PyTorchJob, OpenMPI) starts one `rlsync` per host with the same command
//! line; [`env::detect`] turns the environment it sets into a [`env::NodeIdentity`] (node rank, node count,
//! rendezvous address), with `cluster.*` keys taking precedence. [`placement::resolve`] maps RLinf's
//! `cluster.component_placement` (global slot ranges, `cluster.slots_per_node` slots per node) onto nodes,
//! refusing placements no cluster of that shape can run. Neither spawns, connects or reads anything but its
//! arguments: the environment is passed in as a lookup function, so both are pure and tested here.

pub mod env;
pub mod placement;

pub use env::{ClusterError, NodeIdentity, Scheduler, detect, first_host};
pub use placement::{NodePlacement, PlacedWorker, PlacementError, resolve};

/// This host's name as the kernel knows it (for logs and errors); `"localhost"` if it cannot be read.
pub(crate) fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".to_owned())
}
