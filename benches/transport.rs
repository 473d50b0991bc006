//! Broadcast throughput of 256 MiB over shm (1 and 2 receivers, whole or in 32 MiB payloads) and inproc, vs memcpy;
//! and the per-side copy kernels of a bucket sync (copy + xxh3 of 256 MiB: plain vs hash-then-stream-copy).
//!
//! Each payload is filled by a memcpy from a source buffer straight into the shared slot, and every receiver
//! copies it out into its own buffer (what a bucket install does), so a transport adding nothing would cost
//! about one memcpy per side; the two sides overlap thanks to the double-buffered slots. Receivers are
//! threads with their own runtime, talking to the sender over the real socket and segments.

use std::hint::black_box;
use std::path::Path;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use rlsync_core::transport::shm::{ShmConfig, ShmReceiver, ShmSender};
use rlsync_core::transport::{Receiver, Sender, TransportError, inproc_channel};

const PAYLOAD: usize = 256 << 20;
const TIMEOUT: Duration = Duration::from_secs(600);

fn filled(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31)).collect()
}

/// Copy every payload out until the sender goes away; waiting between criterion samples is fine.
async fn copy_out(mut rx: Receiver) {
    let mut dst = vec![0u8; PAYLOAD];
    loop {
        match rx
            .recv_with(|bytes| dst[..bytes.len()].copy_from_slice(bytes))
            .await
        {
            Ok(()) => {}
            Err(TransportError::Timeout { .. }) => continue,
            Err(_) => break,
        }
        black_box(&dst);
    }
}

/// A receiver thread with its own runtime; `connect` runs on it, since sockets belong to the runtime that made them.
fn spawn_receiver<F>(connect: F) -> JoinHandle<()>
where
    F: Future<Output = Receiver> + Send + 'static,
{
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("receiver runtime");
        rt.block_on(async move { copy_out(connect.await).await });
    })
}

fn shm_channel(
    runtime: &tokio::runtime::Runtime,
    dir: &Path,
    receivers: usize,
) -> (Sender, Vec<JoinHandle<()>>) {
    let socket = dir.join("bench.sock");
    let cfg = ShmConfig {
        socket_path: socket.clone(),
        segment_prefix: format!("rlsync-bench-{}", std::process::id()),
        receivers,
        timeout: TIMEOUT,
        ..ShmConfig::default()
    };
    let threads = (0..receivers)
        .map(|rank| {
            let socket = socket.clone();
            spawn_receiver(async move {
                ShmReceiver::connect(&socket, rank, TIMEOUT)
                    .await
                    .expect("connect")
            })
        })
        .collect();
    let tx = runtime.block_on(ShmSender::bind(cfg)).expect("bind");
    (tx, threads)
}

/// Time `iters` rounds of sending all of `src` as payloads of `chunk` bytes, from first fill to last release.
fn stream(
    runtime: &tokio::runtime::Runtime,
    tx: &mut Sender,
    src: &[u8],
    chunk: usize,
    iters: u64,
) -> Duration {
    runtime.block_on(async {
        let start = Instant::now();
        for _ in 0..iters {
            for part in src.chunks(chunk) {
                tx.send_with(part.len(), |buf| buf.copy_from_slice(part))
                    .await
                    .expect("send");
            }
        }
        tx.flush().await.expect("flush");
        start.elapsed()
    })
}

fn broadcast(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let dir = tempfile::tempdir().expect("tempdir");
    let src = filled(PAYLOAD);
    let mut group = c.benchmark_group("broadcast_256MiB");
    group
        .throughput(Throughput::Bytes(PAYLOAD as u64))
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1));
    group.measurement_time(Duration::from_secs(8));

    let mut dst = vec![0u8; PAYLOAD];
    group.bench_function("memcpy", |b| {
        b.iter(|| {
            dst.copy_from_slice(&src);
            black_box(&dst);
        })
    });
    drop(dst);

    // One 256 MiB payload per iteration (fill and copy-out cannot overlap), then the same bytes as 8 payloads
    // of 32 MiB (as a bucket sync sends them: the next fill overlaps the previous copy-out).
    for (receivers, chunk, name) in [
        (1, PAYLOAD, "shm_1rx"),
        (2, PAYLOAD, "shm_2rx"),
        (1, PAYLOAD / 8, "shm_1rx_8x32MiB"),
    ] {
        let (mut tx, threads) = shm_channel(&runtime, dir.path(), receivers);
        group.bench_function(name, |b| {
            b.iter_custom(|iters| stream(&runtime, &mut tx, &src, chunk, iters))
        });
        drop(tx);
        threads
            .into_iter()
            .for_each(|t| t.join().expect("receiver thread"));
    }

    let (mut tx, rxs) = inproc_channel(1);
    let threads: Vec<_> = rxs
        .into_iter()
        .map(|rx| spawn_receiver(async move { rx }))
        .collect();
    group.bench_function("inproc_1rx", |b| {
        b.iter_custom(|iters| stream(&runtime, &mut tx, &src, PAYLOAD, iters))
    });
    drop(tx);
    threads
        .into_iter()
        .for_each(|t| t.join().expect("receiver thread"));
    group.finish();
}

/// What one side of a bucket sync does per byte: copy it and hash it, in cache-sized chunks. The old kernel
/// copied with ordinary stores and hashed the destination; the current one hashes the source chunk (pulling
/// it into cache) and then copies it with streaming stores (no read-for-ownership of the destination).
fn copy_kernels(c: &mut Criterion) {
    use xxhash_rust::xxh3::Xxh3;
    const CHUNK: usize = 64 << 10;
    let src = filled(PAYLOAD);
    // Destination at page offset 2048 + 48, like a payload body in a shm slot.
    let mut buf = vec![0u8; PAYLOAD + 8192];
    let off = buf.as_ptr().align_offset(4096) + 2048 + 48;
    let mut group = c.benchmark_group("copy_hash_256MiB");
    group
        .throughput(Throughput::Bytes(PAYLOAD as u64))
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1));
    group.bench_function("memcpy", |b| {
        b.iter(|| {
            buf[off..off + PAYLOAD].copy_from_slice(&src);
            black_box(&buf);
        })
    });
    group.bench_function("copy_then_hash_dst", |b| {
        b.iter(|| {
            let mut h = Xxh3::new();
            for (s, d) in src
                .chunks(CHUNK)
                .zip(buf[off..off + PAYLOAD].chunks_mut(CHUNK))
            {
                d.copy_from_slice(s);
                h.update(d);
            }
            black_box(h.digest())
        })
    });
    group.bench_function("hash_src_then_stream_copy", |b| {
        b.iter(|| {
            let mut h = Xxh3::new();
            for (s, d) in src
                .chunks(CHUNK)
                .zip(buf[off..off + PAYLOAD].chunks_mut(CHUNK))
            {
                h.update(s);
                rlsync_core::tensor::copy_streaming(d, s).expect("equal lengths");
            }
            black_box(h.digest())
        })
    });
    group.finish();
}

criterion_group!(benches, copy_kernels, broadcast);
criterion_main!(benches);
