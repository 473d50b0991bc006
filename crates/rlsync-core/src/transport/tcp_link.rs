//! The TCP chain's link messages (after `protocol::auth`'s set-up, magic `RLSYNCC3`): pure encode and decode.
//!
//! Layout (little-endian; `tcp.rs` describes what each message does):
//! ```text
//! set-up, upstream → downstream    first_rank:u32
//! set-up, downstream → upstream    receivers:u32 elastic:u8 (0 or 1)
//! requests (downstream)            PAYLOAD 0x01 len:u64 | PAYLOAD_TO 0x05 rank:u32 len:u64 | FLUSH 0x02
//!                                  | PULL 0x03 rank:u32 | JOIN 0x06 rank:u32 | CLOSE 0x04
//! answers (upstream)               FLUSHED 0x81 n:u32 rank:u32 × n | MSG 0x82 rank:u32 len:u32 bytes | DONE 0x84
//!                                  | MISSING 0x85 rank:u32 why:u8 (0 gone, 1 silent) | ERROR 0x83 len:u32 utf8
//! ```
//! A payload's `len` bytes follow its request on the stream; they are not part of the message (a node forwards
//! them in parts while it receives them). Messages carry no length of their own, so [`Request::decode`] and
//! [`Answer::decode`] say how many bytes a message needs when given too few ([`LinkError::Incomplete`]): a
//! reader reads that many and decodes again, never reading past the message.

use crate::bytes::{BytesError, Reader, Writer};

/// The chain's protocol name in the set-up (`protocol::auth`); 2: the token proof moved there; 3: elastic
/// chains (targeted payloads, joins, detached ranks in `FLUSHED`).
pub(crate) const MAGIC: &[u8; 8] = b"RLSYNCC3";
/// Upper bound on one upstream message (metadata, reports) and on an error's text.
pub(crate) const MAX_MSG: usize = 64 << 20;
/// Upper bound on the ranks one `FLUSHED` lists.
pub(crate) const MAX_RANKS: usize = MAX_MSG / 4;

const TAG_PAYLOAD: u8 = 1;
const TAG_FLUSH: u8 = 2;
const TAG_PULL: u8 = 3;
const TAG_CLOSE: u8 = 4;
const TAG_PAYLOAD_TO: u8 = 5;
const TAG_JOIN: u8 = 6;
const TAG_FLUSHED: u8 = 0x81;
const TAG_MSG: u8 = 0x82;
const TAG_ERROR: u8 = 0x83;
const TAG_DONE: u8 = 0x84;
const TAG_MISSING: u8 = 0x85;

/// Why link bytes are not a message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LinkError {
    /// The bytes are the start of a message that needs at least `need` bytes.
    #[error("a message cut short after {got} bytes (it needs at least {need})")]
    Incomplete { need: usize, got: usize },
    #[error("unknown frame tag {tag:#04x}")]
    UnknownTag { tag: u8 },
    #[error("{what} of {len} exceeds the limit of {max}")]
    TooLarge {
        what: &'static str,
        len: usize,
        max: usize,
    },
    #[error("{what} {value} (0 or 1 expected)")]
    BadFlag { what: &'static str, value: u8 },
    #[error("{extra} bytes after the message")]
    Trailing { extra: usize },
}

impl From<BytesError> for LinkError {
    fn from(e: BytesError) -> LinkError {
        match e {
            BytesError::Short {
                need, offset, left, ..
            } => LinkError::Incomplete {
                need: offset + need,
                got: offset + left,
            },
            BytesError::Trailing { extra, .. } => LinkError::Trailing { extra },
            BytesError::Count { what, count, max } => LinkError::TooLarge {
                what,
                len: usize::try_from(count).unwrap_or(usize::MAX),
                max,
            },
            BytesError::TooLong { what, len, max } => LinkError::TooLarge {
                what,
                len,
                max: usize::try_from(max).unwrap_or(usize::MAX),
            },
        }
    }
}

/// Set-up, downstream → upstream: the receivers at and beyond the answering node, and whether every one of
/// those nodes' local fan-outs is elastic. (Upstream → downstream is the first rank alone: a `u32`.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Extent {
    pub receivers: u32,
    pub elastic: bool,
}

impl Extent {
    pub(crate) const LEN: usize = 5;

    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(Self::LEN);
        w.u32(self.receivers).u8(u8::from(self.elastic));
        w.into_vec()
    }

    pub(crate) fn decode(bytes: &[u8]) -> Result<Extent, LinkError> {
        let mut r = Reader::new(bytes, "set-up answer");
        let receivers = r.u32()?;
        let elastic = flag(r.u8()?, "elastic flag")?;
        r.finish()?;
        Ok(Extent { receivers, elastic })
    }
}

