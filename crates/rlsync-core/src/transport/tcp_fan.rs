//! TCP fan-out across hosts: one sender, N receivers that each connect to it over TCP (the Python API's
//! `tcp_sender` / `tcp_receiver`; the runtime's node-to-node chain, whose sender connects to relays, is `tcp.rs`).
//!
//! Set-up, once per connection: the receiver connects to the sender's listening address (retrying until it
//! listens), both prove the run token (`protocol::auth`, magic `RLSYNCF1`: a chain's or control plane's proof is
//! no proof here), the receiver says `Hello` with its rank, and once all N ranks joined the sender answers each
//! with `Welcome` (a bad or duplicate rank gets `Reject` and does not count; a peer without the token is refused,
//! logged, and the listener keeps waiting). Frames are the shm channel's control frames (`transport/frame.rs`):
//! downstream `Publish {seq, len}` followed by the payload in chunk frames of at most [`CHUNK`] bytes, upstream
//! `Released {seq}` and `Message` (metadata, reports). A receiver reads payloads off the socket as they come
//! (at most `slots` are unreleased, the sender's in-flight bound), so a sender never waits on a receiver that
//! is not applying yet unless every slot is taken; bookkeeping, waits, timeouts and dead peers are the shared
//! fan-out's (`fanout.rs`): a receiver whose connection ends is named at once, a silent one after the timeout.
//!
//! An *elastic* channel ([`TcpFanConfig::elastic`]) keeps listening for the sender's lifetime, as the elastic shm
//! channel does: it may start once `wait_for` receivers joined ([`TcpFanListener::accept_waiting_for`]), a
//! receiver that goes away (or cannot take a payload in time) is detached instead of breaking the channel, and a
//! receiver that connects later for a rank (a restart, or a rank not there yet) proves the token, is welcomed
//! as a late joiner at once and admitted once its predecessor is known to be gone ([`Sender::wait_joined`]);
//! the syncer then catches it up (`SyncSender::rejoin_joined`). The listening socket closes with the sender.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;

use super::fanout::{Event, EventTx, Fanout, Origin};
use super::frame::{Down, MAX_FRAME, Up, VERSION};
use super::inproc::AlignedBuf;
use super::{
    DEFAULT_SLOTS, DEFAULT_TIMEOUT, Peer, Receiver, RecvBackend, SendBackend, Sender, Target,
    TransportError,
};
use crate::bytes::Writer;
use crate::protocol::auth::{self, AuthError};
use crate::protocol::frame::{FrameReader, PREFIX_LEN, ReadError, check_len};

/// The greeting of this protocol in the token proof.
const MAGIC: &[u8; 8] = b"RLSYNCF1";
/// Largest chunk frame of a payload.
pub(crate) const CHUNK: usize = 16 << 20;
/// Pause between connection attempts while the sender is not listening yet.
const CONNECT_RETRY: Duration = Duration::from_millis(50);

const OP_SEND: &str = "sending a payload";
const OP_FLUSH: &str = "flushing";
const OP_RECV_FROM: &str = "receiving an upstream message";
const OP_REPORTS: &str = "waiting for receivers' reports";
const OP_JOIN: &str = "waiting for a receiver to rejoin";
const OP_SLOT: &str = "waiting for a free slot";
const RECV_OP: &str = "waiting for a payload";

/// The sender's settings.
#[derive(Clone)]
pub struct TcpFanConfig {
    /// Address to listen on (`host:port`; port 0 picks one, see [`TcpFanListener::local_addr`]).
    pub bind: String,
    pub receivers: usize,
    /// The run's secret; every receiver must hold the same one.
    pub token: Vec<u8>,
    /// This end's name in peers' logs and errors.
    pub name: String,
    /// Bound on every wait (joining included).
    pub timeout: Duration,
    /// Payloads in flight at once.
    pub slots: usize,
    /// Keep listening after the initial join: a gone receiver is detached and a new one may take its rank.
    pub elastic: bool,
}

impl Default for TcpFanConfig {
    fn default() -> Self {
        TcpFanConfig {
            bind: "127.0.0.1:0".into(),
            receivers: 1,
            token: Vec::new(),
            name: "rlsync sender".into(),
            timeout: DEFAULT_TIMEOUT,
            slots: DEFAULT_SLOTS,
            elastic: false,
        }
    }
}

impl std::fmt::Debug for TcpFanConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpFanConfig")
            .field("bind", &self.bind)
            .field("receivers", &self.receivers)
            .field("timeout", &self.timeout)
            .field("elastic", &self.elastic)
            .finish_non_exhaustive()
    }
}

fn protocol(peer: Peer, reason: impl std::fmt::Display) -> TransportError {
    TransportError::Protocol {
        peer,
        reason: reason.to_string(),
    }
}

fn auth_err(e: AuthError) -> TransportError {
    match e {
        AuthError::Closed { op, .. } => TransportError::PeerGone {
            op,
            peer: Peer::Sender,
        },
        AuthError::Io { op, source, .. } => TransportError::Io { op, source },
        other => TransportError::Auth {
            peer: "the sender".into(),
            reason: other.to_string(),
        },
    }
}

fn io_error(op: &'static str, peer: Peer, e: std::io::Error) -> TransportError {
    match e.kind() {
        std::io::ErrorKind::BrokenPipe
        | std::io::ErrorKind::ConnectionReset
        | std::io::ErrorKind::UnexpectedEof => TransportError::PeerGone { op, peer },
        _ => TransportError::Io { op, source: e },
    }
}

/// Write `parts` back to back, bounded by `deadline` (`timeout` is what a timeout reports).
async fn write_parts(
    writer: &mut OwnedWriteHalf,
    parts: &[&[u8]],
    deadline: Instant,
    timeout: Duration,
    op: &'static str,
    peer: Peer,
) -> Result<(), TransportError> {
    let write = async {
        for part in parts {
            writer.write_all(part).await?;
        }
        Ok::<(), std::io::Error>(())
    };
    match tokio::time::timeout_at(deadline, write).await {
        Err(_) => Err(TransportError::Timeout { op, peer, timeout }),
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(io_error(op, peer, e)),
    }
}

