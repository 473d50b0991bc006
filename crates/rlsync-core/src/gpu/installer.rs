//! The patch install into CUDA tensors: a verified patch is decoded on the host (`scatter_plan`, as the host
//! install would apply it), its changes staged in pinned memory, copied to the device and written by the
//! `scatter` kernels on the caller's stream; dense entries are copied straight into the tensors.
//!
//! Verification stays on the host and before any write (a rejected payload never reaches this module), and
//! the tensors are written in place, so parameters keep their identity (optimizers and captured CUDA graphs
//! stay valid). Kernels run on the caller's stream and the install waits for them before it returns.

use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};

use super::compact::{self, SCATTER_ADD, SCATTER_SET, ScatterJob};
use super::{Arg, DeviceBuf, DeviceState, Gpu, GpuError, Kernel, PinnedBuf, Stream};
use crate::syncer::SyncError;
use crate::syncer::offload::PatchInstaller;
use crate::syncer::patch::{ScatterMode, ValidPatch, scatter_plan};
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
    /// Stage `bytes` and queue their copy to the device; returns the device address.
    fn upload(&mut self, gpu: &Gpu, bytes: &[u8], stream: Stream) -> Result<u64, GpuError> {
        let fits = self
            .bufs
            .as_ref()
            .is_some_and(|(d, _)| d.len() >= bytes.len());
        if !fits {
            self.bufs = None; // free the smaller pair first
            let cap = bytes.len().next_power_of_two().max(4096);
            self.bufs = Some((gpu.alloc(cap)?, gpu.pinned(cap)?));
        }
        let Some((dev, host)) = self.bufs.as_mut() else {
            return Ok(0);
        };
        host[..bytes.len()].copy_from_slice(bytes);
        // SAFETY: rlsync's buffers, `bytes.len()` fits both; the pinned source is not touched until the
        // install synchronises the stream.
        unsafe { gpu.write_async(dev.addr(), host.as_ptr(), bytes.len(), stream) }?;
        Ok(dev.addr())
    }
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

impl PatchInstaller for GpuInstaller {
    fn install(
        &self,
        patch: &ValidPatch,
        state: &mut StateDict,
        threads: NonZeroUsize,
    ) -> Result<(), SyncError> {
        let plan = scatter_plan(patch, threads);
        let (addrs, stream) = {
            let cur = self.current.lock().unwrap_or_else(|p| p.into_inner());
            let addrs: Vec<Option<u64>> = state.keys().map(|k| cur.addrs.get(k).copied()).collect();
            (addrs, cur.stream)
        };
        let addr_of = |ordinal: usize| -> Result<u64, SyncError> {
            addrs.get(ordinal).copied().flatten().ok_or_else(|| {
                let key = state.keys().nth(ordinal).unwrap_or("?").to_owned();
                SyncError::StateMismatch {
                    key,
                    reason: "the patch targets it but it is not a CUDA tensor of this state dict"
                        .into(),
                }
            })
        };
        let gpu = &self.gpu;
        let mut staging = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        let staging = &mut *staging;
        let grid_cap = gpu.sm_count() * BLOCKS_PER_SM;
        for (slot, lists) in plan.widths.iter().enumerate() {
            if lists.idx.is_empty() {
                continue;
            }
            let width = compact::WIDTHS[slot];
            let jobs = lists
                .entries
                .iter()
                .map(|e| {
                    Ok(ScatterJob {
                        dst: addr_of(e.ordinal)? + (e.base * e.width) as u64,
                        first: e.first as u64,
                        count: e.count as u32,
                        mode: match e.mode {
                            ScatterMode::Set => SCATTER_SET,
                            ScatterMode::Add => SCATTER_ADD,
                        },
                    })
                })
                .collect::<Result<Vec<_>, SyncError>>()?;
            let jobs_dev = staging.jobs[slot].upload(gpu, compact::as_bytes(&jobs), stream)?;
            let idx_dev = staging.idx[slot].upload(gpu, compact::as_bytes(&lists.idx), stream)?;
            let vals_dev =
                staging.vals[slot].upload(gpu, compact::as_bytes(&lists.vals), stream)?;
            let total = lists.idx.len();
            let grid = total.div_ceil(compact::BLOCK as usize).clamp(1, grid_cap) as u32;
            let args = [
                Arg::U64(jobs_dev),
                Arg::U32(jobs.len() as u32),
                Arg::U64(total as u64),
                Arg::U64(idx_dev),
                Arg::U64(vals_dev),
            ];
            // SAFETY: the arguments follow scatter's signature; every job's destination is a live CUDA tensor
            // of the receiver (kept alive by the caller during the install) and, the patch having been
            // validated against its layout, every index lies inside it.
            unsafe { gpu.launch(Kernel::Scatter, width, grid, compact::BLOCK, &args, stream) }?;
        }
        if !plan.dense.is_empty() {
            let stream_bytes = patch.dense_stream();
            let base = staging.dense.upload(gpu, stream_bytes, stream)?;
            for d in &plan.dense {
                let dst = addr_of(d.ordinal)? + (d.base * d.width) as u64;
                // SAFETY: device to device, from the staged dense stream into the validated element range.
                unsafe { gpu.copy_async(dst, base + d.bytes.start as u64, d.bytes.len(), stream) }?;
            }
        }
        gpu.sync(stream)?;
        Ok(())
    }
}
