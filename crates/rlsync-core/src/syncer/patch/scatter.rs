//! A validated patch decoded for an install elsewhere (the GPU's `scatter` kernels): flat per-width lists of
//! (entry-relative index, value) with set or add semantics, and the dense entries' byte ranges to copy.
//!
//! Decoding follows `install_entry` exactly: gap + delta entries add the unzigzagged delta (wrapping, in the
//! element's width), COO entries set the raw value, dense entries are copied whole. Applying the plan in any
//! order gives what `install` gives: within an entry an element is written once, or again with the same value
//! (a COO entry that repeats a coordinate keeps only its last value, which a sequential install would leave,
//! and fills the slots its duplicates held by repeating that last change: a set of the same value twice).
//!
//! The shape of the lists (which entry's changes go where, how many per width) follows from the validated
//! plan alone ([`ScatterShape`]), so a device install decodes straight into its own (pinned) staging buffers,
//! entries in parallel, with no intermediate lists ([`ScatterShape::decode_into`]); [`scatter_plan`] decodes
//! into vectors the same way. The walk that decodes also checks what `validate` checks of each entry's streams
//! (every index inside the entry's range, every stream consumed exactly), so a device install of a patch whose
//! entry table alone was validated ([`PlannedPatch`]) checks and decodes in one walk
//! ([`ScatterShape::decode_checked_into`]): the staging is not the weights, and nothing is written to them
//! before every entry passed.

use std::num::NonZeroUsize;
use std::ops::Range;

use crate::bytes::{get_varint, read_uint};
use crate::syncer::wire::PatchBody;
use crate::tensor::parallel::map_items;

use super::super::wire::{IndexCoding, unzigzag};
use super::{EntryPlan, PlannedPatch, ValidPatch, gap_varint};

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
        let slot = width_slot(width)?;
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
    let Some(shape) = ScatterShape::of(p) else {
        return scatter_plan_in_runs(p, threads);
    };
    let mut lists: [(Vec<u32>, Vec<u64>); 4] = Default::default();
    for (slot, (idx, vals)) in lists.iter_mut().enumerate() {
        *idx = vec![0; shape.changes(slot)];
        *vals = vec![0; shape.changes(slot)];
    }
    let [a, b, c, d] = &mut lists;
    shape.decode_into(
        p,
        [
            (&mut a.0, &mut a.1),
            (&mut b.0, &mut b.1),
            (&mut c.0, &mut c.1),
            (&mut d.0, &mut d.1),
        ],
        threads,
    );
    let mut plan = ScatterPlan {
        dense: shape.dense,
        ..ScatterPlan::default()
    };
    for ((out, entries), (idx, vals)) in plan.widths.iter_mut().zip(shape.entries).zip(lists) {
        *out = WidthLists { entries, idx, vals };
    }
    plan
}

/// Where a validated patch's changes go in per-width scatter lists: every sparse entry one [`ScatterEntry`]
/// whose `first` is its changes' offset in its width's lists, and the dense copies. `None` from
/// [`ScatterShape::of`] when an entry spans more elements than u32 indices reach (never for rlsync's own
/// patches, whose entries are segments of 2^22 elements); [`scatter_plan`] then splits such entries in runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScatterShape {
    /// Widths 1, 2, 4, 8 bytes, in that order.
    entries: [Vec<ScatterEntry>; 4],
    dense: Vec<DenseCopy>,
}

impl ScatterShape {
    /// The shape of `p`'s scatter lists (see the type).
    pub fn of(p: &ValidPatch) -> Option<ScatterShape> {
        Self::shaped(&p.body, &p.plan)
    }

    /// The shape of the scatter lists of `p` (its streams not yet checked).
    pub fn of_planned(p: &PlannedPatch) -> Option<ScatterShape> {
        Self::shaped(&p.body, &p.plan)
    }

