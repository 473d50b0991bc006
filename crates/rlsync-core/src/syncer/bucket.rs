//! Bucket transfers (the bucket strategy and the init bootstrap): plan buckets, fill them straight into the
//! transport's buffer part by part, and stage / install them on the receiver without ever exposing a
//! partial version.
//!
//! Tensors are visited in order and a bucket closes once its bytes reach the bucket size (a tensor is never
//! split across buckets, so a bucket may exceed it). A bucket's body travels as parts of [`PART_BYTES`]
//! (wire format 2), so the receiver copies part k while the sender fills part k + 1 into the other transport
//! slot: fill and copy overlap instead of running one after the other. The sender casts floating tensors to
//! the wire dtype while copying into the transport buffer; same-dtype tensors are hashed from the source
//! (cache-sized chunks) and then stream-copied into the slot, which the sender never reads back. The
//! receiver copies each chunk out of the slot once (a cache-sized private chunk: the slot may be shared memory
//! another process can write), hashes that copy and stream-copies (or casts) it into a staging storage;
//! every part is verified against its own checksum, and a bucket is handed out only once all its parts
//! arrived and verified. Installing swaps staged storages into the state dict (a borrowed tensor, the
//! caller's memory, is copied into instead, unless an undo may need its old values); the displaced storages
//! become the next staging buffers, so steady-state syncs allocate nothing.

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::ops::Range;
use std::time::{Duration, Instant};

use xxhash_rust::xxh3::Xxh3;

use crate::tensor::parallel::map_items;
use crate::tensor::{DType, StateDict, Storage, cast_bytes, copy_streaming};
use crate::transport;

use super::MessageError;

pub(crate) mod device;
use super::wire::{
    BucketEntry, HEADER_LEN, Header, KeyMeta, Kind, Stamp, WireError, bucket_layout, bucket_parts,
    read_bucket_table, write_bucket_table,
};

/// Why a bucket part cannot be staged.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PartError {
    /// rlsync's own finding: out of sequence, or not fitting the receiver's keys.
    #[error("{0}")]
    Invalid(String),
    /// The part does not read: its wire format, or bytes that do not convert.
    #[error(transparent)]
    Message(#[from] MessageError),
}

impl From<WireError> for PartError {
    fn from(e: WireError) -> PartError {
        PartError::Message(e.into())
    }
}

/// Bytes hashed then copied at a time: small enough that the copy re-reads the chunk from L1/L2, a
/// multiple of every element size.
const CHUNK: usize = 64 << 10;

/// Size of one transport message of a bucket. Small enough that the pipeline fills quickly (the receiver
/// waits for one part before it can start), big enough that the per-message round trip is noise.
pub(crate) const PART_BYTES: usize = 8 << 20;

/// One tensor of a planned bucket: the sender's key and what goes on the wire.
#[derive(Debug, Clone)]
pub(crate) struct Planned {
    pub key: String,
    pub src: DType,
    pub entry: BucketEntry,
}

/// Split `items` (in order) into buckets closing once they reach `bucket_size` bytes.
pub fn plan(items: Vec<Planned>, bucket_size: u64) -> Vec<Vec<Planned>> {
    let mut buckets = Vec::new();
    let mut cur = Vec::new();
    let mut bytes = 0u64;
    for p in items {
        bytes += p.entry.byte_len as u64;
        cur.push(p);
        if bytes >= bucket_size {
            buckets.push(std::mem::take(&mut cur));
            bytes = 0;
        }
    }
    if !cur.is_empty() {
        buckets.push(cur);
    }
    buckets
}

/// Sizes and times of one bucketed send.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct SendStats {
    pub payload_bytes: u64,
    /// Transport messages sent (parts of all buckets).
    pub messages: u32,
    /// Time spent casting/copying/hashing into transport buffers.
    pub fill: Duration,
    /// Time spent waiting on the transport (slots, publication).
    pub wait: Duration,
}

/// Send every bucket of one version. All keys must exist in `state` with the planned element counts
/// (checked before anything is published).
pub async fn send(
    ch: &mut transport::Sender,
    state: &StateDict,
    buckets: &[Vec<Planned>],
    kind: Kind,
    stamp: Stamp,
    part_bytes: usize,
) -> Result<SendStats, super::SyncError> {
    let sources = check_sources(state, buckets)?;
    send_sources(ch, None, buckets, &sources, kind, stamp, part_bytes).await
}

/// The bytes of every planned tensor of `state`, bucket by bucket; an error naming the first key that is
/// missing or no longer has its planned dtype and size.
pub(crate) fn check_sources<'s>(
    state: &'s StateDict,
    buckets: &[Vec<Planned>],
) -> Result<Vec<Vec<&'s [u8]>>, super::SyncError> {
    let mut sources: Vec<Vec<&[u8]>> = Vec::with_capacity(buckets.len());
    for bucket in buckets {
        let mut srcs = Vec::with_capacity(bucket.len());
        for p in bucket {
            let t = state
                .get(&p.key)
                .ok_or_else(|| super::SyncError::StateMismatch {
                    key: p.key.clone(),
                    reason: "missing from the state dict".into(),
                })?;
            if t.dtype() != p.src || t.numel() * p.entry.dtype.size_bytes() != p.entry.byte_len {
                return Err(super::SyncError::StateMismatch {
                    key: p.key.clone(),
                    reason: format!("now {} {:?}, different at init", t.dtype(), t.shape()),
                });
            }
            srcs.push(t.bytes());
        }
        sources.push(srcs);
    }
    Ok(sources)
}

