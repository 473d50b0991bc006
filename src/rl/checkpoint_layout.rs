//! Where checkpoints live (`<run_dir>/checkpoints/global_step_<n>/`) and how to find the latest one.

use std::path::{Path, PathBuf};

/// File names inside a checkpoint directory.
pub const WEIGHTS_FILE: &str = "model.safetensors";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";

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

#[cfg(test)]
mod tests {
    use super::*;

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
