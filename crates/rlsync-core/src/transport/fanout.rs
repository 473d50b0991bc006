//! Sender-side bookkeeping shared by the backends: in-flight slots, releases, upstream queues, dead peers, timed waits.
//!
//! Receivers report through one event stream (`(rank, Event)`); the sender's waits pull events until their
//! condition holds, the deadline passes (`Timeout` naming the laggards) or a rank they need is gone (`PeerGone`).
//!
//! An *elastic* fanout (the channel admits a new receiver for a rank whose old one died) detaches a gone rank
//! instead of failing: its pending releases and segment mappings are dropped, payloads go to the live ranks
//! only, and a later `Joined` event for the rank re-attaches it (parked until the old incarnation's `Gone`, so
//! no event of a dead receiver is ever attributed to its successor). Payloads may also target one rank.
//!
//! Joiners wait in a [`Mailbox`] until the backend attaches them; each is numbered per rank, and every event
//! names its [`Origin`]: the rank and the join number of the receiver that sent it. Only the events of a
//! rank's current receiver count (the attached one, or the joiner admitted to succeed it), so a dead
//! receiver's late `Gone` cannot detach its successor, and the `Joined` of a joiner that was replaced, or
//! attached already as the mailbox's newest, neither admits nor parks anything (else a park could outlive its
//! joiner and admit, when the attached receiver dies, a rank with no connection).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;

use super::{Peer, Target, TransportError};

/// What a receiver tells the sender.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Event {
    /// The receiver's read of payload `seq` returned; its slot may be reused once every rank released it.
    Released { seq: u64 },
    /// The receiver mapped generation `generation` of slot `slot`'s segment (shm only).
    Mapped { slot: usize, generation: u64 },
    /// An upstream message.
    Message(Vec<u8>),
    /// The receiver disconnected.
    Gone,
    /// The receiver broke the protocol (its stream is dropped); the reason says how.
    Violation(String),
    /// A new receiver said hello for this rank (elastic channels only); the backend's [`Mailbox`] holds its
    /// stream under the origin's join number.
    Joined,
}

/// Who sent an event: rank `rank`'s receiver number `join` (0: the rank's first receiver; 1, 2, …: its
/// joiners, as the [`Mailbox`] numbered them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Origin {
    pub(crate) rank: usize,
    pub(crate) join: u64,
}

impl Origin {
    /// Rank `rank`'s first receiver (it did not join late).
    pub(crate) fn first(rank: usize) -> Origin {
        Origin { rank, join: 0 }
    }
}

pub(crate) type EventTx = mpsc::UnboundedSender<(Origin, Event)>;
pub(crate) type EventRx = mpsc::UnboundedReceiver<(Origin, Event)>;

#[derive(Debug)]
struct InFlight {
    seq: u64,
    /// `pending[rank]`: rank has not released `seq` yet.
    pending: Vec<bool>,
}

/// A segment generation waiting for every rank's `Mapped` acknowledgement.
#[derive(Debug)]
struct MapWait {
    generation: u64,
    pending: Vec<bool>,
}

#[derive(Debug)]
pub(crate) struct Fanout {
    receivers: usize,
    timeout: Duration,
    /// The caller's bound on the calls that follow (`set_bound`): its deadline and the duration it was given.
    bound: Option<(Instant, Duration)>,
    slots: Vec<Option<InFlight>>,
    maps: Vec<Option<MapWait>>,
    /// Slots whose current generation every rank has mapped (drained by the shm backend to unlink).
    fully_mapped: Vec<(usize, u64)>,
    next_seq: u64,
    queues: Vec<VecDeque<Vec<u8>>>,
    gone: Vec<bool>,
    events: EventRx,
    /// Gone ranks are detached (and may rejoin) instead of failing every later payload.
    elastic: bool,
    /// A joiner (its join number) waits for its rank's old receiver to be reported gone.
    parked: Vec<Option<u64>>,
    /// The join number of each rank's current receiver, the only one whose events count: the attached one,
    /// or from its admission on the joiner admitted to succeed it.
    current: Vec<u64>,
    /// Ranks (re)admitted since the backend last took them.
    admitted: Vec<usize>,
}

fn ranks_where(flags: &[bool]) -> Vec<usize> {
    flags
        .iter()
        .enumerate()
        .filter(|(_, f)| **f)
        .map(|(rank, _)| rank)
        .collect()
}

fn peer_of(mut ranks: Vec<usize>) -> Peer {
    if ranks.len() == 1 {
        ranks
            .pop()
            .map_or(Peer::Receivers(Vec::new()), Peer::Receiver)
    } else {
        Peer::Receivers(ranks)
    }
}

impl Fanout {
    pub(crate) fn new(receivers: usize, slots: usize, timeout: Duration, events: EventRx) -> Self {
        Fanout {
            receivers,
            timeout,
            bound: None,
            slots: (0..slots).map(|_| None).collect(),
            maps: (0..slots).map(|_| None).collect(),
            fully_mapped: Vec::new(),
            next_seq: 0,
            queues: (0..receivers).map(|_| VecDeque::new()).collect(),
            gone: vec![false; receivers],
            events,
            elastic: false,
            parked: vec![None; receivers],
            current: vec![0; receivers],
            admitted: Vec::new(),
        }
    }

