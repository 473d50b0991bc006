//! TCP weight chain between nodes: the head (trainer's node) sends each payload to the next node, which
//! forwards it part by part while it receives, and so on down the chain; every node hands the payload to its
//! local fan-out (shared memory to its rollouts). Each byte crosses each link once, so a broadcast to k nodes
//! takes about one payload's time on the slowest link, not k.
//!
//! Set-up, once per connection: the mutual challenge-response on the run token of `protocol::auth` (HMAC-SHA256
//! over both sides' random nonces; the token never crosses the wire; magic `RLSYNCC3`). A peer without the token is refused, logged, and the
//! listener keeps waiting for the right one. Then the upstream node tells the downstream one the first global
//! receiver rank of its local receivers, and the downstream node answers with the number of receivers at and
//! beyond it and whether all of those nodes' local fan-outs are elastic (`receivers:u32 elastic:u8`), so the
//! head sees one channel of `local + remote` receivers with global ranks in chain order.
//!
//! Frames after set-up (their bytes are `tcp_link`'s). Downstream: `PAYLOAD len` and the payload's bytes,
//! `PAYLOAD_TO rank len` and the bytes, `FLUSH`, `PULL rank`, `JOIN rank`, `CLOSE`. Upstream (answers, in order):
//! `FLUSHED ranks` (the global ranks at and beyond the answering node whose receiver is detached now), `MSG rank
//! bytes`, `DONE`, `MISSING rank why` (the receiver is gone, or did not answer in time), `ERROR text`.
//!
//! Elastic chains (every node's local fan-out elastic, e.g. shm with `ShmConfig::elastic`) address one receiver
//! and admit successors like an elastic shm channel: `PAYLOAD_TO` is forwarded (pipelined, like `PAYLOAD`) until
//! the node owning the global rank, which hands it to its local fan-out for that rank only and answers `DONE`;
//! `JOIN` is answered by the owning node once a successor for the rank joined its local fan-out
//! ([`Sender::wait_joined`]); a `PULL`, `PAYLOAD_TO` or `JOIN` about a receiver that is gone or silent past the
//! owning node's timeout is answered `MISSING`, which the head returns as `PeerGone`/`Timeout` naming the
//! receiver, and the chain goes on. A broadcast reaches the live receivers only (each node's elastic fan-out
//! detaches its dead ones); `live()` is the head's local live ranks and every remote rank not reported
//! detached by the last `FLUSHED` or `MISSING` (nor joined again since).
//!
//! Memory stays bounded by TCP back-pressure: a node reads the next payload only once its local fan-out took
//! the previous one. Waiting for the next frame is unbounded (syncs are minutes apart); liveness is the
//! control plane's job. Every other wait is bounded by the channel timeout. Errors name the node they are
//! about. The chain moves bytes only; it knows nothing about what the payloads mean.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::inproc::AlignedBuf;
use super::tcp_link::{
    Answer, Extent, LinkError, MAGIC, Request, Why, decode_first_rank, encode_first_rank,
};
use super::{
    InProcSender, Peer, SendBackend, Sender, ShmSender, Target, TransportError, not_elastic,
};
use crate::protocol::auth::{self, AuthError};
/// The op a `MISSING` about a remote receiver is reported under.
const OP_REMOTE: &str = "waiting on a receiver on another node";

/// Settings shared by every node of a chain.
#[derive(Clone)]
pub struct ChainConfig {
    /// The run's secret; both ends of every link must hold the same one.
    pub token: Vec<u8>,
    /// This node's name in peers' logs and errors (e.g. `node 2 (gpu07)`).
    pub name: String,
    /// Size of the parts a node forwards while it receives the next.
    pub part_bytes: usize,
    /// Bound on every wait except the wait for the next frame.
    pub timeout: Duration,
}

impl std::fmt::Debug for ChainConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChainConfig")
            .field("name", &self.name)
            .field("part_bytes", &self.part_bytes)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

fn node(name: &str) -> Peer {
    Peer::Node(name.to_owned())
}

fn io_err(op: &'static str) -> impl FnOnce(std::io::Error) -> TransportError {
    move |source| TransportError::Io { op, source }
}

/// Map a read failure on a link to "the peer is gone" when it closed, else an i/o error.
fn read_err<'a>(
    op: &'static str,
    peer: &'a str,
) -> impl FnOnce(std::io::Error) -> TransportError + 'a {
    move |source| match source.kind() {
        std::io::ErrorKind::UnexpectedEof
        | std::io::ErrorKind::ConnectionReset
        | std::io::ErrorKind::BrokenPipe => TransportError::PeerGone {
            op,
            peer: node(peer),
        },
        _ => TransportError::Io { op, source },
    }
}

async fn bounded<T>(
    timeout: Duration,
    op: &'static str,
    peer: &str,
    fut: impl Future<Output = Result<T, TransportError>>,
) -> Result<T, TransportError> {
    tokio::time::timeout(timeout, fut)
        .await
        .unwrap_or_else(|_| {
            Err(TransportError::Timeout {
                op,
                peer: node(peer),
                timeout,
            })
        })
}

fn auth_err(e: AuthError) -> TransportError {
    match e {
        AuthError::Closed { op, peer } => TransportError::PeerGone {
            op,
            peer: node(&peer),
        },
        AuthError::Io { op, source, .. } => TransportError::Io { op, source },
        AuthError::Greeting { peer, got, .. } => TransportError::Protocol {
            peer: node(&peer),
            reason: format!("not an rlsync chain node (greeting {got:02x?})"),
        },
        AuthError::Refused { peer, reason } => TransportError::Auth {
            peer,
            reason: reason.to_owned(),
        },
        e @ AuthError::NameTooLong { .. } => TransportError::Protocol {
            peer: node("a peer"),
            reason: e.to_string(),
        },
    }
}

fn link_err(peer: &str) -> impl FnOnce(LinkError) -> TransportError + '_ {
    move |source| TransportError::Link {
        peer: node(peer),
        source,
    }
}

/// Read one link message with `decode` from `s`, after the bytes of it already in `buf`: as many bytes as the
/// decoder says the message needs, and never more (a payload's bytes may follow it on the stream).
async fn read_message<M>(
    s: &mut TcpStream,
    mut buf: Vec<u8>,
    decode: fn(&[u8]) -> Result<M, LinkError>,
    op: &'static str,
    peer: &str,
) -> Result<M, TransportError> {
    let mut have = buf.len();
    if have == 0 {
        buf.resize(1, 0);
    }
    loop {
        s.read_exact(&mut buf[have..])
            .await
            .map_err(read_err(op, peer))?;
        have = buf.len();
        match decode(&buf) {
            Ok(m) => return Ok(m),
            Err(LinkError::Incomplete { need, .. }) => buf.resize(need.max(have + 1), 0),
            Err(e) => return Err(link_err(peer)(e)),
        }
    }
}

