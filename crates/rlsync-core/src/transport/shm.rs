//! Same-host shared-memory backend: payloads written once into POSIX shm slots, read in place by every receiver.
//!
//! The sender listens on a Unix socket only until all N receivers have said hello, then removes the socket
//! file. Each of the `slots` payload slots is backed by its own segment, so one slot can be refilled or
//! replaced by a bigger segment while receivers still read another. Per payload there is one small `Publish`
//! frame to each receiver and one `Released` frame back. A segment's name is unlinked as soon as every
//! receiver has mapped it, so only a crash inside that short window can leave a file behind
//! ([`remove_leftovers`] sweeps those). A wait that times out leaves the channel usable (the caller may wait
//! again or give up); a dead receiver, a failed socket write or a protocol violation breaks it: the sender
//! unlinks every segment and refuses further use with [`TransportError::Broken`].
//!
//! An *elastic* channel (`ShmConfig::elastic`) keeps listening for the sender's lifetime: a dead receiver is
//! detached instead (payloads go on to the live ranks), and a new receiver for a detached rank is welcomed at
//! once and admitted as soon as its predecessor is known to be gone ([`Sender::wait_joined`]). Each rank
//! learns of a slot's segment at its first payload in that slot; a newcomer that needs a segment whose name
//! is already unlinked gets a fresh segment. Payloads may target one rank ([`Sender::send_to_with`]).

mod receiver;
mod segment;

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::unix::OwnedWriteHalf;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::fanout::{Event, EventTx, Fanout, Origin};
use super::frame::{Down, MAX_FRAME, SegmentInfo, Up, VERSION};
use super::{DEFAULT_SLOTS, DEFAULT_TIMEOUT, Peer, SendBackend, Sender, Target, TransportError};
use crate::protocol::frame::FrameReader;
pub use receiver::ShmReceiver;
pub(crate) use segment::validate_name;
use segment::{Namer, OwnedSegment};

/// Segments grow in steps of this many bytes (and at least by half their size) to avoid remapping often.
const GROW_STEP: usize = 1 << 20;

const OP_SEND: &str = "sending a payload";
const OP_FLUSH: &str = "flushing";
const OP_RECV_FROM: &str = "receiving an upstream message";

const OP_JOIN: &str = "waiting for a receiver to rejoin";
const OP_REPORTS: &str = "waiting for receivers' reports";

/// Errors after which the channel is still consistent: a wait for receivers that ran out of time (nothing was
/// half-written), or a caller mistake (bad rank, impossible size; nothing was published). On an elastic
/// channel a gone receiver only detaches its rank.
fn recoverable(err: &TransportError, elastic: bool) -> bool {
    match err {
        TransportError::Timeout { op, .. } => {
            [OP_SEND, OP_FLUSH, OP_RECV_FROM, OP_JOIN, OP_REPORTS].contains(op)
        }
        TransportError::NoSuchRank { .. } | TransportError::TooLarge { .. } => true,
        TransportError::PeerGone { peer, .. } => elastic && *peer != Peer::Sender,
        _ => false,
    }
}

/// How the shm sender is set up.
#[derive(Debug, Clone)]
pub struct ShmConfig {
    /// Unix socket the receivers connect to; exists only until every receiver has joined.
    pub socket_path: PathBuf,
    /// Segment names start with `<segment_prefix>.`; 1..=191 characters of `[A-Za-z0-9_.-]`.
    pub segment_prefix: String,
    /// Number of receivers (ranks `0..receivers`) that must join.
    pub receivers: usize,
    /// Bound on every wait: joining, a free slot, releases, upstream messages, socket writes.
    pub timeout: Duration,
    /// Payloads in flight at once (at least 1; 2 lets the sender fill one while receivers read the other).
    pub slots: usize,
    /// Smallest segment a slot gets when it first needs one (segments are created at first use, grown on demand).
    pub initial_capacity: usize,
    /// Keep listening after the initial join: a dead receiver is detached and a new one may take its rank.
    pub elastic: bool,
}

