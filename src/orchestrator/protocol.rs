//! The control protocol between the orchestrator and its workers: versioned, length-prefixed frames.
//!
//! Frame layout (all integers little-endian):
//! `[u32 frame_len][u32 header_len][header: JSON][blob: frame_len - 4 - header_len raw bytes]`.
//! The JSON header is one of the message enums below; the blob carries bulk bytes (trajectories) so they are
//! never JSON-encoded. The first frame on every connection is a [`Hello`] from the worker carrying
//! [`PROTOCOL_VERSION`]; the orchestrator rejects any other version. The [`LaunchSpec`] file in the run dir is
//! the other serialized format of the orchestrator (also versioned).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::config::schema::RunConfig;
use crate::env::{ActionSpace, EpisodeMetrics};
use crate::rl::{ActionBuf, Trajectory};

/// Version of the control protocol and of the launch file; bump on any incompatible change.
pub const PROTOCOL_VERSION: u32 = 1;

/// Frames larger than this are rejected (a corrupt length must not allocate gigabytes).
pub const MAX_FRAME_BYTES: usize = 1 << 30;

#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    #[error("control connection i/o failed: {0}")]
    Io(#[from] std::io::Error),
    #[error("peer closed the control connection")]
    Closed,
    #[error("frame of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge { len: usize, max: usize },
    #[error("malformed frame: {reason}")]
    Malformed { reason: String },
    #[error("protocol version mismatch: peer speaks {peer}, this binary speaks {ours}")]
    Version { peer: u32, ours: u32 },
}

/// The two worker roles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Trainer,
    Rollout,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::Trainer => "trainer",
            Role::Rollout => "rollout",
        }
    }

    pub fn parse(text: &str) -> Option<Role> {
        match text {
            "trainer" => Some(Role::Trainer),
            "rollout" => Some(Role::Rollout),
            _ => None,
        }
    }
}

/// First frame on a connection: who is speaking.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Hello {
    pub protocol: u32,
    pub role: Role,
    pub rank: u32,
    pub pid: u32,
}

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
    /// Names of shared-memory segments of this run start with this prefix.
    pub segment_prefix: String,
    /// Where training starts: step 0 and version 0, or the checkpoint a resumed run continues from.
    #[serde(default)]
    pub start: StartPoint,
    pub config: RunConfig,
}

/// The step and weight version a run starts at (`runner.resume_dir`: the checkpoint's; else zero). Steps and
/// versions continue from there, so the bootstrap sends the checkpoint's weights as this version.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StartPoint {
    pub step: u64,
    pub version: u64,
}

/// Statistics of one weight transfer, as the trainer reports them.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SyncStats {
    pub version: u64,
    /// `init`, `patch` or `bucket`.
    pub kind: String,
    pub payload_bytes: u64,
    pub changed: u64,
    pub state_bytes: u64,
    pub compression_ratio: f64,
    pub seconds: f64,
}

/// Orchestrator → worker commands.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "snake_case")]
pub enum Command {
    /// Trainer: open the weight sender and bootstrap; rollout: connect and receive the bootstrap.
    InitWeights,
    /// Trainer: publish the current weights as `version`.
    Sync { version: u64 },
    /// Rollout: receive and install the next update now (blocking sync).
    Apply,
    /// Rollout: generate chunks `first_chunk..first_chunk+chunks`, one [`Report::Chunk`] each.
    /// Each chunk is `steps` steps of every env of the worker. With `background` set, updates are received in
    /// the background and installed between chunks.
    Rollout {
        first_chunk: u64,
        chunks: u32,
        steps: u32,
        background: bool,
    },
    /// Trainer: one optimisation step on the trajectories in the blob (concatenated chunk payloads).
    Train {
        step: u64,
        chunks: u32,
        env_steps: u64,
    },
    /// Rollout: evaluate the weights it holds now, deterministically, one episode per env of its share of
    /// `env.eval`; answered by [`Report::Evaluated`].
    Eval,
    /// Trainer: save a checkpoint of the current weights (and optimizer) under
    /// `<run_dir>/checkpoints/global_step_<step>`; answered by [`Report::Checkpointed`].
    Checkpoint,
    /// Finish and exit 0.
    Stop,
}

