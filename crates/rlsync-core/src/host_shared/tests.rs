//! Tests of the host-shared arena: whole versions only, streaming equals a private receiver, faults, processes.

use std::sync::Arc;
use std::sync::atomic::Ordering;

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
    let mut cfg = WeightSyncerConfig {
        kind,
        ..WeightSyncerConfig::default()
    };
    // Several buckets per version (the sender's setting; receivers read the count).
    cfg.bucket.bucket_size = std::num::NonZeroU64::new(512).unwrap();
    WeightSyncer::from_config(&cfg, SyncOptions::default()).unwrap()
}

fn same_values(a: &StateDict, b: &StateDict) -> bool {
    a.len() == b.len()
        && a.iter()
            .all(|(k, t)| b.get(k).is_some_and(|u| u.bytes() == t.bytes()))
}

/// What the relay does to a payload message it forwards to the applier.
const PASS: u8 = 0;
const CORRUPT: u8 = 1;
const DROP: u8 = 2;
/// Keep this message and every later one (in the log) until the mode changes.
const HOLD: u8 = 3;

/// A task between the trainer and the applier: it logs every payload message and does what `mode` says to the
/// one after `after` more have passed (CORRUPT and DROP once, then PASS); the test may inject messages too.
struct Relay {
    state: std::sync::Mutex<RelayState>,
    down: tokio::sync::Mutex<transport::Sender>,
}

/// The log and what to do, changed together (a message is logged and judged at once).
struct RelayState {
    log: Vec<Vec<u8>>,
    mode: u8,
    after: u32,
}

