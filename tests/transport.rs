//! Integration tests of the transports: in-process broadcast, and shm across real processes (re-exec'd test binary).
//!
//! Multi-process tests run this same test binary again with `--exact transport::child_process` and
//! [`CHILD_ENV`] describing the child's role; `child_process` does nothing when that variable is absent.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use rlsync_core::transport::shm::{ShmConfig, ShmReceiver, ShmSender, remove_leftovers};
use rlsync_core::transport::{
    Peer, Receiver, Sender, TransportError, inproc_channel, inproc_channel_with_timeout,
};

const CHILD_ENV: &str = "RLSYNC_TRANSPORT_TEST_CHILD";
const TIMEOUT: Duration = Duration::from_secs(30);
const SENT_MARKER: &str = "RLSYNC-CHILD-SENT";

/// Payload sizes: empty ones, odd ones, and several beyond the 4 KiB initial capacity (forcing segment growth).
const SIZES: [usize; 14] = [
    0,
    1,
    4096,
    4097,
    100_000,
    0,
    3 << 20,
    17,
    (5 << 20) | 3,
    1 << 20,
    9 << 20,
    0,
    12_345,
    2 << 20,
];
const ROUNDS: usize = 3;

fn sizes() -> impl Iterator<Item = (u64, usize)> {
    (0..ROUNDS)
        .flat_map(|_| SIZES)
        .enumerate()
        .map(|(i, len)| (i as u64, len))
}

/// Deterministic bytes for payload `seed`, different for every payload and position.
fn fill_pattern(seed: u64, buf: &mut [u8]) {
    let salt = seed.wrapping_mul(0xD1B5_4A32_D192_ED03).wrapping_add(1);
    for (i, b) in buf.iter_mut().enumerate() {
        *b = ((i as u64 ^ salt).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8;
    }
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0; len];
    fill_pattern(seed, &mut v);
    v
}

fn unique_prefix(test: &str) -> String {
    format!("rlsync-t{}-{test}", std::process::id())
}

/// Names under /dev/shm that belong to `prefix`.
fn shm_files(prefix: &str) -> Vec<String> {
    let lead = format!("{prefix}.");
    std::fs::read_dir("/dev/shm")
        .map(|dir| {
            dir.flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|n| n.starts_with(&lead))
                .collect()
        })
        .unwrap_or_default()
}

fn config(socket_path: &Path, prefix: &str, receivers: usize) -> ShmConfig {
    ShmConfig {
        socket_path: socket_path.to_owned(),
        segment_prefix: prefix.to_owned(),
        receivers,
        timeout: TIMEOUT,
        slots: 2,
        initial_capacity: 4096,
        elastic: false,
    }
}

