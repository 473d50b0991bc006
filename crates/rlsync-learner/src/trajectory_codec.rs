//! The learner's trajectory chunks as they cross processes: one named-array payload per chunk
//! (`rlsync_core::protocol::arrays`, the protocol's one trajectory codec, which Python workers use too).
//!
//! The arrays of a chunk of T steps of E envs with observations of D values (entry `t*E + e` is step `t` of
//! env `e`, time-major), as `docs/protocol.md` section 6 lists them:
//!
//! | name | dtype | shape |
//! |---|---|---|
//! | `obs` | `<f4` | `[T*E, D]` |
//! | `actions` | `<f4` / `<i8` | `[T*E, A]` continuous / `[T*E]` discrete |
//! | `action_bound` / `action_n` | `<f4` / `<u8` | `[]`: the continuous bound / the number of discrete actions |
//! | `logprobs`, `rewards` | `<f4` | `[T*E]` |
//! | `terminated`, `truncated` | `\|b1` | `[T*E]` |
//! | `truncated_obs` | `<f4` | `[K, D]`: the final observation of each of the K truncated entries |
//! | `last_obs` | `<f4` | `[E, D]`: the observation after the last step |
//! | `versions` | `<u8` | `[T*E]`: the weight version each step acted with |
//! | `episodes` | `<f8` | `[3]`: return, success rate, episode length of the episodes finished in the chunk |
//! | `episodes_count` | `<u8` | `[]` |

use rlsync_core::bytes::Writer;
use rlsync_core::protocol::ProtocolError;
use rlsync_core::protocol::arrays::{ChunkOrigin, NamedArray, decode_arrays, encode_arrays};

use crate::env::{ActionSpace, EpisodeMetrics};
use crate::rl::{ActionBuf, Trajectory};

/// Encode one trajectory chunk as a self-delimiting payload (so a `Train` blob can hold several back to back).
pub fn encode_trajectory(origin: ChunkOrigin, traj: &Trajectory) -> Result<Vec<u8>, ProtocolError> {
    let n = traj.len() as u64;
    let d = traj.obs_dim as u64;
    // Each array's elements, little-endian.
    let f32s = |v: &[f32]| {
        each(v, 4, |w, &x| {
            w.f32(x);
        })
    };
    let u64s = |v: &[u64]| {
        each(v, 8, |w, &x| {
            w.u64(x);
        })
    };
    let flags = |v: &[bool]| v.iter().map(|b| u8::from(*b)).collect::<Vec<u8>>();
    let ep = &traj.episodes;
    let (actions, action_shape, space_name, space_dtype, space) = match (&traj.actions, traj.action)
    {
        (ActionBuf::Continuous(a), ActionSpace::Continuous { dim, bound }) => (
            f32s(a),
            vec![n, dim as u64],
            "action_bound",
            "<f4",
            f32s(&[bound]),
        ),
        (ActionBuf::Discrete(a), ActionSpace::Discrete { n: choices }) => (
            each(a, 8, |w, &x| {
                w.i64(x);
            }),
            vec![n],
            "action_n",
            "<u8",
            u64s(&[choices as u64]),
        ),
        _ => {
            return Err(malformed(
                "trajectory: actions do not match the action space".into(),
            ));
        }
    };
    let truncs = traj.truncated.iter().filter(|t| **t).count() as u64;
    let buffers = [
        ("obs", "<f4", vec![n, d], f32s(&traj.obs)),
        ("actions", action_dtype(traj.action), action_shape, actions),
        (space_name, space_dtype, vec![], space),
        ("logprobs", "<f4", vec![n], f32s(&traj.logprobs)),
        ("rewards", "<f4", vec![n], f32s(&traj.rewards)),
        ("terminated", "|b1", vec![n], flags(&traj.terminated)),
        ("truncated", "|b1", vec![n], flags(&traj.truncated)),
        (
            "truncated_obs",
            "<f4",
            vec![truncs, d],
            f32s(&traj.truncated_obs),
        ),
        (
            "last_obs",
            "<f4",
            vec![traj.envs as u64, d],
            f32s(&traj.last_obs),
        ),
        ("versions", "<u8", vec![n], u64s(&traj.versions)),
        (
            "episodes",
            "<f8",
            vec![3],
            each(&[ep.ret, ep.success_rate, ep.episode_len], 8, |w, &x| {
                w.f64(x);
            }),
        ),
        ("episodes_count", "<u8", vec![], u64s(&[ep.episodes])),
    ];
    let arrays: Vec<NamedArray<'_>> = buffers
        .iter()
        .map(|(name, dtype, shape, data)| NamedArray {
            name,
            dtype,
            shape: shape.clone(),
            data,
        })
        .collect();
    encode_arrays(origin, &arrays)
}

