//! Device payloads in Python: `DevicePayloadSender` / `DevicePayloadReceiver` over a state dict's CUDA tensors
//! (the crate's `gpu::payload` with the GPU channel's CUDA devices), which `PatchWeightSyncer` switches to with
//! `transport_device="cuda"` (`rlsync/syncer.py`).
//!
//! The sender builds on its GPU and writes each payload into a uint8 CUDA tensor the Python side allocates
//! (PyTorch's memory, written on the caller's stream, never freed here); the receiver reads the payload tensor
//! its `recv` returned in place. Each call takes the tensors' descriptions (the synced keys, in the syncer's
//! order) and the caller's current stream, checked against the layout fixed at construction; the blocking
//! work runs without the GIL. Without CUDA every constructor raises `rlsync.CudaError`.

use std::sync::Mutex;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use rlsync_core::gpu::GpuError;
use rlsync_core::gpu::compact::Layout;
use rlsync_core::gpu::ipc::CudaReceiver;
use rlsync_core::gpu::ipc::reference::{RefSender, SharedSim, SimMemory};
use rlsync_core::gpu::payload::host::HostReceiver;
use rlsync_core::gpu::payload::{
    InstallReport, PayloadError, PayloadReceiver, PayloadReport, PayloadSender,
};
use rlsync_core::gpu::{Gpu, Stream, cuda_ordinal};
use rlsync_core::syncer::settings::Device;
use rlsync_core::tensor::DType;
use rlsync_core::tensor::borrowed::check_device_memory;

use crate::device;
use crate::errors::{
    CudaError, HandshakeError, PayloadRejected, RlsyncError, borrow_error, chain, gpu_error,
};
use crate::ipc::{
    SenderDevice, addresses, casting_sender, closed, layout_of, open, retarget, take, tensors,
};
use crate::syncer::Desc;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<DevicePayloadSender>()?;
    m.add_class::<DevicePayloadReceiver>()?;
    Ok(())
}

fn payload_error(err: &PayloadError) -> PyErr {
    let msg = chain(err);
    match err {
        PayloadError::Gpu(_) => CudaError::new_err(msg),
        PayloadError::Rejected { .. } => PayloadRejected::new_err(msg),
        PayloadError::Buffer { .. } | PayloadError::NotBuilt | PayloadError::NotStaged => {
            RlsyncError::new_err(msg)
        }
    }
}

/// Each tensor's dtype and the receivers' (`held[k]`, a dtype name): the same, or both floating (a cast).
fn casts(descs: &[Desc], held: &[String]) -> PyResult<Vec<(DType, DType)>> {
    if held.len() != descs.len() {
        return Err(PyValueError::new_err(format!(
            "{} receivers' dtypes for {} tensors",
            held.len(),
            descs.len()
        )));
    }
    descs
        .iter()
        .zip(held)
        .map(|(d, to)| {
            let name = |n: &str| {
                DType::from_name(n).ok_or_else(|| {
                    PyValueError::new_err(format!("tensor '{}': unsupported dtype {n}", d.0))
                })
            };
            let (from, to) = (name(&d.3)?, name(to)?);
            if from != to && !(from.is_floating() && to.is_floating()) {
                return Err(PyValueError::new_err(format!(
                    "tensor '{}' is {} here and {} on the receivers: only floating tensors are cast",
                    d.0, d.3, to
                )));
            }
            Ok((from, to))
        })
        .collect()
}

/// A report's common part: what the payload carried.
fn carried<'py>(
    py: Python<'py>,
    (sequence, version, full, bytes): (u64, u64, bool, u64),
    changes: &[(u8, u64)],
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("sequence", sequence)?;
    d.set_item("version", version)?;
    d.set_item("full", full)?;
    d.set_item("payload_bytes", bytes)?;
    d.set_item("changed", changes.iter().map(|c| c.1).sum::<u64>())?;
    d.set_item("widths", changes.to_vec())?;
    Ok(d)
}

