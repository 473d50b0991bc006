//! Rejoin cost: bytes and time for a receiver that missed k versions to catch up by patch replay, against the
//! k patch payloads it missed and against a full transfer, on a bf16 state updated by Adam at lr 1e-6.
//!
//! `cargo bench --bench rejoin` (defaults: 2^28 = 268 M elements, k = 1 2 4 8). Environment:
//! `RLSYNC_REJOIN_PARAMS` (elements), `RLSYNC_REJOIN_K` (space-separated k values), `RLSYNC_REJOIN_THREADS`.
//! Every catch-up is verified: the receiver's checksum equals the sender's. Not a criterion bench: one
//! measurement per k is the figure (bytes are exact; times are indicative on a shared machine).

use std::num::NonZeroUsize;
use std::time::{Duration, Instant};

use rlsync::config::schema::{SyncerKind, WeightSyncerConfig};
use rlsync_core::syncer::{CatchUpKind, SyncOptions, WeightSyncer};
use rlsync_core::tensor::synthetic::{ModelSpec, SyntheticModel, UpdateMode};
use rlsync_core::tensor::{DType, StateDict};
use rlsync_core::transport::inproc_channel_elastic;

fn env<T: std::str::FromStr>(key: &str, default: T) -> T {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` runs this with no flag: keep that run tiny.
    let benching = std::env::args().any(|a| a == "--bench");
    let params: u64 = env(
        "RLSYNC_REJOIN_PARAMS",
        if benching { 1 << 28 } else { 1 << 16 },
    );
    let ks: Vec<u64> = std::env::var("RLSYNC_REJOIN_K")
        .unwrap_or_else(|_| "1 2 4 8".into())
        .split_whitespace()
        .filter_map(|k| k.parse().ok())
        .collect();
    let threads: usize = env("RLSYNC_REJOIN_THREADS", 0);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(run(params, &ks, threads));
}

async fn run(params: u64, ks: &[u64], threads: usize) {
    let mut model = SyntheticModel::new(ModelSpec {
        params,
        tensors: 128,
        dtype: DType::Bf16,
        frozen_fraction: 0.0,
        seed: 1,
    })
    .expect("model");
    let mut sender = model.state_dict().expect("state");
    let mut receiver = sender.duplicate();
    let step_threads =
        NonZeroUsize::new(std::thread::available_parallelism().map_or(2, |n| n.get()))
            .unwrap_or(NonZeroUsize::MIN);
    let mut step = |state: &mut StateDict| {
        model
            .step(UpdateMode::Adam { lr: 1e-6 }, state, step_threads)
            .expect("step")
    };
    let mut cfg = WeightSyncerConfig {
        kind: SyncerKind::Patch,
        ..WeightSyncerConfig::default()
    };
    cfg.patch.replay_versions = ks.iter().copied().max().unwrap_or(1) as u32;
    cfg.patch.replay_max_bytes = u64::MAX;
    let opts = SyncOptions { threads };
    let tx = WeightSyncer::from_config(&cfg, opts).expect("syncer");
    let (ch, mut rxs, joiner) = inproc_channel_elastic(1, Duration::from_secs(600));
    let keys = sender.synced_keys();
    let rx = WeightSyncer::from_config(&cfg, opts).expect("syncer");
    let rch = rxs.pop().expect("receiver");
    let (a, b) = tokio::join!(
        tx.init_sender(&sender, &keys, ch),
        rx.init_receiver(&mut receiver, rch)
    );
    let (mut tx, init) = a.expect("init sender");
    let (mut rx, _) = b.expect("init receiver");
    let full_bytes = init.state_bytes;
    // Warm the optimizer up so the changed fraction is the steady-state one.
    for _ in 0..3 {
        step(&mut sender);
    }
    let mut version = 1;
    let (a, b) = tokio::join!(tx.sync(&sender, version), rx.apply(&mut receiver));
    a.expect("sync");
    b.expect("apply");
    println!(
        "rejoin after k missed versions: {params} bf16 elements ({} MiB), Adam lr 1e-6, patch syncer",
        full_bytes >> 20
    );
    println!(
        "{:>3} {:>14} {:>14} {:>9} {:>10} {:>8} {:>12}",
        "k", "missed_bytes", "catchup_bytes", "overhead", "vs_full", "kind", "catchup_ms"
    );
    for &k in ks {
        // The receiver leaves holding `version`; k versions go by without it.
        drop(rx);
        let held = version;
        let mut missed = 0u64;
        for _ in 0..k {
            step(&mut sender);
            version += 1;
            missed += tx.sync(&sender, version).await.expect("sync").payload_bytes;
        }
        let syncer = WeightSyncer::from_config(&cfg, opts).expect("syncer");
        let rch = joiner.join(0).expect("join");
        let t0 = Instant::now();
        let (a, b) = tokio::join!(
            tx.rejoin(&sender, 0),
            syncer.rejoin_receiver(&mut receiver, rch, held)
        );
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        let a = a.expect("rejoin sender");
        let (caught_up, b) = b.expect("rejoin receiver");
        rx = caught_up;
        assert_eq!(a.kind, CatchUpKind::Replay, "{}", a.reason);
        assert_eq!(b.to, version);
        assert_eq!(
            rx.checksum(&receiver),
            tx.checksum(&sender).expect("checksum"),
            "caught up bitwise"
        );
        println!(
            "{k:>3} {missed:>14} {:>14} {:>8.4}% {:>9.2}% {:>8} {ms:>12.1}",
            b.payload_bytes,
            (b.payload_bytes as f64 / missed.max(1) as f64 - 1.0) * 100.0,
            b.payload_bytes as f64 / full_bytes as f64 * 100.0,
            b.kind.name(),
        );
    }
    // For comparison: a worker whose weights are unknown (fresh start) takes the full state.
    drop(rx);
    let mut fresh = SyntheticModel::new(ModelSpec {
        params,
        tensors: 128,
        dtype: DType::Bf16,
        frozen_fraction: 0.0,
        seed: 2,
    })
    .expect("model")
    .state_dict()
    .expect("state");
    let rx = WeightSyncer::from_config(&cfg, opts).expect("syncer");
    let rch = joiner.join(0).expect("join");
    let t0 = Instant::now();
    let (a, b) = tokio::join!(
        tx.rejoin(&sender, 0),
        rx.rejoin_receiver(&mut fresh, rch, 0)
    );
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    let (a, (rx, b)) = (a.expect("rejoin sender"), b.expect("rejoin receiver"));
    assert_eq!(a.kind, CatchUpKind::Full);
    assert_eq!(rx.checksum(&fresh), tx.checksum(&sender).expect("checksum"));
    println!(
        "fresh {:>26} {:>9} {:>9.2}% {:>8} {ms:>12.1}   ({})",
        b.payload_bytes,
        "",
        b.payload_bytes as f64 / full_bytes as f64 * 100.0,
        b.kind.name(),
        a.reason
    );
}
