//! Patch strategy kernels: the sender snapshot, the bitwise diff (build), patch coding, and validate-then-
//! install on the receiver.
//!
//! Build scans each synced tensor against the snapshot (held in the receiver's dtype) in segments of
//! [`SEGMENT`](crate::syncer::patch::SEGMENT) elements (the unit of parallelism), comparing 32-element
//! blocks (wide SIMD compares where the CPU has them) and only looking at single elements inside blocks that
//! differ; exactly the changed elements are written into the snapshot as they are found. Install validates
//! the whole payload (every index in range, every stream exactly consumed) before it writes a single byte,
//! so a rejected patch leaves the weights untouched. A version travels as parts of whole tensors
//! ([`part_ranges`](crate::syncer::patch::part_ranges)); a receiver installing part by part keeps an
//! [`Undo`](crate::syncer::patch::Undo) of each part until the last one verified, and
//! [`roll_back`](crate::syncer::patch::roll_back) restores the weights bitwise if a later part fails.

use std::num::NonZeroUsize;

use crate::bytes::{get_varint, put_uint, read_uint};
use crate::tensor::parallel::map_items;
use crate::tensor::{DType, Pod, StateDict, Storage, cast_bytes, pod_slice, pod_slice_mut};

mod scatter;
pub use scatter::{
    DenseCopy, ScatterEntry, ScatterMode, ScatterPlan, ScatterShape, WidthLists, scatter_plan,
};

use super::wire::{
    Codec, Header, IndexCoding, KeyMeta, PATCH_STREAMS, PatchBody, PatchEntry, PatchMessage,
    PatchView, ValueCoding, get_uint, narrowest_width, patch_message, unzigzag, zigzag,
};

/// Elements per diff work item and per patch entry (indices inside a segment fit in u32).
pub(crate) const SEGMENT: usize = 1 << 22;
/// Elements per comparison block.
const BLOCK: usize = 32; // fits the u32 change mask
/// Elements converted at a time when the sender's dtype differs from the receiver's.
const CAST_BLOCK: usize = 4096;

/// A bit pattern of one element width.
pub(crate) trait Word: Pod + Eq {
    /// 8-byte words take two slots in [`Changes`].
    const WIDE: bool;
    fn to_u64(self) -> u64;
    fn from_u64(v: u64) -> Self;
}

