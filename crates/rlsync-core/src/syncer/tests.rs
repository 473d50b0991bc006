//! Property and end-to-end tests of the weight syncer over the in-process transport.

use std::num::NonZeroU64;

use proptest::prelude::*;
use proptest::strategy::Strategy;

use super::*;
use crate::syncer::settings::{FloatDtype, WeightSyncerConfig};
use crate::tensor::{Class, Tensor};
use crate::transport::inproc_channel_with_timeout;
use crate::transport::tap::{Tap, tapped};

fn inproc_channel(n: usize) -> (transport::Sender, Vec<transport::Receiver>) {
    inproc_channel_with_timeout(n, std::time::Duration::from_secs(5))
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn cast_copy(t: &Tensor, to: DType) -> Vec<u8> {
    let mut out = Storage::zeroed(t.numel() * to.size_bytes());
    cast_bytes(t.bytes(), t.dtype(), out.bytes_mut(), to).unwrap();
    out.bytes().to_vec()
}

/// One key of a generated model: sender dtype, receiver dtype, shape, class.
#[derive(Debug, Clone)]
struct KeySpec {
    name: String,
    tx: DType,
    rx: DType,
    shape: Vec<usize>,
    class: Class,
}

fn key_spec(i: usize) -> impl Strategy<Value = KeySpec> {
    (
        0..DType::ALL.len(),
        0..4usize,
        prop::collection::vec(0..5usize, 0..=4),
        0..3u8,
        any::<bool>(),
    )
        .prop_map(move |(d, rxd, shape, class, nested)| {
            let tx = DType::ALL[d];
            let floats = [DType::Bf16, DType::F16, DType::F32, DType::F64];
            let rx = if tx.is_floating() { floats[rxd] } else { tx };
            let class = match class {
                0 => Class::Frozen,
                1 => Class::Buffer,
                _ => Class::Trainable,
            };
            let name = if nested {
                format!("block{}.sub.t{i}", i % 2)
            } else {
                format!("t{i}")
            };
            KeySpec {
                name,
                tx,
                rx,
                shape,
                class,
            }
        })
}

fn model() -> impl Strategy<Value = Vec<KeySpec>> {
    (1..7usize).prop_flat_map(|n| (0..n).map(key_spec).collect::<Vec<_>>())
}

/// Fill a tensor with random bytes from a seed (NaNs, -0.0 and odd bools included).
fn random_bytes(t: &mut Tensor, seed: u64) {
    let mut x = seed | 1;
    for b in t.bytes_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
}

fn build_state(keys: &[KeySpec], receiver: bool, seed: u64) -> StateDict {
    let mut sd = StateDict::new();
    for (i, k) in keys.iter().enumerate() {
        let mut t = Tensor::zeros(if receiver { k.rx } else { k.tx }, &k.shape, k.class).unwrap();
        random_bytes(&mut t, seed.wrapping_mul(31).wrapping_add(i as u64 + 1));
        sd.insert(k.name.clone(), t);
    }
    sd
}

/// Change a random subset of elements of every non-frozen (and, to prove they are ignored, frozen) tensor.
fn mutate(state: &mut StateDict, seed: u64, density_pct: u64) {
    let mut x = seed | 1;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for (_, t) in state.iter_mut() {
        let w = t.dtype().size_bytes();
        let n = t.numel();
        let bytes = t.bytes_mut();
        for i in 0..n {
            if next() % 100 < density_pct {
                let r = next();
                // Small bit-pattern moves (the common training case) and arbitrary new values.
                if r % 3 == 0 {
                    bytes[i * w] = bytes[i * w].wrapping_add(1);
                } else {
                    for b in &mut bytes[i * w..(i + 1) * w] {
                        *b = next() as u8;
                    }
                }
            }
        }
    }
}

#[derive(Debug, Clone)]
struct Settings {
    bucket: bool,
    delta: bool,
    lz4: bool,
    init_sync: bool,
    prefixes: bool,
    bucket_size: u64,
    bucket_dtype: Option<FloatDtype>,
    load_instant: bool,
    threads: usize,
}

fn settings() -> impl Strategy<Value = Settings> {
    (
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        prop_oneof![1..64u64, Just(1u64 << 20)],
        0..4u8,
        any::<bool>(),
        1..3usize,
    )
        .prop_map(
            |(bucket, delta, lz4, init_sync, prefixes, bucket_size, bd, load_instant, threads)| {
                Settings {
                    bucket,
                    delta,
                    lz4,
                    init_sync,
                    prefixes,
                    bucket_size,
                    bucket_dtype: match bd {
                        0 => Some(FloatDtype::Bfloat16),
                        1 => Some(FloatDtype::Float16),
                        2 => Some(FloatDtype::Float32),
                        _ => None,
                    },
                    load_instant,
                    threads,
                }
            },
        )
}

fn config(s: &Settings, keys: &[KeySpec]) -> WeightSyncerConfig {
    let mut c = WeightSyncerConfig {
        kind: if s.bucket {
            SyncerKind::Bucket
        } else {
            SyncerKind::Patch
        },
        ..WeightSyncerConfig::default()
    };
    c.patch.delta_encoding = s.delta;
    c.patch.compression = if s.lz4 {
        Compression::Lz4
    } else {
        Compression::None
    };
    c.patch.init_sync.enabled = s.init_sync;
    c.patch.init_sync.bucket_size = NonZeroU64::new(s.bucket_size).unwrap();
    if s.prefixes {
        let first = keys[0].name.split('.').next().unwrap().to_string();
        c.patch.init_sync.prefixes = Some(vec![first]);
    }
    c.bucket.bucket_size = NonZeroU64::new(s.bucket_size).unwrap();
    c.bucket.bucket_dtype = s.bucket_dtype;
    c.bucket.load_instant = s.load_instant;
    c
}

/// The keys the init bootstrap covers under these settings.
fn bootstrapped(s: &Settings, keys: &[KeySpec]) -> Vec<bool> {
    let first = keys[0].name.split('.').next().unwrap().to_string();
    keys.iter()
        .map(|k| {
            !s.bucket
                && s.init_sync
                && (!s.prefixes || k.name == first || k.name.starts_with(&format!("{first}.")))
        })
        .collect()
}

/// What the receiver must hold for `key` after a sync of `sender`.
fn expected(s: &Settings, k: &KeySpec, t: &Tensor) -> Vec<u8> {
    match (s.bucket, s.bucket_dtype) {
        (true, Some(d)) if k.tx.is_floating() => {
            let wire = DType::from(d);
            let mid = Tensor::from_bytes(wire, &k.shape, k.class, &cast_copy(t, wire)).unwrap();
            cast_copy(&mid, k.rx)
        }
        _ => cast_copy(t, k.rx),
    }
}

struct Pair {
    tx: SyncSender,
    rx: SyncReceiver,
    sender: StateDict,
    receiver: StateDict,
    /// Every payload the sender broadcast on its channel (the plan included).
    tap: Tap,
}

fn init_pair(
    rt: &tokio::runtime::Runtime,
    keys: &[KeySpec],
    s: &Settings,
    seed: u64,
) -> Result<Pair, SyncError> {
    init_pair_with(rt, keys, s, seed, &config(s, keys))
}

/// [`init_pair`] with a configuration derived from `s` and then adjusted.
fn init_pair_with(
    rt: &tokio::runtime::Runtime,
    keys: &[KeySpec],
    s: &Settings,
    seed: u64,
    cfg: &WeightSyncerConfig,
) -> Result<Pair, SyncError> {
    let sender = build_state(keys, false, seed);
    let mut receiver = build_state(keys, true, seed ^ 0xABCD);
    // Without a bootstrap of a key, patch assumes the receiver already equals the sender (RLinf's contract).
    let boot = bootstrapped(s, keys);
    if !s.bucket {
        for (k, b) in keys.iter().zip(&boot) {
            if !b {
                let bytes = cast_copy(sender.get(&k.name).unwrap(), k.rx);
                receiver
                    .get_mut(&k.name)
                    .unwrap()
                    .bytes_mut()
                    .copy_from_slice(&bytes);
            }
        }
    }
    let mut tx = WeightSyncer::from_config(cfg, SyncOptions { threads: s.threads })?;
    // Tiny bucket parts, so that tensors and tables straddle several transport messages.
    tx.settings.part_bytes = [16, 40, 64, 1 << 20][(seed % 4) as usize];
    // Small patch parts too, so that a version's patch travels as one part per tensor or a few.
    tx.settings.patch_part_bytes = [1, 256, 4096, 1 << 20][((seed >> 2) % 4) as usize];
    let rx = WeightSyncer::from_config(cfg, SyncOptions { threads: s.threads })?;
    let (ch, mut rxs) = inproc_channel(1);
    let (ch, tap) = tapped(ch);
    let rch = rxs.pop().unwrap();
    let synced = sender.synced_keys();
    let (a, b) = rt.block_on(async {
        tokio::join!(
            tx.init_sender(&sender, &synced, ch),
            rx.init_receiver(&mut receiver, rch)
        )
    });
    let (tx, _) = a?;
    let (rx, _) = b?;
    Ok(Pair {
        tx,
        rx,
        sender,
        receiver,
        tap,
    })
}

fn sync_once(rt: &tokio::runtime::Runtime, p: &mut Pair, version: u64) -> (SyncReport, SyncReport) {
    let (a, b) = rt.block_on(async {
        tokio::join!(p.tx.sync(&p.sender, version), p.rx.apply(&mut p.receiver))
    });
    (a.unwrap(), b.unwrap())
}

fn assert_synced(p: &Pair, keys: &[KeySpec], s: &Settings, frozen_expect: &[(String, Vec<u8>)]) {
    for k in keys {
        let got = p.receiver.get(&k.name).unwrap();
        if k.class.is_synced() {
            assert_eq!(
                got.bytes(),
                expected(s, k, p.sender.get(&k.name).unwrap()).as_slice(),
                "synced key {} ({:?})",
                k.name,
                k
            );
        }
    }
    for (name, bytes) in frozen_expect {
        assert_eq!(
            p.receiver.get(name).unwrap().bytes(),
            bytes.as_slice(),
            "frozen key {name}"
        );
    }
    assert_eq!(
        p.tx.checksum(&p.sender).unwrap(),
        p.rx.checksum(&p.receiver),
        "checksums"
    );
}

/// Frozen keys' expected receiver bytes right after init (bootstrapped → sender's cast, else untouched).
fn frozen_after_init(p: &Pair, keys: &[KeySpec], s: &Settings) -> Vec<(String, Vec<u8>)> {
    let boot = bootstrapped(s, keys);
    keys.iter()
        .zip(boot)
        .filter(|(k, _)| !k.class.is_synced())
        .map(|(k, b)| {
            let bytes = if b {
                cast_copy(p.sender.get(&k.name).unwrap(), k.rx)
            } else {
                p.receiver.get(&k.name).unwrap().bytes().to_vec()
            };
            (k.name.clone(), bytes)
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, .. ProptestConfig::default() })]

    #[test]
    fn receiver_is_bit_identical_after_every_sync(keys in model(), s in settings(), seed in any::<u64>(), steps in 1..4usize, density in 0..60u64) {
        let rt = rt();
        let mut p = init_pair(&rt, &keys, &s, seed).unwrap();
        let frozen = frozen_after_init(&p, &keys, &s);
        if !s.bucket {
            // After init (before any sync), the patch receiver already holds the snapshot.
            assert_synced(&p, &keys, &s, &frozen);
        }
        for v in 1..=steps as u64 {
            mutate(&mut p.sender, seed.wrapping_add(v), density);
            let (sent, applied) = sync_once(&rt, &mut p, v * 2);
            prop_assert_eq!(applied.version, v * 2);
            prop_assert_eq!(p.rx.version(), v * 2);
            prop_assert_eq!(sent.payload_bytes, applied.payload_bytes);
            if !s.bucket && sent.dense_segments == 0 {
                prop_assert_eq!(sent.changed, applied.changed);
            } else if !s.bucket {
                // A dense segment writes every element of it, changed or not.
                prop_assert!(applied.changed >= sent.changed);
            }
            assert_synced(&p, &keys, &s, &frozen);
        }
    }

    #[test]
    fn corrupt_truncated_and_replayed_payloads_are_rejected(keys in model(), s in settings(), seed in any::<u64>(), flip in any::<u64>(), mode in 0..3u8) {
        let rt = rt();
        let mut p = init_pair(&rt, &keys, &s, seed).unwrap();
        sync_once(&rt, &mut p, 1);
        let before: Vec<Vec<u8>> = p.receiver.iter().map(|(_, t)| t.bytes().to_vec()).collect();
        mutate(&mut p.sender, seed ^ 77, 30);
        let good = capture(&rt, &mut p, 2);
        let bad: Vec<Vec<u8>> = match mode {
            0 => {
                // flip one bit of one message (only messages up to it are sent)
                let k = (flip as usize) % good.len();
                let mut m = good[..=k].to_vec();
                let last = m.last_mut().unwrap();
                let pos = (flip as usize / 7) % last.len();
                last[pos] ^= 1 << (flip % 8);
                m
            }
            1 => {
                let k = (flip as usize) % good.len();
                let mut m = good[..=k].to_vec();
                let last = m.last_mut().unwrap();
                let cut = (flip as usize / 7) % last.len();
                last.truncate(cut);
                m
            }
            _ => vec![first_payload(&p.tap)], // the first payload ever sent (init or v1)
        };
        let r = inject_and_apply(&rt, &mut p, &bad);
        prop_assert!(matches!(&r, Err(e) if e.is_rejection()), "accepted: {:?}", r.map(|r| r.version));
        prop_assert_eq!(p.rx.version(), 1);
        let after: Vec<Vec<u8>> = p.receiver.iter().map(|(_, t)| t.bytes().to_vec()).collect();
        prop_assert!(before == after, "state changed by a rejected payload");
        // The genuine payload still applies afterwards (leftovers of the bad version are skipped).
        let r = inject_and_apply(&rt, &mut p, &good).unwrap();
        prop_assert_eq!(r.version, 2);
        let frozen: Vec<(String, Vec<u8>)> = Vec::new();
        assert_synced(&p, &keys, &s, &frozen);
    }
}

/// Produce the payloads of `version` without delivering them (the sender's channel is swapped for a drained one).
fn capture(rt: &tokio::runtime::Runtime, p: &mut Pair, version: u64) -> Vec<Vec<u8>> {
    let (dummy, mut drx) = inproc_channel(1);
    let (dummy, tap) = tapped(dummy);
    let real = std::mem::replace(&mut p.tx.ch, dummy);
    let mut d = drx.pop().unwrap();
    rt.block_on(async {
        let drain = async { while d.recv_with(|_| ()).await.is_ok() {} };
        let send = async {
            let r = p.tx.sync(&p.sender, version).await;
            // Dropping the dummy sender ends the drain loop.
            let _ = std::mem::replace(&mut p.tx.ch, real);
            r
        };
        let (r, _) = tokio::join!(send, drain);
        r.unwrap();
    });
    tap.payloads()
}

