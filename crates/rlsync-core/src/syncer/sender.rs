//! The sending end [`SyncSender`] (the trainer's): the handshake and init bootstrap that make it
//! ([`WeightSyncer::init_sender`]), one version per `sync` (patch or buckets), a rejoining receiver's catch-up
//! (`rejoin`), and `flush`. A bucket sender may also skip the handshake ([`WeightSyncer::init_sender_described`],
//! RLinf's bucket syncer): then every version starts with a manifest that describes it (see `syncer/wire.rs`).

use std::collections::HashMap;

use super::bootstrap::{Refusal, Selection};
use super::*;

/// The sending end of a weight channel (the trainer's), made by [`WeightSyncer::init_sender`].
pub struct SyncSender {
    pub(super) settings: Settings,
    pub(super) ch: transport::Sender,
    /// The synced keys, in the state dict's order.
    synced_keys: Vec<String>,
    /// Receiver dtype per synced key (same order).
    recv_dtypes: Vec<DType>,
    /// The caller's version and the sequence number of the last sync (both 0 before the first).
    last: Stamp,
    strategy: SenderStrategy,
    pub(super) rejoin: rejoin::RejoinInfo,
    /// What receivers reported ([`SyncReceiver::set_reports`]), read by [`SyncSender::poll_reports`].
    reports: Reports,
}

/// Receivers' reports as the sender read them: per rank the version it installed last, and how many
/// updates it declined (the last one's stamp and reason).
#[derive(Debug, Default)]
struct Reports {
    applied: std::collections::BTreeMap<usize, Stamp>,
    declined: std::collections::BTreeMap<usize, u64>,
    last_declined: Option<Declined>,
}

/// The last update a receiver declined ([`SyncReceiver::decline`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Declined {
    pub rank: usize,
    pub version: u64,
    pub sequence: u64,
    pub reason: String,
}

/// What the sender keeps between versions: the patch syncer's snapshot, or the bucket syncer's plan.
enum SenderStrategy {
    Patch(PatchSender),
    Bucket(BucketSender),
}

struct PatchSender {
    /// Shared only with a background checksum of it (see [`rejoin::RejoinInfo::checksum_in_background`]).
    snap: Arc<Vec<SnapTensor>>,
    /// One build per part of a version (see [`patch::part_ranges`]), its buffers reused from sync to sync.
    built: Vec<patch::Built>,
    /// A device backend's build (CUDA tensors), in place of `patch::build`.
    builder: Option<Box<dyn PatchBuilder>>,
}

struct BucketSender {
    buckets: Vec<Vec<Planned>>,
    /// Self-describing (no handshake): the keys every version's manifest lists, in bucket ordinal order.
    manifest: Option<Vec<wire::ManifestKey>>,
    /// With `keep_last`: the bytes of every planned tensor (sender dtype) as the last `sync` sent them, bucket
    /// by bucket; empty before the first sync or without `keep_last`.
    last: Vec<Vec<Vec<u8>>>,
    /// A device backend's staging (`bucket_device: cuda`, CUDA tensors), in place of the host fill's reads.
    stager: Option<Box<dyn BucketStager>>,
}

impl WeightSyncer {
    /// Sender side of the handshake (+ init bootstrap for patch), which makes this syncer the sending end.
    /// `keys_to_sync` are the keys every later `sync` covers (typically `state.synced_keys()`: trainable
    /// parameters and persistent buffers).
    pub async fn init_sender(
        mut self,
        state: &StateDict,
        keys_to_sync: &[String],
        mut ch: transport::Sender,
    ) -> Result<(SyncSender, SyncReport), SyncError> {
        self.fit_threads(state);
        let settings = self.settings;
        let meta = gather_metadata(&mut ch).await?;
        let selection = match Selection::choose(&settings, &meta, state, keys_to_sync) {
            Ok(selection) => selection,
            Err(refusal) => {
                abort(&mut ch, refusal.reason()).await;
                return Err(refusal.into());
            }
        };
        let mut report =
            send_plan_and_bootstrap(&mut ch, &settings, state, &meta, &selection).await?;
        let t_build = Instant::now();
        let strategy = SenderStrategy::new(&settings, state, &meta, &selection)?;
        report.build = t_build.elapsed();
        report.state_bytes = selection
            .synced_ordinals
            .iter()
            .zip(&selection.synced_keys)
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
        let rejoin = rejoin::RejoinInfo::at_init(&settings, state, meta, &selection)?;
        let sender = SyncSender {
            settings,
            ch,
            synced_keys: selection.synced_keys,
            recv_dtypes: selection.recv_dtypes,
            last: Stamp::default(),
            strategy,
            rejoin,
            reports: Reports::default(),
        };
        if let SenderStrategy::Patch(p) = &sender.strategy
            && sender.rejoin.log.is_enabled()
        {
            sender.rejoin.checksum_in_background(0, &p.snap);
        }
        Ok((sender, report))
    }
}