macro_rules! word {
    ($t:ty) => {
        impl Word for $t {
            const WIDE: bool = size_of::<$t>() == 8;
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

/// Changed elements of one segment of one snapshot tensor. Buffers are kept between builds (see [`Built`]), so
/// a steady-state build allocates nothing and never page-faults fresh memory.
#[derive(Default)]
pub struct Changes {
    /// Position of the tensor in the snapshot.
    pub tensor: usize,
    /// Element offset of the segment in its tensor.
    pub base: usize,
    /// Elements in the segment.
    pub span: usize,
    /// Indices relative to the segment start.
    pub idx: Vec<u32>,
    /// Old and new bit patterns: `old | new << 32` for elements of up to 4 bytes, or two words (old, new) per
    /// change for 8-byte elements.
    vals: Vec<u64>,
    /// Set when the changes could not all be listed (the GPU's output pool overflowed): the count of changed
    /// elements; `idx` and `vals` are then empty and the encoder sends the segment dense, from the snapshot.
    forced: Option<usize>,
}

impl Changes {
    pub(crate) fn reset(&mut self, tensor: usize, base: usize, span: usize) {
        self.tensor = tensor;
        self.base = base;
        self.span = span;
        self.idx.clear();
        self.vals.clear();
        self.forced = None;
    }

    /// Number of changed elements.
    pub fn len(&self) -> usize {
        self.forced.unwrap_or(self.idx.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the segment must be sent dense (its changes were counted, not listed).
    pub fn forced_dense(&self) -> bool {
        self.forced.is_some()
    }

    /// Mark the segment forced-dense with `count` changed elements (dropping any listed changes).
    pub(crate) fn force_dense(&mut self, count: usize) {
        self.idx.clear();
        self.vals.clear();
        self.forced = Some(count);
    }

    /// The change list to fill: segment-relative indices and values as [`Changes::vals`] lays them out.
    pub(crate) fn lists_mut(&mut self) -> (&mut Vec<u32>, &mut Vec<u64>) {
        (&mut self.idx, &mut self.vals)
    }

    /// Old and new bit patterns of change `i` (zero-extended).
    #[inline(always)]
    pub(crate) fn old_new(&self, i: usize, width: usize) -> (u64, u64) {
        if width == 8 {
            (self.vals[2 * i], self.vals[2 * i + 1])
        } else {
            let v = self.vals[i];
            (v & 0xffff_ffff, v >> 32)
        }
    }

    #[inline(always)]
    fn push<W: Word>(&mut self, idx: usize, old: W, new: W) {
        self.idx.push(idx as u32);
        if W::WIDE {
            self.vals.push(old.to_u64());
            self.vals.push(new.to_u64());
        } else {
            self.vals.push(old.to_u64() | new.to_u64() << 32);
        }
    }
}

/// The result of a build: every segment's changes, in snapshot order. Keep one `Built` per sender and pass it
/// to every [`build`]: its buffers are reused.
#[derive(Default)]
pub struct Built {
    segs: Vec<Changes>,
    used: usize,
    pub changed: u64,
}

impl Built {
    /// The segments of the last build (tensor order, then element order).
    pub fn segments(&self) -> &[Changes] {
        &self.segs[..self.used]
    }

    /// Start a build of `count` segments (buffers of earlier builds are kept) and return them, to be reset
    /// and filled by the caller; `changed` is zeroed.
    pub(crate) fn start(&mut self, count: usize) -> &mut [Changes] {
        if self.segs.len() < count {
            self.segs.resize_with(count, Changes::default);
        }
        self.used = count;
        self.changed = 0;
        &mut self.segs[..count]
    }

    /// The segments of the current build, to fill.
    pub(crate) fn segments_mut(&mut self) -> &mut [Changes] {
        &mut self.segs[..self.used]
    }
}

#[inline(always)]
fn diff_words<W: Word>(cur: &[W], snap: &mut [W], base: usize, out: &mut Changes) {
    let full = cur.len().min(snap.len()) / BLOCK * BLOCK;
    let (cur_blocks, cur_tail) = cur.split_at(full);
    let (snap_blocks, snap_tail) = snap.split_at_mut(full);
    for (b, (c, s)) in cur_blocks
        .chunks_exact(BLOCK)
        .zip(snap_blocks.chunks_exact_mut(BLOCK))
        .enumerate()
    {
        // A compare + movemask per block (vectorised); the scalar walk only visits differing elements.
        let mut mask = 0u32;
        for j in 0..BLOCK {
            mask |= u32::from(c[j] != s[j]) << j;
        }
        while mask != 0 {
            let j = mask.trailing_zeros() as usize;
            out.push(base + b * BLOCK + j, s[j], c[j]);
            s[j] = c[j];
            mask &= mask - 1;
        }
    }
    for (j, (c, s)) in cur_tail.iter().zip(snap_tail.iter_mut()).enumerate() {
        if *c != *s {
            out.push(base + full + j, *s, *c);
            *s = *c;
        }
    }
}

fn diff_same(cur: &[u8], snap: &mut [u8], width: usize, base: usize, out: &mut Changes) {
    match width {
        1 => diff_wide::<u8>(cur, snap, base, out),
        2 => diff_wide::<u16>(cur, snap, base, out),
        4 => diff_wide::<u32>(cur, snap, base, out),
        _ => diff_wide::<u64>(cur, snap, base, out),
    }
}

/// The SIMD kernel over the whole blocks, the portable walk over the tail (or everything without AVX2).
#[inline(always)]
fn diff_wide<W: Word>(cur: &[u8], snap: &mut [u8], base: usize, out: &mut Changes) {
    if let (Some(c), Some(s)) = (pod_slice::<W>(cur), pod_slice_mut::<W>(snap)) {
        let done = simd::diff_blocks(c, s, base, out);
        diff_words(&c[done..], &mut s[done..], base + done, out);
    }
}

/// Explicit SIMD for the diff (32-element block masks from wide compares, for every element width: AVX-512 where
/// the CPU has it, else AVX2) and a cache prefetch hint for the install.
mod simd {
    use super::{Changes, Word};

    /// Ask for the cache line holding `p` ahead of a read-modify-write (a hint: no effect on results).
    #[inline(always)]
    pub(crate) fn prefetch<T>(p: *const T) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: prefetch is a hint; it never faults, whatever the address.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast());
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = p;
    }

    /// Diff the leading whole blocks of 32 elements; returns how many elements were covered (0 when the CPU
    /// lacks AVX2, leaving everything to the portable kernel).
    pub(crate) fn diff_blocks<W: Word>(
        cur: &[W],
        snap: &mut [W],
        base: usize,
        out: &mut Changes,
    ) -> usize {
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx512bw")
                && std::is_x86_feature_detected!("avx512vl")
                && std::is_x86_feature_detected!("avx512vbmi2")
            {
                // SAFETY: AVX-512 F/BW/VL/VBMI2 are available (checked just above).
                return unsafe { avx512::diff_blocks(cur, snap, base, out) };
            }
            if std::is_x86_feature_detected!("avx2") {
                // SAFETY: AVX2 is available (checked just above).
                return unsafe { avx2::diff_blocks(cur, snap, base, out) };
            }
        }
        let _ = (cur, snap, base, out);
        0
    }

    /// A whole-block kernel: diffs the leading whole blocks, returns the elements covered.
    #[cfg(test)]
    pub(crate) type Kernel<W> = fn(&[W], &mut [W], usize, &mut Changes) -> usize;

    /// Every whole-block kernel this CPU can run, by name (the tests hold each to the scalar reference,
    /// whichever [`diff_blocks`] would pick).
    #[cfg(test)]
    pub(crate) fn each_kernel<W: Word>() -> Vec<(&'static str, Kernel<W>)> {
        let mut all: Vec<(&'static str, Kernel<W>)> = vec![("none", |_, _, _, _| 0)];
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx2") {
                // SAFETY: listed only when the CPU has AVX2 (checked just above).
                all.push(("avx2", |c, s, b, o| unsafe {
                    avx2::diff_blocks(c, s, b, o)
                }));
            }
            if std::is_x86_feature_detected!("avx512bw")
                && std::is_x86_feature_detected!("avx512vl")
                && std::is_x86_feature_detected!("avx512vbmi2")
            {
                // SAFETY: listed only when the CPU has AVX-512 F/BW/VL/VBMI2 (checked just above).
                all.push(("avx512", |c, s, b, o| unsafe {
                    avx512::diff_blocks(c, s, b, o)
                }));
            }
        }
        all
    }

    /// Changes gathered per differing block without a data-dependent loop (at 1–3 % density a block holds one
    /// or two); the rare rest goes through a loop.
    #[cfg(target_arch = "x86_64")]
    const UNROLL: usize = 4;

    /// Bytes of each side compared per pass: a pass's stretch of both slices is still in L1 when its differing
    /// blocks are gathered, and the gap in the load stream while they are is short enough for the hardware
    /// prefetcher to keep streaming.
    #[cfg(target_arch = "x86_64")]
    const PASS_BYTES: usize = 8 << 10;

    /// Room for the blocks of one pass (1-byte elements: the most blocks per pass).
    #[cfg(target_arch = "x86_64")]
    const PASS_SLOTS: usize = PASS_BYTES / 32;

    /// Record the changes of the block at `b` (change mask `m`, not zero) as list slots `len..`: indices
    /// `base + i`, old and new patterns as [`Changes`] lays them out; the snapshot takes the new values.
    /// Exactly the changed elements are stored to, so a line without a change is never written back.
    ///
    /// # Safety
    /// `b + 32` elements must be in bounds of `cp` and `sp`; slots `len..len + 32` must be within the
    /// capacity of `ip` (and of `vp`, two slots per change for 8-byte words).
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn gather_scalar<W: Word>(
        ip: *mut u32,
        vp: *mut u64,
        len: usize,
        cp: *const W,
        sp: *mut W,
        base: usize,
        b: usize,
        mut m: u32,
    ) {
        // SAFETY: every element index is b + (0..32) and every slot len + (0..32) (a block has at most 32
        // changes, and UNROLL <= 32), in bounds by the caller's contract.
        unsafe {
            let put = |slot: usize, i: usize| {
                let (old, new) = (*sp.add(i), *cp.add(i));
                *ip.add(slot) = (base + i) as u32;
                if W::WIDE {
                    *vp.add(2 * slot) = old.to_u64();
                    *vp.add(2 * slot + 1) = new.to_u64();
                } else {
                    *vp.add(slot) = old.to_u64() | new.to_u64() << 32;
                }
                *sp.add(i) = new;
            };
            // The block's last change: once `m` runs out, the unrolled slots repeat it (its value rewritten
            // unchanged, its list entry cut off by the caller's length update), so no unchanged element is
            // ever stored to.
            let top = 1u32 << (31 - m.leading_zeros());
            for k in 0..UNROLL {
                put(len + k, b + (m | top).trailing_zeros() as usize);
                m &= m.wrapping_sub(1);
            }
            let mut k = UNROLL;
            while m != 0 {
                put(len + k, b + m.trailing_zeros() as usize);
                m &= m - 1;
                k += 1;
            }
        }
    }

    /// The two passes per stretch of [`PASS_BYTES`], so that no branch depends on the data (at 1–3 % density
    /// about a third of the blocks differ, at random: a branch per block mispredicts often): the first compares
    /// every block with `$mask` and lists the ones that differ with their change masks; the second records
    /// those blocks' changes with `$gather` (see [`gather_scalar`]). Expands to the body of an ISA's
    /// `diff_blocks` (a macro, so the kernels inline with that function's target features).
    #[cfg(target_arch = "x86_64")]
    macro_rules! two_passes {
        ($W:ty, $cur:ident, $snap:ident, $base:ident, $out:ident, $mask:path, $gather:path) => {{
            let pass_blocks = PASS_BYTES / (32 * size_of::<$W>());
            // Slots of `Changes::vals` per change.
            let per = if <$W>::WIDE { 2 } else { 1 };
            let n = $cur.len().min($snap.len()) / 32 * 32;
            let cp = $cur.as_ptr();
            let sp = $snap.as_mut_ptr();
            let (mut at, mut mask) = ([0u32; PASS_SLOTS], [0u32; PASS_SLOTS]);
            let mut start = 0;
            while start < n {
                let blocks = ((n - start) / 32).min(pass_blocks);
                let mut hits = 0usize;
                for k in 0..blocks {
                    let b = start + k * 32;
                    // SAFETY: b + 32 <= n <= both lengths, so the block is in bounds; `hits` <= k <
                    // pass_blocks <= PASS_SLOTS, so the list writes are in bounds.
                    unsafe {
                        let m = $mask(cp.add(b), sp.add(b));
                        // Always written, kept only when the block differs.
                        *at.get_unchecked_mut(hits) = b as u32;
                        *mask.get_unchecked_mut(hits) = m;
                        hits += usize::from(m != 0);
                    }
                }
                // Every listed block holds 1 to 32 changes: room for 32 each covers the slots written below.
                $out.idx.reserve(hits * 32);
                $out.vals.reserve(hits * 32 * per);
                let (mut len, ip, vp) = ($out.idx.len(), $out.idx.as_mut_ptr(), $out.vals.as_mut_ptr());
                for h in 0..hits {
                    // SAFETY: h < hits <= PASS_SLOTS; b + 32 <= n as above. `len` grows by each block's change
                    // count (<= 32), so the slots a gather writes, len + (0..32), stay within the capacity
                    // reserved above; the lengths are set to cover exactly the entries recorded.
                    unsafe {
                        let b = *at.get_unchecked(h) as usize;
                        let m = *mask.get_unchecked(h);
                        $gather(ip, vp, len, cp, sp, $base, b, m);
                        len += m.count_ones() as usize;
                    }
                }
                // SAFETY: the first `len` slots of both buffers were written above (or before this pass).
                unsafe {
                    $out.idx.set_len(len);
                    $out.vals.set_len(len * per);
                }
                start += blocks * 32;
            }
            n
        }};
    }

    #[cfg(target_arch = "x86_64")]
    mod avx2 {
        use std::arch::x86_64::*;

        use super::{Changes, PASS_BYTES, PASS_SLOTS, Word, gather_scalar};

        /// Which of the 32 elements at `c` and `s` differ (bit j: element j), compared bitwise.
        ///
        /// # Safety
        /// The CPU must support AVX2; 32 elements must be readable at both pointers.
        #[inline]
        #[target_feature(enable = "avx2")]
        unsafe fn block_mask<W: Word>(c: *const W, s: *const W) -> u32 {
            // SAFETY: (all arms) the loads cover the 32 elements the caller vouches for, 32 bytes each.
            unsafe {
                // A macro, not a closure: the loads inline with this function's target features.
                macro_rules! ld {
                    ($p:expr, $k:expr) => {
                        _mm256_loadu_si256($p.cast::<__m256i>().add($k))
                    };
                }
                match size_of::<W>() {
                    1 => !(_mm256_movemask_epi8(_mm256_cmpeq_epi8(ld!(c, 0), ld!(s, 0))) as u32),
                    2 => {
                        // packs interleaves 64-bit chunks as (lo 0, lo 1, hi 0, hi 1): restore element order.
                        let eq = _mm256_packs_epi16(
                            _mm256_cmpeq_epi16(ld!(c, 0), ld!(s, 0)),
                            _mm256_cmpeq_epi16(ld!(c, 1), ld!(s, 1)),
                        );
                        let eq = _mm256_permute4x64_epi64::<0b11_01_10_00>(eq);
                        !(_mm256_movemask_epi8(eq) as u32)
                    }
                    4 => {
                        let mut eq = 0u32;
                        for k in 0..4 {
                            let e = _mm256_cmpeq_epi32(ld!(c, k), ld!(s, k));
                            eq |= (_mm256_movemask_ps(_mm256_castsi256_ps(e)) as u32) << (8 * k);
                        }
                        !eq
                    }
                    _ => {
                        let mut eq = 0u32;
                        for k in 0..8 {
                            let e = _mm256_cmpeq_epi64(ld!(c, k), ld!(s, k));
                            eq |= (_mm256_movemask_pd(_mm256_castsi256_pd(e)) as u32) << (4 * k);
                        }
                        !eq
                    }
                }
            }
        }

        /// # Safety
        /// The CPU must support AVX2.
        #[target_feature(enable = "avx2")]
        pub(crate) unsafe fn diff_blocks<W: Word>(
            cur: &[W],
            snap: &mut [W],
            base: usize,
            out: &mut Changes,
        ) -> usize {
            two_passes!(W, cur, snap, base, out, block_mask::<W>, gather_scalar::<W>)
        }
    }

    #[cfg(target_arch = "x86_64")]
    mod avx512 {
        use std::arch::x86_64::*;

        use super::{Changes, PASS_BYTES, PASS_SLOTS, Word, gather_scalar};

        /// Which of the 32 elements at `c` and `s` differ (bit j: element j), compared bitwise.
        ///
        /// # Safety
        /// The CPU must support AVX-512 F/BW/VL; 32 elements must be readable at both pointers.
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
        unsafe fn block_mask<W: Word>(c: *const W, s: *const W) -> u32 {
            // SAFETY: (all arms) the loads cover the 32 elements the caller vouches for.
            unsafe {
                macro_rules! ld {
                    ($p:expr, $k:expr) => {
                        _mm512_loadu_si512($p.cast::<__m512i>().add($k))
                    };
                }
                match size_of::<W>() {
                    1 => _mm256_cmpneq_epi8_mask(
                        _mm256_loadu_si256(c.cast()),
                        _mm256_loadu_si256(s.cast()),
                    ),
                    2 => _mm512_cmpneq_epi16_mask(ld!(c, 0), ld!(s, 0)),
                    4 => {
                        let lo = _mm512_cmpneq_epi32_mask(ld!(c, 0), ld!(s, 0));
                        let hi = _mm512_cmpneq_epi32_mask(ld!(c, 1), ld!(s, 1));
                        u32::from(lo) | u32::from(hi) << 16
                    }
                    _ => {
                        let mut m = 0u32;
                        for k in 0..4 {
                            m |= u32::from(_mm512_cmpneq_epi64_mask(ld!(c, k), ld!(s, k)))
                                << (8 * k);
                        }
                        m
                    }
                }
            }
        }

        /// [`gather`] for 32-bit words: each half block of 16 by compress (positions, old and new values packed
        /// to the front), positions stored 16 at a time and values widened 8 at a time, the half's new values
        /// stored into the snapshot masked to its changed elements.
        ///
        /// # Safety
        /// As [`gather`].
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
        #[allow(clippy::too_many_arguments)]
        unsafe fn gather_32(
            ip: *mut u32,
            vp: *mut u64,
            mut len: usize,
            cp: *const u32,
            sp: *mut u32,
            base: usize,
            b: usize,
            m: u32,
        ) {
            // SAFETY: the loads and masked stores cover elements b + (0..32), in bounds by the contract. The
            // first half writes slots len + (0..16), the second len + c0 + (0..16) with c0 <= 16 the first
            // half's changes: all within len + (0..32).
            unsafe {
                let iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
                // Eight (old, new) pairs as `Changes::vals` lays them out (a macro: inlined with this
                // function's target features).
                macro_rules! pair {
                    ($o:expr, $n:expr $(,)?) => {
                        _mm512_or_si512(
                            _mm512_cvtepu32_epi64($o),
                            _mm512_slli_epi64::<32>(_mm512_cvtepu32_epi64($n)),
                        )
                    };
                }
                for h in 0..2 {
                    let mh = (m >> (16 * h)) as u16;
                    let at = b + 16 * h;
                    let cv = _mm512_loadu_si512(cp.add(at).cast());
                    let sv = _mm512_loadu_si512(sp.add(at).cast());
                    let new = _mm512_maskz_compress_epi32(mh, cv);
                    let old = _mm512_maskz_compress_epi32(mh, sv);
                    let pos = _mm512_maskz_compress_epi32(mh, iota);
                    _mm512_storeu_si512(
                        ip.add(len).cast(),
                        _mm512_add_epi32(pos, _mm512_set1_epi32((base + at) as i32)),
                    );
                    _mm512_storeu_si512(
                        vp.add(len).cast(),
                        pair!(_mm512_castsi512_si256(old), _mm512_castsi512_si256(new)),
                    );
                    let count = mh.count_ones() as usize;
                    if count > 8 {
                        _mm512_storeu_si512(
                            vp.add(len + 8).cast(),
                            pair!(
                                _mm512_extracti64x4_epi64::<1>(old),
                                _mm512_extracti64x4_epi64::<1>(new),
                            ),
                        );
                    }
                    _mm512_mask_storeu_epi32(sp.add(at).cast(), mh, cv);
                    len += count;
                }
            }
        }

        /// [`gather_scalar`], with 16-bit words (and 32-bit ones, see [`gather_32`]) gathered by compress: the block's changed positions, old and
        /// new values packed to the front of a register each, then widened into the lists 8 changes at a time;
        /// the snapshot takes the new values by a store masked to exactly the changed elements.
        ///
        /// # Safety
        /// The CPU must support AVX-512 F/BW/VL/VBMI2; otherwise as [`gather_scalar`].
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2")]
        #[allow(clippy::too_many_arguments)]
        unsafe fn gather<W: Word>(
            ip: *mut u32,
            vp: *mut u64,
            len: usize,
            cp: *const W,
            sp: *mut W,
            base: usize,
            b: usize,
            m: u32,
        ) {
            if size_of::<W>() == 4 {
                // SAFETY: the caller's contract is gather_32's.
                unsafe { gather_32(ip, vp, len, cp.cast(), sp.cast(), base, b, m) };
                return;
            }
            if size_of::<W>() != 2 {
                // SAFETY: the caller's contract is gather_scalar's.
                unsafe { gather_scalar(ip, vp, len, cp, sp, base, b, m) };
                return;
            }
            // SAFETY: the loads and the masked store cover elements b + (0..32), in bounds by the contract;
            // the list stores cover slots len + 8 * (0..ceil(count / 8)), within len + (0..32).
            unsafe {
                let (c, s) = (cp.add(b).cast::<u16>(), sp.add(b).cast::<u16>());
                let cv = _mm512_loadu_si512(c.cast());
                let sv = _mm512_loadu_si512(s.cast());
                let iota = _mm512_set_epi16(
                    31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12,
                    11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0,
                );
                let new = _mm512_maskz_compress_epi16(m, cv);
                let old = _mm512_maskz_compress_epi16(m, sv);
                let pos = _mm512_maskz_compress_epi16(m, iota);
                let at = _mm256_set1_epi32((base + b) as i32);
                let count = m.count_ones() as usize;
                // Eight changes per step: the first step always (a block that differs has one), the rest
                // only for crowded blocks.
                macro_rules! eight {
                    ($k:literal) => {{
                        let p = _mm512_extracti32x4_epi32::<$k>(pos);
                        let o = _mm512_extracti32x4_epi32::<$k>(old);
                        let v = _mm512_extracti32x4_epi32::<$k>(new);
                        _mm256_storeu_si256(
                            ip.add(len + 8 * $k).cast(),
                            _mm256_add_epi32(_mm256_cvtepu16_epi32(p), at),
                        );
                        _mm512_storeu_si512(
                            vp.add(len + 8 * $k).cast(),
                            _mm512_or_si512(
                                _mm512_cvtepu16_epi64(o),
                                _mm512_slli_epi64::<32>(_mm512_cvtepu16_epi64(v)),
                            ),
                        );
                    }};
                }
                eight!(0);
                if count > 8 {
                    eight!(1);
                    if count > 16 {
                        eight!(2);
                        if count > 24 {
                            eight!(3);
                        }
                    }
                }
                _mm512_mask_storeu_epi16(sp.add(b).cast(), m, cv);
            }
        }

        /// # Safety
        /// The CPU must support AVX-512 F/BW/VL/VBMI2.
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2")]
        pub(crate) unsafe fn diff_blocks<W: Word>(
            cur: &[W],
            snap: &mut [W],
            base: usize,
            out: &mut Changes,
        ) -> usize {
            two_passes!(W, cur, snap, base, out, block_mask::<W>, gather::<W>)
        }
    }
}

/// Diff one segment: `cur` in `from`, `snap` in `to` (converted block by block when they differ).
fn diff_segment(cur: &[u8], from: DType, snap: &mut [u8], to: DType, out: &mut Changes) {
    let w = to.size_bytes();
    if from == to {
        diff_same(cur, snap, w, 0, out);
        return;
    }
    let mut tmp = Storage::zeroed(CAST_BLOCK * w);
    let fw = from.size_bytes();
    for (i, (c, s)) in cur
        .chunks(CAST_BLOCK * fw)
        .zip(snap.chunks_mut(CAST_BLOCK * w))
        .enumerate()
    {
        let t = &mut tmp.bytes_mut()[..s.len()];
        // Dtype pairs were checked at init (floating ↔ floating), so the cast cannot fail here.
        if cast_bytes(c, from, t, to).is_ok() {
            diff_same(t, s, w, i * CAST_BLOCK, out);
        }
    }
}

/// Diff every synced tensor of `state` against the snapshot, updating the snapshot; the changes land in
/// `built` (its buffers are reused).
pub fn build(
    snap: &mut [SnapTensor],
    state: &StateDict,
    threads: NonZeroUsize,
    built: &mut Built,
) -> Result<(), String> {
    build_segmented(snap, state, threads, built, SEGMENT)
}

/// [`build`] with segments of `segment` elements (a multiple of the comparison block, at most 2^32).
fn build_segmented(
    snap: &mut [SnapTensor],
    state: &StateDict,
    threads: NonZeroUsize,
    built: &mut Built,
    segment: usize,
) -> Result<(), String> {
    const { assert!(SEGMENT.is_multiple_of(BLOCK) && SEGMENT <= 1 << 32) };
    debug_assert!(segment.is_multiple_of(BLOCK) && segment <= 1 << 32);
    let mut work = Vec::new();
    for (pos, st) in snap.iter_mut().enumerate() {
        let t = state
            .get(&st.key)
            .ok_or_else(|| format!("key '{}' is missing from the state dict", st.key))?;
        let numel = st.storage.len() / st.dtype.size_bytes();
        if t.numel() != numel {
            return Err(format!(
                "key '{}' has {} elements, {} at init",
                st.key,
                t.numel(),
                numel
            ));
        }
        let (fw, w) = (t.dtype().size_bytes(), st.dtype.size_bytes());
        for (seg, (c, s)) in t
            .bytes()
            .chunks(segment * fw)
            .zip(st.storage.bytes_mut().chunks_mut(segment * w))
            .enumerate()
        {
            let span = s.len() / w;
            work.push((pos, seg * segment, c, t.dtype(), s, st.dtype, span));
        }
    }
    let segs = built.start(work.len());
    let items: Vec<_> = work.into_iter().zip(segs.iter_mut()).collect();
    map_items(
        items,
        threads,
        |((pos, base, c, from, s, to, span), out)| {
            out.reset(pos, base, span);
            diff_segment(c, from, s, to, out);
        },
    );
    built.changed = built.segments().iter().map(|c| c.len() as u64).sum();
    Ok(())
}

/// Bytes of snapshot per patch part: a version travels as parts of whole tensors of about this much state
/// (see [`part_ranges`]), each built, coded and sent while receivers install the parts before it.
pub(crate) const PART_STATE_BYTES: usize = 64 << 20;

/// The snapshot split into consecutive runs of whole tensors holding about `part_bytes` each (at least one
/// run, empty for an empty snapshot).
pub(crate) fn part_ranges(snap: &[SnapTensor], part_bytes: usize) -> Vec<std::ops::Range<usize>> {
    let mut parts = Vec::new();
    let (mut start, mut bytes) = (0usize, 0usize);
    for (i, st) in snap.iter().enumerate() {
        bytes += st.storage.len();
        if bytes >= part_bytes {
            parts.push(start..i + 1);
            (start, bytes) = (i + 1, 0);
        }
    }
    if start < snap.len() || parts.is_empty() {
        parts.push(start..snap.len());
    }
    parts
}

/// What [`build`] checks of each key before it diffs any (present, as many elements as at init), for the whole
/// snapshot at once: a version built part by part must not fail after its first parts went out.
pub(crate) fn check_sources(snap: &[SnapTensor], state: &StateDict) -> Result<(), String> {
    for st in snap {
        let t = state
            .get(&st.key)
            .ok_or_else(|| format!("key '{}' is missing from the state dict", st.key))?;
        let numel = st.storage.len() / st.dtype.size_bytes();
        if t.numel() != numel {
            return Err(format!(
                "key '{}' has {} elements, {} at init",
                st.key,
                t.numel(),
                numel
            ));
        }
    }
    Ok(())
}

/// One entry's coded streams (gaps/codes/escapes, or rows/cols/values; then dense values).
struct Coded {
    entry: PatchEntry,
    streams: [Vec<u8>; PATCH_STREAMS],
}

/// Code a build into a patch body: gap varints + delta codes (`delta`), or absolute COO + raw values. Each
/// non-empty segment becomes one entry, coded in parallel: sparse, or dense (the segment's new bytes, from the
/// snapshot the build just updated) where that is no larger.
pub fn encode(built: &Built, snap: &[SnapTensor], delta: bool, threads: NonZeroUsize) -> PatchBody {
    encode_as(built, snap, delta, threads, Pick::Smaller)
}

/// How [`encode_as`] codes each segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(test), allow(dead_code))]
enum Pick {
    /// The smaller of sparse and dense (dense on a tie).
    Smaller,
    Sparse,
    Dense,
}

/// [`encode`] serialized straight into a message with `header` (its streams gathered from the entries as
/// coded, never joined into a [`PatchBody`] first); also returns the number of entries and of dense ones.
pub fn encode_message(
    built: &Built,
    snap: &[SnapTensor],
    delta: bool,
    threads: NonZeroUsize,
    header: Header,
    codec: Codec,
) -> (PatchMessage, usize, u64) {
    let (index, value, index_width, coded) =
        code_segments(built, snap, delta, threads, Pick::Smaller);
    let entries: Vec<PatchEntry> = coded.iter().map(|c| c.entry).collect();
    let view = PatchView {
        index,
        value,
        index_width,
        entries: &entries,
        streams: (0..PATCH_STREAMS)
            .map(|i| coded.iter().map(|c| c.streams[i].as_slice()).collect())
            .collect(),
    };
    let dense = entries.iter().filter(|e| e.dense).count() as u64;
    (patch_message(header, &view, codec), entries.len(), dense)
}

fn encode_as(
    built: &Built,
    snap: &[SnapTensor],
    delta: bool,
    threads: NonZeroUsize,
    pick: Pick,
) -> PatchBody {
    let (index, value, index_width, coded) = code_segments(built, snap, delta, threads, pick);
    let mut streams: [Vec<u8>; PATCH_STREAMS] = Default::default();
    for (i, s) in streams.iter_mut().enumerate() {
        s.reserve_exact(coded.iter().map(|c| c.streams[i].len()).sum());
    }
    let mut entries = Vec::with_capacity(coded.len());
    for c in coded {
        entries.push(c.entry);
        for (dst, src) in streams.iter_mut().zip(&c.streams) {
            dst.extend_from_slice(src);
        }
    }
    PatchBody {
        index,
        value,
        index_width,
        entries,
        streams: streams.into(),
    }
}

/// Code every non-empty segment of a build as one entry (in parallel), as `pick` says.
fn code_segments(
    built: &Built,
    snap: &[SnapTensor],
    delta: bool,
    threads: NonZeroUsize,
    pick: Pick,
) -> (IndexCoding, ValueCoding, u8, Vec<Coded>) {
    let segs: Vec<(&SnapTensor, &Changes)> = built
        .segments()
        .iter()
        .filter(|c| !c.is_empty())
        .filter_map(|c| Some((snap.get(c.tensor)?, c)))
        .collect();
    let (index, value, width) = if delta {
        (IndexCoding::Gaps, ValueCoding::Delta, 0)
    } else {
        let max = map_items(segs.clone(), threads, |(st, c)| coo_max(st, c))
            .into_iter()
            .max()
            .unwrap_or(0);
        (IndexCoding::Coo, ValueCoding::Raw, narrowest_width(max))
    };
    let coded = map_items(segs, threads, |(st, c)| {
        let dense_bytes = c.span * st.dtype.size_bytes();
        // A sparse coding takes at least a byte per change (a gap varint, or COO coordinates and value), so a
        // segment whose changes alone outweigh it goes dense without being coded twice. A forced-dense
        // segment has no change list to code.
        if pick == Pick::Dense
            || c.forced_dense()
            || pick == Pick::Smaller && c.len() >= dense_bytes
        {
            return code_dense(st, c);
        }
        let sparse = if delta {
            code_delta(st, c)
        } else {
            code_coo(st, c, width)
        };
        if pick == Pick::Smaller
            && sparse.streams.iter().map(Vec::len).sum::<usize>() >= dense_bytes
        {
            code_dense(st, c)
        } else {
            sparse
        }
    });
    (index, value, width, coded)
}

/// The most bytes a sparse coding spends on one change: a COO change (two coordinates of up to 8 bytes and a
/// value of up to 8) or a delta change (a gap varint of up to 4 bytes, a quarter code byte, an escape of up
/// to 10).
const SPARSE_MAX_PER_CHANGE: usize = 24;

impl Changes {
    /// Whether [`encode`] may code this segment dense, reading its new values from the snapshot: it is forced
    /// dense, or its changes could make a sparse coding as large as the segment's `width`-byte elements.
    pub fn may_code_dense(&self, width: usize) -> bool {
        self.forced_dense()
            || self.len().saturating_mul(SPARSE_MAX_PER_CHANGE) >= self.span.saturating_mul(width)
    }
}

/// Largest row or column of a segment's changes in the tensor's COO view (0 for a forced-dense segment,
/// which lists none).
fn coo_max(st: &SnapTensor, c: &Changes) -> u64 {
    let cols = st.cols.max(1);
    let (first, last) = match (c.idx.first(), c.idx.last()) {
        (Some(&f), Some(&l)) => (c.base + f as usize, c.base + l as usize),
        _ => return 0,
    };
    // Indices ascend, so the last one has the largest row; a single-row span bounds the columns directly.
    let col_max = if first / cols == last / cols {
        last % cols
    } else {
        cols - 1
    };
    ((last / cols) as u64).max(col_max as u64)
}

/// The segment's elements as they now are (the snapshot holds the new values in the receiver's dtype).
fn code_dense(st: &SnapTensor, c: &Changes) -> Coded {
    let w = st.dtype.size_bytes();
    let bytes = st.storage.bytes()[c.base * w..(c.base + c.span) * w].to_vec();
    Coded {
        entry: PatchEntry {
            ordinal: st.ordinal,
            dense: true,
            base: c.base as u64,
            nnz: c.span as u64,
            index_bytes: 0,
            escape_bytes: 0,
        },
        streams: [Vec::new(), Vec::new(), Vec::new(), bytes],
    }
}

fn code_delta(st: &SnapTensor, c: &Changes) -> Coded {
    match st.dtype.size_bytes() {
        1 => code_delta_width::<1>(st, c),
        2 => code_delta_width::<2>(st, c),
        4 => code_delta_width::<4>(st, c),
        _ => code_delta_width::<8>(st, c),
    }
}

/// [`code_delta`] for elements of `W` bytes (the width a constant: the sign extension and the old/new layout
/// of [`Changes`] need no per-change branch or variable shift).
fn code_delta_width<const W: usize>(st: &SnapTensor, c: &Changes) -> Coded {
    // Moving a W-byte difference to the top and back sign-extends it (W = 8: no shift).
    let shift = 64 - 8 * W as u32;
    let n = c.len();
    let mut gaps = Vec::with_capacity(n + n / 4 + 16);
    let mut codes = vec![0u8; n.div_ceil(4)];
    let mut escapes = Vec::new();
    // Each chunk's varints go into fixed buffers first (no capacity check per byte), whole 2-byte words at a
    // time: a gap or escape below 2^14 is written branch-free, its length decided by arithmetic.
    let (mut gbuf, mut ebuf) = ([0u8; CODE_CHUNK * 10], [0u8; CODE_CHUNK * 10]);
    let mut next = 0u64; // previous relative index + 1
    for (ci, (idx, codes)) in c
        .idx
        .chunks(CODE_CHUNK)
        .zip(codes.chunks_mut(CODE_CHUNK / 4))
        .enumerate()
    {
        let (mut gp, mut ep) = (0usize, 0usize);
        // Four changes fill one code byte.
        for (q, (four, code)) in idx.chunks(4).zip(codes.iter_mut()).enumerate() {
            let mut byte = 0u8;
            for (r, &rel) in four.iter().enumerate() {
                let k = ci * CODE_CHUNK + q * 4 + r;
                let rel = u64::from(rel);
                gp += put_short_varint(&mut gbuf[gp..], rel - next, true);
                next = rel + 1;
                let (old, new) = if W == 8 {
                    (c.vals[2 * k], c.vals[2 * k + 1])
                } else {
                    let v = c.vals[k];
                    (v & 0xffff_ffff, v >> 32)
                };
                let z = zigzag(((new.wrapping_sub(old) << shift) as i64) >> shift);
                let coded = (1..=3).contains(&z);
                byte |= (if coded { z as u8 } else { 0 }) << (r * 2);
                ep += put_short_varint(&mut ebuf[ep..], z, !coded);
            }
            *code = byte;
        }
        gaps.extend_from_slice(&gbuf[..gp]);
        escapes.extend_from_slice(&ebuf[..ep]);
    }
    let entry = PatchEntry {
        ordinal: st.ordinal,
        dense: false,
        base: c.base as u64,
        nnz: n as u64,
        index_bytes: gaps.len() as u64,
        escape_bytes: escapes.len() as u64,
    };
    Coded {
        entry,
        streams: [gaps, codes, escapes, Vec::new()],
    }
}

/// Changes coded per chunk by [`code_delta`] (a multiple of 4: a chunk fills whole code bytes).
const CODE_CHUNK: usize = 256;

/// Write `v` as a varint at the start of `out` (room for 10 bytes) and return its length, or 0 when `keep` is
/// false (the bytes written are then garbage the next write overwrites). Values below 2^14, nearly all gaps
/// and escapes, take no data-dependent branch.
#[inline(always)]
fn put_short_varint(out: &mut [u8], v: u64, keep: bool) -> usize {
    if v < 1 << 14 {
        let two = u16::from(v >= 0x80);
        let word = (v as u16 & 0x7f) | two << 7 | ((v >> 7) as u16) << 8;
        if let Some(o) = out.get_mut(..2) {
            o.copy_from_slice(&word.to_le_bytes());
        }
        usize::from(keep) * (1 + usize::from(two))
    } else if keep {
        let mut len = 0;
        let mut v = v;
        while v >= 0x80 {
            if let Some(o) = out.get_mut(len) {
                *o = (v as u8) | 0x80;
            }
            v >>= 7;
            len += 1;
        }
        if let Some(o) = out.get_mut(len) {
            *o = v as u8;
        }
        len + 1
    } else {
        0
    }
}

fn code_coo(st: &SnapTensor, c: &Changes, width: u8) -> Coded {
    let cols = st.cols.max(1);
    let w = st.dtype.size_bytes();
    let n = c.len();
    let (mut rows, mut cols_s) = (
        Vec::with_capacity(n * usize::from(width)),
        Vec::with_capacity(n * usize::from(width)),
    );
    let mut values = Vec::with_capacity(n * w);
    for (k, &rel) in c.idx.iter().enumerate() {
        let idx = c.base + rel as usize;
        put_uint(&mut rows, (idx / cols) as u64, width);
        put_uint(&mut cols_s, (idx % cols) as u64, width);
        // In place of `put_uint`: the element width is a usize here, and this loop is the COO coder's
        // hottest (measured: the u8 width's conversion costs it 5-10 %).
        values.extend_from_slice(&c.old_new(k, w).1.to_le_bytes()[..w]);
    }
    let entry = PatchEntry {
        ordinal: st.ordinal,
        dense: false,
        base: c.base as u64,
        nnz: n as u64,
        index_bytes: rows.len() as u64,
        escape_bytes: 0,
    };
    Coded {
        entry,
        streams: [rows, cols_s, values, Vec::new()],
    }
}

/// Where one entry's data lies (found by the validation pass) and the element range it may touch.
#[derive(Debug, Clone, Copy)]
struct EntryPlan {
    ordinal: usize,
    dense: bool,
    /// Element range `base..limit` of the tensor (up to the next entry of the same tensor).
    base: usize,
    limit: usize,
    nnz: usize,
    width: usize,
    cols: usize,
    rows: usize,
    index_pos: usize,
    index_len: usize,
    code_pos: usize,
    value_pos: usize,
    escape_pos: usize,
    escape_len: usize,
    dense_pos: usize,
}

/// A patch that passed validation against a state dict's layout; installing it cannot fail.
pub struct ValidPatch {
    body: PatchBody,
    plan: Vec<EntryPlan>,
    /// Elements the patch writes (the changes of sparse entries, every element of dense ones).
    pub changed: u64,
}

impl ValidPatch {
    /// The ordinals of the tensors the patch writes, in entry order (a tensor with several entries repeats).
    pub(crate) fn ordinals(&self) -> impl Iterator<Item = usize> + '_ {
        self.plan.iter().map(|e| e.ordinal)
    }
}

