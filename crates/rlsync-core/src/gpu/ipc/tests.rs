//! The GPU channel's protocol and lifecycle on the CPU: the device work done by the reference kernels over a
//! simulated device memory that the sender and receiver threads share (as processes share a GPU).

use std::thread;

use super::reference::{
    self, RefReceiver, RefSender, SharedHost, SharedSim, SimMemory as _, read_vec,
};
use super::*;
use crate::gpu::reference::Memory;

type Shared = SharedSim;
type FakeSender = RefSender<SharedSim>;
type FakeReceiver = RefReceiver<SharedSim>;
type Corruption = reference::Corruption<SharedSim>;

fn lock(h: &Shared) -> std::sync::MutexGuard<'_, SharedHost> {
    h.lock()
}

/// (elements, width) of the test state: partial tiles, an empty tensor, every width, and one u8 tensor
/// large enough for its pool (1/16) to overflow.
pub(crate) const SHAPES: [(u64, usize); 6] = [
    (4096 * 3 + 5, 2),
    (0, 4),
    (1000, 4),
    (333, 8),
    (9000, 2),
    (1_200_000, 1),
];

pub(crate) fn layout() -> Layout {
    Layout::new(&SHAPES).unwrap()
}

/// Tensors of SHAPES in `host` filled from `seed`; their addresses.
pub(crate) fn tensors(host: &Shared, seed: u64) -> Vec<u64> {
    let mut h = lock(host);
    // A distinct odd seed per tensor (`rng::bytes` sets the low bit).
    let mut x = seed | 1;
    SHAPES
        .iter()
        .map(|&(n, w)| {
            x = x.wrapping_add(2);
            h.mem
                .alloc(&crate::gpu::reference::rng::bytes(n as usize * w, x))
        })
        .collect()
}

pub(crate) fn contents(host: &Shared, addrs: &[u64]) -> Vec<Vec<u8>> {
    let h = lock(host);
    addrs
        .iter()
        .zip(SHAPES)
        .map(|(&a, (n, w))| h.mem.read(a, n * w as u64).unwrap().to_vec())
        .collect()
}

/// Change `count` elements of every tensor (every `stride`-th byte of tensor 5 when `stride` > 0).
pub(crate) fn mutate(host: &Shared, addrs: &[u64], round: u64, stride: usize) {
    let mut h = lock(host);
    for (k, (&a, (n, w))) in addrs.iter().zip(SHAPES).enumerate() {
        if n == 0 {
            continue;
        }
        let bytes = h.mem.write(a, n * w as u64).unwrap();
        let step = if k == 5 && stride > 0 { stride } else { 97 };
        for i in (round as usize % step..bytes.len()).step_by(step) {
            bytes[i] = bytes[i].wrapping_add(1 + round as u8);
        }
    }
}

fn sock(dir: &tempfile::TempDir) -> PathBuf {
    dir.path().join("gpu.sock")
}

const T: Duration = Duration::from_secs(30);

fn sender(host: &Shared, path: &Path, n: usize) -> (IpcSender<FakeSender>, Vec<u64>) {
    let state = tensors(host, 1);
    let dev = FakeSender::new(host.clone(), state.clone());
    (IpcSender::bind(path, dev, layout(), n, T).unwrap(), state)
}

/// A receiver thread: connects as `rank`, applies `syncs` messages, reports each result.
fn receiver(
    host: &Shared,
    path: &Path,
    rank: u32,
    syncs: usize,
) -> (Vec<u64>, thread::JoinHandle<Vec<Result<u64, String>>>) {
    let mine = tensors(host, 100 + u64::from(rank));
    let (host, path, addrs) = (host.clone(), path.to_owned(), mine.clone());
    let h = thread::spawn(move || {
        let dev = FakeReceiver::new(host, addrs);
        let mut r = match IpcReceiver::connect(&path, rank, layout(), dev, T) {
            Ok(r) => r,
            Err(e) => return vec![Err(crate::error_chain(&e))],
        };
        (0..syncs)
            .map(|_| r.apply(T).map_err(|e| crate::error_chain(&e)))
            .collect()
    });
    (mine, h)
}

#[test]
fn two_receivers_follow_the_sender_bitwise_through_bootstrap_patches_and_overflow() {
    let dir = tempfile::tempdir().unwrap();
    let path = sock(&dir);
    let host = Shared::default();
    let (mut tx, state) = sender(&host, &path, 2);
    let mode = std::fs::metadata(&path).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "the socket is private");
    let syncs = 6;
    let (r0, h0) = receiver(&host, &path, 0, syncs);
    let (r1, h1) = receiver(&host, &path, 1, syncs);
    assert_ne!(contents(&host, &r0), contents(&host, &state));
    let rep = tx.sync(7).unwrap();
    assert!(rep.full && rep.receivers == 2 && rep.version == 7);
    assert_eq!(contents(&host, &r0), contents(&host, &state));
    assert_eq!(contents(&host, &r1), contents(&host, &state));
    let mut overflowed = false;
    for round in 1..syncs as u64 {
        // Round 3 changes every 8th byte of the large tensor: 150k changes for a pool of 75k.
        let stride = if round == 3 { 8 } else { 0 };
        mutate(&host, &state, round, stride);
        let rep = tx.sync(7 + round).unwrap();
        assert!(!rep.full);
        assert_eq!(rep.seq, round + 1);
        assert!(rep.widths.iter().all(|w| w.changes > 0));
        overflowed |= rep.widths.iter().any(|w| w.overflow);
        assert_eq!(rep.widths.iter().any(|w| w.overflow), round == 3);
        assert_eq!(
            contents(&host, &r0),
            contents(&host, &state),
            "round {round}"
        );
        assert_eq!(
            contents(&host, &r1),
            contents(&host, &state),
            "round {round}"
        );
    }
    assert!(overflowed);
    let want: Vec<Result<u64, String>> = (0..syncs as u64).map(|k| Ok(7 + k)).collect();
    assert_eq!(h0.join().unwrap(), want);
    assert_eq!(h1.join().unwrap(), want);
    assert_eq!(lock(&host).open, 0, "every receiver closed its imports");
    drop(tx);
    assert!(!path.exists(), "the socket file is removed on drop");
}

