//! The patch install into CUDA tensors: a patch is decoded on the host straight into pinned staging
//! (`ScatterShape::decode_into`, entries in parallel, as the host install would apply them), copied to the
//! device and written by the `scatter` kernels on the caller's stream; dense entries are copied straight into
//! the tensors.
//!
//! Verification stays on the host and before any write: the receiver checks the entry table
//! (`patch::plan`), and [`PatchInstaller::check_install`] checks each entry's streams in the same walk that
//! decodes them into the staging (`ScatterShape::decode_checked_into`: one walk of the coded streams, not a
//! validate walk and then a decode walk); a patch that fails is rejected before anything is copied to the
//! device. The tensors are written in place, so parameters keep their identity (optimizers and captured CUDA
//! graphs stay valid). Kernels run on the caller's stream and the install waits for them before it returns.
//! The staging buffers are kept between installs (grown to a power of two), so a steady run allocates
//! nothing.

use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};

use super::compact;
use super::{Arg, DeviceBuf, DeviceState, Gpu, GpuError, Kernel, PinnedBuf, Stream};
use crate::syncer::SyncError;
use crate::syncer::offload::{CheckInstallError, PatchInstaller, check_then_install};
use crate::syncer::patch::{
    DenseCopy, PlannedPatch, ScatterEntry, ScatterShape, ValidPatch, scatter_plan,
};
use crate::tensor::StateDict;

/// Blocks per multiprocessor of a grid-stride launch.
const BLOCKS_PER_SM: usize = 16;

/// Installs patches into CUDA tensors (see the module docs).
pub struct GpuInstaller {
    gpu: Gpu,
    current: Arc<Mutex<DeviceState>>,
    staging: Mutex<Staging>,
}

/// A device buffer and its pinned staging twin, grown on demand.
#[derive(Default)]
struct Pair {
    bufs: Option<(DeviceBuf, PinnedBuf)>,
}

impl Pair {
    /// A pinned staging area of at least `len` bytes (its device twin as large), grown on demand.
    fn reserve(&mut self, gpu: &Gpu, len: usize) -> Result<&mut PinnedBuf, GpuError> {
        // A pair too small is freed before the larger one is allocated.
        let pair = match self.bufs.take().filter(|(d, _)| d.len() >= len) {
            Some(pair) => pair,
            None => {
                let cap = len.next_power_of_two().max(4096);
                (gpu.alloc(cap)?, gpu.pinned(cap)?)
            }
        };
        Ok(&mut self.bufs.insert(pair).1)
    }

    /// Queue the copy of the first `len` staged bytes to the device; the device address (0 for nothing).
    fn queue(&self, gpu: &Gpu, len: usize, stream: Stream) -> Result<u64, GpuError> {
        let Some((dev, host)) = self.bufs.as_ref().filter(|_| len > 0) else {
            return Ok(0);
        };
        // SAFETY: rlsync's buffers, `len` fits both (reserved); the pinned source is not touched until the
        // install synchronises the stream.
        unsafe { gpu.write_async(dev.addr(), host.as_ptr(), len.min(host.len()), stream) }?;
        Ok(dev.addr())
    }

    /// The device buffer's address (0 before the first reserve).
    fn addr(&self) -> u64 {
        self.bufs.as_ref().map_or(0, |(d, _)| d.addr())
    }

    /// Stage `bytes` and queue their copy to the device; returns the device address.
    fn upload(&mut self, gpu: &Gpu, bytes: &[u8], stream: Stream) -> Result<u64, GpuError> {
        self.reserve(gpu, bytes.len())?[..bytes.len()].copy_from_slice(bytes);
        self.queue(gpu, bytes.len(), stream)
    }
}

/// The first `n` elements of a staging buffer as `T`s (pinned buffers are page-aligned and reserved for `n`).
fn typed<T: bytemuck::Pod>(buf: &mut [u8], n: usize) -> Result<&mut [T], GpuError> {
    let have = buf.len();
    buf.get_mut(..n * size_of::<T>())
        .and_then(|b| bytemuck::try_cast_slice_mut(b).ok())
        .ok_or_else(|| GpuError::Driver {
            op: "staging",
            code: 1,
            name: format!("a staging buffer of {have} bytes for {n} elements"),
        })
}