/// The first payload a tapped sender broadcast after the handshake's plan (an init bucket part, or version 1).
fn first_payload(tap: &Tap) -> Vec<u8> {
    tap.payloads()
        .into_iter()
        .find(|m| !matches!(Header::parse_unverified(m), Ok((h, _)) if h.kind == Kind::Plan))
        .expect("a payload after the plan")
}

fn inject_and_apply(
    rt: &tokio::runtime::Runtime,
    p: &mut Pair,
    msgs: &[Vec<u8>],
) -> Result<SyncReport, SyncError> {
    let ch = &mut p.tx.ch;
    let rx = &mut p.rx;
    let receiver = &mut p.receiver;
    rt.block_on(async {
        // The receiver may reject an early message and return: then nobody reads the rest, so stop sending
        // as soon as `apply` is done instead of waiting out the channel's timeout.
        let send = async {
            for m in msgs {
                if ch.send(m).await.is_err() {
                    break;
                }
            }
            std::future::pending::<()>().await
        };
        tokio::select! {
            r = rx.apply(receiver) => r,
            () = send => unreachable!("the send future never completes"),
        }
    })
}

fn simple_keys() -> Vec<KeySpec> {
    vec![
        KeySpec {
            name: "w".into(),
            tx: DType::F32,
            rx: DType::Bf16,
            shape: vec![4, 8],
            class: Class::Trainable,
        },
        KeySpec {
            name: "frozen".into(),
            tx: DType::F32,
            rx: DType::F32,
            shape: vec![3],
            class: Class::Frozen,
        },
        KeySpec {
            name: "count".into(),
            tx: DType::I64,
            rx: DType::I64,
            shape: vec![],
            class: Class::Buffer,
        },
    ]
}

fn default_settings(bucket: bool) -> Settings {
    Settings {
        bucket,
        delta: true,
        lz4: false,
        init_sync: true,
        prefixes: false,
        bucket_size: 1 << 20,
        bucket_dtype: None,
        load_instant: true,
        threads: 1,
    }
}

#[test]
fn empty_patch_still_carries_the_version() {
    let rt = rt();
    let keys = simple_keys();
    let s = default_settings(false);
    let mut p = init_pair(&rt, &keys, &s, 1).unwrap();
    let (sent, applied) = sync_once(&rt, &mut p, 5);
    assert_eq!((sent.changed, applied.changed), (0, 0));
    assert_eq!(applied.version, 5);
    assert_eq!(p.rx.version(), 5);
    assert!(sent.payload_bytes > 0);
}

#[test]
fn two_receivers_get_the_same_weights() {
    let rt = rt();
    let keys = simple_keys();
    for bucket in [false, true] {
        let s = default_settings(bucket);
        let cfg = config(&s, &keys);
        let mut sender = build_state(&keys, false, 3);
        let mut r1 = build_state(&keys, true, 4);
        let mut r2 = build_state(&keys, true, 5);
        let tx = WeightSyncer::from_config(&cfg, SyncOptions::default()).unwrap();
        let a = WeightSyncer::from_config(&cfg, SyncOptions::default()).unwrap();
        let b = WeightSyncer::from_config(&cfg, SyncOptions::default()).unwrap();
        let (ch, mut rxs) = inproc_channel(2);
        let (c2, c1) = (rxs.pop().unwrap(), rxs.pop().unwrap());
        let synced = sender.synced_keys();
        rt.block_on(async {
            let (x, y, z) = tokio::join!(
                tx.init_sender(&sender, &synced, ch),
                a.init_receiver(&mut r1, c1),
                b.init_receiver(&mut r2, c2)
            );
            let ((mut tx, _), (mut a, _), (mut b, _)) = (x.unwrap(), y.unwrap(), z.unwrap());
            for v in 1..4 {
                mutate(&mut sender, v, 40);
                let (x, y, z) =
                    tokio::join!(tx.sync(&sender, v), a.apply(&mut r1), b.apply(&mut r2));
                x.unwrap();
                assert_eq!(y.unwrap().version, v);
                assert_eq!(z.unwrap().version, v);
                let want = tx.checksum(&sender).unwrap();
                assert_eq!(a.checksum(&r1), want, "bucket={bucket} v={v}");
                assert_eq!(b.checksum(&r2), want, "bucket={bucket} v={v}");
            }
        });
    }
}

/// A caller may list the keys to sync in any order (the sender lays patches and buckets out in the state
/// dict's order, as the receiver validates them).
#[test]
fn keys_to_sync_in_any_order_sync_the_same() {
    let rt = rt();
    let keys = dense_keys();
    for bucket in [false, true] {
        let s = default_settings(bucket);
        let cfg = config(&s, &keys);
        let mut sender = build_state(&keys, false, 7);
        let mut receiver = build_state(&keys, true, 7);
        let tx = WeightSyncer::from_config(&cfg, SyncOptions::default()).unwrap();
        let rx = WeightSyncer::from_config(&cfg, SyncOptions::default()).unwrap();
        let (ch, mut rxs) = inproc_channel(1);
        let rch = rxs.pop().unwrap();
        let mut synced = sender.synced_keys();
        synced.reverse();
        assert!(synced.len() > 1, "the test needs several keys");
        rt.block_on(async {
            let (x, y) = tokio::join!(
                tx.init_sender(&sender, &synced, ch),
                rx.init_receiver(&mut receiver, rch)
            );
            let ((mut tx, _), (mut rx, _)) = (x.unwrap(), y.unwrap());
            for v in 1..4 {
                mutate_synced(&mut sender, v, 100);
                let (x, y) = tokio::join!(tx.sync(&sender, v), rx.apply(&mut receiver));
                assert!(x.unwrap().changed > 0, "bucket={bucket} v={v}");
                assert_eq!(y.unwrap().version, v, "bucket={bucket}");
                assert_eq!(
                    rx.checksum(&receiver),
                    tx.checksum(&sender).unwrap(),
                    "bucket={bucket} v={v}"
                );
            }
        });
    }
}

#[test]
fn pending_update_installs_later_and_stale_pending_is_rejected() {
    let rt = rt();
    let keys = simple_keys();
    for bucket in [false, true] {
        let s = default_settings(bucket);
        let mut p = init_pair(&rt, &keys, &s, 9).unwrap();
        mutate(&mut p.sender, 1, 50);
        let pending = rt.block_on(async {
            let (x, y) = tokio::join!(p.tx.sync(&p.sender, 1), p.rx.receive());
            x.unwrap();
            y.unwrap()
        });
        assert_eq!(pending.version(), 1);
        assert_eq!(
            p.rx.version(),
            0,
            "receive does not touch the applied version"
        );
        let r = pending.install(&mut p.receiver).unwrap();
        assert_eq!(r.version, 1);
        assert_synced(&p, &keys, &s, &[]);
    }
}

#[test]
fn sender_rejects_non_increasing_versions_when_asked() {
    let rt = rt();
    let keys = simple_keys();
    let mut p = init_pair(&rt, &keys, &default_settings(false), 2).unwrap();
    p.tx.settings.increasing_versions = true;
    sync_once(&rt, &mut p, 3);
    let r = rt.block_on(p.tx.sync(&p.sender, 3));
    assert!(
        matches!(
            r,
            Err(SyncError::VersionNotNewer {
                version: 3,
                last: 3
            })
        ),
        "{r:?}"
    );
}

/// RLinf's versions: 0 first, the same again (an evaluation), jumps and even a lower number; every one applies
/// and `apply` reports the caller's version, while the sequence counts the syncs.
#[test]
fn any_caller_version_applies_in_sync_order() {
    let rt = rt();
    let keys = simple_keys();
    for bucket in [false, true] {
        let s = default_settings(bucket);
        let mut p = init_pair(&rt, &keys, &s, 5).unwrap();
        let frozen = frozen_after_init(&p, &keys, &s);
        for (i, v) in [0u64, 1, 1, 2, 7, 7, 3].into_iter().enumerate() {
            mutate(&mut p.sender, 40 + i as u64, 50);
            let (sent, applied) = sync_once(&rt, &mut p, v);
            assert_eq!((sent.version, applied.version), (v, v), "bucket {bucket}");
            assert_eq!((p.tx.version(), p.rx.version()), (v, v));
            assert_eq!(
                (p.tx.sequence(), p.rx.sequence()),
                (i as u64 + 1, i as u64 + 1)
            );
            assert_synced(&p, &keys, &s, &frozen);
        }
    }
}

/// With versions that repeat, a replayed or older payload is still refused by its sequence: weights and version
/// stay as they are, and the genuine next payload applies afterwards.
#[test]
fn a_replayed_payload_of_a_repeated_version_is_rejected() {
    let rt = rt();
    let keys = simple_keys();
    for bucket in [false, true] {
        let s = default_settings(bucket);
        let mut p = init_pair(&rt, &keys, &s, 6).unwrap();
        let frozen = frozen_after_init(&p, &keys, &s);
        mutate(&mut p.sender, 1, 50);
        // Version 1 as sync #1, delivered, and kept to be replayed.
        let first = capture(&rt, &mut p, 1);
        inject_and_apply(&rt, &mut p, &first).unwrap();
        // Version 1 again (sync #2) and version 0 (sync #3): both apply.
        for v in [1, 0] {
            mutate(&mut p.sender, 2 + v, 50);
            sync_once(&rt, &mut p, v);
        }
        assert_eq!((p.rx.version(), p.rx.sequence()), (0, 3));
        let before: Vec<Vec<u8>> = p.receiver.iter().map(|(_, t)| t.bytes().to_vec()).collect();
        let r = inject_and_apply(&rt, &mut p, &first);
        assert!(
            matches!(&r, Err(e) if e.is_rejection() && e.to_string().contains("replayed or stale")),
            "bucket {bucket}: {r:?}"
        );
        assert_eq!(
            (p.rx.version(), p.rx.sequence()),
            (0, 3),
            "version untouched"
        );
        let after: Vec<Vec<u8>> = p.receiver.iter().map(|(_, t)| t.bytes().to_vec()).collect();
        assert!(before == after, "state changed by a rejected payload");
        mutate(&mut p.sender, 9, 50);
        let (_, applied) = sync_once(&rt, &mut p, 0);
        assert_eq!((applied.version, p.rx.sequence()), (0, 4));
        assert_synced(&p, &keys, &s, &frozen);
    }
}

/// A pending (no-wait) update overtaken by a newer sync is stale even when it carries the same version.
#[test]
fn a_pending_update_of_the_same_version_overtaken_is_stale() {
    let rt = rt();
    let keys = simple_keys();
    for bucket in [false, true] {
        let s = default_settings(bucket);
        let mut p = init_pair(&rt, &keys, &s, 8).unwrap();
        let frozen = frozen_after_init(&p, &keys, &s);
        mutate(&mut p.sender, 1, 50);
        let stale = rt.block_on(async {
            let (x, y) = tokio::join!(p.tx.sync(&p.sender, 4), p.rx.receive());
            x.unwrap();
            y.unwrap()
        });
        mutate(&mut p.sender, 2, 50);
        let fresh = rt.block_on(async {
            let (x, y) = tokio::join!(p.tx.sync(&p.sender, 4), p.rx.receive());
            x.unwrap();
            y.unwrap()
        });
        if bucket {
            // Buckets carry every tensor: the newer one installs, the older is then stale.
            fresh.install(&mut p.receiver).unwrap();
            let r = stale.install(&mut p.receiver);
            assert!(matches!(&r, Err(e) if e.is_rejection()), "{r:?}");
        } else {
            // The second patch is based on the first: it needs the first installed.
            stale.install(&mut p.receiver).unwrap();
            fresh.install(&mut p.receiver).unwrap();
        }
        assert_eq!((p.rx.version(), p.rx.sequence()), (4, 2));
        assert_synced(&p, &keys, &s, &frozen);
    }
}

#[test]
fn unsupported_devices_and_nvcomp_are_clear_errors() {
    let fail = |f: &dyn Fn(&mut WeightSyncerConfig)| {
        let mut c = WeightSyncerConfig::default();
        f(&mut c);
        WeightSyncer::from_config(&c, SyncOptions::default())
            .err()
            .expect("must fail")
    };
    let no_gpu = |f: &dyn Fn(&mut WeightSyncerConfig), want: &str| {
        let e = fail(f);
        assert!(
            matches!(&e, SyncError::NoGpuBackend { setting, .. } if *setting == want),
            "{e}"
        );
        let text = e.to_string();
        assert!(text.contains("is not available here: "), "{text}");
        assert!(
            !text.contains("--features") && !text.contains("CUDA build"),
            "{text}"
        );
    };
    no_gpu(
        &|c| c.patch.compression = Compression::NvcompLz4,
        "weight_syncer.patch.compression",
    );
    // A snapshot on the GPU needs the CUDA backend in the build (and CUDA tensors, checked by the binding).
    let mut c = WeightSyncerConfig::default();
    c.patch.snapshot_device = Device::Cuda;
    let made = WeightSyncer::from_config(&c, SyncOptions::default());
    assert_eq!(made.is_ok(), crate::gpu::BUILT_WITH_CUDA);
    if let Err(e) = made {
        assert!(
            matches!(e, SyncError::Gpu(crate::gpu::GpuError::NotBuilt)),
            "{e}"
        );
        assert!(e.to_string().contains("built without CUDA"), "{e}");
    }
    no_gpu(
        &|c| c.patch.transport_device = Device::Cuda,
        "weight_syncer.patch.transport_device",
    );
    // Buckets on the GPU are accepted (host tensors are staged on the host, CUDA ones through the binding).
    let mut c = WeightSyncerConfig {
        kind: SyncerKind::Bucket,
        ..Default::default()
    };
    c.bucket.bucket_device = Device::Cuda;
    let made = WeightSyncer::from_config(&c, SyncOptions::default()).unwrap();
    assert_eq!(made.settings.bucket_device, Device::Cuda);
    let e = fail(&|c| c.patch.init_sync.prefixes = Some(vec![]));
    assert!(
        matches!(e, SyncError::Config { .. }) && e.to_string().contains("empty list"),
        "{e}"
    );
}

#[test]
fn handshake_mismatch_fails_both_sides_naming_the_key() {
    let rt = rt();
    let keys = simple_keys();
    let cfg = config(&default_settings(false), &keys);
    let sender = build_state(&keys, false, 1);
    let mut bad = keys.clone();
    bad[0].shape = vec![8, 4];
    let mut receiver = build_state(&bad, true, 2);
    let tx = WeightSyncer::from_config(&cfg, SyncOptions::default()).unwrap();
    let rx = WeightSyncer::from_config(&cfg, SyncOptions::default()).unwrap();
    let (ch, mut rxs) = inproc_channel(1);
    let synced = sender.synced_keys();
    let (a, b) = rt.block_on(async {
        tokio::join!(
            tx.init_sender(&sender, &synced, ch),
            rx.init_receiver(&mut receiver, rxs.pop().unwrap())
        )
    });
    let a = a.err().expect("the sender fails").to_string();
    let b = b.err().expect("the receiver fails").to_string();
    assert!(a.contains("shape mismatch") && a.contains("'w'"), "{a}");
    assert!(b.contains("refused") && b.contains("'w'"), "{b}");
}