/// The bytes of `values`, `size` each, as `put` writes one.
fn each<T>(values: &[T], size: usize, put: impl Fn(&mut Writer, &T)) -> Vec<u8> {
    let mut w = Writer::with_capacity(size * values.len());
    for v in values {
        put(&mut w, v);
    }
    w.into_vec()
}

fn action_dtype(space: ActionSpace) -> &'static str {
    match space {
        ActionSpace::Continuous { .. } => "<f4",
        ActionSpace::Discrete { .. } => "<i8",
    }
}

/// Decode every chunk of a blob of back-to-back [`encode_trajectory`] payloads; each is validated.
pub fn decode_trajectories(bytes: &[u8]) -> Result<Vec<(ChunkOrigin, Trajectory)>, ProtocolError> {
    decode_arrays(bytes)?
        .into_iter()
        .map(|(origin, arrays)| Ok((origin, decode_one(&arrays)?)))
        .collect()
}

/// The chunk's arrays by name, each checked for the dtype and rank the learner expects.
struct Chunk<'a, 'b> {
    arrays: &'b [NamedArray<'a>],
}

impl<'a> Chunk<'a, '_> {
    fn get(&self, name: &str, dtype: &str, ndim: usize) -> Result<&NamedArray<'a>, ProtocolError> {
        let a = self
            .arrays
            .iter()
            .find(|a| a.name == name)
            .ok_or_else(|| malformed(format!("trajectory: no array '{name}'")))?;
        if a.dtype != dtype || a.shape.len() != ndim {
            return Err(malformed(format!(
                "trajectory: array '{name}' is {} of {} dimensions, expected {dtype} of {ndim}",
                a.dtype,
                a.shape.len()
            )));
        }
        Ok(a)
    }

    fn dim(
        &self,
        name: &str,
        dtype: &str,
        ndim: usize,
        axis: usize,
    ) -> Result<usize, ProtocolError> {
        let a = self.get(name, dtype, ndim)?;
        usize::try_from(a.shape[axis])
            .map_err(|_| malformed(format!("trajectory: array '{name}' is too large")))
    }

    fn values<T, const N: usize>(
        &self,
        name: &str,
        dtype: &str,
        ndim: usize,
        read: fn([u8; N]) -> T,
    ) -> Result<Vec<T>, ProtocolError> {
        let a = self.get(name, dtype, ndim)?;
        Ok(a.data
            .chunks_exact(N)
            .map(|c| {
                let mut b = [0; N];
                b.copy_from_slice(c);
                read(b)
            })
            .collect())
    }

    fn f32s(&self, name: &str, ndim: usize) -> Result<Vec<f32>, ProtocolError> {
        self.values(name, "<f4", ndim, f32::from_le_bytes)
    }

    fn flags(&self, name: &str) -> Result<Vec<bool>, ProtocolError> {
        self.values(name, "|b1", 1, u8::from_le_bytes)?
            .into_iter()
            .map(|b| match b {
                0 => Ok(false),
                1 => Ok(true),
                other => Err(malformed(format!(
                    "trajectory: array '{name}' holds the byte {other}, neither 0 nor 1"
                ))),
            })
            .collect()
    }

    fn scalar<T, const N: usize>(
        &self,
        name: &str,
        dtype: &str,
        read: fn([u8; N]) -> T,
    ) -> Result<T, ProtocolError> {
        self.values(name, dtype, 0, read)?
            .into_iter()
            .next()
            .ok_or_else(|| malformed(format!("trajectory: array '{name}' is empty")))
    }
}

