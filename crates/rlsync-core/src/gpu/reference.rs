//! CPU reference implementations of the GPU kernels (`kernels/rlsync.cu`) with their exact semantics, over a
//! simulated device memory: what CI checks the format, the host tables and the encoder against.
//!
//! `diff_compact` works as the kernel does: tiles of [`TILE`] elements, a 16-bit change mask per thread of
//! [`PER_THREAD`] elements, the warp then block scan of the popcounts, one reservation per tile on the cursor
//! in an arbitrary (seeded, shuffled) tile order as the blocks' atomics would take them, overflow of the
//! pool, changed elements written back to the snapshot. `scatter` and `apply_compact` likewise. Addresses in
//! the job tables are addresses in a [`Memory`]; a bad address or table is a [`ReferenceError`].

use super::compact::{
    ApplyJob, BLOCK, DiffJob, OVERFLOW, PER_THREAD, SCATTER_ADD, SEGMENT_TILES, ScatterJob, TILE,
    TileDir, WIDTHS,
};
use crate::bytes::read_uint;
use crate::syncer::patch::SEGMENT;

/// Bytes of address space per buffer of a [`Memory`].
const BUFFER_SPAN: u64 = 1 << 40;

/// Simulated device memory: buffers at fixed, distinct addresses (buffer k at `(k + 1) << 40`).
#[derive(Debug, Clone, Default)]
pub struct Memory {
    bufs: Vec<Vec<u8>>,
}

/// Why a reference kernel could not run (what the device would fault on, or a table it cannot use).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReferenceError {
    #[error("address {addr:#x} + {len} bytes is outside every buffer")]
    Address { addr: u64, len: u64 },
    #[error("element width {width} has no kernel")]
    Width { width: usize },
    #[error("the directory has {found} tiles, the launch {expected}")]
    Directory { found: usize, expected: u64 },
    #[error("pool entry {entry} is outside the lists")]
    Pool { entry: u64 },
}

impl Memory {
    /// A new buffer holding `bytes`; its address.
    pub fn alloc(&mut self, bytes: &[u8]) -> u64 {
        self.bufs.push(bytes.to_vec());
        self.bufs.len() as u64 * BUFFER_SPAN
    }

    /// Drop the buffer at `addr` (a buffer's start): its bytes are released and any later access to it is an
    /// [`ReferenceError::Address`]; its address is never handed out again.
    pub fn free(&mut self, addr: u64) {
        if let Ok((k, 0)) = self.locate(addr, 0) {
            self.bufs[k] = Vec::new();
        }
    }

    /// The whole buffer at `addr` (which must be a buffer's start).
    pub fn buffer(&self, addr: u64) -> Option<&[u8]> {
        if !addr.is_multiple_of(BUFFER_SPAN) {
            return None;
        }
        let k = usize::try_from(addr / BUFFER_SPAN).ok()?.checked_sub(1)?;
        self.bufs.get(k).map(Vec::as_slice)
    }

    fn locate(&self, addr: u64, len: u64) -> Result<(usize, usize), ReferenceError> {
        let bad = ReferenceError::Address { addr, len };
        let k = (addr / BUFFER_SPAN)
            .checked_sub(1)
            .and_then(|k| usize::try_from(k).ok())
            .ok_or(bad.clone())?;
        let off = addr % BUFFER_SPAN;
        let buf = self.bufs.get(k).ok_or(bad.clone())?;
        let end = off.checked_add(len).ok_or(bad.clone())?;
        if end > buf.len() as u64 {
            return Err(bad);
        }
        Ok((k, off as usize))
    }

    /// `len` bytes at `addr`.
    pub fn read(&self, addr: u64, len: u64) -> Result<&[u8], ReferenceError> {
        let (k, off) = self.locate(addr, len)?;
        Ok(&self.bufs[k][off..off + len as usize])
    }

    /// `len` bytes at `addr`, writable.
    pub fn write(&mut self, addr: u64, len: u64) -> Result<&mut [u8], ReferenceError> {
        let (k, off) = self.locate(addr, len)?;
        Ok(&mut self.bufs[k][off..off + len as usize])
    }
}

/// The element access the reference kernels make: the simulated device's [`Memory`], or host memory a receiver
/// on the CPU installs into (`gpu::payload::host`).
pub trait Elements {
    /// Element `i` of the `width`-byte array at `addr`, zero-extended.
    fn load(&self, addr: u64, i: u64, width: usize) -> Result<u64, ReferenceError>;
    /// Store the low `width` bytes of `v` as element `i` of the array at `addr` (little-endian, the
    /// device's byte order; `compact` asserts the host's is the same).
    fn store(&mut self, addr: u64, i: u64, width: usize, v: u64) -> Result<(), ReferenceError>;
}

