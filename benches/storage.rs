//! Host storage for model-sized buffers (a patch sender's snapshot, staging, received versions): a
//! `Storage::zeroed` then written whole, against the allocator's 64-byte-aligned zeroed allocation it used
//! before (which memsets the buffer first: two passes over fresh pages instead of one).
//!
//! `cargo bench --bench storage` (default 256 MiB; `RLSYNC_BENCH_BYTES` sets the size). Every figure is the
//! wall time of one allocation, its whole write and its free, as a snapshot's creation does it.

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use rlsync_core::tensor::Storage;

/// The previous `Storage::zeroed`: cache lines from the allocator's zeroed path.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([u64; 8]);

fn storage(c: &mut Criterion) {
    let bytes: usize = std::env::var("RLSYNC_BENCH_BYTES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256 << 20);
    let src = vec![0x5au8; bytes];
    let mut g = c.benchmark_group("storage");
    g.throughput(Throughput::Bytes(bytes as u64));
    g.sample_size(20);
    g.bench_function("zeroed_then_written", |b| {
        b.iter(|| {
            let mut s = Storage::zeroed(bytes);
            s.bytes_mut().copy_from_slice(&src);
            black_box(s.bytes()[bytes - 1]);
        })
    });
    g.bench_function("aligned_alloc_zeroed_then_written", |b| {
        b.iter(|| {
            let mut v = vec![Line([0; 8]); bytes.div_ceil(64)];
            // SAFETY: `Line` is 64 plain bytes; the Vec holds at least `bytes` of them.
            let view =
                unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), bytes) };
            view.copy_from_slice(&src);
            black_box(view[bytes - 1]);
        })
    });
    g.finish();
}

criterion_group!(benches, storage);
criterion_main!(benches);
