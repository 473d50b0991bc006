//! Length-prefixed control frames of the shm backend (private plumbing, not a product format) and a cancel-safe reader.
//!
//! A frame is `u32 length (LE) | u8 tag | body`, the length counting tag and body. Integers are little-endian,
//! strings and byte strings carry a `u32` length. The receiver's `Hello` opens with [`VERSION`] so that mismatched
//! builds refuse each other in the handshake instead of misreading frames.

use tokio::io::{AsyncRead, AsyncReadExt};

/// Version of this control protocol, sent first in `Hello` and `Welcome`. 2: a receiver sees an increasing
/// subsequence of payload numbers (payloads may target one rank; receivers may join late).
pub(crate) const VERSION: u8 = 2;

/// Largest frame accepted (upstream messages included): bounds what a bad length prefix can make us allocate.
pub(crate) const MAX_FRAME: usize = 64 << 20;

/// Sender → receiver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Down {
    Welcome {
        version: u8,
        receivers: u32,
        slots: u32,
    },
    Reject {
        reason: String,
    },
    /// Payload `seq` of `len` bytes lies at the start of slot `slot`; `segment` announces a new segment for it.
    Publish {
        seq: u64,
        slot: u32,
        len: u64,
        segment: Option<SegmentInfo>,
    },
}

/// A (new) segment backing a slot: the receiver maps it before reading.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SegmentInfo {
    pub generation: u64,
    pub capacity: u64,
    pub name: String,
}