impl Default for ShmConfig {
    fn default() -> Self {
        ShmConfig {
            socket_path: PathBuf::new(),
            segment_prefix: "rlsync".to_owned(),
            receivers: 1,
            timeout: DEFAULT_TIMEOUT,
            slots: DEFAULT_SLOTS,
            initial_capacity: 0,
            elastic: false,
        }
    }
}

/// Remove what a crashed run left behind: segments `<segment_prefix>.<pid>.…` whose process is gone.
/// Segments of live processes are kept, so sweeping while another run uses the prefix is safe.
/// Returns the number of segments removed.
pub fn remove_leftovers(segment_prefix: &str) -> Result<usize, TransportError> {
    segment::sweep(segment_prefix)
}

/// Whether `pid` is a running process (a zombie is not), as the leftover sweeps judge owners.
pub fn pid_alive(pid: i32) -> bool {
    segment::pid_alive(pid)
}

/// The longest path a Unix socket address holds (`sun_path` is 108 bytes with its terminating NUL).
pub const MAX_SOCKET_PATH: usize = 107;

/// The length of `path` in bytes when it is longer than [`MAX_SOCKET_PATH`] (the one rule every socket of
/// rlsync is checked by before binding or connecting; the OS's own error, "path must be shorter than SUN_LEN",
/// names neither path nor length).
pub fn socket_path_too_long(path: &Path) -> Option<usize> {
    let len = path.as_os_str().len();
    (len > MAX_SOCKET_PATH).then_some(len)
}

/// A socket path that fits [`MAX_SOCKET_PATH`], or the config error naming it and its length.
pub fn check_socket_path(path: &Path) -> Result<(), TransportError> {
    if let Some(len) = socket_path_too_long(path) {
        return Err(TransportError::Config {
            reason: format!(
                "socket path {} is {len} bytes, more than the {MAX_SOCKET_PATH} a Unix socket address holds; choose a shorter socket directory",
                path.display()
            ),
        });
    }
    Ok(())
}

/// Remove the socket file at `path` if nobody listens on it (left by a crashed sender). Returns whether a
/// file was removed; a live listener or a non-socket file is left alone (and reported as an error).
pub fn remove_stale_socket(path: &Path) -> Result<bool, TransportError> {
    use std::os::unix::fs::FileTypeExt;
    let meta = match std::fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(source) => {
            return Err(TransportError::Io {
                op: "inspecting the socket path",
                source,
            });
        }
    };
    if !meta.file_type().is_socket() {
        return Err(TransportError::Config {
            reason: format!("{} exists and is not a socket", path.display()),
        });
    }
    match std::os::unix::net::UnixStream::connect(path) {
        Ok(_) => Err(TransportError::Config {
            reason: format!("{} is in use by a live listener", path.display()),
        }),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
            std::fs::remove_file(path).map_err(|source| TransportError::Io {
                op: "removing a stale socket",
                source,
            })?;
            Ok(true)
        }
        Err(source) => Err(TransportError::Io {
            op: "probing the socket path",
            source,
        }),
    }
}

/// Removes the listening socket's file when the accept phase ends, however it ends.
struct SocketFile(PathBuf);

impl Drop for SocketFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Streams of receivers that joined late, by rank, until the sender attaches them.
type Mailbox = super::fanout::Mailbox<Joined>;

/// The sending end of a shared-memory channel.
#[derive(Debug)]
pub struct ShmSender {
    fanout: Fanout,
    /// `None`: the rank's receiver is gone (elastic) and no successor is attached yet.
    writers: Vec<Option<OwnedWriteHalf>>,
    reader_tasks: Vec<Option<JoinHandle<()>>>,
    segments: Vec<Option<OwnedSegment>>,
    /// The current segment of each slot, as announced.
    infos: Vec<Option<SegmentInfo>>,
    /// `known[rank][slot]`: the segment generation of the slot that rank has been told about.
    known: Vec<Vec<Option<u64>>>,
    namer: Namer,
    initial_capacity: usize,
    broken: Option<String>,
    /// Elastic channels: the late joiners' streams, the task accepting them, the socket file it listens on.
    late: Option<Late>,
    events: EventTx,
}

struct Late {
    mailbox: Mailbox,
    acceptor: JoinHandle<()>,
    /// Ranks attached since the caller last waited for them.
    fresh: Vec<usize>,
    _socket_file: SocketFile,
}

