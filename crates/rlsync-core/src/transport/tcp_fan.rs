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

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;

use super::fanout::{Event, EventTx, Fanout};
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
        }
    }
}

impl std::fmt::Debug for TcpFanConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpFanConfig")
            .field("bind", &self.bind)
            .field("receivers", &self.receivers)
            .field("timeout", &self.timeout)
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
        let TcpFanListener { listener, cfg } = self;
        let n = cfg.receivers;
        let deadline = Instant::now() + cfg.timeout;
        let mut joined: Vec<Option<(FrameReader<OwnedReadHalf>, OwnedWriteHalf)>> =
            (0..n).map(|_| None).collect();
        let mut hellos = JoinSet::new();
        while joined.iter().any(Option::is_none) {
            tokio::select! {
                accepted = tokio::time::timeout_at(deadline, listener.accept()) => match accepted {
                    Err(_) => {
                        let missing = joined.iter().enumerate().filter(|(_, j)| j.is_none()).map(|(r, _)| r).collect();
                        return Err(TransportError::Timeout { op: "accepting receivers", peer: Peer::Receivers(missing), timeout: cfg.timeout });
                    }
                    Ok(Ok((stream, addr))) => {
                        let cfg = cfg.clone();
                        hellos.spawn(async move {
                            tokio::time::timeout_at(deadline, hello(stream, addr, &cfg)).await
                                .unwrap_or_else(|_| Err(TransportError::Timeout { op: "reading a hello", peer: Peer::Receivers(Vec::new()), timeout: cfg.timeout }))
                        });
                    }
                    Ok(Err(e)) => tracing::warn!(error = %e, "accepting a receiver failed"),
                },
                Some(done) = hellos.join_next(), if !hellos.is_empty() => match done {
                    Ok(Ok((rank, reader, mut writer))) => {
                        let refuse = if rank >= n {
                            Some(format!("rank {rank} is out of range for a channel with {n} receivers"))
                        } else if joined[rank].is_some() {
                            Some(format!("rank {rank} already joined"))
                        } else {
                            None
                        };
                        match refuse {
                            Some(reason) => {
                                tracing::warn!(rank, %reason, "refused a receiver");
                                if let Ok(frame) = (Down::Reject { reason }).encode() {
                                    let _ = write_parts(&mut writer, &[&frame], deadline, cfg.timeout, "refusing a receiver", Peer::Receiver(rank)).await;
                                }
                            }
                            None => joined[rank] = Some((reader, writer)),
                        }
                    }
                    Ok(Err(e)) => tracing::warn!(error = %crate::error_chain(&e), "a connection was refused"),
                    Err(e) => tracing::warn!(error = %e, "a hello task failed"),
                },
            }
        }
        let (event_tx, event_rx) = mpsc::unbounded_channel();
        let welcome = Down::Welcome {
            version: VERSION,
            receivers: n as u32,
            slots: cfg.slots as u32,
            late: false,
        }
        .encode()
        .map_err(|e| protocol(Peer::Sender, e))?;
        let mut writers = Vec::with_capacity(n);
        let mut readers = Vec::with_capacity(n);
        for (rank, j) in joined.into_iter().enumerate() {
            let Some((reader, mut writer)) = j else {
                continue;
            };
            write_parts(
                &mut writer,
                &[&welcome],
                deadline,
                cfg.timeout,
                "welcoming a receiver",
                Peer::Receiver(rank),
            )
            .await?;
            writers.push(Some(writer));
            readers.push(spawn_reader(rank, reader, event_tx.clone()));
        }
        Ok(Sender::TcpFan(TcpFanSender {
            fanout: Fanout::new(n, cfg.slots.max(1), cfg.timeout, event_rx),
            writers,
            readers,
            broken: None,
        }))
    }
}

/// One connection's set-up up to its hello: the token proof, then the rank it asks for.
async fn hello(
    mut stream: TcpStream,
    addr: SocketAddr,
    cfg: &TcpFanConfig,
) -> Result<(usize, FrameReader<OwnedReadHalf>, OwnedWriteHalf), TransportError> {
    let _ = stream.set_nodelay(true);
    let peer = auth::server(&mut stream, MAGIC, &cfg.token, &cfg.name, &addr.to_string())
        .await
        .map_err(|e| TransportError::Auth {
            peer: addr.to_string(),
            reason: crate::error_chain(&e),
        })?;
    let (read, writer) = stream.into_split();
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
        Up::Hello { version, rank } if version == VERSION => Ok((rank as usize, reader, writer)),
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
    rank: usize,
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
                    tracing::debug!(rank, error = %crate::error_chain(&e), "receiver connection failed");
                    Event::Gone
                }
            };
            let last = matches!(event, Event::Gone | Event::Violation(_));
            if events.send((rank, event)).is_err() || last {
                return;
            }
        }
    })
}