fn report<'py>(py: Python<'py>, r: &PayloadReport) -> PyResult<Bound<'py, PyDict>> {
    let d = carried(py, (r.sequence, r.version, r.full, r.bytes), &r.changes)?;
    d.set_item("build_s", r.build_s)?;
    d.set_item("fill_s", r.fill_s)?;
    Ok(d)
}

fn install_report<'py>(py: Python<'py>, r: &InstallReport) -> PyResult<Bound<'py, PyDict>> {
    let d = carried(py, (r.sequence, r.version, r.full, r.bytes), &r.changes)?;
    d.set_item("read_s", r.read_s)?;
    d.set_item("check_s", r.check_s)?;
    d.set_item("apply_s", r.apply_s)?;
    Ok(d)
}

/// The kernels' reference as a sending device: the state's bytes copied into a simulated device memory before
/// each build, each payload built there and copied out to the caller's host buffer. It is how the Python side
/// of device payloads is tested on machines without a GPU (`DevicePayloadSender.reference`): the same payloads,
/// bit for bit, as the CUDA kernels are specified to write.
struct Reference {
    sim: SharedSim,
    /// The state's copies in `sim`, in layout order.
    state: Vec<u64>,
    tx: PayloadSender<RefSender<SharedSim>>,
}

/// Copy the CPU tensors `ts` ((address, bytes) in layout order) into the simulated state at `state`.
///
/// # Safety
/// Each range is host memory that stays alive and unwritten for the call.
unsafe fn load(sim: &SharedSim, state: &[u64], ts: &[(u64, u64)]) -> Result<(), PayloadError> {
    sim.with(|mem| {
        for (&(addr, bytes), &at) in ts.iter().zip(state) {
            // SAFETY: the caller's contract.
            let src = unsafe { std::slice::from_raw_parts(addr as *const u8, bytes as usize) };
            mem.write(at, bytes)
                .map_err(reference_error)?
                .copy_from_slice(src);
        }
        Ok(())
    })
}

impl Reference {
    /// Fill the built payload into the host buffer at `addr` (`len` bytes).
    ///
    /// # Safety
    /// `addr` is `len` bytes of host memory the caller owns and nothing else uses for the call.
    unsafe fn fill(&mut self, addr: u64, len: u64) -> Result<PayloadReport, PayloadError> {
        let at = self.sim.with(|mem| mem.alloc(&vec![0; len as usize]));
        let filled = self.tx.fill(at, len);
        let copied = self.sim.with(|mem| {
            let copied = match &filled {
                Ok(_) => mem.read(at, len).map(|bytes| {
                    // SAFETY: the caller's contract.
                    unsafe {
                        std::ptr::copy_nonoverlapping(bytes.as_ptr(), addr as *mut u8, bytes.len())
                    }
                }),
                Err(_) => Ok(()),
            };
            mem.free(at);
            copied
        });
        if let Err(e) = copied {
            self.tx.lost();
            return Err(reference_error(e));
        }
        filled
    }
}

fn reference_error(e: rlsync_core::gpu::reference::ReferenceError) -> PayloadError {
    PayloadError::Gpu(GpuError::Driver {
        op: "reference payload",
        code: 1,
        name: e.to_string(),
    })
}

/// Where an open sending end builds.
enum Builder {
    Cuda {
        gpu: Gpu,
        tx: PayloadSender<SenderDevice>,
    },
    Reference(Reference),
}

/// Each tensor as the receivers hold it (key, dtype after `casts`, shape), for the checksum.
fn names(descs: &[Desc], casts: &[(DType, DType)]) -> Vec<(String, DType, Vec<usize>)> {
    descs
        .iter()
        .zip(casts)
        .map(|(d, &(_, to))| (d.0.clone(), to, d.4.clone()))
        .collect()
}

