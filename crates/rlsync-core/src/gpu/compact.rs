//! The compacted-changes format of the GPU patch kernels (notes/gpu-spec.md): its constants and tables, the
//! tile layout of the synced tensors, and the checked walk from a kernel's output to patch.rs's `Built`.
//!
//! `kernels/rlsync.cu` writes this format and this module reads it; the two must agree on every constant and
//! struct below (plain `#[repr(C)]` structs of little-endian integers, 8-byte aligned, viewed as bytes through
//! bytemuck). A tile is [`TILE`] elements of one tensor; each element width (1, 2, 4, 8 bytes) has its own
//! launch and its own tile numbering: the tensors of that width, in snapshot order, take consecutive tiles.
//! [`collect`] trusts nothing it reads: counts, offsets, flags, indices and values are checked, and bad
//! output is a [`CompactError`], never a panic or a wrong patch.

use std::num::NonZeroUsize;

use crate::syncer::patch::{Built, Changes, SEGMENT, ScatterEntry, ScatterMode, SnapTensor};
use crate::tensor::parallel::map_items;

/// Elements per tile (one block of [`BLOCK`] threads, [`PER_THREAD`] elements each).
pub const TILE: usize = 4096;
/// Threads per block of every kernel (launch with exactly this many, no dynamic shared memory).
pub const BLOCK: u32 = 256;
/// Consecutive elements each thread of `diff_compact` compares.
pub const PER_THREAD: usize = 16;
/// Tiles per patch segment ([`SEGMENT`] elements).
pub const SEGMENT_TILES: usize = SEGMENT / TILE;
/// [`TileDir::flags`]: the tile did not fit the output pool; its entries were not written.
pub const OVERFLOW: u32 = 1;
/// [`ScatterJob::mode`]: overwrite the element with the value.
pub const SCATTER_SET: u32 = 0;
/// [`ScatterJob::mode`]: add the value to the element (wrapping, in the element's width).
pub const SCATTER_ADD: u32 = 1;
/// The element widths that have kernels (`diff_compact_w1` ... `_w8`).
pub const WIDTHS: [usize; 4] = [1, 2, 4, 8];

const _: () = assert!(TILE == BLOCK as usize * PER_THREAD && SEGMENT.is_multiple_of(TILE));
const _: () = assert!(PER_THREAD <= 32 && SEGMENT_TILES == 1024);
// The structs are the device's bytes only on a little-endian host (every host CUDA runs on).
const _: () = assert!(cfg!(target_endian = "little"));

/// One tensor of a `diff_compact` launch: device addresses of the state and the snapshot (same dtype).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, bytemuck::Zeroable, bytemuck::Pod)]
pub struct DiffJob {
    pub state: u64,
    pub snap: u64,
    pub numel: u64,
    pub first_tile: u64,
}

/// Where one tile's entries are in the output pool (`offset`, `count`), or [`OVERFLOW`] in `flags`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, bytemuck::Zeroable, bytemuck::Pod)]
pub struct TileDir {
    pub offset: u64,
    pub count: u32,
    pub flags: u32,
}

/// One patch entry of a `scatter` launch: changes `first .. first + count` of the flat lists go to the
/// elements `dst[idx]` (`dst`: the device address of the entry's first element).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, bytemuck::Zeroable, bytemuck::Pod)]
pub struct ScatterJob {
    pub dst: u64,
    pub first: u64,
    pub count: u32,
    pub mode: u32,
}

/// One tensor of an `apply_compact` launch: the receiver's tensor and, for overflowing tiles, the sender's
/// updated snapshot of it (0: overflowing tiles are left to the host).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, bytemuck::Zeroable, bytemuck::Pod)]
pub struct ApplyJob {
    pub dst: u64,
    pub dense_src: u64,
    pub numel: u64,
    pub first_tile: u64,
}

const _: () = assert!(size_of::<DiffJob>() == 32 && size_of::<ApplyJob>() == 32);
const _: () = assert!(size_of::<TileDir>() == 16 && size_of::<ScatterJob>() == 24);

