//! A simulated device for the test worker (`RLSYNC_TEST_DEVICE=1`): the synthetic workload's weights live in a
//! second state dict, the "device tensors", and the runtime's state dict borrows host copies of them, as a Python
//! model on a GPU has; the patch build and install attach to the device copy, so a run checks that the worker
//! runtime asks for the host view before every read of the copies, pushes what it writes into them, and lets
//! the syncs run on the device.
//!
//! Every pull and push is one line on stderr (the worker's log): `simulated device: pull` / `… push`; so is
//! every checksum hashed on the device copy (`simulated device: checksum`), and every build and install of the
//! same-host GPU channel (`simulated device: GPU channel build` / `… install`), which runs the reference
//! kernels over the device copy with its exports shared across the workers' processes as files.

use std::collections::HashMap;
use std::convert::Infallible;
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use rlsync::worker::host_copies::{HostCopies, LazyHostCopies};
use rlsync::worker::workload::{
    Batch, EpisodeMetrics, TrainStats, TrajectoryChunk, Workload, WorkloadError,
};
use rlsync_core::gpu::GpuError;
use rlsync_core::gpu::checksum::Plan;
use rlsync_core::gpu::compact::Layout as ChannelLayout;
use rlsync_core::gpu::differ::CastPlan;
use rlsync_core::gpu::ipc::cast::{Casting, RefCast};
use rlsync_core::gpu::ipc::reference::{FileSim, RefReceiver, RefSender, SimMemory as _};
use rlsync_core::gpu::ipc::wire::{Export, Setup, WidthExport};
use rlsync_core::gpu::ipc::{ReceiverDevice, SenderDevice, WidthBuilt};
use rlsync_core::gpu::reference::{Memory, PoolSum};
use rlsync_core::syncer::offload::{PatchBuilder, PatchInstaller};
use rlsync_core::syncer::patch::{self, Built, SnapTensor, ValidPatch};
use rlsync_core::syncer::settings::SyncerKind;
use rlsync_core::syncer::{SyncError, SyncReceiver, SyncSender};
use rlsync_core::tensor::{DType, Layout, StateDict, Storage, Tensor};

/// The device copy, shared with the attached builder or installer.
type Device = Arc<Mutex<StateDict>>;

fn lock(device: &Device) -> MutexGuard<'_, StateDict> {
    device.lock().unwrap_or_else(|p| p.into_inner())
}

/// `inner` with its weights on the simulated device (see the module docs).
pub struct SimDevice {
    inner: Box<dyn Workload>,
    device: Device,
    /// The host copies the runtime's state dict borrows, refreshed as a Python worker's are.
    copies: LazyHostCopies<SimCopies>,
    /// Where the GPU channel's exports go (the run's private directory), when the run uses the channel.
    exports: Option<PathBuf>,
}

/// The device copy and the host copies the runtime's state dict borrows, by key.
struct SimCopies {
    device: Device,
    host: Vec<(String, Tensor)>,
}

impl HostCopies for SimCopies {
    type Error = Infallible;

    fn pull(&mut self) -> Result<(), Infallible> {
        let device = lock(&self.device);
        for (key, copy) in &mut self.host {
            if let Some(t) = device.get(key) {
                copy.bytes_mut().copy_from_slice(t.bytes());
            }
        }
        eprintln!("simulated device: pull");
        Ok(())
    }

    fn push(&mut self) -> Result<(), Infallible> {
        let mut device = lock(&self.device);
        for (key, copy) in &self.host {
            if let Some(t) = device.get_mut(key) {
                t.bytes_mut().copy_from_slice(copy.bytes());
            }
        }
        eprintln!("simulated device: push");
        Ok(())
    }
}

impl SimDevice {
    pub fn new(inner: Box<dyn Workload>, exports: Option<&Path>) -> SimDevice {
        let device: Device = Arc::new(Mutex::new(StateDict::new()));
        let copies = SimCopies {
            device: device.clone(),
            host: Vec::new(),
        };
        SimDevice {
            inner,
            device,
            copies: LazyHostCopies::new(copies),
            exports: exports.map(Path::to_owned),
        }
    }
}