/// A connection that proved the token and said hello with a rank in range, before its welcome.
struct Joined {
    rank: usize,
    reader: FrameReader<OwnedReadHalf>,
    writer: OwnedWriteHalf,
}

/// Hellos being read, concurrently so a silent connection cannot hold up the others.
type Hellos = JoinSet<Result<Joined, TransportError>>;

/// Elastic channels: connections of receivers that joined late, by rank, until the sender attaches them.
type Mailbox = super::fanout::Mailbox<Joined>;

/// A bound listener: where receivers connect, before they all joined.
pub struct TcpFanListener {
    listener: TcpListener,
    cfg: TcpFanConfig,
}

impl TcpFanListener {
    /// The address receivers connect to (the bound port when `bind` asked for port 0).
    pub fn local_addr(&self) -> Result<SocketAddr, TransportError> {
        self.listener
            .local_addr()
            .map_err(|source| TransportError::Io {
                op: "reading the listening address",
                source,
            })
    }

    /// Accept until all receivers joined (bounded by the timeout: `Timeout` naming the missing ranks).
    pub async fn accept(self) -> Result<Sender, TransportError> {
        let all = self.cfg.receivers;
        self.accept_waiting_for(all).await
    }

    /// As [`TcpFanListener::accept`], returning once `wait_for` of the receivers joined (elastic channels only;
    /// `accept` waits for all): the ranks still missing start detached and join later like the successor of a
    /// gone receiver (welcomed as late joiners, taken in by [`Sender::wait_joined`] / [`Sender::joined_ranks`]).
    pub async fn accept_waiting_for(self, wait_for: usize) -> Result<Sender, TransportError> {
        let TcpFanListener { listener, cfg } = self;
        let n = cfg.receivers;
        if wait_for > n || (!cfg.elastic && wait_for != n) {
            return Err(TransportError::Config {
                reason: format!(
                    "waiting for {wait_for} of {n} receivers needs an elastic channel and at most that many"
                ),
            });
        }
        let deadline = Instant::now() + cfg.timeout;
        let mut joined: Vec<Option<Joined>> = (0..n).map(|_| None).collect();
        let mut hellos = Hellos::new();
        while joined.iter().flatten().count() < wait_for {
            tokio::select! {
                accepted = tokio::time::timeout_at(deadline, listener.accept()) => match accepted {
                    Err(_) => {
                        let missing = joined.iter().enumerate().filter(|(_, j)| j.is_none()).map(|(r, _)| r).collect();
                        return Err(TransportError::Timeout { op: "accepting receivers", peer: Peer::Receivers(missing), timeout: cfg.timeout });
                    }
                    Ok(Ok((stream, addr))) => spawn_hello(&mut hellos, stream, addr, &cfg, deadline),
                    Ok(Err(e)) => tracing::warn!(error = %e, "accepting a receiver failed"),
                },
                Some(done) = hellos.join_next(), if !hellos.is_empty() => {
                    let Some(mut j) = hello_done(done) else { continue };
                    let Some(entry) = joined.get_mut(j.rank) else { continue };
                    match entry {
                        None => *entry = Some(j),
                        // Elastic: a second hello for a rank comes from a restarted receiver (the first one
                        // went away before the sender started); the newest connection takes the rank.
                        Some(_) if cfg.elastic => {
                            tracing::info!(rank = j.rank, "a receiver rejoined before the sender started; the newest takes the rank");
                            *entry = Some(j);
                        }
                        Some(_) => {
                            let reason = format!("rank {} already joined", j.rank);
                            refuse(&mut j.writer, j.rank, reason, deadline, cfg.timeout).await;
                        }
                    }
                }
            }
        }
        let (event_tx, event_rx) = mpsc::unbounded_channel();
        let welcome = |late: bool| {
            Down::Welcome {
                version: VERSION,
                receivers: n as u32,
                slots: cfg.slots as u32,
                late,
            }
            .encode()
            .map_err(|e| protocol(Peer::Sender, e))
        };
        let first = welcome(false)?;
        let mut writers = Vec::with_capacity(n);
        let mut readers = Vec::with_capacity(n);
        let mut detached = Vec::new();
        for (rank, j) in joined.into_iter().enumerate() {
            let Some(mut j) = j else {
                // Not joined yet (elastic, `wait_for`): starts detached, joins late.
                detached.push(rank);
                writers.push(None);
                readers.push(None);
                continue;
            };
            let welcomed = write_parts(
                &mut j.writer,
                &[&first],
                deadline,
                cfg.timeout,
                "welcoming a receiver",
                Peer::Receiver(rank),
            )
            .await;
            match welcomed {
                Ok(()) => {}
                // Elastic: a receiver that went away since its hello starts detached; a successor may take it.
                Err(e) if cfg.elastic => {
                    tracing::warn!(rank, error = %crate::error_chain(&e), "a receiver vanished before its welcome; detached");
                    detached.push(rank);
                    writers.push(None);
                    readers.push(None);
                    continue;
                }
                Err(e) => return Err(e),
            }
            writers.push(Some(j.writer));
            readers.push(Some(spawn_reader(
                Origin::first(rank),
                j.reader,
                event_tx.clone(),
            )));
        }
        let mut fanout = Fanout::new(n, cfg.slots.max(1), cfg.timeout, event_rx);
        let late = if cfg.elastic {
            fanout = fanout.elastic();
            for rank in detached {
                fanout.detach(rank);
            }
            let mailbox = Mailbox::new(n);
            let acceptor = spawn_acceptor(
                listener,
                hellos,
                cfg.clone(),
                welcome(true)?,
                mailbox.clone(),
                event_tx.clone(),
            );
            Some(Late {
                mailbox,
                acceptor,
                fresh: Vec::new(),
                events: event_tx,
            })
        } else {
            // Nobody else may join: the listening socket closes now.
            drop(listener);
            None
        };
        Ok(Sender::TcpFan(TcpFanSender {
            fanout,
            writers,
            readers,
            broken: None,
            late,
        }))
    }
}

