//! The named-array codec: rollout chunks of Python workers (numpy arrays by name) carried in control blobs.
//!
//! A Python rollout returns its trajectories as a dict of arrays of any names, dtypes and shapes; the binding
//! encodes them here, the orchestrator routes the payload unopened, and the Python trainer gets them back as
//! arrays. Each chunk is self-delimiting, so a `Train` blob holds several back to back (as with
//! `trajectory`). Layout (little-endian):
//!
//! ```text
//! "RLNA" u32 format u64 body_len | body
//! body  = u32 rank  u64 chunk  u32 count  array*count
//! array = u16 name_len  name (utf-8)  u8 dtype_len  dtype (numpy `dtype.str`: "<f4", "|b1", "<i8", …)
//!         u8 ndim  u64 dim*ndim  u64 byte_len  bytes (C order; byte_len = product(dims) * itemsize)
//! ```

use crate::bytes::{Reader, Writer};
use crate::protocol::ProtocolError;

/// Where a trajectory chunk came from: the rollout rank and the chunk index (time order within a step).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkOrigin {
    pub rank: u32,
    pub chunk: u64,
}

/// Version of the named-array encoding; bump on any incompatible change.
pub(crate) const ARRAYS_FORMAT: u32 = 1;

const MAGIC: &[u8; 4] = b"RLNA";
/// Bounds that keep a hostile header from asking for absurd allocations.
const MAX_ARRAYS: usize = 4096;
const MAX_NDIM: usize = 32;

/// One array: its name, numpy dtype string, shape and C-order bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedArray<'a> {
    pub name: &'a str,
    pub dtype: &'a str,
    pub shape: Vec<u64>,
    pub data: &'a [u8],
}

/// The item size of a numpy dtype string this codec carries: byte order `<` or `|` (`=` is not portable
/// across hosts), kind `f`/`i`/`u`/`b`, size 1, 2, 4 or 8 (`"<f2"` is float16; bfloat16 has no numpy dtype).
pub(crate) fn itemsize(dtype: &str) -> Option<usize> {
    let rest = dtype.strip_prefix(['<', '|'])?;
    let (kind, size) = rest.split_at_checked(1)?;
    let size: usize = size.parse().ok()?;
    let ok = match kind {
        "f" => matches!(size, 2 | 4 | 8),
        "i" | "u" => matches!(size, 1 | 2 | 4 | 8),
        "b" => size == 1,
        _ => false,
    };
    ok.then_some(size)
}

fn malformed(reason: String) -> ProtocolError {
    ProtocolError::Malformed { reason }
}

/// The byte length `shape` and `dtype` imply, checked against overflow.
fn expected_len(a: &NamedArray<'_>) -> Result<usize, ProtocolError> {
    let size = itemsize(a.dtype).ok_or_else(|| {
        malformed(format!(
            "array '{}': dtype '{}' is not one of <f2 <f4 <f8 <i1..8 <u1..8 |b1 (little-endian numeric or bool)",
            a.name, a.dtype
        ))
    })?;
    a.shape
        .iter()
        .try_fold(size as u64, |acc, &d| acc.checked_mul(d))
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| malformed(format!("array '{}': shape {:?} overflows", a.name, a.shape)))
}

fn check(a: &NamedArray<'_>) -> Result<(), ProtocolError> {
    if a.name.is_empty() || a.name.len() > usize::from(u16::MAX) {
        return Err(malformed(format!(
            "array name must have 1 to 65535 bytes, got {}",
            a.name.len()
        )));
    }
    if a.shape.len() > MAX_NDIM {
        return Err(malformed(format!(
            "array '{}' has {} dimensions (at most {MAX_NDIM})",
            a.name,
            a.shape.len()
        )));
    }
    let want = expected_len(a)?;
    if a.data.len() != want {
        return Err(malformed(format!(
            "array '{}': {} bytes for shape {:?} of {} (expected {want})",
            a.name,
            a.data.len(),
            a.shape,
            a.dtype
        )));
    }
    Ok(())
}

