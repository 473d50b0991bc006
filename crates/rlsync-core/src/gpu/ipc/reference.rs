//! The GPU channel's devices on the reference kernels: a sender and a receiver over a simulated device memory,
//! shared by threads of one process ([`SharedSim`]) or by processes of one host ([`FileSim`]).
//!
//! What the CUDA devices ([`super::CudaSender`], [`super::CudaReceiver`]) do with `diff_compact`,
//! `checksum_compact`, `apply_compact` and copies, these do with the reference kernels
//! ([`crate::gpu::reference`]) over a [`Memory`]. How an export reaches an importer is the simulation's
//! ([`SimMemory`]): threads of one process read the exporter's buffer in place; processes see a file the
//! exporter writes after each operation and the importer reads before each one (as a CUDA IPC mapping shows
//! the exporter's memory). The channel's protocol and lifecycle, and the worker runtime's use of it, are
//! tested with these on machines without a GPU.

use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use super::compact::{self, ApplyJob, Layout, TileDir};
use super::wire::{Export, Setup, WidthExport};
use super::{GpuError, ReceiverDevice, SenderDevice, WidthBuilt, width_export, width_plan};
use crate::bytes::{Reader, Writer};
use crate::gpu::checksum::Plan;
use crate::gpu::payload::{Part, PayloadIn, PayloadOut, Src};
use crate::gpu::reference::{self, Memory, Pool, PoolSum};
use crate::gpu::{IPC_HANDLE_BYTES, IpcHandle};
use crate::tensor::DType;

/// A simulated device's memory and how its exports reach importers.
pub trait SimMemory: Send {
    /// Run `f` on this process's simulated device memory.
    fn with<R>(&self, f: impl FnOnce(&mut Memory) -> R) -> R;
    /// The handle of the buffer at `addr` of this memory, exported.
    fn export(&self, addr: u64) -> IpcHandle;
    /// The exporter wrote the exported buffer at `addr`: make it visible to importers.
    fn publish(&self, mem: &Memory, addr: u64, bytes: u64) -> Result<(), GpuError>;
    /// Open an exported buffer in this memory; its address here.
    fn import(&self, mem: &mut Memory, handle: &IpcHandle, bytes: u64) -> Result<u64, GpuError>;
    /// Before an importer reads the buffer it opened at `addr`: bring it up to date.
    fn refresh(
        &self,
        mem: &mut Memory,
        handle: &IpcHandle,
        addr: u64,
        bytes: u64,
    ) -> Result<(), GpuError>;
    /// The importer opened `imports` buffers.
    fn opened(&self, _imports: usize) {}
    /// The importer closed `imports` buffers.
    fn closed(&self, _imports: usize) {}
    /// The exporter freed the buffer at `addr`.
    fn freed(&self, _addr: u64) {}
}

fn sim_error(name: String) -> GpuError {
    GpuError::Driver {
        op: "reference",
        code: 1,
        name,
    }
}

/// Tag of the handles of [`SharedSim`] (bytes 8..16).
const SHARED_TAG: &[u8; 8] = b"fakeipc!";
/// Tag of the handles of [`FileSim`].
const FILE_TAG: &[u8; 8] = b"fileipc!";

fn handle(tag: &[u8; 8], addr: u64, pid: u32) -> IpcHandle {
    let mut w = Writer::with_capacity(IPC_HANDLE_BYTES);
    w.u64(addr).bytes(tag).u32(pid);
    let mut h = [0u8; IPC_HANDLE_BYTES];
    let b = w.into_vec();
    h[..b.len()].copy_from_slice(&b);
    IpcHandle(h)
}

/// (address, pid) of a handle of `tag`'s kind.
fn parse(tag: &[u8; 8], h: &IpcHandle) -> Result<(u64, u32), GpuError> {
    let mut r = Reader::new(&h.0, "simulated IPC handle");
    let read = (|| Ok::<_, crate::bytes::BytesError>((r.u64()?, r.array::<8>()?, r.u32()?)))();
    match read {
        Ok((addr, t, pid)) if &t == tag => Ok((addr, pid)),
        _ => Err(sim_error("not a handle of this simulated device".into())),
    }
}

