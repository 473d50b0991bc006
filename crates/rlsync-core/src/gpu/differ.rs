//! The patch build on the GPU: `diff_compact` over a state dict's CUDA tensors against a snapshot on the
//! device (`weight_syncer.patch.snapshot_device: cuda`) or in the host snapshot mapped for the device
//! (`cpu`), its output copied to pinned staging and collected into the encoder's input — the bytes the host
//! build would give.
//!
//! The host snapshot stays the syncer's reference (rejoins, the replay log's checksums and dense segments
//! read it); the kernel compares against and updates a copy of it: in device memory (`cuda`: fastest, the
//! model's size again on the GPU) or in pinned host memory mapped for the device (`cpu`: the kernel reads it
//! over the bus, no upload of the snapshot per sync and no GPU memory for it). The host then applies the
//! collected changes to its own snapshot and copies back the segments whose changes did not fit the output
//! pool. (The host snapshot itself is not registered in place: glibc's heap pages are shared between
//! allocations, and pinning them from under it is not safe.) One launch per element width; each width has its own
//! output pool, sized for [`POOL_DENSITY`] of its elements (tiles beyond it go dense, still exact).
//!
//! A state whose floating tensors are in another dtype than the receivers' (fp32 weights, bf16 rollouts) is
//! cast first ([`CastPlan`]): one `cast_gather` launch writes those tensors, in the receivers' dtype and bit
//! for bit as the host path's `cast_bytes`, into one scratch allocation of rlsync's (their size in the
//! receivers' dtype, kept between syncs), which the diff then reads as the state.

use std::num::NonZeroUsize;
use std::sync::Arc;

use super::bucket::{self, CastJob};
use super::compact::{self, CollectReport, Layout, TileDir};
use super::{DeviceBuf, DeviceState, DiffLaunch, Gpu, GpuError, PinnedBuf, Stream};
use crate::syncer::SyncError;
use crate::syncer::offload::PatchBuilder;
use crate::syncer::patch::{Built, Changes, SEGMENT, SnapTensor};
use crate::syncer::settings::Device;
use crate::tensor::parallel::map_items;
use crate::tensor::{DType, StateDict};

/// Fraction of a width's elements its output pool holds (changed elements beyond it make dense segments).
pub const POOL_DENSITY: u64 = 16; // 1/16 = 6.25 %
/// Smallest pool, in entries.
const MIN_POOL: u64 = 1 << 16;

/// Builds patches from CUDA tensors (see the module docs).
pub struct GpuDiffer {
    gpu: Gpu,
    place: Device,
    current: Arc<std::sync::Mutex<DeviceState>>,
    ready: Option<Ready>,
    /// Timings of the last build (kernel + copies, collect, host snapshot update), seconds.
    pub last: BuildTimes,
}

/// Where the time of one device build went.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct BuildTimes {
    /// Launches to the output's arrival in pinned memory.
    pub device: f64,
    /// Collecting the output into segments.
    pub collect: f64,
    /// Bringing the host snapshot up to date (`snapshot_device: cuda`).
    pub host_snapshot: f64,
    pub changes: u64,
    /// Segments sent dense because their changes did not fit the pool.
    pub overflowed: usize,
}

/// Buffers sized at the first build (the snapshot's layout never changes after init).
struct Ready {
    layout: Layout,
    /// Device address of each snapshot tensor's copy.
    snap_addrs: Vec<u64>,
    copies: Vec<SnapCopy>,
    widths: Vec<WidthBufs>,
    /// The casts of a state in other dtypes than the snapshot's (none when every dtype matches).
    cast: Option<CastBufs>,
}

/// A casting build's scratch state and its `cast_gather` job table (also the GPU channel's casts).
pub(crate) struct CastBufs {
    plan: CastPlan,
    scratch: DeviceBuf,
    jobs: DeviceBuf,
    jobs_host: PinnedBuf,
}

