//! Patch strategy kernels: the sender snapshot, the bitwise diff (build), patch coding, and validate-then-
//! install on the receiver.
//!
//! Build scans each synced tensor against the snapshot (held in the receiver's dtype) in segments of
//! [`SEGMENT`] elements (the unit of parallelism), comparing 32-element blocks with a branch-free OR of XORs
//! and only looking at single elements inside blocks that differ; changed elements update the snapshot as
//! they are found. Install validates the whole payload (every index in range, every stream exactly consumed)
//! before it writes a single byte, so a rejected patch leaves the weights untouched.

use std::num::NonZeroUsize;

use crate::tensor::parallel::map_items;
use crate::tensor::{cast_bytes, pod_slice, pod_slice_mut, DType, Pod, StateDict, Storage};

use super::wire::{
    get_uint, get_varint, narrowest_width, put_uint, put_varint, unzigzag, zigzag, IndexCoding, KeyMeta, PatchBody,
    ValueCoding,
};

/// Elements per diff work item (indices inside a segment fit in u32).
pub const SEGMENT: usize = 1 << 22;
/// Elements per comparison block.
const BLOCK: usize = 32; // fits the u32 change mask
/// Elements converted at a time when the sender's dtype differs from the receiver's.
const CAST_BLOCK: usize = 4096;

/// A bit pattern of one element width.
pub(crate) trait Word: Pod + Eq {
    fn to_u64(self) -> u64;
    fn from_u64(v: u64) -> Self;
}

macro_rules! word {
    ($t:ty) => {
        impl Word for $t {
            #[inline(always)]
            fn to_u64(self) -> u64 {
                self as u64
            }
            #[inline(always)]
            fn from_u64(v: u64) -> Self {
                v as $t
            }
        }
    };
}
word!(u8);
word!(u16);
word!(u32);
word!(u64);

/// One synced tensor of the sender's snapshot (receiver dtype).
pub struct SnapTensor {
    pub key: String,
    pub ordinal: u32,
    pub dtype: DType,
    pub cols: usize,
    pub storage: Storage,
}

/// Changed elements of one segment: indices relative to the segment start, old and new element bytes.
#[derive(Default)]
pub struct Changes {
    pub base: usize,
    pub idx: Vec<u32>,
    /// Old and new bit patterns (zero-extended).
    pub old: Vec<u64>,
    pub new: Vec<u64>,
}

/// The result of a build: per snapshot tensor, its segments' changes in order.
pub struct Built {
    pub tensors: Vec<Vec<Changes>>,
    pub changed: u64,
}

#[inline(always)]
fn diff_words<W: Word>(cur: &[W], snap: &mut [W], base: usize, out: &mut Changes) {
    let full = cur.len().min(snap.len()) / BLOCK * BLOCK;
    let (cur_blocks, cur_tail) = cur.split_at(full);
    let (snap_blocks, snap_tail) = snap.split_at_mut(full);
    for (b, (c, s)) in cur_blocks.chunks_exact(BLOCK).zip(snap_blocks.chunks_exact_mut(BLOCK)).enumerate() {
        // A compare + movemask per block (vectorised); the scalar walk only visits differing elements.
        let mut mask = 0u32;
        for j in 0..BLOCK {
            mask |= u32::from(c[j] != s[j]) << j;
        }
        while mask != 0 {
            let j = mask.trailing_zeros() as usize;
            out.idx.push((base + b * BLOCK + j) as u32);
            out.old.push(s[j].to_u64());
            out.new.push(c[j].to_u64());
            s[j] = c[j];
            mask &= mask - 1;
        }
    }
    for (j, (c, s)) in cur_tail.iter().zip(snap_tail.iter_mut()).enumerate() {
        if *c != *s {
            out.idx.push((base + full + j) as u32);
            out.old.push(s.to_u64());
            out.new.push(c.to_u64());
            *s = *c;
        }
    }
}