    fn shaped(body: &PatchBody, plan: &[EntryPlan]) -> Option<ScatterShape> {
        let mode = match body.index {
            IndexCoding::Gaps => ScatterMode::Add,
            IndexCoding::Coo => ScatterMode::Set,
        };
        let mut shape = ScatterShape {
            entries: Default::default(),
            dense: Vec::new(),
        };
        let mut next = [0usize; 4];
        for e in plan {
            if e.dense {
                shape.dense.push(dense_copy(e));
                continue;
            }
            let slot = width_slot(e.width)?;
            if e.limit.saturating_sub(e.base) > 1 << 32 {
                return None;
            }
            shape.entries[slot].push(ScatterEntry {
                ordinal: e.ordinal,
                base: e.base,
                width: e.width,
                mode,
                first: next[slot],
                count: e.nnz,
            });
            next[slot] += e.nnz;
        }
        Some(shape)
    }

    /// Changes in the lists of width slot `slot` (0..4 for 1, 2, 4, 8 bytes).
    pub fn changes(&self, slot: usize) -> usize {
        self.entries
            .get(slot)
            .and_then(|e| e.last())
            .map_or(0, |e| e.first + e.count)
    }

    /// The entries of width slot `slot`, in patch order.
    pub fn entries(&self, slot: usize) -> &[ScatterEntry] {
        self.entries.get(slot).map_or(&[], Vec::as_slice)
    }

    /// The dense entries' copies.
    pub fn dense(&self) -> &[DenseCopy] {
        &self.dense
    }

    /// Decode `p`'s sparse entries (in parallel on `threads`) into `lists`: per width slot the indices
    /// (relative to their entry's base) and values, each list exactly [`ScatterShape::changes`] long — a
    /// list of another length is left untouched with its width's entries (a caller's bug, never the patch's).
    pub fn decode_into(
        &self,
        p: &ValidPatch,
        lists: [(&mut [u32], &mut [u64]); 4],
        threads: NonZeroUsize,
    ) {
        // A validated patch: the walk need not check it (and cannot fail).
        let _ = self.decode::<false>(&p.body, &p.plan, lists, threads);
    }

    /// [`ScatterShape::decode_into`] of a patch whose streams are not checked yet (this shape from
    /// [`ScatterShape::of_planned`]), checking each entry's streams as `validate` does in the same walk: the
    /// validated patch, or the first failure's reason (the lists then hold garbage). The entries of a list of
    /// the wrong length are checked, not decoded.
    pub fn decode_checked_into(
        &self,
        p: PlannedPatch,
        lists: [(&mut [u32], &mut [u64]); 4],
        threads: NonZeroUsize,
    ) -> Result<ValidPatch, String> {
        self.decode::<true>(&p.body, &p.plan, lists, threads)?;
        Ok(p.checked())
    }

    /// Decode (and with `CHECK` check) the sparse entries of `plan` into `lists` (see the callers).
    fn decode<const CHECK: bool>(
        &self,
        body: &PatchBody,
        plan: &[EntryPlan],
        lists: [(&mut [u32], &mut [u64]); 4],
        threads: NonZeroUsize,
    ) -> Result<(), String> {
        let mut rest: [Option<(&mut [u32], &mut [u64])>; 4] = lists.map(Some);
        for (slot, r) in rest.iter_mut().enumerate() {
            let n = self.changes(slot);
            if r.as_ref()
                .is_some_and(|(i, v)| i.len() != n || v.len() != n)
            {
                *r = None;
            }
        }
        let mut work = Vec::with_capacity(plan.len());
        for e in plan.iter().filter(|e| !e.dense) {
            let out = width_slot(e.width).and_then(|slot| {
                let (idx, vals) = rest[slot].take()?;
                let (mine_i, more_i) = idx.split_at_mut(e.nnz);
                let (mine_v, more_v) = vals.split_at_mut(e.nnz);
                rest[slot] = Some((more_i, more_v));
                Some((mine_i, mine_v))
            });
            work.push((e, out));
        }
        let failures = map_items(work, threads, |(e, out)| {
            decode_entry_into::<CHECK>(body, e, out).err()
        });
        match failures.into_iter().flatten().next() {
            Some(reason) => Err(reason),
            None => Ok(()),
        }
    }
}

/// The width slot (0..4) of an element width of 1, 2, 4 or 8 bytes.
fn width_slot(width: usize) -> Option<usize> {
    [1, 2, 4, 8].iter().position(|&w| w == width)
}

/// A dense entry's copy: its element bytes in the dense stream and where they go.
fn dense_copy(e: &EntryPlan) -> DenseCopy {
    DenseCopy {
        ordinal: e.ordinal,
        base: e.base,
        width: e.width,
        bytes: e.dense_pos..e.dense_pos + e.nnz * e.width,
    }
}