    /// Detach gone ranks instead of failing, and admit `Joined` receivers (see the module docs).
    pub(crate) fn elastic(mut self) -> Self {
        self.elastic = true;
        self
    }

    pub(crate) fn is_elastic(&self) -> bool {
        self.elastic
    }

    /// Whether `rank` is currently detached (its receiver gone, no successor admitted yet).
    pub(crate) fn is_gone(&self, rank: usize) -> bool {
        self.gone.get(rank).copied().unwrap_or(true)
    }

    /// Ranks with a live receiver.
    pub(crate) fn live(&self) -> Vec<usize> {
        ranks_where(&self.gone.iter().map(|g| !g).collect::<Vec<_>>())
    }

    /// The live ranks a payload for `target` goes to (`All`: every live rank but those in `held_back`); a rank
    /// that does not exist or is detached is an error of operation `op`.
    pub(crate) fn targets(
        &self,
        target: Target,
        held_back: &[usize],
        op: &'static str,
    ) -> Result<Vec<usize>, TransportError> {
        match target {
            Target::All => Ok(self
                .live()
                .into_iter()
                .filter(|r| !held_back.contains(r))
                .collect()),
            Target::Rank(rank) if rank >= self.receivers => Err(TransportError::NoSuchRank {
                rank,
                receivers: self.receivers,
            }),
            Target::Rank(rank) if self.is_gone(rank) => Err(TransportError::PeerGone {
                op,
                peer: Peer::Receiver(rank),
            }),
            Target::Rank(rank) => Ok(vec![rank]),
        }
    }

    /// Ranks admitted since the last call (the backend attaches their streams, then calls [`Fanout::attached`],
    /// or [`Fanout::detach`] for a rank whose mailbox entry is missing).
    pub(crate) fn take_admitted(&mut self) -> Vec<usize> {
        std::mem::take(&mut self.admitted)
    }

    /// Record that the backend attached joiner `join` of `rank` (the mailbox's newest for it) before its
    /// first event: it is the rank's current receiver, a park by it or an earlier joiner is spent, and their
    /// `Joined` events still queued are ignored.
    pub(crate) fn attached(&mut self, rank: usize, join: u64) {
        if let Some(c) = self.current.get_mut(rank) {
            *c = (*c).max(join);
        }
        if let Some(p) = self.parked.get_mut(rank)
            && p.is_some_and(|parked| parked <= join)
        {
            *p = None;
        }
    }

    pub(crate) fn receivers(&self) -> usize {
        self.receivers
    }

    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Bound every wait from now on by `now + bound` as well as by the channel's own timeout (`None`: the
    /// channel's timeout only). A wait cut short by the bound reports the bound as its timeout.
    pub(crate) fn set_bound(&mut self, bound: Option<Duration>) {
        self.bound = bound.map(|d| (Instant::now() + d, d));
    }

    /// The deadline of a wait starting now: the channel's timeout, or the caller's bound when that ends first.
    pub(crate) fn deadline(&self) -> Instant {
        let own = Instant::now() + self.timeout;
        match self.bound {
            Some((end, _)) if end < own => end,
            _ => own,
        }
    }

    /// The timeout a wait that ran out at `deadline` reports: the caller's bound when it set the deadline.
    pub(crate) fn timeout_at(&self, deadline: Instant) -> Duration {
        match self.bound {
            Some((end, d)) if deadline >= end => d,
            _ => self.timeout,
        }
    }

    /// Sequence number and slot of the next payload.
    pub(crate) fn next(&self) -> (u64, usize) {
        let slots = self.slots.len().max(1) as u64;
        (self.next_seq, (self.next_seq % slots) as usize)
    }

    /// Fail if any rank is gone: a payload must reach every receiver (elastic: the live ones suffice).
    pub(crate) fn require_all_alive(&self, op: &'static str) -> Result<(), TransportError> {
        let gone = ranks_where(&self.gone);
        if gone.is_empty() || self.elastic {
            Ok(())
        } else {
            Err(TransportError::PeerGone {
                op,
                peer: peer_of(gone),
            })
        }
    }

    /// Record that payload `seq` was published in `slot` to every rank.
    #[cfg(test)]
    pub(crate) fn published(&mut self, seq: u64, slot: usize) {
        let all: Vec<usize> = (0..self.receivers).collect();
        self.published_to(seq, slot, &all);
    }

    /// Record that payload `seq` was published in `slot` to `ranks` (those must release it).
    pub(crate) fn published_to(&mut self, seq: u64, slot: usize, ranks: &[usize]) {
        let mut pending = vec![false; self.receivers];
        for &r in ranks {
            if let Some(p) = pending.get_mut(r) {
                *p = true;
            }
        }
        // With no receivers nothing is ever in flight.
        if let Some(entry) = self.slots.get_mut(slot) {
            *entry = pending
                .iter()
                .any(|p| *p)
                .then_some(InFlight { seq, pending });
        }
        self.next_seq = seq + 1;
    }