#[test]
fn a_dead_receiver_ends_the_wait_at_once_naming_its_rank_and_the_others_go_on() {
    let dir = tempfile::tempdir().unwrap();
    let path = sock(&dir);
    let host = Shared::default();
    let (mut tx, state) = sender(&host, &path, 2);
    let (r0, h0) = receiver(&host, &path, 0, 3);
    let (_r1, h1) = receiver(&host, &path, 1, 1); // applies the bootstrap, then its process "dies"
    tx.sync(1).unwrap();
    assert_eq!(h1.join().unwrap(), vec![Ok(1)]);
    mutate(&host, &state, 1, 0);
    let t0 = Instant::now();
    let err = tx.sync(2).err().unwrap();
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "no wait for the timeout"
    );
    assert!(
        matches!(
            err,
            IpcError::Receiver {
                rank: 1,
                source: PeerError::Closed | PeerError::Io(_)
            }
        ),
        "{err:?}"
    );
    assert!(crate::error_chain(&err).contains("rank 1"));
    assert_eq!(
        contents(&host, &r0),
        contents(&host, &state),
        "rank 0 applied"
    );
    assert_eq!(tx.ranks(), vec![0]);
    mutate(&host, &state, 2, 0);
    tx.sync(3).unwrap();
    assert_eq!(contents(&host, &r0), contents(&host, &state));
    assert_eq!(h0.join().unwrap(), vec![Ok(1), Ok(2), Ok(3)]);
}

#[test]
fn a_late_receiver_gets_a_full_copy_of_the_current_version_then_patches() {
    let dir = tempfile::tempdir().unwrap();
    let path = sock(&dir);
    let host = Shared::default();
    let (mut tx, state) = sender(&host, &path, 2);
    let (r0, h0) = receiver(&host, &path, 0, 3);
    // Only rank 0 at bootstrap: the wait for two ends with an error naming the count.
    tx.timeout = Duration::from_millis(200);
    let err = tx.bootstrap(1).err().unwrap();
    assert!(
        matches!(
            err,
            IpcError::Connect {
                missing: 1,
                expected: 2,
                ..
            }
        ),
        "{err:?}"
    );
    // Bootstrap anyway with one (as the first sync would with whoever came): expected drops to who is here.
    tx.expected = 1;
    tx.timeout = T;
    tx.bootstrap(1).unwrap();
    tx.expected = 2;
    mutate(&host, &state, 1, 0);
    tx.sync(2).unwrap();
    let (r1, h1) = receiver(&host, &path, 1, 2);
    // Admitted (handles opened) between syncs, it gets its full copy at the start of the next one.
    while lock(&host).open < 2 * (1 + 4) {
        thread::sleep(Duration::from_millis(5));
        tx.admit(false).unwrap();
    }
    mutate(&host, &state, 2, 0);
    tx.sync(3).unwrap();
    assert_eq!(contents(&host, &r0), contents(&host, &state));
    assert_eq!(contents(&host, &r1), contents(&host, &state));
    assert_eq!(h0.join().unwrap(), vec![Ok(1), Ok(2), Ok(3)]);
    // Rank 1: the full copy of version 2 (sent at admission in `sync(3)`), then version 3's patch.
    assert_eq!(h1.join().unwrap(), vec![Ok(2), Ok(3)]);
}

/// Elastic receivers (restartable rollouts): a receiver that died is dropped and the sync goes on for the
/// others; its successor rejoins with a full copy of the current version at once, then follows the patches.
/// A successor whose predecessor died unnoticed (no sync in between) takes its place too.
#[test]
fn an_elastic_sender_drops_a_dead_receiver_and_its_successor_rejoins_with_a_full_copy() {
    let dir = tempfile::tempdir().unwrap();
    let path = sock(&dir);
    let host = Shared::default();
    let (mut tx, state) = sender(&host, &path, 2);
    tx.set_elastic(true);
    let (r0, h0) = receiver(&host, &path, 0, 5);
    let (_r1, h1) = receiver(&host, &path, 1, 1); // the bootstrap, then its process "dies"
    tx.sync(1).unwrap();
    assert_eq!(h1.join().unwrap(), vec![Ok(1)]);
    mutate(&host, &state, 1, 0);
    let rep = tx.sync(2).unwrap();
    assert_eq!(rep.dropped, vec![1], "{rep:?}");
    assert_eq!(rep.receivers, 2, "sent to both, one gone");
    assert_eq!(tx.ranks(), vec![0]);
    assert_eq!(contents(&host, &r0), contents(&host, &state));
    // The successor: its own initial tensors, a full copy of version 2 at once.
    let (s1, hs1) = receiver(&host, &path, 1, 2);
    assert_ne!(contents(&host, &s1), contents(&host, &state));
    let rep = tx.rejoin(1).unwrap();
    assert!(
        rep.full && rep.version == 2 && rep.receivers == 1,
        "{rep:?}"
    );
    assert_eq!(rep.per_receiver.len(), 1);
    assert_eq!(rep.per_receiver[0].rank, 1);
    assert_eq!(contents(&host, &s1), contents(&host, &state));
    mutate(&host, &state, 2, 0);
    let rep = tx.sync(3).unwrap();
    assert!(!rep.full && rep.dropped.is_empty(), "{rep:?}");
    assert_eq!(contents(&host, &r0), contents(&host, &state));
    assert_eq!(contents(&host, &s1), contents(&host, &state));
    // It dies too, unnoticed: its successor's rejoin replaces it without a sync in between.
    assert_eq!(hs1.join().unwrap(), vec![Ok(2), Ok(3)]);
    let (s2, hs2) = receiver(&host, &path, 1, 2);
    assert_eq!(tx.rejoin(1).unwrap().version, 3);
    assert_eq!(contents(&host, &s2), contents(&host, &state));
    mutate(&host, &state, 3, 0);
    assert!(tx.sync(4).unwrap().dropped.is_empty());
    assert_eq!(contents(&host, &s2), contents(&host, &state));
    mutate(&host, &state, 4, 0);
    tx.sync(5).unwrap();
    assert_eq!(contents(&host, &r0), contents(&host, &state));
    assert_eq!(h0.join().unwrap(), (1..=5).map(Ok).collect::<Vec<_>>());
    assert_eq!(hs2.join().unwrap(), vec![Ok(3), Ok(4)]);
    // A rejoin nobody answers fails by rank after the timeout; the channel goes on.
    tx.timeout = Duration::from_millis(200);
    let err = tx.rejoin(1).unwrap_err();
    assert!(
        matches!(
            err,
            IpcError::Receiver {
                rank: 1,
                source: PeerError::NotConnected { .. }
            }
        ),
        "{err:?}"
    );
    assert!(crate::error_chain(&err).contains("did not connect"));
    let err = tx.rejoin(2).unwrap_err();
    assert!(
        matches!(
            err,
            IpcError::Receiver {
                rank: 2,
                source: PeerError::Refused(Reason::Rank { rank: 2 })
            }
        ),
        "{err:?}"
    );
    drop(tx);
    assert_eq!(lock(&host).open, 0, "every receiver closed its imports");
}