/// Walk one sparse entry's changes as `install_entry` reads them: `f(entry-relative index, value)` in stream
/// order (gap-coded indices ascend strictly; COO ones may repeat or go back). Returns how many it read. With
/// `CHECK`, also the reason the entry's streams fail `validate`'s checks (`check_entry`: every index inside
/// the entry's range, every stream consumed exactly; the stream extents, a COO entry's `nnz` coordinates and
/// values among them, were checked with the entry table), found in the same walk (`f` may have seen some
/// changes of an entry that fails); without, the entry must be validated (only a truncated stream stops it).
fn for_each_change<const CHECK: bool>(
    body: &PatchBody,
    e: &EntryPlan,
    mut f: impl FnMut(usize, u64),
) -> Result<usize, String> {
    let [s0, s1, s2] = [&body.streams[0], &body.streams[1], &body.streams[2]];
    let span = (e.limit - e.base) as u64;
    match body.index {
        IndexCoding::Gaps => {
            let gaps = &s0[e.index_pos..e.index_pos + e.index_len];
            let codes = &s1[e.code_pos..e.code_pos + e.nnz.div_ceil(4)];
            let escapes = &s2[e.escape_pos..e.escape_pos + e.escape_len];
            let (mut ipos, mut epos, mut next) = (0usize, 0usize, 0u64);
            for k in 0..e.nnz {
                let g = gap_varint(gaps, &mut ipos).ok_or("truncated index stream")?;
                let at = next.wrapping_add(g);
                if CHECK && next.checked_add(g).is_none_or(|r| r >= span) {
                    return Err("index outside the entry's range".into());
                }
                next = at + 1;
                let code = (codes[k / 4] >> ((k % 4) * 2)) & 3;
                let z = if code != 0 {
                    u64::from(code)
                } else {
                    get_varint(escapes, &mut epos).ok_or("truncated escape stream")?
                };
                f(at as usize, unzigzag(z) as u64);
            }
            if !CHECK {
                return Ok(e.nnz);
            }
            if ipos != gaps.len() {
                return Err("index stream holds more data than the entry describes".into());
            }
            if !e.nnz.is_multiple_of(4) && codes.last().is_some_and(|b| b >> ((e.nnz % 4) * 2) != 0)
            {
                return Err("code stream padding is not zero".into());
            }
            if epos != escapes.len() {
                return Err("escape stream holds more data than the entry describes".into());
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
                let (r, c) = (read_uint(r), read_uint(c));
                if !CHECK {
                    let at = (r as usize * e.cols + c as usize).wrapping_sub(e.base);
                    f(at, read_uint(v));
                    continue;
                }
                if r >= e.rows as u64 || c >= e.cols as u64 {
                    return Err(format!(
                        "coordinate ({r}, {c}) outside the {}x{} view",
                        e.rows, e.cols
                    ));
                }
                let idx = r * e.cols as u64 + c;
                if idx < e.base as u64 || idx >= e.limit as u64 {
                    return Err(format!("coordinate ({r}, {c}) outside the entry's range"));
                }
                f(idx as usize - e.base, read_uint(v));
            }
        }
    }
    Ok(e.nnz)
}

/// Keep the last write of each index (a sequential install lets it win), ascending: `pairs` in stream order.
fn last_writes<I: Ord + Copy>(pairs: &mut Vec<(I, u64)>) {
    pairs.reverse();
    pairs.sort_by_key(|&(i, _)| i); // stable: the last write first among equals
    pairs.dedup_by_key(|&mut (i, _)| i);
}