/// Upstream side of set-up: the mutual token proof (`protocol::auth`), then our first rank out and the
/// receiver count at and beyond the next node (and whether they are all elastic) back.
async fn client_handshake(
    s: &mut TcpStream,
    cfg: &ChainConfig,
    addr: &str,
    first_rank: u32,
) -> Result<(String, u32, bool), TransportError> {
    const OP: &str = "setting up the link to the next node";
    let peer = auth::client(s, MAGIC, &cfg.token, &cfg.name, addr)
        .await
        .map_err(auth_err)?;
    s.write_all(&encode_first_rank(first_rank))
        .await
        .map_err(read_err(OP, &peer))?;
    let mut answer = [0; Extent::LEN];
    s.read_exact(&mut answer)
        .await
        .map_err(read_err(OP, &peer))?;
    let Extent { receivers, elastic } = Extent::decode(&answer).map_err(link_err(&peer))?;
    Ok((peer, receivers, elastic))
}

/// Downstream side of set-up up to the point where the receiver count is known: the mutual token proof (a
/// peer without the token is refused), then our first rank.
async fn server_handshake(
    s: &mut TcpStream,
    cfg: &ChainConfig,
    addr: &str,
) -> Result<(String, u32), TransportError> {
    const OP: &str = "setting up the link from the previous node";
    let peer = auth::server(s, MAGIC, &cfg.token, &cfg.name, addr)
        .await
        .map_err(auth_err)?;
    let mut first = [0; 4];
    s.read_exact(&mut first)
        .await
        .map_err(read_err(OP, &peer))?;
    let first_rank = decode_first_rank(&first).map_err(link_err(&peer))?;
    Ok((peer, first_rank))
}

async fn finish_server_handshake(
    s: &mut TcpStream,
    peer: &str,
    receivers: u32,
    elastic: bool,
) -> Result<(), TransportError> {
    const OP: &str = "completing set-up with the previous node";
    let answer = Extent { receivers, elastic }.encode();
    s.write_all(&answer).await.map_err(read_err(OP, peer))
}

/// Accept connections on `listener` until one proves the token (within `cfg.timeout` overall). Refused peers
/// are logged and dropped; the wait goes on.
async fn accept_authenticated(
    listener: &TcpListener,
    cfg: &ChainConfig,
) -> Result<(TcpStream, String, u32), TransportError> {
    let timeout = cfg.timeout;
    let accept = async {
        loop {
            let (mut s, addr) = listener
                .accept()
                .await
                .map_err(io_err("accepting the previous node"))?;
            let addr = addr.to_string();
            match bounded(
                timeout,
                "authenticating the previous node",
                &addr,
                server_handshake(&mut s, cfg, &addr),
            )
            .await
            {
                Ok((peer, first)) => {
                    let _ = s.set_nodelay(true);
                    return Ok((s, peer, first));
                }
                Err(e) => {
                    tracing::warn!(
                        "{}: refused a chain connection from {addr}: {}",
                        cfg.name,
                        crate::error_chain(&e)
                    );
                }
            }
        }
    };
    tokio::time::timeout(timeout, accept)
        .await
        .unwrap_or_else(|_| {
            Err(TransportError::Timeout {
                op: "waiting for the previous node to connect",
                peer: Peer::Node("the previous node".into()),
                timeout,
            })
        })
}

async fn connect_downstream(
    addr: &str,
    cfg: &ChainConfig,
    first_rank: u32,
) -> Result<Downstream, TransportError> {
    bounded(cfg.timeout, "connecting to the next node", addr, async {
        // The next node may still be starting: retry refused connections until the timeout.
        let mut s = loop {
            match TcpStream::connect(addr).await {
                Ok(s) => break s,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(source) => {
                    return Err(TransportError::Io {
                        op: "connecting to the next node",
                        source,
                    });
                }
            }
        };
        let _ = s.set_nodelay(true);
        let (peer, receivers, elastic) = client_handshake(&mut s, cfg, addr, first_rank).await?;
        Ok(Downstream {
            stream: s,
            peer,
            receivers,
            elastic,
        })
    })
    .await
}

/// Read one upstream answer from `s`; `ERROR` becomes an error naming `peer`.
async fn read_answer(
    s: &mut TcpStream,
    peer: &str,
    timeout: Duration,
) -> Result<Answer, TransportError> {
    const OP: &str = "waiting for the next node's answer";
    let answer = bounded(
        timeout,
        OP,
        peer,
        read_message(s, Vec::new(), Answer::decode, OP, peer),
    )
    .await?;
    match answer {
        Answer::Error(text) => Err(TransportError::Protocol {
            peer: node(peer),
            reason: format!("failed: {text}"),
        }),
        answer => Ok(answer),
    }
}

fn unexpected(peer: &str, got: &Answer, due: &str) -> TransportError {
    TransportError::Protocol {
        peer: node(peer),
        reason: format!("answered {} where {due} was due", got.name()),
    }
}

/// The answer to a request about receiver `rank` (`PAYLOAD_TO`, `JOIN`: `DONE`; `PULL`: `MSG`), or `MISSING`
/// about it; anything else is a protocol violation by `peer`.
fn answer_about(
    peer: &str,
    rank: u32,
    got: Answer,
    pulled: bool,
) -> Result<Answer, TransportError> {
    match got {
        Answer::Done if !pulled => Ok(got),
        Answer::Msg(r, _) | Answer::Missing { rank: r, .. } if r != rank => {
            Err(TransportError::Protocol {
                peer: node(peer),
                reason: format!("answered about receiver rank {r} when asked about {rank}"),
            })
        }
        Answer::Msg(..) if pulled => Ok(got),
        Answer::Missing { .. } => Ok(got),
        other => Err(unexpected(
            peer,
            &other,
            if pulled {
                "MSG or MISSING"
            } else {
                "DONE or MISSING"
            },
        )),
    }
}

/// The error a `MISSING` answer stands for, naming the receiver by its global rank.
fn missing(rank: u32, why: Why, timeout: Duration) -> TransportError {
    let peer = Peer::Receiver(rank as usize);
    match why {
        Why::Silent => TransportError::Timeout {
            op: OP_REMOTE,
            peer,
            timeout,
        },
        Why::Gone => TransportError::PeerGone {
            op: OP_REMOTE,
            peer,
        },
    }
}

/// The `MISSING` reason for an error of a node's local fan-out about its receivers (gone, or silent past the
/// timeout); `None`: the error is the node's own (it breaks the chain).
fn why_missing(err: &TransportError) -> Option<Why> {
    match err {
        TransportError::PeerGone {
            peer: Peer::Receiver(_) | Peer::Receivers(_),
            ..
        } => Some(Why::Gone),
        TransportError::Timeout {
            peer: Peer::Receiver(_) | Peer::Receivers(_),
            ..
        } => Some(Why::Silent),
        _ => None,
    }
}