fn diff_same(cur: &[u8], snap: &mut [u8], width: usize, base: usize, out: &mut Changes) {
    match width {
        1 => diff_words::<u8>(cur, snap, base, out),
        2 => match (pod_slice::<u16>(cur), pod_slice_mut::<u16>(snap)) {
            (Some(c), Some(s)) => {
                let done = simd::diff_u16(c, s, base, out);
                let (c, s) = (&c[done..], &mut s[done..]);
                diff_words(c, s, base + done, out)
            }
            _ => {}
        },
        4 => match (pod_slice::<u32>(cur), pod_slice_mut::<u32>(snap)) {
            (Some(c), Some(s)) => diff_words(c, s, base, out),
            _ => {}
        },
        _ => match (pod_slice::<u64>(cur), pod_slice_mut::<u64>(snap)) {
            (Some(c), Some(s)) => diff_words(c, s, base, out),
            _ => {}
        },
    }
}

/// Explicit SIMD for the hot case (16-bit weights): 64 bytes per step, compare + movemask on AVX2.
mod simd {
    use super::Changes;

    /// Diff the leading whole blocks of 32 elements; returns how many elements were covered (0 when the CPU
    /// lacks AVX2, leaving everything to the portable kernel).
    pub fn diff_u16(cur: &[u16], snap: &mut [u16], base: usize, out: &mut Changes) -> usize {
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx2") {
                // SAFETY: AVX2 is available (checked just above).
                return unsafe { avx2::diff_u16(cur, snap, base, out) };
            }
        }
        let _ = (cur, snap, base, out);
        0
    }

    #[cfg(target_arch = "x86_64")]
    mod avx2 {
        use std::arch::x86_64::*;

        use super::Changes;

        /// # Safety
        /// The CPU must support AVX2.
        #[target_feature(enable = "avx2")]
        pub unsafe fn diff_u16(cur: &[u16], snap: &mut [u16], base: usize, out: &mut Changes) -> usize {
            let n = cur.len().min(snap.len()) / 32 * 32;
            let cp = cur.as_ptr();
            let sp = snap.as_mut_ptr();
            let mut b = 0;
            while b < n {
                // SAFETY: b + 32 <= n <= both lengths, so all four 32-byte loads are in bounds; unaligned
                // loads are used, and writes below stay at indices < n.
                unsafe {
                    let c0 = _mm256_loadu_si256(cp.add(b).cast());
                    let c1 = _mm256_loadu_si256(cp.add(b + 16).cast());
                    let s0 = _mm256_loadu_si256(sp.add(b).cast());
                    let s1 = _mm256_loadu_si256(sp.add(b + 16).cast());
                    let x = _mm256_or_si256(_mm256_xor_si256(c0, s0), _mm256_xor_si256(c1, s1));
                    if _mm256_testz_si256(x, x) == 0 {
                        // packs interleaves 64-bit chunks as (c0 lo, c1 lo, c0 hi, c1 hi): restore element order.
                        let eq = _mm256_packs_epi16(_mm256_cmpeq_epi16(c0, s0), _mm256_cmpeq_epi16(c1, s1));
                        let eq = _mm256_permute4x64_epi64::<0b11_01_10_00>(eq);
                        let mut m = !(_mm256_movemask_epi8(eq) as u32);
                        while m != 0 {
                            let i = b + m.trailing_zeros() as usize;
                            let (old, new) = (*sp.add(i), *cp.add(i));
                            out.idx.push((base + i) as u32);
                            out.old.push(u64::from(old));
                            out.new.push(u64::from(new));
                            *sp.add(i) = new;
                            m &= m - 1;
                        }
                    }
                }
                b += 32;
            }
            n
        }
    }
}

/// Diff one segment: `cur` in `from`, `snap` in `to` (converted block by block when they differ).
fn diff_segment(cur: &[u8], from: DType, snap: &mut [u8], to: DType) -> Changes {
    let mut out = Changes::default();
    let w = to.size_bytes();
    if from == to {
        diff_same(cur, snap, w, 0, &mut out);
        return out;
    }
    let mut tmp = Storage::zeroed(CAST_BLOCK * w);
    let fw = from.size_bytes();
    for (i, (c, s)) in cur.chunks(CAST_BLOCK * fw).zip(snap.chunks_mut(CAST_BLOCK * w)).enumerate() {
        let t = &mut tmp.bytes_mut()[..s.len()];
        // Dtype pairs were checked at init (floating ↔ floating), so the cast cannot fail here.
        if cast_bytes(c, from, t, to).is_ok() {
            diff_same(t, s, w, i * CAST_BLOCK, &mut out);
        }
    }
    out
}

