//! The module's one tokio runtime: sockets (shm channel control) are bound to the runtime that created them,
//! so every blocking call into the crate runs on this one (from whichever Python thread calls it).

use std::sync::OnceLock;

use pyo3::PyResult;
use pyo3::exceptions::PyRuntimeError;

static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();

/// The shared runtime (one worker thread drives background socket tasks; callers `block_on` it).
pub fn get() -> PyResult<&'static tokio::runtime::Runtime> {
    if let Some(rt) = RUNTIME.get() {
        return Ok(rt);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("rlsync-io")
        .enable_all()
        .build()
        .map_err(|e| PyRuntimeError::new_err(format!("cannot start rlsync's runtime: {e}")))?;
    Ok(RUNTIME.get_or_init(|| rt))
}