/// Send the buckets of one version with each tensor's bytes given (`sources[bucket][item]`, in the planned
/// source dtype) to every receiver, or to receiver `to` only.
pub(crate) async fn send_sources(
    ch: &mut transport::Sender,
    to: Option<usize>,
    buckets: &[Vec<Planned>],
    sources: &[Vec<&[u8]>],
    kind: Kind,
    stamp: Stamp,
    part_bytes: usize,
) -> Result<SendStats, super::SyncError> {
    let mut stats = SendStats::default();
    let count = bucket_count(buckets)?;
    for (seq, (bucket, srcs)) in buckets.iter().zip(sources).enumerate() {
        let src_dtypes = bucket.iter().map(|p| p.src).collect();
        let one = Outgoing {
            seq: seq as u32,
            count,
            bucket,
            srcs,
            src_dtypes,
        };
        send_bucket(ch, to, &one, kind, stamp, part_bytes, &mut stats).await?;
    }
    Ok(stats)
}

/// The number of buckets as the wire counts them.
pub(crate) fn bucket_count(buckets: &[Vec<Planned>]) -> Result<u32, super::SyncError> {
    u32::try_from(buckets.len()).map_err(|_| super::SyncError::Config {
        reason: "more than 2^32 buckets".into(),
    })
}

/// One bucket about to be sent: bucket `seq` of `count`, each tensor's bytes in `src_dtypes`.
pub(crate) struct Outgoing<'a> {
    pub seq: u32,
    pub count: u32,
    pub bucket: &'a [Planned],
    pub srcs: &'a [&'a [u8]],
    pub src_dtypes: Vec<DType>,
}

/// Send one bucket part by part (to every receiver, or to receiver `to` only), adding to `stats`.
pub(crate) async fn send_bucket(
    ch: &mut transport::Sender,
    to: Option<usize>,
    one: &Outgoing<'_>,
    kind: Kind,
    stamp: Stamp,
    part_bytes: usize,
    stats: &mut SendStats,
) -> Result<(), super::SyncError> {
    let entries: Vec<BucketEntry> = one.bucket.iter().map(|p| p.entry).collect();
    let layout = Layout::new(&entries, one.srcs, one.src_dtypes.clone());
    for part in bucket_parts(layout.body_len, layout.table_end(), part_bytes) {
        let mut header = Header::stamped(kind, stamp, part.len());
        header.seq = one.seq;
        header.count = one.count;
        header.aux = part.start as u64;
        let start = Instant::now();
        let fill = |buf: &mut [u8]| {
            let t0 = Instant::now();
            layout.fill(buf, header, part.clone());
            t0.elapsed()
        };
        let len = HEADER_LEN + part.len();
        let fill_time = match to {
            None => ch.send_with(len, fill).await?,
            Some(rank) => ch.send_to_with(rank, len, fill).await?,
        };
        stats.fill += fill_time;
        stats.wait += start.elapsed().saturating_sub(fill_time);
        stats.payload_bytes += (HEADER_LEN + part.len()) as u64;
        stats.messages += 1;
    }
    Ok(())
}

/// Where each tensor of one bucket lies in the bucket body, and where its bytes come from.
struct Layout<'a> {
    entries: &'a [BucketEntry],
    offsets: Vec<usize>,
    body_len: usize,
    srcs: &'a [&'a [u8]],
    src_dtypes: Vec<DType>,
}

