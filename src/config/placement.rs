//! RLinf's `cluster.component_placement` over nodes: which worker runs on which node.
//!
//! A placement lists global slot ("resource") ranks, optionally with the process ranks that share them, in
//! RLinf's syntax: `0-3` (processes 0-3 on slots 0-3, one each), `0,2,4`, `all`, `0-1:0-3` (processes 0-3 on
//! slots 0-1, two per slot), `0-3:0-1` (each process on two slots), and mixes (`0-1:0-3,4-5`: processes 4-5 on
//! slots 4-5). Process ranks are continuous from 0 across the entries. Slot `s` is on node
//! `s / slots_per_node`. rlsync runs one trainer (the actor's process 0) and one rollout worker per rollout
//! process; `env` runs inside the rollout workers, so its placement is checked but places nothing.

use std::fmt;

use crate::config::schema::{ClusterConfig, MAX_PLACEMENT_SLOTS};

/// Where one worker runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlacedWorker {
    /// `"trainer"` or `"rollout"`.
    pub role: &'static str,
    pub rank: u32,
    pub node: u32,
    /// The global slots this worker holds (one, or several when processes are fewer than slots).
    pub slots: Vec<u32>,
}

/// The run's workers over its nodes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodePlacement {
    pub num_nodes: u32,
    pub slots_per_node: u32,
    /// True when `cluster.slots_per_node` was null and the value above was derived from the slots in use.
    pub slots_per_node_derived: bool,
    pub trainer: PlacedWorker,
    pub rollouts: Vec<PlacedWorker>,
}

impl NodePlacement {
    /// Every worker placed on `node`, trainer first.
    pub(crate) fn on_node(&self, node: u32) -> impl Iterator<Item = &PlacedWorker> {
        std::iter::once(&self.trainer)
            .chain(self.rollouts.iter())
            .filter(move |w| w.node == node)
    }

    /// The weight chain: the trainer's node first, then every other node that hosts rollouts, in node order.
    /// A payload crosses each link of the chain once.
    pub fn chain(&self) -> Vec<u32> {
        let mut chain = vec![self.trainer.node];
        for node in 0..self.num_nodes {
            if node != self.trainer.node && self.rollouts.iter().any(|w| w.node == node) {
                chain.push(node);
            }
        }
        chain
    }

    /// Nodes with no worker at all (their agent would only wait; `--dry-run` warns about them).
    pub(crate) fn idle_nodes(&self) -> Vec<u32> {
        (0..self.num_nodes)
            .filter(|&n| self.on_node(n).next().is_none())
            .collect()
    }
}

impl fmt::Display for NodePlacement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let derived = if self.slots_per_node_derived {
            " (derived: set cluster.slots_per_node to fix it)"
        } else {
            ""
        };
        writeln!(
            f,
            "  nodes          {} node(s), {} slot(s) per node{derived}; node 0 runs the orchestrator",
            self.num_nodes, self.slots_per_node
        )?;
        for node in 0..self.num_nodes {
            let workers: Vec<String> = self
                .on_node(node)
                .map(|w| {
                    let slots: Vec<String> = w.slots.iter().map(u32::to_string).collect();
                    format!("{}-{} (slot {})", w.role, w.rank, slots.join(","))
                })
                .collect();
            let what = if workers.is_empty() {
                "no workers (idle)".to_owned()
            } else {
                workers.join(", ")
            };
            let agent = if node == 0 {
                "orchestrator"
            } else {
                "node agent"
            };
            writeln!(f, "    - node {node} ({agent}): {what}")?;
        }
        if self.num_nodes > 1 {
            let chain: Vec<String> = self.chain().iter().map(|n| format!("node {n}")).collect();
            writeln!(
                f,
                "  weight chain   {} (TCP, pipelined in parts)",
                chain.join(" -> ")
            )?;
        }
        Ok(())
    }
}

