//! The launch file: everything a worker needs to start, written once by the orchestrator (versioned JSON).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::schema::RunConfig;
use rlsync_core::protocol::ProtocolError;
use rlsync_core::protocol::messages::PROTOCOL_VERSION;

/// Which entry point the run executes (the workers behave slightly differently in each).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LoopKind {
    Embodied,
    Async,
}

/// Everything a worker needs to start, written once by the orchestrator to `<run_dir>/.rlsync/launch.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LaunchSpec {
    pub format_version: u32,
    pub loop_kind: LoopKind,
    pub rollouts: u32,
    /// Envs simulated by each rollout worker.
    pub envs_per_rollout: u32,
    pub control_socket: PathBuf,
    /// Where the trainer's weight sender listens (rollouts connect to it).
    pub weight_socket: PathBuf,
    /// The same-host GPU channel's socket (`weight_syncer.patch.transport_device: cuda`): the trainer listens,
    /// the rollouts connect after the init bootstrap; absent: the channel is off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_socket: Option<PathBuf>,
    /// Names of shared-memory segments of this run start with this prefix.
    pub segment_prefix: String,
    /// A per-run secret (random, hex): every worker's hello must carry it. The launch file is 0600, so only
    /// the run's own user can read it.
    #[serde(default)]
    pub token: String,
    /// Where training starts: step 0 and version 0, or the checkpoint a resumed run continues from.
    #[serde(default)]
    pub start: StartPoint,
    pub config: RunConfig,
    /// The resolved job config as plain data (every key, also those rlsync does not read), for Python
    /// workers; `null` when the run was started without one (tests, benches).
    #[serde(default)]
    pub job: serde_json::Value,
    /// Multi-node runs: the global ranks of the rollouts on this node's weight channel, in channel order (a
    /// rollout joins it as its position here); absent: every rollout, rank for rank (one host).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_rollouts: Option<Vec<u32>>,
    /// Multi-node runs, the trainer's node: `ip:port` of the next node of the TCP weight chain.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chain_next: Option<String>,
    /// `weight_syncer.host_shared`: this host's arena and the rollout that applies into it (absent: off, or
    /// no rollout on this host).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_shared: Option<HostShared>,
}

/// A host's share of the host-shared mode: one arena (two whole-state buffers in shared memory) that one local
/// rollout, the applier, receives into from the weight channel while every local rollout reads it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostShared {
    /// The arena's shared-memory name ([`arena_name`]); the host's supervisor owns (unlinks) it.
    pub arena: String,
    /// Global rank of the applier: the lowest rank of the host's rollouts, the only one on the weight channel.
    pub applier: u32,
}

/// The arena of node `node` in the run tagged `tag`: `<tag>.arena.<node>`, so the run's leftover sweep knows
/// its owner (`run_files::sweep_leftovers`).
pub fn arena_name(tag: &str, node: u32) -> String {
    format!("{tag}.{ARENA_INFIX}.{node}")
}

/// What sets an arena's name apart from the run's other segments (`<tag>.<creator pid>.…`).
pub const ARENA_INFIX: &str = "arena";

impl LaunchSpec {
    /// The rollouts this node's weight channel serves.
    pub fn local_rollouts(&self) -> usize {
        self.node_rollouts
            .as_ref()
            .map_or(self.rollouts as usize, Vec::len)
    }

    /// The ranks of the rollouts on this node.
    pub fn local_ranks(&self) -> Vec<u32> {
        match &self.node_rollouts {
            None => (0..self.rollouts).collect(),
            Some(ranks) => ranks.clone(),
        }
    }

    /// The receivers on this node's weight channel: every local rollout, or in the host-shared mode the
    /// applier alone.
    pub fn weight_receivers(&self) -> usize {
        match &self.host_shared {
            Some(_) => self.local_rollouts().min(1),
            None => self.local_rollouts(),
        }
    }

    /// The host-shared mode's arena and applier, given the run's `tag` and this `node` (`None`: off, or no
    /// rollout here).
    pub fn host_shared_for(&self, tag: &str, node: u32) -> Option<HostShared> {
        if !self.config.weight_syncer.host_shared {
            return None;
        }
        let applier = host_applier(self.local_ranks())?;
        Some(HostShared {
            arena: arena_name(tag, node),
            applier,
        })
    }

