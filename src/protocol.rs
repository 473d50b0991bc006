//! The app's own formats on top of the core's control protocol (`rlsync_core::protocol`): the launch file a
//! worker reads at start, and the node link between the orchestrator and its node agents.
//!
//! `docs/protocol.md` specifies both with the rest of the protocol, for implementations in other languages.
//! - [`launch`]: the launch file (the resolved `RunConfig`, the worker's channels) and a rollout's local
//!   weights copy entries.
//! - [`node`]: the messages between the orchestrator and its node agents over TCP.

pub mod launch;
pub mod node;
