//! The GPU channel's casts: a sender whose synced tensors are in other floating dtypes than the receivers'
//! (fp32 master weights, bf16 rollouts) diffs a scratch copy in their dtypes, refreshed by one `cast_gather`
//! before each bootstrap and build, bit for bit as the host path's `cast_bytes`.
//!
//! [`Casting`] wraps the sender's device: its inner device reads the cast copies as the state (and hashes
//! them for [`SenderDevice::state_checksum`]: what the receivers hold); the [`CastStage`] refreshes them from
//! the state first, on the CUDA stream the inner device then works on ([`CudaCast`]) or with the kernel's
//! reference over a simulated device ([`RefCast`]). The scratch costs the cast tensors' size in the receivers'
//! dtype of GPU memory, kept for the channel's life.

use super::reference::SimMemory;
use super::wire::{Export, WidthExport};
use super::{Layout, SenderDevice, WidthBuilt};
use crate::gpu::bucket::CastJob;
use crate::gpu::differ::{CastBufs, CastPlan};
use crate::gpu::reference::PoolSum;
use crate::gpu::{Gpu, GpuError, Stream};
use crate::syncer::SyncError;
use crate::tensor::DType;

/// Refreshes a sender's cast copies from its state.
pub trait CastStage: Send {
    /// Cast the state's tensors into their copies (queued before the inner device's next work).
    fn refresh(&mut self) -> Result<(), GpuError>;
}

/// A sender device whose state is cast first (see the module docs).
pub struct Casting<D, C> {
    pub inner: D,
    pub cast: C,
}

/// A casting sender writes payloads from its inner device's buffers (the cast happened before the build).
impl<D: crate::gpu::payload::PayloadOut, C: CastStage> crate::gpu::payload::PayloadOut
    for Casting<D, C>
{
    fn copy_out(
        &mut self,
        dst: u64,
        header: &[u8],
        parts: &[crate::gpu::payload::Part],
    ) -> Result<(), GpuError> {
        self.inner.copy_out(dst, header, parts)
    }
    fn snapshot_checksum(
        &mut self,
        names: &[(String, DType, Vec<usize>)],
        offsets: &[u64],
    ) -> Result<u64, GpuError> {
        self.inner.snapshot_checksum(names, offsets)
    }
}

impl<D: SenderDevice, C: CastStage> SenderDevice for Casting<D, C> {
    fn prepare(
        &mut self,
        layout: &Layout,
        offsets: &[u64],
        snapshot_bytes: u64,
    ) -> Result<(Export, Vec<WidthExport>), GpuError> {
        self.inner.prepare(layout, offsets, snapshot_bytes)
    }

    fn bootstrap(&mut self, layout: &Layout, offsets: &[u64]) -> Result<(), GpuError> {
        self.cast.refresh()?;
        self.inner.bootstrap(layout, offsets)
    }

    fn build(
        &mut self,
        layout: &Layout,
        offsets: &[u64],
        seed: u64,
    ) -> Result<Vec<WidthBuilt>, GpuError> {
        self.cast.refresh()?;
        self.inner.build(layout, offsets, seed)
    }

    fn snapshot_sum(
        &mut self,
        layout: &Layout,
        offsets: &[u64],
        seed: u64,
    ) -> Result<Vec<PoolSum>, GpuError> {
        self.inner.snapshot_sum(layout, offsets, seed)
    }

    fn device(&self) -> u32 {
        self.inner.device()
    }

    fn state_checksum(&mut self, names: &[(String, DType, Vec<usize>)]) -> Result<u64, GpuError> {
        self.inner.state_checksum(names)
    }
}

/// The casts on CUDA: one `cast_gather` launch on the sender's stream into rlsync's scratch allocation.
pub struct CudaCast {
    gpu: Gpu,
    bufs: CastBufs,
    state: Vec<u64>,
    stream: Stream,
}

impl CudaCast {
    /// The casts of `plan` from the CUDA tensors at `state` (layout order) on `stream`, and the addresses the
    /// inner device must read as the state (the cast copies, else the tensors). [`SyncError::CastScratch`]
    /// when the scratch does not fit on the GPU.
    ///
    /// # Safety
    /// `state` must be live CUDA tensors of `gpu` in the plan's state dtypes, unchanged while the channel's
    /// operations run (a worker's parameters keep their identity).
    pub unsafe fn new(
        gpu: Gpu,
        plan: CastPlan,
        state: Vec<u64>,
        stream: Stream,
    ) -> Result<(CudaCast, Vec<u64>), SyncError> {
        let bufs = CastBufs::new(&gpu, plan)?;
        let diff = bufs.diff_state(&state);
        Ok((
            CudaCast {
                gpu,
                bufs,
                state,
                stream,
            },
            diff,
        ))
    }

    /// Point the casts at the state tensors now at `state` (layout order) on `stream`, for a caller whose
    /// tensors may move between operations (the Python API passes them per call); the addresses the inner
    /// device must now read as the state.
    ///
    /// # Safety
    /// As [`CudaCast::new`]'s, for the new `state`.
    pub unsafe fn retarget(&mut self, state: Vec<u64>, stream: Stream) -> Vec<u64> {
        let diff = self.bufs.diff_state(&state);
        self.state = state;
        self.stream = stream;
        diff
    }
}

/// A sender whose receivers hold its own dtypes: nothing to cast.
impl<C: CastStage> CastStage for Option<C> {
    fn refresh(&mut self) -> Result<(), GpuError> {
        self.as_mut().map_or(Ok(()), C::refresh)
    }
}

impl CastStage for CudaCast {
    fn refresh(&mut self) -> Result<(), GpuError> {
        // SAFETY: `state` is the constructor's contract; the inner device works on the same stream after this
        // launch and synchronises it before returning, so the pinned table is not rewritten while queued.
        unsafe { self.bufs.queue(&self.gpu, &self.state, self.stream) }
    }
}

/// The casts on a simulated device, by `cast_gather`'s reference.
pub struct RefCast<M: SimMemory> {
    sim: M,
    jobs: Vec<CastJob>,
    total: u64,
}

impl<M: SimMemory> RefCast<M> {
    /// The casts of `plan` from the tensors at `state` in `sim`'s memory (a scratch buffer allocated there),
    /// and the addresses the inner device must read as the state.
    pub fn new(sim: M, plan: &CastPlan, state: &[u64]) -> (RefCast<M>, Vec<u64>) {
        let scratch = sim.with(|mem| mem.alloc(&vec![0; plan.scratch_bytes.max(1) as usize]));
        let (jobs, total) = plan.jobs(state, scratch);
        let diff = plan.diff_state(state, scratch);
        (RefCast { sim, jobs, total }, diff)
    }
}

impl<M: SimMemory> CastStage for RefCast<M> {
    fn refresh(&mut self) -> Result<(), GpuError> {
        self.sim
            .with(|mem| crate::gpu::reference::cast::cast_gather(mem, &self.jobs, self.total))
            .map_err(|e| GpuError::Driver {
                op: "reference cast_gather",
                code: 1,
                name: e.to_string(),
            })
    }
}
