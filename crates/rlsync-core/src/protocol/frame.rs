//! The one length-prefixed framing of the crate: `u32 length (LE) | body`, with a size limit and a cancel-safe reader.
//!
//! Both the control protocol (body = `u32 header_len | JSON header | blob`, see `messages`) and the shm
//! transport's control messages (body = `u8 tag | fields`, see `transport/frame.rs`) ride this framing; each
//! passes its own limit. The length counts the body only, not the 4 bytes of the prefix.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::bytes::Writer;

/// Bytes of the length prefix.
pub(crate) const PREFIX_LEN: usize = 4;

/// A frame body that may not be sent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("frame of {len} bytes exceeds the limit of {max} bytes")]
pub struct TooLong {
    pub len: usize,
    pub max: usize,
}

/// Why no frame could be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// The stream failed, or ended inside a frame (`UnexpectedEof`).
    #[error("i/o error")]
    Io(#[from] std::io::Error),
    /// The length prefix announces more than the reader's limit (nothing is allocated for it).
    #[error(transparent)]
    TooLong(#[from] TooLong),
}

/// Check a body length against `max`, and that the prefix can hold it; returns the prefix.
pub(crate) fn check_len(len: usize, max: usize) -> Result<u32, TooLong> {
    u32::try_from(len)
        .ok()
        .filter(|_| len <= max)
        .ok_or(TooLong { len, max })
}

/// One frame: the length prefix followed by the concatenation of `parts`.
pub fn encode(parts: &[&[u8]], max: usize) -> Result<Vec<u8>, TooLong> {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    let prefix = check_len(len, max)?;
    let mut out = Writer::with_capacity(PREFIX_LEN + len);
    out.u32(prefix);
    for part in parts {
        out.bytes(part);
    }
    Ok(out.into_vec())
}

/// Reserve the prefix of a frame whose body is appended to the returned buffer; [`seal`] writes the length.
pub fn start() -> Vec<u8> {
    let mut out = Vec::with_capacity(32);
    out.extend_from_slice(&[0; PREFIX_LEN]);
    out
}

/// Write the length of a frame begun with [`start`] into its prefix.
pub(crate) fn seal(mut frame: Vec<u8>, max: usize) -> Result<Vec<u8>, TooLong> {
    let prefix = check_len(frame.len().saturating_sub(PREFIX_LEN), max)?;
    if let Some(dst) = frame.get_mut(..PREFIX_LEN) {
        dst.copy_from_slice(Writer::with_capacity(PREFIX_LEN).u32(prefix).as_slice());
    }
    Ok(frame)
}

/// Write a whole encoded frame and flush.
pub async fn write_all<W: AsyncWrite + Unpin>(writer: &mut W, frame: &[u8]) -> std::io::Result<()> {
    writer.write_all(frame).await?;
    writer.flush().await
}

/// Reads whole frames from a stream. Cancel-safe: dropping a pending [`FrameReader::next`] (e.g. on a timeout)
/// loses no bytes, because only completed reads are appended to the buffer.
pub struct FrameReader<R> {
    stream: R,
    buf: Vec<u8>,
    start: usize,
    max: usize,
}

impl<R> std::fmt::Debug for FrameReader<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FrameReader")
            .field("buffered", &(self.buf.len() - self.start))
            .field("max", &self.max)
            .finish()
    }
}

/// Bytes asked of the stream at a time when no frame length is known yet.
const READ_CHUNK: usize = 4096;

impl<R: AsyncRead + Unpin> FrameReader<R> {
    /// A reader refusing bodies longer than `max` bytes.
    pub fn new(stream: R, max: usize) -> Self {
        FrameReader {
            stream,
            buf: Vec::new(),
            start: 0,
            max,
        }
    }

