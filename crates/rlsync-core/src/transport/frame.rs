//! The shm backend's control messages (private plumbing, not a product format), carried by `protocol::frame`.
//!
//! A frame is `u32 length (LE) | u8 tag | body` (the crate's one framing), the length counting tag and body.
//! Integers are little-endian, strings and byte strings carry a `u32` length. The receiver's `Hello` opens with
//! [`VERSION`] so that mismatched builds refuse each other in the handshake instead of misreading frames.

use crate::bytes::{BytesError, Reader, Writer};
use crate::protocol::frame::{self, TooLong};

/// Version of this control protocol, sent first in `Hello` and `Welcome`. 2: a receiver sees an increasing
/// subsequence of payload numbers (payloads may target one rank; receivers may join late). 3: the welcome
/// says whether the receiver joined late (after the sender started: it must be caught up, see `syncer/rejoin`).
pub(crate) const VERSION: u8 = 3;

/// Largest frame accepted (upstream messages included): bounds what a bad length prefix can make us allocate.
pub(crate) const MAX_FRAME: usize = 64 << 20;

/// Sender → receiver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Down {
    Welcome {
        version: u8,
        receivers: u32,
        slots: u32,
        /// Welcomed by an elastic sender that had already started (a successor of a dead receiver).
        late: bool,
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

impl From<BytesError> for FrameError {
    fn from(e: BytesError) -> FrameError {
        match e {
            BytesError::TooLong { len, max, .. } => FrameError::TooLong {
                len,
                max: usize::try_from(max).unwrap_or(usize::MAX),
            },
            e => FrameError::Truncated { what: e.what() },
        }
    }
}

impl From<TooLong> for FrameError {
    fn from(TooLong { len, max }: TooLong) -> FrameError {
        FrameError::TooLong { len, max }
    }
}

/// One frame: `tag`, then the fields `fields` writes; the length prefix sealed (at most [`MAX_FRAME`]).
fn frame_of(
    tag: u8,
    fields: impl FnOnce(&mut Writer) -> Result<(), BytesError>,
) -> Result<Vec<u8>, FrameError> {
    let mut w = Writer::from_vec(frame::start());
    w.u8(tag);
    fields(&mut w)?;
    Ok(frame::seal(w.into_vec(), MAX_FRAME)?)
}

/// A frame's fields after its tag: each read names its field in errors.
struct Cursor<'a> {
    r: Reader<'a>,
}

impl<'a> Cursor<'a> {
    fn u8(&mut self, what: &'static str) -> Result<u8, FrameError> {
        Ok(self.r.named(what).u8()?)
    }
    fn u32(&mut self, what: &'static str) -> Result<u32, FrameError> {
        Ok(self.r.named(what).u32()?)
    }
    fn u64(&mut self, what: &'static str) -> Result<u64, FrameError> {
        Ok(self.r.named(what).u64()?)
    }
    fn string(&mut self, what: &'static str) -> Result<String, FrameError> {
        let raw = self.r.named(what).bytes_u32()?;
        String::from_utf8(raw.to_vec()).map_err(|_| FrameError::NotUtf8 { what })
    }
    fn end(self, tag: u8) -> Result<(), FrameError> {
        match self.r.remaining() {
            0 => Ok(()),
            extra => Err(FrameError::Trailing { tag, extra }),
        }
    }
}

fn split_tag(frame: &[u8]) -> Result<(u8, Cursor<'_>), FrameError> {
    match frame.split_first() {
        Some((tag, rest)) => Ok((
            *tag,
            Cursor {
                r: Reader::new(rest, "frame"),
            },
        )),
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
                late,
            } => frame_of(TAG_WELCOME, |w| {
                w.u8(*version)
                    .u32(*receivers)
                    .u32(*slots)
                    .u8(u8::from(*late));
                Ok(())
            }),
            Down::Reject { reason } => frame_of(TAG_REJECT, |w| {
                w.bytes_u32(reason.as_bytes())?;
                Ok(())
            }),
            Down::Publish {
                seq,
                slot,
                len,
                segment,
            } => frame_of(TAG_PUBLISH, |w| {
                w.u64(*seq).u32(*slot).u64(*len);
                match segment {
                    None => {
                        w.u8(0);
                    }
                    Some(s) => {
                        w.u8(1)
                            .u64(s.generation)
                            .u64(s.capacity)
                            .bytes_u32(s.name.as_bytes())?;
                    }
                }
                Ok(())
            }),
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
                late: c.u8("late flag")? != 0,
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
            Up::Hello { version, rank } => frame_of(TAG_HELLO, |w| {
                w.u8(*version).u32(*rank);
                Ok(())
            }),
            Up::Mapped { slot, generation } => frame_of(TAG_MAPPED, |w| {
                w.u32(*slot).u64(*generation);
                Ok(())
            }),
            Up::Released { seq } => frame_of(TAG_RELEASED, |w| {
                w.u64(*seq);
                Ok(())
            }),
            // A message fills the rest of the frame: no inner length needed.
            Up::Message(msg) => frame_of(TAG_MESSAGE, |w| {
                w.bytes(msg);
                Ok(())
            }),
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
            TAG_MESSAGE => Up::Message(c.r.rest().to_vec()),
            tag => return Err(FrameError::UnknownTag { tag }),
        };
        c.end(tag)?;
        Ok(msg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
                late: false,
            },
            Down::Welcome {
                version: VERSION,
                receivers: 3,
                slots: 2,
                late: true,
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
}