/// Elastic, the bootstrap waits for the announced receivers only as long as its connect wait: one that died
/// before it connected is left to rejoin, and the others start.
#[test]
fn an_elastic_bootstrap_goes_on_without_a_receiver_that_never_connected() {
    let dir = tempfile::tempdir().unwrap();
    let path = sock(&dir);
    let host = Shared::default();
    let (mut tx, state) = sender(&host, &path, 2);
    tx.set_elastic(true);
    tx.set_connect_wait(Duration::from_millis(200));
    let (r0, h0) = receiver(&host, &path, 0, 2);
    let rep = tx.sync(1).unwrap();
    assert!(rep.full && rep.receivers == 1, "{rep:?}");
    assert_eq!(contents(&host, &r0), contents(&host, &state));
    let (r1, h1) = receiver(&host, &path, 1, 2);
    assert_eq!(tx.rejoin(1).unwrap().version, 1);
    mutate(&host, &state, 1, 0);
    assert_eq!(tx.sync(2).unwrap().receivers, 2);
    assert_eq!(contents(&host, &r1), contents(&host, &state));
    assert_eq!(h0.join().unwrap(), vec![Ok(1), Ok(2)]);
    assert_eq!(h1.join().unwrap(), vec![Ok(1), Ok(2)]);
    // Told (after a while) that rank 1 is gone, it stops waiting for it.
    let dir = tempfile::tempdir().unwrap();
    let path = sock(&dir);
    let (mut tx, _) = sender(&host, &path, 2);
    tx.set_elastic(true);
    let (_r0, h0) = receiver(&host, &path, 0, 1);
    let t0 = Instant::now();
    let mut asked = 0;
    let mut away = || {
        asked += 1;
        if t0.elapsed() > Duration::from_millis(300) {
            vec![1]
        } else {
            Vec::new()
        }
    };
    assert_eq!(tx.bootstrap_elastic(1, &mut away).unwrap().receivers, 1);
    assert!(t0.elapsed() < Duration::from_secs(5), "the timeout is 30 s");
    assert!(asked > 1, "asked again while waiting");
    assert_eq!(h0.join().unwrap(), vec![Ok(1)]);
    // Not elastic, the same wait fails the bootstrap naming the count and the wait.
    let dir = tempfile::tempdir().unwrap();
    let path = sock(&dir);
    let (mut tx, _) = sender(&host, &path, 1);
    tx.set_connect_wait(Duration::from_millis(100));
    let err = tx.sync(1).unwrap_err();
    assert!(
        matches!(err, IpcError::Connect { missing: 1, expected: 1, secs } if secs < 1.0),
        "{err:?}"
    );
}

/// Not elastic (the default), the same death fails the sync (see above), and a rejoin before the bootstrap is
/// refused by name.
#[test]
fn a_rejoin_before_the_bootstrap_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = sock(&dir);
    let host = Shared::default();
    let (mut tx, _state) = sender(&host, &path, 1);
    tx.set_elastic(true);
    let err = tx.rejoin(0).unwrap_err();
    assert!(
        matches!(err, IpcError::NotBootstrapped { rank: 0 }),
        "{err:?}"
    );
}

/// Detached acks: a receiver that dies mid-import (it read the sync, never acked) is forgotten by its
/// successor's rejoin, which gets the posted version in full; the outstanding sync settles with the other
/// receiver's ack, not waiting for the dead one's.
#[test]
fn a_rejoin_while_a_detached_sync_is_outstanding_settles_without_the_dead_receivers_ack() {
    let dir = tempfile::tempdir().unwrap();
    let path = sock(&dir);
    let host = Shared::default();
    let (mut tx, state) = sender(&host, &path, 2);
    tx.set_elastic(true);
    let (r0, h0) = receiver(&host, &path, 0, 3);
    let mine = tensors(&host, 101);
    let (h, p, addrs) = (host.clone(), path.clone(), mine.clone());
    let (read_tx, read_rx) = std::sync::mpsc::channel();
    let dying = thread::spawn(move || {
        let dev = FakeReceiver::new(h, addrs);
        let mut r = IpcReceiver::connect(&p, 1, layout(), dev, T).unwrap();
        r.apply(T).unwrap();
        r.wait().unwrap();
        let _incoming = r.receive(T).unwrap();
        read_tx.send(()).unwrap();
        // Dies here: read, never installed nor acked.
    });
    tx.sync(1).unwrap();
    tx.detach_acks(true);
    let before = contents(&host, &mine);
    mutate(&host, &state, 1, 0);
    tx.sync(2).unwrap();
    read_rx.recv().unwrap();
    dying.join().unwrap();
    assert_eq!(contents(&host, &mine), before, "nothing installed");
    let (s1, hs1) = receiver(&host, &path, 1, 2);
    let rep = tx.rejoin(1).unwrap();
    assert_eq!(rep.version, 2);
    assert_eq!(contents(&host, &s1), contents(&host, &state));
    tx.timeout = Duration::from_secs(2);
    let t0 = Instant::now();
    let settled = tx.settle().unwrap();
    assert!(
        t0.elapsed() < Duration::from_secs(1),
        "no wait for the dead one"
    );
    assert_eq!(
        settled.iter().map(|t| t.rank).collect::<Vec<_>>(),
        vec![0],
        "rank 0's ack of sync 2"
    );
    mutate(&host, &state, 2, 0);
    tx.sync(3).unwrap();
    tx.settle().unwrap();
    assert_eq!(contents(&host, &r0), contents(&host, &state));
    assert_eq!(contents(&host, &s1), contents(&host, &state));
    assert_eq!(h0.join().unwrap(), vec![Ok(1), Ok(2), Ok(3)]);
    assert_eq!(hs1.join().unwrap(), vec![Ok(2), Ok(3)]);
}

#[test]
fn a_receiver_with_other_tensors_or_a_taken_rank_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let path = sock(&dir);
    let host = Shared::default();
    let (mut tx, _state) = sender(&host, &path, 1);
    let p = path.clone();
    let other = thread::spawn(move || {
        let dev = FakeReceiver::new(Shared::default(), Vec::new());
        let shapes = Layout::new(&[(10, 2)]).unwrap();
        IpcReceiver::connect(&p, 0, shapes, dev, T)
            .err()
            .map(|e| crate::error_chain(&e))
    });
    tx.timeout = Duration::from_millis(500);
    let err = tx.bootstrap(1).err().unwrap();
    assert!(
        matches!(
            err,
            IpcError::Receiver {
                rank: 0,
                source: PeerError::Refused(Reason::Tensors { .. })
            }
        ),
        "{err:?}"
    );
    let theirs = other.join().unwrap().unwrap();
    assert!(
        theirs.contains("refused") && theirs.contains("differs"),
        "{theirs}"
    );
    // Rank out of range.
    let p = path.clone();
    let h = host.clone();
    let bad_rank = thread::spawn(move || {
        let dev = FakeReceiver::new(h, Vec::new());
        IpcReceiver::connect(&p, 5, layout(), dev, T)
            .err()
            .map(|e| crate::error_chain(&e))
    });
    assert!(tx.bootstrap(1).is_err());
    assert!(bad_rank.join().unwrap().unwrap().contains("rank 5"));
    assert_eq!(lock(&host).open, 0);
}

