//! The control messages between the orchestrator and its workers: versions, the handshake, commands, reports.
//!
//! A control frame is one `protocol::frame` frame whose body is
//! `[u32 header_len (LE)][header: JSON][blob: the rest of the body]`. The JSON header is a [`Command`]
//! (orchestrator → worker) or a [`Report`] (worker → orchestrator); the blob carries bulk bytes (trajectories,
//! see `protocol::trajectory`) so they are never JSON-encoded. The first frame on every connection is a
//! [`Hello`] from the worker carrying [`PROTOCOL_VERSION`]; the orchestrator rejects any other version.
//! `docs/protocol.md` specifies all of it for implementations in other languages.

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncWrite};

use super::ProtocolError;
use super::frame::{self, FrameReader, ReadError};
use crate::bytes::Writer;

/// Version of the control protocol and of the launch file; bump on any incompatible change (4: [`Report::Built`];
/// 5: [`Command::Rejoin`]'s `receiver`).
pub const PROTOCOL_VERSION: u32 = 5;

/// Frames larger than this are rejected (a corrupt length must not allocate gigabytes).
pub(crate) const MAX_FRAME_BYTES: usize = 1 << 30;

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
    /// The run's token from the launch file (absent in hellos of protocol-doc examples).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub token: String,
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
    /// Patch segments sent dense (absent from older workers' reports: 0).
    #[serde(default)]
    pub dense_segments: u64,
    /// The sender's build of the version, seconds: diff, gather and snapshot update (a GPU channel's device
    /// build and checksum). Absent from older workers' reports: 0.
    #[serde(default)]
    pub build_s: f64,
    /// The sender's encoding of the version, seconds: coding, compression, framing, copies into the
    /// transport's buffers (0 on the GPU channel, which sends the build's output as it is).
    #[serde(default)]
    pub encode_s: f64,
    /// The sender's wait on the transport, seconds: sending, and the receivers' acks where it waits for them.
    pub seconds: f64,
}

/// Where a rollout's install of a version went, seconds: its receiver's phases (the sync's `SyncReport`),
/// then what the worker did with the installed weights.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct InstallPhases {
    /// Waiting for the payload on the weight channel (a background install's was spent in the background,
    /// outside its `seconds`).
    pub wait_s: f64,
    /// Checksum, decompression and validation of the payload, staging copies.
    pub decode_s: f64,
    /// Writing the version into the receiver's weights.
    pub write_s: f64,
    /// The workload taking the written weights (into its model, onto its device); absent where the
    /// workload reads the receiver's weights in place (host-shared).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_s: Option<f64>,
    /// The rollout's checksum of its weights for `runner.verify_sync` (absent where the receiver computes it
    /// as it installs: host-shared, counted in `decode_s`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checksum_s: Option<f64>,
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
    /// Trainer: catch up rollout `rank`, a restarted worker that joined the weight channel late (it reported
    /// [`Report::Joined`]): replay of logged patches when sound, else a full transfer, to that rollout only.
    /// `receiver` is its index on the weight channel, which numbers receivers node by node in chain order (the
    /// rollout rank on one host; in the host-shared mode each node's applier is its node's place in the chain);
    /// the trainer's [`Report::CaughtUp`] names `rank`.
    Rejoin { rank: u32, receiver: u32 },
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
    /// Every worker (a restarted rollout too), once, after its hello: it built its workload (the model, a
    /// Python worker's imports and entry, a resumed trainer's checkpoint) in `seconds` and is ready to sync.
    Built {
        seconds: f64,
    },
    /// Trainer: weights published.
    Synced {
        stats: SyncStats,
        checksum: u64,
        seconds: f64,
    },
    /// Rollout: a version is installed (after bootstrap, a blocking apply or a background install), in
    /// `seconds` (a blocking install with its wait for the payload; a background install without it), and
    /// where that time went when a host receiver installed it (absent for the same-host GPU channel, which
    /// logs its phases per sync, and for host-shared readers, which install nothing).
    Applied {
        version: u64,
        checksum: u64,
        seconds: f64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        phases: Option<InstallPhases>,
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
    /// Rollout (restarted): after `init_weights` it joined the weight channel late, after the bootstrap; it
    /// waits for the trainer to catch it up ([`Command::Rejoin`]).
    Joined,
    /// Rollout (restarted): caught up after a late join and now holds `version` (`checksum` as in `applied`).
    /// `deferred`: it holds no version of the trainer's yet (bucket syncer: the next sync, a full transfer,
    /// makes it current), so it must not generate before it applied one.
    Rejoined {
        version: u64,
        checksum: u64,
        deferred: bool,
        seconds: f64,
    },
    /// Trainer: a `rejoin` is done. `ok` false: the rollout went away meanwhile (`reason` says how). `kind`:
    /// `replay` (the `patches` logged patches from `from`) or `full`; `payload_bytes`: every catch-up byte
    /// sent and received; `reason`: why not a replay.
    CaughtUp {
        rank: u32,
        ok: bool,
        kind: String,
        from: u64,
        to: u64,
        patches: u32,
        payload_bytes: u64,
        seconds: f64,
        #[serde(default, skip_serializing_if = "String::is_empty")]
        reason: String,
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
        dir: std::path::PathBuf,
    },
    /// The worker failed; it exits right after. `blames` names the peers its failure was about (a weight
    /// channel peer that is gone or did not answer in time), so the orchestrator can name the first cause.
    Failed {
        message: String,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        blames: Vec<Blame>,
    },
}

