//! `rlsync bench_sync`: the weight-sync benchmark entry point.
//!
//! A synthetic model (`bench.params` elements in `bench.tensors` tensors of a realistic shape mix) is updated
//! every step by the update generator (`adam`: fp32 master + Adam-like step at `adam_lr`, cast to
//! `bench.dtype`; `density`: a fixed share of random elements), then synced with the configured
//! `weight_syncer` to `bench.receivers` receivers. Receivers run as threads of this process (each with its own
//! runtime) over the selected transport. Every step checks receiver checksum == sender checksum.

mod report;

use std::num::NonZeroUsize;
use std::time::{Duration, Instant};

use crate::config::schema::{ReceiverMemory, RunConfig, TransportKind, UpdateKind};
use rlsync_core::syncer::{SyncError, SyncOptions, SyncReport, WeightSyncer};
use rlsync_core::tensor::parallel::{map_items, resolve_threads};
use rlsync_core::tensor::synthetic::{ModelSpec, SyntheticError, SyntheticModel, UpdateMode};
use rlsync_core::tensor::{DType, StateDict, Storage, Tensor};
use rlsync_core::transport;

pub use report::{BenchSummary, StepRecord};

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("bench config: {reason}")]
    Config { reason: String },
    #[error(transparent)]
    Synthetic(#[from] SyntheticError),
    #[error(transparent)]
    Sync(#[from] SyncError),
    #[error("receiver {rank}: {reason}")]
    Receiver { rank: usize, reason: String },
    #[error("runtime")]
    Runtime(#[from] std::io::Error),
}

/// What a receiver thread reports per step.
struct RxStep {
    report: SyncReport,
    done: Instant,
    checksum: u64,
}

/// Run the benchmark, print per-step lines and the summary (JSON lines or a table), return the summary.
pub fn run(cfg: &RunConfig) -> Result<BenchSummary, BenchError> {
    let b = &cfg.bench;
    let dtype = DType::from(b.dtype);
    let threads = resolve_threads(b.threads as usize);
    let receivers = b.receivers.get() as usize;
    let mode = match b.update {
        UpdateKind::Adam => UpdateMode::Adam { lr: b.adam_lr },
        UpdateKind::Density => UpdateMode::Density { density: b.density },
    };
    let spec = ModelSpec {
        params: b.params,
        tensors: b.tensors.get(),
        dtype,
        frozen_fraction: b.frozen_fraction,
        seed: b.seed,
    };
    let mut model = SyntheticModel::new(spec)?;
    let mut sender_state = model.state_dict()?;
    let synced = sender_state.synced_keys();
    let synced_elems: u64 = synced
        .iter()
        .filter_map(|k| sender_state.get(k))
        .map(|t| t.numel() as u64)
        .sum();
    let opts = SyncOptions {
        threads: threads.get(),
    };
    let sender = WeightSyncer::from_config(&cfg.weight_syncer, opts)?;
    let steps = b.steps.get() as u64;

    let (tx_link, rx_links) = links(b.transport, receivers);
    let (res_tx, res_rx) = std::sync::mpsc::channel::<(usize, Result<RxStep, String>)>();
    let mut handles = Vec::with_capacity(receivers);
    for (rank, ch) in rx_links.into_iter().enumerate() {
        let mut owner = model.state_dict()?;
        let syncer = WeightSyncer::from_config(&cfg.weight_syncer, opts)?;
        let out = res_tx.clone();
        let memory = b.receiver_memory;
        handles.push(
            std::thread::Builder::new()
                .name(format!("bench-rx{rank}"))
                .spawn(move || match memory {
                    ReceiverMemory::Owned => receiver_loop(syncer, owner, ch, steps, rank, out),
                    ReceiverMemory::Borrowed => match borrow_all(&mut owner) {
                        // The borrowed state is dropped inside receiver_loop, before its owner here.
                        Ok(state) => receiver_loop(syncer, state, ch, steps, rank, out),
                        Err(e) => {
                            let _ = out.send((rank, Err(rlsync_core::error_chain(&e))));
                        }
                    },
                })?,
        );
    }
    drop(res_tx);

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let fmt = report::Printer::new(b.format);
    let mut records = Vec::with_capacity(steps as usize);
    // The memory floors and the sync kernels' threads (`bench.threads`, fewer for a small state: the sender
    // says), the floors measured on as many, between the bootstrap and the first step.
    let result: Result<(Floors, NonZeroUsize), BenchError> = rt.block_on(async {
        let tx_ch = match tx_link {
            TxLink::Ready(ch) => ch,
            TxLink::Shm(cfg) => transport::ShmSender::bind(cfg)
                .await
                .map_err(SyncError::from)?,
        };
        let (mut sender, _) = sender.init_sender(&sender_state, &synced, tx_ch).await?;
        // Receivers report their init (bootstrap) as step 0.
        collect(&res_rx, receivers)?;
        let kernel_threads = sender.threads();
        let floors = memory_floors(&sender_state, &synced, kernel_threads);
        for step in 1..=steps {
            let changed = model.step(mode, &mut sender_state, threads)?;
            let t0 = Instant::now();
            let sent = sender.sync(&sender_state, step).await?;
            let rx = collect(&res_rx, receivers)?;
            let done = rx.iter().map(|r| r.done).max().unwrap_or_else(Instant::now);
            let want = sender.checksum(&sender_state)?;
            let verified = rx
                .iter()
                .all(|r| r.checksum == want && r.report.version == step);
            let worst = |f: fn(&SyncReport) -> Duration| {
                rx.iter().map(|r| f(&r.report)).max().unwrap_or_default()
            };
            let rec = StepRecord {
                step,
                changed,
                payload_bytes: sent.payload_bytes,
                build: sent.build,
                encode: sent.encode,
                transfer: sent.transfer,
                decode: worst(|r| r.decode),
                apply: worst(|r| r.apply),
                total: done.saturating_duration_since(t0),
                verified,
                state_bytes: sent.state_bytes,
            };
            fmt.step(&rec);
            records.push(rec);
        }
        Ok((floors, kernel_threads))
    });
    // The sending end went with the block, so every receiver thread ends.
    for h in handles {
        let _ = h.join();
    }
    let (floors, kernel_threads) = result?;
    let summary = BenchSummary::from_steps(
        &records,
        report::RunFacts {
            syncer: cfg.weight_syncer.kind,
            params: b.params,
            dtype,
            synced_elems,
            memcpy_ms: floors.memcpy_ms,
            scan_ms: floors.scan_ms,
            threads: kernel_threads.get(),
            receivers,
            transport: b.transport,
            update: b.update,
        },
    );
    fmt.summary(&summary);
    Ok(summary)
}

/// How the sender gets its channel (shm: bound inside the sender's runtime while receivers connect).
// One per benchmark, moved once into the sender's thread: boxing the large variant would buy nothing.
#[allow(clippy::large_enum_variant)]
enum TxLink {
    Ready(transport::Sender),
    Shm(transport::ShmConfig),
}

/// How a receiver thread gets its channel.
enum RxLink {
    Ready(transport::Receiver),
    Shm {
        socket: std::path::PathBuf,
        rank: usize,
    },
}

fn links(kind: TransportKind, receivers: usize) -> (TxLink, Vec<RxLink>) {
    match kind {
        TransportKind::Inproc => {
            let (tx, rxs) = transport::inproc_channel(receivers);
            (
                TxLink::Ready(tx),
                rxs.into_iter().map(RxLink::Ready).collect(),
            )
        }
        TransportKind::Shm => {
            let socket =
                std::env::temp_dir().join(format!("rlsync-bench-{}.sock", std::process::id()));
            let cfg = transport::ShmConfig {
                socket_path: socket.clone(),
                segment_prefix: "rlsync-bench".into(),
                receivers,
                ..Default::default()
            };
            (
                TxLink::Shm(cfg),
                (0..receivers)
                    .map(|rank| RxLink::Shm {
                        socket: socket.clone(),
                        rank,
                    })
                    .collect(),
            )
        }
    }
}

/// A state dict over `owner`'s memory, which the receiver then does not own (`bench.receiver_memory=borrowed`):
/// what a Python or tch rollout's tensors are to the syncer, so a bucket is copied in rather than swapped.
fn borrow_all(owner: &mut StateDict) -> Result<StateDict, rlsync_core::tensor::TensorError> {
    let mut state = StateDict::new();
    for (name, t) in owner.iter_mut() {
        let (layout, class) = (t.layout().clone(), t.class());
        let bytes = t.bytes_mut();
        // SAFETY: the owner outlives the borrowed state (both live in the receiver's thread, the borrowed one
        // dropped first) and is not touched while it lives; its storages never move or resize.
        let storage = unsafe { Storage::borrowed(bytes.as_mut_ptr(), bytes.len()) };
        state.insert(name, Tensor::from_storage(layout, storage, class)?);
    }
    Ok(state)
}

fn receiver_loop(
    syncer: WeightSyncer,
    mut state: StateDict,
    link: RxLink,
    steps: u64,
    rank: usize,
    out: std::sync::mpsc::Sender<(usize, Result<RxStep, String>)>,
) {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            let _ = out.send((rank, Err(rlsync_core::error_chain(&e))));
            return;
        }
    };
    rt.block_on(async {
        let ch = match link {
            RxLink::Ready(ch) => ch,
            RxLink::Shm { socket, rank } => {
                match transport::ShmReceiver::connect(&socket, rank, transport::DEFAULT_TIMEOUT)
                    .await
                {
                    Ok(ch) => ch,
                    Err(e) => {
                        let _ = out.send((rank, Err(rlsync_core::error_chain(&e))));
                        return;
                    }
                }
            }
        };
        let mut syncer = match syncer.init_receiver(&mut state, ch).await {
            Ok((syncer, report)) => {
                let _ = out.send((
                    rank,
                    Ok(RxStep {
                        report,
                        done: Instant::now(),
                        checksum: 0,
                    }),
                ));
                syncer
            }
            Err(e) => {
                let _ = out.send((rank, Err(rlsync_core::error_chain(&e))));
                return;
            }
        };
        for _ in 0..steps {
            let r = syncer.apply(&mut state).await;
            let done = Instant::now();
            let msg = r
                .map_err(|e| rlsync_core::error_chain(&e))
                .map(|report| RxStep {
                    report,
                    done,
                    checksum: syncer.checksum(&state),
                });
            let failed = msg.is_err();
            let _ = out.send((rank, msg));
            if failed {
                return;
            }
        }
    });
}

