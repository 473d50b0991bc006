//! State checksum speed (what the replay log, rejoins, `checksum()` and checkpoints compute): the chunked
//! checksum on one thread and on all, against the single-stream checksum it replaced, on a bf16 state.
//!
//! `cargo bench --bench checksum` (default 2^28 elements = 512 MiB in 64 tensors; `RLSYNC_BENCH_PARAMS` sets the
//! element count). Every figure is wall time of one whole-state checksum.

use std::hint::black_box;
use std::num::NonZeroUsize;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use rlsync_core::tensor::synthetic::{ModelSpec, SyntheticModel};
use rlsync_core::tensor::{DType, state_checksum, state_checksum_threads, state_checksum_v1};

fn checksums(c: &mut Criterion) {
    let params = std::env::var("RLSYNC_BENCH_PARAMS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1u64 << 28);
    let m = SyntheticModel::new(ModelSpec {
        params,
        tensors: 64,
        dtype: DType::Bf16,
        frozen_fraction: 0.0,
        seed: 1,
    })
    .expect("a synthetic model of RLSYNC_BENCH_PARAMS elements");
    let state = m.state_dict().expect("its state dict");
    let keys: Vec<String> = state.keys().map(str::to_owned).collect();
    let bytes: usize = state.iter().map(|(_, t)| t.bytes().len()).sum();
    let all = std::thread::available_parallelism().unwrap_or(NonZeroUsize::MIN);
    // The values agree however they are computed (what the bench measures is the same function).
    assert_eq!(
        state_checksum(&state, &keys),
        state_checksum_threads(&state, &keys, NonZeroUsize::MIN)
    );
    let mut g = c.benchmark_group("checksum");
    g.throughput(Throughput::Bytes(bytes as u64));
    g.sample_size(10);
    g.bench_function("single_stream_v1", |b| {
        b.iter(|| black_box(state_checksum_v1(&state, &keys)))
    });
    g.bench_function("chunked_1thread", |b| {
        b.iter(|| black_box(state_checksum_threads(&state, &keys, NonZeroUsize::MIN)))
    });
    g.bench_function(format!("chunked_{all}threads"), |b| {
        b.iter(|| black_box(state_checksum(&state, &keys)))
    });
    g.finish();
}

criterion_group!(benches, checksums);
criterion_main!(benches);
