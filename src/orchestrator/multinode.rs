//! A multi-node run before its supervisor starts: what this build runs over several nodes (and what it
//! refuses, with the reason), the run token every node must share, and on node 0 the listener the node agents
//! join, each node's workers, its place in the weight chain and the launch file it is assigned.

use std::time::Duration;

use tokio::net::TcpListener;

use super::OrchestratorError;
use super::supervisor::nodes::{self, Cluster, Joined};
use super::supervisor::{EventTx, WorkerId};
use crate::cluster::NodeIdentity;
use crate::config::placement::NodePlacement;
use crate::config::schema::RunConfig;
use crate::protocol::launch::LaunchSpec;
use crate::protocol::node::{NodeCommand, NodeWorker};
use rlsync_core::protocol::messages::Role;

/// The environment variable holding the secret every node of a run shares.
pub const TOKEN_VAR: &str = "RLSYNC_RUN_TOKEN";

/// Who this process is in a run over several nodes, and the run's shape.
#[derive(Debug, Clone)]
pub struct MultiNode {
    pub identity: NodeIdentity,
    pub placement: NodePlacement,
    /// The run token (`RLSYNC_RUN_TOKEN`), identical on every node.
    pub token: String,
}

impl MultiNode {
    /// This node's name in logs and peers' errors: `node 2 (gpu07)`.
    pub fn name(&self) -> String {
        format!("node {} ({})", self.identity.node_rank, self.identity.host)
    }

    /// The workers placed on `node`, trainer first.
    pub fn workers_on(&self, node: u32) -> Vec<WorkerId> {
        self.placement
            .on_node(node)
            .map(|w| WorkerId {
                role: if w.role == "trainer" {
                    Role::Trainer
                } else {
                    Role::Rollout
                },
                rank: w.rank,
            })
            .collect()
    }

    /// The global ranks of the rollouts on `node`, in order (its weight channel's receivers, its launch file's
    /// `node_rollouts`; [`WeightReceivers`](super::weights::WeightReceivers) numbers the run's receivers by it).
    pub fn rollouts_on(&self, node: u32) -> Vec<u32> {
        self.placement
            .rollouts
            .iter()
            .filter(|w| w.node == node)
            .map(|w| w.rank)
            .collect()
    }

    /// The node after `node` in the weight chain, if any.
    pub fn chain_next(&self, node: u32) -> Option<u32> {
        let chain = self.placement.chain();
        let at = chain.iter().position(|&n| n == node)?;
        chain.get(at + 1).copied()
    }

    /// The heartbeat timeout (`cluster.node_timeout_s`).
    pub fn node_timeout(cfg: &RunConfig) -> Duration {
        Duration::from_secs_f64(cfg.cluster.node_timeout_s)
    }
}

/// For `cluster.num_nodes` > 1: who this node is, the placement, the token, and a refusal of what multi-node
/// runs do not support yet. `None` on one node.
pub fn prepare(cfg: &RunConfig) -> Result<Option<MultiNode>, OrchestratorError> {
    if cfg.cluster.num_nodes.get() == 1 {
        return Ok(None);
    }
    let config = |reason: String| OrchestratorError::Config { reason };
    let host = crate::cluster::host_name();
    let identity = crate::cluster::detect(&cfg.cluster, &host, |k| std::env::var(k).ok())
        .map_err(|source| OrchestratorError::Cluster { source })?;
    let placement = crate::config::placement::resolve(&cfg.cluster)
        .map_err(|source| OrchestratorError::Placement { source })?;
    if let Some(reason) = refusal(cfg, &placement) {
        return Err(config(reason));
    }
    let token = std::env::var(TOKEN_VAR).unwrap_or_default();
    Ok(Some(MultiNode {
        identity,
        placement,
        token,
    }))
}

