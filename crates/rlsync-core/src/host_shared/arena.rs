//! The arena's shared memory: a segment created (O_EXCL, 0600) or opened, its header atomics, the reader slots.
//!
//! The header is mapped read-write by everyone (readers write their slot); the buffers read-write by the
//! applier and read-only by readers. Slot protocol (Dekker-style, all `SeqCst`): a reader stores its slot
//! (pid, buffer) and then re-reads the active index, retrying until both agree; the applier flips the active
//! index first and scans the slots after, so a buffer no slot names is read by nobody.

use std::fs::File;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};

use memmap2::{MmapOptions, MmapRaw};
use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::mman::{shm_open, shm_unlink};
use nix::sys::stat::Mode;

use super::layout::{self, FormatError, Plan};
use crate::tensor::{StateDict, Storage, Tensor};

/// What opening or creating a segment ran into (the caller adds the arena's name).
#[derive(Debug)]
pub(crate) enum SegmentError {
    /// No segment of that name (yet).
    NotFound,
    /// `create`: the name is taken.
    Exists,
    /// The creator has not finished writing the header yet.
    Incomplete,
    Io {
        op: &'static str,
        source: std::io::Error,
    },
    Format(FormatError),
}

fn io(op: &'static str, errno: Errno) -> SegmentError {
    SegmentError::Io {
        op,
        source: std::io::Error::from(errno),
    }
}

fn shm_path(name: &str) -> String {
    format!("/{name}")
}

/// One buffer's published facts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct BufferMeta {
    pub version: u64,
    pub sequence: u64,
    pub checksum: Option<u64>,
    pub generation: u64,
}

/// A mapped arena segment.
#[derive(Debug)]
pub(crate) struct Segment {
    header: MmapRaw,
    buffers: MmapRaw,
    plan: Plan,
}

/// The start time of process `pid` (clock ticks since boot, field 22 of `/proc/<pid>/stat`): with the pid it
/// names one process, so a reused pid is told apart. `None` when it cannot be read.
pub(crate) fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `pid (comm) state …`: comm may hold spaces or parentheses, so split at the last ')'; field 3 is first.
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_ascii_whitespace().nth(19)?.parse().ok()
}

/// Whether the reader recorded as (`pid`, `start`) is still running (a zombie is not; a reused pid is not).
pub(crate) fn reader_alive(pid: u32, start: u64) -> bool {
    let Ok(raw) = i32::try_from(pid) else {
        return false;
    };
    if !crate::transport::shm::pid_alive(raw) {
        return false;
    }
    start == 0 || start_time(pid).is_none_or(|now| now == start)
}

impl Segment {
    /// Create segment `name` laid out by `plan`: exclusively, mode 0600 whatever the umask, its memory
    /// reserved now (a full /dev/shm is an error here, not a SIGBUS later). The header is complete when this
    /// returns; the buffers are zero.
    pub(crate) fn create(name: &str, plan: Plan) -> Result<Segment, SegmentError> {
        let path = shm_path(name);
        let fd = shm_open(
            path.as_str(),
            OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_RDWR,
            Mode::S_IRUSR | Mode::S_IWUSR,
        )
        .map_err(|e| match e {
            Errno::EEXIST => SegmentError::Exists,
            e => io("create", e),
        })?;
        let unlink = |err: SegmentError| {
            let _ = shm_unlink(path.as_str());
            err
        };
        // The umask may have taken bits off the mode; it never adds any, but say 0600 explicitly.
        nix::sys::stat::fchmod(fd.as_fd(), Mode::S_IRUSR | Mode::S_IWUSR)
            .map_err(|e| unlink(io("chmod", e)))?;
        let len =
            libc::off_t::try_from(plan.total).map_err(|_| unlink(io("reserve", Errno::EFBIG)))?;
        nix::fcntl::posix_fallocate(&fd, 0, len).map_err(|e| unlink(io("reserve", e)))?;
        let file = File::from(fd);
        let header = map(&file, 0, plan.buffers, true).map_err(unlink)?;
        let buffers = map(&file, plan.buffers, plan.total - plan.buffers, true).map_err(unlink)?;
        let seg = Segment {
            header,
            buffers,
            plan,
        };
        let fixed = seg.plan.fixed_fields();
        let table_at = Plan::table_offset(seg.plan.max_readers);
        // SAFETY: both ranges lie inside the header mapping (`Plan` sized it for the fixed fields, the slots
        // and the table), which this process created exclusively and nobody reads before `ready` is set.
        unsafe {
            std::ptr::copy_nonoverlapping(
                fixed.as_ptr(),
                seg.header.as_mut_ptr().add(layout::OFF_MAGIC),
                fixed.len(),
            );
            std::ptr::copy_nonoverlapping(
                seg.plan.table.as_ptr(),
                seg.header.as_mut_ptr().add(table_at),
                seg.plan.table.len(),
            );
        }
        seg.atomic(layout::OFF_READY)
            .store(layout::READY_MARK, SeqCst);
        Ok(seg)
    }