/// Read a new connection's token proof and hello in `hellos` (bounded by `deadline`).
fn spawn_hello(
    hellos: &mut Hellos,
    stream: TcpStream,
    addr: SocketAddr,
    cfg: &TcpFanConfig,
    deadline: Instant,
) {
    let cfg = cfg.clone();
    hellos.spawn(async move {
        tokio::time::timeout_at(deadline, hello(stream, addr, &cfg, deadline))
            .await
            .unwrap_or_else(|_| {
                Err(TransportError::Timeout {
                    op: "reading a hello",
                    peer: Peer::Node(addr.to_string()),
                    timeout: cfg.timeout,
                })
            })
    });
}

/// A finished hello's connection, or `None` after logging why there is none (the connection is dropped).
fn hello_done(
    done: Result<Result<Joined, TransportError>, tokio::task::JoinError>,
) -> Option<Joined> {
    match done {
        Ok(Ok(j)) => Some(j),
        Ok(Err(e)) => {
            tracing::warn!(error = %crate::error_chain(&e), "a connection was refused");
            None
        }
        Err(e) => {
            tracing::warn!(error = %e, "a hello task failed");
            None
        }
    }
}

/// Tell a receiver why it is refused (best effort) before its connection is dropped.
async fn refuse(
    writer: &mut OwnedWriteHalf,
    rank: usize,
    reason: String,
    deadline: Instant,
    timeout: Duration,
) {
    tracing::warn!(rank, %reason, "refused a receiver");
    if let Ok(frame) = (Down::Reject { reason }).encode() {
        let _ = write_parts(
            writer,
            &[&frame],
            deadline,
            timeout,
            "refusing a receiver",
            Peer::Receiver(rank),
        )
        .await;
    }
}

/// Elastic channels: accept receivers for the sender's lifetime (each proving the token as the first ones did),
/// welcome each at once as a late joiner and hand its connection over through `mailbox` and a `Joined` event.
fn spawn_acceptor(
    listener: TcpListener,
    mut hellos: Hellos,
    cfg: TcpFanConfig,
    welcome: Vec<u8>,
    mailbox: Mailbox,
    events: EventTx,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((stream, addr)) => spawn_hello(&mut hellos, stream, addr, &cfg, Instant::now() + cfg.timeout),
                    Err(e) => {
                        // Mostly transient (a connection aborted, out of descriptors): pause, then go on.
                        tracing::warn!(error = %e, "accepting a late receiver failed");
                        tokio::time::sleep(CONNECT_RETRY).await;
                    }
                },
                Some(done) = hellos.join_next(), if !hellos.is_empty() => {
                    let Some(mut j) = hello_done(done) else { continue };
                    let rank = j.rank;
                    let d = Instant::now() + cfg.timeout;
                    if let Err(e) = write_parts(&mut j.writer, &[&welcome], d, cfg.timeout, "welcoming a receiver", Peer::Receiver(rank)).await {
                        tracing::warn!(rank, error = %crate::error_chain(&e), "a late receiver went away before its welcome");
                        continue;
                    }
                    tracing::info!(rank, "a receiver joined late");
                    // A joiner not attached yet is replaced: its connection closes, it fails and may retry.
                    let Some(join) = mailbox.put(rank, j) else { continue };
                    if events.send((Origin { rank, join }, Event::Joined)).is_err() {
                        return;
                    }
                }
            }
        }
    })
}

/// One connection's set-up up to its hello: the token proof, then the rank it asks for (one out of range is
/// told so, by `deadline`, and refused).
async fn hello(
    mut stream: TcpStream,
    addr: SocketAddr,
    cfg: &TcpFanConfig,
    deadline: Instant,
) -> Result<Joined, TransportError> {
    let _ = stream.set_nodelay(true);
    let peer = auth::server(&mut stream, MAGIC, &cfg.token, &cfg.name, &addr.to_string())
        .await
        .map_err(|e| TransportError::Auth {
            peer: addr.to_string(),
            reason: crate::error_chain(&e),
        })?;
    let (read, mut writer) = stream.into_split();
    let mut reader = FrameReader::new(read, MAX_FRAME);
    let frame = reader
        .next()
        .await
        .map_err(|e| protocol(Peer::Node(peer.clone()), crate::error_chain(&e)))?
        .ok_or(TransportError::PeerGone {
            op: "reading a hello",
            peer: Peer::Node(peer.clone()),
        })?;
    match Up::decode(&frame).map_err(|e| protocol(Peer::Node(peer.clone()), e))? {
        Up::Hello { version, rank } if version == VERSION => {
            let rank = rank as usize;
            let receivers = cfg.receivers;
            if rank >= receivers {
                let reason =
                    format!("rank {rank} is out of range for a channel with {receivers} receivers");
                refuse(&mut writer, rank, reason, deadline, cfg.timeout).await;
                return Err(TransportError::NoSuchRank { rank, receivers });
            }
            Ok(Joined {
                rank,
                reader,
                writer,
            })
        }
        Up::Hello { version, .. } => Err(protocol(
            Peer::Node(peer),
            format!("protocol version {version} is not ours ({VERSION})"),
        )),
        other => Err(protocol(
            Peer::Node(peer),
            format!("expected a hello, got {other:?}"),
        )),
    }
}