/// How long the upstream side waits for the answer to a request the owning node bounds by its own timeout
/// (a join, a targeted payload): longer than that node's wait, so its `MISSING` arrives first.
fn answer_timeout(timeout: Duration) -> Duration {
    timeout
        .saturating_mul(2)
        .saturating_add(Duration::from_secs(5))
}

/// A node's own fan-out behind the chain: any sender but another chain (which would make the dispatch
/// recursive).
enum Local {
    InProc(InProcSender),
    Shm(ShmSender),
}

impl Local {
    fn new(sender: Sender) -> Result<Local, TransportError> {
        match sender {
            Sender::InProc(s) => Ok(Local::InProc(s)),
            Sender::Shm(s) => Ok(Local::Shm(s)),
            #[cfg(test)]
            Sender::Tap(_) => Err(TransportError::Config {
                reason: "a tapped test sender cannot feed a chain".into(),
            }),
            Sender::Chain(_) | Sender::Bridge(_) | Sender::TcpFan(_) => {
                Err(TransportError::Config {
                    reason: "a node's local fan-out is an in-process or shared-memory channel"
                        .into(),
                })
            }
        }
    }

    fn receivers(&self) -> usize {
        match self {
            Local::InProc(s) => s.receivers(),
            Local::Shm(s) => s.receivers(),
        }
    }

    fn is_elastic(&self) -> bool {
        match self {
            Local::InProc(s) => s.is_elastic(),
            Local::Shm(s) => s.is_elastic(),
        }
    }

    fn live(&self) -> Vec<usize> {
        match self {
            Local::InProc(s) => s.live(),
            Local::Shm(s) => s.live(),
        }
    }

    async fn send_with<R>(
        &mut self,
        target: Target,
        len: usize,
        fill: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, TransportError> {
        match self {
            Local::InProc(s) => s.send_with(target, len, fill).await,
            Local::Shm(s) => s.send_with(target, len, fill).await,
        }
    }

    async fn wait_joined(&mut self, rank: usize) -> Result<(), TransportError> {
        match self {
            Local::InProc(s) => s.wait_joined(rank).await,
            Local::Shm(s) => s.wait_joined(rank).await,
        }
    }

    async fn flush(&mut self) -> Result<(), TransportError> {
        match self {
            Local::InProc(s) => s.flush().await,
            Local::Shm(s) => s.flush().await,
        }
    }

    async fn recv_from(&mut self, rank: usize) -> Result<Vec<u8>, TransportError> {
        match self {
            Local::InProc(s) => s.recv_from(rank).await,
            Local::Shm(s) => s.recv_from(rank).await,
        }
    }
}

/// The next node of the chain, as seen from the node before it.
struct Downstream {
    stream: TcpStream,
    /// `name at addr`.
    peer: String,
    /// Receivers at and beyond it.
    receivers: u32,
    /// Whether every node at and beyond it has an elastic local fan-out.
    elastic: bool,
}

impl Downstream {
    /// Send a request without payload bytes (`FLUSH`, `JOIN`, `PULL`).
    async fn request(&mut self, req: &Request, op: &'static str) -> Result<(), TransportError> {
        self.stream
            .write_all(&req.encode())
            .await
            .map_err(read_err(op, &self.peer))
    }
}

/// The head of a chain: the trainer's node. Sends to its own receivers through `local` and to every other
/// node through the chain. Global receiver ranks: `local` first, then the chain's nodes in order.
pub struct ChainSender {
    local: Option<Local>,
    local_receivers: usize,
    down: Option<Downstream>,
    cfg: ChainConfig,
    /// Staging copy of the payload being sent downstream (64-byte aligned, like every payload buffer).
    staging: Option<AlignedBuf>,
    /// Remote ranks known to be detached (elastic chains): from the last `FLUSHED`, `MISSING` answers, and
    /// joins since.
    remote_down: std::collections::BTreeSet<usize>,
}

impl std::fmt::Debug for ChainSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChainSender")
            .field("local_receivers", &self.local_receivers)
            .field("next", &self.down.as_ref().map(|d| &d.peer))
            .field("remote_receivers", &self.down.as_ref().map(|d| d.receivers))
            .finish_non_exhaustive()
    }
}

impl ChainSender {
    /// Start a chain at this node: `local` serves this node's receivers (ranks first), `next` is the address of
    /// the next node (None: a chain of one node). Returns once every node downstream completed set-up.
    pub async fn connect(
        local: Option<Sender>,
        next: Option<&str>,
        cfg: ChainConfig,
    ) -> Result<Sender, TransportError> {
        let local = local.map(Local::new).transpose()?;
        let local_receivers = local.as_ref().map_or(0, Local::receivers);
        let first = u32::try_from(local_receivers).map_err(|_| TransportError::Config {
            reason: format!("{local_receivers} local receivers is too many"),
        })?;
        let down = match next {
            None => None,
            Some(addr) => {
                let down = connect_downstream(addr, &cfg, first).await?;
                tracing::debug!(
                    "{}: chain to {} ({} receivers{}) is up",
                    cfg.name,
                    down.peer,
                    down.receivers,
                    if down.elastic { ", elastic" } else { "" }
                );
                Some(down)
            }
        };
        Ok(Sender::Chain(ChainSender {
            local,
            local_receivers,
            down,
            cfg,
            staging: None,
            remote_down: std::collections::BTreeSet::new(),
        }))
    }

    /// Send the staged payload down the chain: to every node (`target` None) or towards the node owning
    /// global rank `target`.
    async fn send_downstream(
        &mut self,
        target: Option<u32>,
        len: usize,
    ) -> Result<(), TransportError> {
        const OP: &str = "sending a payload down the chain";
        let (Some(down), Some(staging)) = (self.down.as_mut(), self.staging.as_ref()) else {
            return Ok(());
        };
        let bytes = staging.bytes(len);
        let peer = down.peer.clone();
        let s = &mut down.stream;
        let header = payload_request(target, len).encode();
        bounded(self.cfg.timeout, OP, &peer, async {
            s.write_all(&header).await.map_err(read_err(OP, &peer))
        })
        .await?;
        for part in bytes.chunks(self.cfg.part_bytes.max(1)) {
            bounded(self.cfg.timeout, OP, &peer, async {
                s.write_all(part).await.map_err(read_err(OP, &peer))
            })
            .await?;
        }
        Ok(())
    }

    fn stage(&mut self, len: usize) -> Result<(), TransportError> {
        if self.down.is_some() {
            let fits = self.staging.as_ref().is_some_and(|s| s.capacity() >= len);
            if !fits {
                self.staging = Some(AlignedBuf::with_len(len)?);
            }
        }
        Ok(())
    }

    /// Check that remote rank `rank` exists and can be addressed (the chain is elastic).
    fn remote_rank(&self, rank: usize, what: &str) -> Result<u32, TransportError> {
        let receivers = self.receivers();
        if rank >= receivers || self.down.is_none() {
            return Err(TransportError::NoSuchRank { rank, receivers });
        }
        if !SendBackend::is_elastic(self) {
            return Err(not_elastic(what));
        }
        u32::try_from(rank).map_err(|_| TransportError::NoSuchRank { rank, receivers })
    }