    /// Open the existing segment `name`, its header checked; `writable`: map the buffers read-write (the
    /// applier) or read-only (readers).
    pub(crate) fn open(name: &str, writable: bool) -> Result<Segment, SegmentError> {
        let fd =
            shm_open(shm_path(name).as_str(), OFlag::O_RDWR, Mode::empty()).map_err(
                |e| match e {
                    Errno::ENOENT => SegmentError::NotFound,
                    e => io("open", e),
                },
            )?;
        let file = File::from(fd);
        let size = file
            .metadata()
            .map_err(|source| SegmentError::Io { op: "stat", source })?
            .len();
        if size < layout::PAGE as u64 {
            // Created but not yet sized, or not an arena at all: the caller retries until its wait ends.
            return Err(SegmentError::Incomplete);
        }
        let first = map(&file, 0, layout::PAGE, false)?;
        let word = |off: usize| {
            // SAFETY: `off` is a field offset inside the first page, 8-aligned in a page-aligned mapping.
            unsafe { &*first.as_ptr().add(off).cast::<AtomicU64>() }
        };
        if word(layout::OFF_READY).load(SeqCst) != layout::READY_MARK {
            // Check the magic first: a foreign segment is never going to become ready.
            // SAFETY: inside the first page.
            let magic = unsafe { std::slice::from_raw_parts(first.as_ptr(), 8) };
            if magic != layout::MAGIC {
                return Err(SegmentError::Format(FormatError::Magic));
            }
            return Err(SegmentError::Incomplete);
        }
        // SAFETY: the fixed fields lie inside the first page; `ready` says the creator wrote them.
        let fixed =
            unsafe { std::slice::from_raw_parts(first.as_ptr(), layout::FIXED_LEN) }.to_vec();
        let buffers_at = layout::buffers_offset(&fixed);
        let buffers_at = usize::try_from(buffers_at)
            .ok()
            .filter(|&b| b >= layout::PAGE && b.is_multiple_of(layout::PAGE) && (b as u64) < size)
            .ok_or(SegmentError::Format(FormatError::Inconsistent {
                reason: format!("buffers at byte {buffers_at} of {size}"),
            }))?;
        drop(first);
        let header = map(&file, 0, buffers_at, true)?;
        let plan = Plan::read(&fixed, size, |at, len| {
            let end = at.checked_add(len).filter(|&e| e <= buffers_at)?;
            // SAFETY: `at..end` lies inside the header mapping, checked just above.
            Some(unsafe { std::slice::from_raw_parts(header.as_ptr().add(at), end - at) }.to_vec())
        })
        .map_err(SegmentError::Format)?;
        let buffers = map(&file, plan.buffers, plan.total - plan.buffers, writable)?;
        Ok(Segment {
            header,
            buffers,
            plan,
        })
    }

    pub(crate) fn plan(&self) -> &Plan {
        &self.plan
    }

    /// The header's atomic at byte `off` (a layout constant or a slot's word).
    pub(crate) fn atomic(&self, off: usize) -> &AtomicU64 {
        assert!(
            off.is_multiple_of(8) && off + 8 <= self.header.len(),
            "header offset {off}"
        );
        // SAFETY: in bounds and 8-aligned (checked above; the mapping is page-aligned); the header's words are
        // only ever accessed as atomics, by this and other processes.
        unsafe { &*self.header.as_ptr().add(off).cast::<AtomicU64>() }
    }

    pub(crate) fn published(&self) -> bool {
        self.atomic(layout::OFF_PUBLISHED).load(SeqCst) != 0
    }

    pub(crate) fn active(&self) -> u8 {
        (self.atomic(layout::OFF_ACTIVE).load(SeqCst) & 1) as u8
    }

    pub(crate) fn generation(&self) -> u64 {
        self.atomic(layout::OFF_GENERATION).load(SeqCst)
    }

    fn meta_off(buffer: u8, field: usize) -> usize {
        layout::OFF_BUFFER_META + usize::from(buffer & 1) * layout::BUFFER_META_BYTES + field
    }

    pub(crate) fn meta(&self, buffer: u8) -> BufferMeta {
        let get = |f| self.atomic(Segment::meta_off(buffer, f)).load(SeqCst);
        BufferMeta {
            version: get(layout::META_VERSION),
            sequence: get(layout::META_SEQUENCE),
            checksum: (get(layout::META_HAS_CHECKSUM) != 0).then(|| get(layout::META_CHECKSUM)),
            generation: get(layout::META_GENERATION),
        }
    }

    /// Applier only: record `buffer`'s facts (it is not active, and no live reader names it).
    pub(crate) fn set_meta(&self, buffer: u8, m: BufferMeta) {
        let set = |f, v| self.atomic(Segment::meta_off(buffer, f)).store(v, SeqCst);
        set(layout::META_VERSION, m.version);
        set(layout::META_SEQUENCE, m.sequence);
        set(layout::META_CHECKSUM, m.checksum.unwrap_or(0));
        set(layout::META_HAS_CHECKSUM, u64::from(m.checksum.is_some()));
        set(layout::META_GENERATION, m.generation);
    }