impl<'a> Layout<'a> {
    fn new(entries: &'a [BucketEntry], srcs: &'a [&'a [u8]], src_dtypes: Vec<DType>) -> Self {
        let (body_len, offsets) = bucket_layout(entries);
        Layout {
            entries,
            offsets,
            body_len,
            srcs,
            src_dtypes,
        }
    }

    fn table_end(&self) -> usize {
        self.offsets.first().copied().unwrap_or(self.body_len)
    }

    /// Write part `part` of the bucket body (header first) into `buf`, hashing it as it goes.
    fn fill(&self, buf: &mut [u8], mut header: Header, part: Range<usize>) {
        let (head, body) = buf.split_at_mut(HEADER_LEN.min(buf.len()));
        let mut h = Xxh3::with_seed(header.checksum_seed());
        let mut pos = part.start;
        let zero = |body: &mut [u8], h: &mut Xxh3, r: Range<usize>| {
            if let Some(gap) = body.get_mut(r.start - part.start..r.end - part.start) {
                gap.fill(0);
                h.update(gap);
            }
        };
        if pos == 0 {
            let table_end = self.table_end().min(part.end);
            if let Some(table) = body.get_mut(..table_end) {
                table.fill(0);
            }
            // `bucket_parts` puts the whole table in the first part.
            let _ = write_bucket_table(self.entries, body);
            h.update(body.get(..table_end).unwrap_or_default());
            pos = table_end;
        }
        for (i, e) in self.entries.iter().enumerate() {
            let off = self.offsets.get(i).copied().unwrap_or(0);
            let end = off + e.byte_len;
            if end <= pos || e.byte_len == 0 {
                continue;
            }
            if off >= part.end {
                break;
            }
            if off > pos {
                zero(body, &mut h, pos..off);
                pos = off;
            }
            let stop = end.min(part.end);
            let (src, from) = (
                self.srcs.get(i).copied().unwrap_or_default(),
                self.src_dtypes.get(i).copied().unwrap_or(e.dtype),
            );
            let (sw, dw) = (from.size_bytes(), e.dtype.size_bytes());
            let mut a = pos;
            while a < stop {
                let b = stop.min(a + CHUNK);
                let (e0, e1) = ((a - off) / dw, (b - off) / dw);
                let (Some(s), Some(d)) = (
                    src.get(e0 * sw..e1 * sw),
                    body.get_mut(a - part.start..b - part.start),
                ) else {
                    break;
                };
                if from == e.dtype {
                    // Hash the source (now in cache), then stream it out: the slot is never read back here.
                    h.update(s);
                    let _ = copy_streaming(d, s);
                } else {
                    // Checked before sending: same element count, castable dtypes.
                    let _ = cast_bytes(s, from, d, e.dtype);
                    h.update(d);
                }
                a = b;
            }
            pos = stop;
        }
        if part.end > pos {
            zero(body, &mut h, pos..part.end);
        }
        header.checksum = h.digest();
        let _ = header.write(head);
    }
}

/// Reusable staging storages, keyed by receiver ordinal.
#[derive(Default)]
pub(crate) struct Pool {
    free: HashMap<u32, Storage>,
}

impl Pool {
    fn take(&mut self, ordinal: u32, len: usize) -> Storage {
        match self.free.remove(&ordinal) {
            Some(s) if s.len() == len => s,
            _ => Storage::zeroed(len),
        }
    }

    pub fn give(&mut self, ordinal: u32, s: Storage) {
        self.free.insert(ordinal, s);
    }

    /// Return all of `staged` to the pool.
    pub(crate) fn give_all(&mut self, staged: Staged) {
        for t in staged {
            self.give(t.ordinal, t.storage);
        }
    }
}

/// One verified tensor of a bucket, staged in `dtype`: the receiver's dtype, or the wire dtype when the
/// tensor is installed on a device that casts it there ([`Assembly::start`]'s `keep_wire`).
pub(crate) struct StagedTensor {
    pub ordinal: u32,
    pub dtype: DType,
    pub storage: Storage,
}

/// A verified bucket's tensors.
pub(crate) type Staged = Vec<StagedTensor>;

/// One bucket being received part by part into staging storages. Nothing outside the pool is touched; a
/// caller that gives up on it returns the storages with [`Assembly::abandon`].
pub(crate) struct Assembly {
    kind: Kind,
    version: u64,
    sequence: u64,
    seq: u32,
    count: u32,
    entries: Vec<(BucketEntry, Range<usize>)>,
    dst_dtypes: Vec<DType>,
    staged: Staged,
    /// Bucket-body offset the next part must start at.
    next: usize,
    body_len: usize,
    bytes: usize,
    /// The private copy of the entry table (first part) that was parsed; it is what gets hashed.
    table: Vec<u8>,
    /// A chunk of the payload copied out of the transport slot, hashed and installed from there: the slot may
    /// be shared memory another process can write, so it is read exactly once.
    scratch: Vec<u8>,
}

/// One part's bytes in the transport slot, addressed by bucket-body offsets.
struct Slot<'a> {
    body: &'a [u8],
    /// Bucket-body offset of `body[0]`.
    start: usize,
}

impl Slot<'_> {
    /// Copy body bytes `a..b` (at most [`CHUNK`]) into `scratch` and return the copy.
    fn copy<'s>(&self, scratch: &'s mut Vec<u8>, a: usize, b: usize) -> &'s [u8] {
        scratch.clear();
        scratch.extend_from_slice(&self.body[a - self.start..b - self.start]);
        scratch
    }

    /// Hash body bytes `from..to` outside the tensors (table, padding): the table from its private copy, the
    /// rest through `scratch`.
    fn hash_gap(&self, h: &mut Xxh3, table: &[u8], scratch: &mut Vec<u8>, from: usize, to: usize) {
        let mut a = from;
        if a < table.len() {
            let b = to.min(table.len());
            h.update(&table[a..b]);
            a = b;
        }
        while a < to {
            let b = to.min(a + CHUNK);
            h.update(self.copy(scratch, a, b));
            a = b;
        }
    }
}