/// Check every part of `body` against the receiver's metadata and state before anything is written: the entry
/// table first (ranges, stream extents), then each entry's streams (in parallel when `threads > 1`).
pub fn validate(
    body: PatchBody,
    meta: &[KeyMeta],
    synced: &[bool],
    state: &StateDict,
    threads: NonZeroUsize,
) -> Result<ValidPatch, String> {
    plan(body, meta, synced, state)?.check(threads)
}

/// A patch whose entry table passed validation against a state dict's layout (ordinals, ranges, stream
/// extents), its streams not yet: [`PlannedPatch::check`] checks them (the rest of [`validate`]), or a
/// device install checks them in the walk that decodes them into its staging
/// ([`ScatterShape::decode_checked_into`]).
pub struct PlannedPatch {
    body: PatchBody,
    plan: Vec<EntryPlan>,
}

/// The first half of [`validate`]: the stream count and the entry table.
pub fn plan(
    body: PatchBody,
    meta: &[KeyMeta],
    synced: &[bool],
    state: &StateDict,
) -> Result<PlannedPatch, String> {
    if body.streams.len() != PATCH_STREAMS {
        return Err(format!(
            "expected {PATCH_STREAMS} streams, found {}",
            body.streams.len()
        ));
    }
    let plan = plan_entries(&body, meta, synced, state)?;
    Ok(PlannedPatch { body, plan })
}

