//! The same-host GPU channel's control messages ([`super`]): one place for their byte layout, encode and a
//! decode that answers bad bytes with a typed [`WireError`], never a panic.
//!
//! A frame is `len u32 LE` then `len` bytes of body (at most [`MAX_BODY`]):
//! ```text
//! 0 magic "RLCI" | 4 wire version u16 (= WIRE_VERSION) | 6 kind u8 | 7 zero u8 | 8 fields ... |
//! end-8 checksum u64 = xxh3_64(body[..end-8])
//! ```
//! Every integer is little-endian. Kinds and their fields:
//! - `Hello` (receiver → sender, at connect): rank u32, pid u32, device u32, ntensors u32, per tensor
//!   (numel u64, width u8) — the receiver's tensors, which must be the sender's, in order.
//! - `Setup` (sender → receiver, once): pid u32, device u32, the snapshot export (handle 64 B, bytes u64),
//!   ntensors u32, per tensor (numel u64, width u8, offset in the snapshot u64), nwidths u8, per width
//!   (width u8, ntiles u64, capacity u64, handle 64 B, bytes u64, dir/idx/vals offsets u64 ×3).
//! - `Refuse` (either way, at connect): reason code u16, details u64 ×3.
//! - `Ready` (receiver → sender): rank u32 — the handles are open.
//! - `Sync` (sender → receiver, per sync): seq u64, version u64, mode u8 (0 patch, 1 full copy), sent_ns
//!   u64 (the sender's CLOCK_MONOTONIC when it sent the message), nwidths u8, per width (width u8, changes
//!   u64, overflow u8, pool checksum u64). A full copy lists every width too: changes = the width's elements.
//! - `Ack` (receiver → sender, per sync): seq u64, status u8 (0 applied, 1 rejected), reason code u16,
//!   details u64 ×3, then the receiver's phases in ns ([`Timing`]: wake, drain, check, apply, each u64) and
//!   sent_ns u64 (the receiver's CLOCK_MONOTONIC when it sent the ack; the host's clock is shared by its
//!   processes, so the sender reads the ack's time in flight from it).
//!
//! What the checksums cover: the trailing xxh3 each control message. The device buffers a `Sync` describes
//! never leave the device; they are covered by its per-width pool checksum: `checksum_compact`
//! (`kernels/rlsync.cu`, reference `gpu/reference.rs`), seeded with the sync's sequence number, over the
//! directory's counts, every listed entry (its position and value words, keyed by its tile) and every
//! overflowing tile's elements in the sender's snapshot copy; for a full copy over every element of the
//! snapshot copy. The sender runs it right after its build, each receiver on the opened buffers before it
//! writes anything, and rejects the sync when the sum or the count differs ([`Reason::Checksum`],
//! [`Reason::Count`]): a stale pool (an earlier sequence number), a flipped bit or an entry listed under
//! another tile is caught before any write. Version 2 added the pool checksums and the timings.

use xxhash_rust::xxh3::xxh3_64;

use crate::gpu::{IPC_HANDLE_BYTES, IpcHandle};

/// The first bytes of every body.
pub const MAGIC: [u8; 4] = *b"RLCI";
/// This layout's version; a peer speaking another one is refused.
pub const WIRE_VERSION: u16 = 2;
/// Largest body accepted (a setup of 100k tensors fits).
pub const MAX_BODY: usize = 4 << 20;
/// Header (magic, version, kind, zero) and checksum bytes of a body.
const HEADER: usize = 8;
const CHECKSUM: usize = 8;

/// Why bytes are no control message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("the message ends after {have} bytes, {need} needed")]
    Truncated { need: usize, have: usize },
    #[error("a message of {len} bytes is longer than the {max}-byte limit")]
    TooLong { len: usize, max: usize },
    #[error("not an rlsync GPU-channel message (magic {found:02x?})")]
    Magic { found: [u8; 4] },
    #[error("wire version {found}, this rlsync speaks {WIRE_VERSION}")]
    Version { found: u16 },
    #[error("unknown message kind {found}")]
    Kind { found: u8 },
    #[error("checksum mismatch: the message says {stated:#018x}, its bytes hash to {actual:#018x}")]
    Checksum { stated: u64, actual: u64 },
    #[error("field {field} has the invalid value {value}")]
    Field { field: &'static str, value: u64 },
    #[error("{extra} bytes follow the message's last field")]
    Trailing { extra: usize },
}