impl SimDevice {
    fn exports_dir(&self) -> Result<&Path, WorkloadError> {
        self.exports
            .as_deref()
            .ok_or_else(|| WorkloadError::GpuChannel {
                reason: "the launch file names no GPU channel socket".into(),
            })
    }
}

impl Workload for SimDevice {
    /// The inner workload's weights become the device copy; the returned state borrows host copies of them.
    fn init_state(&mut self) -> Result<StateDict, WorkloadError> {
        let device = self.inner.init_state()?;
        let mut state = StateDict::new();
        let mut host = Vec::new();
        for (key, t) in device.iter() {
            // Filled by the first pull, as a Python worker's copies are.
            let mut copy = Tensor::zeros(t.dtype(), t.shape(), t.class())?;
            let bytes = copy.bytes_mut();
            // SAFETY: the copy's heap memory lives in the copies as long as the worker runs (moving the tensor
            // does not move it) and is written only by `pull`, which the runtime calls between its operations.
            let storage = unsafe { Storage::borrowed(bytes.as_mut_ptr(), bytes.len()) };
            let layout = Layout::new(t.dtype(), t.shape());
            state.insert(key, Tensor::from_storage(layout, storage, t.class())?);
            host.push((key.to_owned(), copy));
        }
        *lock(&self.device) = device;
        self.copies = LazyHostCopies::new(SimCopies {
            device: self.device.clone(),
            host,
        });
        self.copies.host_view().unwrap_or_else(|e| match e {});
        Ok(state)
    }

    fn train_step(
        &mut self,
        _state: &mut StateDict,
        batch: &Batch<'_>,
    ) -> Result<TrainStats, WorkloadError> {
        let stats = self.inner.train_step(&mut lock(&self.device), batch)?;
        self.copies.device_changed();
        Ok(stats)
    }

    fn rollout(
        &mut self,
        _state: &StateDict,
        version: u64,
        steps: u32,
    ) -> Result<TrajectoryChunk, WorkloadError> {
        self.inner.rollout(&lock(&self.device), version, steps)
    }

    fn evaluate(
        &mut self,
        _state: &StateDict,
        version: u64,
    ) -> Result<Option<EpisodeMetrics>, WorkloadError> {
        self.inner.evaluate(&lock(&self.device), version)
    }

    fn save_checkpoint(
        &mut self,
        state: &StateDict,
        run_dir: &Path,
        step: u64,
        version: u64,
    ) -> Result<PathBuf, WorkloadError> {
        if !self.copies.is_current() {
            return Err(WorkloadError::Foreign {
                message: "simulated device: a checkpoint of stale host copies (no host_view first)"
                    .into(),
            });
        }
        self.inner.save_checkpoint(state, run_dir, step, version)
    }

    fn restore(&mut self, state: &mut StateDict, dir: &Path) -> Result<(), WorkloadError> {
        self.inner.restore(state, dir)?;
        self.weights_written(false)
    }

    fn attach_sender(&mut self, sender: &mut SyncSender, _state: &StateDict) -> Option<String> {
        let builder = DeviceBuild(self.device.clone());
        sender
            .set_patch_builder(Box::new(builder))
            .then(|| "simulated device: patch build".to_owned())
    }

    fn attach_receiver(&mut self, receiver: &SyncReceiver) -> Option<String> {
        if receiver.kind() != SyncerKind::Patch {
            return None;
        }
        receiver.set_patch_installer(Arc::new(DeviceInstall(self.device.clone())));
        Some("simulated device: patch install".to_owned())
    }

    /// Hashed where the weights are, as the binding's CUDA workers do: the device checksum's plan, run with
    /// the kernel's CPU reference over a copy of the device tensors.
    fn weights_checksum(
        &mut self,
        state: &StateDict,
        keys: &[String],
    ) -> Result<Option<u64>, WorkloadError> {
        let mut mem = Memory::default();
        let addrs: HashMap<String, u64> = lock(&self.device)
            .iter()
            .map(|(key, t)| (key.to_owned(), mem.alloc(t.bytes())))
            .collect();
        let sum = Plan::new(state, keys, &addrs)
            .finish_on(&mem, NonZeroUsize::MIN)
            .map_err(|e| WorkloadError::Foreign {
                message: format!("simulated device: checksum: {e}"),
            })?;
        eprintln!("simulated device: checksum");
        Ok(Some(sum))
    }