/// A hand-driven sender end: accepts one receiver, answers its hello with `setup`.
fn raw_sender(path: &Path, setup: Setup) -> UnixStream {
    let l = bind_private(path).unwrap();
    let (mut s, _) = l.accept().unwrap();
    let deadline = Instant::now() + T;
    assert!(matches!(
        recv(&mut s, deadline, 30.0).unwrap(),
        Message::Hello { rank: 0, .. }
    ));
    send(&mut s, &Message::Setup(setup)).unwrap();
    assert!(matches!(
        recv(&mut s, deadline, 30.0).unwrap(),
        Message::Ready { rank: 0 }
    ));
    s
}

#[test]
fn a_receiver_rejects_bad_syncs_before_writing_anything() {
    let dir = tempfile::tempdir().unwrap();
    let path = sock(&dir);
    let host = Shared::default();
    // A real sender's exports, driven by hand.
    let state = tensors(&host, 1);
    let mut dev = FakeSender::new(host.clone(), state.clone());
    let l = layout();
    let (offsets, bytes) = snapshot_offsets(&l);
    let (snapshot, widths) = dev.prepare(&l, &offsets, bytes).unwrap();
    dev.bootstrap(&l, &offsets).unwrap();
    let setup = Setup {
        pid: 1,
        device: 0,
        snapshot,
        tensors: facts(&l),
        offsets: offsets.clone(),
        widths,
    };
    let (mine, h) = receiver(&host, &path, 0, 7);
    let mut s = raw_sender(&path, setup.clone());
    let before = contents(&host, &mine);
    let deadline = Instant::now() + T;
    let ask = |s: &mut UnixStream, frame: Vec<u8>| {
        s.write_all(&frame).unwrap();
        match recv(s, deadline, 30.0).unwrap() {
            Message::Ack { status, .. } => status,
            other => panic!("{other:?}"),
        }
    };
    let counts = |c: u64, o: bool| -> Vec<WidthCount> {
        setup
            .widths
            .iter()
            .map(|w| WidthCount {
                width: w.width,
                changes: c,
                overflow: o,
                checksum: 0, // the pool was never built: every directory entry and sum is 0
            })
            .collect()
    };
    let sync = |seq, version, mode, widths| {
        wire::encode(&Message::Sync {
            seq,
            version,
            mode,
            sent_ns: 0,
            widths,
        })
    };
    // A full copy's widths: the snapshot copy's checksum under `seq`.
    let full = |dev: &mut FakeSender, seq| -> Vec<WidthCount> {
        let sums = dev.snapshot_sum(&l, &offsets, seq).unwrap();
        setup
            .widths
            .iter()
            .zip(sums)
            .map(|(w, s)| WidthCount {
                width: w.width,
                changes: s.count,
                overflow: false,
                checksum: s.sum,
            })
            .collect()
    };
    // 1. a patch before the bootstrap;
    let st = ask(&mut s, sync(1, 1, Mode::Patch, counts(1, false)));
    assert_eq!(st, Status::Rejected(Reason::NotBootstrapped));
    // 2. a corrupt frame (a flipped bit in the version);
    let mut bad = sync(2, 1, Mode::Full, Vec::new());
    bad[4 + 8 + 9] ^= 1;
    assert_eq!(ask(&mut s, bad), Status::Rejected(Reason::Corrupt));
    assert_eq!(contents(&host, &mine), before, "nothing written");
    // 2b. a full copy whose checksum was made under another sequence number (a stale snapshot's);
    let stale = full(&mut dev, 2);
    let st = ask(&mut s, sync(3, 5, Mode::Full, stale));
    assert!(
        matches!(st, Status::Rejected(Reason::Checksum { .. })),
        "{st:?}"
    );
    assert_eq!(contents(&host, &mine), before, "nothing written");
    // 3. the bootstrap;
    let widths = full(&mut dev, 4);
    assert_eq!(ask(&mut s, sync(4, 5, Mode::Full, widths)), Status::Applied);
    assert_eq!(contents(&host, &mine), contents(&host, &state));
    let installed = contents(&host, &mine);
    // 4. a replayed sequence number; 5. a lower caller version under a newer sequence is applied (versions
    // only label the weights, as RLinf's runners use them); 6. an overflow flag that contradicts the counts.
    let st = ask(&mut s, sync(4, 6, Mode::Patch, counts(0, false)));
    assert_eq!(st, Status::Rejected(Reason::Stale { seq: 4, last: 4 }));
    let st = ask(&mut s, sync(5, 4, Mode::Patch, counts(0, false)));
    assert_eq!(st, Status::Applied);
    let st = ask(&mut s, sync(6, 6, Mode::Patch, counts(1 << 40, false)));
    assert!(
        matches!(st, Status::Rejected(Reason::Capacity { .. })),
        "{st:?}"
    );
    assert_eq!(
        contents(&host, &mine),
        installed,
        "rejections wrote nothing"
    );
    drop(s);
    let results = h.join().unwrap();
    assert_eq!(results.len(), 7);
    assert!(
        results[0]
            .as_ref()
            .is_err_and(|e| e.contains("before the first full copy"))
    );
    assert!(results[1].as_ref().is_err_and(|e| e.contains("checksum")));
    assert!(
        results[2]
            .as_ref()
            .is_err_and(|e| e.contains("pool checksum") && e.contains("width")),
        "{:?}",
        results[2]
    );
    assert_eq!(results[3], Ok(5));
    assert_eq!(results[5], Ok(4));
    assert!(results[6].as_ref().is_err_and(|e| e.contains("changes")));
}