/// Receiver → sender.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Up {
    Hello { version: u8, rank: u32 },
    Mapped { slot: u32, generation: u64 },
    Released { seq: u64 },
    Message(Vec<u8>),
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(crate) enum FrameError {
    #[error("frame truncated while reading {what}")]
    Truncated { what: &'static str },
    #[error("unknown frame tag {tag}")]
    UnknownTag { tag: u8 },
    #[error("frame of {len} bytes exceeds the limit of {max} bytes")]
    TooLong { len: usize, max: usize },
    #[error("empty frame")]
    Empty,
    #[error("{extra} unexpected trailing bytes in frame with tag {tag}")]
    Trailing { tag: u8, extra: usize },
    #[error("string field {what} is not utf-8")]
    NotUtf8 { what: &'static str },
}

const TAG_WELCOME: u8 = 1;
const TAG_REJECT: u8 = 2;
const TAG_PUBLISH: u8 = 3;
const TAG_HELLO: u8 = 16;
const TAG_MAPPED: u8 = 17;
const TAG_RELEASED: u8 = 18;
const TAG_MESSAGE: u8 = 19;

/// Appends frames to a buffer, patching the length prefix at the end.
struct FrameWriter {
    out: Vec<u8>,
}

impl FrameWriter {
    fn new(tag: u8) -> Self {
        let mut out = Vec::with_capacity(32);
        out.extend_from_slice(&[0; 4]);
        out.push(tag);
        FrameWriter { out }
    }
    fn u8(mut self, v: u8) -> Self {
        self.out.push(v);
        self
    }
    fn u32(mut self, v: u32) -> Self {
        self.out.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(mut self, v: u64) -> Self {
        self.out.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn bytes(mut self, v: &[u8]) -> Self {
        // Frames are bounded by MAX_FRAME, checked by `finish`, so a length that does not fit in u32 never ships.
        self = self.u32(u32::try_from(v.len()).unwrap_or(u32::MAX));
        self.out.extend_from_slice(v);
        self
    }
    fn finish(mut self) -> Result<Vec<u8>, FrameError> {
        let len = self.out.len() - 4;
        if len > MAX_FRAME {
            return Err(FrameError::TooLong {
                len,
                max: MAX_FRAME,
            });
        }
        self.out[..4].copy_from_slice(&(len as u32).to_le_bytes());
        Ok(self.out)
    }
}

/// Reads fields off a frame body, failing on truncation instead of panicking.
struct Cursor<'a> {
    rest: &'a [u8],
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], FrameError> {
        if self.rest.len() < n {
            return Err(FrameError::Truncated { what });
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }
    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], FrameError> {
        let mut a = [0; N];
        a.copy_from_slice(self.take(N, what)?);
        Ok(a)
    }
    fn u8(&mut self, what: &'static str) -> Result<u8, FrameError> {
        Ok(self.array::<1>(what)?[0])
    }
    fn u32(&mut self, what: &'static str) -> Result<u32, FrameError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }
    fn u64(&mut self, what: &'static str) -> Result<u64, FrameError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }
    fn bytes(&mut self, what: &'static str) -> Result<&'a [u8], FrameError> {
        let len = self.u32(what)? as usize;
        self.take(len, what)
    }
    fn string(&mut self, what: &'static str) -> Result<String, FrameError> {
        let raw = self.bytes(what)?;
        String::from_utf8(raw.to_vec()).map_err(|_| FrameError::NotUtf8 { what })
    }
    fn end(self, tag: u8) -> Result<(), FrameError> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(FrameError::Trailing {
                tag,
                extra: self.rest.len(),
            })
        }
    }
}

fn split_tag(frame: &[u8]) -> Result<(u8, Cursor<'_>), FrameError> {
    match frame.split_first() {
        Some((tag, rest)) => Ok((*tag, Cursor { rest })),
        None => Err(FrameError::Empty),
    }
}

impl Down {
    pub(crate) fn encode(&self) -> Result<Vec<u8>, FrameError> {
        match self {
            Down::Welcome {
                version,
                receivers,
                slots,
            } => FrameWriter::new(TAG_WELCOME)
                .u8(*version)
                .u32(*receivers)
                .u32(*slots)
                .finish(),
            Down::Reject { reason } => FrameWriter::new(TAG_REJECT)
                .bytes(reason.as_bytes())
                .finish(),
            Down::Publish {
                seq,
                slot,
                len,
                segment,
            } => {
                let w = FrameWriter::new(TAG_PUBLISH).u64(*seq).u32(*slot).u64(*len);
                match segment {
                    None => w.u8(0),
                    Some(s) => w
                        .u8(1)
                        .u64(s.generation)
                        .u64(s.capacity)
                        .bytes(s.name.as_bytes()),
                }
                .finish()
            }
        }
    }

    /// Decode one frame (tag and body, without the length prefix).
    pub(crate) fn decode(frame: &[u8]) -> Result<Down, FrameError> {
        let (tag, mut c) = split_tag(frame)?;
        let msg = match tag {
            TAG_WELCOME => Down::Welcome {
                version: c.u8("version")?,
                receivers: c.u32("receivers")?,
                slots: c.u32("slots")?,
            },
            TAG_REJECT => Down::Reject {
                reason: c.string("reason")?,
            },
            TAG_PUBLISH => {
                let (seq, slot, len) = (c.u64("seq")?, c.u32("slot")?, c.u64("len")?);
                let segment = match c.u8("segment flag")? {
                    0 => None,
                    _ => Some(SegmentInfo {
                        generation: c.u64("generation")?,
                        capacity: c.u64("capacity")?,
                        name: c.string("segment name")?,
                    }),
                };
                Down::Publish {
                    seq,
                    slot,
                    len,
                    segment,
                }
            }
            tag => return Err(FrameError::UnknownTag { tag }),
        };
        c.end(tag)?;
        Ok(msg)
    }
}

impl Up {
    pub(crate) fn encode(&self) -> Result<Vec<u8>, FrameError> {
        match self {
            Up::Hello { version, rank } => {
                FrameWriter::new(TAG_HELLO).u8(*version).u32(*rank).finish()
            }
            Up::Mapped { slot, generation } => FrameWriter::new(TAG_MAPPED)
                .u32(*slot)
                .u64(*generation)
                .finish(),
            Up::Released { seq } => FrameWriter::new(TAG_RELEASED).u64(*seq).finish(),
            Up::Message(msg) => {
                // A message fills the rest of the frame: no inner length needed.
                let mut w = FrameWriter::new(TAG_MESSAGE);
                w.out.extend_from_slice(msg);
                w.finish()
            }
        }
    }

    /// Decode one frame (tag and body, without the length prefix).
    pub(crate) fn decode(frame: &[u8]) -> Result<Up, FrameError> {
        let (tag, mut c) = split_tag(frame)?;
        let msg = match tag {
            TAG_HELLO => Up::Hello {
                version: c.u8("version")?,
                rank: c.u32("rank")?,
            },
            TAG_MAPPED => Up::Mapped {
                slot: c.u32("slot")?,
                generation: c.u64("generation")?,
            },
            TAG_RELEASED => Up::Released { seq: c.u64("seq")? },
            TAG_MESSAGE => Up::Message(c.take(c.rest.len(), "message")?.to_vec()),
            tag => return Err(FrameError::UnknownTag { tag }),
        };
        c.end(tag)?;
        Ok(msg)
    }
}

/// Why no frame could be read.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReadError {
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Frame(#[from] FrameError),
}

/// Reads whole frames from a stream. Cancel-safe: dropping a pending [`FrameReader::next`] (e.g. on a timeout)
/// loses no bytes, because only completed reads are appended to the buffer.
pub(crate) struct FrameReader<R> {
    stream: R,
    buf: Vec<u8>,
    start: usize,
}

impl<R> std::fmt::Debug for FrameReader<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FrameReader")
            .field("buffered", &(self.buf.len() - self.start))
            .finish()
    }
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    pub(crate) fn new(stream: R) -> Self {
        FrameReader {
            stream,
            buf: Vec::new(),
            start: 0,
        }
    }

    /// The next frame (tag and body), or `None` on a clean end of stream between frames.
    pub(crate) async fn next(&mut self) -> Result<Option<Vec<u8>>, ReadError> {
        loop {
            if let Some(frame) = self.take_buffered()? {
                return Ok(Some(frame));
            }
            let mut chunk = [0u8; 4096];
            let n = self.stream.read(&mut chunk).await?;
            if n == 0 {
                return if self.start == self.buf.len() {
                    Ok(None)
                } else {
                    Err(ReadError::Io(std::io::ErrorKind::UnexpectedEof.into()))
                };
            }
            if self.start > 0 {
                self.buf.drain(..self.start);
                self.start = 0;
            }
            self.buf
                .extend_from_slice(chunk.get(..n).unwrap_or_default());
        }
    }

    fn take_buffered(&mut self) -> Result<Option<Vec<u8>>, FrameError> {
        let pending = self.buf.get(self.start..).unwrap_or_default();
        let Some(prefix) = pending.get(..4) else {
            return Ok(None);
        };
        let mut len_bytes = [0; 4];
        len_bytes.copy_from_slice(prefix);
        let len = u32::from_le_bytes(len_bytes) as usize;
        if len > MAX_FRAME {
            return Err(FrameError::TooLong {
                len,
                max: MAX_FRAME,
            });
        }
        let Some(frame) = pending.get(4..4 + len) else {
            return Ok(None);
        };
        let frame = frame.to_vec();
        self.start += 4 + len;
        Ok(Some(frame))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    fn body(frame: &[u8]) -> &[u8] {
        frame.get(4..).unwrap_or_default()
    }

    #[test]
    fn every_message_round_trips() {
        let downs = [
            Down::Welcome {
                version: VERSION,
                receivers: 3,
                slots: 2,
            },
            Down::Reject {
                reason: "rank 7 out of range".into(),
            },
            Down::Publish {
                seq: 9,
                slot: 1,
                len: 0,
                segment: None,
            },
            Down::Publish {
                seq: u64::MAX,
                slot: 0,
                len: 1 << 40,
                segment: Some(SegmentInfo {
                    generation: 4,
                    capacity: 1 << 41,
                    name: "rlsync.1.0.4".into(),
                }),
            },
        ];
        for msg in downs {
            let frame = msg.encode().unwrap();
            assert_eq!(
                frame.len() - 4,
                u32::from_le_bytes([frame[0], frame[1], frame[2], frame[3]]) as usize
            );
            assert_eq!(Down::decode(body(&frame)), Ok(msg));
        }
        let ups = [
            Up::Hello {
                version: VERSION,
                rank: 5,
            },
            Up::Mapped {
                slot: 1,
                generation: 2,
            },
            Up::Released { seq: 77 },
            Up::Message(Vec::new()),
            Up::Message(b"metadata".to_vec()),
        ];
        for msg in ups {
            let frame = msg.encode().unwrap();
            assert_eq!(Up::decode(body(&frame)), Ok(msg));
        }
    }

    #[test]
    fn malformed_frames_are_errors() {
        let check_down =
            |frame: &[u8], expect: FrameError| assert_eq!(Down::decode(frame), Err(expect));
        let check_up =
            |frame: &[u8], expect: FrameError| assert_eq!(Up::decode(frame), Err(expect));
        check_down(&[], FrameError::Empty);
        check_down(&[99], FrameError::UnknownTag { tag: 99 });
        check_down(
            &[TAG_WELCOME, 1, 0],
            FrameError::Truncated { what: "receivers" },
        );
        check_down(
            &[TAG_REJECT, 5, 0, 0, 0, b'a'],
            FrameError::Truncated { what: "reason" },
        );
        check_down(
            &[TAG_REJECT, 1, 0, 0, 0, 0xff],
            FrameError::NotUtf8 { what: "reason" },
        );
        check_up(
            &[TAG_RELEASED, 1, 2, 3],
            FrameError::Truncated { what: "seq" },
        );
        check_up(
            &[TAG_HELLO, 1, 0, 0, 0, 0, 9],
            FrameError::Trailing {
                tag: TAG_HELLO,
                extra: 1,
            },
        );
        check_up(&[TAG_WELCOME], FrameError::UnknownTag { tag: TAG_WELCOME });
        let mut publish = Down::Publish {
            seq: 1,
            slot: 0,
            len: 8,
            segment: Some(SegmentInfo {
                generation: 1,
                capacity: 8,
                name: "x".into(),
            }),
        }
        .encode()
        .unwrap();
        publish.pop();
        assert!(matches!(
            Down::decode(body(&publish)),
            Err(FrameError::Truncated { .. })
        ));
    }

    #[test]
    fn oversized_message_is_refused_at_encode() {
        let err = Up::Message(vec![0; MAX_FRAME]).encode().unwrap_err();
        assert_eq!(
            err,
            FrameError::TooLong {
                len: MAX_FRAME + 1,
                max: MAX_FRAME
            }
        );
    }

    #[tokio::test]
    async fn reader_reassembles_frames_split_across_reads() {
        let msgs = [
            Up::Hello {
                version: VERSION,
                rank: 1,
            },
            Up::Message(vec![7; 10_000]),
            Up::Released { seq: 3 },
        ];
        let bytes: Vec<u8> = msgs.iter().flat_map(|m| m.encode().unwrap()).collect();
        let (mut a, b) = tokio::io::duplex(64);
        let writer = tokio::spawn(async move {
            // Odd chunk sizes split length prefixes and bodies.
            for chunk in bytes.chunks(7) {
                a.write_all(chunk).await.unwrap();
            }
        });
        let mut reader = FrameReader::new(b);
        for msg in &msgs {
            let frame = reader.next().await.unwrap().unwrap();
            assert_eq!(&Up::decode(&frame).unwrap(), msg);
        }
        writer.await.unwrap();
        assert!(
            reader.next().await.unwrap().is_none(),
            "clean end of stream"
        );
    }

    #[tokio::test]
    async fn reader_rejects_eof_mid_frame_and_huge_prefix() {
        let (mut a, b) = tokio::io::duplex(64);
        a.write_all(&[10, 0, 0, 0, TAG_RELEASED]).await.unwrap();
        drop(a);
        assert!(matches!(
            FrameReader::new(b).next().await,
            Err(ReadError::Io(_))
        ));

        let (mut a, b) = tokio::io::duplex(64);
        a.write_all(&u32::MAX.to_le_bytes()).await.unwrap();
        assert!(matches!(
            FrameReader::new(b).next().await,
            Err(ReadError::Frame(FrameError::TooLong { .. }))
        ));
    }

    #[tokio::test]
    async fn reader_survives_a_cancelled_read() {
        let (mut a, b) = tokio::io::duplex(64);
        let mut reader = FrameReader::new(b);
        let frame = Up::Released { seq: 42 }.encode().unwrap();
        a.write_all(&frame[..6]).await.unwrap();
        let timed_out =
            tokio::time::timeout(std::time::Duration::from_millis(20), reader.next()).await;
        assert!(timed_out.is_err(), "half a frame is not a frame");
        a.write_all(&frame[6..]).await.unwrap();
        let got = reader.next().await.unwrap().unwrap();
        assert_eq!(Up::decode(&got), Ok(Up::Released { seq: 42 }));
    }
}
