//! The same-host GPU channel in the worker runtime (`weight_syncer.patch.transport_device: cuda`): its ends over
//! the devices a workload opens on its CUDA tensors, and what the runtime reports of each sync.
//!
//! The rollouts of one host receive every version from the trainer's GPU, device to device: the trainer's
//! `diff_compact` output, checksummed, read in place by each rollout's `apply_compact` through CUDA IPC
//! ([`rlsync_core::gpu::ipc`]); no host copy, no coding. The handshake (names, dtypes, shapes) and the init
//! bootstrap (frozen tensors included) still run once over the host channel, so the channel starts on states
//! the syncer has checked; from then on it carries the synced tensors, in the syncer's order.
//!
//! A workload whose weights are CUDA tensors opens the devices ([`Workload::gpu_sender_device`],
//! [`Workload::gpu_receiver_device`]); the runtime binds, connects and drives the ends. Blocking installs take
//! each sync on the orchestrator's apply; no-wait installs (`train_async`, `actor.sync_weight_no_wait`) wait
//! for it on a thread and install it between chunks, the trainer's sync returning once sent and collecting
//! its acks at the next one.
//!
//! Restartable rollouts (`runner.rollout_restarts` > 0): a rollout that dies is dropped from the channel (the
//! sync goes on for the others) and its successor rejoins in two halves ([`catch_up`]): on the host channel
//! the trainer's [`HostRejoin`] checks its tensors and sends the frozen keys its copy lacks; then the channel
//! gives it a full copy of the current version from the trainer's device snapshot
//! ([`IpcSender::rejoin`]). There is no replay: a device-to-device copy of the synced state costs less than
//! the host hashing a replay would need, and the rollouts keep no local copy.

use std::path::Path;
use std::time::{Duration, Instant};

use rlsync_core::gpu::compact::Layout;
use rlsync_core::gpu::ipc::{
    IpcError, IpcReceiver, IpcSender, PeerError, ReceiverDevice, ReceiverTiming, SenderDevice,
    SyncReport,
};
use rlsync_core::protocol::messages::{Report, SyncStats};
use rlsync_core::syncer::HostRejoin;
use rlsync_core::tensor::{DType, StateDict};

use crate::worker::WorkerError;
use crate::worker::workload::{Workload, WorkloadError};

/// The trainer's end: the channel over the device its workload opened.
pub type ChannelSender = IpcSender<Box<dyn SenderDevice + Send>>;
/// A rollout's end.
pub type ChannelReceiver = IpcReceiver<Box<dyn ReceiverDevice + Send>>;

/// The synced tensors as the rollouts hold them: each key, its dtype there and its shape (what the channel's
/// state checksum names).
pub type Names = Vec<(String, DType, Vec<usize>)>;

/// The names of `keys` of `state` in the rollouts' `dtypes` (the handshake's, in the order of `keys`).
pub fn names(state: &StateDict, keys: &[String], dtypes: &[DType]) -> Result<Names, WorkloadError> {
    keys.iter()
        .zip(dtypes)
        .map(|(k, &d)| {
            let t = state
                .get(k)
                .ok_or_else(|| WorkloadError::MissingTensor { name: k.clone() })?;
            Ok((k.clone(), d, t.shape().to_vec()))
        })
        .collect()
}

/// The trainer's end of the channel: where, for how many rollouts, and how patient.
pub struct SenderSpec<'a> {
    pub socket: &'a Path,
    pub receivers: usize,
    /// Bounds every wait.
    pub timeout: Duration,
    /// Restartable rollouts: a dead one is dropped, not the sync's error.
    pub elastic: Option<Elastic<'a>>,
}

/// Restartable rollouts at the channel's bootstrap.
pub struct Elastic<'a> {
    /// The weight receivers away on the host channel now: gone, or replaced by a successor whose rejoin is
    /// pending (asked while the bootstrap waits for the rollouts to connect: it stops waiting for those, they
    /// rejoin).
    pub away: &'a mut dyn FnMut() -> Vec<u32>,
    /// How long it waits for the others, leaving those that did not connect (their process died since) to
    /// rejoin.
    pub wait: Duration,
}

/// Trainer: the channel of `spec` over the device tensors of `keys` (the synced keys, in the syncer's order)
/// of `workload`, which the rollouts hold in `dtypes` (a floating tensor in another dtype is cast on the
/// device first); snapshot copy := those tensors, every rollout given a full copy as `version`.
pub fn open_sender(
    workload: &mut dyn Workload,
    state: &StateDict,
    keys: &[String],
    dtypes: &[DType],
    spec: SenderSpec<'_>,
    version: u64,
) -> Result<(ChannelSender, SyncReport), WorkerError> {
    let layout = layout(state, keys, dtypes)?;
    let device = workload.gpu_sender_device(state, keys, dtypes)?;
    let mut channel = IpcSender::bind(spec.socket, device, layout, spec.receivers, spec.timeout)?;
    let report = match spec.elastic {
        Some(elastic) => {
            channel.set_elastic(true);
            channel.set_connect_wait(elastic.wait);
            channel.bootstrap_elastic(version, elastic.away)?
        }
        None => channel.bootstrap(version)?,
    };
    Ok((channel, report))
}