impl Assembly {
    /// Start a bucket from its first part (offset 0), which carries the entry table, and stage that part.
    /// `allowed[ordinal]` says which receiver keys this message kind may carry; `keep_wire[ordinal]` (absent:
    /// false) stages that key in the wire dtype instead of casting it to the receiver's on the host (its
    /// install casts it on the device).
    pub fn start(
        header: &Header,
        body: &[u8],
        meta: &[KeyMeta],
        allowed: &[bool],
        keep_wire: &[bool],
        pool: &mut Pool,
    ) -> Result<Assembly, PartError> {
        if header.aux != 0 {
            return Err(PartError::Invalid(format!(
                "bucket {}/{} of version {} starts at byte {}, not at its first part",
                header.seq, header.count, header.version, header.aux
            )));
        }
        let max_entry = meta
            .iter()
            .map(|m| {
                m.shape
                    .iter()
                    .try_fold(m.dtype.size_bytes().max(8), |a, &d| a.checked_mul(d))
                    .unwrap_or(usize::MAX)
            })
            .max()
            .unwrap_or(0);
        // Parse the table from a private copy (the one hashed below), so the table that is used is the one
        // that is verified.
        let (first, _) = read_bucket_table(body, max_entry)?;
        let table_end = first
            .first()
            .map_or(body.len(), |(_, range)| range.start)
            .min(body.len());
        let table = body[..table_end].to_vec();
        let (entries, body_len) = read_bucket_table(&table, max_entry)?;
        if entries.len() != first.len()
            || entries.iter().zip(&first).any(|((a, ra), (b, rb))| {
                ra != rb || a.ordinal != b.ordinal || a.byte_len != b.byte_len
            })
        {
            return Err(PartError::Invalid(
                "the bucket table changed while it was being read".to_owned(),
            ));
        }
        let mut asm = Assembly {
            table,
            scratch: Vec::with_capacity(CHUNK),
            kind: header.kind,
            version: header.version,
            sequence: header.sequence,
            seq: header.seq,
            count: header.count,
            dst_dtypes: Vec::with_capacity(entries.len()),
            staged: Vec::with_capacity(entries.len()),
            entries: Vec::new(),
            next: 0,
            body_len,
            bytes: 0,
        };
        for (e, _) in &entries {
            let m = match meta.get(e.ordinal as usize) {
                Some(m) if allowed.get(e.ordinal as usize).copied().unwrap_or(false) => m,
                Some(m) => {
                    return asm.fail(
                        PartError::Invalid(format!(
                            "key '{}' is not expected in this {}",
                            m.name,
                            header.kind.name()
                        )),
                        pool,
                    );
                }
                None => {
                    return asm.fail(
                        PartError::Invalid(format!(
                            "ordinal {} is not a key of the receiver",
                            e.ordinal
                        )),
                        pool,
                    );
                }
            };
            if asm.staged.iter().any(|t| t.ordinal == e.ordinal) {
                return asm.fail(
                    PartError::Invalid(format!("key '{}' appears twice", m.name)),
                    pool,
                );
            }
            let numel = m.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
            let ok_len =
                numel.and_then(|n| n.checked_mul(e.dtype.size_bytes())) == Some(e.byte_len);
            let castable = e.dtype == m.dtype || (e.dtype.is_floating() && m.dtype.is_floating());
            if !ok_len || !castable {
                return asm.fail(
                    PartError::Invalid(format!(
                        "key '{}': {} bytes of {} do not fit a {} tensor of shape {:?}",
                        m.name, e.byte_len, e.dtype, m.dtype, m.shape
                    )),
                    pool,
                );
            }
            let dtype = match keep_wire.get(e.ordinal as usize) {
                Some(true) => e.dtype,
                _ => m.dtype,
            };
            asm.dst_dtypes.push(dtype);
            asm.staged.push(StagedTensor {
                ordinal: e.ordinal,
                dtype,
                storage: pool.take(e.ordinal, numel.unwrap_or(0) * dtype.size_bytes()),
            });
        }
        asm.entries = entries;
        match asm.stage_part(header, body) {
            Ok(()) => Ok(asm),
            Err(reason) => asm.fail(reason, pool),
        }
    }

    fn fail<T>(self, e: PartError, pool: &mut Pool) -> Result<T, PartError> {
        self.abandon(pool);
        Err(e)
    }

    /// Give the staging storages back to the pool (the bucket will not be installed).
    pub(crate) fn abandon(self, pool: &mut Pool) {
        pool.give_all(self.staged);
    }

    /// Whether `header` is the next part of this bucket.
    pub(crate) fn is_next_part(&self, header: &Header) -> bool {
        header.kind == self.kind
            && header.version == self.version
            && header.sequence == self.sequence
            && header.seq == self.seq
            && header.count == self.count
            && header.aux == self.next as u64
    }

    /// Stage the next part (after [`Assembly::start`]); the caller gives up on the bucket on error.
    pub(crate) fn add_part(&mut self, header: &Header, body: &[u8]) -> Result<(), PartError> {
        if !self.is_next_part(header) {
            return Err(PartError::Invalid(format!(
                "part at byte {} of bucket {}/{} (version {}) arrived while expecting byte {} of bucket {}/{} (version {})",
                header.aux,
                header.seq,
                header.count,
                header.version,
                self.next,
                self.seq,
                self.count,
                self.version
            )));
        }
        self.stage_part(header, body)
    }