impl Elements for Memory {
    fn load(&self, addr: u64, i: u64, width: usize) -> Result<u64, ReferenceError> {
        let w = width as u64;
        Ok(read_uint(
            self.read(addr.wrapping_add(i.wrapping_mul(w)), w)?,
        ))
    }

    fn store(&mut self, addr: u64, i: u64, width: usize, v: u64) -> Result<(), ReferenceError> {
        let w = width as u64;
        let dst = self.write(addr.wrapping_add(i.wrapping_mul(w)), w)?;
        dst.copy_from_slice(&bytemuck::bytes_of(&v)[..width]);
        Ok(())
    }
}

fn check_width(width: usize) -> Result<(), ReferenceError> {
    if WIDTHS.contains(&width) {
        Ok(())
    } else {
        Err(ReferenceError::Width { width })
    }
}

/// The last job whose `first` is at most `at` (the kernels' binary search; 0 when none is).
fn find_job(firsts: impl Fn(usize) -> u64, n: usize, at: u64) -> usize {
    let (mut lo, mut hi) = (0usize, n);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if firsts(mid) <= at {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

/// A permutation of `0..n` from `seed` (Fisher-Yates on xorshift): the order the tiles' atomics land in.
fn shuffled(n: u64, seed: u64) -> Vec<u64> {
    let mut order: Vec<u64> = (0..n).collect();
    let mut x = seed | 1;
    for i in (1..order.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        order.swap(i, (x % (i as u64 + 1)) as usize);
    }
    order
}

/// The output pool of a `diff_compact` launch.
pub struct Pool<'a> {
    pub idx: &'a mut [u32],
    /// Two words per entry for 8-byte elements, else one.
    pub vals: &'a mut [u64],
    /// Entries the pool holds (`capacity` argument).
    pub capacity: u64,
    /// The cursor (zeroed by the caller before the launch).
    pub cursor: &'a mut u64,
}

/// `diff_compact_w{width}` over `jobs` (addresses in `mem`), tiles `0..ntiles`, reservations in the order
/// `seed` shuffles the tiles into.
pub fn diff_compact(
    mem: &mut Memory,
    width: usize,
    jobs: &[DiffJob],
    ntiles: u64,
    pool: Pool<'_>,
    dir: &mut [TileDir],
    seed: u64,
) -> Result<(), ReferenceError> {
    check_width(width)?;
    if jobs.is_empty() {
        return Ok(());
    }
    if (dir.len() as u64) < ntiles {
        return Err(ReferenceError::Directory {
            found: dir.len(),
            expected: ntiles,
        });
    }
    let per = if width == 8 { 2 } else { 1 };
    let block = BLOCK as usize;
    for tile in shuffled(ntiles, seed) {
        let job = jobs[find_job(|j| jobs[j].first_tile, jobs.len(), tile)];
        let t = tile.wrapping_sub(job.first_tile);
        let start = t.wrapping_mul(TILE as u64);
        let in_table = tile >= job.first_tile && start < job.numel;
        // Per thread: its change mask, and the values it compared.
        let mut masks = vec![0u32; block];
        let mut seen = vec![[(0u64, 0u64); PER_THREAD]; block];
        if in_table {
            for (th, (mask, seen)) in masks.iter_mut().zip(seen.iter_mut()).enumerate() {
                for (k, s) in seen.iter_mut().enumerate() {
                    let i = start + (th * PER_THREAD + k) as u64;
                    if i >= job.numel {
                        break;
                    }
                    let (cur, old) = (
                        mem.load(job.state, i, width)?,
                        mem.load(job.snap, i, width)?,
                    );
                    *s = (old, cur);
                    if cur != old {
                        *mask |= 1 << k;
                        mem.store(job.snap, i, width, cur)?;
                    }
                }
            }
        }
        // The scan: inclusive within each warp (shuffles), then the warp totals.
        let counts: Vec<u32> = masks.iter().map(|m| m.count_ones()).collect();
        let mut incl = counts.clone();
        for warp in incl.chunks_mut(32) {
            let mut d = 1;
            while d < 32 {
                let prev = warp.to_vec();
                for lane in d..warp.len() {
                    warp[lane] += prev[lane - d];
                }
                d <<= 1;
            }
        }
        let totals: Vec<u32> = incl.chunks(32).map(|w| w[w.len() - 1]).collect();
        let total: u32 = totals.iter().sum();
        let mut d = TileDir {
            offset: 0,
            count: total,
            flags: 0,
        };
        let mut off = None;
        if total != 0 {
            let o = *pool.cursor;
            *pool.cursor += u64::from(total);
            if o + u64::from(total) > pool.capacity {
                d.flags = OVERFLOW;
            } else {
                d.offset = o;
                off = Some(o);
            }
        }
        dir[tile as usize] = d;
        let Some(off) = off else { continue };
        let rel0 = (t % SEGMENT_TILES as u64) as u32 * TILE as u32;
        for th in 0..block {
            let before: u32 = totals[..th / 32].iter().sum();
            let rank = before + incl[th] - counts[th];
            let mut e = off + u64::from(rank);
            for (k, &(old, cur)) in seen[th].iter().enumerate() {
                if masks[th] & (1 << k) == 0 {
                    continue;
                }
                let slot = usize::try_from(e)
                    .ok()
                    .filter(|&s| s < pool.idx.len() && (s + 1) * per <= pool.vals.len())
                    .ok_or(ReferenceError::Pool { entry: e })?;
                pool.idx[slot] = rel0 + (th * PER_THREAD + k) as u32;
                if width == 8 {
                    pool.vals[2 * slot] = old;
                    pool.vals[2 * slot + 1] = cur;
                } else {
                    pool.vals[slot] = old | cur << 32;
                }
                e += 1;
            }
        }
    }
    Ok(())
}

/// `scatter_w{width}`: change `i` of `0..total` goes to `dst + idx[i] * width` of its job (the last whose
/// `first` is at most `i`), set or added (wrapping).
pub fn scatter(
    mem: &mut Memory,
    width: usize,
    jobs: &[ScatterJob],
    total: u64,
    idx: &[u32],
    vals: &[u64],
) -> Result<(), ReferenceError> {
    check_width(width)?;
    if jobs.is_empty() {
        return Ok(());
    }
    for i in 0..total {
        let job = jobs[find_job(|j| jobs[j].first, jobs.len(), i)];
        if i < job.first || i - job.first >= u64::from(job.count) {
            continue;
        }
        let (Some(&at), Some(&v)) = (idx.get(i as usize), vals.get(i as usize)) else {
            return Err(ReferenceError::Pool { entry: i });
        };
        let at = u64::from(at);
        let new = if job.mode == SCATTER_ADD {
            mem.load(job.dst, at, width)?.wrapping_add(v)
        } else {
            v
        };
        mem.store(job.dst, at, width, new)?;
    }
    Ok(())
}

/// `apply_compact_w{width}`: each tile's entries (per `dir`) into `dst`, or an overflowing tile copied from
/// `dense_src` (left alone when that is 0).
pub fn apply_compact(
    mem: &mut impl Elements,
    width: usize,
    jobs: &[ApplyJob],
    ntiles: u64,
    dir: &[TileDir],
    idx: &[u32],
    vals: &[u64],
) -> Result<(), ReferenceError> {
    check_width(width)?;
    if jobs.is_empty() {
        return Ok(());
    }
    if (dir.len() as u64) < ntiles {
        return Err(ReferenceError::Directory {
            found: dir.len(),
            expected: ntiles,
        });
    }
    for tile in 0..ntiles {
        let job = jobs[find_job(|j| jobs[j].first_tile, jobs.len(), tile)];
        if tile < job.first_tile {
            continue;
        }
        let t = tile - job.first_tile;
        let start = t * TILE as u64;
        if start >= job.numel {
            continue;
        }
        let end = job.numel.min(start + TILE as u64);
        let d = dir[tile as usize];
        if d.flags & OVERFLOW != 0 {
            if job.dense_src != 0 {
                for i in start..end {
                    let v = mem.load(job.dense_src, i, width)?;
                    mem.store(job.dst, i, width, v)?;
                }
            }
            continue;
        }
        let seg_base = (t / SEGMENT_TILES as u64) * SEGMENT as u64;
        for k in 0..u64::from(d.count.min(TILE as u32)) {
            let e = d.offset + k;
            let at = usize::try_from(e).map_err(|_| ReferenceError::Pool { entry: e })?;
            let (Some(&rel), Some(&new)) = (
                idx.get(at),
                if width == 8 {
                    vals.get(2 * at + 1)
                } else {
                    vals.get(at)
                },
            ) else {
                return Err(ReferenceError::Pool { entry: e });
            };
            let i = seg_base + u64::from(rel);
            if i < start || i >= end {
                continue;
            }
            let new = if width == 8 { new } else { new >> 32 };
            mem.store(job.dst, i, width, new)?;
        }
    }
    Ok(())
}

// -- checksum_compact (the GPU channel's pool checksum; s14/ipcsum) --

/// `checksum_compact`'s output: the wrapping sum of the per-entry hashes and the count it saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolSum {
    pub sum: u64,
    pub count: u64,
}