/// One synced tensor as both ends see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorFact {
    pub numel: u64,
    pub width: u8,
}

/// One exported device allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Export {
    pub handle: IpcHandle,
    pub bytes: u64,
}

/// One width's diff output, exported: its allocation holds the directory, the index and the value pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WidthExport {
    pub width: u8,
    pub ntiles: u64,
    /// Entries the pool holds.
    pub capacity: u64,
    pub buf: Export,
    pub dir_off: u64,
    pub idx_off: u64,
    pub vals_off: u64,
}

/// What a receiver needs once: the sender's exports and the layout facts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Setup {
    pub pid: u32,
    pub device: u32,
    pub snapshot: Export,
    pub tensors: Vec<TensorFact>,
    /// Byte offset of each tensor's copy in the snapshot allocation.
    pub offsets: Vec<u64>,
    pub widths: Vec<WidthExport>,
}

impl Setup {
    /// A full copy's work: (destination, offset of its copy in the snapshot image, bytes) of each tensor
    /// whose destination in `dsts` (layout order) is not 0 (0: held elsewhere, installed by another device).
    pub fn full_copies<'a>(
        &'a self,
        dsts: impl IntoIterator<Item = u64> + 'a,
    ) -> impl Iterator<Item = (u64, u64, u64)> + 'a {
        self.tensors
            .iter()
            .zip(dsts)
            .zip(&self.offsets)
            .filter(|((_, dst), _)| *dst != 0)
            .map(|((t, dst), &off)| (dst, off, t.numel * u64::from(t.width)))
    }
}

/// One width's result of a build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WidthCount {
    pub width: u8,
    /// The kernel's cursor: every change, also those of overflowing tiles.
    pub changes: u64,
    /// Some tile did not fit the pool (its elements are copied from the snapshot).
    pub overflow: bool,
    /// The sender's `checksum_compact` of the width's output (or of its snapshot copy, for a full copy).
    pub checksum: u64,
}

/// A receiver's phases of one sync, in nanoseconds (0 where a phase did not run).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Timing {
    /// The sync's `sent_ns` (the sender's clock) → the receiver had read the whole message.
    pub wake_ns: u64,
    /// Waiting for the work already queued on the receiver's stream (the caller's) before rlsync's.
    pub drain_ns: u64,
    /// The pool checksum: launch, kernel, stream sync, read back.
    pub check_ns: u64,
    /// The install (apply_compact, or the full copy): launches, kernels, stream sync.
    pub apply_ns: u64,
}

/// How a receiver installs a sync.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// apply_compact per width from the sender's diff output.
    Patch,
    /// Every tensor copied from the sender's snapshot (bootstrap, a late receiver).
    Full,
}

/// Why a receiver rejected a sync or refused a setup (code, details on the wire).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Reason {
    #[error("sequence number {seq} is not newer than the last one seen, {last}")]
    Stale { seq: u64, last: u64 },
    #[error("the sync lists {found} widths, the setup {expected}")]
    Widths { found: u64, expected: u64 },
    #[error(
        "width {width}: {changes} changes with overflow flag {overflow} against a pool of the setup"
    )]
    Capacity {
        width: u64,
        changes: u64,
        overflow: u64,
    },
    #[error("a patch before the first full copy")]
    NotBootstrapped,
    #[error("the message could not be read")]
    Corrupt,
    #[error("the device failed to install it")]
    Device,
    #[error("tensor {tensor} differs between the ends (or the tensor counts do: {detail})")]
    Tensors { tensor: u64, detail: u64 },
    #[error("rank {rank} is out of range or already connected")]
    Rank { rank: u64 },
    #[error("the setup's buffers do not fit its layout (item {item})")]
    Exports { item: u64 },
    #[error("the receiver could not open the sender's buffers")]
    Open,
    #[error(
        "width {width}: the pool checksum is {found:#018x} on the receiver, the sender's is {expected:#018x} (the device buffers changed or are stale)"
    )]
    Checksum {
        width: u64,
        expected: u64,
        found: u64,
    },
    #[error(
        "width {width}: the receiver counted {found} changes in the pool, the sender announced {expected}"
    )]
    Count {
        width: u64,
        expected: u64,
        found: u64,
    },
}