    /// Note what an answer about remote rank `rank` says about it; `MISSING` becomes its error.
    fn settle_answer(&mut self, rank: u32, answer: Answer) -> Result<Answer, TransportError> {
        match answer {
            Answer::Missing { rank, why } => {
                self.remote_down.insert(rank as usize);
                Err(missing(rank, why, self.cfg.timeout))
            }
            other => {
                self.remote_down.remove(&(rank as usize));
                Ok(other)
            }
        }
    }

    /// A payload for remote rank `rank` only: forwarded to its node, which answers once its fan-out took it.
    async fn send_remote<R>(
        &mut self,
        rank: usize,
        len: usize,
        fill: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, TransportError> {
        let rank = self.remote_rank(rank, "a TCP chain whose nodes' fan-outs are not elastic")?;
        self.stage(len)?;
        let Some(staging) = self.staging.as_mut() else {
            unreachable!("staged above: the chain has a next node")
        };
        let out = fill(staging.bytes_mut(len));
        self.send_downstream(Some(rank), len).await?;
        let Some(down) = self.down.as_mut() else {
            unreachable!("checked by remote_rank")
        };
        let got = read_answer(
            &mut down.stream,
            &down.peer,
            answer_timeout(self.cfg.timeout),
        )
        .await?;
        let got = answer_about(&down.peer, rank, got, false)?;
        self.settle_answer(rank, got)?;
        Ok(out)
    }
}

impl SendBackend for ChainSender {
    fn receivers(&self) -> usize {
        self.local_receivers + self.down.as_ref().map_or(0, |d| d.receivers as usize)
    }

    async fn wait_joined(&mut self, rank: usize) -> Result<(), TransportError> {
        const OP: &str = "asking the next node for a rejoined receiver";
        if rank < self.local_receivers
            && let Some(local) = self.local.as_mut()
        {
            return local.wait_joined(rank).await;
        }
        let rank = self.remote_rank(rank, "a TCP chain whose nodes' fan-outs are not elastic")?;
        let Some(down) = self.down.as_mut() else {
            unreachable!("checked by remote_rank")
        };
        down.request(&Request::Join { rank }, OP).await?;
        let got = read_answer(
            &mut down.stream,
            &down.peer,
            answer_timeout(self.cfg.timeout),
        )
        .await?;
        let got = answer_about(&down.peer, rank, got, false)?;
        self.settle_answer(rank, got).map(|_| ())
    }

    fn live(&self) -> Vec<usize> {
        let mut live = self.local.as_ref().map_or_else(Vec::new, Local::live);
        live.extend(
            (self.local_receivers..self.receivers()).filter(|r| !self.remote_down.contains(r)),
        );
        live
    }

    fn is_elastic(&self) -> bool {
        self.local.as_ref().is_none_or(Local::is_elastic)
            && self.down.as_ref().is_none_or(|d| d.elastic)
    }

    async fn send_with<R>(
        &mut self,
        target: Target,
        len: usize,
        fill: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, TransportError> {
        match target {
            Target::Rank(rank) if rank < self.local_receivers => {
                let Some(local) = self.local.as_mut() else {
                    unreachable!("local receivers come with a local fan-out")
                };
                return local.send_with(target, len, fill).await;
            }
            Target::Rank(rank) => return self.send_remote(rank, len, fill).await,
            Target::All => {}
        }
        self.stage(len)?;
        let out = match (self.local.as_mut(), self.staging.as_mut()) {
            (Some(local), staging) if self.down.is_some() => {
                let staging = staging.map(|s| s.bytes_mut(len));
                local
                    .send_with(Target::All, len, |buf| {
                        let r = fill(buf);
                        if let Some(st) = staging {
                            st.copy_from_slice(buf);
                        }
                        r
                    })
                    .await?
            }
            (Some(local), _) => return local.send_with(Target::All, len, fill).await,
            (None, Some(staging)) => fill(staging.bytes_mut(len)),
            (None, None) => {
                return Err(TransportError::Config {
                    reason: "a chain with neither local receivers nor a next node".into(),
                });
            }
        };
        self.send_downstream(None, len).await?;
        Ok(out)
    }

    async fn flush(&mut self) -> Result<(), TransportError> {
        if let Some(down) = self.down.as_mut() {
            down.request(&Request::Flush, "flushing the chain").await?;
        }
        if let Some(local) = self.local.as_mut() {
            local.flush().await?;
        }
        if let Some(down) = self.down.as_mut() {
            match read_answer(&mut down.stream, &down.peer, self.cfg.timeout).await? {
                Answer::Flushed(ranks) => {
                    self.remote_down = ranks.into_iter().map(|r| r as usize).collect();
                }
                other => return Err(unexpected(&down.peer, &other, "FLUSHED")),
            }
        }
        Ok(())
    }

    async fn recv_from(&mut self, rank: usize) -> Result<Vec<u8>, TransportError> {
        if rank < self.local_receivers
            && let Some(local) = self.local.as_mut()
        {
            return local.recv_from(rank).await;
        }
        let receivers = self.receivers();
        let Some(down) = self.down.as_mut().filter(|_| rank < receivers) else {
            return Err(TransportError::NoSuchRank { rank, receivers });
        };
        let rank = rank as u32;
        let got = pull(down, rank).await?;
        match self.settle_answer(rank, got)? {
            Answer::Msg(_, msg) => Ok(msg),
            other => Err(unexpected("the next node", &other, "MSG")),
        }
    }
}

/// The request announcing a payload of `len` bytes for every receiver (`target` None) or global rank `target`.
fn payload_request(target: Option<u32>, len: usize) -> Request {
    let len = len as u64;
    match target {
        None => Request::Payload { len },
        Some(rank) => Request::PayloadTo { rank, len },
    }
}

/// Ask the next node for receiver `rank`'s next upstream message: `MSG` or `MISSING` about it.
async fn pull(down: &mut Downstream, rank: u32) -> Result<Answer, TransportError> {
    const OP: &str = "asking the next node for a message";
    down.request(&Request::Pull { rank }, OP).await?;
    // Upstream messages may come long after (a receiver answers once it has work to report).
    let got = read_answer(&mut down.stream, &down.peer, Duration::MAX / 4).await?;
    answer_about(&down.peer, rank, got, true)
}

impl Drop for ChainSender {
    fn drop(&mut self) {
        // Best effort: tell the chain it ended (a closed socket tells it too).
        if let Some(down) = self.down.as_mut() {
            let _ = down.stream.try_write(&Request::Close.encode());
        }
    }
}

/// A node past the head: receives from the previous node, forwards downstream while receiving, and hands
/// each payload to its local fan-out.
pub struct ChainRelay {
    up: TcpStream,
    up_peer: String,
    down: Option<Downstream>,
    local: Local,
    first_rank: u32,
    cfg: ChainConfig,
    buf: Option<AlignedBuf>,
}

impl std::fmt::Debug for ChainRelay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChainRelay")
            .field("from", &self.up_peer)
            .field("next", &self.down.as_ref().map(|d| &d.peer))
            .field("first_rank", &self.first_rank)
            .finish_non_exhaustive()
    }
}