    /// Record that a new segment generation for `slot` was announced to every rank.
    #[cfg(test)]
    pub(crate) fn announced(&mut self, slot: usize, generation: u64) {
        if self.receivers == 0 {
            self.fully_mapped.push((slot, generation));
        } else if let Some(entry) = self.maps.get_mut(slot) {
            *entry = Some(MapWait {
                generation,
                pending: vec![true; self.receivers],
            });
        }
    }

    /// Record that `generation` of `slot` was announced to `rank` (elastic: ranks learn of a generation at
    /// their first payload in that slot); its name stays linked until every rank told has mapped it.
    pub(crate) fn announced_to(&mut self, slot: usize, generation: u64, rank: usize) {
        let receivers = self.receivers;
        if let Some(entry) = self.maps.get_mut(slot) {
            let wait = match entry {
                Some(w) if w.generation == generation => w,
                _ => entry.insert(MapWait {
                    generation,
                    pending: vec![false; receivers],
                }),
            };
            if let Some(p) = wait.pending.get_mut(rank) {
                *p = true;
            }
        }
    }

    /// Slot generations every rank has mapped since the last call.
    pub(crate) fn drain_fully_mapped(&mut self) -> Vec<(usize, u64)> {
        std::mem::take(&mut self.fully_mapped)
    }

    /// Wait for the next event (or the deadline: `Timeout` naming `waiting_on`) and apply it.
    pub(crate) async fn wait_event(
        &mut self,
        deadline: Instant,
        op: &'static str,
        waiting_on: Vec<usize>,
    ) -> Result<(), TransportError> {
        self.next_event(deadline, op, waiting_on).await
    }

    /// Wait until no payload is in flight in `slot`.
    pub(crate) async fn wait_slot_free(
        &mut self,
        slot: usize,
        op: &'static str,
    ) -> Result<(), TransportError> {
        let deadline = self.deadline();
        loop {
            let pending = match self.slots.get(slot) {
                Some(Some(inflight)) => ranks_where(&inflight.pending),
                _ => return Ok(()),
            };
            self.check_pending(&pending, op)?;
            self.next_event(deadline, op, pending).await?;
        }
    }

    /// Wait until every published payload is released by every rank.
    pub(crate) async fn wait_all_free(&mut self, op: &'static str) -> Result<(), TransportError> {
        let deadline = self.deadline();
        loop {
            let mut pending = vec![false; self.receivers];
            for inflight in self.slots.iter().flatten() {
                for (acc, p) in pending.iter_mut().zip(&inflight.pending) {
                    *acc |= *p;
                }
            }
            let pending = ranks_where(&pending);
            if pending.is_empty() {
                return Ok(());
            }
            self.check_pending(&pending, op)?;
            self.next_event(deadline, op, pending).await?;
        }
    }

    /// Wait for the next upstream message from `rank`.
    pub(crate) async fn wait_message(
        &mut self,
        rank: usize,
        op: &'static str,
    ) -> Result<Vec<u8>, TransportError> {
        if rank >= self.receivers {
            return Err(TransportError::NoSuchRank {
                rank,
                receivers: self.receivers,
            });
        }
        let deadline = self.deadline();
        loop {
            if let Some(msg) = self.queues.get_mut(rank).and_then(VecDeque::pop_front) {
                return Ok(msg);
            }
            self.check_pending(&[rank], op)?;
            self.next_event(deadline, op, vec![rank]).await?;
        }
    }

    /// The next upstream message from `rank` already delivered, if `accept` takes it, without waiting
    /// (`None`: none yet, or the next one is not for this caller and stays queued).
    pub(crate) fn try_message(
        &mut self,
        rank: usize,
        accept: &dyn Fn(&[u8]) -> bool,
    ) -> Result<Option<Vec<u8>>, TransportError> {
        if rank >= self.receivers {
            return Err(TransportError::NoSuchRank {
                rank,
                receivers: self.receivers,
            });
        }
        self.poll_events()?;
        let Some(queue) = self.queues.get_mut(rank) else {
            return Ok(None);
        };
        match queue.front() {
            Some(msg) if accept(msg) => Ok(queue.pop_front()),
            _ => Ok(None),
        }
    }

    /// Wait until any of `ranks` has an upstream message queued (bounded; `PeerGone` naming those of them
    /// that are gone, `Timeout` naming them all).
    pub(crate) async fn wait_any_message(
        &mut self,
        ranks: &[usize],
        op: &'static str,
    ) -> Result<(), TransportError> {
        let deadline = self.deadline();
        loop {
            self.poll_events()?;
            if ranks
                .iter()
                .any(|&r| self.queues.get(r).is_some_and(|q| !q.is_empty()))
            {
                return Ok(());
            }
            self.check_pending(ranks, op)?;
            self.next_event(deadline, op, ranks.to_vec()).await?;
        }
    }