/// The address a [`SharedSim`] handle names.
fn shared_addr(h: &IpcHandle) -> Result<u64, GpuError> {
    parse(SHARED_TAG, h).map(|(addr, _)| addr)
}

/// One simulated device of one host that threads share (as processes share a GPU), and how many imports are
/// open on it.
#[derive(Clone, Default)]
pub struct SharedSim(Arc<Mutex<SharedHost>>);

/// [`SharedSim`]'s memory and open imports.
#[derive(Default)]
pub struct SharedHost {
    pub mem: Memory,
    pub open: usize,
    /// Exported buffers the exporter freed while imports were open (what CUDA leaves undefined).
    pub freed_while_open: usize,
}

impl SharedSim {
    pub fn lock(&self) -> MutexGuard<'_, SharedHost> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl SimMemory for SharedSim {
    fn with<R>(&self, f: impl FnOnce(&mut Memory) -> R) -> R {
        f(&mut self.lock().mem)
    }

    fn export(&self, addr: u64) -> IpcHandle {
        handle(SHARED_TAG, addr, 0)
    }

    fn publish(&self, _mem: &Memory, _addr: u64, _bytes: u64) -> Result<(), GpuError> {
        Ok(())
    }

    fn import(&self, mem: &mut Memory, handle: &IpcHandle, bytes: u64) -> Result<u64, GpuError> {
        let addr = shared_addr(handle)?;
        mem.read(addr, bytes)
            .map_err(|e| sim_error(e.to_string()))?;
        Ok(addr)
    }

    fn refresh(&self, _: &mut Memory, _: &IpcHandle, _: u64, _: u64) -> Result<(), GpuError> {
        Ok(())
    }

    fn opened(&self, imports: usize) {
        self.lock().open += imports;
    }

    fn closed(&self, imports: usize) {
        let mut h = self.lock();
        h.open = h.open.saturating_sub(imports);
    }

    fn freed(&self, _addr: u64) {
        let mut h = self.lock();
        if h.open > 0 {
            h.freed_while_open += 1;
        }
    }
}

/// A process's simulated device whose exports other processes of the host import: an exported buffer is
/// published as the file `<dir>/sim-gpu-<pid>-<addr>` after each operation that wrote it, and read by an
/// importer before each of its operations. The exporter removes its files when it frees the buffers.
#[derive(Clone)]
pub struct FileSim {
    mem: Arc<Mutex<Memory>>,
    dir: PathBuf,
}

impl FileSim {
    /// A new, empty simulated device whose exports go to `dir` (which must exist).
    pub fn new(dir: &Path) -> FileSim {
        FileSim {
            mem: Arc::default(),
            dir: dir.to_owned(),
        }
    }

    fn file(&self, addr: u64, pid: u32) -> PathBuf {
        self.dir.join(format!("sim-gpu-{pid}-{addr:x}"))
    }

    fn read_file(&self, handle: &IpcHandle, bytes: u64) -> Result<Vec<u8>, GpuError> {
        let (addr, pid) = parse(FILE_TAG, handle)?;
        let path = self.file(addr, pid);
        let data = std::fs::read(&path)
            .map_err(|e| sim_error(format!("importing {}: {e}", path.display())))?;
        if data.len() as u64 != bytes {
            return Err(sim_error(format!(
                "{} holds {} bytes, the export {bytes}",
                path.display(),
                data.len()
            )));
        }
        Ok(data)
    }
}

impl SimMemory for FileSim {
    fn with<R>(&self, f: impl FnOnce(&mut Memory) -> R) -> R {
        f(&mut self.mem.lock().unwrap_or_else(|p| p.into_inner()))
    }

    fn export(&self, addr: u64) -> IpcHandle {
        handle(FILE_TAG, addr, std::process::id())
    }

    fn publish(&self, mem: &Memory, addr: u64, bytes: u64) -> Result<(), GpuError> {
        let data = mem
            .read(addr, bytes)
            .map_err(|e| sim_error(e.to_string()))?;
        let path = self.file(addr, std::process::id());
        // Whole or not at all (an importer may read it meanwhile), 0600; no fsync: a simulation.
        let mut tmp = path.clone().into_os_string();
        tmp.push(".tmp");
        let written = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .and_then(|mut f| f.write_all(data))
            .and_then(|()| std::fs::rename(&tmp, &path));
        written.map_err(|e| sim_error(format!("publishing {}: {e}", path.display())))
    }

