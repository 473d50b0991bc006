//! The GPU channel's device sides on CUDA: [`CudaSender`] (diff_compact and checksum_compact into rlsync's
//! exported allocations) and [`CudaReceiver`] (the sender's allocations opened by IPC, checksum_compact and
//! apply_compact into the receiver's tensors).

use super::compact::{self, Layout};
use super::wire::{Export, Setup, WidthExport};
use super::{ReceiverDevice, SenderDevice, WidthBuilt, width_export, width_plan};
use crate::gpu::checksum::{DeviceChecksum, Plan};
use crate::gpu::payload::wire::MAX_HEADER;
use crate::gpu::payload::{Part, PayloadIn, PayloadOut, Src};
use crate::gpu::reference::PoolSum;
use crate::gpu::{Arg, DeviceBuf, DiffLaunch, Gpu, GpuError, Kernel, PinnedBuf, Stream};
use crate::gpu::{IPC_HANDLE_BYTES, IpcHandle};
use crate::syncer::settings::Device;
use crate::tensor::DType;
use crate::tensor::checksum::{Piece, StateHasher};
use crate::tensor::parallel::resolve_threads;

/// One wave of resident blocks of `kernel` for `width` (the driver's occupancy), at most one per tile: the
/// grid of a grid-striding launch over `ntiles` tiles. Asked once per end and width, not per sync.
fn wave(gpu: &Gpu, kernel: Kernel, width: usize, ntiles: u64) -> u32 {
    let resident = gpu.sm_count() * gpu.blocks_per_sm(kernel, width, compact::BLOCK);
    (ntiles as usize).min(resident).clamp(1, u32::MAX as usize) as u32
}

/// Where one `checksum_compact` launch reads (device addresses) and what it hashes.
struct SumLaunch {
    width: usize,
    grid: u32,
    /// `ApplyJob`s (`dst` unused, `dense_src` the snapshot copy) and how many.
    jobs: u64,
    njobs: u32,
    ntiles: u64,
    dir: u64,
    idx: u64,
    vals: u64,
    capacity: u64,
    seed: u64,
    full: bool,
    /// Two u64 words (sum, count), zeroed here before the launch.
    out: u64,
}

/// Queue `l` on `stream`: zero its output words, launch.
///
/// # Safety
/// Every address in `l` must be valid for the launch (the job table's snapshot addresses, the directory,
/// index and value pool sized for `ntiles` tiles and `capacity` entries, 16 writable bytes at `out`) until it
/// has run.
unsafe fn queue_checksum(gpu: &Gpu, l: &SumLaunch, stream: Stream) -> Result<(), GpuError> {
    let args = [
        Arg::U64(l.jobs),
        Arg::U32(l.njobs),
        Arg::U64(l.ntiles),
        Arg::U64(l.dir),
        Arg::U64(l.idx),
        Arg::U64(l.vals),
        Arg::U64(l.capacity),
        Arg::U64(l.seed),
        Arg::U32(u32::from(l.full)),
        Arg::U64(l.out),
    ];
    // SAFETY: forwarded to the caller; the arguments follow checksum_compact's signature.
    unsafe {
        gpu.zero_async(l.out, 16, stream)?;
        gpu.launch(
            Kernel::ChecksumCompact,
            l.width,
            l.grid,
            compact::BLOCK,
            &args,
            stream,
        )
    }
}

/// The (sum, count) a `checksum_compact` launch left in 16 pinned bytes.
fn read_sum(host: &PinnedBuf) -> PoolSum {
    PoolSum {
        sum: bytemuck::pod_read_unaligned::<u64>(&host[..8]),
        count: bytemuck::pod_read_unaligned::<u64>(&host[8..16]),
    }
}

/// One width's launch state on the sender's device.
struct SenderWidth {
    width: usize,
    ntiles: u64,
    capacity: u64,
    /// dir | idx | vals (exported).
    out: DeviceBuf,
    offs: (u64, u64, u64),
    jobs: DeviceBuf,
    jobs_host: PinnedBuf,
    cursor: DeviceBuf,
    cursor_host: PinnedBuf,
    /// checksum_compact's job table (the snapshot copy as `dense_src`), output words and grid.
    sum_jobs: DeviceBuf,
    sum_jobs_host: PinnedBuf,
    sum: DeviceBuf,
    sum_host: PinnedBuf,
    sum_grid: u32,
}