/// Diff every synced tensor of `state` against the snapshot, updating the snapshot.
pub fn build(snap: &mut [SnapTensor], state: &StateDict, threads: NonZeroUsize) -> Result<Built, String> {
    let mut items = Vec::new();
    for (pos, st) in snap.iter_mut().enumerate() {
        let t = state.get(&st.key).ok_or_else(|| format!("key '{}' is missing from the state dict", st.key))?;
        let from = t.dtype();
        let numel = st.storage.len() / st.dtype.size_bytes();
        if t.numel() != numel {
            return Err(format!("key '{}' has {} elements, {} at init", st.key, t.numel(), numel));
        }
        let (fw, w) = (from.size_bytes(), st.dtype.size_bytes());
        let cur = t.bytes();
        for (seg, (c, s)) in cur.chunks(SEGMENT * fw).zip(st.storage.bytes_mut().chunks_mut(SEGMENT * w)).enumerate() {
            items.push((pos, seg * SEGMENT, c, from, s, st.dtype));
        }
    }
    let results = map_items(items, threads, |(pos, base, c, from, s, to)| {
        let mut ch = diff_segment(c, from, s, to);
        ch.base = base;
        (pos, ch)
    });
    let mut tensors: Vec<Vec<Changes>> = (0..snap.len()).map(|_| Vec::new()).collect();
    let mut changed = 0u64;
    for (pos, ch) in results {
        changed += ch.idx.len() as u64;
        if !ch.idx.is_empty() {
            if let Some(v) = tensors.get_mut(pos) {
                v.push(ch);
            }
        }
    }
    Ok(Built { tensors, changed })
}

fn sign_extend(v: u64, bits: u32) -> i64 {
    let shift = 64 - bits;
    ((v << shift) as i64) >> shift
}

/// Code a build into a patch body: gap varints + delta codes (`delta`), or absolute COO + raw values.
pub fn encode(built: &Built, snap: &[SnapTensor], delta: bool) -> PatchBody {
    let mut entries = Vec::new();
    if delta {
        let mut gaps = Vec::new();
        let mut codes = Vec::new();
        let mut escapes = Vec::new();
        let mut k = 0usize;
        for (st, segs) in snap.iter().zip(&built.tensors) {
            let nnz: usize = segs.iter().map(|c| c.idx.len()).sum();
            if nnz == 0 {
                continue;
            }
            entries.push((st.ordinal, nnz as u64));
            let w = st.dtype.size_bytes();
            let bits = (w * 8) as u32;
            let mask = if bits == 64 { u64::MAX } else { (1u64 << bits) - 1 };
            let mut next = 0u64; // previous index + 1
            for seg in segs {
                for (i, &rel) in seg.idx.iter().enumerate() {
                    let idx = (seg.base + rel as usize) as u64;
                    put_varint(&mut gaps, idx - next);
                    next = idx + 1;
                    let d = seg.new[i].wrapping_sub(seg.old[i]) & mask;
                    let z = zigzag(sign_extend(d, bits));
                    let code = if (1..=3).contains(&z) { z as u8 } else { 0 };
                    if k % 4 == 0 {
                        codes.push(0);
                    }
                    if let Some(last) = codes.last_mut() {
                        *last |= code << ((k % 4) * 2);
                    }
                    if code == 0 {
                        put_varint(&mut escapes, z);
                    }
                    k += 1;
                }
            }
        }
        PatchBody { index: IndexCoding::Gaps, value: ValueCoding::Delta, index_width: 0, entries, streams: vec![gaps, codes, escapes] }
    } else {
        let mut max = 0u64;
        for (st, segs) in snap.iter().zip(&built.tensors) {
            let cols = st.cols.max(1);
            for seg in segs {
                for &rel in &seg.idx {
                    let idx = seg.base + rel as usize;
                    max = max.max((idx / cols) as u64).max((idx % cols) as u64);
                }
            }
        }
        let width = narrowest_width(max);
        let (mut rows, mut cols_s, mut values) = (Vec::new(), Vec::new(), Vec::new());
        for (st, segs) in snap.iter().zip(&built.tensors) {
            let nnz: usize = segs.iter().map(|c| c.idx.len()).sum();
            if nnz == 0 {
                continue;
            }
            entries.push((st.ordinal, nnz as u64));
            let cols = st.cols.max(1);
            for seg in segs {
                for &rel in &seg.idx {
                    let idx = seg.base + rel as usize;
                    put_uint(&mut rows, (idx / cols) as u64, width);
                    put_uint(&mut cols_s, (idx % cols) as u64, width);
                }
                let w = st.dtype.size_bytes();
                for v in &seg.new {
                    values.extend_from_slice(&v.to_le_bytes()[..w]);
                }
            }
        }
        PatchBody { index: IndexCoding::Coo, value: ValueCoding::Raw, index_width: width, entries, streams: vec![rows, cols_s, values] }
    }
}