impl std::fmt::Debug for Late {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Late").field("fresh", &self.fresh).finish()
    }
}

impl std::fmt::Debug for Joined {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Joined").field("rank", &self.rank).finish()
    }
}

/// Elastic channels: accept receivers for the sender's lifetime, welcome each at once and hand it over.
fn spawn_acceptor(
    listener: UnixListener,
    receivers: usize,
    welcome: Vec<u8>,
    timeout: Duration,
    mailbox: Mailbox,
    events: EventTx,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut hellos = tokio::task::JoinSet::new();
        loop {
            tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => {
                        hellos.spawn(read_hello(stream, receivers, Instant::now() + timeout));
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "accepting a late receiver failed");
                        return;
                    }
                },
                Some(done) = hellos.join_next() => {
                    let Ok(Ok(mut j)) = done else { continue };
                    let rank = j.rank;
                    if write_frame(&mut j.writer, &welcome, timeout, "welcoming a receiver", Peer::Receiver(rank)).await.is_err() {
                        continue;
                    }
                    tracing::info!(rank, "a receiver joined late");
                    // A joiner not yet attached is replaced: its stream closes, it fails and may retry.
                    let Some(join) = mailbox.put(rank, j) else { continue };
                    if events.send((Origin { rank, join }, Event::Joined)).is_err() {
                        return;
                    }
                }
            }
        }
    })
}

pub(crate) async fn write_frame(
    writer: &mut OwnedWriteHalf,
    frame: &[u8],
    timeout: Duration,
    op: &'static str,
    peer: Peer,
) -> Result<(), TransportError> {
    match tokio::time::timeout(timeout, writer.write_all(frame)).await {
        Err(_) => Err(TransportError::Timeout { op, peer, timeout }),
        Ok(Ok(())) => Ok(()),
        Ok(Err(e))
            if matches!(
                e.kind(),
                std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
            ) =>
        {
            Err(TransportError::PeerGone { op, peer })
        }
        Ok(Err(source)) => Err(TransportError::Io { op, source }),
    }
}

fn protocol(peer: Peer, reason: impl std::fmt::Display) -> TransportError {
    TransportError::Protocol {
        peer,
        reason: reason.to_string(),
    }
}

/// A joined receiver's stream, between its hello and the welcome.
struct Joined {
    rank: usize,
    reader: FrameReader<tokio::net::unix::OwnedReadHalf>,
    writer: OwnedWriteHalf,
}

/// Send a refusal (best effort) before dropping the stream.
async fn refuse(writer: &mut OwnedWriteHalf, reason: &str, deadline: Instant) {
    tracing::warn!(%reason, "refused a receiver");
    if let Ok(frame) = (Down::Reject {
        reason: reason.to_owned(),
    })
    .encode()
    {
        let _ = tokio::time::timeout_at(deadline, writer.write_all(&frame)).await;
    }
}

/// Read one receiver's hello; an `Err` is a refusal reason (already answered, the stream is dropped).
async fn read_hello(
    stream: UnixStream,
    receivers: usize,
    deadline: Instant,
) -> Result<Joined, String> {
    let (read, mut writer) = stream.into_split();
    let mut reader = FrameReader::new(read, MAX_FRAME);
    let frame = match tokio::time::timeout_at(deadline, reader.next()).await {
        Err(_) => return Err("no hello before the deadline".to_owned()),
        Ok(Ok(Some(frame))) => frame,
        Ok(Ok(None) | Err(_)) => return Err("connection closed before hello".to_owned()),
    };
    let refusal = match Up::decode(&frame) {
        Ok(Up::Hello { version, .. }) if version != VERSION => {
            format!("protocol version {version} is not the sender's {VERSION}")
        }
        Ok(Up::Hello { rank, .. }) if rank as usize >= receivers => {
            format!("rank {rank} is out of range for {receivers} receivers")
        }
        Ok(Up::Hello { rank, .. }) => {
            return Ok(Joined {
                rank: rank as usize,
                reader,
                writer,
            });
        }
        _ => "first frame is not a hello".to_owned(),
    };
    refuse(&mut writer, &refusal, deadline).await;
    Err(refusal)
}