/// A placement no cluster of the configured shape can run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    #[error("cluster.component_placement has no entry for {component} (e.g. `{component}: 0-1`)")]
    Missing { component: &'static str },
    #[error("cluster.component_placement.{key}: '{text}' {reason}")]
    Syntax {
        key: String,
        text: String,
        reason: String,
    },
    #[error(
        "cluster.component_placement.{key}: node_group '{group}' (RLinf's heterogeneous clusters) is not \
         supported by rlsync; write global slot ranges instead"
    )]
    NodeGroup { key: String, group: String },
    #[error(
        "cluster.component_placement.{key}: `all` needs the cluster's size: set cluster.slots_per_node (the \
         slots each node has)"
    )]
    AllNeedsSize { key: String },
    #[error(
        "cluster.component_placement.{key}: slot {slot} would be on node {node}, but cluster.num_nodes is \
         {num_nodes} ({slots_per_node} slots per node)"
    )]
    OutOfRange {
        key: String,
        slot: u32,
        node: u32,
        num_nodes: u32,
        slots_per_node: u32,
    },
    #[error(
        "cluster.component_placement.{key}: process {process} would hold slots {slots:?} on nodes {nodes:?}; \
         a process runs on one node"
    )]
    SpansNodes {
        key: String,
        process: u32,
        slots: Vec<u32>,
        nodes: Vec<u32>,
    },
    #[error(
        "cluster.component_placement: {component} is listed twice (in '{first}' and '{second}')"
    )]
    Duplicate {
        component: String,
        first: String,
        second: String,
    },
}

impl PlacementError {
    /// The config key the error is about (for `config::typed`'s problem list).
    pub(crate) fn key_path(&self) -> String {
        match self {
            PlacementError::Missing { component } => {
                format!("cluster.component_placement.{component}")
            }
            PlacementError::Syntax { key, .. }
            | PlacementError::NodeGroup { key, .. }
            | PlacementError::AllNeedsSize { key }
            | PlacementError::OutOfRange { key, .. }
            | PlacementError::SpansNodes { key, .. } => {
                format!("cluster.component_placement.{key}")
            }
            PlacementError::Duplicate { .. } => "cluster.component_placement".to_owned(),
        }
    }
}

/// One entry of a placement: slots (`None` = `all`) and, if given, the process ranks that share them.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    slots: Option<(u32, u32)>,
    listed: Vec<u32>,
    processes: Option<(u32, u32)>,
}

fn parse_range(text: &str) -> Option<(u32, u32)> {
    let text = text.trim();
    let (lo, hi) = match text.split_once('-') {
        Some((lo, hi)) => (lo.trim(), hi.trim()),
        None => (text, text),
    };
    let lo: u32 = lo.parse().ok()?;
    let hi: u32 = hi.parse().ok()?;
    (lo <= hi).then_some((lo, hi))
}

fn parse_entries(key: &str, text: &str) -> Result<Vec<Entry>, PlacementError> {
    let bad = |reason: &str| PlacementError::Syntax {
        key: key.to_owned(),
        text: text.to_owned(),
        reason: reason.to_owned(),
    };
    if text.trim().is_empty() {
        return Err(bad("is empty"));
    }
    let mut entries = Vec::new();
    for part in text.split(',') {
        let (slots, processes) = match part.split_once(':') {
            Some((s, p)) => (s.trim(), Some(p.trim())),
            None => (part.trim(), None),
        };
        let slots = if slots == "all" {
            None
        } else {
            Some(parse_range(slots).ok_or_else(|| {
                bad("is not a placement like `0-3`, `0,2,4`, `3`, `all` or `0-1:0-3` (slots:processes)")
            })?)
        };
        let processes = match processes {
            None => None,
            Some(p) => Some(
                parse_range(p)
                    .ok_or_else(|| bad("has process ranks that are not a range like `0-3`"))?,
            ),
        };
        entries.push(Entry {
            slots,
            listed: Vec::new(),
            processes,
        });
    }
    Ok(entries)
}