/// Decode one sparse entry (span within u32 indices) into its `nnz` slots of `out`, as `install_entry`
/// applies it, with `CHECK` checking its streams in the same walk ([`for_each_change`]); without `out`, only
/// checked.
fn decode_entry_into<const CHECK: bool>(
    body: &PatchBody,
    e: &EntryPlan,
    out: Option<(&mut [u32], &mut [u64])>,
) -> Result<(), String> {
    let Some((idx, vals)) = out else {
        return for_each_change::<CHECK>(body, e, |_, _| {}).map(|_| ());
    };
    // Gap-coded indices ascend strictly (checked): only COO entries are watched for repeats.
    let coo = body.index == IndexCoding::Coo;
    let (mut ascending, mut last) = (true, None::<u32>);
    let read = {
        let mut slots = idx.iter_mut().zip(vals.iter_mut());
        for_each_change::<CHECK>(body, e, |at, v| {
            let at = at as u32; // the entry's span fits u32 (`ScatterShape::of`)
            if let Some((i, o)) = slots.next() {
                (*i, *o) = (at, v);
            }
            if coo {
                ascending &= last.is_none_or(|l| l < at);
                last = Some(at);
            }
        })?
    };
    let read = read.min(idx.len());
    // The walk read exactly `nnz` changes; were it otherwise, setting or adding 0 at index 0 of a gap entry
    // changes nothing, and a COO entry repeats its last change below.
    idx[read..].fill(0);
    vals[read..].fill(0);
    if !ascending {
        // Fill the slots of dropped repeats with the last change again (setting a value twice is setting it).
        let mut pairs: Vec<(u32, u64)> = idx[..read]
            .iter()
            .copied()
            .zip(vals[..read].iter().copied())
            .collect();
        last_writes(&mut pairs);
        let fill = pairs.last().copied().unwrap_or((0, 0));
        let unique = pairs.into_iter().chain(std::iter::repeat(fill));
        for ((i, v), (ui, uv)) in idx.iter_mut().zip(vals.iter_mut()).zip(unique) {
            (*i, *v) = (ui, uv);
        }
    }
    Ok(())
}

