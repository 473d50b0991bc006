//! A validated patch decoded for an install elsewhere (the GPU's `scatter` kernels): flat per-width lists of
//! (entry-relative index, value) with set or add semantics, and the dense entries' byte ranges to copy.
//!
//! Decoding follows `install_entry` exactly: gap + delta entries add the unzigzagged delta (wrapping, in the
//! element's width), COO entries set the raw value, dense entries are copied whole. Applying the plan in any
//! order gives what `install` gives: within an entry no element appears twice (a COO entry that repeats a
//! coordinate keeps only its last value, which a sequential install would leave).

use std::num::NonZeroUsize;
use std::ops::Range;

use crate::bytes::{get_varint, read_uint};
use crate::tensor::parallel::map_items;

use super::super::wire::{IndexCoding, unzigzag};
use super::{EntryPlan, ValidPatch, gap_varint};

/// How a change is applied to its element.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScatterMode {
    /// Overwrite with the value (COO entries).
    Set,
    /// Add the value, wrapping in the element's width (delta entries).
    Add,
}

/// A run of changes to one tensor: changes `first .. first + count` of its width's lists, at elements
/// `base + idx` of the tensor with key ordinal `ordinal`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScatterEntry {
    pub ordinal: usize,
    pub base: usize,
    pub width: usize,
    pub mode: ScatterMode,
    pub first: usize,
    pub count: usize,
}

/// A dense entry: `bytes` of [`ValidPatch::dense_stream`] are the elements `base ..` of tensor `ordinal`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DenseCopy {
    pub ordinal: usize,
    pub base: usize,
    pub width: usize,
    pub bytes: Range<usize>,
}

/// The sparse changes of one element width (one `scatter` launch): entries in patch order over flat lists.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WidthLists {
    pub entries: Vec<ScatterEntry>,
    /// Element index relative to the entry's `base`.
    pub idx: Vec<u32>,
    /// The value to set, or the delta to add (zero-extended to 64 bits: only the low `width` bytes count).
    pub vals: Vec<u64>,
}

/// A validated patch decoded into per-width change lists and dense copies.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ScatterPlan {
    /// Widths 1, 2, 4, 8 bytes, in that order.
    pub widths: [WidthLists; 4],
    pub dense: Vec<DenseCopy>,
}

impl ScatterPlan {
    /// The lists of elements of `width` bytes (`None` for a width that has no kernel).
    pub fn of_width(&self, width: usize) -> Option<&WidthLists> {
        let slot = [1, 2, 4, 8].iter().position(|&w| w == width)?;
        self.widths.get(slot)
    }

    /// Changes in the sparse lists.
    pub fn changes(&self) -> usize {
        self.widths.iter().map(|w| w.idx.len()).sum()
    }
}

impl ValidPatch {
    /// The dense entries' element bytes, in entry order ([`DenseCopy::bytes`] ranges into it).
    pub fn dense_stream(&self) -> &[u8] {
        &self.body.streams[3]
    }
}

/// One sparse entry decoded: runs (base offset from the entry's base, changes) and the lists.
struct Decoded {
    runs: Vec<(usize, usize)>,
    idx: Vec<u32>,
    vals: Vec<u64>,
}

