//! The same-host GPU channel in Python: `CudaIpcSender` / `CudaIpcReceiver` over a state dict's CUDA tensors
//! (the crate's `gpu::ipc` with its CUDA devices; `rlsync/ipc.py` wraps them).
//!
//! Each call takes the tensors' descriptions (as `syncer._describe` makes them) and the caller's current
//! stream, checks them against the layout fixed at construction and hands the addresses to the device side;
//! the blocking work runs without the GIL. The GPU is opened before anything else, so on a machine without
//! CUDA (or a build without it) every entry point raises `rlsync.CudaError`.

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard, TryLockError};
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use rlsync_core::gpu::compact::Layout;
use rlsync_core::gpu::differ::CastPlan;
use rlsync_core::gpu::ipc::cast::{Casting, CudaCast};
use rlsync_core::gpu::ipc::{
    CudaReceiver, CudaSender, IpcError, IpcReceiver, IpcSender, ReceiverTiming, SyncReport,
};
use rlsync_core::gpu::{Gpu, Stream, cuda_ordinal};
use rlsync_core::syncer::settings::Device;
use rlsync_core::tensor::DType;
use rlsync_core::tensor::borrowed::check_device_memory;

use crate::device;
use crate::errors::{
    CudaError, HandshakeError, PayloadRejected, RlsyncError, TransportError, borrow_error, chain,
    gpu_error,
};
use crate::syncer::Desc;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<CudaIpcSender>()?;
    m.add_class::<CudaIpcReceiver>()?;
    Ok(())
}

fn ipc_error(err: &IpcError) -> PyErr {
    let msg = chain(err);
    match err {
        IpcError::Gpu(_) => CudaError::new_err(msg),
        IpcError::Rejected { .. } => PayloadRejected::new_err(msg),
        IpcError::State { .. } | IpcError::Layout(_) | IpcError::NotBootstrapped { .. } => {
            PyValueError::new_err(msg)
        }
        IpcError::Receiver { .. }
        | IpcError::Sender { .. }
        | IpcError::Connect { .. }
        | IpcError::Socket { .. }
        | IpcError::InUse { .. }
        | IpcError::NoDir { .. }
        | IpcError::PathTooLong { .. } => TransportError::new_err(msg),
    }
}

/// The device ordinal the descriptions' tensors live on (0 when none is a CUDA tensor: opening it then
/// reports a missing driver or build as it should, and the tensors are refused after).
pub(crate) fn ordinal_of(descs: &[Desc]) -> PyResult<usize> {
    for d in descs {
        if let Some(o) = cuda_ordinal(&d.6) {
            return o.map_err(|_| {
                PyValueError::new_err(format!(
                    "tensor '{}': cannot read its device '{}'",
                    d.0, d.6
                ))
            });
        }
    }
    Ok(0)
}

/// Open the GPU of the tensors (first, so no CUDA is a `CudaError` whatever the tensors are).
pub(crate) fn open(descs: &[Desc]) -> PyResult<Gpu> {
    let ordinal = ordinal_of(descs)?;
    Gpu::open(ordinal).map_err(|e| gpu_error(&e))
}

/// Every tensor a contiguous CUDA tensor of `gpu`'s device: (address, elements, element width) in order.
pub(crate) fn tensors(descs: &[Desc], gpu: &Gpu) -> PyResult<Vec<(u64, u64, usize)>> {
    descs
        .iter()
        .map(|d| {
            let on = cuda_ordinal(&d.6).and_then(Result::ok);
            if on != Some(gpu.ordinal()) {
                return Err(PyValueError::new_err(format!(
                    "tensor '{}' is on {}: rlsync's device path (the GPU channel, device payloads) takes the CUDA tensors of one device, cuda:{}",
                    d.0,
                    d.6,
                    gpu.ordinal()
                )));
            }
            let (dtype, bytes) =
                check_device_memory(&device::raw_tensor(d)).map_err(|e| borrow_error(&e))?;
            let w = dtype.size_bytes();
            Ok((d.2 as u64, (bytes / w) as u64, w))
        })
        .collect()
}

