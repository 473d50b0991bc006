//! Bridge backend: a channel end whose bytes are carried by its caller (e.g. Python's async `send`/`recv`).
//!
//! [`bridge_sender`] / [`bridge_receiver`] give a [`Sender`] / [`Receiver`] for the syncer plus a [`BridgeIo`]
//! handle. A syncer operation on a bridge end is a future that waits only on the bridge; its driver wraps it
//! in a [`Pump`] and calls [`Pump::step`] until it is done: a step runs the operation until it needs the
//! outside world and says what for — [`Step::Send`] a payload (call the caller's `send`, then
//! [`BridgeIo::sent`]), or [`Step::Recv`] one (call the caller's `recv`, then [`BridgeIo::deliver`]). If the
//! caller's transport fails, [`BridgeIo::fail`] turns the pending wait into a [`TransportError`] so the
//! operation ends cleanly (a syncer keeps its weights and version).
//!
//! The far end is one peer (`receivers() == 1`): fan-out is the caller's transport's business. There are no
//! timeouts here; the caller's `send`/`recv` bound their own waits. Inbound payloads are read in place when
//! they are 8-byte aligned (all the syncer's typed views need), else copied once into an aligned buffer.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use std::time::Duration;

use super::{Peer, Receiver, RecvBackend, SendBackend, Sender, Target, TransportError};
use crate::tensor::Storage;

/// Bytes handed in by the caller (a `Vec<u8>`, or e.g. a Python `bytes` kept alive by the binding).
pub trait Payload: Send {
    fn bytes(&self) -> &[u8];
}

impl Payload for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }
}

#[derive(Default)]
struct IoState {
    /// Payloads the operation sent that the caller has not taken yet (at most one: a send waits for `sent`).
    outbox: VecDeque<Vec<u8>>,
    /// Sends started / confirmed by the caller.
    started: u64,
    confirmed: u64,
    /// The operation waits for an inbound payload.
    wants: bool,
    inbox: Option<Box<dyn Payload>>,
    /// The caller's transport failed: every pending and later wait fails with this.
    failed: Option<Failure>,
}

/// Why the caller ended the bridge's waits.
#[derive(Clone)]
enum Failure {
    /// Its `send`/`recv` raised (the reason says how).
    Failed(String),
    /// It stopped awaiting its `send`/`recv` after `timeout` (waiting on `peer`).
    TimedOut { peer: Peer, timeout: Duration },
}

impl Failure {
    fn error(&self, op: &'static str) -> TransportError {
        match self {
            Failure::Failed(reason) => TransportError::Io {
                op,
                source: std::io::Error::other(reason.clone()),
            },
            Failure::TimedOut { peer, timeout } => TransportError::Timeout {
                op,
                peer: peer.clone(),
                timeout: *timeout,
            },
        }
    }
}

/// The caller's handle on a bridge end (cheap to clone; shared with the end).
#[derive(Clone, Default)]
pub struct BridgeIo(Arc<Mutex<IoState>>);

impl BridgeIo {
    fn lock(&self) -> MutexGuard<'_, IoState> {
        // The state is plain data; a panic elsewhere cannot leave it half-updated in a harmful way.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Confirm that the caller's `send` of the last [`Step::Send`] payload completed.
    pub fn sent(&self) {
        let mut s = self.lock();
        s.confirmed = s.started;
    }

    /// Hand in the payload the caller's `recv` returned.
    pub fn deliver(&self, payload: Box<dyn Payload>) {
        self.lock().inbox = Some(payload);
    }

    /// Forget an earlier operation's failure and leftovers before the next operation starts on this end.
    pub fn reset(&self) {
        let mut s = self.lock();
        s.outbox.clear();
        s.confirmed = s.started;
        s.wants = false;
        s.inbox = None;
        s.failed = None;
    }

    /// The caller's transport failed (its `send`/`recv` raised): pending and later waits fail with `reason`.
    pub fn fail(&self, reason: impl Into<String>) {
        self.lock().failed = Some(Failure::Failed(reason.into()));
    }