/// Per process (in rank order), the slots it holds.
fn processes_of(
    key: &str,
    text: &str,
    entries: &mut [Entry],
    total_slots: Option<u32>,
) -> Result<Vec<Vec<u32>>, PlacementError> {
    let bad = |reason: String| PlacementError::Syntax {
        key: key.to_owned(),
        text: text.to_owned(),
        reason,
    };
    let mut seen = Vec::new();
    let mut out: Vec<Vec<u32>> = Vec::new();
    for e in entries.iter_mut() {
        let (lo, hi) = match e.slots {
            Some(r) => r,
            None => match total_slots {
                Some(n) => (0, n - 1),
                None => {
                    return Err(PlacementError::AllNeedsSize {
                        key: key.to_owned(),
                    });
                }
            },
        };
        e.listed = (lo..=hi).collect();
        for &s in &e.listed {
            if seen.contains(&s) {
                return Err(bad(format!("lists slot {s} twice")));
            }
            seen.push(s);
        }
        let next = u32::try_from(out.len()).unwrap_or(u32::MAX);
        let slots = &e.listed;
        let n_slots = slots.len();
        match e.processes {
            None => out.extend(slots.iter().map(|&s| vec![s])),
            Some((plo, phi)) => {
                if plo != next {
                    return Err(bad(format!(
                        "has process ranks {plo}-{phi} where process {next} comes next (process ranks run \
                         from 0 without gaps)"
                    )));
                }
                let n_procs = (phi - plo + 1) as usize;
                if n_procs >= n_slots {
                    if !n_procs.is_multiple_of(n_slots) {
                        return Err(bad(format!(
                            "puts {n_procs} processes on {n_slots} slots: they must split evenly"
                        )));
                    }
                    let per = n_procs / n_slots;
                    out.extend((0..n_procs).map(|i| vec![slots[i / per]]));
                } else {
                    if n_slots % n_procs != 0 {
                        return Err(bad(format!(
                            "spreads {n_procs} processes over {n_slots} slots: they must split evenly"
                        )));
                    }
                    let per = n_slots / n_procs;
                    out.extend((0..n_procs).map(|i| slots[i * per..(i + 1) * per].to_vec()));
                }
            }
        }
    }
    Ok(out)
}