/// A table's bytes as the kernels read them (for a host-to-device copy).
pub fn as_bytes<T: bytemuck::Pod>(table: &[T]) -> &[u8] {
    bytemuck::cast_slice(table)
}

/// Bytes copied back from the device viewed as a table (`TileDir`s, indices, values): they must be whole
/// records, aligned for `T` (pinned and `Vec` buffers are).
pub fn view<T: bytemuck::Pod>(bytes: &[u8]) -> Result<&[T], CompactError> {
    bytemuck::try_cast_slice(bytes).map_err(|_| CompactError::View {
        len: bytes.len(),
        record: size_of::<T>(),
        align: align_of::<T>(),
    })
}

/// Why a kernel's output (or a layout) was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CompactError {
    #[error("element width {width} has no kernel (1, 2, 4 or 8 bytes)")]
    Width { tensor: usize, width: usize },
    #[error("tensor {tensor}: its storage is not a whole number of {width}-byte elements")]
    Storage { tensor: usize, width: usize },
    #[error("{len} bytes are not a table of {record}-byte records aligned to {align}")]
    View {
        len: usize,
        record: usize,
        align: usize,
    },
    #[error("the build holds {found} segments, the layout {expected}: call Layout::prepare first")]
    Unprepared { found: usize, expected: usize },
    #[error("width {width}: the directory has {found} tiles, the launch {expected}")]
    Directory {
        width: usize,
        found: usize,
        expected: u64,
    },
    #[error("width {width}, tile {tile}: unknown flags {flags:#x}")]
    Flags { width: usize, tile: u64, flags: u32 },
    #[error("width {width}, tile {tile}: {count} changes in a tile of {elements} elements")]
    Count {
        width: usize,
        tile: u64,
        count: u32,
        elements: usize,
    },
    #[error("width {width}, tile {tile}: entries {offset}+{count} outside the pool of {capacity}")]
    Pool {
        width: usize,
        tile: u64,
        offset: u64,
        count: u32,
        capacity: usize,
    },
    #[error(
        "width {width}, tile {tile}: entry {entry} has index {index}, outside the tile or not ascending"
    )]
    Index {
        width: usize,
        tile: u64,
        entry: u64,
        index: u32,
    },
    #[error("width {width}, tile {tile}: entry {entry} is no change of a {width}-byte element")]
    Value { width: usize, tile: u64, entry: u64 },
}

/// One synced tensor's place in its width's launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorTiles {
    /// Position in the snapshot (the `tensor` of its segments in [`Built`]).
    pub pos: usize,
    pub width: usize,
    pub numel: u64,
    /// Its first tile in its width's numbering, and how many it has (the last may be partial).
    pub first_tile: u64,
    pub ntiles: u64,
    /// Index of its first segment in [`Built::segments`].
    pub first_segment: usize,
}

/// The tile layout of the synced tensors (per width) and the segments of a build (as `patch::build` makes
/// them: per tensor in snapshot order, chunks of [`SEGMENT`] elements; an empty tensor has none).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Layout {
    tensors: Vec<TensorTiles>,
    /// Per width (index in [`WIDTHS`]): total tiles, and the tensors (indices into `tensors`) in order.
    tiles: [u64; 4],
    by_width: [Vec<usize>; 4],
    /// Per segment: (tensor position, base element, elements).
    segments: Vec<(usize, usize, usize)>,
}

fn width_slot(width: usize) -> Option<usize> {
    WIDTHS.iter().position(|&w| w == width)
}

impl Layout {
    /// The layout of tensors given as (elements, element width) in snapshot order.
    pub fn new(tensors: &[(u64, usize)]) -> Result<Layout, CompactError> {
        let mut l = Layout::default();
        for (pos, &(numel, width)) in tensors.iter().enumerate() {
            let slot = width_slot(width).ok_or(CompactError::Width { tensor: pos, width })?;
            let ntiles = numel.div_ceil(TILE as u64);
            l.by_width[slot].push(l.tensors.len());
            l.tensors.push(TensorTiles {
                pos,
                width,
                numel,
                first_tile: l.tiles[slot],
                ntiles,
                first_segment: l.segments.len(),
            });
            l.tiles[slot] += ntiles;
            let mut base = 0u64;
            while base < numel {
                let span = (numel - base).min(SEGMENT as u64);
                l.segments.push((pos, base as usize, span as usize));
                base += span;
            }
        }
        Ok(l)
    }

