//! Node rank, node count and rendezvous address from the environment the schedulers already set.
//!
//! Precedence, first match wins for each field: the `cluster.*` keys (`node_rank`, `master_addr`,
//! `master_port`); torchrun / PyTorchJob (`NODE_RANK` | `GROUP_RANK` | `RANK`, `NNODES` | `GROUP_WORLD_SIZE` |
//! `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`); OpenMPI (`OMPI_COMM_WORLD_RANK` / `SIZE`); Slurm
//! (`SLURM_PROCID`, `SLURM_NNODES`, the first host of `SLURM_JOB_NODELIST`). No scheduler: a single node.
//! The node count the scheduler started must equal `cluster.num_nodes` (the placement is written for it).

use std::fmt;

use crate::config::schema::ClusterConfig;

/// Rendezvous port when neither `cluster.master_port` nor `MASTER_PORT` gives one (torchrun's default).
pub(crate) const DEFAULT_MASTER_PORT: u16 = 29500;

/// Which launcher's environment gave the node rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheduler {
    /// `cluster.node_rank` was set.
    Config,
    Torchrun,
    OpenMpi,
    Slurm,
    /// No scheduler variables: a single-node run.
    None,
}

impl fmt::Display for Scheduler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Scheduler::Config => "cluster.node_rank",
            Scheduler::Torchrun => "torchrun environment",
            Scheduler::OpenMpi => "OpenMPI environment",
            Scheduler::Slurm => "Slurm environment",
            Scheduler::None => "no scheduler (single node)",
        })
    }
}

/// Who this process is in a multi-node run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeIdentity {
    /// This host's name (in every log line and error about this node).
    pub host: String,
    pub node_rank: u32,
    pub num_nodes: u32,
    /// Where node 0 (the orchestrator) listens for node agents.
    pub master_addr: String,
    pub master_port: u16,
    pub scheduler: Scheduler,
}

impl NodeIdentity {}

/// The environment does not describe a run rlsync can join.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClusterError {
    #[error("on {host}: {var}={value:?} is not valid: {reason}")]
    BadVar {
        host: String,
        var: &'static str,
        value: String,
        reason: String,
    },
    #[error(
        "on {host}: the {scheduler} starts {count} nodes ({var}) but cluster.num_nodes is {configured}; set \
         cluster.num_nodes={count} (the placement is written for a number of nodes)"
    )]
    CountMismatch {
        host: String,
        scheduler: Scheduler,
        var: &'static str,
        count: u32,
        configured: u32,
    },
    #[error(
        "on {host}: node rank {node_rank} (from {scheduler}) is outside the run's {num_nodes} node(s) \
         (cluster.num_nodes)"
    )]
    RankOutOfRange {
        host: String,
        node_rank: u32,
        num_nodes: u32,
        scheduler: Scheduler,
    },
    #[error(
        "on {host}: node {node_rank} of {num_nodes} has no rendezvous address: set MASTER_ADDR or \
         cluster.master_addr to node 0's host"
    )]
    NoRendezvous {
        host: String,
        node_rank: u32,
        num_nodes: u32,
    },
    #[error(
        "on {host}: {var}={value} starts several rlsync processes per node; start one per node (e.g. \
         torchrun --nproc-per-node=1, srun --ntasks-per-node=1)"
    )]
    SeveralPerNode {
        host: String,
        var: &'static str,
        value: u32,
    },
}

/// The first host of a Slurm node list: `node[01-04,07],gpu5` → `node01`, `rack[2-3]-n[1-2]` → `rack2-n1`.
pub fn first_host(nodelist: &str) -> Result<String, String> {
    let mut depth = 0usize;
    let mut end = nodelist.len();
    for (i, c) in nodelist.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth = depth.checked_sub(1).ok_or("unbalanced ']'")?,
            ',' if depth == 0 => {
                end = i;
                break;
            }
            _ => {}
        }
    }
    if depth != 0 && end == nodelist.len() {
        return Err("unbalanced '['".into());
    }
    let item = nodelist[..end].trim();
    let mut host = String::new();
    let mut rest = item;
    while let Some(open) = rest.find('[') {
        host.push_str(&rest[..open]);
        let close = rest[open..]
            .find(']')
            .map(|c| open + c)
            .ok_or("unbalanced '['")?;
        let inner = &rest[open + 1..close];
        let first = inner.split(',').next().unwrap_or("").trim();
        let lo = first.split('-').next().unwrap_or("").trim();
        if lo.is_empty() || !lo.bytes().all(|b| b.is_ascii_digit()) {
            return Err(format!("'[{inner}]' is not a range list like [01-04,07]"));
        }
        host.push_str(lo);
        rest = &rest[close + 1..];
    }
    if rest.contains(']') {
        return Err("unbalanced ']'".into());
    }
    host.push_str(rest);
    if host.is_empty() {
        return Err("the node list is empty".into());
    }
    Ok(host)
}