/// A child process that is killed if the test ends before it does.
struct ChildGuard(Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn_child(role: &str, socket: &Path, rank: usize, prefix: &str, piped: bool) -> ChildGuard {
    let exe = std::env::current_exe().expect("test binary path");
    let child = Command::new(exe)
        .args([
            "--exact",
            "transport::child_process",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(
            CHILD_ENV,
            format!("{role}|{}|{rank}|{prefix}", socket.display()),
        )
        .stdin(Stdio::null())
        // The child's own "test result" lines would mix with ours; its panics still reach stderr.
        .stdout(if piped { Stdio::piped() } else { Stdio::null() })
        .spawn()
        .expect("spawn child test process");
    ChildGuard(child)
}

fn wait_success(mut guard: ChildGuard) {
    let status = guard.0.wait().expect("wait for child");
    assert!(status.success(), "child failed: {status}");
}

fn sigkill(guard: &mut ChildGuard) {
    guard.0.kill().expect("kill child");
    guard.0.wait().expect("reap child");
}

// ---------------------------------------------------------------------------------------------------------------
// The child side of the multi-process tests.

#[test]
fn child_process() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let parts: Vec<&str> = spec.split('|').collect();
    let [role, socket, rank, prefix] = parts.as_slice() else {
        panic!("bad child spec {spec:?}")
    };
    let rank: usize = rank.parse().expect("rank");
    let socket = PathBuf::from(socket);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async move {
        match *role {
            "recv" => child_receive_all(&socket, rank).await,
            "drain" => child_drain(&socket, rank).await,
            "hang" => child_hang(&socket, rank).await,
            "send" => child_send_then_hang(&socket, prefix).await,
            other => panic!("unknown child role {other}"),
        }
    });
}

/// Receive every payload of [`sizes`], checking each byte, then report upstream and expect the sender to go.
async fn child_receive_all(socket: &Path, rank: usize) {
    let mut rx = ShmReceiver::connect(socket, rank, TIMEOUT)
        .await
        .expect("connect");
    assert_eq!(rx.rank(), rank);
    rx.send(format!("joined:{rank}").as_bytes())
        .await
        .expect("upstream hello");
    let mut checked = 0usize;
    for (seed, len) in sizes() {
        let ok = rx
            .recv_with(|bytes| bytes.len() == len && bytes == pattern(seed, len).as_slice())
            .await
            .expect("recv");
        assert!(ok, "payload {seed} ({len} bytes) differs at rank {rank}");
        checked += 1;
    }
    rx.send(format!("verified:{checked}").as_bytes())
        .await
        .expect("upstream report");
    let end = rx.recv_with(|_| ()).await.expect_err("sender is gone");
    assert!(
        matches!(
            end,
            TransportError::PeerGone {
                peer: Peer::Sender,
                ..
            }
        ),
        "{end}"
    );
}

/// Receive until the channel ends, whatever happens to the other receivers.
async fn child_drain(socket: &Path, rank: usize) {
    let mut rx = ShmReceiver::connect(socket, rank, TIMEOUT)
        .await
        .expect("connect");
    while rx.recv_with(|_| ()).await.is_ok() {}
}

/// Receive three payloads, say so upstream, then stop reading (the parent kills us).
async fn child_hang(socket: &Path, rank: usize) {
    let mut rx = ShmReceiver::connect(socket, rank, TIMEOUT)
        .await
        .expect("connect");
    for _ in 0..3 {
        rx.recv_with(|_| ()).await.expect("recv");
    }
    rx.send(b"ready").await.expect("upstream");
    tokio::time::sleep(Duration::from_secs(600)).await;
}

/// Bind as the sender, publish a payload larger than the initial capacity (a fresh, not yet mapped segment),
/// announce it on stdout, then wait to be SIGKILLed.
async fn child_send_then_hang(socket: &Path, prefix: &str) {
    let mut tx = ShmSender::bind(config(socket, prefix, 1))
        .await
        .expect("bind");
    tx.send_with(2 << 20, |buf| fill_pattern(1, buf))
        .await
        .expect("send");
    println!("{SENT_MARKER}");
    tokio::time::sleep(Duration::from_secs(600)).await;
}

// ---------------------------------------------------------------------------------------------------------------
// In-process channel.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inproc_broadcasts_every_payload_to_every_receiver() {
    let (mut tx, rxs) = inproc_channel(3);
    assert_eq!(tx.receivers(), 3);
    let readers: Vec<_> = rxs
        .into_iter()
        .map(|mut rx| {
            tokio::spawn(async move {
                let rank = rx.rank();
                rx.send(format!("meta:{rank}").as_bytes())
                    .await
                    .expect("upstream");
                for (seed, len) in sizes() {
                    let ok = rx
                        .recv_with(|b| b == pattern(seed, len).as_slice())
                        .await
                        .expect("recv");
                    assert!(ok, "payload {seed} differs at rank {rank}");
                }
                rx.send(b"done").await.expect("upstream");
                let end = rx.recv_with(|_| ()).await.expect_err("sender dropped");
                assert!(
                    matches!(
                        end,
                        TransportError::PeerGone {
                            peer: Peer::Sender,
                            ..
                        }
                    ),
                    "{end}"
                );
            })
        })
        .collect();
    for rank in 0..3 {
        assert_eq!(
            tx.recv_from(rank).await.expect("meta"),
            format!("meta:{rank}").into_bytes()
        );
    }
    for (seed, len) in sizes() {
        tx.send_with(len, |buf| fill_pattern(seed, buf))
            .await
            .expect("send");
    }
    tx.flush().await.expect("flush");
    for rank in 0..3 {
        assert_eq!(tx.recv_from(rank).await.expect("done"), b"done");
    }
    drop(tx);
    for reader in readers {
        reader.await.expect("reader task");
    }
}

