//! The same-host GPU channel: one sender's diff output shared with N receiver processes of the host through
//! CUDA IPC handles, and a small control protocol over a 0600 Unix socket ([`wire`]).
//!
//! The sender owns (rlsync's `cuMemAlloc`, never PyTorch's memory) the device snapshot copy, one allocation
//! for every tensor, and per element width one allocation holding `diff_compact`'s directory, index and
//! value pool. Each receiver opens their handles once at connect (on its own device: the sender's GPU or
//! another one of the host, peer access enabled lazily). Per sync the sender builds on the device
//! (`diff_compact`, then `checksum_compact` over its output seeded with the sync's sequence number, on the
//! caller's stream, then one stream sync; only the per-width cursors and checksums come back to the host),
//! sends a [`wire::Message::Sync`] (sequence number, version, per-width change count, overflow flag and pool
//! checksum; the message itself checksummed) to every receiver and waits for every ack; the buffers are not
//! rewritten before all acks (one version in flight). A receiver validates the message before writing
//! anything (sequence newer than the last, a full copy first, widths and counts within the setup's
//! capacities), waits for the work already on its stream, runs `checksum_compact` over the opened buffers and
//! compares sum and count with the message's ([`wire::Reason::Checksum`], [`wire::Reason::Count`]), then runs
//! `apply_compact` per width into its tensors (overflowing tiles copied from the sender's snapshot copy) on
//! its stream, syncs and acks with its phases' times ([`wire::Timing`], per receiver in
//! [`SyncReport::per_receiver`]). A rejected message leaves its tensors untouched. The sender checks its own
//! build first: where its checksum counted other entries than `diff_compact`'s cursor in a width, its pool is
//! not what the message would announce (a kernel fault, a race), so it sends no patch: it sets the snapshot
//! copy to the state again and sends this sync as a full copy ([`SyncReport::fallbacks`], a warning each).
//!
//! Bootstrap: the first sync (or [`IpcSender::bootstrap`]) sets the snapshot copy to the state and sends a
//! full copy ([`wire::Mode::Full`]): each receiver copies every tensor from the imported snapshot, so the
//! receivers start equal to the sender. A receiver that connects later (up to the announced count) is
//! admitted at the start of the next sync with a full copy of the current snapshot. What a full copy
//! verifies: the sender hashes its whole snapshot copy (`checksum_compact` in full mode, seeded with the
//! message's sequence number) and each receiver hashes the opened snapshot copy the same way before it
//! copies anything; the copy itself (`cuMemcpyDtoD` from the verified source) is not hashed again, so the
//! previous weights stay when the source does not match. A receiver that rejected a patch for its checksum is
//! kept and gets a full copy at the start of the next sync (its tensors are still the previous version).
//!
//! Failures: a receiver that dies is noticed at once (EOF on its socket) and its sync ends with an error
//! naming the rank ([`IpcError::Receiver`]); so does a rejection or a missed ack deadline. A failed receiver
//! is dropped from the set (it may reconnect and gets a full copy). The sender's buffers are freed when it
//! drops, after every receiver closed its mappings: the sender ends the stream to each, a receiver closes its
//! mappings on reading that end (or on drop) and then its side, and the sender waits for that (bounded);
//! mappings of a dead receiver are released by the driver with its process. The socket file is removed when
//! the sender drops.
//!
//! Elastic receivers ([`IpcSender::set_elastic`], restartable rollouts): a receiver whose socket closed (its
//! process died) is dropped with a warning instead, and the sync succeeds for the others
//! ([`SyncReport::dropped`]), and the bootstrap goes on without a receiver that did not connect in time
//! ([`IpcSender::set_connect_wait`]); a successor comes back by [`IpcSender::rejoin`], which forgets the
//! predecessor (also its ack of a detached sync), waits for the newcomer's connection and gives it a full copy
//! of the snapshot copy at the current version at once, its ack waited for; the others see nothing of it. A
//! rejection or a missed ack deadline is still the sync's error.
//!
//! The device work hides behind [`SenderDevice`] and [`ReceiverDevice`], so the protocol and lifecycle are
//! tested on the CPU with the reference kernels ([`super::reference`]); [`CudaSender`] and [`CudaReceiver`] are
//! the CUDA implementations.

pub mod cast;
pub mod reference;
pub mod wire;

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::GpuError;
use super::compact::{self, Layout, TileDir};
use super::reference::PoolSum;
use crate::tensor::DType;
use wire::{
    Export, Message, Mode, Reason, Setup, Status, TensorFact, Timing, WidthCount, WidthExport,
    monotonic_ns,
};

/// Fraction of a width's elements its pool holds (as the host-path builder).
const POOL_DENSITY: u64 = super::differ::POOL_DENSITY;
/// Smallest pool, in entries.
const MIN_POOL: u64 = 1 << 16;
/// Alignment of every sub-buffer in an exported allocation.
const ALIGN: u64 = 256;

/// Why the channel failed.
#[derive(Debug, thiserror::Error)]
pub enum IpcError {
    #[error("the socket {path}")]
    Socket {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the socket's directory {dir} does not exist")]
    NoDir { dir: PathBuf },
    #[error(
        "the socket path {path} is {len} bytes, more than the {max} a Unix socket address holds; choose a shorter socket directory",
        max = crate::transport::shm::MAX_SOCKET_PATH
    )]
    PathTooLong { path: PathBuf, len: usize },
    #[error("another sender listens on {path}")]
    InUse { path: PathBuf },
    #[error("{missing} of {expected} receiver(s) did not connect within {secs:.1} s")]
    Connect {
        missing: usize,
        expected: usize,
        secs: f64,
    },
    #[error("receiver rank {rank}")]
    Receiver {
        rank: u32,
        #[source]
        source: PeerError,
    },
    #[error("the sender")]
    Sender {
        #[source]
        source: PeerError,
    },
    #[error("the receiver rejected a sync: {reason}")]
    Rejected { reason: Reason },
    #[error("receiver rank {rank} rejoins before the first full copy (the bootstrap admits it)")]
    NotBootstrapped { rank: u32 },
    #[error(
        "the state has {found} tensors (or other shapes) than the channel's layout ({expected})"
    )]
    State { found: usize, expected: usize },
    #[error("the channel's tensor layout")]
    Layout(#[from] compact::CompactError),
    #[error(transparent)]
    Gpu(#[from] GpuError),
}

/// What went wrong with one peer.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    #[error("closed its end of the socket")]
    Closed,
    #[error("sent no message within {secs:.1} s")]
    Timeout { secs: f64 },
    #[error("did not connect within {secs:.1} s")]
    NotConnected { secs: f64 },
    #[error("socket i/o")]
    Io(#[source] std::io::Error),
    #[error("sent a bad message")]
    Wire(#[source] wire::WireError),
    #[error("sent a {found} message where a {expected} was due")]
    Unexpected {
        found: &'static str,
        expected: &'static str,
    },
    #[error("acknowledged sequence number {found}, {expected} was due")]
    WrongAck { found: u64, expected: u64 },
    #[error("rejected it: {0}")]
    Rejected(Reason),
    #[error("refused the connection: {0}")]
    Refused(Reason),
}

/// Write one message.
fn send(s: &mut UnixStream, msg: &Message) -> Result<(), PeerError> {
    s.write_all(&wire::encode(msg)).map_err(|e| match e.kind() {
        std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset => PeerError::Closed,
        _ => PeerError::Io(e),
    })
}

/// Read one message before `deadline` (a timeout names `secs`, the wait's length).
fn recv(s: &mut UnixStream, deadline: Instant, secs: f64) -> Result<Message, PeerError> {
    let mut prefix = [0u8; 4];
    let timed = |e| match e {
        PeerError::Timeout { .. } => PeerError::Timeout { secs },
        e => e,
    };
    read_full(s, &mut prefix, deadline).map_err(timed)?;
    let len = wire::body_len(prefix).map_err(PeerError::Wire)?;
    let mut body = vec![0u8; len];
    read_full(s, &mut body, deadline).map_err(timed)?;
    wire::decode(&body).map_err(PeerError::Wire)
}

fn read_full(s: &mut UnixStream, buf: &mut [u8], deadline: Instant) -> Result<(), PeerError> {
    let mut at = 0;
    while at < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(PeerError::Timeout { secs: 0.0 });
        }
        s.set_read_timeout(Some(left)).map_err(PeerError::Io)?;
        match s.read(&mut buf[at..]) {
            Ok(0) => return Err(PeerError::Closed),
            Ok(n) => at += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                return Err(PeerError::Closed);
            }
            Err(e) => return Err(PeerError::Io(e)),
        }
    }
    Ok(())
}