impl CastBufs {
    /// The scratch buffer and job table of `plan` on `gpu` ([`SyncError::CastScratch`] when the scratch does
    /// not fit).
    pub(crate) fn new(gpu: &Gpu, plan: CastPlan) -> Result<CastBufs, SyncError> {
        let njobs = plan.casts.iter().flatten().count();
        let job_bytes = njobs * size_of::<CastJob>();
        let bytes = plan.scratch_bytes;
        Ok(CastBufs {
            scratch: gpu
                .alloc(bytes.max(1) as usize)
                .map_err(|source| SyncError::CastScratch { bytes, source })?,
            jobs: gpu.alloc(job_bytes)?,
            jobs_host: gpu.pinned(job_bytes)?,
            plan,
        })
    }

    /// The addresses a diff reads as the state whose tensors are at `state_addrs`: the cast copy of each cast
    /// tensor, else the tensor.
    pub(crate) fn diff_state(&self, state_addrs: &[u64]) -> Vec<u64> {
        self.plan.diff_state(state_addrs, self.scratch.addr())
    }

    /// Queue on `stream` the casts of the tensors at `state_addrs` into the scratch (one `cast_gather`
    /// launch); work queued after it on the same stream reads the cast copies.
    ///
    /// # Safety
    /// `state_addrs` must be the plan's tensors, live device tensors of `gpu` in their state dtype, unchanged
    /// until the stream has run the launch; the pinned table is not touched again before the caller
    /// synchronises the stream.
    pub(crate) unsafe fn queue(
        &mut self,
        gpu: &Gpu,
        state_addrs: &[u64],
        stream: Stream,
    ) -> Result<(), GpuError> {
        let (jobs, total) = self.plan.jobs(state_addrs, self.scratch.addr());
        if jobs.is_empty() {
            return Ok(());
        }
        let bytes: &[u8] = bytemuck::cast_slice(&jobs);
        self.jobs_host[..bytes.len()].copy_from_slice(bytes);
        // SAFETY: the table names the caller's live tensors (read) and this scratch buffer (written), sized by
        // the plan; forwarded to the caller's contract for the rest.
        unsafe {
            gpu.write_async(
                self.jobs.addr(),
                self.jobs_host.as_ptr(),
                bytes.len(),
                stream,
            )?;
            bucket::queue_cast_gather(gpu, self.jobs.addr(), jobs.len(), total, stream)
        }
    }
}

/// Which synced tensors a build casts before its diff, and where their cast copies lie in the scratch
/// buffer: every tensor whose state dtype differs from its snapshot's (the receivers' dtype).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CastPlan {
    /// Per snapshot tensor: its cast, or `None` when the diff reads the state tensor itself.
    pub casts: Vec<Option<Cast>>,
    /// Bytes of the scratch buffer.
    pub scratch_bytes: u64,
}

/// One tensor's cast: `numel` elements from the state's `from` into a copy in `to` at `offset` of the scratch
/// buffer (256-byte aligned).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cast {
    pub offset: u64,
    pub from: DType,
    pub to: DType,
    pub numel: u64,
}

/// Alignment of each cast copy in the scratch buffer (the diff's 16-byte vector loads need 16).
const CAST_ALIGN: u64 = 256;

impl CastPlan {
    /// The plan for `state` against `snap`; an error names a tensor whose dtype pair has no cast on the
    /// device (the host path casts floating tensors only, and init refuses the rest).
    pub fn new(snap: &[SnapTensor], state: &StateDict) -> Result<CastPlan, String> {
        let tensors = snap
            .iter()
            .map(|st| {
                let t = state
                    .get(&st.key)
                    .ok_or_else(|| format!("key '{}' is missing from the state dict", st.key))?;
                let numel = (st.storage.len() / st.dtype.size_bytes()) as u64;
                Ok((st.key.as_str(), t.dtype(), st.dtype, numel))
            })
            .collect::<Result<Vec<_>, String>>()?;
        CastPlan::of(tensors)
    }