    fn import(&self, mem: &mut Memory, handle: &IpcHandle, bytes: u64) -> Result<u64, GpuError> {
        let data = self.read_file(handle, bytes)?;
        Ok(mem.alloc(&data))
    }

    fn refresh(
        &self,
        mem: &mut Memory,
        handle: &IpcHandle,
        addr: u64,
        bytes: u64,
    ) -> Result<(), GpuError> {
        let data = self.read_file(handle, bytes)?;
        mem.write(addr, bytes)
            .map_err(|e| sim_error(e.to_string()))?
            .copy_from_slice(&data);
        Ok(())
    }

    fn freed(&self, addr: u64) {
        let _ = std::fs::remove_file(self.file(addr, std::process::id()));
    }
}

fn copy(mem: &mut Memory, dst: u64, src: u64, len: u64) -> Result<(), GpuError> {
    let bytes = mem
        .read(src, len)
        .map_err(|e| sim_error(e.to_string()))?
        .to_vec();
    mem.write(dst, len)
        .map_err(|e| sim_error(e.to_string()))?
        .copy_from_slice(&bytes);
    Ok(())
}

/// `n` values of `T` at `addr`.
pub fn read_vec<T: bytemuck::Pod>(mem: &Memory, addr: u64, n: u64) -> Result<Vec<T>, GpuError> {
    let bytes = mem
        .read(addr, n * size_of::<T>() as u64)
        .map_err(|e| sim_error(e.to_string()))?;
    Ok(bytes
        .chunks_exact(size_of::<T>())
        .map(bytemuck::pod_read_unaligned)
        .collect())
}

/// The pool checksum (reference kernel) of one width's output at `base`: its entries, or with `full` the
/// snapshot copy the jobs name.
fn pool_sum(
    mem: &Memory,
    w: &WidthExport,
    base: u64,
    jobs: &[ApplyJob],
    seed: u64,
    full: bool,
) -> Result<PoolSum, GpuError> {
    let width = usize::from(w.width);
    let words = if width == 8 { 2 } else { 1 };
    // A full hash reads the snapshot copy only.
    let (dir, idx, vals): (Vec<TileDir>, Vec<u32>, Vec<u64>) = if full {
        Default::default()
    } else {
        (
            read_vec(mem, base + w.dir_off, w.ntiles)?,
            read_vec(mem, base + w.idx_off, w.capacity)?,
            read_vec(mem, base + w.vals_off, w.capacity * words)?,
        )
    };
    reference::checksum_compact(
        mem, width, jobs, w.ntiles, &dir, &idx, &vals, w.capacity, seed, full,
    )
    .map_err(|e| sim_error(e.to_string()))
}

/// What a test does to the simulated device during a sender's build (a fault, a corruption).
pub type Corruption<M> = Box<dyn FnOnce(&mut Memory, &RefSender<M>) + Send>;

/// The channel's sender on the reference kernels: the state's tensors at `state` in `sim`'s memory.
pub struct RefSender<M: SimMemory> {
    pub sim: M,
    /// The state's tensors' addresses, in the layout's order.
    pub state: Vec<u64>,
    /// The snapshot copy's address and size.
    pub snap: u64,
    snap_bytes: u64,
    /// Each width's exported output (handles of `sim`).
    pub outs: Vec<WidthExport>,
    /// Their addresses in `sim`'s memory, in the same order.
    pub out_addrs: Vec<u64>,
    /// Seeds the simulated order of the blocks' reservations.
    seed: u64,
    /// Tests: applied once to the memory after the next build's checksum (a corrupted pool).
    pub corrupt: Option<Corruption<M>>,
    /// Tests: applied once to the memory between the next build's `diff_compact` and its checksum (a fault
    /// on the sender's own device).
    pub fault: Option<Corruption<M>>,
}

impl<M: SimMemory> RefSender<M> {
    pub fn new(sim: M, state: Vec<u64>) -> RefSender<M> {
        RefSender {
            sim,
            state,
            snap: 0,
            snap_bytes: 0,
            outs: Vec::new(),
            out_addrs: Vec::new(),
            seed: 0,
            corrupt: None,
            fault: None,
        }
    }

