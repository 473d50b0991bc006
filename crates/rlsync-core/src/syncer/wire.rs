//! The weight-sync wire formats (the only serialized types of the syncer), format version 7.
//!
//! Every message is a 56-byte little-endian [`Header`] followed by a body:
//! ```text
//!  0 magic "RLSW" | 4 format u16 | 6 kind u8 | 7 flags u8 | 8 version u64 | 16 sequence u64 | 24 seq u32
//! 28 count u32 | 32 body_len u64 | 40 aux u64 | 48 checksum u64 = xxh3_64_with_seed(body, seed = xxh3_64(header[0..48]))
//! ```
//! so a flipped bit anywhere (header or body) is detected. `version` is the caller's version of the weights (any
//! number, repeated or skipped as the caller likes); `sequence` is the sender's own count of its syncs (0 for the
//! handshake and the init bootstrap, then 1, 2, … per `sync`), which orders payloads: a receiver takes only a
//! sequence newer than its own, and a patch only on the sequence it was built on (`aux`). Bodies by kind:
//! - `Metadata` (receiver → sender): `u32 n`, then per key `u32 name_len, name, u8 dtype, u8 rank, rank × u64`.
//! - `Plan` (sender → receivers): `u8 strategy, u32 n, n × u32 synced ordinals` (ordinals index the receiver's
//!   metadata order); `count` = number of init bootstrap buckets that follow.
//! - `Abort`: UTF-8 reason (the sender refused the handshake).
//! - `InitBucket` / `Bucket` (seq/count = position of the bucket in the version): the bucket body is `u32 n`,
//!   per tensor `u32 ordinal, u8 wire dtype, u8 pad[3], u64 byte_len`, then the tensors' bytes, each starting
//!   8-byte aligned. Since format 2 a bucket body travels as one or more *parts* (so a receiver can copy one
//!   part while the sender fills the next): each part is a message whose body is bytes `aux..aux + body_len`
//!   of the bucket body, with its own checksum. Parts come in order without gaps; the first (`aux` 0) holds
//!   at least the whole entry table, which fixes the bucket body's length, so the receiver knows when the
//!   bucket is complete (see [`bucket_parts`], [`read_bucket_table`]).
//! - `Patch` (aux = the sequence it is based on): see [`PatchBody`]: `u8 index_coding, u8 value_coding, u8 index_width, u8 pad,
//!   u32 n_entries`, per entry `u32 ordinal, u8 dense, u8 pad[3], u64 base, u64 nnz, u64 index_bytes,
//!   u64 escape_bytes` (an entry is one element range of one tensor, so entries decode independently and in
//!   parallel), then `u32 n_streams` (4) and per stream `u64 raw_len, u64 stored_len, u8 codec, stored bytes`.
//!   Since format 3 an entry is either sparse (its changes in the index/value streams) or dense (`dense` 1:
//!   the new bytes of elements `base..base + nnz` in the fourth stream), whichever codes its segment smaller.
//!   Since format 6 a version's patch travels as one or more *parts* (`seq`/`count`, all with the version's
//!   stamp and base): each part is a whole patch body of its own over a run of whole tensors, with its own
//!   checksum, so a receiver validates and installs part k while the sender still builds the next ones; the
//!   version is applied only once every part arrived in order and verified (earlier parts are taken back out
//!   when a later one fails).
//!
//! Rejoin (a receiver that joined late catches up; see `syncer/rejoin.rs`), added as new kinds:
//! - `Rejoin` (receiver → sender, version = the version it holds): a `Metadata` body.
//! - `RejoinPlan` (sender → that receiver): a `Plan` body, then `u32 n, n × u32 ordinals` of the keys the init
//!   bootstrap covers beyond the synced ones (frozen weights).
//! - `Held` (receiver → sender, version = the version it holds): `u64 checksum of the synced keys, u64 checksum
//!   of those bootstrap-only keys`, both as [`crate::tensor::state_checksum`] computes them.
//! - `CatchUp` (sender → that receiver, version and sequence = those it will hold): `u8 mode (0 replay, 1 full,
//!   2 deferred to the next version), u32 bootstrap buckets, u32 patches, u32 full buckets, u64 base sequence`
//!   (replay: the sequence of the version it holds, which the first replayed patch is based on; else 0); the
//!   messages follow in that order: `InitBucket`s, then logged `Patch`es exactly as first sent, or `Bucket`s of
//!   that version.
//!
//! Self-describing buckets (no handshake: a bucket sender made by `WeightSyncer::init_sender_described`, as
//! RLinf's bucket syncer works), added in format 5:
//! - `Manifest` (sender → receivers, the first message of every version, stamped like its buckets; `count` =
//!   the number of `Bucket`s that follow): `u32 n`, per key `u32 name_len, name, u8 wire dtype, u8 target dtype,
//!   u8 rank, rank × u64` (the target dtype is the sender's own: the one its checksum assumes). The buckets'
//!   ordinals then index the manifest, not a receiver's metadata; the receiver maps them by name.
//!
//! Reports (receiver → sender, between payloads, on rlsync's own channels when the receiver reports; see
//! [`crate::syncer::SyncReceiver::set_reports`]), added as new kinds:
//! - `Applied` (version and sequence = those the receiver installed): empty body.
//! - `Declined` (version and sequence = those of the staged update the receiver aborted): UTF-8 reason.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use crate::bytes::{BytesError, Reader, Writer, put_uint, read_uint};
use crate::tensor::DType;

pub(crate) const MAGIC: [u8; 4] = *b"RLSW";
/// 4: every header carries the sender's sequence number beside the caller's version, and patches are based on
/// a sequence (3: versions ordered payloads and had to increase). 3: a patch entry is sparse or dense (2: always sparse, 3 streams). 2: bucket bodies travel as parts (1: one
/// message per bucket); patch entries are element ranges with their own stream extents (1: one entry per
/// tensor).
/// 5: `Manifest` messages (self-describing buckets, no handshake); receivers' `Applied` / `Declined` reports.
/// 6: a patch travels as parts (`seq`/`count`), each a patch body over whole tensors (5: one message).
/// 7: the `Held` checksums are the chunked state checksum (`tensor::state_checksum`: each tensor's 1 MiB
/// chunks hashed on their own, on all threads; 6: one xxh3 stream), so peers of format 6 never compare them.
pub(crate) const FORMAT_VERSION: u16 = 7;
pub const HEADER_LEN: usize = 56;

