//! The eight-lane XXH3 (the reference, and the kernel's own source compiled for the host) against
//! `xxhash_rust`'s `xxh3_64`, and the kernel's key tables against the secret.

use std::path::Path;
use std::process::Command;

use xxhash_rust::xxh3::xxh3_64;

use super::*;
use crate::gpu::reference::rng::bytes;
use crate::tensor::CHECKSUM_CHUNK;

const KERNELS: &str = include_str!("../../../../kernels/rlsync.cu");

/// The `u64` literals of the kernel's `__constant__` table `name`.
fn cu_table(name: &str) -> Vec<u64> {
    let start = KERNELS
        .find(&format!("__constant__ u64 {name}["))
        .unwrap_or_else(|| panic!("rlsync.cu has no table {name}"));
    let body = &KERNELS[start..];
    let body = &body[body.find('{').unwrap() + 1..body.find("};").unwrap()];
    body.split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| {
            let hex = t.trim_start_matches("0x").trim_end_matches("ull");
            u64::from_str_radix(hex, 16).unwrap_or_else(|e| panic!("{name}: {t}: {e}"))
        })
        .collect()
}

#[test]
fn the_kernels_key_tables_are_the_secrets_words() {
    assert_eq!(cu_table("XXH3_INIT"), INIT);
    assert_eq!(cu_table("XXH3_WORDS"), words());
    assert_eq!(cu_table("XXH3_LAST"), last_keys());
    assert_eq!(cu_table("XXH3_MERGE"), merge_keys());
}

#[test]
fn a_whole_checksum_chunk_digests_as_xxh3_64() {
    for seed in [1, 2, 3] {
        let b = bytes(CHECKSUM_CHUNK, seed);
        assert_eq!(digest(&b), xxh3_64(&b), "seed {seed}");
    }
    // Every byte counts, the last stripe's too.
    let mut b = bytes(CHECKSUM_CHUNK, 4);
    let before = digest(&b);
    *b.last_mut().unwrap() ^= 1;
    assert_ne!(digest(&b), before);
    assert_eq!(digest(&b), xxh3_64(&b));
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 64, ..Default::default() })]

    /// Lengths on both sides of the 1024-byte scramble blocks and of the last partial block's stripes.
    #[test]
    fn every_supported_length_digests_as_xxh3_64(words in 31usize..1200, seed in proptest::prelude::any::<u64>()) {
        let b = bytes(words * 8, seed);
        proptest::prop_assert!(supported_len(b.len() as u64));
        proptest::prop_assert_eq!(digest(&b), xxh3_64(&b));
    }
}

#[test]
fn the_reference_kernel_reads_chunks_where_the_table_points_and_refuses_misaligned_ones() {
    let mut mem = Memory::default();
    let a = bytes(4096, 7);
    let b = bytes(4096 + 512, 8);
    let at_a = mem.alloc(&a);
    let at_b = mem.alloc(&b);
    let out = xxh3_chunks(&mem, &[at_b + 512, at_a, at_b], 4096).unwrap();
    assert_eq!(out, [xxh3_64(&b[512..]), xxh3_64(&a), xxh3_64(&b[..4096])]);
    assert!(xxh3_chunks(&mem, &[at_a + 4], 1024).is_err());
    assert!(xxh3_chunks(&mem, &[at_a], 1020).is_err());
    assert!(xxh3_chunks(&mem, &[at_a], 8192).is_err(), "past the buffer");
}

/// The kernel's XXH3 device functions (between the `xxh3 chunks` markers of rlsync.cu), compiled for the host
/// with the few CUDA names they use defined, and driven as the kernel drives them: eight lanes, then the merge.
#[test]
fn the_kernels_own_xxh3_source_compiled_for_the_host_digests_as_xxh3_64() {
    let begin = "// -- xxh3 chunks (begin) --";
    let end = "// -- xxh3 chunks (end) --";
    let section = &KERNELS[KERNELS.find(begin).unwrap()..KERNELS.find(end).unwrap()];
    let program = format!(
        r#"#include <cstdio>
#include <cstdlib>
#include <cstring>
typedef unsigned char u8;
typedef unsigned int u32;
typedef unsigned long long u64;
#define __device__
#define __forceinline__ inline
#define __constant__ static const
static inline u64 __ldg(const u64* p) {{ return *p; }}
static inline u64 __umul64hi(u64 a, u64 b) {{ return (u64)(((unsigned __int128)a * b) >> 64); }}
{section}
int main(int argc, char** argv) {{
    FILE* f = fopen(argv[1], "rb");
    if (!f) return 2;
    for (int a = 2; a < argc; ++a) {{
        const u64 len = strtoull(argv[a], 0, 10);
        u64* p = (u64*)malloc(len);
        if (!p || fread(p, 1, len, f) != len) return 3;
        u64 acc[8];
        for (u32 l = 0; l < 8; ++l) acc[l] = xxh3_lane(p, len, l);
        printf("%016llx\n", xxh3_merge(acc, len));
        free(p);
    }}
    return 0;
}}
"#
    );
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("xxh3_host.cpp");
    let exe = dir.path().join("xxh3_host");
    std::fs::write(&src, program).unwrap();
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".to_owned());
    let built = Command::new(&cxx)
        .args(["-O1", "-std=c++17", "-w", "-o"])
        .arg(&exe)
        .arg(&src)
        .output()
        .unwrap_or_else(|e| {
            panic!("this test compiles the kernel's XXH3 for the host and needs a C++ compiler ({cxx}, or $CXX): {e}")
        });
    assert!(
        built.status.success(),
        "{cxx} failed:\n{}",
        String::from_utf8_lossy(&built.stderr)
    );

    let lens = [
        248usize,
        1024,
        1032,
        2048 + 64,
        4096 + 8 * 37,
        CHECKSUM_CHUNK,
    ];
    let inputs: Vec<Vec<u8>> = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| bytes(n, 100 + i as u64))
        .collect();
    let data = dir.path().join("inputs.bin");
    std::fs::write(&data, inputs.concat()).unwrap();
    let out = run(&exe, &data, &lens);
    let want: Vec<String> = inputs
        .iter()
        .map(|b| format!("{:016x}", xxh3_64(b)))
        .collect();
    assert_eq!(out, want);
}

fn run(exe: &Path, data: &Path, lens: &[usize]) -> Vec<String> {
    let out = Command::new(exe)
        .arg(data)
        .args(lens.iter().map(usize::to_string))
        .output()
        .unwrap();
    assert!(out.status.success(), "{:?}", out.status);
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect()
}