/// How a relay ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RelayEnd {
    /// The head closed the channel.
    Closed,
}

/// Where a request about one global rank goes from a relay.
enum Owner {
    /// One of this node's receivers (its local rank).
    Here(usize),
    /// A node further down.
    Beyond,
}

impl ChainRelay {
    /// Accept the previous node on `listener` (refusing peers without the token), connect to `next` (if
    /// any), and complete set-up. `local` serves this node's receivers.
    pub async fn establish(
        listener: &TcpListener,
        next: Option<&str>,
        local: Sender,
        cfg: ChainConfig,
    ) -> Result<ChainRelay, TransportError> {
        let local = Local::new(local)?;
        let (mut up, up_peer, first_rank) = accept_authenticated(listener, &cfg).await?;
        let local_n = u32::try_from(local.receivers()).unwrap_or(u32::MAX);
        let after = first_rank
            .checked_add(local_n)
            .ok_or_else(|| TransportError::Config {
                reason: "too many receivers in the chain".into(),
            })?;
        let down = match next {
            None => None,
            Some(addr) => Some(connect_downstream(addr, &cfg, after).await?),
        };
        let total = local_n.saturating_add(down.as_ref().map_or(0, |d| d.receivers));
        let elastic = local.is_elastic() && down.as_ref().is_none_or(|d| d.elastic);
        finish_server_handshake(&mut up, &up_peer, total, elastic).await?;
        Ok(ChainRelay {
            up,
            up_peer,
            down,
            local,
            first_rank,
            cfg,
            buf: None,
        })
    }

    /// Serve the chain until the head closes it. On an error, the previous node is told (naming this node)
    /// before the error is returned.
    pub async fn serve(mut self) -> Result<RelayEnd, TransportError> {
        let result = self.serve_frames().await;
        if let Err(e) = &result {
            let text = format!("{}: {}", self.cfg.name, crate::error_chain(e));
            // An error's text is cut to the limit, so its encoding cannot fail.
            let frame = Answer::Error(text).encode().unwrap_or_default();
            let up = &mut self.up;
            let _ = tokio::time::timeout(Duration::from_secs(1), async {
                up.write_all(&frame).await?;
                up.shutdown().await?;
                // Read (and drop) what the previous node still sends until it closes: a socket closed with
                // unread bytes is reset by the kernel, and the reset can discard the error frame before the
                // previous node reads it (it would then blame this node instead of the one named).
                let mut sink = vec![0u8; 64 * 1024];
                while up.read(&mut sink).await? > 0 {}
                Ok::<(), std::io::Error>(())
            })
            .await;
        }
        let _ = self.local.flush().await;
        result
    }

    async fn serve_frames(&mut self) -> Result<RelayEnd, TransportError> {
        const OP: &str = "waiting for the next frame";
        const READ: &str = "reading a frame";
        loop {
            // The wait for the next frame is unbounded; the rest of a frame that began is not.
            let tag = match self.up.read_u8().await {
                Ok(t) => t,
                Err(e) => return Err(read_err(OP, &self.up_peer)(e)),
            };
            let peer = self.up_peer.clone();
            let req = bounded(
                self.cfg.timeout,
                READ,
                &peer,
                read_message(&mut self.up, vec![tag], Request::decode, READ, &peer),
            )
            .await?;
            match req {
                Request::Payload { len } => self.relay_payload(None, len).await?,
                Request::PayloadTo { rank, len } => self.relay_payload(Some(rank), len).await?,
                Request::Flush => self.flush().await?,
                Request::Pull { rank } => self.pull(rank).await?,
                Request::Join { rank } => self.join(rank).await?,
                Request::Close => {
                    if let Some(d) = self.down.as_mut() {
                        let _ = d.stream.write_all(&Request::Close.encode()).await;
                    }
                    return Ok(RelayEnd::Closed);
                }
            }
        }
    }

    /// Which node serves global rank `rank`: this one, or one further down; else the request is a
    /// protocol violation by the previous node.
    fn owner(&self, rank: u32) -> Result<Owner, TransportError> {
        let local_n = self.local.receivers() as u64;
        match u64::from(rank).checked_sub(u64::from(self.first_rank)) {
            Some(r) if r < local_n => Ok(Owner::Here(r as usize)),
            Some(_) if self.down.is_some() => Ok(Owner::Beyond),
            _ => Err(TransportError::NoSuchRank {
                rank: rank as usize,
                receivers: (u64::from(self.first_rank) + local_n) as usize,
            }),
        }
    }

    async fn answer_up(&mut self, answer: &Answer) -> Result<(), TransportError> {
        // Only a list or message beyond the link's limits cannot be encoded.
        let frame = answer.encode().map_err(|e| match e {
            LinkError::TooLarge { what, len, max } => TransportError::TooLarge { what, len, max },
            source => TransportError::Link {
                peer: node(&self.up_peer),
                source,
            },
        })?;
        self.up
            .write_all(&frame)
            .await
            .map_err(read_err("answering the previous node", &self.up_peer))
    }

    /// The answer about local receiver (global) `rank` for the outcome of a request about it.
    fn local_answer<T>(
        rank: u32,
        result: Result<T, TransportError>,
    ) -> Result<Answer, TransportError> {
        result.map_or_else(|e| Self::missing_answer(rank, e), |_| Ok(Answer::Done))
    }

    /// `MISSING` about local receiver (global) `rank` when `err` is about it; else `err`, the node's own.
    fn missing_answer(rank: u32, err: TransportError) -> Result<Answer, TransportError> {
        match why_missing(&err) {
            Some(why) => {
                tracing::debug!(
                    "receiver rank {rank} is missing: {}",
                    crate::error_chain(&err)
                );
                Ok(Answer::Missing { rank, why })
            }
            None => Err(err),
        }
    }