impl WeightSyncer {
    /// A bucket sender without a handshake (RLinf's bucket syncer: its `init_sender` needs no `recv`): nothing
    /// is exchanged now; every `sync` sends a manifest first (names, shapes, wire and target dtypes of the synced
    /// keys, checksummed like every message), so receivers made by [`WeightSyncer::init_receiver_described`] map
    /// the buckets by name. `keys_to_sync` must all be in `state` (a missing or repeated key is an error naming
    /// it). The first `sync` carries sequence `after + 1`: a sender made again for receivers that took sequences
    /// up to `after` continues where its predecessor stopped. Patch syncers need the handshake
    /// ([`SyncError::Config`]).
    pub async fn init_sender_described(
        mut self,
        state: &StateDict,
        keys_to_sync: &[String],
        ch: transport::Sender,
        after: u64,
    ) -> Result<(SyncSender, SyncReport), SyncError> {
        self.fit_threads(state);
        let mut settings = self.settings;
        if settings.kind != SyncerKind::Bucket {
            return Err(SyncError::Config {
                reason: "only the bucket syncer can run without a handshake (the patch syncer needs the receivers' metadata)".into(),
            });
        }
        // The sender describes itself: its own keys stand in for a receiver's metadata, so the manifest's
        // order is the bucket ordinals' order.
        let mut meta = Vec::with_capacity(keys_to_sync.len());
        for (i, key) in keys_to_sync.iter().enumerate() {
            if keys_to_sync[..i].contains(key) {
                return Err(SyncError::StateMismatch {
                    key: key.clone(),
                    reason: "listed twice in the keys to sync".into(),
                });
            }
            let t = state.get(key).ok_or_else(|| missing_key(key))?;
            meta.push(KeyMeta {
                name: key.clone(),
                dtype: t.dtype(),
                shape: t.shape().to_vec(),
            });
        }
        settings.same_keys = false;
        let selection = Selection::choose(&settings, &meta, state, keys_to_sync)?;
        let t_build = Instant::now();
        let mut strategy = SenderStrategy::new(&settings, state, &meta, &selection)?;
        if let SenderStrategy::Bucket(b) = &mut strategy {
            let mut wire_dtypes: HashMap<u32, DType> = HashMap::new();
            for p in b.buckets.iter().flatten() {
                wire_dtypes.insert(p.entry.ordinal, p.entry.dtype);
            }
            b.manifest = Some(
                meta.iter()
                    .enumerate()
                    .map(|(o, m)| wire::ManifestKey {
                        name: m.name.clone(),
                        wire: wire_dtypes.get(&(o as u32)).copied().unwrap_or(m.dtype),
                        target: m.dtype,
                        shape: m.shape.clone(),
                    })
                    .collect(),
            );
        }
        let report = SyncReport {
            kind: SyncKind::Init,
            build: t_build.elapsed(),
            compression_ratio: 1.0,
            state_bytes: meta
                .iter()
                .map(|m| (m.shape.iter().product::<usize>() * m.dtype.size_bytes()) as u64)
                .sum(),
            ..Default::default()
        };
        let rejoin = rejoin::RejoinInfo::at_init(&settings, state, meta, &selection)?;
        let sender = SyncSender {
            settings,
            ch,
            synced_keys: selection.synced_keys,
            recv_dtypes: selection.recv_dtypes,
            last: Stamp {
                version: 0,
                sequence: after,
            },
            strategy,
            rejoin,
            reports: Reports::default(),
        };
        Ok((sender, report))
    }
}