/// Worker → orchestrator reports.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "report", rename_all = "snake_case")]
pub enum Report {
    Hello(Hello),
    /// Trainer: weights published.
    Synced {
        stats: SyncStats,
        checksum: u64,
        seconds: f64,
    },
    /// Rollout: a version is installed (after bootstrap, a blocking apply or a background install).
    Applied {
        version: u64,
        checksum: u64,
        seconds: f64,
    },
    /// Rollout: one trajectory chunk in the blob, produced entirely by weights `version`.
    Chunk {
        chunk: u64,
        version: u64,
        env_steps: u64,
        mean_return: f64,
        busy_s: f64,
    },
    /// Trainer: the step is done, the trainer now holds `version`. `metrics` are the workload's own
    /// (`actor/…`, `env/…`, `eval/…`), logged as they are; absent for workloads that have none. A value is
    /// `None` where it is undefined this step (NaN: JSON has no NaN, so an f64 would not round-trip).
    Trained {
        step: u64,
        version: u64,
        loss: f64,
        busy_s: f64,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        metrics: Vec<(String, Option<f64>)>,
    },
    /// Rollout: the evaluation of weights `version`: `episodes` episodes (one per eval env; 0 for workloads
    /// without envs) with their mean return, success rate and length.
    Evaluated {
        version: u64,
        episodes: u64,
        mean_return: f64,
        success_rate: f64,
        episode_len: f64,
    },
    /// Trainer: a checkpoint was written to `dir` at `step` (trainer steps completed) holding `version`.
    Checkpointed {
        step: u64,
        version: u64,
        dir: PathBuf,
    },
    /// The worker failed; it exits right after.
    Failed {
        message: String,
    },
}

/// A decoded frame: a typed header and its bulk bytes.
#[derive(Debug, PartialEq)]
pub struct Frame<T> {
    pub header: T,
    pub blob: Vec<u8>,
}

/// Encode a header and blob into one frame.
pub fn encode<T: Serialize>(header: &T, blob: &[u8]) -> Result<Vec<u8>, ProtocolError> {
    let json = serde_json::to_vec(header).map_err(|e| ProtocolError::Malformed {
        reason: e.to_string(),
    })?;
    let body_len = 4 + json.len() + blob.len();
    if body_len > MAX_FRAME_BYTES {
        return Err(ProtocolError::TooLarge {
            len: body_len,
            max: MAX_FRAME_BYTES,
        });
    }
    let mut out = Vec::with_capacity(4 + body_len);
    out.extend_from_slice(&(body_len as u32).to_le_bytes());
    out.extend_from_slice(&(json.len() as u32).to_le_bytes());
    out.extend_from_slice(&json);
    out.extend_from_slice(blob);
    Ok(out)
}

/// Decode a frame body (everything after the `frame_len` prefix).
pub fn decode_body<T: for<'de> Deserialize<'de>>(
    mut body: Vec<u8>,
) -> Result<Frame<T>, ProtocolError> {
    let header_len = body
        .get(..4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
        .ok_or_else(|| ProtocolError::Malformed {
            reason: format!("body of {} bytes has no header length", body.len()),
        })?;
    let header_end = 4usize
        .checked_add(header_len)
        .filter(|end| *end <= body.len())
        .ok_or_else(|| ProtocolError::Malformed {
            reason: format!(
                "header length {header_len} exceeds body of {} bytes",
                body.len()
            ),
        })?;
    let header =
        serde_json::from_slice(&body[4..header_end]).map_err(|e| ProtocolError::Malformed {
            reason: format!("bad header: {e}"),
        })?;
    let blob = body.split_off(header_end);
    Ok(Frame { header, blob })
}

/// Read one frame; `Closed` when the peer closed cleanly between frames.
pub async fn read_frame<T, R>(reader: &mut R) -> Result<Frame<T>, ProtocolError>
where
    T: for<'de> Deserialize<'de>,
    R: AsyncReadExt + Unpin,
{
    let mut len = [0u8; 4];
    match reader.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            return Err(ProtocolError::Closed);
        }
        Err(e) => return Err(e.into()),
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME_BYTES {
        return Err(ProtocolError::TooLarge {
            len,
            max: MAX_FRAME_BYTES,
        });
    }
    let mut body = vec![0u8; len];
    reader
        .read_exact(&mut body)
        .await
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => ProtocolError::Closed,
            _ => ProtocolError::Io(e),
        })?;
    decode_body(body)
}