/// An open sending end.
struct SenderEnd {
    builder: Builder,
    /// The state's own layout and dtypes, which every call's tensors must have.
    state: Layout,
    dtypes: Vec<String>,
    /// Each tensor as the receivers hold it (key, dtype, shape), for the checksum.
    names: Vec<(String, DType, Vec<usize>)>,
    /// The last payload's report.
    last: Option<PayloadReport>,
}

impl SenderEnd {
    fn version(&self) -> u64 {
        match &self.builder {
            Builder::Cuda { tx, .. } => tx.version(),
            Builder::Reference(r) => r.tx.version(),
        }
    }

    fn sequence(&self) -> u64 {
        match &self.builder {
            Builder::Cuda { tx, .. } => tx.sequence(),
            Builder::Reference(r) => r.tx.sequence(),
        }
    }

    fn fallbacks(&self) -> u64 {
        match &self.builder {
            Builder::Cuda { tx, .. } => tx.fallbacks,
            Builder::Reference(r) => r.tx.fallbacks,
        }
    }

    fn lost(&mut self) {
        match &mut self.builder {
            Builder::Cuda { tx, .. } => tx.lost(),
            Builder::Reference(r) => r.tx.lost(),
        }
    }

    /// The tensors of `descs` with the state's dtypes (the syncer's init's).
    fn same_dtypes(&self, descs: &[Desc]) -> PyResult<()> {
        match descs.iter().zip(&self.dtypes).find(|(d, was)| d.3 != **was) {
            Some((d, was)) => Err(PyValueError::new_err(format!(
                "tensor '{}' is {} now, the syncer was initialised with {was}",
                d.0, d.3
            ))),
            None => Ok(()),
        }
    }
}

/// A patch syncer's sending end on device payloads.
#[pyclass(module = "rlsync._native", frozen)]
pub struct DevicePayloadSender {
    inner: Mutex<Option<SenderEnd>>,
}

impl DevicePayloadSender {
    fn open_end(end: SenderEnd) -> DevicePayloadSender {
        DevicePayloadSender {
            inner: Mutex::new(Some(end)),
        }
    }
}

#[pymethods]
impl DevicePayloadSender {
    /// Allocate the snapshot copy (on the tensors' GPU with `snapshot_device="cuda"`, in pinned host memory
    /// the kernels read over the bus with `"cpu"`) and the diff's outputs for the tensors of `descs` (the
    /// synced keys in the syncer's order) and copy the tensors into the snapshot (the receivers hold them, at
    /// sequence `sequence` labelled `version`). `held`: each tensor's dtype on the receivers.
    #[new]
    #[pyo3(signature = (descs, held, sequence, version, stream, snapshot_device="cuda"))]
    fn new(
        py: Python<'_>,
        descs: Vec<Desc>,
        held: Vec<String>,
        sequence: u64,
        version: u64,
        stream: u64,
        snapshot_device: &str,
    ) -> PyResult<DevicePayloadSender> {
        let place = match snapshot_device {
            "cuda" => Device::Cuda,
            "cpu" => Device::Cpu,
            other => {
                return Err(PyValueError::new_err(format!(
                    "snapshot_device '{other}': 'cuda' or 'cpu'"
                )));
            }
        };
        let gpu = open(&descs)?;
        let ts = tensors(&descs, &gpu)?;
        let state = layout_of(&ts)?;
        let casts = casts(&descs, &held)?;
        let (layout, mut dev) = casting_sender(&gpu, &descs, &ts, &casts, place)?;
        let addrs = ts.iter().map(|t| t.0).collect();
        // SAFETY: `addrs` are the tensors of `descs`, just checked (`tensors`: contiguous CUDA tensors of this
        // device, their sizes; `casting_sender` built the casts for their dtypes); the caller holds them.
        unsafe { retarget(&mut dev, addrs, Stream(stream)) };
        let names = names(&descs, &casts);
        let tx = py
            .detach(|| PayloadSender::new(dev, layout, sequence, version))
            .map_err(|e| payload_error(&e))?;
        Ok(DevicePayloadSender::open_end(SenderEnd {
            builder: Builder::Cuda { gpu, tx },
            state,
            dtypes: descs.iter().map(|d| d.3.clone()).collect(),
            names,
            last: None,
        }))
    }