/// The layout facts of `layout` for the wire.
pub(crate) fn facts(layout: &Layout) -> Vec<TensorFact> {
    layout
        .tensors()
        .iter()
        .map(|t| TensorFact {
            numel: t.numel,
            width: t.width as u8,
        })
        .collect()
}

/// Where each tensor's copy lies in one snapshot allocation, and its size.
pub(crate) fn snapshot_offsets(layout: &Layout) -> (Vec<u64>, u64) {
    let mut at = 0u64;
    let offs = layout
        .tensors()
        .iter()
        .map(|t| {
            let off = at;
            at = (at + t.numel * t.width as u64).next_multiple_of(ALIGN);
            off
        })
        .collect();
    (offs, at)
}

/// The sizes of one width's export: (bytes, dir, idx, vals offsets, capacity).
fn width_plan(layout: &Layout, width: usize) -> (u64, u64, u64, u64, u64) {
    let ntiles = layout.ntiles(width);
    let numel: u64 = layout.tensors_of(width).map(|t| t.numel).sum();
    let capacity = (numel / POOL_DENSITY).max(MIN_POOL).min(numel.max(1));
    let words = if width == 8 { 2 } else { 1 };
    let dir_off = 0;
    let idx_off = (ntiles * size_of::<TileDir>() as u64).next_multiple_of(ALIGN);
    let vals_off = (idx_off + capacity * 4).next_multiple_of(ALIGN);
    let bytes = vals_off + capacity * 8 * words;
    (bytes, dir_off, idx_off, vals_off, capacity)
}

/// One width's export as [`width_plan`] lays it out, its allocation exported as `handle`.
pub(crate) fn width_export(
    layout: &Layout,
    width: usize,
    handle: crate::gpu::IpcHandle,
) -> WidthExport {
    let (bytes, dir_off, idx_off, vals_off, capacity) = width_plan(layout, width);
    WidthExport {
        width: width as u8,
        ntiles: layout.ntiles(width),
        capacity,
        buf: Export { handle, bytes },
        dir_off,
        idx_off,
        vals_off,
    }
}

/// Check a setup against the receiver's own layout before opening anything: same tensors, every sub-buffer
/// inside its allocation, sized for its width's tiles and pool.
fn check_setup(setup: &Setup, layout: &Layout) -> Result<(), Reason> {
    let mine = facts(layout);
    if setup.tensors.len() != mine.len() || setup.offsets.len() != mine.len() {
        return Err(Reason::Tensors {
            tensor: u64::MAX,
            detail: setup.tensors.len() as u64,
        });
    }
    for (k, ((a, b), &off)) in setup
        .tensors
        .iter()
        .zip(&mine)
        .zip(&setup.offsets)
        .enumerate()
    {
        if a != b {
            return Err(Reason::Tensors {
                tensor: k as u64,
                detail: a.numel,
            });
        }
        let end = a
            .numel
            .checked_mul(u64::from(a.width))
            .and_then(|n| n.checked_add(off));
        if end.is_none_or(|e| e > setup.snapshot.bytes) || !off.is_multiple_of(u64::from(a.width)) {
            return Err(Reason::Exports { item: k as u64 });
        }
    }
    let widths: Vec<usize> = layout.widths().collect();
    if setup.widths.len() != widths.len() {
        return Err(Reason::Widths {
            found: setup.widths.len() as u64,
            expected: widths.len() as u64,
        });
    }
    for (k, (w, &mine)) in setup.widths.iter().zip(&widths).enumerate() {
        let item = (setup.tensors.len() + k) as u64;
        let words = if mine == 8 { 2 } else { 1 };
        let fits = |off: u64, len: Option<u64>| {
            len.and_then(|l| l.checked_add(off))
                .is_some_and(|e| e <= w.buf.bytes)
                && off.is_multiple_of(8)
        };
        if usize::from(w.width) != mine
            || w.ntiles != layout.ntiles(mine)
            || w.capacity == 0
            || !fits(w.dir_off, w.ntiles.checked_mul(size_of::<TileDir>() as u64))
            || !fits(w.idx_off, w.capacity.checked_mul(4))
            || !fits(w.vals_off, w.capacity.checked_mul(8 * words))
        {
            return Err(Reason::Exports { item });
        }
    }
    Ok(())
}

/// Check a sync against the setup and the receiver's history; nothing is written before it passes.
fn check_sync(
    setup: &Setup,
    seq: u64,
    _version: u64,
    mode: Mode,
    widths: &[WidthCount],
    last_seq: u64,
    installed: Option<u64>,
) -> Result<(), Reason> {
    if seq <= last_seq {
        return Err(Reason::Stale {
            seq,
            last: last_seq,
        });
    }
    // The caller's version only labels the weights (any value, as RLinf's runners use it: repeats, jumps,
    // even lower); the sequence number above orders the messages. `installed` only says whether a full copy
    // came first.
    if installed.is_none() && mode == Mode::Patch {
        return Err(Reason::NotBootstrapped);
    }
    if widths.len() != setup.widths.len() {
        return Err(Reason::Widths {
            found: widths.len() as u64,
            expected: setup.widths.len() as u64,
        });
    }
    if mode == Mode::Full {
        // A full copy announces every width's element count (what its checksum counts).
        for (c, w) in widths.iter().zip(&setup.widths) {
            let elements = elements_of(&setup.tensors, w.width);
            if c.width != w.width || c.overflow || c.changes != elements {
                return Err(Reason::Capacity {
                    width: u64::from(c.width),
                    changes: c.changes,
                    overflow: u64::from(c.overflow),
                });
            }
        }
        return Ok(());
    }
    for (c, w) in widths.iter().zip(&setup.widths) {
        if c.width != w.width || c.overflow != (c.changes > w.capacity) {
            return Err(Reason::Capacity {
                width: u64::from(c.width),
                changes: c.changes,
                overflow: u64::from(c.overflow),
            });
        }
    }
    Ok(())
}

/// Elements of the tensors of `width` bytes.
fn elements_of(tensors: &[TensorFact], width: u8) -> u64 {
    tensors
        .iter()
        .filter(|t| t.width == width)
        .map(|t| t.numel)
        .sum()
}

/// The first mismatch between what a receiver's checksum found and what the sync announced.
fn check_sums(widths: &[WidthCount], found: &[PoolSum]) -> Result<(), Reason> {
    if found.len() != widths.len() {
        return Err(Reason::Widths {
            found: found.len() as u64,
            expected: widths.len() as u64,
        });
    }
    for (w, f) in widths.iter().zip(found) {
        if f.count != w.changes {
            return Err(Reason::Count {
                width: u64::from(w.width),
                expected: w.changes,
                found: f.count,
            });
        }
        if f.sum != w.checksum {
            return Err(Reason::Checksum {
                width: u64::from(w.width),
                expected: w.checksum,
                found: f.sum,
            });
        }
    }
    Ok(())
}

