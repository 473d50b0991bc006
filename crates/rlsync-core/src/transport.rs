//! Byte channels from one sender to N receivers: in-process, shared memory with Unix-socket control, a
//! bridge whose bytes the caller carries (the Python binding's async `send`/`recv`), and a pipelined TCP
//! chain across nodes (each node's receivers behind its own local channel).
//!
//! A [`Sender`] publishes payloads that every [`Receiver`] reads in place; receivers release each payload when
//! their read closure returns, and a bounded number of payloads may be in flight (the sender fills the next one
//! while receivers read the previous). Receivers send small upstream messages (metadata, reports) back to the
//! sender. Every wait is bounded by the channel's timeout: a dead or stuck peer gives
//! [`TransportError::Timeout`] or [`TransportError::PeerGone`] naming it, never a hang.
//!
//! Elastic channels ([`ShmConfig::elastic`], [`TcpFanConfig::elastic`], [`inproc_channel_elastic`], and a TCP
//! chain whose every node's local fan-out is elastic) outlive their receivers: a gone receiver is detached
//! instead of breaking the channel, a new receiver may take its rank ([`Sender::wait_joined`]), and a payload
//! may go to one rank only ([`Sender::send_to_with`]).
//!
//! A caller may bound the waits of its next calls further ([`Sender::set_bound`], [`Receiver::set_bound`]: the
//! Python API's per-call `timeout=`); a wait cut short reports `Timeout` with that bound, and a payload wait
//! that runs out consumes nothing. Shm, in-process and TCP fan-out senders also hand receivers' upstream
//! reports out between payloads without waiting ([`Sender::try_recv_from`], [`Sender::wait_any_from`]). The
//! TCP fan-out ([`TcpFanSender`]) is the 1 → N channel across hosts whose receivers connect to the sender.
//!
//! Backends sit behind one internal trait per side ([`SendBackend`], [`RecvBackend`]) and are dispatched through
//! the [`Sender`]/[`Receiver`] enums, so callers never name a backend after construction.
//! The transport moves bytes only; it knows nothing about what the payloads mean.

pub mod bridge;
mod fanout;
mod frame;
pub mod inproc;
pub mod shm;
#[cfg(test)]
pub(crate) mod tap;
pub mod tcp;
pub mod tcp_fan;
mod tcp_link;

use std::fmt;
use std::time::Duration;

pub use inproc::{
    InProcJoiner, InProcReceiver, InProcSender, inproc_channel, inproc_channel_elastic,
    inproc_channel_with_timeout,
};
pub use shm::{ShmConfig, ShmReceiver, ShmSender};
pub use tcp::{ChainConfig, ChainRelay, ChainSender, RelayEnd};
pub use tcp_fan::{TcpFanConfig, TcpFanListener, TcpFanReceiver, TcpFanSender};
pub use tcp_link::LinkError;

/// How long any single wait may take unless the channel was built with another timeout.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// Payloads in flight at once unless configured otherwise. Bucket parts are 8 MiB, so four slots keep the
/// sender a few parts ahead of a receiver's copy (measured: bucket sync over shm 1.40–1.47× memcpy with four,
/// 1.50–1.58× with two) for 32 MiB of segments.
pub const DEFAULT_SLOTS: usize = 4;

/// Page offset (in a 4 KiB page) where every payload starts. Copies whose destination sits a little after
/// their source modulo 4 KiB run about 3x slower (loads falsely wait on earlier stores to the same page
/// offset: "4K aliasing"). Receivers copy into allocator buffers, which start at small page offsets (16,
/// 64), so payloads at offset 0 (plus a small header) would hit exactly that; half a page keeps them apart.
pub(crate) const PAYLOAD_PAGE_OFFSET: usize = 2048;

/// The deadline and the reported timeout of a wait starting now: the channel's `timeout`, or the caller's
/// bound (`set_bound`: its deadline and the duration it was given) when that ends first.
pub(crate) fn wait_deadline(
    timeout: Duration,
    bound: Option<(tokio::time::Instant, Duration)>,
) -> (tokio::time::Instant, Duration) {
    let own = tokio::time::Instant::now() + timeout;
    match bound {
        Some((end, d)) if end < own => (end, d),
        _ => (own, timeout),
    }
}