pub(crate) fn layout_of(ts: &[(u64, u64, usize)]) -> PyResult<Layout> {
    let shapes: Vec<(u64, usize)> = ts.iter().map(|&(_, n, w)| (n, w)).collect();
    Layout::new(&shapes).map_err(|e| PyValueError::new_err(chain(&e)))
}

/// The addresses of `descs` for the next operation, which must have the construction's layout.
pub(crate) fn addresses(descs: &[Desc], gpu: &Gpu, layout: &Layout) -> PyResult<Vec<u64>> {
    let ts = tensors(descs, gpu)?;
    if layout_of(&ts)? != *layout {
        return Err(HandshakeError::new_err(format!(
            "the state dict's tensors ({}) are not those the channel was made for ({}, same shapes and dtypes in the same order)",
            ts.len(),
            layout.tensors().len()
        )));
    }
    Ok(ts.into_iter().map(|(a, _, _)| a).collect())
}

/// The end's state for one call. An end runs one call at a time: a second one from another thread gets an
/// error rather than waiting for the lock while it holds the GIL (the running call needs the GIL to finish).
pub(crate) fn take<T>(m: &Mutex<T>) -> PyResult<MutexGuard<'_, T>> {
    match m.try_lock() {
        Ok(g) => Ok(g),
        Err(TryLockError::Poisoned(p)) => Ok(p.into_inner()),
        Err(TryLockError::WouldBlock) => Err(RlsyncError::new_err(
            "another call on this GPU channel end is running (one call at a time)",
        )),
    }
}

pub(crate) fn closed() -> PyErr {
    RlsyncError::new_err("the GPU channel end is closed")
}

fn secs(timeout: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(timeout)
        .map_err(|_| PyValueError::new_err(format!("timeout must be >= 0 seconds, got {timeout}")))
}

fn report<'py>(py: Python<'py>, r: &SyncReport) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("seq", r.seq)?;
    d.set_item("version", r.version)?;
    d.set_item("full", r.full)?;
    d.set_item("build_s", r.build_s)?;
    d.set_item("acks_s", r.acks_s)?;
    d.set_item("receivers", r.receivers)?;
    d.set_item("fallbacks", r.fallbacks)?;
    let widths: Vec<(u8, u64, bool)> = r
        .widths
        .iter()
        .map(|w| (w.width, w.changes, w.overflow))
        .collect();
    d.set_item("widths", widths)?;
    let sums: Vec<u64> = r.widths.iter().map(|w| w.checksum).collect();
    d.set_item("checksums", sums)?;
    d.set_item("per_receiver", timings(py, &r.per_receiver)?)?;
    d.set_item("settled", timings(py, &r.settled)?)?;
    d.set_item("dropped", r.dropped.clone())?;
    Ok(d)
}

/// Receivers' timings as a list of dicts.
fn timings<'py>(
    py: Python<'py>,
    ts: &[ReceiverTiming],
) -> PyResult<Bound<'py, pyo3::types::PyList>> {
    let per = pyo3::types::PyList::empty(py);
    for t in ts {
        let p = PyDict::new(py);
        p.set_item("rank", t.rank)?;
        p.set_item("total_s", t.total_s)?;
        p.set_item("wake_s", t.wake_s)?;
        p.set_item("drain_s", t.drain_s)?;
        p.set_item("check_s", t.check_s)?;
        p.set_item("apply_s", t.apply_s)?;
        p.set_item("reply_s", t.reply_s)?;
        per.append(p)?;
    }
    Ok(per)
}

/// The sender's device: its tensors cast first where the receivers hold floating tensors in another dtype.
pub(crate) type SenderDevice = Casting<CudaSender, Option<CudaCast>>;

/// An open sending end.
struct SenderEnd {
    gpu: Gpu,
    tx: IpcSender<SenderDevice>,
    /// The state's own layout (its dtypes), which every call's tensors must have; the channel's is in the
    /// receivers' dtypes.
    state: Layout,
    /// The state's dtypes by name: a cast reads its tensors as these (a width alone does not tell bf16 from
    /// fp16).
    dtypes: Vec<String>,
}