    fn check_pending(&self, pending: &[usize], op: &'static str) -> Result<(), TransportError> {
        let gone: Vec<usize> = pending
            .iter()
            .copied()
            .filter(|r| self.gone.get(*r).copied().unwrap_or(true))
            .collect();
        if gone.is_empty() {
            Ok(())
        } else {
            Err(TransportError::PeerGone {
                op,
                peer: peer_of(gone),
            })
        }
    }

    async fn next_event(
        &mut self,
        deadline: Instant,
        op: &'static str,
        waiting_on: Vec<usize>,
    ) -> Result<(), TransportError> {
        match tokio::time::timeout_at(deadline, self.events.recv()).await {
            Err(_) => Err(TransportError::Timeout {
                op,
                peer: peer_of(waiting_on),
                timeout: self.timeout_at(deadline),
            }),
            Ok(Some((origin, event))) => self.apply(origin, event),
            // Every event source is gone at once: all receivers have disconnected.
            Ok(None) => {
                for rank in 0..self.receivers {
                    self.mark_gone(rank);
                }
                if self.elastic {
                    // Nobody can join any more either: waiting again would spin.
                    return Err(TransportError::PeerGone {
                        op,
                        peer: peer_of(waiting_on),
                    });
                }
                Ok(())
            }
        }
    }

    /// Take already-delivered events without waiting (keeps acknowledgements flowing between waits).
    pub(crate) fn poll_events(&mut self) -> Result<(), TransportError> {
        while let Ok((origin, event)) = self.events.try_recv() {
            self.apply(origin, event)?;
        }
        Ok(())
    }

    fn apply(&mut self, origin: Origin, event: Event) -> Result<(), TransportError> {
        let Origin { rank, join } = origin;
        let protocol = |reason: String| TransportError::Protocol {
            peer: Peer::Receiver(rank),
            reason,
        };
        if rank >= self.receivers {
            return Err(protocol(format!("event from unknown rank {rank}")));
        }
        // Elastic: a receiver that was succeeded (or a joiner replaced before it was attached) speaks for
        // nobody, whatever it sends after its successor's admission.
        if self.elastic
            && !matches!(event, Event::Joined)
            && self.current.get(rank).is_some_and(|&c| c != join)
        {
            tracing::debug!(
                rank,
                join,
                ?event,
                "ignored an event of a succeeded receiver"
            );
            return Ok(());
        }
        // Elastic: what a detached rank's receiver sent before it died (read after the sender detached it, e.g.
        // on a failed write) concerns nothing any more: its payloads and segments were let go. A successor's
        // events only come after it was admitted (its stream is attached then), its `Joined` included.
        if self.elastic
            && self.gone.get(rank).copied().unwrap_or(false)
            && matches!(
                event,
                Event::Released { .. } | Event::Mapped { .. } | Event::Message(_)
            )
        {
            tracing::debug!(rank, ?event, "ignored an event of a detached receiver");
            return Ok(());
        }
        match event {
            Event::Released { seq } => {
                let inflight = self
                    .slots
                    .iter_mut()
                    .flatten()
                    .find(|inflight| inflight.seq == seq)
                    .ok_or_else(|| {
                        protocol(format!("released payload {seq}, which is not in flight"))
                    })?;
                match inflight.pending.get_mut(rank) {
                    Some(flag @ true) => *flag = false,
                    _ => return Err(protocol(format!("released payload {seq} twice"))),
                }
                for slot in self.slots.iter_mut() {
                    if slot.as_ref().is_some_and(|s| s.pending.iter().all(|p| !p)) {
                        *slot = None;
                    }
                }
            }
            Event::Mapped { slot, generation } => {
                let wait = match self.maps.get_mut(slot) {
                    Some(Some(wait)) if wait.generation == generation => wait,
                    other => {
                        let waiting = match other {
                            Some(Some(wait)) => format!(
                                "generation {} is awaited from ranks {:?}",
                                wait.generation,
                                ranks_where(&wait.pending)
                            ),
                            _ => "no generation of it is awaited".to_owned(),
                        };
                        return Err(protocol(format!(
                            "mapped slot {slot} generation {generation}, which was not announced ({waiting})"
                        )));
                    }
                };
                if let Some(flag) = wait.pending.get_mut(rank) {
                    *flag = false;
                }
                if wait.pending.iter().all(|p| !p) {
                    self.fully_mapped.push((slot, generation));
                    if let Some(entry) = self.maps.get_mut(slot) {
                        *entry = None;
                    }
                }
            }
            Event::Message(msg) => {
                if let Some(queue) = self.queues.get_mut(rank) {
                    queue.push_back(msg);
                }
            }
            Event::Gone => self.mark_gone(rank),
            Event::Violation(reason) => {
                self.mark_gone(rank);
                if !self.elastic {
                    return Err(protocol(reason));
                }
                tracing::warn!(rank, %reason, "receiver broke the protocol and was detached");
            }
            Event::Joined => self.joined(origin)?,
        }
        Ok(())
    }