/// Why this build cannot run `cfg` over several nodes (also a `--dry-run` problem), if it cannot.
pub fn refusal(cfg: &RunConfig, placement: &NodePlacement) -> Option<String> {
    if cfg.cluster.num_nodes.get() == 1 {
        return None;
    }
    if placement.trainer.node != 0 {
        return Some(format!(
            "cluster.component_placement puts the trainer (actor) on node {}; multi-node runs need it on \
             node 0, with the orchestrator (e.g. actor: 0)",
            placement.trainer.node
        ));
    }
    if std::env::var(TOKEN_VAR)
        .unwrap_or_default()
        .trim()
        .is_empty()
    {
        return Some(format!(
            "on {}: a run over {} nodes needs the same secret in {TOKEN_VAR} on every node (e.g. `export \
             {TOKEN_VAR}=$(openssl rand -hex 32)` before srun/torchrun)",
            crate::cluster::host_name(),
            cfg.cluster.num_nodes
        ));
    }
    None
}

/// Node 0: listen on the rendezvous port and wait for every other node's agent to join.
pub async fn gather(
    multi: &MultiNode,
    cfg: &RunConfig,
) -> Result<(Vec<Joined>, Cluster), OrchestratorError> {
    let id = &multi.identity;
    let listener = match TcpListener::bind((id.master_addr.as_str(), id.master_port)).await {
        Ok(l) => l,
        // The rendezvous name may not be an address of this host's (a DNS alias, NAT): every interface.
        Err(_) => TcpListener::bind(("0.0.0.0", id.master_port))
            .await
            .map_err(|source| OrchestratorError::Listen {
                addr: format!("{}:{}", id.master_addr, id.master_port),
                source,
            })?,
    };
    tracing::info!(
        "{}: waiting for {} node agent(s) on {} ({})",
        multi.name(),
        id.num_nodes - 1,
        listener
            .local_addr()
            .map_or_else(|_| "?".to_owned(), |a| a.to_string()),
        id.scheduler
    );
    nodes::gather(
        listener,
        multi.token.as_bytes().to_vec(),
        multi.name(),
        id.num_nodes,
        cfg.runner.handshake_timeout_s.get(),
    )
    .await
}

/// Node 0's launch file fields: its rollouts and the next node of the weight chain (its chain listener).
pub fn node0_launch(multi: &MultiNode, joined: &[Joined], launch: &mut LaunchSpec) {
    launch.node_rollouts = Some(multi.rollouts_on(0));
    launch.chain_next = chain_addr(multi, joined, 0);
}

fn chain_addr(multi: &MultiNode, joined: &[Joined], node: u32) -> Option<String> {
    let next = multi.chain_next(node)?;
    joined
        .iter()
        .find(|j| j.node == next)
        .map(|j| j.chain_addr.clone())
}

/// Start every joined agent's link and send it its assignment: its workers, the next node of the chain, and
/// the launch file (without the token, which never crosses the wire). Returns the workers on other nodes.
pub fn assign(
    multi: &MultiNode,
    joined: Vec<Joined>,
    launch: &LaunchSpec,
    cluster: &mut Cluster,
    events: &EventTx,
    timeout: Duration,
) -> Vec<(WorkerId, u32)> {
    let mut remote = Vec::new();
    let nexts: Vec<(u32, Option<String>)> = joined
        .iter()
        .map(|j| (j.node, chain_addr(multi, &joined, j.node)))
        .collect();
    for (j, (node, chain_next)) in joined.into_iter().zip(nexts) {
        let workers = multi.workers_on(node);
        let mut spec = launch.clone();
        spec.token = String::new();
        spec.node_rollouts = Some(multi.rollouts_on(node));
        spec.chain_next = None;
        // The agent names its own host's arena (under its own run tag).
        spec.host_shared = None;
        // The same-host GPU channel serves the trainer's host only: these rollouts take the chain.
        spec.gpu_socket = None;
        let link = nodes::attach(j, events.clone(), timeout);
        link.tx.send(
            &NodeCommand::Assign {
                workers: workers
                    .iter()
                    .map(|w| NodeWorker {
                        role: w.role,
                        rank: w.rank,
                        pid: 0,
                    })
                    .collect(),
                chain_next,
                launch: Box::new(spec),
            },
            &[],
        );
        remote.extend(workers.into_iter().map(|w| (w, node)));
        cluster.links.push(link);
    }
    remote
}
