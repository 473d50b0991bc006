//! rlsync-core: weight synchronisation from one trainer to N rollouts, and the control protocol they speak.
//!
//! No tch, no config engine, no processes: the app hands in typed settings ([`syncer::settings`]) and state
//! dicts; the learner and the Python binding build on the same types.
//! - [`tensor`]: named tensors with dtype, shape and role (trainable | buffer | frozen); storage that is owned
//!   or borrowed from the caller; casts, checksums, safetensors files, synthetic model-shaped states.
//! - [`syncer`]: the two ends of a weight sync (patch | bucket) over a [`transport`] channel: init bootstrap,
//!   versions, verify-then-install, rejoin by replay.
//! - [`transport`]: byte channels from one sender to N receivers (in-process, shared memory, TCP chain).
//! - [`protocol`]: the control protocol between orchestrator and workers (framing, messages, named arrays,
//!   the run-token handshake between hosts).
//! - [`gpu`]: CUDA tensors (feature `cuda`, loaded at run time): pinned staging, the patch kernels
//!   (`kernels/rlsync.cu`), their compacted-changes format and CPU reference, device builds and installs.
//! - [`host_shared`]: one double-buffered copy of the weights in shared memory for all rollouts of a host
//!   (an applier installs into the back buffer and flips; readers hold a buffer between their steps).
//! - [`bytes`]: the one little-endian byte reader and writer, and the LEB128 varint.
//! - [`atomic_file`]: a file replaced whole or not at all (checkpoints, local copies, the launch file).
//! - [`error_chain`](mod@error_chain): an error and its causes on one line.

pub mod atomic_file;
pub mod bytes;
mod error_chain;
pub mod gpu;
pub mod host_shared;
pub mod protocol;
pub mod syncer;
pub mod tensor;
pub mod transport;

pub use error_chain::error_chain;