    /// Rollout `rank`'s receiver rank on this node's weight channel (`None`: it is not on this node, or it
    /// is a host-shared reader, which is on no channel).
    pub fn weight_rank(&self, rank: u32) -> Option<usize> {
        if let Some(shared) = &self.host_shared {
            return (shared.applier == rank).then_some(0);
        }
        match &self.node_rollouts {
            None => (rank < self.rollouts).then_some(rank as usize),
            Some(ranks) => ranks.iter().position(|&r| r == rank),
        }
    }
}

/// The step and weight version a run starts at (`runner.resume_dir`: the checkpoint's; else zero). Steps and
/// versions continue from there, so the bootstrap sends the checkpoint's weights as this version.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StartPoint {
    pub step: u64,
    pub version: u64,
}

/// Path of the launch file inside a run dir.
pub(crate) fn launch_file(run_dir: &Path) -> PathBuf {
    run_dir.join(".rlsync").join("launch.json")
}

/// File-name prefix of the rollouts' local weights copies (and their temporary files) in `<run_dir>/.rlsync`.
pub const ROLLOUT_COPY_PREFIX: &str = "rollout-";

/// Path of rollout `rank`'s local weights copy (`runner.rollout_weights_copy_interval`) inside a run dir.
pub fn rollout_copy_file(run_dir: &Path, rank: u32) -> PathBuf {
    run_dir
        .join(".rlsync")
        .join(format!("{ROLLOUT_COPY_PREFIX}{rank}.safetensors"))
}

/// Metadata entries of a rollout's local weights copy (a safetensors file; `worker/local_copy.rs` writes and
/// loads it): format, the version the weights are, and the checksum of the file's tensors (all keys, in order).
const COPY_FORMAT_KEY: &str = "rlsync.copy.format";
/// 2: the checksum is the chunked `state_checksum` (a copy of format 1 is refused: the rollout starts from its
/// own weights and gets a full transfer).
const COPY_FORMAT: &str = "2";
const COPY_VERSION_KEY: &str = "rlsync.copy.version";
const COPY_CHECKSUM_KEY: &str = "rlsync.copy.checksum";

/// The metadata entries of a local weights copy of `version` whose tensors hash to `checksum`.
pub fn copy_metadata(version: u64, checksum: u64) -> Vec<(String, String)> {
    vec![
        (COPY_FORMAT_KEY.to_string(), COPY_FORMAT.to_string()),
        (COPY_VERSION_KEY.to_string(), version.to_string()),
        (COPY_CHECKSUM_KEY.to_string(), format!("{checksum:#018x}")),
    ]
}

/// The version and checksum a local weights copy's metadata records; why not, when it is not one.
pub fn parse_copy_metadata(
    meta: &std::collections::HashMap<String, String>,
) -> Result<(u64, u64), String> {
    if meta.get(COPY_FORMAT_KEY).map(String::as_str) != Some(COPY_FORMAT) {
        return Err(format!(
            "no {COPY_FORMAT_KEY} = {COPY_FORMAT} in its metadata (not a rollout's weights copy)"
        ));
    }
    let version = meta
        .get(COPY_VERSION_KEY)
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| format!("no valid {COPY_VERSION_KEY} in its metadata"))?;
    let checksum = meta
        .get(COPY_CHECKSUM_KEY)
        .and_then(|c| c.strip_prefix("0x"))
        .and_then(|c| u64::from_str_radix(c, 16).ok())
        .ok_or_else(|| format!("no valid {COPY_CHECKSUM_KEY} in its metadata"))?;
    Ok((version, checksum))
}

/// Serialize the launch file.
pub(crate) fn encode_launch(spec: &LaunchSpec) -> Result<Vec<u8>, ProtocolError> {
    serde_json::to_vec_pretty(spec).map_err(|source| ProtocolError::Json {
        what: "launch file",
        source,
    })
}

/// Parse the launch file, refusing other format versions.
pub(crate) fn decode_launch(bytes: &[u8]) -> Result<LaunchSpec, ProtocolError> {
    #[derive(Deserialize)]
    struct VersionOnly {
        format_version: u32,
    }
    let malformed = |source| ProtocolError::Json {
        what: "launch file",
        source,
    };
    let probe: VersionOnly = serde_json::from_slice(bytes).map_err(malformed)?;
    if probe.format_version != PROTOCOL_VERSION {
        return Err(ProtocolError::Version {
            peer: probe.format_version,
            ours: PROTOCOL_VERSION,
        });
    }
    serde_json::from_slice(bytes).map_err(malformed)
}