/// The first rank of the downstream node's receivers (set-up, upstream → downstream).
pub(crate) fn encode_first_rank(rank: u32) -> Vec<u8> {
    let mut w = Writer::with_capacity(4);
    w.u32(rank);
    w.into_vec()
}

pub(crate) fn decode_first_rank(bytes: &[u8]) -> Result<u32, LinkError> {
    let mut r = Reader::new(bytes, "first rank");
    let rank = r.u32()?;
    r.finish()?;
    Ok(rank)
}

fn flag(value: u8, what: &'static str) -> Result<bool, LinkError> {
    match value {
        0 => Ok(false),
        1 => Ok(true),
        value => Err(LinkError::BadFlag { what, value }),
    }
}

/// A request down the chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Request {
    /// A payload of `len` bytes for every receiver (the bytes follow).
    Payload {
        len: u64,
    },
    /// A payload of `len` bytes for global receiver `rank` only (the bytes follow).
    PayloadTo {
        rank: u32,
        len: u64,
    },
    Flush,
    /// Receiver `rank`'s next upstream message.
    Pull {
        rank: u32,
    },
    /// Wait for a successor of receiver `rank`.
    Join {
        rank: u32,
    },
    Close,
}

impl Request {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(13);
        match *self {
            Request::Payload { len } => w.u8(TAG_PAYLOAD).u64(len),
            Request::PayloadTo { rank, len } => w.u8(TAG_PAYLOAD_TO).u32(rank).u64(len),
            Request::Flush => w.u8(TAG_FLUSH),
            Request::Pull { rank } => w.u8(TAG_PULL).u32(rank),
            Request::Join { rank } => w.u8(TAG_JOIN).u32(rank),
            Request::Close => w.u8(TAG_CLOSE),
        };
        w.into_vec()
    }

    /// The request `bytes` hold exactly; [`LinkError::Incomplete`] when they are its start.
    pub(crate) fn decode(bytes: &[u8]) -> Result<Request, LinkError> {
        let mut r = Reader::new(bytes, "request");
        let req = match r.u8()? {
            TAG_PAYLOAD => Request::Payload { len: r.u64()? },
            TAG_PAYLOAD_TO => Request::PayloadTo {
                rank: r.u32()?,
                len: r.u64()?,
            },
            TAG_FLUSH => Request::Flush,
            TAG_PULL => Request::Pull { rank: r.u32()? },
            TAG_JOIN => Request::Join { rank: r.u32()? },
            TAG_CLOSE => Request::Close,
            tag => return Err(LinkError::UnknownTag { tag }),
        };
        r.finish()?;
        Ok(req)
    }
}

/// Why a receiver is missing (`MISSING`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Why {
    /// It is gone.
    Gone,
    /// It did not answer in time.
    Silent,
}

/// An answer up the chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Answer {
    /// The global ranks at and beyond the answering node whose receiver is detached.
    Flushed(Vec<u32>),
    /// Receiver `rank`'s upstream message.
    Msg(u32, Vec<u8>),
    Done,
    Missing {
        rank: u32,
        why: Why,
    },
    /// A node failed; the text names it and says why.
    Error(String),
}

