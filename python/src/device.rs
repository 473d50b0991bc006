//! CUDA tensors in the binding: a syncer's device side (the device, the host copies of its CUDA tensors that
//! the host paths read and write, the caller's stream) and the staging of each operation's tensors through it.
//!
//! A state dict may mix CPU and CUDA tensors (all CUDA ones on one device). CUDA tensors are checked like CPU
//! ones (dtype, contiguity, alignment) and replaced, for the crate, by their host copies: pulled before
//! an operation reads them, pushed after one wrote them — on the caller's stream
//! (`torch.cuda.current_stream()`), so the copies follow the work queued before the call. Tied CUDA tensors
//! (same memory) share one copy, so the crate folds them as it does CPU ones; other overlaps are refused.

use std::sync::{Arc, Mutex, MutexGuard};

use pyo3::prelude::*;

use rlsync::worker::host_copies::HostCopies;
use rlsync_core::gpu::bucket::{BucketDevice, CudaBucketDevice};
use rlsync_core::gpu::checksum::DeviceChecksum;
use rlsync_core::gpu::differ::CastPlan;
use rlsync_core::gpu::differ::GpuDiffer;
use rlsync_core::gpu::installer::GpuInstaller;
use rlsync_core::gpu::ipc::cast::{Casting, CudaCast};
use rlsync_core::gpu::ipc::{CudaReceiver, CudaSender, SenderDevice};
use rlsync_core::gpu::mirror::{DeviceTensor, Mirror};
use rlsync_core::gpu::{DeviceState, Gpu, GpuError, Stream, cuda_ordinal};
use rlsync_core::syncer::BucketStager;
use rlsync_core::syncer::settings::{Device, SyncerKind};
use rlsync_core::syncer::{SyncReceiver, SyncSender};
use rlsync_core::tensor::borrowed::check_device_memory;
use rlsync_core::tensor::{BorrowError, RawTensor};
use rlsync_core::tensor::{DType, StateDict};

use crate::errors::{borrow_error, gpu_error};
use crate::syncer::Desc;

/// The device side of a syncer whose state dict has CUDA tensors.
pub(crate) struct DeviceSide {
    gpu: Gpu,
    mirror: Mirror,
    /// The CUDA tensors' device addresses by key and the caller's stream for the operation about to run (the
    /// host copies, the device build and the install all use it).
    current: Arc<Mutex<DeviceState>>,
    /// What runs on the device (set once, after init).
    mode: Mode,
    /// The state checksum on the GPU (created by the first checksum).
    checksum: Option<DeviceChecksum>,
}

/// Which of a syncer's operations work on the CUDA tensors themselves rather than their host copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum Mode {
    /// Every operation reads and writes the host copies (pulled before, pushed after).
    #[default]
    HostStaging,
    /// Patches are built (sender) or installed (receiver) on the device: the operation neither pulls nor
    /// pushes the host copies (they go stale until an operation that reads them pulls).
    Patch,
    /// A bucket sender packs its CUDA tensors' buckets on the GPU (`bucket_device: cuda`, [`attach_stager`]);
    /// it pulls only when a rejoin or the kept copy of the last version needs the host view.
    BucketPack,
    /// A bucket receiver installs verified versions into its CUDA tensors on the GPU (`bucket_device: cuda`,
    /// [`attach_installer`]): no pull or push, as [`Mode::Patch`].
    BucketInstall,
}

impl Mode {
    /// Whether an operation skips the host copies (neither pulls nor pushes).
    fn skips_host_copies(self) -> bool {
        matches!(self, Mode::Patch | Mode::BucketInstall)
    }

    /// Where the tensors were, as `last_report()["device"]` says it.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Mode::HostStaging => "cuda (host staging)",
            Mode::Patch => "cuda (device build/install)",
            Mode::BucketPack => "cuda (device bucket pack)",
            Mode::BucketInstall => "cuda (device bucket install)",
        }
    }
}

/// Shared between a syncer and its running op (one op at a time).
pub(crate) type SharedSide = Arc<Mutex<DeviceSide>>;

pub(crate) fn lock(side: &SharedSide) -> MutexGuard<'_, DeviceSide> {
    side.lock().unwrap_or_else(|p| p.into_inner())
}