/// Each tensor of `descs`: its dtype and the receivers' (`dtype`, a floating dtype's name, for floating
/// tensors, their own otherwise; `None`: their own).
pub(crate) fn receivers_dtypes(
    descs: &[Desc],
    dtype: Option<&str>,
) -> PyResult<Vec<(DType, DType)>> {
    let to = match dtype {
        None => None,
        Some(name) => match DType::from_name(name) {
            Some(d) if d.is_floating() => Some(d),
            _ => {
                return Err(PyValueError::new_err(format!(
                    "dtype '{name}': the receivers' dtype of the floating tensors must be a floating dtype \
                     (bfloat16, float16, float32, float64)"
                )));
            }
        },
    };
    descs
        .iter()
        .map(|d| {
            let from = DType::from_name(&d.3).ok_or_else(|| {
                PyValueError::new_err(format!("tensor '{}': unsupported dtype {}", d.0, d.3))
            })?;
            Ok((from, to.filter(|_| from.is_floating()).unwrap_or(from)))
        })
        .collect()
}

/// The sender's device for the tensors `ts` of `descs` (checked by [`tensors`]) whose receivers hold them in
/// `casts`' second dtypes: the layout in the receivers' dtypes, and a [`CudaSender`] with its snapshot copy in
/// `place` that casts first where they differ (its state addresses are set per call).
pub(crate) fn casting_sender(
    gpu: &Gpu,
    descs: &[Desc],
    ts: &[(u64, u64, usize)],
    casts: &[(DType, DType)],
    place: Device,
) -> PyResult<(Layout, SenderDevice)> {
    let held: Vec<(u64, usize)> = ts
        .iter()
        .zip(casts)
        .map(|(&(_, n, _), (_, to))| (n, to.size_bytes()))
        .collect();
    let layout = Layout::new(&held).map_err(|e| PyValueError::new_err(chain(&e)))?;
    let plan = CastPlan::of(
        descs
            .iter()
            .zip(ts)
            .zip(casts)
            .map(|((d, &(_, n, _)), &(from, to))| (d.0.as_str(), from, to, n)),
    )
    .map_err(PyValueError::new_err)?;
    let addrs: Vec<u64> = ts.iter().map(|t| t.0).collect();
    let cast = if plan.is_empty() {
        None
    } else {
        // SAFETY: `addrs` are the caller's contiguous CUDA tensors of `gpu` in the plan's state dtypes
        // (checked by `tensors`); every operation points the casts at the tensors of its own call first.
        let (cast, _) = unsafe { CudaCast::new(gpu.clone(), plan, addrs, Stream(0)) }
            .map_err(|e| CudaError::new_err(chain(&e)))?;
        Some(cast)
    };
    Ok((
        layout,
        Casting {
            inner: CudaSender::with_snapshot(gpu.clone(), place),
            cast,
        },
    ))
}

/// Point `dev` at this call's tensors `addrs` on `stream`: the casts read them, the diff reads the casts'
/// copies.
///
/// # Safety
/// `addrs` are the call's tensors, checked against the state's layout (dtypes, sizes, the device), and the
/// caller holds them until the operation that reads them returned.
pub(crate) unsafe fn retarget(dev: &mut SenderDevice, addrs: Vec<u64>, stream: Stream) {
    let read = match &mut dev.cast {
        // SAFETY: forwarded to the caller.
        Some(cast) => unsafe { cast.retarget(addrs, stream) },
        None => addrs,
    };
    dev.inner.set_state(read, stream);
}

/// The sending end (`rlsync.cuda_ipc_sender`).
#[pyclass(module = "rlsync._native", frozen)]
pub struct CudaIpcSender {
    inner: Mutex<Option<SenderEnd>>,
}

