//! Little-endian byte reading and LEB128 varints: the one bounds-checked reader and the one varint of the crate.
//!
//! Every binary format (the weight-sync wire, the control frames, the trajectory codec, the shm transport's
//! control messages, TensorBoard records) reads its fields through [`Reader`], so a truncated or overlong input
//! is an error naming what was being read, never a panic.

/// Why a [`Reader`] could not read a field; `what` names the structure being read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BytesError {
    #[error("needs {need} bytes at offset {offset}, {left} left")]
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
}

impl BytesError {
    /// The structure (or field) that was being read.
    pub fn what(&self) -> &'static str {
        match self {
            BytesError::Short { what, .. }
            | BytesError::Trailing { what, .. }
            | BytesError::Count { what, .. } => what,
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
        assert_eq!(err.to_string(), "needs 4 bytes at offset 2, 1 left");
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