    /// Publish every export (after an operation wrote them).
    fn publish(&self, mem: &Memory) -> Result<(), GpuError> {
        self.sim.publish(mem, self.snap, self.snap_bytes)?;
        for (w, &addr) in self.outs.iter().zip(&self.out_addrs) {
            self.sim.publish(mem, addr, w.buf.bytes)?;
        }
        Ok(())
    }
}

impl<M: SimMemory> Drop for RefSender<M> {
    fn drop(&mut self) {
        if self.snap != 0 {
            self.sim.freed(self.snap);
        }
        for &addr in &self.out_addrs {
            self.sim.freed(addr);
        }
    }
}

impl<M: SimMemory> SenderDevice for RefSender<M> {
    fn prepare(
        &mut self,
        layout: &Layout,
        _offsets: &[u64],
        snapshot_bytes: u64,
    ) -> Result<(Export, Vec<WidthExport>), GpuError> {
        let sim = &self.sim;
        let (snap, outs, addrs) = sim.with(|mem| {
            let snap = mem.alloc(&vec![0; snapshot_bytes as usize]);
            let mut outs = Vec::new();
            let mut addrs = Vec::new();
            for width in layout.widths().collect::<Vec<_>>() {
                let base = mem.alloc(&vec![0; width_plan(layout, width).0 as usize]);
                outs.push(width_export(layout, width, sim.export(base)));
                addrs.push(base);
            }
            (snap, outs, addrs)
        });
        self.snap = snap;
        self.snap_bytes = snapshot_bytes;
        self.outs = outs;
        self.out_addrs = addrs;
        let snapshot = Export {
            handle: self.sim.export(self.snap),
            bytes: snapshot_bytes,
        };
        self.sim.with(|mem| self.publish(mem))?;
        Ok((snapshot, self.outs.clone()))
    }

    fn bootstrap(&mut self, layout: &Layout, offsets: &[u64]) -> Result<(), GpuError> {
        self.sim.with(|mem| {
            for (t, (&src, &off)) in layout.tensors().iter().zip(self.state.iter().zip(offsets)) {
                copy(mem, self.snap + off, src, t.numel * t.width as u64)?;
            }
            self.publish(mem)
        })
    }

    fn build(
        &mut self,
        layout: &Layout,
        offsets: &[u64],
        seed: u64,
    ) -> Result<Vec<WidthBuilt>, GpuError> {
        self.seed += 1;
        let fault = self.fault.take();
        let corrupt = self.corrupt.take();
        let this = &*self;
        this.sim.with(|mem| {
            let mut cursors = Vec::new();
            for (w, &base) in this.outs.iter().zip(&this.out_addrs) {
                let width = usize::from(w.width);
                let jobs =
                    layout.diff_jobs(width, |pos| (this.state[pos], this.snap + offsets[pos]));
                let words = if width == 8 { 2 } else { 1 };
                let mut dir: Vec<TileDir> = read_vec(mem, base + w.dir_off, w.ntiles)?;
                let mut idx: Vec<u32> = read_vec(mem, base + w.idx_off, w.capacity)?;
                let mut vals: Vec<u64> = read_vec(mem, base + w.vals_off, w.capacity * words)?;
                let mut cursor = 0u64;
                reference::diff_compact(
                    mem,
                    width,
                    &jobs,
                    w.ntiles,
                    Pool {
                        idx: &mut idx,
                        vals: &mut vals,
                        capacity: w.capacity,
                        cursor: &mut cursor,
                    },
                    &mut dir,
                    this.seed,
                )
                .map_err(|e| sim_error(e.to_string()))?;
                for (at, bytes) in [
                    (w.dir_off, compact::as_bytes(&dir)),
                    (w.idx_off, compact::as_bytes(&idx)),
                    (w.vals_off, compact::as_bytes(&vals)),
                ] {
                    mem.write(base + at, bytes.len() as u64)
                        .map_err(|e| sim_error(e.to_string()))?
                        .copy_from_slice(bytes);
                }
                cursors.push(cursor);
            }
            if let Some(fault) = fault {
                fault(mem, this);
            }
            let mut built = Vec::new();
            for ((w, &base), cursor) in this.outs.iter().zip(&this.out_addrs).zip(cursors) {
                let sum_jobs =
                    layout.apply_jobs(usize::from(w.width), |pos| (0, this.snap + offsets[pos]));
                let sum = pool_sum(mem, w, base, &sum_jobs, seed, false)?;
                built.push(WidthBuilt { cursor, sum });
            }
            if let Some(corrupt) = corrupt {
                corrupt(mem, this);
            }
            this.publish(mem)?;
            Ok(built)
        })
    }

