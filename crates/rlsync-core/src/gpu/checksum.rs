//! The state checksum of weights that live on a GPU, computed there: `xxh3_chunks` digests every whole
//! [`CHECKSUM_CHUNK`] of the CUDA tensors in place, only each tensor's last partial chunk is copied to the
//! host, and the digests go to [`StateHasher`] in order, so the value is
//! [`state_checksum`](crate::tensor::state_checksum)'s for the same weights.
//!
//! Why: a rollout whose model lives on the GPU verifies each sync by its checksum (`runner.verify_sync`).
//! Hashing on the host would copy the whole state down per sync (13.5 GB for a 7B model in bf16: about a
//! second, ten times the device install); the kernel reads it at memory speed and sends 8 bytes per MiB.
//!
//! [`Plan`] is the backend-free part (which ranges are digested on the device, which are copied, how the
//! results combine), checked on the CPU against the host checksum with the kernel's reference
//! (`reference::xxh3`); [`DeviceChecksum`] runs it on a [`Gpu`].

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::ops::Range;

use super::reference::{Memory, ReferenceError, xxh3};
use super::{Arg, DeviceBuf, Gpu, GpuError, Kernel, PinnedBuf, Stream};
use crate::bytes::read_uint;
use crate::tensor::checksum::Piece;
use crate::tensor::parallel::resolve_threads;
use crate::tensor::{CHECKSUM_CHUNK, DType, StateDict, StateHasher};

/// Threads per block of `xxh3_chunks` (eight per chunk).
const BLOCK: u32 = 256;
/// Threads that digest one chunk.
const LANES: usize = 8;

/// A range of device memory the host hashes itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyRange {
    pub addr: u64,
    pub len: usize,
}

/// One key of the checksum, in order.
enum Item<'a> {
    Missing(&'a str),
    /// A tensor whose bytes are `state`'s (not on the device).
    Host(&'a str, DType, &'a [usize], &'a [u8]),
    /// A device tensor: its whole chunks' digests (`chunks` of [`Plan::chunks`]), then the bytes copied into
    /// `copied` of the copy buffer (its last partial chunk; the whole tensor when the kernel cannot read it).
    Device {
        layout: (&'a str, DType, &'a [usize]),
        chunks: Range<usize>,
        copied: Range<usize>,
    },
}

/// What a device checksum of a state reads where: built from the state's layout alone.
pub struct Plan<'a> {
    items: Vec<Item<'a>>,
    /// Device addresses of the whole chunks `xxh3_chunks` digests, in checksum order.
    pub chunks: Vec<u64>,
    /// Device ranges copied to the host, in order; [`Plan::finish`] takes them concatenated.
    pub copies: Vec<CopyRange>,
}

