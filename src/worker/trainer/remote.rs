//! The trainer's other hosts in a run over the same-host GPU channel: their rollouts' syncer on the TCP chain.
//!
//! The channel serves only the rollouts of the trainer's host (CUDA IPC does not cross hosts). With rollouts
//! on other hosts too, the trainer runs a second host syncer whose channel is the TCP weight chain without a
//! local fan-out: it bootstraps those rollouts beside this host's init and sends each later version as coded
//! patches, built from the device against a pinned host snapshot (the GPU keeps one snapshot copy, the
//! channel's). The chain numbers its receivers from 0; the run numbers them after this host's. Its reports
//! are what the run's `Synced` statistics carry: the bytes that crossed hosts.

use rlsync_core::protocol::messages::SyncStats;
use rlsync_core::syncer::{SyncReport, SyncSender};

use crate::worker::WorkerError;

/// The other hosts' rollouts.
pub struct Remote {
    /// The host syncer over the TCP chain.
    pub syncer: SyncSender,
    /// The run's weight receivers before the chain's first: this host's rollouts (the channel's).
    pub first: u32,
}

impl Remote {
    /// `far`, initialised over the chain beside `local` (the end of this host's `local_receivers` rollouts,
    /// whose choice of tensors the channel carries): both must have chosen the same keys in the same dtypes.
    pub fn new(
        local: &SyncSender,
        far: SyncSender,
        local_receivers: usize,
    ) -> Result<Remote, WorkerError> {
        let differs = |what: String| WorkerError::HostsDiffer { what };
        if local.synced_keys() != far.synced_keys() {
            return Err(differs(format!(
                "{} synced keys on the trainer's host, {} on the others",
                local.synced_keys().len(),
                far.synced_keys().len()
            )));
        }
        if let Some(((key, here), there)) = local
            .synced_keys()
            .iter()
            .zip(local.synced_dtypes())
            .zip(far.synced_dtypes())
            .find(|((_, a), b)| a != b)
        {
            return Err(differs(format!(
                "{key} is {here:?} on the trainer's host, {there:?} on the others"
            )));
        }
        let first = u32::try_from(local_receivers)
            .map_err(|_| differs(format!("{local_receivers} rollouts on the trainer's host")))?;
        Ok(Remote { syncer: far, first })
    }
}

/// The `Synced` statistics of a version sent both ways: the chain's (what crossed hosts: its kind, coded
/// bytes and ratio, the changes it counted), its times after the channel's (the trainer did both in turn).
pub fn stats(channel: &SyncStats, chain: &SyncStats) -> SyncStats {
    SyncStats {
        build_s: channel.build_s + chain.build_s,
        encode_s: channel.encode_s + chain.encode_s,
        seconds: channel.seconds + chain.seconds,
        ..chain.clone()
    }
}

/// The init's report when the other hosts are bootstrapped over the chain beside this host's: the chain's
/// (what crossed hosts, as [`stats`] reports a version), each phase as long as the longer of the two, which
/// ran at once.
pub fn init_report(local: &SyncReport, chain: SyncReport) -> SyncReport {
    SyncReport {
        build: local.build.max(chain.build),
        encode: local.encode.max(chain.encode),
        transfer: local.transfer.max(chain.transfer),
        ..chain
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_init_reports_the_chains_bootstrap_and_the_longer_wait() {
        let local = SyncReport {
            payload_bytes: 4_000,
            build: Duration::from_millis(40),
            encode: Duration::from_millis(10),
            transfer: Duration::from_millis(300),
            ..SyncReport::default()
        };
        let chain = SyncReport {
            payload_bytes: 4_100,
            messages: 3,
            build: Duration::from_millis(30),
            encode: Duration::from_millis(20),
            transfer: Duration::from_millis(200),
            ..SyncReport::default()
        };
        let both = init_report(&local, chain.clone());
        assert_eq!((both.payload_bytes, both.messages), (4_100, 3));
        assert_eq!(both.transfer, Duration::from_millis(300));
        assert_eq!(
            (both.build, both.encode),
            (Duration::from_millis(40), Duration::from_millis(20))
        );
        let slower = SyncReport {
            transfer: Duration::from_millis(900),
            ..chain
        };
        assert_eq!(
            init_report(&local, slower).transfer,
            Duration::from_millis(900)
        );
    }

    #[test]
    fn a_version_sent_both_ways_counts_the_chains_bytes_and_both_times() {
        let channel = SyncStats {
            version: 4,
            kind: "patch".into(),
            payload_bytes: 800,
            changed: 100,
            state_bytes: 10_000,
            compression_ratio: 12.5,
            dense_segments: 0,
            build_s: 0.125,
            encode_s: 0.0,
            seconds: 0.25,
        };
        let chain = SyncStats {
            payload_bytes: 300,
            compression_ratio: 10_000.0 / 300.0,
            build_s: 0.25,
            encode_s: 0.0625,
            seconds: 0.5,
            ..channel.clone()
        };
        let both = stats(&channel, &chain);
        assert_eq!((both.version, both.payload_bytes), (4, 300));
        assert!((both.seconds - 0.75).abs() < 1e-12);
        assert!((both.build_s - 0.375).abs() < 1e-12 && (both.encode_s - 0.0625).abs() < 1e-12);
        assert!((both.compression_ratio - chain.compression_ratio).abs() < 1e-12);
    }
}