impl DeviceSide {
    fn stream(&self) -> Stream {
        self.current
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .stream
    }

    /// Host copies := device tensors.
    pub(crate) fn pull(&mut self) -> Result<(), GpuError> {
        let stream = self.stream();
        self.mirror.pull(stream)
    }

    /// Device tensors := host copies.
    pub(crate) fn push(&mut self) -> Result<(), GpuError> {
        let stream = self.stream();
        self.mirror.push(stream)
    }

    /// `state_checksum(state, keys)` of the weights where they are: the CUDA tensors hashed on the GPU in
    /// place (their host copies in `state` are not read, stale or not), the CPU tensors from `state`; after
    /// the work queued on the caller's stream.
    pub(crate) fn checksum(&mut self, state: &StateDict, keys: &[String]) -> Result<u64, GpuError> {
        let cur = self.current.lock().unwrap_or_else(|p| p.into_inner());
        let gpu = &self.gpu;
        let sum = self
            .checksum
            .get_or_insert_with(|| DeviceChecksum::new(gpu));
        // SAFETY: `cur.addrs` are the state dict's CUDA tensors as staged for this operation, each of its
        // entry's size in `state` (its host copy's); their owner keeps them alive and unchanged during the call
        // (the API's contract: a syncer's tensors are not touched while one of its operations runs).
        unsafe { sum.state_checksum(state, keys, &cur.addrs, cur.stream) }
    }
}

/// A worker's host copies of its CUDA tensors as the worker runtime refreshes them
/// ([`rlsync::worker::host_copies`]).
pub(crate) struct CudaCopies(pub(crate) SharedSide);

impl HostCopies for CudaCopies {
    type Error = GpuError;
    fn pull(&mut self) -> Result<(), GpuError> {
        lock(&self.0).pull()
    }
    fn push(&mut self) -> Result<(), GpuError> {
        lock(&self.0).push()
    }
}

/// A description as the crate's [`RawTensor`] (for the checks of a tensor the crate cannot borrow).
pub(crate) fn raw_tensor(d: &Desc) -> RawTensor {
    RawTensor {
        name: d.0.clone(),
        addr: d.2,
        dtype: d.3.clone(),
        shape: d.4.clone(),
        strides: d.5.clone(),
        device: d.6.clone(),
    }
}

/// `state_checksum(state, keys)` with the CUDA tensors hashed on the GPU ([`DeviceSide::checksum`]); `None`
/// without CUDA tensors.
pub(crate) fn checksum(
    side: &Option<SharedSide>,
    state: &StateDict,
    keys: &[String],
) -> Option<Result<u64, GpuError>> {
    side.as_ref().map(|s| lock(s).checksum(state, keys))
}

/// Host copies := device tensors, where the state has CUDA tensors.
pub(crate) fn pull(side: &Option<SharedSide>) -> Result<(), GpuError> {
    side.as_ref().map_or(Ok(()), |s| lock(s).pull())
}

/// Device tensors := host copies, where the state has CUDA tensors.
pub(crate) fn push(side: &Option<SharedSide>) -> Result<(), GpuError> {
    side.as_ref().map_or(Ok(()), |s| lock(s).push())
}

/// Whether operations work on the CUDA tensors themselves (a device patch build or install, a device bucket
/// install): the host copies stay out of them.
pub(crate) fn on_device(side: &Option<SharedSide>) -> bool {
    mode(side).skips_host_copies()
}

/// What runs on the device (`HostStaging` without CUDA tensors too).
pub(crate) fn mode(side: &Option<SharedSide>) -> Mode {
    side.as_ref().map_or(Mode::HostStaging, |s| lock(s).mode)
}

/// The CUDA tensors' addresses cover every synced key.
fn covers(current: &Mutex<DeviceState>, keys: &[String]) -> bool {
    let cur = current.lock().unwrap_or_else(|p| p.into_inner());
    keys.iter().all(|k| cur.addrs.contains_key(k))
}