/// What orders a payload: the caller's version of the weights it carries and the sender's sequence number of
/// the sync it belongs to (0: the handshake and the init bootstrap).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Stamp {
    pub version: u64,
    pub sequence: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("truncated: need {need} bytes, got {got}")]
    Truncated { need: usize, got: usize },
    #[error("bad magic {found:02x?} (not an rlsync weight-sync message)")]
    BadMagic { found: [u8; 4] },
    #[error("unsupported wire format version {found} (this build speaks {FORMAT_VERSION})")]
    FormatVersion { found: u16 },
    #[error("unknown message kind {code}")]
    UnknownKind { code: u8 },
    #[error("expected a {expected} message, got {got}")]
    UnexpectedKind {
        expected: &'static str,
        got: &'static str,
    },
    #[error("body length {declared} in header, {actual} bytes present")]
    BodyLength { declared: u64, actual: usize },
    #[error("checksum mismatch (header says {expected:#018x}, content hashes to {actual:#018x})")]
    Checksum { expected: u64, actual: u64 },
    #[error("malformed {what}: {reason}")]
    Malformed { what: &'static str, reason: String },
    /// A structure that does not read (`what` names it).
    #[error("malformed {what}")]
    Bytes {
        what: &'static str,
        #[source]
        source: BytesError,
    },
    #[error("malformed metadata: key name")]
    KeyName {
        #[source]
        source: std::str::Utf8Error,
    },
    #[error("malformed patch: lz4")]
    Lz4 {
        #[source]
        source: lz4_flex::block::DecompressError,
    },
}

fn malformed(what: &'static str, reason: impl Into<String>) -> WireError {
    WireError::Malformed {
        what,
        reason: reason.into(),
    }
}

/// Message kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Metadata,
    Plan,
    Abort,
    InitBucket,
    Patch,
    Bucket,
    Rejoin,
    RejoinPlan,
    Held,
    CatchUp,
    Manifest,
    Applied,
    Declined,
}

impl Kind {
    fn code(self) -> u8 {
        match self {
            Kind::Metadata => 1,
            Kind::Plan => 2,
            Kind::Abort => 3,
            Kind::InitBucket => 4,
            Kind::Patch => 5,
            Kind::Bucket => 6,
            Kind::Rejoin => 7,
            Kind::RejoinPlan => 8,
            Kind::Held => 9,
            Kind::CatchUp => 10,
            Kind::Manifest => 11,
            Kind::Applied => 12,
            Kind::Declined => 13,
        }
    }

    fn from_code(c: u8) -> Option<Kind> {
        Some(match c {
            1 => Kind::Metadata,
            2 => Kind::Plan,
            3 => Kind::Abort,
            4 => Kind::InitBucket,
            5 => Kind::Patch,
            6 => Kind::Bucket,
            7 => Kind::Rejoin,
            8 => Kind::RejoinPlan,
            9 => Kind::Held,
            10 => Kind::CatchUp,
            11 => Kind::Manifest,
            12 => Kind::Applied,
            13 => Kind::Declined,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Kind::Metadata => "metadata",
            Kind::Plan => "plan",
            Kind::Abort => "abort",
            Kind::InitBucket => "init bucket",
            Kind::Patch => "patch",
            Kind::Bucket => "bucket",
            Kind::Rejoin => "rejoin",
            Kind::RejoinPlan => "rejoin plan",
            Kind::Held => "held",
            Kind::CatchUp => "catch-up",
            Kind::Manifest => "manifest",
            Kind::Applied => "applied",
            Kind::Declined => "declined",
        }
    }
}

/// The fixed message header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    pub flags: u8,
    /// The caller's version of the weights the message carries.
    pub version: u64,
    /// The sender's sequence number of the sync the message belongs to (0: handshake and init bootstrap).
    pub sequence: u64,
    /// Position of the message's bucket in its transfer (0 otherwise).
    pub seq: u32,
    pub count: u32,
    pub body_len: u64,
    pub aux: u64,
    pub checksum: u64,
}

impl Header {
    pub fn new(kind: Kind, version: u64, body_len: usize) -> Header {
        Header {
            kind,
            flags: 0,
            version,
            sequence: 0,
            seq: 0,
            count: 1,
            body_len: body_len as u64,
            aux: 0,
            checksum: 0,
        }
    }

    /// The header of a message of sync `stamp` (its version and sequence).
    pub fn stamped(kind: Kind, stamp: Stamp, body_len: usize) -> Header {
        Header {
            sequence: stamp.sequence,
            ..Header::new(kind, stamp.version, body_len)
        }
    }

    /// The version and sequence the message carries.
    pub fn stamp(&self) -> Stamp {
        Stamp {
            version: self.version,
            sequence: self.sequence,
        }
    }

    /// The header's first 48 bytes (everything but the checksum).
    fn prefix(&self) -> Writer {
        let mut w = Writer::with_capacity(HEADER_LEN);
        w.bytes(&MAGIC)
            .u16(FORMAT_VERSION)
            .u8(self.kind.code())
            .u8(self.flags)
            .u64(self.version)
            .u64(self.sequence)
            .u32(self.seq)
            .u32(self.count)
            .u64(self.body_len)
            .u64(self.aux);
        w
    }

    /// Seed of the body checksum (binds the header fields to the body).
    pub(crate) fn checksum_seed(&self) -> u64 {
        xxh3_64(self.prefix().as_slice())
    }

    /// Write the header with `checksum` into `out[..HEADER_LEN]`.
    pub fn write(&self, out: &mut [u8]) -> Result<(), WireError> {
        let got = out.len();
        let dst = out.get_mut(..HEADER_LEN).ok_or(WireError::Truncated {
            need: HEADER_LEN,
            got,
        })?;
        let mut w = self.prefix();
        w.u64(self.checksum);
        dst.copy_from_slice(w.as_slice());
        Ok(())
    }

    /// Parse the header and check the body length, without hashing the body (callers that copy the body
    /// hash while copying, then call [`Header::verify_digest`]).
    pub(crate) fn parse_unverified(msg: &[u8]) -> Result<(Header, &[u8]), WireError> {
        let h = msg.get(..HEADER_LEN).ok_or(WireError::Truncated {
            need: HEADER_LEN,
            got: msg.len(),
        })?;
        let mut r = Reader::new(h, "header");
        let magic = r.array()?;
        if magic != MAGIC {
            return Err(WireError::BadMagic { found: magic });
        }
        let format = r.u16()?;
        if format != FORMAT_VERSION {
            return Err(WireError::FormatVersion { found: format });
        }
        let code = r.u8()?;
        let kind = Kind::from_code(code).ok_or(WireError::UnknownKind { code })?;
        let header = Header {
            kind,
            flags: r.u8()?,
            version: r.u64()?,
            sequence: r.u64()?,
            seq: r.u32()?,
            count: r.u32()?,
            body_len: r.u64()?,
            aux: r.u64()?,
            checksum: r.u64()?,
        };
        let body = &msg[HEADER_LEN..];
        if header.body_len != body.len() as u64 {
            return Err(WireError::BodyLength {
                declared: header.body_len,
                actual: body.len(),
            });
        }
        if header.seq >= header.count {
            return Err(malformed(
                "header",
                format!(
                    "sequence number {} of {} messages",
                    header.seq, header.count
                ),
            ));
        }
        Ok((header, body))
    }

    /// Parse and fully verify a message (header + body checksum).
    pub fn parse(msg: &[u8]) -> Result<(Header, &[u8]), WireError> {
        let (h, body) = Header::parse_unverified(msg)?;
        h.verify_digest(xxh3_64_with_seed(body, h.checksum_seed()))?;
        Ok((h, body))
    }