    /// Copy (casting to receiver dtypes) one part into the staging storages, hashing it, then verify it.
    fn stage_part(&mut self, header: &Header, body: &[u8]) -> Result<(), PartError> {
        let part = self.next..self.next + body.len();
        if part.end > self.body_len || (body.is_empty() && self.body_len > 0) {
            return Err(PartError::Invalid(format!(
                "part of {} bytes at byte {} does not fit a bucket body of {} bytes",
                body.len(),
                self.next,
                self.body_len
            )));
        }
        // Parts end 8-byte aligned (`bucket_parts`), so no element is split between two parts.
        if part.end != self.body_len && part.end % 8 != 0 {
            return Err(PartError::Invalid(format!(
                "part at byte {} ends at byte {}, which is not 8-byte aligned",
                part.start, part.end
            )));
        }
        let mut h = Xxh3::with_seed(header.checksum_seed());
        let mut pos = part.start;
        let Assembly {
            entries,
            dst_dtypes,
            staged,
            table,
            scratch,
            ..
        } = self;
        let slot = Slot {
            body,
            start: part.start,
        };
        for (((e, range), to), staged) in
            entries.iter().zip(dst_dtypes.iter()).zip(staged.iter_mut())
        {
            let dst = &mut staged.storage;
            if range.end <= pos || range.is_empty() {
                continue;
            }
            if range.start >= part.end {
                break;
            }
            if range.start > pos {
                slot.hash_gap(&mut h, table, scratch, pos, range.start);
                pos = range.start;
            }
            let stop = range.end.min(part.end);
            let (sw, dw) = (e.dtype.size_bytes(), to.size_bytes());
            let mut a = pos;
            while a < stop {
                let b = stop.min(a + CHUNK);
                let (e0, e1) = ((a - range.start) / sw, (b - range.start) / sw);
                let d = dst.bytes_mut().get_mut(e0 * dw..e1 * dw).ok_or_else(|| {
                    PartError::Invalid(format!(
                        "ordinal {}: staging range out of bounds",
                        e.ordinal
                    ))
                })?;
                // Read the slot once, into a cache-sized private chunk; hash and install that chunk, so the
                // bytes installed are exactly the bytes verified.
                let chunk = slot.copy(scratch, a, b);
                h.update(chunk);
                if e.dtype == *to {
                    copy_streaming(d, chunk)
                } else {
                    cast_bytes(chunk, e.dtype, d, *to)
                }
                .map_err(|source| MessageError::Cast {
                    ordinal: e.ordinal,
                    source,
                })?;
                a = b;
            }
            pos = stop;
        }
        slot.hash_gap(&mut h, table, scratch, pos, part.end);
        header.verify_digest(h.digest())?;
        self.next = part.end;
        self.bytes += HEADER_LEN + body.len();
        Ok(())
    }

    /// Whether every part has arrived (and verified).
    pub(crate) fn is_complete(&self) -> bool {
        self.next == self.body_len
    }

    /// Message bytes (headers included) received for this bucket so far.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The staged tensors of a complete bucket.
    pub fn finish(self) -> Staged {
        self.staged
    }
}

/// Check that every staged tensor fits its slot in `state` (before any swap): the key, dtype and shape the
/// metadata sent at init names, and the staged bytes of that shape in the staged dtype — the tensor's own,
/// or with `device_cast` (a device install casts) any floating dtype for a floating tensor.
pub(crate) fn check_fits(
    staged: &Staged,
    meta: &[KeyMeta],
    state: &StateDict,
    device_cast: bool,
) -> Result<(), String> {
    for s in staged {
        let o = s.ordinal;
        let m = meta
            .get(o as usize)
            .ok_or_else(|| format!("ordinal {o} unknown"))?;
        let (name, t) = state
            .get_index(o as usize)
            .ok_or_else(|| format!("key '{}' is missing from the state dict", m.name))?;
        if name != m.name || t.dtype() != m.dtype || t.shape() != m.shape.as_slice() {
            return Err(format!(
                "state dict entry {o} ('{name}') does not match the metadata sent at init ('{}')",
                m.name
            ));
        }
        let numel = t.bytes().len() / t.dtype().size_bytes().max(1);
        let dtype_ok = s.dtype == t.dtype()
            || (device_cast && s.dtype.is_floating() && t.dtype().is_floating());
        if !dtype_ok || numel.checked_mul(s.dtype.size_bytes()) != Some(s.storage.len()) {
            return Err(format!(
                "staged '{name}' ({} bytes of {}) does not fit its {} tensor of shape {:?}",
                s.storage.len(),
                s.dtype,
                t.dtype(),
                t.shape()
            ));
        }
    }
    Ok(())
}

/// Bytes one thread copies at a time in [`install`] (parallel copies into borrowed memory).
const INSTALL_PIECE: usize = 4 << 20;