    /// The `len` bytes after `PAYLOAD` (`target` None: every receiver) or `PAYLOAD_TO rank` (one receiver, here
    /// or further down).
    async fn relay_payload(&mut self, target: Option<u32>, len: u64) -> Result<(), TransportError> {
        const OP: &str = "receiving a payload";
        const FWD: &str = "forwarding a payload";
        let timeout = self.cfg.timeout;
        let up_peer = self.up_peer.clone();
        let target = match target {
            Some(rank) => Some((rank, self.owner(rank)?)),
            None => None,
        };
        let len = usize::try_from(len).map_err(|_| TransportError::TooLarge {
            what: "payload",
            len: usize::MAX,
            max: isize::MAX as usize,
        })?;
        if self.buf.as_ref().is_none_or(|b| b.capacity() < len) {
            self.buf = Some(AlignedBuf::with_len(len)?);
        }
        let Some(buf) = self.buf.as_mut() else {
            unreachable!("allocated above")
        };
        let header = payload_request(target.as_ref().map(|(rank, _)| *rank), len).encode();
        let forward = !matches!(target, Some((_, Owner::Here(_))));
        let bytes = buf.bytes_mut(len);
        let part = self.cfg.part_bytes.max(1);
        let (mut received, mut sent) = (0usize, 0usize);
        let up = &mut self.up;
        let mut down = self.down.as_mut().filter(|_| forward);
        // Receive part i+1 while part i goes downstream.
        while sent < len {
            let (done, rest) = bytes.split_at_mut(received);
            let n = part.min(rest.len());
            let read = async {
                if n > 0 {
                    up.read_exact(&mut rest[..n])
                        .await
                        .map_err(read_err(OP, &up_peer))?;
                }
                Ok::<(), TransportError>(())
            };
            let to_send = &done[sent..];
            let header = &header;
            let write = async {
                if let Some(d) = down.as_deref_mut()
                    && !to_send.is_empty()
                {
                    if sent == 0 {
                        d.stream
                            .write_all(header)
                            .await
                            .map_err(read_err(FWD, &d.peer))?;
                    }
                    d.stream
                        .write_all(to_send)
                        .await
                        .map_err(read_err(FWD, &d.peer))?;
                }
                Ok::<(), TransportError>(())
            };
            let (r, w) = tokio::time::timeout(timeout, async { tokio::join!(read, write) })
                .await
                .map_err(|_| TransportError::Timeout {
                    op: OP,
                    peer: node(&up_peer),
                    timeout,
                })?;
            r?;
            w?;
            sent = received;
            received += n;
        }
        if len == 0
            && let Some(d) = down
        {
            d.stream
                .write_all(&header)
                .await
                .map_err(read_err(FWD, &d.peer))?;
        }
        let Some(buf) = self.buf.as_ref() else {
            unreachable!("allocated above")
        };
        let payload = buf.bytes(len);
        match target {
            None => {
                if self.local.receivers() > 0 {
                    self.local
                        .send_with(Target::All, len, |dst| dst.copy_from_slice(payload))
                        .await?;
                }
                Ok(())
            }
            Some((rank, Owner::Here(local_rank))) => {
                let result = self
                    .local
                    .send_with(Target::Rank(local_rank), len, |dst| {
                        dst.copy_from_slice(payload)
                    })
                    .await;
                let answer = Self::local_answer(rank, result)?;
                self.answer_up(&answer).await
            }
            Some((rank, Owner::Beyond)) => self.pass_answer(rank, false).await,
        }
    }

    /// Read the next node's answer about `rank` and pass it upstream.
    async fn pass_answer(&mut self, rank: u32, pulled: bool) -> Result<(), TransportError> {
        let Some(d) = self.down.as_mut() else {
            unreachable!("only asked of a node with a next node")
        };
        let wait = if pulled {
            Duration::MAX / 4
        } else {
            answer_timeout(self.cfg.timeout)
        };
        let got = read_answer(&mut d.stream, &d.peer, wait).await?;
        let got = answer_about(&d.peer, rank, got, pulled)?;
        self.answer_up(&got).await
    }

    async fn flush(&mut self) -> Result<(), TransportError> {
        const OP: &str = "flushing";
        if let Some(d) = self.down.as_mut() {
            d.request(&Request::Flush, OP).await?;
        }
        if self.local.receivers() > 0 {
            self.local.flush().await?;
        }
        let live = self.local.live();
        let mut detached: Vec<u32> = (0..self.local.receivers())
            .filter(|r| !live.contains(r))
            .map(|r| self.first_rank.saturating_add(r as u32))
            .collect();
        if let Some(d) = self.down.as_mut() {
            match read_answer(&mut d.stream, &d.peer, self.cfg.timeout).await? {
                Answer::Flushed(ranks) => detached.extend(ranks),
                other => return Err(unexpected(&d.peer, &other, "FLUSHED")),
            }
        }
        self.answer_up(&Answer::Flushed(detached)).await
    }

    async fn pull(&mut self, rank: u32) -> Result<(), TransportError> {
        const OP: &str = "answering a pull";
        match self.owner(rank)? {
            Owner::Here(r) => {
                let answer = match self.local.recv_from(r).await {
                    Ok(msg) => Answer::Msg(rank, msg),
                    Err(e) => Self::missing_answer(rank, e)?,
                };
                self.answer_up(&answer).await
            }
            Owner::Beyond => {
                let Some(d) = self.down.as_mut() else {
                    unreachable!("Beyond needs a next node")
                };
                d.request(&Request::Pull { rank }, OP).await?;
                self.pass_answer(rank, true).await
            }
        }
    }

