//! `rlsync._native`: the PyO3 extension module behind the `rlsync` Python package (registration only).
//!
//! All logic lives in the `rlsync` crate; each module here converts Python objects to the crate's types and
//! back. The Python package (`python/rlsync/`) wraps these classes in typed, documented async APIs.
//!
//! - [`errors`]: the exception classes and the conversion of crate errors into them.
//! - [`runtime`]: the one tokio runtime that owns every socket the module opens.
//! - [`syncer`]: weight syncers over torch tensors' memory (`NativeSyncer`, `Op`, shm channel ends).
//! - [`worker`]: Python workers run by rlsync (`run_worker`) and the named-array trajectory codec.
//! - [`device`]: CUDA tensors: a syncer's device side (host copies, stream) and `cuda_available()`.
//! - [`ipc`]: the same-host GPU channel (`CudaIpcSender` / `CudaIpcReceiver`, CUDA IPC of the diff output).
//! - [`payload`]: device payloads (`DevicePayloadSender` / `DevicePayloadReceiver`, a patch syncer's
//!   `transport_device="cuda"`: the diff output in a CUDA tensor handed to the caller's `send`).
//! - [`checkpoint`]: a Python trainer's own state (`state_dict()`) in `optimizer.safetensors`.
//! - [`host_shared`]: a reader of a host-shared arena (`HostSharedReader`) and the arena's unlink.
//! - [`tcp`]: rlsync's TCP channel ends across hosts (`TcpSender` / `TcpReceiver`).

mod checkpoint;
mod device;
mod errors;
mod host_shared;
mod ipc;
mod payload;
mod runtime;
mod syncer;
mod tcp;
mod worker;

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    errors::register(m)?;
    checkpoint::register(m)?;
    syncer::register(m)?;
    tcp::register(m)?;
    worker::register(m)?;
    ipc::register(m)?;
    payload::register(m)?;
    host_shared::register(m)?;
    m.add_function(wrap_pyfunction!(device::cuda_available, m)?)?;
    Ok(())
}
