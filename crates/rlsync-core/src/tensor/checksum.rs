//! State checksums (xxh3 over names, dtypes, shapes and bytes) so callers can verify sender == receiver.
//!
//! A tensor's bytes are hashed in chunks of [`CHUNK`] bytes (xxh3-64 of each, counted from the tensor's first
//! byte; the last may be shorter) and the chunks' digests go into the state's stream in order, after the
//! tensor's name and layout. So the value does not depend on how the bytes arrive ([`StateHasher::bytes`]
//! takes pieces of any size), and a whole state's chunks are hashed on all threads
//! ([`state_checksum_threads`]): a 7B model's 13.5 GB at memory speed instead of one core's xxh3 rate.

use std::num::NonZeroUsize;

use xxhash_rust::xxh3::{Xxh3, xxh3_64};

use super::StateDict;
use super::dtype::DType;
use super::parallel::{map_items, resolve_threads};

/// Bytes of a tensor hashed as one chunk.
pub const CHUNK: usize = 1 << 20;

/// Incremental checksum of a sequence of named tensors; the bytes of a tensor may arrive in pieces of any size
/// (so a sender can hash converted chunks without materialising them). Same input sequence → same value.
pub struct StateHasher {
    /// The state's stream: layouts and chunk digests.
    outer: Xxh3,
    /// The current tensor's unfinished chunk, and how many bytes of it arrived.
    chunk: Xxh3,
    filled: usize,
}

impl Default for StateHasher {
    fn default() -> Self {
        StateHasher::new()
    }
}

impl StateHasher {
    pub fn new() -> StateHasher {
        StateHasher {
            outer: Xxh3::new(),
            chunk: Xxh3::new(),
            filled: 0,
        }
    }

    /// Start a tensor: its name, dtype and shape.
    pub(crate) fn begin_tensor(&mut self, name: &str, dtype: DType, shape: &[usize]) {
        self.end_chunk();
        self.outer.update(&(name.len() as u64).to_le_bytes());
        self.outer.update(name.as_bytes());
        self.outer.update(&[1, dtype.code(), shape.len() as u8]);
        for &d in shape {
            self.outer.update(&(d as u64).to_le_bytes());
        }
    }

    /// A piece of the current tensor's bytes.
    pub fn bytes(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            if self.filled == 0 && bytes.len() >= CHUNK {
                // Whole chunks straight from the piece.
                let (whole, rest) = bytes.split_at(CHUNK);
                self.chunk_digest(xxh3_64(whole));
                bytes = rest;
                continue;
            }
            let take = bytes.len().min(CHUNK - self.filled);
            self.chunk.update(&bytes[..take]);
            self.filled += take;
            bytes = &bytes[take..];
            if self.filled == CHUNK {
                self.end_chunk();
            }
        }
    }

    /// The digest of the current tensor's next whole chunk, hashed elsewhere (`xxh3_64` of its [`CHUNK`]
    /// bytes, or of the tensor's last bytes for its last chunk); only at a chunk boundary (no partial chunk
    /// pending).
    pub(crate) fn chunk_digest(&mut self, digest: u64) {
        debug_assert_eq!(self.filled, 0, "a chunk digest in the middle of a chunk");
        self.outer.update(&digest.to_le_bytes());
    }

    /// Hash the pending partial chunk (the end of a tensor) into the state's stream.
    fn end_chunk(&mut self) {
        if self.filled > 0 {
            let d = self.chunk.digest();
            self.outer.update(&d.to_le_bytes());
            self.chunk.reset();
            self.filled = 0;
        }
    }

    /// A key that is absent (hashes differently from every present tensor).
    pub fn missing(&mut self, name: &str) {
        self.end_chunk();
        self.outer.update(&(name.len() as u64).to_le_bytes());
        self.outer.update(name.as_bytes());
        self.outer.update(&[0]);
    }

    pub fn finish(&self) -> u64 {
        if self.filled == 0 {
            return self.outer.digest();
        }
        let mut outer = self.outer.clone();
        outer.update(&self.chunk.digest().to_le_bytes());
        outer.digest()
    }
}

