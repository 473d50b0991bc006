//! The arena's serialized format: header fields and offsets, the layout table, [`FORMAT_VERSION`].
//!
//! A segment is: the header (fixed fields written once by the creator, then atomics), the reader slots, the
//! layout table, padding to a page, then buffer A and buffer B, each `stride` bytes (page-rounded) apart. Every
//! tensor starts 64-byte aligned inside its buffer. All fixed fields are little-endian; the atomics are the
//! host's native `u64`s (a segment is only ever shared between processes of one host).

use crate::bytes::{BytesError, Reader, Writer};
use crate::tensor::{Class, DType, Layout, StateDict};

/// The first eight bytes of every arena.
pub(crate) const MAGIC: [u8; 8] = *b"RLSYNCHS";
/// The arena format this build reads and writes; another is a [`FormatError::Version`].
pub const FORMAT_VERSION: u32 = 1;
/// Buffers start on a page (readers map them read-only on their own).
pub(crate) const PAGE: usize = 4096;
/// Every tensor starts on a cache line.
pub(crate) const TENSOR_ALIGN: usize = 64;
/// The value of the `ready` word once the creator wrote the whole header.
pub(crate) const READY_MARK: u64 = 0x5245_4144_595f_4853;

// Fixed fields, written once before `ready` is set (little-endian, in this order: magic [8], format u32,
// max readers u32, table length u64, the table's xxh3 u64, buffer bytes u64, buffer A's offset u64, the stride
// from A to B u64, the segment's size u64); [`Plan::fixed_fields`] writes them and [`Plan::read`] reads them.
pub(crate) const OFF_MAGIC: usize = 0;
#[cfg(test)]
const OFF_FORMAT: usize = 8;
pub(crate) const OFF_BUFFERS: usize = 40;
const FIXED_END: usize = 64;

// Atomics (native u64).
pub(crate) const OFF_READY: usize = 64;
/// 0 until the first version is published, then 1.
pub(crate) const OFF_PUBLISHED: usize = 128;
/// The buffer readers take (0 = A, 1 = B).
pub(crate) const OFF_ACTIVE: usize = 136;
/// One more on every publish (never reset, also across applier restarts).
pub(crate) const OFF_GENERATION: usize = 144;
/// The pid of the applier that published last (diagnostics).
pub(crate) const OFF_APPLIER: usize = 152;
/// Per buffer (64 bytes each): version, sequence, checksum, has-checksum, generation.
pub(crate) const OFF_BUFFER_META: usize = 192;
pub(crate) const BUFFER_META_BYTES: usize = 64;
pub(crate) const META_VERSION: usize = 0;
pub(crate) const META_SEQUENCE: usize = 8;
pub(crate) const META_CHECKSUM: usize = 16;
pub(crate) const META_HAS_CHECKSUM: usize = 24;
pub(crate) const META_GENERATION: usize = 32;
/// Reader slots: `max_readers` × (word = pid | buffer code << 32, process start time).
pub(crate) const OFF_SLOTS: usize = OFF_BUFFER_META + 2 * BUFFER_META_BYTES;
pub(crate) const SLOT_BYTES: usize = 16;

/// Most reader slots an arena may have (keeps the header a few pages).
pub const MAX_READERS: usize = 4096;

/// A segment that is not an arena this build can use.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    #[error("it does not start with rlsync's arena magic")]
    Magic,
    #[error("format version {found}, this build reads {expected}")]
    Version { found: u32, expected: u32 },
    #[error("the header was never completed by its creator")]
    Incomplete,
    #[error("the layout table's checksum does not match")]
    Checksum,
    #[error("the layout table does not read")]
    Table(#[source] BytesError),
    #[error("the layout table names dtype code {code} for `{key}`")]
    DType { key: String, code: u8 },
    #[error("the layout table names class code {code} for `{key}`")]
    Class { key: String, code: u8 },
    #[error("the layout table is inconsistent: {reason}")]
    Inconsistent { reason: String },
    #[error("the segment holds {found} bytes, its header says {expected}")]
    Size { found: u64, expected: u64 },
}

/// One tensor of the arena: where it lives inside each buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Entry {
    pub name: String,
    pub layout: Layout,
    pub class: Class,
    /// Byte offset inside a buffer (a multiple of [`TENSOR_ALIGN`]).
    pub offset: usize,
    pub len: usize,
}

