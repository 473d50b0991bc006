//! Rejoin: a receiver that joined late (a restarted rollout) catches up by replaying logged patches, else by a
//! full transfer, and is verified like after any sync.
//!
//! The sender keeps a bounded log of the patch messages it sent ([`ReplayLog`], keyed by base version, at most
//! `weight_syncer.patch.replay_versions` entries and `replay_max_bytes` bytes), each with the checksum of the
//! snapshot it was built on. A rejoining receiver sends its metadata and the version V it holds, gets the plan
//! (synced keys, bootstrap-only keys), and reports the checksums of both key sets. The sender then chooses:
//!
//! - **replay**: V is the base of a chain of logged patches up to the last version sent, the receiver's synced
//!   checksum equals the logged checksum of V, and the chain costs no more than a full transfer. The patches
//!   go out byte for byte as first sent and the receiver validates and installs each exactly like a live one
//!   (kind, checksum, version newer, base equal to its version), so replay is bitwise the same as having been
//!   there. A patch carries absolute values of the elements that changed since its base, hence it is only
//!   sound on exactly its base state: that is what the checksum check guarantees (a fresh worker's own init
//!   weights, a checkpoint-resumed trainer, or a missing log entry all fall back to full).
//! - **full**: every synced tensor of the sender's snapshot (patch syncer: the last version, in the receiver's
//!   dtypes, bit for bit what the others hold) as buckets of that version.
//! - **full, bucket syncer**: the last version, from the state when the caller says the state *is* that version
//!   (nothing trained since), else from the copy of it the sender keeps when asked to
//!   (`WeightSyncer::keep_last_version`; version 0 needs nothing: every receiver of a bucket syncer holds its
//!   own initial weights at version 0);
//! - **deferred** (bucket syncer, the state moved on and no copy kept): every version is a full transfer
//!   anyway, so the receiver only completes the handshake and takes the next version with the others.
//!
//! Versions and sequences: a rejoin names states by the caller's version (the receiver reports the version it
//! holds), payloads are ordered by the sender's sequence. The log keeps only a chain whose versions strictly
//! increase (a sync whose version is not newer than its base ends the chain and is not logged), so a held version
//! names at most one base in it; the catch-up tells the receiver the sequence it continues from. The Rust
//! runtime syncs strictly increasing versions ([`super::WeightSyncer::require_increasing_versions`]); a caller
//! that repeats versions (RLinf) still gets full catch-ups, and replays from the increasing stretch of its log.
//!
//! Keys the init bootstrap covers but no version updates (frozen weights) are sent again, as init buckets,
//! only when the receiver's checksum of them differs from the sender's. All catch-up messages target the one
//! receiver; the others never see them.

use std::collections::VecDeque;
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::tensor::{DType, StateDict, StateHasher, state_checksum};
use crate::transport;

use super::bootstrap::Selection;
use super::bucket::{self, Planned};
use super::patch::SnapTensor;
use super::snapshot_sum::BackgroundSum;
pub(super) use super::snapshot_sum::snapshot_checksum;
use super::wire::{self, CatchUpMode, CatchUpPlan, Header, Held, KeyMeta, Kind, Stamp};
use super::{Settings, SyncError, blocking, hash_cast, missing_key};

/// One logged patch's messages (its parts), in order.
type Parts<'a> = &'a [Vec<u8>];

/// One logged patch: its messages (parts) as sent, its base and version, and the checksum of its base snapshot.
#[derive(Debug)]
struct Logged {
    base: Stamp,
    to: Stamp,
    base_checksum: u64,
    msgs: Vec<Vec<u8>>,
}

impl Logged {
    fn bytes(&self) -> u64 {
        self.msgs.iter().map(|m| m.len() as u64).sum()
    }
}

/// The sender's bounded log of recent patches (oldest evicted first).
#[derive(Debug)]
pub struct ReplayLog {
    max_versions: usize,
    max_bytes: u64,
    bytes: u64,
    entries: VecDeque<Logged>,
}

impl ReplayLog {
    pub fn new(max_versions: usize, max_bytes: u64) -> ReplayLog {
        ReplayLog {
            max_versions,
            max_bytes,
            bytes: 0,
            entries: VecDeque::new(),
        }
    }

    pub fn is_enabled(&self) -> bool {
        self.max_versions > 0 && self.max_bytes > 0
    }

