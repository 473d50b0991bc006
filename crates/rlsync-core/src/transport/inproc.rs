//! In-process backend: payload buffers shared by reference between tasks, recycled once every receiver released them.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

use super::fanout::{Event, EventTx, Fanout, Origin};
use super::{
    DEFAULT_SLOTS, DEFAULT_TIMEOUT, PAYLOAD_PAGE_OFFSET, Peer, Receiver, RecvBackend, SendBackend,
    Sender, Target, TransportError,
};

/// One cache line: the unit of [`AlignedBuf`], so payloads start 64-byte aligned like shm slots do.
#[derive(Clone, Copy, bytemuck::Zeroable, bytemuck::Pod)]
#[repr(C, align(64))]
struct Line([u8; 64]);

const PAGE: usize = 4096;

/// A byte buffer whose payload starts at page offset [`PAYLOAD_PAGE_OFFSET`] (hence 64-byte aligned, which
/// typed views over payloads rely on).
pub(crate) struct AlignedBuf {
    lines: Vec<Line>,
    /// Byte offset of the payload in `lines` (a multiple of 64).
    start: usize,
}

impl AlignedBuf {
    /// A zeroed buffer of at least `len` payload bytes; an impossible size is an error, not an abort.
    pub(crate) fn with_len(len: usize) -> Result<Self, TransportError> {
        let too_large = || TransportError::TooLarge {
            what: "payload",
            len,
            max: isize::MAX as usize,
        };
        let count = len
            .div_ceil(64)
            .checked_add(PAGE / 64)
            .ok_or_else(too_large)?;
        let mut lines = Vec::new();
        lines.try_reserve_exact(count).map_err(|_| too_large())?;
        lines.resize(count, Line([0; 64]));
        let addr = lines.as_ptr() as usize;
        let start = (PAYLOAD_PAGE_OFFSET + PAGE - addr % PAGE) % PAGE;
        Ok(AlignedBuf { lines, start })
    }

    pub(crate) fn capacity(&self) -> usize {
        (self.lines.len() * 64).saturating_sub(self.start)
    }

    pub(crate) fn bytes(&self, len: usize) -> &[u8] {
        let all: &[u8] = bytemuck::cast_slice(&self.lines);
        let end = self.start + len.min(self.capacity());
        all.get(self.start..end).unwrap_or_default()
    }

    pub(crate) fn bytes_mut(&mut self, len: usize) -> &mut [u8] {
        let end = self.start + len.min(self.capacity());
        let all: &mut [u8] = bytemuck::cast_slice_mut(&mut self.lines);
        all.get_mut(self.start..end).unwrap_or_default()
    }
}

struct Published {
    seq: u64,
    len: usize,
    buf: Arc<AlignedBuf>,
}

type Inbox = mpsc::UnboundedSender<Published>;
/// Inboxes of receivers that joined late, by rank, until the sender attaches them.
type Mailbox = super::fanout::Mailbox<Inbox>;

/// The sending end of an in-process channel.
pub struct InProcSender {
    fanout: Fanout,
    /// `None`: detached (elastic channels).
    outs: Vec<Option<Inbox>>,
    /// The buffer last published in each slot; reused in place once every receiver dropped its reference.
    bufs: Vec<Option<Arc<AlignedBuf>>>,
    mailbox: Option<Mailbox>,
    /// Ranks attached since the caller last waited for them.
    fresh: Vec<usize>,
}

/// Makes new receivers for an elastic in-process channel (the in-process stand-in for a restarted worker).
#[derive(Clone)]
pub struct InProcJoiner {
    mailbox: Mailbox,
    events: EventTx,
    timeout: Duration,
    receivers: usize,
}

impl std::fmt::Debug for InProcJoiner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InProcJoiner")
            .field("receivers", &self.receivers)
            .finish()
    }
}