/// Decode a validated patch for a scatter install (sparse entries in parallel on `threads`).
pub fn scatter_plan(p: &ValidPatch, threads: NonZeroUsize) -> ScatterPlan {
    let body = &p.body;
    let sparse: Vec<&EntryPlan> = p.plan.iter().filter(|e| !e.dense).collect();
    let decoded = map_items(sparse, threads, |e| decode_entry(p, e));
    let mode = match body.index {
        IndexCoding::Gaps => ScatterMode::Add,
        IndexCoding::Coo => ScatterMode::Set,
    };
    let mut plan = ScatterPlan::default();
    let mut decoded = decoded.into_iter();
    for e in &p.plan {
        if e.dense {
            plan.dense.push(DenseCopy {
                ordinal: e.ordinal,
                base: e.base,
                width: e.width,
                bytes: e.dense_pos..e.dense_pos + e.nnz * e.width,
            });
            continue;
        }
        let (Some(d), Some(slot)) = (
            decoded.next(),
            [1, 2, 4, 8].iter().position(|&w| w == e.width),
        ) else {
            continue;
        };
        let lists = &mut plan.widths[slot];
        let mut first = lists.idx.len();
        for (off, count) in d.runs {
            lists.entries.push(ScatterEntry {
                ordinal: e.ordinal,
                base: e.base + off,
                width: e.width,
                mode,
                first,
                count,
            });
            first += count;
        }
        lists.idx.extend_from_slice(&d.idx);
        lists.vals.extend_from_slice(&d.vals);
    }
    plan
}

/// Decode one sparse entry as `install_entry` reads it: (entry-relative index, value) in stream order, then
/// ordered and split into runs whose indices fit u32.
fn decode_entry(p: &ValidPatch, e: &EntryPlan) -> Decoded {
    let body = &p.body;
    let [s0, s1, s2] = [&body.streams[0], &body.streams[1], &body.streams[2]];
    let mut pairs: Vec<(usize, u64)> = Vec::with_capacity(e.nnz);
    match body.index {
        IndexCoding::Gaps => {
            let gaps = &s0[e.index_pos..e.index_pos + e.index_len];
            let codes = &s1[e.code_pos..e.code_pos + e.nnz.div_ceil(4)];
            let escapes = &s2[e.escape_pos..e.escape_pos + e.escape_len];
            let (mut ipos, mut epos, mut next) = (0usize, 0usize, 0usize);
            for k in 0..e.nnz {
                let Some(g) = gap_varint(gaps, &mut ipos) else {
                    break;
                };
                let idx = next + g as usize;
                next = idx + 1;
                let code = (codes[k / 4] >> ((k % 4) * 2)) & 3;
                let z = if code != 0 {
                    u64::from(code)
                } else {
                    get_varint(escapes, &mut epos).unwrap_or(0)
                };
                pairs.push((idx, unzigzag(z) as u64));
            }
        }
        IndexCoding::Coo => {
            let (w, iw) = (e.width, usize::from(body.index_width));
            let rows = &s0[e.index_pos..e.index_pos + e.index_len];
            let cols = &s1[e.index_pos..e.index_pos + e.index_len];
            let values = &s2[e.value_pos..e.value_pos + e.nnz * w];
            for ((r, c), v) in rows
                .chunks_exact(iw)
                .zip(cols.chunks_exact(iw))
                .zip(values.chunks_exact(w))
            {
                let idx =
                    (read_uint(r) as usize * e.cols + read_uint(c) as usize).wrapping_sub(e.base);
                pairs.push((idx, read_uint(v)));
            }
            if !pairs.is_sorted_by(|a, b| a.0 < b.0) {
                // A sequential install lets the last write of an element win: keep exactly that one.
                pairs.reverse();
                pairs.sort_by_key(|&(i, _)| i); // stable: the last write first among equals
                pairs.dedup_by_key(|&mut (i, _)| i);
            }
        }
    }
    // Gap-coded indices ascend strictly (validated); an entry longer than 2^32 elements is split into runs.
    let mut d = Decoded {
        runs: Vec::new(),
        idx: Vec::with_capacity(pairs.len()),
        vals: Vec::with_capacity(pairs.len()),
    };
    let (mut run_base, mut run_len) = (0usize, 0usize);
    for (idx, v) in pairs {
        if idx - run_base > u32::MAX as usize {
            if run_len > 0 {
                d.runs.push((run_base, run_len));
            }
            (run_base, run_len) = (idx, 0);
        }
        d.idx.push((idx - run_base) as u32);
        d.vals.push(v);
        run_len += 1;
    }
    if run_len > 0 {
        d.runs.push((run_base, run_len));
    }
    d
}
