//! Tensor layout (dtype + shape) kept apart from storage (cache-line aligned, contiguous host bytes).

use super::dtype::{DType, Element};

/// Element type and shape of a contiguous row-major tensor. Rank 0 (a scalar) and zero-size dims are valid.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Layout {
    dtype: DType,
    shape: Vec<usize>,
}

impl Layout {
    pub fn new(dtype: DType, shape: &[usize]) -> Layout {
        Layout {
            dtype,
            shape: shape.to_vec(),
        }
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    /// Number of elements, `None` on overflow.
    pub(crate) fn checked_numel(&self) -> Option<usize> {
        self.shape
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
    }

    /// Byte length, `None` on overflow.
    pub(crate) fn checked_byte_len(&self) -> Option<usize> {
        self.checked_numel()?.checked_mul(self.dtype.size_bytes())
    }

    /// The 2-D COO view used to address patches: scalar `(1, 1)`, 1-D `(1, N)`, 2-D as is, ≥3-D `(shape[0], rest)`.
    /// `None` on overflow.
    pub fn coo_view(&self) -> Option<(usize, usize)> {
        match self.shape.as_slice() {
            [] => Some((1, 1)),
            [n] => Some((1, *n)),
            [r, rest @ ..] => Some((*r, rest.iter().try_fold(1usize, |a, &d| a.checked_mul(d))?)),
        }
    }
}

/// One cache line: the allocation unit of [`Storage`].
#[derive(Debug, Clone, Copy, bytemuck::Zeroable, bytemuck::Pod)]
#[repr(C, align(64))]
struct Line([u64; 8]);

/// Contiguous bytes, 64-byte aligned so every [`Element`] view is aligned and a kernel's 64-byte block is one
/// cache line (not two). Deliberately not `Clone`: copying a model-sized buffer must be explicit
/// ([`Storage::duplicate`]).
///
/// A storage may also *borrow* memory its caller owns ([`Storage::borrowed`], e.g. a torch tensor's data
/// handed over by the Python binding): then it is only element-aligned, and installs write into that memory
/// in place ([`Storage::is_borrowed`]).
/// Host memory only: a GPU backend would turn this into an enum of per-device storages behind the same
/// methods (as candle's `Storage::{Cpu, Cuda}`), so nothing outside this file depends on how the bytes are held.
#[derive(Debug)]
pub struct Storage {
    mem: Mem,
    len: usize,
}

#[derive(Debug)]
enum Mem {
    Owned(Vec<Line>),
    /// At least [`MAPPED_MIN`] bytes: anonymous pages straight from the kernel (zero until written, so a
    /// model-sized storage costs its first touch once, by whoever writes it first, not a memset and then the
    /// write), advised for transparent huge pages.
    Mapped(memmap2::MmapMut),
    /// `len` bytes at this address, owned by the caller of [`Storage::borrowed`].
    Borrowed(std::ptr::NonNull<u8>),
}

// SAFETY: an owned storage is a Vec, a mapped one a private mapping. A borrowed one is, by the contract of
// `Storage::borrowed`, memory that stays valid and is accessed only through this storage while it lives, so
// moving it to or sharing it with other threads is as safe as doing so with a `Vec<u8>`: `&self` gives shared
// reads, `&mut self` unique writes.
unsafe impl Send for Storage {}
// SAFETY: as above.
unsafe impl Sync for Storage {}

impl Storage {
    /// `len` zero bytes. From [`MAPPED_MIN`] bytes up, fresh pages mapped for it: nothing is written until the
    /// caller writes (untouched pages cost nothing); below, the allocator's cache lines.
    pub fn zeroed(len: usize) -> Storage {
        let mem = (len >= MAPPED_MIN)
            .then(|| mapped(len))
            .flatten()
            .map_or_else(|| Mem::Owned(zeroed_lines(len.div_ceil(64))), Mem::Mapped);
        Storage { mem, len }
    }