impl PlannedPatch {
    /// The ordinals of the tensors the patch writes, in entry order (a tensor with several entries repeats).
    pub(crate) fn ordinals(&self) -> impl Iterator<Item = usize> + '_ {
        self.plan.iter().map(|e| e.ordinal)
    }

    /// The second half of [`validate`]: each entry's streams (in parallel when `threads > 1`).
    pub fn check(self, threads: NonZeroUsize) -> Result<ValidPatch, String> {
        let failures = map_items(self.plan.iter().collect(), threads, |e| {
            check_entry(&self.body, e).err()
        });
        if let Some(reason) = failures.into_iter().flatten().next() {
            return Err(reason);
        }
        Ok(self.checked())
    }

    /// The patch, every entry's streams having been checked (by [`PlannedPatch::check`] or the checked walk).
    fn checked(self) -> ValidPatch {
        let changed = self.plan.iter().map(|e| e.nnz as u64).sum();
        ValidPatch {
            body: self.body,
            plan: self.plan,
            changed,
        }
    }
}

fn plan_entries(
    body: &PatchBody,
    meta: &[KeyMeta],
    synced: &[bool],
    state: &StateDict,
) -> Result<Vec<EntryPlan>, String> {
    let coo = match (body.index, body.value) {
        (IndexCoding::Gaps, ValueCoding::Delta) => false,
        (IndexCoding::Coo, ValueCoding::Raw) => true,
        _ => return Err("unsupported combination of index and value coding".into()),
    };
    let iw = usize::from(body.index_width);
    if coo && ![1, 2, 4, 8].contains(&iw) {
        return Err(format!("index width {iw}"));
    }
    let mut plan: Vec<EntryPlan> = Vec::with_capacity(body.entries.len());
    let (mut ipos, mut cpos, mut vpos, mut epos, mut dpos) =
        (0usize, 0usize, 0usize, 0usize, 0usize);
    for (i, e) in body.entries.iter().enumerate() {
        let o = e.ordinal as usize;
        let m = meta
            .get(o)
            .ok_or_else(|| format!("ordinal {o} is not a key of the receiver"))?;
        if !synced.get(o).copied().unwrap_or(false) {
            return Err(format!("key '{}' is not synced", m.name));
        }
        let (name, t) = state
            .get_index(o)
            .ok_or_else(|| format!("key '{}' is missing from the state dict", m.name))?;
        if name != m.name || t.dtype() != m.dtype || t.shape() != m.shape.as_slice() {
            return Err(format!(
                "state dict entry {o} ('{name}') does not match the metadata sent at init ('{}')",
                m.name
            ));
        }
        let numel = t.numel();
        let limit = match body.entries.get(i + 1) {
            Some(next) if next.ordinal == e.ordinal => {
                usize::try_from(next.base).unwrap_or(usize::MAX).min(numel)
            }
            _ => numel,
        };
        let base = usize::try_from(e.base)
            .ok()
            .filter(|&b| b <= limit)
            .ok_or_else(|| {
                format!(
                    "key '{name}': entry at element {} outside 0..{limit}",
                    e.base
                )
            })?;
        let nnz = usize::try_from(e.nnz)
            .ok()
            .filter(|&n| n <= limit - base)
            .ok_or_else(|| {
                format!(
                    "key '{name}': {} changes for {} elements",
                    e.nnz,
                    limit - base
                )
            })?;
        let width = m.dtype.size_bytes();
        let (rows, cols) = t.layout().coo_view().unwrap_or((1, numel));
        let index_len = usize::try_from(e.index_bytes)
            .map_err(|_| format!("key '{name}': index stream extent overflows"))?;
        let escape_len = usize::try_from(e.escape_bytes)
            .map_err(|_| format!("key '{name}': escape stream extent overflows"))?;
        if e.dense && (index_len != 0 || escape_len != 0) {
            return Err(format!(
                "key '{name}': a dense entry has index or escape bytes"
            ));
        }
        if coo && !e.dense && (index_len != nnz * iw || escape_len != 0) {
            return Err(format!(
                "key '{name}': entry extents do not match {nnz} coordinates of {iw} bytes"
            ));
        }
        plan.push(EntryPlan {
            ordinal: o,
            dense: e.dense,
            base,
            limit,
            nnz,
            width,
            cols: cols.max(1),
            rows,
            index_pos: ipos,
            index_len,
            code_pos: cpos,
            value_pos: vpos,
            escape_pos: epos,
            escape_len,
            dense_pos: dpos,
        });
        let overflow = || format!("key '{name}': stream extents overflow");
        ipos = ipos.checked_add(index_len).ok_or_else(overflow)?;
        epos = epos.checked_add(escape_len).ok_or_else(overflow)?;
        if e.dense {
            dpos = nnz
                .checked_mul(width)
                .and_then(|b| dpos.checked_add(b))
                .ok_or_else(overflow)?;
        } else if coo {
            vpos = vpos.checked_add(nnz * width).ok_or_else(overflow)?;
        } else {
            cpos += nnz.div_ceil(4);
        }
    }
    let [s0, s1, s2, s3] = [
        &body.streams[0],
        &body.streams[1],
        &body.streams[2],
        &body.streams[3],
    ];
    let exact = dpos == s3.len()
        && if coo {
            ipos == s0.len() && ipos == s1.len() && vpos == s2.len()
        } else {
            ipos == s0.len() && cpos == s1.len() && epos == s2.len()
        };
    if !exact {
        return Err("stream lengths do not match the entry table".into());
    }
    Ok(plan)
}