    /// `JOIN rank`: wait for a successor of that receiver to join (here), or ask the node that owns it.
    async fn join(&mut self, rank: u32) -> Result<(), TransportError> {
        const OP: &str = "answering a join";
        match self.owner(rank)? {
            Owner::Here(r) => {
                let result = self.local.wait_joined(r).await;
                let answer = Self::local_answer(rank, result)?;
                self.answer_up(&answer).await
            }
            Owner::Beyond => {
                let Some(d) = self.down.as_mut() else {
                    unreachable!("Beyond needs a next node")
                };
                d.request(&Request::Join { rank }, OP).await?;
                self.pass_answer(rank, false).await
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::{Receiver, inproc_channel_with_timeout};

    const T: Duration = Duration::from_secs(20);

    fn cfg(name: &str, token: &[u8], part: usize) -> ChainConfig {
        ChainConfig {
            token: token.to_vec(),
            name: name.to_owned(),
            part_bytes: part,
            timeout: T,
        }
    }

    async fn listen() -> (TcpListener, String) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        (l, addr)
    }

    /// A head with `local[0]` receivers and relays with `local[1..]` receivers each, on loopback; returns the
    /// head, every receiver in global rank order, and the relay tasks.
    async fn chain(
        local: &[usize],
        part: usize,
    ) -> (
        Sender,
        Vec<Receiver>,
        Vec<tokio::task::JoinHandle<Result<RelayEnd, TransportError>>>,
    ) {
        let mut listeners = Vec::new();
        for _ in 1..local.len() {
            listeners.push(listen().await);
        }
        let addrs: Vec<String> = listeners.iter().map(|(_, a)| a.clone()).collect();
        let mut receivers = Vec::new();
        let (head_local, head_rx) = inproc_channel_with_timeout(local[0], T);
        let mut relays = Vec::new();
        let mut relay_rx = Vec::new();
        for (i, (listener, _)) in listeners.into_iter().enumerate() {
            let (tx, rx) = inproc_channel_with_timeout(local[i + 1], T);
            relay_rx.push(rx);
            let next = addrs.get(i + 1).cloned();
            let c = cfg(&format!("node {}", i + 1), b"secret", part);
            relays.push(tokio::spawn(async move {
                let relay = ChainRelay::establish(&listener, next.as_deref(), tx, c).await?;
                relay.serve().await
            }));
        }
        let head = ChainSender::connect(
            (local[0] > 0).then_some(head_local),
            addrs.first().map(String::as_str),
            cfg("node 0", b"secret", part),
        )
        .await
        .unwrap();
        receivers.extend(head_rx);
        for rx in relay_rx {
            receivers.extend(rx);
        }
        (head, receivers, relays)
    }

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn payloads_reach_every_node_bitwise() {
        // Parts smaller than the payloads and not dividing them, so forwarding overlaps receiving.
        let (mut head, mut rxs, relays) = chain(&[1, 2, 0, 1], 1000).await;
        assert_eq!(head.receivers(), 4);
        let payloads = [
            pattern(10_000, 1),
            pattern(1, 2),
            Vec::new(),
            pattern(4096, 3),
        ];
        let readers: Vec<_> = rxs
            .drain(..)
            .map(|mut rx| {
                tokio::spawn(async move {
                    let mut got = Vec::new();
                    for _ in 0..4 {
                        got.push(rx.recv_with(|b| b.to_vec()).await.unwrap());
                    }
                    let rank = rx.rank();
                    rx.send(format!("done {rank}").as_bytes()).await.unwrap();
                    got
                })
            })
            .collect();
        for p in &payloads {
            head.send(p).await.unwrap();
        }
        head.flush().await.unwrap();
        for r in 0..4 {
            assert_eq!(head.recv_from(r).await.unwrap(), local_done(r));
        }
        for reader in readers {
            assert_eq!(reader.await.unwrap(), payloads);
        }
        assert!(matches!(
            head.recv_from(4).await,
            Err(TransportError::NoSuchRank {
                rank: 4,
                receivers: 4
            })
        ));
        drop(head);
        for relay in relays {
            assert_eq!(relay.await.unwrap().unwrap(), RelayEnd::Closed);
        }
    }

    /// As [`chain`], every node's local fan-out elastic with waits bounded by `timeout`; also returns each
    /// node's joiner (the stand-in for a restarted rollout on that node).
    async fn elastic_chain(
        local: &[usize],
        timeout: Duration,
    ) -> (
        Sender,
        Vec<Receiver>,
        Vec<crate::transport::InProcJoiner>,
        Vec<tokio::task::JoinHandle<Result<RelayEnd, TransportError>>>,
    ) {
        let mut listeners = Vec::new();
        for _ in 1..local.len() {
            listeners.push(listen().await);
        }
        let addrs: Vec<String> = listeners.iter().map(|(_, a)| a.clone()).collect();
        let mut receivers = Vec::new();
        let mut joiners = Vec::new();
        let (head_local, head_rx, head_joiner) =
            crate::transport::inproc_channel_elastic(local[0], timeout);
        joiners.push(head_joiner);
        let mut relays = Vec::new();
        let mut relay_rx = Vec::new();
        for (i, (listener, _)) in listeners.into_iter().enumerate() {
            let (tx, rx, joiner) = crate::transport::inproc_channel_elastic(local[i + 1], timeout);
            relay_rx.push(rx);
            joiners.push(joiner);
            let next = addrs.get(i + 1).cloned();
            let mut c = cfg(&format!("node {}", i + 1), b"secret", 100);
            c.timeout = timeout;
            relays.push(tokio::spawn(async move {
                let relay = ChainRelay::establish(&listener, next.as_deref(), tx, c).await?;
                relay.serve().await
            }));
        }
        let mut c = cfg("node 0", b"secret", 100);
        c.timeout = timeout;
        let head = ChainSender::connect(Some(head_local), addrs.first().map(String::as_str), c)
            .await
            .unwrap();
        receivers.extend(head_rx);
        for rx in relay_rx {
            receivers.extend(rx);
        }
        (head, receivers, joiners, relays)
    }

    async fn read(rx: &mut Receiver) -> Vec<u8> {
        rx.recv_with(<[u8]>::to_vec).await.unwrap()
    }

    fn about(err: &TransportError) -> Option<(&'static str, usize)> {
        match err {
            TransportError::PeerGone {
                peer: Peer::Receiver(r),
                ..
            } => Some(("gone", *r)),
            TransportError::Timeout {
                peer: Peer::Receiver(r),
                ..
            } => Some(("silent", *r)),
            _ => None,
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_elastic_chain_readmits_a_receiver_two_nodes_down_and_addresses_it_alone() {
        // Ranks: 0 on the head, 1 and 2 on node 1, 3 on node 2 (reached through node 1).
        let (mut head, rxs, joiners, relays) =
            elastic_chain(&[1, 2, 1], Duration::from_secs(2)).await;
        assert!(head.is_elastic());
        assert_eq!(head.receivers(), 4);
        let mut rxs: Vec<Option<Receiver>> = rxs.into_iter().map(Some).collect();
        // Rollouts 1 (node 1) and 3 (node 2) die.
        drop(rxs[1].take());
        drop(rxs[3].take());
        // A broadcast reaches the live ones only, and the flush reports who is detached.
        head.send(b"v1").await.unwrap();
        for r in [0, 2] {
            assert_eq!(read(rxs[r].as_mut().unwrap()).await, b"v1");
        }
        head.flush().await.unwrap();
        assert_eq!(head.live(), vec![0, 2]);
        // Requests about a dead remote receiver name it (by global rank); the chain goes on.
        let err = head.send_to(3, b"nobody").await.unwrap_err();
        assert_eq!(about(&err), Some(("gone", 3)), "{err}");
        let err = head.recv_from(1).await.unwrap_err();
        assert_eq!(about(&err), Some(("gone", 1)), "{err}");
        // Rank 1 has no successor: the owning node says it did not come in time.
        let err = head.wait_joined(1).await.unwrap_err();
        assert_eq!(about(&err), Some(("silent", 1)), "{err}");
        // A successor of rank 3 joins node 2 (its local rank 0) and is caught up alone.
        let mut new3 = joiners[2].join(0).unwrap();
        head.wait_joined(3).await.unwrap();
        assert!(head.live().contains(&3));
        head.send_to(3, &pattern(1000, 9)).await.unwrap();
        assert_eq!(read(&mut new3).await, pattern(1000, 9));
        head.send_to(2, b"only 2").await.unwrap();
        assert_eq!(read(rxs[2].as_mut().unwrap()).await, b"only 2");
        // The head's own receivers are addressed through its local fan-out.
        head.send_to(0, b"only 0").await.unwrap();
        assert_eq!(read(rxs[0].as_mut().unwrap()).await, b"only 0");
        new3.send(b"held 1").await.unwrap();
        assert_eq!(head.recv_from(3).await.unwrap(), b"held 1");
        // The next broadcast reaches it with the others; nobody saw the targeted payloads.
        head.send(b"v2").await.unwrap();
        for r in [0, 2] {
            assert_eq!(read(rxs[r].as_mut().unwrap()).await, b"v2");
        }
        assert_eq!(read(&mut new3).await, b"v2");
        head.flush().await.unwrap();
        assert_eq!(head.live(), vec![0, 2, 3]);
        // Out of range is the caller's mistake, not a missing receiver.
        assert!(matches!(
            head.wait_joined(4).await,
            Err(TransportError::NoSuchRank {
                rank: 4,
                receivers: 4
            })
        ));
        drop(head);
        for relay in relays {
            assert_eq!(relay.await.unwrap().unwrap(), RelayEnd::Closed);
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_chain_with_a_node_that_is_not_elastic_admits_no_late_receiver() {
        // Node 1's fan-out is not elastic: the head cannot address or readmit its receivers.
        let (mut head, mut rxs, relays) = chain(&[1, 1], 64).await;
        assert!(!head.is_elastic());
        let err = head.wait_joined(1).await.unwrap_err();
        assert!(matches!(err, TransportError::Config { .. }), "{err}");
        let err = head.send_to(1, b"x").await.unwrap_err();
        assert!(matches!(err, TransportError::Config { .. }), "{err}");
        // The chain still works for everyone.
        head.send(b"all").await.unwrap();
        for rx in &mut rxs {
            assert_eq!(read(rx).await, b"all");
        }
        head.flush().await.unwrap();
        assert_eq!(head.live(), vec![0, 1]);
        drop(head);
        for relay in relays {
            assert_eq!(relay.await.unwrap().unwrap(), RelayEnd::Closed);
        }
    }

    /// What receiver `r` of `chain(&[1, 2, 0, 1])` reports: its rank within its node's local channel.
    fn local_done(r: usize) -> Vec<u8> {
        let local_rank = [0, 0, 1, 0][r];
        format!("done {local_rank}").into_bytes()
    }
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_peer_without_the_token_is_refused_and_the_chain_goes_on() {
        let (listener, addr) = listen().await;
        let (tx, mut rxs) = inproc_channel_with_timeout(1, T);
        let relay = tokio::spawn(async move {
            let relay =
                ChainRelay::establish(&listener, None, tx, cfg("node 1", b"secret", 64)).await?;
            relay.serve().await
        });
        // An impostor: refused, told so, and the relay keeps listening.
        let err = ChainSender::connect(None, Some(&addr), cfg("impostor", b"guess", 64))
            .await
            .unwrap_err();
        assert!(
            matches!(&err, TransportError::Auth { peer, .. } if peer.contains("node 1")),
            "{err}"
        );
        // Something that is not rlsync at all.
        let mut junk = TcpStream::connect(&addr).await.unwrap();
        junk.write_all(b"GET / HTTP/1.0\r\n\r\n").await.unwrap();
        drop(junk);
        // The real head still gets through.
        let mut head = ChainSender::connect(None, Some(&addr), cfg("node 0", b"secret", 64))
            .await
            .unwrap();
        head.send(b"weights").await.unwrap();
        assert_eq!(rxs[0].recv_with(<[u8]>::to_vec).await.unwrap(), b"weights");
        head.flush().await.unwrap();
        drop(head);
        assert_eq!(relay.await.unwrap().unwrap(), RelayEnd::Closed);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_head_without_the_token_is_not_trusted() {
        // The relay side proves the token too: a head cannot be fooled by a listener without it.
        let (listener, addr) = listen().await;
        let fake = tokio::spawn(async move {
            let (tx, _rxs) = inproc_channel_with_timeout(1, T);
            ChainRelay::establish(&listener, None, tx, cfg("fake node", b"other", 64)).await
        });
        let err = ChainSender::connect(None, Some(&addr), cfg("node 0", b"secret", 64))
            .await
            .unwrap_err();
        assert!(
            matches!(&err, TransportError::Auth { peer, .. } if peer.contains("fake node")),
            "{err}"
        );
        fake.abort();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_frame_that_is_no_link_message_ends_the_relay_naming_the_sender_and_why() {
        let (listener, addr) = listen().await;
        let (tx, _rxs) = inproc_channel_with_timeout(1, T);
        let relay = tokio::spawn(async move {
            let relay =
                ChainRelay::establish(&listener, None, tx, cfg("node 1", b"secret", 64)).await?;
            relay.serve().await
        });
        // A head that proves the token and completes set-up, then sends an unknown tag.
        let mut s = TcpStream::connect(&addr).await.unwrap();
        auth::client(&mut s, MAGIC, b"secret", "odd head", &addr)
            .await
            .unwrap();
        s.write_all(&encode_first_rank(0)).await.unwrap();
        let mut extent = [0; Extent::LEN];
        s.read_exact(&mut extent).await.unwrap();
        assert_eq!(
            Extent::decode(&extent),
            Ok(Extent {
                receivers: 1,
                elastic: false
            })
        );
        s.write_all(&[0x07]).await.unwrap();
        let err = relay.await.unwrap().unwrap_err();
        assert!(
            matches!(
                &err,
                TransportError::Link { peer: Peer::Node(p), source: LinkError::UnknownTag { tag: 7 } }
                    if p.contains("odd head")
            ),
            "{err:?}"
        );
        // The relay told its previous node why it stopped.
        let mut rest = Vec::new();
        s.read_to_end(&mut rest).await.unwrap();
        let answer = Answer::decode(&rest).unwrap();
        assert!(
            matches!(&answer, Answer::Error(text) if text.starts_with("node 1: ") && text.contains("unknown frame tag 0x07")),
            "{answer:?}"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lost_node_is_named() {
        // node 2 dies: node 1 reports it upstream and the head's flush names it.
        let (l1, a1) = listen().await;
        let (l2, a2) = listen().await;
        let (tx1, rx1) = inproc_channel_with_timeout(1, T);
        let drain = tokio::spawn(async move {
            for mut rx in rx1 {
                while rx.recv_with(|_| ()).await.is_ok() {}
            }
        });
        let relay1 = tokio::spawn(async move {
            let r = ChainRelay::establish(&l1, Some(&a2), tx1, cfg("node 1", b"k", 16)).await?;
            r.serve().await
        });
        let relay2 = tokio::spawn(async move {
            let (tx2, rx2) = inproc_channel_with_timeout(1, T);
            let r = ChainRelay::establish(&l2, None, tx2, cfg("node 2", b"k", 16)).await;
            drop(rx2);
            r
        });
        let mut head = ChainSender::connect(None, Some(&a1), cfg("node 0", b"k", 16))
            .await
            .unwrap();
        // node 2 completed set-up; now it goes away (its relay and socket are dropped).
        drop(relay2.await.unwrap().unwrap());
        let _ = head.send(&[7; 100]).await;
        let err = head.flush().await.unwrap_err();
        let text = err.to_string();
        assert!(text.contains("node 1") && text.contains("node 2"), "{text}");
        assert!(relay1.await.unwrap().is_err());
        drain.abort();
    }
}