    pub(crate) fn verify_digest(&self, actual: u64) -> Result<(), WireError> {
        if actual == self.checksum {
            Ok(())
        } else {
            Err(WireError::Checksum {
                expected: self.checksum,
                actual,
            })
        }
    }

    pub fn expect(&self, kind: Kind) -> Result<(), WireError> {
        if self.kind == kind {
            Ok(())
        } else {
            Err(WireError::UnexpectedKind {
                expected: kind.name(),
                got: self.kind.name(),
            })
        }
    }
}

/// Assemble a small message (header + body) into one buffer.
pub fn message(mut header: Header, body: &[u8]) -> Vec<u8> {
    header.body_len = body.len() as u64;
    header.checksum = xxh3_64_with_seed(body, header.checksum_seed());
    let mut out = vec![0u8; HEADER_LEN + body.len()];
    // The buffer is exactly HEADER_LEN + body long, so neither step can fail.
    let _ = header.write(&mut out);
    out[HEADER_LEN..].copy_from_slice(body);
    out
}

impl From<BytesError> for WireError {
    fn from(source: BytesError) -> WireError {
        WireError::Bytes {
            what: source.what(),
            source,
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// handshake

/// One receiver-side key: name, dtype, shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyMeta {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
}

pub(crate) fn encode_metadata(keys: &[KeyMeta]) -> Vec<u8> {
    let mut w = Writer::new();
    // Counts and lengths are `as` casts, as the format has always written them: ordinals are u32 throughout
    // the syncer, and a key name or rank beyond the field's range is not a model any framework builds.
    w.u32(keys.len() as u32);
    for k in keys {
        w.u32(k.name.len() as u32)
            .bytes(k.name.as_bytes())
            .u8(k.dtype.code())
            .u8(k.shape.len() as u8);
        for &d in &k.shape {
            w.u64(d as u64);
        }
    }
    message(Header::new(Kind::Metadata, 0, w.len()), w.as_slice())
}

pub(crate) fn decode_metadata(body: &[u8]) -> Result<Vec<KeyMeta>, WireError> {
    let mut r = Reader::new(body, "metadata");
    let n = r.u32()? as usize;
    let mut keys = Vec::with_capacity(n.min(body.len() / 6));
    for _ in 0..n {
        let len = r.u32()? as usize;
        let name = std::str::from_utf8(r.take(len)?)
            .map_err(|source| WireError::KeyName { source })?
            .to_string();
        let code = r.u8()?;
        let dtype = DType::from_code(code)
            .ok_or_else(|| malformed("metadata", format!("key '{name}': dtype code {code}")))?;
        let rank = usize::from(r.u8()?);
        let mut shape = Vec::with_capacity(rank);
        for _ in 0..rank {
            shape.push(
                usize::try_from(r.u64()?)
                    .map_err(|_| malformed("metadata", format!("key '{name}': dim overflow")))?,
            );
        }
        keys.push(KeyMeta { name, dtype, shape });
    }
    r.finish()?;
    Ok(keys)
}

/// One key of a self-describing version's [`Kind::Manifest`]: name, shape, the dtype on the wire and the
/// sender's own dtype.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ManifestKey {
    pub name: String,
    pub wire: DType,
    pub target: DType,
    pub shape: Vec<usize>,
}

/// The manifest of the version `stamp`, followed by `buckets` buckets.
pub(crate) fn encode_manifest(keys: &[ManifestKey], stamp: Stamp, buckets: u32) -> Vec<u8> {
    let mut w = Writer::new();
    // As in `encode_metadata`: counts, name lengths and ranks fit their fields in every model.
    w.u32(keys.len() as u32);
    for k in keys {
        w.u32(k.name.len() as u32)
            .bytes(k.name.as_bytes())
            .u8(k.wire.code())
            .u8(k.target.code())
            .u8(k.shape.len() as u8);
        for &d in &k.shape {
            w.u64(d as u64);
        }
    }
    let mut h = Header::stamped(Kind::Manifest, stamp, w.len());
    h.count = buckets;
    message(h, w.as_slice())
}

pub(crate) fn decode_manifest(body: &[u8]) -> Result<Vec<ManifestKey>, WireError> {
    let mut r = Reader::new(body, "manifest");
    let n = r.u32()? as usize;
    let mut keys = Vec::with_capacity(n.min(body.len() / 7));
    for _ in 0..n {
        let len = r.u32()? as usize;
        let name = std::str::from_utf8(r.take(len)?)
            .map_err(|source| WireError::KeyName { source })?
            .to_string();
        let mut dtype = |what: &str| -> Result<DType, WireError> {
            let code = r.u8()?;
            DType::from_code(code).ok_or_else(|| {
                malformed(
                    "manifest",
                    format!("key '{name}': {what} dtype code {code}"),
                )
            })
        };
        let wire = dtype("wire")?;
        let target = dtype("target")?;
        let rank = usize::from(r.u8()?);
        let mut shape = Vec::with_capacity(rank);
        for _ in 0..rank {
            shape.push(
                usize::try_from(r.u64()?)
                    .map_err(|_| malformed("manifest", format!("key '{name}': dim overflow")))?,
            );
        }
        keys.push(ManifestKey {
            name,
            wire,
            target,
            shape,
        });
    }
    r.finish()?;
    Ok(keys)
}

/// Which strategy follows the handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Strategy {
    Patch,
    Bucket,
}

/// The sender's answer to the metadata: the strategy, the synced ordinals, and how many init buckets follow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Plan {
    pub strategy: Strategy,
    pub synced: Vec<u32>,
    pub init_buckets: u32,
}

pub(crate) fn encode_plan(plan: &Plan) -> Vec<u8> {
    let mut w = Writer::with_capacity(5 + 4 * plan.synced.len());
    w.u8(match plan.strategy {
        Strategy::Patch => 0,
        Strategy::Bucket => 1,
    });
    put_ordinals(&mut w, &plan.synced);
    let mut h = Header::new(Kind::Plan, 0, w.len());
    h.aux = u64::from(plan.init_buckets);
    message(h, w.as_slice())
}

/// `u32 n, n × u32 ordinals` (ordinals are u32, so a list of them never outgrows its count).
fn put_ordinals(w: &mut Writer, ordinals: &[u32]) {
    w.u32(ordinals.len() as u32);
    for &o in ordinals {
        w.u32(o);
    }
}

pub(crate) fn decode_plan(header: &Header, body: &[u8]) -> Result<Plan, WireError> {
    let mut r = Reader::new(body, "plan");
    let strategy = match r.u8()? {
        0 => Strategy::Patch,
        1 => Strategy::Bucket,
        s => return Err(malformed("plan", format!("strategy code {s}"))),
    };
    let n = r.u32()? as usize;
    let mut synced = Vec::with_capacity(n.min(body.len() / 4));
    for _ in 0..n {
        synced.push(r.u32()?);
    }
    r.finish()?;
    let init_buckets =
        u32::try_from(header.aux).map_err(|_| malformed("plan", "init bucket count overflow"))?;
    Ok(Plan {
        strategy,
        synced,
        init_buckets,
    })
}