/// Install staged storages into `state` (after [`check_fits`]) when nothing will need the old values back:
/// an owned tensor takes the staged storage (a pointer swap, as [`swap_in`]); a borrowed one (the caller's
/// memory, e.g. a torch tensor) gets the staged bytes copied into it, on up to `threads` threads, instead of
/// swapping bytes (a swap reads and writes both sides, twice a copy's memory traffic). Returns storages for
/// the staging pool (their contents are not the old values).
pub(crate) fn install(staged: Staged, state: &mut StateDict, threads: NonZeroUsize) -> Staged {
    let mut out = Vec::with_capacity(staged.len());
    let mut copies: Vec<(StagedTensor, &mut [u8])> = Vec::new();
    let mut by_ordinal: HashMap<u32, StagedTensor> =
        staged.into_iter().map(|t| (t.ordinal, t)).collect();
    for (i, (_, t)) in state.iter_mut().enumerate() {
        let Some(s) = by_ordinal.remove(&(i as u32)) else {
            continue;
        };
        if s.dtype != t.dtype() {
            // Staged in the wire dtype for a device install that did not take it (check_fits allowed the
            // cast): cast on the host, into the tensor.
            let (to, dst) = (t.dtype(), t.bytes_mut());
            let _ = cast_bytes(s.storage.bytes(), s.dtype, dst, to);
            out.push(s);
        } else if t.storage().is_borrowed() && t.bytes().len() == s.storage.len() {
            copies.push((s, t.bytes_mut()));
        } else {
            let StagedTensor {
                ordinal,
                dtype,
                storage,
            } = s;
            if let Ok(prev) = t.replace_storage(storage) {
                out.push(StagedTensor {
                    ordinal,
                    dtype,
                    storage: prev,
                });
            }
        }
    }
    // Whatever did not match a tensor (check_fits rules that out) goes back to the pool untouched.
    out.extend(by_ordinal.into_values());
    let pieces: Vec<(&mut [u8], &[u8])> = copies
        .iter_mut()
        .flat_map(|(s, dst)| {
            dst.chunks_mut(INSTALL_PIECE)
                .zip(s.storage.bytes().chunks(INSTALL_PIECE))
        })
        .collect();
    map_items(pieces, threads, |(d, s)| {
        // Equal lengths by construction (same total, same piece size).
        let _ = copy_streaming(d, s);
    });
    out.extend(copies.into_iter().map(|(s, _)| s));
    out
}