    /// A sender on the kernels' reference instead of a GPU: `descs` are CPU tensors (no casts), the payloads are
    /// written into CPU uint8 tensors, bit for bit what the CUDA kernels are specified to write. For tests of
    /// the Python side of device payloads on machines without a GPU; a product sender on the CPU sends
    /// host-coded payloads.
    #[staticmethod]
    fn reference(
        py: Python<'_>,
        descs: Vec<Desc>,
        sequence: u64,
        version: u64,
    ) -> PyResult<DevicePayloadSender> {
        let ts = host_tensors(&descs)?;
        let layout = layout_of_placed(&ts)?;
        let regions = regions(&ts);
        let sim = SharedSim::default();
        let state: Vec<u64> = sim.with(|mem| {
            ts.iter()
                .map(|t| mem.alloc(&vec![0; t.bytes as usize]))
                .collect()
        });
        let dtypes: Vec<String> = descs.iter().map(|d| d.3.clone()).collect();
        let names = names(&descs, &casts(&descs, &dtypes)?);
        let end = py.detach(|| {
            // SAFETY: the CPU tensors of `descs` (checked: contiguous, these sizes), held by the caller.
            unsafe { load(&sim, &state, &regions)? };
            let dev = RefSender::new(sim.clone(), state.clone());
            let tx = PayloadSender::new(dev, layout.clone(), sequence, version)?;
            Ok::<Reference, PayloadError>(Reference { sim, state, tx })
        });
        let end = end.map_err(|e| payload_error(&e))?;
        Ok(DevicePayloadSender::open_end(SenderEnd {
            builder: Builder::Reference(end),
            state: layout,
            dtypes,
            names,
            last: None,
        }))
    }

    /// Build the next payload, labelled `version`, from the tensors of `descs` on `stream`; its length in
    /// bytes (allocate that, then `fill`).
    fn build(&self, py: Python<'_>, descs: Vec<Desc>, stream: u64, version: u64) -> PyResult<u64> {
        let mut g = take(&self.inner)?;
        let end = g.as_mut().ok_or_else(closed)?;
        end.same_dtypes(&descs)?;
        let built = match &mut end.builder {
            Builder::Cuda { gpu, tx } => {
                let addrs = addresses(&descs, gpu, &end.state)?;
                // SAFETY: `addrs` are this call's tensors, checked against the state's layout (dtypes, sizes,
                // the device); the caller holds them until `build` returns (the build waits for its kernels).
                unsafe { retarget(tx.device_mut(), addrs, Stream(stream)) };
                py.detach(|| tx.build(version))
            }
            Builder::Reference(r) => {
                let ts = host_tensors(&descs)?;
                same_layout(&ts, &end.state, "sender")?;
                let regions = regions(&ts);
                py.detach(|| {
                    // SAFETY: this call's CPU tensors, checked against the state's layout; held by the caller.
                    unsafe { load(&r.sim, &r.state, &regions)? };
                    r.tx.build(version)
                })
            }
        };
        built.map_err(|e| payload_error(&e))
    }