// ---------------------------------------------------------------------------------------------------------
// rejoin

/// A rejoining receiver's request: its metadata and the version it holds.
pub(crate) fn encode_rejoin(keys: &[KeyMeta], held: u64) -> Vec<u8> {
    let meta = encode_metadata(keys);
    let body = meta.get(HEADER_LEN..).unwrap_or_default();
    message(Header::new(Kind::Rejoin, held, body.len()), body)
}

/// The sender's plan for a rejoining receiver: the init plan (no init buckets) and the bootstrap-only keys.
pub(crate) fn encode_rejoin_plan(plan: &Plan, boot_only: &[u32]) -> Vec<u8> {
    let init = encode_plan(plan);
    let mut w = Writer::from_vec(init.get(HEADER_LEN..).unwrap_or_default().to_vec());
    put_ordinals(&mut w, boot_only);
    message(Header::new(Kind::RejoinPlan, 0, w.len()), w.as_slice())
}

pub(crate) fn decode_rejoin_plan(body: &[u8]) -> Result<(Plan, Vec<u32>), WireError> {
    let mut r = Reader::new(body, "rejoin plan");
    let strategy = match r.u8()? {
        0 => Strategy::Patch,
        1 => Strategy::Bucket,
        s => return Err(malformed("rejoin plan", format!("strategy code {s}"))),
    };
    let ordinals = |r: &mut Reader| -> Result<Vec<u32>, WireError> {
        let n = r.u32()? as usize;
        if n > body.len() / 4 {
            return Err(malformed(
                "rejoin plan",
                format!("{n} ordinals in {} bytes", body.len()),
            ));
        }
        (0..n).map(|_| Ok(r.u32()?)).collect()
    };
    let synced = ordinals(&mut r)?;
    let boot_only = ordinals(&mut r)?;
    r.finish()?;
    Ok((
        Plan {
            strategy,
            synced,
            init_buckets: 0,
        },
        boot_only,
    ))
}

/// What a rejoining receiver holds: its version and the checksums of its synced and bootstrap-only keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    pub version: u64,
    pub synced: u64,
    pub boot_only: u64,
}

pub(crate) fn encode_held(held: &Held) -> Vec<u8> {
    let mut w = Writer::with_capacity(16);
    w.u64(held.synced).u64(held.boot_only);
    message(Header::new(Kind::Held, held.version, w.len()), w.as_slice())
}

pub(crate) fn decode_held(header: &Header, body: &[u8]) -> Result<Held, WireError> {
    let mut r = Reader::new(body, "held");
    let held = Held {
        version: header.version,
        synced: r.u64()?,
        boot_only: r.u64()?,
    };
    r.finish()?;
    Ok(held)
}

/// How a rejoining receiver catches up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CatchUpMode {
    /// The logged patches from its version on.
    Replay,
    /// Every synced tensor of the sender's last version.
    Full,
    /// Nothing now: the next version is a full transfer anyway (bucket syncer).
    Deferred,
}

/// The announcement of a catch-up: mode, target version and sequence, the message counts that follow, and
/// (replay) the sequence the first replayed patch is based on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CatchUpPlan {
    pub mode: CatchUpMode,
    pub to: Stamp,
    pub boot_buckets: u32,
    pub patches: u32,
    pub full_buckets: u32,
    pub base_sequence: u64,
}

pub(crate) fn encode_catch_up(c: &CatchUpPlan) -> Vec<u8> {
    let mut w = Writer::with_capacity(21);
    w.u8(match c.mode {
        CatchUpMode::Replay => 0,
        CatchUpMode::Full => 1,
        CatchUpMode::Deferred => 2,
    })
    .u32(c.boot_buckets)
    .u32(c.patches)
    .u32(c.full_buckets)
    .u64(c.base_sequence);
    message(Header::stamped(Kind::CatchUp, c.to, w.len()), w.as_slice())
}

pub(crate) fn decode_catch_up(header: &Header, body: &[u8]) -> Result<CatchUpPlan, WireError> {
    let mut r = Reader::new(body, "catch-up");
    let mode = match r.u8()? {
        0 => CatchUpMode::Replay,
        1 => CatchUpMode::Full,
        2 => CatchUpMode::Deferred,
        m => return Err(malformed("catch-up", format!("mode code {m}"))),
    };
    let c = CatchUpPlan {
        mode,
        to: header.stamp(),
        boot_buckets: r.u32()?,
        patches: r.u32()?,
        full_buckets: r.u32()?,
        base_sequence: r.u64()?,
    };
    r.finish()?;
    if c.mode != CatchUpMode::Replay && c.base_sequence != 0 {
        return Err(malformed("catch-up", "a base sequence outside a replay"));
    }
    if c.base_sequence > c.to.sequence {
        return Err(malformed(
            "catch-up",
            format!(
                "base sequence {} beyond the target's {}",
                c.base_sequence, c.to.sequence
            ),
        ));
    }
    if c.mode != CatchUpMode::Replay && c.patches != 0 {
        return Err(malformed("catch-up", "patches announced outside a replay"));
    }
    if c.mode != CatchUpMode::Full && c.full_buckets != 0 {
        return Err(malformed(
            "catch-up",
            "full buckets announced outside a full catch-up",
        ));
    }
    Ok(c)
}

/// A receiver's report that it installed `stamp`.
pub(crate) fn encode_applied(stamp: Stamp) -> Vec<u8> {
    message(Header::stamped(Kind::Applied, stamp, 0), &[])
}

/// A receiver's report that it dropped the update `stamp` without installing it, and why.
pub(crate) fn encode_declined(stamp: Stamp, reason: &str) -> Vec<u8> {
    message(
        Header::stamped(Kind::Declined, stamp, reason.len()),
        reason.as_bytes(),
    )
}

pub(crate) fn encode_abort(reason: &str) -> Vec<u8> {
    message(Header::new(Kind::Abort, 0, reason.len()), reason.as_bytes())
}

pub(crate) fn decode_abort(body: &[u8]) -> String {
    String::from_utf8_lossy(body).into_owned()
}

// ---------------------------------------------------------------------------------------------------------
// buckets

/// One tensor inside a bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BucketEntry {
    pub ordinal: u32,
    pub dtype: DType,
    pub byte_len: usize,
}

const BUCKET_ENTRY_LEN: usize = 16;

fn pad8(n: usize) -> usize {
    n.div_ceil(8) * 8
}

/// Body length of a bucket and the offsets (within the body) of each tensor's bytes.
pub(crate) fn bucket_layout(entries: &[BucketEntry]) -> (usize, Vec<usize>) {
    let mut off = pad8(4 + entries.len() * BUCKET_ENTRY_LEN);
    let mut offsets = Vec::with_capacity(entries.len());
    for e in entries {
        offsets.push(off);
        off = pad8(off + e.byte_len);
    }
    (off, offsets)
}

