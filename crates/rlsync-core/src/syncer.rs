//! The weight syncer: `init_sender`/`init_receiver`/`sync`/`apply` over a transport (patch | bucket).
//!
//! A [`WeightSyncer`] is built from the typed `weight_syncer` config and becomes one of two typed ends at
//! init: [`WeightSyncer::init_sender`] makes a [`SyncSender`] (trainer), [`WeightSyncer::init_receiver`] (or
//! [`WeightSyncer::rejoin_receiver`]) a [`SyncReceiver`] (rollout); a call on the wrong end does not compile.
//! The handshake: each receiver sends its metadata (ordered keys, shapes, dtypes); the sender checks it against its state dict and `keys_to_sync`, answers with a plan (or an abort naming the
//! mismatching keys), then — patch with `init_sync.enabled` — sends the bucketized init bootstrap. From then on
//! [`SyncSender::sync`] sends a patch (changed elements vs the sender's snapshot, held in the receiver's
//! dtypes) or all synced tensors in buckets, and [`SyncReceiver::apply`] receives, verifies and installs it.
//!
//! Self-describing buckets: the bucket syncer may also run without the handshake, as RLinf's does
//! ([`WeightSyncer::init_sender_described`] / [`WeightSyncer::init_receiver_described`]: a mode of the same typed
//! ends, not a type of its own). Nothing is exchanged at init; every version starts with a checksummed manifest
//! (names, shapes, wire and target dtypes) by which the receiver maps the buckets onto its keys, checking them all
//! before anything is written, so the same integrity rules hold. The app's runtime keeps the handshake.
//!
//! Versions and sequences: `sync` takes the caller's version, any number (RLinf sends 0 first, the same version
//! again for an evaluation, jumps under no-wait), and `apply` returns it. What orders payloads is the sender's
//! own sequence number, one more per `sync` (0: the handshake and init bootstrap), carried beside the version in
//! every header ([`wire::Stamp`]): receivers take only a newer sequence, patches only on the sequence they were
//! built on. The caller's version ends at labelling weights; the sequence decides every accept / reject. The
//! Rust runtime keeps strictly increasing versions where it names states by version (its replay log, a
//! rejoining receiver's held version): its trainer sets [`WeightSyncer::require_increasing_versions`], and the
//! replay log only chains patches whose versions increase (see `syncer/rejoin.rs`).
//!
//! Integrity: every payload carries kind, version, sequence and an xxh3 checksum ([`wire`]); a receiver rejects
//! a corrupt or truncated payload, a sequence not newer than its own (replayed or stale), or a patch built on
//! another base sequence, and keeps its weights and version ([`SyncError::Rejected`], or [`SyncError::Unreadable`] with the wire error
//! as its cause; [`SyncError::is_rejection`] says either). Installs need `&mut StateDict` and are
//! validate-then-write (patch) or staged-then-swapped (bucket, undone on a later bucket's failure with
//! `load_instant: true`), so no reader ever sees a partially applied version.
//!
//! Config notes: `bucket.is_agent` is accepted for RLinf compatibility (agent-side key naming) and has no
//! effect on embodied runs. CUDA tensors are synced through [`crate::gpu`] (the binding attaches its
//! [`PatchBuilder`] / [`PatchInstaller`] / [`BucketStager`] hooks); `patch.snapshot_device: cuda` needs a
//! build with the `cuda` feature ([`SyncError::Gpu`]); `bucket.bucket_device: cuda` packs the buckets of CUDA
//! tensors on the GPU (cast to `bucket_dtype` there, floating tensors only) when the binding attaches a
//! [`BucketStager`], and stages host tensors on the host as `cpu` does (the Rust runtime's rollouts are
//! CPU tensors: logged once); `transport_device: cuda` and `nvcomp_lz4` are rejected with
//! [`SyncError::NoGpuBackend`]. With `load_instant: true` each verified bucket is swapped into the state dict as it arrives
//! (no staging of the whole version), `false` stages all buckets and swaps at the end; both undo on failure.
//!
//! CPU work (diff, coding, copies) runs on the calling thread plus scoped worker threads (`threads`); callers
//! on a tokio runtime should give the syncer a task that may block (it uses `block_in_place` when it can).

mod bootstrap;
mod bucket;
mod host_rejoin;
pub mod offload;
/// Patch kernels (build / encode / validate / install); public so `benches/` can time them alone.
pub mod patch;
mod receiver;
mod rejoin;
mod sender;
pub mod settings;
mod snapshot_sum;
pub mod wire;