#[test]
fn a_setup_whose_buffers_do_not_fit_the_layout_is_refused_before_opening() {
    let l = layout();
    let (offsets, bytes) = snapshot_offsets(&l);
    let export = |bytes| Export {
        handle: SharedSim::default().export(1 << 40),
        bytes,
    };
    let widths: Vec<WidthExport> = l
        .widths()
        .map(|w| {
            let (b, dir_off, idx_off, vals_off, capacity) = width_plan(&l, w);
            WidthExport {
                width: w as u8,
                ntiles: l.ntiles(w),
                capacity,
                buf: export(b),
                dir_off,
                idx_off,
                vals_off,
            }
        })
        .collect();
    let good = Setup {
        pid: 1,
        device: 0,
        snapshot: export(bytes),
        tensors: facts(&l),
        offsets,
        widths,
    };
    assert_eq!(check_setup(&good, &l), Ok(()));
    let mut s = good.clone();
    s.snapshot.bytes = s.offsets[5] + 1_200_000 - 1; // the last tensor's copy ends one byte out
    assert!(matches!(check_setup(&s, &l), Err(Reason::Exports { .. })));
    let mut s = good.clone();
    s.widths[0].capacity *= 2;
    assert!(matches!(check_setup(&s, &l), Err(Reason::Exports { .. })));
    let mut s = good.clone();
    s.widths[1].ntiles += 1;
    assert!(matches!(check_setup(&s, &l), Err(Reason::Exports { .. })));
    let mut s = good.clone();
    s.widths[2].vals_off = u64::MAX - 3;
    assert!(matches!(check_setup(&s, &l), Err(Reason::Exports { .. })));
    let mut s = good.clone();
    s.offsets[3] += 1; // misaligned for 8-byte elements
    assert!(matches!(
        check_setup(&s, &l),
        Err(Reason::Exports { item: 3 })
    ));
    let mut s = good;
    s.widths.pop();
    assert!(matches!(check_setup(&s, &l), Err(Reason::Widths { .. })));
}

#[test]
fn the_socket_is_private_a_live_one_is_not_taken_over_and_a_stale_one_is_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let path = sock(&dir);
    let live = bind_private(&path).unwrap();
    assert!(matches!(bind_private(&path), Err(IpcError::InUse { .. })));
    drop(live); // the file stays: stale
    assert!(path.exists());
    let again = bind_private(&path).unwrap();
    let mode = std::fs::metadata(&path).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    drop(again);
    assert!(matches!(
        bind_private(&dir.path().join("missing/gpu.sock")),
        Err(IpcError::NoDir { .. })
    ));
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name())
        .filter(|n| n.as_os_str() != "gpu.sock")
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn a_socket_path_at_the_length_limit_binds() {
    // A run checks its socket paths against 107 bytes (the longest `sun_path` with its NUL): the temporary
    // name the socket is bound under first must fit wherever `gpu.sock` fits.
    let dir = tempfile::tempdir().unwrap();
    let room = 107 - dir.path().as_os_str().len() - "/".len() - "/gpu.sock".len();
    let sub = dir.path().join("d".repeat(room));
    std::fs::create_dir(&sub).unwrap();
    let path = sub.join("gpu.sock");
    assert_eq!(path.as_os_str().len(), 107);
    for _ in 0..3 {
        drop(bind_private(&path).unwrap());
    }
    // One byte more is refused by name and length on both ends, before anything is bound or connected.
    let long = sub.join("gpu.sock1");
    let refused = |e: IpcError| match e {
        IpcError::PathTooLong { path, len } => {
            assert_eq!((path.as_path(), len), (long.as_path(), 108));
            let msg = IpcError::PathTooLong { path, len }.to_string();
            assert!(msg.contains("108 bytes") && msg.contains("107"), "{msg}");
        }
        other => panic!("{other:?}"),
    };
    refused(bind_private(&long).unwrap_err());
    assert!(!long.exists());
    let dev = FakeReceiver::new(Shared::default(), Vec::new());
    match IpcReceiver::connect(&long, 0, layout(), dev, T) {
        Err(e) => refused(e),
        Ok(_) => panic!("connected through a path longer than the limit"),
    }
    assert_eq!(base36(0), "0");
    assert_eq!(base36(35), "z");
    assert_eq!(base36(36), "10");
    assert_eq!(base36(u64::from(u32::MAX)), "1z141z3");
}

#[test]
fn a_receiver_whose_sender_went_away_gets_an_error_not_a_hang() {
    let dir = tempfile::tempdir().unwrap();
    let path = sock(&dir);
    let host = Shared::default();
    let (mut tx, _state) = sender(&host, &path, 1);
    let (_mine, h) = receiver(&host, &path, 0, 2);
    tx.sync(1).unwrap();
    let t0 = Instant::now();
    drop(tx);
    let got = h.join().unwrap();
    assert_eq!(got[0], Ok(1));
    assert!(
        got[1].as_ref().is_err_and(|e| e.contains("closed")),
        "{got:?}"
    );
    assert!(t0.elapsed() < Duration::from_secs(5));
    assert_eq!(lock(&host).open, 0);
}

#[test]
fn a_sender_going_away_frees_its_buffers_only_after_every_receiver_closed_them() {
    // CUDA leaves an exporter's free of an allocation its importers still have open undefined: the sender's
    // drop ends the channel, each receiver closes the buffers on reading the end, then the sender frees them.
    let dir = tempfile::tempdir().unwrap();
    let path = sock(&dir);
    let host = Shared::default();
    let (mut tx, _state) = sender(&host, &path, 2);
    let (_a, ha) = receiver(&host, &path, 0, 3);
    let (_b, hb) = receiver(&host, &path, 1, 3);
    tx.sync(1).unwrap();
    tx.detach_acks(true);
    tx.sync(2).unwrap(); // in flight when the sender goes: collected before anything is freed
    assert!(lock(&host).open > 0, "the receivers have the buffers open");
    let t0 = Instant::now();
    drop(tx);
    assert!(t0.elapsed() < Duration::from_secs(5));
    assert_eq!(
        lock(&host).freed_while_open,
        0,
        "freed while a receiver had them open"
    );
    assert_eq!(lock(&host).open, 0);
    for h in [ha, hb] {
        let got = h.join().unwrap();
        assert_eq!(&got[..2], &[Ok(1), Ok(2)]);
        assert!(
            got[2].as_ref().is_err_and(|e| e.contains("closed")),
            "{got:?}"
        );
    }
}

#[test]
fn a_receiver_waiting_on_another_thread_is_ended_by_its_shutdown_handle() {
    let dir = tempfile::tempdir().unwrap();
    let path = sock(&dir);
    let host = Shared::default();
    let (mut tx, _state) = sender(&host, &path, 1);
    let (p, h) = (path.clone(), host.clone());
    let (handle_tx, handle_rx) = std::sync::mpsc::channel();
    let waiter = thread::spawn(move || {
        let dev = FakeReceiver::new(h.clone(), tensors(&h, 100));
        let mut rx = IpcReceiver::connect(&p, 0, layout(), dev, T).unwrap();
        rx.apply(T).unwrap();
        handle_tx.send(rx.shutdown_handle().unwrap()).unwrap();
        rx.wait().map_err(|e| crate::error_chain(&e))
    });
    tx.sync(1).unwrap();
    let handle = handle_rx.recv_timeout(T).unwrap();
    assert!(lock(&host).open > 0);
    thread::sleep(Duration::from_millis(50)); // the waiter blocks in wait()
    handle.shutdown(std::net::Shutdown::Both).unwrap();
    let ended = waiter.join().unwrap();
    assert!(
        ended.as_ref().is_err_and(|e| e.contains("closed")),
        "{ended:?}"
    );
    assert_eq!(
        lock(&host).open,
        0,
        "the receiver closed the sender's buffers"
    );
}

