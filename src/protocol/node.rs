//! The node control messages between the orchestrator (node 0) and a node agent over TCP: the agent's join,
//! its assignment, worker commands and reports carried across, heartbeats, failure and stop.
//!
//! A node connection starts with the mutual token proof of `protocol::auth` (magic [`NODE_MAGIC`]); after it,
//! every message is a control frame exactly as between the orchestrator and a worker
//! (`u32 frame_len | u32 header_len | JSON header | blob`, `protocol::messages`), whose JSON header is a
//! [`NodeReport`] (agent → orchestrator) or a [`NodeCommand`] (orchestrator → agent). A worker's command or
//! report travels inside one, its blob as the frame's blob, so the loops see remote workers exactly as local
//! ones. `docs/protocol.md` §8 specifies it.

use serde::{Deserialize, Serialize};

use super::launch::LaunchSpec;
use rlsync_core::protocol::messages::{Command, Report, Role};

/// The protocol name in the node connection's set-up.
pub const NODE_MAGIC: &[u8; 8] = b"RLSYNCN1";

/// A worker on a node: its role and rank, and (in `ready`) the pid of its process there.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeWorker {
    pub role: Role,
    pub rank: u32,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub pid: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// Agent → orchestrator.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "node", rename_all = "snake_case")]
pub enum NodeReport {
    /// First message after the token proof: who the agent is and where its weight-chain listener is.
    Join {
        protocol: u32,
        node_rank: u32,
        host: String,
        pid: u32,
        /// `ip:port` of its weight-chain listener (empty when the node hosts no rollouts).
        chain_addr: String,
    },
    /// Every assigned worker was started and completed its handshake with the agent.
    Ready { workers: Vec<NodeWorker> },
    /// A report of one of its workers (the frame's blob is the report's blob).
    Worker {
        role: Role,
        rank: u32,
        pid: u32,
        report: Report,
    },
    /// One of its restartable rollouts (`runner.rollout_restarts` > 0) died, also before the agent's `ready`:
    /// `cause` says how, `status` is its raw wait status when it exited, `tail` the last lines of its log (at
    /// most 20, each at most 512 bytes: `supervisor::spawn::bounded_tail`), quoted by node 0 should this death
    /// be past the budget. Node 0 decides whether it is restarted (its budget and backoff).
    Lost {
        role: Role,
        rank: u32,
        pid: u32,
        cause: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        status: Option<i32>,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        tail: Vec<String>,
    },
    /// The successor of a lost worker (started on `restart`) completed its handshake as process `pid`.
    Restarted { role: Role, rank: u32, pid: u32 },
    /// The answer to `ping`.
    Pong { seq: u64 },
    /// The node failed (a worker, its weight relay, its own set-up): its words; it stops and exits.
    Failed { message: String },
    /// After `shutdown`: its workers are stopped; it exits.
    Stopped,
}

/// Orchestrator → agent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "node", rename_all = "snake_case")]
pub enum NodeCommand {
    /// Which workers to start, the next node of the weight chain, and the launch file to start them with
    /// (its `token` empty: the agent holds the token itself; its sockets and prefix are the agent's own).
    Assign {
        workers: Vec<NodeWorker>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        chain_next: Option<String>,
        launch: Box<LaunchSpec>,
    },
    /// A command for one of its workers (the frame's blob is the command's blob).
    Worker {
        role: Role,
        rank: u32,
        command: Command,
    },
    /// Start the successor of lost worker `role`-`rank` (answered by `restarted` once it completed its
    /// handshake, or by `lost` again).
    Restart { role: Role, rank: u32 },
    /// Kill worker `role`-`rank` (it missed the step deadline; `reason` says so); its death comes back as `lost`.
    Kill {
        role: Role,
        rank: u32,
        reason: String,
    },
    /// Heartbeat; answered by `pong` with the same `seq`.
    Ping { seq: u64 },
    /// Stop the workers and exit: the run ended, or (`failed`: node 0's error) it failed.
    Shutdown {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        failed: Option<String>,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use rlsync_core::protocol::messages::PROTOCOL_VERSION;

    #[test]
    fn node_messages_roundtrip() {
        let reports = [
            NodeReport::Join {
                protocol: PROTOCOL_VERSION,
                node_rank: 1,
                host: "gpu07".into(),
                pid: 4242,
                chain_addr: "10.0.0.7:29510".into(),
            },
            NodeReport::Worker {
                role: Role::Rollout,
                rank: 3,
                pid: 77,
                report: Report::Joined,
            },
            NodeReport::Lost {
                role: Role::Rollout,
                rank: 1,
                pid: 5151,
                cause: "was killed by SIGKILL".into(),
                status: Some(9),
                tail: vec!["weights received: version 0".into()],
            },
            NodeReport::Restarted {
                role: Role::Rollout,
                rank: 1,
                pid: 5252,
            },
            NodeReport::Stopped,
        ];
        for r in reports {
            let text = serde_json::to_string(&r).unwrap();
            assert_eq!(serde_json::from_str::<NodeReport>(&text).unwrap(), r);
        }
        let cmd = NodeCommand::Worker {
            role: Role::Trainer,
            rank: 0,
            command: Command::Sync { version: 7 },
        };
        let text = serde_json::to_string(&cmd).unwrap();
        assert_eq!(
            text,
            r#"{"node":"worker","role":"trainer","rank":0,"command":{"cmd":"sync","version":7}}"#
        );
        assert_eq!(serde_json::from_str::<NodeCommand>(&text).unwrap(), cmd);
    }
}
