//! Little-endian bytes and LEB128 varints: the one bounds-checked reader, the one writer and the one varint.
//!
//! Every binary format (the weight-sync wire, the control frames, the named-array codec, the shm transport's
//! control messages, the TCP chain's link messages, TensorBoard records) reads its fields through [`Reader`],
//! so a truncated or overlong input is an error naming what was being read, never a panic, and writes them
//! through [`Writer`], so a length prefix that cannot hold its length is an error, never a wrong prefix.

/// Why a [`Reader`] could not read a field; `what` names the structure being read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BytesError {
    #[error("truncated: needs {need} bytes at offset {offset}, {left} left")]
    Short {
        what: &'static str,
        need: usize,
        offset: usize,
        left: usize,
    },
    #[error("{extra} trailing bytes")]
    Trailing { what: &'static str, extra: usize },
    #[error("count {count} exceeds {max}")]
    Count {
        what: &'static str,
        count: u64,
        max: usize,
    },
    #[error("{len} bytes do not fit a length prefix of at most {max}")]
    TooLong {
        what: &'static str,
        len: usize,
        max: u64,
    },
}

impl BytesError {
    /// The structure (or field) that was being read.
    pub fn what(&self) -> &'static str {
        match self {
            BytesError::Short { what, .. }
            | BytesError::Trailing { what, .. }
            | BytesError::Count { what, .. }
            | BytesError::TooLong { what, .. } => what,
        }
    }
}

/// A bounds-checked little-endian cursor over a byte slice.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    what: &'static str,
}

impl<'a> Reader<'a> {
    /// A reader over `buf`; `what` names the structure in errors.
    pub fn new(buf: &'a [u8], what: &'static str) -> Reader<'a> {
        Reader { buf, pos: 0, what }
    }

    /// Name what the following reads are reading (for formats that name each field in their errors).
    pub fn named(&mut self, what: &'static str) -> &mut Self {
        self.what = what;
        self
    }

    pub fn take(&mut self, n: usize) -> Result<&'a [u8], BytesError> {
        let left = self.buf.len() - self.pos;
        if n > left {
            return Err(BytesError::Short {
                what: self.what,
                need: n,
                offset: self.pos,
                left,
            });
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    pub fn array<const N: usize>(&mut self) -> Result<[u8; N], BytesError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    pub fn u8(&mut self) -> Result<u8, BytesError> {
        Ok(self.array::<1>()?[0])
    }

    pub fn u16(&mut self) -> Result<u16, BytesError> {
        self.array().map(u16::from_le_bytes)
    }

    pub fn u32(&mut self) -> Result<u32, BytesError> {
        self.array().map(u32::from_le_bytes)
    }

    pub fn u64(&mut self) -> Result<u64, BytesError> {
        self.array().map(u64::from_le_bytes)
    }

    pub fn f32(&mut self) -> Result<f32, BytesError> {
        self.array().map(f32::from_le_bytes)
    }

    pub fn f64(&mut self) -> Result<f64, BytesError> {
        self.array().map(f64::from_le_bytes)
    }

    /// A `u64` count that must be at most `max` (so it can size an allocation).
    pub fn count(&mut self, max: usize) -> Result<usize, BytesError> {
        let n = self.u64()?;
        usize::try_from(n)
            .ok()
            .filter(|&c| c <= max)
            .ok_or(BytesError::Count {
                what: self.what,
                count: n,
                max,
            })
    }

    /// `u32 length` then that many bytes.
    pub fn bytes_u32(&mut self) -> Result<&'a [u8], BytesError> {
        let len = self.u32()? as usize;
        self.take(len)
    }

    /// Everything not read yet.
    pub fn rest(&mut self) -> &'a [u8] {
        let s = &self.buf[self.pos..];
        self.pos = self.buf.len();
        s
    }

    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// Every byte must have been read.
    pub fn finish(&self) -> Result<(), BytesError> {
        match self.remaining() {
            0 => Ok(()),
            extra => Err(BytesError::Trailing {
                what: self.what,
                extra,
            }),
        }
    }
}

