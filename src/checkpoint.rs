//! Where checkpoints live (`<run_dir>/checkpoints/global_step_<n>/`), how to find the latest one, and what a
//! checkpoint's weights file says about itself (read from the safetensors header alone, without libtorch).

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use rlsync_core::tensor::{LayoutMismatch, StateDict, TensorError};

/// File names inside a checkpoint directory.
pub const WEIGHTS_FILE: &str = "model.safetensors";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// A TorchScript policy's module with the checkpoint's weights (`torch.jit.load`-able); only for
/// `model_type: torchscript`.
pub const SCRIPT_FILE: &str = "policy.pt";

/// Metadata of `model.safetensors`: `format` is [`META_FORMAT`]; `global_step`, `version` are integers;
/// `weights_checksum` is `0x` and 16 hex digits.
pub const META_FORMAT: &str = "rlsync_checkpoint";
/// 2: `weights_checksum` is the chunked `tensor::state_checksum` (1: one xxh3 stream, `state_checksum_v1`;
/// still resumed).
pub const FORMAT_VERSION: &str = "2";
pub const CHECKSUM_KEY: &str = "weights_checksum";

/// A checkpoint that cannot be read or written.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("checkpoint {path}: {reason}")]
    Invalid { path: PathBuf, reason: String },
    #[error("checkpoint {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("checkpoint {path}")]
    Tensors {
        path: PathBuf,
        #[source]
        source: TensorError,
    },
    /// The file ends before its safetensors header does.
    #[error("checkpoint {path}: no complete safetensors header")]
    Truncated {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("checkpoint {path}: bad safetensors header")]
    Header {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    /// The checkpoint holds other tensors than the model it is loaded into.
    #[error("checkpoint {path} does not fit the model")]
    Mismatch {
        path: PathBuf,
        #[source]
        source: Box<LayoutMismatch>,
    },
}

/// Largest safetensors header read when only the metadata is wanted.
const MAX_HEADER: u64 = 64 << 20;

/// What a checkpoint records besides tensors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointInfo {
    pub dir: PathBuf,
    /// Trainer steps completed.
    pub global_step: u64,
    /// Weight version the rollouts held when it was saved.
    pub version: u64,
    /// xxh3 checksum of the fp32 weights (every entry, names sorted), as `tensor::state_checksum` computes it.
    pub weights_checksum: u64,
}

/// `<run_dir>/checkpoints/global_step_<step>`.
pub fn checkpoint_dir(run_dir: &Path, step: u64) -> PathBuf {
    run_dir
        .join("checkpoints")
        .join(format!("global_step_{step}"))
}

/// The `global_step_<n>` directory with the largest `n` under `<run_dir>/checkpoints`, if any holds weights.
pub fn latest_checkpoint(run_dir: &Path) -> Option<PathBuf> {
    let entries = std::fs::read_dir(run_dir.join("checkpoints")).ok()?;
    entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let step: u64 = name.strip_prefix("global_step_")?.parse().ok()?;
            e.path()
                .join(WEIGHTS_FILE)
                .is_file()
                .then(|| (step, e.path()))
        })
        .max_by_key(|(step, _)| *step)
        .map(|(_, path)| path)
}

/// The string metadata of a safetensors file, read from its header only.
pub fn read_metadata(path: &Path) -> Result<HashMap<String, String>, CheckpointError> {
    let err = |reason: String| CheckpointError::Invalid {
        path: path.to_owned(),
        reason,
    };
    let mut file = std::fs::File::open(path).map_err(|source| CheckpointError::Io {
        path: path.to_owned(),
        source,
    })?;
    let truncated = |source| CheckpointError::Truncated {
        path: path.to_owned(),
        source,
    };
    let mut len = [0u8; 8];
    file.read_exact(&mut len).map_err(truncated)?;
    let len = u64::from_le_bytes(len);
    if len > MAX_HEADER {
        return Err(err(format!(
            "safetensors header of {len} bytes is too large"
        )));
    }
    let mut header = vec![0u8; len as usize];
    file.read_exact(&mut header).map_err(truncated)?;
    let json: serde_json::Value =
        serde_json::from_slice(&header).map_err(|source| CheckpointError::Header {
            path: path.to_owned(),
            source,
        })?;
    Ok(json
        .get("__metadata__")
        .and_then(|m| m.as_object())
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned())))
                .collect()
        })
        .unwrap_or_default())
}

