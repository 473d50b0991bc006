//! Workers whose weights live on a device (a Python model on a GPU): the runtime lets the syncs and the sync
//! checks' checksums run on the device and copies the weights to the host only to read them there
//! (checkpoints, local copies, host-path syncs), checked with the test worker's simulated device
//! (`RLSYNC_TEST_DEVICE=1`, see `examples/held_worker/sim_device.rs`).

use std::ffi::OsStr;

use crate::util::{Dir, SMALL_SYNTHETIC};

/// Four steps without evaluation (its sync of the last version would be one more than the metrics' rows show).
const RUN: &[&str] = &[
    "runner.max_steps=4",
    "runner.val_check_interval=-1",
    "hydra.run.dir=run",
];

/// Lines of `role`'s log naming a pull / a push of its simulated device / a checksum hashed on it, and the line
/// saying where its syncs run.
struct DeviceLog {
    pulls: usize,
    pushes: usize,
    checksums: usize,
    attached: Option<String>,
    /// Builds (trainer) / installs (rollout) of the same-host GPU channel.
    channel_builds: usize,
    channel_installs: usize,
    text: String,
}

fn device_log(dir: &Dir, worker: &str) -> DeviceLog {
    let path = dir.join(&format!("run/logs/{worker}.log"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    DeviceLog {
        pulls: text.matches("simulated device: pull").count(),
        pushes: text.matches("simulated device: push").count(),
        checksums: text.matches("simulated device: checksum").count(),
        attached: text.lines().find_map(|l| {
            l.split_once("from now on: ")
                .map(|(_, what)| what.to_owned())
        }),
        channel_builds: text.matches("simulated device: GPU channel build").count(),
        channel_installs: text
            .matches("simulated device: GPU channel install")
            .count(),
        text,
    }
}

fn metrics(dir: &Dir) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join("run/metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn run_on_device(dir: &Dir, command: &str, extra: &[&str]) -> String {
    let worker = crate::util::example("held_worker");
    let mut args = vec![command];
    args.extend_from_slice(SMALL_SYNTHETIC);
    args.extend_from_slice(RUN);
    args.extend_from_slice(extra);
    let out = dir.run_env(
        &args,
        &[
            ("RLSYNC_WORKER", worker.as_os_str()),
            ("RLSYNC_TEST_DEVICE", OsStr::new("1")),
        ],
    );
    out.ok().to_owned()
}

/// Every sync verified (the rollouts' checksums of the weights they hold, read back from the device, equal the
/// trainer's); returns how many syncs after the init bootstrap there were.
fn verified_syncs(dir: &Dir) -> usize {
    let rows = metrics(dir);
    let verified: Vec<bool> = rows
        .iter()
        .filter_map(|r| r.get("sync/verified").and_then(serde_json::Value::as_bool))
        .collect();
    assert!(
        !verified.is_empty() && verified.iter().all(|v| *v),
        "sync/verified: {verified:?}"
    );
    rows.iter()
        .filter(|r| {
            r.get("sync/kind")
                .and_then(serde_json::Value::as_str)
                .is_some_and(|k| k != "init")
        })
        .count()
}

#[test]
fn patch_syncs_run_on_the_device_and_the_host_copies_move_only_for_host_reads() {
    let dir = Dir::new();
    let stdout = run_on_device(&dir, "train_embodied", &["runner.save_interval=2"]);
    let syncs = verified_syncs(&dir);
    assert_eq!(syncs, 3, "versions 1 to 3 synced before steps 2 to 4");
    let trainer = device_log(&dir, "trainer-0");
    assert_eq!(
        trainer.attached.as_deref(),
        Some("simulated device: patch build"),
        "{stdout}"
    );
    // The first pull fills the host copies (the init bootstrap reads them). Then the build reads the device
    // copy and the checksum is of the snapshot: only the checkpoints (steps 2 and 4) read the host copies,
    // each after training changed the device.
    assert_eq!((trainer.pulls, trainer.pushes), (1 + 2, 0), "trainer");
    for rank in 0..2 {
        let rollout = device_log(&dir, &format!("rollout-{rank}"));
        assert_eq!(
            rollout.attached.as_deref(),
            Some("simulated device: patch install"),
            "rollout-{rank}"
        );
        // The first pull fills the host copies. The bootstrap was written into them and pushed once; every
        // later version was installed on the device and hashed there for the rollout's checksum of it (the
        // bootstrap's too): the host copies never move again.
        assert_eq!(
            (rollout.pulls, rollout.pushes),
            (1, 1),
            "rollout-{rank}: the first fill and the bootstrap only"
        );
        assert_eq!(
            rollout.checksums,
            1 + syncs,
            "rollout-{rank}: one device checksum per verified version"
        );
    }
    assert_eq!(
        trainer.checksums, 0,
        "a patch sender's checksum is of its snapshot"
    );
}

#[test]
fn background_installs_on_the_device_are_verified_too() {
    let dir = Dir::new();
    run_on_device(
        &dir,
        "train_async",
        &["actor.sync_weight_no_wait=true", "runner.verify_sync=true"],
    );
    verified_syncs(&dir);
    for rank in 0..2 {
        let rollout = device_log(&dir, &format!("rollout-{rank}"));
        assert_eq!(
            rollout.attached.as_deref(),
            Some("simulated device: patch install")
        );
        assert_eq!(rollout.pushes, 1, "rollout-{rank}: the bootstrap only");
        assert_eq!(rollout.pulls, 1, "rollout-{rank}: the first fill only");
        assert!(
            rollout.checksums > 1,
            "rollout-{rank}: hashed on the device"
        );
    }
}

#[test]
fn without_verification_a_device_rollout_never_copies_back() {
    let dir = Dir::new();
    run_on_device(&dir, "train_embodied", &["runner.verify_sync=false"]);
    let rollout = device_log(&dir, "rollout-0");
    assert_eq!(
        (rollout.pulls, rollout.pushes, rollout.checksums),
        (1, 1, 0),
        "the first fill only"
    );
    let trainer = device_log(&dir, "trainer-0");
    assert_eq!(trainer.pulls, 2, "the first fill and the final checkpoint");
}

#[test]
fn a_bucket_syncer_stays_on_the_host_copies_and_pushes_every_version() {
    let dir = Dir::new();
    run_on_device(&dir, "train_embodied", &["weight_syncer=bucket_syncer"]);
    let syncs = verified_syncs(&dir);
    let trainer = device_log(&dir, "trainer-0");
    assert_eq!(
        trainer.attached, None,
        "the simulated device builds patches only"
    );
    for rank in 0..2 {
        let rollout = device_log(&dir, &format!("rollout-{rank}"));
        assert_eq!(rollout.attached, None);
        assert_eq!(
            rollout.pulls, 1,
            "rollout-{rank}: the first fill; then the host copies are current"
        );
        assert!(
            rollout.pushes >= syncs,
            "rollout-{rank}: every installed version is pushed ({} pushes, {syncs} syncs)",
            rollout.pushes
        );
    }
    // A bucket sender reads the host copies for every sync: one pull per trained version. Its checksum (no
    // dtype changes on the way) is the state's, hashed on the device.
    assert!(trainer.pulls >= 4, "trainer pulls: {}", trainer.pulls);
    assert_eq!(
        trainer.checksums,
        1 + syncs,
        "trainer: one device checksum per version, the bootstrap's too"
    );
}

/// The same-host GPU channel (`weight_syncer.patch.transport_device=cuda`), on the simulated device whose
/// exports cross the workers' processes as files: the handshake and bootstrap on the host, then every version
/// built and installed device to device, each rollout's device checksum equal to the trainer's, and no host
/// copy moving for it.
const GPU_CHANNEL: &[&str] = &[
    "weight_syncer.patch.transport_device=cuda",
    "weight_syncer.patch.snapshot_device=cuda",
];

#[test]
fn the_gpu_channel_carries_every_version_device_to_device_verified() {
    let dir = Dir::new();
    let stdout = run_on_device(&dir, "train_embodied", GPU_CHANNEL);
    let syncs = verified_syncs(&dir);
    assert!(syncs >= 3, "versions synced: {syncs}");
    let trainer = device_log(&dir, "trainer-0");
    assert!(
        trainer
            .attached
            .as_deref()
            .is_some_and(|a| a.starts_with("the same-host GPU channel, device to device")),
        "{stdout}"
    );
    assert!(
        !trainer.text.contains("simulated device: patch build"),
        "no host syncer attached"
    );
    assert_eq!(
        trainer.channel_builds, syncs,
        "one device build per version"
    );
    // The first fill and the final checkpoint read the host copies; the syncs never do.
    assert_eq!((trainer.pulls, trainer.pushes), (2, 0), "trainer");
    assert_eq!(
        trainer.checksums,
        1 + syncs,
        "trainer: the state hashed on the device per version, the bootstrap's too"
    );
    for rank in 0..2 {
        let rollout = device_log(&dir, &format!("rollout-{rank}"));
        assert_eq!(
            rollout.attached.as_deref(),
            Some("the same-host GPU channel, device to device"),
            "rollout-{rank}"
        );
        assert_eq!(rollout.channel_installs, syncs, "rollout-{rank}");
        // The bootstrap was written into the host copies and pushed once; every version since arrived on the
        // device and was hashed there.
        assert_eq!((rollout.pulls, rollout.pushes), (1, 1), "rollout-{rank}");
        assert_eq!(rollout.checksums, 1 + syncs, "rollout-{rank}");
    }
    let rows = metrics(&dir);
    let kinds: Vec<&str> = rows
        .iter()
        .filter_map(|r| r.get("sync/kind").and_then(serde_json::Value::as_str))
        .collect();
    assert_eq!(kinds.first(), Some(&"init"), "{kinds:?}");
    assert!(kinds[1..].iter().all(|k| *k == "patch"), "{kinds:?}");
    // The synthetic updates change a share of the weights: the patches read less than the state.
    let ratios: Vec<f64> = rows
        .iter()
        .filter(|r| r.get("sync/kind").and_then(serde_json::Value::as_str) == Some("patch"))
        .filter_map(|r| {
            r.get("sync/compression_ratio")
                .and_then(serde_json::Value::as_f64)
        })
        .collect();
    assert!(
        !ratios.is_empty() && ratios.iter().all(|r| *r > 1.0),
        "{ratios:?}"
    );
    // The channel's socket and exports lived in the run's private directory, which the run removed.
    let leftovers: Vec<_> = std::fs::read_dir(dir.join("run"))
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().starts_with("sim-gpu-"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

/// `train_async` with no-wait installs over the GPU channel: each rollout waits for the next sync on a thread
/// and installs it between its chunks; the trainer's sync returns once sent. Every version verified.
#[test]
fn the_gpu_channel_installs_in_the_background_with_no_wait() {
    let dir = Dir::new();
    let mut extra = GPU_CHANNEL.to_vec();
    extra.extend_from_slice(&["actor.sync_weight_no_wait=true", "runner.verify_sync=true"]);
    run_on_device(&dir, "train_async", &extra);
    let syncs = verified_syncs(&dir);
    assert!(syncs >= 3, "versions synced: {syncs}");
    let trainer = device_log(&dir, "trainer-0");
    assert_eq!(
        trainer.channel_builds, syncs,
        "one device build per version"
    );
    for rank in 0..2 {
        let rollout = device_log(&dir, &format!("rollout-{rank}"));
        assert_eq!(
            rollout.attached.as_deref(),
            Some("the same-host GPU channel, device to device"),
            "rollout-{rank}"
        );
        // Each version installed once, in the background (the run's last may arrive after the last chunk).
        assert!(
            rollout.channel_installs >= syncs - 1 && rollout.channel_installs <= syncs,
            "rollout-{rank}: {} installs, {syncs} syncs",
            rollout.channel_installs
        );
        assert_eq!((rollout.pulls, rollout.pushes), (1, 1), "rollout-{rank}");
    }
}

#[test]
fn the_gpu_channel_serves_the_trainers_host_and_is_refused_where_it_cannot_serve() {
    let dir = Dir::new();
    // Several hosts: the channel serves the trainer's, the TCP chain the others'.
    let worker = crate::util::example("held_worker");
    let mut args = vec!["train_embodied"];
    args.extend_from_slice(crate::util::SMALL_SYNTHETIC);
    args.extend_from_slice(RUN);
    args.extend_from_slice(GPU_CHANNEL);
    args.extend(["cluster.num_nodes=2", "--dry-run"]);
    let out = dir.run_env(
        &args,
        &[
            ("RLSYNC_WORKER", worker.as_os_str()),
            ("RLSYNC_RUN_TOKEN", std::ffi::OsStr::new("t")),
        ],
    );
    let text = out.ok();
    assert!(
        text.contains("OK: configuration is valid")
            && text.contains("other hosts: coded patches over the TCP chain"),
        "{text}"
    );
    // The built-in workers of rlsync itself keep their weights on the host.
    let mut args = vec!["train_embodied"];
    args.extend_from_slice(crate::util::SMALL_SYNTHETIC);
    args.extend_from_slice(RUN);
    args.extend_from_slice(GPU_CHANNEL);
    args.push("--dry-run");
    let out = dir.run_env(&args, &[]);
    let text = format!("{}{}", out.stdout, out.err());
    assert!(text.contains("keep theirs in host memory"), "{text}");
}

/// fp32 master weights on the trainer (`actor.model.precision`), bf16 rollouts (`rollout.model.precision`,
/// which follows the actor's by default): the channel casts on the trainer's device before each build, the rollouts hold the state
/// cast bit for bit, and the trainer's checksum is of the cast copies (every sync verified).
#[test]
fn the_gpu_channel_casts_fp32_master_weights_for_bf16_rollouts() {
    let dir = Dir::new();
    let mut extra = GPU_CHANNEL.to_vec();
    extra.extend_from_slice(&["actor.model.precision=fp32", "rollout.model.precision=bf16"]);
    let stdout = run_on_device(&dir, "train_embodied", &extra);
    let syncs = verified_syncs(&dir);
    assert!(syncs >= 3, "versions synced: {syncs}");
    let trainer = device_log(&dir, "trainer-0");
    assert!(
        trainer
            .text
            .contains("simulated device: GPU channel sender, casting")
            && trainer
                .attached
                .as_deref()
                .is_some_and(|a| a.contains("cast to the rollouts' dtypes on the GPU")),
        "{stdout}"
    );
    assert_eq!(trainer.channel_builds, syncs);
    // The trainer's checksum per version is hashed on the device: its host copies move only for the first
    // fill and the final checkpoint.
    assert_eq!((trainer.pulls, trainer.pushes), (2, 0), "trainer");
    let rows = metrics(&dir);
    let state_bytes: Vec<u64> = rows
        .iter()
        .filter_map(|r| {
            r.get("sync/state_bytes")
                .and_then(serde_json::Value::as_u64)
        })
        .collect();
    assert!(
        state_bytes.iter().all(|b| *b == 2 * 65536),
        "the rollouts' bf16 bytes: {state_bytes:?}"
    );
}