/// Forward one receiver's upstream frames as events until its connection ends.
fn spawn_reader(
    origin: Origin,
    mut reader: FrameReader<OwnedReadHalf>,
    events: EventTx,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let event = match reader.next().await {
                Ok(Some(frame)) => match Up::decode(&frame) {
                    Ok(Up::Released { seq }) => Event::Released { seq },
                    Ok(Up::Message(msg)) => Event::Message(msg),
                    Ok(other) => Event::Violation(format!("unexpected {other:?}")),
                    Err(e) => Event::Violation(crate::error_chain(&e)),
                },
                Ok(None) => Event::Gone,
                Err(e) => {
                    tracing::debug!(rank = origin.rank, error = %crate::error_chain(&e), "receiver connection failed");
                    Event::Gone
                }
            };
            let last = matches!(event, Event::Gone | Event::Violation(_));
            if events.send((origin, event)).is_err() || last {
                return;
            }
        }
    })
}

/// The sending end: one TCP connection per receiver.
pub struct TcpFanSender {
    fanout: Fanout,
    /// `None`: the rank's receiver is gone (elastic) and no successor is attached yet.
    writers: Vec<Option<OwnedWriteHalf>>,
    readers: Vec<Option<JoinHandle<()>>>,
    broken: Option<String>,
    /// Elastic channels: the late joiners' connections and the task accepting them.
    late: Option<Late>,
}

/// What an elastic sender keeps for late joiners.
struct Late {
    mailbox: Mailbox,
    /// Owns the listening socket: it closes when the task is aborted (the sender dropped).
    acceptor: JoinHandle<()>,
    /// Ranks attached since the caller last waited for them.
    fresh: Vec<usize>,
    events: EventTx,
}

impl std::fmt::Debug for TcpFanSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpFanSender")
            .field("receivers", &self.writers.len())
            .field("elastic", &self.late.is_some())
            .finish_non_exhaustive()
    }
}

/// Write payload `seq`'s `Publish` frame and its chunks to one receiver, each write bounded on its own (a large
/// payload on a slow link takes many) and by the caller's bound.
async fn write_payload(
    writer: &mut OwnedWriteHalf,
    fanout: &Fanout,
    publish: &[u8],
    bytes: &[u8],
    rank: usize,
) -> Result<(), TransportError> {
    let deadline = fanout.deadline();
    let timeout = fanout.timeout_at(deadline);
    write_parts(
        writer,
        &[publish],
        deadline,
        timeout,
        OP_SEND,
        Peer::Receiver(rank),
    )
    .await?;
    for chunk in bytes.chunks(CHUNK) {
        // The chunk is a frame of the crate's one framing, its prefix written apart (no copy of it).
        let len = check_len(chunk.len(), CHUNK).map_err(|e| protocol(Peer::Sender, e))?;
        let mut prefix = Writer::with_capacity(PREFIX_LEN);
        prefix.u32(len);
        let deadline = fanout.deadline();
        let timeout = fanout.timeout_at(deadline);
        write_parts(
            writer,
            &[prefix.as_slice(), chunk],
            deadline,
            timeout,
            OP_SEND,
            Peer::Receiver(rank),
        )
        .await?;
    }
    Ok(())
}

impl TcpFanSender {
    /// Listen on `cfg.bind`; [`TcpFanListener::accept`] then waits for the receivers.
    pub async fn listen(cfg: TcpFanConfig) -> Result<TcpFanListener, TransportError> {
        if cfg.receivers == 0 {
            return Err(TransportError::Config {
                reason: "a TCP fan-out needs at least one receiver".into(),
            });
        }
        let listener = TcpListener::bind(&cfg.bind)
            .await
            .map_err(|source| TransportError::Io {
                op: "binding the listening address",
                source,
            })?;
        Ok(TcpFanListener { listener, cfg })
    }

    /// Listen on `cfg.bind` and wait until every receiver joined.
    pub async fn bind(cfg: TcpFanConfig) -> Result<Sender, TransportError> {
        Self::listen(cfg).await?.accept().await
    }