/// A little-endian writer that appends to a byte vector: the counterpart of [`Reader`].
///
/// Fixed-width fields cannot fail; a length prefix ([`Writer::bytes_u8`], [`Writer::bytes_u16`],
/// [`Writer::bytes_u32`], [`Writer::len_u32`]) is an error when the length does not fit its width (nothing is
/// written then).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Writer {
    buf: Vec<u8>,
}

macro_rules! put_le {
    ($($(#[$doc:meta])* $name:ident: $t:ty;)*) => {
        $(
            $(#[$doc])*
            #[inline(always)]
            pub fn $name(&mut self, v: $t) -> &mut Self {
                self.buf.extend_from_slice(&v.to_le_bytes());
                self
            }
        )*
    };
}

impl Writer {
    pub fn new() -> Writer {
        Writer::default()
    }

    /// An empty writer with room for `n` bytes.
    pub fn with_capacity(n: usize) -> Writer {
        Writer {
            buf: Vec::with_capacity(n),
        }
    }

    /// A writer appending to `buf` (what it holds stays in front).
    pub fn from_vec(buf: Vec<u8>) -> Writer {
        Writer { buf }
    }

    #[inline(always)]
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.buf.push(v);
        self
    }

    put_le! {
        u16: u16;
        u32: u32;
        u64: u64;
        i64: i64;
        f32: f32;
        f64: f64;
    }

    /// The raw bytes, without a length.
    #[inline(always)]
    pub fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.buf.extend_from_slice(b);
        self
    }

    /// `u8 length` then the bytes.
    pub fn bytes_u8(&mut self, b: &[u8]) -> Result<&mut Self, BytesError> {
        let len = u8::try_from(b.len()).map_err(|_| too_long(b.len(), u8::MAX.into()))?;
        Ok(self.u8(len).bytes(b))
    }

    /// `u16 length` then the bytes.
    pub fn bytes_u16(&mut self, b: &[u8]) -> Result<&mut Self, BytesError> {
        let len = u16::try_from(b.len()).map_err(|_| too_long(b.len(), u16::MAX.into()))?;
        Ok(self.u16(len).bytes(b))
    }

    /// `u32 length` then the bytes (what [`Reader::bytes_u32`] reads).
    pub fn bytes_u32(&mut self, b: &[u8]) -> Result<&mut Self, BytesError> {
        self.len_u32(b.len()).map(|w| w.bytes(b))
    }

    /// A length or count as a `u32`.
    pub fn len_u32(&mut self, n: usize) -> Result<&mut Self, BytesError> {
        let v = u32::try_from(n).map_err(|_| too_long(n, u32::MAX.into()))?;
        Ok(self.u32(v))
    }

    /// `v` as a LEB128 varint ([`put_varint`]).
    #[inline(always)]
    pub fn varint(&mut self, v: u64) -> &mut Self {
        put_varint(&mut self.buf, v);
        self
    }

    /// The low `width` bytes of `v` (1, 2, 4 or 8: what [`read_uint`] reads back; at most 8 are written).
    #[inline(always)]
    pub fn uint(&mut self, v: u64, width: u8) -> &mut Self {
        put_uint(&mut self.buf, v, width.min(8));
        self
    }

    /// Bytes written so far (with what [`Writer::from_vec`] started from).
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    pub fn as_slice(&self) -> &[u8] {
        &self.buf
    }

    /// The bytes written, for fields filled in afterwards (a length or checksum ahead of what it covers).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.buf
    }

    pub fn into_vec(self) -> Vec<u8> {
        self.buf
    }
}

fn too_long(len: usize, max: u64) -> BytesError {
    BytesError::TooLong {
        what: "length prefix",
        len,
        max,
    }
}

/// Append the low `width` (1 to 8) bytes of `v` (little-endian), for the patch coder's loops that write into
/// their own vectors ([`Writer::uint`] for everyone else).
pub(crate) fn put_uint(out: &mut Vec<u8>, v: u64, width: u8) {
    out.extend_from_slice(&v.to_le_bytes()[..usize::from(width)]);
}