    /// Record the patch `msgs` (its parts) from `base` to `to`. A patch larger than the byte cap, or one whose version is
    /// not newer than its base's, empties the log (no chain could cross it), and a base that does not continue
    /// the log starts it anew.
    pub fn push(&mut self, base: Stamp, to: Stamp, base_checksum: u64, msgs: Vec<Vec<u8>>) {
        if !self.is_enabled() {
            return;
        }
        let len: u64 = msgs.iter().map(|m| m.len() as u64).sum();
        let unlogged = len > self.max_bytes || to.version <= base.version;
        if self.entries.back().is_some_and(|e| e.to != base) || unlogged {
            self.entries.clear();
            self.bytes = 0;
        }
        if unlogged {
            return;
        }
        self.bytes += len;
        self.entries.push_back(Logged {
            base,
            to,
            base_checksum,
            msgs,
        });
        while self.entries.len() > self.max_versions || self.bytes > self.max_bytes {
            match self.entries.pop_front() {
                Some(e) => self.bytes -= e.bytes(),
                None => break,
            }
        }
    }

    /// Tests: flip one body byte of the newest patch (as if memory or the channel corrupted it).
    #[cfg(test)]
    pub(super) fn corrupt_last_for_tests(&mut self) {
        if let Some(e) = self.entries.back_mut()
            && let Some(b) = e.msgs.last_mut().and_then(|m| m.last_mut())
        {
            *b ^= 0x40;
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Versions the log can replay from (the bases it holds), oldest first.
    pub fn bases(&self) -> Vec<u64> {
        self.entries.iter().map(|e| e.base.version).collect()
    }

    /// The logged patches from version `from` up to the newest, if `from` is a base in the log (the log is one
    /// contiguous chain of increasing versions, so the rest follows), with the checksum and stamp of the
    /// snapshot at `from`.
    fn chain(&self, from: u64) -> Option<(u64, Stamp, Vec<Parts<'_>>)> {
        let i = self.entries.iter().position(|e| e.base.version == from)?;
        let first = self.entries.get(i)?;
        Some((
            first.base_checksum,
            first.base,
            self.entries
                .iter()
                .skip(i)
                .map(|e| e.msgs.as_slice())
                .collect(),
        ))
    }
}

/// How a rejoining receiver caught up (metrics: `sync/catchup_kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CatchUpKind {
    #[default]
    Replay,
    Full,
}

impl CatchUpKind {
    pub fn name(self) -> &'static str {
        match self {
            CatchUpKind::Replay => "replay",
            CatchUpKind::Full => "full",
        }
    }
}

/// One catch-up, as the sender or the receiver saw it.
#[derive(Debug, Clone, Default)]
pub struct CatchUpReport {
    pub rank: usize,
    pub kind: CatchUpKind,
    /// The version the receiver held.
    pub from: u64,
    /// The version it holds now (0 for a deferred catch-up: it takes the next version with the others).
    pub to: u64,
    /// Patches replayed.
    pub patches: u32,
    /// Bytes of catch-up payloads (handshake, bootstrap-only keys, patches or buckets; headers included).
    pub payload_bytes: u64,
    /// Of those, bootstrap-only keys re-sent.
    pub boot_bytes: u64,
    /// Why not a replay (empty for a replay).
    pub reason: String,
    /// Bucket syncer: nothing of the current version was sent; the receiver takes the next version (a full
    /// transfer) with the others and holds no version of the sender's until then.
    pub deferred: bool,
    pub elapsed: Duration,
}

/// Where a bucket syncer's full catch-up of the last version comes from.
pub(super) enum BucketSource<'a> {
    /// The state is still exactly the last version (nothing trained since).
    State(&'a [Vec<Planned>]),
    /// The state moved on: the copy of the last version the sender keeps (`keep_last_version`), the bytes of
    /// each planned tensor bucket by bucket.
    Copy(&'a [Vec<Planned>], &'a [Vec<Vec<u8>>]),
}

/// What the sender keeps for rejoins (set at init).
pub(super) struct RejoinInfo {
    /// The receivers' metadata (every rank reported the same).
    pub meta: Vec<KeyMeta>,
    pub synced_ordinals: Vec<u32>,
    /// Bootstrap keys that are not synced, with their receiver ordinals (in state order).
    pub boot_only: Vec<(String, u32)>,
    pub init_bucket_size: u64,
    /// Checksum of the bootstrap-only keys as the init bootstrap sent them.
    pub boot_checksum: u64,
    pub log: ReplayLog,
    /// The checksum of the snapshot at a sequence, when computed for that sequence (patch syncer).
    pub checksum: std::sync::Mutex<Option<(u64, u64)>>,
    /// The snapshot's checksum at a sequence being computed on a background thread (patch syncer with a
    /// replay log): started once a version is sent, finished when the checksum is first needed, its thread
    /// joined before the snapshot is next written.
    pub hashing: std::sync::Mutex<Option<BackgroundSum>>,
    /// Threads of a snapshot checksum on the caller's path (the background one runs on one).
    pub threads: NonZeroUsize,
}