fn decode_one(arrays: &[NamedArray<'_>]) -> Result<Trajectory, ProtocolError> {
    let c = Chunk { arrays };
    let envs = c.dim("last_obs", "<f4", 2, 0)?;
    let obs_dim = c.dim("obs", "<f4", 2, 1)?;
    let action = if arrays.iter().any(|a| a.name == "action_n") {
        let n = usize::try_from(c.scalar("action_n", "<u8", u64::from_le_bytes)?)
            .map_err(|_| malformed("trajectory: action_n is too large".into()))?;
        ActionSpace::Discrete { n }
    } else {
        ActionSpace::Continuous {
            dim: c.dim("actions", "<f4", 2, 1)?,
            bound: c.scalar("action_bound", "<f4", f32::from_le_bytes)?,
        }
    };
    let mut t = Trajectory::new(envs, obs_dim, action);
    t.obs = c.f32s("obs", 2)?;
    t.actions = match action {
        ActionSpace::Continuous { .. } => ActionBuf::Continuous(c.f32s("actions", 2)?),
        ActionSpace::Discrete { .. } => {
            ActionBuf::Discrete(c.values("actions", "<i8", 1, i64::from_le_bytes)?)
        }
    };
    t.logprobs = c.f32s("logprobs", 1)?;
    t.rewards = c.f32s("rewards", 1)?;
    t.terminated = c.flags("terminated")?;
    t.truncated = c.flags("truncated")?;
    t.truncated_obs = c.f32s("truncated_obs", 2)?;
    t.last_obs = c.f32s("last_obs", 2)?;
    t.versions = c.values("versions", "<u8", 1, u64::from_le_bytes)?;
    let ep = c.values("episodes", "<f8", 1, f64::from_le_bytes)?;
    let [ret, success_rate, episode_len] = ep[..] else {
        return Err(malformed(format!(
            "trajectory: array 'episodes' holds {} values, expected 3",
            ep.len()
        )));
    };
    t.episodes = EpisodeMetrics {
        ret,
        success_rate,
        episode_len,
        episodes: c.scalar("episodes_count", "<u8", u64::from_le_bytes)?,
    };
    t.validate().map_err(|e| malformed(e.to_string()))?;
    Ok(t)
}

fn malformed(reason: String) -> ProtocolError {
    ProtocolError::Malformed { reason }
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
            encode_trajectory(ChunkOrigin { rank: 1, chunk: 4 }, &a).unwrap(),
            encode_trajectory(ChunkOrigin { rank: 0, chunk: 5 }, &b).unwrap(),
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
        let err = rlsync_core::error_chain(&decode_trajectories(bytes).unwrap_err());
        assert!(err.contains(expect), "'{err}' should mention '{expect}'");
    }

    #[test]
    fn bad_trajectory_bytes_are_errors_not_panics() {
        let good = encode_trajectory(ChunkOrigin { rank: 0, chunk: 0 }, &sample_trajectory(false))
            .unwrap();
        check_bad_trajectory(b"XXXX", "RLNA");
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
        // A missing array, or one of another dtype, is named.
        let arrays = [NamedArray {
            name: "obs",
            dtype: "<f8",
            shape: vec![1, 1],
            data: &[0; 8],
        }];
        let only_obs = encode_arrays(ChunkOrigin { rank: 0, chunk: 0 }, &arrays).unwrap();
        check_bad_trajectory(&only_obs, "no array 'last_obs'");
        // A trajectory whose buffers disagree is refused by the encoder, naming the buffer...
        let mut t = sample_trajectory(true);
        t.versions.pop();
        let err = encode_trajectory(ChunkOrigin { rank: 0, chunk: 0 }, &t).unwrap_err();
        assert!(err.to_string().contains("versions"), "{err}");
        // ...and arrays that are well formed but disagree with each other by the decoder.
        let good =
            encode_trajectory(ChunkOrigin { rank: 0, chunk: 0 }, &sample_trajectory(true)).unwrap();
        let chunks = decode_arrays(&good).unwrap();
        let (origin, arrays) = &chunks[0];
        let short = [7u64; 5]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect::<Vec<u8>>();
        let arrays: Vec<NamedArray<'_>> = arrays
            .iter()
            .map(|a| match a.name {
                "versions" => NamedArray {
                    name: "versions",
                    dtype: "<u8",
                    shape: vec![5],
                    data: &short,
                },
                _ => a.clone(),
            })
            .collect();
        check_bad_trajectory(&encode_arrays(*origin, &arrays).unwrap(), "versions");
    }

    /// `docs/protocol.md` section 6's example is this codec's bytes for the chunk it describes.
    #[test]
    fn the_protocol_docs_example_is_a_learner_chunk() {
        let doc = include_str!("../../../docs/protocol.md");
        let block = doc
            .split("```hex trajectory\n")
            .nth(1)
            .and_then(|rest| rest.split("```").next())
            .expect("docs/protocol.md has a hex trajectory example");
        let bytes: Vec<u8> = block
            .split_whitespace()
            .map(|b| u8::from_str_radix(b, 16).expect("hex byte"))
            .collect();
        let got = decode_trajectories(&bytes).unwrap();
        let [(origin, t)] = &got[..] else {
            panic!("one chunk, got {}", got.len())
        };
        assert_eq!(*origin, ChunkOrigin { rank: 0, chunk: 5 });
        assert_eq!((t.envs, t.obs_dim, t.len()), (1, 1, 1));
        assert_eq!(t.action, ActionSpace::Discrete { n: 2 });
        assert_eq!(t.actions, ActionBuf::Discrete(vec![1]));
        assert_eq!(
            (t.obs.as_slice(), t.last_obs.as_slice()),
            (&[0.5f32][..], &[0.75f32][..])
        );
        assert_eq!(
            (t.logprobs[0], t.rewards[0], t.versions[0]),
            (-0.25, 1.0, 3)
        );
        assert_eq!(encode_trajectory(*origin, t).unwrap(), bytes);
    }
}