/// The checksum before chunking (one xxh3 stream over the same layouts and the raw bytes): kept only to verify
/// what was recorded with it (checkpoints of `format_version` 1).
pub fn state_checksum_v1(state: &StateDict, keys: &[String]) -> u64 {
    let mut h = Xxh3::new();
    for key in keys {
        h.update(&(key.len() as u64).to_le_bytes());
        h.update(key.as_bytes());
        match state.get(key) {
            Some(t) => {
                h.update(&[1, t.dtype().code(), t.shape().len() as u8]);
                for &d in t.shape() {
                    h.update(&(d as u64).to_le_bytes());
                }
                h.update(t.bytes());
            }
            None => h.update(&[0]),
        }
    }
    h.digest()
}

/// Checksum of `keys` of `state` (in the given order): xxh3 over names, dtypes, shapes and the tensors'
/// chunk digests (module docs), on every available thread.
pub fn state_checksum(state: &StateDict, keys: &[String]) -> u64 {
    state_checksum_threads(state, keys, resolve_threads(0))
}

/// [`state_checksum`] on up to `threads` threads (the value does not depend on them).
pub fn state_checksum_threads(state: &StateDict, keys: &[String], threads: NonZeroUsize) -> u64 {
    let pieces: Vec<Piece<'_>> = keys
        .iter()
        .map(|k| match state.get(k) {
            Some(t) => Piece::Tensor {
                layout: Some((k.as_str(), t.dtype(), t.shape())),
                bytes: t.bytes(),
            },
            None => Piece::Missing(k),
        })
        .collect();
    let mut h = StateHasher::new();
    h.pieces(&pieces, threads);
    h.finish()
}

/// Bytes each thread of a parallel checksum hashes at least: a small state is hashed on fewer threads than
/// asked (starting a thread costs more than hashing a few chunks). One chunk in tests, so that their small
/// states take the parallel path too (the value never depends on the threads).
const BYTES_PER_THREAD: usize = if cfg!(test) { CHUNK } else { 8 * CHUNK };

/// The digests (`xxh3_64`) of `chunks`, in order, on up to `threads` threads (fewer for a few bytes).
pub(crate) fn digest_chunks(chunks: Vec<&[u8]>, threads: NonZeroUsize) -> Vec<u64> {
    let total: usize = chunks.iter().map(|c| c.len()).sum();
    let threads =
        threads.min(NonZeroUsize::new(total / BYTES_PER_THREAD).unwrap_or(NonZeroUsize::MIN));
    map_items(chunks, threads, xxh3_64)
}

/// What [`StateHasher::pieces`] hashes, in order.
pub(crate) enum Piece<'a> {
    /// A tensor: its layout (name, dtype, shape) and all its bytes, or (`layout` `None`) the rest of the
    /// current tensor's bytes from a chunk boundary.
    Tensor {
        layout: Option<(&'a str, DType, &'a [usize])>,
        bytes: &'a [u8],
    },
    /// A tensor's first whole chunks, hashed elsewhere: their digests (`xxh3_64` of each [`CHUNK`] bytes,
    /// e.g. by the GPU's `xxh3_chunks`), after its layout; the rest of its bytes may follow as a `Tensor`
    /// piece without a layout.
    Digests {
        layout: (&'a str, DType, &'a [usize]),
        digests: &'a [u64],
    },
    /// A key that is absent.
    Missing(&'a str),
}