    /// The caller gave up awaiting its `send`/`recv` after `timeout`: pending and later waits fail with
    /// [`TransportError::Timeout`] naming `peer` (the far end: `Peer::Sender` on a receiving end).
    pub fn time_out(&self, peer: Peer, timeout: Duration) {
        self.lock().failed = Some(Failure::TimedOut { peer, timeout });
    }

    /// Queue `msg` and wait until the caller confirms it was sent.
    async fn send(&self, msg: Vec<u8>, op: &'static str) -> Result<(), TransportError> {
        let seq = {
            let mut s = self.lock();
            if let Some(r) = &s.failed {
                return Err(r.error(op));
            }
            s.outbox.push_back(msg);
            s.started += 1;
            s.started
        };
        std::future::poll_fn(|_| {
            let s = self.lock();
            match &s.failed {
                Some(r) => Poll::Ready(Err(r.error(op))),
                None if s.confirmed >= seq => Poll::Ready(Ok(())),
                None => Poll::Pending,
            }
        })
        .await
    }

    /// Wait for the caller to deliver a payload.
    async fn recv(&self, op: &'static str) -> Result<Box<dyn Payload>, TransportError> {
        self.lock().wants = true;
        std::future::poll_fn(|_| {
            let mut s = self.lock();
            if let Some(r) = &s.failed {
                return Poll::Ready(Err(r.error(op)));
            }
            match s.inbox.take() {
                Some(p) => {
                    s.wants = false;
                    Poll::Ready(Ok(p))
                }
                None => Poll::Pending,
            }
        })
        .await
    }
}

/// What a pumped operation needs next.
pub enum Step<T> {
    /// Call the caller's `send` with this payload, then [`BridgeIo::sent`].
    Send(Vec<u8>),
    /// Call the caller's `recv`, then [`BridgeIo::deliver`] its result.
    Recv,
    /// The operation finished.
    Done(T),
}

/// A future that waits only on bridge ends, driven step by step by its caller (no async runtime needed).
pub struct Pump<T> {
    fut: Option<Pin<Box<dyn Future<Output = T> + Send>>>,
    io: BridgeIo,
}

impl<T> Pump<T> {
    pub fn new(fut: impl Future<Output = T> + Send + 'static, io: BridgeIo) -> Pump<T> {
        Pump {
            fut: Some(Box::pin(fut)),
            io,
        }
    }

    /// Run the operation until it finishes or needs the caller. CPU work runs on the calling thread.
    ///
    /// An operation that waits on something other than its bridge ends (it never should) gets the bridge
    /// failed, so it ends with a transport error instead of hanging; stepping after `Done` is an error too.
    pub fn step(&mut self) -> Result<Step<T>, TransportError> {
        let Some(fut) = self.fut.as_mut() else {
            return Err(TransportError::Config {
                reason: "the operation already finished".into(),
            });
        };
        let mut cx = Context::from_waker(Waker::noop());
        for _ in 0..2 {
            if let Poll::Ready(out) = fut.as_mut().poll(&mut cx) {
                self.fut = None;
                return Ok(Step::Done(out));
            }
            let mut s = self.io.lock();
            if let Some(msg) = s.outbox.pop_front() {
                return Ok(Step::Send(msg));
            }
            if s.wants && s.inbox.is_none() && s.failed.is_none() {
                return Ok(Step::Recv);
            }
            // Neither: it waits on something the bridge does not control. Fail it and poll once more.
            s.failed.get_or_insert_with(|| {
                Failure::Failed("the operation waited on something other than its bridge".into())
            });
        }
        Err(TransportError::Config {
            reason: "the operation did not finish after its bridge failed".into(),
        })
    }
}

/// The sending end over a bridge: payloads go out through the caller's `send`, the one peer's upstream
/// messages (metadata) come in through its `recv`.
pub struct BridgeSender {
    io: BridgeIo,
}