    /// The layout of a sender's snapshot tensors.
    pub fn from_snapshot(snap: &[SnapTensor]) -> Result<Layout, CompactError> {
        let shapes = snap
            .iter()
            .enumerate()
            .map(|(pos, st)| {
                let width = st.dtype.size_bytes();
                let len = st.storage.len();
                if !len.is_multiple_of(width) {
                    return Err(CompactError::Storage { tensor: pos, width });
                }
                Ok(((len / width) as u64, width))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Layout::new(&shapes)
    }

    /// Every tensor, in snapshot order.
    pub fn tensors(&self) -> &[TensorTiles] {
        &self.tensors
    }

    /// The tensors of one width, in their launch's order.
    pub fn tensors_of(&self, width: usize) -> impl Iterator<Item = &TensorTiles> {
        width_slot(width)
            .map(|s| self.by_width[s].as_slice())
            .unwrap_or_default()
            .iter()
            .map(|&i| &self.tensors[i])
    }

    /// The widths that have at least one tile (one launch each).
    pub fn widths(&self) -> impl Iterator<Item = usize> + '_ {
        WIDTHS
            .into_iter()
            .zip(self.tiles)
            .filter(|&(_, n)| n > 0)
            .map(|(w, _)| w)
    }

    /// Tiles of one width's launch (the `ntiles` argument; the directory's length).
    pub fn ntiles(&self, width: usize) -> u64 {
        width_slot(width).map_or(0, |s| self.tiles[s])
    }

    /// Segments of a build over this layout.
    pub fn segment_count(&self) -> usize {
        self.segments.len()
    }

    /// The `diff_compact` job table of one width, given each tensor's (state, snapshot) device addresses by
    /// snapshot position. Jobs of empty tensors are kept (they own no tile).
    pub fn diff_jobs(
        &self,
        width: usize,
        mut ptrs: impl FnMut(usize) -> (u64, u64),
    ) -> Vec<DiffJob> {
        self.tensors_of(width)
            .map(|t| {
                let (state, snap) = ptrs(t.pos);
                DiffJob {
                    state,
                    snap,
                    numel: t.numel,
                    first_tile: t.first_tile,
                }
            })
            .collect()
    }

    /// The `apply_compact` job table of one width, given each tensor's (destination, dense source) device
    /// addresses by snapshot position.
    pub fn apply_jobs(
        &self,
        width: usize,
        mut ptrs: impl FnMut(usize) -> (u64, u64),
    ) -> Vec<ApplyJob> {
        self.tensors_of(width)
            .map(|t| {
                let (dst, dense_src) = ptrs(t.pos);
                ApplyJob {
                    dst,
                    dense_src,
                    numel: t.numel,
                    first_tile: t.first_tile,
                }
            })
            .collect()
    }

    /// The `apply_compact` job table of one width for an install: [`Self::apply_jobs`] without the tensors
    /// whose destination is 0 (held elsewhere: a receiver whose tensors live on several devices installs each
    /// device's share with its own job table). The kernel and its reference skip a tile with no job of its
    /// tensor (it lies past the previous job's tiles, or before the first job's).
    pub fn install_jobs(
        &self,
        width: usize,
        ptrs: impl FnMut(usize) -> (u64, u64),
    ) -> Vec<ApplyJob> {
        let mut jobs = self.apply_jobs(width, ptrs);
        jobs.retain(|j| j.dst != 0);
        jobs
    }

    /// Start a build over this layout: every segment in place and empty, no changes counted.
    pub fn prepare(&self, built: &mut Built) {
        for (c, &(pos, base, span)) in built
            .start(self.segments.len())
            .iter_mut()
            .zip(&self.segments)
        {
            c.reset(pos, base, span);
        }
    }
}

/// The `scatter` job table of one width's decoded entries (`patch::scatter_plan` / `patch::ScatterShape`),
/// given each tensor's device address by key ordinal; the launch's `total` is the width's change count. A run
/// of more than `u32::MAX` changes becomes several jobs.
pub fn scatter_jobs(
    entries: &[ScatterEntry],
    mut dst: impl FnMut(usize) -> u64,
) -> Vec<ScatterJob> {
    let mut jobs = Vec::with_capacity(entries.len());
    for e in entries {
        let at = dst(e.ordinal).wrapping_add((e.base as u64).wrapping_mul(e.width as u64));
        let mode = match e.mode {
            ScatterMode::Set => SCATTER_SET,
            ScatterMode::Add => SCATTER_ADD,
        };
        let (mut first, mut left) = (e.first as u64, e.count as u64);
        loop {
            let count = left.min(u64::from(u32::MAX));
            jobs.push(ScatterJob {
                dst: at,
                first,
                count: count as u32,
                mode,
            });
            first += count;
            left -= count;
            if left == 0 {
                break;
            }
        }
    }
    jobs
}

/// What [`collect`] found in one width's output.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CollectReport {
    /// Changed elements (those of overflowing tiles included): the kernel's cursor when nothing overflowed.
    pub changes: u64,
    /// Entries read from the pool.
    pub listed: u64,
    /// Segments (indices into [`Built::segments`]) with an overflowing tile: now forced dense.
    pub forced: Vec<usize>,
    /// Segments the encoder may code dense (the forced ones too): their new values must be in the host
    /// snapshot before [`crate::syncer::patch::encode`] runs (`Changes::may_code_dense`).
    pub needs_snapshot: Vec<usize>,
}

