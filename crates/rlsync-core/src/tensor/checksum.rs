//! State checksums (xxh3 over names, dtypes, shapes and bytes) so callers can verify sender == receiver.

use xxhash_rust::xxh3::Xxh3;

use super::StateDict;
use super::dtype::DType;

/// Incremental checksum of a sequence of named tensors; the bytes of a tensor may arrive in pieces (so a
/// sender can hash converted chunks without materialising them). Same input sequence → same value.
pub struct StateHasher {
    inner: Xxh3,
}

impl Default for StateHasher {
    fn default() -> Self {
        StateHasher::new()
    }
}

impl StateHasher {
    pub fn new() -> StateHasher {
        StateHasher { inner: Xxh3::new() }
    }

    /// Start a tensor: its name, dtype and shape.
    pub(crate) fn begin_tensor(&mut self, name: &str, dtype: DType, shape: &[usize]) {
        self.inner.update(&(name.len() as u64).to_le_bytes());
        self.inner.update(name.as_bytes());
        self.inner.update(&[1, dtype.code(), shape.len() as u8]);
        for &d in shape {
            self.inner.update(&(d as u64).to_le_bytes());
        }
    }

    /// A piece of the current tensor's bytes.
    pub fn bytes(&mut self, bytes: &[u8]) {
        self.inner.update(bytes);
    }

    /// A key that is absent (hashes differently from every present tensor).
    pub fn missing(&mut self, name: &str) {
        self.inner.update(&(name.len() as u64).to_le_bytes());
        self.inner.update(name.as_bytes());
        self.inner.update(&[0]);
    }

    pub fn finish(&self) -> u64 {
        self.inner.digest()
    }
}

/// Checksum of `keys` of `state` (in the given order): xxh3 over names, dtypes, shapes and bytes.
pub fn state_checksum(state: &StateDict, keys: &[String]) -> u64 {
    let mut h = StateHasher::new();
    for key in keys {
        match state.get(key) {
            Some(t) => {
                h.begin_tensor(key, t.dtype(), t.shape());
                h.bytes(t.bytes());
            }
            None => h.missing(key),
        }
    }
    h.finish()
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