/// Every tensor's place, and the sizes that follow from it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Plan {
    pub entries: Vec<Entry>,
    pub max_readers: usize,
    /// Bytes of one buffer's tensors (with alignment padding).
    pub buffer_bytes: usize,
    /// Where buffer A starts (page-aligned: the header, slots and table come first).
    pub buffers: usize,
    /// Buffer B starts `stride` bytes after A.
    pub stride: usize,
    pub total: usize,
    /// The encoded layout table.
    pub table: Vec<u8>,
}

fn class_code(class: Class) -> u8 {
    match class {
        Class::Trainable => 0,
        Class::Buffer => 1,
        Class::Frozen => 2,
    }
}

fn class_from_code(code: u8) -> Option<Class> {
    match code {
        0 => Some(Class::Trainable),
        1 => Some(Class::Buffer),
        2 => Some(Class::Frozen),
        _ => None,
    }
}

fn round_up(n: usize, to: usize) -> Option<usize> {
    n.checked_add(to - 1).map(|v| v / to * to)
}

fn inconsistent(reason: impl Into<String>) -> FormatError {
    FormatError::Inconsistent {
        reason: reason.into(),
    }
}

impl Plan {
    /// Lay out `template`'s tensors (in its order, each 64-byte aligned). `None` when the sizes overflow.
    pub(crate) fn of(template: &StateDict, max_readers: usize) -> Option<Plan> {
        let mut entries = Vec::with_capacity(template.len());
        let mut at = 0usize;
        for (name, t) in template.iter() {
            let offset = round_up(at, TENSOR_ALIGN)?;
            let len = t.bytes().len();
            entries.push(Entry {
                name: name.to_owned(),
                layout: t.layout().clone(),
                class: t.class(),
                offset,
                len,
            });
            at = offset.checked_add(len)?;
        }
        Plan::from_entries(entries, max_readers, at)
    }

    fn from_entries(entries: Vec<Entry>, max_readers: usize, buffer_bytes: usize) -> Option<Plan> {
        let table = encode_table(&entries)?;
        let table_end = OFF_SLOTS
            .checked_add(max_readers.checked_mul(SLOT_BYTES)?)?
            .checked_add(table.len())?;
        let buffers = round_up(table_end, PAGE)?;
        let stride = round_up(buffer_bytes.max(1), PAGE)?;
        let total = buffers.checked_add(stride.checked_mul(2)?)?;
        Some(Plan {
            entries,
            max_readers,
            buffer_bytes,
            buffers,
            stride,
            total,
            table,
        })
    }

    /// Where the table starts in the header.
    pub(crate) fn table_offset(max_readers: usize) -> usize {
        OFF_SLOTS + max_readers * SLOT_BYTES
    }

    /// The fixed fields as the creator writes them (`OFF_MAGIC..FIXED_END`).
    pub(crate) fn fixed_fields(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(FIXED_END);
        w.bytes(&MAGIC)
            .u32(FORMAT_VERSION)
            .u32(self.max_readers as u32)
            .u64(self.table.len() as u64)
            .u64(xxhash_rust::xxh3::xxh3_64(&self.table))
            .u64(self.buffer_bytes as u64)
            .u64(self.buffers as u64)
            .u64(self.stride as u64)
            .u64(self.total as u64);
        w.into_vec()
    }