/// Accept connections until every rank in `0..receivers` has said hello, reading hellos concurrently so a
/// silent connection cannot hold up the others.
async fn accept_all(
    listener: &UnixListener,
    receivers: usize,
    wait_for: usize,
    deadline: Instant,
    timeout: Duration,
    elastic: bool,
) -> Result<Vec<Option<Joined>>, TransportError> {
    let mut joined: Vec<Option<Joined>> = (0..receivers).map(|_| None).collect();
    let mut hellos = tokio::task::JoinSet::new();
    while joined.iter().flatten().count() < wait_for {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, _) = accepted.map_err(|source| TransportError::Io { op: "accepting a receiver", source })?;
                hellos.spawn(read_hello(stream, receivers, deadline));
            }
            Some(done) = hellos.join_next() => match done {
                Ok(Ok(mut j)) => match joined.get_mut(j.rank) {
                    Some(entry @ None) => *entry = Some(j),
                    // Elastic: a second hello for a rank comes from a restarted receiver (the first one died
                    // before the sender started); the newest stream takes the rank.
                    Some(entry) if elastic => {
                        tracing::info!(rank = j.rank, "a receiver rejoined before the sender started; the newest takes the rank");
                        *entry = Some(j);
                    }
                    _ => refuse(&mut j.writer, &format!("rank {} has already joined", j.rank), deadline).await,
                },
                Ok(Err(_refused)) => {}
                Err(e) => tracing::warn!(error = %e, "hello task failed"),
            },
            () = tokio::time::sleep_until(deadline) => {
                let missing = joined.iter().enumerate().filter(|(_, j)| j.is_none()).map(|(rank, _)| rank).collect();
                return Err(TransportError::Timeout { op: "accepting receivers", peer: Peer::Receivers(missing), timeout });
            }
        }
    }
    Ok(joined)
}

