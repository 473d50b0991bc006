//! The module's one tokio runtime per process: sockets (shm channel control) are bound to the runtime that
//! created them, so every blocking call into the crate runs on this one (from whichever Python thread calls it).
//!
//! A `fork`ed child (Python's `multiprocessing` with the fork start method) inherits the parent's runtime without
//! its worker thread, so nothing scheduled on it would ever run: the child builds its own on first use and leaves
//! the inherited one alone (leaked; dropping it would wait for a thread that does not exist there). Objects made
//! before the fork stay bound to the parent's runtime and are not usable in the child.

use std::sync::atomic::{AtomicPtr, Ordering};

use pyo3::PyResult;
use pyo3::exceptions::PyRuntimeError;

/// A runtime and the process that built it.
struct Owned {
    pid: u32,
    rt: tokio::runtime::Runtime,
}

/// The current process's runtime (null before the first use); each one is leaked, so a pointer read here stays
/// valid for the life of the process. A lock-free slot: a lock held by another thread at the fork would stay
/// held forever in the child.
static CURRENT: AtomicPtr<Owned> = AtomicPtr::new(std::ptr::null_mut());

/// This process's shared runtime (one worker thread drives background socket tasks; callers `block_on` it).
pub fn get() -> PyResult<&'static tokio::runtime::Runtime> {
    let pid = std::process::id();
    let seen = CURRENT.load(Ordering::Acquire);
    // SAFETY: a non-null pointer in `CURRENT` comes from `Box::leak` below and is never freed.
    if let Some(owned) = unsafe { seen.as_ref() }
        && owned.pid == pid
    {
        return Ok(&owned.rt);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("rlsync-io")
        .enable_all()
        .build()
        .map_err(|e| PyRuntimeError::new_err(format!("cannot start rlsync's runtime: {e}")))?;
    let mine: *mut Owned = Box::leak(Box::new(Owned { pid, rt }));
    match CURRENT.compare_exchange(seen, mine, Ordering::AcqRel, Ordering::Acquire) {
        // SAFETY: `mine` was just leaked and is now published; never freed.
        Ok(_) => Ok(unsafe { &(*mine).rt }),
        Err(won) => {
            // Another thread of this process installed one first: use it, and drop ours (its thread is alive
            // here, so dropping it shuts it down cleanly).
            // SAFETY: `mine` was leaked above and never published, so this is its only owner.
            drop(unsafe { Box::from_raw(mine) });
            // SAFETY: `won` is non-null (the exchange failed, so another thread replaced `seen` with its own
            // leaked runtime) and never freed.
            match unsafe { won.as_ref() } {
                Some(owned) if owned.pid == pid => Ok(&owned.rt),
                _ => Err(PyRuntimeError::new_err(
                    "cannot start rlsync's runtime: another process's runtime in this one",
                )),
            }
        }
    }
}