/// After `init_sender`: a patch sender whose synced keys are all CUDA tensors builds its patches on the device
/// (`snapshot_device` says where the snapshot lives); floating tensors in another dtype than the receivers'
/// are cast there first (`gpu::differ::CastPlan`: a scratch copy in the receivers' dtype). Otherwise (CPU
/// tensors among the synced ones) it stays on the host path through the host copies. Returns whether it
/// moved.
pub(crate) fn attach_builder(
    side: &Option<SharedSide>,
    sender: &mut SyncSender,
    state: &StateDict,
) -> bool {
    let Some(s) = side else {
        return false;
    };
    let mut g = lock(s);
    // The receivers' dtype, or a floating one the device build casts from (init refused other pairs).
    let castable = sender
        .synced_keys()
        .iter()
        .zip(sender.synced_dtypes())
        .all(|(k, d)| {
            state
                .get(k)
                .is_some_and(|t| t.dtype() == *d || (t.dtype().is_floating() && d.is_floating()))
        });
    if sender.kind() != SyncerKind::Patch || !castable || !covers(&g.current, sender.synced_keys())
    {
        return false;
    }
    let differ = GpuDiffer::new(g.gpu.clone(), sender.snapshot_device(), g.current.clone());
    let moved = sender.set_patch_builder(Box::new(differ));
    if moved {
        g.mode = Mode::Patch;
    }
    moved
}

/// The same-host GPU channel's devices (`weight_syncer.patch.transport_device: cuda`, the worker runtime's
/// `gpu_channel`) over the CUDA tensors of `keys`, at their addresses and on the stream staged at init (a
/// worker's parameters keep their identity); the error names the first key that is not a CUDA tensor.
pub(crate) fn channel_sender(
    side: &SharedSide,
    state: &StateDict,
    keys: &[String],
    dtypes: &[DType],
) -> Result<Box<dyn SenderDevice + Send>, String> {
    let (gpu, addrs, stream) = channel_tensors(side, keys)?;
    // Floating tensors the rollouts hold in another dtype (fp32 master weights, bf16 rollouts) are cast into
    // a scratch copy on the GPU before each build.
    let plan = CastPlan::to_dtypes(state, keys, dtypes)?;
    let mut dev = CudaSender::new(gpu.clone());
    if plan.is_empty() {
        dev.set_state(addrs, stream);
        return Ok(Box::new(dev));
    }
    // SAFETY: `addrs` are the model's CUDA tensors staged at init, in their state dtypes (the host copies'
    // dtypes in `state`); a worker's parameters keep their identity while the channel runs.
    let (cast, diff) = unsafe { CudaCast::new(gpu, plan, addrs, stream) }
        .map_err(|e| rlsync_core::error_chain(&e))?;
    dev.set_state(diff, stream);
    Ok(Box::new(Casting { inner: dev, cast }))
}

/// See [`channel_sender`].
pub(crate) fn channel_receiver(side: &SharedSide, keys: &[String]) -> Result<CudaReceiver, String> {
    let (gpu, addrs, stream) = channel_tensors(side, keys)?;
    let mut dev = CudaReceiver::new(gpu);
    dev.set_tensors(addrs, stream);
    Ok(dev)
}

/// The device, the addresses of `keys` in order, and the stream; or why a key cannot go over the channel.
fn channel_tensors(side: &SharedSide, keys: &[String]) -> Result<(Gpu, Vec<u64>, Stream), String> {
    let g = lock(side);
    let cur = g.current.lock().unwrap_or_else(|p| p.into_inner());
    let addrs = keys
        .iter()
        .map(|k| {
            cur.addrs.get(k).copied().ok_or_else(|| {
                format!(
                    "tensor '{k}' is not a CUDA tensor of cuda:{}: the channel moves the synced tensors of one GPU",
                    g.gpu.ordinal()
                )
            })
        })
        .collect::<Result<Vec<u64>, String>>()?;
    Ok((g.gpu.clone(), addrs, cur.stream))
}

/// A bucket syncer's device staging: packs (sender) or installs (receiver) on the state's GPU, at the
/// addresses and on the stream of the operation about to run.
struct CudaStager {
    dev: CudaBucketDevice,
    current: Arc<Mutex<DeviceState>>,
}