/// Where a sender's snapshot copy lives.
enum SnapshotBuf {
    /// Device memory (exported to the GPU channel's receivers).
    Device(DeviceBuf),
    /// Pinned host memory mapped for the device, which the kernels read and write over the bus (device
    /// payloads with `snapshot_device: cpu`; not exported).
    Host { buf: PinnedBuf, addr: u64 },
}

impl SnapshotBuf {
    /// Its address for the kernels.
    fn addr(&self) -> u64 {
        match self {
            SnapshotBuf::Device(b) => b.addr(),
            SnapshotBuf::Host { addr, .. } => *addr,
        }
    }
}

/// [`SenderDevice`] on CUDA: the state is the caller's CUDA tensors ([`CudaSender::set_state`] before each
/// sync), the snapshot copy and the outputs are rlsync's allocations.
pub struct CudaSender {
    gpu: Gpu,
    state: Vec<u64>,
    stream: Stream,
    /// Where `prepare` puts the snapshot copy.
    place: Device,
    snapshot: Option<SnapshotBuf>,
    widths: Vec<SenderWidth>,
    /// The state checksum on the GPU (created by the first one).
    checksum: Option<DeviceChecksum>,
    /// A device payload's header on its way to the device (created by the first payload).
    header: Option<PinnedBuf>,
}

impl CudaSender {
    /// A sender whose snapshot copy is device memory (what the GPU channel exports).
    pub fn new(gpu: Gpu) -> CudaSender {
        CudaSender::with_snapshot(gpu, Device::Cuda)
    }

    /// A sender whose snapshot copy is in `place`: device memory, or (`Cpu`, device payloads only: it cannot
    /// be exported) pinned host memory the kernels read over the bus, which costs no GPU memory.
    pub fn with_snapshot(gpu: Gpu, place: Device) -> CudaSender {
        CudaSender {
            gpu,
            state: Vec::new(),
            stream: Stream::default(),
            place,
            snapshot: None,
            widths: Vec::new(),
            checksum: None,
            header: None,
        }
    }

    /// The state tensors' device addresses (layout order) and the stream of the next operation. The caller
    /// keeps the tensors alive and unchanged until that operation returns.
    pub fn set_state(&mut self, addrs: Vec<u64>, stream: Stream) {
        self.state = addrs;
        self.stream = stream;
    }

    fn state_of(&self, layout: &Layout) -> Result<&[u64], GpuError> {
        if self.state.len() != layout.tensors().len() {
            return Err(GpuError::Driver {
                op: "ipc state",
                code: 1,
                name: format!(
                    "{} tensor addresses for a layout of {}",
                    self.state.len(),
                    layout.tensors().len()
                ),
            });
        }
        Ok(&self.state)
    }
}

impl SenderDevice for CudaSender {
    fn prepare(
        &mut self,
        layout: &Layout,
        _offsets: &[u64],
        snapshot_bytes: u64,
    ) -> Result<(Export, Vec<WidthExport>), GpuError> {
        let gpu = &self.gpu;
        let (snap, snapshot) = match self.place {
            Device::Cuda => {
                let buf = gpu.alloc(snapshot_bytes as usize)?;
                let handle = gpu.ipc_handle(&buf)?;
                (SnapshotBuf::Device(buf), handle)
            }
            Device::Cpu => {
                let buf = gpu.pinned(snapshot_bytes as usize)?;
                let addr = buf.device_addr()?;
                (
                    SnapshotBuf::Host { buf, addr },
                    IpcHandle([0; IPC_HANDLE_BYTES]),
                )
            }
        };
        let snapshot = Export {
            handle: snapshot,
            bytes: snapshot_bytes,
        };
        let mut exports = Vec::new();
        let mut widths = Vec::new();
        for width in layout.widths().collect::<Vec<_>>() {
            let out = gpu.alloc(width_plan(layout, width).0 as usize)?;
            let jobs_bytes = layout.tensors_of(width).count() * size_of::<compact::DiffJob>();
            let export = width_export(layout, width, gpu.ipc_handle(&out)?);
            widths.push(SenderWidth {
                width,
                ntiles: export.ntiles,
                capacity: export.capacity,
                out,
                offs: (export.dir_off, export.idx_off, export.vals_off),
                jobs: gpu.alloc(jobs_bytes)?,
                jobs_host: gpu.pinned(jobs_bytes)?,
                cursor: gpu.alloc(8)?,
                cursor_host: gpu.pinned(8)?,
                sum_jobs: gpu.alloc(jobs_bytes)?,
                sum_jobs_host: gpu.pinned(jobs_bytes)?,
                sum: gpu.alloc(16)?,
                sum_host: gpu.pinned(16)?,
                sum_grid: wave(gpu, Kernel::ChecksumCompact, width, layout.ntiles(width)),
            });
            exports.push(export);
        }
        self.snapshot = Some(snap);
        self.widths = widths;
        Ok((snapshot, exports))
    }