/// One width's result of a sender's build.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WidthBuilt {
    /// `diff_compact`'s cursor (every change, also those of overflowing tiles).
    pub cursor: u64,
    /// `checksum_compact` over the output just built.
    pub sum: PoolSum,
}

/// The sender's device work.
pub trait SenderDevice {
    /// Allocate the snapshot copy (one allocation, tensor `k` at `offsets[k]`) and each width's output
    /// buffer (per [`width_plan`]) for `layout`; their exports.
    fn prepare(
        &mut self,
        layout: &Layout,
        offsets: &[u64],
        snapshot_bytes: u64,
    ) -> Result<(Export, Vec<WidthExport>), GpuError>;
    /// Snapshot copy := state, waited for.
    fn bootstrap(&mut self, layout: &Layout, offsets: &[u64]) -> Result<(), GpuError>;
    /// `diff_compact` per width (state against the snapshot copy, which it updates), then `checksum_compact`
    /// over its output seeded with `seed`, waited for; each width's cursor and checksum in the order of the
    /// exports.
    fn build(
        &mut self,
        layout: &Layout,
        offsets: &[u64],
        seed: u64,
    ) -> Result<Vec<WidthBuilt>, GpuError>;
    /// `checksum_compact` in full mode over the snapshot copy, seeded with `seed`, per width, waited for.
    fn snapshot_sum(
        &mut self,
        layout: &Layout,
        offsets: &[u64],
        seed: u64,
    ) -> Result<Vec<PoolSum>, GpuError>;
    /// The device ordinal (informational, in the setup).
    fn device(&self) -> u32;
    /// The state checksum ([`crate::tensor::state_checksum`]) of the tensors the last bootstrap or build
    /// read: what every receiver holds once it acked (a cast copy in the receivers' dtype where the sender
    /// casts), each named by `names[k]` (key, the receivers' dtype and shape, in layout order).
    fn state_checksum(&mut self, names: &[(String, DType, Vec<usize>)]) -> Result<u64, GpuError>;
}

/// The receiver's device work. A tensor whose address the caller set to 0 is held elsewhere (a receiver
/// whose tensors live on several devices installs each device's share through its own device): `full` and
/// `apply` write nothing of it; the checksums, which read the payload, cover it.
pub trait ReceiverDevice {
    /// Open the setup's allocations (closed on drop).
    fn open(&mut self, setup: &Setup) -> Result<(), GpuError>;
    /// Every tensor := its copy in the sender's snapshot, waited for.
    fn full(&mut self, setup: &Setup) -> Result<(), GpuError>;
    /// `apply_compact` per width of the setup ([`Layout::install_jobs`]), waited for.
    fn apply(&mut self, setup: &Setup, layout: &Layout) -> Result<(), GpuError>;
    /// Wait for the work already queued on the receiver's stream (the caller's), so the phases after it time
    /// rlsync's work only.
    fn drain(&mut self) -> Result<(), GpuError>;
    /// `checksum_compact` per width of the setup over the opened buffers (with `full`, over the opened
    /// snapshot copy), seeded with `seed`, waited for.
    fn checksum(
        &mut self,
        setup: &Setup,
        layout: &Layout,
        seed: u64,
        full: bool,
    ) -> Result<Vec<PoolSum>, GpuError>;
    /// The device ordinal (informational, in the hello).
    fn device(&self) -> u32;
    /// Close the opened allocations now: the sender is closing the channel, and CUDA leaves an exporter's
    /// free of an allocation that importers still have open undefined. Drop closes them otherwise.
    fn close(&mut self) {}
}

/// A boxed device is a device (the worker runtime holds the one its workload opened).
impl<D: SenderDevice + ?Sized> SenderDevice for Box<D> {
    fn prepare(
        &mut self,
        layout: &Layout,
        offsets: &[u64],
        snapshot_bytes: u64,
    ) -> Result<(Export, Vec<WidthExport>), GpuError> {
        (**self).prepare(layout, offsets, snapshot_bytes)
    }
    fn bootstrap(&mut self, layout: &Layout, offsets: &[u64]) -> Result<(), GpuError> {
        (**self).bootstrap(layout, offsets)
    }
    fn build(
        &mut self,
        layout: &Layout,
        offsets: &[u64],
        seed: u64,
    ) -> Result<Vec<WidthBuilt>, GpuError> {
        (**self).build(layout, offsets, seed)
    }
    fn snapshot_sum(
        &mut self,
        layout: &Layout,
        offsets: &[u64],
        seed: u64,
    ) -> Result<Vec<PoolSum>, GpuError> {
        (**self).snapshot_sum(layout, offsets, seed)
    }
    fn device(&self) -> u32 {
        (**self).device()
    }
    fn state_checksum(&mut self, names: &[(String, DType, Vec<usize>)]) -> Result<u64, GpuError> {
        (**self).state_checksum(names)
    }
}

impl<D: ReceiverDevice + ?Sized> ReceiverDevice for Box<D> {
    fn open(&mut self, setup: &Setup) -> Result<(), GpuError> {
        (**self).open(setup)
    }
    fn full(&mut self, setup: &Setup) -> Result<(), GpuError> {
        (**self).full(setup)
    }
    fn apply(&mut self, setup: &Setup, layout: &Layout) -> Result<(), GpuError> {
        (**self).apply(setup, layout)
    }
    fn drain(&mut self) -> Result<(), GpuError> {
        (**self).drain()
    }
    fn checksum(
        &mut self,
        setup: &Setup,
        layout: &Layout,
        seed: u64,
        full: bool,
    ) -> Result<Vec<PoolSum>, GpuError> {
        (**self).checksum(setup, layout, seed, full)
    }
    fn device(&self) -> u32 {
        (**self).device()
    }
    fn close(&mut self) {
        (**self).close()
    }
}

/// Which receivers an accept waits for.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Until {
    /// As many as announced.
    Announced,
    /// These ranks (an elastic bootstrap: the list shrinks as ranks are known gone).
    Ranks(Vec<u32>),
    /// This rank (a rejoin).
    Rank(u32),
}

/// A connected receiver.
struct Peer {
    rank: u32,
    stream: UnixStream,
    /// Admitted, its tensors not yet a copy of the snapshot: the next sync starts with a full copy for it.
    fresh: bool,
}

/// Where one receiver's part of a sync went, in seconds (from its ack; the host's monotonic clock is shared by
/// its processes).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ReceiverTiming {
    pub rank: u32,
    /// The sender sent the sync → the receiver sent its ack.
    pub total_s: f64,
    /// The receiver's phases ([`wire::Timing`]): sync sent → read by the receiver; the caller's work queued
    /// on its stream; the pool checksum; the install.
    pub wake_s: f64,
    pub drain_s: f64,
    pub check_s: f64,
    pub apply_s: f64,
    /// The ack sent → read by the sender (the sender reads the acks in rank order, so a later rank's can wait
    /// for an earlier one's).
    pub reply_s: f64,
}

impl ReceiverTiming {
    fn new(rank: u32, sync_sent: u64, t: &Timing, ack_sent: u64, ack_read: u64) -> ReceiverTiming {
        let s = |ns: u64| ns as f64 * 1e-9;
        // A clock that could not be read is 0: its differences are reported as 0, not as nonsense.
        let between = |a: u64, b: u64| {
            if a == 0 || b == 0 {
                0
            } else {
                b.saturating_sub(a)
            }
        };
        ReceiverTiming {
            rank,
            total_s: s(between(sync_sent, ack_sent)),
            wake_s: s(t.wake_ns),
            drain_s: s(t.drain_ns),
            check_s: s(t.check_ns),
            apply_s: s(t.apply_ns),
            reply_s: s(between(ack_sent, ack_read)),
        }
    }
}