    /// The plan for `keys` of `state` to be held in `dtypes` (in the order of `keys`: the GPU channel's
    /// casts); a missing key is an error naming it.
    pub fn to_dtypes(
        state: &StateDict,
        keys: &[String],
        dtypes: &[DType],
    ) -> Result<CastPlan, String> {
        let tensors = keys
            .iter()
            .zip(dtypes)
            .map(|(k, &to)| {
                let t = state
                    .get(k)
                    .ok_or_else(|| format!("key '{k}' is missing from the state dict"))?;
                Ok((k.as_str(), t.dtype(), to, t.numel() as u64))
            })
            .collect::<Result<Vec<_>, String>>()?;
        CastPlan::of(tensors)
    }

    /// The plan for tensors given as (key, state dtype, receivers' dtype, elements), in order.
    pub fn of<'a>(
        tensors: impl IntoIterator<Item = (&'a str, DType, DType, u64)>,
    ) -> Result<CastPlan, String> {
        let mut casts = Vec::new();
        let mut at = 0u64;
        for (key, from, to, numel) in tensors {
            if from == to {
                casts.push(None);
                continue;
            }
            if !(from.is_floating() && to.is_floating()) {
                return Err(format!(
                    "key '{key}' is {} in the state and {} for the receivers: only floating tensors are cast",
                    from.name(),
                    to.name()
                ));
            }
            casts.push(Some(Cast {
                offset: at,
                from,
                to,
                numel,
            }));
            at = (at + numel * to.size_bytes() as u64).next_multiple_of(CAST_ALIGN);
        }
        Ok(CastPlan {
            casts,
            scratch_bytes: at,
        })
    }

    /// Whether no tensor is cast.
    pub fn is_empty(&self) -> bool {
        self.casts.iter().all(Option::is_none)
    }

    /// The `cast_gather` table: tensor `k` from `state_addrs[k]` into its copy at `scratch`; and the
    /// launch's element count.
    pub fn jobs(&self, state_addrs: &[u64], scratch: u64) -> (Vec<CastJob>, u64) {
        let mut jobs = Vec::new();
        let mut first = 0u64;
        for (cast, &src) in self.casts.iter().zip(state_addrs) {
            let Some(c) = *cast else {
                continue;
            };
            if c.numel == 0 {
                continue;
            }
            jobs.push(CastJob {
                src,
                dst: scratch + c.offset,
                first,
                numel: c.numel,
                codes: bucket::code(c.from) | bucket::code(c.to) << 8,
                pad: 0,
            });
            first += c.numel;
        }
        (jobs, first)
    }

    /// The addresses the diff reads as the state: the cast copy of each cast tensor, else the tensor.
    pub fn diff_state(&self, state_addrs: &[u64], scratch: u64) -> Vec<u64> {
        state_addrs
            .iter()
            .zip(&self.casts)
            .map(|(&a, cast)| cast.map_or(a, |c| scratch + c.offset))
            .collect()
    }
}

/// The kernel's copy of one snapshot tensor.
enum SnapCopy {
    Device(DeviceBuf),
    Host(PinnedBuf),
}

/// One width's launch: its job table, output pool, cursor and directory, on the device and staged.
struct WidthBufs {
    width: usize,
    ntiles: u64,
    capacity: u64,
    jobs: DeviceBuf,
    jobs_host: PinnedBuf,
    cursor: DeviceBuf,
    cursor_host: PinnedBuf,
    dir: DeviceBuf,
    dir_host: PinnedBuf,
    idx: DeviceBuf,
    vals: DeviceBuf,
    /// Pinned staging of the listed changes, grown to what builds list (pinning is slow: never the pool's
    /// whole capacity up front).
    idx_host: Option<PinnedBuf>,
    vals_host: Option<PinnedBuf>,
}

/// The first `len` bytes of a staging buffer (none before the first build lists a change).
fn staged(buf: &Option<PinnedBuf>, len: usize) -> &[u8] {
    buf.as_ref().map_or(&[][..], |b| &b[..len.min(b.len())])
}

/// `buf` holds at least `len` bytes (reallocated with a quarter of headroom when it does not).
fn ensure(gpu: &Gpu, buf: &mut Option<PinnedBuf>, len: usize) -> Result<(), GpuError> {
    if buf.as_ref().is_none_or(|b| b.len() < len) {
        *buf = None; // free the smaller one first
        *buf = Some(gpu.pinned(len + len / 4)?);
    }
    Ok(())
}

