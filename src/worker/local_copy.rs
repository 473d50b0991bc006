//! A restartable rollout's local copy of its weights (`runner.rollout_weights_copy_interval`): written
//! atomically in the background every K installed versions, loaded and verified by a restarted rollout so it
//! rejoins the weight channel from that version (a catch-up by replay) instead of from its own initial weights.
//!
//! The copy is `<run_dir>/.rlsync/rollout-<rank>.safetensors`: every tensor of the rollout's state dict (synced
//! and frozen) with, in the file's metadata, the version and the checksum of its contents (the entries are
//! `protocol::launch`'s: the copy passes from a dead worker to its successor). It is written to a
//! temporary file, synced to disk and renamed over the previous copy (`rlsync_core::atomic_file`), so a worker
//! killed mid-write leaves the previous copy whole. Loading checks the format, that keys, dtypes and shapes are
//! exactly the model's (`StateDict::read_safetensors_like`) and that the contents hash to the recorded
//! checksum, and only then copies the values into the state (in place: a Python model's tensors get them);
//! anything else leaves the state untouched (its initial weights, version 0).
//! Whether the copy really is the trainer's version is then decided by the trainer, which replays only onto
//! a receiver whose checksum equals the logged one of that version (else it sends the full state).

use std::path::{Path, PathBuf};
use std::thread::JoinHandle;

use crate::protocol::launch::{copy_metadata, parse_copy_metadata};
use rlsync_core::tensor::{LayoutMismatch, StateDict, TensorError, state_checksum};

#[derive(Debug, thiserror::Error)]
pub enum LocalCopyError {
    #[error("weights copy {path}")]
    Tensor {
        path: PathBuf,
        #[source]
        source: TensorError,
    },
    #[error("weights copy {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("weights copy {path} is not used: {reason}")]
    Refused { path: PathBuf, reason: String },
    /// The copy holds other tensors than the model (another model's copy).
    #[error("weights copy {path} is not used")]
    Mismatch {
        path: PathBuf,
        #[source]
        source: Box<LayoutMismatch>,
    },
}

/// The copy of one rollout: where it lives, how often it is written, the write in flight.
#[derive(Debug)]
pub struct LocalCopy {
    path: PathBuf,
    interval: u64,
    /// The version of the last copy started.
    last: Option<u64>,
    writer: Option<JoinHandle<Result<u64, LocalCopyError>>>,
}