/// The receiving end over a bridge: payloads come in through the caller's `recv`, upstream messages go out
/// through its `send`.
pub struct BridgeReceiver {
    io: BridgeIo,
}

impl std::fmt::Debug for BridgeSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BridgeSender")
    }
}

impl std::fmt::Debug for BridgeReceiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BridgeReceiver")
    }
}

/// A sending end carried by its caller, and the handle that carries it.
pub fn bridge_sender() -> (Sender, BridgeIo) {
    let io = BridgeIo::default();
    (Sender::Bridge(BridgeSender { io: io.clone() }), io)
}

/// A receiving end (rank 0) carried by its caller, and the handle that carries it.
pub fn bridge_receiver() -> (Receiver, BridgeIo) {
    let io = BridgeIo::default();
    (Receiver::Bridge(BridgeReceiver { io: io.clone() }), io)
}

impl SendBackend for BridgeSender {
    fn receivers(&self) -> usize {
        1
    }

    async fn wait_joined(&mut self, _rank: usize) -> Result<(), TransportError> {
        Err(super::not_elastic("a bridge"))
    }

    fn live(&self) -> Vec<usize> {
        vec![0]
    }

    async fn send_with<R>(
        &mut self,
        _target: Target,
        len: usize,
        fill: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, TransportError> {
        // One receiver: a payload for rank 0 and one for all are the same.
        let mut buf = Vec::new();
        buf.try_reserve_exact(len)
            .map_err(|_| TransportError::TooLarge {
                what: "payload",
                len,
                max: isize::MAX as usize,
            })?;
        buf.resize(len, 0);
        let out = fill(&mut buf);
        self.io.send(buf, "sending a payload").await?;
        Ok(out)
    }

    async fn flush(&mut self) -> Result<(), TransportError> {
        // Every send already waited for the caller's `send` to complete.
        Ok(())
    }

    async fn recv_from(&mut self, rank: usize) -> Result<Vec<u8>, TransportError> {
        if rank != 0 {
            return Err(TransportError::NoSuchRank { rank, receivers: 1 });
        }
        let p = self.io.recv("receiving an upstream message").await?;
        Ok(p.bytes().to_vec())
    }
}

impl RecvBackend for BridgeReceiver {
    fn rank(&self) -> usize {
        0
    }

    async fn recv_with<R>(&mut self, read: impl FnOnce(&[u8]) -> R) -> Result<R, TransportError> {
        let p = self.io.recv("receiving a payload").await?;
        let bytes = p.bytes();
        if (bytes.as_ptr() as usize).is_multiple_of(8) {
            return Ok(read(bytes));
        }
        let aligned = Storage::from_bytes(bytes);
        drop(p);
        Ok(read(aligned.bytes()))
    }