    /// Joiner `origin.join` of `origin.rank` said hello: admitted at once where the rank's receiver is gone,
    /// else parked until it is.
    fn joined(&mut self, origin: Origin) -> Result<(), TransportError> {
        let Origin { rank, join } = origin;
        if !self.elastic {
            return Err(TransportError::Protocol {
                peer: Peer::Receiver(rank),
                reason: "joined a channel that admits no new receivers".into(),
            });
        }
        if self.current.get(rank).is_some_and(|&c| join <= c) {
            // Admitted or attached already, or replaced by a later joiner that was.
            tracing::debug!(rank, join, "a join event of an admitted or replaced joiner");
        } else if self.gone.get(rank).copied().unwrap_or(false) {
            self.admit(rank, join);
        } else if let Some(p) = self.parked.get_mut(rank) {
            *p = Some(p.map_or(join, |parked| parked.max(join)));
        }
        Ok(())
    }

    /// Joiner `join` succeeds `rank`'s gone receiver: live again, its events the ones that count.
    fn admit(&mut self, rank: usize, join: u64) {
        if let Some(g) = self.gone.get_mut(rank) {
            *g = false;
        }
        if let Some(c) = self.current.get_mut(rank) {
            *c = join;
        }
        if let Some(p) = self.parked.get_mut(rank) {
            *p = None;
        }
        self.admitted.retain(|&r| r != rank);
        self.admitted.push(rank);
    }

    /// Record that `rank`'s receiver is gone. Elastic: it no longer holds up any payload or segment, and a
    /// parked successor is admitted.
    fn mark_gone(&mut self, rank: usize) {
        if let Some(flag) = self.gone.get_mut(rank) {
            *flag = true;
        }
        if !self.elastic {
            return;
        }
        // What the dead receiver sent and nobody read is not its successor's.
        if let Some(q) = self.queues.get_mut(rank) {
            q.clear();
        }
        self.admitted.retain(|&r| r != rank);
        for slot in self.slots.iter_mut() {
            if let Some(inflight) = slot {
                if let Some(p) = inflight.pending.get_mut(rank) {
                    *p = false;
                }
                if inflight.pending.iter().all(|p| !p) {
                    *slot = None;
                }
            }
        }
        for (slot, entry) in self.maps.iter_mut().enumerate() {
            if let Some(wait) = entry {
                if let Some(p) = wait.pending.get_mut(rank) {
                    *p = false;
                }
                if wait.pending.iter().all(|p| !p) {
                    self.fully_mapped.push((slot, wait.generation));
                    *entry = None;
                }
            }
        }
        if let Some(join) = self.parked.get(rank).copied().flatten() {
            self.admit(rank, join);
        }
    }

    /// Mark `rank` gone because writing to it failed (elastic channels: the same as its `Gone`).
    pub(crate) fn detach(&mut self, rank: usize) {
        self.mark_gone(rank);
    }
}

/// Joiners' connections by rank, each under its join number, from a backend's acceptor (which puts them) to
/// its sender (which takes them when the fanout admits the rank). A joiner not taken yet is replaced by the
/// next for its rank (its connection closes: it fails and may retry).
pub(crate) struct Mailbox<T>(Arc<Mutex<Vec<Waiting<T>>>>);

struct Waiting<T> {
    joins: u64,
    joiner: Option<T>,
}

impl<T> Clone for Mailbox<T> {
    fn clone(&self) -> Self {
        Mailbox(self.0.clone())
    }
}

impl<T> std::fmt::Debug for Mailbox<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let waiting: Vec<usize> = self
            .lock()
            .iter()
            .enumerate()
            .filter(|(_, w)| w.joiner.is_some())
            .map(|(rank, _)| rank)
            .collect();
        f.debug_struct("Mailbox")
            .field("waiting", &waiting)
            .finish()
    }
}

impl<T> Mailbox<T> {
    pub(crate) fn new(receivers: usize) -> Self {
        let slots = (0..receivers)
            .map(|_| Waiting {
                joins: 0,
                joiner: None,
            })
            .collect();
        Mailbox(Arc::new(Mutex::new(slots)))
    }

    /// The slots; a panic elsewhere while one was held leaves them consistent (each update is one store).
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Waiting<T>>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Leave `joiner` for `rank` (replacing one not taken yet): its join number (1, 2, … per rank), which its
    /// `Joined` event must carry; `None` for a rank out of range.
    pub(crate) fn put(&self, rank: usize, joiner: T) -> Option<u64> {
        let mut slots = self.lock();
        let slot = slots.get_mut(rank)?;
        slot.joins += 1;
        slot.joiner = Some(joiner);
        Some(slot.joins)
    }

    /// Take `rank`'s waiting joiner and its join number.
    pub(crate) fn take(&self, rank: usize) -> Option<(u64, T)> {
        let mut slots = self.lock();
        let slot = slots.get_mut(rank)?;
        let joiner = slot.joiner.take()?;
        Some((slot.joins, joiner))
    }
}