/// One width's index and value lists of `n` changes, in its pinned staging.
fn stage_lists<'a>(
    gpu: &Gpu,
    idx: &'a mut Pair,
    vals: &'a mut Pair,
    n: usize,
) -> Result<(&'a mut [u32], &'a mut [u64]), GpuError> {
    Ok((
        typed(idx.reserve(gpu, n * 4)?, n)?,
        typed(vals.reserve(gpu, n * 8)?, n)?,
    ))
}

/// Per width slot: a staging area's indices and values.
type Lists<'a> = [(&'a mut [u32], &'a mut [u64]); 4];

/// Per width slot the pinned staging lists (indices, values) of `shape`'s changes.
fn staged_lists<'a>(
    gpu: &Gpu,
    staging: &'a mut Staging,
    shape: &ScatterShape,
) -> Result<Lists<'a>, GpuError> {
    let Staging { idx, vals, .. } = staging;
    let [i0, i1, i2, i3] = idx;
    let [v0, v1, v2, v3] = vals;
    Ok([
        stage_lists(gpu, i0, v0, shape.changes(0))?,
        stage_lists(gpu, i1, v1, shape.changes(1))?,
        stage_lists(gpu, i2, v2, shape.changes(2))?,
        stage_lists(gpu, i3, v3, shape.changes(3))?,
    ])
}

/// Per width: jobs, indices, values; and the dense bytes.
#[derive(Default)]
struct Staging {
    jobs: [Pair; 4],
    idx: [Pair; 4],
    vals: [Pair; 4],
    dense: Pair,
}

impl GpuInstaller {
    /// An installer on `gpu`; `current` holds the device addresses of the receiver's CUDA tensors and the
    /// stream for each install (refreshed by the caller before every call).
    pub fn new(gpu: Gpu, current: Arc<Mutex<DeviceState>>) -> GpuInstaller {
        GpuInstaller {
            gpu,
            current,
            staging: Mutex::new(Staging::default()),
        }
    }
}

impl GpuInstaller {
    /// The device address of each tensor of `state` (`None` for a host tensor) and the install's stream;
    /// every tensor a patch writes (`ordinals`) must be a CUDA tensor (checked before any write).
    fn targets(
        &self,
        mut ordinals: impl Iterator<Item = usize>,
        state: &StateDict,
    ) -> Result<(Vec<Option<u64>>, Stream), SyncError> {
        let (addrs, stream) = {
            let cur = self.current.lock().unwrap_or_else(|p| p.into_inner());
            let addrs: Vec<Option<u64>> = state.keys().map(|k| cur.addrs.get(k).copied()).collect();
            (addrs, cur.stream)
        };
        if let Some(missing) = ordinals.find(|&o| addrs.get(o).copied().flatten().is_none()) {
            let key = state.keys().nth(missing).unwrap_or("?").to_owned();
            return Err(SyncError::StateMismatch {
                key,
                reason: "the patch targets it but it is not a CUDA tensor of this state dict"
                    .into(),
            });
        }
        Ok((addrs, stream))
    }

    /// Queue the copies of `shape`'s lists (decoded into `staging`) to the device, scatter them and copy the
    /// dense entries from `dense_stream`, waited for.
    fn scatter_staged(
        &self,
        staging: &mut Staging,
        shape: &ScatterShape,
        dense_stream: &[u8],
        addrs: &[Option<u64>],
        stream: Stream,
    ) -> Result<(), GpuError> {
        for slot in 0..4 {
            let n = shape.changes(slot);
            staging.idx[slot].queue(&self.gpu, n * 4, stream)?;
            staging.vals[slot].queue(&self.gpu, n * 8, stream)?;
        }
        let entries = std::array::from_fn(|slot| shape.entries(slot));
        self.scatter(staging, entries, shape.dense(), dense_stream, addrs, stream)
    }

