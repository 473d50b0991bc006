//! End-to-end weight sync over the shared-memory transport: one sender, two receivers in separate processes.
//!
//! The receivers are this test binary run again with `--exact sync_shm::child_receiver` and [`CHILD_ENV`]
//! describing the child; `child_receiver` does nothing when that variable is absent. After every version each
//! child appends `version:checksum` to a report file and the sender checks it against what it meant to send.

use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use rlsync::config::schema::{Compression, SyncerKind, WeightSyncerConfig};
use rlsync_core::syncer::{SyncOptions, WeightSyncer};
use rlsync_core::tensor::DType;
use rlsync_core::tensor::synthetic::{ModelSpec, SyntheticModel, UpdateMode};
use rlsync_core::transport::shm::{ShmConfig, ShmReceiver, ShmSender};

const CHILD_ENV: &str = "RLSYNC_SYNC_TEST_CHILD";
const TIMEOUT: Duration = Duration::from_secs(30);
const VERSIONS: u64 = 3;

fn spec(seed: u64) -> ModelSpec {
    ModelSpec {
        params: 1 << 16,
        tensors: 12,
        dtype: DType::Bf16,
        frozen_fraction: 0.2,
        seed,
    }
}

fn syncer_config(kind: &str) -> WeightSyncerConfig {
    let mut c = WeightSyncerConfig::default();
    match kind {
        "patch" => c.patch.compression = Compression::Lz4,
        _ => {
            c.kind = SyncerKind::Bucket;
            c.bucket.bucket_size = std::num::NonZeroU64::new(16 << 10).expect("non-zero");
        }
    }
    c
}

struct ChildGuard(Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn_child(kind: &str, socket: &Path, rank: usize) -> ChildGuard {
    let exe = std::env::current_exe().expect("test binary path");
    let child = Command::new(exe)
        .args([
            "--exact",
            "sync_shm::child_receiver",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, format!("{kind}|{}|{rank}", socket.display()))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn child test process");
    ChildGuard(child)
}

#[test]
fn child_receiver() {
    let Ok(spec_env) = std::env::var(CHILD_ENV) else {
        return;
    };
    let parts: Vec<&str> = spec_env.split('|').collect();
    let [kind, socket, rank] = parts.as_slice() else {
        panic!("bad child spec {spec_env:?}")
    };
    let rank: usize = rank.parse().expect("rank");
    let socket = PathBuf::from(socket);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        // Start from other weights than the sender: the init bootstrap (patch) or the buckets align them.
        let mut state = SyntheticModel::new(spec(1000 + rank as u64))
            .expect("model")
            .state_dict()
            .expect("state");
        let rx = WeightSyncer::from_config(&syncer_config(kind), SyncOptions::default())
            .expect("syncer");
        let ch = ShmReceiver::connect(&socket, rank, TIMEOUT)
            .await
            .expect("connect");
        let (mut rx, _) = rx
            .init_receiver(&mut state, ch)
            .await
            .expect("init_receiver");
        for _ in 0..VERSIONS {
            let report = rx.apply(&mut state).await.expect("apply");
            let sum = rx.checksum(&state);
            // The syncer owns the channel, so the child reports through a file next to the socket.
            let line = format!("{}:{sum}\n", report.version);
            let path = socket.with_extension(format!("rank{rank}"));
            let mut text = std::fs::read_to_string(&path).unwrap_or_default();
            text.push_str(&line);
            std::fs::write(&path, text).expect("write report");
        }
    });
}

fn run(kind: &str) {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("sync.sock");
    let children: Vec<ChildGuard> = (0..2)
        .map(|rank| spawn_child(kind, &socket, rank))
        .collect();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let mut model = SyntheticModel::new(spec(7)).expect("model");
    let mut state = model.state_dict().expect("state");
    let mut expected = Vec::new();
    rt.block_on(async {
        let cfg = ShmConfig {
            socket_path: socket.clone(),
            segment_prefix: format!("rlsync-sync-t{}", std::process::id()),
            receivers: 2,
            timeout: TIMEOUT,
            ..Default::default()
        };
        let ch = ShmSender::bind(cfg).await.expect("bind");
        let tx = WeightSyncer::from_config(&syncer_config(kind), SyncOptions::default())
            .expect("syncer");
        let keys = state.synced_keys();
        let (mut tx, _) = tx
            .init_sender(&state, &keys, ch)
            .await
            .expect("init_sender");
        for v in 1..=VERSIONS {
            model
                .step(UpdateMode::Adam { lr: 1e-4 }, &mut state, NonZeroUsize::MIN)
                .expect("step");
            let r = tx.sync(&state, v).await.expect("sync");
            assert!(r.payload_bytes > 0);
            expected.push(format!("{v}:{}", tx.checksum(&state).expect("checksum")));
        }
        tx.flush().await.expect("flush");
    });
    for (rank, mut child) in children.into_iter().enumerate() {
        let status = child.0.wait().expect("wait for child");
        assert!(
            status.success(),
            "{kind}: receiver rank {rank} failed: {status}"
        );
        let report = std::fs::read_to_string(socket.with_extension(format!("rank{rank}")))
            .expect("child report");
        let lines: Vec<&str> = report.lines().collect();
        assert_eq!(
            lines, expected,
            "{kind}: receiver rank {rank} versions/checksums"
        );
    }
}

#[test]
fn patch_over_shm_to_two_receiver_processes() {
    run("patch");
}

#[test]
fn bucket_over_shm_to_two_receiver_processes() {
    run("bucket");
}