fn collect(
    rx: &std::sync::mpsc::Receiver<(usize, Result<RxStep, String>)>,
    n: usize,
) -> Result<Vec<RxStep>, BenchError> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let (rank, r) = rx.recv().map_err(|_| BenchError::Receiver {
            rank: usize::MAX,
            reason: "receiver threads ended early".into(),
        })?;
        out.push(r.map_err(|reason| BenchError::Receiver { rank, reason })?);
    }
    Ok(out)
}

/// The host's memory figures for this state, as medians of three passes after a warm-up: a plain copy of the
/// synced bytes into a warm buffer (one thread), and one read of those bytes and of that copy compared word by
/// word on `threads` threads — the traffic a patch build cannot avoid (it must read the state and a snapshot of
/// it to find what changed), so no build on this host is faster than the scan.
fn memory_floors(state: &StateDict, keys: &[String], threads: NonZeroUsize) -> Floors {
    let tensors: Vec<&[u8]> = keys
        .iter()
        .filter_map(|k| state.get(k))
        .map(|t| t.bytes())
        .collect();
    let total: usize = tensors.iter().map(|t| t.len()).sum();
    let mut dst = vec![0u8; total];
    let mut copies = Vec::new();
    for _ in 0..4 {
        let t0 = Instant::now();
        let mut off = 0;
        for t in &tensors {
            dst[off..off + t.len()].copy_from_slice(t);
            off += t.len();
        }
        copies.push(t0.elapsed().as_secs_f64() * 1e3);
        std::hint::black_box(&dst);
    }
    copies.remove(0); // first pass faults the pages in
    // Pieces of at most 16 MiB, so the threads share uneven tensors evenly.
    let mut pieces = Vec::new();
    let mut off = 0;
    for t in &tensors {
        for c in t.chunks(16 << 20) {
            pieces.push((c, &dst[off..off + c.len()]));
            off += c.len();
        }
    }
    let mut scans = Vec::new();
    for _ in 0..4 {
        let t0 = Instant::now();
        let differ = any_difference(pieces.clone(), threads);
        scans.push(t0.elapsed().as_secs_f64() * 1e3);
        std::hint::black_box(differ);
    }
    scans.remove(0);
    Floors {
        memcpy_ms: report::median(&mut copies),
        scan_ms: report::median(&mut scans),
    }
}