impl RejoinInfo {
    /// What the sender keeps for rejoins, set at init: the receivers' metadata, the synced ordinals, and the
    /// bootstrap-only keys with the checksum of what the init bootstrap sent of them.
    pub fn at_init(
        settings: &Settings,
        state: &StateDict,
        meta: Vec<KeyMeta>,
        selection: &Selection,
    ) -> Result<RejoinInfo, SyncError> {
        let boot_only: Vec<(String, u32)> = selection
            .boot_keys
            .iter()
            .filter(|k| !selection.synced_keys.contains(k))
            .filter_map(|k| selection.ordinals.get(k).map(|&o| (k.clone(), o)))
            .collect();
        let boot_typed: Vec<(String, DType)> = boot_only
            .iter()
            .map(|(k, o)| (k.clone(), meta[*o as usize].dtype))
            .collect();
        let boot_checksum = blocking(|| cast_checksum(state, &boot_typed))?;
        Ok(RejoinInfo {
            meta,
            synced_ordinals: selection.synced_ordinals.clone(),
            boot_only,
            init_bucket_size: settings.init_bucket_size,
            boot_checksum,
            log: ReplayLog::new(settings.replay_versions, settings.replay_max_bytes),
            checksum: std::sync::Mutex::new(None),
            hashing: std::sync::Mutex::new(None),
            threads: settings.threads,
        })
    }

    /// The cached checksum of the snapshot at sequence `sequence`, if that is the one cached.
    pub fn cached_checksum(&self, sequence: u64) -> Option<u64> {
        self.settle();
        let c = self.checksum.lock().unwrap_or_else(|p| p.into_inner());
        c.filter(|(s, _)| *s == sequence).map(|(_, c)| c)
    }

    /// Finish the background checksum, if one runs, and cache it: the thread is told to stop and the caller
    /// hashes what it has not, at its own priority, on the syncer's threads, without waiting for it (a nice-19
    /// thread on a busy host may not run for milliseconds).
    pub fn settle(&self) {
        let mut hashing = self.hashing.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(sum) = hashing.as_mut().filter(|s| !s.finished()) {
            let c = sum.finish(&self.meta, self.threads);
            self.cache_checksum(sum.sequence, c);
        }
    }

    /// [`RejoinInfo::settle`], then wait for the background thread to end: afterwards nothing else holds the
    /// snapshot (it may be written). The thread was told to stop when the checksum was settled, normally a
    /// training step before.
    pub fn release(&self) {
        self.settle();
        let sum = self
            .hashing
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(sum) = sum {
            sum.join();
        }
    }

    /// Start computing the checksum of `snap`, the snapshot at sequence `version`, on a background thread, so the
    /// next `sync` finds the base checksum its log entry needs without hashing the whole snapshot on its
    /// critical path (the trainer's next step overlaps it instead). Inline if no thread can be started.
    pub fn checksum_in_background(&self, version: u64, snap: &Arc<Vec<SnapTensor>>) {
        self.release();
        match BackgroundSum::start(version, snap, crate::tensor::parallel::lowest_priority) {
            Ok(sum) => *self.hashing.lock().unwrap_or_else(|p| p.into_inner()) = Some(sum),
            Err(_) => {
                self.cache_checksum(version, snapshot_checksum(snap, &self.meta, self.threads))
            }
        }
    }

    pub fn cache_checksum(&self, version: u64, checksum: u64) {
        *self.checksum.lock().unwrap_or_else(|p| p.into_inner()) = Some((version, checksum));
    }
}

/// Checksum of `keys` of `state` as a receiver holding them in `dtypes` would compute it.
pub(super) fn cast_checksum(state: &StateDict, keys: &[(String, DType)]) -> Result<u64, SyncError> {
    let mut h = StateHasher::new();
    for (key, rd) in keys {
        let t = state.get(key).ok_or_else(|| missing_key(key))?;
        h.begin_tensor(key, *rd, t.shape());
        hash_cast(&mut h, t.bytes(), t.dtype(), *rd, *rd);
    }
    Ok(h.finish())
}