impl Reason {
    fn encode(&self) -> (u16, u64, u64, u64) {
        match *self {
            Reason::Stale { seq, last } => (1, seq, last, 0),
            // Code 2 (an older caller version) was retired: versions only label the weights.
            Reason::Widths { found, expected } => (3, found, expected, 0),
            Reason::Capacity {
                width,
                changes,
                overflow,
            } => (4, width, changes, overflow),
            Reason::NotBootstrapped => (5, 0, 0, 0),
            Reason::Corrupt => (6, 0, 0, 0),
            Reason::Device => (7, 0, 0, 0),
            Reason::Tensors { tensor, detail } => (8, tensor, detail, 0),
            Reason::Rank { rank } => (9, rank, 0, 0),
            Reason::Exports { item } => (10, item, 0, 0),
            Reason::Open => (11, 0, 0, 0),
            Reason::Checksum {
                width,
                expected,
                found,
            } => (12, width, expected, found),
            Reason::Count {
                width,
                expected,
                found,
            } => (13, width, expected, found),
        }
    }

    fn decode(code: u16, a: u64, b: u64, c: u64) -> Result<Reason, WireError> {
        Ok(match code {
            1 => Reason::Stale { seq: a, last: b },
            3 => Reason::Widths {
                found: a,
                expected: b,
            },
            4 => Reason::Capacity {
                width: a,
                changes: b,
                overflow: c,
            },
            5 => Reason::NotBootstrapped,
            6 => Reason::Corrupt,
            7 => Reason::Device,
            8 => Reason::Tensors {
                tensor: a,
                detail: b,
            },
            9 => Reason::Rank { rank: a },
            10 => Reason::Exports { item: a },
            11 => Reason::Open,
            12 => Reason::Checksum {
                width: a,
                expected: b,
                found: c,
            },
            13 => Reason::Count {
                width: a,
                expected: b,
                found: c,
            },
            other => {
                return Err(WireError::Field {
                    field: "reason",
                    value: u64::from(other),
                });
            }
        })
    }
}

/// A receiver's answer to a sync.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Applied,
    Rejected(Reason),
}

/// A control message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    Hello {
        rank: u32,
        pid: u32,
        device: u32,
        tensors: Vec<TensorFact>,
    },
    Setup(Setup),
    Refuse(Reason),
    Ready {
        rank: u32,
    },
    Sync {
        seq: u64,
        version: u64,
        mode: Mode,
        /// The sender's CLOCK_MONOTONIC at sending, in ns ([`monotonic_ns`]).
        sent_ns: u64,
        widths: Vec<WidthCount>,
    },
    Ack {
        seq: u64,
        status: Status,
        timing: Timing,
        /// The receiver's CLOCK_MONOTONIC at sending, in ns.
        sent_ns: u64,
    },
}

/// This host's CLOCK_MONOTONIC in ns (one clock for all its processes; 0 if it cannot be read).
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: writes one timespec owned by this frame.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    if rc != 0 {
        return 0;
    }
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}

const K_HELLO: u8 = 1;
const K_SETUP: u8 = 2;
const K_REFUSE: u8 = 3;
const K_READY: u8 = 4;
const K_SYNC: u8 = 5;
const K_ACK: u8 = 6;

impl Message {
    /// The message's kind as a word (errors name it).
    pub fn kind(&self) -> &'static str {
        match self {
            Message::Hello { .. } => "hello",
            Message::Setup(_) => "setup",
            Message::Refuse(_) => "refuse",
            Message::Ready { .. } => "ready",
            Message::Sync { .. } => "sync",
            Message::Ack { .. } => "ack",
        }
    }
}

struct Out(Vec<u8>);

impl Out {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn export(&mut self, e: &Export) {
        self.0.extend_from_slice(&e.handle.0);
        self.u64(e.bytes);
    }
    fn count(&mut self, n: usize) {
        self.u32(u32::try_from(n).unwrap_or(u32::MAX));
    }
}