/// What one sync did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SyncReport {
    pub seq: u64,
    pub version: u64,
    pub full: bool,
    /// Per width: (width, changes, overflowed, pool checksum).
    pub widths: Vec<WidthCount>,
    /// Seconds: the device build (or snapshot copy) with its checksum, then sending and waiting for every ack.
    pub build_s: f64,
    pub acks_s: f64,
    pub receivers: usize,
    /// Per receiver that acked (rank order): where its part of the sync went.
    pub per_receiver: Vec<ReceiverTiming>,
    /// Syncs this sender has sent as a full copy (since it was bound) because its own checksum counted
    /// other changes than `diff_compact` reported (its pool is not what it would announce).
    pub fallbacks: u64,
    /// Detached acks ([`IpcSender::detach_acks`]): the previous sync's acks, collected before this sync
    /// touched the buffers (this sync's own are then collected by the next one, and `per_receiver` is empty).
    pub settled: Vec<ReceiverTiming>,
    /// Elastic receivers ([`IpcSender::set_elastic`]): ranks whose socket closed since the last report (their
    /// process died), dropped from the set rather than failing the sync.
    pub dropped: Vec<u32>,
}

/// The sending end (see the module docs).
pub struct IpcSender<D: SenderDevice> {
    dev: D,
    listener: UnixListener,
    path: PathBuf,
    layout: Layout,
    offsets: Vec<u64>,
    setup: Setup,
    expected: usize,
    peers: Vec<Peer>,
    seq: u64,
    /// The version of the snapshot copy (None before the bootstrap).
    version: Option<u64>,
    timeout: Duration,
    /// See [`SyncReport::fallbacks`].
    fallbacks: u64,
    /// [`IpcSender::detach_acks`]: a sync returns once its message is sent.
    detached: bool,
    /// The sync whose acks are still to be collected (detached acks only).
    pending: Option<Posted>,
    /// [`IpcSender::set_elastic`]: a receiver whose socket closed is dropped, not the sync's error.
    elastic: bool,
    /// Ranks dropped that way since the last report.
    dropped: Vec<u32>,
    /// How long the bootstrap (and a rejoin) waits for receivers to connect (`None`: the timeout).
    connect_wait: Option<Duration>,
}

/// A sync message written to the receivers, its acks not yet read.
struct Posted {
    seq: u64,
    /// When it was sent (the host's monotonic clock).
    sent_ns: u64,
    ranks: Vec<u32>,
    /// Receivers the message could not be written to.
    failed: Vec<(u32, PeerError)>,
}

impl<D: SenderDevice> IpcSender<D> {
    /// Bind the socket `path` (its directory must exist; the file is created 0600 and removed on drop),
    /// allocate the device buffers for `layout` and wait for nobody yet: receivers connect until
    /// [`IpcSender::bootstrap`] (or the first sync) admits `receivers` of them. `timeout` bounds every wait.
    pub fn bind(
        path: &Path,
        mut dev: D,
        layout: Layout,
        receivers: usize,
        timeout: Duration,
    ) -> Result<IpcSender<D>, IpcError> {
        let listener = bind_private(path)?;
        let (offsets, snap_bytes) = snapshot_offsets(&layout);
        let made = dev.prepare(&layout, &offsets, snap_bytes);
        let (snapshot, widths) = match made {
            Ok(x) => x,
            Err(e) => {
                let _ = std::fs::remove_file(path);
                return Err(e.into());
            }
        };
        let setup = Setup {
            pid: std::process::id(),
            device: dev.device(),
            snapshot,
            tensors: facts(&layout),
            offsets: offsets.clone(),
            widths,
        };
        Ok(IpcSender {
            dev,
            listener,
            path: path.to_owned(),
            layout,
            offsets,
            setup,
            expected: receivers,
            peers: Vec::new(),
            seq: 0,
            version: None,
            timeout,
            fallbacks: 0,
            detached: false,
            pending: None,
            elastic: false,
            dropped: Vec::new(),
            connect_wait: None,
        })
    }

    /// How long the bootstrap waits for the announced receivers to connect (default: the timeout, which
    /// bounds every other wait). Elastic, those still missing then are left to rejoin (their process died
    /// before it connected); otherwise the bootstrap fails naming how many.
    pub fn set_connect_wait(&mut self, wait: Duration) {
        self.connect_wait = Some(wait);
    }

    /// How long the bootstrap and a rejoin wait for receivers to connect.
    fn connect_patience(&self) -> Duration {
        self.connect_wait.unwrap_or(self.timeout)
    }

    /// Elastic receivers (restartable rollouts): a receiver whose socket closed (its process died) is dropped
    /// with a warning and named in the next report's [`SyncReport::dropped`] instead of failing the sync, and
    /// the bootstrap goes on without those that did not connect in time ([`IpcSender::set_connect_wait`]);
    /// a successor comes back by [`IpcSender::rejoin`] (or connects and is admitted at the next sync). Off:
    /// each is an error.
    pub fn set_elastic(&mut self, on: bool) {
        self.elastic = on;
    }

    /// A restarted receiver `rank` comes back (elastic receivers): its predecessor is forgotten (its process is
    /// gone; a detached sync no longer waits for its ack), the newcomer's connection is awaited (up to the
    /// connect wait, [`IpcSender::set_connect_wait`]; a connection that closes during its handshake, such as
    /// a dead predecessor's still queued, is passed over) and it gets a full copy of the snapshot copy at the
    /// current version at once, its ack waited for. The other receivers see nothing of it (with detached acks their outstanding sync stays theirs: the
    /// snapshot copy a full copy reads is not rewritten before it is settled). The report's `version` is what
    /// the newcomer holds.
    pub fn rejoin(&mut self, rank: u32) -> Result<SyncReport, IpcError> {
        let Some(version) = self.version else {
            return Err(IpcError::NotBootstrapped { rank });
        };
        if rank as usize >= self.expected {
            return Err(IpcError::Receiver {
                rank,
                source: PeerError::Refused(Reason::Rank {
                    rank: u64::from(rank),
                }),
            });
        }
        self.forget(rank);
        self.accept(self.connect_patience(), true, Until::Rank(rank), None)
            .map_err(|e| match e {
                IpcError::Connect { secs, .. } => IpcError::Receiver {
                    rank,
                    source: PeerError::NotConnected { secs },
                },
                e => e,
            })?;
        let t0 = Instant::now();
        let widths = self.full_widths()?;
        let build_s = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        for p in self.peers.iter_mut().filter(|p| p.rank == rank) {
            p.fresh = false;
        }
        let msg = self.next_sync(version, Mode::Full, widths.clone());
        let (per_receiver, failed) = match self.post(msg, &[rank]) {
            Some(posted) => self.gather(posted),
            None => (Vec::new(), Vec::new()),
        };
        if let Some((rank, source)) = failed.into_iter().next() {
            self.forget(rank);
            return Err(IpcError::Receiver { rank, source });
        }
        Ok(SyncReport {
            seq: self.seq,
            version,
            full: true,
            widths,
            build_s,
            acks_s: t1.elapsed().as_secs_f64(),
            receivers: 1,
            per_receiver,
            fallbacks: self.fallbacks,
            settled: Vec::new(),
            dropped: Vec::new(),
        })
    }

    /// Drop receiver `rank`, if connected, and stop waiting for its ack of a detached sync.
    fn forget(&mut self, rank: u32) {
        self.peers.retain(|p| p.rank != rank);
        if let Some(posted) = &mut self.pending {
            posted.ranks.retain(|r| *r != rank);
            posted.failed.retain(|(r, _)| *r != rank);
        }
    }

    /// Detached acks (a sender whose receivers install between their own work, e.g. in the background of a
    /// rollout): a sync returns once its message is sent, and its acks are collected at the start of the next
    /// sync, before the buffers are rewritten (still one version in flight; a receiver's rejection or death is
    /// then that next sync's error, naming the rank). Off: every sync waits for its acks.
    pub fn detach_acks(&mut self, on: bool) {
        self.detached = on;
    }