#[test]
fn prefix_matching_nothing_is_an_error() {
    let rt = rt();
    let keys = simple_keys();
    let mut cfg = config(&default_settings(false), &keys);
    cfg.patch.init_sync.prefixes = Some(vec!["nope".into()]);
    let sender = build_state(&keys, false, 1);
    let mut receiver = build_state(&keys, true, 2);
    let tx = WeightSyncer::from_config(&cfg, SyncOptions::default()).unwrap();
    let rx = WeightSyncer::from_config(&cfg, SyncOptions::default()).unwrap();
    let (ch, mut rxs) = inproc_channel(1);
    let synced = sender.synced_keys();
    let (a, b) = rt.block_on(async {
        tokio::join!(
            tx.init_sender(&sender, &synced, ch),
            rx.init_receiver(&mut receiver, rxs.pop().unwrap())
        )
    });
    let a = a.err().expect("the sender fails").to_string();
    assert!(a.contains("'nope' matches no key"), "{a}");
    assert!(b.is_err());
}

#[test]
fn adam_bf16_payload_is_under_two_bytes_per_changed_element() {
    use crate::tensor::synthetic::{ModelSpec, SyntheticModel, UpdateMode};
    let rt = rt();
    let mut model = SyntheticModel::new(ModelSpec {
        params: 1 << 20,
        tensors: 32,
        dtype: DType::Bf16,
        frozen_fraction: 0.0,
        seed: 7,
    })
    .unwrap();
    let mut sender = model.state_dict().unwrap();
    let mut receiver = model.state_dict().unwrap();
    for compression in [Compression::None, Compression::Lz4] {
        let mut cfg = WeightSyncerConfig::default();
        cfg.patch.compression = compression;
        let tx = WeightSyncer::from_config(&cfg, SyncOptions::default()).unwrap();
        let rx = WeightSyncer::from_config(&cfg, SyncOptions::default()).unwrap();
        let (ch, mut rxs) = inproc_channel(1);
        let synced = sender.synced_keys();
        let (tx, rx) = rt.block_on(async {
            let (a, b) = tokio::join!(
                tx.init_sender(&sender, &synced, ch),
                rx.init_receiver(&mut receiver, rxs.pop().unwrap())
            );
            let ((mut tx, _), (mut rx, _)) = (a.unwrap(), b.unwrap());
            for v in 1..=3 {
                let changed = model
                    .step(
                        UpdateMode::Adam { lr: 1e-6 },
                        &mut sender,
                        NonZeroUsize::MIN,
                    )
                    .unwrap();
                let (a, b) = tokio::join!(tx.sync(&sender, v), rx.apply(&mut receiver));
                let (a, b) = (a.unwrap(), b.unwrap());
                assert_eq!(a.changed, changed);
                let per = a.payload_bytes as f64 / changed as f64;
                assert!(
                    per <= 2.0,
                    "{compression:?}: {per:.3} bytes per changed element"
                );
                assert_eq!(b.version, v);
            }
            (tx, rx)
        });
        assert_eq!(tx.checksum(&sender).unwrap(), rx.checksum(&receiver));
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, .. ProptestConfig::default() })]

    /// A payload with a valid header and checksum but an arbitrary body (a buggy or hostile sender) is
    /// rejected without panicking and without touching the weights.
    #[test]
    fn well_framed_garbage_is_rejected(keys in model(), bucket in any::<bool>(), body in prop::collection::vec(any::<u8>(), 0..256), aux in 0..3u64, seq_count in (0..1u32, 1..3u32)) {
        let rt = rt();
        let mut s = default_settings(bucket);
        s.init_sync = false;
        let mut p = init_pair(&rt, &keys, &s, 5).unwrap();
        let before: Vec<Vec<u8>> = p.receiver.iter().map(|(_, t)| t.bytes().to_vec()).collect();
        let mut h = Header::new(if bucket { Kind::Bucket } else { Kind::Patch }, 1, body.len());
        h.aux = aux;
        h.seq = 0;
        h.count = seq_count.1;
        let msg = wire::message(h, &body);
        let r = inject_and_apply(&rt, &mut p, &[msg]);
        prop_assert!(matches!(&r, Err(e) if e.is_rejection()), "accepted garbage: {:?}", r.map(|r| r.version));
        let after: Vec<Vec<u8>> = p.receiver.iter().map(|(_, t)| t.bytes().to_vec()).collect();
        prop_assert!(before == after);
        prop_assert_eq!(p.rx.version(), 0);
    }
}

#[test]
fn a_corrupted_header_is_rejected_not_skipped_as_a_leftover() {
    // Flipping the bucket number of a version's first part must not make the receiver take it for a leftover
    // of an earlier version and wait for more: the part's checksum fails and the version is rejected.
    let rt = rt();
    let keys = simple_keys();
    let s = default_settings(true);
    let mut p = init_pair(&rt, &keys, &s, 3).unwrap();
    sync_once(&rt, &mut p, 1);
    mutate(&mut p.sender, 11, 30);
    let good = capture(&rt, &mut p, 2);
    let mut first = good[0].clone();
    first[16] ^= 1; // header `seq`: bucket 0 → bucket 1
    let r = inject_and_apply(&rt, &mut p, &[first]);
    assert!(
        matches!(&r, Err(e) if e.is_rejection()),
        "{:?}",
        r.map(|r| r.version)
    );
    assert_eq!(p.rx.version(), 1);
    let r = inject_and_apply(&rt, &mut p, &good).unwrap();
    assert_eq!(r.version, 2);
}

fn chain_cfg(name: &str) -> crate::transport::ChainConfig {
    crate::transport::ChainConfig {
        token: b"run-token".to_vec(),
        name: name.to_owned(),
        part_bytes: 48,
        timeout: std::time::Duration::from_secs(20),
    }
}

/// Three nodes on loopback: node 0 (the trainer, one local rollout in process), node 1 (one rollout in
/// process) and node 2 (one rollout over shared memory), joined by the TCP chain. Patch and bucket syncs
/// reach every rollout bit for bit, and node 2's rollout sees versions exactly as on one host.
#[test]
fn weights_cross_a_tcp_chain_of_nodes_bitwise() {
    use crate::transport::{ChainRelay, ChainSender, ShmConfig, ShmReceiver, ShmSender};
    use tokio::net::TcpListener;
    let timeout = std::time::Duration::from_secs(20);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let keys = simple_keys();
    for bucket in [false, true] {
        let s = default_settings(bucket);
        let cfg = config(&s, &keys);
        let mut sender = build_state(&keys, false, 3);
        let mut states: Vec<StateDict> = (0..3).map(|i| build_state(&keys, true, 10 + i)).collect();
        let mut tx = WeightSyncer::from_config(&cfg, SyncOptions::default()).unwrap();
        // Tiny bucket parts: many payloads in flight along the chain.
        tx.settings.part_bytes = 40;
        let rx = || WeightSyncer::from_config(&cfg, SyncOptions::default()).unwrap();
        rt.block_on(async {
            let l1 = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let l2 = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let a1 = l1.local_addr().unwrap().to_string();
            let a2 = l2.local_addr().unwrap().to_string();
            let sock = dir.path().join(format!("node2-{bucket}.sock"));
            let shm = ShmConfig {
                socket_path: sock.clone(),
                segment_prefix: "rlsync-chain-test".into(),
                receivers: 1,
                timeout,
                ..ShmConfig::default()
            };
            let (shm_tx, shm_rx) = tokio::join!(
                ShmSender::bind(shm),
                ShmReceiver::connect(&sock, 0, timeout)
            );
            let (shm_tx, shm_rx) = (shm_tx.unwrap(), shm_rx.unwrap());
            let (tx1, mut rx1) = inproc_channel(1);
            let relay2 = tokio::spawn(async move {
                let relay = ChainRelay::establish(&l2, None, shm_tx, chain_cfg("node 2")).await?;
                relay.serve().await
            });
            let relay1 = tokio::spawn(async move {
                let relay = ChainRelay::establish(&l1, Some(&a2), tx1, chain_cfg("node 1")).await?;
                relay.serve().await
            });
            let (head_local, mut rx0) = inproc_channel(1);
            let head = ChainSender::connect(Some(head_local), Some(&a1), chain_cfg("node 0"))
                .await
                .unwrap();
            assert_eq!(head.receivers(), 3);
            let (c0, c1, c2) = (rx0.pop().unwrap(), rx1.pop().unwrap(), shm_rx);
            let synced = sender.synced_keys();
            let [s0, s1, s2] = &mut states[..] else {
                unreachable!()
            };
            let (x, a, b, c) = tokio::join!(
                tx.init_sender(&sender, &synced, head),
                rx().init_receiver(s0, c0),
                rx().init_receiver(s1, c1),
                rx().init_receiver(s2, c2)
            );
            let (mut tx, _) = x.unwrap();
            let (mut w0, mut w1, mut w2) = (a.unwrap().0, b.unwrap().0, c.unwrap().0);
            for v in 1..4 {
                mutate(&mut sender, v, 40);
                let (x, a, b, c) = tokio::join!(
                    tx.sync(&sender, v),
                    w0.apply(s0),
                    w1.apply(s1),
                    w2.apply(s2)
                );
                x.unwrap();
                for r in [a, b, c] {
                    assert_eq!(r.unwrap().version, v, "bucket={bucket}");
                }
                let want = tx.checksum(&sender).unwrap();
                for (w, st) in [(&w0, &*s0), (&w1, &*s1), (&w2, &*s2)] {
                    assert_eq!(w.checksum(st), want, "bucket={bucket} v={v}");
                }
            }
            drop(tx);
            for relay in [relay1, relay2] {
                relay.await.unwrap().unwrap();
            }
        });
    }
}

// ---------------------------------------------------------------------------------------------------------
// rejoin: a receiver that left catches up (replay or full) and ends bitwise equal to those that stayed

/// As [`mutate`], for synced tensors only: a trainer never changes frozen weights.
fn mutate_synced(state: &mut StateDict, seed: u64, density_pct: u64) {
    let frozen: Vec<(String, Vec<u8>)> = state
        .iter()
        .filter(|(_, t)| !t.class().is_synced())
        .map(|(k, t)| (k.to_string(), t.bytes().to_vec()))
        .collect();
    mutate(state, seed, density_pct);
    for (k, bytes) in frozen {
        if let Some(t) = state.get_mut(&k) {
            t.bytes_mut().copy_from_slice(&bytes);
        }
    }
}

struct Elastic {
    tx: SyncSender,
    sender: StateDict,
    rxs: Vec<Option<(SyncReceiver, StateDict)>>,
    joiner: transport::InProcJoiner,
}

fn init_elastic(
    rt: &tokio::runtime::Runtime,
    keys: &[KeySpec],
    s: &Settings,
    seed: u64,
    replay_versions: u32,
) -> Elastic {
    init_elastic_with(rt, keys, s, seed, replay_versions, |_| {})
}

/// [`init_elastic`] with the sender's syncer set up by `setup` before its init.
fn init_elastic_with(
    rt: &tokio::runtime::Runtime,
    keys: &[KeySpec],
    s: &Settings,
    seed: u64,
    replay_versions: u32,
    setup: impl FnOnce(&mut WeightSyncer),
) -> Elastic {
    let sender = build_state(keys, false, seed);
    let mut cfg = config(s, keys);
    cfg.patch.replay_versions = replay_versions;
    let mut tx = WeightSyncer::from_config(&cfg, SyncOptions { threads: s.threads }).unwrap();
    setup(&mut tx);
    tx.settings.part_bytes = [16, 40, 64, 1 << 20][(seed % 4) as usize];
    // Small patch parts too, so that a version's patch travels as one part per tensor or a few.
    tx.settings.patch_part_bytes = [1, 256, 4096, 1 << 20][((seed >> 2) % 4) as usize];
    let (ch, rchs, joiner) =
        transport::inproc_channel_elastic(2, std::time::Duration::from_secs(5));
    let boot = bootstrapped(s, keys);
    let mut rxs = Vec::new();
    let mut pending = Vec::new();
    for rch in rchs {
        let mut receiver = build_state(keys, true, seed ^ 0xABCD);
        if !s.bucket {
            for (k, b) in keys.iter().zip(&boot) {
                if !b {
                    let bytes = cast_copy(sender.get(&k.name).unwrap(), k.rx);
                    receiver
                        .get_mut(&k.name)
                        .unwrap()
                        .bytes_mut()
                        .copy_from_slice(&bytes);
                }
            }
        }
        let rx = WeightSyncer::from_config(&cfg, SyncOptions { threads: s.threads }).unwrap();
        pending.push((rx, receiver, rch));
    }
    let synced = sender.synced_keys();
    let (tx, _) = rt.block_on(async {
        let mut futs = Vec::new();
        for (rx, st, rch) in pending {
            futs.push(tokio::spawn(async move {
                let mut st = st;
                let (rx, _) = rx.init_receiver(&mut st, rch).await.unwrap();
                (rx, st)
            }));
        }
        let tx = tx.init_sender(&sender, &synced, ch).await.unwrap();
        for f in futs {
            rxs.push(Some(f.await.unwrap()));
        }
        tx
    });
    Elastic {
        tx,
        sender,
        rxs,
        joiner,
    }
}

/// Sync `version` to every live receiver.
fn sync_live(rt: &tokio::runtime::Runtime, e: &mut Elastic, version: u64) -> SyncReport {
    rt.block_on(async {
        let mut futs = Vec::new();
        for (rank, slot) in e.rxs.iter_mut().enumerate() {
            if let Some((rx, st)) = slot.take() {
                futs.push((
                    rank,
                    tokio::spawn(async move {
                        let (mut rx, mut st) = (rx, st);
                        rx.apply(&mut st).await.unwrap();
                        (rx, st)
                    }),
                ));
            }
        }
        let report = e.tx.sync(&e.sender, version).await.unwrap();
        for (rank, f) in futs {
            e.rxs[rank] = Some(f.await.unwrap());
        }
        report
    })
}

/// Rank `rank` leaves; returns its state (what a late worker holds).
fn leave(e: &mut Elastic, rank: usize) -> StateDict {
    let (rx, st) = e.rxs[rank].take().unwrap();
    drop(rx);
    st
}

fn rejoin(
    rt: &tokio::runtime::Runtime,
    e: &mut Elastic,
    rank: usize,
    st: StateDict,
    held: u64,
    cfg: &WeightSyncerConfig,
) -> (
    Result<CatchUpReport, SyncError>,
    Result<CatchUpReport, SyncError>,
) {
    rejoin_with(rt, e, rank, st, held, cfg, |_| {})
}