/// Where a full catch-up's tensors come from.
pub(super) enum FullSource<'a> {
    /// Patch syncer: its snapshot (the last version sent, in the receivers' dtypes).
    Snapshot(&'a [SnapTensor]),
    /// Bucket syncer: the last version, from the state or the sender's copy; `None` when neither holds it.
    Buckets(Option<BucketSource<'a>>),
    /// Not over this channel ([`super::HostRejoin`]): the synced tensors reach the receiver another way (the
    /// same-host GPU channel), so the catch-up is deferred; the syncer's strategy, for the plan.
    Elsewhere(wire::Strategy),
}

/// The catch-up chosen for a rejoining receiver, and the payloads that carry it.
struct Choice<'a> {
    mode: CatchUpMode,
    /// The version the receiver holds afterwards (0 for a deferred catch-up) and the sequence it continues from.
    to: Stamp,
    /// Replay: the stamp of the held version the first replayed patch is based on.
    base_sequence: u64,
    payloads: Payloads<'a>,
    /// Why not a replay (empty for a replay).
    reason: String,
}

enum Payloads<'a> {
    /// Nothing: version 0 of a bucket syncer (every receiver's own initial state), or a deferred catch-up.
    None,
    /// The logged patches from the held version on (each as its parts), byte for byte as first sent.
    Replay(Vec<Parts<'a>>),
    /// The patch syncer's snapshot, in buckets.
    Snapshot {
        snap: &'a [SnapTensor],
        buckets: Vec<Vec<Planned>>,
    },
    /// The bucket syncer's last version.
    Buckets(BucketSource<'a>),
}

/// The sender's side of one rejoin: everything goes to `rank` only.
pub(super) struct Serving<'a> {
    pub ch: &'a mut transport::Sender,
    pub rank: usize,
    pub info: &'a RejoinInfo,
    pub state: &'a StateDict,
    pub last: Stamp,
    pub part_bytes: usize,
}

impl<'a> Serving<'a> {
    /// Serve the rejoin: the request, the plan, the receiver's checksums, then the catch-up it needs.
    pub async fn serve(mut self, source: FullSource<'a>) -> Result<CatchUpReport, SyncError> {
        let started = Instant::now();
        let mut report = CatchUpReport {
            rank: self.rank,
            ..CatchUpReport::default()
        };
        self.ch.wait_joined(self.rank).await?;
        report.from = self.request(&mut report).await?;
        let strategy = match source {
            FullSource::Snapshot(_) => wire::Strategy::Patch,
            FullSource::Buckets(_) => wire::Strategy::Bucket,
            FullSource::Elsewhere(strategy) => strategy,
        };
        self.send_plan(strategy, &mut report).await?;
        let held = self.held(report.from, &mut report).await?;
        let boot_buckets = self.boot_buckets(&held)?;
        let choice = match source {
            FullSource::Snapshot(snap) => choose_patch(self.info, snap, self.last, &held),
            FullSource::Buckets(source) => choose_buckets(source, self.last),
            FullSource::Elsewhere(_) => Choice {
                mode: CatchUpMode::Deferred,
                to: Stamp {
                    version: 0,
                    sequence: self.last.sequence,
                },
                base_sequence: 0,
                payloads: Payloads::None,
                reason: "the synced tensors reach it another way (the same-host GPU channel)"
                    .into(),
            },
        };
        let plan = CatchUpPlan {
            mode: choice.mode,
            to: choice.to,
            base_sequence: choice.base_sequence,
            boot_buckets: boot_buckets.len() as u32,
            patches: match &choice.payloads {
                Payloads::Replay(msgs) => msgs.len() as u32,
                _ => 0,
            },
            full_buckets: match &choice.payloads {
                Payloads::Snapshot { buckets, .. } => buckets.len() as u32,
                Payloads::Buckets(BucketSource::State(b) | BucketSource::Copy(b, _)) => {
                    b.len() as u32
                }
                Payloads::None | Payloads::Replay(_) => 0,
            },
        };
        let msg = wire::encode_catch_up(&plan);
        report.payload_bytes += msg.len() as u64;
        self.ch.send_to(self.rank, &msg).await?;
        if !boot_buckets.is_empty() {
            let stats = self
                .send_state_buckets(&boot_buckets, Kind::InitBucket, Stamp::default())
                .await?;
            report.boot_bytes = stats.payload_bytes;
            report.payload_bytes += stats.payload_bytes;
        }
        report.payload_bytes += self.send_payloads(choice.payloads).await?;
        report.kind = match plan.mode {
            CatchUpMode::Replay => CatchUpKind::Replay,
            CatchUpMode::Full | CatchUpMode::Deferred => CatchUpKind::Full,
        };
        report.to = plan.to.version;
        report.deferred = plan.mode == CatchUpMode::Deferred;
        report.patches = plan.patches;
        report.reason = choice.reason;
        report.elapsed = started.elapsed();
        Ok(report)
    }

    fn handshake(&self, reason: String) -> SyncError {
        SyncError::Handshake {
            reason: format!("rejoin of receiver rank {}: {reason}", self.rank),
        }
    }