/// The [`SendBackend`](super::SendBackend) of a sender built on [`Fanout`] (the shm channel's and the TCP
/// fan-out's): both provide `check_usable`, `housekeep` (take pending events), `settle` (turn a failure into
/// the channel's state), `try_send_with`, `try_wait_joined`, a `fanout` and an optional `late` (joiners);
/// `$slot_op` names a wait for a free slot in errors. The expansion site must have `SendBackend`, `Target`,
/// `TransportError`, `Duration` and the `OP_FLUSH`, `OP_RECV_FROM`, `OP_REPORTS` constants in scope.
macro_rules! fan_send_backend {
    ($ty:ty, $slot_op:expr) => {
        impl SendBackend for $ty {
            fn receivers(&self) -> usize {
                self.fanout.receivers()
            }

            async fn send_with<R>(
                &mut self,
                target: Target,
                len: usize,
                fill: impl FnOnce(&mut [u8]) -> R,
            ) -> Result<R, TransportError> {
                self.check_usable()?;
                let result = self.try_send_with(target, len, fill).await;
                self.settle(result)
            }

            async fn wait_joined(&mut self, rank: usize) -> Result<(), TransportError> {
                self.check_usable()?;
                let result = self.try_wait_joined(rank).await;
                self.settle(result)
            }

            fn live(&self) -> Vec<usize> {
                self.fanout.live()
            }

            fn is_elastic(&self) -> bool {
                self.fanout.is_elastic()
            }

            async fn flush(&mut self) -> Result<(), TransportError> {
                self.check_usable()?;
                let result = match self.housekeep() {
                    Ok(()) => self.fanout.wait_all_free(OP_FLUSH).await,
                    Err(e) => Err(e),
                };
                self.settle(result)
            }

            async fn recv_from(&mut self, rank: usize) -> Result<Vec<u8>, TransportError> {
                self.check_usable()?;
                let result = match self.housekeep() {
                    Ok(()) => self.fanout.wait_message(rank, OP_RECV_FROM).await,
                    Err(e) => Err(e),
                };
                self.settle(result)
            }

            fn joined_ranks(&mut self) -> Result<Vec<usize>, TransportError> {
                self.check_usable()?;
                let result = self.housekeep();
                self.settle(result)?;
                Ok(self
                    .late
                    .as_ref()
                    .map(|l| l.fresh.clone())
                    .unwrap_or_default())
            }

            fn try_recv_from(
                &mut self,
                rank: usize,
                accept: &dyn Fn(&[u8]) -> bool,
            ) -> Result<Option<Vec<u8>>, TransportError> {
                self.check_usable()?;
                let result = self
                    .housekeep()
                    .and_then(|()| self.fanout.try_message(rank, accept));
                self.settle(result)
            }

            async fn wait_any_from(&mut self, ranks: &[usize]) -> Result<(), TransportError> {
                self.check_usable()?;
                let result = match self.housekeep() {
                    Ok(()) => self.fanout.wait_any_message(ranks, OP_REPORTS).await,
                    Err(e) => Err(e),
                };
                self.settle(result)
            }

            fn set_bound(&mut self, bound: Option<Duration>) {
                self.fanout.set_bound(bound);
            }

            async fn ready(&mut self) -> Result<(), TransportError> {
                self.check_usable()?;
                let result = match self.housekeep() {
                    Ok(()) => {
                        let (_, slot) = self.fanout.next();
                        self.fanout.wait_slot_free(slot, $slot_op).await
                    }
                    Err(e) => Err(e),
                };
                self.settle(result)
            }
        }
    };
}
pub(super) use fan_send_backend;

#[cfg(test)]
mod tests {
    use super::*;

    fn fanout(receivers: usize, slots: usize) -> (Fanout, EventTx) {
        let (tx, rx) = mpsc::unbounded_channel();
        (
            Fanout::new(receivers, slots, Duration::from_millis(50), rx),
            tx,
        )
    }

    fn elastic(receivers: usize) -> (Fanout, EventTx) {
        let (f, tx) = fanout(receivers, 2);
        (f.elastic(), tx)
    }

    fn joiner(rank: usize, join: u64) -> Origin {
        Origin { rank, join }
    }

    #[test]
    fn a_joiner_is_admitted_once_its_predecessor_is_gone() {
        let (mut f, tx) = elastic(2);
        // Joined while the first receiver lives: parked until its Gone.
        tx.send((joiner(1, 1), Event::Joined)).ok();
        f.poll_events().unwrap();
        assert!(f.take_admitted().is_empty());
        tx.send((Origin::first(1), Event::Gone)).ok();
        f.poll_events().unwrap();
        assert_eq!(f.take_admitted(), [1]);
        assert_eq!(f.live(), [0, 1]);
        f.attached(1, 1);
        // Joined after a Gone: admitted at once.
        tx.send((joiner(1, 1), Event::Gone)).ok();
        tx.send((joiner(1, 2), Event::Joined)).ok();
        f.poll_events().unwrap();
        assert_eq!(f.take_admitted(), [1]);
    }