    /// The GPU channel on the simulated device: the reference kernels over memories whose exports are files.
    fn gpu_sender_device(
        &mut self,
        _state: &StateDict,
        keys: &[String],
        dtypes: &[DType],
    ) -> Result<Box<dyn SenderDevice + Send>, WorkloadError> {
        let (sim, tensors) = stage_channel(self.exports_dir()?, &self.device, keys)?;
        let addrs: Vec<u64> = tensors.iter().map(|t| t.1).collect();
        // Tensors the rollouts hold in another dtype are cast on the simulated device first.
        let plan = CastPlan::to_dtypes(&lock(&self.device), keys, dtypes)
            .map_err(|reason| WorkloadError::GpuChannel { reason })?;
        let device = self.device.clone();
        if plan.is_empty() {
            eprintln!("simulated device: GPU channel sender");
            return Ok(Box::new(ChannelDevice {
                inner: RefSender::new(sim.clone(), addrs),
                sim,
                device,
                tensors,
            }));
        }
        eprintln!("simulated device: GPU channel sender, casting");
        let (cast, diff) = RefCast::new(sim.clone(), &plan, &addrs);
        Ok(Box::new(ChannelDevice {
            inner: Casting {
                inner: RefSender::new(sim.clone(), diff),
                cast,
            },
            sim,
            device,
            tensors,
        }))
    }

    fn gpu_receiver_device(
        &mut self,
        _state: &StateDict,
        keys: &[String],
    ) -> Result<Box<dyn ReceiverDevice + Send>, WorkloadError> {
        let (sim, tensors) = stage_channel(self.exports_dir()?, &self.device, keys)?;
        let addrs = tensors.iter().map(|t| t.1).collect();
        eprintln!("simulated device: GPU channel receiver");
        Ok(Box::new(ChannelDevice {
            inner: RefReceiver::new(sim.clone(), addrs),
            sim,
            device: self.device.clone(),
            tensors,
        }))
    }

    fn host_view(&mut self) -> Result<(), WorkloadError> {
        self.copies.host_view().unwrap_or_else(|e| match e {});
        Ok(())
    }

    fn weights_written(&mut self, on_device: bool) -> Result<(), WorkloadError> {
        self.copies
            .written(on_device)
            .unwrap_or_else(|e| match e {});
        Ok(())
    }
}

/// The patch build over the device copy (the host view the sender is handed is ignored, as the GPU build's).
struct DeviceBuild(Device);

impl PatchBuilder for DeviceBuild {
    fn build(
        &mut self,
        snap: &mut [SnapTensor],
        _state: &StateDict,
        threads: NonZeroUsize,
        built: &mut Built,
    ) -> Result<(), SyncError> {
        patch::build(snap, &lock(&self.0), threads, built).map_err(|reason| {
            SyncError::StateMismatch {
                key: "(simulated device)".into(),
                reason,
            }
        })
    }
}

/// The patch install into the device copy (the host copies are left as they are, as the GPU install's).
struct DeviceInstall(Device);

impl PatchInstaller for DeviceInstall {
    fn install(
        &self,
        valid: &ValidPatch,
        _state: &mut StateDict,
        threads: NonZeroUsize,
    ) -> Result<(), SyncError> {
        patch::install(valid, &mut lock(&self.0), threads);
        Ok(())
    }
}

/// The GPU channel's device over the simulated device: the reference kernels run on a [`FileSim`] memory (its
/// exports files in the run's private directory, as CUDA IPC maps them across processes) that holds a copy of
/// the synced device tensors, refreshed from the device copy before each build (sender) and written back into it
/// after each install (receiver).
struct ChannelDevice<D> {
    inner: D,
    sim: FileSim,
    device: Device,
    /// (key, address in `sim`) of each synced tensor, in order.
    tensors: Vec<(String, u64)>,
}