    fn unreadable(&self, message: &str, source: wire::WireError) -> SyncError {
        SyncError::HandshakeMessage {
            message: format!("rejoin of receiver rank {}: {message}", self.rank),
            source: source.into(),
        }
    }

    /// Step 1: the receiver's metadata (which must be that of the receivers at init) and the version it holds.
    async fn request(&mut self, report: &mut CatchUpReport) -> Result<u64, SyncError> {
        let msg = self.ch.recv_from(self.rank).await?;
        report.payload_bytes += msg.len() as u64;
        let (held_version, meta) = Header::parse(&msg)
            .and_then(|(h, body)| {
                h.expect(Kind::Rejoin)?;
                Ok((h.version, wire::decode_metadata(body)?))
            })
            .map_err(|e| self.unreadable("its request", e))?;
        if meta != self.info.meta {
            let reason =
                "its keys, shapes or dtypes differ from those of the receivers at init".to_string();
            let _ = self
                .ch
                .send_to(self.rank, &wire::encode_abort(&reason))
                .await;
            return Err(self.handshake(reason));
        }
        Ok(held_version)
    }

    /// Step 2: the plan (synced keys and bootstrap-only keys).
    async fn send_plan(
        &mut self,
        strategy: wire::Strategy,
        report: &mut CatchUpReport,
    ) -> Result<(), SyncError> {
        let plan = wire::Plan {
            strategy,
            synced: self.info.synced_ordinals.clone(),
            init_buckets: 0,
        };
        let boot_ordinals: Vec<u32> = self.info.boot_only.iter().map(|(_, o)| *o).collect();
        let msg = wire::encode_rejoin_plan(&plan, &boot_ordinals);
        report.payload_bytes += msg.len() as u64;
        self.ch.send_to(self.rank, &msg).await?;
        Ok(())
    }

    /// Step 3: the receiver's checksums of what it holds (of the version it reported first).
    async fn held(
        &mut self,
        held_version: u64,
        report: &mut CatchUpReport,
    ) -> Result<Held, SyncError> {
        let msg = self.ch.recv_from(self.rank).await?;
        report.payload_bytes += msg.len() as u64;
        let held: Held = Header::parse(&msg)
            .and_then(|(h, body)| {
                h.expect(Kind::Held)?;
                wire::decode_held(&h, body)
            })
            .map_err(|e| self.unreadable("its checksums", e))?;
        if held.version != held_version {
            return Err(self.handshake(format!(
                "reported version {held_version}, then {}",
                held.version
            )));
        }
        Ok(held)
    }

    /// Step 4: the buckets of the bootstrap-only (frozen) keys, when the receiver's copy of them differs from
    /// the sender's.
    fn boot_buckets(&self, held: &Held) -> Result<Vec<Vec<Planned>>, SyncError> {
        let info = self.info;
        let boot_keys: Vec<(String, DType)> = info
            .boot_only
            .iter()
            .map(|(k, o)| (k.clone(), info.meta[*o as usize].dtype))
            .collect();
        let boot_now = if boot_keys.is_empty() {
            held.boot_only
        } else {
            blocking(|| cast_checksum(self.state, &boot_keys))?
        };
        if boot_now != info.boot_checksum {
            // Frozen keys are not synced, so the receivers that stayed still hold what the bootstrap sent; the
            // sender no longer has those values. The rejoining receiver gets the current ones: say so.
            tracing::warn!(
                rank = self.rank,
                "frozen (bootstrap-only) keys changed on the sender since the init bootstrap: the rejoining receiver gets their current values, the others keep the bootstrap's"
            );
        }
        if boot_now == held.boot_only {
            return Ok(Vec::new());
        }
        let refs: Vec<&str> = boot_keys.iter().map(|(k, _)| k.as_str()).collect();
        let ordinals = info
            .boot_only
            .iter()
            .map(|(k, o)| (k.clone(), *o))
            .collect();
        let items =
            super::bootstrap::plan_items(self.state, &refs, &info.meta, &ordinals, |_, r| r);
        Ok(bucket::plan(items, info.init_bucket_size))
    }

