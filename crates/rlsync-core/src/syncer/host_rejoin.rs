//! [`HostRejoin`]: what a sender keeps of the host channel when every version after the init bootstrap travels
//! another way (the same-host GPU channel): the rejoins' handshakes and frozen keys, no snapshot.

use super::*;

/// The host half of the rejoins of a run whose synced tensors travel another way after the init bootstrap
/// (the same-host GPU channel, whose [`crate::gpu::ipc::IpcSender::rejoin`] gives a restarted receiver its
/// full copy), made by [`SyncSender::into_host_rejoin`]. It keeps the (elastic) host channel and what the
/// init bootstrap recorded for rejoins: the receivers' metadata, the frozen (bootstrap-only) keys and their
/// checksum. The snapshot and the replay log are freed: nothing synced is sent from here again.
pub struct HostRejoin {
    pub(super) settings: Settings,
    pub(super) ch: transport::Sender,
    pub(super) rejoin: rejoin::RejoinInfo,
    pub(super) last: Stamp,
    pub(super) strategy: Strategy,
}

impl HostRejoin {
    /// Serve receiver `rank`'s rejoin ([`WeightSyncer::rejoin_receiver`] on its side): the handshake (its
    /// metadata must be the receivers' at init), its checksums, and the frozen keys of `state` when its copy
    /// of them differs. The catch-up itself is deferred (the report's `deferred`, `to` 0): the synced tensors
    /// reach it the other way. Waits (bounded by the channel's timeout) for the receiver to join; only that
    /// receiver sees these messages.
    pub async fn serve(
        &mut self,
        state: &StateDict,
        rank: usize,
    ) -> Result<CatchUpReport, SyncError> {
        rejoin::Serving {
            ch: &mut self.ch,
            rank,
            info: &self.rejoin,
            state,
            last: self.last,
            part_bytes: self.settings.part_bytes,
        }
        .serve(rejoin::FullSource::Elsewhere(self.strategy))
        .await
    }

    /// Receiver ranks attached to the host channel as of the last operation that read its events (a
    /// rejoin): the channel learns of deaths and joiners only when it reads them.
    pub fn live_receivers(&self) -> Vec<usize> {
        self.ch.live()
    }
}