/// Work out this node's identity from `cluster.*` and the scheduler's environment (`var` looks a variable up;
/// pass `|k| std::env::var(k).ok()` in production).
pub fn detect(
    cluster: &ClusterConfig,
    host: &str,
    var: impl Fn(&str) -> Option<String>,
) -> Result<NodeIdentity, ClusterError> {
    let host = host.to_owned();
    let num = |name: &'static str| -> Result<Option<u32>, ClusterError> {
        match var(name) {
            None => Ok(None),
            Some(v) if v.trim().is_empty() => Ok(None),
            Some(v) => v
                .trim()
                .parse::<u32>()
                .map(Some)
                .map_err(|_| ClusterError::BadVar {
                    host: host.clone(),
                    var: name,
                    value: v.clone(),
                    reason: "not a non-negative integer".into(),
                }),
        }
    };
    let first_of = |names: &[&'static str]| -> Result<Option<(&'static str, u32)>, ClusterError> {
        for &n in names {
            if let Some(v) = num(n)? {
                return Ok(Some((n, v)));
            }
        }
        Ok(None)
    };

    // Rank and count, by scheduler.
    let torch_rank = first_of(&["NODE_RANK", "GROUP_RANK", "RANK"])?;
    let torch_count = first_of(&["NNODES", "GROUP_WORLD_SIZE", "WORLD_SIZE"])?;
    let (scheduler, rank, count) = if let Some(r) = cluster.node_rank {
        (Scheduler::Config, r, None)
    } else if let Some((_, r)) = torch_rank.filter(|_| var("MASTER_ADDR").is_some()) {
        if let Some(n) = num("LOCAL_WORLD_SIZE")?.filter(|&n| n > 1) {
            return Err(ClusterError::SeveralPerNode {
                host,
                var: "LOCAL_WORLD_SIZE",
                value: n,
            });
        }
        (Scheduler::Torchrun, r, torch_count)
    } else if let Some(r) = num("OMPI_COMM_WORLD_RANK")? {
        if let Some(n) = num("OMPI_COMM_WORLD_LOCAL_SIZE")?.filter(|&n| n > 1) {
            return Err(ClusterError::SeveralPerNode {
                host,
                var: "OMPI_COMM_WORLD_LOCAL_SIZE",
                value: n,
            });
        }
        let count = num("OMPI_COMM_WORLD_SIZE")?.map(|n| ("OMPI_COMM_WORLD_SIZE", n));
        (Scheduler::OpenMpi, r, count)
    } else if let Some(r) = num("SLURM_PROCID")? {
        let nodes = num("SLURM_NNODES")?.or(num("SLURM_JOB_NUM_NODES")?);
        if let (Some(tasks), Some(nodes)) = (num("SLURM_NTASKS")?, nodes)
            && tasks > nodes
        {
            return Err(ClusterError::SeveralPerNode {
                host,
                var: "SLURM_NTASKS",
                value: tasks,
            });
        }
        (Scheduler::Slurm, r, nodes.map(|n| ("SLURM_NNODES", n)))
    } else {
        (Scheduler::None, 0, None)
    };

    let num_nodes = cluster.num_nodes.get();
    if let Some((var_name, n)) = count
        && n != num_nodes
    {
        return Err(ClusterError::CountMismatch {
            host,
            scheduler,
            var: var_name,
            count: n,
            configured: num_nodes,
        });
    }
    if rank >= num_nodes {
        return Err(ClusterError::RankOutOfRange {
            host,
            node_rank: rank,
            num_nodes,
            scheduler,
        });
    }

    // Rendezvous.
    let slurm_first = match var("SLURM_JOB_NODELIST").or_else(|| var("SLURM_NODELIST")) {
        Some(list) if scheduler == Scheduler::Slurm || var("MASTER_ADDR").is_none() => {
            Some(first_host(&list).map_err(|reason| ClusterError::BadVar {
                host: host.clone(),
                var: "SLURM_JOB_NODELIST",
                value: list.clone(),
                reason,
            })?)
        }
        _ => None,
    };
    let master_addr = cluster
        .master_addr
        .clone()
        .or_else(|| var("MASTER_ADDR").filter(|s| !s.trim().is_empty()))
        .or(slurm_first);
    let master_addr = match master_addr {
        Some(a) => a,
        None if num_nodes == 1 => "127.0.0.1".to_owned(),
        // Node 0 is the rendezvous: it listens, so it needs no address of its own to reach.
        None if rank == 0 => host.clone(),
        None => {
            return Err(ClusterError::NoRendezvous {
                host,
                node_rank: rank,
                num_nodes,
            });
        }
    };
    let master_port = match cluster.master_port {
        Some(p) => p,
        None => match var("MASTER_PORT") {
            None => DEFAULT_MASTER_PORT,
            Some(v) => match v.trim().parse::<u16>() {
                Ok(p) if p > 0 => p,
                _ => {
                    return Err(ClusterError::BadVar {
                        host,
                        var: "MASTER_PORT",
                        value: v,
                        reason: "not a TCP port (1-65535)".into(),
                    });
                }
            },
        },
    };
    Ok(NodeIdentity {
        host,
        node_rank: rank,
        num_nodes,
        master_addr,
        master_port,
        scheduler,
    })
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::num::NonZeroU32;

    use super::*;

    fn cluster(nodes: u32) -> ClusterConfig {
        ClusterConfig {
            num_nodes: NonZeroU32::new(nodes).unwrap(),
            ..ClusterConfig::default()
        }
    }

    fn detect_with(c: &ClusterConfig, vars: &[(&str, &str)]) -> Result<NodeIdentity, ClusterError> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        detect(c, "hostA", |k| map.get(k).cloned())
    }

    /// `scheduler rank/count addr:port`.
    fn summary(id: &NodeIdentity) -> String {
        format!(
            "{:?} {}/{} {}:{}",
            id.scheduler, id.node_rank, id.num_nodes, id.master_addr, id.master_port
        )
    }

    #[test]
    fn nodelist_first_host() {
        let check = |list: &str, want: Result<&str, ()>| {
            assert_eq!(
                first_host(list).map_err(|_| ()),
                want.map(str::to_owned),
                "{list}"
            );
        };
        check("node[01-04,07]", Ok("node01"));
        check("node[07,01-04]", Ok("node07"));
        check("gpu5,node[1-2]", Ok("gpu5"));
        check("node[3-4],gpu5", Ok("node3"));
        check("rack[2-3]-n[1-2]", Ok("rack2-n1"));
        check("single", Ok("single"));
        check("a-b.example.org", Ok("a-b.example.org"));
        check("node[01-04", Err(()));
        check("node]1[", Err(()));
        check("node[x-y]", Err(()));
        check("", Err(()));
    }

    #[test]
    fn no_scheduler_is_a_single_node() {
        let id = detect_with(&cluster(1), &[]).unwrap();
        assert_eq!(summary(&id), "None 0/1 127.0.0.1:29500");
        assert_eq!(id.host, "hostA");
    }

    #[test]
    fn torchrun_and_pytorchjob() {
        let tr = [
            ("MASTER_ADDR", "n0"),
            ("MASTER_PORT", "1234"),
            ("GROUP_RANK", "2"),
            ("GROUP_WORLD_SIZE", "3"),
            ("LOCAL_WORLD_SIZE", "1"),
        ];
        assert_eq!(
            summary(&detect_with(&cluster(3), &tr).unwrap()),
            "Torchrun 2/3 n0:1234"
        );
        // NODE_RANK / NNODES win over GROUP_RANK / WORLD_SIZE.
        let v = [
            ("MASTER_ADDR", "n0"),
            ("NODE_RANK", "1"),
            ("GROUP_RANK", "0"),
            ("NNODES", "2"),
            ("WORLD_SIZE", "16"),
        ];
        assert_eq!(
            summary(&detect_with(&cluster(2), &v).unwrap()),
            "Torchrun 1/2 n0:29500"
        );
        // PyTorchJob: one pod per node, RANK / WORLD_SIZE.
        let pj = [
            ("MASTER_ADDR", "job-master-0"),
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
        ];
        assert_eq!(
            summary(&detect_with(&cluster(2), &pj).unwrap()),
            "Torchrun 1/2 job-master-0:29500"
        );
        let several = [
            ("MASTER_ADDR", "n0"),
            ("GROUP_RANK", "0"),
            ("LOCAL_WORLD_SIZE", "8"),
        ];
        assert!(matches!(
            detect_with(&cluster(1), &several),
            Err(ClusterError::SeveralPerNode {
                var: "LOCAL_WORLD_SIZE",
                value: 8,
                ..
            })
        ));
    }

    #[test]
    fn slurm_and_openmpi() {
        let slurm = [
            ("SLURM_PROCID", "3"),
            ("SLURM_NNODES", "4"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_JOB_NODELIST", "gpu[07-10]"),
        ];
        assert_eq!(
            summary(&detect_with(&cluster(4), &slurm).unwrap()),
            "Slurm 3/4 gpu07:29500"
        );
        let too_many = [
            ("SLURM_PROCID", "0"),
            ("SLURM_NNODES", "2"),
            ("SLURM_NTASKS", "16"),
        ];
        assert!(matches!(
            detect_with(&cluster(2), &too_many),
            Err(ClusterError::SeveralPerNode { .. })
        ));
        let mpi = [
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "10.0.0.1"),
        ];
        assert_eq!(
            summary(&detect_with(&cluster(2), &mpi).unwrap()),
            "OpenMpi 1/2 10.0.0.1:29500"
        );
        // OpenMPI gives no rendezvous host of its own.
        let e = detect_with(
            &cluster(2),
            &[("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "2")],
        );
        assert!(
            matches!(e, Err(ClusterError::NoRendezvous { node_rank: 1, .. })),
            "{e:?}"
        );
        // torchrun inside a Slurm allocation: torchrun's rank wins.
        let both = [
            ("SLURM_PROCID", "0"),
            ("SLURM_NNODES", "2"),
            ("MASTER_ADDR", "n0"),
            ("NODE_RANK", "1"),
            ("NNODES", "2"),
        ];
        assert_eq!(
            summary(&detect_with(&cluster(2), &both).unwrap()),
            "Torchrun 1/2 n0:29500"
        );
    }

    #[test]
    fn config_keys_override_the_environment() {
        let mut c = cluster(2);
        c.node_rank = Some(1);
        c.master_addr = Some("head".into());
        c.master_port = Some(4000);
        let v = [
            ("MASTER_ADDR", "n0"),
            ("MASTER_PORT", "1234"),
            ("NODE_RANK", "0"),
        ];
        assert_eq!(
            summary(&detect_with(&c, &v).unwrap()),
            "Config 1/2 head:4000"
        );
    }

    #[test]
    fn bad_environments_name_the_host_and_variable() {
        let e =
            detect_with(&cluster(1), &[("SLURM_PROCID", "0"), ("SLURM_NNODES", "4")]).unwrap_err();
        assert!(
            matches!(
                e,
                ClusterError::CountMismatch {
                    count: 4,
                    configured: 1,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().starts_with("on hostA: "), "{e}");
        assert!(e.to_string().contains("cluster.num_nodes=4"), "{e}");
        let e = detect_with(&cluster(2), &[("SLURM_PROCID", "five")]).unwrap_err();
        assert!(
            matches!(
                e,
                ClusterError::BadVar {
                    var: "SLURM_PROCID",
                    ..
                }
            ),
            "{e}"
        );
        let e = detect_with(&cluster(2), &[("SLURM_PROCID", "2")]).unwrap_err();
        assert!(
            matches!(e, ClusterError::RankOutOfRange { node_rank: 2, .. }),
            "{e}"
        );
        let e = detect_with(&cluster(1), &[("MASTER_PORT", "70000")]).unwrap_err();
        assert!(
            matches!(
                e,
                ClusterError::BadVar {
                    var: "MASTER_PORT",
                    ..
                }
            ),
            "{e}"
        );
        let e = detect_with(
            &cluster(2),
            &[("SLURM_PROCID", "1"), ("SLURM_JOB_NODELIST", "n[1-")],
        )
        .unwrap_err();
        assert!(
            matches!(
                e,
                ClusterError::BadVar {
                    var: "SLURM_JOB_NODELIST",
                    ..
                }
            ),
            "{e}"
        );
    }
}