#[test]
fn a_receiver_that_never_acks_fails_its_sync_at_the_deadline_by_rank() {
    let dir = tempfile::tempdir().unwrap();
    let path = sock(&dir);
    let host = Shared::default();
    let (mut tx, _state) = sender(&host, &path, 1);
    tx.timeout = Duration::from_millis(300);
    // A hand-driven receiver: hello, ready, then silence (its socket stays open).
    let p = path.clone();
    let silent = thread::spawn(move || {
        let mut s = UnixStream::connect(&p).unwrap();
        let hello = Message::Hello {
            rank: 0,
            pid: 0,
            device: 0,
            tensors: facts(&layout()),
        };
        send(&mut s, &hello).unwrap();
        let deadline = Instant::now() + T;
        assert!(matches!(
            recv(&mut s, deadline, 30.0).unwrap(),
            Message::Setup(_)
        ));
        send(&mut s, &Message::Ready { rank: 0 }).unwrap();
        assert!(matches!(
            recv(&mut s, deadline, 30.0).unwrap(),
            Message::Sync {
                mode: Mode::Full,
                ..
            }
        ));
        // Hold the socket until the sender gave up on us (it closes its end).
        let mut b = [0u8; 1];
        let _ = s.set_read_timeout(Some(T));
        let _ = s.read(&mut b);
    });
    let t0 = Instant::now();
    let err = tx.sync(1).err().unwrap();
    assert!(t0.elapsed() >= Duration::from_millis(250));
    assert!(
        matches!(
            err,
            IpcError::Receiver {
                rank: 0,
                source: PeerError::Timeout { .. }
            }
        ),
        "{err:?}"
    );
    assert!(tx.ranks().is_empty(), "the silent receiver was dropped");
    silent.join().unwrap();
}

/// Flip the bits `mask` of the byte at `at` of the simulated device.
fn flip(mem: &mut Memory, at: u64, mask: u8) {
    mem.write(at, 1).unwrap()[0] ^= mask;
}

fn export_of(dev: &FakeSender, width: u8) -> (WidthExport, u64) {
    let k = dev.outs.iter().position(|w| w.width == width).unwrap();
    (dev.outs[k], dev.out_addrs[k])
}

#[test]
fn a_corrupted_pool_is_rejected_by_its_checksum_the_tensors_untouched_and_the_next_sync_applies() {
    let dir = tempfile::tempdir().unwrap();
    let path = sock(&dir);
    let host = Shared::default();
    let (mut tx, state) = sender(&host, &path, 1);
    let (r0, h0) = receiver(&host, &path, 0, 13);
    tx.sync(1).unwrap();
    // (stride of the large tensor's changes, the corruption, what the error names)
    let cases: Vec<(usize, Corruption, &str)> = vec![
        (
            0,
            // A bit of the first index entry of the 2-byte width (a used one: every tensor changed).
            Box::new(|mem, dev| {
                let (w, base) = export_of(dev, 2);
                flip(mem, base + w.idx_off, 1 << 3);
            }),
            "pool checksum",
        ),
        (
            0,
            // A bit of the new half of the first value of the 4-byte width.
            Box::new(|mem, dev| {
                let (w, base) = export_of(dev, 4);
                flip(mem, base + w.vals_off + 6, 0x10);
            }),
            "pool checksum",
        ),
        (
            0,
            // The count of the 8-byte width's only tile.
            Box::new(|mem, dev| {
                let (w, base) = export_of(dev, 8);
                flip(mem, base + w.dir_off + 8, 1);
            }),
            "counted",
        ),
        (
            8,
            // A byte of the snapshot copy inside a tile that overflowed the pool (copied densely).
            Box::new(|mem, dev| {
                let (w, base) = export_of(dev, 1);
                let dir: Vec<TileDir> = read_vec(mem, base + w.dir_off, w.ntiles).unwrap();
                let tile = dir.iter().position(|d| d.flags & compact::OVERFLOW != 0);
                let tile = tile.expect("the large tensor overflowed its pool") as u64;
                let (offsets, _) = snapshot_offsets(&layout());
                flip(mem, dev.snap + offsets[5] + tile * 4096 + 17, 0x40);
            }),
            "pool checksum",
        ),
    ];
    let mut want = vec![Ok(1)];
    let mut version = 1;
    for (k, (stride, corrupt, named)) in cases.into_iter().enumerate() {
        version += 1;
        mutate(&host, &state, version, stride);
        tx.device_mut().corrupt = Some(corrupt);
        let before = contents(&host, &r0);
        let err = tx.sync(version).expect_err("a corrupted pool is rejected");
        assert!(
            matches!(
                err,
                IpcError::Receiver {
                    rank: 0,
                    source: PeerError::Rejected(Reason::Checksum { .. } | Reason::Count { .. })
                }
            ),
            "case {k}: {err:?}"
        );
        let chain = crate::error_chain(&err);
        assert!(chain.contains(named), "case {k}: {chain}");
        assert_eq!(contents(&host, &r0), before, "case {k}: tensors untouched");
        assert_eq!(tx.ranks(), vec![0], "case {k}: the receiver stays");
        want.push(Err(named));
        // The next sync: a full copy of the current snapshot (the receiver holds the previous version), then
        // the patch.
        version += 1;
        mutate(&host, &state, version, 0);
        let rep = tx.sync(version).unwrap();
        assert_eq!(rep.per_receiver.len(), 1);
        assert_eq!(contents(&host, &r0), contents(&host, &state), "case {k}");
        want.push(Ok(version - 1));
        want.push(Ok(version));
    }
    let got = h0.join().unwrap();
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(&want) {
        match (g, w) {
            (Ok(a), Ok(b)) => assert_eq!(a, b),
            (Err(e), Err(named)) => assert!(e.contains(named), "{e}"),
            _ => panic!("{got:?} vs {want:?}"),
        }
    }
}