impl Report {
    /// The trainer's `caught_up` for a rejoin of rollout `rank` that did not complete after `seconds`: the
    /// rollout went away meanwhile (`reason` says how).
    pub fn rejoin_failed(rank: u32, seconds: f64, reason: String) -> Report {
        Report::CaughtUp {
            rank,
            ok: false,
            kind: String::new(),
            from: 0,
            to: 0,
            patches: 0,
            payload_bytes: 0,
            seconds,
            reason,
        }
    }
}

/// A worker another worker's failure points at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Blame {
    pub role: Role,
    pub rank: u32,
}

/// A decoded frame: a typed header and its bulk bytes.
#[derive(Debug, PartialEq)]
pub struct Frame<T> {
    pub header: T,
    pub blob: Vec<u8>,
}

/// Encode a header and blob into one frame (length prefix included).
pub fn encode<T: Serialize>(header: &T, blob: &[u8]) -> Result<Vec<u8>, ProtocolError> {
    let json = serde_json::to_vec(header).map_err(|source| ProtocolError::Json {
        what: "frame header",
        source,
    })?;
    let mut header_len = Writer::with_capacity(4);
    // A header beyond u32 is beyond the frame limit too.
    header_len
        .len_u32(json.len())
        .map_err(|_| ProtocolError::TooLarge {
            len: json.len(),
            max: MAX_FRAME_BYTES,
        })?;
    frame::encode(&[header_len.as_slice(), &json, blob], MAX_FRAME_BYTES).map_err(|e| {
        ProtocolError::TooLarge {
            len: e.len,
            max: e.max,
        }
    })
}

/// Decode a frame body (everything after the length prefix).
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
        serde_json::from_slice(&body[4..header_end]).map_err(|source| ProtocolError::Json {
            what: "frame header",
            source,
        })?;
    let blob = body.split_off(header_end);
    Ok(Frame { header, blob })
}

/// A frame reader for one end of a control connection (frames up to [`MAX_FRAME_BYTES`]).
pub fn control_reader<R: AsyncRead + Unpin>(stream: R) -> FrameReader<R> {
    FrameReader::new(stream, MAX_FRAME_BYTES)
}

/// Read one frame; `Closed` when the peer closed the connection (between frames or inside one).
/// Cancel-safe: a dropped call loses no bytes.
pub async fn read_frame<T, R>(reader: &mut FrameReader<R>) -> Result<Frame<T>, ProtocolError>
where
    T: for<'de> Deserialize<'de>,
    R: AsyncRead + Unpin,
{
    match reader.next().await {
        Ok(Some(body)) => decode_body(body),
        Ok(None) => Err(ProtocolError::Closed),
        Err(ReadError::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            Err(ProtocolError::Closed)
        }
        Err(ReadError::Io(e)) => Err(ProtocolError::Io(e)),
        Err(ReadError::TooLong(e)) => Err(ProtocolError::TooLarge {
            len: e.len,
            max: e.max,
        }),
    }
}

