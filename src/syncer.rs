//! The weight syncer: `init_sender`/`init_receiver`/`sync`/`apply` over a transport (patch | bucket).
//!
//! One [`WeightSyncer`] is built from the typed `weight_syncer` config and becomes a sender (trainer) or a
//! receiver (rollout) at init. The handshake: each receiver sends its metadata (ordered keys, shapes, dtypes);
//! the sender checks it against its state dict and `keys_to_sync`, answers with a plan (or an abort naming the
//! mismatching keys), then — patch with `init_sync.enabled` — sends the bucketized init bootstrap. From then on
//! `sync(state, version)` sends a patch (changed elements vs the sender's snapshot, held in the receiver's
//! dtypes) or all synced tensors in buckets, and `apply(state)` receives, verifies and installs it.
//!
//! Integrity: every payload carries kind, version and an xxh3 checksum ([`wire`]); a receiver rejects a
//! corrupt or truncated payload, a version not newer than its own, or a patch built on another base version,
//! and keeps its weights and version ([`SyncError::Rejected`]). Installs need `&mut StateDict` and are
//! validate-then-write (patch) or staged-then-swapped (bucket, undone on a later bucket's failure with
//! `load_instant: true`), so no reader ever sees a partially applied version.
//!
//! Config notes: `bucket.is_agent` is accepted for RLinf compatibility (agent-side key naming) and has no
//! effect on embodied runs; `cuda` devices and `nvcomp_lz4` are rejected with [`SyncError::NoGpuBackend`]
//! (rlsync has no GPU backend yet). With `load_instant: true` each verified bucket is swapped into the state dict as it arrives
//! (no staging of the whole version), `false` stages all buckets and swaps at the end; both undo on failure.
//!
//! CPU work (diff, coding, copies) runs on the calling thread plus scoped worker threads (`threads`); callers
//! on a tokio runtime should give the syncer a task that may block (it uses `block_in_place` when it can).

mod bootstrap;
mod bucket;
/// Patch kernels (build / encode / validate / install); public so `benches/` can time them alone.
pub mod patch;
mod rejoin;
pub mod wire;

use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::config::schema::{Compression, Device, SyncerKind, WeightSyncerConfig};
use crate::tensor::parallel::resolve_threads;
use crate::tensor::{DType, StateDict, StateHasher, Storage, cast_bytes, state_checksum};
use crate::transport::{self, TransportError};

use bucket::{Assembly, Planned, Pool, Staged};
use patch::{SnapTensor, ValidPatch};
use wire::{Codec, Header, KeyMeta, Kind, Plan, Strategy, WireError};

pub use rejoin::{CatchUpKind, CatchUpReport, ReplayLog};