impl InProcJoiner {
    /// A new receiver for `rank`; the sender admits it once the rank's previous receiver is gone.
    pub fn join(&self, rank: usize) -> Result<Receiver, TransportError> {
        if rank >= self.receivers {
            return Err(TransportError::NoSuchRank {
                rank,
                receivers: self.receivers,
            });
        }
        let (tx, inbox) = mpsc::unbounded_channel();
        let join = self
            .mailbox
            .put(rank, tx)
            .ok_or(TransportError::NoSuchRank {
                rank,
                receivers: self.receivers,
            })?;
        let origin = Origin { rank, join };
        self.events
            .send((origin, Event::Joined))
            .map_err(|_| TransportError::PeerGone {
                op: "joining the sender",
                peer: Peer::Sender,
            })?;
        Ok(Receiver::InProc(InProcReceiver {
            origin,
            timeout: self.timeout,
            bound: None,
            inbox,
            events: self.events.clone(),
        }))
    }
}

/// An elastic in-process channel: receivers may be dropped and replaced through the joiner.
pub fn inproc_channel_elastic(
    receivers: usize,
    timeout: Duration,
) -> (Sender, Vec<Receiver>, InProcJoiner) {
    let (event_tx, event_rx) = mpsc::unbounded_channel();
    let (mut sender, rxs) = build(receivers, timeout, event_tx.clone(), event_rx, true);
    let mailbox = Mailbox::new(receivers);
    sender.mailbox = Some(mailbox.clone());
    let joiner = InProcJoiner {
        mailbox,
        events: event_tx,
        timeout,
        receivers,
    };
    (Sender::InProc(sender), rxs, joiner)
}

const OP_REPORTS: &str = "waiting for receivers' reports";

/// A receiving end of an in-process channel.
pub struct InProcReceiver {
    /// Its rank, and its join number (0 unless it joined late).
    origin: Origin,
    timeout: Duration,
    /// The caller's bound on the waits that follow (`set_bound`).
    bound: Option<(tokio::time::Instant, Duration)>,
    inbox: mpsc::UnboundedReceiver<Published>,
    events: EventTx,
}

impl std::fmt::Debug for InProcSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InProcSender")
            .field("receivers", &self.outs.len())
            .field("slots", &self.bufs.len())
            .finish()
    }
}

impl std::fmt::Debug for InProcReceiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InProcReceiver")
            .field("rank", &self.origin.rank)
            .finish()
    }
}

/// A channel from one sender to `receivers` receivers in this process (ranks `0..receivers`, in order), with
/// [`DEFAULT_TIMEOUT`] on every wait.
pub fn inproc_channel(receivers: usize) -> (Sender, Vec<Receiver>) {
    inproc_channel_with_timeout(receivers, DEFAULT_TIMEOUT)
}

/// As [`inproc_channel`], with `timeout` bounding every wait.
pub fn inproc_channel_with_timeout(receivers: usize, timeout: Duration) -> (Sender, Vec<Receiver>) {
    let (event_tx, event_rx) = mpsc::unbounded_channel();
    let (sender, rxs) = build(receivers, timeout, event_tx, event_rx, false);
    (Sender::InProc(sender), rxs)
}

fn build(
    receivers: usize,
    timeout: Duration,
    event_tx: EventTx,
    event_rx: super::fanout::EventRx,
    elastic: bool,
) -> (InProcSender, Vec<Receiver>) {
    let mut outs = Vec::with_capacity(receivers);
    let mut rxs = Vec::with_capacity(receivers);
    for rank in 0..receivers {
        let (tx, inbox) = mpsc::unbounded_channel();
        outs.push(Some(tx));
        rxs.push(Receiver::InProc(InProcReceiver {
            origin: Origin::first(rank),
            timeout,
            bound: None,
            inbox,
            events: event_tx.clone(),
        }));
    }
    let fanout = Fanout::new(receivers, DEFAULT_SLOTS, timeout, event_rx);
    let sender = InProcSender {
        fanout: if elastic { fanout.elastic() } else { fanout },
        outs,
        bufs: (0..DEFAULT_SLOTS).map(|_| None).collect(),
        mailbox: None,
        fresh: Vec::new(),
    };
    (sender, rxs)
}

