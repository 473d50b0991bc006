//! `HostSharedReader`: a process's hold on a host-shared arena (the crate's `Reader`), and `host_shared_unlink`.
//!
//! The reader hands Python each tensor's address in both buffers; `rlsync/host_shared.py` builds torch views
//! over them once and swaps a model's tensors between them (`param.data = view`) when the held buffer flips.

use std::sync::{Mutex, MutexGuard, TryLockError};

use pyo3::prelude::*;

use rlsync_core::host_shared::{Applier, Held, Reader};

use crate::errors::{RlsyncError, host_shared_error};
use crate::runtime;
use crate::syncer::timeout;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<HostSharedReader>()?;
    m.add_function(wrap_pyfunction!(host_shared_unlink, m)?)?;
    Ok(())
}

/// One tensor of the arena: `(name, dtype, shape, address in buffer A, address in buffer B, bytes)`.
type Entry = (String, &'static str, Vec<usize>, usize, usize, usize);

/// `(version, sequence, checksum or None, buffer, generation)`.
type HeldTuple = (u64, u64, Option<u64>, u8, u64);

fn tuple(h: Held) -> HeldTuple {
    (h.version, h.sequence, h.checksum, h.buffer, h.generation)
}

/// A reader of a host-shared arena (the crate's `Reader`); `close` (or dropping it) frees its slot.
#[pyclass(module = "rlsync._native", frozen)]
pub struct HostSharedReader {
    reader: Mutex<Option<Reader>>,
}

impl HostSharedReader {
    /// The reader's lock, waited for with the GIL released: `wait_newer` holds it for its whole wait and needs
    /// the GIL back at the end, so a thread waiting for the lock while holding the GIL would deadlock with it.
    fn lock(&self, py: Python<'_>) -> MutexGuard<'_, Option<Reader>> {
        loop {
            match self.reader.try_lock() {
                Ok(g) => return g,
                Err(TryLockError::Poisoned(p)) => return p.into_inner(),
                Err(TryLockError::WouldBlock) => py.detach(|| {
                    drop(self.reader.lock());
                }),
            }
        }
    }

    fn get(&self, py: Python<'_>) -> PyResult<MutexGuard<'_, Option<Reader>>> {
        let g = self.lock(py);
        if g.is_none() {
            return Err(RlsyncError::new_err("this host-shared reader is closed"));
        }
        Ok(g)
    }
}

#[pymethods]
impl HostSharedReader {
    /// Attach to arena `name`, waiting up to `timeout` seconds for it to be created and a version published.
    #[new]
    #[pyo3(signature = (name, timeout = 60.0))]
    fn new(py: Python<'_>, name: String, timeout: f64) -> PyResult<Self> {
        let wait = crate::syncer::timeout(timeout)?;
        let rt = runtime::get()?;
        let reader = py
            .detach(|| rt.block_on(Reader::attach(&name, wait)))
            .map_err(|e| host_shared_error(&e))?;
        Ok(HostSharedReader {
            reader: Mutex::new(Some(reader)),
        })
    }

    /// Every tensor in the arena's order: `(name, dtype, shape, address in A, address in B, bytes)`.
    fn layout(&self, py: Python<'_>) -> PyResult<Vec<Entry>> {
        let g = self.get(py)?;
        let Some(r) = g.as_ref() else {
            return Ok(Vec::new());
        };
        let (a, b) = (r.buffer_state(0), r.buffer_state(1));
        Ok(a.iter()
            .filter_map(|(name, t)| {
                let u = b.get(name)?;
                Some((
                    name.to_owned(),
                    t.dtype().name(),
                    t.shape().to_vec(),
                    t.bytes().as_ptr() as usize,
                    u.bytes().as_ptr() as usize,
                    t.bytes().len(),
                ))
            })
            .collect())
    }

    /// The held version: `(version, sequence, checksum or None, buffer, generation)`.
    #[getter]
    fn held(&self, py: Python<'_>) -> PyResult<HeldTuple> {
        let g = self.get(py)?;
        Ok(g.as_ref().map(|r| tuple(r.held())).unwrap_or_default())
    }

    /// Flip to the newest published version if it is not the held one (never blocks); the new hold or `None`.
    fn refresh(&self, py: Python<'_>) -> PyResult<Option<HeldTuple>> {
        let mut g = self.get(py)?;
        Ok(g.as_mut().and_then(Reader::refresh).map(tuple))
    }

    /// Wait (up to `timeout` seconds, the GIL released) for a version newer than `than`, then hold it.
    fn wait_newer(&self, py: Python<'_>, than: u64, timeout: f64) -> PyResult<HeldTuple> {
        let wait = self::timeout(timeout)?;
        let rt = runtime::get()?;
        let mut g = self.get(py)?;
        let Some(r) = g.as_mut() else {
            return Err(RlsyncError::new_err("this host-shared reader is closed"));
        };
        py.detach(|| rt.block_on(r.wait_newer(than, wait)))
            .map(tuple)
            .map_err(|e| host_shared_error(&e))
    }

    /// Free the slot and unmap the arena (views built over it must not be used afterwards). A `wait_newer` of
    /// another thread finishes first (the GIL is released meanwhile).
    fn close(&self, py: Python<'_>) {
        let reader = self.lock(py).take();
        drop(reader);
    }

    #[getter]
    fn closed(&self, py: Python<'_>) -> bool {
        self.lock(py).is_none()
    }
}

/// Unlink arena `name` (mappings live on until closed); whether there was one.
#[pyfunction]
fn host_shared_unlink(name: &str) -> PyResult<bool> {
    Applier::unlink(name).map_err(|e| host_shared_error(&e))
}