    /// Read a header: its fixed fields (`fixed`, [`FIXED_END`] bytes) say how long the table is; `table_at`
    /// returns the table's bytes for an offset and a length (`None`: outside the mapping). `size` is the
    /// segment's file size.
    pub(crate) fn read(
        fixed: &[u8],
        size: u64,
        table_at: impl FnOnce(usize, usize) -> Option<Vec<u8>>,
    ) -> Result<Plan, FormatError> {
        let mut r = Reader::new(fixed, "arena header");
        let magic: [u8; 8] = r.array().map_err(FormatError::Table)?;
        if magic != MAGIC {
            return Err(FormatError::Magic);
        }
        let format = r.u32().map_err(FormatError::Table)?;
        if format != FORMAT_VERSION {
            return Err(FormatError::Version {
                found: format,
                expected: FORMAT_VERSION,
            });
        }
        let max_readers = r.u32().map_err(FormatError::Table)? as usize;
        let table_len = r.u64().map_err(FormatError::Table)?;
        let table_sum = r.u64().map_err(FormatError::Table)?;
        let buffer_bytes = r.u64().map_err(FormatError::Table)?;
        let buffers = r.u64().map_err(FormatError::Table)?;
        let stride = r.u64().map_err(FormatError::Table)?;
        let total = r.u64().map_err(FormatError::Table)?;
        if max_readers == 0 || max_readers > MAX_READERS {
            return Err(inconsistent(format!(
                "{max_readers} reader slots (1..={MAX_READERS})"
            )));
        }
        if total != size {
            return Err(FormatError::Size {
                found: size,
                expected: total,
            });
        }
        let table_len = usize::try_from(table_len)
            .ok()
            .filter(|&l| (l as u64) < total)
            .ok_or_else(|| inconsistent(format!("a table of {table_len} bytes")))?;
        let table = table_at(Plan::table_offset(max_readers), table_len)
            .ok_or_else(|| inconsistent("the table lies outside the header"))?;
        if xxhash_rust::xxh3::xxh3_64(&table) != table_sum {
            return Err(FormatError::Checksum);
        }
        let buffer_bytes =
            usize::try_from(buffer_bytes).map_err(|_| inconsistent("buffer size"))?;
        let entries = decode_table(&table, buffer_bytes)?;
        let plan = Plan::from_entries(entries, max_readers, buffer_bytes)
            .ok_or_else(|| inconsistent("sizes overflow"))?;
        if plan.buffers as u64 != buffers
            || plan.stride as u64 != stride
            || plan.total as u64 != total
        {
            return Err(inconsistent(format!(
                "buffers at {buffers} (stride {stride}, total {total}), the table needs {} ({}, {})",
                plan.buffers, plan.stride, plan.total
            )));
        }
        Ok(plan)
    }
}

fn encode_table(entries: &[Entry]) -> Option<Vec<u8>> {
    let mut w = Writer::new();
    w.u32(u32::try_from(entries.len()).ok()?);
    for e in entries {
        w.bytes_u16(e.name.as_bytes()).ok()?;
        w.u8(e.layout.dtype().code())
            .u8(class_code(e.class))
            .u8(u8::try_from(e.layout.rank()).ok()?);
        for &d in e.layout.shape() {
            w.u64(d as u64);
        }
        w.u64(e.offset as u64).u64(e.len as u64);
    }
    Some(w.into_vec())
}

fn decode_table(table: &[u8], buffer_bytes: usize) -> Result<Vec<Entry>, FormatError> {
    let mut r = Reader::new(table, "arena layout table");
    let count = r.u32().map_err(FormatError::Table)? as usize;
    let mut entries: Vec<Entry> = Vec::with_capacity(count.min(table.len() / 16));
    let mut seen = std::collections::HashSet::new();
    let mut end = 0usize;
    for _ in 0..count {
        let name_len = usize::from(r.u16().map_err(FormatError::Table)?);
        let name = r.take(name_len).map_err(FormatError::Table)?;
        let name = std::str::from_utf8(name)
            .map_err(|_| inconsistent("a tensor name is not UTF-8"))?
            .to_owned();
        let code = r.u8().map_err(FormatError::Table)?;
        let dtype = DType::from_code(code).ok_or_else(|| FormatError::DType {
            key: name.clone(),
            code,
        })?;
        let code = r.u8().map_err(FormatError::Table)?;
        let class = class_from_code(code).ok_or_else(|| FormatError::Class {
            key: name.clone(),
            code,
        })?;
        let rank = r.u8().map_err(FormatError::Table)?;
        let mut shape = Vec::with_capacity(usize::from(rank));
        for _ in 0..rank {
            let d = r.u64().map_err(FormatError::Table)?;
            shape.push(
                usize::try_from(d)
                    .map_err(|_| inconsistent(format!("`{name}`: a dimension of {d}")))?,
            );
        }
        let offset = r.u64().map_err(FormatError::Table)?;
        let len = r.u64().map_err(FormatError::Table)?;
        let layout = Layout::new(dtype, &shape);
        let (Ok(offset), Ok(len)) = (usize::try_from(offset), usize::try_from(len)) else {
            return Err(inconsistent(format!(
                "`{name}`: offset {offset}, length {len}"
            )));
        };
        if layout.checked_byte_len() != Some(len)
            || !offset.is_multiple_of(TENSOR_ALIGN)
            || offset < end
            || offset.checked_add(len).is_none_or(|e| e > buffer_bytes)
        {
            return Err(inconsistent(format!(
                "`{name}` ({dtype} {shape:?}) at {offset}, {len} bytes, after byte {end} of {buffer_bytes}"
            )));
        }
        if !seen.insert(name.clone()) {
            return Err(inconsistent(format!("`{name}` appears twice")));
        }
        end = offset + len;
        entries.push(Entry {
            name,
            layout,
            class,
            offset,
            len,
        });
    }
    r.finish().map_err(FormatError::Table)?;
    Ok(entries)
}