impl InProcSender {
    /// Take events and attach the inboxes of admitted joiners.
    fn housekeep(&mut self) -> Result<(), TransportError> {
        let polled = self.fanout.poll_events();
        for rank in self.fanout.take_admitted() {
            let Some((join, inbox)) = self.mailbox.as_ref().and_then(|m| m.take(rank)) else {
                // Admitted without an inbox (the fanout's join numbers rule it out): not live.
                self.fanout.detach(rank);
                continue;
            };
            self.fanout.attached(rank, join);
            if let Some(out) = self.outs.get_mut(rank) {
                *out = Some(inbox);
                self.fresh.retain(|&r| r != rank);
                self.fresh.push(rank);
            }
        }
        for (rank, out) in self.outs.iter_mut().enumerate() {
            if self.fanout.is_elastic() && self.fanout.is_gone(rank) {
                *out = None;
            }
        }
        polled
    }

    /// The slot's buffer, reused when it is no longer shared and big enough, else a fresh one.
    fn take_buf(&mut self, slot: usize, len: usize) -> Result<AlignedBuf, TransportError> {
        let old = self
            .bufs
            .get_mut(slot)
            .and_then(Option::take)
            .and_then(|arc| Arc::try_unwrap(arc).ok());
        match old {
            Some(buf) if buf.capacity() >= len => Ok(buf),
            _ => AlignedBuf::with_len(len),
        }
    }
}

impl SendBackend for InProcSender {
    fn receivers(&self) -> usize {
        self.fanout.receivers()
    }

    async fn send_with<R>(
        &mut self,
        target: Target,
        len: usize,
        fill: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, TransportError> {
        const OP: &str = "sending a payload";
        self.housekeep()?;
        self.fanout.require_all_alive(OP)?;
        let targets = self.fanout.targets(target, &[], OP)?;
        let (seq, slot) = self.fanout.next();
        self.fanout.wait_slot_free(slot, OP).await?;
        let mut buf = self.take_buf(slot, len)?;
        let out = fill(buf.bytes_mut(len));
        let buf = Arc::new(buf);
        let mut reached = Vec::with_capacity(targets.len());
        for rank in targets {
            let sent = self
                .outs
                .get(rank)
                .and_then(Option::as_ref)
                .is_some_and(|tx| {
                    tx.send(Published {
                        seq,
                        len,
                        buf: Arc::clone(&buf),
                    })
                    .is_ok()
                });
            if sent {
                reached.push(rank);
            } else if self.fanout.is_elastic() {
                self.fanout.detach(rank);
            } else {
                return Err(TransportError::PeerGone {
                    op: OP,
                    peer: Peer::Receiver(rank),
                });
            }
        }
        if let Some(entry) = self.bufs.get_mut(slot) {
            *entry = Some(buf);
        }
        self.fanout.published_to(seq, slot, &reached);
        if let Target::Rank(rank) = target
            && reached.is_empty()
        {
            return Err(TransportError::PeerGone {
                op: OP,
                peer: Peer::Receiver(rank),
            });
        }
        Ok(out)
    }

    async fn wait_joined(&mut self, rank: usize) -> Result<(), TransportError> {
        const OP: &str = "waiting for a receiver to rejoin";
        if self.mailbox.is_none() {
            return Err(TransportError::Config {
                reason: "this channel admits no new receivers (it is not elastic)".to_owned(),
            });
        }
        if rank >= self.fanout.receivers() {
            return Err(TransportError::NoSuchRank {
                rank,
                receivers: self.fanout.receivers(),
            });
        }
        let deadline = self.fanout.deadline();
        loop {
            self.housekeep()?;
            if let Some(i) = self.fresh.iter().position(|&r| r == rank) {
                self.fresh.remove(i);
                return Ok(());
            }
            self.fanout.wait_event(deadline, OP, vec![rank]).await?;
        }
    }

    fn live(&self) -> Vec<usize> {
        self.fanout.live()
    }

    fn is_elastic(&self) -> bool {
        self.fanout.is_elastic()
    }

    async fn flush(&mut self) -> Result<(), TransportError> {
        self.housekeep()?;
        self.fanout.wait_all_free("flushing").await
    }

    async fn recv_from(&mut self, rank: usize) -> Result<Vec<u8>, TransportError> {
        self.housekeep()?;
        self.fanout
            .wait_message(rank, "receiving an upstream message")
            .await
    }

    fn joined_ranks(&mut self) -> Result<Vec<usize>, TransportError> {
        self.housekeep()?;
        Ok(self.fresh.clone())
    }

    fn try_recv_from(
        &mut self,
        rank: usize,
        accept: &dyn Fn(&[u8]) -> bool,
    ) -> Result<Option<Vec<u8>>, TransportError> {
        self.housekeep()?;
        self.fanout.try_message(rank, accept)
    }

    async fn wait_any_from(&mut self, ranks: &[usize]) -> Result<(), TransportError> {
        self.housekeep()?;
        self.fanout.wait_any_message(ranks, OP_REPORTS).await
    }

    fn set_bound(&mut self, bound: Option<Duration>) {
        self.fanout.set_bound(bound);
    }

    async fn ready(&mut self) -> Result<(), TransportError> {
        self.housekeep()?;
        let (_, slot) = self.fanout.next();
        self.fanout.wait_slot_free(slot, "sending a payload").await
    }
}

impl RecvBackend for InProcReceiver {
    fn rank(&self) -> usize {
        self.origin.rank
    }