/// Who an error is about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Peer {
    /// The single sender of the channel (seen from a receiver).
    Sender,
    /// One receiver, by rank.
    Receiver(usize),
    /// Several receivers, by rank (e.g. all those that did not release a payload in time).
    Receivers(Vec<usize>),
    /// Another node of a TCP chain (`node 2 (gpu07) at 10.0.0.7:29511`).
    Node(String),
}

impl fmt::Display for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Peer::Sender => write!(f, "the sender"),
            Peer::Receiver(rank) => write!(f, "receiver rank {rank}"),
            Peer::Receivers(ranks) => write!(f, "receiver ranks {ranks:?}"),
            Peer::Node(name) => write!(f, "{name}"),
        }
    }
}

/// Everything that can go wrong moving bytes.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("timed out after {timeout:?} while {op}, waiting on {peer}")]
    Timeout {
        op: &'static str,
        peer: Peer,
        timeout: Duration,
    },
    #[error("{peer} is gone (disconnected) while {op}")]
    PeerGone { op: &'static str, peer: Peer },
    #[error("i/o error while {op}")]
    Io {
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("shared memory segment {name}: {op} failed")]
    Segment {
        name: String,
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("protocol violation by {peer}: {reason}")]
    Protocol { peer: Peer, reason: String },
    /// Bytes on a TCP chain link that are not a link message.
    #[error("protocol violation by {peer}")]
    Link {
        peer: Peer,
        #[source]
        source: LinkError,
    },
    #[error("{peer} was refused: {reason}")]
    Auth { peer: String, reason: String },
    #[error("the handshake was rejected by the sender: {reason}")]
    Rejected { reason: String },
    #[error("{what} of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge {
        what: &'static str,
        len: usize,
        max: usize,
    },
    #[error("rank {rank} is out of range for a channel with {receivers} receivers")]
    NoSuchRank { rank: usize, receivers: usize },
    #[error("invalid transport config: {reason}")]
    Config { reason: String },
    #[error("the channel is unusable after an earlier error: {first}")]
    Broken { first: String },
}

/// The writing end: one sender, N receivers.
///
/// Call [`Sender::flush`] before dropping it: dropping ends the channel at once, and a shm receiver that has
/// not yet mapped a payload's (new) segment can then no longer read it.
// One per channel end: boxing the chain head (the largest variant) would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Sender {
    InProc(InProcSender),
    Shm(ShmSender),
    Bridge(bridge::BridgeSender),
    /// The head of a TCP chain to other nodes (with this node's own receivers behind a local sender).
    Chain(ChainSender),
    /// One TCP connection per receiver, across hosts (receivers connect to the sender).
    TcpFan(TcpFanSender),
    /// Tests only: an in-process sender that records what it sends ([`tap::tapped`]).
    #[cfg(test)]
    Tap(tap::TapSender),
}

/// A reading end, identified by its rank in `0..receivers`.
#[derive(Debug)]
pub enum Receiver {
    InProc(InProcReceiver),
    Shm(ShmReceiver),
    Bridge(bridge::BridgeReceiver),
    TcpFan(TcpFanReceiver),
}

/// Who a payload is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Target {
    /// Every live receiver.
    All,
    /// One receiver.
    Rank(usize),
}

