//! The receiving end of the shm backend: joins by socket path + rank, maps announced segments, reads slots in place.

use std::path::Path;
use std::time::Duration;

use tokio::net::UnixStream;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::time::Instant;

use super::segment::{self, MappedSegment};
use super::write_frame;
use crate::protocol::frame::{FrameReader, ReadError};
use crate::transport::frame::{Down, MAX_FRAME, SegmentInfo, Up, VERSION};
use crate::transport::{Peer, Receiver, RecvBackend, TransportError};

/// Pause between connection attempts while the sender is not listening yet.
const CONNECT_RETRY: Duration = Duration::from_millis(20);

const RECV_OP: &str = "waiting for a payload";

/// A receiving end of a shared-memory channel.
#[derive(Debug)]
pub struct ShmReceiver {
    rank: usize,
    timeout: Duration,
    /// The caller's bound on the waits that follow (`set_bound`).
    bound: Option<(Instant, Duration)>,
    reader: FrameReader<OwnedReadHalf>,
    writer: OwnedWriteHalf,
    slots: Vec<Option<MappedSegment>>,
    next_seq: u64,
    broken: Option<String>,
    /// Welcomed by an elastic sender that had already started (see [`ShmReceiver::joined_late`]).
    late: bool,
}

fn protocol(reason: impl std::fmt::Display) -> TransportError {
    TransportError::Protocol {
        peer: Peer::Sender,
        reason: reason.to_string(),
    }
}

fn read_error(op: &'static str, err: ReadError) -> TransportError {
    match err {
        ReadError::Io(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::UnexpectedEof
            ) =>
        {
            TransportError::PeerGone {
                op,
                peer: Peer::Sender,
            }
        }
        ReadError::Io(source) => TransportError::Io { op, source },
        ReadError::TooLong(e) => protocol(e),
    }
}

/// Connect to `path`, retrying while the sender has not bound it yet.
async fn connect_stream(
    path: &Path,
    deadline: Instant,
    timeout: Duration,
) -> Result<UnixStream, TransportError> {
    loop {
        match UnixStream::connect(path).await {
            Ok(stream) => return Ok(stream),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
                ) =>
            {
                if Instant::now() + CONNECT_RETRY >= deadline {
                    return Err(TransportError::Timeout {
                        op: "connecting",
                        peer: Peer::Sender,
                        timeout,
                    });
                }
                tokio::time::sleep(CONNECT_RETRY).await;
            }
            Err(source) => {
                return Err(TransportError::Io {
                    op: "connecting",
                    source,
                });
            }
        }
    }
}