    fn bootstrap(&mut self, layout: &Layout, offsets: &[u64]) -> Result<(), GpuError> {
        let state = self.state_of(layout)?.to_vec();
        let (gpu, stream) = (&self.gpu, self.stream);
        let Some(snap) = self.snapshot.as_mut() else {
            return Ok(());
        };
        gpu.settled(stream, || {
            for (t, (&src, &off)) in layout.tensors().iter().zip(state.iter().zip(offsets)) {
                let bytes = t.numel as usize * t.width;
                // SAFETY: the caller's live tensor of `bytes` bytes into this sender's snapshot allocation,
                // sized for every tensor at its offset (device memory, or pinned host memory copied into from
                // the device); nothing else writes it (one version in flight) before `settled`'s stream sync.
                unsafe {
                    match snap {
                        SnapshotBuf::Device(b) => {
                            gpu.copy_async(b.addr() + off, src, bytes, stream)?
                        }
                        SnapshotBuf::Host { buf, .. } => {
                            let dst = buf[off as usize..].as_mut_ptr();
                            gpu.read_async(dst, src, bytes, stream)?
                        }
                    }
                };
            }
            Ok(())
        })
    }

    fn build(
        &mut self,
        layout: &Layout,
        offsets: &[u64],
        seed: u64,
    ) -> Result<Vec<WidthBuilt>, GpuError> {
        let state = self.state_of(layout)?.to_vec();
        let Some(snap) = self.snapshot.as_ref() else {
            return Ok(Vec::new());
        };
        let (gpu, stream) = (&self.gpu, self.stream);
        let widths = &mut self.widths;
        gpu.settled(stream, || {
            for wb in widths.iter_mut() {
                let jobs =
                    layout.diff_jobs(wb.width, |pos| (state[pos], snap.addr() + offsets[pos]));
                let bytes = compact::as_bytes(&jobs);
                wb.jobs_host[..bytes.len()].copy_from_slice(bytes);
                let (dir_off, idx_off, vals_off) = wb.offs;
                let base = wb.out.addr();
                let launch = DiffLaunch {
                    width: wb.width,
                    jobs: wb.jobs.addr(),
                    njobs: jobs.len() as u32,
                    ntiles: wb.ntiles,
                    idx: base + idx_off,
                    vals: base + vals_off,
                    capacity: wb.capacity,
                    cursor: wb.cursor.addr(),
                    dir: base + dir_off,
                };
                // SAFETY: rlsync's buffers sized for this layout (width_plan); the job table names the caller's
                // live tensors and this sender's snapshot copy; the pinned job table is not touched again before
                // `settled`'s stream sync; no receiver reads the outputs now (all acked the previous version).
                unsafe {
                    gpu.write_async(wb.jobs.addr(), wb.jobs_host.as_ptr(), bytes.len(), stream)?;
                    gpu.queue_diff_compact(&launch, stream)?;
                    gpu.read_async(wb.cursor_host.as_mut_ptr(), wb.cursor.addr(), 8, stream)?;
                }
                // The checksum of what was just built, on the same stream (after diff_compact), seeded with the
                // sync's sequence number.
                queue_sum(
                    gpu,
                    wb,
                    layout,
                    |pos| snap.addr() + offsets[pos],
                    seed,
                    false,
                    stream,
                )?;
            }
            Ok(())
        })?;
        Ok(self
            .widths
            .iter()
            .map(|wb| WidthBuilt {
                cursor: bytemuck::pod_read_unaligned::<u64>(&wb.cursor_host[..8]),
                sum: read_sum(&wb.sum_host),
            })
            .collect())
    }

