//! A device payload's receiver on the CPU: the payload in host memory and the receiver's tensors in host memory,
//! checked and installed by the reference kernels ([`crate::gpu::reference`]), bit for bit what the GPU kernels
//! do, so a rollout whose model lives on the CPU takes the payloads of a sender on the GPU.

use super::{PayloadIn, Setup};
use crate::bytes::read_uint;
use crate::gpu::GpuError;
use crate::gpu::compact::{Layout, TileDir};
use crate::gpu::ipc::ReceiverDevice;
use crate::gpu::reference::{self, Elements, PoolSum, ReferenceError};

fn host_error(name: String) -> GpuError {
    GpuError::Driver {
        op: "host payload",
        code: 1,
        name,
    }
}

/// Host memory regions the caller vouches for: (address, bytes), each alive, and not otherwise accessed, while
/// registered; sorted by address. Every access is checked to lie inside one region.
#[derive(Debug, Default)]
struct Regions(Vec<(u64, u64)>);

impl Regions {
    fn set(&mut self, mut regions: Vec<(u64, u64)>) {
        regions.sort_unstable();
        self.0 = regions;
    }

    fn check(&self, addr: u64, len: u64) -> Result<(), ReferenceError> {
        // The last region starting at or before `addr` (regions of live tensors do not overlap).
        let k = self.0.partition_point(|&(start, _)| start <= addr);
        let inside = k > 0 && {
            let (start, bytes) = self.0[k - 1];
            addr.checked_add(len)
                .is_some_and(|end| end <= start.saturating_add(bytes))
        };
        if inside {
            Ok(())
        } else {
            Err(ReferenceError::Address { addr, len })
        }
    }

    fn bytes(&self, addr: u64, len: u64) -> Result<&[u8], ReferenceError> {
        self.check(addr, len)?;
        // SAFETY: inside a registered region, which the caller keeps alive and unwritten by others while
        // registered (`HostReceiver::set_tensors` / `set_payload`).
        Ok(unsafe { std::slice::from_raw_parts(addr as *const u8, len as usize) })
    }

    fn bytes_mut(&mut self, addr: u64, len: u64) -> Result<&mut [u8], ReferenceError> {
        self.check(addr, len)?;
        // SAFETY: as `bytes`; `&mut self` makes this the only access through the registry.
        Ok(unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len as usize) })
    }
}

impl Elements for Regions {
    fn load(&self, addr: u64, i: u64, width: usize) -> Result<u64, ReferenceError> {
        let w = width as u64;
        Ok(read_uint(
            self.bytes(addr.wrapping_add(i.wrapping_mul(w)), w)?,
        ))
    }

    fn store(&mut self, addr: u64, i: u64, width: usize, v: u64) -> Result<(), ReferenceError> {
        let w = width as u64;
        let at = addr.wrapping_add(i.wrapping_mul(w));
        self.bytes_mut(at, w)?
            .copy_from_slice(&bytemuck::bytes_of(&v)[..width]);
        Ok(())
    }
}

/// [`ReceiverDevice`] and [`PayloadIn`] on the CPU: the receiver's tensors and the payload are host memory.
#[derive(Debug, Default)]
pub struct HostReceiver {
    /// The tensors (address, bytes), in the layout's order, and the payload: all registered in `mem`.
    tensors: Vec<(u64, u64)>,
    payload: Option<(u64, u64)>,
    mem: Regions,
    /// The attached buffers (the snapshot image first, then per width).
    attached: Vec<u64>,
}

/// One width's directory, index and values.
type Pools = (Vec<TileDir>, Vec<u32>, Vec<u64>);

/// `bytes` as values of `T` (copied: the payload need not be aligned for them).
fn collect<T: bytemuck::Pod>(bytes: &[u8]) -> Vec<T> {
    bytes
        .chunks_exact(size_of::<T>())
        .map(bytemuck::pod_read_unaligned)
        .collect()
}

fn sim(e: ReferenceError) -> GpuError {
    host_error(e.to_string())
}

impl HostReceiver {
    pub fn new() -> HostReceiver {
        HostReceiver::default()
    }

    /// The receiver's tensors for the next stage or commit: (address, bytes) of each, in the layout's order;
    /// address 0 for a tensor held elsewhere (on a GPU of a receiver whose tensors live on several devices:
    /// nothing of it is written here).
    ///
    /// # Safety
    /// Each range is host memory that stays alive, and is neither read nor written by anything else, until
    /// the next `set_tensors` or the receiver's drop.
    pub unsafe fn set_tensors(&mut self, tensors: &[(u64, u64)]) {
        self.tensors = tensors.to_vec();
        self.register();
    }