/// Whether any pair of equally long byte slices differs, read on `threads` threads (every byte is read: the
/// reduction has no early exit, as a diff has none).
fn any_difference(pieces: Vec<(&[u8], &[u8])>, threads: NonZeroUsize) -> bool {
    map_items(pieces, threads, |(a, b)| {
        a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y))
    })
    .into_iter()
    .any(|d| d != 0)
}

struct Floors {
    memcpy_ms: f64,
    scan_ms: f64,
}

#[cfg(test)]
mod tests {
    use std::num::{NonZeroU32, NonZeroU64};

    use super::*;
    use crate::config::schema::{OutputFormat, SyncerKind};

    fn bench(kind: SyncerKind, memory: ReceiverMemory, load_instant: bool) -> BenchSummary {
        let mut cfg = RunConfig::default();
        cfg.weight_syncer.kind = kind;
        // Several buckets per version: the ones before the last are swapped in (an undo may need them), the
        // last is copied in.
        cfg.weight_syncer.bucket.bucket_size = NonZeroU64::new(64 << 10).unwrap();
        cfg.weight_syncer.bucket.load_instant = load_instant;
        cfg.bench.params = 1 << 18;
        cfg.bench.tensors = NonZeroU32::new(16).unwrap();
        cfg.bench.steps = NonZeroU32::new(3).unwrap();
        cfg.bench.receivers = NonZeroU32::new(2).unwrap();
        cfg.bench.receiver_memory = memory;
        cfg.bench.threads = 2;
        cfg.bench.format = OutputFormat::Json;
        run(&cfg).unwrap()
    }