/// Where the fixed fields `fixed` say buffer A starts (0 when they are too short), to map the header before
/// [`Plan::read`] checks it whole.
pub(crate) fn buffers_offset(fixed: &[u8]) -> u64 {
    let mut r = Reader::new(fixed.get(OFF_BUFFERS..).unwrap_or_default(), "arena header");
    r.u64().unwrap_or(0)
}

/// The fixed fields' length (what [`Plan::read`] takes first).
pub(crate) const FIXED_LEN: usize = FIXED_END;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::Tensor;

    fn template() -> StateDict {
        let mut sd = StateDict::new();
        sd.insert(
            "a",
            Tensor::zeros(DType::Bf16, &[3], Class::Trainable).unwrap(),
        );
        sd.insert("b", Tensor::zeros(DType::I64, &[], Class::Buffer).unwrap());
        sd.insert(
            "c",
            Tensor::zeros(DType::F32, &[2, 5], Class::Frozen).unwrap(),
        );
        sd
    }

    fn read_back(plan: &Plan, fixed: &[u8]) -> Result<Plan, FormatError> {
        let table = plan.table.clone();
        Plan::read(fixed, plan.total as u64, move |at, len| {
            (at == Plan::table_offset(plan.max_readers) && len == table.len()).then_some(table)
        })
    }

    #[test]
    fn tensors_are_aligned_and_the_table_reads_back() {
        let plan = Plan::of(&template(), 8).unwrap();
        let offsets: Vec<usize> = plan.entries.iter().map(|e| e.offset).collect();
        assert_eq!(offsets, vec![0, 64, 128]);
        assert_eq!(plan.buffer_bytes, 128 + 40);
        assert_eq!(plan.buffers % PAGE, 0);
        assert_eq!(plan.stride, PAGE);
        let back = read_back(&plan, &plan.fixed_fields()).unwrap();
        assert_eq!(back, plan);
    }

    #[test]
    fn foreign_or_damaged_headers_are_typed_errors() {
        let plan = Plan::of(&template(), 8).unwrap();
        let mut fixed = plan.fixed_fields();
        fixed[0] = b'X';
        assert!(matches!(read_back(&plan, &fixed), Err(FormatError::Magic)));
        let mut fixed = plan.fixed_fields();
        fixed[OFF_FORMAT] = 9;
        assert!(matches!(
            read_back(&plan, &fixed),
            Err(FormatError::Version { found: 9, .. })
        ));
        let fixed = plan.fixed_fields();
        let err = Plan::read(&fixed, plan.total as u64 + 1, |_, _| None).unwrap_err();
        assert!(matches!(err, FormatError::Size { .. }), "{err}");
        let mut bad = plan.table.clone();
        bad[6] ^= 1;
        let err = Plan::read(&fixed, plan.total as u64, |_, _| Some(bad)).unwrap_err();
        assert!(matches!(err, FormatError::Checksum), "{err}");
        assert!(matches!(
            Plan::read(&fixed[..20], plan.total as u64, |_, _| None),
            Err(FormatError::Table(_))
        ));
    }

    #[test]
    fn an_inconsistent_table_is_refused() {
        let mut plan = Plan::of(&template(), 2).unwrap();
        plan.entries[1].offset = 32; // not aligned
        let table = encode_table(&plan.entries).unwrap();
        let err = decode_table(&table, plan.buffer_bytes).unwrap_err();
        assert!(matches!(err, FormatError::Inconsistent { .. }), "{err}");
    }
}