    fn snapshot_sum(
        &mut self,
        layout: &Layout,
        offsets: &[u64],
        seed: u64,
    ) -> Result<Vec<PoolSum>, GpuError> {
        let Some(snap) = self.snapshot.as_ref() else {
            return Ok(Vec::new());
        };
        let (gpu, stream) = (&self.gpu, self.stream);
        let widths = &mut self.widths;
        gpu.settled(stream, || {
            for wb in widths.iter_mut() {
                queue_sum(
                    gpu,
                    wb,
                    layout,
                    |pos| snap.addr() + offsets[pos],
                    seed,
                    true,
                    stream,
                )?;
            }
            Ok(())
        })?;
        Ok(self
            .widths
            .iter()
            .map(|wb| read_sum(&wb.sum_host))
            .collect())
    }

    fn device(&self) -> u32 {
        self.gpu.ordinal() as u32
    }

    fn state_checksum(&mut self, names: &[(String, DType, Vec<usize>)]) -> Result<u64, GpuError> {
        if self.state.len() != names.len() {
            return Err(GpuError::Driver {
                op: "ipc state checksum",
                code: 1,
                name: format!(
                    "{} tensor addresses for {} names",
                    self.state.len(),
                    names.len()
                ),
            });
        }
        let plan = Plan::of_device(names, &self.state);
        let gpu = &self.gpu;
        let sum = self
            .checksum
            .get_or_insert_with(|| DeviceChecksum::new(gpu));
        // SAFETY: the state addresses are the tensors the last build read (the caller's live tensors, or this
        // sender's cast copies), each of its name's size; the caller keeps them unchanged during the call.
        unsafe { sum.run(&plan, self.stream) }
    }
}

impl PayloadOut for CudaSender {
    fn copy_out(&mut self, dst: u64, header: &[u8], parts: &[Part]) -> Result<(), GpuError> {
        let Some(snap) = self.snapshot.as_ref() else {
            return Err(GpuError::Driver {
                op: "payload copy",
                code: 1,
                name: "the sender's buffers are not prepared".into(),
            });
        };
        let (gpu, stream) = (&self.gpu, self.stream);
        let pinned = match &mut self.header {
            Some(h) if h.len() >= header.len() => h,
            slot => slot.insert(gpu.pinned(header.len().max(MAX_HEADER))?),
        };
        pinned[..header.len()].copy_from_slice(header);
        // SAFETY: `dst` is the caller's device allocation of the payload's length (checked by the payload
        // sender against the plan that made `parts`), unused by anything else until this returns; each part
        // lies inside this sender's snapshot copy or width output (the plan's offsets are `width_plan`'s); the
        // pinned header and a host snapshot copy stay untouched until `settled`'s stream sync.
        let widths = &self.widths;
        // SAFETY: as above.
        gpu.settled(stream, || unsafe {
            gpu.write_async(dst, pinned.as_ptr(), header.len(), stream)?;
            for p in parts {
                let to = dst + p.dst_off;
                let len = p.len as usize;
                match p.src {
                    Src::Snapshot => match snap {
                        SnapshotBuf::Device(b) => {
                            gpu.copy_async(to, b.addr() + p.src_off, len, stream)?
                        }
                        SnapshotBuf::Host { buf, .. } => {
                            gpu.write_async(to, buf[p.src_off as usize..].as_ptr(), len, stream)?
                        }
                    },
                    Src::Width(k) => {
                        let Some(w) = widths.get(k) else {
                            return Err(GpuError::Driver {
                                op: "payload copy",
                                code: 1,
                                name: format!("no width {k} in this sender's buffers"),
                            });
                        };
                        gpu.copy_async(to, w.out.addr() + p.src_off, len, stream)?;
                    }
                }
            }
            Ok(())
        })
    }

