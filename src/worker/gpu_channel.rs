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
//! its acks at the next one. Restarted rollouts are not served (the config refuses `runner.rollout_restarts`
//! > 0 with the channel: it has no rejoin path).

use std::path::Path;
use std::time::Duration;

use rlsync_core::gpu::compact::Layout;
use rlsync_core::gpu::ipc::{
    IpcError, IpcReceiver, IpcSender, ReceiverDevice, ReceiverTiming, SenderDevice, SyncReport,
};
use rlsync_core::protocol::messages::SyncStats;
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

/// Trainer: the channel at `socket` for `receivers` rollouts over the device tensors of `keys` (the synced
/// keys, in the syncer's order) of `workload`, which the rollouts hold in `dtypes` (a floating tensor in
/// another dtype is cast on the device first); snapshot copy := those tensors, every rollout given a full
/// copy as `version`.
#[allow(clippy::too_many_arguments)]
pub fn open_sender(
    workload: &mut dyn Workload,
    state: &StateDict,
    keys: &[String],
    dtypes: &[DType],
    socket: &Path,
    receivers: usize,
    timeout: Duration,
    version: u64,
) -> Result<(ChannelSender, SyncReport), WorkerError> {
    let layout = layout(state, keys, dtypes)?;
    let device = workload.gpu_sender_device(state, keys, dtypes)?;
    let mut channel = IpcSender::bind(socket, device, layout, receivers, timeout)?;
    let report = channel.bootstrap(version)?;
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
        seconds: report.build_s + report.acks_s,
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
    format!(
        "GPU channel: version {} ({}), build {:.2} ms, acks {:.2} ms; {acks}",
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
        assert!((s.seconds - 0.75).abs() < 1e-12);
        let full = SyncReport {
            full: true,
            ..patch
        };
        let s = stats(&full, 10_000);
        assert_eq!((s.kind.as_str(), s.payload_bytes), ("full", 10_000));
        assert!((s.compression_ratio - 1.0).abs() < 1e-12);
    }
}
