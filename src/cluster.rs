//! Multi-node runs on the schedulers users already have: which node this process is.
//!
//! The scheduler (Slurm, torchrun / PyTorchJob, OpenMPI) starts one `rlsync` per host with the same command
//! line; [`env::detect`] turns the environment it sets into a [`env::NodeIdentity`] (node rank, node count,
//! rendezvous address), with `cluster.*` keys taking precedence. It spawns, connects and reads nothing but its
//! arguments: the environment is passed in as a lookup function, so it is pure and tested here. Where every
//! worker lives is a question of the config alone (`config::placement`).

pub mod env;

pub use env::{ClusterError, NodeIdentity, Scheduler, detect, first_host};

/// This host's name as the kernel knows it (for logs and errors); `"localhost"` if it cannot be read.
pub(crate) fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".to_owned())
}