use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::syncer::settings::{Compression, Device, SyncerKind, WeightSyncerConfig};
use crate::tensor::parallel::{resolve_threads, threads_for_state};
use crate::tensor::{
    CastError, DType, StateDict, StateHasher, Storage, cast_bytes, state_checksum,
};
use crate::transport::{self, TransportError};

use bucket::{Assembly, Planned, Pool, Staged};
use patch::{SnapTensor, ValidPatch};
use wire::{Codec, Header, KeyMeta, Kind, Plan, Stamp, Strategy, WireError};

pub use host_rejoin::HostRejoin;
pub use offload::{BucketStager, CheckInstallError, PatchBuilder, PatchInstaller};
pub use receiver::{PendingUpdate, SyncReceiver};
pub use rejoin::{CatchUpKind, CatchUpReport, ReplayLog};
pub use sender::{Declined, SyncSender};

/// Runtime options that are not part of the weight_syncer config.
#[derive(Debug, Clone, Copy, Default)]
pub struct SyncOptions {
    /// Threads for the diff / coding / install kernels (`0`: all cores), at most: a state of less than
    /// [`STATE_BYTES_PER_THREAD`](crate::tensor::parallel::STATE_BYTES_PER_THREAD) per thread syncs on fewer.
    pub threads: usize,
}

/// What a report describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SyncKind {
    /// The handshake and the init bootstrap.
    #[default]
    Init,
    Patch,
    Bucket,
}

impl SyncKind {
    pub fn name(self) -> &'static str {
        match self {
            SyncKind::Init => "init",
            SyncKind::Patch => "patch",
            SyncKind::Bucket => "bucket",
        }
    }
}

/// Sizes and timings of one init, sync or apply.
#[derive(Debug, Clone, Default)]
pub struct SyncReport {
    /// The version sent (sender) or now applied (receiver).
    pub version: u64,
    pub kind: SyncKind,
    /// Bytes on the wire (headers included), per receiver.
    pub payload_bytes: u64,
    /// Elements changed (patch) or sent (bucket, init).
    pub changed: u64,
    /// Bytes of the synced state in the receiver's dtypes.
    pub state_bytes: u64,
    /// Tensors carried (patch: tensors with changes).
    pub tensors: usize,
    /// Messages that made up the payload (buckets; 1 for a patch).
    pub messages: u32,
    /// Sender: diff + gather + snapshot update.
    pub build: Duration,
    /// Sender: coding, compression, framing, casting/copying into transport buffers.
    pub encode: Duration,
    /// Sender: waiting on the transport. Receiver: waiting for the payload.
    pub transfer: Duration,
    /// Receiver: checksum, decompression, validation, staging copies (with a device installer the patch's
    /// entry table only: its streams are checked as they are decoded for the device, in `apply`).
    pub decode: Duration,
    /// Receiver: writing into the state dict.
    pub apply: Duration,
    /// Patch streams' raw bytes / stored bytes (1.0 without compression).
    pub compression_ratio: f64,
    /// Patch segments sent dense (their new bytes) because a sparse coding would have been larger.
    pub dense_segments: u64,
    /// Receiver: leftover messages of an earlier rejected version that were skipped.
    pub skipped: u32,
}

#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    #[error("weight_syncer config: {reason}")]
    Config { reason: String },
    #[error(transparent)]
    Gpu(#[from] crate::gpu::GpuError),
    /// The GPU patch build could not allocate the scratch copy of the tensors it casts to the receivers' dtype.
    #[error(
        "the GPU patch build needs {bytes} bytes of GPU memory for the synced tensors cast to the receivers' dtype (a state in the rollouts' dtype needs none)"
    )]
    CastScratch {
        bytes: u64,
        #[source]
        source: crate::gpu::GpuError,
    },
    /// A bucket could not be packed or unpacked on the device (`bucket_device: cuda`).
    #[error(transparent)]
    BucketDevice(crate::gpu::bucket::BucketDeviceError),
    /// A setting whose value needs a GPU path this part of rlsync does not offer; `why` says which and where
    /// it is offered instead.
    #[error("{setting}: {value} is not available here: {why}; use {instead}")]
    NoGpuBackend {
        setting: &'static str,
        value: &'static str,
        why: &'static str,
        instead: &'static str,
    },
    #[error("handshake failed: {reason}")]
    Handshake { reason: String },
    /// A handshake message (`message` names it) that does not read.
    #[error("handshake failed: {message}")]
    HandshakeMessage {
        message: String,
        #[source]
        source: MessageError,
    },
    #[error("version {version} is not newer than the last sent version {last}")]
    VersionNotNewer { version: u64, last: u64 },
    #[error("rejected payload{}: {reason} (kept version {current})", for_version(*version))]
    Rejected {
        version: Option<u64>,
        current: u64,
        reason: String,
    },
    /// A payload that does not read (corrupt, truncated, of another kind): rejected like [`SyncError::Rejected`].
    #[error("rejected payload{} (kept version {current})", for_version(*version))]
    Unreadable {
        version: Option<u64>,
        current: u64,
        #[source]
        source: MessageError,
    },
    #[error("state dict key '{key}': {reason}")]
    StateMismatch { key: String, reason: String },
    #[error("state dict key '{key}': cannot convert it to the receivers' dtype")]
    StateCast {
        key: String,
        #[source]
        source: CastError,
    },
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// Receiver `rank` dropped the update the sender waited for it to install ([`SyncReceiver::decline`]).
    #[error("receiver rank {rank} declined version {version}: {reason}")]
    Declined {
        rank: usize,
        version: u64,
        reason: String,
    },
}