/// Write one frame.
pub async fn write_frame<T, W>(writer: &mut W, header: &T, blob: &[u8]) -> Result<(), ProtocolError>
where
    T: Serialize,
    W: AsyncWriteExt + Unpin,
{
    let bytes = encode(header, blob)?;
    writer.write_all(&bytes).await?;
    writer.flush().await?;
    Ok(())
}

/// Check a worker's greeting against this binary's protocol version.
pub fn check_hello(hello: &Hello) -> Result<(), ProtocolError> {
    if hello.protocol != PROTOCOL_VERSION {
        return Err(ProtocolError::Version {
            peer: hello.protocol,
            ours: PROTOCOL_VERSION,
        });
    }
    Ok(())
}

/// Serialize the launch file.
pub fn encode_launch(spec: &LaunchSpec) -> Result<Vec<u8>, ProtocolError> {
    serde_json::to_vec_pretty(spec).map_err(|e| ProtocolError::Malformed {
        reason: e.to_string(),
    })
}

/// Parse the launch file, refusing other format versions.
pub fn decode_launch(bytes: &[u8]) -> Result<LaunchSpec, ProtocolError> {
    #[derive(Deserialize)]
    struct VersionOnly {
        format_version: u32,
    }
    let probe: VersionOnly =
        serde_json::from_slice(bytes).map_err(|e| ProtocolError::Malformed {
            reason: format!("launch file: {e}"),
        })?;
    if probe.format_version != PROTOCOL_VERSION {
        return Err(ProtocolError::Version {
            peer: probe.format_version,
            ours: PROTOCOL_VERSION,
        });
    }
    serde_json::from_slice(bytes).map_err(|e| ProtocolError::Malformed {
        reason: format!("launch file: {e}"),
    })
}

/// Version of the trajectory chunk encoding ([`encode_trajectory`]); bump on any incompatible change.
pub const TRAJECTORY_FORMAT: u32 = 1;

const TRAJECTORY_MAGIC: &[u8; 4] = b"RLTJ";

/// Where a trajectory chunk came from: the rollout rank and the chunk index (time order within a step).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkOrigin {
    pub rank: u32,
    pub chunk: u64,
}