#[pymethods]
impl CudaIpcSender {
    /// Bind `path` (0600; its directory must exist) and allocate the snapshot copy and outputs for the
    /// tensors of `descs` on their device; `receivers` ranks 0..receivers may connect. `dtype`: the receivers
    /// hold the floating tensors in this dtype (cast on the GPU into a scratch copy before each build).
    #[new]
    #[pyo3(signature = (path, descs, receivers, snapshot_device, timeout, dtype=None))]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        descs: Vec<Desc>,
        receivers: usize,
        snapshot_device: &str,
        timeout: f64,
        dtype: Option<&str>,
    ) -> PyResult<CudaIpcSender> {
        let gpu = open(&descs)?;
        if snapshot_device != "cuda" {
            return Err(PyValueError::new_err(format!(
                "snapshot_device '{snapshot_device}': the GPU channel shares its snapshot copy with the receivers by CUDA IPC, so it lives on the GPU ('cuda')"
            )));
        }
        let timeout = secs(timeout)?;
        let ts = tensors(&descs, &gpu)?;
        let state = layout_of(&ts)?;
        let casts = receivers_dtypes(&descs, dtype)?;
        let (layout, dev) = casting_sender(&gpu, &descs, &ts, &casts, Device::Cuda)?;
        let tx = py
            .detach(|| IpcSender::bind(&path, dev, layout, receivers, timeout))
            .map_err(|e| ipc_error(&e))?;
        let dtypes = descs.iter().map(|d| d.3.clone()).collect();
        Ok(CudaIpcSender {
            inner: Mutex::new(Some(SenderEnd {
                gpu,
                tx,
                state,
                dtypes,
            })),
        })
    }

    /// Snapshot copy := the tensors, wait for every receiver and give each a full copy at `version`.
    fn bootstrap<'py>(
        &self,
        py: Python<'py>,
        descs: Vec<Desc>,
        stream: u64,
        version: u64,
    ) -> PyResult<Bound<'py, PyDict>> {
        self.run(py, descs, stream, |tx| tx.bootstrap(version))
    }

    /// One sync at `version` (the first one bootstraps).
    fn sync<'py>(
        &self,
        py: Python<'py>,
        descs: Vec<Desc>,
        stream: u64,
        version: u64,
    ) -> PyResult<Bound<'py, PyDict>> {
        self.run(py, descs, stream, |tx| tx.sync(version))
    }

    /// A restarted receiver `rank` comes back (elastic): its predecessor is forgotten, its connection awaited
    /// and it gets a full copy of the current version at once.
    fn rejoin<'py>(
        &self,
        py: Python<'py>,
        descs: Vec<Desc>,
        stream: u64,
        rank: u32,
    ) -> PyResult<Bound<'py, PyDict>> {
        self.run(py, descs, stream, |tx| tx.rejoin(rank))
    }

    /// Elastic receivers: one whose socket closed is dropped (named in a report's `dropped`), not an error.
    fn set_elastic(&self, on: bool) -> PyResult<()> {
        self.with(|tx| tx.set_elastic(on))
    }

    /// Detached acks: a sync returns once sent; its acks are collected by the next sync (or `settle`).
    fn detach_acks(&self, on: bool) -> PyResult<()> {
        self.with(|tx| tx.detach_acks(on))
    }

    /// Collect the acks of a detached sync still outstanding; their timings.
    fn settle<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyList>> {
        let settled = self
            .with(|tx| py.detach(|| tx.settle()))?
            .map_err(|e| ipc_error(&e))?;
        timings(py, &settled)
    }

    /// The ranks connected now.
    fn ranks(&self) -> PyResult<Vec<u32>> {
        self.with(|tx| tx.ranks())
    }

    /// Remove the socket, end the channel (receivers see it close and close the buffers), wait for that
    /// (bounded) and free the device buffers; without the GIL, so receivers in this process's threads go on.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let taken = take(&self.inner)?.take();
        py.detach(move || drop(taken));
        Ok(())
    }
}

impl Drop for CudaIpcSender {
    /// Collected without `close()`: the same, without the GIL.
    fn drop(&mut self) {
        let taken = self
            .inner
            .get_mut()
            .map_or_else(|p| p.into_inner().take(), Option::take);
        if taken.is_some() {
            Python::attach(|py| py.detach(move || drop(taken)));
        }
    }
}