/// [`rejoin`] with the receiver's syncer set up by `setup` first.
fn rejoin_with(
    rt: &tokio::runtime::Runtime,
    e: &mut Elastic,
    rank: usize,
    mut st: StateDict,
    held: u64,
    cfg: &WeightSyncerConfig,
    setup: impl FnOnce(&mut WeightSyncer),
) -> (
    Result<CatchUpReport, SyncError>,
    Result<CatchUpReport, SyncError>,
) {
    let rch = e.joiner.join(rank).unwrap();
    let mut rx = WeightSyncer::from_config(cfg, SyncOptions::default()).unwrap();
    setup(&mut rx);
    let (a, b) = rt.block_on(async {
        tokio::join!(
            e.tx.rejoin(&e.sender, rank),
            rx.rejoin_receiver(&mut st, rch, held)
        )
    });
    let b = b.map(|(rx, report)| {
        e.rxs[rank] = Some((rx, st));
        report
    });
    (a, b)
}

fn assert_same(e: &Elastic, keys: &[KeySpec], s: &Settings) {
    let boot = bootstrapped(s, keys);
    let (Some((rx0, st0)), Some((rx1, st1))) = (&e.rxs[0], &e.rxs[1]) else {
        panic!("both receivers live")
    };
    for (k, b) in keys.iter().zip(boot) {
        if k.class.is_synced() || b {
            assert_eq!(
                st0.get(&k.name).unwrap().bytes(),
                st1.get(&k.name).unwrap().bytes(),
                "key {} ({k:?})",
                k.name
            );
        }
    }
    let expect = e.tx.checksum(&e.sender).unwrap();
    assert_eq!(rx0.checksum(st0), expect);
    assert_eq!(rx1.checksum(st1), expect);
    assert_eq!(rx0.version(), rx1.version());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, .. ProptestConfig::default() })]

    /// Whatever the settings, the version held and the log size: after the catch-up and the next sync the
    /// rejoined receiver holds bitwise what the one that stayed holds (synced and bootstrapped keys).
    #[test]
    fn rejoin_equals_staying(
        keys in model(),
        s in settings(),
        seed in any::<u64>(),
        before in 0..3u64,
        missed in 0..4u64,
        fresh in any::<bool>(),
        log in 0..5u32,
    ) {
        let rt = rt();
        let mut cfg = config(&s, &keys);
        cfg.patch.replay_versions = log;
        let mut e = init_elastic(&rt, &keys, &s, seed, log);
        let mut v = 0;
        for _ in 0..before {
            v += 1;
            mutate_synced(&mut e.sender, seed ^ v, 20);
            sync_live(&rt, &mut e, v);
        }
        let late = leave(&mut e, 1);
        let (st, held) = if fresh {
            (build_state(&keys, true, seed ^ 0x5EED), 0)
        } else {
            (late, v)
        };
        for _ in 0..missed {
            v += 1;
            mutate_synced(&mut e.sender, seed ^ v, 20);
            sync_live(&rt, &mut e, v);
        }
        let (tx_report, rx_report) = rejoin(&rt, &mut e, 1, st, held, &cfg);
        let (tx_report, rx_report) = (tx_report.unwrap(), rx_report.unwrap());
        prop_assert_eq!(tx_report.kind, rx_report.kind);
        prop_assert_eq!(tx_report.payload_bytes, rx_report.payload_bytes);
        if s.bucket {
            prop_assert_eq!(rx_report.to, 0, "bucket: the next version makes it current");
        } else {
            prop_assert_eq!(rx_report.to, v);
            if tx_report.kind == CatchUpKind::Replay {
                prop_assert_eq!(u64::from(rx_report.patches), v - held);
            } else {
                prop_assert!(!tx_report.reason.is_empty());
            }
            if !fresh && log as u64 >= missed && missed == 0 {
                prop_assert_eq!(tx_report.kind, CatchUpKind::Replay, "{}", tx_report.reason);
            }
            if log == 0 && v > held {
                prop_assert_eq!(tx_report.kind, CatchUpKind::Full);
            }
        }
        v += 1;
        mutate_synced(&mut e.sender, seed ^ v, 20);
        sync_live(&rt, &mut e, v);
        assert_same(&e, &keys, &s);
    }
}

fn dense_keys() -> Vec<KeySpec> {
    let k = |name: &str, tx, rx, shape: &[usize], class| KeySpec {
        name: name.into(),
        tx,
        rx,
        shape: shape.to_vec(),
        class,
    };
    vec![
        k("enc.w", DType::F32, DType::Bf16, &[64, 64], Class::Frozen),
        k(
            "l1.w",
            DType::F32,
            DType::Bf16,
            &[128, 64],
            Class::Trainable,
        ),
        k("l1.b", DType::F32, DType::F32, &[128], Class::Trainable),
        k("bn.n", DType::I64, DType::I64, &[1], Class::Buffer),
    ]
}

fn patch_settings() -> Settings {
    Settings {
        bucket: false,
        delta: true,
        lz4: false,
        init_sync: true,
        prefixes: false,
        bucket_size: 1 << 20,
        bucket_dtype: None,
        load_instant: true,
        threads: 1,
    }
}

#[test]
fn replay_costs_the_missed_patches_only() {
    let rt = rt();
    let (keys, s) = (dense_keys(), patch_settings());
    let cfg = config(&s, &keys);
    let mut e = init_elastic(&rt, &keys, &s, 7, 8);
    mutate_synced(&mut e.sender, 1, 1);
    sync_live(&rt, &mut e, 1);
    let late = leave(&mut e, 1);
    let mut missed_bytes = 0;
    for v in 2..=4 {
        mutate_synced(&mut e.sender, v, 1);
        missed_bytes += sync_live(&rt, &mut e, v).payload_bytes;
    }
    let (tx, rx) = rejoin(&rt, &mut e, 1, late, 1, &cfg);
    let (tx, rx) = (tx.unwrap(), rx.unwrap());
    assert_eq!(
        (tx.kind, tx.patches, tx.from, tx.to),
        (CatchUpKind::Replay, 3, 1, 4)
    );
    assert_eq!(rx.payload_bytes, tx.payload_bytes);
    assert_eq!(tx.boot_bytes, 0, "the frozen key is unchanged: not re-sent");
    // The handshake (metadata, plan, checksums, catch-up header) is the only overhead.
    let handshake = tx.payload_bytes - missed_bytes;
    assert!(handshake < 1024, "{handshake} bytes of handshake");
    mutate_synced(&mut e.sender, 5, 1);
    sync_live(&rt, &mut e, 5);
    assert_same(&e, &keys, &s);
}

/// A receiver whose synced tensors reach it another way after a rejoin (the GPU channel's rollouts) does not
/// hash them: its checksum matches no base, so a sender that could replay to it sends the full state instead.
#[test]
fn a_receiver_synced_elsewhere_does_not_hash_its_synced_tensors() {
    let rt = rt();
    let (keys, s) = (dense_keys(), patch_settings());
    let cfg = config(&s, &keys);
    let mut e = init_elastic(&rt, &keys, &s, 7, 8);
    mutate_synced(&mut e.sender, 1, 1);
    sync_live(&rt, &mut e, 1);
    let late = leave(&mut e, 1);
    mutate_synced(&mut e.sender, 2, 1);
    sync_live(&rt, &mut e, 2);
    let (tx, rx) = rejoin_with(&rt, &mut e, 1, late, 1, &cfg, |rx| {
        rx.synced_elsewhere(true)
    });
    let tx = tx.unwrap();
    assert_eq!((tx.kind, tx.from, tx.to), (CatchUpKind::Full, 1, 2));
    assert!(tx.reason.contains("checksum"), "{}", tx.reason);
    rx.unwrap();
    assert_same(&e, &keys, &s);
}

#[test]
fn a_fresh_worker_gets_the_full_state_and_the_frozen_keys() {
    let rt = rt();
    let (keys, s) = (dense_keys(), patch_settings());
    let cfg = config(&s, &keys);
    let mut e = init_elastic(&rt, &keys, &s, 9, 8);
    mutate_synced(&mut e.sender, 1, 5);
    sync_live(&rt, &mut e, 1);
    leave(&mut e, 1);
    let fresh = build_state(&keys, true, 12345);
    let (tx, rx) = rejoin(&rt, &mut e, 1, fresh, 0, &cfg);
    let (tx, rx) = (tx.unwrap(), rx.unwrap());
    assert_eq!((tx.kind, rx.to), (CatchUpKind::Full, 1));
    assert!(
        tx.reason.contains("not those of version 0"),
        "{}",
        tx.reason
    );
    assert!(tx.boot_bytes > 0, "the frozen key differs: re-sent");
    assert_same(&e, &keys, &s);
}

/// A run whose versions travel another way after the init bootstrap (the same-host GPU channel) keeps only
/// the host channel's rejoin half: a restarted receiver completes the handshake and gets the frozen keys when
/// its copy of them differs (not when it matches); the synced tensors are deferred, nothing of them sent.
#[test]
fn a_host_rejoin_serves_the_handshake_and_the_frozen_keys_only() {
    let rt = rt();
    let (keys, s) = (dense_keys(), patch_settings());
    let cfg = config(&s, &keys);
    let Elastic {
        tx,
        mut sender,
        mut rxs,
        joiner,
    } = init_elastic(&rt, &keys, &s, 11, 8);
    let mut host = tx.into_host_rejoin();
    drop(rxs[1].take());
    // Training goes on; its versions go the other way.
    mutate_synced(&mut sender, 1, 5);
    let fresh = build_state(&keys, true, 4242);
    let synced_before = fresh.get("l1.w").unwrap().bytes().to_vec();
    let frozen_want = cast_copy(sender.get("enc.w").unwrap(), DType::Bf16);
    assert_ne!(fresh.get("enc.w").unwrap().bytes(), &frozen_want[..]);
    let serve = |host: &mut HostRejoin, mut st: StateDict| {
        let rch = joiner.join(1).unwrap();
        let mut rx = WeightSyncer::from_config(&cfg, SyncOptions::default()).unwrap();
        rx.synced_elsewhere(true);
        let (a, b) = rt.block_on(async {
            tokio::join!(host.serve(&sender, 1), rx.rejoin_receiver(&mut st, rch, 0))
        });
        let (rx, b) = b.unwrap();
        (a.unwrap(), b, rx, st)
    };
    let (tx_report, rx_report, rx, st) = serve(&mut host, fresh);
    assert!(tx_report.deferred && rx_report.deferred);
    assert_eq!((tx_report.to, rx_report.to, tx_report.patches), (0, 0, 0));
    assert!(
        tx_report.reason.contains("GPU channel"),
        "{}",
        tx_report.reason
    );
    assert_eq!(tx_report.payload_bytes, rx_report.payload_bytes);
    assert!(tx_report.boot_bytes > 0 && tx_report.boot_bytes == rx_report.boot_bytes);
    assert!(
        tx_report.payload_bytes < tx_report.boot_bytes + 1024,
        "the handshake and the frozen key only: {tx_report:?}"
    );
    assert_eq!(st.get("enc.w").unwrap().bytes(), &frozen_want[..]);
    assert_eq!(
        st.get("l1.w").unwrap().bytes(),
        &synced_before[..],
        "synced keys untouched"
    );
    // It restarts again, its frozen copy now the trainer's: nothing of it is re-sent.
    drop(rx);
    let (tx_report, _, _rx, _) = serve(&mut host, st);
    assert_eq!(tx_report.boot_bytes, 0);
    assert!(tx_report.deferred);
    assert_eq!(host.live_receivers(), vec![0, 1]);
}

/// What a bootstrap elsewhere (the GPU channel's) must not wait for: a receiver that died, and one whose
/// successor joined the host channel but was not caught up yet (it connects elsewhere only after its rejoin).
#[test]
fn ranks_gone_names_the_dead_and_the_replaced_not_yet_caught_up() {
    let rt = rt();
    let (keys, s) = (dense_keys(), patch_settings());
    let cfg = config(&s, &keys);
    let Elastic {
        mut tx,
        sender,
        mut rxs,
        joiner,
    } = init_elastic(&rt, &keys, &s, 13, 8);
    assert_eq!(tx.ranks_gone().unwrap(), Vec::<usize>::new());
    drop(rxs[1].take());
    let gone = wait_for(|| tx.ranks_gone().unwrap() == [1]);
    assert!(gone, "the dead receiver is gone");
    let rch = joiner.join(1).unwrap();
    // Its successor joined (the channel admits it at once) but is not caught up yet: still away.
    assert_eq!(tx.ranks_gone().unwrap(), [1]);
    assert_eq!(tx.live_receivers(), [0, 1], "the channel has it");
    let mut st = build_state(&keys, true, 77);
    let rx = WeightSyncer::from_config(&cfg, SyncOptions::default()).unwrap();
    let (a, b) = rt.block_on(async {
        tokio::join!(tx.rejoin(&sender, 1), rx.rejoin_receiver(&mut st, rch, 0))
    });
    a.unwrap();
    let _held = b.unwrap();
    assert_eq!(tx.ranks_gone().unwrap(), Vec::<usize>::new());
}