/// Encode one trajectory chunk as a self-delimiting payload (so a `Train` blob can hold several back to back).
///
/// Layout (little-endian): `"RLTJ" u32 format u64 body_len | body`, body =
/// `u32 rank u64 chunk u64 envs u64 obs_dim u8 action_kind (0 continuous, 1 discrete) u64 dim_or_n f32 bound`,
/// then the arrays `obs f32, actions (f32 | i64), logprobs f32, rewards f32, terminated u8, truncated u8,
/// truncated_obs f32, last_obs f32, versions u64`, each as `u64 count` + values, then the episode metrics
/// `f64 return f64 success_rate f64 episode_len u64 episodes`.
pub fn encode_trajectory(origin: ChunkOrigin, traj: &Trajectory) -> Vec<u8> {
    let mut body = Vec::with_capacity(64 + traj.obs.len() * 4 + traj.len() * 24);
    body.extend_from_slice(&origin.rank.to_le_bytes());
    body.extend_from_slice(&origin.chunk.to_le_bytes());
    body.extend_from_slice(&(traj.envs as u64).to_le_bytes());
    body.extend_from_slice(&(traj.obs_dim as u64).to_le_bytes());
    let (kind, size, bound) = match traj.action {
        ActionSpace::Continuous { dim, bound } => (0u8, dim, bound),
        ActionSpace::Discrete { n } => (1u8, n, 0.0),
    };
    body.push(kind);
    body.extend_from_slice(&(size as u64).to_le_bytes());
    body.extend_from_slice(&bound.to_le_bytes());
    put_f32s(&mut body, &traj.obs);
    match &traj.actions {
        ActionBuf::Continuous(a) => put_f32s(&mut body, a),
        ActionBuf::Discrete(a) => {
            put_array(&mut body, a.len(), a.iter().flat_map(|v| v.to_le_bytes()))
        }
    }
    put_f32s(&mut body, &traj.logprobs);
    put_f32s(&mut body, &traj.rewards);
    put_array(
        &mut body,
        traj.terminated.len(),
        traj.terminated.iter().map(|b| u8::from(*b)),
    );
    put_array(
        &mut body,
        traj.truncated.len(),
        traj.truncated.iter().map(|b| u8::from(*b)),
    );
    put_f32s(&mut body, &traj.truncated_obs);
    put_f32s(&mut body, &traj.last_obs);
    put_array(
        &mut body,
        traj.versions.len(),
        traj.versions.iter().flat_map(|v| v.to_le_bytes()),
    );
    let ep = &traj.episodes;
    for v in [ep.ret, ep.success_rate, ep.episode_len] {
        body.extend_from_slice(&v.to_le_bytes());
    }
    body.extend_from_slice(&ep.episodes.to_le_bytes());
    let mut out = Vec::with_capacity(16 + body.len());
    out.extend_from_slice(TRAJECTORY_MAGIC);
    out.extend_from_slice(&TRAJECTORY_FORMAT.to_le_bytes());
    out.extend_from_slice(&(body.len() as u64).to_le_bytes());
    out.extend_from_slice(&body);
    out
}

/// Decode every chunk of a blob of back-to-back [`encode_trajectory`] payloads; each is validated.
pub fn decode_trajectories(
    mut bytes: &[u8],
) -> Result<Vec<(ChunkOrigin, Trajectory)>, ProtocolError> {
    let mut out = Vec::new();
    while !bytes.is_empty() {
        let mut head = Reader {
            bytes,
            what: "trajectory header",
        };
        if head.take(4)? != TRAJECTORY_MAGIC {
            return Err(malformed(
                "trajectory payload does not start with RLTJ".into(),
            ));
        }
        let format = head.u32()?;
        if format != TRAJECTORY_FORMAT {
            return Err(ProtocolError::Version {
                peer: format,
                ours: TRAJECTORY_FORMAT,
            });
        }
        let len = usize::try_from(head.u64()?)
            .map_err(|_| malformed("trajectory length overflows".into()))?;
        let mut body = Reader {
            bytes: head.bytes,
            what: "trajectory body",
        };
        let chunk = body.take(len)?;
        bytes = body.bytes;
        out.push(decode_one(chunk)?);
    }
    Ok(out)
}