    /// A storage over `len` bytes of CPU memory the caller owns (zero-copy). A null `ptr` is only accepted for
    /// `len == 0` (an owned empty storage is returned then).
    ///
    /// # Safety
    /// For as long as the returned storage (or anything it is moved into) lives, `ptr..ptr + len` must stay
    /// valid for reads and writes, and must not be read or written other than through this storage while a
    /// syncer operation runs on it.
    pub unsafe fn borrowed(ptr: *mut u8, len: usize) -> Storage {
        match std::ptr::NonNull::new(ptr) {
            Some(p) if len > 0 => Storage {
                mem: Mem::Borrowed(p),
                len,
            },
            _ => Storage::zeroed(0),
        }
    }

    /// Whether the bytes belong to the caller of [`Storage::borrowed`] (installs then copy into them).
    pub(crate) fn is_borrowed(&self) -> bool {
        matches!(self.mem, Mem::Borrowed(_))
    }

    pub fn from_bytes(bytes: &[u8]) -> Storage {
        let mut s = Storage::zeroed(bytes.len());
        s.bytes_mut().copy_from_slice(bytes);
        s
    }

    /// An explicit deep copy.
    pub fn duplicate(&self) -> Storage {
        Storage::from_bytes(self.bytes())
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn bytes(&self) -> &[u8] {
        match &self.mem {
            Mem::Owned(words) => {
                let all = words_as_bytes(words);
                &all[..self.len.min(all.len())]
            }
            Mem::Mapped(m) => &m[..self.len.min(m.len())],
            // SAFETY: `Storage::borrowed`'s contract: `len` valid bytes for this storage's lifetime.
            Mem::Borrowed(p) => unsafe { std::slice::from_raw_parts(p.as_ptr(), self.len) },
        }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let len = self.len;
        match &mut self.mem {
            Mem::Owned(words) => {
                let all = words_as_bytes_mut(words);
                let n = len.min(all.len());
                &mut all[..n]
            }
            Mem::Mapped(m) => {
                let n = len.min(m.len());
                &mut m[..n]
            }
            // SAFETY: as in `bytes`; `&mut self` makes this the only access through the storage.
            Mem::Borrowed(p) => unsafe { std::slice::from_raw_parts_mut(p.as_ptr(), len) },
        }
    }
}

/// Bytes from which a [`Storage::zeroed`] is mapped pages rather than the allocator's: glibc's largest mmap
/// threshold, from which it maps fresh pages for every allocation itself. Below it the allocator reuses freed
/// memory, which a buffer made and dropped per sync gains from (`cargo bench --bench storage`).
pub(crate) const MAPPED_MIN: usize = 32 << 20;

/// `len` bytes of fresh anonymous pages (page-aligned, zero), advised for transparent huge pages: a 2 MiB page
/// per fault instead of a 4 KiB one where the kernel's THP mode is `madvise` (most distributions' default), ~5×
/// faster first touch (`cargo bench --bench storage`). `RLSYNC_HUGE_PAGES=0` leaves the pages 4 KiB (for a host
/// whose memory is so fragmented that the kernel's compaction for huge pages stalls). `None` when the kernel
/// refuses the mapping (the caller falls back to the allocator).
fn mapped(len: usize) -> Option<memmap2::MmapMut> {
    static HUGE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let m = memmap2::MmapMut::map_anon(len).ok()?;
    if *HUGE.get_or_init(|| std::env::var_os("RLSYNC_HUGE_PAGES").is_none_or(|v| v != "0")) {
        // Advice only: a kernel without THP keeps 4 KiB pages, which are as correct.
        let _ = m.advise(memmap2::Advice::HugePage);
    }
    Some(m)
}

/// `n` zeroed lines from the allocator's zeroed path. A 64-byte alignment is above what `calloc` guarantees,
/// so the allocator writes the zeros itself: fine for small storages, a whole extra pass for large ones
/// (those are [`mapped`]).
fn zeroed_lines(n: usize) -> Vec<Line> {
    let Ok(layout) = std::alloc::Layout::array::<Line>(n) else {
        std::alloc::handle_alloc_error(std::alloc::Layout::new::<Line>())
    };
    if layout.size() == 0 {
        return Vec::new();
    }
    // SAFETY: the layout has a non-zero size; all-zero bytes are a valid `Line`; the pointer comes from the
    // global allocator with exactly the layout `Vec<Line>` uses for capacity `n`, so the Vec may own and free it.
    unsafe {
        let ptr = std::alloc::alloc_zeroed(layout).cast::<Line>();
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        Vec::from_raw_parts(ptr, n, n)
    }
}

fn words_as_bytes(words: &[Line]) -> &[u8] {
    bytemuck::cast_slice(words)
}

fn words_as_bytes_mut(words: &mut [Line]) -> &mut [u8] {
    bytemuck::cast_slice_mut(words)
}

/// Plain-old-data types the kernels may reinterpret bytes as (every bit pattern valid, no padding): bytemuck's.
pub(crate) use bytemuck::Pod;

/// Reinterpret bytes as `[T]`; `None` when misaligned or the length is not a multiple of `size_of::<T>()`.
pub(crate) fn pod_slice<T: Pod>(bytes: &[u8]) -> Option<&[T]> {
    bytemuck::try_cast_slice(bytes).ok()
}

/// Mutable counterpart of [`pod_slice`].
pub(crate) fn pod_slice_mut<T: Pod>(bytes: &mut [u8]) -> Option<&mut [T]> {
    bytemuck::try_cast_slice_mut(bytes).ok()
}

/// View typed `Element`s (public API: the element type must match the dtype).
pub(crate) fn element_slice<T: Element>(bytes: &[u8]) -> Option<&[T]> {
    pod_slice(bytes)
}

pub(crate) fn element_slice_mut<T: Element>(bytes: &mut [u8]) -> Option<&mut [T]> {
    pod_slice_mut(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coo_view_follows_rank_rules() {
        let check = |shape: &[usize], expect: (usize, usize)| {
            assert_eq!(
                Layout::new(DType::F32, shape).coo_view(),
                Some(expect),
                "shape {shape:?}"
            );
        };
        check(&[], (1, 1));
        check(&[7], (1, 7));
        check(&[3, 4], (3, 4));
        check(&[2, 3, 4], (2, 12));
        check(&[2, 0, 4, 5], (2, 0));
        check(&[0], (1, 0));
    }

    #[test]
    fn storage_is_aligned_and_sized() {
        let mut s = Storage::zeroed(13);
        assert_eq!(s.bytes().len(), 13);
        assert_eq!(s.bytes().as_ptr() as usize % 8, 0);
        s.bytes_mut()[12] = 7;
        let d = s.duplicate();
        assert_eq!(d.bytes()[12], 7);
        assert!(
            pod_slice::<u32>(s.bytes()).is_none(),
            "13 bytes are not a whole number of u32"
        );
        assert_eq!(
            pod_slice::<u32>(&s.bytes()[..12]).map(<[u32]>::len),
            Some(3)
        );
    }

    #[test]
    fn a_large_storage_is_mapped_zeroed_aligned_and_owned() {
        let len = MAPPED_MIN + 13;
        let mut s = Storage::zeroed(len);
        assert!(
            matches!(s.mem, Mem::Mapped(_)),
            "{len} bytes come from a mapping"
        );
        assert!(!s.is_borrowed());
        assert_eq!(s.len(), len);
        assert_eq!(s.bytes().as_ptr() as usize % 64, 0);
        assert!(s.bytes().iter().all(|&b| b == 0));
        s.bytes_mut()[0] = 1;
        s.bytes_mut()[len - 1] = 9;
        let d = s.duplicate();
        assert!(matches!(d.mem, Mem::Mapped(_)));
        assert_eq!(
            (d.bytes()[0], d.bytes()[len - 1], d.bytes().len()),
            (1, 9, len)
        );
        drop(s);
        assert_eq!(d.bytes()[len - 1], 9, "a copy owns its own pages");
        let small = Storage::zeroed(MAPPED_MIN - 1);
        assert!(matches!(small.mem, Mem::Owned(_)));
    }

    #[test]
    fn numel_overflow_is_none() {
        let l = Layout::new(DType::F64, &[usize::MAX, 2]);
        assert_eq!(l.checked_numel(), None);
        assert_eq!(
            Layout::new(DType::F64, &[usize::MAX / 4]).checked_byte_len(),
            None
        );
    }
}