    async fn send(&mut self, msg: &[u8]) -> Result<(), TransportError> {
        self.io
            .send(msg.to_vec(), "sending an upstream message")
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Drive a sender and a receiver operation against each other through an in-memory queue per direction.
    fn run_pair<A: Send + 'static, B: Send + 'static>(
        mut a: Pump<A>,
        a_io: BridgeIo,
        mut b: Pump<B>,
        b_io: BridgeIo,
    ) -> (A, B) {
        let mut a_to_b: VecDeque<Vec<u8>> = VecDeque::new();
        let mut b_to_a: VecDeque<Vec<u8>> = VecDeque::new();
        let (mut ra, mut rb) = (None, None);
        let (mut a_wait, mut b_wait) = (false, false);
        for _ in 0..10_000 {
            if ra.is_none() && (!a_wait || !b_to_a.is_empty()) {
                if a_wait {
                    a_io.deliver(Box::new(b_to_a.pop_front().unwrap()));
                    a_wait = false;
                }
                match a.step().unwrap() {
                    Step::Send(m) => {
                        a_to_b.push_back(m);
                        a_io.sent();
                    }
                    Step::Recv => a_wait = true,
                    Step::Done(v) => ra = Some(v),
                }
            }
            if rb.is_none() && (!b_wait || !a_to_b.is_empty()) {
                if b_wait {
                    b_io.deliver(Box::new(a_to_b.pop_front().unwrap()));
                    b_wait = false;
                }
                match b.step().unwrap() {
                    Step::Send(m) => {
                        b_to_a.push_back(m);
                        b_io.sent();
                    }
                    Step::Recv => b_wait = true,
                    Step::Done(v) => rb = Some(v),
                }
            }
            if let (Some(_), Some(_)) = (&ra, &rb) {
                break;
            }
        }
        (ra.expect("sender finished"), rb.expect("receiver finished"))
    }

    #[test]
    fn messages_cross_in_order_and_misaligned_payloads_are_copied() {
        let (mut tx, tio) = bridge_sender();
        let (mut rx, rio) = bridge_receiver();
        let a = Pump::new(
            async move {
                let hello = tx.recv_from(0).await?;
                tx.send(b"one").await?;
                tx.send(&hello).await?;
                tx.flush().await?;
                Ok::<_, TransportError>(tx.receivers())
            },
            tio.clone(),
        );
        let b = Pump::new(
            async move {
                rx.send(b"hello").await?;
                let one = rx.recv_with(<[u8]>::to_vec).await?;
                let two = rx.recv_with(<[u8]>::to_vec).await?;
                Ok::<_, TransportError>((one, two))
            },
            rio.clone(),
        );
        let (ra, rb) = run_pair(a, tio, b, rio);
        assert_eq!(ra.unwrap(), 1);
        assert_eq!(rb.unwrap(), (b"one".to_vec(), b"hello".to_vec()));

        // A payload at an odd address is still read correctly (through an aligned copy).
        struct Odd(Vec<u8>);
        impl Payload for Odd {
            fn bytes(&self) -> &[u8] {
                &self.0[1..]
            }
        }
        let (mut rx, rio) = bridge_receiver();
        let mut p = Pump::new(
            async move {
                rx.recv_with(|b| (b.as_ptr() as usize % 8, b.to_vec()))
                    .await
            },
            rio.clone(),
        );
        assert!(matches!(p.step().unwrap(), Step::Recv));
        rio.deliver(Box::new(Odd(vec![0, 1, 2, 3])));
        match p.step().unwrap() {
            Step::Done(r) => assert_eq!(r.unwrap(), (0, vec![1, 2, 3])),
            _ => panic!("expected done"),
        }
    }

    #[test]
    fn a_failed_transport_ends_the_operation_with_its_reason() {
        let (mut rx, rio) = bridge_receiver();
        let mut p = Pump::new(
            async move { (rx.recv_with(<[u8]>::len).await, rx) },
            rio.clone(),
        );
        assert!(matches!(p.step().unwrap(), Step::Recv));
        rio.fail("ConnectionResetError: peer went away");
        let mut rx = match p.step().unwrap() {
            Step::Done((Err(e), rx)) => {
                let text = crate::error_chain(&e);
                assert!(text.contains("peer went away"), "{text}");
                rx
            }
            _ => panic!("expected a failed operation"),
        };
        assert!(
            p.step().is_err(),
            "stepping a finished operation is an error"
        );
        // The end stays usable: the next operation on it starts afresh after a reset.
        rio.reset();
        let mut p = Pump::new(async move { rx.recv_with(<[u8]>::len).await }, rio.clone());
        assert!(matches!(p.step().unwrap(), Step::Recv));
        rio.deliver(Box::new(vec![1u8, 2]));
        assert!(matches!(p.step().unwrap(), Step::Done(Ok(2))));

        // An operation waiting on something else is failed rather than left hanging.
        let (_tx, io) = bridge_sender();
        let (otx, orx) = tokio::sync::oneshot::channel::<()>();
        let mut p = Pump::new(
            async move {
                let _ = orx.await;
            },
            io,
        );
        assert!(p.step().is_err());
        drop(otx);
    }
}