/// Rollout `rank`: connect to the trainer's channel at `socket` with the device tensors of `keys` of
/// `workload`, and install its full copy; that copy's version.
pub fn open_receiver(
    workload: &mut dyn Workload,
    state: &StateDict,
    keys: &[String],
    socket: &Path,
    rank: u32,
    timeout: Duration,
) -> Result<(ChannelReceiver, u64), WorkerError> {
    let mut dtypes = Vec::with_capacity(keys.len());
    for k in keys {
        let t = state
            .get(k)
            .ok_or_else(|| WorkloadError::MissingTensor { name: k.clone() })?;
        dtypes.push(t.dtype());
    }
    let layout = layout(state, keys, &dtypes)?;
    let device = workload.gpu_receiver_device(state, keys)?;
    let mut channel = IpcReceiver::connect(socket, rank, layout, device, timeout)?;
    let version = channel.apply(timeout)?;
    Ok((channel, version))
}

/// The channel's tensor layout of `keys` of `state` held in `dtypes` (elements and element width of each, in
/// order).
pub fn layout(
    state: &StateDict,
    keys: &[String],
    dtypes: &[DType],
) -> Result<Layout, WorkloadError> {
    let shapes = keys
        .iter()
        .zip(dtypes)
        .map(|(k, d)| {
            let t = state
                .get(k)
                .ok_or_else(|| WorkloadError::MissingTensor { name: k.clone() })?;
            Ok((t.numel() as u64, d.size_bytes()))
        })
        .collect::<Result<Vec<_>, WorkloadError>>()?;
    Layout::new(&shapes).map_err(|e| WorkloadError::GpuChannel {
        reason: rlsync_core::error_chain(&e),
    })
}

/// The state checksum of the synced tensors as the rollouts hold them after the last sync (hashed on the
/// device where the channel's sender works, the cast copies where it casts).
pub fn checksum(channel: &mut ChannelSender, names: &Names) -> Result<u64, WorkerError> {
    tokio::task::block_in_place(|| channel.device_mut().state_checksum(names))
        .map_err(|e| WorkerError::GpuChannel(IpcError::Gpu(e)))
}

/// The bytes of the synced tensors as the rollouts hold them.
pub fn state_bytes(names: &Names) -> u64 {
    names
        .iter()
        .map(|(_, d, shape)| (shape.iter().product::<usize>() * d.size_bytes()) as u64)
        .sum()
}

/// Trainer: serve the rejoin of restarted rollout `rank`, weight receiver `receiver` of both channels: the
/// host channel's handshake and frozen keys ([`HostRejoin::serve`]), then the channel's full copy of the
/// current version ([`IpcSender::rejoin`]; `state_bytes` of the synced tensors). The rollout going away
/// meanwhile (gone, silent past the timeout, never connecting) is not the trainer's failure: the report says
/// so and the orchestrator restarts it again.
pub async fn catch_up(
    host: &mut HostRejoin,
    channel: &mut ChannelSender,
    state_bytes: u64,
    state: &StateDict,
    rank: u32,
    receiver: u32,
) -> Result<Report, WorkerError> {
    let started = Instant::now();
    let failed = |reason: String| {
        tracing::warn!("rejoin of rollout-{rank} failed: {reason}");
        Report::rejoin_failed(rank, started.elapsed().as_secs_f64(), reason)
    };
    let on_host = match host.serve(state, receiver as usize).await {
        Ok(r) => r,
        Err(e) => match crate::worker::trainer::went_away(&e, receiver as usize) {
            Some(gone) => return Ok(failed(gone.to_string())),
            None => return Err(e.into()),
        },
    };
    let full = match tokio::task::block_in_place(|| channel.rejoin(receiver)) {
        Ok(r) => r,
        Err(
            e @ IpcError::Receiver {
                rank: r,
                source:
                    PeerError::Closed
                    | PeerError::Timeout { .. }
                    | PeerError::NotConnected { .. }
                    | PeerError::Io(_),
            },
        ) if r == receiver => return Ok(failed(rlsync_core::error_chain(&e))),
        Err(e) => return Err(WorkerError::GpuChannel(e)),
    };
    let seconds = started.elapsed().as_secs_f64();
    tracing::info!(
        "caught up rollout-{rank} (weight receiver {receiver}): handshake{} on the host ({} bytes), then a full copy of version {} over the same-host GPU channel ({:.1} ms in all; {})",
        if on_host.boot_bytes > 0 {
            " and frozen keys"
        } else {
            ""
        },
        on_host.payload_bytes,
        full.version,
        seconds * 1e3,
        describe(&full)
    );
    Ok(Report::CaughtUp {
        rank,
        ok: true,
        kind: "full".into(),
        from: on_host.from,
        to: full.version,
        patches: 0,
        payload_bytes: on_host.payload_bytes + state_bytes,
        seconds,
        reason: "the same-host GPU channel: a full copy of the trainer's device snapshot".into(),
    })
}