/// One segment's outcome, before it is merged into the report.
struct SegmentOutcome {
    changes: u64,
    listed: u64,
    forced: bool,
    needs_snapshot: bool,
}

/// Rebuild the segments of the `width`-byte tensors in `built` (prepared by [`Layout::prepare`]) from one
/// `diff_compact` launch's output: `dir` (one entry per tile), the pool's `idx` and `vals` (capacity
/// `min(idx.len(), vals.len() / k)` with k = 2 for 8-byte elements, else 1). Each segment lists its tiles'
/// entries in tile order, so `patch::encode` makes exactly the CPU path's bytes; a segment with an
/// [`OVERFLOW`] tile is forced dense with its exact change count. Segments run in parallel on `threads`.
/// `built.changed` is the sum over every segment afterwards.
pub fn collect(
    layout: &Layout,
    width: usize,
    dir: &[TileDir],
    idx: &[u32],
    vals: &[u64],
    built: &mut Built,
    threads: NonZeroUsize,
) -> Result<CollectReport, CompactError> {
    let slot = width_slot(width).ok_or(CompactError::Width { tensor: 0, width })?;
    let found = built.segments().len();
    if found != layout.segments.len() {
        return Err(CompactError::Unprepared {
            found,
            expected: layout.segments.len(),
        });
    }
    let ntiles = layout.tiles[slot];
    if (dir.len() as u64) < ntiles {
        return Err(CompactError::Directory {
            width,
            found: dir.len(),
            expected: ntiles,
        });
    }
    let per = if width == 8 { 2 } else { 1 };
    let pool = Pool {
        width,
        dir,
        idx,
        vals,
        capacity: idx.len().min(vals.len() / per),
    };
    // The segments of this width: (segment index, its tensor, tile of its first element in the launch).
    let mut mine = Vec::new();
    for t in layout.tensors_of(width) {
        let nseg = t.ntiles.div_ceil(SEGMENT_TILES as u64) as usize;
        for s in 0..nseg {
            mine.push((t.first_segment + s, *t, s));
        }
    }
    // Ascending segment indices: pair each with its `Changes` in one walk.
    let mut items = Vec::with_capacity(mine.len());
    let mut mine = mine.into_iter().peekable();
    for (i, c) in built.segments_mut().iter_mut().enumerate() {
        if let Some((_, t, s)) = mine.next_if(|&(j, _, _)| j == i) {
            items.push((i, t, s, c));
        }
    }
    let outcomes = map_items(items, threads, |(i, t, s, c)| {
        pool.segment(&t, s, c).map(|o| (i, o))
    });
    let mut report = CollectReport::default();
    for o in outcomes {
        let (i, o) = o?;
        report.changes += o.changes;
        report.listed += o.listed;
        if o.forced {
            report.forced.push(i);
        }
        if o.needs_snapshot {
            report.needs_snapshot.push(i);
        }
    }
    built.changed = built.segments().iter().map(|c| c.len() as u64).sum();
    Ok(report)
}