    /// The next frame's body, or `None` on a clean end of stream between frames.
    pub async fn next(&mut self) -> Result<Option<Vec<u8>>, ReadError> {
        loop {
            let want = match self.buffered()? {
                Buffered::Frame(len) => {
                    let body = self.buf[self.start + PREFIX_LEN..][..len].to_vec();
                    self.start += PREFIX_LEN + len;
                    return Ok(Some(body));
                }
                Buffered::Need(n) => n,
            };
            if self.start > 0 {
                self.buf.drain(..self.start);
                self.start = 0;
            }
            // A large body is read straight into the buffer's spare capacity in as few reads as it takes.
            self.buf.reserve(want.max(READ_CHUNK));
            let n = self.stream.read_buf(&mut self.buf).await?;
            if n == 0 {
                return if self.start == self.buf.len() {
                    Ok(None)
                } else {
                    Err(ReadError::Io(std::io::ErrorKind::UnexpectedEof.into()))
                };
            }
        }
    }

    fn buffered(&self) -> Result<Buffered, TooLong> {
        let pending = self.buf.get(self.start..).unwrap_or_default();
        let Some(prefix) = pending.get(..PREFIX_LEN) else {
            return Ok(Buffered::Need(PREFIX_LEN - pending.len()));
        };
        let mut len_bytes = [0; PREFIX_LEN];
        len_bytes.copy_from_slice(prefix);
        let len = u32::from_le_bytes(len_bytes) as usize;
        check_len(len, self.max)?;
        let have = pending.len() - PREFIX_LEN;
        Ok(if have >= len {
            Buffered::Frame(len)
        } else {
            Buffered::Need(len - have)
        })
    }
}

enum Buffered {
    /// A whole frame of this body length is buffered.
    Frame(usize),
    /// At least this many more bytes are needed.
    Need(usize),
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    #[test]
    fn encode_prefixes_the_body_length() {
        let frame = encode(&[b"ab", b"", b"cde"], 16).unwrap();
        assert_eq!(frame, [5, 0, 0, 0, b'a', b'b', b'c', b'd', b'e']);
        assert_eq!(encode(&[&[0; 17]], 16), Err(TooLong { len: 17, max: 16 }));
        let mut sealed = start();
        sealed.extend_from_slice(b"xyz");
        assert_eq!(seal(sealed, 3).unwrap(), [3, 0, 0, 0, b'x', b'y', b'z']);
        let mut long = start();
        long.extend_from_slice(b"xyzw");
        assert_eq!(seal(long, 3), Err(TooLong { len: 4, max: 3 }));
    }

    #[tokio::test]
    async fn reader_reassembles_frames_split_across_reads() {
        let bodies: [&[u8]; 4] = [b"one", &[7; 10_000], b"", b"last"];
        let bytes: Vec<u8> = bodies
            .iter()
            .flat_map(|b| encode(&[b], 1 << 20).unwrap())
            .collect();
        let (mut a, b) = tokio::io::duplex(64);
        let writer = tokio::spawn(async move {
            // Odd chunk sizes split length prefixes and bodies.
            for chunk in bytes.chunks(7) {
                a.write_all(chunk).await.unwrap();
            }
        });
        let mut reader = FrameReader::new(b, 1 << 20);
        for body in bodies {
            assert_eq!(reader.next().await.unwrap().unwrap(), body);
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
        a.write_all(&[10, 0, 0, 0, 1]).await.unwrap();
        drop(a);
        match FrameReader::new(b, 64).next().await {
            Err(ReadError::Io(e)) => assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof),
            other => panic!("expected an eof error, got {other:?}"),
        }

        let (mut a, b) = tokio::io::duplex(64);
        a.write_all(&u32::MAX.to_le_bytes()).await.unwrap();
        assert!(matches!(
            FrameReader::new(b, 1 << 30).next().await,
            Err(ReadError::TooLong(TooLong {
                max: 0x4000_0000,
                ..
            }))
        ));
    }

    #[tokio::test]
    async fn reader_survives_a_cancelled_read() {
        let (mut a, b) = tokio::io::duplex(64);
        let mut reader = FrameReader::new(b, 64);
        let frame = encode(&[b"0123456789"], 64).unwrap();
        a.write_all(&frame[..6]).await.unwrap();
        let timed_out =
            tokio::time::timeout(std::time::Duration::from_millis(20), reader.next()).await;
        assert!(timed_out.is_err(), "half a frame is not a frame");
        a.write_all(&frame[6..]).await.unwrap();
        assert_eq!(reader.next().await.unwrap().unwrap(), b"0123456789");
    }
}
