//! The control protocol between the orchestrator and its workers: framing, messages, launch file, trajectories.
//!
//! The orchestrator and the workers both import this module and never each other. `docs/protocol.md`
//! specifies every format here precisely enough to implement a worker in another language.
//! - [`frame`]: the crate's one length-prefixed framing (also carries the shm transport's control messages).
//! - [`messages`]: the control messages, their versions and the handshake.
//! - [`launch`]: the launch file a worker reads at start.
//! - [`trajectory`]: the binary codec of rollout chunks carried in control-frame blobs.
//! - [`arrays`]: the named-array codec of Python workers' rollout chunks (numpy arrays by name).
//! - [`auth`]: the mutual HMAC challenge-response on the run token between hosts (control plane, weight chain).
//! - [`node`]: the messages between the orchestrator and its node agents over TCP.

pub mod arrays;
pub mod auth;
pub mod frame;
pub mod launch;
pub mod messages;
pub mod node;
pub mod trajectory;

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
    #[error("protocol version mismatch: peer speaks {peer}, this binary speaks {ours}")]
    Version { peer: u32, ours: u32 },
    #[error("the hello does not carry this run's token")]
    BadToken,
}

impl From<BytesError> for ProtocolError {
    fn from(e: BytesError) -> ProtocolError {
        let reason = match e {
            BytesError::Short { what, .. } => format!("{what} truncated: {e}"),
            _ => format!("{}: {e}", e.what()),
        };
        ProtocolError::Malformed { reason }
    }
}