    #[test]
    fn join_events_of_attached_or_replaced_joiners_neither_admit_nor_park() {
        let (mut f, tx) = elastic(2);
        tx.send((Origin::first(1), Event::Gone)).ok();
        tx.send((joiner(1, 1), Event::Joined)).ok();
        f.poll_events().unwrap();
        // Joiner 2 replaced joiner 1 in the mailbox before the backend took it; its event finds rank 1 live.
        tx.send((joiner(1, 2), Event::Joined)).ok();
        f.poll_events().unwrap();
        assert_eq!(f.take_admitted(), [1]);
        f.attached(1, 2);
        tx.send((joiner(1, 2), Event::Gone)).ok();
        f.poll_events().unwrap();
        assert!(
            f.take_admitted().is_empty(),
            "the park was joiner 2's, which is attached"
        );
        assert_eq!(f.live(), [0]);
        // Joiner 3's event admits rank 1; the backend attaches the mailbox's newest, joiner 4, whose event is
        // read only afterwards.
        tx.send((joiner(1, 3), Event::Joined)).ok();
        f.poll_events().unwrap();
        assert_eq!(f.take_admitted(), [1]);
        f.attached(1, 4);
        tx.send((joiner(1, 4), Event::Joined)).ok();
        f.poll_events().unwrap();
        tx.send((joiner(1, 4), Event::Gone)).ok();
        f.poll_events().unwrap();
        assert!(f.take_admitted().is_empty(), "nobody waits to join rank 1");
        assert_eq!(f.live(), [0]);
        // A later joiner still parks while the attached receiver lives, and is admitted at its Gone.
        tx.send((joiner(0, 1), Event::Joined)).ok();
        f.poll_events().unwrap();
        assert!(f.take_admitted().is_empty());
        tx.send((Origin::first(0), Event::Gone)).ok();
        f.poll_events().unwrap();
        assert_eq!(f.take_admitted(), [0]);
    }

    /// Rank 1's receiver is detached on a failed write and a joiner admitted before the dead receiver's own
    /// events are read: they concern nobody (its Gone would otherwise detach the successor, its release
    /// count as the successor's); the successor's count.
    #[tokio::test]
    async fn a_succeeded_receivers_late_events_are_ignored() {
        let (mut f, tx) = elastic(2);
        f.published(0, 0);
        f.detach(1);
        tx.send((joiner(1, 1), Event::Joined)).ok();
        tx.send((Origin::first(1), Event::Released { seq: 0 })).ok();
        tx.send((Origin::first(1), Event::Gone)).ok();
        tx.send((Origin::first(0), Event::Released { seq: 0 })).ok();
        f.poll_events().unwrap();
        assert_eq!(f.take_admitted(), [1]);
        assert_eq!(f.live(), [0, 1], "the successor stays admitted");
        f.wait_all_free("t").await.unwrap();
        f.attached(1, 1);
        f.published_to(1, 1, &[0, 1]);
        tx.send((Origin::first(1), Event::Released { seq: 1 })).ok();
        tx.send((Origin::first(0), Event::Released { seq: 1 })).ok();
        f.poll_events().unwrap();
        assert!(
            f.wait_slot_free(1, "t").await.is_err(),
            "only the successor's release frees the slot"
        );
        tx.send((joiner(1, 1), Event::Released { seq: 1 })).ok();
        f.wait_slot_free(1, "t").await.unwrap();
    }

    #[test]
    fn the_mailbox_numbers_joiners_per_rank_and_keeps_the_newest() {
        let m: Mailbox<&str> = Mailbox::new(2);
        assert_eq!(m.put(1, "b"), Some(1));
        assert_eq!(m.put(1, "c"), Some(2));
        assert_eq!(m.put(0, "x"), Some(1));
        assert_eq!(m.put(2, "out of range"), None);
        assert_eq!(m.take(1), Some((2, "c")));
        assert_eq!(m.take(1), None);
        assert_eq!(m.put(1, "d"), Some(3));
        assert_eq!(format!("{m:?}"), "Mailbox { waiting: [0, 1] }");
    }

    #[tokio::test]
    async fn slot_frees_only_after_every_rank_released() {
        let (mut f, tx) = fanout(2, 2);
        f.published(0, 0);
        tx.send((Origin::first(0), Event::Released { seq: 0 })).ok();
        let err = f.wait_slot_free(0, "test").await.unwrap_err();
        assert!(
            matches!(
                err,
                TransportError::Timeout {
                    peer: Peer::Receiver(1),
                    ..
                }
            ),
            "{err}"
        );
        tx.send((Origin::first(1), Event::Released { seq: 0 })).ok();
        f.wait_slot_free(0, "test").await.unwrap();
        f.wait_all_free("test").await.unwrap();
    }