impl LocalCopy {
    /// The copy at `path`, written after an install once `interval` (> 0) versions passed since the last one.
    pub fn new(path: PathBuf, interval: u64) -> LocalCopy {
        LocalCopy {
            path,
            interval: interval.max(1),
            last: None,
            writer: None,
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Load the copy into `state` and return its version; `Ok(None)` when there is none. On any error `state`
    /// is untouched.
    pub fn load_into(&self, state: &mut StateDict) -> Result<Option<u64>, LocalCopyError> {
        let path = &self.path;
        match std::fs::metadata(path) {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(LocalCopyError::Io {
                    path: path.clone(),
                    source,
                });
            }
        }
        let (copy, meta) = state.read_safetensors_like(path).map_err(|e| match e {
            TensorError::Mismatch { source, .. } => LocalCopyError::Mismatch {
                path: path.clone(),
                source,
            },
            source => LocalCopyError::Tensor {
                path: path.clone(),
                source,
            },
        })?;
        let refused = |reason: String| LocalCopyError::Refused {
            path: path.clone(),
            reason,
        };
        let (version, recorded) = parse_copy_metadata(&meta).map_err(refused)?;
        let keys: Vec<String> = copy.keys().map(str::to_string).collect();
        let got = state_checksum(&copy, &keys);
        if got != recorded {
            return Err(refused(format!(
                "its contents hash to {got:#018x}, its metadata records {recorded:#018x} (corrupt)"
            )));
        }
        state
            .copy_values_from(&copy)
            .map_err(|source| LocalCopyError::Mismatch {
                path: path.clone(),
                source: Box::new(source),
            })?;
        Ok(Some(version))
    }

    /// After installing `version`: start writing a copy of `state` when `interval` versions passed since the
    /// last copy (version 0, a worker's initial weights, is never written). The write runs in the background
    /// on a copy of the state; while one runs, later versions wait for the next install.
    pub fn after_install(&mut self, state: &StateDict, version: u64) {
        if !self.wants(version) {
            return;
        }
        let copy = tokio::task::block_in_place(|| state.duplicate());
        let path = self.path.clone();
        self.last = Some(version);
        self.writer = Some(std::thread::spawn(move || write(&copy, version, &path)));
    }

    /// Whether [`LocalCopy::after_install`] of `version` would read the state now (a copy is due and no
    /// write is in flight); a finished write is reaped first.
    pub fn wants(&mut self, version: u64) -> bool {
        self.reap(false);
        version != 0
            && self.writer.is_none()
            && self
                .last
                .is_none_or(|l| version >= l.saturating_add(self.interval))
    }

    /// Wait for a write in flight (before the worker exits).
    pub fn finish(&mut self) {
        self.reap(true);
    }

    fn reap(&mut self, wait: bool) {
        let Some(writer) = self.writer.take() else {
            return;
        };
        if !wait && !writer.is_finished() {
            self.writer = Some(writer);
            return;
        }
        match writer.join() {
            Ok(Ok(version)) => tracing::debug!(
                "local weights copy of version {version} written: {}",
                self.path.display()
            ),
            Ok(Err(e)) => tracing::warn!(
                "the local weights copy was not written: {}",
                rlsync_core::error_chain(&e)
            ),
            Err(_) => tracing::warn!("the local weights copy's writer panicked"),
        }
    }
}

/// Write `state` as the copy of `version` at `path`: a temporary file beside it, synced, renamed over it
/// (what `StateDict::save_safetensors_with` does).
pub fn write(state: &StateDict, version: u64, path: &Path) -> Result<u64, LocalCopyError> {
    let keys: Vec<String> = state.keys().map(str::to_string).collect();
    let checksum = state_checksum(state, &keys);
    let meta = copy_metadata(version, checksum);
    state
        .save_safetensors_with(path, &meta)
        .map_err(|source| LocalCopyError::Tensor {
            path: path.to_owned(),
            source,
        })?;
    Ok(version)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rlsync_core::tensor::{Class, DType, Tensor};

    fn state(seed: f32) -> StateDict {
        let mut s = StateDict::new();
        s.insert(
            "w",
            Tensor::from_slice(
                DType::F32,
                &[2, 2],
                Class::Trainable,
                &[seed, 2.0, 3.0, 4.0],
            )
            .unwrap(),
        );
        s.insert(
            "frozen",
            Tensor::from_slice(DType::I64, &[1], Class::Frozen, &[7i64]).unwrap(),
        );
        s
    }

    fn bytes(s: &StateDict) -> Vec<Vec<u8>> {
        s.iter().map(|(_, t)| t.bytes().to_vec()).collect()
    }

    #[test]
    fn a_copy_roundtrips_its_version_and_values() {
        let dir = tempfile::tempdir().unwrap();
        let copy = LocalCopy::new(dir.path().join("rollout-0.safetensors"), 2);
        assert_eq!(
            copy.load_into(&mut state(0.0)).unwrap(),
            None,
            "no copy yet"
        );
        write(&state(9.0), 12, copy.path()).unwrap();
        let mut s = state(0.0);
        assert_eq!(copy.load_into(&mut s).unwrap(), Some(12));
        assert_eq!(bytes(&s), bytes(&state(9.0)));
    }

    #[test]
    fn a_corrupt_or_foreign_copy_is_refused_and_leaves_the_state_untouched() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rollout-1.safetensors");
        let copy = LocalCopy::new(path.clone(), 1);
        write(&state(9.0), 3, &path).unwrap();
        // One flipped value byte (the last bytes of the file are tensor data).
        let mut raw = std::fs::read(&path).unwrap();
        let n = raw.len();
        raw[n - 1] ^= 0x10;
        std::fs::write(&path, &raw).unwrap();
        let mut s = state(0.0);
        let err = copy.load_into(&mut s).unwrap_err().to_string();
        assert!(err.contains("corrupt"), "{err}");
        assert_eq!(bytes(&s), bytes(&state(0.0)));
        // Another model's copy (other keys), a plain safetensors file, garbage.
        let mut other = state(9.0);
        other.insert(
            "extra",
            Tensor::zeros(DType::F32, &[1], Class::Frozen).unwrap(),
        );
        write(&other, 3, &path).unwrap();
        let err = rlsync_core::error_chain(&copy.load_into(&mut s).unwrap_err());
        assert!(
            err.contains("is not used: it has 3 keys, the model has 2"),
            "{err}"
        );
        state(9.0).save_safetensors_with(&path, &[]).unwrap();
        assert!(
            copy.load_into(&mut s)
                .unwrap_err()
                .to_string()
                .contains("rlsync.copy.format")
        );
        std::fs::write(&path, b"garbage").unwrap();
        assert!(copy.load_into(&mut s).is_err());
        assert_eq!(bytes(&s), bytes(&state(0.0)));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn copies_are_written_every_interval_versions() {
        let dir = tempfile::tempdir().unwrap();
        let mut copy = LocalCopy::new(dir.path().join("rollout-0.safetensors"), 3);
        let mut written = Vec::new();
        for v in 0..=10u64 {
            copy.after_install(&state(v as f32), v);
            copy.finish();
            let mut s = state(0.0);
            if let Some(got) = copy.load_into(&mut s).unwrap()
                && written.last() != Some(&got)
            {
                assert_eq!(bytes(&s), bytes(&state(got as f32)));
                written.push(got);
            }
        }
        assert_eq!(written, vec![1, 4, 7, 10]);
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            1,
            "no temporary file left"
        );
    }
}