/// [`scatter_plan`] for patches with an entry wider than u32 indices: entries split in runs.
fn scatter_plan_in_runs(p: &ValidPatch, threads: NonZeroUsize) -> ScatterPlan {
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
            plan.dense.push(dense_copy(e));
            continue;
        }
        let (Some(d), Some(slot)) = (decoded.next(), width_slot(e.width)) else {
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
    let mut pairs: Vec<(usize, u64)> = Vec::with_capacity(e.nnz);
    // A validated patch: the walk need not check it (and cannot fail).
    let _ = for_each_change::<false>(&p.body, e, |at, v| pairs.push((at, v)));
    if !pairs.is_sorted_by(|a, b| a.0 < b.0) {
        last_writes(&mut pairs);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::syncer::patch::{Built, SnapTensor, build, encode, install, validate};
    use crate::syncer::wire::{KeyMeta, PATCH_STREAMS, PatchBody, PatchEntry, ValueCoding};
    use crate::tensor::{Class, DType, StateDict, Storage, Tensor};

    const ONE: NonZeroUsize = NonZeroUsize::MIN;

    /// Apply `plan` to `state` as the scatter kernels and dense copies would (entries in any order).
    fn apply(plan: &ScatterPlan, patch: &ValidPatch, state: &mut StateDict) {
        let keys: Vec<String> = state.keys().map(str::to_owned).collect();
        for lists in &plan.widths {
            for e in lists.entries.iter().rev() {
                let t = state.get_mut(&keys[e.ordinal]).unwrap().bytes_mut();
                for k in e.first..e.first + e.count {
                    let at = (e.base + lists.idx[k] as usize) * e.width;
                    let el = &mut t[at..at + e.width];
                    let old = read_uint(el);
                    let new = match e.mode {
                        ScatterMode::Set => lists.vals[k],
                        ScatterMode::Add => old.wrapping_add(lists.vals[k]),
                    };
                    el.copy_from_slice(&new.to_le_bytes()[..e.width]);
                }
            }
        }
        for d in &plan.dense {
            let t = state.get_mut(&keys[d.ordinal]).unwrap().bytes_mut();
            let at = d.base * d.width;
            t[at..at + d.bytes.len()].copy_from_slice(&patch.dense_stream()[d.bytes.clone()]);
        }
    }

    /// A foreign COO patch that repeats a coordinate out of order: both decoders (straight into the
    /// lists, and in runs) install what the sequential install leaves (the last write of an element wins),
    /// and the shape's lists are exactly as long as the entries' change counts.
    #[test]
    fn unsorted_coo_with_repeats_scatters_as_install_does() {
        let vals: Vec<f32> = (0..32).map(|i| i as f32).collect();
        let mut state = StateDict::new();
        state.insert(
            "w",
            Tensor::from_slice(DType::F32, &[4, 8], Class::Trainable, &vals).unwrap(),
        );
        let meta = vec![KeyMeta {
            name: "w".into(),
            dtype: DType::F32,
            shape: vec![4, 8],
        }];
        let coords = [
            (1u8, 2u8, 10.5f32),
            (0, 3, -1.0),
            (1, 2, 99.0),
            (3, 7, 7.25),
            (0, 3, 2.0),
        ];
        let body = PatchBody {
            index: IndexCoding::Coo,
            value: ValueCoding::Raw,
            index_width: 1,
            entries: vec![PatchEntry {
                ordinal: 0,
                dense: false,
                base: 0,
                nnz: coords.len() as u64,
                index_bytes: coords.len() as u64,
                escape_bytes: 0,
            }],
            streams: {
                let mut s = vec![Vec::new(); PATCH_STREAMS];
                for (r, c, v) in coords {
                    s[0].push(r);
                    s[1].push(c);
                    s[2].extend_from_slice(&v.to_le_bytes());
                }
                s
            },
        };
        let v = validate(body, &meta, &[true], &state, ONE).unwrap();
        let mut want = state.duplicate();
        install(&v, &mut want, ONE);
        assert_eq!(want.get("w").unwrap().as_slice::<f32>().unwrap()[10], 99.0);
        assert_eq!(want.get("w").unwrap().as_slice::<f32>().unwrap()[3], 2.0);
        let shape = ScatterShape::of(&v).unwrap();
        assert_eq!(shape.changes(2), coords.len());
        for plan in [scatter_plan(&v, ONE), scatter_plan_in_runs(&v, ONE)] {
            let mut got = state.duplicate();
            apply(&plan, &v, &mut got);
            assert_eq!(
                got.get("w").unwrap().bytes(),
                want.get("w").unwrap().bytes()
            );
        }
    }

    /// The two decoders give the same lists for a gap-coded patch (rlsync's own coding).
    #[test]
    fn straight_and_run_decoders_agree_on_gap_patches() {
        let n = 5000;
        let old: Vec<f32> = (0..n).map(|i| (i as f32 * 0.1).cos()).collect();
        let mut new = old.clone();
        for i in (0..n).step_by(7) {
            new[i] += 1.0;
        }
        let mut state = StateDict::new();
        state.insert(
            "w",
            Tensor::from_slice(DType::F32, &[n], Class::Trainable, &old).unwrap(),
        );
        let mut sender = StateDict::new();
        sender.insert(
            "w",
            Tensor::from_slice(DType::F32, &[n], Class::Trainable, &new).unwrap(),
        );
        let meta = vec![KeyMeta {
            name: "w".into(),
            dtype: DType::F32,
            shape: vec![n],
        }];
        let t = state.get("w").unwrap();
        let mut storage = Storage::zeroed(t.bytes().len());
        storage.bytes_mut().copy_from_slice(t.bytes());
        let mut snap = vec![SnapTensor {
            key: "w".into(),
            ordinal: 0,
            dtype: DType::F32,
            cols: t.layout().coo_view().unwrap().1,
            storage,
        }];
        let mut built = Built::default();
        build(&mut snap, &sender, ONE, &mut built).unwrap();
        let body = encode(&built, &snap, true, ONE);
        let v = validate(body, &meta, &[true], &state, ONE).unwrap();
        assert_eq!(scatter_plan(&v, ONE), scatter_plan_in_runs(&v, ONE));
        let mut got = state.duplicate();
        apply(&scatter_plan(&v, ONE), &v, &mut got);
        assert_eq!(
            got.get("w").unwrap().as_slice::<f32>().unwrap(),
            new.as_slice()
        );
    }

    /// A CPU stand-in for the CUDA installer: decodes into its (vector) staging as the installer decodes into
    /// pinned memory, then applies the lists as the scatter kernels would.
    struct StagedInstaller;

    impl crate::syncer::PatchInstaller for StagedInstaller {
        fn install(
            &self,
            patch: &ValidPatch,
            state: &mut StateDict,
            threads: NonZeroUsize,
        ) -> Result<(), crate::syncer::SyncError> {
            apply(&scatter_plan(patch, threads), patch, state);
            Ok(())
        }

        fn check_install(
            &self,
            patch: PlannedPatch,
            state: &mut StateDict,
            threads: NonZeroUsize,
        ) -> Result<ValidPatch, crate::syncer::CheckInstallError> {
            let shape = ScatterShape::of_planned(&patch).unwrap();
            let (valid, plan) = checked_decode(&shape, patch, threads);
            let valid =
                valid.map_err(|reason| crate::syncer::CheckInstallError::Rejected { reason })?;
            apply(&plan, &valid, state);
            Ok(valid)
        }
    }

    /// `shape`'s lists decoded (and checked) into fresh staging, as a plan; the checked patch.
    fn checked_decode(
        shape: &ScatterShape,
        patch: PlannedPatch,
        threads: NonZeroUsize,
    ) -> (Result<ValidPatch, String>, ScatterPlan) {
        let mut lists: [(Vec<u32>, Vec<u64>); 4] = Default::default();
        for (slot, (i, v)) in lists.iter_mut().enumerate() {
            // Garbage where the decode must write.
            *i = vec![0xdead; shape.changes(slot)];
            *v = vec![0xbeef; shape.changes(slot)];
        }
        let [a, b, c, d] = &mut lists;
        let valid = shape.decode_checked_into(
            patch,
            [
                (&mut a.0, &mut a.1),
                (&mut b.0, &mut b.1),
                (&mut c.0, &mut c.1),
                (&mut d.0, &mut d.1),
            ],
            threads,
        );
        let mut plan = ScatterPlan {
            dense: shape.dense().to_vec(),
            ..ScatterPlan::default()
        };
        for (slot, (out, (idx, vals))) in plan.widths.iter_mut().zip(lists).enumerate() {
            *out = WidthLists {
                entries: shape.entries(slot).to_vec(),
                idx,
                vals,
            };
        }
        (valid, plan)
    }

    /// A receiver state of `dtype` (rows x 40 elements) and a patch to a random change of it (segments of
    /// 256 elements, each coded sparse or dense, whichever is smaller); the receiver's metadata.
    fn random_patch(
        dtype: DType,
        rows: usize,
        density: u64,
        big: u64,
        seed: u64,
        delta: bool,
    ) -> (StateDict, Vec<KeyMeta>, PatchBody) {
        let (n, w) = (rows * 40, dtype.size_bytes());
        let mut x = seed | 1;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let old: Vec<u8> = (0..n * w).map(|_| rnd() as u8).collect();
        let mut new = old.clone();
        for el in new.chunks_exact_mut(w) {
            if rnd() % 100 >= density {
                continue;
            }
            let v = read_uint(el);
            let step = if rnd() % 100 < big {
                rnd()
            } else {
                [1, 2, u64::MAX][(rnd() % 3) as usize]
            };
            let mut nv = v.wrapping_add(step);
            if nv.to_le_bytes()[..w] == v.to_le_bytes()[..w] {
                nv ^= 1;
            }
            el.copy_from_slice(&nv.to_le_bytes()[..w]);
        }
        let shape = [rows, 40];
        let mut state = StateDict::new();
        state.insert(
            "w",
            Tensor::from_bytes(dtype, &shape, Class::Trainable, &old).unwrap(),
        );
        let mut sender = StateDict::new();
        sender.insert(
            "w",
            Tensor::from_bytes(dtype, &shape, Class::Trainable, &new).unwrap(),
        );
        let mut storage = Storage::zeroed(old.len());
        storage.bytes_mut().copy_from_slice(&old);
        let mut snap = vec![SnapTensor {
            key: "w".into(),
            ordinal: 0,
            dtype,
            cols: 40,
            storage,
        }];
        let mut built = Built::default();
        let two = NonZeroUsize::new(2).unwrap();
        super::super::build_segmented(&mut snap, &sender, two, &mut built, 256).unwrap();
        let body = super::super::encode_as(&built, &snap, delta, two, super::super::Pick::Smaller);
        let meta = vec![KeyMeta {
            name: "w".into(),
            dtype,
            shape: shape.to_vec(),
        }];
        (state, meta, body)
    }

    /// Damage `body` in one of the ways the validate tests use (0: none): a byte of a stream changed, a
    /// stream cut or lengthened, an entry's change count, base or index extent off by one, entries swapped,
    /// an entry read with the other coding.
    fn damage(body: &mut PatchBody, kind: usize, at: usize, byte: u8) {
        let n = body.entries.len();
        match kind {
            1..=3 => {
                let s = &mut body.streams[kind - 1];
                if !s.is_empty() {
                    let i = at % s.len();
                    s[i] = byte;
                }
            }
            4 => {
                let s = &mut body.streams[at % 3];
                s.truncate(s.len().saturating_sub(1 + byte as usize % 3));
            }
            5 => body.streams[at % 3].push(byte),
            6 if n > 0 => {
                let e = &mut body.entries[at % n];
                e.nnz = if byte.is_multiple_of(2) {
                    e.nnz + 1
                } else {
                    e.nnz.saturating_sub(1)
                };
            }
            7 if n > 0 => {
                let e = &mut body.entries[at % n];
                e.base = if byte.is_multiple_of(2) {
                    e.base + 1
                } else {
                    e.base.saturating_sub(1)
                };
            }
            8 if n > 0 => body.entries[at % n].index_bytes += 1,
            9 if n > 1 => body.entries.swap(at % n, (at + 1) % n),
            10 if n > 0 => body.entries[at % n].dense ^= true,
            _ => {}
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 256, ..Default::default() })]

        /// The one-walk check and decode (what a CUDA install does) accepts exactly the patches `validate`
        /// accepts, damaged or not, every coding and width; a patch it accepts decodes into exactly the staging
        /// of the two-walk path (validate, then decode) and installs as the host install does; a patch it
        /// rejects leaves the tensors untouched.
        #[test]
        fn the_checked_decode_accepts_what_validate_accepts_and_stages_the_same(
            dtype in proptest::sample::select(vec![DType::U8, DType::Bf16, DType::F32, DType::I64]),
            rows in 1usize..40,
            density in 0u64..=60,
            big in 0u64..=100,
            seed in proptest::prelude::any::<u64>(),
            delta in proptest::prelude::any::<bool>(),
            kind in 0usize..12,
            at in proptest::prelude::any::<usize>(),
            byte in proptest::prelude::any::<u8>(),
        ) {
            use crate::syncer::{CheckInstallError, PatchInstaller};
            let (state, meta, mut body) = random_patch(dtype, rows, density, big, seed, delta);
            damage(&mut body, kind, at, byte);
            let two = NonZeroUsize::new(2).unwrap();
            let old = validate(body.clone(), &meta, &[true], &state, two);
            let planned = crate::syncer::patch::plan(body.clone(), &meta, &[true], &state);
            let mut got = state.duplicate();
            let new = match planned {
                Ok(p) => StagedInstaller.check_install(p, &mut got, two).map_err(|e| match e {
                    CheckInstallError::Rejected { reason } => reason,
                    CheckInstallError::Install(e) => e.to_string(),
                }),
                Err(r) => Err(r),
            };
            proptest::prop_assert_eq!(old.is_ok(), new.is_ok(), "old {:?} new {:?}", old.as_ref().err(), new.as_ref().err());
            let Ok(old) = old else {
                proptest::prop_assert_eq!(got.get("w").unwrap().bytes(), state.get("w").unwrap().bytes(), "untouched");
                return Ok(());
            };
            let new = new.unwrap_or_else(|_| unreachable!());
            proptest::prop_assert_eq!(old.changed, new.changed);
            let mut want = state.duplicate();
            install(&old, &mut want, two);
            proptest::prop_assert_eq!(got.get("w").unwrap().bytes(), want.get("w").unwrap().bytes());
            // The staging of the one walk equals the two-walk path's.
            let shape = ScatterShape::of(&old).unwrap();
            let planned = crate::syncer::patch::plan(body, &meta, &[true], &state).unwrap();
            proptest::prop_assert_eq!(&ScatterShape::of_planned(&planned).unwrap(), &shape);
            let (checked, plan) = checked_decode(&shape, planned, two);
            proptest::prop_assert!(checked.is_ok());
            proptest::prop_assert_eq!(plan, scatter_plan(&old, two));
        }
    }
}