    #[tokio::test]
    async fn gone_rank_fails_waits_that_need_it() {
        let (mut f, tx) = fanout(3, 2);
        f.published(0, 0);
        tx.send((Origin::first(0), Event::Released { seq: 0 })).ok();
        tx.send((Origin::first(2), Event::Gone)).ok();
        let err = f.wait_all_free("flushing").await.unwrap_err();
        assert!(
            matches!(
                err,
                TransportError::PeerGone {
                    peer: Peer::Receiver(2),
                    ..
                }
            ),
            "{err}"
        );
        assert!(f.require_all_alive("sending").is_err());
    }

    #[tokio::test]
    async fn no_receivers_means_nothing_in_flight() {
        let (mut f, _tx) = fanout(0, 2);
        for seq in 0..5 {
            let (next, slot) = f.next();
            assert_eq!((next, slot), (seq, (seq % 2) as usize));
            f.wait_slot_free(slot, "t").await.unwrap();
            f.published(seq, slot);
            f.announced(slot, seq);
        }
        f.wait_all_free("t").await.unwrap();
        assert_eq!(f.drain_fully_mapped().len(), 5);
    }

    #[tokio::test]
    async fn messages_queue_per_rank_in_order() {
        let (mut f, tx) = fanout(2, 1);
        tx.send((Origin::first(1), Event::Message(b"a".to_vec())))
            .ok();
        tx.send((Origin::first(0), Event::Message(b"b".to_vec())))
            .ok();
        tx.send((Origin::first(1), Event::Message(b"c".to_vec())))
            .ok();
        assert_eq!(f.wait_message(1, "t").await.unwrap(), b"a");
        assert_eq!(f.wait_message(1, "t").await.unwrap(), b"c");
        assert_eq!(f.wait_message(0, "t").await.unwrap(), b"b");
        assert!(matches!(
            f.wait_message(5, "t").await,
            Err(TransportError::NoSuchRank { rank: 5, .. })
        ));
    }

    #[tokio::test]
    async fn bogus_events_are_protocol_errors() {
        let check = |event: Event| async move {
            let (mut f, tx) = fanout(1, 1);
            f.published(0, 0);
            tx.send((Origin::first(0), Event::Released { seq: 0 })).ok();
            tx.send((Origin::first(0), event)).ok();
            f.wait_all_free("t").await.unwrap();
            f.poll_events()
        };
        assert!(
            check(Event::Released { seq: 0 }).await.is_err(),
            "double release"
        );
        assert!(
            check(Event::Released { seq: 9 }).await.is_err(),
            "unknown seq"
        );
        assert!(
            check(Event::Mapped {
                slot: 0,
                generation: 3
            })
            .await
            .is_err(),
            "unannounced generation"
        );
        assert!(
            matches!(
                check(Event::Violation("a second hello".into())).await,
                Err(TransportError::Protocol { peer: Peer::Receiver(0), reason }) if reason == "a second hello"
            ),
            "violations name the rank"
        );
        assert!(check(Event::Message(vec![1])).await.is_ok());
    }

    #[tokio::test]
    async fn mapped_generations_drain_once_all_ranks_mapped() {
        let (mut f, tx) = fanout(2, 2);
        f.announced(1, 7);
        tx.send((
            Origin::first(0),
            Event::Mapped {
                slot: 1,
                generation: 7,
            },
        ))
        .ok();
        f.poll_events().unwrap();
        assert!(f.drain_fully_mapped().is_empty());
        tx.send((
            Origin::first(1),
            Event::Mapped {
                slot: 1,
                generation: 7,
            },
        ))
        .ok();
        f.poll_events().unwrap();
        assert_eq!(f.drain_fully_mapped(), vec![(1, 7)]);
        assert!(f.drain_fully_mapped().is_empty());
    }

    /// A receiver detached on a failed write whose last acknowledgements are read only afterwards: they are
    /// its dead incarnation's, ignored, and the channel goes on (its successor starts clean).
    #[tokio::test]
    async fn events_of_a_detached_receiver_are_ignored_when_elastic() {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut f = Fanout::new(2, 2, Duration::from_millis(50), rx).elastic();
        f.published(0, 0);
        f.announced_to(0, 5, 0);
        f.announced_to(0, 5, 1);
        f.detach(0);
        for event in [
            Event::Mapped {
                slot: 0,
                generation: 5,
            },
            Event::Released { seq: 0 },
            Event::Message(vec![1]),
            Event::Gone,
        ] {
            tx.send((Origin::first(0), event)).ok();
        }
        f.poll_events().unwrap();
        assert!(f.is_gone(0));
        tx.send((
            Origin::first(1),
            Event::Mapped {
                slot: 0,
                generation: 5,
            },
        ))
        .ok();
        tx.send((Origin::first(1), Event::Released { seq: 0 })).ok();
        f.poll_events().unwrap();
        assert_eq!(f.drain_fully_mapped(), vec![(0, 5)]);
        f.wait_all_free("t").await.unwrap();
    }
}