    async fn recv_with<R>(&mut self, read: impl FnOnce(&[u8]) -> R) -> Result<R, TransportError> {
        const OP: &str = "receiving a payload";
        let (deadline, timeout) = super::wait_deadline(self.timeout, self.bound);
        let published = match tokio::time::timeout_at(deadline, self.inbox.recv()).await {
            Err(_) => {
                return Err(TransportError::Timeout {
                    op: OP,
                    peer: Peer::Sender,
                    timeout,
                });
            }
            Ok(None) => {
                return Err(TransportError::PeerGone {
                    op: OP,
                    peer: Peer::Sender,
                });
            }
            Ok(Some(published)) => published,
        };
        let out = read(published.buf.bytes(published.len));
        let seq = published.seq;
        // Drop our reference before releasing, so the sender can reuse the buffer in place.
        drop(published);
        // The read succeeded; a sender that vanished since will be reported by the next call.
        let _ = self.events.send((self.origin, Event::Released { seq }));
        Ok(out)
    }

    fn set_bound(&mut self, bound: Option<Duration>) {
        self.bound = bound.map(|d| (tokio::time::Instant::now() + d, d));
    }

    async fn send(&mut self, msg: &[u8]) -> Result<(), TransportError> {
        self.events
            .send((self.origin, Event::Message(msg.to_vec())))
            .map_err(|_| TransportError::PeerGone {
                op: "sending an upstream message",
                peer: Peer::Sender,
            })
    }
}

impl Drop for InProcReceiver {
    fn drop(&mut self) {
        let _ = self.events.send((self.origin, Event::Gone));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_buf_is_aligned_and_sized() {
        for len in [0, 1, 63, 64, 65, 1000] {
            let mut buf = AlignedBuf::with_len(len).unwrap();
            assert!(buf.capacity() >= len);
            assert_eq!(buf.bytes_mut(len).len(), len);
            assert_eq!(buf.bytes(len).as_ptr() as usize % 4096, PAYLOAD_PAGE_OFFSET);
        }
    }

    #[tokio::test]
    async fn impossible_payload_size_is_an_error() {
        let (mut tx, _rxs) = inproc_channel(1);
        let err = tx.send_with(usize::MAX, |_| ()).await.unwrap_err();
        assert!(
            matches!(
                err,
                TransportError::TooLarge {
                    len: usize::MAX,
                    ..
                }
            ),
            "{err}"
        );
        tx.send(b"still usable").await.unwrap();
    }

    /// The interleaving of the fan-out's double replacement: joiner B is admitted during a wait (attached only
    /// at the next housekeeping), C replaces it in the mailbox before that, and C's `Joined` arrives while the
    /// rank counts as live; B goes away. C is attached; when C goes, the rank is detached (before join numbers
    /// it was admitted again by a park C's own event had left, with no receiver to attach), and the next
    /// joiner is attached as usual.
    #[tokio::test(flavor = "current_thread")]
    async fn a_joiner_replaced_before_it_was_attached_leaves_no_park_behind() {
        let (mut tx, mut rxs, joiner) = inproc_channel_elastic(2, Duration::from_secs(5));
        let (Some(mut rx1), Some(mut rx0)) = (rxs.pop(), rxs.pop()) else {
            panic!("two receivers")
        };
        tx.send(b"v0").await.unwrap();
        for rx in [&mut rx0, &mut rx1] {
            assert_eq!(rx.recv_with(|b| b.to_vec()).await.unwrap(), b"v0");
        }
        tx.flush().await.unwrap();
        // recv_from housekeeps, then waits: rank 1's Gone and B's Joined are applied inside that wait.
        let (up, b) = tokio::join!(tx.recv_from(0), async {
            drop(rx1);
            let b = joiner.join(1).unwrap();
            rx0.send(b"up").await.unwrap();
            b
        });
        assert_eq!(up.unwrap(), b"up");
        let mut c = joiner.join(1).unwrap();
        // B, replaced, goes away (its Gone admits C's park: the same C is attached either way).
        drop(b);
        tx.wait_joined(1).await.unwrap();
        tx.send_to(1, b"to c").await.unwrap();
        assert_eq!(c.recv_with(|m| m.to_vec()).await.unwrap(), b"to c");
        assert_eq!(tx.live(), [0, 1]);
        drop(c);
        tx.joined_ranks().unwrap();
        assert_eq!(
            tx.live(),
            [0],
            "rank 1's last receiver is gone and nobody waits to join"
        );
        let err = tx.send_to(1, b"to nobody").await.unwrap_err();
        assert!(matches!(err, TransportError::PeerGone { .. }), "{err}");
        let mut d = joiner.join(1).unwrap();
        tx.wait_joined(1).await.unwrap();
        tx.send_to(1, b"to d").await.unwrap();
        assert_eq!(d.recv_with(|m| m.to_vec()).await.unwrap(), b"to d");
        assert_eq!(tx.live(), [0, 1]);
    }

    #[tokio::test]
    async fn buffer_is_reused_once_released() {
        let (mut tx, mut rxs) = inproc_channel(1);
        let Some(rx) = rxs.get_mut(0) else {
            panic!("one receiver")
        };
        let mut ptrs = Vec::new();
        let rounds = 2 * DEFAULT_SLOTS;
        for i in 0..rounds as u8 {
            let p = tx
                .send_with(100, |buf| {
                    buf.fill(i);
                    buf.as_ptr() as usize
                })
                .await
                .unwrap();
            ptrs.push(p);
            assert_eq!(rx.recv_with(|b| b.to_vec()).await.unwrap(), vec![i; 100]);
            tx.flush().await.unwrap();
        }
        // The slots take turns, each reusing its own buffer.
        for i in 0..DEFAULT_SLOTS {
            assert_eq!(ptrs[i], ptrs[i + DEFAULT_SLOTS], "slot {i}");
        }
    }
}