/// A simulated device (its exports in `dir`) holding a copy of the device tensors of `keys`; their addresses in
/// it.
fn stage_channel(
    dir: &Path,
    device: &Device,
    keys: &[String],
) -> Result<(FileSim, Vec<(String, u64)>), WorkloadError> {
    let sim = FileSim::new(dir);
    let device = lock(device);
    let tensors = keys
        .iter()
        .map(|k| {
            let t = device
                .get(k)
                .ok_or_else(|| WorkloadError::MissingTensor { name: k.clone() })?;
            Ok((k.clone(), sim.with(|mem| mem.alloc(t.bytes()))))
        })
        .collect::<Result<Vec<_>, WorkloadError>>()?;
    Ok((sim, tensors))
}

impl<D> ChannelDevice<D> {
    /// `sim`'s copies := the device tensors.
    fn copy_in(&self) -> Result<(), GpuError> {
        let device = lock(&self.device);
        self.sim.with(|mem| {
            for (key, addr) in &self.tensors {
                if let Some(t) = device.get(key) {
                    let dst = mem
                        .write(*addr, t.bytes().len() as u64)
                        .map_err(sim_error)?;
                    dst.copy_from_slice(t.bytes());
                }
            }
            Ok(())
        })
    }

    /// The device tensors := `sim`'s copies.
    fn copy_out(&self) -> Result<(), GpuError> {
        let mut device = lock(&self.device);
        self.sim.with(|mem| {
            for (key, addr) in &self.tensors {
                if let Some(t) = device.get_mut(key) {
                    let src = mem.read(*addr, t.bytes().len() as u64).map_err(sim_error)?;
                    t.bytes_mut().copy_from_slice(src);
                }
            }
            Ok(())
        })
    }
}

fn sim_error(e: impl std::fmt::Display) -> GpuError {
    GpuError::Driver {
        op: "simulated device",
        code: 1,
        name: e.to_string(),
    }
}

impl<D: SenderDevice + Send> SenderDevice for ChannelDevice<D> {
    fn prepare(
        &mut self,
        layout: &ChannelLayout,
        offsets: &[u64],
        snapshot_bytes: u64,
    ) -> Result<(Export, Vec<WidthExport>), GpuError> {
        self.inner.prepare(layout, offsets, snapshot_bytes)
    }

    fn bootstrap(&mut self, layout: &ChannelLayout, offsets: &[u64]) -> Result<(), GpuError> {
        self.copy_in()?;
        self.inner.bootstrap(layout, offsets)
    }

    fn build(
        &mut self,
        layout: &ChannelLayout,
        offsets: &[u64],
        seed: u64,
    ) -> Result<Vec<WidthBuilt>, GpuError> {
        self.copy_in()?;
        eprintln!("simulated device: GPU channel build");
        self.inner.build(layout, offsets, seed)
    }

    fn snapshot_sum(
        &mut self,
        layout: &ChannelLayout,
        offsets: &[u64],
        seed: u64,
    ) -> Result<Vec<PoolSum>, GpuError> {
        self.inner.snapshot_sum(layout, offsets, seed)
    }

    fn device(&self) -> u32 {
        0
    }

    /// What the rollouts hold, hashed on the simulated device (the cast copies where the sender casts).
    fn state_checksum(&mut self, names: &[(String, DType, Vec<usize>)]) -> Result<u64, GpuError> {
        eprintln!("simulated device: checksum");
        self.inner.state_checksum(names)
    }
}

impl<D: ReceiverDevice + Send> ReceiverDevice for ChannelDevice<D> {
    fn open(&mut self, setup: &Setup) -> Result<(), GpuError> {
        self.inner.open(setup)
    }

    fn full(&mut self, setup: &Setup) -> Result<(), GpuError> {
        self.inner.full(setup)?;
        self.copy_out()
    }

    fn apply(&mut self, setup: &Setup, layout: &ChannelLayout) -> Result<(), GpuError> {
        self.inner.apply(setup, layout)?;
        eprintln!("simulated device: GPU channel install");
        self.copy_out()
    }

    fn drain(&mut self) -> Result<(), GpuError> {
        self.inner.drain()
    }

    fn checksum(
        &mut self,
        setup: &Setup,
        layout: &ChannelLayout,
        seed: u64,
        full: bool,
    ) -> Result<Vec<PoolSum>, GpuError> {
        self.inner.checksum(setup, layout, seed, full)
    }

    fn device(&self) -> u32 {
        0
    }
}