    /// Collect the acks of a detached sync still outstanding (waiting up to the timeout for them).
    pub fn settle(&mut self) -> Result<Vec<ReceiverTiming>, IpcError> {
        match self.pending.take() {
            Some(posted) => self.collect(posted),
            None => Ok(Vec::new()),
        }
    }

    pub fn device_mut(&mut self) -> &mut D {
        &mut self.dev
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Ranks connected now.
    pub fn ranks(&self) -> Vec<u32> {
        self.peers.iter().map(|p| p.rank).collect()
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Snapshot copy := state, admit every announced receiver (waiting up to the timeout) and give each a
    /// full copy at `version`.
    pub fn bootstrap(&mut self, version: u64) -> Result<SyncReport, IpcError> {
        self.bootstrap_with(version, None)
    }

    /// [`IpcSender::bootstrap`] of elastic receivers: while it waits for them to connect, `away` (asked every
    /// few tens of milliseconds) names the ranks the caller knows are gone or being replaced (e.g. from its host
    /// channel); the bootstrap stops waiting for those that have not connected (they rejoin). A receiver whose
    /// connection closes during its handshake is not waited for either; the connect wait bounds the rest.
    pub fn bootstrap_elastic(
        &mut self,
        version: u64,
        away: &mut dyn FnMut() -> Vec<u32>,
    ) -> Result<SyncReport, IpcError> {
        self.bootstrap_with(version, Some(away))
    }

    fn bootstrap_with(
        &mut self,
        version: u64,
        away: Option<&mut dyn FnMut() -> Vec<u32>>,
    ) -> Result<SyncReport, IpcError> {
        let settled = self.settle()?;
        let t0 = Instant::now();
        self.dev.bootstrap(&self.layout, &self.offsets)?;
        self.version = Some(version);
        let widths = self.full_widths()?;
        let build_s = t0.elapsed().as_secs_f64();
        let until = if self.elastic {
            Until::Ranks((0..self.expected as u32).collect())
        } else {
            Until::Announced
        };
        match self.accept(self.connect_patience(), true, until, away) {
            // Elastic: a receiver that died before it connected is left to rejoin.
            Err(IpcError::Connect {
                missing,
                expected,
                secs,
            }) if self.elastic => tracing::warn!(
                "GPU channel bootstrap: {missing} of {expected} receiver(s) did not connect within {secs:.1} s; \
                 bootstrapping the others (a restarted one rejoins)"
            ),
            admitted => admitted?,
        }
        for p in &mut self.peers {
            p.fresh = false;
        }
        self.send(version, Mode::Full, widths, build_s, settled)
    }

    /// One sync at `version`: the first one bootstraps; later receivers are admitted with a full copy; then
    /// build on the device, send the control message and wait for every ack.
    pub fn sync(&mut self, version: u64) -> Result<SyncReport, IpcError> {
        let Some(current) = self.version else {
            return self.bootstrap(version);
        };
        // The previous sync's acks first (detached): its buffers are about to be rewritten.
        let settled = self.settle()?;
        // Late receivers: a full copy of the current snapshot (equal to every other receiver's tensors).
        self.admit(false)?;
        let late: Vec<u32> = self
            .peers
            .iter_mut()
            .filter(|p| p.fresh)
            .map(|p| {
                p.fresh = false;
                p.rank
            })
            .collect();
        if !late.is_empty() {
            let widths = self.full_widths()?;
            let msg = self.next_sync(current, Mode::Full, widths);
            self.broadcast(msg, &late)?;
        }
        let t0 = Instant::now();
        // Seeded with the sequence number the message will carry (next_sync takes it below).
        let built = self.dev.build(&self.layout, &self.offsets, self.seq + 1)?;
        self.version = Some(version);
        if let Some((w, b)) = self
            .setup
            .widths
            .iter()
            .zip(&built)
            .find(|(_, b)| b.sum.count != b.cursor)
        {
            // The pool is not what the cursor announces (a kernel fault, a race): every receiver would reject
            // it. diff_compact has already moved the snapshot copy, so this sync goes out as a full copy.
            self.fallbacks += 1;
            tracing::warn!(
                width = w.width,
                changes = b.cursor,
                counted = b.sum.count,
                fallbacks = self.fallbacks,
                "GPU channel sender: its pool checksum counted other changes than diff_compact reported; \
                 this sync is sent as a full copy"
            );
            return self.fallback(version, t0, settled);
        }
        let widths: Vec<WidthCount> = self
            .setup
            .widths
            .iter()
            .zip(built)
            .map(|(w, b)| WidthCount {
                width: w.width,
                changes: b.cursor,
                overflow: b.cursor > w.capacity,
                checksum: b.sum.sum,
            })
            .collect();
        self.send(
            version,
            Mode::Patch,
            widths,
            t0.elapsed().as_secs_f64(),
            settled,
        )
    }

    /// This sync (`version`, begun at `t0`) as a full copy to every receiver: the snapshot copy set to the
    /// state again (a fault that broke the pool may have broken the copy too), hashed as every full copy.
    fn fallback(
        &mut self,
        version: u64,
        t0: Instant,
        settled: Vec<ReceiverTiming>,
    ) -> Result<SyncReport, IpcError> {
        self.dev.bootstrap(&self.layout, &self.offsets)?;
        let widths = self.full_widths()?;
        self.send(
            version,
            Mode::Full,
            widths,
            t0.elapsed().as_secs_f64(),
            settled,
        )
    }

    /// Send every connected receiver the sync at `version` in `mode` (a full copy's `widths` from
    /// [`Self::full_widths`]; a patch's from the build), built in `build_s`, and wait for the acks (detached:
    /// leave them for the next sync, and report the previous sync's, `settled`).
    fn send(
        &mut self,
        version: u64,
        mode: Mode,
        widths: Vec<WidthCount>,
        build_s: f64,
        settled: Vec<ReceiverTiming>,
    ) -> Result<SyncReport, IpcError> {
        let t1 = Instant::now();
        let ranks = self.ranks();
        let msg = self.next_sync(version, mode, widths.clone());
        let per_receiver = if self.detached {
            self.pending = self.post(msg, &ranks);
            Vec::new()
        } else {
            self.broadcast(msg, &ranks)?
        };
        Ok(SyncReport {
            seq: self.seq,
            version,
            full: mode == Mode::Full,
            widths,
            build_s,
            acks_s: t1.elapsed().as_secs_f64(),
            receivers: ranks.len(),
            per_receiver,
            fallbacks: self.fallbacks,
            settled,
            dropped: std::mem::take(&mut self.dropped),
        })
    }

    /// The widths of a full copy of the snapshot copy under the next sequence number: each width's elements
    /// and the snapshot copy's checksum.
    fn full_widths(&mut self) -> Result<Vec<WidthCount>, IpcError> {
        let sums = self
            .dev
            .snapshot_sum(&self.layout, &self.offsets, self.seq + 1)?;
        Ok(self
            .setup
            .widths
            .iter()
            .zip(sums)
            .map(|(w, s)| WidthCount {
                width: w.width,
                changes: s.count,
                overflow: false,
                checksum: s.sum,
            })
            .collect())
    }

    fn next_sync(&mut self, version: u64, mode: Mode, widths: Vec<WidthCount>) -> Message {
        self.seq += 1;
        Message::Sync {
            seq: self.seq,
            version,
            mode,
            sent_ns: 0,
            widths,
        }
    }

    /// Send `msg` (stamped with the clock now) to the receivers of `ranks`, then wait for each one's ack; the
    /// acks' timings. Every receiver that failed is dropped, except one that rejected a sync for its pool
    /// checksum or count: its tensors are the previous version, so it stays and gets a full copy at the
    /// start of the next sync. The first failure (lowest rank) is the error.
    fn broadcast(&mut self, msg: Message, ranks: &[u32]) -> Result<Vec<ReceiverTiming>, IpcError> {
        match self.post(msg, ranks) {
            Some(posted) => self.collect(posted),
            None => Ok(Vec::new()),
        }
    }

    /// Write `msg` (a sync, stamped with the clock now) to the receivers of `ranks`; `None` for another
    /// message.
    fn post(&mut self, mut msg: Message, ranks: &[u32]) -> Option<Posted> {
        let Message::Sync {
            seq,
            ref mut sent_ns,
            ..
        } = msg
        else {
            return None;
        };
        let sync_sent = monotonic_ns();
        *sent_ns = sync_sent;
        let frame = wire::encode(&msg);
        let mut failed: Vec<(u32, PeerError)> = Vec::new();
        for p in self.peers.iter_mut().filter(|p| ranks.contains(&p.rank)) {
            if let Err(e) = p.stream.write_all(&frame) {
                failed.push((p.rank, io_peer(e)));
            }
        }
        Some(Posted {
            seq,
            sent_ns: sync_sent,
            ranks: ranks.to_vec(),
            failed,
        })
    }

    /// Wait (up to the timeout) for the ack of each receiver a sync was posted to (see [`Self::broadcast`]).
    fn collect(&mut self, posted: Posted) -> Result<Vec<ReceiverTiming>, IpcError> {
        let (timings, failed) = self.gather(posted);
        self.fail(failed)?;
        Ok(timings)
    }

    /// Wait (up to the timeout) for the ack of each receiver a sync was posted to: the acks' timings, and the
    /// receivers that failed (the message could not be written, no ack, a rejection).
    fn gather(&mut self, posted: Posted) -> (Vec<ReceiverTiming>, Vec<(u32, PeerError)>) {
        let Posted {
            seq,
            sent_ns: sync_sent,
            ranks,
            mut failed,
        } = posted;
        let mut timings = Vec::new();
        let deadline = Instant::now() + self.timeout;
        for p in self.peers.iter_mut().filter(|p| ranks.contains(&p.rank)) {
            if failed.iter().any(|(r, _)| *r == p.rank) {
                continue;
            }
            let got = match recv(&mut p.stream, deadline, self.timeout.as_secs_f64()) {
                Ok(Message::Ack {
                    seq: s,
                    status,
                    timing,
                    sent_ns,
                }) if s == seq => {
                    let read = monotonic_ns();
                    timings.push(ReceiverTiming::new(
                        p.rank, sync_sent, &timing, sent_ns, read,
                    ));
                    match status {
                        Status::Applied => Ok(()),
                        Status::Rejected(r) => Err(PeerError::Rejected(r)),
                    }
                }
                Ok(Message::Ack { seq: s, .. }) => Err(PeerError::WrongAck {
                    found: s,
                    expected: seq,
                }),
                Ok(other) => Err(PeerError::Unexpected {
                    found: other.kind(),
                    expected: "ack",
                }),
                Err(e) => Err(e),
            };
            if let Err(e) = got {
                failed.push((p.rank, e));
            }
        }
        (timings, failed)
    }

    /// Settle the receivers that failed a sync: every one is dropped, except one that rejected it for its pool
    /// checksum or count (its tensors are the previous version: it stays and gets a full copy at the start of
    /// the next sync); elastic, one whose socket closed is dropped and is no error. The first failure (lowest
    /// rank) left is the error.
    fn fail(&mut self, mut failed: Vec<(u32, PeerError)>) -> Result<(), IpcError> {
        if failed.is_empty() {
            return Ok(());
        }
        failed.sort_by_key(|(r, _)| *r);
        let kept = |e: &PeerError| {
            matches!(
                e,
                PeerError::Rejected(Reason::Checksum { .. } | Reason::Count { .. })
            )
        };
        for p in &mut self.peers {
            if failed.iter().any(|(r, e)| *r == p.rank && kept(e)) {
                p.fresh = true;
            }
        }
        self.peers
            .retain(|p| !failed.iter().any(|(r, e)| *r == p.rank && !kept(e)));
        if self.elastic {
            failed.retain(|(rank, e)| {
                if !matches!(e, PeerError::Closed) {
                    return true;
                }
                tracing::warn!(
                    rank,
                    "GPU channel receiver closed its socket (its process is gone): dropped; a restarted one rejoins"
                );
                self.dropped.push(*rank);
                false
            });
            if failed.is_empty() {
                return Ok(());
            }
        }
        for (rank, e) in &failed[1..] {
            tracing::warn!(rank, error = %crate::error_chain(e), "GPU channel receiver dropped");
        }
        let (rank, source) = failed.swap_remove(0);
        Err(IpcError::Receiver { rank, source })
    }

    /// Accept and set up receivers: all announced ones (waiting up to the timeout) when `wait`, else only
    /// those already knocking. A receiver that fails its handshake is dropped (and named in the error when
    /// waiting ends short).
    fn admit(&mut self, wait: bool) -> Result<(), IpcError> {
        self.accept(self.timeout, wait, Until::Announced, None)
    }

    /// Accept and set up receivers until those `until` names are connected (waiting up to `patience` when
    /// `wait`, else taking only those already knocking). Elastic, a receiver whose connection closes during
    /// its handshake is not waited for, nor one `away` names (asked every 20 ms).
    fn accept(
        &mut self,
        patience: Duration,
        wait: bool,
        mut until: Until,
        mut away: Option<&mut dyn FnMut() -> Vec<u32>>,
    ) -> Result<(), IpcError> {
        let deadline = Instant::now() + patience;
        self.listener
            .set_nonblocking(true)
            .map_err(|source| self.socket_error(source))?;
        let mut last: Option<(u32, PeerError)> = None;
        let mut asked: Option<Instant> = None;
        while !self.admitted(&until) {
            if let (Some(away), Until::Ranks(ranks)) = (away.as_mut(), &mut until)
                && asked.is_none_or(|at| at.elapsed() >= Duration::from_millis(20))
            {
                asked = Some(Instant::now());
                let gone = away();
                let peers = &self.peers;
                ranks.retain(|r| !gone.contains(r) || peers.iter().any(|p| p.rank == *r));
                continue;
            }
            match self.listener.accept() {
                Ok((stream, _)) => {
                    if let Err((rank, e)) = self.handshake(stream, deadline) {
                        tracing::warn!(rank, error = %crate::error_chain(&e), "GPU channel receiver refused");
                        if self.elastic && matches!(e, PeerError::Closed) {
                            // It died during its handshake (or before: its connection was still queued, a
                            // successor's may follow): the bootstrap does not wait for it, it rejoins.
                            if let Until::Ranks(ranks) = &mut until {
                                ranks.retain(|r| *r != rank);
                            }
                            continue;
                        }
                        if until == Until::Rank(rank) {
                            return Err(IpcError::Receiver { rank, source: e });
                        }
                        last = Some((rank, e));
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if !wait {
                        break;
                    }
                    if Instant::now() >= deadline {
                        if let Some((rank, source)) = last {
                            return Err(IpcError::Receiver { rank, source });
                        }
                        return Err(IpcError::Connect {
                            missing: self.expected - self.peers.len(),
                            expected: self.expected,
                            secs: patience.as_secs_f64(),
                        });
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(source) => return Err(self.socket_error(source)),
            }
        }
        Ok(())
    }

    /// Whether the receivers `until` names are connected.
    fn admitted(&self, until: &Until) -> bool {
        let has = |rank: u32| self.peers.iter().any(|p| p.rank == rank);
        match until {
            Until::Announced => self.peers.len() >= self.expected,
            Until::Ranks(ranks) => ranks.iter().all(|r| has(*r)),
            Until::Rank(rank) => has(*rank),
        }
    }

    fn socket_error(&self, source: std::io::Error) -> IpcError {
        IpcError::Socket {
            path: self.path.clone(),
            source,
        }
    }

    /// Hello → setup → ready with one connecting receiver.
    fn handshake(
        &mut self,
        mut stream: UnixStream,
        deadline: Instant,
    ) -> Result<(), (u32, PeerError)> {
        let _ = stream.set_nonblocking(false);
        let hello =
            recv(&mut stream, deadline, self.timeout.as_secs_f64()).map_err(|e| (u32::MAX, e))?;
        let Message::Hello { rank, tensors, .. } = hello else {
            return Err((
                u32::MAX,
                PeerError::Unexpected {
                    found: hello.kind(),
                    expected: "hello",
                },
            ));
        };
        let refuse = |stream: &mut UnixStream, r: Reason| {
            let _ = send(stream, &Message::Refuse(r));
            Err((rank, PeerError::Refused(r)))
        };
        // A predecessor whose socket closed (its process died before a sync noticed) gives way.
        if self
            .peers
            .iter()
            .any(|p| p.rank == rank && socket_closed(&p.stream))
        {
            self.forget(rank);
        }
        if rank as usize >= self.expected || self.peers.iter().any(|p| p.rank == rank) {
            return refuse(
                &mut stream,
                Reason::Rank {
                    rank: u64::from(rank),
                },
            );
        }
        if tensors != self.setup.tensors {
            let k = tensors
                .iter()
                .zip(&self.setup.tensors)
                .position(|(a, b)| a != b)
                .unwrap_or(tensors.len().min(self.setup.tensors.len()));
            return refuse(
                &mut stream,
                Reason::Tensors {
                    tensor: k as u64,
                    detail: tensors.len() as u64,
                },
            );
        }
        send(&mut stream, &Message::Setup(self.setup.clone())).map_err(|e| (rank, e))?;
        match recv(&mut stream, deadline, self.timeout.as_secs_f64()).map_err(|e| (rank, e))? {
            Message::Ready { rank: r } if r == rank => {}
            Message::Refuse(r) => return Err((rank, PeerError::Refused(r))),
            other => {
                return Err((
                    rank,
                    PeerError::Unexpected {
                        found: other.kind(),
                        expected: "ready",
                    },
                ));
            }
        }
        self.peers.push(Peer {
            rank,
            stream,
            fresh: true,
        });
        self.peers.sort_by_key(|p| p.rank);
        Ok(())
    }
}

/// Whether the peer closed its end of `s` (EOF pending, or a reset), without consuming anything.
fn socket_closed(s: &UnixStream) -> bool {
    use nix::sys::socket::MsgFlags;
    let mut byte = [0u8; 1];
    loop {
        let peeked = nix::sys::socket::recv(
            std::os::fd::AsRawFd::as_raw_fd(s),
            &mut byte,
            MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT,
        );
        return match peeked {
            Ok(0) => true,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => e == nix::errno::Errno::ECONNRESET,
            Ok(_) => false,
        };
    }
}

fn io_peer(e: std::io::Error) -> PeerError {
    match e.kind() {
        std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset => PeerError::Closed,
        _ => PeerError::Io(e),
    }
}

/// The longest a sender going away waits for its receivers to close its buffers (each does as soon as it reads
/// the channel's end: a receiver waiting for a sync, or one that exited, takes no time).
const CLOSE_WAIT: Duration = Duration::from_secs(10);

impl<D: SenderDevice> Drop for IpcSender<D> {
    /// The receivers map this sender's buffers, and CUDA leaves freeing an exported allocation before its
    /// importers closed it undefined: collect a sync still in flight (its receivers may be reading the
    /// buffers), end the channel's stream to every receiver, and wait — at most [`CLOSE_WAIT`] or the channel's
    /// timeout — until each has closed its side, which a receiver does once it closed the buffers
    /// ([`IpcReceiver`] on reading the end). Only then are the buffers freed (`dev`, dropped after this).
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
        if self.pending.is_some() {
            let _ = self.settle();
        }
        for p in &self.peers {
            let _ = p.stream.shutdown(std::net::Shutdown::Write);
        }
        let deadline = Instant::now() + self.timeout.min(CLOSE_WAIT);
        for p in &mut self.peers {
            let mut sink = [0u8; 256];
            loop {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() || p.stream.set_read_timeout(Some(left)).is_err() {
                    break;
                }
                match p.stream.read(&mut sink) {
                    Ok(0) => break,
                    Ok(_) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
        }
    }
}

/// `n` in base 36 (digits, then lowercase letters).
fn base36(mut n: u64) -> String {
    let mut digits = Vec::new();
    loop {
        digits.push(b"0123456789abcdefghijklmnopqrstuvwxyz"[(n % 36) as usize]);
        n /= 36;
        if n == 0 {
            break;
        }
    }
    digits.reverse();
    String::from_utf8(digits).unwrap_or_default()
}

/// A socket path a Unix address holds, or the error naming it and its length.
fn check_path(path: &Path) -> Result<(), IpcError> {
    if let Some(len) = crate::transport::shm::socket_path_too_long(path) {
        return Err(IpcError::PathTooLong {
            path: path.to_owned(),
            len,
        });
    }
    Ok(())
}

/// Bind a listening socket at `path`, 0600 from the moment it is reachable under that name: bound under a
/// private temporary name, restricted, then renamed into place. A stale socket (nobody listening) is replaced.
fn bind_private(path: &Path) -> Result<UnixListener, IpcError> {
    check_path(path)?;
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
    let dir = dir.unwrap_or(Path::new("."));
    if !dir.is_dir() {
        return Err(IpcError::NoDir {
            dir: dir.to_owned(),
        });
    }
    let socket_err = |source| IpcError::Socket {
        path: path.to_owned(),
        source,
    };
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            return Err(IpcError::InUse {
                path: path.to_owned(),
            });
        }
        std::fs::remove_file(path).map_err(socket_err)?;
    }
    // Unique between processes and within one (two channels bound at once), and short: a run checks its paths'
    // limit of 107 bytes for the final name, `gpu.sock`, which this name (8 characters at most for the first
    // 36 binds of a process) does not exceed.
    static BOUND: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = BOUND.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!(
        ".{}{}",
        base36(u64::from(std::process::id())),
        base36(n)
    ));
    let _ = std::fs::remove_file(&tmp);
    let listener = UnixListener::bind(&tmp).map_err(socket_err)?;
    let placed = std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))
        .and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = placed {
        let _ = std::fs::remove_file(&tmp);
        return Err(socket_err(e));
    }
    Ok(listener)
}

/// The receiving end (see the module docs).
pub struct IpcReceiver<D: ReceiverDevice> {
    dev: D,
    stream: UnixStream,
    rank: u32,
    layout: Layout,
    setup: Setup,
    last_seq: u64,
    installed: Option<u64>,
}

impl<D: ReceiverDevice> IpcReceiver<D> {
    /// Connect to the sender at `path` as `rank` (retrying until the socket exists, up to `timeout`), check
    /// the setup against `layout` (the receiver's tensors, in the sender's order) and open the sender's
    /// buffers on `dev`.
    pub fn connect(
        path: &Path,
        rank: u32,
        layout: Layout,
        mut dev: D,
        timeout: Duration,
    ) -> Result<IpcReceiver<D>, IpcError> {
        check_path(path)?;
        let deadline = Instant::now() + timeout;
        let mut stream = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e)
                    if Instant::now() < deadline
                        && matches!(
                            e.kind(),
                            std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
                        ) =>
                {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(source) => {
                    return Err(IpcError::Socket {
                        path: path.to_owned(),
                        source,
                    });
                }
            }
        };
        let sender_err = |source| IpcError::Sender { source };
        let hello = Message::Hello {
            rank,
            pid: std::process::id(),
            device: dev.device(),
            tensors: facts(&layout),
        };
        send(&mut stream, &hello).map_err(sender_err)?;
        let setup = match recv(&mut stream, deadline, timeout.as_secs_f64()).map_err(sender_err)? {
            Message::Setup(s) => s,
            Message::Refuse(r) => return Err(sender_err(PeerError::Refused(r))),
            other => {
                return Err(sender_err(PeerError::Unexpected {
                    found: other.kind(),
                    expected: "setup",
                }));
            }
        };
        if let Err(r) = check_setup(&setup, &layout) {
            let _ = send(&mut stream, &Message::Refuse(r));
            return Err(IpcError::Rejected { reason: r });
        }
        if let Err(e) = dev.open(&setup) {
            let _ = send(&mut stream, &Message::Refuse(Reason::Open));
            return Err(e.into());
        }
        send(&mut stream, &Message::Ready { rank }).map_err(sender_err)?;
        Ok(IpcReceiver {
            dev,
            stream,
            rank,
            layout,
            setup,
            last_seq: 0,
            installed: None,
        })
    }

    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// The layout of the receiver's tensors (fixed at connect).
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    pub fn device_mut(&mut self) -> &mut D {
        &mut self.dev
    }

    /// The version installed last (None before the first full copy).
    pub fn version(&self) -> Option<u64> {
        self.installed
    }

    /// A second handle on the channel's socket, to end a [`Self::wait`] blocked on another thread: shutting
    /// it down ends the wait as the sender's end would (the receiver closes the sender's buffers).
    pub fn shutdown_handle(&self) -> std::io::Result<UnixStream> {
        self.stream.try_clone()
    }

    /// Wait up to `timeout` for the next sync, validate it, verify the device buffers (pool checksum and
    /// count), install it and ack with the phases' times; its version. A message that fails validation or
    /// verification is acked as rejected and returned as [`IpcError::Rejected`], the tensors untouched.
    pub fn apply(&mut self, timeout: Duration) -> Result<u64, IpcError> {
        let incoming = self.receive(timeout)?;
        self.install(incoming)
    }

    /// Block until the next message starts to arrive (however long the sender takes), or the sender closed
    /// the channel ([`PeerError::Closed`]). For a receiver that waits in the background between installs.
    pub fn wait(&mut self) -> Result<(), IpcError> {
        let sender_err = |source| IpcError::Sender { source };
        self.stream
            .set_read_timeout(None)
            .map_err(|e| sender_err(PeerError::Io(e)))?;
        let mut byte = [0u8; 1];
        loop {
            // A peek (the byte stays for `receive`), blocking: no read timeout is set.
            let peeked = nix::sys::socket::recv(
                std::os::fd::AsRawFd::as_raw_fd(&self.stream),
                &mut byte,
                nix::sys::socket::MsgFlags::MSG_PEEK,
            );
            match peeked {
                Ok(0) => return Err(self.sender_closed()),
                Ok(_) => return Ok(()),
                Err(nix::errno::Errno::EINTR) => {}
                Err(e) => return Err(sender_err(io_peer(std::io::Error::from(e)))),
            }
        }
    }

    /// The sender ended the channel: close its buffers here, then this end of the stream (which tells the
    /// sender they are closed and it may free them).
    fn sender_closed(&mut self) -> IpcError {
        self.dev.close();
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        IpcError::Sender {
            source: PeerError::Closed,
        }
    }

    /// The first half of [`Self::apply`]: wait up to `timeout` for the next sync and validate it (nothing is
    /// read from the device yet). A message that fails validation is acked as rejected.
    pub fn receive(&mut self, timeout: Duration) -> Result<Incoming, IpcError> {
        let deadline = Instant::now() + timeout;
        let sender_err = |source| IpcError::Sender { source };
        let msg = match recv(&mut self.stream, deadline, timeout.as_secs_f64()) {
            Ok(m) => m,
            Err(PeerError::Wire(e)) => {
                // The frame was read whole (its length was sane): answer it, so the sender is not left waiting.
                let _ = send(
                    &mut self.stream,
                    &ack(0, Status::Rejected(Reason::Corrupt), Timing::default()),
                );
                return Err(sender_err(PeerError::Wire(e)));
            }
            Err(PeerError::Closed) => return Err(self.sender_closed()),
            Err(e) => return Err(sender_err(e)),
        };
        let read = monotonic_ns();
        let Message::Sync {
            seq,
            version,
            mode,
            sent_ns,
            widths,
        } = msg
        else {
            return Err(sender_err(PeerError::Unexpected {
                found: msg.kind(),
                expected: "sync",
            }));
        };
        let timing = Timing {
            wake_ns: if sent_ns == 0 || read == 0 {
                0
            } else {
                read.saturating_sub(sent_ns)
            },
            ..Timing::default()
        };
        let checked = check_sync(
            &self.setup,
            seq,
            version,
            mode,
            &widths,
            self.last_seq,
            self.installed,
        );
        if let Err(reason) = checked {
            send(
                &mut self.stream,
                &ack(seq, Status::Rejected(reason), timing),
            )
            .map_err(sender_err)?;
            return Err(IpcError::Rejected { reason });
        }
        self.last_seq = seq;
        Ok(Incoming {
            seq,
            version,
            mode,
            widths,
            timing,
        })
    }

    /// The second half of [`Self::apply`]: verify the received sync's device buffers, install it and ack;
    /// its version (rejected: the tensors untouched).
    pub fn install(&mut self, incoming: Incoming) -> Result<u64, IpcError> {
        let Incoming {
            seq,
            version,
            mode,
            widths,
            mut timing,
        } = incoming;
        let sender_err = |source| IpcError::Sender { source };
        let full = mode == Mode::Full;
        let t = Instant::now();
        let drained = self.dev.drain();
        timing.drain_ns = t.elapsed().as_nanos() as u64;
        let t = Instant::now();
        let sums = drained.and_then(|()| self.dev.checksum(&self.setup, &self.layout, seq, full));
        timing.check_ns = t.elapsed().as_nanos() as u64;
        let sums = match sums {
            Ok(s) => s,
            Err(e) => {
                let _ = send(
                    &mut self.stream,
                    &ack(seq, Status::Rejected(Reason::Device), timing),
                );
                return Err(e.into());
            }
        };
        if let Err(reason) = check_sums(&widths, &sums) {
            send(
                &mut self.stream,
                &ack(seq, Status::Rejected(reason), timing),
            )
            .map_err(sender_err)?;
            return Err(IpcError::Rejected { reason });
        }
        let t = Instant::now();
        let done = match mode {
            Mode::Full => self.dev.full(&self.setup),
            Mode::Patch => self.dev.apply(&self.setup, &self.layout),
        };
        timing.apply_ns = t.elapsed().as_nanos() as u64;
        if let Err(e) = done {
            let _ = send(
                &mut self.stream,
                &ack(seq, Status::Rejected(Reason::Device), timing),
            );
            return Err(e.into());
        }
        self.installed = Some(version);
        send(&mut self.stream, &ack(seq, Status::Applied, timing)).map_err(sender_err)?;
        Ok(version)
    }
}

/// A sync received and validated, not yet verified on the device nor installed ([`IpcReceiver::receive`]).
#[derive(Debug)]
pub struct Incoming {
    seq: u64,
    version: u64,
    mode: Mode,
    widths: Vec<WidthCount>,
    timing: Timing,
}

/// An ack of `seq`, stamped with the clock now.
fn ack(seq: u64, status: Status, timing: Timing) -> Message {
    Message::Ack {
        seq,
        status,
        timing,
        sent_ns: monotonic_ns(),
    }
}

mod device;
pub use device::{CudaReceiver, CudaSender};

#[cfg(test)]
pub(crate) mod tests;