    /// Launch `scatter` per width over the lists already queued in `staging`, copy the dense entries from
    /// `dense_stream`, wait for the stream.
    fn scatter(
        &self,
        staging: &mut Staging,
        entries: [&[ScatterEntry]; 4],
        dense: &[DenseCopy],
        dense_stream: &[u8],
        addrs: &[Option<u64>],
        stream: Stream,
    ) -> Result<(), GpuError> {
        let addr_of = |ordinal: usize| addrs.get(ordinal).copied().flatten().unwrap_or(0);
        let gpu = &self.gpu;
        let grid_cap = gpu.sm_count() * BLOCKS_PER_SM;
        // The staging's pinned buffers are read by the queued copies: waited for whatever fails midway.
        gpu.settled(stream, || {
            for (slot, entries) in entries.iter().enumerate() {
                let total: usize = entries.iter().map(|e| e.count).sum();
                if total == 0 {
                    continue;
                }
                let width = compact::WIDTHS[slot];
                let jobs = compact::scatter_jobs(entries, addr_of);
                let jobs_dev = staging.jobs[slot].upload(gpu, compact::as_bytes(&jobs), stream)?;
                let grid = total.div_ceil(compact::BLOCK as usize).clamp(1, grid_cap) as u32;
                let args = [
                    Arg::U64(jobs_dev),
                    Arg::U32(jobs.len() as u32),
                    Arg::U64(total as u64),
                    Arg::U64(staging.idx[slot].addr()),
                    Arg::U64(staging.vals[slot].addr()),
                ];
                // SAFETY: the arguments follow scatter's signature; every job's destination is a live CUDA tensor
                // of the receiver (kept alive by the caller during the install) and, the patch having been
                // validated against its layout, every index lies inside it; the index and value lists were
                // queued to the device on this stream before.
                unsafe { gpu.launch(Kernel::Scatter, width, grid, compact::BLOCK, &args, stream) }?;
            }
            if !dense.is_empty() {
                let base = staging.dense.upload(gpu, dense_stream, stream)?;
                for d in dense {
                    let dst = addr_of(d.ordinal) + (d.base * d.width) as u64;
                    // SAFETY: device to device, from the staged dense stream into the validated element range.
                    unsafe {
                        gpu.copy_async(dst, base + d.bytes.start as u64, d.bytes.len(), stream)
                    }?;
                }
            }
            Ok(())
        })
    }
}

impl PatchInstaller for GpuInstaller {
    fn install(
        &self,
        patch: &ValidPatch,
        state: &mut StateDict,
        threads: NonZeroUsize,
    ) -> Result<(), SyncError> {
        let (addrs, stream) = self.targets(patch.ordinals(), state)?;
        let gpu = &self.gpu;
        let mut staging = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        let staging = &mut *staging;
        if let Some(shape) = ScatterShape::of(patch) {
            // Decoded straight into the pinned staging.
            shape.decode_into(patch, staged_lists(gpu, staging, &shape)?, threads);
            self.scatter_staged(staging, &shape, patch.dense_stream(), &addrs, stream)?;
            return Ok(());
        }
        // Owned lists only for patches whose entries exceed u32 indices (never rlsync's own).
        let lists = scatter_plan(patch, threads);
        for (slot, l) in lists.widths.iter().enumerate() {
            staging.idx[slot].upload(gpu, compact::as_bytes(&l.idx), stream)?;
            staging.vals[slot].upload(gpu, compact::as_bytes(&l.vals), stream)?;
        }
        let entries = std::array::from_fn(|slot| lists.widths[slot].entries.as_slice());
        self.scatter(
            staging,
            entries,
            &lists.dense,
            patch.dense_stream(),
            &addrs,
            stream,
        )?;
        Ok(())
    }

    /// The streams checked in the walk that decodes them into the pinned staging (one walk, not two);
    /// nothing reaches the device before every entry passed.
    fn check_install(
        &self,
        patch: PlannedPatch,
        state: &mut StateDict,
        threads: NonZeroUsize,
    ) -> Result<ValidPatch, CheckInstallError> {
        let Some(shape) = ScatterShape::of_planned(&patch) else {
            return check_then_install(self, patch, state, threads);
        };
        let (addrs, stream) = self.targets(patch.ordinals(), state)?;
        let gpu = &self.gpu;
        let mut staging = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        let staging = &mut *staging;
        let lists = staged_lists(gpu, staging, &shape).map_err(SyncError::from)?;
        let valid = shape
            .decode_checked_into(patch, lists, threads)
            .map_err(|reason| CheckInstallError::Rejected { reason })?;
        self.scatter_staged(staging, &shape, valid.dense_stream(), &addrs, stream)
            .map_err(SyncError::from)?;
        Ok(valid)
    }
}