/// What every sending backend provides; [`Sender`] dispatches to it.
pub(crate) trait SendBackend {
    fn receivers(&self) -> usize;
    async fn send_with<R>(
        &mut self,
        target: Target,
        len: usize,
        fill: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, TransportError>;
    async fn wait_joined(&mut self, rank: usize) -> Result<(), TransportError>;
    fn live(&self) -> Vec<usize>;
    /// Whether a gone receiver only detaches its rank (and a successor may take it).
    fn is_elastic(&self) -> bool {
        false
    }
    async fn flush(&mut self) -> Result<(), TransportError>;
    async fn recv_from(&mut self, rank: usize) -> Result<Vec<u8>, TransportError>;
    /// An upstream message from `rank` already delivered that `accept` takes, without waiting.
    fn try_recv_from(
        &mut self,
        rank: usize,
        accept: &dyn Fn(&[u8]) -> bool,
    ) -> Result<Option<Vec<u8>>, TransportError> {
        let _ = (rank, accept);
        Err(no_reports())
    }
    /// Ranks whose new receiver joined and was not taken in yet (elastic channels; others: none).
    fn joined_ranks(&mut self) -> Result<Vec<usize>, TransportError> {
        Ok(Vec::new())
    }
    /// Wait (bounded) until any of `ranks` has an upstream message queued.
    async fn wait_any_from(&mut self, ranks: &[usize]) -> Result<(), TransportError> {
        let _ = ranks;
        Err(no_reports())
    }
    /// Bound the waits of the calls that follow by `now + bound` too (`None`: the channel's timeout only).
    /// Backends without timeouts of their own (the bridge: its caller bounds them) ignore it.
    fn set_bound(&mut self, bound: Option<Duration>) {
        let _ = bound;
    }
    /// Wait (bounded) until the next payload could be published without waiting for receivers, so a caller
    /// can time out before it changes anything of its own (the patch sender's snapshot).
    async fn ready(&mut self) -> Result<(), TransportError> {
        Ok(())
    }
}

/// The error of a backend that cannot admit new receivers or address one of them.
pub(crate) fn not_elastic(what: &str) -> TransportError {
    TransportError::Config {
        reason: format!(
            "{what} admits no new receivers and sends to all of them (it is not elastic)"
        ),
    }
}

/// The error of a backend whose sender does not read receivers' reports between payloads.
fn no_reports() -> TransportError {
    TransportError::Config {
        reason:
            "this channel does not carry receivers' reports between payloads (rlsync's shm and \
                 in-process channels do)"
                .to_owned(),
    }
}

/// What every receiving backend provides; [`Receiver`] dispatches to it.
pub(crate) trait RecvBackend {
    fn rank(&self) -> usize;
    async fn recv_with<R>(&mut self, read: impl FnOnce(&[u8]) -> R) -> Result<R, TransportError>;
    async fn send(&mut self, msg: &[u8]) -> Result<(), TransportError>;
    /// Bound the waits of the calls that follow by `now + bound` too (`None`: the channel's timeout only).
    /// Backends without timeouts of their own (the bridge: its caller bounds them) ignore it.
    fn set_bound(&mut self, bound: Option<Duration>) {
        let _ = bound;
    }
}

impl Sender {
    /// Number of receivers every payload is broadcast to.
    pub fn receivers(&self) -> usize {
        match self {
            Sender::InProc(s) => s.receivers(),
            Sender::Shm(s) => s.receivers(),
            Sender::Bridge(s) => s.receivers(),
            Sender::Chain(s) => s.receivers(),
            Sender::TcpFan(s) => s.receivers(),
            #[cfg(test)]
            Sender::Tap(s) => s.receivers(),
        }
    }