#[tokio::test]
async fn inproc_names_the_receiver_that_stalls_or_leaves() {
    let (mut tx, mut rxs) = inproc_channel_with_timeout(2, Duration::from_millis(100));
    tx.send(b"one").await.expect("first payload");
    for _ in 1..rlsync_core::transport::DEFAULT_SLOTS {
        tx.send(b"more").await.expect("payload filling a slot");
    }
    let Some(rx0) = rxs.get_mut(0) else {
        panic!("rank 0")
    };
    assert_eq!(
        rx0.recv_with(<[u8]>::to_vec).await.expect("rank 0 reads"),
        b"one"
    );
    // Every slot is in flight and rank 1 never reads: the next send times out naming rank 1 only.
    let err = tx.send(b"three").await.expect_err("stalled receiver");
    assert!(
        matches!(
            &err,
            TransportError::Timeout {
                peer: Peer::Receiver(1),
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("receiver rank 1"), "{err}");
    rxs.truncate(1);
    let err = tx.flush().await.expect_err("receiver 1 dropped");
    assert!(
        matches!(
            err,
            TransportError::PeerGone {
                peer: Peer::Receiver(1),
                ..
            }
        ),
        "{err}"
    );
    assert!(matches!(
        tx.recv_from(7).await,
        Err(TransportError::NoSuchRank {
            rank: 7,
            receivers: 2
        })
    ));
}

// ---------------------------------------------------------------------------------------------------------------
// Shared memory across processes.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_two_receiver_processes_read_every_payload() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("sync.sock");
    let prefix = unique_prefix("two");
    let children = [
        spawn_child("recv", &socket, 0, &prefix, false),
        spawn_child("recv", &socket, 1, &prefix, false),
    ];
    let mut tx = ShmSender::bind(config(&socket, &prefix, 2))
        .await
        .expect("bind");
    assert!(
        !socket.exists(),
        "socket file is removed once every receiver joined"
    );
    for rank in 0..2 {
        assert_eq!(
            tx.recv_from(rank).await.expect("joined"),
            format!("joined:{rank}").into_bytes()
        );
    }
    for (seed, len) in sizes() {
        tx.send_with(len, |buf| fill_pattern(seed, buf))
            .await
            .expect("send");
    }
    tx.flush().await.expect("flush");
    assert_eq!(
        shm_files(&prefix),
        Vec::<String>::new(),
        "segments are unlinked once mapped"
    );
    let expected = format!("verified:{}", SIZES.len() * ROUNDS).into_bytes();
    for rank in 0..2 {
        assert_eq!(tx.recv_from(rank).await.expect("report"), expected);
    }
    drop(tx);
    for child in children {
        wait_success(child);
    }
    assert!(shm_files(&prefix).is_empty());
    assert!(!socket.exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_receiver_killed_mid_stream_fails_the_sender_naming_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("sync.sock");
    let prefix = unique_prefix("kill");
    let drain = spawn_child("drain", &socket, 0, &prefix, false);
    let mut hang = spawn_child("hang", &socket, 1, &prefix, false);
    let mut tx = ShmSender::bind(config(&socket, &prefix, 2))
        .await
        .expect("bind");
    for seed in 0..3 {
        tx.send_with(10_000, |buf| fill_pattern(seed, buf))
            .await
            .expect("send");
    }
    assert_eq!(tx.recv_from(1).await.expect("ready"), b"ready");
    sigkill(&mut hang);
    let mut outcome = Ok(());
    // Two slots: at most a couple of sends can still succeed before rank 1's release is needed.
    for seed in 3..20 {
        outcome = tx.send_with(3 << 20, |buf| fill_pattern(seed, buf)).await;
        if outcome.is_err() {
            break;
        }
    }
    let err = outcome.expect_err("a dead receiver fails the sender");
    assert!(
        matches!(
            err,
            TransportError::PeerGone {
                peer: Peer::Receiver(1),
                ..
            }
        ),
        "{err}"
    );
    assert!(
        matches!(tx.flush().await, Err(TransportError::Broken { .. })),
        "the channel stays failed"
    );
    assert!(
        shm_files(&prefix).is_empty(),
        "segments are unlinked on error"
    );
    assert!(!socket.exists());
    drop(tx);
    wait_success(drain);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_sender_sigkill_leftovers_are_swept() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("sync.sock");
    let prefix = unique_prefix("crash");
    let mut sender = spawn_child("send", &socket, 0, &prefix, true);
    let mut rx = ShmReceiver::connect(&socket, 0, TIMEOUT)
        .await
        .expect("connect");
    let stdout = sender.0.stdout.take().expect("piped stdout");
    let saw_marker = tokio::task::spawn_blocking(move || {
        BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .any(|line| line.contains(SENT_MARKER))
    })
    .await
    .expect("stdout reader");
    assert!(saw_marker, "child sender published");
    sigkill(&mut sender);
    let left = shm_files(&prefix);
    assert_eq!(
        left.len(),
        1,
        "the published, not yet mapped segment survives a SIGKILL: {left:?}"
    );
    assert!(
        !socket.exists(),
        "the socket file went away when the receiver joined"
    );
    assert_eq!(remove_leftovers(&prefix).expect("sweep"), 1);
    assert!(shm_files(&prefix).is_empty());
    assert_eq!(remove_leftovers(&prefix).expect("second sweep"), 0);
    let err = rx
        .recv_with(|_| ())
        .await
        .expect_err("the segment and the sender are gone");
    // A missing announced segment means its sender removed it or was swept after it died: the peer is gone.
    assert!(
        matches!(
            err,
            TransportError::PeerGone {
                peer: rlsync_core::transport::Peer::Sender,
                ..
            }
        ),
        "{err}"
    );
}

// ---------------------------------------------------------------------------------------------------------------
// Shared memory within one process (handshake, modes, timeouts).

async fn pair(socket: &Path, prefix: &str, timeout: Duration) -> (Sender, Receiver) {
    let cfg = ShmConfig {
        timeout,
        ..config(socket, prefix, 1)
    };
    let (tx, rx) = tokio::join!(
        ShmSender::bind(cfg),
        ShmReceiver::connect(socket, 0, timeout)
    );
    (tx.expect("bind"), rx.expect("connect"))
}

#[tokio::test]
async fn a_socket_path_too_long_for_a_unix_address_is_a_config_error_naming_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let deep = dir.path().join("d".repeat(100));
    std::fs::create_dir(&deep).expect("mkdir");
    let socket = deep.join("s.sock");
    let len = socket.as_os_str().len();
    assert!(len > rlsync_core::transport::shm::MAX_SOCKET_PATH);
    let prefix = unique_prefix("long");
    let errors = [
        ShmSender::bind(config(&socket, &prefix, 1)).await.err(),
        ShmReceiver::connect(&socket, 0, TIMEOUT).await.err(),
    ];
    for err in errors {
        let err = err.expect("refused");
        let text = err.to_string();
        assert!(matches!(err, TransportError::Config { .. }), "{text}");
        assert!(
            text.contains(&socket.display().to_string())
                && text.contains(&format!("is {len} bytes")),
            "{text}"
        );
    }
    assert!(!socket.exists() && shm_files(&prefix).is_empty());
}

#[tokio::test]
async fn shm_segments_are_private_and_unlinked_once_mapped() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("s.sock");
    let prefix = unique_prefix("mode");
    let (mut tx, mut rx) = pair(&socket, &prefix, TIMEOUT).await;
    tx.send_with(64 << 10, |buf| fill_pattern(9, buf))
        .await
        .expect("send");
    let files = shm_files(&prefix);
    let [name] = files.as_slice() else {
        panic!("one segment expected, got {files:?}")
    };
    let mode = std::fs::metadata(Path::new("/dev/shm").join(name))
        .expect("stat segment")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "segment {name} mode {mode:o}");
    let (ok, addr) = rx
        .recv_with(|b| (b == pattern(9, 64 << 10).as_slice(), b.as_ptr() as usize))
        .await
        .expect("recv");
    assert!(ok);
    assert_eq!(addr % 64, 0, "payloads start aligned");
    tx.flush().await.expect("flush");
    assert!(shm_files(&prefix).is_empty());
}