impl<'a> Plan<'a> {
    /// The checksum of `keys` of `state` where the tensors named in `device` live at those device addresses
    /// (same dtype, shape and size as their entry in `state`, whose bytes are not read); the rest are `state`'s.
    pub fn new(
        state: &'a StateDict,
        keys: &'a [String],
        device: &HashMap<String, u64>,
    ) -> Plan<'a> {
        let mut plan = Plan {
            items: Vec::with_capacity(keys.len()),
            chunks: Vec::new(),
            copies: Vec::new(),
        };
        let mut copied = 0;
        for key in keys {
            let Some(t) = state.get(key) else {
                plan.items.push(Item::Missing(key));
                continue;
            };
            let Some(&addr) = device.get(key.as_str()) else {
                plan.items
                    .push(Item::Host(key, t.dtype(), t.shape(), t.bytes()));
                continue;
            };
            copied = plan.device(key, t.dtype(), t.shape(), addr, copied);
        }
        plan
    }

    /// The checksum of device tensors alone: each named (key, dtype, shape) as the checksum hashes it, its
    /// bytes (elements × the dtype's size) at `addrs[k]` (a cast copy in another dtype than the state's).
    pub fn of_device(names: &'a [(String, DType, Vec<usize>)], addrs: &[u64]) -> Plan<'a> {
        let mut plan = Plan {
            items: Vec::with_capacity(names.len()),
            chunks: Vec::new(),
            copies: Vec::new(),
        };
        let mut copied = 0;
        for ((key, dtype, shape), &addr) in names.iter().zip(addrs) {
            copied = plan.device(key, *dtype, shape, addr, copied);
        }
        plan
    }

    /// Add a device tensor at `addr` whose copied bytes start at `copied` in the copy buffer; where the next
    /// one's start.
    fn device(
        &mut self,
        key: &'a str,
        dtype: DType,
        shape: &'a [usize],
        addr: u64,
        copied: usize,
    ) -> usize {
        let len = shape.iter().product::<usize>() * dtype.size_bytes();
        // The kernel's 8-byte loads need an aligned tensor; PyTorch's allocations are, a view with an odd
        // storage offset may not be: the host hashes such a tensor whole.
        let whole = if addr.is_multiple_of(8) {
            len / CHECKSUM_CHUNK
        } else {
            0
        };
        let first = self.chunks.len();
        self.chunks
            .extend((0..whole as u64).map(|c| addr + c * CHECKSUM_CHUNK as u64));
        let rest = len - whole * CHECKSUM_CHUNK;
        if rest > 0 {
            self.copies.push(CopyRange {
                addr: addr + (whole * CHECKSUM_CHUNK) as u64,
                len: rest,
            });
        }
        self.items.push(Item::Device {
            layout: (key, dtype, shape),
            chunks: first..self.chunks.len(),
            copied: copied..copied + rest,
        });
        copied + rest
    }

    /// Bytes [`Plan::copies`] adds up to.
    pub fn copied_bytes(&self) -> usize {
        self.copies.iter().map(|c| c.len).sum()
    }

    /// The checksum, from `digests` (one per [`Plan::chunks`]) and `copied` (the [`Plan::copies`]
    /// concatenated); host tensors are hashed on up to `threads` threads.
    pub fn finish(&self, digests: &[u64], copied: &[u8], threads: NonZeroUsize) -> u64 {
        let mut pieces = Vec::with_capacity(self.items.len() + self.copies.len());
        for item in &self.items {
            match item {
                Item::Missing(name) => pieces.push(Piece::Missing(name)),
                &Item::Host(name, dtype, shape, bytes) => pieces.push(Piece::Tensor {
                    layout: Some((name, dtype, shape)),
                    bytes,
                }),
                Item::Device {
                    layout,
                    chunks,
                    copied: range,
                } => {
                    let rest = copied.get(range.clone()).unwrap_or_default();
                    if chunks.is_empty() {
                        pieces.push(Piece::Tensor {
                            layout: Some(*layout),
                            bytes: rest,
                        });
                        continue;
                    }
                    pieces.push(Piece::Digests {
                        layout: *layout,
                        digests: digests.get(chunks.clone()).unwrap_or_default(),
                    });
                    if !rest.is_empty() {
                        pieces.push(Piece::Tensor {
                            layout: None,
                            bytes: rest,
                        });
                    }
                }
            }
        }
        let mut h = StateHasher::new();
        h.pieces(&pieces, threads);
        h.finish()
    }

    /// The checksum with a simulated device: `mem` holds the device tensors and the kernel's CPU reference
    /// digests the chunks (the CPU tests, the test worker's simulated device).
    pub fn finish_on(&self, mem: &Memory, threads: NonZeroUsize) -> Result<u64, ReferenceError> {
        let digests = xxh3::xxh3_chunks(mem, &self.chunks, CHECKSUM_CHUNK as u64)?;
        let mut copied = Vec::with_capacity(self.copied_bytes());
        for c in &self.copies {
            copied.extend_from_slice(mem.read(c.addr, c.len as u64)?);
        }
        Ok(self.finish(&digests, &copied, threads))
    }
}

/// Runs [`Plan`]s on a GPU; keeps its buffers (the chunk table and digests on the device, their pinned
/// staging and the copied tails) from one checksum to the next.
pub struct DeviceChecksum {
    gpu: Gpu,
    /// The chunk table, then the digests (8 bytes per chunk each).
    device: Option<DeviceBuf>,
    /// The same two, then the copied bytes.
    host: Option<PinnedBuf>,
}

impl DeviceChecksum {
    pub fn new(gpu: &Gpu) -> DeviceChecksum {
        DeviceChecksum {
            gpu: gpu.clone(),
            device: None,
            host: None,
        }
    }