fn decode_one(bytes: &[u8]) -> Result<(ChunkOrigin, Trajectory), ProtocolError> {
    let mut r = Reader {
        bytes,
        what: "trajectory body",
    };
    let origin = ChunkOrigin {
        rank: r.u32()?,
        chunk: r.u64()?,
    };
    let envs = r.usize()?;
    let obs_dim = r.usize()?;
    let kind = r.take(1)?.first().copied().unwrap_or(u8::MAX);
    let size = r.usize()?;
    let bound = f32::from_le_bytes(r.array()?);
    let action = match kind {
        0 => ActionSpace::Continuous { dim: size, bound },
        1 => ActionSpace::Discrete { n: size },
        other => return Err(malformed(format!("unknown action kind {other}"))),
    };
    let mut t = Trajectory::new(envs, obs_dim, action);
    t.obs = r.f32s()?;
    t.actions = match action {
        ActionSpace::Continuous { .. } => ActionBuf::Continuous(r.f32s()?),
        ActionSpace::Discrete { .. } => {
            ActionBuf::Discrete(r.values(8, |b| i64::from_le_bytes(to_array(b)))?)
        }
    };
    t.logprobs = r.f32s()?;
    t.rewards = r.f32s()?;
    t.terminated = r.bools()?;
    t.truncated = r.bools()?;
    t.truncated_obs = r.f32s()?;
    t.last_obs = r.f32s()?;
    t.versions = r.values(8, |b| u64::from_le_bytes(to_array(b)))?;
    t.episodes = EpisodeMetrics {
        ret: f64::from_le_bytes(r.array()?),
        success_rate: f64::from_le_bytes(r.array()?),
        episode_len: f64::from_le_bytes(r.array()?),
        episodes: r.u64()?,
    };
    if !r.bytes.is_empty() {
        return Err(malformed(format!(
            "{} unexpected bytes after the trajectory",
            r.bytes.len()
        )));
    }
    t.validate().map_err(|e| malformed(e.to_string()))?;
    Ok((origin, t))
}

fn malformed(reason: String) -> ProtocolError {
    ProtocolError::Malformed { reason }
}

fn put_array(out: &mut Vec<u8>, count: usize, bytes: impl Iterator<Item = u8>) {
    out.extend_from_slice(&(count as u64).to_le_bytes());
    out.extend(bytes);
}

fn put_f32s(out: &mut Vec<u8>, values: &[f32]) {
    put_array(
        out,
        values.len(),
        values.iter().flat_map(|v| v.to_le_bytes()),
    );
}

fn to_array<const N: usize>(bytes: &[u8]) -> [u8; N] {
    let mut a = [0u8; N];
    a.copy_from_slice(&bytes[..N]);
    a
}

