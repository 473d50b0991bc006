//! The control protocol between the orchestrator and its workers: framing, messages, rollout chunks, auth.
//!
//! The orchestrator and the workers (Rust, Python through the binding, remote through a node agent) all speak
//! it and never import each other. `docs/protocol.md` specifies every format here precisely enough to
//! implement a worker in another language; the app adds the launch file and the node link on top of it.
//! - [`frame`]: the one length-prefixed framing (also carries the shm transport's control messages).
//! - [`messages`]: the control messages, their versions and the handshake.
//! - [`arrays`]: the named-array codec of rollout chunks (arrays by name, dtype and shape).
//! - [`auth`]: the mutual HMAC challenge-response on the run token between hosts (control plane, weight chain).

pub mod arrays;
pub mod auth;
pub mod frame;
pub mod messages;

use crate::bytes::BytesError;

#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    #[error("control connection i/o failed")]
    Io(#[from] std::io::Error),
    #[error("peer closed the control connection")]
    Closed,
    #[error("frame of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge { len: usize, max: usize },
    #[error("malformed frame: {reason}")]
    Malformed { reason: String },
    /// A binary field (named arrays, trajectories) that could not be read.
    #[error("malformed {}", .source.what())]
    Bytes {
        #[from]
        source: BytesError,
    },
    /// A JSON document of the protocol (a frame's header, the launch file) that is not what it must be.
    #[error("malformed {what}")]
    Json {
        what: &'static str,
        #[source]
        source: serde_json::Error,
    },
    #[error("protocol version mismatch: peer speaks {peer}, this binary speaks {ours}")]
    Version { peer: u32, ours: u32 },
    #[error("the hello does not carry this run's token")]
    BadToken,
}
