//! The TCP fan-out channel ends (`TcpSender`, `TcpReceiver`: rlsync's authenticated channel across hosts, 1 -> N),
//! before a syncer takes one over at `init_sender` / `init_receiver`, like the shm channel's ends.

use std::sync::Mutex;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use rlsync_core::transport::{self, TcpFanConfig, TcpFanReceiver, TcpFanSender};

use crate::errors::{RlsyncError, transport_error};
use crate::runtime;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<TcpSender>()?;
    m.add_class::<TcpReceiver>()?;
    m.add_function(wrap_pyfunction!(tcp_bind, m)?)?;
    m.add_function(wrap_pyfunction!(tcp_connect, m)?)?;
    Ok(())
}

/// The sending end of rlsync's TCP channel (1 -> N receivers on any hosts).
#[pyclass(module = "rlsync._native", frozen)]
pub struct TcpSender {
    end: Mutex<Option<transport::Sender>>,
    receivers: usize,
    addr: String,
}

/// A receiving end of rlsync's TCP channel.
#[pyclass(module = "rlsync._native", frozen)]
pub struct TcpReceiver {
    end: Mutex<Option<transport::Receiver>>,
    rank: usize,
}

fn used() -> PyErr {
    RlsyncError::new_err("this channel end is already used by a syncer (one syncer per channel)")
}

impl TcpSender {
    pub(crate) fn take(&self) -> PyResult<transport::Sender> {
        self.end
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .ok_or_else(used)
    }
}

impl TcpReceiver {
    pub(crate) fn take(&self) -> PyResult<transport::Receiver> {
        self.end
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .ok_or_else(used)
    }
}

#[pymethods]
impl TcpSender {
    #[getter]
    fn receivers(&self) -> usize {
        self.receivers
    }

    /// The address receivers connected to (the bound port when `bind` asked for port 0).
    #[getter]
    fn address(&self) -> String {
        self.addr.clone()
    }
}

#[pymethods]
impl TcpReceiver {
    #[getter]
    fn rank(&self) -> usize {
        self.rank
    }
}

/// Listen on `bind` (`host:port`) and wait (GIL released) until all `receivers` connected and proved `token`.
/// With `elastic`, receivers may go and (re)join later (caught up at the next sync), and the bind returns once
/// `wait_for` of them joined (default: all).
#[pyfunction]
#[pyo3(signature = (bind, receivers, token, timeout_s = 60.0, slots = transport::DEFAULT_SLOTS, elastic = false, wait_for = None))]
#[allow(clippy::too_many_arguments)]
fn tcp_bind(
    py: Python<'_>,
    bind: String,
    receivers: usize,
    token: Vec<u8>,
    timeout_s: f64,
    slots: usize,
    elastic: bool,
    wait_for: Option<usize>,
) -> PyResult<TcpSender> {
    if receivers == 0 {
        return Err(PyValueError::new_err("receivers must be at least 1"));
    }
    if token.is_empty() {
        return Err(PyValueError::new_err("token must not be empty"));
    }
    let cfg = TcpFanConfig {
        bind,
        receivers,
        token,
        name: "rlsync sender".into(),
        timeout: crate::syncer::timeout(timeout_s)?,
        slots: slots.max(1),
        elastic,
    };
    let wait_for = wait_for.unwrap_or(receivers);
    let rt = runtime::get()?;
    let (end, addr) = py
        .detach(|| {
            rt.block_on(async {
                let listener = TcpFanSender::listen(cfg).await?;
                let addr = listener.local_addr()?.to_string();
                let end = listener.accept_waiting_for(wait_for).await?;
                Ok::<_, transport::TransportError>((end, addr))
            })
        })
        .map_err(|e| transport_error(&e))?;
    Ok(TcpSender {
        end: Mutex::new(Some(end)),
        receivers,
        addr,
    })
}

/// Connect to the sender at `addr` as receiver `rank` and prove `token` (GIL released while connecting).
#[pyfunction]
#[pyo3(signature = (addr, rank, token, timeout_s = 60.0))]
fn tcp_connect(
    py: Python<'_>,
    addr: String,
    rank: usize,
    token: Vec<u8>,
    timeout_s: f64,
) -> PyResult<TcpReceiver> {
    let t = crate::syncer::timeout(timeout_s)?;
    let name = format!("receiver rank {rank}");
    let rt = runtime::get()?;
    let end = py
        .detach(|| rt.block_on(TcpFanReceiver::connect(&addr, rank, &token, &name, t)))
        .map_err(|e| transport_error(&e))?;
    Ok(TcpReceiver {
        end: Mutex::new(Some(end)),
        rank,
    })
}