/// A bounds-checked little-endian cursor: every read names what ran short instead of panicking.
struct Reader<'a> {
    bytes: &'a [u8],
    what: &'static str,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], ProtocolError> {
        if n > self.bytes.len() {
            return Err(malformed(format!(
                "{} truncated: needs {n} more bytes, {} left",
                self.what,
                self.bytes.len()
            )));
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], ProtocolError> {
        self.take(N).map(to_array)
    }

    fn u32(&mut self) -> Result<u32, ProtocolError> {
        self.array().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64, ProtocolError> {
        self.array().map(u64::from_le_bytes)
    }

    fn usize(&mut self) -> Result<usize, ProtocolError> {
        usize::try_from(self.u64()?)
            .map_err(|_| malformed(format!("{}: size overflows", self.what)))
    }

    /// `u64 count` then `count` values of `width` bytes; the count is checked against the bytes left first.
    fn values<T>(
        &mut self,
        width: usize,
        read: impl Fn(&[u8]) -> T,
    ) -> Result<Vec<T>, ProtocolError> {
        let count = self.usize()?;
        let len = count
            .checked_mul(width)
            .ok_or_else(|| malformed(format!("{}: array count {count} overflows", self.what)))?;
        Ok(self.take(len)?.chunks_exact(width).map(read).collect())
    }

    fn f32s(&mut self) -> Result<Vec<f32>, ProtocolError> {
        self.values(4, |b| f32::from_le_bytes(to_array(b)))
    }

    fn bools(&mut self) -> Result<Vec<bool>, ProtocolError> {
        let raw = self.values(1, |b| b.first().copied().unwrap_or(2))?;
        raw.into_iter()
            .map(|b| match b {
                0 => Ok(false),
                1 => Ok(true),
                other => Err(malformed(format!(
                    "{}: flag byte {other} is neither 0 nor 1",
                    self.what
                ))),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(cmd: Command, blob: &[u8]) {
        let bytes = encode(&cmd, blob).unwrap();
        let len = u32::from_le_bytes(bytes[..4].try_into().unwrap()) as usize;
        assert_eq!(len, bytes.len() - 4);
        let frame: Frame<Command> = decode_body(bytes[4..].to_vec()).unwrap();
        assert_eq!(frame.header, cmd);
        assert_eq!(frame.blob, blob);
    }

    #[test]
    fn commands_roundtrip_with_blobs() {
        roundtrip(Command::InitWeights, b"");
        roundtrip(Command::Sync { version: 7 }, b"");
        roundtrip(Command::Checkpoint, b"");
        roundtrip(Command::Eval, b"");
        roundtrip(
            Command::Train {
                step: 3,
                chunks: 2,
                env_steps: 64,
            },
            &[1, 2, 3, 0, 255],
        );
        roundtrip(
            Command::Rollout {
                first_chunk: 9,
                chunks: 4,
                steps: 16,
                background: true,
            },
            b"",
        );
        let trained = Report::Trained {
            step: 1,
            version: 2,
            loss: 0.5,
            busy_s: 0.1,
            metrics: vec![
                ("actor/loss".into(), Some(0.5)),
                ("actor/behav_approx_kl".into(), None),
            ],
        };
        let bytes = encode(&trained, b"").unwrap();
        assert_eq!(
            decode_body::<Report>(bytes[4..].to_vec()).unwrap().header,
            trained
        );
    }

    fn check_malformed(body: Vec<u8>, expect: &str) {
        let err = decode_body::<Command>(body).unwrap_err();
        assert!(
            err.to_string().contains(expect),
            "{err} does not contain {expect}"
        );
    }

    #[test]
    fn malformed_bodies_are_errors_not_panics() {
        check_malformed(vec![], "no header length");
        check_malformed(vec![1, 0], "no header length");
        check_malformed(vec![200, 0, 0, 0, b'{'], "exceeds body");
        check_malformed(vec![255, 255, 255, 255], "exceeds body");
        check_malformed([&[2u8, 0, 0, 0][..], b"{}"].concat(), "bad header");
        check_malformed([&[4u8, 0, 0, 0][..], b"null"].concat(), "bad header");
    }

    #[tokio::test]
    async fn stream_roundtrip_and_clean_close() {
        let (mut a, mut b) = tokio::io::duplex(1024);
        let hello = Report::Hello(Hello {
            protocol: PROTOCOL_VERSION,
            role: Role::Rollout,
            rank: 2,
            pid: 42,
        });
        write_frame(&mut a, &hello, b"xyz").await.unwrap();
        drop(a);
        let frame: Frame<Report> = read_frame(&mut b).await.unwrap();
        assert_eq!(frame.header, hello);
        assert_eq!(frame.blob, b"xyz");
        assert!(matches!(
            read_frame::<Report, _>(&mut b).await,
            Err(ProtocolError::Closed)
        ));
    }

    #[tokio::test]
    async fn oversized_length_is_rejected_before_allocating() {
        let (mut a, mut b) = tokio::io::duplex(64);
        a.write_all(&u32::MAX.to_le_bytes()).await.unwrap();
        assert!(matches!(
            read_frame::<Report, _>(&mut b).await,
            Err(ProtocolError::TooLarge { .. })
        ));
    }

    #[test]
    fn hello_version_is_checked() {
        let ok = Hello {
            protocol: PROTOCOL_VERSION,
            role: Role::Trainer,
            rank: 0,
            pid: 1,
        };
        assert!(check_hello(&ok).is_ok());
        let bad = Hello {
            protocol: PROTOCOL_VERSION + 1,
            ..ok
        };
        assert!(matches!(
            check_hello(&bad),
            Err(ProtocolError::Version { .. })
        ));
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
            segment_prefix: "rlsync-1-x".into(),
            start: StartPoint {
                step: 100,
                version: 100,
            },
            config: RunConfig::default(),
        };
        let bytes = encode_launch(&spec).unwrap();
        assert_eq!(decode_launch(&bytes).unwrap(), spec);
        let text = String::from_utf8(bytes).unwrap().replacen(
            "\"format_version\": 1",
            "\"format_version\": 99",
            1,
        );
        assert!(matches!(
            decode_launch(text.as_bytes()),
            Err(ProtocolError::Version { peer: 99, .. })
        ));
        assert!(decode_launch(b"{").is_err());
    }

    fn sample_trajectory(discrete: bool) -> Trajectory {
        let (envs, steps, d) = (2, 3, 2);
        let n = envs * steps;
        let action = if discrete {
            ActionSpace::Discrete { n: 3 }
        } else {
            ActionSpace::Continuous { dim: 2, bound: 1.5 }
        };
        let mut t = Trajectory::new(envs, d, action);
        t.obs = (0..n * d).map(|i| i as f32 * 0.5).collect();
        t.actions = if discrete {
            ActionBuf::Discrete((0..n as i64).map(|i| i % 3).collect())
        } else {
            ActionBuf::Continuous((0..n * 2).map(|i| -(i as f32)).collect())
        };
        t.logprobs = (0..n).map(|i| -(i as f32) / 7.0).collect();
        t.rewards = (0..n).map(|i| i as f32).collect();
        t.terminated = (0..n).map(|i| i == 4).collect();
        t.truncated = (0..n).map(|i| i == 1).collect();
        t.truncated_obs = vec![9.0, 8.0];
        t.last_obs = vec![1.0, 2.0, 3.0, 4.0];
        t.versions = vec![7, 7, 7, 8, 8, 8];
        t.episodes = EpisodeMetrics {
            ret: 1.25,
            success_rate: 0.5,
            episode_len: 3.0,
            episodes: 2,
        };
        t.validate().unwrap();
        t
    }

    #[test]
    fn trajectories_roundtrip_back_to_back() {
        let a = sample_trajectory(false);
        let b = sample_trajectory(true);
        let blob = [
            encode_trajectory(ChunkOrigin { rank: 1, chunk: 4 }, &a),
            encode_trajectory(ChunkOrigin { rank: 0, chunk: 5 }, &b),
        ]
        .concat();
        let got = decode_trajectories(&blob).unwrap();
        assert_eq!(
            got,
            vec![
                (ChunkOrigin { rank: 1, chunk: 4 }, a),
                (ChunkOrigin { rank: 0, chunk: 5 }, b)
            ]
        );
        assert!(decode_trajectories(&[]).unwrap().is_empty());
    }

    fn check_bad_trajectory(bytes: &[u8], expect: &str) {
        let err = decode_trajectories(bytes).unwrap_err().to_string();
        assert!(err.contains(expect), "'{err}' should mention '{expect}'");
    }

    #[test]
    fn bad_trajectory_bytes_are_errors_not_panics() {
        let good = encode_trajectory(ChunkOrigin { rank: 0, chunk: 0 }, &sample_trajectory(false));
        check_bad_trajectory(b"XXXX", "RLTJ");
        check_bad_trajectory(b"RL", "truncated");
        let mut version = good.clone();
        version[4] = 9;
        check_bad_trajectory(&version, "version mismatch");
        check_bad_trajectory(&good[..good.len() - 3], "truncated");
        // A body that claims fewer bytes than it holds leaves trailing bytes inside that body.
        let mut longer = good.clone();
        longer.push(0);
        let len = u64::from_le_bytes(longer[8..16].try_into().unwrap()) + 1;
        longer[8..16].copy_from_slice(&len.to_le_bytes());
        check_bad_trajectory(&longer, "unexpected bytes");
        // Every truncation and every single-byte corruption is an error or a valid trajectory, never a panic.
        for cut in 0..good.len() {
            assert!(decode_trajectories(&good[..cut]).is_err() || cut == 0);
        }
        for i in 0..good.len() {
            let mut bad = good.clone();
            bad[i] ^= 0xA5;
            if let Ok(got) = decode_trajectories(&bad) {
                got.iter().for_each(|(_, t)| t.validate().unwrap());
            }
        }
        // Sizes that disagree are caught by validation.
        let mut t = sample_trajectory(true);
        t.versions.pop();
        check_bad_trajectory(
            &encode_trajectory(ChunkOrigin { rank: 0, chunk: 0 }, &t),
            "versions",
        );
    }
}