/// 64-bit values per change of a width (old and new as two words for 8-byte elements).
fn words(width: usize) -> usize {
    if width == 8 { 2 } else { 1 }
}

impl GpuDiffer {
    /// A builder on `gpu` with its snapshot at `place`; `current` holds the device addresses of the state
    /// dict's CUDA tensors and the stream for each sync (refreshed by the caller before every call).
    pub fn new(gpu: Gpu, place: Device, current: Arc<std::sync::Mutex<DeviceState>>) -> GpuDiffer {
        GpuDiffer {
            gpu,
            place,
            current,
            ready: None,
            last: BuildTimes::default(),
        }
    }

    fn prepare(
        &mut self,
        snap: &mut [SnapTensor],
        state: &StateDict,
        stream: Stream,
    ) -> Result<Ready, SyncError> {
        let layout = Layout::from_snapshot(snap).map_err(|e| mismatch(e.to_string()))?;
        let plan = CastPlan::new(snap, state).map_err(mismatch)?;
        let gpu = &self.gpu;
        let cast = if plan.is_empty() {
            None
        } else {
            Some(CastBufs::new(gpu, plan)?)
        };
        let mut copies = Vec::with_capacity(snap.len());
        let mut snap_addrs = Vec::with_capacity(snap.len());
        for st in snap.iter() {
            let bytes = st.storage.bytes();
            match self.place {
                Device::Cuda => {
                    let buf = gpu.alloc(bytes.len())?;
                    // SAFETY: a fresh buffer of exactly this size, written by nothing else.
                    unsafe { gpu.write(buf.addr(), bytes, stream) }?;
                    snap_addrs.push(buf.addr());
                    copies.push(SnapCopy::Device(buf));
                }
                Device::Cpu => {
                    let mut buf = gpu.pinned(bytes.len())?;
                    buf.copy_from_slice(bytes);
                    snap_addrs.push(buf.device_addr()?);
                    copies.push(SnapCopy::Host(buf));
                }
            }
        }
        let mut widths = Vec::new();
        for width in layout.widths().collect::<Vec<_>>() {
            let ntiles = layout.ntiles(width);
            let numel: u64 = layout.tensors_of(width).map(|t| t.numel).sum();
            let capacity = (numel / POOL_DENSITY).max(MIN_POOL).min(numel.max(1));
            let jobs_bytes = layout.tensors_of(width).count() * size_of::<compact::DiffJob>();
            let dir_bytes = ntiles as usize * size_of::<TileDir>();
            let idx_bytes = capacity as usize * 4;
            let vals_bytes = capacity as usize * 8 * words(width);
            widths.push(WidthBufs {
                width,
                ntiles,
                capacity,
                jobs: gpu.alloc(jobs_bytes)?,
                jobs_host: gpu.pinned(jobs_bytes)?,
                cursor: gpu.alloc(8)?,
                cursor_host: gpu.pinned(8)?,
                dir: gpu.alloc(dir_bytes)?,
                dir_host: gpu.pinned(dir_bytes)?,
                idx: gpu.alloc(idx_bytes)?,
                vals: gpu.alloc(vals_bytes)?,
                idx_host: None,
                vals_host: None,
            });
        }
        Ok(Ready {
            layout,
            snap_addrs,
            copies,
            widths,
            cast,
        })
    }
}

fn mismatch(reason: String) -> SyncError {
    SyncError::StateMismatch {
        key: "(synced keys)".into(),
        reason,
    }
}