/// Handshake step 1: every receiver's metadata, which must all agree (a receiver that went away from an
/// elastic channel is skipped: its successor rejoins).
async fn gather_metadata(ch: &mut transport::Sender) -> Result<Vec<KeyMeta>, SyncError> {
    let mut meta: Option<Vec<KeyMeta>> = None;
    for rank in 0..ch.receivers() {
        let msg = match ch.recv_from(rank).await {
            Ok(msg) => msg,
            // Elastic: a receiver that died during the bootstrap is detached; its successor rejoins.
            Err(TransportError::PeerGone { .. }) if ch.is_elastic() => {
                tracing::warn!(
                    rank,
                    "receiver went away during the bootstrap; it may rejoin"
                );
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        let m = Header::parse(&msg)
            .and_then(|(h, body)| {
                h.expect(Kind::Metadata)
                    .and_then(|_| wire::decode_metadata(body))
            })
            .map_err(|e| SyncError::HandshakeMessage {
                message: format!("metadata from receiver rank {rank}"),
                source: e.into(),
            })?;
        match &meta {
            Some(first) if *first != m => {
                let reason = format!(
                    "receiver rank {rank} reports different keys/shapes/dtypes than rank 0"
                );
                abort(ch, &reason).await;
                return Err(SyncError::Handshake { reason });
            }
            Some(_) => {}
            None => meta = Some(m),
        }
    }
    match meta {
        Some(meta) => Ok(meta),
        None if ch.receivers() == 0 => Ok(Vec::new()),
        None => Err(SyncError::Handshake {
            reason: "every receiver went away before sending its metadata".into(),
        }),
    }
}

/// Handshake step 3: the plan, then (patch with `init_sync`) the init bootstrap's buckets.
async fn send_plan_and_bootstrap(
    ch: &mut transport::Sender,
    settings: &Settings,
    state: &StateDict,
    meta: &[KeyMeta],
    selection: &Selection,
) -> Result<SyncReport, SyncError> {
    let boot_refs: Vec<&str> = selection.boot_keys.iter().map(String::as_str).collect();
    let boot_items = bootstrap::plan_items(state, &boot_refs, meta, &selection.ordinals, |_, r| r);
    let boot_buckets = bucket::plan(boot_items, settings.init_bucket_size);
    let plan = Plan {
        strategy: settings.strategy(),
        synced: selection.synced_ordinals.clone(),
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
        let stats = bucket::send(
            ch,
            state,
            &boot_buckets,
            Kind::InitBucket,
            Stamp::default(),
            settings.part_bytes,
        )
        .await?;
        report.payload_bytes = stats.payload_bytes;
        report.encode = stats.fill;
        report.changed = elements(&boot_buckets);
        report.tensors = boot_buckets.iter().map(Vec::len).sum();
    }
    Ok(report)
}

/// Elements carried by `buckets`.
fn elements(buckets: &[Vec<Planned>]) -> u64 {
    buckets
        .iter()
        .flatten()
        .map(|p| (p.entry.byte_len / p.entry.dtype.size_bytes()) as u64)
        .sum()
}

impl SenderStrategy {
    /// Handshake step 4: the patch syncer's snapshot of the synced keys (in the receivers' dtypes), or the
    /// bucket syncer's plan of them.
    fn new(
        settings: &Settings,
        state: &StateDict,
        meta: &[KeyMeta],
        selection: &Selection,
    ) -> Result<SenderStrategy, SyncError> {
        let keys = &selection.synced_keys;
        match settings.kind {
            SyncerKind::Patch => {
                let mut snap = Vec::with_capacity(keys.len());
                for ((key, &o), &rd) in keys
                    .iter()
                    .zip(&selection.synced_ordinals)
                    .zip(&selection.recv_dtypes)
                {
                    let t = state.get(key).ok_or_else(|| missing_key(key))?;
                    let mut storage = Storage::zeroed(t.numel() * rd.size_bytes());
                    blocking(|| cast_bytes(t.bytes(), t.dtype(), storage.bytes_mut(), rd))
                        .map_err(|source| SyncError::StateCast {
                            key: key.clone(),
                            source,
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
                Ok(SenderStrategy::Patch(PatchSender {
                    snap: Arc::new(snap),
                    built: Vec::new(),
                    builder: None,
                }))
            }
            SyncerKind::Bucket => {
                let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
                let bucket_dtype = settings.bucket_dtype;
                let items =
                    bootstrap::plan_items(state, &refs, meta, &selection.ordinals, |src, _| {
                        match bucket_dtype {
                            Some(d) if src.is_floating() => d,
                            _ => src,
                        }
                    });
                let mut buckets = bucket::plan(items, settings.bucket_size);
                if buckets.is_empty() {
                    // Nothing selected: one empty bucket per version still carries the version.
                    buckets.push(Vec::new());
                }
                Ok(SenderStrategy::Bucket(BucketSender {
                    buckets,
                    manifest: None,
                    last: Vec::new(),
                    stager: None,
                }))
            }
        }
    }
}

impl SyncSender {
    /// Send the synced keys of `state` as the caller's version `version`: any number (the same again, a jump),
    /// unless [`WeightSyncer::require_increasing_versions`] asked for strictly increasing ones. The payload
    /// carries the next sequence number, which is what orders it at the receivers.
    pub async fn sync(&mut self, state: &StateDict, version: u64) -> Result<SyncReport, SyncError> {
        if self.settings.increasing_versions && version <= self.last.version {
            return Err(SyncError::VersionNotNewer {
                version,
                last: self.last.version,
            });
        }
        let base = self.last;
        let next = Stamp {
            version,
            sequence: base.sequence + 1,
        };
        let (ch, settings) = (&mut self.ch, &self.settings);
        let mut report = match &mut self.strategy {
            SenderStrategy::Patch(p) => {
                // Wait for a free slot before the snapshot changes: a timeout here leaves everything as it was.
                ch.ready().await?;
                match p
                    .sync(ch, settings, &mut self.rejoin, base, state, next)
                    .await
                {
                    Ok(report) => report,
                    Err(e) => {
                        // Sending failed after the snapshot took `next`: later patches build on it, so
                        // receivers that missed this one reject them instead of silently missing its changes.
                        // (A state dict that does not fit fails before anything changes.)
                        if matches!(e, SyncError::Transport(_)) {
                            self.last.sequence = next.sequence;
                        }
                        return Err(e);
                    }
                }
            }
            SenderStrategy::Bucket(b) => {
                let mut report = match b.sync(ch, settings, state, next).await {
                    Ok(report) => report,
                    Err(e) => {
                        // Sending failed midway: some receivers may hold part (or all) of it, so its
                        // sequence is spent. (A state dict that does not fit fails before anything is sent.)
                        if matches!(e, SyncError::Transport(_)) {
                            self.last.sequence = next.sequence;
                        }
                        return Err(e);
                    }
                };
                report.state_bytes = self
                    .synced_keys
                    .iter()
                    .zip(&self.recv_dtypes)
                    .map(|(k, d)| state.get(k).map_or(0, |t| t.numel() * d.size_bytes()) as u64)
                    .sum();
                report
            }
        };
        self.last = next;
        report.version = version;
        Ok(report)
    }

    /// Catch up receiver `rank`, which joined the (elastic) channel late and called
    /// [`WeightSyncer::rejoin_receiver`]: replay of logged patches when sound, else a full transfer (see
    /// `syncer/rejoin.rs`). Only that receiver sees these messages. Waits (bounded by the channel's timeout)
    /// for the receiver to join.
    pub async fn rejoin(
        &mut self,
        state: &StateDict,
        rank: usize,
    ) -> Result<CatchUpReport, SyncError> {
        self.rejoin_at(state, rank, false).await
    }

    /// [`SyncSender::rejoin`], where the caller says whether `state` is still exactly the last version sent
    /// (nothing trained since): the bucket syncer, which keeps no copy of it, then sends `state` as that version
    /// instead of deferring the receiver to the next one.
    pub async fn rejoin_at(
        &mut self,
        state: &StateDict,
        rank: usize,
        state_is_last: bool,
    ) -> Result<CatchUpReport, SyncError> {
        let source = match &self.strategy {
            SenderStrategy::Patch(p) => {
                self.rejoin.settle();
                rejoin::FullSource::Snapshot(p.snap.as_slice())
            }
            SenderStrategy::Bucket(BucketSender { buckets, last, .. }) => {
                rejoin::FullSource::Buckets(if state_is_last {
                    Some(rejoin::BucketSource::State(buckets.as_slice()))
                } else if !last.is_empty() {
                    Some(rejoin::BucketSource::Copy(
                        buckets.as_slice(),
                        last.as_slice(),
                    ))
                } else {
                    None
                })
            }
        };
        rejoin::Serving {
            ch: &mut self.ch,
            rank,
            info: &self.rejoin,
            state,
            last: self.last,
            part_bytes: self.settings.part_bytes,
        }
        .serve(source)
        .await
    }

    /// Keep only what the rejoins of a run need when every version after the init bootstrap travels another
    /// way (the same-host GPU channel): the host channel, for the handshakes and frozen keys of restarted
    /// receivers ([`HostRejoin::serve`]). The snapshot, the replay log and any plan are freed.
    pub fn into_host_rejoin(self) -> HostRejoin {
        self.rejoin.release();
        let strategy = match self.strategy {
            SenderStrategy::Patch(_) => Strategy::Patch,
            SenderStrategy::Bucket(_) => Strategy::Bucket,
        };
        let mut rejoin = self.rejoin;
        rejoin.log = ReplayLog::new(0, 0);
        HostRejoin {
            settings: self.settings,
            ch: self.ch,
            rejoin,
            last: self.last,
            strategy,
        }
    }

    /// Build patches with `builder` (a device backend's) instead of the host diff; `false` (and nothing set)
    /// on a bucket sender.
    pub fn set_patch_builder(&mut self, builder: Box<dyn PatchBuilder>) -> bool {
        match &mut self.strategy {
            SenderStrategy::Patch(p) => {
                p.builder = Some(builder);
                true
            }
            SenderStrategy::Bucket(_) => false,
        }
    }

    /// Pack buckets with `stager` (a device backend's, `bucket_device: cuda`) instead of reading the tensors
    /// on the host; `false` (and nothing set) on a patch sender.
    pub fn set_bucket_stager(&mut self, stager: Box<dyn BucketStager>) -> bool {
        match &mut self.strategy {
            SenderStrategy::Bucket(b) => {
                b.stager = Some(stager);
                true
            }
            SenderStrategy::Patch(_) => false,
        }
    }

    /// The receivers' dtype of each synced key (the snapshot's), in [`SyncSender::synced_keys`] order.
    pub fn synced_dtypes(&self) -> &[DType] {
        &self.recv_dtypes
    }

    /// Whether the next sync may read the state dict's host view beyond dtypes and sizes (a binding or a
    /// worker keeps its host copies of CUDA tensors fresh when it does): `false` for a patch sender whose
    /// builder diffs on the device (a rejoin replays from the snapshot and reads only the bootstrap-only keys
    /// of the state, which training leaves as they are), and for a bucket sender whose stager packs the
    /// buckets from the device, that keeps no copy of the last version and whose channel nobody joins late (a
    /// bucket rejoin sends the state from the host view).
    pub fn needs_host_view(&self) -> bool {
        match &self.strategy {
            SenderStrategy::Bucket(b) => {
                b.stager.is_none() || self.settings.keep_last || self.ch.is_elastic()
            }
            SenderStrategy::Patch(p) => p.builder.is_none(),
        }
    }

    /// Whether [`SyncSender::checksum`] reads the state dict's host view: a bucket sender's does (it keeps no
    /// snapshot); a patch sender's is of its snapshot.
    pub fn checksum_reads_state(&self) -> bool {
        matches!(self.strategy, SenderStrategy::Bucket(_))
    }

    /// The keys whose [`state_checksum`] of `state` is [`SyncSender::checksum`]:
    /// a bucket sender's whose values keep their dtype on the way (no `bucket_dtype` cast, receivers in the
    /// sender's dtypes), so a workload may hash its weights where they live instead. `None` for a patch
    /// sender (its checksum is of its snapshot, no read of `state`) and for casts.
    pub fn checksum_as_state(&self, state: &StateDict) -> Option<&[String]> {
        let SenderStrategy::Bucket(_) = self.strategy else {
            return None;
        };
        let same = self
            .synced_keys
            .iter()
            .zip(&self.recv_dtypes)
            .all(|(key, &rd)| {
                state
                    .get(key)
                    .is_some_and(|t| self.wire_dtype(t.dtype(), rd) == t.dtype() && rd == t.dtype())
            });
        same.then_some(self.synced_keys.as_slice())
    }

    /// The dtype a bucket sender's tensor of `dtype` reached the receivers in, which hold it as `rd`:
    /// `bucket_dtype` for a floating tensor once a version was sent; before that (the bucket syncer has no
    /// init bootstrap: the receivers hold the weights they loaded themselves, expected equal to the state as
    /// cast to their dtypes) nothing crossed the wire, so `rd`.
    fn wire_dtype(&self, dtype: DType, rd: DType) -> DType {
        match self.settings.bucket_dtype {
            _ if self.last.sequence == 0 => rd,
            Some(d) if dtype.is_floating() => d,
            _ => dtype,
        }
    }

    /// `weight_syncer.bucket.bucket_device`: where a device backend should stage buckets.
    pub fn bucket_device(&self) -> settings::Device {
        self.settings.bucket_device
    }

    /// `weight_syncer.patch.snapshot_device`: where a device backend should keep the snapshot.
    pub fn snapshot_device(&self) -> settings::Device {
        self.settings.snapshot_device
    }

    /// The caller's version of the last sync (0 before the first).
    pub fn version(&self) -> u64 {
        self.last.version
    }

    /// The sequence number of the last sync (0 before the first; one more per `sync`).
    pub fn sequence(&self) -> u64 {
        self.last.sequence
    }

    /// The synced keys, in sync order.
    pub fn synced_keys(&self) -> &[String] {
        &self.synced_keys
    }

    /// The threads its kernels run on: the caller's `SyncOptions::threads`, fewer for a small state.
    pub fn threads(&self) -> NonZeroUsize {
        self.settings.threads
    }

    pub fn kind(&self) -> SyncerKind {
        self.settings.kind
    }

    /// Bytes held by the replay log.
    pub fn replay_log_bytes(&self) -> u64 {
        self.rejoin.log.bytes()
    }

    /// Receiver ranks attached to the channel as of the last operation that read its events (a sync, a
    /// rejoin, [`SyncSender::ranks_gone`]): the channel learns of deaths and joiners only when it reads them.
    pub fn live_receivers(&self) -> Vec<usize> {
        self.ch.live()
    }

    /// Receiver ranks that are away now: gone with no successor admitted, or whose successor joined but was
    /// not caught up yet (its rejoin pending: a receiver that also connects elsewhere after it, the GPU
    /// channel's, does not before). An elastic channel's events are read without waiting.
    pub fn ranks_gone(&mut self) -> Result<Vec<usize>, SyncError> {
        // Reading the joiners takes the channel's events (deaths included) first.
        let joined = self.ch.joined_ranks()?;
        let live = self.ch.live();
        Ok((0..self.ch.receivers())
            .filter(|r| !live.contains(r) || joined.contains(r))
            .collect())
    }

    /// Wait until every receiver has released every published payload.
    pub async fn flush(&mut self) -> Result<(), SyncError> {
        Ok(self.ch.flush().await?)
    }

    /// Bound every wait of the calls that follow by `now + bound` as well as by the channel's own timeout
    /// (`None`: the channel's timeout only); a call that runs out returns `SyncError::Transport(Timeout)`
    /// naming the receivers it waited on. A `sync` that runs out before its payload went out changes nothing
    /// (the patch sender waits for a free slot before it touches its snapshot); one that runs out later
    /// counts as sent (receivers that missed a patch reject the patches after it, as after any lost payload).
    pub fn set_bound(&mut self, bound: Option<Duration>) {
        self.ch.set_bound(bound);
    }

    /// Catch up every receiver that joined the (elastic) channel since the last call and asked to rejoin
    /// ([`WeightSyncer::rejoin_receiver`]), as [`SyncSender::rejoin`] does for one; call it before a `sync`
    /// (the Python API does at every `sync` on rlsync's channel). A catch-up that fails (the joiner went away
    /// again) is logged and skipped: the joiner sees its own error. Returns what each one got.
    pub async fn rejoin_joined(
        &mut self,
        state: &StateDict,
    ) -> Result<Vec<CatchUpReport>, SyncError> {
        let mut done = Vec::new();
        for rank in self.ch.joined_ranks()? {
            match self.rejoin(state, rank).await {
                Ok(report) => done.push(report),
                Err(e) => {
                    tracing::warn!(rank, error = %crate::error_chain(&e), "a late receiver's catch-up failed");
                }
            }
        }
        Ok(done)
    }

    /// Read the reports receivers sent so far ([`SyncReceiver::set_reports`]) without waiting. Only the
    /// reports are taken: a rejoining receiver's messages stay queued for [`SyncSender::rejoin`].
    pub fn poll_reports(&mut self) -> Result<(), SyncError> {
        for rank in self.ch.live() {
            while let Some(msg) = self.ch.try_recv_from(rank, &is_report)? {
                self.take_report(rank, &msg)?;
            }
        }
        Ok(())
    }

    /// The version (and sequence) each live receiver reported installed last, by rank (read so far: call
    /// [`SyncSender::poll_reports`] first); a receiver that went away is left out.
    pub fn acked(&self) -> Vec<(usize, Stamp)> {
        let live = self.ch.live();
        self.reports
            .applied
            .iter()
            .filter(|(rank, _)| live.contains(rank))
            .map(|(&rank, &stamp)| (rank, stamp))
            .collect()
    }

    /// How many updates each receiver declined ([`SyncReceiver::decline`]), by rank, and the last one.
    pub fn declined(&self) -> (Vec<(usize, u64)>, Option<&Declined>) {
        (
            self.reports
                .declined
                .iter()
                .map(|(&r, &n)| (r, n))
                .collect(),
            self.reports.last_declined.as_ref(),
        )
    }

    /// Wait until every live receiver reported installing the last sync (bounded by the channel's timeout
    /// and [`SyncSender::set_bound`]: `Timeout` naming the ranks still missing). A receiver that declined it
    /// is an error naming it; on an elastic channel a receiver that goes away is no longer waited for, on
    /// another one it is an error naming it at once (`PeerGone`).
    pub async fn wait_applied(&mut self) -> Result<(), SyncError> {
        let target = self.last;
        loop {
            self.poll_reports()?;
            if let Some(d) = &self.reports.last_declined
                && d.sequence == target.sequence
            {
                return Err(SyncError::Declined {
                    rank: d.rank,
                    version: d.version,
                    reason: d.reason.clone(),
                });
            }
            let missing: Vec<usize> = self
                .ch
                .live()
                .into_iter()
                .filter(|r| {
                    self.reports
                        .applied
                        .get(r)
                        .is_none_or(|s| s.sequence < target.sequence)
                })
                .collect();
            if missing.is_empty() {
                return Ok(());
            }
            match self.ch.wait_any_from(&missing).await {
                Ok(()) => {}
                Err(TransportError::PeerGone { .. }) if self.ch.is_elastic() => {}
                Err(e) => return Err(e.into()),
            }
        }
    }

    fn take_report(&mut self, rank: usize, msg: &[u8]) -> Result<(), SyncError> {
        let (h, body) = Header::parse(msg).map_err(|e| SyncError::HandshakeMessage {
            message: format!("report from receiver rank {rank}"),
            source: e.into(),
        })?;
        match h.kind {
            Kind::Applied => {
                self.reports.applied.insert(rank, h.stamp());
            }
            Kind::Declined => {
                *self.reports.declined.entry(rank).or_insert(0) += 1;
                self.reports.last_declined = Some(Declined {
                    rank,
                    version: h.version,
                    sequence: h.sequence,
                    reason: wire::decode_abort(body),
                });
            }
            _ => {}
        }
        Ok(())
    }

    /// The checksum each receiver should report ([`SyncReceiver::checksum`]), i.e. of the synced keys as the
    /// receivers hold them (patch: the snapshot; bucket: `state` cast to the receivers' dtypes through the wire
    /// dtype).
    pub fn checksum(&self, state: &StateDict) -> Result<u64, SyncError> {
        match &self.strategy {
            SenderStrategy::Patch(p) => {
                if let Some(c) = self.rejoin.cached_checksum(self.last.sequence) {
                    return Ok(c);
                }
                // Not hashed in the background (no replay log): on the syncer's threads now.
                let c = rejoin::snapshot_checksum(&p.snap, &self.rejoin.meta, self.rejoin.threads);
                self.rejoin.cache_checksum(self.last.sequence, c);
                Ok(c)
            }
            SenderStrategy::Bucket(_) => {
                let mut h = StateHasher::new();
                for (key, &rd) in self.synced_keys.iter().zip(&self.recv_dtypes) {
                    let t = state.get(key).ok_or_else(|| missing_key(key))?;
                    h.begin_tensor(key, rd, t.shape());
                    hash_cast(
                        &mut h,
                        t.bytes(),
                        t.dtype(),
                        self.wire_dtype(t.dtype(), rd),
                        rd,
                    );
                }
                Ok(h.finish())
            }
        }
    }
}

impl PatchSender {
    /// One patch from `base` to `next`: diff against the snapshot, encode, send, and log it for rejoins.
    async fn sync(
        &mut self,
        ch: &mut transport::Sender,
        settings: &Settings,
        rejoin: &mut rejoin::RejoinInfo,
        base: Stamp,
        state: &StateDict,
        next: Stamp,
    ) -> Result<SyncReport, SyncError> {
        let PatchSender {
            snap: shared,
            built,
            builder,
        } = self;
        // The log needs the checksum of the base (the snapshot before this build): normally computed in the
        // background since the last sync (finished here), else now. The thread is gone before the build.
        rejoin.release();
        let base_checksum = rejoin.log.is_enabled().then(|| {
            rejoin.cached_checksum(base.sequence).unwrap_or_else(|| {
                let c =
                    blocking(|| rejoin::snapshot_checksum(shared, &rejoin.meta, rejoin.threads));
                rejoin.cache_checksum(base.sequence, c);
                c
            })
        });
        // No background checksum holds the snapshot any more (released above).
        let snap = Arc::get_mut(shared).ok_or_else(|| SyncError::StateMismatch {
            key: "(snapshot)".into(),
            reason: "the snapshot is still being read by a checksum thread".into(),
        })?;
        // A version travels as parts of whole tensors: each is built, coded and sent in turn, so receivers
        // validate and install part k while this builds part k + 1. A device builder diffs all at once.
        let parts = match builder {
            Some(_) => std::iter::once(0..snap.len()).collect(),
            None => {
                patch::check_sources(snap, state).map_err(|reason| SyncError::StateMismatch {
                    key: "(synced keys)".into(),
                    reason,
                })?;
                patch::part_ranges(snap, settings.patch_part_bytes)
            }
        };
        let count = u32::try_from(parts.len()).map_err(|_| SyncError::Config {
            reason: "more than 2^32 patch parts".into(),
        })?;
        built.resize_with(parts.len(), patch::Built::default);
        let mut report = SyncReport {
            kind: SyncKind::Patch,
            state_bytes: snap.iter().map(|t| t.storage.len() as u64).sum(),
            messages: count,
            ..Default::default()
        };
        let (mut raw, mut stored) = (0usize, 0usize);
        let mut msgs = Vec::with_capacity(parts.len());
        for (k, range) in parts.iter().enumerate() {
            let (part, b) = (&mut snap[range.clone()], &mut built[k]);
            let t0 = Instant::now();
            match builder {
                Some(builder) => blocking(|| builder.build(part, state, settings.threads, b))?,
                None => blocking(|| patch::build(part, state, settings.threads, b)).map_err(
                    |reason| SyncError::StateMismatch {
                        key: "(synced keys)".into(),
                        reason,
                    },
                )?,
            }
            report.build += t0.elapsed();
            let t1 = Instant::now();
            let (enc, tensors, dense) = blocking(|| {
                let mut h = Header::stamped(Kind::Patch, next, 0);
                h.aux = base.sequence;
                h.seq = k as u32;
                h.count = count;
                patch::encode_message(b, part, settings.delta, settings.threads, h, settings.codec)
            });
            report.encode += t1.elapsed();
            report.changed += b.changed;
            report.tensors += tensors;
            report.dense_segments += dense;
            raw += enc.raw_stream_bytes;
            stored += enc.stored_stream_bytes;
            let t2 = Instant::now();
            if let Err(e) = ch.send(&enc.msg).await {
                // The snapshot must hold `next` whole (the caller counts it as sent): build the rest unsent.
                for (later, b) in parts.iter().zip(built.iter_mut()).skip(k + 1) {
                    let part = &mut snap[later.clone()];
                    let _ = blocking(|| patch::build(part, state, settings.threads, b));
                }
                return Err(e.into());
            }
            report.transfer += t2.elapsed();
            report.payload_bytes += enc.msg.len() as u64;
            msgs.push(enc.msg);
        }
        report.compression_ratio = if stored == 0 {
            1.0
        } else {
            raw as f64 / stored as f64
        };
        if let Some(c) = base_checksum {
            rejoin.log.push(base, next, c, msgs);
            // The next sync's base: hashed while the caller goes on (its next training step).
            rejoin.checksum_in_background(next.sequence, shared);
        }
        Ok(report)
    }
}

impl BucketSender {
    /// One version as buckets of every synced tensor (and, with `keep_last`, a copy of what was sent).
    async fn sync(
        &mut self,
        ch: &mut transport::Sender,
        settings: &Settings,
        state: &StateDict,
        next: Stamp,
    ) -> Result<SyncReport, SyncError> {
        let BucketSender {
            buckets,
            manifest,
            last,
            stager,
        } = self;
        let mut manifest_bytes = 0;
        if let Some(keys) = manifest {
            // Checked before the manifest goes out: a version is not announced that cannot be sent.
            bucket::check_sources(state, buckets)?;
            let msg = wire::encode_manifest(keys, next, buckets.len() as u32);
            manifest_bytes = msg.len() as u64;
            ch.send(&msg).await?;
        }
        // With `keep_last` the copy kept for rejoins is read from the host view, so the binding stages that
        // sync on the host as before.
        let mut stats = match stager {
            Some(stager) if !settings.keep_last => {
                let (kind, part) = (Kind::Bucket, settings.part_bytes);
                bucket::device::send_device(ch, stager.as_mut(), state, buckets, kind, next, part)
                    .await?
            }
            _ => bucket::send(ch, state, buckets, Kind::Bucket, next, settings.part_bytes).await?,
        };
        if manifest_bytes > 0 {
            stats.payload_bytes += manifest_bytes;
            stats.messages += 1;
        }
        if settings.keep_last {
            blocking(|| keep_copy(last, buckets, state))?;
        }
        Ok(SyncReport {
            kind: SyncKind::Bucket,
            payload_bytes: stats.payload_bytes,
            changed: elements(buckets),
            tensors: buckets.iter().map(Vec::len).sum(),
            messages: stats.messages,
            encode: stats.fill,
            transfer: stats.wait,
            compression_ratio: 1.0,
            ..Default::default()
        })
    }
}

/// Whether an upstream message is a receiver's report (not a rejoin's request).
fn is_report(msg: &[u8]) -> bool {
    Header::parse_unverified(msg)
        .is_ok_and(|(h, _)| matches!(h.kind, Kind::Applied | Kind::Declined))
}

impl From<Refusal> for SyncError {
    fn from(refusal: Refusal) -> SyncError {
        match refusal {
            Refusal::Handshake(reason) => SyncError::Handshake { reason },
            Refusal::Config(reason) => SyncError::Config { reason },
        }
    }
}

/// Copy the bytes of every planned tensor of `state` into `last` (buffers reused from the previous version).
fn keep_copy(
    last: &mut Vec<Vec<Vec<u8>>>,
    buckets: &[Vec<Planned>],
    state: &StateDict,
) -> Result<(), SyncError> {
    last.resize_with(buckets.len(), Vec::new);
    for (bucket, copies) in buckets.iter().zip(last.iter_mut()) {
        copies.resize_with(bucket.len(), Vec::new);
        for (p, copy) in bucket.iter().zip(copies.iter_mut()) {
            let t = state.get(&p.key).ok_or_else(|| missing_key(&p.key))?;
            copy.clear();
            copy.extend_from_slice(t.bytes());
        }
    }
    Ok(())
}

async fn abort(ch: &mut transport::Sender, reason: &str) {
    // Best effort: receivers that cannot be told will time out on their own.
    let _ = ch.send(&wire::encode_abort(reason)).await;
}

#[cfg(test)]
impl SyncSender {
    /// For tests outside the syncer: send each patch version as parts of about `patch_part_bytes` of state
    /// and each bucket as messages of `part_bytes`, to cover versions that arrive in many parts.
    pub(crate) fn set_part_sizes(&mut self, patch_part_bytes: usize, part_bytes: usize) {
        self.settings.patch_part_bytes = patch_part_bytes;
        self.settings.part_bytes = part_bytes;
    }
}
