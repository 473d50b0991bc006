//! CPU reference of `xxh3_chunks` (kernels/rlsync.cu, "State checksum chunks"): XXH3-64 computed the way the
//! kernel's eight threads per chunk compute it, over a [`Memory`], so the device checksum is checked against
//! `xxhash_rust`'s `xxh3_64` (and the kernel's key tables against the secret) here.

use super::{Memory, ReferenceError};
use crate::bytes::read_uint;

/// XXH3's default secret (`kSecret`): the kernel's keys are its words.
pub const SECRET: [u8; 192] = [
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad,
    0x1c, //
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67,
    0x1f, //
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72,
    0x21, //
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26,
    0x4c, //
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e,
    0xa3, //
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac,
    0xd8, //
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f,
    0x1d, //
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73,
    0x64, //
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63,
    0xeb, //
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68,
    0x9e, //
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31,
    0xce, //
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40,
    0x7e, //
];

const PRIME32_1: u64 = 0x9E37_79B1;
const PRIME64_1: u64 = 0x9E37_79B1_85EB_CA87;
const PRIME_MX1: u64 = 0x1656_6791_9E37_79F9;

/// The accumulators' initial values (`XXH3_INIT`).
pub const INIT: [u64; 8] = [
    0xC2B2_AE3D,
    0x9E37_79B1_85EB_CA87,
    0xC2B2_AE3D_27D4_EB4F,
    0x1656_67B1_9E37_79F9,
    0x85EB_CA77_C2B2_AE63,
    0x85EB_CA77,
    0x27D4_EB2F_1656_67C5,
    0x9E37_79B1,
];

/// The secret's little-endian word at byte `at`.
fn secret_word(at: usize) -> u64 {
    read_uint(&SECRET[at..at + 8])
}

/// `XXH3_WORDS`: the secret's 24 aligned words (stripe `s`'s key for accumulator `i` is word `s + i`; the
/// scramble's, word `16 + i`).
pub fn words() -> [u64; 24] {
    std::array::from_fn(|k| secret_word(8 * k))
}

/// `XXH3_LAST`: the last stripe's keys (the secret's words at byte 121).
pub fn last_keys() -> [u64; 8] {
    std::array::from_fn(|k| secret_word(121 + 8 * k))
}

/// `XXH3_MERGE`: the merge's keys (the secret's words at byte 11).
pub fn merge_keys() -> [u64; 8] {
    std::array::from_fn(|k| secret_word(11 + 8 * k))
}

/// Whether `xxh3_chunks` takes chunks of `len` bytes: longer than XXH3's short-input limit (240), whole words.
pub fn supported_len(len: u64) -> bool {
    len > 240 && len.is_multiple_of(8)
}

/// `xxh3_step`.
fn step(acc: u64, v: u64, w: u64, k: u64) -> u64 {
    let dk = v ^ k;
    acc.wrapping_add(w)
        .wrapping_add((dk & 0xFFFF_FFFF).wrapping_mul(dk >> 32))
}

/// `xxh3_scramble`.
fn scramble(mut acc: u64, k: u64) -> u64 {
    acc ^= acc >> 47;
    acc ^= k;
    acc.wrapping_mul(PRIME32_1)
}

/// `xxh3_lane`: accumulator `lane` of the `len / 8` words `word(0..)`.
fn lane(word: &impl Fn(u64) -> u64, len: u64, lane: usize) -> u64 {
    let (words, last_keys) = (words(), last_keys());
    let other = (lane ^ 1) as u64;
    let l = lane as u64;
    let mut acc = INIT[lane];
    let blocks = (len - 1) / 1024;
    for b in 0..blocks {
        let s = b * 128;
        for i in 0..16 {
            let at = s + i * 8;
            acc = step(
                acc,
                word(at + l),
                word(at + other),
                words[i as usize + lane],
            );
        }
        acc = scramble(acc, words[16 + lane]);
    }
    let s = blocks * 128;
    let stripes = ((len - 1) - blocks * 1024) / 64;
    for i in 0..stripes {
        let at = s + i * 8;
        acc = step(
            acc,
            word(at + l),
            word(at + other),
            words[i as usize + lane],
        );
    }
    let last = len / 8 - 8;
    step(acc, word(last + l), word(last + other), last_keys[lane])
}

/// `xxh3_fold`.
fn fold(a: u64, b: u64) -> u64 {
    let p = u128::from(a) * u128::from(b);
    (p as u64) ^ ((p >> 64) as u64)
}

/// `xxh3_merge`.
fn merge(acc: &[u64; 8], len: u64) -> u64 {
    let keys = merge_keys();
    let mut h = len.wrapping_mul(PRIME64_1);
    for i in 0..4 {
        h = h.wrapping_add(fold(
            acc[2 * i] ^ keys[2 * i],
            acc[2 * i + 1] ^ keys[2 * i + 1],
        ));
    }
    h ^= h >> 37;
    h = h.wrapping_mul(PRIME_MX1);
    h ^ (h >> 32)
}

/// One chunk's digest as the kernel's eight threads compute it: `bytes` must be [`supported_len`].
pub fn digest(bytes: &[u8]) -> u64 {
    let word = |i: u64| {
        let at = i as usize * 8;
        read_uint(&bytes[at..at + 8])
    };
    let len = bytes.len() as u64;
    let acc: [u64; 8] = std::array::from_fn(|l| lane(&word, len, l));
    merge(&acc, len)
}

/// `xxh3_chunks` over `chunks` (addresses in `mem`, 8-byte aligned as the kernel's loads need), each `len`
/// bytes ([`supported_len`]): `out[c]` := chunk `c`'s digest.
pub fn xxh3_chunks(mem: &Memory, chunks: &[u64], len: u64) -> Result<Vec<u64>, ReferenceError> {
    chunks
        .iter()
        .map(|&addr| {
            if !addr.is_multiple_of(8) || !supported_len(len) {
                return Err(ReferenceError::Address { addr, len });
            }
            Ok(digest(mem.read(addr, len)?))
        })
        .collect()
}

#[cfg(test)]
mod tests;
