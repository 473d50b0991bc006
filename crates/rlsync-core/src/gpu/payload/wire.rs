//! The device payload's header ([`super`]): one place for its byte layout, encode and a decode that answers bad
//! bytes with a typed [`HeaderError`], never a panic.
//!
//! A device payload is one buffer (a 1-D uint8 CUDA tensor of the caller's): this header at offset 0, then
//! the sections it names, each at a [`ALIGN`]-aligned offset. The header (at most [`MAX_HEADER`] bytes, read to
//! the host in one copy) is:
//! ```text
//! 0 magic "RLDP" | 4 wire version u16 (= WIRE_VERSION) | 6 mode u8 (0 patch, 1 full) | 7 nwidths u8 |
//! 8 header length u32 | 12 ntensors u32 | 16 session u64 | 24 sequence u64 | 32 base u64 | 40 version u64 |
//! 48 total u64 | 56 layout u64 | 64 snapshot offset u64 | 72 snapshot bytes u64 |
//! 80 per width, 64 bytes: width u8, 7 zero bytes, ntiles u64, entries u64, dir/idx/vals offsets u64 ×3,
//!    pool checksum u64, count u64 |
//! end-8 checksum u64 = xxh3_64(header[..end-8])
//! ```
//! Every integer is little-endian. `session` is the sender's random id (fixed for its life), `sequence` the
//! payload's number (one more per payload, continuing the syncer's), `base` the sequence a patch applies to
//! (what the receiver must hold), `version` the caller's label of the weights (RLinf's `version`),
//! `total` the payload's length in bytes, `layout` the digest of the synced tensors' (elements, width) list
//! ([`layout_digest`]). A patch lists per width `diff_compact`'s directory (`ntiles` entries at `dir`), index
//! and value pool (`entries` entries at `idx`, `vals`), in the kernels' format ([`crate::gpu::compact`]); a
//! full payload holds the snapshot image (`snapshot bytes` at `snapshot offset`, each tensor where
//! [`crate::gpu::ipc`]'s snapshot copy has it) and lists the widths with no pool. Each width's `checksum` and
//! `count` are the sender's `checksum_compact` of what the payload holds (seeded with [`seed`]`(session,
//! version)`), which the receiver recomputes over the payload before it writes anything.

use xxhash_rust::xxh3::xxh3_64;

use crate::bytes::{BytesError, Reader, Writer};

/// The first bytes of every device payload.
pub const MAGIC: [u8; 4] = *b"RLDP";
/// This layout's version; a payload of another one is rejected.
pub const WIRE_VERSION: u16 = 1;
/// Bytes a receiver reads to find the header (it is shorter: four widths at most).
pub const MAX_HEADER: usize = 512;
/// Alignment of every section.
pub const ALIGN: u64 = 256;
/// Fixed part before the widths.
const FIXED: usize = 80;
/// Bytes per width entry.
const PER_WIDTH: usize = 64;
/// The trailing checksum.
const CHECKSUM: usize = 8;

/// Why bytes are no device payload header.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    #[error("not an rlsync device payload (magic {found:02x?})")]
    Magic { found: [u8; 4] },
    #[error("device payload wire version {found}, this rlsync reads {WIRE_VERSION}")]
    Version { found: u16 },
    #[error("the header ends after {have} bytes, {need} needed")]
    Truncated { need: usize, have: usize },
    #[error("header checksum mismatch: it says {stated:#018x}, its bytes hash to {actual:#018x}")]
    Checksum { stated: u64, actual: u64 },
    #[error("header field {field} has the invalid value {value}")]
    Field { field: &'static str, value: u64 },
}

impl From<BytesError> for HeaderError {
    fn from(e: BytesError) -> HeaderError {
        match e {
            BytesError::Short {
                need, offset, left, ..
            } => HeaderError::Truncated {
                need: offset + need,
                have: offset + left,
            },
            _ => HeaderError::Field {
                field: e.what(),
                value: 0,
            },
        }
    }
}

/// How the receiver installs a payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// `apply_compact` per width from the payload's pools.
    Patch,
    /// Every tensor copied from the payload's snapshot image.
    Full,
}

/// One width's section of a payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WidthPart {
    pub width: u8,
    pub ntiles: u64,
    /// Pool entries the payload holds (0 in a full payload).
    pub entries: u64,
    pub dir_off: u64,
    pub idx_off: u64,
    pub vals_off: u64,
    /// The sender's `checksum_compact` sum and count.
    pub sum: u64,
    pub count: u64,
}

/// A payload's header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub mode: Mode,
    pub ntensors: u32,
    pub session: u64,
    pub sequence: u64,
    pub base: u64,
    /// The caller's version label.
    pub version: u64,
    pub total: u64,
    pub layout: u64,
    pub snapshot_off: u64,
    pub snapshot_bytes: u64,
    pub widths: Vec<WidthPart>,
}

impl Header {
    /// Encoded length: where the first section may start (before alignment).
    pub fn len(&self) -> usize {
        header_len(self.widths.len())
    }

    /// Always false: a header has its fixed part.
    pub fn is_empty(&self) -> bool {
        false
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(self.len());
        w.bytes(&MAGIC).u16(WIRE_VERSION);
        w.u8(match self.mode {
            Mode::Patch => 0,
            Mode::Full => 1,
        });
        w.u8(self.widths.len() as u8);
        w.u32(self.len() as u32).u32(self.ntensors);
        for v in [
            self.session,
            self.sequence,
            self.base,
            self.version,
            self.total,
            self.layout,
            self.snapshot_off,
            self.snapshot_bytes,
        ] {
            w.u64(v);
        }
        for p in &self.widths {
            w.u8(p.width).bytes(&[0; 7]);
            for v in [
                p.ntiles, p.entries, p.dir_off, p.idx_off, p.vals_off, p.sum, p.count,
            ] {
                w.u64(v);
            }
        }
        let mut out = w.into_vec();
        let sum = xxh3_64(&out);
        out.extend_from_slice(&sum.to_le_bytes());
        out
    }