    /// [`state_checksum`](crate::tensor::state_checksum) of `keys` of `state`, the tensors named in `device`
    /// read where they live on this GPU (see [`Plan::new`]), ordered after the work queued on `stream`
    /// (waited for).
    ///
    /// # Safety
    /// Every address in `device` must be the start of a live device tensor of this GPU holding its entry's
    /// bytes in `state`, unchanged until this returns.
    pub unsafe fn state_checksum(
        &mut self,
        state: &StateDict,
        keys: &[String],
        device: &HashMap<String, u64>,
        stream: Stream,
    ) -> Result<u64, GpuError> {
        let plan = Plan::new(state, keys, device);
        // SAFETY: forwarded to the caller's contract (the plan names `device`'s tensors).
        unsafe { self.run(&plan, stream) }
    }

    /// The checksum of `plan` on this GPU, after the work queued on `stream` (waited for).
    ///
    /// # Safety
    /// Every device range `plan` names must be live memory of this GPU, unchanged until this returns.
    pub unsafe fn run(&mut self, plan: &Plan<'_>, stream: Stream) -> Result<u64, GpuError> {
        let n = plan.chunks.len();
        let table = n * 8;
        let copied = plan.copied_bytes();
        // Kept from the last call when large enough (nothing is queued on them: that call synchronised); a
        // smaller one is freed once its replacement exists (a few bytes per MiB of state).
        let dev = match self.device.take() {
            Some(b) if b.len() >= 2 * table => b,
            _ => self.gpu.alloc(headroom(2 * table))?,
        };
        let dev = self.device.insert(dev);
        let host = match self.host.take() {
            Some(b) if b.len() >= 2 * table + copied => b,
            _ => self.gpu.pinned(headroom(2 * table + copied))?,
        };
        let host = self.host.insert(host);
        // The kernel's table: u64 addresses in the device's byte order (little-endian, as the host's:
        // `compact` asserts it).
        host[..table].copy_from_slice(bytemuck::cast_slice(&plan.chunks));
        let host_at = host.as_mut_ptr();
        let gpu = &self.gpu;
        // SAFETY: `host` is pinned memory of 2 * table + copied bytes and `dev` device memory of 2 * table
        // bytes, both rlsync's and untouched until the stream is synchronised below (on every path: a failed
        // call leaves nothing queued on them); the chunk table names whole chunks of live device tensors (the
        // caller's contract), `xxh3_chunks` reads them and writes `n` digests after the table; the copies read
        // the tensors' tails.
        let queued = unsafe {
            (|| {
                if n > 0 {
                    gpu.write_async(dev.addr(), host_at, table, stream)?;
                    let resident = gpu.sm_count() * gpu.blocks_per_sm(Kernel::Xxh3Chunks, 1, BLOCK);
                    let grid = (n * LANES).div_ceil(BLOCK as usize).min(resident).max(1) as u32;
                    let args = [
                        Arg::U64(dev.addr()),
                        Arg::U64(n as u64),
                        Arg::U64(CHECKSUM_CHUNK as u64),
                        Arg::U64(dev.addr() + table as u64),
                    ];
                    gpu.launch(Kernel::Xxh3Chunks, 1, grid, BLOCK, &args, stream)?;
                    gpu.read_async(host_at.add(table), dev.addr() + table as u64, table, stream)?;
                }
                let mut at = 2 * table;
                for c in &plan.copies {
                    gpu.read_async(host_at.add(at), c.addr, c.len, stream)?;
                    at += c.len;
                }
                Ok::<(), GpuError>(())
            })()
        };
        let synced = gpu.sync(stream);
        queued?;
        synced?;
        let digests: Vec<u64> = host[table..2 * table]
            .chunks_exact(8)
            .map(read_uint)
            .collect();
        Ok(plan.finish(
            &digests,
            &host[2 * table..2 * table + copied],
            resolve_threads(0),
        ))
    }
}

/// A buffer size for `len` bytes with a quarter of headroom (the next state may be a little larger), never 0.
fn headroom(len: usize) -> usize {
    (len + len / 4).max(8)
}

#[cfg(test)]
mod tests;