impl SyncError {
    /// Whether a received payload was refused (the receiver kept its weights and version).
    pub fn is_rejection(&self) -> bool {
        matches!(
            self,
            SyncError::Rejected { .. } | SyncError::Unreadable { .. }
        )
    }
}

fn for_version(version: Option<u64>) -> String {
    version
        .map(|v| format!(" for version {v}"))
        .unwrap_or_default()
}

/// What is wrong with a received message that does not read: its wire format, or bytes that do not convert
/// to the receiver's dtype.
#[derive(Debug, thiserror::Error)]
pub enum MessageError {
    #[error(transparent)]
    Wire(#[from] WireError),
    #[error("ordinal {ordinal}")]
    Cast {
        ordinal: u32,
        #[source]
        source: CastError,
    },
}

#[derive(Debug, Clone)]
struct Settings {
    kind: SyncerKind,
    delta: bool,
    codec: Codec,
    init_sync: bool,
    init_prefixes: Option<Vec<String>>,
    init_bucket_size: u64,
    bucket_size: u64,
    bucket_dtype: Option<DType>,
    load_instant: bool,
    /// Patch: where the caller's device backend keeps the snapshot (`weight_syncer.patch.snapshot_device`).
    snapshot_device: Device,
    /// Bucket: where the caller's device backend stages buckets (`weight_syncer.bucket.bucket_device`).
    bucket_device: Device,
    threads: NonZeroUsize,
    /// Bytes per transport message of a bucket (tests shrink it to cover multi-part buckets).
    part_bytes: usize,
    /// Bytes of state per patch part (tests shrink it to cover multi-part patches).
    patch_part_bytes: usize,
    /// Refuse a receiver whose state dict differs from the sender's at all ([`WeightSyncer::require_same_keys`]).
    same_keys: bool,
    /// Refuse a sync whose version is not newer than the last ([`WeightSyncer::require_increasing_versions`]).
    increasing_versions: bool,
    /// Patches the sender keeps for rejoining receivers, and their byte cap.
    replay_versions: usize,
    replay_max_bytes: u64,
    /// Bucket sender: keep a copy of the last version sent, so a rejoining receiver gets it at once
    /// ([`WeightSyncer::keep_last_version`]).
    keep_last: bool,
    /// Receiver: its synced tensors reach it another way after a rejoin ([`WeightSyncer::synced_elsewhere`]).
    synced_elsewhere: bool,
}

impl Settings {
    /// The payload strategy this syncer speaks.
    fn strategy(&self) -> Strategy {
        match self.kind {
            SyncerKind::Patch => Strategy::Patch,
            SyncerKind::Bucket => Strategy::Bucket,
        }
    }
}

/// A syncer configured but not yet an end: [`WeightSyncer::init_sender`] turns it into a [`SyncSender`],
/// [`WeightSyncer::init_receiver`] or [`WeightSyncer::rejoin_receiver`] into a [`SyncReceiver`].
pub struct WeightSyncer {
    settings: Settings,
    /// Tests only: where a receiver awaits a future first ([`WeightSyncer::hold_at`]).
    hold: Option<(HoldPoint, Hold)>,
}

/// A point of a receiver's set-up where a test may hold it ([`WeightSyncer::hold_at`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoldPoint {
    /// `init_receiver`: the plan received, before the init bootstrap's payloads.
    Bootstrap,
    /// `rejoin_receiver`: the catch-up announced, before its payloads (replay or full transfer).
    CatchUp,
}