impl Relay {
    fn state(&self) -> std::sync::MutexGuard<'_, RelayState> {
        self.state.lock().unwrap()
    }

    /// Once `logged` messages were logged (and judged), do `mode` to the message after the next `after`.
    async fn arm(&self, mode: u8, after: u32, logged: usize) {
        let started = Instant::now();
        loop {
            {
                let mut st = self.state();
                if st.log.len() >= logged {
                    (st.mode, st.after) = (mode, after);
                    return;
                }
            }
            assert!(
                started.elapsed() < WAIT,
                "the relay never got {logged} messages"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Messages logged so far.
    fn logged(&self) -> usize {
        self.state().log.len()
    }

    /// Send the logged messages `from..` to the applier again, as they came from the trainer.
    async fn resend(&self, from: usize) {
        let msgs: Vec<Vec<u8>> = self.state().log[from..].to_vec();
        let mut down = self.down.lock().await;
        for m in msgs {
            down.send(&m).await.unwrap();
        }
    }
}

/// A trainer, an applier over an arena and a private receiver (the reference: the receive-then-install path)
/// on one in-process channel; every version travels as several patch parts or buckets. With a relay, the
/// applier's payloads pass through a task that can corrupt, drop or hold them.
struct Rig {
    sender: SyncSender,
    trainer: StateDict,
    applier: Applier,
    private: SyncReceiver,
    private_state: StateDict,
    version: u64,
    kind: SyncerKind,
    joiner: crate::transport::inproc::InProcJoiner,
    relay: Option<Arc<Relay>>,
}

/// Forward the applier's metadata upstream, then every payload downstream, doing what the relay's mode says.
async fn relay(mut up: transport::Receiver, relay: Arc<Relay>) {
    let meta = {
        let mut down = relay.down.lock().await;
        match down.recv_from(0).await {
            Ok(meta) => meta,
            Err(_) => return,
        }
    };
    if up.send(&meta).await.is_err() {
        return;
    }
    while let Ok(mut msg) = up.recv_with(|m| m.to_vec()).await {
        let mode = {
            let mut st = relay.state();
            st.log.push(msg.clone());
            if st.after > 0 {
                st.after -= 1;
                PASS
            } else if st.mode == HOLD {
                HOLD
            } else {
                std::mem::replace(&mut st.mode, PASS)
            }
        };
        match mode {
            CORRUPT => {
                let at = msg.len() / 2;
                msg[at] ^= 0x10;
            }
            DROP | HOLD => continue,
            _ => {}
        }
        if relay.down.lock().await.send(&msg).await.is_err() {
            return;
        }
    }
}

impl Rig {
    async fn new(name: &str, kind: SyncerKind, with_relay: bool) -> Rig {
        let trainer = model(1);
        let template = model(2);
        let mut private_state = model(2);
        let mut applier = Applier::create(name, &template, 8).unwrap();
        let (ch, mut rxs, joiner) = crate::transport::inproc::inproc_channel_elastic(2, WAIT);
        let (rx_private, mut rx_arena) = (rxs.remove(0), rxs.remove(0));
        let relay = with_relay.then(|| {
            let (down, mut down_rxs) = inproc_channel_with_timeout(1, WAIT);
            let ctl = Arc::new(Relay {
                state: std::sync::Mutex::new(RelayState {
                    log: Vec::new(),
                    mode: PASS,
                    after: 0,
                }),
                down: tokio::sync::Mutex::new(down),
            });
            tokio::spawn(relay(
                rx_arena_take(&mut rx_arena, &mut down_rxs),
                ctl.clone(),
            ));
            ctl
        });
        let synced = trainer.synced_keys();
        let (sender, init, private) = tokio::join!(
            syncer(kind).init_sender(&trainer, &synced, ch),
            applier.init(syncer(kind), rx_arena, 0, true),
            syncer(kind).init_receiver(&mut private_state, rx_private),
        );
        let (mut sender, _) = sender.unwrap();
        // One patch part per synced tensor, buckets in messages of 64 bytes.
        sender.set_part_sizes(1, 64);
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
            kind,
            joiner,
            relay,
        }
    }

    /// One training step and its sync, applied by the applier and the private receiver (received whole, then
    /// installed: the path that validates a version whole before writing any of it).
    async fn next(&mut self, pct: u64) -> Result<Published, HostSharedError> {
        self.version += 1;
        step(&mut self.trainer, self.version, pct);
        let private = async {
            let pending = self.private.receive().await?;
            pending.install(&mut self.private_state)
        };
        let (sent, published, private) = tokio::join!(
            self.sender.sync(&self.trainer, self.version),
            self.applier.apply(WAIT),
            private,
        );
        sent.unwrap();
        private.unwrap();
        published
    }

    /// A published version: its buffer bitwise the private receiver's state, its checksum that of the
    /// buffer's synced keys and the trainer's.
    fn check(&self, p: &Published) {
        let view = &self.applier.views[usize::from(p.buffer)];
        assert!(
            same_values(view, &self.private_state),
            "version {}",
            p.version
        );
        let keys = self.applier.synced_keys();
        assert_eq!(
            p.checksum,
            Some(state_checksum(view, keys)),
            "version {}",
            p.version
        );
        assert_eq!(
            p.checksum,
            Some(self.sender.checksum(&self.trainer).unwrap())
        );
        assert_eq!(self.applier.active().map(|h| h.checksum), Some(p.checksum));
    }

    /// What a reader can observe: the active index, the generation, the active buffer's facts and bytes.
    fn seen(&self) -> (u8, u64, arena::BufferMeta, Vec<Vec<u8>>) {
        let seg = &self.applier.seg;
        let active = seg.active();
        let bytes = self.applier.views[usize::from(active)]
            .iter()
            .map(|(_, t)| t.bytes().to_vec())
            .collect();
        (active, seg.generation(), seg.meta(active), bytes)
    }

    /// The back buffer's bytes, per tensor.
    fn back_bytes(&self) -> Vec<Vec<u8>> {
        let back = 1 - self.applier.seg.active();
        self.applier.views[usize::from(back)]
            .iter()
            .map(|(_, t)| t.bytes().to_vec())
            .collect()
    }

    /// The back buffer equals the active one on every synced key, and `before` (its bytes then) on the others.
    fn back_holds_the_active_version(&self, before: &[Vec<u8>]) -> bool {
        let active = self.applier.seg.active();
        let (front, back) = (
            &self.applier.views[usize::from(active)],
            &self.applier.views[usize::from(1 - active)],
        );
        let keys = self.applier.synced_keys();
        back.iter().zip(before).all(|((k, t), old)| {
            if keys.iter().any(|s| s == k) {
                front.get(k).is_some_and(|f| f.bytes() == t.bytes())
            } else {
                t.bytes() == old.as_slice()
            }
        })
    }

    /// What a wait that runs out must leave alone: both buffers' bytes and the header's facts.
    fn snapshot(&self) -> (Vec<Vec<u8>>, u8, u64, [arena::BufferMeta; 2]) {
        let bytes = self
            .applier
            .views
            .iter()
            .flat_map(|v| v.iter().map(|(_, t)| t.bytes().to_vec()))
            .collect();
        let seg = &self.applier.seg;
        (
            bytes,
            seg.active(),
            seg.generation(),
            [seg.meta(0), seg.meta(1)],
        )
    }
}

/// The applier's end: with a relay, the relay takes the channel's end and the applier gets the relay's.
fn rx_arena_take(
    rx_arena: &mut transport::Receiver,
    down_rxs: &mut Vec<transport::Receiver>,
) -> transport::Receiver {
    std::mem::replace(rx_arena, down_rxs.remove(0))
}

#[test]
fn a_reader_sees_init_then_each_version_equal_to_a_private_receiver() {
    let name = arena_name("equal");
    rt().block_on(async {
        let mut rig = Rig::new(&name, SyncerKind::Patch, false).await;
        let mut reader = Reader::attach(&name, WAIT).await.unwrap();
        assert_eq!(reader.held().version, 0);
        assert!(same_values(reader.state(), &rig.private_state));
        assert_eq!(
            reader.held().checksum,
            Some(rig.private.checksum(&rig.private_state))
        );
        for v in 1..=6 {
            let p = rig.next(3).await.unwrap();
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

#[test]
fn bucket_versions_and_patches_after_them_equal_a_private_receiver() {
    let name = arena_name("bucket");
    rt().block_on(async {
        let mut rig = Rig::new(&name, SyncerKind::Bucket, false).await;
        let mut reader = Reader::attach(&name, WAIT).await.unwrap();
        for v in 1..=4 {
            let p = rig.next(5).await.unwrap();
            assert_eq!(p.report.kind, crate::syncer::SyncKind::Bucket);
            let held = reader.refresh().unwrap();
            assert_eq!(held.version, v);
            assert!(
                same_values(reader.state(), &rig.private_state),
                "version {v}"
            );
            assert_eq!(
                held.checksum,
                Some(rig.sender.checksum(&rig.trainer).unwrap())
            );
        }
    });
}

/// A rejected update changes nothing a reader can observe (active index, generation, the active buffer and
/// its facts); the back buffer, caught up first, holds the active version (its frozen keys untouched). The
/// versions refused, sent again whole, then install.
#[test]
fn a_rejected_update_changes_nothing_readers_see_and_the_back_buffer_holds_the_active_version() {
    let name = arena_name("reject");
    rt().block_on(async {
        let mut rig = Rig::new(&name, SyncerKind::Patch, true).await;
        let relay = rig.relay.clone().unwrap();
        for _ in 0..3 {
            let p = rig.next(4).await.unwrap();
            rig.check(&p);
        }
        let seen = rig.seen();
        let back = rig.back_bytes();
        assert!(
            !rig.back_holds_the_active_version(&back),
            "the back buffer is two versions old before an apply"
        );
        // A corrupt first part: refused when received.
        let from = relay.logged();
        relay.arm(CORRUPT, 0, from).await;
        let err = rig.next(4).await.unwrap_err();
        assert!(err.is_rejection(), "{err}");
        assert!(
            rig.seen() == seen,
            "a corrupt payload changed what readers see"
        );
        assert!(rig.back_holds_the_active_version(&back));
        // A patch on a version the applier never got (held whole by the relay): refused at its first part.
        relay.arm(HOLD, 0, from + 4).await;
        {
            rig.version += 1;
            step(&mut rig.trainer, rig.version, 4);
            let (sent, private) = tokio::join!(
                rig.sender.sync(&rig.trainer, rig.version),
                rig.private.apply(&mut rig.private_state)
            );
            sent.unwrap();
            private.unwrap();
        }
        relay.arm(PASS, 0, from + 8).await;
        let err = rig.next(4).await.unwrap_err();
        assert!(err.is_rejection(), "{err}");
        assert!(err.to_string().contains("weight sync"), "{err}");
        assert!(
            crate::error_chain(&err).contains("a full resync is needed"),
            "{}",
            crate::error_chain(&err)
        );
        assert!(
            rig.seen() == seen,
            "a patch on another base changed what readers see"
        );
        assert!(rig.back_holds_the_active_version(&back));
        let reader = Reader::attach(&name, WAIT).await.unwrap();
        assert_eq!(reader.held().version, 3);
        drop(reader);
        // The three versions again, whole: the applier takes them in turn (skipping the refused one's rest).
        let applier = &mut rig.applier;
        let applied = async {
            for v in 4..=6 {
                let p = applier.apply(WAIT).await.unwrap();
                assert_eq!(p.version, v);
            }
        };
        tokio::join!(relay.resend(from), applied);
        let p = rig.next(4).await.unwrap();
        rig.check(&p);
    });
}

/// Every version of a patch or bucket syncer streams into the arena part by part (four patch parts, many
/// bucket messages) and equals, bitwise, a private receiver that receives each version whole and installs it;
/// the published checksum, folded in while the parts land, is the buffer's.
#[test]
fn streaming_equals_receive_then_install_over_many_versions() {
    for kind in [SyncerKind::Patch, SyncerKind::Bucket] {
        let name = arena_name(&format!("stream-{kind:?}"));
        rt().block_on(async {
            let mut rig = Rig::new(&name, kind, false).await;
            for v in 1..=45u64 {
                let pct = [2, 0, 7, 100, 30][v as usize % 5];
                let p = rig.next(pct).await.unwrap();
                assert_eq!(p.version, v);
                assert!(p.report.messages > 1, "{kind:?}: version {v} came whole");
                rig.check(&p);
            }
        });
    }
}

#[test]
fn a_corrupt_later_patch_part_is_taken_back_out_and_the_version_installs_when_sent_again() {
    a_corrupt_later_part(SyncerKind::Patch);
}

#[test]
fn a_corrupt_later_bucket_is_taken_back_out_and_the_version_installs_when_sent_again() {
    a_corrupt_later_part(SyncerKind::Bucket);
}

/// A corrupt part after others were installed into the back buffer: rejected, taken back out (a patch
/// receiver's back buffer holds the active version, a bucket receiver's is as it was), readers see nothing;
/// the genuine version sent again installs, and so do the versions after it (checksums folded correctly).
fn a_corrupt_later_part(kind: SyncerKind) {
    let name = arena_name(&format!("later-{kind:?}"));
    rt().block_on(async {
        let mut rig = Rig::new(&name, kind, true).await;
        let relay = rig.relay.clone().unwrap();
        let mut per_version = 0;
        for _ in 0..3 {
            let from = relay.logged();
            let p = rig.next(5).await.unwrap();
            rig.check(&p);
            per_version = relay.logged() - from;
        }
        assert!(
            per_version > 2,
            "{kind:?}: {per_version} messages a version"
        );
        let seen = rig.seen();
        let back = rig.back_bytes();
        let from = relay.logged();
        // The second to last message: the parts or buckets before it are installed by then.
        relay.arm(CORRUPT, (per_version - 2) as u32, from).await;
        let err = rig.next(5).await.unwrap_err();
        assert!(err.is_rejection(), "{kind:?}: {err}");
        assert!(rig.seen() == seen, "{kind:?}: readers see a change");
        match kind {
            SyncerKind::Patch => assert!(rig.back_holds_the_active_version(&back)),
            SyncerKind::Bucket => assert!(rig.back_bytes() == back, "the back buffer changed"),
        }
        let (_, p) = tokio::join!(relay.resend(from), rig.applier.apply(WAIT));
        let p = p.unwrap();
        assert_eq!(p.version, rig.version);
        rig.check(&p);
        for _ in 0..3 {
            let p = rig.next(5).await.unwrap();
            rig.check(&p);
        }
    });
}

/// A channel wait that runs out between two patch parts takes the installed parts back out (readers see
/// nothing; the back buffer holds the active version) and keeps them: the next apply goes on with the version.
#[test]
fn a_wait_that_runs_out_between_parts_keeps_them_for_the_next_apply() {
    let name = arena_name("partial");
    rt().block_on(async {
        let mut rig = Rig::new(&name, SyncerKind::Patch, true).await;
        let relay = rig.relay.clone().unwrap();
        for _ in 0..2 {
            rig.next(6).await.unwrap();
        }
        let seen = rig.seen();
        let back = rig.back_bytes();
        let from = relay.logged();
        relay.arm(HOLD, 2, from).await;
        rig.version += 1;
        step(&mut rig.trainer, rig.version, 6);
        if let Some(r) = rig.applier.receiver_mut() {
            r.set_bound(Some(Duration::from_millis(150)));
        }
        let (sent, applied, private) = tokio::join!(
            rig.sender.sync(&rig.trainer, rig.version),
            rig.applier.apply(WAIT),
            rig.private.apply(&mut rig.private_state)
        );
        sent.unwrap();
        private.unwrap();
        let err = applied.unwrap_err();
        assert!(
            matches!(
                &err,
                HostSharedError::Sync {
                    source: SyncError::Transport(crate::transport::TransportError::Timeout { .. }),
                    ..
                }
            ),
            "{err}"
        );
        assert!(rig.seen() == seen, "readers see a change");
        assert!(rig.back_holds_the_active_version(&back));
        if let Some(r) = rig.applier.receiver_mut() {
            r.set_bound(None);
        }
        relay.arm(PASS, 0, from + 4).await;
        let (_, p) = tokio::join!(relay.resend(from + 2), rig.applier.apply(WAIT));
        let p = p.unwrap();
        // The two parts kept, then the two held ones.
        assert_eq!((p.version, p.report.messages), (rig.version, 4));
        rig.check(&p);
        let p = rig.next(6).await.unwrap();
        rig.check(&p);
    });
}

/// The folded checksum equals the whole-state one, in sync order and out of it (a part writing a tensor
/// already hashed: hashed again from scratch), with parts that write nothing synced.
#[test]
fn the_folded_checksum_equals_the_whole_one() {
    let mut state = model(5);
    let keys = state.synced_keys();
    assert_eq!(keys, ["w", "b", "steps", "h"]);
    let position = [Some(0), Some(1), Some(2), None, Some(3)];
    let orders: [&[&[usize]]; 5] = [
        &[&[0], &[1], &[2], &[4]],
        &[&[0, 1], &[], &[4]],
        &[],
        &[&[3], &[2, 4]],
        &[&[1], &[0], &[4]],
    ];
    for (i, parts) in orders.iter().enumerate() {
        let mut fold = Fold::new(&keys, &position);
        for (k, part) in parts.iter().enumerate() {
            // Each part writes its tensors, then reports them.
            for &o in *part {
                if let Some((_, t)) = state.get_index_mut(o) {
                    t.bytes_mut()[0] = t.bytes()[0].wrapping_add((i + k + 1) as u8);
                }
            }
            fold.part(part, &state);
        }
        assert_eq!(
            fold.finish(&state),
            state_checksum(&state, &keys),
            "order {i}"
        );
    }
}

/// Every synced tensor of the held buffer hashes to the checksum published for it: a whole version.
fn whole(reader: &Reader, keys: &[String]) -> bool {
    reader.held().checksum == Some(state_checksum(reader.state(), keys))
}

#[test]
fn readers_in_threads_see_only_whole_versions_while_many_patches_are_applied() {
    readers_in_threads(SyncerKind::Patch);
}

#[test]
fn readers_in_threads_see_only_whole_versions_while_many_buckets_are_applied() {
    readers_in_threads(SyncerKind::Bucket);
}

/// Three reader threads check every version they hold (checksum == the published one) and flip whenever they
/// can, while the applier applies 40 sparse versions and a dense one.
fn readers_in_threads(kind: SyncerKind) {
    let name = arena_name(&format!("threads-{kind:?}"));
    let rt = rt();
    let mut rig = rt.block_on(Rig::new(&name, kind, false));
    let keys = rig.applier.synced_keys().to_vec();
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let readers: Vec<_> = (0..3)
        .map(|_| {
            let (name, keys, done) = (name.clone(), keys.clone(), done.clone());
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            let mut reader = rt.block_on(Reader::attach(&name, WAIT)).unwrap();
            std::thread::spawn(move || {
                let (mut checks, mut seen, mut last) = (0u64, 0u64, reader.held().generation);
                while !done.load(Ordering::SeqCst) {
                    assert!(whole(&reader, &keys), "torn version {:?}", reader.held());
                    checks += 1;
                    if let Some(h) = reader.refresh() {
                        assert!(h.generation > last, "went back from {last} to {h:?}");
                        last = h.generation;
                        seen += 1;
                    }
                }
                (checks, seen)
            })
        })
        .collect();
    rt.block_on(async {
        for _ in 0..40 {
            rig.next(2).await.unwrap();
        }
        rig.next(100).await.unwrap(); // a dense version: every element changes
    });
    done.store(true, Ordering::SeqCst);
    for r in readers {
        let (checks, seen) = r.join().unwrap();
        assert!(
            checks > 0 && seen > 0,
            "checks {checks}, versions seen {seen}"
        );
    }
}

/// The role this test binary plays when a test runs it as a reader process (`RLSYNC_HS_CHILD=mode:name`).
fn child_role() -> Option<(String, String)> {
    let v = std::env::var("RLSYNC_HS_CHILD").ok()?;
    let (mode, name) = v.split_once(':')?;
    Some((mode.to_owned(), name.to_owned()))
}

/// This test binary, running only test `test` as a reader process of `mode` on arena `name`.
fn spawn_child(test: &str, mode: &str, name: &str) -> std::process::Child {
    std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture", "--test-threads", "1"])
        .env("RLSYNC_HS_CHILD", format!("{mode}:{name}"))
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap()
}

/// A reader process: `check` verifies every held version until version `final` is held; `hold` holds the
/// first version forever (until killed).
fn run_child(mode: &str, name: &str) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut reader = rt.block_on(Reader::attach(name, WAIT)).unwrap();
    match mode {
        "hold" => loop {
            std::thread::park();
        },
        _ => {
            let target: u64 = mode.trim_start_matches("check").parse().unwrap();
            let keys: Vec<String> = reader.state().synced_keys();
            while reader.held().version < target {
                assert!(whole(&reader, &keys), "torn version {:?}", reader.held());
                reader.refresh();
            }
            assert!(whole(&reader, &keys));
        }
    }
}

#[test]
fn a_reader_in_another_process_sees_only_whole_versions() {
    const TEST: &str = "host_shared::tests::a_reader_in_another_process_sees_only_whole_versions";
    if let Some((mode, name)) = child_role() {
        return run_child(&mode, &name);
    }
    let name = arena_name("process");
    rt().block_on(async {
        let mut rig = Rig::new(&name, SyncerKind::Patch, false).await;
        let mut child = spawn_child(TEST, "check30", &name);
        // Wait for the child's slot (it holds version 0) so it sees the versions go by.
        let pid = child.id();
        let started = Instant::now();
        while !rig.applier.seg.holders(0).contains(&pid) {
            assert!(started.elapsed() < WAIT, "the child never attached");
            assert!(
                child.try_wait().unwrap().is_none(),
                "the child exited early"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        for _ in 0..30 {
            rig.next(3).await.unwrap();
        }
        let status = tokio::task::spawn_blocking(move || child.wait())
            .await
            .unwrap()
            .unwrap();
        assert!(status.success(), "the reader process failed: {status}");
        assert!(rig.applier.seg.holders(0).is_empty() && rig.applier.seg.holders(1).is_empty());
    });
}

#[test]
fn the_async_back_buffer_wait_yields_so_dropping_it_ends_it_and_it_ends_when_the_reader_leaves() {
    let name = arena_name("released");
    rt().block_on(async {
        let mut rig = Rig::new(&name, SyncerKind::Patch, false).await;
        // A reader of this process holds version 0's buffer A; version 1 goes to B, so A is the back buffer.
        let mut reader = Reader::attach(&name, WAIT).await.unwrap();
        assert_eq!(rig.next(3).await.unwrap().buffer, 1);
        let me = std::process::id();
        assert_eq!(rig.applier.back_buffer_holders(), [me]);
        // Both branches are polled by this thread: a wait that blocked it would never let the timer win.
        tokio::select! {
            r = rig.applier.back_buffer_released(Duration::from_secs(3600)) => {
                panic!("the wait ended while the reader held the back buffer: {r:?}")
            }
            () = tokio::time::sleep(Duration::from_millis(50)) => {}
        }
        let err = rig
            .applier
            .back_buffer_released(Duration::from_millis(20))
            .await
            .unwrap_err();
        match &err {
            HostSharedError::BackBufferHeld { buffer, pids, .. } => {
                assert_eq!((*buffer, pids.as_slice()), (0, &[me][..]), "{err}");
            }
            e => panic!("expected BackBufferHeld, got {e}"),
        }
        assert_eq!(reader.refresh().map(|h| h.buffer), Some(1));
        rig.applier.back_buffer_released(WAIT).await.unwrap();
        let p = rig.next(3).await.unwrap();
        assert_eq!((p.version, p.buffer), (2, 0));
        rig.check(&p);
    });
}

#[test]
fn a_live_reader_holding_the_back_buffer_times_out_apply_and_a_killed_one_is_cleared() {
    const TEST: &str = "host_shared::tests::a_live_reader_holding_the_back_buffer_times_out_apply_and_a_killed_one_is_cleared";
    if let Some((mode, name)) = child_role() {
        return run_child(&mode, &name);
    }
    let name = arena_name("held");
    rt().block_on(async {
        let mut rig = Rig::new(&name, SyncerKind::Patch, false).await;
        let mut child = spawn_child(TEST, "hold", &name);
        let pid = child.id();
        let started = Instant::now();
        while !rig.applier.seg.holders(0).contains(&pid) {
            assert!(started.elapsed() < WAIT, "the child never attached");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        // Version 1 goes to buffer B; then the child's buffer A is the back buffer.
        assert_eq!(rig.next(3).await.unwrap().buffer, 1);
        let before = rig.snapshot();
        let err = rig
            .applier
            .wait_back_buffer(Duration::from_millis(200))
            .unwrap_err();
        match &err {
            HostSharedError::BackBufferHeld { buffer, pids, .. } => {
                assert_eq!((*buffer, pids.as_slice()), (0, &[pid][..]), "{err}");
            }
            e => panic!("expected BackBufferHeld, got {e}"),
        }
        assert!(err.to_string().contains(&pid.to_string()), "{err}");
        assert!(rig.snapshot() == before);
        child.kill().unwrap();
        child.wait().unwrap();
        rig.applier.wait_back_buffer(WAIT).unwrap();
        assert!(
            rig.applier.seg.holders(0).is_empty(),
            "the dead reader's slot is cleared"
        );
        let p = rig.next(3).await.unwrap();
        assert_eq!((p.version, p.buffer), (2, 0));
        let reader = Reader::attach(&name, WAIT).await.unwrap();
        assert!(same_values(reader.state(), &rig.private_state));
    });
}

#[test]
fn the_arena_is_private_exclusive_and_gone_after_unlink() {
    let name = arena_name("mode");
    let old = nix::sys::stat::umask(nix::sys::stat::Mode::empty());
    let made = Applier::create(&name, &model(3), 4);
    nix::sys::stat::umask(old);
    let mut applier = made.unwrap();
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(shm_file(&name))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "even with umask 000");
    assert!(matches!(
        Applier::create(&name, &model(3), 4),
        Err(HostSharedError::Exists { .. })
    ));
    applier.set_unlink_on_drop(false);
    drop(applier);
    assert!(shm_file(&name).exists(), "kept for its owner");
    assert!(Applier::unlink(&name).unwrap());
    assert!(!shm_file(&name).exists());
    assert!(!Applier::unlink(&name).unwrap(), "nothing left to unlink");
    assert!(matches!(
        Applier::create("../etc", &model(3), 4),
        Err(HostSharedError::Name { .. })
    ));
    assert!(matches!(
        Applier::create(&name, &model(3), 0),
        Err(HostSharedError::Readers { .. })
    ));
}

#[test]
fn readers_wait_boundedly_and_foreign_segments_are_typed_errors() {
    let rt = rt();
    let name = arena_name("absent");
    let err = rt
        .block_on(Reader::attach(&name, Duration::from_millis(30)))
        .unwrap_err();
    assert!(matches!(err, HostSharedError::NotCreated { .. }), "{err}");
    let applier = Applier::create(&name, &model(3), 4).unwrap();
    let err = rt
        .block_on(Reader::attach(&name, Duration::from_millis(30)))
        .unwrap_err();
    assert!(matches!(err, HostSharedError::NotPublished { .. }), "{err}");
    assert!(
        Applier::reopen(&name, &model(3)).is_ok(),
        "the same layout reopens"
    );
    let mut other = StateDict::new();
    other.insert(
        "w",
        Tensor::zeros(DType::F32, &[2], Class::Trainable).unwrap(),
    );
    let err = Applier::reopen(&name, &other).map(|_| ()).unwrap_err();
    assert!(matches!(err, HostSharedError::Layout { .. }), "{err}");
    drop(applier);
    // A segment of someone else's under the name.
    let foreign = arena_name("foreign");
    let path = format!("/{foreign}");
    let fd = nix::sys::mman::shm_open(
        path.as_str(),
        nix::fcntl::OFlag::O_CREAT | nix::fcntl::OFlag::O_RDWR,
        nix::sys::stat::Mode::S_IRUSR | nix::sys::stat::Mode::S_IWUSR,
    )
    .unwrap();
    nix::unistd::ftruncate(&fd, 8192).unwrap();
    nix::unistd::write(&fd, b"NOTRLSYNC-and-more-bytes").unwrap();
    let err = rt.block_on(Reader::attach(&foreign, WAIT)).unwrap_err();
    assert!(
        matches!(
            err,
            HostSharedError::Foreign {
                source: FormatError::Magic,
                ..
            }
        ),
        "{err}"
    );
    let err = Applier::reopen(&foreign, &model(3))
        .map(|_| ())
        .unwrap_err();
    assert!(matches!(err, HostSharedError::Foreign { .. }), "{err}");
    assert!(Applier::unlink(&foreign).unwrap());
}

#[test]
fn a_restarted_applier_reopens_and_rejoins_and_readers_keep_a_whole_version() {
    let name = arena_name("restart");
    rt().block_on(async {
        let mut rig = Rig::new(&name, SyncerKind::Patch, false).await;
        let mut reader = Reader::attach(&name, WAIT).await.unwrap();
        for _ in 0..3 {
            rig.next(3).await.unwrap();
            reader.refresh().unwrap();
        }
        // The applier dies (its process would; the name stays for its owner).
        let template = model(2);
        let mut dead = Applier::create(&arena_name("restart-spare"), &template, 1).unwrap();
        std::mem::swap(&mut dead, &mut rig.applier);
        dead.set_unlink_on_drop(false);
        drop(dead);
        assert_eq!(reader.held().version, 3);
        assert!(whole(&reader, &reader.state().synced_keys()));
        // Training goes on without it.
        for _ in 0..2 {
            rig.version += 1;
            step(&mut rig.trainer, rig.version, 3);
            let (sent, private) = tokio::join!(
                rig.sender.sync(&rig.trainer, rig.version),
                rig.private.apply(&mut rig.private_state)
            );
            sent.unwrap();
            private.unwrap();
        }
        let mut applier = Applier::reopen(&name, &template).unwrap();
        let rch = rig.joiner.join(1).unwrap();
        let (sent, rejoined) = tokio::join!(
            rig.sender.rejoin(&rig.trainer, 1),
            applier.rejoin(syncer(rig.kind), rch, true, WAIT)
        );
        sent.unwrap();
        let (published, catch_up) = rejoined.unwrap();
        assert_eq!((published.version, catch_up.from, catch_up.to), (5, 3, 5));
        let spare = std::mem::replace(&mut rig.applier, applier);
        drop(spare);
        rig.applier.set_unlink_on_drop(true);
        let held = reader.refresh().unwrap();
        assert_eq!(held.version, 5);
        assert!(same_values(reader.state(), &rig.private_state));
        for v in 6..=8 {
            rig.next(3).await.unwrap();
            assert_eq!(reader.wait_newer(v - 1, WAIT).await.unwrap().version, v);
            assert!(
                same_values(reader.state(), &rig.private_state),
                "version {v}"
            );
        }
    });
    assert!(!shm_file(&name).exists());
}

#[test]
fn the_ends_move_between_threads() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}
    send_sync::<Reader>();
    send::<Applier>();
}