/// The host-shared applier among a host's rollout `ranks`: its lowest rank (`None`: no rollout there). The one
/// rule both the launch file (`LaunchSpec::host_shared_for`) and the orchestrator's receiver map follow.
pub fn host_applier(ranks: impl IntoIterator<Item = u32>) -> Option<u32> {
    ranks.into_iter().min()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_metadata_roundtrips_and_refuses_other_files() {
        let meta: std::collections::HashMap<_, _> =
            copy_metadata(42, 0xDEAD_BEEF).into_iter().collect();
        assert_eq!(parse_copy_metadata(&meta), Ok((42, 0xDEAD_BEEF)));
        let mut other = meta.clone();
        other.remove(COPY_FORMAT_KEY);
        assert!(parse_copy_metadata(&other).unwrap_err().contains("format"));
        let mut bad = meta;
        bad.insert(COPY_CHECKSUM_KEY.into(), "zz".into());
        assert!(parse_copy_metadata(&bad).unwrap_err().contains("checksum"));
    }

    #[test]
    fn host_shared_puts_only_the_lowest_local_rank_on_the_weight_channel() {
        let mut spec = LaunchSpec {
            format_version: PROTOCOL_VERSION,
            loop_kind: LoopKind::Embodied,
            rollouts: 5,
            envs_per_rollout: 1,
            control_socket: "/tmp/c.sock".into(),
            weight_socket: "/tmp/w.sock".into(),
            gpu_socket: None,
            segment_prefix: "rlsync-1-x".into(),
            token: String::new(),
            start: StartPoint::default(),
            config: RunConfig::default(),
            job: serde_json::Value::Null,
            node_rollouts: Some(vec![4, 2, 3]),
            chain_next: None,
            host_shared: None,
        };
        assert_eq!(
            spec.host_shared_for("rlsync-1-x", 1),
            None,
            "off by default"
        );
        assert_eq!(spec.weight_receivers(), 3);
        assert_eq!(spec.weight_rank(4), Some(0));
        spec.config.weight_syncer.host_shared = true;
        let shared = spec.host_shared_for("rlsync-1-x", 1).unwrap();
        assert_eq!(shared.arena, "rlsync-1-x.arena.1");
        assert_eq!(shared.applier, 2);
        spec.host_shared = Some(shared);
        assert_eq!(spec.weight_receivers(), 1);
        assert_eq!(spec.weight_rank(2), Some(0));
        assert_eq!(spec.weight_rank(4), None, "a reader is on no channel");
        assert_eq!(spec.weight_rank(3), None);
        spec.node_rollouts = Some(Vec::new());
        assert_eq!(
            spec.host_shared_for("rlsync-1-x", 1),
            None,
            "no rollout here"
        );
        assert_eq!(spec.weight_receivers(), 0);
    }

    #[test]
    fn launch_file_roundtrips_and_checks_version() {
        let spec = LaunchSpec {
            format_version: PROTOCOL_VERSION,
            loop_kind: LoopKind::Async,
            rollouts: 2,
            envs_per_rollout: 4,
            control_socket: "/tmp/c.sock".into(),
            weight_socket: "/tmp/w.sock".into(),
            gpu_socket: None,
            segment_prefix: "rlsync-1-x".into(),
            token: "0123".into(),
            start: StartPoint {
                step: 100,
                version: 100,
            },
            config: RunConfig::default(),
            job: serde_json::json!({"env": {"train": {"task": "Reacher-v5"}}}),
            node_rollouts: Some(vec![2, 3]),
            chain_next: Some("10.0.0.2:29510".into()),
            host_shared: Some(HostShared {
                arena: arena_name("rlsync-1-x", 1),
                applier: 2,
            }),
        };
        let bytes = encode_launch(&spec).unwrap();
        assert_eq!(decode_launch(&bytes).unwrap(), spec);
        let text = String::from_utf8(bytes).unwrap().replacen(
            &format!("\"format_version\": {PROTOCOL_VERSION}"),
            "\"format_version\": 99",
            1,
        );
        assert!(matches!(
            decode_launch(text.as_bytes()),
            Err(ProtocolError::Version { peer: 99, .. })
        ));
        assert!(decode_launch(b"{").is_err());
    }
}