impl Answer {
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Answer::Flushed(_) => "FLUSHED",
            Answer::Msg(..) => "MSG",
            Answer::Done => "DONE",
            Answer::Missing { .. } => "MISSING",
            Answer::Error(_) => "ERROR",
        }
    }

    /// The answer's bytes; an error when a list, message or text is beyond the limits [`Answer::decode`]
    /// accepts (an error's text is cut to the limit instead, at a character boundary).
    pub(crate) fn encode(&self) -> Result<Vec<u8>, LinkError> {
        let mut w = Writer::new();
        match self {
            Answer::Flushed(ranks) => {
                within("list of detached ranks", ranks.len(), MAX_RANKS)?;
                w.u8(TAG_FLUSHED).len_u32(ranks.len())?;
                for &r in ranks {
                    w.u32(r);
                }
            }
            Answer::Msg(rank, msg) => {
                within("upstream message", msg.len(), MAX_MSG)?;
                w.u8(TAG_MSG).u32(*rank).bytes_u32(msg)?;
            }
            Answer::Done => {
                w.u8(TAG_DONE);
            }
            Answer::Missing { rank, why } => {
                w.u8(TAG_MISSING).u32(*rank).u8(match why {
                    Why::Gone => 0,
                    Why::Silent => 1,
                });
            }
            Answer::Error(text) => {
                let mut end = text.len().min(MAX_MSG);
                while !text.is_char_boundary(end) {
                    end -= 1;
                }
                w.u8(TAG_ERROR).bytes_u32(&text.as_bytes()[..end])?;
            }
        }
        Ok(w.into_vec())
    }

    /// The answer `bytes` hold exactly; [`LinkError::Incomplete`] when they are its start. An error's text that
    /// is not UTF-8 is taken lossily (it is only ever shown).
    pub(crate) fn decode(bytes: &[u8]) -> Result<Answer, LinkError> {
        let mut r = Reader::new(bytes, "answer");
        let answer = match r.u8()? {
            TAG_FLUSHED => {
                let n = r.u32()? as usize;
                within("list of detached ranks", n, MAX_RANKS)?;
                let mut ranks = Reader::new(r.take(4 * n)?, "detached ranks");
                Answer::Flushed((0..n).map(|_| ranks.u32()).collect::<Result<_, _>>()?)
            }
            TAG_MSG => {
                let rank = r.u32()?;
                let len = r.u32()? as usize;
                within("upstream message", len, MAX_MSG)?;
                Answer::Msg(rank, r.take(len)?.to_vec())
            }
            TAG_DONE => Answer::Done,
            TAG_MISSING => {
                let rank = r.u32()?;
                let why = match flag(r.u8()?, "missing reason")? {
                    false => Why::Gone,
                    true => Why::Silent,
                };
                Answer::Missing { rank, why }
            }
            TAG_ERROR => {
                let len = r.u32()? as usize;
                within("error text", len, MAX_MSG)?;
                Answer::Error(String::from_utf8_lossy(r.take(len)?).into_owned())
            }
            tag => return Err(LinkError::UnknownTag { tag }),
        };
        r.finish()?;
        Ok(answer)
    }
}