/// Swap staged storages into `state` (after [`check_fits`] without device casts: the staged dtypes are the
/// tensors'); returns the displaced storages, which hold the old values (what an undo swaps back).
pub(crate) fn swap_in(staged: Staged, state: &mut StateDict) -> Staged {
    let mut old = Vec::with_capacity(staged.len());
    for s in staged {
        if let Some((_, t)) = state.get_index_mut(s.ordinal as usize)
            && let Ok(prev) = t.replace_storage(s.storage)
        {
            old.push(StagedTensor {
                ordinal: s.ordinal,
                dtype: s.dtype,
                storage: prev,
            })
        }
    }
    old
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::{Class, Tensor};

    fn p(n: usize) -> Planned {
        Planned {
            key: format!("k{n}"),
            src: DType::U8,
            entry: BucketEntry {
                ordinal: n as u32,
                dtype: DType::U8,
                byte_len: n,
            },
        }
    }

    #[test]
    fn buckets_close_at_size_and_never_split() {
        let sizes = |b: &Vec<Vec<Planned>>| {
            b.iter()
                .map(|v| v.iter().map(|p| p.entry.byte_len).collect::<Vec<_>>())
                .collect::<Vec<_>>()
        };
        let b = plan(vec![p(3), p(4), p(10), p(1), p(2)], 5);
        assert_eq!(sizes(&b), vec![vec![3, 4], vec![10], vec![1, 2]]);
        let b = plan(vec![p(3), p(4)], 1);
        assert_eq!(sizes(&b), vec![vec![3], vec![4]]);
        assert!(plan(vec![], 5).is_empty());
    }

    /// A sender state (f32 weights sent as bf16, a u8 buffer, an empty i64 tensor) and the receiver's metadata.
    fn sample() -> (StateDict, Vec<Planned>, Vec<KeyMeta>) {
        let mut sd = StateDict::new();
        let w: Vec<f32> = (0..37).map(|i| i as f32 * 0.37 - 3.0).collect();
        sd.insert(
            "w".to_owned(),
            Tensor::from_slice(DType::F32, &[37], Class::Trainable, &w).unwrap(),
        );
        let b: Vec<u8> = (0..13).map(|i| i * 17).collect();
        sd.insert(
            "b".to_owned(),
            Tensor::from_slice(DType::U8, &[13], Class::Buffer, &b).unwrap(),
        );
        sd.insert(
            "e".to_owned(),
            Tensor::zeros(DType::I64, &[0, 3], Class::Trainable).unwrap(),
        );
        let planned = vec![
            Planned {
                key: "w".into(),
                src: DType::F32,
                entry: BucketEntry {
                    ordinal: 0,
                    dtype: DType::Bf16,
                    byte_len: 74,
                },
            },
            Planned {
                key: "b".into(),
                src: DType::U8,
                entry: BucketEntry {
                    ordinal: 1,
                    dtype: DType::U8,
                    byte_len: 13,
                },
            },
            Planned {
                key: "e".into(),
                src: DType::I64,
                entry: BucketEntry {
                    ordinal: 2,
                    dtype: DType::I64,
                    byte_len: 0,
                },
            },
        ];
        let meta = vec![
            KeyMeta {
                name: "w".into(),
                dtype: DType::F32,
                shape: vec![37],
            },
            KeyMeta {
                name: "b".into(),
                dtype: DType::U8,
                shape: vec![13],
            },
            KeyMeta {
                name: "e".into(),
                dtype: DType::I64,
                shape: vec![0, 3],
            },
        ];
        (sd, planned, meta)
    }

    /// The messages `send` would publish for one bucket of `planned`, with parts of `part` bytes.
    fn messages(sd: &StateDict, planned: &[Planned], part: usize) -> Vec<Vec<u8>> {
        let entries: Vec<BucketEntry> = planned.iter().map(|p| p.entry).collect();
        let srcs: Vec<&[u8]> = planned
            .iter()
            .map(|p| sd.get(&p.key).unwrap().bytes())
            .collect();
        let layout = Layout::new(&entries, &srcs, planned.iter().map(|p| p.src).collect());
        bucket_parts(layout.body_len, layout.table_end(), part)
            .into_iter()
            .map(|range| {
                let mut header = Header::new(Kind::Bucket, 7, range.len());
                header.aux = range.start as u64;
                let mut buf = vec![0xEE; HEADER_LEN + range.len()];
                layout.fill(&mut buf, header, range);
                buf
            })
            .collect()
    }

    /// Feed `msgs` to a new assembly; the staged bytes per ordinal, or the first error.
    fn assemble(
        msgs: &[Vec<u8>],
        meta: &[KeyMeta],
        pool: &mut Pool,
    ) -> Result<Vec<(u32, Vec<u8>)>, String> {
        let mut asm: Option<Assembly> = None;
        for m in msgs {
            let (h, body) = Header::parse_unverified(m).map_err(|e| e.to_string())?;
            match asm.as_mut() {
                None => {
                    let a = Assembly::start(&h, body, meta, &[true; 3], &[], pool)
                        .map_err(|e| crate::error_chain(&e))?;
                    asm = Some(a);
                }
                Some(a) => {
                    if let Err(e) = a.add_part(&h, body) {
                        if let Some(a) = asm.take() {
                            a.abandon(pool);
                        }
                        return Err(crate::error_chain(&e));
                    }
                }
            }
        }
        let a = asm.ok_or("no message")?;
        if !a.is_complete() {
            a.abandon(pool);
            return Err("incomplete".into());
        }
        Ok(a.finish()
            .into_iter()
            .map(|t| (t.ordinal, t.storage.bytes().to_vec()))
            .collect())
    }

    #[test]
    fn multi_part_bucket_stages_the_same_bytes_as_one_part() {
        let (sd, planned, meta) = sample();
        let mut pool = Pool::default();
        let whole = messages(&sd, &planned, 1 << 20);
        assert_eq!(whole.len(), 1);
        // A single part is an ordinary fully checksummed message.
        assert!(Header::parse(&whole[0]).is_ok());
        let want = assemble(&whole, &meta, &mut pool).unwrap();
        // The f32 weights went through bf16 on the wire and back to f32.
        let got: Vec<u32> = want[0]
            .1
            .chunks(4)
            .map(|c| u32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let expect: Vec<u32> = (0..37)
            .map(|i| u32::from(crate::tensor::cast_f32_to_bf16(i as f32 * 0.37 - 3.0)) << 16)
            .collect();
        assert_eq!(got, expect);
        assert_eq!(want[1].1, (0..13).map(|i| i * 17).collect::<Vec<u8>>());
        for part in [8, 16, 24, 40] {
            let msgs = messages(&sd, &planned, part);
            assert!(
                msgs.len() > 2,
                "part size {part} gives {} messages",
                msgs.len()
            );
            assert_eq!(
                assemble(&msgs, &meta, &mut pool).unwrap(),
                want,
                "part size {part}"
            );
        }
    }

    #[test]
    fn corrupt_missing_or_reordered_parts_are_rejected_and_storages_return() {
        let (sd, planned, meta) = sample();
        let msgs = messages(&sd, &planned, 16);
        let check = |msgs: Vec<Vec<u8>>, expect: &str| {
            let mut pool = Pool::default();
            let err = assemble(&msgs, &meta, &mut pool).unwrap_err();
            assert!(err.contains(expect), "{err:?} should mention {expect:?}");
            // Staging storages of an abandoned bucket go back to the pool, none is lost.
            assert_eq!(pool.free.len(), 3, "{expect}");
        };
        let mut flipped = msgs.clone();
        let last = flipped.len() - 1;
        flipped[last][HEADER_LEN] ^= 0x10;
        check(flipped, "checksum mismatch");
        let mut flipped = msgs.clone();
        flipped[2][HEADER_LEN + 3] ^= 1;
        check(flipped, "checksum mismatch");
        let mut gap = msgs.clone();
        gap.remove(2);
        check(gap, "arrived while expecting byte");
        let mut swapped = msgs.clone();
        swapped.swap(1, 2);
        check(swapped, "arrived while expecting byte");
        let mut cut = msgs.clone();
        cut.pop();
        check(cut, "incomplete");
    }

    proptest::proptest! {
        /// The checksum folded into the copy (each cache-sized chunk hashed right after it is copied, on both
        /// ends) still covers every byte: one flipped bit anywhere in any part, header or body, table,
        /// tensor bytes or padding, is caught and the bucket is not staged.
        #[test]
        fn a_flipped_bit_anywhere_in_a_bucket_is_caught(
            part in proptest::sample::select(vec![8usize, 16, 24, 40, 64, 1 << 20]),
            pick in proptest::prelude::any::<u64>(),
            bit in 0..8u8,
        ) {
            let (sd, planned, meta) = sample();
            let mut msgs = messages(&sd, &planned, part);
            let k = (pick as usize) % msgs.len();
            let pos = (pick as usize / 7) % msgs[k].len();
            msgs[k][pos] ^= 1 << bit;
            let mut pool = Pool::default();
            let got = assemble(&msgs, &meta, &mut pool);
            proptest::prop_assert!(got.is_err(), "part {k} byte {pos} bit {bit}: staged {got:?}");
        }
    }

    #[test]
    fn a_bucket_must_start_with_its_table() {
        let (sd, planned, meta) = sample();
        let msgs = messages(&sd, &planned, 16);
        let (h, body) = Header::parse_unverified(&msgs[1]).unwrap();
        let err = Assembly::start(&h, body, &meta, &[true; 3], &[], &mut Pool::default())
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("not at its first part"), "{err}");
        // A receiver that does not expect a key refuses the bucket before staging anything.
        let (h, body) = Header::parse_unverified(&msgs[0]).unwrap();
        let err = Assembly::start(
            &h,
            body,
            &meta,
            &[true, false, true],
            &[],
            &mut Pool::default(),
        )
        .err()
        .unwrap()
        .to_string();
        assert!(err.contains("key 'b' is not expected"), "{err}");
    }

    /// A sender that stops in the middle of a version (here: after one and a half of three buckets, then
    /// gone) leaves the receiver's weights and version exactly as they were, with `load_instant` too.
    #[test]
    fn partial_send_leaves_weights_intact() {
        use crate::syncer::settings::{SyncerKind, WeightSyncerConfig};
        use crate::syncer::{SyncOptions, WeightSyncer};
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        for load_instant in [true, false] {
            let make = |seed: f32| {
                let mut sd = StateDict::new();
                for k in 0..3 {
                    let v: Vec<f32> = (0..64).map(|i| seed + (k * 64 + i) as f32).collect();
                    sd.insert(
                        format!("t{k}"),
                        Tensor::from_slice(DType::F32, &[64], Class::Trainable, &v).unwrap(),
                    );
                }
                sd
            };
            let mut cfg = WeightSyncerConfig {
                kind: SyncerKind::Bucket,
                ..WeightSyncerConfig::default()
            };
            cfg.bucket.bucket_size = std::num::NonZeroU64::new(256).unwrap();
            cfg.bucket.load_instant = load_instant;
            let mut tx = WeightSyncer::from_config(&cfg, SyncOptions::default()).unwrap();
            tx.settings.part_bytes = 64;
            let rx = WeightSyncer::from_config(&cfg, SyncOptions::default()).unwrap();
            let (mut sender, mut receiver) = (make(1.0), make(-1.0));
            let (ch, mut rxs) = transport::inproc_channel(1);
            let synced = sender.synced_keys();
            let (mut tx, mut rx) = rt.block_on(async {
                let (a, b) = tokio::join!(
                    tx.init_sender(&sender, &synced, ch),
                    rx.init_receiver(&mut receiver, rxs.pop().unwrap())
                );
                let ((mut tx, _), (mut rx, _)) = (a.unwrap(), b.unwrap());
                let (a, b) = tokio::join!(tx.sync(&sender, 1), rx.apply(&mut receiver));
                a.unwrap();
                assert_eq!(b.unwrap().version, 1);
                (tx, rx)
            });
            let before: Vec<Vec<u8>> = receiver.iter().map(|(_, t)| t.bytes().to_vec()).collect();
            sender = make(100.0);
            // Produce version 2's messages into a drained channel, then deliver only a prefix of them.
            let (dummy, mut drx) = transport::inproc_channel(1);
            let (dummy, tap) = transport::tap::tapped(dummy);
            let mut real = std::mem::replace(&mut tx.ch, dummy);
            let mut d = drx.pop().unwrap();
            rt.block_on(async {
                let drain = async { while d.recv_with(|_| ()).await.is_ok() {} };
                let send = async {
                    let r = tx.sync(&sender, 2).await;
                    let (gone, _) = transport::inproc_channel(1);
                    drop(std::mem::replace(&mut tx.ch, gone));
                    r
                };
                let (r, ()) = tokio::join!(send, drain);
                r.unwrap();
            });
            let msgs = tap.payloads();
            // 3 buckets of 256 + table bytes in 64-byte parts: 5 parts each.
            assert_eq!(msgs.len(), 15);
            let r = rt.block_on(async {
                let send = async {
                    for m in &msgs[..7] {
                        real.send(m).await.unwrap();
                    }
                    drop(real);
                };
                let (_, r) = tokio::join!(send, rx.apply(&mut receiver));
                r
            });
            assert!(r.is_err(), "a version cut short must not apply");
            assert_eq!(rx.version(), 1);
            let after: Vec<Vec<u8>> = receiver.iter().map(|(_, t)| t.bytes().to_vec()).collect();
            assert!(
                before == after,
                "weights changed by a partial version (load_instant {load_instant})"
            );
        }
    }
}