    /// Write the built payload into the buffer at `addr` (`len` bytes: a CUDA tensor on the tensors' device;
    /// for a reference sender, a CPU tensor), waited for; its report.
    fn fill<'py>(&self, py: Python<'py>, addr: u64, len: u64) -> PyResult<Bound<'py, PyDict>> {
        let mut g = take(&self.inner)?;
        let end = g.as_mut().ok_or_else(closed)?;
        let filled = match &mut end.builder {
            Builder::Cuda { tx, .. } => py.detach(|| tx.fill(addr, len)),
            // SAFETY: the caller's buffer of `len` bytes (a CPU tensor it allocated for this payload).
            Builder::Reference(r) => py.detach(|| unsafe { r.fill(addr, len) }),
        };
        let r = filled.map_err(|e| payload_error(&e))?;
        let d = report(py, &r)?;
        end.last = Some(r);
        Ok(d)
    }

    /// The last payload did not reach the receivers (the caller's `send` failed): the next one is full.
    fn lost(&self) -> PyResult<()> {
        take(&self.inner)?.as_mut().ok_or_else(closed)?.lost();
        Ok(())
    }

    /// The state checksum of what the receivers hold after the last payload (the snapshot copy), on the GPU.
    fn checksum(&self, py: Python<'_>) -> PyResult<u64> {
        let mut g = take(&self.inner)?;
        let end = g.as_mut().ok_or_else(closed)?;
        let names = &end.names;
        let sum = match &mut end.builder {
            Builder::Cuda { tx, .. } => py.detach(|| tx.checksum(names)),
            Builder::Reference(r) => py.detach(|| r.tx.checksum(names)),
        };
        sum.map_err(|e| payload_error(&e))
    }

    /// The version label of the last payload.
    #[getter]
    fn version(&self) -> PyResult<u64> {
        Ok(take(&self.inner)?.as_ref().ok_or_else(closed)?.version())
    }

    /// The sequence number of the last payload.
    #[getter]
    fn sequence(&self) -> PyResult<u64> {
        Ok(take(&self.inner)?.as_ref().ok_or_else(closed)?.sequence())
    }

    /// Payloads sent in full because the sender's own check of a build failed.
    #[getter]
    fn fallbacks(&self) -> PyResult<u64> {
        Ok(take(&self.inner)?.as_ref().ok_or_else(closed)?.fallbacks())
    }

    /// The last payload's report (empty before the first).
    fn last_report<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let g = take(&self.inner)?;
        match g.as_ref().ok_or_else(closed)?.last.as_ref() {
            Some(r) => report(py, r),
            None => Ok(PyDict::new(py)),
        }
    }

    /// Free the device buffers.
    fn close(&self) -> PyResult<()> {
        drop(take(&self.inner)?.take());
        Ok(())
    }
}

/// One device's share of a receiver: the tensors on one GPU, or on the CPU. Each share holds the whole
/// layout and installs its own tensors (the others it holds elsewhere: address 0).
enum Share {
    Cuda { rx: PayloadReceiver<CudaReceiver> },
    Host { rx: PayloadReceiver<HostReceiver> },
}

/// A GPU share's tensors (their addresses, 0 where another share's) and stream for the next stage or commit.
fn aim(rx: &mut PayloadReceiver<CudaReceiver>, tensors: &[(u64, u64)], stream: u64) {
    let addrs = tensors.iter().map(|t| t.0).collect();
    rx.device_mut().set_tensors(addrs, Stream(stream));
}

impl Share {
    fn stage(
        &mut self,
        py: Python<'_>,
        (addr, len): (u64, u64),
        tensors: &[(u64, u64)],
        stream: u64,
    ) -> Result<u64, PayloadError> {
        match self {
            Share::Cuda { rx } => {
                aim(rx, tensors, stream);
                py.detach(|| rx.stage(addr, len))
            }
            Share::Host { rx } => {
                // SAFETY: the CPU tensors of this call (checked: contiguous, these sizes), which the caller
                // holds for the call, and the payload, which it holds until the commit or abort; the syncer's
                // API says neither is used elsewhere meanwhile.
                unsafe {
                    rx.device_mut().set_tensors(tensors);
                    rx.device_mut().set_payload(addr, len);
                }
                py.detach(|| rx.stage(addr, len))
            }
        }
    }

    fn commit(
        &mut self,
        py: Python<'_>,
        tensors: &[(u64, u64)],
        stream: u64,
    ) -> Result<u64, PayloadError> {
        match self {
            Share::Cuda { rx } => {
                aim(rx, tensors, stream);
                py.detach(|| rx.commit())
            }
            Share::Host { rx } => {
                // SAFETY: as in `stage`; the staged payload stays registered from there.
                unsafe { rx.device_mut().set_tensors(tensors) };
                py.detach(|| rx.commit())
            }
        }
    }