fn within(what: &'static str, len: usize, max: usize) -> Result<(), LinkError> {
    if len > max {
        Err(LinkError::TooLarge { what, len, max })
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn requests() -> impl Strategy<Value = Request> {
        prop_oneof![
            any::<u64>().prop_map(|len| Request::Payload { len }),
            (any::<u32>(), any::<u64>()).prop_map(|(rank, len)| Request::PayloadTo { rank, len }),
            Just(Request::Flush),
            any::<u32>().prop_map(|rank| Request::Pull { rank }),
            any::<u32>().prop_map(|rank| Request::Join { rank }),
            Just(Request::Close),
        ]
    }

    fn answers() -> impl Strategy<Value = Answer> {
        prop_oneof![
            proptest::collection::vec(any::<u32>(), 0..40).prop_map(Answer::Flushed),
            (any::<u32>(), proptest::collection::vec(any::<u8>(), 0..200))
                .prop_map(|(r, m)| Answer::Msg(r, m)),
            Just(Answer::Done),
            (any::<u32>(), any::<bool>()).prop_map(|(rank, silent)| Answer::Missing {
                rank,
                why: if silent { Why::Silent } else { Why::Gone },
            }),
            ".{0,40}".prop_map(Answer::Error),
        ]
    }

    /// Read `bytes` as a reader on a stream does: the tag, then as many bytes as the decoder says it needs.
    fn read_incrementally<M>(
        bytes: &[u8],
        decode: impl Fn(&[u8]) -> Result<M, LinkError>,
    ) -> Result<(M, usize), LinkError> {
        let mut have = 1;
        loop {
            match decode(&bytes[..have.min(bytes.len())]) {
                Ok(m) => return Ok((m, have)),
                Err(LinkError::Incomplete { need, got }) => {
                    assert_eq!(got, have.min(bytes.len()));
                    assert!(need > got, "need {need} after {got}: no progress");
                    if need > bytes.len() {
                        return Err(LinkError::Incomplete { need, got });
                    }
                    have = need;
                }
                Err(e) => return Err(e),
            }
        }
    }

    #[test]
    fn the_layout_is_the_documented_one() {
        assert_eq!(
            Request::PayloadTo { rank: 2, len: 3 }.encode(),
            [5, 2, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0]
        );
        assert_eq!(Request::Close.encode(), [4]);
        assert_eq!(
            Answer::Flushed(vec![7, 1]).encode().unwrap(),
            [0x81, 2, 0, 0, 0, 7, 0, 0, 0, 1, 0, 0, 0]
        );
        assert_eq!(
            Answer::Msg(1, b"hi".to_vec()).encode().unwrap(),
            [0x82, 1, 0, 0, 0, 2, 0, 0, 0, b'h', b'i']
        );
        assert_eq!(
            Answer::Missing {
                rank: 3,
                why: Why::Silent
            }
            .encode()
            .unwrap(),
            [0x85, 3, 0, 0, 0, 1]
        );
        assert_eq!(
            Answer::Error("x".into()).encode().unwrap(),
            [0x83, 1, 0, 0, 0, b'x']
        );
        let extent = Extent {
            receivers: 4,
            elastic: true,
        };
        assert_eq!(extent.encode(), [4, 0, 0, 0, 1]);
        assert_eq!(Extent::decode(&extent.encode()), Ok(extent));
        assert_eq!(decode_first_rank(&encode_first_rank(9)), Ok(9));
    }

    #[test]
    fn malformed_messages_are_errors() {
        assert_eq!(
            Request::decode(&[0x07]),
            Err(LinkError::UnknownTag { tag: 7 })
        );
        assert_eq!(
            Answer::decode(&[0x01]),
            Err(LinkError::UnknownTag { tag: 1 })
        );
        assert_eq!(
            Request::decode(&[]),
            Err(LinkError::Incomplete { need: 1, got: 0 })
        );
        assert_eq!(
            Request::decode(&[2, 0]),
            Err(LinkError::Trailing { extra: 1 })
        );
        assert_eq!(
            Answer::decode(&[0x85, 0, 0, 0, 0, 2]),
            Err(LinkError::BadFlag {
                what: "missing reason",
                value: 2
            })
        );
        assert_eq!(
            Extent::decode(&[1, 0, 0, 0, 7]).unwrap_err().to_string(),
            "elastic flag 7 (0 or 1 expected)"
        );
        // Lengths beyond the limits are refused before anything is allocated for them.
        let huge = Writer::new()
            .u8(0x82)
            .u32(0)
            .u32(u32::MAX)
            .as_slice()
            .to_vec();
        assert!(matches!(
            Answer::decode(&huge),
            Err(LinkError::TooLarge {
                what: "upstream message",
                ..
            })
        ));
        let huge = Writer::new().u8(0x81).u32(u32::MAX).as_slice().to_vec();
        assert!(matches!(
            Answer::decode(&huge),
            Err(LinkError::TooLarge { .. })
        ));
        assert!(Answer::Msg(0, vec![0; MAX_MSG + 1]).encode().is_err());
        // An error's text is cut to the limit, not refused.
        let long = "é".repeat(MAX_MSG / 2 + 1);
        let Answer::Error(cut) = Answer::decode(&Answer::Error(long).encode().unwrap()).unwrap()
        else {
            panic!("not an error answer")
        };
        assert_eq!(cut.len(), MAX_MSG);
    }

    proptest! {
        #[test]
        fn requests_round_trip_when_read_as_a_stream_reads_them(req in requests()) {
            let bytes = req.encode();
            let (got, read) = read_incrementally(&bytes, Request::decode).unwrap();
            prop_assert_eq!(got, req);
            prop_assert_eq!(read, bytes.len());
        }

        #[test]
        fn answers_round_trip_when_read_as_a_stream_reads_them(answer in answers()) {
            let bytes = answer.encode().unwrap();
            let (got, read) = read_incrementally(&bytes, Answer::decode).unwrap();
            prop_assert_eq!(got, answer);
            prop_assert_eq!(read, bytes.len());
            // Every cut is the start of a message, never a message or a panic.
            for cut in 0..bytes.len() {
                let is_incomplete = matches!(Answer::decode(&bytes[..cut]), Err(LinkError::Incomplete { .. }));
                prop_assert!(is_incomplete, "cut {}", cut);
            }
        }

        #[test]
        fn arbitrary_bytes_never_panic_and_never_ask_for_less(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            for decoded in [
                Request::decode(&bytes).map(|_| ()),
                Answer::decode(&bytes).map(|_| ()),
                Extent::decode(&bytes).map(|_| ()),
                decode_first_rank(&bytes).map(|_| ()),
            ] {
                if let Err(LinkError::Incomplete { need, got }) = decoded {
                    prop_assert_eq!(got, bytes.len());
                    prop_assert!(need > got);
                }
            }
        }
    }
}
