//! Host storage for model-sized buffers (a patch sender's snapshot, staging, received versions): a
//! `Storage::zeroed` then written whole, against the allocator's 64-byte-aligned zeroed allocation it used
//! before (which memsets the buffer first: two passes over fresh pages instead of one).
//!
//! `cargo bench --bench storage` (default 256 MiB; `RLSYNC_BENCH_BYTES` sets the size). Every figure is the
//! wall time of one allocation, its whole write and its free, as a snapshot's creation does it.

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use rlsync_core::tensor::Storage;

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
    // The previous `Storage::zeroed`: 64-byte-aligned cache lines from the allocator's zeroed path.
    let layout = std::alloc::Layout::from_size_align(bytes.next_multiple_of(64), 64)
        .expect("a layout of RLSYNC_BENCH_BYTES");
    g.bench_function("aligned_alloc_zeroed_then_written", |b| {
        b.iter(|| {
            // SAFETY: a non-zero layout; the allocation is written within its size and freed with it.
            unsafe {
                let ptr = std::alloc::alloc_zeroed(layout);
                assert!(!ptr.is_null(), "out of memory");
                let view = std::slice::from_raw_parts_mut(ptr, bytes);
                view.copy_from_slice(&src);
                black_box(view[bytes - 1]);
                std::alloc::dealloc(ptr, layout);
            }
        })
    });
    g.finish();
}

criterion_group!(benches, storage);
criterion_main!(benches);