    fn snapshot_checksum(
        &mut self,
        names: &[(String, DType, Vec<usize>)],
        offsets: &[u64],
    ) -> Result<u64, GpuError> {
        let Some(snap) = self.snapshot.as_ref() else {
            return Err(GpuError::Driver {
                op: "payload checksum",
                code: 1,
                name: "the sender's buffers are not prepared".into(),
            });
        };
        if let SnapshotBuf::Host { buf, .. } = snap {
            // Host memory: hashed here, on the host's threads (the last build or bootstrap was waited for).
            let pieces: Vec<Piece<'_>> = names
                .iter()
                .zip(offsets)
                .map(|((key, dtype, shape), &off)| {
                    let len = shape.iter().product::<usize>() * dtype.size_bytes();
                    Piece::Tensor {
                        layout: Some((key.as_str(), *dtype, shape.as_slice())),
                        bytes: &buf[off as usize..off as usize + len],
                    }
                })
                .collect();
            let mut h = StateHasher::new();
            h.pieces(&pieces, resolve_threads(0));
            return Ok(h.finish());
        }
        let addrs: Vec<u64> = offsets.iter().map(|&o| snap.addr() + o).collect();
        let plan = Plan::of_device(names, &addrs);
        let gpu = &self.gpu;
        let sum = self
            .checksum
            .get_or_insert_with(|| DeviceChecksum::new(gpu));
        // SAFETY: the snapshot copy holds every tensor at its offset, in the receivers' dtype and size (the
        // names' sizes: the layout it was allocated for); nothing writes it during the call.
        unsafe { sum.run(&plan, self.stream) }
    }
}

/// Queue the sender's `checksum_compact` of one width (its output, or with `full` the snapshot copy at
/// `snap(pos)`) and the read back of its words; the launch.
fn queue_sum(
    gpu: &Gpu,
    wb: &mut SenderWidth,
    layout: &Layout,
    snap: impl Fn(usize) -> u64,
    seed: u64,
    full: bool,
    stream: Stream,
) -> Result<(), GpuError> {
    let jobs = layout.apply_jobs(wb.width, |pos| (0, snap(pos)));
    let bytes = compact::as_bytes(&jobs);
    wb.sum_jobs_host[..bytes.len()].copy_from_slice(bytes);
    let (dir_off, idx_off, vals_off) = wb.offs;
    let base = wb.out.addr();
    let l = SumLaunch {
        width: wb.width,
        grid: wb.sum_grid,
        jobs: wb.sum_jobs.addr(),
        njobs: jobs.len() as u32,
        ntiles: wb.ntiles,
        dir: base + dir_off,
        idx: base + idx_off,
        vals: base + vals_off,
        capacity: wb.capacity,
        seed,
        full,
        out: wb.sum.addr(),
    };
    // SAFETY: rlsync's buffers sized for this layout (width_plan; 16 bytes of output words); the job table
    // names this sender's snapshot copy; the pinned table and words are not touched again before the
    // caller's stream sync.
    unsafe {
        gpu.write_async(
            wb.sum_jobs.addr(),
            wb.sum_jobs_host.as_ptr(),
            bytes.len(),
            stream,
        )?;
        queue_checksum(gpu, &l, stream)?;
        gpu.read_async(wb.sum_host.as_mut_ptr(), wb.sum.addr(), 16, stream)?;
    }
    Ok(())
}

/// [`ReceiverDevice`] on CUDA: the receiver's CUDA tensors ([`CudaReceiver::set_tensors`] before each apply)
/// and the sender's allocations opened in its context.
pub struct CudaReceiver {
    gpu: Gpu,
    tensors: Vec<u64>,
    stream: Stream,
    /// Opened allocations: the snapshot first, then one per width (closed on drop unless `attached`).
    opened: Vec<u64>,
    /// `opened` holds a device payload's addresses ([`PayloadIn::attach`]): nothing to close.
    attached: bool,
    widths: Vec<ReceiverWidth>,
    /// A device payload's header on its way to the host.
    header: Option<PinnedBuf>,
}

/// One width's launch state on a receiver's device.
struct ReceiverWidth {
    /// The `ApplyJob` table (also checksum_compact's: it ignores `dst`).
    jobs: DeviceBuf,
    jobs_host: PinnedBuf,
    /// checksum_compact's output words.
    sum: DeviceBuf,
    sum_host: PinnedBuf,
    /// One wave of resident blocks of each kernel (asked once, at open).
    apply_grid: u32,
    sum_grid: u32,
}

impl CudaReceiver {
    pub fn new(gpu: Gpu) -> CudaReceiver {
        CudaReceiver {
            gpu,
            tensors: Vec::new(),
            stream: Stream::default(),
            opened: Vec::new(),
            attached: false,
            widths: Vec::new(),
            header: None,
        }
    }