#[test]
fn a_sender_whose_own_count_disagrees_with_its_cursor_sends_a_full_copy_and_counts_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = sock(&dir);
    let host = Shared::default();
    let (mut tx, state) = sender(&host, &path, 2);
    // The bootstrap, then per fault the fallback and a patch.
    let syncs = 5;
    let (r0, h0) = receiver(&host, &path, 0, syncs);
    let (r1, h1) = receiver(&host, &path, 1, syncs);
    let rep = tx.sync(1).unwrap();
    assert_eq!(rep.fallbacks, 0);
    // Faults between diff_compact and the checksum.
    let faults: Vec<Corruption> = vec![
        // The count of the 8-byte width's only tile.
        Box::new(|mem, dev| {
            let (w, base) = export_of(dev, 8);
            flip(mem, base + w.dir_off + 8, 1);
        }),
        // The count of the 2-byte width's first tile and a byte of the snapshot copy: the full copy must
        // come from the state, not from the broken copy.
        Box::new(|mem, dev| {
            let (w, base) = export_of(dev, 2);
            flip(mem, base + w.dir_off + 8, 2);
            flip(mem, dev.snap + 3, 0x80);
        }),
    ];
    let mut version = 1;
    for (k, fault) in faults.into_iter().enumerate() {
        version += 1;
        mutate(&host, &state, version, 0);
        tx.device_mut().fault = Some(fault);
        let rep = tx.sync(version).unwrap();
        assert!(rep.full, "case {k}: sent as a full copy");
        assert_eq!(rep.fallbacks, k as u64 + 1, "case {k}");
        assert_eq!(rep.per_receiver.len(), 2, "case {k}: both acked");
        assert_eq!(tx.ranks(), vec![0, 1]);
        for r in [&r0, &r1] {
            assert_eq!(contents(&host, r), contents(&host, &state), "case {k}");
        }
        // The next sync is a patch again, on the refreshed snapshot copy.
        version += 1;
        mutate(&host, &state, version, 0);
        let rep = tx.sync(version).unwrap();
        assert!(!rep.full, "case {k}");
        assert_eq!(rep.fallbacks, k as u64 + 1, "case {k}");
        for r in [&r0, &r1] {
            assert_eq!(contents(&host, r), contents(&host, &state), "case {k}");
        }
    }
    let want: Vec<Result<u64, String>> = (1..=version).map(Ok).collect();
    assert_eq!(h0.join().unwrap(), want, "no receiver rejected anything");
    assert_eq!(h1.join().unwrap(), want, "no receiver rejected anything");
}

/// Across processes: each end's own memory, the exports seen through files (as the test worker's simulated
/// GPU uses them); the receiver follows the sender bitwise, and the sender's files go with it.
#[test]
fn file_backed_ends_with_separate_memories_follow_the_sender_and_leave_no_file() {
    use super::reference::FileSim;
    let dir = tempfile::tempdir().unwrap();
    let path = sock(&dir);
    let fill = |sim: &FileSim, seed: u64| -> Vec<u64> {
        sim.with(|mem| {
            SHAPES
                .iter()
                .enumerate()
                .map(|(k, &(n, w))| {
                    mem.alloc(&crate::gpu::reference::rng::bytes(
                        n as usize * w,
                        seed + 2 * k as u64,
                    ))
                })
                .collect()
        })
    };
    let read = |sim: &FileSim, addrs: &[u64]| -> Vec<Vec<u8>> {
        sim.with(|mem| {
            addrs
                .iter()
                .zip(SHAPES)
                .map(|(&a, (n, w))| mem.read(a, n * w as u64).unwrap().to_vec())
                .collect()
        })
    };
    let tx_sim = FileSim::new(dir.path());
    let state = fill(&tx_sim, 1);
    let mut tx = IpcSender::bind(
        &path,
        RefSender::new(tx_sim.clone(), state.clone()),
        layout(),
        1,
        T,
    )
    .unwrap();
    let rx_sim = FileSim::new(dir.path());
    let mine = fill(&rx_sim, 101);
    let (p, sim, addrs) = (path.clone(), rx_sim.clone(), mine.clone());
    let rx = thread::spawn(move || {
        let mut r = IpcReceiver::connect(&p, 0, layout(), RefReceiver::new(sim, addrs), T).unwrap();
        (0..4).map(|_| r.apply(T).unwrap()).collect::<Vec<_>>()
    });
    for version in 1..=4u64 {
        if version > 1 {
            tx_sim.with(|mem| {
                for (&a, (n, w)) in state.iter().zip(SHAPES) {
                    let bytes = mem.write(a, n * w as u64).unwrap();
                    for i in (version as usize..bytes.len()).step_by(89) {
                        bytes[i] = bytes[i].wrapping_add(3);
                    }
                }
            });
        }
        let rep = tx.sync(version).unwrap();
        assert_eq!(rep.full, version == 1);
    }
    assert_eq!(rx.join().unwrap(), vec![1, 2, 3, 4]);
    assert_eq!(read(&rx_sim, &mine), read(&tx_sim, &state));
    assert!(
        std::fs::read_dir(dir.path()).unwrap().count() > 1,
        "the exports are files"
    );
    drop(tx);
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert!(left.is_empty(), "{left:?}");
}