    /// The header at the start of `bytes` (the payload's first bytes, at least the header's length).
    pub fn decode(bytes: &[u8]) -> Result<Header, HeaderError> {
        let mut r = Reader::new(bytes, "device payload header");
        let magic = r.array::<4>()?;
        if magic != MAGIC {
            return Err(HeaderError::Magic { found: magic });
        }
        let version = r.u16()?;
        if version != WIRE_VERSION {
            return Err(HeaderError::Version { found: version });
        }
        let mode = match r.u8()? {
            0 => Mode::Patch,
            1 => Mode::Full,
            m => {
                return Err(HeaderError::Field {
                    field: "mode",
                    value: u64::from(m),
                });
            }
        };
        let nwidths = r.u8()?;
        if nwidths > 4 {
            return Err(HeaderError::Field {
                field: "nwidths",
                value: u64::from(nwidths),
            });
        }
        let len = r.u32()? as usize;
        let expected = header_len(usize::from(nwidths));
        if len != expected {
            return Err(HeaderError::Field {
                field: "header length",
                value: len as u64,
            });
        }
        if bytes.len() < len {
            return Err(HeaderError::Truncated {
                need: len,
                have: bytes.len(),
            });
        }
        let stated = u64::from_le_bytes(bytes[len - CHECKSUM..len].try_into().unwrap_or([0; 8]));
        let actual = xxh3_64(&bytes[..len - CHECKSUM]);
        if stated != actual {
            return Err(HeaderError::Checksum { stated, actual });
        }
        let ntensors = r.u32()?;
        let mut f = [0u64; 8];
        for v in &mut f {
            *v = r.u64()?;
        }
        let [
            session,
            sequence,
            base,
            version,
            total,
            layout,
            snapshot_off,
            snapshot_bytes,
        ] = f;
        let mut widths = Vec::with_capacity(usize::from(nwidths));
        for _ in 0..nwidths {
            let width = r.u8()?;
            if !matches!(width, 1 | 2 | 4 | 8) {
                return Err(HeaderError::Field {
                    field: "width",
                    value: u64::from(width),
                });
            }
            r.take(7)?;
            let mut g = [0u64; 7];
            for v in &mut g {
                *v = r.u64()?;
            }
            let [ntiles, entries, dir_off, idx_off, vals_off, sum, count] = g;
            widths.push(WidthPart {
                width,
                ntiles,
                entries,
                dir_off,
                idx_off,
                vals_off,
                sum,
                count,
            });
        }
        Ok(Header {
            mode,
            ntensors,
            session,
            sequence,
            base,
            version,
            total,
            layout,
            snapshot_off,
            snapshot_bytes,
            widths,
        })
    }
}

/// The encoded length of a header listing `nwidths` widths.
pub const fn header_len(nwidths: usize) -> usize {
    FIXED + PER_WIDTH * nwidths + CHECKSUM
}

/// Whether `bytes` (a payload's first bytes) start like a device payload.
pub fn is_device_payload(bytes: &[u8]) -> bool {
    bytes.starts_with(&MAGIC)
}

/// The digest of a layout's (elements, width) list: both ends must sync the same tensors in the same order.
pub fn layout_digest(tensors: impl IntoIterator<Item = (u64, usize)>) -> u64 {
    let mut w = Writer::new();
    for (numel, width) in tensors {
        w.u64(numel).u8(width as u8);
    }
    xxh3_64(&w.into_vec())
}

/// The pool checksums' seed of one payload: its sender's session and its sequence number, so a pool of
/// another sender or another payload never matches.
pub fn seed(session: u64, sequence: u64) -> u64 {
    use crate::gpu::reference::mix64;
    mix64(session ^ mix64(sequence ^ 0x524c_4450))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> Header {
        Header {
            mode: Mode::Patch,
            ntensors: 3,
            session: 7,
            sequence: 5,
            base: 4,
            version: 12,
            total: 4096,
            layout: 99,
            snapshot_off: 0,
            snapshot_bytes: 0,
            widths: vec![
                WidthPart {
                    width: 2,
                    ntiles: 3,
                    entries: 10,
                    dir_off: 512,
                    idx_off: 768,
                    vals_off: 1024,
                    sum: 11,
                    count: 10,
                },
                WidthPart {
                    width: 4,
                    ..WidthPart::default()
                },
            ],
        }
    }

    #[test]
    fn a_header_round_trips() {
        let h = header();
        let b = h.encode();
        assert_eq!(b.len(), h.len());
        assert!(is_device_payload(&b));
        assert_eq!(Header::decode(&b), Ok(h));
    }

    #[test]
    fn every_flipped_bit_and_every_truncation_is_an_error() {
        let b = header().encode();
        for i in 0..b.len() * 8 {
            let mut c = b.clone();
            c[i / 8] ^= 1 << (i % 8);
            assert!(Header::decode(&c).is_err(), "bit {i} flipped was accepted");
        }
        for n in 0..b.len() {
            assert!(Header::decode(&b[..n]).is_err(), "{n} bytes were accepted");
        }
    }

    #[test]
    fn the_seed_depends_on_session_and_version() {
        assert_ne!(seed(1, 2), seed(1, 3));
        assert_ne!(seed(1, 2), seed(2, 2));
        assert_ne!(
            layout_digest([(4, 2), (8, 4)]),
            layout_digest([(8, 4), (4, 2)])
        );
    }
}