impl PatchBuilder for GpuDiffer {
    fn build(
        &mut self,
        snap: &mut [SnapTensor],
        state: &StateDict,
        threads: NonZeroUsize,
        built: &mut Built,
    ) -> Result<(), SyncError> {
        let (state_addrs, stream) = {
            let cur = self.current.lock().unwrap_or_else(|p| p.into_inner());
            let addrs = snap
                .iter()
                .map(|st| {
                    cur.addrs.get(&st.key).copied().ok_or_else(|| {
                        mismatch(format!(
                            "key '{}' is not a CUDA tensor of this state dict",
                            st.key
                        ))
                    })
                })
                .collect::<Result<Vec<u64>, _>>()?;
            (addrs, cur.stream)
        };
        if self.ready.is_none() {
            self.ready = Some(self.prepare(snap, state, stream)?);
        }
        let Some(ready) = self.ready.as_mut() else {
            return Err(mismatch("the device buffers were not prepared".into()));
        };
        let gpu = &self.gpu;
        let t0 = std::time::Instant::now();
        let diff_addrs = match &mut ready.cast {
            Some(c) => {
                // SAFETY: `state_addrs` are the state dict's live CUDA tensors as staged for this build (the
                // plan's, in the snapshot's order); the diff below on the same stream reads the cast copies, and
                // the stream is synchronised before this build returns.
                unsafe { c.queue(gpu, &state_addrs, stream)? };
                c.diff_state(&state_addrs)
            }
            None => state_addrs,
        };
        gpu.settled(stream, || {
            for wb in &mut ready.widths {
                let jobs = ready
                    .layout
                    .diff_jobs(wb.width, |pos| (diff_addrs[pos], ready.snap_addrs[pos]));
                let bytes = compact::as_bytes(&jobs);
                wb.jobs_host[..bytes.len()].copy_from_slice(bytes);
                let launch = DiffLaunch {
                    width: wb.width,
                    jobs: wb.jobs.addr(),
                    njobs: jobs.len() as u32,
                    ntiles: wb.ntiles,
                    idx: wb.idx.addr(),
                    vals: wb.vals.addr(),
                    capacity: wb.capacity,
                    cursor: wb.cursor.addr(),
                    dir: wb.dir.addr(),
                };
                // SAFETY: rlsync's own buffers of the sizes prepared for this layout; the job table names live CUDA
                // tensors (the caller keeps them alive during the sync) and snapshot memory this builder owns; the
                // pinned sources and destinations are not touched again before `settled` synchronises the stream.
                unsafe {
                    gpu.write_async(wb.jobs.addr(), wb.jobs_host.as_ptr(), bytes.len(), stream)?;
                    gpu.queue_diff_compact(&launch, stream)?;
                    gpu.read_async(wb.cursor_host.as_mut_ptr(), wb.cursor.addr(), 8, stream)?;
                }
            }
            Ok::<(), GpuError>(())
        })?;
        let mut listed = Vec::with_capacity(ready.widths.len());
        gpu.settled(stream, || {
            for wb in &mut ready.widths {
                let cursor = compact::view::<u64>(&wb.cursor_host[..8])
                    .ok()
                    .and_then(|c| c.first().copied())
                    .unwrap_or(0);
                let n = cursor.min(wb.capacity) as usize;
                let (dir_len, idx_len, vals_len) = (
                    wb.ntiles as usize * size_of::<TileDir>(),
                    n * 4,
                    n * 8 * words(wb.width),
                );
                ensure(gpu, &mut wb.idx_host, idx_len)?;
                ensure(gpu, &mut wb.vals_host, vals_len)?;
                let (Some(idx_host), Some(vals_host)) =
                    (wb.idx_host.as_mut(), wb.vals_host.as_mut())
                else {
                    return Err(mismatch("the staging buffers were not allocated".into()));
                };
                // SAFETY: device buffers of at least these sizes (n ≤ capacity) copied into pinned buffers at
                // least as large, untouched until `settled`'s sync.
                unsafe {
                    gpu.read_async(wb.dir_host.as_mut_ptr(), wb.dir.addr(), dir_len, stream)?;
                    gpu.read_async(idx_host.as_mut_ptr(), wb.idx.addr(), idx_len, stream)?;
                    gpu.read_async(vals_host.as_mut_ptr(), wb.vals.addr(), vals_len, stream)?;
                }
                listed.push((dir_len, idx_len, vals_len));
            }
            Ok(())
        })?;
        let t1 = std::time::Instant::now();
        ready.layout.prepare(built);
        let mut report = CollectReport::default();
        for (wb, &(dir_len, idx_len, vals_len)) in ready.widths.iter().zip(&listed) {
            let dir = compact::view::<TileDir>(&wb.dir_host[..dir_len])
                .map_err(|e| mismatch(e.to_string()))?;
            let idx = compact::view::<u32>(staged(&wb.idx_host, idx_len))
                .map_err(|e| mismatch(e.to_string()))?;
            let vals = compact::view::<u64>(staged(&wb.vals_host, vals_len))
                .map_err(|e| mismatch(e.to_string()))?;
            let r = compact::collect(&ready.layout, wb.width, dir, idx, vals, built, threads)
                .map_err(|e| mismatch(e.to_string()))?;
            report.changes += r.changes;
            report.listed += r.listed;
            report.forced.extend(r.forced);
        }
        let t2 = std::time::Instant::now();
        update_host_snapshot(
            gpu,
            snap,
            &ready.copies,
            built,
            &report.forced,
            threads,
            stream,
        )?;
        self.last = BuildTimes {
            device: (t1 - t0).as_secs_f64(),
            collect: (t2 - t1).as_secs_f64(),
            host_snapshot: t2.elapsed().as_secs_f64(),
            changes: report.changes,
            overflowed: report.forced.len(),
        };
        Ok(())
    }
}