/// The kernels' 64-bit mix (splitmix64's finalizer): a bijection of `u64`, so changing any bit of its input
/// changes its output.
pub fn mix64(mut z: u64) -> u64 {
    z ^= z >> 30;
    z = z.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z ^= z >> 27;
    z = z.wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Marks the key of a tile hashed densely (an overflowing tile, or every tile of a full hash).
pub const DENSE_KEY: u64 = 1 << 63;

/// The per-launch key: the seed (the sync's sequence number) and the element width.
fn launch_key(seed: u64, width: usize) -> u64 {
    mix64(seed ^ ((width as u64) << 48))
}

/// One listed entry's hash: keyed by the tile it is listed under, its element's position in the width's tile
/// space (`first_tile * TILE + element`, wrapping) and its value word(s) (both halves: old | new << 32, or
/// the two words of an 8-byte element). Each step is a bijection, so any one changed input bit changes it.
pub fn entry_hash(tile_key: u64, pos: u64, v0: u64, v1: u64) -> u64 {
    mix64(mix64(mix64(tile_key ^ pos) ^ v0) ^ v1)
}

/// One densely hashed element's hash: its position and its value bits (zero-extended).
pub fn dense_hash(tile_key: u64, pos: u64, v: u64) -> u64 {
    mix64(mix64(tile_key ^ pos) ^ v)
}

/// `checksum_compact_w{width}`: per tile of `0..ntiles` (jobs as [`apply_compact`]'s; `dst` unused): with
/// `full`, every element of the tile hashed from `dense_src` and counted; else the tile's directory entry
/// counted (`count`, also for an overflowing tile), an overflowing tile's elements hashed from `dense_src`
/// (none when it is 0), a listed tile's entries `offset .. offset + min(count, TILE)` below `capacity`
/// hashed. The per-entry hashes are summed (wrapping): the sum does not depend on the pool's order.
#[allow(clippy::too_many_arguments)]
pub fn checksum_compact(
    mem: &impl Elements,
    width: usize,
    jobs: &[ApplyJob],
    ntiles: u64,
    dir: &[TileDir],
    idx: &[u32],
    vals: &[u64],
    capacity: u64,
    seed: u64,
    full: bool,
) -> Result<PoolSum, ReferenceError> {
    check_width(width)?;
    let mut out = PoolSum::default();
    if jobs.is_empty() {
        return Ok(out);
    }
    if !full && (dir.len() as u64) < ntiles {
        return Err(ReferenceError::Directory {
            found: dir.len(),
            expected: ntiles,
        });
    }
    let key = launch_key(seed, width);
    for tile in 0..ntiles {
        let job = jobs[find_job(|j| jobs[j].first_tile, jobs.len(), tile)];
        if tile < job.first_tile {
            continue;
        }
        let t = tile - job.first_tile;
        let start = t * TILE as u64;
        if start >= job.numel {
            continue;
        }
        let end = job.numel.min(start + TILE as u64);
        let base = job.first_tile.wrapping_mul(TILE as u64);
        let dense = |out: &mut PoolSum| -> Result<(), ReferenceError> {
            if job.dense_src == 0 {
                return Ok(());
            }
            let tkey = mix64(key ^ tile ^ DENSE_KEY);
            for i in start..end {
                let v = mem.load(job.dense_src, i, width)?;
                out.sum = out
                    .sum
                    .wrapping_add(dense_hash(tkey, base.wrapping_add(i), v));
            }
            Ok(())
        };
        if full {
            out.count += end - start;
            dense(&mut out)?;
            continue;
        }
        let d = dir[tile as usize];
        out.count = out.count.wrapping_add(u64::from(d.count));
        if d.flags & OVERFLOW != 0 {
            dense(&mut out)?;
            continue;
        }
        let tkey = mix64(key ^ tile);
        let seg_base = (t / SEGMENT_TILES as u64) * SEGMENT as u64;
        for k in 0..u64::from(d.count.min(TILE as u32)) {
            let e = d.offset.wrapping_add(k);
            if e >= capacity {
                continue;
            }
            let at = usize::try_from(e).map_err(|_| ReferenceError::Pool { entry: e })?;
            let words = if width == 8 {
                vals.get(2 * at).zip(vals.get(2 * at + 1))
            } else {
                vals.get(at).map(|v| (v, &0))
            };
            let (Some(&rel), Some((&v0, &v1))) = (idx.get(at), words) else {
                return Err(ReferenceError::Pool { entry: e });
            };
            let pos = base.wrapping_add(seg_base).wrapping_add(u64::from(rel));
            out.sum = out.sum.wrapping_add(entry_hash(tkey, pos, v0, v1));
        }
    }
    Ok(out)
}

// -- checksum_compact (end) --

pub mod cast;
#[cfg(test)]
pub(crate) mod rng;
pub mod xxh3;

#[cfg(test)]
mod tests;
