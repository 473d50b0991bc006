//! The GPU tests' deterministic inputs: one xorshift generator, so a failing case names a reproducible seed.

/// xorshift64: seedable, fast, enough for test bytes.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// `len` bytes drawn from `seed` (never the all-zero state).
pub(crate) fn bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut r = Rng(seed | 1);
    (0..len).map(|_| r.next() as u8).collect()
}