/// Write a bucket's entry table into the start of `body` (the tensors' bytes go at the layout's offsets).
pub(crate) fn write_bucket_table(
    entries: &[BucketEntry],
    body: &mut [u8],
) -> Result<(), WireError> {
    let need = 4 + entries.len() * BUCKET_ENTRY_LEN;
    let got = body.len();
    let dst = body
        .get_mut(..need)
        .ok_or(WireError::Truncated { need, got })?;
    let mut w = Writer::with_capacity(need);
    // A bucket holds at most one entry per synced tensor, and ordinals are u32.
    w.u32(entries.len() as u32);
    for e in entries {
        w.u32(e.ordinal)
            .u8(e.dtype.code())
            .bytes(&[0; 3])
            .u64(e.byte_len as u64);
    }
    dst.copy_from_slice(w.as_slice());
    Ok(())
}

/// Byte ranges of the parts a bucket body of `body_len` bytes is sent in: parts of `part_size` bytes, except
/// that the first one is stretched to hold the whole entry table (`table_end`, the first tensor's offset).
/// A body always has at least one part. `part_size` is rounded up to a multiple of 8, so every part boundary
/// is 8-byte aligned and no tensor element straddles two parts.
#[allow(clippy::single_range_in_vec_init)] // a list of part ranges, which may hold just one
pub(crate) fn bucket_parts(
    body_len: usize,
    table_end: usize,
    part_size: usize,
) -> Vec<std::ops::Range<usize>> {
    let step = pad8(part_size.max(8));
    let first_end = table_end.max(step).min(body_len);
    let mut parts = vec![0..first_end];
    let mut start = first_end;
    while start < body_len {
        let end = start.saturating_add(step).min(body_len);
        parts.push(start..end);
        start = end;
    }
    parts
}

/// A bucket's entries with their byte ranges inside the bucket body, and the body's total length.
pub(crate) type BucketTable = (Vec<(BucketEntry, std::ops::Range<usize>)>, usize);

/// Parse the entry table at the start of a bucket's first part. The whole table must lie inside `first`;
/// the returned length is that of the whole bucket body (all parts). Entry sizes are limited to
/// `max_entry_bytes` (the receiver's largest tensor), so layout arithmetic cannot overflow.
pub(crate) fn read_bucket_table(
    first: &[u8],
    max_entry_bytes: usize,
) -> Result<BucketTable, WireError> {
    let mut r = Reader::new(first, "bucket table");
    let n = r.u32()? as usize;
    if n > first.len() / BUCKET_ENTRY_LEN {
        return Err(malformed(
            "bucket table",
            format!("{n} entries cannot fit in {} bytes", first.len()),
        ));
    }
    let mut entries = Vec::with_capacity(n);
    // Bounds the layout below: the table, plus each entry padded to 8 bytes.
    let mut sum = first.len();
    for _ in 0..n {
        let ordinal = r.u32()?;
        let code = r.u8()?;
        let dtype = DType::from_code(code)
            .ok_or_else(|| malformed("bucket table", format!("dtype code {code}")))?;
        r.take(3)?;
        let byte_len = r.count(max_entry_bytes)?;
        sum = sum
            .checked_add(byte_len)
            .and_then(|x| x.checked_add(8))
            .ok_or_else(|| malformed("bucket table", "entry sizes overflow"))?;
        entries.push(BucketEntry {
            ordinal,
            dtype,
            byte_len,
        });
    }
    let (total, offsets) = bucket_layout(&entries);
    let table_end = offsets.first().copied().unwrap_or(total);
    if table_end > first.len() {
        return Err(malformed(
            "bucket table",
            format!(
                "the table ends at byte {table_end}, the first part has {}",
                first.len()
            ),
        ));
    }
    Ok((
        entries
            .into_iter()
            .zip(offsets)
            .map(|(e, o)| (e, o..o + e.byte_len))
            .collect(),
        total,
    ))
}

/// Parse a whole (single-part) bucket body into entries and their byte ranges (bounds-checked against it).
#[cfg(test)]
pub(crate) fn read_bucket(
    body: &[u8],
) -> Result<Vec<(BucketEntry, std::ops::Range<usize>)>, WireError> {
    let (entries, total) = read_bucket_table(body, body.len())?;
    if total != body.len() {
        return Err(malformed(
            "bucket",
            format!("entries describe {total} bytes, body has {}", body.len()),
        ));
    }
    Ok(entries)
}

// ---------------------------------------------------------------------------------------------------------
// patches

/// How changed positions are coded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IndexCoding {
    /// Absolute (row, col) of the 2-D COO view, each stream at the narrowest unsigned width (RLinf layout).
    Coo,
    /// Row-major gaps in the 2-D COO view (`idx - prev - 1`), LEB128 varints (delta-coded coordinates).
    Gaps,
}

/// How new values are coded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueCoding {
    /// The new element bytes.
    Raw,
    /// Integer difference of the bit patterns vs the previous value (zig-zag): 2-bit codes (1..=3 = the
    /// zig-zag value, 0 = escape) plus a varint escape stream. A bf16 weight nudged by one ulp costs 2 bits.
    Delta,
}

/// Stream codec.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    Plain,
    Lz4,
}

/// One entry of a patch: the changes of one tensor at element offsets `base..` (up to the next entry of the
/// same tensor, or its end). Its data is a contiguous run of each stream, so entries decode independently.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PatchEntry {
    pub ordinal: u32,
    /// Dense: the entry holds the new bytes of elements `base..base + nnz` in the dense stream (no index or
    /// escape bytes). Sparse: `nnz` changes in the index and value streams.
    pub dense: bool,
    /// First element (row-major) the entry may touch; gap coding starts counting here.
    pub base: u64,
    /// Sparse: changed elements. Dense: elements written.
    pub nnz: u64,
    /// Bytes of the index stream (gaps, or rows and cols each) that belong to this entry.
    pub index_bytes: u64,
    /// Bytes of the escape stream that belong to this entry (delta values only; 0 otherwise).
    pub escape_bytes: u64,
}

/// Bytes of one serialized [`PatchEntry`].
const PATCH_ENTRY_LEN: usize = 40;

/// Streams of a patch body: index, codes or cols, escapes or values, dense values.
pub(crate) const PATCH_STREAMS: usize = 4;

/// A decoded (but not yet interpreted) patch body: entries and raw streams.
#[derive(Debug, Clone)]
pub struct PatchBody {
    pub index: IndexCoding,
    pub value: ValueCoding,
    /// Bytes per row/col for [`IndexCoding::Coo`].
    pub index_width: u8,
    /// Entries ordered by `(ordinal, base)`, strictly increasing.
    pub entries: Vec<PatchEntry>,
    /// Coo: rows, cols, values. Gaps: gaps, codes (2 bits each, every entry starting on a byte), escapes.
    /// Both: then the dense entries' element bytes, in entry order.
    pub streams: Vec<Vec<u8>>,
}