impl CudaStager {
    /// A stager on `side`'s GPU, at the addresses and stream its operations set.
    fn on(side: &DeviceSide) -> Box<CudaStager> {
        Box::new(CudaStager {
            dev: CudaBucketDevice::new(&side.gpu, Stream::default()),
            current: side.current.clone(),
        })
    }
}

impl BucketStager for CudaStager {
    fn addr(&self, key: &str) -> Option<u64> {
        let cur = self.current.lock().unwrap_or_else(|p| p.into_inner());
        cur.addrs.get(key).copied()
    }

    fn device(&mut self) -> &mut dyn BucketDevice {
        self.dev.stream = self
            .current
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .stream;
        &mut self.dev
    }
}

/// After `init_sender`: a bucket sender with `bucket_device: cuda` whose state has CUDA tensors packs their
/// buckets on the GPU (cast to the wire dtype there) into pinned buffers; its CPU tensors are read on the
/// host. Without CUDA tensors (no device side) buckets are staged on the host. Returns whether it attached.
pub(crate) fn attach_stager(side: &Option<SharedSide>, sender: &mut SyncSender) -> bool {
    let Some(s) = side else {
        return false;
    };
    if sender.kind() != SyncerKind::Bucket || sender.bucket_device() != Device::Cuda {
        return false;
    }
    let mut g = lock(s);
    let attached = sender.set_bucket_stager(CudaStager::on(&g));
    if attached {
        g.mode = Mode::BucketPack;
    }
    attached
}

/// After `init_receiver`: a patch receiver whose synced keys are all CUDA tensors installs on the device; a
/// bucket receiver with `bucket_device: cuda` installs its CUDA tensors on the device (its CPU tensors on the
/// host) once each version verified whole. Returns whether it attached.
pub(crate) fn attach_installer(side: &Option<SharedSide>, receiver: &SyncReceiver) -> bool {
    let Some(s) = side else {
        return false;
    };
    let mut g = lock(s);
    match receiver.kind() {
        SyncerKind::Patch if covers(&g.current, receiver.synced_keys()) => {
            receiver.set_patch_installer(Arc::new(GpuInstaller::new(
                g.gpu.clone(),
                g.current.clone(),
            )));
            g.mode = Mode::Patch;
            true
        }
        SyncerKind::Bucket if receiver.bucket_device() == Device::Cuda => {
            let attached = receiver.set_bucket_stager(CudaStager::on(&g));
            if attached {
                g.mode = Mode::BucketInstall;
            }
            attached
        }
        _ => false,
    }
}