/// Write the build's new values into the host snapshot, and copy the segments that were forced dense (their
/// changes were not listed) back from the kernel's copy.
fn update_host_snapshot(
    gpu: &Gpu,
    snap: &mut [SnapTensor],
    copies: &[SnapCopy],
    built: &Built,
    forced: &[usize],
    threads: NonZeroUsize,
    stream: Stream,
) -> Result<(), SyncError> {
    let segments = built.segments();
    // (width, the copy and the segment's byte offset in it, the host snapshot's bytes of the segment)
    let mut chunks: Vec<(usize, (&SnapCopy, usize), &mut [u8])> =
        Vec::with_capacity(segments.len());
    for (st, copy) in snap.iter_mut().zip(copies) {
        let w = st.dtype.size_bytes();
        for (k, c) in st.storage.bytes_mut().chunks_mut(SEGMENT * w).enumerate() {
            chunks.push((w, (copy, k * SEGMENT * w), c));
        }
    }
    if chunks.len() != segments.len() {
        return Err(mismatch(format!(
            "the build has {} segments, the snapshot {}",
            segments.len(),
            chunks.len()
        )));
    }
    let mut items: Vec<_> = segments.iter().zip(chunks).enumerate().collect();
    for &s in forced {
        let Some((_, (_, (_, (copy, at), bytes)))) = items.get_mut(s) else {
            continue;
        };
        match copy {
            // SAFETY: the device copy's segment, of this chunk's size, into host memory this builder owns.
            SnapCopy::Device(d) => unsafe { gpu.read(bytes, d.addr() + *at as u64, stream) }?,
            SnapCopy::Host(h) => bytes.copy_from_slice(&h[*at..*at + bytes.len()]),
        }
    }
    items.retain(|(s, (c, _))| !c.idx.is_empty() && !forced.contains(s));
    map_items(items, threads, |(_, (c, (w, _, bytes)))| match w {
        1 => put_new::<u8>(c, bytes),
        2 => put_new::<u16>(c, bytes),
        4 => put_new::<u32>(c, bytes),
        _ => put_new::<u64>(c, bytes),
    });
    Ok(())
}

/// Write segment `c`'s new values into its bytes of the host snapshot (element-aligned: storages are
/// cache-line aligned and segments start at multiples of their width).
fn put_new<W: bytemuck::Pod + TryFrom<u64>>(c: &Changes, bytes: &mut [u8]) {
    let Ok(dst) = bytemuck::try_cast_slice_mut::<u8, W>(bytes) else {
        return;
    };
    let w = size_of::<W>();
    for (i, &at) in c.idx.iter().enumerate() {
        let (_, new) = c.old_new(i, w);
        if let (Some(x), Ok(v)) = (dst.get_mut(at as usize), W::try_from(new)) {
            *x = v;
        }
    }
}

#[cfg(test)]
mod tests;