/// The frame of `msg`: length prefix and body.
pub fn encode(msg: &Message) -> Vec<u8> {
    let mut o = Out(Vec::with_capacity(64));
    o.u32(0); // length, patched below
    o.0.extend_from_slice(&MAGIC);
    o.u16(WIRE_VERSION);
    let kind = match msg {
        Message::Hello { .. } => K_HELLO,
        Message::Setup(_) => K_SETUP,
        Message::Refuse(_) => K_REFUSE,
        Message::Ready { .. } => K_READY,
        Message::Sync { .. } => K_SYNC,
        Message::Ack { .. } => K_ACK,
    };
    o.u8(kind);
    o.u8(0);
    match msg {
        Message::Hello {
            rank,
            pid,
            device,
            tensors,
        } => {
            o.u32(*rank);
            o.u32(*pid);
            o.u32(*device);
            o.count(tensors.len());
            for t in tensors {
                o.u64(t.numel);
                o.u8(t.width);
            }
        }
        Message::Setup(s) => {
            o.u32(s.pid);
            o.u32(s.device);
            o.export(&s.snapshot);
            o.count(s.tensors.len());
            for (t, off) in s.tensors.iter().zip(&s.offsets) {
                o.u64(t.numel);
                o.u8(t.width);
                o.u64(*off);
            }
            o.u8(u8::try_from(s.widths.len()).unwrap_or(u8::MAX));
            for w in &s.widths {
                o.u8(w.width);
                o.u64(w.ntiles);
                o.u64(w.capacity);
                o.export(&w.buf);
                o.u64(w.dir_off);
                o.u64(w.idx_off);
                o.u64(w.vals_off);
            }
        }
        Message::Refuse(r) => {
            let (code, a, b, c) = r.encode();
            o.u16(code);
            o.u64(a);
            o.u64(b);
            o.u64(c);
        }
        Message::Ready { rank } => o.u32(*rank),
        Message::Sync {
            seq,
            version,
            mode,
            sent_ns,
            widths,
        } => {
            o.u64(*seq);
            o.u64(*version);
            o.u8(match mode {
                Mode::Patch => 0,
                Mode::Full => 1,
            });
            o.u64(*sent_ns);
            o.u8(u8::try_from(widths.len()).unwrap_or(u8::MAX));
            for w in widths {
                o.u8(w.width);
                o.u64(w.changes);
                o.u8(u8::from(w.overflow));
                o.u64(w.checksum);
            }
        }
        Message::Ack {
            seq,
            status,
            timing,
            sent_ns,
        } => {
            o.u64(*seq);
            let (st, (code, a, b, c)) = match status {
                Status::Applied => (0, (0, 0, 0, 0)),
                Status::Rejected(r) => (1, r.encode()),
            };
            o.u8(st);
            o.u16(code);
            o.u64(a);
            o.u64(b);
            o.u64(c);
            for v in [
                timing.wake_ns,
                timing.drain_ns,
                timing.check_ns,
                timing.apply_ns,
            ] {
                o.u64(v);
            }
            o.u64(*sent_ns);
        }
    }
    let sum = xxh3_64(&o.0[4..]);
    o.u64(sum);
    let len = (o.0.len() - 4) as u32;
    o.0[..4].copy_from_slice(&len.to_le_bytes());
    o.0
}

/// The body length a frame's 4-byte prefix announces, checked against [`MAX_BODY`].
pub fn body_len(prefix: [u8; 4]) -> Result<usize, WireError> {
    let len = u32::from_le_bytes(prefix) as usize;
    if len > MAX_BODY {
        return Err(WireError::TooLong { len, max: MAX_BODY });
    }
    if len < HEADER + CHECKSUM {
        return Err(WireError::Truncated {
            need: HEADER + CHECKSUM,
            have: len,
        });
    }
    Ok(len)
}

struct In<'a> {
    b: &'a [u8],
    at: usize,
}