    fn snapshot_sum(
        &mut self,
        layout: &Layout,
        offsets: &[u64],
        seed: u64,
    ) -> Result<Vec<PoolSum>, GpuError> {
        self.sim.with(|mem| {
            self.outs
                .iter()
                .zip(&self.out_addrs)
                .map(|(w, &base)| {
                    let jobs = layout
                        .apply_jobs(usize::from(w.width), |pos| (0, self.snap + offsets[pos]));
                    pool_sum(mem, w, base, &jobs, seed, true)
                })
                .collect()
        })
    }

    fn device(&self) -> u32 {
        0
    }

    fn state_checksum(&mut self, names: &[(String, DType, Vec<usize>)]) -> Result<u64, GpuError> {
        let plan = Plan::of_device(names, &self.state);
        self.sim
            .with(|mem| plan.finish_on(mem, std::num::NonZeroUsize::MIN))
            .map_err(|e| sim_error(e.to_string()))
    }
}

impl<M: SimMemory> PayloadOut for RefSender<M> {
    fn copy_out(&mut self, dst: u64, header: &[u8], parts: &[Part]) -> Result<(), GpuError> {
        self.sim.with(|mem| {
            mem.write(dst, header.len() as u64)
                .map_err(|e| sim_error(e.to_string()))?
                .copy_from_slice(header);
            for p in parts {
                let src = match p.src {
                    Src::Snapshot => self.snap,
                    Src::Width(k) => self
                        .out_addrs
                        .get(k)
                        .copied()
                        .ok_or_else(|| sim_error(format!("no width {k}")))?,
                };
                copy(mem, dst + p.dst_off, src + p.src_off, p.len)?;
            }
            Ok(())
        })
    }

    fn snapshot_checksum(
        &mut self,
        names: &[(String, DType, Vec<usize>)],
        offsets: &[u64],
    ) -> Result<u64, GpuError> {
        let addrs: Vec<u64> = offsets.iter().map(|&o| self.snap + o).collect();
        let plan = Plan::of_device(names, &addrs);
        self.sim
            .with(|mem| plan.finish_on(mem, std::num::NonZeroUsize::MIN))
            .map_err(|e| sim_error(e.to_string()))
    }
}

/// The channel's receiver on the reference kernels: the receiver's tensors at `tensors` in `sim`'s memory.
pub struct RefReceiver<M: SimMemory> {
    pub sim: M,
    /// The receiver's tensors' addresses, in the layout's order.
    pub tensors: Vec<u64>,
    /// The opened exports: (handle, address here, bytes); the snapshot copy first, then the widths in the
    /// setup's order.
    opened: Vec<(IpcHandle, u64, u64)>,
    /// `opened` holds a device payload's addresses in this memory ([`PayloadIn::attach`]): nothing to
    /// refresh or close.
    attached: bool,
}

impl<M: SimMemory> RefReceiver<M> {
    pub fn new(sim: M, tensors: Vec<u64>) -> RefReceiver<M> {
        RefReceiver {
            sim,
            tensors,
            opened: Vec::new(),
            attached: false,
        }
    }

    /// Bring every opened export up to date, then run `f` on the memory.
    fn fresh<R>(&self, f: impl FnOnce(&mut Memory) -> Result<R, GpuError>) -> Result<R, GpuError> {
        self.sim.with(|mem| {
            for (h, addr, bytes) in self.opened.iter().filter(|_| !self.attached) {
                self.sim.refresh(mem, h, *addr, *bytes)?;
            }
            f(mem)
        })
    }

    fn snap(&self) -> Result<u64, GpuError> {
        self.opened
            .first()
            .map(|o| o.1)
            .ok_or_else(|| sim_error("nothing opened".into()))
    }
}