/// Stage `descs` for an operation: CUDA tensors are checked and replaced by their host copies in `side`
/// (created, or re-created when the tensors moved, on first use). Returns the descriptions for the crate
/// and the device side when the state has CUDA tensors. `stream`: the caller's current CUDA stream.
pub(crate) fn stage(
    descs: Vec<Desc>,
    side: &mut Option<SharedSide>,
    stream: u64,
) -> PyResult<(Vec<Desc>, Option<SharedSide>)> {
    let mut ordinal = None;
    let mut cuda = Vec::new(); // (position in descs, tensor)
    for (i, d) in descs.iter().enumerate() {
        let Some(o) = cuda_ordinal(&d.6) else {
            continue;
        };
        let o = o.map_err(|_| {
            pyo3::exceptions::PyValueError::new_err(format!(
                "tensor '{}': cannot read its device '{}'",
                d.0, d.6
            ))
        })?;
        match ordinal {
            None => ordinal = Some(o),
            Some(first) if first != o => {
                return Err(pyo3::exceptions::PyValueError::new_err(format!(
                    "tensor '{}' is on cuda:{o} and earlier ones on cuda:{first}: rlsync syncs the CUDA tensors of one device per state dict",
                    d.0
                )));
            }
            Some(_) => {}
        }
        let (_, bytes) = check_device_memory(&raw_tensor(d)).map_err(|e| borrow_error(&e))?;
        cuda.push((
            i,
            DeviceTensor {
                addr: d.2 as u64,
                bytes,
            },
        ));
    }
    let Some(ordinal) = ordinal else {
        return Ok((descs, None));
    };
    // One host copy per distinct device range; identical ranges (tied tensors) share it, overlaps are refused.
    let mut order: Vec<usize> = (0..cuda.len()).collect();
    order.sort_by_key(|&k| (cuda[k].1.addr, cuda[k].1.bytes));
    let mut unique: Vec<DeviceTensor> = Vec::new();
    let mut slot_of = vec![0usize; cuda.len()];
    let mut last: Option<usize> = None; // index into `cuda` of the previous distinct range
    for &k in &order {
        let t = cuda[k].1;
        if let Some(p) = last {
            let prev = cuda[p].1;
            if prev == t && t.bytes > 0 {
                slot_of[k] = slot_of[p];
                continue;
            }
            if t.bytes > 0 && prev.addr + prev.bytes as u64 > t.addr {
                let (a, b) = (&descs[cuda[p].0].0, &descs[cuda[k].0].0);
                return Err(borrow_error(&BorrowError::Overlap {
                    first: a.clone(),
                    second: b.clone(),
                }));
            }
        }
        slot_of[k] = unique.len();
        unique.push(t);
        if t.bytes > 0 {
            last = Some(k);
        }
    }
    let stream = Stream(stream);
    let addrs = cuda
        .iter()
        .map(|(i, t)| (descs[*i].0.clone(), t.addr))
        .collect();
    if let Some(s) = side.as_ref() {
        let g = lock(s);
        if g.mode != Mode::HostStaging && g.gpu.ordinal() != ordinal {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "the state dict's CUDA tensors moved from cuda:{} (at init) to cuda:{ordinal}: a syncer stays on the device it was initialised on",
                g.gpu.ordinal()
            )));
        }
    }
    let reuse = side.as_ref().is_some_and(|s| {
        let g = lock(s);
        g.gpu.ordinal() == ordinal && g.mirror.matches(&unique)
    });
    if reuse {
        if let Some(s) = side.as_ref() {
            let g = lock(s);
            let mut cur = g.current.lock().unwrap_or_else(|p| p.into_inner());
            cur.addrs = addrs;
            cur.stream = stream;
        }
    } else {
        let gpu = match side.as_ref() {
            Some(s) if lock(s).gpu.ordinal() == ordinal => lock(s).gpu.clone(),
            _ => Gpu::open(ordinal).map_err(|e| gpu_error(&e))?,
        };
        let mirror = Mirror::new(&gpu, unique).map_err(|e| gpu_error(&e))?;
        // A side that existed keeps its address table (a device build or install holds it).
        let (current, mode) = match side.as_ref() {
            Some(s) => {
                let g = lock(s);
                (g.current.clone(), g.mode)
            }
            None => (
                Arc::new(Mutex::new(DeviceState::default())),
                Mode::HostStaging,
            ),
        };
        {
            let mut cur = current.lock().unwrap_or_else(|p| p.into_inner());
            cur.addrs = addrs;
            cur.stream = stream;
        }
        *side = Some(Arc::new(Mutex::new(DeviceSide {
            gpu,
            mirror,
            current,
            mode,
            checksum: None,
        })));
    }
    let Some(s) = side.as_ref() else {
        return Ok((descs, None));
    };
    let g = lock(s);
    let mut descs = descs;
    for (k, (i, _)) in cuda.iter().enumerate() {
        let host = g.mirror.host_addr(slot_of[k]).unwrap_or(0);
        descs[*i].2 = host;
        descs[*i].6 = "cpu".to_owned();
    }
    drop(g);
    Ok((descs, Some(s.clone())))
}

/// `rlsync.cuda_available()`: `(True, "<device count> device(s), driver <version>")` where CUDA tensors can
/// be synced, else `(False, why)` (a build without CUDA, or no driver).
#[pyfunction]
pub(crate) fn cuda_available() -> (bool, String) {
    match rlsync_core::gpu::probe() {
        Ok(info) => (
            info.devices > 0,
            format!(
                "{} CUDA device(s), driver API {}.{}",
                info.devices,
                info.driver_version / 1000,
                info.driver_version % 1000 / 10
            ),
        ),
        Err(e) => (false, rlsync_core::error_chain(&e)),
    }
}