    /// Step 6: the replayed patches or the full transfer, after the catch-up plan; returns the bytes sent.
    async fn send_payloads(&mut self, payloads: Payloads<'_>) -> Result<u64, SyncError> {
        let (rank, last, part_bytes) = (self.rank, self.last, self.part_bytes);
        let stats = match payloads {
            Payloads::None => return Ok(0),
            Payloads::Replay(msgs) => {
                let mut bytes = 0;
                for msg in msgs.into_iter().flatten() {
                    self.ch.send_to(rank, msg).await?;
                    bytes += msg.len() as u64;
                }
                return Ok(bytes);
            }
            Payloads::Buckets(BucketSource::State(buckets)) => {
                self.send_state_buckets(buckets, Kind::Bucket, last).await?
            }
            Payloads::Buckets(BucketSource::Copy(buckets, copy)) => {
                let sources: Vec<Vec<&[u8]>> = copy
                    .iter()
                    .map(|b| b.iter().map(Vec::as_slice).collect())
                    .collect();
                bucket::send_sources(
                    self.ch,
                    Some(rank),
                    buckets,
                    &sources,
                    Kind::Bucket,
                    last,
                    part_bytes,
                )
                .await?
            }
            Payloads::Snapshot { snap, buckets } => {
                let by_key: std::collections::HashMap<&str, &[u8]> = snap
                    .iter()
                    .map(|t| (t.key.as_str(), t.storage.bytes()))
                    .collect();
                let sources: Vec<Vec<&[u8]>> = buckets
                    .iter()
                    .map(|b| {
                        b.iter()
                            .map(|p| by_key.get(p.key.as_str()).copied().unwrap_or_default())
                            .collect()
                    })
                    .collect();
                // Before the first version a receiver takes version 0 as init buckets (a bucket must be newer).
                let kind = if last.sequence == 0 {
                    Kind::InitBucket
                } else {
                    Kind::Bucket
                };
                bucket::send_sources(
                    self.ch,
                    Some(rank),
                    &buckets,
                    &sources,
                    kind,
                    last,
                    part_bytes,
                )
                .await?
            }
        };
        Ok(stats.payload_bytes)
    }

    /// Buckets of the state (cast as planned) of `kind` and `stamp` to the rejoining rank.
    async fn send_state_buckets(
        &mut self,
        buckets: &[Vec<Planned>],
        kind: Kind,
        stamp: Stamp,
    ) -> Result<bucket::SendStats, SyncError> {
        let mut sources = Vec::with_capacity(buckets.len());
        for b in buckets {
            let mut srcs = Vec::with_capacity(b.len());
            for p in b {
                let t = self.state.get(&p.key).ok_or_else(|| missing_key(&p.key))?;
                if t.dtype() != p.src {
                    return Err(SyncError::StateMismatch {
                        key: p.key.clone(),
                        reason: format!("now {}, {} at init", t.dtype(), p.src),
                    });
                }
                srcs.push(t.bytes());
            }
            sources.push(srcs);
        }
        bucket::send_sources(
            self.ch,
            Some(self.rank),
            buckets,
            &sources,
            kind,
            stamp,
            self.part_bytes,
        )
        .await
    }
}

/// Step 5, patch syncer: replay the logged patches from the held version when the receiver holds exactly that
/// version (its checksum says so) and the chain costs no more than the snapshot; else the snapshot in full.
fn choose_patch<'a>(
    info: &'a RejoinInfo,
    snap: &'a [SnapTensor],
    last: Stamp,
    held: &Held,
) -> Choice<'a> {
    let full_bytes: u64 = snap.iter().map(|t| t.storage.len() as u64).sum();
    let current = info.cached_checksum(last.sequence).unwrap_or_else(|| {
        let c = blocking(|| snapshot_checksum(snap, &info.meta, info.threads));
        info.cache_checksum(last.sequence, c);
        c
    });
    let chain = if held.version == last.version {
        Some((current, last, Vec::new()))
    } else {
        info.log.chain(held.version)
    };
    let reason = match chain {
        None if !info.log.is_enabled() => {
            "the replay log is off (weight_syncer.patch.replay_versions: 0)".to_owned()
        }
        None => {
            let bases = info.log.bases();
            match (bases.first(), bases.last()) {
                (Some(a), Some(b)) => format!(
                    "version {} is not in the replay log (it can replay from versions {a}..={b})",
                    held.version
                ),
                _ => format!("version {} is not in the (empty) replay log", held.version),
            }
        }
        Some((expected, _, _)) if expected != held.synced => format!(
            "its weights are not those of version {} (checksum {:#018x}, expected {expected:#018x})",
            held.version, held.synced
        ),
        Some((_, base, msgs)) => {
            let bytes: u64 = msgs
                .iter()
                .flat_map(|v| v.iter())
                .map(|m| m.len() as u64)
                .sum();
            if bytes <= full_bytes {
                return Choice {
                    mode: CatchUpMode::Replay,
                    to: last,
                    base_sequence: base.sequence,
                    payloads: Payloads::Replay(msgs),
                    reason: String::new(),
                };
            }
            format!(
                "replaying {} patches ({bytes} bytes) costs more than the full state ({full_bytes} bytes)",
                msgs.len()
            )
        }
    };
    let items = snap
        .iter()
        .map(|t| Planned {
            key: t.key.clone(),
            src: t.dtype,
            entry: wire::BucketEntry {
                ordinal: t.ordinal,
                dtype: t.dtype,
                byte_len: t.storage.len(),
            },
        })
        .collect();
    let mut buckets = bucket::plan(items, info.init_bucket_size);
    if buckets.is_empty() {
        buckets.push(Vec::new());
    }
    Choice {
        mode: CatchUpMode::Full,
        to: last,
        base_sequence: 0,
        payloads: Payloads::Snapshot { snap, buckets },
        reason,
    }
}