/// Map `cluster.component_placement` onto `cluster.num_nodes` nodes, or say why it cannot run.
pub fn resolve(cluster: &ClusterConfig) -> Result<NodePlacement, PlacementError> {
    // Components named in more than one key.
    let mut owner: Vec<(String, String)> = Vec::new();
    for key in cluster.component_placement.keys() {
        for c in key.split(',').map(str::trim) {
            if let Some((_, first)) = owner.iter().find(|(name, _)| name == c) {
                return Err(PlacementError::Duplicate {
                    component: c.to_owned(),
                    first: first.clone(),
                    second: key.clone(),
                });
            }
            owner.push((c.to_owned(), key.clone()));
        }
    }
    // Parse every entry (each placement once, even if it names several components).
    let mut parsed = Vec::new();
    for (key, placement) in &cluster.component_placement {
        let (text, group) = placement.text();
        if let Some(group) = group {
            return Err(PlacementError::NodeGroup {
                key: key.clone(),
                group: group.to_owned(),
            });
        }
        let entries = parse_entries(key, &text)?;
        // Count before anything is expanded: a hostile `0-2000000` costs nothing to refuse.
        let listed: u64 = entries
            .iter()
            .flat_map(|e| [e.slots, e.processes])
            .flatten()
            .map(|(lo, hi)| u64::from(hi.saturating_sub(lo)) + 1)
            .sum();
        if listed > MAX_PLACEMENT_SLOTS as u64 {
            return Err(PlacementError::Syntax {
                key: key.clone(),
                text,
                reason: format!(
                    "lists more than {MAX_PLACEMENT_SLOTS} slots (one worker process each)"
                ),
            });
        }
        parsed.push((key.clone(), text, entries));
    }
    let num_nodes = cluster.num_nodes.get();
    let (slots_per_node, derived) = match cluster.slots_per_node {
        Some(n) => (n.get(), false),
        None => {
            let used = parsed
                .iter()
                .flat_map(|(_, _, es)| es.iter())
                .filter_map(|e| e.slots.map(|(_, hi)| hi.saturating_add(1)))
                .max();
            let all_only = used.is_none();
            if all_only && num_nodes > 1 {
                (1, true)
            } else {
                (used.unwrap_or(1).div_ceil(num_nodes).max(1), true)
            }
        }
    };
    let total = if derived
        && parsed
            .iter()
            .any(|(_, _, es)| es.iter().any(|e| e.slots.is_none()))
    {
        None
    } else {
        num_nodes.checked_mul(slots_per_node)
    };
    let mut per_key = Vec::new();
    for (key, text, mut entries) in parsed {
        let procs = processes_of(&key, &text, &mut entries, total)?;
        for (p, slots) in procs.iter().enumerate() {
            let mut nodes: Vec<u32> = slots.iter().map(|s| s / slots_per_node).collect();
            nodes.dedup();
            if let Some(&slot) = slots.iter().find(|&&s| s / slots_per_node >= num_nodes) {
                return Err(PlacementError::OutOfRange {
                    key,
                    slot,
                    node: slot / slots_per_node,
                    num_nodes,
                    slots_per_node,
                });
            }
            if nodes.len() > 1 {
                return Err(PlacementError::SpansNodes {
                    key,
                    process: p as u32,
                    slots: slots.clone(),
                    nodes,
                });
            }
        }
        per_key.push((key, procs));
    }
    let find = |component: &str| {
        per_key
            .iter()
            .find(|(key, _)| key.split(',').any(|c| c.trim() == component))
            .map(|(_, procs)| procs)
    };
    let place = |role: &'static str, rank: usize, slots: &[u32]| PlacedWorker {
        role,
        rank: rank as u32,
        node: slots[0] / slots_per_node,
        slots: slots.to_vec(),
    };
    let trainer = match find("actor").and_then(|p| p.first()) {
        Some(slots) => place("trainer", 0, slots),
        None => place("trainer", 0, &[0]),
    };
    let rollouts = find("rollout")
        .ok_or(PlacementError::Missing {
            component: "rollout",
        })?
        .iter()
        .enumerate()
        .map(|(rank, slots)| place("rollout", rank, slots))
        .collect();
    Ok(NodePlacement {
        num_nodes,
        slots_per_node,
        slots_per_node_derived: derived,
        trainer,
        rollouts,
    })
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use indexmap::IndexMap;

    use super::*;
    use crate::config::schema::{GroupedPlacement, Placement, PlacementRanges};

    fn cluster(nodes: u32, per_node: Option<u32>, entries: &[(&str, &str)]) -> ClusterConfig {
        let mut placement = IndexMap::new();
        for (k, v) in entries {
            placement.insert((*k).to_owned(), Placement::Ranges((*v).to_owned()));
        }
        ClusterConfig {
            num_nodes: NonZeroU32::new(nodes).unwrap(),
            slots_per_node: per_node.and_then(NonZeroU32::new),
            component_placement: placement,
            ..ClusterConfig::default()
        }
    }

    /// `role-rank@node` for every worker, trainer first.
    fn layout(p: &NodePlacement) -> Vec<String> {
        std::iter::once(&p.trainer)
            .chain(&p.rollouts)
            .map(|w| format!("{}{}@{}", &w.role[..1], w.rank, w.node))
            .collect()
    }

    #[test]
    fn single_node_default_is_unchanged() {
        let p = resolve(&ClusterConfig::default()).unwrap();
        assert_eq!(layout(&p), ["t0@0", "r0@0", "r1@0"]);
        assert_eq!(p.chain(), [0]);
        assert!(p.idle_nodes().is_empty());
    }

    #[test]
    fn slots_map_to_nodes() {
        // 2 nodes x 4 slots: the trainer on node 0, rollouts on slots 4-7 (node 1) and 1-3 (node 0).
        let p = resolve(&cluster(2, Some(4), &[("actor", "0"), ("rollout", "1-7")])).unwrap();
        assert_eq!(
            layout(&p),
            [
                "t0@0", "r0@0", "r1@0", "r2@0", "r3@1", "r4@1", "r5@1", "r6@1"
            ]
        );
        assert_eq!(p.chain(), [0, 1]);
        // Trainer alone on node 0, one rollout per further node.
        let p = resolve(&cluster(5, Some(1), &[("actor", "0"), ("rollout", "1-4")])).unwrap();
        assert_eq!(layout(&p), ["t0@0", "r0@1", "r1@2", "r2@3", "r3@4"]);
        assert_eq!(p.chain(), [0, 1, 2, 3, 4]);
    }

    #[test]
    fn rlinf_syntax_shared_keys_all_and_process_ranks() {
        // `actor,env,rollout: all` on 2 nodes x 2 slots: four rollouts, the trainer on slot 0.
        let p = resolve(&cluster(2, Some(2), &[("actor,env,rollout", "all")])).unwrap();
        assert_eq!(layout(&p), ["t0@0", "r0@0", "r1@0", "r2@1", "r3@1"]);
        // Two processes per slot.
        let p = resolve(&cluster(
            2,
            Some(1),
            &[("actor", "0"), ("rollout", "0-1:0-3")],
        ))
        .unwrap();
        assert_eq!(layout(&p), ["t0@0", "r0@0", "r1@0", "r2@1", "r3@1"]);
        // One process over two slots (on one node), then a plain range continues the process ranks.
        let p = resolve(&cluster(
            2,
            Some(4),
            &[("actor", "0"), ("rollout", "0-3:0-1,4-5")],
        ))
        .unwrap();
        assert_eq!(layout(&p), ["t0@0", "r0@0", "r1@0", "r2@1", "r3@1"]);
        assert_eq!(p.rollouts[0].slots, [0, 1]);
        // The long form without a node group.
        let mut c = cluster(1, None, &[("actor", "0")]);
        c.component_placement.insert(
            "rollout".into(),
            Placement::Grouped(GroupedPlacement {
                node_group: None,
                placement: PlacementRanges::Ranges("0-2".into()),
            }),
        );
        assert_eq!(resolve(&c).unwrap().rollouts.len(), 3);
    }

    #[test]
    fn derived_slots_per_node_split_the_used_slots() {
        let p = resolve(&cluster(2, None, &[("actor", "0"), ("rollout", "1-3")])).unwrap();
        assert!(p.slots_per_node_derived);
        assert_eq!(p.slots_per_node, 2);
        assert_eq!(layout(&p), ["t0@0", "r0@0", "r1@1", "r2@1"]);
        // One node: everything on it, however many slots.
        let p = resolve(&cluster(1, None, &[("rollout", "0-9")])).unwrap();
        assert_eq!(p.slots_per_node, 10);
        assert_eq!(p.trainer.node, 0);
    }

    #[test]
    fn impossible_placements_are_refused() {
        let err = |c: ClusterConfig| resolve(&c).unwrap_err();
        let e = err(cluster(2, Some(2), &[("actor", "0"), ("rollout", "1-4")]));
        assert!(
            matches!(
                e,
                PlacementError::OutOfRange {
                    slot: 4,
                    node: 2,
                    num_nodes: 2,
                    ..
                }
            ),
            "{e}"
        );
        assert_eq!(e.key_path(), "cluster.component_placement.rollout");
        let e = err(cluster(2, Some(2), &[("rollout", "1-2:0")]));
        assert!(
            matches!(e, PlacementError::SpansNodes { process: 0, .. }),
            "{e}"
        );
        let e = err(cluster(1, None, &[("rollout", "0-2:0-3")]));
        assert!(e.to_string().contains("split evenly"), "{e}");
        let e = err(cluster(1, None, &[("rollout", "0-1:1-2")]));
        assert!(e.to_string().contains("process 0 comes next"), "{e}");
        let e = err(cluster(1, None, &[("rollout", "0-1,1")]));
        assert!(e.to_string().contains("slot 1 twice"), "{e}");
        let e = err(cluster(1, None, &[("rollout", "3-1")]));
        assert!(matches!(e, PlacementError::Syntax { .. }), "{e}");
        let e = err(cluster(1, None, &[("rollout", "gpu0")]));
        assert!(matches!(e, PlacementError::Syntax { .. }), "{e}");
        let e = err(cluster(1, None, &[("actor,rollout", "all")]));
        assert!(matches!(e, PlacementError::AllNeedsSize { .. }), "{e}");
        let e = err(cluster(1, None, &[("actor", "0")]));
        assert_eq!(
            e,
            PlacementError::Missing {
                component: "rollout"
            }
        );
        let e = err(cluster(
            1,
            None,
            &[("actor,rollout", "0"), ("rollout", "1")],
        ));
        assert!(matches!(e, PlacementError::Duplicate { .. }), "{e}");
        let mut c = cluster(2, None, &[("actor", "0")]);
        c.component_placement.insert(
            "rollout".into(),
            Placement::Grouped(GroupedPlacement {
                node_group: Some("4090".into()),
                placement: PlacementRanges::Single(0),
            }),
        );
        assert!(matches!(err(c), PlacementError::NodeGroup { .. }));
    }

    #[test]
    fn report_lists_every_node() {
        let p = resolve(&cluster(3, Some(1), &[("actor", "0"), ("rollout", "2")])).unwrap();
        let text = p.to_string();
        assert!(
            text.contains("node 0 (orchestrator): trainer-0 (slot 0)"),
            "{text}"
        );
        assert!(
            text.contains("node 1 (node agent): no workers (idle)"),
            "{text}"
        );
        assert!(
            text.contains("node 2 (node agent): rollout-0 (slot 2)"),
            "{text}"
        );
        assert!(text.contains("node 0 -> node 2"), "{text}");
        assert_eq!(p.idle_nodes(), [1]);
    }
}