    fn version(&self) -> u64 {
        match self {
            Share::Cuda { rx } => rx.version(),
            Share::Host { rx } => rx.version(),
        }
    }

    fn sequence(&self) -> u64 {
        match self {
            Share::Cuda { rx } => rx.sequence(),
            Share::Host { rx } => rx.sequence(),
        }
    }

    fn staged_version(&self) -> Option<u64> {
        match self {
            Share::Cuda { rx } => rx.staged_version(),
            Share::Host { rx } => rx.staged_version(),
        }
    }

    fn abort(&mut self) -> Option<u64> {
        match self {
            Share::Cuda { rx } => rx.abort(),
            Share::Host { rx } => rx.abort(),
        }
    }

    fn last(&self) -> Option<&InstallReport> {
        match self {
            Share::Cuda { rx } => rx.last(),
            Share::Host { rx } => rx.last(),
        }
    }
}

/// An open receiving end: one share per device its tensors live on.
struct ReceiverEnd {
    /// Each share's device (`cuda:N` or `cpu`), in the order the tensors first name them.
    devices: Vec<String>,
    shares: Vec<Share>,
    layout: Layout,
}

/// Where one synced tensor is, and its size.
struct Placed {
    /// `cuda:N` or `cpu`.
    device: String,
    addr: u64,
    bytes: u64,
    numel: u64,
    width: usize,
}

/// Every tensor a contiguous tensor of a GPU or the CPU, in order.
fn placed(descs: &[Desc]) -> PyResult<Vec<Placed>> {
    descs
        .iter()
        .map(|d| {
            let device = match cuda_ordinal(&d.6) {
                Some(Ok(o)) => format!("cuda:{o}"),
                None if d.6 == "cpu" => d.6.clone(),
                _ => {
                    return Err(PyValueError::new_err(format!(
                        "tensor '{}' is on {}: device payloads install into CUDA or CPU tensors",
                        d.0, d.6
                    )));
                }
            };
            let (dtype, bytes) =
                check_device_memory(&device::raw_tensor(d)).map_err(|e| borrow_error(&e))?;
            let w = dtype.size_bytes();
            Ok(Placed {
                device,
                addr: d.2 as u64,
                bytes: bytes as u64,
                numel: (bytes / w) as u64,
                width: w,
            })
        })
        .collect()
}

/// The layout of placed tensors.
fn layout_of_placed(ts: &[Placed]) -> PyResult<Layout> {
    let shapes: Vec<(u64, usize)> = ts.iter().map(|t| (t.numel, t.width)).collect();
    Layout::new(&shapes).map_err(|e| PyValueError::new_err(chain(&e)))
}

/// This call's tensors have the layout the end (`what`) was made for.
fn same_layout(ts: &[Placed], layout: &Layout, what: &str) -> PyResult<()> {
    if layout_of_placed(ts).ok().as_ref() != Some(layout) {
        return Err(HandshakeError::new_err(format!(
            "the state dict's tensors ({}) are not those the {what} was made for ({}, same shapes and dtypes in the same order)",
            ts.len(),
            layout.tensors().len()
        )));
    }
    Ok(())
}

/// The tensors of `descs`, all contiguous CPU tensors (a reference sender's).
fn host_tensors(descs: &[Desc]) -> PyResult<Vec<Placed>> {
    let ts = placed(descs)?;
    if let Some(t) = ts.iter().find(|t| t.device != "cpu") {
        return Err(PyValueError::new_err(format!(
            "a tensor is on {}: a reference sender takes CPU tensors only",
            t.device
        )));
    }
    Ok(ts)
}

/// (address, bytes) of each placed tensor.
fn regions(ts: &[Placed]) -> Vec<(u64, u64)> {
    ts.iter().map(|t| (t.addr, t.bytes)).collect()
}

