//! The one mutual challenge-response on the run token between two hosts (HMAC-SHA256 over both sides' random
//! nonces; the token never crosses the wire), used by the TCP control plane and the TCP weight chain.
//!
//! Wire (before anything else on the connection): the client sends `magic[8] nonce_c[32] name`; the server
//! answers `magic[8] nonce_s[32] proof_s[32] name`, where `proof_s = HMAC(token, "rlsync server" ‖ magic ‖
//! nonce_c ‖ nonce_s)`; the client checks it (a server without the token is not trusted: the client closes)
//! and sends `proof_c = HMAC(token, "rlsync client" ‖ magic ‖ nonce_s ‖ nonce_c)`; the server checks it and
//! answers one verdict byte, 1 (accepted) or 0 (refused). A `name` is `u16 len (LE) | UTF-8`, at most 256
//! bytes: the peer's name for logs and errors (`node 2 (gpu07)`). The magic names the protocol that follows
//! (`RLSYNCN1` control plane, `RLSYNCC3` weight chain), so a proof for one is no proof for the other.

use hmac::{Hmac, Mac};
use sha2::Sha256;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::bytes::Writer;

const NONCE: usize = 32;
const MAC: usize = 32;
const MAX_NAME: usize = 256;
const ACCEPTED: u8 = 1;
const REFUSED: u8 = 0;
const LABEL_SERVER: &[u8] = b"rlsync server";
const LABEL_CLIENT: &[u8] = b"rlsync client";