/// One launch's output, read-only.
struct Pool<'a> {
    width: usize,
    dir: &'a [TileDir],
    idx: &'a [u32],
    vals: &'a [u64],
    capacity: usize,
}

impl Pool<'_> {
    /// Fill segment `s` of tensor `t` into `c` from its tiles.
    fn segment(
        &self,
        t: &TensorTiles,
        s: usize,
        c: &mut Changes,
    ) -> Result<SegmentOutcome, CompactError> {
        let width = self.width;
        let base = s * SEGMENT;
        let span = (t.numel as usize - base).min(SEGMENT);
        c.reset(t.pos, base, span);
        let first = t.first_tile + (s * SEGMENT_TILES) as u64;
        let tiles = span.div_ceil(TILE);
        // Pass 1: every directory entry checked, the count summed, overflow found.
        let (mut changes, mut listed, mut forced) = (0u64, 0u64, false);
        for k in 0..tiles {
            let tile = first + k as u64;
            let d = self.dir[tile as usize];
            let elements = (span - k * TILE).min(TILE);
            if d.flags & !OVERFLOW != 0 {
                return Err(CompactError::Flags {
                    width,
                    tile,
                    flags: d.flags,
                });
            }
            if d.count as usize > elements {
                return Err(CompactError::Count {
                    width,
                    tile,
                    count: d.count,
                    elements,
                });
            }
            changes += u64::from(d.count);
            if d.flags & OVERFLOW != 0 {
                forced = true;
            } else if d.count > 0 {
                let end = d.offset.checked_add(u64::from(d.count));
                if end.is_none_or(|e| e > self.capacity as u64) {
                    return Err(CompactError::Pool {
                        width,
                        tile,
                        offset: d.offset,
                        count: d.count,
                        capacity: self.capacity,
                    });
                }
                listed += u64::from(d.count);
            }
        }
        if forced {
            c.force_dense(changes as usize);
        } else {
            // Pass 2: the entries, checked (inside their tile, ascending, real changes) and copied.
            let (out_idx, out_vals) = c.lists_mut();
            out_idx.reserve(listed as usize);
            out_vals.reserve(listed as usize * if width == 8 { 2 } else { 1 });
            let mask = if width == 8 {
                u64::MAX
            } else {
                (1u64 << (8 * width)) - 1
            };
            for k in 0..tiles {
                let tile = first + k as u64;
                let d = self.dir[tile as usize];
                let (lo, hi) = (k * TILE, k * TILE + (span - k * TILE).min(TILE));
                let (from, n) = (d.offset as usize, d.count as usize);
                let mut next = lo as u64;
                for (e, &i) in self.idx[from..from + n].iter().enumerate() {
                    let entry = (from + e) as u64;
                    if u64::from(i) < next || i as usize >= hi {
                        return Err(CompactError::Index {
                            width,
                            tile,
                            entry,
                            index: i,
                        });
                    }
                    next = u64::from(i) + 1;
                }
                if width == 8 {
                    let v = &self.vals[2 * from..2 * (from + n)];
                    if let Some(e) = v.chunks_exact(2).position(|p| p[0] == p[1]) {
                        return Err(CompactError::Value {
                            width,
                            tile,
                            entry: (from + e) as u64,
                        });
                    }
                    out_vals.extend_from_slice(v);
                } else {
                    let v = &self.vals[from..from + n];
                    if let Some(e) = v.iter().position(|&x| {
                        (x & 0xffff_ffff) > mask || (x >> 32) > mask || x & 0xffff_ffff == x >> 32
                    }) {
                        return Err(CompactError::Value {
                            width,
                            tile,
                            entry: (from + e) as u64,
                        });
                    }
                    out_vals.extend_from_slice(v);
                }
                out_idx.extend_from_slice(&self.idx[from..from + n]);
            }
        }
        Ok(SegmentOutcome {
            changes,
            listed: if forced { 0 } else { listed },
            forced,
            needs_snapshot: c.may_code_dense(width),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_numbers_tiles_per_width_and_segments_like_build() {
        let seg = SEGMENT as u64;
        let l = Layout::new(&[(5000, 2), (0, 2), (seg + 1, 4), (10, 2), (1, 1)]).unwrap();
        assert_eq!(l.ntiles(2), 3, "tiles of 5000, 0 and 10 elements");
        assert_eq!(l.ntiles(4), (seg / TILE as u64) + 1);
        assert_eq!(l.ntiles(1), 1);
        assert_eq!(l.ntiles(8), 0);
        assert_eq!(l.widths().collect::<Vec<_>>(), vec![1, 2, 4]);
        let firsts: Vec<u64> = l.tensors_of(2).map(|t| t.first_tile).collect();
        assert_eq!(
            firsts,
            vec![0, 2, 2],
            "an empty tensor shares its first tile with the next"
        );
        assert_eq!(
            l.segments,
            vec![
                (0, 0, 5000),
                (2, 0, SEGMENT),
                (2, SEGMENT, 1),
                (3, 0, 10),
                (4, 0, 1)
            ]
        );
        assert_eq!(l.tensors()[3].first_segment, 3);
        let jobs = l.diff_jobs(2, |p| (p as u64 * 100, p as u64 * 100 + 1));
        assert_eq!(
            jobs[2],
            DiffJob {
                state: 300,
                snap: 301,
                numel: 10,
                first_tile: 2
            }
        );
        assert_eq!(
            Layout::new(&[(1, 3)]),
            Err(CompactError::Width {
                tensor: 0,
                width: 3
            })
        );
    }

    #[test]
    fn tables_have_the_kernels_byte_layout() {
        let d = TileDir {
            offset: 0x0102_0304_0506_0708,
            count: 0x0a0b_0c0d,
            flags: OVERFLOW,
        };
        let b = as_bytes(std::slice::from_ref(&d));
        assert_eq!(
            b,
            &[8, 7, 6, 5, 4, 3, 2, 1, 0x0d, 0x0c, 0x0b, 0x0a, 1, 0, 0, 0]
        );
        let back: &[TileDir] = view(b).unwrap();
        assert_eq!(back, &[d]);
        assert!(matches!(
            view::<TileDir>(&b[..15]),
            Err(CompactError::View { .. })
        ));
        let s = ScatterJob {
            dst: 1,
            first: 2,
            count: 3,
            mode: SCATTER_ADD,
        };
        assert_eq!(as_bytes(std::slice::from_ref(&s)).len(), 24);
    }

    /// One 2-byte tensor of 3 tiles: a prepared build and the pool the kernel would write.
    fn one_tensor() -> (Layout, Built) {
        let l = Layout::new(&[(2 * TILE as u64 + 5, 2)]).unwrap();
        let mut b = Built::default();
        l.prepare(&mut b);
        (l, b)
    }

    const T1: NonZeroUsize = NonZeroUsize::MIN;

    #[test]
    fn collect_lists_tiles_in_tile_order_whatever_the_pool_order() {
        let (l, mut b) = one_tensor();
        // Tile 2 reserved first, then tile 0; tile 1 unchanged.
        let dir = [
            TileDir {
                offset: 1,
                count: 2,
                flags: 0,
            },
            TileDir::default(),
            TileDir {
                offset: 0,
                count: 1,
                flags: 0,
            },
        ];
        let idx = [2 * TILE as u32 + 4, 3, 7];
        let vals = [1 | 2 << 32, 5 | 6 << 32, 0xffff];
        let r = collect(&l, 2, &dir, &idx, &vals, &mut b, T1).unwrap();
        assert_eq!((r.changes, r.listed), (3, 3));
        assert!(r.forced.is_empty());
        let c = &b.segments()[0];
        assert_eq!(c.idx, vec![3, 7, 2 * TILE as u32 + 4]);
        assert_eq!(c.old_new(1, 2), (0xffff, 0));
        assert_eq!(b.changed, 3);
    }

    #[test]
    fn collect_forces_dense_on_overflow_with_the_exact_count() {
        let (l, mut b) = one_tensor();
        let dir = [
            TileDir {
                offset: 0,
                count: 1,
                flags: 0,
            },
            TileDir {
                offset: 0,
                count: 9,
                flags: OVERFLOW,
            },
            TileDir::default(),
        ];
        let r = collect(&l, 2, &dir, &[3], &[1 | 2 << 32], &mut b, T1).unwrap();
        assert_eq!(r.forced, vec![0]);
        assert_eq!(r.needs_snapshot, vec![0]);
        assert_eq!((r.changes, r.listed), (10, 0));
        assert!(b.segments()[0].forced_dense());
        assert_eq!(b.changed, 10);
    }

    #[test]
    fn collect_refuses_bad_output_without_panicking() {
        let good_dir = [
            TileDir {
                offset: 0,
                count: 1,
                flags: 0,
            },
            TileDir::default(),
            TileDir::default(),
        ];
        let cases: Vec<([TileDir; 3], Vec<u32>, Vec<u64>)> = vec![
            // Unknown flags; a count over the tile; a count over the tail tile (5 elements).
            (
                [
                    TileDir {
                        flags: 2,
                        ..good_dir[0]
                    },
                    good_dir[1],
                    good_dir[2],
                ],
                vec![3],
                vec![1 << 32],
            ),
            (
                [
                    TileDir {
                        count: TILE as u32 + 1,
                        ..good_dir[0]
                    },
                    good_dir[1],
                    good_dir[2],
                ],
                vec![3],
                vec![1 << 32],
            ),
            (
                [
                    good_dir[0],
                    good_dir[1],
                    TileDir {
                        offset: 0,
                        count: 6,
                        flags: 0,
                    },
                ],
                vec![3],
                vec![1 << 32],
            ),
            // Outside the pool, and an offset that overflows.
            (
                [
                    TileDir {
                        offset: 1,
                        ..good_dir[0]
                    },
                    good_dir[1],
                    good_dir[2],
                ],
                vec![3],
                vec![1 << 32],
            ),
            (
                [
                    TileDir {
                        offset: u64::MAX,
                        ..good_dir[0]
                    },
                    good_dir[1],
                    good_dir[2],
                ],
                vec![3],
                vec![1 << 32],
            ),
            // An index of another tile; old == new; a value wider than 2 bytes.
            (good_dir, vec![TILE as u32], vec![1 << 32]),
            (good_dir, vec![3], vec![7 | 7 << 32]),
            (good_dir, vec![3], vec![1 << 48]),
            // Indices not ascending within a tile.
            (
                [
                    TileDir {
                        offset: 0,
                        count: 2,
                        flags: 0,
                    },
                    good_dir[1],
                    good_dir[2],
                ],
                vec![5, 5],
                vec![1 << 32, 1 << 32],
            ),
        ];
        for (k, (dir, idx, vals)) in cases.into_iter().enumerate() {
            let (l, mut b) = one_tensor();
            assert!(
                collect(&l, 2, &dir, &idx, &vals, &mut b, T1).is_err(),
                "case {k}"
            );
        }
        let (l, mut b) = one_tensor();
        assert!(matches!(
            collect(&l, 2, &good_dir[..2], &[3], &[1 << 32], &mut b, T1),
            Err(CompactError::Directory { .. })
        ));
        assert!(collect(&l, 2, &good_dir, &[3], &[1 << 32], &mut b, T1).is_ok());
        assert!(matches!(
            collect(
                &l,
                2,
                &good_dir,
                &[3],
                &[1 << 32],
                &mut Built::default(),
                T1
            ),
            Err(CompactError::Unprepared { .. })
        ));
    }
}