    /// The registry := the tensors and the payload.
    fn register(&mut self) {
        let regions = self
            .tensors
            .iter()
            .copied()
            .filter(|&(addr, _)| addr != 0)
            .chain(self.payload)
            .collect();
        self.mem.set(regions);
    }

    /// The payload the next stage reads and the commit after it installs: `len` bytes at `addr`.
    ///
    /// # Safety
    /// As [`Self::set_tensors`], for the payload (read only), until the next `set_payload` or the drop.
    pub unsafe fn set_payload(&mut self, addr: u64, len: u64) {
        self.payload = Some((addr, len));
        self.register();
    }

    fn base(&self, k: usize) -> Result<u64, GpuError> {
        self.attached
            .get(k)
            .copied()
            .ok_or_else(|| host_error("no payload attached".into()))
    }

    /// One width's directory, index and values, read out of the payload.
    fn pools(&self, base: u64, w: &crate::gpu::ipc::wire::WidthExport) -> Result<Pools, GpuError> {
        let words = if w.width == 8 { 2 } else { 1 };
        let dir_len = w.ntiles * size_of::<TileDir>() as u64;
        let dir = self.mem.bytes(base + w.dir_off, dir_len).map_err(sim)?;
        let idx = self
            .mem
            .bytes(base + w.idx_off, w.capacity * 4)
            .map_err(sim)?;
        let vals = self
            .mem
            .bytes(base + w.vals_off, w.capacity * 8 * words)
            .map_err(sim)?;
        Ok((collect(dir), collect(idx), collect(vals)))
    }
}

impl ReceiverDevice for HostReceiver {
    fn open(&mut self, _setup: &Setup) -> Result<(), GpuError> {
        Err(host_error(
            "a receiver on the CPU takes device payloads, not the GPU channel's buffers".into(),
        ))
    }

    fn full(&mut self, setup: &Setup) -> Result<(), GpuError> {
        let snap = self.base(0)?;
        for (dst, off, len) in setup.full_copies(self.tensors.iter().map(|t| t.0)) {
            let src = self.mem.bytes(snap + off, len).map_err(sim)?.to_vec();
            self.mem
                .bytes_mut(dst, len)
                .map_err(sim)?
                .copy_from_slice(&src);
        }
        Ok(())
    }

    fn apply(&mut self, setup: &Setup, layout: &Layout) -> Result<(), GpuError> {
        let snap = self.base(0)?;
        for (k, w) in setup.widths.iter().enumerate() {
            let (dir, idx, vals) = self.pools(self.base(1 + k)?, w)?;
            let width = usize::from(w.width);
            let jobs = layout.install_jobs(width, |pos| {
                (self.tensors[pos].0, snap + setup.offsets[pos])
            });
            reference::apply_compact(&mut self.mem, width, &jobs, w.ntiles, &dir, &idx, &vals)
                .map_err(sim)?;
        }
        Ok(())
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
        let snap = self.base(0)?;
        let mut sums = Vec::with_capacity(setup.widths.len());
        for (k, w) in setup.widths.iter().enumerate() {
            let width = usize::from(w.width);
            let (dir, idx, vals) = if full {
                Default::default()
            } else {
                self.pools(self.base(1 + k)?, w)?
            };
            let jobs = layout.apply_jobs(width, |pos| {
                (self.tensors[pos].0, snap + setup.offsets[pos])
            });
            let sum = reference::checksum_compact(
                &self.mem, width, &jobs, w.ntiles, &dir, &idx, &vals, w.capacity, seed, full,
            )
            .map_err(sim)?;
            sums.push(sum);
        }
        Ok(sums)
    }

    fn device(&self) -> u32 {
        u32::MAX
    }
}

impl PayloadIn for HostReceiver {
    fn read(&mut self, addr: u64, len: usize) -> Result<Vec<u8>, GpuError> {
        Ok(self.mem.bytes(addr, len as u64).map_err(sim)?.to_vec())
    }

    fn attach(&mut self, _setup: &Setup, addrs: Vec<u64>) -> Result<(), GpuError> {
        self.attached = addrs;
        Ok(())
    }
}