/// A failed set-up. `peer` is the address (or, once known, `name at address`).
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("{peer} closed the connection while {op}")]
    Closed { op: &'static str, peer: String },
    #[error("i/o error while {op} with {peer}")]
    Io {
        op: &'static str,
        peer: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{peer} is not an rlsync {want} peer (greeting {got:02x?})")]
    Greeting {
        peer: String,
        want: String,
        got: [u8; 8],
    },
    #[error("{peer} was refused: {reason}")]
    Refused { peer: String, reason: &'static str },
    #[error("{peer} sent a name of {len} bytes (at most {MAX_NAME})")]
    NameTooLong { peer: String, len: usize },
}

impl AuthError {
    /// Whether the peer closed or reset the connection (as opposed to a refusal or a local i/o error).
    pub fn is_closed(&self) -> bool {
        matches!(self, AuthError::Closed { .. })
    }
}

fn io<'a>(op: &'static str, peer: &'a str) -> impl FnOnce(std::io::Error) -> AuthError + 'a {
    move |source| match source.kind() {
        std::io::ErrorKind::UnexpectedEof
        | std::io::ErrorKind::ConnectionReset
        | std::io::ErrorKind::BrokenPipe => AuthError::Closed {
            op,
            peer: peer.to_owned(),
        },
        _ => AuthError::Io {
            op,
            peer: peer.to_owned(),
            source,
        },
    }
}

fn mac(token: &[u8], label: &[u8], magic: &[u8], first: &[u8], second: &[u8]) -> Hmac<Sha256> {
    // HMAC accepts keys of any length: `new_from_slice` cannot fail.
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(token).unwrap_or_else(|_| unreachable!());
    m.update(label);
    m.update(magic);
    m.update(first);
    m.update(second);
    m
}

async fn write_name<S: AsyncWrite + Unpin>(
    s: &mut S,
    name: &str,
    peer: &str,
) -> Result<(), AuthError> {
    const OP: &str = "sending our name";
    let mut end = name.len().min(MAX_NAME);
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    let bytes = &name.as_bytes()[..end];
    let mut out = Writer::with_capacity(2 + bytes.len());
    // Cut to MAX_NAME above, which a u16 holds.
    let _ = out.bytes_u16(bytes);
    s.write_all(out.as_slice()).await.map_err(io(OP, peer))
}

async fn read_name<S: AsyncRead + Unpin>(s: &mut S, peer: &str) -> Result<String, AuthError> {
    const OP: &str = "reading its name";
    let len = usize::from(s.read_u16_le().await.map_err(io(OP, peer))?);
    if len > MAX_NAME {
        return Err(AuthError::NameTooLong {
            peer: peer.to_owned(),
            len,
        });
    }
    let mut buf = vec![0; len];
    s.read_exact(&mut buf).await.map_err(io(OP, peer))?;
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

async fn read_greeting<S: AsyncRead + Unpin>(
    s: &mut S,
    magic: &[u8; 8],
    peer: &str,
) -> Result<[u8; NONCE], AuthError> {
    const OP: &str = "reading its greeting";
    let mut got = [0; 8];
    s.read_exact(&mut got).await.map_err(io(OP, peer))?;
    if &got != magic {
        return Err(AuthError::Greeting {
            peer: peer.to_owned(),
            want: String::from_utf8_lossy(magic).into_owned(),
            got,
        });
    }
    let mut nonce = [0; NONCE];
    s.read_exact(&mut nonce).await.map_err(io(OP, peer))?;
    Ok(nonce)
}

/// The connecting side: prove the token to the server at `addr` and check its proof. Returns the server's
/// `name at addr`.
pub async fn client<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    magic: &[u8; 8],
    token: &[u8],
    name: &str,
    addr: &str,
) -> Result<String, AuthError> {
    const OP: &str = "proving the run token";
    let ours: [u8; NONCE] = rand::random();
    let mut hello = Vec::with_capacity(8 + NONCE);
    hello.extend_from_slice(magic);
    hello.extend_from_slice(&ours);
    s.write_all(&hello).await.map_err(io(OP, addr))?;
    write_name(s, name, addr).await?;
    let theirs = read_greeting(s, magic, addr).await?;
    let mut proof = [0; MAC];
    s.read_exact(&mut proof).await.map_err(io(OP, addr))?;
    let peer = format!("{} at {addr}", read_name(s, addr).await?);
    if mac(token, LABEL_SERVER, magic, &ours, &theirs)
        .verify_slice(&proof)
        .is_err()
    {
        return Err(AuthError::Refused {
            peer,
            reason: "it does not hold this run's token (RLSYNC_RUN_TOKEN)",
        });
    }
    let proof = mac(token, LABEL_CLIENT, magic, &theirs, &ours)
        .finalize()
        .into_bytes();
    s.write_all(&proof).await.map_err(io(OP, &peer))?;
    match s.read_u8().await.map_err(io(OP, &peer))? {
        ACCEPTED => Ok(peer),
        _ => Err(AuthError::Refused {
            peer,
            reason: "it refused our token (RLSYNC_RUN_TOKEN differs)",
        }),
    }
}

/// The accepting side: check the client's proof and prove ours. Returns the client's `name at addr`; a
/// client without the token is told so (verdict 0) and refused.
pub async fn server<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    magic: &[u8; 8],
    token: &[u8],
    name: &str,
    addr: &str,
) -> Result<String, AuthError> {
    const OP: &str = "checking its run token";
    let theirs = read_greeting(s, magic, addr).await?;
    let peer = format!("{} at {addr}", read_name(s, addr).await?);
    let ours: [u8; NONCE] = rand::random();
    let mut answer = Vec::with_capacity(8 + NONCE + MAC);
    answer.extend_from_slice(magic);
    answer.extend_from_slice(&ours);
    answer.extend_from_slice(
        &mac(token, LABEL_SERVER, magic, &theirs, &ours)
            .finalize()
            .into_bytes(),
    );
    s.write_all(&answer).await.map_err(io(OP, &peer))?;
    write_name(s, name, &peer).await?;
    let mut proof = [0; MAC];
    s.read_exact(&mut proof)
        .await
        .map_err(|e| match io(OP, &peer)(e) {
            AuthError::Closed { peer, .. } => AuthError::Refused {
                peer,
                reason: "it closed the connection instead of proving this run's token",
            },
            other => other,
        })?;
    if mac(token, LABEL_CLIENT, magic, &ours, &theirs)
        .verify_slice(&proof)
        .is_err()
    {
        let _ = s.write_u8(REFUSED).await;
        return Err(AuthError::Refused {
            peer,
            reason: "it does not hold this run's token",
        });
    }
    s.write_u8(ACCEPTED).await.map_err(io(OP, &peer))?;
    Ok(peer)
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn pair(
        client_token: &'static [u8],
        server_token: &'static [u8],
    ) -> (Result<String, AuthError>, Result<String, AuthError>) {
        let (mut a, mut b) = tokio::io::duplex(4096);
        let magic = b"RLSYNCT1";
        // Each side closes its end when it is done, as a dropped connection would.
        tokio::join!(
            async move { client(&mut a, magic, client_token, "node 1 (a)", "server-addr").await },
            async move { server(&mut b, magic, server_token, "node 0 (b)", "client-addr").await }
        )
    }

    #[tokio::test]
    async fn both_sides_with_the_token_accept_each_other() {
        let (c, s) = pair(b"secret", b"secret").await;
        assert_eq!(c.unwrap(), "node 0 (b) at server-addr");
        assert_eq!(s.unwrap(), "node 1 (a) at client-addr");
    }

    #[tokio::test]
    async fn a_wrong_token_is_refused_on_both_sides() {
        let (c, s) = pair(b"wrong", b"secret").await;
        assert!(matches!(c, Err(AuthError::Refused { .. })), "{c:?}");
        assert!(matches!(s, Err(AuthError::Refused { .. })), "{s:?}");
    }

    #[tokio::test]
    async fn another_protocol_is_not_a_peer() {
        let (mut a, mut b) = tokio::io::duplex(4096);
        let (c, s) = tokio::join!(
            async move { client(&mut a, b"RLSYNCC2", b"t", "x", "s").await },
            async move { server(&mut b, b"RLSYNCN1", b"t", "y", "c").await }
        );
        assert!(matches!(s, Err(AuthError::Greeting { .. })), "{s:?}");
        assert!(c.is_err());
    }
}