impl<M: SimMemory> Drop for RefReceiver<M> {
    fn drop(&mut self) {
        self.close();
    }
}

impl<M: SimMemory> PayloadIn for RefReceiver<M> {
    fn read(&mut self, addr: u64, len: usize) -> Result<Vec<u8>, GpuError> {
        self.sim.with(|mem| {
            mem.read(addr, len as u64)
                .map(<[u8]>::to_vec)
                .map_err(|e| sim_error(e.to_string()))
        })
    }

    fn attach(&mut self, setup: &Setup, addrs: Vec<u64>) -> Result<(), GpuError> {
        if !self.attached && !self.opened.is_empty() {
            return Err(sim_error(
                "this receiver has a GPU channel's buffers open".into(),
            ));
        }
        let none = IpcHandle([0; IPC_HANDLE_BYTES]);
        let sizes =
            std::iter::once(setup.snapshot.bytes).chain(setup.widths.iter().map(|w| w.buf.bytes));
        self.opened = addrs
            .into_iter()
            .zip(sizes)
            .map(|(a, b)| (none, a, b))
            .collect();
        self.attached = true;
        Ok(())
    }
}

impl<M: SimMemory> ReceiverDevice for RefReceiver<M> {
    fn close(&mut self) {
        if !self.attached {
            self.sim.closed(self.opened.len());
            self.opened.clear();
        }
    }

    fn open(&mut self, setup: &Setup) -> Result<(), GpuError> {
        let exports: Vec<Export> = std::iter::once(setup.snapshot)
            .chain(setup.widths.iter().map(|w| w.buf))
            .collect();
        let sim = &self.sim;
        let opened: Result<Vec<_>, GpuError> = sim.with(|mem| {
            exports
                .iter()
                .map(|e| Ok((e.handle, sim.import(mem, &e.handle, e.bytes)?, e.bytes)))
                .collect()
        });
        self.opened = opened?;
        self.sim.opened(self.opened.len());
        Ok(())
    }

    fn full(&mut self, setup: &Setup) -> Result<(), GpuError> {
        let snap = self.snap()?;
        self.fresh(|mem| {
            for (dst, off, bytes) in setup.full_copies(self.tensors.iter().copied()) {
                copy(mem, dst, snap + off, bytes)?;
            }
            Ok(())
        })
    }

    fn apply(&mut self, setup: &Setup, layout: &Layout) -> Result<(), GpuError> {
        let snap = self.snap()?;
        self.fresh(|mem| {
            for (k, w) in setup.widths.iter().enumerate() {
                let width = usize::from(w.width);
                let base = self.opened.get(1 + k).map(|o| o.1).unwrap_or_default();
                let words = if width == 8 { 2 } else { 1 };
                let dir: Vec<TileDir> = read_vec(mem, base + w.dir_off, w.ntiles)?;
                let idx: Vec<u32> = read_vec(mem, base + w.idx_off, w.capacity)?;
                let vals: Vec<u64> = read_vec(mem, base + w.vals_off, w.capacity * words)?;
                let jobs = layout
                    .install_jobs(width, |pos| (self.tensors[pos], snap + setup.offsets[pos]));
                reference::apply_compact(mem, width, &jobs, w.ntiles, &dir, &idx, &vals)
                    .map_err(|e| sim_error(e.to_string()))?;
            }
            Ok(())
        })
    }

    fn drain(&mut self) -> Result<(), GpuError> {
        Ok(())
    }

    fn checksum(
        &mut self,
        setup: &Setup,
        layout: &Layout,
        seed: u64,
        full: bool,
    ) -> Result<Vec<PoolSum>, GpuError> {
        let snap = self.snap()?;
        self.fresh(|mem| {
            setup
                .widths
                .iter()
                .enumerate()
                .map(|(k, w)| {
                    let base = self.opened.get(1 + k).map(|o| o.1).unwrap_or_default();
                    let jobs = layout.apply_jobs(usize::from(w.width), |pos| {
                        (self.tensors[pos], snap + setup.offsets[pos])
                    });
                    pool_sum(mem, w, base, &jobs, seed, full)
                })
                .collect()
        })
    }

    fn device(&self) -> u32 {
        0
    }
}