    /// Write a payload of `len` bytes in place and publish it to every receiver; returns once published.
    ///
    /// The buffer starts 64-byte aligned (at page offset 2048, see `PAYLOAD_PAGE_OFFSET`), and so does what
    /// receivers see, so typed views over it work.
    /// For shm, `fill` writes straight into the shared segment (once for all receivers). The buffer is not
    /// zeroed between payloads: `fill` must write every byte it wants receivers to see. At most the channel's
    /// slot count of payloads is in flight; this waits (bounded by the timeout) for the oldest to be released.
    /// `fill` runs on the calling thread, so a large fill on a tokio worker blocks it for that long.
    pub async fn send_with<R>(
        &mut self,
        len: usize,
        fill: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, TransportError> {
        match self {
            Sender::InProc(s) => s.send_with(Target::All, len, fill).await,
            Sender::Shm(s) => s.send_with(Target::All, len, fill).await,
            Sender::Bridge(s) => s.send_with(Target::All, len, fill).await,
            Sender::Chain(s) => s.send_with(Target::All, len, fill).await,
            Sender::TcpFan(s) => s.send_with(Target::All, len, fill).await,
            #[cfg(test)]
            Sender::Tap(s) => s.send_with(Target::All, len, fill).await,
        }
    }

    /// As [`Sender::send_with`], for receiver `rank` only (a catch-up for a receiver that rejoined).
    pub(crate) async fn send_to_with<R>(
        &mut self,
        rank: usize,
        len: usize,
        fill: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, TransportError> {
        match self {
            Sender::InProc(s) => s.send_with(Target::Rank(rank), len, fill).await,
            Sender::Shm(s) => s.send_with(Target::Rank(rank), len, fill).await,
            Sender::Bridge(s) => s.send_with(Target::Rank(rank), len, fill).await,
            Sender::Chain(s) => s.send_with(Target::Rank(rank), len, fill).await,
            Sender::TcpFan(s) => s.send_with(Target::Rank(rank), len, fill).await,
            #[cfg(test)]
            Sender::Tap(s) => s.send_with(Target::Rank(rank), len, fill).await,
        }
    }

    /// Publish a copy of `payload` to receiver `rank` only.
    pub async fn send_to(&mut self, rank: usize, payload: &[u8]) -> Result<(), TransportError> {
        self.send_to_with(rank, payload.len(), |buf| buf.copy_from_slice(payload))
            .await
    }

    /// Elastic channels: wait (bounded by the timeout) until a new receiver for `rank` has joined since the
    /// last call for that rank; from then on payloads reach it. A non-elastic channel answers `Config`.
    pub async fn wait_joined(&mut self, rank: usize) -> Result<(), TransportError> {
        match self {
            Sender::InProc(s) => s.wait_joined(rank).await,
            Sender::Shm(s) => s.wait_joined(rank).await,
            Sender::Bridge(s) => s.wait_joined(rank).await,
            Sender::Chain(s) => s.wait_joined(rank).await,
            Sender::TcpFan(s) => s.wait_joined(rank).await,
            #[cfg(test)]
            Sender::Tap(s) => s.wait_joined(rank).await,
        }
    }

    /// Ranks whose receiver is attached now (all of them on a channel that is not elastic and not broken).
    pub fn live(&self) -> Vec<usize> {
        match self {
            Sender::InProc(s) => s.live(),
            Sender::Shm(s) => s.live(),
            Sender::Bridge(s) => s.live(),
            Sender::Chain(s) => s.live(),
            Sender::TcpFan(s) => s.live(),
            #[cfg(test)]
            Sender::Tap(s) => s.live(),
        }
    }

    /// Whether a gone receiver only detaches its rank, so a successor may take it (shm and in-process
    /// channels built elastic; a TCP chain whose every node's local fan-out is elastic).
    pub fn is_elastic(&self) -> bool {
        match self {
            Sender::InProc(s) => s.is_elastic(),
            Sender::Shm(s) => s.is_elastic(),
            Sender::Bridge(s) => s.is_elastic(),
            Sender::Chain(s) => s.is_elastic(),
            Sender::TcpFan(s) => s.is_elastic(),
            #[cfg(test)]
            Sender::Tap(s) => s.is_elastic(),
        }
    }

    /// Publish a copy of `payload`.
    pub async fn send(&mut self, payload: &[u8]) -> Result<(), TransportError> {
        self.send_with(payload.len(), |buf| buf.copy_from_slice(payload))
            .await
    }

    /// The next upstream message from receiver `rank` if one was already delivered and `accept` takes it,
    /// without waiting (a message `accept` refuses stays queued for [`Sender::recv_from`]). Shm and in-process
    /// channels; others answer `Config`.
    pub fn try_recv_from(
        &mut self,
        rank: usize,
        accept: &dyn Fn(&[u8]) -> bool,
    ) -> Result<Option<Vec<u8>>, TransportError> {
        match self {
            Sender::InProc(s) => s.try_recv_from(rank, accept),
            Sender::Shm(s) => s.try_recv_from(rank, accept),
            Sender::Bridge(s) => s.try_recv_from(rank, accept),
            Sender::Chain(s) => s.try_recv_from(rank, accept),
            Sender::TcpFan(s) => s.try_recv_from(rank, accept),
            #[cfg(test)]
            Sender::Tap(s) => s.try_recv_from(rank, accept),
        }
    }

    /// Ranks whose (new) receiver joined an elastic channel and was not taken in yet by
    /// [`Sender::wait_joined`], without waiting: each must be caught up (`SyncSender::rejoin`) before it follows
    /// the others. Empty on channels that are not elastic.
    pub fn joined_ranks(&mut self) -> Result<Vec<usize>, TransportError> {
        match self {
            Sender::InProc(s) => s.joined_ranks(),
            Sender::Shm(s) => s.joined_ranks(),
            Sender::Bridge(s) => s.joined_ranks(),
            Sender::Chain(s) => s.joined_ranks(),
            Sender::TcpFan(s) => s.joined_ranks(),
            #[cfg(test)]
            Sender::Tap(s) => s.joined_ranks(),
        }
    }

    /// Wait (bounded by the timeout and [`Sender::set_bound`]) until any of `ranks` has an upstream message
    /// queued: `PeerGone` naming those of them that are gone, `Timeout` naming them all. Shm and in-process
    /// channels; others answer `Config`.
    pub async fn wait_any_from(&mut self, ranks: &[usize]) -> Result<(), TransportError> {
        match self {
            Sender::InProc(s) => s.wait_any_from(ranks).await,
            Sender::Shm(s) => s.wait_any_from(ranks).await,
            Sender::Bridge(s) => s.wait_any_from(ranks).await,
            Sender::Chain(s) => s.wait_any_from(ranks).await,
            Sender::TcpFan(s) => s.wait_any_from(ranks).await,
            #[cfg(test)]
            Sender::Tap(s) => s.wait_any_from(ranks).await,
        }
    }

    /// Bound every wait of the calls that follow by `now + bound` as well as by the channel's own timeout
    /// (`None`: the channel's timeout only); a wait cut short reports `Timeout` with `bound` as its timeout
    /// and leaves the channel as the channel's own timeout would. Shm and in-process channels; the bridge's
    /// caller bounds its own waits, and a TCP chain keeps its own timeouts.
    pub fn set_bound(&mut self, bound: Option<Duration>) {
        match self {
            Sender::InProc(s) => s.set_bound(bound),
            Sender::Shm(s) => s.set_bound(bound),
            Sender::Bridge(s) => s.set_bound(bound),
            Sender::Chain(s) => s.set_bound(bound),
            Sender::TcpFan(s) => s.set_bound(bound),
            #[cfg(test)]
            Sender::Tap(s) => s.set_bound(bound),
        }
    }

    /// Wait (bounded) until the next payload can be published without waiting on receivers' releases.
    pub async fn ready(&mut self) -> Result<(), TransportError> {
        match self {
            Sender::InProc(s) => s.ready().await,
            Sender::Shm(s) => s.ready().await,
            Sender::Bridge(s) => s.ready().await,
            Sender::Chain(s) => s.ready().await,
            Sender::TcpFan(s) => s.ready().await,
            #[cfg(test)]
            Sender::Tap(s) => s.ready().await,
        }
    }

    /// Wait until every receiver has released every published payload.
    pub async fn flush(&mut self) -> Result<(), TransportError> {
        match self {
            Sender::InProc(s) => s.flush().await,
            Sender::Shm(s) => s.flush().await,
            Sender::Bridge(s) => s.flush().await,
            Sender::Chain(s) => s.flush().await,
            Sender::TcpFan(s) => s.flush().await,
            #[cfg(test)]
            Sender::Tap(s) => s.flush().await,
        }
    }

    /// The next upstream message (metadata, reports) from receiver `rank`, in the order it was sent.
    pub async fn recv_from(&mut self, rank: usize) -> Result<Vec<u8>, TransportError> {
        match self {
            Sender::InProc(s) => s.recv_from(rank).await,
            Sender::Shm(s) => s.recv_from(rank).await,
            Sender::Bridge(s) => s.recv_from(rank).await,
            Sender::Chain(s) => s.recv_from(rank).await,
            Sender::TcpFan(s) => s.recv_from(rank).await,
            #[cfg(test)]
            Sender::Tap(s) => s.recv_from(rank).await,
        }
    }
}

impl Receiver {
    /// Whether an elastic sender that had already started welcomed this receiver (a successor of a dead
    /// one): it must be caught up (`WeightSyncer::rejoin_receiver`) rather than initialised.
    pub fn joined_late(&self) -> bool {
        match self {
            Receiver::Shm(r) => r.joined_late(),
            Receiver::TcpFan(r) => r.joined_late(),
            Receiver::InProc(_) | Receiver::Bridge(_) => false,
        }
    }

    /// This receiver's rank in `0..receivers`.
    pub fn rank(&self) -> usize {
        match self {
            Receiver::InProc(r) => r.rank(),
            Receiver::Shm(r) => r.rank(),
            Receiver::Bridge(r) => r.rank(),
            Receiver::TcpFan(r) => r.rank(),
        }
    }

    /// Wait for the next payload; `read` sees it in place (zero-copy) and the payload is released when `read`
    /// returns. `read` runs on the calling thread.
    pub async fn recv_with<R>(
        &mut self,
        read: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, TransportError> {
        match self {
            Receiver::InProc(r) => r.recv_with(read).await,
            Receiver::Shm(r) => r.recv_with(read).await,
            Receiver::Bridge(r) => r.recv_with(read).await,
            Receiver::TcpFan(r) => r.recv_with(read).await,
        }
    }

    /// Bound the waits of the calls that follow by `now + bound` as well as by the channel's own timeout
    /// (`None`: the channel's timeout only). A payload wait cut short consumes nothing: waiting again is fine.
    pub fn set_bound(&mut self, bound: Option<Duration>) {
        match self {
            Receiver::InProc(r) => r.set_bound(bound),
            Receiver::Shm(r) => r.set_bound(bound),
            Receiver::Bridge(r) => r.set_bound(bound),
            Receiver::TcpFan(r) => r.set_bound(bound),
        }
    }

    /// Send one small upstream message to the sender.
    pub async fn send(&mut self, msg: &[u8]) -> Result<(), TransportError> {
        match self {
            Receiver::InProc(r) => r.send(msg).await,
            Receiver::Shm(r) => r.send(msg).await,
            Receiver::Bridge(r) => r.send(msg).await,
            Receiver::TcpFan(r) => r.send(msg).await,
        }
    }
}

impl From<InProcSender> for Sender {
    fn from(s: InProcSender) -> Self {
        Sender::InProc(s)
    }
}

impl From<ShmSender> for Sender {
    fn from(s: ShmSender) -> Self {
        Sender::Shm(s)
    }
}

impl From<ChainSender> for Sender {
    fn from(s: ChainSender) -> Self {
        Sender::Chain(s)
    }
}

impl From<InProcReceiver> for Receiver {
    fn from(r: InProcReceiver) -> Self {
        Receiver::InProc(r)
    }
}

impl From<ShmReceiver> for Receiver {
    fn from(r: ShmReceiver) -> Self {
        Receiver::Shm(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send<T: Send>(_: &T) {}

    /// Callers spawn sync work on tokio tasks, so every channel future must be `Send` (when the closure is).
    #[test]
    fn channel_futures_are_send() {
        let (mut tx, mut rxs) = inproc_channel(1);
        assert_send(&tx.send_with(4, |b| b.len()));
        assert_send(&tx.send(b"x"));
        assert_send(&tx.flush());
        assert_send(&tx.recv_from(0));
        if let Some(rx) = rxs.first_mut() {
            assert_send(&rx.recv_with(|b| b.len()));
            assert_send(&rx.send(b"x"));
        }
        assert_send(&tx);
        assert_send(&rxs);
        assert_send(&ShmSender::bind(ShmConfig::default()));
        assert_send(&ShmReceiver::connect(
            std::path::Path::new("x"),
            0,
            DEFAULT_TIMEOUT,
        ));
    }

    #[test]
    fn errors_name_the_peer() {
        let check = |err: TransportError, expect: &str| assert_eq!(err.to_string(), expect);
        check(
            TransportError::Timeout {
                op: "flushing",
                peer: Peer::Receivers(vec![0, 2]),
                timeout: Duration::from_secs(3),
            },
            "timed out after 3s while flushing, waiting on receiver ranks [0, 2]",
        );
        check(
            TransportError::PeerGone {
                op: "sending a payload",
                peer: Peer::Receiver(1),
            },
            "receiver rank 1 is gone (disconnected) while sending a payload",
        );
        check(
            TransportError::PeerGone {
                op: "waiting for a payload",
                peer: Peer::Sender,
            },
            "the sender is gone (disconnected) while waiting for a payload",
        );
    }

    #[tokio::test]
    async fn send_copies_the_payload() {
        let (mut tx, mut rxs) = inproc_channel(2);
        tx.send(b"weights").await.unwrap();
        for rx in rxs.iter_mut() {
            assert_eq!(rx.recv_with(<[u8]>::to_vec).await.unwrap(), b"weights");
        }
        tx.flush().await.unwrap();
    }
}