/// Write one frame.
pub async fn write_frame<T, W>(writer: &mut W, header: &T, blob: &[u8]) -> Result<(), ProtocolError>
where
    T: Serialize,
    W: AsyncWrite + Unpin,
{
    let bytes = encode(header, blob)?;
    frame::write_all(writer, &bytes).await?;
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

/// Check a greeting's version and that it carries the run's `token` (compared in constant time).
pub fn authenticate(hello: &Hello, token: &str) -> Result<(), ProtocolError> {
    check_hello(hello)?;
    let (got, want) = (hello.token.as_bytes(), token.as_bytes());
    let differ =
        got.len() != want.len() || got.iter().zip(want).fold(0u8, |acc, (a, b)| acc | (a ^ b)) != 0;
    if want.is_empty() || differ {
        return Err(ProtocolError::BadToken);
    }
    Ok(())
}

/// A new per-run token: 128 random bits as hex.
pub fn new_token() -> String {
    format!("{:032x}", rand::random::<u128>())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    fn roundtrip(cmd: Command, blob: &[u8]) {
        let bytes = encode(&cmd, blob).unwrap();
        let len = u32::from_le_bytes(bytes[..4].try_into().unwrap()) as usize;
        assert_eq!(len, bytes.len() - 4);
        let frame: Frame<Command> = decode_body(bytes[4..].to_vec()).unwrap();
        assert_eq!(frame.header, cmd);
        assert_eq!(frame.blob, blob);
    }

    #[test]
    fn hellos_are_authenticated_by_the_run_token() {
        let hello = |token: &str| Hello {
            protocol: PROTOCOL_VERSION,
            role: Role::Rollout,
            rank: 1,
            pid: 7,
            token: token.to_owned(),
        };
        let token = new_token();
        assert_eq!(token.len(), 32);
        assert_ne!(token, new_token(), "each run draws its own");
        assert!(authenticate(&hello(&token), &token).is_ok());
        // The same length, differing in the last character only (flipped, so never equal to the real one).
        let last = if token.ends_with('0') { "1" } else { "0" };
        let one_off = format!("{}{last}", &token[..31]);
        for bad in ["", "00", &token[1..], &one_off] {
            assert!(
                matches!(
                    authenticate(&hello(bad), &token),
                    Err(ProtocolError::BadToken)
                ),
                "{bad:?}"
            );
        }
        // An empty expected token never authenticates anyone.
        assert!(authenticate(&hello(""), "").is_err());
    }

    #[test]
    fn commands_roundtrip_with_blobs() {
        roundtrip(Command::InitWeights, b"");
        roundtrip(Command::Sync { version: 7 }, b"");
        roundtrip(Command::Checkpoint, b"");
        roundtrip(Command::Eval, b"");
        roundtrip(
            Command::Rejoin {
                rank: 2,
                receiver: 1,
            },
            b"",
        );
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
        let evaluated = Report::Evaluated {
            version: 4,
            episodes: 16,
            mean_return: -3.5,
            success_rate: 0.75,
            episode_len: 50.0,
        };
        let checkpointed = Report::Checkpointed {
            step: 100,
            version: 100,
            dir: "/runs/x/checkpoints/global_step_100".into(),
        };
        let built = Report::Built { seconds: 1.25 };
        for report in [trained, evaluated, checkpointed, built] {
            let bytes = encode(&report, b"").unwrap();
            assert_eq!(
                decode_body::<Report>(bytes[4..].to_vec()).unwrap().header,
                report
            );
        }
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
        check_malformed(
            [&[2u8, 0, 0, 0][..], b"{}"].concat(),
            "malformed frame header",
        );
        check_malformed(
            [&[4u8, 0, 0, 0][..], b"null"].concat(),
            "malformed frame header",
        );
    }

    #[tokio::test]
    async fn stream_roundtrip_and_clean_close() {
        let (mut a, b) = tokio::io::duplex(1024);
        let hello = Report::Hello(Hello {
            protocol: PROTOCOL_VERSION,
            role: Role::Rollout,
            rank: 2,
            pid: 42,
            token: String::new(),
        });
        write_frame(&mut a, &hello, b"xyz").await.unwrap();
        drop(a);
        let mut b = control_reader(b);
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
        let (mut a, b) = tokio::io::duplex(64);
        a.write_all(&u32::MAX.to_le_bytes()).await.unwrap();
        assert!(matches!(
            read_frame::<Report, _>(&mut control_reader(b)).await,
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
            token: String::new(),
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
}