/// Check one entry's streams: every index inside its range, every stream run consumed exactly.
fn check_entry(body: &PatchBody, e: &EntryPlan) -> Result<(), String> {
    if e.dense {
        // Its extent in the dense stream was checked with the entry table; any bytes are valid values.
        return Ok(());
    }
    let [s0, s1, s2] = [&body.streams[0], &body.streams[1], &body.streams[2]];
    let span = e.limit - e.base;
    match body.index {
        IndexCoding::Gaps => {
            let gaps = &s0[e.index_pos..e.index_pos + e.index_len];
            let escapes = &s2[e.escape_pos..e.escape_pos + e.escape_len];
            let codes = &s1[e.code_pos..e.code_pos + e.nnz.div_ceil(4)];
            check_delta(gaps, codes, escapes, e.nnz, span)?;
        }
        IndexCoding::Coo => {
            let w = body.index_width;
            let (rows, cols) = (
                &s0[e.index_pos..e.index_pos + e.index_len],
                &s1[e.index_pos..e.index_pos + e.index_len],
            );
            for i in 0..e.nnz {
                let (r, c) = (
                    get_uint(rows, i, w).ok_or("truncated row stream")?,
                    get_uint(cols, i, w).ok_or("truncated col stream")?,
                );
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
            }
        }
    }
    Ok(())
}

/// Check a delta entry's streams: `nnz` gaps whose indices stay below `span`, `nnz` codes (zero padding), one
/// escape varint per zero code, each stream consumed exactly. The common case in a few streaming passes;
/// anything they cannot vouch for (a gap of 3+ bytes, a fault) goes through the exact walk, which also words
/// the error.
fn check_delta(
    gaps: &[u8],
    codes: &[u8],
    escapes: &[u8],
    nnz: usize,
    span: usize,
) -> Result<(), String> {
    if gaps_fit(gaps, nnz, span)
        && let Some(escaped) = escape_codes(codes, nnz)
        && varints_exact(escapes, escaped)
    {
        return Ok(());
    }
    check_delta_walk(gaps, codes, escapes, nnz, span)
}

/// [`check_delta`] varint by varint.
fn check_delta_walk(
    gaps: &[u8],
    codes: &[u8],
    escapes: &[u8],
    nnz: usize,
    span: usize,
) -> Result<(), String> {
    let (mut pos, mut next) = (0usize, 0u64);
    for _ in 0..nnz {
        let g = get_varint(gaps, &mut pos).ok_or("truncated index stream")?;
        let rel = next
            .checked_add(g)
            .filter(|&r| r < span as u64)
            .ok_or("index outside the entry's range")?;
        next = rel + 1;
    }
    if pos != gaps.len() {
        return Err("index stream holds more data than the entry describes".into());
    }
    let escaped = (0..nnz)
        .filter(|k| (codes[k / 4] >> ((k % 4) * 2)) & 3 == 0)
        .count();
    let padding = if nnz.is_multiple_of(4) {
        0
    } else {
        codes.last().map_or(0, |b| b >> ((nnz % 4) * 2))
    };
    if padding != 0 {
        return Err("code stream padding is not zero".into());
    }
    let mut epos = 0usize;
    for _ in 0..escaped {
        get_varint(escapes, &mut epos).ok_or("truncated escape stream")?;
    }
    if epos != escapes.len() {
        return Err("escape stream holds more data than the entry describes".into());
    }
    Ok(())
}

/// Bytes per pass of [`gaps_fit`]'s inner loop: its 32-bit sums cannot overflow (127 << 7 per byte).
const GAP_CHUNK: usize = 1 << 16;

/// Whether `gaps` is exactly `nnz` gap varints of one or two bytes each whose indices all fall below `span`
/// (false also when a gap is longer: the caller then walks the stream varint by varint). Gaps are never
/// negative, so the last index, the sum of the gaps plus `nnz - 1`, bounds them all; a byte is the second of
/// its varint exactly when the one before it has its continuation bit set.
fn gaps_fit(gaps: &[u8], nnz: usize, span: usize) -> bool {
    let Some((&first, _)) = gaps.split_first() else {
        return nnz == 0;
    };
    if gaps.last().is_some_and(|&b| b >= 0x80) {
        return false;
    }
    let (mut ends, mut both, mut sum) = (usize::from(first < 0x80), 0u8, u64::from(first & 0x7f));
    for (p, b) in gaps.chunks(GAP_CHUNK).zip(gaps[1..].chunks(GAP_CHUNK)) {
        let (mut e, mut s) = (0u32, 0u32);
        for (&p, &b) in p.iter().zip(b) {
            e += u32::from(b < 0x80);
            both |= p & b;
            s += u32::from(b & 0x7f) << (7 * u32::from(p >> 7));
        }
        ends += e as usize;
        sum += u64::from(s);
    }
    // `both` has its top bit set when two continuation bytes follow each other (a varint of 3+ bytes).
    both < 0x80 && ends == nnz && sum + (nnz as u64 - 1) < span as u64
}

/// Escapes (zero codes) among the first `nnz` 2-bit codes, or `None` when the padding after them is not zero.
fn escape_codes(codes: &[u8], nnz: usize) -> Option<usize> {
    let full = nnz / 4;
    if !nnz.is_multiple_of(4) && codes.get(full).is_some_and(|b| b >> ((nnz % 4) * 2) != 0) {
        return None;
    }
    // Each code pair that is not zero sets the low bit of `x | x >> 1` in its pair.
    let pairs = |x: u64| (x | x >> 1) & 0x5555_5555_5555_5555;
    let words = codes.chunks_exact(8);
    let rest = words.remainder();
    let mut nonzero: usize = words
        .map(|c| pairs(u64::from_le_bytes(c.try_into().unwrap_or_default())).count_ones() as usize)
        .sum();
    let mut tail = [0u8; 8];
    tail[..rest.len()].copy_from_slice(rest);
    nonzero += pairs(u64::from_le_bytes(tail)).count_ones() as usize;
    Some(nnz - nonzero)
}

/// Whether `buf` is exactly `count` varints as [`get_varint`] reads them (each ends within 10 bytes).
fn varints_exact(buf: &[u8], count: usize) -> bool {
    let (mut ends, mut run, mut longest) = (0usize, 0u32, 0u32);
    for &b in buf {
        let more = u32::from(b >> 7);
        ends += 1 - more as usize;
        run = (run + 1) * more;
        longest = longest.max(run);
    }
    ends == count && longest < 10 && buf.last().is_none_or(|&b| b < 0x80)
}

/// Write a validated patch into the state (entries in parallel when `threads > 1`: each owns a disjoint
/// element range).
pub fn install(p: &ValidPatch, state: &mut StateDict, threads: NonZeroUsize) {
    let body = &p.body;
    map_items(targets(p, state), threads, |(e, bytes)| {
        install_width::<false>(body, &e, bytes)
    });
}

/// Each entry of a validated patch with the bytes of its element range in `state` (validation ordered the
/// ranges and kept them inside their tensors, so every split succeeds).
fn targets<'s>(p: &ValidPatch, state: &'s mut StateDict) -> Vec<(EntryPlan, &'s mut [u8])> {
    let mut targets = Vec::with_capacity(p.plan.len());
    let mut plans = p.plan.iter().peekable();
    for (i, (_, t)) in state.iter_mut().enumerate() {
        let mut rest: &mut [u8] = t.bytes_mut();
        let mut at = 0usize; // element offset of `rest`
        while let Some(e) = plans.next_if(|e| e.ordinal == i) {
            let Some((_, tail)) =
                std::mem::take(&mut rest).split_at_mut_checked((e.base - at) * e.width)
            else {
                return targets;
            };
            let Some((mine, tail)) = tail.split_at_mut_checked((e.limit - e.base) * e.width) else {
                return targets;
            };
            targets.push((*e, mine));
            rest = tail;
            at = e.limit;
        }
    }
    targets
}

/// [`install_entry`] for the entry's element width; `UNDO` takes a delta entry's changes back out.
fn install_width<const UNDO: bool>(body: &PatchBody, e: &EntryPlan, bytes: &mut [u8]) {
    match e.width {
        1 => install_entry::<u8, UNDO>(body, e, bytes),
        2 => install_entry::<u16, UNDO>(body, e, bytes),
        4 => install_entry::<u32, UNDO>(body, e, bytes),
        _ => install_entry::<u64, UNDO>(body, e, bytes),
    }
}