#[tokio::test]
async fn shm_timeouts_and_refused_sizes_are_recoverable() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("s.sock");
    let (mut tx, mut rx) = pair(&socket, &unique_prefix("idle"), Duration::from_secs(1)).await;
    let err = rx.recv_with(|_| ()).await.expect_err("nothing was sent");
    assert!(
        matches!(
            err,
            TransportError::Timeout {
                peer: Peer::Sender,
                ..
            }
        ),
        "{err}"
    );
    tx.send(b"late").await.expect("send");
    assert_eq!(
        rx.recv_with(<[u8]>::to_vec)
            .await
            .expect("recv after a timeout"),
        b"late"
    );
    let err = tx.recv_from(0).await.expect_err("no upstream message");
    assert!(
        matches!(
            err,
            TransportError::Timeout {
                peer: Peer::Receiver(0),
                ..
            }
        ),
        "{err}"
    );
    let err = tx
        .send_with(usize::MAX, |_| ())
        .await
        .expect_err("impossible size");
    assert!(matches!(err, TransportError::TooLarge { .. }), "{err}");
    tx.send(b"after")
        .await
        .expect("still usable after a refused size");
    assert_eq!(rx.recv_with(<[u8]>::to_vec).await.expect("recv"), b"after");
}

#[tokio::test]
async fn shm_bind_refuses_bad_ranks_and_times_out_naming_missing_ones() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("s.sock");
    let prefix = unique_prefix("hello");
    // Long enough for every connection below to reach the sender even on a loaded machine.
    let cfg = ShmConfig {
        timeout: Duration::from_secs(3),
        ..config(&socket, &prefix, 2)
    };
    let bind = tokio::spawn(ShmSender::bind(cfg));
    let bad = ShmReceiver::connect(&socket, 5, TIMEOUT)
        .await
        .expect_err("rank out of range");
    assert!(
        matches!(&bad, TransportError::Rejected { reason } if reason.contains("rank 5")),
        "{bad}"
    );
    // Rank 0 tries to join twice (one is refused as a duplicate, the other waits for the welcome); rank 1
    // never joins.
    let join0 = || {
        let socket = socket.clone();
        tokio::spawn(async move { ShmReceiver::connect(&socket, 0, Duration::from_secs(6)).await })
    };
    let (first, second) = (join0(), join0());
    let err = bind
        .await
        .expect("bind task")
        .expect_err("rank 1 is missing");
    assert!(
        matches!(&err, TransportError::Timeout { peer: Peer::Receivers(missing), .. } if missing == &[1]),
        "{err}"
    );
    assert!(!socket.exists(), "socket file removed on error");
    let outcomes = [
        first.await.expect("join task"),
        second.await.expect("join task"),
    ];
    let refused = outcomes
        .iter()
        .filter(|o| matches!(o, Err(TransportError::Rejected { reason }) if reason.contains("already joined")))
        .count();
    assert_eq!(refused, 1, "exactly one duplicate rank 0 is refused");
    assert!(
        outcomes.iter().all(Result::is_err),
        "the accepted rank 0 hears that the sender gave up"
    );
}