impl PatchBody {
    /// The parts of one version's patch as one body (entries and streams one part after another), as one
    /// message would have carried them: parts cover consecutive runs of whole tensors. COO coordinates are
    /// widened to the widest part's width. Parts that code differently, or hold another number of streams, do
    /// not join. The result is checked like any body (`patch::validate`) before it is installed.
    pub fn join(parts: Vec<PatchBody>) -> Result<PatchBody, WireError> {
        let mut it = parts.into_iter();
        let Some(mut out) = it.next() else {
            return Err(malformed("patch", "a version without parts"));
        };
        let rest: Vec<PatchBody> = it.collect();
        if rest.is_empty() {
            return Ok(out);
        }
        if out.streams.len() != PATCH_STREAMS
            || rest.iter().any(|p| {
                p.index != out.index || p.value != out.value || p.streams.len() != PATCH_STREAMS
            })
        {
            return Err(malformed(
                "patch",
                "the parts of one version code their streams differently",
            ));
        }
        let coo = out.index == IndexCoding::Coo;
        let width = rest
            .iter()
            .map(|p| p.index_width)
            .fold(out.index_width, u8::max);
        if coo && ![1, 2, 4, 8].contains(&width) {
            return Err(malformed("patch", format!("index width {width}")));
        }
        let mut all = Vec::with_capacity(rest.len() + 1);
        all.push(std::mem::take(&mut out.entries));
        let mut streams: Vec<Vec<u8>> = std::mem::take(&mut out.streams);
        let first_width = out.index_width;
        if coo && first_width != width {
            widen_coo(&mut streams, &mut all[0], first_width, width)?;
        }
        for mut p in rest {
            if coo && p.index_width != width {
                widen_coo(&mut p.streams, &mut p.entries, p.index_width, width)?;
            }
            all.push(p.entries);
            for (dst, src) in streams.iter_mut().zip(&p.streams) {
                dst.extend_from_slice(src);
            }
        }
        out.entries = all.into_iter().flatten().collect();
        out.streams = streams;
        out.index_width = if coo { width } else { out.index_width };
        Ok(out)
    }

    /// The body with each stream as one part.
    pub fn view(&self) -> PatchView<'_> {
        PatchView {
            index: self.index,
            value: self.value,
            index_width: self.index_width,
            entries: &self.entries,
            streams: self.streams.iter().map(|s| vec![s.as_slice()]).collect(),
        }
    }
}

/// Rewrite a COO part's row and column streams from `from`-byte to `to`-byte coordinates (and its entries'
/// index extents with them).
fn widen_coo(
    streams: &mut [Vec<u8>],
    entries: &mut [PatchEntry],
    from: u8,
    to: u8,
) -> Result<(), WireError> {
    let w = u64::from(from);
    if ![1, 2, 4, 8].contains(&from)
        || streams
            .iter()
            .take(2)
            .any(|s| !(s.len() as u64).is_multiple_of(w))
        || entries.iter().any(|e| !e.index_bytes.is_multiple_of(w))
    {
        return Err(malformed(
            "patch",
            format!("coordinates that are not whole {from}-byte values"),
        ));
    }
    for s in streams.iter_mut().take(2) {
        let mut wide = Vec::with_capacity(s.len() / usize::from(from) * usize::from(to));
        for c in s.chunks(usize::from(from)) {
            put_uint(&mut wide, read_uint(c), to);
        }
        *s = wide;
    }
    for e in entries {
        e.index_bytes = e.index_bytes / u64::from(from) * u64::from(to);
    }
    Ok(())
}

/// A patch body whose streams are held in parts (each stream is its parts one after another, e.g. one part
/// per entry as coded), so it can be serialized without joining them first.
pub struct PatchView<'a> {
    pub index: IndexCoding,
    pub value: ValueCoding,
    pub index_width: u8,
    pub entries: &'a [PatchEntry],
    pub streams: Vec<Vec<&'a [u8]>>,
}

/// Encoded patch body plus size accounting.
pub struct EncodedPatch {
    pub body: Vec<u8>,
    /// Sum of the streams before compression.
    pub raw_stream_bytes: usize,
    /// Sum of the streams as stored.
    pub stored_stream_bytes: usize,
}

/// Serialize a patch body; with `Codec::Lz4` each stream is compressed when that makes it smaller.
pub fn encode_patch_body(p: &PatchBody, codec: Codec) -> EncodedPatch {
    let p = p.view();
    let mut b = Vec::with_capacity(patch_body_capacity(&p));
    let (raw_stream_bytes, stored_stream_bytes) = write_patch_body(&mut b, &p, codec);
    EncodedPatch {
        body: b,
        raw_stream_bytes,
        stored_stream_bytes,
    }
}

/// A whole patch message (header + body) plus size accounting.
pub struct PatchMessage {
    pub msg: Vec<u8>,
    /// Sum of the streams before compression.
    pub raw_stream_bytes: usize,
    /// Sum of the streams as stored.
    pub stored_stream_bytes: usize,
}

/// [`message`] of [`encode_patch_body`], serialized straight into the message's buffer (the body is not copied
/// a second time).
pub fn patch_message(mut header: Header, p: &PatchView<'_>, codec: Codec) -> PatchMessage {
    let mut out = Vec::with_capacity(HEADER_LEN + patch_body_capacity(p));
    out.resize(HEADER_LEN, 0);
    let (raw_stream_bytes, stored_stream_bytes) = write_patch_body(&mut out, p, codec);
    let body = &out[HEADER_LEN..];
    header.body_len = body.len() as u64;
    header.checksum = xxh3_64_with_seed(body, header.checksum_seed());
    // The buffer holds HEADER_LEN bytes ahead of the body, so the write cannot fail.
    let _ = header.write(&mut out[..HEADER_LEN]);
    PatchMessage {
        msg: out,
        raw_stream_bytes,
        stored_stream_bytes,
    }
}

/// Bytes of a patch body with its streams stored plain (enough for any codec's choice).
fn patch_body_capacity(p: &PatchView<'_>) -> usize {
    16 + p.entries.len() * PATCH_ENTRY_LEN
        + p.streams
            .iter()
            .map(|s| s.iter().map(|part| part.len()).sum::<usize>() + 17)
            .sum::<usize>()
}

/// Append the body of `p` to `b`; returns the streams' bytes before and after compression.
fn write_patch_body(b: &mut Vec<u8>, p: &PatchView<'_>, codec: Codec) -> (usize, usize) {
    let mut w = Writer::from_vec(std::mem::take(b));
    w.u8(match p.index {
        IndexCoding::Coo => 0,
        IndexCoding::Gaps => 1,
    })
    .u8(match p.value {
        ValueCoding::Raw => 0,
        ValueCoding::Delta => 1,
    })
    .u8(p.index_width)
    .u8(0);
    // Entries are element ranges of u32-numbered tensors, a handful per tensor; streams are 4.
    w.u32(p.entries.len() as u32);
    for e in p.entries {
        w.u32(e.ordinal)
            .bytes(&[u8::from(e.dense), 0, 0, 0])
            .u64(e.base)
            .u64(e.nnz)
            .u64(e.index_bytes)
            .u64(e.escape_bytes);
    }
    w.u32(p.streams.len() as u32);
    let (mut raw, mut stored) = (0, 0);
    for parts in &p.streams {
        let len: usize = parts.iter().map(|part| part.len()).sum();
        let packed = match codec {
            Codec::Lz4 if len > 0 => {
                Some(lz4_flex::block::compress(&parts.concat())).filter(|c| c.len() < len)
            }
            _ => None,
        };
        w.u64(len as u64);
        match &packed {
            Some(c) => {
                w.u64(c.len() as u64).u8(1).bytes(c);
                stored += c.len();
            }
            None => {
                w.u64(len as u64).u8(0);
                for part in parts {
                    w.bytes(part);
                }
                stored += len;
            }
        }
        raw += len;
    }
    *b = w.into_vec();
    (raw, stored)
}