/// What a held receiver awaits.
pub type Hold = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

/// Run CPU-heavy work without stalling other tasks of a multi-threaded runtime.
pub(crate) fn blocking<R>(f: impl FnOnce() -> R) -> R {
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
    }
}

fn rejected(version: Option<u64>, current: u64, reason: impl Into<String>) -> SyncError {
    SyncError::Rejected {
        version,
        current,
        reason: reason.into(),
    }
}

/// A payload that does not read, rejected.
fn unreadable(version: Option<u64>, current: u64, source: impl Into<MessageError>) -> SyncError {
    SyncError::Unreadable {
        version,
        current,
        source: source.into(),
    }
}

/// A bucket part that cannot be staged, rejected.
fn rejection(version: Option<u64>, current: u64, e: bucket::PartError) -> SyncError {
    match e {
        bucket::PartError::Invalid(reason) => rejected(version, current, reason),
        bucket::PartError::Message(source) => unreadable(version, current, source),
    }
}

/// The error of a key `state` lacks.
fn missing_key(key: &str) -> SyncError {
    SyncError::StateMismatch {
        key: key.to_owned(),
        reason: "missing from the state dict".into(),
    }
}

/// Ordered keys, dtypes and shapes of `state`: what a receiver reports in the handshake.
fn metadata(state: &StateDict) -> Vec<KeyMeta> {
    state
        .iter()
        .map(|(k, t)| KeyMeta {
            name: k.to_string(),
            dtype: t.dtype(),
            shape: t.shape().to_vec(),
        })
        .collect()
}

impl WeightSyncer {
    /// Build from the typed config. `patch.transport_device: cuda` and nvCOMP are [`SyncError::NoGpuBackend`];
    /// `bucket.bucket_device: cuda` is accepted: CUDA tensors are packed and unpacked on the GPU through the
    /// binding's [`BucketStager`] (a build without CUDA says so when CUDA tensors arrive), host tensors are
    /// staged on the host (one `tracing::info` says so), like RLinf moving buckets to `bucket_device`.
    pub fn from_config(
        cfg: &WeightSyncerConfig,
        opts: SyncOptions,
    ) -> Result<WeightSyncer, SyncError> {
        let p = &cfg.patch;
        let b = &cfg.bucket;
        let codec = match cfg.kind {
            SyncerKind::Patch => {
                if p.snapshot_device == Device::Cuda && !crate::gpu::BUILT_WITH_CUDA {
                    return Err(SyncError::Gpu(crate::gpu::GpuError::NotBuilt));
                }
                if p.transport_device == Device::Cuda {
                    return Err(SyncError::NoGpuBackend {
                        setting: "weight_syncer.patch.transport_device",
                        value: "cuda",
                        why: "a syncer over rlsync's host channels (shared memory, TCP) carries host bytes; payloads on the GPU are the Python PatchWeightSyncer(transport_device=\"cuda\")'s (handed to your own collective) and the same-host GPU channel's of `rlsync train_embodied` / `train_async` (Python workers on GPUs); CUDA tensors are diffed and installed on the GPU with snapshot_device",
                        instead: "cpu",
                    });
                }
                match p.compression {
                    Compression::None => Codec::Plain,
                    Compression::Lz4 => Codec::Lz4,
                    Compression::NvcompLz4 => {
                        return Err(SyncError::NoGpuBackend {
                            setting: "weight_syncer.patch.compression",
                            value: "nvcomp_lz4",
                            why: "rlsync does not link nvCOMP (patches are coded and compressed on the host)",
                            instead: "lz4 or none",
                        });
                    }
                }
            }
            SyncerKind::Bucket => {
                if b.bucket_device == Device::Cuda {
                    tracing::info!(
                        "weight_syncer.bucket.bucket_device: cuda: buckets of CUDA tensors are packed (sender) and installed (receiver) on the GPU; host tensors are staged on the host"
                    );
                }
                Codec::Plain
            }
        };
        if let (SyncerKind::Patch, true, Some(pre)) =
            (cfg.kind, p.init_sync.enabled, &p.init_sync.prefixes)
            && pre.is_empty()
        {
            return Err(SyncError::Config { reason: "weight_syncer.patch.init_sync.prefixes is an empty list (use null for the whole state dict)".into() });
        }
        Ok(WeightSyncer {
            settings: Settings {
                kind: cfg.kind,
                delta: p.delta_encoding,
                codec,
                init_sync: p.init_sync.enabled,
                init_prefixes: p.init_sync.prefixes.clone(),
                init_bucket_size: p.init_sync.bucket_size.get(),
                bucket_size: b.bucket_size.get(),
                bucket_dtype: b.bucket_dtype.map(DType::from),
                load_instant: b.load_instant,
                snapshot_device: p.snapshot_device,
                bucket_device: b.bucket_device,
                threads: resolve_threads(opts.threads),
                part_bytes: bucket::PART_BYTES,
                patch_part_bytes: patch::PART_STATE_BYTES,
                same_keys: false,
                increasing_versions: false,
                replay_versions: p.replay_versions as usize,
                replay_max_bytes: p.replay_max_bytes,
                keep_last: false,
                synced_elsewhere: false,
            },
            hold: None,
        })
    }