/// Runtime options that are not part of the weight_syncer config.
#[derive(Debug, Clone, Copy, Default)]
pub struct SyncOptions {
    /// Threads for the diff / coding / install kernels (`0`: all cores).
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
    /// Receiver: checksum, decompression, validation, staging copies.
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
    #[error("{setting}: {value} needs a GPU backend, which rlsync does not have; use {instead}")]
    NoGpuBackend {
        setting: &'static str,
        value: &'static str,
        instead: &'static str,
    },
    #[error("handshake failed: {reason}")]
    Handshake { reason: String },
    #[error("the syncer is not initialised as a {expected} (call init_{expected} first)")]
    NotInitialized { expected: &'static str },
    #[error("the syncer is already initialised")]
    AlreadyInitialized,
    #[error("version {version} is not newer than the last sent version {last}")]
    VersionNotNewer { version: u64, last: u64 },
    #[error("rejected payload{}: {reason} (kept version {current})", version.map(|v| format!(" for version {v}")).unwrap_or_default())]
    Rejected {
        version: Option<u64>,
        current: u64,
        reason: String,
    },
    #[error("state dict key '{key}': {reason}")]
    StateMismatch { key: String, reason: String },
    #[error(transparent)]
    Transport(#[from] TransportError),
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
    threads: NonZeroUsize,
    /// Bytes per transport message of a bucket (tests shrink it to cover multi-part buckets).
    part_bytes: usize,
    /// Refuse a receiver whose state dict differs from the sender's at all ([`WeightSyncer::require_same_keys`]).
    same_keys: bool,
    /// Patches the sender keeps for rejoining receivers, and their byte cap.
    replay_versions: usize,
    replay_max_bytes: u64,
}

enum SenderStrategy {
    Patch {
        snap: Vec<SnapTensor>,
        built: patch::Built,
    },
    Bucket {
        buckets: Vec<Vec<Planned>>,
    },
}

struct SenderSide {
    ch: transport::Sender,
    synced_keys: Vec<String>,
    /// Receiver dtype per synced key (same order).
    recv_dtypes: Vec<DType>,
    last_version: u64,
    strategy: SenderStrategy,
    rejoin: rejoin::RejoinInfo,
}

/// Receiver-side facts shared with [`PendingUpdate`]s.
struct ReceiverShared {
    meta: Vec<KeyMeta>,
    synced: Vec<bool>,
    applied: AtomicU64,
    pool: Mutex<Pool>,
    threads: NonZeroUsize,
}

impl ReceiverShared {
    /// The staging pool (a panic elsewhere cannot leave it inconsistent: it only holds free storages).
    fn pool(&self) -> std::sync::MutexGuard<'_, Pool> {
        self.pool.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Bytes of the synced tensors in the receiver's dtypes.
    fn synced_bytes(&self) -> u64 {
        self.synced
            .iter()
            .zip(&self.meta)
            .filter(|(s, _)| **s)
            .map(|(_, m)| {
                m.shape
                    .iter()
                    .product::<usize>()
                    .saturating_mul(m.dtype.size_bytes()) as u64
            })
            .sum()
    }
}

struct ReceiverSide {
    ch: transport::Receiver,
    strategy: Strategy,
    synced_keys: Vec<String>,
    /// Highest version received and validated (≥ applied).
    received: u64,
    /// A bucket version this receiver gave up on midway: its remaining parts are skipped.
    interrupted: Option<u64>,
    shared: Arc<ReceiverShared>,
}

// One per syncer, never moved on a hot path: boxing the large sender side would buy nothing.
#[allow(clippy::large_enum_variant)]
enum Side {
    Uninit,
    Sender(SenderSide),
    Receiver(ReceiverSide),
}

/// Syncs a trainer's weights to rollout workers (see the module docs).
pub struct WeightSyncer {
    settings: Settings,
    side: Side,
    /// Tests capture every payload the sender publishes (to corrupt, truncate or replay it).
    #[cfg(test)]
    tap: Option<Vec<Vec<u8>>>,
}

/// Run CPU-heavy work without stalling other tasks of a multi-threaded runtime.
fn blocking<R>(f: impl FnOnce() -> R) -> R {
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

impl WeightSyncer {
    /// Build from the typed config. Settings that need a GPU (devices, nvCOMP) are [`SyncError::NoGpuBackend`].
    pub fn from_config(
        cfg: &WeightSyncerConfig,
        opts: SyncOptions,
    ) -> Result<WeightSyncer, SyncError> {
        let p = &cfg.patch;
        let b = &cfg.bucket;
        let cuda = |setting: &'static str| SyncError::NoGpuBackend {
            setting,
            value: "cuda",
            instead: "cpu",
        };
        let codec = match cfg.kind {
            SyncerKind::Patch => {
                if p.snapshot_device == Device::Cuda {
                    return Err(cuda("weight_syncer.patch.snapshot_device"));
                }
                if p.transport_device == Device::Cuda {
                    return Err(cuda("weight_syncer.patch.transport_device"));
                }
                match p.compression {
                    Compression::None => Codec::Plain,
                    Compression::Lz4 => Codec::Lz4,
                    Compression::NvcompLz4 => {
                        return Err(SyncError::NoGpuBackend {
                            setting: "weight_syncer.patch.compression",
                            value: "nvcomp_lz4",
                            instead: "lz4 or none",
                        });
                    }
                }
            }
            SyncerKind::Bucket => {
                if b.bucket_device == Device::Cuda {
                    return Err(cuda("weight_syncer.bucket.bucket_device"));
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
                threads: resolve_threads(opts.threads),
                part_bytes: bucket::PART_BYTES,
                same_keys: false,
                replay_versions: p.replay_versions as usize,
                replay_max_bytes: p.replay_max_bytes,
            },
            side: Side::Uninit,
            #[cfg(test)]
            tap: None,
        })
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

    /// Sender: the last version sent. Receiver: the version applied. 0 before the first sync.
    pub fn version(&self) -> u64 {
        match &self.side {
            Side::Uninit => 0,
            Side::Sender(s) => s.last_version,
            Side::Receiver(r) => r.shared.applied.load(Ordering::SeqCst),
        }
    }

    /// The synced keys (known after init on both sides), in sync order.
    pub fn synced_keys(&self) -> &[String] {
        match &self.side {
            Side::Uninit => &[],
            Side::Sender(s) => &s.synced_keys,
            Side::Receiver(r) => &r.synced_keys,
        }
    }

    /// Receiver: [`state_checksum`] of its synced keys. Sender: the checksum each receiver should report, i.e.
    /// of the synced keys as the receivers hold them (patch: the snapshot; bucket: `state` cast to the
    /// receivers' dtypes through the wire dtype).
    pub fn checksum(&self, state: &StateDict) -> Result<u64, SyncError> {
        match &self.side {
            Side::Uninit => Err(SyncError::NotInitialized {
                expected: "sender or receiver",
            }),
            Side::Receiver(r) => Ok(state_checksum(state, &r.synced_keys)),
            Side::Sender(s) => {
                let mut h = StateHasher::new();
                match &s.strategy {
                    SenderStrategy::Patch { snap, .. } => {
                        if let Some(c) = s.rejoin.cached_checksum(s.last_version) {
                            return Ok(c);
                        }
                        for st in snap {
                            let shape = state
                                .get(&st.key)
                                .map(|t| t.shape().to_vec())
                                .unwrap_or_default();
                            h.begin_tensor(&st.key, st.dtype, &shape);
                            h.bytes(st.storage.bytes());
                        }
                        let c = h.finish();
                        s.rejoin.cache_checksum(s.last_version, c);
                        return Ok(c);
                    }
                    SenderStrategy::Bucket { .. } => {
                        for (key, &rd) in s.synced_keys.iter().zip(&s.recv_dtypes) {
                            let t = state.get(key).ok_or_else(|| SyncError::StateMismatch {
                                key: key.clone(),
                                reason: "missing from the state dict".into(),
                            })?;
                            let wire = self.wire_dtype(t.dtype(), rd);
                            h.begin_tensor(key, rd, t.shape());
                            hash_cast(&mut h, t.bytes(), t.dtype(), wire, rd);
                        }
                    }
                }
                Ok(h.finish())
            }
        }
    }

    fn wire_dtype(&self, src: DType, _receiver: DType) -> DType {
        match self.settings.bucket_dtype {
            Some(d) if src.is_floating() => d,
            _ => src,
        }
    }

    // -----------------------------------------------------------------------------------------------------
    // init

    /// Sender side of the handshake (+ init bootstrap for patch). `keys_to_sync` are the keys every later
    /// `sync` covers (typically `state.synced_keys()`: trainable parameters and persistent buffers).
    pub async fn init_sender(
        &mut self,
        state: &StateDict,
        keys_to_sync: &[String],
        mut ch: transport::Sender,
    ) -> Result<SyncReport, SyncError> {
        if !matches!(self.side, Side::Uninit) {
            return Err(SyncError::AlreadyInitialized);
        }
        // 1. every receiver's metadata
        let mut meta: Option<Vec<KeyMeta>> = None;
        for rank in 0..ch.receivers() {
            let msg = ch.recv_from(rank).await?;
            let m = Header::parse(&msg)
                .and_then(|(h, body)| {
                    h.expect(Kind::Metadata)
                        .and_then(|_| wire::decode_metadata(body))
                })
                .map_err(|e| SyncError::Handshake {
                    reason: format!("metadata from receiver rank {rank}: {e}"),
                })?;
            match &meta {
                Some(first) if *first != m => {
                    let reason = format!(
                        "receiver rank {rank} reports different keys/shapes/dtypes than rank 0"
                    );
                    abort(&mut ch, &reason).await;
                    return Err(SyncError::Handshake { reason });
                }
                Some(_) => {}
                None => meta = Some(m),
            }
        }
        let meta = meta.unwrap_or_default();
        if self.settings.same_keys
            && let Some(diff) = bootstrap::first_difference(&meta, state)
        {
            let reason = format!("trainer and rollout state dicts differ: {diff}");
            abort(&mut ch, &reason).await;
            return Err(SyncError::Handshake { reason });
        }
        // 2. key selection and checks
        let patch_init = self.settings.kind == SyncerKind::Patch && self.settings.init_sync;
        let boot_keys: Vec<String> = match (patch_init, &self.settings.init_prefixes) {
            (false, _) => Vec::new(),
            (true, None) => state.keys().map(str::to_string).collect(),
            (true, Some(p)) => match bootstrap::select_prefixed(state, p) {
                Ok(k) => k,
                Err(reason) => {
                    abort(&mut ch, &reason).await;
                    return Err(SyncError::Config { reason });
                }
            },
        };
        let mut all: Vec<&str> = keys_to_sync.iter().map(String::as_str).collect();
        for k in &boot_keys {
            if !keys_to_sync.contains(k) {
                all.push(k);
            }
        }
        let full_state = patch_init && self.settings.init_prefixes.is_none();
        let ordinals = match bootstrap::check_metadata(&meta, state, &all, full_state) {
            Ok(o) => o,
            Err(reason) => {
                abort(&mut ch, &reason).await;
                return Err(SyncError::Handshake { reason });
            }
        };
        if let Some(dup) = keys_to_sync
            .iter()
            .enumerate()
            .find(|(i, k)| keys_to_sync[..*i].contains(k))
        {
            let reason = format!("keys_to_sync lists '{}' twice", dup.1);
            abort(&mut ch, &reason).await;
            return Err(SyncError::Handshake { reason });
        }
        let synced_ordinals: Vec<u32> = keys_to_sync
            .iter()
            .filter_map(|k| ordinals.get(k).copied())
            .collect();
        let recv_dtypes: Vec<DType> = synced_ordinals
            .iter()
            .map(|&o| meta[o as usize].dtype)
            .collect();
        // 3. plan + bootstrap
        let boot_refs: Vec<&str> = boot_keys.iter().map(String::as_str).collect();
        let boot_items =
            bootstrap::plan_items(state, &boot_refs, &meta, &ordinals, |_, receiver| receiver);
        let boot_buckets = bucket::plan(boot_items, self.settings.init_bucket_size);
        let strategy = match self.settings.kind {
            SyncerKind::Patch => Strategy::Patch,
            SyncerKind::Bucket => Strategy::Bucket,
        };
        let plan = Plan {
            strategy,
            synced: synced_ordinals.clone(),
            init_buckets: boot_buckets.len() as u32,
        };
        ch.send(&wire::encode_plan(&plan)).await?;
        let mut report = SyncReport {
            kind: SyncKind::Init,
            messages: boot_buckets.len() as u32,
            compression_ratio: 1.0,
            ..Default::default()
        };
        if !boot_buckets.is_empty() {
            let part_bytes = self.settings.part_bytes;
            let tap = self.tap_mut();
            let stats = bucket::send(
                &mut ch,
                state,
                &boot_buckets,
                Kind::InitBucket,
                0,
                part_bytes,
                tap,
            )
            .await?;
            report.payload_bytes = stats.payload_bytes;
            report.encode = stats.fill;
            report.changed = boot_buckets
                .iter()
                .flatten()
                .map(|p| (p.entry.byte_len / p.entry.dtype.size_bytes()) as u64)
                .sum();
            report.tensors = boot_buckets.iter().map(Vec::len).sum();
        }
        // 4. the strategy's own state
        let t_build = Instant::now();
        let strategy = match self.settings.kind {
            SyncerKind::Patch => {
                let mut snap = Vec::with_capacity(keys_to_sync.len());
                for ((key, &o), &rd) in keys_to_sync.iter().zip(&synced_ordinals).zip(&recv_dtypes)
                {
                    let t = state.get(key).ok_or_else(|| SyncError::StateMismatch {
                        key: key.clone(),
                        reason: "missing from the state dict".into(),
                    })?;
                    let mut storage = Storage::zeroed(t.numel() * rd.size_bytes());
                    blocking(|| cast_bytes(t.bytes(), t.dtype(), storage.bytes_mut(), rd))
                        .map_err(|e| SyncError::StateMismatch {
                            key: key.clone(),
                            reason: e.to_string(),
                        })?;
                    let cols = t.layout().coo_view().map_or(t.numel(), |(_, c)| c);
                    snap.push(SnapTensor {
                        key: key.clone(),
                        ordinal: o,
                        dtype: rd,
                        cols,
                        storage,
                    });
                }
                SenderStrategy::Patch {
                    snap,
                    built: patch::Built::default(),
                }
            }
            SyncerKind::Bucket => {
                let refs: Vec<&str> = keys_to_sync.iter().map(String::as_str).collect();
                let bucket_dtype = self.settings.bucket_dtype;
                let items = bootstrap::plan_items(state, &refs, &meta, &ordinals, |src, _| {
                    match bucket_dtype {
                        Some(d) if src.is_floating() => d,
                        _ => src,
                    }
                });
                let mut buckets = bucket::plan(items, self.settings.bucket_size);
                if buckets.is_empty() {
                    // Nothing selected: one empty bucket per version still carries the version.
                    buckets.push(Vec::new());
                }
                SenderStrategy::Bucket { buckets }
            }
        };
        report.build = t_build.elapsed();
        report.state_bytes = synced_ordinals
            .iter()
            .zip(keys_to_sync)
            .map(|(&o, k)| {
                state
                    .get(k)
                    .map_or(0, |t| t.numel() * meta[o as usize].dtype.size_bytes())
                    as u64
            })
            .sum();
        let t_flush = Instant::now();
        ch.flush().await?;
        report.transfer = t_flush.elapsed();
        let boot_only: Vec<(String, u32)> = boot_keys
            .iter()
            .filter(|k| !keys_to_sync.contains(k))
            .filter_map(|k| ordinals.get(k).map(|&o| (k.clone(), o)))
            .collect();
        let boot_typed: Vec<(String, DType)> = boot_only
            .iter()
            .map(|(k, o)| (k.clone(), meta[*o as usize].dtype))
            .collect();
        let boot_checksum = blocking(|| rejoin::cast_checksum(state, &boot_typed))?;
        self.side = Side::Sender(SenderSide {
            ch,
            synced_keys: keys_to_sync.to_vec(),
            recv_dtypes,
            last_version: 0,
            strategy,
            rejoin: rejoin::RejoinInfo {
                meta,
                synced_ordinals,
                boot_only,
                init_bucket_size: self.settings.init_bucket_size,
                boot_checksum,
                log: ReplayLog::new(
                    self.settings.replay_versions,
                    self.settings.replay_max_bytes,
                ),
                checksum: Mutex::new(None),
            },
        });
        Ok(report)
    }

    /// Receiver side of the handshake: send metadata of `state`, receive the plan and (patch) install the
    /// init bootstrap into `state`.
    pub async fn init_receiver(
        &mut self,
        state: &mut StateDict,
        mut ch: transport::Receiver,
    ) -> Result<SyncReport, SyncError> {
        if !matches!(self.side, Side::Uninit) {
            return Err(SyncError::AlreadyInitialized);
        }
        let meta: Vec<KeyMeta> = state
            .iter()
            .map(|(k, t)| KeyMeta {
                name: k.to_string(),
                dtype: t.dtype(),
                shape: t.shape().to_vec(),
            })
            .collect();
        ch.send(&wire::encode_metadata(&meta)).await?;
        let t_wait = Instant::now();
        let plan = ch
            .recv_with(|msg| -> Result<Plan, SyncError> {
                // Verify what is used: the checksum and the decoding read one private copy, never the slot twice.
                let msg = msg.to_vec();
                let (h, body) = Header::parse(&msg).map_err(|e| SyncError::Handshake {
                    reason: format!("plan from the sender: {e}"),
                })?;
                match h.kind {
                    Kind::Abort => Err(SyncError::Handshake {
                        reason: format!("the sender refused: {}", wire::decode_abort(body)),
                    }),
                    Kind::Plan => wire::decode_plan(&h, body).map_err(|e| SyncError::Handshake {
                        reason: e.to_string(),
                    }),
                    k => Err(SyncError::Handshake {
                        reason: format!("expected the sender's plan, got a {} message", k.name()),
                    }),
                }
            })
            .await??;
        let mut report = SyncReport {
            kind: SyncKind::Init,
            transfer: t_wait.elapsed(),
            compression_ratio: 1.0,
            ..Default::default()
        };
        let mut synced = vec![false; meta.len()];
        for &o in &plan.synced {
            match synced.get_mut(o as usize) {
                Some(s) => *s = true,
                None => {
                    return Err(SyncError::Handshake {
                        reason: format!(
                            "plan names ordinal {o}, the receiver has {} keys",
                            meta.len()
                        ),
                    });
                }
            }
        }
        let synced_keys: Vec<String> = plan
            .synced
            .iter()
            .map(|&o| meta[o as usize].name.clone())
            .collect();
        let expected_strategy = match self.settings.kind {
            SyncerKind::Patch => Strategy::Patch,
            SyncerKind::Bucket => Strategy::Bucket,
        };
        if plan.strategy != expected_strategy {
            return Err(SyncError::Handshake {
                reason: format!(
                    "sender uses {:?}, this receiver is configured for {:?}",
                    plan.strategy, expected_strategy
                ),
            });
        }
        let shared = Arc::new(ReceiverShared {
            meta,
            synced,
            applied: AtomicU64::new(0),
            pool: Mutex::new(Pool::default()),
            threads: self.settings.threads,
        });
        if plan.init_buckets > 0 {
            let got = receive_init_buckets(&mut ch, plan.init_buckets, &shared.meta, state).await?;
            report.payload_bytes += got.payload_bytes;
            report.messages += got.messages;
            report.decode += got.decode;
            report.apply += got.apply;
            report.tensors = got.tensors;
            report.changed = got.changed;
        }
        report.state_bytes = plan
            .synced
            .iter()
            .map(|&o| {
                state
                    .get_index(o as usize)
                    .map_or(0, |(_, t)| t.bytes().len()) as u64
            })
            .sum();
        self.side = Side::Receiver(ReceiverSide {
            ch,
            strategy: plan.strategy,
            synced_keys,
            received: 0,
            interrupted: None,
            shared,
        });
        Ok(report)
    }

    /// Receiver side of a rejoin (a restarted rollout on an elastic channel): report the metadata of `state`
    /// and the version `held` it holds (0 after a fresh start: its own init weights), then install the
    /// catch-up the sender chose (see `syncer/rejoin.rs`). Afterwards this is a receiver like any other, at
    /// `report.to` (0 for a deferred catch-up: the next version, a full transfer, makes it current).
    pub async fn rejoin_receiver(
        &mut self,
        state: &mut StateDict,
        mut ch: transport::Receiver,
        held: u64,
    ) -> Result<CatchUpReport, SyncError> {
        if !matches!(self.side, Side::Uninit) {
            return Err(SyncError::AlreadyInitialized);
        }
        let started = Instant::now();
        let rank = ch.rank();
        let meta: Vec<KeyMeta> = state
            .iter()
            .map(|(k, t)| KeyMeta {
                name: k.to_string(),
                dtype: t.dtype(),
                shape: t.shape().to_vec(),
            })
            .collect();
        let handshake = |reason: String| SyncError::Handshake {
            reason: format!("rejoin: {reason}"),
        };
        let msg = wire::encode_rejoin(&meta, held);
        let mut report = CatchUpReport {
            rank,
            from: held,
            payload_bytes: msg.len() as u64,
            ..CatchUpReport::default()
        };
        ch.send(&msg).await?;
        let (plan, boot_only, len) = ch
            .recv_with(|msg| -> Result<(Plan, Vec<u32>, usize), SyncError> {
                let (h, body) = Header::parse(msg).map_err(|e| handshake(e.to_string()))?;
                match h.kind {
                    Kind::Abort => Err(handshake(format!(
                        "the sender refused: {}",
                        wire::decode_abort(body)
                    ))),
                    Kind::RejoinPlan => wire::decode_rejoin_plan(body)
                        .map(|(p, b)| (p, b, msg.len()))
                        .map_err(|e| handshake(e.to_string())),
                    k => Err(handshake(format!(
                        "expected the sender's rejoin plan, got a {} message",
                        k.name()
                    ))),
                }
            })
            .await??;
        report.payload_bytes += len as u64;
        let expected_strategy = match self.settings.kind {
            SyncerKind::Patch => Strategy::Patch,
            SyncerKind::Bucket => Strategy::Bucket,
        };
        if plan.strategy != expected_strategy {
            return Err(handshake(format!(
                "sender uses {:?}, this receiver is configured for {:?}",
                plan.strategy, expected_strategy
            )));
        }
        let name = |o: &u32| {
            meta.get(*o as usize)
                .map(|m| m.name.clone())
                .ok_or_else(|| {
                    handshake(format!(
                        "plan names ordinal {o}, the receiver has {} keys",
                        meta.len()
                    ))
                })
        };
        let synced_keys = plan
            .synced
            .iter()
            .map(name)
            .collect::<Result<Vec<_>, _>>()?;
        let boot_keys = boot_only.iter().map(name).collect::<Result<Vec<_>, _>>()?;
        let mut synced = vec![false; meta.len()];
        for &o in &plan.synced {
            if let Some(s) = synced.get_mut(o as usize) {
                *s = true;
            }
        }
        let held_now = blocking(|| rejoin::held(state, held, &synced_keys, &boot_keys));
        let msg = wire::encode_held(&held_now);
        report.payload_bytes += msg.len() as u64;
        ch.send(&msg).await?;
        let (catch_up, len) = ch
            .recv_with(|msg| -> Result<(wire::CatchUpPlan, usize), SyncError> {
                let (h, body) = Header::parse(msg).map_err(|e| handshake(e.to_string()))?;
                h.expect(Kind::CatchUp)
                    .and_then(|_| wire::decode_catch_up(&h, body))
                    .map(|c| (c, msg.len()))
                    .map_err(|e| handshake(e.to_string()))
            })
            .await??;
        report.payload_bytes += len as u64;
        if catch_up.boot_buckets > 0 {
            let got = receive_init_buckets(&mut ch, catch_up.boot_buckets, &meta, state).await?;
            report.boot_bytes = got.payload_bytes;
            report.payload_bytes += got.payload_bytes;
        }
        // Replay starts from the held version; a full or deferred catch-up replaces everything.
        let start = match catch_up.mode {
            wire::CatchUpMode::Replay => held,
            wire::CatchUpMode::Full | wire::CatchUpMode::Deferred => 0,
        };
        let shared = Arc::new(ReceiverShared {
            meta,
            synced,
            applied: AtomicU64::new(start),
            pool: Mutex::new(Pool::default()),
            threads: self.settings.threads,
        });
        let mut r = ReceiverSide {
            ch,
            strategy: plan.strategy,
            synced_keys,
            received: start,
            interrupted: None,
            shared,
        };
        match catch_up.mode {
            wire::CatchUpMode::Replay => {
                report.kind = CatchUpKind::Replay;
                for _ in 0..catch_up.patches {
                    let pending = receive_patch(&mut r).await?;
                    let got = pending.install(state)?;
                    report.payload_bytes += got.payload_bytes;
                    report.patches += 1;
                }
            }
            wire::CatchUpMode::Full => {
                report.kind = CatchUpKind::Full;
                if catch_up.version == 0 {
                    // Version 0 (no sync yet): the snapshot travels as init buckets, like the bootstrap.
                    let got = receive_init_buckets(
                        &mut r.ch,
                        catch_up.full_buckets,
                        &r.shared.meta,
                        state,
                    )
                    .await?;
                    report.payload_bytes += got.payload_bytes;
                } else if catch_up.full_buckets > 0 {
                    let (_, got) = receive_buckets(&mut r, Some(state)).await?;
                    report.payload_bytes += got.payload_bytes;
                }
            }
            wire::CatchUpMode::Deferred => report.kind = CatchUpKind::Full,
        }
        let now = r.shared.applied.load(Ordering::SeqCst);
        if now != catch_up.version {
            return Err(rejected(
                Some(catch_up.version),
                now,
                format!(
                    "the catch-up was announced to reach version {}, it reached {now}",
                    catch_up.version
                ),
            ));
        }
        report.to = now;
        report.elapsed = started.elapsed();
        self.side = Side::Receiver(r);
        Ok(report)
    }

    #[cfg(test)]
    fn tap_mut(&mut self) -> Option<&mut Vec<Vec<u8>>> {
        self.tap.as_mut()
    }

    #[cfg(not(test))]
    fn tap_mut(&mut self) -> Option<&mut Vec<Vec<u8>>> {
        None
    }

    // -----------------------------------------------------------------------------------------------------
    // sender

    /// Send version `version` (must be greater than the last one sent) of the synced keys of `state`.
    pub async fn sync(&mut self, state: &StateDict, version: u64) -> Result<SyncReport, SyncError> {
        let settings = self.settings.clone();
        #[cfg(test)]
        let tap = self.tap.as_mut();
        #[cfg(not(test))]
        let tap: Option<&mut Vec<Vec<u8>>> = None;
        let Side::Sender(s) = &mut self.side else {
            return Err(SyncError::NotInitialized { expected: "sender" });
        };
        if version <= s.last_version {
            return Err(SyncError::VersionNotNewer {
                version,
                last: s.last_version,
            });
        }
        let mut report = match &mut s.strategy {
            SenderStrategy::Patch { snap, built } => {
                // The log needs the checksum of the base (the snapshot before this build).
                let base_checksum = s.rejoin.log.is_enabled().then(|| {
                    s.rejoin.cached_checksum(s.last_version).unwrap_or_else(|| {
                        let c = blocking(|| rejoin::snapshot_checksum(snap, &s.rejoin.meta));
                        s.rejoin.cache_checksum(s.last_version, c);
                        c
                    })
                });
                let t0 = Instant::now();
                blocking(|| patch::build(snap, state, settings.threads, built)).map_err(
                    |reason| SyncError::StateMismatch {
                        key: "(synced keys)".into(),
                        reason,
                    },
                )?;
                let build = t0.elapsed();
                let t1 = Instant::now();
                let (msg, ratio, tensors, dense) = blocking(|| {
                    let body = patch::encode(built, snap, settings.delta, settings.threads);
                    let tensors = body.entries.len();
                    let dense = body.entries.iter().filter(|e| e.dense).count() as u64;
                    let enc = wire::encode_patch_body(&body, settings.codec);
                    let mut h = Header::new(Kind::Patch, version, enc.body.len());
                    h.aux = s.last_version;
                    let ratio = if enc.stored_stream_bytes == 0 {
                        1.0
                    } else {
                        enc.raw_stream_bytes as f64 / enc.stored_stream_bytes as f64
                    };
                    (wire::message(h, &enc.body), ratio, tensors, dense)
                });
                let encode = t1.elapsed();
                let t2 = Instant::now();
                s.ch.send(&msg).await?;
                if let Some(tap) = tap {
                    tap.push(msg.clone());
                }
                let payload_bytes = msg.len() as u64;
                if let Some(c) = base_checksum {
                    s.rejoin.log.push(s.last_version, version, c, msg);
                }
                SyncReport {
                    kind: SyncKind::Patch,
                    payload_bytes,
                    changed: built.changed,
                    state_bytes: snap.iter().map(|t| t.storage.len() as u64).sum(),
                    tensors,
                    messages: 1,
                    build,
                    encode,
                    transfer: t2.elapsed(),
                    compression_ratio: ratio,
                    dense_segments: dense,
                    ..Default::default()
                }
            }
            SenderStrategy::Bucket { buckets } => {
                let stats = bucket::send(
                    &mut s.ch,
                    state,
                    buckets,
                    Kind::Bucket,
                    version,
                    settings.part_bytes,
                    tap,
                )
                .await?;
                SyncReport {
                    kind: SyncKind::Bucket,
                    payload_bytes: stats.payload_bytes,
                    changed: buckets
                        .iter()
                        .flatten()
                        .map(|p| (p.entry.byte_len / p.entry.dtype.size_bytes()) as u64)
                        .sum(),
                    state_bytes: s
                        .synced_keys
                        .iter()
                        .zip(&s.recv_dtypes)
                        .map(|(k, d)| state.get(k).map_or(0, |t| t.numel() * d.size_bytes()) as u64)
                        .sum(),
                    tensors: buckets.iter().map(Vec::len).sum(),
                    messages: stats.messages,
                    encode: stats.fill,
                    transfer: stats.wait,
                    compression_ratio: 1.0,
                    ..Default::default()
                }
            }
        };
        s.last_version = version;
        report.version = version;
        Ok(report)
    }

    /// Sender: catch up receiver `rank`, which joined the (elastic) channel late and called
    /// [`WeightSyncer::rejoin_receiver`]: replay of logged patches when sound, else a full transfer (see
    /// `syncer/rejoin.rs`). Only that receiver sees these messages. Waits (bounded by the channel's timeout)
    /// for the receiver to join.
    pub async fn rejoin(
        &mut self,
        state: &StateDict,
        rank: usize,
    ) -> Result<CatchUpReport, SyncError> {
        let part_bytes = self.settings.part_bytes;
        let Side::Sender(s) = &mut self.side else {
            return Err(SyncError::NotInitialized { expected: "sender" });
        };
        let (snap, strategy) = match &s.strategy {
            SenderStrategy::Patch { snap, .. } => (Some(snap.as_slice()), Strategy::Patch),
            SenderStrategy::Bucket { .. } => (None, Strategy::Bucket),
        };
        rejoin::serve(
            &mut s.ch,
            rank,
            &s.rejoin,
            state,
            snap,
            s.last_version,
            strategy,
            part_bytes,
        )
        .await
    }

    /// Sender: bytes held by the replay log.
    pub fn replay_log_bytes(&self) -> u64 {
        match &self.side {
            Side::Sender(s) => s.rejoin.log.bytes(),
            _ => 0,
        }
    }

    /// Sender: receiver ranks attached to the channel now.
    pub fn live_receivers(&self) -> Vec<usize> {
        match &self.side {
            Side::Sender(s) => s.ch.live(),
            _ => Vec::new(),
        }
    }

    /// Wait until every receiver has released every published payload.
    pub async fn flush(&mut self) -> Result<(), SyncError> {
        let Side::Sender(s) = &mut self.side else {
            return Err(SyncError::NotInitialized { expected: "sender" });
        };
        Ok(s.ch.flush().await?)
    }

    // -----------------------------------------------------------------------------------------------------
    // receiver

    /// Receive the next version and install it into `state`; `report.version` is the applied version.
    pub async fn apply(&mut self, state: &mut StateDict) -> Result<SyncReport, SyncError> {
        let instant = self.settings.load_instant;
        let Side::Receiver(r) = &mut self.side else {
            return Err(SyncError::NotInitialized {
                expected: "receiver",
            });
        };
        if r.strategy == Strategy::Bucket && instant {
            return receive_buckets(r, Some(state))
                .await
                .map(|(_, report)| report);
        }
        let pending = receive(r).await?;
        pending.install(state)
    }

    /// Background (no-wait) receive: read and validate the next update without touching the weights; install
    /// it later with [`PendingUpdate::install`] (between rollout chunks, never mid-forward).
    pub async fn receive(&mut self) -> Result<PendingUpdate, SyncError> {
        let Side::Receiver(r) = &mut self.side else {
            return Err(SyncError::NotInitialized {
                expected: "receiver",
            });
        };
        receive(r).await
    }
}

/// Receive `count` init buckets (any receiver key) and install them into `state` once all arrived and fit.
async fn receive_init_buckets(
    ch: &mut transport::Receiver,
    count: u32,
    meta: &[KeyMeta],
    state: &mut StateDict,
) -> Result<SyncReport, SyncError> {
    let mut report = SyncReport::default();
    let all = vec![true; meta.len()];
    let mut staged: Staged = Vec::new();
    let mut pool = Pool::default();
    for seq in 0..count {
        let mut asm: Option<Assembly> = None;
        loop {
            let t0 = Instant::now();
            let done = ch
                .recv_with(|msg| -> Result<bool, String> {
                    let (h, body) = Header::parse_unverified(msg).map_err(|e| e.to_string())?;
                    h.expect(Kind::InitBucket).map_err(|e| e.to_string())?;
                    if h.seq != seq || h.count != count || h.version != 0 {
                        return Err(format!(
                            "init bucket {}/{} (version {}) out of sequence, expected {seq}/{count}",
                            h.seq, h.count, h.version
                        ));
                    }
                    match asm.as_mut() {
                        None => {
                            asm = Some(blocking(|| {
                                Assembly::start(&h, body, meta, &all, &mut pool)
                            })?)
                        }
                        Some(a) => blocking(|| a.add_part(&h, body))?,
                    }
                    Ok(asm.as_ref().is_some_and(Assembly::is_complete))
                })
                .await?
                .map_err(|reason| SyncError::Handshake {
                    reason: format!("init bootstrap: {reason}"),
                })?;
            report.decode += t0.elapsed();
            if done {
                break;
            }
        }
        if let Some(a) = asm {
            report.payload_bytes += a.bytes() as u64;
            report.messages += 1;
            staged.extend(a.finish());
        }
    }
    let t0 = Instant::now();
    bucket::check_fits(&staged, meta, state).map_err(|reason| SyncError::Handshake { reason })?;
    report.tensors = staged.len();
    report.changed = staged
        .iter()
        .map(|(o, s)| (s.len() / meta.get(*o as usize).map_or(1, |m| m.dtype.size_bytes())) as u64)
        .sum();
    let _ = bucket::swap_in(staged, state);
    report.apply = t0.elapsed();
    Ok(report)
}

async fn abort(ch: &mut transport::Sender, reason: &str) {
    // Best effort: receivers that cannot be told will time out on their own.
    let _ = ch.send(&wire::encode_abort(reason)).await;
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

/// A received, verified update waiting to be installed.
pub struct PendingUpdate {
    version: u64,
    body: PendingBody,
    shared: Arc<ReceiverShared>,
    report: SyncReport,
}

enum PendingBody {
    Patch { base: u64, body: wire::PatchBody },
    Bucket(Staged),
}

impl PendingUpdate {
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Install into `state` (the receiver's state dict from init). Rejected — state and version untouched —
    /// when the version is no longer newer than the applied one, a patch's base is not the applied version,
    /// or the payload does not fit the state dict.
    pub fn install(self, state: &mut StateDict) -> Result<SyncReport, SyncError> {
        let PendingUpdate {
            version,
            body,
            shared,
            mut report,
        } = self;
        let current = shared.applied.load(Ordering::SeqCst);
        if version <= current {
            if let PendingBody::Bucket(staged) = body {
                give_back(&shared, staged);
            }
            return Err(rejected(
                Some(version),
                current,
                format!("version {version} is not newer than the applied version {current}"),
            ));
        }
        match body {
            PendingBody::Patch { base, body } => {
                if base != current {
                    return Err(rejected(
                        Some(version),
                        current,
                        format!(
                            "patch is based on version {base}, this receiver holds {current} (a full resync is needed)"
                        ),
                    ));
                }
                let t0 = Instant::now();
                let valid: ValidPatch = blocking(|| {
                    patch::validate(body, &shared.meta, &shared.synced, state, shared.threads)
                })
                .map_err(|r| rejected(Some(version), current, r))?;
                report.decode += t0.elapsed();
                let t1 = Instant::now();
                blocking(|| patch::install(&valid, state, shared.threads));
                report.apply = t1.elapsed();
                report.changed = valid.changed;
            }
            PendingBody::Bucket(staged) => {
                if let Err(r) = bucket::check_fits(&staged, &shared.meta, state) {
                    give_back(&shared, staged);
                    return Err(rejected(Some(version), current, r));
                }
                let t1 = Instant::now();
                let old = bucket::swap_in(staged, state);
                report.apply = t1.elapsed();
                give_back(&shared, old);
            }
        }
        shared.applied.store(version, Ordering::SeqCst);
        report.version = version;
        Ok(report)
    }
}

fn give_back(shared: &ReceiverShared, staged: Staged) {
    shared.pool().give_all(staged);
}

/// Read the next update (patch: one message; bucket: all buckets of a version, staged).
async fn receive(r: &mut ReceiverSide) -> Result<PendingUpdate, SyncError> {
    match r.strategy {
        Strategy::Patch => receive_patch(r).await,
        Strategy::Bucket => match receive_buckets(r, None).await? {
            (Some(p), _) => Ok(p),
            (None, _) => Err(rejected(
                None,
                r.shared.applied.load(Ordering::SeqCst),
                "bucket version produced no staged update",
            )),
        },
    }
}

async fn receive_patch(r: &mut ReceiverSide) -> Result<PendingUpdate, SyncError> {
    let current = r.shared.applied.load(Ordering::SeqCst);
    let received = r.received;
    let t_wait = Instant::now();
    let max_stream = r
        .shared
        .meta
        .iter()
        .map(|m| m.shape.iter().product::<usize>().saturating_mul(10))
        .sum::<usize>()
        .saturating_add(1 << 16);
    let mut decode = Duration::ZERO;
    let out =
        r.ch.recv_with(
            |msg| -> Result<(u64, u64, wire::PatchBody, usize, Duration), SyncError> {
                let t0 = Instant::now();
                // Verify what is installed: the slot may be shared memory another process can write, so the
                // checksum and the decoding both read one private copy, never the slot twice.
                let msg = blocking(|| msg.to_vec());
                let (h, body) =
                    Header::parse(&msg).map_err(|e| rejected(None, current, e.to_string()))?;
                h.expect(Kind::Patch)
                    .map_err(|e| rejected(Some(h.version), current, e.to_string()))?;
                if h.version <= received {
                    return Err(rejected(
                        Some(h.version),
                        current,
                        format!(
                            "version {} is not newer than {received} (replayed or stale)",
                            h.version
                        ),
                    ));
                }
                let pb = blocking(|| wire::decode_patch_body(body, max_stream))
                    .map_err(|e: WireError| rejected(Some(h.version), current, e.to_string()))?;
                Ok((h.version, h.aux, pb, msg.len(), t0.elapsed()))
            },
        )
        .await?;
    let (version, base, body, len, d) = out?;
    decode += d;
    r.received = version;
    let report = SyncReport {
        kind: SyncKind::Patch,
        payload_bytes: len as u64,
        messages: 1,
        tensors: body.entries.len(),
        transfer: t_wait.elapsed().saturating_sub(decode),
        decode,
        compression_ratio: 1.0,
        state_bytes: r.shared.synced_bytes(),
        ..Default::default()
    };
    Ok(PendingUpdate {
        version,
        body: PendingBody::Patch { base, body },
        shared: r.shared.clone(),
        report,
    })
}

enum BucketStep {
    /// A leftover part of an earlier (rejected or interrupted) version.
    Skip,
    /// A part was staged; the bucket is complete when this is true.
    Staged { complete: bool, decode: Duration },
}

/// Receive every bucket of one version, part by part. With `install = Some(state)` (load_instant) each
/// verified bucket is swapped into the state at once and undone if a later bucket fails (or the channel
/// fails mid-version); otherwise everything is staged and returned as a pending update.
async fn receive_buckets(
    r: &mut ReceiverSide,
    mut install: Option<&mut StateDict>,
) -> Result<(Option<PendingUpdate>, SyncReport), SyncError> {
    let shared = r.shared.clone();
    let current = shared.applied.load(Ordering::SeqCst);
    let mut report = SyncReport {
        kind: SyncKind::Bucket,
        compression_ratio: 1.0,
        ..Default::default()
    };
    let mut staged_all: Staged = Vec::new();
    let mut undo: Staged = Vec::new();
    let mut asm: Option<Assembly> = None;
    let mut version: Option<u64> = None;
    let mut count = 0u32;
    let mut seq = 0u32;
    let t_start = Instant::now();
    // Undo what was installed, return every staging storage, and report why.
    let fail = |err: SyncError,
                asm: Option<Assembly>,
                staged_all: Staged,
                undo: Staged,
                state: Option<&mut StateDict>| {
        if let Some(state) = state {
            let displaced = bucket::swap_in(undo, state);
            give_back(&shared, displaced);
        }
        give_back(&shared, staged_all);
        if let Some(a) = asm {
            let mut pool = shared.pool();
            a.abandon(&mut pool);
        }
        err
    };
    loop {
        let received = r.received;
        let interrupted = r.interrupted;
        let v_now = version;
        let step = r
            .ch
            .recv_with(|msg| -> Result<BucketStep, (Option<u64>, String)> {
                let t0 = Instant::now();
                let (h, body) = Header::parse_unverified(msg).map_err(|e| (None, e.to_string()))?;
                h.expect(Kind::Bucket).map_err(|e| (Some(h.version), e.to_string()))?;
                if let Some(a) = asm.as_mut() {
                    blocking(|| a.add_part(&h, body)).map_err(|e| (Some(h.version), e))?;
                    return Ok(BucketStep::Staged { complete: a.is_complete(), decode: t0.elapsed() });
                }
                let starts_version = h.seq == 0 && h.aux == 0;
                match v_now {
                    // Later buckets, or later parts of a bucket this receiver gave up on, of an earlier version.
                    None if h.seq != 0 || (!starts_version && interrupted == Some(h.version)) => {
                        // Skip only a genuine leftover: a corrupted header must not make a part look like one.
                        Header::parse(msg).map_err(|e| (Some(h.version), e.to_string()))?;
                        return Ok(BucketStep::Skip);
                    }
                    None if !starts_version => {
                        return Err((Some(h.version), format!("version {} starts at byte {} of bucket {}/{}, not at its beginning", h.version, h.aux, h.seq, h.count)));
                    }
                    None if h.version <= received => {
                        return Err((Some(h.version), format!("version {} is not newer than {received} (replayed or stale)", h.version)));
                    }
                    None => {}
                    Some(v) if h.version != v || h.seq != seq || h.count != count => {
                        return Err((Some(h.version), format!("bucket {}/{} of version {} arrived while expecting {seq}/{count} of version {v}", h.seq, h.count, h.version)));
                    }
                    Some(_) => {}
                }
                let mut pool = shared.pool();
                let a = blocking(|| Assembly::start(&h, body, &shared.meta, &shared.synced, &mut pool)).map_err(|e| (Some(h.version), e))?;
                let complete = a.is_complete();
                if v_now.is_none() {
                    version = Some(h.version);
                    count = h.count;
                }
                asm = Some(a);
                Ok(BucketStep::Staged { complete, decode: t0.elapsed() })
            })
            .await;
        let step = match step {
            Ok(step) => step,
            Err(e) => {
                r.interrupted = version;
                return Err(fail(e.into(), asm, staged_all, undo, install));
            }
        };
        match step {
            Ok(BucketStep::Skip) => report.skipped += 1,
            Ok(BucketStep::Staged { complete, decode }) => {
                report.decode += decode;
                if !complete {
                    continue;
                }
                let Some(done) = asm.take() else { continue };
                report.payload_bytes += done.bytes() as u64;
                report.messages += 1;
                let staged = done.finish();
                report.tensors += staged.len();
                report.changed += staged
                    .iter()
                    .map(|(o, s)| {
                        (s.len()
                            / shared
                                .meta
                                .get(*o as usize)
                                .map_or(1, |m| m.dtype.size_bytes())) as u64
                    })
                    .sum::<u64>();
                match install.as_deref_mut() {
                    Some(state) => {
                        if let Err(reason) = bucket::check_fits(&staged, &shared.meta, state) {
                            give_back(&shared, staged);
                            r.interrupted = version;
                            return Err(fail(
                                rejected(version, current, reason),
                                None,
                                staged_all,
                                undo,
                                Some(state),
                            ));
                        }
                        let t1 = Instant::now();
                        undo.extend(bucket::swap_in(staged, state));
                        report.apply += t1.elapsed();
                    }
                    None => staged_all.extend(staged),
                }
                seq += 1;
                if seq == count {
                    break;
                }
            }
            Err((v, reason)) => {
                r.interrupted = v.or(version);
                return Err(fail(
                    rejected(v.or(version), current, reason),
                    asm,
                    staged_all,
                    undo,
                    install,
                ));
            }
        }
    }
    let version = version.unwrap_or(0);
    r.received = version;
    report.transfer = t_start
        .elapsed()
        .saturating_sub(report.decode + report.apply);
    report.version = version;
    report.state_bytes = shared.synced_bytes();
    match install {
        Some(_) => {
            give_back(&shared, undo);
            shared.applied.store(version, Ordering::SeqCst);
            Ok((None, report))
        }
        None => Ok((
            Some(PendingUpdate {
                version,
                body: PendingBody::Bucket(staged_all),
                shared: shared.clone(),
                report: report.clone(),
            }),
            report,
        )),
    }
}

#[cfg(test)]
mod tests;