/// Polls `cond` every 5 ms for up to 5 s.
fn wait_for(mut cond: impl FnMut() -> bool) -> bool {
    let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while std::time::Instant::now() < until {
        if cond() {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    cond()
}

#[test]
fn rejoin_before_the_first_version_sends_version_zero() {
    let rt = rt();
    let (keys, s) = (dense_keys(), patch_settings());
    let cfg = config(&s, &keys);
    let mut e = init_elastic(&rt, &keys, &s, 3, 0);
    leave(&mut e, 1);
    let fresh = build_state(&keys, true, 999);
    let (tx, rx) = rejoin(&rt, &mut e, 1, fresh, 0, &cfg);
    let (tx, rx) = (tx.unwrap(), rx.unwrap());
    assert_eq!((tx.kind, rx.to), (CatchUpKind::Full, 0));
    assert_same(&e, &keys, &s);
    mutate_synced(&mut e.sender, 1, 5);
    sync_live(&rt, &mut e, 1);
    assert_same(&e, &keys, &s);
}

#[test]
fn a_corrupt_replayed_patch_is_rejected() {
    let rt = rt();
    let (keys, s) = (dense_keys(), patch_settings());
    let cfg = config(&s, &keys);
    let mut e = init_elastic(&rt, &keys, &s, 5, 8);
    mutate_synced(&mut e.sender, 1, 5);
    sync_live(&rt, &mut e, 1);
    let late = leave(&mut e, 1);
    mutate_synced(&mut e.sender, 2, 5);
    sync_live(&rt, &mut e, 2);
    e.tx.rejoin.log.corrupt_last_for_tests();
    let (tx, rx) = rejoin(&rt, &mut e, 1, late, 1, &cfg);
    assert_eq!(tx.unwrap().kind, CatchUpKind::Replay);
    let err = rx.unwrap_err();
    assert!(
        matches!(&err, SyncError::Unreadable { current: 1, .. })
            && crate::error_chain(&err).contains("checksum"),
        "{err}"
    );
    // The sender and the receiver that stayed go on.
    mutate_synced(&mut e.sender, 3, 5);
    sync_live(&rt, &mut e, 3);
    let (rx0, st0) = e.rxs[0].as_ref().unwrap();
    assert_eq!(rx0.checksum(st0), e.tx.checksum(&e.sender).unwrap());
}

#[test]
fn a_receiver_with_other_keys_is_refused() {
    let rt = rt();
    let (keys, s) = (dense_keys(), patch_settings());
    let cfg = config(&s, &keys);
    let mut e = init_elastic(&rt, &keys, &s, 5, 8);
    leave(&mut e, 1);
    let mut other = build_state(&keys, true, 1);
    other.insert(
        "extra",
        Tensor::zeros(DType::F32, &[2], Class::Frozen).unwrap(),
    );
    let (tx, rx) = rejoin(&rt, &mut e, 1, other, 0, &cfg);
    assert!(tx.unwrap_err().to_string().contains("differ"));
    assert!(rx.unwrap_err().to_string().contains("refused"));
}

#[test]
fn a_bucket_syncer_sends_the_last_version_while_the_state_is_still_it() {
    let rt = rt();
    let keys = dense_keys();
    let s = Settings {
        bucket: true,
        ..patch_settings()
    };
    let cfg = config(&s, &keys);
    let mut e = init_elastic(&rt, &keys, &s, 11, 8);
    for v in 1..=2 {
        mutate_synced(&mut e.sender, v, 5);
        sync_live(&rt, &mut e, v);
    }
    leave(&mut e, 1);
    let mut st = build_state(&keys, true, 4242);
    let rch = e.joiner.join(1).unwrap();
    let rx = WeightSyncer::from_config(&cfg, SyncOptions::default()).unwrap();
    let (a, b) = rt.block_on(async {
        tokio::join!(
            e.tx.rejoin_at(&e.sender, 1, true),
            rx.rejoin_receiver(&mut st, rch, 0)
        )
    });
    let (a, (rx, b)) = (a.unwrap(), b.unwrap());
    assert_eq!((a.kind, b.to, b.deferred), (CatchUpKind::Full, 2, false));
    assert_eq!(a.payload_bytes, b.payload_bytes);
    e.rxs[1] = Some((rx, st));
    // Current at once, before any further version.
    assert_same(&e, &keys, &s);
    mutate_synced(&mut e.sender, 3, 5);
    sync_live(&rt, &mut e, 3);
    assert_same(&e, &keys, &s);
}

#[test]
fn a_bucket_syncer_keeping_the_last_version_sends_it_after_the_state_moved_on() {
    let rt = rt();
    let keys = dense_keys();
    let s = Settings {
        bucket: true,
        ..patch_settings()
    };
    let cfg = config(&s, &keys);
    let mut e = init_elastic_with(&rt, &keys, &s, 13, 8, |tx| tx.keep_last_version(true));
    for v in 1..=2 {
        mutate_synced(&mut e.sender, v, 5);
        sync_live(&rt, &mut e, v);
    }
    leave(&mut e, 1);
    // Trained on since version 2 (runner.weight_sync_interval > 1): the state is no longer the last version.
    mutate_synced(&mut e.sender, 99, 50);
    let mut st = build_state(&keys, true, 4343);
    let rch = e.joiner.join(1).unwrap();
    let rx = WeightSyncer::from_config(&cfg, SyncOptions::default()).unwrap();
    let (a, b) = rt.block_on(async {
        tokio::join!(
            e.tx.rejoin_at(&e.sender, 1, false),
            rx.rejoin_receiver(&mut st, rch, 0)
        )
    });
    let (a, (rx, b)) = (a.unwrap(), b.unwrap());
    assert_eq!((a.kind, b.to, b.deferred), (CatchUpKind::Full, 2, false));
    assert!(a.reason.contains("sender's copy"), "{}", a.reason);
    assert_eq!(a.payload_bytes, b.payload_bytes);
    // Version 2, bit for bit what the receiver that stayed holds, and not the moved-on state.
    let (rx0, st0) = e.rxs[0].as_ref().unwrap();
    assert_eq!(rx.checksum(&st), rx0.checksum(st0));
    assert_ne!(rx.checksum(&st), e.tx.checksum(&e.sender).unwrap());
    e.rxs[1] = Some((rx, st));
    mutate_synced(&mut e.sender, 3, 5);
    sync_live(&rt, &mut e, 3);
    assert_same(&e, &keys, &s);
}

#[test]
fn a_bucket_syncer_without_the_copy_defers_a_rejoin_after_the_state_moved_on() {
    let rt = rt();
    let keys = dense_keys();
    let s = Settings {
        bucket: true,
        ..patch_settings()
    };
    let cfg = config(&s, &keys);
    let mut e = init_elastic(&rt, &keys, &s, 17, 8);
    mutate_synced(&mut e.sender, 1, 5);
    sync_live(&rt, &mut e, 1);
    leave(&mut e, 1);
    mutate_synced(&mut e.sender, 98, 50);
    let st = build_state(&keys, true, 4444);
    let rch = e.joiner.join(1).unwrap();
    let rx = WeightSyncer::from_config(&cfg, SyncOptions::default()).unwrap();
    let mut st = st;
    let (a, b) = rt.block_on(async {
        tokio::join!(
            e.tx.rejoin_at(&e.sender, 1, false),
            rx.rejoin_receiver(&mut st, rch, 0)
        )
    });
    let (a, (rx, b)) = (a.unwrap(), b.unwrap());
    assert_eq!((a.kind, b.to, b.deferred), (CatchUpKind::Full, 0, true));
    e.rxs[1] = Some((rx, st));
    sync_live(&rt, &mut e, 2);
    assert_same(&e, &keys, &s);
}

/// A handshake message that does not read fails the handshake naming the message, its wire error the cause.
#[test]
fn an_unreadable_plan_fails_the_handshake_with_its_wire_error_as_the_cause() {
    let rt = rt();
    let keys = simple_keys();
    let cfg = config(&default_settings(false), &keys);
    let mut receiver = build_state(&keys, true, 2);
    let rx = WeightSyncer::from_config(&cfg, SyncOptions::default()).unwrap();
    let (mut ch, mut rxs) = inproc_channel(1);
    let rch = rxs.pop().unwrap();
    let r = rt.block_on(async {
        let sender = async {
            ch.recv_from(0).await.expect("the receiver's metadata");
            let mut plan = wire::encode_plan(&Plan {
                strategy: wire::Strategy::Patch,
                synced: vec![0],
                init_buckets: 0,
            });
            let last = plan.len() - 1;
            plan[last] ^= 1;
            ch.send(&plan).await.expect("send the plan");
        };
        let (_, r) = tokio::join!(sender, rx.init_receiver(&mut receiver, rch));
        r
    });
    let err = r.err().expect("an unreadable plan fails the init");
    assert!(
        matches!(
            &err,
            SyncError::HandshakeMessage {
                source: MessageError::Wire(WireError::Checksum { .. }),
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(err.to_string(), "handshake failed: plan from the sender");
    let chain = crate::error_chain(&err);
    assert!(
        chain.starts_with("handshake failed: plan from the sender: checksum mismatch"),
        "{chain}"
    );
}

/// Repeated versions (RLinf's evaluation syncs) end the replay chain: a receiver that left before the repeat
/// gets the full state, one that left after it replays from the sequence it holds; both end bitwise equal.
#[test]
fn a_repeated_version_ends_the_replay_chain() {
    let rt = rt();
    let (keys, s) = (dense_keys(), patch_settings());
    let cfg = config(&s, &keys);
    let mut e = init_elastic(&rt, &keys, &s, 7, 8);
    for v in [1, 2, 2] {
        mutate_synced(&mut e.sender, 10 + v, 1);
        sync_live(&rt, &mut e, v);
    }
    // Left at version 2 (the second, sync #3): its version is the base of the log's chain.
    let late = leave(&mut e, 1);
    for v in [3, 4] {
        mutate_synced(&mut e.sender, 20 + v, 1);
        sync_live(&rt, &mut e, v);
    }
    let (tx, rx) = rejoin(&rt, &mut e, 1, late, 2, &cfg);
    let (tx, rx) = (tx.unwrap(), rx.unwrap());
    assert_eq!(
        (tx.kind, tx.patches, tx.from, tx.to, rx.to),
        (CatchUpKind::Replay, 2, 2, 4, 4)
    );
    assert_same(&e, &keys, &s);
    // Version 4 again: the chain ends; a receiver left at 4 (sync #5) no longer replays: full.
    let late = leave(&mut e, 1);
    mutate_synced(&mut e.sender, 30, 1);
    sync_live(&rt, &mut e, 4);
    let (tx, rx) = rejoin(&rt, &mut e, 1, late, 4, &cfg);
    let (tx, rx) = (tx.unwrap(), rx.unwrap());
    assert_eq!(
        (tx.kind, tx.to, rx.to),
        (CatchUpKind::Full, 4, 4),
        "{}",
        tx.reason
    );
    assert_same(&e, &keys, &s);
    // Both go on with the next sync.
    mutate_synced(&mut e.sender, 31, 1);
    sync_live(&rt, &mut e, 0);
    assert_same(&e, &keys, &s);
    let seqs: Vec<u64> = e
        .rxs
        .iter()
        .flatten()
        .map(|(rx, _)| rx.sequence())
        .collect();
    assert_eq!(seqs, vec![7, 7]);
}

/// The sender matches tensors by name at every call: a state dict in another order syncs the same, one lacking a
/// synced key is an error naming it (nothing sent, the sync after it still applies).
#[test]
fn the_sender_matches_tensors_by_name_at_every_sync() {
    let rt = rt();
    let keys = simple_keys();
    for bucket in [false, true] {
        let s = default_settings(bucket);
        let mut p = init_pair(&rt, &keys, &s, 11).unwrap();
        let frozen = frozen_after_init(&p, &keys, &s);
        let names: Vec<String> = p.sender.iter().map(|(k, _)| k.to_string()).collect();
        let copy = |st: &StateDict, keep: &dyn Fn(&str) -> bool| {
            let mut out = StateDict::new();
            for k in names.iter().rev().filter(|k| keep(k)) {
                out.insert(k.clone(), st.get(k).unwrap().duplicate());
            }
            out
        };
        mutate(&mut p.sender, 3, 50);
        let reversed = copy(&p.sender, &|_| true);
        let (a, b) = rt
            .block_on(async { tokio::join!(p.tx.sync(&reversed, 1), p.rx.apply(&mut p.receiver)) });
        assert_eq!((a.unwrap().version, b.unwrap().version), (1, 1));
        assert_synced(&p, &keys, &s, &frozen);
        let missing = copy(&p.sender, &|k| k != "w");
        let r = rt.block_on(p.tx.sync(&missing, 2));
        let e = r.expect_err("a synced key is missing");
        assert!(e.to_string().contains("'w'"), "bucket {bucket}: {e}");
        assert_eq!(p.tx.sequence(), 1, "nothing was sent");
        mutate(&mut p.sender, 4, 50);
        sync_once(&rt, &mut p, 2);
        assert_eq!(p.rx.sequence(), 2);
        assert_synced(&p, &keys, &s, &frozen);
    }
}

// ---------------------------------------------------------------------------------------------------------
// self-describing buckets (no handshake)

/// A sender state: f32 weights, a bf16 bias, an i64 and a u8 buffer (`seed` moves the values).
fn described_state(seed: f32) -> StateDict {
    let mut sd = StateDict::new();
    let w: Vec<f32> = (0..96).map(|i| seed + i as f32 * 0.37).collect();
    sd.insert(
        "w".to_string(),
        Tensor::from_slice(DType::F32, &[8, 12], Class::Trainable, &w).unwrap(),
    );
    let b: Vec<half::bf16> = (0..5)
        .map(|i| half::bf16::from_f32(seed * 2.0 + i as f32))
        .collect();
    sd.insert(
        "b".to_string(),
        Tensor::from_slice(DType::Bf16, &[5], Class::Trainable, &b).unwrap(),
    );
    let n: Vec<i64> = vec![(1 << 40) + seed as i64, -(1 << 39)];
    sd.insert(
        "count".to_string(),
        Tensor::from_slice(DType::I64, &[2], Class::Buffer, &n).unwrap(),
    );
    let m: Vec<u8> = (0..3).map(|i| (seed as u8).wrapping_add(i)).collect();
    sd.insert(
        "mask".to_string(),
        Tensor::from_slice(DType::U8, &[3], Class::Buffer, &m).unwrap(),
    );
    sd
}

struct Described {
    tx: SyncSender,
    rx: SyncReceiver,
    sender: StateDict,
    receiver: StateDict,
}

fn described_cfg(load_instant: bool, bucket_dtype: Option<FloatDtype>) -> WeightSyncerConfig {
    let mut cfg = WeightSyncerConfig {
        kind: SyncerKind::Bucket,
        ..WeightSyncerConfig::default()
    };
    cfg.bucket.bucket_size = NonZeroU64::new(200).unwrap();
    cfg.bucket.load_instant = load_instant;
    cfg.bucket.bucket_dtype = bucket_dtype;
    cfg
}

/// A described pair: the receiver has one key the sender does not send (`extra`), and the sender syncs
/// every key but `mask` (which the receiver keeps as it is).
fn described_pair(rt: &tokio::runtime::Runtime, cfg: &WeightSyncerConfig) -> Described {
    let sender = described_state(1.0);
    let mut receiver = described_state(-50.0);
    receiver.insert(
        "extra".to_string(),
        Tensor::from_slice(DType::F32, &[2], Class::Trainable, &[7.0f32, 8.0]).unwrap(),
    );
    let mut tx = WeightSyncer::from_config(cfg, SyncOptions::default()).unwrap();
    tx.settings.part_bytes = 64;
    let rx = WeightSyncer::from_config(cfg, SyncOptions::default()).unwrap();
    let (ch, mut rxs) = inproc_channel(1);
    let keys: Vec<String> = ["w", "b", "count"].iter().map(|k| k.to_string()).collect();
    let (tx, rx) = rt.block_on(async {
        let (tx, _) = tx
            .init_sender_described(&sender, &keys, ch, 0)
            .await
            .unwrap();
        let (rx, _) = rx
            .init_receiver_described(&receiver, rxs.pop().unwrap())
            .await
            .unwrap();
        (tx, rx)
    });
    Described {
        tx,
        rx,
        sender,
        receiver,
    }
}

fn described_sync(rt: &tokio::runtime::Runtime, d: &mut Described, version: u64) -> SyncReport {
    let Described {
        tx,
        rx,
        sender,
        receiver,
    } = d;
    rt.block_on(async {
        let (a, b) = tokio::join!(tx.sync(sender, version), rx.apply(receiver));
        a.unwrap();
        b.unwrap()
    })
}

fn bytes_of(sd: &StateDict, key: &str) -> Vec<u8> {
    sd.get(key).unwrap().bytes().to_vec()
}

#[test]
fn described_buckets_round_trip_by_name_with_versions_as_given() {
    let rt = rt();
    for load_instant in [true, false] {
        for bucket_dtype in [None, Some(FloatDtype::Bfloat16)] {
            let cfg = described_cfg(load_instant, bucket_dtype);
            let mut d = described_pair(&rt, &cfg);
            let mask_before = bytes_of(&d.receiver, "mask");
            for (step, version) in [0u64, 1, 1, 7].into_iter().enumerate() {
                d.sender = described_state(step as f32 + 3.0);
                let r = described_sync(&rt, &mut d, version);
                assert_eq!(r.version, version);
                assert_eq!(d.rx.version(), version);
                let w = d.sender.get("w").unwrap();
                let want = match bucket_dtype {
                    None => w.bytes().to_vec(),
                    Some(_) => cast_copy(&cast_copy_tensor(w, DType::Bf16), DType::F32),
                };
                assert_eq!(
                    bytes_of(&d.receiver, "w"),
                    want,
                    "{load_instant} {bucket_dtype:?}"
                );
                // bf16 stays bf16, integers keep every bit whatever the bucket dtype.
                assert_eq!(bytes_of(&d.receiver, "b"), bytes_of(&d.sender, "b"));
                assert_eq!(bytes_of(&d.receiver, "count"), bytes_of(&d.sender, "count"));
                // Keys the sender does not send stay as they are (strict=False).
                assert_eq!(bytes_of(&d.receiver, "mask"), mask_before);
                assert_eq!(
                    bytes_of(&d.receiver, "extra"),
                    [7.0f32, 8.0]
                        .iter()
                        .flat_map(|v| v.to_ne_bytes())
                        .collect::<Vec<_>>()
                );
                assert_eq!(d.rx.synced_keys(), ["w", "b", "count"]);
                assert_eq!(
                    d.tx.checksum(&d.sender).unwrap(),
                    d.rx.checksum(&d.receiver),
                    "{load_instant} {bucket_dtype:?}"
                );
            }
        }
    }
}

/// `t` cast to `to`, as a tensor (for the expected value of a cast through the wire dtype).
fn cast_copy_tensor(t: &Tensor, to: DType) -> Tensor {
    let bytes = cast_copy(t, to);
    let mut out = Tensor::zeros(to, t.shape(), Class::Trainable).unwrap();
    out.bytes_mut().copy_from_slice(&bytes);
    out
}

/// Deliver `msgs` to the described receiver and apply (stops sending once `apply` returned).
fn described_inject(
    rt: &tokio::runtime::Runtime,
    d: &mut Described,
    msgs: &[Vec<u8>],
) -> Result<SyncReport, SyncError> {
    let (ch, rx, receiver) = (&mut d.tx.ch, &mut d.rx, &mut d.receiver);
    rt.block_on(async {
        let send = async {
            for m in msgs {
                if ch.send(m).await.is_err() {
                    break;
                }
            }
            std::future::pending::<()>().await
        };
        tokio::select! {
            r = rx.apply(receiver) => r,
            () = send => unreachable!("the send future never completes"),
        }
    })
}

/// The messages of `version` from the described sender, not delivered.
fn described_capture(
    rt: &tokio::runtime::Runtime,
    d: &mut Described,
    version: u64,
) -> Vec<Vec<u8>> {
    let (dummy, mut drx) = inproc_channel(1);
    let (dummy, tap) = tapped(dummy);
    let real = std::mem::replace(&mut d.tx.ch, dummy);
    let mut rx = drx.pop().unwrap();
    rt.block_on(async {
        let drain = async { while rx.recv_with(|_| ()).await.is_ok() {} };
        let send = async {
            let r = d.tx.sync(&d.sender, version).await;
            let _ = std::mem::replace(&mut d.tx.ch, real);
            r
        };
        let (r, _) = tokio::join!(send, drain);
        r.unwrap();
    });
    tap.payloads()
}

#[test]
fn described_corrupt_truncated_replayed_and_stale_versions_are_rejected_whole() {
    let rt = rt();
    for load_instant in [true, false] {
        let mut d = described_pair(&rt, &described_cfg(load_instant, None));
        described_sync(&rt, &mut d, 1);
        d.sender = described_state(20.0);
        let old = described_capture(&rt, &mut d, 2);
        assert_eq!(Header::parse(&old[0]).unwrap().0.kind, Kind::Manifest);
        assert!(old.len() > 3, "several buckets and parts: {}", old.len());
        d.sender = described_state(30.0);
        let good = described_capture(&rt, &mut d, 3);
        let snapshot = |d: &Described| -> Vec<Vec<u8>> {
            d.receiver.iter().map(|(_, t)| t.bytes().to_vec()).collect()
        };
        let before = snapshot(&d);
        let mut cases: Vec<(&str, Vec<Vec<u8>>)> = Vec::new();
        let mut bad = good.clone();
        bad[0][wire::HEADER_LEN + 6] ^= 1; // a byte of the manifest's first name
        cases.push(("corrupt manifest", bad));
        let mut bad = good.clone();
        let last = bad.len() - 1;
        bad[last][wire::HEADER_LEN + 1] ^= 0x40; // a byte of the last bucket part
        cases.push(("corrupt bucket", bad));
        // (Not `good`'s buckets: after the cases above they are leftovers of a version given up on, skipped.)
        cases.push(("bucket without manifest", old[1..].to_vec()));
        let mut cut = good[..good.len() - 1].to_vec();
        cut.push(good[0].clone()); // the next thing after a cut-short version: another manifest
        cases.push(("truncated", cut));
        for (what, msgs) in cases {
            let r = described_inject(&rt, &mut d, &msgs);
            assert!(
                matches!(&r, Err(e) if e.is_rejection()),
                "{what}: {:?}",
                r.map(|r| r.version)
            );
            assert_eq!(d.rx.version(), 1, "{what}");
            assert!(
                snapshot(&d) == before,
                "{what}: weights changed (load_instant {load_instant})"
            );
        }
        // The good version (its leftovers from the cases above skipped), then the older one replayed.
        let r = described_inject(&rt, &mut d, &good).unwrap();
        assert_eq!(r.version, 3);
        let applied = snapshot(&d);
        let r = described_inject(&rt, &mut d, &old);
        assert!(
            matches!(&r, Err(e) if e.is_rejection()),
            "{:?}",
            r.map(|r| r.version)
        );
        let err = crate::error_chain(&r.unwrap_err());
        assert!(err.contains("replayed or stale"), "{err}");
        assert_eq!(d.rx.version(), 3);
        assert!(snapshot(&d) == applied);
        let r = described_inject(&rt, &mut d, &good);
        assert!(
            matches!(&r, Err(e) if e.is_rejection()),
            "a replay of the applied version"
        );
        assert!(snapshot(&d) == applied);
    }
}

#[test]
fn described_receiver_refuses_unknown_keys_and_other_shapes_before_writing() {
    let rt = rt();
    for load_instant in [true, false] {
        let cfg = described_cfg(load_instant, None);
        for (what, change) in [
            (
                "lacks",
                Box::new(|sd: &mut StateDict| {
                    // The same keys but `count`, rebuilt.
                    let mut kept = StateDict::new();
                    for (k, t) in sd.iter() {
                        if k != "count" {
                            let mut copy =
                                Tensor::zeros(t.dtype(), t.shape(), Class::Trainable).unwrap();
                            copy.bytes_mut().copy_from_slice(t.bytes());
                            kept.insert(k.to_string(), copy);
                        }
                    }
                    *sd = kept;
                }) as Box<dyn Fn(&mut StateDict)>,
            ),
            (
                "shape",
                Box::new(|sd: &mut StateDict| {
                    sd.insert(
                        "count".to_string(),
                        Tensor::zeros(DType::I64, &[3], Class::Buffer).unwrap(),
                    );
                }),
            ),
            (
                "dtype",
                Box::new(|sd: &mut StateDict| {
                    sd.insert(
                        "count".to_string(),
                        Tensor::zeros(DType::F32, &[2], Class::Buffer).unwrap(),
                    );
                }),
            ),
        ] {
            let sender = described_state(1.0);
            let mut receiver = described_state(-5.0);
            change(&mut receiver);
            let tx = WeightSyncer::from_config(&cfg, SyncOptions::default()).unwrap();
            let rx = WeightSyncer::from_config(&cfg, SyncOptions::default()).unwrap();
            let (ch, mut rxs) = inproc_channel(1);
            let keys: Vec<String> = ["w", "b", "count"].iter().map(|k| k.to_string()).collect();
            let before: Vec<Vec<u8>> = receiver.iter().map(|(_, t)| t.bytes().to_vec()).collect();
            let err = rt.block_on(async {
                let (mut tx, _) = tx
                    .init_sender_described(&sender, &keys, ch, 0)
                    .await
                    .unwrap();
                let (mut rx, _) = rx
                    .init_receiver_described(&receiver, rxs.pop().unwrap())
                    .await
                    .unwrap();
                let (a, b) = tokio::join!(tx.sync(&sender, 1), rx.apply(&mut receiver));
                a.unwrap();
                assert_eq!(rx.version(), 0);
                b.unwrap_err()
            });
            let msg = crate::error_chain(&err);
            assert!(
                err.is_rejection() && msg.contains("'count'"),
                "{what}: {msg}"
            );
            let after: Vec<Vec<u8>> = receiver.iter().map(|(_, t)| t.bytes().to_vec()).collect();
            assert!(before == after, "{what}: weights changed");
        }
    }
}

#[test]
fn described_needs_the_bucket_syncer_and_existing_keys() {
    let rt = rt();
    let patch = WeightSyncerConfig::default();
    let state = described_state(1.0);
    let keys = vec!["w".to_string()];
    let (ch, mut rxs) = inproc_channel(1);
    let tx = WeightSyncer::from_config(&patch, SyncOptions::default()).unwrap();
    let rx = WeightSyncer::from_config(&patch, SyncOptions::default()).unwrap();
    rt.block_on(async {
        let e = tx
            .init_sender_described(&state, &keys, ch, 0)
            .await
            .err()
            .unwrap();
        assert!(matches!(e, SyncError::Config { .. }), "{e}");
        let e = rx
            .init_receiver_described(&state, rxs.pop().unwrap())
            .await
            .err()
            .unwrap();
        assert!(matches!(e, SyncError::Config { .. }), "{e}");
    });
    let cfg = described_cfg(true, None);
    for (keys, key) in [(vec!["w", "nope"], "nope"), (vec!["w", "b", "w"], "w")] {
        let keys: Vec<String> = keys.into_iter().map(String::from).collect();
        let (ch, _rxs) = inproc_channel(1);
        let tx = WeightSyncer::from_config(&cfg, SyncOptions::default()).unwrap();
        let e = rt
            .block_on(tx.init_sender_described(&state, &keys, ch, 0))
            .err()
            .unwrap();
        assert!(
            matches!(&e, SyncError::StateMismatch { key: k, .. } if k == key),
            "{e}"
        );
    }
}

#[test]
fn a_described_sender_made_again_continues_the_sequence() {
    let rt = rt();
    let cfg = described_cfg(true, None);
    let mut d = described_pair(&rt, &cfg);
    described_sync(&rt, &mut d, 4);
    let seq = d.tx.sequence();
    assert_eq!(seq, 1);
    let keys: Vec<String> = ["w", "b", "count"].iter().map(|k| k.to_string()).collect();
    let ch = std::mem::replace(&mut d.tx.ch, inproc_channel(1).0);
    let tx = WeightSyncer::from_config(&cfg, SyncOptions::default()).unwrap();
    d.tx = rt
        .block_on(tx.init_sender_described(&d.sender, &keys, ch, seq))
        .unwrap()
        .0;
    d.sender = described_state(9.0);
    assert_eq!(described_sync(&rt, &mut d, 4).version, 4);
    assert_eq!(d.rx.sequence(), 2);
    assert_eq!(bytes_of(&d.receiver, "w"), bytes_of(&d.sender, "w"));
}

#[test]
fn a_handshake_receiver_is_told_that_the_sender_runs_without_one() {
    let rt = rt();
    let cfg = described_cfg(true, None);
    let sender = described_state(1.0);
    let mut receiver = described_state(2.0);
    let keys = vec!["w".to_string()];
    let (ch, mut rxs) = inproc_channel(1);
    let tx = WeightSyncer::from_config(&cfg, SyncOptions::default()).unwrap();
    let rx = WeightSyncer::from_config(&cfg, SyncOptions::default()).unwrap();
    let err = rt.block_on(async {
        let (mut tx, _) = tx
            .init_sender_described(&sender, &keys, ch, 0)
            .await
            .unwrap();
        // The handshake receiver's metadata goes nowhere (the sender does not read it); its first message is a manifest.
        let (a, b) = tokio::join!(
            tx.sync(&sender, 0),
            rx.init_receiver(&mut receiver, rxs.pop().unwrap())
        );
        a.unwrap();
        b.err().unwrap()
    });
    assert!(
        crate::error_chain(&err).contains("without a handshake"),
        "{err}"
    );
}
// -------------------------------------------------------------------------------------------------------
// Per-call bounds and receivers' reports (the Python API's timeouts, acks, stage/commit/abort)

fn timed_out(err: &SyncError) -> Option<(&'static str, transport::Peer, Duration)> {
    match err {
        SyncError::Transport(TransportError::Timeout { op, peer, timeout }) => {
            Some((op, peer.clone(), *timeout))
        }
        _ => None,
    }
}

#[test]
fn a_bounded_apply_times_out_and_the_receiver_stays_usable() {
    let rt = rt();
    let keys = simple_keys();
    for bucket in [false, true] {
        let s = default_settings(bucket);
        let mut p = init_pair(&rt, &keys, &s, 21).unwrap();
        let before: Vec<Vec<u8>> = keys
            .iter()
            .map(|k| p.receiver.get(&k.name).unwrap().bytes().to_vec())
            .collect();
        p.rx.set_bound(Some(Duration::from_millis(50)));
        let t0 = Instant::now();
        let err = rt.block_on(p.rx.apply(&mut p.receiver)).unwrap_err();
        assert!(
            t0.elapsed() < Duration::from_secs(2),
            "the bound, not the 5 s channel timeout"
        );
        let (_, peer, timeout) = timed_out(&err).expect("a timeout");
        assert_eq!(
            (peer, timeout),
            (transport::Peer::Sender, Duration::from_millis(50))
        );
        for (k, b) in keys.iter().zip(&before) {
            assert_eq!(p.receiver.get(&k.name).unwrap().bytes(), b.as_slice());
        }
        p.rx.set_bound(None);
        mutate(&mut p.sender, 3, 50);
        let (_, applied) = sync_once(&rt, &mut p, 7);
        assert_eq!(applied.version, 7);
        assert_synced(&p, &keys, &s, &[]);
    }
}

#[test]
fn a_sync_that_times_out_waiting_for_a_slot_changes_nothing() {
    let rt = rt();
    let keys = simple_keys();
    for bucket in [false, true] {
        let s = default_settings(bucket);
        let mut p = init_pair(&rt, &keys, &s, 22).unwrap();
        // One message per version (a bucket version in one part), so each sync takes one slot.
        p.tx.settings.part_bytes = 1 << 20;
        // Fill every slot: the receiver reads nothing yet.
        for v in 1..=transport::DEFAULT_SLOTS as u64 {
            mutate(&mut p.sender, v, 30);
            rt.block_on(p.tx.sync(&p.sender, v)).unwrap();
        }
        mutate(&mut p.sender, 99, 30);
        p.tx.set_bound(Some(Duration::from_millis(50)));
        let err = rt.block_on(p.tx.sync(&p.sender, 50)).unwrap_err();
        let (_, peer, timeout) = timed_out(&err).expect("a timeout");
        assert_eq!(
            (peer, timeout),
            (transport::Peer::Receiver(0), Duration::from_millis(50))
        );
        p.tx.set_bound(None);
        assert_eq!(p.tx.version(), transport::DEFAULT_SLOTS as u64);
        for v in 1..=transport::DEFAULT_SLOTS as u64 {
            assert_eq!(rt.block_on(p.rx.apply(&mut p.receiver)).unwrap().version, v);
        }
        // The change made before the timed-out sync travels with the next one.
        let (_, applied) = sync_once(&rt, &mut p, 60);
        assert_eq!(applied.version, 60);
        assert_synced(&p, &keys, &s, &[]);
    }
}

#[test]
fn reports_tell_the_sender_what_each_receiver_installed_or_declined() {
    let rt = rt();
    let keys = simple_keys();
    for bucket in [false, true] {
        let s = default_settings(bucket);
        let mut p = init_pair(&rt, &keys, &s, 23).unwrap();
        p.rx.set_reports(true);
        p.tx.poll_reports().unwrap();
        assert!(p.tx.acked().is_empty());
        mutate(&mut p.sender, 1, 50);
        sync_once(&rt, &mut p, 4);
        rt.block_on(p.tx.wait_applied()).unwrap();
        assert_eq!(
            p.tx.acked(),
            vec![(
                0,
                wire::Stamp {
                    version: 4,
                    sequence: 1
                }
            )]
        );
        // Staged, then committed: reported too.
        mutate(&mut p.sender, 2, 50);
        let pending = rt.block_on(async {
            let (a, b) = tokio::join!(p.tx.sync(&p.sender, 5), p.rx.receive());
            a.unwrap();
            b.unwrap()
        });
        rt.block_on(p.rx.commit(pending, &mut p.receiver)).unwrap();
        rt.block_on(p.tx.wait_applied()).unwrap();
        assert_eq!(p.tx.acked()[0].1.version, 5);
        assert_synced(&p, &keys, &s, &[]);
        // Staged, then declined: counted, the acked version stays, waiting for it says who declined.
        mutate(&mut p.sender, 3, 50);
        let pending = rt.block_on(async {
            let (a, b) = tokio::join!(p.tx.sync(&p.sender, 6), p.rx.receive());
            a.unwrap();
            b.unwrap()
        });
        rt.block_on(p.rx.decline(pending, "checks failed"));
        assert_eq!(p.rx.version(), 5);
        let err = rt.block_on(p.tx.wait_applied()).unwrap_err();
        assert!(
            matches!(&err, SyncError::Declined { rank: 0, version: 6, reason } if reason == "checks failed"),
            "{err}"
        );
        let (counts, last) = p.tx.declined();
        assert_eq!(counts, vec![(0, 1)]);
        assert_eq!(last.map(|d| (d.rank, d.version)), Some((0, 6)));
        assert_eq!(p.tx.acked()[0].1.version, 5);
    }
}

#[test]
fn waiting_for_acks_times_out_naming_the_missing_receivers() {
    let rt = rt();
    let keys = simple_keys();
    let s = default_settings(false);
    let mut p = init_pair(&rt, &keys, &s, 24).unwrap();
    p.rx.set_reports(true);
    rt.block_on(p.tx.sync(&p.sender, 1)).unwrap();
    p.tx.set_bound(Some(Duration::from_millis(50)));
    let err = rt.block_on(p.tx.wait_applied()).unwrap_err();
    let (op, peer, _) = timed_out(&err).expect("a timeout");
    assert_eq!(peer, transport::Peer::Receiver(0));
    assert!(op.contains("reports"), "{op}");
    p.tx.set_bound(None);
    rt.block_on(p.rx.apply(&mut p.receiver)).unwrap();
    rt.block_on(p.tx.wait_applied()).unwrap();
}

#[test]
fn reports_need_a_channel_that_carries_them() {
    let rt = rt();
    let (ch, _io) = crate::transport::bridge::bridge_sender();
    let mut ch = ch;
    assert!(matches!(
        ch.try_recv_from(0, &|_| true),
        Err(TransportError::Config { .. })
    ));
    assert!(matches!(
        rt.block_on(ch.wait_any_from(&[0])),
        Err(TransportError::Config { .. })
    ));
}

/// A TCP fan-out on loopback (the Python API's `tcp_sender` / `tcp_receiver`): patch and bucket versions reach
/// two receivers bit for bit, each reports what it installed, and the sender waits for both.
#[test]
fn weights_and_acks_cross_a_tcp_fan_out() {
    use crate::transport::{TcpFanConfig, TcpFanReceiver, TcpFanSender};
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let keys = simple_keys();
    let timeout = Duration::from_secs(20);
    for bucket in [false, true] {
        let s = default_settings(bucket);
        let cfg = config(&s, &keys);
        let mut sender = build_state(&keys, false, 5);
        let mut states: Vec<StateDict> = (0..2).map(|i| build_state(&keys, true, 30 + i)).collect();
        let mut tx = WeightSyncer::from_config(&cfg, SyncOptions::default()).unwrap();
        tx.settings.part_bytes = 40;
        let rx = || WeightSyncer::from_config(&cfg, SyncOptions::default()).unwrap();
        rt.block_on(async {
            let listener = TcpFanSender::listen(TcpFanConfig {
                receivers: 2,
                token: b"run-token".to_vec(),
                timeout,
                ..TcpFanConfig::default()
            })
            .await
            .unwrap();
            let addr = listener.local_addr().unwrap().to_string();
            let (ch, c0, c1) = tokio::join!(
                listener.accept(),
                TcpFanReceiver::connect(&addr, 0, b"run-token", "r0", timeout),
                TcpFanReceiver::connect(&addr, 1, b"run-token", "r1", timeout),
            );
            let synced = sender.synced_keys();
            let [s0, s1] = &mut states[..] else {
                unreachable!()
            };
            let (a, b0, b1) = tokio::join!(
                tx.init_sender(&sender, &synced, ch.unwrap()),
                rx().init_receiver(s0, c0.unwrap()),
                rx().init_receiver(s1, c1.unwrap()),
            );
            let (mut tx, _) = a.unwrap();
            let (mut r0, _) = b0.unwrap();
            let (mut r1, _) = b1.unwrap();
            r0.set_reports(true);
            r1.set_reports(true);
            for v in 1..=3u64 {
                mutate_synced(&mut sender, v, 40);
                let (a, b0, b1) = tokio::join!(
                    async {
                        tx.sync(&sender, v).await?;
                        tx.wait_applied().await
                    },
                    r0.apply(s0),
                    r1.apply(s1),
                );
                a.unwrap();
                assert_eq!((b0.unwrap().version, b1.unwrap().version), (v, v));
                let acked: Vec<(usize, u64)> = tx
                    .acked()
                    .into_iter()
                    .map(|(r, st)| (r, st.version))
                    .collect();
                assert_eq!(acked, vec![(0, v), (1, v)]);
            }
            let want = tx.checksum(&sender).unwrap();
            assert_eq!((r0.checksum(s0), r1.checksum(s1)), (want, want));
            tx.flush().await.unwrap();
        });
    }
}

/// `rejoin_joined` before a sync catches up whoever joined since (the Python API's late joiners): nothing
/// when nobody joined, then the restarted rank, which then follows the next version like the other one.
#[test]
fn rejoin_joined_catches_up_whoever_joined_before_the_next_sync() {
    let rt = rt();
    let keys = simple_keys();
    for bucket in [false, true] {
        let s = default_settings(bucket);
        let mut cfg = config(&s, &keys);
        cfg.patch.replay_versions = 4;
        let mut e = init_elastic(&rt, &keys, &s, 31, 4);
        for v in 1..=2 {
            mutate_synced(&mut e.sender, v, 30);
            sync_live(&rt, &mut e, v);
        }
        assert!(
            rt.block_on(e.tx.rejoin_joined(&e.sender))
                .unwrap()
                .is_empty()
        );
        let _gone = leave(&mut e, 1);
        mutate_synced(&mut e.sender, 3, 30);
        sync_live(&rt, &mut e, 3);
        let rch = e.joiner.join(1).unwrap();
        let mut st = build_state(&keys, true, 0x5EED);
        let rx = WeightSyncer::from_config(&cfg, SyncOptions::default()).unwrap();
        let (served, joined) = rt.block_on(async {
            // The join reaches the sender before it looks.
            tokio::time::sleep(Duration::from_millis(20)).await;
            tokio::join!(
                e.tx.rejoin_joined(&e.sender),
                rx.rejoin_receiver(&mut st, rch, 0)
            )
        });
        let served = served.unwrap();
        assert_eq!(served.iter().map(|r| r.rank).collect::<Vec<_>>(), vec![1]);
        let (rx, _) = joined.unwrap();
        e.rxs[1] = Some((rx, st));
        mutate_synced(&mut e.sender, 4, 30);
        sync_live(&rt, &mut e, 4);
        assert_same(&e, &keys, &s);
    }
}

/// Four synced tensors of several widths (and a frozen one), so a patch with tiny parts has four parts.
fn part_keys() -> Vec<KeySpec> {
    let key = |name: &str, tx, rx, shape: Vec<usize>, class| KeySpec {
        name: name.into(),
        tx,
        rx,
        shape,
        class,
    };
    vec![
        key("a", DType::F32, DType::Bf16, vec![16, 8], Class::Trainable),
        key("b", DType::F32, DType::F32, vec![40], Class::Trainable),
        key("frozen", DType::F32, DType::F32, vec![3], Class::Frozen),
        key("c", DType::I64, DType::I64, vec![9], Class::Buffer),
        key("d", DType::U8, DType::U8, vec![33], Class::Trainable),
    ]
}

/// A patch pair whose every version travels as one part per synced tensor (four parts).
fn part_pair(rt: &tokio::runtime::Runtime, delta: bool, seed: u64) -> Pair {
    let s = Settings {
        delta,
        ..default_settings(false)
    };
    let mut p = init_pair(rt, &part_keys(), &s, seed).unwrap();
    p.tx.settings.patch_part_bytes = 1;
    p
}

fn state_bytes(sd: &StateDict) -> Vec<Vec<u8>> {
    sd.iter().map(|(_, t)| t.bytes().to_vec()).collect()
}

/// A corrupt or truncated LAST part, after the parts before it were validated and installed, takes those
/// parts back out: the receiver's weights and version are bitwise as before. Sparse delta entries (undone by
/// subtracting), dense entries and absolute COO entries (undone from the saved old values) alike.
#[test]
fn a_corrupt_last_part_takes_the_installed_parts_back_out() {
    let rt = rt();
    for (delta, density) in [(true, 5), (true, 100), (false, 5), (false, 100)] {
        for truncate in [false, true] {
            let mut p = part_pair(&rt, delta, 31);
            sync_once(&rt, &mut p, 1);
            let before = state_bytes(&p.receiver);
            mutate(&mut p.sender, 7, density);
            let good = capture(&rt, &mut p, 2);
            assert_eq!(good.len(), 4, "one part per synced tensor");
            for m in &good {
                let (h, _) = Header::parse(m).unwrap();
                assert_eq!((h.kind, h.count, h.version), (Kind::Patch, 4, 2));
            }
            let mut bad = good.clone();
            let last = bad.last_mut().unwrap();
            if truncate {
                last.truncate(last.len() - 1);
            } else {
                let at = last.len() - 1;
                last[at] ^= 0x20;
            }
            let r = inject_and_apply(&rt, &mut p, &bad);
            assert!(
                matches!(&r, Err(e) if e.is_rejection()),
                "delta {delta} density {density}: accepted {:?}",
                r.map(|r| r.version)
            );
            assert_eq!(p.rx.version(), 1);
            assert!(
                state_bytes(&p.receiver) == before,
                "delta {delta} density {density} truncate {truncate}: the weights changed"
            );
            // The genuine version still applies whole afterwards.
            assert_eq!(inject_and_apply(&rt, &mut p, &good).unwrap().version, 2);
            assert_synced(&p, &part_keys(), &default_settings(false), &[]);
        }
    }
}

/// A part of another version, a repeated part or a later part without the ones before it is rejected, and
/// the parts already installed are taken back out.
#[test]
fn out_of_order_replayed_and_foreign_parts_are_rejected_whole() {
    let rt = rt();
    let mut p = part_pair(&rt, true, 32);
    sync_once(&rt, &mut p, 1);
    let before = state_bytes(&p.receiver);
    mutate(&mut p.sender, 8, 20);
    let v2 = capture(&rt, &mut p, 2);
    mutate(&mut p.sender, 9, 20);
    let v3 = capture(&rt, &mut p, 3);
    let cases: Vec<(Vec<Vec<u8>>, &str)> = vec![
        (vec![v2[0].clone(), v2[2].clone()], "expecting part 1/4"),
        (vec![v2[0].clone(), v2[0].clone()], "expecting part 1/4"),
        (vec![v2[0].clone(), v3[1].clone()], "expecting part 1/4"),
        (vec![v3[1].clone()], "without the parts before it"),
    ];
    for (msgs, expect) in cases {
        let err = inject_and_apply(&rt, &mut p, &msgs).unwrap_err();
        assert!(err.is_rejection(), "{err}");
        assert!(
            crate::error_chain(&err).contains(expect),
            "{} should say {expect:?}",
            crate::error_chain(&err)
        );
        assert_eq!(p.rx.version(), 1);
        assert!(
            state_bytes(&p.receiver) == before,
            "{expect}: the weights changed"
        );
    }
    // Version 2 whole still applies; then version 3 on it.
    assert_eq!(inject_and_apply(&rt, &mut p, &v2).unwrap().version, 2);
    assert_eq!(inject_and_apply(&rt, &mut p, &v3).unwrap().version, 3);
    assert_synced(&p, &part_keys(), &default_settings(false), &[]);
    // Replaying version 3's first part again is stale.
    let err = inject_and_apply(&rt, &mut p, &v3[..1]).unwrap_err();
    assert!(crate::error_chain(&err).contains("not newer"), "{err}");
}

/// Receivers slower than the sender: the sender publishes several versions' parts back to back (waiting
/// only for free transport slots) while each receiver takes its time between parts and versions; every
/// receiver ends bitwise on the last version, through each version in turn.
#[test]
fn parts_arrive_while_receivers_are_slower_than_the_sender() {
    let rt = rt();
    let keys = part_keys();
    let s = default_settings(false);
    let cfg = config(&s, &keys);
    let mut sender = build_state(&keys, false, 33);
    let mut tx = WeightSyncer::from_config(&cfg, SyncOptions { threads: 1 }).unwrap();
    tx.settings.patch_part_bytes = 1;
    let (ch, rxs) = inproc_channel(2);
    let synced = sender.synced_keys();
    let mut receivers: Vec<StateDict> = (0..2).map(|i| build_state(&keys, true, 40 + i)).collect();
    let steps = 4u64;
    rt.block_on(async {
        let rx_ends = rxs
            .into_iter()
            .zip(receivers.iter_mut())
            .map(|(ch, state)| {
                let rx = WeightSyncer::from_config(&cfg, SyncOptions { threads: 1 }).unwrap();
                async move {
                    let (mut rx, _) = rx.init_receiver(state, ch).await.unwrap();
                    for v in 1..=steps {
                        tokio::time::sleep(Duration::from_millis(15)).await;
                        assert_eq!(rx.apply(state).await.unwrap().version, v);
                    }
                    rx.checksum(state)
                }
            });
        let send = async {
            let (mut tx, _) = tx.init_sender(&sender, &synced, ch).await.unwrap();
            for v in 1..=steps {
                mutate(&mut sender, v, 30);
                let sent = tx.sync(&sender, v).await.unwrap();
                assert_eq!(sent.messages, 4);
            }
            tx.flush().await.unwrap();
            tx.checksum(&sender).unwrap()
        };
        let mut rx_ends = rx_ends.collect::<Vec<_>>().into_iter();
        let (Some(a), Some(b)) = (rx_ends.next(), rx_ends.next()) else {
            unreachable!("two receivers")
        };
        let (want, a, b) = tokio::join!(send, a, b);
        assert_eq!((a, b), (want, want));
    });
}

/// A bounded wait that runs out between two parts takes the installed parts back out (weights and version
/// as before, so the caller may go on with them) and keeps them: the next call goes on with the version.
#[test]
fn a_wait_that_runs_out_between_parts_keeps_the_version_for_the_next_call() {
    let rt = rt();
    let mut p = part_pair(&rt, true, 34);
    sync_once(&rt, &mut p, 1);
    let before = state_bytes(&p.receiver);
    mutate(&mut p.sender, 10, 40);
    let v2 = capture(&rt, &mut p, 2);
    p.rx.set_bound(Some(Duration::from_millis(50)));
    let err = inject_and_apply(&rt, &mut p, &v2[..2]).unwrap_err();
    assert!(timed_out(&err).is_some(), "{err}");
    assert_eq!(p.rx.version(), 1);
    assert!(state_bytes(&p.receiver) == before, "the weights changed");
    p.rx.set_bound(None);
    let r = inject_and_apply(&rt, &mut p, &v2[2..]).unwrap();
    assert_eq!(r.version, 2);
    assert_synced(&p, &part_keys(), &default_settings(false), &[]);
}

/// The background path (`receive`, then `install`) joins a version's parts into one body, validated whole
/// before any of it is written: delta and COO coding, COO parts of different coordinate widths included.
#[test]
fn a_received_patch_joins_its_parts_and_installs_later() {
    let rt = rt();
    let mut keys = part_keys();
    keys.push(KeySpec {
        name: "wide".into(),
        tx: DType::U8,
        rx: DType::U8,
        shape: vec![2, 300],
        class: Class::Trainable,
    });
    for delta in [true, false] {
        let s = Settings {
            delta,
            ..default_settings(false)
        };
        let mut p = init_pair(&rt, &keys, &s, 35).unwrap();
        p.tx.settings.patch_part_bytes = 1;
        for v in 1..=2u64 {
            mutate(&mut p.sender, 11 + v, 20);
            let (sent, pending) =
                rt.block_on(async { tokio::join!(p.tx.sync(&p.sender, v), p.rx.receive()) });
            assert_eq!(sent.unwrap().messages, 5);
            let pending = pending.unwrap();
            assert_eq!(pending.report().messages, 5);
            assert_eq!(pending.install(&mut p.receiver).unwrap().version, v);
            assert_synced(&p, &keys, &s, &[]);
        }
    }
}

/// A device installer's stand-in: counts the check-and-install calls and the ones that wrote, and installs
/// on the host (the one-walk device path itself is tested in `patch/scatter.rs`).
#[derive(Default)]
struct CountingInstaller {
    checks: std::sync::atomic::AtomicUsize,
    writes: std::sync::atomic::AtomicUsize,
}

impl PatchInstaller for CountingInstaller {
    fn install(
        &self,
        patch: &patch::ValidPatch,
        state: &mut StateDict,
        threads: NonZeroUsize,
    ) -> Result<(), SyncError> {
        self.writes
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        patch::install(patch, state, threads);
        Ok(())
    }

    fn check_install(
        &self,
        patch: patch::PlannedPatch,
        state: &mut StateDict,
        threads: NonZeroUsize,
    ) -> Result<patch::ValidPatch, CheckInstallError> {
        self.checks
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let valid = patch
            .check(threads)
            .map_err(|reason| CheckInstallError::Rejected { reason })?;
        self.install(&valid, state, threads)?;
        Ok(valid)
    }
}

/// With a device installer the receiver checks the entry table, then hands the patch to the installer's
/// check-and-install: the genuine patch installs through that call, and a patch whose stream fails the check is
/// a rejection (weights and version untouched, nothing written).
#[test]
fn a_device_installer_checks_the_streams_and_a_bad_one_is_rejected_untouched() {
    use std::sync::atomic::Ordering::SeqCst;
    let rt = rt();
    let keys = simple_keys();
    let s = default_settings(false);
    // Seed 12: one patch part per version.
    let mut p = init_pair(&rt, &keys, &s, 12).unwrap();
    sync_once(&rt, &mut p, 1);
    let installer = Arc::new(CountingInstaller::default());
    p.rx.set_patch_installer(installer.clone());
    mutate_synced(&mut p.sender, 5, 30);
    let (_, r) = sync_once(&rt, &mut p, 2);
    assert!(r.changed > 0);
    assert_eq!(
        (installer.checks.load(SeqCst), installer.writes.load(SeqCst)),
        (1, 1)
    );
    assert_synced(&p, &keys, &s, &[]);
    // One change of `w` (32 elements): a sparse entry whose first gap is its index.
    p.sender
        .get_mut("w")
        .unwrap()
        .as_mut_slice::<f32>()
        .unwrap()[5] += 1000.0;
    let good = capture(&rt, &mut p, 3);
    let bad: Vec<Vec<u8>> = good
        .iter()
        .map(|m| {
            let (h, body) = Header::parse(m).unwrap();
            if h.kind != Kind::Patch {
                return m.clone();
            }
            let mut pb = wire::decode_patch_body(body, usize::MAX).unwrap();
            assert!(
                !pb.entries[0].dense && pb.entries[0].nnz == 1,
                "{:?}",
                pb.entries
            );
            // An index past the entry's 32 elements (a 1-byte gap of 127).
            pb.streams[0][0] = 0x7f;
            wire::message(h, &wire::encode_patch_body(&pb, Codec::Plain).body)
        })
        .collect();
    assert_ne!(bad, good);
    let before: Vec<Vec<u8>> = p.receiver.iter().map(|(_, t)| t.bytes().to_vec()).collect();
    let r = inject_and_apply(&rt, &mut p, &bad);
    assert!(matches!(&r, Err(e) if e.is_rejection()), "{r:?}");
    assert!(crate::error_chain(&r.unwrap_err()).contains("outside the entry's range"));
    assert_eq!(
        (installer.checks.load(SeqCst), installer.writes.load(SeqCst)),
        (2, 1)
    );
    let after: Vec<Vec<u8>> = p.receiver.iter().map(|(_, t)| t.bytes().to_vec()).collect();
    assert_eq!(before, after, "state changed by a rejected patch");
    assert_eq!(p.rx.version(), 2);
}

mod device_bucket_tests;

/// A patch builder that diffs another copy of the state (a device's, as the GPU builder reads the CUDA tensors
/// themselves): the caller's host view may be stale.
struct OtherCopyBuilder(std::sync::Arc<std::sync::Mutex<StateDict>>);

impl offload::PatchBuilder for OtherCopyBuilder {
    fn build(
        &mut self,
        snap: &mut [patch::SnapTensor],
        _state: &StateDict,
        threads: std::num::NonZeroUsize,
        built: &mut patch::Built,
    ) -> Result<(), SyncError> {
        let held = self.0.lock().unwrap();
        patch::build(snap, &held, threads, built).map_err(|reason| SyncError::StateMismatch {
            key: "(device copy)".into(),
            reason,
        })
    }
}

#[test]
fn a_patch_sender_building_from_another_copy_needs_no_host_view() {
    let rt = rt();
    let keys = simple_keys();
    let s = default_settings(false);
    let mut p = init_pair(&rt, &keys, &s, 7).unwrap();
    assert!(p.tx.needs_host_view(), "the host build reads the host view");
    let device = std::sync::Arc::new(std::sync::Mutex::new(p.sender.duplicate()));
    assert!(p.tx.set_patch_builder(Box::new(OtherCopyBuilder(device.clone()))));
    assert!(
        !p.tx.needs_host_view(),
        "a builder that reads its own copy needs no host view"
    );
    for version in 1..=3 {
        mutate_synced(&mut device.lock().unwrap(), version, 30);
        // The host view is stale (what a worker's host copies of CUDA tensors are after its train step).
        for (_, t) in p.sender.iter_mut() {
            t.bytes_mut().fill(0x77);
        }
        sync_once(&rt, &mut p, version);
        let held = device.lock().unwrap();
        for k in keys.iter().filter(|k| k.class.is_synced()) {
            assert_eq!(
                p.receiver.get(&k.name).unwrap().bytes(),
                expected(&s, k, held.get(&k.name).unwrap()).as_slice(),
                "version {version}, key {}",
                k.name
            );
        }
        assert_eq!(
            p.tx.checksum(&held).unwrap(),
            p.rx.checksum(&p.receiver),
            "the sender's checksum is of the snapshot, not the stale host view"
        );
    }
}

#[test]
fn a_bucket_senders_checksum_is_the_state_checksum_exactly_when_no_dtype_changes() {
    let rt = rt();
    let same: Vec<KeySpec> = simple_keys()
        .into_iter()
        .map(|mut k| {
            k.rx = k.tx;
            k
        })
        .collect();
    let mut s = default_settings(true);
    let mut p = init_pair(&rt, &same, &s, 3).unwrap();
    for version in 1..=2 {
        mutate_synced(&mut p.sender, version, 40);
        sync_once(&rt, &mut p, version);
        let keys =
            p.tx.checksum_as_state(&p.sender)
                .expect("no cast: the state's checksum")
                .to_vec();
        assert_eq!(keys, p.tx.synced_keys());
        assert_eq!(
            state_checksum(&p.sender, &keys),
            p.tx.checksum(&p.sender).unwrap()
        );
        assert_eq!(
            state_checksum(&p.receiver, &keys),
            p.rx.checksum(&p.receiver)
        );
    }
    // Casts on the way: once a version crossed the wire, the sender's checksum is of the cast values (before,
    // the receivers hold the weights they loaded).
    s.bucket_dtype = Some(FloatDtype::Bfloat16);
    let mut p = init_pair(&rt, &same, &s, 3).unwrap();
    assert!(p.tx.checksum_as_state(&p.sender).is_some());
    mutate_synced(&mut p.sender, 1, 40);
    sync_once(&rt, &mut p, 1);
    assert!(p.tx.checksum_as_state(&p.sender).is_none());
    let p = init_pair(&rt, &simple_keys(), &default_settings(true), 3).unwrap();
    assert!(
        p.tx.checksum_as_state(&p.sender).is_none(),
        "a receiver in another dtype"
    );
    // A patch sender's checksum is of its snapshot.
    let p = init_pair(&rt, &same, &default_settings(false), 3).unwrap();
    assert!(p.tx.checksum_as_state(&p.sender).is_none());
}

/// A bucket sender's checksum is of what the receivers hold: before the first version (no init bootstrap)
/// the weights they loaded themselves, the state as cast to their dtypes; after it, the round trip through
/// `bucket_dtype`.
#[test]
fn a_bucket_senders_checksum_follows_what_crossed_the_wire() {
    let rt = rt();
    for rx_dtype in [DType::F32, DType::Bf16] {
        let mut cfg = WeightSyncerConfig {
            kind: SyncerKind::Bucket,
            ..WeightSyncerConfig::default()
        };
        cfg.bucket.bucket_dtype = Some(FloatDtype::Float16);
        let w: Vec<f32> = (0..96).map(|i| 1.0 + i as f32 * 0.37).collect();
        let mut sender = StateDict::new();
        let t = Tensor::from_slice(DType::F32, &[96], Class::Trainable, &w).unwrap();
        // The receiver loaded the same weights in its own dtype.
        let mut receiver = StateDict::new();
        receiver.insert(
            "w".to_string(),
            Tensor::from_bytes(rx_dtype, &[96], Class::Trainable, &cast_copy(&t, rx_dtype))
                .unwrap(),
        );
        sender.insert("w".to_string(), t);
        let tx = WeightSyncer::from_config(&cfg, SyncOptions::default()).unwrap();
        let rx = WeightSyncer::from_config(&cfg, SyncOptions::default()).unwrap();
        let (ch, mut rxs) = inproc_channel(1);
        let keys = vec!["w".to_string()];
        let (mut tx, mut rx) = rt.block_on(async {
            let r = rxs.pop().unwrap();
            let (a, b) = tokio::join!(
                tx.init_sender(&sender, &keys, ch),
                rx.init_receiver(&mut receiver, r)
            );
            (a.unwrap().0, b.unwrap().0)
        });
        assert_eq!(
            tx.checksum(&sender).unwrap(),
            rx.checksum(&receiver),
            "{rx_dtype:?}: before any version"
        );
        // fp32 receivers are not the state's dtype once the wire rounded to fp16: no device hash of the state.
        assert_eq!(
            tx.checksum_as_state(&sender).is_some(),
            rx_dtype == DType::F32
        );
        rt.block_on(async {
            let (a, b) = tokio::join!(tx.sync(&sender, 1), rx.apply(&mut receiver));
            a.unwrap();
            b.unwrap();
        });
        assert_eq!(
            tx.checksum(&sender).unwrap(),
            rx.checksum(&receiver),
            "{rx_dtype:?}: after the first version"
        );
        assert!(tx.checksum_as_state(&sender).is_none(), "{rx_dtype:?}");
    }
}