    #[test]
    fn the_scan_floor_reads_every_byte_of_both_sides() {
        let a: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let mut b = a.clone();
        let pieces = |a: &[u8], b: &[u8]| -> Vec<(Vec<u8>, Vec<u8>)> {
            a.chunks(7_000)
                .zip(b.chunks(7_000))
                .map(|(x, y)| (x.to_vec(), y.to_vec()))
                .collect()
        };
        for threads in [1, 3] {
            let t = NonZeroUsize::new(threads).unwrap();
            let same = pieces(&a, &b);
            assert!(!any_difference(
                same.iter().map(|(x, y)| (&x[..], &y[..])).collect(),
                t
            ));
            for at in [0, 6_999, 50_000, 99_999] {
                b[at] ^= 0x10;
                let one = pieces(&a, &b);
                assert!(
                    any_difference(one.iter().map(|(x, y)| (&x[..], &y[..])).collect(), t),
                    "a flipped bit at {at} with {threads} threads"
                );
                b[at] ^= 0x10;
            }
        }
    }

    #[test]
    fn receivers_over_borrowed_memory_reach_the_senders_weights_every_step() {
        for kind in [SyncerKind::Patch, SyncerKind::Bucket] {
            for load_instant in [true, false] {
                for memory in [ReceiverMemory::Owned, ReceiverMemory::Borrowed] {
                    let s = bench(kind, memory, load_instant);
                    assert!(
                        s.verified && s.steps == 3,
                        "{kind:?} {memory:?} load_instant={load_instant}: {s:?}"
                    );
                }
            }
        }
    }
}