/// Forward one receiver's upstream frames as events (from `origin`) until its stream ends.
fn spawn_reader(
    origin: Origin,
    mut reader: FrameReader<tokio::net::unix::OwnedReadHalf>,
    events: EventTx,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let event = match reader.next().await {
                Ok(Some(frame)) => match Up::decode(&frame) {
                    Ok(Up::Released { seq }) => Event::Released { seq },
                    Ok(Up::Mapped { slot, generation }) => Event::Mapped {
                        slot: slot as usize,
                        generation,
                    },
                    Ok(Up::Message(msg)) => Event::Message(msg),
                    Ok(Up::Hello { .. }) => Event::Violation("a second hello".to_owned()),
                    Err(e) => Event::Violation(crate::error_chain(&e)),
                },
                Ok(None) => Event::Gone,
                Err(e) => {
                    tracing::debug!(rank = origin.rank, error = %crate::error_chain(&e), "receiver stream failed");
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

impl ShmSender {
    /// Listen on `cfg.socket_path` (replacing a stale socket file), accept all `cfg.receivers` receivers within
    /// `cfg.timeout`, then remove the socket file. Hellos with a bad version or rank, or a duplicate rank, are
    /// refused and do not count.
    pub async fn bind(cfg: ShmConfig) -> Result<Sender, TransportError> {
        let all = cfg.receivers;
        Self::bind_waiting_for(cfg, all).await
    }

    /// As [`ShmSender::bind`], returning once `wait_for` of the receivers joined (elastic channels only; `bind`
    /// waits for all): the ranks still missing start detached and join later like the successor of a dead
    /// receiver (welcomed as late joiners, taken in by [`Sender::wait_joined`] / [`Sender::joined_ranks`]).
    pub async fn bind_waiting_for(
        cfg: ShmConfig,
        wait_for: usize,
    ) -> Result<Sender, TransportError> {
        if wait_for > cfg.receivers || (!cfg.elastic && wait_for != cfg.receivers) {
            return Err(TransportError::Config {
                reason: format!(
                    "waiting for {wait_for} of {} receivers needs an elastic channel and at most that many",
                    cfg.receivers
                ),
            });
        }
        segment::validate_prefix(&cfg.segment_prefix)?;
        if cfg.socket_path.as_os_str().is_empty() {
            return Err(TransportError::Config {
                reason: "socket_path is empty".to_owned(),
            });
        }
        check_socket_path(&cfg.socket_path)?;
        if cfg.slots == 0 {
            return Err(TransportError::Config {
                reason: "slots must be at least 1".to_owned(),
            });
        }
        let wire_receivers = u32::try_from(cfg.receivers).map_err(|_| TransportError::Config {
            reason: format!("{} receivers is too many", cfg.receivers),
        })?;
        remove_stale_socket(&cfg.socket_path)?;
        let listener =
            UnixListener::bind(&cfg.socket_path).map_err(|source| TransportError::Io {
                op: "binding the socket",
                source,
            })?;
        let socket_file = SocketFile(cfg.socket_path.clone());

        // Same-uid processes are trusted anyway; others must not even connect.
        std::fs::set_permissions(
            &cfg.socket_path,
            std::os::unix::fs::PermissionsExt::from_mode(0o600),
        )
        .map_err(|source| TransportError::Io {
            op: "restricting the socket to its owner",
            source,
        })?;
        let joined = accept_all(
            &listener,
            cfg.receivers,
            wait_for,
            Instant::now() + cfg.timeout,
            cfg.timeout,
            cfg.elastic,
        )
        .await?;

        let slots = u32::try_from(cfg.slots).map_err(|_| TransportError::Config {
            reason: "too many slots".to_owned(),
        })?;
        let welcome_as = |late: bool| {
            Down::Welcome {
                version: VERSION,
                receivers: wire_receivers,
                slots,
                late,
            }
            .encode()
            .map_err(|e| protocol(Peer::Sender, e))
        };
        let welcome = welcome_as(false)?;
        let (event_tx, event_rx) = mpsc::unbounded_channel();
        let mut writers = Vec::with_capacity(cfg.receivers);
        let mut reader_tasks = Vec::with_capacity(cfg.receivers);
        let mut unwelcome = Vec::new();
        for (rank, j) in joined.into_iter().enumerate() {
            let Some(j) = j else {
                // Not joined yet (elastic, `wait_for`): starts detached, joins late.
                unwelcome.push(rank);
                writers.push(None);
                reader_tasks.push(None);
                continue;
            };
            let mut writer = j.writer;
            match write_frame(
                &mut writer,
                &welcome,
                cfg.timeout,
                "welcoming a receiver",
                Peer::Receiver(rank),
            )
            .await
            {
                Ok(()) => {}
                // Elastic: a receiver that died since its hello starts detached; a successor may take its rank.
                Err(TransportError::PeerGone { .. } | TransportError::Io { .. }) if cfg.elastic => {
                    tracing::warn!(rank, "a receiver vanished before its welcome; detached");
                    unwelcome.push(rank);
                    writers.push(None);
                    reader_tasks.push(None);
                    continue;
                }
                Err(err) => return Err(err),
            }
            writers.push(Some(writer));
            reader_tasks.push(Some(spawn_reader(
                Origin::first(rank),
                j.reader,
                event_tx.clone(),
            )));
        }
        let mut fanout = Fanout::new(cfg.receivers, cfg.slots, cfg.timeout, event_rx);
        let late = if cfg.elastic {
            fanout = fanout.elastic();
            for rank in unwelcome {
                fanout.detach(rank);
            }
            let welcome = welcome_as(true)?;
            let mailbox = Mailbox::new(cfg.receivers);
            Some(Late {
                acceptor: spawn_acceptor(
                    listener,
                    cfg.receivers,
                    welcome,
                    cfg.timeout,
                    mailbox.clone(),
                    event_tx.clone(),
                ),
                mailbox,
                fresh: Vec::new(),
                _socket_file: socket_file,
            })
        } else {
            drop(listener);
            drop(socket_file);
            None
        };
        let sender = ShmSender {
            fanout,
            writers,
            reader_tasks,
            segments: (0..cfg.slots).map(|_| None).collect(),
            infos: (0..cfg.slots).map(|_| None).collect(),
            known: (0..cfg.receivers).map(|_| vec![None; cfg.slots]).collect(),
            namer: Namer::new(&cfg.segment_prefix),
            initial_capacity: cfg.initial_capacity,
            broken: None,
            late,
            events: event_tx,
        };
        Ok(Sender::Shm(sender))
    }

    /// Attach the streams of receivers the fanout admitted (elastic channels).
    fn attach_admitted(&mut self) {
        let admitted = self.fanout.take_admitted();
        let Some(late) = self.late.as_mut() else {
            return;
        };
        for rank in admitted {
            let Some((join, j)) = late.mailbox.take(rank) else {
                // Admitted without a stream (the fanout's join numbers rule it out): not live.
                self.fanout.detach(rank);
                continue;
            };
            self.fanout.attached(rank, join);
            if let Some(w) = self.writers.get_mut(rank) {
                *w = Some(j.writer);
            }
            if let Some(t) = self.reader_tasks.get_mut(rank)
                && let Some(old) = t.replace(spawn_reader(
                    Origin { rank, join },
                    j.reader,
                    self.events.clone(),
                ))
            {
                old.abort();
            }
            if let Some(k) = self.known.get_mut(rank) {
                k.iter_mut().for_each(|g| *g = None);
            }
            late.fresh.retain(|&r| r != rank);
            late.fresh.push(rank);
        }
    }

    /// Take events and attach joiners; drop the writers of detached ranks.
    fn housekeep(&mut self) -> Result<(), TransportError> {
        let polled = self.fanout.poll_events();
        self.attach_admitted();
        self.unlink_mapped();
        for (rank, w) in self.writers.iter_mut().enumerate() {
            if self.fanout.is_elastic() && self.fanout.is_gone(rank) && w.is_some() {
                *w = None;
            }
        }
        polled
    }

    async fn try_wait_joined(&mut self, rank: usize) -> Result<(), TransportError> {
        if self.late.is_none() {
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

    fn check_usable(&self) -> Result<(), TransportError> {
        match &self.broken {
            Some(first) => Err(TransportError::Broken {
                first: first.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Record a fatal error: from now on the channel refuses use, and no segment name stays behind.
    fn fail(&mut self, err: TransportError) -> TransportError {
        if self.broken.is_none() {
            self.broken = Some(crate::error_chain(&err));
        }
        self.segments
            .iter_mut()
            .flatten()
            .for_each(OwnedSegment::unlink);
        err
    }

    /// Housekeeping after every public call: unlink what is mapped everywhere, break the channel on fatal errors.
    fn settle<T>(&mut self, result: Result<T, TransportError>) -> Result<T, TransportError> {
        self.unlink_mapped();
        match result {
            Err(err) if !recoverable(&err, self.fanout.is_elastic()) => Err(self.fail(err)),
            other => other,
        }
    }

    /// Unlink the segments every receiver has mapped by now.
    fn unlink_mapped(&mut self) {
        for (slot, generation) in self.fanout.drain_fully_mapped() {
            if let Some(Some(seg)) = self.segments.get_mut(slot)
                && seg.generation() == generation
            {
                seg.unlink();
            }
        }
    }

    /// Give `slot` a new segment for payloads of at least `len` bytes, announced with the slot's next payload.
    fn replace_segment(&mut self, slot: usize, len: usize) -> Result<(), TransportError> {
        let old = self
            .segments
            .get(slot)
            .and_then(Option::as_ref)
            .map_or(0, OwnedSegment::size);
        let capacity = len
            .saturating_add(segment::PAYLOAD_OFFSET)
            .max(old.saturating_add(old / 2))
            .div_ceil(GROW_STEP)
            .saturating_mul(GROW_STEP);
        let (generation, name) = self.namer.next();
        // Drop the old segment first: its memory is freed once receivers remap too.
        if let Some(entry) = self.segments.get_mut(slot) {
            *entry = None;
        }
        let seg = OwnedSegment::create(&name, generation, capacity)?;
        let info = SegmentInfo {
            generation,
            capacity: seg.size() as u64,
            name: seg.name().to_owned(),
        };
        if let Some(entry) = self.segments.get_mut(slot) {
            *entry = Some(seg);
        }
        if let Some(entry) = self.infos.get_mut(slot) {
            *entry = Some(info);
        }
        Ok(())
    }

    async fn try_send_with<R>(
        &mut self,
        target: Target,
        len: usize,
        fill: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, TransportError> {
        const OP: &str = OP_SEND;
        self.housekeep()?;
        self.fanout.require_all_alive(OP)?;
        // A late joiner sees only its own payloads until the caller took it in (`wait_joined`): it must be
        // caught up before it can follow the others.
        let fresh = self
            .late
            .as_ref()
            .map(|l| l.fresh.as_slice())
            .unwrap_or(&[]);
        let targets = self.fanout.targets(target, fresh, OP)?;
        let (seq, slot) = self.fanout.next();
        self.fanout.wait_slot_free(slot, OP).await?;
        self.housekeep()?;
        let segment = self.segments.get(slot).and_then(Option::as_ref);
        let current = segment.map_or(0, OwnedSegment::payload_capacity);
        let generation = segment.map(OwnedSegment::generation);
        // A target that has not mapped the current segment can no longer open it once its name is gone.
        let stale = segment.is_some_and(|seg| !seg.is_linked())
            && targets.iter().any(|&r| {
                self.known
                    .get(r)
                    .and_then(|k| k.get(slot))
                    .copied()
                    .flatten()
                    != generation
            });
        if len > current || stale {
            self.replace_segment(slot, len.max(self.initial_capacity).max(current))?;
        }
        let out = match self.segments.get_mut(slot).and_then(Option::as_mut) {
            Some(seg) => match seg.payload_mut(len) {
                Some(bytes) => fill(bytes),
                None => {
                    return Err(protocol(
                        Peer::Sender,
                        format!("slot {slot} segment is smaller than {len} bytes"),
                    ));
                }
            },
            None => fill(&mut []),
        };
        let info = self.infos.get(slot).cloned().flatten();
        let timeout = self.fanout.timeout();
        let mut reached = Vec::with_capacity(targets.len());
        for rank in targets {
            let told = self
                .known
                .get(rank)
                .and_then(|k| k.get(slot))
                .copied()
                .flatten();
            let announce = info.clone().filter(|i| Some(i.generation) != told);
            let frame = Down::Publish {
                seq,
                slot: slot as u32,
                len: len as u64,
                segment: announce.clone(),
            }
            .encode()
            .map_err(|e| protocol(Peer::Sender, e))?;
            let Some(writer) = self.writers.get_mut(rank).and_then(Option::as_mut) else {
                continue;
            };
            match write_frame(
                writer,
                &frame,
                timeout,
                "publishing a payload",
                Peer::Receiver(rank),
            )
            .await
            {
                Ok(()) => {}
                Err(TransportError::PeerGone { .. } | TransportError::Io { .. })
                    if self.fanout.is_elastic() =>
                {
                    tracing::warn!(rank, "a receiver vanished while publishing; detached");
                    self.fanout.detach(rank);
                    if let Some(w) = self.writers.get_mut(rank) {
                        *w = None;
                    }
                    continue;
                }
                Err(err) => return Err(err),
            }
            if let Some(i) = announce {
                self.fanout.announced_to(slot, i.generation, rank);
                if let Some(k) = self.known.get_mut(rank).and_then(|k| k.get_mut(slot)) {
                    *k = Some(i.generation);
                }
            }
            reached.push(rank);
        }
        if let Target::Rank(rank) = target
            && reached.is_empty()
        {
            self.fanout.published_to(seq, slot, &reached);
            return Err(TransportError::PeerGone {
                op: OP,
                peer: Peer::Receiver(rank),
            });
        }
        self.fanout.published_to(seq, slot, &reached);
        Ok(out)
    }
}

// `check_usable`, `housekeep`, `settle`, `try_send_with`, `try_wait_joined` above; the rest is shared.
super::fanout::fan_send_backend!(ShmSender, OP_SEND);

impl Drop for ShmSender {
    fn drop(&mut self) {
        for task in self.reader_tasks.iter().flatten() {
            task.abort();
        }
        if let Some(late) = &self.late {
            late.acceptor.abort();
        }
        // Segments unlink themselves on drop; the socket file is gone since `bind` returned.
    }
}
