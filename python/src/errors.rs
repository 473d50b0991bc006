//! Python exception classes of `rlsync` and the conversion of crate errors into them (message = the Rust
//! error and each of its causes, once).

use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use rlsync_core::gpu::GpuError;
use rlsync_core::host_shared::HostSharedError;
use rlsync_core::syncer::SyncError;
use rlsync_core::tensor::BorrowError;
use rlsync_core::transport::TransportError as CoreTransportError;

create_exception!(
    rlsync,
    RlsyncError,
    PyRuntimeError,
    "Base class of rlsync's errors (the message carries the Rust cause)."
);
create_exception!(
    rlsync,
    PayloadRejected,
    RlsyncError,
    "A received payload was corrupt, truncated, replayed, stale or did not fit; weights and version are untouched."
);
create_exception!(
    rlsync,
    HandshakeError,
    RlsyncError,
    "The sender and the receiver do not agree (state dict keys, shapes, dtypes or syncer kind)."
);
create_exception!(
    rlsync,
    TransportError,
    RlsyncError,
    "Moving bytes failed: the caller's send/recv raised, a peer went away or a wait timed out."
);

create_exception!(
    rlsync,
    Timeout,
    TransportError,
    "A per-call or channel bound ran out: `awaited` (what was awaited), `rank` (int | None), `ranks` (every \
     receiver rank waited on), `version` (int | None) and `seconds` (the bound). Weights and version are untouched."
);

create_exception!(
    rlsync,
    CudaError,
    RlsyncError,
    "CUDA tensors could not be synced: a build without CUDA, no driver, no such device, or a driver call failed."
);

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("CudaError", py.get_type::<CudaError>())?;
    m.add("RlsyncError", py.get_type::<RlsyncError>())?;
    m.add("PayloadRejected", py.get_type::<PayloadRejected>())?;
    m.add("HandshakeError", py.get_type::<HandshakeError>())?;
    m.add("TransportError", py.get_type::<TransportError>())?;
    m.add("Timeout", py.get_type::<Timeout>())?;
    Ok(())
}

/// `err` and its sources on one line, outermost first (each error's message says only its own layer).
pub fn chain(err: &dyn std::error::Error) -> String {
    rlsync_core::error_chain(err)
}

pub fn sync_error(err: &SyncError) -> PyErr {
    let msg = chain(err);
    match err {
        SyncError::Rejected { .. } | SyncError::Unreadable { .. } => PayloadRejected::new_err(msg),
        SyncError::Handshake { .. }
        | SyncError::HandshakeMessage { .. }
        | SyncError::StateMismatch { .. }
        | SyncError::StateCast { .. } => HandshakeError::new_err(msg),
        SyncError::Transport(_) => TransportError::new_err(msg),
        SyncError::Config { .. } | SyncError::NoGpuBackend { .. } => PyValueError::new_err(msg),
        SyncError::Gpu(_) | SyncError::BucketDevice(_) | SyncError::CastScratch { .. } => {
            CudaError::new_err(msg)
        }
        _ => RlsyncError::new_err(msg),
    }
}

/// A host-shared arena's error: a refused update is `PayloadRejected`, the weight channel's other failures as
/// `sync_error` says, the arena's own waits that ran out `rlsync.Timeout` (nothing consumed: the call may be
/// retried; `awaited` names what, e.g. the pids holding the back buffer), bad names and layouts `ValueError`.
pub fn host_shared_error(err: &HostSharedError) -> PyErr {
    let msg = chain(err);
    let ran_out = |what: String, version: Option<u64>, waited: &std::time::Duration| {
        let awaited = Awaited {
            what,
            ranks: Vec::new(),
            version,
            seconds: waited.as_secs_f64(),
        };
        Python::attach(|py| timeout_error(py, msg.clone(), awaited))
    };
    match err {
        HostSharedError::Sync { source, .. } if source.is_rejection() => {
            PayloadRejected::new_err(msg)
        }
        HostSharedError::Sync { source, .. } => sync_error(source),
        HostSharedError::BackBufferHeld {
            name,
            buffer,
            pids,
            waited,
        } => ran_out(
            format!("reader pid(s) {pids:?} to leave buffer {buffer} of arena {name}"),
            None,
            waited,
        ),
        HostSharedError::NotNewer {
            name, than, waited, ..
        } => ran_out(
            format!("a version newer than {than} in arena {name}"),
            Some(than.saturating_add(1)),
            waited,
        ),
        HostSharedError::NotCreated { name, waited } if !waited.is_zero() => {
            ran_out(format!("arena {name} to be created"), None, waited)
        }
        HostSharedError::NotPublished { name, waited } => {
            ran_out(format!("a first version in arena {name}"), None, waited)
        }
        HostSharedError::Name { .. }
        | HostSharedError::Readers { .. }
        | HostSharedError::Layout { .. } => PyValueError::new_err(msg),
        _ => RlsyncError::new_err(msg),
    }
}

/// The timeout inside `err` (itself or one of its causes), if it is one.
pub fn find_timeout<'a>(
    err: &'a (dyn std::error::Error + 'static),
) -> Option<&'a CoreTransportError> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = cur {
        if let Some(t @ CoreTransportError::Timeout { .. }) = e.downcast_ref::<CoreTransportError>()
        {
            return Some(t);
        }
        // `SyncError::Transport` is transparent: its `source()` skips the transport error itself.
        if let Some(SyncError::Transport(t @ CoreTransportError::Timeout { .. })) =
            e.downcast_ref::<SyncError>()
        {
            return Some(t);
        }
        cur = e.source();
    }
    None
}

/// What a timed-out wait was about, for `rlsync.Timeout`'s attributes.
pub struct Awaited {
    /// What was awaited, in words ("payload of version after 3 from the sender").
    pub what: String,
    /// Every receiver rank waited on (empty: the sender).
    pub ranks: Vec<usize>,
    pub version: Option<u64>,
    pub seconds: f64,
}

/// `rlsync.Timeout` with its attributes (the message: `msg`).
pub fn timeout_error(py: Python<'_>, msg: String, awaited: Awaited) -> PyErr {
    let err = Timeout::new_err(msg);
    let value = err.value(py);
    let rank = match awaited.ranks.as_slice() {
        [one] => Some(*one),
        _ => None,
    };
    let set = || -> PyResult<()> {
        value.setattr("awaited", awaited.what)?;
        value.setattr("rank", rank)?;
        value.setattr("ranks", awaited.ranks)?;
        value.setattr("version", awaited.version)?;
        value.setattr("seconds", awaited.seconds)?;
        Ok(())
    };
    match set() {
        Ok(()) => err,
        Err(e) => e,
    }
}

pub fn transport_error(err: &CoreTransportError) -> PyErr {
    TransportError::new_err(chain(err))
}

pub fn borrow_error(err: &BorrowError) -> PyErr {
    PyValueError::new_err(err.to_string())
}

/// A GPU error as `rlsync.CudaError`.
pub fn gpu_error(err: &GpuError) -> PyErr {
    CudaError::new_err(chain(err))
}