/// The sending end: one TCP connection per receiver.
pub struct TcpFanSender {
    fanout: Fanout,
    writers: Vec<Option<OwnedWriteHalf>>,
    readers: Vec<JoinHandle<()>>,
    broken: Option<String>,
}

impl std::fmt::Debug for TcpFanSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpFanSender")
            .field("receivers", &self.writers.len())
            .finish_non_exhaustive()
    }
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
    /// mistakes. Everything else (a failed or half-done write, a gone receiver) breaks it.
    fn settle<T>(&mut self, result: Result<T, TransportError>) -> Result<T, TransportError> {
        match result {
            Err(err) => {
                let recoverable = match &err {
                    TransportError::Timeout { op, .. } => {
                        [OP_FLUSH, OP_RECV_FROM, OP_REPORTS].contains(op)
                            || *op == "waiting for a free slot"
                    }
                    TransportError::NoSuchRank { .. } | TransportError::TooLarge { .. } => true,
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

    async fn try_send_with<R>(
        &mut self,
        target: Target,
        len: usize,
        fill: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, TransportError> {
        self.fanout.poll_events()?;
        self.fanout.require_all_alive(OP_SEND)?;
        let targets = self.fanout.targets(target, &[], OP_SEND)?;
        let (seq, slot) = self.fanout.next();
        self.fanout
            .wait_slot_free(slot, "waiting for a free slot")
            .await?;
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
        for &rank in &targets {
            let Some(writer) = self.writers.get_mut(rank).and_then(Option::as_mut) else {
                continue;
            };
            // Each write is bounded on its own (a large payload on a slow link takes many), and by the
            // caller's bound.
            let deadline = self.fanout.deadline();
            let timeout = self.fanout.timeout_at(deadline);
            write_parts(
                writer,
                &[&publish],
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
                let deadline = self.fanout.deadline();
                let timeout = self.fanout.timeout_at(deadline);
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
        }
        self.fanout.published_to(seq, slot, &targets);
        Ok(out)
    }
}

impl SendBackend for TcpFanSender {
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

    async fn wait_joined(&mut self, _rank: usize) -> Result<(), TransportError> {
        Err(super::not_elastic("a TCP fan-out"))
    }

    fn live(&self) -> Vec<usize> {
        self.fanout.live()
    }

    async fn flush(&mut self) -> Result<(), TransportError> {
        self.check_usable()?;
        let result = self.fanout.wait_all_free(OP_FLUSH).await;
        self.settle(result)
    }

    async fn recv_from(&mut self, rank: usize) -> Result<Vec<u8>, TransportError> {
        self.check_usable()?;
        let result = self.fanout.wait_message(rank, OP_RECV_FROM).await;
        self.settle(result)
    }

    fn try_recv_from(
        &mut self,
        rank: usize,
        accept: &dyn Fn(&[u8]) -> bool,
    ) -> Result<Option<Vec<u8>>, TransportError> {
        self.check_usable()?;
        let result = self.fanout.try_message(rank, accept);
        self.settle(result)
    }

    async fn wait_any_from(&mut self, ranks: &[usize]) -> Result<(), TransportError> {
        self.check_usable()?;
        let result = self.fanout.wait_any_message(ranks, OP_REPORTS).await;
        self.settle(result)
    }

    fn set_bound(&mut self, bound: Option<Duration>) {
        self.fanout.set_bound(bound);
    }

    async fn ready(&mut self) -> Result<(), TransportError> {
        self.check_usable()?;
        let result = match self.fanout.poll_events() {
            Ok(()) => {
                let (_, slot) = self.fanout.next();
                self.fanout
                    .wait_slot_free(slot, "waiting for a free slot")
                    .await
            }
            Err(e) => Err(e),
        };
        self.settle(result)
    }
}

impl Drop for TcpFanSender {
    fn drop(&mut self) {
        for task in &self.readers {
            task.abort();
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
        let slots = match Down::decode(&frame).map_err(|e| protocol(Peer::Sender, e))? {
            Down::Welcome {
                version,
                receivers,
                slots,
                ..
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
                slots as usize
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
        }))
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
}