/// What the checkpoint in `dir` records (its `model.safetensors` metadata): step, version and checksum.
pub fn read_info(dir: &Path) -> Result<CheckpointInfo, CheckpointError> {
    let path = dir.join(WEIGHTS_FILE);
    let meta = read_metadata(&path)?;
    let err = |reason: String| CheckpointError::Invalid {
        path: path.clone(),
        reason,
    };
    if meta.get("format").map(String::as_str) != Some(META_FORMAT) {
        return Err(err("not an rlsync checkpoint (metadata `format`)".into()));
    }
    let int = |key: &str| {
        meta.get(key)
            .and_then(|v| v.parse::<u64>().ok())
            .ok_or_else(|| err(format!("metadata `{key}` is missing or not an integer")))
    };
    let weights_checksum = meta
        .get(CHECKSUM_KEY)
        .and_then(|v| u64::from_str_radix(v.trim_start_matches("0x"), 16).ok())
        .unwrap_or(0);
    Ok(CheckpointInfo {
        dir: dir.to_owned(),
        global_step: int("global_step")?,
        version: int("version")?,
        weights_checksum,
    })
}

/// Save `state` as a weights-only checkpoint after `step` train steps, holding weight `version`:
/// `<run_dir>/checkpoints/global_step_<step>/model.safetensors` with the metadata [`read_info`] reads. What a
/// workload without its own checkpoint format (synthetic, Python workers) saves; the learner adds its optimizer.
pub fn save_weights(
    state: &StateDict,
    run_dir: &Path,
    step: u64,
    version: u64,
) -> Result<PathBuf, CheckpointError> {
    let dir = checkpoint_dir(run_dir, step);
    std::fs::create_dir_all(&dir).map_err(|source| CheckpointError::Io {
        path: dir.clone(),
        source,
    })?;
    let mut keys: Vec<String> = state.keys().map(str::to_owned).collect();
    keys.sort();
    let checksum = rlsync_core::tensor::state_checksum(state, &keys);
    let meta = [
        ("format", META_FORMAT.to_owned()),
        ("format_version", FORMAT_VERSION.to_owned()),
        ("global_step", step.to_string()),
        ("version", version.to_string()),
        (CHECKSUM_KEY, format!("{checksum:#018x}")),
    ]
    .map(|(k, v)| (k.to_owned(), v));
    let path = dir.join(WEIGHTS_FILE);
    state
        .save_safetensors_with(&path, &meta)
        .map_err(|source| CheckpointError::Tensors { path, source })?;
    Ok(dir)
}

/// Copy the weights of the checkpoint in `dir` into `state`, in place (every tensor of `state` must be in the
/// file with the same dtype and shape, and the file must hold no other; else `state` is untouched); returns
/// what the checkpoint records.
pub fn load_weights_into(
    state: &mut StateDict,
    dir: &Path,
) -> Result<CheckpointInfo, CheckpointError> {
    let info = read_info(dir)?;
    let path = dir.join(WEIGHTS_FILE);
    state.load_safetensors_into(&path).map_err(|e| match e {
        TensorError::Mismatch { source, .. } => CheckpointError::Mismatch { path, source },
        source => CheckpointError::Tensors { path, source },
    })?;
    Ok(info)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn info_is_read_from_the_header_and_bad_files_are_errors() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = checkpoint_dir(tmp.path(), 7);
        std::fs::create_dir_all(&dir).unwrap();
        let write = |meta: &str| {
            let header = format!(r#"{{"__metadata__":{meta}}}"#);
            let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
            bytes.extend_from_slice(header.as_bytes());
            std::fs::write(dir.join(WEIGHTS_FILE), bytes).unwrap();
        };
        write(
            r#"{"format":"rlsync_checkpoint","global_step":"7","version":"9","weights_checksum":"0x00000000000000ff"}"#,
        );
        let info = read_info(&dir).unwrap();
        assert_eq!(
            (info.global_step, info.version, info.weights_checksum),
            (7, 9, 255)
        );
        write(r#"{"format":"rlsync_checkpoint","global_step":"x","version":"9"}"#);
        assert!(
            read_info(&dir)
                .unwrap_err()
                .to_string()
                .contains("global_step")
        );
        write(r#"{"format":"other"}"#);
        assert!(
            read_info(&dir)
                .unwrap_err()
                .to_string()
                .contains("not an rlsync")
        );
        std::fs::write(dir.join(WEIGHTS_FILE), u64::MAX.to_le_bytes()).unwrap();
        assert!(
            read_info(&dir)
                .unwrap_err()
                .to_string()
                .contains("too large")
        );
        assert!(read_info(&tmp.path().join("missing")).is_err());
    }

    #[test]
    fn latest_is_the_largest_step_with_weights() {
        let tmp = tempfile::tempdir().unwrap();
        assert_eq!(latest_checkpoint(tmp.path()), None);
        for (step, with_weights) in [(2, true), (10, true), (30, false)] {
            let d = checkpoint_dir(tmp.path(), step);
            std::fs::create_dir_all(&d).unwrap();
            if with_weights {
                std::fs::write(d.join(WEIGHTS_FILE), b"x").unwrap();
            }
        }
        std::fs::create_dir_all(tmp.path().join("checkpoints/global_step_x")).unwrap();
        assert_eq!(
            latest_checkpoint(tmp.path()),
            Some(checkpoint_dir(tmp.path(), 10))
        );
        assert!(checkpoint_dir(tmp.path(), 10).ends_with("checkpoints/global_step_10"));
    }
}