#[tokio::test]
async fn shm_config_is_validated() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("s.sock");
    let check = |cfg: ShmConfig| async move { ShmSender::bind(cfg).await.map(|_| ()) };
    let bad_prefix = ShmConfig {
        segment_prefix: "a/b".into(),
        ..config(&socket, "x", 1)
    };
    assert!(matches!(
        check(bad_prefix).await,
        Err(TransportError::Config { .. })
    ));
    let no_path = ShmConfig {
        socket_path: PathBuf::new(),
        ..config(&socket, "x", 1)
    };
    assert!(matches!(
        check(no_path).await,
        Err(TransportError::Config { .. })
    ));
    let no_slots = ShmConfig {
        slots: 0,
        ..config(&socket, "x", 1)
    };
    assert!(matches!(
        check(no_slots).await,
        Err(TransportError::Config { .. })
    ));
    std::fs::write(&socket, b"not a socket").expect("write file");
    assert!(matches!(
        check(config(&socket, "x", 1)).await,
        Err(TransportError::Config { .. })
    ));
}

#[test]
fn shm_fill_that_panics_leaves_the_channel_consistent() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("s.sock");
    let prefix = unique_prefix("panic");
    let (mut tx, mut rx) = rt.block_on(pair(&socket, &prefix, TIMEOUT));
    // The fill panics after a bigger segment was created for slot 0 but before it was announced.
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        rt.block_on(tx.send_with(3 << 20, |_| panic!("fill failed")))
    }));
    assert!(panicked.is_err());
    rt.block_on(async {
        for (seed, len) in [(1, 2 << 20), (2, 3 << 20), (3, 5)] {
            tx.send_with(len, |buf| fill_pattern(seed, buf))
                .await
                .expect("send after a panicked fill");
            let ok = rx
                .recv_with(|b| b == pattern(seed, len).as_slice())
                .await
                .expect("recv");
            assert!(ok, "payload {seed} intact");
        }
        tx.flush().await.expect("flush");
    });
    assert!(shm_files(&prefix).is_empty());
}