/// Parse a patch body; decompressed streams are limited to `max_stream` bytes each.
pub fn decode_patch_body(body: &[u8], max_stream: usize) -> Result<PatchBody, WireError> {
    let mut r = Reader::new(body, "patch");
    let index = match r.u8()? {
        0 => IndexCoding::Coo,
        1 => IndexCoding::Gaps,
        c => return Err(malformed("patch", format!("index coding {c}"))),
    };
    let value = match r.u8()? {
        0 => ValueCoding::Raw,
        1 => ValueCoding::Delta,
        c => return Err(malformed("patch", format!("value coding {c}"))),
    };
    let index_width = r.u8()?;
    if index == IndexCoding::Coo && ![1, 2, 4, 8].contains(&index_width) {
        return Err(malformed("patch", format!("index width {index_width}")));
    }
    r.u8()?;
    let n = r.u32()? as usize;
    if n > body.len() / PATCH_ENTRY_LEN {
        return Err(malformed(
            "patch",
            format!("{n} entries cannot fit in {} bytes", body.len()),
        ));
    }
    let mut entries: Vec<PatchEntry> = Vec::with_capacity(n);
    for _ in 0..n {
        let ordinal = r.u32()?;
        let dense = match r.take(4)? {
            [0, 0, 0, 0] => false,
            [1, 0, 0, 0] => true,
            other => return Err(malformed("patch", format!("entry coding {other:?}"))),
        };
        let e = PatchEntry {
            ordinal,
            dense,
            base: r.u64()?,
            nnz: r.u64()?,
            index_bytes: r.u64()?,
            escape_bytes: r.u64()?,
        };
        if entries
            .last()
            .is_some_and(|l| (e.ordinal, e.base) <= (l.ordinal, l.base))
        {
            return Err(malformed(
                "patch",
                format!(
                    "entry (ordinal {}, base {}) out of order",
                    e.ordinal, e.base
                ),
            ));
        }
        entries.push(e);
    }
    let ns = r.u32()? as usize;
    if ns != PATCH_STREAMS {
        return Err(malformed("patch", format!("{ns} streams")));
    }
    let mut streams = Vec::with_capacity(ns);
    for _ in 0..ns {
        let raw_len = r.count(max_stream)?;
        let stored_len = r.count(body.len())?;
        let codec = r.u8()?;
        let bytes = r.take(stored_len)?;
        let s = match codec {
            0 if stored_len == raw_len => bytes.to_vec(),
            0 => return Err(malformed("patch", "plain stream length mismatch")),
            1 => {
                let mut out = vec![0u8; raw_len];
                let got = lz4_flex::block::decompress_into(bytes, &mut out)
                    .map_err(|source| WireError::Lz4 { source })?;
                if got != raw_len {
                    return Err(malformed(
                        "patch",
                        format!("lz4 stream inflated to {got} bytes, expected {raw_len}"),
                    ));
                }
                out
            }
            c => return Err(malformed("patch", format!("stream codec {c}"))),
        };
        streams.push(s);
    }
    r.finish()?;
    Ok(PatchBody {
        index,
        value,
        index_width,
        entries,
        streams,
    })
}

// ---------------------------------------------------------------------------------------------------------
// integer codings used by patch streams

#[inline(always)]
pub(crate) fn zigzag(v: i64) -> u64 {
    ((v << 1) ^ (v >> 63)) as u64
}

#[inline(always)]
pub(crate) fn unzigzag(v: u64) -> i64 {
    ((v >> 1) as i64) ^ -((v & 1) as i64)
}

/// Narrowest unsigned width (1, 2, 4, 8 bytes) holding `max`.
pub(crate) fn narrowest_width(max: u64) -> u8 {
    match max {
        0..=0xFF => 1,
        0x100..=0xFFFF => 2,
        0x1_0000..=0xFFFF_FFFF => 4,
        _ => 8,
    }
}