/// Step 5, bucket syncer: every version is a full transfer, so the last version in full when the state or the
/// sender's copy holds it, nothing at version 0, else deferred to the next version.
fn choose_buckets(source: Option<BucketSource<'_>>, last: Stamp) -> Choice<'_> {
    match source {
        _ if last.sequence == 0 => Choice {
            // Nothing was ever sent: it holds version 0 (its own initial weights) like the others.
            mode: CatchUpMode::Full,
            to: Stamp::default(),
            base_sequence: 0,
            payloads: Payloads::None,
            reason: "bucket syncer: version 0 is every receiver's own initial state".into(),
        },
        Some(source) => {
            let from = match &source {
                BucketSource::State(_) => "",
                BucketSource::Copy(..) => " (the last version, from the sender's copy)",
            };
            Choice {
                mode: CatchUpMode::Full,
                to: last,
                base_sequence: 0,
                reason: format!("bucket syncer: every version is a full transfer{from}"),
                payloads: Payloads::Buckets(source),
            }
        }
        None => Choice {
            mode: CatchUpMode::Deferred,
            // It holds none of the sender's versions, and takes the sync after the last one.
            to: Stamp {
                version: 0,
                sequence: last.sequence,
            },
            base_sequence: 0,
            payloads: Payloads::None,
            reason: "bucket syncer: the state moved on since the last version; the next version is a full transfer".into(),
        },
    }
}

/// The receiver's checksums of its synced and bootstrap-only keys.
pub(super) fn held(
    state: &StateDict,
    version: u64,
    synced: &[String],
    boot_only: &[String],
) -> Held {
    Held {
        version,
        synced: state_checksum(state, synced),
        boot_only: state_checksum(state, boot_only),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_background_checksum_is_settled_to_the_snapshots_and_released_before_the_snapshot_is_written()
     {
        let (snap, meta) = super::super::snapshot_sum::test_snapshot();
        let whole = snapshot_checksum(&snap, &meta, NonZeroUsize::MIN);
        let info = RejoinInfo {
            meta,
            synced_ordinals: vec![],
            boot_only: vec![],
            init_bucket_size: 0,
            boot_checksum: 0,
            log: ReplayLog::new(0, 0),
            checksum: std::sync::Mutex::new(None),
            hashing: std::sync::Mutex::new(None),
            threads: NonZeroUsize::new(2).unwrap(),
        };
        for version in 1..4 {
            info.checksum_in_background(version, &snap);
            assert_eq!(info.cached_checksum(version), Some(whole));
            info.settle();
            assert_eq!(info.cached_checksum(version), Some(whole));
            info.release();
            assert_eq!(Arc::strong_count(&snap), 1, "no thread holds the snapshot");
        }
    }

    fn msg(n: usize) -> Vec<Vec<u8>> {
        vec![vec![7; n]]
    }

    /// Version `v` sent as the `v`th sync.
    fn st(v: u64) -> Stamp {
        Stamp {
            version: v,
            sequence: v,
        }
    }

    #[test]
    fn the_log_keeps_the_newest_versions_within_its_caps() {
        let mut log = ReplayLog::new(3, 1000);
        for v in 1..=5u64 {
            log.push(st(v - 1), st(v), v * 10, msg(100));
        }
        assert_eq!(log.bases(), vec![2, 3, 4]);
        assert_eq!(log.bytes(), 300);
        assert!(log.chain(1).is_none(), "evicted");
        let (checksum, base, msgs) = log.chain(3).unwrap();
        // Each entry carries the checksum of its base (the test pushes version × 10 for base version - 1).
        assert_eq!((checksum, base, msgs.len()), (40, st(3), 2));
        // The byte cap evicts too.
        log.push(st(5), st(6), 60, msg(800));
        assert_eq!(log.bases(), vec![3, 4, 5]);
        assert_eq!(log.bytes(), 1000);
        log.push(st(6), st(7), 70, msg(150));
        assert_eq!(log.bases(), vec![5, 6]);
        assert_eq!(log.bytes(), 950);
        // A patch larger than the cap empties the log: no chain can cross it.
        log.push(st(7), st(8), 80, msg(1001));
        assert!(log.bases().is_empty());
        assert_eq!(log.bytes(), 0);
        // A base that does not continue the newest version starts the log anew.
        log.push(st(7), st(8), 80, msg(10));
        log.push(st(9), st(10), 90, msg(10));
        assert_eq!(log.bases(), vec![9]);
    }

    /// A caller that repeats or lowers versions (RLinf: the same version again for an evaluation) ends the chain:
    /// a held version names at most one base in the log, and the sequence it continues from comes with it.
    #[test]
    fn a_version_not_newer_than_its_base_ends_the_chain() {
        let stamp = |version, sequence| Stamp { version, sequence };
        let mut log = ReplayLog::new(8, 1000);
        log.push(stamp(0, 0), stamp(1, 1), 1, msg(10));
        log.push(stamp(1, 1), stamp(2, 2), 2, msg(10));
        assert_eq!(log.bases(), vec![0, 1]);
        // Version 2 again (sequence 3): not logged, and the chain before it is gone.
        log.push(stamp(2, 2), stamp(2, 3), 3, msg(10));
        assert!(log.bases().is_empty());
        assert!(log.chain(1).is_none());
        // An older version (1 at sequence 4) neither.
        log.push(stamp(2, 3), stamp(1, 4), 4, msg(10));
        assert!(log.bases().is_empty());
        // From there on versions increase again and the log chains by sequence.
        log.push(stamp(1, 4), stamp(5, 5), 5, msg(10));
        log.push(stamp(5, 5), stamp(6, 6), 6, msg(10));
        assert_eq!(log.bases(), vec![1, 5]);
        let (checksum, base, msgs) = log.chain(1).unwrap();
        assert_eq!((checksum, base, msgs.len()), (5, stamp(1, 4), 2));
        // A base that is the right version at another sequence does not continue the chain.
        log.push(stamp(6, 9), stamp(7, 10), 7, msg(10));
        assert_eq!(log.bases(), vec![6]);
    }

    #[test]
    fn a_disabled_log_holds_nothing() {
        for (versions, bytes) in [(0, 1000), (4, 0)] {
            let mut log = ReplayLog::new(versions, bytes);
            log.push(st(0), st(1), 1, msg(10));
            assert!(!log.is_enabled());
            assert!(log.bases().is_empty());
        }
    }

    /// A bucket syncer's rejoin: nothing at version 0, the last version in full from the state or the copy,
    /// else deferred to the next version.
    #[test]
    fn a_bucket_catch_up_sends_the_last_version_when_something_holds_it() {
        let buckets: Vec<Vec<Planned>> = vec![Vec::new(), Vec::new()];
        let copy: Vec<Vec<Vec<u8>>> = vec![Vec::new(), Vec::new()];
        let summary = |c: Choice<'_>| {
            let payload = match c.payloads {
                Payloads::None => "none",
                Payloads::Buckets(BucketSource::State(_)) => "state",
                Payloads::Buckets(BucketSource::Copy(..)) => "copy",
                Payloads::Replay(_) | Payloads::Snapshot { .. } => "patch",
            };
            (c.mode, c.to.version, payload, c.reason)
        };
        let (mode, version, payload, reason) =
            summary(choose_buckets(Some(BucketSource::State(&buckets)), st(0)));
        assert_eq!((mode, version, payload), (CatchUpMode::Full, 0, "none"));
        assert!(reason.contains("version 0"), "{reason}");
        let (mode, version, payload, _) =
            summary(choose_buckets(Some(BucketSource::State(&buckets)), st(3)));
        assert_eq!((mode, version, payload), (CatchUpMode::Full, 3, "state"));
        let (mode, version, payload, reason) = summary(choose_buckets(
            Some(BucketSource::Copy(&buckets, &copy)),
            st(3),
        ));
        assert_eq!((mode, version, payload), (CatchUpMode::Full, 3, "copy"));
        assert!(reason.contains("sender's copy"), "{reason}");
        let (mode, version, payload, reason) = summary(choose_buckets(None, st(3)));
        assert_eq!((mode, version, payload), (CatchUpMode::Deferred, 0, "none"));
        assert!(reason.contains("moved on"), "{reason}");
    }

    #[test]
    fn catch_up_kinds_have_metric_names() {
        assert_eq!(CatchUpKind::Replay.name(), "replay");
        assert_eq!(CatchUpKind::Full.name(), "full");
    }
}