impl ReceiverEnd {
    /// Each share's tensors of this call, (address, bytes) in layout order (0 where another share's), checked
    /// against the layout and the devices of the construction.
    fn tensors_of(&self, descs: &[Desc]) -> PyResult<Vec<Vec<(u64, u64)>>> {
        let ts = placed(descs)?;
        same_layout(&ts, &self.layout, "receiver")?;
        if let Some(t) = ts.iter().find(|t| !self.devices.contains(&t.device)) {
            return Err(PyValueError::new_err(format!(
                "a synced tensor is on {}, a device this receiver was not made for (its devices: {:?}): keep the model where it was at the first device payload",
                t.device, self.devices
            )));
        }
        Ok(self
            .devices
            .iter()
            .map(|dev| {
                ts.iter()
                    .map(|t| {
                        if &t.device == dev {
                            (t.addr, t.bytes)
                        } else {
                            (0, 0)
                        }
                    })
                    .collect()
            })
            .collect())
    }

    /// `step` on each share in turn (they agree on the version label); on the first failure every share's
    /// staged payload is dropped and the error raised.
    fn each(
        &mut self,
        mut step: impl FnMut(usize, &mut Share) -> Result<u64, PayloadError>,
    ) -> PyResult<u64> {
        let mut version = 0;
        for k in 0..self.shares.len() {
            match step(k, &mut self.shares[k]) {
                Ok(v) => version = v,
                Err(e) => {
                    self.abort();
                    return Err(payload_error(&e));
                }
            }
        }
        Ok(version)
    }

    /// Drop what every share holds staged; the version label staged, if any.
    fn abort(&mut self) -> Option<u64> {
        let dropped: Vec<Option<u64>> = self.shares.iter_mut().map(Share::abort).collect();
        dropped.into_iter().flatten().next()
    }

    /// One entry per share, or an error naming what the caller gave.
    fn per_share<T>(&self, what: &str, items: Vec<T>) -> PyResult<Vec<T>> {
        if items.len() != self.shares.len() {
            return Err(PyValueError::new_err(format!(
                "{} {what} for a receiver on {} devices {:?}",
                items.len(),
                self.shares.len(),
                self.devices
            )));
        }
        Ok(items)
    }
}

/// A patch syncer's receiving end of device payloads.
#[pyclass(module = "rlsync._native", frozen)]
pub struct DevicePayloadReceiver {
    inner: Mutex<Option<ReceiverEnd>>,
}

#[pymethods]
impl DevicePayloadReceiver {
    /// A receiver into the tensors of `descs` (the synced keys in the syncer's order), which hold sequence
    /// `sequence` labelled `version`: one share per device the tensors live on (each GPU, the CPU), each
    /// verifying every payload and installing its own tensors.
    #[new]
    fn new(descs: Vec<Desc>, sequence: u64, version: u64) -> PyResult<DevicePayloadReceiver> {
        let ts = placed(&descs)?;
        let layout = layout_of_placed(&ts)?;
        let mut devices: Vec<String> = Vec::new();
        for t in &ts {
            if !devices.contains(&t.device) {
                devices.push(t.device.clone());
            }
        }
        if devices.is_empty() {
            devices.push("cpu".into());
        }
        let shares = devices
            .iter()
            .map(|dev| -> PyResult<Share> {
                Ok(match cuda_ordinal(dev) {
                    Some(Ok(o)) => {
                        let gpu = Gpu::open(o).map_err(|e| gpu_error(&e))?;
                        let dev = CudaReceiver::new(gpu);
                        Share::Cuda {
                            rx: PayloadReceiver::new(dev, layout.clone(), sequence, version),
                        }
                    }
                    _ => Share::Host {
                        rx: PayloadReceiver::new(
                            HostReceiver::new(),
                            layout.clone(),
                            sequence,
                            version,
                        ),
                    },
                })
            })
            .collect::<PyResult<Vec<Share>>>()?;
        Ok(DevicePayloadReceiver {
            inner: Mutex::new(Some(ReceiverEnd {
                devices,
                shares,
                layout,
            })),
        })
    }