impl In<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], WireError> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len());
        let Some(end) = end else {
            return Err(WireError::Truncated {
                need: self.at.saturating_add(n),
                have: self.b.len(),
            });
        };
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, WireError> {
        let mut a = [0; 2];
        a.copy_from_slice(self.take(2)?);
        Ok(u16::from_le_bytes(a))
    }
    fn u32(&mut self) -> Result<u32, WireError> {
        let mut a = [0; 4];
        a.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(a))
    }
    fn u64(&mut self) -> Result<u64, WireError> {
        let mut a = [0; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }
    fn export(&mut self) -> Result<Export, WireError> {
        let mut h = [0u8; IPC_HANDLE_BYTES];
        h.copy_from_slice(self.take(IPC_HANDLE_BYTES)?);
        Ok(Export {
            handle: IpcHandle(h),
            bytes: self.u64()?,
        })
    }
    /// A count of items of at least `item` bytes each (refused when the rest cannot hold them).
    fn count(&mut self, n: u64, item: usize, field: &'static str) -> Result<usize, WireError> {
        let rest = (self.b.len() - self.at) as u64;
        if n.saturating_mul(item as u64) > rest {
            return Err(WireError::Field { field, value: n });
        }
        Ok(n as usize)
    }
    fn width(&mut self) -> Result<u8, WireError> {
        let w = self.u8()?;
        if [1, 2, 4, 8].contains(&w) {
            Ok(w)
        } else {
            Err(WireError::Field {
                field: "width",
                value: u64::from(w),
            })
        }
    }
}