impl StateHasher {
    /// Hash `pieces` in order, as [`StateHasher::begin_tensor`], [`StateHasher::bytes`] and
    /// [`StateHasher::missing`] would, with the tensors' chunks hashed on up to `threads` threads.
    pub(crate) fn pieces(&mut self, pieces: &[Piece<'_>], threads: NonZeroUsize) {
        let chunks: Vec<&[u8]> = pieces
            .iter()
            .filter_map(|p| match *p {
                Piece::Tensor { bytes, .. } => Some(bytes),
                Piece::Digests { .. } | Piece::Missing(_) => None,
            })
            .flat_map(|b| b.chunks(CHUNK))
            .collect();
        let mut digests = digest_chunks(chunks, threads).into_iter();
        for p in pieces {
            match *p {
                Piece::Tensor { layout, bytes } => {
                    if let Some((name, dtype, shape)) = layout {
                        self.begin_tensor(name, dtype, shape);
                    }
                    for _ in 0..bytes.len().div_ceil(CHUNK) {
                        self.chunk_digest(digests.next().unwrap_or_default());
                    }
                }
                Piece::Digests {
                    layout: (name, dtype, shape),
                    digests: done,
                } => {
                    self.begin_tensor(name, dtype, shape);
                    for &d in done {
                        self.chunk_digest(d);
                    }
                }
                Piece::Missing(name) => self.missing(name),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::{Class, Tensor};

    fn sd(values: &[f32], shape: &[usize]) -> StateDict {
        let mut s = StateDict::new();
        s.insert(
            "w",
            Tensor::from_slice(DType::F32, shape, Class::Trainable, values).unwrap(),
        );
        s
    }

    #[test]
    fn checksum_sees_bytes_shape_and_missing_keys() {
        let keys = vec!["w".to_string()];
        let a = state_checksum(&sd(&[1.0, 2.0], &[2]), &keys);
        assert_eq!(a, state_checksum(&sd(&[1.0, 2.0], &[2]), &keys));
        assert_ne!(a, state_checksum(&sd(&[1.0, 3.0], &[2]), &keys));
        assert_ne!(a, state_checksum(&sd(&[1.0, 2.0], &[1, 2]), &keys));
        assert_ne!(
            a,
            state_checksum(&sd(&[1.0, 2.0], &[2]), &["v".to_string()])
        );
    }

    /// The value does not depend on how a tensor's bytes arrive nor on the threads: pieces straddling chunk
    /// boundaries, whole chunks, one byte at a time.
    #[test]
    fn pieces_and_threads_give_the_same_value() {
        let n = 2 * CHUNK + 3 * 7;
        let mut s = StateDict::new();
        let bytes: Vec<u8> = (0..n).map(|i| (i * 131 % 251) as u8).collect();
        s.insert(
            "big",
            Tensor::from_bytes(DType::U8, &[n], Class::Trainable, &bytes).unwrap(),
        );
        s.insert(
            "small",
            Tensor::from_bytes(DType::U8, &[3], Class::Trainable, &[1, 2, 3]).unwrap(),
        );
        let keys = vec!["big".to_string(), "gone".to_string(), "small".to_string()];
        let one = state_checksum_threads(&s, &keys, NonZeroUsize::MIN);
        assert_eq!(
            one,
            state_checksum_threads(&s, &keys, NonZeroUsize::new(3).unwrap())
        );
        for piece in [1usize, 7, CHUNK - 1, CHUNK, CHUNK + 5, n] {
            let mut h = StateHasher::new();
            h.begin_tensor("big", DType::U8, &[n]);
            for p in bytes.chunks(piece) {
                h.bytes(p);
            }
            h.missing("gone");
            h.begin_tensor("small", DType::U8, &[3]);
            h.bytes(&[1, 2]);
            h.bytes(&[3]);
            assert_eq!(h.finish(), one, "pieces of {piece}");
        }
        // Moving one byte across the chunk boundary between two tensors changes the value.
        let mut moved = StateDict::new();
        moved.insert(
            "big",
            Tensor::from_bytes(DType::U8, &[n - 1], Class::Trainable, &bytes[..n - 1]).unwrap(),
        );
        let mut small = vec![bytes[n - 1]];
        small.extend_from_slice(&[1, 2, 3]);
        moved.insert(
            "small",
            Tensor::from_bytes(DType::U8, &[4], Class::Trainable, &small).unwrap(),
        );
        assert_ne!(state_checksum(&moved, &keys), one);
    }

    /// The format-1 checksum of a fixed state, as checkpoints written before chunking recorded it: it must
    /// never change (those checkpoints are verified with it).
    #[test]
    fn the_format_1_checksum_is_what_it_was() {
        let s = sd(&[1.0, 2.0], &[2]);
        let keys = vec!["w".to_string(), "gone".to_string()];
        let mut h = Xxh3::new();
        h.update(&1u64.to_le_bytes());
        h.update(b"w");
        h.update(&[1, DType::F32.code(), 1]);
        h.update(&2u64.to_le_bytes());
        h.update(&[0, 0, 0x80, 0x3F, 0, 0, 0, 0x40]);
        h.update(&4u64.to_le_bytes());
        h.update(b"gone");
        h.update(&[0]);
        assert_eq!(state_checksum_v1(&s, &keys), h.digest());
        assert_ne!(state_checksum_v1(&s, &keys), state_checksum(&s, &keys));
    }

    #[test]
    fn chunked_hashing_equals_whole() {
        let s = sd(&[1.0, 2.0, 3.0], &[3]);
        let t = s.get("w").unwrap();
        let mut h = StateHasher::new();
        h.begin_tensor("w", DType::F32, &[3]);
        h.bytes(&t.bytes()[..5]);
        h.bytes(&t.bytes()[5..]);
        assert_eq!(h.finish(), state_checksum(&s, &["w".to_string()]));
    }
}