/// The `Synced` statistics of one sync over the channel: a patch counts the compacted entries the rollouts
/// read (index and old/new value each; a tile that overflowed its pool is read densely from the snapshot
/// copy), a full copy the state.
pub fn stats(report: &SyncReport, state_bytes: u64) -> SyncStats {
    let changed: u64 = report.widths.iter().map(|w| w.changes).sum();
    let payload_bytes = if report.full {
        state_bytes
    } else {
        report
            .widths
            .iter()
            .map(|w| w.changes * (4 + 2 * u64::from(w.width)))
            .sum()
    };
    SyncStats {
        version: report.version,
        kind: if report.full { "full" } else { "patch" }.into(),
        payload_bytes,
        changed,
        state_bytes,
        compression_ratio: if payload_bytes == 0 {
            0.0
        } else {
            state_bytes as f64 / payload_bytes as f64
        },
        dense_segments: report.widths.iter().filter(|w| w.overflow).count() as u64,
        build_s: report.build_s,
        encode_s: 0.0,
        seconds: report.acks_s,
    }
}

/// One line for the log: where the sync's time went, per rollout (with detached acks, the previous sync's:
/// this one's are collected by the next).
pub fn describe(report: &SyncReport) -> String {
    let per = |timings: &[ReceiverTiming]| -> String {
        timings
            .iter()
            .map(|t| {
                format!(
                    "rollout {}: {:.2} ms (check {:.2}, apply {:.2})",
                    t.rank,
                    t.total_s * 1e3,
                    t.check_s * 1e3,
                    t.apply_s * 1e3
                )
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    let acks = if report.settled.is_empty() {
        per(&report.per_receiver)
    } else {
        format!("the previous sync's acks: {}", per(&report.settled))
    };
    let dropped = if report.dropped.is_empty() {
        String::new()
    } else {
        let ranks: Vec<String> = report.dropped.iter().map(u32::to_string).collect();
        format!(
            "; dropped (gone, a restarted one rejoins): rollout {}",
            ranks.join(", ")
        )
    };
    format!(
        "GPU channel: version {} ({}), build {:.2} ms, acks {:.2} ms; {acks}{dropped}",
        report.version,
        if report.full { "full copy" } else { "patch" },
        report.build_s * 1e3,
        report.acks_s * 1e3,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_line_names_each_rollouts_phases_or_the_previous_syncs_when_detached() {
        let t = ReceiverTiming {
            rank: 1,
            total_s: 0.004,
            check_s: 0.001,
            apply_s: 0.002,
            ..ReceiverTiming::default()
        };
        let blocking = SyncReport {
            version: 3,
            per_receiver: vec![t],
            ..SyncReport::default()
        };
        let line = describe(&blocking);
        assert!(
            line.contains("version 3 (patch)")
                && line.ends_with("rollout 1: 4.00 ms (check 1.00, apply 2.00)"),
            "{line}"
        );
        let detached = SyncReport {
            version: 4,
            settled: vec![t],
            ..SyncReport::default()
        };
        assert!(
            describe(&detached).contains("the previous sync's acks: rollout 1: 4.00 ms"),
            "{}",
            describe(&detached)
        );
    }

    #[test]
    fn a_patch_counts_what_the_rollouts_read_and_a_full_copy_the_state() {
        use rlsync_core::gpu::ipc::wire::WidthCount;
        let w = |width, changes, overflow| WidthCount {
            width,
            changes,
            overflow,
            checksum: 0,
        };
        let patch = SyncReport {
            version: 7,
            widths: vec![w(2, 100, false), w(4, 10, true)],
            build_s: 0.25,
            acks_s: 0.5,
            ..SyncReport::default()
        };
        let s = stats(&patch, 10_000);
        assert_eq!(s.kind, "patch");
        assert_eq!((s.version, s.changed), (7, 110));
        assert_eq!(s.payload_bytes, 100 * 8 + 10 * 12);
        assert_eq!(s.dense_segments, 1);
        assert!((s.build_s - 0.25).abs() < 1e-12 && (s.seconds - 0.5).abs() < 1e-12);
        let full = SyncReport {
            full: true,
            ..patch
        };
        let s = stats(&full, 10_000);
        assert_eq!((s.kind.as_str(), s.payload_bytes), ("full", 10_000));
        assert!((s.compression_ratio - 1.0).abs() < 1e-12);
    }
}