impl CudaIpcSender {
    /// `op` on the open sender (an error once closed, or while another call runs).
    fn with<R>(&self, op: impl FnOnce(&mut IpcSender<SenderDevice>) -> R) -> PyResult<R> {
        let mut g = take(&self.inner)?;
        let end = g.as_mut().ok_or_else(closed)?;
        Ok(op(&mut end.tx))
    }

    fn run<'py>(
        &self,
        py: Python<'py>,
        descs: Vec<Desc>,
        stream: u64,
        op: impl FnOnce(&mut IpcSender<SenderDevice>) -> Result<SyncReport, IpcError> + Send,
    ) -> PyResult<Bound<'py, PyDict>> {
        let mut g = take(&self.inner)?;
        let Some(SenderEnd {
            gpu,
            tx,
            state,
            dtypes,
        }) = g.as_mut()
        else {
            return Err(closed());
        };
        let addrs = addresses(&descs, gpu, state)?;
        if let Some((d, was)) = descs
            .iter()
            .zip(dtypes.iter())
            .find(|(d, was)| d.3 != **was)
        {
            return Err(HandshakeError::new_err(format!(
                "tensor '{}' is {} now, the channel was made for {was}",
                d.0, d.3
            )));
        }
        // SAFETY: `addrs` are this call's tensors, checked against the state's layout (dtypes, sizes, the
        // device); the caller holds them for the call.
        unsafe { retarget(tx.device_mut(), addrs, Stream(stream)) };
        let r = py.detach(|| op(tx)).map_err(|e| ipc_error(&e))?;
        report(py, &r)
    }
}

/// The receiving end (`rlsync.cuda_ipc_receiver`).
#[pyclass(module = "rlsync._native", frozen)]
pub struct CudaIpcReceiver {
    inner: Mutex<Option<(Gpu, IpcReceiver<CudaReceiver>)>>,
}

#[pymethods]
impl CudaIpcReceiver {
    /// Connect to the sender at `path` as `rank` (waiting up to `timeout` for it) and open its buffers on
    /// the device of the tensors of `descs`.
    #[new]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        rank: u32,
        descs: Vec<Desc>,
        timeout: f64,
    ) -> PyResult<CudaIpcReceiver> {
        let gpu = open(&descs)?;
        let timeout = secs(timeout)?;
        let ts = tensors(&descs, &gpu)?;
        let layout = layout_of(&ts)?;
        let dev = CudaReceiver::new(gpu.clone());
        let rx = py
            .detach(|| IpcReceiver::connect(&path, rank, layout, dev, timeout))
            .map_err(|e| ipc_error(&e))?;
        Ok(CudaIpcReceiver {
            inner: Mutex::new(Some((gpu, rx))),
        })
    }

    /// Wait up to `timeout` seconds for the next sync, install it into the tensors of `descs` on `stream`;
    /// its version.
    fn apply(&self, py: Python<'_>, descs: Vec<Desc>, stream: u64, timeout: f64) -> PyResult<u64> {
        let timeout = secs(timeout)?;
        let mut g = take(&self.inner)?;
        let Some((gpu, rx)) = g.as_mut() else {
            return Err(closed());
        };
        let addrs = addresses(&descs, gpu, rx.layout())?;
        rx.device_mut().set_tensors(addrs, Stream(stream));
        py.detach(|| rx.apply(timeout)).map_err(|e| ipc_error(&e))
    }

    /// The version installed last (`None` before the first sync).
    #[getter]
    fn version(&self) -> PyResult<Option<u64>> {
        let g = take(&self.inner)?;
        g.as_ref().map(|(_, rx)| rx.version()).ok_or_else(closed)
    }

    /// Close the sender's buffers in this process.
    fn close(&self) -> PyResult<()> {
        let taken = take(&self.inner)?.take();
        drop(taken);
        Ok(())
    }
}