    /// Each width's launch state for `setup` (job tables, checksum words, grids).
    fn launch_state(&mut self, setup: &Setup) -> Result<(), GpuError> {
        self.widths.clear();
        for w in &setup.widths {
            let n = setup.tensors.iter().filter(|t| t.width == w.width).count();
            let bytes = n * size_of::<compact::ApplyJob>();
            let width = usize::from(w.width);
            self.widths.push(ReceiverWidth {
                jobs: self.gpu.alloc(bytes)?,
                jobs_host: self.gpu.pinned(bytes)?,
                sum: self.gpu.alloc(16)?,
                sum_host: self.gpu.pinned(16)?,
                apply_grid: wave(&self.gpu, Kernel::ApplyCompact, width, w.ntiles),
                sum_grid: wave(&self.gpu, Kernel::ChecksumCompact, width, w.ntiles),
            });
        }
        Ok(())
    }

    /// The receiver's tensors' device addresses (layout order) and the stream of the next apply.
    pub fn set_tensors(&mut self, addrs: Vec<u64>, stream: Stream) {
        self.tensors = addrs;
        self.stream = stream;
    }

    fn tensors_for(&self, setup: &Setup) -> Result<&[u64], GpuError> {
        if self.tensors.len() != setup.tensors.len() || self.opened.len() != 1 + setup.widths.len()
        {
            return Err(GpuError::Driver {
                op: "ipc apply",
                code: 1,
                name: format!(
                    "{} tensor addresses and {} open buffers for a setup of {} tensors",
                    self.tensors.len(),
                    self.opened.len(),
                    setup.tensors.len()
                ),
            });
        }
        Ok(&self.tensors)
    }
}

impl ReceiverDevice for CudaReceiver {
    fn open(&mut self, setup: &Setup) -> Result<(), GpuError> {
        for h in std::iter::once(&setup.snapshot.handle)
            .chain(setup.widths.iter().map(|w| &w.buf.handle))
        {
            // SAFETY: closed once in Drop, after the last apply (each apply waits for its stream).
            let addr = unsafe { self.gpu.ipc_open(h) }?;
            self.opened.push(addr);
        }
        self.launch_state(setup)
    }

    fn drain(&mut self) -> Result<(), GpuError> {
        self.gpu.sync(self.stream)
    }

    fn checksum(
        &mut self,
        setup: &Setup,
        layout: &Layout,
        seed: u64,
        full: bool,
    ) -> Result<Vec<PoolSum>, GpuError> {
        let tensors = self.tensors_for(setup)?.to_vec();
        let snap = self.opened[0];
        let (gpu, stream) = (&self.gpu, self.stream);
        let (opened, rws) = (&self.opened, &mut self.widths);
        gpu.settled(stream, || {
            for (k, w) in setup.widths.iter().enumerate() {
                let width = usize::from(w.width);
                let jobs =
                    layout.apply_jobs(width, |pos| (tensors[pos], snap + setup.offsets[pos]));
                let bytes = compact::as_bytes(&jobs);
                let rw = &mut rws[k];
                rw.jobs_host[..bytes.len()].copy_from_slice(bytes);
                let base = opened[1 + k];
                let l = SumLaunch {
                    width,
                    grid: rw.sum_grid,
                    jobs: rw.jobs.addr(),
                    njobs: jobs.len() as u32,
                    ntiles: w.ntiles,
                    dir: base + w.dir_off,
                    idx: base + w.idx_off,
                    vals: base + w.vals_off,
                    capacity: w.capacity,
                    seed,
                    full,
                    out: rw.sum.addr(),
                };
                // SAFETY: the job table names the sender's snapshot copy (checked against the layout at setup);
                // the directory and pool (capacity entries) were checked to lie inside the opened allocation; the
                // sender rewrites none of them before this ack; the pinned table and words stay untouched until
                // `settled`'s stream sync.
                unsafe {
                    gpu.write_async(rw.jobs.addr(), rw.jobs_host.as_ptr(), bytes.len(), stream)?;
                    queue_checksum(gpu, &l, stream)?;
                    gpu.read_async(rw.sum_host.as_mut_ptr(), rw.sum.addr(), 16, stream)?;
                }
            }
            Ok(())
        })?;
        Ok(self
            .widths
            .iter()
            .map(|rw| read_sum(&rw.sum_host))
            .collect())
    }

