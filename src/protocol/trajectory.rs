//! The trajectory codec: rollout chunks as self-delimiting little-endian payloads in control-frame blobs.

use super::ProtocolError;
use crate::bytes::{BytesError, Reader};
use crate::env::{ActionSpace, EpisodeMetrics};
use crate::rl::{ActionBuf, Trajectory};

/// Version of the trajectory chunk encoding ([`encode_trajectory`]); bump on any incompatible change.
pub(crate) const TRAJECTORY_FORMAT: u32 = 1;

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
pub fn decode_trajectories(bytes: &[u8]) -> Result<Vec<(ChunkOrigin, Trajectory)>, ProtocolError> {
    let mut out = Vec::new();
    let mut r = Reader::new(bytes, "trajectory header");
    while r.remaining() > 0 {
        r.named("trajectory header");
        if r.take(4)? != TRAJECTORY_MAGIC {
            return Err(malformed(
                "trajectory payload does not start with RLTJ".into(),
            ));
        }
        let format = r.u32()?;
        if format != TRAJECTORY_FORMAT {
            return Err(ProtocolError::Version {
                peer: format,
                ours: TRAJECTORY_FORMAT,
            });
        }
        let len = r.count(usize::MAX)?;
        let chunk = r.named("trajectory body").take(len)?;
        out.push(decode_one(chunk)?);
    }
    Ok(out)
}

fn decode_one(bytes: &[u8]) -> Result<(ChunkOrigin, Trajectory), ProtocolError> {
    let mut r = Reader::new(bytes, "trajectory body");
    let origin = ChunkOrigin {
        rank: r.u32()?,
        chunk: r.u64()?,
    };
    let envs = r.count(usize::MAX)?;
    let obs_dim = r.count(usize::MAX)?;
    let kind = r.u8()?;
    let size = r.count(usize::MAX)?;
    let bound = r.f32()?;
    let action = match kind {
        0 => ActionSpace::Continuous { dim: size, bound },
        1 => ActionSpace::Discrete { n: size },
        other => return Err(malformed(format!("unknown action kind {other}"))),
    };
    let mut t = Trajectory::new(envs, obs_dim, action);
    t.obs = f32s(&mut r)?;
    t.actions = match action {
        ActionSpace::Continuous { .. } => ActionBuf::Continuous(f32s(&mut r)?),
        ActionSpace::Discrete { .. } => ActionBuf::Discrete(values(&mut r, i64::from_le_bytes)?),
    };
    t.logprobs = f32s(&mut r)?;
    t.rewards = f32s(&mut r)?;
    t.terminated = flags(&mut r)?;
    t.truncated = flags(&mut r)?;
    t.truncated_obs = f32s(&mut r)?;
    t.last_obs = f32s(&mut r)?;
    t.versions = values(&mut r, u64::from_le_bytes)?;
    t.episodes = EpisodeMetrics {
        ret: r.f64()?,
        success_rate: r.f64()?,
        episode_len: r.f64()?,
        episodes: r.u64()?,
    };
    if r.remaining() > 0 {
        return Err(malformed(format!(
            "{} unexpected bytes after the trajectory",
            r.remaining()
        )));
    }
    t.validate().map_err(|e| malformed(e.to_string()))?;
    Ok((origin, t))
}

/// `u64 count` then `count` little-endian values of `N` bytes; the count is checked against the bytes left.
fn values<T, const N: usize>(
    r: &mut Reader<'_>,
    read: fn([u8; N]) -> T,
) -> Result<Vec<T>, BytesError> {
    let count = r.count(r.remaining() / N)?;
    let raw = r.take(count * N)?;
    Ok(raw
        .chunks_exact(N)
        .map(|c| {
            let mut a = [0; N];
            a.copy_from_slice(c);
            read(a)
        })
        .collect())
}

fn f32s(r: &mut Reader<'_>) -> Result<Vec<f32>, BytesError> {
    values(r, f32::from_le_bytes)
}

fn flags(r: &mut Reader<'_>) -> Result<Vec<bool>, ProtocolError> {
    values(r, u8::from_le_bytes)?
        .into_iter()
        .map(|b| match b {
            0 => Ok(false),
            1 => Ok(true),
            other => Err(malformed(format!(
                "trajectory body: flag byte {other} is neither 0 nor 1"
            ))),
        })
        .collect()
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

#[cfg(test)]
mod tests {
    use super::*;

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