/// What installing one part of a version overwrote, so that a later part that fails can take it back
/// ([`roll_back`]): a delta entry is its own undo (its changes are wrapping additions, subtracted again), a
/// dense entry keeps the old bytes of its range, an absolute (COO) entry the old values at its positions.
pub struct Undo {
    patch: ValidPatch,
    saved: Vec<Saved>,
}

/// One entry's old values.
enum Saved {
    Delta,
    Bytes(Vec<u8>),
    Values(Vec<u64>),
}

impl Undo {
    /// The patch part again (after [`roll_back`]), to install it once more later.
    pub fn into_body(self) -> PatchBody {
        self.patch.body
    }

    /// The installed patch part, validated (the version went whole: its old values are not needed).
    pub fn into_patch(self) -> ValidPatch {
        self.patch
    }
}

/// [`install`], keeping what it overwrites in an [`Undo`].
pub fn install_logged(p: ValidPatch, state: &mut StateDict, threads: NonZeroUsize) -> Undo {
    let body = &p.body;
    let saved = map_items(targets(&p, state), threads, |(e, bytes)| {
        let saved = save_entry(body, &e, bytes);
        install_width::<false>(body, &e, bytes);
        saved
    });
    Undo { patch: p, saved }
}

/// Put back what [`install_logged`] overwrote (`state` as it was then, but for that install), so the state is
/// bitwise what it was before it.
pub fn roll_back(u: &Undo, state: &mut StateDict, threads: NonZeroUsize) {
    let body = &u.patch.body;
    let items: Vec<_> = targets(&u.patch, state).into_iter().zip(&u.saved).collect();
    map_items(items, threads, |((e, bytes), saved)| match saved {
        Saved::Delta => install_width::<true>(body, &e, bytes),
        Saved::Bytes(old) => {
            if let Some(dst) = bytes.get_mut(..old.len()) {
                dst.copy_from_slice(old);
            }
        }
        Saved::Values(old) => match e.width {
            1 => restore_coo::<u8>(body, &e, bytes, old),
            2 => restore_coo::<u16>(body, &e, bytes, old),
            4 => restore_coo::<u32>(body, &e, bytes, old),
            _ => restore_coo::<u64>(body, &e, bytes, old),
        },
    });
}

/// The old values an install of entry `e` into `bytes` overwrites (nothing for a delta entry).
fn save_entry(body: &PatchBody, e: &EntryPlan, bytes: &[u8]) -> Saved {
    if e.dense {
        return Saved::Bytes(bytes.get(..e.nnz * e.width).unwrap_or_default().to_vec());
    }
    match body.index {
        IndexCoding::Gaps => Saved::Delta,
        IndexCoding::Coo => Saved::Values(match e.width {
            1 => coo_old::<u8>(body, e, bytes),
            2 => coo_old::<u16>(body, e, bytes),
            4 => coo_old::<u32>(body, e, bytes),
            _ => coo_old::<u64>(body, e, bytes),
        }),
    }
}

/// The element positions (relative to the entry's base) a COO entry writes, in stream order.
fn coo_positions<'b>(body: &'b PatchBody, e: &EntryPlan) -> impl Iterator<Item = usize> + 'b {
    let iw = usize::from(body.index_width).max(1);
    let rows = body.streams[0].get(e.index_pos..e.index_pos + e.index_len);
    let cols = body.streams[1].get(e.index_pos..e.index_pos + e.index_len);
    let (cols_per_row, base) = (e.cols, e.base);
    rows.unwrap_or_default()
        .chunks_exact(iw)
        .zip(cols.unwrap_or_default().chunks_exact(iw))
        .map(move |(r, c)| {
            (read_uint(r) as usize * cols_per_row + read_uint(c) as usize).wrapping_sub(base)
        })
}

fn coo_old<W: Word>(body: &PatchBody, e: &EntryPlan, bytes: &[u8]) -> Vec<u64> {
    let Some(dst) = pod_slice::<W>(bytes) else {
        return Vec::new();
    };
    coo_positions(body, e)
        .map(|idx| dst.get(idx).map_or(0, |x| x.to_u64()))
        .collect()
}

/// Write the old values back, last first (a position written twice ends with its first old value).
fn restore_coo<W: Word>(body: &PatchBody, e: &EntryPlan, bytes: &mut [u8], old: &[u64]) {
    let Some(dst) = pod_slice_mut::<W>(bytes) else {
        return;
    };
    let positions: Vec<usize> = coo_positions(body, e).collect();
    for (&idx, &v) in positions.iter().zip(old).rev() {
        if let Some(x) = dst.get_mut(idx) {
            *x = W::from_u64(v);
        }
    }
}

/// Install one entry into `bytes`, its element range `base..limit`.
fn install_entry<W: Word, const UNDO: bool>(body: &PatchBody, e: &EntryPlan, bytes: &mut [u8]) {
    if e.dense {
        let n = e.nnz * e.width;
        let src = &body.streams[3][e.dense_pos..e.dense_pos + n];
        bytes[..n].copy_from_slice(src);
        return;
    }
    let Some(dst) = pod_slice_mut::<W>(bytes) else {
        return;
    };
    let [s0, s1, s2] = [&body.streams[0], &body.streams[1], &body.streams[2]];
    match body.index {
        IndexCoding::Gaps => {
            let gaps = &s0[e.index_pos..e.index_pos + e.index_len];
            let codes = &s1[e.code_pos..e.code_pos + e.nnz.div_ceil(4)];
            let escapes = &s2[e.escape_pos..e.escape_pos + e.escape_len];
            // Decode a batch of positions first, then update them in a tight loop: the decode is a serial
            // chain, and keeping it out of the update loop lets many cache misses be in flight at once.
            let (mut idxs, mut deltas) = ([0usize; INSTALL_BATCH], [0u64; INSTALL_BATCH]);
            let (mut ipos, mut epos, mut next, mut k) = (0usize, 0usize, 0usize, 0usize);
            while k < e.nnz {
                let n = INSTALL_BATCH.min(e.nnz - k);
                for j in 0..n {
                    let Some(g) = gap_varint(gaps, &mut ipos) else {
                        return;
                    };
                    let idx = next + g as usize;
                    next = idx + 1;
                    let kk = k + j;
                    let code = (codes[kk / 4] >> ((kk % 4) * 2)) & 3;
                    let z = if code != 0 {
                        u64::from(code)
                    } else {
                        get_varint(escapes, &mut epos).unwrap_or(0)
                    };
                    idxs[j] = idx;
                    deltas[j] = unzigzag(z) as u64;
                    simd::prefetch(dst.as_ptr().wrapping_add(idx));
                }
                for (&idx, &d) in idxs[..n].iter().zip(&deltas[..n]) {
                    if let Some(x) = dst.get_mut(idx) {
                        let v = if UNDO {
                            x.to_u64().wrapping_sub(d)
                        } else {
                            x.to_u64().wrapping_add(d)
                        };
                        *x = W::from_u64(v);
                    }
                }
                k += n;
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
                if let Some(x) = dst.get_mut(idx) {
                    *x = W::from_u64(read_uint(v));
                }
            }
        }
    }
}

/// [`get_varint`] with a branch-free path for the 1- and 2-byte varints that nearly all gaps are (at 1–3 %
/// density a gap crosses 127 often enough that a length branch would mispredict).
#[inline(always)]
fn gap_varint(buf: &[u8], pos: &mut usize) -> Option<u64> {
    if let Some(&[b0, b1]) = buf.get(*pos..*pos + 2)
        && b0 & b1 < 0x80
    {
        let two = usize::from(b0 >> 7);
        *pos += 1 + two;
        return Some(u64::from(b0 & 0x7f) | ((u64::from(b1 & 0x7f) << 7) * two as u64));
    }
    get_varint(buf, pos)
}

