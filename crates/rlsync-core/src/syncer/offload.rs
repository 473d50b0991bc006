//! The hooks through which a device backend takes over a patch's build (sender) and install (receiver) when
//! the synced tensors live in memory the host does not hold (CUDA); the host kernels stay the default.
//!
//! A hook sees the same snapshot, [`Built`] and [`ValidPatch`] as the host kernels, so everything around it
//! (encoding, versions, checksums, the replay log, rejoins) is unchanged and the wire bytes are the same.

use std::num::NonZeroUsize;

use super::SyncError;
use super::patch::{Built, PlannedPatch, SnapTensor, ValidPatch};
use crate::tensor::StateDict;

/// Builds a patch in place of `patch::build`.
pub trait PatchBuilder: Send {
    /// Diff the synced tensors against `snap` (the snapshot, in the receivers' dtypes, in sync order) and
    /// update it, leaving one `Changes` per segment in `built` exactly as `patch::build` would. `state` is
    /// the host view of the state dict the caller passed (its device tensors' host copies may be stale).
    fn build(
        &mut self,
        snap: &mut [SnapTensor],
        state: &StateDict,
        threads: NonZeroUsize,
        built: &mut Built,
    ) -> Result<(), SyncError>;
}

/// Installs a validated patch in place of `patch::install`.
pub trait PatchInstaller: Send + Sync {
    /// Write `patch` into the tensors it targets; `state` is the host view the patch was validated against.
    /// On an error the patch may be partly written (a device failure); the receiver's version stays.
    fn install(
        &self,
        patch: &ValidPatch,
        state: &mut StateDict,
        threads: NonZeroUsize,
    ) -> Result<(), SyncError>;

    /// Check the streams of `patch` (its entry table checked by `patch::plan`) and install it: an installer
    /// that walks the streams to decode them anyway checks them in that walk (one walk, not two); no tensor
    /// is written before every entry passed. The default checks ([`PlannedPatch::check`]), then installs.
    fn check_install(
        &self,
        patch: PlannedPatch,
        state: &mut StateDict,
        threads: NonZeroUsize,
    ) -> Result<ValidPatch, CheckInstallError> {
        check_then_install(self, patch, state, threads)
    }
}

/// [`PatchInstaller::check_install`] in two walks: check the streams ([`PlannedPatch::check`]), then
/// [`PatchInstaller::install`] (the default, and what an installer does with a patch it cannot decode while
/// checking).
pub fn check_then_install<I: PatchInstaller + ?Sized>(
    installer: &I,
    patch: PlannedPatch,
    state: &mut StateDict,
    threads: NonZeroUsize,
) -> Result<ValidPatch, CheckInstallError> {
    let valid = patch
        .check(threads)
        .map_err(|reason| CheckInstallError::Rejected { reason })?;
    installer.install(&valid, state, threads)?;
    Ok(valid)
}

/// Why [`PatchInstaller::check_install`] did not install a patch.
#[derive(Debug, thiserror::Error)]
pub enum CheckInstallError {
    /// The patch's streams failed validation (rlsync's own description); no tensor was written.
    #[error("{reason}")]
    Rejected { reason: String },
    /// The install failed after the check (as [`PatchInstaller::install`]).
    #[error(transparent)]
    Install(#[from] SyncError),
}

/// Stages bucket syncs on a device (`bucket_device: cuda`) in place of the host fill's reads of the
/// tensors (sender) and writes of them (receiver); see `syncer/bucket/device.rs`.
pub trait BucketStager: Send {
    /// The device address of `key`'s tensor, or `None` when it lives on the host (it is then read from
    /// and written to the state dict as on the host path).
    fn addr(&self, key: &str) -> Option<u64>;
    /// The device that packs and unpacks the buckets.
    fn device(&mut self) -> &mut dyn crate::gpu::bucket::BucketDevice;
}