    /// Fit the kernels' threads to the size of `state`, the caller's end of the channel about to be made: a
    /// small state syncs on fewer threads than asked ([`threads_for_state`]).
    fn fit_threads(&mut self, state: &StateDict) {
        self.settings.threads = threads_for_state(state.total_bytes(), self.settings.threads);
    }

    /// Tests only: await `hold` once this receiver reaches `point` (the worker's `RLSYNC_TEST_HOLD` knob
    /// holds a rollout there until a test kills it, a death at a known moment of the weight channel).
    pub fn hold_at(&mut self, point: HoldPoint, hold: Hold) {
        self.hold = Some((point, hold));
    }

    /// Await the hold set for `point`, if any.
    async fn reach(&mut self, point: HoldPoint) {
        if self.hold.as_ref().is_some_and(|(p, _)| *p == point)
            && let Some((_, hold)) = self.hold.take()
        {
            hold.await;
        }
    }

    pub fn kind(&self) -> SyncerKind {
        self.settings.kind
    }

    /// Make `init_sender` refuse a receiver whose state dict differs from the sender's — a key on one side
    /// only, another shape, or non-convertible dtypes — naming the first difference (RLinf's rule; by default
    /// only the synced and bootstrapped keys must match).
    pub fn require_same_keys(&mut self, on: bool) {
        self.settings.same_keys = on;
    }

    /// Sender: refuse a `sync` whose version is not newer than the last one sent ([`SyncError::VersionNotNewer`]);
    /// the Rust runtime's rule (its replay log and rejoins name states by version). Off by default: a caller
    /// may send any version (RLinf sends 0 first, the same version again, jumps), ordered by the sequence.
    pub fn require_increasing_versions(&mut self, on: bool) {
        self.settings.increasing_versions = on;
    }

    /// Bucket sender: keep a copy of the synced tensors as last sent (one more copy of the synced state, in
    /// the sender's dtypes, refreshed by every `sync`), so a receiver that rejoins after the state moved on is
    /// sent that version at once instead of waiting for the next one (a deferred catch-up). The patch syncer
    /// keeps its snapshot anyway; for it this changes nothing.
    pub fn keep_last_version(&mut self, on: bool) {
        self.settings.keep_last = on;
    }

    /// Receiver: after a rejoin its synced tensors reach it another way (the same-host GPU channel's full
    /// copy; the sender serves such rejoins with [`HostRejoin`]), so [`WeightSyncer::rejoin_receiver`] does
    /// not hash them (a second of host hashing for a 7B state) and reports a checksum that matches nothing:
    /// a sender that would replay or patch against it sends the full state instead.
    pub fn synced_elsewhere(&mut self, on: bool) {
        self.settings.synced_elsewhere = on;
    }
}

fn hash_cast(h: &mut StateHasher, src: &[u8], from: DType, wire: DType, to: DType) {
    const ELEMS: usize = 1 << 15;
    let mut a = Storage::zeroed(ELEMS * wire.size_bytes());
    let mut b = Storage::zeroed(ELEMS * to.size_bytes());
    for chunk in src.chunks(ELEMS * from.size_bytes()) {
        let n = chunk.len() / from.size_bytes();
        let wa = &mut a.bytes_mut()[..n * wire.size_bytes()];
        let _ = cast_bytes(chunk, from, wa, wire);
        let wb = &mut b.bytes_mut()[..n * to.size_bytes()];
        let _ = cast_bytes(wa, wire, wb, to);
        h.bytes(wb);
    }
}

#[cfg(test)]
mod tests;