/// Append `v` as a LEB128 varint (7 bits per byte, low first, high bit = more).
#[inline(always)]
pub fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Decode a LEB128 varint at `*pos`; `None` when truncated or longer than 10 bytes.
#[inline(always)]
pub fn get_varint(buf: &[u8], pos: &mut usize) -> Option<u64> {
    let first = *buf.get(*pos)?;
    if first < 0x80 {
        *pos += 1;
        return Some(u64::from(first));
    }
    let mut v = 0u64;
    for i in 0..10 {
        let b = *buf.get(*pos + i)?;
        v |= u64::from(b & 0x7F) << (7 * i);
        if b < 0x80 {
            *pos += i + 1;
            return Some(v);
        }
    }
    None
}

/// A little-endian unsigned integer of 1, 2, 4 or 8 bytes (0 for any other length).
#[inline(always)]
pub fn read_uint(b: &[u8]) -> u64 {
    match *b {
        [a] => u64::from(a),
        [a, b] => u64::from(u16::from_le_bytes([a, b])),
        [a, b, c, d] => u64::from(u32::from_le_bytes([a, b, c, d])),
        [a, b, c, d, e, f, g, h] => u64::from_le_bytes([a, b, c, d, e, f, g, h]),
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_little_endian_fields_in_order() {
        let mut buf = vec![7u8];
        buf.extend_from_slice(&0x0102u16.to_le_bytes());
        buf.extend_from_slice(&0x0304_0506u32.to_le_bytes());
        buf.extend_from_slice(&u64::MAX.to_le_bytes());
        buf.extend_from_slice(&(-3i64).to_le_bytes());
        buf.extend_from_slice(&1.5f32.to_le_bytes());
        buf.extend_from_slice(&(-0.25f64).to_le_bytes());
        buf.extend_from_slice(&3u32.to_le_bytes());
        buf.extend_from_slice(b"abc");
        let mut r = Reader::new(&buf, "test");
        assert_eq!(r.u8(), Ok(7));
        assert_eq!(r.u16(), Ok(0x0102));
        assert_eq!(r.u32(), Ok(0x0304_0506));
        assert_eq!(r.u64(), Ok(u64::MAX));
        assert_eq!(r.u64(), Ok(-3i64 as u64));
        assert_eq!(r.f32(), Ok(1.5));
        assert_eq!(r.f64(), Ok(-0.25));
        assert_eq!(r.bytes_u32(), Ok(&b"abc"[..]));
        assert_eq!(r.finish(), Ok(()));
    }

    #[test]
    fn short_reads_trailing_bytes_and_big_counts_are_errors() {
        let mut r = Reader::new(&[1, 2, 3], "header");
        assert_eq!(r.u16(), Ok(0x0201));
        let err = r.u32().unwrap_err();
        assert_eq!(
            err,
            BytesError::Short {
                what: "header",
                need: 4,
                offset: 2,
                left: 1
            }
        );
        assert_eq!(
            err.to_string(),
            "truncated: needs 4 bytes at offset 2, 1 left"
        );
        // A failed read consumes nothing.
        assert_eq!(r.remaining(), 1);
        assert_eq!(
            r.finish(),
            Err(BytesError::Trailing {
                what: "header",
                extra: 1
            })
        );
        assert_eq!(r.named("field").take(2).unwrap_err().what(), "field");
        assert_eq!(r.rest(), &[3]);
        assert_eq!(r.finish(), Ok(()));

        let big = u64::MAX.to_le_bytes();
        let err = Reader::new(&big, "table").count(10).unwrap_err();
        assert_eq!(err.to_string(), format!("count {} exceeds 10", u64::MAX));
    }

    #[test]
    fn the_writer_writes_what_the_reader_reads() {
        let mut w = Writer::from_vec(vec![0xEE]);
        w.u8(7)
            .u16(0x0102)
            .u32(0x0304_0506)
            .u64(u64::MAX)
            .i64(-3)
            .f32(1.5)
            .f64(-0.25)
            .varint(300)
            .uint(0x0A0B, 2)
            .bytes(b"raw");
        w.bytes_u32(b"abc").unwrap().len_u32(9).unwrap();
        w.bytes_u16(b"de").unwrap().bytes_u8(b"f").unwrap();
        assert_eq!(
            w.len(),
            1 + 1 + 2 + 4 + 8 + 8 + 4 + 8 + 2 + 2 + 3 + 7 + 4 + 4 + 2
        );
        let buf = w.into_vec();
        let mut r = Reader::new(&buf, "test");
        assert_eq!(r.u8(), Ok(0xEE), "from_vec keeps what the vector held");
        assert_eq!(r.u8(), Ok(7));
        assert_eq!(r.u16(), Ok(0x0102));
        assert_eq!(r.u32(), Ok(0x0304_0506));
        assert_eq!(r.u64(), Ok(u64::MAX));
        assert_eq!(r.u64(), Ok(-3i64 as u64));
        assert_eq!(r.f32(), Ok(1.5));
        assert_eq!(r.f64(), Ok(-0.25));
        assert_eq!(r.take(2), Ok(&[0xAC, 0x02][..]));
        assert_eq!(r.take(2).map(read_uint), Ok(0x0A0B));
        assert_eq!(r.take(3), Ok(&b"raw"[..]));
        assert_eq!(r.bytes_u32(), Ok(&b"abc"[..]));
        assert_eq!(r.u32(), Ok(9));
        assert_eq!(r.u16(), Ok(2));
        assert_eq!(r.take(2), Ok(&b"de"[..]));
        assert_eq!(r.u8(), Ok(1));
        assert_eq!(r.take(1), Ok(&b"f"[..]));
        assert_eq!(r.finish(), Ok(()));
    }

    #[test]
    fn a_length_prefix_too_narrow_for_its_length_is_an_error_and_writes_nothing() {
        let mut w = Writer::new();
        let long = vec![0u8; 256];
        let err = w.bytes_u8(&long).unwrap_err();
        assert_eq!(
            err,
            BytesError::TooLong {
                what: "length prefix",
                len: 256,
                max: 255
            }
        );
        assert_eq!(
            err.to_string(),
            "256 bytes do not fit a length prefix of at most 255"
        );
        assert!(w.bytes_u8(&long[..255]).is_ok());
        assert_eq!(w.len(), 256);
        let mut w = Writer::new();
        let longer = vec![0u8; 1 << 16];
        assert!(w.bytes_u16(&longer).is_err());
        assert!(w.is_empty());
        assert!(w.len_u32(1 << 32).is_err());
        assert!(w.is_empty());
        assert!(w.len_u32(u32::MAX as usize).is_ok());
        assert_eq!(w.as_slice(), &[0xFF; 4]);
        w.as_mut_slice()[0] = 0;
        assert_eq!(w.as_slice(), &[0, 0xFF, 0xFF, 0xFF]);
    }

    #[test]
    fn varints_roundtrip_and_reject_truncation() {
        for v in [0, 1, 127, 128, 300, 1 << 35, u64::MAX] {
            let mut b = Vec::new();
            put_varint(&mut b, v);
            let mut pos = 0;
            assert_eq!(get_varint(&b, &mut pos), Some(v));
            assert_eq!(pos, b.len());
            if b.len() > 1 {
                assert_eq!(get_varint(&b[..b.len() - 1], &mut 0), None);
            }
        }
        let mut b = Vec::new();
        put_varint(&mut b, 300);
        assert_eq!(b, [0xAC, 0x02]);
        assert_eq!(get_varint(&[0xFF; 11], &mut 0), None);
    }

    #[test]
    fn read_uint_widths() {
        assert_eq!(read_uint(&[5]), 5);
        assert_eq!(read_uint(&[1, 1]), 257);
        assert_eq!(read_uint(&[0, 0, 0, 1]), 1 << 24);
        assert_eq!(read_uint(&[0, 0, 0, 0, 0, 0, 0, 1]), 1 << 56);
        assert_eq!(read_uint(&[1, 2, 3]), 0);
    }
}