/// The message in `body` (a frame without its length prefix): checksum, magic, version and kind checked,
/// every field read in bounds, nothing left over.
pub fn decode(body: &[u8]) -> Result<Message, WireError> {
    if body.len() > MAX_BODY {
        return Err(WireError::TooLong {
            len: body.len(),
            max: MAX_BODY,
        });
    }
    if body.len() < HEADER + CHECKSUM {
        return Err(WireError::Truncated {
            need: HEADER + CHECKSUM,
            have: body.len(),
        });
    }
    let (content, tail) = body.split_at(body.len() - CHECKSUM);
    let mut magic = [0; 4];
    magic.copy_from_slice(&content[..4]);
    if magic != MAGIC {
        return Err(WireError::Magic { found: magic });
    }
    let mut sum = [0; 8];
    sum.copy_from_slice(tail);
    let (stated, actual) = (u64::from_le_bytes(sum), xxh3_64(content));
    if stated != actual {
        return Err(WireError::Checksum { stated, actual });
    }
    let mut i = In { b: content, at: 4 };
    let version = i.u16()?;
    if version != WIRE_VERSION {
        return Err(WireError::Version { found: version });
    }
    let kind = i.u8()?;
    let zero = i.u8()?;
    if zero != 0 {
        return Err(WireError::Field {
            field: "reserved",
            value: u64::from(zero),
        });
    }
    let msg = match kind {
        K_HELLO => {
            let (rank, pid, device) = (i.u32()?, i.u32()?, i.u32()?);
            let n = i.u32()?;
            let n = i.count(u64::from(n), 9, "tensors")?;
            let mut tensors = Vec::with_capacity(n);
            for _ in 0..n {
                tensors.push(TensorFact {
                    numel: i.u64()?,
                    width: i.width()?,
                });
            }
            Message::Hello {
                rank,
                pid,
                device,
                tensors,
            }
        }
        K_SETUP => {
            let (pid, device) = (i.u32()?, i.u32()?);
            let snapshot = i.export()?;
            let n = i.u32()?;
            let n = i.count(u64::from(n), 17, "tensors")?;
            let (mut tensors, mut offsets) = (Vec::with_capacity(n), Vec::with_capacity(n));
            for _ in 0..n {
                tensors.push(TensorFact {
                    numel: i.u64()?,
                    width: i.width()?,
                });
                offsets.push(i.u64()?);
            }
            let nw = i.u8()?;
            if nw > 4 {
                return Err(WireError::Field {
                    field: "widths",
                    value: u64::from(nw),
                });
            }
            let mut widths = Vec::with_capacity(nw as usize);
            for _ in 0..nw {
                widths.push(WidthExport {
                    width: i.width()?,
                    ntiles: i.u64()?,
                    capacity: i.u64()?,
                    buf: i.export()?,
                    dir_off: i.u64()?,
                    idx_off: i.u64()?,
                    vals_off: i.u64()?,
                });
            }
            Message::Setup(Setup {
                pid,
                device,
                snapshot,
                tensors,
                offsets,
                widths,
            })
        }
        K_REFUSE => {
            let code = i.u16()?;
            let (a, b, c) = (i.u64()?, i.u64()?, i.u64()?);
            Message::Refuse(Reason::decode(code, a, b, c)?)
        }
        K_READY => Message::Ready { rank: i.u32()? },
        K_SYNC => {
            let (seq, version) = (i.u64()?, i.u64()?);
            let mode = match i.u8()? {
                0 => Mode::Patch,
                1 => Mode::Full,
                m => {
                    return Err(WireError::Field {
                        field: "mode",
                        value: u64::from(m),
                    });
                }
            };
            let sent_ns = i.u64()?;
            let nw = i.u8()?;
            if nw > 4 {
                return Err(WireError::Field {
                    field: "widths",
                    value: u64::from(nw),
                });
            }
            let mut widths = Vec::with_capacity(nw as usize);
            for _ in 0..nw {
                let width = i.width()?;
                let changes = i.u64()?;
                let overflow = match i.u8()? {
                    0 => false,
                    1 => true,
                    o => {
                        return Err(WireError::Field {
                            field: "overflow",
                            value: u64::from(o),
                        });
                    }
                };
                widths.push(WidthCount {
                    width,
                    changes,
                    overflow,
                    checksum: i.u64()?,
                });
            }
            Message::Sync {
                seq,
                version,
                mode,
                sent_ns,
                widths,
            }
        }
        K_ACK => {
            let seq = i.u64()?;
            let st = i.u8()?;
            let code = i.u16()?;
            let (a, b, c) = (i.u64()?, i.u64()?, i.u64()?);
            let status = match st {
                0 => Status::Applied,
                1 => Status::Rejected(Reason::decode(code, a, b, c)?),
                s => {
                    return Err(WireError::Field {
                        field: "status",
                        value: u64::from(s),
                    });
                }
            };
            let timing = Timing {
                wake_ns: i.u64()?,
                drain_ns: i.u64()?,
                check_ns: i.u64()?,
                apply_ns: i.u64()?,
            };
            Message::Ack {
                seq,
                status,
                timing,
                sent_ns: i.u64()?,
            }
        }
        other => return Err(WireError::Kind { found: other }),
    };
    if i.at != content.len() {
        return Err(WireError::Trailing {
            extra: content.len() - i.at,
        });
    }
    Ok(msg)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn handle(seed: u8) -> IpcHandle {
        IpcHandle(std::array::from_fn(|k| seed.wrapping_add(k as u8)))
    }

    pub(crate) fn samples() -> Vec<Message> {
        let setup = Setup {
            pid: 4242,
            device: 1,
            snapshot: Export {
                handle: handle(7),
                bytes: 1 << 33,
            },
            tensors: vec![
                TensorFact {
                    numel: 4096 * 3 + 5,
                    width: 2,
                },
                TensorFact { numel: 0, width: 4 },
            ],
            offsets: vec![0, 24832],
            widths: vec![WidthExport {
                width: 2,
                ntiles: 4,
                capacity: 65536,
                buf: Export {
                    handle: handle(99),
                    bytes: 1 << 20,
                },
                dir_off: 0,
                idx_off: 256,
                vals_off: 262400,
            }],
        };
        vec![
            Message::Hello {
                rank: 3,
                pid: 17,
                device: 0,
                tensors: setup.tensors.clone(),
            },
            Message::Setup(setup),
            Message::Refuse(Reason::Tensors {
                tensor: 2,
                detail: 9,
            }),
            Message::Ready { rank: 1 },
            Message::Sync {
                seq: 12,
                version: u64::MAX,
                mode: Mode::Patch,
                sent_ns: 123_456_789,
                widths: vec![
                    WidthCount {
                        width: 2,
                        changes: 77,
                        overflow: false,
                        checksum: 0xdead_beef_0123_4567,
                    },
                    WidthCount {
                        width: 8,
                        changes: 1 << 40,
                        overflow: true,
                        checksum: u64::MAX,
                    },
                ],
            },
            Message::Sync {
                seq: 1,
                version: 0,
                mode: Mode::Full,
                sent_ns: 0,
                widths: vec![WidthCount {
                    width: 4,
                    changes: 1000,
                    overflow: false,
                    checksum: 5,
                }],
            },
            Message::Ack {
                seq: 12,
                status: Status::Applied,
                timing: Timing {
                    wake_ns: 1,
                    drain_ns: 2,
                    check_ns: 3,
                    apply_ns: u64::MAX,
                },
                sent_ns: 99,
            },
            Message::Ack {
                seq: 13,
                status: Status::Rejected(Reason::Capacity {
                    width: 2,
                    changes: 5,
                    overflow: 1,
                }),
                timing: Timing::default(),
                sent_ns: 0,
            },
            Message::Ack {
                seq: 13,
                status: Status::Rejected(Reason::Stale { seq: 4, last: 9 }),
                timing: Timing::default(),
                sent_ns: 7,
            },
            Message::Ack {
                seq: 14,
                status: Status::Rejected(Reason::Checksum {
                    width: 2,
                    expected: 0x0123_4567_89ab_cdef,
                    found: 17,
                }),
                timing: Timing::default(),
                sent_ns: 7,
            },
            Message::Ack {
                seq: 15,
                status: Status::Rejected(Reason::Count {
                    width: 8,
                    expected: 10,
                    found: 11,
                }),
                timing: Timing::default(),
                sent_ns: 7,
            },
        ]
    }

    fn body(frame: &[u8]) -> &[u8] {
        let len = body_len(frame[..4].try_into().unwrap()).unwrap();
        assert_eq!(len, frame.len() - 4);
        &frame[4..]
    }

    #[test]
    fn every_message_round_trips() {
        for m in samples() {
            let frame = encode(&m);
            assert_eq!(decode(body(&frame)), Ok(m.clone()), "{}", m.kind());
        }
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        for m in samples() {
            let frame = encode(&m);
            let b = body(&frame);
            for cut in 0..b.len() {
                assert!(decode(&b[..cut]).is_err(), "{} cut at {cut}", m.kind());
            }
        }
    }

    #[test]
    fn every_flipped_bit_is_caught() {
        for m in samples() {
            let frame = encode(&m);
            let b = body(&frame).to_vec();
            for byte in 0..b.len() {
                for bit in 0..8 {
                    let mut c = b.clone();
                    c[byte] ^= 1 << bit;
                    assert!(decode(&c).is_err(), "{} byte {byte} bit {bit}", m.kind());
                }
            }
        }
    }

    /// A body with a valid checksum over `content` (magic, version, kind, fields).
    fn sealed(content: &[u8]) -> Vec<u8> {
        let mut b = content.to_vec();
        b.extend_from_slice(&xxh3_64(content).to_le_bytes());
        b
    }

    #[test]
    fn well_sealed_but_wrong_bodies_name_what_is_wrong() {
        let mut c = MAGIC.to_vec();
        c.extend_from_slice(&1u16.to_le_bytes()); // the previous version (no pool checksums)
        c.extend_from_slice(&[K_READY, 0, 1, 0, 0, 0]);
        assert_eq!(decode(&sealed(&c)), Err(WireError::Version { found: 1 }));
        c[4..6].copy_from_slice(&WIRE_VERSION.to_le_bytes());
        c[6] = 42;
        assert_eq!(decode(&sealed(&c)), Err(WireError::Kind { found: 42 }));
        c[6] = K_READY;
        assert_eq!(
            decode(&sealed(&c)),
            Ok(Message::Ready { rank: 1 }),
            "the base body is valid"
        );
        c.push(0);
        assert_eq!(decode(&sealed(&c)), Err(WireError::Trailing { extra: 1 }));
        // A sync claiming a width of 3 bytes; a hello claiming 2^32-1 tensors in a short body.
        let mut s = encode(&Message::Sync {
            seq: 1,
            version: 1,
            mode: Mode::Patch,
            sent_ns: 0,
            widths: vec![WidthCount {
                width: 2,
                changes: 0,
                overflow: false,
                checksum: 0,
            }],
        })[4..]
            .to_vec();
        s.truncate(s.len() - CHECKSUM);
        s[8 + 26] = 3;
        assert_eq!(
            decode(&sealed(&s)),
            Err(WireError::Field {
                field: "width",
                value: 3
            })
        );
        let mut h = MAGIC.to_vec();
        h.extend_from_slice(&WIRE_VERSION.to_le_bytes());
        h.extend_from_slice(&[K_HELLO, 0]);
        h.extend_from_slice(&[0; 12]);
        h.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            decode(&sealed(&h)),
            Err(WireError::Field {
                field: "tensors",
                ..
            })
        ));
        assert!(matches!(
            body_len((MAX_BODY as u32 + 1).to_le_bytes()),
            Err(WireError::TooLong { .. })
        ));
        assert!(matches!(
            body_len(3u32.to_le_bytes()),
            Err(WireError::Truncated { .. })
        ));
    }
}