/// Where one entry's data starts in each stream (found by the validation pass).
#[derive(Debug, Clone, Copy)]
struct EntryPlan {
    ordinal: usize,
    nnz: usize,
    width: usize,
    cols: usize,
    index_pos: usize,
    value_pos: usize,
    escape_pos: usize,
}

/// A patch that passed validation against a state dict's layout; installing it cannot fail.
pub struct ValidPatch {
    body: PatchBody,
    plan: Vec<EntryPlan>,
    pub changed: u64,
}

/// Check every part of `body` against the receiver's metadata and state before anything is written.
pub fn validate(body: PatchBody, meta: &[KeyMeta], synced: &[bool], state: &StateDict) -> Result<ValidPatch, String> {
    let nstreams = body.streams.len();
    if nstreams != 3 {
        return Err(format!("expected 3 streams, found {nstreams}"));
    }
    let (s0, s1, s2) = (&body.streams[0], &body.streams[1], &body.streams[2]);
    let mut plan = Vec::with_capacity(body.entries.len());
    let (mut ipos, mut vpos, mut epos) = (0usize, 0usize, 0usize);
    let mut changed = 0u64;
    for &(ordinal, nnz) in &body.entries {
        let o = ordinal as usize;
        let m = meta.get(o).ok_or_else(|| format!("ordinal {o} is not a key of the receiver"))?;
        if !synced.get(o).copied().unwrap_or(false) {
            return Err(format!("key '{}' is not synced", m.name));
        }
        let (name, t) = state.get_index(o).ok_or_else(|| format!("key '{}' is missing from the state dict", m.name))?;
        if name != m.name || t.dtype() != m.dtype || t.shape() != m.shape.as_slice() {
            return Err(format!("state dict entry {o} ('{name}') does not match the metadata sent at init ('{}')", m.name));
        }
        let numel = t.numel();
        let nnz = usize::try_from(nnz).ok().filter(|&n| n <= numel).ok_or_else(|| format!("key '{name}': {nnz} changes for {numel} elements"))?;
        let (rows, cols) = t.layout().coo_view().unwrap_or((1, numel));
        let width = m.dtype.size_bytes();
        plan.push(EntryPlan { ordinal: o, nnz, width, cols, index_pos: ipos, value_pos: vpos, escape_pos: epos });
        match body.index {
            IndexCoding::Gaps => {
                let mut next = 0u64;
                for _ in 0..nnz {
                    let g = get_varint(s0, &mut ipos).ok_or_else(|| format!("key '{name}': truncated index stream"))?;
                    let idx = next.checked_add(g).filter(|&i| i < numel as u64).ok_or_else(|| format!("key '{name}': index out of range"))?;
                    next = idx + 1;
                }
            }
            IndexCoding::Coo => {
                let w = body.index_width;
                for i in ipos..ipos + nnz {
                    let r = get_uint(s0, i, w).ok_or_else(|| format!("key '{name}': truncated row stream"))?;
                    let c = get_uint(s1, i, w).ok_or_else(|| format!("key '{name}': truncated col stream"))?;
                    if r >= rows as u64 || c >= cols as u64 {
                        return Err(format!("key '{name}': coordinate ({r}, {c}) outside the {rows}x{cols} view"));
                    }
                }
                ipos += nnz;
            }
        }
        match body.value {
            ValueCoding::Raw => {
                vpos = vpos.checked_add(nnz * width).filter(|&v| v <= s2.len()).ok_or_else(|| format!("key '{name}': truncated value stream"))?;
            }
            ValueCoding::Delta => {
                if body.index != IndexCoding::Gaps {
                    return Err("delta values need gap-coded indices".into());
                }
                let (codes, esc) = (s1, s2);
                for k in vpos..vpos + nnz {
                    let byte = codes.get(k / 4).ok_or_else(|| format!("key '{name}': truncated code stream"))?;
                    if (byte >> ((k % 4) * 2)) & 3 == 0 {
                        get_varint(esc, &mut epos).ok_or_else(|| format!("key '{name}': truncated escape stream"))?;
                    }
                }
                vpos += nnz;
            }
        }
        changed += nnz as u64;
    }
    let consumed = match (body.index, body.value) {
        (IndexCoding::Gaps, ValueCoding::Delta) => ipos == s0.len() && vpos.div_ceil(4) == s1.len() && epos == s2.len(),
        (IndexCoding::Coo, ValueCoding::Raw) => {
            let w = usize::from(body.index_width);
            ipos * w == s0.len() && ipos * w == s1.len() && vpos == s2.len()
        }
        _ => return Err("unsupported combination of index and value coding".into()),
    };
    if !consumed {
        return Err("streams hold more data than the entries describe".into());
    }
    Ok(ValidPatch { body, plan, changed })
}