    /// The devices of the shares (`cuda:N`, `cpu`), in the order `stage` takes their payloads and streams.
    #[getter]
    fn devices(&self) -> PyResult<Vec<String>> {
        Ok(take(&self.inner)?
            .as_ref()
            .ok_or_else(closed)?
            .devices
            .clone())
    }

    /// Verify the payload, one copy per share (`payloads[k]`: (address, bytes) of a uint8 tensor on
    /// `devices[k]`, kept alive and unchanged by the caller until `commit` or `abort`), each on its stream
    /// (`streams[k]`, 0 for the CPU), whose work (the `recv` and copy that wrote it) comes first; its version
    /// label. Every share checks its copy before any share is held: rejected, `PayloadRejected`, tensors
    /// and version untouched.
    fn stage(
        &self,
        py: Python<'_>,
        payloads: Vec<(u64, u64)>,
        descs: Vec<Desc>,
        streams: Vec<u64>,
    ) -> PyResult<u64> {
        let mut g = take(&self.inner)?;
        let end = g.as_mut().ok_or_else(closed)?;
        let payloads = end.per_share("payloads", payloads)?;
        let streams = end.per_share("streams", streams)?;
        let tensors = end.tensors_of(&descs)?;
        end.each(|k, share| share.stage(py, payloads[k], &tensors[k], streams[k]))
    }

    /// Install the staged payload into the tensors of `descs`, each share on its stream, waited for; its
    /// version label. A GPU failure midway leaves the shares before it installed: the next patch is then
    /// rejected by the others (a full resync is needed), as after any failed install.
    fn commit(&self, py: Python<'_>, descs: Vec<Desc>, streams: Vec<u64>) -> PyResult<u64> {
        let mut g = take(&self.inner)?;
        let end = g.as_mut().ok_or_else(closed)?;
        let streams = end.per_share("streams", streams)?;
        let tensors = end.tensors_of(&descs)?;
        end.each(|k, share| share.commit(py, &tensors[k], streams[k]))
    }

    /// Drop the staged payload; its version label, if one was staged.
    fn abort(&self) -> PyResult<Option<u64>> {
        Ok(take(&self.inner)?.as_mut().ok_or_else(closed)?.abort())
    }

    #[getter]
    fn staged_version(&self) -> PyResult<Option<u64>> {
        let g = take(&self.inner)?;
        Ok(g.as_ref().ok_or_else(closed)?.shares[0].staged_version())
    }

    /// The version label installed last (the first share's: all agree unless an install failed midway).
    #[getter]
    fn version(&self) -> PyResult<u64> {
        Ok(take(&self.inner)?.as_ref().ok_or_else(closed)?.shares[0].version())
    }

    /// The sequence number installed last: the lowest of the shares' (where an install failed midway, the
    /// one the sender's next full payload must come after).
    #[getter]
    fn sequence(&self) -> PyResult<u64> {
        let g = take(&self.inner)?;
        let end = g.as_ref().ok_or_else(closed)?;
        Ok(end
            .shares
            .iter()
            .map(Share::sequence)
            .min()
            .unwrap_or_default())
    }

    /// The last install's report (empty before the first): the first share's, its seconds summed over the
    /// shares (they run one after another).
    fn last_report<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let g = take(&self.inner)?;
        let end = g.as_ref().ok_or_else(closed)?;
        let reports: Vec<&InstallReport> = end.shares.iter().filter_map(Share::last).collect();
        let Some(&first) = reports.first() else {
            return Ok(PyDict::new(py));
        };
        let total = |f: fn(&InstallReport) -> f64| reports.iter().map(|r| f(r)).sum::<f64>();
        let merged = InstallReport {
            read_s: total(|r| r.read_s),
            check_s: total(|r| r.check_s),
            apply_s: total(|r| r.apply_s),
            ..first.clone()
        };
        install_report(py, &merged)
    }
}