    fn check_usable(&self) -> Result<(), TransportError> {
        match &self.broken {
            Some(first) => Err(TransportError::Broken {
                first: first.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Errors after which the channel is consistent: waits that ran out before anything was written, caller
    /// mistakes, and on an elastic channel a gone receiver (only its rank is detached). Everything else (a
    /// failed or half-done write on a channel that is not elastic, a gone receiver there) breaks it.
    fn settle<T>(&mut self, result: Result<T, TransportError>) -> Result<T, TransportError> {
        match result {
            Err(err) => {
                let recoverable = match &err {
                    TransportError::Timeout { op, .. } => {
                        [OP_FLUSH, OP_RECV_FROM, OP_REPORTS, OP_JOIN, OP_SLOT].contains(op)
                    }
                    TransportError::NoSuchRank { .. } | TransportError::TooLarge { .. } => true,
                    TransportError::PeerGone { peer, .. } => {
                        self.fanout.is_elastic() && *peer != Peer::Sender
                    }
                    _ => false,
                };
                if !recoverable && self.broken.is_none() {
                    self.broken = Some(crate::error_chain(&err));
                }
                Err(err)
            }
            ok => ok,
        }
    }

    /// Let `rank`'s receiver go (elastic): its connection closes, and a successor may take the rank.
    fn detach(&mut self, rank: usize) {
        self.fanout.detach(rank);
        if let Some(w) = self.writers.get_mut(rank) {
            *w = None;
        }
        if let Some(task) = self.readers.get_mut(rank).and_then(Option::take) {
            task.abort();
        }
    }

    /// Attach the connections of receivers the fanout admitted (elastic channels).
    fn attach_admitted(&mut self) {
        let admitted = self.fanout.take_admitted();
        let Some(late) = self.late.as_mut() else {
            return;
        };
        for rank in admitted {
            let Some((join, j)) = late.mailbox.take(rank) else {
                // Admitted without a connection (the fanout's join numbers rule it out): not live.
                self.fanout.detach(rank);
                continue;
            };
            self.fanout.attached(rank, join);
            if let Some(w) = self.writers.get_mut(rank) {
                *w = Some(j.writer);
            }
            let reader = spawn_reader(Origin { rank, join }, j.reader, late.events.clone());
            if let Some(old) = self.readers.get_mut(rank).and_then(|t| t.replace(reader)) {
                old.abort();
            }
            late.fresh.retain(|&r| r != rank);
            late.fresh.push(rank);
        }
    }

    /// Take events and attach joiners; close the connections of detached ranks.
    fn housekeep(&mut self) -> Result<(), TransportError> {
        let polled = self.fanout.poll_events();
        if self.fanout.is_elastic() {
            self.attach_admitted();
            for rank in 0..self.writers.len() {
                if self.fanout.is_gone(rank) && self.writers.get(rank).is_some_and(Option::is_some)
                {
                    self.detach(rank);
                }
            }
        }
        polled
    }

    async fn try_wait_joined(&mut self, rank: usize) -> Result<(), TransportError> {
        if self.late.is_none() {
            return Err(super::not_elastic("a TCP fan-out"));
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
            if let Some(late) = self.late.as_mut()
                && let Some(i) = late.fresh.iter().position(|&r| r == rank)
            {
                late.fresh.remove(i);
                return Ok(());
            }
            self.fanout
                .wait_event(deadline, OP_JOIN, vec![rank])
                .await?;
        }
    }

    async fn try_send_with<R>(
        &mut self,
        target: Target,
        len: usize,
        fill: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, TransportError> {
        self.housekeep()?;
        self.fanout.require_all_alive(OP_SEND)?;
        // A late joiner sees only its own payloads until the caller took it in (`wait_joined`): it must be
        // caught up before it can follow the others.
        let fresh = self
            .late
            .as_ref()
            .map(|l| l.fresh.as_slice())
            .unwrap_or(&[]);
        let targets = self.fanout.targets(target, fresh, OP_SEND)?;
        let (seq, slot) = self.fanout.next();
        self.fanout.wait_slot_free(slot, OP_SLOT).await?;
        let mut buf = AlignedBuf::with_len(len)?;
        let out = fill(buf.bytes_mut(len));
        let publish = Down::Publish {
            seq,
            slot: slot as u32,
            len: len as u64,
            segment: None,
        }
        .encode()
        .map_err(|e| protocol(Peer::Sender, e))?;
        let bytes = buf.bytes(len);
        let mut reached = Vec::with_capacity(targets.len());
        for &rank in &targets {
            // Elastic: a target may have gone while this waited for the slot (not elastic: writing to it
            // fails, naming it).
            if self.fanout.is_elastic() && self.fanout.is_gone(rank) {
                continue;
            }
            let Some(writer) = self.writers.get_mut(rank).and_then(Option::as_mut) else {
                continue;
            };
            match write_payload(writer, &self.fanout, &publish, bytes, rank).await {
                Ok(()) => reached.push(rank),
                // Elastic: a receiver that is gone, or cannot take the payload in time (its connection now
                // holds part of it), is detached; the others get the payload.
                Err(e) if self.fanout.is_elastic() => {
                    tracing::warn!(rank, error = %crate::error_chain(&e), "a receiver could not take a payload; detached");
                    self.detach(rank);
                }
                Err(e) => return Err(e),
            }
        }
        self.fanout.published_to(seq, slot, &reached);
        if let Target::Rank(rank) = target
            && reached.is_empty()
        {
            return Err(TransportError::PeerGone {
                op: OP_SEND,
                peer: Peer::Receiver(rank),
            });
        }
        Ok(out)
    }
}

// `check_usable`, `housekeep`, `settle`, `try_send_with`, `try_wait_joined` above; the rest is shared.
super::fanout::fan_send_backend!(TcpFanSender, OP_SLOT);

impl Drop for TcpFanSender {
    fn drop(&mut self) {
        for task in self.readers.iter().flatten() {
            task.abort();
        }
        if let Some(late) = &self.late {
            late.acceptor.abort();
        }
    }
}

/// One payload read off the connection.
type Inbound = Result<(u64, AlignedBuf, usize), TransportError>;

/// A receiving end: its payloads are read off the connection by a task as they come.
pub struct TcpFanReceiver {
    rank: usize,
    timeout: Duration,
    bound: Option<(Instant, Duration)>,
    inbox: mpsc::Receiver<Inbound>,
    writer: OwnedWriteHalf,
    task: JoinHandle<()>,
    broken: Option<String>,
    /// Welcomed by an elastic sender that had already started (see [`TcpFanReceiver::joined_late`]).
    late: bool,
}

impl std::fmt::Debug for TcpFanReceiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpFanReceiver")
            .field("rank", &self.rank)
            .finish_non_exhaustive()
    }
}

impl TcpFanReceiver {
    /// Connect to the sender at `addr` as `rank` (retrying while it does not listen yet), prove the token, and
    /// wait (bounded by `timeout`) until the sender welcomed every receiver.
    pub async fn connect(
        addr: &str,
        rank: usize,
        token: &[u8],
        name: &str,
        timeout: Duration,
    ) -> Result<Receiver, TransportError> {
        const OP: &str = "joining the sender";
        let deadline = Instant::now() + timeout;
        let timed_out = || TransportError::Timeout {
            op: OP,
            peer: Peer::Sender,
            timeout,
        };
        let wire_rank = u32::try_from(rank).map_err(|_| TransportError::NoSuchRank {
            rank,
            receivers: u32::MAX as usize,
        })?;
        let mut stream = loop {
            match tokio::time::timeout_at(deadline, TcpStream::connect(addr)).await {
                Err(_) => return Err(timed_out()),
                Ok(Ok(s)) => break s,
                Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                    if Instant::now() + CONNECT_RETRY >= deadline {
                        return Err(timed_out());
                    }
                    tokio::time::sleep(CONNECT_RETRY).await;
                }
                Ok(Err(source)) => {
                    return Err(TransportError::Io {
                        op: "connecting",
                        source,
                    });
                }
            }
        };
        let _ = stream.set_nodelay(true);
        tokio::time::timeout_at(
            deadline,
            auth::client(&mut stream, MAGIC, token, name, addr),
        )
        .await
        .map_err(|_| timed_out())?
        .map_err(auth_err)?;
        let (read, mut writer) = stream.into_split();
        let mut reader = FrameReader::new(read, MAX_FRAME.max(CHUNK));
        let hello = Up::Hello {
            version: VERSION,
            rank: wire_rank,
        }
        .encode()
        .map_err(|e| protocol(Peer::Sender, e))?;
        write_parts(&mut writer, &[&hello], deadline, timeout, OP, Peer::Sender).await?;
        let frame = match tokio::time::timeout_at(deadline, reader.next()).await {
            Err(_) => return Err(timed_out()),
            Ok(Ok(Some(frame))) => frame,
            Ok(Ok(None)) => {
                return Err(TransportError::PeerGone {
                    op: OP,
                    peer: Peer::Sender,
                });
            }
            Ok(Err(e)) => return Err(read_error(OP, e)),
        };
        let (slots, late) = match Down::decode(&frame).map_err(|e| protocol(Peer::Sender, e))? {
            Down::Welcome {
                version,
                receivers,
                slots,
                late,
            } => {
                if version != VERSION {
                    return Err(protocol(
                        Peer::Sender,
                        format!("protocol version {version} is not ours ({VERSION})"),
                    ));
                }
                if rank >= receivers as usize {
                    return Err(TransportError::NoSuchRank {
                        rank,
                        receivers: receivers as usize,
                    });
                }
                (slots as usize, late)
            }
            Down::Reject { reason } => return Err(TransportError::Rejected { reason }),
            other => {
                return Err(protocol(
                    Peer::Sender,
                    format!("expected a welcome, got {other:?}"),
                ));
            }
        };
        let (tx, inbox) = mpsc::channel(slots.max(1));
        let task = tokio::spawn(read_payloads(reader, tx));
        Ok(Receiver::TcpFan(TcpFanReceiver {
            rank,
            timeout,
            bound: None,
            inbox,
            writer,
            task,
            broken: None,
            late,
        }))
    }

    /// Whether an elastic sender that had already started welcomed this receiver (a late joiner, or the
    /// successor of a gone one): the syncer must rejoin (`WeightSyncer::rejoin_receiver`), not init.
    pub fn joined_late(&self) -> bool {
        self.late
    }
}

fn read_error(op: &'static str, err: ReadError) -> TransportError {
    match err {
        ReadError::Io(e) => io_error(op, Peer::Sender, e),
        ReadError::TooLong(e) => protocol(Peer::Sender, e),
    }
}

/// Read payloads (a `Publish` frame, then its chunks) off the connection into `tx` until it ends; the end or a
/// failure is the last item.
async fn read_payloads(mut reader: FrameReader<OwnedReadHalf>, tx: mpsc::Sender<Inbound>) {
    let gone = || TransportError::PeerGone {
        op: RECV_OP,
        peer: Peer::Sender,
    };
    loop {
        let item = async {
            let frame = reader
                .next()
                .await
                .map_err(|e| read_error(RECV_OP, e))?
                .ok_or_else(gone)?;
            let (seq, len) = match Down::decode(&frame).map_err(|e| protocol(Peer::Sender, e))? {
                Down::Publish { seq, len, .. } => (seq, len),
                other => {
                    return Err(protocol(
                        Peer::Sender,
                        format!("expected a payload, got {other:?}"),
                    ));
                }
            };
            let len = usize::try_from(len)
                .map_err(|_| protocol(Peer::Sender, "payload length does not fit in memory"))?;
            let mut buf = AlignedBuf::with_len(len)?;
            let mut at = 0;
            while at < len {
                let chunk = reader
                    .next()
                    .await
                    .map_err(|e| read_error(RECV_OP, e))?
                    .ok_or_else(gone)?;
                let end = at + chunk.len();
                let dst = buf.bytes_mut(len).get_mut(at..end).ok_or_else(|| {
                    protocol(Peer::Sender, format!("payload {seq} overruns {len} bytes"))
                })?;
                dst.copy_from_slice(&chunk);
                at = end;
            }
            Ok((seq, buf, len))
        }
        .await;
        let last = item.is_err();
        if tx.send(item).await.is_err() || last {
            return;
        }
    }
}

impl TcpFanReceiver {
    fn fail(&mut self, err: TransportError) -> TransportError {
        if self.broken.is_none() {
            self.broken = Some(crate::error_chain(&err));
        }
        err
    }
}

impl RecvBackend for TcpFanReceiver {
    fn rank(&self) -> usize {
        self.rank
    }

    async fn recv_with<R>(&mut self, read: impl FnOnce(&[u8]) -> R) -> Result<R, TransportError> {
        if let Some(first) = &self.broken {
            return Err(TransportError::Broken {
                first: first.clone(),
            });
        }
        let (deadline, timeout) = super::wait_deadline(self.timeout, self.bound);
        // Cancel-safe (an mpsc receive): a wait that runs out consumes nothing.
        let item = match tokio::time::timeout_at(deadline, self.inbox.recv()).await {
            Err(_) => {
                return Err(TransportError::Timeout {
                    op: RECV_OP,
                    peer: Peer::Sender,
                    timeout,
                });
            }
            Ok(None) => Err(TransportError::PeerGone {
                op: RECV_OP,
                peer: Peer::Sender,
            }),
            Ok(Some(item)) => item,
        };
        let (seq, buf, len) = item.map_err(|e| self.fail(e))?;
        let out = read(buf.bytes(len));
        drop(buf);
        let released = Up::Released { seq }
            .encode()
            .map_err(|e| protocol(Peer::Sender, e))?;
        // The read succeeded: it is returned whatever happens to the release (a gone sender is reported by
        // the next call; another failure leaves the connection unusable).
        let d = Instant::now() + self.timeout;
        match write_parts(
            &mut self.writer,
            &[&released],
            d,
            self.timeout,
            "releasing a payload",
            Peer::Sender,
        )
        .await
        {
            Ok(()) | Err(TransportError::PeerGone { .. }) => {}
            Err(err) => {
                self.fail(err);
            }
        }
        Ok(out)
    }

    fn set_bound(&mut self, bound: Option<Duration>) {
        self.bound = bound.map(|d| (Instant::now() + d, d));
    }

    async fn send(&mut self, msg: &[u8]) -> Result<(), TransportError> {
        if let Some(first) = &self.broken {
            return Err(TransportError::Broken {
                first: first.clone(),
            });
        }
        if msg.len() + PREFIX_LEN >= MAX_FRAME {
            return Err(TransportError::TooLarge {
                what: "upstream message",
                len: msg.len(),
                max: MAX_FRAME - 1,
            });
        }
        let frame = Up::Message(msg.to_vec())
            .encode()
            .map_err(|e| protocol(Peer::Sender, e))?;
        let d = Instant::now() + self.timeout;
        match write_parts(
            &mut self.writer,
            &[&frame],
            d,
            self.timeout,
            "sending an upstream message",
            Peer::Sender,
        )
        .await
        {
            Ok(()) => Ok(()),
            Err(err) => Err(self.fail(err)),
        }
    }
}

impl Drop for TcpFanReceiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(receivers: usize, token: &[u8]) -> TcpFanConfig {
        TcpFanConfig {
            receivers,
            token: token.to_vec(),
            timeout: Duration::from_secs(5),
            ..TcpFanConfig::default()
        }
    }

    async fn pair(n: usize) -> (Sender, Vec<Receiver>) {
        let listener = TcpFanSender::listen(cfg(n, b"secret")).await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let rxs = (0..n).map(|r| {
            let addr = addr.clone();
            tokio::spawn(async move {
                TcpFanReceiver::connect(&addr, r, b"secret", "test", Duration::from_secs(5)).await
            })
        });
        let rxs: Vec<_> = rxs.collect();
        let tx = listener.accept().await.unwrap();
        let mut out = Vec::new();
        for h in rxs {
            out.push(h.await.unwrap().unwrap());
        }
        (tx, out)
    }

    #[tokio::test]
    async fn payloads_and_messages_cross_both_ways() {
        let (mut tx, mut rxs) = pair(2).await;
        let big: Vec<u8> = (0..(CHUNK + 12345)).map(|i| (i % 251) as u8).collect();
        tx.send(b"hello").await.unwrap();
        tx.send(&big).await.unwrap();
        for rx in rxs.iter_mut() {
            assert_eq!(rx.recv_with(<[u8]>::to_vec).await.unwrap(), b"hello");
            let got = rx
                .recv_with(|b| (b.as_ptr() as usize % 64, b.to_vec()))
                .await
                .unwrap();
            assert_eq!(got.0, 0, "payloads start 64-byte aligned");
            assert!(got.1 == big);
            rx.send(format!("from {}", rx.rank()).as_bytes())
                .await
                .unwrap();
        }
        tx.flush().await.unwrap();
        for r in 0..2 {
            assert_eq!(
                tx.recv_from(r).await.unwrap(),
                format!("from {r}").into_bytes()
            );
        }
    }

    #[tokio::test]
    async fn a_wrong_token_is_refused_and_a_gone_receiver_named() {
        let listener = TcpFanSender::listen(cfg(1, b"secret")).await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let bad = tokio::spawn({
            let addr = addr.clone();
            async move {
                TcpFanReceiver::connect(&addr, 0, b"wrong", "bad", Duration::from_secs(2)).await
            }
        });
        let good = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            TcpFanReceiver::connect(&addr, 0, b"secret", "good", Duration::from_secs(5)).await
        });
        let mut tx = listener.accept().await.unwrap();
        assert!(bad.await.unwrap().is_err());
        let rx = good.await.unwrap().unwrap();
        drop(rx);
        tokio::time::sleep(Duration::from_millis(100)).await;
        let err = tx.send(b"x").await.unwrap_err();
        assert!(
            matches!(
                &err,
                TransportError::PeerGone {
                    peer: Peer::Receiver(0),
                    ..
                }
            ),
            "{err}"
        );
    }

    #[tokio::test]
    async fn a_bounded_wait_times_out_and_the_receiver_stays_usable() {
        let (mut tx, mut rxs) = pair(1).await;
        let rx = &mut rxs[0];
        rx.set_bound(Some(Duration::from_millis(50)));
        let err = rx.recv_with(<[u8]>::to_vec).await.unwrap_err();
        assert!(
            matches!(err, TransportError::Timeout { timeout, .. } if timeout == Duration::from_millis(50))
        );
        rx.set_bound(None);
        tx.send(b"later").await.unwrap();
        assert_eq!(rx.recv_with(<[u8]>::to_vec).await.unwrap(), b"later");
    }

    fn elastic_cfg(receivers: usize) -> TcpFanConfig {
        TcpFanConfig {
            elastic: true,
            ..cfg(receivers, b"secret")
        }
    }

    async fn join(addr: &str, rank: usize, token: &[u8]) -> Result<Receiver, TransportError> {
        TcpFanReceiver::connect(addr, rank, token, "test", Duration::from_secs(5)).await
    }

    /// The next payload's bytes.
    async fn recv(rx: &mut Receiver) -> Vec<u8> {
        rx.recv_with(<[u8]>::to_vec).await.unwrap()
    }

    #[tokio::test]
    async fn a_late_joiner_is_welcomed_late_and_reached_once_taken_in() {
        let listener = TcpFanSender::listen(elastic_cfg(2)).await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (tx, rx0) = tokio::join!(listener.accept_waiting_for(1), join(&addr, 0, b"secret"));
        let (mut tx, mut rx0) = (tx.unwrap(), rx0.unwrap());
        assert!(tx.is_elastic() && !rx0.joined_late());
        assert_eq!(tx.live(), vec![0]);
        tx.send(b"one").await.unwrap();
        let mut rx1 = join(&addr, 1, b"secret").await.unwrap();
        assert!(rx1.joined_late(), "welcomed after the sender started");
        tx.wait_joined(1).await.unwrap();
        assert_eq!(tx.live(), vec![0, 1]);
        assert!(
            tx.joined_ranks().unwrap().is_empty(),
            "taken in by wait_joined"
        );
        tx.send_to(1, b"catch-up").await.unwrap();
        tx.send(b"two").await.unwrap();
        assert_eq!(recv(&mut rx0).await, b"one");
        assert_eq!(recv(&mut rx0).await, b"two");
        assert_eq!(recv(&mut rx1).await, b"catch-up");
        assert_eq!(recv(&mut rx1).await, b"two");
        tx.flush().await.unwrap();
    }

    #[tokio::test]
    async fn a_gone_receiver_is_detached_and_its_successor_takes_the_rank() {
        let listener = TcpFanSender::listen(elastic_cfg(2)).await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (tx, rx0, rx1) = tokio::join!(
            listener.accept(),
            join(&addr, 0, b"secret"),
            join(&addr, 1, b"secret")
        );
        let (mut tx, mut rx0, rx1) = (tx.unwrap(), rx0.unwrap(), rx1.unwrap());
        drop(rx1);
        tokio::time::sleep(Duration::from_millis(100)).await;
        // Not elastic, this is a `PeerGone` naming rank 1 (see above); here rank 0 goes on alone.
        tx.send(b"alone").await.unwrap();
        assert_eq!(tx.live(), vec![0]);
        assert_eq!(recv(&mut rx0).await, b"alone");
        tx.flush().await.unwrap();
        let err = tx.send_to(1, b"x").await.unwrap_err();
        assert!(
            matches!(
                err,
                TransportError::PeerGone {
                    peer: Peer::Receiver(1),
                    ..
                }
            ),
            "{err}"
        );
        let mut again = join(&addr, 1, b"secret").await.unwrap();
        assert!(again.joined_late());
        tx.wait_joined(1).await.unwrap();
        tx.send(b"both").await.unwrap();
        assert_eq!(recv(&mut rx0).await, b"both");
        assert_eq!(recv(&mut again).await, b"both");
        tx.flush().await.unwrap();
        // Nothing stays open once the sender is gone: its receivers are told, and nobody can connect.
        drop(tx);
        let err = rx0.recv_with(<[u8]>::to_vec).await.unwrap_err();
        assert!(
            matches!(
                err,
                TransportError::PeerGone {
                    peer: Peer::Sender,
                    ..
                }
            ),
            "{err}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
        let err = TcpStream::connect(&addr).await.unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused);
    }

    #[tokio::test]
    async fn a_late_joiner_without_the_token_or_with_a_bad_rank_is_refused() {
        let listener = TcpFanSender::listen(elastic_cfg(2)).await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (tx, rx0) = tokio::join!(listener.accept_waiting_for(1), join(&addr, 0, b"secret"));
        let (mut tx, _rx0) = (tx.unwrap(), rx0.unwrap());
        let err = TcpFanReceiver::connect(&addr, 1, b"wrong", "bad", Duration::from_secs(2))
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                TransportError::Auth { .. } | TransportError::PeerGone { .. }
            ),
            "{err}"
        );
        let err = join(&addr, 2, b"secret").await.unwrap_err();
        assert!(matches!(err, TransportError::Rejected { .. }), "{err}");
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(tx.joined_ranks().unwrap().is_empty());
        assert_eq!(tx.live(), vec![0]);
        // The listener goes on: the right receiver is still admitted.
        let rx1 = join(&addr, 1, b"secret").await.unwrap();
        assert!(rx1.joined_late());
        tx.wait_joined(1).await.unwrap();
        assert_eq!(tx.live(), vec![0, 1]);
    }

    #[tokio::test]
    async fn waits_for_joiners_are_bounded_and_leave_the_channel_usable() {
        // Too few receivers to start: `Timeout` naming the missing ranks.
        let listener = TcpFanSender::listen(TcpFanConfig {
            timeout: Duration::from_millis(200),
            ..elastic_cfg(3)
        })
        .await
        .unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (tx, _rx0) = tokio::join!(listener.accept_waiting_for(2), join(&addr, 0, b"secret"));
        let err = tx.unwrap_err();
        assert!(
            matches!(&err, TransportError::Timeout { peer: Peer::Receivers(m), .. } if *m == vec![1, 2]),
            "{err}"
        );
        // A rank that never comes back: `wait_joined` gives up after the caller's bound.
        let listener = TcpFanSender::listen(elastic_cfg(2)).await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (tx, rx0) = tokio::join!(listener.accept_waiting_for(1), join(&addr, 0, b"secret"));
        let (mut tx, mut rx0) = (tx.unwrap(), rx0.unwrap());
        tx.set_bound(Some(Duration::from_millis(50)));
        let err = tx.wait_joined(1).await.unwrap_err();
        assert!(
            matches!(
                err,
                TransportError::Timeout { peer: Peer::Receiver(1), timeout, .. } if timeout == Duration::from_millis(50)
            ),
            "{err}"
        );
        tx.set_bound(None);
        tx.send(b"still").await.unwrap();
        assert_eq!(recv(&mut rx0).await, b"still");
        // A channel that is not elastic neither starts short nor admits anyone.
        let listener = TcpFanSender::listen(cfg(2, b"secret")).await.unwrap();
        assert!(matches!(
            listener.accept_waiting_for(1).await,
            Err(TransportError::Config { .. })
        ));
        let (mut tx, _rxs) = pair(1).await;
        assert!(matches!(
            tx.wait_joined(0).await,
            Err(TransportError::Config { .. })
        ));
        assert!(!tx.is_elastic());
    }
}