/// Positions decoded ahead of their updates in [`install_entry`].
const INSTALL_BATCH: usize = 256;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::{Class, Tensor};

    fn snap_of(state: &StateDict, dtype: DType) -> Vec<SnapTensor> {
        state
            .iter()
            .enumerate()
            .map(|(i, (k, t))| {
                let mut s = Storage::zeroed(t.numel() * dtype.size_bytes());
                cast_bytes(t.bytes(), t.dtype(), s.bytes_mut(), dtype).unwrap();
                SnapTensor {
                    key: k.into(),
                    ordinal: i as u32,
                    dtype,
                    cols: t.layout().coo_view().unwrap().1,
                    storage: s,
                }
            })
            .collect()
    }

    #[test]
    fn diff_finds_exactly_the_changed_bits_including_nan_and_negative_zero() {
        let vals: Vec<f32> = (0..1000).map(|i| i as f32 * 0.25).collect();
        let mut sd = StateDict::new();
        sd.insert(
            "w",
            Tensor::from_slice(DType::F32, &[10, 100], Class::Trainable, &vals).unwrap(),
        );
        let mut snap = snap_of(&sd, DType::F32);
        let s = sd.get_mut("w").unwrap().as_mut_slice::<f32>().unwrap();
        s[0] = -0.0; // 0.0 → -0.0: equal as floats, different bits
        s[33] = f32::NAN;
        s[999] += 1.0;
        let mut b = Built::default();
        build(&mut snap, &sd, NonZeroUsize::MIN, &mut b).unwrap();
        assert_eq!(b.changed, 3);
        let found: Vec<usize> = b
            .segments()
            .iter()
            .flat_map(|c| c.idx.iter().map(|&i| c.base + i as usize))
            .collect();
        assert_eq!(found, vec![0, 33, 999]);
        assert_eq!(
            snap[0].storage.bytes(),
            sd.get("w").unwrap().bytes(),
            "snapshot follows the state"
        );
        build(&mut snap, &sd, NonZeroUsize::MIN, &mut b).unwrap();
        assert_eq!(
            b.changed, 0,
            "a second build of the same state finds nothing (buffers reused)"
        );
    }

    /// A receiver copy of the snapshot (what the receiver holds after init).
    fn receiver_of(snap: &[SnapTensor], like: &StateDict) -> StateDict {
        let mut receiver = StateDict::new();
        for st in snap {
            let t = like.get(&st.key).unwrap();
            receiver.insert(
                st.key.clone(),
                Tensor::from_bytes(st.dtype, t.shape(), Class::Trainable, st.storage.bytes())
                    .unwrap(),
            );
        }
        receiver
    }

    fn meta_of(state: &StateDict) -> Vec<KeyMeta> {
        state
            .iter()
            .map(|(k, t)| KeyMeta {
                name: k.into(),
                dtype: t.dtype(),
                shape: t.shape().to_vec(),
            })
            .collect()
    }

    #[test]
    fn a_tensor_spanning_many_segments_becomes_disjoint_entries() {
        const SEGMENT: usize = 256;
        let n = SEGMENT * 5 + 17;
        let vals: Vec<i16> = (0..n).map(|i| i as i16).collect();
        let mut sender = StateDict::new();
        sender.insert(
            "w",
            Tensor::from_slice(DType::I16, &[n], Class::Trainable, &vals).unwrap(),
        );
        let mut snap = snap_of(&sender, DType::I16);
        let mut receiver = receiver_of(&snap, &sender);
        let s = sender.get_mut("w").unwrap().as_mut_slice::<i16>().unwrap();
        // Changes on both sides of every segment boundary, none in segment 2.
        for seg in [0, 1, 3, 4, 5] {
            for i in [
                seg * SEGMENT,
                seg * SEGMENT + 1,
                (seg * SEGMENT).saturating_sub(1),
            ] {
                if i < n && i / SEGMENT != 2 {
                    s[i] ^= 0x5a5a;
                }
            }
        }
        let mut b = Built::default();
        build_segmented(
            &mut snap,
            &sender,
            NonZeroUsize::new(2).unwrap(),
            &mut b,
            SEGMENT,
        )
        .unwrap();
        for delta in [true, false] {
            let body = encode(&b, &snap, delta, NonZeroUsize::new(2).unwrap());
            let bases: Vec<u64> = body.entries.iter().map(|e| e.base).collect();
            assert_eq!(
                bases,
                [0, 1, 3, 4, 5].map(|s| (s * SEGMENT) as u64),
                "one entry per non-empty segment"
            );
            let mut r = receiver.duplicate();
            let v = validate(
                body.clone(),
                &meta_of(&r),
                &[true],
                &r,
                NonZeroUsize::new(2).unwrap(),
            )
            .unwrap();
            install(&v, &mut r, NonZeroUsize::new(2).unwrap());
            assert_eq!(
                r.get("w").unwrap().bytes(),
                sender.get("w").unwrap().bytes(),
                "delta={delta}"
            );

            // An entry whose indices reach into the next entry's range is rejected before anything is written.
            let mut bad = body.clone();
            bad.entries[1].base -= 1;
            let err = validate(
                bad,
                &meta_of(&receiver),
                &[true],
                &receiver,
                NonZeroUsize::MIN,
            )
            .err()
            .unwrap();
            assert!(err.contains("range") || err.contains("order"), "{err}");
            // Swapped entries are out of order.
            let mut bad = body.clone();
            bad.entries.swap(0, 1);
            assert!(
                validate(
                    bad,
                    &meta_of(&receiver),
                    &[true],
                    &receiver,
                    NonZeroUsize::MIN
                )
                .is_err()
            );
            // Stream extents that do not add up are rejected.
            let mut bad = body;
            bad.entries[0].index_bytes += 1;
            assert!(
                validate(
                    bad,
                    &meta_of(&receiver),
                    &[true],
                    &receiver,
                    NonZeroUsize::MIN
                )
                .is_err()
            );
        }
        install_nothing_keeps(&mut receiver);
    }

    /// A patch with no entries validates and changes nothing.
    fn install_nothing_keeps(receiver: &mut StateDict) {
        let before = receiver.duplicate();
        let body = PatchBody {
            index: IndexCoding::Gaps,
            value: ValueCoding::Delta,
            index_width: 0,
            entries: vec![],
            streams: vec![vec![]; PATCH_STREAMS],
        };
        let v = validate(
            body,
            &meta_of(receiver),
            &[true],
            receiver,
            NonZeroUsize::MIN,
        )
        .unwrap();
        install(&v, receiver, NonZeroUsize::MIN);
        assert_eq!(
            receiver.get("w").unwrap().bytes(),
            before.get("w").unwrap().bytes()
        );
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 64, ..Default::default() })]

        /// Each segment goes sparse or dense, whichever is smaller: the patch is never larger than an
        /// all-sparse or an all-dense one, and installs to exactly the sender's snapshot either way.
        #[test]
        fn segments_go_dense_where_sparse_does_not_pay(
            n in 1usize..3000,
            bf16 in proptest::prelude::any::<bool>(),
            density in 0u64..=100,
            big in proptest::prelude::any::<bool>(),
            seed in proptest::prelude::any::<u64>(),
            delta in proptest::prelude::any::<bool>(),
        ) {
            const SEGMENT: usize = 256;
            let vals: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let mut sender = StateDict::new();
            sender.insert("w", Tensor::from_slice(DType::F32, &[n], Class::Trainable, &vals).unwrap());
            let dtype = if bf16 { DType::Bf16 } else { DType::F32 };
            let mut snap = snap_of(&sender, dtype);
            let receiver = receiver_of(&snap, &sender);
            let mut x = seed | 1;
            for v in sender.get_mut("w").unwrap().as_mut_slice::<f32>().unwrap() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                if x % 100 < density {
                    // Small (Adam-like) or large (random) updates.
                    *v += if big { (x >> 40) as f32 * 1e-6 } else { *v * 0.01 + 1e-3 };
                }
            }
            let mut b = Built::default();
            let threads = NonZeroUsize::new(2).unwrap();
            build_segmented(&mut snap, &sender, threads, &mut b, SEGMENT).unwrap();
            let size = |p: &PatchBody| super::super::wire::encode_patch_body(p, super::super::wire::Codec::Plain).body.len();
            let mut sizes = Vec::new();
            for pick in [Pick::Smaller, Pick::Sparse, Pick::Dense] {
                let body = encode_as(&b, &snap, delta, threads, pick);
                sizes.push(size(&body));
                if !body.entries.is_empty() {
                    // An entry read with the other coding never validates (its extents no longer add up).
                    let mut bad = body.clone();
                    bad.entries[0].dense = !bad.entries[0].dense;
                    proptest::prop_assert!(validate(bad, &meta_of(&receiver), &[true], &receiver, threads).is_err());
                }
                let mut r = receiver.duplicate();
                let v = validate(body, &meta_of(&r), &[true], &r, threads).unwrap();
                install(&v, &mut r, threads);
                proptest::prop_assert_eq!(r.get("w").unwrap().bytes(), snap[0].storage.bytes(), "{:?}", pick);
            }
            proptest::prop_assert!(sizes[0] <= sizes[1].min(sizes[2]), "smaller {} sparse {} dense {}", sizes[0], sizes[1], sizes[2]);
            // The sender's message, serialized from the coded entries without a PatchBody in between, is the
            // message of the encoded body.
            use super::super::wire::{self, Kind};
            let body = encode(&b, &snap, delta, threads);
            for codec in [Codec::Plain, Codec::Lz4] {
                let mut h = Header::new(Kind::Patch, 2, 0);
                h.aux = 1;
                let (m, entries, dense) = encode_message(&b, &snap, delta, threads, h, codec);
                proptest::prop_assert_eq!(&m.msg, &wire::message(h, &wire::encode_patch_body(&body, codec).body));
                proptest::prop_assert_eq!(entries, body.entries.len());
                proptest::prop_assert_eq!(dense, body.entries.iter().filter(|e| e.dense).count() as u64);
            }
        }
    }

    /// A diff of a state's bytes against a snapshot's, recording into a [`Changes`].
    type DiffFn<'a> = dyn FnMut(&[u8], &mut [u8], &mut Changes) + 'a;

    /// The plain scalar diff: every element's bits compared on their own, in order; changed elements listed as
    /// [`Changes`] lays them out and copied into the snapshot.
    fn diff_reference(
        cur: &[u8],
        snap: &mut [u8],
        width: usize,
        base: usize,
    ) -> (Vec<u32>, Vec<u64>) {
        let word = |b: &[u8]| match width {
            1 => u64::from(b[0]),
            2 => u64::from(u16::from_ne_bytes([b[0], b[1]])),
            4 => u64::from(u32::from_ne_bytes(b.try_into().unwrap())),
            _ => u64::from_ne_bytes(b.try_into().unwrap()),
        };
        let (mut idx, mut vals) = (Vec::new(), Vec::new());
        for (i, (c, s)) in cur
            .chunks_exact(width)
            .zip(snap.chunks_exact_mut(width))
            .enumerate()
        {
            if c != s {
                let (old, new) = (word(s), word(c));
                idx.push((base + i) as u32);
                if width == 8 {
                    vals.extend([old, new]);
                } else {
                    vals.push(old | new << 32);
                }
                s.copy_from_slice(c);
            }
        }
        (idx, vals)
    }

    /// A floating-point bit pattern of `width` bytes (1: any byte): +0.0 when `neg` is false, else -0.0.
    fn zero_bits(width: usize, neg: bool) -> u64 {
        u64::from(neg) << (8 * width - 1)
    }

    /// A quiet NaN of `width` bytes (2: bf16's layout; 1: any byte) with `payload` in its low bits.
    fn nan_bits(width: usize, payload: u64) -> u64 {
        match width {
            2 => 0x7fc0 | (payload & 0x3f),
            4 => 0x7fc0_0000 | (payload & 0x3f_ffff),
            8 => 0x7ff8_0000_0000_0000 | (payload & 0x7_ffff_ffff_ffff),
            _ => payload & 0xff,
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 256, ..Default::default() })]

        /// Every whole-block kernel this CPU runs (AVX-512, AVX2), the dispatching diff and the portable block
        /// walk find exactly what the plain scalar diff finds and leave the same snapshot, bitwise: for every
        /// width, lengths with tails and spanning several passes, no change, every element changed, random
        /// and clustered changes (runs as Adam leaves them), NaNs whose payload changes or stays, and zeros
        /// whose sign flips (equal as floats, different bits).
        #[test]
        fn diff_kernels_match_the_scalar_reference(
            width in proptest::sample::select(vec![1usize, 2, 4, 8]),
            n in proptest::prop_oneof![0usize..100, 0usize..40_000],
            mode in 0u8..5,
            density in 0u64..=100,
            base in 0usize..1000,
            seed in proptest::prelude::any::<u64>(),
        ) {
            let mut x = seed | 1;
            let mut rnd = move || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x
            };
            let set = |b: &mut [u8], v: u64| b.copy_from_slice(&v.to_le_bytes()[..width]);
            let snap: Vec<u8> = (0..n * width).map(|_| rnd() as u8).collect();
            let mut cur = snap.clone();
            let mut snap = snap;
            let mut run = 0u64;
            for (c, s) in cur.chunks_exact_mut(width).zip(snap.chunks_exact_mut(width)) {
                let r = rnd();
                match mode {
                    // none changed
                    0 => {}
                    // every element changed (one bit each)
                    1 => c[(r as usize / 8) % width] ^= 1 << (r % 8),
                    // random: one bit anywhere, at `density` %
                    2 => if r % 100 < density {
                        let bit = (r >> 8) as usize % (8 * width);
                        c[bit / 8] ^= 1 << (bit % 8);
                    },
                    // clustered: runs of up to 40 changed elements start at `density` / 10 %
                    3 => {
                        if run == 0 && r % 1000 < density {
                            run = 1 + (r >> 10) % 40;
                        }
                        if run > 0 {
                            run -= 1;
                            c[0] ^= 1 + (r >> 20) as u8 % 3;
                        }
                    }
                    // NaNs and signed zeros: a NaN whose payload changes or stays, a zero whose sign
                    // flips or stays
                    _ => match r % 8 {
                        0 => { set(s, nan_bits(width, r >> 8)); set(c, nan_bits(width, r >> 8)); }
                        1 => { set(s, nan_bits(width, r >> 8)); set(c, nan_bits(width, (r >> 8) ^ 1)); }
                        2 => { set(s, zero_bits(width, false)); set(c, zero_bits(width, true)); }
                        3 => { set(s, zero_bits(width, true)); set(c, zero_bits(width, false)); }
                        4 => { set(s, zero_bits(width, true)); set(c, zero_bits(width, true)); }
                        _ => {}
                    },
                }
            }
            let mut reference = snap.clone();
            let (want_idx, want_vals) = diff_reference(&cur, &mut reference, width, base);
            proptest::prop_assert_eq!(&reference, &cur, "the reference's snapshot takes the state");
            let c = {
                let mut c = Storage::zeroed(n * width);
                c.bytes_mut().copy_from_slice(&cur);
                c
            };
            let fresh = || {
                let mut s = Storage::zeroed(n * width);
                s.bytes_mut().copy_from_slice(&snap);
                s
            };
            let check = |name: &str, run: &mut DiffFn| {
                let mut s = fresh();
                let mut got = Changes::default();
                run(c.bytes(), s.bytes_mut(), &mut got);
                proptest::prop_assert_eq!(&got.idx, &want_idx, "{} positions", name);
                proptest::prop_assert_eq!(&got.vals, &want_vals, "{} values", name);
                proptest::prop_assert_eq!(s.bytes(), &cur[..], "{} snapshot", name);
                Ok(())
            };
            check("diff_same", &mut |c, s, o| diff_same(c, s, width, base, o))?;
            macro_rules! each {
                ($W:ty) => {
                    for (name, kernel) in simd::each_kernel::<$W>() {
                        check(name, &mut |c, s, o| {
                            let (c, s) = (pod_slice::<$W>(c).unwrap(), pod_slice_mut::<$W>(s).unwrap());
                            let done = kernel(c, s, base, o);
                            assert_eq!(done, if name == "none" { 0 } else { c.len() / BLOCK * BLOCK });
                            diff_words(&c[done..], &mut s[done..], base + done, o);
                        })?;
                    }
                };
            }
            match width {
                1 => each!(u8),
                2 => each!(u16),
                4 => each!(u32),
                _ => each!(u64),
            }
        }
    }

    fn sign_extend(v: u64, bits: u32) -> i64 {
        let shift = 64 - bits;
        ((v << shift) as i64) >> shift
    }

    /// The delta coder as first written (a `put_varint` per gap and escape): the reference for [`code_delta`].
    fn code_delta_reference(st: &SnapTensor, c: &Changes) -> [Vec<u8>; 3] {
        use crate::bytes::put_varint;
        let w = st.dtype.size_bytes();
        let bits = (w * 8) as u32;
        let mask = if bits == 64 {
            u64::MAX
        } else {
            (1u64 << bits) - 1
        };
        let n = c.len();
        let (mut gaps, mut codes, mut escapes) = (Vec::new(), vec![0u8; n.div_ceil(4)], Vec::new());
        let mut next = 0u64;
        for (k, &rel) in c.idx.iter().enumerate() {
            let rel = u64::from(rel);
            put_varint(&mut gaps, rel - next);
            next = rel + 1;
            let (old, new) = c.old_new(k, w);
            let z = zigzag(sign_extend(new.wrapping_sub(old) & mask, bits));
            if (1..=3).contains(&z) {
                codes[k / 4] |= (z as u8) << ((k % 4) * 2);
            } else {
                put_varint(&mut escapes, z);
            }
        }
        [gaps, codes, escapes]
    }

    /// Random changes of one segment: every element changes with `density` %, by a small step (a code) or a
    /// random pattern (an escape of any length); `far` spreads them over a span where gaps pass 2^14.
    fn random_changes(
        dtype: DType,
        n: usize,
        density: u64,
        big: u64,
        far: bool,
        seed: u64,
    ) -> Changes {
        let mut c = Changes::default();
        let span = if far { n << 16 } else { n };
        c.reset(0, 0, span);
        let mut x = seed | 1;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let w = dtype.size_bytes();
        let mask = if w == 8 { u64::MAX } else { (1 << (8 * w)) - 1 };
        for i in 0..n {
            if rnd() % 100 >= density {
                continue;
            }
            let old = rnd() & mask;
            let step = if rnd() % 100 < big {
                rnd()
            } else {
                [1, 2, u64::MAX][(rnd() % 3) as usize]
            };
            let new = old.wrapping_add(step) & mask;
            let new = if new == old { old ^ 1 } else { new };
            let idx = if far {
                (i << 16) + (rnd() % (1 << 16)) as usize
            } else {
                i
            };
            match w {
                1 => c.push::<u8>(idx, old as u8, new as u8),
                2 => c.push::<u16>(idx, old as u16, new as u16),
                4 => c.push::<u32>(idx, old as u32, new as u32),
                _ => c.push::<u64>(idx, old, new),
            }
        }
        c
    }

    fn snap_tensor(dtype: DType, span: usize) -> SnapTensor {
        SnapTensor {
            key: "w".into(),
            ordinal: 0,
            dtype,
            cols: span.max(1),
            storage: Storage::zeroed(0),
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 256, ..Default::default() })]

        /// The chunked, branch-free delta coder writes exactly the reference's bytes, for every element width,
        /// densities from none to all, counts that do not fill a chunk or a code byte, and gaps and escapes of
        /// every varint length.
        #[test]
        fn code_delta_matches_the_reference(
            dtype in proptest::sample::select(vec![DType::U8, DType::Bf16, DType::F32, DType::I64]),
            n in 0usize..2000,
            density in proptest::prop_oneof![proptest::strategy::Just(0u64), proptest::strategy::Just(100u64), 0u64..=100],
            big in 0u64..=100,
            far in proptest::prelude::any::<bool>(),
            seed in proptest::prelude::any::<u64>(),
        ) {
            let c = random_changes(dtype, n, density, big, far, seed);
            let st = snap_tensor(dtype, c.span);
            let coded = code_delta(&st, &c);
            let [gaps, codes, escapes] = code_delta_reference(&st, &c);
            proptest::prop_assert_eq!(&coded.streams[0], &gaps);
            proptest::prop_assert_eq!(&coded.streams[1], &codes);
            proptest::prop_assert_eq!(&coded.streams[2], &escapes);
            proptest::prop_assert!(coded.streams[3].is_empty());
            proptest::prop_assert_eq!(coded.entry.index_bytes, gaps.len() as u64);
            proptest::prop_assert_eq!(coded.entry.escape_bytes, escapes.len() as u64);
            proptest::prop_assert_eq!(check_delta(&gaps, &codes, &escapes, c.len(), c.span), Ok(()));
            if !far {
                // Gaps below 2^14: the streaming check vouches for the entry without the walk.
                proptest::prop_assert!(gaps_fit(&gaps, c.len(), c.span));
                proptest::prop_assert!(escape_codes(&codes, c.len()).is_some_and(|e| varints_exact(&escapes, e)));
            }
        }

        /// The streaming delta check accepts exactly what the varint-by-varint walk accepts, on coded entries
        /// and on every kind of damage to them (a byte changed, cut or added; a wrong count or range).
        #[test]
        fn check_delta_agrees_with_the_walk(
            dtype in proptest::sample::select(vec![DType::U8, DType::Bf16, DType::F32, DType::I64]),
            n in 0usize..600,
            density in 0u64..=100,
            big in 0u64..=100,
            far in proptest::prelude::any::<bool>(),
            seed in proptest::prelude::any::<u64>(),
            damage in 0usize..8,
            at in proptest::prelude::any::<usize>(),
            byte in proptest::prelude::any::<u8>(),
        ) {
            let c = random_changes(dtype, n, density, big, far, seed);
            let coded = code_delta(&snap_tensor(dtype, c.span), &c);
            let [mut gaps, mut codes, mut escapes, _] = coded.streams;
            let (mut nnz, mut span) = (c.len(), c.span);
            let last = c.idx.last().map_or(0, |&i| i as usize + 1);
            match damage {
                0 => {}
                1..=3 => {
                    let s = [&mut gaps, &mut codes, &mut escapes].into_iter().nth(damage - 1).unwrap_or_else(|| unreachable!());
                    if !s.is_empty() {
                        let i = at % s.len();
                        s[i] = byte;
                    }
                }
                4 => {
                    let s = [&mut gaps, &mut codes, &mut escapes].into_iter().nth(at % 3).unwrap_or_else(|| unreachable!());
                    s.truncate(s.len().saturating_sub(1 + byte as usize % 3));
                }
                5 => {
                    if let Some(s) = [&mut gaps, &mut codes, &mut escapes].into_iter().nth(at % 3) {
                        s.push(byte);
                    }
                }
                6 => nnz = if at % 2 == 0 { nnz + 1 } else { nnz.saturating_sub(1) },
                _ => span = last.saturating_sub(at % 2),
            }
            let codes = &codes[..codes.len().min(nnz.div_ceil(4))];
            if codes.len() == nnz.div_ceil(4) {
                proptest::prop_assert_eq!(
                    check_delta(&gaps, codes, &escapes, nnz, span).is_ok(),
                    check_delta_walk(&gaps, codes, &escapes, nnz, span).is_ok()
                );
            }
        }
    }

    #[test]
    fn check_delta_edges() {
        // No changes: every stream empty.
        assert_eq!(check_delta(&[], &[], &[], 0, 0), Ok(()));
        assert!(check_delta(&[0], &[], &[], 0, 10).is_err());
        // One change at the last element of the span, and one past it.
        assert_eq!(check_delta(&[9], &[2], &[], 1, 10), Ok(()));
        assert!(check_delta(&[10], &[2], &[], 1, 10).is_err());
        // A 2-byte gap (200) and a 3-byte one (2^14): the second only through the walk.
        assert_eq!(check_delta(&[0xc8, 0x01], &[2], &[], 1, 201), Ok(()));
        assert!(check_delta(&[0xc8, 0x01], &[2], &[], 1, 200).is_err());
        assert_eq!(
            check_delta(&[0x80, 0x80, 0x01], &[2], &[], 1, 1 << 14 | 1),
            Ok(())
        );
        assert!(check_delta(&[0x80, 0x80, 0x01], &[2], &[], 1, 1 << 14).is_err());
        // An unterminated gap; an escape of 10 bytes (accepted) and of 11 (not).
        assert!(check_delta(&[0x80], &[2], &[], 1, 1000).is_err());
        let ten = [0xff; 9].into_iter().chain([0x01]).collect::<Vec<u8>>();
        assert_eq!(check_delta(&[0], &[0], &ten, 1, 1), Ok(()));
        let eleven = [0xff; 10].into_iter().chain([0x01]).collect::<Vec<u8>>();
        assert!(check_delta(&[0], &[0], &eleven, 1, 1).is_err());
        // Nonzero padding after the last code.
        assert!(check_delta(&[0], &[0b0100_0010], &[], 1, 1).is_err());
    }

    #[test]
    fn encode_validate_install_roundtrip_both_codings() {
        for delta in [true, false] {
            let vals: Vec<f32> = (0..5000).map(|i| (i as f32).sin()).collect();
            let mut sender = StateDict::new();
            sender.insert(
                "w",
                Tensor::from_slice(DType::F32, &[50, 100], Class::Trainable, &vals).unwrap(),
            );
            sender.insert(
                "b",
                Tensor::from_slice(DType::F32, &[7], Class::Trainable, &[1.0f32; 7]).unwrap(),
            );
            let mut snap = snap_of(&sender, DType::Bf16);
            let mut receiver = StateDict::new();
            for st in &snap {
                let t = sender.get(&st.key).unwrap();
                receiver.insert(
                    st.key.clone(),
                    Tensor::from_bytes(
                        DType::Bf16,
                        t.shape(),
                        Class::Trainable,
                        st.storage.bytes(),
                    )
                    .unwrap(),
                );
            }
            let s = sender.get_mut("w").unwrap().as_mut_slice::<f32>().unwrap();
            for i in (0..5000).step_by(37) {
                s[i] += if i % 2 == 0 { 0.01 } else { -5.0 };
            }
            sender.get_mut("b").unwrap().as_mut_slice::<f32>().unwrap()[6] = f32::NAN;
            let mut b = Built::default();
            build(&mut snap, &sender, NonZeroUsize::new(2).unwrap(), &mut b).unwrap();
            let body = encode(&b, &snap, delta, NonZeroUsize::new(2).unwrap());
            let meta: Vec<KeyMeta> = receiver
                .iter()
                .map(|(k, t)| KeyMeta {
                    name: k.into(),
                    dtype: t.dtype(),
                    shape: t.shape().to_vec(),
                })
                .collect();
            let v = validate(
                body,
                &meta,
                &[true, true],
                &receiver,
                NonZeroUsize::new(2).unwrap(),
            )
            .unwrap();
            assert_eq!(v.changed, b.changed);
            install(&v, &mut receiver, NonZeroUsize::new(2).unwrap());
            for st in &snap {
                assert_eq!(
                    receiver.get(&st.key).unwrap().bytes(),
                    st.storage.bytes(),
                    "delta={delta} key {}",
                    st.key
                );
            }
        }
    }
}