#[tokio::test]
async fn shm_silent_connection_does_not_hold_up_the_receivers() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("s.sock");
    let prefix = unique_prefix("silent");
    let bind = tokio::spawn(ShmSender::bind(config(&socket, &prefix, 1)));
    // A connection that never says hello, made as soon as the sender listens.
    let mut silent = None;
    for _ in 0..1000 {
        if let Ok(stream) = tokio::net::UnixStream::connect(&socket).await {
            silent = Some(stream);
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(silent.is_some(), "sender never listened");
    let mut rx = ShmReceiver::connect(&socket, 0, TIMEOUT)
        .await
        .expect("real receiver joins");
    let mut tx = bind
        .await
        .expect("bind task")
        .expect("bind completes without the silent peer");
    tx.send(b"hi").await.expect("send");
    assert_eq!(rx.recv_with(<[u8]>::to_vec).await.expect("recv"), b"hi");
}

// ---------------------------------------------------------------------------------------------------------------
// Elastic shm channels: a dead receiver is detached, a new one takes its rank.

async fn read_all(rx: &mut Receiver) -> Vec<u8> {
    rx.recv_with(<[u8]>::to_vec).await.expect("payload")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_elastic_channel_detaches_the_dead_and_admits_a_successor() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("sync.sock");
    let prefix = unique_prefix("elastic");
    let cfg = ShmConfig {
        elastic: true,
        ..config(&socket, &prefix, 2)
    };
    let bind = tokio::spawn(ShmSender::bind(cfg));
    // The sender welcomes the first receivers together, once all joined.
    let (r0, r1) = tokio::join!(
        ShmReceiver::connect(&socket, 0, TIMEOUT),
        ShmReceiver::connect(&socket, 1, TIMEOUT)
    );
    let (mut r0, mut r1) = (r0.expect("rank 0"), r1.expect("rank 1"));
    let mut tx = bind.await.expect("task").expect("bind");
    assert!(socket.exists(), "an elastic channel keeps listening");
    tx.send(&pattern(0, 100_000)).await.expect("send");
    assert_eq!(read_all(&mut r0).await, pattern(0, 100_000));
    assert_eq!(read_all(&mut r1).await, pattern(0, 100_000));
    tx.flush().await.expect("flush");
    assert!(
        shm_files(&prefix).is_empty(),
        "mapped segments are unlinked"
    );

    // Rank 1 dies: payloads go on to rank 0, more than the slots hold, and grow the segments.
    drop(r1);
    for seed in 1..8 {
        let len = 3 << 20 | seed as usize;
        tx.send(&pattern(seed, len))
            .await
            .expect("a dead rank is detached");
        assert_eq!(read_all(&mut r0).await, pattern(seed, len));
    }
    assert_eq!(tx.live(), vec![0]);
    assert!(matches!(
        tx.send_to(1, b"x").await,
        Err(TransportError::PeerGone {
            peer: Peer::Receiver(1),
            ..
        })
    ));

    // Its successor joins; a payload for it alone, then one for both.
    let mut r1 = ShmReceiver::connect(&socket, 1, TIMEOUT)
        .await
        .expect("rejoin");
    tx.wait_joined(1).await.expect("admitted");
    assert_eq!(tx.live(), vec![0, 1]);
    tx.send_to(1, &pattern(100, 5000)).await.expect("targeted");
    tx.send(&pattern(101, 4 << 20)).await.expect("broadcast");
    assert_eq!(read_all(&mut r1).await, pattern(100, 5000));
    assert_eq!(read_all(&mut r1).await, pattern(101, 4 << 20));
    assert_eq!(
        read_all(&mut r0).await,
        pattern(101, 4 << 20),
        "rank 0 never sees the other rank's payload"
    );
    r1.send(b"up").await.expect("upstream");
    assert_eq!(tx.recv_from(1).await.expect("message"), b"up");
    tx.flush().await.expect("flush");
    assert!(
        shm_files(&prefix).is_empty(),
        "the successor mapped what it was told"
    );
    drop(tx);
    assert!(!socket.exists(), "the socket file goes with the sender");
    assert!(shm_files(&prefix).is_empty());
}

#[tokio::test]
async fn inproc_elastic_channel_admits_a_successor_once_the_rank_is_gone() {
    let (mut tx, mut rxs, joiner) =
        rlsync_core::transport::inproc_channel_elastic(2, Duration::from_secs(5));
    let r1 = rxs.pop().expect("rank 1");
    let mut r0 = rxs.pop().expect("rank 0");
    // A joiner for a live rank waits (parked) until the old receiver is gone.
    let mut r1b = joiner.join(1).expect("join");
    tx.send(b"a").await.expect("send");
    assert_eq!(read_all(&mut r0).await, b"a");
    drop(r1);
    tx.wait_joined(1)
        .await
        .expect("admitted after the old one left");
    tx.send_to(1, b"only").await.expect("targeted");
    tx.send(b"both").await.expect("send");
    assert_eq!(read_all(&mut r1b).await, b"only");
    assert_eq!(read_all(&mut r1b).await, b"both");
    assert_eq!(read_all(&mut r0).await, b"both");
    tx.flush().await.expect("flush");
    assert!(matches!(
        joiner.join(2),
        Err(TransportError::NoSuchRank { rank: 2, .. })
    ));
}