/// Write a validated patch into the state (tensors in parallel when `threads > 1`).
pub fn install(p: &ValidPatch, state: &mut StateDict, threads: NonZeroUsize) {
    let mut targets = Vec::with_capacity(p.plan.len());
    let mut plans = p.plan.iter().peekable();
    for (i, (_, t)) in state.iter_mut().enumerate() {
        if plans.peek().is_some_and(|e| e.ordinal == i) {
            if let Some(e) = plans.next() {
                targets.push((*e, t.bytes_mut()));
            }
        }
    }
    let body = &p.body;
    map_items(targets, threads, |(e, bytes)| match e.width {
        1 => install_entry::<u8>(body, &e, bytes),
        2 => install_entry::<u16>(body, &e, bytes),
        4 => install_entry::<u32>(body, &e, bytes),
        _ => install_entry::<u64>(body, &e, bytes),
    });
}

fn install_entry<W: Word>(body: &PatchBody, e: &EntryPlan, bytes: &mut [u8]) {
    let Some(dst) = pod_slice_mut::<W>(bytes) else { return };
    let (s0, s1, s2) = (&body.streams[0], &body.streams[1], &body.streams[2]);
    match (body.index, body.value) {
        (IndexCoding::Gaps, ValueCoding::Delta) => {
            let (mut ipos, mut epos) = (e.index_pos, e.escape_pos);
            let mut next = 0usize;
            for k in e.value_pos..e.value_pos + e.nnz {
                let Some(g) = get_varint(s0, &mut ipos) else { return };
                let idx = next + g as usize;
                next = idx + 1;
                let code = (s1[k / 4] >> ((k % 4) * 2)) & 3;
                let z = if code != 0 { u64::from(code) } else { get_varint(s2, &mut epos).unwrap_or(0) };
                if let Some(x) = dst.get_mut(idx) {
                    *x = W::from_u64(x.to_u64().wrapping_add(unzigzag(z) as u64));
                }
            }
        }
        _ => {
            let w = body.index_width;
            for (j, i) in (e.index_pos..e.index_pos + e.nnz).enumerate() {
                let (Some(r), Some(c)) = (get_uint(s0, i, w), get_uint(s1, i, w)) else { return };
                let idx = r as usize * e.cols + c as usize;
                let at = e.value_pos + j * e.width;
                let mut b = [0u8; 8];
                let Some(src) = s2.get(at..at + e.width) else { return };
                b[..e.width].copy_from_slice(src);
                let v = u64::from_le_bytes(b);
                if let Some(x) = dst.get_mut(idx) {
                    *x = W::from_u64(v);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::{Role, Tensor};

    fn snap_of(state: &StateDict, dtype: DType) -> Vec<SnapTensor> {
        state
            .iter()
            .enumerate()
            .map(|(i, (k, t))| {
                let mut s = Storage::zeroed(t.numel() * dtype.size_bytes());
                cast_bytes(t.bytes(), t.dtype(), s.bytes_mut(), dtype).unwrap();
                SnapTensor { key: k.into(), ordinal: i as u32, dtype, cols: t.layout().coo_view().unwrap().1, storage: s }
            })
            .collect()
    }

    #[test]
    fn diff_finds_exactly_the_changed_bits_including_nan_and_negative_zero() {
        let vals: Vec<f32> = (0..1000).map(|i| i as f32 * 0.25).collect();
        let mut sd = StateDict::new();
        sd.insert("w", Tensor::from_slice(DType::F32, &[10, 100], Role::Trainable, &vals).unwrap());
        let mut snap = snap_of(&sd, DType::F32);
        let s = sd.get_mut("w").unwrap().as_mut_slice::<f32>().unwrap();
        s[0] = -0.0; // 0.0 → -0.0: equal as floats, different bits
        s[33] = f32::NAN;
        s[999] += 1.0;
        let b = build(&mut snap, &sd, NonZeroUsize::MIN).unwrap();
        assert_eq!(b.changed, 3);
        assert_eq!(b.tensors[0][0].idx, vec![0, 33, 999]);
        assert_eq!(snap[0].storage.bytes(), sd.get("w").unwrap().bytes(), "snapshot follows the state");
        let again = build(&mut snap, &sd, NonZeroUsize::MIN).unwrap();
        assert_eq!(again.changed, 0);
    }

    #[test]
    fn encode_validate_install_roundtrip_both_codings() {
        for delta in [true, false] {
            let vals: Vec<f32> = (0..5000).map(|i| (i as f32).sin()).collect();
            let mut sender = StateDict::new();
            sender.insert("w", Tensor::from_slice(DType::F32, &[50, 100], Role::Trainable, &vals).unwrap());
            sender.insert("b", Tensor::from_slice(DType::F32, &[7], Role::Trainable, &[1.0f32; 7]).unwrap());
            let mut snap = snap_of(&sender, DType::Bf16);
            let mut receiver = StateDict::new();
            for st in &snap {
                let t = sender.get(&st.key).unwrap();
                receiver.insert(st.key.clone(), Tensor::from_bytes(DType::Bf16, t.shape(), Role::Trainable, st.storage.bytes()).unwrap());
            }
            let s = sender.get_mut("w").unwrap().as_mut_slice::<f32>().unwrap();
            for i in (0..5000).step_by(37) {
                s[i] += if i % 2 == 0 { 0.01 } else { -5.0 };
            }
            sender.get_mut("b").unwrap().as_mut_slice::<f32>().unwrap()[6] = f32::NAN;
            let b = build(&mut snap, &sender, NonZeroUsize::new(2).unwrap()).unwrap();
            let body = encode(&b, &snap, delta);
            let meta: Vec<KeyMeta> = receiver.iter().map(|(k, t)| KeyMeta { name: k.into(), dtype: t.dtype(), shape: t.shape().to_vec() }).collect();
            let v = validate(body, &meta, &[true, true], &receiver).unwrap();
            assert_eq!(v.changed, b.changed);
            install(&v, &mut receiver, NonZeroUsize::new(2).unwrap());
            for st in &snap {
                assert_eq!(receiver.get(&st.key).unwrap().bytes(), st.storage.bytes(), "delta={delta} key {}", st.key);
            }
        }
    }
}