/// Encode one chunk's arrays; every array is checked (dtype, shape against byte length, unique names).
pub fn encode_arrays(
    origin: ChunkOrigin,
    arrays: &[NamedArray<'_>],
) -> Result<Vec<u8>, ProtocolError> {
    if arrays.len() > MAX_ARRAYS {
        return Err(malformed(format!(
            "{} arrays in one chunk (at most {MAX_ARRAYS})",
            arrays.len()
        )));
    }
    let mut w = Writer::with_capacity(
        16 + arrays
            .iter()
            .map(|a| 32 + a.name.len() + a.data.len() + 8 * a.shape.len())
            .sum::<usize>(),
    );
    w.u32(origin.rank).u64(origin.chunk).len_u32(arrays.len())?;
    for (i, a) in arrays.iter().enumerate() {
        check(a)?;
        if arrays[..i].iter().any(|b| b.name == a.name) {
            return Err(malformed(format!("array '{}' appears twice", a.name)));
        }
        // `check` bounded the name (u16), the dtype (a few bytes) and the rank (MAX_NDIM).
        w.bytes_u16(a.name.as_bytes())?
            .bytes_u8(a.dtype.as_bytes())?
            .u8(a.shape.len() as u8);
        for &d in &a.shape {
            w.u64(d);
        }
        w.u64(a.data.len() as u64).bytes(a.data);
    }
    let mut out = Writer::with_capacity(16 + w.len());
    out.bytes(MAGIC)
        .u32(ARRAYS_FORMAT)
        .u64(w.len() as u64)
        .bytes(w.as_slice());
    Ok(out.into_vec())
}

/// Decode every chunk of a blob of back-to-back [`encode_arrays`] payloads; each array is validated and
/// borrows from `bytes`.
pub fn decode_arrays(
    bytes: &[u8],
) -> Result<Vec<(ChunkOrigin, Vec<NamedArray<'_>>)>, ProtocolError> {
    let mut r = Reader::new(bytes, "named-array chunk");
    let mut out = Vec::new();
    while r.remaining() > 0 {
        if r.take(4)? != MAGIC {
            return Err(malformed(
                "named-array payload does not start with RLNA".into(),
            ));
        }
        let format = r.u32()?;
        if format != ARRAYS_FORMAT {
            return Err(ProtocolError::Version {
                peer: format,
                ours: ARRAYS_FORMAT,
            });
        }
        let len = usize::try_from(r.u64()?)
            .map_err(|_| malformed("named-array chunk length overflows".into()))?;
        out.push(decode_one(r.take(len)?)?);
    }
    Ok(out)
}

fn decode_one(body: &[u8]) -> Result<(ChunkOrigin, Vec<NamedArray<'_>>), ProtocolError> {
    let mut r = Reader::new(body, "named-array body");
    let origin = ChunkOrigin {
        rank: r.u32()?,
        chunk: r.u64()?,
    };
    let count = r.u32()? as usize;
    if count > MAX_ARRAYS {
        return Err(malformed(format!(
            "{count} arrays in one chunk (at most {MAX_ARRAYS})"
        )));
    }
    let mut arrays = Vec::with_capacity(count);
    for _ in 0..count {
        let name_len = usize::from(r.u16()?);
        let name = std::str::from_utf8(r.take(name_len)?)
            .map_err(|_| malformed("array name is not utf-8".into()))?;
        let dtype_len = usize::from(r.u8()?);
        let dtype = std::str::from_utf8(r.take(dtype_len)?)
            .map_err(|_| malformed(format!("array '{name}': dtype is not utf-8")))?;
        let ndim = usize::from(r.u8()?);
        if ndim > MAX_NDIM {
            return Err(malformed(format!(
                "array '{name}' has {ndim} dimensions (at most {MAX_NDIM})"
            )));
        }
        let shape = (0..ndim).map(|_| r.u64()).collect::<Result<Vec<_>, _>>()?;
        let byte_len = usize::try_from(r.u64()?)
            .map_err(|_| malformed(format!("array '{name}': length overflows")))?;
        let data = r.take(byte_len)?;
        let a = NamedArray {
            name,
            dtype,
            shape,
            data,
        };
        check(&a)?;
        if arrays.iter().any(|b: &NamedArray<'_>| b.name == name) {
            return Err(malformed(format!("array '{name}' appears twice")));
        }
        arrays.push(a);
    }
    if r.remaining() != 0 {
        return Err(malformed(format!(
            "{} unexpected bytes after the arrays",
            r.remaining()
        )));
    }
    Ok((origin, arrays))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample<'a>(obs: &'a [u8], done: &'a [u8]) -> Vec<NamedArray<'a>> {
        vec![
            NamedArray {
                name: "obs",
                dtype: "<f4",
                shape: vec![2, 1],
                data: obs,
            },
            NamedArray {
                name: "done",
                dtype: "|b1",
                shape: vec![2],
                data: done,
            },
        ]
    }

    #[test]
    fn chunks_round_trip_back_to_back() {
        let obs: Vec<u8> = [1.5f32, -2.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let done = [0u8, 1];
        let a = encode_arrays(ChunkOrigin { rank: 1, chunk: 7 }, &sample(&obs, &done)).unwrap();
        let empty = encode_arrays(ChunkOrigin { rank: 0, chunk: 8 }, &[]).unwrap();
        let blob = [a.as_slice(), empty.as_slice()].concat();
        let chunks = decode_arrays(&blob).unwrap();
        assert_eq!(chunks.len(), 2);
        assert_eq!(chunks[0].0, ChunkOrigin { rank: 1, chunk: 7 });
        assert_eq!(chunks[0].1, sample(&obs, &done));
        assert_eq!(chunks[1].0.chunk, 8);
        assert!(chunks[1].1.is_empty());
    }

    #[test]
    fn bad_arrays_are_refused_when_encoding() {
        let short = [0u8; 3];
        for (dtype, shape, data, want) in [
            ("<f4", vec![1u64], &short[..], "expected 4"),
            (">f4", vec![0], &[][..], "little-endian"),
            ("<c8", vec![0], &[][..], "dtype"),
            ("<f4", vec![u64::MAX, 4], &[][..], "overflows"),
        ] {
            let a = NamedArray {
                name: "x",
                dtype,
                shape,
                data,
            };
            let err = encode_arrays(ChunkOrigin { rank: 0, chunk: 0 }, &[a]).unwrap_err();
            assert!(err.to_string().contains(want), "{dtype}: {err}");
        }
        let a = NamedArray {
            name: "x",
            dtype: "|b1",
            shape: vec![0],
            data: &[],
        };
        let err = encode_arrays(ChunkOrigin { rank: 0, chunk: 0 }, &[a.clone(), a]).unwrap_err();
        assert!(err.to_string().contains("twice"), "{err}");
    }

    #[test]
    fn every_truncation_and_bit_flip_of_the_header_is_an_error_not_a_panic() {
        let obs: Vec<u8> = [1.0f32, 2.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        let done = [1u8, 0];
        let blob = encode_arrays(ChunkOrigin { rank: 3, chunk: 1 }, &sample(&obs, &done)).unwrap();
        for cut in 0..blob.len() {
            assert!(
                decode_arrays(&blob[..cut]).is_err() || cut == 0,
                "cut {cut}"
            );
        }
        // Flip each header/metadata byte (data bytes may legitimately change values).
        for i in 0..blob.len() {
            let mut bad = blob.clone();
            bad[i] ^= 0x80;
            // Either refused, or decoded into something self-consistent (a flipped data byte).
            if let Ok(chunks) = decode_arrays(&bad) {
                for (_, arrays) in chunks {
                    for a in arrays {
                        assert_eq!(a.data.len(), expected_len(&a).unwrap());
                    }
                }
            }
        }
    }

    #[test]
    fn version_and_magic_are_checked() {
        let mut blob = encode_arrays(ChunkOrigin { rank: 0, chunk: 0 }, &[]).unwrap();
        blob[4] = 9;
        assert!(matches!(
            decode_arrays(&blob),
            Err(ProtocolError::Version { peer: 9, ours: 1 })
        ));
        blob[0] = b'X';
        assert!(
            decode_arrays(&blob)
                .unwrap_err()
                .to_string()
                .contains("RLNA")
        );
    }
}
