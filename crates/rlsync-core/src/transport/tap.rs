//! Tests only: an in-process sender that records every payload it sends to all receivers, so that tests can
//! corrupt, truncate or replay what a syncer published.

use std::sync::{Arc, Mutex};

use super::{InProcSender, SendBackend, Sender, Target, TransportError};

/// The payloads a tapped sender sent to all receivers, in order (shared with the test that reads them).
#[derive(Debug, Clone, Default)]
pub(crate) struct Tap(Arc<Mutex<Vec<Vec<u8>>>>);

impl Tap {
    /// A copy of every payload recorded so far.
    pub(crate) fn payloads(&self) -> Vec<Vec<u8>> {
        self.0.lock().map(|p| p.clone()).unwrap_or_default()
    }
}

#[derive(Debug)]
pub struct TapSender {
    inner: InProcSender,
    tap: Tap,
}

/// `ch` (an in-process sender) with every payload for all receivers recorded in the returned [`Tap`];
/// payloads for one rank (a rejoining receiver's catch-up) are not recorded.
pub(crate) fn tapped(ch: Sender) -> (Sender, Tap) {
    let Sender::InProc(inner) = ch else {
        panic!("only an in-process sender can be tapped");
    };
    let tap = Tap::default();
    (
        Sender::Tap(TapSender {
            inner,
            tap: tap.clone(),
        }),
        tap,
    )
}

impl SendBackend for TapSender {
    fn receivers(&self) -> usize {
        self.inner.receivers()
    }

    async fn send_with<R>(
        &mut self,
        target: Target,
        len: usize,
        fill: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, TransportError> {
        let tap = self.tap.clone();
        let record = target == Target::All;
        self.inner
            .send_with(target, len, move |buf: &mut [u8]| {
                let r = fill(buf);
                if record && let Ok(mut payloads) = tap.0.lock() {
                    payloads.push(buf.to_vec());
                }
                r
            })
            .await
    }

    async fn wait_joined(&mut self, rank: usize) -> Result<(), TransportError> {
        self.inner.wait_joined(rank).await
    }

    fn live(&self) -> Vec<usize> {
        self.inner.live()
    }

    async fn flush(&mut self) -> Result<(), TransportError> {
        self.inner.flush().await
    }

    async fn recv_from(&mut self, rank: usize) -> Result<Vec<u8>, TransportError> {
        self.inner.recv_from(rank).await
    }

    fn try_recv_from(
        &mut self,
        rank: usize,
        accept: &dyn Fn(&[u8]) -> bool,
    ) -> Result<Option<Vec<u8>>, TransportError> {
        self.inner.try_recv_from(rank, accept)
    }

    async fn wait_any_from(&mut self, ranks: &[usize]) -> Result<(), TransportError> {
        self.inner.wait_any_from(ranks).await
    }

    fn joined_ranks(&mut self) -> Result<Vec<usize>, TransportError> {
        self.inner.joined_ranks()
    }

    fn set_bound(&mut self, bound: Option<std::time::Duration>) {
        self.inner.set_bound(bound);
    }

    async fn ready(&mut self) -> Result<(), TransportError> {
        self.inner.ready().await
    }
}