    /// Applier only: make `buffer` (its facts already set) the one readers take. The flip comes first, the
    /// slot scan of the next write after it.
    pub(crate) fn flip(&self, buffer: u8, generation: u64) {
        self.atomic(layout::OFF_ACTIVE)
            .store(u64::from(buffer & 1), SeqCst);
        self.atomic(layout::OFF_GENERATION)
            .store(generation, SeqCst);
        self.atomic(layout::OFF_APPLIER)
            .store(u64::from(std::process::id()), SeqCst);
        self.atomic(layout::OFF_PUBLISHED).store(1, SeqCst);
    }

    fn slot_word(&self, slot: usize) -> &AtomicU64 {
        self.atomic(layout::OFF_SLOTS + slot * layout::SLOT_BYTES)
    }

    fn slot_start(&self, slot: usize) -> &AtomicU64 {
        self.atomic(layout::OFF_SLOTS + slot * layout::SLOT_BYTES + 8)
    }

    /// Take a free slot for `pid` (naming no buffer yet); `None` when all are taken.
    pub(crate) fn claim_slot(&self, pid: u32) -> Option<usize> {
        let start = start_time(pid).unwrap_or(0);
        (0..self.plan.max_readers).find(|&i| {
            let won = self
                .slot_word(i)
                .compare_exchange(0, u64::from(pid), SeqCst, SeqCst)
                .is_ok();
            if won {
                self.slot_start(i).store(start, SeqCst);
            }
            won
        })
    }

    /// Name `buffer` in `slot` (then the caller re-reads the active index).
    pub(crate) fn hold(&self, slot: usize, pid: u32, buffer: u8) {
        self.slot_word(slot)
            .store(u64::from(pid) | (u64::from(buffer & 1) + 1) << 32, SeqCst);
    }

    pub(crate) fn release_slot(&self, slot: usize) {
        self.slot_start(slot).store(0, SeqCst);
        self.slot_word(slot).store(0, SeqCst);
    }

    /// Pids of live readers whose slot names `buffer`; the slots of dead ones are cleared.
    pub(crate) fn holders(&self, buffer: u8) -> Vec<u32> {
        let code = u64::from(buffer & 1) + 1;
        let mut live = Vec::new();
        for i in 0..self.plan.max_readers {
            let word = self.slot_word(i).load(SeqCst);
            let pid = (word & 0xffff_ffff) as u32;
            if word == 0 {
                continue;
            }
            let start = self.slot_start(i).load(SeqCst);
            if !reader_alive(pid, start) {
                // Only if the slot still holds what was judged dead (a new reader may have taken it).
                let _ = self.slot_word(i).compare_exchange(word, 0, SeqCst, SeqCst);
                continue;
            }
            if word >> 32 == code {
                live.push(pid);
            }
        }
        live
    }

    /// The tensors of `buffer` as a state dict over the mapping.
    ///
    /// # Safety
    /// The state dict must not outlive this segment. Writing through it is only allowed with read-write
    /// buffers, on a buffer no reader holds (the applier's back buffer).
    pub(crate) unsafe fn buffer_state(&self, buffer: u8) -> StateDict {
        let mut state = StateDict::new();
        let base = usize::from(buffer & 1) * self.plan.stride;
        for e in &self.plan.entries {
            // SAFETY: `Plan` keeps every tensor inside its buffer, and both buffers inside the mapping; the
            // caller keeps the mapping alive and follows the slot protocol for writes.
            let storage =
                unsafe { Storage::borrowed(self.buffers.as_mut_ptr().add(base + e.offset), e.len) };
            let tensor = Tensor::from_storage(e.layout.clone(), storage, e.class);
            if let Ok(t) = tensor {
                state.insert(e.name.clone(), t);
            }
        }
        state
    }
}

/// Map `len` bytes of `file` at `offset` (page-aligned), read-write or read-only, pages faulted in.
fn map(file: &File, offset: usize, len: usize, writable: bool) -> Result<MmapRaw, SegmentError> {
    let mut opts = MmapOptions::new();
    opts.offset(offset as u64).len(len).populate();
    let mapped = if writable {
        opts.map_raw(file)
    } else {
        opts.map_raw_read_only(file)
    };
    mapped.map_err(|source| SegmentError::Io { op: "map", source })
}

/// Remove the name `name` (mappings live on); `false` when there was none.
pub(crate) fn unlink(name: &str) -> Result<bool, SegmentError> {
    match shm_unlink(shm_path(name).as_str()) {
        Ok(()) => Ok(true),
        Err(Errno::ENOENT) => Ok(false),
        Err(e) => Err(io("unlink", e)),
    }
}