impl ShmReceiver {
    /// Join the sender listening on `socket_path` as `rank`. Waits (bounded by `timeout`) for the sender to
    /// listen and for every other receiver to join, since the sender welcomes all of them at once.
    pub async fn connect(
        socket_path: &Path,
        rank: usize,
        timeout: Duration,
    ) -> Result<Receiver, TransportError> {
        const OP: &str = "joining the sender";
        let deadline = Instant::now() + timeout;
        let wire_rank = u32::try_from(rank).map_err(|_| TransportError::NoSuchRank {
            rank,
            receivers: u32::MAX as usize,
        })?;
        super::check_socket_path(socket_path)?;
        let stream = connect_stream(socket_path, deadline, timeout).await?;
        let (read, mut writer) = stream.into_split();
        let mut reader = FrameReader::new(read, MAX_FRAME);
        let hello = Up::Hello {
            version: VERSION,
            rank: wire_rank,
        }
        .encode()
        .map_err(protocol)?;
        write_frame(&mut writer, &hello, timeout, OP, Peer::Sender).await?;
        let frame = match tokio::time::timeout_at(deadline, reader.next()).await {
            Err(_) => {
                return Err(TransportError::Timeout {
                    op: OP,
                    peer: Peer::Sender,
                    timeout,
                });
            }
            Ok(Ok(Some(frame))) => frame,
            Ok(Ok(None)) => {
                return Err(TransportError::PeerGone {
                    op: OP,
                    peer: Peer::Sender,
                });
            }
            Ok(Err(e)) => return Err(read_error(OP, e)),
        };
        let (slots, late) = match Down::decode(&frame).map_err(protocol)? {
            Down::Welcome {
                version,
                receivers,
                slots,
                late,
            } => {
                if version != VERSION {
                    return Err(protocol(format!(
                        "protocol version {version} is not ours ({VERSION})"
                    )));
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
            other => return Err(protocol(format!("expected a welcome, got {other:?}"))),
        };
        Ok(Receiver::Shm(ShmReceiver {
            rank,
            timeout,
            bound: None,
            reader,
            writer,
            slots: (0..slots).map(|_| None).collect(),
            next_seq: 0,
            broken: None,
            late,
        }))
    }

    /// Whether the sender had already started when it welcomed this receiver (an elastic channel's successor
    /// of a dead receiver): the syncer must rejoin (`WeightSyncer::rejoin_receiver`), not init.
    pub fn joined_late(&self) -> bool {
        self.late
    }

    fn check_usable(&self) -> Result<(), TransportError> {
        match &self.broken {
            Some(first) => Err(TransportError::Broken {
                first: first.clone(),
            }),
            None => Ok(()),
        }
    }

    fn fail(&mut self, err: TransportError) -> TransportError {
        if self.broken.is_none() {
            self.broken = Some(crate::error_chain(&err));
        }
        err
    }

    /// Map the announced segment into `slot` and tell the sender, so it can unlink the name.
    async fn map(&mut self, slot: usize, info: SegmentInfo) -> Result<(), TransportError> {
        if !segment::validate_name(&info.name) {
            return Err(protocol(format!(
                "announced segment name {:?} is not a plain name",
                info.name
            )));
        }
        let capacity = usize::try_from(info.capacity)
            .map_err(|_| protocol("segment capacity does not fit in memory"))?;
        let entry = self
            .slots
            .get_mut(slot)
            .ok_or_else(|| protocol(format!("slot {slot} out of range")))?;
        // Unmap the old generation first: its memory can go as soon as every process dropped it.
        *entry = None;
        // Only the sender unlinks a segment, and never one it announced before every receiver mapped it
        // (the slot is not released until then), unless it is going away: a missing segment means the sender
        // failed or exited, which is what this receiver's failure is about.
        let segment = MappedSegment::open(&info.name, capacity).map_err(|e| match e {
            TransportError::Segment { ref source, .. }
                if source.kind() == std::io::ErrorKind::NotFound =>
            {
                TransportError::PeerGone {
                    op: "mapping an announced segment (the sender removed it)",
                    peer: Peer::Sender,
                }
            }
            e => e,
        })?;
        *entry = Some(segment);
        let mapped = Up::Mapped {
            slot: slot as u32,
            generation: info.generation,
        }
        .encode()
        .map_err(protocol)?;
        write_frame(
            &mut self.writer,
            &mapped,
            self.timeout,
            "acknowledging a segment",
            Peer::Sender,
        )
        .await
    }

    async fn try_recv_with<R>(
        &mut self,
        read: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, TransportError> {
        const OP: &str = RECV_OP;
        let (deadline, timeout) = crate::transport::wait_deadline(self.timeout, self.bound);
        let frame = match tokio::time::timeout_at(deadline, self.reader.next()).await {
            Err(_) => {
                return Err(TransportError::Timeout {
                    op: OP,
                    peer: Peer::Sender,
                    timeout,
                });
            }
            Ok(Ok(Some(frame))) => frame,
            Ok(Ok(None)) => {
                return Err(TransportError::PeerGone {
                    op: OP,
                    peer: Peer::Sender,
                });
            }
            Ok(Err(e)) => return Err(read_error(OP, e)),
        };
        let (seq, slot, len, segment) = match Down::decode(&frame).map_err(protocol)? {
            Down::Publish {
                seq,
                slot,
                len,
                segment,
            } => (seq, slot as usize, len, segment),
            other => return Err(protocol(format!("expected a payload, got {other:?}"))),
        };
        // Payloads for other ranks (catch-ups) leave gaps; a receiver that joined late starts anywhere.
        if seq < self.next_seq {
            return Err(protocol(format!(
                "payload {seq} arrived after payload {}",
                self.next_seq - 1
            )));
        }
        if let Some(info) = segment {
            self.map(slot, info).await?;
        }
        let len =
            usize::try_from(len).map_err(|_| protocol("payload length does not fit in memory"))?;
        let out = if len == 0 {
            read(&[])
        } else {
            let bytes = self
                .slots
                .get(slot)
                .and_then(Option::as_ref)
                .and_then(|seg| seg.payload(len))
                .ok_or_else(|| {
                    protocol(format!(
                        "payload {seq} of {len} bytes does not fit slot {slot}"
                    ))
                })?;
            read(bytes)
        };
        self.next_seq = seq + 1;
        let released = Up::Released { seq }.encode().map_err(protocol)?;
        // The read succeeded, so it is returned whatever happens to the release: a sender that vanished is
        // reported (as PeerGone) by the next read, any other failure leaves the stream unusable.
        match write_frame(
            &mut self.writer,
            &released,
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
}

impl RecvBackend for ShmReceiver {
    fn rank(&self) -> usize {
        self.rank
    }

    async fn recv_with<R>(&mut self, read: impl FnOnce(&[u8]) -> R) -> Result<R, TransportError> {
        self.check_usable()?;
        match self.try_recv_with(read).await {
            Ok(out) => Ok(out),
            // Nothing was consumed (the frame reader is cancel-safe): waiting again is fine.
            Err(err @ TransportError::Timeout { op: RECV_OP, .. }) => Err(err),
            Err(err) => Err(self.fail(err)),
        }
    }

    fn set_bound(&mut self, bound: Option<Duration>) {
        self.bound = bound.map(|d| (Instant::now() + d, d));
    }

    async fn send(&mut self, msg: &[u8]) -> Result<(), TransportError> {
        self.check_usable()?;
        if msg.len() >= MAX_FRAME {
            return Err(TransportError::TooLarge {
                what: "upstream message",
                len: msg.len(),
                max: MAX_FRAME - 1,
            });
        }
        let frame = Up::Message(msg.to_vec()).encode().map_err(protocol)?;
        match write_frame(
            &mut self.writer,
            &frame,
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