pub(crate) fn get_uint(buf: &[u8], i: usize, width: u8) -> Option<u64> {
    let w = usize::from(width);
    buf.get(i.checked_mul(w)?..i.checked_mul(w)?.checked_add(w)?)
        .map(read_uint)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_roundtrip_and_every_bit_flip_is_caught() {
        let mut h = Header::new(Kind::Patch, 7, 0);
        h.aux = 6;
        let msg = message(h, b"hello patch");
        let (p, body) = Header::parse(&msg).unwrap();
        assert_eq!(
            (p.kind, p.version, p.aux, body),
            (Kind::Patch, 7, 6, &b"hello patch"[..])
        );
        for byte in 0..msg.len() {
            for bit in 0..8 {
                let mut m = msg.clone();
                m[byte] ^= 1 << bit;
                assert!(
                    Header::parse(&m).is_err(),
                    "flip at byte {byte} bit {bit} accepted"
                );
            }
        }
        for cut in 0..msg.len() {
            assert!(
                Header::parse(&msg[..cut]).is_err(),
                "truncation to {cut} accepted"
            );
        }
    }

    #[test]
    fn streaming_digest_equals_one_shot() {
        let body: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
        let seed = 12345;
        let mut s = xxhash_rust::xxh3::Xxh3::with_seed(seed);
        for c in body.chunks(777) {
            s.update(c);
        }
        assert_eq!(s.digest(), xxh3_64_with_seed(&body, seed));
    }

    #[test]
    fn metadata_roundtrip() {
        let keys = vec![
            KeyMeta {
                name: "a.w".into(),
                dtype: DType::Bf16,
                shape: vec![3, 4],
            },
            KeyMeta {
                name: "s".into(),
                dtype: DType::I64,
                shape: vec![],
            },
        ];
        let msg = encode_metadata(&keys);
        let (h, body) = Header::parse(&msg).unwrap();
        assert_eq!(h.kind, Kind::Metadata);
        assert_eq!(decode_metadata(body).unwrap(), keys);
    }

    #[test]
    fn zigzag_roundtrips() {
        for v in [0i64, 1, -1, 2, -2, i64::MAX, i64::MIN] {
            assert_eq!(unzigzag(zigzag(v)), v);
        }
        assert_eq!((zigzag(-1), zigzag(1)), (1, 2));
    }

    #[test]
    fn narrowest_width_picks_smallest() {
        let check = |max, w| assert_eq!(narrowest_width(max), w, "{max}");
        check(0, 1);
        check(255, 1);
        check(256, 2);
        check(65536, 4);
        check(1 << 32, 8);
    }

    #[test]
    fn patch_body_roundtrip_with_and_without_lz4() {
        let p = PatchBody {
            index: IndexCoding::Gaps,
            value: ValueCoding::Delta,
            index_width: 0,
            entries: vec![
                PatchEntry {
                    ordinal: 0,
                    dense: false,
                    base: 0,
                    nnz: 3,
                    index_bytes: 3,
                    escape_bytes: 0,
                },
                PatchEntry {
                    ordinal: 0,
                    dense: false,
                    base: 100,
                    nnz: 1,
                    index_bytes: 1,
                    escape_bytes: 0,
                },
                PatchEntry {
                    ordinal: 4,
                    dense: false,
                    base: 0,
                    nnz: 1,
                    index_bytes: 1,
                    escape_bytes: 0,
                },
                PatchEntry {
                    ordinal: 5,
                    dense: true,
                    base: 0,
                    nnz: 2,
                    index_bytes: 0,
                    escape_bytes: 0,
                },
            ],
            streams: vec![vec![1, 2, 3, 4], vec![0; 1000], vec![], vec![7; 8]],
        };
        for codec in [Codec::Plain, Codec::Lz4] {
            let e = encode_patch_body(&p, codec);
            let mut h = Header::new(Kind::Patch, 7, 0);
            h.aux = 6;
            let m = patch_message(h, &p.view(), codec);
            // The same streams in parts (split anywhere) serialize to the same bytes.
            fn split(s: &[u8]) -> Vec<&[u8]> {
                let (a, b) = s.split_at(s.len() / 3);
                vec![a, &[], b]
            }
            let parts = PatchView {
                streams: p.streams.iter().map(|s| split(s)).collect(),
                ..p.view()
            };
            assert_eq!(patch_message(h, &parts, codec).msg, m.msg);
            assert_eq!(
                m.msg,
                message(h, &e.body),
                "serialized in place, the same message"
            );
            assert_eq!(
                (m.raw_stream_bytes, m.stored_stream_bytes),
                (e.raw_stream_bytes, e.stored_stream_bytes)
            );
            let d = decode_patch_body(&e.body, 1 << 20).unwrap();
            assert_eq!(d.entries, p.entries);
            assert_eq!(d.streams, p.streams);
            if codec == Codec::Lz4 {
                assert!(e.stored_stream_bytes < e.raw_stream_bytes);
            }
            // An entry coding other than 0 (sparse) or 1 (dense) is refused.
            let mut bad = e.body.clone();
            bad[8 + 4] = 2;
            assert!(decode_patch_body(&bad, 1 << 20).is_err());
            for cut in 0..e.body.len() {
                assert!(
                    decode_patch_body(&e.body[..cut], 1 << 20).is_err(),
                    "cut {cut}"
                );
            }
        }
        let e = encode_patch_body(&p, Codec::Plain);
        assert!(
            decode_patch_body(&e.body, 10).is_err(),
            "stream limit enforced"
        );
    }

    #[test]
    fn bucket_table_roundtrip_and_bounds() {
        let entries = vec![
            BucketEntry {
                ordinal: 2,
                dtype: DType::F32,
                byte_len: 12,
            },
            BucketEntry {
                ordinal: 5,
                dtype: DType::Bool,
                byte_len: 3,
            },
        ];
        let (len, offsets) = bucket_layout(&entries);
        assert!(offsets.iter().all(|o| o % 8 == 0));
        let mut body = vec![0u8; len];
        write_bucket_table(&entries, &mut body).unwrap();
        let parsed = read_bucket(&body).unwrap();
        assert_eq!(parsed.iter().map(|(e, _)| *e).collect::<Vec<_>>(), entries);
        assert!(read_bucket(&body[..len - 8]).is_err());
        assert!(read_bucket(&[0xFF; 4]).is_err());
    }

    #[test]
    #[allow(clippy::single_range_in_vec_init)] // expected part lists, some of one range
    fn bucket_parts_cover_the_body_in_order() {
        let check = |body_len: usize,
                     table_end: usize,
                     part: usize,
                     expect: Vec<std::ops::Range<usize>>| {
            assert_eq!(
                bucket_parts(body_len, table_end, part),
                expect,
                "body {body_len}, table {table_end}, part {part}"
            );
        };
        check(100, 24, 40, vec![0..40, 40..80, 80..100]);
        check(100, 56, 40, vec![0..56, 56..96, 96..100]);
        check(24, 24, 40, vec![0..24]);
        check(8, 8, 1 << 20, vec![0..8]);
        // Part sizes round up to a multiple of 8, so no element straddles two parts.
        check(40, 8, 13, vec![0..16, 16..32, 32..40]);
    }

    #[test]
    fn bucket_table_bounds_entry_sizes() {
        let entries = vec![BucketEntry {
            ordinal: 0,
            dtype: DType::U8,
            byte_len: 100,
        }];
        let (len, offsets) = bucket_layout(&entries);
        let mut body = vec![0u8; len];
        write_bucket_table(&entries, &mut body).unwrap();
        let (parsed, total) = read_bucket_table(&body[..offsets[0]], 100).unwrap();
        assert_eq!(
            (parsed[0].1.clone(), total),
            (offsets[0]..offsets[0] + 100, len)
        );
        assert!(
            read_bucket_table(&body[..offsets[0]], 99).is_err(),
            "entry larger than the receiver allows"
        );
        assert!(
            read_bucket_table(&body[..offsets[0] - 1], 100).is_err(),
            "table cut short"
        );
    }

    #[test]
    fn garbage_never_panics() {
        let mut x = 0x1234_5678_u64;
        for len in 0..300 {
            let buf: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            let _ = Header::parse(&buf);
            let _ = decode_metadata(&buf);
            let _ = read_bucket(&buf);
            let _ = read_bucket_table(&buf, usize::MAX / 2);
            let _ = decode_patch_body(&buf, 1 << 16);
        }
    }

    /// A catch-up carries the version and sequence the receiver will hold and, for a replay, the sequence the
    /// replay starts from; a base sequence outside a replay or beyond the target is malformed.
    #[test]
    fn catch_up_carries_the_target_stamp_and_the_replay_base_sequence() {
        let plan = CatchUpPlan {
            mode: CatchUpMode::Replay,
            to: Stamp {
                version: 7,
                sequence: 12,
            },
            boot_buckets: 1,
            patches: 3,
            full_buckets: 0,
            base_sequence: 9,
        };
        let msg = encode_catch_up(&plan);
        let (h, body) = Header::parse(&msg).unwrap();
        assert_eq!((h.version, h.sequence), (7, 12));
        assert_eq!(decode_catch_up(&h, body).unwrap(), plan);
        let bad = |p: CatchUpPlan| {
            let msg = encode_catch_up(&p);
            let (h, body) = Header::parse(&msg).unwrap();
            decode_catch_up(&h, body).unwrap_err().to_string()
        };
        let e = bad(CatchUpPlan {
            base_sequence: 13,
            ..plan
        });
        assert!(e.contains("base sequence 13 beyond the target's 12"), "{e}");
        let e = bad(CatchUpPlan {
            mode: CatchUpMode::Full,
            patches: 0,
            ..plan
        });
        assert!(e.contains("base sequence outside a replay"), "{e}");
    }
}
