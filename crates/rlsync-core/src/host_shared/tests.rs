//! Tests of the host-shared arena: whole versions only, replay equals a private receiver, faults, processes.

use super::*;
use crate::syncer::settings::{SyncerKind, WeightSyncerConfig};
use crate::syncer::{SyncOptions, SyncSender};
use crate::tensor::{Class, DType, Tensor};
use crate::transport::inproc_channel_with_timeout;

const WAIT: Duration = Duration::from_secs(5);

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// A name no other test (or test process) uses.
fn arena_name(test: &str) -> String {
    format!("rlsync-hs-test.{}.{test}", std::process::id())
}

fn shm_file(name: &str) -> std::path::PathBuf {
    std::path::Path::new("/dev/shm").join(name)
}

/// A small model: trainable f32 and bf16 tensors, an i64 buffer, a frozen tensor, a scalar.
fn model(seed: u64) -> StateDict {
    let mut sd = StateDict::new();
    let spec: [(&str, DType, &[usize], Class); 5] = [
        ("w", DType::F32, &[48, 33], Class::Trainable),
        ("b", DType::Bf16, &[17], Class::Trainable),
        ("steps", DType::I64, &[], Class::Buffer),
        ("frozen", DType::F32, &[9], Class::Frozen),
        ("h", DType::F32, &[3, 5, 7], Class::Trainable),
    ];
    for (i, (name, dtype, shape, class)) in spec.into_iter().enumerate() {
        let mut t = Tensor::zeros(dtype, shape, class).unwrap();
        let mut x = seed.wrapping_mul(0x9e37_79b9).wrapping_add(i as u64) | 1;
        for b in t.bytes_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = (x % 200) as u8; // no NaN patterns for f32 (high byte < 0x7f... values stay finite-ish)
        }
        sd.insert(name, t);
    }
    sd
}

/// Change about `pct` % of the bytes of every synced tensor (each a small move).
fn step(state: &mut StateDict, seed: u64, pct: u64) {
    let mut x = seed | 1;
    for (_, t) in state.iter_mut() {
        if t.class() == Class::Frozen {
            continue;
        }
        for b in t.bytes_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            if x % 100 < pct {
                *b = b.wrapping_add(1 + (x >> 40) as u8 % 3);
            }
        }
    }
}

fn syncer(kind: SyncerKind) -> WeightSyncer {
    let cfg = WeightSyncerConfig {
        kind,
        ..WeightSyncerConfig::default()
    };
    WeightSyncer::from_config(&cfg, SyncOptions::default()).unwrap()
}

fn same_values(a: &StateDict, b: &StateDict) -> bool {
    a.len() == b.len()
        && a.iter()
            .all(|(k, t)| b.get(k).is_some_and(|u| u.bytes() == t.bytes()))
}

/// A trainer, an applier over an arena and a private receiver (the reference) on one in-process channel.
struct Rig {
    sender: SyncSender,
    trainer: StateDict,
    applier: Applier,
    private: SyncReceiver,
    private_state: StateDict,
    version: u64,
}

impl Rig {
    async fn new(name: &str, kind: SyncerKind) -> Rig {
        let trainer = model(1);
        let template = model(2);
        let mut private_state = model(2);
        let mut applier = Applier::create(name, &template, 8).unwrap();
        let (ch, mut rxs) = inproc_channel_with_timeout(2, WAIT);
        let (rx_private, rx_arena) = (rxs.remove(0), rxs.remove(0));
        let synced = trainer.synced_keys();
        let (sender, init, private) = tokio::join!(
            syncer(kind).init_sender(&trainer, &synced, ch),
            applier.init(syncer(kind), rx_arena, 0, true),
            syncer(kind).init_receiver(&mut private_state, rx_private),
        );
        let (sender, _) = sender.unwrap();
        let published = init.unwrap();
        assert_eq!((published.version, published.buffer), (0, 0));
        let (private, _) = private.unwrap();
        Rig {
            sender,
            trainer,
            applier,
            private,
            private_state,
            version: 0,
        }
    }

    /// One training step and its sync, applied by the applier and the private receiver.
    async fn next(&mut self, pct: u64) -> Published {
        self.version += 1;
        step(&mut self.trainer, self.version, pct);
        let (sent, published, private) = tokio::join!(
            self.sender.sync(&self.trainer, self.version),
            self.applier.apply(WAIT),
            self.private.apply(&mut self.private_state),
        );
        sent.unwrap();
        private.unwrap();
        published.unwrap()
    }
}

#[test]
fn a_reader_sees_init_then_each_version_equal_to_a_private_receiver() {
    let name = arena_name("equal");
    rt().block_on(async {
        let mut rig = Rig::new(&name, SyncerKind::Patch).await;
        let mut reader = Reader::attach(&name, WAIT).await.unwrap();
        assert_eq!(reader.held().version, 0);
        assert!(same_values(reader.state(), &rig.private_state));
        assert_eq!(
            reader.held().checksum,
            Some(rig.private.checksum(&rig.private_state))
        );
        for v in 1..=6 {
            let p = rig.next(3).await;
            assert_eq!(p.version, v);
            let held = reader.refresh().expect("a newer version was published");
            assert_eq!((held.version, held.buffer), (v, p.buffer));
            assert!(
                same_values(reader.state(), &rig.private_state),
                "version {v}"
            );
            assert_eq!(
                held.checksum,
                Some(rig.private.checksum(&rig.private_state))
            );
            assert_eq!(
                held.checksum,
                Some(rig.sender.checksum(&rig.trainer).unwrap())
            );
            assert!(reader.refresh().is_none(), "nothing newer");
        }
    });
    assert!(
        !shm_file(&name).exists(),
        "dropping the applier unlinks the arena"
    );
}