    fn full(&mut self, setup: &Setup) -> Result<(), GpuError> {
        let tensors = self.tensors_for(setup)?;
        let snap = self.opened[0];
        self.gpu.settled(self.stream, || {
            for (dst, off, bytes) in setup.full_copies(tensors.iter().copied()) {
                let bytes = bytes as usize;
                // SAFETY: the sender's snapshot copy (opened, checked to hold the tensor at `off`) into the
                // receiver's live tensor of the same size; the sender does not write it before this ack.
                unsafe { self.gpu.copy_async(dst, snap + off, bytes, self.stream)? };
            }
            Ok(())
        })
    }

    fn apply(&mut self, setup: &Setup, layout: &Layout) -> Result<(), GpuError> {
        let tensors = self.tensors_for(setup)?.to_vec();
        let snap = self.opened[0];
        let (gpu, stream) = (&self.gpu, self.stream);
        let (opened, rws) = (&self.opened, &mut self.widths);
        gpu.settled(stream, || {
            for (k, w) in setup.widths.iter().enumerate() {
                let width = usize::from(w.width);
                let jobs =
                    layout.install_jobs(width, |pos| (tensors[pos], snap + setup.offsets[pos]));
                if jobs.is_empty() {
                    continue; // every tensor of this width is held elsewhere
                }
                let bytes = compact::as_bytes(&jobs);
                let rw = &mut rws[k];
                let (dev, host) = (&rw.jobs, &mut rw.jobs_host);
                host[..bytes.len()].copy_from_slice(bytes);
                let base = opened[1 + k];
                let args = [
                    Arg::U64(dev.addr()),
                    Arg::U32(jobs.len() as u32),
                    Arg::U64(w.ntiles),
                    Arg::U64(base + w.dir_off),
                    Arg::U64(base + w.idx_off),
                    Arg::U64(base + w.vals_off),
                ];
                // One wave of resident blocks (the driver's occupancy for this width's kernel), grid-striding.
                let grid = rw.apply_grid;
                // SAFETY: the job table names the receiver's live tensors and the sender's snapshot copy (checked
                // against the layout at setup); the directory and pool were checked to lie inside the opened
                // allocation; the sender rewrites none of them before this ack; the pinned table stays untouched
                // until `settled`'s stream sync.
                unsafe {
                    gpu.write_async(dev.addr(), host.as_ptr(), bytes.len(), stream)?;
                    gpu.launch(
                        Kernel::ApplyCompact,
                        width,
                        grid,
                        compact::BLOCK,
                        &args,
                        stream,
                    )?;
                }
            }
            Ok(())
        })
    }

    fn device(&self) -> u32 {
        self.gpu.ordinal() as u32
    }

    fn close(&mut self) {
        if self.attached {
            return; // a device payload's buffers are the caller's
        }
        for addr in self.opened.drain(..) {
            // SAFETY: opened once in `open`, closed once (drained); every operation on them waited for its
            // stream.
            let _ = unsafe { self.gpu.ipc_close(addr) };
        }
    }
}

impl PayloadIn for CudaReceiver {
    fn read(&mut self, addr: u64, len: usize) -> Result<Vec<u8>, GpuError> {
        let pinned = match &mut self.header {
            Some(h) if h.len() >= len => h,
            slot => slot.insert(self.gpu.pinned(len.max(MAX_HEADER))?),
        };
        let (gpu, stream) = (&self.gpu, self.stream);
        // SAFETY: the caller's payload of at least `len` bytes at `addr` on this device, kept alive by the
        // caller; the pinned buffer (`len` bytes at least) is untouched until `settled`'s stream sync.
        gpu.settled(stream, || unsafe {
            gpu.read_async(pinned.as_mut_ptr(), addr, len, stream)
        })?;
        Ok(pinned[..len].to_vec())
    }

    fn attach(&mut self, setup: &Setup, addrs: Vec<u64>) -> Result<(), GpuError> {
        if !self.attached && !self.opened.is_empty() {
            return Err(GpuError::Driver {
                op: "payload attach",
                code: 1,
                name: "this receiver has a GPU channel's buffers open".into(),
            });
        }
        if self.widths.len() != setup.widths.len() {
            self.launch_state(setup)?;
        }
        self.opened = addrs;
        self.attached = true;
        Ok(())
    }
}

impl Drop for CudaReceiver {
    fn drop(&mut self) {
        // Every operation waited for its work (`settled`), and the caller's stream may be gone by now: nothing
        // to wait for before the buffers are closed.
        self.close();
    }
}