/// Detached acks (receivers installing in the background between their own work): a sync returns once sent,
/// its acks are collected by the next sync (or `settle`) before the buffers are rewritten, and a receiver's
/// rejection surfaces there, the receiver untouched and given a full copy next.
#[test]
fn detached_acks_are_collected_by_the_next_sync_and_a_rejection_is_its_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = sock(&dir);
    let host = Shared::default();
    let (mut tx, state) = sender(&host, &path, 1);
    let mine = tensors(&host, 100);
    let (h, p, addrs) = (host.clone(), path.clone(), mine.clone());
    // Bootstrap (1), patches 2 and 3, the rejected 4, the full copy of 4's snapshot and the patch 5.
    let rx = thread::spawn(move || {
        let dev = FakeReceiver::new(h, addrs);
        let mut r = IpcReceiver::connect(&p, 0, layout(), dev, T).unwrap();
        let mut got = Vec::new();
        for _ in 0..6 {
            r.wait().unwrap();
            let incoming = r.receive(T).unwrap();
            // The rollout's chunk in progress: the install waits for its end.
            thread::sleep(Duration::from_millis(50));
            got.push(r.install(incoming).map_err(|e| crate::error_chain(&e)));
        }
        // The sender closing is seen by the wait.
        let closed = r.wait().unwrap_err();
        (got, crate::error_chain(&closed))
    });
    let rep = tx.sync(1).unwrap();
    assert_eq!(
        rep.per_receiver.len(),
        1,
        "the bootstrap waits for its acks"
    );
    tx.detach_acks(true);
    mutate(&host, &state, 2, 0);
    let rep = tx.sync(2).unwrap();
    assert!(
        rep.per_receiver.is_empty() && rep.settled.is_empty(),
        "{rep:?}"
    );
    mutate(&host, &state, 3, 0);
    let rep = tx.sync(3).unwrap();
    assert_eq!(rep.settled.len(), 1, "sync 2's ack, collected by sync 3");
    assert!(
        rep.settled[0].total_s >= 0.05,
        "acked after the install's wait"
    );
    assert_eq!(tx.settle().unwrap().len(), 1, "sync 3's ack");
    assert_eq!(contents(&host, &mine), contents(&host, &state));
    assert!(tx.settle().unwrap().is_empty(), "nothing outstanding");
    // A corrupted pool: the sync itself returns; its rejection is the settle's error.
    mutate(&host, &state, 4, 0);
    tx.device_mut().corrupt = Some(Box::new(|mem, dev| {
        let (w, base) = export_of(dev, 2);
        flip(mem, base + w.idx_off, 1 << 3);
    }));
    let before = contents(&host, &mine);
    tx.sync(4).unwrap();
    let err = tx.settle().unwrap_err();
    assert!(
        matches!(
            err,
            IpcError::Receiver {
                rank: 0,
                source: PeerError::Rejected(Reason::Checksum { .. })
            }
        ),
        "{err:?}"
    );
    assert_eq!(
        contents(&host, &mine),
        before,
        "the rejected sync wrote nothing"
    );
    mutate(&host, &state, 5, 0);
    tx.sync(5).unwrap();
    tx.settle().unwrap();
    assert_eq!(contents(&host, &mine), contents(&host, &state));
    drop(tx);
    let (got, closed) = rx.join().unwrap();
    let versions: Vec<Result<u64, bool>> = got
        .iter()
        .map(|g| {
            g.as_ref()
                .map(|v| *v)
                .map_err(|e| e.contains("pool checksum"))
        })
        .collect();
    assert_eq!(
        versions,
        vec![Ok(1), Ok(2), Ok(3), Err(true), Ok(4), Ok(5)],
        "{got:?}"
    );
    assert!(closed.contains("closed"), "{closed}");
}

/// A sender whose state is in other floating dtypes than the receivers' (fp32 and f64 master weights for
/// bf16 and fp32 receivers, one tensor already in theirs): the receivers hold the state cast bit for bit as
/// the host casts, after every sync, and the sender's state checksum is the host checksum of that.
#[test]
fn a_casting_sender_gives_the_receivers_its_state_in_their_dtypes_and_hashes_what_they_hold() {
    use super::cast::{Casting, RefCast};
    use crate::gpu::differ::CastPlan;
    use crate::tensor::{Class, DType, StateDict, Tensor, cast_bytes, state_checksum};
    let dir = tempfile::tempdir().unwrap();
    let path = sock(&dir);
    let host = Shared::default();
    let specs = [
        ("w", DType::F32, DType::Bf16, 9000usize),
        ("b", DType::Bf16, DType::Bf16, 3000),
        ("g", DType::F64, DType::F32, 700),
        ("e", DType::F32, DType::F16, 0),
    ];
    let state: Vec<u64> = {
        let mut h = lock(&host);
        specs
            .iter()
            .enumerate()
            .map(|(k, &(_, from, _, n))| {
                h.mem.alloc(&crate::gpu::reference::rng::bytes(
                    n * from.size_bytes(),
                    31 + 2 * k as u64,
                ))
            })
            .collect()
    };
    let plan = CastPlan::of(specs.iter().map(|&(k, f, t, n)| (k, f, t, n as u64))).unwrap();
    let (cast, diff) = RefCast::new(host.clone(), &plan, &state);
    assert_eq!(
        diff[1], state[1],
        "a tensor in the receivers' dtype is read in place"
    );
    let dev = Casting {
        inner: FakeSender::new(host.clone(), diff),
        cast,
    };
    let shapes: Vec<(u64, usize)> = specs
        .iter()
        .map(|&(_, _, t, n)| (n as u64, t.size_bytes()))
        .collect();
    let layout = Layout::new(&shapes).unwrap();
    let mut tx = IpcSender::bind(&path, dev, layout.clone(), 1, T).unwrap();
    let mine: Vec<u64> = {
        let mut h = lock(&host);
        shapes
            .iter()
            .map(|&(n, w)| h.mem.alloc(&vec![0; n as usize * w]))
            .collect()
    };
    let (h, p, addrs, l) = (host.clone(), path.clone(), mine.clone(), layout.clone());
    let rx = thread::spawn(move || {
        let mut r = IpcReceiver::connect(&p, 0, l, FakeReceiver::new(h, addrs), T).unwrap();
        (0..4).map(|_| r.apply(T).unwrap()).collect::<Vec<_>>()
    });
    let names: Vec<(String, DType, Vec<usize>)> = specs
        .iter()
        .map(|&(k, _, t, n)| (k.to_owned(), t, vec![n]))
        .collect();
    for version in 1..=4u64 {
        if version > 1 {
            let mut h = lock(&host);
            for (&a, &(_, from, _, n)) in state.iter().zip(&specs) {
                let bytes = h.mem.write(a, (n * from.size_bytes()) as u64).unwrap();
                for i in (version as usize..bytes.len()).step_by(61) {
                    bytes[i] = bytes[i].wrapping_add(5);
                }
            }
        }
        tx.sync(version).unwrap();
        // What the host would hold: each state tensor cast to the receivers' dtype.
        let mut want = StateDict::new();
        {
            let h = lock(&host);
            for (k, (&a, &(key, from, to, n))) in state.iter().zip(&specs).enumerate() {
                // Aligned copies for the host cast (the simulated device's bytes are not).
                let src = h.mem.read(a, (n * from.size_bytes()) as u64).unwrap();
                let src = Tensor::from_bytes(from, &[n], Class::Trainable, src).unwrap();
                let mut dst = Tensor::zeros(to, &[n], Class::Trainable).unwrap();
                cast_bytes(src.bytes(), from, dst.bytes_mut(), to).unwrap();
                let held = h.mem.read(mine[k], dst.bytes().len() as u64).unwrap();
                assert!(
                    held == dst.bytes(),
                    "version {version}: '{key}' as the host casts it"
                );
                want.insert(key, dst);
            }
        }
        let keys: Vec<String> = specs.iter().map(|s| s.0.to_owned()).collect();
        assert_eq!(
            tx.device_mut().state_checksum(&names).unwrap(),
            state_checksum(&want, &keys),
            "version {version}"
        );
    }
    assert_eq!(rx.join().unwrap(), vec![1, 2, 3, 4]);
}
